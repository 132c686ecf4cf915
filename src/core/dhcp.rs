//! DHCP for the guest behind KubeVirt's masquerade binding: the exchange.
//!
//! Every VM's namespace has the same layout (bridge `k6t-eth0` at 10.0.2.1,
//! guest at 10.0.2.2), so each guest needs exactly one static lease. The
//! exchange ([`respond`]) is a pure function of the request and the VM's
//! [`LeaseConfig`]; `host::dhcp` serves it from a socket in each namespace.

use core::net::{Ipv4Addr, SocketAddrV4};

use dhcproto::error::DecodeError;
use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Name};

pub const SERVER_PORT: u16 = 67;
pub const CLIENT_PORT: u16 = 68;
/// A day: long enough that a kvirtd restart never expires a lease, short
/// enough that guests pick up changed DNS servers on renewal.
pub const DEFAULT_LEASE_SECS: u32 = 24 * 60 * 60;
/// RFC 2132 §5.1: the smallest MTU option a client may be sent.
const MIN_MTU: u16 = 68;
/// `0xffffffff` means "infinite" in the lease time option (RFC 2131 §3.3).
const INFINITE_LEASE: u32 = u32::MAX;

/// The one lease a VM's guest gets, and the options that go with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Only this MAC is answered: the namespace holds exactly one guest.
    pub client_mac: [u8; 6],
    pub ip: Ipv4Addr,
    pub netmask: Ipv4Addr,
    /// Unspecified: no router option (a network without a gateway).
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
    /// Every reply broadcast, never sent to the client's address: behind
    /// the bridge binding that address is also the namespace's own (the
    /// dummy keeping the plugin's addresses), so a unicast would stay here.
    pub broadcast: bool,
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
            broadcast: false,
        }
    }

    /// KubeVirt's bridge binding of a secondary network: the address its
    /// CNI plugin gave (`ip`/`prefix`), the gateway it named if any, from the
    /// bridge's own link-local `server_id`.
    pub fn bridged(
        client_mac: [u8; 6],
        ip: Ipv4Addr,
        prefix: u8,
        gateway: Option<Ipv4Addr>,
        server_id: Ipv4Addr,
    ) -> Self {
        let prefix = prefix.min(32);
        LeaseConfig {
            ip,
            netmask: Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)),
            router: gateway.unwrap_or(Ipv4Addr::UNSPECIFIED),
            server_id,
            broadcast: true,
            ..Self::masquerade(client_mac, Vec::new(), 0)
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
pub fn reply_destination(request: &Message, reply: &Message, broadcast: bool) -> SocketAddrV4 {
    let ciaddr = request.ciaddr();
    if reply.opts().has_msg_type(MessageType::Nak) || ciaddr.is_unspecified() || broadcast {
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
/// IPv6 resolvers are skipped: the DHCPv6 answer carries no DNS servers
/// yet, and a guest resolves over IPv4.
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

/// Decodes one datagram and works out the reply and where it goes.
pub fn handle_datagram(
    datagram: &[u8],
    lease: &LeaseConfig,
) -> Result<Option<(Message, Message, SocketAddrV4)>, DecodeError> {
    // dhcproto asserts on some malformed option lengths (in debug builds):
    // a guest's packet is refused, never a panic in kvirtd.
    let request = std::panic::catch_unwind(|| Message::decode(&mut Decoder::new(datagram)))
        .map_err(|_| DecodeError::InvalidData(0, "malformed option"))??;
    Ok(respond(&request, lease).map(|reply| {
        let to = reply_destination(&request, &reply, lease.broadcast);
        (request, reply, to)
    }))
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
    if !lease.router.is_unspecified() {
        opts.insert(DhcpOption::Router(vec![lease.router]));
    }
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
pub(crate) mod tests {
    use super::*;
    use dhcproto::v4::Flags;
    use dhcproto::Encodable;

    pub(crate) const MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x00, 0x02, 0x02];
    pub(crate) const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
    pub(crate) const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 1);

    pub(crate) fn lease() -> LeaseConfig {
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

    pub(crate) fn client(kind: MessageType, mac: &[u8]) -> Message {
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

    pub(crate) fn selecting(requested: Ipv4Addr) -> Message {
        let mut msg = client(MessageType::Request, &MAC);
        msg.opts_mut()
            .insert(DhcpOption::RequestedIpAddress(requested));
        msg.opts_mut().insert(DhcpOption::ServerIdentifier(GATEWAY));
        msg
    }

    pub(crate) fn renewing(ciaddr: Ipv4Addr) -> Message {
        let mut msg = client(MessageType::Request, &MAC);
        msg.set_ciaddr(ciaddr);
        msg
    }

    /// What goes on the wire and back, so the tests see what a client sees.
    pub(crate) fn round_trip(msg: &Message) -> Message {
        Message::decode(&mut Decoder::new(&msg.to_vec().unwrap())).unwrap()
    }

    pub(crate) fn opt(msg: &Message, code: OptionCode) -> Option<&DhcpOption> {
        msg.opts().get(code)
    }

    pub(crate) fn assert_lease_options(reply: &Message) {
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
            reply_destination(&discover, &offer, false),
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
                reply_destination(&request, &nak, false),
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
            reply_destination(&request, &ack, false),
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
            reply_destination(&inform, &ack, false),
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
    fn a_bridged_network_is_answered_by_broadcast_with_the_plugins_address() {
        let ip = Ipv4Addr::new(10, 1, 0, 5);
        let server = Ipv4Addr::new(169, 254, 75, 11);
        let lease = LeaseConfig::bridged(MAC, ip, 24, None, server);
        let mut request = client(MessageType::Request, &MAC);
        request.set_ciaddr(ip);
        let (_, ack, to) = handle_datagram(&request.to_vec().unwrap(), &lease)
            .unwrap()
            .unwrap();
        // A renewal too: the address is the namespace's own as well.
        assert_eq!(to, SocketAddrV4::new(Ipv4Addr::BROADCAST, CLIENT_PORT));
        assert_eq!(ack.yiaddr(), ip);
        assert_eq!(
            opt(&ack, OptionCode::SubnetMask),
            Some(&DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)))
        );
        assert_eq!(
            opt(&ack, OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(server))
        );
        // No gateway named: no router.
        assert!(opt(&ack, OptionCode::Router).is_none());
        let routed = LeaseConfig::bridged(MAC, ip, 24, Some(Ipv4Addr::new(10, 1, 0, 1)), server);
        let ack = respond(&request, &routed).unwrap();
        assert_eq!(
            opt(&ack, OptionCode::Router),
            Some(&DhcpOption::Router(vec![Ipv4Addr::new(10, 1, 0, 1)]))
        );
        assert_eq!(
            LeaseConfig::bridged(MAC, ip, 0, None, server).netmask,
            Ipv4Addr::UNSPECIFIED
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
                Err(_) | Ok(None) => {}
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
}
