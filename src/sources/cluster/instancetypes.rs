//! A VirtualMachine's instancetype and preference in a cluster, kept as
//! KubeVirt keeps them: the object is read once, stored whole in a
//! ControllerRevision owned by the VM (so it goes with the VM), and the
//! revision is named in the VM's status (`instancetypeRef`,
//! `preferenceRef`); later runs read the revision, never the object, so
//! an edited instancetype changes no VM that uses it. A revision the user
//! names (`spec.instancetype.revisionName`) is used as it is.

use super::ClusterError;
use crate::core::instancetype::{
    Captured, Matcher, ObjectKey, Revision, Wanted, API_VERSION, GROUP, VERSION,
};
use crate::core::vm::VirtualMachine;
use k8s_openapi::api::apps::v1::ControllerRevision;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use serde_json::Value;
use std::collections::BTreeMap;
use tracing::info;

/// Revisions read or made, by namespace and name: a revision is never
/// changed once made, so each is read from the API server once.
#[derive(Debug, Default)]
pub(super) struct Revisions(std::sync::Mutex<BTreeMap<(String, String), Revision>>);

impl Revisions {
    fn get(&self, ns: &str, name: &str) -> Option<Revision> {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&(ns.to_owned(), name.to_owned())).cloned()
    }

    fn keep(&self, ns: &str, rev: &Revision) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Bounded: those of deleted VMs are dropped with the rest now and
        // then, and read again when needed.
        if m.len() >= 10_000 {
            m.clear();
        }
        m.insert((ns.to_owned(), rev.name.clone()), rev.clone());
    }
}

/// The revisions the VM uses: those it names and still match its
/// matchers, else ones made now from the objects. An object that does not
/// exist is left out (the VM's status then names it).
pub(super) async fn captured(
    client: &kube::Client,
    known: &Revisions,
    vm: &VirtualMachine,
    wanted: &Wanted,
) -> Result<Captured, ClusterError> {
    read(client, known, vm, wanted, Capture::Keep).await
}

/// Whether a revision read from the object is kept as a ControllerRevision.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Capture {
    Keep,
    /// Only looked at (`virtctl expand`): nothing is written.
    Look,
}

async fn read(
    client: &kube::Client,
    known: &Revisions,
    vm: &VirtualMachine,
    wanted: &Wanted,
    capture: Capture,
) -> Result<Captured, ClusterError> {
    Ok(Captured {
        instancetype: one(
            client,
            known,
            vm,
            (wanted.instancetype.as_ref(), vm.spec.instancetype.as_ref()),
            "instancetypeRef",
            capture,
        )
        .await?,
        preference: one(
            client,
            known,
            vm,
            (wanted.preference.as_ref(), vm.spec.preference.as_ref()),
            "preferenceRef",
            capture,
        )
        .await?,
    })
}

/// The VirtualMachine `key` as `virtctl expand` shows it (read only);
/// `Ok(None)` when there is no such VM.
pub async fn expand(
    client: &kube::Client,
    key: &crate::core::key::VmKey,
) -> Result<Option<serde_json::Value>, String> {
    let api: Api<VirtualMachine> = Api::namespaced(client.clone(), key.namespace());
    let Some(vm) = api
        .get_opt(key.name())
        .await
        .map_err(|e| format!("unable to retrieve vm [{}]: {e}", key.name()))?
    else {
        return Ok(None);
    };
    let wanted = vm.wanted()?;
    let captured = read(client, &Revisions::default(), &vm, &wanted, Capture::Look)
        .await
        .map_err(|e| e.to_string())?;
    crate::core::vm::expanded(&vm, &captured).map(Some)
}

async fn one(
    client: &kube::Client,
    known: &Revisions,
    vm: &VirtualMachine,
    (key, matcher): (Option<&ObjectKey>, Option<&Matcher>),
    status_field: &str,
    capture: Capture,
) -> Result<Option<Revision>, ClusterError> {
    let Some(key) = key else { return Ok(None) };
    let ns = vm.metadata.namespace.as_deref().unwrap_or("default");
    let vm_name = vm.metadata.name.clone().unwrap_or_default();
    let api_err = |op| super::api_error(format!("VirtualMachine {ns}/{vm_name}"), op);
    let revisions: Api<ControllerRevision> = Api::namespaced(client.clone(), ns);
    let named = matcher
        .and_then(|m| m.revision_name.clone())
        .filter(|n| !n.is_empty())
        .or_else(|| {
            let r = vm.status.get(status_field)?;
            (r.get("name")?.as_str()? == key.name).then(|| {
                r.pointer("/controllerRevisionRef/name")?
                    .as_str()
                    .map(str::to_owned)
            })?
        });
    if let Some(name) = named {
        if let Some(rev) = known.get(ns, &name).filter(|r| r.is_of(key)) {
            return Ok(Some(rev));
        }
        let found = revisions
            .get_opt(&name)
            .await
            .map_err(api_err("reading ControllerRevision"))?;
        if let Some(rev) = found.and_then(|cr| revision_of(&name, cr)) {
            if rev.is_of(key) {
                known.keep(ns, &rev);
                return Ok(Some(rev));
            }
        }
    }
    let Some(object) = read_object(client, key)
        .await
        .map_err(api_err("reading instancetype"))?
    else {
        return Ok(None);
    };
    let rev = Revision::of(&vm_name, &object);
    if capture == Capture::Look {
        return Ok(Some(rev));
    }
    let cr = ControllerRevision {
        metadata: ObjectMeta {
            name: Some(rev.name.clone()),
            namespace: Some(ns.to_owned()),
            owner_references: Some(vec![OwnerReference {
                api_version: crate::core::vmi::API_VERSION.into(),
                kind: crate::core::vm::KIND.into(),
                name: vm_name.clone(),
                uid: vm.metadata.uid.clone().unwrap_or_default(),
                controller: Some(true),
                block_owner_deletion: Some(true),
            }]),
            labels: Some(labels(key, &rev.object)),
            ..ObjectMeta::default()
        },
        data: Some(RawExtension(rev.object.clone())),
        revision: 0,
    };
    match revisions.create(&PostParams::default(), &cr).await {
        Ok(_) => {
            info!(revision = %rev.name, "VirtualMachine: kept {key} as a ControllerRevision");
            known.keep(ns, &rev);
            Ok(Some(rev))
        }
        // Another kvirtd made it first: the same name is the same object
        // generation; use what it stored.
        Err(kube::Error::Api(s)) if s.code == 409 => {
            let found = revisions
                .get_opt(&rev.name)
                .await
                .map_err(api_err("reading ControllerRevision"))?;
            Ok(found.and_then(|cr| revision_of(&rev.name, cr)))
        }
        Err(e) => Err(api_err("creating ControllerRevision")(e)),
    }
}

fn revision_of(name: &str, cr: ControllerRevision) -> Option<Revision> {
    Some(Revision {
        name: name.to_owned(),
        object: cr.data?.0,
    })
}

/// KubeVirt's labels on a revision: what it holds.
fn labels(key: &ObjectKey, object: &Value) -> BTreeMap<String, String> {
    let meta = |k: &str| {
        object
            .pointer(&format!("/metadata/{k}"))
            .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
            .unwrap_or_default()
    };
    [
        ("object-kind", key.kind.as_str().to_owned()),
        ("object-name", key.name.clone()),
        ("object-uid", meta("uid")),
        ("object-generation", meta("generation")),
        ("object-version", VERSION.to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (format!("{GROUP}/{k}"), v))
    .collect()
}

/// The object, or `None` when it does not exist.
async fn read_object(client: &kube::Client, key: &ObjectKey) -> Result<Option<Value>, kube::Error> {
    let res = ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: API_VERSION.into(),
        kind: key.kind.as_str().into(),
        plural: key.kind.plural(),
    };
    let api: Api<DynamicObject> = match (&key.namespace, key.kind) {
        (Some(ns), k) if k.namespaced() => Api::namespaced_with(client.clone(), ns, &res),
        _ => Api::all_with(client.clone(), &res),
    };
    let Some(obj) = api.get_opt(&key.name).await? else {
        return Ok(None);
    };
    let mut v = serde_json::to_value(&obj).unwrap_or_default();
    v["apiVersion"] = API_VERSION.into();
    v["kind"] = key.kind.as_str().into();
    Ok(Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::instancetype::Kind;

    #[test]
    fn a_revision_carries_kubevirts_labels() {
        let obj =
            serde_json::json!({"metadata": {"name": "u1.small", "uid": "u", "generation": 4}});
        let key = ObjectKey {
            kind: Kind::VirtualMachineClusterInstancetype,
            namespace: None,
            name: "u1.small".into(),
        };
        let l = labels(&key, &obj);
        assert_eq!(
            l["instancetype.kubevirt.io/object-kind"],
            "VirtualMachineClusterInstancetype"
        );
        assert_eq!(l["instancetype.kubevirt.io/object-generation"], "4");
        assert_eq!(l["instancetype.kubevirt.io/object-version"], "v1beta1");
    }
}
