//! Whether a VMI's subresource can be served now, with virt-api's checks
//! in its order and words (the codes decide what virtctl does: console
//! and VNC answer 400 while the VMI is not running, and virtctl retries).

use super::{ApiError, VmiAction};
use crate::core::status::{AGENT_CONNECTED, PAUSED};
use crate::core::vmi::{Phase, VirtualMachineInstance};

const VMI: &str = "virtualmachineinstance";

fn condition(vmi: &VirtualMachineInstance, type_: &str) -> bool {
    vmi.status
        .conditions
        .iter()
        .any(|c| c.type_ == type_ && c.status == "True")
}

/// `vmi` as this host runs it (`None`: it does not run here).
pub fn admit(
    action: VmiAction,
    name: &str,
    vmi: Option<&VirtualMachineInstance>,
) -> Result<(), ApiError> {
    let running = vmi.is_some_and(|v| {
        v.status.phase == Some(Phase::Running) && v.metadata.deletion_timestamp.is_none()
    });
    let conflict = |why: &str| Err(ApiError::conflict_on(VMI, name, why));
    let devices = vmi.map(|v| &v.spec.domain.devices);
    match action {
        VmiAction::Console => {
            if devices.and_then(|d| d.autoattach_serial_console) == Some(false) {
                return Err(ApiError::bad_request("No serial consoles are present."));
            }
            if vmi.is_some_and(|v| v.status.phase == Some(Phase::Failed)) {
                return conflict("VMI is in failed status");
            }
            if !running {
                return Err(ApiError::bad_request("VMI is not running"));
            }
        }
        VmiAction::Vnc => {
            if devices.and_then(|d| d.autoattach_graphics_device) == Some(false) {
                return Err(ApiError::bad_request("No graphics devices are present."));
            }
            if !running {
                return Err(ApiError::bad_request("VMI is not running"));
            }
        }
        VmiAction::Pause => {
            if !running {
                return conflict("VM is not running");
            }
            if vmi.is_some_and(|v| condition(v, PAUSED)) {
                return conflict("VMI is already paused");
            }
        }
        VmiAction::Unpause => {
            if !running {
                return conflict("VMI is not running");
            }
            if !vmi.is_some_and(|v| condition(v, PAUSED)) {
                return conflict("VMI is not paused");
            }
        }
        VmiAction::SoftReboot => {
            if !running {
                return conflict("VM is not running");
            }
            let vmi = vmi.expect("running");
            if condition(vmi, PAUSED) {
                return conflict("VMI is paused");
            }
            let acpi_off = vmi
                .spec
                .domain
                .features
                .as_ref()
                .and_then(|f| f.acpi.as_ref())
                .and_then(|a| a.enabled)
                == Some(false);
            if !condition(vmi, AGENT_CONNECTED) && acpi_off {
                return conflict(
                    "VMI neither have the agent connected nor the ACPI feature enabled",
                );
            }
        }
        VmiAction::GuestOsInfo | VmiAction::UserList | VmiAction::FilesystemList => {
            if !running {
                return conflict("VMI is not running");
            }
            if !vmi.is_some_and(|v| condition(v, AGENT_CONNECTED)) {
                return conflict("VMI does not have guest agent connected");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::vmi::Condition;

    fn vmi(phase: Phase, conditions: &[&str], spec: serde_json::Value) -> VirtualMachineInstance {
        let mut v: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm1", "namespace": "ns"},
            "spec": spec,
        }))
        .unwrap();
        v.status.phase = Some(phase);
        v.status.conditions = conditions
            .iter()
            .map(|c| Condition {
                type_: (*c).into(),
                status: "True".into(),
                ..Default::default()
            })
            .collect();
        v
    }

    fn plain() -> serde_json::Value {
        serde_json::json!({"domain": {"devices": {}}})
    }

    #[test]
    fn console_and_vnc_answer_400_until_the_vmi_runs() {
        let scheduled = vmi(Phase::Scheduled, &[], plain());
        for a in [VmiAction::Console, VmiAction::Vnc] {
            assert_eq!(admit(a, "vm1", Some(&scheduled)).unwrap_err().code, 400);
            assert_eq!(admit(a, "vm1", None).unwrap_err().code, 400);
            admit(a, "vm1", Some(&vmi(Phase::Running, &[], plain()))).unwrap();
        }
        let failed = vmi(Phase::Failed, &[], plain());
        assert_eq!(
            admit(VmiAction::Console, "vm1", Some(&failed))
                .unwrap_err()
                .code,
            409
        );
        let headless = vmi(
            Phase::Running,
            &[],
            serde_json::json!({"domain": {"devices": {"autoattachGraphicsDevice": false, "autoattachSerialConsole": false}}}),
        );
        assert_eq!(
            admit(VmiAction::Vnc, "vm1", Some(&headless))
                .unwrap_err()
                .message,
            "No graphics devices are present."
        );
        assert_eq!(
            admit(VmiAction::Console, "vm1", Some(&headless))
                .unwrap_err()
                .message,
            "No serial consoles are present."
        );
    }

    #[test]
    fn pause_unpause_and_reboot_follow_the_paused_condition() {
        let running = vmi(Phase::Running, &[], plain());
        let paused = vmi(Phase::Running, &[PAUSED], plain());
        admit(VmiAction::Pause, "vm1", Some(&running)).unwrap();
        let e = admit(VmiAction::Pause, "vm1", Some(&paused)).unwrap_err();
        assert_eq!(
            (e.code, e.message.ends_with("VMI is already paused")),
            (409, true)
        );
        admit(VmiAction::Unpause, "vm1", Some(&paused)).unwrap();
        assert!(admit(VmiAction::Unpause, "vm1", Some(&running))
            .unwrap_err()
            .message
            .ends_with("VMI is not paused"));
        assert!(admit(VmiAction::SoftReboot, "vm1", Some(&paused))
            .unwrap_err()
            .message
            .ends_with("VMI is paused"));
        let no_acpi = vmi(
            Phase::Running,
            &[],
            serde_json::json!({"domain": {"devices": {}, "features": {"acpi": {"enabled": false}}}}),
        );
        assert_eq!(
            admit(VmiAction::SoftReboot, "vm1", Some(&no_acpi))
                .unwrap_err()
                .code,
            409
        );
        assert_eq!(admit(VmiAction::Pause, "vm1", None).unwrap_err().code, 409);
    }

    #[test]
    fn the_guest_agent_must_be_connected() {
        let running = vmi(Phase::Running, &[], plain());
        assert!(admit(VmiAction::GuestOsInfo, "vm1", Some(&running))
            .unwrap_err()
            .message
            .ends_with("VMI does not have guest agent connected"));
        admit(
            VmiAction::UserList,
            "vm1",
            Some(&vmi(Phase::Running, &[AGENT_CONNECTED], plain())),
        )
        .unwrap();
    }
}
