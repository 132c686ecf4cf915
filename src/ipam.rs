//! Addresses for VMs out of the node's VM subnet, one per VM id, persisted
//! so that no address is ever held by two VMs, not even across a restart.
//!
//! [`Leases`] is the pure allocator, [`LeaseFile`] the on-disk form and
//! [`Ipam`] ties them together: every change is on disk before the caller
//! sees it. All of it is blocking (file I/O under a `std` mutex): call it
//! from a blocking thread.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};

/// Smaller than /16 would be 65k+ VMs per node, a typo rather than a plan;
/// /30 and beyond leave fewer than 5 VM addresses, same.
const MIN_PREFIX: u8 = 16;
const MAX_PREFIX: u8 = 29;

/// Bumped on any incompatible change of [`LeaseFile`]'s format.
const FILE_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    #[error("invalid subnet {text:?}: {reason}")]
    InvalidSubnet { text: String, reason: String },
    #[error("subnet {subnet} exhausted: all {capacity} VM addresses are leased")]
    Exhausted { subnet: Subnet, capacity: u32 },
    #[error("lease file {path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("lease file {path} is unreadable, refusing to start from empty: {source}")]
    Corrupt {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("lease file {path} has version {found}, this kvirtd reads {FILE_VERSION}")]
    Version { path: PathBuf, found: u32 },
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
            .map_err(|_| invalid("not an IPv4 address (IPv6 is not supported yet)"))?;
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

/// A lease that [`LeaseFile::load`] left out; the caller should log it at
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

/// What [`LeaseFile::load`] found.
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

/// The leases on disk, as one JSON file replaced atomically on every save.
#[derive(Clone, Debug)]
pub struct LeaseFile {
    path: PathBuf,
}

impl LeaseFile {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A missing file is an empty set of leases (first start). A file that
    /// cannot be parsed is an error rather than empty: starting empty would
    /// hand out addresses that running VMs still hold.
    ///
    /// Leases that do not fit `subnet` (it changed since the file was
    /// written) are left out and returned in [`Loaded::dropped`].
    pub fn load(&self, subnet: Subnet) -> Result<Loaded, IpamError> {
        let text = match std::fs::read(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Loaded {
                    leases: Leases::new(subnet),
                    dropped: Vec::new(),
                })
            }
            Err(source) => return Err(self.io("read")(source)),
        };
        let file: FileFormat =
            serde_json::from_slice(&text).map_err(|source| IpamError::Corrupt {
                path: self.path.clone(),
                source,
            })?;
        if file.version != FILE_VERSION {
            return Err(IpamError::Version {
                path: self.path.clone(),
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

    /// Replaces the file with `leases`: a temporary file beside it, synced,
    /// renamed over it, then the directory synced, so after a crash the file
    /// is either the old or the new set, never a torn one.
    pub fn save(&self, leases: &Leases) -> Result<(), IpamError> {
        let file = FileFormat {
            version: FILE_VERSION,
            subnet: leases.subnet.to_string(),
            last: leases.last,
            leases: leases.by_id.clone(),
        };
        let mut text = serde_json::to_vec_pretty(&file).expect("leases serialize to JSON");
        text.push(b'\n');

        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(dir).map_err(self.io("create directory"))?;
        let mut name = self.path.file_name().unwrap_or_default().to_owned();
        name.push(".tmp");
        let tmp = dir.join(name);

        let mut f = std::fs::File::create(&tmp).map_err(self.io("create temporary file"))?;
        f.write_all(&text)
            .map_err(self.io("write temporary file"))?;
        f.sync_all().map_err(self.io("sync temporary file"))?;
        drop(f);
        std::fs::rename(&tmp, &self.path).map_err(self.io("rename temporary file"))?;
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(self.io("sync directory"))?;
        Ok(())
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> IpamError + '_ {
        move |source| IpamError::Io {
            path: self.path.clone(),
            op,
            source,
        }
    }
}

/// The leases of this node, shared by all reconcilers.
///
/// A change is made on a copy, saved, and only then becomes the state in
/// memory: when the save fails the caller gets the error and memory still
/// matches the disk, so an address is never in use without being on disk.
#[derive(Debug)]
pub struct Ipam {
    file: LeaseFile,
    leases: Mutex<Leases>,
}

impl Ipam {
    /// Loads the leases; the dropped ones are for the caller to log.
    pub fn open(file: LeaseFile, subnet: Subnet) -> Result<(Self, Vec<DroppedLease>), IpamError> {
        let Loaded { leases, dropped } = file.load(subnet)?;
        Ok((
            Self {
                file,
                leases: Mutex::new(leases),
            },
            dropped,
        ))
    }

    pub fn subnet(&self) -> Subnet {
        self.lock().subnet
    }

    /// The address of `id`, leased and on disk before this returns.
    pub fn lease(&self, id: &str, uid: &str) -> Result<Ipv4Addr, IpamError> {
        let mut leases = self.lock();
        if let Some(lease) = leases.get(id).filter(|l| l.uid == uid) {
            return Ok(lease.ip);
        }
        let mut next = leases.clone();
        let ip = next.allocate(id, uid)?;
        self.file.save(&next)?;
        *leases = next;
        Ok(ip)
    }

    /// Frees `id`'s address; on error it stays leased (the safe side).
    pub fn release(&self, id: &str) -> Result<Option<Ipv4Addr>, IpamError> {
        let mut leases = self.lock();
        if leases.get(id).is_none() {
            return Ok(None);
        }
        let mut next = leases.clone();
        let ip = next.release(id);
        self.file.save(&next)?;
        *leases = next;
        Ok(ip)
    }

    pub fn get(&self, id: &str) -> Option<Lease> {
        self.lock().get(id).cloned()
    }

    /// A copy of all leases, e.g. to release those of VMs that are gone.
    pub fn snapshot(&self) -> Leases {
        self.lock().clone()
    }

    /// State is only ever replaced whole after a successful save, so a
    /// panic elsewhere while holding the lock cannot leave it half-changed.
    fn lock(&self) -> MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
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

    #[test]
    fn file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let file = LeaseFile::new(dir.path().join("sub/leases.json"));
        let s = subnet("10.213.0.0/24");
        let empty = file.load(s).unwrap();
        assert!(empty.leases.is_empty() && empty.dropped.is_empty());

        let mut l = Leases::new(s);
        l.allocate("ns_a", "u1").unwrap();
        l.allocate("ns_b", "u2").unwrap();
        l.release("ns_a");
        file.save(&l).unwrap();
        let loaded = file.load(s).unwrap();
        assert!(loaded.dropped.is_empty());
        assert_eq!(loaded.leases, l);
        // The cursor survives: the next address follows ns_b's, not ns_a's.
        let mut again = loaded.leases;
        assert_eq!(again.allocate("ns_c", "u3").unwrap(), ip("10.213.0.4"));
        assert!(!dir.path().join("sub/leases.json.tmp").exists());
    }

    #[test]
    fn load_keeps_only_leases_that_fit_a_changed_subnet() {
        let dir = tempfile::tempdir().unwrap();
        let file = LeaseFile::new(dir.path().join("leases.json"));
        let mut old = Leases::new(subnet("10.0.0.0/28"));
        for id in ["a", "b", "c", "d", "e", "f"] {
            old.allocate(id, "u").unwrap(); // .2 ..= .7
        }
        file.save(&old).unwrap();

        // .7 is the broadcast of the new subnet, the rest still fit.
        let loaded = file.load(subnet("10.0.0.0/29")).unwrap();
        assert_eq!(
            loaded.leases.ids().collect::<Vec<_>>(),
            ["a", "b", "c", "d", "e"]
        );
        assert_eq!(
            loaded.dropped,
            [DroppedLease {
                id: "f".into(),
                lease: Lease {
                    ip: ip("10.0.0.7"),
                    uid: "u".into()
                },
                reason: DropReason::OutsideSubnet
            }]
        );
        assert!(loaded.dropped[0].to_string().contains("10.0.0.7"));
        let moved = file.load(subnet("10.9.0.0/24")).unwrap();
        assert!(moved.leases.is_empty());
        assert_eq!(moved.dropped.len(), 6);
    }

    #[test]
    fn load_drops_a_duplicate_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.json");
        let file = LeaseFile::new(&path);
        std::fs::write(
            &path,
            r#"{"version":1,"subnet":"10.0.0.0/24","leases":{
                "a":{"ip":"10.0.0.5","uid":"1"},"b":{"ip":"10.0.0.5","uid":"2"}}}"#,
        )
        .unwrap();
        let loaded = file.load(subnet("10.0.0.0/24")).unwrap();
        assert_eq!(loaded.leases.holder(ip("10.0.0.5")), Some("a"));
        assert_eq!(
            loaded.dropped[0].reason,
            DropReason::Duplicate { holder: "a".into() }
        );

        std::fs::write(&path, "{\"version\":1,").unwrap();
        assert!(matches!(
            file.load(subnet("10.0.0.0/24")),
            Err(IpamError::Corrupt { .. })
        ));
        std::fs::write(&path, r#"{"version":2,"subnet":"x","leases":{}}"#).unwrap();
        assert!(matches!(
            file.load(subnet("10.0.0.0/24")),
            Err(IpamError::Version { found: 2, .. })
        ));
    }

    #[test]
    fn ipam_persists_every_change_before_returning() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.json");
        let s = subnet("10.213.0.0/24");
        let (ipam, dropped) = Ipam::open(LeaseFile::new(&path), s).unwrap();
        assert!(dropped.is_empty());
        let a = ipam.lease("ns_a", "u1").unwrap();
        let b = ipam.lease("ns_b", "u2").unwrap();
        assert_eq!(ipam.lease("ns_a", "u1").unwrap(), a);

        // A "restart" sees exactly what the first instance handed out.
        let reopened = || Ipam::open(LeaseFile::new(&path), s).unwrap().0;
        assert_eq!(reopened().get("ns_a").unwrap().ip, a);
        assert_eq!(reopened().get("ns_b").unwrap().ip, b);
        assert_ne!(reopened().lease("ns_c", "u3").unwrap(), a);

        assert_eq!(ipam.lease("ns_a", "u9").unwrap(), a);
        assert_eq!(reopened().get("ns_a").unwrap().uid, "u9");
        assert_eq!(ipam.release("ns_a").unwrap(), Some(a));
        assert_eq!(ipam.release("ns_a").unwrap(), None);
        assert!(reopened().get("ns_a").is_none());
        assert_eq!(ipam.snapshot().len(), 1);
        assert_eq!(ipam.subnet(), s);
    }

    #[test]
    fn ipam_failed_save_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("leases.json");
        // A directory where the temporary file goes: every save fails, even
        // for root.
        std::fs::create_dir(dir.path().join("leases.json.tmp")).unwrap();
        let s = subnet("10.213.0.0/24");
        let (ipam, _) = Ipam::open(LeaseFile::new(&path), s).unwrap();
        let err = ipam.lease("ns_a", "u").unwrap_err();
        assert!(matches!(err, IpamError::Io { .. }), "{err}");
        assert!(ipam.get("ns_a").is_none());
        assert!(ipam.snapshot().is_empty());
        assert!(!path.exists());
    }

    #[test]
    fn ipam_is_shared_across_threads_without_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let s = subnet("10.213.0.0/24");
        let (ipam, _) = Ipam::open(LeaseFile::new(dir.path().join("l.json")), s).unwrap();
        let ips: Vec<Ipv4Addr> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    let ipam = &ipam;
                    scope.spawn(move || {
                        (0..10)
                            .map(|i| ipam.lease(&format!("ns_t{t}v{i}"), "u").unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(ips.iter().collect::<HashSet<_>>().len(), 40);
        let on_disk = LeaseFile::new(dir.path().join("l.json")).load(s).unwrap();
        assert_eq!(on_disk.leases, ipam.snapshot());
    }
}
