//! Guest memory, and the `resources` block that also feeds CPU sizing and
//! the systemd unit's limits.

use super::Errors;
use crate::core::quantity::Quantity;
use crate::core::vmi::{Memory, ResourceRequirements};
use std::collections::BTreeMap;

/// Resource names that do not affect the VM: the unit has no disk quota.
const IGNORED_RESOURCES: &[&str] = &["ephemeral-storage"];

/// `resources.requests`/`limits`, parsed and checked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResourceSpec {
    pub memory_request: Option<u64>,
    pub memory_limit: Option<u64>,
    pub cpu_request: Option<u64>,
    pub cpu_limit: Option<u64>,
}

impl ResourceSpec {
    pub fn parse(res: Option<&ResourceRequirements>, errs: &mut Errors) -> Self {
        let Some(res) = res else {
            return Self::default();
        };
        const PATH: &str = "spec.domain.resources";
        // KubeVirt leaves its overhead out of the pod's request with this;
        // kvirt reserves nothing up front, so it changes nothing here.
        let mut extra = res.extra.clone();
        extra.remove("overcommitGuestOverhead");
        errs.reject_extra(PATH, &extra);
        let requests = parse_list(&res.requests, &format!("{PATH}.requests"), errs);
        let limits = parse_list(&res.limits, &format!("{PATH}.limits"), errs);
        let spec = Self {
            memory_request: requests.0,
            memory_limit: limits.0,
            cpu_request: requests.1,
            cpu_limit: limits.1,
        };
        if let (Some(r), Some(l)) = (spec.memory_request, spec.memory_limit) {
            if r > l {
                errs.add(
                    format!("{PATH}.requests.memory"),
                    "must not be greater than limits.memory",
                );
            }
        }
        if let (Some(r), Some(l)) = (spec.cpu_request, spec.cpu_limit) {
            if r > l {
                errs.add(
                    format!("{PATH}.requests.cpu"),
                    "must not be greater than limits.cpu",
                );
            }
        }
        spec
    }
}

/// (memory bytes, cpu millicores) of one list.
fn parse_list(
    list: &BTreeMap<String, Quantity>,
    path: &str,
    errs: &mut Errors,
) -> (Option<u64>, Option<u64>) {
    let mut out = (None, None);
    for (name, q) in list {
        let field = format!("{path}.{name}");
        match name.as_str() {
            "memory" => match q.to_bytes() {
                Ok(b) => out.0 = Some(b),
                Err(e) => errs.add(field, e),
            },
            "cpu" => match q.to_millis() {
                Ok(m) => out.1 = Some(m),
                Err(e) => errs.add(field, e),
            },
            n if IGNORED_RESOURCES.contains(&n) => {}
            _ => errs.add(field, "resource not supported by kvirt"),
        }
    }
    out
}

/// `memory.guest`, else the memory request (which Kubernetes defaults to the
/// limit), as KubeVirt does.
pub(super) fn guest_memory(mem: Option<&Memory>, res: &ResourceSpec, errs: &mut Errors) -> u64 {
    const FIELD: &str = "spec.domain.memory.guest";
    if let Some(mem) = mem {
        errs.reject_extra("spec.domain.memory", &mem.extra);
    }
    let guest = match mem.and_then(|m| m.guest.as_ref()) {
        Some(q) => match q.to_bytes() {
            Ok(b) => Some(b),
            Err(e) => {
                errs.add(FIELD, e);
                return 0;
            }
        },
        None => None,
    };
    let Some(bytes) = guest.or(res.memory_request).or(res.memory_limit) else {
        errs.add(
            FIELD,
            "guest memory is required: set spec.domain.memory.guest or spec.domain.resources.requests.memory",
        );
        return 0;
    };
    if bytes < 1 << 20 {
        errs.add(
            FIELD,
            format!("{bytes} bytes is too little memory for a VM (minimum 1Mi)"),
        );
    }
    if let (Some(_), Some(limit)) = (guest, res.memory_limit) {
        if bytes > limit {
            errs.add(FIELD, "must not be greater than resources.limits.memory");
        }
    }
    bytes
}

/// The page size of `memory.hugepages`, when the guest's memory is to be
/// backed by hugepages: one the x86 kernel has (2Mi or 1Gi), dividing the
/// guest memory, as KubeVirt checks.
pub(super) fn hugepage_size(
    mem: Option<&Memory>,
    guest_bytes: u64,
    errs: &mut Errors,
) -> Option<u64> {
    const FIELD: &str = "spec.domain.memory.hugepages";
    let hp = mem?.hugepages.as_ref()?;
    errs.reject_extra(FIELD, &hp.extra);
    let field = format!("{FIELD}.pageSize");
    let Some(q) = &hp.page_size else {
        errs.add(field, "is required (2Mi or 1Gi)");
        return None;
    };
    let size = match q.to_bytes() {
        Ok(b @ (0x20_0000 | 0x4000_0000)) => b,
        Ok(_) => {
            errs.add(
                field,
                format!("{q} is not a hugepage size of this architecture (2Mi or 1Gi)"),
            );
            return None;
        }
        Err(e) => {
            errs.add(field, e);
            return None;
        }
    };
    if guest_bytes % size != 0 {
        errs.add(
            "spec.domain.memory.guest",
            format!("{guest_bytes} bytes is not a whole number of {q} hugepages"),
        );
        return None;
    }
    Some(size)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;

    #[test]
    fn guest_wins_then_request_then_limit() {
        let r = |y| run(&vmi(y), DomainType::Kvm).unwrap().resources;
        let c = r("domain: {memory: {guest: 128Mi}, resources: {requests: {memory: 64Mi}, limits: {memory: 1Gi}}}");
        assert_eq!(c.memory_bytes, 128 << 20);
        assert_eq!(c.memory_limit_bytes, Some(1 << 30));
        assert_eq!(
            r("domain: {resources: {requests: {memory: 64Mi}}}").memory_bytes,
            64 << 20
        );
        assert_eq!(
            r("domain: {resources: {limits: {memory: 2Gi}}}").memory_bytes,
            2 << 30
        );
        let x = run(
            &vmi("domain: {resources: {requests: {memory: 1073741824}}}"),
            DomainType::Kvm,
        )
        .unwrap()
        .domain_xml;
        assert!(x.contains("<memory unit=\"b\">1073741824</memory>"), "{x}");
    }

    #[test]
    fn hugepages_back_the_guest_memory_from_the_vms_own_hugetlbfs_directory() {
        let c = run(
            &vmi("domain: {memory: {guest: 128Mi, hugepages: {pageSize: 2Mi}}}"),
            DomainType::Kvm,
        )
        .unwrap();
        let x = &c.domain_xml;
        assert!(
            x.contains("<memoryBacking><hugepages><page size=\"2048\" unit=\"KiB\"/></hugepages></memoryBacking>")
                || x.contains("<memoryBacking>\n    <hugepages>\n      <page size=\"2048\" unit=\"KiB\"/>"),
            "{x}"
        );
        assert_eq!(
            c.disks,
            [super::super::DiskPrep::Hugepages {
                vm: "ns_vm".into(),
                page_bytes: 2 << 20,
                pages: 64,
                qemu_conf: "/var/lib/kvirt/vms/ns_vm/config/libvirt/qemu.conf".into(),
            }]
        );
        // Hugepages are charged to the hugetlb controller: the memory cgroup
        // sees none of the guest, only what a limit leaves above it.
        assert_eq!(c.resources.cgroup_memory_bytes(), 0);
        let limited = |y| {
            run(&vmi(y), DomainType::Kvm)
                .unwrap()
                .resources
                .cgroup_memory_bytes()
        };
        assert_eq!(
            limited("domain: {memory: {guest: 128Mi, hugepages: {pageSize: 2Mi}}, resources: {limits: {memory: 192Mi}}}"),
            64 << 20
        );
        assert_eq!(
            limited("domain: {memory: {guest: 128Mi}, resources: {limits: {memory: 192Mi}}}"),
            192 << 20
        );
    }

    #[test]
    fn errors() {
        let f = |y| fields(run(&vmi(y), DomainType::Kvm));
        assert_eq!(f("domain: {}"), ["spec.domain.memory.guest"]);
        assert_eq!(
            f("domain: {memory: {guest: 64MB}}"),
            ["spec.domain.memory.guest"]
        );
        assert_eq!(
            f("domain: {memory: {guest: 1Ki}}"),
            ["spec.domain.memory.guest"]
        );
        assert_eq!(
            f("domain: {memory: {guest: 2Gi, hugepages: {pageSize: 2Mi}}, resources: {limits: {memory: 1Gi}}}"),
            ["spec.domain.memory.guest"]
        );
        for (hp, field) in [
            ("{pageSize: 4Ki}", "spec.domain.memory.hugepages.pageSize"),
            ("{pageSize: 2MB}", "spec.domain.memory.hugepages.pageSize"),
            ("{}", "spec.domain.memory.hugepages.pageSize"),
            ("{pageSize: 2Mi, x: 1}", "spec.domain.memory.hugepages.x"),
            ("{pageSize: 1Gi}", "spec.domain.memory.guest"),
        ] {
            let spec = format!("domain: {{memory: {{guest: 66Mi, hugepages: {hp}}}}}");
            assert_eq!(fields(run(&vmi(&spec), DomainType::Kvm)), [field], "{hp}");
        }
        assert_eq!(
            f("domain: {resources: {requests: {memory: 2Gi, nvidia.com/gpu: 1}, limits: {memory: 1Gi}, overcommitGuestOverhead: true}}"),
            [
                "spec.domain.resources.requests.nvidia.com/gpu",
                "spec.domain.resources.requests.memory",
                // The guest's memory defaults to the request (KubeVirt's
                // setGuestMemory), which is over the limit too.
                "spec.domain.memory.guest"
            ]
        );
        let ok =
            vmi("domain: {memory: {guest: 1Gi}, resources: {requests: {ephemeral-storage: 1Gi}}}");
        assert!(run(&ok, DomainType::Kvm).is_ok());
    }
}
