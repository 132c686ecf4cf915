//! `VirtualMachineInstanceMigration`s through the API server: each
//! labelled for the host that runs its VMI (`core::migration::route`; the
//! leader labels new ones, `super::routing`), which alone watches and acts
//! on it (see `daemon::vmim`); and the handover of a migrated VMI to its
//! new host, the one write that moves it (its node label, which each
//! host's watch selects by, and `status.nodeName`).

use super::NODE_LABEL;
use crate::core::migration::{
    Migration, MigrationPhase, MigrationState, EVACUATION_ANNOTATION, HOST_LABEL,
    TARGET_NODE_LABEL, VMI_NAME_LABEL,
};
use crate::core::vmi::VirtualMachineInstance;
use crate::sources::Handover;
use futures::future::BoxFuture;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{json, Value};

resource!(
    Migration,
    "VirtualMachineInstanceMigration",
    "kubevirt.io",
    "v1",
    "virtualmachineinstancemigrations"
);

/// The merge patch that hands a migrated VMI to `state.target_node`
/// (pure): its node label and `status.nodeName` moved, the migration's
/// target label gone, `status.migrationState` as it ended. It names the
/// VMI's uid: never another instance of the name.
pub fn handover_patch(vmi: &VirtualMachineInstance, state: &MigrationState) -> Value {
    let mut patch = json!({
        "metadata": {
            "labels": { NODE_LABEL: state.target_node, TARGET_NODE_LABEL: null },
        },
        "status": {
            "nodeName": state.target_node,
            "migrationState": state,
        },
    });
    if let Some(uid) = vmi.metadata.uid.as_deref() {
        patch["metadata"]["uid"] = uid.into();
    }
    patch
}

/// A cluster's VMIs are the API server's: the source hands the VMI over
/// once the target confirmed; the target holds it until its watch lists it.
pub struct KubeHandover {
    pub client: kube::Client,
}

impl Handover for KubeHandover {
    fn standalone(&self) -> bool {
        false
    }

    fn may_let_go(&self, _key: &crate::core::key::VmKey, _vmi_uid: &str) -> Result<(), String> {
        Ok(())
    }

    fn let_go<'a>(
        &'a self,
        vmi: &'a VirtualMachineInstance,
        state: &'a MigrationState,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let key = vmi.key().map_err(|e| e.to_string())?;
            let api: Api<VirtualMachineInstance> =
                Api::namespaced(self.client.clone(), key.namespace());
            let patch = handover_patch(vmi, state);
            api.patch(key.name(), &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(|e| format!("handing VMI {key} to {}: {e}", state.target_node))
        })
    }

    fn take_on(&self, _vmi: &VirtualMachineInstance) -> Result<bool, String> {
        Ok(false)
    }
}

/// The migration objects, for the host that acts on them.
#[derive(Clone)]
pub struct KubeMigrations {
    pub client: kube::Client,
}

impl KubeMigrations {
    fn api(&self, m: &Migration) -> Api<Migration> {
        let ns = m.metadata.namespace.as_deref().unwrap_or("default");
        Api::namespaced(self.client.clone(), ns)
    }

    /// The migration objects of the cluster (watched by a label).
    pub fn all(&self) -> Api<Migration> {
        Api::all(self.client.clone())
    }

    /// Labels `m` for `node` (`core::migration::Route::Host`) if it is
    /// still as it was read; `Ok(false)`: another write came first.
    pub async fn route(&self, m: &Migration, node: &str) -> Result<bool, String> {
        self.report_if_unchanged(
            m,
            &json!({ "metadata": { "labels": { HOST_LABEL: node } } }),
        )
        .await
    }

    /// Fails `m` with `reason` (`core::migration::Route::Fail`) if it is
    /// still as it was read; `Ok(false)`: another write came first.
    pub async fn fail(&self, m: &Migration, reason: &str) -> Result<bool, String> {
        let uid = m.metadata.uid.as_deref().unwrap_or_default();
        let at = crate::sources::now_rfc3339();
        let state = MigrationState::started(uid, "", &at).ended(&at, Err(reason));
        let patch = phase_patch(&m.spec.vmi_name, MigrationPhase::Failed, Some(&state));
        self.report_if_unchanged(m, &patch).await
    }

    /// Writes the migration's phase (and `migrationState`, labels) by merge
    /// patch, guarded by its uid.
    pub async fn report(&self, m: &Migration, patch: &Value) -> Result<(), String> {
        self.patch(m, patch.clone()).await.map_err(|e| {
            let name = m.metadata.name.as_deref().unwrap_or_default();
            format!("writing migration {name}: {e}")
        })
    }

    /// The merge patch `patch` of `m`, guarded by its uid.
    async fn patch(&self, m: &Migration, mut patch: Value) -> Result<(), kube::Error> {
        let name = m.metadata.name.as_deref().unwrap_or_default();
        if let Some(uid) = m.metadata.uid.as_deref() {
            patch["metadata"]["uid"] = uid.into();
        }
        self.api(m)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(|_| ())
    }

    /// A migration of the VMI `key`, as virt-api makes one for `virtctl
    /// migrate`, or (`evacuating` a node) as KubeVirt's evacuation
    /// controller does for a drain, labelled for `host` (its VMI's, when
    /// the caller read it); its name.
    pub async fn create(
        &self,
        key: &crate::core::key::VmKey,
        added_node_selector: std::collections::BTreeMap<String, String>,
        evacuating: Option<&str>,
        host: Option<&str>,
    ) -> Result<String, kube::Error> {
        let api: Api<Migration> = Api::namespaced(self.client.clone(), key.namespace());
        let mut m = Migration::default();
        let prefix = match evacuating {
            Some(node) => {
                let why = [(EVACUATION_ANNOTATION.to_string(), node.to_string())];
                m.metadata.annotations = Some(why.into());
                "kubevirt-evacuation-"
            }
            None => "kubevirt-migrate-vm-",
        };
        m.metadata.generate_name = Some(prefix.into());
        m.metadata.namespace = Some(key.namespace().into());
        let mut labels = std::collections::BTreeMap::from([(
            VMI_NAME_LABEL.to_string(),
            key.name().to_string(),
        )]);
        if let Some(h) = host {
            labels.insert(HOST_LABEL.to_string(), h.to_string());
        }
        m.metadata.labels = Some(labels);
        m.spec.vmi_name = key.name().into();
        m.spec.added_node_selector = added_node_selector;
        m.api_version = "kubevirt.io/v1".into();
        m.kind = "VirtualMachineInstanceMigration".into();
        let made = api.create(&kube::api::PostParams::default(), &m).await?;
        Ok(made.metadata.name.unwrap_or_default())
    }

    /// Writes `patch` (as [`Self::report`]) only if `m` is still as it was
    /// read (its resourceVersion): of several hosts deciding alike, one
    /// writes. `Ok(false)`: another write came first.
    pub async fn report_if_unchanged(&self, m: &Migration, patch: &Value) -> Result<bool, String> {
        let mut patch = patch.clone();
        if let Some(v) = m.metadata.resource_version.as_deref() {
            patch["metadata"]["resourceVersion"] = v.into();
        }
        match self.patch(m, patch).await {
            Ok(()) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => {
                let name = m.metadata.name.as_deref().unwrap_or_default();
                Err(format!("writing migration {name}: {e}"))
            }
        }
    }

    /// The VMI `key`, if it exists.
    pub async fn vmi(
        &self,
        key: &crate::core::key::VmKey,
    ) -> Result<Option<VirtualMachineInstance>, String> {
        let api: Api<VirtualMachineInstance> =
            Api::namespaced(self.client.clone(), key.namespace());
        api.get_opt(key.name())
            .await
            .map_err(|e| format!("reading VMI {key}: {e}"))
    }

    /// The migration object `name` of `namespace`, if there is one.
    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<Migration>, String> {
        let api: Api<Migration> = Api::namespaced(self.client.clone(), namespace);
        api.get_opt(name)
            .await
            .map_err(|e| format!("reading migration {namespace}/{name}: {e}"))
    }

    /// The kvirt hosts whose Leases are current.
    pub async fn peers(&self) -> Result<Vec<crate::core::peers::Peer>, String> {
        super::lease::peers(&self.client)
            .await
            .map_err(|e| format!("listing kvirt hosts' leases: {e}"))
    }
}

/// A migration's phase patch (pure): the phase, the state when known, and
/// the labels virtctl and UIs find it by.
pub fn phase_patch(vmi_name: &str, phase: MigrationPhase, state: Option<&MigrationState>) -> Value {
    let mut patch = json!({
        "metadata": { "labels": { VMI_NAME_LABEL: vmi_name } },
        "status": { "phase": phase },
    });
    if let Some(s) = state {
        patch["status"]["migrationState"] = json!(s);
        if !s.target_node.is_empty() {
            patch["metadata"]["labels"][TARGET_NODE_LABEL] = s.target_node.clone().into();
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handover_moves_the_node_and_names_the_instance() {
        let vmi: VirtualMachineInstance = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "v", "namespace": "default", "uid": "u1",
                         "labels": {NODE_LABEL: "node-a"}},
        }))
        .unwrap();
        let mut state = MigrationState::started("m1", "node-a", "2026-01-01T00:00:00Z");
        state.target_node = "node-b".into();
        let state = state.ended("2026-01-01T00:00:05Z", Ok(()));
        let p = handover_patch(&vmi, &state);
        assert_eq!(p["metadata"]["labels"][NODE_LABEL], "node-b");
        assert!(p["metadata"]["labels"][TARGET_NODE_LABEL].is_null());
        assert_eq!(p["metadata"]["uid"], "u1");
        assert_eq!(p["status"]["nodeName"], "node-b");
        assert_eq!(p["status"]["migrationState"]["completed"], true);
        assert_eq!(p["status"]["migrationState"]["sourceNode"], "node-a");
    }

    #[test]
    fn a_phase_patch_labels_the_migration_for_virtctl() {
        let p = phase_patch("v", MigrationPhase::Scheduling, None);
        assert_eq!(p["metadata"]["labels"][VMI_NAME_LABEL], "v");
        assert_eq!(p["status"]["phase"], "Scheduling");
        let mut s = MigrationState::started("m1", "node-a", "2026-01-01T00:00:00Z");
        s.target_node = "node-b".into();
        let p = phase_patch("v", MigrationPhase::Scheduled, Some(&s));
        assert_eq!(p["metadata"]["labels"][TARGET_NODE_LABEL], "node-b");
        assert_eq!(p["status"]["migrationState"]["targetNode"], "node-b");
    }
}
