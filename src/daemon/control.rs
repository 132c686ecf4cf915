//! kvirtd's control socket: `kvirtctl start|stop|restart` of standalone
//! VirtualMachines, `pause|unpause|soft-reboot` of running VMIs, `migrate`
//! of a VMI to another kvirtd, `drain` and `uncordon` of the host. One
//! JSON request line; its answer is one JSON line, after the lines of a
//! drain's progress (each `{"progress": ...}`). Only root,
//! or the members of a configured group, may connect: the socket's mode
//! says so and each peer's credentials are checked again.

use crate::core::key::VmKey;
use crate::core::vm::Verb;
use crate::daemon::controller::{VmiAction, VmiView};
use crate::daemon::drain::{self, Evict};
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
    /// `migrate --to`: the target kvirtd's migration port (ADDRESS:PORT);
    /// in a cluster, none (the host is chosen by the VMI's rules).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    /// `drain NODE`, `uncordon NODE`: the host meant, checked against
    /// this one's node name (a drain of the wrong host refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
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

/// A line of a drain's progress, sent before its answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Progress {
    progress: String,
}

/// What a request asks, and of whom.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    Vm(Verb),
    Vmi(VmiAction),
    Migrate {
        to: Option<std::net::SocketAddr>,
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
            "migrate" => Command::Migrate {
                to: target(self.to.as_deref())?,
                bandwidth: self.bandwidth,
            },
            other => return Err(format!("unknown action {other:?}")),
        };
        Ok((key, command))
    }
}

/// `--to ADDRESS:PORT`, if given.
fn target(to: Option<&str>) -> Result<Option<std::net::SocketAddr>, String> {
    to.map(|to| {
        to.parse()
            .map_err(|e| format!("--to {to:?}: not ADDRESS:PORT: {e}"))
    })
    .transpose()
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
pub async fn serve(listener: UnixListener, group: Option<u32>, ctx: Ctx) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                warn!("control socket: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        if ctx.to.is_closed() {
            return;
        }
        let ctx = ctx.clone();
        tokio::spawn(async move {
            if let Err(e) = tokio::time::timeout(MIGRATE_DEADLINE, one(stream, group, ctx)).await {
                warn!("control socket: a client took too long: {e}");
            }
        });
    }
}

/// What the requests act on.
#[derive(Clone)]
pub struct Ctx {
    /// This host's node name.
    pub node: String,
    /// The VM loop (a VirtualMachine's start, stop, restart).
    pub to: UnboundedSender<Input>,
    pub view: Arc<dyn VmiView>,
    /// This host's migrations, if it takes part in any.
    pub migrate: Option<Arc<dyn Migrate>>,
    /// In a cluster, how a VM is moved and stopped through the API server
    /// (a standalone host does it itself).
    pub evict: Option<Arc<dyn Evict>>,
}

async fn one(stream: UnixStream, group: Option<u32>, ctx: Ctx) {
    let allowed = stream
        .peer_cred()
        .map(|c| c.uid() == 0 || group.is_some_and(|g| c.gid() == g || in_group(c.pid(), g)))
        .unwrap_or(false);
    let (read, mut write) = stream.into_split();
    if !allowed {
        let refused = Answer {
            ok: false,
            message:
                "permission denied: only root or the control group may use kvirtd's control socket"
                    .into(),
        };
        return send(&mut write, &refused).await;
    }
    let mut line = String::new();
    let mut reader = BufReader::new(tokio::io::AsyncReadExt::take(read, MAX_REQUEST));
    let message = match tokio::time::timeout(DEADLINE, reader.read_line(&mut line)).await {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(format!("reading the request: {e}")),
        Err(_) => Some("no request line within 10 s".into()),
    };
    if let Some(message) = message {
        return send(&mut write, &Answer { ok: false, message }).await;
    }
    // A drain's lines go out as they come, its answer after them.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let report = move |progress: String| {
        let _ = tx.send(Progress { progress });
    };
    let work = answer(&line, &ctx, &report);
    let mut work = std::pin::pin!(work);
    let done = loop {
        tokio::select! {
            a = &mut work => break a,
            Some(p) = rx.recv() => send(&mut write, &p).await,
        }
    };
    while let Ok(p) = rx.try_recv() {
        send(&mut write, &p).await;
    }
    send(&mut write, &done).await;
}

/// One JSON line to the client; a client gone is not kvirtd's problem.
async fn send(write: &mut tokio::net::unix::OwnedWriteHalf, line: &impl Serialize) {
    let mut out = serde_json::to_vec(line).expect("an answer serializes");
    out.push(b'\n');
    let _ = write.write_all(&out).await;
}

async fn answer(line: &str, ctx: &Ctx, report: &(dyn Fn(String) + Sync)) -> Answer {
    let request = match serde_json::from_str::<Request>(line.trim()) {
        Ok(r) => r,
        Err(e) => {
            return Answer {
                ok: false,
                message: format!("bad request: {e}"),
            }
        }
    };
    if let Some(a) = host_answer(&request, ctx, report).await {
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
            return done(migrate(ctx, key, to, bandwidth).await);
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

/// `kvirtctl migrate`: standalone, to the kvirtd at `to`; in a cluster,
/// by a migration object, to the host the VMI's rules choose.
async fn migrate(
    ctx: &Ctx,
    key: VmKey,
    to: Option<std::net::SocketAddr>,
    bandwidth: Option<u64>,
) -> Result<String, String> {
    let m = ctx.migrate.as_ref().ok_or(NO_MIGRATIONS)?;
    if m.standalone() {
        let to = to.ok_or("migrate: --to ADDRESS:PORT is missing")?;
        return m.migrate(key, to, bandwidth).await;
    }
    cluster_evict(ctx, to, bandwidth)?.migrate(key, false).await
}

/// A cluster host's way of moving VMs: by migration objects, whose target
/// the VMI's rules choose and whose bandwidth is the configured one, so a
/// `--to` or `--bandwidth` is refused rather than ignored.
fn cluster_evict(
    ctx: &Ctx,
    to: Option<std::net::SocketAddr>,
    bandwidth: Option<u64>,
) -> Result<&dyn Evict, String> {
    if to.is_some() {
        return Err(
            "--to: in a cluster the target is the kvirt host the VMI's scheduling \
                    rules choose (or its kvirt.io/target-node annotation's); leave --to out"
                .into(),
        );
    }
    if bandwidth.is_some() {
        return Err("--bandwidth: in a cluster each migration's bandwidth is \
                    [migration] bandwidth_per_migration_mib"
            .into());
    }
    ctx.evict.as_deref().ok_or_else(|| NO_MIGRATIONS.into())
}

/// `drain` and `uncordon`, of the host rather than a VM; `None`: not one.
async fn host_answer(r: &Request, ctx: &Ctx, report: &(dyn Fn(String) + Sync)) -> Option<Answer> {
    if !matches!(r.action.as_str(), "drain" | "uncordon") {
        return None;
    }
    if let Some(node) = r.node.as_ref().filter(|n| **n != ctx.node) {
        return Some(Answer {
            ok: false,
            message: format!(
                "this is the kvirtd of {}, not of {node}: run kvirtctl {} on {node}",
                ctx.node, r.action
            ),
        });
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
            let to = target(r.to.as_deref())?;
            let d = if m.standalone() {
                let direct = drain::Direct {
                    migrate: m.as_ref(),
                    vms: &ctx.to,
                    to: to.ok_or("drain: --to ADDRESS:PORT is missing")?,
                    bandwidth: r.bandwidth,
                };
                drain::drain(m.as_ref(), &direct, report).await?
            } else {
                let evict = cluster_evict(ctx, to, r.bandwidth)?;
                drain::drain(m.as_ref(), evict, report).await?
            };
            Ok(Answer {
                ok: d.empty,
                message: d.summary,
            })
        }
        .await
    };
    Some(result.unwrap_or_else(|message: String| Answer { ok: false, message }))
}

const NO_MIGRATIONS: &str = "this kvirtd migrates no VMs: kvirtds with kvirt's identity \
                             ([api] cert, key, ca) and a [migration] section do";

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
    call_with(path, req, &mut |_| {})
}

/// [`call`], with each line of a drain's progress given to `progress` as
/// it comes.
pub fn call_with(
    path: &Path,
    req: &Request,
    progress: &mut dyn FnMut(&str),
) -> std::io::Result<Answer> {
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
    let mut reader = std::io::BufReader::new(s);
    loop {
        let mut line = String::new();
        std::io::Read::take(&mut reader, MAX_REQUEST * 4).read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::other(
                "kvirtd closed the socket without an answer",
            ));
        }
        match serde_json::from_str::<Progress>(&line) {
            Ok(p) => progress(&p.progress),
            Err(_) => return serde_json::from_str(&line).map_err(std::io::Error::other),
        }
    }
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
        let ctx = Ctx {
            node: "node-a".into(),
            to: tx,
            view: Arc::new(NoVmis),
            migrate: None,
            evict: None,
        };
        tokio::spawn(serve(listener, None, ctx));
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

    /// A cluster host with one VMI, moved by its migration object.
    #[derive(Default)]
    struct ClusterHost {
        here: std::sync::Mutex<Vec<VmKey>>,
    }

    impl Migrate for ClusterHost {
        fn migrate(
            &self,
            _: VmKey,
            _: std::net::SocketAddr,
            _: Option<u64>,
        ) -> futures::future::BoxFuture<'_, Result<String, String>> {
            unreachable!("a cluster host moves VMs by migration objects")
        }
        fn cordon(&self, _: bool) -> Result<(), String> {
            Ok(())
        }
        fn drain_plan(&self) -> Vec<(VmKey, crate::core::drain::Action)> {
            let a = VmKey::new("default", "a").unwrap();
            vec![(a, crate::core::drain::Action::Migrate)]
        }
        fn still_here(&self) -> Vec<VmKey> {
            self.here.lock().unwrap().clone()
        }
        fn standalone(&self) -> bool {
            false
        }
    }

    impl Evict for ClusterHost {
        fn migrate(
            &self,
            key: VmKey,
            evacuation: bool,
        ) -> futures::future::BoxFuture<'_, Result<String, String>> {
            assert!(evacuation, "a drain's migrations are evacuations");
            self.here.lock().unwrap().clear();
            Box::pin(async move { Ok(format!("{key} moved to node-b")) })
        }
        fn stop(&self, _: VmKey) -> futures::future::BoxFuture<'_, Result<String, String>> {
            unreachable!("nothing to stop")
        }
    }

    #[tokio::test]
    async fn a_drains_progress_comes_line_by_line_before_its_answer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let listener = bind(&path, None).unwrap();
        let host = Arc::new(ClusterHost::default());
        host.here
            .lock()
            .unwrap()
            .push(VmKey::new("default", "a").unwrap());
        // The VM loop, there (kvirtd running) though never asked.
        let (to, _vms) = tokio::sync::mpsc::unbounded_channel();
        let ctx = Ctx {
            node: "node-a".into(),
            to,
            view: Arc::new(NoVmis),
            migrate: Some(host.clone()),
            evict: Some(host),
        };
        tokio::spawn(serve(listener, None, ctx));
        let ask = |req: Request| {
            let p = path.clone();
            tokio::task::spawn_blocking(move || {
                let mut lines = Vec::new();
                let a = call_with(&p, &req, &mut |l| lines.push(l.to_owned())).unwrap();
                (lines, a)
            })
        };
        let drain = Request {
            action: "drain".into(),
            ..Default::default()
        };
        // Another host named: refused before anything is cordoned.
        let elsewhere = Request {
            node: Some("node-b".into()),
            ..drain.clone()
        };
        let (lines, answer) = ask(elsewhere).await.unwrap();
        assert!(lines.is_empty() && !answer.ok, "{answer:?}");
        assert!(answer.message.contains("kvirtd of node-a, not of node-b"));
        let here = Request {
            node: Some("node-a".into()),
            ..drain.clone()
        };
        let (lines, answer) = ask(here).await.unwrap();
        assert_eq!(
            lines,
            [
                "cordoned: this host takes no VM arriving",
                "default/a: migrating",
                "default/a moved to node-b"
            ]
        );
        assert!(answer.ok, "{answer:?}");
        assert_eq!(answer.message, "drained: no VM runs here");
        // A target or bandwidth a cluster does not take is refused.
        let to = Request {
            to: Some("10.0.0.2:8444".into()),
            ..drain.clone()
        };
        let (lines, answer) = ask(to).await.unwrap();
        assert!(lines.is_empty() && !answer.ok && answer.message.starts_with("--to:"));
        let slow = Request {
            bandwidth: Some(1),
            ..drain
        };
        let (_, answer) = ask(slow).await.unwrap();
        assert!(!answer.ok && answer.message.starts_with("--bandwidth:"));
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
                to: Some("10.0.0.2:8444".parse().unwrap()),
                bandwidth: Some(8)
            }
        );
        // In a cluster the VMI's rules choose; standalone refuses it later.
        assert_eq!(
            m(None).parse().unwrap().1,
            Command::Migrate {
                to: None,
                bandwidth: Some(8)
            }
        );
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
