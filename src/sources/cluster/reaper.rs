//! Hosts that died: the leading kvirtd watches the kvirt Leases, and fails
//! the VMIs of a host it has seen unrenewed for the Lease's duration plus
//! `[kubernetes] node_dead_after_seconds` (reason `NodeUnresponsive`), as
//! virt-controller does for a node whose virt-handler stopped. Their
//! VirtualMachines then make them anew, and the leader places them on a
//! live host. The
//! dead host, back, finds its VMIs failed or replaced and tears its copies
//! down (a final or vanished VMI's VM is torn down).

use super::{VirtualMachineInstance, FINALIZER, KUBEVIRT_FINALIZER, NODE_LABEL};
use crate::core::liveness::{unresponsive_patch, Beat, Liveness, NODE_UNRESPONSIVE};
use crate::sources::{EventReason, Recorder};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// How often the Leases are looked at.
const LOOK: Duration = Duration::from_secs(5);
/// How often a dead host's VMIs are listed again (one may be labelled for
/// it later, or a patch may have lost a race).
const RELIST: Duration = Duration::from_secs(60);

/// What a Lease says, if it is a kvirt host's.
fn beat(lease: &Lease) -> Option<Beat> {
    let spec = lease.spec.as_ref()?;
    Some(Beat {
        node: spec.holder_identity.clone()?,
        renewed: spec.renew_time.as_ref()?.0.to_string(),
        duration: Duration::from_secs(u64::try_from(spec.lease_duration_seconds?).ok()?),
    })
}

/// Fails the VMIs of the hosts found dead, looking at `reader` (the
/// leader's one watch of the host Leases, listed already,
/// [`super::lease::watch_hosts`]: nothing polled).
pub fn run(
    client: kube::Client,
    own: String,
    dead_after: Duration,
    events: Arc<dyn Recorder>,
    reader: Store<Lease>,
) {
    tokio::spawn(async move {
        let mut liveness = Liveness::default();
        let mut listed: BTreeMap<String, Instant> = BTreeMap::new();
        let mut tick = tokio::time::interval(LOOK);
        loop {
            tick.tick().await;
            let beats: Vec<Beat> = reader.state().iter().filter_map(|l| beat(l)).collect();
            let now = Instant::now();
            liveness.observe(&beats, &own, now);
            let dead = liveness.dead(&own, dead_after, now);
            listed.retain(|n, _| dead.contains(n));
            for node in dead {
                if listed
                    .get(&node)
                    .is_some_and(|at| now.duration_since(*at) < RELIST)
                {
                    continue;
                }
                listed.insert(node.clone(), now);
                if let Err(e) = fail_vmis_of(&client, &node, events.as_ref()).await {
                    warn!(node = %node, "failing the VMIs of a dead host: {e}");
                }
            }
        }
    });
}

/// Fails every VMI of `node` that is not final yet.
async fn fail_vmis_of(
    client: &kube::Client,
    node: &str,
    events: &dyn Recorder,
) -> Result<(), kube::Error> {
    let all: Api<VirtualMachineInstance> = Api::all(client.clone());
    let vmis = all
        .list(&ListParams::default().labels(&format!("{NODE_LABEL}={node}")))
        .await?;
    for vmi in vmis.items {
        if vmi.status.phase.is_some_and(|p| p.is_final()) {
            continue;
        }
        let (Some(ns), Some(name), Some(rv)) = (
            vmi.metadata.namespace.as_deref(),
            vmi.metadata.name.as_deref(),
            vmi.metadata.resource_version.as_deref(),
        ) else {
            continue;
        };
        let kept: Vec<String> = (vmi.metadata.finalizers.iter().flatten())
            .filter(|f| f.as_str() != FINALIZER && f.as_str() != KUBEVIRT_FINALIZER)
            .cloned()
            .collect();
        let api: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), ns);
        let patch = unresponsive_patch(rv, node, &kept);
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {
                let message = format!(
                    "node {node} stopped renewing its Lease: {ns}/{name} is failed ({NODE_UNRESPONSIVE})"
                );
                info!("{message}");
                events.record(&vmi, EventReason::NodeUnresponsive, &message, true);
            }
            // Another kvirtd failed it first, or it changed meanwhile.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => warn!("{ns}/{name}: failing it: {e}"),
        }
    }
    Ok(())
}
