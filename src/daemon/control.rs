//! kvirtd's control socket: `kvirtctl start|stop|restart` of standalone
//! VirtualMachines, `pause|unpause|soft-reboot` of running VMIs, `migrate`
//! of a standalone VMI to another kvirtd, `drain` and `uncordon` of the
//! host. One JSON request line, one JSON
//! answer line. Only root,
//! or the members of a configured group, may connect: the socket's mode
//! says so and each peer's credentials are checked again.

use crate::core::key::VmKey;
use crate::core::vm::Verb;
use crate::daemon::controller::{VmiAction, VmiView};
use crate::daemon::drain;
use crate::daemon::migration::Migrate;
use crate::daemon::vms::Input;
use serde::{Deserialize, Serialize};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::{info, warn};

/// A request is a name and a few flags: far below this.
const MAX_REQUEST: u64 = 4096;
const DEADLINE: Duration = Duration::from_secs(10);
/// A migration's answer comes when it ended: the longest one allowed,
/// and the target's preparation before it.
pub const MIGRATE_DEADLINE: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    /// `start`, `stop`, `restart` (a VirtualMachine), `pause`, `unpause`
    /// or `soft-reboot` (its VMI, or a VMI), `migrate` (a VMI); `drain`
    /// or `uncordon` (the host).
    pub action: String,
    /// NAMESPACE/NAME; empty for the host's actions.
    #[serde(default)]
    pub vm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace: Option<u64>,
    /// `start --paused`; `restart --force`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
    /// `migrate --to`: the target kvirtd's migration port (ADDRESS:PORT).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// `migrate --bandwidth`: the most the migration may use, MiB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Answer {
    pub ok: bool,
    pub message: String,
}

/// What a request asks, and of whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Vm(Verb),
    Vmi(VmiAction),
    Migrate {
        to: std::net::SocketAddr,
        bandwidth: Option<u64>,
    },
}

impl Request {
    fn parse(&self) -> Result<(VmKey, Command), String> {
        let (ns, name) = self
            .vm
            .split_once('/')
            .ok_or_else(|| format!("{:?}: expected NAMESPACE/NAME", self.vm))?;
        let key = VmKey::new(ns, name).map_err(|e| e.to_string())?;
        let command = match self.action.as_str() {
            "start" => Command::Vm(Verb::Start {
                paused: self.paused,
            }),
            "stop" => Command::Vm(Verb::Stop { grace: self.grace }),
            "restart" => Command::Vm(Verb::Restart { force: self.force }),
            "pause" => Command::Vmi(VmiAction::Pause),
            "unpause" => Command::Vmi(VmiAction::Unpause),
            "soft-reboot" => Command::Vmi(VmiAction::SoftReboot),
            "migrate" => {
                let to = self
                    .to
                    .as_deref()
                    .ok_or("migrate: --to ADDRESS:PORT is missing")?;
                Command::Migrate {
                    to: to
                        .parse()
                        .map_err(|e| format!("--to {to:?}: not ADDRESS:PORT: {e}"))?,
                    bandwidth: self.bandwidth,
                }
            }
            other => return Err(format!("unknown action {other:?}")),
        };
        Ok((key, command))
    }
}

/// Binds the socket with its mode already set (made under a temporary
/// name, then moved into place), `0600` root's or `0660` with `group`.
pub fn bind(path: &Path, group: Option<u32>) -> std::io::Result<UnixListener> {
    let tmp = path.with_extension("sock.tmp");
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp)?;
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    if let Some(gid) = group {
        nix::unistd::chown(&tmp, None, Some(nix::unistd::Gid::from_raw(gid)))?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(listener)
}

/// Serves requests until the VM loop goes away, one task per connection.
pub async fn serve(
    listener: UnixListener,
    group: Option<u32>,
    to: UnboundedSender<Input>,
    view: Arc<dyn VmiView>,
    migrate: Option<Arc<dyn Migrate>>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                warn!("control socket: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if to.is_closed() {
            return;
        }
        let (to, view, migrate) = (to.clone(), view.clone(), migrate.clone());
        tokio::spawn(async move {
            let ctx = Ctx { to, view, migrate };
            if let Err(e) = tokio::time::timeout(MIGRATE_DEADLINE, one(stream, group, ctx)).await {
                warn!("control socket: a client took too long: {e}");
            }
        });
    }
}

/// What the requests act on.
struct Ctx {
    to: UnboundedSender<Input>,
    view: Arc<dyn VmiView>,
    migrate: Option<Arc<dyn Migrate>>,
}

async fn one(stream: UnixStream, group: Option<u32>, ctx: Ctx) {
    let allowed = stream
        .peer_cred()
        .map(|c| c.uid() == 0 || group.is_some_and(|g| c.gid() == g || in_group(c.pid(), g)))
        .unwrap_or(false);
    let (read, mut write) = stream.into_split();
    let answer = if !allowed {
        Answer {
            ok: false,
            message:
                "permission denied: only root or the control group may use kvirtd's control socket"
                    .into(),
        }
    } else {
        let mut line = String::new();
        let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(read, MAX_REQUEST));
        match tokio::time::timeout(DEADLINE, reader.read_line(&mut line)).await {
            Ok(Ok(_)) => answer(&line, &ctx).await,
            Ok(Err(e)) => Answer {
                ok: false,
                message: format!("reading the request: {e}"),
            },
            Err(_) => Answer {
                ok: false,
                message: "no request line within 10 s".into(),
            },
        }
    };
    let mut out = serde_json::to_vec(&answer).expect("an answer serializes");
    out.push(b'\n');
    let _ = write.write_all(&out).await;
}

async fn answer(line: &str, ctx: &Ctx) -> Answer {
    let request = match serde_json::from_str::<Request>(line.trim()) {
        Ok(r) => r,
        Err(e) => {
            return Answer {
                ok: false,
                message: format!("bad request: {e}"),
            }
        }
    };
    if let Some(a) = host_answer(&request, ctx).await {
        return a;
    }
    let parsed = request.parse();
    let done = |r: Result<String, String>| match r {
        Ok(message) => Answer { ok: true, message },
        Err(message) => Answer { ok: false, message },
    };
    let (key, verb) = match parsed {
        Ok((key, Command::Vm(verb))) => (key, verb),
        Ok((key, Command::Vmi(action))) => {
            let r = tokio::time::timeout(DEADLINE, ctx.view.act(&key.id(), action)).await;
            return done(r.unwrap_or_else(|_| Err("no answer within 10 s".into())));
        }
        Ok((key, Command::Migrate { to, bandwidth })) => {
            return done(match &ctx.migrate {
                Some(m) => m.migrate(key, to, bandwidth).await,
                None => Err(NO_MIGRATIONS.into()),
            })
        }
        Err(message) => return Answer { ok: false, message },
    };
    let to = &ctx.to;
    let (reply, rx) = oneshot::channel();
    if to
        .send(Input::Command {
            key: key.clone(),
            verb,
            reply,
        })
        .is_err()
    {
        return Answer {
            ok: false,
            message: "kvirtd is shutting down".into(),
        };
    }
    match tokio::time::timeout(DEADLINE, rx)
        .await
        .unwrap_or(Ok(Err("no answer within 10 s".into())))
    {
        Ok(Ok(message)) => {
            info!(vm = %key, ?verb, "control socket: {message}");
            Answer { ok: true, message }
        }
        Ok(Err(message)) => Answer { ok: false, message },
        Err(_) => Answer {
            ok: false,
            message: "kvirtd dropped the request".into(),
        },
    }
}

/// `drain` and `uncordon`, of the host rather than a VM; `None`: not one.
async fn host_answer(r: &Request, ctx: &Ctx) -> Option<Answer> {
    if !matches!(r.action.as_str(), "drain" | "uncordon") {
        return None;
    }
    let Some(m) = &ctx.migrate else {
        return Some(Answer {
            ok: false,
            message: NO_MIGRATIONS.into(),
        });
    };
    let result = if r.action == "uncordon" {
        m.cordon(false).map(|()| Answer {
            ok: true,
            message: "uncordoned: this host takes VMs arriving again".into(),
        })
    } else {
        async {
            let to =
                r.to.as_deref()
                    .ok_or("drain: --to ADDRESS:PORT is missing")?;
            let to = to
                .parse()
                .map_err(|e| format!("--to {to:?}: not ADDRESS:PORT: {e}"))?;
            let d = drain::drain(m.as_ref(), &ctx.to, to, r.bandwidth).await?;
            Ok(Answer {
                ok: d.empty,
                message: d.lines.join("\n"),
            })
        }
        .await
    };
    Some(result.unwrap_or_else(|message: String| Answer { ok: false, message }))
}

const NO_MIGRATIONS: &str = "this kvirtd migrates no VMs: standalone kvirtds with kvirt's \
                             identity ([api] cert, key, ca) do; in a cluster, not yet";

/// Whether process `pid` has `gid` among its supplementary groups.
fn in_group(pid: Option<i32>, gid: u32) -> bool {
    let Some(pid) = pid else { return false };
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .is_some_and(|g| g.split_whitespace().any(|x| x == gid.to_string()))
}

/// The client side (kvirtctl): one request, its answer.
pub fn call(path: &Path, req: &Request) -> std::io::Result<Answer> {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path)?;
    let wait = if matches!(req.action.as_str(), "migrate" | "drain") {
        MIGRATE_DEADLINE
    } else {
        DEADLINE
    };
    s.set_read_timeout(Some(wait))?;
    let mut line = serde_json::to_vec(req).expect("a request serializes");
    line.push(b'\n');
    // A refused caller is answered at once, before its request is read:
    // its write can then fail while the answer saying why waits unread.
    match s.write_all(&line) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r?,
    }
    let mut answer = String::new();
    std::io::BufReader::new(std::io::Read::take(s, MAX_REQUEST * 4)).read_line(&mut answer)?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    /// Run by `only_root_may_use_the_control_socket` as another user: one
    /// request to the socket in `KVIRT_TEST_SOCKET`, the outcome printed.
    #[test]
    #[ignore = "run as a child process by only_root_may_use_the_control_socket"]
    fn client_as_another_user() {
        let path = std::env::var("KVIRT_TEST_SOCKET").unwrap();
        let req = Request {
            action: "stop".into(),
            vm: "default/a".into(),
            ..Default::default()
        };
        match call(Path::new(&path), &req) {
            Ok(a) => println!("ANSWER ok={} {}", a.ok, a.message),
            Err(e) => println!("ERROR {e}"),
        }
    }

    /// This test binary where another user can run it: a checkout may sit
    /// in a directory only root may enter (`/root` is 0700), so it is
    /// linked (or copied, across file systems) into a directory of its own
    /// that anyone may traverse.
    fn reachable_by_anyone() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::Builder::new()
            .prefix("kvirt-test-exe")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.path().join("test");
        let me = std::env::current_exe().unwrap();
        if std::fs::hard_link(&me, &exe).is_err() {
            std::fs::copy(&me, &exe).unwrap();
        }
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        (dir, exe)
    }

    fn as_nobody(exe: &Path, socket: &Path) -> String {
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "daemon::control::tests::client_as_another_user",
                "--ignored",
                "--nocapture",
            ])
            .env("KVIRT_TEST_SOCKET", socket)
            .uid(65534)
            .gid(65534)
            .output()
            .unwrap();
        // A child that could not even start its test says why here.
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    #[tokio::test]
    async fn only_root_may_use_the_control_socket() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = dir.path().join("control.sock");
        let listener = bind(&path, None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(serve(listener, None, tx, Arc::new(NoVmis), None));
        // The VM loop's part: every request answered "done".
        tokio::spawn(async move {
            while let Some(Input::Command { reply, .. }) = rx.recv().await {
                let _ = reply.send(Ok("done".into()));
            }
        });
        let p = path.clone();
        let root = tokio::task::spawn_blocking(move || {
            call(
                &p,
                &Request {
                    action: "restart".into(),
                    vm: "default/a".into(),
                    ..Default::default()
                },
            )
        })
        .await
        .unwrap()
        .unwrap();
        assert!(root.ok, "{root:?}");

        // Another user: the socket's mode keeps it out...
        let (_exe_dir, exe) = reachable_by_anyone();
        let (p, e) = (path.clone(), exe.clone());
        let out = tokio::task::spawn_blocking(move || as_nobody(&e, &p))
            .await
            .unwrap();
        assert!(
            out.contains("ERROR") && out.contains("ermission denied"),
            "{out}"
        );
        // ...and were the mode wrong, its credentials do.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        let p = path.clone();
        let out = tokio::task::spawn_blocking(move || as_nobody(&exe, &p))
            .await
            .unwrap();
        assert!(out.contains("ANSWER ok=false permission denied"), "{out}");
    }

    struct NoVmis;

    impl VmiView for NoVmis {
        fn view(&self, _: &str) -> (Option<crate::core::vmi::VirtualMachineInstance>, bool) {
            (None, true)
        }
        fn passes(&self) -> tokio::sync::watch::Receiver<u64> {
            tokio::sync::watch::Sender::new(0).subscribe()
        }
        fn act(&self, id: &str, _: VmiAction) -> crate::daemon::controller::ActFuture<'_> {
            let id = id.to_owned();
            Box::pin(async move { Err(format!("no VMI {id}")) })
        }
        fn guest_details(&self, _: &str) -> crate::daemon::controller::GuestFuture<'_> {
            Box::pin(async { Ok(None) })
        }
    }

    #[test]
    fn a_migration_names_its_target_and_may_cap_its_bandwidth() {
        let m = |to: Option<&str>| Request {
            action: "migrate".into(),
            vm: "ns/a".into(),
            to: to.map(str::to_owned),
            bandwidth: Some(8),
            ..Default::default()
        };
        assert_eq!(
            m(Some("10.0.0.2:8444")).parse().unwrap().1,
            Command::Migrate {
                to: "10.0.0.2:8444".parse().unwrap(),
                bandwidth: Some(8)
            }
        );
        assert!(m(None).parse().unwrap_err().contains("--to"));
        let bad = m(Some("host-b")).parse().unwrap_err();
        assert!(bad.contains("ADDRESS:PORT"), "{bad}");
    }

    #[test]
    fn requests_name_a_vm_and_an_action() {
        let r = |action: &str, vm: &str| Request {
            action: action.into(),
            vm: vm.into(),
            grace: Some(3),
            ..Default::default()
        };
        assert_eq!(
            r("stop", "ns/a").parse().unwrap().1,
            Command::Vm(Verb::Stop { grace: Some(3) })
        );
        let flagged = Request {
            paused: true,
            force: true,
            ..r("start", "ns/a")
        };
        assert_eq!(
            flagged.parse().unwrap().1,
            Command::Vm(Verb::Start { paused: true })
        );
        let restart = Request {
            action: "restart".into(),
            ..flagged
        };
        assert_eq!(
            restart.parse().unwrap().1,
            Command::Vm(Verb::Restart { force: true })
        );
        assert_eq!(
            r("soft-reboot", "ns/a").parse().unwrap().1,
            Command::Vmi(VmiAction::SoftReboot)
        );
        assert!(r("stop", "a")
            .parse()
            .unwrap_err()
            .contains("NAMESPACE/NAME"));
        assert!(r("explode", "ns/a")
            .parse()
            .unwrap_err()
            .contains("unknown"));
        assert!(r("start", "ns/A_B").parse().is_err());
        assert!(serde_json::from_str::<Request>(r#"{"action":"start","vm":"a/b","x":1}"#).is_err());
    }
}
