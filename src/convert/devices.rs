//! The other devices: serial console, VNC, balloon, RNG. (Networking is
//! `network.rs`.)

use super::domain::{
    Console, ConsoleTarget, Devices, Graphics, Log, Memballoon, Rng, RngBackend, Serial,
    SerialTarget, UnixSource, Video, VideoModel,
};
use super::Errors;
use crate::layout::VmPaths;
use crate::vmi::VmiSpec;

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
    out
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
            conv("{inputs: [], rng: {x: 1}}").unwrap_err(),
            ["spec.domain.devices.inputs", "spec.domain.devices.rng.x"]
        );
    }
}
