//! PersistentVolumeClaims a VMI names: read with their PV and class, bound
//! for this node when their class waits for a consumer, and held by
//! kvirt's finalizer while a VM uses them (every write guarded by the
//! claim's resourceVersion, so two hosts never both win).

use super::status::KubeStatus;
use crate::core::pvc::{self, DataVolume, User};
use crate::core::vmi::VirtualMachineInstance;
use crate::sources::{ClaimObjects, SourceError};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{json, Value};

fn claim_err(namespace: &str, name: &str) -> impl Fn(kube::Error) -> SourceError {
    let (namespace, name) = (namespace.to_owned(), name.to_owned());
    move |e| SourceError::Claim {
        namespace: namespace.clone(),
        name: name.clone(),
        message: match e {
            kube::Error::Api(s) if s.code == 403 => format!(
                "kvirtd may not read or hold claims here ({}): re-apply kvirt's RBAC",
                s.message
            ),
            e => e.to_string(),
        },
    }
}

/// The merge patch that records `user` and the finalizer, `Ok(None)` when
/// both are there, `Err` when the access modes forbid another user. The
/// records of VMIs in `gone` (deleted without kvirt letting go, e.g. their
/// finalizer removed by hand) are dropped first.
pub fn hold_patch(
    pvc: &PersistentVolumeClaim,
    user: &User,
    gone: &[String],
) -> Result<Option<Value>, String> {
    let name = pvc.metadata.name.as_deref().unwrap_or_default();
    let mut users = pvc::users(pvc.metadata.annotations.as_ref());
    let recorded = users.len();
    users.retain(|u| !gone.contains(&u.uid));
    let stale = users.len() != recorded;
    let modes = access_modes(pvc);
    if let Some(why) = pvc::conflict(name, &modes, &users, user) {
        return Err(why);
    }
    let finalizers = pvc.metadata.finalizers.clone().unwrap_or_default();
    let held = finalizers.iter().any(|f| f == pvc::FINALIZER);
    if held && users.contains(user) && !stale {
        return Ok(None);
    }
    users.retain(|u| u.uid != user.uid);
    users.push(user.clone());
    Ok(Some(patch(pvc, &users, true, &finalizers)))
}

fn access_modes(pvc: &PersistentVolumeClaim) -> Vec<String> {
    (pvc.status.as_ref().and_then(|s| s.access_modes.clone()))
        .or_else(|| pvc.spec.as_ref().and_then(|s| s.access_modes.clone()))
        .unwrap_or_default()
}

/// The merge patch that drops the VMI `uid`'s record (and the finalizer
/// with the last one), `None` when there is nothing of it.
pub fn release_patch(pvc: &PersistentVolumeClaim, uid: &str) -> Option<Value> {
    let mut users = pvc::users(pvc.metadata.annotations.as_ref());
    let finalizers = pvc.metadata.finalizers.clone().unwrap_or_default();
    let before = users.len();
    users.retain(|u| u.uid != uid);
    let held = finalizers.iter().any(|f| f == pvc::FINALIZER);
    if users.len() == before && (!held || !users.is_empty()) {
        return None;
    }
    Some(patch(pvc, &users, !users.is_empty(), &finalizers))
}

fn patch(pvc: &PersistentVolumeClaim, users: &[User], hold: bool, finalizers: &[String]) -> Value {
    let mut f: Vec<&String> = finalizers.iter().filter(|f| *f != pvc::FINALIZER).collect();
    let ours = pvc::FINALIZER.to_owned();
    if hold {
        f.push(&ours);
    }
    let annotation = if users.is_empty() {
        Value::Null
    } else {
        json!(serde_json::to_string(users).unwrap_or_default())
    };
    json!({
        "metadata": {
            "resourceVersion": pvc.metadata.resource_version,
            "finalizers": f,
            "annotations": { pvc::USERS_ANNOTATION: annotation },
        }
    })
}

impl KubeStatus {
    fn pvcs(&self, namespace: &str) -> Api<PersistentVolumeClaim> {
        Api::namespaced(self.client.clone(), namespace)
    }

    pub(super) async fn read_claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<ClaimObjects, SourceError> {
        let err = claim_err(namespace, name);
        let Some(pvc) = self.pvcs(namespace).get_opt(name).await.map_err(&err)? else {
            return Ok(ClaimObjects::default());
        };
        let spec = pvc.spec.clone().unwrap_or_default();
        let pv = match spec.volume_name.as_deref().filter(|v| !v.is_empty()) {
            Some(v) => Api::<PersistentVolume>::all(self.client.clone())
                .get_opt(v)
                .await
                .map_err(&err)?,
            None => None,
        };
        let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
        // The class matters only while the claim waits to be bound.
        let binding_mode = match (bound, spec.storage_class_name.as_deref()) {
            (false, Some(class)) if !class.is_empty() => {
                Api::<StorageClass>::all(self.client.clone())
                    .get_opt(class)
                    .await
                    .map_err(&err)?
                    .and_then(|c| c.volume_binding_mode)
            }
            _ => None,
        };
        Ok(ClaimObjects {
            pvc: Some(pvc),
            pv,
            binding_mode,
        })
    }

    pub(super) async fn read_data_volume(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<DataVolume>, SourceError> {
        let gvk = GroupVersionKind::gvk("cdi.kubevirt.io", "v1beta1", "DataVolume");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "datavolumes");
        let api = Api::<DynamicObject>::namespaced_with(self.client.clone(), namespace, &resource);
        let dv = match api.get_opt(name).await {
            Ok(dv) => dv,
            // No CDI installed: no DataVolume.
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => return Err(claim_err(namespace, name)(e)),
        };
        Ok(dv.map(|dv| {
            let status = &dv.data["status"];
            let text = |k: &str| status[k].as_str().map(str::to_owned);
            let message = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["message"].as_str())
                .find(|m| !m.is_empty())
                .map(str::to_owned);
            DataVolume {
                phase: text("phase").unwrap_or_default(),
                progress: text("progress"),
                message,
            }
        }))
    }

    pub(super) async fn set_selected_node(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
    ) -> Result<(), SourceError> {
        let patch = json!({"metadata": {"annotations": {pvc::SELECTED_NODE: node}}});
        self.pvcs(namespace)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(claim_err(namespace, name))
            .map(|_| ())
    }

    pub(super) async fn hold_pvc(
        &self,
        namespace: &str,
        name: &str,
        user: &User,
    ) -> Result<Result<(), String>, SourceError> {
        let err = claim_err(namespace, name);
        let api = self.pvcs(namespace);
        let Some(pvc) = api.get_opt(name).await.map_err(&err)? else {
            return Ok(Err(format!("claim {name} does not exist")));
        };
        if pvc.metadata.deletion_timestamp.is_some() {
            return Ok(Err(format!("claim {name} is being deleted")));
        }
        let gone = self.gone_users(&pvc, user).await.map_err(&err)?;
        match hold_patch(&pvc, user, &gone) {
            Ok(None) => Ok(Ok(())),
            Ok(Some(p)) => api
                .patch(name, &PatchParams::default(), &Patch::Merge(&p))
                .await
                .map(|_| Ok(()))
                .map_err(err),
            Err(why) => Ok(Err(why)),
        }
    }

    /// The UIDs of the other users recorded on the claim whose VMI no
    /// longer exists: asked only when one of them stands in the way.
    async fn gone_users(
        &self,
        pvc: &PersistentVolumeClaim,
        me: &User,
    ) -> Result<Vec<String>, kube::Error> {
        let name = pvc.metadata.name.as_deref().unwrap_or_default();
        let users = pvc::users(pvc.metadata.annotations.as_ref());
        let modes = access_modes(pvc);
        if pvc::conflict(name, &modes, &users, me).is_none() {
            return Ok(Vec::new());
        }
        let mut gone = Vec::new();
        for u in users.iter().filter(|u| u.uid != me.uid) {
            let Some((ns, vmi)) = u.vmi.split_once('/') else {
                continue;
            };
            let api = Api::<VirtualMachineInstance>::namespaced(self.client.clone(), ns);
            let live = api.get_opt(vmi).await?;
            if live.is_none_or(|v| v.metadata.uid.as_deref() != Some(u.uid.as_str())) {
                gone.push(u.uid.clone());
            }
        }
        Ok(gone)
    }

    pub(super) async fn release_pvc(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(), SourceError> {
        let err = claim_err(namespace, name);
        let api = self.pvcs(namespace);
        let Some(pvc) = api.get_opt(name).await.map_err(&err)? else {
            return Ok(());
        };
        match release_patch(&pvc, uid) {
            None => Ok(()),
            Some(p) => api
                .patch(name, &PatchParams::default(), &Patch::Merge(&p))
                .await
                .map(|_| ())
                .map_err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(extra: &str) -> PersistentVolumeClaim {
        serde_norway::from_str(&format!(
            "metadata: {{name: c, resourceVersion: '7'{extra}}}\nspec: {{accessModes: [ReadWriteOnce]}}"
        ))
        .unwrap()
    }

    fn user(node: &str, uid: &str) -> User {
        User {
            node: node.into(),
            vmi: format!("ns/{uid}"),
            uid: uid.into(),
        }
    }

    #[test]
    fn holding_records_the_user_and_the_finalizer_guarded_by_the_version() {
        let p = hold_patch(&claim(""), &user("a", "1"), &[])
            .unwrap()
            .unwrap();
        assert_eq!(p["metadata"]["resourceVersion"], "7");
        assert_eq!(p["metadata"]["finalizers"], json!([pvc::FINALIZER]));
        let users: Vec<User> = serde_json::from_str(
            p["metadata"]["annotations"][pvc::USERS_ANNOTATION]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(users, [user("a", "1")]);
        // Held already: nothing to write.
        let held = claim(&format!(
            ", finalizers: [{}], annotations: {{'{}': '{}'}}",
            pvc::FINALIZER,
            pvc::USERS_ANNOTATION,
            serde_json::to_string(&[user("a", "1")]).unwrap()
        ));
        assert_eq!(hold_patch(&held, &user("a", "1"), &[]), Ok(None));
        // Another node on a ReadWriteOnce claim: refused, naming it...
        let e = hold_patch(&held, &user("b", "2"), &[]).unwrap_err();
        assert!(e.contains("ns/1") && e.contains("node a"), "{e}");
        // ...unless that VMI is gone (its record was left behind).
        let p = hold_patch(&held, &user("b", "2"), &["1".into()])
            .unwrap()
            .unwrap();
        let users: Vec<User> = serde_json::from_str(
            p["metadata"]["annotations"][pvc::USERS_ANNOTATION]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(users, [user("b", "2")]);
        // Released by the last user: the finalizer goes, others' stay.
        let p = release_patch(&held, "1").unwrap();
        assert_eq!(p["metadata"]["finalizers"], json!([]));
        assert_eq!(
            p["metadata"]["annotations"][pvc::USERS_ANNOTATION],
            Value::Null
        );
        assert_eq!(release_patch(&claim(""), "1"), None);
    }
}
