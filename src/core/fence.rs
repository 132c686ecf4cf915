//! Self-fencing: a host that cannot renew its own Lease stops the VMs whose
//! disks other hosts reach, before its peers take it for dead
//! ([`crate::core::liveness`]) and run those VMs again on the same disks.
//!
//! Its peers count `node_dead_after` from the last renewal they saw, plus
//! the Lease's duration; this host counts from its own last renewal, so it
//! stops its VMs a margin earlier than the earliest moment a peer may act.
//! The margin covers the time a frozen kvirtd takes to be restarted by
//! systemd's watchdog and fence at its start.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// When this host fences: unrenewed for `after`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SelfFence {
    pub after: Duration,
    /// Its peers' bound (`node_dead_after`), for the messages.
    pub dead_after: Duration,
}

impl SelfFence {
    /// `None` where the margin leaves nothing: the configuration refuses
    /// that (`kubernetes.self_fence_margin_seconds`).
    pub fn new(dead_after: Duration, margin: Duration) -> Option<Self> {
        let after = dead_after.checked_sub(margin).filter(|a| !a.is_zero())?;
        Some(Self { after, dead_after })
    }

    /// Whether a host unrenewed this long must have stopped its VMs on
    /// shared disks.
    pub fn due(&self, unrenewed: Duration) -> bool {
        unrenewed >= self.after
    }

    /// Why a VM was stopped: its VMI's `Failed` reason and Event.
    pub fn why(&self, unrenewed: Duration) -> String {
        format!(
            "fenced: this host could not renew its Lease for {} s, so its VMs on shared disks \
             were stopped before other hosts take it for dead ({} s, \
             kubernetes.node_dead_after_seconds) and run them again",
            unrenewed.as_secs(),
            self.dead_after.as_secs()
        )
    }

    /// The host's `STATUS=` while it is fenced.
    pub fn status(&self, unrenewed: Duration, fenced: usize) -> String {
        format!(
            "fenced: Lease unrenewed for {} s (self_fence after {} s); {fenced} VM(s) on shared \
             disks stopped",
            unrenewed.as_secs(),
            self.after.as_secs()
        )
    }
}

/// The record of a VM stopped by a fence, kept (root's alone) until its
/// VMI is gone: the VM is not started here again, and its VMI is failed
/// with `why` once the API server answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Fenced {
    pub vmi_uid: String,
    pub why: String,
}

impl Fenced {
    /// Whether it is of this instance (a VMI of the same name made anew
    /// since is not fenced).
    pub fn holds_for(&self, uid: Option<&str>) -> bool {
        uid == Some(self.vmi_uid.as_str())
    }
}

/// The VMs to stop: units that run (or are starting) a VM on shared disks.
pub fn to_fence(unit: &crate::core::plan::UnitObs) -> Option<&str> {
    use crate::core::plan::UnitActivity::*;
    let running = matches!(unit.activity, Active | Activating | Deactivating);
    (running && unit.shared_disks)
        .then_some(unit.uid.as_deref())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::{UnitActivity, UnitObs};

    #[test]
    fn a_host_fences_a_margin_before_its_peers_may_act() {
        let f = SelfFence::new(Duration::from_secs(300), Duration::from_secs(60)).unwrap();
        assert!(!f.due(Duration::from_secs(239)));
        assert!(f.due(Duration::from_secs(240)));
        assert!(f.why(Duration::from_secs(241)).contains("241 s"));
        assert!(f.why(Duration::from_secs(241)).contains("(300 s"));
        // No time left before the peers act: no fence can be promised.
        assert_eq!(
            SelfFence::new(Duration::from_secs(60), Duration::from_secs(60)),
            None
        );
        assert_eq!(
            SelfFence::new(Duration::from_secs(30), Duration::from_secs(60)),
            None
        );
    }

    fn unit(activity: UnitActivity, shared: bool) -> UnitObs {
        UnitObs::of("u-1", activity, shared)
    }

    #[test]
    fn only_running_vms_on_shared_disks_are_fenced() {
        assert_eq!(to_fence(&unit(UnitActivity::Active, true)), Some("u-1"));
        assert_eq!(to_fence(&unit(UnitActivity::Activating, true)), Some("u-1"));
        assert_eq!(to_fence(&unit(UnitActivity::Active, false)), None);
        assert_eq!(to_fence(&unit(UnitActivity::Failed, true)), None);
        assert_eq!(to_fence(&unit(UnitActivity::Inactive, true)), None);
        let mut anonymous = unit(UnitActivity::Active, true);
        anonymous.uid = None;
        assert_eq!(to_fence(&anonymous), None);
        let f = Fenced {
            vmi_uid: "u-1".into(),
            why: "x".into(),
        };
        assert!(f.holds_for(Some("u-1")));
        assert!(!f.holds_for(Some("u-2")));
        assert!(!f.holds_for(None));
    }
}
