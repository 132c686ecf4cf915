//! `features` → `<features>`. ACPI is on unless disabled, as in KubeVirt:
//! graceful shutdown relies on the ACPI power button.

use super::domain::{Features, Hyperv, Present, Spinlocks, State, VendorId};
use super::{firmware, DomainType, Errors};
use crate::core::vmi;

pub(super) fn convert(
    f: Option<&vmi::Features>,
    needs: firmware::Needs,
    domain_type: DomainType,
    errs: &mut Errors,
) -> Option<Features> {
    const PATH: &str = "spec.domain.features";
    let mut out = Features {
        acpi: Some(Present {}),
        ..Features::default()
    };
    if let Some(f) = f {
        errs.reject_extra(PATH, &f.extra);
        for (name, state) in [("acpi", &f.acpi), ("apic", &f.apic), ("smm", &f.smm)] {
            if let Some(s) = state {
                errs.reject_extra(&format!("{PATH}.{name}"), &s.extra);
            }
        }
        if f.acpi.as_ref().is_some_and(|s| !s.is_enabled()) {
            out.acpi = None;
        }
        if f.apic.as_ref().is_some_and(vmi::FeatureState::is_enabled) {
            out.apic = Some(Present {});
        }
        out.smm = f.smm.as_ref().map(|s| State {
            state: if s.is_enabled() { "on" } else { "off" },
        });
        if let Some(hv) = &f.hyperv {
            out.hyperv = hyperv(hv, domain_type, errs);
        }
    }
    match out.smm {
        Some(State { state: "off" }) if needs.smm => errs.add(
            format!("{PATH}.smm"),
            "Secure Boot needs SMM (enable it, or set efi.secureBoot: false)",
        ),
        // KubeVirt turns SMM on for Secure Boot itself.
        None if needs.smm => out.smm = Some(State { state: "on" }),
        _ => {}
    }
    (out != Features::default()).then_some(out)
}

/// KubeVirt's Hyper-V enlightenments, with the dependencies QEMU enforces
/// checked here so the error names the field.
fn hyperv(
    hv: &std::collections::BTreeMap<String, vmi::FeatureState>,
    domain_type: DomainType,
    errs: &mut Errors,
) -> Option<Hyperv> {
    const PATH: &str = "spec.domain.features.hyperv";
    if domain_type == DomainType::Qemu {
        errs.add(
            PATH,
            "Hyper-V enlightenments need KVM, but this host emulates CPUs",
        );
        return None;
    }
    let on = |name: &str| hv.get(name).is_some_and(vmi::FeatureState::is_enabled);
    let state = |s: &vmi::FeatureState| State {
        state: if s.is_enabled() { "on" } else { "off" },
    };
    let mut out = Hyperv {
        mode: "custom",
        ..Hyperv::default()
    };
    for (name, s) in hv {
        let p = format!("{PATH}.{name}");
        let mut extra = s.extra.clone();
        match name.as_str() {
            "relaxed" => out.relaxed = Some(state(s)),
            "vapic" => out.vapic = Some(state(s)),
            "vpindex" => out.vpindex = Some(state(s)),
            "runtime" => out.runtime = Some(state(s)),
            "synic" => out.synic = Some(state(s)),
            "synictimer" => out.stimer = Some(state(s)),
            "reset" => out.reset = Some(state(s)),
            "frequencies" => out.frequencies = Some(state(s)),
            "reenlightenment" => out.reenlightenment = Some(state(s)),
            "tlbflush" => out.tlbflush = Some(state(s)),
            "ipi" => out.ipi = Some(state(s)),
            "spinlocks" => {
                let retries = extra.remove("spinlocks").map(|v| {
                    match v.as_u64().and_then(|n| u32::try_from(n).ok()) {
                        Some(n) if n >= 4096 => n,
                        _ => {
                            errs.add(
                                format!("{p}.spinlocks"),
                                "must be a number of at least 4096",
                            );
                            4096
                        }
                    }
                });
                out.spinlocks = Some(Spinlocks {
                    state: state(s).state,
                    retries: retries.filter(|_| s.is_enabled()),
                });
            }
            "vendorid" => {
                let value = extra.remove("vendorid").map(|v| match v.as_str() {
                    Some(id) if !id.is_empty() && id.len() <= 12 && id.is_ascii() => id.to_owned(),
                    _ => {
                        errs.add(format!("{p}.vendorid"), "must be 1 to 12 ASCII characters");
                        String::new()
                    }
                });
                if s.is_enabled() && value.is_none() {
                    errs.add(format!("{p}.vendorid"), "is required when enabled");
                }
                out.vendor_id = Some(VendorId {
                    state: state(s).state,
                    value: value.filter(|_| s.is_enabled()),
                });
            }
            _ => {
                errs.add(&p, "not supported by kvirt");
                continue;
            }
        }
        errs.reject_extra(&p, &extra);
    }
    for (needs, of) in [
        ("synic", "vpindex"),
        ("synictimer", "synic"),
        ("synictimer", "vpindex"),
        ("tlbflush", "vpindex"),
        ("ipi", "vpindex"),
    ] {
        if on(needs) && !on(of) {
            errs.add(format!("{PATH}.{needs}"), format!("needs {of} enabled too"));
        }
    }
    (!hv.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;

    fn xml(features: &str) -> String {
        let v = vmi(&format!(
            "domain: {{memory: {{guest: 64Mi}}, features: {features}}}"
        ));
        run(&v, DomainType::Kvm).unwrap().domain_xml
    }

    #[test]
    fn acpi_default_and_off() {
        assert!(run(&vmi(MEM), DomainType::Kvm)
            .unwrap()
            .domain_xml
            .contains("<features>\n    <acpi/>\n  </features>"));
        assert!(xml("{acpi: {}}").contains("<acpi/>"));
        let off = xml("{acpi: {enabled: false}}");
        assert!(!off.contains("<features>"), "{off}");
    }

    #[test]
    fn apic_smm() {
        let x = xml("{apic: {}, smm: {enabled: false}}");
        assert!(
            x.contains("<acpi/>\n    <apic/>\n    <smm state=\"off\"/>"),
            "{x}"
        );
        assert!(!xml("{apic: {enabled: false}}").contains("<apic"));
    }

    #[test]
    fn errors() {
        let v = vmi(
            "domain: {memory: {guest: 64Mi}, features: {kvm: {hidden: true}, hyperv: {}, apic: {endOfInterrupt: true}}}",
        );
        assert_eq!(
            fields(run(&v, DomainType::Kvm)),
            [
                "spec.domain.features.kvm",
                "spec.domain.features.apic.endOfInterrupt"
            ]
        );
    }

    #[test]
    fn secure_boot_turns_smm_on_and_refuses_it_off() {
        let efi = |features: &str, efi: &str| {
            run(
                &vmi(&format!(
                    "domain: {{memory: {{guest: 64Mi}}, features: {features}, firmware: {{bootloader: {{efi: {efi}}}}}}}"
                )),
                DomainType::Kvm,
            )
        };
        let x = efi("{}", "{}").unwrap().domain_xml;
        assert!(x.contains("<smm state=\"on\"/>"), "{x}");
        assert!(x.contains("<os firmware=\"efi\">"), "{x}");
        assert!(
            x.contains("<feature enabled=\"yes\" name=\"secure-boot\"/>"),
            "{x}"
        );
        let x = efi("{}", "{secureBoot: false}").unwrap().domain_xml;
        assert!(!x.contains("<smm"), "{x}");
        assert!(
            x.contains("<feature enabled=\"no\" name=\"secure-boot\"/>"),
            "{x}"
        );
        assert_eq!(
            fields(efi("{smm: {enabled: false}}", "{persistent: true}")),
            ["spec.domain.features.smm"]
        );
    }

    #[test]
    fn hyperv_enlightenments_and_their_dependencies() {
        let x = xml("{hyperv: {relaxed: {}, vapic: {}, spinlocks: {spinlocks: 8191}, vpindex: {}, synic: {}, synictimer: {}, vendorid: {vendorid: KVMKVMKVM}, reset: {enabled: false}}}");
        for want in [
            "<hyperv mode=\"custom\">",
            "<relaxed state=\"on\"/>",
            "<spinlocks state=\"on\" retries=\"8191\"/>",
            "<stimer state=\"on\"/>",
            "<vendor_id state=\"on\" value=\"KVMKVMKVM\"/>",
            "<reset state=\"off\"/>",
        ] {
            assert!(x.contains(want), "{want} in {x}");
        }
        let errs = |hv: &str, t| {
            fields(run(
                &vmi(&format!(
                    "domain: {{memory: {{guest: 64Mi}}, features: {{hyperv: {hv}}}}}"
                )),
                t,
            ))
        };
        assert_eq!(
            errs("{synictimer: {}, ipi: {}, spinlocks: {spinlocks: 10}, vendorid: {}, evmcs: {}, relaxed: {x: 1}}", DomainType::Kvm),
            [
                "spec.domain.features.hyperv.evmcs",
                "spec.domain.features.hyperv.relaxed.x",
                "spec.domain.features.hyperv.spinlocks.spinlocks",
                "spec.domain.features.hyperv.vendorid.vendorid",
                "spec.domain.features.hyperv.synictimer",
                "spec.domain.features.hyperv.synictimer",
                "spec.domain.features.hyperv.ipi",
            ]
        );
        assert_eq!(
            errs("{relaxed: {}}", DomainType::Qemu),
            ["spec.domain.features.hyperv"]
        );
    }
}
