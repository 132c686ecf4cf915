//! The VM's networks: the pod network with KubeVirt's masquerade binding,
//! and secondary networks (Multus NetworkAttachmentDefinitions) with its
//! bridge binding. Other bindings (SR-IOV, passt, macvtap, ...) are refused
//! by name.

use super::domain::{Boot, Interface, InterfaceAlias, InterfaceModel, InterfaceTarget, MacAddress};
use super::Errors;
use crate::core::cni::{BridgeLinks, CniResult, NetworkRef};
pub use crate::core::nft::{PortRule, Proto};
use crate::core::vmi::VmiSpec;
use core::net::Ipv4Addr;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// KubeVirt's default guest network behind the masquerade bridge.
pub const DEFAULT_VM_CIDR: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 0, 2, 0), 24);
pub const DEFAULT_NETWORK: &str = "default";
/// QEMU's tap in the VM's namespace, attached to the masquerade bridge.
pub const TAP: &str = "tap0";
const MODELS: &[&str] = &["virtio", "e1000", "e1000e", "rtl8139", "ne2k_pci", "pcnet"];
const BINDINGS: &[&str] = &["bridge", "sriov", "slirp", "passt", "macvtap", "binding"];

/// The VM's one interface, as the host side needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetSpec {
    /// The interface (and network) name, e.g. `default`.
    pub name: String,
    pub mac: [u8; 6],
    /// Inbound ports to forward; empty means all, as KubeVirt does.
    pub ports: Vec<PortRule>,
    /// The guest network inside the namespace: bridge .1, guest .2.
    pub vm_cidr: (Ipv4Addr, u8),
    /// What DHCP tells the guest: its host name (`spec.hostname`, else the
    /// VMI's name) and, with `spec.subdomain`, the domain to search first.
    pub hostname: String,
    pub domain_search: Option<String>,
}

impl NetSpec {
    pub fn vm_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.vm_cidr.0) + 1)
    }

    pub fn guest_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.vm_cidr.0) + 2)
    }

    pub fn mac_string(&self) -> String {
        format_mac(&self.mac)
    }
}

/// The cluster DNS domain KubeVirt's DHCP puts after `<subdomain>.<ns>.svc.`.
pub const CLUSTER_DOMAIN: &str = "cluster.local";

/// `spec.hostname` and `spec.subdomain` as KubeVirt's DHCP hands them out:
/// the host name (the VMI's name when unset) and the search domain
/// `<subdomain>.<namespace>.svc.cluster.local`. Each must be a DNS label.
pub(super) fn guest_names(
    extra: &crate::core::vmi::Extra,
    name: &str,
    namespace: &str,
    errs: &mut Errors,
) -> (String, Option<String>) {
    let mut label = |field: &str| -> Option<String> {
        let v = extra.get(field)?;
        match v.as_str() {
            Some(s) if super::is_dns_label(s) => Some(s.to_owned()),
            _ => {
                errs.add(
                    format!("spec.{field}"),
                    format!("{v} is not a DNS label (a-z, 0-9 and '-', at most 63)"),
                );
                None
            }
        }
    };
    let hostname = label("hostname").unwrap_or_else(|| name.chars().take(63).collect());
    let search = label("subdomain").map(|s| format!("{s}.{namespace}.svc.{CLUSTER_DOMAIN}"));
    (hostname, search)
}

pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .split([':', '-'])
        .map(|p| u8::from_str_radix(p, 16).ok().filter(|_| p.len() == 2))
        .collect::<Option<_>>()?;
    let mac: [u8; 6] = parts.try_into().ok()?;
    // A multicast MAC cannot be a NIC's.
    (mac[0] & 1 == 0).then_some(mac)
}

fn parse_cidr(s: &str) -> Option<(Ipv4Addr, u8)> {
    let (ip, len) = s.split_once('/')?;
    let ip: Ipv4Addr = ip.parse().ok()?;
    let len: u8 = len.parse().ok().filter(|l| (8..=30).contains(l))?;
    let mask = u32::MAX << (32 - len);
    (u32::from(ip) & !mask == 0).then_some((ip, len))
}

/// The guest's MAC when the VMI gives none: locally administered, stable
/// per VM id.
pub fn guest_mac(id: &str) -> [u8; 6] {
    let h = Sha256::digest(format!("mac:{id}").as_bytes());
    [0x02, h[0], h[1], h[2], h[3], h[4]]
}

/// A secondary network's interface: its NetworkAttachmentDefinition,
/// attached by its CNI plugins and bound to the guest by KubeVirt's bridge
/// binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Secondary {
    /// The VMI's name of the network (and of its interface).
    pub name: String,
    pub network: NetworkRef,
    /// The spec's MAC, else one of kvirt's (stable per VM and network) for
    /// when the plugins report none: see [`Secondary::guest_mac`].
    pub mac: [u8; 6],
    /// Whether `mac` is the spec's: only then is it offered to the plugins
    /// (`runtimeConfig.mac`), as KubeVirt does.
    pub spec_mac: bool,
    pub links: BridgeLinks,
}

impl Secondary {
    /// The guest's MAC, in KubeVirt's order for the bridge binding: the
    /// spec's, else that of the interface the plugins made (from their
    /// result, recorded, so the same after a restart), else kvirt's own.
    pub fn guest_mac(&self, result: Option<&CniResult>) -> [u8; 6] {
        if self.spec_mac {
            return self.mac;
        }
        result
            .and_then(|r| r.mac_of(&self.links.pod_iface))
            .unwrap_or(self.mac)
    }
}

/// Each secondary interface's guest MAC (by interface name), from the
/// plugins' results (by pod interface name).
pub fn guest_macs(
    secondary: &[Secondary],
    results: &[(String, CniResult)],
) -> Vec<(String, [u8; 6])> {
    secondary
        .iter()
        .map(|s| {
            let r = results.iter().find(|(i, _)| *i == s.links.pod_iface);
            (s.name.clone(), s.guest_mac(r.map(|(_, r)| r)))
        })
        .collect()
}

/// The VM's networks as the host side makes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Networks {
    pub pod: Option<NetSpec>,
    pub secondary: Vec<Secondary>,
}

/// What one of `spec.networks` is.
enum Source {
    Pod,
    Multus(NetworkRef),
    /// Refused already: its interface says nothing more.
    Refused,
}

/// Reads `spec.networks`: one pod network at most, Multus secondary
/// networks; anything else is refused by name.
fn sources(
    spec: &VmiSpec,
    namespace: &str,
    vm_cidr: &mut (Ipv4Addr, u8),
    errs: &mut Errors,
) -> Vec<(String, Source)> {
    let mut out: Vec<(String, Source)> = Vec::new();
    for (i, n) in spec.networks.iter().enumerate() {
        let path = format!("spec.networks[{i}]");
        if out.iter().any(|(name, _)| *name == n.name) {
            errs.add(
                format!("{path}.name"),
                format!("{:?} is named twice", n.name),
            );
            continue;
        }
        let mut extra = n.extra.clone();
        let source = match (extra.remove("pod"), extra.remove("multus")) {
            (Some(_), _) if out.iter().any(|(_, s)| matches!(s, Source::Pod)) => {
                errs.add(format!("{path}.pod"), "only one pod network is possible");
                None
            }
            (Some(pod), None) => {
                pod_source(&pod, &path, vm_cidr, errs);
                Some(Source::Pod)
            }
            (None, Some(m)) => multus_source(&m, &path, namespace, errs),
            (Some(_), Some(_)) => {
                errs.add(path.clone(), "names both pod and multus");
                None
            }
            (None, None) => {
                errs.add(
                    path.clone(),
                    "only the pod network and multus networks are supported",
                );
                None
            }
        };
        for k in extra.keys() {
            errs.add(format!("{path}.{k}"), super::UNSUPPORTED);
        }
        out.push((n.name.clone(), source.unwrap_or(Source::Refused)));
    }
    out
}

fn pod_source(pod: &Value, path: &str, vm_cidr: &mut (Ipv4Addr, u8), errs: &mut Errors) {
    if let Some(cidr) = pod.get("vmNetworkCIDR") {
        match cidr.as_str().and_then(parse_cidr) {
            Some(c) => *vm_cidr = c,
            None => errs.add(
                format!("{path}.pod.vmNetworkCIDR"),
                format!("{cidr} is not an IPv4 network (a.b.c.d/8..30)"),
            ),
        }
    }
    for k in pod.as_object().into_iter().flatten().map(|(k, _)| k) {
        if k != "vmNetworkCIDR" {
            errs.add(format!("{path}.pod.{k}"), super::UNSUPPORTED);
        }
    }
}

fn multus_source(m: &Value, path: &str, namespace: &str, errs: &mut Errors) -> Option<Source> {
    let mut source = None;
    for (k, v) in m.as_object().into_iter().flatten() {
        match (k.as_str(), v) {
            ("networkName", Value::String(n)) => match NetworkRef::parse(n, namespace) {
                Ok(r) => source = Some(Source::Multus(r)),
                Err(e) => errs.add(format!("{path}.multus.networkName"), e),
            },
            ("default", Value::Bool(false)) => {}
            ("default", _) => errs.add(
                format!("{path}.multus.default"),
                "a Multus network in place of the pod network is not supported yet",
            ),
            _ => errs.add(format!("{path}.multus.{k}"), super::UNSUPPORTED),
        }
    }
    if source.is_none() && !m.get("networkName").is_some_and(Value::is_string) {
        errs.add(format!("{path}.multus.networkName"), "is required");
    }
    source
}

/// The fields every binding reads alike.
struct Common {
    mac: Option<[u8; 6]>,
    model: String,
    boot: Option<Boot>,
}

fn common(extra: &mut crate::core::vmi::Extra, path: &str, errs: &mut Errors) -> Common {
    let mac = extra.remove("macAddress").and_then(|v| {
        let m = v.as_str().and_then(parse_mac);
        if m.is_none() {
            errs.add(
                format!("{path}.macAddress"),
                format!("{v} is not a unicast MAC address"),
            );
        }
        m
    });
    let model = match extra.remove("model") {
        None => "virtio".to_owned(),
        Some(Value::String(m)) if MODELS.contains(&m.as_str()) => m,
        Some(m) => {
            errs.add(
                format!("{path}.model"),
                format!("{m} is not one of {MODELS:?}"),
            );
            "virtio".into()
        }
    };
    // PXE from a network; disks check that no two share an order.
    let boot = extra.remove("bootOrder").and_then(|v| match v.as_u64() {
        Some(order @ 1..=65535) => Some(Boot {
            order: order as u32,
        }),
        _ => {
            errs.add(format!("{path}.bootOrder"), "must be at least 1");
            None
        }
    });
    Common { mac, model, boot }
}

/// Converts the VMI's networks and interfaces: the pod network with the
/// masquerade binding, secondary (Multus) networks with the bridge binding.
/// `default_mac` is the pod interface's when the VMI names none; `id` (the
/// VM's) makes the secondary interfaces' MACs.
pub(super) fn convert(
    spec: &VmiSpec,
    namespace: &str,
    id: &str,
    default_mac: [u8; 6],
    errs: &mut Errors,
) -> (Vec<Interface>, Networks) {
    let dev = &spec.domain.devices;
    if spec.networks.is_empty() && dev.interfaces.is_empty() {
        if dev.autoattach_pod_interface == Some(false) {
            return Default::default();
        }
        let net = NetSpec {
            name: DEFAULT_NETWORK.into(),
            mac: default_mac,
            ports: vec![],
            vm_cidr: DEFAULT_VM_CIDR,
            hostname: String::new(),
            domain_search: None,
        };
        let iface = interface(&net.name, net.mac, TAP, "virtio");
        return (
            vec![iface],
            Networks {
                pod: Some(net),
                secondary: vec![],
            },
        );
    }
    let mut vm_cidr = DEFAULT_VM_CIDR;
    let sources = sources(spec, namespace, &mut vm_cidr, errs);
    let (mut ifaces, mut nets) = (Vec::new(), Networks::default());
    for (i, iface) in dev.interfaces.iter().enumerate() {
        let path = format!("{IFACES}[{i}]");
        let Some(source) = source_of(&dev.interfaces[..i], iface, &sources, &path, errs) else {
            continue;
        };
        let mut extra = iface.extra.clone();
        let c = common(&mut extra, &path, errs);
        binding(&mut extra, source, &path, errs);
        let mut domain_iface = match source {
            Source::Multus(r) => {
                let links = BridgeLinks::of(&iface.name);
                let mac = c
                    .mac
                    .unwrap_or_else(|| guest_mac(&format!("{id}/{}", iface.name)));
                nets.secondary.push(Secondary {
                    name: iface.name.clone(),
                    network: r.clone(),
                    mac,
                    spec_mac: c.mac.is_some(),
                    links: links.clone(),
                });
                interface(&iface.name, mac, &links.tap, &c.model)
            }
            _ => {
                let ports = extra
                    .remove("ports")
                    .map(|p| ports(&p, &format!("{path}.ports"), errs))
                    .unwrap_or_default();
                let net = NetSpec {
                    name: iface.name.clone(),
                    mac: c.mac.unwrap_or(default_mac),
                    ports,
                    vm_cidr,
                    hostname: String::new(),
                    domain_search: None,
                };
                let d = interface(&net.name, net.mac, TAP, &c.model);
                nets.pod = Some(net);
                d
            }
        };
        domain_iface.boot = c.boot;
        for k in extra.keys() {
            errs.add(format!("{path}.{k}"), super::UNSUPPORTED);
        }
        ifaces.push(domain_iface);
    }
    check_pairing(dev, &sources, &nets, errs);
    (ifaces, nets)
}

const IFACES: &str = "spec.domain.devices.interfaces";

/// The network an interface is on: `None` (said in `errs`) for a second
/// interface of a name, one of no network, or one on a refused network.
fn source_of<'a>(
    before: &[crate::core::vmi::Interface],
    iface: &crate::core::vmi::Interface,
    sources: &'a [(String, Source)],
    path: &str,
    errs: &mut Errors,
) -> Option<&'a Source> {
    if before.iter().any(|o| o.name == iface.name) {
        errs.add(
            format!("{path}.name"),
            format!("{:?} is named twice", iface.name),
        );
        return None;
    }
    match sources.iter().find(|(n, _)| *n == iface.name) {
        None => {
            errs.add(
                format!("{path}.name"),
                format!(
                    "{:?} is not the name of a network in spec.networks",
                    iface.name
                ),
            );
            None
        }
        Some((_, Source::Refused)) => None,
        Some((_, s)) => Some(s),
    }
}

/// The one binding each network takes: masquerade on the pod network,
/// bridge on a Multus one; any other named and refused.
fn binding(extra: &mut crate::core::vmi::Extra, source: &Source, path: &str, errs: &mut Errors) {
    let (binding, want) = match source {
        Source::Multus(_) => ("bridge", "a multus network"),
        _ => ("masquerade", "the pod network"),
    };
    let all = || BINDINGS.iter().chain(["masquerade"].iter());
    if extra.remove(binding).is_none() {
        let other = all().find(|b| extra.contains_key(**b));
        errs.add(
            format!("{path}.{}", other.unwrap_or(&binding)),
            match other {
                Some(b) => format!("the {b} binding is not supported on {want} yet; use {binding}"),
                None => format!("the interface needs a binding; {want} takes {binding}"),
            },
        );
    }
    for b in all() {
        extra.remove(*b);
    }
}

/// Every network has an interface, and no two interfaces one MAC.
fn check_pairing(
    dev: &crate::core::vmi::Devices,
    sources: &[(String, Source)],
    nets: &Networks,
    errs: &mut Errors,
) {
    for (name, _) in sources {
        if !dev.interfaces.iter().any(|i| i.name == *name) {
            errs.add(
                IFACES,
                format!("spec.networks names {name:?} but no interface uses it"),
            );
        }
    }
    let macs: Vec<[u8; 6]> = nets
        .pod
        .iter()
        .map(|p| p.mac)
        .chain(nets.secondary.iter().map(|s| s.mac))
        .collect();
    if (1..macs.len()).any(|i| macs[..i].contains(&macs[i])) {
        errs.add(IFACES, "two interfaces have the same macAddress");
    }
}

fn ports(v: &Value, path: &str, errs: &mut Errors) -> Vec<PortRule> {
    let Some(list) = v.as_array() else {
        errs.add(path, "must be a list");
        return vec![];
    };
    let mut out = Vec::new();
    for (i, p) in list.iter().enumerate() {
        let port = p
            .get("port")
            .and_then(Value::as_u64)
            .filter(|n| (1..=65535).contains(n));
        let proto = match p.get("protocol").and_then(Value::as_str).unwrap_or("TCP") {
            "TCP" => Some(Proto::Tcp),
            "UDP" => Some(Proto::Udp),
            _ => None,
        };
        match (port, proto) {
            (Some(port), Some(proto)) => out.push(PortRule {
                proto,
                port: port as u16,
            }),
            (None, _) => errs.add(format!("{path}[{i}].port"), "must be 1..65535"),
            (_, None) => errs.add(format!("{path}[{i}].protocol"), "must be TCP or UDP"),
        }
        if let Some(o) = p.as_object() {
            for k in o
                .keys()
                .filter(|k| !["name", "port", "protocol"].contains(&k.as_str()))
            {
                errs.add(format!("{path}[{i}].{k}"), super::UNSUPPORTED);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn interface(name: &str, mac: [u8; 6], tap: &str, model: &str) -> Interface {
    Interface {
        type_: "ethernet",
        mac: MacAddress {
            address: format_mac(&mac),
        },
        target: InterfaceTarget {
            dev: tap.to_owned(),
            managed: "no",
        },
        model: InterfaceModel {
            type_: model.to_owned(),
        },
        boot: None,
        alias: InterfaceAlias {
            name: format!("ua-{name}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;
    use super::*;

    #[test]
    fn guest_mac_is_local_and_stable() {
        let m = guest_mac("default_vm");
        assert_eq!(m[0], 0x02);
        assert_eq!(m, guest_mac("default_vm"));
        assert_ne!(m, guest_mac("default_vm2"));
    }

    fn convert_all(yaml: &str) -> Result<(Vec<Interface>, Networks), Vec<String>> {
        let spec: VmiSpec = serde_norway::from_str(yaml).unwrap();
        let mut errs = Errors::default();
        let r = convert(&spec, "prod", "prod_web", [2, 1, 2, 3, 4, 5], &mut errs);
        if errs.0.is_empty() {
            Ok(r)
        } else {
            Err(errs.0.into_iter().map(|e| e.field).collect())
        }
    }

    fn conv(yaml: &str) -> Result<Option<NetSpec>, Vec<String>> {
        convert_all(yaml).map(|(_, n)| n.pod)
    }

    #[test]
    fn no_interfaces_means_the_default_pod_interface() {
        let n = conv("domain: {devices: {}}").unwrap().unwrap();
        assert_eq!(n.name, "default");
        assert_eq!(n.mac, [2, 1, 2, 3, 4, 5]);
        assert!(n.ports.is_empty());
        assert_eq!(n.guest_ip(), Ipv4Addr::new(10, 0, 2, 2));
        assert_eq!(
            conv("domain: {devices: {autoattachPodInterface: false}}").unwrap(),
            None
        );
    }

    #[test]
    fn masquerade_with_mac_model_ports_and_cidr() {
        let n = conv(
            "domain: {devices: {interfaces: [{name: net, masquerade: {}, macAddress: '02:aa:bb:cc:dd:ee', model: e1000, ports: [{port: 80}, {name: dns, port: 53, protocol: UDP}]}]}}\nnetworks: [{name: net, pod: {vmNetworkCIDR: 10.11.12.0/24}}]",
        )
        .unwrap()
        .unwrap();
        assert_eq!(n.mac_string(), "02:aa:bb:cc:dd:ee");
        assert_eq!(
            n.ports,
            vec![
                PortRule {
                    proto: Proto::Tcp,
                    port: 80
                },
                PortRule {
                    proto: Proto::Udp,
                    port: 53
                }
            ]
        );
        assert_eq!(n.vm_gateway(), Ipv4Addr::new(10, 11, 12, 1));
        assert_eq!(n.guest_ip(), Ipv4Addr::new(10, 11, 12, 2));
    }

    #[test]
    fn other_bindings_and_networks_are_refused_by_name() {
        let e = conv("domain: {devices: {interfaces: [{name: default, bridge: {}}]}}\nnetworks: [{name: default, pod: {}}]").unwrap_err();
        assert_eq!(e, vec!["spec.domain.devices.interfaces[0].bridge"]);
        let e = conv("domain: {devices: {interfaces: [{name: m, masquerade: {}}]}}\nnetworks: [{name: m, multus: {networkName: x}}]").unwrap_err();
        assert_eq!(e, vec!["spec.domain.devices.interfaces[0].masquerade"]);
        let e = conv("domain: {devices: {interfaces: [{name: default, masquerade: {}, macAddress: 'ff:ff:ff:ff:ff:ff', ports: [{port: 0}]}]}}\nnetworks: [{name: default, pod: {vmNetworkCIDR: 10.0.2.1/24}}]").unwrap_err();
        assert_eq!(
            e,
            vec![
                "spec.networks[0].pod.vmNetworkCIDR",
                "spec.domain.devices.interfaces[0].macAddress",
                "spec.domain.devices.interfaces[0].ports[0].port",
            ]
        );
    }

    const TWO: &str = "domain: {devices: {interfaces: [{name: default, masquerade: {}}, {name: blue, bridge: {}, model: e1000e}, {name: red, bridge: {}, macAddress: '02:00:00:00:00:0a', bootOrder: 3}]}}
networks: [{name: default, pod: {}}, {name: blue, multus: {networkName: blue-net}}, {name: red, multus: {networkName: infra/red-net}}]";

    #[test]
    fn multus_networks_are_bridged_interfaces_of_their_own() {
        let (ifaces, nets) = convert_all(TWO).unwrap();
        assert_eq!(nets.pod.as_ref().unwrap().name, "default");
        let [blue, red] = &nets.secondary[..] else {
            panic!("{nets:?}")
        };
        assert_eq!(blue.network.to_string(), "prod/blue-net");
        assert_eq!(red.network.to_string(), "infra/red-net");
        assert_eq!(red.mac, [2, 0, 0, 0, 0, 0x0a]);
        // A MAC of kvirt's own: stable, local, per network.
        assert_eq!(blue.mac, guest_mac("prod_web/blue"));
        assert_eq!(blue.links, BridgeLinks::of("blue"));
        assert_eq!(ifaces.len(), 3);
        assert_eq!(ifaces[1].target.dev, blue.links.tap);
        assert_eq!(ifaces[1].model.type_, "e1000e");
        assert_eq!(ifaces[1].alias.name, "ua-blue");
        assert_eq!(ifaces[2].boot, Some(Boot { order: 3 }));
        assert_eq!(ifaces[0].target.dev, TAP);
        // Without the pod network.
        let (_, nets) = convert_all(
            "domain: {devices: {interfaces: [{name: blue, bridge: {}}]}}\nnetworks: [{name: blue, multus: {networkName: blue-net}}]",
        )
        .unwrap();
        assert_eq!((nets.pod, nets.secondary.len()), (None, 1));
    }

    /// KubeVirt's order for a bridged interface's guest MAC: the spec's,
    /// else the plugins' interface's, else kvirt's own. A MAC the plugins
    /// could not have given a guest (multicast, zero, outside the VM's
    /// namespace) is not taken.
    #[test]
    fn a_bridged_guest_takes_the_plugins_mac_unless_the_spec_names_one() {
        let (_, nets) = convert_all(TWO).unwrap();
        let [blue, red] = &nets.secondary[..] else {
            panic!("{nets:?}")
        };
        assert!(!blue.spec_mac && red.spec_mac);
        let result = |name: &str, mac: &str, sandbox: &str| {
            crate::core::cni::parse_result(
                "bridge",
                format!(
                    r#"{{"cniVersion":"1.0.0","interfaces":[{{"name":"{name}","mac":"{mac}","sandbox":"{sandbox}"}}]}}"#
                )
                .as_bytes(),
            )
            .unwrap()
            .1
        };
        let theirs = result(&blue.links.pod_iface, "0a:58:0a:4d:00:07", "/run/netns/x");
        assert_eq!(
            blue.guest_mac(Some(&theirs)),
            [0x0a, 0x58, 0x0a, 0x4d, 0, 7]
        );
        assert_eq!(blue.guest_mac(None), blue.mac);
        let red_result = result(&red.links.pod_iface, "0a:58:0a:4d:00:08", "/run/netns/x");
        assert_eq!(red.guest_mac(Some(&red_result)), red.mac);
        for (mac, sandbox) in [
            ("01:00:5e:00:00:01", "/run/netns/x"),
            ("00:00:00:00:00:00", "/run/netns/x"),
            ("0a:58:0a:4d:00:07", ""),
            ("not a mac", "/run/netns/x"),
        ] {
            let r = result(&blue.links.pod_iface, mac, sandbox);
            assert_eq!(blue.guest_mac(Some(&r)), blue.mac, "{mac} {sandbox:?}");
        }
        let macs = guest_macs(&nets.secondary, &[(blue.links.pod_iface.clone(), theirs)]);
        assert_eq!(
            macs,
            [
                ("blue".to_owned(), [0x0a, 0x58, 0x0a, 0x4d, 0, 7]),
                ("red".to_owned(), red.mac)
            ]
        );
    }

    /// The plugins' MACs go into the domain XML after the conversion: the
    /// named interface's changes, nothing else does.
    #[test]
    fn the_domain_takes_the_plugins_macs_after_conversion() {
        use super::super::test_support::{run, vmi};
        let spec = TWO.replacen("domain: {", "domain: {memory: {guest: 64Mi}, ", 1);
        let c = run(&vmi(&spec), DomainType::Qemu).unwrap();
        assert_eq!(c.domain_xml_with_macs(&[]).unwrap(), c.domain_xml);
        let blue = c.secondary_networks[0].clone();
        let same = [("blue".to_owned(), blue.mac)];
        assert_eq!(c.domain_xml_with_macs(&same).unwrap(), c.domain_xml);
        let theirs = [("blue".to_owned(), [0x0a, 0x58, 0x0a, 0x4d, 0, 7])];
        let xml = c.domain_xml_with_macs(&theirs).unwrap();
        let old = format!("<mac address=\"{}\"/>", format_mac(&blue.mac));
        assert!(c.domain_xml.contains(&old), "{}", c.domain_xml);
        assert!(!xml.contains(&old), "{xml}");
        assert!(
            xml.contains("<mac address=\"0a:58:0a:4d:00:07\"/>"),
            "{xml}"
        );
        assert_eq!(xml.len(), c.domain_xml.len());
        assert!(
            xml.contains("<mac address=\"02:00:00:00:00:0a\"/>"),
            "{xml}"
        );
    }

    #[test]
    fn what_secondary_networks_cannot_do_is_refused_by_name() {
        for (yaml, field) in [
            ("domain: {devices: {interfaces: [{name: b, masquerade: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[0].masquerade"),
            ("domain: {devices: {interfaces: [{name: b, macvtap: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[0].macvtap"),
            ("domain: {devices: {interfaces: [{name: b, sriov: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[0].sriov"),
            ("domain: {devices: {interfaces: [{name: b, passt: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[0].passt"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}}]}}\nnetworks: [{name: b, multus: {networkName: n, default: true}}]", "spec.networks[0].multus.default"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}}]}}\nnetworks: [{name: b, multus: {networkName: 'Bad/Name'}}]", "spec.networks[0].multus.networkName"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}}]}}\nnetworks: [{name: b, multus: {}}]", "spec.networks[0].multus.networkName"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}, ports: [{port: 80}]}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[0].ports"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}}, {name: c, bridge: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}]", "spec.domain.devices.interfaces[1].name"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}}]}}\nnetworks: [{name: b, multus: {networkName: n}}, {name: c, multus: {networkName: n}}]", "spec.domain.devices.interfaces"),
            ("domain: {devices: {interfaces: [{name: b, bridge: {}, macAddress: '02:00:00:00:00:01'}, {name: c, bridge: {}, macAddress: '02:00:00:00:00:01'}]}}\nnetworks: [{name: b, multus: {networkName: n}}, {name: c, multus: {networkName: m}}]", "spec.domain.devices.interfaces"),
        ] {
            let e = conv(yaml).unwrap_err();
            assert_eq!(e, vec![field], "{yaml}");
        }
    }

    #[test]
    fn interface_boot_order_is_its_own() {
        let net = |extra: &str| {
            run(
                &vmi(&format!("domain: {{memory: {{guest: 64Mi}}, devices: {{disks: [{{name: a, bootOrder: 1}}], interfaces: [{{name: default, masquerade: {{}}{extra}}}]}}}}\nnetworks: [{{name: default, pod: {{}}}}]\nvolumes: [{{name: a, emptyDisk: {{capacity: 1Mi}}}}]")),
                DomainType::Kvm,
            )
        };
        let x = net(", bootOrder: 2").unwrap().domain_xml;
        assert!(
            x.contains("<model type=\"virtio\"/>\n      <boot order=\"2\"/>"),
            "{x}"
        );
        assert_eq!(
            fields(net(", bootOrder: 1")),
            ["spec.domain.devices.interfaces[0].bootOrder"]
        );
        assert_eq!(
            fields(net(", bootOrder: 0")),
            ["spec.domain.devices.interfaces[0].bootOrder"]
        );
    }
}
