//! DHCP (and DHCPv6) for the guest behind KubeVirt's masquerade binding:
//! the servers.
//!
//! Rather than run a DHCP daemon per VM, kvirtd opens one UDP socket
//! *inside* each VM's namespace and serves all of them from its own
//! runtime: a socket keeps the namespace it was created in, whichever
//! thread later uses it. What to answer is `core::dhcp`'s pure exchange;
//! the socket plumbing here is kept thin around it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::core::dhcp::{handle_datagram, LeaseConfig, SERVER_PORT};
use crate::core::dhcp6::Lease6;
use dhcproto::v4::MessageType;
use dhcproto::Encodable;
use nix::sched::{setns, CloneFlags};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, warn, Instrument};

/// Bigger than any DHCP message on an Ethernet link; a truncated datagram
/// would only fail to decode.
const RECV_BUFFER: usize = 4096;
/// Pause after a receive error so a persistently failing socket (e.g. its
/// interface vanished) does not spin a worker.
const RECV_ERROR_BACKOFF: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum DhcpError {
    #[error("opening network namespace {path}: {source}")]
    OpenNetns { path: PathBuf, source: io::Error },
    #[error("entering network namespace {path}: {source}")]
    EnterNetns { path: PathBuf, source: nix::Error },
    #[error("DHCP socket on {iface} in {path}: {op}: {source}")]
    Socket {
        path: PathBuf,
        iface: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("starting a thread to enter {path}: {source}")]
    Thread { path: PathBuf, source: io::Error },
    #[error("the thread entering {path} panicked")]
    ThreadPanicked { path: PathBuf },
    #[error("registering the DHCP socket with the runtime: {0}")]
    Runtime(io::Error),
}

/// What one server hands out: an IPv4 lease (DHCP, port 67) or an IPv6
/// one (DHCPv6, port 547).
#[derive(Clone, Debug)]
pub enum ServerLease {
    V4(LeaseConfig),
    V6(Lease6),
}

impl From<LeaseConfig> for ServerLease {
    fn from(l: LeaseConfig) -> Self {
        ServerLease::V4(l)
    }
}

impl From<Lease6> for ServerLease {
    fn from(l: Lease6) -> Self {
        ServerLease::V6(l)
    }
}

/// A non-blocking UDP socket on port 67 of `iface`, created inside the
/// network namespace at `netns_path`.
///
/// `setns` changes only the calling thread's namespace, so it happens on a
/// throwaway thread that exits afterwards: no runtime worker ever changes
/// namespace. Blocks briefly; from async code call it via `spawn_blocking`.
pub fn bind_in_netns(netns_path: &Path, iface: &str) -> Result<UdpSocket, DhcpError> {
    bind_family_in_netns(netns_path, iface, false)
}

/// [`bind_in_netns`] for DHCPv6: port 547, joined to the servers' group
/// `ff02::1:2` on `iface`.
pub fn bind6_in_netns(netns_path: &Path, iface: &str) -> Result<UdpSocket, DhcpError> {
    bind_family_in_netns(netns_path, iface, true)
}

fn bind_family_in_netns(netns_path: &Path, iface: &str, v6: bool) -> Result<UdpSocket, DhcpError> {
    let path = netns_path.to_owned();
    let ns = File::open(&path).map_err(|source| DhcpError::OpenNetns {
        path: path.clone(),
        source,
    })?;
    let thread_path = path.clone();
    let iface = iface.to_owned();
    std::thread::Builder::new()
        .name("kvirt-dhcp-ns".into())
        .spawn(move || {
            setns(&ns, CloneFlags::CLONE_NEWNET).map_err(|source| DhcpError::EnterNetns {
                path: thread_path.clone(),
                source,
            })?;
            let socket = if v6 {
                open_server_socket6(&iface)
            } else {
                open_server_socket(&iface)
            };
            socket.map_err(|(op, source)| DhcpError::Socket {
                path: thread_path,
                iface,
                op,
                source,
            })
        })
        .map_err(|source| DhcpError::Thread {
            path: path.clone(),
            source,
        })?
        .join()
        .map_err(|_| DhcpError::ThreadPanicked { path })?
}

fn open_server_socket(iface: &str) -> Result<UdpSocket, (&'static str, io::Error)> {
    let socket =
        Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).map_err(|e| ("socket", e))?;
    // Lets a replacement server bind while the old socket is still closing.
    socket
        .set_reuse_address(true)
        .map_err(|e| ("SO_REUSEADDR", e))?;
    socket
        .set_broadcast(true)
        .map_err(|e| ("SO_BROADCAST", e))?;
    // Keeps both the broadcasts we receive and those we send on this bridge.
    socket
        .bind_device(Some(iface.as_bytes()))
        .map_err(|e| ("SO_BINDTODEVICE", e))?;
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, SERVER_PORT));
    socket.bind(&addr.into()).map_err(|e| ("bind :67", e))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| ("O_NONBLOCK", e))?;
    Ok(socket.into())
}

/// All DHCPv6 relay agents and servers (RFC 8415 §7.1).
const ALL_DHCP_SERVERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 1, 2);

fn open_server_socket6(iface: &str) -> Result<UdpSocket, (&'static str, io::Error)> {
    // Looked up here, inside the namespace, where the name means this link.
    let index = nix::net::if_::if_nametoindex(iface).map_err(|e| ("if_nametoindex", e.into()))?;
    let socket =
        Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP)).map_err(|e| ("socket", e))?;
    socket.set_only_v6(true).map_err(|e| ("IPV6_V6ONLY", e))?;
    socket
        .set_reuse_address(true)
        .map_err(|e| ("SO_REUSEADDR", e))?;
    socket
        .bind_device(Some(iface.as_bytes()))
        .map_err(|e| ("SO_BINDTODEVICE", e))?;
    let addr = SocketAddr::from((Ipv6Addr::UNSPECIFIED, crate::core::dhcp6::SERVER_PORT));
    socket.bind(&addr.into()).map_err(|e| ("bind :547", e))?;
    socket
        .join_multicast_v6(&ALL_DHCP_SERVERS, index)
        .map_err(|e| ("join ff02::1:2", e))?;
    socket
        .set_nonblocking(true)
        .map_err(|e| ("O_NONBLOCK", e))?;
    Ok(socket.into())
}

/// Answers DHCPv6 on `socket` (from [`bind6_in_netns`]) until `cancel`
/// fires: each reply goes back to where its request came from (the
/// client's link-local address and port).
pub async fn serve6(
    socket: UdpSocket,
    lease: Lease6,
    cancel: oneshot::Receiver<()>,
) -> Result<(), DhcpError> {
    serve_with(socket, cancel, |datagram, from| {
        let reply = crate::core::dhcp6::handle_datagram(datagram, &lease);
        if reply.is_none() {
            debug!(%from, "DHCPv6 message ignored");
        }
        reply.map(|r| (r, from))
    })
    .await
}

/// Answers DHCP on `socket` (from [`bind_in_netns`]) until `cancel` fires
/// or its sender is dropped.
///
/// Fails only if the socket cannot be registered with the runtime; bad
/// input and socket errors are logged and survived.
pub async fn serve(
    socket: UdpSocket,
    lease: LeaseConfig,
    cancel: oneshot::Receiver<()>,
) -> Result<(), DhcpError> {
    serve_with(socket, cancel, |datagram, from| {
        answer(datagram, from, &lease)
    })
    .await
}

/// What to send for one DHCP datagram, and where.
fn answer(datagram: &[u8], from: SocketAddr, lease: &LeaseConfig) -> Option<(Vec<u8>, SocketAddr)> {
    let (request, reply, to) = match handle_datagram(datagram, lease) {
        Ok(Some(exchange)) => exchange,
        Ok(None) => {
            debug!(%from, "DHCP message ignored");
            return None;
        }
        Err(e) => {
            debug!(%from, error = %e, "undecodable DHCP datagram");
            return None;
        }
    };
    if request.opts().has_msg_type(MessageType::Decline) {
        warn!(ip = %lease.ip, "guest declined its address: it is in use on the link");
    }
    let bytes = match reply.to_vec() {
        Ok(bytes) => bytes,
        Err(e) => {
            warn!(error = %e, "encoding DHCP reply failed");
            return None;
        }
    };
    debug!(
        xid = format_args!("{:#010x}", request.xid()),
        request = ?request.opts().msg_type(),
        reply = ?reply.opts().msg_type(),
        yiaddr = %reply.yiaddr(),
        %to,
        "DHCP exchange"
    );
    Some((bytes, SocketAddr::V4(to)))
}

/// The receive loop both servers share: bad input is the answer's to
/// refuse, socket errors are logged and survived.
async fn serve_with(
    socket: UdpSocket,
    mut cancel: oneshot::Receiver<()>,
    mut answer: impl FnMut(&[u8], SocketAddr) -> Option<(Vec<u8>, SocketAddr)>,
) -> Result<(), DhcpError> {
    let socket = tokio::net::UdpSocket::from_std(socket).map_err(DhcpError::Runtime)?;
    let mut buf = vec![0u8; RECV_BUFFER];
    loop {
        let received = tokio::select! {
            _ = &mut cancel => return Ok(()),
            received = socket.recv_from(&mut buf) => received,
        };
        let (len, from) = match received {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "DHCP receive failed");
                tokio::select! {
                    _ = &mut cancel => return Ok(()),
                    _ = tokio::time::sleep(RECV_ERROR_BACKOFF) => continue,
                }
            }
        };
        let Some((bytes, to)) = answer(&buf[..len], from) else {
            continue;
        };
        if let Err(e) = socket.send_to(&bytes, to).await {
            warn!(%to, error = %e, "DHCP send failed");
        }
    }
}

/// One DHCP server task per VM, keyed by VM id.
///
/// `start` replaces whatever runs for the id, so kvirtd can call it both on
/// create and when adopting VMs after its own restart. Dropping this stops
/// every server (their cancel senders go away).
#[derive(Debug, Default)]
pub struct DhcpServers {
    running: Mutex<HashMap<String, Running>>,
}

#[derive(Debug)]
struct Running {
    cancel: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Running {
    async fn shut_down(self, id: &str) {
        let _ = self.cancel.send(());
        if let Err(e) = self.task.await {
            warn!(vm = id, error = %e, "DHCP server task failed");
        }
    }
}

impl DhcpServers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves `lease` on `iface` inside the namespace at `netns_path`,
    /// replacing any server already running for `id`. On error, no server
    /// runs for `id`: the old one served a namespace being replaced anyway.
    pub async fn start(
        &self,
        id: &str,
        netns_path: &Path,
        iface: &str,
        lease: impl Into<ServerLease>,
    ) -> Result<(), DhcpError> {
        self.stop(id).await;
        let lease = lease.into();
        let path = netns_path.to_owned();
        let bind_iface = iface.to_owned();
        let v6 = matches!(lease, ServerLease::V6(_));
        let socket =
            tokio::task::spawn_blocking(move || bind_family_in_netns(&path, &bind_iface, v6))
                .await
                .map_err(|_| DhcpError::ThreadPanicked {
                    path: netns_path.to_owned(),
                })??;
        let (cancel, cancelled) = oneshot::channel();
        // Created inside the VM's span (the reconcile that set it up), so
        // the task's lines still name the VM.
        let span = tracing::info_span!("dhcp", iface);
        let task = tokio::spawn(
            async move {
                let served = match lease {
                    ServerLease::V4(l) => serve(socket, l, cancelled).await,
                    ServerLease::V6(l) => serve6(socket, l, cancelled).await,
                };
                if let Err(e) = served {
                    warn!(error = %e, "DHCP server stopped");
                }
            }
            .instrument(span),
        );
        let raced = self.lock().insert(id.to_owned(), Running { cancel, task });
        // A concurrent start for the same id got there first; the newest wins.
        if let Some(old) = raced {
            old.shut_down(id).await;
        }
        Ok(())
    }

    /// Stops the server for `id` and waits until its socket is closed.
    /// Returns whether one was running.
    pub async fn stop(&self, id: &str) -> bool {
        let Some(running) = self.lock().remove(id) else {
            return false;
        };
        running.shut_down(id).await;
        true
    }

    /// Ids with a server running, sorted.
    /// Whether a server runs for `id` (a lookup: every VM's pass asks).
    pub fn serves(&self, id: &str) -> bool {
        self.lock().contains_key(id)
    }

    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().keys().cloned().collect();
        ids.sort();
        ids
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        // The map stays consistent even if a holder panicked: every
        // operation on it is a single insert or remove.
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::dhcp::tests::*;
    use crate::core::dhcp::CLIENT_PORT;
    use dhcproto::v4::Message;
    use dhcproto::{Decodable, Decoder};
    use std::net::SocketAddrV4;

    /// Tier 2: a real namespace pair and busybox's DHCP client.
    mod netns {
        use super::*;
        use std::process::{Command, Output, Stdio};
        use std::time::Instant;

        const CLIENT_DEADLINE: Duration = Duration::from_secs(30);

        /// A throwaway namespace, deleted on drop so a failing test leaves
        /// nothing behind.
        struct TempNetns(String);

        impl TempNetns {
            fn new(name: String) -> Self {
                ip(&["netns", "add", &name]);
                TempNetns(name)
            }
            fn path(&self) -> PathBuf {
                Path::new("/run/netns").join(&self.0)
            }
            fn ip(&self, args: &[&str]) {
                ip(&[&["-n", &self.0][..], args].concat());
            }
        }

        impl Drop for TempNetns {
            fn drop(&mut self) {
                let _ = Command::new("ip")
                    .args(["netns", "del", &self.0])
                    .stderr(Stdio::null())
                    .status();
            }
        }

        fn ip(args: &[&str]) {
            let out = Command::new("ip").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }

        fn can_run() -> bool {
            let ok = nix::unistd::geteuid().is_root()
                && Path::new("/usr/bin/busybox").exists()
                && Command::new("ip")
                    .arg("-V")
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("skipping: needs root, ip and /usr/bin/busybox");
            }
            ok
        }

        /// The VM's namespace with KubeVirt's bridge, and a guest namespace
        /// whose `guest0` sits on that bridge in place of QEMU's tap.
        fn topology(tag: &str) -> (TempNetns, TempNetns) {
            let pid = std::process::id();
            let vm = TempNetns::new(format!("kvirt-dhcptest-{pid}-{tag}-vm"));
            let guest = TempNetns::new(format!("kvirt-dhcptest-{pid}-{tag}-g"));
            vm.ip(&["link", "add", "k6t-eth0", "type", "bridge"]);
            vm.ip(&["link", "set", "k6t-eth0", "address", "02:00:00:00:00:00"]);
            vm.ip(&["addr", "add", "10.0.2.1/24", "dev", "k6t-eth0"]);
            vm.ip(&["link", "set", "k6t-eth0", "up"]);
            vm.ip(&[
                "link", "add", "tap0", "type", "veth", "peer", "name", "guest0", "netns", &guest.0,
            ]);
            vm.ip(&["link", "set", "tap0", "master", "k6t-eth0", "up"]);
            let mac = MAC.map(|b| format!("{b:02x}")).join(":");
            guest.ip(&["link", "set", "guest0", "address", &mac, "up"]);
            (vm, guest)
        }

        /// Runs udhcpc in `guest` and returns its exit, output and the
        /// variables its script saw on `bound`, if it got that far.
        async fn udhcpc(
            guest: &TempNetns,
            dir: &Path,
            attempts: &str,
        ) -> (Output, Option<HashMap<String, String>>) {
            let script = dir.join("script.sh");
            let result = dir.join("bound.env");
            let _ = std::fs::remove_file(&result);
            std::fs::write(
                &script,
                format!(
                    "#!/bin/sh\n[ \"$1\" = bound ] || exit 0\n\
                     for v in ip subnet router dns mtu search hostname lease; do\n\
                       eval \"echo $v=\\$$v\"\n\
                     done > {0}.tmp && mv {0}.tmp {0}\n",
                    result.display()
                ),
            )
            .unwrap();
            std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
            let mut child = Command::new("ip")
                .args(["netns", "exec", &guest.0, "busybox", "udhcpc"])
                .args(["-i", "guest0", "-n", "-q", "-f", "-T", "1", "-t", attempts])
                .arg("-s")
                .arg(&script)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let deadline = Instant::now() + CLIENT_DEADLINE;
            while child.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let out = child.wait_with_output().unwrap();
                    panic!("udhcpc still running after {CLIENT_DEADLINE:?}: {out:?}");
                }
                // Yield to the server task between polls of the child.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let out = child.wait_with_output().unwrap();
            let env = std::fs::read_to_string(&result).ok().map(|text| {
                text.lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
                    .collect()
            });
            (out, env)
        }

        #[tokio::test]
        async fn busybox_client_gets_the_lease_from_a_namespace_socket() {
            if !can_run() {
                return;
            }
            let (vm, guest) = topology("lease");
            let dir = tempfile::tempdir().unwrap();
            let servers = DhcpServers::new();
            // Twice: start replaces, as when adopting after a restart.
            for _ in 0..2 {
                servers
                    .start("ns_vm", &vm.path(), "k6t-eth0", lease())
                    .await
                    .unwrap();
            }
            assert_eq!(servers.ids(), ["ns_vm"]);

            let (out, env) = udhcpc(&guest, dir.path(), "5").await;
            let env = env.unwrap_or_else(|| panic!("no lease: {out:?}"));
            assert!(out.status.success(), "{out:?}");
            assert_eq!(env["ip"], "10.0.2.2");
            assert_eq!(env["subnet"], "255.255.255.0");
            assert_eq!(env["router"], "10.0.2.1");
            assert_eq!(env["dns"], "192.0.2.53 198.51.100.53");
            assert_eq!(env["mtu"], "1400");
            assert_eq!(env["hostname"], "testvm");
            assert_eq!(env["search"], "default.svc.cluster.local svc.cluster.local");
            assert_eq!(env["lease"], "86400");

            assert!(servers.stop("ns_vm").await);
            assert!(!servers.stop("ns_vm").await);
            assert!(servers.ids().is_empty());
            let (out, env) = udhcpc(&guest, dir.path(), "2").await;
            assert!(env.is_none(), "lease after stop: {out:?}");
            assert!(!out.status.success());
        }

        /// A UDP socket in `ns`, made the way `bind_in_netns` does.
        fn socket_in(ns: &TempNetns, addr: SocketAddrV4) -> UdpSocket {
            let file = File::open(ns.path()).unwrap();
            std::thread::spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET).unwrap();
                UdpSocket::bind(addr).unwrap()
            })
            .join()
            .unwrap()
        }

        #[tokio::test]
        async fn renewal_is_answered_by_unicast() {
            if !can_run() {
                return;
            }
            let (vm, guest) = topology("renew");
            guest.ip(&["addr", "add", "10.0.2.2/24", "dev", "guest0"]);
            let socket = bind_in_netns(&vm.path(), "k6t-eth0").unwrap();
            let (cancel, cancelled) = oneshot::channel();
            let server = tokio::spawn(serve(socket, lease(), cancelled));

            let client = socket_in(&guest, SocketAddrV4::new(GUEST, CLIENT_PORT));
            client.set_nonblocking(true).unwrap();
            let client = tokio::net::UdpSocket::from_std(client).unwrap();
            let request = renewing(GUEST);
            client
                .send_to(&request.to_vec().unwrap(), (GATEWAY, SERVER_PORT))
                .await
                .unwrap();
            let mut buf = [0u8; RECV_BUFFER];
            let (len, from) = tokio::time::timeout(CLIENT_DEADLINE, client.recv_from(&mut buf))
                .await
                .expect("no reply to the renewal")
                .unwrap();
            let ack = Message::decode(&mut Decoder::new(&buf[..len])).unwrap();
            assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
            assert_eq!(ack.xid(), request.xid());
            assert_eq!(ack.ciaddr(), GUEST);
            assert_eq!(from, SocketAddr::from((GATEWAY, SERVER_PORT)));
            drop(cancel);
            server.await.unwrap().unwrap();
        }

        /// A DHCPv6 client socket in `ns` on `iface`: port 546, as a
        /// guest's client binds it.
        fn client6_in(ns: &TempNetns, iface: &str) -> UdpSocket {
            let file = File::open(ns.path()).unwrap();
            let iface = iface.to_owned();
            std::thread::spawn(move || {
                setns(&file, CloneFlags::CLONE_NEWNET).unwrap();
                let s = Socket::new(Domain::IPV6, Type::DGRAM, Some(Protocol::UDP)).unwrap();
                s.bind_device(Some(iface.as_bytes())).unwrap();
                let any =
                    SocketAddr::from((Ipv6Addr::UNSPECIFIED, crate::core::dhcp6::CLIENT_PORT));
                s.bind(&any.into()).unwrap();
                s.set_nonblocking(true).unwrap();
                s.into()
            })
            .join()
            .unwrap()
        }

        /// The DHCPv6 server for real: a Solicit with rapid commit, sent to
        /// the servers' group on the guest's link, gets a Reply leasing
        /// `fd10:0:2::2`, from the server's socket in the VM's namespace.
        #[tokio::test]
        async fn a_dhcpv6_solicit_on_the_link_gets_the_guests_address() {
            use dhcproto::v6::{self, DhcpOption, OptionCode};
            if !can_run() {
                return;
            }
            let (vm, guest) = topology("v6");
            let servers = DhcpServers::new();
            let lease = Lease6::masquerade([2, 0, 0, 0, 0, 0], Vec::new(), 3600);
            servers
                .start("ns_vm#v6", &vm.path(), "k6t-eth0", lease)
                .await
                .unwrap();
            let index = {
                let out = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &guest.0,
                        "cat",
                        "/sys/class/net/guest0/ifindex",
                    ])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout)
                    .trim()
                    .parse::<u32>()
                    .unwrap()
            };
            let client = tokio::net::UdpSocket::from_std(client6_in(&guest, "guest0")).unwrap();
            let mut solicit = v6::Message::new_with_id(v6::MessageType::Solicit, [7, 7, 7]);
            let o = solicit.opts_mut();
            o.insert(DhcpOption::ClientId(vec![
                0, 3, 0, 1, 2, 0x42, 0x0a, 0, 2, 2,
            ]));
            o.insert(DhcpOption::IANA(v6::IANA {
                id: 1,
                t1: 0,
                t2: 0,
                opts: v6::DhcpOptions::new(),
            }));
            o.insert(DhcpOption::RapidCommit);
            let bytes = solicit.to_vec().unwrap();
            let to = std::net::SocketAddrV6::new(
                ALL_DHCP_SERVERS,
                crate::core::dhcp6::SERVER_PORT,
                0,
                index,
            );
            // Both links' own addresses go through duplicate detection
            // first: until then a send or its reply fails, so ask again.
            let deadline = Instant::now() + CLIENT_DEADLINE;
            let mut buf = [0u8; RECV_BUFFER];
            let len = loop {
                assert!(Instant::now() < deadline, "no DHCPv6 reply");
                let _ = client.send_to(&bytes, to).await;
                let wait = tokio::time::timeout(Duration::from_secs(1), client.recv_from(&mut buf));
                if let Ok(Ok((len, _))) = wait.await {
                    break len;
                }
            };
            let reply = v6::Message::decode(&mut Decoder::new(&buf[..len])).unwrap();
            assert_eq!(reply.msg_type(), v6::MessageType::Reply);
            assert_eq!(reply.xid(), [7, 7, 7]);
            let Some(DhcpOption::IANA(ia)) = reply.opts().get(OptionCode::IANA) else {
                panic!("no IA_NA: {reply:?}");
            };
            let Some(DhcpOption::IAAddr(a)) = ia.opts.get(OptionCode::IAAddr) else {
                panic!("no address: {reply:?}");
            };
            assert_eq!(a.addr, crate::core::dhcp6::GUEST);
            assert!(servers.stop("ns_vm#v6").await);
        }

        #[test]
        fn binding_in_a_missing_namespace_fails_cleanly() {
            let err = bind_in_netns(Path::new("/run/netns/kvirt-dhcptest-absent"), "k6t-eth0")
                .unwrap_err();
            assert!(matches!(err, DhcpError::OpenNetns { .. }), "{err}");
            if !can_run() {
                return;
            }
            let (vm, _guest) = topology("noiface");
            let err = bind_in_netns(&vm.path(), "nosuchdev0").unwrap_err();
            assert!(
                matches!(
                    err,
                    DhcpError::Socket {
                        op: "SO_BINDTODEVICE",
                        ..
                    }
                ),
                "{err}"
            );
        }
    }
}
