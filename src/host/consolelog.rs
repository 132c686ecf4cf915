//! Each VM's serial console log, kept to a fixed size whatever the guest
//! prints. There is no virtlogd per VM (it costs more than the rest of
//! kvirt's overhead per VM), so QEMU appends to `console.log` in the VM's
//! runtime directory itself; kvirtd rotates it as virtlogd would with
//! `max_size` and one backup: past [`MAX_SIZE`], the newest `MAX_SIZE`
//! bytes go to `console.log.1` and the log starts again. QEMU appends
//! (`O_APPEND`), so it writes on at the new end. Both files go with the
//! VM's runtime directory.
//!
//! The directory is the VM's user's: the log is reached through
//! [`Beneath`], so a planted link or FIFO is refused, never truncated.

use crate::core::layout::HostLayout;
use crate::host::beneath::Beneath;
use nix::fcntl::OFlag;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::PathBuf;

/// virtlogd's default `max_size`.
pub const MAX_SIZE: u64 = 2 << 20;

#[derive(Debug, thiserror::Error)]
#[error("console log {path}: {source}")]
pub struct ConsoleLogError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// One pass over every VM's console log; errors are per VM, the rest go on.
pub fn cap_all(layout: &HostLayout, max: u64) -> Vec<ConsoleLogError> {
    let Ok(ids) = Beneath::open(&layout.vms_runtime_dir()).and_then(|d| d.entries()) else {
        return Vec::new();
    };
    let mut errors = Vec::new();
    for id in ids {
        let paths = layout.vm_by_id(&id.to_string_lossy());
        let log = paths.serial_log();
        let name = log.file_name().unwrap_or_default().to_string_lossy();
        let result = Beneath::open(&paths.runtime_dir).and_then(|dir| cap(&dir, &name, max));
        match result {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => errors.push(ConsoleLogError { path: log, source }),
            Ok(()) => {}
        }
    }
    errors
}

/// The errors of a pass not told before: a FIFO or link a VM planted for
/// its log fails every pass (each one the VM's writes wake), and is told
/// once, again only once it changes or after it went away. `told` keeps
/// the last error per log between passes.
pub fn untold(
    told: &mut std::collections::HashMap<PathBuf, String>,
    errors: Vec<ConsoleLogError>,
) -> Vec<ConsoleLogError> {
    let now: std::collections::HashMap<PathBuf, String> = errors
        .iter()
        .map(|e| (e.path.clone(), e.source.to_string()))
        .collect();
    let fresh = errors
        .into_iter()
        .filter(|e| told.get(&e.path) != now.get(&e.path))
        .collect();
    *told = now;
    fresh
}

/// Rotates `name` in `dir` once it is larger than `max`.
pub fn cap(dir: &Beneath, name: &str, max: u64) -> io::Result<()> {
    let mut log = dir.file(name, OFlag::O_RDWR)?;
    let len = log.metadata()?.len();
    if len <= max {
        return Ok(());
    }
    let mut newest = Vec::with_capacity(max as usize);
    log.seek(SeekFrom::Start(len - max))?;
    (&mut log).take(max).read_to_end(&mut newest)?;
    dir.write(&format!("{name}.1"), &newest, 0o600, None)?;
    log.set_len(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(root: &std::path::Path) -> HostLayout {
        HostLayout {
            state_dir: root.join("lib"),
            runtime_dir: root.join("run"),
            cache_dir: root.join("cache"),
        }
    }

    #[test]
    fn a_log_past_its_cap_keeps_its_newest_bytes_in_one_backup() {
        let t = tempfile::tempdir().unwrap();
        let l = layout(t.path());
        let p = l.vm_by_id("default_vm1");
        std::fs::create_dir_all(&p.runtime_dir).unwrap();
        let log = p.serial_log();
        let mut text: Vec<u8> = (0..3000u32)
            .flat_map(|i| format!("line {i}\n").into_bytes())
            .collect();
        std::fs::write(&log, &text).unwrap();

        assert!(cap_all(&l, 1 << 20).is_empty());
        assert_eq!(
            std::fs::read(&log).unwrap(),
            text,
            "under the cap: untouched"
        );

        assert!(cap_all(&l, 1000).is_empty());
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        let backup = std::fs::read(log.with_extension("log.1")).unwrap();
        assert_eq!(backup, text.split_off(text.len() - 1000));
        // An appending writer (QEMU) goes on at the new end.
        let mut f = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        std::io::Write::write_all(&mut f, b"after\n").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"after\n");
    }

    /// The VM's user planted links (to root's file, to an endless device)
    /// or a FIFO where the log goes: none is truncated, read or waited on.
    #[test]
    fn planted_logs_are_refused_and_never_truncated() {
        let t = tempfile::tempdir().unwrap();
        let l = layout(t.path());
        let secret = t.path().join("secret");
        std::fs::write(&secret, vec![b's'; 4096]).unwrap();
        let plant = |id: &str, how: &dyn Fn(&std::path::Path)| {
            let p = l.vm_by_id(id);
            std::fs::create_dir_all(&p.runtime_dir).unwrap();
            how(&p.serial_log());
        };
        plant("default_link", &|log| {
            std::os::unix::fs::symlink(&secret, log).unwrap()
        });
        plant("default_zero", &|log| {
            std::os::unix::fs::symlink("/dev/zero", log).unwrap()
        });
        plant("default_fifo", &|log| {
            nix::unistd::mkfifo(log, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let l2 = l.clone();
        std::thread::spawn(move || tx.send(cap_all(&l2, 100)).unwrap());
        let errors = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the pass blocked");
        assert_eq!(errors.len(), 3, "{errors:?}");
        // Told once: the next passes fail the same way, and say nothing.
        let mut told = Default::default();
        assert_eq!(untold(&mut told, errors).len(), 3);
        assert!(untold(&mut told, cap_all(&l, 100)).is_empty());
        assert!(untold(&mut told, cap_all(&l, 100)).is_empty());
        assert_eq!(std::fs::metadata(&secret).unwrap().len(), 4096);
        for id in ["default_link", "default_zero", "default_fifo"] {
            assert!(!l.vm_by_id(id).runtime_dir.join("console.log.1").exists());
        }
    }
}
