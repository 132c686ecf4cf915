//! State kept in memory and saved whole to disk, where changes made at the
//! same time share one save (group commit). Each save syncs a file and its
//! directory (~10 ms on a disk): a hundred VMs deleted at once would
//! otherwise wait for a hundred of them in a row.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

/// Replaces `file` with `bytes`, root's alone (0600): written to a hidden
/// temporary file beside it (never through a link), synced, renamed over
/// it, then the directory synced, so after a crash the file holds the old
/// or the new bytes, never a torn mix.
pub fn replace_private(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut name = std::ffi::OsString::from(".");
    name.push(file.file_name().unwrap_or_default());
    name.push(".tmp");
    let tmp = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, file)?;
    std::fs::File::open(dir)?.sync_all()
}

/// How a batch of changes ended.
enum Outcome<E> {
    Saved,
    /// The changes are gone from memory as well.
    Failed(Arc<E>),
    /// The save panicked; its changes are gone from memory.
    Panicked,
}

type Batch<E> = Arc<OnceLock<Outcome<E>>>;

struct State<T, E> {
    /// As on disk.
    saved: T,
    /// `saved` with the changes not yet saved.
    next: T,
    /// The changes made since the running save began.
    open: Batch<E>,
    saving: bool,
}

type Save<T, E> = Box<dyn Fn(&T) -> Result<(), E> + Send + Sync>;

pub struct GroupCommit<T, E> {
    state: Mutex<State<T, E>>,
    /// Woken when a save ends.
    saved: Condvar,
    save: Save<T, E>,
}

impl<T: std::fmt::Debug, E> std::fmt::Debug for GroupCommit<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit")
            .field("saved", &self.lock().saved)
            .finish_non_exhaustive()
    }
}

impl<T, E> GroupCommit<T, E>
where
    T: Clone,
    E: From<Arc<E>>,
{
    /// `value` is what is on disk now; `save` writes a whole value durably.
    pub fn new(value: T, save: impl Fn(&T) -> Result<(), E> + Send + Sync + 'static) -> Self {
        Self {
            state: Mutex::new(State {
                next: value.clone(),
                saved: value,
                open: Batch::default(),
                saving: false,
            }),
            saved: Condvar::new(),
            save: Box::new(save),
        }
    }

    /// Looks at what is on disk (a change not yet saved is not there).
    pub fn read<R>(&self, f: impl FnOnce(&T) -> R) -> R {
        f(&self.lock().saved)
    }

    /// Applies `change` to the newest state. It returns its result and
    /// whether it changed anything; if it did, this returns once that is
    /// on disk, or with the error of the save that failed to put it there
    /// (then the change is undone). An error of `change` itself changes
    /// nothing.
    pub fn change<R>(&self, change: impl FnOnce(&mut T) -> Result<(R, bool), E>) -> Result<R, E> {
        let mut st = self.lock();
        let mut next = st.next.clone();
        let (r, changed) = change(&mut next)?;
        if !changed {
            return Ok(r);
        }
        st.next = next;
        let mine = st.open.clone();
        loop {
            match mine.get() {
                Some(Outcome::Saved) => return Ok(r),
                Some(Outcome::Failed(e)) => return Err(E::from(e.clone())),
                Some(Outcome::Panicked) => panic!("a save of this state panicked"),
                None => {}
            }
            if st.saving {
                st = self.saved.wait(st).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            // Nobody saves: this thread saves every change made so far.
            st = self.save_open(st);
        }
    }

    fn save_open<'a>(&'a self, mut st: MutexGuard<'a, State<T, E>>) -> MutexGuard<'a, State<T, E>> {
        st.saving = true;
        let batch = std::mem::take(&mut st.open);
        let snapshot = st.next.clone();
        drop(st);
        let mut guard = Saving {
            gc: self,
            batch: Some(batch),
        };
        let result = (self.save)(&snapshot);
        let batch = guard.batch.take().expect("taken once");
        let mut st = self.lock();
        st.saving = false;
        match result {
            Ok(()) => {
                st.saved = snapshot;
                let _ = batch.set(Outcome::Saved);
            }
            Err(e) => {
                let e = Arc::new(e);
                let later = st.undo();
                let _ = batch.set(Outcome::Failed(e.clone()));
                let _ = later.set(Outcome::Failed(e));
            }
        }
        self.saved.notify_all();
        st
    }
}

impl<T, E> GroupCommit<T, E> {
    fn lock(&self) -> MutexGuard<'_, State<T, E>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: Clone, E> State<T, E> {
    /// Back to what is on disk. The changes made while the failed save
    /// ran were made on top of the lost ones: they go too, and their batch
    /// is returned to be told.
    fn undo(&mut self) -> Batch<E> {
        self.next = self.saved.clone();
        std::mem::take(&mut self.open)
    }
}

/// Ends a save that panicked: its waiters and the next saver are not left
/// waiting for it.
struct Saving<'a, T: Clone, E> {
    gc: &'a GroupCommit<T, E>,
    batch: Option<Batch<E>>,
}

impl<T: Clone, E> Drop for Saving<'_, T, E> {
    fn drop(&mut self) {
        let Some(batch) = self.batch.take() else {
            return;
        };
        let mut st = self.gc.lock();
        st.saving = false;
        let later = st.undo();
        let _ = batch.set(Outcome::Panicked);
        let _ = later.set(Outcome::Panicked);
        self.gc.saved.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole new content or the old, root's alone; a link planted
    /// where the temporary file goes is not written through.
    #[test]
    fn a_private_file_is_replaced_whole_and_never_through_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state.json");
        replace_private(&file, b"old").unwrap();
        replace_private(&file, b"new").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["state.json"], "no temporary file left");

        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, b"untouched").unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join(".state.json.tmp")).unwrap();
        assert!(replace_private(&file, b"newer").is_err());
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"untouched");
        assert_eq!(std::fs::read(&file).unwrap(), b"new");
    }
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    #[derive(Debug, thiserror::Error)]
    enum TestError {
        #[error("disk full")]
        Full,
        #[error("refused")]
        Refused,
        #[error(transparent)]
        Shared(#[from] Arc<TestError>),
    }

    type Disk = Arc<Mutex<Vec<Vec<u32>>>>;

    /// A store of numbers whose saves are recorded, and fail while `full`.
    fn store(
        full: Arc<std::sync::atomic::AtomicBool>,
        gate: Option<Arc<Barrier>>,
    ) -> (Arc<GroupCommit<Vec<u32>, TestError>>, Disk) {
        let disk: Disk = Arc::default();
        let d = disk.clone();
        let gc = GroupCommit::new(Vec::new(), move |v: &Vec<u32>| {
            if let Some(g) = &gate {
                g.wait();
            }
            if full.load(Ordering::SeqCst) {
                return Err(TestError::Full);
            }
            d.lock().unwrap().push(v.clone());
            Ok(())
        });
        (Arc::new(gc), disk)
    }

    fn push(n: u32) -> impl FnOnce(&mut Vec<u32>) -> Result<((), bool), TestError> {
        move |v| {
            v.push(n);
            Ok(((), true))
        }
    }

    #[test]
    fn a_change_is_on_disk_when_it_returns() {
        let (gc, disk) = store(Arc::default(), None);
        gc.change(push(1)).unwrap();
        assert_eq!(*disk.lock().unwrap(), vec![vec![1]]);
        assert_eq!(gc.read(Clone::clone), vec![1]);
        // No change, no save.
        gc.change(|_| Ok(((), false))).unwrap();
        assert_eq!(disk.lock().unwrap().len(), 1);
    }

    #[test]
    fn a_refused_change_changes_nothing() {
        let (gc, disk) = store(Arc::default(), None);
        let r = gc.change(|v| {
            v.push(7);
            Err::<((), bool), _>(TestError::Refused)
        });
        assert!(matches!(r, Err(TestError::Refused)));
        gc.change(push(1)).unwrap();
        assert_eq!(*disk.lock().unwrap(), vec![vec![1]]);
    }

    #[test]
    fn changes_made_during_a_save_share_the_next_one() {
        // The first save waits at the gate until every other change is in.
        let gate = Arc::new(Barrier::new(2));
        let (gc, disk) = store(Arc::default(), Some(gate.clone()));
        let first = {
            let gc = gc.clone();
            std::thread::spawn(move || gc.change(push(0)).unwrap())
        };
        // Wait until the first save runs, then queue eight changes.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !gc.lock().saving {
            assert!(
                std::time::Instant::now() < deadline,
                "the first save never began"
            );
            std::thread::yield_now();
        }
        let queued = Arc::new(AtomicUsize::new(0));
        let others: Vec<_> = (1..=8)
            .map(|n| {
                let (gc, queued) = (gc.clone(), queued.clone());
                std::thread::spawn(move || {
                    gc.change(|v| {
                        v.push(n);
                        queued.fetch_add(1, Ordering::SeqCst);
                        Ok(((), true))
                    })
                    .unwrap()
                })
            })
            .collect();
        while queued.load(Ordering::SeqCst) < 8 {
            assert!(std::time::Instant::now() < deadline, "changes not queued");
            std::thread::yield_now();
        }
        gate.wait(); // the first save
        gate.wait(); // the one save of the eight
        first.join().unwrap();
        for t in others {
            t.join().unwrap();
        }
        let saves = disk.lock().unwrap().clone();
        assert_eq!(saves.len(), 2, "{saves:?}");
        let mut last = saves[1].clone();
        last.sort();
        assert_eq!(last, (0..=8).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_save_undoes_its_changes_and_tells_every_waiter() {
        let full = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (gc, disk) = store(full.clone(), None);
        gc.change(push(1)).unwrap();
        full.store(true, Ordering::SeqCst);
        let r = gc.change(push(2));
        assert!(matches!(r, Err(TestError::Shared(ref e)) if matches!(**e, TestError::Full)));
        assert_eq!(r.unwrap_err().to_string(), "disk full");
        assert_eq!(gc.read(Clone::clone), vec![1]);
        full.store(false, Ordering::SeqCst);
        gc.change(push(3)).unwrap();
        assert_eq!(disk.lock().unwrap().last().unwrap(), &vec![1, 3]);
    }

    #[test]
    fn a_panicking_save_leaves_no_one_waiting() {
        let gc = Arc::new(GroupCommit::<Vec<u32>, TestError>::new(
            Vec::new(),
            |v: &Vec<u32>| {
                assert!(!v.contains(&13), "unlucky");
                Ok(())
            },
        ));
        let g = gc.clone();
        let r = std::thread::spawn(move || g.change(push(13))).join();
        assert!(r.is_err(), "the saver's panic reaches its caller");
        gc.change(push(1)).unwrap();
        assert_eq!(gc.read(Clone::clone), vec![1]);
    }
}
