//! The client side of `subresources.kubevirt.io`: what `kvirtctl` asks
//! through the API server in a cluster, as `virtctl` does, with the
//! user's own credentials (never the node's).

use crate::core::key::VmKey;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::WebSocketStream;

pub type Stream = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

const SUBPROTOCOL: &str = "plain.kubevirt.io";

pub fn path(key: &VmKey, resource: &str, sub: &str) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{}/{resource}/{}/{sub}",
        key.namespace(),
        key.name()
    )
}

/// The message of a failed answer: a `Status`'s, else the body.
fn failure(code: http::StatusCode, body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("message")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{code}: {}", String::from_utf8_lossy(body).trim()))
}

/// `PUT` of a subresource with an options body.
pub async fn put(
    client: &kube::Client,
    key: &VmKey,
    resource: &str,
    sub: &str,
    body: &serde_json::Value,
) -> Result<(), String> {
    let req = http::Request::put(path(key, resource, sub))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(kube::client::Body::from(
            serde_json::to_vec(body).unwrap_or_default(),
        ))
        .map_err(|e| e.to_string())?;
    let res = client.send(req).await.map_err(|e| e.to_string())?;
    let code = res.status();
    if code.is_success() {
        return Ok(());
    }
    let body = res
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Err(failure(code, &body))
}

/// The websocket of a VMI's `console` or `vnc`.
pub async fn connect(client: &kube::Client, key: &VmKey, sub: &str) -> Result<Stream, String> {
    let ws_key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
    let req = http::Request::get(path(key, "virtualmachineinstances", sub))
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "websocket")
        .header(http::header::SEC_WEBSOCKET_VERSION, "13")
        .header(http::header::SEC_WEBSOCKET_KEY, &ws_key)
        .header(http::header::SEC_WEBSOCKET_PROTOCOL, SUBPROTOCOL)
        .body(kube::client::Body::empty())
        .map_err(|e| e.to_string())?;
    let res = client.send(req).await.map_err(|e| e.to_string())?;
    let code = res.status();
    if code != http::StatusCode::SWITCHING_PROTOCOLS {
        let body: Bytes = res
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err(failure(code, &body));
    }
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(ws_key.as_bytes());
    if res
        .headers()
        .get(http::header::SEC_WEBSOCKET_ACCEPT)
        .map(|v| v.as_bytes())
        != Some(accept.as_bytes())
    {
        return Err("the server's websocket handshake does not match ours".into());
    }
    let upgraded = hyper::upgrade::on(res).await.map_err(|e| e.to_string())?;
    Ok(WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_failures_read_as_virtctl_reads_them() {
        let key = VmKey::new("ns", "vm").unwrap();
        assert_eq!(
            path(&key, "virtualmachines", "start"),
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/start"
        );
        let status = br#"{"kind":"Status","message":"VMI is not running","code":400}"#;
        assert_eq!(
            failure(http::StatusCode::BAD_REQUEST, status),
            "VMI is not running"
        );
        assert_eq!(
            failure(http::StatusCode::UNAUTHORIZED, b"no\n"),
            "401 Unauthorized: no"
        );
    }
}
