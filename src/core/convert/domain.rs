//! Typed libvirt domain XML: only the elements kvirt emits. Serialised by
//! quick-xml's serde support (`@` attributes, `$text` text), so escaping is
//! never done by hand.

use serde::Serialize;

pub const KVIRT_XMLNS: &str = "http://kvirt.io/xmlns/domain/1";

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename = "domain")]
pub struct Domain {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub name: String,
    pub uuid: String,
    pub metadata: Metadata,
    pub memory: Memory,
    #[serde(rename = "memoryBacking", skip_serializing_if = "Option::is_none")]
    pub memory_backing: Option<MemoryBacking>,
    pub vcpu: Vcpu,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cputune: Option<CpuTune>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sysinfo: Option<Sysinfo>,
    pub os: Os,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub features: Option<Features>,
    pub cpu: Cpu,
    pub clock: Clock,
    pub on_poweroff: &'static str,
    pub on_reboot: &'static str,
    pub on_crash: &'static str,
    pub devices: Devices,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metadata {
    #[serde(rename = "kvirt:vm")]
    pub vm: KvirtMetadata,
}

/// Recorded in the domain so adoption can match a domain to its VMI by UID.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KvirtMetadata {
    #[serde(rename = "@xmlns:kvirt")]
    pub xmlns: &'static str,
    #[serde(rename = "kvirt:uid", skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(rename = "kvirt:namespace")]
    pub namespace: String,
    #[serde(rename = "kvirt:name")]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Memory {
    #[serde(rename = "@unit")]
    pub unit: &'static str,
    #[serde(rename = "$text")]
    pub value: u64,
}

/// Guest memory from hugepages of one size.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryBacking {
    pub hugepages: HugepagePages,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HugepagePages {
    pub page: HugepageSize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HugepageSize {
    #[serde(rename = "@size")]
    pub size: u64,
    #[serde(rename = "@unit")]
    pub unit: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Vcpu {
    #[serde(rename = "@placement")]
    pub placement: &'static str,
    #[serde(rename = "$text")]
    pub count: u32,
}

/// Dedicated CPUs: each vCPU on its own host CPU, QEMU's other threads
/// (the emulator) on theirs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuTune {
    pub vcpupin: Vec<VcpuPin>,
    pub emulatorpin: CpuSetAttr,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VcpuPin {
    #[serde(rename = "@vcpu")]
    pub vcpu: u32,
    #[serde(rename = "@cpuset")]
    pub cpuset: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuSetAttr {
    #[serde(rename = "@cpuset")]
    pub cpuset: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sysinfo {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub system: SysinfoSystem,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SysinfoSystem {
    pub entry: Vec<SysinfoEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SysinfoEntry {
    #[serde(rename = "@name")]
    pub name: &'static str,
    #[serde(rename = "$text")]
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Os {
    /// `efi`: libvirt picks the OVMF build matching `firmware` below.
    #[serde(rename = "@firmware", skip_serializing_if = "Option::is_none")]
    pub firmware_kind: Option<&'static str>,
    #[serde(rename = "type")]
    pub type_: OsType,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub firmware: Option<OsFirmware>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmdline: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bios: Option<OsBios>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smbios: Option<Smbios>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OsFirmware {
    pub feature: Vec<FirmwareFeature>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FirmwareFeature {
    #[serde(rename = "@enabled")]
    pub enabled: &'static str,
    #[serde(rename = "@name")]
    pub name: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OsType {
    #[serde(rename = "@machine")]
    pub machine: String,
    #[serde(rename = "$text")]
    pub value: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OsBios {
    #[serde(rename = "@useserial")]
    pub useserial: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Smbios {
    #[serde(rename = "@mode")]
    pub mode: &'static str,
}

/// A feature that is on by being present, e.g. `<acpi/>`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Present {}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct State {
    #[serde(rename = "@state")]
    pub state: &'static str,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Features {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acpi: Option<Present>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub apic: Option<Present>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hyperv: Option<Hyperv>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smm: Option<State>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Hyperv {
    #[serde(rename = "@mode")]
    pub mode: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relaxed: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vapic: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spinlocks: Option<Spinlocks>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vpindex: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synic: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stimer: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reset: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vendor_id: Option<VendorId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequencies: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reenlightenment: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tlbflush: Option<State>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipi: Option<State>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Spinlocks {
    #[serde(rename = "@state")]
    pub state: &'static str,
    #[serde(rename = "@retries", skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VendorId {
    #[serde(rename = "@state")]
    pub state: &'static str,
    #[serde(rename = "@value", skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cpu {
    #[serde(rename = "@mode", skip_serializing_if = "Option::is_none")]
    pub mode: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<CpuModel>,
    pub topology: Topology,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub feature: Vec<CpuFeature>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuModel {
    /// `forbid`: a model QEMU cannot provide fails the start instead of
    /// silently becoming another.
    #[serde(rename = "@fallback")]
    pub fallback: &'static str,
    #[serde(rename = "$text")]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuFeature {
    #[serde(rename = "@policy")]
    pub policy: &'static str,
    #[serde(rename = "@name")]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Topology {
    #[serde(rename = "@sockets")]
    pub sockets: u32,
    #[serde(rename = "@cores")]
    pub cores: u32,
    #[serde(rename = "@threads")]
    pub threads: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Clock {
    #[serde(rename = "@offset")]
    pub offset: &'static str,
    #[serde(rename = "@adjustment", skip_serializing_if = "Option::is_none")]
    pub adjustment: Option<String>,
    #[serde(rename = "@timezone", skip_serializing_if = "Option::is_none")]
    pub timezone: Option<String>,
    #[serde(rename = "timer", default, skip_serializing_if = "Vec::is_empty")]
    pub timers: Vec<Timer>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timer {
    #[serde(rename = "@name")]
    pub name: &'static str,
    #[serde(rename = "@present", skip_serializing_if = "Option::is_none")]
    pub present: Option<&'static str>,
    #[serde(rename = "@tickpolicy", skip_serializing_if = "Option::is_none")]
    pub tickpolicy: Option<&'static str>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Devices {
    #[serde(rename = "disk", skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    #[serde(rename = "controller", skip_serializing_if = "Vec::is_empty")]
    pub controllers: Vec<Controller>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<Serial>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub console: Option<Console>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graphics: Option<Graphics>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub video: Option<Video>,
    #[serde(rename = "interface", skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memballoon: Option<Memballoon>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rng: Option<Rng>,
    #[serde(rename = "input", skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<Input>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub watchdog: Option<Watchdog>,
    #[serde(rename = "channel", skip_serializing_if = "Vec::is_empty")]
    pub channels: Vec<Channel>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<Tpm>,
}

/// A TPM 2.0 that libvirt emulates with swtpm, run by the VM's own daemon.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tpm {
    #[serde(rename = "@model")]
    pub model: &'static str,
    pub backend: TpmBackend,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TpmBackend {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@version")]
    pub version: &'static str,
    #[serde(rename = "@persistent_state", skip_serializing_if = "Option::is_none")]
    pub persistent_state: Option<&'static str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Input {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@bus")]
    pub bus: &'static str,
    pub alias: Alias,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Watchdog {
    #[serde(rename = "@model")]
    pub model: &'static str,
    #[serde(rename = "@action")]
    pub action: &'static str,
    pub alias: Alias,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Channel {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub source: UnixSource,
    pub target: ChannelTarget,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChannelTarget {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@name")]
    pub name: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Disk {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@device")]
    pub device: &'static str,
    pub driver: DiskDriver,
    pub source: DiskSource,
    pub target: DiskTarget,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot: Option<Boot>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readonly: Option<Present>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shareable: Option<Present>,
    pub alias: Alias,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskDriver {
    #[serde(rename = "@name")]
    pub name: &'static str,
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@cache", skip_serializing_if = "Option::is_none")]
    pub cache: Option<&'static str>,
    #[serde(rename = "@io", skip_serializing_if = "Option::is_none")]
    pub io: Option<&'static str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskSource {
    #[serde(rename = "@file", skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// A block device (`<disk type='block'>`).
    #[serde(rename = "@dev", skip_serializing_if = "Option::is_none")]
    pub dev: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DiskTarget {
    #[serde(rename = "@dev")]
    pub dev: String,
    #[serde(rename = "@bus")]
    pub bus: &'static str,
    #[serde(rename = "@tray", skip_serializing_if = "Option::is_none")]
    pub tray: Option<&'static str>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Boot {
    #[serde(rename = "@order")]
    pub order: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alias {
    #[serde(rename = "@name")]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Controller {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@index")]
    pub index: u32,
    #[serde(rename = "@model")]
    pub model: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Serial {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub source: UnixSource,
    pub log: Log,
    pub target: SerialTarget,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UnixSource {
    #[serde(rename = "@mode")]
    pub mode: &'static str,
    #[serde(rename = "@path")]
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Log {
    #[serde(rename = "@file")]
    pub file: String,
    #[serde(rename = "@append")]
    pub append: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SerialTarget {
    #[serde(rename = "@port")]
    pub port: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Console {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub source: UnixSource,
    pub target: ConsoleTarget,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConsoleTarget {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@port")]
    pub port: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Graphics {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@socket")]
    pub socket: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Video {
    pub model: VideoModel,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VideoModel {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    #[serde(rename = "@vram")]
    pub vram: u32,
    #[serde(rename = "@heads")]
    pub heads: u32,
}

/// `<interface type='ethernet'>` on a tap kvirt made (`managed='no'`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Interface {
    #[serde(rename = "@type")]
    pub type_: &'static str,
    pub mac: MacAddress,
    pub target: InterfaceTarget,
    pub model: InterfaceModel,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot: Option<Boot>,
    pub alias: InterfaceAlias,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MacAddress {
    #[serde(rename = "@address")]
    pub address: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InterfaceTarget {
    #[serde(rename = "@dev")]
    pub dev: String,
    #[serde(rename = "@managed")]
    pub managed: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InterfaceModel {
    #[serde(rename = "@type")]
    pub type_: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InterfaceAlias {
    #[serde(rename = "@name")]
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Memballoon {
    #[serde(rename = "@model")]
    pub model: &'static str,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Rng {
    #[serde(rename = "@model")]
    pub model: &'static str,
    pub backend: RngBackend,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RngBackend {
    #[serde(rename = "@model")]
    pub model: &'static str,
    #[serde(rename = "$text")]
    pub device: &'static str,
}

impl Domain {
    /// Indented XML, stable for snapshots and readable in `kvirtctl domxml`.
    pub fn to_xml(&self) -> Result<String, quick_xml::SeError> {
        let mut out = String::new();
        let mut ser = quick_xml::se::Serializer::new(&mut out);
        ser.indent(' ', 2);
        self.serialize(ser)?;
        out.push('\n');
        Ok(out)
    }
}
