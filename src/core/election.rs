//! Which kvirtd runs the cluster's controllers (VirtualMachines, replica
//! sets and pools, dead hosts, stale API endpoints): one at a time,
//! elected by a Lease, as KubeVirt's virt-controller and
//! kube-controller-manager are. Were every host to run them, each would
//! watch every VMI, VM and host Lease in the cluster: the API server
//! would send each change to every host, a cost that grows with the
//! square of the hosts. (Certificates are still approved by every host:
//! none approves its own, so the leader's needs another.)
//!
//! Time is counted by this kvirtd's own clock from when it saw each
//! renewal, never from the time written in the Lease (clocks differ; an
//! API server outage makes every Lease look old).

use std::time::{Duration, Instant};

/// The election Lease's name, in the host Leases' namespace: no host's
/// Lease (`kvirt-<node>`) can have it.
pub const LEASE: &str = "kvirt.controllers";

/// The election Lease as last seen: its holder and version, and when this
/// kvirtd saw that version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    pub holder: Option<String>,
    pub version: String,
    pub at: Instant,
}

/// What to do on a tick.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write the Lease anew (it is ours).
    Renew,
    /// Take it: it has no holder, or its holder let it run out.
    Take,
    /// Another host leads (or may still): nothing to write.
    Follow,
}

/// The step for `me`, given the Lease as `seen` (`None`: there is none),
/// its `duration`, at `now`.
pub fn step(me: &str, seen: Option<&Seen>, duration: Duration, now: Instant) -> Step {
    let Some(seen) = seen else {
        return Step::Take;
    };
    match seen.holder.as_deref() {
        Some(h) if h == me => Step::Renew,
        Some(h) if !h.is_empty() && now.saturating_duration_since(seen.at) < duration => {
            Step::Follow
        }
        _ => Step::Take,
    }
}

/// Whether a leader must stand down: its last renewal the API server took
/// is older than three quarters of the duration, so that it has stopped
/// acting before any other host may take the Lease (which waits for the
/// whole duration after the last renewal it saw).
pub fn must_stand_down(last_renewed: Instant, duration: Duration, now: Instant) -> bool {
    now.saturating_duration_since(last_renewed) >= duration * 3 / 4
}

/// How often the leader renews: a third of the duration, so that one lost
/// renewal is not yet a reason to stand down.
pub fn renew_every(duration: Duration) -> Duration {
    (duration / 3).max(Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Duration = Duration::from_secs(15);

    fn seen(holder: &str, at: Instant) -> Seen {
        Seen {
            holder: (!holder.is_empty()).then(|| holder.to_owned()),
            version: "1".into(),
            at,
        }
    }

    #[test]
    fn a_lease_nobody_holds_is_taken_and_ours_is_renewed() {
        let now = Instant::now();
        assert_eq!(step("a", None, D, now), Step::Take);
        assert_eq!(step("a", Some(&seen("", now)), D, now), Step::Take);
        assert_eq!(step("a", Some(&seen("a", now)), D, now), Step::Renew);
    }

    #[test]
    fn another_holder_is_followed_until_unrenewed_for_the_whole_duration_as_seen_here() {
        let at = Instant::now();
        let lease = seen("b", at);
        assert_eq!(step("a", Some(&lease), D, at), Step::Follow);
        assert_eq!(
            step("a", Some(&lease), D, at + D - Duration::from_millis(1)),
            Step::Follow
        );
        assert_eq!(step("a", Some(&lease), D, at + D), Step::Take);
    }

    #[test]
    fn a_leader_stands_down_before_a_follower_may_take_over() {
        let renewed = Instant::now();
        assert!(!must_stand_down(renewed, D, renewed + renew_every(D) * 2));
        assert!(must_stand_down(renewed, D, renewed + D * 3 / 4));
        // A follower that saw that same renewal at once may take only later.
        assert_eq!(
            step("a", Some(&seen("b", renewed)), D, renewed + D * 3 / 4),
            Step::Follow
        );
    }
}
