//! Machine type, firmware (UUID, SMBIOS serial, BIOS) → `<uuid>`, `<os>`,
//! `<sysinfo>`.

use super::domain::{
    FirmwareFeature, Os, OsBios, OsFirmware, OsType, Smbios, Sysinfo, SysinfoEntry, SysinfoSystem,
};
use super::Errors;
use crate::core::defaults::{firmware_uuid, normalize_uuid, MACHINE_TYPE};
use crate::core::key::VmKey;
use crate::core::vmi::{DomainSpec, VirtualMachineInstance};

/// What the firmware asks of the rest of the domain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Needs {
    /// Secure Boot: OVMF's secure build only runs with SMM on.
    pub smm: bool,
    /// `kernelBoot` is set (see `kernelboot`).
    pub kernel_boot: bool,
    /// `efi.persistent`: the variables outlive the VMI.
    pub persistent_efi: bool,
}

pub(super) fn convert(
    vmi: &VirtualMachineInstance,
    key: &VmKey,
    dom: &DomainSpec,
    errs: &mut Errors,
) -> (String, Os, Option<Sysinfo>, Needs) {
    let mut machine = MACHINE_TYPE.to_owned();
    if let Some(m) = &dom.machine {
        errs.reject_extra("spec.domain.machine", &m.extra);
        if !m.type_.is_empty() {
            if m.type_.len() <= 64
                && m.type_
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            {
                machine = m.type_.clone();
            } else {
                errs.add(
                    "spec.domain.machine.type",
                    format!("{:?} is not a machine type", m.type_),
                );
            }
        }
    }

    let fw = dom.firmware.as_ref();
    let mut uuid = firmware_uuid(vmi, key);
    let mut sysinfo = None;
    let mut bios = None;
    let mut efi = None;
    let mut needs = Needs::default();
    if let Some(fw) = fw {
        const PATH: &str = "spec.domain.firmware";
        errs.reject_extra(PATH, &fw.extra);
        needs.kernel_boot = fw.kernel_boot.is_some();
        if let Some(u) = &fw.uuid {
            match normalize_uuid(u) {
                Some(u) => uuid = u,
                None => errs.add(format!("{PATH}.uuid"), format!("{u:?} is not a UUID")),
            }
        }
        if let Some(serial) = &fw.serial {
            if serial.is_empty() || serial.len() > 256 || serial.chars().any(char::is_control) {
                errs.add(
                    format!("{PATH}.serial"),
                    "must be 1 to 256 characters without control characters",
                );
            }
            sysinfo = Some(Sysinfo {
                type_: "smbios",
                system: SysinfoSystem {
                    entry: vec![SysinfoEntry {
                        name: "serial",
                        value: serial.clone(),
                    }],
                },
            });
        }
        if let Some(boot) = &fw.bootloader {
            errs.reject_extra(&format!("{PATH}.bootloader"), &boot.extra);
            if let Some(b) = &boot.bios {
                errs.reject_extra(&format!("{PATH}.bootloader.bios"), &b.extra);
                if b.use_serial == Some(true) {
                    bios = Some(OsBios { useserial: "yes" });
                }
            }
            if let Some(e) = &boot.efi {
                let p = format!("{PATH}.bootloader.efi");
                errs.reject_extra(&p, &e.extra);
                if boot.bios.is_some() {
                    errs.add(&p, "set only one of bios and efi");
                }
                needs.persistent_efi = e.persistent == Some(true);
                let secure = e.secure_boot.unwrap_or(true);
                if secure && !machine.contains("q35") {
                    errs.add(
                        format!("{p}.secureBoot"),
                        format!("Secure Boot needs a q35 machine, not {machine:?}"),
                    );
                }
                needs.smm = secure;
                let yes_no = |b: bool| if b { "yes" } else { "no" };
                efi = Some(OsFirmware {
                    feature: vec![
                        FirmwareFeature {
                            enabled: yes_no(secure),
                            name: "secure-boot",
                        },
                        FirmwareFeature {
                            enabled: yes_no(secure),
                            name: "enrolled-keys",
                        },
                    ],
                });
            }
        }
    }
    let os = Os {
        firmware_kind: efi.as_ref().map(|_| "efi"),
        type_: OsType {
            machine,
            value: "hvm",
        },
        firmware: efi,
        kernel: None,
        initrd: None,
        cmdline: None,
        bios,
        smbios: sysinfo.as_ref().map(|_| Smbios { mode: "sysinfo" }),
    };
    (uuid, os, sysinfo, needs)
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;
    use super::*;

    #[test]
    fn uuid_sources() {
        let mut v = vmi(MEM);
        let x = |v: &VirtualMachineInstance| run(v, DomainType::Kvm).unwrap().domain_xml;
        assert!(x(&v).contains("<uuid>0f2d3a9c-1111-4222-8333-444455556666</uuid>"));
        v.metadata.uid = None;
        let derived = x(&v);
        assert!(derived.contains("<uuid>"), "{derived}");
        assert_eq!(derived, x(&v), "derived UUID must be stable");
        let key = VmKey::new("ns", "vm").unwrap();
        let u = firmware_uuid(&v, &key);
        assert!(
            normalize_uuid(&u).is_some() && u.as_bytes()[14] == b'8',
            "{u}"
        );
        v.metadata.uid = Some("not-a-uuid".into());
        assert_ne!(firmware_uuid(&v, &key), u);

        let v = vmi("domain: {memory: {guest: 64Mi}, firmware: {uuid: 5D307CA9-B3EF-428C-8861-06E72D69F223}}");
        assert!(x(&v).contains("<uuid>5d307ca9-b3ef-428c-8861-06e72d69f223</uuid>"));
    }

    #[test]
    fn serial_machine_bios() {
        let v = vmi(
            "domain: {memory: {guest: 64Mi}, machine: {type: pc-q35-7.2}, \
             firmware: {serial: \"<s&n>\", bootloader: {bios: {useSerial: true}}}}",
        );
        let x = run(&v, DomainType::Kvm).unwrap().domain_xml;
        assert!(
            x.contains("<entry name=\"serial\">&lt;s&amp;n&gt;</entry>"),
            "{x}"
        );
        assert!(x.contains("<type machine=\"pc-q35-7.2\">hvm</type>"), "{x}");
        assert!(x.contains("<bios useserial=\"yes\"/>"), "{x}");
        assert!(x.contains("<smbios mode=\"sysinfo\"/>"), "{x}");
    }

    #[test]
    fn persistent_efi_variables_belong_to_the_virtual_machine() {
        use super::super::DiskPrep;
        let efi =
            "domain: {memory: {guest: 64Mi}, firmware: {bootloader: {efi: {persistent: true}}}}";
        let prep = |v: &VirtualMachineInstance| {
            run(v, DomainType::Kvm)
                .unwrap()
                .disks
                .into_iter()
                .find(|d| matches!(d, DiskPrep::EfiVars { .. }))
        };
        let Some(DiskPrep::EfiVars {
            owner,
            nvram,
            kept_dir,
        }) = prep(&vmi(efi))
        else {
            panic!("no EfiVars prep")
        };
        assert_eq!(owner, "VirtualMachineInstance ns/vm");
        assert_eq!(
            nvram,
            std::path::Path::new(
                "/var/lib/kvirt/vms/ns_vm/config/libvirt/qemu/nvram/ns_vm_VARS.fd"
            )
        );
        assert_eq!(
            kept_dir,
            std::path::Path::new("/var/lib/kvirt/efi-vars/ns_vm")
        );
        // A VMI of a VirtualMachine: the VM's, by its UID.
        let mut v = vmi(efi);
        v.metadata.owner_references = Some(vec![serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "name": "myvm", "uid": "u-vm-1", "controller": true
        }))
        .unwrap()]);
        let Some(DiskPrep::EfiVars { owner, .. }) = prep(&v) else {
            panic!()
        };
        assert_eq!(owner, "VirtualMachine ns/myvm u-vm-1");
        // Not asked for: nothing kept.
        let plain = vmi("domain: {memory: {guest: 64Mi}, firmware: {bootloader: {efi: {}}}}");
        assert!(prep(&plain).is_none());
    }

    #[test]
    fn errors() {
        let f = |fw: &str| {
            fields(run(
                &vmi(&format!("domain: {{memory: {{guest: 64Mi}}, {fw}}}")),
                DomainType::Kvm,
            ))
        };
        assert_eq!(f("firmware: {uuid: nope}"), ["spec.domain.firmware.uuid"]);
        assert_eq!(
            f("firmware: {serial: \"\"}"),
            ["spec.domain.firmware.serial"]
        );
        assert_eq!(
            f("firmware: {bootloader: {bios: {}, efi: {secureBoot: false, x: 1}}}"),
            [
                "spec.domain.firmware.bootloader.efi.x",
                "spec.domain.firmware.bootloader.efi"
            ]
        );
        assert_eq!(
            f("machine: {type: pc-i440fx-9.2}, firmware: {bootloader: {efi: {}}}"),
            ["spec.domain.firmware.bootloader.efi.secureBoot"]
        );
        assert_eq!(
            f("firmware: {kernelBoot: {}}"),
            ["spec.domain.firmware.kernelBoot.container"]
        );
        assert_eq!(
            f("machine: {type: \"q35 -x\"}"),
            ["spec.domain.machine.type"]
        );
    }
}
