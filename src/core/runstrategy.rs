//! A VirtualMachine's `runStrategy` as KubeVirt's virt-controller applies
//! it: given what the VM asks for and what its VMI is doing, whether to
//! create the VMI, stop it, start it anew, or wait. Pure: the loop that
//! acts on it (issue 16) is not written yet.

use std::time::Duration;

/// `spec.runStrategy`, or the deprecated `spec.running`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunStrategy {
    /// A VMI always exists: one that ends is started anew.
    Always,
    /// Started anew only when it fails; a guest that shuts down stays down.
    RerunOnFailure,
    /// Only `start`/`stop`/`restart` requests change anything.
    Manual,
    /// No VMI: a running one is stopped.
    Halted,
    /// Run once; when the VMI ends, whatever the outcome, the VM is Halted.
    Once,
}

impl RunStrategy {
    /// From the spec's `runStrategy` and `running`: KubeVirt refuses both
    /// at once, and kvirt cannot be a migration target (`WaitAsReceiver`).
    pub fn from_spec(run_strategy: Option<&str>, running: Option<bool>) -> Result<Self, String> {
        match (run_strategy, running) {
            (Some(_), Some(_)) => {
                Err("spec.running and spec.runStrategy are mutually exclusive".into())
            }
            (None, Some(true)) => Ok(Self::Always),
            (None, Some(false)) | (None, None) => Ok(Self::Halted),
            (Some(s), None) => match s {
                "Always" => Ok(Self::Always),
                "RerunOnFailure" => Ok(Self::RerunOnFailure),
                "Manual" => Ok(Self::Manual),
                "Halted" => Ok(Self::Halted),
                "Once" => Ok(Self::Once),
                "WaitAsReceiver" => {
                    Err("spec.runStrategy WaitAsReceiver: kvirt does not receive migrations".into())
                }
                other => Err(format!("spec.runStrategy {other:?} is not a run strategy")),
            },
        }
    }
}

/// What the VM's VMI is doing now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmiState {
    Absent,
    /// Pending, Scheduled or Running: alive, or on its way.
    Active,
    /// Being deleted (it has a deletion timestamp).
    Stopping,
    /// Ended with the guest shutting down.
    Succeeded,
    /// Ended otherwise (QEMU killed, start failed).
    Failed,
}

/// A `start` or `stop` asked for through the API (KubeVirt's
/// `status.stateChangeRequests`) or kvirtctl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    Start,
    Stop,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Nothing,
    Create,
    /// Delete the VMI (a graceful stop).
    Stop,
    /// Delete the ended VMI so that a new one is created.
    Remove,
    /// Start anew, but not before this (start-failure backoff, shown as
    /// `CrashLoopBackOff`).
    WaitThenCreate(Duration),
    /// The VMI ended and the VM is now `Halted` (`Once`).
    Halt,
}

/// KubeVirt's start-failure backoff: 10 s doubling per consecutive
/// failure, at most 5 minutes.
pub fn backoff(consecutive_failures: u32) -> Duration {
    if consecutive_failures == 0 {
        return Duration::ZERO;
    }
    let secs = 10u64.saturating_mul(1 << (consecutive_failures - 1).min(10));
    Duration::from_secs(secs.min(300))
}

/// What to do now. `request` is the oldest pending request (it wins over
/// the strategy, as in KubeVirt); `failures` counts consecutive failed
/// runs and `since_failure` how long ago the last one ended.
pub fn decide(
    strategy: RunStrategy,
    vmi: VmiState,
    request: Option<Request>,
    failures: u32,
    since_failure: Duration,
) -> Action {
    use Action::*;
    use VmiState::*;
    let restart_after_failure = || {
        let wait = backoff(failures).saturating_sub(since_failure);
        if wait.is_zero() {
            Create
        } else {
            WaitThenCreate(wait)
        }
    };
    match (request, vmi) {
        (Some(Request::Stop), Active) => return Stop,
        (Some(Request::Stop), _) => return Nothing,
        (Some(Request::Start), Absent) => return Create,
        (Some(Request::Start), Succeeded | Failed) => return Remove,
        (Some(Request::Start), _) => return Nothing,
        (None, _) => {}
    }
    match (strategy, vmi) {
        (_, Stopping) => Nothing,
        (RunStrategy::Halted, Active) => Stop,
        (RunStrategy::Halted, Succeeded | Failed) => Remove,
        (RunStrategy::Halted | RunStrategy::Manual, Absent) => Nothing,
        (RunStrategy::Manual, _) => Nothing,
        (RunStrategy::Always | RunStrategy::RerunOnFailure | RunStrategy::Once, Active) => Nothing,
        (RunStrategy::Always, Succeeded) => Remove,
        (RunStrategy::Always | RunStrategy::RerunOnFailure, Failed) => Remove,
        (RunStrategy::Always | RunStrategy::RerunOnFailure, Absent) => restart_after_failure(),
        (RunStrategy::RerunOnFailure, Succeeded) => Nothing,
        (RunStrategy::Once, Succeeded | Failed) => Halt,
        (RunStrategy::Once, Absent) => Create,
    }
}

#[cfg(test)]
mod tests {
    use super::Action::*;
    use super::RunStrategy::*;
    use super::VmiState::*;
    use super::*;

    #[test]
    fn the_spec_gives_one_strategy_or_a_reason() {
        assert_eq!(RunStrategy::from_spec(None, Some(true)), Ok(Always));
        assert_eq!(RunStrategy::from_spec(None, Some(false)), Ok(Halted));
        assert_eq!(RunStrategy::from_spec(None, None), Ok(Halted));
        assert_eq!(RunStrategy::from_spec(Some("Once"), None), Ok(Once));
        assert!(RunStrategy::from_spec(Some("Always"), Some(true))
            .unwrap_err()
            .contains("mutually exclusive"));
        assert!(RunStrategy::from_spec(Some("WaitAsReceiver"), None)
            .unwrap_err()
            .contains("migrations"));
        assert!(RunStrategy::from_spec(Some("always"), None).is_err());
    }

    #[test]
    fn backoff_doubles_from_ten_seconds_to_five_minutes() {
        let s = |n| backoff(n).as_secs();
        assert_eq!(
            [s(0), s(1), s(2), s(3), s(5), s(6), s(40)],
            [0, 10, 20, 40, 160, 300, 300]
        );
    }

    /// KubeVirt's table, row by row: the strategy and the VMI's state,
    /// with no request pending and no failure to wait out.
    #[test]
    fn each_strategy_acts_as_kubevirts() {
        let d = |s, v| decide(s, v, None, 0, Duration::ZERO);
        let rows = [
            (Always, Absent, Create),
            (Always, Active, Nothing),
            (Always, Succeeded, Remove),
            (Always, Failed, Remove),
            (RerunOnFailure, Absent, Create),
            (RerunOnFailure, Succeeded, Nothing),
            (RerunOnFailure, Failed, Remove),
            (Manual, Absent, Nothing),
            (Manual, Succeeded, Nothing),
            (Halted, Active, Stop),
            (Halted, Absent, Nothing),
            (Halted, Failed, Remove),
            (Once, Absent, Create),
            (Once, Active, Nothing),
            (Once, Succeeded, Halt),
            (Once, Failed, Halt),
        ];
        for (s, v, want) in rows {
            assert_eq!(d(s, v), want, "{s:?} with the VMI {v:?}");
        }
        for s in [Always, RerunOnFailure, Manual, Halted, Once] {
            assert_eq!(d(s, Stopping), Nothing, "{s:?} waits for a stop to end");
        }
    }

    #[test]
    fn requests_win_over_the_strategy() {
        let d = |s, v, r| decide(s, v, Some(r), 0, Duration::ZERO);
        assert_eq!(d(Always, Active, Request::Stop), Stop);
        assert_eq!(d(Manual, Absent, Request::Start), Create);
        assert_eq!(d(Manual, Succeeded, Request::Start), Remove);
        assert_eq!(d(Halted, Active, Request::Start), Nothing);
        assert_eq!(d(Manual, Absent, Request::Stop), Nothing);
    }

    #[test]
    fn failed_runs_are_restarted_after_their_backoff() {
        let after = |failures, ago| {
            decide(
                RerunOnFailure,
                Absent,
                None,
                failures,
                Duration::from_secs(ago),
            )
        };
        assert_eq!(after(1, 0), WaitThenCreate(Duration::from_secs(10)));
        assert_eq!(after(3, 15), WaitThenCreate(Duration::from_secs(25)));
        assert_eq!(after(3, 40), Create);
        assert_eq!(
            decide(Always, Absent, None, 9, Duration::ZERO),
            WaitThenCreate(Duration::from_secs(300))
        );
    }
}
