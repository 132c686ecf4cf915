//! vCPU count, topology and CPU model.

use super::domain::{Cpu, CpuFeature, CpuModel, CpuSetAttr, CpuTune, Topology, VcpuPin};
use super::memory::ResourceSpec;
use super::{DomainType, Errors};
use crate::core::cpuset::CpuSet;
use crate::core::vmi;

/// Far above any host kvirt targets; keeps a typo from asking QEMU for
/// millions of vCPUs.
const MAX_VCPUS: u32 = 1024;

const PATH: &str = "spec.domain.cpu";

pub(super) fn convert(
    cpu: Option<&vmi::Cpu>,
    res: &ResourceSpec,
    domain_type: DomainType,
    errs: &mut Errors,
) -> (Cpu, u32) {
    let (topology, vcpus) = topology(cpu, res, errs);
    let mut mode = match domain_type {
        DomainType::Kvm => Some("host-passthrough"),
        // TCG cannot pass the host CPU through; QEMU's default model it is.
        DomainType::Qemu => None,
    };
    let mut model = None;
    let mut feature = Vec::new();
    if let Some(c) = cpu {
        for (key, why) in [
            ("numa", "guest NUMA topology is not supported yet"),
            ("realtime", "realtime vCPUs are not supported yet"),
        ] {
            if c.extra.contains_key(key) {
                errs.add(format!("{PATH}.{key}"), why);
            }
        }
        let mut rest = c.extra.clone();
        for key in [
            "dedicatedCpuPlacement",
            "isolateEmulatorThread",
            "numa",
            "realtime",
        ] {
            rest.remove(key);
        }
        errs.reject_extra(PATH, &rest);
        match (c.model.as_deref(), domain_type) {
            (None, _) => {}
            (Some(m @ ("host-passthrough" | "host-model")), DomainType::Kvm) => {
                mode = Some(if m == "host-model" {
                    "host-model"
                } else {
                    "host-passthrough"
                })
            }
            (Some(m @ ("host-passthrough" | "host-model")), DomainType::Qemu) => errs.add(
                format!("{PATH}.model"),
                format!("{m} needs KVM, but this host emulates CPUs (domain type qemu)"),
            ),
            (Some(m), _) if is_name(m) => {
                mode = Some("custom");
                model = Some(CpuModel {
                    fallback: "forbid",
                    name: m.to_owned(),
                });
            }
            (Some(m), _) => errs.add(
                format!("{PATH}.model"),
                format!("{m:?} is not a CPU model name"),
            ),
        }
        for (i, f) in c.features.iter().flatten().enumerate() {
            let p = format!("{PATH}.features[{i}]");
            errs.reject_extra(&p, &f.extra);
            if !is_name(&f.name) {
                errs.add(
                    format!("{p}.name"),
                    format!("{:?} is not a CPU feature name", f.name),
                );
            }
            let policy = match f.policy.as_deref().unwrap_or("require") {
                "force" => "force",
                "require" => "require",
                "optional" => "optional",
                "disable" => "disable",
                "forbid" => "forbid",
                other => {
                    errs.add(
                        format!("{p}.policy"),
                        format!("{other:?} is not force, require, optional, disable or forbid"),
                    );
                    "require"
                }
            };
            feature.push(CpuFeature {
                policy,
                name: f.name.clone(),
            });
        }
        if !feature.is_empty() && mode.is_none() {
            errs.add(
                format!("{PATH}.features"),
                "an emulated CPU needs a model for features (set cpu.model)",
            );
        }
    }
    (
        Cpu {
            mode,
            model,
            topology,
            feature,
        },
        vcpus,
    )
}

/// How many host CPUs a VMI with `dedicatedCpuPlacement` holds: one per
/// vCPU, and one more for QEMU's own threads with `isolateEmulatorThread`.
/// `None`: it shares the host's CPUs (or its CPU block is refused anyway).
pub fn dedicated_cpus_wanted(vmi: &vmi::VirtualMachineInstance) -> Option<u32> {
    let dom = &vmi.spec.domain;
    let cpu = dom.cpu.as_ref()?;
    if flag(cpu, "dedicatedCpuPlacement", &mut Errors::default()) != Some(true) {
        return None;
    }
    let mut errs = Errors::default();
    let res = ResourceSpec::parse(dom.resources.as_ref(), &mut errs);
    let (_, vcpus) = topology(Some(cpu), &res, &mut errs);
    let isolate = flag(cpu, "isolateEmulatorThread", &mut errs) == Some(true);
    Some(vcpus + u32::from(isolate))
}

/// Dedicated CPUs as libvirt pins them, checked as KubeVirt's admission
/// checks them: vCPU `i` on the `i`th of `placed`, the emulator on the
/// extra one (`isolateEmulatorThread`) or on the vCPUs' own.
pub(super) fn pinning(
    cpu: Option<&vmi::Cpu>,
    res: &ResourceSpec,
    vcpus: u32,
    placed: Option<&CpuSet>,
    errs: &mut Errors,
) -> Option<CpuTune> {
    let c = cpu?;
    let dedicated = flag(c, "dedicatedCpuPlacement", errs) == Some(true);
    let isolate = flag(c, "isolateEmulatorThread", errs) == Some(true);
    let field = format!("{PATH}.dedicatedCpuPlacement");
    if isolate && !dedicated {
        errs.add(
            format!("{PATH}.isolateEmulatorThread"),
            "only goes with dedicatedCpuPlacement: true",
        );
    }
    if !dedicated {
        return None;
    }
    const RES: &str = "spec.domain.resources";
    let mut whole = true;
    for (what, v) in [("requests", res.cpu_request), ("limits", res.cpu_limit)] {
        if let Some(m) = v.filter(|m| m % 1000 != 0) {
            whole = false;
            errs.add(
                format!("{RES}.{what}.cpu"),
                format!("dedicated CPUs are whole CPUs: {m}m is not"),
            );
        }
    }
    match (res.cpu_request, res.cpu_limit) {
        (Some(r), Some(l)) if r != l => errs.add(
            format!("{RES}.requests.cpu"),
            "must equal limits.cpu with dedicated CPUs",
        ),
        (r, l)
            if whole
                && (r.is_some() || l.is_some())
                && ![r, l].contains(&Some(u64::from(vcpus) * 1000)) =>
        {
            errs.add(
                format!("{RES}.limits.cpu"),
                format!("must be the {vcpus} vCPUs of the CPU topology with dedicated CPUs"),
            )
        }
        _ => {}
    }
    if c.threads.is_some_and(|t| t > 2) {
        errs.add(
            format!("{PATH}.threads"),
            "at most 2 with dedicated CPUs (as KubeVirt allows)",
        );
    }
    let want = vcpus + u32::from(isolate);
    let cpus: Vec<u32> = match placed {
        Some(p) if p.len() == want as usize => p.iter().collect(),
        Some(p) => {
            errs.add(
                field,
                format!("{want} CPUs are needed, {} were placed ({p})", p.len()),
            );
            return None;
        }
        None => {
            errs.add(field, "this host placed no dedicated CPUs for it");
            return None;
        }
    };
    let (vcpu_cpus, rest) = cpus.split_at(vcpus as usize);
    let emulator: CpuSet = if isolate {
        rest.iter().copied().collect()
    } else {
        vcpu_cpus.iter().copied().collect()
    };
    Some(CpuTune {
        vcpupin: (0..vcpus)
            .zip(vcpu_cpus)
            .map(|(vcpu, host)| VcpuPin {
                vcpu,
                cpuset: host.to_string(),
            })
            .collect(),
        emulatorpin: CpuSetAttr {
            cpuset: emulator.to_string(),
        },
    })
}

/// A boolean of the CPU block that kvirt's typed VMI keeps as extra.
fn flag(c: &vmi::Cpu, key: &str, errs: &mut Errors) -> Option<bool> {
    match c.extra.get(key)? {
        serde_json::Value::Bool(b) => Some(*b),
        serde_json::Value::Null => None,
        _ => {
            errs.add(format!("{PATH}.{key}"), "must be true or false");
            None
        }
    }
}

/// The vCPUs' topology and count: the VMI's, or (as KubeVirt does) one
/// core per CPU of its limit, else of its request.
fn topology(cpu: Option<&vmi::Cpu>, res: &ResourceSpec, errs: &mut Errors) -> (Topology, u32) {
    let topology = match cpu {
        Some(c) if c.sockets.is_some() || c.cores.is_some() || c.threads.is_some() => {
            let mut part = |name: &str, v: Option<u32>| match v.unwrap_or(1) {
                0 => {
                    errs.add(format!("{PATH}.{name}"), "must be at least 1");
                    1
                }
                n => n,
            };
            Topology {
                sockets: part("sockets", c.sockets),
                cores: part("cores", c.cores),
                threads: part("threads", c.threads),
            }
        }
        // Like KubeVirt: without a topology, one core per (rounded up) CPU
        // of the limit, else of the request.
        _ => Topology {
            sockets: 1,
            cores: res.cpu_limit.or(res.cpu_request).map_or(1, |m| {
                u32::try_from(m.div_ceil(1000).max(1)).unwrap_or(u32::MAX)
            }),
            threads: 1,
        },
    };
    let vcpus = topology
        .sockets
        .checked_mul(topology.cores)
        .and_then(|n| n.checked_mul(topology.threads))
        .filter(|&n| n <= MAX_VCPUS);
    let vcpus = vcpus.unwrap_or_else(|| {
        errs.add(
            PATH,
            format!("more than {MAX_VCPUS} vCPUs are not supported"),
        );
        1
    });

    (topology, vcpus)
}

/// CPU model and feature names as libvirt and QEMU spell them.
fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;

    #[test]
    fn topology_and_count() {
        let c = run(
            &vmi("domain: {memory: {guest: 64Mi}, cpu: {sockets: 2, cores: 3}}"),
            DomainType::Kvm,
        )
        .unwrap();
        assert_eq!(c.resources.vcpus, 6);
        assert!(c.domain_xml.contains("<vcpu placement=\"static\">6</vcpu>"));
        assert!(c.domain_xml.contains(
            "<cpu mode=\"host-model\">\n    <topology sockets=\"2\" cores=\"3\" threads=\"1\"/>"
        ));
    }

    #[test]
    fn count_from_resources() {
        let c = run(
            &vmi("domain: {memory: {guest: 64Mi}, resources: {requests: {cpu: 1500m}}}"),
            DomainType::Qemu,
        )
        .unwrap();
        assert_eq!(c.resources.vcpus, 2);
        assert_eq!(c.resources.cpu_request_millis, Some(1500));
        assert!(c
            .domain_xml
            .contains("<cpu>\n    <topology sockets=\"2\" cores=\"1\" threads=\"1\"/>"));
        let c = run(
            &vmi("domain: {memory: {guest: 64Mi}, resources: {requests: {cpu: 500m}, limits: {cpu: 3}}}"),
            DomainType::Kvm,
        )
        .unwrap();
        assert_eq!(
            (
                c.resources.vcpus,
                c.resources.cpu_request_millis,
                c.resources.cpu_limit_millis
            ),
            (3, Some(500), Some(3000))
        );
    }

    #[test]
    fn models() {
        let ok = |m, t| {
            run(
                &vmi(&format!(
                    "domain: {{memory: {{guest: 64Mi}}, cpu: {{model: {m}}}}}"
                )),
                t,
            )
        };
        assert!(ok("host-model", DomainType::Kvm)
            .unwrap()
            .domain_xml
            .contains("<cpu mode=\"host-model\">"));
        assert_eq!(
            fields(ok("host-passthrough", DomainType::Qemu)),
            ["spec.domain.cpu.model"]
        );
        assert_eq!(
            fields(ok("\"Has well\"", DomainType::Kvm)),
            ["spec.domain.cpu.model"]
        );
        // A named model is exact on KVM and TCG alike: never another one.
        for t in [DomainType::Kvm, DomainType::Qemu] {
            let x = ok("Haswell-noTSX", t).unwrap().domain_xml;
            assert!(
                x.contains(
                    "<cpu mode=\"custom\">\n    <model fallback=\"forbid\">Haswell-noTSX</model>"
                ),
                "{x}"
            );
        }
    }

    #[test]
    fn features_with_policies() {
        let x = run(
            &vmi("domain: {memory: {guest: 64Mi}, cpu: {model: host-model, features: [{name: pcid}, {name: vmx, policy: disable}]}}"),
            DomainType::Kvm,
        )
        .unwrap()
        .domain_xml;
        assert!(
            x.contains("<feature policy=\"require\" name=\"pcid\"/>"),
            "{x}"
        );
        assert!(
            x.contains("<feature policy=\"disable\" name=\"vmx\"/>"),
            "{x}"
        );
        assert_eq!(
            fields(run(
                &vmi("domain: {memory: {guest: 64Mi}, cpu: {features: [{name: 'a b', policy: maybe, x: 1}]}}"),
                DomainType::Qemu,
            )),
            [
                "spec.domain.cpu.features[0].x",
                "spec.domain.cpu.features[0].name",
                "spec.domain.cpu.features[0].policy",
                "spec.domain.cpu.features"
            ]
        );
    }

    #[test]
    fn errors() {
        let f = |y: &str| {
            fields(run(
                &vmi(&format!("domain: {{memory: {{guest: 64Mi}}, cpu: {y}}}")),
                DomainType::Kvm,
            ))
        };
        // All-zero is no topology (KubeVirt defaults it); one zero among
        // others is an error.
        assert!(run(
            &vmi("domain: {memory: {guest: 64Mi}, cpu: {cores: 0}}"),
            DomainType::Kvm
        )
        .is_ok());
        assert_eq!(f("{cores: 0, sockets: 2}"), ["spec.domain.cpu.cores"]);
        assert_eq!(f("{cores: 64, sockets: 64}"), ["spec.domain.cpu"]);
        let e = run(
            &vmi("domain: {memory: {guest: 64Mi}, cpu: {cores: 2, dedicatedCpuPlacement: true, numa: {}, x: 1}}"),
            DomainType::Kvm,
        )
        .unwrap_err()
        .iter()
        .map(|e| format!("{e}\n"))
        .collect::<String>();
        for want in [
            "spec.domain.cpu.numa: guest NUMA",
            "spec.domain.cpu.x: not supported by kvirt",
        ] {
            assert!(e.contains(want), "{want} in {e}");
        }
    }

    #[test]
    fn dedicated_cpus_pin_each_vcpu_and_the_emulator() {
        use crate::core::convert::dedicated_cpus_wanted;
        use crate::core::cpuset::CpuSet;
        let spec = "domain: {memory: {guest: 64Mi}, cpu: {cores: 2, dedicatedCpuPlacement: true}}";
        assert_eq!(dedicated_cpus_wanted(&vmi(spec)), Some(2));
        let placed: CpuSet = "3,5".parse().unwrap();
        let c = run_placed(&vmi(spec), DomainType::Qemu, Some(&placed)).unwrap();
        assert!(
            c.domain_xml.contains(
                "<cputune>\n    <vcpupin vcpu=\"0\" cpuset=\"3\"/>\n    \
                 <vcpupin vcpu=\"1\" cpuset=\"5\"/>\n    <emulatorpin cpuset=\"3,5\"/>\n  </cputune>"
            ),
            "{}",
            c.domain_xml
        );
        assert_eq!(c.resources.dedicated_cpus, Some(placed));

        // isolateEmulatorThread: one CPU more, QEMU's own threads on it.
        let spec = "domain: {memory: {guest: 64Mi}, resources: {limits: {cpu: 2}}, \
                    cpu: {dedicatedCpuPlacement: true, isolateEmulatorThread: true}}";
        assert_eq!(dedicated_cpus_wanted(&vmi(spec)), Some(3));
        let c = run(&vmi(spec), DomainType::Qemu).unwrap();
        assert!(c.domain_xml.contains("<vcpupin vcpu=\"1\" cpuset=\"1\"/>"));
        assert!(c.domain_xml.contains("<emulatorpin cpuset=\"2\"/>"));

        // Without: no pinning, no CPUs held.
        let c = run(&vmi(MEM), DomainType::Qemu).unwrap();
        assert!(!c.domain_xml.contains("cputune"));
        assert_eq!(c.resources.dedicated_cpus, None);
        assert_eq!(dedicated_cpus_wanted(&vmi(MEM)), None);
    }

    #[test]
    fn dedicated_cpus_are_checked_as_kubevirt_admits_them() {
        let f = |cpu: &str, res: &str| {
            let spec = format!("domain: {{memory: {{guest: 64Mi}}, cpu: {cpu}{res}}}");
            match run(&vmi(&spec), DomainType::Qemu) {
                Ok(_) => Vec::new(),
                Err(errs) => errs.into_iter().map(|e| e.to_string()).collect(),
            }
        };
        let r = |s: &str| format!(", resources: {s}");
        assert_eq!(
            f("{cores: 1, isolateEmulatorThread: true}", ""),
            ["spec.domain.cpu.isolateEmulatorThread: only goes with dedicatedCpuPlacement: true"]
        );
        assert_eq!(
            f("{dedicatedCpuPlacement: yes}", ""),
            ["spec.domain.cpu.dedicatedCpuPlacement: must be true or false"]
        );
        assert_eq!(
            f(
                "{dedicatedCpuPlacement: true}",
                &r("{requests: {cpu: 1500m}}")
            ),
            ["spec.domain.resources.requests.cpu: dedicated CPUs are whole CPUs: 1500m is not"]
        );
        assert_eq!(
            f(
                "{dedicatedCpuPlacement: true}",
                &r("{requests: {cpu: 1}, limits: {cpu: 2}}")
            ),
            ["spec.domain.resources.requests.cpu: must equal limits.cpu with dedicated CPUs"]
        );
        assert_eq!(
            f("{cores: 2, dedicatedCpuPlacement: true}", &r("{limits: {cpu: 3}}")),
            ["spec.domain.resources.limits.cpu: must be the 2 vCPUs of the CPU topology with dedicated CPUs"]
        );
        assert_eq!(
            f("{threads: 4, dedicatedCpuPlacement: true}", ""),
            ["spec.domain.cpu.threads: at most 2 with dedicated CPUs (as KubeVirt allows)"]
        );
        assert!(f(
            "{cores: 2, dedicatedCpuPlacement: true}",
            &r("{limits: {cpu: 2}}")
        )
        .is_empty());
        assert!(f("{dedicatedCpuPlacement: false}", "").is_empty());

        // The host placed none, or not as many: refused, never unpinned.
        let spec = "domain: {memory: {guest: 64Mi}, cpu: {cores: 2, dedicatedCpuPlacement: true}}";
        let one: crate::core::cpuset::CpuSet = "4".parse().unwrap();
        let e = |placed| fields(run_placed(&vmi(spec), DomainType::Qemu, placed));
        assert_eq!(e(None), ["spec.domain.cpu.dedicatedCpuPlacement"]);
        assert_eq!(e(Some(&one)), ["spec.domain.cpu.dedicatedCpuPlacement"]);
    }
}
