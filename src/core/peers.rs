//! The other kvirt hosts of a cluster, as each announces itself on its
//! heartbeat Lease, and the choice of a migration's target among them, as
//! kube-scheduler would place the VMI's pod: the VMI's nodeSelector,
//! affinity and tolerations, plus the migration's `addedNodeSelector`, or
//! the one host kvirt's annotation names. Pure.

use crate::core::migration::{Migration, TARGET_ANNOTATION};
use crate::core::scheduling::{self, HostFacts, Taint};
use crate::core::vmi::VirtualMachineInstance;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The Lease annotation a host announces itself with (JSON).
pub const ANNOUNCEMENT: &str = "kvirt.io/host";

/// What a host tells its peers: what it offers VMIs and where it takes
/// migrations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Announcement {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taints: Vec<Taint>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub scheduler_name: String,
    /// The migration port, `ip:port`; empty: it takes no migrations.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub migration: String,
    /// Cordoned: it takes no VM arriving.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cordoned: bool,
    /// It takes new, unassigned VMIs (`[kubernetes] claim`, and not about
    /// to fence itself): the leader's scheduler places them only on such
    /// hosts ([`crate::core::placement`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub claims: bool,
    /// How many VMIs were assigned to it when it renewed.
    #[serde(default)]
    pub vmis: u32,
}

impl Announcement {
    /// `migration`: the port's `ip:port`, if served.
    pub fn of(facts: &HostFacts, migration: Option<String>, cordoned: bool) -> Self {
        Self {
            labels: facts.labels.clone(),
            taints: facts.taints.clone(),
            scheduler_name: facts.scheduler_name.clone(),
            migration: migration.unwrap_or_default(),
            cordoned,
            claims: false,
            vmis: 0,
        }
    }

    /// The same, telling the scheduler whether it takes new VMIs and how
    /// many it has.
    pub fn taking(self, claims: bool, vmis: usize) -> Self {
        Self {
            claims,
            vmis: u32::try_from(vmis).unwrap_or(u32::MAX),
            ..self
        }
    }
}

/// A live host of the cluster (its Lease current), as it announced itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub node: String,
    pub announced: Announcement,
}

impl Peer {
    pub(crate) fn facts(&self) -> HostFacts {
        HostFacts {
            node_name: self.node.clone(),
            labels: self.announced.labels.clone(),
            taints: self.announced.taints.clone(),
            scheduler_name: self.announced.scheduler_name.clone(),
        }
    }

    /// Why this host cannot take `vmi` now, if it cannot.
    /// Its migration port, unless it cannot take `vmi` now (then why).
    fn refuses(&self, vmi: &VirtualMachineInstance) -> Result<String, String> {
        if self.announced.cordoned {
            return Err("cordoned".into());
        }
        if self.announced.migration.is_empty() {
            return Err("takes no migrations (no migration.listen)".into());
        }
        scheduling::fits(vmi, &self.facts())?;
        Ok(self.announced.migration.clone())
    }
}

/// The host a migration goes to, and its migration port (as announced:
/// the caller parses it): the one the
/// migration's annotation names, else the first (by name) of the live
/// hosts but `here` that fit the VMI with the migration's
/// `addedNodeSelector`. `Err` says why no host will do, host by host.
pub fn choose_target(
    vmi: &VirtualMachineInstance,
    migration: &Migration,
    here: &str,
    peers: &[Peer],
) -> Result<(String, String), String> {
    let mut vmi = vmi.clone();
    for (k, v) in &migration.spec.added_node_selector {
        if vmi.spec.node_selector.get(k).is_some_and(|have| have != v) {
            return Err(format!(
                "addedNodeSelector {k}={v} contradicts the VMI's nodeSelector"
            ));
        }
        vmi.spec.node_selector.insert(k.clone(), v.clone());
    }
    let named = migration
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(TARGET_ANNOTATION))
        .filter(|n| !n.is_empty());
    let mut sorted: Vec<&Peer> = peers.iter().filter(|p| p.node != here).collect();
    sorted.sort_by(|a, b| a.node.cmp(&b.node));
    if let Some(node) = named {
        if node == here {
            return Err(format!("{TARGET_ANNOTATION} names the host it runs on"));
        }
        let peer = sorted
            .iter()
            .find(|p| &p.node == node)
            .ok_or_else(|| format!("{TARGET_ANNOTATION}: no live kvirt host {node}"))?;
        return peer
            .refuses(&vmi)
            .map(|a| (node.clone(), a))
            .map_err(|why| format!("{node}: {why}"));
    }
    let mut why = Vec::new();
    for p in sorted {
        match p.refuses(&vmi) {
            Ok(addr) => return Ok((p.node.clone(), addr)),
            Err(e) => why.push(format!("{}: {e}", p.node)),
        }
    }
    if why.is_empty() {
        return Err("no other live kvirt host".into());
    }
    why.truncate(8);
    Err(format!("no host fits: {}", why.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(selector: &str) -> VirtualMachineInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "uid": "u1"},
            "spec": {"nodeSelector": serde_json::from_str::<serde_json::Value>(selector).unwrap()},
        }))
        .unwrap()
    }

    fn peer(node: &str, zone: &str, migration: &str) -> Peer {
        Peer {
            node: node.into(),
            announced: Announcement {
                labels: [("zone".to_string(), zone.to_string())].into(),
                migration: migration.into(),
                ..Default::default()
            },
        }
    }

    fn migration(added: &[(&str, &str)], target: Option<&str>) -> Migration {
        let mut m = Migration::default();
        m.spec.added_node_selector = added
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if let Some(t) = target {
            m.metadata.annotations = Some([(TARGET_ANNOTATION.to_string(), t.to_string())].into());
        }
        m
    }

    #[test]
    fn the_first_fitting_host_but_this_one_is_chosen() {
        let peers = [
            peer("c", "z1", "10.0.0.3:8444"),
            peer("a", "z1", "10.0.0.1:8444"),
            peer("b", "z2", "10.0.0.2:8444"),
        ];
        let m = migration(&[], None);
        let (node, addr) = choose_target(&vmi(r#"{"zone":"z1"}"#), &m, "a", &peers).unwrap();
        assert_eq!(
            (node.as_str(), addr.to_string().as_str()),
            ("c", "10.0.0.3:8444")
        );
        // addedNodeSelector narrows it further.
        let m = migration(&[("zone", "z2")], None);
        let (node, _) = choose_target(&vmi("{}"), &m, "a", &peers).unwrap();
        assert_eq!(node, "b");
    }

    #[test]
    fn no_host_fitting_says_why_host_by_host() {
        let mut cordoned = peer("b", "z1", "10.0.0.2:8444");
        cordoned.announced.cordoned = true;
        let peers = [
            peer("a", "z1", "10.0.0.1:8444"),
            cordoned,
            peer("c", "z1", ""),
        ];
        let e = choose_target(&vmi("{}"), &migration(&[], None), "a", &peers).unwrap_err();
        assert!(e.contains("b: cordoned"), "{e}");
        assert!(e.contains("c: takes no migrations"), "{e}");
        let e = choose_target(&vmi("{}"), &migration(&[], None), "a", &peers[..1]).unwrap_err();
        assert_eq!(e, "no other live kvirt host");
        let e = choose_target(
            &vmi(r#"{"zone":"z1"}"#),
            &migration(&[("zone", "z2")], None),
            "a",
            &peers,
        )
        .unwrap_err();
        assert!(e.contains("contradicts"), "{e}");
    }

    #[test]
    fn the_annotation_names_the_one_host_that_may_take_it() {
        let peers = [
            peer("a", "z1", "10.0.0.1:8444"),
            peer("b", "z1", "10.0.0.2:8444"),
            peer("c", "z2", "10.0.0.3:8444"),
        ];
        let (node, _) = choose_target(&vmi("{}"), &migration(&[], Some("c")), "a", &peers).unwrap();
        assert_eq!(node, "c");
        // Named, but the VMI's selector rules it out: refused, not moved elsewhere.
        let e = choose_target(
            &vmi(r#"{"zone":"z1"}"#),
            &migration(&[], Some("c")),
            "a",
            &peers,
        )
        .unwrap_err();
        assert!(e.starts_with("c: nodeSelector"), "{e}");
        for (named, says) in [("a", "the host it runs on"), ("x", "no live kvirt host x")] {
            let e =
                choose_target(&vmi("{}"), &migration(&[], Some(named)), "a", &peers).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn an_announcement_reads_back_as_written() {
        let facts = HostFacts {
            node_name: "a".into(),
            labels: [("zone".to_string(), "z1".to_string())].into(),
            taints: vec![],
            scheduler_name: "kvirt".into(),
        };
        let a = Announcement::of(&facts, Some("10.0.0.1:8444".into()), true);
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(serde_json::from_str::<Announcement>(&json).unwrap(), a);
        // An unknown field (a newer kvirtd's) is ignored, not refused.
        let newer: Announcement =
            serde_json::from_str(r#"{"labels":{},"migration":"10.0.0.2:8444","later":1}"#).unwrap();
        assert_eq!(newer.migration, "10.0.0.2:8444");
    }
}
