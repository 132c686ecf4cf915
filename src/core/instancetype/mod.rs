//! Instancetypes and preferences (`instancetype.kubevirt.io/v1beta1`), as
//! KubeVirt applies them to a VirtualMachine's template: the instancetype's
//! fields are the VM's (a template field it also sets is a conflict, named
//! as KubeVirt names it); a preference fills only what the template leaves
//! unset, and its requirements are checked. Pure.
//!
//! A VM keeps the objects it first used (a [`Captured`] revision, as
//! KubeVirt keeps a ControllerRevision): editing an instancetype never
//! changes a VM that uses it, run after run, until the VM's matcher names
//! another object.

mod apply;
mod preference;

use crate::core::quantity::Quantity;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

pub const GROUP: &str = "instancetype.kubevirt.io";
pub const VERSION: &str = "v1beta1";
pub const API_VERSION: &str = "instancetype.kubevirt.io/v1beta1";

/// The four kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    VirtualMachineInstancetype,
    VirtualMachineClusterInstancetype,
    VirtualMachinePreference,
    VirtualMachineClusterPreference,
}

impl Kind {
    pub const ALL: [Kind; 4] = [
        Kind::VirtualMachineInstancetype,
        Kind::VirtualMachineClusterInstancetype,
        Kind::VirtualMachinePreference,
        Kind::VirtualMachineClusterPreference,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::VirtualMachineInstancetype => "VirtualMachineInstancetype",
            Kind::VirtualMachineClusterInstancetype => "VirtualMachineClusterInstancetype",
            Kind::VirtualMachinePreference => "VirtualMachinePreference",
            Kind::VirtualMachineClusterPreference => "VirtualMachineClusterPreference",
        }
    }

    pub fn plural(self) -> String {
        format!("{}s", self.as_str().to_ascii_lowercase())
    }

    pub fn namespaced(self) -> bool {
        matches!(
            self,
            Kind::VirtualMachineInstancetype | Kind::VirtualMachinePreference
        )
    }

    pub fn is_preference(self) -> bool {
        matches!(
            self,
            Kind::VirtualMachinePreference | Kind::VirtualMachineClusterPreference
        )
    }

    pub fn from_name(s: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// A matcher's `kind`: any case, singular or plural; none is the
    /// cluster kind (KubeVirt's `find` rules).
    fn of_matcher(kind: Option<&str>, preference: bool) -> Result<Kind, String> {
        let choices = if preference {
            [
                Kind::VirtualMachineClusterPreference,
                Kind::VirtualMachinePreference,
            ]
        } else {
            [
                Kind::VirtualMachineClusterInstancetype,
                Kind::VirtualMachineInstancetype,
            ]
        };
        let Some(k) = kind.filter(|k| !k.is_empty()) else {
            return Ok(choices[0]);
        };
        let lower = k.to_ascii_lowercase();
        choices
            .into_iter()
            .find(|c| lower == c.as_str().to_ascii_lowercase() || lower == c.plural())
            .ok_or_else(|| {
                format!(
                    "{k:?} is not {} or {}",
                    choices[0].as_str(),
                    choices[1].as_str()
                )
            })
    }
}

/// One object: kind, namespace (for the namespaced kinds), name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: String,
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{} {ns}/{}", self.kind.as_str(), self.name),
            None => write!(f, "{} {}", self.kind.as_str(), self.name),
        }
    }
}

impl ObjectKey {
    /// The key of an object (a manifest or an API object), if it is one of
    /// the four kinds; a namespaced one without a namespace is `default`'s.
    pub fn of_object(obj: &Value) -> Option<Result<ObjectKey, String>> {
        let kind = Kind::from_name(obj.get("kind")?.as_str()?)?;
        Some((|| {
            let api = obj.get("apiVersion").and_then(Value::as_str).unwrap_or("");
            if api != API_VERSION {
                return Err(format!(
                    "{} must be {API_VERSION}, not {api:?}",
                    kind.as_str()
                ));
            }
            let name = obj
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or("metadata.name is missing")?;
            let namespace = kind.namespaced().then(|| {
                obj.pointer("/metadata/namespace")
                    .and_then(Value::as_str)
                    .unwrap_or("default")
                    .to_owned()
            });
            Ok(ObjectKey {
                kind,
                namespace,
                name: name.to_owned(),
            })
        })())
    }
}

/// `spec.instancetype` / `spec.preference` of a VirtualMachine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Matcher {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision_name: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Matcher {
    /// The object it names, in the VM's namespace for a namespaced kind.
    pub fn key(&self, preference: bool, vm_namespace: &str) -> Result<ObjectKey, String> {
        let field = if preference {
            "spec.preference"
        } else {
            "spec.instancetype"
        };
        if let Some(k) = self.extra.keys().next() {
            return Err(if k.starts_with("inferFromVolume") {
                format!(
                    "{field}.{k}: kvirt does not infer instancetypes from volumes yet; name one"
                )
            } else {
                format!("{field}.{k} is not supported by kvirt")
            });
        }
        let name = self
            .name
            .as_deref()
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("{field}.name is missing"))?;
        let kind = Kind::of_matcher(self.kind.as_deref(), preference)
            .map_err(|e| format!("{field}.kind: {e}"))?;
        Ok(ObjectKey {
            kind,
            namespace: kind.namespaced().then(|| vm_namespace.to_owned()),
            name: name.to_owned(),
        })
    }
}

/// An object as a VM keeps it: the name of its revision and the object
/// (`apiVersion`, `kind`, `metadata.name`/`uid`/`generation`, `spec`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Revision {
    pub name: String,
    pub object: Value,
}

impl Revision {
    /// KubeVirt's revision of an object for a VM:
    /// `<vm>-<object>-<version>-<uid>-<generation>`, the object stripped of
    /// what is not its content.
    pub fn of(vm_name: &str, object: &Value) -> Revision {
        let meta = object.get("metadata").cloned().unwrap_or_default();
        let s = |k: &str| meta.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let generation = meta.get("generation").and_then(Value::as_i64).unwrap_or(1);
        let name = format!(
            "{vm_name}-{}-{VERSION}-{}-{generation}",
            s("name"),
            s("uid")
        );
        let mut kept = json!({
            "apiVersion": object.get("apiVersion").cloned().unwrap_or_default(),
            "kind": object.get("kind").cloned().unwrap_or_default(),
            "metadata": {"name": s("name"), "uid": s("uid"), "generation": generation},
            "spec": object.get("spec").cloned().unwrap_or(json!({})),
        });
        if let Some(ns) = meta.get("namespace") {
            kept["metadata"]["namespace"] = ns.clone();
        }
        Revision {
            name: kubernetes_name(&name),
            object: kept,
        }
    }

    /// Whether it holds the object `key` names.
    pub fn is_of(&self, key: &ObjectKey) -> bool {
        self.object.get("kind").and_then(Value::as_str) == Some(key.kind.as_str())
            && self
                .object
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                == Some(&key.name)
    }
}

/// A revision's name must be a DNS subdomain (253 characters); a longer
/// one keeps its start and a digest of the whole.
fn kubernetes_name(s: &str) -> String {
    if s.len() <= 253 {
        return s.to_owned();
    }
    use sha2::{Digest, Sha256};
    let d: String = Sha256::digest(s.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut cut = 236;
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}-{d}", s[..cut].trim_end_matches(['-', '.']))
}

/// The revisions a VM uses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Captured {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instancetype: Option<Revision>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preference: Option<Revision>,
}

impl Captured {
    pub fn is_empty(&self) -> bool {
        self.instancetype.is_none() && self.preference.is_none()
    }
}

/// What a VM's matchers want: the objects they name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    pub instancetype: Option<ObjectKey>,
    pub preference: Option<ObjectKey>,
}

/// Keeps what the VM captured while its matchers name the same objects;
/// captures anew (from `lookup`) what they name now and it lacks. What
/// cannot be found stays missing: [`VirtualMachine::expandable`] names it.
///
/// [`VirtualMachine::expandable`]: crate::core::vm::VirtualMachine::expandable
pub fn settle(
    wanted: &Wanted,
    kept: &Captured,
    vm_name: &str,
    lookup: &dyn Fn(&ObjectKey) -> Option<Value>,
) -> Captured {
    let one = |want: &Option<ObjectKey>, had: &Option<Revision>| {
        let key = want.as_ref()?;
        if let Some(r) = had.as_ref().filter(|r| r.is_of(key)) {
            return Some(r.clone());
        }
        lookup(key).map(|obj| Revision::of(vm_name, &obj))
    };
    Captured {
        instancetype: one(&wanted.instancetype, &kept.instancetype),
        preference: one(&wanted.preference, &kept.preference),
    }
}

/// Applies the captured objects to a VM's template (`{metadata, spec}`),
/// as KubeVirt makes the VMI: instancetype first (conflicts fail it, the
/// preference is then not applied), preference, then its requirements.
pub fn apply(template: &mut Value, captured: &Captured) -> Result<(), String> {
    let it = captured
        .instancetype
        .as_ref()
        .map(|r| spec_of(r, false))
        .transpose()?;
    let pref = captured
        .preference
        .as_ref()
        .map(|r| spec_of(r, true))
        .transpose()?;
    obj_at(template, &["spec"]);
    if let Some(it) = &it {
        apply::instancetype(template, it, pref.as_ref())?;
    }
    if let Some(pref) = &pref {
        preference::apply(template, pref)?;
        preference::requirements(template, pref, it.as_ref())?;
    }
    // Which objects made the VMI, as KubeVirt notes it.
    for (rev, cluster, namespaced) in [
        (
            &captured.instancetype,
            "kubevirt.io/cluster-instancetype-name",
            "kubevirt.io/instancetype-name",
        ),
        (
            &captured.preference,
            "kubevirt.io/cluster-preference-name",
            "kubevirt.io/preference-name",
        ),
    ] {
        let Some(rev) = rev else { continue };
        let kind = rev.object.get("kind").and_then(Value::as_str).unwrap_or("");
        let key = if kind.contains("Cluster") {
            cluster
        } else {
            namespaced
        };
        let name = rev
            .object
            .pointer("/metadata/name")
            .cloned()
            .unwrap_or_default();
        obj_at(template, &["metadata", "annotations"]).insert(key.into(), name);
    }
    Ok(())
}

/// The object's spec, checked against the kind's fields.
fn spec_of(rev: &Revision, preference: bool) -> Result<Value, String> {
    let kind = rev.object.get("kind").and_then(Value::as_str).unwrap_or("");
    let name = rev
        .object
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("");
    let spec = rev.object.get("spec").cloned().unwrap_or(json!({}));
    let known = if preference {
        preference::FIELDS
    } else {
        apply::FIELDS
    };
    for k in spec.as_object().into_iter().flat_map(|o| o.keys()) {
        if !known.contains(&k.as_str()) {
            return Err(format!("{kind} {name}: spec.{k} is not supported by kvirt"));
        }
    }
    if !preference {
        let guest = spec.pointer("/cpu/guest").and_then(Value::as_u64);
        if guest.is_none_or(|g| g == 0 || g > u64::from(u32::MAX)) {
            return Err(format!(
                "{kind} {name}: spec.cpu.guest must be a number of vCPUs"
            ));
        }
        if spec
            .pointer("/memory/guest")
            .and_then(quantity_bytes)
            .is_none()
        {
            return Err(format!(
                "{kind} {name}: spec.memory.guest must be a quantity"
            ));
        }
    }
    Ok(spec)
}

/// Refuses, by name, a field of `spec.<part>` its kind does not have.
fn check_parts(spec: &Value, parts: &[(&str, &[&str])], what: &str) -> Result<(), String> {
    for (part, known) in parts {
        let fields = spec.get(part).and_then(Value::as_object);
        if let Some(k) = fields
            .into_iter()
            .flatten()
            .map(|(k, _)| k)
            .find(|k| !known.contains(&k.as_str()))
        {
            return Err(format!("{what} spec.{part}.{k} is not supported by kvirt"));
        }
    }
    Ok(())
}

/// Adds the object's `annotations` the template lacks (a key it has keeps
/// its value).
fn add_annotations(template: &mut Value, spec: &Value) {
    if let Some(a) = spec.get("annotations").and_then(Value::as_object) {
        let mine = obj_at(template, &["metadata", "annotations"]);
        for (k, v) in a {
            mine.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
}

/// A quantity's bytes, written as a string or a number.
fn quantity_bytes(v: &Value) -> Option<u64> {
    match v {
        Value::String(s) => Quantity::new(s.as_str()).to_bytes().ok(),
        Value::Number(n) => Quantity::new(n.to_string()).to_bytes().ok(),
        _ => None,
    }
}

/// The object at `path` below `v`, made (`{}`) where missing or not an
/// object.
fn obj_at<'a>(v: &'a mut Value, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut cur = v;
    for p in path {
        if !cur.is_object() {
            *cur = json!({});
        }
        cur = cur
            .as_object_mut()
            .expect("made an object")
            .entry(*p)
            .or_insert_with(|| json!({}));
    }
    if !cur.is_object() {
        *cur = json!({});
    }
    cur.as_object_mut().expect("made an object")
}

/// The value at `path`, unless absent or `null`.
fn get<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter()
        .try_fold(v, |cur, p| cur.get(p))
        .filter(|v| !v.is_null())
}

/// Set as KubeVirt's Go types tell: present, and not an empty string, a
/// zero, `false` or an empty list.
fn is_set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn y(s: &str) -> Value {
        serde_norway::from_str(s).unwrap()
    }

    #[test]
    fn matchers_name_objects_by_kubevirts_rules() {
        let m = |s: &str| serde_json::from_value::<Matcher>(y(s)).unwrap();
        let k = m("{name: u1.small}").key(false, "ns").unwrap();
        assert_eq!(k.kind, Kind::VirtualMachineClusterInstancetype);
        assert_eq!(k.namespace, None);
        let k = m("{name: mine, kind: virtualmachineinstancetypes}")
            .key(false, "ns")
            .unwrap();
        assert_eq!(
            (k.kind, k.namespace.as_deref()),
            (Kind::VirtualMachineInstancetype, Some("ns"))
        );
        let k = m("{name: f, kind: VirtualMachinePreference}")
            .key(true, "ns")
            .unwrap();
        assert_eq!(k.kind, Kind::VirtualMachinePreference);
        assert!(m("{name: f, kind: VirtualMachinePreference}")
            .key(false, "ns")
            .is_err());
        assert_eq!(
            m("{}").key(false, "ns").unwrap_err(),
            "spec.instancetype.name is missing"
        );
        let e = m("{inferFromVolume: root}").key(false, "ns").unwrap_err();
        assert!(e.contains("does not infer"), "{e}");
    }

    #[test]
    fn a_revision_is_named_and_kept_as_kubevirt_keeps_it() {
        let obj = y("{apiVersion: instancetype.kubevirt.io/v1beta1, kind: VirtualMachineClusterInstancetype, \
                     metadata: {name: u1.small, uid: abc, generation: 2, labels: {x: y}, resourceVersion: '9'}, \
                     spec: {cpu: {guest: 1}, memory: {guest: 1Gi}}}");
        let r = Revision::of("web", &obj);
        assert_eq!(r.name, "web-u1.small-v1beta1-abc-2");
        assert_eq!(r.object.pointer("/metadata/labels"), None);
        assert_eq!(r.object["spec"], obj["spec"]);
        let long = Revision::of(&"v".repeat(250), &obj);
        assert!(long.name.len() <= 253, "{}", long.name);

        // Kept while the matcher names the same object, though it changed.
        let key = ObjectKey::of_object(&obj).unwrap().unwrap();
        let wanted = Wanted {
            instancetype: Some(key.clone()),
            preference: None,
        };
        let kept = settle(&wanted, &Captured::default(), "web", &|_| Some(obj.clone()));
        let mut edited = obj.clone();
        edited["spec"]["cpu"]["guest"] = 8.into();
        edited["metadata"]["generation"] = 3.into();
        assert_eq!(
            settle(&wanted, &kept, "web", &|_| Some(edited.clone())),
            kept
        );
        // Another object: captured anew; none found: missing.
        let other = ObjectKey {
            name: "u1.large".into(),
            ..key
        };
        let wanted = Wanted {
            instancetype: Some(other),
            preference: None,
        };
        assert_eq!(
            settle(&wanted, &kept, "web", &|_| None),
            Captured::default()
        );
    }

    #[test]
    fn instancetype_objects_are_checked_before_use() {
        let rev = |spec: &str| {
            Captured {
            instancetype: Some(Revision::of("v", &y(&format!(
                "{{apiVersion: instancetype.kubevirt.io/v1beta1, kind: VirtualMachineInstancetype, metadata: {{name: i}}, spec: {spec}}}"
            )))),
            preference: None,
        }
        };
        let mut t = y("{spec: {}}");
        assert!(apply(
            &mut t,
            &rev("{cpu: {guest: 1}, memory: {guest: 1Gi}, gpuz: []}")
        )
        .unwrap_err()
        .contains("spec.gpuz"));
        assert!(
            apply(&mut t, &rev("{cpu: {guest: 0}, memory: {guest: 1Gi}}"))
                .unwrap_err()
                .contains("spec.cpu.guest")
        );
        assert!(
            apply(&mut t, &rev("{cpu: {guest: 1}, memory: {guest: lots}}"))
                .unwrap_err()
                .contains("spec.memory.guest")
        );
        apply(&mut t, &rev("{cpu: {guest: 1}, memory: {guest: 1Gi}}")).unwrap();
        assert_eq!(
            t["metadata"]["annotations"]["kubevirt.io/instancetype-name"],
            "i"
        );
    }
}
