//! What wakes the loop. The sources send the VMIs they see; the daemon's
//! own timers send the rest.

use crate::core::key::VmKey;
use crate::core::vmi::VirtualMachineInstance;
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq)]
pub enum Trigger {
    /// Something about this VM id changed.
    Vm(String),
    /// The set of VMIs changed: diff it and wake the ones that differ.
    Vmis(BTreeMap<VmKey, VirtualMachineInstance>),
    /// Look at every VM (the slow safety net).
    Resync,
    /// The watchdog asks whether the loop still turns: it answers by
    /// recording the number (see `Controller::heartbeat`).
    Heartbeat(u64),
    /// Drop kept EFI variables whose VirtualMachine is gone.
    EfiVars,
}
