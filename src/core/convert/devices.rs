//! The other devices: serial console, VNC, balloon, RNG, input devices, the
//! watchdog and the guest agent's channel. (Networking is `network.rs`.)

use super::domain::{
    Alias, Channel, ChannelTarget, Console, ConsoleTarget, Devices, Graphics, Input, Log,
    Memballoon, Rng, RngBackend, Serial, SerialTarget, Tpm, TpmBackend, UnixSource, Video,
    VideoModel, Watchdog,
};
use super::{is_dns_label, Errors};
use crate::core::layout::VmPaths;
use crate::core::vmi::{self, VmiSpec};

/// Everything in `<devices>` except disks and controllers.
pub(super) fn convert(spec: &VmiSpec, paths: &VmPaths, errs: &mut Errors) -> Devices {
    const PATH: &str = "spec.domain.devices";
    let dev = &spec.domain.devices;
    errs.reject_extra(PATH, &dev.extra);

    let mut out = Devices::default();
    if dev.autoattach_serial_console != Some(false) {
        let source = UnixSource {
            mode: "bind",
            path: paths.serial_socket().to_string_lossy().into_owned(),
        };
        out.serial = Some(Serial {
            type_: "unix",
            source: source.clone(),
            log: Log {
                file: paths.serial_log().to_string_lossy().into_owned(),
                append: "on",
            },
            target: SerialTarget { port: 0 },
        });
        // libvirt treats a serial-type console as an alias of serial port 0.
        out.console = Some(Console {
            type_: "unix",
            source,
            target: ConsoleTarget {
                type_: "serial",
                port: 0,
            },
        });
    }
    if dev.autoattach_graphics_device != Some(false) {
        out.graphics = Some(Graphics {
            type_: "vnc",
            socket: paths.vnc_socket().to_string_lossy().into_owned(),
        });
        out.video = Some(Video {
            model: VideoModel {
                type_: "vga",
                vram: 16384,
                heads: 1,
            },
        });
    }
    out.memballoon = Some(Memballoon {
        model: if dev.autoattach_mem_balloon == Some(false) {
            "none"
        } else {
            "virtio"
        },
    });
    if let Some(rng) = &dev.rng {
        errs.reject_extra(&format!("{PATH}.rng"), &rng.extra);
        out.rng = Some(Rng {
            model: "virtio",
            backend: RngBackend {
                model: "random",
                device: "/dev/urandom",
            },
        });
    }
    out.inputs = inputs(&dev.inputs, errs);
    out.watchdog = dev.watchdog.as_ref().and_then(|w| watchdog(w, errs));
    out.tpm = dev.tpm.as_ref().and_then(|t| tpm(t, errs));
    // As in KubeVirt, every VM gets the guest agent's channel: an agent in
    // the guest answers on it whenever it runs.
    out.channels.push(Channel {
        type_: "unix",
        source: UnixSource {
            mode: "bind",
            path: paths.guest_agent_socket().to_string_lossy().into_owned(),
        },
        target: ChannelTarget {
            type_: "virtio",
            name: "org.qemu.guest_agent.0",
        },
    });
    out
}

/// `inputs`: KubeVirt offers the tablet, on USB (default) or virtio.
fn inputs(list: &[vmi::Input], errs: &mut Errors) -> Vec<Input> {
    let mut out = Vec::new();
    for (i, input) in list.iter().enumerate() {
        let path = format!("spec.domain.devices.inputs[{i}]");
        errs.reject_extra(&path, &input.extra);
        if !is_dns_label(&input.name) {
            errs.add(
                format!("{path}.name"),
                format!("{:?} is not a DNS-1123 label", input.name),
            );
            continue;
        }
        if input.type_.as_deref() != Some("tablet") {
            errs.add(format!("{path}.type"), "only tablet is supported");
            continue;
        }
        let bus = match input.bus.as_deref() {
            None | Some("") | Some("usb") => "usb",
            Some("virtio") => "virtio",
            Some(other) => {
                errs.add(format!("{path}.bus"), format!("{other:?}: usb or virtio"));
                continue;
            }
        };
        out.push(Input {
            type_: "tablet",
            bus,
            alias: Alias {
                name: format!("ua-{}", input.name),
            },
        });
    }
    out
}

/// `tpm`: a TPM 2.0 from swtpm, as KubeVirt's: TIS, or CRB with its state
/// kept (`persistent`, which the caller keeps across the VM's restarts).
pub(super) fn tpm(t: &vmi::Tpm, errs: &mut Errors) -> Option<Tpm> {
    errs.reject_extra("spec.domain.devices.tpm", &t.extra);
    if t.enabled == Some(false) {
        return None;
    }
    let persistent = t.persistent == Some(true);
    Some(Tpm {
        model: if persistent { "tpm-crb" } else { "tpm-tis" },
        backend: TpmBackend {
            type_: "emulator",
            version: "2.0",
            persistent_state: persistent.then_some("yes"),
        },
    })
}

/// `watchdog`: the i6300esb, with KubeVirt's actions (default reset).
fn watchdog(w: &vmi::Watchdog, errs: &mut Errors) -> Option<Watchdog> {
    const PATH: &str = "spec.domain.devices.watchdog";
    errs.reject_extra(PATH, &w.extra);
    let Some(esb) = &w.i6300esb else {
        errs.add(PATH, "needs i6300esb (the only watchdog model)");
        return None;
    };
    errs.reject_extra(&format!("{PATH}.i6300esb"), &esb.extra);
    let action = match esb.action.as_deref() {
        None | Some("") | Some("reset") => "reset",
        Some("poweroff") => "poweroff",
        Some("shutdown") => "shutdown",
        Some(other) => {
            errs.add(
                format!("{PATH}.i6300esb.action"),
                format!("{other:?}: reset, poweroff or shutdown"),
            );
            return None;
        }
    };
    Some(Watchdog {
        model: "i6300esb",
        action,
        alias: Alias {
            name: format!("ua-{}", w.name),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;

    fn conv(devices: &str) -> Result<String, Vec<String>> {
        let v = vmi(&format!(
            "domain: {{memory: {{guest: 64Mi}}, devices: {devices}}}"
        ));
        run(&v, DomainType::Kvm)
            .map(|c| c.domain_xml)
            .map_err(|e| e.into_iter().map(|e| e.field).collect())
    }

    #[test]
    fn defaults_attach_console_and_vnc() {
        let x = conv("{}").unwrap();
        for want in [
            r#"<serial type="unix">
      <source mode="bind" path="/run/kvirt/vms/ns_vm/serial.sock"/>
      <log file="/run/kvirt/vms/ns_vm/console.log" append="on"/>
      <target port="0"/>
    </serial>"#,
            r#"<target type="serial" port="0"/>"#,
            r#"<graphics type="vnc" socket="/run/kvirt/vms/ns_vm/vnc.sock"/>"#,
            r#"<model type="vga" vram="16384" heads="1"/>"#,
            r#"<memballoon model="virtio"/>"#,
        ] {
            assert!(x.contains(want), "{want} missing in\n{x}");
        }
        assert!(!x.contains("<rng"));
        assert!(
            x.contains(
                r#"<channel type="unix">
      <source mode="bind" path="/run/kvirt/vms/ns_vm/qga.sock"/>
      <target type="virtio" name="org.qemu.guest_agent.0"/>
    </channel>"#
            ),
            "{x}"
        );
        assert!(!x.contains("<input") && !x.contains("<watchdog"));
    }

    #[test]
    fn tablet_and_watchdog() {
        let x = conv("{inputs: [{name: t1, type: tablet}, {name: t2, type: tablet, bus: virtio}], watchdog: {name: wd, i6300esb: {action: poweroff}}}").unwrap();
        for want in [
            r#"<input type="tablet" bus="usb">
      <alias name="ua-t1"/>"#,
            r#"<input type="tablet" bus="virtio">"#,
            r#"<watchdog model="i6300esb" action="poweroff">
      <alias name="ua-wd"/>"#,
        ] {
            assert!(x.contains(want), "{want} missing in\n{x}");
        }
        let x = conv("{watchdog: {name: wd, i6300esb: {}}}").unwrap();
        assert!(x.contains(r#"action="reset""#), "{x}");
    }

    #[test]
    fn opt_outs() {
        let x = conv("{autoattachSerialConsole: false, autoattachGraphicsDevice: false, autoattachMemBalloon: false, autoattachPodInterface: false, rng: {}}").unwrap();
        assert!(
            !x.contains("<serial")
                && !x.contains("<console")
                && !x.contains("<graphics")
                && !x.contains("<video")
        );
        assert!(x.contains(r#"<memballoon model="none"/>"#));
        assert!(
            x.contains(r#"<backend model="random">/dev/urandom</backend>"#),
            "{x}"
        );
    }

    #[test]
    fn unknown_devices_are_refused() {
        assert_eq!(
            conv("{sound: {}, rng: {x: 1}}").unwrap_err(),
            ["spec.domain.devices.sound", "spec.domain.devices.rng.x"]
        );
        assert_eq!(
            conv("{inputs: [{name: m, type: mouse}, {name: k, type: tablet, bus: ps2}], watchdog: {name: w, i6300esb: {action: pause}}}")
                .unwrap_err(),
            [
                "spec.domain.devices.inputs[0].type",
                "spec.domain.devices.inputs[1].bus",
                "spec.domain.devices.watchdog.i6300esb.action",
            ]
        );
        // KubeVirt defaults a watchdog to an i6300esb that resets.
        assert!(conv("{watchdog: {name: w}}")
            .unwrap()
            .contains("<watchdog model=\"i6300esb\" action=\"reset\">"));
    }

    #[test]
    fn a_tpm_is_swtpms_as_kubevirt_models_it() {
        let x = conv("{tpm: {}}").unwrap();
        assert!(
            x.contains(
                "<tpm model=\"tpm-tis\">\n      <backend type=\"emulator\" version=\"2.0\"/>"
            ),
            "{x}"
        );
        let x = conv("{tpm: {persistent: true}}").unwrap();
        assert!(
            x.contains(
                "<tpm model=\"tpm-crb\">\n      \
                 <backend type=\"emulator\" version=\"2.0\" persistent_state=\"yes\"/>"
            ),
            "{x}"
        );
        assert!(!conv("{tpm: {enabled: false}}").unwrap().contains("<tpm"));
        assert_eq!(
            conv("{tpm: {x: 1}}").unwrap_err(),
            ["spec.domain.devices.tpm.x"]
        );
    }

    #[test]
    fn a_persistent_tpm_keeps_its_state_for_the_vms_next_run() {
        use crate::core::convert::DiskPrep;
        let v = vmi("domain: {memory: {guest: 64Mi}, devices: {tpm: {persistent: true}}}");
        let c = run(&v, DomainType::Qemu).unwrap();
        let Some(DiskPrep::TpmState {
            state, kept_dir, ..
        }) = c
            .disks
            .iter()
            .find(|d| matches!(d, DiskPrep::TpmState { .. }))
        else {
            panic!("no TpmState prep: {:?}", c.disks)
        };
        assert!(
            state.ends_with("tpm2/tpm2-00.permall"),
            "{}",
            state.display()
        );
        assert!(
            kept_dir.ends_with("efi-vars/ns_vm"),
            "{}",
            kept_dir.display()
        );
        let v = vmi("domain: {memory: {guest: 64Mi}, devices: {tpm: {}}}");
        let c = run(&v, DomainType::Qemu).unwrap();
        assert!(!c
            .disks
            .iter()
            .any(|d| matches!(d, DiskPrep::TpmState { .. })));
    }
}
