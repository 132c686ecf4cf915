//! VirtualMachines in a cluster without KubeVirt: every kvirtd plays
//! virt-controller's part for all of them ([`vm::cluster_step`]). Several
//! kvirtds never make two VMIs of one VM, and never both act on one
//! observation:
//! - a VM's VMI has the VM's name, so the API server lets one exist;
//! - each step first writes the VM's status with the resourceVersion it
//!   was decided on: of two kvirtds deciding on the same VM, one write
//!   fails (409) and that kvirtd does nothing;
//! - a VMI is deleted only with its UID as precondition.
//!
//! The chosen VMI is then run by whichever host the node label or the claim
//! rules give it, like any VMI.

use super::ClusterError;
use crate::core::key::VmKey;
use crate::core::vm::{self, VirtualMachine};
use crate::core::vmi::VirtualMachineInstance;
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use tracing::{info, warn, Instrument};

/// Held on each VM until its VMI is gone (the test cluster, like some
/// others, has no garbage collector to follow ownerReferences).
pub const VM_FINALIZER: &str = "kvirt.io/virtualmachine";

resource!(
    VirtualMachine,
    "VirtualMachine",
    "kubevirt.io",
    "v1",
    "virtualmachines"
);

fn err(key: &VmKey, op: &'static str) -> impl FnOnce(kube::Error) -> ClusterError {
    super::api_error(format!("VirtualMachine {key}"), op)
}

/// 404 and 409: someone else got there first; nothing to do.
pub(super) fn raced(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404 || s.code == 409)
}

/// A merge patch from `old` to `new` status: changed keys, and removed
/// ones as null.
fn status_patch(old: &Value, new: &Value, resource_version: Option<&str>) -> Value {
    let mut status = new.as_object().cloned().unwrap_or_default();
    for k in old.as_object().into_iter().flat_map(|o| o.keys()) {
        status.entry(k.clone()).or_insert(Value::Null);
    }
    json!({
        "metadata": { "resourceVersion": resource_version },
        "status": status,
    })
}

pub(super) struct Vms {
    pub(super) client: kube::Client,
    pub(super) vms: Store<VirtualMachine>,
    pub(super) vmis: Store<VirtualMachineInstance>,
    pub(super) revisions: super::instancetypes::Revisions,
}

impl Vms {
    fn vm_api(&self, key: &VmKey) -> Api<VirtualMachine> {
        Api::namespaced(self.client.clone(), key.namespace())
    }

    fn vmi_api(&self, key: &VmKey) -> Api<VirtualMachineInstance> {
        Api::namespaced(self.client.clone(), key.namespace())
    }

    /// One look at one VM; returns when to look again at the latest.
    pub(super) async fn reconcile(&self, key: &VmKey) -> Result<Option<Duration>, ClusterError> {
        let r = ObjectRef::new(key.name()).within(key.namespace());
        let Some(vm) = self.vms.get(&r) else {
            return Ok(None);
        };
        let vm_uid = vm.metadata.uid.clone().unwrap_or_default();
        let found = self
            .vmis
            .get(&ObjectRef::new(key.name()).within(key.namespace()));
        let owned = found.as_deref().filter(|v| {
            v.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.controller == Some(true) && o.uid == vm_uid)
        });
        let rv = vm.metadata.resource_version.as_deref();
        let finalizers = vm.metadata.finalizers.clone().unwrap_or_default();

        if vm.metadata.deletion_timestamp.is_some() {
            match owned {
                Some(v) if v.metadata.deletion_timestamp.is_none() => {
                    let grace = v.termination_grace_period().as_secs() as i64;
                    self.delete_vmi(key, v.uid().unwrap_or_default(), grace)
                        .await?;
                }
                Some(_) => {}
                None if finalizers.iter().any(|f| f == VM_FINALIZER) => {
                    let rest: Vec<&String> =
                        finalizers.iter().filter(|f| *f != VM_FINALIZER).collect();
                    let p = json!({"metadata": {"resourceVersion": rv, "finalizers": rest}});
                    match self
                        .vm_api(key)
                        .patch(key.name(), &PatchParams::default(), &Patch::Merge(&p))
                        .await
                    {
                        Err(e) if !raced(&e) => return Err(err(key, "remove finalizer")(e)),
                        _ => info!("VirtualMachine deleted: its VMI is gone"),
                    }
                }
                None => {}
            }
            return Ok(Some(Duration::from_secs(2)));
        }
        if !finalizers.iter().any(|f| f == VM_FINALIZER) {
            let mut all = finalizers.clone();
            all.push(VM_FINALIZER.into());
            let p = json!({"metadata": {"resourceVersion": rv, "finalizers": all}});
            return match self
                .vm_api(key)
                .patch(key.name(), &PatchParams::default(), &Patch::Merge(&p))
                .await
            {
                Err(e) if !raced(&e) => Err(err(key, "add finalizer")(e)),
                // The change comes back through the watch.
                _ => Ok(Some(Duration::from_secs(1))),
            };
        }

        let captured = match vm.wanted() {
            Ok(w) if w != Default::default() => {
                super::instancetypes::captured(&self.client, &self.revisions, &vm, &w).await?
            }
            // A matcher kvirt cannot follow: the status says why.
            _ => Default::default(),
        };
        let now = jiff::Timestamp::now().as_second();
        let mut step = vm::cluster_step(&vm, owned, now, &captured);
        if found.is_some() && owned.is_none() {
            // Not ours to touch: say so, and wait for it to go.
            step = vm::ClusterStep {
                status: json!({
                    "printableStatus": "Failure",
                    "ready": false,
                    "created": false,
                    "conditions": [{
                        "type": "Failure",
                        "status": "True",
                        "reason": "FailedCreate",
                        "message": format!("a VMI {key} exists that this VirtualMachine does not own"),
                    }],
                }),
                create: None,
                delete: None,
                run_strategy: None,
                wait: None,
            };
        }
        let acts = step.create.is_some() || step.delete.is_some() || step.run_strategy.is_some();
        if acts || step.status != vm.status {
            let p = status_patch(&vm.status, &step.status, rv);
            match self
                .vm_api(key)
                .patch_status(key.name(), &PatchParams::default(), &Patch::Merge(&p))
                .await
            {
                Ok(_) => {}
                // Another kvirtd decided first on this version: it acts.
                Err(e) if raced(&e) => return Ok(Some(Duration::from_secs(1))),
                Err(e) => return Err(err(key, "write status")(e)),
            }
        }
        if let Some(new) = &step.create {
            match self.vmi_api(key).create(&PostParams::default(), new).await {
                Ok(v) => info!(vmi_uid = ?v.uid(), "VirtualMachine: created its VMI"),
                Err(e) if raced(&e) => {}
                Err(e) => return Err(err(key, "create VMI")(e)),
            }
        }
        if let Some((uid, grace)) = &step.delete {
            self.delete_vmi(key, uid, *grace).await?;
        }
        if let Some(s) = step.run_strategy {
            let p = json!({"spec": {"runStrategy": s, "running": null}});
            self.vm_api(key)
                .patch(key.name(), &PatchParams::default(), &Patch::Merge(&p))
                .await
                .map_err(err(key, "set runStrategy"))?;
            info!("VirtualMachine: runStrategy now {s}");
        }
        Ok(step.wait)
    }

    async fn delete_vmi(&self, key: &VmKey, uid: &str, grace: i64) -> Result<(), ClusterError> {
        let dp = DeleteParams {
            grace_period_seconds: Some(grace.max(0) as u32),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match self.vmi_api(key).delete(key.name(), &dp).await {
            Ok(_) => {
                info!(vmi_uid = %uid, "VirtualMachine: stopping its VMI");
                Ok(())
            }
            Err(e) if raced(&e) => Ok(()),
            Err(e) => Err(err(key, "delete VMI")(e)),
        }
    }
}

/// `kvirtctl start|stop|restart` in a cluster, as `virtctl` does them
/// through KubeVirt's API: a new `spec.runStrategy`, or
/// `status.stateChangeRequests` (each write guarded by the resourceVersion
/// read); `stop --grace` first shortens the VMI's grace period. The VM
/// loops of the kvirtds carry them out.
pub async fn request(client: kube::Client, key: &VmKey, verb: vm::Verb) -> Result<String, String> {
    // A write that loses to a VM loop's (409) is decided again on what won.
    let mut tries = 0;
    loop {
        match request_once(&client, key, verb).await {
            Err(Attempt::Conflict(_)) if tries < 4 => tries += 1,
            Err(Attempt::Conflict(m) | Attempt::Failed(m)) => return Err(m),
            Ok(m) => return Ok(m),
        }
    }
}

enum Attempt {
    Conflict(String),
    Failed(String),
}

impl From<String> for Attempt {
    fn from(m: String) -> Self {
        Attempt::Failed(m)
    }
}

async fn request_once(
    client: &kube::Client,
    key: &VmKey,
    verb: vm::Verb,
) -> Result<String, Attempt> {
    let vms: Api<VirtualMachine> = Api::namespaced(client.clone(), key.namespace());
    let vmis: Api<VirtualMachineInstance> = Api::namespaced(client.clone(), key.namespace());
    let e = |op: &str| {
        let op = op.to_owned();
        move |e: kube::Error| {
            let m = format!("{op} {key}: {e}");
            match e {
                kube::Error::Api(s) if s.code == 409 => Attempt::Conflict(m),
                _ => Attempt::Failed(m),
            }
        }
    };
    let vm = vms
        .get_opt(key.name())
        .await
        .map_err(e("reading VirtualMachine"))?
        .ok_or_else(|| format!("no VirtualMachine {key}"))?;
    let vm_uid = vm.metadata.uid.clone().unwrap_or_default();
    let owned = vmis
        .get_opt(key.name())
        .await
        .map_err(e("reading VMI"))?
        .filter(|v| {
            v.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == vm_uid)
        });
    let mut book = vm::book_of(&vm, owned.as_ref());
    let seen = vm::Seen {
        gone: owned.is_none(),
        vmi: owned.clone(),
    };
    let before = book.clone();
    vm::request(&vm, &mut book, &seen, verb)?;
    let rv = vm.metadata.resource_version.as_deref();
    if let (Some(g), Some(v)) = (book.stop_grace, &owned) {
        let own = v.termination_grace_period().as_secs();
        let p = json!({"spec": {"terminationGracePeriodSeconds": g.min(own)}});
        vmis.patch(key.name(), &PatchParams::default(), &Patch::Merge(&p))
            .await
            .map_err(e("shortening the grace period of VMI"))?;
    }
    if let Some(o) = book
        .override_strategy
        .filter(|o| Some(o) != before.override_strategy.as_ref())
    {
        let p = json!({
            "metadata": {"resourceVersion": rv},
            "spec": {"runStrategy": o.strategy, "running": null},
        });
        vms.patch(key.name(), &PatchParams::default(), &Patch::Merge(&p))
            .await
            .map_err(e("patching VirtualMachine"))?;
    }
    if book.requests != before.requests {
        let uid = owned.as_ref().and_then(|v| v.uid());
        let reqs: Vec<Value> = book.requests.iter().map(|r| r.to_json(uid)).collect();
        let p = json!({
            "metadata": {"resourceVersion": rv},
            "status": {"stateChangeRequests": reqs},
        });
        vms.patch_status(key.name(), &PatchParams::default(), &Patch::Merge(&p))
            .await
            .map_err(e("requesting of VirtualMachine"))?;
    }
    Ok(verb.scheduled(key))
}

pub(super) fn key_of(meta: &ObjectMeta) -> Option<VmKey> {
    VmKey::new(meta.namespace.as_deref()?, meta.name.as_deref()?).ok()
}

/// Watches every VirtualMachine and VMI and runs the VMs, until kvirtd
/// exits. An API outage only delays: the stores keep the last state and
/// nothing acts on a stale version (the status write fails first).
pub fn run(client: kube::Client) {
    let (tx, mut rx) = unbounded_channel::<VmKey>();
    let (vm_reader, vm_writer) = reflector::store::<VirtualMachine>();
    let (vmi_reader, vmi_writer) = reflector::store::<VirtualMachineInstance>();
    watch(
        reflector::reflector(
            vm_writer,
            watcher(
                Api::<VirtualMachine>::all(client.clone()),
                Default::default(),
            ),
        ),
        tx.clone(),
        "VirtualMachines",
        key_of,
    );
    watch(
        reflector::reflector(
            vmi_writer,
            watcher(
                Api::<VirtualMachineInstance>::all(client.clone()),
                Default::default(),
            ),
        ),
        tx,
        "VirtualMachineInstances",
        key_of,
    );
    let this = Vms {
        client,
        vms: vm_reader,
        vmis: vmi_reader,
        revisions: Default::default(),
    };
    tokio::spawn(async move {
        let _ = this.vms.wait_until_ready().await;
        let _ = this.vmis.wait_until_ready().await;
        info!("VirtualMachines: watching");
        let mut due: BTreeMap<VmKey, tokio::time::Instant> = BTreeMap::new();
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            let mut now_due: BTreeSet<VmKey> = BTreeSet::new();
            let next = due.values().min().copied();
            tokio::select! {
                k = rx.recv() => match k {
                    Some(k) => { now_due.insert(k); }
                    None => return,
                },
                _ = async {
                    match next {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
                // The slow safety net: every VM, now and then.
                _ = tick.tick() => now_due.extend(this.vms.state().iter().filter_map(|v| key_of(&v.metadata))),
            }
            while let Ok(k) = rx.try_recv() {
                now_due.insert(k);
            }
            let t = tokio::time::Instant::now();
            now_due.extend(
                due.iter()
                    .filter(|(_, at)| **at <= t)
                    .map(|(k, _)| k.clone()),
            );
            for key in now_due {
                due.remove(&key);
                // The journal files it under the VM as the VMI loop's lines.
                let span = tracing::info_span!("vm", vm = %key);
                let r = this.reconcile(&key).instrument(span).await;
                let again = match r {
                    Ok(w) => w,
                    Err(e) => {
                        warn!("VirtualMachine {key}: {e}");
                        Some(Duration::from_secs(5))
                    }
                };
                if let Some(w) = again {
                    due.insert(key, tokio::time::Instant::now() + w);
                }
            }
        }
    });
}

/// Feeds a reflector's changes to the loop as the keys `key` gives them.
pub(super) fn watch<K, S>(
    stream: S,
    tx: UnboundedSender<VmKey>,
    what: &'static str,
    key: fn(&ObjectMeta) -> Option<VmKey>,
) where
    K: kube::Resource + Send + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let stream = stream.default_backoff();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let keys: Vec<VmKey> = match event {
                Ok(watcher::Event::Apply(o) | watcher::Event::Delete(o)) => {
                    key(o.meta()).into_iter().collect()
                }
                Ok(_) => vec![],
                Err(e) => {
                    warn!("watching {what}: {e}");
                    vec![]
                }
            };
            for k in keys {
                if tx.send(k).is_err() {
                    return;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_patch_clears_what_is_no_longer_there() {
        let old = json!({"printableStatus": "CrashLoopBackOff", "startFailure": {"consecutiveFailCount": 1}});
        let new = json!({"printableStatus": "Running"});
        let p = status_patch(&old, &new, Some("42"));
        assert_eq!(p["metadata"]["resourceVersion"], "42");
        assert_eq!(p["status"]["printableStatus"], "Running");
        assert!(p["status"]["startFailure"].is_null());
        assert!(p["status"]
            .as_object()
            .unwrap()
            .contains_key("startFailure"));
    }
}
