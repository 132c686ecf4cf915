//! The tunnel end to end on loopback, with real TLS: who gets through,
//! and that what gets through arrives unchanged both ways.

use super::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const NAME: &str = "kvirt-api.kvirt.svc";

struct Ca {
    cert: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn ca() -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap().der().clone();
    Ca {
        cert,
        issuer: Issuer::new(params, key),
    }
}

fn leaf(ca: &Ca) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![NAME.to_string()])
        .unwrap()
        .signed_by(&key, &ca.issuer)
        .unwrap();
    let der = PrivateKeyDer::try_from(key.serialize_der()).unwrap();
    (vec![cert.der().clone()], der)
}

fn roots(ca: &Ca) -> Arc<RootCertStore> {
    let mut r = RootCertStore::empty();
    r.add(ca.cert.clone()).unwrap();
    Arc::new(r)
}

fn server_config(ca: &Ca) -> Arc<rustls::ServerConfig> {
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots(ca), provider())
            .build()
            .unwrap();
    let (chain, key) = leaf(ca);
    Arc::new(
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .unwrap(),
    )
}

/// A client trusting `server_ca`, presenting a certificate of `own` if any.
fn client_config(server_ca: &Ca, own: Option<&Ca>) -> Arc<rustls::ClientConfig> {
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots(server_ca));
    Arc::new(match own {
        Some(ca) => {
            let (chain, key) = leaf(ca);
            b.with_client_auth_cert(chain, key).unwrap()
        }
        None => b.with_no_client_auth(),
    })
}

/// A target host: the tunnel's port, and the socket its VM's QEMU listens on.
struct Target {
    _dir: tempfile::TempDir,
    address: SocketAddr,
    qemu: UnixListener,
    routes: Routes,
    dir: PathBuf,
}

async fn target(ca: &Ca) -> Target {
    let dir = tempfile::tempdir().unwrap();
    let qemu = UnixListener::bind(dir.path().join("memory.sock")).unwrap();
    let routes = Routes::default();
    routes.add(
        "uid-1",
        Route {
            dir: dir.path().into(),
            sockets: [(Channel::Memory, "memory.sock".to_string())].into(),
        },
    );
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = tcp.local_addr().unwrap();
    let config = server_config(ca);
    tokio::spawn(serve(tcp, move || config.clone(), routes.clone(), None));
    Target {
        dir: dir.path().into(),
        _dir: dir,
        address,
        qemu,
        routes,
    }
}

fn peer(t: &Target, tls: Arc<rustls::ClientConfig>) -> Peer {
    Peer {
        address: t.address,
        name: ServerName::try_from(NAME).unwrap(),
        tls,
    }
}

/// What a rejected connection got back: the handshake fails, or the first
/// read after it does (TLS 1.3 reports a refused client certificate only
/// there), or it reads end of stream. Never a byte.
async fn got_nothing(t: &Target, tls: Arc<rustls::ClientConfig>, hello: &str) {
    let mut s = match dial(&peer(t, tls), hello).await {
        Ok(s) => s,
        Err(_) => return,
    };
    let _ = s.write_all(b"stolen memory").await;
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await;
    match read.expect("the target cuts the connection") {
        Ok(0) | Err(_) => {}
        Ok(n) => panic!("got {n} bytes: {:?}", &buf[..n]),
    }
}

/// The next connection to the target's QEMU carries `want` first: every
/// refused connection before it reached nothing.
async fn next_connection_is(t: &Target, want: &[u8]) {
    let (mut s, _) = tokio::time::timeout(Duration::from_secs(20), t.qemu.accept())
        .await
        .expect("a connection")
        .unwrap();
    let mut got = vec![0u8; want.len()];
    s.read_exact(&mut got).await.unwrap();
    assert_eq!(got, want);
}

async fn legitimate(t: &Target, ca: &Ca, payload: &[u8]) {
    let mut s = dial(
        &peer(t, client_config(ca, Some(ca))),
        &header("uid-1", Channel::Memory),
    )
    .await
    .unwrap();
    s.write_all(payload).await.unwrap();
    s.flush().await.unwrap();
    next_connection_is(t, payload).await;
}

#[tokio::test]
async fn a_peer_without_kvirts_certificate_gets_nothing() {
    let ca = ca();
    let t = target(&ca).await;
    let hello = header("uid-1", Channel::Memory);
    got_nothing(&t, client_config(&ca, None), &hello).await;
    let stranger = self::ca();
    got_nothing(&t, client_config(&ca, Some(&stranger)), &hello).await;
    // A plain TCP client that sends the header in the clear.
    let mut plain = TcpStream::connect(t.address).await.unwrap();
    plain.write_all(hello.as_bytes()).await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(20), plain.read(&mut buf))
        .await
        .expect("cut")
        .unwrap_or(0);
    assert!(
        !buf[..n].windows(6).any(|w| w == b"stolen"),
        "{:?}",
        &buf[..n]
    );
    legitimate(&t, &ca, b"first real bytes").await;
}

#[tokio::test]
async fn a_peer_reaches_only_prepared_migrations_and_channels() {
    let ca = ca();
    let t = target(&ca).await;
    let good = client_config(&ca, Some(&ca));
    for hello in [
        header("uid-2", Channel::Memory),
        header("uid-1", Channel::Disks),
        "kvirt-migration/1 uid-1 memory extra\n".to_string(),
        "kvirt-migration/1 ../uid-1 memory\n".to_string(),
        "hello\n".to_string(),
        // This target takes no control connections (no daemon handler).
        header("uid-1", Channel::Control),
        format!("{}\n", "x".repeat(MAX_HEADER + 10)),
    ] {
        got_nothing(&t, good.clone(), &hello).await;
    }
    t.routes.remove("uid-1");
    got_nothing(&t, good, &header("uid-1", Channel::Memory)).await;
    t.routes.add(
        "uid-1",
        Route {
            dir: t.dir.clone(),
            sockets: [(Channel::Memory, "memory.sock".to_string())].into(),
        },
    );
    legitimate(&t, &ca, b"after the refusals").await;
}

#[tokio::test]
async fn a_link_planted_in_the_vms_directory_is_not_followed() {
    let ca = ca();
    let t = target(&ca).await;
    // Another VM's socket, and a link to it where the route's socket is.
    let other = tempfile::tempdir().unwrap();
    let victim = UnixListener::bind(other.path().join("memory.sock")).unwrap();
    std::os::unix::fs::symlink(other.path().join("memory.sock"), t.dir.join("planted")).unwrap();
    t.routes.add(
        "uid-3",
        Route {
            dir: t.dir.clone(),
            sockets: [(Channel::Memory, "planted".to_string())].into(),
        },
    );
    let good = client_config(&ca, Some(&ca));
    got_nothing(&t, good, &header("uid-3", Channel::Memory)).await;
    // The victim's listener saw nothing: the first connection it accepts
    // is this probe's.
    let mut probe = UnixStream::connect(other.path().join("memory.sock"))
        .await
        .unwrap();
    probe.write_all(b"probe").await.unwrap();
    let (mut first, _) = victim.accept().await.unwrap();
    let mut got = [0u8; 5];
    first.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"probe");
}

#[tokio::test]
async fn bytes_cross_the_tunnel_both_ways_unchanged() {
    let ca = ca();
    let t = target(&ca).await;
    let src = tempfile::tempdir().unwrap();
    let path = src.path().join("memory.sock");
    let fwd = forward(
        bind(&path).unwrap(),
        peer(&t, client_config(&ca, Some(&ca))),
        "uid-1",
        Channel::Memory,
    );
    let mut qemu_src = UnixStream::connect(&path).await.unwrap();
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let send = {
        let data = data.clone();
        tokio::spawn(async move {
            qemu_src.write_all(&data).await.unwrap();
            let mut back = [0u8; 5];
            qemu_src.read_exact(&mut back).await.unwrap();
            back
        })
    };
    let (mut qemu_dst, _) = t.qemu.accept().await.unwrap();
    let mut got = vec![0u8; data.len()];
    qemu_dst.read_exact(&mut got).await.unwrap();
    assert!(got == data, "the stream arrived changed");
    qemu_dst.write_all(b"ready").await.unwrap();
    assert_eq!(&send.await.unwrap(), b"ready");
    drop(fwd);
}

#[tokio::test]
async fn a_control_connection_reaches_the_daemon_and_its_messages_are_bounded() {
    use serde_json::{json, Value};
    let ca = ca();
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = tcp.local_addr().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let config = server_config(&ca);
    tokio::spawn(serve(
        tcp,
        move || config.clone(),
        Routes::default(),
        Some(tx),
    ));
    let peer = Peer {
        address,
        name: ServerName::try_from(NAME).unwrap(),
        tls: client_config(&ca, Some(&ca)),
    };
    let mut ours = dial(&peer, &header("uid-9", Channel::Control))
        .await
        .unwrap();
    write_message(&mut ours, &json!({"prepare": 1}))
        .await
        .unwrap();
    let (uid, mut theirs) = rx.recv().await.unwrap();
    assert_eq!(uid, "uid-9");
    let m: Value = read_message(&mut theirs).await.unwrap().unwrap();
    assert_eq!(m, json!({"prepare": 1}));
    write_message(&mut theirs, &json!("ready")).await.unwrap();
    let back: Value = read_message(&mut ours).await.unwrap().unwrap();
    assert_eq!(back, json!("ready"));
    // A line longer than a message may be is refused once the bound is
    // passed, not read to its end.
    let big = vec![b'x'; MAX_MESSAGE + 100];
    let writer = tokio::spawn(async move {
        let _ = ours.write_all(&big).await;
        ours
    });
    let r: Result<Option<Value>, _> = read_message(&mut theirs).await;
    assert!(matches!(r, Err(TunnelError::Message(_))), "{r:?}");
    drop(theirs);
    drop(writer.await.unwrap());
    // The end of the stream, between messages, is the end: no error.
    let mut ours = dial(&peer, &header("uid-10", Channel::Control))
        .await
        .unwrap();
    let (_, mut theirs) = rx.recv().await.unwrap();
    ours.shutdown().await.unwrap();
    let end: Option<Value> = read_message(&mut theirs).await.unwrap();
    assert!(end.is_none());
}
