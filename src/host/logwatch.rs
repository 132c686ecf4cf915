//! When the VMs' logs need tending: inotify on the directories QEMU and
//! its libvirt daemon write them in, so a host of idle VMs costs kvirtd no
//! wakeups at all (a pass over every VM once a second did, at 100 VMs).
//!
//! The directories are the VM's user's: each is opened through
//! [`Beneath`] and watched through its descriptor's `/proc/self/fd` link,
//! which names exactly the directory opened, never a link planted in its
//! place. A watch only says "look again"; what is read is read as before,
//! through `Beneath`.

use crate::core::layout::HostLayout;
use crate::host::beneath::Beneath;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Component, Path};
use std::time::Duration;

pub struct LogWatch {
    inotify: Inotify,
    layout: HostLayout,
}

/// A directory where VM directories come and go, or one on the way to a
/// log: something new there may be a log to watch.
const PARENT: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_ONLYDIR);
/// A directory holding logs: written, made, or moved into.
const LOGS: AddWatchFlags = PARENT.union(AddWatchFlags::IN_MODIFY);

impl LogWatch {
    pub fn new(layout: HostLayout) -> io::Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
        Ok(Self { inotify, layout })
    }

    /// Watches every VM's log directories as they are now (a directory
    /// already watched keeps its watch). Directories not there yet are
    /// watched once their parent says they were made.
    pub fn rewatch(&self) {
        // kvirt's own directories too: on a fresh host the VMs' ones are
        // made with the first VM, after kvirtd started (unwatched, its
        // QEMU's log waited for the five-minute look).
        let l = &self.layout;
        for top in [
            &l.state_dir,
            &l.runtime_dir,
            &l.vms_state_dir(),
            &l.vms_runtime_dir(),
        ] {
            let _ = Beneath::open(top).and_then(|d| self.add(&d, PARENT));
        }
        for id in self.ids() {
            let paths = self.layout.vm_by_id(&id);
            let _ = Beneath::open(&paths.runtime_dir).and_then(|d| self.add(&d, LOGS));
            let logs = paths.qemu_log_dir();
            let Ok(rel) = logs.strip_prefix(&paths.state_dir) else {
                continue;
            };
            let Ok(mut dir) = Beneath::open(&paths.state_dir) else {
                continue;
            };
            let _ = self.add(&dir, PARENT);
            let parts: Vec<_> = rel.components().collect();
            for (i, part) in parts.iter().enumerate() {
                let Component::Normal(name) = part else { break };
                let Ok(next) = dir.dir(Path::new(name)) else {
                    break;
                };
                let mask = if i + 1 == parts.len() { LOGS } else { PARENT };
                let _ = self.add(&next, mask);
                dir = next;
            }
        }
    }

    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = [self.layout.vms_state_dir(), self.layout.vms_runtime_dir()]
            .iter()
            .filter_map(|d| Beneath::open(d).and_then(|d| d.entries()).ok())
            .flatten()
            .map(|n| n.to_string_lossy().into_owned())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    fn add(&self, dir: &Beneath, mask: AddWatchFlags) -> io::Result<()> {
        let link = format!("/proc/self/fd/{}", dir.as_fd().as_raw_fd());
        self.inotify.add_watch(link.as_str(), mask)?;
        Ok(())
    }

    /// Waits up to `timeout` for a change in a watched directory; true
    /// when there was one (or the kernel's queue overflowed). Every
    /// pending event is consumed: one pass serves them all.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        let timeout = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(self.inotify.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => return Ok(false),
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let mut changed = false;
        loop {
            match self.inotify.read_events() {
                Ok(events) if events.is_empty() => break,
                Ok(_) => changed = true,
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(root: &Path) -> HostLayout {
        HostLayout {
            state_dir: root.join("lib"),
            runtime_dir: root.join("run"),
            cache_dir: root.join("cache"),
        }
    }

    const NOW: Duration = Duration::from_millis(0);
    const SOON: Duration = Duration::from_secs(5);

    #[test]
    fn a_log_written_or_made_anywhere_in_a_vm_wakes_it_and_nothing_else_does() {
        let t = tempfile::tempdir().unwrap();
        let l = layout(t.path());
        std::fs::create_dir_all(l.vms_state_dir()).unwrap();
        std::fs::create_dir_all(l.vms_runtime_dir()).unwrap();
        let w = LogWatch::new(l.clone()).unwrap();
        w.rewatch();
        assert!(!w.wait(NOW).unwrap(), "nothing happened yet");

        // A new VM: its directories appear, then its daemon makes the log
        // directory level by level.
        let p = l.vm_by_id("default_vm1");
        std::fs::create_dir_all(&p.runtime_dir).unwrap();
        assert!(w.wait(SOON).unwrap(), "a VM's runtime directory");
        std::fs::create_dir_all(&p.state_dir).unwrap();
        assert!(w.wait(SOON).unwrap(), "a VM's state directory");
        w.rewatch();
        std::fs::create_dir_all(p.qemu_log_dir()).unwrap();
        assert!(
            w.wait(SOON).unwrap(),
            "the first level of the log directory"
        );
        w.rewatch();
        assert!(!w.wait(NOW).unwrap(), "rewatching is quiet");

        let qemu_log = p.qemu_log_dir().join("default_vm1.log");
        std::fs::write(&qemu_log, "started\n").unwrap();
        assert!(w.wait(SOON).unwrap(), "QEMU's log made");
        std::fs::write(p.serial_log(), "login:\n").unwrap();
        assert!(w.wait(SOON).unwrap(), "the console log made");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(p.serial_log())
            .unwrap();
        std::io::Write::write_all(&mut f, b"more\n").unwrap();
        assert!(w.wait(SOON).unwrap(), "the console log written");
        assert!(!w.wait(NOW).unwrap(), "each change wakes once");

        // Reading does not wake it.
        std::fs::read(&qemu_log).unwrap();
        assert!(!w.wait(NOW).unwrap());
    }

    /// A fresh host: kvirtd starts before there is any VM directory.
    #[test]
    fn the_first_vm_on_a_fresh_host_wakes_it() {
        let t = tempfile::tempdir().unwrap();
        let l = layout(t.path());
        std::fs::create_dir_all(&l.state_dir).unwrap();
        std::fs::create_dir_all(&l.runtime_dir).unwrap();
        let w = LogWatch::new(l.clone()).unwrap();
        w.rewatch();
        assert!(!w.wait(NOW).unwrap());
        std::fs::create_dir_all(l.vms_state_dir()).unwrap();
        assert!(w.wait(SOON).unwrap(), "the VMs' state directory made");
        w.rewatch();
        std::fs::create_dir_all(l.vm_by_id("default_vm1").state_dir).unwrap();
        assert!(w.wait(SOON).unwrap(), "the first VM's directory");
    }

    /// The VM's user replaces its log directory with a link to a directory
    /// of root's: the link is not followed, so root's directory is not
    /// watched (writes there wake nothing).
    #[test]
    fn a_link_planted_for_a_log_directory_is_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let l = layout(t.path());
        let p = l.vm_by_id("default_vm1");
        std::fs::create_dir_all(&p.runtime_dir).unwrap();
        let logs = p.qemu_log_dir();
        std::fs::create_dir_all(logs.parent().unwrap()).unwrap();
        let roots = t.path().join("roots");
        std::fs::create_dir_all(&roots).unwrap();
        std::os::unix::fs::symlink(&roots, &logs).unwrap();
        let w = LogWatch::new(l).unwrap();
        w.rewatch();
        std::fs::write(roots.join("secret"), "x").unwrap();
        assert!(!w.wait(NOW).unwrap(), "root's directory is not watched");
    }
}
