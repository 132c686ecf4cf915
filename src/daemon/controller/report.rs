//! The VMI's status as a pass leaves it: phase, conditions, interfaces
//! and what the running domain tells, with the Events for each change;
//! written out within the host's write budget.

use super::{now_rfc3339, status_err, Adapters, Controller, ControllerError};
use crate::core::cni;
use crate::core::convert::network::format_mac;
use crate::core::convert::Converted;
use crate::core::key::VmKey;
use crate::core::plan::{DomainObs, Outcome};
use crate::core::status;
use crate::core::vmi::Phase;
use crate::core::vmi::VirtualMachineInstance;
use crate::host::libvirt::{DomainRef, Hypervisor};
use crate::host::network::Network;
use crate::sources::{EventReason, Recorder, StatusStore};
use std::collections::HashSet;
use std::time::Duration;
use tracing::{info, warn};

impl<A: Adapters> Controller<A> {
    /// Applies the outcome to the VMI's status. The new status is the
    /// truth at once (the next plan relies on it); writing it out is retried
    /// until it succeeds, so an outage of the status store loses nothing.
    /// `net`: the VMI's pod network as this pass converted it. A write the
    /// budget does not allow yet waits, and says how long. `uid`: the
    /// instance the pass worked on; when the VMI was replaced meanwhile (a
    /// manifest edited, an object recreated), the outcome is the old
    /// instance's and says nothing of the new one, whose own pass follows.
    /// What a running VM shows besides its phase: its guest agent, why it
    /// is paused, its machine type. `seen`: the domain as observed (none
    /// when this pass started it, `start_paused` if it started so).
    pub(super) async fn live(
        &self,
        dom: &DomainRef,
        seen: Option<&DomainObs>,
        start_paused: bool,
    ) -> status::Live {
        // Asked only once its channel says it is there (the agent's
        // connecting wakes the VM): a resync of a hundred agentless VMs
        // asks none.
        let agent = if seen.is_none_or(|d| d.agent) {
            self.deps
                .hypervisor
                .guest_agent(dom)
                .await
                .unwrap_or_else(|e| {
                    warn!("asking the guest agent: {e}");
                    None
                })
        } else {
            None
        };
        let paused = match seen {
            Some(d) => d.paused.clone(),
            None => start_paused.then(|| "PausedStartStrategy".to_owned()),
        };
        status::Live {
            agent,
            paused,
            machine: seen.and_then(|d| d.machine.clone()),
            volumes: None,
            migratable: None,
        }
    }

    pub(super) async fn report(
        &self,
        key: &VmKey,
        uid: Option<&str>,
        outcome: &Outcome,
        live: &status::Live,
        conv: Option<&Converted>,
    ) -> Result<Option<Duration>, ControllerError> {
        let id = key.id();
        let now = now_rfc3339();
        let interfaces = self.interfaces(&id, outcome, conv);
        let network_status = self.network_status(&id, outcome, conv);
        let changed = {
            let mut vmis = self.vmis();
            let Some(vmi) = vmis.get_mut(&id).filter(|v| v.uid() == uid) else {
                return Ok(None);
            };
            let next =
                match status::next_status(&vmi.status, outcome, &self.settings.node_name, &now) {
                    Ok(Some(mut next)) => {
                        let qos = status::qos_class(vmi.spec.domain.resources.as_ref());
                        next.extra.insert("qosClass".into(), qos.into());
                        Some(next)
                    }
                    Ok(None) => Some(vmi.status.clone()),
                    Err(e) => {
                        warn!("not reporting: {e}");
                        None
                    }
                };
            next.and_then(|mut next| {
                // A pass that saw nothing settled says nothing about these.
                if !matches!(outcome, Outcome::Unchanged | Outcome::Unresponsive(_)) {
                    next.interfaces = interfaces;
                    status::set_live(&mut next, live, &now);
                }
                let old = vmi.status.phase;
                let annotated = network_status
                    .as_ref()
                    .is_some_and(|ns| set_annotation(vmi, cni::NETWORK_STATUS_ANNOTATION, ns));
                (next != vmi.status || annotated).then(|| {
                    vmi.status = next;
                    (old, vmi.status.phase)
                })
            })
        };
        let current = self.vmis().get(&id).filter(|v| v.uid() == uid).cloned();
        if let (Some((old, new)), Some(vmi)) = (changed, &current) {
            self.unsaved().insert(id.clone());
            if let Outcome::Unresponsive(m) = outcome {
                warn!("{m}");
                let r = &self.deps.recorder;
                r.record(vmi, EventReason::DaemonUnresponsive, m, true);
            }
            if old != new {
                info!(phase = ?new, "phase changed");
                let r = &self.deps.recorder;
                match (outcome, new) {
                    (Outcome::Invalid(m), _) => r.record(vmi, EventReason::SyncFailed, m, true),
                    (Outcome::Refused { reason, message }, _) => {
                        let m = format!("{reason}: {message}");
                        r.record(vmi, EventReason::SyncFailed, &m, true)
                    }
                    (_, Some(Phase::Running)) => {
                        r.record(vmi, EventReason::Started, "VM started", false)
                    }
                    (Outcome::Failed(m), _) => r.record(vmi, EventReason::Stopped, m, true),
                    (_, Some(Phase::Succeeded)) => {
                        r.record(vmi, EventReason::Stopped, "the guest powered off", false)
                    }
                    _ => {}
                }
            }
        }
        if !self.unsaved().contains(&id) || self.not_ours(&id) {
            return Ok(None);
        }
        let Some(vmi) = current else {
            return Ok(None);
        };
        let now = tokio::time::Instant::now().into_std();
        let allowed = self
            .write_budget
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(&id, now);
        if let Err(wait) = allowed {
            // Changes until then ride along with the one write.
            self.metrics.status_write_deferred();
            return Ok(Some(wait));
        }
        self.deps.status.save(&vmi).await.map_err(status_err(&id))?;
        self.unsaved().remove(&id);
        Ok(None)
    }

    /// `status.interfaces` while the VM runs: the pod network with the
    /// namespace's `eth0` address (as KubeVirt reports the pod IP), and each
    /// secondary network with the addresses its plugins gave (as KubeVirt
    /// reports them from Multus's network-status).
    pub(super) fn interfaces(
        &self,
        id: &str,
        outcome: &Outcome,
        conv: Option<&Converted>,
    ) -> Vec<serde_json::Value> {
        if *outcome != Outcome::Phase(Phase::Running) {
            return vec![];
        }
        let Some(conv) = conv else {
            return vec![];
        };
        let mut out = Vec::new();
        if let (Some(net), Some(ip)) = (&conv.network, self.deps.network.address(id)) {
            out.push(serde_json::json!({
                "name": net.name,
                "mac": net.mac_string(),
                "ipAddress": ip.to_string(),
                "ipAddresses": self.pod_ips(id, ip),
                "infoSource": "domain",
                "podInterfaceName": crate::host::network::POD_IFACE,
            }));
        }
        let results = self.deps.network.attachments(id);
        for s in &conv.secondary_networks {
            let result = results.iter().find(|(i, _)| *i == s.links.pod_iface);
            let mut iface = serde_json::json!({
                "name": s.name,
                "mac": format_mac(&s.guest_mac(result.map(|(_, r)| r))),
                "infoSource": "domain, multus-status",
                "podInterfaceName": s.links.pod_iface,
            });
            let ips: Vec<String> = results
                .iter()
                .filter(|(ifname, _)| *ifname == s.links.pod_iface)
                .flat_map(|(_, r)| r.ips.iter().filter_map(|i| i.ip()).map(|i| i.to_string()))
                .collect();
            if let Some(first) = ips.first() {
                iface["ipAddress"] = first.clone().into();
                iface["ipAddresses"] = ips.clone().into();
            }
            out.push(iface);
        }
        out
    }

    /// Multus's `k8s.v1.cni.cncf.io/network-status` of a running VM with
    /// secondary networks: the pod network (the default) and each
    /// attachment, from its plugins' result.
    fn network_status(
        &self,
        id: &str,
        outcome: &Outcome,
        conv: Option<&Converted>,
    ) -> Option<String> {
        let conv = conv.filter(|c| !c.secondary_networks.is_empty())?;
        if *outcome != Outcome::Phase(Phase::Running) {
            return None;
        }
        let mut list = Vec::new();
        if let (Some(_), Some(ip)) = (&conv.network, self.deps.network.address(id)) {
            list.push(serde_json::json!({
                "name": cni::POD_NETWORK_NAME,
                "interface": crate::host::network::POD_IFACE,
                "ips": self.pod_ips(id, ip),
                "default": true,
                "dns": {},
            }));
        }
        let results = self.deps.network.attachments(id);
        for s in &conv.secondary_networks {
            if let Some((_, r)) = results.iter().find(|(i, _)| *i == s.links.pod_iface) {
                list.push(cni::network_status(&s.network, r, false));
            }
        }
        serde_json::to_string(&list).ok()
    }

    /// The pod network's addresses, IPv4 first as on a dual-stack pod.
    fn pod_ips(&self, id: &str, ip: std::net::Ipv4Addr) -> Vec<String> {
        let v6 = self.deps.network.address6(id);
        std::iter::once(ip.to_string())
            .chain(v6.map(|a| a.to_string()))
            .collect()
    }

    pub(super) fn unsaved(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.unsaved.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sets an annotation; whether it changed.
fn set_annotation(vmi: &mut VirtualMachineInstance, key: &str, value: &str) -> bool {
    let a = vmi
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    if a.get(key).map(String::as_str) == Some(value) {
        return false;
    }
    a.insert(key.into(), value.into());
    true
}
