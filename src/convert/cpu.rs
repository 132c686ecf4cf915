//! vCPU count, topology and CPU model.

use super::domain::{Cpu, Topology};
use super::memory::ResourceSpec;
use super::{DomainType, Errors};
use crate::vmi;

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
    if let Some(c) = cpu {
        errs.reject_extra(PATH, &c.extra);
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
            (Some(m), _) => errs.add(
                format!("{PATH}.model"),
                format!("named CPU models ({m:?}) are not supported yet; use host-passthrough or host-model"),
            ),
        }
    }
    (Cpu { mode, topology }, vcpus)
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
        assert!(c
            .domain_xml
            .contains("<cpu mode=\"host-passthrough\">\n    <topology sockets=\"2\" cores=\"3\" threads=\"1\"/>"));
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
            .contains("<cpu>\n    <topology sockets=\"1\" cores=\"2\" threads=\"1\"/>"));
        let c = run(
            &vmi("domain: {memory: {guest: 64Mi}, resources: {requests: {cpu: 500m}, limits: {cpu: 3}}}"),
            DomainType::Kvm,
        )
        .unwrap();
        assert_eq!(
            (c.resources.vcpus, c.resources.cpu_request_millis),
            (3, Some(500))
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
            fields(ok("Haswell", DomainType::Kvm)),
            ["spec.domain.cpu.model"]
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
        assert_eq!(f("{cores: 0}"), ["spec.domain.cpu.cores"]);
        assert_eq!(f("{cores: 64, sockets: 64}"), ["spec.domain.cpu"]);
        assert_eq!(
            f("{cores: 2, dedicatedCpuPlacement: true}"),
            ["spec.domain.cpu.dedicatedCpuPlacement"]
        );
    }
}
