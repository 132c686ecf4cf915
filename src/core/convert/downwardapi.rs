//! `downwardAPI` volumes → a seed ISO with one file per item, as KubeVirt's
//! downwardAPI disks (volume label `volumeLabel`, else `cfgdata`). There is
//! no pod: the guest learns the VMI's own name, namespace, uid, labels and
//! annotations. Like KubeVirt's ISO, the files are written once, at start.

use super::configdisk::{self, DEFAULT_LABEL};
use super::seed::Seed;
use super::Errors;
use crate::core::vmi::{DownwardApiFile, DownwardApiVolume};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use std::collections::BTreeMap;
use std::path::{Component, Path};

const SUPPORTED: &str = "metadata.name, metadata.namespace, metadata.uid, \
     metadata.labels, metadata.annotations, metadata.labels['KEY'] or metadata.annotations['KEY']";

/// The seed of a downwardAPI volume at `path` (`spec.volumes[i]`), or `None`
/// with the errors added.
pub(super) fn seed(
    v: &DownwardApiVolume,
    meta: &ObjectMeta,
    path: &str,
    errs: &mut Errors,
) -> Option<Seed> {
    let p = format!("{path}.downwardAPI");
    let before = errs.len();
    errs.reject_extra(&p, &v.extra);
    let label = v.volume_label.as_deref().unwrap_or(DEFAULT_LABEL);
    configdisk::check_label(label, &format!("{p}.volumeLabel"), errs);
    let mut seed = Seed::new(label);
    for (i, f) in v.fields.iter().enumerate() {
        let fp = format!("{p}.fields[{i}]");
        if let Some(bytes) = file(f, meta, &fp, errs) {
            seed.files.push((f.path.clone(), bytes));
        }
    }
    check_paths(&seed.files, &p, errs);
    (errs.len() == before).then_some(seed)
}

fn file(f: &DownwardApiFile, meta: &ObjectMeta, fp: &str, errs: &mut Errors) -> Option<Vec<u8>> {
    errs.reject_extra(fp, &f.extra);
    if !is_relative_path(&f.path) {
        errs.add(
            format!("{fp}.path"),
            format!("{:?} is not a relative path without '..'", f.path),
        );
    }
    if f.mode.as_ref().is_some_and(|m| file_mode(m).is_none()) {
        errs.add(format!("{fp}.mode"), "must be a file mode from 0 to 0777");
    }
    if f.resource_field_ref.is_some() {
        errs.add(
            format!("{fp}.resourceFieldRef"),
            "not supported by kvirt: a VMI has no container whose resources it could show",
        );
        return None;
    }
    let Some(r) = &f.field_ref else {
        errs.add(format!("{fp}.fieldRef"), "is required");
        return None;
    };
    errs.reject_extra(&format!("{fp}.fieldRef"), &r.extra);
    if r.api_version.as_deref().is_some_and(|v| v != "v1") {
        errs.add(
            format!("{fp}.fieldRef.apiVersion"),
            "must be v1 (the fields are those of a pod's metadata)",
        );
    }
    match field(&r.field_path, meta) {
        Ok(text) => Some(text.into_bytes()),
        Err(message) => {
            errs.add(format!("{fp}.fieldRef.fieldPath"), message);
            None
        }
    }
}

/// The text a pod's downwardAPI volume would hold for `field_path`, with the
/// VMI's metadata in place of the pod's.
fn field(field_path: &str, meta: &ObjectMeta) -> Result<String, String> {
    let empty = BTreeMap::new();
    let labels = meta.labels.as_ref().unwrap_or(&empty);
    let annotations = meta.annotations.as_ref().unwrap_or(&empty);
    let text = |s: &Option<String>| s.clone().unwrap_or_default();
    match field_path {
        "metadata.name" => return Ok(text(&meta.name)),
        "metadata.namespace" => return Ok(text(&meta.namespace)),
        "metadata.uid" => return Ok(text(&meta.uid)),
        "metadata.labels" => return Ok(format_map(labels)),
        "metadata.annotations" => return Ok(format_map(annotations)),
        _ => {}
    }
    let subscript = |prefix: &str| {
        field_path
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix("['"))
            .and_then(|rest| rest.strip_suffix("']"))
    };
    let (map, key) = match (
        subscript("metadata.labels"),
        subscript("metadata.annotations"),
    ) {
        (Some(key), _) => (labels, key),
        (_, Some(key)) => (annotations, key),
        _ => return Err(format!("{field_path:?} is not one of {SUPPORTED}")),
    };
    if !is_qualified_key(key) {
        return Err(format!("{key:?} is not a label or annotation key"));
    }
    // A key the object lacks gives an empty file, as kubelet writes it.
    Ok(map.get(key).cloned().unwrap_or_default())
}

/// Kubernetes' `key="value"` lines, sorted by key, values quoted as Go's %q.
fn format_map(m: &BTreeMap<String, String>) -> String {
    m.iter()
        .map(|(k, v)| format!("{k}={}", go_quote(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Go's `strconv.Quote`, with Rust's idea of a control character standing
/// in for Go's of a printable one.
fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if c.is_control() && (c as u32) < 0x80 => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn file_mode(m: &serde_json::Value) -> Option<u32> {
    let mode = match m {
        serde_json::Value::Number(n) => u32::try_from(n.as_u64()?).ok()?,
        serde_json::Value::String(s) if s.starts_with('0') => u32::from_str_radix(s, 8).ok()?,
        _ => return None,
    };
    (mode <= 0o777).then_some(mode)
}

/// Kubernetes' validation of a volume item's path.
fn is_relative_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 4096
        && !p.contains('\0')
        && Path::new(p)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// `[prefix/]name`: a DNS subdomain prefix and a name of alphanumerics,
/// `-`, `_` and `.`, as label and annotation keys are.
fn is_qualified_key(key: &str) -> bool {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    let prefix_ok = prefix.is_none_or(|p| !p.is_empty() && super::is_dns_subdomain(p));
    name_ok && prefix_ok
}

/// Two items may not name the same file, nor one a directory of another.
fn check_paths(files: &[(String, Vec<u8>)], p: &str, errs: &mut Errors) {
    let mut seen: Vec<&str> = Vec::new();
    for (path, _) in files {
        let clash = seen.iter().find(|s| {
            **s == path || path.starts_with(&format!("{s}/")) || s.starts_with(&format!("{path}/"))
        });
        if let Some(other) = clash {
            errs.add(
                format!("{p}.fields"),
                format!("{path:?} clashes with {other:?}"),
            );
        }
        seen.push(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> ObjectMeta {
        serde_norway::from_str(
            "{name: web, namespace: prod, uid: 1234-5678, \
              labels: {app: web, kubevirt.io/os: linux}, \
              annotations: {note: \"say \\\"hi\\\"\\n\\ttab\\\\\"}}",
        )
        .unwrap()
    }

    fn check(yaml: &str) -> (Option<Seed>, Vec<String>) {
        let v: DownwardApiVolume = serde_norway::from_str(yaml).unwrap();
        let mut errs = Errors::default();
        let s = seed(&v, &meta(), "spec.volumes[1]", &mut errs);
        (s, errs.0.into_iter().map(|e| e.field).collect())
    }

    fn files(s: &Seed) -> Vec<(&str, &str)> {
        s.files
            .iter()
            .map(|(p, b)| (p.as_str(), std::str::from_utf8(b).unwrap()))
            .collect()
    }

    #[test]
    fn each_field_is_written_as_kubelet_writes_it() {
        let (s, e) = check(
            "fields:
               - {path: name, fieldRef: {fieldPath: metadata.name}}
               - {path: ns, fieldRef: {fieldPath: metadata.namespace, apiVersion: v1}}
               - {path: uid, fieldRef: {fieldPath: metadata.uid}}
               - {path: meta/labels, fieldRef: {fieldPath: metadata.labels}, mode: 0444}
               - {path: meta/annotations, fieldRef: {fieldPath: metadata.annotations}}
               - {path: os, fieldRef: {fieldPath: \"metadata.labels['kubevirt.io/os']\"}}
               - {path: none, fieldRef: {fieldPath: \"metadata.annotations['absent']\"}}",
        );
        assert!(e.is_empty(), "{e:?}");
        let s = s.unwrap();
        assert_eq!(s.label, "cfgdata");
        assert!(!s.sensitive);
        assert_eq!(
            files(&s),
            [
                ("name", "web"),
                ("ns", "prod"),
                ("uid", "1234-5678"),
                ("meta/labels", "app=\"web\"\nkubevirt.io/os=\"linux\""),
                ("meta/annotations", r#"note="say \"hi\"\n\ttab\\""#),
                ("os", "linux"),
                ("none", ""),
            ]
        );
        let (s, _) = check("{volumeLabel: OEMDRV, fields: []}");
        assert_eq!(s.unwrap().label, "OEMDRV");
    }

    #[test]
    fn go_quote_escapes_what_go_escapes() {
        assert_eq!(go_quote("plain é ✓"), "\"plain é ✓\"");
        assert_eq!(go_quote("\x01\x7f\u{85}"), "\"\\x01\\x7f\\u0085\"");
        assert_eq!(go_quote("\x07\x08\x0c\r\x0b"), "\"\\a\\b\\f\\r\\v\"");
    }

    #[test]
    fn mistakes_name_their_field() {
        let f = |item: &str| check(&format!("fields: [{item}]")).1;
        let p = "spec.volumes[1].downwardAPI.fields[0]";
        assert_eq!(
            f("{path: x, fieldRef: {fieldPath: spec.nodeName}}"),
            [format!("{p}.fieldRef.fieldPath")]
        );
        assert_eq!(
            f("{path: x, fieldRef: {fieldPath: \"metadata.labels['bad key']\"}}"),
            [format!("{p}.fieldRef.fieldPath")]
        );
        assert_eq!(
            f("{path: x, fieldRef: {fieldPath: 'metadata.labels[\"app\"]'}}"),
            [format!("{p}.fieldRef.fieldPath")]
        );
        assert_eq!(
            f("{path: x, fieldRef: {fieldPath: metadata.name, apiVersion: v2}}"),
            [format!("{p}.fieldRef.apiVersion")]
        );
        assert_eq!(
            f("{path: x, resourceFieldRef: {resource: limits.cpu}}"),
            [format!("{p}.resourceFieldRef")]
        );
        assert_eq!(f("{path: x}"), [format!("{p}.fieldRef")]);
        for bad in ["''", "/etc/x", "../x", "a/../b", "./a"] {
            assert_eq!(
                f(&format!(
                    "{{path: {bad}, fieldRef: {{fieldPath: metadata.name}}}}"
                )),
                [format!("{p}.path")],
                "{bad}"
            );
        }
        for bad in ["4096", "0999", "'rw'", "-1"] {
            assert_eq!(
                f(&format!(
                    "{{path: x, mode: {bad}, fieldRef: {{fieldPath: metadata.name}}}}"
                )),
                [format!("{p}.mode")],
                "{bad}"
            );
        }
        assert!(f("{path: x, mode: 292, fieldRef: {fieldPath: metadata.name}}").is_empty());
        assert_eq!(
            f("{path: x, fieldRef: {fieldPath: metadata.name}, items: 1}"),
            [format!("{p}.items")]
        );
        let two = |a: &str, b: &str| {
            check(&format!(
                "fields: [{{path: {a}, fieldRef: {{fieldPath: metadata.name}}}}, \
                          {{path: {b}, fieldRef: {{fieldPath: metadata.uid}}}}]"
            ))
            .1
        };
        assert_eq!(two("a", "a"), ["spec.volumes[1].downwardAPI.fields"]);
        assert_eq!(two("a", "a/b"), ["spec.volumes[1].downwardAPI.fields"]);
        assert_eq!(two("a/b", "a"), ["spec.volumes[1].downwardAPI.fields"]);
        assert!(two("a/b", "a/c").is_empty());
        assert_eq!(
            check("{volumeLabel: 'no spaces', fields: []}").1,
            ["spec.volumes[1].downwardAPI.volumeLabel"]
        );
    }
}
