//! The VMI status kvirtd owns, computed from a plan's outcome: phase,
//! nodeName, transition timestamps and the `Ready`/`Synchronized` conditions.
//! Pure; writing it somewhere is the source's job.

use crate::core::phase;
use crate::core::plan::{GuestAgent, Outcome};
use crate::core::vmi::{
    Condition, Phase, PhaseTransitionTimestamp, ResourceRequirements, VmiStatus,
};

pub const READY: &str = "Ready";
pub const SYNCHRONIZED: &str = "Synchronized";

/// Applies an outcome to the previous status. Returns the new status, or
/// `None` when nothing changes (so nothing is written and no timestamp moves).
pub fn next_status(
    prev: &VmiStatus,
    outcome: &Outcome,
    node_name: &str,
    now: &str,
) -> Result<Option<VmiStatus>, phase::TransitionError> {
    let (phase, failure) = match outcome {
        Outcome::Unchanged => return Ok(None),
        Outcome::Unresponsive(message) => {
            let mut next = prev.clone();
            set_condition(
                &mut next.conditions,
                READY,
                false,
                Some("DaemonUnresponsive"),
                Some(message),
                now,
            );
            return Ok((next != *prev).then_some(next));
        }
        Outcome::Phase(p) => (*p, None),
        Outcome::Failed(reason) => (Phase::Failed, Some(("Failed", reason.as_str(), false))),
        Outcome::Invalid(reason) => (Phase::Failed, Some(("SyncFailed", reason.as_str(), true))),
        Outcome::Refused { reason, message } => {
            (Phase::Failed, Some((*reason, message.as_str(), true)))
        }
    };
    phase::check(prev.phase, phase)?;

    let mut next = prev.clone();
    if next.phase != Some(phase) {
        next.phase = Some(phase);
        next.phase_transition_timestamps
            .push(PhaseTransitionTimestamp {
                phase,
                phase_transition_timestamp: Some(now.to_owned()),
                extra: Default::default(),
            });
    }
    next.node_name = Some(node_name.to_owned());

    let ready = phase == Phase::Running;
    set_condition(
        &mut next.conditions,
        READY,
        ready,
        if ready {
            None
        } else {
            failure.map(|f| f.0).or(Some("NotRunning"))
        },
        if ready { None } else { failure.map(|f| f.1) },
        now,
    );
    match failure {
        Some((reason, message, true)) => set_condition(
            &mut next.conditions,
            SYNCHRONIZED,
            false,
            Some(reason),
            Some(message),
            now,
        ),
        // KubeVirt drops Synchronized once things are in sync again.
        _ => next.conditions.retain(|c| c.type_ != SYNCHRONIZED),
    }
    if let Some((_, message, _)) = failure {
        next.reason = Some(message.to_owned());
    }

    Ok((next != *prev).then_some(next))
}

/// KubeVirt's `AgentConnected` condition and `guestOSInfo`: present while
/// a guest agent is connected, gone when it is not.
fn set_guest_agent(status: &mut VmiStatus, agent: Option<&GuestAgent>, now: &str) {
    match agent {
        Some(a) => {
            set_condition(
                &mut status.conditions,
                AGENT_CONNECTED,
                true,
                None,
                None,
                now,
            );
            let info = a
                .os_info
                .iter()
                .take(GUEST_OS_INFO_KEYS)
                .map(|(k, v)| (guest_text(k), serde_json::Value::String(guest_text(v))))
                .collect();
            status
                .extra
                .insert(GUEST_OS_INFO.into(), serde_json::Value::Object(info));
        }
        None => {
            status.conditions.retain(|c| c.type_ != AGENT_CONNECTED);
            status.extra.remove(GUEST_OS_INFO);
        }
    }
}

/// What only a running domain can tell, for its VMI's status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Live {
    pub agent: Option<GuestAgent>,
    /// Why the domain is paused, when it is.
    pub paused: Option<String>,
    /// The machine type QEMU runs.
    pub machine: Option<String>,
    /// `status.volumeStatus`, set by the pass that starts the VM (the
    /// claims' facts are read then); `None` leaves it as it is.
    pub volumes: Option<Vec<serde_json::Value>>,
    /// The `LiveMigratable` condition, set by the same pass (it depends on
    /// the claims read then); `None` leaves it as it is.
    pub migratable: Option<crate::core::migration::Migratable>,
}

/// A running VMI's live facts: the guest agent's condition and OS, the
/// `Paused` condition (a paused VM is Running but not Ready, as in
/// KubeVirt, whether paused on request or by itself on an I/O error) and
/// `machine.type`.
pub fn set_live(status: &mut VmiStatus, live: &Live, now: &str) {
    set_guest_agent(status, live.agent.as_ref(), now);
    if let Some(v) = &live.volumes {
        status.extra.insert("volumeStatus".into(), v.clone().into());
    }
    if let Some(m) = &live.migratable {
        let c = crate::core::migration::condition(m);
        set_condition(
            &mut status.conditions,
            &c.type_,
            c.status == "True",
            c.reason.as_deref(),
            c.message.as_deref(),
            now,
        );
    }
    match &live.paused {
        Some(reason) => {
            set_condition(
                &mut status.conditions,
                PAUSED,
                true,
                Some(reason),
                Some("the VM's vCPUs are paused"),
                now,
            );
            if status.phase == Some(Phase::Running) {
                set_condition(
                    &mut status.conditions,
                    READY,
                    false,
                    Some("Paused"),
                    Some("the VM is paused"),
                    now,
                );
            }
        }
        None => {
            status.conditions.retain(|c| c.type_ != PAUSED);
            if status.phase == Some(Phase::Running) {
                set_condition(&mut status.conditions, READY, true, None, None, now);
            }
        }
    }
    if let Some(m) = &live.machine {
        status
            .extra
            .insert("machine".into(), serde_json::json!({ "type": m }));
    }
}

/// The most of a guest-given string the status carries: KubeVirt's
/// `guestOSInfo` values are names and versions.
pub const GUEST_TEXT_MAX: usize = 256;
const GUEST_OS_INFO_KEYS: usize = 16;

/// A string the guest (its agent) sent, as the status may carry it: no
/// control characters, at most [`GUEST_TEXT_MAX`] characters. Whatever a
/// hostile guest answers, its VMI's status stays small.
pub fn guest_text(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_control())
        .take(GUEST_TEXT_MAX)
        .collect()
}

pub const PAUSED: &str = "Paused";
pub const AGENT_CONNECTED: &str = "AgentConnected";
const GUEST_OS_INFO: &str = "guestOSInfo";

/// A VM that is not running yet says why in its Ready condition (a
/// containerDisk being pulled, or failing to be); the phase stays.
pub fn waiting(prev: &VmiStatus, reason: &str, message: &str, now: &str) -> Option<VmiStatus> {
    waiting_as(prev, reason, message, false, now)
}

/// [`waiting`] for what only someone else can fix (an administrator, the
/// VMI's author): `Synchronized=False` too, with the same reason.
pub fn waiting_as(
    prev: &VmiStatus,
    reason: &str,
    message: &str,
    unsynchronized: bool,
    now: &str,
) -> Option<VmiStatus> {
    if prev.phase == Some(Phase::Running) {
        return None;
    }
    let mut next = prev.clone();
    set_condition(
        &mut next.conditions,
        READY,
        false,
        Some(reason),
        Some(message),
        now,
    );
    if unsynchronized {
        set_condition(
            &mut next.conditions,
            SYNCHRONIZED,
            false,
            Some(reason),
            Some(message),
            now,
        );
    }
    (next != *prev).then_some(next)
}

/// Kubernetes' QoS class for the VM's resources, as KubeVirt reports the
/// pod's: Guaranteed when CPU and memory limits are set and requests (where
/// given) equal them, BestEffort with no resources at all, else Burstable.
pub fn qos_class(resources: Option<&ResourceRequirements>) -> &'static str {
    let Some(r) = resources.filter(|r| !r.requests.is_empty() || !r.limits.is_empty()) else {
        return "BestEffort";
    };
    let guaranteed = ["cpu", "memory"].iter().all(|k| {
        r.limits
            .get(*k)
            .is_some_and(|l| r.requests.get(*k).is_none_or(|q| q.as_str() == l.as_str()))
    });
    if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

/// Sets one condition, moving its transition time only when its status flips.
fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    ok: bool,
    reason: Option<&str>,
    message: Option<&str>,
    now: &str,
) {
    let status = if ok { "True" } else { "False" };
    let existing = conditions.iter_mut().find(|c| c.type_ == type_);
    let transition = match &existing {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Some(now.to_owned()),
    };
    let cond = Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.map(str::to_owned),
        message: message.map(str::to_owned),
        last_probe_time: None,
        last_transition_time: transition,
        ..Default::default()
    };
    match existing {
        Some(c) => *c = cond,
        None => conditions.push(cond),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond<'a>(s: &'a VmiStatus, t: &str) -> Option<&'a Condition> {
        s.conditions.iter().find(|c| c.type_ == t)
    }

    #[test]
    fn whatever_a_guest_agent_answers_the_status_stays_small() {
        let huge = format!("{}\u{1b}[31m\n{}", "a".repeat(1 << 20), "b");
        let agent = GuestAgent {
            os_info: (0..100)
                .map(|i| (format!("key{i:03}\n"), huge.clone()))
                .collect(),
        };
        let mut st = VmiStatus {
            phase: Some(Phase::Running),
            ..Default::default()
        };
        set_live(
            &mut st,
            &Live {
                agent: Some(agent),
                ..Default::default()
            },
            "t",
        );
        let info = st.extra[GUEST_OS_INFO].as_object().unwrap();
        assert_eq!(info.len(), GUEST_OS_INFO_KEYS);
        for (k, v) in info {
            let v = v.as_str().unwrap();
            assert!(
                !k.contains('\n') && v.chars().count() <= GUEST_TEXT_MAX,
                "{k}"
            );
            assert!(!v.chars().any(char::is_control), "{v:?}");
        }
        assert!(serde_json::to_vec(&st).unwrap().len() < 16 * 1024);
    }

    #[test]
    fn running_is_ready_with_one_timestamp() {
        let s0 = VmiStatus::default();
        let s1 = next_status(&s0, &Outcome::Phase(Phase::Scheduled), "n1", "t1")
            .unwrap()
            .unwrap();
        let s2 = next_status(&s1, &Outcome::Phase(Phase::Running), "n1", "t2")
            .unwrap()
            .unwrap();
        assert_eq!(s2.phase, Some(Phase::Running));
        assert_eq!(s2.node_name.as_deref(), Some("n1"));
        assert_eq!(cond(&s2, READY).unwrap().status, "True");
        assert_eq!(s2.phase_transition_timestamps.len(), 2);
        // Level-triggered re-runs change nothing: no write, no flapping.
        assert_eq!(
            next_status(&s2, &Outcome::Phase(Phase::Running), "n1", "t3").unwrap(),
            None
        );
    }

    #[test]
    fn an_unanswering_daemon_makes_a_running_vm_not_ready_until_it_answers() {
        let running = next_status(
            &VmiStatus::default(),
            &Outcome::Phase(Phase::Running),
            "n1",
            "t1",
        )
        .unwrap()
        .unwrap();
        let stuck = Outcome::Unresponsive("no answer".into());
        let s = next_status(&running, &stuck, "n1", "t2").unwrap().unwrap();
        assert_eq!(s.phase, Some(Phase::Running));
        assert_eq!(
            s.phase_transition_timestamps,
            running.phase_transition_timestamps
        );
        let ready = cond(&s, READY).unwrap();
        assert_eq!(ready.status, "False");
        assert_eq!(ready.reason.as_deref(), Some("DaemonUnresponsive"));
        // Said once, not at every pass.
        assert_eq!(next_status(&s, &stuck, "n1", "t3").unwrap(), None);
        let back = next_status(&s, &Outcome::Phase(Phase::Running), "n1", "t4")
            .unwrap()
            .unwrap();
        assert_eq!(cond(&back, READY).unwrap().status, "True");
    }

    #[test]
    fn invalid_vmi_is_failed_and_not_synchronized() {
        let s = next_status(
            &VmiStatus::default(),
            &Outcome::Invalid("spec.domain.devices.disks[0].lun: not supported".into()),
            "n1",
            "t1",
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.phase, Some(Phase::Failed));
        let c = cond(&s, SYNCHRONIZED).unwrap();
        assert_eq!(c.status, "False");
        assert!(c.message.as_deref().unwrap().contains("disks[0].lun"));
        assert_eq!(cond(&s, READY).unwrap().status, "False");
    }

    #[test]
    fn qos_classes() {
        let r = |y: &str| serde_norway::from_str::<ResourceRequirements>(y).unwrap();
        assert_eq!(qos_class(None), "BestEffort");
        assert_eq!(qos_class(Some(&r("requests: {memory: 64Mi}"))), "Burstable");
        assert_eq!(
            qos_class(Some(&r("limits: {memory: 64Mi, cpu: '1'}"))),
            "Guaranteed"
        );
        assert_eq!(
            qos_class(Some(&r(
                "limits: {memory: 64Mi, cpu: '1'}\nrequests: {cpu: 500m}"
            ))),
            "Burstable"
        );
    }

    #[test]
    fn final_phases_do_not_move() {
        let done = VmiStatus {
            phase: Some(Phase::Succeeded),
            ..Default::default()
        };
        assert!(next_status(&done, &Outcome::Phase(Phase::Running), "n1", "t").is_err());
    }

    #[test]
    fn failure_keeps_reason() {
        let running = next_status(
            &VmiStatus::default(),
            &Outcome::Phase(Phase::Running),
            "n",
            "t",
        )
        .unwrap()
        .unwrap();
        let failed = next_status(
            &running,
            &Outcome::Failed("the guest crashed".into()),
            "n",
            "t2",
        )
        .unwrap()
        .unwrap();
        assert_eq!(failed.phase, Some(Phase::Failed));
        assert_eq!(failed.reason.as_deref(), Some("the guest crashed"));
        assert_eq!(
            cond(&failed, READY).unwrap().message.as_deref(),
            Some("the guest crashed")
        );
        assert!(cond(&failed, SYNCHRONIZED).is_none());
    }
}
