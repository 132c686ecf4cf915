//! The claims a VMI's volumes name, in a cluster: read and checked before
//! its VM is converted for a start, held while it runs, let go once it is
//! gone. Standalone, the claims are the host's configuration, known to
//! every conversion.

use super::{Adapters, Controller, ControllerError};
use crate::core::convert::{Claims, Converted};
use crate::core::cpuset::CpuSet;
use crate::core::key::VmKey;
use crate::core::plan::Outcome;
use crate::core::pvc::{self, Unusable, User};
use crate::core::scheduling::HostFacts;
use crate::core::vmi::VirtualMachineInstance;
use crate::sources::{EventReason, StatusStore};
use std::collections::BTreeMap;

impl<A: Adapters> Controller<A> {
    /// Whether this pass reads the VMI's claims: a cluster VMI that names
    /// some and whose VM does not run yet.
    pub(super) fn reads_claims(&self, vmi: &VirtualMachineInstance, admitted: bool) -> bool {
        self.settings.cluster && !admitted && !pvc::claims_of(&vmi.spec).is_empty()
    }

    /// The VMI converted with its claims, read for this start (and held
    /// once they can be used), or with the outcome that refuses it.
    pub(super) async fn convert_with_claims(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        dedicated_cpus: Option<&CpuSet>,
    ) -> Result<(Result<Converted, String>, Option<Outcome>), ControllerError> {
        let conv = match self.read_claims(vmi, key).await? {
            Ok(claims) => self.convert(vmi, key, false, &claims, dedicated_cpus),
            Err((reason, message)) => {
                let refused = Outcome::Refused {
                    reason,
                    message: message.clone(),
                };
                return Ok((Err(message), Some(refused)));
            }
        };
        match &conv {
            Ok(_) => self.hold_claims(vmi, key).await?,
            Err(why) => {
                let invalid = Outcome::Invalid(why.clone());
                return Ok((conv, Some(invalid)));
            }
        }
        Ok((conv, None))
    }

    /// The claims of a VMI about to start, each Bound to a volume this
    /// host reaches (a `WaitForFirstConsumer` claim is bound for this
    /// node first, all of a VM's together), and its DataVolumes populated.
    /// `Ok(Err)`: the VMI cannot run here, with every reason; `Err`: it
    /// waits (the reason in its Ready condition and an Event).
    pub(super) async fn read_claims(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
    ) -> Result<Result<Claims, (&'static str, String)>, ControllerError> {
        let ns = key.namespace();
        let host = self.host_facts();
        let mut by_name = BTreeMap::new();
        let (mut refused, mut waits, mut unbound) = (Vec::new(), Vec::new(), Vec::new());
        for u in pvc::claims_of(&vmi.spec) {
            if u.data_volume {
                let dv = self.deps.status.data_volume(ns, &u.claim).await;
                let ready = dv.map_err(|e| Unusable::Wait {
                    reason: "DataVolumeNotReady",
                    message: e.to_string(),
                });
                if let Err(e) = ready.and_then(|dv| pvc::data_volume_ready(&u.claim, dv.as_ref())) {
                    sort(e, &mut refused, &mut waits);
                    continue;
                }
            }
            let objects = match self.deps.status.claim(ns, &u.claim).await {
                Ok(o) => o,
                Err(e) => {
                    waits.push(("PVCNotBound", e.to_string()));
                    continue;
                }
            };
            let Some(claim) = &objects.pvc else {
                waits.push(("PVCNotBound", format!("claim {} does not exist", u.claim)));
                continue;
            };
            match pvc::resolve(
                claim,
                objects.pv.as_ref(),
                &host,
                &self.settings.claim_roots,
            ) {
                Ok(p) => {
                    by_name.insert(u.claim.clone(), p);
                }
                Err(Unusable::Wait { .. })
                    if objects.binding_mode.as_deref() == Some("WaitForFirstConsumer")
                        && !has_selected_node(claim) =>
                {
                    unbound.push(u.claim.clone())
                }
                Err(e) => sort(e, &mut refused, &mut waits),
            }
        }
        if let Some((reason, _)) = refused.first() {
            let all: Vec<&str> = refused.iter().map(|(_, m)| m.as_str()).collect();
            return Ok(Err((reason, all.join("; "))));
        }
        if waits.is_empty() && !unbound.is_empty() {
            self.select_this_node(ns, &unbound, &mut waits).await;
        }
        if let Some((reason, _)) = waits.first() {
            let reason = match *reason {
                "DataVolumeNotReady" | "DataVolumeNotFound" => EventReason::DataVolumeNotReady,
                _ => EventReason::PVCNotBound,
            };
            let message: Vec<String> = waits.into_iter().map(|(_, m)| m).collect();
            let message = message.join("; ");
            self.wait_for(vmi, key, reason, &message).await;
            return Err(ControllerError::Claims {
                id: key.id(),
                message,
            });
        }
        Ok(Ok(Claims::known(
            by_name,
            self.settings.claims.filesystem_overhead,
        )))
    }

    /// What kube-scheduler does for a pod's `WaitForFirstConsumer`
    /// claims: this node selected, for all of them together. The VM waits
    /// until they are bound.
    async fn select_this_node(&self, ns: &str, unbound: &[String], waits: &mut Reasons) {
        let node = &self.settings.node_name;
        for c in unbound {
            if let Err(e) = self.deps.status.select_node(ns, c, node).await {
                waits.push(("PVCNotBound", e.to_string()));
            }
        }
        waits.push((
            "PVCNotBound",
            format!(
                "claims {} wait to be bound for node {node} (WaitForFirstConsumer)",
                unbound.join(", ")
            ),
        ));
    }

    /// Before anything is made on the host: this VMI recorded on each of
    /// its claims, with kvirt's finalizer, so a claim in use is neither
    /// deleted nor used from another node (ReadWriteOnce).
    pub(super) async fn hold_claims(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
    ) -> Result<(), ControllerError> {
        let user = self.user_of(vmi, key);
        for u in pvc::claims_of(&vmi.spec) {
            let held = self
                .deps
                .status
                .hold_claim(key.namespace(), &u.claim, &user)
                .await;
            let (reason, message) = match held {
                Ok(Ok(())) => continue,
                Ok(Err(why)) => (EventReason::PVCInUse, why),
                Err(e) => (EventReason::PVCNotBound, e.to_string()),
            };
            self.wait_for(vmi, key, reason, &message).await;
            return Err(ControllerError::Claims {
                id: key.id(),
                message,
            });
        }
        Ok(())
    }

    /// Once the VM is gone from the host: its record on each claim goes,
    /// and kvirt's finalizer with the last one. An error keeps the VMI
    /// (its own finalizer), so the next pass, or the next kvirtd, retries.
    pub(super) async fn release_claims(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> Result<(), ControllerError> {
        let (Some(uid), Ok(key)) = (vmi.uid(), vmi.key()) else {
            return Ok(());
        };
        for u in pvc::claims_of(&vmi.spec) {
            self.deps
                .status
                .release_claim(key.namespace(), &u.claim, uid)
                .await
                .map_err(|e| ControllerError::Claims {
                    id: key.id(),
                    message: e.to_string(),
                })?;
        }
        Ok(())
    }

    fn user_of(&self, vmi: &VirtualMachineInstance, key: &VmKey) -> User {
        User {
            node: self.settings.node_name.clone(),
            vmi: format!("{}/{}", key.namespace(), key.name()),
            uid: vmi.uid().unwrap_or_default().to_owned(),
        }
    }

    fn host_facts(&self) -> HostFacts {
        self.settings
            .placement
            .clone()
            .unwrap_or_else(|| HostFacts {
                node_name: self.settings.node_name.clone(),
                ..Default::default()
            })
    }
}

fn has_selected_node(claim: &k8s_openapi::api::core::v1::PersistentVolumeClaim) -> bool {
    (claim.metadata.annotations.as_ref()).is_some_and(|a| a.contains_key(pvc::SELECTED_NODE))
}

type Reasons = Vec<(&'static str, String)>;

fn sort(e: Unusable, refused: &mut Reasons, waits: &mut Reasons) {
    match e {
        Unusable::Refuse { reason, message } => refused.push((reason, message)),
        Unusable::Wait { reason, message } => waits.push((reason, message)),
    }
}
