//! Who asks: an aggregated API server trusts the user the API server's
//! front proxy names in request headers, and only when the connection
//! carries a client certificate of the front proxy's CA with an allowed
//! name. The API server publishes which CA, names and headers in the
//! ConfigMap `kube-system/extension-apiserver-authentication`.

use serde::Serialize;
use std::collections::BTreeMap;

/// The ConfigMap and its keys.
pub const CONFIGMAP_NAMESPACE: &str = "kube-system";
pub const CONFIGMAP_NAME: &str = "extension-apiserver-authentication";

/// The headers kvirtds forward a user to each other with: the API server's
/// defaults, so a peer reads them as it reads the front proxy's.
pub const USER_HEADER: &str = "X-Remote-User";
pub const UID_HEADER: &str = "X-Remote-Uid";
pub const GROUP_HEADER: &str = "X-Remote-Group";
pub const EXTRA_PREFIX: &str = "X-Remote-Extra-";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestHeader {
    /// PEM of the CA the front proxy's client certificate chains to.
    pub client_ca: String,
    /// Common names the certificate may carry; empty: any of that CA.
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
    pub uid_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_prefixes: Vec<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestHeaderError {
    #[error("{CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME} has no requestheader-client-ca-file: the API server runs without --requestheader-client-ca-file, so no aggregated API can authenticate its users")]
    NoClientCa,
    #[error(
        "{CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME}: {key} is not a JSON list of strings: {value:?}"
    )]
    List { key: &'static str, value: String },
}

/// A user, as a SubjectAccessReview names one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

impl RequestHeader {
    /// From the ConfigMap's data.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self, RequestHeaderError> {
        let client_ca = data
            .get("requestheader-client-ca-file")
            .filter(|s| !s.trim().is_empty())
            .ok_or(RequestHeaderError::NoClientCa)?
            .clone();
        let list = |key: &'static str| -> Result<Vec<String>, RequestHeaderError> {
            match data.get(key) {
                None => Ok(vec![]),
                Some(v) if v.trim().is_empty() => Ok(vec![]),
                Some(v) => serde_json::from_str(v).map_err(|_| RequestHeaderError::List {
                    key,
                    value: v.clone(),
                }),
            }
        };
        Ok(Self {
            client_ca,
            allowed_names: list("requestheader-allowed-names")?,
            username_headers: list("requestheader-username-headers")?,
            uid_headers: list("requestheader-uid-headers")?,
            group_headers: list("requestheader-group-headers")?,
            extra_prefixes: list("requestheader-extra-headers-prefix")?,
        })
    }

    /// How kvirtds read each other's forwarded users.
    pub fn peers() -> Self {
        Self {
            client_ca: String::new(),
            allowed_names: vec![],
            username_headers: vec![USER_HEADER.into()],
            uid_headers: vec![UID_HEADER.into()],
            group_headers: vec![GROUP_HEADER.into()],
            extra_prefixes: vec![EXTRA_PREFIX.into()],
        }
    }

    /// Whether a certificate of the CA with this common name may name users.
    pub fn allows(&self, common_name: &str) -> bool {
        self.allowed_names.is_empty() || self.allowed_names.iter().any(|n| n == common_name)
    }

    /// The user the headers name; `None` without a user name.
    pub fn user(&self, headers: &[(&str, &str)]) -> Option<User> {
        let values = |names: &[String]| -> Vec<String> {
            headers
                .iter()
                .filter(|(h, _)| names.iter().any(|n| n.eq_ignore_ascii_case(h)))
                .map(|(_, v)| (*v).to_owned())
                .collect()
        };
        // The first configured header that has a value names the user.
        let name = self.username_headers.iter().find_map(|n| {
            values(std::slice::from_ref(n))
                .into_iter()
                .find(|v| !v.is_empty())
        })?;
        let uid = self
            .uid_headers
            .iter()
            .find_map(|n| values(std::slice::from_ref(n)).into_iter().next())
            .unwrap_or_default();
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for &(h, v) in headers {
            let Some(key) = self.extra_prefixes.iter().find_map(|p| {
                (h.len() > p.len() && h[..p.len()].eq_ignore_ascii_case(p)).then(|| &h[p.len()..])
            }) else {
                continue;
            };
            extra
                .entry(unescape(&key.to_ascii_lowercase()))
                .or_default()
                .push(v.to_owned());
        }
        Some(User {
            name,
            uid,
            groups: values(&self.group_headers),
            extra,
        })
    }
}

impl User {
    /// The headers that carry this user to a peer (the API server's own
    /// encoding: extra keys percent-escaped).
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut h = vec![(USER_HEADER.to_owned(), self.name.clone())];
        if !self.uid.is_empty() {
            h.push((UID_HEADER.to_owned(), self.uid.clone()));
        }
        h.extend(
            self.groups
                .iter()
                .map(|g| (GROUP_HEADER.to_owned(), g.clone())),
        );
        for (k, vs) in &self.extra {
            let name = format!("{EXTRA_PREFIX}{}", escape(k));
            h.extend(vs.iter().map(|v| (name.clone(), v.clone())));
        }
        h
    }
}

/// Every header a request may carry a user in, under any configuration:
/// removed from what a client sent before a user is set.
pub fn is_user_header(name: &str, config: &RequestHeader) -> bool {
    let any = |names: &[String]| names.iter().any(|n| n.eq_ignore_ascii_case(name));
    let prefixed = |p: &String| name.len() >= p.len() && name[..p.len()].eq_ignore_ascii_case(p);
    any(&config.username_headers)
        || any(&config.uid_headers)
        || any(&config.group_headers)
        || config.extra_prefixes.iter().any(prefixed)
        || [USER_HEADER, UID_HEADER, GROUP_HEADER]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
        || (name.len() >= EXTRA_PREFIX.len()
            && name[..EXTRA_PREFIX.len()].eq_ignore_ascii_case(EXTRA_PREFIX))
}

/// Header names are tokens: the API server percent-escapes extra keys.
fn escape(key: &str) -> String {
    let mut out = String::new();
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || b"-!#$&'*+.^_`|~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn unescape(key: &str) -> String {
    let b = key.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&key[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The ConfigMap's data as kube-apiserver writes it with kubeadm's flags,
/// for tests.
#[cfg(test)]
pub(crate) fn kubeadm_data(client_ca: &str) -> BTreeMap<String, String> {
    [
        ("requestheader-client-ca-file", client_ca),
        ("requestheader-allowed-names", "[\"front-proxy-client\"]"),
        ("requestheader-username-headers", "[\"X-Remote-User\"]"),
        ("requestheader-group-headers", "[\"X-Remote-Group\"]"),
        (
            "requestheader-extra-headers-prefix",
            "[\"X-Remote-Extra-\"]",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> BTreeMap<String, String> {
        kubeadm_data("-----BEGIN CERTIFICATE-----\n...")
    }

    #[test]
    fn the_configmap_names_ca_names_and_headers() {
        let rh = RequestHeader::from_data(&data()).unwrap();
        assert!(rh.allows("front-proxy-client") && !rh.allows("admin"));
        assert_eq!(rh.username_headers, ["X-Remote-User"]);
        let mut d = data();
        d.remove("requestheader-client-ca-file");
        assert_eq!(
            RequestHeader::from_data(&d).unwrap_err(),
            RequestHeaderError::NoClientCa
        );
        d = data();
        d.insert("requestheader-allowed-names".into(), "front-proxy".into());
        assert!(matches!(
            RequestHeader::from_data(&d),
            Err(RequestHeaderError::List { .. })
        ));
    }

    #[test]
    fn the_user_comes_from_the_configured_headers_only() {
        let rh = RequestHeader::from_data(&data()).unwrap();
        let headers = [
            ("x-remote-user", "alice"),
            ("X-Remote-Group", "devs"),
            ("X-Remote-Group", "system:authenticated"),
            ("X-Remote-Extra-Scopes%2fa", "s1"),
            ("X-Other-User", "mallory"),
        ];
        let u = rh.user(&headers).unwrap();
        assert_eq!(u.name, "alice");
        assert_eq!(u.groups, ["devs", "system:authenticated"]);
        assert_eq!(u.extra["scopes/a"], ["s1"]);
        assert!(rh.user(&[("X-Other-User", "mallory")]).is_none());
    }

    #[test]
    fn a_forwarded_user_reads_back_the_same() {
        let u = User {
            name: "bob".into(),
            uid: "42".into(),
            groups: vec!["g1".into(), "g2".into()],
            extra: [("scopes/a b".to_owned(), vec!["x".to_owned()])].into(),
        };
        let h = u.headers();
        let back = RequestHeader::peers()
            .user(
                &h.iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect::<Vec<_>>(),
            )
            .unwrap();
        assert_eq!(back, u);
        assert!(h
            .iter()
            .all(|(k, _)| is_user_header(k, &RequestHeader::peers())));
        assert!(!is_user_header("Authorization", &RequestHeader::peers()));
    }
}
