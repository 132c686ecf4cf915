//! A cluster's `VirtualMachineInstanceMigration`s, acted on by the host
//! that runs their VMI (as KubeVirt's virt-controller and the source
//! virt-handler together): the target chosen among the live kvirt hosts
//! ([`crate::core::peers`]), the phases written as the migration passes
//! them, the VM moved by [`Migrate`], and a migration whose object is
//! deleted while it runs cancelled (the VM stays). Each host watches the
//! objects labelled for it (`HOST_LABEL`: the leader labels new ones,
//! `sources::cluster::routing`), hands on one whose VMI moved, and
//! [`object_action`] decides what it does with its own.

use crate::core::key::VmKey;
use crate::core::migration::{
    object_action, route, Here, Migration, MigrationPhase, MigrationState, ObjectAction, Route,
    HOST_LABEL,
};
use crate::core::peers;
use crate::core::progress;
use crate::daemon::controller::{now_rfc3339, VmiView};
use crate::daemon::migration::{Migrate, Object, Step};
use crate::sources::cluster::migrations::{phase_patch, KubeMigrations};
use crate::sources::cluster::routing::UNPLACED_AFTER;
use futures::StreamExt;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn, Instrument};

/// How often objects not final are looked at again: a migration a
/// restarted kvirtd's recovery ended shows on its VMI, not its object.
const SETTLE: Duration = Duration::from_secs(10);
/// The most often a running migration's figures are written to its object.
const FIGURES_EVERY: Duration = Duration::from_secs(5);

struct Runner {
    objects: KubeMigrations,
    node: String,
    view: Arc<dyn VmiView>,
    migrate: Arc<dyn Migrate>,
    /// The migrations this host runs now: object uid → its VM.
    running: Mutex<HashMap<String, VmKey>>,
    /// Objects labelled for this host whose VMI is not here (not begun,
    /// or begun by a source that could not finish): uid → when this host
    /// first saw them so.
    elsewhere: Mutex<HashMap<String, tokio::time::Instant>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Watches the migration objects until kvirtd stops.
pub async fn run(
    objects: KubeMigrations,
    node: String,
    view: Arc<dyn VmiView>,
    migrate: Arc<dyn Migrate>,
) {
    let runner = Arc::new(Runner {
        objects,
        node,
        view,
        migrate,
        running: Mutex::default(),
        elsewhere: Mutex::default(),
    });
    // The objects not final, by uid: looked at again on a period.
    let mut open: BTreeMap<String, Migration> = BTreeMap::new();
    let mine = watcher::Config::default().labels(&format!("{HOST_LABEL}={}", runner.node));
    let stream = watcher(runner.objects.all(), mine).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut tick = tokio::time::interval(SETTLE);
    loop {
        tokio::select! {
            event = stream.next() => match event {
                Some(Ok(watcher::Event::Apply(m) | watcher::Event::InitApply(m))) => {
                    let uid = m.metadata.uid.clone().unwrap_or_default();
                    if m.status.phase.is_some_and(MigrationPhase::is_final) {
                        open.remove(&uid);
                    } else {
                        open.insert(uid, m.clone());
                    }
                    runner.consider(&m);
                }
                Some(Ok(watcher::Event::Delete(m))) => {
                    let uid = m.metadata.uid.clone().unwrap_or_default();
                    open.remove(&uid);
                    lock(&runner.elsewhere).remove(&uid);
                    runner.cancel(&uid).await;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => warn!("watching VirtualMachineInstanceMigrations: {e}"),
                None => return,
            },
            _ = tick.tick() => {
                for m in open.values() {
                    runner.consider(m);
                }
            }
        }
    }
}

impl Runner {
    fn consider(self: &Arc<Self>, m: &Migration) {
        let uid = m.metadata.uid.clone().unwrap_or_default();
        if m.metadata.deletion_timestamp.is_some() {
            let me = self.clone();
            tokio::spawn(async move { me.cancel(&uid).await });
            return;
        }
        let ns = m.metadata.namespace.as_deref().unwrap_or("default");
        let Ok(key) = VmKey::new(ns, &m.spec.vmi_name) else {
            return;
        };
        let (Some(vmi), _) = self.view.view(&key.id()) else {
            let open = !m.status.phase.is_some_and(MigrationPhase::is_final);
            if open && !lock(&self.running).contains_key(&uid) {
                self.elsewhere(m, key);
            } else {
                lock(&self.elsewhere).remove(&uid);
            }
            return;
        };
        lock(&self.elsewhere).remove(&uid);
        let begun = m
            .status
            .phase
            .is_some_and(|p| p >= MigrationPhase::Scheduled);
        let here = Here {
            node: &self.node,
            running: lock(&self.running).contains_key(&uid),
            departing: begun && self.migrate.departing(&key),
        };
        match object_action(m, &vmi, &here) {
            ObjectAction::Ignore => {}
            ObjectAction::Finish(phase, reason) => {
                let me = self.clone();
                let m = m.clone();
                tokio::spawn(async move {
                    let mut state = None;
                    if let Some(r) = reason {
                        let s = MigrationState::started(&uid, &me.node, &now_rfc3339());
                        state = Some(s.ended(&now_rfc3339(), Err(&r)));
                    }
                    me.write(&m, phase, state.as_ref()).await;
                });
            }
            ObjectAction::Start => {
                lock(&self.running).insert(uid.clone(), key.clone());
                let me = self.clone();
                let m = m.clone();
                let span = crate::host::journal::vm_span(&key.id(), Some(&key));
                tokio::spawn(
                    async move {
                        me.start(&m, &vmi, &key).await;
                        lock(&me.running).remove(&uid);
                    }
                    .instrument(span),
                );
            }
        }
    }

    async fn write(&self, m: &Migration, phase: MigrationPhase, state: Option<&MigrationState>) {
        let patch = phase_patch(&m.spec.vmi_name, phase, state);
        if let Err(e) = self.objects.report(m, &patch).await {
            warn!("{e}");
        }
    }

    /// Chooses the target, then moves the VM, writing each phase.
    async fn start(
        &self,
        m: &Migration,
        vmi: &crate::core::vmi::VirtualMachineInstance,
        key: &VmKey,
    ) {
        let uid = m.metadata.uid.clone().unwrap_or_default();
        let name = m.metadata.name.clone().unwrap_or_default();
        self.write(m, MigrationPhase::Scheduling, None).await;
        let mut state = MigrationState::started(&uid, &self.node, &now_rfc3339());
        let target = match self.objects.peers().await {
            Ok(p) => peers::choose_target(vmi, m, &self.node, &p).and_then(|(node, addr)| {
                let addr: std::net::SocketAddr = addr
                    .parse()
                    .map_err(|e| format!("{node} announces migration port {addr:?}: {e}"))?;
                Ok((node, addr))
            }),
            Err(e) => Err(e),
        };
        let (node, addr) = match target {
            Ok(t) => t,
            Err(reason) => {
                warn!(migration = %name, "no target: {reason}");
                let failed = state.ended(&now_rfc3339(), Err(&reason));
                return self.write(m, MigrationPhase::Failed, Some(&failed)).await;
            }
        };
        info!(migration = %name, target = %node, %addr, "migrating");
        state.target_node.clone_from(&node);
        state.target_node_address = addr.to_string();
        self.write(m, MigrationPhase::Scheduled, Some(&state)).await;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let object = Object {
            uid: uid.clone(),
            node,
            progress: tx,
        };
        let moving = self.migrate.migrate_object(key.clone(), addr, object);
        let (result, reached) = self.follow(m, &state, moving, rx).await;
        let (phase, end) = match &result {
            Ok(said) => {
                info!(migration = %name, "{said}");
                (MigrationPhase::Succeeded, Ok(()))
            }
            Err(_) if reached == MigrationPhase::Succeeded => (MigrationPhase::Succeeded, Ok(())),
            Err(reason) => {
                warn!(migration = %name, "{reason}");
                (MigrationPhase::Failed, Err(reason.as_str()))
            }
        };
        let ended = state.ended(&now_rfc3339(), end);
        self.write(m, phase, Some(&ended)).await;
        let said = match &result {
            Ok(said) | Err(said) => said,
        };
        let reason = if phase == MigrationPhase::Succeeded {
            "Succeeded"
        } else {
            "Failed"
        };
        self.note(m, reason, said).await;
    }

    /// Runs `moving`, writing each phase it reaches and, at most every
    /// [`FIGURES_EVERY`], its figures; how it ended, and the last phase it
    /// reached (`Succeeded` once the target confirmed, even if handing the
    /// VMI over is still to be retried).
    async fn follow(
        &self,
        m: &Migration,
        state: &MigrationState,
        moving: impl std::future::Future<Output = Result<String, String>>,
        mut rx: tokio::sync::mpsc::UnboundedReceiver<Step>,
    ) -> (Result<String, String>, MigrationPhase) {
        let mut moving = std::pin::pin!(moving);
        let mut reached = MigrationPhase::Scheduled;
        let mut noted: Option<tokio::time::Instant> = None;
        let result = loop {
            tokio::select! {
                r = &mut moving => break r,
                Some(step) = rx.recv() => match step {
                    Step::Phase(phase) => {
                        reached = phase;
                        if !phase.is_final() {
                            self.write(m, phase, Some(state)).await;
                        }
                    }
                    Step::Figures(p) => {
                        if noted.is_none_or(|t| t.elapsed() >= FIGURES_EVERY) {
                            noted = Some(tokio::time::Instant::now());
                            self.note(m, "Running", &p.line()).await;
                        }
                    }
                },
            }
        };
        while let Ok(step) = rx.try_recv() {
            if let Step::Phase(phase) = step {
                reached = phase;
            }
        }
        (result, reached)
    }

    /// The object's progress condition: its figures, or how it ended.
    async fn note(&self, m: &Migration, reason: &str, message: &str) {
        let patch = progress::condition_patch(reason, message, &now_rfc3339());
        if let Err(e) = self.objects.report(m, &patch).await {
            warn!("{e}");
        }
    }

    /// An object labelled for this host whose VMI is not here: after
    /// [`UNPLACED_AFTER`] (this host's view of its VMIs may lag), handed on
    /// to the host its VMI runs on now (the target of a migration whose
    /// source could not finish it), or failed with why if its VMI runs
    /// nowhere. Guarded by the object's resourceVersion.
    fn elsewhere(self: &Arc<Self>, m: &Migration, key: VmKey) {
        let uid = m.metadata.uid.clone().unwrap_or_default();
        let now = tokio::time::Instant::now();
        let first = *lock(&self.elsewhere).entry(uid.clone()).or_insert(now);
        if now.duration_since(first) < UNPLACED_AFTER {
            return;
        }
        let me = self.clone();
        let m = m.clone();
        tokio::spawn(async move {
            let vmi = match me.objects.vmi(&key).await {
                Ok(v) => v,
                Err(e) => return warn!("{e}"),
            };
            let done = match route(&m, &key.to_string(), vmi.as_ref()) {
                Route::Host(node) => me.objects.route(&m, &node).await.inspect(|&w| {
                    if w {
                        info!(vm = %key, %node, "migration object handed on to its VMI's host");
                    }
                }),
                Route::Fail(reason) => me.objects.fail(&m, &reason).await.inspect(|&w| {
                    if w {
                        info!(vm = %key, "migration object failed: {reason}");
                    }
                }),
                Route::Stay => return,
            };
            match done {
                Ok(_) => drop(lock(&me.elsewhere).remove(&uid)),
                Err(e) => warn!("{e}"),
            }
        });
    }

    /// The object of a running migration was deleted: the VM stays.
    async fn cancel(&self, uid: &str) {
        let Some(key) = lock(&self.running).get(uid).cloned() else {
            return;
        };
        info!(vm = %key, "its migration object was deleted: cancelling the migration");
        if let Err(e) = self.migrate.cancel(&key).await {
            warn!(vm = %key, "cancelling its migration: {e}");
        }
    }
}
