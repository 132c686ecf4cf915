//! A host's own identity in a cluster, got by TLS bootstrap as kubelet
//! gets its: a key made here (never leaving the host, root's alone), a
//! certificate request for `kvirt:node:<node>` sent with a bootstrap
//! credential, and once a joined kvirtd (or an administrator) approved it
//! and kube-controller-manager signed it, the node kubeconfig written whole.
//!
//! A crash can come at any line: the key waits in `<kubeconfig>.pending-key`
//! until the kubeconfig holding it is written, and the request's name comes
//! from that key, so the next start finds the request it made before
//! (never a second identity, never a request left behind for nothing).

use crate::core::csr::{node_user, request_name, NODES_GROUP, NODE_USER_PREFIX};
use crate::host::commit::replace_private;
use crate::sources::cluster::csr::{self, CsrError};
use base64::Engine as _;
use rcgen::PublicKeyData as _;
use std::path::{Path, PathBuf};
use x509_parser::oid_registry::{OID_X509_COMMON_NAME, OID_X509_ORGANIZATION_NAME};
use x509_parser::prelude::{FromDer, X509Certificate};

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Kubeconfig { path: PathBuf, message: String },
    #[error("the node key: {0}")]
    Key(String),
    #[error(transparent)]
    Request(#[from] CsrError),
    #[error("the certificate issued for {request}: {message}")]
    Issued { request: String, message: String },
}

fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> JoinError + 'a {
    move |source| JoinError::Io {
        path: path.into(),
        op,
        source,
    }
}

/// Where the node's credentials live.
#[derive(Clone, Debug)]
pub struct Files {
    /// The node kubeconfig kvirtd connects with (key and certificate inline).
    pub kubeconfig: PathBuf,
    /// The credential that asks for the first one (a bootstrap token).
    pub bootstrap: PathBuf,
}

impl Files {
    /// Where the configuration puts them.
    pub fn of(k: &crate::daemon::config::KubernetesConfig) -> Files {
        Files {
            kubeconfig: k.kubeconfig.clone(),
            bootstrap: k.bootstrap_kubeconfig.clone(),
        }
    }

    /// The key of a request not yet answered.
    pub fn pending_key(&self) -> PathBuf {
        let mut name = self.kubeconfig.clone().into_os_string();
        name.push(".pending-key");
        name.into()
    }
}

/// A client certificate as kvirtd needs to know it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub user: String,
    pub groups: Vec<String>,
    /// Validity, in seconds since the epoch.
    pub not_before: i64,
    pub not_after: i64,
    pub public_key_der: Vec<u8>,
}

impl Held {
    /// Whether it is `node`'s identity and valid at `now`.
    pub fn serves(&self, node: &str, now: i64) -> bool {
        self.user == node_user(node)
            && self.groups.iter().any(|g| g == NODES_GROUP)
            && self.not_before <= now
            && now < self.not_after
    }
}

/// Whether a new identity must be asked for at start: the node kubeconfig
/// is missing, or holds a kvirt identity that no longer serves this node
/// (run out). A kubeconfig of another kind (an administrator's, for the
/// first host) is used as it is: the client says what is wrong with it.
pub fn needed(files: &Files, node: &str, now: i64) -> Result<bool, JoinError> {
    Ok(match current(&files.kubeconfig) {
        Ok(None) => true,
        Ok(Some(h)) => h.user.starts_with(NODE_USER_PREFIX) && !h.serves(node, now),
        Err(_) => false,
    })
}

/// Reads a PEM certificate.
pub fn held(pem: &[u8]) -> Result<Held, String> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem).map_err(|e| format!("not PEM: {e}"))?;
    let (_, c) = X509Certificate::from_der(&p.contents).map_err(|e| format!("not X.509: {e}"))?;
    let texts = |oid| -> Vec<String> {
        (c.subject().iter_attributes())
            .filter(|a| a.attr_type() == &oid)
            .filter_map(|a| a.as_str().ok().map(String::from))
            .collect()
    };
    Ok(Held {
        user: texts(OID_X509_COMMON_NAME)
            .into_iter()
            .next()
            .unwrap_or_default(),
        groups: texts(OID_X509_ORGANIZATION_NAME),
        not_before: c.validity().not_before.timestamp(),
        not_after: c.validity().not_after.timestamp(),
        public_key_der: c.public_key().raw.to_vec(),
    })
}

/// The client certificate of a kubeconfig's current user, if it has one
/// inline; `Ok(None)` if the file is not there.
pub fn current(kubeconfig: &Path) -> Result<Option<Held>, JoinError> {
    if std::fs::symlink_metadata(kubeconfig).is_err() {
        return Ok(None);
    }
    let bad = |message: String| JoinError::Kubeconfig {
        path: kubeconfig.into(),
        message,
    };
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| bad(e.to_string()))?;
    let user = current_user(&kc).ok_or_else(|| bad("no current user".into()))?;
    let data = user
        .client_certificate_data
        .as_deref()
        .ok_or_else(|| bad("its user has no client-certificate-data".into()))?;
    let pem = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| bad(format!("client-certificate-data: {e}")))?;
    held(&pem).map(Some).map_err(bad)
}

fn current_context(kc: &kube::config::Kubeconfig) -> Option<&kube::config::Context> {
    let name = kc.current_context.as_deref()?;
    (kc.contexts.iter().find(|c| c.name == name))?
        .context
        .as_ref()
}

fn current_user(kc: &kube::config::Kubeconfig) -> Option<&kube::config::AuthInfo> {
    let name = current_context(kc)?.user.as_deref()?;
    (kc.auth_infos.iter().find(|u| u.name == name))?
        .auth_info
        .as_ref()
}

fn current_cluster(kc: &kube::config::Kubeconfig) -> Option<&kube::config::Cluster> {
    let name = &current_context(kc)?.cluster;
    (kc.clusters.iter().find(|c| &c.name == name))?
        .cluster
        .as_ref()
}

/// The pending key: the one a request is out for, or a new one (written
/// before any request names it).
fn pending_key(files: &Files) -> Result<rcgen::KeyPair, JoinError> {
    let path = files.pending_key();
    match std::fs::read_to_string(&path) {
        Ok(pem) => rcgen::KeyPair::from_pem(&pem).map_err(|e| JoinError::Key(e.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = rcgen::KeyPair::generate().map_err(|e| JoinError::Key(e.to_string()))?;
            replace_private(&path, key.serialize_pem().as_bytes()).map_err(io(&path, "write"))?;
            Ok(key)
        }
        Err(e) => Err(io(&path, "read")(e)),
    }
}

/// The PKCS#10 request for `node`'s identity with `key`.
fn request_pem(node: &str, key: &rcgen::KeyPair) -> Result<String, JoinError> {
    let key_err = |e: rcgen::Error| JoinError::Key(e.to_string());
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(key_err)?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name
        .push(rcgen::DnType::OrganizationName, NODES_GROUP);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, node_user(node));
    p.serialize_request(key)
        .and_then(|r| r.pem())
        .map_err(key_err)
}

/// How [`ensure`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Joined {
    /// The node kubeconfig was there and valid.
    Already,
    /// A new certificate was issued, by this request.
    Issued(String),
}

/// Makes sure `files.kubeconfig` holds a valid identity for `node`: if
/// not, asks for one with the credential of `with` (the bootstrap
/// kubeconfig, or for a renewal the node kubeconfig itself), for
/// `seconds`, and writes the node kubeconfig. `waiting` is told the
/// request's name while it waits for approval.
pub async fn ensure(
    files: &Files,
    with: &Path,
    node: &str,
    seconds: u32,
    now: i64,
    renew: bool,
    waiting: impl FnOnce(&str),
) -> Result<Joined, JoinError> {
    if !renew {
        if let Some(h) = current(&files.kubeconfig)? {
            if h.serves(node, now) {
                remove_pending(files)?;
                return Ok(Joined::Already);
            }
        }
    }
    let bad = |message: String| JoinError::Kubeconfig {
        path: with.into(),
        message,
    };
    let kc = kube::config::Kubeconfig::read_from(with).map_err(|e| bad(e.to_string()))?;
    let cluster = current_cluster(&kc)
        .cloned()
        .ok_or_else(|| bad("no current cluster".into()))?;
    let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| bad(e.to_string()))?;
    let client = kube::Client::try_from(config).map_err(|e| bad(e.to_string()))?;
    let key = pending_key(files)?;
    let name = request_name(node, &key.subject_public_key_info());
    let pem = request_pem(node, &key)?;
    let cert = match csr::request(client, node, &name, &pem, seconds, waiting).await {
        Ok(cert) => cert,
        Err(e @ (CsrError::Denied { .. } | CsrError::Failed { .. })) => {
            // That key's request is answered for good: the next try
            // starts from a new one.
            remove_pending(files)?;
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    let issued = |message: String| JoinError::Issued {
        request: name.clone(),
        message,
    };
    let h = held(cert.as_bytes()).map_err(issued)?;
    if h.public_key_der != key.subject_public_key_info() || !h.serves(node, h.not_before) {
        return Err(issued(format!(
            "it is {} of {:?} for another key, or not this node's",
            h.user, h.groups
        )));
    }
    let text = node_kubeconfig(&cluster, node, &cert, &key.serialize_pem());
    replace_private(&files.kubeconfig, text.as_bytes()).map_err(io(&files.kubeconfig, "write"))?;
    remove_pending(files)?;
    Ok(Joined::Issued(name))
}

fn remove_pending(files: &Files) -> Result<(), JoinError> {
    let path = files.pending_key();
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&path, "remove")(e)),
        _ => Ok(()),
    }
}

/// A self-contained kubeconfig: the cluster as the credential that asked
/// named it, the node's certificate and key inline.
fn node_kubeconfig(cluster: &kube::config::Cluster, node: &str, cert: &str, key: &str) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let mut c = format!(
        "    server: {}\n",
        cluster.server.as_deref().unwrap_or_default()
    );
    if let Some(ca) = &cluster.certificate_authority_data {
        c.push_str(&format!("    certificate-authority-data: {ca}\n"));
    }
    if let Some(ca) = &cluster.certificate_authority {
        c.push_str(&format!("    certificate-authority: {ca}\n"));
    }
    if let Some(n) = &cluster.tls_server_name {
        c.push_str(&format!("    tls-server-name: {n}\n"));
    }
    let user = node_user(node);
    format!(
        "# kvirt host {node}'s identity, written by kvirtd (TLS bootstrap).
apiVersion: v1
kind: Config
clusters:
- name: cluster
  cluster:
{c}users:
- name: \"{user}\"
  user:
    client-certificate-data: {cert}
    client-key-data: {key}
contexts:
- name: kvirt
  context:
    cluster: cluster
    user: \"{user}\"
current-context: kvirt
",
        cert = b64(cert),
        key = b64(key),
    )
}

/// The bootstrap kubeconfig `kvirtd join` writes: the API server, its CA,
/// and the token.
pub fn bootstrap_kubeconfig(server: &str, ca_pem: &[u8], token: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem);
    format!(
        "# A bootstrap token: asks for this host's identity once, then unused.
apiVersion: v1
kind: Config
clusters:
- name: cluster
  cluster:
    server: {server}
    certificate-authority-data: {ca}
users:
- name: bootstrap
  user:
    token: {token}
contexts:
- name: bootstrap
  context:
    cluster: cluster
    user: bootstrap
current-context: bootstrap
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed(node_cn: &str, orgs: &[&str], key: &rcgen::KeyPair, days: i64) -> String {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::from_ca_cert_pem(&ca_cert.pem(), ca_key).unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for o in orgs {
            p.distinguished_name
                .push(rcgen::DnType::OrganizationName, *o);
        }
        p.distinguished_name
            .push(rcgen::DnType::CommonName, node_cn);
        p.not_before = rcgen::date_time_ymd(2020, 1, 1);
        p.not_after = if days > 0 {
            rcgen::date_time_ymd(2099, 1, 1)
        } else {
            rcgen::date_time_ymd(2021, 1, 1)
        };
        p.signed_by(key, &issuer).unwrap().pem()
    }

    fn time_now() -> i64 {
        jiff::Timestamp::now().as_second()
    }

    #[test]
    fn a_written_node_kubeconfig_reads_back_as_the_nodes_identity() {
        let t = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = signed("kvirt:node:node-b", &[NODES_GROUP], &key, 1);
        let cluster = kube::config::Cluster {
            server: Some("https://10.0.0.1:6443".into()),
            certificate_authority_data: Some("Q0E=".into()),
            ..Default::default()
        };
        let path = t.path().join("kubeconfig");
        std::fs::write(
            &path,
            node_kubeconfig(&cluster, "node-b", &cert, &key.serialize_pem()),
        )
        .unwrap();
        let h = current(&path).unwrap().unwrap();
        assert_eq!(h.user, "kvirt:node:node-b");
        assert_eq!(h.public_key_der, key.subject_public_key_info());
        assert!(h.serves("node-b", time_now()));
        assert!(!h.serves("node-a", time_now()));
        // An expired one, or one without the group, serves no one.
        let old = held(signed("kvirt:node:node-b", &[NODES_GROUP], &key, 0).as_bytes()).unwrap();
        assert!(!old.serves("node-b", time_now()));
        let bare = held(signed("kvirt:node:node-b", &[], &key, 1).as_bytes()).unwrap();
        assert!(!bare.serves("node-b", time_now()));
        assert_eq!(current(&t.path().join("none")).unwrap(), None);
    }

    #[test]
    fn the_pending_key_outlives_a_crash_and_names_the_same_request() {
        let t = tempfile::tempdir().unwrap();
        let files = Files {
            kubeconfig: t.path().join("kubeconfig"),
            bootstrap: t.path().join("bootstrap"),
        };
        let first = pending_key(&files).unwrap();
        let again = pending_key(&files).unwrap();
        assert_eq!(
            request_name("n", &first.subject_public_key_info()),
            request_name("n", &again.subject_public_key_info())
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(files.pending_key())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let pem = request_pem("n", &first).unwrap();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
        remove_pending(&files).unwrap();
        remove_pending(&files).unwrap();
        assert_ne!(
            request_name("n", &first.subject_public_key_info()),
            request_name("n", &pending_key(&files).unwrap().subject_public_key_info())
        );
    }
}
