//! A request for a VMI another host runs goes to that host's kvirtd, over
//! TLS with this host's certificate (both chain to kvirt's CA), carrying
//! the user this host authenticated and authorised. An upgraded
//! connection (console, VNC) is then copied byte for byte both ways.

use super::{strip_user_headers, Body};
use crate::core::subresource::requestheader::{RequestHeader, User};
use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing::debug;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Answers of a VMI's subresources are small documents.
const MAX_ANSWER: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("connecting to {addr}: {message}")]
    Connect { addr: SocketAddr, message: String },
    #[error("{0}")]
    Http(String),
}

pub async fn forward(
    tls: Arc<rustls::ClientConfig>,
    addr: SocketAddr,
    user: &User,
    front: &RequestHeader,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, ForwardError> {
    let connect_err = |message: String| ForwardError::Connect { addr, message };
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| connect_err("timed out".into()))?
        .map_err(|e| connect_err(e.to_string()))?;
    let name = ServerName::try_from(super::tls::SERVICE_NAME).expect("a DNS name");
    let stream = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio_rustls::TlsConnector::from(tls).connect(name, tcp),
    )
    .await
    .map_err(|_| connect_err("TLS handshake timed out".into()))?
    .map_err(|e| connect_err(format!("TLS: {e}")))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ForwardError::Http(e.to_string()))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            debug!("forwarded connection: {e}");
        }
    });

    let upgrading = req.headers().contains_key(http::header::UPGRADE);
    let client_upgrade = upgrading.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let body = Limited::new(body, super::MAX_BODY)
        .collect()
        .await
        .map_err(|e| ForwardError::Http(format!("reading the request body: {e}")))?
        .to_bytes();
    strip_user_headers(&mut parts.headers, front);
    strip_user_headers(&mut parts.headers, &RequestHeader::peers());
    for (k, v) in user.headers() {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            parts.headers.append(k, v);
        }
    }
    parts.headers.insert(
        http::header::HOST,
        HeaderValue::from_static(super::tls::SERVICE_NAME),
    );
    let out = Request::from_parts(parts, Full::new(body));
    let mut answer = sender
        .send_request(out)
        .await
        .map_err(|e| ForwardError::Http(e.to_string()))?;

    if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ForwardError::Http(
                "the peer upgraded a plain request".into(),
            ));
        };
        let peer_upgrade = hyper::upgrade::on(&mut answer);
        tokio::spawn(async move {
            let (Ok(client), Ok(peer)) = (client_upgrade.await, peer_upgrade.await) else {
                return;
            };
            let (mut client, mut peer) = (TokioIo::new(client), TokioIo::new(peer));
            let _ = tokio::io::copy_bidirectional(&mut client, &mut peer).await;
        });
        let (parts, _) = answer.into_parts();
        return Ok(Response::from_parts(parts, Full::new(Bytes::new())));
    }
    let (parts, body) = answer.into_parts();
    let body = Limited::new(body, MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| ForwardError::Http(format!("reading the answer: {e}")))?
        .to_bytes();
    Ok(Response::from_parts(parts, Full::new(body)))
}
