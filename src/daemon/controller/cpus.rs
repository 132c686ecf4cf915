//! Dedicated CPUs (`dedicatedCpuPlacement`): placed for a VMI before its
//! conversion (the domain pins its vCPUs to them), held from the start of
//! its unit, let go once its unit is gone. Every other VM's unit is kept
//! on the CPUs no VM holds, as kubelet's static CPU manager keeps other
//! pods off a Guaranteed pod's CPUs.

use super::{Adapters, Controller, ControllerError};
use crate::core::convert::{self, Converted};
use crate::core::cpuset::CpuSet;
use crate::core::key;
use crate::core::plan::{UnitActivity, UnitObs};
use crate::core::vmi::VirtualMachineInstance;
use crate::host::systemd::Units;
use tracing::{info, warn};

const FIELD: &str = "spec.domain.cpu.dedicatedCpuPlacement";

/// Why a VMI has no CPUs placed.
pub(super) enum Unplaced {
    /// It can never start here.
    Refused(String),
    /// Not now: too few are free. It waits, as a pod waits for a node
    /// with room, converted meanwhile with `provisional` CPUs (never
    /// defined with them).
    Wait {
        message: String,
        provisional: CpuSet,
    },
}

impl<A: Adapters> Controller<A> {
    /// The dedicated CPUs the VMI of `id` runs on: those it holds, else
    /// those it would get now (held only once its unit starts). `Err`: why
    /// it cannot start on this host. `admitted`: its unit runs, and a VM
    /// that runs is never refused.
    pub(super) async fn place_cpus(
        &self,
        id: &str,
        vmi: &VirtualMachineInstance,
        admitted: bool,
    ) -> Result<Option<CpuSet>, Unplaced> {
        let cpus = &self.deps.cpus;
        let Some(want) = convert::dedicated_cpus_wanted(vmi) else {
            if cpus.enabled() && !admitted && cpus.shared().is_empty() {
                return Err(Unplaced::Wait {
                    message: format!(
                        "every CPU is held by VMs with dedicated CPUs ({}); none is left \
                         for one without",
                        cpus.pool()
                    ),
                    provisional: CpuSet::default(),
                });
            }
            return Ok(None);
        };
        if admitted {
            // A VM that runs keeps its CPUs, and keeps running whatever the
            // host's configuration says now; when no holding is known (its
            // CPUs no longer dedicated), the conversion only reports.
            return Ok(Some(
                cpus.held_by(id)
                    .filter(|h| h.len() == want as usize)
                    .unwrap_or_else(|| (0..want).collect()),
            ));
        }
        if !cpus.enabled() {
            return Err(Unplaced::Refused(format!(
                "{FIELD}: this host dedicates no CPUs to VMs (vm.dedicated_cpus in its \
                 kvirtd.toml is empty)"
            )));
        }
        if want as usize > cpus.pool().len() {
            return Err(Unplaced::Refused(format!(
                "{FIELD}: needs {want} dedicated CPUs, and this host dedicates {} in all ({})",
                cpus.pool().len(),
                cpus.pool()
            )));
        }
        // A VM without dedicated CPUs that runs keeps one CPU to run on.
        let keep_shared = match self.deps.units.list_ids().await {
            Ok(ids) => ids.iter().any(|u| u != id && cpus.held_by(u).is_none()),
            Err(e) => {
                warn!(
                    "listing the VMs' units: {e}; one CPU stays for those without dedicated ones"
                );
                true
            }
        };
        cpus.propose(id, want, keep_shared)
            .map(Some)
            .map_err(|e| Unplaced::Wait {
                message: e.to_string(),
                provisional: cpus.pool().iter().take(want as usize).collect(),
            })
    }

    /// Holds the CPUs a VM's domain is pinned to before its unit starts
    /// (on disk first, so a restart finds them held); the other VMs move
    /// off them.
    pub(super) async fn hold_cpus(
        &self,
        id: &str,
        conv: &Converted,
    ) -> Result<(), ControllerError> {
        let Some(set) = conv.resources.dedicated_cpus.clone() else {
            return Ok(());
        };
        let (store, who, what) = (self.deps.cpus.clone(), id.to_owned(), set.clone());
        let held = tokio::task::spawn_blocking(move || store.claim(&who, &what))
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|message| ControllerError::Cpus {
                id: id.into(),
                message,
            })?;
        if held {
            info!(cpus = %set, "holds its dedicated CPUs");
            self.spread_shared().await;
        }
        Ok(())
    }

    /// Lets go of what `id` held (its unit is gone); VMIs waiting for
    /// CPUs are passed again, as they are when a unit without dedicated
    /// CPUs was `stopped` (the CPU kept for such VMs may be free now).
    pub(super) async fn release_cpus(&self, id: &str, stopped: bool) {
        if self.deps.cpus.held_by(id).is_none() {
            if stopped && self.deps.cpus.enabled() {
                self.wake_cpu_waiters();
            }
            return;
        }
        let (store, who) = (self.deps.cpus.clone(), id.to_owned());
        match tokio::task::spawn_blocking(move || store.release(&who)).await {
            Ok(Ok(Some(set))) => {
                info!(cpus = %set, "let go of its dedicated CPUs");
                self.spread_shared().await;
                self.wake_cpu_waiters();
            }
            Ok(Ok(None)) => {}
            // Still held on disk: the next pass tries again.
            Ok(Err(e)) => warn!("letting go of its dedicated CPUs: {e}"),
            Err(e) => warn!("letting go of its dedicated CPUs: {e}"),
        }
    }

    /// The VMIs that want dedicated CPUs and hold none are looked at again
    /// by the loop: one may fit now.
    fn wake_cpu_waiters(&self) {
        let waiting: Vec<String> = self
            .vmis()
            .iter()
            .filter(|(id, v)| {
                self.deps.cpus.held_by(id).is_none() && convert::dedicated_cpus_wanted(v).is_some()
            })
            .map(|(id, _)| id.clone())
            .collect();
        self.woken
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(waiting);
    }

    /// Ids the loop should pass again (see `wake_cpu_waiters`).
    pub(super) fn take_woken(&self) -> Vec<String> {
        std::mem::take(&mut *self.woken.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// What a starting unit runs on: its dedicated CPUs, else those no VM
    /// holds; `None` when the host dedicates none (any CPU).
    pub(super) fn unit_cpus(&self, conv: &Converted) -> Option<CpuSet> {
        let cpus = &self.deps.cpus;
        cpus.enabled().then(|| {
            conv.resources
                .dedicated_cpus
                .clone()
                .unwrap_or_else(|| cpus.shared())
        })
    }

    /// A running VM's unit that is not on the CPUs it should be (a start
    /// that raced another VM's taking CPUs, a hand-made change) is moved.
    pub(super) async fn keep_on_cpus(&self, id: &str, unit: Option<&UnitObs>) {
        let cpus = &self.deps.cpus;
        let Some(u) = unit.filter(|u| u.activity == UnitActivity::Active) else {
            return;
        };
        if !cpus.enabled() {
            return;
        }
        let want = cpus.held_by(id).unwrap_or_else(|| cpus.shared());
        if want.is_empty() || u.allowed_cpus.as_ref() == Some(&want) {
            return;
        }
        let unit = key::unit_name_of(id);
        match self.deps.units.set_allowed_cpus(&unit, &want).await {
            Ok(()) => info!(cpus = %want, "moved its unit to the CPUs it runs on"),
            Err(e) => warn!("moving its unit to CPUs {want}: {e}"),
        }
    }

    /// Every VM unit without dedicated CPUs is moved to those no VM holds.
    pub async fn spread_shared(&self) {
        let cpus = &self.deps.cpus;
        let shared = cpus.shared();
        if !cpus.enabled() || shared.is_empty() {
            return;
        }
        let ids = match self.deps.units.list_ids().await {
            Ok(ids) => ids,
            Err(e) => return warn!("listing the VMs' units to move them off dedicated CPUs: {e}"),
        };
        for id in ids.iter().filter(|id| cpus.held_by(id).is_none()) {
            let unit = key::unit_name_of(id);
            if let Err(e) = self.deps.units.set_allowed_cpus(&unit, &shared).await {
                warn!(vm = %id, "moving its unit to CPUs {shared}: {e}");
            }
        }
    }

    /// After a start of kvirtd: what units no longer run is let go, and
    /// every other VM is kept off what is held.
    pub async fn converge_cpus(&self) {
        let cpus = &self.deps.cpus;
        let holders = cpus.holders();
        if holders.is_empty() {
            self.spread_shared().await;
            return;
        }
        match self.deps.units.list_ids().await {
            Ok(running) => {
                for id in holders.iter().filter(|h| !running.contains(h)) {
                    self.release_cpus(id, false).await;
                }
            }
            Err(e) => warn!("listing the VMs' units: {e}; dedicated CPUs stay held"),
        }
        self.spread_shared().await;
    }
}
