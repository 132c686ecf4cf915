//! Console and VNC as virt-api serves them: a websocket (subprotocol
//! `plain.kubevirt.io`, binary frames) joined byte for byte to the VM's
//! socket. One session per VM and kind at a time: a new one takes over
//! and the old one is closed saying so, unless the new one asks to
//! `preserveSession`, which then is refused while another is open.

use super::{error, Api, Body};
use crate::core::key::VmKey;
use crate::core::subresource::{ApiError, VmiAction};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use tokio_tungstenite::tungstenite::Message;
use tracing::{debug, info};

pub const SUBPROTOCOL: &str = "plain.kubevirt.io";
/// How long a new session waits for the one it takes over to let go of
/// the VM's socket (QEMU serves one client at a time).
const TAKEOVER_WAIT: Duration = Duration::from_secs(5);

/// Why a session was closed, sent in its close frame.
#[derive(Clone, Debug)]
struct Close {
    code: CloseCode,
    reason: &'static str,
}

struct Session {
    serial: u64,
    close: watch::Sender<Option<Close>>,
    /// Resolves when the session has let go of the VM's socket.
    done: watch::Receiver<bool>,
}

#[derive(Default)]
pub struct Sessions {
    open: Mutex<HashMap<(String, &'static str), Session>>,
    serial: std::sync::atomic::AtomicU64,
}

impl Sessions {
    /// Takes the VM's console or VNC for a new session: the previous one
    /// (if any) is closed and waited for, or, with `preserve`, the new one
    /// is refused.
    async fn take(
        &self,
        key: &(String, &'static str),
        preserve: bool,
    ) -> Result<(u64, watch::Receiver<Option<Close>>, watch::Sender<bool>), ApiError> {
        let old = {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            match open.get(key) {
                Some(s) if !*s.done.borrow() && preserve => {
                    return Err(ApiError::conflict("Active VNC connection. Request denied."))
                }
                Some(s) => {
                    let _ = s.close.send(Some(Close {
                        code: CloseCode::Policy,
                        reason: "a new connection took over the session",
                    }));
                    Some(s.done.clone())
                }
                None => None,
            }
        };
        if let Some(mut done) = old {
            let _ = tokio::time::timeout(TAKEOVER_WAIT, done.wait_for(|d| *d)).await;
        }
        let serial = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (close_tx, close_rx) = watch::channel(None);
        let (done_tx, done_rx) = watch::channel(false);
        self.open.lock().unwrap_or_else(|p| p.into_inner()).insert(
            key.clone(),
            Session {
                serial,
                close: close_tx,
                done: done_rx,
            },
        );
        Ok((serial, close_rx, done_tx))
    }

    fn release(&self, key: &(String, &'static str), serial: u64) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.get(key).is_some_and(|s| s.serial == serial) {
            open.remove(key);
        }
    }

    /// Closes every session ("going away") and waits for them briefly.
    pub async fn close_all(&self) {
        let waits: Vec<watch::Receiver<bool>> = {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            open.values()
                .map(|s| {
                    let _ = s.close.send(Some(Close {
                        code: CloseCode::Away,
                        reason: "kvirtd is stopping; the VM keeps running",
                    }));
                    s.done.clone()
                })
                .collect()
        };
        for mut w in waits {
            let _ = tokio::time::timeout(Duration::from_secs(2), w.wait_for(|d| *d)).await;
        }
    }
}

fn bad(message: &str) -> Response<Body> {
    error(&ApiError::bad_request(message.to_owned()))
}

/// Answers the websocket handshake and, once upgraded, joins it to the
/// VM's socket.
pub async fn open(
    api: Arc<Api>,
    key: &VmKey,
    action: VmiAction,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let h = req.headers();
    let upgrade = h
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    let Some(ws_key) = h.get(http::header::SEC_WEBSOCKET_KEY).cloned() else {
        return bad("a websocket upgrade is required");
    };
    if !upgrade
        || h.get(http::header::SEC_WEBSOCKET_VERSION)
            .map(|v| v.as_bytes())
            != Some(b"13")
    {
        return bad("a websocket upgrade (version 13) is required");
    }
    let offered = h
        .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == SUBPROTOCOL);
    if !offered {
        return bad("the websocket subprotocol plain.kubevirt.io is required");
    }
    // virt-api reads preserveSession for VNC only: a console always takes over.
    let preserve = action == VmiAction::Vnc
        && req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .any(|kv| kv == "preserveSession=true");
    let session = (key.id(), action.name());
    let (serial, mut close, done) = match api.sessions.take(&session, preserve).await {
        Ok(s) => s,
        Err(e) => return error(&e),
    };
    let socket = match api.local.connect(key, action).await {
        Ok(s) => s,
        Err(e) => {
            api.sessions.release(&session, serial);
            let _ = done.send(true);
            return error(&e);
        }
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let key = key.clone();
    tokio::spawn(async move {
        match on_upgrade.await {
            Ok(upgraded) => {
                let io = hyper_util::rt::TokioIo::new(upgraded);
                let ws =
                    tokio_tungstenite::WebSocketStream::from_raw_socket(io, Role::Server, None)
                        .await;
                info!(vm = %key, kind = action.name(), "session opened");
                let why = bridge(ws, socket, &mut close).await;
                info!(vm = %key, kind = action.name(), "session closed: {why}");
            }
            Err(e) => debug!(vm = %key, "websocket upgrade: {e}"),
        }
        api.sessions.release(&session, serial);
        let _ = done.send(true);
    });
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(ws_key.as_bytes());
    let mut r = Response::new(Full::new(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = r.headers_mut();
    headers.insert(http::header::UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    headers.insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(SUBPROTOCOL),
    );
    if let Ok(v) = HeaderValue::from_str(&accept) {
        headers.insert(http::header::SEC_WEBSOCKET_ACCEPT, v);
    }
    r
}

/// Copies frames to the socket and the socket's bytes to binary frames
/// until either side ends or the session is closed; says why it ended.
async fn bridge<S>(
    ws: tokio_tungstenite::WebSocketStream<S>,
    socket: tokio::net::UnixStream,
    close: &mut watch::Receiver<Option<Close>>,
) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut tx, mut rx) = ws.split();
    let (mut from_vm, mut to_vm) = socket.into_split();
    let mut buf = vec![0u8; 32 * 1024];
    let ending = loop {
        tokio::select! {
            m = rx.next() => match m {
                Some(Ok(Message::Binary(b))) => {
                    if let Err(e) = to_vm.write_all(&b).await {
                        break Some((CloseCode::Error, format!("writing to the VM: {e}")));
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    if let Err(e) = to_vm.write_all(t.as_bytes()).await {
                        break Some((CloseCode::Error, format!("writing to the VM: {e}")));
                    }
                }
                Some(Ok(Message::Close(_))) | None => break None,
                Some(Ok(_)) => {}
                Some(Err(e)) => break Some((CloseCode::Protocol, format!("websocket: {e}"))),
            },
            n = from_vm.read(&mut buf) => match n {
                Ok(0) => break Some((CloseCode::Normal, "the VM closed its end".to_owned())),
                Ok(n) => {
                    if tx.send(Message::Binary(Bytes::copy_from_slice(&buf[..n]))).await.is_err() {
                        break None;
                    }
                }
                Err(e) => break Some((CloseCode::Error, format!("reading from the VM: {e}"))),
            },
            _ = close.changed() => {
                let c = close.borrow().clone();
                if let Some(c) = c {
                    break Some((c.code, c.reason.to_owned()));
                }
            }
        }
    };
    match ending {
        None => "the client left".to_owned(),
        Some((code, reason)) => {
            let frame = CloseFrame {
                code,
                reason: reason.clone().into(),
            };
            let _ = tx.send(Message::Close(Some(frame))).await;
            let _ = tx.close().await;
            reason
        }
    }
}
