//! kvirt's nftables rules as data: pure functions build each ruleset as one
//! `nft -j` batch, which `host::nft::apply` hands to `nft` in one
//! transaction, on the host or inside a VM's network namespace.
//!
//! Everything lives in kvirt's own tables, `ip kvirt` (NAT, forwarding) and
//! `bridge kvirt` (what a VM may send: its own MAC and address only), so
//! kvirt never touches rules it did not write, and each ruleset starts by
//! deleting and recreating its tables: applying one twice gives the same
//! state, and applying a changed one leaves nothing of the old behind.

use crate::core::ipam::Subnet;
use core::net::Ipv4Addr;
use nftables::batch::Batch;
use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix};
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
/// The host ends of VMs' veths (`kv` and a hash, see `host::network`);
/// they are the only ports of the VM bridge.
pub const VETH_PATTERN: &str = "kv*";

/// Standard chain priorities (`nft` keywords `srcnat`, `dstnat`, `filter`;
/// `-200` is the bridge family's `filter` before anything else).
const PRIO_SRCNAT: i32 = 100;
const PRIO_BRIDGE_FIRST: i32 = -200;
const PRIO_DSTNAT: i32 = -100;
const PRIO_FILTER: i32 = 0;

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

/// A VM's veth on the host and the one address it may send from.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct VmSource {
    pub veth: String,
    pub ip: Ipv4Addr,
}

/// The host's rules for the VM subnet behind `bridge`, and what each VM's
/// veth may send (`vms`, the VMs that hold an address).
///
/// The forward chain's accepts let VM traffic through only as far as this
/// table goes: a `drop` in another table on the same hook (e.g. Docker's
/// `FORWARD` policy) still wins, which no rule here can override.
///
/// On the bridge, a frame from a VM's veth passes only with that VM's
/// address as its IPv4 or ARP sender: the VM's namespace masquerades
/// everything else, so anything other is spoofed (or a namespace whose own
/// rules are gone). Frames that are neither IPv4 nor ARP do not pass.
pub fn host_ruleset(subnet: &Subnet, bridge: &str, vms: &[VmSource]) -> Nftables<'static> {
    let mut b = Batch::new();
    recreate(&mut b, NfFamily::IP);
    b.add(base_chain(
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        PRIO_SRCNAT,
    ));
    b.add(rule(
        "postrouting",
        vec![
            ip_saddr_in(subnet.network(), subnet.prefix()),
            meta_match(MetaKey::Oifname, Operator::NEQ, bridge),
            masquerade(),
        ],
    ));

    // Only accepts, under the accept policy of every kvirt chain: this chain
    // must not change what the host forwards for anyone else.
    b.add(base_chain(
        "forward",
        NfChainType::Filter,
        NfHook::Forward,
        PRIO_FILTER,
    ));
    b.add(rule("forward", vec![ct_established(), accept()]));
    b.add(rule(
        "forward",
        vec![meta_match(MetaKey::Iifname, Operator::EQ, bridge), accept()],
    ));
    b.add(rule(
        "forward",
        vec![meta_match(MetaKey::Oifname, Operator::EQ, bridge), accept()],
    ));

    recreate(&mut b, NfFamily::Bridge);
    b.add(NfListObject::Set(Box::new(Set {
        family: NfFamily::Bridge,
        table: TABLE.into(),
        name: VM_SOURCES.into(),
        handle: None,
        set_type: SetTypeValue::Concatenated(vec![SetType::Ifname, SetType::Ipv4Addr].into()),
        elem: (!vms.is_empty()).then(|| vm_source_elems(vms).into()),
        ..Set::default()
    })));
    b.add(bridge_chain());
    let from_vm = || meta_match(MetaKey::Iifname, Operator::EQ, VETH_PATTERN);
    let known = |sender: Expression<'static>| {
        Statement::Match(Match {
            left: Expression::Named(NamedExpression::Concat(vec![
                Expression::Named(NamedExpression::Meta(Meta {
                    key: MetaKey::Iifname,
                })),
                sender,
            ])),
            right: Expression::String(format!("@{VM_SOURCES}").into()),
            op: Operator::EQ,
        })
    };
    b.add(bridge_rule(vec![
        from_vm(),
        ether_type("arp"),
        known(payload("arp", "saddr ip")),
        accept(),
    ]));
    b.add(bridge_rule(vec![
        from_vm(),
        ether_type("ip"),
        known(payload("ip", "saddr")),
        accept(),
    ]));
    b.add(bridge_rule(vec![from_vm(), drop()]));
    b.to_nftables()
}

fn vm_source_elems(vms: &[VmSource]) -> Vec<Expression<'static>> {
    vms.iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|v| {
            Expression::Named(NamedExpression::Concat(vec![
                Expression::String(v.veth.clone().into()),
                Expression::String(v.ip.to_string().into()),
            ]))
        })
        .collect()
}

fn vm_source_element(vm: &VmSource) -> NfListObject<'static> {
    NfListObject::Element(Element {
        family: NfFamily::Bridge,
        table: TABLE.into(),
        name: VM_SOURCES.into(),
        elem: vm_source_elems(std::slice::from_ref(vm)).into(),
    })
}

/// Lets a VM's veth send from its address (idempotent).
pub fn vm_source_add(vm: &VmSource) -> Nftables<'static> {
    let mut b = Batch::new();
    b.add(vm_source_element(vm));
    b.to_nftables()
}

/// Takes a VM's veth and address out of the host's set; a pair that is not
/// there is fine too (the `add` makes the `delete` never fail on it).
pub fn vm_source_remove(vm: &VmSource) -> Nftables<'static> {
    let mut b = Batch::new();
    b.add(vm_source_element(vm));
    b.delete(vm_source_element(vm));
    b.to_nftables()
}

/// Removes the host's table; a host without one is fine too (the `add`
/// makes the `delete` never fail on a missing table).
pub fn host_teardown() -> Nftables<'static> {
    let mut b = Batch::new();
    for family in [NfFamily::IP, NfFamily::Bridge] {
        b.add(table(family));
        b.delete(table(family));
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
}

/// The rules inside a VM's namespace, KubeVirt's masquerade binding: the
/// guest net leaves masqueraded as `eth0`'s address, and inbound traffic
/// on `eth0` goes to the guest: the listed ports, or all TCP and UDP when
/// none are listed.
///
/// Only traffic that arrives on `eth0` is DNAT-ed, so what the namespace
/// itself sends or serves on `k6t-eth0` (kvirtd's DHCP) is left alone.
///
/// What the guest sends through its tap passes the bridge only from its
/// own MAC, and only as IPv4 from its address (or DHCP from `0.0.0.0`) or
/// ARP with its MAC and address (or `0.0.0.0`, a probe).
pub fn vm_ruleset(guest: &Guest, ports: &[PortRule]) -> Nftables<'static> {
    let (guest_net, guest_ip) = (guest.net, guest.ip);
    let mut b = Batch::new();
    recreate(&mut b, NfFamily::IP);
    b.add(base_chain(
        "postrouting",
        NfChainType::NAT,
        NfHook::Postrouting,
        PRIO_SRCNAT,
    ));
    b.add(rule(
        "postrouting",
        vec![
            ip_saddr_in(guest_net.0, guest_net.1),
            meta_match(MetaKey::Oifname, Operator::EQ, VM_UPLINK),
            masquerade(),
        ],
    ));

    b.add(base_chain(
        "prerouting",
        NfChainType::NAT,
        NfHook::Prerouting,
        PRIO_DSTNAT,
    ));
    let from_uplink = || meta_match(MetaKey::Iifname, Operator::EQ, VM_UPLINK);
    if ports.is_empty() {
        for proto in [Proto::Tcp, Proto::Udp] {
            b.add(rule(
                "prerouting",
                vec![
                    from_uplink(),
                    meta_match(MetaKey::L4proto, Operator::EQ, proto.name()),
                    dnat(guest_ip),
                ],
            ));
        }
    } else {
        // Sorted and deduplicated, so the same ports in any order give the
        // same batch.
        for p in ports.iter().collect::<BTreeSet<_>>() {
            b.add(rule(
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

    recreate(&mut b, NfFamily::Bridge);
    b.add(bridge_chain());
    let from_tap = || meta_match(MetaKey::Iifname, Operator::EQ, guest.tap);
    let mac = format_mac(&guest.mac);
    let eq = |field: Expression<'static>, value: &str| {
        Statement::Match(Match {
            left: field,
            right: Expression::String(value.to_owned().into()),
            op: Operator::EQ,
        })
    };
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
    for sender in [guest_ip.to_string(), unspecified.clone()] {
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
        eq(payload("ip", "saddr"), &guest_ip.to_string()),
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
    b.add(bridge_rule(vec![from_tap(), drop()]));
    b.to_nftables()
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
    b.add(table(family));
    b.delete(table(family));
    b.add(table(family));
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
    name: &'static str,
    ty: NfChainType,
    hook: NfHook,
    prio: i32,
) -> NfListObject<'static> {
    NfListObject::Chain(Chain {
        family: NfFamily::IP,
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

fn rule(chain: &'static str, expr: Vec<Statement<'static>>) -> NfListObject<'static> {
    NfListObject::Rule(Rule {
        family: NfFamily::IP,
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

fn ip_saddr_in(network: Ipv4Addr, prefix: u8) -> Statement<'static> {
    Statement::Match(Match {
        left: payload("ip", "saddr"),
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

fn dnat(to: Ipv4Addr) -> Statement<'static> {
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
        }];
        host_ruleset(&"10.213.0.0/24".parse().unwrap(), "kvirt0", &vms)
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
            assert!(c[..at].iter().all(|x| x.to_string().contains("\"ip\"")));
        }
        assert_eq!(
            Value::from(cmds(&host_teardown())),
            json!([{"add": t}, {"delete": t}, {"add": br}, {"delete": br}])
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
        let empty = host_ruleset(&"10.213.0.0/24".parse().unwrap(), "kvirt0", &[]);
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

    /// A batch `nft` refuses: a rule in a chain that does not exist.
    pub(crate) fn rule_in_missing_chain() -> Nftables<'static> {
        let mut b = Batch::new();
        b.add(table(NfFamily::IP));
        b.add(rule("nope", vec![accept()]));
        b.to_nftables()
    }
}
