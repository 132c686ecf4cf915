//! KubeVirt's `subresources.kubevirt.io`, served by kvirtd behind the API
//! server's aggregator, so that `virtctl` works unchanged: who asks
//! (front-proxy certificate and headers, [`tls`]), whether they may (a
//! SubjectAccessReview), and the answer: here for the VMIs this host runs
//! ([`local`], [`stream`]), from another kvirtd for the others
//! ([`forward`]), through the API server for VirtualMachines.

pub mod cluster;
pub mod forward;
pub mod local;
pub mod pki;
pub mod reload;
pub mod run;
pub mod stream;
pub mod tls;

use crate::core::key::VmKey;
use crate::core::subresource::admit::admit;
use crate::core::subresource::requestheader::{is_user_header, RequestHeader, User};
use crate::core::subresource::{self, discovery, options, Access, ApiError, Route, VmAction};
use crate::core::vm::Verb;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use rustls::RootCertStore;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tls::Caller;
use tokio::net::TcpListener;
use tracing::{debug, info, warn, Instrument};

pub type Body = Full<Bytes>;
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Request bodies are a few options: far below this.
const MAX_BODY: usize = 64 * 1024;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the API needs of the cluster: authorisation, where a VMI runs,
/// VirtualMachine requests, and where another kvirtd listens.
pub trait Cluster: Send + Sync + 'static {
    fn review<'a>(
        &'a self,
        user: &'a User,
        access: &'a Access,
    ) -> BoxFuture<'a, Result<(bool, String), String>>;
    /// The node the VMI runs on: `Ok(None)` when there is no such VMI,
    /// `Some("")` when it runs nowhere yet.
    fn vmi_node<'a>(&'a self, key: &'a VmKey) -> BoxFuture<'a, Result<Option<String>, ApiError>>;
    fn vm_request<'a>(
        &'a self,
        key: &'a VmKey,
        verb: Verb,
    ) -> BoxFuture<'a, Result<String, ApiError>>;
    fn expand_spec<'a>(
        &'a self,
        key: &'a VmKey,
    ) -> BoxFuture<'a, Result<serde_json::Value, ApiError>>;
    fn peer<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Result<Option<SocketAddr>, String>>;
    /// `virtctl migrate`: a `VirtualMachineInstanceMigration` of the VM's
    /// running VMI, made as virt-api makes it; says which.
    fn migrate<'a>(
        &'a self,
        _key: &'a VmKey,
        _added_node_selector: std::collections::BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async { Err(ApiError::internal("migration objects are not made here")) })
    }
}

/// The front proxy's trust, as the API server last published it.
struct FrontProxy {
    header: RequestHeader,
    roots: Arc<RootCertStore>,
    server: Arc<rustls::ServerConfig>,
}

/// This host's certificate and whom it trusts: both read again while
/// kvirtd runs (a renewed certificate, a rotated front-proxy CA).
struct Trust {
    identity: tls::Identity,
    peer_client: Arc<rustls::ClientConfig>,
    front: Option<FrontProxy>,
}

pub struct Api {
    node: String,
    trust: RwLock<Trust>,
    cluster: Arc<dyn Cluster>,
    local: local::Local,
    sessions: stream::Sessions,
}

fn respond(code: StatusCode, body: Vec<u8>) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// JSON as virt-api writes it: indented by one space.
pub fn json(code: StatusCode, v: &serde_json::Value) -> Response<Body> {
    use serde::Serialize;
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut out,
        serde_json::ser::PrettyFormatter::with_indent(b" "),
    );
    let _ = v.serialize(&mut ser);
    respond(code, out)
}

pub fn error(e: &ApiError) -> Response<Body> {
    let code = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(code, &e.status())
}

impl Api {
    pub fn new(
        node: String,
        identity: tls::Identity,
        cluster: Arc<dyn Cluster>,
        local: local::Local,
    ) -> Result<Arc<Self>, tls::TlsError> {
        Ok(Arc::new(Self {
            node,
            trust: RwLock::new(Trust {
                peer_client: identity.client_config()?,
                identity,
                front: None,
            }),
            cluster,
            local,
            sessions: stream::Sessions::default(),
        }))
    }

    fn trust(&self) -> std::sync::RwLockReadGuard<'_, Trust> {
        self.trust.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the front proxy's trust is known (nothing is served before).
    pub fn knows_front_proxy(&self) -> bool {
        self.trust().front.is_some()
    }

    /// Takes the front proxy's CA, names and headers (at start, and
    /// whenever the API server's ConfigMap changes).
    pub fn set_front_proxy(&self, header: RequestHeader) -> Result<(), tls::TlsError> {
        let mut trust = self.trust.write().unwrap_or_else(|p| p.into_inner());
        if trust.front.as_ref().is_some_and(|f| f.header == header) {
            return Ok(());
        }
        let roots = tls::roots(header.client_ca.as_bytes(), "requestheader-client-ca-file")?;
        let server = trust.identity.server_config(roots.clone())?;
        trust.front = Some(FrontProxy {
            header,
            roots,
            server,
        });
        Ok(())
    }

    /// Takes a renewed certificate (or CA) of this host: new connections
    /// use it, open ones keep theirs.
    pub fn set_identity(&self, identity: tls::Identity) -> Result<(), tls::TlsError> {
        let mut trust = self.trust.write().unwrap_or_else(|p| p.into_inner());
        if trust.identity == identity {
            return Ok(());
        }
        let peer_client = identity.client_config()?;
        let server = match &trust.front {
            Some(f) => Some(identity.server_config(f.roots.clone())?),
            None => None,
        };
        if let (Some(f), Some(server)) = (trust.front.as_mut(), server) {
            f.server = server;
        }
        trust.identity = identity;
        trust.peer_client = peer_client;
        Ok(())
    }

    /// What a new connection is served with: the server's TLS, and the
    /// front proxy's and kvirt's CAs to tell callers apart.
    fn server_config(
        &self,
    ) -> Option<(
        Arc<rustls::ServerConfig>,
        Arc<RootCertStore>,
        Arc<RootCertStore>,
    )> {
        let trust = self.trust();
        let f = trust.front.as_ref()?;
        Some((
            f.server.clone(),
            f.roots.clone(),
            trust.identity.peers.clone(),
        ))
    }

    /// Ends every console and VNC session with a close frame (kvirtd stops).
    pub async fn close_sessions(&self) {
        self.sessions.close_all().await;
    }

    /// The user a request speaks for, or `None` (401).
    fn user(&self, caller: &Caller, headers: &http::HeaderMap) -> Option<User> {
        let pairs: Vec<(&str, &str)> = headers
            .iter()
            .filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)))
            .collect();
        match caller {
            Caller::FrontProxy(cn) => {
                let trust = self.trust();
                let header = &trust.front.as_ref()?.header;
                if !header.allows(cn) {
                    return None;
                }
                header.user(&pairs)
            }
            Caller::Peer => RequestHeader::peers().user(&pairs),
            Caller::Anonymous => None,
        }
    }

    async fn handle(self: Arc<Self>, caller: Caller, req: Request<Incoming>) -> Response<Body> {
        let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
        let Some(user) = self.user(&caller, req.headers()) else {
            debug!(%method, %path, ?caller, "unauthenticated request");
            return error(&ApiError::unauthorized());
        };
        let (route, version) = match subresource::route(&method, &path) {
            Ok(r) => r,
            Err(e) => return error(&e),
        };
        let span = tracing::info_span!("api", user = %user.name, %method, %path);
        async move {
            // A peer forwards a user the first kvirtd already authorised.
            if let (Some(access), Caller::FrontProxy(_)) = (route.access(version), &caller) {
                match self.cluster.review(&user, &access).await {
                    Ok((true, _)) => {}
                    Ok((false, reason)) => return error(&forbidden(&user, &access, &reason)),
                    Err(e) => return error(&ApiError::internal(e)),
                }
            }
            self.dispatch(caller, user, route, version, req).await
        }
        .instrument(span)
        .await
    }

    async fn dispatch(
        self: Arc<Self>,
        caller: Caller,
        user: User,
        route: Route,
        version: &'static str,
        req: Request<Incoming>,
    ) -> Response<Body> {
        match route {
            Route::Group => json(StatusCode::OK, &discovery::group()),
            Route::Resources { version } => json(StatusCode::OK, &discovery::resources(version)),
            Route::Version => json(
                StatusCode::OK,
                &discovery::version(
                    env!("CARGO_PKG_VERSION"),
                    &format!("linux/{}", std::env::consts::ARCH),
                ),
            ),
            Route::Healthz => respond(StatusCode::OK, b"ok".to_vec()),
            Route::Vm { key, action } => match self.vm(&key, action, req).await {
                Ok(r) => r,
                Err(e) => error(&e),
            },
            Route::Vmi { key, action } => {
                let _ = version;
                match self.cluster.vmi_node(&key).await {
                    Err(e) => error(&e),
                    Ok(None) => error(&ApiError::not_found("virtualmachineinstance", key.name())),
                    Ok(Some(node)) if node == self.node => self.local_vmi(&key, action, req).await,
                    // A peer sends only what it found to run here: never
                    // forward again (two hosts that disagree would loop).
                    Ok(Some(_)) if caller == Caller::Peer => error(&ApiError::conflict_on(
                        "virtualmachineinstance",
                        key.name(),
                        &format!("VMI does not run on {}", self.node),
                    )),
                    Ok(Some(node)) if node.is_empty() => match admit(action, key.name(), None) {
                        Err(e) => error(&e),
                        Ok(()) => error(&ApiError::internal("admitted without a VMI")),
                    },
                    Ok(Some(node)) => self.forward(&node, &user, req).await,
                }
            }
        }
    }

    async fn vm(
        &self,
        key: &VmKey,
        action: VmAction,
        req: Request<Incoming>,
    ) -> Result<Response<Body>, ApiError> {
        if action == VmAction::ExpandSpec {
            let spec = self.cluster.expand_spec(key).await?;
            return Ok(json(StatusCode::OK, &spec));
        }
        let body = read_body(req).await?;
        if action == VmAction::Migrate {
            match options::migrate(&body)? {
                Some(added) => {
                    let message = self.cluster.migrate(key, added).await?;
                    info!(vm = %key, "{message}");
                }
                None => info!(vm = %key, action = action.name(), "dry run"),
            }
            return Ok(respond(StatusCode::ACCEPTED, vec![]));
        }
        match options::verb(action, &body)? {
            Some(verb) => {
                let message = self.cluster.vm_request(key, verb).await?;
                info!(vm = %key, "{message}");
            }
            None => info!(vm = %key, action = action.name(), "dry run"),
        }
        Ok(respond(StatusCode::ACCEPTED, vec![]))
    }

    async fn forward(&self, node: &str, user: &User, req: Request<Incoming>) -> Response<Body> {
        let addr = match self.cluster.peer(node).await {
            Ok(Some(a)) => a,
            Ok(None) => {
                return error(&ApiError::unavailable(format!(
                    "the kvirtd of node {node} publishes no API address"
                )))
            }
            Err(e) => return error(&ApiError::internal(e)),
        };
        let (header, client) = {
            let trust = self.trust();
            let header = trust.front.as_ref().map(|f| f.header.clone());
            (header.unwrap_or_default(), trust.peer_client.clone())
        };
        forward::forward(client, addr, user, &header, req)
            .await
            .unwrap_or_else(|e| {
                warn!(%node, %addr, "forwarding: {e}");
                error(&ApiError::unavailable(format!(
                    "forwarding to the kvirtd of node {node}: {e}"
                )))
            })
    }
}

/// Kubernetes' words for a denied request.
fn forbidden(user: &User, a: &Access, reason: &str) -> ApiError {
    let mut m = format!(
        "{}.{} \"{}\" is forbidden: User \"{}\" cannot {} resource \"{}/{}\" in API group \"{}\" in the namespace \"{}\"",
        a.resource,
        subresource::GROUP,
        a.name,
        user.name,
        a.verb,
        a.resource,
        a.subresource,
        subresource::GROUP,
        a.namespace
    );
    if !reason.is_empty() {
        m.push_str(": ");
        m.push_str(reason);
    }
    ApiError::forbidden(m)
}

pub async fn read_body(req: Request<Incoming>) -> Result<Bytes, ApiError> {
    Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))
}

/// Headers that may never pass from a client to a handler or a peer: a
/// user is named by kvirt alone.
pub fn strip_user_headers(headers: &mut http::HeaderMap, config: &RequestHeader) {
    let names: Vec<http::HeaderName> = headers
        .keys()
        .filter(|k| is_user_header(k.as_str(), config) || *k == http::header::AUTHORIZATION)
        .cloned()
        .collect();
    for n in names {
        headers.remove(n);
    }
}

/// Accepts connections until the listener fails; each is served on a task
/// of its own.
pub async fn serve(listener: TcpListener, api: Arc<Api>) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("API port: accepting: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let api = api.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(api, tcp).await {
                debug!(%peer, "API connection: {e}");
            }
        });
    }
}

async fn connection(api: Arc<Api>, tcp: tokio::net::TcpStream) -> Result<(), String> {
    let Some((config, front_roots, peer_roots)) = api.server_config() else {
        return Err("not serving yet: the front proxy's CA is not known".into());
    };
    let tls = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio_rustls::TlsAcceptor::from(config).accept(tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_owned())?
    .map_err(|e| format!("TLS handshake: {e}"))?;
    let caller = tls::classify(
        tls.get_ref().1.peer_certificates(),
        &front_roots,
        &peer_roots,
    );
    let service = hyper::service::service_fn(move |req| {
        let (api, caller) = (api.clone(), caller.clone());
        async move { Ok::<_, std::convert::Infallible>(api.handle(caller, req).await) }
    });
    hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HANDSHAKE_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
        .with_upgrades()
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
