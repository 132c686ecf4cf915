//! When this host last renewed its Lease, by the boot clock
//! (`CLOCK_BOOTTIME`: never set back, and counting while the machine is
//! suspended), kept in memory and in a root-only file so that a kvirtd
//! restarted while its host is cut off (its watchdog fired on a frozen
//! process) fences from the last renewal, not from its own start.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The file holds a number, no more.
const MAX_FILE: u64 = 64;

pub struct RenewalClock {
    file: PathBuf,
    /// Milliseconds of the boot clock at the last renewal.
    last: AtomicU64,
}

/// The boot clock now, in milliseconds.
fn now_ms() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(|t| Duration::from(t).as_millis() as u64)
        .unwrap_or(0)
}

impl RenewalClock {
    /// The last renewal the file records; none recorded (a first start, an
    /// earlier kvirt), or one past now (a file of another boot), counts
    /// as now.
    pub fn open(file: PathBuf) -> Self {
        let now = now_ms();
        let last = read_bounded(&file)
            .and_then(|s| s.trim().parse::<u64>().ok())
            .filter(|&t| t <= now)
            .unwrap_or(now);
        Self {
            file,
            last: AtomicU64::new(last),
        }
    }

    /// The Lease was renewed now. The file is replaced whole; failing to
    /// write it is said, and only a restart would miss it.
    pub fn renewed(&self) {
        let now = now_ms();
        self.last.store(now, Ordering::Relaxed);
        let write = || -> std::io::Result<()> {
            use std::os::unix::fs::DirBuilderExt;
            if let Some(dir) = self.file.parent() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)?;
            }
            crate::host::commit::replace_private(&self.file, now.to_string().as_bytes())
        };
        if let Err(e) = write() {
            tracing::warn!(
                "recording the Lease's renewal in {}: {e}",
                self.file.display()
            );
        }
    }

    /// How long since the last renewal.
    pub fn unrenewed(&self) -> Duration {
        let last = self.last.load(Ordering::Relaxed);
        Duration::from_millis(now_ms().saturating_sub(last))
    }
}

/// The file's text, if it is a small regular file (never through a link).
fn read_bounded(file: &std::path::Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(file)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut s = String::new();
    f.take(MAX_FILE).read_to_string(&mut s).ok()?;
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_kvirtd_counts_from_the_last_renewal_recorded() {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("fenced").join("lease-renewed");
        // Nothing recorded: counts from now.
        let first = RenewalClock::open(file.clone());
        assert!(first.unrenewed() < Duration::from_secs(5));
        // A renewal 100 s ago, as a kvirtd restarted after a freeze finds.
        let past = now_ms().saturating_sub(100_000);
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, past.to_string()).unwrap();
        let restarted = RenewalClock::open(file.clone());
        assert!(restarted.unrenewed() >= Duration::from_secs(100));
        restarted.renewed();
        assert!(restarted.unrenewed() < Duration::from_secs(5));
        let kept: u64 = std::fs::read_to_string(&file).unwrap().parse().unwrap();
        assert!(kept > past);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // A time past now (another boot's) or garbage: counts from now.
        for text in [(now_ms() + 1_000_000).to_string(), "yesterday".into()] {
            std::fs::write(&file, text).unwrap();
            assert!(RenewalClock::open(file.clone()).unrenewed() < Duration::from_secs(5));
        }
    }

    #[test]
    fn a_planted_fifo_or_link_is_not_read() {
        let t = tempfile::tempdir().unwrap();
        let fifo = t.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Opening it must neither block nor be taken for a renewal.
        assert_eq!(read_bounded(&fifo), None);
        let target = t.path().join("target");
        std::fs::write(&target, "1").unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(read_bounded(&link), None);
    }
}
