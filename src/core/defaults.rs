//! KubeVirt's defaulting of a VMI (virt-api's VMI mutator, the API's
//! `SetDefaults_*`, and `SetDefaultVolumeDisk`), applied in one place before
//! conversion: a VMI written for a KubeVirt cluster means here what it means
//! there. Pure.
//!
//! Where kvirt differs, on purpose:
//! - the default interface binds with `masquerade` (KubeVirt's default is
//!   `bridge`, configurable; kvirt has only masquerade on the pod network);
//! - `cpu.model` is `host-model` only on KVM: TCG has no host CPU to model;
//! - `maxSockets`/`maxGuest` (CPU and memory hotplug) are not set: kvirt
//!   has no hotplug;
//! - a standalone VMI's firmware UUID follows from its UID (KubeVirt's is
//!   random, written back into the VMI by the mutator; kvirt writes no spec);
//! - `terminationGracePeriodSeconds` stays unset, as in KubeVirt (30 s is
//!   read where it is used).

use crate::core::convert::DomainType;
use crate::core::key::VmKey;
use crate::core::quantity::Quantity;
use crate::core::vmi::{
    CdromTarget, Cpu, Devices, Disk, DiskTarget, DomainSpec, FeatureState, Firmware, I6300esb,
    Interface, Machine, Memory, Network, VirtualMachineInstance, VmiSpec,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// KubeVirt's default machine type on amd64.
pub const MACHINE_TYPE: &str = "q35";
/// KubeVirt's default bus for disks, cdroms and LUNs on amd64: guests
/// have a SATA driver out of the box.
pub const DISK_BUS: &str = "sata";
/// The pod network's name when KubeVirt adds it.
pub const DEFAULT_NETWORK: &str = "default";
/// KubeVirt's `firmwareUUIDns`: the namespace of a VM's name-derived
/// (version 5) firmware UUID.
const FIRMWARE_UUID_NS: [u8; 16] = [
    0x6a, 0x1a, 0x24, 0xa1, 0x40, 0x61, 0x46, 0x07, 0x8b, 0xf4, 0xa3, 0x96, 0x3d, 0x0c, 0x58, 0x95,
];

/// Sets every default KubeVirt would have set when the VMI was created.
/// Idempotent; never removes or changes what the VMI says.
pub fn apply(vmi: &mut VirtualMachineInstance, key: &VmKey, domain_type: DomainType) {
    let uuid = firmware_uuid(vmi, key);
    let spec = &mut vmi.spec;
    network(spec);
    volume_disks(spec);
    let dom = &mut spec.domain;
    disk_devices(&mut dom.devices.disks);
    devices(&mut dom.devices);
    machine(dom);
    cpu(dom, domain_type);
    memory(dom);
    features(dom);
    let fw = dom.firmware.get_or_insert_with(Firmware::default);
    fw.uuid.get_or_insert(uuid);
    for v in &mut spec.volumes {
        if let Some(cd) = &mut v.container_disk {
            if cd.image_pull_policy.is_none() {
                if let Ok(p) = crate::core::image::PullPolicy::resolve(None, &cd.image) {
                    cd.image_pull_policy = Some(p.as_str().into());
                }
            }
        }
    }
}

/// What virt-controller defaults when it makes a VM's VMI, before the
/// instancetype and preference apply: a disk for each volume, the pod
/// network.
pub fn controller_defaults(spec: &mut VmiSpec) {
    network(spec);
    volume_disks(spec);
}

/// The pod network and its interface, when the VMI names no network and
/// no interface and does not turn the pod interface off.
fn network(spec: &mut VmiSpec) {
    let dev = &spec.domain.devices;
    if !spec.networks.is_empty()
        || !dev.interfaces.is_empty()
        || dev.autoattach_pod_interface == Some(false)
    {
        return;
    }
    spec.networks.push(Network {
        name: DEFAULT_NETWORK.into(),
        extra: obj(json!({"pod": {}})),
    });
    spec.domain.devices.interfaces.push(Interface {
        name: DEFAULT_NETWORK.into(),
        extra: obj(json!({"masquerade": {}})),
    });
}

/// A disk for each volume no disk (or filesystem) names, in volume order.
fn volume_disks(spec: &mut VmiSpec) {
    let dev = &spec.domain.devices;
    let filesystems: Vec<&str> = dev
        .extra
        .get("filesystems")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|f| f.get("name")?.as_str())
        .collect();
    let missing: Vec<String> = spec
        .volumes
        .iter()
        .map(|v| v.name.clone())
        .filter(|n| !dev.disks.iter().any(|d| &d.name == n) && !filesystems.contains(&n.as_str()))
        .collect();
    for name in missing {
        spec.domain.devices.disks.push(Disk {
            name,
            ..Disk::default()
        });
    }
}

/// A disk of no type is a `disk`; every bus left out is SATA; a cdrom is
/// read-only with its tray closed.
fn disk_devices(disks: &mut [Disk]) {
    for d in disks {
        if d.disk.is_none() && d.cdrom.is_none() && d.lun.is_none() {
            d.disk = Some(DiskTarget::default());
        }
        if let Some(t) = &mut d.disk {
            t.bus.get_or_insert_with(|| DISK_BUS.into());
        }
        if let Some(c) = &mut d.cdrom {
            default_cdrom(c);
        }
        if let Some(Value::Object(lun)) = &mut d.lun {
            lun.entry("bus").or_insert_with(|| DISK_BUS.into());
        }
    }
}

fn default_cdrom(c: &mut CdromTarget) {
    c.bus.get_or_insert_with(|| DISK_BUS.into());
    c.readonly.get_or_insert(true);
    c.tray.get_or_insert_with(|| "closed".into());
}

/// Inputs are USB tablets unless said otherwise; a watchdog resets.
fn devices(dev: &mut Devices) {
    for i in &mut dev.inputs {
        if i.bus.as_deref().is_none_or(str::is_empty) {
            i.bus = Some("usb".into());
        }
        if i.type_.as_deref().is_none_or(str::is_empty) {
            i.type_ = Some("tablet".into());
        }
    }
    if let Some(w) = &mut dev.watchdog {
        let esb = w.i6300esb.get_or_insert_with(I6300esb::default);
        esb.action.get_or_insert_with(|| "reset".into());
    }
}

fn machine(dom: &mut DomainSpec) {
    let m = dom.machine.get_or_insert_with(Machine::default);
    if m.type_.is_empty() {
        m.type_ = MACHINE_TYPE.into();
    }
}

/// Without a topology, one socket per CPU of the limit, else of the
/// request, else one (KubeVirt's `SetDefaultGuestCPUTopology`).
fn cpu(dom: &mut DomainSpec, domain_type: DomainType) {
    let res = dom.resources.as_ref();
    let cpus = |which: fn(&crate::core::vmi::ResourceRequirements) -> Option<&Quantity>| {
        res.and_then(which)
            .and_then(|q| q.to_millis().ok())
            .filter(|&m| m > 0)
            .map(|m| u32::try_from(m.div_ceil(1000)).unwrap_or(u32::MAX))
    };
    let sockets = cpus(|r| r.limits.get("cpu"))
        .or_else(|| cpus(|r| r.requests.get("cpu")))
        .unwrap_or(1);
    let c = dom.cpu.get_or_insert_with(Cpu::default);
    let unset = |v: Option<u32>| v.is_none_or(|n| n == 0);
    if unset(c.sockets) && unset(c.cores) && unset(c.threads) {
        c.sockets = Some(sockets);
        c.cores = Some(1);
        c.threads = Some(1);
    }
    if domain_type == DomainType::Kvm && c.model.as_deref().is_none_or(str::is_empty) {
        c.model = Some("host-model".into());
    }
}

/// Guest memory from the request, else the limit, else one hugepage.
fn memory(dom: &mut DomainSpec) {
    if dom.memory.as_ref().is_some_and(|m| m.guest.is_some()) {
        return;
    }
    let res = dom.resources.as_ref();
    let from_res = res
        .and_then(|r| r.requests.get("memory").or_else(|| r.limits.get("memory")))
        .cloned();
    let page = dom
        .memory
        .as_ref()
        .and_then(|m| m.hugepages.as_ref())
        .and_then(|h| h.page_size.clone());
    if let Some(guest) = from_res.or(page) {
        dom.memory.get_or_insert_with(Memory::default).guest = Some(guest);
    }
}

/// ACPI is on unless turned off; a feature or timer that is present is on.
fn features(dom: &mut DomainSpec) {
    let f = dom.features.get_or_insert_with(Default::default);
    f.acpi
        .get_or_insert_with(FeatureState::default)
        .enabled
        .get_or_insert(true);
    for s in [&mut f.apic, &mut f.smm].into_iter().flatten() {
        s.enabled.get_or_insert(true);
    }
    for s in f.hyperv.iter_mut().flat_map(|h| h.values_mut()) {
        s.enabled.get_or_insert(true);
    }
    if let Some(t) = dom.clock.as_mut().and_then(|c| c.timer.as_mut()) {
        for timer in [
            &mut t.hpet,
            &mut t.kvm,
            &mut t.pit,
            &mut t.rtc,
            &mut t.hyperv,
        ]
        .into_iter()
        .flatten()
        {
            timer.present.get_or_insert(true);
        }
    }
}

fn obj(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// A VMI's UID is a UUID already (KubeVirt gives the domain a UUID of its
/// own, random, kept in the VMI; kvirt writes no spec, so it derives one).
/// Without a UID (manifests read before one is given) the UUID follows
/// from the namespace and name, stable across restarts of kvirtd.
pub fn firmware_uuid(vmi: &VirtualMachineInstance, key: &VmKey) -> String {
    if let Some(u) = vmi.uid().and_then(normalize_uuid) {
        return u;
    }
    let seed = match vmi.uid() {
        Some(uid) => format!("kvirt-uid:{uid}"),
        None => format!("kvirt-name:{}/{}", key.namespace(), key.name()),
    };
    let d = Sha256::digest(seed.as_bytes());
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    // RFC 9562 version 8 (custom), variant 10.
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    format_uuid(&b)
}

/// KubeVirt's `CalculateLegacyUUID`: the firmware UUID of a VM's VMIs,
/// the same for every run, so the guest sees one machine.
pub fn vm_firmware_uuid(vm_name: &str) -> String {
    let u = uuid::Uuid::new_v5(
        &uuid::Uuid::from_bytes(FIRMWARE_UUID_NS),
        vm_name.as_bytes(),
    );
    u.hyphenated().to_string()
}

pub fn format_uuid(b: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*b).hyphenated().to_string()
}

/// Accepts the canonical 8-4-4-4-12 form in any case; returns it lowercased.
pub fn normalize_uuid(s: &str) -> Option<String> {
    let groups: Vec<&str> = s.split('-').collect();
    let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    (lens == [8, 4, 4, 4, 12]
        && groups
            .iter()
            .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit())))
    .then(|| s.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaulted(spec: &str, dt: DomainType) -> Value {
        let mut v = VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\n\
             metadata: {{name: a, namespace: ns, uid: 0f2d3a9c-1111-4222-8333-444455556666}}\n\
             spec: {spec}\n"
        ))
        .unwrap();
        let key = v.key().unwrap();
        apply(&mut v, &key, dt);
        let once = v.clone();
        apply(&mut v, &key, dt);
        assert_eq!(v, once, "defaulting twice changes nothing");
        serde_json::to_value(&v.spec).unwrap()
    }

    fn tcg(spec: &str) -> Value {
        defaulted(spec, DomainType::Qemu)
    }

    /// Each row: a spec, a JSON pointer into the defaulted spec, and what
    /// KubeVirt puts there (`pkg/defaults`, `api/core/v1/defaults.go`).
    #[test]
    fn kubevirts_defaults_field_by_field() {
        let rows: &[(&str, &str, Value)] = &[
            // SetDefaultNetworkInterface (binding: kvirt's masquerade).
            ("{}", "/networks", json!([{"name": "default", "pod": {}}])),
            (
                "{}",
                "/domain/devices/interfaces",
                json!([{"name": "default", "masquerade": {}}]),
            ),
            (
                "{domain: {devices: {autoattachPodInterface: false}}}",
                "/networks",
                Value::Null,
            ),
            (
                "{networks: [{name: n, pod: {}}], domain: {devices: {interfaces: [{name: n, masquerade: {}}]}}}",
                "/networks/1",
                Value::Null,
            ),
            // SetDefaultVolumeDisk, SetDefaults_DiskDevice, amd64 buses.
            (
                "{volumes: [{name: a, emptyDisk: {capacity: 1Gi}}, {name: b, emptyDisk: {capacity: 1Gi}}], domain: {devices: {disks: [{name: b, cdrom: {}}]}}}",
                "/domain/devices/disks",
                json!([
                    {"name": "b", "cdrom": {"bus": "sata", "readonly": true, "tray": "closed"}},
                    {"name": "a", "disk": {"bus": "sata"}}
                ]),
            ),
            (
                "{domain: {devices: {disks: [{name: a, disk: {bus: virtio}}, {name: b, lun: {}}]}}}",
                "/domain/devices/disks",
                json!([{"name": "a", "disk": {"bus": "virtio"}}, {"name": "b", "lun": {"bus": "sata"}}]),
            ),
            (
                "{volumes: [{name: fs, emptyDisk: {capacity: 1Gi}}], domain: {devices: {filesystems: [{name: fs, virtiofs: {}}]}}}",
                "/domain/devices/disks",
                Value::Null,
            ),
            ("{}", "/domain/machine", json!({"type": "q35"})),
            ("{domain: {machine: {type: pc-q35-8.2}}}", "/domain/machine/type", json!("pc-q35-8.2")),
            // SetDefaultGuestCPUTopology.
            ("{}", "/domain/cpu", json!({"sockets": 1, "cores": 1, "threads": 1})),
            (
                "{domain: {resources: {requests: {cpu: 1500m}}}}",
                "/domain/cpu",
                json!({"sockets": 2, "cores": 1, "threads": 1}),
            ),
            (
                "{domain: {resources: {requests: {cpu: 1}, limits: {cpu: 3}}}}",
                "/domain/cpu/sockets",
                json!(3),
            ),
            ("{domain: {cpu: {cores: 2}}}", "/domain/cpu", json!({"cores": 2})),
            // setGuestMemory.
            (
                "{domain: {resources: {requests: {memory: 64Mi}, limits: {memory: 128Mi}}}}",
                "/domain/memory/guest",
                json!("64Mi"),
            ),
            ("{domain: {resources: {limits: {memory: 128Mi}}}}", "/domain/memory/guest", json!("128Mi")),
            ("{domain: {memory: {hugepages: {pageSize: 2Mi}}}}", "/domain/memory/guest", json!("2Mi")),
            ("{domain: {memory: {guest: 1Gi}, resources: {requests: {memory: 64Mi}}}}", "/domain/memory/guest", json!("1Gi")),
            // Features and timers.
            ("{}", "/domain/features", json!({"acpi": {"enabled": true}})),
            ("{domain: {features: {acpi: {enabled: false}}}}", "/domain/features/acpi/enabled", json!(false)),
            ("{domain: {features: {smm: {}, hyperv: {relaxed: {}}}}}", "/domain/features/smm/enabled", json!(true)),
            ("{domain: {features: {hyperv: {relaxed: {}}}}}", "/domain/features/hyperv/relaxed/enabled", json!(true)),
            ("{domain: {clock: {timer: {hpet: {}}}}}", "/domain/clock/timer/hpet/present", json!(true)),
            ("{domain: {clock: {utc: {}}}}", "/domain/clock/timer", Value::Null),
            // setDefaults_Input, SetAmd64Watchdog.
            ("{domain: {devices: {inputs: [{name: t}]}}}", "/domain/devices/inputs/0", json!({"name": "t", "type": "tablet", "bus": "usb"})),
            ("{domain: {devices: {watchdog: {name: w}}}}", "/domain/devices/watchdog/i6300esb/action", json!("reset")),
            // setDefaultPullPoliciesOnContainerDisks.
            ("{volumes: [{name: a, containerDisk: {image: quay.io/x/y}}]}", "/volumes/0/containerDisk/imagePullPolicy", json!("Always")),
            ("{volumes: [{name: a, containerDisk: {image: \"quay.io/x/y:1\"}}]}", "/volumes/0/containerDisk/imagePullPolicy", json!("IfNotPresent")),
            // The firmware UUID: the VMI's UID.
            ("{}", "/domain/firmware/uuid", json!("0f2d3a9c-1111-4222-8333-444455556666")),
            ("{domain: {firmware: {uuid: 5D307CA9-B3EF-428C-8861-06E72D69F223}}}", "/domain/firmware/uuid", json!("5D307CA9-B3EF-428C-8861-06E72D69F223")),
            // Left as KubeVirt leaves it.
            ("{}", "/terminationGracePeriodSeconds", Value::Null),
            ("{}", "/domain/devices/rng", Value::Null),
            ("{}", "/domain/cpu/model", Value::Null),
        ];
        for (spec, ptr, want) in rows {
            let got = tcg(spec).pointer(ptr).cloned().unwrap_or(Value::Null);
            assert_eq!(&got, want, "{spec} at {ptr}");
        }
    }

    #[test]
    fn the_cpu_model_is_host_model_on_kvm_only() {
        let kvm = defaulted("{}", DomainType::Kvm);
        assert_eq!(kvm.pointer("/domain/cpu/model"), Some(&json!("host-model")));
        let own = defaulted("{domain: {cpu: {model: Haswell}}}", DomainType::Kvm);
        assert_eq!(own.pointer("/domain/cpu/model"), Some(&json!("Haswell")));
    }

    #[test]
    fn a_vms_firmware_uuid_is_kubevirts_legacy_uuid() {
        // uuid.NewSHA1(6a1a24a1-4061-4607-8bf4-a3963d0c5895, "testvm"): a
        // version 5 UUID of the bare name, the same for every run.
        let u = vm_firmware_uuid("testvm");
        assert_eq!(u, vm_firmware_uuid("testvm"));
        assert_ne!(u, vm_firmware_uuid("testvm2"));
        // Python's uuid.uuid5 of the same gives this.
        assert_eq!(u, "5a9fc181-957e-5c32-9e5a-2de5e9673531");
    }
}
