//! systemd, the one place VMs run: start/stop/list `kvirt-vm@` units.

use crate::core::cpuset::CpuSet;
use crate::core::key::{self, UNIT_PREFIX};
use crate::core::layout::DaemonKind;
use crate::core::plan::{UnitActivity, UnitObs};
use crate::core::unit::{
    Prop, UnitSpec, ENV_DAEMON, ENV_GRACE, ENV_NAME, ENV_NAMESPACE, ENV_SHARED_DISKS, ENV_UID,
};
use crate::host::bus::Bus;
use crate::host::pidfd::{self, Pidfd};
use crate::host::removals::{Removal, Removals};
use futures::StreamExt;
use std::future::Future;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use zbus::zvariant::{OwnedObjectPath, OwnedValue, Value};
use zbus_systemd::systemd1::{ManagerProxy, ServiceProxy, UnitProxy};

#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    #[error("D-Bus: {0}")]
    Bus(#[from] zbus::Error),
    #[error("unit {unit}: job {verb} finished with {result}")]
    Job {
        unit: String,
        verb: &'static str,
        result: String,
    },
    #[error("unit {unit}: job {verb} did not finish within {timeout:?}")]
    Timeout {
        unit: String,
        verb: &'static str,
        timeout: Duration,
    },
    #[error("unit {unit}: property {property}: {message}")]
    Property {
        unit: String,
        property: &'static str,
        message: String,
    },
}

/// How much of a failed unit's log goes into its error.
const LOG_LINES: usize = 6;
const LOG_LINE_CHARS: usize = 200;

/// What the journal holds of `unit` since `since` (systemd's messages
/// about it and its processes' own), as ": line; line", or nothing. Best
/// effort and bounded: the journal may not have it yet.
async fn unit_log(unit: &str, since: std::time::SystemTime) -> String {
    let secs = since
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let unit = unit.to_owned();
    let read = tokio::task::spawn_blocking(move || {
        std::process::Command::new("journalctl")
            .args(["--no-pager", "-o", "cat", "-n", &LOG_LINES.to_string()])
            .arg(format!("--since=@{secs}"))
            .arg(format!("--unit={unit}"))
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .output()
    });
    match tokio::time::timeout(Duration::from_secs(5), read).await {
        Ok(Ok(Ok(out))) => log_tail(&out.stdout),
        _ => String::new(),
    }
}

/// The last lines of a unit's log, each cut short and stripped of control
/// characters (its processes wrote some of them), joined on one line.
pub fn log_tail(text: &[u8]) -> String {
    let text = String::from_utf8_lossy(text);
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.chars()
                .map(|c| if c.is_control() { ' ' } else { c })
                .take(LOG_LINE_CHARS)
                .collect()
        })
        .collect();
    let tail = &lines[lines.len().saturating_sub(LOG_LINES)..];
    if tail.is_empty() {
        String::new()
    } else {
        format!(": {}", tail.join("; "))
    }
}

/// The units kvirtd manages, as far as it needs them.
pub trait Units: Send + Sync + 'static {
    /// Starts the unit and waits for its start job; fails with the job's result.
    fn start(&self, spec: &UnitSpec) -> impl Future<Output = Result<(), SystemdError>> + Send;
    /// Stops the unit (if loaded) and waits; a failed unit is reset so it is collected.
    /// `daemon`: its main process as the caller last saw it (`MainPID`),
    /// which saves asking systemd again; it is checked to be in the unit.
    fn stop(
        &self,
        unit: &str,
        daemon: Option<u32>,
    ) -> impl Future<Output = Result<(), SystemdError>> + Send;
    fn get(&self, unit: &str)
        -> impl Future<Output = Result<Option<UnitObs>, SystemdError>> + Send;
    /// Ids (`<ns>_<name>` form) of every loaded `kvirt-vm@` unit.
    fn list_ids(&self) -> impl Future<Output = Result<Vec<String>, SystemdError>> + Send;
    /// SIGKILL to every process of the unit at once (QEMU and its daemon):
    /// a fence, which waits for no guest.
    fn kill_all(&self, unit: &str) -> impl Future<Output = Result<(), SystemdError>> + Send;
    /// Moves a running unit to these CPUs (`AllowedCPUs=`, until it ends).
    fn set_allowed_cpus(
        &self,
        unit: &str,
        cpus: &CpuSet,
    ) -> impl Future<Output = Result<(), SystemdError>> + Send;
}

const JOB_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a unit's processes have after their SIGTERM before its stop
/// job (and so its `ExecStop=`) is used instead.
const TERM_WAIT: Duration = Duration::from_secs(15);

#[derive(Clone)]
pub struct SystemdBus {
    bus: Bus,
    /// Whether [`Units::get`] reads `AllowedCPUs`: only a host that
    /// dedicates CPUs places units on them.
    read_cpus: bool,
    /// Fed by one reader of `UnitRemoved` for the connection's life.
    removals: Removals,
}

impl SystemdBus {
    pub async fn connect() -> Result<Self, SystemdError> {
        let bus = Bus::system().await?;
        let manager = ManagerProxy::new(bus.connection()).await?;
        manager.subscribe().await?;
        let removals = Removals::default();
        let mut removed = manager.receive_unit_removed().await?;
        let feed = removals.clone();
        // Read as they come (an unread stream holds up the connection's
        // replies); the stream ends with the connection.
        tokio::spawn(async move {
            while let Some(sig) = removed.next().await {
                if let Ok(a) = sig.args() {
                    feed.removed(&a.id);
                }
            }
        });
        Ok(Self {
            bus,
            read_cpus: true,
            removals,
        })
    }

    /// Units' CPUs are read only where they are placed (a resync reads
    /// every VM's unit: each property is a bus round trip).
    pub fn reading_cpus(self, read_cpus: bool) -> Self {
        Self { read_cpus, ..self }
    }

    /// The bus connection and its bound, for the other systemd services
    /// (machined).
    pub fn bus(&self) -> Bus {
        self.bus.clone()
    }

    async fn manager(&self) -> Result<ManagerProxy<'static>, SystemdError> {
        Ok(ManagerProxy::new(self.bus.connection()).await?)
    }

    /// Runs one job call and waits for its `JobRemoved`. The signal stream
    /// is opened before the call so a fast job cannot be missed, and read
    /// while the call is out (see `drain`): in a burst of jobs an unread
    /// one held up every reply for the bus timeout.
    async fn run_job<F, Fut>(
        &self,
        unit: &str,
        verb: &'static str,
        call: F,
    ) -> Result<(), SystemdError>
    where
        F: FnOnce(ManagerProxy<'static>) -> Fut,
        Fut: Future<Output = zbus::Result<OwnedObjectPath>>,
    {
        let manager = self.manager().await?;
        let mut removed = self.bus.call(manager.receive_job_removed()).await?;
        let mut early: Vec<(OwnedObjectPath, String)> = Vec::new();
        let job = drain(self.bus.call(call(manager)), &mut removed, |sig| {
            if let Ok(a) = sig.args() {
                early.push((a.job.clone(), a.result.clone()));
            }
        })
        .await?;
        let done_early = early
            .into_iter()
            .find(|(j, _)| *j == job)
            .map(|(_, result)| result);
        let wait = async {
            if done_early.is_some() {
                return done_early;
            }
            while let Some(sig) = removed.next().await {
                let Ok(args) = sig.args() else { continue };
                if args.job == job {
                    return Some(args.result.clone());
                }
            }
            None
        };
        match tokio::time::timeout(JOB_TIMEOUT, wait).await {
            Ok(Some(result)) if result == "done" => Ok(()),
            Ok(Some(result)) => Err(SystemdError::Job {
                unit: unit.into(),
                verb,
                result,
            }),
            Ok(None) => Err(SystemdError::Job {
                unit: unit.into(),
                verb,
                result: "signal stream ended".into(),
            }),
            Err(_) => Err(SystemdError::Timeout {
                unit: unit.into(),
                verb,
                timeout: JOB_TIMEOUT,
            }),
        }
    }

    /// Ends the unit's processes as systemd's own stop would (SIGTERM and
    /// SIGCONT), but sent by kvirtd through pidfds, then waits for the unit
    /// to go away. The libvirt daemon first: it says `STOPPING=1` and
    /// exits, leaving its guest running as on any restart, and systemd
    /// runs no `ExecStop=` (stopping 100 VMs through their stop jobs spent
    /// a third of the CPU in systemd setting up each unit's mount
    /// namespace again for that one command). Then what KillMode=process
    /// left, QEMU. Not both at once: QEMU's exit raced the daemon's own
    /// shutdown, and 2 of 100 daemons then hung until libvirt's 30 s
    /// shutdown timeout. Not through KillUnit: under load each call took
    /// systemd up to half a second to answer. A daemon that does not say
    /// STOPPING=1 (older libvirt) still exits, and systemd then runs
    /// `ExecStop=` as a stop job would.
    async fn terminate(
        &self,
        unit: &str,
        (daemon, cgroup): (Option<Pidfd>, String),
        mut removal: Removal,
    ) -> Result<Ended, SystemdError> {
        let deadline = tokio::time::sleep(TERM_WAIT);
        tokio::pin!(deadline);
        // Where a stop's time goes (KVIRT_LOG=kvirt::host::systemd=debug):
        // the daemon's exit, then QEMU's and the unit's removal.
        let t0 = tokio::time::Instant::now();
        let mut gone = false;
        if let Some(daemon) = daemon {
            daemon.signal(libc::SIGTERM);
            daemon.signal(libc::SIGCONT);
            tokio::select! {
                _ = daemon.exited() => {}
                _ = &mut removal => gone = true,
                _ = &mut deadline => return Ok(Ended::No),
            }
        }
        let daemon_ms = t0.elapsed().as_millis() as u64;
        if !gone {
            pidfd::signal_cgroup(&cgroup, libc::SIGTERM);
            pidfd::signal_cgroup(&cgroup, libc::SIGCONT);
        }
        let ended = if gone {
            Ended::Removed
        } else {
            tokio::select! {
                ended = self.until_down(unit, &cgroup, &mut removal) => ended?,
                _ = &mut deadline => return Ok(Ended::No),
            }
        };
        let ms = t0.elapsed().as_millis() as u64;
        tracing::debug!(unit, daemon_ms, ms, ?ended, "stopped");
        Ok(ended)
    }

    /// Until the unit is removed, or is down with none of its processes
    /// left. A look now and then: a unit kept loaded (something still
    /// holds it) sends no UnitRemoved when it goes inactive. Less and less
    /// often: most units are removed within a second or two, and a look
    /// every second by each of 250 stopping VMs added to the bus calls the
    /// others' stops wait for. Down with processes left is QEMU still
    /// exiting (KillMode=process: systemd waits for none of it): not yet
    /// a reason to kill it.
    async fn until_down(
        &self,
        unit: &str,
        cgroup: &str,
        removal: &mut Removal,
    ) -> Result<Ended, SystemdError> {
        let mut wait = Duration::from_secs(2);
        loop {
            tokio::select! {
                _ = &mut *removal => return Ok(Ended::Removed),
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(8));
            match self.activity_of(unit).await? {
                None => return Ok(Ended::Removed),
                Some(UnitActivity::Inactive | UnitActivity::Failed)
                    if pidfd::pids_of(cgroup).is_empty() =>
                {
                    return Ok(Ended::Down)
                }
                Some(_) => {}
            }
        }
    }

    /// After a stop's signals: a stop job where they did not end the
    /// unit, then whatever is left killed.
    async fn finish_stop(
        &self,
        unit: &str,
        ended: Result<Ended, SystemdError>,
    ) -> Result<(), SystemdError> {
        let ended = ended.unwrap_or_else(|e| {
            tracing::debug!(unit, "SIGTERM to the unit: {e}; stopping it instead");
            Ended::No
        });
        let name = unit.to_owned();
        let res = match ended {
            Ended::Removed => return Ok(()),
            Ended::Down => Ok(()),
            Ended::No => match self
                .run_job(unit, "stop", |m| async move {
                    m.stop_unit(name, "replace".into()).await
                })
                .await
            {
                Err(SystemdError::Bus(e)) if no_such_unit(&e) => Ok(()),
                r => r,
            },
        };
        if let Ok(Some(left)) = self.activity_of(unit).await {
            let manager = self.manager().await?;
            // KillMode=process spares QEMU when only the daemon dies; a
            // stop on purpose leaves nothing, not even a process that
            // ignored its SIGTERM.
            let _ = self
                .bus
                .call(manager.kill_unit(unit.into(), "all".into(), libc::SIGKILL))
                .await;
            // Stopping can leave it failed (e.g. killed by the stop timeout).
            if left == UnitActivity::Failed {
                let _ = self.bus.call(manager.reset_failed_unit(unit.into())).await;
            }
        }
        res
    }

    /// The unit's main process, pinned by a pidfd (`None` when it has none
    /// or it is gone), and its cgroup.
    async fn processes(
        &self,
        path: &OwnedObjectPath,
    ) -> Result<(Option<Pidfd>, String), SystemdError> {
        let service = self.service_at(path).await?;
        // One after the other: a hundred VMs stopping at once, each with
        // two calls outstanding, hit the bus's limit of pending replies
        // per connection.
        let pid = self.bus.call(service.main_pid()).await?;
        let cgroup = self.bus.call(service.control_group()).await?;
        // MainPID is a number: pinned, then checked to be the unit's, so a
        // pid reused since systemd answered is never signalled.
        Ok((Pidfd::open_in(pid, &cgroup), cgroup))
    }

    async fn service_at(
        &self,
        path: &OwnedObjectPath,
    ) -> Result<ServiceProxy<'static>, SystemdError> {
        Ok(ServiceProxy::builder(self.bus.connection())
            .path(path.clone())?
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await?)
    }

    async fn unit_at(&self, path: &OwnedObjectPath) -> Result<UnitProxy<'static>, SystemdError> {
        Ok(UnitProxy::builder(self.bus.connection())
            .path(path.clone())?
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await?)
    }

    /// The unit's object path; `None` when it is not loaded.
    async fn unit_path(&self, unit: &str) -> Result<Option<OwnedObjectPath>, SystemdError> {
        let manager = self.manager().await?;
        match self.bus.call(manager.get_unit(unit.into())).await {
            Ok(p) => Ok(Some(p)),
            Err(e) if no_such_unit(&e) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The unit's activity, in two calls; `None` when it is not loaded.
    async fn activity_of(&self, unit: &str) -> Result<Option<UnitActivity>, SystemdError> {
        let Some(path) = self.unit_path(unit).await? else {
            return Ok(None);
        };
        let unit = self.unit_at(&path).await?;
        let state = self.bus.call(unit.active_state()).await?;
        Ok(Some(activity(&state)))
    }

    /// Sends every `kvirt-vm@` unit's id to `tx` whenever its state changes
    /// or it goes away: the loop's view of VMs stopping on their own.
    pub async fn watch(&self, tx: UnboundedSender<String>) -> Result<(), SystemdError> {
        let rule = zbus::MatchRule::builder()
            .msg_type(zbus::message::Type::Signal)
            .sender("org.freedesktop.systemd1")?
            .interface("org.freedesktop.DBus.Properties")?
            .member("PropertiesChanged")?
            .path_namespace("/org/freedesktop/systemd1/unit")?
            .build();
        let mut changes =
            zbus::MessageStream::for_match_rule(rule, self.bus.connection(), None).await?;
        let mut removed = self.manager().await?.receive_unit_removed().await?;
        tokio::spawn(async move {
            loop {
                let id = tokio::select! {
                    Some(Ok(msg)) = changes.next() => msg
                        .header()
                        .path()
                        .and_then(|p| unit_from_object_path(p.as_str()))
                        .and_then(|u| key::id_from_unit(&u).map(str::to_owned)),
                    Some(sig) = removed.next() => sig
                        .args()
                        .ok()
                        .and_then(|a| key::id_from_unit(&a.id).map(str::to_owned)),
                    else => break,
                };
                if let Some(id) = id {
                    if tx.send(id).is_err() {
                        break;
                    }
                }
            }
        });
        Ok(())
    }
}

impl Units for SystemdBus {
    async fn start(&self, spec: &UnitSpec) -> Result<(), SystemdError> {
        let props = spec
            .properties
            .iter()
            .map(|p| to_dbus(&spec.name, p))
            .collect::<Result<Vec<_>, _>>()?;
        let name = spec.name.clone();
        let since = std::time::SystemTime::now();
        let started = self
            .run_job(&spec.name, "start", |m| async move {
                m.start_transient_unit(name, "fail".into(), props, vec![])
                    .await
            })
            .await;
        match started {
            // "failed" alone says nothing: what systemd logged says why
            // (a namespace it could not set up, the daemon's exit...).
            Err(SystemdError::Job { unit, verb, result }) => {
                let why = unit_log(&unit, since).await;
                Err(SystemdError::Job {
                    unit,
                    verb,
                    result: format!("{result}{why}"),
                })
            }
            r => r,
        }
    }

    async fn stop(&self, unit: &str, daemon: Option<u32>) -> Result<(), SystemdError> {
        // Waited for from before anything is signalled.
        let removal = self.removals.wait_for(unit);
        // The daemon the pass saw, still running in the unit's cgroup: the
        // unit is active, and nothing need be asked of systemd first (its
        // path and state: 250 VMs' stops queued ~1.8 s on the bus for them
        // before their signals).
        if let Some((pinned, cgroup)) = daemon.and_then(|pid| pidfd::pin_in_unit(pid, unit)) {
            let ended = self.terminate(unit, (Some(pinned), cgroup), removal).await;
            return self.finish_stop(unit, ended).await;
        }
        let Some(path) = self.unit_path(unit).await? else {
            return Ok(());
        };
        let unit_iface = self.unit_at(&path).await?;
        let now = activity(&self.bus.call(unit_iface.active_state()).await?);
        if now == UnitActivity::Failed {
            // A failed unit is already stopped; resetting lets it be collected.
            let manager = self.manager().await?;
            return Ok(self
                .bus
                .call(manager.reset_failed_unit(unit.into()))
                .await?);
        }
        if now == UnitActivity::Inactive {
            // Stopped already: systemd collects it once nothing holds it.
            // A stop job here would change nothing but wake this VM's pass
            // again (its signals), over and over while it is held.
            return Ok(());
        }
        let ended = if now == UnitActivity::Active {
            match self.processes(&path).await {
                Ok(target) => self.terminate(unit, target, removal).await,
                Err(e) => Err(e),
            }
        } else {
            Ok(Ended::No)
        };
        self.finish_stop(unit, ended).await
    }

    async fn get(&self, unit: &str) -> Result<Option<UnitObs>, SystemdError> {
        let Some(path) = self.unit_path(unit).await? else {
            return Ok(None);
        };
        let (unit_iface, svc) = (self.unit_at(&path).await?, self.service_at(&path).await?);
        let bus = &self.bus;
        // Each property is a round trip, and a resync reads every VM's
        // unit: only what this activity gives a meaning is read.
        let activity = activity(&bus.call(unit_iface.active_state()).await?);
        let stopped = matches!(activity, UnitActivity::Inactive | UnitActivity::Failed);
        // A unit only referenced (by a job, a dependency) is loaded as
        // not-found, and is inactive: no unit of ours.
        if stopped && bus.call(unit_iface.load_state()).await? == "not-found" {
            return Ok(None);
        }
        // Whose unit it is: never guessed (a unit going away as it is
        // read answers nothing here, and must not pass for anyone's).
        let env = bus.call(svc.environment()).await?;
        let result = if stopped {
            bus.call(svc.result()).await.unwrap_or_default()
        } else {
            String::new()
        };
        let restarts = bus.call(svc.n_restarts()).await.unwrap_or_default();
        let main_pid = match activity {
            UnitActivity::Active => bus.call(svc.main_pid()).await.ok().filter(|p| *p > 0),
            _ => None,
        };
        let allowed_cpus = if self.read_cpus {
            bus.call(svc.allowed_cp_us()).await.ok()
        } else {
            None
        }
        .map(|m| CpuSet::from_mask(&m))
        .filter(|c| !c.is_empty());
        Ok(Some(unit_obs(
            activity,
            &env,
            result,
            restarts,
            main_pid,
            allowed_cpus,
        )))
    }

    async fn list_ids(&self) -> Result<Vec<String>, SystemdError> {
        let manager = self.manager().await?;
        let units = self
            .bus
            .call(manager.list_units_by_patterns(vec![], vec![format!("{UNIT_PREFIX}*")]))
            .await?;
        Ok(units
            .into_iter()
            .filter_map(|u| key::id_from_unit(&u.0).map(str::to_owned))
            .collect())
    }

    async fn kill_all(&self, unit: &str) -> Result<(), SystemdError> {
        let manager = self.manager().await?;
        Ok(self
            .bus
            .call(manager.kill_unit(unit.into(), "all".into(), libc::SIGKILL))
            .await?)
    }

    async fn set_allowed_cpus(&self, unit: &str, cpus: &CpuSet) -> Result<(), SystemdError> {
        let prop = to_dbus(unit, &Prop::Bytes("AllowedCPUs", cpus.to_mask()))?;
        let manager = self.manager().await?;
        Ok(self
            .bus
            .call(manager.set_unit_properties(unit.into(), true, vec![prop]))
            .await?)
    }
}

/// Drives `call` while handing each signal of `signals` to `on`: zbus
/// stops reading the bus while any stream is full, so a stream left
/// unread during a call (every waiter's stream gets every unit's and
/// job's signal) would hold up that call's own reply.
async fn drain<S: futures::Stream + Unpin, T>(
    call: impl Future<Output = T>,
    signals: &mut S,
    mut on: impl FnMut(S::Item),
) -> T {
    tokio::pin!(call);
    loop {
        tokio::select! {
            r = &mut call => return r,
            Some(sig) = signals.next() => on(sig),
        }
    }
}

/// How a `terminate` ended.
#[derive(Debug)]
enum Ended {
    /// The unit went away (it is collected).
    Removed,
    /// Inactive or failed, and maybe still loaded.
    Down,
    /// Not within its time: a stop job must do it.
    No,
}

fn no_such_unit(e: &zbus::Error) -> bool {
    matches!(e, zbus::Error::MethodError(name, _, _)
        if name.as_str() == "org.freedesktop.systemd1.NoSuchUnit")
}

/// What kvirt reads of a unit, from its properties and the environment
/// kvirtd gave it.
fn unit_obs(
    activity: UnitActivity,
    env: &[String],
    result: String,
    restarts: u32,
    main_pid: Option<u32>,
    allowed_cpus: Option<CpuSet>,
) -> UnitObs {
    let var = |k: &str| {
        env.iter()
            .find_map(|e| e.strip_prefix(k).and_then(|r| r.strip_prefix('=')))
            .map(str::to_owned)
    };
    UnitObs {
        activity,
        uid: var(ENV_UID),
        daemon: var(ENV_DAEMON).and_then(|d| match d.as_str() {
            "virtqemud" => Some(DaemonKind::Virtqemud),
            "libvirtd" => Some(DaemonKind::Libvirtd),
            _ => None,
        }),
        grace: var(ENV_GRACE)
            .and_then(|g| g.parse().ok())
            .map(Duration::from_secs),
        domain_name: var(ENV_NAMESPACE)
            .zip(var(ENV_NAME))
            .map(|(ns, n)| format!("{ns}_{n}")),
        result,
        restarts,
        main_pid,
        allowed_cpus,
        shared_disks: var(ENV_SHARED_DISKS).is_some(),
    }
}

fn activity(s: &str) -> UnitActivity {
    match s {
        "active" | "reloading" | "refreshing" => UnitActivity::Active,
        "activating" => UnitActivity::Activating,
        "deactivating" => UnitActivity::Deactivating,
        "failed" => UnitActivity::Failed,
        _ => UnitActivity::Inactive,
    }
}

/// `/org/freedesktop/systemd1/unit/kvirt_2dvm_40a_5fb_2eservice` →
/// `kvirt-vm@a_b.service` (systemd's bus path escaping: `_xx` is a byte).
fn unit_from_object_path(path: &str) -> Option<String> {
    let tail = path.strip_prefix("/org/freedesktop/systemd1/unit/")?;
    let bytes = tail.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'_' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn to_dbus(unit: &str, p: &Prop) -> Result<(String, OwnedValue), SystemdError> {
    let (name, value): (&str, Value) = match p {
        Prop::Str(n, v) => (n, Value::from(v.clone())),
        Prop::Bool(n, v) => (n, Value::from(*v)),
        Prop::U32(n, v) => (n, Value::from(*v)),
        Prop::U64(n, v) => (n, Value::from(*v)),
        Prop::I32(n, v) => (n, Value::from(*v)),
        Prop::Bytes(n, v) => (n, Value::from(v.clone())),
        Prop::Strs(n, v) => (n, Value::from(v.clone())),
        Prop::Exec(n, argv) => {
            let path = argv.first().cloned().unwrap_or_default();
            (n, Value::from(vec![(path, argv.clone(), false)]))
        }
        Prop::ExecEx(n, argv, flags) => {
            let path = argv.first().cloned().unwrap_or_default();
            let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
            (n, Value::from(vec![(path, argv.clone(), flags)]))
        }
        Prop::Binds(n, v) => {
            const MS_REC: u64 = libc::MS_REC;
            let v: Vec<(String, String, bool, u64)> = v
                .iter()
                .map(|(s, d)| (s.clone(), d.clone(), false, MS_REC))
                .collect();
            (n, Value::from(v))
        }
        Prop::TmpFs(n, v) | Prop::Devices(n, v) => (n, Value::from(v.clone())),
        Prop::AllowList(n, v) => (n, Value::from((true, v.clone()))),
    };
    let owned = OwnedValue::try_from(value).map_err(|e| SystemdError::Property {
        unit: unit.into(),
        property: p.name(),
        message: e.to_string(),
    })?;
    Ok((name.to_owned(), owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_units_log_is_its_last_lines_cut_short_on_one_line() {
        assert_eq!(log_tail(b""), "");
        assert_eq!(log_tail(b"\n  \n"), "");
        let log = "Starting kvirt VM a/b...\n\
            kvirt-vm@a_b.service: Failed to set up mount namespacing: /run/x: No such file or directory\n\
            kvirt-vm@a_b.service: Failed at step NAMESPACE spawning /usr/sbin/virtqemud: No such file or directory\n\
            kvirt-vm@a_b.service: Main process exited, code=exited, status=226/NAMESPACE\n";
        let tail = log_tail(log.as_bytes());
        assert!(tail.starts_with(": Starting kvirt VM a/b...; kvirt-vm@a_b.service: Failed"));
        assert!(tail.ends_with("status=226/NAMESPACE"), "{tail}");
        // What the unit's processes wrote is bounded and cannot forge lines.
        let mut hostile = b"x\x1b[2Jy\r".to_vec();
        hostile.extend(std::iter::repeat_n(b'z', 10_000));
        hostile.extend(b"\n".repeat(3));
        for i in 0..20 {
            hostile.extend(format!("line {i}\n").as_bytes());
        }
        let tail = log_tail(&hostile);
        assert_eq!(
            tail,
            ": line 14; line 15; line 16; line 17; line 18; line 19"
        );
        let first = log_tail(&hostile[..10_007]);
        assert!(!first.contains('\x1b') && !first.contains('\r'));
        assert_eq!(first.chars().count(), 2 + LOG_LINE_CHARS);
    }

    #[test]
    fn a_units_environment_says_whose_vm_it_is_and_nothing_else_does() {
        let env: Vec<String> = [
            // A name that only starts with one kvirt reads is not it.
            format!("{ENV_UID}X=u-2"),
            format!("{ENV_UID}=u-1"),
            format!("{ENV_DAEMON}=virtqemud"),
            format!("{ENV_GRACE}=30"),
            format!("{ENV_NAMESPACE}=ns"),
            format!("{ENV_NAME}=vm"),
        ]
        .into();
        let u = unit_obs(UnitActivity::Active, &env, String::new(), 2, Some(7), None);
        assert_eq!(u.uid.as_deref(), Some("u-1"));
        assert_eq!(u.daemon, Some(DaemonKind::Virtqemud));
        assert_eq!(u.grace, Some(Duration::from_secs(30)));
        assert_eq!(u.domain_name.as_deref(), Some("ns_vm"));
        assert_eq!(
            (u.restarts, u.main_pid, u.shared_disks),
            (2, Some(7), false)
        );
        let bare = unit_obs(UnitActivity::Failed, &[], "exit-code".into(), 0, None, None);
        assert_eq!((bare.uid, bare.daemon, bare.grace), (None, None, None));
        assert_eq!(bare.result, "exit-code");
        let odd = [
            format!("{ENV_DAEMON}=qemu"),
            format!("{ENV_SHARED_DISKS}=1"),
        ];
        let u = unit_obs(UnitActivity::Active, &odd, String::new(), 0, None, None);
        assert_eq!((u.daemon, u.shared_disks), (None, true));
    }

    #[test]
    fn object_paths_unescape_to_unit_names() {
        assert_eq!(
            unit_from_object_path(
                "/org/freedesktop/systemd1/unit/kvirt_2dvm_40default_5fmy_2dvm_2eservice"
            )
            .as_deref(),
            Some("kvirt-vm@default_my-vm.service")
        );
        assert_eq!(unit_from_object_path("/org/other"), None);
    }

    #[test]
    fn properties_have_systemds_signatures() {
        let sig = |p: Prop| to_dbus("u", &p).unwrap().1.value_signature().to_string();
        assert_eq!(
            sig(Prop::Exec("ExecStart", vec!["/bin/x".into(), "-a".into()])),
            "a(sasb)"
        );
        assert_eq!(
            sig(Prop::ExecEx(
                "ExecStopEx",
                vec!["/bin/x".into()],
                vec!["privileged"]
            )),
            "a(sasas)"
        );
        assert_eq!(
            sig(Prop::Binds("BindPaths", vec![("a".into(), "b".into())])),
            "a(ssbt)"
        );
        assert_eq!(
            sig(Prop::TmpFs(
                "TemporaryFileSystem",
                vec![("a".into(), "ro".into())]
            )),
            "a(ss)"
        );
        assert_eq!(sig(Prop::U32("UMask", 7)), "u");
        assert_eq!(
            sig(Prop::AllowList(
                "RestrictAddressFamilies",
                vec!["AF_UNIX".into()]
            )),
            "(bas)"
        );
        assert_eq!(sig(Prop::Strs("Environment", vec!["A=b".into()])), "as");
        assert_eq!(sig(Prop::Bytes("AllowedCPUs", vec![3])), "ay");
    }
}
