//! Live migration's pure half: KubeVirt's `VirtualMachineInstanceMigration`
//! and its phases (checked transitions), whether a VMI can move at all (the
//! `LiveMigratable` condition, with KubeVirt's reasons), whether this host
//! may be a migration's target, and the VMI's `status.migrationState`.
//!
//! Targets are chosen the way claim mode chooses a host for a VMI: every
//! kvirtd that fits claims the migration with optimistic concurrency, the
//! first write wins. So the scheduling rules are the VMI's own
//! ([`scheduling::fits`]) plus the migration's `addedNodeSelector` and
//! kvirt's target-node annotation.

use crate::core::convert::Claims;
use crate::core::plan::Migrating;
use crate::core::pvc::{self, Backend, Pvc};
use crate::core::scheduling::{self, HostFacts};
use crate::core::vmi::{Condition, VirtualMachineInstance, VmiSpec, Volume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

/// The VMI condition KubeVirt sets on every VMI.
pub const CONDITION: &str = "LiveMigratable";
/// KubeVirt's reason for a VMI whose disks cannot follow it.
pub const REASON_DISKS: &str = "DisksNotLiveMigratable";
/// The migration's label naming its VMI (`virtctl migrate-cancel` lists by it).
pub const VMI_NAME_LABEL: &str = "kubevirt.io/vmi-name";
/// The label, on the migration and the VMI, naming the target node.
pub const TARGET_NODE_LABEL: &str = "kubevirt.io/migrationTargetNodeName";
/// KubeVirt's annotation on a migration a drain made, naming the node
/// being emptied.
pub const EVACUATION_ANNOTATION: &str = "kubevirt.io/evacuationMigration";
/// kvirt's annotation on a migration naming the one host that may take it.
pub const TARGET_ANNOTATION: &str = "kvirt.io/target-node";
/// kvirt's label on a migration naming the host that acts on it (its
/// VMI's): each host watches only the objects labelled with its name; the
/// leader labels new ones (`sources::cluster::routing`).
pub const HOST_LABEL: &str = "kvirt.io/host";

/// KubeVirt's migration phases, in the order a migration passes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum MigrationPhase {
    Pending,
    Scheduling,
    Scheduled,
    PreparingTarget,
    TargetReady,
    Running,
    Succeeded,
    Failed,
}

impl MigrationPhase {
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("migration phase {from:?} cannot become {to:?}")]
pub struct TransitionError {
    pub from: MigrationPhase,
    pub to: MigrationPhase,
}

/// Forward only (a standalone migration skips the scheduling phases), any
/// unfinished phase may fail, only a running migration succeeds, and the
/// final phases stay.
pub fn check(from: Option<MigrationPhase>, to: MigrationPhase) -> Result<(), TransitionError> {
    use MigrationPhase::*;
    let Some(from) = from else { return Ok(()) };
    let ok = from == to
        || match (from, to) {
            (Succeeded | Failed, _) => false,
            (_, Failed) => true,
            (_, Succeeded) => from == Running,
            _ => to > from,
        };
    if ok {
        Ok(())
    } else {
        Err(TransitionError { from, to })
    }
}

/// What the host holding a migration object's VMI does with the object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ObjectAction {
    /// Not this host's to act on, or being acted on already.
    Ignore,
    /// Move the VMI.
    Start,
    /// Write the object's final phase (and why it failed).
    Finish(MigrationPhase, Option<String>),
}

/// The host deciding on a migration object, and what it knows of it.
pub struct Here<'a> {
    pub node: &'a str,
    /// This kvirtd runs the object's migration now.
    pub running: bool,
    /// The VM bears a mark of a migration away from here (a kvirtd before
    /// this one began one; its recovery ends it).
    pub departing: bool,
}

/// Decides for the object `m` on host `here`, which holds `vmi` (pure).
/// The VMI's `migrationState`, written by the migration's source, tells
/// how a migration this host no longer runs ended: after a kvirtd
/// restart, or on the target once the VMI was handed to it.
pub fn object_action(m: &Migration, vmi: &VirtualMachineInstance, here: &Here) -> ObjectAction {
    use crate::core::vmi::{Phase, NODE_LABEL};
    let labelled = vmi.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL));
    let uid = m.metadata.uid.as_deref().unwrap_or_default();
    if m.status.phase.is_some_and(MigrationPhase::is_final)
        || labelled.map(String::as_str) != Some(here.node)
        || here.running
        || uid.is_empty()
    {
        return ObjectAction::Ignore;
    }
    // Past Scheduling, an earlier kvirtd here began it (the host running
    // the VMI is the one that acts): never begun again.
    let begun = m
        .status
        .phase
        .is_some_and(|p| p >= MigrationPhase::Scheduled);
    let state: Option<MigrationState> = vmi
        .status
        .extra
        .get(STATE_FIELD)
        .and_then(|v| serde_json::from_value(v.clone()).ok());
    match state.filter(|s| s.migration_uid == uid) {
        Some(s) if s.completed => ObjectAction::Finish(MigrationPhase::Succeeded, None),
        Some(s) if s.failed => ObjectAction::Finish(MigrationPhase::Failed, s.failure_reason),
        // Started by a kvirtd that restarted since: its recovery ends it.
        Some(_) => ObjectAction::Ignore,
        None if begun && here.departing => ObjectAction::Ignore,
        None if begun => ObjectAction::Finish(
            MigrationPhase::Failed,
            Some("the source kvirtd restarted before the guest began to move".into()),
        ),
        None if m.metadata.deletion_timestamp.is_some() => ObjectAction::Ignore,
        None if vmi.metadata.deletion_timestamp.is_some() => ObjectAction::Finish(
            MigrationPhase::Failed,
            Some("the VMI is being deleted".into()),
        ),
        None if vmi.status.phase != Some(Phase::Running) => ObjectAction::Finish(
            MigrationPhase::Failed,
            Some(format!(
                "the VMI is not running (phase {:?})",
                vmi.status.phase.unwrap_or(Phase::Pending)
            )),
        ),
        None => ObjectAction::Start,
    }
}

/// Where a migration object goes, given its VMI `key` as read now.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// Labelled for this host ([`HOST_LABEL`]): the one its VMI runs on.
    Host(String),
    /// Failed, with why: its VMI does not exist or runs on no host.
    Fail(String),
    /// Left as it is: final, being deleted, or labelled rightly already.
    Stay,
}

/// Routes the object `m` of the VMI `key` (pure): to the host its VMI runs
/// on, which alone acts on it (an object a user made has no label yet; one
/// whose VMI moved since it was labelled, as a migration's target that
/// finishes what its source could not, goes on to the VMI's new host).
pub fn route(m: &Migration, key: &str, vmi: Option<&VirtualMachineInstance>) -> Route {
    use crate::core::vmi::NODE_LABEL;
    if m.status.phase.is_some_and(MigrationPhase::is_final)
        || m.metadata.deletion_timestamp.is_some()
    {
        return Route::Stay;
    }
    let labelled = m.metadata.labels.as_ref().and_then(|l| l.get(HOST_LABEL));
    let node = vmi.and_then(|v| v.metadata.labels.as_ref()?.get(NODE_LABEL));
    match (node, runs_nowhere(key, vmi)) {
        (Some(n), _) if labelled == Some(n) => Route::Stay,
        (Some(n), _) => Route::Host(n.clone()),
        (None, Some(why)) => Route::Fail(why),
        (None, None) => Route::Stay,
    }
}

/// Why the object of a migration no host took up fails (pure): its VMI
/// does not exist, or runs on no host (KubeVirt refuses such an object at
/// admission). `None`: its VMI is some host's, which decides.
fn runs_nowhere(key: &str, vmi: Option<&VirtualMachineInstance>) -> Option<String> {
    use crate::core::vmi::NODE_LABEL;
    let Some(vmi) = vmi else {
        return Some(format!("the VMI {key} does not exist"));
    };
    let labels = vmi.metadata.labels.as_ref();
    if labels.is_some_and(|l| l.contains_key(NODE_LABEL)) {
        return None;
    }
    let phase = vmi.status.phase.unwrap_or(crate::core::vmi::Phase::Pending);
    Some(format!(
        "the VMI {key} runs on no host (phase {phase:?}): only a running VMI migrates"
    ))
}

/// `kubevirt.io/v1` `VirtualMachineInstanceMigration`, the fields kvirt reads
/// and writes; the rest is kept as it came.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Migration {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: MigrationSpec,
    #[serde(default)]
    pub status: MigrationStatus,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationSpec {
    #[serde(default)]
    pub vmi_name: String,
    /// Labels the target must have besides what the VMI asks for.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub added_node_selector: BTreeMap<String, String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MigrationPhase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_state: Option<MigrationState>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The VMI's `status.migrationState` (and the migration's), KubeVirt's names.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigrationState {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub migration_uid: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source_node: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target_node: String,
    /// The target's migration port, `host:port`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub target_node_address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_timestamp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_timestamp: Option<String>,
    #[serde(default)]
    pub completed: bool,
    #[serde(default)]
    pub failed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    #[serde(default)]
    pub abort_requested: bool,
    /// `PreCopy`: kvirt does not switch to post-copy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
}

/// What a source kvirtd asks of the target kvirtd, one JSON line each on
/// the migration's control channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum ToTarget {
    /// Make everything the VM needs but its domain (the migration brings
    /// that): unit, namespace, network, daemon, disks.
    Prepare {
        vmi: Box<VirtualMachineInstance>,
        source_node: String,
        /// The base each copied overlay lies over at the source, by
        /// volume (see [`same_bases`]).
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        bases: BTreeMap<String, String>,
    },
    /// libvirt finished: the target runs the VM, and owns it from now on.
    /// The VMI's uid lets a target that restarted since it took the VM on
    /// recognise a commit repeated (its answer lost) by the VM it runs.
    Commit {
        #[serde(default)]
        vmi_uid: String,
    },
    /// Remove what was prepared; the VM stays at the source.
    Abort { reason: String },
}

/// What the target kvirtd answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum ToSource {
    /// Prepared: the VM's daemon listens where the layout says.
    Ready,
    /// Not here, and why (nothing was left behind).
    Refused { reason: String },
    /// Answer to a commit: the VM does not run here (it ended during the
    /// migration, or never came), and nothing of it is left here. The
    /// source's copy is all there is.
    NotHere { reason: String },
    /// The target runs the VM as its own; the guest's pause at the
    /// switch-over when its libvirt knows it.
    Committed {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        downtime_ms: Option<u64>,
    },
}

/// The status key [`MigrationState`] lives under.
pub const STATE_FIELD: &str = "migrationState";

impl MigrationState {
    pub fn started(uid: &str, source_node: &str, now: &str) -> Self {
        MigrationState {
            migration_uid: uid.into(),
            source_node: source_node.into(),
            start_timestamp: Some(now.into()),
            mode: Some("PreCopy".into()),
            ..Default::default()
        }
    }

    /// Ended: `Ok` the VM runs at the target, `Err` why it stayed.
    pub fn ended(mut self, now: &str, result: Result<(), &str>) -> Self {
        self.end_timestamp = Some(now.into());
        match result {
            Ok(()) => self.completed = true,
            Err(reason) => {
                self.failed = true;
                self.failure_reason = Some(reason.chars().take(FIELD_MAX).collect());
            }
        }
        self
    }
}

/// Bound on a reason kept in a status field.
const FIELD_MAX: usize = 1024;

/// A migration this host takes part in, kept (atomically, root's alone)
/// from before it starts until it ends: a kvirtd restarted meanwhile must
/// know a VM is leaving (never start it here again: the source daemon
/// completes a migration whose client died) or arriving.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mark {
    pub migration_uid: String,
    pub role: Migrating,
    /// The VMI instance it is about: a mark of an older instance of the
    /// name holds nothing of a newer one.
    pub vmi_uid: String,
    /// The other host (its migration port's address).
    pub peer: String,
    /// Arriving: the VMI itself, which no source of this host lists until
    /// the migration commits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmi: Option<Box<VirtualMachineInstance>>,
    /// Arriving in a cluster: the source's commit is in, and the mark holds
    /// the VMI until the API server lists it as this host's (the source
    /// hands it over after the commit).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub committed: bool,
}

impl Mark {
    /// Whether it holds for `vmi` (its uid).
    pub fn holds_for(&self, vmi: &VirtualMachineInstance) -> bool {
        vmi.uid() == Some(self.vmi_uid.as_str())
    }
}

/// What a host knows of its storage: which disks both ends reach at the
/// same path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SharedStorage<'a> {
    /// Storage every host reaches at the same path (`storage.shared_roots`),
    /// borrowed from the settings: a conversion copies nothing of it.
    pub roots: &'a [PathBuf],
    /// Claims (by name, in the VMI's namespace) whose volume every host
    /// reaches: ReadWriteMany on a shared path.
    pub claims: BTreeSet<String>,
}

impl<'a> SharedStorage<'a> {
    /// From the host's shared roots and the claims a conversion read: a
    /// claim is shared when it is ReadWriteMany (as KubeVirt asks) and its
    /// volume is a block device (the PV's word that every host reaches
    /// it) or a directory under a shared root.
    pub fn new(roots: &'a [PathBuf], claims: &Claims) -> Self {
        let shared = |p: &Pvc| {
            p.access_modes.iter().any(|m| m == "ReadWriteMany")
                && match &p.backend {
                    Backend::Block(_) => true,
                    Backend::Directory { dir, .. } => under_any(dir, roots),
                }
        };
        Self {
            roots,
            claims: claims
                .by_name
                .values()
                .filter(|p| shared(p))
                .map(|p| p.name.clone())
                .collect(),
        }
    }
}

/// Whether, and how, a VMI can move.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Migratable {
    /// `copies_disks`: some disk is this host's alone (a containerDisk's
    /// overlay, an emptyDisk) and is copied (`NON_SHARED_INC`).
    Yes { copies_disks: bool },
    No {
        reason: &'static str,
        message: String,
    },
}

/// KubeVirt's answer for kvirt's devices: disks must be shared or copyable,
/// and state kept on this host (persistent EFI variables or TPM) cannot
/// follow. Everything else the converter accepts moves (masquerade on the
/// pod network, bridge on Multus networks, as KubeVirt).
pub fn migratable(spec: &VmiSpec, storage: &SharedStorage) -> Migratable {
    match disks(spec, storage) {
        Ok(copies_disks) => Migratable::Yes { copies_disks },
        Err(message) => Migratable::No {
            reason: REASON_DISKS,
            message,
        },
    }
}

fn disks(spec: &VmiSpec, storage: &SharedStorage) -> Result<bool, String> {
    let efi = spec
        .domain
        .firmware
        .as_ref()
        .and_then(|f| f.bootloader.as_ref());
    if efi.and_then(|b| b.efi.as_ref()).and_then(|e| e.persistent) == Some(true) {
        return Err("persistent EFI variables are kept on this host".into());
    }
    if let Some(tpm) = &spec.domain.devices.tpm {
        if tpm.enabled != Some(false) {
            return Err("a TPM's state is kept on this host".into());
        }
    }
    let mut copies = false;
    for v in &spec.volumes {
        if let Some(h) = &v.host_disk {
            if !under_any(Path::new(&h.path), storage.roots) {
                return Err(format!(
                    "hostDisk {:?} ({}) is not under a shared root, and kvirt copies only disks it made",
                    v.name, h.path
                ));
            }
        }
        // Only the overlay is copied: the target lays its own over the
        // same base, which must then be the same bytes there.
        if let Some(h) = v.ephemeral.as_ref().and_then(|e| e.host_disk.as_ref()) {
            if !under_any(Path::new(&h.path), storage.roots) {
                return Err(format!(
                    "the base of ephemeral volume {:?} ({}) is not under a shared root",
                    v.name, h.path
                ));
            }
        }
        copies |= is_copied(v);
    }
    for c in pvc::claims_of(spec) {
        if !storage.claims.contains(&c.claim) {
            return Err(format!(
                "PVC {:?} is not shared, live migration requires that all PVCs must be shared \
                 (using ReadWriteMany access mode)",
                c.claim
            ));
        }
    }
    Ok(copies)
}

/// Whether some disk of the VM is on storage other hosts reach at the same
/// path: a hostDisk under a shared root, or a claim whose volume is a
/// block device or under a shared root (whatever its access mode: another
/// host could still write it). An ephemeral volume's shared base is only
/// read (its overlay is this host's).
pub fn on_shared_storage(spec: &VmiSpec, roots: &[PathBuf], claims: &Claims) -> bool {
    let host_disk = |v: &crate::core::vmi::Volume| {
        (v.host_disk.as_ref()).is_some_and(|h| under_any(Path::new(&h.path), roots))
    };
    let claim = |c: &pvc::ClaimUse| {
        claims
            .by_name
            .get(&c.claim)
            .is_some_and(|p| match &p.backend {
                Backend::Block(_) => true,
                Backend::Directory { dir, .. } => under_any(dir, roots),
            })
    };
    spec.volumes.iter().any(host_disk) || pvc::claims_of(spec).iter().any(claim)
}

/// Lexically under one of `roots`: a path with `..` is under none.
fn under_any(path: &Path, roots: &[PathBuf]) -> bool {
    let plain = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    plain && roots.iter().any(|r| path.starts_with(r) && path != r)
}

/// The `LiveMigratable` condition for `m`.
pub fn condition(m: &Migratable) -> Condition {
    let (status, reason, message) = match m {
        Migratable::Yes { .. } => ("True", None, None),
        Migratable::No { reason, message } => {
            ("False", Some(reason.to_string()), Some(message.clone()))
        }
    };
    Condition {
        type_: CONDITION.into(),
        status: status.into(),
        reason,
        message,
        ..Default::default()
    }
}

/// Whether `vmi`, as this host last reported it, may leave now: Running,
/// not being deleted, and found migratable (its `LiveMigratable`).
pub fn may_leave(vmi: &VirtualMachineInstance) -> Result<(), String> {
    if vmi.metadata.deletion_timestamp.is_some() {
        return Err("it is being deleted".into());
    }
    match vmi.status.phase {
        // A paused guest would arrive paused, indistinguishable at the
        // target from one still arriving: unpause it, or stop it.
        Some(crate::core::vmi::Phase::Running) if is_paused(vmi) => {
            return Err("it is paused".into());
        }
        Some(crate::core::vmi::Phase::Running) => {}
        p => {
            let p = p.map_or("not started", |p| p.as_str());
            return Err(format!("it is {p}, not Running"));
        }
    }
    let c = vmi.status.conditions.iter().find(|c| c.type_ == CONDITION);
    match c {
        Some(c) if c.status == "True" => Ok(()),
        Some(c) => Err(format!(
            "it is not live-migratable ({}): {}",
            c.reason.as_deref().unwrap_or("no reason given"),
            c.message.as_deref().unwrap_or("")
        )),
        None => Err(format!("it has no {CONDITION} condition yet")),
    }
}

fn is_paused(vmi: &VirtualMachineInstance) -> bool {
    vmi.status
        .conditions
        .iter()
        .any(|c| c.type_ == crate::core::status::PAUSED && c.status == "True")
}

/// The disks a migration copies to the target (`migrate_disks`): the
/// targets (`vda`) of the volumes only this host has (a containerDisk's or
/// an ephemeral volume's overlay, an emptyDisk), as `volumeStatus` names
/// them. Every other writable disk is shared; read-only ones (cloud-init)
/// the target made itself.
pub fn copied_targets(spec: &VmiSpec, volume_status: &[serde_json::Value]) -> Vec<String> {
    let local: BTreeSet<&str> = spec
        .volumes
        .iter()
        .filter(|v| is_copied(v))
        .map(|v| v.name.as_str())
        .collect();
    volume_status
        .iter()
        .filter(|s| s["name"].as_str().is_some_and(|n| local.contains(n)))
        .filter_map(|s| s["target"].as_str().map(str::to_owned))
        .collect()
}

/// A volume whose disk kvirt makes over a base (a containerDisk's or an
/// ephemeral volume's overlay): the base stays, only the overlay moves.
pub fn has_overlay(v: &Volume) -> bool {
    v.container_disk.is_some() || v.ephemeral.is_some()
}

/// A volume whose disk only this host has, copied by a migration.
fn is_copied(v: &Volume) -> bool {
    has_overlay(v) || v.empty_disk.is_some()
}

/// How much of a qcow2 overlay's start is read for its backing file's
/// name (kvirt writes it right after the header).
pub const QCOW2_HEAD: u64 = 64 << 10;

/// The backing file a qcow2 image's header names (`None`: it has none),
/// from the image's first bytes. An overlay is the VM's to write: the name
/// is bounded, and only ever compared.
pub fn qcow2_backing(head: &[u8]) -> Result<Option<String>, String> {
    if head.len() < 20 || head[..4] != *b"QFI\xfb" {
        return Err("not a qcow2 image".into());
    }
    let word = |at: usize, n: usize| {
        head[at..at + n]
            .iter()
            .fold(0u64, |a, b| a << 8 | *b as u64)
    };
    let (offset, size) = (word(8, 8), word(16, 4));
    if offset == 0 {
        return Ok(None);
    }
    // qcow2 allows 1023 bytes of name.
    let name = offset
        .checked_add(size)
        .filter(|&end| size <= 1023 && end <= head.len() as u64)
        .map(|end| &head[offset as usize..end as usize])
        .ok_or("its backing file's name is out of bounds")?;
    String::from_utf8(name.to_vec())
        .map(Some)
        .map_err(|_| "its backing file's name is not UTF-8".into())
}

/// Whether the target's overlays lie over the bases the source's do: only
/// what the guest wrote is copied (`NON_SHARED_INC`), so a containerDisk
/// whose tag names another image by now, or another file at an
/// ephemeral base's path, would leave the guest a disk of mixed bytes.
/// The image cache keeps each image under its digest, so the same path
/// is the same image.
pub fn same_bases(
    source: &BTreeMap<String, String>,
    here: &BTreeMap<String, String>,
) -> Result<(), String> {
    for (volume, base) in source {
        match here.get(volume) {
            Some(b) if b == base => {}
            Some(b) => {
                return Err(format!(
                    "volume {volume:?}: the VM's disk lies over {base} at the source, over {b} here"
                ))
            }
            None => {
                return Err(format!(
                    "volume {volume:?}: the VM's disk lies over {base} at the source, over nothing here"
                ))
            }
        }
    }
    Ok(())
}

/// A new migration's uid: unique per VMI instance, source and moment.
pub fn new_uid(vmi_uid: &str, source_node: &str, nanos: u128) -> String {
    let name = format!("{vmi_uid}/{source_node}/{nanos}");
    uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, name.as_bytes()).to_string()
}

/// Whether this host may take `migration` of `vmi`, running on
/// `source_node`; `Err` says why not (for the log).
pub fn target_fits(
    vmi: &VirtualMachineInstance,
    migration: &Migration,
    host: &HostFacts,
    source_node: &str,
) -> Result<(), String> {
    if host.node_name == source_node {
        return Err("the VMI runs on this host".into());
    }
    let named = migration
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TARGET_ANNOTATION));
    if let Some(n) = named {
        if *n != host.node_name {
            return Err(format!("{TARGET_ANNOTATION} names {n:?}"));
        }
    }
    for (k, v) in &migration.spec.added_node_selector {
        if host.labels.get(k) != Some(v) {
            return Err(format!(
                "addedNodeSelector {k}={v} does not match this host"
            ));
        }
    }
    scheduling::fits(vmi, host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use MigrationPhase::*;

    fn vmi(spec: &str) -> VirtualMachineInstance {
        let text = format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a, namespace: ns}}\nspec: {spec}\n");
        serde_norway::from_str(&text).unwrap()
    }

    fn storage() -> SharedStorage<'static> {
        SharedStorage {
            roots: Box::leak(vec![PathBuf::from("/srv/shared")].into_boxed_slice()),
            claims: ["rwx".to_string()].into(),
        }
    }

    #[test]
    fn the_host_holding_the_vmi_starts_a_migration_and_settles_one_that_ended() {
        use crate::core::vmi::{Phase, NODE_LABEL};
        let mut v = vmi("{domain: {devices: {}}}");
        v.metadata.labels = Some([(NODE_LABEL.to_string(), "node-a".to_string())].into());
        v.status.phase = Some(Phase::Running);
        let mut m = Migration::default();
        m.metadata.uid = Some("m1".into());
        m.spec.vmi_name = "a".into();
        let at = |node, running| Here {
            node,
            running,
            departing: false,
        };
        assert_eq!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Start
        );
        // Another host's VMI (or an arrival held here), or one running here.
        assert_eq!(
            object_action(&m, &v, &at("node-b", false)),
            ObjectAction::Ignore
        );
        assert_eq!(
            object_action(&m, &v, &at("node-a", true)),
            ObjectAction::Ignore
        );
        // The VMI says how it ended: completed (on the host it was handed
        // to), failed, or started by a kvirtd whose recovery ends it.
        let started = MigrationState::started("m1", "node-a", "t0");
        let put = |v: &mut VirtualMachineInstance, s: &MigrationState| {
            v.status
                .extra
                .insert(STATE_FIELD.into(), serde_json::to_value(s).unwrap());
        };
        let mut w = v.clone();
        put(&mut w, &started);
        assert_eq!(
            object_action(&m, &w, &at("node-a", false)),
            ObjectAction::Ignore
        );
        put(&mut w, &started.clone().ended("t1", Err("no")));
        assert_eq!(
            object_action(&m, &w, &at("node-a", false)),
            ObjectAction::Finish(Failed, Some("no".into()))
        );
        put(&mut w, &started.clone().ended("t1", Ok(())));
        w.metadata.labels = Some([(NODE_LABEL.to_string(), "node-b".to_string())].into());
        assert_eq!(
            object_action(&m, &w, &at("node-b", false)),
            ObjectAction::Finish(Succeeded, None)
        );
        // An earlier migration's state says nothing of this one.
        put(
            &mut v,
            &MigrationState::started("m0", "node-a", "t0").ended("t1", Ok(())),
        );
        assert_eq!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Start
        );
        // Final objects stay as they are; a VMI not running fails it.
        m.status.phase = Some(Succeeded);
        assert_eq!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Ignore
        );
        m.status.phase = None;
        v.status.phase = Some(Phase::Scheduled);
        assert!(matches!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Finish(Failed, Some(r)) if r.contains("not running")
        ));
        // Begun by a kvirtd before this one, its state not yet written:
        // its recovery ends it, or (no mark: it never began) it fails.
        v.status.phase = Some(Phase::Running);
        m.status.phase = Some(PreparingTarget);
        let marked = Here {
            departing: true,
            ..at("node-a", false)
        };
        assert_eq!(object_action(&m, &v, &marked), ObjectAction::Ignore);
        assert!(matches!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Finish(Failed, Some(r)) if r.contains("restarted")
        ));
        // Still choosing its target when that kvirtd stopped: begun anew.
        m.status.phase = Some(Scheduling);
        assert_eq!(
            object_action(&m, &v, &at("node-a", false)),
            ObjectAction::Start
        );
    }

    #[test]
    fn only_a_running_migratable_vmi_may_leave() {
        let mut v = vmi("{domain: {devices: {}}}");
        assert!(may_leave(&v).unwrap_err().contains("not started"));
        v.status.phase = Some(crate::core::vmi::Phase::Running);
        assert!(may_leave(&v).unwrap_err().contains("no LiveMigratable"));
        v.status.conditions.push(condition(&Migratable::No {
            reason: REASON_DISKS,
            message: "hostDisk \"a\" is local".into(),
        }));
        let e = may_leave(&v).unwrap_err();
        assert!(e.contains(REASON_DISKS) && e.contains("is local"), "{e}");
        v.status.conditions = vec![condition(&Migratable::Yes {
            copies_disks: false,
        })];
        assert_eq!(may_leave(&v), Ok(()));
        let mut paused = v.clone();
        paused.status.conditions.push(Condition {
            type_: crate::core::status::PAUSED.into(),
            status: "True".into(),
            ..Default::default()
        });
        assert!(may_leave(&paused).unwrap_err().contains("paused"));
        v.metadata.deletion_timestamp = serde_json::from_value("2026-12-05T00:00:00Z".into()).ok();
        assert!(v.metadata.deletion_timestamp.is_some());
        assert!(may_leave(&v).unwrap_err().contains("deleted"));
    }

    #[test]
    fn the_copied_disks_are_the_local_volumes_by_target() {
        let v = vmi("{domain: {devices: {}}, volumes: [\
            {name: root, containerDisk: {image: r/i}},\
            {name: shared, hostDisk: {path: /srv/shared/b.img, type: Disk}},\
            {name: scratch, emptyDisk: {capacity: 1Gi}},\
            {name: ci, cloudInitNoCloud: {userData: x}}]}");
        let status: Vec<serde_json::Value> = ["root", "shared", "scratch", "ci"]
            .iter()
            .zip(["vda", "vdb", "vdc", "vdd"])
            .map(|(n, t)| serde_json::json!({"name": n, "target": t}))
            .collect();
        assert_eq!(copied_targets(&v.spec, &status), ["vda", "vdc"]);
        assert!(copied_targets(&v.spec, &[]).is_empty());
    }

    #[test]
    fn migration_uids_differ_per_attempt() {
        let a = new_uid("u", "host-a", 1);
        assert_ne!(a, new_uid("u", "host-a", 2));
        assert_eq!(a, new_uid("u", "host-a", 1));
        assert_eq!(a.len(), 36);
    }

    #[test]
    fn transition_table() {
        let cases = [
            (None, Pending, true),
            (Some(Pending), Scheduling, true),
            (Some(Pending), Scheduled, true),
            (Some(Scheduled), PreparingTarget, true),
            (Some(TargetReady), Running, true),
            (Some(Running), Succeeded, true),
            (Some(Running), Running, true),
            (Some(Pending), Failed, true),
            (Some(TargetReady), Failed, true),
            (Some(TargetReady), Succeeded, false),
            (Some(Running), Scheduled, false),
            (Some(TargetReady), PreparingTarget, false),
            (Some(Succeeded), Failed, false),
            (Some(Failed), Running, false),
            (Some(Failed), Pending, false),
        ];
        for (from, to, ok) in cases {
            assert_eq!(check(from, to).is_ok(), ok, "{from:?} -> {to:?}");
        }
    }

    #[test]
    fn phases_read_and_write_as_kubevirts_strings() {
        let m: Migration = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m", "labels": {VMI_NAME_LABEL: "a"}},
            "spec": {"vmiName": "a", "addedNodeSelector": {"zone": "b"}, "future": 1},
            "status": {"phase": "PreparingTarget", "phaseTransitionTimestamps": []},
        }))
        .unwrap();
        assert_eq!(m.status.phase, Some(PreparingTarget));
        assert_eq!(m.spec.added_node_selector["zone"], "b");
        let back = serde_json::to_value(&m).unwrap();
        assert_eq!(back["spec"]["future"], 1, "unknown fields kept");
        assert_eq!(back["status"]["phase"], "PreparingTarget");
        let state = MigrationState {
            migration_uid: "u".into(),
            completed: true,
            ..Default::default()
        };
        let v = serde_json::to_value(&state).unwrap();
        assert_eq!(v["migrationUid"], "u");
        assert_eq!(v["completed"], true);
        assert!(v.get("targetNode").is_none());
    }

    #[test]
    fn copied_disks_and_shared_ones_migrate() {
        let v = vmi("{domain: {devices: {}}, volumes: [\
            {name: a, containerDisk: {image: r/i}},\
            {name: b, hostDisk: {path: /srv/shared/vm/b.img, type: Disk}},\
            {name: c, persistentVolumeClaim: {claimName: rwx}},\
            {name: d, cloudInitNoCloud: {userData: x}}]}");
        assert_eq!(
            migratable(&v.spec, &storage()),
            Migratable::Yes { copies_disks: true }
        );
        let shared_only = vmi("{domain: {devices: {}}, volumes: [{name: c, persistentVolumeClaim: {claimName: rwx}}]}");
        assert_eq!(
            migratable(&shared_only.spec, &storage()),
            Migratable::Yes {
                copies_disks: false
            }
        );
    }

    #[test]
    fn a_disk_only_this_host_reaches_keeps_the_vmi_here() {
        let cases = [
            (
                "{name: a, hostDisk: {path: /var/lib/kvirt/images/a.img, type: Disk}}",
                "not under a shared root",
            ),
            (
                "{name: a, hostDisk: {path: /srv/shared/../../etc/a.img, type: Disk}}",
                "not under a shared root",
            ),
            (
                "{name: a, hostDisk: {path: /srv/shared, type: Disk}}",
                "not under a shared root",
            ),
            (
                "{name: a, hostDisk: {path: /srv/sharedx/a.img, type: Disk}}",
                "not under a shared root",
            ),
            (
                "{name: a, persistentVolumeClaim: {claimName: rwo}}",
                "PVC \"rwo\" is not shared",
            ),
            (
                "{name: a, dataVolume: {name: rwo}}",
                "PVC \"rwo\" is not shared",
            ),
            (
                "{name: a, ephemeral: {hostDisk: {path: /var/lib/kvirt/images/a.img, type: Disk}}}",
                "base of ephemeral volume \"a\"",
            ),
        ];
        for (volume, why) in cases {
            let v = vmi(&format!(
                "{{domain: {{devices: {{}}}}, volumes: [{volume}]}}"
            ));
            match migratable(&v.spec, &storage()) {
                Migratable::No { reason, message } => {
                    assert_eq!(reason, REASON_DISKS);
                    assert!(message.contains(why), "{volume}: {message}");
                }
                yes => panic!("{volume}: {yes:?}"),
            }
        }
    }

    #[test]
    fn state_kept_on_this_host_keeps_the_vmi_here() {
        for spec in [
            "{domain: {devices: {}, firmware: {bootloader: {efi: {persistent: true}}}}}",
            "{domain: {devices: {tpm: {}}}}",
        ] {
            let m = migratable(&vmi(spec).spec, &storage());
            assert!(matches!(m, Migratable::No { .. }), "{spec}: {m:?}");
        }
        let off = vmi("{domain: {devices: {tpm: {enabled: false}}}}");
        assert!(matches!(
            migratable(&off.spec, &storage()),
            Migratable::Yes { .. }
        ));
    }

    #[test]
    fn a_claim_is_shared_when_readwritemany_on_shared_storage() {
        let pvc = |name: &str, mode: &str, backend: Backend| Pvc {
            name: name.into(),
            backend,
            read_only: false,
            capacity: None,
            request: None,
            access_modes: vec![mode.into()],
        };
        let dir = |d: &str| Backend::Directory {
            root: "/srv".into(),
            dir: d.into(),
        };
        let claims = Claims {
            by_name: [
                pvc("nfs", "ReadWriteMany", dir("/srv/shared/pv-1")),
                pvc(
                    "local-rwx",
                    "ReadWriteMany",
                    dir("/var/lib/kvirt/claims/pv-2"),
                ),
                pvc("nfs-rwo", "ReadWriteOnce", dir("/srv/shared/pv-3")),
                pvc("san", "ReadWriteMany", Backend::Block("/dev/sdz".into())),
            ]
            .into_iter()
            .map(|p| (p.name.clone(), p))
            .collect(),
            ..Default::default()
        };
        let roots = [PathBuf::from("/srv/shared")];
        let s = SharedStorage::new(&roots, &claims);
        assert_eq!(s.claims, ["nfs".to_string(), "san".to_string()].into());
        assert_eq!(s.roots, [PathBuf::from("/srv/shared")]);
        // What a self-fence stops: any claim another host could write,
        // whatever its access mode, and hostDisks under a shared root.
        let uses = |volume: &str| -> VmiSpec {
            serde_json::from_value(serde_json::json!({
                "domain": {"devices": {}},
                "volumes": [serde_json::from_str::<serde_json::Value>(volume).unwrap()],
            }))
            .unwrap()
        };
        let claim = |c: &str| {
            uses(&format!(
                r#"{{"name": "d", "persistentVolumeClaim": {{"claimName": "{c}"}}}}"#
            ))
        };
        let host_disk = |p: &str| {
            uses(&format!(
                r#"{{"name": "d", "hostDisk": {{"path": "{p}", "type": "Disk"}}}}"#
            ))
        };
        for (spec, shared) in [
            (claim("nfs"), true),
            (claim("nfs-rwo"), true),
            (claim("san"), true),
            (claim("local-rwx"), false),
            (host_disk("/srv/shared/a.img"), true),
            (host_disk("/srv/shared/../x.img"), false),
            (host_disk("/var/lib/kvirt/images/a.img"), false),
        ] {
            assert_eq!(
                on_shared_storage(&spec, &roots, &claims),
                shared,
                "{spec:?}"
            );
        }
    }

    #[test]
    fn the_migration_state_has_kubevirts_field_names_and_ends_one_way() {
        let s = MigrationState::started("m1", "a", "2026-12-05T10:00:00Z");
        let mut at_b = s.clone();
        at_b.target_node = "b".into();
        let done = serde_json::to_value(at_b.ended("2026-12-05T10:00:02Z", Ok(()))).unwrap();
        assert_eq!(
            done,
            serde_json::json!({"migrationUid": "m1", "sourceNode": "a", "targetNode": "b",
                "startTimestamp": "2026-12-05T10:00:00Z", "endTimestamp": "2026-12-05T10:00:02Z",
                "completed": true, "failed": false, "abortRequested": false, "mode": "PreCopy"})
        );
        let failed = s.ended("2026-12-05T10:00:09Z", Err(&"x".repeat(5000)));
        assert!(failed.failed && !failed.completed);
        assert_eq!(failed.failure_reason.unwrap().len(), FIELD_MAX);
    }

    #[test]
    fn control_messages_are_one_json_object_each_and_nothing_else() {
        let prepare = ToTarget::Prepare {
            vmi: Box::new(vmi("{domain: {devices: {}}}")),
            source_node: "a".into(),
            bases: BTreeMap::new(),
        };
        let line = serde_json::to_string(&prepare).unwrap();
        assert!(line.starts_with("{\"prepare\":{\"vmi\":"), "{line}");
        assert!(!line.contains('\n'));
        assert_eq!(serde_json::from_str::<ToTarget>(&line).unwrap(), prepare);
        let commit = ToTarget::Commit {
            vmi_uid: "u1".into(),
        };
        let line = serde_json::to_string(&commit).unwrap();
        assert_eq!(line, "{\"commit\":{\"vmi_uid\":\"u1\"}}");
        assert_eq!(serde_json::from_str::<ToTarget>(&line).unwrap(), commit);
        assert_eq!(
            serde_json::from_str::<ToSource>("{\"refused\":{\"reason\":\"full\"}}").unwrap(),
            ToSource::Refused {
                reason: "full".into()
            }
        );
        for bad in [
            "\"delete everything\"",
            "{\"abort\":{\"reason\":\"x\",\"also\":1}}",
            "{\"prepare\":{\"sourceNode\":\"a\"}}",
        ] {
            assert!(serde_json::from_str::<ToTarget>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_condition_carries_kubevirts_reason() {
        let no = condition(&Migratable::No {
            reason: REASON_DISKS,
            message: "m".into(),
        });
        assert_eq!(
            (no.type_.as_str(), no.status.as_str()),
            ("LiveMigratable", "False")
        );
        assert_eq!(no.reason.as_deref(), Some("DisksNotLiveMigratable"));
        let yes = condition(&Migratable::Yes {
            copies_disks: false,
        });
        assert_eq!(yes.status, "True");
        assert!(yes.reason.is_none());
    }

    fn host(name: &str, labels: &[(&str, &str)]) -> HostFacts {
        HostFacts {
            node_name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_target_is_another_host_that_fits_the_vmi_and_the_migration() {
        let v = vmi("{nodeSelector: {disk: ssd}, domain: {devices: {}}}");
        let mut m: Migration = serde_json::from_value(serde_json::json!({
            "spec": {"vmiName": "a", "addedNodeSelector": {"zone": "z1"}}
        }))
        .unwrap();
        let b = host("b", &[("disk", "ssd"), ("zone", "z1")]);
        assert_eq!(target_fits(&v, &m, &b, "a"), Ok(()));
        assert!(target_fits(&v, &m, &b, "b")
            .unwrap_err()
            .contains("runs on this host"));
        let wrong_zone = host("c", &[("disk", "ssd"), ("zone", "z2")]);
        assert!(target_fits(&v, &m, &wrong_zone, "a")
            .unwrap_err()
            .contains("addedNodeSelector"));
        let no_ssd = host("d", &[("zone", "z1")]);
        assert!(target_fits(&v, &m, &no_ssd, "a")
            .unwrap_err()
            .contains("nodeSelector"));
        m.metadata.annotations = Some([(TARGET_ANNOTATION.to_string(), "e".to_string())].into());
        assert!(target_fits(&v, &m, &b, "a")
            .unwrap_err()
            .contains("names \"e\""));
        let e = host("e", &[("disk", "ssd"), ("zone", "z1")]);
        assert_eq!(target_fits(&v, &m, &e, "a"), Ok(()));
    }

    /// A qcow2 header (version 3, 104 bytes) naming `backing` right
    /// after it, as `qemu-img create -b` writes one.
    fn qcow2(backing: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; 104];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        if !backing.is_empty() {
            h[8..16].copy_from_slice(&104u64.to_be_bytes());
            h[16..20].copy_from_slice(&(backing.len() as u32).to_be_bytes());
        }
        h.extend_from_slice(backing);
        h.resize(512, 0);
        h
    }

    #[test]
    fn an_overlays_backing_file_is_read_from_its_header_within_bounds() {
        let base = b"/var/cache/kvirt/images/repos/k/sha256:ab/disk/g.qcow2";
        assert_eq!(
            qcow2_backing(&qcow2(base)).unwrap().as_deref(),
            Some(std::str::from_utf8(base).unwrap())
        );
        assert_eq!(qcow2_backing(&qcow2(b"")), Ok(None));
        assert!(qcow2_backing(b"raw bytes of a raw disk")
            .unwrap_err()
            .contains("not a qcow2"));
        // A header the guest rewrote: past the bytes read, too long, not text.
        let mut far = qcow2(base);
        far[8..16].copy_from_slice(&u64::MAX.to_be_bytes());
        assert!(qcow2_backing(&far).unwrap_err().contains("out of bounds"));
        let long = qcow2(&[b'a'; 1024]);
        assert!(qcow2_backing(&long).unwrap_err().contains("out of bounds"));
        assert!(qcow2_backing(&qcow2(&[0xff, 0xfe]))
            .unwrap_err()
            .contains("UTF-8"));
    }

    #[test]
    fn a_copied_overlay_needs_the_same_base_at_the_target() {
        let bases = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(v, b)| (v.to_string(), b.to_string()))
                .collect()
        };
        let source = bases(&[("boot", "/c/repos/k/sha256:aa/disk/g.qcow2")]);
        assert_eq!(same_bases(&source, &source), Ok(()));
        assert_eq!(same_bases(&BTreeMap::new(), &source), Ok(()));
        let newer = bases(&[("boot", "/c/repos/k/sha256:bb/disk/g.qcow2")]);
        let e = same_bases(&source, &newer).unwrap_err();
        assert!(e.contains("\"boot\"") && e.contains("sha256:bb"), "{e}");
        assert!(same_bases(&source, &BTreeMap::new())
            .unwrap_err()
            .contains("over nothing here"));
    }

    #[test]
    fn an_object_whose_vmi_runs_nowhere_fails_and_one_whose_vmi_is_a_hosts_is_left_to_it() {
        let vmi = |labels: &str| {
            VirtualMachineInstance::from_yaml(&format!(
                "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a, namespace: ns, labels: {{{labels}}}}}\nspec: {{domain: {{devices: {{}}}}}}\n"
            ))
            .unwrap()
        };
        let gone = runs_nowhere("ns/a", None).unwrap();
        assert_eq!(gone, "the VMI ns/a does not exist");
        let pending = runs_nowhere("ns/a", Some(&vmi(""))).unwrap();
        assert!(
            pending.contains("runs on no host (phase Pending)"),
            "{pending}"
        );
        let placed = vmi("kubevirt.io/nodeName: node-a");
        assert_eq!(runs_nowhere("ns/a", Some(&placed)), None);
    }

    #[test]
    fn an_object_goes_to_its_vmis_host_and_on_when_the_vmi_moved() {
        use crate::core::vmi::NODE_LABEL;
        let on = |node: &str| {
            let mut v = vmi("{domain: {devices: {}}}");
            v.metadata.labels = Some([(NODE_LABEL.to_string(), node.to_string())].into());
            v
        };
        let mut m = Migration::default();
        m.spec.vmi_name = "a".into();
        // A user's object: no label yet.
        assert_eq!(
            route(&m, "ns/a", Some(&on("node-a"))),
            Route::Host("node-a".into())
        );
        m.metadata.labels = Some([(HOST_LABEL.to_string(), "node-a".to_string())].into());
        assert_eq!(route(&m, "ns/a", Some(&on("node-a"))), Route::Stay);
        // Its VMI handed to node-b since: node-b finishes it.
        m.status.phase = Some(MigrationPhase::Running);
        assert_eq!(
            route(&m, "ns/a", Some(&on("node-b"))),
            Route::Host("node-b".into())
        );
        // No VMI, or one no host runs: failed, saying so.
        let Route::Fail(why) = route(&m, "ns/a", None) else {
            panic!("not failed")
        };
        assert!(why.contains("does not exist"), "{why}");
        let Route::Fail(why) = route(&m, "ns/a", Some(&vmi("{domain: {devices: {}}}"))) else {
            panic!("not failed")
        };
        assert!(why.contains("runs on no host"), "{why}");
        // Ended, or going: left alone.
        m.status.phase = Some(MigrationPhase::Succeeded);
        assert_eq!(route(&m, "ns/a", None), Route::Stay);
        let going: Migration = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"vmiName": "a"},
        }))
        .unwrap();
        assert_eq!(route(&going, "ns/a", None), Route::Stay);
    }
}
