//! What a migration asks of the VMI loop, on either host: the leaving VM's
//! facts and its move (source), an arriving VMI held by its mark until the
//! source commits (target). The conversation between the hosts is
//! `daemon::migration`'s; the loop's passes do everything else (an
//! arrival's unit, namespace, network and daemon; a departure's teardown).

use super::{Adapters, Controller, ControllerError};
use crate::core::key::{self, VmKey};
use crate::core::layout::VmPaths;
use crate::core::migration::{self, Mark, MigrationState};
use crate::core::plan::{DomainState, UnitActivity};
use crate::core::vmi::{VirtualMachineInstance, VmiSpec};
use crate::host::beneath::Beneath;
use crate::host::libvirt::{DomainRef, Hypervisor, LibvirtError};
use crate::host::marks::{MarkError, Records};
use crate::host::migrate::{LiveMigration, MigrateTo};
use crate::host::storage::Owner;
use crate::host::systemd::Units;
use nix::fcntl::OFlag;
use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;

/// A VM that may leave this host now, as the loop knows it.
#[derive(Clone, Debug)]
pub struct Leaving {
    pub vmi: VirtualMachineInstance,
    pub key: VmKey,
    pub dom: DomainRef,
    pub paths: VmPaths,
    pub owner: Owner,
    /// The disks copied to the target, by target name.
    pub copied: Vec<String>,
    /// The base each copied overlay lies over, by volume.
    pub bases: BTreeMap<String, String>,
}

impl<A: Adapters> Controller<A> {
    pub fn node_name(&self) -> &str {
        &self.settings.node_name
    }

    /// The VM `key` if it may leave now; `Err` says why not.
    pub fn leaving(&self, key: &VmKey) -> Result<Leaving, String> {
        let id = key.id();
        let vmi = self
            .vmis()
            .get(&id)
            .cloned()
            .ok_or_else(|| format!("no VMI {key} on this host"))?;
        migration::may_leave(&vmi)?;
        let owner = self
            .owner(&id)
            .ok_or_else(|| format!("{key} has no identity on this host"))?;
        let volume_status: Vec<serde_json::Value> = vmi
            .status
            .extra
            .get("volumeStatus")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        Ok(Leaving {
            copied: migration::copied_targets(&vmi.spec, &volume_status),
            bases: self.overlay_bases(&id, &vmi.spec)?,
            dom: self.domain_ref(&id, None, &key.domain_name()),
            paths: self.paths(&id),
            key: key.clone(),
            owner,
            vmi,
        })
    }

    /// The base each of the VM's overlays (containerDisk, ephemeral) lies
    /// over here, by volume, from the overlays' headers: read beneath the
    /// VM's directory, bounded (the overlay is the VM's to write).
    pub fn overlay_bases(
        &self,
        id: &str,
        spec: &VmiSpec,
    ) -> Result<BTreeMap<String, String>, String> {
        let paths = self.paths(id);
        let dir = Beneath::open(&paths.state_dir)
            .map_err(|e| format!("{}: {e}", paths.state_dir.display()))?;
        let mut bases = BTreeMap::new();
        for v in spec.volumes.iter().filter(|v| migration::has_overlay(v)) {
            let overlay = paths.overlay(&v.name);
            let rel = overlay.strip_prefix(&paths.state_dir).unwrap_or(&overlay);
            let why = |e: String| format!("the overlay of volume {:?}: {e}", v.name);
            let mut head = Vec::new();
            dir.file(rel, OFlag::O_RDONLY)
                .and_then(|f| f.take(migration::QCOW2_HEAD).read_to_end(&mut head))
                .map_err(|e| why(e.to_string()))?;
            if let Some(base) = migration::qcow2_backing(&head).map_err(why)? {
                bases.insert(v.name.clone(), base);
            }
        }
        Ok(bases)
    }

    /// The VMI's `status.migrationState`, if it has one.
    pub fn migration_state(&self, id: &str) -> Option<MigrationState> {
        let v = self
            .vmis()
            .get(id)?
            .status
            .extra
            .get(migration::STATE_FIELD)?
            .clone();
        serde_json::from_value(v).ok()
    }

    /// Sets the VMI's `status.migrationState`; its next pass writes it out.
    pub fn set_migration_state(&self, id: &str, state: &MigrationState) {
        let Ok(value) = serde_json::to_value(state) else {
            return;
        };
        match self.vmis().get_mut(id) {
            Some(vmi) => vmi
                .status
                .extra
                .insert(migration::STATE_FIELD.into(), value),
            None => return,
        };
        self.unsaved().insert(id.into());
    }

    /// Whether this host could run `vmi` as a migration's target: a VMI
    /// of that name is not here already and it converts (a mark here is
    /// found by `claim_mark`).
    pub fn may_arrive(&self, vmi: &VirtualMachineInstance) -> Result<VmKey, String> {
        let key = vmi.key().map_err(|e| e.to_string())?;
        let id = key.id();
        if self.vmis().contains_key(&id) {
            return Err(format!("a VMI {key} is on this host already"));
        }
        self.convert(vmi, &key, false, &self.settings.claims, None)
            .map_err(|e| format!("this host cannot run it: {e}"))?;
        Ok(key)
    }

    /// Holds `vmi` here from now on as an arrival (its mark already kept):
    /// the next pass prepares everything but its domain.
    pub fn arrive(&self, key: &VmKey, vmi: VirtualMachineInstance) {
        self.vmis().insert(key.id(), vmi);
    }

    /// Lets go of an arrival that did not come (its mark already cleared):
    /// the next pass tears down what was prepared.
    pub fn abandon(&self, key: &VmKey, vmi_uid: &str) {
        let mut vmis = self.vmis();
        if vmis.get(&key.id()).and_then(|v| v.uid()) == Some(vmi_uid) {
            vmis.remove(&key.id());
        }
    }

    pub fn mark(&self, id: &str) -> Result<Option<Mark>, MarkError> {
        self.deps.marks.get(id)
    }

    /// Keeps `mark` for `id` unless it has one: a VM takes part in one
    /// migration at a time (two `kvirtctl migrate` of it at once, or an
    /// arrival racing its own departure, find the other's mark).
    pub fn claim_mark(&self, id: &str, mark: &Mark) -> Result<(), String> {
        let _one = self.marking.lock().unwrap_or_else(|p| p.into_inner());
        match self.deps.marks.get(id) {
            Ok(None) => self.deps.marks.set(id, mark).map_err(|e| e.to_string()),
            Ok(Some(other)) => Err(format!(
                "it takes part in another migration here ({}, {:?})",
                other.migration_uid, other.role
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    pub fn clear_mark(&self, id: &str) -> Result<(), MarkError> {
        self.deps.marks.clear(id)
    }

    /// Keeps `mark` in place of the one `id` has (its own, changed).
    pub fn replace_mark(&self, id: &str, mark: &Mark) -> Result<(), MarkError> {
        self.deps.marks.set(id, mark)
    }

    /// A committed arrival that a source of this host now lists: the VMI
    /// is this host's, its mark goes, and its status is written afresh
    /// (the source's last one named the source).
    pub(super) fn arrived(&self, id: &str) {
        match self.deps.marks.clear(id) {
            Ok(()) => tracing::info!(vm = id, "the arrived VM's VMI is this host's now"),
            Err(e) => tracing::warn!("{e}"),
        }
        // Its state as the source ended it, not as it began here.
        match self.migration_state(id) {
            Some(s) if s.end_timestamp.is_none() => {
                self.set_migration_state(id, &s.ended(&super::now_rfc3339(), Ok(())));
            }
            _ => {
                self.unsaved().insert(id.into());
            }
        }
    }

    /// The VM of `id` left for another host, whose VMI it becomes: this
    /// host no longer writes its status.
    pub fn hand_over(&self, id: &str) {
        self.handed_over().insert(id.into());
    }

    /// The handover of `id` failed: its status is this host's again.
    pub fn keep(&self, id: &str) {
        self.handed_over().remove(id);
    }

    /// Whether `id`'s status is another host's to write: handed over, or
    /// an arrival not yet this host's.
    pub(super) fn not_ours(&self, id: &str) -> bool {
        if self.handed_over().contains(id) {
            return true;
        }
        matches!(self.deps.marks.get(id), Ok(Some(m)) if m.role == crate::core::plan::Migrating::Incoming)
    }

    fn handed_over(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.handed_over.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every mark there is, by VM id.
    pub fn marks(&self) -> Vec<(String, Mark)> {
        self.deps.marks.all()
    }

    /// Moves the leaving VM's domain (see [`LiveMigration::migrate`]).
    pub async fn move_domain(
        &self,
        dom: &DomainRef,
        to: &MigrateTo,
        timeout: Duration,
    ) -> Result<(), LibvirtError> {
        self.deps.hypervisor.migrate(dom, to, timeout).await
    }

    /// Aborts the domain's running job, if any (a migration: the domain
    /// runs on here).
    pub async fn abort_job(&self, dom: &DomainRef) -> Result<(), LibvirtError> {
        self.deps.hypervisor.abort(dom).await
    }

    /// The guest's pause at the switch-over of the migration that brought
    /// the domain here, as its daemon measured it (`None`: not known).
    pub async fn arrival_downtime(&self, dom: &DomainRef) -> Option<Duration> {
        match self.deps.hypervisor.finished(dom).await {
            Ok(job) => job?.downtime_ms.map(Duration::from_millis),
            Err(e) => {
                tracing::debug!("the arrival's job stats: {e}");
                None
            }
        }
    }

    /// The key of the VMI of `uid` this host holds, if it holds one.
    pub fn vmi_key_of_uid(&self, uid: &str) -> Option<VmKey> {
        self.vmis()
            .values()
            .find(|v| v.uid() == Some(uid))
            .and_then(|v| v.key().ok())
    }

    /// The VMI of `id` the loop holds, with the status it reported.
    pub fn view_vmi(&self, id: &str) -> Option<VirtualMachineInstance> {
        self.vmis().get(id).cloned()
    }

    /// Whether the host is cordoned (`kvirtctl drain`): no VM arrives.
    pub fn cordoned(&self) -> bool {
        self.settings.layout.cordon_file().exists()
    }

    /// Cordons the host, or lifts it: a file, so that it outlives kvirtd
    /// and a reboot (replaced whole, synced, never through a link).
    pub fn set_cordoned(&self, on: bool) -> Result<(), String> {
        let file = self.settings.layout.cordon_file();
        let r = if on {
            let since = format!("{}\n", super::now_rfc3339());
            crate::host::commit::replace_private(&file, since.as_bytes())
        } else {
            match std::fs::remove_file(&file) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            }
        };
        r.map_err(|e| format!("{}: {e}", file.display()))?;
        tracing::info!(
            cordoned = on,
            "{}",
            if on { "cordoned" } else { "uncordoned" }
        );
        Ok(())
    }

    /// Every VMI the loop holds whose VM has not ended.
    pub fn live_vmis(&self) -> Vec<VirtualMachineInstance> {
        let mut v: Vec<_> = self
            .vmis()
            .values()
            .filter(|v| !v.status.phase.is_some_and(|p| p.is_final()))
            .cloned()
            .collect();
        v.sort_by_key(|v| v.key().map(|k| k.id()).unwrap_or_default());
        v
    }

    /// The VM's domain in its own daemon.
    pub fn domain_of(&self, key: &VmKey) -> DomainRef {
        self.domain_ref(&key.id(), None, &key.domain_name())
    }

    /// Where the VM's daemon listens, on the host.
    pub fn daemon_socket(&self, id: &str) -> std::path::PathBuf {
        self.paths(id).libvirt_socket(self.settings.daemon)
    }

    /// Whether the domain is still defined in the VM's daemon here. The
    /// domain lives only in its unit's daemon: with the unit gone or
    /// stopped (the source's teardown after the switch-over, before a
    /// restart), it is not here, and there is no daemon to ask.
    pub async fn domain_here(&self, dom: &DomainRef) -> Result<bool, ControllerError> {
        let unit = key::unit_name_of(&dom.id);
        let running = match self.deps.units.get(&unit).await {
            Ok(Some(u)) => matches!(u.activity, UnitActivity::Active | UnitActivity::Activating),
            Ok(None) => false,
            Err(source) => {
                let id = dom.id.clone();
                return Err(ControllerError::Systemd { id, source });
            }
        };
        if !running {
            return Ok(false);
        }
        let state = self.domain_state(dom).await;
        Ok(state
            .map_err(|source| ControllerError::Libvirt { source })?
            .is_some())
    }

    /// The domain's state in the VM's daemon here; `None`: not there.
    pub async fn domain_state(&self, dom: &DomainRef) -> Result<Option<DomainState>, LibvirtError> {
        Ok(self.deps.hypervisor.observe(dom).await?.map(|o| o.state))
    }

    /// The figures of the domain's job (a migration) running now, if one
    /// does and its daemon answers.
    pub async fn job_progress(&self, dom: &DomainRef) -> Option<crate::host::migrate::Progress> {
        self.deps.hypervisor.progress(dom).await.ok().flatten()
    }

    /// Waits (at most `wait`) for the domain's job to end: a migration
    /// asked to abort ends with the domain here, or past its switch-over
    /// with the domain gone.
    pub async fn until_no_job(&self, dom: &DomainRef, wait: Duration) {
        let deadline = tokio::time::Instant::now() + wait;
        while let Ok(Some(_)) = self.deps.hypervisor.progress(dom).await {
            if tokio::time::Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
