//! What the VMs' writable disks may still take of the host's disk. An
//! emptyDisk or overlay is sparse: it takes nothing when made and up to its
//! size as the guest writes. Each is recorded, when kvirt makes it, with
//! the size it may grow to, in a root-only file per VM; a new disk must fit
//! in the free space less what every recorded disk may still take.
//!
//! The records are root's (the VM cannot make another VM look large); the
//! disk files are the VM's, so each is opened beneath its VM's directory
//! and only its allocation is read. Whatever a VM does to its disk files
//! (a huge sparse file, a link, deleting one QEMU still writes), each
//! counts between zero and what was admitted, never past it.

use crate::host::beneath::Beneath;
use crate::host::commit::replace_private;
use nix::fcntl::OFlag;
use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// A VM's record: its disks (below its state directory) and the bytes each
/// may grow to.
type Record = BTreeMap<PathBuf, u64>;

/// Far above any VM's disk count.
const MAX_RECORD: u64 = 64 << 10;

#[derive(Clone, Debug)]
pub struct Growth {
    /// The records, one file per VM id (root's, 0700).
    pub dir: PathBuf,
    /// Where each VM's state directory is, by id.
    pub vms: PathBuf,
}

impl Growth {
    /// Records that VM `id`'s disk `rel` (below its state directory) may
    /// grow to `size` bytes; atomically, before the disk is used.
    pub fn record(&self, id: &str, rel: &Path, size: u64) -> std::io::Result<()> {
        let mut record = self.read(id).unwrap_or_default();
        record.insert(rel.to_owned(), size);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let bytes = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
        replace_private(&self.dir.join(id), &bytes)
    }

    /// Forgets VM `id`'s disks (its state directory is gone).
    pub fn forget(&self, id: &str) -> std::io::Result<()> {
        match std::fs::remove_file(self.dir.join(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// What every recorded disk may still take: its size less what it has
    /// allocated, never more than its size.
    pub fn pending(&self) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut total = 0u64;
        for e in entries.flatten() {
            let Some(id) = e.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if id.starts_with('.') {
                continue;
            }
            let (Some(record), Ok(vm)) = (self.read(&id), Beneath::open(&self.vms.join(&id)))
            else {
                continue;
            };
            for (rel, size) in record {
                // One that cannot be opened (swapped for a link, or
                // deleted while QEMU still writes it) counts in full.
                let used = vm
                    .file(&rel, OFlag::O_RDONLY)
                    .and_then(|f| Ok(nix::sys::stat::fstat(&f)?))
                    .map_or(0, |st| st.st_blocks as u64 * 512);
                total = total.saturating_add(size.saturating_sub(used));
            }
        }
        total
    }

    /// What VM `id`'s recorded disks may grow to together, `rel` (a disk
    /// being made again) left out.
    pub fn vm_total(&self, id: &str, rel: &Path) -> u64 {
        self.read(id)
            .unwrap_or_default()
            .iter()
            .filter(|(r, _)| r.as_path() != rel)
            .fold(0u64, |sum, (_, size)| sum.saturating_add(*size))
    }

    fn read(&self, id: &str) -> Option<Record> {
        let f = std::fs::File::open(self.dir.join(id)).ok()?;
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_RECORD), &mut text).ok()?;
        serde_json::from_slice(&text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn each_disk_counts_what_it_may_still_take_and_never_more() {
        let t = tempfile::tempdir().unwrap();
        let g = Growth {
            dir: t.path().join("growth"),
            vms: t.path().join("vms"),
        };
        assert_eq!(g.pending(), 0);
        let disks = g.vms.join("ns_a/disks");
        std::fs::create_dir_all(&disks).unwrap();
        let disk = disks.join("e.qcow2");
        // 1 MiB written of a disk that may grow to 100.
        std::fs::write(&disk, vec![1u8; MIB as usize]).unwrap();
        g.record("ns_a", Path::new("disks/e.qcow2"), 100 * MIB)
            .unwrap();
        let p = g.pending();
        assert!((98 * MIB..=99 * MIB).contains(&p), "{p}");
        // What the VM does to its files never counts past what was admitted.
        std::fs::remove_file(&disk).unwrap();
        std::fs::File::create(&disk)
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        assert_eq!(g.pending(), 100 * MIB, "a huge sparse file");
        std::fs::remove_file(&disk).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &disk).unwrap();
        assert_eq!(g.pending(), 100 * MIB, "a link is not followed");
        std::fs::remove_file(&disk).unwrap();
        assert_eq!(g.pending(), 100 * MIB, "deleted: QEMU may still write it");
        // Two disks of one VM, and another VM's.
        g.record("ns_a", Path::new("disks/f.qcow2"), 5 * MIB)
            .unwrap();
        std::fs::create_dir_all(g.vms.join("ns_b")).unwrap();
        g.record("ns_b", Path::new("disks/g.qcow2"), 7 * MIB)
            .unwrap();
        assert_eq!(g.pending(), 112 * MIB);
        // Root's alone, and gone with the VM's state directory.
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!((mode(&g.dir), mode(&g.dir.join("ns_a"))), (0o700, 0o600));
        // A VM's own total, the disk being made again left out.
        assert_eq!(g.vm_total("ns_a", Path::new("disks/x.qcow2")), 105 * MIB);
        assert_eq!(g.vm_total("ns_a", Path::new("disks/f.qcow2")), 100 * MIB);
        assert_eq!(g.vm_total("ns_c", Path::new("disks/f.qcow2")), 0);
        g.forget("ns_a").unwrap();
        g.forget("ns_a").unwrap();
        assert_eq!(g.pending(), 7 * MIB);
        // A record whose VM directory is gone (a crash between the two)
        // counts nothing.
        std::fs::remove_dir_all(g.vms.join("ns_b")).unwrap();
        assert_eq!(g.pending(), 0);
    }
}
