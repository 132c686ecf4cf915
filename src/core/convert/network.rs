//! The pod network with KubeVirt's masquerade binding: the only network
//! kvirt gives a VM. Everything else (bridge, SR-IOV, passt, Multus) is
//! refused by name.

use super::domain::{Boot, Interface, InterfaceAlias, InterfaceModel, InterfaceTarget, MacAddress};
use super::Errors;
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

fn parse_mac(s: &str) -> Option<[u8; 6]> {
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

/// Converts the VMI's networks and interfaces; `default_mac` is used when
/// the VMI names none (the DHCP server must know the guest's MAC).
pub(super) fn convert(
    spec: &VmiSpec,
    default_mac: [u8; 6],
    errs: &mut Errors,
) -> Option<(Interface, NetSpec)> {
    const IFACES: &str = "spec.domain.devices.interfaces";
    let dev = &spec.domain.devices;
    if spec.networks.is_empty() && dev.interfaces.is_empty() {
        if dev.autoattach_pod_interface == Some(false) {
            return None;
        }
        let net = NetSpec {
            name: DEFAULT_NETWORK.into(),
            mac: default_mac,
            ports: vec![],
            vm_cidr: DEFAULT_VM_CIDR,
            hostname: String::new(),
            domain_search: None,
        };
        return Some((interface(&net, "virtio"), net));
    }

    let mut vm_cidr = DEFAULT_VM_CIDR;
    let mut pod_network = None;
    for (i, n) in spec.networks.iter().enumerate() {
        let path = format!("spec.networks[{i}]");
        let mut extra = n.extra.clone();
        match extra.remove("pod") {
            Some(pod) if pod_network.is_none() => {
                pod_network = Some(n.name.clone());
                if let Some(cidr) = pod.get("vmNetworkCIDR") {
                    match cidr.as_str().and_then(parse_cidr) {
                        Some(c) => vm_cidr = c,
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
            Some(_) => errs.add(format!("{path}.pod"), "only one pod network is possible"),
            None => {
                errs.add(
                    path.clone(),
                    "only the pod network is supported (no Multus or other networks yet)",
                );
                continue;
            }
        }
        for k in extra.keys() {
            errs.add(format!("{path}.{k}"), super::UNSUPPORTED);
        }
    }

    if dev.interfaces.len() > 1 {
        errs.add(
            IFACES,
            "only one interface (on the pod network) is supported",
        );
    }
    let Some(iface) = dev.interfaces.first() else {
        errs.add(
            IFACES,
            "spec.networks names a network but no interface uses it",
        );
        return None;
    };
    let path = format!("{IFACES}[0]");
    if Some(&iface.name) != pod_network.as_ref() {
        errs.add(
            format!("{path}.name"),
            format!(
                "{:?} is not the name of a pod network in spec.networks",
                iface.name
            ),
        );
    }
    let mut extra = iface.extra.clone();
    if extra.remove("masquerade").is_none() {
        let binding = BINDINGS.iter().find(|b| extra.contains_key(**b));
        errs.add(
            format!("{path}.{}", binding.unwrap_or(&"masquerade")),
            match binding {
                Some(b) => format!("the {b} binding is not supported yet; use masquerade"),
                None => "the interface needs a binding; only masquerade is supported".into(),
            },
        );
        for b in BINDINGS {
            extra.remove(*b);
        }
    }
    let mac = match extra.remove("macAddress") {
        None => default_mac,
        Some(v) => v.as_str().and_then(parse_mac).unwrap_or_else(|| {
            errs.add(
                format!("{path}.macAddress"),
                format!("{v} is not a unicast MAC address"),
            );
            default_mac
        }),
    };
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
    let ports = extra
        .remove("ports")
        .map(|p| ports(&p, &format!("{path}.ports"), errs))
        .unwrap_or_default();
    // PXE from the pod network; disks check that no two share an order.
    let boot = extra.remove("bootOrder").and_then(|v| match v.as_u64() {
        Some(order @ 1..=65535) => Some(Boot {
            order: order as u32,
        }),
        _ => {
            errs.add(format!("{path}.bootOrder"), "must be at least 1");
            None
        }
    });
    for k in extra.keys() {
        errs.add(format!("{path}.{k}"), super::UNSUPPORTED);
    }
    let net = NetSpec {
        name: iface.name.clone(),
        mac,
        ports,
        vm_cidr,
        hostname: String::new(),
        domain_search: None,
    };
    let mut iface = interface(&net, &model);
    iface.boot = boot;
    Some((iface, net))
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

fn interface(net: &NetSpec, model: &str) -> Interface {
    Interface {
        type_: "ethernet",
        mac: MacAddress {
            address: net.mac_string(),
        },
        target: InterfaceTarget {
            dev: TAP,
            managed: "no",
        },
        model: InterfaceModel {
            type_: model.to_owned(),
        },
        boot: None,
        alias: InterfaceAlias {
            name: format!("ua-{}", net.name),
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

    fn conv(yaml: &str) -> Result<Option<NetSpec>, Vec<String>> {
        let spec: VmiSpec = serde_norway::from_str(yaml).unwrap();
        let mut errs = Errors::default();
        let r = convert(&spec, [2, 1, 2, 3, 4, 5], &mut errs);
        if errs.0.is_empty() {
            Ok(r.map(|(_, n)| n))
        } else {
            Err(errs.0.into_iter().map(|e| e.field).collect())
        }
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
        assert!(e.contains(&"spec.networks[0]".to_string()), "{e:?}");
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
