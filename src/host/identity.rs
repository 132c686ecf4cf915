//! VM identities on the host: `core::identity`'s allocations kept in one
//! file under the state directory (replaced atomically, on disk before a
//! VM uses its number), and each identity's user and group record as a
//! systemd `userdb` drop-in under `/run/userdb`, which `nss-systemd`
//! serves: systemd resolves even a numeric `User=` through NSS, so a VM's
//! unit needs a record for its user (measured with systemd 257).

use crate::core::identity::{self, IdRange, Identities, IdentityError};
use crate::host::commit::{replace_private, GroupCommit};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum IdentityStoreError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("identities file {path} {source}")]
    File {
        path: PathBuf,
        source: IdentityError,
    },
    #[error("VM {id}: {source}")]
    Allocate { id: String, source: IdentityError },
    /// The failed save that also held this change.
    #[error(transparent)]
    Shared(#[from] Arc<IdentityStoreError>),
    #[error("the VM has no identity (made by an older kvirt?)")]
    Missing,
    #[error(
        "user {uid} does not resolve: VM identities need nss-systemd (libnss-systemd, with \"systemd\" in the passwd and group lines of /etc/nsswitch.conf)"
    )]
    Unresolvable { uid: u32 },
}

/// The users VMs run as, as the loop sees them: one per VM, acquired before
/// anything of the VM is made, released once nothing of it is left.
pub trait VmUsers: Send + Sync + 'static {
    /// VM `id`'s uid (its gid is the same number), allocated and resolvable
    /// before this returns; `vm` names the VM in its user record.
    fn acquire(
        &self,
        id: &str,
        vm: &str,
    ) -> impl std::future::Future<Output = Result<u32, IdentityStoreError>> + Send;
    fn release(
        &self,
        id: &str,
    ) -> impl std::future::Future<Output = Result<(), IdentityStoreError>> + Send;
    fn uid_of(&self, id: &str) -> Option<u32>;
    /// Ids holding an identity (for cleaning up after VMIs that are gone).
    fn ids(&self) -> Vec<String>;
}

/// The real [`VmUsers`]: an [`IdentityStore`], on the blocking pool.
#[derive(Clone, Debug)]
pub struct HostUsers(pub std::sync::Arc<IdentityStore>);

impl VmUsers for HostUsers {
    async fn acquire(&self, id: &str, vm: &str) -> Result<u32, IdentityStoreError> {
        let (store, id, vm) = (self.0.clone(), id.to_owned(), vm.to_owned());
        tokio::task::spawn_blocking(move || {
            let uid = store.acquire(&id, &vm)?;
            // systemd would fail the unit with 217/USER; say why here.
            let user = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid));
            match user {
                Ok(Some(_)) => Ok(uid),
                _ => Err(IdentityStoreError::Unresolvable { uid }),
            }
        })
        .await
        .map_err(|e| thread_died(e.to_string()))?
    }

    async fn release(&self, id: &str) -> Result<(), IdentityStoreError> {
        let (store, id) = (self.0.clone(), id.to_owned());
        tokio::task::spawn_blocking(move || store.release(&id).map(drop))
            .await
            .map_err(|e| thread_died(e.to_string()))?
    }

    fn uid_of(&self, id: &str) -> Option<u32> {
        self.0.get(id)
    }

    fn ids(&self) -> Vec<String> {
        self.0.ids()
    }
}

fn thread_died(message: String) -> IdentityStoreError {
    IdentityStoreError::Io {
        path: PathBuf::new(),
        op: "worker thread",
        source: std::io::Error::other(message),
    }
}

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> IdentityStoreError {
    let path = path.to_owned();
    move |source| IdentityStoreError::Io { path, op, source }
}

/// The host's VM identities. Blocking (file I/O, waits on a `std` mutex):
/// call it from a blocking thread.
#[derive(Debug)]
pub struct IdentityStore {
    userdb: PathBuf,
    /// Changes made at once share one save of the file.
    ids: GroupCommit<Identities, IdentityStoreError>,
}

/// Whether the host has a user or group of this number (a VM must never
/// share one with anything else).
pub fn host_uses(uid: u32) -> bool {
    use nix::unistd::{Gid, Group, Uid, User};
    let ours = |name: &str| name.starts_with("kvirt-vm-");
    let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
    let group = Group::from_gid(Gid::from_raw(uid)).ok().flatten();
    user.is_some_and(|u| !ours(&u.name)) || group.is_some_and(|g| !ours(&g.name))
}

impl IdentityStore {
    /// Loads the allocations (a missing file is none) and writes the user
    /// record of each, as after a reboot `/run` has none; entries that
    /// cannot be kept are returned for logging.
    pub fn open(
        file: PathBuf,
        userdb: PathBuf,
        range: IdRange,
    ) -> Result<(Self, Vec<String>), IdentityStoreError> {
        let loaded = match std::fs::read(&file) {
            Ok(text) => {
                Identities::decode(&text, range).map_err(|source| IdentityStoreError::File {
                    path: file.clone(),
                    source,
                })?
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => identity::Loaded {
                identities: Identities::new(range),
                dropped: Vec::new(),
            },
            Err(e) => return Err(io(&file, "read")(e)),
        };
        let ids: Vec<(String, u32)> = loaded
            .identities
            .iter()
            .map(|(id, uid)| (id.to_owned(), uid))
            .collect();
        let store = Self {
            userdb,
            ids: GroupCommit::new(loaded.identities, move |ids| save(&file, ids)),
        };
        for (id, uid) in ids {
            store.write_records(&id, uid)?;
        }
        let dropped = loaded
            .dropped
            .iter()
            .map(|(id, uid)| format!("identity {uid} of {id}: not a VM's to have, dropped"))
            .collect();
        Ok((store, dropped))
    }

    /// The identity of VM `id` (`vm` names it for people), allocated and on
    /// disk, with its user record, before this returns.
    pub fn acquire(&self, id: &str, vm: &str) -> Result<u32, IdentityStoreError> {
        let uid = self.ids.change(|next| match next.get(id) {
            Some(uid) => Ok((uid, false)),
            None => next
                .allocate(id, host_uses)
                .map(|uid| (uid, true))
                .map_err(|source| IdentityStoreError::Allocate {
                    id: id.into(),
                    source,
                }),
        })?;
        self.write_records_named(uid, vm)?;
        Ok(uid)
    }

    pub fn get(&self, id: &str) -> Option<u32> {
        self.ids.read(|ids| ids.get(id))
    }

    /// Ids holding an identity (for cleaning up after VMIs that are gone).
    pub fn ids(&self) -> Vec<String> {
        self.ids
            .read(|ids| ids.iter().map(|(id, _)| id.to_owned()).collect())
    }

    /// Frees `id`'s identity and removes its user record; on error it stays
    /// allocated (the safe side).
    pub fn release(&self, id: &str) -> Result<Option<u32>, IdentityStoreError> {
        let Some(uid) = self.get(id) else {
            return Ok(None);
        };
        self.remove_records(uid)?;
        self.ids.change(|next| Ok((next.release(id), true)))
    }

    fn write_records(&self, id: &str, uid: u32) -> Result<(), IdentityStoreError> {
        let vm =
            crate::core::key::VmKey::parse(id).map_or_else(|_| id.to_owned(), |k| k.to_string());
        self.write_records_named(uid, &vm)
    }

    /// `<name>.user` and `<name>.group` with the records, and `<uid>.user`
    /// and `<gid>.group` linking to them, as userdb looks both up.
    fn write_records_named(&self, uid: u32, vm: &str) -> Result<(), IdentityStoreError> {
        let name = identity::user_name(uid);
        std::fs::create_dir_all(&self.userdb).map_err(io(&self.userdb, "create directory"))?;
        for (kind, record) in [
            ("user", identity::user_record(uid, vm)),
            ("group", identity::group_record(uid)),
        ] {
            let file = self.userdb.join(format!("{name}.{kind}"));
            let tmp = self.userdb.join(format!(".{name}.{kind}.tmp"));
            let text = serde_json::to_vec_pretty(&record).expect("a record serializes");
            std::fs::write(&tmp, text).map_err(io(&tmp, "write"))?;
            std::fs::rename(&tmp, &file).map_err(io(&file, "rename"))?;
            let link = self.userdb.join(format!("{uid}.{kind}"));
            let tmp_link = self.userdb.join(format!(".{uid}.{kind}.tmp"));
            let _ = std::fs::remove_file(&tmp_link);
            std::os::unix::fs::symlink(format!("{name}.{kind}"), &tmp_link)
                .map_err(io(&tmp_link, "link"))?;
            std::fs::rename(&tmp_link, &link).map_err(io(&link, "rename"))?;
        }
        Ok(())
    }

    fn remove_records(&self, uid: u32) -> Result<(), IdentityStoreError> {
        let name = identity::user_name(uid);
        for kind in ["user", "group"] {
            for f in [format!("{uid}.{kind}"), format!("{name}.{kind}")] {
                let path = self.userdb.join(f);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(io(&path, "remove")(e))
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

/// A temporary file beside the real one, synced, renamed over it, then the
/// directory synced: after a crash the file is the old or the new set,
/// never a torn one.
fn save(file: &Path, ids: &Identities) -> Result<(), IdentityStoreError> {
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir, "create directory"))?;
    // Root's alone: which uid each VM has names every tenant of the host.
    replace_private(file, &ids.encode()).map_err(io(file, "save"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path) -> IdentityStore {
        IdentityStore::open(
            dir.join("lib/identities.json"),
            dir.join("userdb"),
            "200000-200009".parse().unwrap(),
        )
        .unwrap()
        .0
    }

    #[test]
    fn identities_persist_with_their_records_and_go_with_their_vm() {
        let t = tempfile::tempdir().unwrap();
        let s = open(t.path());
        let a = s.acquire("ns_a", "ns/a").unwrap();
        let b = s.acquire("ns_b", "ns/b").unwrap();
        assert_ne!(a, b);
        assert_eq!(s.acquire("ns_a", "ns/a").unwrap(), a);
        let userdb = t.path().join("userdb");
        let rec: serde_json::Value = serde_json::from_slice(
            &std::fs::read(userdb.join(format!("kvirt-vm-{a}.user"))).unwrap(),
        )
        .unwrap();
        assert_eq!(rec["uid"], a);
        assert_eq!(
            std::fs::read_link(userdb.join(format!("{a}.group"))).unwrap(),
            PathBuf::from(format!("kvirt-vm-{a}.group"))
        );

        // Reopened (kvirtd restarted, or /run emptied by a reboot): the same
        // numbers, and their records written again.
        std::fs::remove_dir_all(&userdb).unwrap();
        let again = open(t.path());
        assert_eq!(again.get("ns_a"), Some(a));
        assert_eq!(again.get("ns_b"), Some(b));
        assert!(userdb.join(format!("{b}.user")).exists());

        assert_eq!(again.release("ns_a").unwrap(), Some(a));
        assert_eq!(again.release("ns_a").unwrap(), None);
        assert!(!userdb.join(format!("{a}.user")).exists());
        assert!(!userdb.join(format!("kvirt-vm-{a}.group")).exists());
        assert_eq!(open(t.path()).ids(), ["ns_b"]);
    }
}
