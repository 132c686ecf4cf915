//! Processes named by pidfd, not by number: a signal reaches the process
//! that was looked at, never one that reused its pid, and its exit can be
//! awaited. Used to end a VM's unit without a D-Bus call per signal (under
//! load each took systemd hundreds of milliseconds to answer).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use tokio::io::unix::AsyncFd;

pub struct Pidfd(AsyncFd<OwnedFd>);

/// `None` when the process is gone already.
fn open(pid: u32) -> Option<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).ok().filter(|p| *p > 0)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the signal was delivered (false: the process has exited).
fn send(fd: &impl AsRawFd, signal: i32) -> bool {
    // SAFETY: a pidfd, a signal number, no siginfo, no flags.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r == 0
}

impl Pidfd {
    /// `None` when the process is gone already (or there is no runtime
    /// to wait on it with).
    pub fn open(pid: u32) -> Option<Self> {
        // SAFETY: the AsyncFd owns the fd and closes it only when dropped.
        unsafe { AsyncFd::register_with_interest(open(pid)?, tokio::io::Interest::READABLE) }
            .ok()
            .map(Self)
    }

    /// [`Pidfd::open`], only while `pid` runs in the cgroup `path`
    /// (checked after it is pinned).
    pub fn open_in(pid: u32, path: &str) -> Option<Self> {
        let fd = Self::open(pid)?;
        (cgroup_of(pid)?.as_str() == path).then_some(fd)
    }

    /// Whether the signal was delivered (false: the process has exited).
    pub fn signal(&self, signal: i32) -> bool {
        send(self.0.get_ref(), signal)
    }

    /// Resolves once the process has exited.
    pub async fn exited(&self) {
        // A pidfd polls readable at exit; an error means it cannot be
        // waited on, which the caller's deadline covers.
        if self.0.readable().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A process pinned by a pidfd: its pid number may be handed to another
/// process once it is gone, the pidfd never.
pub struct Pinned(OwnedFd);

impl Pinned {
    /// `None` when the process is gone already.
    pub fn pin(pid: u32) -> Option<Self> {
        open(pid).map(Self)
    }

    /// Whether the pinned process still runs (so its pid is still its own).
    pub fn alive(&self) -> bool {
        send(&self.0, 0)
    }
}

/// The `0::` line of `/proc/<pid>/cgroup` (the unified hierarchy path),
/// read after the caller pinned `pid`: if the number was reused, the pin
/// is of the newcomer, which is then the one read here.
pub fn cgroup_of(pid: u32) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/cgroup"))
        .ok()?
        .take(4096)
        .read_to_string(&mut text)
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_owned)
}

/// `pid` pinned, with its cgroup, if that cgroup is `unit`'s (its last
/// component is the unit's name): a pid that was the unit's main process
/// and has since been reused by a process elsewhere is never signalled.
pub fn pin_in_unit(pid: u32, unit: &str) -> Option<(Pidfd, String)> {
    let fd = Pidfd::open(pid)?;
    let cgroup = cgroup_of(pid)?;
    (cgroup.rsplit('/').next() == Some(unit)).then_some((fd, cgroup))
}

/// The `cgroup.procs` of the unified hierarchy's `path`, at its own
/// mount or beside the legacy ones on a hybrid host.
fn procs_of(path: &str) -> Option<String> {
    let relative = path.trim_start_matches('/');
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .iter()
        .find_map(|root| {
            std::fs::read_to_string(Path::new(root).join(relative).join("cgroup.procs")).ok()
        })
}

/// The processes of the cgroup `path` (none when it cannot be listed).
pub fn pids_of(path: &str) -> Vec<u32> {
    procs_of(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

/// Whether the processes of the cgroup `path` can be listed here.
pub fn can_list(path: &str) -> bool {
    procs_of(path).is_some()
}

/// Sends `signal` to every process in the cgroup `path` (a unified
/// hierarchy path, as systemd's `ControlGroup` gives it; the hierarchy is
/// at /sys/fs/cgroup, or beside the legacy ones on a hybrid host), each
/// checked to be in it after it is pinned by its pidfd. How many were
/// signalled.
pub fn signal_cgroup(path: &str, signal: i32) -> usize {
    let Some(procs) = procs_of(path) else {
        return 0;
    };
    procs
        .lines()
        .filter_map(|l| l.parse::<u32>().ok())
        .filter_map(|pid| {
            let fd = open(pid)?;
            (cgroup_of(pid)? == path && send(&fd, signal)).then_some(())
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_signalled_process_is_seen_to_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let fd = Pidfd::open(child.id()).unwrap();
        assert!(fd.signal(libc::SIGTERM));
        // The exit is seen although the child is not yet reaped (a zombie).
        tokio::time::timeout(Duration::from_secs(10), fd.exited())
            .await
            .expect("the exit was not seen");
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGTERM)
        );
        // Reaped: the pid may be anyone's now, the pidfd still names the dead child.
        assert!(!fd.signal(libc::SIGTERM));
        assert!(Pidfd::open(0).is_none());
    }

    #[test]
    fn only_members_of_the_cgroup_are_signalled() {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
            eprintln!("skipped: no unified cgroup hierarchy");
            return;
        };
        // Signal 0 checks delivery without sending anything: this test
        // process is in its own cgroup, and in no other.
        assert!(signal_cgroup(path, 0) >= 1);
        assert_eq!(signal_cgroup("/no/such/cgroup", 0), 0);
    }

    #[tokio::test]
    async fn a_seen_pid_is_pinned_only_in_its_units_cgroup() {
        let Some(own) = cgroup_of(std::process::id()) else {
            eprintln!("skipped: no unified cgroup hierarchy");
            return;
        };
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let last = own.rsplit('/').next().unwrap().to_owned();
        let pinned = pin_in_unit(child.id(), &last);
        // Another unit's name, or a pid that is no process: nothing pinned.
        let other = pin_in_unit(child.id(), "kvirt-vm@default_other.service");
        child.kill().unwrap();
        child.wait().unwrap();
        let (fd, cgroup) = pinned.expect("the child is in this cgroup");
        assert_eq!(cgroup, own);
        assert!(
            !fd.signal(0),
            "the pidfd names the reaped child, no one else"
        );
        assert!(other.is_none() || last == "kvirt-vm@default_other.service");
        assert!(pin_in_unit(u32::MAX, &last).is_none());
    }
}
