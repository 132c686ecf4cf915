//! The journal: kvirtd's own log lines, and each VM's QEMU log, with the
//! fields that let `journalctl -u kvirt-vm@<id>` and `KVIRT_VM=<ns>/<name>`
//! find every line about a VM.
//!
//! journald attributes `OBJECT_SYSTEMD_UNIT=` sent by a root process to that
//! unit (`journalctl -u` matches it), the way systemd's own messages about a
//! unit carry `UNIT=`.

use crate::core::key::{self, VmKey};
use std::fmt::Write as _;
use std::io;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

pub const SOCKET: &str = "/run/systemd/journal/socket";
/// The field naming the VM a line is about, as `<namespace>/<name>`.
pub const VM_FIELD: &str = "KVIRT_VM";

/// The span every line about one VM runs in: its `<ns>/<name>` and unit
/// become `KVIRT_VM=` and `OBJECT_SYSTEMD_UNIT=`.
pub fn vm_span(id: &str, key: Option<&VmKey>) -> tracing::Span {
    let vm = key
        .map(VmKey::to_string)
        .or_else(|| VmKey::parse(id).ok().map(|k| k.to_string()))
        .unwrap_or_else(|| id.to_owned());
    tracing::info_span!("vm", vm = %vm, unit = %key::unit_name_of(id))
}

/// Where journal entries go: the socket, or a recording in tests.
pub trait Sink: Send + Sync {
    fn send(&self, fields: &[(&str, &str)]) -> io::Result<()>;

    /// An entry as process `pid`'s: journald takes `_PID=` (what
    /// `journalctl` shows as `name[pid]`), `_COMM=` and `_SYSTEMD_UNIT=`
    /// from it rather than from kvirtd. Only root may say so, and only of a
    /// process that exists (ESRCH otherwise).
    fn send_as(&self, pid: u32, fields: &[(&str, &str)]) -> io::Result<()>;
}

pub struct Journal {
    socket: UnixDatagram,
}

impl Journal {
    pub fn connect() -> io::Result<Self> {
        Self::connect_to(Path::new(SOCKET))
    }

    pub fn connect_to(path: &Path) -> io::Result<Self> {
        let socket = UnixDatagram::unbound()?;
        socket.connect(path)?;
        Ok(Self { socket })
    }

    /// Whether stderr is the journal (systemd sets `JOURNAL_STREAM` to its
    /// device and inode): only then do kvirtd's lines go there natively.
    pub fn stderr_is_journal() -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(stream) = std::env::var("JOURNAL_STREAM") else {
            return false;
        };
        let Ok(meta) = std::fs::metadata("/proc/self/fd/2") else {
            return false;
        };
        stream == format!("{}:{}", meta.dev(), meta.ino())
    }
}

/// journald's native protocol: `NAME=value\n`, or for a value with a
/// newline `NAME\n`, its length as 64-bit little endian, the value, `\n`.
pub fn encode(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut buf = Vec::new();
    for (name, value) in fields {
        buf.extend_from_slice(name.as_bytes());
        if value.contains('\n') {
            buf.push(b'\n');
            buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
        } else {
            buf.push(b'=');
        }
        buf.extend_from_slice(value.as_bytes());
        buf.push(b'\n');
    }
    buf
}

/// journald drops datagrams above its buffer size; lines this long are
/// noise anyway.
const MAX_VALUE: usize = 48 * 1024;

fn encode_cut(fields: &[(&str, &str)]) -> Vec<u8> {
    let cut: Vec<(&str, &str)> = fields
        .iter()
        .map(|(n, v)| (*n, truncate(v, MAX_VALUE)))
        .collect();
    encode(&cut)
}

impl Sink for Journal {
    fn send(&self, fields: &[(&str, &str)]) -> io::Result<()> {
        self.socket.send(&encode_cut(fields)).map(drop)
    }

    fn send_as(&self, pid: u32, fields: &[(&str, &str)]) -> io::Result<()> {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixCredentials};
        use std::os::fd::AsRawFd;
        let buf = encode_cut(fields);
        let creds = UnixCredentials::from(libc::ucred {
            pid: pid as libc::pid_t,
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        });
        let iov = [io::IoSlice::new(&buf)];
        sendmsg::<()>(
            self.socket.as_raw_fd(),
            &iov,
            &[ControlMessage::ScmCredentials(&creds)],
            MsgFlags::empty(),
            None,
        )
        .map(drop)
        .map_err(io::Error::from)
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn priority(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "3",
        Level::WARN => "4",
        Level::INFO => "6",
        Level::DEBUG | Level::TRACE => "7",
    }
}

/// The VM a span is about, from its `vm` and `unit` fields.
#[derive(Clone, Debug, Default)]
struct VmFields {
    vm: Option<String>,
    unit: Option<String>,
}

impl Visit for VmFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "vm" => self.vm = Some(format!("{value:?}")),
            "unit" => self.unit = Some(format!("{value:?}")),
            _ => {}
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "vm" => self.vm = Some(value.into()),
            "unit" => self.unit = Some(value.into()),
            _ => {}
        }
    }
}

/// An event's message and its other fields, as `key=value` text.
#[derive(Default)]
struct Text {
    message: String,
    rest: String,
}

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.rest, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.rest, " {}={value}", field.name());
        }
    }
}

/// A tracing layer writing kvirtd's events to the journal. Lines inside a
/// VM's span read `<ns>/<name>: message` and carry `KVIRT_VM=` and
/// `OBJECT_SYSTEMD_UNIT=`.
pub struct Layer<K: Sink> {
    sink: K,
}

impl<K: Sink> Layer<K> {
    pub fn new(sink: K) -> Self {
        Self { sink }
    }
}

impl<S, K> tracing_subscriber::Layer<S> for Layer<K>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    K: Sink + 'static,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut fields = VmFields::default();
        attrs.record(&mut fields);
        if fields.vm.is_some() {
            if let Some(span) = ctx.span(id) {
                span.extensions_mut().insert(fields);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut text = Text::default();
        event.record(&mut text);
        let vm = ctx.event_scope(event).and_then(|scope| {
            scope
                .from_root()
                .filter_map(|s| s.extensions().get::<VmFields>().cloned())
                .last()
        });
        let meta = event.metadata();
        let message = match vm.as_ref().and_then(|v| v.vm.as_deref()) {
            Some(name) => format!("{name}: {}{}", text.message, text.rest),
            None => format!("{}{}", text.message, text.rest),
        };
        let mut fields = vec![
            ("PRIORITY", priority(meta.level())),
            ("SYSLOG_IDENTIFIER", "kvirtd"),
            ("TARGET", meta.target()),
            ("MESSAGE", message.as_str()),
        ];
        if let Some(v) = &vm {
            if let Some(name) = &v.vm {
                fields.push((VM_FIELD, name));
            }
            if let Some(unit) = &v.unit {
                fields.push(("OBJECT_SYSTEMD_UNIT", unit));
            }
        }
        // Nowhere to report a failure to log to.
        let _ = self.sink.send(&fields);
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    pub type Entry = Vec<(String, String)>;

    /// Records every entry as owned fields.
    #[derive(Clone, Default)]
    pub struct Recording(pub Arc<Mutex<Vec<Entry>>>);

    impl Sink for Recording {
        fn send(&self, fields: &[(&str, &str)]) -> io::Result<()> {
            self.0.lock().unwrap().push(
                fields
                    .iter()
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .collect(),
            );
            Ok(())
        }

        /// Recorded with the `_PID=` journald would give it.
        fn send_as(&self, pid: u32, fields: &[(&str, &str)]) -> io::Result<()> {
            let pid = pid.to_string();
            let mut all = fields.to_vec();
            all.push(("_PID", &pid));
            self.send(&all)
        }
    }

    pub fn field<'a>(entry: &'a [(String, String)], name: &str) -> Option<&'a str> {
        entry
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn the_native_protocol_frames_multiline_values() {
        assert_eq!(encode(&[("A", "b"), ("C", "")]), b"A=b\nC=\n");
        let mut want = b"M\n".to_vec();
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(b"x\ny\n");
        assert_eq!(encode(&[("M", "x\ny")]), want);
        assert_eq!(truncate("héllo", 2), "h");
    }

    #[test]
    fn lines_about_a_vm_name_it_and_its_unit() {
        let rec = Recording::default();
        let subscriber = tracing_subscriber::registry().with(Layer::new(rec.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!("starting");
            let span = tracing::info_span!(
                "vm",
                vm = "default/vm1",
                unit = "kvirt-vm@default_vm1.service"
            );
            let _g = span.enter();
            tracing::warn!(steps = 3, "acting");
        });
        let entries = rec.0.lock().unwrap();
        assert_eq!(field(&entries[0], "MESSAGE"), Some("starting"));
        assert_eq!(field(&entries[0], VM_FIELD), None);
        assert_eq!(field(&entries[0], "PRIORITY"), Some("6"));
        let e = &entries[1];
        assert_eq!(field(e, "MESSAGE"), Some("default/vm1: acting steps=3"));
        assert_eq!(field(e, VM_FIELD), Some("default/vm1"));
        assert_eq!(
            field(e, "OBJECT_SYSTEMD_UNIT"),
            Some("kvirt-vm@default_vm1.service")
        );
        assert_eq!(field(e, "PRIORITY"), Some("4"));
        assert_eq!(field(e, "SYSLOG_IDENTIFIER"), Some("kvirtd"));
    }

    #[test]
    fn a_vm_known_only_by_its_id_is_named_the_same_way() {
        let rec = Recording::default();
        let subscriber = tracing_subscriber::registry().with(Layer::new(rec.clone()));
        tracing::subscriber::with_default(subscriber, || {
            vm_span("default_vm1", None).in_scope(|| tracing::warn!("reconcile failed"));
        });
        let entries = rec.0.lock().unwrap();
        assert_eq!(field(&entries[0], VM_FIELD), Some("default/vm1"));
        assert_eq!(
            field(&entries[0], "OBJECT_SYSTEMD_UNIT"),
            Some("kvirt-vm@default_vm1.service")
        );
        assert_eq!(
            field(&entries[0], "MESSAGE"),
            Some("default/vm1: reconcile failed")
        );
    }

    #[test]
    fn a_datagram_reaches_a_listening_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("socket");
        let server = UnixDatagram::bind(&path).unwrap();
        let j = Journal::connect_to(&path).unwrap();
        j.send(&[("MESSAGE", "hi")]).unwrap();
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"MESSAGE=hi\n");
    }

    /// What journald reads as `_PID=`: the credentials sent, which name
    /// another process (root may), and fail for one that is not there.
    #[test]
    fn an_entry_sent_as_another_process_carries_its_credentials() {
        use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags};
        use std::os::fd::AsRawFd;
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("socket");
        let server = UnixDatagram::bind(&path).unwrap();
        setsockopt(&server, sockopt::PassCred, &true).unwrap();
        let j = Journal::connect_to(&path).unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        j.send_as(child.id(), &[("MESSAGE", "hi")]).unwrap();
        let mut buf = [0u8; 64];
        let mut cmsg = nix::cmsg_space!(libc::ucred);
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            server.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::empty(),
        )
        .unwrap();
        let pid = msg.cmsgs().unwrap().find_map(|c| match c {
            ControlMessageOwned::ScmCredentials(c) => Some(c.pid()),
            _ => None,
        });
        assert_eq!(pid, Some(child.id() as libc::pid_t));
        child.kill().unwrap();
        child.wait().unwrap();
        let gone = j.send_as(child.id(), &[("MESSAGE", "late")]).unwrap_err();
        assert_eq!(gone.raw_os_error(), Some(libc::ESRCH));
    }
}
