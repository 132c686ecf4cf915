//! Each VM's QEMU log, forwarded line by line into the journal under the
//! VM's unit. The VM runs without virtlogd (it costs more per VM than the
//! rest of kvirt's overhead), so libvirt writes QEMU's log to a file in the
//! VM's cache; kvirtd, as root, forwards it with `OBJECT_SYSTEMD_UNIT=`.
//!
//! Only the file libvirt names for the VM's domain (`<id>.log`) is read.
//! Where it was read up to (by inode) is kept in root's own directory under
//! a name kvirtd makes from the VM's id, so a restarted kvirtd continues
//! without repeating or losing lines, and nothing the VM names steers it.
//!
//! Each line is sent as a process of the VM's unit (QEMU's, else the
//! daemon's, else any process in the unit's cgroup), each pinned by a
//! pidfd: it counts against the VM's journald rate limit, never kvirtd's.
//! Only once nothing of the VM runs are its last lines sent by kvirtd, as
//! `qemu` lines of the VM's unit, and then at most [`UNNAMED_LINES`].
//!
//! The log directory is the VM's user's: everything in it is reached
//! through [`Beneath`], so a link planted there leads nowhere, a FIFO does
//! not block the forwarder, and a huge file is read a chunk at a time.

use crate::core::key::{self, VmKey};
use crate::core::layout::HostLayout;
use crate::host::beneath::Beneath;
use crate::host::journal::{Sink, VM_FIELD};
use crate::host::pidfd::{self, Pinned};
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

/// At most this much of one log per pass: a chatty VM gets its share and
/// the rest of its log waits for the next pass (a second later), so it
/// cannot hold up the others or the console caps.
const CHUNK: u64 = 256 << 10;
/// libvirt's pid file holds a number and a newline.
const MAX_PID_FILE: u64 = 32;
/// Lines kvirtd sends itself for a VM of which nothing runs any more (a
/// failed start's last words); the rest of such a log is skipped.
pub const UNNAMED_LINES: usize = 100;

/// A command line libvirt logs is one line per argument, each but the
/// last ending in `\`: sent as one journal entry (an entry per argument
/// made ~50 entries, some 25 KiB of journal, per VM started), up to this
/// many bytes.
const MAX_ENTRY: usize = 32 << 10;

/// The entries `text`'s lines make: a line, or a line ending in `\` with
/// the lines that continue it (joined by newlines, as written), bounded
/// by [`MAX_ENTRY`]. Empty lines are skipped.
fn entries(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut open = false;
    for line in text.lines().filter(|l| !l.is_empty()) {
        match out.last_mut() {
            Some(last) if open && last.len() + 1 + line.len() <= MAX_ENTRY => {
                last.push('\n');
                last.push_str(line);
            }
            _ => out.push(line.to_owned()),
        }
        open = line.ends_with('\\');
    }
    out
}

/// A process the forwarder names as a line's writer: pinned first, its
/// unit read after, and alive at each line it is named for.
pub struct Writer {
    pub unit: String,
    pub alive: Box<dyn Fn() -> bool + Send>,
}

/// The processes lines are sent as (`HostProcesses`, or a fake in tests).
pub trait Processes: Send + Sync {
    /// `pid` pinned, with the unit it runs in.
    fn pin(&self, pid: u32) -> Option<Writer>;
    /// Some process of `unit`, pinned.
    fn any_of(&self, unit: &str) -> Option<(u32, Writer)>;
}

/// The host's processes; `slice` is the one VM units run in.
pub struct HostProcesses {
    pub slice: String,
}

impl Processes for HostProcesses {
    fn pin(&self, pid: u32) -> Option<Writer> {
        pin_process(pid)
    }

    fn any_of(&self, unit: &str) -> Option<(u32, Writer)> {
        let cgroup = format!("{}/{unit}", slice_cgroup(&self.slice));
        pidfd::pids_of(&cgroup)
            .into_iter()
            .find_map(|pid| Some((pid, pin_process(pid).filter(|w| w.unit == unit)?)))
    }
}

/// What one pass did.
#[derive(Debug, Default)]
pub struct Pass {
    pub errors: Vec<QemuLogError>,
    /// Lines are left (waiting for QEMU's pid, or past a VM's share):
    /// pass again in a second, whether or not a log changes.
    pub pending: bool,
}

pub struct Forwarder<K: Sink, P: Processes = HostProcesses> {
    sink: K,
    layout: HostLayout,
    processes: P,
    /// Each VM's last error, told once: a FIFO a VM planted for its log
    /// fails every pass, and must not fill kvirtd's own log.
    told: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl<K: Sink> Forwarder<K> {
    pub fn new(sink: K, layout: HostLayout, slice: &str) -> Self {
        let slice = slice.to_owned();
        Self::with_processes(sink, layout, HostProcesses { slice })
    }
}

/// How one VM's log stands after a pass.
enum Left {
    Nothing,
    More,
}

impl<K: Sink, P: Processes> Forwarder<K, P> {
    pub fn with_processes(sink: K, layout: HostLayout, processes: P) -> Self {
        Self {
            sink,
            layout,
            processes,
            told: Default::default(),
        }
    }

    /// One pass over every VM's log; errors are per VM, the rest go on.
    pub fn pass(&self) -> Pass {
        let mut pass = Pass::default();
        let mut kept = Vec::new();
        for entry in std::fs::read_dir(self.layout.vms_state_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            let id = entry.file_name().to_string_lossy().into_owned();
            kept.push(position_name(&id));
            let paths = self.layout.vm_by_id(&id);
            // No log directory yet (or not one of ours): nothing to forward.
            let log_dir = paths.qemu_log_dir();
            let below = log_dir.strip_prefix(&paths.state_dir).unwrap_or(&log_dir);
            let Ok(logs) = Beneath::open(&paths.state_dir).and_then(|d| d.dir(below)) else {
                continue;
            };
            let result = self.forward(&id, &logs);
            let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
            match result {
                Ok(left) => {
                    pass.pending |= matches!(left, Left::More);
                    told.remove(&id);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    if told.insert(id.clone(), source.to_string()).as_ref()
                        != Some(&source.to_string())
                    {
                        pass.errors.push(QemuLogError {
                            path: logs.path().join(format!("{id}.log")),
                            source,
                        });
                    }
                }
            }
        }
        // Positions of VMs that are gone.
        for entry in std::fs::read_dir(self.layout.log_positions_dir())
            .into_iter()
            .flatten()
            .flatten()
        {
            if !kept
                .iter()
                .any(|k| *k == entry.file_name().to_string_lossy())
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        pass
    }

    fn forward(&self, id: &str, logs: &Beneath) -> io::Result<Left> {
        let pos_file = self.layout.log_positions_dir().join(position_name(id));
        let mut file = logs.file(format!("{id}.log"), OFlag::O_RDONLY)?;
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
            return Ok(Left::Nothing);
        }
        file.seek(SeekFrom::Start(offset))?;
        let mut buf = Vec::new();
        file.take(CHUNK).read_to_end(&mut buf)?;
        // Only whole lines; the rest waits for its newline (unless a line
        // is longer than a whole chunk).
        let upto = match buf.iter().rposition(|b| *b == b'\n') {
            Some(i) => i + 1,
            None if buf.len() as u64 == CHUNK => buf.len(),
            None => return Ok(Left::Nothing),
        };
        let Some(writer) = self.writer(id, &meta) else {
            // QEMU's pid file is not there yet: in a second.
            return Ok(Left::More);
        };
        self.send_lines(id, &buf[..upto], writer)?;
        std::fs::create_dir_all(self.layout.log_positions_dir())?;
        let tmp = pos_file.with_extension("tmp");
        let read_to = offset + upto as u64;
        std::fs::write(&tmp, format!("{} {read_to}\n", meta.ino()))?;
        std::fs::rename(&tmp, &pos_file)?;
        Ok(if read_to < meta.len() {
            Left::More
        } else {
            Left::Nothing
        })
    }

    /// Who the lines are sent as. QEMU's lines are QEMU's in the journal
    /// (`qemu[<its pid>]`, its unit). Before QEMU exists libvirt writes its
    /// command line here: those lines wait for QEMU's pid file a little
    /// (`None`); when there is none (QEMU did not start, or has gone) they
    /// are the daemon's, which wrote them, or any process's of the unit.
    /// A pid is taken only of a process in the VM's own unit: the pid
    /// files are the VM's, and could name anyone.
    fn writer(&self, id: &str, meta: &std::fs::Metadata) -> Option<Option<(u32, Writer)>> {
        let unit = key::unit_name_of(id);
        let paths = self.layout.vm_by_id(id);
        let ours = |pid: u32| {
            let w = self.processes.pin(pid).filter(|w| w.unit == unit)?;
            Some((pid, w))
        };
        if let Some(w) = first_pid(&paths, &[paths.qemu_pid_file(id)]).and_then(ours) {
            return Some(Some(w));
        }
        if written_within(meta, QEMU_PID_WAIT) {
            return None;
        }
        let daemon = first_pid(&paths, &paths.daemon_pid_files()).and_then(ours);
        Some(daemon.or_else(|| self.processes.any_of(&unit)))
    }

    fn send_lines(
        &self,
        id: &str,
        text: &[u8],
        mut writer: Option<(u32, Writer)>,
    ) -> io::Result<()> {
        let unit = key::unit_name_of(id);
        let vm = VmKey::parse(id).map_or_else(|_| id.to_owned(), |k| k.to_string());
        let fields = [
            ("PRIORITY", "6"),
            ("OBJECT_SYSTEMD_UNIT", unit.as_str()),
            (VM_FIELD, vm.as_str()),
            ("SYSLOG_IDENTIFIER", "qemu"),
        ];
        let mut unnamed = 0;
        let text = String::from_utf8_lossy(text);
        let entries = entries(&text);
        let mut lines = entries.iter().map(String::as_str);
        while let Some(line) = lines.next() {
            // Gone since it was pinned (its number may be anyone's now), or
            // gone at the send: another of the unit, if any, sends it.
            let mut tries = 0;
            while let Some((pid, w)) = &writer {
                if tries < 2 && (w.alive)() {
                    let pid_text = pid.to_string();
                    let mut as_writer = fields.to_vec();
                    as_writer.extend([("SYSLOG_PID", pid_text.as_str()), ("MESSAGE", line)]);
                    match self.sink.send_as(*pid, &as_writer) {
                        Ok(()) => break,
                        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                        Err(e) => return Err(e),
                    }
                }
                tries += 1;
                writer = if tries < 2 {
                    self.processes.any_of(&unit)
                } else {
                    None
                };
            }
            if writer.is_some() {
                continue;
            }
            // Nothing of the VM runs: kvirtd sends its last words, as the
            // VM unit's `qemu` lines, up to a bound.
            if unnamed == UNNAMED_LINES {
                let skipped = 1 + lines.by_ref().count();
                let message = format!("{skipped} more lines of QEMU's log not forwarded: no process of the VM is left to send them as");
                let mut note = fields.to_vec();
                note.push(("MESSAGE", &message));
                return self.sink.send(&note);
            }
            unnamed += 1;
            let mut own = fields.to_vec();
            own.push(("MESSAGE", line));
            self.sink.send(&own)?;
        }
        Ok(())
    }
}

/// The name a VM's position file has: from its id (which may be longer
/// than a file name may be), never from anything the VM names.
fn position_name(id: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(id.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{hex}.pos")
}

/// The cgroup directory of a systemd slice: `machine-kvirt.slice` is
/// `/machine.slice/machine-kvirt.slice`.
pub fn slice_cgroup(slice: &str) -> String {
    let name = slice.strip_suffix(".slice").unwrap_or(slice);
    let mut path = String::new();
    for (i, _) in name.match_indices('-').chain([(name.len(), "")]) {
        path.push('/');
        path.push_str(&name[..i]);
        path.push_str(".slice");
    }
    path
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
    let pinned = Pinned::pin(pid)?;
    let unit = unit_in_cgroup(&pidfd::cgroup_of(pid)?)?;
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
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;

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

    /// Pids 77 and 4242 run in vm1's unit (or `unit`), 999 in another
    /// VM's; `extra` is what else runs in vm1's unit (found through its
    /// cgroup); each pin stays alive for `lives` lines.
    #[derive(Default)]
    struct Procs {
        unit: Option<String>,
        extra: Option<u32>,
        lives: Option<Arc<AtomicUsize>>,
    }

    impl Procs {
        fn writer(&self, unit: &str) -> Writer {
            let lives = self.lives.clone();
            Writer {
                unit: unit.into(),
                alive: Box::new(move || {
                    lives.as_ref().is_none_or(|l| {
                        l.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok()
                    })
                }),
            }
        }
    }

    const VM1: &str = "kvirt-vm@default_vm1.service";

    impl Processes for Procs {
        fn pin(&self, pid: u32) -> Option<Writer> {
            match pid {
                77 | 4242 => Some(self.writer(self.unit.as_deref().unwrap_or(VM1))),
                999 => Some(self.writer("kvirt-vm@default_other.service")),
                p if Some(p) == self.extra => Some(self.writer(VM1)),
                _ => None,
            }
        }

        fn any_of(&self, unit: &str) -> Option<(u32, Writer)> {
            let pid = self.extra.filter(|_| unit == VM1)?;
            Some((pid, self.writer(unit)))
        }
    }

    fn forwarder(rec: &Recording, layout: &HostLayout) -> Forwarder<Recording, Procs> {
        with(rec, layout, Procs::default())
    }

    fn with(rec: &Recording, layout: &HostLayout, p: Procs) -> Forwarder<Recording, Procs> {
        Forwarder::with_processes(rec.clone(), layout.clone(), p)
    }

    fn messages(rec: &Recording) -> Vec<String> {
        rec.0
            .lock()
            .unwrap()
            .drain(..)
            .map(|e| field(&e, "MESSAGE").unwrap().to_owned())
            .collect()
    }

    fn pids(rec: &Recording) -> Vec<Option<String>> {
        (rec.0.lock().unwrap().iter())
            .map(|e| field(e, "_PID").map(str::to_owned))
            .collect()
    }

    /// The log as last written a minute ago.
    fn age(path: &Path) {
        let f = std::fs::File::options().append(true).open(path).unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60))
            .unwrap();
    }

    fn write_pid(file: &Path, pid: &str) {
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(file, format!("{pid}\n")).unwrap();
    }

    #[test]
    fn lines_before_qemu_exists_wait_for_its_pid_then_are_the_daemons() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);
        std::fs::write(&path, "LC_ALL=C /usr/bin/qemu-system-x86_64 \\\n").unwrap();
        let pass = fwd.pass();
        assert!(
            messages(&rec).is_empty(),
            "sent before QEMU's pid was known"
        );
        assert!(pass.pending, "the forwarder must look again soon");
        // QEMU never came: the daemon, which wrote them, is named.
        write_pid(&layout.vm_by_id("default_vm1").daemon_pid_files()[0], "77");
        age(&path);
        assert!(!fwd.pass().pending);
        let e = rec.0.lock().unwrap()[0].clone();
        assert_eq!(field(&e, "SYSLOG_PID"), Some("77"));
        assert_eq!(field(&e, "_PID"), Some("77"), "sent as the daemon's");
    }

    /// A pid file naming another VM's QEMU, or a process that is not
    /// there: the lines are not passed off as that process's. They go as
    /// another process of the VM's unit; with none left, kvirtd sends
    /// them as the unit's `qemu` lines, never as its own.
    #[test]
    fn a_pid_outside_the_vms_unit_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let paths = layout.vm_by_id("default_vm1");
        write_pid(&paths.qemu_pid_file("default_vm1"), "999");
        write_pid(&paths.daemon_pid_files()[0], "31337");
        std::fs::write(&path, "planted\n").unwrap();
        let rec = Recording::default();
        forwarder(&rec, &layout).pass();
        assert!(messages(&rec).is_empty(), "999 is another VM's QEMU");
        age(&path);
        let in_unit = Procs {
            extra: Some(5),
            ..Default::default()
        };
        with(&rec, &layout, in_unit).pass();
        assert_eq!(pids(&rec), [Some("5".to_owned())], "a process of the unit");

        let mut f = std::fs::File::options().append(true).open(&path).unwrap();
        f.write_all(b"once more\n").unwrap();
        age(&path);
        forwarder(&rec, &layout).pass();
        let e = rec.0.lock().unwrap()[1].clone();
        assert_eq!(field(&e, "_PID"), None);
        assert_eq!(field(&e, "SYSLOG_PID"), None);
        assert_eq!(field(&e, "SYSLOG_IDENTIFIER"), Some("qemu"));
        assert_eq!(field(&e, "MESSAGE"), Some("once more"));
        assert_eq!(field(&e, VM_FIELD), Some("default/vm1"));
        assert_eq!(field(&e, "OBJECT_SYSTEMD_UNIT"), Some(VM1));
    }

    /// Lines of a VM of which nothing runs are kvirtd's to send: a bounded
    /// number, then one line saying how many more there were.
    #[test]
    fn lines_no_process_can_send_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let text: String = (0..UNNAMED_LINES + 50)
            .map(|i| format!("line {i}\n"))
            .collect();
        std::fs::write(&path, text).unwrap();
        age(&path);
        let rec = Recording::default();
        forwarder(&rec, &layout).pass();
        let sent = messages(&rec);
        assert_eq!(sent.len(), UNNAMED_LINES + 1);
        assert!(sent[UNNAMED_LINES].starts_with("50 more lines"), "{sent:?}");
        forwarder(&rec, &layout).pass();
        assert!(messages(&rec).is_empty(), "skipped lines come back");
    }

    #[test]
    fn a_process_unit_is_the_first_cgroup_below_the_slices() {
        let unit = |p| unit_in_cgroup(p);
        assert_eq!(
            unit("/machine.slice/machine-kvirt.slice/kvirt-vm@default_a.service").as_deref(),
            Some("kvirt-vm@default_a.service")
        );
        assert_eq!(
            unit("/machine.slice/machine-kvirt.slice/kvirt-vm@default_a.service/sub/x.scope")
                .as_deref(),
            Some("kvirt-vm@default_a.service")
        );
        assert_eq!(unit("/"), None);
        assert_eq!(unit("/user.slice"), None);
        let me = pin_process(std::process::id()).map(|w| w.unit);
        assert!(me.is_none() || !me.unwrap().ends_with(".slice"));
        assert_eq!(
            slice_cgroup("machine-kvirt.slice"),
            "/machine.slice/machine-kvirt.slice"
        );
        assert_eq!(slice_cgroup("kvirt.slice"), "/kvirt.slice");
        assert_eq!(
            slice_cgroup("a-b-c.slice"),
            "/a.slice/a-b.slice/a-b-c.slice"
        );
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
        let two_lines = Procs {
            lives: Some(Arc::new(AtomicUsize::new(2))),
            ..Default::default()
        };
        let fwd = with(&rec, &layout, two_lines);
        write_pid(
            &layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1"),
            "4242",
        );
        std::fs::write(&path, "one\ntwo\nthree\nfour\n").unwrap();
        assert!(fwd.pass().errors.is_empty());
        let some = |p: &str| Some(p.to_owned());
        assert_eq!(pids(&rec), [some("4242"), some("4242"), None, None]);
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
        let pinned = Pinned::pin(child.id()).unwrap();
        assert!(pinned.alive());
        assert!(w.as_ref().is_none_or(|w| (w.alive)()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!pinned.alive());
        assert!(w.as_ref().is_none_or(|w| !(w.alive)()));
    }

    /// libvirt's command line (an argument per line, continued by `\`)
    /// is one entry; other lines one each; a huge one is bounded.
    #[test]
    fn a_continued_command_line_is_one_entry() {
        let text = "2026-12-06 starting up\nLC_ALL=C \\\n/usr/bin/qemu \\\n-name x \\\n-S\nnext\n\nlast \\\n";
        assert_eq!(
            entries(text),
            [
                "2026-12-06 starting up",
                "LC_ALL=C \\\n/usr/bin/qemu \\\n-name x \\\n-S",
                "next",
                "last \\",
            ]
        );
        let arg = format!("{} \\", "a".repeat(1000));
        let long = vec![arg.as_str(); 100].join("\n");
        let split = entries(&long);
        assert!(split.len() > 1 && split.iter().all(|e| e.len() <= MAX_ENTRY));
        assert_eq!(
            split.concat().len() + split.len() - 1,
            long.len(),
            "nothing lost"
        );
    }

    #[test]
    fn lines_go_once_whole_and_under_the_vm_unit() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let path = log_path(&layout, "default_vm1");
        let rec = Recording::default();
        let fwd = forwarder(&rec, &layout);

        write_pid(
            &layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1"),
            "4242",
        );
        std::fs::write(&path, "qemu starting\nhalf a li").unwrap();
        assert!(fwd.pass().errors.is_empty());
        let e = rec.0.lock().unwrap()[0].clone();
        assert_eq!(field(&e, "SYSLOG_PID"), Some("4242"));
        assert_eq!(field(&e, "_PID"), Some("4242"), "sent as QEMU's");
        assert_eq!(field(&e, "SYSLOG_IDENTIFIER"), Some("qemu"));
        assert_eq!(field(&e, "OBJECT_SYSTEMD_UNIT"), Some(VM1));
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

    /// A VM's share of a pass is bounded: a log far past it goes on in the
    /// passes that follow (which `pending` asks for), each line once.
    #[test]
    fn a_long_log_goes_in_shares_and_a_long_name_keeps_its_place() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        // A name as long as a VM's directory may have: twice over (as the
        // position's name once was) it is longer than a file name may be.
        let id = format!("default_{}", "v".repeat(230));
        let path = log_path(&layout, &id);
        write_pid(&layout.vm_by_id(&id).qemu_pid_file(&id), "4242");
        let line = format!("{}\n", "x".repeat(1023));
        let lines = (3 * CHUNK as usize) / line.len();
        std::fs::write(&path, line.repeat(lines)).unwrap();
        let rec = Recording::default();
        let unit = Procs {
            unit: Some(key::unit_name_of(&id)),
            ..Default::default()
        };
        let fwd = with(&rec, &layout, unit);
        let mut passes = 0;
        loop {
            let pass = fwd.pass();
            assert!(pass.errors.is_empty(), "{:?}", pass.errors);
            passes += 1;
            if !pass.pending {
                break;
            }
            assert!(passes < 10);
        }
        assert!(passes >= 3, "{passes} passes");
        assert_eq!(messages(&rec).len(), lines);
        fwd.pass();
        assert!(messages(&rec).is_empty(), "nothing is sent twice");
    }

    /// What the VM's user can plant in its log directory: a FIFO, links to
    /// root's files and to an endless device, under any name. None of it
    /// is read, and the VM's real log still goes through; the real log
    /// itself swapped for a FIFO or a link is refused without blocking.
    #[test]
    fn planted_fifos_and_links_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let layout = host(dir.path());
        let good = log_path(&layout, "default_vm1");
        std::fs::write(&good, "real line\n").unwrap();
        let logs = good.parent().unwrap().to_owned();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "root's secret\n").unwrap();
        let fifo = |p: &Path| {
            nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap()
        };
        fifo(&logs.join("fifo.log"));
        std::os::unix::fs::symlink(&secret, logs.join("link.log")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", logs.join("zero.log")).unwrap();
        let long = format!("{}.log", "n".repeat(250));
        std::fs::write(logs.join(long), "not libvirt's\n").unwrap();
        // And QEMU's pid file pointing at a root file that holds a number.
        let pid_file = layout.vm_by_id("default_vm1").qemu_pid_file("default_vm1");
        std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
        let number = dir.path().join("number");
        std::fs::write(&number, "1\n").unwrap();
        std::os::unix::fs::symlink(&number, &pid_file).unwrap();
        age(&good);

        let rec = Recording::default();
        let in_time = |layout: &HostLayout, rec: &Recording| {
            let fwd = forwarder(rec, layout);
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || tx.send(fwd.pass()).unwrap());
            rx.recv_timeout(std::time::Duration::from_secs(10))
                .expect("the pass blocked")
        };
        let pass = in_time(&layout, &rec);
        assert!(pass.errors.is_empty(), "{:?}", pass.errors);
        let sent = rec.0.lock().unwrap().clone();
        assert_eq!(sent.len(), 1, "only the real log");
        assert_eq!(field(&sent[0], "MESSAGE"), Some("real line"));
        assert_eq!(
            field(&sent[0], "_PID"),
            None,
            "a linked pid file is not read"
        );

        for swap in ["fifo", "link"] {
            std::fs::remove_file(&good).unwrap();
            match swap {
                "fifo" => fifo(&good),
                _ => std::os::unix::fs::symlink(&secret, &good).unwrap(),
            }
            let pass = in_time(&layout, &rec);
            assert_eq!(pass.errors.len(), 1, "{swap}: {:?}", pass.errors);
            assert_eq!(rec.0.lock().unwrap().len(), 1, "{swap} read");
        }
        // Told once, not at every pass: kvirtd's own log is not the VM's
        // to fill.
        let fwd = forwarder(&rec, &layout);
        assert_eq!(fwd.pass().errors.len(), 1);
        assert!(fwd.pass().errors.is_empty());
    }
}
