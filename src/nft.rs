//! kvirt's nftables rules as data: pure functions build each ruleset as one
//! `nft -j` batch, and [`apply`] hands a batch to `nft` in one transaction,
//! on the host or inside a VM's network namespace.
//!
//! Everything lives in kvirt's own `table ip kvirt`, so kvirt never touches
//! rules it did not write, and each ruleset starts by deleting and
//! recreating that table: applying one twice gives the same state, and
//! applying a changed one leaves nothing of the old behind.

use crate::ipam::Subnet;
use nftables::batch::Batch;
use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix};
use nftables::schema::{Chain, NfListObject, Nftables, Rule, Table};
use nftables::stmt::{Match, Operator, Statement, NAT};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

pub const TABLE: &str = "kvirt";
/// The VM side of the veth inside the VM's namespace.
pub const VM_UPLINK: &str = "eth0";

/// Standard chain priorities (`nft` keywords `srcnat`, `dstnat`, `filter`).
const PRIO_SRCNAT: i32 = 100;
const PRIO_DSTNAT: i32 = -100;
const PRIO_FILTER: i32 = 0;

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nft{}: cannot run {program}: {source}", in_netns(.netns))]
    Spawn {
        program: &'static str,
        netns: Option<String>,
        source: std::io::Error,
    },
    #[error("nft{}: applying ruleset failed ({status}): {stderr}", in_netns(.netns))]
    Failed {
        netns: Option<String>,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("invalid netns name {0:?}")]
    InvalidNetns(String),
}

fn in_netns(netns: &Option<String>) -> String {
    netns
        .as_ref()
        .map(|n| format!(" in netns {n}"))
        .unwrap_or_default()
}

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

/// Runs `nft -j -f -` with the batch on stdin, in the namespace `netns`
/// (via `ip netns exec`, so it must be a name under `/run/netns`) or in
/// kvirtd's own. Blocking: call it from a blocking thread.
///
/// Spawned here rather than through `nftables::helper`, whose apply does
/// not capture `nft`'s stderr: its errors would carry no message.
pub fn apply(batch: &Nftables, netns: Option<&str>) -> Result<(), NftError> {
    let payload = serde_json::to_vec(batch).expect("an nftables batch serializes to JSON");
    let (program, mut cmd) = match netns {
        None => ("nft", Command::new("nft")),
        Some(name) => {
            if name.is_empty() || name.contains('/') || name.starts_with('.') {
                return Err(NftError::InvalidNetns(name.into()));
            }
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", name, "nft"]);
            ("ip", cmd)
        }
    };
    let netns = netns.map(str::to_owned);
    let spawn_err = |source| NftError::Spawn {
        program,
        netns: netns.clone(),
        source,
    };
    let mut child = cmd
        .args(["-j", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // nft reads its whole input before it reports anything; if it exits
    // early the write fails with EPIPE and the exit status says why.
    let written = stdin.write_all(&payload);
    drop(stdin);
    let output = child.wait_with_output().map_err(spawn_err)?;
    if !output.status.success() {
        return Err(NftError::Failed {
            netns,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    written.map_err(spawn_err)
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
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const GUEST: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
    const GUEST_NET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 0, 2, 0), 24);

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

    fn host() -> Nftables<'static> {
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

    #[test]
    fn apply_rejects_path_like_netns_names() {
        for bad in ["", "../x", "a/b", "."] {
            assert!(matches!(
                apply(&host_teardown(), Some(bad)),
                Err(NftError::InvalidNetns(_))
            ));
        }
    }

    /// Tier 2: real `nft` in a throwaway namespace; needs root and nft.
    mod kernel {
        use super::*;

        fn usable() -> bool {
            let root = nix::unistd::Uid::effective().is_root();
            let nft = Command::new("nft").arg("--version").output().is_ok();
            if !(root && nft) {
                eprintln!("skipping: needs root and nft (root={root}, nft={nft})");
            }
            root && nft
        }

        struct TestNetns(String);

        impl TestNetns {
            fn new(tag: &str) -> Self {
                let name = format!("kvirt-nfttest-{}-{tag}", std::process::id());
                let st = Command::new("ip")
                    .args(["netns", "add", &name])
                    .status()
                    .unwrap();
                assert!(st.success(), "ip netns add {name}");
                Self(name)
            }

            /// `nft -j list table ip kvirt`, or None when there is no table.
            fn list(&self) -> Option<Value> {
                let out = Command::new("ip")
                    .args(["netns", "exec", &self.0, "nft", "-j", "list", "table", "ip"])
                    .arg(TABLE)
                    .output()
                    .unwrap();
                out.status
                    .success()
                    .then(|| serde_json::from_slice(&out.stdout).unwrap())
            }

            /// (chain names, rule count) of the kvirt table.
            fn summary(&self) -> (Vec<String>, usize) {
                let listed = self.list().expect("table exists");
                let items = listed["nftables"].as_array().unwrap();
                let mut chains: Vec<String> = items
                    .iter()
                    .filter_map(|i| i["chain"]["name"].as_str().map(String::from))
                    .collect();
                chains.sort();
                let rules = items.iter().filter(|i| i.get("rule").is_some()).count();
                (chains, rules)
            }
        }

        impl Drop for TestNetns {
            fn drop(&mut self) {
                let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
            }
        }

        #[test]
        fn host_ruleset_applies_idempotently_and_tears_down() {
            if !usable() {
                return;
            }
            let ns = TestNetns::new("host");
            let name = Some(ns.0.as_str());
            // Teardown of nothing is fine.
            apply(&host_teardown(), name).unwrap();
            assert!(ns.list().is_none());

            let batch = host();
            apply(&batch, name).unwrap();
            let first = ns.summary();
            assert_eq!(first, (vec!["forward".into(), "postrouting".into()], 4));
            apply(&batch, name).unwrap();
            assert_eq!(ns.summary(), first);

            let text = Command::new("ip")
                .args([
                    "netns", "exec", &ns.0, "nft", "list", "table", "ip", "kvirt",
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&text.stdout);
            assert!(
                text.contains("ip saddr 10.213.0.0/24 oifname != \"kvirt0\" masquerade"),
                "{text}"
            );
            assert!(
                text.contains("ct state { established, related } accept")
                    || text.contains("ct state established,related accept"),
                "{text}"
            );

            apply(&host_teardown(), name).unwrap();
            assert!(ns.list().is_none());
        }

        #[test]
        fn vm_ruleset_applies_idempotently_and_replaces_old_ports() {
            if !usable() {
                return;
            }
            let ns = TestNetns::new("vm");
            let name = Some(ns.0.as_str());
            let all = vm_ruleset(GUEST, GUEST_NET, &[]);
            apply(&all, name).unwrap();
            apply(&all, name).unwrap();
            assert_eq!(
                ns.summary(),
                (vec!["postrouting".into(), "prerouting".into()], 3)
            );

            let some = vm_ruleset(
                GUEST,
                GUEST_NET,
                &[
                    PortRule {
                        proto: Proto::Tcp,
                        port: 8080,
                    },
                    PortRule {
                        proto: Proto::Tcp,
                        port: 22,
                    },
                    PortRule {
                        proto: Proto::Udp,
                        port: 53,
                    },
                ],
            );
            apply(&some, name).unwrap();
            assert_eq!(ns.summary().1, 4);
            let text = Command::new("ip")
                .args([
                    "netns", "exec", &ns.0, "nft", "list", "table", "ip", "kvirt",
                ])
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&text.stdout);
            assert!(
                text.contains("iifname \"eth0\" tcp dport 8080 dnat to 10.0.2.2"),
                "{text}"
            );
            assert!(!text.contains("l4proto"), "old rules left: {text}");

            apply(&host_teardown(), name).unwrap();
            assert!(ns.list().is_none());
        }

        #[test]
        fn nft_errors_carry_its_message() {
            if !usable() {
                return;
            }
            let ns = TestNetns::new("err");
            // A rule in a chain that does not exist.
            let mut b = Batch::new();
            b.add(table());
            b.add(rule("nope", vec![accept()]));
            let err = apply(&b.to_nftables(), Some(&ns.0)).unwrap_err();
            assert!(matches!(err, NftError::Failed { .. }), "{err}");
            assert!(err.to_string().contains(&ns.0), "{err}");
            assert!(
                err.to_string().to_lowercase().contains("no such file"),
                "{err}"
            );

            let err = apply(&host_teardown(), Some("kvirt-nfttest-missing")).unwrap_err();
            assert!(matches!(err, NftError::Failed { .. }), "{err}");
        }
    }
}
