//! DHCP for the guest behind KubeVirt's masquerade binding.
//!
//! Every VM's namespace has the same layout (bridge `k6t-eth0` at 10.0.2.1,
//! guest at 10.0.2.2), so each guest needs exactly one static lease. Rather
//! than run a DHCP daemon per VM, kvirtd opens one UDP socket *inside* each
//! namespace and serves all of them from its own runtime: a socket keeps the
//! namespace it was created in, whichever thread later uses it.
//!
//! The exchange itself ([`respond`]) is a pure function of the request and the
//! VM's [`LeaseConfig`]; the socket plumbing is kept thin around it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Name};
use nix::sched::{setns, CloneFlags};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, warn, Instrument};

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
/// A day: long enough that a kvirtd restart never expires a lease, short
/// enough that guests pick up changed DNS servers on renewal.
pub const DEFAULT_LEASE_SECS: u32 = 24 * 60 * 60;
/// RFC 2132 §5.1: the smallest MTU option a client may be sent.
const MIN_MTU: u16 = 68;
/// `0xffffffff` means "infinite" in the lease time option (RFC 2131 §3.3).
const INFINITE_LEASE: u32 = u32::MAX;
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
    #[error("decoding DHCP message: {0}")]
    Decode(#[from] dhcproto::error::DecodeError),
    #[error("encoding DHCP reply: {0}")]
    Encode(#[from] dhcproto::error::EncodeError),
}

/// The one lease a VM's guest gets, and the options that go with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Only this MAC is answered: the namespace holds exactly one guest.
    pub client_mac: [u8; 6],
    pub ip: Ipv4Addr,
    pub netmask: Ipv4Addr,
    pub router: Ipv4Addr,
    pub server_id: Ipv4Addr,
    /// Empty means no DNS option (an empty option 6 is malformed).
    pub dns: Vec<Ipv4Addr>,
    /// Below 68 (e.g. 0) means no MTU option.
    pub mtu: u16,
    /// `u32::MAX` is an infinite lease (no renewal times are sent).
    pub lease_secs: u32,
    pub hostname: Option<String>,
    /// Domains separated by whitespace or commas, as in resolv.conf `search`.
    pub domain_search: Option<String>,
}

impl LeaseConfig {
    /// KubeVirt's masquerade addressing: guest 10.0.2.2/24, bridge 10.0.2.1
    /// as router and server.
    pub fn masquerade(client_mac: [u8; 6], dns: Vec<Ipv4Addr>, mtu: u16) -> Self {
        LeaseConfig {
            client_mac,
            ip: Ipv4Addr::new(10, 0, 2, 2),
            netmask: Ipv4Addr::new(255, 255, 255, 0),
            router: Ipv4Addr::new(10, 0, 2, 1),
            server_id: Ipv4Addr::new(10, 0, 2, 1),
            dns,
            mtu,
            lease_secs: DEFAULT_LEASE_SECS,
            hostname: None,
            domain_search: None,
        }
    }
}

/// The reply to `request`, or `None` when the server must stay silent.
///
/// Options are always sent in full, whatever the parameter request list
/// asks: dhcproto keeps options in a map ordered by code, so the client's
/// preferred order cannot be honoured, and every client we care about reads
/// options it did not request.
pub fn respond(request: &Message, lease: &LeaseConfig) -> Option<Message> {
    if request.opcode() != Opcode::BootRequest {
        return None;
    }
    // `hlen` is taken straight from the wire and `Message::chaddr` slices by
    // it, so it must be checked first: hlen > 16 would panic.
    if request.htype() != HType::Eth || request.hlen() != 6 || request.chaddr() != lease.client_mac
    {
        return None;
    }
    // Nobody relays on a bridge private to one VM; a relayed request is not
    // from our guest.
    if !request.giaddr().is_unspecified() {
        return None;
    }
    let opts = request.opts();
    match opts.msg_type()? {
        MessageType::Discover => Some(lease_reply(request, lease, MessageType::Offer)),
        MessageType::Request => {
            if let Some(DhcpOption::ServerIdentifier(server)) =
                opts.get(OptionCode::ServerIdentifier)
            {
                // SELECTING another server's offer: not ours to answer.
                if *server != lease.server_id {
                    return None;
                }
            }
            // SELECTING and INIT-REBOOT name the address in option 50;
            // RENEWING and REBINDING put it in ciaddr.
            let requested = match opts.get(OptionCode::RequestedIpAddress) {
                Some(DhcpOption::RequestedIpAddress(ip)) => *ip,
                _ if !request.ciaddr().is_unspecified() => request.ciaddr(),
                _ => return None,
            };
            if requested == lease.ip {
                Some(lease_reply(request, lease, MessageType::Ack))
            } else {
                Some(nak(request, lease))
            }
        }
        MessageType::Inform => Some(inform_ack(request, lease)),
        // A static lease has nothing to release; a decline is logged by the
        // server since it means an address conflict we cannot fix.
        _ => None,
    }
}

/// Where to send `reply` (RFC 2131 §4.1, without relays).
///
/// A client with an address (renewing, informing) gets a unicast. Everyone
/// else gets a broadcast: unicasting to `yiaddr` would need an ARP entry the
/// client cannot answer for yet, and broadcast is always acceptable.
pub fn reply_destination(request: &Message, reply: &Message) -> SocketAddrV4 {
    let ciaddr = request.ciaddr();
    if reply.opts().has_msg_type(MessageType::Nak) || ciaddr.is_unspecified() {
        SocketAddrV4::new(Ipv4Addr::BROADCAST, CLIENT_PORT)
    } else {
        SocketAddrV4::new(ciaddr, CLIENT_PORT)
    }
}

/// The addresses of the host's resolvers from a resolv.conf, to hand to the
/// guest.
///
/// Loopback resolvers (systemd-resolved's 127.0.0.53, a local dnsmasq) are
/// skipped: from the guest, 127.x is its own loopback, and the host's is not
/// reachable through the masquerade. On a systemd-resolved host, read
/// `/run/systemd/resolve/resolv.conf`, which lists the real upstreams.
/// IPv6 resolvers are skipped since the guest only gets IPv4 here.
pub fn host_dns(resolv_conf: &str) -> Vec<Ipv4Addr> {
    let mut servers = Vec::new();
    for line in resolv_conf.lines() {
        let line = line.split(['#', ';']).next().unwrap_or_default();
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(Ok(addr)) = words.next().map(str::parse::<Ipv4Addr>) else {
            continue;
        };
        if addr.is_loopback() || addr.is_unspecified() || servers.contains(&addr) {
            continue;
        }
        servers.push(addr);
    }
    servers
}

/// A non-blocking UDP socket on port 67 of `iface`, created inside the
/// network namespace at `netns_path`.
///
/// `setns` changes only the calling thread's namespace, so it happens on a
/// throwaway thread that exits afterwards: no runtime worker ever changes
/// namespace. Blocks briefly; from async code call it via `spawn_blocking`.
pub fn bind_in_netns(netns_path: &Path, iface: &str) -> Result<UdpSocket, DhcpError> {
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
            open_server_socket(&iface).map_err(|(op, source)| DhcpError::Socket {
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

/// Decodes one datagram and works out the reply and where it goes.
fn handle_datagram(
    datagram: &[u8],
    lease: &LeaseConfig,
) -> Result<Option<(Message, Message, SocketAddrV4)>, DhcpError> {
    let request = Message::decode(&mut Decoder::new(datagram))?;
    Ok(respond(&request, lease).map(|reply| {
        let to = reply_destination(&request, &reply);
        (request, reply, to)
    }))
}

/// Answers DHCP on `socket` (from [`bind_in_netns`]) until `cancel` fires
/// or its sender is dropped.
///
/// Fails only if the socket cannot be registered with the runtime; bad
/// input and socket errors are logged and survived.
pub async fn serve(
    socket: UdpSocket,
    lease: LeaseConfig,
    mut cancel: oneshot::Receiver<()>,
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
        let (request, reply, to) = match handle_datagram(&buf[..len], &lease) {
            Ok(Some(exchange)) => exchange,
            Ok(None) => {
                debug!(%from, "DHCP message ignored");
                continue;
            }
            Err(e) => {
                debug!(%from, error = %e, "undecodable DHCP datagram");
                continue;
            }
        };
        if request.opts().has_msg_type(MessageType::Decline) {
            warn!(ip = %lease.ip, "guest declined its address: it is in use on the link");
        }
        let bytes = match reply.to_vec() {
            Ok(bytes) => bytes,
            Err(e) => {
                warn!(error = %e, "encoding DHCP reply failed");
                continue;
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
        lease: LeaseConfig,
    ) -> Result<(), DhcpError> {
        self.stop(id).await;
        let path = netns_path.to_owned();
        let bind_iface = iface.to_owned();
        let socket = tokio::task::spawn_blocking(move || bind_in_netns(&path, &bind_iface))
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
                if let Err(e) = serve(socket, lease, cancelled).await {
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

/// The reply skeleton shared by every message type.
fn base_reply(request: &Message, lease: &LeaseConfig, kind: MessageType) -> Message {
    let mut reply = Message::new_with_id(
        request.xid(),
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        request.giaddr(),
        &lease.client_mac,
    );
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_flags(request.flags());
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::MessageType(kind));
    opts.insert(DhcpOption::ServerIdentifier(lease.server_id));
    // RFC 6842: a client identifier must be echoed back.
    if let Some(DhcpOption::ClientIdentifier(id)) = request.opts().get(OptionCode::ClientIdentifier)
    {
        opts.insert(DhcpOption::ClientIdentifier(id.clone()));
    }
    reply
}

fn lease_reply(request: &Message, lease: &LeaseConfig, kind: MessageType) -> Message {
    let mut reply = base_reply(request, lease, kind);
    reply.set_yiaddr(lease.ip).set_siaddr(lease.server_id);
    // RFC 2131 table 3: an ACK echoes ciaddr, an OFFER leaves it zero.
    if kind == MessageType::Ack {
        reply.set_ciaddr(request.ciaddr());
    }
    insert_config(&mut reply, lease);
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::AddressLeaseTime(lease.lease_secs));
    if lease.lease_secs != INFINITE_LEASE {
        // RFC 2131 §4.4.5 defaults: T1 = 0.5, T2 = 0.875 of the lease.
        let secs = u64::from(lease.lease_secs);
        opts.insert(DhcpOption::Renewal((secs / 2) as u32));
        opts.insert(DhcpOption::Rebinding((secs * 7 / 8) as u32));
    }
    reply
}

/// RFC 2131 §4.3.5: configuration only; no yiaddr and no lease time.
fn inform_ack(request: &Message, lease: &LeaseConfig) -> Message {
    let mut reply = base_reply(request, lease, MessageType::Ack);
    reply
        .set_ciaddr(request.ciaddr())
        .set_siaddr(lease.server_id);
    insert_config(&mut reply, lease);
    reply
}

fn nak(request: &Message, lease: &LeaseConfig) -> Message {
    let mut reply = base_reply(request, lease, MessageType::Nak);
    reply.opts_mut().insert(DhcpOption::Message(format!(
        "only {} is leased to this client",
        lease.ip
    )));
    reply
}

fn insert_config(reply: &mut Message, lease: &LeaseConfig) {
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::SubnetMask(lease.netmask));
    opts.insert(DhcpOption::Router(vec![lease.router]));
    if !lease.dns.is_empty() {
        opts.insert(DhcpOption::DomainNameServer(lease.dns.clone()));
    }
    if lease.mtu >= MIN_MTU {
        opts.insert(DhcpOption::InterfaceMtu(lease.mtu));
    }
    if let Some(hostname) = lease.hostname.as_deref().filter(|h| !h.is_empty()) {
        opts.insert(DhcpOption::Hostname(hostname.to_owned()));
    }
    let search = domain_search(lease.domain_search.as_deref().unwrap_or_default());
    if !search.is_empty() {
        opts.insert(DhcpOption::DomainSearch(search));
    }
}

/// Names that do not parse are dropped rather than failing the exchange: a
/// guest without a search list still boots.
fn domain_search(list: &str) -> Vec<Name> {
    list.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|d| !d.is_empty())
        .filter_map(|d| Name::from_ascii(d).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::Flags;

    const MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x00, 0x02, 0x02];
    const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
    const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);

    fn lease() -> LeaseConfig {
        LeaseConfig {
            hostname: Some("testvm".into()),
            domain_search: Some("default.svc.cluster.local, svc.cluster.local".into()),
            ..LeaseConfig::masquerade(
                MAC,
                vec![
                    Ipv4Addr::new(192, 0, 2, 53),
                    Ipv4Addr::new(198, 51, 100, 53),
                ],
                1400,
            )
        }
    }

    fn client(kind: MessageType, mac: &[u8]) -> Message {
        let mut msg = Message::new_with_id(
            0xdead_beef,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            Ipv4Addr::UNSPECIFIED,
            mac,
        );
        msg.opts_mut().insert(DhcpOption::MessageType(kind));
        msg.opts_mut().insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::Router,
            OptionCode::DomainNameServer,
        ]));
        msg
    }

    fn selecting(requested: Ipv4Addr) -> Message {
        let mut msg = client(MessageType::Request, &MAC);
        msg.opts_mut()
            .insert(DhcpOption::RequestedIpAddress(requested));
        msg.opts_mut().insert(DhcpOption::ServerIdentifier(GATEWAY));
        msg
    }

    fn renewing(ciaddr: Ipv4Addr) -> Message {
        let mut msg = client(MessageType::Request, &MAC);
        msg.set_ciaddr(ciaddr);
        msg
    }

    /// What goes on the wire and back, so the tests see what a client sees.
    fn round_trip(msg: &Message) -> Message {
        Message::decode(&mut Decoder::new(&msg.to_vec().unwrap())).unwrap()
    }

    fn opt(msg: &Message, code: OptionCode) -> Option<&DhcpOption> {
        msg.opts().get(code)
    }

    fn assert_lease_options(reply: &Message) {
        assert_eq!(
            opt(reply, OptionCode::SubnetMask),
            Some(&DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)))
        );
        assert_eq!(
            opt(reply, OptionCode::Router),
            Some(&DhcpOption::Router(vec![GATEWAY]))
        );
        assert_eq!(
            opt(reply, OptionCode::DomainNameServer),
            Some(&DhcpOption::DomainNameServer(lease().dns))
        );
        assert_eq!(
            opt(reply, OptionCode::InterfaceMtu),
            Some(&DhcpOption::InterfaceMtu(1400))
        );
        assert_eq!(
            opt(reply, OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(GATEWAY))
        );
        assert_eq!(
            opt(reply, OptionCode::Hostname),
            Some(&DhcpOption::Hostname("testvm".into()))
        );
        let Some(DhcpOption::DomainSearch(names)) = opt(reply, OptionCode::DomainSearch) else {
            panic!("no domain search in {reply:?}");
        };
        let names: Vec<String> = names.iter().map(|n| n.to_ascii()).collect();
        assert_eq!(names, ["default.svc.cluster.local.", "svc.cluster.local."]);
    }

    #[test]
    fn discover_gets_an_offer_of_the_guest_address() {
        let mut discover = client(MessageType::Discover, &MAC);
        discover.set_flags(Flags::default().set_broadcast());
        let offer = round_trip(&respond(&discover, &lease()).unwrap());

        assert_eq!(offer.opcode(), Opcode::BootReply);
        assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
        assert_eq!(offer.xid(), 0xdead_beef);
        assert!(offer.flags().broadcast());
        assert_eq!(offer.chaddr(), MAC);
        assert_eq!(offer.yiaddr(), GUEST);
        assert_eq!(offer.siaddr(), GATEWAY);
        assert_eq!(offer.ciaddr(), Ipv4Addr::UNSPECIFIED);
        assert_lease_options(&offer);
        assert_eq!(
            opt(&offer, OptionCode::AddressLeaseTime),
            Some(&DhcpOption::AddressLeaseTime(86400))
        );
        assert_eq!(
            opt(&offer, OptionCode::Renewal),
            Some(&DhcpOption::Renewal(43200))
        );
        assert_eq!(
            opt(&offer, OptionCode::Rebinding),
            Some(&DhcpOption::Rebinding(75600))
        );
        assert_eq!(
            reply_destination(&discover, &offer),
            SocketAddrV4::new(Ipv4Addr::BROADCAST, 68)
        );
    }

    #[test]
    fn request_for_the_guest_address_is_acked() {
        let init_reboot = {
            let mut msg = client(MessageType::Request, &MAC);
            msg.opts_mut().insert(DhcpOption::RequestedIpAddress(GUEST));
            msg
        };
        for request in [selecting(GUEST), init_reboot, renewing(GUEST)] {
            let ack = round_trip(&respond(&request, &lease()).unwrap());
            assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack), "{request:?}");
            assert_eq!(ack.xid(), request.xid());
            assert_eq!(ack.yiaddr(), GUEST);
            assert_eq!(ack.ciaddr(), request.ciaddr());
            assert_eq!(ack.chaddr(), MAC);
            assert_lease_options(&ack);
            assert!(opt(&ack, OptionCode::AddressLeaseTime).is_some());
        }
    }

    #[test]
    fn request_for_another_address_is_naked() {
        let other = Ipv4Addr::new(10, 0, 2, 99);
        for request in [selecting(other), renewing(other)] {
            let nak = round_trip(&respond(&request, &lease()).unwrap());
            assert_eq!(nak.opts().msg_type(), Some(MessageType::Nak));
            assert_eq!(nak.yiaddr(), Ipv4Addr::UNSPECIFIED);
            assert_eq!(nak.ciaddr(), Ipv4Addr::UNSPECIFIED);
            assert!(opt(&nak, OptionCode::AddressLeaseTime).is_none());
            assert!(opt(&nak, OptionCode::Router).is_none());
            assert_eq!(
                opt(&nak, OptionCode::ServerIdentifier),
                Some(&DhcpOption::ServerIdentifier(GATEWAY))
            );
            // Even a client that claims an address learns of the NAK by
            // broadcast: the address it claims may not be usable.
            assert_eq!(
                reply_destination(&request, &nak),
                SocketAddrV4::new(Ipv4Addr::BROADCAST, 68)
            );
        }
    }

    #[test]
    fn request_selecting_another_server_is_ignored() {
        let mut request = selecting(GUEST);
        request
            .opts_mut()
            .insert(DhcpOption::ServerIdentifier(Ipv4Addr::new(10, 0, 2, 254)));
        assert_eq!(respond(&request, &lease()), None);
    }

    #[test]
    fn request_naming_no_address_is_ignored() {
        let request = client(MessageType::Request, &MAC);
        assert_eq!(respond(&request, &lease()), None);
    }

    #[test]
    fn other_macs_get_no_answer() {
        let stranger = [0x02, 0, 0, 0, 0, 0x99];
        for kind in [
            MessageType::Discover,
            MessageType::Request,
            MessageType::Inform,
        ] {
            let mut msg = client(kind, &stranger);
            msg.opts_mut().insert(DhcpOption::RequestedIpAddress(GUEST));
            assert_eq!(respond(&msg, &lease()), None, "{kind:?}");
        }
        // Our MAC with a different hardware length is someone else too.
        let long = [MAC.as_slice(), &[0, 0]].concat();
        assert_eq!(
            respond(&client(MessageType::Discover, &long), &lease()),
            None
        );
    }

    #[test]
    fn release_decline_and_replies_get_no_answer() {
        for kind in [
            MessageType::Release,
            MessageType::Decline,
            MessageType::Offer,
        ] {
            assert_eq!(respond(&client(kind, &MAC), &lease()), None, "{kind:?}");
        }
        let mut reply = client(MessageType::Discover, &MAC);
        reply.set_opcode(Opcode::BootReply);
        assert_eq!(respond(&reply, &lease()), None);
        let mut bootp = client(MessageType::Discover, &MAC);
        bootp.opts_mut().clear();
        assert_eq!(respond(&bootp, &lease()), None);
    }

    #[test]
    fn relayed_requests_get_no_answer() {
        let mut msg = client(MessageType::Discover, &MAC);
        msg.set_giaddr(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(respond(&msg, &lease()), None);
    }

    #[test]
    fn renewal_is_acked_by_unicast_to_ciaddr() {
        let request = renewing(GUEST);
        let ack = respond(&request, &lease()).unwrap();
        assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
        assert_eq!(
            reply_destination(&request, &ack),
            SocketAddrV4::new(GUEST, 68)
        );
    }

    #[test]
    fn inform_is_acked_without_a_lease() {
        let mut inform = client(MessageType::Inform, &MAC);
        inform.set_ciaddr(GUEST);
        let ack = round_trip(&respond(&inform, &lease()).unwrap());
        assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
        assert_eq!(ack.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(ack.ciaddr(), GUEST);
        assert_lease_options(&ack);
        for code in [
            OptionCode::AddressLeaseTime,
            OptionCode::Renewal,
            OptionCode::Rebinding,
        ] {
            assert!(opt(&ack, code).is_none(), "{code:?}");
        }
        assert_eq!(
            reply_destination(&inform, &ack),
            SocketAddrV4::new(GUEST, 68)
        );
    }

    #[test]
    fn client_identifier_is_echoed() {
        let mut discover = client(MessageType::Discover, &MAC);
        let id = [&[1u8][..], &MAC].concat();
        discover
            .opts_mut()
            .insert(DhcpOption::ClientIdentifier(id.clone()));
        let offer = respond(&discover, &lease()).unwrap();
        assert_eq!(
            opt(&offer, OptionCode::ClientIdentifier),
            Some(&DhcpOption::ClientIdentifier(id))
        );
    }

    #[test]
    fn optional_options_are_left_out_when_unset() {
        let bare = LeaseConfig {
            lease_secs: INFINITE_LEASE,
            ..LeaseConfig::masquerade(MAC, Vec::new(), 0)
        };
        let offer = round_trip(&respond(&client(MessageType::Discover, &MAC), &bare).unwrap());
        for code in [
            OptionCode::DomainNameServer,
            OptionCode::InterfaceMtu,
            OptionCode::Hostname,
            OptionCode::DomainSearch,
            OptionCode::Renewal,
            OptionCode::Rebinding,
        ] {
            assert!(opt(&offer, code).is_none(), "{code:?}");
        }
        assert_eq!(
            opt(&offer, OptionCode::AddressLeaseTime),
            Some(&DhcpOption::AddressLeaseTime(u32::MAX))
        );
        assert_eq!(offer.yiaddr(), GUEST);
    }

    #[test]
    fn garbage_is_a_decode_error_or_silence_never_a_panic() {
        for garbage in [&b""[..], b"hello", &[0xff; 300], &[0; 240]] {
            match handle_datagram(garbage, &lease()) {
                Err(DhcpError::Decode(_)) | Ok(None) => {}
                other => panic!("{garbage:?}: {other:?}"),
            }
        }
        let valid = client(MessageType::Discover, &MAC).to_vec().unwrap();
        assert!(handle_datagram(&valid, &lease()).unwrap().is_some());
        // dhcproto decodes any hardware length, and its `chaddr()` would
        // slice out of bounds for one beyond the 16-byte field.
        let mut bad_hlen = valid.clone();
        bad_hlen[2] = 200;
        assert!(handle_datagram(&bad_hlen, &lease()).unwrap().is_none());
        // Every truncation of a valid request is survivable too.
        for len in 0..valid.len() {
            let _ = handle_datagram(&valid[..len], &lease());
        }
    }

    #[test]
    fn host_dns_keeps_reachable_ipv4_resolvers_in_order() {
        let conf = "\
# Generated by NetworkManager
search example.com
nameserver 192.0.2.1
nameserver 2001:db8::1
nameserver 127.0.0.53
; nameserver 192.0.2.9
nameserver\t198.51.100.7 # secondary
nameserver 192.0.2.1
nameserver not-an-address
nameserver
options edns0 trust-ad
";
        assert_eq!(
            host_dns(conf),
            [Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(198, 51, 100, 7)]
        );
    }

    #[test]
    fn host_dns_of_systemd_resolved_stub_is_empty() {
        let conf = "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch .\n";
        assert!(host_dns(conf).is_empty());
        assert!(host_dns("").is_empty());
    }

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
