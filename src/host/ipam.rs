//! The node's address leases on disk: [`LeaseFile`] is `core::ipam`'s
//! lease set as one JSON file replaced atomically, and [`Ipam`] shares it
//! between reconcilers so that every change is on disk before the caller
//! sees it (changes made at once share a save). All of it is blocking
//! (file I/O, waits on a `std` mutex): call it from a blocking thread.

use crate::core::ipam::{DroppedLease, IpamError, Lease, Leases, Loaded, Subnet};
use crate::host::commit::{replace_private, GroupCommit};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum LeaseStoreError {
    #[error("lease file {path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("lease file {path} {source}")]
    File { path: PathBuf, source: IpamError },
    #[error(transparent)]
    Leases(#[from] IpamError),
    /// The failed save that also held this change.
    #[error(transparent)]
    Shared(#[from] Arc<LeaseStoreError>),
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

    /// A missing file is an empty set of leases (first start); see
    /// [`Leases::decode`] for the rest.
    pub fn load(&self, subnet: Subnet) -> Result<Loaded, LeaseStoreError> {
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
        Leases::decode(&text, subnet).map_err(|source| LeaseStoreError::File {
            path: self.path.clone(),
            source,
        })
    }

    /// Replaces the file with `leases`: a temporary file beside it, synced,
    /// renamed over it, then the directory synced, so after a crash the file
    /// is either the old or the new set, never a torn one.
    pub fn save(&self, leases: &Leases) -> Result<(), LeaseStoreError> {
        let text = leases.encode();
        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        std::fs::create_dir_all(dir).map_err(self.io("create directory"))?;
        replace_private(&self.path, &text).map_err(self.io("save"))
    }

    fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> LeaseStoreError + '_ {
        move |source| LeaseStoreError::Io {
            path: self.path.clone(),
            op,
            source,
        }
    }
}

/// The leases of this node, shared by all reconcilers.
///
/// A change is made on a copy and saved; only then does it become the
/// state everyone reads. When the save fails the caller gets the error and
/// the change is undone, so an address is never in use without being on
/// disk.
#[derive(Debug)]
pub struct Ipam {
    leases: GroupCommit<Leases, LeaseStoreError>,
}

impl Ipam {
    /// Loads the leases; the dropped ones are for the caller to log.
    pub fn open(
        file: LeaseFile,
        subnet: Subnet,
    ) -> Result<(Self, Vec<DroppedLease>), LeaseStoreError> {
        let Loaded { leases, dropped } = file.load(subnet)?;
        Ok((
            Self {
                leases: GroupCommit::new(leases, move |l| file.save(l)),
            },
            dropped,
        ))
    }

    pub fn subnet(&self) -> Subnet {
        self.leases.read(Leases::subnet)
    }

    /// The address of `id`, leased and on disk before this returns.
    pub fn lease(&self, id: &str, uid: &str) -> Result<Ipv4Addr, LeaseStoreError> {
        self.leases.change(|next| {
            if let Some(lease) = next.get(id).filter(|l| l.uid == uid) {
                return Ok((lease.ip, false));
            }
            Ok((next.allocate(id, uid)?, true))
        })
    }

    /// Frees `id`'s address; on error it stays leased (the safe side).
    pub fn release(&self, id: &str) -> Result<Option<Ipv4Addr>, LeaseStoreError> {
        self.leases.change(|next| {
            if next.get(id).is_none() {
                return Ok((None, false));
            }
            Ok((next.release(id), true))
        })
    }

    pub fn get(&self, id: &str) -> Option<Lease> {
        self.leases.read(|l| l.get(id).cloned())
    }

    /// A copy of all leases, e.g. to release those of VMs that are gone.
    pub fn snapshot(&self) -> Leases {
        self.leases.read(Clone::clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::ipam::DropReason;
    use std::collections::HashSet;

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
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
        assert!(!dir.path().join("sub/.leases.json.tmp").exists());
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
            Err(LeaseStoreError::File {
                source: IpamError::Corrupt { .. },
                ..
            })
        ));
        std::fs::write(&path, r#"{"version":2,"subnet":"x","leases":{}}"#).unwrap();
        assert!(matches!(
            file.load(subnet("10.0.0.0/24")),
            Err(LeaseStoreError::File {
                source: IpamError::Version { found: 2 },
                ..
            })
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
        std::fs::create_dir(dir.path().join(".leases.json.tmp")).unwrap();
        let s = subnet("10.213.0.0/24");
        let (ipam, _) = Ipam::open(LeaseFile::new(&path), s).unwrap();
        let err = ipam.lease("ns_a", "u").unwrap_err();
        assert!(
            matches!(err, LeaseStoreError::Shared(ref e) if matches!(**e, LeaseStoreError::Io { .. })),
            "{err}"
        );
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
