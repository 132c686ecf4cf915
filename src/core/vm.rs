//! A `VirtualMachine` (`kubevirt.io/v1`) as virt-controller runs it: its
//! template becomes a VMI of the same name, created, stopped and created
//! anew by its `runStrategy` ([`runstrategy`]), with KubeVirt's status.
//! Pure: [`advance`] takes what the VM asks for, what kvirt keeps of it
//! ([`Book`]) and what its VMI is doing, and says what changes.
//!
//! [`runstrategy`]: crate::core::runstrategy

use crate::core::instancetype::{self, Captured, Matcher, Wanted};
use crate::core::key::{KeyError, VmKey};
use crate::core::runstrategy::{self, Action, Request, RunStrategy, VmiState};
use crate::core::vmi::{Condition, Extra, Phase, VirtualMachineInstance, API_VERSION};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::time::Duration;

pub const KIND: &str = "VirtualMachine";
/// The annotation virt-controller puts on the VMIs it creates: the VM
/// generation their spec came from.
pub const GENERATION_ANNOTATION: &str = "kubevirt.io/vm-generation";
/// A failed run shorter than this counts as a start failure (backed off);
/// one that ran longer starts the count afresh.
pub const FAILURE_RESET: Duration = Duration::from_secs(300);

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachine {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: VmSpec,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub status: Value,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<Template>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instancetype: Option<Matcher>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preference: Option<Matcher>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Template {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMeta>,
    /// Kept as written: it becomes the VMI's spec verbatim.
    #[serde(default)]
    pub spec: Value,
}

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid VirtualMachine: {0}")]
    Json(#[from] serde_json::Error),
    #[error("expected apiVersion {API_VERSION:?} and kind {KIND:?}, got {api_version:?} {kind:?}")]
    WrongKind { api_version: String, kind: String },
    #[error("metadata.name is missing")]
    NoName,
    #[error(transparent)]
    Key(#[from] KeyError),
}

impl VirtualMachine {
    pub fn from_value(v: Value) -> Result<Self, VmError> {
        let vm: Self = serde_json::from_value(v)?;
        if vm.api_version != API_VERSION || vm.kind != KIND {
            return Err(VmError::WrongKind {
                api_version: vm.api_version,
                kind: vm.kind,
            });
        }
        Ok(vm)
    }

    pub fn key(&self) -> Result<VmKey, VmError> {
        let name = self.metadata.name.as_deref().ok_or(VmError::NoName)?;
        let namespace = self.metadata.namespace.as_deref().unwrap_or("default");
        Ok(VmKey::new(namespace, name)?)
    }

    /// Its run strategy, or why it has none kvirt can follow. Spec fields
    /// kvirt does not implement are refused here, never dropped.
    pub fn strategy(&self) -> Result<RunStrategy, String> {
        for (field, value) in &self.spec.extra {
            let empty = value.is_null() || value.as_array().is_some_and(|a| a.is_empty());
            if !empty {
                return Err(format!("spec.{field} is not supported by kvirt"));
            }
        }
        let Some(template) = &self.spec.template else {
            return Err("spec.template is missing".into());
        };
        // A node is the scheduler's (or a claiming host's) to choose: a
        // template naming one would skip every placement rule.
        let labels = template.metadata.as_ref().and_then(|m| m.labels.as_ref());
        if labels.is_some_and(|l| l.contains_key(crate::core::vmi::NODE_LABEL)) {
            return Err(format!(
                "spec.template.metadata.labels[{}]: a VirtualMachine may not choose its node; \
                 use nodeSelector or affinity",
                crate::core::vmi::NODE_LABEL
            ));
        }
        RunStrategy::from_spec(self.spec.run_strategy.as_deref(), self.spec.running)
    }

    /// The instancetype and preference its matchers name.
    pub fn wanted(&self) -> Result<Wanted, String> {
        let ns = self.metadata.namespace.as_deref().unwrap_or("default");
        let key = |m: &Option<Matcher>, pref| m.as_ref().map(|m| m.key(pref, ns)).transpose();
        Ok(Wanted {
            instancetype: key(&self.spec.instancetype, false)?,
            preference: key(&self.spec.preference, true)?,
        })
    }

    /// Whether the VM can be made from what it captured: each object its
    /// matchers name is there, and applies to its template.
    pub fn expandable(&self, captured: &Captured) -> Result<(), String> {
        let wanted = self.wanted()?;
        for (want, have) in [
            (&wanted.instancetype, &captured.instancetype),
            (&wanted.preference, &captured.preference),
        ] {
            if let Some(key) = want {
                if !have.as_ref().is_some_and(|r| r.is_of(key)) {
                    return Err(format!("{key} not found"));
                }
            }
        }
        instance(self, 0, captured).map(|_| ())
    }

    fn generation(&self) -> i64 {
        self.metadata.generation.unwrap_or(1)
    }
}

/// The VM as `virtctl expand` shows it: its template's spec is the VMI
/// spec kvirt would run (instancetype and preference applied), and the
/// matchers that named them are gone.
pub fn expanded(vm: &VirtualMachine, captured: &Captured) -> Result<Value, String> {
    vm.expandable(captured)?;
    let vmi = instance(vm, 0, captured)?;
    let mut v = serde_json::to_value(vm).map_err(|e| e.to_string())?;
    v["spec"]["template"]["spec"] = serde_json::to_value(&vmi.spec).map_err(|e| e.to_string())?;
    if let Some(spec) = v["spec"].as_object_mut() {
        spec.remove("instancetype");
        spec.remove("preference");
    }
    Ok(v)
}

/// What kvirt keeps of one VirtualMachine between passes and across
/// restarts (written atomically after each change). Everything a decision
/// needs that the VM object and its VMI do not say.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Book {
    /// The VM's UID where its manifest gives none: made once, kept.
    #[serde(default)]
    pub vm_uid: String,
    /// The VM's generation: one more each time its spec changes.
    #[serde(default)]
    pub generation: i64,
    #[serde(default)]
    pub spec_digest: String,
    /// How many VMIs this VM has had: each new one's UID derives from it.
    pub runs: u64,
    /// The current VMI as created: its spec is the template of the time,
    /// so an edited template waits for the next start (RestartRequired).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmi: Option<VirtualMachineInstance>,
    /// A strategy set by `kvirtctl start`/`stop` (what `virtctl` patches
    /// into a cluster VM's spec), and the spec's strategy it overrode: an
    /// edited manifest wins over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub override_strategy: Option<Override>,
    /// The instancetype and preference revisions the VM uses (KubeVirt's
    /// ControllerRevisions): captured once, kept while its matchers name
    /// the same objects.
    #[serde(default, skip_serializing_if = "Captured::is_empty")]
    pub captured: Captured,
    /// Pending `start`/`stop` requests, oldest first (KubeVirt's
    /// `stateChangeRequests`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requests: Vec<Req>,
    /// The grace period of an asked-for stop (`--grace`), for the VMI it
    /// stops.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_grace: Option<u64>,
    pub failures: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failed_uid: Option<String>,
    /// When the last failed run ended (seconds since the epoch).
    #[serde(default)]
    pub last_failed_at: i64,
    /// When the current VMI was first seen Running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_since: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Override {
    pub strategy: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
}

/// A pending request of `status.stateChangeRequests`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Req {
    Start,
    /// `virtctl start --paused`: the VMI it makes has `startStrategy:
    /// Paused` (KubeVirt's start request with `data.startPaused`).
    StartPaused,
    Stop,
}

impl Req {
    /// KubeVirt's form; a stop names the VMI it stops.
    pub fn to_json(self, vmi_uid: Option<&str>) -> Value {
        match self {
            Req::Start => json!({"action": "Start"}),
            Req::StartPaused => json!({"action": "Start", "data": {"startPaused": "true"}}),
            Req::Stop => json!({"action": "Stop", "uid": vmi_uid}),
        }
    }

    /// `None` for an action kvirt does not know.
    pub fn from_json(r: &Value) -> Option<Req> {
        match r["action"].as_str()? {
            "Start" if r["data"]["startPaused"] == "true" => Some(Req::StartPaused),
            "Start" => Some(Req::Start),
            "Stop" => Some(Req::Stop),
            _ => None,
        }
    }

    fn starts(self) -> bool {
        matches!(self, Req::Start | Req::StartPaused)
    }
}

/// What the VM's VMI is doing, as the loop that runs it sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Seen {
    /// The VMI with the status kvirt reported, when it is the book's.
    pub vmi: Option<VirtualMachineInstance>,
    /// Nothing of the VM is left on the host.
    pub gone: bool,
}

/// Gives a manifest's VM what the API server would: a UID (the manifest's
/// own, or one made once by `fresh_uid`) and a generation that counts spec
/// changes.
pub fn settle_identity(
    vm: &mut VirtualMachine,
    book: &mut Book,
    fresh_uid: impl FnOnce() -> String,
) {
    match vm.metadata.uid.as_deref().filter(|u| !u.is_empty()) {
        Some(uid) => book.vm_uid = uid.to_owned(),
        None => {
            if book.vm_uid.is_empty() {
                book.vm_uid = fresh_uid();
            }
            vm.metadata.uid = Some(book.vm_uid.clone());
        }
    }
    let spec = serde_json::to_vec(&vm.spec).unwrap_or_default();
    let digest: String = Sha256::digest(&spec)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != book.spec_digest {
        book.spec_digest = digest;
        book.generation += 1;
    }
    vm.metadata.generation = Some(book.generation.max(1));
}

/// The spec's strategy string, as the book's override compares it.
fn spec_strategy(vm: &VirtualMachine) -> Option<String> {
    vm.spec
        .run_strategy
        .clone()
        .or_else(|| vm.spec.running.map(|r| format!("running={r}")))
}

fn strategy_name(s: RunStrategy) -> &'static str {
    match s {
        RunStrategy::Always => "Always",
        RunStrategy::RerunOnFailure => "RerunOnFailure",
        RunStrategy::Manual => "Manual",
        RunStrategy::Halted => "Halted",
        RunStrategy::Once => "Once",
    }
}

/// The strategy in force: the spec's, or what `start`/`stop` set over it.
pub fn effective(vm: &VirtualMachine, book: &Book) -> Result<RunStrategy, String> {
    let spec = vm.strategy()?;
    vm.expandable(&book.captured)?;
    match &book.override_strategy {
        Some(o) if o.over == spec_strategy(vm) => RunStrategy::from_spec(Some(&o.strategy), None),
        _ => Ok(spec),
    }
}

/// A UUID-shaped digest, so that a VMI's UID follows from its VM's and its
/// run number: the same after a crash, new for each run.
pub fn derived_uid(vm_uid: &str, run: u64) -> String {
    crate::core::key::uuid_form(&Sha256::digest(format!("{vm_uid}/{run}").as_bytes()))
}

/// The VMI of run `run`: the template's metadata and spec, with the
/// captured instancetype and preference applied, the VM's name and
/// namespace, owned by the VM as virt-controller owns it.
pub fn instance(
    vm: &VirtualMachine,
    run: u64,
    captured: &Captured,
) -> Result<VirtualMachineInstance, String> {
    let tpl = vm
        .spec
        .template
        .as_ref()
        .ok_or("spec.template is missing")?;
    let vm_uid = vm.metadata.uid.clone().unwrap_or_default();
    let mut meta = tpl.metadata.clone().unwrap_or_default();
    meta.name = vm.metadata.name.clone();
    meta.namespace = vm.metadata.namespace.clone();
    meta.uid = Some(derived_uid(&vm_uid, run));
    meta.generate_name = None;
    meta.resource_version = None;
    meta.owner_references = Some(vec![OwnerReference {
        api_version: API_VERSION.into(),
        kind: KIND.into(),
        name: vm.metadata.name.clone().unwrap_or_default(),
        uid: vm_uid,
        controller: Some(true),
        block_owner_deletion: Some(true),
    }]);
    meta.annotations
        .get_or_insert_with(Default::default)
        .insert(GENERATION_ANNOTATION.into(), vm.generation().to_string());
    let mut doc = json!({
        "apiVersion": API_VERSION,
        "kind": crate::core::vmi::KIND,
        "metadata": meta,
        "spec": tpl.spec,
    });
    if !captured.is_empty() {
        // As virt-controller: the disks and network the defaults add are
        // there for the preference to fill in.
        let mut vmi: VirtualMachineInstance =
            serde_json::from_value(doc).map_err(|e| format!("spec.template: {e}"))?;
        crate::core::defaults::controller_defaults(&mut vmi.spec);
        doc = serde_json::to_value(&vmi).map_err(|e| e.to_string())?;
        instancetype::apply(&mut doc, captured)?;
    }
    let mut vmi: VirtualMachineInstance =
        serde_json::from_value(doc).map_err(|e| format!("spec.template: {e}"))?;
    // One machine to the guest, whatever the run (KubeVirt's
    // setupStableFirmwareUUID): not the VMI's UID, which is new each time.
    let fw = vmi
        .spec
        .domain
        .firmware
        .get_or_insert_with(Default::default);
    fw.uuid.get_or_insert_with(|| {
        crate::core::defaults::vm_firmware_uuid(vm.metadata.name.as_deref().unwrap_or_default())
    });
    Ok(vmi)
}

fn state_of(book: &Book, seen: &Seen) -> VmiState {
    let Some(mine) = &book.vmi else {
        return if seen.gone {
            VmiState::Absent
        } else {
            VmiState::Stopping
        };
    };
    if mine.metadata.deletion_timestamp.is_some() {
        return VmiState::Stopping;
    }
    // What was seen is of an earlier VMI when this one was just made.
    let seen = seen.vmi.as_ref().filter(|v| v.uid() == mine.uid());
    match seen.and_then(|v| v.status.phase) {
        Some(Phase::Succeeded) => VmiState::Succeeded,
        Some(Phase::Failed) => VmiState::Failed,
        _ => VmiState::Active,
    }
}

/// What one step of [`advance`] did, for the log and the Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Created(String),
    Stopping(String),
    Removed(String),
    Halted,
    /// A Halted VM asked to start paused is now `Always`.
    Unhalted,
    /// Waiting out the start-failure backoff.
    Waiting(Duration),
}

/// Moves the book on by what the VMI did and what the strategy and the
/// requests ask for, until nothing more is to be done now. `now` is in
/// seconds since the epoch. Returns the changes made and, when a start
/// waits out a backoff, how long.
pub fn advance(
    vm: &VirtualMachine,
    book: &mut Book,
    seen: &Seen,
    now: i64,
    deleted: bool,
) -> Result<(Vec<Change>, Option<Duration>), String> {
    let mut changes = Vec::new();
    // What the VMI did since the last pass.
    let same = |v: &&VirtualMachineInstance| book.vmi.as_ref().and_then(|b| b.uid()) == v.uid();
    if let (Some(mine), Some(v)) = (&book.vmi, seen.vmi.as_ref().filter(same)) {
        let uid = mine.uid().unwrap_or_default().to_owned();
        match v.status.phase {
            Some(Phase::Running) if book.running_since.is_none() => book.running_since = Some(now),
            Some(Phase::Failed) if book.last_failed_uid.as_deref() != Some(&uid) => {
                let ran = book.running_since.map_or(0, |s| now - s);
                book.failures = if ran >= FAILURE_RESET.as_secs() as i64 {
                    1
                } else {
                    book.failures.saturating_add(1)
                };
                book.last_failed_uid = Some(uid);
                book.last_failed_at = now;
            }
            Some(Phase::Succeeded) => book.failures = 0,
            _ => {}
        }
    }
    if seen.gone
        && book
            .vmi
            .as_ref()
            .is_some_and(|v| v.metadata.deletion_timestamp.is_some())
    {
        let uid = book.vmi.take().and_then(|v| v.metadata.uid);
        changes.push(Change::Removed(uid.unwrap_or_default()));
        book.running_since = None;
    }
    if deleted {
        if book.vmi.is_some() && state_of(book, seen) != VmiState::Stopping {
            changes.push(stop(book, now));
        }
        return Ok((changes, None));
    }
    let mut strategy = effective(vm, book)?;
    for _ in 0..4 {
        let state = state_of(book, seen);
        if unhalts(strategy, book, state) {
            book.override_strategy = Some(Override {
                strategy: strategy_name(RunStrategy::Always).into(),
                over: spec_strategy(vm),
            });
            strategy = RunStrategy::Always;
            changes.push(Change::Unhalted);
            continue;
        }
        let request = match book.requests.first() {
            // A stop asked of a VMI that does not run is done already.
            Some(Req::Stop) if !matches!(state, VmiState::Active | VmiState::Stopping) => {
                book.requests.remove(0);
                continue;
            }
            Some(Req::Stop) => Some(Request::Stop),
            Some(Req::Start | Req::StartPaused) => Some(Request::Start),
            None => None,
        };
        let since = Duration::from_secs((now - book.last_failed_at).max(0) as u64);
        match runstrategy::decide(strategy, state, request, book.failures, since) {
            Action::Nothing => return Ok((changes, None)),
            Action::WaitThenCreate(d) => {
                changes.push(Change::Waiting(d));
                return Ok((changes, Some(d)));
            }
            Action::Create => {
                book.runs += 1;
                let mut vmi = instance(vm, book.runs, &book.captured)?;
                if request == Some(Request::Start) && book.requests[0] == Req::StartPaused {
                    vmi.spec
                        .extra
                        .insert("startStrategy".into(), "Paused".into());
                }
                changes.push(Change::Created(vmi.uid().unwrap_or_default().into()));
                book.vmi = Some(vmi);
                book.running_since = None;
                book.stop_grace = None;
                if request == Some(Request::Start) {
                    book.requests.remove(0);
                }
            }
            Action::Stop => {
                changes.push(stop(book, now));
                if request == Some(Request::Stop) {
                    book.requests.remove(0);
                }
            }
            Action::Remove => changes.push(stop(book, now)),
            Action::Halt => {
                book.override_strategy = Some(Override {
                    strategy: "Halted".into(),
                    over: spec_strategy(vm),
                });
                changes.push(Change::Halted);
                return Ok((changes, None));
            }
        }
    }
    Ok((changes, None))
}

/// A start asked of a Halted VM with no VMI (only a paused start asks
/// so): as KubeVirt's controller, kvirt makes the strategy `Always` first,
/// and the request then starts the VMI.
fn unhalts(strategy: RunStrategy, book: &Book, state: VmiState) -> bool {
    strategy == RunStrategy::Halted
        && state == VmiState::Absent
        && book.requests.first().is_some_and(|r| r.starts())
}

/// Marks the book's VMI deleted, as a delete of the object does: the loop
/// that runs it shuts it down within this grace period.
fn stop(book: &mut Book, now: i64) -> Change {
    let grace = book.stop_grace;
    let Some(v) = book.vmi.as_mut() else {
        return Change::Stopping(String::new());
    };
    v.metadata.deletion_timestamp = serde_json::from_value(rfc3339(now).into()).ok();
    shorten_grace(v, grace);
    Change::Stopping(v.uid().unwrap_or_default().into())
}

/// The VMI's grace period, shortened to `grace` (never lengthened) as
/// `virtctl stop --grace-period` patches it: the VMI loop shuts the guest
/// down within it.
fn shorten_grace(v: &mut VirtualMachineInstance, grace: Option<u64>) {
    let own = v.termination_grace_period().as_secs();
    let g = grace.unwrap_or(own).min(own) as i64;
    v.spec.termination_grace_period_seconds = Some(g);
    v.metadata.deletion_grace_period_seconds = Some(g);
}

/// `kvirtctl start|stop|restart`, as `virtctl` does it to a VM: `start`
/// and `stop` change the strategy of a VM that follows one (KubeVirt
/// patches `spec.runStrategy`), and queue a request for a `Manual` one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// `paused`: the VMI starts with its vCPUs stopped (`--paused`).
    Start {
        paused: bool,
    },
    Stop {
        grace: Option<u64>,
    },
    /// `force`: the VMI is stopped within [`FORCE_RESTART_GRACE`].
    Restart {
        force: bool,
    },
}

impl Verb {
    /// The answer to a request taken (virtctl's words).
    pub fn scheduled(self, key: &VmKey) -> String {
        let what = match self {
            Verb::Start { .. } => "start",
            Verb::Stop { .. } => "stop",
            Verb::Restart { .. } => "restart",
        };
        format!("VM {key} was scheduled to {what}")
    }
}

/// The grace period of a forced restart: KubeVirt's virt-api sets the
/// VMI's to 1 s, "the shortest safe restart period".
pub const FORCE_RESTART_GRACE: u64 = 1;

pub fn request(
    vm: &VirtualMachine,
    book: &mut Book,
    seen: &Seen,
    verb: Verb,
) -> Result<(), String> {
    let strategy = effective(vm, book)?;
    let state = state_of(book, seen);
    let running = matches!(state, VmiState::Active);
    let set = |book: &mut Book, s: RunStrategy| {
        book.override_strategy = Some(Override {
            strategy: strategy_name(s).into(),
            over: spec_strategy(vm),
        });
    };
    match verb {
        Verb::Start { paused } => {
            let start = if paused { Req::StartPaused } else { Req::Start };
            match strategy {
                _ if running => Err("VM is already running".into()),
                // A paused start is a request: the VM loop makes the
                // strategy Always when it takes it (as KubeVirt's does), so
                // no VMI starts unpaused in between.
                RunStrategy::Halted if paused => {
                    book.requests.push(start);
                    Ok(())
                }
                RunStrategy::Halted => {
                    set(book, RunStrategy::Always);
                    Ok(())
                }
                RunStrategy::Always | RunStrategy::Once => Err(format!(
                    "VM is already started (runStrategy {})",
                    strategy_name(strategy)
                )),
                RunStrategy::Manual | RunStrategy::RerunOnFailure => {
                    book.requests.push(start);
                    Ok(())
                }
            }
        }
        Verb::Stop { grace } => {
            if strategy == RunStrategy::Halted && !running {
                return Err("VM is not running".into());
            }
            stop_within(book, grace);
            match strategy {
                RunStrategy::Manual => book.requests.push(Req::Stop),
                _ => set(book, RunStrategy::Halted),
            }
            Ok(())
        }
        Verb::Restart { force } => {
            match strategy {
                RunStrategy::Halted => return Err("VM is not running: start it instead".into()),
                RunStrategy::Once => {
                    return Err("VM runs Once: runStrategy Once does not support restart".into())
                }
                _ if book.vmi.is_none() => return Err("VM is not running".into()),
                _ => {}
            }
            if force {
                stop_within(book, Some(FORCE_RESTART_GRACE));
            }
            book.requests.extend([Req::Stop, Req::Start]);
            Ok(())
        }
    }
}

/// An asked-for stop's grace period, for the VMI it stops; one already
/// stopping is shortened too (`stop --force` after `stop`).
fn stop_within(book: &mut Book, grace: Option<u64>) {
    book.stop_grace = grace;
    if let Some(v) = book
        .vmi
        .as_mut()
        .filter(|v| v.metadata.deletion_timestamp.is_some())
    {
        shorten_grace(v, grace);
    }
}

/// The VM's status as KubeVirt writes it.
pub fn status(vm: &VirtualMachine, book: &Book, seen: &Seen, now: i64, deleted: bool) -> Value {
    let strategy = effective(vm, book);
    let vmi = seen.vmi.as_ref();
    let state = state_of(book, seen);
    let cond = |t: &str| {
        vmi.and_then(|v| v.status.conditions.iter().find(|c| c.type_ == t))
            .cloned()
    };
    let ready = cond("Ready").is_some_and(|c| c.status == "True");
    let paused = cond("Paused").is_some_and(|c| c.status == "True");
    let phase = vmi
        .filter(|v| book.vmi.as_ref().and_then(|b| b.uid()) == v.uid())
        .and_then(|v| v.status.phase);
    let waiting_reason = cond("Ready").and_then(|c| c.reason);
    let retry_at = book.last_failed_at + runstrategy::backoff(book.failures).as_secs() as i64;
    let printable = if deleted {
        "Terminating"
    } else if state == VmiState::Stopping {
        "Stopping"
    } else if strategy.is_err() {
        "Failure"
    } else if book.vmi.is_none() {
        if book.failures > 0 && retry_at > now && strategy != Ok(RunStrategy::Halted) {
            "CrashLoopBackOff"
        } else {
            "Stopped"
        }
    } else {
        match phase {
            Some(Phase::Running) if paused => "Paused",
            Some(Phase::Running) => "Running",
            Some(Phase::Succeeded) => "Stopped",
            Some(Phase::Failed) => "Stopped",
            _ => match waiting_reason.as_deref() {
                Some("ErrImagePull") => "ErrImagePull",
                _ => "Starting",
            },
        }
    };
    let mut conditions: Vec<Condition> =
        ["Ready", "Paused"].iter().filter_map(|t| cond(t)).collect();
    if let Err(why) = &strategy {
        conditions.push(condition("Failure", "True", "FailedCreate", why));
    } else if let Some(c) = cond("Synchronized").filter(|c| c.status == "False") {
        conditions.push(Condition {
            type_: "Failure".into(),
            status: "True".into(),
            ..c
        });
    }
    if let Some(mine) = book
        .vmi
        .as_ref()
        .filter(|v| v.metadata.deletion_timestamp.is_none())
    {
        // Both read through the same types, so only a real change differs.
        let spec = |v: &VirtualMachineInstance| serde_json::to_value(&v.spec).ok();
        let mut now = instance(vm, 0, &book.captured).ok();
        // A VMI made before kvirt gave a VM's VMIs KubeVirt's firmware UUID
        // has none: not a change of the user's.
        let fw_uuid = |v: &VirtualMachineInstance| {
            v.spec.domain.firmware.as_ref().and_then(|f| f.uuid.clone())
        };
        if let (Some(n), None) = (now.as_mut(), fw_uuid(mine)) {
            n.spec.domain.firmware = mine.spec.domain.firmware.clone();
        }
        // A paused start's startStrategy is the request's, not the template's.
        if let (Some(n), Some(s)) = (now.as_mut(), mine.spec.extra.get("startStrategy")) {
            n.spec
                .extra
                .entry("startStrategy")
                .or_insert_with(|| s.clone());
        }
        let now_spec = now.and_then(|v| spec(&v));
        if now_spec.is_some() && now_spec != spec(mine) {
            conditions.push(condition(
                "RestartRequired",
                "True",
                "",
                "a non-live-updatable field was changed in the template spec",
            ));
        }
    }
    let observed = book
        .vmi
        .as_ref()
        .and_then(|v| v.metadata.annotations.as_ref())
        .and_then(|a| a.get(GENERATION_ANNOTATION))
        .and_then(|g| g.parse::<i64>().ok());
    let mut st = json!({
        "printableStatus": printable,
        "ready": ready,
        "created": book.vmi.is_some(),
        "desiredGeneration": vm.generation(),
        "conditions": conditions,
    });
    let o = st.as_object_mut().expect("an object");
    if let Ok(s) = strategy {
        o.insert("runStrategy".into(), strategy_name(s).into());
    }
    if let Some(g) = observed {
        o.insert("observedGeneration".into(), g.into());
    }
    // Which revisions the VM uses (KubeVirt 1.5's status references).
    for (field, rev) in [
        ("instancetypeRef", &book.captured.instancetype),
        ("preferenceRef", &book.captured.preference),
    ] {
        if let Some(r) = rev {
            o.insert(
                field.into(),
                json!({
                    "name": r.object.pointer("/metadata/name"),
                    "kind": r.object.get("kind"),
                    "controllerRevisionRef": {"name": r.name},
                }),
            );
        }
    }
    if book.failures > 0 {
        o.insert(
            "startFailure".into(),
            json!({
                "consecutiveFailCount": book.failures,
                "lastFailedVMIUID": book.last_failed_uid,
                "retryAfterTimestamp": rfc3339(retry_at),
            }),
        );
    }
    if !book.requests.is_empty() {
        let uid = book.vmi.as_ref().and_then(|v| v.uid());
        let reqs: Vec<Value> = book.requests.iter().map(|r| r.to_json(uid)).collect();
        o.insert("stateChangeRequests".into(), reqs.into());
    }
    st
}

fn condition(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: (!reason.is_empty()).then(|| reason.into()),
        message: Some(message.into()),
        last_probe_time: None,
        last_transition_time: None,
        extra: Default::default(),
    }
}

/// A cluster VM's record, read back from the API objects: KubeVirt's
/// `status.startFailure` and `status.stateChangeRequests` of the VM, and
/// its VMI (the one it owns, if any). What a standalone record keeps
/// besides (run numbers, strategy overrides) the API holds itself: the
/// server names each VMI's UID, and `virtctl` patches the spec.
pub fn book_of(vm: &VirtualMachine, vmi: Option<&VirtualMachineInstance>) -> Book {
    let st = &vm.status;
    let failures = st["startFailure"]["consecutiveFailCount"]
        .as_u64()
        .unwrap_or(0) as u32;
    let retry_at = st["startFailure"]["retryAfterTimestamp"]
        .as_str()
        .and_then(parse_rfc3339);
    let requests = st["stateChangeRequests"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Req::from_json)
        .collect();
    let running_since = vmi.and_then(|v| {
        v.status
            .phase_transition_timestamps
            .iter()
            .find(|t| t.phase == Phase::Running)
            .and_then(|t| t.phase_transition_timestamp.as_deref())
            .and_then(parse_rfc3339)
    });
    Book {
        vm_uid: vm.metadata.uid.clone().unwrap_or_default(),
        generation: vm.generation(),
        vmi: vmi.cloned(),
        requests,
        failures,
        last_failed_uid: st["startFailure"]["lastFailedVMIUID"]
            .as_str()
            .map(str::to_owned),
        last_failed_at: retry_at.map_or(0, |r| r - runstrategy::backoff(failures).as_secs() as i64),
        running_since,
        ..Default::default()
    }
}

/// What a cluster VM needs now: the VM's new status (written first, with
/// the VM's resourceVersion, so that of several kvirtds one acts), then at
/// most one change to its VMI, and whether `Once` has run its course.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterStep {
    pub status: Value,
    /// A new VMI to create (its UID is the API server's to give).
    pub create: Option<VirtualMachineInstance>,
    /// Delete the VMI of this UID within this grace period.
    pub delete: Option<(String, i64)>,
    /// Set `spec.runStrategy` to this: `Halted` after `Once` ran, `Always`
    /// for a paused start of a Halted VM.
    pub run_strategy: Option<&'static str>,
    /// Look again after this long (a start waiting out its backoff).
    pub wait: Option<Duration>,
}

pub fn cluster_step(
    vm: &VirtualMachine,
    vmi: Option<&VirtualMachineInstance>,
    now: i64,
    captured: &Captured,
) -> ClusterStep {
    let mut book = book_of(vm, vmi);
    book.captured = captured.clone();
    let seen = Seen {
        vmi: vmi.cloned(),
        gone: vmi.is_none(),
    };
    let before = vmi.map(|v| {
        (
            v.uid().map(str::to_owned),
            v.metadata.deletion_timestamp.is_some(),
        )
    });
    if let Ok(strategy) = effective(vm, &book) {
        if unhalts(strategy, &book, state_of(&book, &seen)) {
            // The strategy first, in a write of its own: the request then
            // starts the VMI on the next pass, whatever happens in between.
            return ClusterStep {
                status: status(vm, &book, &seen, now, false),
                create: None,
                delete: None,
                run_strategy: Some("Always"),
                wait: None,
            };
        }
    }
    let (changes, wait) = advance(vm, &mut book, &seen, now, false).unwrap_or_default();
    let mut step = ClusterStep {
        status: Value::Null,
        create: None,
        delete: None,
        run_strategy: changes.contains(&Change::Halted).then_some("Halted"),
        wait,
    };
    if let Some(v) = &book.vmi {
        let uid = v.uid().map(str::to_owned);
        match &before {
            Some((old, _)) if *old != uid => {}
            None => {
                let mut new = v.clone();
                new.metadata.uid = None;
                step.create = Some(new);
            }
            Some((old, false)) if v.metadata.deletion_timestamp.is_some() => {
                let grace = v.metadata.deletion_grace_period_seconds.unwrap_or(0);
                step.delete = old.clone().map(|u| (u, grace));
            }
            Some(_) => {}
        }
    }
    let shown = Seen {
        vmi: seen.vmi.filter(|_| step.create.is_none()),
        gone: seen.gone,
    };
    step.status = status(vm, &book, &shown, now, false);
    step
}

/// Seconds since the epoch of a Kubernetes timestamp (`2026-12-01T10:00:00Z`,
/// fractions and offsets accepted); `None` when it is not one.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (hh, mm, ss) = (n(11..13)?, n(14..16)?, n(17..19)?);
    let rest = &s[19..];
    let rest = rest.trim_start_matches(|c: char| c == '.' || c.is_ascii_digit());
    let offset = match rest {
        "Z" | "z" => 0,
        o if o.len() == 6 => {
            let sign = if o.starts_with('-') { -1 } else { 1 };
            sign * (o.get(1..3)?.parse::<i64>().ok()? * 3600
                + o.get(4..6)?.parse::<i64>().ok()? * 60)
        }
        _ => return None,
    };
    // Days since 1970-01-01 from the civil date (the inverse of rfc3339's).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss - offset)
}

/// Kubernetes' timestamp form of seconds since the epoch (UTC, whole
/// seconds), computed here so that this module stays free of clocks.
pub fn rfc3339(secs: i64) -> String {
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (the proleptic Gregorian
    // calendar in 400-year eras).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE: Captured = Captured {
        instancetype: None,
        preference: None,
    };

    #[test]
    fn expand_applies_the_instancetype_and_drops_the_matcher() {
        let mut v = serde_json::to_value(vm("Always")).unwrap();
        v["spec"]["instancetype"] = json!({"kind": "VirtualMachineInstancetype", "name": "small"});
        v["spec"]["template"]["spec"]["domain"]
            .as_object_mut()
            .unwrap()
            .remove("memory");
        let v = VirtualMachine::from_value(v).unwrap();
        let captured = Captured {
            instancetype: Some(instancetype::Revision::of(
                "web",
                &json!({
                    "apiVersion": "instancetype.kubevirt.io/v1beta1",
                    "kind": "VirtualMachineInstancetype",
                    "metadata": {"name": "small", "namespace": "prod"},
                    "spec": {"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}},
                }),
            )),
            preference: None,
        };
        let e = expanded(&v, &captured).unwrap();
        assert!(e["spec"].get("instancetype").is_none(), "{e}");
        assert_eq!(
            e["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
            "256Mi"
        );
        assert_eq!(
            e["spec"]["template"]["spec"]["domain"]["cpu"]["sockets"], 2,
            "{e}"
        );
        // What cannot be found is named, not guessed.
        assert!(expanded(&v, &NONE).unwrap_err().contains("not found"));
    }

    fn vm(strategy: &str) -> VirtualMachine {
        let mut v = VirtualMachine::from_value(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachine",
            "metadata": {"name": "web", "namespace": "prod"},
            "spec": {
                "runStrategy": strategy,
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 30,
                        "domain": {"devices": {}, "memory": {"guest": "128Mi"}}
                    }
                }
            }
        }))
        .unwrap();
        let mut book = Book::default();
        settle_identity(&mut v, &mut book, || "vm-uid".into());
        v
    }

    /// The VMI as the VMI loop reports it back.
    fn seen(book: &Book, phase: Option<Phase>) -> Seen {
        let vmi = book.vmi.clone().map(|mut v| {
            v.status.phase = phase;
            v
        });
        Seen { vmi, gone: false }
    }

    /// One pass with the book's VMI in `phase`.
    fn at(
        vm: &VirtualMachine,
        book: &mut Book,
        phase: Option<Phase>,
        now: i64,
    ) -> Result<(Vec<Change>, Option<Duration>), String> {
        let s = seen(book, phase);
        advance(vm, book, &s, now, false)
    }

    const GONE: Seen = Seen {
        vmi: None,
        gone: true,
    };

    /// The book's VMI is marked deleted (being stopped).
    fn stopping(book: &Book) -> bool {
        book.vmi
            .as_ref()
            .is_some_and(|v| v.metadata.deletion_timestamp.is_some())
    }

    fn uid(book: &Book) -> String {
        book.vmi.as_ref().unwrap().uid().unwrap().to_owned()
    }

    #[test]
    fn the_vmi_is_the_template_owned_by_the_vm() {
        let vm = vm("Always");
        let v = instance(&vm, 1, &NONE).unwrap();
        assert_eq!(v.metadata.name.as_deref(), Some("web"));
        assert_eq!(v.metadata.namespace.as_deref(), Some("prod"));
        assert_eq!(v.metadata.labels.as_ref().unwrap()["app"], "web");
        let owner = &v.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("VirtualMachine", "vm-uid", Some(true))
        );
        assert_eq!(
            v.metadata.annotations.as_ref().unwrap()[GENERATION_ANNOTATION],
            "1"
        );
        assert_eq!(v.spec.termination_grace_period_seconds, Some(30));
        // One UID per run, the same when made again (after a crash).
        assert_eq!(v.uid(), instance(&vm, 1, &NONE).unwrap().uid());
        assert_ne!(v.uid(), instance(&vm, 2, &NONE).unwrap().uid());
        // The guest sees one machine across runs: KubeVirt's UUID of the name.
        let uuid = |run| {
            instance(&vm, run, &NONE)
                .unwrap()
                .spec
                .domain
                .firmware
                .unwrap()
                .uuid
        };
        assert_eq!(
            uuid(1),
            Some(crate::core::defaults::vm_firmware_uuid("web"))
        );
        assert_eq!(uuid(1), uuid(2));
    }

    #[test]
    fn what_kvirt_cannot_run_is_refused_with_the_field() {
        let mut v = vm("Always");
        v.spec
            .extra
            .insert("liveUpdateFeatures".into(), json!({"cpu": {}}));
        assert!(v
            .strategy()
            .unwrap_err()
            .contains("spec.liveUpdateFeatures"));
        v.spec.extra.clear();
        v.spec.template.as_mut().unwrap().metadata = Some(
            serde_json::from_value(json!({"labels": {"kubevirt.io/nodeName": "node-1"}})).unwrap(),
        );
        let e = v.strategy().unwrap_err();
        assert!(
            e.contains("kubevirt.io/nodeName") && e.contains("may not choose its node"),
            "{e}"
        );
        let mut v = vm("Always");
        v.spec
            .extra
            .insert("dataVolumeTemplates".into(), json!([{"metadata": {}}]));
        assert!(v.strategy().unwrap_err().contains("dataVolumeTemplates"));
        let mut book = Book::default();
        let err = advance(&vm("WaitAsReceiver"), &mut book, &GONE, 0, false).unwrap_err();
        assert!(err.contains("migrations"), "{err}");
        assert!(book.vmi.is_none());
        let st = status(&vm("WaitAsReceiver"), &book, &GONE, 0, false);
        assert_eq!(st["printableStatus"], "Failure");
        assert_eq!(st["conditions"][0]["type"], "Failure");
    }

    #[test]
    fn always_starts_a_new_vmi_after_the_guest_powers_off() {
        let vm = vm("Always");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 100, false).unwrap();
        let first = uid(&book);
        at(&vm, &mut book, Some(Phase::Running), 101).unwrap();
        assert_eq!(
            status(&vm, &book, &seen(&book, Some(Phase::Running)), 101, false)["printableStatus"],
            "Running"
        );
        // Powered off: the VMI is deleted, and once gone a new one is made.
        at(&vm, &mut book, Some(Phase::Succeeded), 102).unwrap();
        assert!(stopping(&book));
        let s = seen(&book, Some(Phase::Succeeded));
        assert_eq!(
            status(&vm, &book, &s, 102, false)["printableStatus"],
            "Stopping"
        );
        // Its last status is still about when it is found gone: the new
        // VMI is not taken for it.
        let mut last = seen(&book, Some(Phase::Succeeded));
        last.gone = true;
        let (changes, wait) = advance(&vm, &mut book, &last, 103, false).unwrap();
        assert_eq!(wait, None);
        assert!(
            matches!(changes[..], [Change::Removed(_), Change::Created(_)]),
            "{changes:?}"
        );
        assert!(book.vmi.is_some() && !stopping(&book));
        assert_ne!(uid(&book), first);
        assert_eq!(book.failures, 0);
    }

    #[test]
    fn failed_runs_back_off_and_show_crash_loop() {
        let vm = vm("RerunOnFailure");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 100, false).unwrap();
        let first = uid(&book);
        at(&vm, &mut book, Some(Phase::Failed), 110).unwrap();
        assert_eq!(book.failures, 1);
        let (_, wait) = advance(&vm, &mut book, &GONE, 111, false).unwrap();
        assert_eq!(wait, Some(Duration::from_secs(9)));
        assert!(book.vmi.is_none());
        let st = status(&vm, &book, &GONE, 111, false);
        assert_eq!(st["printableStatus"], "CrashLoopBackOff");
        assert_eq!(st["startFailure"]["consecutiveFailCount"], 1);
        assert_eq!(st["startFailure"]["lastFailedVMIUID"], first.as_str());
        assert_eq!(
            st["startFailure"]["retryAfterTimestamp"],
            "1970-01-01T00:02:00Z"
        );
        // Due: a new VMI.
        advance(&vm, &mut book, &GONE, 120, false).unwrap();
        assert_ne!(uid(&book), first);
        // Failing again at once doubles the wait.
        at(&vm, &mut book, Some(Phase::Failed), 121).unwrap();
        let (_, wait) = advance(&vm, &mut book, &GONE, 121, false).unwrap();
        assert_eq!(wait, Some(Duration::from_secs(20)));
        // A guest that shuts down is not started again.
        advance(&vm, &mut book, &GONE, 141, false).unwrap();
        at(&vm, &mut book, Some(Phase::Succeeded), 150).unwrap();
        assert_eq!(book.failures, 0);
        assert!(book.vmi.is_some() && !stopping(&book));
        let s = seen(&book, Some(Phase::Succeeded));
        assert_eq!(
            status(&vm, &book, &s, 150, false)["printableStatus"],
            "Stopped"
        );
    }

    #[test]
    fn stop_start_and_restart_as_virtctl_does_them() {
        let vm = vm("Always");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 0, false).unwrap();
        let first = uid(&book);
        let running = seen(&book, Some(Phase::Running));
        assert!(
            request(&vm, &mut book, &running, Verb::Start { paused: false })
                .unwrap_err()
                .contains("already running")
        );
        // Restart: the VMI goes, a new one comes.
        request(&vm, &mut book, &running, Verb::Restart { force: false }).unwrap();
        advance(&vm, &mut book, &running, 1, false).unwrap();
        assert!(stopping(&book));
        advance(&vm, &mut book, &GONE, 2, false).unwrap();
        let second = uid(&book);
        assert_ne!(second, first);
        assert!(book.requests.is_empty());
        // Stop, with a shorter grace: Halted, and it stays so.
        let running = seen(&book, Some(Phase::Running));
        request(&vm, &mut book, &running, Verb::Stop { grace: Some(5) }).unwrap();
        assert_eq!(effective(&vm, &book), Ok(RunStrategy::Halted));
        advance(&vm, &mut book, &running, 3, false).unwrap();
        let v = book.vmi.as_ref().unwrap();
        assert_eq!(v.metadata.deletion_grace_period_seconds, Some(5));
        assert_eq!(v.spec.termination_grace_period_seconds, Some(5));
        advance(&vm, &mut book, &GONE, 4, false).unwrap();
        assert!(book.vmi.is_none());
        advance(&vm, &mut book, &GONE, 5, false).unwrap();
        assert!(book.vmi.is_none());
        assert_eq!(
            status(&vm, &book, &GONE, 5, false)["printableStatus"],
            "Stopped"
        );
        assert!(request(&vm, &mut book, &GONE, Verb::Stop { grace: None })
            .unwrap_err()
            .contains("not running"));
        // Start: Always again.
        request(&vm, &mut book, &GONE, Verb::Start { paused: false }).unwrap();
        advance(&vm, &mut book, &GONE, 6, false).unwrap();
        assert!(book.vmi.is_some());
        // An edited manifest's strategy wins over kvirtctl's.
        let mut halted = vm.clone();
        halted.spec.run_strategy = Some("Halted".into());
        assert_eq!(effective(&halted, &book), Ok(RunStrategy::Halted));
    }

    fn start_strategy(book: &Book) -> Option<&Value> {
        book.vmi.as_ref()?.spec.extra.get("startStrategy")
    }

    #[test]
    fn a_paused_start_makes_a_paused_vmi_once() {
        // Halted: the request comes first, the strategy follows it.
        let vm = vm("Halted");
        let mut book = Book::default();
        request(&vm, &mut book, &GONE, Verb::Start { paused: true }).unwrap();
        assert_eq!(effective(&vm, &book), Ok(RunStrategy::Halted));
        let st = status(&vm, &book, &GONE, 0, false);
        assert_eq!(
            st["stateChangeRequests"][0],
            json!({"action": "Start", "data": {"startPaused": "true"}})
        );
        let (changes, _) = advance(&vm, &mut book, &GONE, 1, false).unwrap();
        assert_eq!(changes[0], Change::Unhalted, "{changes:?}");
        assert_eq!(effective(&vm, &book), Ok(RunStrategy::Always));
        assert_eq!(start_strategy(&book), Some(&json!("Paused")));
        assert!(book.requests.is_empty());
        // Its own start strategy is no edit of the template's.
        let running = seen(&book, Some(Phase::Running));
        let st = status(&vm, &book, &running, 2, false);
        assert!(
            !st["conditions"].to_string().contains("RestartRequired"),
            "{st}"
        );
        // The next VMI (after a restart) runs as the template says.
        request(&vm, &mut book, &running, Verb::Restart { force: false }).unwrap();
        advance(&vm, &mut book, &running, 3, false).unwrap();
        advance(&vm, &mut book, &GONE, 4, false).unwrap();
        assert_eq!(start_strategy(&book), None);
        // Manual: a request, as an unpaused start.
        let manual = super::tests::vm("Manual");
        let mut book = Book::default();
        request(&manual, &mut book, &GONE, Verb::Start { paused: true }).unwrap();
        assert_eq!(book.requests, [Req::StartPaused]);
        advance(&manual, &mut book, &GONE, 0, false).unwrap();
        assert_eq!(start_strategy(&book), Some(&json!("Paused")));
        assert_eq!(effective(&manual, &book), Ok(RunStrategy::Manual));
        // Always: refused as virt-api does.
        let always = super::tests::vm("Always");
        assert!(request(
            &always,
            &mut Book::default(),
            &GONE,
            Verb::Start { paused: true }
        )
        .unwrap_err()
        .contains("already started"));
    }

    #[test]
    fn a_forced_restart_stops_within_a_second() {
        let vm = vm("Always");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 0, false).unwrap();
        let running = seen(&book, Some(Phase::Running));
        request(&vm, &mut book, &running, Verb::Restart { force: true }).unwrap();
        assert_eq!(book.stop_grace, Some(FORCE_RESTART_GRACE));
        advance(&vm, &mut book, &running, 1, false).unwrap();
        let v = book.vmi.as_ref().unwrap();
        assert_eq!(v.metadata.deletion_grace_period_seconds, Some(1));
        advance(&vm, &mut book, &GONE, 2, false).unwrap();
        // The new VMI keeps the template's grace.
        let v = book.vmi.as_ref().unwrap();
        assert_eq!(v.spec.termination_grace_period_seconds, Some(30));
        assert_eq!(book.stop_grace, None);
        // Nothing to restart: refused with virt-api's reasons.
        for (strategy, seen, why) in [
            ("Once", &running, "Once"),
            ("Halted", &GONE, "not running"),
            ("Always", &GONE, "not running"),
        ] {
            let e = request(
                &super::tests::vm(strategy),
                &mut Book::default(),
                seen,
                Verb::Restart { force: true },
            )
            .unwrap_err();
            assert!(e.contains(why), "{strategy}: {e}");
        }
    }

    #[test]
    fn manual_vms_move_only_on_requests_and_once_halts() {
        let vm = vm("Manual");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 0, false).unwrap();
        assert!(book.vmi.is_none());
        request(&vm, &mut book, &GONE, Verb::Start { paused: false }).unwrap();
        advance(&vm, &mut book, &GONE, 0, false).unwrap();
        assert!(book.vmi.is_some() && book.requests.is_empty());
        let running = seen(&book, Some(Phase::Running));
        request(&vm, &mut book, &running, Verb::Stop { grace: None }).unwrap();
        let st = status(&vm, &book, &running, 0, false);
        assert_eq!(st["stateChangeRequests"][0]["action"], "Stop");
        advance(&vm, &mut book, &running, 1, false).unwrap();
        advance(&vm, &mut book, &GONE, 2, false).unwrap();
        assert!(book.vmi.is_none() && book.requests.is_empty());

        let once = super::tests::vm("Once");
        let mut book = Book::default();
        advance(&once, &mut book, &GONE, 0, false).unwrap();
        let (changes, _) = at(&once, &mut book, Some(Phase::Succeeded), 1).unwrap();
        assert!(changes.contains(&Change::Halted), "{changes:?}");
        assert_eq!(effective(&once, &book), Ok(RunStrategy::Halted));
        at(&once, &mut book, Some(Phase::Succeeded), 2).unwrap();
        advance(&once, &mut book, &GONE, 3, false).unwrap();
        assert!(book.vmi.is_none());
    }

    #[test]
    fn an_edited_template_waits_for_the_next_start() {
        let mut v = vm("Always");
        let mut book = Book {
            vm_uid: "vm-uid".into(),
            ..Default::default()
        };
        settle_identity(&mut v, &mut book, || unreachable!());
        advance(&v, &mut book, &GONE, 0, false).unwrap();
        let running = seen(&book, Some(Phase::Running));
        let st = status(&v, &book, &running, 0, false);
        assert_eq!(
            (
                st["desiredGeneration"].clone(),
                st["observedGeneration"].clone()
            ),
            (json!(1), json!(1))
        );
        let restart = |st: &Value| {
            st["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["type"] == "RestartRequired")
        };
        assert!(!restart(&st));
        // A VMI made by an older kvirt, without the firmware UUID it now
        // gives: no restart is asked for.
        let mut old = book.clone();
        old.vmi.as_mut().unwrap().spec.domain.firmware = None;
        assert!(!restart(&status(&v, &old, &running, 0, false)));
        let mut edited = v.clone();
        edited.spec.template.as_mut().unwrap().spec["domain"]["memory"]["guest"] = json!("256Mi");
        settle_identity(&mut edited, &mut book, || unreachable!());
        advance(&edited, &mut book, &running, 1, false).unwrap();
        let st = status(&edited, &book, &running, 1, false);
        assert_eq!(st["desiredGeneration"], 2);
        assert_eq!(st["observedGeneration"], 1);
        assert!(st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "RestartRequired"));
        // The running VMI keeps the spec it was made with.
        assert_eq!(
            book.vmi
                .as_ref()
                .unwrap()
                .spec
                .domain
                .memory
                .as_ref()
                .map(|m| format!("{:?}", m)),
            instance(&v, 1, &NONE)
                .unwrap()
                .spec
                .domain
                .memory
                .as_ref()
                .map(|m| format!("{:?}", m))
        );
    }

    #[test]
    fn a_deleted_vm_stops_its_vmi() {
        let vm = vm("Always");
        let mut book = Book::default();
        advance(&vm, &mut book, &GONE, 0, false).unwrap();
        let running = seen(&book, Some(Phase::Running));
        advance(&vm, &mut book, &running, 1, true).unwrap();
        assert!(stopping(&book));
        assert_eq!(
            status(&vm, &book, &running, 1, true)["printableStatus"],
            "Terminating"
        );
        advance(&vm, &mut book, &GONE, 2, true).unwrap();
        assert!(book.vmi.is_none());
    }

    #[test]
    fn a_cluster_vm_acts_through_its_objects() {
        let vm = vm("RerunOnFailure");
        // No VMI: one to create, the server to name its UID.
        let s = cluster_step(&vm, None, 100, &NONE);
        let new = s.create.clone().unwrap();
        assert_eq!(new.metadata.uid, None);
        assert_eq!(
            new.metadata.owner_references.as_ref().unwrap()[0].uid,
            "vm-uid"
        );
        assert_eq!(s.status["created"], true);
        // Its VMI failed: the count is written, the VMI deleted.
        let mut failed = new.clone();
        failed.metadata.uid = Some("api-1".into());
        failed.status.phase = Some(Phase::Failed);
        let s = cluster_step(&vm, Some(&failed), 110, &NONE);
        assert_eq!(s.delete, Some(("api-1".into(), 30)));
        assert_eq!(s.status["startFailure"]["consecutiveFailCount"], 1);
        assert!(s.create.is_none());
        // Read back (as another kvirtd would): not counted twice.
        let mut seen_vm = vm.clone();
        seen_vm.status = s.status.clone();
        let mut deleting = failed.clone();
        deleting.metadata.deletion_timestamp = serde_json::from_value(json!(rfc3339(110))).ok();
        let s2 = cluster_step(&seen_vm, Some(&deleting), 111, &NONE);
        assert_eq!(s2.status["startFailure"]["consecutiveFailCount"], 1);
        assert_eq!((s2.delete.clone(), s2.create.is_some()), (None, false));
        // Gone: backed off, then made anew.
        let s3 = cluster_step(&seen_vm, None, 112, &NONE);
        assert_eq!(s3.wait, Some(Duration::from_secs(8)));
        assert_eq!(s3.status["printableStatus"], "CrashLoopBackOff");
        assert!(s3.create.is_none());
        assert!(cluster_step(&seen_vm, None, 120, &NONE).create.is_some());
        // Once: the run ended, the spec becomes Halted.
        let once = super::tests::vm("Once");
        let mut done = instance(&once, 1, &NONE).unwrap();
        done.status.phase = Some(Phase::Succeeded);
        assert_eq!(
            cluster_step(&once, Some(&done), 5, &NONE).run_strategy,
            Some("Halted")
        );
    }

    #[test]
    fn a_cluster_vm_started_paused_becomes_always_before_its_vmi() {
        let mut vm = vm("Halted");
        let mut book = book_of(&vm, None);
        request(&vm, &mut book, &GONE, Verb::Start { paused: true }).unwrap();
        // What the request handler writes, read back by the VM loop.
        let uid = None;
        let reqs: Vec<Value> = book.requests.iter().map(|r| r.to_json(uid)).collect();
        vm.status = json!({"stateChangeRequests": reqs});
        let s = cluster_step(&vm, None, 1, &NONE);
        assert_eq!(s.run_strategy, Some("Always"));
        assert!(s.create.is_none());
        assert_eq!(
            s.status["stateChangeRequests"],
            vm.status["stateChangeRequests"]
        );
        // The strategy written: the next pass makes the VMI, paused.
        vm.spec.run_strategy = Some("Always".into());
        let s = cluster_step(&vm, None, 2, &NONE);
        let new = s.create.unwrap();
        assert_eq!(new.spec.extra.get("startStrategy"), Some(&json!("Paused")));
        assert!(
            s.status.get("stateChangeRequests").is_none(),
            "{}",
            s.status
        );
        assert_eq!(s.run_strategy, None);
    }

    #[test]
    fn timestamps_are_kubernetes_form() {
        assert_eq!(parse_rfc3339("2026-12-01T23:59:59Z"), Some(1_796_169_599));
        assert_eq!(
            parse_rfc3339("2026-12-01T23:59:59.123Z"),
            Some(1_796_169_599)
        );
        assert_eq!(
            parse_rfc3339("2026-12-02T01:59:59+02:00"),
            Some(1_796_169_599)
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
        for t in [0, 951_782_400, 1_796_169_599, 4_102_444_800] {
            assert_eq!(parse_rfc3339(&rfc3339(t)), Some(t));
        }
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_169_599), "2026-12-01T23:59:59Z");
    }
}
