//! `features` → `<features>`. ACPI is on unless disabled, as in KubeVirt:
//! graceful shutdown relies on the ACPI power button.

use super::domain::{Features, Present, State};
use super::{firmware, Errors};
use crate::vmi;

pub(super) fn convert(
    f: Option<&vmi::Features>,
    needs: firmware::Needs,
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
            "domain: {memory: {guest: 64Mi}, features: {hyperv: {}, apic: {endOfInterrupt: true}}}",
        );
        assert_eq!(
            fields(run(&v, DomainType::Kvm)),
            [
                "spec.domain.features.hyperv",
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
            [
                "spec.domain.firmware.bootloader.efi.persistent",
                "spec.domain.features.smm"
            ]
        );
    }
}
