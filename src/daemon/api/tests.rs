//! The server over real TLS on loopback, with a scripted cluster and a
//! fake VM (a unix socket that echoes): who gets in, what they get, and
//! how console sessions begin and end.

use super::*;
use crate::core::layout::HostLayout;
use crate::core::vmi::{Phase, VirtualMachineInstance};
use crate::daemon::controller::{ActFuture, VmiView};
use futures::{SinkExt, StreamExt};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::Message;

/// A CA and a client certificate it signs (PEM), as a front proxy has.
fn client_pki(cn: &str) -> (String, String, String) {
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, "test-ca");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    let ca = p.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(p, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, &issuer).unwrap();
    (ca.pem(), cert.pem(), key.serialize_pem())
}

struct Scripted;

impl Cluster for Scripted {
    fn review<'a>(
        &'a self,
        user: &'a User,
        _: &'a Access,
    ) -> BoxFuture<'a, Result<(bool, String), String>> {
        Box::pin(async move { Ok((user.name != "mallory", "RBAC: no".to_owned())) })
    }
    fn vmi_node<'a>(&'a self, key: &'a VmKey) -> BoxFuture<'a, Result<Option<String>, ApiError>> {
        Box::pin(async move {
            Ok(match key.name() {
                "here" | "stopped" | "planted" | "fifo" => Some("node-a".into()),
                "there" => Some("node-b".into()),
                _ => None,
            })
        })
    }
    fn vm_request<'a>(
        &'a self,
        key: &'a VmKey,
        _: Verb,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async move { Ok(format!("VM {key} was scheduled")) })
    }
    fn expand_spec<'a>(
        &'a self,
        _: &'a VmKey,
    ) -> BoxFuture<'a, Result<serde_json::Value, ApiError>> {
        Box::pin(async move { Err(ApiError::new(501, "NotImplemented", "no")) })
    }
    fn peer<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<SocketAddr>, String>> {
        Box::pin(async move { Ok(None) })
    }
}

struct View(tokio::sync::watch::Sender<u64>);

impl VmiView for View {
    fn view(&self, id: &str) -> (Option<VirtualMachineInstance>, bool) {
        let (ns, name) = id.split_once('_').unwrap();
        let mut v: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"domain": {"devices": {}}},
        }))
        .unwrap();
        v.status.phase = Some(if name == "here" {
            Phase::Running
        } else {
            Phase::Scheduled
        });
        (Some(v), false)
    }
    fn passes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.0.subscribe()
    }
    fn act(&self, _: &str, _: crate::daemon::controller::VmiAction) -> ActFuture<'_> {
        Box::pin(async { Ok("done".to_owned()) })
    }
    fn guest_details(&self, _: &str) -> crate::daemon::controller::GuestFuture<'_> {
        Box::pin(async {
            Ok(Some(crate::core::guestinfo::GuestDetails {
                users: vec![crate::core::guestinfo::GuestUser {
                    name: "alice".into(),
                    ..Default::default()
                }],
                filesystems: vec![],
            }))
        })
    }
}

struct Fixture {
    api: Arc<Api>,
    pki_dir: std::path::PathBuf,
    _dir: tempfile::TempDir,
    addr: SocketAddr,
    kvirt_ca: String,
    front: (String, String),
    stranger: (String, String),
}

/// kvirtd's API on loopback, and the VM `default/here` whose serial
/// socket echoes what it gets after a greeting.
async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let pki_dir = dir.path().join("pki");
    pki::make(&pki_dir).unwrap();
    let identity = tls::Identity::load(
        &pki_dir.join(pki::CERT),
        &pki_dir.join(pki::KEY),
        &pki_dir.join(pki::CA_CERT),
    )
    .unwrap();
    let (front_ca, front_cert, front_key) = client_pki("front-proxy-client");
    let (_, stranger_cert, stranger_key) = client_pki("front-proxy-client");
    let layout = HostLayout {
        state_dir: dir.path().join("lib"),
        runtime_dir: dir.path().join("run"),
        cache_dir: dir.path().join("cache"),
    };
    let paths = layout.vm(&VmKey::new("default", "here").unwrap());
    std::fs::create_dir_all(&paths.runtime_dir).unwrap();
    let serial = tokio::net::UnixListener::bind(paths.serial_socket()).unwrap();
    tokio::spawn(async move {
        // QEMU's chardev: one client at a time.
        while let Ok((mut s, _)) = serial.accept().await {
            let _ = s.write_all(b"GUEST-HELLO\n").await;
            let mut buf = [0u8; 256];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    // What a hostile VM's user may leave where its console socket goes: a
    // link to another VM's socket, a FIFO.
    let planted = layout.vm(&VmKey::new("default", "planted").unwrap());
    std::fs::create_dir_all(&planted.runtime_dir).unwrap();
    std::os::unix::fs::symlink(paths.serial_socket(), planted.serial_socket()).unwrap();
    let fifo = layout.vm(&VmKey::new("default", "fifo").unwrap());
    std::fs::create_dir_all(&fifo.runtime_dir).unwrap();
    nix::unistd::mkfifo(
        &fifo.serial_socket(),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let vnc = tokio::net::UnixListener::bind(paths.vnc_socket()).unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = vnc.accept().await {
            let _ = s.write_all(b"RFB 003.008\n").await;
            let mut buf = [0u8; 64];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        }
    });
    let (tx, _) = tokio::sync::watch::channel(0);
    let api = Api::new(
        "node-a".into(),
        identity,
        Arc::new(Scripted),
        local::Local {
            view: Arc::new(View(tx)),
            layout,
        },
    )
    .unwrap();
    let data = crate::core::subresource::requestheader::kubeadm_data(&front_ca);
    api.set_front_proxy(RequestHeader::from_data(&data).unwrap())
        .unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, api.clone()));
    Fixture {
        api,
        pki_dir: pki_dir.clone(),
        kvirt_ca: std::fs::read_to_string(pki_dir.join(pki::CA_CERT)).unwrap(),
        _dir: dir,
        addr,
        front: (front_cert, front_key),
        stranger: (stranger_cert, stranger_key),
    }
}

type Conn = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

impl Fixture {
    async fn tls(&self, cert: Option<&(String, String)>) -> std::io::Result<Conn> {
        let roots = tls::roots(self.kvirt_ca.as_bytes(), "ca").unwrap();
        let b = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
        let config = match cert {
            Some((c, k)) => b
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(c.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(k.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => b.with_no_client_auth(),
        };
        let tcp = tokio::net::TcpStream::connect(self.addr).await?;
        let name = ServerName::try_from(tls::SERVICE_NAME).unwrap();
        let mut s = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await?;
        // A refused client certificate shows at the first read (TLS 1.3).
        s.flush().await?;
        Ok(s)
    }

    /// One request; the status code and body, or the transport's error.
    async fn call(
        &self,
        cert: Option<&(String, String)>,
        method: &str,
        path: &str,
        user: Option<&str>,
    ) -> Result<(u16, String), String> {
        let mut s = self.tls(cert).await.map_err(|e| e.to_string())?;
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n"
        );
        if let Some(u) = user {
            req.push_str(&format!("X-Remote-User: {u}\r\nX-Remote-Group: g\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let code = text
            .get(9..12)
            .and_then(|c| c.parse().ok())
            .ok_or(text.clone())?;
        Ok((code, text))
    }

    async fn console(
        &self,
        query: &str,
    ) -> Result<tokio_tungstenite::WebSocketStream<Conn>, (u16, String)> {
        self.stream("here", query).await
    }

    async fn stream(
        &self,
        vm: &str,
        query: &str,
    ) -> Result<tokio_tungstenite::WebSocketStream<Conn>, (u16, String)> {
        let s = self.tls(Some(&self.front)).await.unwrap();
        let req = http::Request::get(format!("wss://x/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/{vm}/{query}"))
            .header("Host", "x")
            .header("Connection", "Upgrade")
            .header("Upgrade", "websocket")
            .header("Sec-WebSocket-Version", "13")
            .header("Sec-WebSocket-Key", tokio_tungstenite::tungstenite::handshake::client::generate_key())
            .header("Sec-WebSocket-Protocol", "plain.kubevirt.io")
            .header("X-Remote-User", "alice")
            .header("X-Remote-Group", "g")
            .body(())
            .unwrap();
        match tokio_tungstenite::client_async(req, s).await {
            Ok((ws, res)) => {
                assert_eq!(res.headers()["sec-websocket-protocol"], "plain.kubevirt.io");
                Ok(ws)
            }
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err((
                r.status().as_u16(),
                String::from_utf8_lossy(r.body().as_deref().unwrap_or_default()).into_owned(),
            )),
            Err(e) => panic!("{e}"),
        }
    }
}

const V1: &str = "/apis/subresources.kubevirt.io/v1";

#[tokio::test]
async fn only_the_front_proxy_names_users_and_rbac_decides() {
    let f = fixture().await;
    let pause = format!("{V1}/namespaces/default/virtualmachineinstances/here/pause");
    // No certificate: 401, whatever the headers say.
    assert_eq!(
        f.call(None, "PUT", &pause, Some("alice")).await.unwrap().0,
        401
    );
    // A certificate of another CA never completes the handshake.
    assert!(f
        .call(Some(&f.stranger), "PUT", &pause, Some("alice"))
        .await
        .is_err());
    // The front proxy without a user: 401; with one RBAC denies: 403.
    assert_eq!(
        f.call(Some(&f.front), "PUT", &pause, None).await.unwrap().0,
        401
    );
    let (code, body) = f
        .call(Some(&f.front), "PUT", &pause, Some("mallory"))
        .await
        .unwrap();
    assert_eq!(code, 403, "{body}");
    assert!(
        body.contains("cannot update resource \\\"virtualmachineinstances/pause\\\""),
        "{body}"
    );
    assert_eq!(
        f.call(Some(&f.front), "PUT", &pause, Some("alice"))
            .await
            .unwrap()
            .0,
        200
    );
    // Discovery and version for any user the front proxy names.
    let (code, body) = f
        .call(Some(&f.front), "GET", V1, Some("system:kube-aggregator"))
        .await
        .unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("virtualmachineinstances/console"), "{body}");
    let (_, body) = f
        .call(Some(&f.front), "GET", &format!("{V1}/version"), Some("u"))
        .await
        .unwrap();
    assert!(body.contains("\"gitVersion\": \"v1.9.0\""), "{body}");
}

#[tokio::test]
async fn answers_follow_virt_api() {
    let f = fixture().await;
    let ns = format!("{V1}/namespaces/default");
    let cases = [
        ("PUT", format!("{ns}/virtualmachines/vm/start"), 202),
        ("GET", format!("{ns}/virtualmachines/vm/start"), 405),
        (
            "PUT",
            format!("{ns}/virtualmachineinstances/nothing/pause"),
            404,
        ),
        // Scheduled, not yet running: pause is a conflict, console a 400
        // (virtctl waits on 400).
        (
            "PUT",
            format!("{ns}/virtualmachineinstances/stopped/pause"),
            409,
        ),
        (
            "GET",
            format!("{ns}/virtualmachineinstances/stopped/console"),
            400,
        ),
        // Runs elsewhere, whose kvirtd publishes no address: 503.
        (
            "PUT",
            format!("{ns}/virtualmachineinstances/there/pause"),
            503,
        ),
        (
            "GET",
            format!("{V1}/namespaces/default/virtualmachineinstances/here/migrate"),
            404,
        ),
    ];
    for (method, path, want) in cases {
        let (code, body) = f
            .call(Some(&f.front), method, &path, Some("alice"))
            .await
            .unwrap();
        assert_eq!(code, want, "{method} {path}: {body}");
    }
}

#[tokio::test]
async fn a_console_carries_bytes_both_ways_and_a_new_session_takes_over() {
    let f = fixture().await;
    let mut first = f.console("console").await.unwrap();
    let Some(Ok(Message::Binary(b))) = first.next().await else {
        panic!("no greeting")
    };
    assert_eq!(&b[..], b"GUEST-HELLO\n");
    first.send(Message::Binary("typed\n".into())).await.unwrap();
    let Some(Ok(Message::Binary(b))) = first.next().await else {
        panic!("no echo")
    };
    assert_eq!(&b[..], b"typed\n");
    // A second console takes over; the first hears why.
    let mut second = f.console("console?preserveSession=true").await.unwrap();
    let Some(Ok(Message::Close(Some(frame)))) = first.next().await else {
        panic!("no close frame")
    };
    assert!(frame.reason.contains("took over"), "{frame:?}");
    let Some(Ok(Message::Binary(b))) = second.next().await else {
        panic!("no greeting")
    };
    assert_eq!(&b[..], b"GUEST-HELLO\n");
}

#[tokio::test]
async fn vnc_keeps_its_session_when_the_newcomer_asks_to_preserve_it() {
    let f = fixture().await;
    let mut first = f.console("vnc").await.unwrap();
    let Some(Ok(Message::Binary(b))) = first.next().await else {
        panic!("no handshake")
    };
    assert_eq!(&b[..], b"RFB 003.008\n");
    let (code, body) = f.console("vnc?preserveSession=true").await.err().unwrap();
    assert_eq!(code, 409);
    assert!(
        body.contains("Active VNC connection. Request denied."),
        "{body}"
    );
    // Without it, the newcomer takes over.
    let _second = f.console("vnc").await.unwrap();
    let Some(Ok(Message::Close(Some(_)))) = first.next().await else {
        panic!("no close frame")
    };
}

#[tokio::test]
async fn a_link_or_fifo_planted_for_the_console_is_never_followed() {
    let f = fixture().await;
    for vm in ["planted", "fifo"] {
        let (code, body) = f.stream(vm, "console").await.err().unwrap();
        assert_eq!(code, 400, "{vm}: {body}");
    }
    // The other VM's console was not taken: its first session greets.
    let mut ws = f.console("console").await.unwrap();
    let Some(Ok(Message::Binary(b))) = ws.next().await else {
        panic!("no greeting")
    };
    assert_eq!(&b[..], b"GUEST-HELLO\n");
}

#[tokio::test]
async fn a_renewed_certificate_serves_new_connections_without_a_restart() {
    let f = fixture().await;
    let served = |s: &Conn| s.get_ref().1.peer_certificates().unwrap()[0].clone();
    let before = served(&f.tls(Some(&f.front)).await.unwrap());
    pki::make(&f.pki_dir).unwrap();
    let renewed = tls::Identity::load(
        &f.pki_dir.join(pki::CERT),
        &f.pki_dir.join(pki::KEY),
        &f.pki_dir.join(pki::CA_CERT),
    )
    .unwrap();
    f.api.set_identity(renewed).unwrap();
    let after = served(&f.tls(Some(&f.front)).await.unwrap());
    assert_ne!(before, after);
    let (code, _) = f.call(Some(&f.front), "GET", V1, Some("u")).await.unwrap();
    assert_eq!(code, 200);
}
