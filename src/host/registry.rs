//! The OCI distribution protocol as kvirt speaks it to a registry it does
//! not trust: every body it reads is bounded in size before it is kept
//! (manifests, indexes, token answers), error bodies are never read, and
//! no request reaches this host or its link unless the host lists it —
//! not through a name that resolves there, a token service the registry
//! names, nor a redirect.
//!
//! A pull opens a [`Session`] per image: the registry's challenge is asked
//! for once, a token fetched if it wants one, and only that pull uses it
//! (one VM's credentials never serve another's pull).

use crate::core::pullsecret::Credentials;
use oci_client::manifest::{
    OciDescriptor, OciImageIndex, OciImageManifest, IMAGE_MANIFEST_LIST_MEDIA_TYPE,
    IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE,
};
use oci_client::Reference;
use reqwest::header::{HeaderValue, ACCEPT, AUTHORIZATION, RANGE, WWW_AUTHENTICATE};
use reqwest::{StatusCode, Url};
use sha2::{Digest, Sha256};
use std::net::IpAddr;
use std::sync::Arc;

/// The largest manifest or index kvirt reads (containerd's bound too).
pub const MAX_MANIFEST: usize = 4 << 20;
/// The largest token answer kvirt reads.
pub const MAX_TOKEN: usize = 1 << 20;

/// What went wrong, told without anything the registry chose to say:
/// these texts reach a VMI's status.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("HTTP status {0}")]
    Status(u16),
    #[error("not authorized (HTTP status {0})")]
    Unauthorized(u16),
    #[error("image manifest not found")]
    NotFound,
    #[error("authentication failed (HTTP status {0})")]
    Authentication(u16),
    #[error("its {what} is larger than the {limit} bytes kvirt reads")]
    TooLarge { what: &'static str, limit: usize },
    #[error("its {0} cannot be parsed")]
    Parse(&'static str),
    #[error("an unsupported media type")]
    MediaType,
    #[error("an image index without a {0} image")]
    NoPlatform(String),
    #[error("its {what} arrived with digest {got}, not {want}")]
    Digest {
        what: &'static str,
        got: String,
        want: String,
    },
    #[error("its token service {0} is on this host or its link; kvirt asks such a service only when storage.local_registries lists it")]
    LocalRealm(String),
    #[error("its token service is not an http(s) address")]
    Realm,
    #[error("its token service is plain http, the registry https: credentials and tokens would travel in clear")]
    RealmDowngrade,
    #[error("{}", request_told(.0))]
    Request(#[source] reqwest::Error),
}

/// A transport failure as kvirt tells it: its kind, never a body.
fn request_told(e: &reqwest::Error) -> String {
    if let Some(status) = e.status() {
        format!("HTTP status {}", status.as_u16())
    } else if e.is_timeout() {
        "timed out".into()
    } else if e.is_redirect() {
        "a redirect kvirt does not follow (too many, or to this host or its link)".into()
    } else if e.is_connect() {
        "cannot connect (or the name resolves only to this host or its link)".into()
    } else {
        "the request failed".into()
    }
}

impl From<reqwest::Error> for RegistryError {
    fn from(e: reqwest::Error) -> Self {
        Self::Request(e)
    }
}

/// Whether an address is on this host or its link (a cloud's metadata
/// service at 169.254.169.254 is).
pub fn is_near(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_unicast_link_local()
                || v6
                    .to_ipv4_mapped()
                    .is_some_and(|v4| v4.is_loopback() || v4.is_link_local() || v4.is_unspecified())
        }
    }
}

/// Whether `host` (and `port`, if known) is one `storage.local_registries`
/// lists, as `host:port` or `host` for any port.
pub fn is_listed(host: &str, port: Option<u16>, local: &[String]) -> bool {
    local.iter().any(|l| {
        l == host
            || port.is_some_and(|p| *l == format!("{host}:{p}") || *l == format!("[{host}]:{p}"))
    })
}

/// An address of a URL that names this host or its link by itself
/// (`localhost`, an address literal) and is not listed.
fn near_literal(url: &Url, local: &[String]) -> Option<String> {
    let host = url
        .host_str()?
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port_or_known_default();
    if is_listed(host, port, local) {
        return None;
    }
    let near = host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| is_near(&ip));
    near.then(|| host.to_owned())
}

/// Names resolve as usual, less every address on this host or its link
/// unless the name is listed: a registry's own name, a token service or a
/// redirect cannot lead root to the host's services, nor can DNS answering
/// differently after kvirt's own check (rebinding).
struct FarOnly {
    local: Arc<Vec<String>>,
}

impl reqwest::dns::Resolve for FarOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        let listed = self.local.iter().any(|l| {
            l == &host
                || l.rsplit_once(':')
                    .is_some_and(|(h, p)| h == host && p.bytes().all(|b| b.is_ascii_digit()))
        });
        Box::pin(async move {
            let found: Vec<_> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| listed || !is_near(&a.ip()))
                .collect();
            if found.is_empty() {
                return Err(format!("{host} resolves only to this host or its link").into());
            }
            Ok(Box::new(found.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The HTTP side of pulls: one per kvirtd, its connections shared by every
/// pull (their tokens are not: see [`Session`]).
#[derive(Clone)]
pub struct RegistryClient {
    http: reqwest::Client,
    local: Arc<Vec<String>>,
}

impl RegistryClient {
    /// `local`: the registries on this host or its link that may be asked
    /// (`storage.local_registries`).
    pub fn new(local: Vec<String>) -> Self {
        // reqwest is built without a TLS provider of its own: use ring, as kube does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let local = Arc::new(local);
        let redirects = local.clone();
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(30))
            .read_timeout(std::time::Duration::from_secs(60))
            .user_agent(concat!("kvirt/", env!("CARGO_PKG_VERSION")))
            .dns_resolver(Arc::new(FarOnly {
                local: local.clone(),
            }))
            .redirect(reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() >= 5 {
                    attempt.error("too many redirects")
                } else if let Some(host) = near_literal(attempt.url(), &redirects) {
                    attempt.error(format!("a redirect to {host}"))
                } else {
                    attempt.follow()
                }
            }))
            .build()
            // Only a TLS back end that cannot start fails here: nothing a
            // registry or a VMI can cause.
            .expect("an HTTP client");
        Self { http, local }
    }

    /// Opens a pull of `r` over `scheme` (`http` or `https`): asks the
    /// registry how it wants to be spoken to and fetches a token if it
    /// wants one.
    pub async fn session(
        &self,
        scheme: &str,
        r: &Reference,
        auth: Option<&Credentials>,
    ) -> Result<Session, RegistryError> {
        let base = format!("{scheme}://{}/v2/", r.resolve_registry());
        let mut session = Session {
            http: self.http.clone(),
            base: base.clone(),
            repository: r.repository().to_owned(),
            authorization: None,
        };
        let ping = self.http.get(&base).send().await?;
        if ping.status() != StatusCode::UNAUTHORIZED {
            return Ok(session);
        }
        let challenge = ping
            .headers()
            .get(WWW_AUTHENTICATE)
            .and_then(|v| v.to_str().ok())
            .map(Challenge::parse);
        session.authorization = match (challenge, auth) {
            (Some(Challenge::Bearer { realm, service }), _) => {
                let realm = realm_url(scheme, &realm, &self.local)?;
                let token = self.token(realm, service.as_deref(), r, auth).await?;
                header(&format!("Bearer {token}"))
            }
            (_, Some(c)) => header(&basic(c)),
            // Anonymous: the requests themselves will be refused, and say so.
            (_, None) => None,
        };
        Ok(session)
    }

    /// A pull token from the service the registry named.
    async fn token(
        &self,
        mut url: Url,
        service: Option<&str>,
        r: &Reference,
        auth: Option<&Credentials>,
    ) -> Result<String, RegistryError> {
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("scope", &format!("repository:{}:pull", r.repository()));
            if let Some(s) = service {
                q.append_pair("service", s);
            }
        }
        let mut request = self.http.get(url);
        if let Some(c) = auth {
            request = request.basic_auth(&c.username, Some(&c.password));
        }
        let response = request.send().await?;
        let status = response.status();
        if !status.is_success() {
            return Err(RegistryError::Authentication(status.as_u16()));
        }
        let body = read_bounded(response, MAX_TOKEN, "token").await?;
        #[derive(serde::Deserialize)]
        struct Answer {
            token: Option<String>,
            access_token: Option<String>,
        }
        let answer: Answer =
            serde_json::from_slice(&body).map_err(|_| RegistryError::Parse("token"))?;
        answer
            .token
            .or(answer.access_token)
            .filter(|t| !t.is_empty() && HeaderValue::from_str(&format!("Bearer {t}")).is_ok())
            .ok_or(RegistryError::Parse("token"))
    }
}

/// The token service a registry reached by `scheme` names: http(s), not
/// plain http for an https registry (credentials and tokens would travel
/// in clear), not on this host or its link unless listed.
fn realm_url(scheme: &str, realm: &str, local: &[String]) -> Result<Url, RegistryError> {
    let url = Url::parse(realm).map_err(|_| RegistryError::Realm)?;
    match url.scheme() {
        "https" => {}
        "http" if scheme == "http" => {}
        "http" => return Err(RegistryError::RealmDowngrade),
        _ => return Err(RegistryError::Realm),
    }
    if let Some(host) = near_literal(&url, local) {
        return Err(RegistryError::LocalRealm(host));
    }
    Ok(url)
}

fn basic(c: &Credentials) -> String {
    use base64::Engine;
    let pair = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

fn header(value: &str) -> Option<HeaderValue> {
    let mut v = HeaderValue::from_str(value).ok()?;
    v.set_sensitive(true);
    Some(v)
}

/// What a registry's `WWW-Authenticate` asks for.
#[derive(Debug, PartialEq, Eq)]
enum Challenge {
    Bearer {
        realm: String,
        service: Option<String>,
    },
    Other,
}

impl Challenge {
    /// `Bearer realm="…",service="…",scope="…"`; anything else (`Basic`,
    /// a Bearer without a realm) is `Other`.
    fn parse(text: &str) -> Self {
        let Some((scheme, params)) = text.trim().split_once(' ') else {
            return Self::Other;
        };
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Self::Other;
        }
        let (mut realm, mut service) = (None, None);
        for (key, value) in auth_params(params) {
            match key.to_ascii_lowercase().as_str() {
                "realm" => realm = Some(value),
                "service" => service = Some(value),
                _ => {}
            }
        }
        match realm {
            Some(realm) => Self::Bearer { realm, service },
            None => Self::Other,
        }
    }
}

/// `key=value` or `key="quoted, \"value\""` pairs, comma separated.
fn auth_params(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=')).collect();
        if chars.next() != Some('=') {
            return out;
        }
        let mut value = String::new();
        if chars.next_if_eq(&'"').is_some() {
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = std::iter::from_fn(|| chars.next_if(|c| *c != ',')).collect();
        }
        out.push((key.trim().to_owned(), value.trim().to_owned()));
    }
}

/// A response's body, refused as soon as it passes `limit` bytes (by its
/// declared length, or by what arrives).
async fn read_bounded(
    mut response: reqwest::Response,
    limit: usize,
    what: &'static str,
) -> Result<Vec<u8>, RegistryError> {
    let too_large = RegistryError::TooLarge { what, limit };
    if response.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit {
            return Err(too_large);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A layer being downloaded: from `offset` if the registry honoured the
/// range, else from the start.
pub struct Blob {
    response: reqwest::Response,
    pub from_start: bool,
}

impl Blob {
    pub async fn chunk(&mut self) -> Result<Option<bytes::Bytes>, RegistryError> {
        Ok(self.response.chunk().await?)
    }
}

/// One pull's conversation with a registry, with its own authorization.
pub struct Session {
    http: reqwest::Client,
    base: String,
    repository: String,
    authorization: Option<HeaderValue>,
}

/// The platform kvirt runs images of, as image indexes name it.
fn platform() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

impl Session {
    fn get(&self, url: &str) -> reqwest::RequestBuilder {
        self.request(reqwest::Method::GET, url)
    }

    /// A request with this session's authorization.
    fn request(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let request = self.http.request(method, url);
        match &self.authorization {
            Some(a) => request.header(AUTHORIZATION, a.clone()),
            None => request,
        }
    }

    fn manifest_url(&self, reference: &str) -> String {
        format!("{}{}/manifests/{reference}", self.base, self.repository)
    }

    /// Refuses a failed answer by its status alone: its body is the
    /// registry's to choose and is never read.
    fn accepted(response: reqwest::Response) -> Result<reqwest::Response, RegistryError> {
        match response.status() {
            s if s.is_success() => Ok(response),
            StatusCode::NOT_FOUND => Err(RegistryError::NotFound),
            s @ (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) => {
                Err(RegistryError::Unauthorized(s.as_u16()))
            }
            s => Err(RegistryError::Status(s.as_u16())),
        }
    }

    /// The image manifest `r` names, and its digest; through an index, the
    /// entry for this host's platform. A digest the reference pins, or an
    /// index names, is checked against what arrived.
    pub async fn manifest(
        &self,
        r: &Reference,
    ) -> Result<(OciImageManifest, String), RegistryError> {
        let reference = r
            .digest()
            .map(str::to_owned)
            .unwrap_or_else(|| r.tag().unwrap_or("latest").to_owned());
        let (body, digest) = self.manifest_body(&reference, r.digest()).await?;
        match media_type(&body)?.as_str() {
            OCI_IMAGE_INDEX_MEDIA_TYPE | IMAGE_MANIFEST_LIST_MEDIA_TYPE => {
                let index: OciImageIndex =
                    serde_json::from_slice(&body).map_err(|_| RegistryError::Parse("index"))?;
                let entry = index
                    .manifests
                    .iter()
                    .find(|m| {
                        m.platform.as_ref().is_some_and(|p| {
                            p.os.to_string() == "linux" && p.architecture.to_string() == platform()
                        })
                    })
                    .ok_or_else(|| RegistryError::NoPlatform(format!("linux/{}", platform())))?;
                let (body, digest) = self
                    .manifest_body(&entry.digest, Some(&entry.digest))
                    .await?;
                match media_type(&body)?.as_str() {
                    OCI_IMAGE_MEDIA_TYPE | IMAGE_MANIFEST_MEDIA_TYPE => Ok((parse(&body)?, digest)),
                    _ => Err(RegistryError::MediaType),
                }
            }
            OCI_IMAGE_MEDIA_TYPE | IMAGE_MANIFEST_MEDIA_TYPE => Ok((parse(&body)?, digest)),
            _ => Err(RegistryError::MediaType),
        }
    }

    /// A manifest's bytes (at most [`MAX_MANIFEST`]) and their digest,
    /// which must be `want` if given.
    async fn manifest_body(
        &self,
        reference: &str,
        want: Option<&str>,
    ) -> Result<(Vec<u8>, String), RegistryError> {
        let response = self
            .get(&self.manifest_url(reference))
            .header(ACCEPT, ACCEPTED)
            .send()
            .await?;
        let body = read_bounded(Self::accepted(response)?, MAX_MANIFEST, "manifest").await?;
        let digest = format!("sha256:{:x}", Sha256::digest(&body));
        match want {
            Some(want) if want != digest => Err(RegistryError::Digest {
                what: "manifest",
                got: digest,
                want: want.to_owned(),
            }),
            _ => Ok((body, digest)),
        }
    }

    /// Whether the registry lets this session have `r` (a HEAD: nothing
    /// of the answer is read).
    pub async fn may_pull(&self, r: &Reference) -> Result<(), RegistryError> {
        let reference = r.digest().or(r.tag()).unwrap_or("latest");
        let request = self.request(reqwest::Method::HEAD, &self.manifest_url(reference));
        Self::accepted(request.header(ACCEPT, ACCEPTED).send().await?).map(drop)
    }

    /// A layer from byte `offset` on (the whole of it if the registry
    /// ignores the range).
    pub async fn blob(&self, layer: &OciDescriptor, offset: u64) -> Result<Blob, RegistryError> {
        let url = format!("{}{}/blobs/{}", self.base, self.repository, layer.digest);
        let mut request = self.get(&url);
        if offset > 0 {
            request = request.header(RANGE, format!("bytes={offset}-"));
        }
        let response = Self::accepted(request.send().await?)?;
        let from_start = offset == 0 || response.status() != StatusCode::PARTIAL_CONTENT;
        Ok(Blob {
            response,
            from_start,
        })
    }
}

const ACCEPTED: &str = "application/vnd.oci.image.manifest.v1+json, \
application/vnd.docker.distribution.manifest.v2+json, \
application/vnd.oci.image.index.v1+json, \
application/vnd.docker.distribution.manifest.list.v2+json";

/// A manifest's media type, from its own `mediaType` (an OCI manifest
/// without one is an image manifest, as the spec allows) and schema 2.
fn media_type(body: &[u8]) -> Result<String, RegistryError> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Versioned {
        schema_version: u32,
        media_type: Option<String>,
        manifests: Option<serde::de::IgnoredAny>,
    }
    let v: Versioned =
        serde_json::from_slice(body).map_err(|_| RegistryError::Parse("manifest"))?;
    if v.schema_version != 2 {
        return Err(RegistryError::MediaType);
    }
    Ok(match (v.media_type, v.manifests) {
        (Some(t), _) => t,
        (None, Some(_)) => OCI_IMAGE_INDEX_MEDIA_TYPE.to_owned(),
        (None, None) => OCI_IMAGE_MEDIA_TYPE.to_owned(),
    })
}

fn parse(body: &[u8]) -> Result<OciImageManifest, RegistryError> {
    serde_json::from_slice(body).map_err(|_| RegistryError::Parse("manifest"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What a hostile registry answers a request (its path and headers).
    enum Answer {
        /// Status, headers, body; sent with its length.
        Plain(u16, Vec<(&'static str, String)>, Vec<u8>),
        /// 200 and `n` bytes of `x` with no length, until the reader stops.
        Endless,
        /// 200 that declares `n` bytes and sends none.
        Declares(u64),
    }

    struct Server {
        port: u16,
        /// Every request line and its Authorization header.
        seen: Arc<Mutex<Vec<String>>>,
        /// Bytes of endless bodies that went out.
        sent: Arc<AtomicU64>,
    }

    fn serve(answer: impl Fn(&str, &str) -> Answer + Send + Sync + 'static) -> Server {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let (seen, sent) = (Arc::default(), Arc::new(AtomicU64::new(0)));
        let answer = Arc::new(answer);
        let server = Server {
            port,
            seen: Arc::clone(&seen),
            sent: Arc::clone(&sent),
        };
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let (answer, seen, sent) = (answer.clone(), seen.clone(), sent.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut b = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).await.unwrap_or(0) == 1 {
                        head.push(b[0]);
                    }
                    let head = String::from_utf8_lossy(&head).to_string();
                    let line = head.lines().next().unwrap_or("").to_owned();
                    let auth = head
                        .lines()
                        .find_map(|l| l.strip_prefix("authorization: "))
                        .unwrap_or("")
                        .to_owned();
                    seen.lock().unwrap().push(format!("{line} [{auth}]"));
                    let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                    match answer(&path, &auth) {
                        Answer::Plain(status, headers, body) => {
                            let mut out = format!(
                                "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                                body.len()
                            );
                            for (k, v) in headers {
                                out.push_str(&format!("{k}: {v}\r\n"));
                            }
                            out.push_str("\r\n");
                            let _ = s.write_all(out.as_bytes()).await;
                            let _ = s.write_all(&body).await;
                        }
                        Answer::Endless => {
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
                                .await;
                            let chunk = vec![b'x'; 64 << 10];
                            while s.write_all(&chunk).await.is_ok() {
                                if sent.fetch_add(chunk.len() as u64, Ordering::Relaxed) > 1 << 30 {
                                    break;
                                }
                            }
                        }
                        Answer::Declares(n) => {
                            let _ = s
                                .write_all(
                                    format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n")
                                        .as_bytes(),
                                )
                                .await;
                            let _ = s.shutdown().await;
                        }
                    }
                });
            }
        });
        server
    }

    fn ok(body: &[u8]) -> Answer {
        Answer::Plain(200, vec![], body.to_vec())
    }

    fn reference(port: u16, rest: &str) -> Reference {
        format!("127.0.0.1:{port}/{rest}").parse().unwrap()
    }

    fn listed(port: u16) -> RegistryClient {
        RegistryClient::new(vec![format!("127.0.0.1:{port}")])
    }

    fn manifest_json(layer: &str) -> Vec<u8> {
        serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_IMAGE_MEDIA_TYPE,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": format!("sha256:{}", "0".repeat(64)), "size": 2},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                        "digest": layer, "size": 5}],
        })
        .to_string()
        .into_bytes()
    }

    fn digest_of(body: &[u8]) -> String {
        format!("sha256:{:x}", Sha256::digest(body))
    }

    /// A hostile registry sends endless or huge bodies where a manifest
    /// or a token goes, and its error pages: kvirt reads at most the
    /// bound, and says only the kind of failure and the status.
    #[tokio::test]
    async fn every_answer_is_bounded_and_no_body_is_told() {
        let script = "<script>".repeat(100_000);
        let page = script.clone();
        let server = serve(move |path, _| match path {
            "/v2/" => ok(b"{}"),
            p if p.ends_with("/endless") => Answer::Endless,
            p if p.ends_with("/declared") => Answer::Declares(1 << 40),
            p if p.ends_with("/broken") => Answer::Plain(500, vec![], page.clone().into()),
            p if p.ends_with("/locked") => Answer::Plain(401, vec![], page.clone().into()),
            _ => Answer::Plain(404, vec![], page.clone().into()),
        });
        let client = listed(server.port);
        for (tag, told) in [
            (
                "endless",
                "its manifest is larger than the 4194304 bytes kvirt reads",
            ),
            (
                "declared",
                "its manifest is larger than the 4194304 bytes kvirt reads",
            ),
            ("broken", "HTTP status 500"),
            ("locked", "not authorized (HTTP status 401)"),
            ("gone", "image manifest not found"),
        ] {
            let r = reference(server.port, &format!("x/y:{tag}"));
            let session = client.session("http", &r, None).await.unwrap();
            let err = session.manifest(&r).await.unwrap_err().to_string();
            assert_eq!(err, told, "{tag}");
        }
        // The endless body was given up near the bound (what the sockets
        // buffer aside), not read to the server's 1 GiB.
        let sent = server.sent.load(Ordering::Relaxed);
        assert!(sent < 64 << 20, "{sent} bytes went out");

        // A token service that answers without end.
        let token = serve(|path, _| match path {
            "/v2/" => Answer::Plain(
                401,
                vec![("WWW-Authenticate", "Bearer realm=\"/token\"".into())],
                vec![],
            ),
            _ => Answer::Endless,
        });
        let realm = format!("http://127.0.0.1:{}/token", token.port);
        let registry = serve(move |path, _| match path {
            "/v2/" => Answer::Plain(
                401,
                vec![(
                    "WWW-Authenticate",
                    format!("Bearer realm=\"{realm}\",service=\"s\""),
                )],
                vec![],
            ),
            _ => Answer::Plain(401, vec![], vec![]),
        });
        let client = RegistryClient::new(vec![
            format!("127.0.0.1:{}", registry.port),
            format!("127.0.0.1:{}", token.port),
        ]);
        let r = reference(registry.port, "x/y:1");
        let err = client.session("http", &r, None).await.err().unwrap();
        assert_eq!(
            err.to_string(),
            "its token is larger than the 1048576 bytes kvirt reads"
        );
    }

    /// A registry names a token service, or redirects a layer, on this
    /// host or its link: root never goes there unless the host lists it.
    #[tokio::test]
    async fn a_registry_cannot_send_root_to_this_host() {
        let inner = serve(|_, _| ok(b"{\"token\":\"t\"}"));
        let inner_url = format!("127.0.0.1:{}", inner.port);
        for realm in [
            format!("http://{inner_url}/token"),
            format!("http://localhost:{}/token", inner.port),
            "http://169.254.169.254/latest/meta-data".to_owned(),
            "file:///etc/shadow".to_owned(),
        ] {
            let registry = serve(move |_, _| {
                Answer::Plain(
                    401,
                    vec![("WWW-Authenticate", format!("Bearer realm=\"{realm}\""))],
                    vec![],
                )
            });
            let r = reference(registry.port, "x/y:1");
            let err = listed(registry.port)
                .session("http", &r, None)
                .await
                .err()
                .unwrap();
            assert!(
                matches!(err, RegistryError::LocalRealm(_) | RegistryError::Realm),
                "{err}"
            );
        }
        assert!(inner.seen.lock().unwrap().is_empty());

        // An https registry naming a plain http token service.
        assert!(matches!(
            realm_url("https", "http://r.example/t", &[]),
            Err(RegistryError::RealmDowngrade)
        ));
        assert!(realm_url("https", "https://r.example/t", &[]).is_ok());
        assert!(realm_url("http", "http://r.example/t", &[]).is_ok());

        // A layer redirected to this host, by address or by name.
        let layer = format!("sha256:{}", "1".repeat(64));
        for to in [
            format!("http://{inner_url}/blob"),
            format!("http://localhost:{}/blob", inner.port),
        ] {
            let registry = serve(move |path, _| match path {
                "/v2/" => ok(b"{}"),
                _ => Answer::Plain(307, vec![("Location", to.clone())], vec![]),
            });
            let r = reference(registry.port, "x/y:1");
            let session = listed(registry.port)
                .session("http", &r, None)
                .await
                .unwrap();
            let descriptor = OciDescriptor {
                digest: layer.clone(),
                ..Default::default()
            };
            let err = session.blob(&descriptor, 0).await.err().unwrap();
            assert!(err.to_string().contains("redirect"), "{err}");
        }
        assert!(inner.seen.lock().unwrap().is_empty());

        // A name is resolved without this host's addresses unless listed.
        use reqwest::dns::Resolve;
        use std::str::FromStr;
        let name = |n: &str| reqwest::dns::Name::from_str(n).unwrap();
        let far = FarOnly {
            local: Arc::new(vec![]),
        };
        assert!(far.resolve(name("localhost")).await.is_err());
        let far = FarOnly {
            local: Arc::new(vec!["localhost:5000".into()]),
        };
        assert!(far.resolve(name("localhost")).await.is_ok());
    }

    /// The whole conversation with a registry that wants a token: the
    /// token is asked for with the pull's credentials and this
    /// repository's scope, an index leads to this platform's manifest, and
    /// every digest is checked against what arrived.
    #[tokio::test]
    async fn a_token_registry_is_pulled_with_the_pulls_own_token_and_digests_checked() {
        let layer = format!("sha256:{}", "2".repeat(64));
        let image = manifest_json(&layer);
        let image_digest = digest_of(&image);
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE,
            "manifests": [
                {"mediaType": OCI_IMAGE_MEDIA_TYPE, "digest": format!("sha256:{}", "3".repeat(64)),
                 "size": 10, "platform": {"os": "windows", "architecture": platform()}},
                {"mediaType": OCI_IMAGE_MEDIA_TYPE, "digest": image_digest, "size": image.len(),
                 "platform": {"os": "linux", "architecture": platform()}},
            ],
        })
        .to_string()
        .into_bytes();
        let index_digest = digest_of(&index);
        let port = Arc::new(AtomicU64::new(0));
        let p = port.clone();
        let (idx, img, want) = (index.clone(), image.clone(), image_digest.clone());
        let server = serve(move |path, auth| {
            let realm = format!("http://127.0.0.1:{}/token", p.load(Ordering::Relaxed));
            let bearer = auth == "Bearer t0k3n";
            match path {
                "/v2/" => Answer::Plain(
                    401,
                    vec![(
                        "WWW-Authenticate",
                        format!("Bearer realm=\"{realm}\",service=\"reg\",scope=\"x\""),
                    )],
                    vec![],
                ),
                "/token?scope=repository%3Ateam%2Fvm%3Apull&service=reg"
                    if auth == format!("Basic {}", base64_of("u:p")) =>
                {
                    ok(b"{\"token\":\"t0k3n\",\"expires_in\":60}")
                }
                "/token?scope=repository%3Ateam%2Fvm%3Apull&service=reg" => {
                    Answer::Plain(401, vec![], vec![])
                }
                "/v2/team/vm/manifests/1" if bearer => ok(&idx),
                p if bearer && p == format!("/v2/team/vm/manifests/{want}") => ok(&img),
                "/v2/team/vm/manifests/tampered" if bearer => ok(&img),
                p if bearer && p.ends_with(&"4".repeat(64)) => ok(&img),
                p if bearer && p.starts_with("/v2/team/vm/blobs/") => ok(b"layer"),
                _ => Answer::Plain(401, vec![], vec![]),
            }
        });
        port.store(server.port as u64, Ordering::Relaxed);
        let client = listed(server.port);
        let creds = Credentials {
            username: "u".into(),
            password: "p".into(),
        };
        let r = reference(server.port, "team/vm:1");
        let session = client.session("http", &r, Some(&creds)).await.unwrap();
        let (manifest, digest) = session.manifest(&r).await.unwrap();
        assert_eq!(digest, image_digest);
        assert_ne!(digest, index_digest);
        assert_eq!(manifest.layers[0].digest, layer);
        let mut blob = session.blob(&manifest.layers[0], 0).await.unwrap();
        assert_eq!(blob.chunk().await.unwrap().unwrap().as_ref(), b"layer");
        session.may_pull(&r).await.unwrap();

        // Wrong credentials: the token service refuses, and kvirt says so.
        let wrong = Credentials {
            username: "u".into(),
            password: "nope".into(),
        };
        let err = client
            .session("http", &r, Some(&wrong))
            .await
            .err()
            .unwrap();
        assert_eq!(err.to_string(), "authentication failed (HTTP status 401)");

        // A digest the reference pins is what must arrive.
        let pinned = reference(server.port, &format!("team/vm@sha256:{}", "4".repeat(64)));
        let err = session.manifest(&pinned).await.unwrap_err();
        assert!(matches!(err, RegistryError::Digest { .. }), "{err}");
        let tampered = reference(server.port, "team/vm:tampered");
        let (_, d) = session.manifest(&tampered).await.unwrap();
        assert_eq!(d, image_digest, "a tag's digest is that of what arrived");
        let tokens = server
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("/token"))
            .count();
        assert_eq!(tokens, 2, "one token per session");
    }

    fn base64_of(s: &str) -> String {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    #[test]
    fn challenges_are_read_as_registries_write_them() {
        assert_eq!(
            Challenge::parse(
                r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/x:pull""#
            ),
            Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
            }
        );
        assert_eq!(
            Challenge::parse(r#"bearer realm=https://r/t, service="a \"b\"""#),
            Challenge::Bearer {
                realm: "https://r/t".into(),
                service: Some("a \"b\"".into()),
            }
        );
        assert_eq!(Challenge::parse(r#"Basic realm="kvirt""#), Challenge::Other);
        assert_eq!(Challenge::parse("Bearer service=x"), Challenge::Other);
        assert_eq!(Challenge::parse(""), Challenge::Other);
        assert_eq!(Challenge::parse(&"=\"".repeat(10_000)), Challenge::Other);
    }
}
