//! `VirtualMachinePool` (`pool.kubevirt.io`), as KubeVirt's pool
//! controller keeps one: `replicas` VirtualMachines from its
//! `virtualMachineTemplate`, named `<pool>-<index>` with the lowest free
//! indexes, owned by the pool; scaling in removes the highest indexes
//! first. Pure: which VMs a pool wants, and what to create or remove.

use crate::core::scheduling;
use crate::core::vm::{self, VirtualMachine};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeSet;

pub const GROUP: &str = "pool.kubevirt.io";
pub const KIND: &str = "VirtualMachinePool";
/// The versions KubeVirt serves; the first is what kvirt writes.
pub const API_VERSIONS: [&str; 2] = ["pool.kubevirt.io/v1beta1", "pool.kubevirt.io/v1alpha1"];
/// A pool's size is bounded: a typo must not make a million VMs.
pub const MAX_REPLICAS: u32 = 1000;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PoolSpec,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub status: Value,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_machine_template: Option<VmTemplate>,
    #[serde(default)]
    pub paused: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct VmTemplate {
    #[serde(default)]
    pub metadata: Option<ObjectMeta>,
    #[serde(default)]
    pub spec: Value,
}

impl Pool {
    pub fn from_value(v: Value) -> Result<Pool, String> {
        let p: Pool = serde_json::from_value(v).map_err(|e| format!("invalid {KIND}: {e}"))?;
        if p.kind != KIND || !API_VERSIONS.contains(&p.api_version.as_str()) {
            return Err(format!(
                "expected {KIND} of {}, got {:?} {:?}",
                API_VERSIONS.join(" or "),
                p.api_version,
                p.kind
            ));
        }
        Ok(p)
    }

    /// How many VMs it wants, or why it cannot be followed. Fields kvirt
    /// does not implement are refused by name, never dropped.
    pub fn replicas(&self) -> Result<u32, String> {
        let t = self.spec.virtual_machine_template.as_ref();
        checked_replicas(
            &self.metadata,
            &self.spec.extra,
            self.spec.selector.as_ref(),
            t.map(|t| t.metadata.as_ref()),
            "spec.virtualMachineTemplate",
            self.spec.replicas,
        )
    }

    /// Its VM of index `i`: the template, named `<pool>-<i>`, owned by the
    /// pool.
    pub fn member(&self, i: u32) -> Result<VirtualMachine, String> {
        let t = self
            .spec
            .virtual_machine_template
            .as_ref()
            .ok_or("spec.virtualMachineTemplate is missing")?;
        let meta = member_meta(
            &self.metadata,
            &self.api_version,
            KIND,
            t.metadata.as_ref(),
            i,
        );
        let doc = serde_json::json!({
            "apiVersion": crate::core::vmi::API_VERSION,
            "kind": vm::KIND,
            "metadata": meta,
            "spec": t.spec,
        });
        VirtualMachine::from_value(doc).map_err(|e| format!("spec.virtualMachineTemplate: {e}"))
    }
}

/// The count a pool or replica set wants, checked as KubeVirt's webhooks
/// check it: a name, no field kvirt lacks, a template whose labels the
/// selector matches, a bounded count (default 1).
pub(crate) fn checked_replicas(
    meta: &ObjectMeta,
    extra: &Map<String, Value>,
    selector: Option<&LabelSelector>,
    template: Option<Option<&ObjectMeta>>,
    template_field: &str,
    replicas: Option<i64>,
) -> Result<u32, String> {
    if meta.name.as_deref().unwrap_or("").is_empty() {
        return Err("metadata.name is missing".into());
    }
    if let Some(k) = extra.keys().next() {
        return Err(format!("spec.{k} is not supported by kvirt"));
    }
    let t = template.ok_or_else(|| format!("{template_field} is missing"))?;
    let labels = t.and_then(|m| m.labels.clone()).unwrap_or_default();
    // As a VirtualMachine's: placement is the scheduler's (or a claiming
    // host's), never the template's.
    if labels.contains_key(crate::core::vmi::NODE_LABEL) {
        return Err(format!(
            "{template_field}.metadata.labels[{}]: members may not choose their node; \
             use nodeSelector or affinity",
            crate::core::vmi::NODE_LABEL
        ));
    }
    let selector = selector.ok_or("spec.selector is missing")?;
    if !scheduling::label_selector_matches(selector, &labels) {
        return Err(format!(
            "spec.selector does not match the labels of {template_field}"
        ));
    }
    let n = replicas.unwrap_or(1);
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_REPLICAS)
        .ok_or_else(|| format!("spec.replicas: {n} is not 0 to {MAX_REPLICAS}"))
}

/// A member's metadata: the template's, named `<owner>-<i>` in the
/// owner's namespace, controlled by the owner.
pub(crate) fn member_meta(
    owner: &ObjectMeta,
    api_version: &str,
    kind: &str,
    template: Option<&ObjectMeta>,
    i: u32,
) -> ObjectMeta {
    let name = owner.name.as_deref().unwrap_or("");
    let mut meta = template.cloned().unwrap_or_default();
    meta.name = Some(format!("{name}-{i}"));
    meta.namespace = owner.namespace.clone();
    meta.uid = None;
    meta.owner_references = owner.uid.as_ref().map(|uid| {
        vec![OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.to_owned(),
            uid: uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]
    });
    meta
}

/// The index of a member's name, `<pool>-<index>`.
pub fn index_of(pool: &str, vm: &str) -> Option<u32> {
    let rest = vm.strip_prefix(pool)?.strip_prefix('-')?;
    (!rest.starts_with('0') || rest == "0")
        .then(|| rest.parse().ok())
        .flatten()
}

/// What brings the `active` members (by index) to `want`: the lowest
/// indexes no member holds (`taken` counts those going too) to create, or
/// the highest active ones to remove.
pub fn scale(active: &BTreeSet<u32>, taken: &BTreeSet<u32>, want: u32) -> (Vec<u32>, Vec<u32>) {
    let n = active.len() as u32;
    if n < want {
        let create = (0..)
            .filter(|i| !taken.contains(i))
            .take((want - n) as usize);
        (create.collect(), Vec::new())
    } else {
        let remove = active.iter().rev().take((n - want) as usize).copied();
        (Vec::new(), remove.collect())
    }
}

/// A standalone pool's VMs: indexes `0..replicas`.
pub fn members(pool: &Pool) -> Result<Vec<VirtualMachine>, String> {
    (0..pool.replicas()?).map(|i| pool.member(i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(replicas: i64, extra: &str) -> Pool {
        Pool::from_value(
            serde_norway::from_str(&format!(
                "{{apiVersion: pool.kubevirt.io/v1alpha1, kind: VirtualMachinePool, \
                 metadata: {{name: web, namespace: ns, uid: pool-uid}}, spec: {{replicas: {replicas}, \
                 selector: {{matchLabels: {{app: web}}}}, {extra} virtualMachineTemplate: \
                 {{metadata: {{labels: {{app: web}}}}, spec: {{runStrategy: Always, template: \
                 {{spec: {{domain: {{memory: {{guest: 64Mi}}}}}}}}}}}}}}}}"
            ))
            .unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn a_pools_vms_are_its_template_named_by_index_and_owned_by_it() {
        let vms = members(&pool(3, "")).unwrap();
        let names: Vec<_> = vms
            .iter()
            .map(|v| v.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["web-0", "web-1", "web-2"]);
        let v = &vms[1];
        assert_eq!(v.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(v.metadata.labels.as_ref().unwrap()["app"], "web");
        let o = &v.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (o.kind.as_str(), o.uid.as_str()),
            ("VirtualMachinePool", "pool-uid")
        );
        assert_eq!(v.spec.run_strategy.as_deref(), Some("Always"));
        assert!(members(&pool(0, "")).unwrap().is_empty());
    }

    #[test]
    fn scaling_fills_the_lowest_gaps_and_removes_the_highest_first() {
        let have: BTreeSet<u32> = [0, 2, 5].into();
        assert_eq!(scale(&have, &have, 5), (vec![1, 3], vec![]));
        assert_eq!(scale(&have, &have, 1), (vec![], vec![5, 2]));
        assert_eq!(scale(&have, &have, 3), (vec![], vec![]));
        // A member going (or ended) keeps its name until gone.
        let taken: BTreeSet<u32> = [0, 1, 2, 5].into();
        assert_eq!(scale(&have, &taken, 5), (vec![3, 4], vec![]));
        assert_eq!(index_of("web", "web-12"), Some(12));
        assert_eq!(index_of("web", "web-01"), None);
        assert_eq!(index_of("web", "webby-1"), None);
        assert_eq!(index_of("web", "web-x"), None);
    }

    #[test]
    fn what_a_pool_cannot_be_is_refused_by_name() {
        assert!(pool(2, "autohealing: {},")
            .replicas()
            .unwrap_err()
            .contains("spec.autohealing"));
        assert!(pool(-1, "")
            .replicas()
            .unwrap_err()
            .contains("spec.replicas"));
        assert!(pool(5000, "").replicas().is_err());
        let mut p = pool(1, "");
        p.spec.selector =
            serde_json::from_value(serde_json::json!({"matchLabels": {"app": "db"}})).unwrap();
        assert!(p.replicas().unwrap_err().contains("does not match"));
        assert!(Pool::from_value(
            serde_json::json!({"apiVersion": "pool.kubevirt.io/v9", "kind": "VirtualMachinePool"})
        )
        .is_err());
    }
}

/// `VirtualMachineInstanceReplicaSet` (`kubevirt.io/v1`): `replicas` VMIs
/// from its `template`; an ended one is replaced. KubeVirt names them
/// with a random suffix (`generateName`); kvirt names them `<rs>-<index>`
/// as a pool's, so that kvirtds racing to make one make it once.
pub const REPLICA_SET_KIND: &str = "VirtualMachineInstanceReplicaSet";

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSet {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: ReplicaSetSpec,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub status: Value,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplicaSetSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<VmTemplate>,
    #[serde(default)]
    pub paused: bool,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ReplicaSet {
    pub fn replicas(&self) -> Result<u32, String> {
        let t = self.spec.template.as_ref();
        checked_replicas(
            &self.metadata,
            &self.spec.extra,
            self.spec.selector.as_ref(),
            t.map(|t| t.metadata.as_ref()),
            "spec.template",
            self.spec.replicas,
        )
    }

    /// Its VMI of index `i`.
    pub fn member(&self, i: u32) -> Result<crate::core::vmi::VirtualMachineInstance, String> {
        let t = self
            .spec
            .template
            .as_ref()
            .ok_or("spec.template is missing")?;
        let meta = member_meta(
            &self.metadata,
            crate::core::vmi::API_VERSION,
            REPLICA_SET_KIND,
            t.metadata.as_ref(),
            i,
        );
        serde_json::from_value(serde_json::json!({
            "apiVersion": crate::core::vmi::API_VERSION,
            "kind": crate::core::vmi::KIND,
            "metadata": meta,
            "spec": t.spec,
        }))
        .map_err(|e| format!("spec.template: {e}"))
    }
}

impl ReplicaSet {
    pub fn from_value(v: Value) -> Result<ReplicaSet, String> {
        let rs: ReplicaSet =
            serde_json::from_value(v).map_err(|e| format!("invalid {REPLICA_SET_KIND}: {e}"))?;
        if rs.kind != REPLICA_SET_KIND || rs.api_version != crate::core::vmi::API_VERSION {
            return Err(format!(
                "expected {REPLICA_SET_KIND} of {}, got {:?} {:?}",
                crate::core::vmi::API_VERSION,
                rs.api_version,
                rs.kind
            ));
        }
        Ok(rs)
    }

    /// Standalone, where no controller makes new VMIs: its replica of
    /// index `i` as a VM with `runStrategy: Always` named as that VMI
    /// (`<rs>-<i>`), whose VMI is the template and which starts a new one
    /// when one ends, as the replica set replaces it.
    pub fn standalone_member(&self, i: u32) -> Result<VirtualMachine, String> {
        let vmi = self.member(i)?;
        let t = self
            .spec
            .template
            .as_ref()
            .ok_or("spec.template is missing")?;
        let doc = serde_json::json!({
            "apiVersion": crate::core::vmi::API_VERSION,
            "kind": vm::KIND,
            "metadata": vmi.metadata,
            "spec": {
                "runStrategy": "Always",
                "template": {"metadata": t.metadata, "spec": t.spec},
            },
        });
        VirtualMachine::from_value(doc).map_err(|e| format!("spec.template: {e}"))
    }

    pub fn standalone_members(&self) -> Result<Vec<VirtualMachine>, String> {
        (0..self.replicas()?)
            .map(|i| self.standalone_member(i))
            .collect()
    }
}

#[cfg(test)]
mod replica_set_tests {
    use super::*;

    /// A replica set `r` of 2 VMIs labelled `k: v`.
    fn two() -> Value {
        serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": REPLICA_SET_KIND,
            "metadata": {"name": "r", "namespace": "ns", "uid": "rs-u"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"k": "v"}},
                     "template": {"metadata": {"labels": {"k": "v"}},
                                  "spec": {"domain": {"memory": {"guest": "64Mi"}}}}},
        })
    }

    #[test]
    fn standalone_a_replica_set_is_vms_that_always_run_its_template() {
        let rs = ReplicaSet::from_value(two()).unwrap();
        let vms = rs.standalone_members().unwrap();
        assert_eq!(vms.len(), 2);
        let v = serde_json::to_value(&vms[1]).unwrap();
        assert_eq!(v["metadata"]["name"], "r-1");
        assert_eq!(
            v["metadata"]["ownerReferences"][0]["kind"],
            REPLICA_SET_KIND
        );
        assert_eq!(v["spec"]["runStrategy"], "Always");
        assert_eq!(v["spec"]["template"]["metadata"]["labels"]["k"], "v");
        assert_eq!(
            v["spec"]["template"]["spec"]["domain"]["memory"]["guest"],
            "64Mi"
        );
        assert!(
            ReplicaSet::from_value(serde_json::json!({"apiVersion": "v1", "kind": "Pod"})).is_err()
        );
    }

    #[test]
    fn a_replica_sets_vmis_are_its_template_named_by_index() {
        let rs: ReplicaSet = serde_json::from_value(two()).unwrap();
        assert_eq!(rs.replicas(), Ok(2));
        let v = rs.member(1).unwrap();
        assert_eq!(v.metadata.name.as_deref(), Some("r-1"));
        let o = &v.metadata.owner_references.unwrap()[0];
        assert_eq!(
            (o.kind.as_str(), o.uid.as_str()),
            (REPLICA_SET_KIND, "rs-u")
        );
        let mut bad = rs.clone();
        bad.spec.template = None;
        assert_eq!(bad.replicas().unwrap_err(), "spec.template is missing");
        // Members may not name their node, as a VirtualMachine's VMI may not.
        let mut pinned = two();
        pinned["spec"]["template"]["metadata"]["labels"]["kubevirt.io/nodeName"] = "n1".into();
        let pinned: ReplicaSet = serde_json::from_value(pinned).unwrap();
        assert!(pinned
            .replicas()
            .unwrap_err()
            .contains("may not choose their node"));
    }
}
