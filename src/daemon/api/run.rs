//! The API port's life in kvirtd: bound at start, served once the API
//! server's front proxy is known, this host's address published (ready)
//! and kept so, other hosts' stale addresses pruned, and at SIGTERM the
//! address marked not ready and every session closed with a close frame.

use super::{cluster::KubeCluster, local::Local, tls, Api};
use crate::core::layout::HostLayout;
use crate::daemon::controller::VmiView;
use crate::sources::cluster::aggregation;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// How often the front proxy's ConfigMap is read again and this host's
/// address checked (and written again if someone removed it): two reads
/// per host every five minutes, however many hosts there are.
const REFRESH: Duration = Duration::from_secs(300);

pub struct ApiSettings {
    pub listen: SocketAddr,
    /// The address published for this host (with the listen port).
    pub address: std::net::IpAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// Other hosts' addresses go once their Lease is this much overdue.
    pub lease: Duration,
}

/// The certificate, key and CA files, read at start and every refresh.
struct Files {
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiRunError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// What kvirtd calls when it stops.
pub struct Running {
    api: Arc<Api>,
    client: kube::Client,
    node: String,
    published: SocketAddr,
}

impl Running {
    pub async fn stop(self) {
        if let Err(e) = aggregation::publish(&self.client, &self.node, self.published, false).await
        {
            warn!("marking this host's API address not ready: {e}");
        }
        self.api.close_sessions().await;
    }
}

pub async fn start(
    s: ApiSettings,
    node: String,
    client: kube::Client,
    view: Arc<dyn VmiView>,
    layout: HostLayout,
    leading: tokio::sync::watch::Receiver<bool>,
) -> Result<Running, ApiRunError> {
    let identity = tls::Identity::load(&s.cert, &s.key, &s.ca)?;
    let listener = tokio::net::TcpListener::bind(s.listen)
        .await
        .map_err(|source| ApiRunError::Bind {
            addr: s.listen,
            source,
        })?;
    let cluster = Arc::new(KubeCluster {
        client: client.clone(),
    });
    let api = Api::new(node.clone(), identity, cluster, Local { view, layout })?;
    tokio::spawn(super::serve(listener, api.clone()));
    let published = SocketAddr::new(s.address, s.listen.port());
    info!(listen = %s.listen, %published, "serving subresources.kubevirt.io");
    let files = Files {
        cert: s.cert,
        key: s.key,
        ca: s.ca,
    };
    tokio::spawn(keep(
        api.clone(),
        files,
        client.clone(),
        node.clone(),
        published,
        s.lease,
        leading,
    ));
    Ok(Running {
        api,
        client,
        node,
        published,
    })
}

/// Front proxy first (nothing is served before it is known), then this
/// host's address; both again every [`REFRESH`]; while this host leads
/// (`core::election`), stale hosts pruned every lease period: one host's
/// reads, not every host's.
async fn keep(
    api: Arc<Api>,
    files: Files,
    client: kube::Client,
    node: String,
    published: SocketAddr,
    lease: Duration,
    leading: tokio::sync::watch::Receiver<bool>,
) {
    let mut refreshed: Option<tokio::time::Instant> = None;
    let mut told = false;
    let mut tick = tokio::time::interval(lease.min(REFRESH).max(Duration::from_secs(2)));
    loop {
        tick.tick().await;
        if refreshed.is_none_or(|t| t.elapsed() >= REFRESH) {
            let first = refreshed.is_none();
            match refresh(&api, &files, &client, &node, published, first).await {
                Ok(()) => {
                    refreshed = Some(tokio::time::Instant::now());
                    told = false;
                }
                // Said once; retried every tick until it works.
                Err(e) if !told => {
                    warn!("subresources.kubevirt.io is not served yet: {e}");
                    told = true;
                }
                Err(_) => {}
            }
        }
        let mine = refreshed.is_some().then_some(published);
        if *leading.borrow() {
            if let Err(e) = aggregation::prune(&client, &node, mine, lease).await {
                warn!("pruning stale API endpoints: {e}");
            }
        }
    }
}

/// This host's certificate and the front proxy's trust read again, then
/// this host's address published: the `first` time, or when it went
/// missing. A certificate that no longer reads is said, and the one in
/// use kept.
async fn refresh(
    api: &Api,
    files: &Files,
    client: &kube::Client,
    node: &str,
    published: SocketAddr,
    first: bool,
) -> Result<(), String> {
    if let Err(e) =
        tls::Identity::load(&files.cert, &files.key, &files.ca).and_then(|i| api.set_identity(i))
    {
        warn!("the API port's certificate was not read again: {e}; keeping the one in use");
    }
    let header = aggregation::request_header(client)
        .await
        .map_err(|e| e.to_string())?;
    api.set_front_proxy(header).map_err(|e| e.to_string())?;
    let listed = !first
        && aggregation::still_published(client, node, published)
            .await
            .map_err(|e| e.to_string())?;
    if listed {
        return Ok(());
    }
    aggregation::publish(client, node, published, true)
        .await
        .map_err(|e| e.to_string())
}
