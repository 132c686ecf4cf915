//! kvirtd's configuration: `/etc/kvirt/kvirtd.toml`, every field optional,
//! defaults that run on one host with nothing else installed.

use crate::core::convert::{Claims, HostDiskRoots, Limits};
use crate::core::cpuset::CpuSet;
use crate::core::drain::Strategy;
use crate::core::identity::IdRange;
use crate::core::image::ImageLimits;
use crate::core::quantity::parse_bytes;

/// 0x70000000 and the 64Ki above: in the range systemd leaves unused,
/// clear of system, login, dynamic and container users.
const DEFAULT_IDENTITIES: (u32, u32) = (1_879_048_192, 1_879_113_727);
use crate::core::layout::{DaemonKind, HostLayout};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const DEFAULT_PATH: &str = "/etc/kvirt/kvirtd.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {source}")]
    Parse {
        path: PathBuf,
        source: Box<toml::de::Error>,
    },
    #[error("invalid config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// This host's node name (`status.nodeName`); the hostname when empty.
    pub node_name: String,
    pub source: SourceConfig,
    pub paths: PathsConfig,
    pub vm: VmConfig,
    pub storage: StorageConfig,
    pub kubernetes: KubernetesConfig,
    pub network: NetworkConfig,
    pub metrics: MetricsConfig,
    pub control: ControlConfig,
    pub api: ApiConfig,
    pub migration: MigrationConfig,
}

/// The migration port: where other kvirtds carry a migrating VM's
/// connections to this host, over mutual TLS with the `[api]` certificate,
/// key and CA (kvirt's one PKI).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MigrationConfig {
    /// address:port of the migration port; empty: not served.
    pub listen: String,
    /// The longest a migration may run before it is aborted (the VM stays
    /// on the source): KubeVirt's `completionTimeoutPerGiB` for an 8 GiB VM.
    pub timeout_seconds: u64,
    /// What `kvirtctl drain` does with a VMI that names no
    /// `evictionStrategy` (KubeVirt's cluster-wide default): `None`,
    /// `LiveMigrate`, `LiveMigrateIfPossible` or `External`.
    pub eviction_strategy: Strategy,
    /// At most this many MiB/s for each migration a
    /// VirtualMachineInstanceMigration asks for (KubeVirt's
    /// `bandwidthPerMigration`); 0: unlimited.
    pub bandwidth_per_migration_mib: u64,
}

impl Default for MigrationConfig {
    fn default() -> Self {
        Self {
            listen: String::new(),
            timeout_seconds: 1200,
            eviction_strategy: Strategy::None,
            bandwidth_per_migration_mib: 0,
        }
    }
}

impl MigrationConfig {
    pub fn listen_address(&self) -> Result<Option<std::net::SocketAddr>, String> {
        listen_address("migration.listen", &self.listen)
    }
}

/// A `listen` key's address:port; empty: nothing listens.
fn listen_address(key: &str, value: &str) -> Result<Option<std::net::SocketAddr>, String> {
    if value.is_empty() {
        return Ok(None);
    }
    value
        .parse()
        .map(Some)
        .map_err(|e| format!("{key} {value:?}: {e}"))
}

/// KubeVirt's `subresources.kubevirt.io` API (what `virtctl` calls),
/// served by kvirtd in a cluster behind the API server's aggregator.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// address:port kvirtd serves it on (TLS); empty: not served.
    pub listen: String,
    /// The address the API server and the other kvirtds reach this host
    /// at (its Endpoints); empty: the listen address when it names one,
    /// else the address this host reaches the API server from.
    pub address: String,
    /// This host's serving certificate and key (PEM): the certificate
    /// names `kvirt-api.kvirt.svc` and is also the client certificate
    /// requests forwarded to other kvirtds are made with.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA (PEM) that signs every kvirtd's certificate: the
    /// APIService's `caBundle`, and who may forward a user to this host.
    pub ca: PathBuf,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8443".into(),
            address: String::new(),
            cert: "/etc/kvirt/pki/api.crt".into(),
            key: "/etc/kvirt/pki/api.key".into(),
            ca: "/etc/kvirt/pki/api-ca.crt".into(),
        }
    }
}

impl ApiConfig {
    pub fn listen_address(&self) -> Result<Option<std::net::SocketAddr>, String> {
        listen_address("api.listen", &self.listen)
    }

    /// The configured address, if any.
    pub fn advertised(&self) -> Result<Option<std::net::IpAddr>, String> {
        if !self.address.is_empty() {
            return self
                .address
                .parse()
                .map(Some)
                .map_err(|e| format!("api.address {:?}: {e}", self.address));
        }
        Ok(self
            .listen_address()?
            .map(|a| a.ip())
            .filter(|ip| !ip.is_unspecified()))
    }
}

/// kvirtd's control socket (`kvirtctl start|stop|restart`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ControlConfig {
    /// A group whose members may use it besides root; empty: root only.
    pub group: String,
}

impl ControlConfig {
    /// The group's id; an unknown group is a configuration error.
    pub fn gid(&self) -> Result<Option<u32>, String> {
        if self.group.is_empty() {
            return Ok(None);
        }
        match nix::unistd::Group::from_name(&self.group) {
            Ok(Some(g)) => Ok(Some(g.gid.as_raw())),
            Ok(None) => Err(format!("control.group: no group {:?}", self.group)),
            Err(e) => Err(format!("control.group {:?}: {e}", self.group)),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Address of the Prometheus endpoint (`/metrics`); empty: none.
    pub listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9477".into(),
        }
    }
}

impl MetricsConfig {
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// The node's VM subnet on the bridge `kvirt0` (gateway: its first
    /// address). The default avoids Docker's 172.17/16, Podman's 10.88/16
    /// and the common pod CIDRs 10.42/16, 10.244/16.
    pub subnet: String,
    /// The node's IPv6 VM range, for dual-stack VMs (KubeVirt's masquerade
    /// with IPv6); empty: IPv4 only. Each VM's IPv6 address is this range
    /// plus the host part of its IPv4 address.
    pub subnet6: String,
    pub mtu: u32,
    /// DNS servers handed to guests; empty: the host's own resolvers.
    pub dns: Vec<std::net::Ipv4Addr>,
    pub dhcp_lease_seconds: u32,
    /// Where CNI plugins are found, in order (`CNI_PATH`).
    pub cni_path: Vec<PathBuf>,
    /// Named CNI network configs, for NetworkAttachmentDefinitions
    /// without a config (Multus's rule).
    pub cni_config_dir: PathBuf,
    /// libcni's cache: `results/` records each attachment.
    pub cni_cache_dir: PathBuf,
    /// How long one plugin may run.
    pub cni_timeout_seconds: u64,
    /// Namespaces whose NetworkAttachmentDefinitions every namespace's VMs
    /// may use (Multus's `globalNamespaces`); others, only their own.
    pub cni_global_namespaces: Vec<String>,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            subnet: "10.213.0.0/24".into(),
            subnet6: String::new(),
            mtu: 1500,
            dns: vec![],
            dhcp_lease_seconds: 86_400,
            cni_path: vec!["/usr/lib/cni".into(), "/opt/cni/bin".into()],
            cni_config_dir: "/etc/cni/net.d".into(),
            cni_cache_dir: "/var/lib/cni".into(),
            cni_timeout_seconds: 60,
            cni_global_namespaces: vec!["default".into()],
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceKind {
    /// Manifests in `source.directory`; status in each VM's runtime dir.
    #[default]
    Directory,
    /// The VMIs of a Kubernetes API server labelled for this node.
    Kubernetes,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// kubeconfig kvirtd connects with (a host daemon, not a pod).
    pub kubeconfig: PathBuf,
    /// Take unassigned VMIs whose nodeSelector these labels satisfy (the
    /// leader's scheduler places them, `core::placement`).
    pub claim: bool,
    /// This host's labels, for `claim`.
    pub node_labels: std::collections::BTreeMap<String, String>,
    /// This host's taints, for `claim`: a VMI claims it only when it
    /// tolerates each `NoSchedule`/`NoExecute` one.
    pub node_taints: Vec<crate::core::scheduling::Taint>,
    /// VMIs naming this `schedulerName` (or `default-scheduler`, or none)
    /// are claimed; any other scheduler's are left to it.
    pub scheduler_name: String,
    /// Run VirtualMachines: make, stop and make anew their VMIs by their
    /// runStrategy (every kvirtd of a cluster may; they never conflict).
    pub virtual_machines: bool,
    /// The heartbeat Lease's duration; renewed every quarter of it.
    pub lease_seconds: u64,
    /// How often kept EFI variables are checked against their
    /// VirtualMachine: those of a deleted VM are removed.
    pub efi_vars_check_seconds: u64,
    /// The lifetime asked for a serviceAccount disk's token; a running
    /// VM's is renewed, in place, when four fifths of it are over.
    pub service_account_token_seconds: u64,
    /// The audiences of those tokens; none: the API server's own.
    pub service_account_token_audiences: Vec<String>,
    /// A bootstrap kubeconfig (`kvirtd join` writes it): while `kubeconfig`
    /// is missing, or holds this node's identity run out, kvirtd asks for
    /// a new identity with it at start (TLS bootstrap).
    pub bootstrap_kubeconfig: PathBuf,
    /// The life asked for this host's certificate (at least 600).
    pub certificate_seconds: u32,
    /// Approve other kvirt hosts' certificate requests that are exactly
    /// kvirt's, for the node their requester may speak for.
    pub approve_certificates: bool,
    /// ...living at most this long.
    pub max_certificate_seconds: u32,
    /// A host seen unrenewed for its Lease's duration and this long is
    /// dead: its VMIs are failed (`NodeUnresponsive`) so that their
    /// VirtualMachines run them again elsewhere.
    pub node_dead_after_seconds: u64,
    /// A host that cannot renew its own Lease for `node_dead_after_seconds`
    /// less `self_fence_margin_seconds` stops its VMs on shared disks
    /// before its peers run them again elsewhere.
    pub self_fence: bool,
    /// How much earlier than its peers may act (the kill, a peer's late
    /// view of the Lease).
    pub self_fence_margin_seconds: u64,
}

impl KubernetesConfig {
    /// When this host fences itself, if it does.
    pub fn self_fence(&self) -> Option<crate::core::fence::SelfFence> {
        self.self_fence
            .then(|| {
                crate::core::fence::SelfFence::new(
                    std::time::Duration::from_secs(self.node_dead_after_seconds),
                    std::time::Duration::from_secs(self.self_fence_margin_seconds),
                )
            })
            .flatten()
    }
}

/// A year: what kubelet's own tokens may be extended to.
pub const MAX_TOKEN_SECONDS: u64 = 365 * 24 * 3600;

impl KubernetesConfig {
    /// What this host offers VMIs, for claiming and for admitting them.
    pub fn host_facts(&self, node_name: &str) -> crate::core::scheduling::HostFacts {
        crate::core::scheduling::HostFacts {
            node_name: node_name.to_owned(),
            labels: self.node_labels.clone(),
            taints: self.node_taints.clone(),
            scheduler_name: self.scheduler_name.clone(),
        }
    }
}

impl Config {
    /// What this host offers VMIs: `kubernetes.host_facts`, and KubeVirt's
    /// `cpumanager=true` label when it dedicates CPUs (a VMI asking for
    /// dedicated CPUs is placed only on such nodes).
    pub fn host_facts(&self) -> crate::core::scheduling::HostFacts {
        let mut facts = self.kubernetes.host_facts(&self.node_name);
        if self.vm.dedicated_cpus().is_ok_and(|c| !c.is_empty()) {
            facts.labels.insert(
                crate::core::scheduling::CPU_MANAGER_LABEL.into(),
                "true".into(),
            );
        }
        facts
    }
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            kubeconfig: "/etc/kvirt/kubeconfig".into(),
            claim: false,
            node_labels: Default::default(),
            node_taints: vec![],
            scheduler_name: "kvirt".into(),
            virtual_machines: true,
            lease_seconds: 40,
            efi_vars_check_seconds: 600,
            service_account_token_seconds: 3600,
            service_account_token_audiences: Vec::new(),
            bootstrap_kubeconfig: "/etc/kvirt/bootstrap-kubeconfig".into(),
            certificate_seconds: 24 * 3600,
            approve_certificates: true,
            max_certificate_seconds: 7 * 24 * 3600,
            node_dead_after_seconds: 300,
            self_fence: true,
            self_fence_margin_seconds: 60,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SourceConfig {
    pub kind: SourceKind,
    /// Directory of VMI manifests (YAML or JSON), kubelet-static-pod style.
    pub directory: PathBuf,
    /// Seconds between full resyncs of every VM (the safety net under events).
    pub resync_seconds: u64,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PathsConfig {
    pub state_dir: PathBuf,
    pub runtime_dir: PathBuf,
    pub cache_dir: PathBuf,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Emulation {
    /// Use KVM when `/dev/kvm` answers, TCG otherwise.
    Auto,
    /// Always TCG (`<domain type='qemu'>`).
    Always,
    /// Always KVM.
    Never,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DaemonChoice {
    /// virtqemud when installed, else libvirtd.
    Auto,
    Virtqemud,
    Libvirtd,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    /// kvirt's own unprivileged user (sysusers.d): owns nothing of a VM.
    pub user: String,
    /// The numbers each VM's own user and group come from.
    pub identities: IdRange,
    pub slice: String,
    pub daemon: DaemonChoice,
    pub emulation: Emulation,
    /// Memory the unit may use beyond the guest's (daemon, QEMU, TCG cache).
    pub overhead_mib: u64,
    pub tasks_max: u64,
    /// The longest terminationGracePeriodSeconds a VMI may ask for.
    pub max_grace_period_seconds: u64,
    /// The most a VM's own writable disks (emptyDisks, DiskOrCreate
    /// hostDisks) may grow to together (a quantity such as "1Ti").
    pub max_disk_size: String,
    /// The host CPUs VMs with `dedicatedCpuPlacement` may hold, each alone
    /// (a list such as "2-7"); empty: none, and such VMs are refused. The
    /// others (the host's, and VMs without dedicated CPUs) are never handed out.
    pub dedicated_cpus: String,
    /// VMs that may be starting at once; 0: two per CPU kvirtd may use,
    /// from 4 to 64.
    pub starts_at_once: usize,
}

impl VmConfig {
    pub fn limits(&self) -> Result<Limits, String> {
        Ok(Limits {
            max_grace_seconds: self.max_grace_period_seconds,
            max_disk_bytes: parse_bytes(&self.max_disk_size)
                .map_err(|e| format!("vm.max_disk_size: {e}"))?,
        })
    }

    /// `starts_at_once`, its 0 made the default for `cpus` CPUs.
    pub fn starts_at_once(&self, cpus: usize) -> usize {
        match self.starts_at_once {
            0 => crate::daemon::controller::starts_at_once(cpus),
            n => n,
        }
    }

    pub fn dedicated_cpus(&self) -> Result<CpuSet, String> {
        self.dedicated_cpus
            .parse()
            .map_err(|e| format!("vm.dedicated_cpus: {e}"))
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Standalone: hostDisk paths must lie under one of these.
    pub host_disk_roots: Vec<PathBuf>,
    /// In a cluster: the roots each namespace may use; a namespace not
    /// listed gets no hostDisk at all.
    pub host_disk_roots_by_namespace: BTreeMap<String, Vec<PathBuf>>,
    /// Directories on storage every kvirt host reaches at the same path: a
    /// hostDisk, or a ReadWriteMany claim's volume, under one stays where
    /// it is when its VM migrates (the `LiveMigratable` condition).
    pub shared_roots: Vec<PathBuf>,
    /// containerDisk registries (`host:port`) spoken to over plain HTTP;
    /// loopback registries always are.
    pub insecure_registries: Vec<String>,
    /// Registries on this host or its link (loopback, `localhost`,
    /// link-local: a cloud's metadata service) kvirt may pull from, as
    /// `host:port` or `host`; any other such registry is refused.
    pub local_registries: Vec<String>,
    /// A containerDisk image may be at most this per layer and in all as
    /// downloaded, and this unpacked (quantities such as "10Gi"), with at
    /// most `image_max_files` files and directories.
    pub image_max_layer: String,
    pub image_max_download: String,
    pub image_max_unpacked: String,
    pub image_max_files: u64,
    /// One pull may take this long in all (60 s to a week).
    pub image_max_pull_seconds: u64,
    /// The image cache is collected down to this after each pull, least
    /// recently used first; images in use are kept.
    pub image_cache_max: String,
    /// What of the VMs' file system (`/var/lib/kvirt`) stays free: a VM
    /// whose emptyDisk or overlay could grow past it does not start.
    pub free_space_reserve: String,
    /// Filesystem claims' volumes (a local or hostPath PV's path, a
    /// configured claim's) must lie below one of these.
    pub claim_roots: Vec<PathBuf>,
    /// The share of a filesystem claim kept for its file system when
    /// kvirt sizes a new disk.img (CDI's default, 0.055).
    pub filesystem_overhead: f64,
    /// Standalone: the claims manifests may name, by name.
    pub claims: BTreeMap<String, ClaimConfig>,
}

/// A claim of the host's own (`[storage.claims.<name>]`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClaimConfig {
    /// The volume's directory (below a claim root), or a block device.
    pub path: PathBuf,
    /// `Filesystem` (the default) or `Block`.
    #[serde(default = "filesystem")]
    pub volume_mode: String,
    /// A filesystem claim's size, e.g. "10Gi": what a new disk.img is
    /// made of (less the overhead).
    #[serde(default)]
    pub capacity: Option<String>,
    #[serde(default)]
    pub read_only: bool,
}

fn filesystem() -> String {
    "Filesystem".into()
}

impl StorageConfig {
    pub fn image_limits(&self) -> Result<ImageLimits, String> {
        let bytes = |key: &str, v: &str| parse_bytes(v).map_err(|e| format!("storage.{key}: {e}"));
        Ok(ImageLimits {
            max_layer_bytes: bytes("image_max_layer", &self.image_max_layer)?,
            max_image_bytes: bytes("image_max_download", &self.image_max_download)?,
            max_unpacked_bytes: bytes("image_max_unpacked", &self.image_max_unpacked)?,
            max_entries: self.image_max_files,
            max_pull_seconds: match self.image_max_pull_seconds {
                s @ 60..=604_800 => s,
                s => {
                    return Err(format!(
                        "storage.image_max_pull_seconds: {s} is not between 60 and 604800"
                    ))
                }
            },
        })
    }

    pub fn image_cache_bytes(&self) -> Result<u64, String> {
        parse_bytes(&self.image_cache_max).map_err(|e| format!("storage.image_cache_max: {e}"))
    }

    pub fn free_space_reserve_bytes(&self) -> Result<u64, String> {
        parse_bytes(&self.free_space_reserve)
            .map_err(|e| format!("storage.free_space_reserve: {e}"))
    }
}

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            kind: SourceKind::Directory,
            directory: "/etc/kvirt/vmis.d".into(),
            resync_seconds: 300,
        }
    }
}

impl Default for PathsConfig {
    fn default() -> Self {
        let l = HostLayout::default();
        Self {
            state_dir: l.state_dir,
            runtime_dir: l.runtime_dir,
            cache_dir: l.cache_dir,
        }
    }
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            user: "kvirt".into(),
            identities: IdRange::new(DEFAULT_IDENTITIES.0, DEFAULT_IDENTITIES.1)
                .expect("the default range is valid"),
            slice: "machine-kvirt.slice".into(),
            daemon: DaemonChoice::Auto,
            emulation: Emulation::Auto,
            overhead_mib: 256,
            tasks_max: 1024,
            max_grace_period_seconds: Limits::DEFAULT_MAX_GRACE_SECONDS,
            max_disk_size: "1Ti".into(),
            dedicated_cpus: String::new(),
            starts_at_once: 0,
        }
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            host_disk_roots: vec!["/var/lib/kvirt/images".into()],
            host_disk_roots_by_namespace: BTreeMap::new(),
            shared_roots: Vec::new(),
            insecure_registries: Vec::new(),
            local_registries: Vec::new(),
            image_max_layer: "10Gi".into(),
            image_max_download: "20Gi".into(),
            image_max_unpacked: "40Gi".into(),
            image_max_files: 100_000,
            image_max_pull_seconds: 3600,
            image_cache_max: "50Gi".into(),
            free_space_reserve: "2Gi".into(),
            claim_roots: vec!["/var/lib/kvirt/claims".into(), "/mnt/disks".into()],
            filesystem_overhead: crate::core::pvc::DEFAULT_FILESYSTEM_OVERHEAD,
            claims: BTreeMap::new(),
        }
    }
}

impl Config {
    /// Reads the file; a missing file at the default path means defaults,
    /// a missing file given explicitly is an error.
    pub fn load(path: &Path, explicit: bool) -> Result<Self, ConfigError> {
        let mut merged = toml::Table::new();
        match std::fs::read_to_string(path) {
            Ok(text) => merge(&mut merged, table(&text, path)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {}
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.into(),
                    source,
                })
            }
        }
        // Drop-ins (`kvirtd.toml.d/*.toml`, in name order) override the
        // main file key by key, so local settings never edit the packaged
        // conffile.
        let dropins = drop_in_dir(path);
        let mut files: Vec<PathBuf> = match std::fs::read_dir(&dropins) {
            Ok(entries) => entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "toml"))
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(source) => {
                return Err(ConfigError::Read {
                    path: dropins,
                    source,
                })
            }
        };
        files.sort();
        for f in &files {
            let text = std::fs::read_to_string(f).map_err(|source| ConfigError::Read {
                path: f.clone(),
                source,
            })?;
            let t = table(&text, f)?;
            merge(&mut merged, t);
        }
        let cfg = Config::deserialize(merged).map_err(|e| ConfigError::Parse {
            path: path.into(),
            source: Box::new(e),
        })?;
        cfg.validated(path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            source: Box::new(e),
        })?;
        cfg.validated(path)
    }

    fn validated(mut self, path: &Path) -> Result<Self, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.into(),
            message,
        };
        if self.node_name.is_empty() {
            self.node_name = nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| "localhost".into());
        }
        self.migration.listen_address().map_err(invalid)?;
        if !self.metrics.listen.is_empty() && self.metrics.address().is_none() {
            return Err(invalid(format!(
                "metrics.listen: {:?} is not an address:port",
                self.metrics.listen
            )));
        }
        self.api.advertised().map_err(invalid)?;
        for (name, p) in [
            ("api.cert", &self.api.cert),
            ("api.key", &self.api.key),
            ("api.ca", &self.api.ca),
        ] {
            if !p.is_absolute() {
                return Err(invalid(format!("{name}: {} is not absolute", p.display())));
            }
        }
        self.storage.image_limits().map_err(invalid)?;
        self.vm.limits().map_err(invalid)?;
        self.vm.dedicated_cpus().map_err(invalid)?;
        self.storage.image_cache_bytes().map_err(invalid)?;
        self.storage.free_space_reserve_bytes().map_err(invalid)?;
        self.claims().map_err(invalid)?;
        if let Some(r) = self.storage.claim_roots.iter().find(|r| !r.is_absolute()) {
            return Err(invalid(format!(
                "storage.claim_roots: {} is not absolute",
                r.display()
            )));
        }
        for (key, roots) in [
            ("storage.host_disk_roots", &self.storage.host_disk_roots),
            ("storage.shared_roots", &self.storage.shared_roots),
        ] {
            if let Some(r) = roots.iter().find(|r| !r.is_absolute()) {
                return Err(invalid(format!("{key}: {} is not absolute", r.display())));
            }
        }
        for (ns, roots) in &self.storage.host_disk_roots_by_namespace {
            let key = format!("storage.host_disk_roots_by_namespace.{ns}");
            if crate::core::key::VmKey::new(ns, "x").is_err() {
                return Err(invalid(format!("{key}: {ns:?} is not a namespace name")));
            }
            if let Some(r) = roots.iter().find(|r| !r.is_absolute()) {
                return Err(invalid(format!("{key}: {} is not absolute", r.display())));
            }
        }
        for (name, p) in [
            ("paths.state_dir", &self.paths.state_dir),
            ("paths.runtime_dir", &self.paths.runtime_dir),
            ("paths.cache_dir", &self.paths.cache_dir),
            ("source.directory", &self.source.directory),
        ] {
            if !p.is_absolute() {
                return Err(invalid(format!("{name}: {} is not absolute", p.display())));
            }
        }
        if !self.vm.slice.ends_with(".slice") {
            return Err(invalid(format!(
                "vm.slice: {:?} must end in .slice",
                self.vm.slice
            )));
        }
        let subnet = match self.network.subnet.parse::<crate::core::ipam::Subnet>() {
            Ok(s) => s,
            Err(e) => return Err(invalid(format!("network.subnet: {e}"))),
        };
        if !self.network.subnet6.is_empty() {
            if let Err(e) = crate::core::ipam::Subnet6::parse(&self.network.subnet6, &subnet) {
                return Err(invalid(format!("network.subnet6: {e}")));
            }
        }
        if !(576..=9000).contains(&self.network.mtu) {
            return Err(invalid("network.mtu must be 576..9000".into()));
        }
        if !(1..=3600).contains(&self.network.cni_timeout_seconds) {
            return Err(invalid(
                "network.cni_timeout_seconds must be 1..3600".into(),
            ));
        }
        for d in self
            .network
            .cni_path
            .iter()
            .chain([&self.network.cni_config_dir, &self.network.cni_cache_dir])
        {
            if !d.is_absolute() {
                return Err(invalid(format!(
                    "network: {} must be an absolute path",
                    d.display()
                )));
            }
        }
        if self.network.dhcp_lease_seconds < 10 {
            return Err(invalid(
                "network.dhcp_lease_seconds must be at least 10".into(),
            ));
        }
        if self.kubernetes.lease_seconds < 4 {
            return Err(invalid(
                "kubernetes.lease_seconds must be at least 4".into(),
            ));
        }
        if self.source.kind == SourceKind::Kubernetes && !self.kubernetes.kubeconfig.is_absolute() {
            return Err(invalid(format!(
                "kubernetes.kubeconfig: {} is not absolute",
                self.kubernetes.kubeconfig.display()
            )));
        }
        let k = &self.kubernetes;
        if !k.bootstrap_kubeconfig.is_absolute() {
            return Err(invalid(format!(
                "kubernetes.bootstrap_kubeconfig: {} is not absolute",
                k.bootstrap_kubeconfig.display()
            )));
        }
        if k.node_dead_after_seconds < 5 {
            return Err(invalid(
                "kubernetes.node_dead_after_seconds must be at least 5".into(),
            ));
        }
        if k.self_fence && k.self_fence().is_none() {
            return Err(invalid(format!(
                "kubernetes.self_fence_margin_seconds ({}) must be less than \
                 node_dead_after_seconds ({}): the host must fence before its peers act \
                 (or self_fence = false)",
                k.self_fence_margin_seconds, k.node_dead_after_seconds
            )));
        }
        // The API server refuses a certificate request of less than 600 s.
        if k.certificate_seconds < crate::core::csr::MIN_SECONDS
            || k.max_certificate_seconds < crate::core::csr::MIN_SECONDS
        {
            return Err(invalid(
                "kubernetes.certificate_seconds and max_certificate_seconds must be at least 600"
                    .into(),
            ));
        }
        // The API server's bounds for a TokenRequest.
        let token = self.kubernetes.service_account_token_seconds;
        if !(600..=MAX_TOKEN_SECONDS).contains(&token) {
            return Err(invalid(format!(
                "kubernetes.service_account_token_seconds must be 600 to {MAX_TOKEN_SECONDS} (got {token})"
            )));
        }
        if self.source.resync_seconds == 0 {
            return Err(invalid("source.resync_seconds must be > 0".into()));
        }
        Ok(self)
    }

    /// The claims conversions know: standalone, the configured ones (all
    /// there are); in a cluster none, each start reads its own.
    pub fn claims(&self) -> Result<Claims, String> {
        let overhead = self.storage.filesystem_overhead;
        if !(0.0..1.0).contains(&overhead) {
            return Err(format!(
                "storage.filesystem_overhead: {overhead} is not in [0, 1)"
            ));
        }
        if self.source.kind == SourceKind::Kubernetes {
            return Ok(Claims {
                filesystem_overhead: overhead,
                ..Claims::default()
            });
        }
        let mut by_name = BTreeMap::new();
        for (name, c) in &self.storage.claims {
            let key = format!("storage.claims.{name}");
            let pvc = crate::core::pvc::configured(
                name,
                c.path.to_str().unwrap_or(""),
                &c.volume_mode,
                c.capacity.as_deref(),
                c.read_only,
                &self.storage.claim_roots,
            )
            .map_err(|e| format!("{key}: {e}"))?;
            by_name.insert(name.clone(), pvc);
        }
        Ok(Claims::known(by_name, overhead))
    }

    /// The hostDisk roots VMIs may use: the host's in standalone mode,
    /// each namespace's own in a cluster.
    pub fn host_disk_roots(&self) -> HostDiskRoots {
        match self.source.kind {
            SourceKind::Directory => HostDiskRoots::Host(self.storage.host_disk_roots.clone()),
            SourceKind::Kubernetes => {
                HostDiskRoots::Namespaces(self.storage.host_disk_roots_by_namespace.clone())
            }
        }
    }

    pub fn layout(&self) -> HostLayout {
        HostLayout {
            state_dir: self.paths.state_dir.clone(),
            runtime_dir: self.paths.runtime_dir.clone(),
            cache_dir: self.paths.cache_dir.clone(),
        }
    }

    /// The daemon to run new VMs with, looking at what is installed.
    pub fn daemon_kind(&self, installed: impl Fn(&str) -> bool) -> DaemonKind {
        match self.vm.daemon {
            DaemonChoice::Virtqemud => DaemonKind::Virtqemud,
            DaemonChoice::Libvirtd => DaemonKind::Libvirtd,
            DaemonChoice::Auto if installed("virtqemud") => DaemonKind::Virtqemud,
            DaemonChoice::Auto => DaemonKind::Libvirtd,
        }
    }
}

/// `/etc/kvirt/kvirtd.toml` → `/etc/kvirt/kvirtd.toml.d`.
pub fn drop_in_dir(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".d");
    path.with_file_name(name)
}

/// One file as a table, checked on its own so an unknown key or a wrong
/// type is reported with the file it is in.
fn table(text: &str, path: &Path) -> Result<toml::Table, ConfigError> {
    let err = |e| ConfigError::Parse {
        path: path.into(),
        source: Box::new(e),
    };
    let t: toml::Table = toml::from_str(text).map_err(err)?;
    Config::deserialize(t.clone()).map_err(err)?;
    Ok(t)
}

/// Tables merge key by key; anything else is replaced.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drains_default_strategy_is_one_of_kubevirts() {
        let c = Config::parse("", Path::new("x")).unwrap();
        assert_eq!(c.migration.eviction_strategy, Strategy::None);
        let text = "[migration]\neviction_strategy = \"LiveMigrateIfPossible\"";
        let c = Config::parse(text, Path::new("x")).unwrap();
        assert_eq!(
            c.migration.eviction_strategy,
            Strategy::LiveMigrateIfPossible
        );
        let bad = Config::parse(
            "[migration]\neviction_strategy = \"Migrate\"",
            Path::new("x"),
        );
        assert!(bad.unwrap_err().to_string().contains("Migrate"));
    }

    #[test]
    fn empty_file_is_all_defaults() {
        let c = Config::parse("node_name = \"n1\"", Path::new("x")).unwrap();
        assert_eq!(c.node_name, "n1");
        assert_eq!(c.source.directory, PathBuf::from("/etc/kvirt/vmis.d"));
        assert_eq!(c.vm.slice, "machine-kvirt.slice");
    }

    #[test]
    fn host_disks_are_the_hosts_standalone_and_granted_per_namespace_in_a_cluster() {
        let text = "[storage]\nhost_disk_roots = [\"/srv/all\"]\n\
                    [storage.host_disk_roots_by_namespace]\nteam-a = [\"/srv/a\"]\n";
        let c = Config::parse(text, Path::new("x")).unwrap();
        let roots = c.host_disk_roots();
        assert_eq!(roots.of("team-a"), [PathBuf::from("/srv/all")]);
        assert_eq!(roots.of("other"), [PathBuf::from("/srv/all")]);
        let c = Config::parse(
            &format!("{text}[source]\nkind = \"kubernetes\"\n"),
            Path::new("x"),
        )
        .unwrap();
        let roots = c.host_disk_roots();
        assert_eq!(roots.of("team-a"), [PathBuf::from("/srv/a")]);
        assert!(roots.of("other").is_empty(), "off unless granted");
        assert!(
            Config::parse("[source]\nkind = \"kubernetes\"", Path::new("x"))
                .unwrap()
                .host_disk_roots()
                .of("default")
                .is_empty()
        );
        for bad in ["Team_A = [\"/srv/a\"]", "team-a = [\"rel\"]"] {
            let e = Config::parse(
                &format!("[storage.host_disk_roots_by_namespace]\n{bad}\n"),
                Path::new("x"),
            )
            .unwrap_err();
            assert!(
                e.to_string().contains("host_disk_roots_by_namespace"),
                "{e}"
            );
        }
    }

    #[test]
    fn unknown_keys_and_bad_values_are_clear_errors() {
        let e = Config::parse("nod_name = 1", Path::new("/etc/x.toml")).unwrap_err();
        assert!(e.to_string().contains("/etc/x.toml"), "{e}");
        assert!(e.to_string().contains("nod_name"), "{e}");
        let e = Config::parse("[storage]\nhost_disk_roots=[\"rel\"]", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("host_disk_roots"), "{e}");
        let e = Config::parse("[vm]\nemulation=\"maybe\"", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("emulation"), "{e}");
        let e = Config::parse("[metrics]\nlisten=\"localhost\"", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("metrics.listen"), "{e}");
        let off = Config::parse("[metrics]\nlisten=\"\"", Path::new("x")).unwrap();
        assert_eq!(off.metrics.address(), None);
        // The API server refuses a token under ten minutes, and a year is
        // what it extends kubelet's to.
        for bad in [0, 599, MAX_TOKEN_SECONDS + 1] {
            let text = format!("[kubernetes]\nservice_account_token_seconds={bad}");
            let e = Config::parse(&text, Path::new("x")).unwrap_err();
            assert!(
                e.to_string().contains("service_account_token_seconds"),
                "{e}"
            );
        }
        let text = "[kubernetes]\nservice_account_token_seconds=600";
        assert!(Config::parse(text, Path::new("x")).is_ok());
        // A self-fence that could not come before the peers act is refused,
        // unless fencing is off.
        let text = "[kubernetes]\nnode_dead_after_seconds=60\nself_fence_margin_seconds=60";
        let e = Config::parse(text, Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("self_fence_margin_seconds"), "{e}");
        let off = format!("{text}\nself_fence=false");
        assert_eq!(
            Config::parse(&off, Path::new("x"))
                .unwrap()
                .kubernetes
                .self_fence(),
            None
        );
        let default = Config::parse("", Path::new("x"))
            .unwrap()
            .kubernetes
            .self_fence();
        assert_eq!(default.map(|f| f.after.as_secs()), Some(240));
    }

    #[test]
    fn drop_ins_override_key_by_key_in_name_order() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("kvirtd.toml");
        std::fs::write(
            &main,
            "node_name = \"n1\"\n[vm]\nuser = \"u\"\ntasks_max = 7\n",
        )
        .unwrap();
        let d = drop_in_dir(&main);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join("20-b.toml"), "[vm]\ntasks_max = 9\n").unwrap();
        std::fs::write(
            d.join("10-a.toml"),
            "[vm]\ntasks_max = 8\nemulation = \"always\"\n",
        )
        .unwrap();
        std::fs::write(d.join("README"), "not toml, ignored").unwrap();
        let c = Config::load(&main, true).unwrap();
        assert_eq!(c.node_name, "n1");
        assert_eq!(c.vm.user, "u");
        assert_eq!(c.vm.tasks_max, 9);
        assert_eq!(c.vm.emulation, Emulation::Always);
        // A mistake in a drop-in names the drop-in.
        std::fs::write(d.join("30-bad.toml"), "[vm]\ntask_max = 1\n").unwrap();
        let e = Config::load(&main, true).unwrap_err().to_string();
        assert!(e.contains("30-bad.toml") && e.contains("task_max"), "{e}");
        // No main file at the default path: drop-ins still apply.
        std::fs::remove_file(d.join("30-bad.toml")).unwrap();
        std::fs::remove_file(&main).unwrap();
        assert_eq!(Config::load(&main, false).unwrap().vm.tasks_max, 9);
    }

    #[test]
    fn vm_limits_are_a_grace_and_a_quantity() {
        let c = Config::parse(
            "[vm]\nmax_grace_period_seconds = 60\nmax_disk_size = \"10Gi\"\n",
            Path::new("x"),
        )
        .unwrap();
        let l = c.vm.limits().unwrap();
        assert_eq!((l.max_grace_seconds, l.max_disk_bytes), (60, 10 << 30));
        assert_eq!(Config::default().vm.limits().unwrap(), Limits::default());
        let e = Config::parse("[vm]\nmax_disk_size = \"big\"\n", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("vm.max_disk_size"), "{e}");
    }

    #[test]
    fn dedicated_cpus_are_a_cpu_list_and_none_by_default() {
        assert!(Config::default().vm.dedicated_cpus().unwrap().is_empty());
        let c = Config::parse("[vm]\ndedicated_cpus = \"2-4,7\"\n", Path::new("x")).unwrap();
        assert_eq!(c.vm.dedicated_cpus().unwrap().to_string(), "2-4,7");
        let e = Config::parse("[vm]\ndedicated_cpus = \"4-2\"\n", Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("vm.dedicated_cpus: \"4-2\""), "{e}");
    }

    #[test]
    fn a_host_that_dedicates_cpus_is_a_cpumanager_node() {
        let c = Config::parse("[vm]\ndedicated_cpus = \"1\"\n", Path::new("x")).unwrap();
        assert_eq!(c.host_facts().labels["cpumanager"], "true");
        assert!(!Config::default()
            .host_facts()
            .labels
            .contains_key("cpumanager"));
    }

    #[test]
    fn daemon_auto_prefers_virtqemud() {
        let c = Config::default();
        assert_eq!(c.daemon_kind(|_| true), DaemonKind::Virtqemud);
        assert_eq!(c.daemon_kind(|_| false), DaemonKind::Libvirtd);
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    #[test]
    fn the_shipped_config_is_the_defaults() {
        let text = include_str!("../../systemd/kvirtd.toml");
        let parsed = Config::parse(text, Path::new("systemd/kvirtd.toml")).unwrap();
        let defaults = Config::parse("", Path::new("x")).unwrap();
        assert_eq!(parsed, defaults);
    }

    #[test]
    fn image_limits_are_quantities() {
        let c = Config::parse(
            "[storage]\nimage_max_layer = \"1Mi\"\nimage_max_files = 7\nimage_cache_max = \"2Gi\"\n",
            Path::new("x"),
        )
        .unwrap();
        let l = c.storage.image_limits().unwrap();
        assert_eq!((l.max_layer_bytes, l.max_entries), (1 << 20, 7));
        assert_eq!(l.max_image_bytes, 20 << 30);
        assert_eq!(c.storage.image_cache_bytes().unwrap(), 2 << 30);
        assert_eq!(l.max_pull_seconds, 3600);
        let err = Config::parse("[storage]\nimage_max_pull_seconds = 0\n", Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("image_max_pull_seconds"), "{err}");
        let err = Config::parse("[storage]\nimage_max_unpacked = \"lots\"\n", Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("storage.image_max_unpacked"), "{err}");
    }
}
