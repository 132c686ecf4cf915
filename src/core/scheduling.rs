//! Whether a VMI fits this host, as kube-scheduler would decide for its
//! pod: `nodeSelector`, required node affinity, tolerations of the host's
//! taints, and a `schedulerName` that is kvirt's. Used by claim mode: a
//! VMI that does not fit is left for another host. Pure.

use crate::core::vmi::VirtualMachineInstance;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// A taint of this host (`[kubernetes] node_taints`), as a Node's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// What this host offers to the VMIs it may claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    pub node_name: String,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    /// The scheduler name kvirt answers to (besides `default-scheduler`).
    pub scheduler_name: String,
}

/// KubeVirt's node label for nodes that give pods CPUs of their own; a
/// VMI with dedicated CPUs runs only on such a node.
pub const CPU_MANAGER_LABEL: &str = "cpumanager";

/// `Ok` when the VMI may run here, else why not (for the log).
pub fn fits(vmi: &VirtualMachineInstance, host: &HostFacts) -> Result<(), String> {
    let spec = &vmi.spec;
    if crate::core::convert::dedicated_cpus_wanted(vmi).is_some()
        && host.labels.get(CPU_MANAGER_LABEL).map(String::as_str) != Some("true")
    {
        return Err(format!(
            "dedicatedCpuPlacement needs a node labelled {CPU_MANAGER_LABEL}=true \
             (vm.dedicated_cpus), and this host dedicates no CPUs"
        ));
    }
    for (k, v) in &spec.node_selector {
        if host.labels.get(k) != Some(v) {
            return Err(format!("nodeSelector {k}={v} does not match this host"));
        }
    }
    match spec.extra.get("schedulerName").and_then(Value::as_str) {
        None | Some("") | Some("default-scheduler") => {}
        Some(s) if s == host.scheduler_name => {}
        Some(s) => return Err(format!("schedulerName {s:?} is not kvirt's")),
    }
    if let Some(affinity) = spec.extra.get("affinity") {
        node_affinity(affinity, host)?;
        for kind in ["podAffinity", "podAntiAffinity"] {
            let required = &affinity[kind]["requiredDuringSchedulingIgnoredDuringExecution"];
            if required.as_array().is_some_and(|r| !r.is_empty()) {
                return Err(format!(
                    "affinity.{kind} is required, and a host without pods cannot tell"
                ));
            }
        }
    }
    let tolerations = spec
        .extra
        .get("tolerations")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for t in &host.taints {
        if t.effect == "PreferNoSchedule" {
            continue;
        }
        if !tolerations.iter().any(|tol| tolerates(tol, t)) {
            return Err(format!(
                "the host's taint {}={}:{} is not tolerated",
                t.key, t.value, t.effect
            ));
        }
    }
    Ok(())
}

fn node_affinity(affinity: &Value, host: &HostFacts) -> Result<(), String> {
    let required = &affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
    if required.is_null() {
        return Ok(());
    }
    selector_terms_match(&required["nodeSelectorTerms"], host)
        .map_err(|why| format!("required node affinity does not match this host ({why})"))
}

/// `nodeSelectorTerms` (a JSON list) against this host: the terms are
/// ORed, and an empty list matches nothing, as Kubernetes'.
pub fn selector_terms_match(terms: &Value, host: &HostFacts) -> Result<(), String> {
    let mut why = Vec::new();
    for term in terms.as_array().into_iter().flatten() {
        match term_matches(term, host) {
            Ok(()) => return Ok(()),
            Err(e) => why.push(e),
        }
    }
    Err(if why.is_empty() {
        "no nodeSelectorTerms".into()
    } else {
        why.join("; ")
    })
}

/// One term: its expressions on labels and on fields, all of them.
fn term_matches(term: &Value, host: &HostFacts) -> Result<(), String> {
    let fields = BTreeMap::from([("metadata.name".to_owned(), host.node_name.clone())]);
    for (list, values) in [("matchExpressions", &host.labels), ("matchFields", &fields)] {
        for e in term[list].as_array().into_iter().flatten() {
            let key = e["key"].as_str().unwrap_or("");
            let op = e["operator"].as_str().unwrap_or("");
            let want: Vec<&str> = e["values"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let have = values.get(key).map(String::as_str);
            let number = |s: Option<&str>| s.and_then(|s| s.parse::<i64>().ok());
            let ok = match op {
                "In" => have.is_some_and(|h| want.contains(&h)),
                "NotIn" => !have.is_some_and(|h| want.contains(&h)),
                "Exists" => have.is_some(),
                "DoesNotExist" => have.is_none(),
                "Gt" | "Lt" => match (number(have), number(want.first().copied())) {
                    (Some(h), Some(w)) => (op == "Gt" && h > w) || (op == "Lt" && h < w),
                    _ => false,
                },
                other => return Err(format!("unknown operator {other:?}")),
            };
            if !ok {
                return Err(format!("{key} {op} {want:?}"));
            }
        }
    }
    Ok(())
}

/// Kubernetes' rule: an empty key with `Exists` tolerates everything; an
/// empty effect matches every effect.
fn tolerates(tol: &Value, t: &Taint) -> bool {
    let key = tol["key"].as_str().unwrap_or("");
    let op = tol["operator"].as_str().unwrap_or("Equal");
    let effect = tol["effect"].as_str().unwrap_or("");
    if !effect.is_empty() && effect != t.effect {
        return false;
    }
    match op {
        "Exists" => key.is_empty() || key == t.key,
        _ => key == t.key && tol["value"].as_str().unwrap_or("") == t.value,
    }
}

/// Whether `labels` satisfy a Kubernetes label selector (`matchLabels`,
/// `matchExpressions` with `In`, `NotIn`, `Exists`, `DoesNotExist`); an
/// empty selector selects everything, an unknown operator nothing.
pub fn label_selector_matches(
    sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    labels: &BTreeMap<String, String>,
) -> bool {
    let plain = sel
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    plain
        && sel.match_expressions.iter().flatten().all(|e| {
            let values = e.values.as_deref().unwrap_or_default();
            let have = labels.get(&e.key);
            match e.operator.as_str() {
                "In" => have.is_some_and(|v| values.contains(v)),
                "NotIn" => have.is_none_or(|v| !values.contains(v)),
                "Exists" => have.is_some(),
                "DoesNotExist" => have.is_none(),
                _ => false,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi(spec: &str) -> VirtualMachineInstance {
        VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a}}\nspec:\n  domain: {{devices: {{}}}}\n{spec}"
        ))
        .unwrap()
    }

    fn host() -> HostFacts {
        HostFacts {
            node_name: "node-a".into(),
            labels: [("zone", "z1"), ("gpu", "2")]
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            taints: vec![Taint {
                key: "dedicated".into(),
                value: "vms".into(),
                effect: "NoSchedule".into(),
            }],
            scheduler_name: "kvirt".into(),
        }
    }

    const TOLERATES: &str =
        "  tolerations: [{key: dedicated, operator: Equal, value: vms, effect: NoSchedule}]\n";

    fn ok(spec: &str) -> bool {
        fits(&vmi(spec), &host()).is_ok()
    }

    #[test]
    fn dedicated_cpus_go_only_to_a_cpumanager_node() {
        let dedicated = |cpu: &str| {
            VirtualMachineInstance::from_yaml(&format!(
                "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: a}}\n\
                 spec:\n{TOLERATES}  domain: {{cpu: {cpu}, devices: {{}}}}\n"
            ))
            .unwrap()
        };
        let yes = dedicated("{cores: 2, dedicatedCpuPlacement: true}");
        let e = fits(&yes, &host()).unwrap_err();
        assert!(e.contains("needs a node labelled cpumanager=true"), "{e}");
        let mut cpumanager = host();
        cpumanager
            .labels
            .insert(CPU_MANAGER_LABEL.into(), "true".into());
        assert!(fits(&yes, &cpumanager).is_ok());
        assert!(fits(&dedicated("{cores: 2}"), &host()).is_ok());
    }

    #[test]
    fn taints_keep_out_what_does_not_tolerate_them() {
        assert!(!ok(""));
        assert!(fits(&vmi(""), &host())
            .unwrap_err()
            .contains("dedicated=vms:NoSchedule"));
        assert!(ok(TOLERATES));
        assert!(ok("  tolerations: [{operator: Exists}]\n"));
        assert!(ok("  tolerations: [{key: dedicated, operator: Exists}]\n"));
        assert!(!ok("  tolerations: [{key: dedicated, value: other}]\n"));
        assert!(!ok(
            "  tolerations: [{key: dedicated, operator: Exists, effect: NoExecute}]\n"
        ));
        let mut soft = host();
        soft.taints[0].effect = "PreferNoSchedule".into();
        assert!(fits(&vmi(""), &soft).is_ok());
    }

    #[test]
    fn required_node_affinity_is_honoured() {
        let aff = |exprs: &str| {
            format!(
                "{TOLERATES}  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n{exprs}"
            )
        };
        assert!(ok(&aff(
            "        - matchExpressions: [{key: zone, operator: In, values: [z1, z2]}]\n"
        )));
        assert!(!ok(&aff(
            "        - matchExpressions: [{key: zone, operator: In, values: [z2]}]\n"
        )));
        // Terms are ORed, expressions ANDed.
        assert!(ok(&aff(
            "        - matchExpressions: [{key: zone, operator: NotIn, values: [z1]}]\n        - matchExpressions: [{key: gpu, operator: Gt, values: ['1']}, {key: ssd, operator: DoesNotExist}]\n"
        )));
        assert!(!ok(&aff(
            "        - matchExpressions: [{key: gpu, operator: Lt, values: ['1']}, {key: zone, operator: Exists}]\n"
        )));
        assert!(ok(&aff(
            "        - matchFields: [{key: metadata.name, operator: In, values: [node-a]}]\n"
        )));
        assert!(!ok(&aff(
            "        - matchFields: [{key: metadata.name, operator: In, values: [node-b]}]\n"
        )));
        // Preferred terms are preferences, not requirements.
        assert!(ok(&format!(
            "{TOLERATES}  affinity:\n    nodeAffinity:\n      preferredDuringSchedulingIgnoredDuringExecution: [{{weight: 1, preference: {{matchExpressions: [{{key: zone, operator: In, values: [z9]}}]}}}}]\n"
        )));
        let pods = format!(
            "{TOLERATES}  affinity:\n    podAntiAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution: [{{topologyKey: zone}}]\n"
        );
        assert!(fits(&vmi(&pods), &host())
            .unwrap_err()
            .contains("podAntiAffinity"));
    }

    #[test]
    fn only_kvirts_or_the_default_scheduler_is_answered() {
        assert!(ok(&format!("{TOLERATES}  schedulerName: kvirt\n")));
        assert!(ok(&format!(
            "{TOLERATES}  schedulerName: default-scheduler\n"
        )));
        assert!(!ok(&format!("{TOLERATES}  schedulerName: volcano\n")));
        assert!(!ok(&format!("{TOLERATES}  nodeSelector: {{zone: z2}}\n")));
    }

    #[test]
    fn label_selectors_match_as_kubernetes_matches_them() {
        let sel = |v: serde_json::Value| serde_json::from_value(v).unwrap();
        let labels: BTreeMap<String, String> = [
            ("app".to_owned(), "web".to_owned()),
            ("tier".to_owned(), "a".to_owned()),
        ]
        .into();
        let m = |v| label_selector_matches(&sel(v), &labels);
        assert!(m(serde_json::json!({})));
        assert!(m(serde_json::json!({"matchLabels": {"app": "web"}})));
        assert!(!m(serde_json::json!({"matchLabels": {"app": "db"}})));
        assert!(m(
            serde_json::json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]})
        ));
        assert!(!m(
            serde_json::json!({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]})
        ));
        assert!(m(
            serde_json::json!({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]})
        ));
        assert!(!m(
            serde_json::json!({"matchExpressions": [{"key": "zone", "operator": "Exists"}]})
        ));
        assert!(!m(
            serde_json::json!({"matchExpressions": [{"key": "app", "operator": "Gt", "values": ["1"]}]})
        ));
    }
}
