//! VirtualMachinePools and VirtualMachineInstanceReplicaSets in a cluster
//! without KubeVirt: every kvirtd plays KubeVirt's pool and replica set
//! controllers ([`pool::scale`]). Several kvirtds never make two members of
//! one index: a member's name is `<owner>-<index>`, which the API server
//! lets exist once; a member is deleted with its UID as precondition. An
//! owner holds kvirt's finalizer until its members are gone (not every
//! cluster runs a garbage collector). A replica set's VMI that ended is
//! deleted and replaced, as KubeVirt's are.

use super::vms::{key_of, raced, watch};
use super::ClusterError;
use crate::core::key::VmKey;
use crate::core::pool::{self, Pool, ReplicaSet};
use crate::core::vm::VirtualMachine;
use crate::core::vmi::{Phase, VirtualMachineInstance};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::Resource;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::unbounded_channel;
use tracing::{info, warn, Instrument};

/// An API object kvirt reads and writes.
pub(super) trait Object:
    kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
    + Clone
    + Debug
    + DeserializeOwned
    + Serialize
    + Send
    + Sync
    + 'static
{
}

impl<T> Object for T where
    T: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Serialize
        + Send
        + Sync
        + 'static
{
}

/// What a pool and a replica set share: a count of members made from a
/// template.
pub(super) trait Owner: Object {
    type Member: Object;
    const KIND: &'static str;
    const FINALIZER: &'static str;
    fn wanted(&self) -> Result<u32, String>;
    fn paused(&self) -> bool;
    fn selector(&self) -> Option<&LabelSelector>;
    fn status(&self) -> &Value;
    fn member(&self, i: u32) -> Result<Self::Member, String>;
    /// A member that ended for good: deleted, and replaced.
    fn ended(m: &Self::Member) -> bool;
    fn ready(m: &Self::Member) -> bool;
}

impl Owner for Pool {
    type Member = VirtualMachine;
    const KIND: &'static str = pool::KIND;
    const FINALIZER: &'static str = "kvirt.io/vmpool";
    fn wanted(&self) -> Result<u32, String> {
        self.replicas()
    }
    fn paused(&self) -> bool {
        self.spec.paused
    }
    fn selector(&self) -> Option<&LabelSelector> {
        self.spec.selector.as_ref()
    }
    fn status(&self) -> &Value {
        &self.status
    }
    fn member(&self, i: u32) -> Result<VirtualMachine, String> {
        Pool::member(self, i)
    }
    fn ended(_: &VirtualMachine) -> bool {
        false
    }
    fn ready(m: &VirtualMachine) -> bool {
        m.status.get("ready") == Some(&Value::Bool(true))
    }
}

impl Owner for ReplicaSet {
    type Member = VirtualMachineInstance;
    const KIND: &'static str = pool::REPLICA_SET_KIND;
    const FINALIZER: &'static str = "kvirt.io/vmirs";
    fn wanted(&self) -> Result<u32, String> {
        self.replicas()
    }
    fn paused(&self) -> bool {
        self.spec.paused
    }
    fn selector(&self) -> Option<&LabelSelector> {
        self.spec.selector.as_ref()
    }
    fn status(&self) -> &Value {
        &self.status
    }
    fn member(&self, i: u32) -> Result<VirtualMachineInstance, String> {
        ReplicaSet::member(self, i)
    }
    fn ended(m: &VirtualMachineInstance) -> bool {
        matches!(m.status.phase, Some(Phase::Succeeded | Phase::Failed))
    }
    fn ready(m: &VirtualMachineInstance) -> bool {
        m.status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    }
}

resource!(
    Pool,
    pool::KIND,
    pool::GROUP,
    "v1beta1",
    "virtualmachinepools"
);
resource!(
    ReplicaSet,
    pool::REPLICA_SET_KIND,
    "kubevirt.io",
    "v1",
    "virtualmachineinstancereplicasets"
);

struct Controller<O: Owner> {
    client: kube::Client,
    owners: Store<O>,
    members: Store<O::Member>,
}

fn err(kind: &str, key: &VmKey, op: &'static str) -> impl FnOnce(kube::Error) -> ClusterError {
    super::api_error(format!("{kind} {key}"), op)
}

impl<O: Owner> Controller<O> {
    /// The owner's members: those it controls, by index.
    fn members(&self, o: &O) -> Vec<(u32, Arc<O::Member>)> {
        let meta = o.meta();
        let uid = meta.uid.as_deref().unwrap_or_default();
        let name = meta.name.as_deref().unwrap_or_default();
        self.members
            .state()
            .into_iter()
            .filter(|m| m.meta().namespace == meta.namespace)
            .filter(|m| {
                m.meta()
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|r| r.controller == Some(true) && r.uid == uid)
            })
            .filter_map(|m| Some((pool::index_of(name, m.meta().name.as_deref()?)?, m)))
            .collect()
    }

    /// kvirt's finalizer on, or off once the members are gone; `true`
    /// when a patch was sent (the change comes back through the watch).
    async fn finalizer(&self, key: &VmKey, o: &O, members: usize) -> Result<bool, ClusterError> {
        let meta = o.meta();
        let finalizers = meta.finalizers.clone().unwrap_or_default();
        let holds = finalizers.iter().any(|f| f == O::FINALIZER);
        let deleting = meta.deletion_timestamp.is_some();
        let new: Vec<&str> = match (holds, deleting) {
            (false, false) => finalizers
                .iter()
                .map(String::as_str)
                .chain([O::FINALIZER])
                .collect(),
            (true, true) if members == 0 => finalizers
                .iter()
                .map(String::as_str)
                .filter(|f| *f != O::FINALIZER)
                .collect(),
            _ => return Ok(false),
        };
        let patch =
            json!({"metadata": {"resourceVersion": meta.resource_version, "finalizers": new}});
        let api: Api<O> = Api::namespaced(self.client.clone(), key.namespace());
        match api
            .patch(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Err(e) if !raced(&e) => Err(err(O::KIND, key, "patch finalizers")(e)),
            _ => Ok(true),
        }
    }

    async fn reconcile(&self, key: &VmKey) -> Result<(), ClusterError> {
        let r = reflector::ObjectRef::new(key.name()).within(key.namespace());
        let Some(o) = self.owners.get(&r) else {
            return Ok(());
        };
        let api: Api<O::Member> = Api::namespaced(self.client.clone(), key.namespace());
        let members = self.members(&o);
        if self.finalizer(key, &o, members.len()).await? {
            return Ok(());
        }
        let deleting = o.meta().deletion_timestamp.is_some();
        let want = if deleting { Ok(0) } else { o.wanted() };
        // Ended members go (and are replaced); those going still hold
        // their names.
        let going = |m: &O::Member| m.meta().deletion_timestamp.is_some();
        let taken: BTreeSet<u32> = members.iter().map(|(i, _)| *i).collect();
        let active: BTreeSet<u32> = members
            .iter()
            .filter(|(_, m)| !going(m) && !O::ended(m))
            .map(|(i, _)| *i)
            .collect();
        let ended = members.iter().filter(|(_, m)| !going(m) && O::ended(m));
        let (create, remove) = match (&want, o.paused()) {
            (Ok(n), false) => pool::scale(&active, &taken, *n),
            _ => (vec![], vec![]),
        };
        for i in create {
            let m = o.member(i).map_err(|message| ClusterError::Invalid {
                object: format!("{} {key}", O::KIND),
                message,
            })?;
            match api.create(&PostParams::default(), &m).await {
                Ok(_) => info!("{}: made {}-{i}", O::KIND, key.name()),
                Err(e) if raced(&e) => {}
                Err(e) => return Err(err(O::KIND, key, "create member")(e)),
            }
        }
        let doomed = members
            .iter()
            .filter(|(i, _)| remove.contains(i))
            .chain(ended);
        for (_, m) in doomed {
            let name = m.meta().name.clone().unwrap_or_default();
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: m.meta().uid.clone(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            match api.delete(&name, &dp).await {
                Ok(_) => info!("{}: removed {name}", O::KIND),
                Err(e) if raced(&e) => {}
                Err(e) => return Err(err(O::KIND, key, "delete member")(e)),
            }
        }
        let status = status(&*o, &members, want.as_ref().err());
        if &status != o.status() {
            let owners: Api<O> = Api::namespaced(self.client.clone(), key.namespace());
            let patch = json!({"status": status});
            match owners
                .patch_status(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Err(e) if !raced(&e) => return Err(err(O::KIND, key, "write status")(e)),
                _ => {}
            }
        }
        Ok(())
    }
}

/// KubeVirt's status of a pool or replica set: members, ready ones, the
/// selector as a string, and why it cannot be followed.
fn status<O: Owner>(o: &O, members: &[(u32, Arc<O::Member>)], why: Option<&String>) -> Value {
    let ready = members.iter().filter(|(_, m)| O::ready(m)).count();
    let selector = o
        .selector()
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

/// The owner of kind `O` a member belongs to, by its controller reference.
fn owner_of<O: Owner>(meta: &ObjectMeta) -> Option<VmKey> {
    let o = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == O::KIND)?;
    VmKey::new(meta.namespace.as_deref()?, &o.name).ok()
}

/// Watches every pool and replica set with their members and keeps their
/// sizes, until kvirtd exits.
pub fn run(client: kube::Client) {
    run_for::<Pool>(client.clone(), "VirtualMachinePools");
    run_for::<ReplicaSet>(client, "VirtualMachineInstanceReplicaSets");
}

fn run_for<O: Owner>(client: kube::Client, what: &'static str) {
    let (tx, mut rx) = unbounded_channel::<VmKey>();
    let (owner_reader, owner_writer) = reflector::store::<O>();
    let (member_reader, member_writer) = reflector::store::<O::Member>();
    watch(
        reflector::reflector(
            owner_writer,
            watcher(Api::<O>::all(client.clone()), Default::default()),
        ),
        tx.clone(),
        what,
        key_of,
    );
    watch(
        reflector::reflector(
            member_writer,
            watcher(Api::<O::Member>::all(client.clone()), Default::default()),
        ),
        tx,
        what,
        owner_of::<O>,
    );
    let this = Controller::<O> {
        client,
        owners: owner_reader,
        members: member_reader,
    };
    tokio::spawn(async move {
        let _ = this.owners.wait_until_ready().await;
        let _ = this.members.wait_until_ready().await;
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            let mut due: BTreeSet<VmKey> = BTreeSet::new();
            tokio::select! {
                k = rx.recv() => match k {
                    Some(k) => { due.insert(k); }
                    None => return,
                },
                _ = tick.tick() => due.extend(this.owners.state().iter().filter_map(|o| key_of(o.meta()))),
            }
            while let Ok(k) = rx.try_recv() {
                due.insert(k);
            }
            for key in due {
                let span = tracing::info_span!("replicas", owner = %key);
                // What did not settle is looked at again on the next tick.
                if let Err(e) = this.reconcile(&key).instrument(span).await {
                    warn!("{} {key}: {e}", O::KIND);
                }
            }
        }
    });
}
