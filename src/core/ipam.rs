//! Addresses for VMs out of the node's VM subnet, one per VM id, persisted
//! so that no address is ever held by two VMs, not even across a restart.
//!
//! [`Leases`] is the pure allocator and its file format; `host::ipam` keeps
//! it on disk, every change saved before the caller sees it.

use core::net::{Ipv4Addr, Ipv6Addr};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Smaller than /16 would be 65k+ VMs per node, a typo rather than a plan;
/// /30 and beyond leave fewer than 5 VM addresses, same.
const MIN_PREFIX: u8 = 16;
const MAX_PREFIX: u8 = 29;

/// Bumped on any incompatible change of the lease file's format.
const FILE_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    #[error("invalid subnet {text:?}: {reason}")]
    InvalidSubnet { text: String, reason: String },
    #[error("subnet {subnet} exhausted: all {capacity} VM addresses are leased")]
    Exhausted { subnet: Subnet, capacity: u32 },
    /// The lease file's text (its path is the caller's to add).
    #[error("is unreadable, refusing to start from empty: {source}")]
    Corrupt { source: serde_json::Error },
    #[error("has version {found}, this kvirtd reads {FILE_VERSION}")]
    Version { found: u32 },
}

/// An IPv4 subnet whose first host address is the gateway (`kvirt0`) and
/// whose remaining host addresses go to VMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Subnet {
    network: Ipv4Addr,
    prefix: u8,
}

impl Subnet {
    pub fn new(network: Ipv4Addr, prefix: u8) -> Result<Self, IpamError> {
        let text = || format!("{network}/{prefix}");
        if !(MIN_PREFIX..=MAX_PREFIX).contains(&prefix) {
            return Err(IpamError::InvalidSubnet {
                text: text(),
                reason: format!("prefix must be {MIN_PREFIX}..={MAX_PREFIX}"),
            });
        }
        let subnet = Self { network, prefix };
        if u32::from(network) & !subnet.mask() != 0 {
            return Err(IpamError::InvalidSubnet {
                text: text(),
                reason: format!(
                    "host bits set, the network address is {}",
                    Ipv4Addr::from(u32::from(network) & subnet.mask())
                ),
            });
        }
        Ok(subnet)
    }

    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    pub fn netmask(&self) -> Ipv4Addr {
        self.mask().into()
    }

    /// The bridge's address: the first host address.
    pub fn gateway(&self) -> Ipv4Addr {
        (self.base() + 1).into()
    }

    pub fn broadcast(&self) -> Ipv4Addr {
        (self.base() | !self.mask()).into()
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & self.mask() == self.base()
    }

    /// Whether `ip` may be leased: inside, and not network, gateway or
    /// broadcast.
    pub fn is_vm_address(&self, ip: Ipv4Addr) -> bool {
        (self.first_vm()..=self.last_vm()).contains(&u32::from(ip))
    }

    /// How many VM addresses there are.
    pub fn capacity(&self) -> u32 {
        self.last_vm() - self.first_vm() + 1
    }

    fn mask(&self) -> u32 {
        u32::MAX << (32 - self.prefix)
    }

    fn base(&self) -> u32 {
        self.network.into()
    }

    fn first_vm(&self) -> u32 {
        self.base() + 2
    }

    fn last_vm(&self) -> u32 {
        u32::from(self.broadcast()) - 1
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Subnet {
    type Err = IpamError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| IpamError::InvalidSubnet {
            text: s.into(),
            reason: reason.into(),
        };
        let (addr, prefix) = s
            .trim()
            .split_once('/')
            .ok_or_else(|| invalid("expected ADDRESS/PREFIX, e.g. 10.213.0.0/24"))?;
        let addr = addr
            .parse::<Ipv4Addr>()
            .map_err(|_| invalid("not an IPv4 address (IPv6 ranges go in subnet6)"))?;
        let prefix = prefix
            .parse::<u8>()
            .map_err(|_| invalid("prefix is not a number"))?;
        Self::new(addr, prefix)
    }
}

impl TryFrom<String> for Subnet {
    type Error = IpamError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Subnet> for String {
    fn from(s: Subnet) -> Self {
        s.to_string()
    }
}

/// The node's IPv6 VM range, beside the IPv4 subnet: a VM's IPv6 address
/// is this network plus the host part of its IPv4 lease (10.213.0.7 →
/// `<network>::7`). So one lease, one atomic write, gives both families: a
/// crash cannot leave a VM with one family's address and not the other's,
/// and no second lease file has to agree with the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Subnet6 {
    network: Ipv6Addr,
    prefix: u8,
}

/// A /64 is the usual site assignment; past /120 too few addresses are
/// left for a node's VMs.
const MIN_PREFIX6: u8 = 64;
const MAX_PREFIX6: u8 = 120;

impl Subnet6 {
    /// A range that fits `v4`'s host part, is unicast and global or
    /// unique-local, and stays clear of the guest's own `fd10:0:2::/120`
    /// (both are routed in the VM's namespace).
    pub fn new(network: Ipv6Addr, prefix: u8, v4: &Subnet) -> Result<Self, IpamError> {
        let invalid = |reason: String| IpamError::InvalidSubnet {
            text: format!("{network}/{prefix}"),
            reason,
        };
        if !(MIN_PREFIX6..=MAX_PREFIX6).contains(&prefix) {
            return Err(invalid(format!(
                "prefix must be {MIN_PREFIX6}..={MAX_PREFIX6}"
            )));
        }
        let host_bits = 32 - u32::from(v4.prefix());
        if 128 - u32::from(prefix) < host_bits {
            return Err(invalid(format!(
                "has fewer host bits than the IPv4 subnet {v4} ({host_bits}): prefix at most /{}",
                128 - host_bits
            )));
        }
        let s = Self { network, prefix };
        if u128::from(network) & !s.mask() != 0 {
            return Err(invalid(format!(
                "host bits set, the network address is {}",
                Ipv6Addr::from(u128::from(network) & s.mask())
            )));
        }
        let first = network.segments()[0];
        if first & 0xffc0 == 0xfe80 || first & 0xff00 == 0xff00 || network.is_unspecified() {
            return Err(invalid(
                "not a unicast range (link-local, multicast)".into(),
            ));
        }
        let guest = crate::core::dhcp6::GUEST_NET;
        let common = prefix.min(crate::core::dhcp6::PREFIX);
        let m = u128::MAX << (128 - u32::from(common));
        if u128::from(network) & m == u128::from(guest) & m {
            return Err(invalid(format!(
                "overlaps the guest network {guest}/{}",
                crate::core::dhcp6::PREFIX
            )));
        }
        Ok(s)
    }

    /// Parses `ADDRESS/PREFIX` for the IPv4 subnet `v4`.
    pub fn parse(text: &str, v4: &Subnet) -> Result<Self, IpamError> {
        let invalid = |reason: &str| IpamError::InvalidSubnet {
            text: text.into(),
            reason: reason.into(),
        };
        let (addr, prefix) = text
            .trim()
            .split_once('/')
            .ok_or_else(|| invalid("expected ADDRESS/PREFIX, e.g. fd00:6b76::/64"))?;
        let addr = addr
            .parse::<Ipv6Addr>()
            .map_err(|_| invalid("not an IPv6 address"))?;
        let prefix = prefix
            .parse::<u8>()
            .map_err(|_| invalid("prefix is not a number"))?;
        Self::new(addr, prefix, v4)
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The IPv6 address paired with `ip` of `v4` (its host part kept).
    pub fn address_of(&self, v4: &Subnet, ip: Ipv4Addr) -> Ipv6Addr {
        let host = u32::from(ip) & !v4.mask();
        Ipv6Addr::from(u128::from(self.network) | u128::from(host))
    }

    /// The bridge's IPv6 address, paired with the IPv4 gateway.
    pub fn gateway(&self, v4: &Subnet) -> Ipv6Addr {
        self.address_of(v4, v4.gateway())
    }

    pub fn network(&self) -> Ipv6Addr {
        self.network
    }

    fn mask(&self) -> u128 {
        u128::MAX << (128 - u32::from(self.prefix))
    }
}

impl fmt::Display for Subnet6 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// The address a VM holds, and the uid of the VMI it was handed to, so a
/// leftover lease can be told apart from a live one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub ip: Ipv4Addr,
    pub uid: String,
}

/// The pure allocator: no I/O, no clock.
///
/// Addresses are handed out round-robin, the next free one after the last
/// handed out, like CNI's host-local IPAM: an address just released is the
/// last to come back, so peers' ARP caches, conntrack entries and stale
/// Endpoints that still point at the old VM do not reach a new one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leases {
    subnet: Subnet,
    by_id: BTreeMap<String, Lease>,
    /// The reverse index; kept in step with `by_id`, which is what makes
    /// "never twice" checkable in one place.
    by_ip: BTreeMap<Ipv4Addr, String>,
    /// The last address handed out; the search for a free one starts after it.
    last: Option<Ipv4Addr>,
}

impl Leases {
    pub fn new(subnet: Subnet) -> Self {
        Self {
            subnet,
            by_id: BTreeMap::new(),
            by_ip: BTreeMap::new(),
            last: None,
        }
    }

    pub fn subnet(&self) -> Subnet {
        self.subnet
    }

    /// The address of `id`: its existing lease (with `uid` updated, since the
    /// id also names the VM's namespace and a recreated VMI reuses it), or the
    /// next free one.
    pub fn allocate(&mut self, id: &str, uid: &str) -> Result<Ipv4Addr, IpamError> {
        if let Some(lease) = self.by_id.get_mut(id) {
            if lease.uid != uid {
                lease.uid = uid.to_owned();
            }
            return Ok(lease.ip);
        }
        let ip = self.next_free().ok_or(IpamError::Exhausted {
            subnet: self.subnet,
            capacity: self.subnet.capacity(),
        })?;
        self.by_id.insert(
            id.to_owned(),
            Lease {
                ip,
                uid: uid.to_owned(),
            },
        );
        self.by_ip.insert(ip, id.to_owned());
        self.last = Some(ip);
        Ok(ip)
    }

    pub fn release(&mut self, id: &str) -> Option<Ipv4Addr> {
        let lease = self.by_id.remove(id)?;
        self.by_ip.remove(&lease.ip);
        Some(lease.ip)
    }

    pub fn get(&self, id: &str) -> Option<&Lease> {
        self.by_id.get(id)
    }

    /// Which id holds `ip`, if any.
    pub fn holder(&self, ip: Ipv4Addr) -> Option<&str> {
        self.by_ip.get(&ip).map(String::as_str)
    }

    pub fn ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.by_id.keys().map(String::as_str)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Lease)> + '_ {
        self.by_id.iter().map(|(id, lease)| (id.as_str(), lease))
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    fn next_free(&self) -> Option<Ipv4Addr> {
        let (first, last) = (self.subnet.first_vm(), self.subnet.last_vm());
        let start = match self.last.map(u32::from) {
            Some(prev) if prev >= first && prev < last => prev + 1,
            _ => first,
        };
        (start..=last)
            .chain(first..start)
            .map(Ipv4Addr::from)
            .find(|ip| !self.by_ip.contains_key(ip))
    }

    /// Adopts a lease read from disk, or returns why it cannot be kept.
    fn adopt(&mut self, id: String, lease: Lease) -> Result<(), (String, Lease, DropReason)> {
        if !self.subnet.is_vm_address(lease.ip) {
            return Err((id, lease, DropReason::OutsideSubnet));
        }
        if let Some(holder) = self.by_ip.get(&lease.ip) {
            let holder = holder.clone();
            return Err((id, lease, DropReason::Duplicate { holder }));
        }
        self.by_ip.insert(lease.ip, id.clone());
        self.by_id.insert(id, lease);
        Ok(())
    }
}

/// Why a lease on disk was not loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Not a VM address of the configured subnet (it changed since).
    OutsideSubnet,
    /// Another id, earlier in order, already holds the address; only a
    /// hand-edited file can get here.
    Duplicate { holder: String },
}

/// A lease that [`Leases::decode`] left out; the caller should log it at
/// warning level (the VM, if it still runs, keeps an address kvirt no
/// longer knows about).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppedLease {
    pub id: String,
    pub lease: Lease,
    pub reason: DropReason,
}

impl fmt::Display for DroppedLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lease of {} for {}: ", self.lease.ip, self.id)?;
        match &self.reason {
            DropReason::OutsideSubnet => f.write_str("not a VM address of the subnet"),
            DropReason::Duplicate { holder } => write!(f, "address already held by {holder}"),
        }
    }
}

/// What [`Leases::decode`] found.
#[derive(Debug)]
pub struct Loaded {
    pub leases: Leases,
    /// Leases that no longer fit the subnet; the file keeps them until the
    /// next save, so reverting a mistaken subnet change loses nothing.
    pub dropped: Vec<DroppedLease>,
}

#[derive(Serialize, Deserialize)]
struct FileFormat {
    version: u32,
    /// Informational: the subnet in force when written. Kept as text so a
    /// file from a kvirtd with other subnet rules still loads.
    subnet: String,
    #[serde(default)]
    last: Option<Ipv4Addr>,
    leases: BTreeMap<String, Lease>,
}

impl Leases {
    /// Reads the lease file's text. Leases that do not fit `subnet` (it
    /// changed since the file was written) are left out and returned in
    /// [`Loaded::dropped`]. Text that cannot be parsed is an error rather
    /// than empty: starting empty would hand out addresses that running VMs
    /// still hold.
    pub fn decode(text: &[u8], subnet: Subnet) -> Result<Loaded, IpamError> {
        let file: FileFormat =
            serde_json::from_slice(text).map_err(|source| IpamError::Corrupt { source })?;
        if file.version != FILE_VERSION {
            return Err(IpamError::Version {
                found: file.version,
            });
        }
        let mut leases = Leases::new(subnet);
        let mut dropped = Vec::new();
        for (id, lease) in file.leases {
            if let Err((id, lease, reason)) = leases.adopt(id, lease) {
                dropped.push(DroppedLease { id, lease, reason });
            }
        }
        leases.last = file.last.filter(|ip| subnet.is_vm_address(*ip));
        Ok(Loaded { leases, dropped })
    }

    /// The lease file's text for these leases.
    pub fn encode(&self) -> Vec<u8> {
        let file = FileFormat {
            version: FILE_VERSION,
            subnet: self.subnet.to_string(),
            last: self.last,
            leases: self.by_id.clone(),
        };
        let mut text = serde_json::to_vec_pretty(&file).expect("leases serialize to JSON");
        text.push(b'\n');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn subnet_parses_and_derives_addresses() {
        let s = subnet("10.213.0.0/24");
        assert_eq!(s.network(), ip("10.213.0.0"));
        assert_eq!(s.prefix(), 24);
        assert_eq!(s.netmask(), ip("255.255.255.0"));
        assert_eq!(s.gateway(), ip("10.213.0.1"));
        assert_eq!(s.broadcast(), ip("10.213.0.255"));
        assert_eq!(s.capacity(), 253);
        assert!(s.contains(ip("10.213.0.0")));
        assert!(!s.contains(ip("10.213.1.0")));
        assert!(!s.is_vm_address(ip("10.213.0.0")));
        assert!(!s.is_vm_address(ip("10.213.0.1")));
        assert!(s.is_vm_address(ip("10.213.0.2")));
        assert!(s.is_vm_address(ip("10.213.0.254")));
        assert!(!s.is_vm_address(ip("10.213.0.255")));
        assert_eq!(s.to_string(), "10.213.0.0/24");
        assert_eq!(subnet(" 10.0.0.0/16 ").capacity(), 65533);
        assert_eq!(subnet("10.0.0.8/29").capacity(), 5);
    }

    #[test]
    fn an_ipv6_range_pairs_each_vm_address_with_one_of_its_own() {
        let v4 = subnet("10.213.0.0/24");
        let s = Subnet6::parse("fd00:6b76::/64", &v4).unwrap();
        assert_eq!(s.gateway(&v4), "fd00:6b76::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(
            s.address_of(&v4, ip("10.213.0.254")),
            "fd00:6b76::fe".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(s.to_string(), "fd00:6b76::/64");
        // As many host bits as the IPv4 subnet is enough.
        assert!(Subnet6::parse("fd00:6b76::100/120", &v4).is_ok());
        for bad in [
            "fd00:6b76::",
            "fd00:6b76::/x",
            "10.0.0.0/64",
            "fd00:6b76::/63",
            "fd00:6b76::/121",
            "fd00:6b76::1/64",
            "fe80::/64",
            "ff02::/64",
            "fd10:0:2::/64",
            "fd10:0:2::/120",
        ] {
            let err = Subnet6::parse(bad, &v4).map(|s| s.to_string());
            assert!(err.is_err(), "{bad} accepted: {err:?}");
        }
        // A /120 holds a /24's host part, not a /16's.
        assert!(Subnet6::parse("fd00:6b76::/120", &subnet("10.0.0.0/16")).is_err());
        // The guest's net itself is refused, a neighbour of it is fine.
        assert!(Subnet6::parse("fd10:0:2::/120", &v4).is_err());
        assert!(Subnet6::parse("fd10:0:2::100/120", &v4).is_ok());
    }

    #[test]
    fn subnet_rejects_bad_text() {
        for bad in [
            "10.213.0.0",
            "10.213.0.0/",
            "10.213.0.0/x",
            "10.213.0/24",
            "fd00::/64",
            "10.0.0.0/15",
            "10.0.0.0/30",
            "10.0.0.0/32",
            "10.213.0.1/24",
            "10.0.0.4/29",
        ] {
            let err = bad.parse::<Subnet>().unwrap_err();
            assert!(
                matches!(err, IpamError::InvalidSubnet { .. }),
                "{bad}: {err}"
            );
        }
        let err = "10.213.0.1/24".parse::<Subnet>().unwrap_err().to_string();
        assert!(err.contains("10.213.0.0"), "{err}");
    }

    #[test]
    fn subnet_serde_is_its_text() {
        let s = subnet("10.213.0.0/24");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"10.213.0.0/24\"");
        assert_eq!(
            serde_json::from_str::<Subnet>("\"10.213.0.0/24\"").unwrap(),
            s
        );
        assert!(serde_json::from_str::<Subnet>("\"10.213.0.0/8\"").is_err());
    }

    #[test]
    fn allocation_starts_after_gateway_and_is_unique() {
        let mut l = Leases::new(subnet("10.213.0.0/22"));
        let mut seen = HashSet::new();
        for i in 0..l.subnet().capacity() {
            let a = l.allocate(&format!("ns_vm{i}"), "uid").unwrap();
            if i == 0 {
                assert_eq!(a, ip("10.213.0.2"));
            }
            assert!(l.subnet().is_vm_address(a), "{a}");
            assert!(seen.insert(a), "{a} handed out twice");
        }
        assert_eq!(seen.len(), 1021);
        assert!(!seen.contains(&ip("10.213.3.255")));
        assert!(!seen.contains(&ip("10.213.0.1")));
    }

    #[test]
    fn allocation_is_idempotent_per_id() {
        let mut l = Leases::new(subnet("10.213.0.0/24"));
        let a = l.allocate("ns_a", "u1").unwrap();
        let b = l.allocate("ns_b", "u2").unwrap();
        assert_ne!(a, b);
        assert_eq!(l.allocate("ns_a", "u1").unwrap(), a);
        assert_eq!(l.len(), 2);
        // A recreated VMI keeps its id's address, under its new uid.
        assert_eq!(l.allocate("ns_a", "u3").unwrap(), a);
        assert_eq!(l.get("ns_a").unwrap().uid, "u3");
        assert_eq!(l.holder(a), Some("ns_a"));
        assert_eq!(l.ids().collect::<Vec<_>>(), ["ns_a", "ns_b"]);
    }

    #[test]
    fn released_address_is_reused_last() {
        let mut l = Leases::new(subnet("10.0.0.8/29"));
        let a = l.allocate("a", "u").unwrap();
        assert_eq!(a, ip("10.0.0.10"));
        assert_eq!(l.release("a"), Some(a));
        assert_eq!(l.release("a"), None);
        assert!(l.get("a").is_none());
        assert_eq!(l.holder(a), None);
        // Round robin: the next ones first, then wrap around to a.
        let next: Vec<_> = ["b", "c", "d", "e", "f"]
            .iter()
            .map(|id| l.allocate(id, "u").unwrap())
            .collect();
        assert_eq!(
            next,
            [
                "10.0.0.11",
                "10.0.0.12",
                "10.0.0.13",
                "10.0.0.14",
                "10.0.0.10"
            ]
            .map(ip)
        );
    }

    #[test]
    fn exhaustion_is_an_error_until_something_is_released() {
        let mut l = Leases::new(subnet("10.0.0.8/29"));
        for id in ["a", "b", "c", "d", "e"] {
            l.allocate(id, "u").unwrap();
        }
        let err = l.allocate("f", "u").unwrap_err();
        assert!(matches!(err, IpamError::Exhausted { capacity: 5, .. }));
        assert!(err.to_string().contains("10.0.0.8/29"), "{err}");
        // Existing ids still get theirs.
        assert_eq!(l.allocate("c", "u").unwrap(), ip("10.0.0.12"));
        let freed = l.release("c").unwrap();
        assert_eq!(l.allocate("f", "u").unwrap(), freed);
    }

    /// xorshift64: enough randomness for a property loop, reproducible.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    fn assert_consistent(l: &Leases) {
        let ips: HashSet<_> = l.iter().map(|(_, lease)| lease.ip).collect();
        assert_eq!(ips.len(), l.len(), "an address is held twice");
        assert_eq!(l.by_ip.len(), l.by_id.len());
        for (id, lease) in l.iter() {
            assert!(l.subnet.is_vm_address(lease.ip));
            assert_eq!(l.holder(lease.ip), Some(id));
        }
    }

    #[test]
    fn random_allocate_release_never_duplicates() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        // /28: 13 addresses for 20 ids, so exhaustion and wrap-around happen.
        let mut l = Leases::new(subnet("10.1.2.16/28"));
        let mut model: BTreeMap<String, Ipv4Addr> = BTreeMap::new();
        let (mut exhausted, mut released) = (0, 0);
        for _ in 0..1000 {
            let id = format!("ns_vm{}", rng.next() % 20);
            if rng.next() % 3 == 0 {
                assert_eq!(l.release(&id), model.remove(&id));
                released += 1;
            } else {
                match l.allocate(&id, "u") {
                    Ok(a) => {
                        assert_eq!(*model.entry(id).or_insert(a), a, "address changed");
                    }
                    Err(IpamError::Exhausted { .. }) => {
                        assert_eq!(model.len(), 13);
                        assert!(!model.contains_key(&id));
                        exhausted += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            assert_consistent(&l);
        }
        assert!(exhausted > 0 && released > 0, "{exhausted} {released}");
    }
}
