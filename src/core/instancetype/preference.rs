//! A preference onto a VM's template (KubeVirt's
//! `pkg/instancetype/preference/apply`): each fills what the template
//! leaves unset; then its requirements are checked.

use super::{add_annotations, check_parts, get, is_set, obj_at, quantity_bytes};
use serde_json::{json, Map, Value};

/// `VirtualMachinePreferenceSpec`'s fields.
pub(super) const FIELDS: &[&str] = &[
    "clock",
    "cpu",
    "devices",
    "features",
    "firmware",
    "machine",
    "volumes",
    "preferredSubdomain",
    "preferredTerminationGracePeriodSeconds",
    "requirements",
    "annotations",
    "preferSpreadSocketToCoreRatio",
    "preferredArchitecture",
];

/// Each part's fields; a field not listed is refused by name.
const PART_FIELDS: &[(&str, &[&str])] = &[
    ("clock", &["preferredClockOffset", "preferredTimer"]),
    (
        "cpu",
        &[
            "preferredCPUTopology",
            "spreadOptions",
            "preferredCPUFeatures",
        ],
    ),
    ("machine", &["preferredMachineType"]),
    ("volumes", &["preferredStorageClassName"]),
    ("requirements", &["cpu", "memory", "architecture"]),
    (
        "features",
        &[
            "preferredAcpi",
            "preferredApic",
            "preferredHyperv",
            "preferredKvm",
            "preferredPvspinlock",
            "preferredSmm",
        ],
    ),
    (
        "firmware",
        &[
            "preferredUseBios",
            "preferredUseBiosSerial",
            "preferredUseEfi",
            "preferredUseSecureBoot",
            "preferredEfi",
        ],
    ),
    (
        "devices",
        &[
            "preferredAutoattachGraphicsDevice",
            "preferredAutoattachMemBalloon",
            "preferredAutoattachPodInterface",
            "preferredAutoattachSerialConsole",
            "preferredAutoattachInputDevice",
            "preferredDisableHotplug",
            "preferredUseVirtioTransitional",
            "preferredBlockMultiQueue",
            "preferredNetworkInterfaceMultiQueue",
            "preferredDiskBus",
            "preferredLunBus",
            "preferredCdromBus",
            "preferredDiskDedicatedIoThread",
            "preferredDiskCache",
            "preferredDiskIO",
            "preferredDiskBlockSize",
            "preferredInputBus",
            "preferredInputType",
            "preferredInterfaceModel",
            "preferredInterfaceMasquerade",
            "preferredRng",
            "preferredTPM",
            "preferredSoundModel",
            "preferredVirtualGPUOptions",
            "preferredPanicDeviceModel",
            "preferredVideoType",
        ],
    ),
];

/// `devices.preferredX` → `domain.devices.x`, set where unset.
const DEVICE_FLAGS: &[(&str, &str)] = &[
    (
        "preferredAutoattachGraphicsDevice",
        "autoattachGraphicsDevice",
    ),
    ("preferredAutoattachMemBalloon", "autoattachMemBalloon"),
    ("preferredAutoattachPodInterface", "autoattachPodInterface"),
    (
        "preferredAutoattachSerialConsole",
        "autoattachSerialConsole",
    ),
    ("preferredAutoattachInputDevice", "autoattachInputDevice"),
    ("preferredUseVirtioTransitional", "useVirtioTransitional"),
    ("preferredBlockMultiQueue", "blockMultiQueue"),
    (
        "preferredNetworkInterfaceMultiQueue",
        "networkInterfaceMultiqueue",
    ),
    ("preferredRng", "rng"),
    ("preferredTPM", "tpm"),
];

/// `features.preferredX` → `domain.features.x`, set where unset.
const FEATURES: &[(&str, &str)] = &[
    ("preferredApic", "apic"),
    ("preferredHyperv", "hyperv"),
    ("preferredKvm", "kvm"),
    ("preferredPvspinlock", "pvspinlock"),
    ("preferredSmm", "smm"),
];

pub(super) fn apply(template: &mut Value, pref: &Value) -> Result<(), String> {
    check_parts(pref, PART_FIELDS, "preference")?;
    let p = |path: &[&str]| get(pref, path).cloned();
    let spec = &mut template["spec"];
    devices(spec, pref);
    let features = obj_at(spec, &["domain", "features"]);
    if let Some(acpi) = p(&["features", "preferredAcpi"]) {
        // KubeVirt's exception: the VMI's ACPI is no pointer, so always.
        features.insert("acpi".into(), acpi);
    }
    for (from, to) in FEATURES {
        if let Some(v) = p(&["features", from]) {
            features.entry(*to).or_insert(v);
        }
    }
    firmware(spec, pref);
    if let Some(t) = p(&["machine", "preferredMachineType"]).filter(|t| is_set(Some(t))) {
        let m = obj_at(spec, &["domain", "machine"]);
        if !is_set(m.get("type")) {
            m.insert("type".into(), t);
        }
    }
    clock(spec, pref);
    if let Some(fs) = p(&["cpu", "preferredCPUFeatures"]).and_then(|f| f.as_array().cloned()) {
        let cpu = obj_at(spec, &["domain", "cpu"]);
        let list = cpu.entry("features").or_insert_with(|| json!([]));
        if let Some(list) = list.as_array_mut() {
            for f in fs {
                if !list.iter().any(|g| g.get("name") == f.get("name")) {
                    list.push(f);
                }
            }
        }
    }
    let top = spec.as_object_mut().expect("spec is an object");
    for (from, to) in [
        (
            "preferredTerminationGracePeriodSeconds",
            "terminationGracePeriodSeconds",
        ),
        ("preferredSubdomain", "subdomain"),
        ("preferredArchitecture", "architecture"),
    ] {
        if let Some(v) = p(&[from]) {
            top.entry(to).or_insert(v);
        }
    }
    add_annotations(template, pref);
    Ok(())
}

fn devices(spec: &mut Value, pref: &Value) {
    let p = |k: &str| get(pref, &["devices", k]).cloned();
    let dev = obj_at(spec, &["domain", "devices"]);
    for (from, to) in DEVICE_FLAGS {
        if let Some(v) = p(from) {
            dev.entry(*to).or_insert(v);
        }
    }
    if let Some(v) = p("preferredDisableHotplug") {
        dev.insert("disableHotplug".into(), v);
    }
    for d in list(dev, "disks") {
        if !["disk", "cdrom", "lun"].iter().any(|t| d.contains_key(*t)) {
            d.insert("disk".into(), json!({}));
        }
        for (kind, pref_bus) in [
            ("disk", "preferredDiskBus"),
            ("cdrom", "preferredCdromBus"),
            ("lun", "preferredLunBus"),
        ] {
            if let (Some(bus), Some(Value::Object(t))) = (p(pref_bus), d.get_mut(kind)) {
                if !is_set(t.get("bus")) {
                    t.insert("bus".into(), bus);
                }
            }
        }
        for (from, to) in [
            ("preferredDiskCache", "cache"),
            ("preferredDiskIO", "io"),
            ("preferredDiskBlockSize", "blockSize"),
        ] {
            if let Some(v) = p(from) {
                d.entry(to).or_insert(v);
            }
        }
        let virtio = d
            .get("disk")
            .and_then(|t| t.get("bus"))
            .and_then(Value::as_str)
            == Some("virtio");
        if let (true, Some(v)) = (virtio, p("preferredDiskDedicatedIoThread")) {
            d.entry("dedicatedIOThread").or_insert(v);
        }
    }
    for i in list(dev, "inputs") {
        for (from, to) in [("preferredInputBus", "bus"), ("preferredInputType", "type")] {
            if let Some(v) = p(from) {
                if !is_set(i.get(to)) {
                    i.insert(to.into(), v);
                }
            }
        }
    }
    for i in list(dev, "interfaces") {
        if let Some(m) = p("preferredInterfaceModel") {
            if !is_set(i.get("model")) {
                i.insert("model".into(), m);
            }
        }
        const BINDINGS: &[&str] = &["bridge", "masquerade", "sriov", "passt", "slirp", "binding"];
        if let Some(m) = p("preferredInterfaceMasquerade") {
            if !BINDINGS.iter().any(|b| i.contains_key(*b)) {
                i.insert("masquerade".into(), m);
            }
        }
    }
    if let Some(model) = p("preferredSoundModel") {
        if let Some(Value::Object(sound)) = dev.get_mut("sound") {
            sound.entry("model").or_insert(model);
        }
    }
    if let Some(model) = p("preferredPanicDeviceModel") {
        let panic = dev.entry("panicDevices").or_insert_with(|| json!([{}]));
        for d in panic
            .as_array_mut()
            .into_iter()
            .flatten()
            .filter_map(Value::as_object_mut)
        {
            d.entry("model").or_insert_with(|| model.clone());
        }
    }
    if let Some(t) = p("preferredVideoType") {
        let video = dev.entry("video").or_insert_with(|| json!({}));
        if let Some(v) = video.as_object_mut() {
            v.entry("type").or_insert(t);
        }
    }
    if let Some(opts) = p("preferredVirtualGPUOptions") {
        for g in list(dev, "gpus") {
            g.entry("virtualGPUOptions").or_insert_with(|| opts.clone());
        }
    }
}

/// The objects of a list field, if it is one.
fn list<'a>(
    dev: &'a mut Map<String, Value>,
    key: &str,
) -> impl Iterator<Item = &'a mut Map<String, Value>> {
    dev.get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(Value::as_object_mut)
}

/// BIOS or EFI, only when the template chose neither.
fn firmware(spec: &mut Value, pref: &Value) {
    let p = |k: &str| get(pref, &["firmware", k]).cloned();
    let boot = obj_at(spec, &["domain", "firmware", "bootloader"]);
    if boot.contains_key("bios") || boot.contains_key("efi") {
        return;
    }
    if let Some(efi) = p("preferredEfi") {
        boot.insert("efi".into(), efi);
    } else if p("preferredUseEfi") == Some(json!(true)) {
        let secure = p("preferredUseSecureBoot").unwrap_or(json!(false));
        boot.insert("efi".into(), json!({"secureBoot": secure}));
    } else if p("preferredUseBios") == Some(json!(true)) {
        let mut bios = json!({});
        if let Some(s) = p("preferredUseBiosSerial") {
            bios["useSerial"] = s;
        }
        boot.insert("bios".into(), bios);
    }
    if boot.is_empty() {
        let fw = obj_at(spec, &["domain", "firmware"]);
        fw.remove("bootloader");
        if fw.is_empty() {
            obj_at(spec, &["domain"]).remove("firmware");
        }
    }
}

/// The clock's offset when the template gives none; timers likewise.
fn clock(spec: &mut Value, pref: &Value) {
    let offset = get(pref, &["clock", "preferredClockOffset"]).and_then(Value::as_object);
    let timer = get(pref, &["clock", "preferredTimer"]).cloned();
    if offset.is_none() && timer.is_none() {
        return;
    }
    let clock = obj_at(spec, &["domain", "clock"]);
    if let Some(o) = offset {
        if !clock.contains_key("utc") && !clock.contains_key("timezone") {
            for (k, v) in o {
                clock.insert(k.clone(), v.clone());
            }
        }
    }
    if let Some(t) = timer {
        clock.entry("timer").or_insert(t);
    }
}

/// The preference's requirements, met by the instancetype or else by the
/// template, in KubeVirt's words.
pub(super) fn requirements(
    template: &Value,
    pref: &Value,
    it: Option<&Value>,
) -> Result<(), String> {
    let fail = |why: String| Err(format!("failure checking preference requirements: {why}"));
    let req = |p: &[&str]| get(pref, &[&["requirements"], p].concat()).cloned();
    let spec = template.get("spec").cloned().unwrap_or_default();
    if let Some(need) = req(&["cpu", "guest"]).and_then(|v| v.as_u64()) {
        match it {
            Some(it) => {
                let have = it
                    .pointer("/cpu/guest")
                    .and_then(Value::as_u64)
                    .unwrap_or(0);
                if have < need {
                    return fail(format!(
                        "insufficient CPU resources of {have} vCPU provided by instance type, \
                         preference requires {need} vCPU"
                    ));
                }
            }
            None => {
                let Some(cpu) = get(&spec, &["domain", "cpu"]) else {
                    return fail(format!(
                        "no CPU resources provided by VirtualMachine, preference requires {need} vCPU"
                    ));
                };
                let n = |k: &str| cpu.get(k).and_then(Value::as_u64).unwrap_or(1);
                let have = n("sockets") * n("cores") * n("threads");
                if have < need {
                    return fail(format!(
                        "insufficient CPU resources of {have} vCPU provided by VirtualMachine, \
                         preference requires {need} vCPU provided as sockets, cores and threads"
                    ));
                }
            }
        }
    }
    if let Some(need) = req(&["memory", "guest"]) {
        let need_b = quantity_bytes(&need).unwrap_or(u64::MAX);
        let (have, from) = match it {
            Some(it) => (it.pointer("/memory/guest").cloned(), "instance type"),
            None => (
                get(&spec, &["domain", "memory", "guest"]).cloned(),
                "VirtualMachine",
            ),
        };
        let have_b = have.as_ref().and_then(quantity_bytes).unwrap_or(0);
        if have_b < need_b {
            let shown = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            return fail(format!(
                "insufficient Memory resources of {} provided by {from}, preference requires {}",
                have.as_ref().map_or("nothing".into(), shown),
                shown(&need)
            ));
        }
    }
    if let Some(arch) = req(&["architecture"]).and_then(|a| a.as_str().map(str::to_owned)) {
        let asked = spec
            .get("architecture")
            .and_then(Value::as_str)
            .unwrap_or("amd64");
        if arch != asked {
            return fail(format!(
                "preference requires architecture {arch} but {asked} is being requested"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn y(s: &str) -> Value {
        serde_norway::from_str(s).unwrap()
    }

    fn applied(template: &str, pref: &str) -> Value {
        let mut t = y(template);
        obj_at(&mut t, &["spec"]);
        apply(&mut t, &y(pref)).unwrap();
        t
    }

    /// Each row: a template, a preference, a pointer into the result and
    /// what KubeVirt puts there.
    #[test]
    fn preferences_fill_only_what_the_template_leaves_unset() {
        let rows: &[(&str, &str, &str, Value)] = &[
            ("{spec: {domain: {devices: {disks: [{name: a}]}}}}", "{devices: {preferredDiskBus: virtio}}", "/spec/domain/devices/disks/0/disk/bus", json!("virtio")),
            ("{spec: {domain: {devices: {disks: [{name: a, disk: {bus: sata}}]}}}}", "{devices: {preferredDiskBus: virtio}}", "/spec/domain/devices/disks/0/disk/bus", json!("sata")),
            ("{spec: {domain: {devices: {disks: [{name: a, cdrom: {}}]}}}}", "{devices: {preferredCdromBus: scsi, preferredDiskBus: virtio}}", "/spec/domain/devices/disks/0/cdrom/bus", json!("scsi")),
            ("{spec: {domain: {devices: {disks: [{name: a, disk: {bus: virtio}}]}}}}", "{devices: {preferredDiskDedicatedIoThread: true, preferredDiskCache: none}}", "/spec/domain/devices/disks/0", json!({"name": "a", "disk": {"bus": "virtio"}, "dedicatedIOThread": true, "cache": "none"})),
            ("{spec: {domain: {devices: {disks: [{name: a, disk: {bus: sata}}]}}}}", "{devices: {preferredDiskDedicatedIoThread: true}}", "/spec/domain/devices/disks/0/dedicatedIOThread", Value::Null),
            ("{spec: {domain: {devices: {interfaces: [{name: d}]}}}}", "{devices: {preferredInterfaceModel: e1000, preferredInterfaceMasquerade: {}}}", "/spec/domain/devices/interfaces/0", json!({"name": "d", "model": "e1000", "masquerade": {}})),
            ("{spec: {domain: {devices: {interfaces: [{name: d, model: virtio, masquerade: {}}]}}}}", "{devices: {preferredInterfaceModel: e1000}}", "/spec/domain/devices/interfaces/0/model", json!("virtio")),
            ("{spec: {}}", "{devices: {preferredRng: {}, preferredAutoattachGraphicsDevice: false}}", "/spec/domain/devices", json!({"rng": {}, "autoattachGraphicsDevice": false})),
            ("{spec: {domain: {devices: {autoattachGraphicsDevice: true}}}}", "{devices: {preferredAutoattachGraphicsDevice: false}}", "/spec/domain/devices/autoattachGraphicsDevice", json!(true)),
            ("{spec: {domain: {devices: {inputs: [{name: t}]}}}}", "{devices: {preferredInputBus: virtio, preferredInputType: tablet}}", "/spec/domain/devices/inputs/0", json!({"name": "t", "bus": "virtio", "type": "tablet"})),
            ("{spec: {}}", "{features: {preferredSmm: {}, preferredAcpi: {enabled: false}}}", "/spec/domain/features", json!({"smm": {}, "acpi": {"enabled": false}})),
            ("{spec: {domain: {features: {smm: {enabled: false}}}}}", "{features: {preferredSmm: {}}}", "/spec/domain/features/smm", json!({"enabled": false})),
            ("{spec: {}}", "{firmware: {preferredEfi: {secureBoot: true}}}", "/spec/domain/firmware/bootloader", json!({"efi": {"secureBoot": true}})),
            ("{spec: {}}", "{firmware: {preferredUseEfi: true}}", "/spec/domain/firmware/bootloader", json!({"efi": {"secureBoot": false}})),
            ("{spec: {}}", "{firmware: {preferredUseBios: true, preferredUseBiosSerial: true}}", "/spec/domain/firmware/bootloader", json!({"bios": {"useSerial": true}})),
            ("{spec: {domain: {firmware: {bootloader: {bios: {}}}}}}", "{firmware: {preferredEfi: {}}}", "/spec/domain/firmware/bootloader", json!({"bios": {}})),
            ("{spec: {}}", "{machine: {preferredMachineType: pc-q35-9.2}}", "/spec/domain/machine/type", json!("pc-q35-9.2")),
            ("{spec: {domain: {machine: {type: q35}}}}", "{machine: {preferredMachineType: pc-q35-9.2}}", "/spec/domain/machine/type", json!("q35")),
            ("{spec: {}}", "{clock: {preferredClockOffset: {utc: {offsetSeconds: 60}}, preferredTimer: {rtc: {}}}}", "/spec/domain/clock", json!({"utc": {"offsetSeconds": 60}, "timer": {"rtc": {}}})),
            ("{spec: {domain: {clock: {timezone: UTC}}}}", "{clock: {preferredClockOffset: {utc: {}}}}", "/spec/domain/clock", json!({"timezone": "UTC"})),
            ("{spec: {domain: {cpu: {features: [{name: vmx}]}}}}", "{cpu: {preferredCPUFeatures: [{name: vmx, policy: disable}, {name: pcid}]}}", "/spec/domain/cpu/features", json!([{"name": "vmx"}, {"name": "pcid"}])),
            ("{spec: {}}", "{preferredTerminationGracePeriodSeconds: 5, preferredSubdomain: s}", "/spec/terminationGracePeriodSeconds", json!(5)),
            ("{spec: {terminationGracePeriodSeconds: 9}}", "{preferredTerminationGracePeriodSeconds: 5}", "/spec/terminationGracePeriodSeconds", json!(9)),
            ("{metadata: {annotations: {a: mine}}, spec: {}}", "{annotations: {a: theirs, b: x}}", "/metadata/annotations", json!({"a": "mine", "b": "x"})),
        ];
        for (template, pref, ptr, want) in rows {
            let got = applied(template, pref)
                .pointer(ptr)
                .cloned()
                .unwrap_or(Value::Null);
            assert_eq!(&got, want, "{template} + {pref} at {ptr}");
        }
    }

    #[test]
    fn unknown_preference_fields_are_refused_by_name() {
        let mut t = y("{spec: {}}");
        let e = apply(&mut t, &y("{devices: {preferredHoverboard: true}}")).unwrap_err();
        assert_eq!(
            e,
            "preference spec.devices.preferredHoverboard is not supported by kvirt"
        );
    }

    #[test]
    fn requirements_in_kubevirts_words() {
        let req = "{requirements: {cpu: {guest: 2}, memory: {guest: 2Gi}}}";
        let small = y("{cpu: {guest: 1}, memory: {guest: 4Gi}}");
        let e = requirements(&y("{spec: {}}"), &y(req), Some(&small)).unwrap_err();
        assert_eq!(e, "failure checking preference requirements: insufficient CPU resources of 1 vCPU provided by instance type, preference requires 2 vCPU");
        let little = y("{cpu: {guest: 2}, memory: {guest: 1Gi}}");
        let e = requirements(&y("{spec: {}}"), &y(req), Some(&little)).unwrap_err();
        assert_eq!(e, "failure checking preference requirements: insufficient Memory resources of 1Gi provided by instance type, preference requires 2Gi");
        let e = requirements(&y("{spec: {}}"), &y(req), None).unwrap_err();
        assert!(
            e.contains("no CPU resources provided by VirtualMachine"),
            "{e}"
        );
        let t = y("{spec: {domain: {cpu: {sockets: 2}, memory: {guest: 2Gi}}}}");
        requirements(&t, &y(req), None).unwrap();
        let e = requirements(&t, &y("{requirements: {architecture: arm64}}"), None).unwrap_err();
        assert!(
            e.ends_with("preference requires architecture arm64 but amd64 is being requested"),
            "{e}"
        );
    }
}
