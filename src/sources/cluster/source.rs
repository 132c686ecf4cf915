//! VMIs from the API: the ones labelled for this node; which VMIs wait
//! for a host, and the write that assigns one (the leader's scheduler,
//! `scheduler`).

use super::{api_err, ClusterError, NODE_LABEL};
use crate::core::key::VmKey;
use crate::core::trigger::Trigger;
use crate::core::vmi::{Phase, VirtualMachineInstance};
use futures::StreamExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::json;
use std::collections::BTreeMap;
use tokio::sync::mpsc::UnboundedSender;
use tracing::warn;

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

/// Whether the VMI waits for a host: unassigned, not started, not being
/// deleted (the leader's scheduler places it).
pub fn unplaced(vmi: &VirtualMachineInstance) -> bool {
    let unassigned = !vmi
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(NODE_LABEL))
        && vmi.status.node_name.as_deref().unwrap_or("").is_empty();
    let fresh = matches!(vmi.status.phase, None | Some(Phase::Pending));
    let alive = vmi.metadata.deletion_timestamp.is_none();
    unassigned && fresh && alive
}

/// The assignment (pure): the node label and `status.nodeName`, guarded
/// by the resourceVersion the decision was made on, so a VMI changed
/// meanwhile (or assigned by a leader that has just lost the lead) is not
/// assigned twice: the later write gets a 409 Conflict.
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
    fn only_unassigned_fresh_vmis_wait_for_a_host() {
        assert!(unplaced(&vmi("")));
        assert!(unplaced(&vmi("status: {phase: Pending}\n")));
        assert!(!unplaced(&vmi("status: {phase: Running}\n")));
        assert!(!unplaced(&vmi("status: {nodeName: other}\n")));
        let mut labelled = vmi("");
        labelled.metadata.labels = Some([(NODE_LABEL.to_string(), "n".to_string())].into());
        assert!(!unplaced(&labelled));
    }

    #[test]
    fn the_claim_is_guarded_by_resource_version() {
        let p = claim_patch(&vmi(""), "node-1");
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["metadata"]["labels"][NODE_LABEL], "node-1");
        assert_eq!(p["status"]["nodeName"], "node-1");
    }
}
