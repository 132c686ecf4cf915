//! The level-triggered loop: one key per VM (its id), fed by manifest
//! changes, unit state changes, libvirt domain events and a slow resync.
//! Each reconcile observes the host, plans, carries the plan out and
//! reports status; one VM's trouble never blocks another's.

mod claims;
mod cpus;
use cpus::Unplaced;
mod inputs;
mod migrate;
pub use migrate::Leaving;
mod report;
mod starts;
pub use starts::starts_at_once;
mod steps;
mod tokens;

use crate::core::budget::{Rate, WriteBudget};
use crate::core::convert::{
    self, Claims, ConvertContext, Converted, DomainType, HostCapacity, HostDiskRoots, Limits,
};
use crate::core::cpuset::CpuSet;
use crate::core::efivars;
use crate::core::guestinfo::GuestDetails;
use crate::core::key::{self, VmKey};
use crate::core::layout::{DaemonKind, HostLayout, VmPaths};
use crate::core::plan::{self, Desired, Migrating, Observed, Outcome, Step, UnitActivity, UnitObs};
use crate::core::scheduling::{self, HostFacts};
use crate::core::status;
use crate::core::trigger::Trigger;
use crate::core::unit;
use crate::core::vmi::{Phase, VirtualMachineInstance};
use crate::daemon::metrics::{Adoption, Metrics};
use crate::host::identity::{IdentityStoreError, VmUsers};
use crate::host::image::{ImageError, Images};
use crate::host::journal;
use crate::host::libvirt::{DomainRef, Hypervisor, LibvirtError, VmSocket};
use crate::host::machined::Machines;
use crate::host::marks::Records;
use crate::host::netns::{Netns, NetnsError};
use crate::host::network::{Network, NetworkError};
use crate::host::storage::{Owner, RuntimeDir, Storage, StorageError};
use crate::host::systemd::{SystemdError, Units};
use crate::sources::{EventReason, Recorder, SourceError, StatusStore};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use steps::StepCtx;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;
use tracing::{error, info, warn, Instrument};

#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    #[error("VM {id}: {source}")]
    Systemd { id: String, source: SystemdError },
    #[error("VM {id}: {source}")]
    Netns { id: String, source: NetnsError },
    #[error("{source}")]
    Libvirt { source: LibvirtError },
    #[error("VM {id}: {source}")]
    Storage { id: String, source: StorageError },
    #[error("{source}")]
    Network { source: NetworkError },
    #[error("VM {id}: status: {source}")]
    Status { id: String, source: SourceError },
    #[error("{source}")]
    Machined {
        source: crate::host::machined::MachinedError,
    },
    #[error("VM {id}: {source}")]
    Image { id: String, source: ImageError },
    #[error("VM {id}: {message}")]
    Objects { id: String, message: String },
    #[error("VM {id}: {message}")]
    Quota { id: String, message: String },
    #[error("VM {id}: {message}")]
    Claims { id: String, message: String },
    #[error("VM {id}: dedicated CPUs: {message}")]
    Cpus { id: String, message: String },
    #[error("VM {id}: teardown incomplete: {}", errors.join("; "))]
    Teardown { id: String, errors: Vec<String> },
    #[error("VM {id}: identity: {source}")]
    Identity {
        id: String,
        source: IdentityStoreError,
    },
    /// A migration mark that cannot be read: nothing is done to the VM
    /// until it can (it may be leaving, and must not be started again).
    #[error("VM {id}: {source}")]
    Mark {
        id: String,
        source: crate::host::marks::MarkError,
    },
}

impl ControllerError {
    /// The metric label: which system the failure came from.
    pub fn reason(&self) -> &'static str {
        match self {
            ControllerError::Systemd { .. } => "systemd",
            ControllerError::Netns { .. } => "netns",
            ControllerError::Libvirt { .. } => "libvirt",
            ControllerError::Storage { .. } => "storage",
            ControllerError::Network { .. } => "network",
            ControllerError::Status { .. } => "status",
            ControllerError::Machined { .. } => "machined",
            ControllerError::Image { .. } => "image",
            ControllerError::Objects { .. } => "objects",
            ControllerError::Quota { .. } => "quota",
            ControllerError::Claims { .. } => "claims",
            ControllerError::Cpus { .. } => "cpus",
            ControllerError::Teardown { .. } => "teardown",
            ControllerError::Identity { .. } => "identity",
            ControllerError::Mark { .. } => "migration",
        }
    }
}

/// Standalone mode: Events are log lines carrying the VM key.
pub struct LogRecorder;

impl Recorder for LogRecorder {
    fn record(
        &self,
        vmi: &VirtualMachineInstance,
        reason: EventReason,
        message: &str,
        warning: bool,
    ) {
        let span = vmi.key().ok().map(|k| journal::vm_span(&k.id(), Some(&k)));
        let _in_vm = span.as_ref().map(|s| s.enter());
        if warning {
            warn!(reason = ?reason, "{message}");
        } else {
            info!(reason = ?reason, "{message}");
        }
    }
}

/// Host-wide facts every reconcile needs, fixed at start.
#[derive(Clone, Debug)]
pub struct Settings {
    pub node_name: String,
    pub layout: HostLayout,
    pub host_disk_roots: HostDiskRoots,
    /// `storage.shared_roots`: what every host reaches at the same path.
    pub shared_roots: Vec<PathBuf>,
    /// VMIs come from a cluster (their volumes may name its objects).
    pub cluster: bool,
    pub daemon: DaemonKind,
    pub daemon_path: PathBuf,
    pub domain_type: DomainType,
    /// kvirt's own user (no VM runs as it) and its ids: the capability
    /// probe's; `None` runs no probe.
    pub user: String,
    pub probe_owner: Option<Owner>,
    pub slice: String,
    pub overhead_bytes: u64,
    pub tasks_max: u64,
    /// How often the graceful shutdown re-sends the ACPI power button.
    pub shutdown_resend: Duration,
    /// The host's memory and CPUs; `None`: VMs are not checked against them.
    pub capacity: Option<HostCapacity>,
    /// What the host allows one VM.
    pub limits: Limits,
    /// In a cluster, what the host offers (labels, taints, its scheduler):
    /// a VMI is run only where the host would have claimed it, whoever put
    /// the node label on it. `None`: the host's own manifests, trusted.
    pub placement: Option<HostFacts>,
    /// How often a running VM's serviceAccount tokens are renewed (four
    /// fifths of their lifetime); `None`: never (standalone).
    pub token_renewal: Option<Duration>,
    /// Standalone: the configured claims (all there are). In a cluster:
    /// none, only the filesystem overhead; each start reads its own.
    pub claims: Claims,
    /// Filesystem claims' volumes must lie below one of these; every VM's
    /// unit hides them but for its own disks.
    pub claim_roots: Vec<PathBuf>,
    /// Namespaces whose NetworkAttachmentDefinitions VMIs of any namespace
    /// may use (Multus's `globalNamespaces`); others only their own.
    pub cni_global_namespaces: Vec<String>,
    /// VMs that may be starting at once (`vm.starts_at_once`).
    pub starts_at_once: usize,
}

/// The systems one controller drives, named once: the host's adapters and
/// its source's status store and recorder. kvirtd names the real ones; the
/// loop's tests name `FakeHost` for all of them.
pub trait Adapters: 'static {
    type Units: Units;
    type Netns: Netns;
    type Network: Network;
    type Hypervisor: Hypervisor + crate::host::migrate::LiveMigration;
    type Storage: Storage;
    type Machines: Machines;
    type Images: Images;
    type Users: VmUsers;
    type Status: StatusStore;
    type Recorder: Recorder;
    type Marks: Records<crate::core::migration::Mark>;
    type Fences: Records<crate::core::fence::Fenced>;
}

pub struct Deps<A: Adapters> {
    pub units: A::Units,
    pub netns: A::Netns,
    pub network: A::Network,
    pub hypervisor: A::Hypervisor,
    pub storage: A::Storage,
    pub status: A::Status,
    pub recorder: A::Recorder,
    pub machines: A::Machines,
    pub images: A::Images,
    pub users: A::Users,
    /// The migrations this host takes part in.
    pub marks: A::Marks,
    /// The VMs a self-fence stopped.
    pub fences: A::Fences,
    /// The host's dedicated CPUs and who holds them.
    pub cpus: Arc<crate::host::cpus::DedicatedCpus>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    pub requeue_after: Option<Duration>,
    /// What this pass found of a VM that was already on the host (what
    /// adoption means on the first pass after a start).
    pub found: Option<Adoption>,
}

pub struct Controller<A: Adapters> {
    deps: Deps<A>,
    settings: Settings,
    /// The VMIs this host should run, by id, with the status kvirtd owns.
    vmis: Mutex<HashMap<String, VirtualMachineInstance>>,
    /// Ids whose status changed but could not be written yet.
    unsaved: Mutex<HashSet<String>>,
    metrics: Metrics,
    /// The last heartbeat the loop answered.
    heartbeat: AtomicU64,
    /// Each unit's `NRestarts` when last seen: a rise is the VM's daemon
    /// having died and come back.
    restarts: Mutex<HashMap<String, u32>>,
    /// Per id, whether its last pass left nothing of it on the host.
    gone: Mutex<HashMap<String, bool>>,
    /// When kvirtd learnt that an id's VMI was deleted: its grace period
    /// counts from then, as Kubernetes' does from the deletion, not from
    /// whenever its pass gets to it (a hundred deleted at once).
    unwanted: Mutex<HashMap<String, tokio::time::Instant>>,
    /// Bumped after each pass: what watches VMIs (VirtualMachines) looks again.
    passes: tokio::sync::watch::Sender<u64>,
    /// How often each VM's status, and the host's, may be written.
    write_budget: Mutex<WriteBudget>,
    /// When each running VM's serviceAccount tokens are next renewed.
    tokens: Mutex<HashMap<String, tokens::Due>>,
    /// Ids to pass again once the current passes end (dedicated CPUs freed).
    woken: Mutex<Vec<String>>,
    /// Held while a migration mark is checked and set (see `claim_mark`).
    marking: Mutex<()>,
    /// VMIs handed to another host by a migration: their status is that
    /// host's to write, even while a source still lists them here.
    handed_over: Mutex<HashSet<String>>,
    /// Slots for VMs starting at once (see `starts`).
    starts: tokio::sync::Semaphore,
    /// Bumped when a VMI appears, goes, or begins to be deleted: a pass
    /// waiting for a start slot looks again whether it is still wanted.
    vmis_changed: tokio::sync::watch::Sender<u64>,
}

/// What a VMI's loop shows of one id to the VirtualMachines above it.
pub trait VmiView: Send + Sync + 'static {
    /// The VMI with the status kvirt reported, and whether nothing of the
    /// id is left on the host.
    fn view(&self, id: &str) -> (Option<VirtualMachineInstance>, bool);
    /// Changes each time a pass ends.
    fn passes(&self) -> tokio::sync::watch::Receiver<u64>;
    /// Pauses, unpauses or soft-reboots the running VMI of `id`; says what
    /// was done, or why not.
    fn act(&self, id: &str, action: VmiAction) -> ActFuture<'_>;
    /// What the running VMI's guest agent says of its users and
    /// filesystems; `Ok(None)` while no agent is connected.
    fn guest_details(&self, id: &str) -> GuestFuture<'_>;
}

pub type GuestFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Option<GuestDetails>, String>> + Send + 'a>,
>;

pub type ActFuture<'a> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<String, String>> + Send + 'a>>;

/// What `virtctl pause|unpause|soft-reboot` asks of a running VMI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmiAction {
    Pause,
    Unpause,
    SoftReboot,
}

impl<A: Adapters> VmiView for Controller<A> {
    fn view(&self, id: &str) -> (Option<VirtualMachineInstance>, bool) {
        let vmi = self.vmis().get(id).cloned();
        let gone = self
            .gone
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .copied();
        // Never looked at since kvirtd started: the first pass over every
        // id the host has covers it, so an unknown one has nothing.
        (vmi, gone.unwrap_or(true))
    }

    fn passes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.passes.subscribe()
    }

    fn act(&self, id: &str, action: VmiAction) -> ActFuture<'_> {
        let id = id.to_owned();
        Box::pin(async move {
            let vmi = self.vmis().get(&id).cloned();
            let vmi = vmi.ok_or_else(|| format!("no VMI {id} on this host"))?;
            let key = vmi.key().map_err(|e| e.to_string())?;
            if vmi.status.phase != Some(Phase::Running) || vmi.metadata.deletion_timestamp.is_some()
            {
                return Err(format!("VMI {key} is not running"));
            }
            let paused = vmi
                .status
                .conditions
                .iter()
                .any(|c| c.type_ == status::PAUSED && c.status == "True");
            match (action, paused) {
                (VmiAction::Pause, true) => return Err(format!("VMI {key} is already paused")),
                (VmiAction::Unpause, false) => return Err(format!("VMI {key} is not paused")),
                (VmiAction::SoftReboot, true) => {
                    return Err(format!("VMI {key} is paused: unpause it first"))
                }
                _ => {}
            }
            let obs = self.observe(&id, None).await.map_err(|e| e.to_string())?;
            let daemon = obs.unit.as_ref().and_then(|u| u.daemon);
            let dom = self.domain_ref(&id, daemon, &key.domain_name());
            let hv = &self.deps.hypervisor;
            let (done, verb) = match action {
                VmiAction::Pause => (hv.set_paused(&dom, true).await, "paused"),
                VmiAction::Unpause => (hv.set_paused(&dom, false).await, "unpaused"),
                VmiAction::SoftReboot => (hv.soft_reboot(&dom).await, "soft-rebooted"),
            };
            done.map_err(|e| e.to_string())?;
            // Its status follows from the domain's event.
            info!(vm = %key, "{verb} on request");
            Ok(format!("VMI {key} was {verb}"))
        })
    }

    fn guest_details(&self, id: &str) -> GuestFuture<'_> {
        let id = id.to_owned();
        Box::pin(async move {
            let vmi = self.vmis().get(&id).cloned();
            let vmi = vmi.ok_or_else(|| format!("no VMI {id} on this host"))?;
            let key = vmi.key().map_err(|e| e.to_string())?;
            let obs = self.observe(&id, None).await.map_err(|e| e.to_string())?;
            let daemon = obs.unit.as_ref().and_then(|u| u.daemon);
            let dom = self.domain_ref(&id, daemon, &key.domain_name());
            self.deps
                .hypervisor
                .guest_details(&dom)
                .await
                .map_err(|e| e.to_string())
        })
    }
}

type Phases = BTreeMap<String, usize>;

impl<A: Adapters> Controller<A> {
    pub fn new(deps: Deps<A>, settings: Settings) -> Arc<Self> {
        Arc::new(Self {
            deps,
            vmis: Mutex::default(),
            unsaved: Mutex::default(),
            metrics: Metrics::default(),
            heartbeat: AtomicU64::new(0),
            restarts: Mutex::default(),
            gone: Mutex::default(),
            unwanted: Mutex::default(),
            passes: tokio::sync::watch::Sender::new(0),
            write_budget: Mutex::new(WriteBudget::new(Rate::PER_VM, Rate::PER_HOST)),
            tokens: Mutex::default(),
            woken: Mutex::default(),
            marking: Mutex::default(),
            handed_over: Mutex::default(),
            starts: tokio::sync::Semaphore::new(settings.starts_at_once.max(1)),
            vmis_changed: tokio::sync::watch::Sender::new(0),
            settings,
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn heartbeat(&self) -> u64 {
        self.heartbeat.load(Ordering::Relaxed)
    }

    /// This host's part in a migration of `vmi`, by its mark (a mark of
    /// another instance of the name holds nothing).
    fn migrating(
        &self,
        id: &str,
        vmi: &VirtualMachineInstance,
    ) -> Result<Option<Migrating>, crate::host::marks::MarkError> {
        let mark = self.deps.marks.get(id)?;
        Ok(mark.filter(|m| m.holds_for(vmi)).map(|m| m.role))
    }

    /// Why a self-fence stopped `vmi` here, if it did. A record of an
    /// earlier instance of the name (its VirtualMachine made it anew) is
    /// done with; an unreadable one counts as a fence (the safe side).
    fn fenced(&self, id: &str, vmi: &VirtualMachineInstance) -> Option<String> {
        match self.deps.fences.get(id) {
            Ok(Some(f)) if f.holds_for(vmi.uid()) => Some(f.why),
            Ok(Some(_)) => {
                if let Err(e) = self.deps.fences.clear(id) {
                    warn!("{e}");
                }
                None
            }
            Ok(None) => None,
            Err(e) => Some(format!("fenced (its record unreadable: {e})")),
        }
    }

    /// How many VMs a self-fence stopped that are still recorded, for
    /// `STATUS=`.
    pub fn fenced_count(&self) -> usize {
        self.deps.fences.all().len()
    }

    fn vmis(&self) -> std::sync::MutexGuard<'_, HashMap<String, VirtualMachineInstance>> {
        self.vmis.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the unit's daemon was restarted since the last pass saw it.
    fn daemon_restarted(&self, id: &str, unit: Option<&UnitObs>) -> bool {
        let mut seen = self.restarts.lock().unwrap_or_else(|p| p.into_inner());
        match unit {
            Some(u) => seen
                .insert(id.into(), u.restarts)
                .is_some_and(|n| n < u.restarts),
            None => {
                seen.remove(id);
                false
            }
        }
    }

    /// VM counts per phase, for `STATUS=` and `kvirtctl`.
    pub fn phase_counts(&self) -> Phases {
        let mut counts = Phases::new();
        for vmi in self.vmis().values() {
            let phase = vmi.status.phase.unwrap_or(Phase::Pending);
            *counts.entry(format!("{phase:?}")).or_default() += 1;
        }
        counts
    }

    /// Takes a new set of VMIs; returns the ids whose VMI appeared, went
    /// away, changed identity or began to be deleted. Known statuses carry over (from memory, or
    /// from the status store after a restart) when the UID matches.
    pub async fn set_vmis(&self, mut new: BTreeMap<VmKey, VirtualMachineInstance>) -> Vec<String> {
        // A VMI arriving by migration is listed by no source of this host
        // until the migration commits (in a cluster, until the source hands
        // it over): its mark holds it meanwhile.
        let mut arrived = Vec::new();
        for (id, mark) in self.deps.marks.all() {
            if let (Migrating::Incoming, Some(vmi)) = (mark.role, &mark.vmi) {
                match vmi.key() {
                    Ok(key) if key.id() == id => {
                        let listed = new.get(&key).is_some_and(|v| mark.holds_for(v));
                        if mark.committed && listed {
                            self.arrived(&id);
                            arrived.push(id);
                        } else {
                            new.entry(key).or_insert_with(|| (**vmi).clone());
                        }
                    }
                    _ => warn!("migration mark {id}: its VMI is not of that id"),
                }
            }
        }
        let listed: HashSet<String> = new.keys().map(VmKey::id).collect();
        self.handed_over
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id| listed.contains(id));
        let mut incoming = HashMap::new();
        for (key, mut vmi) in new {
            let id = key.id();
            let known = self.vmis().get(&id).cloned();
            let prev = match known {
                Some(k) => Some(k),
                None => self.deps.status.load(&key).await,
            };
            if let Some(prev) = prev.filter(|p| p.uid() == vmi.uid()) {
                vmi.status = prev.status;
            }
            incoming.insert(id, vmi);
        }
        let mut vmis = self.vmis();
        let mut changed: Vec<String> = incoming
            .iter()
            // A new instance, or one now being deleted, needs a pass.
            .filter(|(id, v)| {
                vmis.get(*id)
                    .map(|o| (o.uid(), &o.metadata.deletion_timestamp))
                    != Some((v.uid(), &v.metadata.deletion_timestamp))
            })
            .map(|(id, _)| id.clone())
            .collect();
        changed.extend(
            vmis.keys()
                .filter(|id| !incoming.contains_key(*id))
                .cloned(),
        );
        let now = tokio::time::Instant::now();
        let deleted = |id: &String| {
            incoming
                .get(id)
                .is_none_or(|v| v.metadata.deletion_timestamp.is_some())
        };
        let mut unwanted = self.unwanted.lock().unwrap_or_else(|p| p.into_inner());
        unwanted.retain(|id, _| deleted(id));
        for id in changed.iter().filter(|id| deleted(id)) {
            unwanted.entry(id.clone()).or_insert(now);
        }
        *vmis = incoming;
        drop(vmis);
        if !changed.is_empty() {
            self.vmis_changed.send_modify(|n| *n += 1);
        }
        // An arrival now this host's: its pass writes its status.
        changed.extend(arrived);
        changed.sort();
        changed.dedup();
        changed
    }

    /// When the grace period of `id`'s shutdown ends (see `unwanted`).
    pub(super) fn grace_deadline(&self, id: &str, grace: Duration) -> tokio::time::Instant {
        let since = self
            .unwanted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .copied();
        let since = since.unwrap_or_else(tokio::time::Instant::now);
        // A grace period past the clock's range (admission refuses them,
        // but a VM may predate a lower limit) ends when time would.
        since
            .checked_add(grace)
            .unwrap_or_else(|| since + Duration::from_secs(100 * 365 * 86_400))
    }

    /// Every id the host or the source knows of.
    pub async fn all_ids(&self) -> Vec<String> {
        let mut ids: HashSet<String> = self.vmis().keys().cloned().collect();
        match self.deps.units.list_ids().await {
            Ok(u) => ids.extend(u),
            Err(e) => warn!("listing units: {e}"),
        }
        match self.deps.netns.list().await {
            Ok(n) => ids.extend(
                n.iter()
                    .filter_map(|n| key::id_from_netns(n).map(str::to_owned)),
            ),
            Err(e) => warn!("listing namespaces: {e}"),
        }
        ids.extend(self.deps.storage.list_ids().await);
        ids.extend(self.deps.network.ids());
        ids.extend(self.deps.users.ids());
        let mut ids: Vec<String> = ids.into_iter().collect();
        ids.sort();
        ids
    }

    pub fn paths(&self, id: &str) -> VmPaths {
        self.settings.layout.vm_by_id(id)
    }

    /// `admitted`: the VM's unit runs already. The host's capacity and
    /// limits keep a VM from starting, never stop one that runs (a limit
    /// lowered, or kvirt upgraded, under it).
    fn convert(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        admitted: bool,
        claims: &Claims,
        dedicated_cpus: Option<&CpuSet>,
    ) -> Result<Converted, String> {
        if vmi.uid().is_none() {
            return Err("metadata.uid: the VMI has no UID".into());
        }
        if let (false, Some(host)) = (admitted, &self.settings.placement) {
            scheduling::fits(vmi, host)
                .map_err(|why| format!("placement: {why}, so this node does not run it"))?;
        }
        let paths = self.settings.layout.vm(key);
        // A claim configured away under a running VM never stops it.
        let lenient;
        let claims = if admitted && claims.complete {
            lenient = Claims {
                complete: false,
                ..claims.clone()
            };
            &lenient
        } else {
            claims
        };
        convert::convert(
            vmi,
            &ConvertContext {
                key,
                paths: &paths,
                domain_type: self.settings.domain_type,
                host_disk_roots: self.settings.host_disk_roots.of(key.namespace()),
                shared_roots: &self.settings.shared_roots,
                cluster: self.settings.cluster,
                capacity: self.settings.capacity.filter(|_| !admitted),
                limits: if admitted {
                    Limits::NONE
                } else {
                    self.settings.limits
                },
                claims,
                dedicated_cpus,
            },
        )
        .map_err(|e| e.to_string())
    }

    async fn observe(
        &self,
        id: &str,
        dom: Option<&DomainRef>,
    ) -> Result<Observed, ControllerError> {
        let unit = self
            .deps
            .units
            .get(&key::unit_name_of(id))
            .await
            .map_err(|source| ControllerError::Systemd {
                id: id.into(),
                source,
            })?;
        let netns = self
            .deps
            .netns
            .exists(&key::netns_name_of(id))
            .await
            .map_err(|source| ControllerError::Netns {
                id: id.into(),
                source,
            })?;
        let paths = self.paths(id);
        // machined only mirrors what runs: trouble asking it never stops a VM.
        let machine = self
            .deps
            .machines
            .registered(&key::machine_name_of(id))
            .await
            .unwrap_or_else(|e| {
                warn!("{e}");
                None
            });
        let runtime = self.deps.storage.runtime_dir(&paths.runtime_dir).await;
        let mut obs = Observed {
            machine,
            netns,
            network: self.deps.network.holds(id),
            state_dir: self.deps.storage.exists(&paths.state_dir).await,
            runtime_dir: runtime != RuntimeDir::Absent,
            runtime_kept: runtime == RuntimeDir::Kept,
            domain: None,
            unit,
            identity: self.deps.users.uid_of(id).is_some(),
            unresponsive: None,
        };
        if let Some(u) = obs
            .unit
            .as_ref()
            .filter(|u| u.activity == UnitActivity::Active)
        {
            let mut dom = match dom {
                Some(d) => Some(self.domain_ref(id, u.daemon, &d.name)),
                None => u
                    .domain_name
                    .as_ref()
                    .map(|n| self.domain_ref(id, u.daemon, n)),
            };
            // Only the unit's main process may be spoken to as its daemon.
            if let Some(s) = dom.as_mut().and_then(|d| d.socket.as_mut()) {
                s.daemon_pid = u.main_pid;
            }
            if let Some(d) = dom {
                match self.deps.hypervisor.observe(&d).await {
                    Ok(domain) => obs.domain = domain,
                    Err(e) if e.is_unresponsive() => obs.unresponsive = Some(e.to_string()),
                    Err(source) => return Err(ControllerError::Libvirt { source }),
                }
            }
        }
        Ok(obs)
    }

    fn domain_ref(&self, id: &str, daemon: Option<DaemonKind>, name: &str) -> DomainRef {
        let paths = self.paths(id);
        let daemon = daemon.unwrap_or(self.settings.daemon);
        let socket = paths.libvirt_socket(daemon);
        DomainRef {
            id: id.into(),
            uri: paths.libvirt_uri(daemon),
            name: name.into(),
            socket: socket
                .strip_prefix(&paths.runtime_dir)
                .ok()
                .map(|rel| VmSocket {
                    dir: paths.runtime_dir.clone(),
                    rel: rel.to_owned(),
                    daemon_pid: None,
                }),
        }
    }

    /// One pass for one VM: observe, plan, act, report.
    pub async fn reconcile(&self, id: &str) -> Result<Reconciled, ControllerError> {
        let vmi = self.vmis().get(id).cloned();
        let key = vmi.as_ref().and_then(|v| v.key().ok());
        let span = journal::vm_span(id, key.as_ref());
        let r = self.reconcile_inner(id, vmi, key).instrument(span).await;
        self.passes.send_modify(|n| *n += 1);
        r
    }

    async fn reconcile_inner(
        &self,
        id: &str,
        vmi: Option<VirtualMachineInstance>,
        key: Option<VmKey>,
    ) -> Result<Reconciled, ControllerError> {
        let dom = key
            .as_ref()
            .map(|k| self.domain_ref(id, None, &k.domain_name()));
        let mut obs = self.observe(id, dom.as_ref()).await?;
        // Only the host says what was admitted: a VMI's status is its
        // author's to write too (KubeVirt's CRD has no status subresource).
        let admitted = |v: &VirtualMachineInstance| {
            obs.unit
                .as_ref()
                .is_some_and(|u| u.uid.is_some() && u.uid.as_deref() == v.uid())
        };
        let (placed, cpu_wait) = match &vmi {
            Some(v) => match self.place_cpus(id, v, admitted(v)).await {
                Ok(p) => (Ok(p), None),
                Err(Unplaced::Refused(why)) => (Err(why), None),
                Err(Unplaced::Wait {
                    message,
                    provisional,
                }) => (
                    Ok(Some(provisional).filter(|p| !p.is_empty())),
                    Some(message),
                ),
            },
            None => (Ok(None), None),
        };
        let mut converted = match (&vmi, &key, &placed) {
            (Some(v), Some(k), Ok(cpus)) => {
                Some(self.convert(v, k, admitted(v), &self.settings.claims, cpus.as_ref()))
            }
            (Some(_), Some(_), Err(why)) => Some(Err(why.clone())),
            _ => None,
        };
        if self.daemon_restarted(id, obs.unit.as_ref()) {
            let m = "the VM's libvirt daemon died and was started again; the VM kept running";
            warn!("{m}");
            if let Some(v) = &vmi {
                (self.deps.recorder).record(v, EventReason::DaemonRestarted, m, true);
            }
        }
        // A VMI being deleted is wanted no more: tear down, then let it go.
        let deleting = vmi
            .as_ref()
            .is_some_and(|v| v.metadata.deletion_timestamp.is_some());
        let migrating = match &vmi {
            Some(v) => self
                .migrating(id, v)
                .map_err(|source| ControllerError::Mark {
                    id: id.into(),
                    source,
                })?,
            None => None,
        };
        let fenced = vmi.as_ref().and_then(|v| self.fenced(id, v));
        let desired = vmi.as_ref().filter(|_| !deleting).map(|v| Desired {
            uid: v.uid().unwrap_or_default().to_owned(),
            grace: v.termination_grace_period(),
            phase: v.status.phase,
            invalid: converted.as_ref().and_then(|c| c.as_ref().err().cloned()),
            migrating,
            fenced,
        });
        if let (true, Some(v), Some(u)) = (deleting, &vmi, obs.unit.as_mut()) {
            // A grace period shortened after the start (`virtctl stop
            // --grace-period` patches the VMI's) holds for its shutdown.
            let now = v.termination_grace_period();
            u.grace = Some(u.grace.map_or(now, |g| g.min(now)));
        }
        let started = tokio::time::Instant::now();
        let plan = plan::plan(desired.as_ref(), &obs);
        let mut outcome = plan.outcome.clone();
        if !plan.steps.is_empty() {
            info!(steps = ?plan.steps, why = plan.why, "acting");
        }

        let creating =
            plan.steps.contains(&Step::StartUnit) || plan.steps.contains(&Step::DefineDomain);
        let mut refused = None;
        if let (Some(v), Some(k), true, Some(Ok(_))) = (&vmi, &key, creating, &converted) {
            if let Some(message) = cpu_wait {
                self.wait_for(v, k, EventReason::FailedScheduling, &message)
                    .await;
                return Err(ControllerError::Cpus {
                    id: id.into(),
                    message,
                });
            }
        }
        if let (Some(v), Some(k), true) = (&vmi, &key, creating) {
            self.announce_start(v, k, migrating).await?;
            if let (true, Ok(cpus)) = (self.reads_claims(v, false), &placed) {
                let (conv, why) = self.convert_with_claims(v, k, cpus.as_ref()).await?;
                (converted, refused) = (Some(conv), why);
            }
            if let (Some(Ok(conv)), None) = (&converted, &refused) {
                self.hold_cpus(id, conv).await?;
            }
        }
        let (mut disks, mut images, mut networks) = (Vec::new(), BTreeMap::new(), Vec::new());
        if let (Some(v), Some(k), Some(Ok(conv)), true) = (&vmi, &key, &converted, creating) {
            disks = self.read_objects(v, k, conv).await?;
            networks = self.read_networks(v, k, conv).await?;
            images = self.pull_images(v, k, conv).await?;
        }
        let ctx = StepCtx {
            id,
            disks: &disks,
            images: &images,
            networks: &networks,
            obs: &obs,
            vmi: vmi.as_ref(),
            key: key.as_ref(),
            converted: converted.as_ref().and_then(|c| c.as_ref().ok()),
            dom: dom.as_ref(),
        };
        // Its start waits its turn (see `starts`).
        let slot = match (creating && refused.is_none(), &vmi) {
            (true, Some(v)) => match self.start_slot(id, v.uid().unwrap_or_default()).await {
                Some(slot) => Some(slot),
                None => {
                    return Ok(Reconciled {
                        requeue_after: Some(Duration::ZERO),
                        found: None,
                    })
                }
            },
            _ => None,
        };
        let (failed, teardown_errors) = match refused {
            // Its claims cannot be used here: nothing is made.
            Some(r) => {
                outcome = r;
                (None, Vec::new())
            }
            None => self.run_plan(&plan.steps, &ctx).await,
        };
        drop(slot);
        if let Some(why) = failed {
            outcome = Outcome::Failed(why);
        }
        let unit_gone = obs.unit.is_none() || plan.steps.contains(&Step::StopUnit);
        if !creating && unit_gone && teardown_errors.is_empty() {
            self.release_cpus(id, obs.unit.is_some()).await;
        }
        if let (Some(v), false, true) = (&vmi, deleting, teardown_errors.is_empty()) {
            // A finished VM uses its claims no more.
            if v.status.phase.is_some_and(Phase::is_final) {
                self.release_claims(v).await?;
            }
        }
        self.record_gone(
            id,
            desired.is_none() && teardown_errors.is_empty(),
            vmi.is_none(),
        );
        if !teardown_errors.is_empty() {
            return Err(ControllerError::Teardown {
                id: id.into(),
                errors: teardown_errors,
            });
        }
        if vmi.is_none() {
            // A VM that left by migration: its mark held it until now.
            if let Ok(Some(_)) = self.deps.marks.get(id) {
                if let Err(e) = self.deps.marks.clear(id) {
                    warn!("{e}");
                }
            }
            // A fenced VM's VMI is gone: the record has done its work.
            if let Ok(Some(_)) = self.deps.fences.get(id) {
                if let Err(e) = self.deps.fences.clear(id) {
                    warn!("{e}");
                }
            }
            self.deps.status.forget(id).await;
            self.write_budget
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .forget(id);
        }
        let running = outcome == Outcome::Phase(Phase::Running);
        if running {
            self.reattach_network(&ctx).await;
            if !creating {
                self.keep_on_cpus(id, obs.unit.as_ref()).await;
            }
        }
        if creating && running {
            self.metrics.started(started.elapsed());
        }
        let found = adoption(&outcome, desired.is_some(), &obs, creating);
        let deferred = self.tell(&ctx, deleting, &outcome, creating).await?;
        let renew = match (ctx.vmi, ctx.key, ctx.converted) {
            (Some(v), Some(k), Some(conv)) if running => {
                self.renew_tokens(v, k, conv, creating).await
            }
            _ => {
                self.forget_tokens(id);
                None
            }
        };
        let requeue = plan.requeue.then_some(Duration::from_millis(500));
        Ok(Reconciled {
            requeue_after: requeue.into_iter().chain(deferred).chain(renew).min(),
            found,
        })
    }

    /// A running VM's DHCP lives in kvirtd: after a restart it is attached
    /// again here (idempotent), the VM untouched.
    async fn reattach_network(&self, ctx: &StepCtx<'_>) {
        let Some(conv) = ctx.converted else {
            return;
        };
        let (pod, secondary) = (conv.network.as_ref(), &conv.secondary_networks);
        if pod.is_none() && secondary.is_empty() {
            return;
        }
        if let Err(e) = self.deps.network.attach(ctx.id, pod, secondary).await {
            warn!("re-attaching the network: {e}");
        }
    }

    /// What the pass says of the VMI: a deleted one, gone from the host, is
    /// let go; any other gets its status (with what its running domain
    /// shows). Returns when a status write the budget held back is due.
    async fn tell(
        &self,
        ctx: &StepCtx<'_>,
        deleting: bool,
        outcome: &Outcome,
        creating: bool,
    ) -> Result<Option<Duration>, ControllerError> {
        match (ctx.vmi, ctx.key) {
            (Some(v), _) if deleting => {
                // Everything of it is gone from the host: let its claims
                // go, then the object.
                self.release_claims(v).await?;
                let released = self.deps.status.release(v).await;
                released.map_err(status_err(ctx.id)).map(|()| None)
            }
            (Some(v), Some(k)) => {
                let live = match (outcome, ctx.dom) {
                    (Outcome::Phase(Phase::Running), Some(d)) => {
                        let start_paused =
                            creating && ctx.converted.is_some_and(|c| c.start_paused);
                        let mut live = self.live(d, ctx.obs.domain.as_ref(), start_paused).await;
                        // Set by the pass that starts the VM; one that
                        // arrived by migration (or predates the condition)
                        // gets them from the first pass that finds it running.
                        let known = v
                            .status
                            .conditions
                            .iter()
                            .any(|c| c.type_ == crate::core::migration::CONDITION);
                        if creating || !known {
                            live.volumes = ctx.converted.map(|c| c.volume_status.clone());
                            live.migratable = ctx.converted.map(|c| c.migratable.clone());
                        }
                        live
                    }
                    _ => status::Live::default(),
                };
                self.report(k, v.uid(), outcome, &live, ctx.converted).await
            }
            _ => Ok(None),
        }
    }

    /// Before anything is made on the host: the VMI held for cleanup, and
    /// a VMI not yet scheduled shown Scheduled, with its Event (not one
    /// arriving by migration: its status is the source's to write).
    async fn announce_start(
        &self,
        v: &VirtualMachineInstance,
        k: &VmKey,
        migrating: Option<Migrating>,
    ) -> Result<(), ControllerError> {
        self.fit_allowance(v, k).await?;
        // An arriving VMI is still the source's, which holds it; it is
        // this host's to hold once handed over (and in a cluster a host
        // may not write another node's VMI at all).
        if migrating != Some(Migrating::Incoming) {
            self.deps
                .status
                .hold(v)
                .await
                .map_err(status_err(&k.id()))?;
        }
        let unscheduled = matches!(
            v.status.phase,
            None | Some(Phase::Pending | Phase::Scheduling)
        );
        if unscheduled && migrating.is_none() {
            let scheduled = Outcome::Phase(Phase::Scheduled);
            self.report(k, v.uid(), &scheduled, &Default::default(), None)
                .await?;
            self.deps
                .recorder
                .record(v, EventReason::Created, "VM is being created", false);
        }
        Ok(())
    }

    /// Runs the plan's steps, stage by stage. A create step that fails
    /// rolls the start back and says why (the VMI fails with it); teardown
    /// goes on past errors and returns every one.
    async fn run_plan(&self, steps: &[Step], ctx: &StepCtx<'_>) -> (Option<String>, Vec<String>) {
        let mut teardown_errors = Vec::new();
        let mut unit_may_run = false;
        for stage in plan::stages(steps) {
            if unit_may_run && stage.contains(&Step::ReleaseIdentity) {
                // Its processes may still run as it: the number is not
                // free for another VM until the unit is known gone.
                teardown_errors.push("identity kept: the VM's unit may still run".to_owned());
                continue;
            }
            for (step, result) in stage.iter().zip(self.run_stage(stage, ctx).await) {
                let Err(e) = result else { continue };
                // Its processes may still run as it, or its files still
                // be its identity's.
                unit_may_run |= matches!(step, Step::StopUnit | Step::KeepConsoleLog);
                if step.best_effort() {
                    warn!("{e}");
                    continue;
                }
                if step.creates() {
                    // Roll back what this attempt made; the VMI fails with why.
                    warn!("cannot start: {e}");
                    self.metrics.error(e.reason());
                    self.rollback(ctx.id, ctx.dom).await;
                    return (Some(format!("cannot start: {e}")), teardown_errors);
                }
                // Teardown continues past errors, and reports every one.
                warn!("{e}");
                teardown_errors.push(e.to_string());
            }
        }
        (None, teardown_errors)
    }

    /// Whether the pass left nothing of `id` on the host; a VMI that is
    /// gone and left nothing is no longer waited for.
    fn record_gone(&self, id: &str, gone: bool, vmi_gone: bool) {
        self.gone
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.into(), gone);
        if gone && vmi_gone {
            self.unwanted
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
        }
    }

    /// Runs kvirt's own libvirt daemon once, as kvirt's user, so that each
    /// VM starts from a capability cache that no VM wrote (a fresh daemon
    /// spends ~0.5 s probing QEMU). A VM that starts before it is done, or
    /// after it failed, probes QEMU itself.
    pub async fn refresh_capabilities(&self) -> Result<(), ControllerError> {
        let Some(owner) = self.settings.probe_owner else {
            return Ok(());
        };
        let id = "probe";
        let sd = |source| ControllerError::Systemd {
            id: id.into(),
            source,
        };
        self.deps
            .storage
            .create_probe_dirs(owner)
            .await
            .map_err(|source| ControllerError::Storage {
                id: id.into(),
                source,
            })?;
        // One left running by a kvirtd that died mid-probe goes first.
        let _ = self.deps.units.stop(unit::PROBE_UNIT, None).await;
        let spec = unit::probe_spec(&unit::ProbeInput {
            host: &self.settings.layout,
            daemon_path: self.settings.daemon_path.clone(),
            user: &self.settings.user,
            slice: &self.settings.slice,
        });
        self.deps.units.start(&spec).await.map_err(sd)?;
        let uri = self.settings.layout.probe_uri(self.settings.daemon);
        let probed = self.deps.hypervisor.probe(&uri).await;
        let stopped = self.deps.units.stop(unit::PROBE_UNIT, None).await;
        probed.map_err(|source| ControllerError::Libvirt { source })?;
        stopped.map_err(sd)
    }

    /// Removes the kept EFI variables whose VirtualMachine is gone (or
    /// only VM `only`'s), as KubeVirt's backend storage goes with its VM.
    /// Variables a running VM uses, or kept for a VMI's name, stay; so does
    /// everything when the cluster cannot be asked (the next sweep asks
    /// again).
    pub async fn sweep_efi_vars(&self, only: Option<&str>) {
        let kept = match self.deps.storage.kept_efi_vars().await {
            Ok(k) => k,
            Err(e) => return warn!("kept EFI variables: {e}"),
        };
        for k in kept {
            if k.active || only.is_some_and(|id| id != k.id) {
                continue;
            }
            let Some(efivars::Owner::VirtualMachine {
                namespace,
                name,
                uid,
            }) = &k.owner
            else {
                continue;
            };
            let span = journal::vm_span(&k.id, None);
            let id = k.id.as_str();
            let result = async {
                let status = &self.deps.status;
                if status
                    .virtual_machine_exists(namespace, name, uid)
                    .await
                    .map_err(status_err(id))?
                {
                    return Ok(false);
                }
                let storage = &self.deps.storage;
                storage.remove_kept_efi_vars(id).await.map_err(|source| {
                    ControllerError::Storage {
                        id: id.into(),
                        source,
                    }
                })?;
                Ok::<_, ControllerError>(true)
            }
            .instrument(span.clone())
            .await;
            span.in_scope(|| match result {
                Ok(true) => info!(
                    "removed the EFI variables kept for VirtualMachine {namespace}/{name}: it is gone"
                ),
                Ok(false) => {}
                Err(e) => warn!("kept EFI variables of VirtualMachine {namespace}/{name}: {e}"),
            });
        }
    }

    /// Reconciles every id once, concurrently: adoption before serving.
    pub async fn reconcile_all(self: &Arc<Self>) -> Vec<(String, ControllerError)> {
        let ids = self.all_ids().await;
        let tasks: Vec<_> = ids
            .into_iter()
            .map(|id| {
                let this = self.clone();
                tokio::spawn(async move {
                    let r = this.reconcile(&id).await;
                    (id, r)
                })
            })
            .collect();
        let mut errors = Vec::new();
        for t in tasks {
            match t.await {
                Ok((_, Ok(r))) => {
                    if let Some(a) = r.found {
                        self.metrics.adoption(a);
                    }
                }
                Ok((id, Err(e))) => {
                    self.metrics.error(e.reason());
                    errors.push((id, e));
                }
                Err(_) => {}
            }
        }
        errors
    }

    /// The loop: runs until `triggers` closes. At most one reconcile per id
    /// at a time; a trigger during one marks it to run again. It starts
    /// with a pass over every id (adoption) and says on `adopted` when each
    /// has had one, so a slow VM (a grace period, a stuck daemon) never
    /// holds up the others or kvirtd's readiness.
    pub async fn run(
        self: Arc<Self>,
        triggers: UnboundedSender<Trigger>,
        mut rx: UnboundedReceiver<Trigger>,
        adopted: Option<oneshot::Sender<()>>,
    ) {
        let (done_tx, mut done_rx) = unbounded_channel::<(String, Result<Reconciled, Failure>)>();
        let mut running: HashSet<String> = HashSet::new();
        let mut dirty: HashSet<String> = HashSet::new();
        let mut failures: HashMap<String, u32> = HashMap::new();
        let mut adopted = adopted;
        let mut first_pass: HashSet<String> = self.all_ids().await.into_iter().collect();
        let spawn = |id: String, running: &mut HashSet<String>, dirty: &mut HashSet<String>| {
            if !running.insert(id.clone()) {
                dirty.insert(id);
                return;
            }
            let this = self.clone();
            let done = done_tx.clone();
            tokio::spawn(async move {
                // The pass runs as a task of its own: a panic in it (a bug,
                // or input nothing foresaw) ends that pass, not the loop's
                // knowledge that it ended, so the VM is retried, not lost.
                let pass = tokio::spawn({
                    let (this, id) = (this.clone(), id.clone());
                    async move { this.reconcile(&id).await }
                });
                let r = match pass.await {
                    Ok(r) => r.map_err(|e| {
                        this.metrics.error(e.reason());
                        Failure {
                            message: e.to_string(),
                            panicked: false,
                        }
                    }),
                    Err(e) => {
                        this.metrics.error("panic");
                        Err(Failure {
                            message: format!("internal error: the VM's pass {}", panic_text(e)),
                            panicked: true,
                        })
                    }
                };
                let _ = done.send((id, r));
            });
        };
        for id in first_pass.clone() {
            spawn(id, &mut running, &mut dirty);
        }
        loop {
            if first_pass.is_empty() {
                if let Some(tx) = adopted.take() {
                    let _ = tx.send(());
                }
            }
            tokio::select! {
                t = rx.recv() => match t {
                    None => break,
                    Some(Trigger::Vm(id)) => spawn(id, &mut running, &mut dirty),
                    Some(Trigger::Vmis(vmis)) => {
                        for id in self.set_vmis(vmis).await {
                            spawn(id, &mut running, &mut dirty);
                        }
                    }
                    Some(Trigger::Resync) => {
                        for id in self.all_ids().await {
                            spawn(id, &mut running, &mut dirty);
                        }
                    }
                    Some(Trigger::Heartbeat(n)) => self.heartbeat.store(n, Ordering::Relaxed),
                    Some(Trigger::EfiVars) => {
                        let this = self.clone();
                        tokio::spawn(async move { this.sweep_efi_vars(None).await });
                    }
                },
                Some((id, result)) = done_rx.recv() => {
                    running.remove(&id);
                    let first = first_pass.remove(&id);
                    let delay = match result {
                        Ok(r) => {
                            failures.remove(&id);
                            if let (true, Some(a)) = (first, r.found) {
                                self.metrics.adoption(a);
                            }
                            r.requeue_after
                        }
                        Err(Failure { message, panicked }) => {
                            let n = failures.entry(id.clone()).or_default();
                            *n += 1;
                            let delay = Duration::from_secs(1 << (*n).min(6));
                            journal::vm_span(&id, None).in_scope(|| {
                                if panicked {
                                    error!(retry_in = ?delay, "{message}")
                                } else {
                                    warn!(retry_in = ?delay, "reconcile failed: {message}")
                                }
                            });
                            if panicked && *n == 1 {
                                if let Some(v) = self.vmis().get(&id) {
                                    self.deps.recorder.record(v, EventReason::SyncFailed, &message, true);
                                }
                            }
                            Some(delay)
                        }
                    };
                    for woken in self.take_woken() {
                        spawn(woken, &mut running, &mut dirty);
                    }
                    if dirty.remove(&id) {
                        spawn(id, &mut running, &mut dirty);
                    } else if let Some(d) = delay {
                        let tx = triggers.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(d).await;
                            let _ = tx.send(Trigger::Vm(id));
                        });
                    }
                }
            }
        }
    }
}

/// What a pass found of a VM that was on the host (what adoption means on
/// the first pass after kvirtd starts).
fn adoption(outcome: &Outcome, wanted: bool, obs: &Observed, creating: bool) -> Option<Adoption> {
    let on_host = obs.unit.is_some() || obs.domain.is_some();
    match (outcome, wanted) {
        _ if !on_host => None,
        (Outcome::Phase(Phase::Running), true) if !creating => Some(Adoption::Adopted),
        (Outcome::Failed(_), true) => Some(Adoption::Failed),
        (_, false) | (Outcome::Unchanged, _) => Some(Adoption::Cleaned),
        _ => None,
    }
}

/// Why a VM's pass did not finish: its error, or a panic.
struct Failure {
    message: String,
    panicked: bool,
}

/// What a pass's panic said, for the log and the VM's Event.
fn panic_text(e: tokio::task::JoinError) -> String {
    if !e.is_panic() {
        return "was cancelled".into();
    }
    let payload = e.into_panic();
    let text = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".into());
    format!("panicked: {text}")
}

fn status_err(id: &str) -> impl FnOnce(SourceError) -> ControllerError + '_ {
    move |source| ControllerError::Status {
        id: id.into(),
        source,
    }
}

pub use crate::sources::now_rfc3339;
