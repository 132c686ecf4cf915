//! Which kvirt hosts are dead, as virt-controller tells a node whose
//! virt-handler stopped heartbeating: a host whose Lease this kvirtd has
//! seen go unrenewed for its duration plus `dead_after`. Counted by this
//! kvirtd's own clock from when it saw each renewal, never from the time
//! written in the Lease: after an API server outage every Lease looks old,
//! and a kvirtd that just started has seen nothing yet; neither is a death.

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What a Lease says: whose it is, when it was last renewed (as written)
/// and for how long.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Beat {
    pub node: String,
    pub renewed: String,
    pub duration: Duration,
}

/// Each host's last renewal, and when this kvirtd saw it.
#[derive(Default, Debug)]
pub struct Liveness {
    seen: BTreeMap<String, (Beat, Instant)>,
}

impl Liveness {
    /// Notes the Leases as they are at `now`: a renewal not seen before
    /// counts from now; a host whose Lease is gone is forgotten. While
    /// this host's own renewals are not seen (its API server away, its
    /// watch broken) it is blind: once it sees again, every host's clock
    /// starts anew.
    pub fn observe(&mut self, beats: &[Beat], own: &str, now: Instant) {
        let was_blind = self.blind(own, now);
        self.seen
            .retain(|node, _| beats.iter().any(|b| &b.node == node));
        for b in beats {
            let fresh = self.seen.get(&b.node).is_none_or(|(old, _)| old != b);
            if fresh {
                self.seen.insert(b.node.clone(), (b.clone(), now));
            }
        }
        if was_blind && !self.blind(own, now) {
            for (_, at) in self.seen.values_mut() {
                *at = now;
            }
        }
    }

    /// Whether this host's own renewals are unseen for longer than its
    /// Lease's duration (or never seen).
    fn blind(&self, own: &str, now: Instant) -> bool {
        self.seen
            .get(own)
            .is_none_or(|(b, at)| now.saturating_duration_since(*at) > b.duration)
    }

    /// The hosts unrenewed, as seen from here, for their Lease's duration
    /// plus `dead_after`; never `own`, and none while blind.
    pub fn dead(&self, own: &str, dead_after: Duration, now: Instant) -> Vec<String> {
        if self.blind(own, now) {
            return vec![];
        }
        (self.seen.iter())
            .filter(|(node, (beat, at))| {
                node.as_str() != own
                    && now.saturating_duration_since(*at) > beat.duration + dead_after
            })
            .map(|(node, _)| node.clone())
            .collect()
    }
}

/// KubeVirt's reason for a VMI failed because its node stopped answering.
pub const NODE_UNRESPONSIVE: &str = "NodeUnresponsive";

/// The patch that fails a dead host's VMI: phase `Failed`, reason
/// `NodeUnresponsive`, not Ready, and the finalizers that waited for that
/// host dropped (`kept` are the others), so its VirtualMachine can replace
/// it. Guarded by the VMI's resourceVersion: of the kvirtds that see the
/// host dead, one writes it.
pub fn unresponsive_patch(resource_version: &str, node: &str, kept: &[String]) -> Value {
    let message = format!("node {node} stopped renewing its Lease: its VM is taken as lost");
    json!({
        "metadata": {"resourceVersion": resource_version, "finalizers": kept},
        "status": {
            "phase": "Failed",
            "reason": NODE_UNRESPONSIVE,
            "conditions": [{
                "type": "Ready",
                "status": "False",
                "reason": NODE_UNRESPONSIVE,
                "message": message,
            }],
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(node: &str, renewed: &str) -> Beat {
        Beat {
            node: node.into(),
            renewed: renewed.into(),
            duration: Duration::from_secs(8),
        }
    }

    /// `a` (this host) renewing every 2 s from `from` to `to` seconds,
    /// with `others` as they are.
    fn run(l: &mut Liveness, t0: Instant, from: u64, to: u64, others: &[Beat]) {
        for s in (from..=to).step_by(2) {
            let mut beats = vec![beat("a", &s.to_string())];
            beats.extend_from_slice(others);
            l.observe(&beats, "a", t0 + Duration::from_secs(s));
        }
    }

    #[test]
    fn a_host_is_dead_once_seen_unrenewed_for_its_lease_and_the_grace() {
        let t0 = Instant::now();
        let after = Duration::from_secs(10);
        let at = |s| t0 + Duration::from_secs(s);
        let mut l = Liveness::default();
        run(&mut l, t0, 0, 8, &[beat("b", "1")]);
        // b renews at 10 s, then stops; a (this host) never counts.
        run(&mut l, t0, 10, 26, &[beat("b", "2")]);
        assert!(l.dead("a", after, at(27)).is_empty());
        run(&mut l, t0, 28, 28, &[beat("b", "2")]);
        assert_eq!(l.dead("a", after, at(29)), ["b"]);
        // A host whose Lease is deleted is forgotten, not dead.
        run(&mut l, t0, 30, 60, &[]);
        assert!(l.dead("a", after, at(60)).is_empty());
    }

    #[test]
    fn old_leases_seen_first_after_an_outage_or_a_start_count_from_then() {
        let t0 = Instant::now();
        let after = Duration::from_secs(10);
        let at = |s| t0 + Duration::from_secs(s);
        // Whatever the Lease says, this kvirtd counts from its first look.
        let mut l = Liveness::default();
        let old = beat("b", "2020-01-01T00:00:00.000000Z");
        run(&mut l, t0, 0, 18, std::slice::from_ref(&old));
        assert!(l.dead("a", after, at(18)).is_empty());
        run(&mut l, t0, 20, 20, std::slice::from_ref(&old));
        assert_eq!(l.dead("a", after, at(20)), ["b"]);
        // An outage: nothing renews, this host sees nothing new for 60 s.
        let mut l = Liveness::default();
        run(&mut l, t0, 0, 4, &[beat("b", "1")]);
        assert!(l.dead("a", after, at(64)).is_empty(), "blind, not dead");
        // Back: its own renewal seen again, and b's old one still listed:
        // b's clock starts from the return, as everyone's.
        l.observe(&[beat("a", "64"), beat("b", "1")], "a", at(64));
        assert!(l.dead("a", after, at(70)).is_empty());
        run(&mut l, t0, 66, 84, &[beat("b", "1")]);
        assert_eq!(l.dead("a", after, at(84)), ["b"]);
        // Never seen its own Lease (just started): blind.
        let mut l = Liveness::default();
        l.observe(&[beat("b", "1")], "a", t0);
        assert!(l.dead("a", after, at(100)).is_empty());
    }

    #[test]
    fn the_patch_fails_the_vmi_as_kubevirt_does_and_drops_the_hosts_finalizers() {
        let p = unresponsive_patch("42", "node-b", &["example.com/keep".into()]);
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["metadata"]["finalizers"], json!(["example.com/keep"]));
        assert_eq!(p["status"]["phase"], "Failed");
        assert_eq!(p["status"]["reason"], NODE_UNRESPONSIVE);
        assert_eq!(p["status"]["conditions"][0]["status"], "False");
    }
}
