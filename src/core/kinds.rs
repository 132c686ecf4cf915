//! Every kind of object that makes VMIs, down to the VMI it makes: a VMI
//! is itself; a VirtualMachine's is its template ([`vm::instance`]); a
//! VirtualMachinePool's VMs are its `virtualMachineTemplate`, named
//! `<pool>-<index>` as KubeVirt's pool controller names them; a
//! VirtualMachineInstanceReplicaSet's VMIs are its `template`. Pure: for
//! `kvirtctl domxml` now, and the controllers of pools and replica sets.
//!
//! [`vm::instance`]: crate::core::vm::instance

use crate::core::instancetype::{self, Captured, ObjectKey};
use crate::core::vm::{self, VirtualMachine};
use crate::core::vmi::{self, VirtualMachineInstance};
use serde_json::{json, Value};

use crate::core::pool::{KIND as POOL_KIND, REPLICA_SET_KIND};

const POOL_API_VERSION: &str = "pool.kubevirt.io/v1alpha1";

/// The VMI the object makes first: the pool's VM of index 0, the replica
/// set's first replica (its name as `kvirtctl` shows it: KubeVirt's are
/// generated).
/// `lookup` finds the instancetypes and preferences VMs name.
pub fn first_instance(doc: &Value, lookup: &Lookup<'_>) -> Result<VirtualMachineInstance, String> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    let api = doc.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    match (api, kind) {
        (vmi::API_VERSION, vmi::KIND) => {
            serde_json::from_value(doc.clone()).map_err(|e| format!("invalid VMI: {e}"))
        }
        (vmi::API_VERSION, vm::KIND) => from_vm(doc.clone(), lookup),
        (POOL_API_VERSION | "pool.kubevirt.io/v1beta1", POOL_KIND) => {
            let t = doc
                .pointer("/spec/virtualMachineTemplate")
                .ok_or("spec.virtualMachineTemplate is missing")?;
            let meta = member_meta(doc, t, &format!("{}-0", name_of(doc)?));
            from_vm(
                json!({
                    "apiVersion": vmi::API_VERSION,
                    "kind": vm::KIND,
                    "metadata": meta,
                    "spec": t.get("spec").cloned().unwrap_or_default(),
                }),
                lookup,
            )
        }
        (vmi::API_VERSION, REPLICA_SET_KIND) => {
            let t = doc
                .pointer("/spec/template")
                .ok_or("spec.template is missing")?;
            let meta = member_meta(doc, t, &format!("{}-0", name_of(doc)?));
            serde_json::from_value(json!({
                "apiVersion": vmi::API_VERSION,
                "kind": vmi::KIND,
                "metadata": meta,
                "spec": t.get("spec").cloned().unwrap_or_default(),
            }))
            .map_err(|e| format!("spec.template: {e}"))
        }
        _ => Err(format!(
            "{api:?} {kind:?} is none of the kinds kvirt runs: {} and {} ({}), \
             {POOL_KIND} ({POOL_API_VERSION}), {REPLICA_SET_KIND} ({})",
            vmi::KIND,
            vm::KIND,
            vmi::API_VERSION,
            vmi::API_VERSION
        )),
    }
}

fn name_of(doc: &Value) -> Result<&str, String> {
    doc.pointer("/metadata/name")
        .and_then(Value::as_str)
        .ok_or_else(|| "metadata.name is missing".into())
}

/// A member's metadata: the template's, with the member's name and the
/// owner's namespace.
fn member_meta(owner: &Value, template: &Value, name: &str) -> Value {
    let mut meta = template.get("metadata").cloned().unwrap_or(json!({}));
    if !meta.is_object() {
        meta = json!({});
    }
    meta["name"] = name.into();
    if let Some(ns) = owner.pointer("/metadata/namespace") {
        meta["namespace"] = ns.clone();
    }
    meta
}

/// Finds an instancetype or preference by its key.
pub type Lookup<'a> = dyn Fn(&ObjectKey) -> Option<Value> + 'a;

/// The VM's first run, as kvirtd would make it.
fn from_vm(doc: Value, lookup: &Lookup<'_>) -> Result<VirtualMachineInstance, String> {
    let mut vm = VirtualMachine::from_value(doc).map_err(|e| e.to_string())?;
    vm.strategy()?;
    vm.metadata
        .uid
        .get_or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
    let name = vm.metadata.name.clone().unwrap_or_default();
    let captured = instancetype::settle(&vm.wanted()?, &Captured::default(), &name, lookup);
    vm.expandable(&captured)?;
    vm::instance(&vm, 1, &captured)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(doc: &Value) -> Result<VirtualMachineInstance, String> {
        first_instance(doc, &|_| None)
    }

    fn yaml(s: &str) -> Value {
        serde_norway::from_str(s).unwrap()
    }

    const SPEC: &str =
        "{domain: {memory: {guest: 64Mi}}, volumes: [{name: d, emptyDisk: {capacity: 1Gi}}]}";

    #[test]
    fn each_kind_gives_the_vmi_it_makes() {
        let vmi = first(&yaml(&format!(
            "{{apiVersion: kubevirt.io/v1, kind: VirtualMachineInstance, metadata: {{name: a}}, spec: {SPEC}}}"
        )))
        .unwrap();
        assert_eq!(vmi.metadata.name.as_deref(), Some("a"));

        let vm = first(&yaml(&format!(
            "{{apiVersion: kubevirt.io/v1, kind: VirtualMachine, metadata: {{name: web, namespace: prod}}, \
             spec: {{runStrategy: Always, template: {{metadata: {{labels: {{app: web}}}}, spec: {SPEC}}}}}}}"
        )))
        .unwrap();
        assert_eq!(vm.metadata.name.as_deref(), Some("web"));
        assert_eq!(vm.metadata.labels.unwrap()["app"], "web");
        assert_eq!(vm.spec.volumes[0].name, "d");

        let pool = first(&yaml(&format!(
            "{{apiVersion: pool.kubevirt.io/v1alpha1, kind: VirtualMachinePool, metadata: {{name: p, namespace: ns}}, \
             spec: {{replicas: 3, selector: {{matchLabels: {{k: v}}}}, virtualMachineTemplate: \
             {{metadata: {{labels: {{k: v}}}}, spec: {{runStrategy: Always, template: {{spec: {SPEC}}}}}}}}}}}"
        )))
        .unwrap();
        assert_eq!(pool.metadata.name.as_deref(), Some("p-0"));
        assert_eq!(pool.metadata.namespace.as_deref(), Some("ns"));

        let rs = first(&yaml(&format!(
            "{{apiVersion: kubevirt.io/v1, kind: VirtualMachineInstanceReplicaSet, metadata: {{name: r}}, \
             spec: {{replicas: 2, template: {{metadata: {{labels: {{k: v}}}}, spec: {SPEC}}}}}}}"
        )))
        .unwrap();
        assert_eq!(rs.metadata.name.as_deref(), Some("r-0"));
        assert_eq!(rs.metadata.labels.unwrap()["k"], "v");
    }

    #[test]
    fn other_kinds_and_broken_ones_are_refused_with_the_reason() {
        let e = first(&yaml("{apiVersion: v1, kind: Pod, metadata: {name: p}}")).unwrap_err();
        assert!(e.contains("none of the kinds kvirt runs"), "{e}");
        let e = first(&yaml(
            "{apiVersion: pool.kubevirt.io/v1alpha1, kind: VirtualMachinePool, metadata: {name: p}, spec: {}}",
        ))
        .unwrap_err();
        assert!(e.contains("virtualMachineTemplate"), "{e}");
        let e = first(&yaml(
            "{apiVersion: kubevirt.io/v1, kind: VirtualMachine, metadata: {name: v}, spec: {bogus: 1, template: {spec: {}}}}",
        ))
        .unwrap_err();
        assert!(e.contains("spec.bogus"), "{e}");
    }

    #[test]
    fn a_vm_is_expanded_with_its_instancetype_and_preference() {
        let objects = [
            yaml("{apiVersion: instancetype.kubevirt.io/v1beta1, kind: VirtualMachineClusterInstancetype, \
                  metadata: {name: u1.small, uid: it-uid, generation: 3}, spec: {cpu: {guest: 2}, memory: {guest: 2Gi}}}"),
            yaml("{apiVersion: instancetype.kubevirt.io/v1beta1, kind: VirtualMachinePreference, \
                  metadata: {name: fedora, namespace: prod}, spec: {devices: {preferredDiskBus: virtio}, \
                  requirements: {cpu: {guest: 1}, memory: {guest: 1Gi}}}}"),
        ];
        let lookup = |k: &ObjectKey| {
            objects
                .iter()
                .find(|o| ObjectKey::of_object(o).and_then(Result::ok).as_ref() == Some(k))
                .cloned()
        };
        let vm = |extra: &str| {
            yaml(&format!(
                "{{apiVersion: kubevirt.io/v1, kind: VirtualMachine, metadata: {{name: web, namespace: prod}}, \
                 spec: {{runStrategy: Always, instancetype: {{name: u1.small}}, {extra} \
                 template: {{spec: {{volumes: [{{name: d, emptyDisk: {{capacity: 1Gi}}}}]}}}}}}}}"
            ))
        };
        let v = first_instance(
            &vm("preference: {name: fedora, kind: VirtualMachinePreference},"),
            &lookup,
        )
        .unwrap();
        let cpu = v.spec.domain.cpu.as_ref().unwrap();
        assert_eq!(
            (cpu.sockets, cpu.cores, cpu.threads),
            (Some(2), Some(1), Some(1))
        );
        assert_eq!(
            v.spec
                .domain
                .memory
                .as_ref()
                .unwrap()
                .guest
                .as_ref()
                .unwrap()
                .as_str(),
            "2Gi"
        );
        // The volume's disk, added as virt-controller does, has the preferred bus.
        assert_eq!(
            v.spec.domain.devices.disks[0]
                .disk
                .as_ref()
                .unwrap()
                .bus
                .as_deref(),
            Some("virtio")
        );
        let ann = v.metadata.annotations.unwrap();
        assert_eq!(ann["kubevirt.io/cluster-instancetype-name"], "u1.small");
        assert_eq!(ann["kubevirt.io/preference-name"], "fedora");

        // A missing object is named; so is one of the wrong namespace.
        let e = first_instance(&vm("preference: {name: fedora},"), &lookup).unwrap_err();
        assert_eq!(e, "VirtualMachineClusterPreference fedora not found");
        let e =
            first_instance(&vm("preference: {name: fedora, kind: vmpref},"), &lookup).unwrap_err();
        assert!(e.contains("spec.preference.kind"), "{e}");
    }
}
