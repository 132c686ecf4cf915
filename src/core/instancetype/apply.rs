//! An instancetype's fields onto a VM's template (KubeVirt's
//! `pkg/instancetype/apply`): they are the VM's, so a template that sets
//! one too conflicts.

use super::{add_annotations, check_parts, get, is_set, obj_at, quantity_bytes};
use serde_json::{json, Value};

/// `VirtualMachineInstancetypeSpec`'s fields.
pub(super) const FIELDS: &[&str] = &[
    "cpu",
    "memory",
    "gpus",
    "hostDevices",
    "ioThreadsPolicy",
    "ioThreads",
    "launchSecurity",
    "annotations",
    "nodeSelector",
    "schedulerName",
];
const CPU_FIELDS: &[&str] = &[
    "guest",
    "model",
    "dedicatedCPUPlacement",
    "numa",
    "isolateEmulatorThread",
    "realtime",
    "maxSockets",
];
const MEMORY_FIELDS: &[&str] = &["guest", "hugepages", "overcommitPercent", "maxGuest"];
/// Where the template's fields are, in KubeVirt's conflict messages.
const BASE: &str = "spec.template.spec";

/// Instancetype field → the VMI field it sets, below `spec`.
const COPIED: &[(&[&str], &[&str])] = &[
    (&["cpu", "model"], &["domain", "cpu", "model"]),
    (
        &["cpu", "dedicatedCPUPlacement"],
        &["domain", "cpu", "dedicatedCpuPlacement"],
    ),
    (
        &["cpu", "isolateEmulatorThread"],
        &["domain", "cpu", "isolateEmulatorThread"],
    ),
    (&["cpu", "numa"], &["domain", "cpu", "numa"]),
    (&["cpu", "realtime"], &["domain", "cpu", "realtime"]),
    (&["cpu", "maxSockets"], &["domain", "cpu", "maxSockets"]),
    (&["memory", "hugepages"], &["domain", "memory", "hugepages"]),
    (&["memory", "maxGuest"], &["domain", "memory", "maxGuest"]),
    (&["gpus"], &["domain", "devices", "gpus"]),
    (&["hostDevices"], &["domain", "devices", "hostDevices"]),
    (&["ioThreadsPolicy"], &["domain", "ioThreadsPolicy"]),
    (&["ioThreads"], &["domain", "ioThreads"]),
    (&["launchSecurity"], &["domain", "launchSecurity"]),
    (&["nodeSelector"], &["nodeSelector"]),
    (&["schedulerName"], &["schedulerName"]),
];

pub(super) fn instancetype(
    template: &mut Value,
    it: &Value,
    pref: Option<&Value>,
) -> Result<(), String> {
    check_parts(
        it,
        &[("cpu", CPU_FIELDS), ("memory", MEMORY_FIELDS)],
        "instancetype",
    )?;
    let found = conflicts(template, it);
    if !found.is_empty() {
        return Err(format!(
            "VM field(s) {} conflicts with selected instance type",
            found.join(", ")
        ));
    }
    let guest = it
        .pointer("/cpu/guest")
        .and_then(Value::as_u64)
        .unwrap_or(1) as u32;
    let (sockets, cores, threads) = topology(guest, pref)?;
    let spec = &mut template["spec"];
    let cpu = obj_at(spec, &["domain", "cpu"]);
    cpu.insert("sockets".into(), sockets.into());
    cpu.insert("cores".into(), cores.into());
    cpu.insert("threads".into(), threads.into());
    let guest_mem = it.pointer("/memory/guest").cloned().unwrap_or_default();
    let bytes = quantity_bytes(&guest_mem).unwrap_or(0);
    obj_at(spec, &["domain", "memory"]).insert("guest".into(), guest_mem);
    let over = it
        .pointer("/memory/overcommitPercent")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if over > 100 {
        return Err(format!(
            "instancetype spec.memory.overcommitPercent: {over} is over 100"
        ));
    }
    if over > 0 {
        let request = bytes / 100 * (100 - over) + bytes % 100 * (100 - over) / 100;
        obj_at(spec, &["domain", "resources", "requests"])
            .insert("memory".into(), request.to_string().into());
    }
    for (from, to) in COPIED {
        if let Some(v) = get(it, from) {
            let (last, parents) = to.split_last().expect("a path");
            obj_at(spec, parents).insert((*last).into(), v.clone());
        }
    }
    add_annotations(template, it);
    Ok(())
}

/// The template fields the instancetype also sets, by KubeVirt's rules.
fn conflicts(template: &Value, it: &Value) -> Vec<String> {
    let spec = template.get("spec").cloned().unwrap_or_default();
    let vm = |p: &[&str]| get(&spec, p);
    let mine = |p: &[&str]| get(it, p);
    let mut found = Vec::new();
    let mut add = |p: &[&str]| found.push(format!("{BASE}.{}", p.join(".")));
    for f in ["sockets", "cores", "threads"] {
        if is_set(vm(&["domain", "cpu", f])) {
            add(&["domain", "cpu", f]);
        }
    }
    for res in ["cpu", "memory"] {
        for which in ["requests", "limits"] {
            if vm(&["domain", "resources", which, res]).is_some() {
                add(&["domain", "resources", which, res]);
            }
        }
    }
    if is_set(vm(&["domain", "memory", "guest"])) {
        add(&["domain", "memory", "guest"]);
    }
    // Set by both (a flag only when the template turns it on).
    for (from, to) in COPIED {
        let theirs = mine(from);
        let ours = vm(to);
        let clash = match theirs {
            None => false,
            Some(_) if to.last() == Some(&"dedicatedCpuPlacement") => ours == Some(&json!(true)),
            Some(_) if to.last() == Some(&"isolateEmulatorThread") => ours == Some(&json!(true)),
            Some(_) if to.last() == Some(&"maxSockets") => false,
            Some(_) => is_set(ours) || ours.is_some_and(Value::is_object),
        };
        if clash {
            add(to);
        }
    }
    let ann = template.pointer("/metadata/annotations");
    for (k, v) in it
        .get("annotations")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        if ann.and_then(|a| a.get(k)).is_some_and(|mine| mine != v) {
            found.push(format!("annotations.{k}"));
        }
    }
    found
}

/// The instancetype's vCPUs as sockets, cores and threads, by the
/// preference's `preferredCPUTopology` (default: sockets).
fn topology(guest: u32, pref: Option<&Value>) -> Result<(u32, u32, u32), String> {
    if guest <= 1 {
        return Ok((1, 1, 1));
    }
    let cpu = pref.and_then(|p| p.get("cpu"));
    let how = cpu
        .and_then(|c| c.get("preferredCPUTopology"))
        .and_then(Value::as_str)
        .unwrap_or("sockets");
    let spread = || -> Result<(u32, u32, u32), String> {
        let opts = cpu.and_then(|c| c.get("spreadOptions"));
        let ratio = opts
            .and_then(|o| o.get("ratio"))
            .and_then(Value::as_u64)
            .or_else(|| pref?.get("preferSpreadSocketToCoreRatio")?.as_u64())
            .filter(|&r| r > 0)
            .unwrap_or(2) as u32;
        let across = opts
            .and_then(|o| o.get("across"))
            .and_then(Value::as_str)
            .unwrap_or("SocketsCores");
        let not_divisible = |by: u32| {
            format!(
                "{guest} vCPUs provided by the instance type are not divisible by the \
                 Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio \
                 of {by} provided by the preference"
            )
        };
        match across {
            "SocketsCores" if guest % ratio == 0 => Ok((guest / ratio, ratio, 1)),
            "CoresThreads" if ratio == 2 && guest % 2 == 0 => Ok((1, guest / 2, 2)),
            "SocketsCoresThreads" if guest % (2 * ratio) == 0 => Ok((guest / 2 / ratio, ratio, 2)),
            "SocketsCores" | "SocketsCoresThreads" => Err(not_divisible(ratio)),
            "CoresThreads" => Err(not_divisible(2)),
            other => Err(format!(
                "preference spec.cpu.spreadOptions.across: {other:?} is not SocketsCores, \
                 CoresThreads or SocketsCoresThreads"
            )),
        }
    };
    match how {
        "sockets" | "preferSockets" | "any" | "preferAny" => Ok((guest, 1, 1)),
        "cores" | "preferCores" => Ok((1, guest, 1)),
        "threads" | "preferThreads" => Ok((1, 1, guest)),
        "spread" | "preferSpread" => spread(),
        other => Err(format!(
            "preference spec.cpu.preferredCPUTopology: {other:?} is not sockets, cores, \
             threads, spread or any"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn it(y: &str) -> Value {
        serde_norway::from_str(y).unwrap()
    }

    fn applied(template: &str, instancetype: &str, pref: Option<&str>) -> Result<Value, String> {
        let mut t = it(template);
        let p = pref.map(it);
        instancetype_into(&mut t, &it(instancetype), p.as_ref())?;
        Ok(t)
    }

    fn instancetype_into(t: &mut Value, i: &Value, p: Option<&Value>) -> Result<(), String> {
        obj_at(t, &["spec"]);
        instancetype(t, i, p)
    }

    #[test]
    fn cpu_and_memory_become_the_vms() {
        let t = applied(
            "{spec: {domain: {devices: {}}}}",
            "{cpu: {guest: 4, model: Haswell, dedicatedCPUPlacement: true}, memory: {guest: 2Gi, overcommitPercent: 25}, nodeSelector: {a: b}, schedulerName: s, annotations: {x: y}}",
            None,
        )
        .unwrap();
        let s = &t["spec"];
        assert_eq!(
            s["domain"]["cpu"],
            json!({"sockets": 4, "cores": 1, "threads": 1, "model": "Haswell", "dedicatedCpuPlacement": true})
        );
        assert_eq!(s["domain"]["memory"]["guest"], "2Gi");
        // 2Gi less 25 %.
        assert_eq!(s["domain"]["resources"]["requests"]["memory"], "1610612736");
        assert_eq!(s["nodeSelector"], json!({"a": "b"}));
        assert_eq!(s["schedulerName"], "s");
        assert_eq!(t["metadata"]["annotations"]["x"], "y");
    }

    #[test]
    fn template_fields_it_sets_are_conflicts_named_as_kubevirt_names_them() {
        let e = applied(
            "{metadata: {annotations: {x: other}}, spec: {domain: {cpu: {sockets: 2, model: host-model}, memory: {guest: 1Gi}, resources: {requests: {memory: 1Gi}}}, nodeSelector: {}}}",
            "{cpu: {guest: 1, model: Haswell}, memory: {guest: 1Gi}, nodeSelector: {a: b}, annotations: {x: y}}",
            None,
        )
        .unwrap_err();
        assert_eq!(
            e,
            "VM field(s) spec.template.spec.domain.cpu.sockets, \
             spec.template.spec.domain.resources.requests.memory, \
             spec.template.spec.domain.memory.guest, spec.template.spec.domain.cpu.model, \
             spec.template.spec.nodeSelector, annotations.x conflicts with selected instance type"
        );
        // A flag the template leaves off, or the same annotation, is fine.
        applied(
            "{metadata: {annotations: {x: y}}, spec: {domain: {cpu: {dedicatedCpuPlacement: false}}}}",
            "{cpu: {guest: 1, dedicatedCPUPlacement: true}, memory: {guest: 1Gi}, annotations: {x: y}}",
            None,
        )
        .unwrap();
    }

    #[test]
    fn the_preference_chooses_the_topology() {
        let topo = |guest, pref: &str| topology(guest, Some(&it(pref)));
        assert_eq!(topology(4, None), Ok((4, 1, 1)));
        assert_eq!(
            topo(1, "{cpu: {preferredCPUTopology: cores}}"),
            Ok((1, 1, 1))
        );
        assert_eq!(
            topo(4, "{cpu: {preferredCPUTopology: cores}}"),
            Ok((1, 4, 1))
        );
        assert_eq!(
            topo(4, "{cpu: {preferredCPUTopology: preferThreads}}"),
            Ok((1, 1, 4))
        );
        assert_eq!(topo(4, "{cpu: {preferredCPUTopology: any}}"), Ok((4, 1, 1)));
        assert_eq!(
            topo(8, "{cpu: {preferredCPUTopology: spread}}"),
            Ok((4, 2, 1))
        );
        assert_eq!(
            topo(
                12,
                "{cpu: {preferredCPUTopology: spread, spreadOptions: {ratio: 3}}}"
            ),
            Ok((4, 3, 1))
        );
        assert_eq!(
            topo(12, "{preferSpreadSocketToCoreRatio: 3, cpu: {preferredCPUTopology: spread, spreadOptions: {across: SocketsCoresThreads}}}"),
            Ok((2, 3, 2))
        );
        assert_eq!(
            topo(
                8,
                "{cpu: {preferredCPUTopology: spread, spreadOptions: {across: CoresThreads}}}"
            ),
            Ok((1, 4, 2))
        );
        let e = topo(
            6,
            "{cpu: {preferredCPUTopology: spread, spreadOptions: {ratio: 4}}}",
        )
        .unwrap_err();
        assert!(
            e.contains("6 vCPUs provided by the instance type are not divisible"),
            "{e}"
        );
        assert!(topo(2, "{cpu: {preferredCPUTopology: diagonal}}").is_err());
    }

    #[test]
    fn fields_kvirt_does_not_know_are_refused_by_name() {
        let e = applied(
            "{spec: {}}",
            "{cpu: {guest: 1, bogus: 1}, memory: {guest: 1Gi}}",
            None,
        )
        .unwrap_err();
        assert_eq!(e, "instancetype spec.cpu.bogus is not supported by kvirt");
    }
}
