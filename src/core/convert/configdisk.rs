//! `configMap`, `secret` and `serviceAccount` volumes → seed ISOs with a
//! file per key, as KubeVirt's config disks: volume label `volumeLabel`,
//! else `cfgdata`. The objects are read when the VM starts, so these need
//! a cluster.

use super::seed::{ObjectFiles, Seed, Take};
use super::Errors;
use crate::core::objects::ObjectRef;
use crate::core::vmi::Volume;

/// KubeVirt's label when a volume sets none.
pub const DEFAULT_LABEL: &str = "cfgdata";

/// The seed of a config volume, or `None` when `v` is not one (or is wrong,
/// with the errors added).
pub(super) fn seed(v: &Volume, path: &str, cluster: bool, errs: &mut Errors) -> Option<Seed> {
    let (field, object, optional, label, extra) = if let Some(c) = &v.config_map {
        (
            "configMap",
            ObjectRef::ConfigMap(c.name.clone()),
            c.optional.unwrap_or(false),
            c.volume_label.as_deref(),
            &c.extra,
        )
    } else if let Some(s) = &v.secret {
        (
            "secret",
            ObjectRef::Secret(s.secret_name.clone()),
            s.optional.unwrap_or(false),
            s.volume_label.as_deref(),
            &s.extra,
        )
    } else if let Some(sa) = &v.service_account {
        (
            "serviceAccount",
            ObjectRef::ServiceAccountToken(sa.service_account_name.clone()),
            false,
            None,
            &sa.extra,
        )
    } else {
        return None;
    };
    let p = format!("{path}.{field}");
    let before = errs.len();
    errs.reject_extra(&p, extra);
    if !cluster {
        errs.add(&p, super::NEEDS_CLUSTER);
        return None;
    }
    if object.name().is_empty() {
        let name_field = match field {
            "secret" => "secretName",
            "serviceAccount" => "serviceAccountName",
            _ => "name",
        };
        errs.add(format!("{p}.{name_field}"), "is required");
    }
    let label = label.unwrap_or(DEFAULT_LABEL);
    check_label(label, &format!("{p}.volumeLabel"), errs);
    if errs.len() != before {
        return None;
    }
    let mut seed = Seed::new(label);
    seed.from_objects.push(ObjectFiles {
        object,
        field: p,
        take: Take::All { optional },
    });
    Some(seed)
}

/// ISO 9660 volume ids: at most 32 characters, and what xorrisofs and
/// blkid pass through unchanged.
pub(super) fn check_label(label: &str, field: &str, errs: &mut Errors) {
    if label.is_empty()
        || label.len() > 32
        || !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        errs.add(
            field,
            format!("{label:?} is not a volume label (1-32 of A-Z a-z 0-9 - _ .)"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(yaml: &str) -> Volume {
        serde_norway::from_str(yaml).unwrap()
    }

    fn check(yaml: &str, cluster: bool) -> (Option<Seed>, Vec<String>) {
        let mut errs = Errors::default();
        let s = seed(&volume(yaml), "spec.volumes[2]", cluster, &mut errs);
        (s, errs.0.into_iter().map(|e| e.field).collect())
    }

    #[test]
    fn each_kind_reads_its_object_under_its_label() {
        let (s, e) = check(
            "{name: v, configMap: {name: app, volumeLabel: OEMDRV}}",
            true,
        );
        let s = s.unwrap();
        assert!(e.is_empty(), "{e:?}");
        assert_eq!(s.label, "OEMDRV");
        assert!(s.files.is_empty());
        assert_eq!(
            s.from_objects,
            [ObjectFiles {
                object: ObjectRef::ConfigMap("app".into()),
                field: "spec.volumes[2].configMap".into(),
                take: Take::All { optional: false },
            }]
        );
        let (s, _) = check("{name: v, secret: {secretName: pw, optional: true}}", true);
        let s = s.unwrap();
        assert_eq!(s.label, DEFAULT_LABEL);
        assert_eq!(s.from_objects[0].object, ObjectRef::Secret("pw".into()));
        assert_eq!(s.from_objects[0].take, Take::All { optional: true });
        let (s, _) = check(
            "{name: v, serviceAccount: {serviceAccountName: default}}",
            true,
        );
        assert_eq!(
            s.unwrap().from_objects[0].object,
            ObjectRef::ServiceAccountToken("default".into())
        );
        assert!(check("{name: v, emptyDisk: {capacity: 1Mi}}", true)
            .0
            .is_none());
    }

    #[test]
    fn mistakes_name_their_field() {
        let (s, e) = check("{name: v, configMap: {name: app}}", false);
        assert!(s.is_none());
        assert_eq!(e, ["spec.volumes[2].configMap"]);
        assert_eq!(
            check("{name: v, secret: {}}", true).1,
            ["spec.volumes[2].secret.secretName"]
        );
        assert_eq!(
            check("{name: v, serviceAccount: {}}", true).1,
            ["spec.volumes[2].serviceAccount.serviceAccountName"]
        );
        for label in ["''", "'a b'", "x/y", &"l".repeat(33)] {
            assert_eq!(
                check(
                    &format!("{{name: v, configMap: {{name: a, volumeLabel: {label}}}}}"),
                    true
                )
                .1,
                ["spec.volumes[2].configMap.volumeLabel"],
                "{label}"
            );
        }
        assert_eq!(
            check("{name: v, configMap: {name: a, items: []}}", true).1,
            ["spec.volumes[2].configMap.items"]
        );
    }
}
