//! DHCPv6 for the guest behind KubeVirt's masquerade binding, as KubeVirt's
//! own server answers it: one address (IA_NA, `fd10:0:2::2`), rapid commit
//! when the client asks for it, DNS servers; no router advertisements (the
//! guest's route comes from the link). Pure: what to answer to a datagram;
//! the socket is `host`'s.

use core::net::Ipv6Addr;
use dhcproto::v6::{
    DhcpOption, DhcpOptions, IAAddr, Message, MessageType, OptionCode, Status, StatusCode, IANA,
};
use dhcproto::{Decodable, Decoder, Encodable};

/// KubeVirt's IPv6 masquerade addressing.
pub const GUEST: Ipv6Addr = Ipv6Addr::new(0xfd10, 0, 2, 0, 0, 0, 0, 2);
/// The guest's network: the bridge `k6t-eth0` and the guest on it.
pub const GUEST_NET: Ipv6Addr = Ipv6Addr::new(0xfd10, 0, 2, 0, 0, 0, 0, 0);
pub const GATEWAY: Ipv6Addr = Ipv6Addr::new(0xfd10, 0, 2, 0, 0, 0, 0, 1);
pub const PREFIX: u8 = 120;
pub const SERVER_PORT: u16 = 547;
pub const CLIENT_PORT: u16 = 546;

/// What the server hands out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease6 {
    pub ip: Ipv6Addr,
    /// The server's DUID-LL is made of this MAC (the bridge's).
    pub server_mac: [u8; 6],
    pub dns: Vec<Ipv6Addr>,
    /// Preferred and valid lifetime; `u32::MAX` is infinite.
    pub lease_secs: u32,
}

impl Lease6 {
    pub fn masquerade(server_mac: [u8; 6], dns: Vec<Ipv6Addr>, lease_secs: u32) -> Self {
        Self {
            ip: GUEST,
            server_mac,
            dns,
            lease_secs,
        }
    }

    /// DUID-LL (RFC 8415 §11.4): type 3, hardware type 1, the MAC.
    pub fn server_duid(&self) -> Vec<u8> {
        let mut d = vec![0, 3, 0, 1];
        d.extend_from_slice(&self.server_mac);
        d
    }
}

/// The reply to a client message, or `None` when the server stays silent
/// (a message for another server, a server's own message, one without a
/// client id).
pub fn respond(request: &Message, lease: &Lease6) -> Option<Message> {
    let opts = request.opts();
    let client_id = match opts.get(OptionCode::ClientId) {
        Some(DhcpOption::ClientId(id)) if !id.is_empty() => id.clone(),
        _ => return None,
    };
    // A message naming a server answers only to that server.
    if let Some(DhcpOption::ServerId(id)) = opts.get(OptionCode::ServerId) {
        if *id != lease.server_duid() {
            return None;
        }
    }
    let kind = match request.msg_type() {
        MessageType::Solicit if opts.get(OptionCode::RapidCommit).is_some() => MessageType::Reply,
        MessageType::Solicit => MessageType::Advertise,
        MessageType::Request
        | MessageType::Renew
        | MessageType::Rebind
        | MessageType::Confirm
        | MessageType::InformationRequest
        | MessageType::Release
        | MessageType::Decline => MessageType::Reply,
        _ => return None,
    };
    let mut reply = Message::new_with_id(kind, request.xid());
    let out = reply.opts_mut();
    out.insert(DhcpOption::ClientId(client_id));
    out.insert(DhcpOption::ServerId(lease.server_duid()));
    if request.msg_type() == MessageType::Solicit && kind == MessageType::Reply {
        out.insert(DhcpOption::RapidCommit);
    }
    if !lease.dns.is_empty() {
        out.insert(DhcpOption::DomainNameServers(lease.dns.clone()));
    }
    match request.msg_type() {
        MessageType::InformationRequest => {}
        MessageType::Release | MessageType::Decline => out.insert(status(Status::Success, "")),
        MessageType::Confirm => {
            let on_link = addresses_asked(opts).all(|a| a == lease.ip);
            out.insert(if on_link {
                status(Status::Success, "")
            } else {
                status(Status::NotOnLink, "not this link's address")
            });
        }
        _ => {
            let iaid = match opts.get(OptionCode::IANA) {
                Some(DhcpOption::IANA(ia)) => ia.id,
                // Only addresses are handed out (no IA_TA, no prefixes).
                _ => {
                    out.insert(status(Status::NoAddrsAvail, "only IA_NA is served"));
                    return Some(reply);
                }
            };
            out.insert(DhcpOption::IANA(ia_na(iaid, lease)));
        }
    }
    Some(reply)
}

fn status(status: Status, msg: &str) -> DhcpOption {
    DhcpOption::StatusCode(StatusCode {
        status,
        msg: msg.into(),
    })
}

/// The addresses a client's IA_NAs name.
fn addresses_asked(opts: &DhcpOptions) -> impl Iterator<Item = Ipv6Addr> + '_ {
    opts.iter()
        .filter_map(|o| match o {
            DhcpOption::IANA(ia) => Some(ia),
            _ => None,
        })
        .flat_map(|ia| {
            ia.opts.iter().filter_map(|o| match o {
                DhcpOption::IAAddr(a) => Some(a.addr),
                _ => None,
            })
        })
}

fn ia_na(id: u32, lease: &Lease6) -> IANA {
    let life = lease.lease_secs;
    let (t1, t2) = if life == u32::MAX {
        (u32::MAX, u32::MAX)
    } else {
        (life / 2, (u64::from(life) * 4 / 5) as u32)
    };
    let mut opts = DhcpOptions::new();
    opts.insert(DhcpOption::IAAddr(IAAddr {
        addr: lease.ip,
        preferred_life: life,
        valid_life: life,
        opts: DhcpOptions::new(),
    }));
    IANA { id, t1, t2, opts }
}

/// Decodes a datagram and answers it; a guest's malformed packet is
/// refused, never a panic.
pub fn handle_datagram(datagram: &[u8], lease: &Lease6) -> Option<Vec<u8>> {
    let request = std::panic::catch_unwind(|| Message::decode(&mut Decoder::new(datagram)))
        .ok()?
        .ok()?;
    respond(&request, lease)?.to_vec().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 0];

    fn lease() -> Lease6 {
        Lease6::masquerade(MAC, vec!["fd00::53".parse().unwrap()], 3600)
    }

    fn client(kind: MessageType, rapid: bool) -> Message {
        let mut m = Message::new_with_id(kind, [1, 2, 3]);
        let o = m.opts_mut();
        o.insert(DhcpOption::ClientId(vec![0, 3, 0, 1, 2, 9, 9, 9, 9, 9]));
        o.insert(DhcpOption::IANA(IANA {
            id: 7,
            t1: 0,
            t2: 0,
            opts: DhcpOptions::new(),
        }));
        if rapid {
            o.insert(DhcpOption::RapidCommit);
        }
        m
    }

    fn round_trip(m: &Message) -> Message {
        Message::decode(&mut Decoder::new(&m.to_vec().unwrap())).unwrap()
    }

    fn leased(m: &Message) -> Option<(u32, Ipv6Addr, u32)> {
        match m.opts().get(OptionCode::IANA)? {
            DhcpOption::IANA(ia) => match ia.opts.get(OptionCode::IAAddr)? {
                DhcpOption::IAAddr(a) => Some((ia.id, a.addr, a.valid_life)),
                _ => None,
            },
            _ => None,
        }
    }

    #[test]
    fn a_rapid_commit_solicit_gets_the_guest_address_at_once() {
        let reply = round_trip(&respond(&client(MessageType::Solicit, true), &lease()).unwrap());
        assert_eq!(reply.msg_type(), MessageType::Reply);
        assert_eq!(reply.xid(), [1, 2, 3]);
        assert!(reply.opts().get(OptionCode::RapidCommit).is_some());
        assert_eq!(leased(&reply), Some((7, GUEST, 3600)));
        assert_eq!(
            reply.opts().get(OptionCode::DomainNameServers),
            Some(&DhcpOption::DomainNameServers(vec!["fd00::53"
                .parse()
                .unwrap()]))
        );
        assert_eq!(
            reply.opts().get(OptionCode::ServerId),
            Some(&DhcpOption::ServerId(lease().server_duid()))
        );
    }

    #[test]
    fn the_four_message_exchange_and_renewals_work() {
        let adv = respond(&client(MessageType::Solicit, false), &lease()).unwrap();
        assert_eq!(adv.msg_type(), MessageType::Advertise);
        assert_eq!(leased(&adv).map(|l| l.1), Some(GUEST));
        for kind in [
            MessageType::Request,
            MessageType::Renew,
            MessageType::Rebind,
        ] {
            let mut req = client(kind, false);
            req.opts_mut()
                .insert(DhcpOption::ServerId(lease().server_duid()));
            let reply = respond(&req, &lease()).unwrap();
            assert_eq!(reply.msg_type(), MessageType::Reply, "{kind:?}");
            assert_eq!(leased(&reply).map(|l| l.1), Some(GUEST), "{kind:?}");
        }
    }

    #[test]
    fn others_messages_and_garbage_get_no_answer() {
        // Another server's.
        let mut req = client(MessageType::Request, false);
        req.opts_mut()
            .insert(DhcpOption::ServerId(vec![0, 3, 0, 1, 1, 1, 1, 1, 1, 1]));
        assert!(respond(&req, &lease()).is_none());
        // No client id; a server's own message type.
        let bare = Message::new(MessageType::Solicit);
        assert!(respond(&bare, &lease()).is_none());
        assert!(respond(&client(MessageType::Advertise, false), &lease()).is_none());
        for junk in [
            &b""[..],
            b"\x01",
            b"\x01\x02\x03\x04\x00\x01\xff\xff",
            &[0xffu8; 600][..],
        ] {
            let _ = handle_datagram(junk, &lease());
        }
        // Only addresses: no IA_NA, no lease.
        let mut ta = Message::new_with_id(MessageType::Request, [0, 0, 1]);
        ta.opts_mut().insert(DhcpOption::ClientId(vec![1, 2]));
        let reply = respond(&ta, &lease()).unwrap();
        assert!(matches!(
            reply.opts().get(OptionCode::StatusCode),
            Some(DhcpOption::StatusCode(StatusCode {
                status: Status::NoAddrsAvail,
                ..
            }))
        ));
    }

    #[test]
    fn confirm_says_whether_the_address_is_still_on_link() {
        let confirm = |addr: Ipv6Addr| {
            let mut m = Message::new_with_id(MessageType::Confirm, [0, 0, 2]);
            let mut ia = DhcpOptions::new();
            ia.insert(DhcpOption::IAAddr(IAAddr {
                addr,
                preferred_life: 0,
                valid_life: 0,
                opts: DhcpOptions::new(),
            }));
            m.opts_mut().insert(DhcpOption::ClientId(vec![1]));
            m.opts_mut().insert(DhcpOption::IANA(IANA {
                id: 1,
                t1: 0,
                t2: 0,
                opts: ia,
            }));
            respond(&m, &lease()).unwrap()
        };
        let code = |m: &Message| match m.opts().get(OptionCode::StatusCode) {
            Some(DhcpOption::StatusCode(s)) => s.status,
            _ => panic!("no status"),
        };
        assert_eq!(code(&confirm(GUEST)), Status::Success);
        assert_eq!(
            code(&confirm("fd10:0:3::2".parse().unwrap())),
            Status::NotOnLink
        );
    }
}
