//! The subset of KubeVirt's `kubevirt.io/v1` VirtualMachineInstance that
//! kvirt reads, written by hand (no usable generated types exist).
//!
//! Every spec type keeps the fields it does not model in `extra`, so nothing
//! a user wrote is dropped on a round trip, and the converter can refuse
//! what it does not implement instead of silently ignoring it. Status types
//! are lenient: KubeVirt writes `null` timestamps and phases we may not know.

use crate::core::key::{KeyError, VmKey};
use crate::core::quantity::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::time::Duration;

pub const API_VERSION: &str = "kubevirt.io/v1";
pub const KIND: &str = "VirtualMachineInstance";
/// virt-handler's selector: the VMIs scheduled to a node carry this label.
pub const NODE_LABEL: &str = "kubevirt.io/nodeName";
/// KubeVirt's default when `terminationGracePeriodSeconds` is absent.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// Unknown fields of one object, kept verbatim.
pub type Extra = Map<String, Value>;

#[derive(Debug, thiserror::Error)]
pub enum VmiError {
    #[error("invalid VMI YAML: {0}")]
    Yaml(#[from] serde_norway::Error),
    #[error("invalid VMI JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("expected apiVersion {API_VERSION:?} and kind {KIND:?}, got {api_version:?} {kind:?}")]
    WrongKind { api_version: String, kind: String },
    #[error("metadata.name is missing")]
    NoName,
    #[error(transparent)]
    Key(#[from] KeyError),
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstance {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: VmiSpec,
    #[serde(default, skip_serializing_if = "is_default")]
    pub status: VmiStatus,
    #[serde(flatten)]
    pub extra: Extra,
}

impl VirtualMachineInstance {
    pub fn from_yaml(s: &str) -> Result<Self, VmiError> {
        serde_norway::from_str::<Self>(s)?.checked()
    }

    pub fn from_json(s: &str) -> Result<Self, VmiError> {
        serde_json::from_str::<Self>(s)?.checked()
    }

    fn checked(self) -> Result<Self, VmiError> {
        if self.api_version != API_VERSION || self.kind != KIND {
            return Err(VmiError::WrongKind {
                api_version: self.api_version,
                kind: self.kind,
            });
        }
        Ok(self)
    }

    /// Namespace and name; the namespace defaults to `default` as kubectl does.
    pub fn key(&self) -> Result<VmKey, VmiError> {
        let name = self.metadata.name.as_deref().ok_or(VmiError::NoName)?;
        let namespace = self.metadata.namespace.as_deref().unwrap_or("default");
        Ok(VmKey::new(namespace, name)?)
    }

    pub fn uid(&self) -> Option<&str> {
        self.metadata.uid.as_deref().filter(|u| !u.is_empty())
    }

    /// Negative values (invalid in KubeVirt) are treated as zero.
    pub fn termination_grace_period(&self) -> Duration {
        self.spec
            .termination_grace_period_seconds
            .map_or(DEFAULT_GRACE_PERIOD, |s| {
                Duration::from_secs(s.max(0).unsigned_abs())
            })
    }
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiSpec {
    #[serde(default)]
    pub domain: DomainSpec,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<Network>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub termination_grace_period_seconds: Option<i64>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DomainSpec {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Cpu>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Memory>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine: Option<Machine>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firmware: Option<Firmware>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub features: Option<Features>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock: Option<Clock>,
    #[serde(default)]
    pub devices: Devices,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Cpu {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sockets: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<CpuFeature>>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CpuFeature {
    pub name: String,
    /// force, require (the default), optional, disable or forbid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Memory {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest: Option<Quantity>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<Hugepages>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hugepages {
    #[serde(default)]
    pub page_size: Option<Quantity>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRequirements {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub requests: BTreeMap<String, Quantity>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, Quantity>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Machine {
    #[serde(rename = "type", default, skip_serializing_if = "String::is_empty")]
    pub type_: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Firmware {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootloader: Option<Bootloader>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_boot: Option<KernelBoot>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Direct kernel boot, the kernel and initrd taken from a container image.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KernelBoot {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_args: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<KernelBootContainer>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KernelBootContainer {
    pub image: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bootloader {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bios: Option<Bios>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub efi: Option<Efi>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bios {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_serial: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// UEFI (OVMF). KubeVirt turns Secure Boot on unless told otherwise.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Efi {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secure_boot: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistent: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Features {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acpi: Option<FeatureState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apic: Option<FeatureState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smm: Option<FeatureState>,
    /// Hyper-V enlightenments by KubeVirt's names (`relaxed`, `vapic`,
    /// `spinlocks`, ...); extra settings (`spinlocks`, `vendorid`) are in
    /// each one's `extra`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hyperv: Option<std::collections::BTreeMap<String, FeatureState>>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// KubeVirt's `{enabled: bool}`; a present feature with no `enabled` is on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FeatureState {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl FeatureState {
    pub fn is_enabled(&self) -> bool {
        self.enabled.unwrap_or(true)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Clock {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub utc: Option<ClockUtc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timer: Option<Timers>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClockUtc {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset_seconds: Option<i64>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Timers {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hpet: Option<Timer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kvm: Option<Timer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pit: Option<Timer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtc: Option<Timer>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hyperv: Option<Timer>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Timer {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tick_policy: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Devices {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoattach_graphics_device: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoattach_serial_console: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoattach_pod_interface: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoattach_mem_balloon: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rng: Option<Rng>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<Input>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watchdog: Option<Watchdog>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<Tpm>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A vTPM (`devices.tpm`): on unless `enabled: false`; `persistent` keeps
/// its state across the VM's restarts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Tpm {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistent: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Input {
    pub name: String,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Watchdog {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub i6300esb: Option<I6300esb>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct I6300esb {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rng {
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskTarget>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cdrom: Option<CdromTarget>,
    /// Modelled only so the converter can refuse it by name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lun: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_order: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<String>,
    /// Several VMs may have it open at once (a cluster file system's disk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shareable: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiskTarget {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CdromTarget {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readonly: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tray: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Kept whole: networking is not converted yet, only refused.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_disk: Option<HostDisk>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub empty_disk: Option<EmptyDisk>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloud_init_no_cloud: Option<CloudInit>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cloud_init_config_drive: Option<CloudInit>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_disk: Option<ContainerDisk>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ephemeral: Option<Ephemeral>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapVolume>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretVolume>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountVolume>,
    #[serde(rename = "downwardAPI", skip_serializing_if = "Option::is_none")]
    pub downward_api: Option<DownwardApiVolume>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimVolume>,
    /// A CDI DataVolume: its PVC, of the same name, once it is populated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_volume: Option<DataVolumeVolume>,
    /// Other volume sources (memoryDump, ...).
    #[serde(flatten)]
    pub extra: Extra,
}

/// `cloudInitNoCloud` and `cloudInitConfigDrive` share their fields.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloudInit {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_data: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_data_base64: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_data: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_data_base64: Option<String>,
    /// User data from a Secret's `userdata` (or `userData`) key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<LocalObjectReference>,
    /// Network data from a Secret's `networkdata` (or `networkData`) key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_data_secret_ref: Option<LocalObjectReference>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalObjectReference {
    #[serde(default)]
    pub name: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A ConfigMap as a disk: an ISO with a file per key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapVolume {
    #[serde(default)]
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A Secret as a disk: an ISO with a file per key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretVolume {
    #[serde(default)]
    pub secret_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A ServiceAccount's credentials as a disk: `token`, `namespace`, `ca.crt`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountVolume {
    #[serde(default)]
    pub service_account_name: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The VMI's own metadata as a disk: an ISO with a file per item.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApiVolume {
    #[serde(default)]
    pub fields: Vec<DownwardApiFile>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub volume_label: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One file of a downwardAPI volume (Kubernetes' `DownwardAPIVolumeFile`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DownwardApiFile {
    #[serde(default)]
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field_ref: Option<FieldRef>,
    /// Kept to be refused by name: a VMI has no container's resources.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resource_field_ref: Option<serde_json::Value>,
    /// File mode, checked and then unused: ISO files are read-only. A
    /// number, or YAML 1.1's octal `0444`, which YAML 1.2 reads as a string.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<serde_json::Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// Kubernetes' `ObjectFieldSelector`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FieldRef {
    #[serde(default)]
    pub field_path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A disk image in an OCI image (under `/disk/`), used through a
/// throw-away overlay.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDisk {
    pub image: String,
    /// The disk's path in the image; the file in `/disk/` when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// KubeVirt's ephemeral volume: a read-only base with a throw-away
/// overlay. KubeVirt's base is a PVC; kvirt's is a hostDisk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ephemeral {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_disk: Option<HostDisk>,
    /// `persistentVolumeClaim` (needs a cluster's storage).
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostDiskType {
    #[default]
    Disk,
    DiskOrCreate,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostDisk {
    pub path: String,
    #[serde(rename = "type")]
    pub type_: HostDiskType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<Quantity>,
    /// Only tells KubeVirt the file is on shared storage (for migration);
    /// it has no effect on the domain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `persistentVolumeClaim`: a claim in the VMI's namespace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimVolume {
    pub claim_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    /// KubeVirt's hotplug marker: kvirt has no hotplug.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `dataVolume`: the DataVolume of that name, through its PVC.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataVolumeVolume {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hotpluggable: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDisk {
    pub capacity: Quantity,
    #[serde(flatten)]
    pub extra: Extra,
}

// ---- status ----

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiStatus {
    #[serde(
        default,
        deserialize_with = "phase_or_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub phase: Option<Phase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub conditions: Vec<Condition>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub phase_transition_timestamps: Vec<PhaseTransitionTimestamp>,
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub interfaces: Vec<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// KubeVirt's VMI phases. Any other string reads as `Unknown`, so a newer
/// KubeVirt never makes a VMI unreadable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Pending,
    Scheduling,
    Scheduled,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Scheduling => "Scheduling",
            Self::Scheduled => "Scheduled",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Unknown => "Unknown",
        }
    }

    pub fn from_str_lossy(s: &str) -> Self {
        match s {
            "Pending" => Self::Pending,
            "Scheduling" => Self::Scheduling,
            "Scheduled" => Self::Scheduled,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            _ => Self::Unknown,
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for Phase {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Phase {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::from_str_lossy(&String::deserialize(d)?))
    }
}

/// KubeVirt writes `phase: ""` for an unset phase.
fn phase_or_none<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Phase>, D::Error> {
    Ok(Option::<String>::deserialize(d)?
        .filter(|s| !s.is_empty())
        .map(|s| Phase::from_str_lossy(&s)))
}

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `"True"`, `"False"` or `"Unknown"`.
    #[serde(default)]
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_probe_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTransitionTimestamp {
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_transition_timestamp: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const WITH_UNKNOWN: &str = r##"
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: vm1
  uid: 9b1c4b3e-0000-4000-8000-000000000001
  labels: {app: x}
topLevelThing: 1
spec:
  futureSpecField: {a: 1}
  terminationGracePeriodSeconds: 5
  domain:
    somethingNew: true
    cpu: {cores: 2, dedicatedCpuPlacement: true}
    memory: {guest: 64Mi, hugepages: {pageSize: 2Mi}}
    resources:
      requests: {memory: 64Mi, cpu: 500m}
      overcommitGuestOverhead: true
    devices:
      blockMultiQueue: true
      disks:
        - name: root
          disk: {bus: virtio, pciAddress: "0000:81:01.0"}
          dedicatedIOThread: true
  volumes:
    - name: root
      hostDisk: {path: /srv/vm.img, type: Disk, futureHostDiskField: x}
    - name: cd
      containerDisk: {image: quay.io/containerdisks/fedora:latest, futureField: 1}
status:
  phase: Running
  someStatusField: [1, 2]
"##;

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let vmi = VirtualMachineInstance::from_yaml(WITH_UNKNOWN).unwrap();
        assert_eq!(vmi.extra["topLevelThing"], json!(1));
        assert_eq!(vmi.spec.extra["futureSpecField"], json!({"a": 1}));
        assert_eq!(vmi.spec.domain.extra["somethingNew"], json!(true));
        let cpu = vmi.spec.domain.cpu.as_ref().unwrap();
        assert_eq!(cpu.cores, Some(2));
        assert!(cpu.extra.contains_key("dedicatedCpuPlacement"));
        assert!(vmi.spec.domain.devices.disks[0]
            .extra
            .contains_key("dedicatedIOThread"));
        let cd = vmi.spec.volumes[1].container_disk.as_ref().unwrap();
        assert_eq!(cd.image, "quay.io/containerdisks/fedora:latest");
        assert!(cd.extra.contains_key("futureField"));
        assert_eq!(vmi.status.phase, Some(Phase::Running));

        // YAML → typed → JSON must equal YAML → untyped → JSON.
        let untyped: Value = serde_norway::from_str(WITH_UNKNOWN).unwrap();
        assert_eq!(serde_json::to_value(&vmi).unwrap(), untyped);
        let again = VirtualMachineInstance::from_json(&serde_json::to_string(&vmi).unwrap());
        assert_eq!(again.unwrap(), vmi);
    }

    #[test]
    fn status_tolerates_nulls_and_unknown_phases() {
        let vmi = VirtualMachineInstance::from_json(
            &json!({
                "apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": "a", "namespace": "ns"},
                "spec": {},
                "status": {
                    "phase": "Migrating",
                    "conditions": [{"type": "Ready", "status": "True",
                                    "lastProbeTime": null, "lastTransitionTime": null}],
                    "phaseTransitionTimestamps": [
                        {"phase": "Pending", "phaseTransitionTimestamp": "2024-01-01T00:00:00Z"},
                        {"phase": "WaitingForSync", "phaseTransitionTimestamp": null}],
                    "interfaces": null,
                    "guestOSInfo": {}
                }
            })
            .to_string(),
        )
        .unwrap();
        let st = &vmi.status;
        assert_eq!(st.phase, Some(Phase::Unknown));
        assert_eq!(st.conditions[0].last_probe_time, None);
        assert_eq!(st.conditions[0].type_, "Ready");
        assert_eq!(st.phase_transition_timestamps[1].phase, Phase::Unknown);
        assert_eq!(
            st.phase_transition_timestamps[1].phase_transition_timestamp,
            None
        );
        assert!(st.interfaces.is_empty());
        assert!(st.extra.contains_key("guestOSInfo"));
        let out = serde_json::to_value(st).unwrap();
        assert_eq!(out["phase"], "Unknown");
        assert!(out["conditions"][0].get("lastProbeTime").is_none());
    }

    #[test]
    fn empty_phase_is_none() {
        let st: VmiStatus = serde_json::from_str(r#"{"phase": ""}"#).unwrap();
        assert_eq!(st.phase, None);
        assert_eq!(serde_json::to_string(&st).unwrap(), "{}");
    }

    #[test]
    fn helpers() {
        let vmi = VirtualMachineInstance::from_yaml(WITH_UNKNOWN).unwrap();
        assert_eq!(vmi.key().unwrap().domain_name(), "default_vm1");
        assert_eq!(vmi.uid(), Some("9b1c4b3e-0000-4000-8000-000000000001"));
        assert_eq!(vmi.termination_grace_period(), Duration::from_secs(5));
        let bare = VirtualMachineInstance::default();
        assert_eq!(bare.termination_grace_period(), DEFAULT_GRACE_PERIOD);
        assert!(matches!(bare.key(), Err(VmiError::NoName)));
    }

    #[test]
    fn clear_errors() {
        let err = VirtualMachineInstance::from_yaml("apiVersion: v1\nkind: Pod\n").unwrap_err();
        assert!(err.to_string().contains("\"Pod\""), "{err}");
        let err = VirtualMachineInstance::from_yaml(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nspec: {domain: {cpu: {cores: many}}}\n",
        )
        .unwrap_err();
        assert!(err.to_string().starts_with("invalid VMI YAML"), "{err}");
    }
}
