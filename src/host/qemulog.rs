//! Each VM's QEMU log, forwarded line by line into the journal under the
//! VM's unit. The VM runs without virtlogd (it costs more per VM than the
//! rest of kvirt's overhead), so libvirt writes QEMU's log to a file in the
//! VM's cache; kvirtd, as root, forwards it with `OBJECT_SYSTEMD_UNIT=`.
//!
//! Where each file was read up to is kept under the runtime directory, so a
//! restarted kvirtd continues without repeating or losing lines.
//!
//! The log directory is the VM's user's: everything in it is reached
//! through [`Beneath`], so a link planted there leads nowhere, a FIFO does
//! not block the forwarder, and a huge file is read a chunk at a time.

use crate::core::key::{self, VmKey};
use crate::core::layout::HostLayout;
use crate::host::beneath::Beneath;
use crate::host::journal::{Sink, VM_FIELD};
use nix::fcntl::OFlag;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[error("QEMU log {path}: {source}")]
pub struct QemuLogError {
    pub path: PathBuf,
    pub source: io::Error,
}

/// At most this much of one log per pass, so one chatty VM cannot hold up
/// the others.
const CHUNK: u64 = 1 << 20;
/// libvirt's pid file holds a number and a newline.
const MAX_PID_FILE: u64 = 32;

/// A process the forwarder names as a line's writer: pinned first, its
/// unit read after, and alive at each line it is named for.
pub struct Writer {
    pub unit: String,
    pub alive: Box<dyn Fn() -> bool + Send>,
}

/// Pins a process and tells its unit (`pin_process`, or a fake in tests).
pub type UnitOf = Box<dyn Fn(u32) -> Option<Writer> + Send + Sync>;

pub struct Forwarder<K: Sink> {
    sink: K,
    layout: HostLayout,
    unit_of: UnitOf,
}

impl<K: Sink> Forwarder<K> {
    pub fn new(sink: K, layout: HostLayout) -> Self {
        Self::with_units(sink, layout, Box::new(pin_process))
    }

    pub fn with_units(sink: K, layout: HostLayout, unit_of: UnitOf) -> Self {
        Self {
            sink,
            layout,
            unit_of,
        }
    }

    fn offsets_dir(&self) -> PathBuf {
        self.layout.log_positions_dir()
    }

    /// One pass over every VM's log; errors are per file, the rest go on.
    pub fn pass(&self) -> Vec<QemuLogError> {
        let mut errors = Vec::new();
        let mut ids = Vec::new();
        for entry in std::fs::read_dir(self.layout.vms_state_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let id = entry.file_name().to_string_lossy().into_owned();
            let paths = self.layout.vm_by_id(&id);
            // No log directory yet (or not one of ours): nothing to forward.
            let log_dir = paths.qemu_log_dir();
            let below = log_dir.strip_prefix(&paths.state_dir).unwrap_or(&log_dir);
            let Ok(logs) = Beneath::open(&paths.state_dir).and_then(|d| d.dir(below)) else {
                ids.push(id);
                continue;
            };
            for name in logs.entries().unwrap_or_default() {
                let name = name.to_string_lossy().into_owned();
                if let Some(domain) = name.strip_suffix(".log") {
                    if let Err(source) = self.forward(&id, &logs, domain) {
                        let path = logs.path().join(&name);
                        errors.push(QemuLogError { path, source });
                    }
                }
            }
            ids.push(id);
        }
        // Positions of VMs that are gone.
        for entry in std::fs::read_dir(self.offsets_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !ids.iter().any(|id| name.starts_with(&format!("{id}."))) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        errors
    }

    fn forward(&self, id: &str, logs: &Beneath, domain: &str) -> io::Result<()> {
        let pos_file = self.offsets_dir().join(format!("{id}.{domain}.log.pos"));
        let mut file = logs.file(format!("{domain}.log"), OFlag::O_RDONLY)?;
        let meta = file.metadata()?;
        // "<inode> <offset>": a new file (the VM was recreated) starts over.
        let mut offset = std::fs::read_to_string(&pos_file)
            .ok()
            .and_then(|s| {
                let (ino, off) = s.trim().split_once(' ')?;
                (ino.parse::<u64>().ok()? == meta.ino()).then(|| off.parse::<u64>().ok())?
            })
            .unwrap_or(0);
        if offset > meta.len() {
            offset = 0;
        }
        if offset == meta.len() {
            return Ok(());
        }
        file.seek(SeekFrom::Start(offset))?;
        let mut buf = Vec::new();
        file.take(CHUNK).read_to_end(&mut buf)?;
        // Only whole lines; the rest waits for its newline (unless a line
        // is longer than a whole chunk).
        let upto = match buf.iter().rposition(|b| *b == b'\n') {
            Some(i) => i + 1,
            None if buf.len() as u64 == CHUNK => buf.len(),
            None => return Ok(()),
        };
        let unit = key::unit_name_of(id);
        let vm = VmKey::parse(id).map_or_else(|_| id.to_owned(), |k| k.to_string());
        // QEMU's lines are QEMU's in the journal (`qemu[<its pid>]`, its
        // unit), never kvirtd's, which only forwards them. Before QEMU
        // exists libvirt writes its command line here: those lines wait
        // for QEMU's pid file a little; when there is none (QEMU did not
        // start, or has gone) they are the writer's, the VM's libvirt
        // daemon. A pid is taken only of a process in the VM's own unit:
        // the pid files are the VM's, and could name anyone.
        let paths = self.layout.vm_by_id(id);
        let ours = |pid: u32| {
            (self.unit_of)(pid)
                .filter(|w| w.unit == unit)
                .map(|w| (pid, w))
        };
        let mut writer = match first_pid(&paths, &[paths.qemu_pid_file(domain)]).and_then(ours) {
            Some(p) => Some(p),
            None if written_within(&meta, QEMU_PID_WAIT) => return Ok(()),
            None => first_pid(&paths, &paths.daemon_pid_files()).and_then(ours),
        };
        for line in String::from_utf8_lossy(&buf[..upto]).lines() {
            if line.is_empty() {
                continue;
            }
            let fields = [
                ("PRIORITY", "6"),
                ("OBJECT_SYSTEMD_UNIT", unit.as_str()),
                (VM_FIELD, vm.as_str()),
            ];
            // Gone since it was pinned: its number may be anyone's now.
            if writer.as_ref().is_some_and(|(_, w)| !(w.alive)()) {
                writer = None;
            }
            if let Some((pid, _)) = &writer {
                let pid = *pid;
                let pid_text = pid.to_string();
                let mut as_writer = fields.to_vec();
                as_writer.extend([
                    ("SYSLOG_IDENTIFIER", "qemu"),
                    ("SYSLOG_PID", pid_text.as_str()),
                    ("MESSAGE", line),
                ]);
                match self.sink.send_as(pid, &as_writer) {
                    Ok(()) => continue,
                    // Gone since: the rest are forwarded as kvirtd's.
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => writer = None,
                    Err(e) => return Err(e),
                }
            }
            // No process of the VM's to name: kvirtd says it forwards them.
            let message = format!("{vm}: QEMU log: {line}");
            let mut as_kvirtd = fields.to_vec();
            as_kvirtd.extend([("SYSLOG_IDENTIFIER", "kvirtd"), ("MESSAGE", &message)]);
            self.sink.send(&as_kvirtd)?;
        }
        std::fs::create_dir_all(self.offsets_dir())?;
        let tmp = pos_file.with_extension("tmp");
        std::fs::write(&tmp, format!("{} {}\n", meta.ino(), offset + upto as u64))?;
        std::fs::rename(&tmp, &pos_file)
    }
}

/// The pid in the first of `files` (below the VM's runtime directory)
/// that holds one.
fn first_pid(paths: &crate::core::layout::VmPaths, files: &[PathBuf]) -> Option<u32> {
    let dir = Beneath::open(&paths.runtime_dir).ok()?;
    files.iter().find_map(|file| {
        let rel = file.strip_prefix(&paths.runtime_dir).ok()?;
        let text = dir.read(rel, MAX_PID_FILE).ok()?;
        String::from_utf8(text).ok()?.trim().parse::<u32>().ok()
    })
}

/// `pid` pinned by a pidfd, with the systemd unit it runs in, read from
/// its cgroup after the pin: the first component below the slices. Deeper
/// ones prove nothing: below its unit a process may create cgroups of any
/// name.
pub fn pin_process(pid: u32) -> Option<Writer> {
    let pinned = crate::host::pidfd::Pinned::pin(pid)?;
    let unit = unit_in_cgroup(&crate::host::pidfd::cgroup_of(pid)?)?;
    Some(Writer {
        unit,
        alive: Box::new(move || pinned.alive()),
    })
}

fn unit_in_cgroup(path: &str) -> Option<String> {
    path.split('/')
        .filter(|c| !c.is_empty())
        .find(|c| !c.ends_with(".slice"))
        .map(str::to_owned)
}

/// How long lines wait for QEMU's pid file after the log was last written.
const QEMU_PID_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn written_within(meta: &std::fs::Metadata, wait: std::time::Duration) -> bool {
    meta.modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .is_some_and(|age| age < wait)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::journal::tests::{field, Recording};
    use std::io::Write;
    use std::path::Path;

    fn host(dir: &Path) -> HostLayout {
        HostLayout {
            state_dir: dir.join("lib"),
            runtime_dir: dir.join("run"),
            cache_dir: dir.join("cache"),
        }
    }

    fn log_path(layout: &HostLayout, id: &str) -> PathBuf {
        let p = layout.vm_by_id(id).qemu_log_dir().join(format!("{id}.log"));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p
    }

    /// Pids 77 and 4242 run in vm1's unit, 999 in another VM's.
    fn forwarder(rec: &Recording, layout: &HostLayout) -> Forwarder<Recording> {
        Forwarder::with_units(
            rec.clone(),
            layout.clone(),
            Box::new(|pid| {
                let unit = match pid {
                    77 | 4242 => "kvirt-vm@default_vm1.service",
                    999 => "kvirt-vm@default_other.service",
                    _ => return None,
                };
                Some(Writer {
                    unit: unit.into(),
                    alive: Box::new(|| true),
                })
            }),
        )
    }

    fn messages(rec: &Recording) -> Vec<String> {
        rec.0
            .lock()
            .unwrap()
            .drain(..)
            .map(|e| field(&e, "MESSAGE").unwrap().to_owned())
            .collect()
    }

    /// The log as last written a minute ago.
    fn age(path: &Path) {
        let f = std::fs::File::options().append(true).open(path).unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60))
            .unwrap();
    }

    #[test]
    fn lines_before_qemu_exists_wait_for_its_pid_then_are_the_daemons() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);
        std::fs::write(&path, "LC_ALL=C /usr/bin/qemu-system-x86_64 \\\n").unwrap();
        fwd.pass();
        assert!(
            messages(&rec).is_empty(),
            "sent before QEMU's pid was known"
        );
        // QEMU never came: the daemon, which wrote them, is named.
        let daemon = layout.vm_by_id("default_vm1").daemon_pid_files()[0].clone();
        std::fs::create_dir_all(daemon.parent().unwrap()).unwrap();
        std::fs::write(&daemon, "77\n").unwrap();
        age(&path);
        fwd.pass();
        let e = rec.0.lock().unwrap()[0].clone();
        assert_eq!(field(&e, "SYSLOG_PID"), Some("77"));
        assert_eq!(field(&e, "_PID"), Some("77"), "sent as the daemon's");
    }

    /// A pid file naming another VM's QEMU, or a process that is not
    /// there: the lines are not passed off as that process's.
    #[test]
    fn a_pid_outside_the_vms_unit_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);
        let paths = layout.vm_by_id("default_vm1");
        let pid_file = paths.qemu_pid_file("default_vm1");
        std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
        std::fs::write(&pid_file, "999\n").unwrap();
        let daemon = paths.daemon_pid_files()[0].clone();
        std::fs::create_dir_all(daemon.parent().unwrap()).unwrap();
        std::fs::write(&daemon, "31337\n").unwrap();
        std::fs::write(&path, "planted\n").unwrap();
        fwd.pass();
        assert!(messages(&rec).is_empty(), "999 is another VM's QEMU");
        age(&path);
        fwd.pass();
        let e = rec.0.lock().unwrap()[0].clone();
        assert_eq!(field(&e, "_PID"), None);
        assert_eq!(field(&e, "SYSLOG_PID"), None);
        assert_eq!(field(&e, "SYSLOG_IDENTIFIER"), Some("kvirtd"));
        assert_eq!(field(&e, "MESSAGE"), Some("default/vm1: QEMU log: planted"));
        assert_eq!(
            field(&e, "OBJECT_SYSTEMD_UNIT"),
            Some("kvirt-vm@default_vm1.service")
        );
    }

    #[test]
    fn a_process_unit_is_the_first_cgroup_below_the_slices() {
        let unit = |p| unit_in_cgroup(p);
        assert_eq!(
            unit("/machine.slice/machine-kvirt.slice/kvirt-vm@default_a.service").as_deref(),
            Some("kvirt-vm@default_a.service")
        );
        assert_eq!(
            unit("/machine.slice/kvirt-vm@default_a.service/kvirt-vm@default_b.service").as_deref(),
            Some("kvirt-vm@default_a.service")
        );
        assert_eq!(unit("/"), None);
        assert_eq!(unit("/user.slice"), None);
        let me = pin_process(std::process::id()).map(|w| w.unit);
        assert!(me.is_none() || !me.unwrap().ends_with(".slice"));
    }

    /// QEMU exits while its lines are forwarded and its pid goes to some
    /// other process: the rest of the lines are not sent under that pid
    /// (journald would file them under whatever unit the newcomer is in).
    #[test]
    fn a_writer_gone_since_it_was_pinned_is_named_no_more() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let lines_left = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(2));
        let fwd = Forwarder::with_units(rec.clone(), layout.clone(), {
            let lines_left = lines_left.clone();
            Box::new(move |_| {
                let lines_left = lines_left.clone();
                Some(Writer {
                    unit: "kvirt-vm@default_vm1.service".into(),
                    // Alive for two lines, then gone.
                    alive: Box::new(move || {
                        use std::sync::atomic::Ordering::SeqCst;
                        lines_left
                            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                            .is_ok()
                    }),
                })
            })
        });
        let pid_file = layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1");
        std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
        std::fs::write(&pid_file, "4242\n").unwrap();
        std::fs::write(&path, "one\ntwo\nthree\nfour\n").unwrap();
        assert!(fwd.pass().is_empty());
        let sent: Vec<Option<String>> = (rec.0.lock().unwrap().iter())
            .map(|e| field(e, "_PID").map(str::to_owned))
            .collect();
        assert_eq!(sent, [Some("4242".into()), Some("4242".into()), None, None]);
    }

    /// The real pin: a process reaped is not alive, whoever has its pid.
    #[test]
    fn a_pinned_process_is_alive_until_it_exits() {
        let mut child = std::process::Command::new("sleep")
            .arg("300")
            .spawn()
            .unwrap();
        let own = crate::host::pidfd::cgroup_of(std::process::id()).unwrap();
        // Outside any unit (a container's root cgroup) there is no unit to
        // name: nothing is pinned for the journal, only for the check.
        let w = pin_process(child.id());
        assert_eq!(w.as_ref().map(|w| w.unit.clone()), unit_in_cgroup(&own));
        let pinned = crate::host::pidfd::Pinned::pin(child.id()).unwrap();
        assert!(pinned.alive());
        assert!(w.as_ref().is_none_or(|w| (w.alive)()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!pinned.alive());
        assert!(w.as_ref().is_none_or(|w| !(w.alive)()));
    }

    #[test]
    fn lines_go_once_whole_and_under_the_vm_unit() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);

        let pid_file = layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1");
        std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
        std::fs::write(&pid_file, "4242\n").unwrap();
        std::fs::write(&path, "qemu starting\nhalf a li").unwrap();
        assert!(fwd.pass().is_empty());
        let e = rec.0.lock().unwrap()[0].clone();
        assert_eq!(field(&e, "SYSLOG_PID"), Some("4242"));
        assert_eq!(field(&e, "_PID"), Some("4242"), "sent as QEMU's");
        assert_eq!(
            field(&e, "OBJECT_SYSTEMD_UNIT"),
            Some("kvirt-vm@default_vm1.service")
        );
        assert_eq!(field(&e, VM_FIELD), Some("default/vm1"));
        assert_eq!(messages(&rec), ["qemu starting"]);

        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"ne\nnext\n").unwrap();
        fwd.pass();
        assert_eq!(messages(&rec), ["half a line", "next"]);

        // A restarted forwarder continues where the last one stopped.
        let again = forwarder(&rec, &layout);
        again.pass();
        assert!(messages(&rec).is_empty());

        // The VM recreated: a new file is read from its start.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "fresh\n").unwrap();
        again.pass();
        assert_eq!(messages(&rec), ["fresh"]);

        // The VM gone: its position goes too.
        std::fs::remove_dir_all(layout.vm_by_id("default_vm1").state_dir).unwrap();
        again.pass();
        assert_eq!(
            std::fs::read_dir(layout.log_positions_dir())
                .unwrap()
                .count(),
            0
        );
    }

    /// What the VM's user can plant in its log directory: a FIFO, links to
    /// root's files and to an endless device. None of it blocks the pass,
    /// none of it is read, and the VM's real log still goes through.
    #[test]
    fn planted_fifos_and_links_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let good = log_path(&layout, "default_vm1");
        std::fs::write(&good, "real line\n").unwrap();
        let logs = good.parent().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root's secret\n").unwrap();
        nix::unistd::mkfifo(
            &logs.join("fifo.log"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        std::os::unix::fs::symlink(&secret, logs.join("link.log")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", logs.join("zero.log")).unwrap();
        // And QEMU's pid file pointing at a root file that holds a number.
        let pid_file = layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1");
        std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
        let number = dir.path().join("number");
        std::fs::write(&number, "1\n").unwrap();
        std::os::unix::fs::symlink(&number, &pid_file).unwrap();
        age(&good);

        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(fwd.pass()).unwrap());
        let errors = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the pass blocked");
        let mut refused: Vec<String> = errors
            .iter()
            .map(|e| e.path.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        refused.sort();
        assert_eq!(refused, ["fifo.log", "link.log", "zero.log"], "{errors:?}");
        let sent = rec.0.lock().unwrap().clone();
        assert_eq!(sent.len(), 1, "only the real log");
        assert_eq!(
            field(&sent[0], "MESSAGE"),
            Some("default/vm1: QEMU log: real line")
        );
        assert_eq!(
            field(&sent[0], "_PID"),
            None,
            "a linked pid file is not read"
        );
    }
}
