//! vCPU count, topology and CPU model.

use super::domain::{Cpu, CpuFeature, CpuModel, Topology};
use super::memory::ResourceSpec;
use super::{DomainType, Errors};
use crate::core::vmi;

/// Far above any host kvirt targets; keeps a typo from asking QEMU for
/// millions of vCPUs.
const MAX_VCPUS: u32 = 1024;

pub(super) fn convert(
    cpu: Option<&vmi::Cpu>,
    res: &ResourceSpec,
    domain_type: DomainType,
    errs: &mut Errors,
) -> (Cpu, u32) {
    const PATH: &str = "spec.domain.cpu";
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

    let mut mode = match domain_type {
        DomainType::Kvm => Some("host-passthrough"),
        // TCG cannot pass the host CPU through; QEMU's default model it is.
        DomainType::Qemu => None,
    };
    let mut model = None;
    let mut feature = Vec::new();
    if let Some(c) = cpu {
        for (key, why) in [
            (
                "dedicatedCpuPlacement",
                "dedicated CPUs need CPU pinning, which kvirt does not do yet",
            ),
            (
                "isolateEmulatorThread",
                "needs dedicated CPUs, which kvirt does not do yet",
            ),
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
            "spec.domain.cpu.dedicatedCpuPlacement: dedicated CPUs need CPU pinning",
            "spec.domain.cpu.numa: guest NUMA",
            "spec.domain.cpu.x: not supported by kvirt",
        ] {
            assert!(e.contains(want), "{want} in {e}");
        }
    }
}
