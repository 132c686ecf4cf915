//! kvirt's nftables rules as data: pure functions build each ruleset as one
//! `nft -j` batch, which `host::nft::apply` hands to `nft` in one
//! transaction, on the host or inside a VM's network namespace.
//!
//! Everything lives in kvirt's own `table ip kvirt`, so kvirt never touches
//! rules it did not write, and each ruleset starts by deleting and
//! recreating that table: applying one twice gives the same state, and
//! applying a changed one leaves nothing of the old behind.

use crate::core::ipam::Subnet;
use core::net::Ipv4Addr;
use nftables::batch::Batch;
use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix};
use nftables::schema::{Chain, NfListObject, Nftables, Rule, Table};
use nftables::stmt::{Match, Operator, Statement, NAT};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::borrow::Cow;
use std::collections::BTreeSet;

pub const TABLE: &str = "kvirt";
/// The VM side of the veth inside the VM's namespace.
pub const VM_UPLINK: &str = "eth0";

/// Standard chain priorities (`nft` keywords `srcnat`, `dstnat`, `filter`).
const PRIO_SRCNAT: i32 = 100;
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

/// The host's rules for the VM subnet behind `bridge`.
///
/// The forward chain's accepts let VM traffic through only as far as this
/// table goes: a `drop` in another table on the same hook (e.g. Docker's
/// `FORWARD` policy) still wins, which no rule here can override.
pub fn host_ruleset(subnet: &Subnet, bridge: &str) -> Nftables<'static> {
    let mut b = recreate_table();
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
    b.to_nftables()
}

/// Removes the host's table; a host without one is fine too (the `add`
/// makes the `delete` never fail on a missing table).
pub fn host_teardown() -> Nftables<'static> {
    let mut b = Batch::new();
    b.add(table());
    b.delete(table());
    b.to_nftables()
}

/// The rules inside a VM's namespace, KubeVirt's masquerade binding: the
/// guest net leaves masqueraded as `eth0`'s address, and inbound traffic
/// on `eth0` goes to the guest: the listed ports, or all TCP and UDP when
/// none are listed.
///
/// Only traffic that arrives on `eth0` is DNAT-ed, so what the namespace
/// itself sends or serves on `k6t-eth0` (kvirtd's DHCP) is left alone.
pub fn vm_ruleset(
    guest: Ipv4Addr,
    guest_net: (Ipv4Addr, u8),
    ports: &[PortRule],
) -> Nftables<'static> {
    let mut b = recreate_table();
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
                    dnat(guest),
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
                    dnat(guest),
                ],
            ));
        }
    }
    b.to_nftables()
}

fn table() -> NfListObject<'static> {
    NfListObject::Table(Table {
        family: NfFamily::IP,
        name: TABLE.into(),
        handle: None,
    })
}

/// `add table; delete table; add table`: in one transaction, so there is
/// no moment without rules. Deleting rather than flushing also drops chains
/// an older kvirtd created and redefines chains whose hook or priority
/// changed, which `add chain` on an existing chain would refuse.
fn recreate_table() -> Batch<'static> {
    let mut b = Batch::new();
    b.add(table());
    b.delete(table());
    b.add(table());
    b
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

    fn cmds(batch: &Nftables) -> Vec<Value> {
        let v = serde_json::to_value(batch).unwrap();
        v["nftables"].as_array().unwrap().clone()
    }

    fn rules_of(batch: &Nftables, chain: &str) -> Vec<Value> {
        cmds(batch)
            .into_iter()
            .filter_map(|c| c["add"]["rule"].as_object().cloned())
            .filter(|r| r["chain"] == chain)
            .map(|r| r["expr"].clone())
            .collect()
    }

    pub(crate) fn host() -> Nftables<'static> {
        host_ruleset(&"10.213.0.0/24".parse().unwrap(), "kvirt0")
    }

    #[test]
    fn rulesets_start_by_recreating_the_table() {
        let t = json!({"table": {"family": "ip", "name": "kvirt"}});
        let head = json!([{"add": t}, {"delete": t}, {"add": t}]);
        for batch in [host(), vm_ruleset(GUEST, GUEST_NET, &[])] {
            assert_eq!(Value::from(cmds(&batch)[..3].to_vec()), head);
        }
        assert_eq!(
            Value::from(cmds(&host_teardown())),
            json!([{"add": t}, {"delete": t}])
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
            rules_of(&vm_ruleset(GUEST, GUEST_NET, &[]), "postrouting"),
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
        let rules = rules_of(&vm_ruleset(GUEST, GUEST_NET, &ports), "prerouting");
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
        let rules = rules_of(&vm_ruleset(GUEST, GUEST_NET, &[]), "prerouting");
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
        b.add(table());
        b.add(rule("nope", vec![accept()]));
        b.to_nftables()
    }
}
