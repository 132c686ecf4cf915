//! The identity of one VM on this host, and the names derived from it.
//!
//! `<ns>_<name>` is KubeVirt's own domain name; `_` never occurs in a
//! Kubernetes name, so the pair can be recovered from it. Everything that
//! reaches a unit name, a netns name or a path goes through [`VmKey::id`],
//! which is validated here once, so no caller has to escape again.

use sha2::{Digest, Sha256};
use std::fmt;

/// An id this long or shorter is the domain name itself; a longer one is
/// shortened (its start and a hash). The bound is what keeps the VM's
/// sockets under the default runtime directory within a Unix socket
/// path's 107 bytes: the longest is
/// `/run/kvirt/vms/<id>/xdg/libvirt/virtqemud-admin-sock`, 48 bytes and the
/// id. Every VM that ran before under its full name still has it (a longer
/// one was refused), and every Kubernetes name runs
/// (`every_kubernetes_name_fits_the_sockets`).
pub const MAX_ID_LEN: usize = 107 - "/run/kvirt/vms//xdg/libvirt/virtqemud-admin-sock".len();
/// Length of the hash suffix that keeps shortened ids unique.
const HASH_LEN: usize = 16;
/// machined's limit, the kernel's for a host name.
const MAX_MACHINE_LEN: usize = 64;

pub const UNIT_PREFIX: &str = "kvirt-vm@";
pub const UNIT_SUFFIX: &str = ".service";
pub const NETNS_PREFIX: &str = "kvirt-";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("invalid {what} {value:?}: {reason}")]
    Invalid {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("{0:?} is not a kvirt VM id (<namespace>_<name>)")]
    NotAnId(String),
}

/// Namespace and name of a VMI: the key of everything kvirtd does.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VmKey {
    namespace: String,
    name: String,
}

impl VmKey {
    /// Validates both parts as Kubernetes names (RFC 1123 subdomain), which
    /// also guarantees they are safe in unit names, netns names and paths.
    pub fn new(namespace: &str, name: &str) -> Result<Self, KeyError> {
        validate("namespace", namespace, 63)?;
        validate("name", name, 253)?;
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// Parses `NS/NAME` (the CLI form) or `NS_NAME` (the domain name form).
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (ns, name) = s
            .split_once('/')
            .or_else(|| s.split_once('_'))
            .ok_or_else(|| KeyError::NotAnId(s.to_owned()))?;
        Self::new(ns, name)
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// KubeVirt's domain name, `<ns>_<name>`, never shortened (libvirt has
    /// no practical limit).
    pub fn domain_name(&self) -> String {
        format!("{}_{}", self.namespace, self.name)
    }

    /// The id used in unit, netns and directory names: the domain name, or a
    /// deterministic shortened form with a hash when it would not fit a unit
    /// name.
    pub fn id(&self) -> String {
        let full = self.domain_name();
        if full.len() <= MAX_ID_LEN {
            return full;
        }
        shorten(&full, MAX_ID_LEN)
    }

    pub fn unit_name(&self) -> String {
        unit_name_of(&self.id())
    }

    pub fn netns_name(&self) -> String {
        netns_name_of(&self.id())
    }
}

/// A Kubernetes DNS-1123 label: lower-case letters, digits and `-`, at
/// most 63, neither first nor last a `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain (most objects' names): labels joined by dots, at
/// most 253.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Unit name of a VM known only by its id (found on the host).
/// Sixteen bytes in a UUID's form (8-4-4-4-12 hex digits): how kvirt
/// writes the UIDs it makes (digests, random ones).
pub fn uuid_form(b: &[u8]) -> String {
    let x: String = b.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

pub fn unit_name_of(id: &str) -> String {
    format!("{UNIT_PREFIX}{id}{UNIT_SUFFIX}")
}

/// machined's name for the VM: `<ns>.<name>`. machined takes only host
/// names (no `_`), and a namespace has no dots, so the first dot divides.
pub fn machine_name_of(id: &str) -> String {
    let name = id.replacen('_', ".", 1);
    if name.len() <= MAX_MACHINE_LEN {
        return name;
    }
    shorten(&name, MAX_MACHINE_LEN)
}

/// `s` cut to `max` bytes with a hash of all of it, so distinct long names
/// stay distinct and the same name always gives the same result.
fn shorten(s: &str, max: usize) -> String {
    let digest = Sha256::digest(s.as_bytes());
    let hash: String = digest
        .iter()
        .take(HASH_LEN / 2)
        .map(|b| format!("{b:02x}"))
        .collect();
    // Names are ASCII, so byte slicing is on a char boundary; a cut right
    // after a separator would leave an empty label.
    let keep = s[..max - HASH_LEN - 1].trim_end_matches(['.', '-']);
    format!("{keep}-{hash}")
}

pub fn netns_name_of(id: &str) -> String {
    format!("{NETNS_PREFIX}{id}")
}

impl fmt::Display for VmKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The id inside a `kvirt-vm@<id>.service` unit name, if it is one of ours.
pub fn id_from_unit(unit: &str) -> Option<&str> {
    unit.strip_prefix(UNIT_PREFIX)?.strip_suffix(UNIT_SUFFIX)
}

/// The id inside a `kvirt-<id>` netns name, if it is one of ours.
pub fn id_from_netns(netns: &str) -> Option<&str> {
    netns.strip_prefix(NETNS_PREFIX)
}

fn validate(what: &'static str, value: &str, max: usize) -> Result<(), KeyError> {
    let err = |reason| {
        Err(KeyError::Invalid {
            what,
            value: value.to_owned(),
            reason,
        })
    };
    if value.is_empty() {
        return err("must not be empty");
    }
    if value.len() > max {
        return err("too long");
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    {
        return err("only lowercase letters, digits, '-' and '.' are allowed");
    }
    let first = value.as_bytes()[0];
    let last = value.as_bytes()[value.len() - 1];
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return err("must start and end with a letter or digit");
    }
    if value.split('.').any(|part| part.is_empty()) {
        return err("must not contain empty '.' parts");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        let k = VmKey::new("default", "my-vm").unwrap();
        assert_eq!(k.domain_name(), "default_my-vm");
        assert_eq!(k.unit_name(), "kvirt-vm@default_my-vm.service");
        assert_eq!(k.netns_name(), "kvirt-default_my-vm");
        assert_eq!(k.to_string(), "default/my-vm");
        assert_eq!(id_from_unit(&k.unit_name()), Some("default_my-vm"));
    }

    #[test]
    fn parse_accepts_both_forms() {
        let a = VmKey::parse("ns/vm").unwrap();
        let b = VmKey::parse("ns_vm").unwrap();
        assert_eq!(a, b);
        assert!(VmKey::parse("novm").is_err());
    }

    #[test]
    fn rejects_what_could_escape_a_path_or_unit() {
        for bad in [
            "", "..", "a/b", "a_b", "A", "-a", "a-", "a..b", "a b", "a\\x2d",
        ] {
            assert!(VmKey::new("ns", bad).is_err(), "{bad:?} accepted");
        }
        assert!(VmKey::new(&"a".repeat(64), "vm").is_err());
    }

    #[test]
    fn long_names_are_shortened_deterministically() {
        let long = "a".repeat(253);
        let k1 = VmKey::new("ns", &long).unwrap();
        let k2 = VmKey::new("ns", &format!("{}b", "a".repeat(252))).unwrap();
        assert!(k1.unit_name().len() <= 255, "{}", k1.unit_name().len());
        assert_eq!(k1.id().len(), MAX_ID_LEN);
        assert!(k1.id().starts_with("ns_aaaa"), "{}", k1.id());
        assert_eq!(k1.id(), VmKey::new("ns", &long).unwrap().id());
        assert_ne!(k1.id(), k2.id());
        assert_eq!(k1.domain_name().len(), 256);
    }

    #[test]
    fn machine_names_are_host_names() {
        assert_eq!(machine_name_of("default_my-vm"), "default.my-vm");
        assert_eq!(machine_name_of("default_vm.example"), "default.vm.example");
        let long = format!("ns_{}", "a".repeat(100));
        let m = machine_name_of(&long);
        assert_eq!(m.len(), 64, "{m}");
        assert!(m.starts_with("ns.aaa"), "{m}");
        assert_ne!(m, machine_name_of(&format!("ns_{}", "a".repeat(101))));
        // A cut right after the dot leaves no empty label behind.
        let id = format!("{}_{}", "n".repeat(46), "v".repeat(30));
        let m = machine_name_of(&id);
        assert!(!m.contains(".-"), "{m}");
        assert!(m
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'));
    }
}
