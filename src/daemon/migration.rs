//! Live migration between two kvirtds: the migration port (the tunnel of
//! [`crate::host::tunnel`], served with this host's kvirt identity so that
//! only other kvirtds reach it) and the conversation over it.
//!
//! The source keeps its mark before anything else, asks the target to
//! prepare (the target keeps its own mark with the VMI, and its loop makes
//! everything but the domain), carries the daemons' and QEMUs' sockets to
//! the target and has libvirt move the domain; then the target takes the
//! VMI on (its manifest, standalone) and the source lets it go. A kvirtd
//! that dies midway finds its marks when it starts again: the source then
//! finishes the conversation from what its daemon shows (the domain gone:
//! it left, so commit; still here: abort), and neither host ever starts
//! the VM a second time.

use crate::core::drain::{self, Strategy};
use crate::core::key::VmKey;
use crate::core::migration::{self, Mark, MigrationPhase, MigrationState, ToSource, ToTarget};
use crate::core::plan::{DomainState, Migrating};
use crate::core::trigger::Trigger;
use crate::core::vmi::{VirtualMachineInstance, VmiStatus};
use crate::daemon::api::reload::Reloading;
use crate::daemon::api::tls::{Identity, TlsError, SERVICE_NAME};
use crate::daemon::controller::{now_rfc3339, Adapters, Controller, Leaving};
use crate::host::beneath::Beneath;
use crate::host::migrate::{MigrateTo, Progress};
use crate::host::tunnel::{self, Channel, ControlConn, Forward, Peer, Route, Routes};
use crate::sources::Handover;
use futures::future::BoxFuture;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn, Instrument};

#[derive(Debug, thiserror::Error)]
pub enum MigrationPortError {
    #[error("the migration port's identity: {0}")]
    Tls(#[from] TlsError),
    #[error("binding the migration port {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The directory below a VM's runtime directory where a migration's
/// sockets are, on both hosts (the source's ends kvirtd's, the target's
/// its QEMU's).
const DIR: &str = "migration";
const MEMORY: &str = "memory.sock";
const DISKS: &str = "disks.sock";
const DAEMON: &str = "daemon.sock";
/// How long the target may take to prepare (an image pull included).
const PREPARE: Duration = Duration::from_secs(300);
/// How long an answer to a commit or an abort may take.
const ANSWER: Duration = Duration::from_secs(30);
/// How long an arrival whose source went silent waits for it, when no
/// domain came.
const SETTLE: Duration = Duration::from_secs(30);
/// How often a running migration's figures are read (for its object's
/// status and the metrics).
const FIGURES: Duration = Duration::from_secs(2);
/// How often a departure left unfinished (its commit's answer lost, the
/// target away) is tried again, as a restart would.
const RETRY: Duration = Duration::from_secs(30);

/// How kvirtd takes part in migrations.
#[derive(Clone)]
pub struct Setup {
    /// The migration port; `None`: this host takes no migrations (it may
    /// still send VMs away).
    pub listen: Option<SocketAddr>,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// Where a VMI's ownership lives (its manifest, or its node in the
    /// API server), handed over when its VM moves.
    pub handover: Arc<dyn Handover>,
    /// The longest a migration may run before it is aborted.
    pub timeout: Duration,
    /// A drain's strategy for a VMI that names none.
    pub eviction_strategy: Strategy,
    /// At most this many MiB/s per migration object's migration
    /// (KubeVirt's `bandwidthPerMigration`); `None`: unlimited.
    pub bandwidth: Option<u64>,
    /// Told when the host's cordon changes: in a cluster the heartbeat
    /// announces it at once (the leader places no new VMI on a cordoned
    /// host, and learns of the cordon from the Lease).
    pub announce: Arc<tokio::sync::Notify>,
}

/// What kvirtctl's `migrate` asks of kvirtd.
pub trait Migrate: Send + Sync + 'static {
    /// Moves the VM `key` to the kvirtd whose migration port is `to`, at
    /// most `bandwidth` MiB/s when given; the answer says how it went.
    fn migrate(
        &self,
        key: VmKey,
        to: SocketAddr,
        bandwidth: Option<u64>,
    ) -> BoxFuture<'_, Result<String, String>>;
    /// Cordons the host (`true`: it takes no VM arriving, kept across
    /// restarts) or lifts it.
    fn cordon(&self, on: bool) -> Result<(), String>;
    /// What a drain does with each VM that runs here now.
    fn drain_plan(&self) -> Vec<(VmKey, drain::Action)>;
    /// The VMs not ended here.
    fn still_here(&self) -> Vec<VmKey>;
    /// Whether this host's VMIs are its manifests (standalone), which it
    /// may move and stop itself; in a cluster they are the API server's.
    fn standalone(&self) -> bool;
    /// Moves the VM `key` for a cluster's migration object (see
    /// [`Object`]) to the kvirtd whose migration port is `to`.
    fn migrate_object(
        &self,
        _key: VmKey,
        _to: SocketAddr,
        _object: Object,
    ) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async { Err("this host takes no migration objects".to_string()) })
    }
    /// Aborts the migration of `key` under way, if any: the VM stays.
    fn cancel(&self, _key: &VmKey) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Err("this host cancels no migrations".to_string()) })
    }
    /// Whether `key` bears a mark of a migration away from here (one a
    /// kvirtd began, which its recovery ends).
    fn departing(&self, _key: &VmKey) -> bool {
        false
    }
}

/// A cluster's `VirtualMachineInstanceMigration`, as its migration runs.
pub struct Object {
    /// Its uid: the migration's, on both hosts.
    pub uid: String,
    /// The host it goes to.
    pub node: String,
    /// Each phase the migration reaches, as it reaches it, and its
    /// figures while it moves the guest.
    pub progress: UnboundedSender<Step>,
}

/// What a migration object's migration tells as it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Phase(MigrationPhase),
    Figures(Progress),
}

/// Migrations, both ways, of one kvirtd.
pub struct Migrations<A: Adapters> {
    ctl: Arc<Controller<A>>,
    triggers: UnboundedSender<Trigger>,
    routes: Routes,
    client: Reloading<Arc<rustls::ClientConfig>>,
    setup: Setup,
    /// Arrivals committed since kvirtd started, by migration uid: a commit
    /// repeated (its answer lost) is answered again.
    committed: Mutex<HashSet<String>>,
    /// The VMs being sent or recovered now, by id: their marks are theirs.
    /// `true`: the send is cancelled (its migration object deleted).
    sending: Mutex<HashMap<String, bool>>,
}

/// A VM being sent or recovered, for as long as this lives.
struct Sending<'a> {
    set: &'a Mutex<HashMap<String, bool>>,
    id: String,
}

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        lock(self.set).remove(&self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl<A: Adapters> Migrations<A> {
    /// Serves the migration port (when configured) and finishes what a
    /// previous kvirtd left midway.
    pub async fn start(
        setup: Setup,
        ctl: Arc<Controller<A>>,
        triggers: UnboundedSender<Trigger>,
    ) -> Result<Arc<Self>, MigrationPortError> {
        // Read again whenever the files change: a renewed certificate or
        // a new CA serves the next connection, both ways.
        let files = || (setup.cert.clone(), setup.key.clone(), setup.ca.clone());
        let (cert, key, ca) = files();
        let client = Reloading::new(cert, key, ca, Identity::tunnel_client_config)?;
        let this = Arc::new(Self {
            ctl,
            triggers,
            routes: Routes::default(),
            client,
            setup: setup.clone(),
            committed: Mutex::default(),
            sending: Mutex::default(),
        });
        if let Some(listen) = setup.listen {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|source| MigrationPortError::Bind {
                    addr: listen,
                    source,
                })?;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<ControlConn>();
            let (cert, key, ca) = files();
            let tls = Reloading::new(cert, key, ca, Identity::tunnel_server_config)?;
            let routes = this.routes.clone();
            tokio::spawn(tunnel::serve(listener, move || tls.get(), routes, Some(tx)));
            let me = this.clone();
            tokio::spawn(async move {
                while let Some((uid, stream)) = rx.recv().await {
                    tokio::spawn(me.clone().receive(uid, stream));
                }
            });
            info!(%listen, "serving the migration port");
        }
        tokio::spawn(this.clone().recover());
        tokio::spawn(this.clone().retry_departures());
        Ok(this)
    }

    fn peer(&self, address: SocketAddr) -> Peer {
        Peer {
            address,
            name: rustls::pki_types::ServerName::try_from(SERVICE_NAME).expect("a DNS name"),
            tls: self.client.get(),
        }
    }

    fn wake(&self, id: &str) {
        let _ = self.triggers.send(Trigger::Vm(id.into()));
    }
}

impl<A: Adapters> Migrate for Migrations<A> {
    fn migrate(
        &self,
        key: VmKey,
        to: SocketAddr,
        bandwidth: Option<u64>,
    ) -> BoxFuture<'_, Result<String, String>> {
        let span = crate::host::journal::vm_span(&key.id(), Some(&key));
        Box::pin(async move { self.send(&key, to, bandwidth, None).await }.instrument(span))
    }

    fn migrate_object(
        &self,
        key: VmKey,
        to: SocketAddr,
        object: Object,
    ) -> BoxFuture<'_, Result<String, String>> {
        let span = crate::host::journal::vm_span(&key.id(), Some(&key));
        let bandwidth = self.setup.bandwidth;
        Box::pin(async move { self.send(&key, to, bandwidth, Some(object)).await }.instrument(span))
    }

    fn cancel(&self, key: &VmKey) -> BoxFuture<'_, Result<(), String>> {
        let id = key.id();
        let dom = self.ctl.domain_of(key);
        Box::pin(async move {
            match lock(&self.sending).get_mut(&id) {
                Some(cancelled) => *cancelled = true,
                None => return Err(format!("no migration of {id} runs here")),
            }
            // Moving already: its job aborted, the domain stays. Before
            // that, the send sees the cancel before it moves the domain.
            self.ctl.abort_job(&dom).await.map_err(|e| e.to_string())
        })
    }

    fn cordon(&self, on: bool) -> Result<(), String> {
        self.ctl.set_cordoned(on)?;
        self.setup.announce.notify_one();
        Ok(())
    }

    fn departing(&self, key: &VmKey) -> bool {
        // A mark that cannot be read is taken as one: recovery decides.
        match self.ctl.mark(&key.id()) {
            Ok(m) => m.is_some_and(|m| m.role == Migrating::Outgoing),
            Err(_) => true,
        }
    }

    fn drain_plan(&self) -> Vec<(VmKey, drain::Action)> {
        let default = self.setup.eviction_strategy;
        self.ctl
            .live_vmis()
            .iter()
            .filter_map(|vmi| {
                let key = vmi.key().ok()?;
                let vm = owning_vm(vmi);
                let c = drain::Candidate {
                    strategy: Strategy::of(vmi, default),
                    may_leave: migration::may_leave(vmi),
                    vm: vm.as_ref(),
                    cluster: !self.standalone(),
                };
                Some((key, drain::decide(&c)))
            })
            .collect()
    }

    fn standalone(&self) -> bool {
        self.setup.handover.standalone()
    }

    fn still_here(&self) -> Vec<VmKey> {
        let vmis = self.ctl.live_vmis();
        vmis.iter().filter_map(|v| v.key().ok()).collect()
    }
}

/// The VirtualMachine that owns `vmi`, if one does.
fn owning_vm(vmi: &VirtualMachineInstance) -> Option<VmKey> {
    let owner = vmi
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.kind == "VirtualMachine")?;
    VmKey::new(vmi.key().ok()?.namespace(), &owner.name).ok()
}

// ---- the source ----

impl<A: Adapters> Migrations<A> {
    async fn send(
        &self,
        key: &VmKey,
        to: SocketAddr,
        bandwidth: Option<u64>,
        object: Option<Object>,
    ) -> Result<String, String> {
        let started = Instant::now();
        let leaving = self.ctl.leaving(key)?;
        let vmi_uid = leaving.vmi.uid().unwrap_or_default().to_owned();
        let handover = &self.setup.handover;
        if object.is_none() && !handover.standalone() {
            return Err("in a cluster, a VirtualMachineInstanceMigration moves a VMI".into());
        }
        handover.may_let_go(key, &vmi_uid)?;
        let uid = match &object {
            Some(o) => o.uid.clone(),
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                migration::new_uid(&vmi_uid, self.ctl.node_name(), nanos)
            }
        };
        let progress = |step| {
            if let Some(o) = &object {
                let _ = o.progress.send(step);
            }
        };
        let id = key.id();
        let mark = Mark {
            migration_uid: uid.clone(),
            role: Migrating::Outgoing,
            vmi_uid,
            peer: to.to_string(),
            vmi: None,
            committed: false,
        };
        let Some(_sending) = self.busy(&id) else {
            return Err(format!(
                "{key} stays here: it takes part in another migration here"
            ));
        };
        // Kept first: from here a kvirtd restarted never starts it here again.
        self.ctl
            .claim_mark(&id, &mark)
            .map_err(|e| format!("{key} stays here: {e}"))?;
        info!(migration = %uid, %to, "migrating");
        let mut state = MigrationState::started(&uid, self.ctl.node_name(), &now_rfc3339());
        state.target_node_address = to.to_string();
        if let Some(o) = &object {
            state.target_node.clone_from(&o.node);
        }
        self.ctl.set_migration_state(&id, &state);
        // Shown while it runs (and read by a kvirtd restarted meanwhile).
        self.wake(&id);
        let sent = self
            .send_marked(&leaving, &uid, self.peer(to), bandwidth, &progress)
            .await;
        if sent.is_ok() {
            progress(Step::Phase(MigrationPhase::Succeeded));
        }
        self.sent(key, to, &leaving, state, started, sent).await
    }

    /// How a migration sent ended: the VM handed over to the target (its
    /// time and pause counted), or kept here with its state saying why.
    async fn sent(
        &self,
        key: &VmKey,
        to: SocketAddr,
        leaving: &Leaving,
        state: MigrationState,
        started: Instant,
        sent: Result<Option<Duration>, Failed>,
    ) -> Result<String, String> {
        let id = key.id();
        let uid = state.migration_uid.clone();
        match sent {
            Ok(downtime) => {
                let done = state.ended(&now_rfc3339(), Ok(()));
                if let Err(e) = self.let_go(&id, &leaving.vmi, &done).await {
                    // It runs at the target: the mark stays, and the
                    // retry hands it over.
                    return Err(format!("{key} left for {to}, but {e}"));
                }
                let took = started.elapsed();
                self.ctl.metrics().migration(Some((took, downtime)));
                let paused = downtime.map_or_else(
                    || "the guest's pause not known".into(),
                    |d| format!("the guest paused {} ms", d.as_millis()),
                );
                let m = format!(
                    "{key} moved to {to} in {:.1} s, {paused} (migration {uid})",
                    took.as_secs_f64()
                );
                info!("{m}");
                Ok(m)
            }
            Err(Failed { reason, left }) => {
                self.ctl.metrics().migration(None);
                if left {
                    // It runs at the target, which did not answer the
                    // commit: the mark stays, and the next start commits.
                    return Err(format!(
                        "{key} left for {to}, but the target did not confirm: {reason}"
                    ));
                }
                let failed = state.ended(&now_rfc3339(), Err(&reason));
                self.ctl.set_migration_state(&id, &failed);
                if let Err(e) = self.ctl.clear_mark(&id) {
                    warn!("{e}");
                }
                self.wake(&id);
                warn!(migration = %uid, "migration failed, the VM runs on here: {reason}");
                Err(format!("{key} stays here: {reason}"))
            }
        }
    }

    /// Prepare, move, commit; on failure before the domain left, the
    /// target is told to abort. Moved: the guest's pause, if known.
    async fn send_marked(
        &self,
        l: &Leaving,
        uid: &str,
        peer: Peer,
        bandwidth: Option<u64>,
        progress: &(dyn Fn(Step) + Sync),
    ) -> Result<Option<Duration>, Failed> {
        let stay = |reason: String| Failed {
            reason,
            left: false,
        };
        progress(Step::Phase(MigrationPhase::PreparingTarget));
        let mut control = dial_control(&peer, uid).await.map_err(stay)?;
        let mut vmi = l.vmi.clone();
        vmi.status = VmiStatus::default();
        let prepare = ToTarget::Prepare {
            vmi: Box::new(vmi),
            source_node: self.ctl.node_name().into(),
            bases: l.bases.clone(),
        };
        match ask(&mut control, &prepare, PREPARE).await {
            Ok(ToSource::Ready) => {}
            Ok(ToSource::Refused { reason }) => return Err(stay(format!("the target: {reason}"))),
            Ok(other) => return Err(stay(format!("the target answered {other:?}"))),
            Err(e) => return Err(stay(format!("preparing the target: {e}"))),
        }
        progress(Step::Phase(MigrationPhase::TargetReady));
        if self.cancelled(&l.key.id()) {
            let reason = "cancelled: its migration object was deleted".to_string();
            abort(&mut control, &reason).await;
            return Err(stay(reason));
        }
        progress(Step::Phase(MigrationPhase::Running));
        let figures = |p: Progress| {
            self.ctl.metrics().migrating(&l.key, Some(&p));
            progress(Step::Figures(p));
        };
        let moved = self.move_domain(l, uid, &peer, bandwidth, &figures).await;
        self.ctl.metrics().migrating(&l.key, None);
        let left = match &moved {
            Ok(()) => true,
            // libvirt may fail after the switch-over (its confirm step):
            // what the daemon shows decides.
            Err(_) => matches!(self.ctl.domain_here(&l.dom).await, Ok(false)),
        };
        if !left {
            let reason = moved.err().unwrap_or_default();
            return match abort(&mut control, &reason).await {
                // Running there already: the target's word is final.
                Some(ToSource::Committed { downtime_ms }) => {
                    Ok(downtime_ms.map(Duration::from_millis))
                }
                _ => Err(stay(reason)),
            };
        }
        let vmi_uid = l.vmi.uid().unwrap_or_default();
        commit(Some(&mut control), uid, vmi_uid, &peer)
            .await
            .map_err(|e| match e {
                // Gone here (its unit stopped midway) and not there: the
                // loop finds it ended.
                Unconfirmed::NotHere(r) => stay(format!("the VM ended before it arrived: {r}")),
                Unconfirmed::Silent(reason) => Failed { reason, left: true },
            })
    }

    /// The sockets the source's daemon and QEMU reach the target by, each
    /// carried to it; then libvirt's migration.
    async fn move_domain(
        &self,
        l: &Leaving,
        uid: &str,
        peer: &Peer,
        bandwidth: Option<u64>,
        figures: &(dyn Fn(Progress) + Sync),
    ) -> Result<(), String> {
        let dir = Beneath::open(&l.paths.runtime_dir)
            .and_then(|d| d.mkdir(DIR, 0o755, Some((0, 0))))
            .map_err(|e| format!("{}/{DIR}: {e}", l.paths.runtime_dir.display()))?;
        let mut forwards: Vec<Forward> = Vec::new();
        for (name, channel) in [
            (DAEMON, Channel::Daemon),
            (MEMORY, Channel::Memory),
            (DISKS, Channel::Disks),
        ] {
            let listener = dir
                .remove(name)
                .and_then(|()| dir.bind_socket(name, Some((l.owner.uid, l.owner.gid))))
                .and_then(|s| {
                    s.set_nonblocking(true)?;
                    tokio::net::UnixListener::from_std(s)
                })
                .map_err(|e| format!("binding {DIR}/{name}: {e}"))?;
            forwards.push(tunnel::forward(listener, peer.clone(), uid, channel));
        }
        // The paths as the VM's unit sees them, the same on both hosts.
        let seen = l.paths.unit_runtime_dir().join(DIR);
        let to = MigrateTo {
            daemon_socket: seen.join(DAEMON),
            memory_socket: seen.join(MEMORY),
            disks_socket: seen.join(DISKS),
            copied_disks: l.copied.clone(),
            dest_xml: None,
            bandwidth_mib: bandwidth,
        };
        let moving = self.ctl.move_domain(&l.dom, &to, self.setup.timeout);
        let r = self.watching(moving, l, figures).await;
        drop(forwards);
        for name in [DAEMON, MEMORY, DISKS] {
            let _ = dir.remove(name);
        }
        r.map_err(|e| e.to_string())
    }

    /// Runs `moving`, giving the job's figures to `figures` every
    /// [`FIGURES`] meanwhile.
    async fn watching<T>(
        &self,
        moving: impl std::future::Future<Output = T>,
        l: &Leaving,
        figures: &(dyn Fn(Progress) + Sync),
    ) -> T {
        let mut moving = std::pin::pin!(moving);
        let mut tick = tokio::time::interval(FIGURES);
        loop {
            tokio::select! {
                r = &mut moving => return r,
                _ = tick.tick() => {
                    if let Some(p) = self.ctl.job_progress(&l.dom).await {
                        figures(p);
                    }
                }
            }
        }
    }

    /// The VM is the target's: its VMI goes to it (the loop then tears
    /// down what is left here, and clears the mark once nothing is). Its
    /// status is no longer this host's to write.
    async fn let_go(
        &self,
        id: &str,
        vmi: &VirtualMachineInstance,
        state: &MigrationState,
    ) -> Result<(), String> {
        self.ctl.hand_over(id);
        let r = self.setup.handover.let_go(vmi, state).await;
        if r.is_err() {
            self.ctl.keep(id);
        }
        self.wake(id);
        r
    }

    /// What a previous kvirtd left midway. As the source: the domain gone
    /// from its daemon means it left (commit, then let go); still here, its
    /// job is aborted and the target told (which keeps the VM only if it
    /// runs there already). As the target: see [`Self::settle_arrival`].
    async fn recover(self: Arc<Self>) {
        for (id, mark) in self.ctl.marks() {
            let span = crate::host::journal::vm_span(&id, None);
            match mark.role {
                Migrating::Outgoing => self.recover_outgoing(&id, mark).instrument(span).await,
                Migrating::Incoming => {
                    let uid = mark.migration_uid;
                    tokio::spawn(self.clone().settle_arrival(uid).instrument(span));
                }
            }
        }
    }

    /// Departures no send is finishing (its commit's answer was lost, or
    /// the target was away) are finished as a restart would, now and then:
    /// a source that let go late is better than one that holds a VM's
    /// manifest until its next start.
    async fn retry_departures(self: Arc<Self>) {
        loop {
            tokio::time::sleep(RETRY).await;
            for (id, mark) in self.ctl.marks() {
                if mark.role != Migrating::Outgoing {
                    continue;
                }
                let span = crate::host::journal::vm_span(&id, None);
                self.recover_outgoing(&id, mark).instrument(span).await;
            }
        }
    }

    /// Marks `id` as sent or recovered by the caller until the guard
    /// drops; `None`: another send or recovery has it.
    fn busy(&self, id: &str) -> Option<Sending<'_>> {
        let mut sending = lock(&self.sending);
        if sending.contains_key(id) {
            return None;
        }
        sending.insert(id.to_owned(), false);
        Some(Sending {
            set: &self.sending,
            id: id.to_owned(),
        })
    }

    /// Whether the send of `id` was cancelled.
    fn cancelled(&self, id: &str) -> bool {
        lock(&self.sending).get(id).copied().unwrap_or(false)
    }

    async fn recover_outgoing(&self, id: &str, mark: Mark) {
        let Some(_busy) = self.busy(id) else { return };
        let Ok(peer) = mark.peer.parse::<SocketAddr>().map(|a| self.peer(a)) else {
            return warn!("migration mark of {id}: bad peer {:?}", mark.peer);
        };
        let Some(key) = self.ctl.view_vmi(id).and_then(|v| v.key().ok()) else {
            // Its VMI is gone from here: the loop clears the mark.
            return self.wake(id);
        };
        let dom = self.ctl.domain_of(&key);
        let uid = mark.migration_uid.clone();
        let mut here = self.ctl.domain_here(&dom).await;
        if let Ok(true) = here {
            // Its job may still run (the daemon carries on without its
            // client): aborted, it ends one way or the other.
            let _ = self.ctl.abort_job(&dom).await;
            self.ctl.until_no_job(&dom, ANSWER).await;
            here = self.ctl.domain_here(&dom).await;
        }
        let left = match here {
            Ok(true) => {
                let reason = "the source kvirtd restarted midway";
                let answer = match dial_control(&peer, &uid).await {
                    Ok(mut c) => abort(&mut c, reason).await,
                    Err(e) => {
                        warn!(migration = %uid, "telling the target: {e}");
                        None
                    }
                };
                matches!(answer, Some(ToSource::Committed { .. }))
            }
            Ok(false) => {
                match commit::<tunnel::ClientStream>(None, &uid, &mark.vmi_uid, &peer).await {
                    Ok(_) => true,
                    Err(Unconfirmed::NotHere(r)) => {
                        info!(migration = %uid, "the VM ended before it arrived: {r}");
                        false
                    }
                    Err(Unconfirmed::Silent(e)) => {
                        return warn!(migration = %uid, "the target did not confirm: {e}")
                    }
                }
            }
            Err(e) => return warn!(migration = %uid, "recovering: {e}"),
        };
        if left {
            info!(migration = %uid, "a migration left unfinished ended at the target");
            let Some(vmi) = self.ctl.view_vmi(id) else {
                return self.wake(id);
            };
            let state = self.ctl.migration_state(id).unwrap_or_else(|| {
                MigrationState::started(&uid, self.ctl.node_name(), &now_rfc3339())
            });
            if let Err(e) = self
                .let_go(id, &vmi, &state.ended(&now_rfc3339(), Ok(())))
                .await
            {
                warn!(migration = %uid, "{e}");
            }
        } else {
            info!(migration = %uid, "a migration left unfinished did not end: the VM stays");
            // Its state says so, for its migration object (if any) to end.
            let state = self.ctl.migration_state(id);
            let state = state.filter(|s| s.migration_uid == uid).unwrap_or_else(|| {
                MigrationState::started(&uid, self.ctl.node_name(), &now_rfc3339())
            });
            let reason = "the source kvirtd restarted midway";
            self.ctl
                .set_migration_state(id, &state.ended(&now_rfc3339(), Err(reason)));
            if let Err(e) = self.ctl.clear_mark(id) {
                warn!("{e}");
            }
            self.wake(id);
        }
    }
}

/// The migration's control channel to the target.
async fn dial_control(peer: &Peer, uid: &str) -> Result<tunnel::ClientStream, String> {
    tunnel::dial(peer, &tunnel::header(uid, Channel::Control))
        .await
        .map_err(|e| e.to_string())
}

/// Tells the target it owns the VM now: on `control` if given, then on
/// new connections (the answer lost, or the source restarted), until it
/// confirms, says the VM is not there, or [`ANSWER`] passes. Confirmed:
/// the guest's pause, if known.
async fn commit<S: AsyncRead + AsyncWrite + Unpin>(
    control: Option<&mut S>,
    uid: &str,
    vmi_uid: &str,
    peer: &Peer,
) -> Result<Option<Duration>, Unconfirmed> {
    let message = ToTarget::Commit {
        vmi_uid: vmi_uid.into(),
    };
    let decided = |answer: &Result<ToSource, String>| match answer {
        Ok(ToSource::Committed { downtime_ms }) => Some(Ok(downtime_ms.map(Duration::from_millis))),
        Ok(ToSource::NotHere { reason }) => Some(Err(Unconfirmed::NotHere(reason.clone()))),
        _ => None,
    };
    if let Some(c) = control {
        if let Some(d) = decided(&ask(c, &message, ANSWER).await) {
            return d;
        }
    }
    let deadline = Instant::now() + ANSWER;
    loop {
        let last = match dial_control(peer, uid).await {
            Ok(mut c) => {
                let answer = ask(&mut c, &message, ANSWER).await;
                if let Some(d) = decided(&answer) {
                    return d;
                }
                match answer {
                    Ok(other) => format!("the target answered {other:?}"),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        if Instant::now() > deadline {
            return Err(Unconfirmed::Silent(last));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Tells the target to abort; its answer, if it gives one in time
/// (`Committed`: the VM runs there already, and stays).
async fn abort<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, reason: &str) -> Option<ToSource> {
    let message = ToTarget::Abort {
        reason: reason.into(),
    };
    ask(s, &message, ANSWER).await.ok()
}

/// The target's no to a source, said in its log too.
fn refused(uid: &str, reason: String) -> ToSource {
    warn!(migration = %uid, "refused: {reason}");
    ToSource::Refused { reason }
}

/// A failed migration: why, and whether the domain left all the same.
struct Failed {
    reason: String,
    left: bool,
}

/// A commit the target did not confirm.
enum Unconfirmed {
    /// The target answered that the VM does not run there.
    NotHere(String),
    /// No answer, or another one: the target may run the VM.
    Silent(String),
}

async fn ask<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    message: &ToTarget,
    wait: Duration,
) -> Result<ToSource, String> {
    tunnel::write_message(s, message)
        .await
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout(wait, tunnel::read_message::<_, ToSource>(s)).await {
        Ok(Ok(Some(a))) => Ok(a),
        Ok(Ok(None)) => Err("the target closed the connection".into()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {} s", wait.as_secs())),
    }
}

// ---- the target ----

impl<A: Adapters> Migrations<A> {
    /// One control connection from a source: a new migration's prepare,
    /// then its commit or abort; or (a source that restarted) one of those
    /// alone.
    async fn receive(self: Arc<Self>, uid: String, mut stream: tunnel::ControlStream) {
        loop {
            let message = match tunnel::read_message::<_, ToTarget>(&mut stream).await {
                Ok(Some(m)) => m,
                Ok(None) | Err(_) => {
                    // The source went silent: it comes back to finish, or
                    // this host's daemon decides (an arrival only).
                    tokio::spawn(self.clone().settle_arrival(uid));
                    return;
                }
            };
            let answer = match message {
                ToTarget::Prepare {
                    vmi,
                    source_node,
                    bases,
                } => self.prepare(&uid, *vmi, &source_node, &bases).await,
                ToTarget::Commit { vmi_uid } => self.take_on(&uid, &vmi_uid).await,
                ToTarget::Abort { reason } => self.call_off(&uid, &reason).await,
            };
            if tunnel::write_message(&mut stream, &answer).await.is_err() {
                return;
            }
        }
    }

    fn arrival(&self, uid: &str) -> Option<(String, Mark)> {
        self.ctl
            .marks()
            .into_iter()
            .find(|(_, m)| m.migration_uid == uid && m.role == Migrating::Incoming)
    }

    async fn prepare(
        &self,
        uid: &str,
        vmi: VirtualMachineInstance,
        source: &str,
        bases: &BTreeMap<String, String>,
    ) -> ToSource {
        let refuse = |reason: String| refused(uid, reason);
        if self.ctl.cordoned() {
            return refuse("this host is cordoned (kvirtctl uncordon lifts it)".into());
        }
        let key = match self.ctl.may_arrive(&vmi) {
            Ok(k) => k,
            Err(e) => return refuse(e),
        };
        let span = crate::host::journal::vm_span(&key.id(), Some(&key));
        // Instrumented, not entered: a span entered across an await would
        // name this VM in other tasks' lines on the same thread.
        self.arrive(uid, key, vmi, source, bases)
            .instrument(span)
            .await
    }

    /// The arrival's mark kept, its VMI held for the loop, then ready once
    /// the VM's daemon listens over the same bases.
    async fn arrive(
        &self,
        uid: &str,
        key: VmKey,
        vmi: VirtualMachineInstance,
        source: &str,
        bases: &BTreeMap<String, String>,
    ) -> ToSource {
        let refuse = |reason: String| refused(uid, reason);
        let id = key.id();
        let mark = Mark {
            migration_uid: uid.into(),
            role: Migrating::Incoming,
            vmi_uid: vmi.uid().unwrap_or_default().into(),
            peer: source.into(),
            vmi: Some(Box::new(vmi.clone())),
            committed: false,
        };
        if let Err(e) = self.ctl.claim_mark(&id, &mark) {
            return refuse(format!("{key}: {e}"));
        }
        info!(migration = %uid, from = source, "preparing for an arriving VM");
        let spec = vmi.spec.clone();
        self.ctl.arrive(&key, vmi);
        let mut state = MigrationState::started(uid, source, &now_rfc3339());
        state.target_node = self.ctl.node_name().into();
        self.ctl.set_migration_state(&id, &state);
        self.wake(&id);
        let ready = self.until_daemon_listens(&id).await.and_then(|route| {
            // The overlays are made (before the unit): over the same bases?
            let here = self.ctl.overlay_bases(&id, &spec)?;
            migration::same_bases(bases, &here).map(|()| route)
        });
        match ready {
            Ok(route) => {
                self.routes.add(uid, route);
                ToSource::Ready
            }
            Err(reason) => {
                self.drop_arrival(uid, &reason);
                refuse(reason)
            }
        }
    }

    /// Waits for the arrival's daemon (made by the loop's pass) to listen;
    /// then the migration's directory is made for its QEMU to listen in.
    async fn until_daemon_listens(&self, id: &str) -> Result<Route, String> {
        let paths = self.ctl.paths(id);
        let daemon = self.ctl.daemon_socket(id);
        let rel = daemon
            .strip_prefix(&paths.runtime_dir)
            .map_err(|_| "the daemon's socket is outside the VM's directory".to_string())?
            .to_owned();
        let deadline = Instant::now() + PREPARE;
        let owner = loop {
            let owner = self.ctl.owner(id);
            let listening = owner.and_then(|o| {
                let (_, uid) = Beneath::open(&paths.runtime_dir)
                    .and_then(|d| d.socket(&rel))
                    .and_then(|s| s.listener())
                    .ok()?;
                (uid == o.uid).then_some(o)
            });
            if let Some(o) = listening {
                break o;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the VM's daemon did not listen within {} s",
                    PREPARE.as_secs()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        Beneath::open(&paths.runtime_dir)
            .and_then(|d| d.mkdir(DIR, 0o700, Some((owner.uid, owner.gid))))
            .map_err(|e| format!("{}/{DIR}: {e}", paths.runtime_dir.display()))?;
        let sockets = HashMap::from([
            (Channel::Daemon, rel.to_string_lossy().into_owned()),
            (Channel::Memory, format!("{DIR}/{MEMORY}")),
            (Channel::Disks, format!("{DIR}/{DISKS}")),
        ]);
        Ok(Route {
            dir: paths.runtime_dir,
            sockets,
        })
    }

    /// The source says the VM runs here now: its VMI is taken on (its
    /// manifest written, so this host lists it as its own; in a cluster,
    /// held by its mark until the source's handover lists it here).
    async fn take_on(&self, uid: &str, vmi_uid: &str) -> ToSource {
        let committed = |s: &Self| lock(&s.committed).contains(uid);
        let Some((id, mark)) = self.arrival(uid) else {
            if committed(self) || self.runs_here(vmi_uid).await {
                return ToSource::Committed { downtime_ms: None };
            }
            return ToSource::NotHere {
                reason: format!("no migration {uid} arriving here, nor the VM running"),
            };
        };
        if mark.committed {
            // A commit repeated (its answer lost): taken on already.
            return ToSource::Committed { downtime_ms: None };
        }
        // libvirt resumes the guest here only at the switch-over: a domain
        // not running (or gone) means the source's ended before it.
        if self.arrival_state(uid).await != Some(DomainState::Running) {
            let reason = "the VM's domain does not run here";
            self.drop_arrival(uid, reason);
            return ToSource::NotHere {
                reason: reason.into(),
            };
        }
        let Some(vmi) = &mark.vmi else {
            return ToSource::Refused {
                reason: "the arrival's mark holds no VMI".into(),
            };
        };
        // Read while the arrival is still marked (the answer carries it).
        let downtime = match vmi.key() {
            Ok(key) => self.ctl.arrival_downtime(&self.ctl.domain_of(&key)).await,
            Err(_) => None,
        };
        let downtime_ms = downtime.map(|d| d.as_millis() as u64);
        let _in = crate::host::journal::vm_span(&id, None).entered();
        match self.setup.handover.take_on(vmi) {
            Ok(true) => {
                info!(migration = %uid, ?downtime_ms, "the VM arrived: it runs here now");
                if let Some(state) = self.ctl.migration_state(&id) {
                    self.ctl
                        .set_migration_state(&id, &state.ended(&now_rfc3339(), Ok(())));
                }
                if let Err(e) = self.ctl.clear_mark(&id) {
                    // Its manifest holds it; the mark left only waits for a restart.
                    warn!("{e}");
                }
            }
            Ok(false) => {
                info!(migration = %uid, ?downtime_ms, "the VM arrived: it runs here, held until the source hands its VMI over");
                let mut held = mark.clone();
                held.committed = true;
                if let Err(e) = self.ctl.replace_mark(&id, &held) {
                    warn!("{e}");
                    return ToSource::Refused {
                        reason: format!("keeping the arrival: {e}"),
                    };
                }
            }
            Err(e) => {
                warn!("{e}");
                return ToSource::Refused { reason: e };
            }
        }
        self.routes.remove(uid);
        lock(&self.committed).insert(uid.into());
        self.wake(&id);
        ToSource::Committed { downtime_ms }
    }

    /// Whether the VMI of `vmi_uid` is this host's and runs here, with no
    /// migration of it under way: a commit repeated after this kvirtd
    /// restarted (its `committed` gone with it) finds the VM it took on.
    async fn runs_here(&self, vmi_uid: &str) -> bool {
        if vmi_uid.is_empty() {
            return false;
        }
        let Some(key) = self.ctl.vmi_key_of_uid(vmi_uid) else {
            return false;
        };
        if !matches!(self.ctl.mark(&key.id()), Ok(None)) {
            return false;
        }
        let state = self.ctl.domain_state(&self.ctl.domain_of(&key)).await;
        matches!(state, Ok(Some(DomainState::Running)))
    }

    /// The source asks to abort: granted unless the VM runs here already
    /// (the migration's switch-over done, the source's copy stopped):
    /// then it is this host's, and the answer says so.
    async fn call_off(&self, uid: &str, reason: &str) -> ToSource {
        if self.arrival_state(uid).await == Some(DomainState::Running) {
            return self.take_on(uid, "").await;
        }
        self.drop_arrival(uid, reason);
        ToSource::Refused {
            reason: format!("aborted: {reason}"),
        }
    }

    /// The arrival's domain state here, if it has an arrival and a domain.
    async fn arrival_state(&self, uid: &str) -> Option<DomainState> {
        let (_, mark) = self.arrival(uid)?;
        let key = mark.vmi.as_ref()?.key().ok()?;
        self.ctl
            .domain_state(&self.ctl.domain_of(&key))
            .await
            .ok()?
    }

    /// An arrival whose source went silent (it, or this kvirtd, restarted):
    /// the source's recovery finishes it if it comes back in time; else
    /// this host's daemon decides. The domain running here means the
    /// switch-over was done (libvirt resumes the guest at the target only
    /// then): the VM is this host's. Nothing here means it never came.
    /// An incoming (paused) domain waits for its source.
    async fn settle_arrival(self: Arc<Self>, uid: String) {
        let grace = Instant::now() + SETTLE;
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            if self.arrival(&uid).is_none() {
                return;
            }
            match self.arrival_state(&uid).await {
                Some(DomainState::Running) => {
                    info!(migration = %uid, "the source went silent, and the VM runs here: it arrived");
                    self.take_on(&uid, "").await;
                    return;
                }
                None if Instant::now() > grace => {
                    self.drop_arrival(&uid, "the source went silent before the VM came");
                    return;
                }
                _ => {}
            }
        }
    }

    /// The migration did not happen: what was prepared goes.
    fn drop_arrival(&self, uid: &str, reason: &str) {
        self.routes.remove(uid);
        let Some((id, mark)) = self.arrival(uid) else {
            return;
        };
        let _in = crate::host::journal::vm_span(&id, None).entered();
        info!(migration = %uid, "the arrival is called off: {reason}");
        if let Err(e) = self.ctl.clear_mark(&id) {
            return warn!("{e}");
        }
        if let Some(key) = mark.vmi.as_ref().and_then(|v| v.key().ok()) {
            self.ctl.abandon(&key, &mark.vmi_uid);
        }
        self.wake(&id);
    }
}
