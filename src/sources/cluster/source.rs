//! VMIs from the API: the ones labelled for this node, and (optionally)
//! unassigned ones this host claims.

use super::{api_err, ClusterError, NODE_LABEL};
use crate::core::key::VmKey;
use crate::core::scheduling::{self, HostFacts};
use crate::core::trigger::Trigger;
use crate::core::vmi::{Phase, VirtualMachineInstance};
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::json;
use std::collections::BTreeMap;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

/// Every VMI of the store, by key (objects without a valid key are skipped).
pub fn snapshot(store: &Store<VirtualMachineInstance>) -> BTreeMap<VmKey, VirtualMachineInstance> {
    store
        .state()
        .into_iter()
        .filter_map(|v| Some((v.key().ok()?, (*v).clone())))
        .collect()
}

/// Watches this node's VMIs into a store. Returns the store once the first
/// list has arrived; from then on every change sends the whole set (the
/// controller diffs it). During an API outage the store keeps the last
/// state and the watch retries with backoff: nothing is torn down.
pub async fn watch_node(
    client: kube::Client,
    node: &str,
    tx: UnboundedSender<Trigger>,
) -> Store<VirtualMachineInstance> {
    let api: Api<VirtualMachineInstance> = Api::all(client);
    let cfg = watcher::Config::default().labels(&format!("{NODE_LABEL}={node}"));
    let (reader, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, cfg)).default_backoff();
    let store = reader.clone();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut listed = false;
        while let Some(event) = stream.next().await {
            // The store swaps in a (re-)list at InitDone; before the first
            // one it is empty, and an empty set would mean "tear all down".
            let send = match event {
                Ok(watcher::Event::InitDone) => {
                    listed = true;
                    true
                }
                Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => listed,
                Ok(_) => false,
                Err(e) => {
                    warn!("watching VMIs: {e}");
                    false
                }
            };
            if send && tx.send(Trigger::Vmis(snapshot(&store))).is_err() {
                break;
            }
        }
    });
    let _ = reader.wait_until_ready().await;
    reader
}

/// Whether this host may claim the VMI: unassigned, not started, and it
/// fits the host ([`scheduling::fits`]: nodeSelector, required node
/// affinity, taints, schedulerName).
pub fn claimable(vmi: &VirtualMachineInstance, host: &HostFacts) -> Result<bool, String> {
    let unassigned = !vmi
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(NODE_LABEL))
        && vmi.status.node_name.as_deref().unwrap_or("").is_empty();
    let fresh = matches!(vmi.status.phase, None | Some(Phase::Pending));
    let alive = vmi.metadata.deletion_timestamp.is_none();
    if !(unassigned && fresh && alive) {
        return Ok(false);
    }
    scheduling::fits(vmi, host).map(|()| true)
}

/// The claim (pure): the node label and `status.nodeName`, guarded by the
/// resourceVersion the decision was made on, so of two hosts racing for
/// one VMI exactly one wins (the other gets a 409 Conflict).
pub fn claim_patch(vmi: &VirtualMachineInstance, node: &str) -> serde_json::Value {
    json!({
        "metadata": {
            "resourceVersion": vmi.metadata.resource_version,
            "labels": { NODE_LABEL: node },
        },
        "status": { "nodeName": node },
    })
}

pub async fn claim(
    client: &kube::Client,
    vmi: &VirtualMachineInstance,
    node: &str,
) -> Result<bool, ClusterError> {
    let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
    let name = vmi.metadata.name.as_deref().unwrap_or_default();
    let api: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), ns);
    match api
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(claim_patch(vmi, node)),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => Ok(false),
        Err(e) => Err(api_err(vmi, "claim")(e)),
    }
}

/// Watches unassigned VMIs and claims those whose nodeSelector this host
/// satisfies, unless it is `cordoned` then; a claimed VMI then arrives
/// through [`watch_node`].
pub fn claim_unassigned(
    client: kube::Client,
    host: HostFacts,
    cordoned: impl Fn() -> bool + Send + 'static,
) {
    let api: Api<VirtualMachineInstance> = Api::all(client.clone());
    let cfg = watcher::Config::default().labels(&format!("!{NODE_LABEL}"));
    tokio::spawn(async move {
        let stream = watcher(api, cfg).default_backoff().applied_objects();
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            let vmi = match item {
                Ok(v) => v,
                Err(e) => {
                    warn!("watching unassigned VMIs: {e}");
                    continue;
                }
            };
            let key = vmi.key().map_or_else(|_| "?".into(), |k| k.to_string());
            // A cordoned host (kvirtctl drain) takes no new VMs, as a
            // cordoned Node.
            if cordoned() {
                info!(vm = %key, "not claimed: this host is cordoned");
                continue;
            }
            match claimable(&vmi, &host) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(why) => {
                    info!(vm = %key, "not claimed: {why}");
                    continue;
                }
            }
            match claim(&client, &vmi, &host.node_name).await {
                Ok(true) => info!(vm = %key, "claimed"),
                Ok(false) => info!(vm = %key, "claimed by another host first"),
                Err(e) => warn!(vm = %key, "claiming: {e}"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(extra: &str) -> VirtualMachineInstance {
        VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a, namespace: ns, resourceVersion: '7'}}\nspec:\n  domain: {{devices: {{}}}}\n{extra}"
        ))
        .unwrap()
    }

    #[test]
    fn claims_only_unassigned_matching_vmis() {
        let host = HostFacts {
            node_name: "node-1".into(),
            labels: [("zone".to_string(), "a".to_string())]
                .into_iter()
                .collect(),
            taints: vec![],
            scheduler_name: "kvirt".into(),
        };
        assert_eq!(claimable(&vmi(""), &host), Ok(true));
        assert_eq!(
            claimable(&vmi("  nodeSelector: {zone: a}\n"), &host),
            Ok(true)
        );
        assert!(claimable(&vmi("  nodeSelector: {zone: b}\n"), &host).is_err());
        assert!(claimable(&vmi("  schedulerName: other\n"), &host).is_err());
        assert_eq!(
            claimable(&vmi("status: {phase: Running}\n"), &host),
            Ok(false)
        );
        assert_eq!(
            claimable(&vmi("status: {nodeName: other}\n"), &host),
            Ok(false)
        );
    }

    #[test]
    fn the_claim_is_guarded_by_resource_version() {
        let p = claim_patch(&vmi(""), "node-1");
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["metadata"]["labels"][NODE_LABEL], "node-1");
        assert_eq!(p["status"]["nodeName"], "node-1");
    }
}
