//! Where a new, unassigned VMI goes: the leading kvirtd's choice among the
//! live hosts, as kube-scheduler places a pod. Of the hosts that take new
//! VMIs, are not cordoned and fit the VMI ([`scheduling::fits`]:
//! nodeSelector, required node affinity, taints, schedulerName), the one
//! with the fewest VMIs; equal hosts are ranked by a hash of the VMI's uid
//! and the host's name, so they share a burst rather than one taking it
//! all. One chooser instead of every host racing to claim each VMI: at
//! 100 hosts the race cost 99 refused writes per VMI. Pure.

use crate::core::peers::Peer;
use crate::core::scheduling;
use crate::core::vmi::VirtualMachineInstance;
use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};

/// Why `peer` cannot take `vmi` now, if it cannot.
fn declines(peer: &Peer, vmi: &VirtualMachineInstance) -> Result<(), String> {
    if !peer.announced.claims {
        return Err("takes no new VMIs ([kubernetes] claim = false, or fencing itself)".into());
    }
    if peer.announced.cordoned {
        return Err("cordoned".into());
    }
    scheduling::fits(vmi, &peer.facts())
}

/// A fixed hash (SipHash with zero keys): the same on every run, so a
/// VMI's ranking of equal hosts does not depend on who computes it.
fn rank(uid: &str, node: &str) -> u64 {
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    (uid, node).hash(&mut h);
    h.finish()
}

/// The host `vmi` goes to. `pending`: VMIs placed on a host since its
/// announcement (its count does not know them yet). `Err` says why no
/// host will do, host by host (the first eight).
pub fn place(
    vmi: &VirtualMachineInstance,
    peers: &[Peer],
    pending: &BTreeMap<String, u32>,
) -> Result<String, String> {
    let uid = vmi.metadata.uid.as_deref().unwrap_or_default();
    let mut why = Vec::new();
    let mut best: Option<(u64, u64, &str)> = None;
    for p in peers {
        if let Err(e) = declines(p, vmi) {
            why.push(format!("{}: {e}", p.node));
            continue;
        }
        let load = u64::from(p.announced.vmis) + u64::from(*pending.get(&p.node).unwrap_or(&0));
        let key = (load, rank(uid, &p.node), p.node.as_str());
        if best.is_none_or(|b| key < b) {
            best = Some(key);
        }
    }
    if let Some((_, _, node)) = best {
        return Ok(node.to_owned());
    }
    if why.is_empty() {
        return Err("no live kvirt host".into());
    }
    why.sort();
    let more = why.len().saturating_sub(8);
    why.truncate(8);
    let more = if more > 0 {
        format!(" (and {more} more)")
    } else {
        String::new()
    };
    Err(format!("no host fits: {}{more}", why.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::peers::Announcement;

    fn vmi(uid: &str, selector: &str) -> VirtualMachineInstance {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "uid": uid},
            "spec": {"nodeSelector": serde_json::from_str::<serde_json::Value>(selector).unwrap()},
        }))
        .unwrap()
    }

    fn host(node: &str, zone: &str, vmis: u32) -> Peer {
        Peer {
            node: node.into(),
            announced: Announcement {
                labels: [("zone".to_string(), zone.to_string())].into(),
                ..Default::default()
            }
            .taking(true, vmis as usize),
        }
    }

    #[test]
    fn the_least_loaded_fitting_host_is_chosen() {
        let peers = [host("a", "z1", 5), host("b", "z1", 2), host("c", "z2", 0)];
        let none = BTreeMap::new();
        assert_eq!(place(&vmi("u1", "{}"), &peers, &none).unwrap(), "c");
        assert_eq!(
            place(&vmi("u1", r#"{"zone":"z1"}"#), &peers, &none).unwrap(),
            "b"
        );
        // What the leader placed since b's announcement counts too.
        let pending = [("b".to_string(), 4)].into();
        assert_eq!(
            place(&vmi("u1", r#"{"zone":"z1"}"#), &peers, &pending).unwrap(),
            "a"
        );
    }

    #[test]
    fn equal_hosts_share_a_burst() {
        let peers: Vec<Peer> = (0..4).map(|i| host(&format!("h{i}"), "z", 0)).collect();
        let mut chosen = std::collections::BTreeSet::new();
        for i in 0..40 {
            chosen
                .insert(place(&vmi(&format!("uid-{i}"), "{}"), &peers, &BTreeMap::new()).unwrap());
        }
        assert_eq!(chosen.len(), 4, "{chosen:?}");
        // The same VMI, the same host, whoever asks.
        let v = vmi("uid-7", "{}");
        assert_eq!(
            place(&v, &peers, &BTreeMap::new()),
            place(&v, &peers, &BTreeMap::new())
        );
    }

    #[test]
    fn hosts_that_take_no_new_vmis_or_do_not_fit_say_why() {
        let mut cordoned = host("b", "z1", 0);
        cordoned.announced.cordoned = true;
        let mut not_taking = host("c", "z1", 0);
        not_taking.announced.claims = false;
        let peers = [host("a", "z2", 0), cordoned, not_taking];
        let e = place(&vmi("u", r#"{"zone":"z1"}"#), &peers, &BTreeMap::new()).unwrap_err();
        assert!(e.contains("a: nodeSelector zone=z1"), "{e}");
        assert!(e.contains("b: cordoned"), "{e}");
        assert!(e.contains("c: takes no new VMIs"), "{e}");
        assert_eq!(
            place(&vmi("u", "{}"), &[], &BTreeMap::new()).unwrap_err(),
            "no live kvirt host"
        );
    }
}
