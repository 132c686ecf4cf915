//! kvirt's nftables rules as data: pure functions build each ruleset as one
//! `nft -j` batch, which `host::nft::apply` hands to `nft` in one
//! transaction, on the host or inside a VM's network namespace.
//!
//! Everything lives in kvirt's own tables, `ip kvirt` and `ip6 kvirt` (NAT,
//! forwarding) and `bridge kvirt` (what a VM may send: its own MAC and
//! addresses only), so kvirt never touches rules it did not write, and each
//! ruleset starts by deleting and recreating its tables: applying one twice
//! gives the same state, and applying a changed one leaves nothing of the
//! old behind (an `ip6` table of a host or VM without IPv6 is removed).

use crate::core::ipam::Subnet;
use core::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use nftables::batch::Batch;
use nftables::expr::{
    Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix, SetItem,
};
use nftables::schema::{
    Chain, Element, NfListObject, Nftables, Rule, Set, SetType, SetTypeValue, Table,
};
use nftables::stmt::{Match, Operator, Statement, NAT};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::borrow::Cow;
use std::collections::BTreeSet;

pub const TABLE: &str = "kvirt";
/// The VM side of the veth inside the VM's namespace.
pub const VM_UPLINK: &str = "eth0";

/// The host's set of (veth, address) pairs VMs may send from.
pub const VM_SOURCES: &str = "vm_sources";
/// The same for IPv6.
pub const VM_SOURCES6: &str = "vm_sources6";
/// The host ends of VMs' veths (`kv` and a hash, see `host::network`);
/// they are the only ports of the VM bridge.
pub const VETH_PATTERN: &str = "kv*";

/// Standard chain priorities (`nft` keywords `srcnat`, `dstnat`, `filter`;
/// `-200` is the bridge family's `filter` before anything else).
const PRIO_SRCNAT: i32 = 100;
const PRIO_BRIDGE_FIRST: i32 = -200;
const PRIO_DSTNAT: i32 = -100;
const PRIO_FILTER: i32 = 0;

/// Link-local sources: what a namespace or guest sends before, or beside,
/// its own address (neighbour discovery, DHCPv6 requests). A router never
/// forwards them, so they reach only the link.
const LINK_LOCAL: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10);
/// ICMPv6 a link needs from a host without an address yet or from its
/// link-local one: neighbour and router solicitations, multicast listener
/// reports. Not advertisements: those carry a target address, which is
/// checked only by the source it is sent from (a namespace's kernel
/// answers for its own addresses from those addresses).
const LINK_ICMPV6: [&str; 4] = [
    "nd-neighbor-solicit",
    "nd-router-solicit",
    "mld-listener-report",
    "mld2-listener-report",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// One inbound port forwarded to the guest, on the same port number.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortRule {
    pub proto: Proto,
    pub port: u16,
}

/// A VM's veth on the host and the addresses it may send from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VmSource {
    pub veth: String,
    pub ip: Ipv4Addr,
    pub ip6: Option<Ipv6Addr>,
}

/// The host's rules for the VM subnet behind `bridge` (and its IPv6 range
/// when dual-stack), and what each VM's veth may send (`vms`, the VMs that
/// hold an address).
///
/// The forward chain's accepts let VM traffic through only as far as this
/// table goes: a `drop` in another table on the same hook (e.g. Docker's
/// `FORWARD` policy) still wins, which no rule here can override.
///
/// On the bridge, a frame from a VM's veth passes only with that VM's
/// address as its IPv4, IPv6 or ARP sender (or, for IPv6, neighbour
/// discovery from a link-local or no address): the VM's namespace
/// masquerades everything else, so anything other is spoofed (or a
/// namespace whose own rules are gone). Frames of other types do not pass.
pub fn host_ruleset(
    subnet: &Subnet,
    subnet6: Option<(Ipv6Addr, u8)>,
    bridge: &str,
    vms: &[VmSource],
) -> Nftables<'static> {
    let mut b = Batch::new();
    let v4 = (IpAddr::V4(subnet.network()), subnet.prefix());
    host_nat_forward(&mut b, NfFamily::IP, v4, bridge);
    match subnet6 {
        Some((net, len)) => host_nat_forward(&mut b, NfFamily::IP6, (IpAddr::V6(net), len), bridge),
        None => remove_table(&mut b, NfFamily::IP6),
    }

    recreate(&mut b, NfFamily::Bridge);
    for (name, ty) in [
        (VM_SOURCES, SetType::Ipv4Addr),
        (VM_SOURCES6, SetType::Ipv6Addr),
    ] {
        let elem = vm_source_elems(vms, name == VM_SOURCES6);
        b.add(NfListObject::Set(Box::new(Set {
            family: NfFamily::Bridge,
            table: TABLE.into(),
            name: name.into(),
            handle: None,
            set_type: SetTypeValue::Concatenated(vec![SetType::Ifname, ty].into()),
            elem: (!elem.is_empty()).then(|| elem.into()),
            ..Set::default()
        })));
    }
    b.add(bridge_chain());
    let from_vm = || meta_match(MetaKey::Iifname, Operator::EQ, VETH_PATTERN);
    let known = |sender: Expression<'static>, set: &str| {
        Statement::Match(Match {
            left: Expression::Named(NamedExpression::Concat(vec![
                Expression::Named(NamedExpression::Meta(Meta {
                    key: MetaKey::Iifname,
                })),
                sender,
            ])),
            right: Expression::String(format!("@{set}").into()),
            op: Operator::EQ,
        })
    };
    b.add(bridge_rule(vec![
        from_vm(),
        ether_type("arp"),
        known(payload("arp", "saddr ip"), VM_SOURCES),
        accept(),
    ]));
    b.add(bridge_rule(vec![
        from_vm(),
        ether_type("ip"),
        known(payload("ip", "saddr"), VM_SOURCES),
        accept(),
    ]));
    if subnet6.is_some() {
        b.add(bridge_rule(vec![
            from_vm(),
            ether_type("ip6"),
            known(payload("ip6", "saddr"), VM_SOURCES6),
            accept(),
        ]));
        for link_local in [true, false] {
            b.add(bridge_rule(link_icmpv6(from_vm(), link_local)));
        }
    }
    b.add(bridge_rule(vec![from_vm(), drop()]));
    b.to_nftables()
}

/// One family's egress masquerade of the VM range and the forward accepts.
fn host_nat_forward(b: &mut Batch<'static>, family: NfFamily, range: (IpAddr, u8), bridge: &str) {
    recreate(b, family);
    masquerading(b, family, range, Operator::NEQ, bridge);

    // Only accepts, under the accept policy of every kvirt chain: this chain
    // must not change what the host forwards for anyone else.
    b.add(base_chain(
        family,
        "forward",
        NfChainType::Filter,
        NfHook::Forward,
        PRIO_FILTER,
    ));
    b.add(rule(family, "forward", vec![ct_established(), accept()]));
    b.add(rule(
        family,
        "forward",
        vec![meta_match(MetaKey::Iifname, Operator::EQ, bridge), accept()],
    ));
    b.add(rule(
        family,
        "forward",
        vec![meta_match(MetaKey::Oifname, Operator::EQ, bridge), accept()],
    ));
}

/// The postrouting chain masquerading `range` as it leaves by (`EQ`) or
/// other than by (`NEQ`) the interface `oif`.
fn masquerading(
    b: &mut Batch<'static>,
    family: NfFamily,
    range: (IpAddr, u8),
    op: Operator,
    oif: &str,
) {
    b.add(base_chain(
        family,
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        PRIO_SRCNAT,
    ));
    b.add(rule(
        family,
        "postrouting",
        vec![
            saddr_in(range.0, range.1),
            meta_match(MetaKey::Oifname, op, oif),
            masquerade(),
        ],
    ));
}

/// A bridge rule letting through what IPv6 needs on a link ([`LINK_ICMPV6`]
/// only) from a sender without an address of its own yet (`::`) or from
/// its link-local one.
fn link_icmpv6(from: Statement<'static>, link_local: bool) -> Vec<Statement<'static>> {
    let source = if link_local {
        saddr_in(IpAddr::V6(LINK_LOCAL.0), LINK_LOCAL.1)
    } else {
        eq(payload("ip6", "saddr"), &Ipv6Addr::UNSPECIFIED.to_string())
    };
    let types = Statement::Match(Match {
        left: payload("icmpv6", "type"),
        right: Expression::Named(NamedExpression::Set(
            LINK_ICMPV6
                .iter()
                .map(|t| SetItem::Element(Expression::String((*t).into())))
                .collect(),
        )),
        op: Operator::EQ,
    });
    vec![from, ether_type("ip6"), source, types, accept()]
}

fn vm_source_elems(vms: &[VmSource], v6: bool) -> Vec<Expression<'static>> {
    vms.iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .filter_map(|v| {
            let ip = if v6 {
                v.ip6?.to_string()
            } else {
                v.ip.to_string()
            };
            Some(Expression::Named(NamedExpression::Concat(vec![
                Expression::String(v.veth.clone().into()),
                Expression::String(ip.into()),
            ])))
        })
        .collect()
}

/// The VM's elements of the source sets: its IPv4 pair, and its IPv6 pair
/// when it has one.
fn vm_source_elements(vm: &VmSource) -> Vec<NfListObject<'static>> {
    let one = std::slice::from_ref(vm);
    [(VM_SOURCES, false), (VM_SOURCES6, true)]
        .into_iter()
        .filter_map(|(name, v6)| {
            let elem = vm_source_elems(one, v6);
            (!elem.is_empty()).then(|| {
                NfListObject::Element(Element {
                    family: NfFamily::Bridge,
                    table: TABLE.into(),
                    name: name.into(),
                    elem: elem.into(),
                })
            })
        })
        .collect()
}

/// Lets a VM's veth send from its address (idempotent).
pub fn vm_source_add(vm: &VmSource) -> Nftables<'static> {
    let mut b = Batch::new();
    for e in vm_source_elements(vm) {
        b.add(e);
    }
    b.to_nftables()
}

/// Takes a VM's veth and address out of the host's set; a pair that is not
/// there is fine too (the `add` makes the `delete` never fail on it).
pub fn vm_source_remove(vm: &VmSource) -> Nftables<'static> {
    let mut b = Batch::new();
    for e in vm_source_elements(vm) {
        b.add(e.clone());
        b.delete(e);
    }
    b.to_nftables()
}

/// Removes the host's table; a host without one is fine too (the `add`
/// makes the `delete` never fail on a missing table).
pub fn host_teardown() -> Nftables<'static> {
    let mut b = Batch::new();
    for family in [NfFamily::IP, NfFamily::IP6, NfFamily::Bridge] {
        remove_table(&mut b, family);
    }
    b.to_nftables()
}

/// The guest, as its namespace's rules see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guest<'a> {
    /// QEMU's tap, the guest's only way in.
    pub tap: &'a str,
    pub mac: [u8; 6],
    pub ip: Ipv4Addr,
    /// The guest network behind the masquerade bridge.
    pub net: (Ipv4Addr, u8),
    /// Dual stack: the guest's IPv6 address and network (KubeVirt's
    /// `fd10:0:2::2` in `fd10:0:2::/120`).
    pub v6: Option<(Ipv6Addr, (Ipv6Addr, u8))>,
}

/// The rules inside a VM's namespace, KubeVirt's masquerade binding: the
/// guest net leaves masqueraded as `eth0`'s address, and inbound traffic
/// on `eth0` goes to the guest: the listed ports, or all TCP and UDP when
/// none are listed. For each family the guest has.
///
/// Only traffic that arrives on `eth0` is DNAT-ed, so what the namespace
/// itself sends or serves on `k6t-eth0` (kvirtd's DHCP) is left alone.
///
/// What the guest sends through its tap passes the bridge only from its
/// own MAC, and only as IPv4 from its address (or DHCP from `0.0.0.0`),
/// ARP with its MAC and address (or `0.0.0.0`, a probe), IPv6 from its
/// address or its link-local one (which reaches only the namespace:
/// DHCPv6, neighbour discovery), or neighbour discovery from `::`.
pub fn vm_ruleset(guest: &Guest, ports: &[PortRule]) -> Nftables<'static> {
    let mut b = Batch::new();
    let net = (IpAddr::V4(guest.net.0), guest.net.1);
    vm_nat(&mut b, NfFamily::IP, net, IpAddr::V4(guest.ip), ports);
    match guest.v6 {
        Some((ip, (n, len))) => vm_nat(
            &mut b,
            NfFamily::IP6,
            (IpAddr::V6(n), len),
            IpAddr::V6(ip),
            ports,
        ),
        None => remove_table(&mut b, NfFamily::IP6),
    }

    recreate(&mut b, NfFamily::Bridge);
    b.add(bridge_chain());
    let from_tap = || meta_match(MetaKey::Iifname, Operator::EQ, guest.tap);
    let mac = format_mac(&guest.mac);
    let unspecified = Ipv4Addr::UNSPECIFIED.to_string();
    b.add(bridge_rule(vec![
        from_tap(),
        Statement::Match(Match {
            left: payload("ether", "saddr"),
            right: Expression::String(mac.clone().into()),
            op: Operator::NEQ,
        }),
        drop(),
    ]));
    for sender in [guest.ip.to_string(), unspecified.clone()] {
        b.add(bridge_rule(vec![
            from_tap(),
            ether_type("arp"),
            eq(payload("arp", "saddr ether"), &mac),
            eq(payload("arp", "saddr ip"), &sender),
            accept(),
        ]));
    }
    b.add(bridge_rule(vec![
        from_tap(),
        ether_type("ip"),
        eq(payload("ip", "saddr"), &guest.ip.to_string()),
        accept(),
    ]));
    b.add(bridge_rule(vec![
        from_tap(),
        ether_type("ip"),
        eq(payload("ip", "saddr"), &unspecified),
        eq(payload("udp", "sport"), "68"),
        eq(payload("udp", "dport"), "67"),
        accept(),
    ]));
    if let Some((ip, _)) = guest.v6 {
        b.add(bridge_rule(vec![
            from_tap(),
            ether_type("ip6"),
            eq(payload("ip6", "saddr"), &ip.to_string()),
            accept(),
        ]));
        b.add(bridge_rule(vec![
            from_tap(),
            ether_type("ip6"),
            saddr_in(IpAddr::V6(LINK_LOCAL.0), LINK_LOCAL.1),
            accept(),
        ]));
        b.add(bridge_rule(link_icmpv6(from_tap(), false)));
    }
    b.add(bridge_rule(vec![from_tap(), drop()]));
    b.to_nftables()
}

/// One family's table in a VM's namespace: the guest net masqueraded out
/// of `eth0`, inbound ports DNAT-ed to the guest.
fn vm_nat(
    b: &mut Batch<'static>,
    family: NfFamily,
    guest_net: (IpAddr, u8),
    guest_ip: IpAddr,
    ports: &[PortRule],
) {
    recreate(b, family);
    masquerading(b, family, guest_net, Operator::EQ, VM_UPLINK);
    b.add(base_chain(
        family,
        "prerouting",
        NfChainType::NAT,
        NfHook::Prerouting,
        PRIO_DSTNAT,
    ));
    let from_uplink = || meta_match(MetaKey::Iifname, Operator::EQ, VM_UPLINK);
    if ports.is_empty() {
        for proto in [Proto::Tcp, Proto::Udp] {
            b.add(rule(
                family,
                "prerouting",
                vec![
                    from_uplink(),
                    meta_match(MetaKey::L4proto, Operator::EQ, proto.name()),
                    dnat(guest_ip),
                ],
            ));
        }
        return;
    }
    // Sorted and deduplicated, so the same ports in any order give the
    // same batch.
    for p in ports.iter().collect::<BTreeSet<_>>() {
        b.add(rule(
            family,
            "prerouting",
            vec![
                from_uplink(),
                Statement::Match(Match {
                    left: payload(p.proto.name(), "dport"),
                    right: Expression::Number(p.port.into()),
                    op: Operator::EQ,
                }),
                dnat(guest_ip),
            ],
        ));
    }
}

fn eq(field: Expression<'static>, value: &str) -> Statement<'static> {
    Statement::Match(Match {
        left: field,
        right: Expression::String(value.to_owned().into()),
        op: Operator::EQ,
    })
}

fn table(family: NfFamily) -> NfListObject<'static> {
    NfListObject::Table(Table {
        family,
        name: TABLE.into(),
        handle: None,
    })
}

/// `add table; delete table; add table`: in one transaction, so there is
/// no moment without rules. Deleting rather than flushing also drops chains
/// an older kvirtd created and redefines chains whose hook or priority
/// changed, which `add chain` on an existing chain would refuse.
fn recreate(b: &mut Batch<'static>, family: NfFamily) {
    remove_table(b, family);
    b.add(table(family));
}

/// `add table; delete table`: gone, whether it was there or not.
fn remove_table(b: &mut Batch<'static>, family: NfFamily) {
    b.add(table(family));
    b.delete(table(family));
}

/// The bridge family's first filter: what may enter the bridge at all.
fn bridge_chain() -> NfListObject<'static> {
    NfListObject::Chain(Chain {
        family: NfFamily::Bridge,
        table: TABLE.into(),
        name: "prerouting".into(),
        _type: Some(NfChainType::Filter),
        hook: Some(NfHook::Prerouting),
        prio: Some(PRIO_BRIDGE_FIRST),
        policy: Some(NfChainPolicy::Accept),
        ..Chain::default()
    })
}

fn bridge_rule(expr: Vec<Statement<'static>>) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family: NfFamily::Bridge,
        table: TABLE.into(),
        chain: "prerouting".into(),
        expr: expr.into(),
        ..Rule::default()
    })
}

fn ether_type(name: &'static str) -> Statement<'static> {
    Statement::Match(Match {
        left: payload("ether", "type"),
        right: Expression::String(name.into()),
        op: Operator::EQ,
    })
}

fn format_mac(m: &[u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

fn base_chain(
    family: NfFamily,
    name: &'static str,
    ty: NfChainType,
    hook: NfHook,
    prio: i32,
) -> NfListObject<'static> {
    NfListObject::Chain(Chain {
        family,
        table: TABLE.into(),
        name: name.into(),
        _type: Some(ty),
        hook: Some(hook),
        prio: Some(prio),
        // Explicit although it is the default, so `nft list` shows the
        // intent.
        policy: Some(NfChainPolicy::Accept),
        ..Chain::default()
    })
}

fn rule(
    family: NfFamily,
    chain: &'static str,
    expr: Vec<Statement<'static>>,
) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family,
        table: TABLE.into(),
        chain: chain.into(),
        expr: expr.into(),
        ..Rule::default()
    })
}

fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

fn meta_match(key: MetaKey, op: Operator, value: &str) -> Statement<'static> {
    Statement::Match(Match {
        left: Expression::Named(NamedExpression::Meta(Meta { key })),
        right: Expression::String(Cow::Owned(value.to_owned())),
        op,
    })
}

fn saddr_in(network: IpAddr, prefix: u8) -> Statement<'static> {
    let protocol = if network.is_ipv6() { "ip6" } else { "ip" };
    Statement::Match(Match {
        left: payload(protocol, "saddr"),
        right: Expression::Named(NamedExpression::Prefix(Prefix {
            addr: Box::new(Expression::String(network.to_string().into())),
            len: prefix.into(),
        })),
        op: Operator::EQ,
    })
}

fn ct_established() -> Statement<'static> {
    Statement::Match(Match {
        left: Expression::Named(NamedExpression::CT(nftables::expr::CT {
            key: "state".into(),
            family: None,
            dir: None,
        })),
        right: Expression::List(vec![
            Expression::String("established".into()),
            Expression::String("related".into()),
        ]),
        op: Operator::IN,
    })
}

fn accept() -> Statement<'static> {
    Statement::Accept(None)
}

fn drop() -> Statement<'static> {
    Statement::Drop(None)
}

fn masquerade() -> Statement<'static> {
    Statement::Masquerade(None)
}

fn dnat(to: IpAddr) -> Statement<'static> {
    Statement::DNAT(Some(NAT {
        addr: Some(Expression::String(to.to_string().into())),
        family: None,
        port: None,
        flags: None,
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{json, Value};

    pub(crate) const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
    pub(crate) const GUEST_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 0, 2, 0), 24);
    pub(crate) const GUEST_MAC: [u8; 6] = [0x02, 0x42, 0x0a, 0x00, 0x02, 0x02];

    pub(crate) fn guest() -> Guest<'static> {
        Guest {
            tap: "tap0",
            mac: GUEST_MAC,
            ip: GUEST,
            net: GUEST_NET,
            v6: None,
        }
    }

    pub(crate) fn guest6() -> Guest<'static> {
        Guest {
            v6: Some((
                crate::core::dhcp6::GUEST,
                (crate::core::dhcp6::GUEST_NET, crate::core::dhcp6::PREFIX),
            )),
            ..guest()
        }
    }

    pub(crate) fn vm(ports: &[PortRule]) -> Nftables<'static> {
        vm_ruleset(&guest(), ports)
    }

    fn cmds(batch: &Nftables) -> Vec<Value> {
        let v = serde_json::to_value(batch).unwrap();
        v["nftables"].as_array().unwrap().clone()
    }

    fn rules_in(batch: &Nftables, family: &str, chain: &str) -> Vec<Value> {
        cmds(batch)
            .into_iter()
            .filter_map(|c| c["add"]["rule"].as_object().cloned())
            .filter(|r| r["family"] == family && r["chain"] == chain)
            .map(|r| r["expr"].clone())
            .collect()
    }

    fn rules_of(batch: &Nftables, chain: &str) -> Vec<Value> {
        rules_in(batch, "ip", chain)
    }

    pub(crate) const VM_VETH: &str = "kv0123456789ab";

    pub(crate) fn host() -> Nftables<'static> {
        let vms = [VmSource {
            veth: VM_VETH.into(),
            ip: Ipv4Addr::new(10, 213, 0, 2),
            ip6: None,
        }];
        host_ruleset(&"10.213.0.0/24".parse().unwrap(), None, "kvirt0", &vms)
    }

    pub(crate) const SUBNET6: (Ipv6Addr, u8) =
        (Ipv6Addr::new(0xfd00, 0x6b76, 0, 0, 0, 0, 0, 0), 64);

    pub(crate) fn host6(vms: &[VmSource]) -> Nftables<'static> {
        host_ruleset(
            &"10.213.0.0/24".parse().unwrap(),
            Some(SUBNET6),
            "kvirt0",
            vms,
        )
    }

    fn dual_vm() -> VmSource {
        VmSource {
            veth: VM_VETH.into(),
            ip: Ipv4Addr::new(10, 213, 0, 2),
            ip6: Some("fd00:6b76::2".parse().unwrap()),
        }
    }

    #[test]
    fn rulesets_start_by_recreating_their_tables() {
        let t = json!({"table": {"family": "ip", "name": "kvirt"}});
        let br = json!({"table": {"family": "bridge", "name": "kvirt"}});
        let head = json!([{"add": t}, {"delete": t}, {"add": t}]);
        let bridge = json!([{"add": br}, {"delete": br}, {"add": br}]);
        for batch in [host(), vm(&[])] {
            let c = cmds(&batch);
            assert_eq!(Value::from(c[..3].to_vec()), head);
            let at = c.iter().position(|x| x["add"] == br).unwrap();
            assert_eq!(Value::from(c[at..at + 3].to_vec()), bridge);
            // Nothing of the bridge table comes before it is recreated.
            assert!(c[..at]
                .iter()
                .all(|x| x.to_string().contains("\"ip\"") || x.to_string().contains("\"ip6\"")));
        }
        let t6 = json!({"table": {"family": "ip6", "name": "kvirt"}});
        assert_eq!(
            Value::from(cmds(&host_teardown())),
            json!([{"add": t}, {"delete": t}, {"add": t6}, {"delete": t6}, {"add": br}, {"delete": br}])
        );
    }

    #[test]
    fn host_chains_hook_where_expected() {
        let chains: Vec<Value> = cmds(&host())
            .into_iter()
            .filter_map(|c| c["add"].get("chain").cloned())
            .collect();
        assert_eq!(
            chains,
            [
                json!({"family": "ip", "table": "kvirt", "name": "postrouting",
                       "type": "nat", "hook": "postrouting", "prio": 100, "policy": "accept"}),
                json!({"family": "ip", "table": "kvirt", "name": "forward",
                       "type": "filter", "hook": "forward", "prio": 0, "policy": "accept"}),
                json!({"family": "bridge", "table": "kvirt", "name": "prerouting",
                       "type": "filter", "hook": "prerouting", "prio": -200, "policy": "accept"}),
            ]
        );
    }

    #[test]
    fn host_bridge_takes_from_each_veth_only_its_vms_address() {
        let set = cmds(&host())
            .into_iter()
            .find_map(|c| c["add"].get("set").cloned())
            .unwrap();
        assert_eq!(
            set,
            json!({"family": "bridge", "table": "kvirt", "name": "vm_sources",
                   "type": ["ifname", "ipv4_addr"],
                   "elem": [{"concat": [VM_VETH, "10.213.0.2"]}]})
        );
        let from_vm =
            json!({"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "kv*"}});
        let known = |sender: Value| {
            json!({"match": {"op": "==", "right": "@vm_sources", "left": {"concat": [
                {"meta": {"key": "iifname"}}, sender]}}})
        };
        let ether = |ty: &str| json!({"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "type"}}, "right": ty}});
        assert_eq!(
            rules_in(&host(), "bridge", "prerouting"),
            [
                json!([from_vm, ether("arp"),
                       known(json!({"payload": {"protocol": "arp", "field": "saddr ip"}})),
                       {"accept": null}]),
                json!([from_vm, ether("ip"),
                       known(json!({"payload": {"protocol": "ip", "field": "saddr"}})),
                       {"accept": null}]),
                json!([from_vm, {"drop": null}]),
            ]
        );
        // No VMs: an empty set, still declared for the elements to come.
        let empty = host_ruleset(&"10.213.0.0/24".parse().unwrap(), None, "kvirt0", &[]);
        let set = cmds(&empty)
            .into_iter()
            .find_map(|c| c["add"].get("set").cloned())
            .unwrap();
        assert!(set.get("elem").is_none(), "{set}");
    }

    #[test]
    fn vm_sources_come_and_go_one_by_one() {
        let vm = VmSource {
            veth: VM_VETH.into(),
            ip: Ipv4Addr::new(10, 213, 0, 9),
            ip6: None,
        };
        let e = json!({"element": {"family": "bridge", "table": "kvirt", "name": "vm_sources",
                                   "elem": [{"concat": [VM_VETH, "10.213.0.9"]}]}});
        assert_eq!(Value::from(cmds(&vm_source_add(&vm))), json!([{"add": e}]));
        assert_eq!(
            Value::from(cmds(&vm_source_remove(&vm))),
            json!([{"add": e}, {"delete": e}])
        );
    }

    #[test]
    fn the_guest_sends_only_from_its_own_mac_and_address() {
        let tap =
            json!({"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "tap0"}});
        let eq = |proto: &str, field: &str, v: Value| json!({"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": field}}, "right": v}});
        let mac = "02:42:0a:00:02:02";
        assert_eq!(
            rules_in(&vm(&[]), "bridge", "prerouting"),
            [
                json!([tap, {"match": {"op": "!=", "left": {"payload": {"protocol": "ether", "field": "saddr"}},
                                        "right": mac}}, {"drop": null}]),
                json!([tap, eq("ether", "type", json!("arp")), eq("arp", "saddr ether", json!(mac)),
                       eq("arp", "saddr ip", json!("10.0.2.2")), {"accept": null}]),
                json!([tap, eq("ether", "type", json!("arp")), eq("arp", "saddr ether", json!(mac)),
                       eq("arp", "saddr ip", json!("0.0.0.0")), {"accept": null}]),
                json!([tap, eq("ether", "type", json!("ip")), eq("ip", "saddr", json!("10.0.2.2")),
                       {"accept": null}]),
                json!([tap, eq("ether", "type", json!("ip")), eq("ip", "saddr", json!("0.0.0.0")),
                       eq("udp", "sport", json!("68")), eq("udp", "dport", json!("67")),
                       {"accept": null}]),
                json!([tap, {"drop": null}]),
            ]
        );
    }

    #[test]
    fn host_masquerades_the_subnet_leaving_other_than_by_the_bridge() {
        assert_eq!(
            rules_of(&host(), "postrouting"),
            [json!([
                {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                           "right": {"prefix": {"addr": "10.213.0.0", "len": 24}}}},
                {"match": {"op": "!=", "left": {"meta": {"key": "oifname"}}, "right": "kvirt0"}},
                {"masquerade": null}
            ])]
        );
    }

    #[test]
    fn host_forward_accepts_established_and_bridge_traffic() {
        assert_eq!(
            rules_of(&host(), "forward"),
            [
                json!([
                    {"match": {"op": "in", "left": {"ct": {"key": "state"}},
                               "right": ["established", "related"]}},
                    {"accept": null}
                ]),
                json!([
                    {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "kvirt0"}},
                    {"accept": null}
                ]),
                json!([
                    {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "kvirt0"}},
                    {"accept": null}
                ]),
            ]
        );
    }

    #[test]
    fn vm_masquerades_the_guest_net_out_of_eth0() {
        assert_eq!(
            rules_of(&vm(&[]), "postrouting"),
            [json!([
                {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                           "right": {"prefix": {"addr": "10.0.2.0", "len": 24}}}},
                {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "eth0"}},
                {"masquerade": null}
            ])]
        );
    }

    #[test]
    fn vm_dnats_listed_ports_from_eth0_only() {
        let ports = [
            PortRule {
                proto: Proto::Udp,
                port: 53,
            },
            PortRule {
                proto: Proto::Tcp,
                port: 8080,
            },
            PortRule {
                proto: Proto::Tcp,
                port: 8080,
            },
        ];
        let rules = rules_of(&vm(&ports), "prerouting");
        let dnat = |proto: &str, port: u16| {
            json!([
                {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "eth0"}},
                {"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": "dport"}},
                           "right": port}},
                {"dnat": {"addr": "10.0.2.2"}}
            ])
        };
        assert_eq!(rules, [dnat("tcp", 8080), dnat("udp", 53)]);
    }

    #[test]
    fn vm_without_ports_dnats_all_tcp_and_udp() {
        let rules = rules_of(&vm(&[]), "prerouting");
        let all = |proto: &str| {
            json!([
                {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "eth0"}},
                {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": proto}},
                {"dnat": {"addr": "10.0.2.2"}}
            ])
        };
        assert_eq!(rules, [all("tcp"), all("udp")]);
        assert!(!serde_json::to_string(&rules).unwrap().contains("dport"));
    }

    #[test]
    fn without_ipv6_an_ip6_table_is_only_removed() {
        let t6 = json!({"table": {"family": "ip6", "name": "kvirt"}});
        for batch in [host(), vm(&[])] {
            let c = cmds(&batch);
            let at = c.iter().position(|x| x["add"] == t6).unwrap();
            assert_eq!(c[at + 1], json!({"delete": t6}));
            assert_eq!(c.iter().filter(|x| x["add"] == t6).count(), 1);
            assert!(rules_in(&batch, "ip6", "postrouting").is_empty());
            assert!(!batch_text(&batch).contains("\"ip6\", \"field\""));
        }
    }

    fn batch_text(b: &Nftables) -> String {
        serde_json::to_string(b)
            .unwrap()
            .replace("\":", "\": ")
            .replace(",\"", ", \"")
    }

    #[test]
    fn dual_stack_mirrors_nat_and_forwarding_in_an_ip6_table() {
        let h = host6(&[dual_vm()]);
        assert_eq!(
            rules_in(&h, "ip6", "postrouting"),
            [json!([
                {"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}},
                           "right": {"prefix": {"addr": "fd00:6b76::", "len": 64}}}},
                {"match": {"op": "!=", "left": {"meta": {"key": "oifname"}}, "right": "kvirt0"}},
                {"masquerade": null}
            ])]
        );
        assert_eq!(rules_in(&h, "ip6", "forward"), rules_of(&host(), "forward"));
        let v = vm_ruleset(
            &guest6(),
            &[PortRule {
                proto: Proto::Tcp,
                port: 8080,
            }],
        );
        assert_eq!(
            rules_in(&v, "ip6", "postrouting"),
            [json!([
                {"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}},
                           "right": {"prefix": {"addr": "fd10:0:2::", "len": 120}}}},
                {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "eth0"}},
                {"masquerade": null}
            ])]
        );
        assert_eq!(
            rules_in(&v, "ip6", "prerouting"),
            [json!([
                {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "eth0"}},
                {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}},
                           "right": 8080}},
                {"dnat": {"addr": "fd10:0:2::2"}}
            ])]
        );
        // The IPv4 side is the same as without IPv6.
        assert_eq!(
            rules_in(&v, "ip", "prerouting"),
            rules_of(
                &vm(&[PortRule {
                    proto: Proto::Tcp,
                    port: 8080
                }]),
                "prerouting"
            )
        );
    }

    #[test]
    fn dual_stack_veths_send_ipv6_only_from_their_vms_address_or_for_discovery() {
        let h = host6(&[dual_vm()]);
        let set6 = cmds(&h)
            .into_iter()
            .filter_map(|c| c["add"].get("set").cloned())
            .find(|s| s["name"] == VM_SOURCES6)
            .unwrap();
        assert_eq!(set6["type"], json!(["ifname", "ipv6_addr"]));
        assert_eq!(set6["elem"], json!([{"concat": [VM_VETH, "fd00:6b76::2"]}]));
        let rules = rules_in(&h, "bridge", "prerouting");
        assert_eq!(rules.len(), 6, "{rules:?}");
        let text = Value::from(rules.clone()).to_string();
        assert!(text.contains("\"right\":\"@vm_sources6\""), "{text}");
        // Discovery from link-local or no address: solicitations and
        // listener reports, never advertisements.
        for r in &rules[3..5] {
            let t = r.to_string();
            assert!(
                t.contains("nd-neighbor-solicit") && t.contains("mld2-listener-report"),
                "{t}"
            );
            assert!(!t.contains("advert"), "{t}");
        }
        assert!(rules[3].to_string().contains("fe80::"), "{:?}", rules[3]);
        assert!(
            rules[4].to_string().contains("\"right\":\"::\""),
            "{:?}",
            rules[4]
        );
        assert_eq!(
            rules[5],
            json!([
                {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "kv*"}},
                {"drop": null}
            ])
        );
        // A VM comes and goes with both of its pairs.
        let add = Value::from(cmds(&vm_source_add(&dual_vm()))).to_string();
        assert!(
            add.contains("\"vm_sources\"") && add.contains("\"vm_sources6\""),
            "{add}"
        );
        let gone = cmds(&vm_source_remove(&dual_vm()));
        assert_eq!(gone.len(), 4, "{gone:?}");
    }

    #[test]
    fn a_dual_stack_guest_sends_ipv6_only_from_its_address_or_link_local() {
        let rules = rules_in(&vm_ruleset(&guest6(), &[]), "bridge", "prerouting");
        let tap =
            json!({"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "tap0"}});
        let ip6 = json!({"match": {"op": "==", "left": {"payload": {"protocol": "ether", "field": "type"}}, "right": "ip6"}});
        assert_eq!(rules.len(), 9, "{rules:?}");
        assert_eq!(
            rules[5],
            json!([tap, ip6, {"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}},
                                        "right": "fd10:0:2::2"}}, {"accept": null}])
        );
        assert_eq!(
            rules[6],
            json!([tap, ip6, {"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "saddr"}},
                                        "right": {"prefix": {"addr": "fe80::", "len": 10}}}}, {"accept": null}])
        );
        assert!(
            rules[7].to_string().contains("nd-neighbor-solicit"),
            "{:?}",
            rules[7]
        );
        assert_eq!(rules[8], json!([tap, {"drop": null}]));
        // The MAC check still comes first.
        assert!(rules[0].to_string().contains("\"!=\""), "{:?}", rules[0]);
    }

    /// A batch `nft` refuses: a rule in a chain that does not exist.
    pub(crate) fn rule_in_missing_chain() -> Nftables<'static> {
        let mut b = Batch::new();
        b.add(table(NfFamily::IP));
        b.add(rule(NfFamily::IP, "nope", vec![accept()]));
        b.to_nftables()
    }
}
