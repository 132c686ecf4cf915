//! Each VM's own identity: a uid, and a gid of the same number, out of a
//! configured range, so that no VM's process can signal, trace or read
//! another VM's (the kernel's checks are by uid) and no VM's files are
//! another's to read. [`Identities`] is the pure allocator and its file
//! format: one identity per VM id, never two VMs at once, never a number
//! the host already uses, kept while the VM exists so adoption keeps it.
//! `host::identity` keeps it on disk and gives each identity a user
//! record systemd can resolve.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// Bumped on any incompatible change of the identities file's format.
const FILE_VERSION: u32 = 1;

/// Below this the numbers belong to the system and to people (Debian's
/// and Fedora's `SYS_UID_MAX` and `UID_MAX` are far below).
const MIN_FIRST: u32 = 65536;

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("invalid identity range {text:?}: {reason}")]
    InvalidRange { text: String, reason: String },
    #[error("identity range {range} exhausted: every uid in it is a VM's or the host's")]
    Exhausted { range: IdRange },
    /// The identities file's text (its path is the caller's to add).
    #[error("is unreadable, refusing to start from empty: {source}")]
    Corrupt { source: serde_json::Error },
    #[error("has version {found}, this kvirtd reads {FILE_VERSION}")]
    Version { found: u32 },
}

/// The numbers VM identities come from, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct IdRange {
    first: u32,
    last: u32,
}

impl IdRange {
    pub fn new(first: u32, last: u32) -> Result<Self, IdentityError> {
        let bad = |reason: &str| IdentityError::InvalidRange {
            text: format!("{first}-{last}"),
            reason: reason.into(),
        };
        if first < MIN_FIRST {
            return Err(bad(
                "must start at 65536 or above, clear of system and login users",
            ));
        }
        if last < first {
            return Err(bad("ends before it starts"));
        }
        // 65534 is nobody; (uid_t)-1 and -2 mean "no change" and overflow.
        if last >= u32::MAX - 1 {
            return Err(bad("must end below 4294967294"));
        }
        Ok(Self { first, last })
    }

    pub fn contains(&self, uid: u32) -> bool {
        (self.first..=self.last).contains(&uid)
    }

    pub fn len(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

impl fmt::Display for IdRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl FromStr for IdRange {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason: &str| IdentityError::InvalidRange {
            text: s.into(),
            reason: reason.into(),
        };
        let (a, b) = s.split_once('-').ok_or_else(|| bad("must be FIRST-LAST"))?;
        let num = |t: &str| t.trim().parse::<u32>().map_err(|_| bad("not a number"));
        Self::new(num(a)?, num(b)?)
    }
}

impl TryFrom<String> for IdRange {
    type Error = IdentityError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<IdRange> for String {
    fn from(r: IdRange) -> Self {
        r.to_string()
    }
}

/// The user and group name of a VM identity, as systemd and `ps` show it.
pub fn user_name(uid: u32) -> String {
    format!("kvirt-vm-{uid}")
}

/// The identities of this host's VMs, by VM id.
///
/// Handed out lowest free number first, so a host's VMs over its life use
/// as few numbers as ever ran at once: journald keeps a file per uid that
/// logged (`user-<uid>.journal`, 8 MiB and more each, never vacuumed while
/// in use), and a number per VM ever run filled a host's disk after ~700
/// VMs. A number comes back only once nothing of its VM is left: its unit
/// gone (so no process of it runs), its directories removed, its IPC
/// objects removed with the unit (`RemoveIPC=`), its hostDisk grants taken
/// back, and the VM's unit cannot read the journal files its number may
/// share with its predecessor's (`InaccessiblePaths=`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identities {
    range: IdRange,
    by_id: BTreeMap<String, u32>,
    by_uid: BTreeMap<u32, String>,
}

#[derive(Serialize, Deserialize)]
struct FileFormat {
    version: u32,
    /// Informational: the range in force when written.
    range: String,
    /// (An older kvirt's `last`, from when numbers went round-robin, is
    /// ignored.)
    vms: BTreeMap<String, u32>,
}

/// What [`Identities::decode`] found: the identities, and the entries it
/// could not keep (a number no VM may have, or one given twice; the caller
/// logs them). An identity outside the configured range now (the range
/// was changed) stays its VM's until released, and is never handed out
/// again: its VM may still run, and its grants must go back with it.
#[derive(Debug)]
pub struct Loaded {
    pub identities: Identities,
    pub dropped: Vec<(String, u32)>,
}

impl Identities {
    pub fn new(range: IdRange) -> Self {
        Self {
            range,
            by_id: BTreeMap::new(),
            by_uid: BTreeMap::new(),
        }
    }

    pub fn range(&self) -> IdRange {
        self.range
    }

    pub fn get(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, u32)> + '_ {
        self.by_id.iter().map(|(id, uid)| (id.as_str(), *uid))
    }

    /// The identity of `id`: its own if it has one, else the next number
    /// that is neither a VM's nor `taken` by the host (a user or group of
    /// that number exists).
    pub fn allocate(
        &mut self,
        id: &str,
        taken: impl Fn(u32) -> bool,
    ) -> Result<u32, IdentityError> {
        if let Some(uid) = self.get(id) {
            return Ok(uid);
        }
        let uid = (self.range.first..=self.range.last)
            .find(|u| !self.by_uid.contains_key(u) && !taken(*u))
            .ok_or(IdentityError::Exhausted { range: self.range })?;
        self.by_id.insert(id.to_owned(), uid);
        self.by_uid.insert(uid, id.to_owned());
        Ok(uid)
    }

    pub fn release(&mut self, id: &str) -> Option<u32> {
        let uid = self.by_id.remove(id)?;
        self.by_uid.remove(&uid);
        Some(uid)
    }

    /// Reads the identities file's text. Text that cannot be parsed is an
    /// error rather than empty: starting empty could give a running VM's
    /// number to another.
    pub fn decode(text: &[u8], range: IdRange) -> Result<Loaded, IdentityError> {
        let file: FileFormat =
            serde_json::from_slice(text).map_err(|source| IdentityError::Corrupt { source })?;
        if file.version != FILE_VERSION {
            return Err(IdentityError::Version {
                found: file.version,
            });
        }
        let mut ids = Identities::new(range);
        let mut dropped = Vec::new();
        for (id, uid) in file.vms {
            let possible = IdRange::new(uid, uid).is_ok();
            if possible && !ids.by_uid.contains_key(&uid) {
                ids.by_uid.insert(uid, id.clone());
                ids.by_id.insert(id, uid);
            } else {
                dropped.push((id, uid));
            }
        }
        Ok(Loaded {
            identities: ids,
            dropped,
        })
    }

    /// The identities file's text.
    pub fn encode(&self) -> Vec<u8> {
        let file = FileFormat {
            version: FILE_VERSION,
            range: self.range.to_string(),
            vms: self.by_id.clone(),
        };
        let mut text = serde_json::to_vec_pretty(&file).expect("identities serialize to JSON");
        text.push(b'\n');
        text
    }
}

/// systemd's JSON user record for an identity (a `userdb` drop-in): no
/// home, no shell, no password, and a name that says whose it is.
pub fn user_record(uid: u32, vm: &str) -> serde_json::Value {
    serde_json::json!({
        "userName": user_name(uid),
        "uid": uid,
        "gid": uid,
        "realName": format!("kvirt VM {vm}"),
        "homeDirectory": "/",
        "shell": "/usr/sbin/nologin",
        "locked": true,
        "disposition": "system",
    })
}

/// The group of the same name and number, for the user record's `gid`.
pub fn group_record(uid: u32) -> serde_json::Value {
    serde_json::json!({
        "groupName": user_name(uid),
        "gid": uid,
        "disposition": "system",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(s: &str) -> IdRange {
        s.parse().unwrap()
    }

    #[test]
    fn ranges_are_checked() {
        assert_eq!(range("100000-100009").len(), 10);
        for bad in [
            "1000-2000",
            "200000-100000",
            "x-1",
            "100000",
            "100000-4294967295",
        ] {
            assert!(bad.parse::<IdRange>().is_err(), "{bad}");
        }
        let r: IdRange = serde_json::from_str("\"100000-100009\"").unwrap();
        assert_eq!(serde_json::to_string(&r).unwrap(), "\"100000-100009\"");
    }

    #[test]
    fn each_vm_gets_its_own_number_and_keeps_it() {
        let mut ids = Identities::new(range("100000-100003"));
        let a = ids.allocate("ns_a", |_| false).unwrap();
        let b = ids.allocate("ns_b", |u| u == 100001).unwrap();
        assert_eq!((a, b), (100000, 100002), "the host's 100001 is skipped");
        assert_eq!(ids.allocate("ns_a", |_| false).unwrap(), a);
        assert_eq!(ids.release("ns_a"), Some(a));
        // The lowest free number first: a released one comes back.
        assert_eq!(ids.allocate("ns_c", |_| false).unwrap(), 100000);
        assert_eq!(ids.allocate("ns_d", |u| u == 100001).unwrap(), 100003);
        let e = ids.allocate("ns_e", |u| u == 100001).unwrap_err();
        assert!(matches!(e, IdentityError::Exhausted { .. }), "{e}");
        assert_eq!(ids.allocate("ns_e", |_| false).unwrap(), 100001);
        // VMs coming and going one at a time use one number, not one each
        // (each number is a journal file of its own).
        let mut one = Identities::new(range("100000-199999"));
        let used: std::collections::BTreeSet<u32> = (0..200)
            .map(|i| {
                let vm = format!("ns_vm{i}");
                let uid = one.allocate(&vm, |_| false).unwrap();
                one.release(&vm);
                uid
            })
            .collect();
        assert_eq!(used.len(), 1);
    }

    #[test]
    fn never_two_vms_one_number_through_any_sequence() {
        let mut ids = Identities::new(range("100000-100007"));
        let mut x: u64 = 7;
        for _ in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let id = format!("ns_{}", (x >> 33) % 12);
            if (x >> 20) % 3 == 0 {
                ids.release(&id);
            } else {
                let _ = ids.allocate(&id, |u| u == 100005);
            }
            let uids: std::collections::BTreeSet<u32> = ids.iter().map(|(_, u)| u).collect();
            assert_eq!(uids.len(), ids.by_id.len());
            assert!(!uids.contains(&100005));
            assert!(uids.iter().all(|u| ids.range().contains(*u)));
        }
    }

    #[test]
    fn the_file_round_trips_and_refuses_garbage() {
        let mut ids = Identities::new(range("100000-100009"));
        ids.allocate("ns_a", |_| false).unwrap();
        ids.allocate("ns_b", |_| false).unwrap();
        let back = Identities::decode(&ids.encode(), range("100000-100009")).unwrap();
        assert_eq!(back.identities, ids);
        assert!(back.dropped.is_empty());
        // A narrower range keeps what no longer fits until it is released
        // (its VM may run; its grants go back with it), and never hands it
        // out again.
        let narrow = Identities::decode(&ids.encode(), range("100001-100009")).unwrap();
        assert!(narrow.dropped.is_empty());
        let mut narrow = narrow.identities;
        assert_eq!(narrow.get("ns_a"), Some(100000));
        assert_eq!(narrow.get("ns_b"), Some(100001));
        assert_eq!(narrow.release("ns_a"), Some(100000));
        assert_eq!(narrow.allocate("ns_c", |_| false).unwrap(), 100002);
        // A number no VM may have is not kept, whatever the file says.
        let root = br#"{"version":1,"range":"x","vms":{"a":0,"b":4294967295}}"#;
        let l = Identities::decode(root, range("100000-100009")).unwrap();
        assert_eq!(l.dropped.len(), 2);
        assert!(matches!(
            Identities::decode(b"{\"version\":1,", range("100000-100009")),
            Err(IdentityError::Corrupt { .. })
        ));
        let dup = br#"{"version":1,"range":"x","vms":{"a":100001,"b":100001}}"#;
        let l = Identities::decode(dup, range("100000-100009")).unwrap();
        assert_eq!(l.dropped.len(), 1, "one number, one VM");
    }

    #[test]
    fn user_records_name_the_vm_and_grant_nothing() {
        let u = user_record(100007, "default/vm1");
        assert_eq!(u["userName"], "kvirt-vm-100007");
        assert_eq!(u["uid"], 100007);
        assert_eq!(u["gid"], 100007);
        assert_eq!(u["locked"], true);
        assert_eq!(u["realName"], "kvirt VM default/vm1");
        assert_eq!(group_record(100007)["groupName"], "kvirt-vm-100007");
    }
}
