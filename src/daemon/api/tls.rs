//! The TLS of kvirtd's API port: its serving certificate, and which client
//! certificates it accepts. Two kinds of caller may present one: the API
//! server's front proxy (its CA from `extension-apiserver-authentication`)
//! and other kvirtds forwarding a user (kvirt's own CA). A caller without
//! a certificate still completes the handshake, so that it is answered
//! 401 as Kubernetes answers, but is never trusted with a user.

use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name every kvirtd's serving certificate carries: what the API
/// server's aggregator checks (`<service>.<namespace>.svc`).
pub const SERVICE_NAME: &str = "kvirt-api.kvirt.svc";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {message}")]
    Invalid { what: String, message: String },
}

fn invalid(what: impl Into<String>) -> impl FnOnce(String) -> TlsError {
    let what = what.into();
    move |message| TlsError::Invalid { what, message }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.into(),
        source,
    })
}

pub fn certificates(pem: &[u8], what: &str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| invalid(what)(e.to_string()))?;
    if certs.is_empty() {
        return Err(invalid(what)("no PEM certificate".into()));
    }
    Ok(certs)
}

pub fn roots(pem: &[u8], what: &str) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for c in certificates(pem, what)? {
        store.add(c).map_err(|e| invalid(what)(e.to_string()))?;
    }
    Ok(Arc::new(store))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// This host's certificate, key and kvirt's CA, as configured.
#[derive(Clone)]
pub struct Identity {
    pub chain: Vec<CertificateDer<'static>>,
    key: Arc<PrivateKeyDer<'static>>,
    /// kvirt's CA: peers' certificates chain to it.
    pub peers: Arc<RootCertStore>,
}

impl PartialEq for Identity {
    fn eq(&self, other: &Self) -> bool {
        self.chain == other.chain
            && self.key.secret_der() == other.key.secret_der()
            && self.peers.roots == other.peers.roots
    }
}

impl Identity {
    pub fn load(cert: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let chain = certificates(&read(cert)?, &cert.display().to_string())?;
        let key = PrivateKeyDer::from_pem_slice(&read(key)?)
            .map_err(|e| invalid(key.display().to_string())(e.to_string()))?;
        let peers = roots(&read(ca)?, &ca.display().to_string())?;
        Ok(Self {
            chain,
            key: Arc::new(key),
            peers,
        })
    }

    /// The server side: this certificate, and client certificates of the
    /// front proxy's CA or kvirt's, optional.
    pub fn server_config(
        &self,
        front_proxy: Arc<RootCertStore>,
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let verifier = Arc::new(EitherCa {
            front_proxy: client_verifier(front_proxy)?,
            peers: client_verifier(self.peers.clone())?,
        });
        self.serving(verifier, b"http/1.1")
    }

    /// This host's certificate, served to clients `verifier` accepts,
    /// speaking `alpn`.
    fn serving(
        &self,
        verifier: Arc<dyn ClientCertVerifier>,
        alpn: &[u8],
    ) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("TLS versions")(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| invalid("api.cert and api.key")(e.to_string()))?;
        config.alpn_protocols = vec![alpn.to_vec()];
        Ok(Arc::new(config))
    }

    /// The client side, to another kvirtd: its certificate must chain to
    /// kvirt's CA and name the service; this host's certificate goes along.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("TLS versions")(e.to_string()))?
            .with_root_certificates(self.peers.clone())
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| invalid("api.cert and api.key")(e.to_string()))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The migration port's protocol: a TLS client of the API port (or any
/// other) is refused at the handshake, and the reverse.
pub const TUNNEL_ALPN: &[u8] = b"kvirt-migration/1";

impl Identity {
    /// The migration port: only a peer with a certificate of kvirt's CA
    /// completes the handshake (none is anonymous there).
    pub fn tunnel_server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.peers.clone(), provider())
            .build()
            .map_err(|e| invalid("client CA")(e.to_string()))?;
        self.serving(verifier, TUNNEL_ALPN)
    }

    /// The client side of the migration port, as [`Identity::client_config`].
    pub fn tunnel_client_config(&self) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let mut config = (*self.client_config()?).clone();
        config.alpn_protocols = vec![TUNNEL_ALPN.to_vec()];
        Ok(Arc::new(config))
    }
}

fn client_verifier(roots: Arc<RootCertStore>) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    WebPkiClientVerifier::builder_with_provider(roots, provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| invalid("client CA")(e.to_string()))
}

/// Who presented a certificate, once the handshake is done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Caller {
    /// The API server's front proxy, with the certificate's common name.
    FrontProxy(String),
    /// Another kvirtd.
    Peer,
    /// No certificate: gets 401.
    Anonymous,
}

/// Which CA the end-entity certificate chains to (the handshake already
/// checked that one of them does).
pub fn classify(
    chain: Option<&[CertificateDer<'_>]>,
    front_proxy: &Arc<RootCertStore>,
    peers: &Arc<RootCertStore>,
) -> Caller {
    let Some((ee, rest)) = chain.and_then(|c| c.split_first()) else {
        return Caller::Anonymous;
    };
    let chains_to = |roots: &Arc<RootCertStore>| {
        client_verifier(roots.clone())
            .is_ok_and(|v| v.verify_client_cert(ee, rest, UnixTime::now()).is_ok())
    };
    // kvirt's CA first: a cluster that signs both with one CA still tells
    // kvirtds apart by their certificate's name.
    if chains_to(peers) && common_name(ee).is_some_and(|cn| cn == SERVICE_NAME) {
        return Caller::Peer;
    }
    if chains_to(front_proxy) {
        return match common_name(ee) {
            Some(cn) => Caller::FrontProxy(cn),
            None => Caller::Anonymous,
        };
    }
    Caller::Anonymous
}

pub fn common_name(der: &CertificateDer<'_>) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

/// Accepts a client certificate of either CA.
#[derive(Debug)]
struct EitherCa {
    front_proxy: Arc<dyn ClientCertVerifier>,
    peers: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for EitherCa {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: Go's client then offers its certificate whatever CA
        // signed it.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.front_proxy
            .verify_client_cert(end_entity, intermediates, now)
            .or_else(|_| {
                self.peers
                    .verify_client_cert(end_entity, intermediates, now)
            })
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.front_proxy.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.front_proxy.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.front_proxy.supported_verify_schemes()
    }
}
