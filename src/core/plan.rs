//! `plan(desired, observed) -> steps`: what to do for one VM, as a plain
//! function of what the VMI asks for and what the host has now.
//!
//! Level-triggered: the plan never depends on what happened before except
//! through the VMI's recorded phase, so running it again after any crash
//! continues where things stand.

use crate::core::layout::DaemonKind;
use crate::core::phase::is_final;
use crate::core::vmi::Phase;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitActivity {
    Active,
    Activating,
    Deactivating,
    Inactive,
    Failed,
}

/// The VM's unit as systemd reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitObs {
    pub activity: UnitActivity,
    /// `KVIRT_VMI_UID` from the unit's environment.
    pub uid: Option<String>,
    pub daemon: Option<DaemonKind>,
    pub grace: Option<Duration>,
    /// `<ns>_<name>` from the unit's environment: the domain to shut down
    /// when only the unit is left to go by.
    pub domain_name: Option<String>,
    /// systemd's `Result` (e.g. `exit-code`) for a stopped unit; empty
    /// for one that runs.
    pub result: String,
    /// How often systemd restarted the daemon in this unit (`NRestarts`).
    pub restarts: u32,
    /// The unit's main process, the VM's libvirt daemon (`MainPID`), of
    /// an active unit.
    pub main_pid: Option<u32>,
    /// The CPUs it may run on (`AllowedCPUs`); `None`: any, or not read
    /// (a host that places no unit on CPUs).
    pub allowed_cpus: Option<crate::core::cpuset::CpuSet>,
    /// The VM writes disks other hosts reach (`KVIRT_SHARED_DISKS`): a
    /// self-fence stops it ([`crate::core::fence`]).
    pub shared_disks: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DomainState {
    Running,
    Paused,
    /// Powered off by the guest (or by us).
    Shutdown,
    Crashed,
    /// Defined, never started or stopped by a destroy.
    Shutoff,
    Other,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainObs {
    pub state: DomainState,
    /// The VMI UID from the domain's kvirt metadata.
    pub uid: Option<String>,
    /// Why a paused domain is paused (KubeVirt's `Paused` condition
    /// reason: `PausedByUser`, `PausedIOError`, ...).
    pub paused: Option<String>,
    /// The machine type QEMU runs (`status.machine.type`).
    pub machine: Option<String>,
    /// The guest agent's channel is connected: only then is it asked.
    pub agent: bool,
}

/// A connected guest agent and the guest OS it reports, with KubeVirt's
/// `guestOSInfo` keys (`id`, `name`, `prettyName`, `version`, ...); empty
/// when the agent cannot tell.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestAgent {
    pub os_info: BTreeMap<String, String>,
}

/// Everything the host has of one VM id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub unit: Option<UnitObs>,
    pub netns: bool,
    pub state_dir: bool,
    pub runtime_dir: bool,
    /// The runtime directory holds only a finished VM's console tail
    /// (root's): nothing of it is the VM's identity's any more.
    pub runtime_kept: bool,
    /// An address is leased to this VM id.
    pub network: bool,
    pub domain: Option<DomainObs>,
    /// Registered with systemd-machined; None where machined is absent.
    pub machine: Option<bool>,
    /// The VM has an identity (a uid of its own) allocated.
    pub identity: bool,
    /// The unit runs but its libvirt daemon did not answer: what the
    /// domain does is unknown. Why (a timeout, a socket nobody or
    /// something else listens on), for the VMI's condition.
    pub unresponsive: Option<String>,
}

#[cfg(test)]
impl UnitObs {
    /// A unit of VMI `uid`, in `activity`, for tests.
    pub(crate) fn of(uid: &str, activity: UnitActivity, shared_disks: bool) -> Self {
        Self {
            activity,
            uid: Some(uid.into()),
            daemon: None,
            grace: None,
            domain_name: None,
            result: String::new(),
            restarts: 0,
            main_pid: None,
            allowed_cpus: None,
            shared_disks,
        }
    }
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.unit.is_none()
            && !self.netns
            && !self.state_dir
            && !self.runtime_dir
            && !self.network
            && self.domain.is_none()
            && self.machine != Some(true)
            && !self.identity
    }

    fn uid(&self) -> Option<&str> {
        self.unit
            .as_ref()
            .and_then(|u| u.uid.as_deref())
            .or_else(|| self.domain.as_ref().and_then(|d| d.uid.as_deref()))
    }

    fn domain_up(&self) -> bool {
        matches!(
            self.domain.as_ref().map(|d| d.state),
            Some(DomainState::Running | DomainState::Paused)
        )
    }
}

/// What the VMI asks for, as far as planning needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    pub uid: String,
    pub grace: Duration,
    /// The phase recorded in the VMI's status.
    pub phase: Option<Phase>,
    /// Why the VMI cannot run, if the converter refused it.
    pub invalid: Option<String>,
    /// A live migration this host takes part in.
    pub migrating: Option<Migrating>,
    /// Why a self-fence stopped it here ([`crate::core::fence`]): it is
    /// not started here again, and its VMI fails with this.
    pub fenced: Option<String>,
}

/// This host's part in a live migration of the VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Migrating {
    /// It receives the VM: everything but the domain is made, and the
    /// migration brings the domain. Until the source commits, the VMI's
    /// status is the source's to write.
    Incoming,
    /// It sends the VM away: the domain leaving is the migration's end,
    /// never a failure and never a reason to start it here again.
    Outgoing,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The VM's own uid and gid, which its files, tap and unit use.
    AcquireIdentity,
    CreateDirs,
    PrepareDisks,
    CreateNetns,
    /// The VM's address, veth, in-namespace bridge, tap, NAT and DHCP
    /// (idempotent; nothing for a VM without an interface).
    SetupNetwork,
    StartUnit,
    DefineDomain,
    StartDomain,
    /// Tell machined about the running VM (best effort: never fails it).
    RegisterMachine,
    UnregisterMachine,
    /// ACPI power-off, re-sent, for up to `grace`. What still runs then is
    /// ended by StopUnit, which always follows (the domain runs in the unit).
    ShutdownDomain {
        grace: Duration,
    },
    StopUnit,
    /// DHCP, veth and the leased address.
    TeardownNetwork,
    DeleteNetns,
    RemoveStateDir,
    RemoveRuntimeDir,
    /// A finished VM's runtime directory (its tmpfs, its identity's)
    /// replaced at once by the last of its console log, root's: what a
    /// user reads after a failure stays, and costs little.
    KeepConsoleLog,
    /// Once nothing of the VM is left that its identity owns.
    ReleaseIdentity,
}

impl Step {
    /// Its name in metrics and logs (`kvirt_step_duration_seconds{step}`).
    pub fn name(&self) -> &'static str {
        match self {
            Step::AcquireIdentity => "acquire_identity",
            Step::CreateDirs => "create_dirs",
            Step::PrepareDisks => "prepare_disks",
            Step::CreateNetns => "create_netns",
            Step::SetupNetwork => "setup_network",
            Step::StartUnit => "start_unit",
            Step::DefineDomain => "define_domain",
            Step::StartDomain => "start_domain",
            Step::RegisterMachine => "register_machine",
            Step::UnregisterMachine => "unregister_machine",
            Step::ShutdownDomain { .. } => "shutdown_domain",
            Step::StopUnit => "stop_unit",
            Step::TeardownNetwork => "teardown_network",
            Step::DeleteNetns => "delete_netns",
            Step::RemoveStateDir => "remove_state_dir",
            Step::RemoveRuntimeDir => "remove_runtime_dir",
            Step::KeepConsoleLog => "keep_console_log",
            Step::ReleaseIdentity => "release_identity",
        }
    }

    /// Makes something of the VM: a failure rolls the whole start back.
    pub fn creates(&self) -> bool {
        matches!(
            self,
            Step::AcquireIdentity
                | Step::CreateDirs
                | Step::PrepareDisks
                | Step::CreateNetns
                | Step::SetupNetwork
                | Step::StartUnit
                | Step::DefineDomain
                | Step::StartDomain
        )
    }

    /// machined only mirrors what runs: its failures are logged, never
    /// fatal to a start or a teardown.
    pub fn best_effort(&self) -> bool {
        matches!(self, Step::RegisterMachine | Step::UnregisterMachine)
    }

    /// Teardown steps that touch separate systems and need nothing of each
    /// other: run together, so a hundred VMs deleted at once wait for
    /// machined or the host's netlink only once, not once per step. The
    /// grace period starts while machined is told, and the network goes
    /// while the unit stops (its guest's grace is over by then).
    fn stage(&self) -> Option<u8> {
        match self {
            Step::UnregisterMachine | Step::ShutdownDomain { .. } => Some(1),
            Step::StopUnit | Step::TeardownNetwork => Some(2),
            _ => None,
        }
    }
}

/// The steps in order, cut where one must wait for the one before: each
/// stage's steps may run at once.
pub fn stages(steps: &[Step]) -> impl Iterator<Item = &[Step]> {
    steps.chunk_by(|a, b| a.stage().is_some() && a.stage() == b.stage())
}

/// The phase the VMI should show after the steps, with the reason for a
/// failure or a pending condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Phase(Phase),
    /// The VMI cannot run: Failed with `Synchronized=False`.
    Invalid(String),
    /// The VMI cannot run on this host, for a reason with a name of its
    /// own (a claim it cannot reach): Failed, `Synchronized=False` with
    /// that reason.
    Refused {
        reason: &'static str,
        message: String,
    },
    Failed(String),
    /// Nothing to report (the VMI is gone, or the host is still settling).
    Unchanged,
    /// The VM's libvirt daemon does not answer: the phase stays, the VM is
    /// not Ready, and nothing is done to it until it answers again.
    Unresponsive(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    pub outcome: Outcome,
    /// Look again soon: something is in motion (a unit starting or stopping,
    /// an old instance being replaced).
    pub requeue: bool,
    /// Which case of the plan this is, for the log line that shows the
    /// steps: a teardown says what made it one.
    pub why: &'static str,
}

impl Plan {
    fn new(steps: Vec<Step>, outcome: Outcome, why: &'static str) -> Self {
        Self {
            steps,
            outcome,
            requeue: false,
            why,
        }
    }

    /// A plan after which the VM is looked at again soon.
    fn again(steps: Vec<Step>, outcome: Outcome, why: &'static str) -> Self {
        Self {
            requeue: true,
            ..Self::new(steps, outcome, why)
        }
    }
}

const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Everything needed to remove whatever the host has of this VM, in order.
fn teardown(obs: &Observed, grace: Duration, keep_runtime: bool) -> Vec<Step> {
    let mut steps = Vec::new();
    if obs.machine == Some(true) {
        steps.push(Step::UnregisterMachine);
    }
    if obs.domain_up() {
        steps.push(Step::ShutdownDomain { grace });
    }
    if obs.unit.is_some() {
        steps.push(Step::StopUnit);
    }
    if obs.network || obs.netns {
        steps.push(Step::TeardownNetwork);
    }
    if obs.netns {
        steps.push(Step::DeleteNetns);
    }
    if obs.state_dir {
        steps.push(Step::RemoveStateDir);
    }
    match (obs.runtime_dir, keep_runtime) {
        (true, false) => steps.push(Step::RemoveRuntimeDir),
        // A finished VMI keeps its console log readable until it goes.
        (true, true) if !obs.runtime_kept => steps.push(Step::KeepConsoleLog),
        _ => {}
    }
    // Nothing of the VM is its identity's after these steps.
    if obs.identity {
        steps.push(Step::ReleaseIdentity);
    }
    steps
}

/// A VM that runs (or is about to) and machined does not know yet.
fn register(obs: &Observed) -> impl Iterator<Item = Step> {
    (obs.machine == Some(false))
        .then_some(Step::RegisterMachine)
        .into_iter()
}

pub fn plan(desired: Option<&Desired>, obs: &Observed) -> Plan {
    let Some(d) = desired else {
        let grace = obs
            .unit
            .as_ref()
            .and_then(|u| u.grace)
            .unwrap_or(DEFAULT_GRACE);
        return Plan::new(
            teardown(obs, grace, false),
            Outcome::Unchanged,
            "the VMI is gone or being deleted",
        );
    };

    // A different instance of the same name (the manifest was replaced):
    // clear the old one out first, then come back for the new one.
    if obs.uid().is_some_and(|uid| uid != d.uid) {
        return Plan::again(
            teardown(obs, d.grace, true),
            Outcome::Unchanged,
            "the host runs another instance of this name",
        );
    }

    if let Some(reason) = &d.invalid {
        return Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Invalid(reason.clone()),
            "the VMI cannot run",
        );
    }

    if d.phase.is_some_and(is_final) {
        // Done: nothing of it runs any more, but its status stays readable.
        return Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Unchanged,
            "the VMI has finished",
        );
    }

    if let Some(why) = &d.fenced {
        // Stopped at once: its disks may be another host's by now. A VM
        // that was arriving is still the source's to report.
        let outcome = match d.migrating {
            Some(Migrating::Incoming) => Outcome::Unchanged,
            _ => Outcome::Failed(why.clone()),
        };
        return Plan::new(
            teardown(obs, Duration::ZERO, true),
            outcome,
            "a self-fence stopped the VM",
        );
    }

    match (d.migrating, &obs.unit) {
        (Some(Migrating::Incoming), None) => incoming(obs),
        (Some(Migrating::Outgoing), None) => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Unchanged,
            "the unit of a VM migrating away is gone",
        ),
        (_, None) => without_unit(d, obs),
        (_, Some(unit)) => with_unit(d, obs, unit),
    }
}

/// A VM to receive: made as a start makes it, without a domain.
fn incoming(obs: &Observed) -> Plan {
    Plan::new(
        everything_but_the_domain(obs),
        Outcome::Unchanged,
        "preparing to receive the VM",
    )
}

/// Nothing of the VM runs: made, unless it ran and its unit went.
fn without_unit(d: &Desired, obs: &Observed) -> Plan {
    if d.phase == Some(Phase::Running) {
        return Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Failed("the VM's unit disappeared".into()),
            "the unit of a running VM is gone",
        );
    }
    let mut steps = everything_but_the_domain(obs);
    steps.extend([Step::DefineDomain, Step::StartDomain]);
    steps.extend(register(obs));
    Plan::new(steps, Outcome::Phase(Phase::Running), "creating the VM")
}

/// A start's steps up to the VM's daemon running: its identity, files,
/// namespace, network and unit.
fn everything_but_the_domain(obs: &Observed) -> Vec<Step> {
    let mut steps = vec![Step::AcquireIdentity, Step::CreateDirs, Step::PrepareDisks];
    if !obs.netns {
        steps.push(Step::CreateNetns);
    }
    steps.extend([Step::SetupNetwork, Step::StartUnit]);
    steps
}

/// The VM's unit is there: what its state says.
fn with_unit(d: &Desired, obs: &Observed, unit: &UnitObs) -> Plan {
    match unit.activity {
        UnitActivity::Activating | UnitActivity::Deactivating => Plan::again(
            vec![],
            Outcome::Unchanged,
            "the unit is starting or stopping",
        ),
        // A unit that stopped before it said whose it is (its properties
        // gone with it, or an older instance's torn down while its daemon
        // died): cleared out, and the VMI not blamed for it.
        UnitActivity::Failed | UnitActivity::Inactive
            if unit.uid.as_deref() != Some(d.uid.as_str()) =>
        {
            Plan::again(
                teardown(obs, d.grace, true),
                Outcome::Unchanged,
                "a unit of no known instance stopped",
            )
        }
        // Arriving or leaving, the migration says how it ended, not this.
        UnitActivity::Failed | UnitActivity::Inactive if d.migrating.is_some() => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Unchanged,
            "the unit of a migrating VM stopped",
        ),
        UnitActivity::Failed | UnitActivity::Inactive => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Failed(format!(
                "the VM's libvirt daemon stopped (result: {})",
                unit.result
            )),
            "the VM's unit stopped",
        ),
        UnitActivity::Active if obs.unresponsive.is_some() => {
            let why = obs.unresponsive.as_deref().unwrap_or_default();
            Plan::again(
                vec![],
                Outcome::Unresponsive(format!("the VM's libvirt daemon does not answer: {why}")),
                "the VM's libvirt daemon does not answer",
            )
        }
        UnitActivity::Active => with_domain(d, obs),
    }
}

/// The unit runs: what the domain's state says.
fn with_domain(d: &Desired, obs: &Observed) -> Plan {
    match d.migrating {
        Some(Migrating::Incoming) => return with_incoming_domain(obs),
        Some(Migrating::Outgoing) => return with_outgoing_domain(d, obs),
        None => {}
    }
    let was_running = d.phase == Some(Phase::Running);
    match obs.domain.as_ref().map(|dom| dom.state) {
        None => Plan::new(
            [Step::SetupNetwork, Step::DefineDomain, Step::StartDomain]
                .into_iter()
                .chain(register(obs))
                .collect(),
            Outcome::Phase(Phase::Running),
            "the unit runs without the domain",
        ),
        Some(DomainState::Running | DomainState::Paused) => Plan::new(
            register(obs).collect(),
            Outcome::Phase(Phase::Running),
            "the VM runs",
        ),
        Some(DomainState::Shutoff | DomainState::Other) if !was_running => Plan::new(
            std::iter::once(Step::StartDomain)
                .chain(register(obs))
                .collect(),
            Outcome::Phase(Phase::Running),
            "the domain is defined but not started",
        ),
        Some(DomainState::Shutdown) => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Phase(Phase::Succeeded),
            "the guest powered off",
        ),
        Some(DomainState::Crashed) => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Failed("the guest crashed".into()),
            "the guest crashed",
        ),
        Some(DomainState::Shutoff | DomainState::Other) => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Failed("the domain stopped unexpectedly".into()),
            "the domain stopped",
        ),
    }
}

/// Receiving: nothing to do but wait. The domain arrives paused while the
/// migration runs (a paused VM stays so), and is this host's only once
/// the source commits; until then nothing else happens to it here.
fn with_incoming_domain(obs: &Observed) -> Plan {
    let why = match obs.domain.as_ref().map(|dom| dom.state) {
        Some(DomainState::Running | DomainState::Paused) => {
            "the migration brought the domain; the source commits it"
        }
        _ => "waiting for the migration to bring the domain",
    };
    Plan::new(vec![], Outcome::Unchanged, why)
}

/// Sending: the VM runs here until the migration ends; then its domain is
/// gone (the target runs it) and the rest goes, reported by the migration,
/// not as the VM's end.
fn with_outgoing_domain(d: &Desired, obs: &Observed) -> Plan {
    match obs.domain.as_ref().map(|dom| dom.state) {
        Some(DomainState::Running | DomainState::Paused) => Plan::new(
            register(obs).collect(),
            Outcome::Phase(Phase::Running),
            "the VM runs while it migrates",
        ),
        None => Plan::new(
            teardown(obs, d.grace, true),
            Outcome::Unchanged,
            "the VM migrated away",
        ),
        // Shut off as the migration hands over, about to be undefined.
        Some(_) => Plan::new(
            vec![],
            Outcome::Unchanged,
            "the VM is handed over to its target",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Step::*;

    const G: Duration = Duration::from_secs(30);

    fn desired(phase: Option<Phase>) -> Desired {
        Desired {
            uid: "u1".into(),
            grace: G,
            phase,
            invalid: None,
            migrating: None,
            fenced: None,
        }
    }

    fn unit(activity: UnitActivity, uid: &str) -> Option<UnitObs> {
        Some(UnitObs {
            activity,
            uid: Some(uid.into()),
            daemon: Some(DaemonKind::Virtqemud),
            grace: Some(Duration::from_secs(5)),
            domain_name: Some("ns_vm".into()),
            result: "success".into(),
            restarts: 0,
            main_pid: None,
            allowed_cpus: None,
            shared_disks: false,
        })
    }

    fn dom(state: DomainState) -> Option<DomainObs> {
        Some(DomainObs {
            state,
            uid: Some("u1".into()),
            paused: None,
            machine: None,
            agent: false,
        })
    }

    fn running_host(state: DomainState) -> Observed {
        Observed {
            unit: unit(UnitActivity::Active, "u1"),
            netns: true,
            state_dir: true,
            runtime_dir: true,
            runtime_kept: false,
            network: true,
            domain: dom(state),
            machine: None,
            identity: true,
            unresponsive: None,
        }
    }

    #[test]
    fn a_teardown_runs_in_stages_and_a_start_one_step_at_a_time() {
        let down = plan(None, &running_host(DomainState::Running));
        let got: Vec<&[Step]> = stages(&down.steps).collect();
        assert_eq!(
            got,
            [
                &[ShutdownDomain {
                    grace: Duration::from_secs(5)
                }][..],
                &[StopUnit, TeardownNetwork],
                &[DeleteNetns],
                &[RemoveStateDir],
                &[RemoveRuntimeDir],
                &[ReleaseIdentity],
            ]
        );
        let registered = Observed {
            machine: Some(true),
            ..running_host(DomainState::Running)
        };
        let down = plan(None, &registered);
        assert_eq!(
            stages(&down.steps).next(),
            Some(
                &[
                    UnregisterMachine,
                    ShutdownDomain {
                        grace: Duration::from_secs(5)
                    }
                ][..]
            )
        );
        let up = plan(Some(&desired(None)), &Observed::default());
        assert!(up.steps.len() > 1);
        assert!(stages(&up.steps).all(|s| s.len() == 1), "{:?}", up.steps);
    }

    #[test]
    fn a_daemon_that_does_not_answer_keeps_its_vm_and_only_a_teardown_acts() {
        let stuck = Observed {
            domain: None,
            unresponsive: Some("timed out".into()),
            ..running_host(DomainState::Running)
        };
        let p = plan(Some(&desired(Some(Phase::Running))), &stuck);
        assert!(p.steps.is_empty(), "{:?}", p.steps);
        assert!(matches!(p.outcome, Outcome::Unresponsive(_)));
        assert!(p.requeue);
        // Deleted meanwhile: the unit's stop takes QEMU along, with no
        // shutdown asked of a daemon that would not pass it on.
        let gone = plan(None, &stuck).steps;
        assert_eq!(gone.first(), Some(&Step::StopUnit), "{gone:?}");
    }

    #[test]
    fn a_start_is_all_creates_and_a_teardown_none() {
        let start = plan(Some(&desired(None)), &Observed::default()).steps;
        assert!(
            !start.is_empty() && start.iter().all(Step::creates),
            "{start:?}"
        );
        let teardown = plan(None, &running_host(DomainState::Running)).steps;
        assert!(!teardown.is_empty(), "{teardown:?}");
        assert!(!teardown.iter().any(Step::creates), "{teardown:?}");
        assert!(RegisterMachine.best_effort() && UnregisterMachine.best_effort());
        assert!(!teardown.iter().any(|s| s.best_effort() && s.creates()));
    }

    #[test]
    fn table() {
        use DomainState as D;
        use Phase::*;
        let full_teardown_keep = vec![
            ShutdownDomain { grace: G },
            StopUnit,
            TeardownNetwork,
            DeleteNetns,
            RemoveStateDir,
            KeepConsoleLog,
            ReleaseIdentity,
        ];
        type Case = (&'static str, Option<Desired>, Observed, Vec<Step>, Outcome);
        let cases: Vec<Case> = vec![
            (
                "new VMI, empty host: create everything",
                Some(desired(None)),
                Observed::default(),
                vec![
                    AcquireIdentity,
                    CreateDirs,
                    PrepareDisks,
                    CreateNetns,
                    SetupNetwork,
                    StartUnit,
                    DefineDomain,
                    StartDomain,
                ],
                Outcome::Phase(Running),
            ),
            (
                "adopted: running VM is left alone",
                Some(desired(Some(Running))),
                running_host(D::Running),
                vec![],
                Outcome::Phase(Running),
            ),
            (
                "daemon up but domain never defined (crash mid-create)",
                Some(desired(Some(Scheduled))),
                Observed {
                    domain: None,
                    ..running_host(D::Running)
                },
                vec![SetupNetwork, DefineDomain, StartDomain],
                Outcome::Phase(Running),
            ),
            (
                "defined but not started",
                Some(desired(Some(Scheduled))),
                running_host(D::Shutoff),
                vec![StartDomain],
                Outcome::Phase(Running),
            ),
            (
                "guest powered off: Succeeded, unit collected, status kept",
                Some(desired(Some(Running))),
                running_host(D::Shutdown),
                vec![
                    StopUnit,
                    TeardownNetwork,
                    DeleteNetns,
                    RemoveStateDir,
                    KeepConsoleLog,
                    ReleaseIdentity,
                ],
                Outcome::Phase(Succeeded),
            ),
            (
                "guest crashed",
                Some(desired(Some(Running))),
                running_host(D::Crashed),
                vec![
                    StopUnit,
                    TeardownNetwork,
                    DeleteNetns,
                    RemoveStateDir,
                    KeepConsoleLog,
                    ReleaseIdentity,
                ],
                Outcome::Failed("the guest crashed".into()),
            ),
            (
                "unit vanished under a running VM",
                Some(desired(Some(Running))),
                Observed {
                    unit: None,
                    domain: None,
                    ..running_host(D::Running)
                },
                vec![
                    TeardownNetwork,
                    DeleteNetns,
                    RemoveStateDir,
                    KeepConsoleLog,
                    ReleaseIdentity,
                ],
                Outcome::Failed("the VM's unit disappeared".into()),
            ),
            (
                "VMI removed: graceful teardown with the unit's grace",
                None,
                running_host(D::Running),
                vec![
                    ShutdownDomain {
                        grace: Duration::from_secs(5),
                    },
                    StopUnit,
                    TeardownNetwork,
                    DeleteNetns,
                    RemoveStateDir,
                    RemoveRuntimeDir,
                    ReleaseIdentity,
                ],
                Outcome::Unchanged,
            ),
            (
                "VMI removed, only its identity left (a crash after releasing the rest)",
                None,
                Observed {
                    identity: true,
                    ..Observed::default()
                },
                vec![ReleaseIdentity],
                Outcome::Unchanged,
            ),
            (
                "VMI removed, nothing on host",
                None,
                Observed::default(),
                vec![],
                Outcome::Unchanged,
            ),
            (
                "invalid VMI touches nothing new",
                Some(Desired {
                    invalid: Some("spec.x: unsupported".into()),
                    ..desired(None)
                }),
                Observed::default(),
                vec![],
                Outcome::Invalid("spec.x: unsupported".into()),
            ),
            (
                "final VMI: leftovers cleaned, status kept",
                Some(desired(Some(Succeeded))),
                running_host(D::Running),
                full_teardown_keep,
                Outcome::Unchanged,
            ),
            (
                "unit failed before the VM ran",
                Some(desired(Some(Scheduled))),
                Observed {
                    unit: Some(UnitObs {
                        activity: UnitActivity::Failed,
                        result: "exit-code".into(),
                        ..unit(UnitActivity::Failed, "u1").unwrap()
                    }),
                    domain: None,
                    ..running_host(D::Running)
                },
                vec![
                    StopUnit,
                    TeardownNetwork,
                    DeleteNetns,
                    RemoveStateDir,
                    KeepConsoleLog,
                    ReleaseIdentity,
                ],
                Outcome::Failed("the VM's libvirt daemon stopped (result: exit-code)".into()),
            ),
        ];
        for (name, d, obs, steps, outcome) in cases {
            let p = plan(d.as_ref(), &obs);
            assert_eq!(p.steps, steps, "{name}");
            assert_eq!(p.outcome, outcome, "{name}");
        }
    }

    #[test]
    fn replaced_instance_is_torn_down_first_and_requeued() {
        let mut obs = running_host(DomainState::Running);
        obs.unit = unit(UnitActivity::Active, "old");
        obs.domain = None;
        let p = plan(Some(&desired(None)), &obs);
        assert_eq!(
            p.steps,
            vec![
                StopUnit,
                TeardownNetwork,
                DeleteNetns,
                RemoveStateDir,
                KeepConsoleLog,
                ReleaseIdentity
            ]
        );
        assert!(p.requeue);
    }

    /// A finished VM's console tail is root's: kept as it is, and nothing
    /// of it holds the VM's number any more; it goes with the VMI.
    #[test]
    fn a_finished_vm_keeps_only_its_console_tail_and_no_identity() {
        let kept = Observed {
            runtime_dir: true,
            runtime_kept: true,
            identity: true,
            ..Observed::default()
        };
        let done = plan(Some(&desired(Some(Phase::Failed))), &kept);
        assert_eq!(done.steps, vec![ReleaseIdentity]);
        let released = Observed {
            identity: false,
            ..kept.clone()
        };
        let done = plan(Some(&desired(Some(Phase::Failed))), &released);
        assert!(done.steps.is_empty());
        assert_eq!(plan(None, &released).steps, vec![RemoveRuntimeDir]);
    }

    #[test]
    fn settling_unit_waits() {
        let mut obs = running_host(DomainState::Running);
        obs.unit = unit(UnitActivity::Activating, "u1");
        let p = plan(Some(&desired(Some(Phase::Scheduled))), &obs);
        assert!(p.steps.is_empty());
        assert!(p.requeue);
    }

    #[test]
    fn running_vms_are_registered_with_machined_where_it_exists() {
        let d = desired(Some(Phase::Running));
        let unregistered = Observed {
            machine: Some(false),
            ..running_host(DomainState::Running)
        };
        assert_eq!(plan(Some(&d), &unregistered).steps, vec![RegisterMachine]);
        let registered = Observed {
            machine: Some(true),
            ..unregistered.clone()
        };
        assert!(plan(Some(&d), &registered).steps.is_empty());
        // A fresh VM is registered once it runs.
        let fresh = Observed {
            machine: Some(false),
            ..Observed::default()
        };
        assert_eq!(
            plan(Some(&desired(None)), &fresh).steps.last(),
            Some(&RegisterMachine)
        );
        // Deleting forgets the machine before anything stops.
        assert_eq!(plan(None, &registered).steps[0], UnregisterMachine);
        // A host without machined is never asked.
        assert!(!plan(None, &running_host(DomainState::Running))
            .steps
            .contains(&UnregisterMachine));
    }

    /// Chaos (seed 1796389352919579155): an old instance's unit, torn down
    /// while its daemon was killed, was read back without its uid as it
    /// stopped, and the new instance was failed for it.
    #[test]
    fn a_stopped_unit_of_no_known_instance_fails_no_vmi() {
        let d = desired(None);
        let mut stopped = unit(UnitActivity::Inactive, "u1");
        stopped.as_mut().unwrap().uid = None;
        let obs = Observed {
            unit: stopped,
            state_dir: true,
            ..Observed::default()
        };
        let p = plan(Some(&d), &obs);
        assert_eq!(p.outcome, Outcome::Unchanged);
        assert!(p.requeue);
        assert_eq!(p.steps, vec![StopUnit, RemoveStateDir]);
        // Then the new instance is made, as if nothing had been there.
        let p = plan(Some(&d), &Observed::default());
        assert_eq!(p.outcome, Outcome::Phase(Phase::Running));
        // Its own unit stopping is still its failure.
        let own = Observed {
            unit: unit(UnitActivity::Failed, "u1"),
            ..Observed::default()
        };
        assert!(matches!(plan(Some(&d), &own).outcome, Outcome::Failed(_)));
    }

    #[test]
    fn a_vm_to_receive_gets_everything_but_its_domain_and_waits_for_it() {
        let incoming = Desired {
            migrating: Some(Migrating::Incoming),
            ..desired(None)
        };
        let nothing = Observed::default();
        let p = plan(Some(&incoming), &nothing);
        assert_eq!(
            p.steps,
            vec![
                AcquireIdentity,
                CreateDirs,
                PrepareDisks,
                CreateNetns,
                SetupNetwork,
                StartUnit
            ]
        );
        assert_eq!(
            p.outcome,
            Outcome::Unchanged,
            "the source reports, not the target"
        );
        let mut waiting = running_host(DomainState::Running);
        waiting.domain = None;
        let p = plan(Some(&incoming), &waiting);
        assert!(
            p.steps.is_empty(),
            "never defines or starts it: {:?}",
            p.steps
        );
        assert_eq!(p.outcome, Outcome::Unchanged);
        for state in [DomainState::Paused, DomainState::Running] {
            let arrived = plan(Some(&incoming), &running_host(state));
            assert!(arrived.steps.is_empty(), "{state:?}: {:?}", arrived.steps);
            assert_eq!(arrived.outcome, Outcome::Unchanged);
        }
    }

    /// The safety of a migration's end: a domain gone from under a VM that
    /// migrates away is not started here again (the target runs it), and
    /// is no failure.
    #[test]
    fn a_fenced_vm_is_never_started_here_again_and_its_vmi_fails_with_why() {
        let fenced = |phase| Desired {
            fenced: Some("fenced: Lease unrenewed".into()),
            ..desired(phase)
        };
        // Killed by the fence, its daemon started again by systemd: the
        // domain is gone and nothing brings it back, whatever the phase.
        let mut killed = running_host(DomainState::Shutoff);
        killed.domain = None;
        for phase in [None, Some(Phase::Scheduled), Some(Phase::Running)] {
            for obs in [killed.clone(), Observed::default()] {
                let p = plan(Some(&fenced(phase)), &obs);
                assert!(!p.steps.iter().any(Step::creates), "{phase:?}: {p:?}");
                assert_eq!(
                    p.outcome,
                    Outcome::Failed("fenced: Lease unrenewed".into()),
                    "{phase:?}"
                );
            }
        }
        // One still running (the fence could not kill it) is stopped
        // without waiting for its guest.
        let p = plan(
            Some(&fenced(Some(Phase::Running))),
            &running_host(DomainState::Running),
        );
        assert!(
            p.steps.contains(&ShutdownDomain {
                grace: Duration::ZERO
            }),
            "{p:?}"
        );
        // Its VMI failed already: torn down, nothing more said.
        let p = plan(Some(&fenced(Some(Phase::Failed))), &killed);
        assert_eq!(p.outcome, Outcome::Unchanged);
        // Arriving by migration: torn down, the source reports.
        let arriving = Desired {
            migrating: Some(Migrating::Incoming),
            ..fenced(Some(Phase::Running))
        };
        let p = plan(Some(&arriving), &killed);
        assert_eq!(p.outcome, Outcome::Unchanged);
        assert!(!p.steps.iter().any(Step::creates), "{p:?}");
    }

    #[test]
    fn a_vm_migrating_away_is_never_started_here_again() {
        let outgoing = Desired {
            migrating: Some(Migrating::Outgoing),
            ..desired(Some(Phase::Running))
        };
        let runs = plan(Some(&outgoing), &running_host(DomainState::Running));
        assert_eq!(runs.outcome, Outcome::Phase(Phase::Running));
        assert!(!runs
            .steps
            .iter()
            .any(|s| matches!(s, StartDomain | DefineDomain)));
        let mut gone = running_host(DomainState::Running);
        gone.domain = None;
        let p = plan(Some(&outgoing), &gone);
        assert!(
            !p.steps
                .iter()
                .any(|s| matches!(s, StartDomain | DefineDomain)),
            "{:?}",
            p.steps
        );
        assert!(p.steps.contains(&StopUnit), "{:?}", p.steps);
        assert_eq!(p.outcome, Outcome::Unchanged);
        for state in [DomainState::Shutoff, DomainState::Other] {
            let handing = plan(Some(&outgoing), &running_host(state));
            assert!(handing.steps.is_empty(), "{state:?}: {:?}", handing.steps);
            assert_eq!(handing.outcome, Outcome::Unchanged);
        }
        let mut stopped = running_host(DomainState::Running);
        stopped.unit = unit(UnitActivity::Failed, "u1");
        for role in [Migrating::Outgoing, Migrating::Incoming] {
            let d = Desired {
                migrating: Some(role),
                ..desired(Some(Phase::Running))
            };
            let p = plan(Some(&d), &stopped);
            assert_eq!(
                p.outcome,
                Outcome::Unchanged,
                "{role:?}: no failure of its own"
            );
            assert!(p.steps.contains(&StopUnit) || p.steps.contains(&TeardownNetwork));
        }
        // Without the mark, the same observation restarts the domain: the
        // mark is what keeps a migrated VM from running twice.
        let unmarked = plan(Some(&desired(Some(Phase::Running))), &gone);
        assert!(unmarked.steps.contains(&StartDomain));
    }
}
