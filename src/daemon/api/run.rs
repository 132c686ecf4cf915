//! The API port's life in kvirtd: bound at start, served once the API
//! server's front proxy is known, this host's address published (ready)
//! and kept so, other hosts' stale addresses pruned, and at SIGTERM the
//! address marked not ready and every session closed with a close frame.

use super::{cluster::KubeCluster, local::Local, tls, Api};
use crate::core::layout::HostLayout;
use crate::daemon::controller::VmiView;
use crate::host::fence::RenewalClock;
use crate::sources::cluster::aggregation;
use futures::StreamExt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// How often the certificate files are read again (no request).
const CERTS: Duration = Duration::from_secs(300);
/// How often this host's address is looked for in the Endpoints (someone
/// may have edited them) besides after an absence: one read an hour. It
/// was every five minutes; at 1,000 hosts that read of an object listing
/// every host was the largest idle cost after the Lease.
const RECHECK: Duration = Duration::from_secs(3600);

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

/// The certificate, key and CA files, read at start and every [`CERTS`].
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
    renewals: Arc<RenewalClock>,
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
        renewals,
    ));
    Ok(Running {
        api,
        client,
        node,
        published,
    })
}

/// The front proxy's trust, as the API server publishes it: watched (one
/// object, by name), so a rotated CA is taken at once and an idle host
/// sends no request for it.
/// `known` is told each time it is taken.
fn watch_front_proxy(api: Arc<Api>, client: kube::Client, known: Arc<tokio::sync::Notify>) {
    tokio::spawn(async move {
        let mut headers = std::pin::pin!(aggregation::front_proxy(client));
        let mut told = false;
        while let Some(h) = headers.next().await {
            match h.map(|h| api.set_front_proxy(h).map_err(|e| e.to_string())) {
                Ok(Ok(())) => {
                    told = false;
                    known.notify_one();
                }
                // Said once until it works again: the watch retries.
                Ok(Err(e)) if !told => {
                    warn!("the front proxy's trust is unusable: {e}");
                    told = true;
                }
                Err(e) if !told => {
                    warn!("subresources.kubevirt.io waits for the front proxy: {e}");
                    told = true;
                }
                _ => {}
            }
        }
    });
}

/// Front proxy first (nothing is served before it is known), then this
/// host's address, published once; looked for again every [`RECHECK`] and
/// after an absence (the leader drops the address of a host it saw
/// unrenewed for twice the lease: one whose renewals stopped for a lease
/// looks when they resume; the leader prunes, `aggregation::keep_pruned`).
/// Between those, an idle host sends no request here: its Lease is its
/// only periodic one.
#[allow(clippy::too_many_arguments)]
async fn keep(
    api: Arc<Api>,
    files: Files,
    client: kube::Client,
    node: String,
    published: SocketAddr,
    lease: Duration,
    renewals: Arc<RenewalClock>,
) {
    let known = Arc::new(tokio::sync::Notify::new());
    watch_front_proxy(api.clone(), client.clone(), known.clone());
    // The address is published as soon as the front proxy is known, not a
    // period later (a restart would leave it not ready that long).
    known.notified().await;
    let mut found: Option<tokio::time::Instant> = None;
    let mut certs = tokio::time::Instant::now();
    let (mut away, mut told) = (false, false);
    let mut tick = tokio::time::interval(lease.max(Duration::from_secs(2)));
    loop {
        tick.tick().await;
        if certs.elapsed() >= CERTS {
            reload_identity(&api, &files);
            certs = tokio::time::Instant::now();
        }
        let unrenewed = renewals.unrenewed();
        away |= unrenewed > lease;
        let due = found.is_none_or(|t| t.elapsed() >= RECHECK || (away && unrenewed < lease));
        if due && api.knows_front_proxy() {
            match aggregation::keep_published(&client, &node, published, found.is_none()).await {
                Ok(()) => {
                    found = Some(tokio::time::Instant::now());
                    (away, told) = (false, false);
                }
                // Said once; tried again every period until it works.
                Err(e) if !told => {
                    warn!("this host's API address is not published: {e}");
                    told = true;
                }
                Err(_) => {}
            }
        }
    }
}

/// This host's certificate read again; one that no longer reads is said,
/// and the one in use kept.
fn reload_identity(api: &Api, files: &Files) {
    if let Err(e) =
        tls::Identity::load(&files.cert, &files.key, &files.ca).and_then(|i| api.set_identity(i))
    {
        warn!("the API port's certificate was not read again: {e}; keeping the one in use");
    }
}
