//! Recording fakes of every external system, sharing one simulated host so
//! tests can check what the loop did, in order, across systems. It stands
//! in for `host` and `sources` alike, so it lives with the loop it tests.

use crate::core::convert::DiskPrep;
use crate::core::cpuset::CpuSet;
use crate::core::guestinfo::GuestDetails;
use crate::core::image::PullPolicy;
use crate::core::key::{self, VmKey};
use crate::core::layout::VmPaths;
use crate::core::objects::{ObjectData, ObjectRef};
use crate::core::plan::{DomainObs, DomainState, GuestAgent, UnitActivity, UnitObs};
use crate::core::pullsecret::Credentials;
use crate::core::unit::{
    Prop, UnitSpec, ENV_GRACE, ENV_NAME, ENV_NAMESPACE, ENV_SHARED_DISKS, ENV_UID,
};
use crate::core::vmi::VirtualMachineInstance;
use crate::daemon::controller::{Adapters, Deps};
use crate::host::cpus::DedicatedCpus;
use crate::host::identity::{IdentityStoreError, VmUsers};
use crate::host::image::{ImageDisk, ImageError, Images, Progress};
use crate::host::libvirt::{DomainRef, Hypervisor, LibvirtError};
use crate::host::machined::{MachineSpec, MachinedError, Machines};
use crate::host::netns::{Netns, NetnsError};
use crate::host::storage::{Owner, Storage, StorageError};
use crate::host::systemd::{SystemdError, Units};
use crate::sources::{EventReason, Recorder, SourceError, StatusStore};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

#[derive(Debug, Default)]
pub struct HostState {
    /// The dedicated CPUs `deps()` hands out; `None`: the host has none.
    pub cpus: Option<Arc<DedicatedCpus>>,
    pub units: BTreeMap<String, UnitObs>,
    pub unit_specs: BTreeMap<String, UnitSpec>,
    pub netns: BTreeSet<String>,
    pub dirs: BTreeSet<PathBuf>,
    /// Runtime directories replaced by a finished VM's kept console log.
    pub kept: BTreeSet<PathBuf>,
    pub disks: Vec<DiskPrep>,
    /// Seed ISOs written again over a running VM's (renewed tokens).
    pub reseeded: Vec<(PathBuf, crate::core::convert::seed::Seed)>,
    /// The hostDisk roots each disk was prepared with, by its path.
    pub disk_roots: BTreeMap<PathBuf, Vec<PathBuf>>,
    /// Whose each directory and disk was made for (uid, gid), by path; and
    /// each VM's tap, by VM id.
    pub owners: BTreeMap<PathBuf, Option<(u32, u32)>>,
    pub tap_owners: BTreeMap<String, (u32, u32)>,
    /// VM identities, by VM id; the next number to hand out.
    pub identities: BTreeMap<String, u32>,
    pub next_identity: u32,
    /// Domains by VM id.
    pub domains: BTreeMap<String, DomainObs>,
    pub statuses: BTreeMap<VmKey, VirtualMachineInstance>,
    pub events: Vec<(VmKey, EventReason, String)>,
    /// VMIs held (finalizer added) and released, by key.
    pub held: BTreeSet<VmKey>,
    /// Addresses leased, by VM id; and VM ids whose DHCP server runs.
    pub addresses: BTreeMap<String, std::net::Ipv4Addr>,
    /// Dual stack: each address has an IPv6 one beside it, `fd00:6b76::`
    /// and the IPv4 address's last byte.
    pub dual_stack: bool,
    pub dhcp: BTreeSet<String>,
    /// Secondary networks attached, by VM id (their config names).
    pub attached: BTreeMap<String, Vec<String>>,
    /// The CNI config directory's networks, by name.
    pub cni_files: BTreeMap<String, String>,
    /// The attachments' results, by VM id.
    pub cni_results: BTreeMap<String, Vec<(String, crate::core::cni::CniResult)>>,
    pub released: Vec<VmKey>,
    /// Every call, in order: `start kvirt-vm@ns_vm.service`, `define ns_vm`...
    pub calls: Vec<String>,
    /// Calls (by their recorded text prefix) that fail.
    pub fail: BTreeSet<String>,
    /// Calls (by prefix) that panic, as a bug in an adapter would.
    pub panic: BTreeSet<String>,
    /// Calls (by prefix) that wait, once recorded, until the test adds a
    /// permit: a pass held at that point while the test changes the world.
    pub gates: BTreeMap<String, Arc<tokio::sync::Semaphore>>,
    /// Where a unit's or domain's change is told by VM id, as systemd's
    /// and libvirt's events are (`kvirtd --simulate`); tests drive passes
    /// themselves.
    pub wake: Option<tokio::sync::mpsc::UnboundedSender<String>>,
    /// VM ids whose libvirt daemon does not answer.
    pub unresponsive: BTreeSet<String>,
    /// Ids whose daemon's socket cannot be connected to.
    pub unreachable: BTreeSet<String>,
    /// Whether guests power off when the ACPI button is pressed.
    pub guests_ignore_acpi: bool,
    /// Machines machined knows, by name.
    pub machines: BTreeMap<String, MachineSpec>,
    /// A host without systemd-machined.
    pub no_machined: bool,
    /// Images in the (pretend) image cache.
    pub pulled: BTreeSet<String>,
    /// Guest agents connected, by VM id.
    pub agents: BTreeMap<String, GuestAgent>,
    /// What a connected agent says of users and filesystems, by VM id.
    pub guest_details: BTreeMap<String, GuestDetails>,
    /// Cluster objects, by namespace and reference.
    pub objects: BTreeMap<(String, ObjectRef), ObjectData>,
    /// Claims as the cluster has them, and their recorded users, by
    /// namespace and name.
    pub claims: BTreeMap<(String, String), crate::sources::ClaimObjects>,
    pub claim_users: BTreeMap<(String, String), Vec<crate::core::pvc::User>>,
    /// Namespaces whose objects kvirtd may not read (not opted in).
    pub closed_namespaces: BTreeSet<String>,
    /// ResourceQuota bounds on emptyDisks, by namespace.
    pub quotas: BTreeMap<String, Vec<crate::core::quota::Hard>>,
    /// VMIs of other hosts, by namespace, as the allowance counts them
    /// (this host's are its statuses, admitted once held).
    pub other_claims: BTreeMap<String, Vec<crate::core::quota::Claim>>,
    /// Kept EFI variables, by VM id.
    pub kept_efi_vars: BTreeMap<String, crate::core::efivars::Kept>,
    /// VirtualMachines that exist, as `namespace/name uid`; `None`: there
    /// is no cluster to ask.
    pub virtual_machines: Option<BTreeSet<String>>,
    /// Migration marks, by VM id (kept across controllers, as on disk).
    pub marks: BTreeMap<String, crate::core::migration::Mark>,
    pub fences: BTreeMap<String, crate::core::fence::Fenced>,
}

#[derive(Clone, Default)]
pub struct FakeHost(Arc<Mutex<HostState>>);

/// One fake for every part: calls across systems land in one ordered log.
impl Adapters for FakeHost {
    type Units = FakeHost;
    type Netns = FakeHost;
    type Network = FakeHost;
    type Hypervisor = FakeHost;
    type Storage = FakeHost;
    type Machines = FakeHost;
    type Images = FakeHost;
    type Users = FakeHost;
    type Status = FakeHost;
    type Recorder = FakeHost;
    type Marks = FakeHost;
    type Fences = FakeHost;
}

/// The fake as every host part, with a real source's status store and
/// recorder: `kvirtd --simulate`, a host that runs no VM but talks to the
/// API server as a real one does (the control plane's benchmark).
pub struct Simulated<St, R>(std::marker::PhantomData<(St, R)>);

impl<St: StatusStore, R: Recorder> Adapters for Simulated<St, R> {
    type Units = FakeHost;
    type Netns = FakeHost;
    type Network = FakeHost;
    type Hypervisor = FakeHost;
    type Storage = FakeHost;
    type Machines = FakeHost;
    type Images = FakeHost;
    type Users = FakeHost;
    type Status = St;
    type Recorder = R;
    type Marks = FakeHost;
    type Fences = FakeHost;
}

impl FakeHost {
    pub fn state(&self) -> MutexGuard<'_, HostState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This one fake as every part of a controller.
    pub fn deps(&self) -> Deps<FakeHost> {
        Deps {
            units: self.clone(),
            netns: self.clone(),
            network: self.clone(),
            hypervisor: self.clone(),
            storage: self.clone(),
            status: self.clone(),
            recorder: self.clone(),
            machines: self.clone(),
            images: self.clone(),
            users: self.clone(),
            marks: self.clone(),
            fences: self.clone(),
            cpus: self
                .state()
                .cpus
                .clone()
                .unwrap_or_else(|| Arc::new(DedicatedCpus::none())),
        }
    }

    /// This fake as every host part, with `status` and `recorder`.
    pub fn simulated<St: StatusStore, R: Recorder>(
        &self,
        status: St,
        recorder: R,
    ) -> Deps<Simulated<St, R>> {
        let d = self.deps();
        Deps {
            units: d.units,
            netns: d.netns,
            network: d.network,
            hypervisor: d.hypervisor,
            storage: d.storage,
            status,
            recorder,
            machines: d.machines,
            images: d.images,
            users: d.users,
            marks: d.marks,
            fences: d.fences,
            cpus: d.cpus,
        }
    }

    pub fn take_calls(&self) -> Vec<String> {
        std::mem::take(&mut self.state().calls)
    }

    /// Records a call; returns true when the test asked it to fail.
    fn call(&self, what: String) -> bool {
        let mut s = self.state();
        let fail = s.fail.iter().any(|f| what.starts_with(f.as_str()));
        let panic = s.panic.iter().any(|f| what.starts_with(f.as_str()));
        s.calls.push(what.clone());
        drop(s);
        assert!(!panic, "injected panic: {what}");
        fail
    }

    /// Holds calls starting with `prefix` until the returned semaphore
    /// gets a permit.
    pub fn gate(&self, prefix: &str) -> Arc<tokio::sync::Semaphore> {
        let g = Arc::new(tokio::sync::Semaphore::new(0));
        self.state().gates.insert(prefix.into(), g.clone());
        g
    }

    async fn wait_at_gate(&self, what: &str) {
        let gate = (self.state().gates.iter())
            .find(|(prefix, _)| what.starts_with(prefix.as_str()))
            .map(|(_, g)| g.clone());
        if let Some(g) = gate {
            g.acquire().await.expect("gate open").forget();
        }
    }

    /// Tells `id`'s change to whoever listens for events.
    fn changed(&self, id: &str) {
        if let Some(tx) = &self.state().wake {
            let _ = tx.send(id.to_owned());
        }
    }

    /// The guest powers itself off, as a real one would.
    pub fn guest_poweroff(&self, id: &str) {
        if let Some(d) = self.state().domains.get_mut(id) {
            d.state = DomainState::Shutdown;
        }
    }

    pub fn fail(&self, prefix: &str) {
        self.state().fail.insert(prefix.into());
    }

    pub fn heal(&self, prefix: &str) {
        self.state().fail.remove(prefix);
    }
}

fn env_of(spec: &UnitSpec, k: &str) -> Option<String> {
    spec.properties.iter().find_map(|p| match p {
        Prop::Strs("Environment", env) => env
            .iter()
            .find_map(|e| e.strip_prefix(k)?.strip_prefix('=').map(str::to_owned)),
        _ => None,
    })
}

fn injected(what: &str) -> String {
    format!("injected failure: {what}")
}

impl Units for FakeHost {
    async fn start(&self, spec: &UnitSpec) -> Result<(), SystemdError> {
        let what = format!("start {}", spec.name);
        let fail = self.call(what.clone());
        self.wait_at_gate(&what).await;
        if fail {
            return Err(SystemdError::Job {
                unit: spec.name.clone(),
                verb: "start",
                result: injected("start"),
            });
        }
        let obs = UnitObs {
            activity: UnitActivity::Active,
            uid: env_of(spec, ENV_UID),
            daemon: None,
            grace: env_of(spec, ENV_GRACE)
                .and_then(|g| g.parse().ok())
                .map(Duration::from_secs),
            domain_name: env_of(spec, ENV_NAMESPACE)
                .zip(env_of(spec, ENV_NAME))
                .map(|(a, b)| format!("{a}_{b}")),
            result: "success".into(),
            restarts: 0,
            main_pid: None,
            allowed_cpus: spec.properties.iter().find_map(|p| match p {
                Prop::Bytes("AllowedCPUs", mask) => Some(CpuSet::from_mask(mask)),
                _ => None,
            }),
            shared_disks: env_of(spec, ENV_SHARED_DISKS).is_some(),
        };
        let mut s = self.state();
        s.units.insert(spec.name.clone(), obs);
        s.unit_specs.insert(spec.name.clone(), spec.clone());
        drop(s);
        if let Some(id) = key::id_from_unit(&spec.name) {
            self.changed(id);
        }
        Ok(())
    }

    async fn stop(&self, unit: &str, _daemon: Option<u32>) -> Result<(), SystemdError> {
        if self.call(format!("stop {unit}")) {
            return Err(SystemdError::Job {
                unit: unit.into(),
                verb: "stop",
                result: injected("stop"),
            });
        }
        let mut s = self.state();
        s.units.remove(unit);
        // machined forgets a machine whose unit is gone.
        s.machines.retain(|_, m| m.unit != unit);
        // Stopping the unit kills its daemon and QEMU with it.
        if let Some(id) = key::id_from_unit(unit) {
            s.domains.remove(id);
            drop(s);
            self.changed(id);
        }
        Ok(())
    }

    async fn get(&self, unit: &str) -> Result<Option<UnitObs>, SystemdError> {
        Ok(self.state().units.get(unit).cloned())
    }

    async fn set_allowed_cpus(&self, unit: &str, cpus: &CpuSet) -> Result<(), SystemdError> {
        self.call(format!("cpus {unit} {cpus}"));
        if let Some(u) = self.state().units.get_mut(unit) {
            u.allowed_cpus = Some(cpus.clone());
        }
        Ok(())
    }

    /// As systemd does for a VM's unit: QEMU gone with its daemon, which
    /// the unit then starts again (`Restart=on-failure`) without a domain.
    async fn kill_all(&self, unit: &str) -> Result<(), SystemdError> {
        if self.call(format!("kill {unit}")) {
            return Err(SystemdError::Job {
                unit: unit.into(),
                verb: "kill",
                result: injected("kill"),
            });
        }
        let mut s = self.state();
        if let Some(id) = key::id_from_unit(unit) {
            s.domains.remove(id);
        }
        if let Some(u) = s.units.get_mut(unit) {
            u.restarts += 1;
        }
        Ok(())
    }

    async fn list_ids(&self) -> Result<Vec<String>, SystemdError> {
        Ok(self
            .state()
            .units
            .keys()
            .filter_map(|u| key::id_from_unit(u).map(str::to_owned))
            .collect())
    }
}

/// Images are "pulled" into a cache that only exists in memory: half a
/// progress report, then the whole, as a real pull reports.
impl Images for FakeHost {
    async fn disk(
        &self,
        image: &str,
        _policy: PullPolicy,
        path: Option<&str>,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<ImageDisk, ImageError> {
        let who = auth.map_or(String::new(), |c| format!(" as {}", c.username));
        if self.call(format!("pull {image}{who}")) {
            return Err(ImageError::Content {
                image: image.into(),
                message: injected("pull"),
            });
        }
        progress(Progress { done: 1, total: 2 });
        progress(Progress { done: 2, total: 2 });
        let hex: String = image.bytes().map(|b| format!("{b:02x}")).take(32).collect();
        let root = PathBuf::from("/var/cache/kvirt/images/sha256").join(&hex);
        self.state().pulled.insert(image.into());
        Ok(ImageDisk {
            path: root.join(path.unwrap_or("disk/disk.qcow2").trim_start_matches('/')),
            format: "qcow2",
            root,
            digest: format!("sha256:{hex}"),
        })
    }
}

impl Machines for FakeHost {
    async fn registered(&self, name: &str) -> Result<Option<bool>, MachinedError> {
        let s = self.state();
        Ok((!s.no_machined).then(|| s.machines.contains_key(name)))
    }

    async fn register(&self, spec: &MachineSpec) -> Result<(), MachinedError> {
        if self.call(format!("register-machine {}", spec.name)) {
            return Err(MachinedError::Leader {
                name: spec.name.clone(),
                path: spec.pid_file.clone(),
                message: injected("register-machine"),
            });
        }
        self.state()
            .machines
            .insert(spec.name.clone(), spec.clone());
        Ok(())
    }

    async fn unregister(&self, name: &str) -> Result<(), MachinedError> {
        self.call(format!("unregister-machine {name}"));
        self.state().machines.remove(name);
        Ok(())
    }
}

impl Netns for FakeHost {
    async fn create(&self, name: &str) -> Result<(), NetnsError> {
        if self.call(format!("netns add {name}")) {
            return Err(NetnsError::Loopback {
                name: name.into(),
                message: injected("netns"),
            });
        }
        self.state().netns.insert(name.into());
        Ok(())
    }

    async fn delete(&self, name: &str) -> Result<(), NetnsError> {
        if self.call(format!("netns del {name}")) {
            return Err(NetnsError::Loopback {
                name: name.into(),
                message: injected("netns del"),
            });
        }
        self.state().netns.remove(name);
        Ok(())
    }

    async fn exists(&self, name: &str) -> Result<bool, NetnsError> {
        Ok(self.state().netns.contains(name))
    }

    async fn list(&self) -> Result<Vec<String>, NetnsError> {
        Ok(self.state().netns.iter().cloned().collect())
    }
}

/// A migration moves the domain away at once (the other host is another
/// fake); a domain injected with `migrate` fails and stays.
impl crate::host::migrate::LiveMigration for FakeHost {
    async fn migrate(
        &self,
        d: &DomainRef,
        to: &crate::host::migrate::MigrateTo,
        _timeout: Duration,
    ) -> Result<(), LibvirtError> {
        let copied = to.copied_disks.join(",");
        if self.call(format!("migrate {} copying [{copied}]", d.name)) {
            return Err(LibvirtError::Call {
                id: d.id.clone(),
                op: "migrate",
                message: injected("migrate"),
            });
        }
        self.state().domains.remove(&d.id);
        Ok(())
    }

    async fn progress(
        &self,
        _d: &DomainRef,
    ) -> Result<Option<crate::host::migrate::Progress>, LibvirtError> {
        Ok(None)
    }

    async fn finished(
        &self,
        _d: &DomainRef,
    ) -> Result<Option<crate::host::migrate::Progress>, LibvirtError> {
        Ok(None)
    }

    async fn abort(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.call(format!("abort migration {}", d.name));
        Ok(())
    }
}

impl Hypervisor for FakeHost {
    async fn observe(&self, d: &DomainRef) -> Result<Option<DomainObs>, LibvirtError> {
        let s = self.state();
        if s.unreachable.contains(&d.id) {
            return Err(LibvirtError::Call {
                id: d.id.clone(),
                op: "connect",
                message: "No such file or directory (os error 2)".into(),
            });
        }
        if s.unresponsive.contains(&d.id) {
            return Err(LibvirtError::Unresponsive {
                id: d.id.clone(),
                op: "observe",
                timeout: Duration::from_secs(15),
            });
        }
        let agent = s.agents.contains_key(&d.id);
        Ok(s.domains
            .get(&d.id)
            .cloned()
            .map(|o| DomainObs { agent, ..o }))
    }

    async fn define(&self, d: &DomainRef, xml: &str) -> Result<(), LibvirtError> {
        if self.call(format!("define {}", d.name)) {
            return Err(LibvirtError::Call {
                id: d.id.clone(),
                op: "define",
                message: injected("define"),
            });
        }
        let uid = xml
            .find(":uid>")
            .map(|i| &xml[i + 5..])
            .and_then(|r| r.split('<').next())
            .map(str::to_owned);
        self.state().domains.insert(
            d.id.clone(),
            DomainObs {
                state: DomainState::Shutoff,
                uid,
                paused: None,
                machine: None,
                agent: false,
            },
        );
        Ok(())
    }

    async fn start(&self, d: &DomainRef, paused: bool) -> Result<(), LibvirtError> {
        if self.call(format!("start-domain {}", d.name)) {
            return Err(LibvirtError::Call {
                id: d.id.clone(),
                op: "start",
                message: injected("start"),
            });
        }
        if let Some(dom) = self.state().domains.get_mut(&d.id) {
            dom.state = DomainState::Running;
            if paused {
                dom.state = DomainState::Paused;
                dom.paused = Some("PausedStartStrategy".into());
            }
        }
        self.changed(&d.id);
        Ok(())
    }

    async fn set_paused(&self, d: &DomainRef, paused: bool) -> Result<(), LibvirtError> {
        self.call(format!(
            "{} {}",
            if paused { "pause" } else { "unpause" },
            d.name
        ));
        let mut s = self.state();
        let dom = s.domains.get_mut(&d.id).ok_or_else(|| LibvirtError::Call {
            id: d.id.clone(),
            op: "pause",
            message: "domain is not defined".into(),
        })?;
        (dom.state, dom.paused) = if paused {
            (DomainState::Paused, Some("PausedByUser".into()))
        } else {
            (DomainState::Running, None)
        };
        Ok(())
    }

    async fn soft_reboot(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.call(format!("soft-reboot {}", d.name));
        Ok(())
    }

    async fn shutdown(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.call(format!("shutdown {}", d.name));
        let mut s = self.state();
        let ignore = s.guests_ignore_acpi;
        if let Some(dom) = s.domains.get_mut(&d.id).filter(|_| !ignore) {
            dom.state = DomainState::Shutdown;
        }
        Ok(())
    }

    async fn forget(&self, _id: &str) {}

    /// No events: waiters poll.
    fn changes(&self, _id: &str) -> tokio::sync::watch::Receiver<u64> {
        tokio::sync::watch::channel(0).1
    }

    async fn probe(&self, uri: &str) -> Result<(), LibvirtError> {
        if self.call(format!("probe {uri}")) {
            return Err(LibvirtError::Call {
                id: "probe".into(),
                op: "capabilities",
                message: injected("probe"),
            });
        }
        Ok(())
    }

    async fn guest_agent(&self, d: &DomainRef) -> Result<Option<GuestAgent>, LibvirtError> {
        let s = self.state();
        let running = s
            .domains
            .get(&d.id)
            .is_some_and(|dom| dom.state == DomainState::Running);
        Ok(s.agents.get(&d.id).filter(|_| running).cloned())
    }

    async fn guest_details(&self, d: &DomainRef) -> Result<Option<GuestDetails>, LibvirtError> {
        self.call(format!("guest details {}", d.id));
        let s = self.state();
        let running = s
            .domains
            .get(&d.id)
            .is_some_and(|dom| dom.state == DomainState::Running);
        Ok((running && s.agents.contains_key(&d.id))
            .then(|| s.guest_details.get(&d.id).cloned().unwrap_or_default()))
    }
}

impl Storage for FakeHost {
    async fn create_dirs(&self, paths: &VmPaths, owner: Option<Owner>) -> Result<(), StorageError> {
        self.call(format!("mkdir {}", paths.state_dir.display()));
        let mut s = self.state();
        for d in [&paths.state_dir, &paths.runtime_dir] {
            s.owners.insert(d.clone(), owner.map(|o| (o.uid, o.gid)));
        }
        s.kept.remove(&paths.runtime_dir);
        s.dirs.insert(paths.state_dir.clone());
        s.dirs.insert(paths.runtime_dir.clone());
        Ok(())
    }

    async fn prepare_disk(
        &self,
        disk: &DiskPrep,
        roots: &[PathBuf],
        _images: &crate::host::storage::Pulled,
        owner: Option<Owner>,
    ) -> Result<Option<String>, StorageError> {
        let path = disk.path().to_owned();
        let mut s = self.state();
        s.disk_roots.insert(path.clone(), roots.to_vec());
        s.owners.insert(path.clone(), owner.map(|o| (o.uid, o.gid)));
        drop(s);
        if self.call(format!("disk {}", path.display())) {
            return Err(StorageError::Disk {
                path,
                message: injected("disk"),
            });
        }
        self.state().disks.push(disk.clone());
        Ok(None)
    }

    async fn remove_dir(&self, dir: &Path) -> Result<(), StorageError> {
        self.call(format!("rmdir {}", dir.display()));
        let mut s = self.state();
        s.dirs.remove(dir);
        s.kept.remove(dir);
        Ok(())
    }

    /// Hugepage directories are never made by the fake host.
    async fn remove_hugepages(&self, _id: &str) -> Result<(), StorageError> {
        Ok(())
    }

    /// Nor are EFI variables: tests plant them in `kept_efi_vars`.
    async fn keep_efi_vars(&self, _paths: &VmPaths) -> Result<(), StorageError> {
        Ok(())
    }

    async fn kept_efi_vars(&self) -> Result<Vec<crate::core::efivars::Kept>, StorageError> {
        Ok(self.state().kept_efi_vars.values().cloned().collect())
    }

    async fn remove_kept_efi_vars(&self, id: &str) -> Result<(), StorageError> {
        let dir = PathBuf::from(format!("efi-vars/{id}"));
        if self.call(format!("rmdir {}", dir.display())) {
            return Err(StorageError::Disk {
                path: dir,
                message: injected("rmdir"),
            });
        }
        self.state().kept_efi_vars.remove(id);
        Ok(())
    }

    async fn runtime_dir(&self, dir: &Path) -> crate::host::storage::RuntimeDir {
        use crate::host::storage::RuntimeDir;
        let s = self.state();
        match (s.dirs.contains(dir), s.kept.contains(dir)) {
            (_, true) => RuntimeDir::Kept,
            (true, false) => RuntimeDir::Live,
            (false, false) => RuntimeDir::Absent,
        }
    }

    async fn keep_console_log(&self, paths: &VmPaths) -> Result<(), StorageError> {
        let dir = &paths.runtime_dir;
        if self.call(format!("keep {}", dir.display())) {
            return Err(StorageError::Disk {
                path: dir.clone(),
                message: injected("keep"),
            });
        }
        let mut s = self.state();
        s.kept.insert(dir.clone());
        s.owners.insert(dir.clone(), None);
        Ok(())
    }

    async fn rewrite_seed_iso(
        &self,
        path: &Path,
        seed: &crate::core::convert::seed::Seed,
        _owner: Option<Owner>,
    ) -> Result<(), StorageError> {
        if self.call(format!("reseed {}", path.display())) {
            return Err(StorageError::Disk {
                path: path.to_owned(),
                message: injected("reseed"),
            });
        }
        self.state().reseeded.push((path.to_owned(), seed.clone()));
        Ok(())
    }

    async fn revoke_grants(&self, uid: u32) -> Result<(), StorageError> {
        self.call(format!("revoke {uid}"));
        Ok(())
    }

    async fn create_probe_dirs(&self, owner: Owner) -> Result<(), StorageError> {
        self.call(format!("mkdir probe {}", owner.uid));
        Ok(())
    }

    async fn exists(&self, dir: &Path) -> bool {
        self.state().dirs.contains(dir)
    }

    async fn list_ids(&self) -> Vec<String> {
        let s = self.state();
        let mut ids: Vec<String> = s
            .dirs
            .iter()
            .filter_map(|d| d.file_name()?.to_str().map(str::to_owned))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

impl StatusStore for FakeHost {
    async fn load(&self, key: &VmKey) -> Option<VirtualMachineInstance> {
        self.state().statuses.get(key).cloned()
    }

    async fn save(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        let key = vmi.key().expect("saved VMIs have keys");
        if self.call(format!("save {key}")) {
            return Err(SourceError::Manifest {
                path: "fake".into(),
                message: injected("save"),
            });
        }
        self.state().statuses.insert(key, vmi.clone());
        Ok(())
    }

    async fn hold(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        let key = vmi.key().expect("held VMIs have keys");
        self.call(format!("hold {key}"));
        self.state().held.insert(key);
        Ok(())
    }

    async fn release(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        let key = vmi.key().expect("released VMIs have keys");
        self.call(format!("release {key}"));
        let mut s = self.state();
        s.held.remove(&key);
        s.released.push(key);
        Ok(())
    }

    async fn object(
        &self,
        namespace: &str,
        object: &ObjectRef,
    ) -> Result<Option<ObjectData>, SourceError> {
        if self.call(format!("read {namespace}/{object}")) {
            return Err(SourceError::Object {
                namespace: namespace.into(),
                object: object.clone(),
                message: injected("read"),
            });
        }
        if self.state().closed_namespaces.contains(namespace) {
            return Err(SourceError::NotOptedIn {
                namespace: namespace.into(),
                object: object.clone(),
            });
        }
        let key = (namespace.to_owned(), object.clone());
        Ok(self.state().objects.get(&key).cloned())
    }

    async fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<crate::sources::ClaimObjects, SourceError> {
        self.call(format!("claim {namespace}/{name}"));
        let key = (namespace.to_owned(), name.to_owned());
        Ok(self.state().claims.get(&key).cloned().unwrap_or_default())
    }

    async fn hold_claim(
        &self,
        namespace: &str,
        name: &str,
        user: &crate::core::pvc::User,
    ) -> Result<Result<(), String>, SourceError> {
        self.call(format!("hold claim {namespace}/{name}"));
        let key = (namespace.to_owned(), name.to_owned());
        let mut s = self.state();
        let modes = (s.claims.get(&key))
            .and_then(|c| c.pvc.as_ref()?.spec.as_ref()?.access_modes.clone())
            .unwrap_or_default();
        let users = s.claim_users.entry(key).or_default();
        if let Some(why) = crate::core::pvc::conflict(name, &modes, users, user) {
            return Ok(Err(why));
        }
        users.retain(|u| u.uid != user.uid);
        users.push(user.clone());
        Ok(Ok(()))
    }

    async fn release_claim(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(), SourceError> {
        self.call(format!("release claim {namespace}/{name}"));
        let key = (namespace.to_owned(), name.to_owned());
        if let Some(users) = self.state().claim_users.get_mut(&key) {
            users.retain(|u| u.uid != uid);
        }
        Ok(())
    }

    async fn allowance(
        &self,
        namespace: &str,
    ) -> Result<
        (
            Vec<crate::core::quota::Hard>,
            Vec<crate::core::quota::Claim>,
        ),
        SourceError,
    > {
        if self.call(format!("allowance {namespace}")) {
            return Err(SourceError::Allowance {
                namespace: namespace.into(),
                message: injected("allowance"),
            });
        }
        let s = self.state();
        let bounds = s.quotas.get(namespace).cloned().unwrap_or_default();
        let mut claims = s.other_claims.get(namespace).cloned().unwrap_or_default();
        for (key, vmi) in s
            .statuses
            .iter()
            .filter(|(k, _)| k.namespace() == namespace)
        {
            if let Some(mut c) = crate::core::quota::claim_of(vmi, "") {
                c.admitted = s.held.contains(key);
                claims.push(c);
            }
        }
        Ok((bounds, claims))
    }

    async fn virtual_machine_exists(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<bool, SourceError> {
        let vm = format!("{namespace}/{name} {uid}");
        if self.call(format!("get vm {vm}")) {
            return Err(SourceError::VirtualMachine {
                namespace: namespace.into(),
                name: name.into(),
                message: injected("get vm"),
            });
        }
        Ok(self
            .state()
            .virtual_machines
            .as_ref()
            .is_none_or(|vms| vms.contains(&vm)))
    }
}

impl Recorder for FakeHost {
    fn record(
        &self,
        vmi: &VirtualMachineInstance,
        reason: EventReason,
        message: &str,
        _warning: bool,
    ) {
        let key = vmi.key().expect("recorded VMIs have keys");
        self.state().events.push((key, reason, message.to_owned()));
    }
}

impl crate::host::network::Network for FakeHost {
    async fn setup(
        &self,
        id: &str,
        _vm: crate::host::bridging::VmMeta<'_>,
        pod: Option<&crate::core::convert::network::NetSpec>,
        secondary: &[crate::host::bridging::Attached],
        tap_owner: (u32, u32),
    ) -> Result<(), crate::host::network::NetworkError> {
        self.state().tap_owners.insert(id.into(), tap_owner);
        if self.call(format!("net setup {id}")) {
            return Err(crate::host::network::NetworkError::Vm {
                id: id.into(),
                message: injected("net setup"),
            });
        }
        let mut s = self.state();
        for (i, a) in secondary.iter().enumerate() {
            s.attached
                .entry(id.into())
                .or_default()
                .push(a.list.name.clone());
            // What a bridge plugin with host-local would answer.
            let result = crate::core::cni::CniResult {
                ips: vec![crate::core::cni::ResultIp {
                    address: format!("10.99.{i}.10/24"),
                    gateway: None,
                    interface: None,
                }],
                ..Default::default()
            };
            s.cni_results
                .entry(id.into())
                .or_default()
                .push((a.secondary.links.pod_iface.clone(), result));
        }
        if pod.is_some() {
            let next = std::net::Ipv4Addr::new(10, 213, 0, 2 + s.addresses.len() as u8);
            s.addresses.entry(id.into()).or_insert(next);
            s.dhcp.insert(id.into());
        }
        Ok(())
    }

    async fn attach(
        &self,
        id: &str,
        _pod: Option<&crate::core::convert::network::NetSpec>,
        _secondary: &[crate::core::convert::network::Secondary],
    ) -> Result<(), crate::host::network::NetworkError> {
        if self.state().dhcp.insert(id.into()) {
            self.call(format!("net attach {id}"));
        }
        Ok(())
    }

    async fn teardown(&self, id: &str) -> Result<(), crate::host::network::NetworkError> {
        self.call(format!("net teardown {id}"));
        let mut s = self.state();
        s.addresses.remove(id);
        s.attached.remove(id);
        s.cni_results.remove(id);
        s.dhcp.remove(id);
        Ok(())
    }

    fn attachments(&self, id: &str) -> Vec<(String, crate::core::cni::CniResult)> {
        self.state()
            .cni_results
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    fn holds(&self, id: &str) -> bool {
        let s = self.state();
        s.addresses.contains_key(id) || s.attached.contains_key(id)
    }

    fn named_config(&self, name: &str) -> Option<String> {
        self.state().cni_files.get(name).cloned()
    }

    fn address(&self, id: &str) -> Option<std::net::Ipv4Addr> {
        self.state().addresses.get(id).copied()
    }

    fn address6(&self, id: &str) -> Option<std::net::Ipv6Addr> {
        let s = self.state();
        let v4 = s.addresses.get(id).filter(|_| s.dual_stack)?;
        let last = u16::from(v4.octets()[3]);
        Some(std::net::Ipv6Addr::new(0xfd00, 0x6b76, 0, 0, 0, 0, 0, last))
    }

    fn ids(&self) -> Vec<String> {
        let s = self.state();
        let mut ids: Vec<String> = s
            .addresses
            .keys()
            .chain(s.attached.keys())
            .cloned()
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

/// Identities from 100000 up, one per VM, never reused while held.
impl VmUsers for FakeHost {
    async fn acquire(&self, id: &str, _vm: &str) -> Result<u32, IdentityStoreError> {
        if self.call(format!("identity {id}")) {
            return Err(IdentityStoreError::Missing);
        }
        let mut s = self.state();
        if let Some(uid) = s.identities.get(id) {
            return Ok(*uid);
        }
        let uid = 100_000 + s.next_identity;
        s.next_identity += 1;
        s.identities.insert(id.into(), uid);
        Ok(uid)
    }

    async fn release(&self, id: &str) -> Result<(), IdentityStoreError> {
        self.call(format!("identity release {id}"));
        self.state().identities.remove(id);
        Ok(())
    }

    fn uid_of(&self, id: &str) -> Option<u32> {
        self.state().identities.get(id).copied()
    }

    fn ids(&self) -> Vec<String> {
        self.state().identities.keys().cloned().collect()
    }
}

impl crate::host::marks::Records<crate::core::migration::Mark> for FakeHost {
    fn get(
        &self,
        id: &str,
    ) -> Result<Option<crate::core::migration::Mark>, crate::host::marks::MarkError> {
        Ok(self.state().marks.get(id).cloned())
    }

    fn set(
        &self,
        id: &str,
        mark: &crate::core::migration::Mark,
    ) -> Result<(), crate::host::marks::MarkError> {
        let _ = self.call(format!("mark {id} {:?}", mark.role));
        self.state().marks.insert(id.into(), mark.clone());
        Ok(())
    }

    fn clear(&self, id: &str) -> Result<(), crate::host::marks::MarkError> {
        let _ = self.call(format!("clear mark {id}"));
        self.state().marks.remove(id);
        Ok(())
    }

    fn all(&self) -> Vec<(String, crate::core::migration::Mark)> {
        self.state().marks.clone().into_iter().collect()
    }
}

impl crate::host::marks::Records<crate::core::fence::Fenced> for FakeHost {
    fn get(
        &self,
        id: &str,
    ) -> Result<Option<crate::core::fence::Fenced>, crate::host::marks::MarkError> {
        Ok(self.state().fences.get(id).cloned())
    }

    fn set(
        &self,
        id: &str,
        record: &crate::core::fence::Fenced,
    ) -> Result<(), crate::host::marks::MarkError> {
        let _ = self.call(format!("fenced {id}"));
        self.state().fences.insert(id.into(), record.clone());
        Ok(())
    }

    fn clear(&self, id: &str) -> Result<(), crate::host::marks::MarkError> {
        let _ = self.call(format!("clear fenced {id}"));
        self.state().fences.remove(id);
        Ok(())
    }

    fn all(&self) -> Vec<(String, crate::core::fence::Fenced)> {
        self.state().fences.clone().into_iter().collect()
    }
}
