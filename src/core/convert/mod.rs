//! VMI → libvirt domain XML, as a pure function.
//!
//! One small configurator per area (CPU, memory, firmware, features, clock,
//! disks, other devices), in the spirit of KubeVirt's virt-launcher
//! converter. The converter does no I/O: files the runtime has to create or
//! check before defining the domain are returned as [`DiskPrep`]s.
//!
//! Anything in the VMI that kvirt does not implement is an error naming the
//! field, never silently ignored: every spec type keeps unknown fields in an
//! `extra` map, and each configurator rejects what it finds there. The only
//! exceptions are the scheduling-only fields in [`IGNORED_SPEC_FIELDS`],
//! `ephemeral-storage` resources, and `hostDisk.shared` (a migration hint).
//! `metadata` labels and annotations are not interpreted.

mod clock;
pub mod cloudinit;
pub mod configdisk;
mod cpu;
pub use cpu::dedicated_cpus_wanted;
mod devices;
mod disks;
pub mod domain;
mod downwardapi;
mod features;
mod firmware;
pub mod kernelboot;
mod memory;
pub mod network;
pub mod seed;

use crate::core::key::VmKey;
use crate::core::layout::{VmPaths, MAX_SOCKET_PATH};
use crate::core::vmi::{Extra, VirtualMachineInstance};
use std::fmt;
use std::path::PathBuf;

/// Top-level `spec` fields accepted without effect on the domain. They
/// steer scheduling or live migration on a cluster, which a single host
/// without pods has no use for. `hostname`/`subdomain` reach the guest
/// through DHCP (`network::guest_names`); `architecture` is handled
/// separately (only `amd64` is accepted).
pub const IGNORED_SPEC_FIELDS: &[&str] = &[
    "affinity",
    "tolerations",
    "topologySpreadConstraints",
    "schedulerName",
    "priorityClassName",
    "evictionStrategy",
];

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DomainType {
    /// Hardware virtualisation through `/dev/kvm`.
    #[default]
    Kvm,
    /// TCG emulation, for hosts (and test containers) without KVM.
    Qemu,
}

impl DomainType {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvm => "kvm",
            Self::Qemu => "qemu",
        }
    }
}

/// Which hostDisk roots a VMI may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostDiskRoots {
    /// Standalone: every VMI is the host's own, and may use all of these.
    Host(Vec<PathBuf>),
    /// In a cluster a namespace is a tenant: it may use only the roots
    /// granted to it (none by default), so no tenant reaches another's
    /// disks, as KubeVirt keeps hostDisk behind a feature gate.
    Namespaces(std::collections::BTreeMap<String, Vec<PathBuf>>),
}

impl HostDiskRoots {
    /// Every root of every namespace: what a VM's unit hides (but its own
    /// disks).
    pub fn all(&self) -> Vec<PathBuf> {
        let mut all: Vec<PathBuf> = match self {
            Self::Host(roots) => roots.clone(),
            Self::Namespaces(by_ns) => by_ns.values().flatten().cloned().collect(),
        };
        all.sort();
        all.dedup();
        all
    }

    /// The roots a VMI of `namespace` may use.
    pub fn of(&self, namespace: &str) -> &[PathBuf] {
        match self {
            Self::Host(roots) => roots,
            Self::Namespaces(by_ns) => by_ns.get(namespace).map_or(&[], Vec::as_slice),
        }
    }
}

pub struct ConvertContext<'a> {
    pub key: &'a VmKey,
    pub paths: &'a VmPaths,
    pub domain_type: DomainType,
    /// hostDisk paths must lie under one of these (lexically; the runtime
    /// re-checks the real path).
    pub host_disk_roots: &'a [PathBuf],
    /// Storage every kvirt host reaches at the same path
    /// (`storage.shared_roots`): what may stay put when the VM migrates.
    pub shared_roots: &'a [PathBuf],
    /// Whether the VMI comes from a cluster, whose Secrets, ConfigMaps and
    /// ServiceAccounts its volumes may name.
    pub cluster: bool,
    /// What the host has: a VM asking for more is refused up front, as
    /// kubelet refuses a pod that cannot fit. `None`: not checked.
    pub capacity: Option<HostCapacity>,
    /// What the host allows one VM, whatever it has.
    pub limits: Limits,
    /// The claims its `persistentVolumeClaim` and `dataVolume` volumes name.
    pub claims: &'a Claims,
    /// The host CPUs placed for a VMI with `dedicatedCpuPlacement` (as many
    /// as [`dedicated_cpus_wanted`] says).
    pub dedicated_cpus: Option<&'a crate::core::cpuset::CpuSet>,
}

/// The claims a conversion knows, by claim name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Claims {
    pub by_name: std::collections::BTreeMap<String, crate::core::pvc::Pvc>,
    /// All there are: a claim not here is refused. Otherwise (a cluster's
    /// claims, read only for a start) a claim not here is not looked up
    /// in this pass, and its disk only stands in.
    pub complete: bool,
    /// The share of a filesystem claim kept for its file system.
    pub filesystem_overhead: f64,
}

/// No claims known, none refused: for conversions that never start a VM.
pub static NO_CLAIMS: Claims = Claims {
    by_name: std::collections::BTreeMap::new(),
    complete: false,
    filesystem_overhead: crate::core::pvc::DEFAULT_FILESYSTEM_OVERHEAD,
};

impl Claims {
    /// Claims read from the cluster for one start, or configured.
    pub fn known(
        by_name: std::collections::BTreeMap<String, crate::core::pvc::Pvc>,
        overhead: f64,
    ) -> Self {
        Self {
            by_name,
            complete: true,
            filesystem_overhead: overhead,
        }
    }
}

/// What the host allows one VM (`[vm]` settings): a VMI asking for more is
/// refused with both figures, before anything is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The longest `terminationGracePeriodSeconds` accepted.
    pub max_grace_seconds: u64,
    /// The most the VM's own writable disks (emptyDisks, DiskOrCreate
    /// hostDisks) may grow to, together.
    pub max_disk_bytes: u64,
}

impl Limits {
    pub const DEFAULT_MAX_GRACE_SECONDS: u64 = 86_400;
    pub const DEFAULT_MAX_DISK_BYTES: u64 = 1 << 40;
    /// No limit: for a VM that was admitted and runs.
    pub const NONE: Limits = Limits {
        max_grace_seconds: u64::MAX,
        max_disk_bytes: u64::MAX,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_grace_seconds: Self::DEFAULT_MAX_GRACE_SECONDS,
            max_disk_bytes: Self::DEFAULT_MAX_DISK_BYTES,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostCapacity {
    pub memory_bytes: u64,
    pub cpus: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Converted {
    pub domain_xml: String,
    /// What `domain_xml` was made from, for [`Converted::domain_xml_with_macs`].
    domain: domain::Domain,
    /// Files the runtime must create or check before defining the domain.
    pub disks: Vec<DiskPrep>,
    /// The pod interface, when the VM has one.
    pub network: Option<network::NetSpec>,
    /// Its secondary networks' interfaces, in the VMI's order.
    pub secondary_networks: Vec<network::Secondary>,
    pub resources: Resources,
    /// `startStrategy: Paused`: the domain starts with its vCPUs stopped.
    pub start_paused: bool,
    /// `status.volumeStatus`: each disk's volume and target, with a
    /// claim's `persistentVolumeClaimInfo` when its claim was read.
    pub volume_status: Vec<serde_json::Value>,
    /// Whether the VM could migrate (its `LiveMigratable` condition).
    pub migratable: crate::core::migration::Migratable,
    /// Some disk of it is on storage other hosts reach: a self-fence
    /// stops it ([`crate::core::fence`]).
    pub shared_disks: bool,
}

impl Converted {
    /// The domain XML with the given guest MACs (by interface name) in
    /// place of the converted ones: a secondary interface without a spec
    /// MAC takes its plugins' once they have run (KubeVirt's bridge
    /// binding), known only after the conversion.
    pub fn domain_xml_with_macs(
        &self,
        macs: &[(String, [u8; 6])],
    ) -> Result<String, quick_xml::SeError> {
        let mut domain = self.domain.clone();
        let mut changed = false;
        for iface in &mut domain.devices.interfaces {
            let Some(name) = iface.alias.name.strip_prefix("ua-") else {
                continue;
            };
            if let Some((_, mac)) = macs.iter().find(|(n, _)| n == name) {
                let address = network::format_mac(mac);
                changed |= iface.mac.address != address;
                iface.mac.address = address;
            }
        }
        if changed {
            domain.to_xml()
        } else {
            Ok(self.domain_xml.clone())
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiskPrep {
    /// emptyDisk: a qcow2 of this virtual size in the VM's state dir.
    CreateQcow2 {
        volume: String,
        path: PathBuf,
        size_bytes: u64,
    },
    /// hostDisk DiskOrCreate: a sparse raw file of `capacity` if missing.
    CreateRawIfMissing {
        volume: String,
        path: PathBuf,
        size_bytes: u64,
    },
    /// hostDisk Disk: must exist (the runtime checks, and re-checks the
    /// real path under the roots).
    RequireExisting { volume: String, path: PathBuf },
    /// cloudInitNoCloud/ConfigDrive and configMap/secret/serviceAccount
    /// volumes: an ISO of these files, remade on every start (the VMI and
    /// its objects are the truth, the image only a copy of them).
    SeedIso {
        volume: String,
        path: PathBuf,
        seed: seed::Seed,
    },
    /// containerDisk / ephemeral: a fresh qcow2 overlay on a read-only
    /// base, made on every start (KubeVirt's ephemeral write layer).
    Overlay {
        volume: String,
        path: PathBuf,
        backing: Backing,
    },
    /// `efi.persistent`: the variables kept from this VM's last run (by
    /// the same `owner`) are put back at `nvram` before it starts, and kept
    /// again when it goes.
    EfiVars {
        owner: String,
        nvram: PathBuf,
        kept_dir: PathBuf,
    },
    /// `tpm.persistent`: the TPM's state a VM left (its owner's, as for EFI
    /// variables, and in the same kept directory) is put back at `state`
    /// (where the VM's libvirt runs swtpm on it) before it starts, and kept
    /// again when it goes.
    TpmState {
        owner: String,
        state: PathBuf,
        kept_dir: PathBuf,
    },
    /// `memory.hugepages`: the VM's own directory on the host's hugetlbfs
    /// of that page size, which its libvirt is told to use in `qemu_conf`;
    /// the runtime checks first that enough pages are free.
    Hugepages {
        vm: String,
        page_bytes: u64,
        pages: u64,
        qemu_conf: PathBuf,
    },
    /// A filesystem claim's `disk.img`, below the claim root `root`:
    /// made sparse of `size_bytes` if missing and grown to it if smaller
    /// (`None`: read-only, it must exist and is never changed).
    Claim {
        volume: String,
        root: PathBuf,
        path: PathBuf,
        size_bytes: Option<u64>,
    },
    /// A block claim: a node of the host's `device` made at `node`, in the
    /// VM's own state directory, for the VM alone.
    ClaimDevice {
        volume: String,
        device: PathBuf,
        node: PathBuf,
        read_only: bool,
    },
    /// `kernelBoot`: files of an image copied into the VM's directory.
    KernelBoot {
        image: String,
        pull_policy: crate::core::image::PullPolicy,
        pull_secret: Option<String>,
        kernel: Option<ImageFile>,
        initrd: Option<ImageFile>,
    },
}

/// A file in a container image and where the VM gets its copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageFile {
    pub path_in_image: String,
    pub dest: PathBuf,
}

/// One file the runtime must find in a pulled image: `key` names it in
/// the map of pulled files (a volume name, or `kernelboot::KERNEL`...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageNeed<'a> {
    pub key: &'a str,
    pub image: &'a str,
    pub pull_policy: crate::core::image::PullPolicy,
    /// The Secret with the registry's credentials (cluster mode).
    pub pull_secret: Option<&'a str>,
    pub path: Option<&'a str>,
}

impl DiskPrep {
    /// The files this prep needs from container images.
    pub fn image_needs(&self) -> Vec<ImageNeed<'_>> {
        match self {
            DiskPrep::Overlay {
                volume,
                backing:
                    Backing::Image {
                        image,
                        pull_policy,
                        pull_secret,
                        path,
                    },
                ..
            } => vec![ImageNeed {
                key: volume,
                image,
                pull_policy: *pull_policy,
                pull_secret: pull_secret.as_deref(),
                path: path.as_deref(),
            }],
            DiskPrep::KernelBoot {
                image,
                pull_policy,
                pull_secret,
                kernel,
                initrd,
            } => [(kernelboot::KERNEL, kernel), (kernelboot::INITRD, initrd)]
                .into_iter()
                .filter_map(|(key, f)| {
                    Some(ImageNeed {
                        key,
                        image,
                        pull_policy: *pull_policy,
                        pull_secret: pull_secret.as_deref(),
                        path: Some(f.as_ref()?.path_in_image.as_str()),
                    })
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What the fake host and logs call it.
    pub fn path(&self) -> &std::path::Path {
        match self {
            DiskPrep::CreateQcow2 { path, .. }
            | DiskPrep::CreateRawIfMissing { path, .. }
            | DiskPrep::RequireExisting { path, .. }
            | DiskPrep::SeedIso { path, .. }
            | DiskPrep::Overlay { path, .. }
            | DiskPrep::Claim { path, .. } => path,
            DiskPrep::ClaimDevice { node, .. } => node,
            DiskPrep::Hugepages { qemu_conf, .. } => qemu_conf,
            DiskPrep::EfiVars { nvram, .. } => nvram,
            DiskPrep::TpmState { state, .. } => state,
            DiskPrep::KernelBoot { kernel, initrd, .. } => kernel
                .as_ref()
                .or(initrd.as_ref())
                .map_or(std::path::Path::new(""), |f| &f.dest),
        }
    }
}

/// What an overlay is laid over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A containerDisk: the disk inside the image, found after the pull.
    Image {
        image: String,
        pull_policy: crate::core::image::PullPolicy,
        pull_secret: Option<String>,
        path: Option<String>,
    },
    /// `ephemeral.hostDisk`: an existing file, only read.
    HostDisk(PathBuf),
}

/// What the systemd unit needs to size the VM's cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resources {
    /// Guest RAM, without QEMU's overhead.
    pub memory_bytes: u64,
    pub vcpus: u32,
    /// `resources.limits.memory`, if set.
    pub memory_limit_bytes: Option<u64>,
    /// `resources.requests.cpu` (defaulting to `limits.cpu`, as Kubernetes does).
    pub cpu_request_millis: Option<u64>,
    /// `resources.limits.cpu`: a hard quota on the VM's unit, as a pod's
    /// CPU limit is a CFS quota on its cgroup.
    pub cpu_limit_millis: Option<u64>,
    /// Guest RAM backed by hugepages, which the kernel charges to the hugetlb
    /// controller, never to the memory cgroup.
    pub hugepage_bytes: u64,
    /// The host CPUs it holds alone (`dedicatedCpuPlacement`): its unit's
    /// `AllowedCPUs`. `None`: it shares those no VM holds.
    pub dedicated_cpus: Option<crate::core::cpuset::CpuSet>,
}

impl Resources {
    /// What the memory cgroup of the VM's unit will see of the guest: its
    /// limit (or guest RAM), less what hugepages back. QEMU's overhead is the
    /// caller's to add.
    pub fn cgroup_memory_bytes(&self) -> u64 {
        self.memory_limit_bytes
            .unwrap_or(self.memory_bytes)
            .saturating_sub(self.hugepage_bytes)
    }
}

/// A persistent TPM's state is kept for the VM's next run. (swtpm's
/// socket is among those `check_identity` fits to the path limit.)
fn tpm_state(
    vmi: &VirtualMachineInstance,
    ctx: &ConvertContext,
    t: &crate::core::vmi::Tpm,
    uuid: &str,
) -> Option<DiskPrep> {
    (t.enabled != Some(false) && t.persistent == Some(true)).then(|| DiskPrep::TpmState {
        owner: crate::core::efivars::Owner::of(vmi, ctx.key).to_string(),
        state: ctx.paths.tpm_state(uuid),
        kept_dir: ctx.paths.efi_vars_dir.clone(),
    })
}

/// One problem with a VMI, located by its field path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConvertError {
    /// e.g. `spec.domain.devices.disks[1].lun`
    pub field: String,
    pub message: String,
}

/// Converts, or returns the first problem found.
pub fn convert(
    vmi: &VirtualMachineInstance,
    ctx: &ConvertContext,
) -> Result<Converted, ConvertError> {
    convert_all_errors(vmi, ctx).map_err(|errs| {
        errs.into_iter()
            .next()
            .expect("a failed conversion has at least one error")
    })
}

/// Converts, or returns every problem found (for `kvirtctl domxml`).
/// The VMI is first given KubeVirt's defaults ([`defaults`]), so it means
/// what it would on a KubeVirt cluster.
///
/// [`defaults`]: crate::core::defaults
pub fn convert_all_errors(
    vmi: &VirtualMachineInstance,
    ctx: &ConvertContext,
) -> Result<Converted, Vec<ConvertError>> {
    let mut vmi = vmi.clone();
    crate::core::defaults::apply(&mut vmi, ctx.key, ctx.domain_type);
    let vmi = &vmi;
    let mut errs = Errors::default();
    check_identity(vmi, ctx, &mut errs);
    check_spec_fields(&vmi.spec.extra, &mut errs);
    check_annotations(vmi, &mut errs);

    let spec = &vmi.spec;
    let dom = &spec.domain;
    errs.reject_extra("spec.domain", &dom.extra);
    let res = memory::ResourceSpec::parse(dom.resources.as_ref(), &mut errs);
    let memory_bytes = memory::guest_memory(dom.memory.as_ref(), &res, &mut errs);
    let hugepage = memory::hugepage_size(dom.memory.as_ref(), memory_bytes, &mut errs);
    let (cpu, vcpus) = cpu::convert(dom.cpu.as_ref(), &res, ctx.domain_type, &mut errs);
    let cputune = cpu::pinning(dom.cpu.as_ref(), &res, vcpus, ctx.dedicated_cpus, &mut errs);
    if let Some(cap) = ctx.capacity {
        check_fits(memory_bytes, vcpus, cap, &mut errs);
    }
    check_grace(spec.termination_grace_period_seconds, ctx.limits, &mut errs);
    let (uuid, os, sysinfo, needs) = firmware::convert(vmi, ctx.key, dom, &mut errs);
    let features = features::convert(dom.features.as_ref(), needs, ctx.domain_type, &mut errs);
    let clock = clock::convert(dom.clock.as_ref(), &mut errs);
    let (disk_devs, controllers, mut preps) =
        disks::convert(spec, &vmi.metadata, ctx, &uuid, &mut errs);
    let volume_status = disks::volume_status(spec, &disk_devs, ctx.claims);
    if needs.persistent_efi {
        preps.push(DiskPrep::EfiVars {
            owner: crate::core::efivars::Owner::of(vmi, ctx.key).to_string(),
            nvram: ctx.paths.nvram(),
            kept_dir: ctx.paths.efi_vars_dir.clone(),
        });
    }
    if let Some(t) = spec.domain.devices.tpm.as_ref() {
        preps.extend(tpm_state(vmi, ctx, t, &uuid));
    }
    if let Some(page_bytes) = hugepage {
        preps.push(DiskPrep::Hugepages {
            vm: ctx.key.id(),
            page_bytes,
            pages: memory_bytes / page_bytes,
            qemu_conf: ctx.paths.qemu_conf(),
        });
    }
    let mut os = os;
    if let Some(kb) = dom.firmware.as_ref().and_then(|f| f.kernel_boot.as_ref()) {
        preps.extend(kernelboot::convert(
            kb,
            ctx.paths,
            ctx.cluster,
            &mut os,
            &mut errs,
        ));
    }
    let mut devices = devices::convert(spec, ctx.paths, &mut errs);
    devices.disks = disk_devs;
    devices.controllers = controllers;
    let default_mac = network::guest_mac(&ctx.key.id());
    let (hostname, domain_search) =
        network::guest_names(&spec.extra, ctx.key.name(), ctx.key.namespace(), &mut errs);
    let (ifaces, mut nets) = network::convert(
        spec,
        ctx.key.namespace(),
        &ctx.key.id(),
        default_mac,
        &mut errs,
    );
    if let Some(net) = nets.pod.as_mut() {
        net.hostname = hostname;
        net.domain_search = domain_search;
    }
    for (i, iface) in ifaces.iter().enumerate() {
        if let Some(b) = &iface.boot {
            if devices.disks.iter().any(|d| d.boot.as_ref() == Some(b)) {
                errs.add(
                    format!("spec.domain.devices.interfaces[{i}].bootOrder"),
                    format!("{} is used by a disk", b.order),
                );
            }
        }
    }
    devices.interfaces = ifaces;

    if !errs.0.is_empty() {
        return Err(errs.0);
    }
    let domain = domain::Domain {
        type_: ctx.domain_type.as_str(),
        name: ctx.key.domain_name(),
        uuid,
        metadata: domain::Metadata {
            vm: domain::KvirtMetadata {
                xmlns: domain::KVIRT_XMLNS,
                uid: vmi.uid().map(str::to_owned),
                namespace: ctx.key.namespace().to_owned(),
                name: ctx.key.name().to_owned(),
            },
        },
        memory: domain::Memory {
            unit: "b",
            value: memory_bytes,
        },
        memory_backing: hugepage.map(|page| domain::MemoryBacking {
            hugepages: domain::HugepagePages {
                page: domain::HugepageSize {
                    size: page >> 10,
                    unit: "KiB",
                },
            },
        }),
        vcpu: domain::Vcpu {
            placement: "static",
            count: vcpus,
        },
        cputune: cputune.clone(),
        sysinfo,
        os,
        features,
        cpu,
        clock,
        on_poweroff: "destroy",
        on_reboot: "restart",
        on_crash: "destroy",
        devices,
    };
    let domain_xml = domain.to_xml().map_err(|e| {
        vec![ConvertError {
            field: "spec".into(),
            message: format!("cannot serialise the domain XML: {e}"),
        }]
    })?;
    let shared = crate::core::migration::SharedStorage::new(ctx.shared_roots, ctx.claims);
    Ok(Converted {
        domain_xml,
        domain,
        volume_status,
        migratable: crate::core::migration::migratable(spec, &shared),
        shared_disks: crate::core::migration::on_shared_storage(spec, ctx.shared_roots, ctx.claims),
        disks: preps,
        network: nets.pod,
        secondary_networks: nets.secondary,
        start_paused: spec.extra.get("startStrategy").and_then(|s| s.as_str()) == Some("Paused"),
        resources: Resources {
            memory_bytes,
            vcpus,
            memory_limit_bytes: res.memory_limit,
            cpu_request_millis: res.cpu_request.or(res.cpu_limit),
            cpu_limit_millis: res.cpu_limit,
            hugepage_bytes: if hugepage.is_some() { memory_bytes } else { 0 },
            dedicated_cpus: cputune.and(ctx.dedicated_cpus.cloned()),
        },
    })
}

/// The caller derives the key from the VMI; a mismatch would define the
/// domain under another VM's name.
fn check_identity(vmi: &VirtualMachineInstance, ctx: &ConvertContext, errs: &mut Errors) {
    match vmi.key() {
        Ok(key) if &key == ctx.key => {
            let longest = ctx.paths.longest_socket_path(&key.domain_name());
            if longest > MAX_SOCKET_PATH {
                let id = key.id();
                let fits = id.len().saturating_sub(longest - MAX_SOCKET_PATH);
                errs.add(
                    "metadata.name",
                    format!(
                        "{key} is too long for kvirt: the VM's sockets under {} would be {longest} bytes, past the {MAX_SOCKET_PATH} a Unix socket path may have; namespace and name may have {} characters together",
                        ctx.paths.state_dir.display(),
                        fits.saturating_sub(1),
                    ),
                )
            }
        }
        Ok(key) => errs.add(
            "metadata",
            format!("VMI is {key}, but the conversion is for {}", ctx.key),
        ),
        Err(e) => errs.add("metadata.name", e.to_string()),
    }
}

fn check_fits(memory_bytes: u64, vcpus: u32, cap: HostCapacity, errs: &mut Errors) {
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    if memory_bytes > cap.memory_bytes {
        errs.add(
            "spec.domain.memory",
            format!(
                "{} of guest memory does not fit this host's {}",
                gib(memory_bytes),
                gib(cap.memory_bytes)
            ),
        );
    }
    if vcpus > cap.cpus {
        errs.add(
            "spec.domain.cpu",
            format!("{vcpus} vCPUs do not fit this host's {} CPUs", cap.cpus),
        );
    }
}

/// A grace period longer than the host allows would hold a deleted VM (and
/// its resources) for that long; a negative one means nothing.
fn check_grace(seconds: Option<i64>, limits: Limits, errs: &mut Errors) {
    let field = "spec.terminationGracePeriodSeconds";
    match seconds {
        Some(s) if s < 0 => errs.add(field, format!("{s} is negative")),
        Some(s) if s.unsigned_abs() > limits.max_grace_seconds => errs.add(
            field,
            format!(
                "{s} s is longer than this host allows ({} s, vm.max_grace_period_seconds)",
                limits.max_grace_seconds
            ),
        ),
        _ => {}
    }
}

fn check_spec_fields(extra: &Extra, errs: &mut Errors) {
    for (k, v) in extra {
        // hostname and subdomain are read by `network::guest_names`.
        if IGNORED_SPEC_FIELDS.contains(&k.as_str()) || k == "hostname" || k == "subdomain" {
            continue;
        }
        if k == "startStrategy" {
            if v.as_str() != Some("Paused") {
                errs.add(
                    "spec.startStrategy",
                    format!("only Paused is a start strategy, not {v}"),
                );
            }
            continue;
        }
        if k == "architecture" {
            if v.as_str() != Some("amd64") {
                errs.add(
                    "spec.architecture",
                    format!("only amd64 is supported, not {v}"),
                );
            }
            continue;
        }
        errs.add(format!("spec.{k}"), UNSUPPORTED);
    }
}

/// Annotations that change what KubeVirt runs for a VMI (extra
/// containers, a different launcher, config handed to the guest by
/// QEMU's firmware config): kvirt runs none of that, so it refuses them.
pub const REFUSED_ANNOTATIONS: &[&str] = &[
    "hooks.kubevirt.io/hookSidecars",
    "kubevirt.io/ignitiondata",
    "kubevirt.io/keep-launcher-alive-after-failure",
];

fn check_annotations(vmi: &VirtualMachineInstance, errs: &mut Errors) {
    let Some(annotations) = &vmi.metadata.annotations else {
        return;
    };
    for a in annotations.keys() {
        if REFUSED_ANNOTATIONS.contains(&a.as_str()) || a.starts_with("hooks.kubevirt.io/") {
            errs.add(format!("metadata.annotations[{a}]"), UNSUPPORTED);
        }
    }
}

const UNSUPPORTED: &str = "not supported by kvirt";

/// Why a cluster object cannot be used in standalone mode.
const NEEDS_CLUSTER: &str =
    "needs a cluster: kvirtd reads this VMI from a manifest directory, which has no Secrets, ConfigMaps or ServiceAccounts";

/// Collects every problem so a user can fix a manifest in one pass.
#[derive(Debug, Default)]
pub(crate) struct Errors(Vec<ConvertError>);

impl Errors {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn add(&mut self, field: impl Into<String>, message: impl fmt::Display) {
        self.0.push(ConvertError {
            field: field.into(),
            message: message.to_string(),
        });
    }

    /// Every unknown field of an object is an error: it would change the VM
    /// on a real KubeVirt, so running without it would be a lie.
    fn reject_extra(&mut self, path: &str, extra: &Extra) {
        for k in extra.keys() {
            self.add(format!("{path}.{k}"), UNSUPPORTED);
        }
    }
}

// Volume and disk names become file names and device aliases, so they must
// not carry anything else than a DNS label's characters.
use crate::core::key::{is_dns_label, is_dns_subdomain};

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use crate::core::cpuset::CpuSet;
    use crate::core::layout::HostLayout;

    pub fn vmi(spec_yaml: &str) -> VirtualMachineInstance {
        let indented: String = spec_yaml.lines().map(|l| format!("  {l}\n")).collect();
        VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\n\
             metadata: {{name: vm, namespace: ns, uid: 0f2d3a9c-1111-4222-8333-444455556666}}\n\
             spec:\n{indented}"
        ))
        .unwrap()
    }

    /// Dedicated CPUs, when asked for, are the host's first ones.
    pub fn run(
        vmi: &VirtualMachineInstance,
        domain_type: DomainType,
    ) -> Result<Converted, Vec<ConvertError>> {
        let first: Option<CpuSet> = dedicated_cpus_wanted(vmi).map(|n| (0..n).collect());
        run_placed(vmi, domain_type, first.as_ref())
    }

    pub fn run_placed(
        vmi: &VirtualMachineInstance,
        domain_type: DomainType,
        dedicated_cpus: Option<&CpuSet>,
    ) -> Result<Converted, Vec<ConvertError>> {
        let key = VmKey::new("ns", "vm").unwrap();
        let paths = HostLayout::default().vm(&key);
        let roots = [PathBuf::from("/srv/vms")];
        convert_all_errors(
            vmi,
            &ConvertContext {
                key: &key,
                paths: &paths,
                domain_type,
                host_disk_roots: &roots,
                shared_roots: &[],
                cluster: false,
                capacity: Some(HostCapacity {
                    memory_bytes: 64 << 30,
                    cpus: 64,
                }),
                limits: Limits::default(),
                claims: &NO_CLAIMS,
                dedicated_cpus,
            },
        )
    }

    pub const MEM: &str = "domain: {memory: {guest: 64Mi}}";

    /// The fields of all errors, for compact assertions.
    pub fn fields(r: Result<Converted, Vec<ConvertError>>) -> Vec<String> {
        r.expect_err("expected errors")
            .into_iter()
            .map(|e| e.field)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    #[test]
    fn a_vm_larger_than_the_host_is_refused_with_the_figures() {
        let big = vmi("domain: {memory: {guest: 1Ti}, cpu: {cores: 128}}");
        let errs = run(&big, DomainType::Kvm).expect_err("it does not fit");
        let text: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        assert!(
            text.iter()
                .any(|e| e.contains("1024.0 GiB of guest memory does not fit this host's 64.0 GiB")),
            "{text:?}"
        );
        assert!(
            text.iter()
                .any(|e| e.contains("128 vCPUs do not fit this host's 64 CPUs")),
            "{text:?}"
        );
    }

    #[test]
    fn a_grace_period_longer_than_the_host_allows_is_refused() {
        let grace = |s: &str| vmi(&format!("terminationGracePeriodSeconds: {s}\n{MEM}"));
        assert!(run(&grace("86400"), DomainType::Kvm).is_ok());
        let e = run(&grace("9223372036854775807"), DomainType::Kvm)
            .expect_err("the longest i64")
            .remove(0)
            .to_string();
        assert!(
            e.starts_with("spec.terminationGracePeriodSeconds:")
                && e.contains("9223372036854775807 s is longer than this host allows (86400 s"),
            "{e}"
        );
        assert_eq!(
            fields(run(&grace("-1"), DomainType::Kvm)),
            ["spec.terminationGracePeriodSeconds"]
        );
    }

    /// A context with no disk roots, claims, capacity or CPUs.
    fn bare<'a>(key: &'a VmKey, paths: &'a VmPaths, domain_type: DomainType) -> ConvertContext<'a> {
        ConvertContext {
            key,
            paths,
            domain_type,
            host_disk_roots: &[],
            shared_roots: &[],
            cluster: false,
            capacity: None,
            limits: Limits::default(),
            claims: &NO_CLAIMS,
            dedicated_cpus: None,
        }
    }

    #[test]
    fn a_vm_whose_sockets_cannot_fit_is_refused_with_the_limit() {
        // Every Kubernetes name fits the default layout (`key::MAX_ID_LEN`);
        // a runtime directory configured longer leaves less room, and a
        // VM that cannot fit is refused up front with the figures.
        let layout = crate::core::layout::HostLayout {
            runtime_dir: format!("/run/{}", "r".repeat(50)).into(),
            ..Default::default()
        };
        let key = VmKey::new("ns", "vm").unwrap();
        let paths = layout.vm(&key);
        let errs = convert_all_errors(&vmi(MEM), &bare(&key, &paths, DomainType::Kvm))
            .expect_err("too long");
        let e = errs[0].to_string();
        assert!(e.starts_with("metadata.name:"), "{e}");
        assert!(
            e.contains("past the 107 a Unix socket path may have"),
            "{e}"
        );
    }

    #[test]
    fn a_tpm_runs_with_the_longest_names() {
        // swtpm's socket is under the unit's short alias of the runtime
        // directory: the longest names Kubernetes allows fit.
        let (ns, name) = ("n".repeat(63), "v".repeat(63));
        let key = VmKey::new(&ns, &name).unwrap();
        let paths = crate::core::layout::HostLayout::default().vm(&key);
        let mut v = vmi("domain: {memory: {guest: 64Mi}, devices: {tpm: {}}}");
        v.metadata.namespace = Some(ns.clone());
        v.metadata.name = Some(name.clone());
        assert!(convert_all_errors(&v, &bare(&key, &paths, DomainType::Qemu)).is_ok());
        assert!(paths.longest_socket_path(&key.domain_name()) <= MAX_SOCKET_PATH);
    }

    #[test]
    fn minimal_defaults() {
        let c = run(&vmi(MEM), DomainType::Kvm).unwrap();
        let x = &c.domain_xml;
        assert!(x.starts_with("<domain type=\"kvm\">"), "{x}");
        assert!(x.contains("<name>ns_vm</name>"));
        assert!(x.contains("<uuid>0f2d3a9c-1111-4222-8333-444455556666</uuid>"));
        assert!(x.contains("<kvirt:uid>0f2d3a9c-1111-4222-8333-444455556666</kvirt:uid>"));
        assert!(x.contains("<on_crash>destroy</on_crash>"));
        assert_eq!(
            c.resources,
            Resources {
                memory_bytes: 64 << 20,
                vcpus: 1,
                memory_limit_bytes: None,
                cpu_request_millis: None,
                cpu_limit_millis: None,
                hugepage_bytes: 0,
                dedicated_cpus: None,
            }
        );
        assert!(c.disks.is_empty());
    }

    #[test]
    fn scheduling_fields_are_ignored_others_rejected() {
        let v = vmi(&format!(
            "{MEM}\nnodeSelector: {{a: b}}\naffinity: {{}}\ntolerations: []\narchitecture: amd64\n\
             startStrategy: Paused\nreadinessProbe: {{}}"
        ));
        assert_eq!(fields(run(&v, DomainType::Kvm)), ["spec.readinessProbe"]);
        assert!(
            run(
                &vmi(&format!("{MEM}\nstartStrategy: Paused")),
                DomainType::Kvm
            )
            .unwrap()
            .start_paused
        );
        let v = vmi(&format!("{MEM}\nstartStrategy: Sleepy"));
        assert_eq!(fields(run(&v, DomainType::Kvm)), ["spec.startStrategy"]);
        let v = vmi(&format!("{MEM}\narchitecture: arm64"));
        assert_eq!(fields(run(&v, DomainType::Kvm)), ["spec.architecture"]);
    }

    #[test]
    fn hostname_and_subdomain_reach_the_guest_through_dhcp() {
        let net = |extra: &str| {
            run(&vmi(&format!("{MEM}\n{extra}")), DomainType::Kvm)
                .map(|c| c.network.unwrap())
                .map(|n| (n.hostname, n.domain_search))
        };
        assert_eq!(net("").unwrap(), ("vm".into(), None));
        assert_eq!(
            net("hostname: web-1\nsubdomain: backends").unwrap(),
            ("web-1".into(), Some("backends.ns.svc.cluster.local".into()))
        );
        let errs: Vec<String> = net("hostname: Web_1\nsubdomain: \"-x\"")
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(errs, ["spec.hostname", "spec.subdomain"]);
    }

    #[test]
    fn annotations_that_change_what_runs_are_refused_by_name() {
        let mut v = vmi(MEM);
        v.metadata.annotations = Some(
            [
                ("hooks.kubevirt.io/hookSidecars", "[{\"image\": \"x\"}]"),
                ("kubevirt.io/ignitiondata", "{}"),
                ("note", "harmless"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        );
        assert_eq!(
            fields(run(&v, DomainType::Kvm)),
            [
                "metadata.annotations[hooks.kubevirt.io/hookSidecars]",
                "metadata.annotations[kubevirt.io/ignitiondata]"
            ]
        );
    }

    #[test]
    fn key_must_match() {
        let mut v = vmi(MEM);
        v.metadata.name = Some("other".into());
        let e = run(&v, DomainType::Kvm).unwrap_err();
        assert_eq!(e[0].field, "metadata");
        assert_eq!(
            e[0].to_string(),
            "metadata: VMI is ns/other, but the conversion is for ns/vm"
        );
    }

    #[test]
    fn all_errors_are_reported() {
        let v = vmi(
            "domain: {cpu: {cores: 0, sockets: 1}, foo: 1}\nnetworks: [{name: default, pod: {}}]",
        );
        let f = fields(run(&v, DomainType::Kvm));
        assert_eq!(
            f,
            [
                "spec.domain.foo",
                "spec.domain.memory.guest",
                "spec.domain.cpu.cores",
                "spec.domain.devices.interfaces"
            ]
        );
    }
}
