//! VirtualMachinePools in a cluster without KubeVirt: every kvirtd plays
//! KubeVirt's pool controller ([`pool::scale`]). Several kvirtds never
//! make two VMs of one index: a member's name is `<pool>-<index>`, which
//! the API server lets exist once; a member is deleted with its UID as
//! precondition. A pool holds kvirt's finalizer until its VMs are gone
//! (not every cluster runs a garbage collector).

use super::vms::{key_of, raced, watch};
use super::ClusterError;
use crate::core::key::VmKey;
use crate::core::pool::{self, Pool};
use crate::core::vm::VirtualMachine;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio::sync::mpsc::unbounded_channel;
use tracing::{info, warn, Instrument};

pub const POOL_FINALIZER: &str = "kvirt.io/vmpool";

impl kube::Resource for Pool {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        pool::KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        pool::GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1beta1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "virtualmachinepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

struct Pools {
    client: kube::Client,
    pools: Store<Pool>,
    vms: Store<VirtualMachine>,
}

fn err(key: &VmKey, op: &'static str) -> impl FnOnce(kube::Error) -> ClusterError {
    super::api_error(format!("VirtualMachinePool {key}"), op)
}

impl Pools {
    /// The pool's members: VMs it controls, by index.
    fn members(&self, p: &Pool) -> Vec<(u32, std::sync::Arc<VirtualMachine>)> {
        let uid = p.metadata.uid.as_deref().unwrap_or_default();
        let name = p.metadata.name.as_deref().unwrap_or_default();
        self.vms
            .state()
            .into_iter()
            .filter(|v| v.metadata.namespace == p.metadata.namespace)
            .filter(|v| {
                v.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.controller == Some(true) && o.uid == uid)
            })
            .filter_map(|v| Some((pool::index_of(name, v.metadata.name.as_deref()?)?, v)))
            .collect()
    }

    async fn reconcile(&self, key: &VmKey) -> Result<Option<Duration>, ClusterError> {
        let r = reflector::ObjectRef::new(key.name()).within(key.namespace());
        let Some(p) = self.pools.get(&r) else {
            return Ok(None);
        };
        let pools: Api<Pool> = Api::namespaced(self.client.clone(), key.namespace());
        let vms: Api<VirtualMachine> = Api::namespaced(self.client.clone(), key.namespace());
        let members = self.members(&p);
        let rv = p.metadata.resource_version.as_deref();
        let finalizers = p.metadata.finalizers.clone().unwrap_or_default();
        let holds = finalizers.iter().any(|f| f == POOL_FINALIZER);
        let want = if p.metadata.deletion_timestamp.is_some() {
            if members.is_empty() && holds {
                let rest: Vec<&String> =
                    finalizers.iter().filter(|f| *f != POOL_FINALIZER).collect();
                let patch = json!({"metadata": {"resourceVersion": rv, "finalizers": rest}});
                return match pools
                    .patch(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Err(e) if !raced(&e) => Err(err(key, "remove finalizer")(e)),
                    _ => Ok(None),
                };
            }
            Ok(0)
        } else {
            p.replicas()
        };
        if !holds && p.metadata.deletion_timestamp.is_none() {
            let mut all = finalizers.clone();
            all.push(POOL_FINALIZER.into());
            let patch = json!({"metadata": {"resourceVersion": rv, "finalizers": all}});
            return match pools
                .patch(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Err(e) if !raced(&e) => Err(err(key, "add finalizer")(e)),
                _ => Ok(Some(Duration::from_secs(1))),
            };
        }
        let have: BTreeSet<u32> = members.iter().map(|(i, _)| *i).collect();
        let (create, remove) = match (&want, p.spec.paused) {
            (Ok(n), false) => pool::scale(&have, *n),
            _ => (vec![], vec![]),
        };
        for i in create {
            let vm = p.member(i).map_err(|message| ClusterError::Invalid {
                object: format!("VirtualMachinePool {key}"),
                message,
            })?;
            match vms.create(&PostParams::default(), &vm).await {
                Ok(_) => info!("VirtualMachinePool: created VM {}-{i}", key.name()),
                Err(e) if raced(&e) => {}
                Err(e) => return Err(err(key, "create VM")(e)),
            }
        }
        for i in remove {
            let Some((_, vm)) = members.iter().find(|(j, _)| *j == i) else {
                continue;
            };
            let name = vm.metadata.name.clone().unwrap_or_default();
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: vm.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match vms.delete(&name, &dp).await {
                Ok(_) => info!("VirtualMachinePool: removed VM {name}"),
                Err(e) if raced(&e) => {}
                Err(e) => return Err(err(key, "delete VM")(e)),
            }
        }
        let status = status(&p, &members, want.as_ref().err());
        if status != p.status {
            let patch = json!({"status": status});
            match pools
                .patch_status(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Err(e) if !raced(&e) => return Err(err(key, "write status")(e)),
                _ => {}
            }
        }
        Ok(None)
    }
}

/// KubeVirt's pool status: replicas, ready ones, the selector as a string,
/// and why it cannot be followed.
fn status(
    p: &Pool,
    members: &[(u32, std::sync::Arc<VirtualMachine>)],
    why: Option<&String>,
) -> Value {
    let ready = members
        .iter()
        .filter(|(_, v)| v.status.get("ready") == Some(&Value::Bool(true)))
        .count();
    let selector = p
        .spec
        .selector
        .as_ref()
        .and_then(|s| s.match_labels.as_ref())
        .map(|l| {
            l.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default();
    let mut st = json!({
        "replicas": members.len(),
        "readyReplicas": ready,
        "labelSelector": selector,
    });
    if let Some(why) = why {
        st["conditions"] = json!([{
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": why,
        }]);
    }
    st
}

/// The pool a VM belongs to, by its controller reference.
fn pool_of(meta: &ObjectMeta) -> Option<VmKey> {
    let o = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == pool::KIND)?;
    VmKey::new(meta.namespace.as_deref()?, &o.name).ok()
}

/// Watches every pool and VirtualMachine and keeps the pools' sizes,
/// until kvirtd exits.
pub fn run(client: kube::Client) {
    let (tx, mut rx) = unbounded_channel::<VmKey>();
    let (pool_reader, pool_writer) = reflector::store::<Pool>();
    let (vm_reader, vm_writer) = reflector::store::<VirtualMachine>();
    watch(
        reflector::reflector(
            pool_writer,
            watcher(Api::<Pool>::all(client.clone()), Default::default()),
        ),
        tx.clone(),
        "VirtualMachinePools",
        key_of,
    );
    watch(
        reflector::reflector(
            vm_writer,
            watcher(
                Api::<VirtualMachine>::all(client.clone()),
                Default::default(),
            ),
        ),
        tx,
        "VirtualMachines of pools",
        pool_of,
    );
    let this = Pools {
        client,
        pools: pool_reader,
        vms: vm_reader,
    };
    tokio::spawn(async move {
        let _ = this.pools.wait_until_ready().await;
        let _ = this.vms.wait_until_ready().await;
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            let mut due: BTreeSet<VmKey> = BTreeSet::new();
            tokio::select! {
                k = rx.recv() => match k {
                    Some(k) => { due.insert(k); }
                    None => return,
                },
                _ = tick.tick() => due.extend(this.pools.state().iter().filter_map(|p| key_of(&p.metadata))),
            }
            while let Ok(k) = rx.try_recv() {
                due.insert(k);
            }
            for key in due {
                let span = tracing::info_span!("vmpool", pool = %key);
                // What did not settle is looked at again on the next tick.
                if let Err(e) = this.reconcile(&key).instrument(span).await {
                    warn!("VirtualMachinePool {key}: {e}");
                }
            }
        }
    });
}
