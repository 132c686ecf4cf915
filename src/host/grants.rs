//! Files lent to VMs: a hostDisk, or an image in the root-only image
//! cache, is given to a VM's identity by a POSIX ACL entry for the VM's
//! life, so the file keeps its owner and mode, a file shared by several
//! VMs is each one's, and it is exactly as it was once the last VM goes.
//!
//! Two records, root's alone in the grants directory, written before the
//! file is touched, so whatever a crash interrupts is finished by the
//! next give-back:
//! - `<uid>.json`: the files lent to that identity;
//! - `files/<dev>-<inode>.json`: a lent file's own ACL from before its
//!   first loan (its baseline) and every loan of it. The file's ACL is
//!   always [`Acl::lent`] of the two, so a loan never widens anyone
//!   else's rights, and the last one gone puts the baseline back as it was.

use crate::core::acl::{self, Acl};
use crate::host::storage::StorageError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.to_owned();
    move |source| StorageError::Io { path, op, source }
}

/// Every change of the records is a read, a change and a write: two VMs
/// lent one file at once (a replica set's VMIs over one base image) would
/// each write the file's record without the other's loan (and the second
/// rename find the first's temporary file gone). kvirtd is the records'
/// only writer: one change at a time in it is enough.
static CHANGES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_change() -> std::sync::MutexGuard<'static, ()> {
    CHANGES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The grants directory (`/var/lib/kvirt/grants`).
#[derive(Clone, Debug)]
pub struct Grants {
    dir: PathBuf,
}

/// One lent file: its baseline ACL (kernel encoding) and who has it.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Loans {
    path: PathBuf,
    baseline: Vec<u8>,
    /// Borrowing uid → permission bits.
    loans: BTreeMap<u32, u16>,
}

impl Loans {
    fn acl(&self, path: &Path) -> Result<Acl, StorageError> {
        let baseline = Acl::decode(&self.baseline).map_err(|e| StorageError::Disk {
            path: path.to_owned(),
            message: format!("its recorded ACL is unreadable: {e}"),
        })?;
        let loans: Vec<(u32, u16)> = self.loans.iter().map(|(u, p)| (*u, *p)).collect();
        Ok(Acl::lent(&baseline, &loans))
    }
}

impl Grants {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    fn of_uid(&self, uid: u32) -> PathBuf {
        self.dir.join(format!("{uid}.json"))
    }

    fn of_file(&self, meta: &std::fs::Metadata) -> PathBuf {
        self.dir
            .join("files")
            .join(format!("{}-{}.json", meta.dev(), meta.ino()))
    }

    /// Lends `uid` `perm` on the file at `real` (resolved, no links).
    pub fn lend(&self, real: &Path, uid: u32, perm: u16) -> Result<(), StorageError> {
        self.lend_file(&open_disk(real)?, real, uid, perm)
    }

    /// Lends `uid` `perm` on `file`, already open (a hostDisk opened
    /// beneath its root), known as `real`: the ACL goes on the file root
    /// holds, whatever the name leads to by now.
    pub fn lend_file(
        &self,
        file: &std::fs::File,
        real: &Path,
        uid: u32,
        perm: u16,
    ) -> Result<(), StorageError> {
        let meta = file.metadata().map_err(io(real, "stat"))?;
        let record = self.of_file(&meta);
        let _one = one_change();
        let mut loans = match read_json::<Loans>(&record)? {
            Some(l) => l,
            None => Loans {
                path: real.to_owned(),
                baseline: read_acl(file).map_err(io(real, "read ACL"))?.encode(),
                loans: BTreeMap::new(),
            },
        };
        loans.loans.insert(uid, perm);
        write_json(&record, &loans)?;
        let by_uid = self.of_uid(uid);
        let mut lent: Vec<PathBuf> = read_json(&by_uid)?.unwrap_or_default();
        if !lent.iter().any(|p| p == real) {
            lent.push(real.to_owned());
            write_json(&by_uid, &lent)?;
        }
        write_acl(file, &loans.acl(real)?).map_err(|e| acl_err(real, e))
    }

    /// Takes back everything lent to `uid`; a file gone, or replaced by a
    /// link or something else since, is skipped (its new self was never
    /// lent, and is not followed).
    pub fn give_back(&self, uid: u32) -> Result<(), StorageError> {
        let _one = one_change();
        let by_uid = self.of_uid(uid);
        let lent: Vec<PathBuf> = read_json(&by_uid)?.unwrap_or_default();
        for path in lent {
            let file = match open_disk(&path) {
                Ok(f) => f,
                Err(StorageError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound
                        || source.raw_os_error() == Some(libc::ELOOP) =>
                {
                    continue
                }
                Err(StorageError::Disk { .. }) => continue,
                Err(e) => return Err(e),
            };
            let meta = file.metadata().map_err(io(&path, "stat"))?;
            let record = self.of_file(&meta);
            match read_json::<Loans>(&record)? {
                Some(mut loans) => {
                    loans.loans.remove(&uid);
                    // The record first: a crash before the ACL is written
                    // is finished by the next give-back, from the record.
                    let acl = loans.acl(&path)?;
                    if loans.loans.is_empty() {
                        write_acl(&file, &acl).map_err(|e| acl_err(&path, e))?;
                        remove(&record)?;
                    } else {
                        write_json(&record, &loans)?;
                        write_acl(&file, &acl).map_err(|e| acl_err(&path, e))?;
                    }
                }
                // Lent by a kvirt before these records: its entry goes.
                None => {
                    let mut a = read_acl(&file).map_err(io(&path, "read ACL"))?;
                    if a.perm_of(uid).is_some() {
                        a.revoke(uid);
                        write_acl(&file, &a).map_err(|e| acl_err(&path, e))?;
                    }
                }
            }
        }
        remove(&by_uid)
    }

    /// Takes back everything lent to any VM (a package purge, once every
    /// VM is stopped); how many identities had loans. Goes on past a file
    /// it cannot give back, and says the last such error.
    pub fn give_back_all(&self) -> Result<usize, StorageError> {
        let uids: Vec<u32> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.strip_suffix(".json")?.parse().ok()
            })
            .collect();
        let mut last_error = None;
        for uid in &uids {
            if let Err(e) = self.give_back(*uid) {
                last_error = Some(e);
            }
        }
        last_error.map_or(Ok(uids.len()), Err)
    }

    /// Every file some VM has been lent and not yet given back: what the
    /// image cache must keep.
    pub fn lent_paths(&self) -> Vec<PathBuf> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .flat_map(|e| {
                read_json::<Vec<PathBuf>>(&e.path())
                    .ok()
                    .flatten()
                    .unwrap_or_default()
            })
            .collect()
    }
}

fn remove(record: &Path) -> Result<(), StorageError> {
    match std::fs::remove_file(record) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(record, "remove")(e)),
        _ => Ok(()),
    }
}

/// A record of root's own; `None` when there is none.
fn read_json<T: serde::de::DeserializeOwned>(record: &Path) -> Result<Option<T>, StorageError> {
    match std::fs::read(record) {
        Ok(text) => serde_json::from_slice(&text)
            .map(Some)
            .map_err(|e| StorageError::Disk {
                path: record.to_owned(),
                message: format!("unreadable: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(record, "read")(e)),
    }
}

/// Replaced whole (a temporary file renamed over it), in a directory of
/// root's alone.
fn write_json<T: Serialize>(record: &Path, value: &T) -> Result<(), StorageError> {
    let dir = record.parent().expect("a record has a directory");
    std::fs::create_dir_all(dir).map_err(io(dir, "create directory"))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io(dir, "chmod"))?;
    let tmp = record.with_extension("json.tmp");
    let text = serde_json::to_vec(value).expect("a record serializes");
    std::fs::write(&tmp, text).map_err(io(&tmp, "write"))?;
    std::fs::rename(&tmp, record).map_err(io(record, "rename"))
}

/// A hostDisk by its real path: a regular file, not a link, never blocking.
fn open_disk(real: &Path) -> Result<std::fs::File, StorageError> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(real)
        .map_err(io(real, "open"))?;
    if !f.metadata().map_err(io(real, "stat"))?.is_file() {
        return Err(StorageError::Disk {
            path: real.to_owned(),
            message: "not a regular file".into(),
        });
    }
    Ok(f)
}

fn acl_err(path: &Path, e: std::io::Error) -> StorageError {
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return StorageError::Disk {
            path: path.to_owned(),
            message: "its file system has no POSIX ACLs: a VM cannot be given this hostDisk".into(),
        };
    }
    io(path, "write ACL")(e)
}

const ACL_XATTR: &std::ffi::CStr = c"system.posix_acl_access";

/// The file's access ACL, or its mode bits as one when it has none.
pub(crate) fn read_acl(f: &std::fs::File) -> std::io::Result<acl::Acl> {
    use std::os::fd::AsRawFd;
    let mut buf = vec![0u8; 4096];
    // SAFETY: buf is writable for its length; the name is NUL-terminated.
    let n = unsafe {
        libc::fgetxattr(
            f.as_raw_fd(),
            ACL_XATTR.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENODATA) {
            let mode = f.metadata()?.permissions().mode();
            return Ok(acl::Acl::from_mode(mode));
        }
        return Err(e);
    }
    buf.truncate(n as usize);
    acl::Acl::decode(&buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Sets the file's access ACL; a minimal one goes back to plain mode bits.
fn write_acl(f: &std::fs::File, a: &acl::Acl) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    if a.is_minimal() {
        // SAFETY: the name is NUL-terminated.
        let r = unsafe { libc::fremovexattr(fd, ACL_XATTR.as_ptr()) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(e);
            }
        }
        let mode = f.metadata()?.permissions().mode() & !0o777 | a.mode_bits();
        return f.set_permissions(std::fs::Permissions::from_mode(mode));
    }
    let bytes = a.encode();
    // SAFETY: bytes is readable for its length; the name is NUL-terminated.
    let r = unsafe {
        libc::fsetxattr(
            fd,
            ACL_XATTR.as_ptr(),
            bytes.as_ptr().cast(),
            bytes.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::acl::{READ, WRITE};

    /// getfacl: user::rw- user:1000:rw- group::r-- mask::r-- other::---
    const MASKED: [u8; 44] = [
        2, 0, 0, 0, //
        1, 0, 6, 0, 255, 255, 255, 255, //
        2, 0, 6, 0, 232, 3, 0, 0, //
        4, 0, 4, 0, 255, 255, 255, 255, //
        16, 0, 4, 0, 255, 255, 255, 255, //
        32, 0, 0, 0, 255, 255, 255, 255,
    ];

    #[test]
    fn a_masked_acl_is_neither_widened_by_loans_nor_changed_after_them() {
        let t = tempfile::tempdir().unwrap();
        let disk = t.path().join("disk.img");
        std::fs::write(&disk, b"disk").unwrap();
        let file = std::fs::File::open(&disk).unwrap();
        write_acl(&file, &Acl::decode(&MASKED).unwrap()).unwrap();
        let mode = || std::fs::metadata(&disk).unwrap().mode();
        let acl = || read_acl(&std::fs::File::open(&disk).unwrap()).unwrap();
        let (before, mode_before) = (acl().encode(), mode());
        assert_eq!(before, MASKED);

        let g = Grants::new(t.path().join("grants"));
        g.lend(&disk, 300_001, READ | WRITE).unwrap();
        g.lend(&disk, 300_002, READ).unwrap();
        let during = acl();
        assert_eq!(during.perm_of(300_001), Some(READ | WRITE));
        assert_eq!(during.perm_of(1000), Some(READ), "user 1000 gains nothing");
        assert_eq!(g.lent_paths().len(), 2);

        g.give_back(300_001).unwrap();
        assert_eq!(acl().perm_of(300_001), None);
        assert_eq!(
            acl().perm_of(300_002),
            Some(READ),
            "the other VM keeps its loan"
        );
        g.give_back(300_002).unwrap();
        g.give_back(300_002).unwrap();
        assert_eq!(acl().encode(), before, "the ACL exactly as it was");
        assert_eq!(mode(), mode_before, "and the mode");
        assert!(g.lent_paths().is_empty());
        assert_eq!(
            std::fs::read_dir(t.path().join("grants/files"))
                .unwrap()
                .count(),
            0
        );
    }

    /// A replica set's VMIs start together over one base image: every
    /// loan made at once is in the record and the ACL.
    #[test]
    fn loans_of_one_file_made_at_once_are_all_kept() {
        let t = tempfile::tempdir().unwrap();
        let disk = t.path().join("base.img");
        std::fs::write(&disk, b"disk").unwrap();
        let g = Grants::new(t.path().join("grants"));
        let uids: Vec<u32> = (300_001..300_009).collect();
        let lends: Vec<_> = uids
            .iter()
            .map(|&uid| {
                let (g, disk) = (g.clone(), disk.clone());
                std::thread::spawn(move || g.lend(&disk, uid, READ))
            })
            .collect();
        for l in lends {
            l.join().unwrap().unwrap();
        }
        let acl = read_acl(&std::fs::File::open(&disk).unwrap()).unwrap();
        for &uid in &uids {
            assert_eq!(acl.perm_of(uid), Some(READ), "{uid}: {acl:?}");
        }
        let gives: Vec<_> = uids
            .iter()
            .map(|&uid| {
                let g = g.clone();
                std::thread::spawn(move || g.give_back(uid))
            })
            .collect();
        for b in gives {
            b.join().unwrap().unwrap();
        }
        let acl = read_acl(&std::fs::File::open(&disk).unwrap()).unwrap();
        assert!(acl.is_minimal(), "{acl:?}");
    }

    #[test]
    fn a_give_back_cut_short_is_finished_by_the_next() {
        let t = tempfile::tempdir().unwrap();
        let disk = t.path().join("disk.img");
        std::fs::write(&disk, b"disk").unwrap();
        std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o600)).unwrap();
        let g = Grants::new(t.path().join("grants"));
        g.lend(&disk, 300_001, READ | WRITE).unwrap();
        // A crash after the file's record dropped the loan, before its ACL
        // was written: the next give-back finishes from the records.
        let meta = std::fs::metadata(&disk).unwrap();
        let record = g.of_file(&meta);
        let mut loans: Loans = read_json(&record).unwrap().unwrap();
        loans.loans.clear();
        write_json(&record, &loans).unwrap();
        g.give_back(300_001).unwrap();
        let a = read_acl(&std::fs::File::open(&disk).unwrap()).unwrap();
        assert!(a.is_minimal(), "{a:?}");
        assert_eq!(std::fs::metadata(&disk).unwrap().mode() & 0o777, 0o600);
    }
}
