//! `imagePullSecret`: registry credentials from a Secret of type
//! `kubernetes.io/dockerconfigjson` (`.dockerconfigjson`) or the older
//! `kubernetes.io/dockercfg` (`.dockercfg`), matched to an image as kubelet
//! matches them: by registry host (a `*` may stand for one DNS label) and
//! repository path prefix, the most specific entry first.

use crate::core::objects::ObjectData;
use serde::Deserialize;
use std::collections::BTreeMap;

/// A user name and password for one registry; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({:?}, <password>)", self.username)
    }
}

#[derive(Deserialize)]
struct DockerConfig {
    #[serde(default)]
    auths: BTreeMap<String, Entry>,
}

#[derive(Deserialize)]
struct Entry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// Docker Hub's names: keys written for one are meant for all.
const DOCKER_HUB: &[&str] = &["docker.io", "index.docker.io", "registry-1.docker.io"];

/// The credentials of the secret's most specific entry for `repository` on
/// `registry` (`host[:port]`), `None` when no entry matches (the pull is
/// then anonymous, as kubelet's). Errors say what is wrong with the secret,
/// never what is in it.
pub fn credentials(
    data: &ObjectData,
    registry: &str,
    repository: &str,
) -> Result<Option<Credentials>, String> {
    let entries = if let Some(json) = data.get(".dockerconfigjson") {
        serde_json::from_slice::<DockerConfig>(json)
            .map_err(|e| format!(".dockerconfigjson is not a Docker config: {e}"))?
            .auths
    } else if let Some(json) = data.get(".dockercfg") {
        serde_json::from_slice(json)
            .map_err(|e| format!(".dockercfg is not a Docker config: {e}"))?
    } else {
        return Err("has neither .dockerconfigjson nor .dockercfg".into());
    };
    let best = entries
        .iter()
        .filter_map(|(key, e)| Some((matches(key, registry, repository)?, key, e)))
        .max_by_key(|(specificity, ..)| *specificity);
    let Some((_, key, e)) = best else {
        return Ok(None);
    };
    let (username, password) = match (&e.username, &e.password, &e.auth) {
        (Some(u), Some(p), _) => (u.clone(), p.clone()),
        (_, _, Some(auth)) => {
            use base64::Engine as _;
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok())
                .ok_or_else(|| format!("the auth of {key:?} is not base64 of user:password"))?;
            let (u, p) = decoded
                .split_once(':')
                .ok_or_else(|| format!("the auth of {key:?} is not base64 of user:password"))?;
            (u.to_owned(), p.to_owned())
        }
        _ => {
            return Err(format!(
                "{key:?} has neither auth nor username and password"
            ))
        }
    };
    Ok(Some(Credentials { username, password }))
}

/// How specifically `key` names `repository` on `registry`, or `None`.
fn matches(key: &str, registry: &str, repository: &str) -> Option<usize> {
    let key = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key)
        .trim_end_matches('/');
    let (host, path) = key.split_once('/').unwrap_or((key, ""));
    let hub = |h: &str| DOCKER_HUB.contains(&h);
    // Docker Hub's keys carry the API version as a path.
    let path = if hub(host) && matches!(path, "v1" | "v2") {
        ""
    } else {
        path
    };
    let host_ok = host_matches(host, registry) || (hub(host) && hub(registry));
    let path_ok =
        path.is_empty() || repository == path || repository.starts_with(&format!("{path}/"));
    (host_ok && path_ok).then_some(host.len() + path.len())
}

/// Hosts (with ports) match label by label; a `*` label matches any one.
fn host_matches(pattern: &str, host: &str) -> bool {
    let (p_name, p_port) = pattern.split_once(':').unwrap_or((pattern, ""));
    let (h_name, h_port) = host.split_once(':').unwrap_or((host, ""));
    let p: Vec<&str> = p_name.split('.').collect();
    let h: Vec<&str> = h_name.split('.').collect();
    p_port == h_port
        && p.len() == h.len()
        && p.iter()
            .zip(&h)
            .all(|(a, b)| *a == "*" || a.eq_ignore_ascii_case(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(key: &str, json: &str) -> ObjectData {
        ObjectData::from([(key.to_string(), json.as_bytes().to_vec())])
    }

    fn user(data: &ObjectData, registry: &str, repo: &str) -> Option<String> {
        credentials(data, registry, repo)
            .unwrap()
            .map(|c| c.username)
    }

    #[test]
    fn the_most_specific_matching_entry_wins() {
        // "dXNlcjpwYXNz" is "user:pass".
        let s = secret(
            ".dockerconfigjson",
            r#"{"auths": {
                "registry.example:5000": {"auth": "dXNlcjpwYXNz"},
                "registry.example:5000/team": {"username": "team", "password": "p"},
                "*.corp.example": {"username": "wild", "password": "p"},
                "https://index.docker.io/v1/": {"username": "hub", "password": "p"}
            }}"#,
        );
        let c = credentials(&s, "registry.example:5000", "other/disk").unwrap();
        assert_eq!(
            c,
            Some(Credentials {
                username: "user".into(),
                password: "pass".into()
            })
        );
        assert_eq!(
            user(&s, "registry.example:5000", "team/disk").as_deref(),
            Some("team")
        );
        assert_eq!(
            user(&s, "registry.example:5000", "teamx/disk").as_deref(),
            Some("user")
        );
        assert_eq!(
            user(&s, "registry.example", "x"),
            None,
            "the port is part of the host"
        );
        assert_eq!(user(&s, "quay.corp.example", "x").as_deref(), Some("wild"));
        assert_eq!(user(&s, "a.quay.corp.example", "x"), None);
        assert_eq!(
            user(&s, "index.docker.io", "library/x").as_deref(),
            Some("hub")
        );
        assert_eq!(user(&s, "quay.io", "x"), None);
    }

    #[test]
    fn the_old_dockercfg_format_is_read_too() {
        let s = secret(".dockercfg", r#"{"quay.io": {"auth": "dXNlcjpwYXNz"}}"#);
        assert_eq!(user(&s, "quay.io", "org/disk").as_deref(), Some("user"));
    }

    #[test]
    fn a_broken_secret_says_what_is_wrong_and_never_what_is_in_it() {
        let err = |s: ObjectData| credentials(&s, "quay.io", "x").unwrap_err();
        assert_eq!(
            err(secret("password", "x")),
            "has neither .dockerconfigjson nor .dockercfg"
        );
        assert!(err(secret(".dockerconfigjson", "{")).starts_with(".dockerconfigjson is not"));
        let e = err(secret(
            ".dockerconfigjson",
            r#"{"auths": {"quay.io": {"auth": "c2VjcmV0"}}}"#,
        ));
        assert_eq!(e, "the auth of \"quay.io\" is not base64 of user:password");
        assert!(!e.contains("secret"));
        let c = Credentials {
            username: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
