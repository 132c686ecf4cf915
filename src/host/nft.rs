//! Applies kvirt's nftables rulesets (`core::nft`, rules as data) with
//! `nft -j`, on the host or inside a VM's network namespace, in one
//! transaction each.

use crate::host::netns::NETNS_DIR;
use nftables::schema::Nftables;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("nft{}: cannot run nft: {source}", in_netns(.netns))]
    Spawn {
        netns: Option<String>,
        source: std::io::Error,
    },
    #[error("nft{}: applying ruleset failed ({status}): {stderr}", in_netns(.netns))]
    Failed {
        netns: Option<String>,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("nft: cannot open network namespace {name}: {source}")]
    Netns {
        name: String,
        source: std::io::Error,
    },
    #[error("invalid netns name {0:?}")]
    InvalidNetns(String),
    #[error("nft: the host table's worker is gone")]
    Worker,
}

fn in_netns(netns: &Option<String>) -> String {
    netns
        .as_ref()
        .map(|n| format!(" in netns {n}"))
        .unwrap_or_default()
}

/// Runs `nft -j -f -` with the batch on stdin, in the namespace `netns`
/// (a name under `/run/netns`) or in kvirtd's own. Blocking: call it from
/// a blocking thread.
///
/// Spawned here rather than through `nftables::helper`, whose apply does
/// not capture `nft`'s stderr: its errors would carry no message. The child
/// joins the namespace itself before it runs `nft`: `ip netns exec` would
/// cost a process, a mount namespace and a remount of /sys per VM start.
pub fn apply(batch: &Nftables, netns: Option<&str>) -> Result<(), NftError> {
    let payload = serde_json::to_vec(batch).expect("an nftables batch serializes to JSON");
    let spawn_err = |source| NftError::Spawn {
        netns: netns.map(str::to_owned),
        source,
    };
    let mut cmd = Command::new("nft");
    if let Some(name) = netns {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(NftError::InvalidNetns(name.into()));
        }
        // Opened here (close-on-exec), so the child only makes one call.
        let ns = std::fs::File::open(Path::new(NETNS_DIR).join(name)).map_err(|source| {
            NftError::Netns {
                name: name.into(),
                source,
            }
        })?;
        // SAFETY: between fork and exec the child only calls setns(2),
        // which is async-signal-safe, on an fd the parent keeps open.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
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
            netns: netns.map(str::to_owned),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    written.map_err(spawn_err)
}

type Reply = tokio::sync::oneshot::Sender<Result<(), NftError>>;

/// Changes to the host's table from many VMs, applied by one `nft` per
/// burst rather than one each: a hundred VMs going at once spent more CPU
/// starting `nft` than in what it did. A burst is whatever queued while
/// the previous one ran, so a lone change waits for nothing.
#[derive(Clone)]
pub struct HostTable {
    tx: tokio::sync::mpsc::UnboundedSender<(Nftables<'static>, Reply)>,
}

impl HostTable {
    /// The table in `netns` (`None`: kvirtd's own). Needs a tokio runtime:
    /// a task of it applies the bursts.
    pub fn start(netns: Option<String>) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Nftables<'static>, Reply)>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut burst = vec![first];
                while let Ok(more) = rx.try_recv() {
                    burst.push(more);
                }
                let merged = Nftables {
                    objects: burst
                        .iter()
                        .flat_map(|(b, _)| b.objects.iter().cloned())
                        .collect(),
                };
                if matches!(run(merged, netns.clone()).await, Ok(())) {
                    for (_, reply) in burst {
                        let _ = reply.send(Ok(()));
                    }
                    continue;
                }
                // One change nft refused fails its whole transaction: each
                // alone, so only that one fails.
                for (batch, reply) in burst {
                    let _ = reply.send(run(batch, netns.clone()).await);
                }
            }
        });
        Self { tx }
    }

    pub async fn apply(&self, batch: Nftables<'static>) -> Result<(), NftError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.tx.send((batch, reply)).map_err(|_| NftError::Worker)?;
        answer.await.map_err(|_| NftError::Worker)?
    }
}

async fn run(batch: Nftables<'static>, netns: Option<String>) -> Result<(), NftError> {
    tokio::task::spawn_blocking(move || apply(&batch, netns.as_deref()))
        .await
        .map_err(|_| NftError::Worker)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::nft::tests::*;
    use crate::core::nft::{
        host_ruleset, host_teardown, vm_ruleset, vm_source_add, vm_source_remove, PortRule, Proto,
        VmSource, TABLE,
    };
    use serde_json::Value;

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

        /// Twenty VMs' changes at once, one of them refused: the rest land,
        /// and only it fails.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_burst_lands_together_and_a_refused_change_fails_alone() {
            if !usable() {
                return;
            }
            let host = TestNetns::new("burst");
            let subnet = "10.213.0.0/24".parse().unwrap();
            apply(&host_ruleset(&subnet, None, "kvirt0", &[]), Some(&host.0)).unwrap();
            let table = HostTable::start(Some(host.0.clone()));
            let source = |i: u8| VmSource {
                veth: format!("kvtest{i}"),
                ip: std::net::Ipv4Addr::new(10, 213, 0, 10 + i),
                ip6: None,
            };
            // A rule in a chain that does not exist: nft refuses it.
            let bad = serde_json::from_value::<Nftables>(serde_json::json!({"nftables": [
                {"add": {"rule": {"family": "ip", "table": TABLE, "chain": "no-such-chain",
                                  "expr": [{"accept": null}]}}}
            ]}))
            .unwrap();
            let mut changes: Vec<_> = (0..20)
                .map(|i| {
                    let t = table.clone();
                    tokio::spawn(async move { t.apply(vm_source_add(&source(i))).await })
                })
                .collect();
            let refused = {
                let t = table.clone();
                tokio::spawn(async move { t.apply(bad).await })
            };
            for c in changes.drain(..) {
                c.await.unwrap().unwrap();
            }
            assert!(matches!(
                refused.await.unwrap(),
                Err(NftError::Failed { .. })
            ));
            let listed = Command::new("ip")
                .args(["netns", "exec", &host.0, "nft", "list", "ruleset"])
                .output()
                .unwrap();
            let listed = String::from_utf8_lossy(&listed.stdout);
            for i in 0..20 {
                assert!(
                    listed.contains(&format!("\"kvtest{i}\"")),
                    "kvtest{i} missing: {listed}"
                );
            }
            assert!(!listed.contains("kvtest99"), "{listed}");
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
            let all = vm(&[]);
            apply(&all, name).unwrap();
            apply(&all, name).unwrap();
            assert_eq!(
                ns.summary(),
                (vec!["postrouting".into(), "prerouting".into()], 3)
            );

            let some = vm(&[
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
            ]);
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
            let err = apply(&rule_in_missing_chain(), Some(&ns.0)).unwrap_err();
            assert!(matches!(err, NftError::Failed { .. }), "{err}");
            assert!(err.to_string().contains(&ns.0), "{err}");
            assert!(
                err.to_string().to_lowercase().contains("no such file"),
                "{err}"
            );

            let err = apply(&host_teardown(), Some("kvirt-nfttest-missing")).unwrap_err();
            assert!(matches!(err, NftError::Netns { .. }), "{err}");
            assert!(err.to_string().contains("kvirt-nfttest-missing"), "{err}");
        }

        fn sh(ns: &TestNetns, cmd: &str) -> bool {
            Command::new("ip")
                .args(["netns", "exec", &ns.0, "sh", "-c", cmd])
                .status()
                .unwrap()
                .success()
        }

        fn must(ns: &TestNetns, cmd: &str) {
            assert!(sh(ns, cmd), "in {}: {cmd}", ns.0);
        }

        /// One ICMP echo to `to`, from `from` when given; true if answered.
        fn pings(ns: &TestNetns, to: &str, from: Option<&str>) -> bool {
            let from = from.map_or(String::new(), |f| format!("-I {f}"));
            sh(
                ns,
                &format!("busybox ping -c 1 -W 2 {from} {to} >/dev/null 2>&1"),
            )
        }

        /// Whether `to` answers within five echoes: a path that must work
        /// is given time (a loaded machine may drop the first); one that
        /// must not is asked once, with [`pings`].
        fn answers(ns: &TestNetns, to: &str, from: Option<&str>) -> bool {
            (0..5).any(|_| pings(ns, to, from))
        }

        /// The masquerade path for real: a stand-in host with the VM bridge,
        /// a VM namespace with KubeVirt's bridge, and a guest namespace whose
        /// `guest0` is the other end of `tap0`. Spoofed sources from the
        /// guest (address or MAC) and from the VM's namespace go nowhere;
        /// the real ones do.
        #[test]
        fn spoofed_sources_never_reach_the_host() {
            if !usable() || !std::path::Path::new("/bin/busybox").exists() {
                eprintln!("skipping: needs root, nft and busybox");
                return;
            }
            let (host, vmns, guest) = (
                TestNetns::new("spoof-h"),
                TestNetns::new("spoof-v"),
                TestNetns::new("spoof-g"),
            );
            let veth = format!("kv{:012x}", std::process::id());
            let mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
            must(&host, "ip link add kvirt0 type bridge && ip addr add 10.213.0.1/24 dev kvirt0 && ip link set kvirt0 up");
            must(&host, &format!("ip link add {veth} type veth peer name eth0 netns {} && ip link set {veth} master kvirt0 up", vmns.0));
            must(&vmns, "ip addr add 10.213.0.2/24 dev eth0 && ip link set eth0 up && ip link set lo up && ip route add default via 10.213.0.1");
            must(&vmns, "ip link add k6t-eth0 type bridge && ip addr add 10.0.2.1/24 dev k6t-eth0 && ip link set k6t-eth0 up");
            must(&vmns, &format!("ip link add tap0 type veth peer name guest0 netns {} && ip link set tap0 master k6t-eth0 up", guest.0));
            must(&vmns, "echo 1 > /proc/sys/net/ipv4/ip_forward");
            must(&guest, &format!("ip link set guest0 address {mac} up && ip addr add 10.0.2.2/24 dev guest0 && ip route add default via 10.0.2.1"));
            let source = VmSource {
                veth: veth.clone(),
                ip: "10.213.0.2".parse().unwrap(),
                ip6: None,
            };
            let subnet = "10.213.0.0/24".parse().unwrap();
            apply(&host_ruleset(&subnet, None, "kvirt0", &[]), Some(&host.0)).unwrap();
            apply(&vm(&[]), Some(&vmns.0)).unwrap();

            // Until its address is in the host's set, the VM sends nothing.
            assert!(!pings(&vmns, "10.213.0.1", None), "unknown VM passed");
            apply(&vm_source_add(&source), Some(&host.0)).unwrap();
            apply(&vm_source_add(&source), Some(&host.0)).unwrap();
            assert!(answers(&vmns, "10.213.0.1", None), "the VM's own address");
            assert!(
                answers(&guest, "10.213.0.1", None),
                "the guest, masqueraded"
            );

            // The guest with another address, or another MAC.
            must(&guest, "ip addr add 10.0.2.77/24 dev guest0");
            assert!(
                !pings(&guest, "10.213.0.1", Some("10.0.2.77")),
                "spoofed address passed"
            );
            must(&guest, "ip link set guest0 address 02:de:ad:be:ef:01");
            must(&guest, "ip neigh flush all");
            assert!(!pings(&guest, "10.213.0.1", None), "spoofed MAC passed");
            must(&guest, &format!("ip link set guest0 address {mac}"));
            assert!(answers(&guest, "10.213.0.1", None), "the guest again");

            // The VM's namespace with another address of the subnet.
            must(&vmns, "ip addr add 10.213.0.99/24 dev eth0");
            assert!(
                !pings(&vmns, "10.213.0.1", Some("10.213.0.99")),
                "spoofed pod address passed"
            );

            // Gone from the set: nothing passes any more; twice is fine.
            apply(&vm_source_remove(&source), Some(&host.0)).unwrap();
            apply(&vm_source_remove(&source), Some(&host.0)).unwrap();
            assert!(!pings(&vmns, "10.213.0.1", None), "a removed VM passed");
        }

        /// [`spoofed_sources_never_reach_the_host`] for IPv6, dual-stack:
        /// the guest at `fd10:0:2::2` reaches the host masqueraded, and
        /// neither another guest address nor another pod address passes.
        #[test]
        fn ipv6_spoofed_sources_never_reach_the_host() {
            if !usable() || !std::path::Path::new("/bin/busybox").exists() {
                eprintln!("skipping: needs root, nft and busybox");
                return;
            }
            let (host, vmns, guest) = (
                TestNetns::new("spoof6-h"),
                TestNetns::new("spoof6-v"),
                TestNetns::new("spoof6-g"),
            );
            let veth = format!("kv6{:011x}", std::process::id());
            let mac = GUEST_MAC.map(|b| format!("{b:02x}")).join(":");
            must(&host, "ip link add kvirt0 type bridge && ip addr add 10.213.0.1/24 dev kvirt0 && ip addr add fd00:6b76::1/64 dev kvirt0 nodad && ip link set kvirt0 up");
            must(&host, &format!("ip link add {veth} type veth peer name eth0 netns {} && ip link set {veth} master kvirt0 up", vmns.0));
            must(&vmns, "ip addr add 10.213.0.2/24 dev eth0 && ip addr add fd00:6b76::2/64 dev eth0 nodad && ip link set eth0 up && ip link set lo up && ip route add default via 10.213.0.1 && ip -6 route add default via fd00:6b76::1");
            must(&vmns, "ip link add k6t-eth0 type bridge && ip addr add 10.0.2.1/24 dev k6t-eth0 && ip addr add fd10:0:2::1/120 dev k6t-eth0 nodad && ip link set k6t-eth0 up");
            must(&vmns, &format!("ip link add tap0 type veth peer name guest0 netns {} && ip link set tap0 master k6t-eth0 up", guest.0));
            must(&vmns, "echo 1 > /proc/sys/net/ipv4/ip_forward && echo 1 > /proc/sys/net/ipv6/conf/all/forwarding");
            must(&guest, &format!("ip link set guest0 address {mac} up && ip addr add fd10:0:2::2/120 dev guest0 nodad && ip -6 route add default via fd10:0:2::1"));
            let source = VmSource {
                veth: veth.clone(),
                ip: "10.213.0.2".parse().unwrap(),
                ip6: Some("fd00:6b76::2".parse().unwrap()),
            };
            let subnet = "10.213.0.0/24".parse().unwrap();
            let subnet6 = Some(crate::core::nft::tests::SUBNET6);
            apply(
                &host_ruleset(&subnet, subnet6, "kvirt0", &[]),
                Some(&host.0),
            )
            .unwrap();
            apply(&vm_ruleset(&guest6(), &[]), Some(&vmns.0)).unwrap();

            assert!(!pings(&vmns, "fd00:6b76::1", None), "unknown VM passed");
            apply(&vm_source_add(&source), Some(&host.0)).unwrap();
            assert!(answers(&vmns, "fd00:6b76::1", None), "the VM's own address");
            assert!(
                answers(&guest, "fd00:6b76::1", None),
                "the guest, masqueraded"
            );

            must(&guest, "ip addr add fd10:0:2::77/120 dev guest0 nodad");
            assert!(
                !pings(&guest, "fd00:6b76::1", Some("fd10:0:2::77")),
                "spoofed guest address passed"
            );
            must(&vmns, "ip addr add fd00:6b76::99/64 dev eth0 nodad");
            assert!(
                !pings(&vmns, "fd00:6b76::1", Some("fd00:6b76::99")),
                "spoofed pod address passed"
            );
            apply(&vm_source_remove(&source), Some(&host.0)).unwrap();
            assert!(!pings(&vmns, "fd00:6b76::1", None), "a removed VM passed");
        }
    }
}
