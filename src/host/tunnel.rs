//! The migration tunnel between two kvirtds, as KubeVirt's migration proxy:
//! the VMs' libvirt daemons and QEMUs speak only through unix sockets, and
//! kvirtd carries each connection to the peer host over mutual TLS on one
//! port. The source end listens on a unix socket per channel and opens a
//! TLS connection per accepted connection; the first line on it names the
//! migration and the channel; the target end connects it to the socket the
//! target's daemon or QEMU listens on, found beneath the VM's directory
//! (never by a name a link could redirect).
//!
//! A peer without a certificate of kvirt's CA completes no handshake and
//! gets no byte; a peer with one reaches only migrations this host has
//! prepared, by their uid.

use crate::host::beneath::Beneath;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tracing::{debug, warn};

/// The first bytes on every tunnel connection.
const MAGIC: &str = "kvirt-migration/1";
/// A header line is at most this long: anything longer is not ours.
const MAX_HEADER: usize = 256;
/// A peer that has not completed its handshake and header by then is cut.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections being set up at once; more wait (a flood of handshakes
/// cannot take every task).
const MAX_HANDSHAKES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("bad tunnel header: {0}")]
    Header(String),
    #[error("no prepared migration {0:?} here")]
    Unknown(String),
    #[error("timed out: {0}")]
    Timeout(&'static str),
    #[error("control message: {0}")]
    Message(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> TunnelError {
    let what = what.into();
    move |source| TunnelError::Io { what, source }
}

/// One of a migration's connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// The source daemon to the target's libvirt daemon (peer-to-peer).
    Daemon,
    /// QEMU's migration stream.
    Memory,
    /// The NBD server the target runs for disks that are copied.
    Disks,
    /// kvirtd to kvirtd: the source asks the target to prepare, commit or
    /// abort (JSON lines, [`read_message`] and [`write_message`]).
    Control,
}

impl Channel {
    pub const ALL: [Channel; 4] = [
        Channel::Daemon,
        Channel::Memory,
        Channel::Disks,
        Channel::Control,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Daemon => "daemon",
            Channel::Memory => "memory",
            Channel::Disks => "disks",
            Channel::Control => "control",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

/// The header line: magic, migration uid, channel.
pub fn header(uid: &str, channel: Channel) -> String {
    format!("{MAGIC} {uid} {}\n", channel.as_str())
}

fn parse_header(line: &str) -> Result<(String, Channel), TunnelError> {
    let bad = || TunnelError::Header(line.chars().take(80).collect());
    let mut words = line.trim_end_matches('\n').split(' ');
    let (Some(MAGIC), Some(uid), Some(ch), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(bad());
    };
    let uid_ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    match Channel::parse(ch) {
        Some(c) if uid_ok => Ok((uid.to_string(), c)),
        _ => Err(bad()),
    }
}

/// Reads the header a byte at a time so that nothing past it is consumed.
async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<String, TunnelError> {
    let mut line = Vec::with_capacity(64);
    loop {
        let b = r.read_u8().await.map_err(io("reading the tunnel header"))?;
        if b == b'\n' {
            break;
        }
        line.push(b);
        if line.len() > MAX_HEADER {
            return Err(TunnelError::Header("too long".into()));
        }
    }
    String::from_utf8(line).map_err(|_| TunnelError::Header("not UTF-8".into()))
}

/// Where a prepared migration's channels end on this (the target) host:
/// sockets beneath the VM's directory.
#[derive(Clone, Debug)]
pub struct Route {
    pub dir: PathBuf,
    pub sockets: HashMap<Channel, String>,
}

/// The migrations this host has prepared as a target, by uid.
#[derive(Clone, Debug, Default)]
pub struct Routes(Arc<Mutex<HashMap<String, Route>>>);

impl Routes {
    /// Held only to look up or change a route, never across I/O; a panic
    /// elsewhere while it was held leaves the map whole.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Route>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn add(&self, uid: &str, route: Route) {
        self.lock().insert(uid.into(), route);
    }

    pub fn remove(&self, uid: &str) {
        self.lock().remove(uid);
    }

    fn socket(&self, uid: &str, channel: Channel) -> Result<(PathBuf, String), TunnelError> {
        let routes = self.lock();
        let route = routes
            .get(uid)
            .ok_or_else(|| TunnelError::Unknown(uid.into()))?;
        let name = route
            .sockets
            .get(&channel)
            .ok_or_else(|| TunnelError::Unknown(format!("{uid} {}", channel.as_str())))?;
        Ok((route.dir.clone(), name.clone()))
    }
}

/// A peer's control connection, for the daemon: the migration's uid and
/// the stream after the header.
pub type ControlConn = (String, ControlStream);

/// A control connection after its header.
pub type ControlStream = tokio_rustls::server::TlsStream<TcpStream>;

/// The target end: accepts peers on `listener` for as long as it runs;
/// control connections go to `control` (none: refused).
pub async fn serve(
    listener: TcpListener,
    tls: impl Fn() -> Arc<rustls::ServerConfig>,
    routes: Routes,
    control: Option<tokio::sync::mpsc::UnboundedSender<ControlConn>>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!("migration port: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        // Asked per connection: a renewed certificate serves the next one.
        let acceptor = TlsAcceptor::from(tls());
        let (routes, control) = (routes.clone(), control.clone());
        tokio::spawn(async move {
            let hello = tokio::time::timeout(HELLO_TIMEOUT, accept(acceptor, tcp, &routes));
            let joined = match hello.await {
                Ok(Ok(j)) => j,
                Ok(Err(e)) => return debug!("migration port: {peer}: {e}"),
                Err(_) => return debug!("migration port: {peer}: handshake timed out"),
            };
            drop(permit);
            match joined {
                Joined::Control(uid, tls) => match control {
                    Some(c) if c.send((uid, tls)).is_ok() => {}
                    _ => debug!("migration port: {peer}: this host takes no migrations"),
                },
                Joined::Socket(mut tls, mut unix) => {
                    if let Err(e) = tokio::io::copy_bidirectional(&mut tls, &mut unix).await {
                        debug!("migration port: {peer}: {e}");
                    }
                }
            }
        });
    }
}

enum Joined {
    Control(String, tokio_rustls::server::TlsStream<TcpStream>),
    Socket(tokio_rustls::server::TlsStream<TcpStream>, UnixStream),
}

async fn accept(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    routes: &Routes,
) -> Result<Joined, TunnelError> {
    let mut tls = acceptor.accept(tcp).await.map_err(io("TLS handshake"))?;
    let (uid, channel) = parse_header(&read_header(&mut tls).await?)?;
    if channel == Channel::Control {
        return Ok(Joined::Control(uid, tls));
    }
    let (dir, name) = routes.socket(&uid, channel)?;
    let socket = Beneath::open(&dir)
        .and_then(|d| d.socket(&name))
        .map_err(io(format!("{} {name}", dir.display())))?;
    let unix = UnixStream::connect(socket.path())
        .await
        .map_err(io(format!("connecting {} {name}", dir.display())))?;
    Ok(Joined::Socket(tls, unix))
}

/// The most one control message may be: a VMI with its status.
pub const MAX_MESSAGE: usize = 1 << 20;

/// Sends one control message: a JSON line.
pub async fn write_message<W: AsyncWrite + Unpin, T: serde::Serialize>(
    w: &mut W,
    message: &T,
) -> Result<(), TunnelError> {
    let mut line =
        serde_json::to_vec(message).map_err(|e| TunnelError::Message(format!("encoding: {e}")))?;
    line.push(b'\n');
    w.write_all(&line)
        .await
        .map_err(io("sending a control message"))?;
    w.flush().await.map_err(io("sending a control message"))
}

/// Reads one control message of at most [`MAX_MESSAGE`] bytes, a byte at
/// a time (nothing after it is consumed); `None` at the end of the stream.
pub async fn read_message<R: AsyncRead + Unpin, T: serde::de::DeserializeOwned>(
    r: &mut R,
) -> Result<Option<T>, TunnelError> {
    let mut line = Vec::new();
    loop {
        match r.read_u8().await {
            Ok(b'\n') => break,
            Ok(b) if line.len() < MAX_MESSAGE => line.push(b),
            Ok(_) => {
                return Err(TunnelError::Message(format!(
                    "no complete message within {MAX_MESSAGE} bytes"
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && line.is_empty() => {
                return Ok(None)
            }
            Err(e) => return Err(io("reading a control message")(e)),
        }
    }
    serde_json::from_slice(&line)
        .map(Some)
        .map_err(|e| TunnelError::Message(e.to_string()))
}

/// The source end of one channel: a unix socket that forwards every
/// connection to the peer. Dropping it stops it (the socket file stays
/// for its owner to remove with the VM's directory).
#[derive(Debug)]
pub struct Forward(JoinHandle<()>);

impl Drop for Forward {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Where and as whom the source end dials.
#[derive(Clone)]
pub struct Peer {
    pub address: SocketAddr,
    pub name: ServerName<'static>,
    pub tls: Arc<rustls::ClientConfig>,
}

/// Listens on `listener` (bound by the caller where the VM's QEMU or
/// daemon reaches it) and carries each connection to `peer`.
pub fn forward(listener: UnixListener, peer: Peer, uid: &str, channel: Channel) -> Forward {
    let hello = header(uid, channel);
    Forward(tokio::spawn(async move {
        // Owned here, so that stopping the forward cuts its connections too.
        let mut carried = tokio::task::JoinSet::new();
        loop {
            let unix = match listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    warn!("migration tunnel {}: accept: {e}", channel.as_str());
                    return;
                }
            };
            while carried.try_join_next().is_some() {}
            let (peer, hello) = (peer.clone(), hello.clone());
            carried.spawn(async move {
                if let Err(e) = carry(unix, &peer, &hello).await {
                    warn!("migration tunnel to {}: {e}", peer.address);
                }
            });
        }
    }))
}

async fn carry(mut unix: UnixStream, peer: &Peer, hello: &str) -> Result<(), TunnelError> {
    let mut tls = dial(peer, hello).await?;
    tokio::io::copy_bidirectional(&mut unix, &mut tls)
        .await
        .map_err(io("carrying"))?;
    Ok(())
}

/// The source's end of a tunnel connection.
pub type ClientStream = tokio_rustls::client::TlsStream<TcpStream>;

/// A TLS connection to `peer` that has sent `hello`.
pub async fn dial(peer: &Peer, hello: &str) -> Result<ClientStream, TunnelError> {
    let connect = async {
        let tcp = TcpStream::connect(peer.address)
            .await
            .map_err(io(format!("connecting {}", peer.address)))?;
        let _ = tcp.set_nodelay(true);
        let mut tls = TlsConnector::from(peer.tls.clone())
            .connect(peer.name.clone(), tcp)
            .await
            .map_err(io(format!("TLS to {}", peer.address)))?;
        tls.write_all(hello.as_bytes())
            .await
            .map_err(io("sending the header"))?;
        Ok(tls)
    };
    tokio::time::timeout(HELLO_TIMEOUT, connect)
        .await
        .map_err(|_| TunnelError::Timeout("connecting the migration peer"))?
}

/// Binds a unix socket at `path` (whose directory the caller made safe).
pub fn bind(path: &Path) -> Result<UnixListener, TunnelError> {
    UnixListener::bind(path).map_err(io(format!("binding {}", path.display())))
}

#[cfg(test)]
mod tests;
