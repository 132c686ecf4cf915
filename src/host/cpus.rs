//! The host's dedicated CPUs and which VM holds which: `core::cpuset`'s
//! allocation as one JSON file, replaced atomically on each change and
//! read back when kvirtd starts, so a restart leaves every VM its CPUs.
//! It lives under `/run`: after a reboot no VM runs, and nothing is held.
//! Blocking (file I/O, a `std` mutex): call it from a blocking thread.

use crate::core::cpuset::{Allocation, CpuSet, CpuSetError};
use crate::host::commit::{replace_private, GroupCommit};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum CpuStoreError {
    #[error("dedicated CPUs file {path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("dedicated CPUs file {path}: {message}")]
    File { path: PathBuf, message: String },
    #[error(transparent)]
    Cpus(#[from] CpuSetError),
    /// The failed save that also held this change.
    #[error(transparent)]
    Shared(#[from] Arc<CpuStoreError>),
}

/// The CPUs this host dedicates to VMs, and who holds them.
#[derive(Debug)]
pub struct DedicatedCpus {
    /// What VMs may hold (configured, and online).
    pool: CpuSet,
    /// Every CPU kvirtd may run on: the others' share is what no VM holds.
    online: CpuSet,
    held: GroupCommit<Allocation, CpuStoreError>,
}

impl DedicatedCpus {
    /// Reads what was held before (a missing file: nothing).
    pub fn open(file: &Path, pool: CpuSet, online: CpuSet) -> Result<Self, CpuStoreError> {
        let held = match std::fs::read(file) {
            Ok(bytes) => Allocation::decode(&bytes).map_err(|message| CpuStoreError::File {
                path: file.into(),
                message,
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Allocation::default(),
            Err(source) => return Err(io(file, "read")(source)),
        };
        let path = file.to_owned();
        Ok(Self {
            pool,
            online,
            held: GroupCommit::new(held, move |a: &Allocation| save(&path, a)),
        })
    }

    /// No CPU is dedicated, nothing is saved: VMs asking are refused.
    pub fn none() -> Self {
        Self {
            pool: CpuSet::default(),
            online: CpuSet::default(),
            held: GroupCommit::new(Allocation::default(), |_| Ok(())),
        }
    }

    pub fn pool(&self) -> &CpuSet {
        &self.pool
    }

    /// Whether VMs' units are placed on CPUs at all.
    pub fn enabled(&self) -> bool {
        !self.pool.is_empty()
    }

    pub fn held_by(&self, id: &str) -> Option<CpuSet> {
        self.held.read(|a| a.get(id).cloned())
    }

    pub fn holders(&self) -> Vec<String> {
        self.held.read(|a| a.ids().map(str::to_owned).collect())
    }

    /// Where VMs without dedicated CPUs run.
    pub fn shared(&self) -> CpuSet {
        self.held.read(|a| a.shared(&self.online))
    }

    /// See [`Allocation::propose`]; changes nothing.
    pub fn propose(&self, id: &str, want: u32, keep_shared: bool) -> Result<CpuSet, CpuSetError> {
        self.held
            .read(|a| a.propose(id, want, &self.pool, &self.online, keep_shared))
    }

    /// `cpus` are `id`'s, on disk before this returns; true if that is new.
    pub fn claim(&self, id: &str, cpus: &CpuSet) -> Result<bool, CpuStoreError> {
        self.held.change(|next| {
            let changed = next.claim(id, cpus)?;
            Ok((changed, changed))
        })
    }

    /// What `id` held, let go (and on disk) before this returns.
    pub fn release(&self, id: &str) -> Result<Option<CpuSet>, CpuStoreError> {
        self.held.change(|next| {
            let gone = next.release(id);
            let changed = gone.is_some();
            Ok((gone, changed))
        })
    }
}

fn save(path: &Path, a: &Allocation) -> Result<(), CpuStoreError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io(path, "create directory"))?;
    }
    replace_private(path, &a.encode()).map_err(io(path, "save"))
}

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> CpuStoreError {
    let path = path.to_owned();
    move |source| CpuStoreError::Io { path, op, source }
}

/// The CPUs kvirtd may run on (its affinity, which systemd and the
/// container it may run in set): VMs run on no others.
pub fn online() -> std::io::Result<CpuSet> {
    let mask = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0))?;
    Ok((0..nix::sched::CpuSet::count() as u32)
        .filter(|&c| mask.is_set(c as usize).unwrap_or(false))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(s: &str) -> CpuSet {
        s.parse().unwrap()
    }

    #[test]
    fn what_is_held_is_on_disk_and_read_back_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sub/cpus.json");
        let cpus = DedicatedCpus::open(&file, set("1-3"), set("0-3")).unwrap();
        let a = cpus.propose("ns_a", 2, true).unwrap();
        assert!(cpus.claim("ns_a", &a).unwrap());
        assert!(cpus.claim("ns_b", &set("2")).is_err(), "held by ns_a");
        assert_eq!(cpus.shared(), set("0,3"));

        let again = DedicatedCpus::open(&file, set("1-3"), set("0-3")).unwrap();
        assert_eq!(again.held_by("ns_a"), Some(set("1-2")));
        assert_eq!(
            again.propose("ns_b", 2, false).unwrap_err().to_string(),
            "needs 2 dedicated CPUs, but only 1 of this host's 3 dedicated CPUs (1-3) are free \
             (held: 1-2 by ns_a)"
        );
        assert_eq!(again.release("ns_a").unwrap(), Some(set("1-2")));
        assert_eq!(again.release("ns_a").unwrap(), None);
        let after = DedicatedCpus::open(&file, set("1-3"), set("0-3")).unwrap();
        assert!(after.holders().is_empty());
    }

    #[test]
    fn a_file_that_holds_a_cpu_twice_is_refused_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cpus.json");
        std::fs::write(&file, br#"{"held": {"a": "1", "b": "1"}}"#).unwrap();
        let err = DedicatedCpus::open(&file, set("1"), set("0-1")).unwrap_err();
        assert!(err.to_string().contains("b: CPUs 1 are held by a"), "{err}");
    }

    #[test]
    fn this_process_runs_on_some_cpu() {
        assert!(!online().unwrap().is_empty());
    }
}
