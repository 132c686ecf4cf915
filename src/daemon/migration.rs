//! The migration port in kvirtd: [`crate::host::tunnel`] served with this
//! host's kvirt identity (the `[api]` certificate, key and CA), so that
//! only other kvirtds reach it.

use crate::daemon::api::tls::{Identity, TlsError};
use crate::host::tunnel::{self, Routes};
use std::net::SocketAddr;
use std::path::Path;
use tracing::info;

#[derive(Debug, thiserror::Error)]
pub enum MigrationPortError {
    #[error("the migration port's identity: {0}")]
    Tls(#[from] TlsError),
    #[error("binding the migration port {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Serves the migration port on `listen` from now on; the routes are the
/// migrations this host has prepared as a target.
pub async fn start(
    listen: SocketAddr,
    cert: &Path,
    key: &Path,
    ca: &Path,
) -> Result<Routes, MigrationPortError> {
    let identity = Identity::load(cert, key, ca)?;
    let tls = identity.tunnel_server_config()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| MigrationPortError::Bind {
            addr: listen,
            source,
        })?;
    let routes = Routes::default();
    tokio::spawn(tunnel::serve(listener, tls, routes.clone(), None));
    info!(%listen, "serving the migration port");
    Ok(routes)
}
