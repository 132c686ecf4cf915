//! KubeVirt's bridge binding of a secondary network, inside the VM's
//! namespace once its CNI plugins have made their interface there: that
//! interface (`pod<hash>`) is renamed `<hash>-nic` and enslaved to a bridge
//! `k6t-<hash>` with a tap for QEMU (the VM's user's), and a stand-in keeps
//! the original name, MAC and addresses, as KubeVirt's dummy does, so that
//! what the plugins made is still where they look. The guest gets the
//! plugin's address by DHCP on the bridge (`host::dhcp`).
//!
//! The stand-in is a veth pair, not a dummy: kernels without the dummy
//! driver (measured: the test machines' have none, nor 8021q) have veth.

use crate::core::cni::{BridgeLinks, CniResult, ConfList, Record, Runtime};
use crate::core::convert::network::{format_mac, Secondary};
use crate::core::dhcp::LeaseConfig;
use crate::host::cni::{Cni, ExecCni};
use crate::host::dhcp::DhcpServers;
use crate::host::network::{create_tap, in_netns, index_of, nl, write_sysctl, NetworkError};
use sha2::Digest;
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The bridge's own address, link-local: the DHCP server's identity
/// (KubeVirt's `169.254.75.1<index>/32`).
pub fn bridge_address(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(169, 254, 75, 10 + (index % 240) as u8)
}

/// One secondary network's binding, decided before any of it is made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    pub netns_path: PathBuf,
    pub links: BridgeLinks,
    /// The interface's place among the VM's (for the bridge's address).
    pub index: usize,
    /// The plugin's addresses (from its result), kept on the stand-in.
    pub addresses: Vec<(IpAddr, u8)>,
    /// The plugin's MAC for its interface, when it said one.
    pub pod_mac: Option<[u8; 6]>,
    pub tap_uid: u32,
    pub tap_gid: u32,
}

/// The bridge's MAC, set (so enslaving a port never changes it), local,
/// and of the network's hash: never a guest's (kvirt's guest MACs are made
/// another way, and a spec's would have to hit these 40 bits).
pub fn bridge_mac(links: &BridgeLinks) -> [u8; 6] {
    let h = sha2::Sha256::digest(format!("bridge:{}", links.bridge).as_bytes());
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

/// The stand-in's peer: `d` and the hash (12 bytes).
fn stand_in_peer(links: &BridgeLinks) -> String {
    format!("d{}", &links.pod_iface[3..])
}

/// Binds the plugin's interface (idempotent: a binding cut short is
/// completed from what exists). Returns the interface's MTU.
pub fn bind(b: &Binding) -> Result<u32, NetworkError> {
    let b = b.clone();
    in_netns(Some(b.netns_path.clone()), move |h| {
        Box::pin(async move {
            let l = &b.links;
            // 1. The plugin's interface becomes the bridge's port.
            if index_of(&h, &l.nic).await?.is_none() {
                let pod =
                    index_of(&h, &l.pod_iface)
                        .await?
                        .ok_or_else(|| NetworkError::Netlink {
                            what: l.pod_iface.clone(),
                            message: "the CNI plugin made no interface of this name".into(),
                        })?;
                flush_addresses(&h, pod).await?;
                // The port takes the bridge's MAC (KubeVirt's CopyMacFrom):
                // the plugin's may be the guest's own (a spec MAC offered to
                // the plugins), and a bridge drops frames from a MAC one of
                // its own ports has.
                h.link()
                    .set(
                        rtnetlink::LinkUnspec::new_with_index(pod)
                            .down()
                            .name(l.nic.clone())
                            .address(bridge_mac(l).to_vec())
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(nl(format!("rename {} to {}", l.pod_iface, l.nic)))?;
            }
            let nic = index_of(&h, &l.nic).await?.unwrap_or_default();
            let mtu = mtu_of(&h, nic).await?;
            // 2. The stand-in with the plugin's name, MAC and addresses.
            if index_of(&h, &l.pod_iface).await?.is_none() {
                let mut veth = rtnetlink::LinkVeth::new(&l.pod_iface, &stand_in_peer(l)).mtu(mtu);
                if let Some(m) = b.pod_mac {
                    veth = veth.address(m.to_vec());
                }
                h.link()
                    .add(veth.build())
                    .execute()
                    .await
                    .map_err(nl(format!("create {}", l.pod_iface)))?;
            }
            let stand_in = index_of(&h, &l.pod_iface).await?.unwrap_or_default();
            for (ip, prefix) in &b.addresses {
                add_any(&h, stand_in, *ip, *prefix, &l.pod_iface).await?;
            }
            // 3. The bridge, its port (with the bridge's MAC, as KubeVirt's)
            // and QEMU's tap.
            let br =
                crate::host::network::ensure_bridge(&h, &l.bridge, Some(bridge_mac(l)), Some(mtu))
                    .await?;
            if b.addresses.iter().any(|(ip, _)| ip.is_ipv4()) {
                add_any(&h, br, bridge_address(b.index).into(), 32, &l.bridge).await?;
            }
            h.link()
                .set(
                    rtnetlink::LinkUnspec::new_with_index(nic)
                        .controller(br)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(nl(format!("attach {} to {}", l.nic, l.bridge)))?;
            if index_of(&h, &l.tap).await?.is_none() {
                create_tap(&l.tap, b.tap_uid, b.tap_gid)?;
            }
            let tap = index_of(&h, &l.tap).await?.unwrap_or_default();
            h.link()
                .set(
                    rtnetlink::LinkUnspec::new_with_index(tap)
                        .controller(br)
                        .mtu(mtu)
                        .up()
                        .build(),
                )
                .execute()
                .await
                .map_err(nl(format!("attach {}", l.tap)))?;
            // The namespace answers ARP only for addresses of the link
            // asked on: never for the guest's, which the stand-in holds.
            write_sysctl("/proc/sys/net/ipv4/conf/all/arp_ignore", "1")?;
            Ok(mtu)
        })
    })
}

async fn mtu_of(h: &rtnetlink::Handle, index: u32) -> Result<u32, NetworkError> {
    use futures::TryStreamExt;
    use rtnetlink::packet_route::link::LinkAttribute;
    let mut links = h.link().get().match_index(index).execute();
    let link = links
        .try_next()
        .await
        .map_err(nl("read link"))?
        .ok_or_else(|| NetworkError::Netlink {
            what: format!("link {index}"),
            message: "vanished".into(),
        })?;
    Ok(link
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Mtu(m) => Some(*m),
            _ => None,
        })
        .unwrap_or(1500))
}

async fn flush_addresses(h: &rtnetlink::Handle, index: u32) -> Result<(), NetworkError> {
    use futures::TryStreamExt;
    let mut addrs = h.address().get().set_link_index_filter(index).execute();
    let mut found = Vec::new();
    while let Some(a) = addrs.try_next().await.map_err(nl("list addresses"))? {
        found.push(a);
    }
    for a in found {
        match h.address().del(a).execute().await {
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EADDRNOTAVAIL => {}
            r => r.map_err(nl("remove an address"))?,
        }
    }
    Ok(())
}

async fn add_any(
    h: &rtnetlink::Handle,
    index: u32,
    ip: IpAddr,
    prefix: u8,
    what: &str,
) -> Result<(), NetworkError> {
    match h.address().add(index, ip, prefix).execute().await {
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EEXIST => Ok(()),
        r => r.map_err(nl(format!("address {ip}/{prefix} on {what}"))),
    }
}

/// One secondary network of a VM, resolved at its start: its interface
/// (from the converter) and its NetworkAttachmentDefinition's config.
#[derive(Clone, Debug, PartialEq)]
pub struct Attached {
    pub secondary: Secondary,
    pub list: ConfList,
}

/// The VM a network is set up for, as its plugins are told (Multus's
/// `CNI_ARGS`).
#[derive(Clone, Copy, Debug)]
pub struct VmMeta<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub uid: &'a str,
    /// What DHCP tells the guest its name is.
    pub hostname: &'a str,
}

/// Every VM's secondary networks on this host: their CNI attachments
/// (ADD and DEL through `host::cni`, each recorded), the bridge binding and
/// a DHCP server per network. Which VM holds attachments is known from the
/// records, also after a crash.
pub struct SecondaryNets {
    pub cni: ExecCni,
    /// Each VM's attachments as last added or read back: interface name
    /// (`pod<hash>`) and the plugins' result.
    results: Mutex<HashMap<String, Vec<(String, CniResult)>>>,
    /// VM ids holding records.
    holders: Mutex<HashSet<String>>,
}

/// What the DHCP servers hand out besides the address.
#[derive(Clone, Debug)]
pub struct LeaseDefaults {
    pub dns: Vec<Ipv4Addr>,
    pub lease_secs: u32,
    pub hostname: String,
}

fn dhcp_key(id: &str, links: &BridgeLinks) -> String {
    format!("{id}#{}", links.bridge)
}

fn vm_err(id: &str, message: impl std::fmt::Display) -> NetworkError {
    NetworkError::Vm {
        id: id.into(),
        message: message.to_string(),
    }
}

/// The plugin's addresses of interface `ifname` (all of them when the
/// result names no interfaces), and its MAC.
fn addresses_of(r: &CniResult, ifname: &str) -> (Vec<(IpAddr, u8)>, Option<[u8; 6]>) {
    let own = r.interfaces.iter().position(|i| i.name == ifname);
    let addrs = r
        .ips
        .iter()
        .filter(|ip| own.is_none() || ip.interface.is_none() || ip.interface == own)
        .filter_map(|ip| Some((ip.ip()?, ip.prefix()?)))
        .collect();
    let mac = own.and_then(|i| crate::core::convert::network::parse_mac(&r.interfaces[i].mac));
    (addrs, mac)
}

/// The DHCP lease of a bound network: its first IPv4 address, with the
/// gateway the plugin named for it (or its default route's).
fn lease_of(
    s: &Secondary,
    r: &CniResult,
    index: usize,
    mtu: u32,
    d: &LeaseDefaults,
) -> Option<LeaseConfig> {
    let (addrs, _) = addresses_of(r, &s.links.pod_iface);
    let (ip, prefix) = addrs.iter().find_map(|(ip, p)| match ip {
        IpAddr::V4(v4) => Some((*v4, *p)),
        IpAddr::V6(_) => None,
    })?;
    let gateway = r
        .ips
        .iter()
        .filter(|i| i.ip() == Some(IpAddr::V4(ip)))
        .find_map(|i| i.gateway.as_deref()?.parse().ok())
        .or_else(|| {
            r.routes
                .iter()
                .find(|rt| rt.dst == "0.0.0.0/0")
                .and_then(|rt| rt.gw.as_deref()?.parse().ok())
        });
    let mac = s.guest_mac(Some(r));
    let mut l = LeaseConfig::bridged(mac, ip, prefix, gateway, bridge_address(index));
    let dns: Vec<Ipv4Addr> = r.dns["nameservers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str()?.parse().ok())
        .collect();
    l.dns = if dns.is_empty() { d.dns.clone() } else { dns };
    l.mtu = u16::try_from(mtu).unwrap_or(0);
    l.lease_secs = d.lease_secs;
    l.hostname = Some(d.hostname.chars().take(63).collect());
    l.domain_search = r.dns["search"].as_array().map(|s| {
        s.iter()
            .filter_map(|d| d.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    });
    Some(l)
}

impl SecondaryNets {
    /// Learns from the records which VMs hold attachments.
    pub fn open(cni: ExecCni) -> (Self, Vec<String>) {
        let (records, bad) = cni.records();
        let holders = records
            .iter()
            .filter_map(|r| r.runtime().vm_id().map(str::to_owned))
            .collect();
        (
            Self {
                cni,
                results: Default::default(),
                holders: Mutex::new(holders),
            },
            bad.iter().map(|e| e.to_string()).collect(),
        )
    }

    fn holders(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn results(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<(String, CniResult)>>> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// VMs holding attachments.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.holders().iter().cloned().collect();
        ids.sort();
        ids
    }

    pub fn holds(&self, id: &str) -> bool {
        self.holders().contains(id)
    }

    /// The attachments' results (for status), by interface name.
    pub fn results_of(&self, id: &str) -> Vec<(String, CniResult)> {
        self.results().get(id).cloned().unwrap_or_default()
    }

    /// This VM's records, by interface name.
    fn records_of(&self, id: &str) -> Vec<Record> {
        let (records, _) = self.cni.records();
        records
            .into_iter()
            .filter(|r| r.runtime().vm_id() == Some(id))
            .collect()
    }

    /// Attaches, binds and serves each network (idempotent: an attachment
    /// recorded with its result is kept; one cut short is undone and made
    /// again). A failure is returned as is: the start's rollback tears
    /// down what was made.
    #[allow(clippy::too_many_arguments)]
    pub async fn setup(
        &self,
        id: &str,
        vm: VmMeta<'_>,
        netns: &Path,
        attached: &[Attached],
        tap_owner: (u32, u32),
        dhcp: &DhcpServers,
        defaults: &LeaseDefaults,
    ) -> Result<(), NetworkError> {
        let mut results = Vec::new();
        let existing = self.records_of(id);
        for (i, a) in attached.iter().enumerate() {
            let links = &a.secondary.links;
            let mut rt = Runtime::for_vmi(
                vm.namespace,
                vm.name,
                vm.uid,
                id,
                &netns.to_string_lossy(),
                &links.pod_iface,
            );
            if a.secondary.spec_mac {
                rt.capability_args
                    .insert("mac".into(), format_mac(&a.secondary.mac).into());
            }
            self.holders().insert(id.to_owned());
            let kept = existing
                .iter()
                .find(|r| r.if_name == links.pod_iface && r.container_id == vm.uid);
            let result = match kept {
                Some(r) if r.result.is_some() => {
                    serde_json::from_value(r.result.clone().unwrap_or_default())
                        .map_err(|e| vm_err(id, e))?
                }
                found => {
                    if let Some(r) = found {
                        // An ADD cut short: undone before it is made again.
                        self.cni
                            .del(&r.file_name())
                            .await
                            .map_err(|e| vm_err(id, e))?;
                    }
                    self.cni
                        .add(&a.list, &rt)
                        .await
                        .map_err(|e| vm_err(id, e))?
                        .1
                }
            };
            let (addresses, pod_mac) = addresses_of(&result, &links.pod_iface);
            let binding = Binding {
                netns_path: netns.to_owned(),
                links: links.clone(),
                index: i + 1,
                addresses,
                pod_mac,
                tap_uid: tap_owner.0,
                tap_gid: tap_owner.1,
            };
            let mtu = tokio::task::spawn_blocking(move || bind(&binding))
                .await
                .map_err(|_| NetworkError::Thread)??;
            if let Some(lease) = lease_of(&a.secondary, &result, i + 1, mtu, defaults) {
                dhcp.start(&dhcp_key(id, links), netns, &links.bridge, lease)
                    .await
                    .map_err(|e| vm_err(id, e))?;
            }
            results.push((links.pod_iface.clone(), result));
        }
        self.results().insert(id.to_owned(), results);
        Ok(())
    }

    /// Serves DHCP again on each bound network of a running VM (after a
    /// restart of kvirtd), from the recorded results.
    pub async fn attach(
        &self,
        id: &str,
        netns: &Path,
        secondary: &[Secondary],
        dhcp: &DhcpServers,
        defaults: &LeaseDefaults,
    ) -> Result<(), NetworkError> {
        if secondary
            .iter()
            .all(|s| dhcp.serves(&dhcp_key(id, &s.links)))
            && self.results().contains_key(id)
        {
            return Ok(());
        }
        let records = self.records_of(id);
        let mut results = Vec::new();
        for (i, s) in secondary.iter().enumerate() {
            let Some(r) = records.iter().find(|r| r.if_name == s.links.pod_iface) else {
                continue;
            };
            let Ok(result) =
                serde_json::from_value::<CniResult>(r.result.clone().unwrap_or_default())
            else {
                continue;
            };
            let key = dhcp_key(id, &s.links);
            if !dhcp.serves(&key) {
                let mtu = mtu_in(netns, &s.links.bridge).unwrap_or(1500);
                if let Some(lease) = lease_of(s, &result, i + 1, mtu, defaults) {
                    dhcp.start(&key, netns, &s.links.bridge, lease)
                        .await
                        .map_err(|e| vm_err(id, e))?;
                }
            }
            results.push((s.links.pod_iface.clone(), result));
        }
        self.results().insert(id.to_owned(), results);
        Ok(())
    }

    /// Stops the VM's DHCP servers and DELs each of its attachments (by its
    /// record); goes on past errors and returns them all. Run before the
    /// VM's namespace goes, so the plugins find what they made.
    pub async fn teardown(&self, id: &str, dhcp: &DhcpServers) -> Vec<String> {
        for key in dhcp.ids() {
            if key.strip_prefix(id).is_some_and(|k| k.starts_with('#')) {
                dhcp.stop(&key).await;
            }
        }
        let mut errors = Vec::new();
        for r in self.records_of(id) {
            if let Err(e) = self.cni.del(&r.file_name()).await {
                errors.push(e.to_string());
            }
        }
        self.results().remove(id);
        if errors.is_empty() {
            self.holders().remove(id);
        }
        errors
    }

    /// A NetworkAttachmentDefinition without a config names a file of the
    /// CNI config directory (Multus's rule): the first `.conf`,
    /// `.conflist` or `.json` whose network has that name.
    pub fn named_config(dir: &Path, name: &str) -> Option<String> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| e == "conf" || e == "conflist" || e == "json")
            })
            .collect();
        files.sort();
        files.into_iter().find_map(|p| {
            let text = read_bounded(&p)?;
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            (v["name"] == name).then_some(text)
        })
    }
}

/// A config file's text, if it is a regular file of a sane size.
fn read_bounded(p: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(p)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    f.take(crate::core::cni::MAX_BYTES as u64)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// A link's MTU inside a namespace.
fn mtu_in(netns: &Path, name: &str) -> Option<u32> {
    let name = name.to_owned();
    in_netns(Some(netns.to_owned()), move |h| {
        Box::pin(async move {
            let i = index_of(&h, &name)
                .await?
                .ok_or_else(|| NetworkError::Netlink {
                    what: name.clone(),
                    message: "missing".into(),
                })?;
            mtu_of(&h, i).await
        })
    })
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::netns::{KernelNetns, Netns};

    fn ip(netns: &std::path::Path, args: &str) -> serde_json::Value {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["ip", "-j", "-d"])
            .args(args.split(' '))
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_default()
    }

    #[test]
    fn the_guest_is_leased_the_plugins_address_gateway_and_dns() {
        let (_, r) = crate::core::cni::parse_result(
            "bridge",
            br#"{"cniVersion":"1.0.0","interfaces":[{"name":"kvtblue"},{"name":"veth1"},{"name":"pod16477688c0e","mac":"02:aa:00:00:00:07","sandbox":"/run/netns/x"}],
                 "ips":[{"interface":2,"address":"fd00::7/64"},{"interface":2,"address":"10.77.0.7/24","gateway":"10.77.0.1"}],
                 "dns":{"nameservers":["10.77.0.53"],"search":["blue.example"]}}"#,
        )
        .unwrap();
        let s = Secondary {
            name: "blue".into(),
            network: crate::core::cni::NetworkRef::parse("blue", "prod").unwrap(),
            mac: [2, 0, 0, 0, 0, 9],
            spec_mac: false,
            links: BridgeLinks::of("blue"),
        };
        let (addrs, mac) = addresses_of(&r, &s.links.pod_iface);
        assert_eq!(addrs.len(), 2);
        assert_eq!(mac, Some([2, 0xaa, 0, 0, 0, 7]));
        let d = LeaseDefaults {
            dns: vec![Ipv4Addr::new(192, 0, 2, 53)],
            lease_secs: 3600,
            hostname: "web".into(),
        };
        let l = lease_of(&s, &r, 1, 1400, &d).unwrap();
        // No spec MAC: the guest has the plugin's interface's, as in KubeVirt.
        assert_eq!(l.client_mac, [2, 0xaa, 0, 0, 0, 7]);
        let spec = Secondary {
            spec_mac: true,
            ..s.clone()
        };
        assert_eq!(lease_of(&spec, &r, 1, 1400, &d).unwrap().client_mac, s.mac);
        assert_eq!(l.ip, Ipv4Addr::new(10, 77, 0, 7));
        assert_eq!(l.router, Ipv4Addr::new(10, 77, 0, 1));
        assert_eq!(l.server_id, bridge_address(1));
        assert_eq!(l.dns, [Ipv4Addr::new(10, 77, 0, 53)]);
        assert_eq!(l.domain_search.as_deref(), Some("blue.example"));
        assert_eq!((l.mtu, l.lease_secs, l.broadcast), (1400, 3600, true));
        // IPv6 only: plain L2, no DHCP.
        let (_, v6) = crate::core::cni::parse_result(
            "bridge",
            br#"{"cniVersion":"1.0.0","ips":[{"address":"fd00::7/64"}]}"#,
        )
        .unwrap();
        assert!(lease_of(&s, &v6, 1, 1400, &d).is_none());
    }

    /// Tier 2: a veth standing in for a plugin's interface, bound twice
    /// (idempotent): renamed, enslaved with a tap, the stand-in holding its
    /// name, MAC and address, the bridge its link-local address.
    #[tokio::test]
    async fn binds_a_plugins_interface_as_kubevirt_does() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ns = KernelNetns::at(dir.path());
        ns.create("kvirt-b-vm").await.unwrap();
        let path = dir.path().join("kvirt-b-vm");
        let links = BridgeLinks::of("blue");
        // What the plugin leaves: its interface, up, with an address.
        let plugin = std::process::Command::new("nsenter")
            .arg(format!("--net={}", path.display()))
            .args([
                "sh",
                "-c",
                &format!(
                    "ip link add {p} mtu 1400 address 02:00:00:00:00:33 type veth peer name x && ip addr add 10.5.0.7/24 dev {p} && ip link set {p} up",
                    p = links.pod_iface
                ),
            ])
            .status()
            .unwrap();
        let b = Binding {
            netns_path: path.clone(),
            links: links.clone(),
            index: 1,
            addresses: vec![("10.5.0.7".parse().unwrap(), 24)],
            pod_mac: Some([2, 0, 0, 0, 0, 0x33]),
            tap_uid: 65534,
            tap_gid: 65534,
        };
        let first = bind(&b);
        let second = bind(&b);
        let links_json = ip(&path, "link show");
        let addrs = ip(&path, "addr show");
        ns.delete("kvirt-b-vm").await.unwrap();

        assert!(plugin.success());
        assert_eq!(first.unwrap(), 1400);
        assert_eq!(second.unwrap(), 1400);
        let link = |n: &str| {
            links_json
                .as_array()
                .unwrap()
                .iter()
                .find(|l| l["ifname"] == n)
                .cloned()
                .unwrap_or_else(|| panic!("{n} missing: {links_json}"))
        };
        assert_eq!(link(&links.nic)["master"], links.bridge.as_str());
        // The port has the bridge's MAC, never the plugin's (maybe the guest's).
        let mac = crate::core::convert::network::format_mac(&bridge_mac(&links));
        assert_eq!(link(&links.nic)["address"], mac.as_str());
        assert_eq!(link(&links.bridge)["address"], mac.as_str());
        assert_eq!(link(&links.tap)["master"], links.bridge.as_str());
        assert_eq!(link(&links.tap)["mtu"], 1400);
        assert_eq!(link(&links.pod_iface)["address"], "02:00:00:00:00:33");
        let has = |n: &str, a: &str| {
            addrs.as_array().unwrap().iter().any(|l| {
                l["ifname"] == n
                    && l["addr_info"]
                        .as_array()
                        .is_some_and(|x| x.iter().any(|i| i["local"] == a))
            })
        };
        assert!(has(&links.pod_iface, "10.5.0.7"), "{addrs}");
        assert!(!has(&links.nic, "10.5.0.7"), "{addrs}");
        assert!(has(&links.bridge, "169.254.75.11"), "{addrs}");
    }
}
