//! Status and finalizers on the VMI object, by merge patch.

use super::{api_err, ClusterError, FINALIZER, KUBEVIRT_FINALIZER};
use crate::core::key::VmKey;
use crate::core::objects::{ObjectData, ObjectRef};
use crate::core::pvc::{DataVolume, User};
use crate::core::quota::{self, Claim, Hard};
use crate::core::vmi::VirtualMachineInstance;
use crate::sources::{ClaimObjects, SourceError, StatusStore};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, ResourceQuota, Secret, ServiceAccount};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{json, Map, Value};

/// The status fields kvirtd owns; everything else in `status` is someone
/// else's and is never written.
const OWNED: &[&str] = &[
    "phase",
    "nodeName",
    "reason",
    "phaseTransitionTimestamps",
    "conditions",
    "interfaces",
    "qosClass",
    "machine",
    "guestOSInfo",
    "volumeStatus",
    "migrationState",
];

/// The merge patch that writes kvirtd's part of the status (pure). It
/// names the object's uid, as kubelet's pod status patches do: the API
/// server refuses it for another object of the same name (the VMI deleted
/// and made anew while this status was on its way).
pub fn status_patch(vmi: &VirtualMachineInstance) -> Value {
    let status = serde_json::to_value(&vmi.status).unwrap_or_default();
    let owned: Map<String, Value> = OWNED
        .iter()
        .filter_map(|k| status.get(*k).map(|v| ((*k).to_owned(), v.clone())))
        .collect();
    let mut patch = json!({ "status": owned });
    if let Some(uid) = vmi.metadata.uid.as_deref() {
        patch["metadata"]["uid"] = uid.into();
    }
    // Multus's network-status, which kvirt writes as Multus would on a pod.
    let key = crate::core::cni::NETWORK_STATUS_ANNOTATION;
    if let Some(ns) = vmi.metadata.annotations.as_ref().and_then(|a| a.get(key)) {
        patch["metadata"]["annotations"][key] = ns.clone().into();
    }
    patch
}

/// The API server's answer to a patch whose uid is not the object's: a
/// conflict (or, from some versions, an immutable-field error naming it).
fn is_uid_mismatch(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => {
            s.code == 409 && s.message.contains("UID")
                || s.code == 422 && s.message.contains("metadata.uid")
        }
        _ => false,
    }
}

/// The finalizer list with ours added, or `None` when it is there already.
pub fn with_finalizer(finalizers: &[String]) -> Option<Vec<String>> {
    (!finalizers.iter().any(|f| f == FINALIZER)).then(|| {
        let mut f = finalizers.to_vec();
        f.push(FINALIZER.into());
        f
    })
}

/// The finalizer list without ours and KubeVirt's foreground one, or `None`
/// when neither is there.
pub fn without_finalizers(finalizers: &[String]) -> Option<Vec<String>> {
    let kept: Vec<String> = finalizers
        .iter()
        .filter(|f| *f != FINALIZER && *f != KUBEVIRT_FINALIZER)
        .cloned()
        .collect();
    (kept.len() != finalizers.len()).then_some(kept)
}

#[derive(Clone)]
pub struct KubeStatus {
    pub client: kube::Client,
    /// The cluster's CA (PEM), the `ca.crt` of serviceAccount disks.
    pub ca_pem: Option<Vec<u8>>,
    /// What serviceAccount disks' tokens are asked for.
    pub token: TokenSpec,
}

/// A serviceAccount disk's token: bound to no object (a VMI cannot be
/// one), so short-lived and renewed while the VM runs (see
/// `daemon::controller::tokens`); the API server may cap it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenSpec {
    pub seconds: i64,
    /// None: the API server's own, as a pod's default token.
    pub audiences: Vec<String>,
}

impl Default for TokenSpec {
    fn default() -> Self {
        Self {
            seconds: 3600,
            audiences: Vec::new(),
        }
    }
}

impl KubeStatus {
    fn api(&self, vmi: &VirtualMachineInstance) -> Api<VirtualMachineInstance> {
        let ns = vmi.metadata.namespace.as_deref().unwrap_or("default");
        Api::namespaced(self.client.clone(), ns)
    }

    /// Rewrites the finalizer list of the live object, guarded by its
    /// resourceVersion so a concurrent change is never overwritten.
    async fn edit_finalizers(
        &self,
        vmi: &VirtualMachineInstance,
        edit: fn(&[String]) -> Option<Vec<String>>,
    ) -> Result<(), ClusterError> {
        let api = self.api(vmi);
        let name = vmi.metadata.name.clone().unwrap_or_default();
        let live = match api.get_opt(&name).await.map_err(api_err(vmi, "get"))? {
            // Gone, or a new object of the same name: nothing of ours to edit.
            None => return Ok(()),
            Some(l) if l.uid() != vmi.uid() => return Ok(()),
            Some(l) => l,
        };
        let Some(finalizers) = edit(live.metadata.finalizers.as_deref().unwrap_or_default()) else {
            return Ok(());
        };
        let patch = json!({
            "metadata": {
                "resourceVersion": live.metadata.resource_version,
                "finalizers": finalizers,
            }
        });
        api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_err(vmi, "patch finalizers"))?;
        Ok(())
    }
}

fn source_err(e: ClusterError) -> SourceError {
    SourceError::Manifest {
        path: "kube-apiserver".into(),
        message: e.to_string(),
    }
}

impl StatusStore for KubeStatus {
    /// The object's own status is the record; nothing is kept aside.
    async fn load(&self, _key: &VmKey) -> Option<VirtualMachineInstance> {
        None
    }

    async fn save(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        let name = vmi.metadata.name.clone().unwrap_or_default();
        match self
            .api(vmi)
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(status_patch(vmi)),
            )
            .await
        {
            Ok(_) => Ok(()),
            // Another object of that name now: this status was never its.
            Err(e) if is_uid_mismatch(&e) => {
                tracing::debug!("status not written: {name} was replaced: {e}");
                Ok(())
            }
            Err(e) => Err(source_err(api_err(vmi, "patch status")(e))),
        }
    }

    async fn hold(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        if vmi
            .metadata
            .finalizers
            .as_ref()
            .is_some_and(|f| f.iter().any(|x| x == FINALIZER))
        {
            return Ok(());
        }
        self.edit_finalizers(vmi, with_finalizer)
            .await
            .map_err(source_err)
    }

    async fn release(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        self.edit_finalizers(vmi, without_finalizers)
            .await
            .map_err(source_err)
    }

    async fn object(
        &self,
        namespace: &str,
        object: &ObjectRef,
    ) -> Result<Option<ObjectData>, SourceError> {
        let err = |e: kube::Error| match e {
            // Access is granted per namespace (a RoleBinding an
            // administrator makes), as the Node authorizer confines kubelet.
            kube::Error::Api(s) if s.code == 403 => SourceError::NotOptedIn {
                namespace: namespace.into(),
                object: object.clone(),
            },
            e => SourceError::Object {
                namespace: namespace.into(),
                object: object.clone(),
                message: e.to_string(),
            },
        };
        let client = self.client.clone();
        Ok(match object {
            ObjectRef::Secret(name) => Api::<Secret>::namespaced(client, namespace)
                .get_opt(name)
                .await
                .map_err(err)?
                .map(|s| {
                    s.data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| (k, v.0))
                        .collect()
                }),
            ObjectRef::ConfigMap(name) => Api::<ConfigMap>::namespaced(client, namespace)
                .get_opt(name)
                .await
                .map_err(err)?
                .map(|c| {
                    let text = c.data.unwrap_or_default().into_iter();
                    let binary = c.binary_data.unwrap_or_default().into_iter();
                    text.map(|(k, v)| (k, v.into_bytes()))
                        .chain(binary.map(|(k, v)| (k, v.0)))
                        .collect()
                }),
            ObjectRef::NetworkAttachmentDefinition(name) => {
                let api: Api<kube::api::DynamicObject> =
                    Api::namespaced_with(client, namespace, &nad_resource());
                api.get_opt(name).await.map_err(err)?.map(|o| {
                    crate::core::objects::nad_data(&serde_json::to_value(&o).unwrap_or_default())
                })
            }
            ObjectRef::ServiceAccountToken(name) => {
                let request = TokenRequest {
                    spec: TokenRequestSpec {
                        audiences: self.token.audiences.clone(),
                        expiration_seconds: Some(self.token.seconds),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let api = Api::<ServiceAccount>::namespaced(client, namespace);
                match api
                    .create_token_request(name, &Default::default(), &request)
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 404 => None,
                    Err(e) => return Err(err(e)),
                    Ok(t) => {
                        let token = t.status.map(|s| s.token).unwrap_or_default();
                        let mut files = ObjectData::from([
                            ("token".to_string(), token.into_bytes()),
                            ("namespace".to_string(), namespace.as_bytes().to_vec()),
                        ]);
                        if let Some(ca) = &self.ca_pem {
                            files.insert("ca.crt".into(), ca.clone());
                        }
                        Some(files)
                    }
                }
            }
        })
    }

    async fn allowance(&self, namespace: &str) -> Result<(Vec<Hard>, Vec<Claim>), SourceError> {
        let err = |e: kube::Error| SourceError::Allowance {
            namespace: namespace.into(),
            message: e.to_string(),
        };
        let all = kube::api::ListParams::default();
        let quotas = Api::<ResourceQuota>::namespaced(self.client.clone(), namespace)
            .list(&all)
            .await
            .map_err(err)?;
        let bounds = quota::bounds(quotas.items.into_iter().map(|q| {
            let hard = q.spec.and_then(|s| s.hard).unwrap_or_default();
            let hard = hard.into_iter().map(|(k, v)| (k, v.0)).collect();
            (q.metadata.name.unwrap_or_default(), hard)
        }));
        if bounds.is_empty() {
            // No quota of the kind: the VMIs need not be listed.
            return Ok((bounds, Vec::new()));
        }
        let vmis = Api::<VirtualMachineInstance>::namespaced(self.client.clone(), namespace)
            .list(&all)
            .await
            .map_err(err)?;
        let claims = vmis
            .items
            .iter()
            .filter_map(|v| quota::claim_of(v, FINALIZER))
            .collect();
        Ok((bounds, claims))
    }

    async fn claim(&self, namespace: &str, name: &str) -> Result<ClaimObjects, SourceError> {
        self.read_claim(namespace, name).await
    }

    async fn data_volume(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<DataVolume>, SourceError> {
        self.read_data_volume(namespace, name).await
    }

    async fn select_node(
        &self,
        namespace: &str,
        name: &str,
        node: &str,
    ) -> Result<(), SourceError> {
        self.set_selected_node(namespace, name, node).await
    }

    async fn hold_claim(
        &self,
        namespace: &str,
        name: &str,
        user: &User,
    ) -> Result<Result<(), String>, SourceError> {
        self.hold_pvc(namespace, name, user).await
    }

    async fn release_claim(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<(), SourceError> {
        self.release_pvc(namespace, name, uid).await
    }

    async fn virtual_machine_exists(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> Result<bool, SourceError> {
        let gvk = GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine");
        let resource = ApiResource::from_gvk_with_plural(&gvk, "virtualmachines");
        let api = Api::<DynamicObject>::namespaced_with(self.client.clone(), namespace, &resource);
        // 404 also when the VirtualMachine kind itself is gone: so are its VMs.
        let vm = api
            .get_opt(name)
            .await
            .map_err(|e| SourceError::VirtualMachine {
                namespace: namespace.into(),
                name: name.into(),
                message: e.to_string(),
            })?;
        Ok(vm.is_some_and(|vm| {
            vm.metadata.uid.as_deref() == Some(uid) && vm.metadata.deletion_timestamp.is_none()
        }))
    }
}

/// Multus's `NetworkAttachmentDefinition` (`k8s.cni.cncf.io/v1`).
fn nad_resource() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "k8s.cni.cncf.io".into(),
        version: "v1".into(),
        api_version: "k8s.cni.cncf.io/v1".into(),
        kind: "NetworkAttachmentDefinition".into(),
        plural: "network-attachment-definitions".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::vmi::Phase;

    #[test]
    fn the_patch_carries_only_owned_fields() {
        let mut vmi = VirtualMachineInstance::from_yaml(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\nspec: {domain: {devices: {}}}\nstatus: {activePods: {x: 1}}\n",
        )
        .unwrap();
        vmi.status.phase = Some(Phase::Running);
        vmi.status.node_name = Some("n1".into());
        let p = status_patch(&vmi);
        assert_eq!(p["status"]["phase"], "Running");
        assert_eq!(p["status"]["nodeName"], "n1");
        assert!(p["status"].get("activePods").is_none(), "{p}");
        assert!(p.get("spec").is_none() && p.get("metadata").is_none());
        vmi.metadata.uid = Some("u-1".into());
        assert_eq!(status_patch(&vmi)["metadata"], json!({"uid": "u-1"}));
        // Of the annotations, only Multus's network-status, kvirt's to write.
        vmi.metadata.annotations = Some(
            [
                ("k8s.v1.cni.cncf.io/network-status".into(), "[]".into()),
                ("user".into(), "x".into()),
            ]
            .into(),
        );
        assert_eq!(
            status_patch(&vmi)["metadata"],
            json!({"uid": "u-1", "annotations": {"k8s.v1.cni.cncf.io/network-status": "[]"}})
        );
    }

    #[test]
    fn finalizers_are_added_once_and_removed_with_kubevirts() {
        assert_eq!(with_finalizer(&[]), Some(vec![FINALIZER.to_string()]));
        assert_eq!(with_finalizer(&[FINALIZER.into()]), None);
        let both = vec![
            "other".to_string(),
            FINALIZER.into(),
            KUBEVIRT_FINALIZER.into(),
        ];
        assert_eq!(without_finalizers(&both), Some(vec!["other".to_string()]));
        assert_eq!(without_finalizers(&["other".to_string()]), None);
    }
}
