//! What draining a host does with each VMI on it, by the VMI's
//! `spec.evictionStrategy` (else the host's default), as KubeVirt evicts a
//! node's VMIs: `LiveMigrate` moves it or blocks the drain,
//! `LiveMigrateIfPossible` moves it or stops it, `None` stops it,
//! `External` leaves it to whoever handles its eviction.

use crate::core::key::VmKey;
use crate::core::vmi::VirtualMachineInstance;
use serde::{Deserialize, Serialize};

/// KubeVirt's `evictionStrategy` values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    #[default]
    None,
    LiveMigrate,
    LiveMigrateIfPossible,
    External,
}

impl Strategy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "None" => Ok(Self::None),
            "LiveMigrate" => Ok(Self::LiveMigrate),
            "LiveMigrateIfPossible" => Ok(Self::LiveMigrateIfPossible),
            "External" => Ok(Self::External),
            other => Err(format!(
                "evictionStrategy {other:?}: expected None, LiveMigrate, \
                 LiveMigrateIfPossible or External"
            )),
        }
    }

    /// The VMI's own, else `default`; a value kvirt does not know is an
    /// error (never read as another).
    pub fn of(vmi: &VirtualMachineInstance, default: Strategy) -> Result<Self, String> {
        match vmi.spec.extra.get("evictionStrategy") {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(serde_json::Value::String(s)) => Self::parse(s),
            Some(other) => Err(format!("evictionStrategy {other}: not a string")),
        }
    }
}

/// What a drain does with one VMI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Migrate,
    /// Stop its VirtualMachine (started again with `kvirtctl start`).
    StopVm(VmKey),
    /// Left running, and why: the host is not empty while it is.
    Stays(String),
}

/// One VMI as the drain sees it. `may_leave`: whether it may migrate now
/// (`Err`: why not); `vm`: the VirtualMachine that owns it, if one does;
/// `cluster`: whether its host's VMIs are the API server's (a
/// VirtualMachine's VMI then moves, its VirtualMachine finding it by name
/// wherever it runs) rather than the host's manifests.
pub struct Candidate<'a> {
    pub strategy: Result<Strategy, String>,
    pub may_leave: Result<(), String>,
    pub vm: Option<&'a VmKey>,
    pub cluster: bool,
}

pub fn decide(c: &Candidate) -> Action {
    let strategy = match &c.strategy {
        Ok(s) => *s,
        Err(e) => return Action::Stays(e.clone()),
    };
    // A standalone VirtualMachine's VMI does not migrate yet: its
    // VirtualMachine's manifest would have to move with it.
    let movable = match (c.vm, &c.may_leave) {
        (Some(_), _) if !c.cluster => {
            Err("a standalone VirtualMachine's VMI does not migrate yet".to_owned())
        }
        (_, r) => r.clone(),
    };
    let removed_by = match c.cluster {
        true => "deleting it (kubectl delete vmi)",
        false => "removing its manifest",
    };
    let stop = |why: &str| match c.vm {
        Some(vm) => Action::StopVm(vm.clone()),
        None => Action::Stays(format!(
            "{why}, and a VMI of its own is stopped only by {removed_by}"
        )),
    };
    match (strategy, movable) {
        (Strategy::LiveMigrate | Strategy::LiveMigrateIfPossible, Ok(())) => Action::Migrate,
        (Strategy::LiveMigrate, Err(why)) => Action::Stays(format!(
            "evictionStrategy LiveMigrate, but it cannot migrate: {why}"
        )),
        (Strategy::LiveMigrateIfPossible, Err(why)) => stop(&format!("it cannot migrate ({why})")),
        (Strategy::None, _) => stop("evictionStrategy None"),
        (Strategy::External, _) => {
            Action::Stays("evictionStrategy External: left to whoever handles its eviction".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(extra: &str) -> VirtualMachineInstance {
        let text = format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a, namespace: ns}}\nspec: {{domain: {{devices: {{}}}}{extra}}}\n"
        );
        serde_norway::from_str(&text).unwrap()
    }

    #[test]
    fn the_strategy_is_the_vmis_else_the_hosts_and_unknown_ones_are_errors() {
        let d = Strategy::LiveMigrateIfPossible;
        assert_eq!(Strategy::of(&vmi(""), d), Ok(d));
        let own = vmi(", evictionStrategy: LiveMigrate");
        assert_eq!(Strategy::of(&own, d), Ok(Strategy::LiveMigrate));
        let bad = vmi(", evictionStrategy: Migrate");
        assert!(Strategy::of(&bad, d).unwrap_err().contains("\"Migrate\""));
        assert!(Strategy::of(&vmi(", evictionStrategy: 3"), d).is_err());
    }

    #[test]
    fn each_strategy_moves_stops_or_keeps_as_kubevirt_evicts() {
        let vm = VmKey::new("ns", "vm").unwrap();
        let no = || Err::<(), _>("it is paused".to_owned());
        let c = |s, may_leave, vm| Candidate {
            strategy: Ok(s),
            may_leave,
            vm,
            cluster: false,
        };
        use Strategy::{External, LiveMigrate, LiveMigrateIfPossible};
        assert_eq!(
            decide(&c(LiveMigrate, Ok(()), Option::None)),
            Action::Migrate
        );
        assert_eq!(
            decide(&c(LiveMigrateIfPossible, Ok(()), Option::None)),
            Action::Migrate
        );
        let Action::Stays(why) = decide(&c(LiveMigrate, no(), Option::None)) else {
            panic!()
        };
        assert!(why.contains("cannot migrate: it is paused"), "{why}");
        assert_eq!(
            decide(&c(LiveMigrateIfPossible, no(), Some(&vm))),
            Action::StopVm(vm.clone())
        );
        assert_eq!(
            decide(&c(Strategy::None, Ok(()), Some(&vm))),
            Action::StopVm(vm.clone())
        );
        assert!(
            matches!(decide(&c(Strategy::None, Ok(()), Option::None)), Action::Stays(w) if w.contains("removing its manifest"))
        );
        assert!(matches!(
            decide(&c(External, Ok(()), Option::None)),
            Action::Stays(_)
        ));
        // A VirtualMachine's VMI: stopped, or kept if it must migrate.
        assert_eq!(
            decide(&c(LiveMigrateIfPossible, Ok(()), Some(&vm))),
            Action::StopVm(vm.clone())
        );
        assert!(
            matches!(decide(&c(LiveMigrate, Ok(()), Some(&vm))), Action::Stays(w) if w.contains("VirtualMachine"))
        );
        let bad = Candidate {
            strategy: Err("evictionStrategy \"x\"".into()),
            may_leave: Ok(()),
            vm: Option::None,
            cluster: false,
        };
        assert!(matches!(decide(&bad), Action::Stays(_)));
    }

    #[test]
    fn in_a_cluster_a_virtual_machines_vmi_migrates_and_a_vmi_of_its_own_is_deleted_by_its_owner() {
        let vm = VmKey::new("ns", "vm").unwrap();
        let c = |s, vm| Candidate {
            strategy: Ok(s),
            may_leave: Ok(()),
            vm,
            cluster: true,
        };
        assert_eq!(
            decide(&c(Strategy::LiveMigrate, Some(&vm))),
            Action::Migrate
        );
        assert_eq!(
            decide(&c(Strategy::None, Some(&vm))),
            Action::StopVm(vm.clone())
        );
        let Action::Stays(why) = decide(&c(Strategy::None, Option::None)) else {
            panic!()
        };
        assert!(why.contains("kubectl delete vmi"), "{why}");
    }
}
