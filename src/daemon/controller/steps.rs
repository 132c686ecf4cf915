//! Carrying out a plan's steps, one function per step, grouped by the
//! system they touch: the VM's files, its network, its unit, its domain and
//! its machined registration. A failed create is rolled back here too.

use super::{Adapters, Controller, ControllerError};
use crate::core::convert::{Backing, Converted, DiskPrep};
use crate::core::identity;
use crate::core::key::{self, VmKey};
use crate::core::plan::{self, DomainState, Migrating, Observed, Step};
use crate::core::unit::{self, UnitInput};
use crate::core::vmi::VirtualMachineInstance;
use crate::host::bridging::{Attached, VmMeta};
use crate::host::identity::{IdentityStoreError, VmUsers};
use crate::host::image::ImageDisk;
use crate::host::libvirt::{DomainRef, Hypervisor};
use crate::host::machined::{MachineSpec, Machines};
use crate::host::netns::{Netns, NetnsError};
use crate::host::network::Network;
use crate::host::storage::{Owner, Storage, StorageError};
use crate::host::systemd::{SystemdError, Units};
use crate::sources::{EventReason, Recorder};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use tracing::{debug, info, warn};

/// What one pass knows that its steps need.
pub(super) struct StepCtx<'a> {
    pub id: &'a str,
    /// The converted disks with their cluster objects' data, for this start.
    pub disks: &'a [DiskPrep],
    /// containerDisks pulled for this start, by volume.
    pub images: &'a BTreeMap<String, ImageDisk>,
    /// The secondary networks with their configs, for this start.
    pub networks: &'a [Attached],
    pub obs: &'a Observed,
    pub vmi: Option<&'a VirtualMachineInstance>,
    pub key: Option<&'a VmKey>,
    pub converted: Option<&'a Converted>,
    pub dom: Option<&'a DomainRef>,
}

impl StepCtx<'_> {
    fn converted(&self) -> &Converted {
        self.converted
            .expect("create steps only run for a converted VMI")
    }

    fn uid(&self) -> &str {
        self.vmi.and_then(|v| v.uid()).unwrap_or_default()
    }
}

impl<A: Adapters> Controller<A> {
    pub(super) async fn run_step(
        &self,
        step: &Step,
        c: &StepCtx<'_>,
    ) -> Result<(), ControllerError> {
        match step {
            Step::AcquireIdentity => self.acquire_identity(c).await,
            Step::ReleaseIdentity => self.release_identity(c.id).await,
            Step::CreateDirs => self.create_dirs(c.id).await,
            Step::PrepareDisks => self.prepare_disks(c).await,
            Step::RemoveStateDir => self.remove_state_dir(c.id).await,
            Step::RemoveRuntimeDir => self.remove_runtime_dir(c.id).await,
            Step::KeepConsoleLog => self.keep_console_log(c.id).await,
            Step::CreateNetns => self.create_netns(c.id).await,
            Step::SetupNetwork => self.setup_network(c).await,
            Step::TeardownNetwork => self.teardown_network(c.id).await,
            Step::DeleteNetns => self.delete_netns(c.id).await,
            Step::StartUnit => self.start_unit(c).await,
            Step::StopUnit => self.stop_unit(c).await,
            Step::DefineDomain => self.define_domain(c).await,
            Step::StartDomain => self.start_domain(c).await,
            Step::ShutdownDomain { grace } => self.shutdown_domain(c, *grace).await,
            Step::RegisterMachine => self.register_machine(c).await,
            Step::UnregisterMachine => self.unregister_machine(c.id).await,
        }
    }

    /// Runs one stage's steps at once (see `plan::stages`); their results
    /// in the stage's order.
    pub(super) async fn run_stage(
        &self,
        stage: &[Step],
        c: &StepCtx<'_>,
    ) -> Vec<Result<(), ControllerError>> {
        futures::future::join_all(stage.iter().map(|step| async move {
            let t = tokio::time::Instant::now();
            let result = self.run_step(step, c).await;
            self.metrics.step(step.name(), t.elapsed());
            debug!(
                ?step,
                ms = t.elapsed().as_millis() as u64,
                ok = result.is_ok(),
                "step"
            );
            result
        }))
        .await
    }

    /// Undoes what a failed start made, best effort: whatever the host has
    /// of `id` is torn down as for a deleted VMI.
    pub(super) async fn rollback(&self, id: &str, dom: Option<&DomainRef>) {
        let obs = match self.observe(id, dom).await {
            Ok(o) => o,
            Err(e) => {
                warn!("rollback: cannot observe: {e}");
                Observed {
                    unit: None,
                    netns: true,
                    network: true,
                    state_dir: true,
                    runtime_dir: false,
                    runtime_kept: false,
                    domain: None,
                    machine: None,
                    identity: false,
                    unresponsive: None,
                }
            }
        };
        // The runtime directory and the identity stay with the VMI (its
        // log says why it failed); they go when the VMI does.
        let p = plan::plan(
            None,
            &Observed {
                runtime_dir: false,
                identity: false,
                ..obs
            },
        );
        let ctx = StepCtx {
            id,
            disks: &[],
            images: &BTreeMap::new(),
            networks: &[],
            obs: &Observed::default(),
            vmi: None,
            key: None,
            converted: None,
            dom,
        };
        // A VM that never started needs no grace.
        let steps: Vec<Step> = p
            .steps
            .into_iter()
            .map(|step| match step {
                Step::ShutdownDomain { .. } => Step::ShutdownDomain {
                    grace: Duration::ZERO,
                },
                s => s,
            })
            .collect();
        for stage in plan::stages(&steps) {
            for e in self
                .run_stage(stage, &ctx)
                .await
                .into_iter()
                .filter_map(Result::err)
            {
                warn!("rollback: {e}");
            }
        }
    }

    // Its identity.

    async fn acquire_identity(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let vm = c.key.map_or_else(|| c.id.to_owned(), |k| k.to_string());
        let users = &self.deps.users;
        users
            .acquire(c.id, &vm)
            .await
            .map(drop)
            .map_err(identity_err(c.id))
    }

    async fn release_identity(&self, id: &str) -> Result<(), ControllerError> {
        if let Some(owner) = self.owner(id) {
            // The hostDisks it was given first: on error the identity stays.
            let storage = &self.deps.storage;
            storage
                .revoke_grants(owner.uid)
                .await
                .map_err(storage_err(id))?;
        }
        self.deps.users.release(id).await.map_err(identity_err(id))
    }

    /// The VM's own uid and gid, which everything of it is made for.
    pub fn owner(&self, id: &str) -> Option<Owner> {
        let uid = self.deps.users.uid_of(id)?;
        Some(Owner { uid, gid: uid })
    }

    // Its files.

    async fn create_dirs(&self, id: &str) -> Result<(), ControllerError> {
        let paths = self.paths(id);
        let owner = self.owner(id).ok_or_else(|| no_identity(id))?;
        let storage = &self.deps.storage;
        storage
            .create_dirs(&paths, Some(owner))
            .await
            .map_err(storage_err(id))
    }

    async fn prepare_disks(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let namespace = c.key.map_or("", |k| k.namespace());
        let roots = self.settings.host_disk_roots.of(namespace);
        let owner = self.owner(c.id).ok_or_else(|| no_identity(c.id))?;
        for d in c.disks {
            let notice = self
                .deps
                .storage
                .prepare_disk(d, roots, c.images, Some(owner))
                .await
                .map_err(storage_err(c.id))?;
            if let (Some(m), Some(vmi)) = (notice, c.vmi) {
                warn!("{m}");
                let r = &self.deps.recorder;
                r.record(vmi, EventReason::ToleratedSmallPV, &m, true);
            }
        }
        Ok(())
    }

    async fn remove_state_dir(&self, id: &str) -> Result<(), ControllerError> {
        let paths = self.paths(id);
        let storage = &self.deps.storage;
        storage
            .keep_efi_vars(&paths)
            .await
            .map_err(storage_err(id))?;
        storage
            .remove_hugepages(id)
            .await
            .map_err(storage_err(id))?;
        storage
            .remove_dir(&paths.state_dir)
            .await
            .map_err(storage_err(id))?;
        // A VM deleted with its VMI leaves nobody to keep them for.
        self.sweep_efi_vars(Some(id)).await;
        Ok(())
    }

    async fn keep_console_log(&self, id: &str) -> Result<(), ControllerError> {
        let paths = self.paths(id);
        let storage = &self.deps.storage;
        storage
            .keep_console_log(&paths)
            .await
            .map_err(storage_err(id))
    }

    async fn remove_runtime_dir(&self, id: &str) -> Result<(), ControllerError> {
        let paths = self.paths(id);
        let storage = &self.deps.storage;
        storage
            .remove_dir(&paths.runtime_dir)
            .await
            .map_err(storage_err(id))
    }

    // Its network.

    async fn create_netns(&self, id: &str) -> Result<(), ControllerError> {
        let netns = &self.deps.netns;
        netns
            .create(&key::netns_name_of(id))
            .await
            .map_err(netns_err(id))
    }

    async fn setup_network(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let conv = c.converted();
        if conv.network.is_none() && c.networks.is_empty() {
            return Ok(());
        }
        let key = c.key.expect("a converted VMI has a key");
        let owner = self.owner(c.id).ok_or_else(|| no_identity(c.id))?;
        let hostname = conv
            .network
            .as_ref()
            .map_or(key.name(), |n| n.hostname.as_str());
        let vm = VmMeta {
            namespace: key.namespace(),
            name: key.name(),
            uid: c.uid(),
            hostname,
        };
        self.deps
            .network
            .setup(
                c.id,
                vm,
                conv.network.as_ref(),
                c.networks,
                (owner.uid, owner.gid),
            )
            .await
            .map_err(|source| ControllerError::Network { source })
    }

    async fn teardown_network(&self, id: &str) -> Result<(), ControllerError> {
        let network = &self.deps.network;
        network
            .teardown(id)
            .await
            .map_err(|source| ControllerError::Network { source })
    }

    async fn delete_netns(&self, id: &str) -> Result<(), ControllerError> {
        let netns = &self.deps.netns;
        netns
            .delete(&key::netns_name_of(id))
            .await
            .map_err(netns_err(id))
    }

    // Its unit.

    async fn start_unit(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let conv = c.converted();
        let key = c.key.expect("a converted VMI has a key");
        let paths = self.paths(c.id);
        let user = identity::user_name(self.owner(c.id).ok_or_else(|| no_identity(c.id))?.uid);
        let spec = unit::unit_spec(&UnitInput {
            key,
            uid: c.uid(),
            paths: &paths,
            host: &self.settings.layout,
            daemon: self.settings.daemon,
            daemon_path: self.settings.daemon_path.clone(),
            user: &user,
            slice: &self.settings.slice,
            memory_max_bytes: conv.resources.cgroup_memory_bytes() + self.settings.overhead_bytes,
            cpu_weight: unit::cpu_weight(conv.resources.cpu_request_millis),
            cpu_limit_millis: conv.resources.cpu_limit_millis,
            tasks_max: self.settings.tasks_max,
            grace_seconds: self
                .vmis()
                .get(c.id)
                .map_or(30, |v| v.termination_grace_period().as_secs()),
            extra_rw_paths: writable_disks(conv),
            extra_ro_paths: read_only_disks(conv, c.images),
            hidden_roots: self.hidden_roots(),
            devices: claim_devices(conv),
            allowed_cpus: self.unit_cpus(conv).as_ref(),
            shared_disks: conv.shared_disks,
        });
        self.deps.units.start(&spec).await.map_err(sd_err(c.id))
    }

    /// What a VM's unit hides but for its own disks: every hostDisk root
    /// and the claim roots there are.
    fn hidden_roots(&self) -> Vec<PathBuf> {
        let mut roots = self.settings.host_disk_roots.all();
        let claims = self.settings.claim_roots.iter();
        roots.extend(claims.filter(|r| r.is_dir()).cloned());
        roots.sort();
        roots.dedup();
        roots
    }

    /// The connection to the VM's daemon closes while the unit stops: a
    /// close needs the daemon's answer, which under load came late, and
    /// the daemon ending ends the connection anyway.
    async fn stop_unit(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let (id, unit) = (c.id, key::unit_name_of(c.id));
        let daemon = c.obs.unit.as_ref().and_then(|u| u.main_pid);
        let (_, stopped) = tokio::join!(
            self.deps.hypervisor.forget(id),
            self.deps.units.stop(&unit, daemon)
        );
        stopped.map_err(sd_err(id))
    }

    // Its domain.

    /// The domain this step acts on: the one this pass named, else the one
    /// the unit records.
    fn step_domain(&self, c: &StepCtx<'_>) -> DomainRef {
        c.dom.cloned().unwrap_or_else(|| {
            let unit = c.obs.unit.as_ref();
            self.domain_ref(
                c.id,
                unit.and_then(|u| u.daemon),
                unit.and_then(|u| u.domain_name.as_deref()).unwrap_or(c.id),
            )
        })
    }

    async fn define_domain(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let conv = c.converted();
        let results = self.deps.network.attachments(c.id);
        let macs = crate::core::convert::network::guest_macs(&conv.secondary_networks, &results);
        let xml = conv
            .domain_xml_with_macs(&macs)
            .map_err(|e| ControllerError::Network {
                source: crate::host::network::NetworkError::Vm {
                    id: c.id.into(),
                    message: format!("the domain XML with the plugins' MACs: {e}"),
                },
            })?;
        let hv = &self.deps.hypervisor;
        hv.define(&self.step_domain(c), &xml)
            .await
            .map_err(|source| ControllerError::Libvirt { source })
    }

    async fn start_domain(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let hv = &self.deps.hypervisor;
        let paused = c.converted.is_some_and(|conv| conv.start_paused);
        hv.start(&self.step_domain(c), paused)
            .await
            .map_err(|source| ControllerError::Libvirt { source })
    }

    async fn shutdown_domain(
        &self,
        c: &StepCtx<'_>,
        grace: Duration,
    ) -> Result<(), ControllerError> {
        if let Some(v) = c.vmi {
            self.deps.recorder.record(
                v,
                EventReason::ShuttingDown,
                "shutting the guest down",
                false,
            );
        }
        let deadline = self.grace_deadline(c.id, grace);
        let dom = self.step_domain(c);
        self.call_off_departure(c.id, &dom).await;
        self.shutdown(&dom, deadline).await
    }

    /// A VM stopped while it leaves (its VMI deleted midway): its
    /// migration job is aborted first, as its daemon would not shut the
    /// guest down under it; the send then finds the VM here and tells the
    /// target to let go.
    async fn call_off_departure(&self, id: &str, dom: &DomainRef) {
        let leaving = matches!(self.mark(id), Ok(Some(m)) if m.role == Migrating::Outgoing);
        if !leaving {
            return;
        }
        info!("the VM is stopped while it leaves: its migration is aborted first");
        if let Err(e) = self.abort_job(dom).await {
            warn!("aborting the migration: {e}");
        }
        self.until_no_job(dom, Duration::from_secs(30)).await;
    }

    /// ACPI power button, re-sent, until the guest is off or the grace
    /// period is up (KubeVirt's terminationGracePeriodSeconds); then the
    /// unit's stop ends QEMU. Between looks
    /// it waits for the domain's next event (a second at most): a hundred
    /// VMs in their grace periods cost their daemons nothing.
    async fn shutdown(
        &self,
        d: &DomainRef,
        deadline: tokio::time::Instant,
    ) -> Result<(), ControllerError> {
        let hv = &self.deps.hypervisor;
        let mut next_press = tokio::time::Instant::now();
        // Subscribed before the first look, so no change after it is missed.
        let mut changes = hv.changes(&d.id);
        loop {
            // The clock before a look: the stop that follows ends the guest
            // whatever a last look would show, and with 250 VMs' looks at
            // once that look made the graces end 0.7 s late (p50).
            if tokio::time::Instant::now() >= deadline {
                // No libvirt destroy: the unit's stop, next, signals QEMU
                // as destroy would, and its daemon at the same time.
                info!("grace period over: stopping the unit ends the guest");
                return Ok(());
            }
            let state = hv
                .observe(d)
                .await
                .map_err(|source| ControllerError::Libvirt { source })?
                .map(|o| o.state);
            if !matches!(state, Some(DomainState::Running | DomainState::Paused)) {
                return Ok(());
            }
            let now = tokio::time::Instant::now();
            if now >= next_press {
                if let Err(e) = hv.shutdown(d).await {
                    warn!("ACPI shutdown: {e}");
                }
                next_press = now + self.settings.shutdown_resend;
            }
            let wait = tokio::time::sleep(
                Duration::from_secs(1)
                    .min(deadline.saturating_duration_since(now))
                    .min(next_press.saturating_duration_since(now)),
            );
            tokio::pin!(wait);
            tokio::select! {
                r = changes.changed() => if r.is_err() {
                    wait.await;
                },
                _ = &mut wait => {}
            }
        }
    }

    // Its machined registration.

    async fn register_machine(&self, c: &StepCtx<'_>) -> Result<(), ControllerError> {
        let uid = c
            .vmi
            .and_then(|v| v.uid())
            .or_else(|| c.obs.unit.as_ref().and_then(|u| u.uid.as_deref()))
            .unwrap_or_default();
        let paths = self.paths(c.id);
        let pid_file = paths.qemu_pid_file(&self.step_domain(c).name);
        let spec = MachineSpec::new(c.id, uid, paths.runtime_dir, pid_file);
        self.deps
            .machines
            .register(&spec)
            .await
            .map_err(|source| ControllerError::Machined { source })
    }

    async fn unregister_machine(&self, id: &str) -> Result<(), ControllerError> {
        self.deps
            .machines
            .unregister(&key::machine_name_of(id))
            .await
            .map_err(|source| ControllerError::Machined { source })
    }
}

/// Disks the VM writes that live outside its own directories.
fn writable_disks(conv: &Converted) -> Vec<PathBuf> {
    conv.disks
        .iter()
        .filter_map(|d| match d {
            DiskPrep::CreateRawIfMissing { path, .. }
            | DiskPrep::RequireExisting { path, .. }
            | DiskPrep::Claim {
                path,
                size_bytes: Some(_),
                ..
            } => Some(path.clone()),
            _ => None,
        })
        .collect()
}

/// What the VM's overlays read: hostDisk bases and the image cache's
/// copies of its containerDisks (kernels are copied, not read in place).
fn read_only_disks(conv: &Converted, images: &BTreeMap<String, ImageDisk>) -> Vec<PathBuf> {
    let bases = conv.disks.iter().filter_map(|d| match d {
        DiskPrep::Overlay {
            backing: Backing::HostDisk(base),
            ..
        }
        | DiskPrep::Claim {
            path: base,
            size_bytes: None,
            ..
        } => Some(base.clone()),
        _ => None,
    });
    let cached = conv.disks.iter().filter_map(|d| match d {
        DiskPrep::Overlay { volume, .. } => images.get(volume).map(|i| i.root.clone()),
        _ => None,
    });
    bases.chain(cached).collect()
}

/// Block claims' host devices, and whether the VM may write them.
fn claim_devices(conv: &Converted) -> Vec<(PathBuf, bool)> {
    conv.disks
        .iter()
        .filter_map(|d| match d {
            DiskPrep::ClaimDevice {
                device, read_only, ..
            } => Some((device.clone(), !read_only)),
            _ => None,
        })
        .collect()
}

fn storage_err(id: &str) -> impl FnOnce(StorageError) -> ControllerError + '_ {
    move |source| ControllerError::Storage {
        id: id.into(),
        source,
    }
}

fn netns_err(id: &str) -> impl FnOnce(NetnsError) -> ControllerError + '_ {
    move |source| ControllerError::Netns {
        id: id.into(),
        source,
    }
}

fn no_identity(id: &str) -> ControllerError {
    ControllerError::Identity {
        id: id.into(),
        source: IdentityStoreError::Missing,
    }
}

fn identity_err(id: &str) -> impl FnOnce(IdentityStoreError) -> ControllerError + '_ {
    move |source| ControllerError::Identity {
        id: id.into(),
        source,
    }
}

fn sd_err(id: &str) -> impl FnOnce(SystemdError) -> ControllerError + '_ {
    move |source| ControllerError::Systemd {
        id: id.into(),
        source,
    }
}
