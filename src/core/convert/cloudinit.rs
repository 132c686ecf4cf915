//! `cloudInitNoCloud` / `cloudInitConfigDrive` volumes → the files of the
//! seed image the guest's cloud-init reads, as KubeVirt lays them out:
//!
//! - NoCloud: volume label `cidata`; `meta-data`, `user-data`,
//!   `network-config`;
//! - ConfigDrive: volume label `config-2`; `openstack/latest/meta_data.json`,
//!   `user_data`, `network_data.json`.
//!
//! In cluster mode `secretRef`/`networkDataSecretRef` name Secrets read
//! when the VM starts (keys `userdata`/`userData`, `networkdata`/
//! `networkData`, as KubeVirt reads them).

use super::seed::{ObjectFiles, Seed, Take};
use super::Errors;
use crate::core::key::VmKey;
use crate::core::objects::ObjectRef;
use crate::core::vmi::{CloudInit, LocalObjectReference};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    NoCloud,
    ConfigDrive,
}

impl Flavor {
    pub fn field(self) -> &'static str {
        match self {
            Flavor::NoCloud => "cloudInitNoCloud",
            Flavor::ConfigDrive => "cloudInitConfigDrive",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Flavor::NoCloud => "cidata",
            Flavor::ConfigDrive => "config-2",
        }
    }
}

/// Far above any real user-data, far below what would strain the host.
const MAX_DATA: usize = 16 << 20;

/// Plain or base64, never both; `None` when neither is set.
fn data(
    plain: &Option<String>,
    b64: &Option<String>,
    path: &str,
    name: &str,
    errs: &mut Errors,
) -> Option<Vec<u8>> {
    let bytes = match (plain, b64) {
        (Some(_), Some(_)) => {
            errs.add(path, format!("set only one of {name} and {name}Base64"));
            return None;
        }
        (Some(p), None) => p.as_bytes().to_vec(),
        (None, Some(b)) => match decode_base64(b) {
            Some(d) => d,
            None => {
                errs.add(format!("{path}.{name}Base64"), "is not valid base64");
                return None;
            }
        },
        (None, None) => return None,
    };
    if bytes.len() > MAX_DATA {
        errs.add(
            format!("{path}.{name}"),
            format!("{} bytes is more than {MAX_DATA}", bytes.len()),
        );
        return None;
    }
    Some(bytes)
}

/// Standard base64, padding optional, whitespace (line breaks) ignored.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    use base64::engine::{general_purpose::GeneralPurpose, DecodePaddingMode};
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let compact: String = s.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::Engine::decode(&LENIENT, compact).ok()
}

/// The places a seed can put user or network data.
struct Slots {
    user: &'static str,
    network: &'static str,
}

impl Flavor {
    fn slots(self) -> Slots {
        match self {
            Flavor::NoCloud => Slots {
                user: "user-data",
                network: "network-config",
            },
            Flavor::ConfigDrive => Slots {
                user: "openstack/latest/user_data",
                network: "openstack/latest/network_data.json",
            },
        }
    }
}

const USER_KEYS: &[&str] = &["userdata", "userData"];
const NETWORK_KEYS: &[&str] = &["networkdata", "networkData"];

/// A Secret to read at start, or an error when there is no cluster to
/// read it from.
fn secret_ref(
    r: &Option<LocalObjectReference>,
    field: String,
    cluster: bool,
    errs: &mut Errors,
) -> Option<(ObjectRef, String)> {
    let r = r.as_ref()?;
    errs.reject_extra(&field, &r.extra);
    if !cluster {
        errs.add(&field, super::NEEDS_CLUSTER);
        return None;
    }
    if r.name.is_empty() {
        errs.add(format!("{field}.name"), "is required");
        return None;
    }
    Some((ObjectRef::Secret(r.name.clone()), field))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn seed(
    flavor: Flavor,
    ci: &CloudInit,
    path: &str,
    key: &VmKey,
    hostname: &str,
    uuid: &str,
    cluster: bool,
    errs: &mut Errors,
) -> Option<Seed> {
    errs.reject_extra(path, &ci.extra);
    let mut user = data(&ci.user_data, &ci.user_data_base64, path, "userData", errs);
    let mut network = data(
        &ci.network_data,
        &ci.network_data_base64,
        path,
        "networkData",
        errs,
    );
    let user_secret = secret_ref(&ci.secret_ref, format!("{path}.secretRef"), cluster, errs);
    let network_secret = secret_ref(
        &ci.network_data_secret_ref,
        format!("{path}.networkDataSecretRef"),
        cluster,
        errs,
    );
    if user.is_some() && ci.secret_ref.is_some() {
        errs.add(path, "set only one of userData and secretRef");
        user = None;
    }
    if network.is_some() && ci.network_data_secret_ref.is_some() {
        errs.add(path, "set only one of networkData and networkDataSecretRef");
        network = None;
    }
    let nothing = [
        &ci.user_data,
        &ci.user_data_base64,
        &ci.network_data,
        &ci.network_data_base64,
    ]
    .iter()
    .all(|d| d.is_none())
        && ci.secret_ref.is_none()
        && ci.network_data_secret_ref.is_none();
    if nothing && ci.extra.is_empty() {
        errs.add(
            path,
            "needs userData, userDataBase64, networkData or a secretRef",
        );
    }
    let instance_id = format!("{}.{}", key.name(), key.namespace());
    let slots = flavor.slots();
    let mut seed = Seed::new(flavor.label());
    match flavor {
        Flavor::NoCloud => {
            let meta = format!("instance-id: {instance_id}\nlocal-hostname: {hostname}\n");
            seed.files.push(("meta-data".into(), meta.into_bytes()));
            // NoCloud always has a user-data file, empty if need be.
            if ci.secret_ref.is_none() {
                seed.files
                    .push((slots.user.into(), user.take().unwrap_or_default()));
            }
        }
        Flavor::ConfigDrive => {
            let meta = serde_json::json!({
                "instance_id": instance_id,
                "local_hostname": hostname,
                "hostname": hostname,
                "uuid": uuid,
            });
            seed.files.push((
                "openstack/latest/meta_data.json".into(),
                meta.to_string().into_bytes(),
            ));
        }
    }
    if let Some(u) = user {
        seed.files.push((slots.user.into(), u));
    }
    if let Some(n) = network {
        seed.files.push((slots.network.into(), n));
    }
    for (secret, keys, file) in [
        (user_secret, USER_KEYS, slots.user),
        (network_secret, NETWORK_KEYS, slots.network),
    ] {
        if let Some((object, field)) = secret {
            seed.from_objects.push(ObjectFiles {
                object,
                field,
                take: Take::FirstOf {
                    keys,
                    file: file.into(),
                },
            });
        }
    }
    Some(seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> VmKey {
        VmKey::new("default", "vm1").unwrap()
    }

    fn ci(yaml: &str) -> CloudInit {
        serde_norway::from_str(yaml).unwrap()
    }

    fn files(s: &Seed) -> Vec<(&str, String)> {
        s.files
            .iter()
            .map(|(p, b)| (p.as_str(), String::from_utf8_lossy(b).into_owned()))
            .collect()
    }

    const UUID: &str = "5b9b0f4e-0000-4000-8000-000000000001";

    /// The seed of volume `v` (hostname `host1`) and the fields of its errors.
    fn run(flavor: Flavor, yaml: &str, cluster: bool) -> (Option<Seed>, Vec<String>) {
        let mut errs = Errors::default();
        let s = seed(
            flavor,
            &ci(yaml),
            "v",
            &key(),
            "host1",
            UUID,
            cluster,
            &mut errs,
        );
        (s, errs.0.into_iter().map(|e| e.field).collect())
    }

    /// A seed that converts without errors.
    fn ok(flavor: Flavor, yaml: &str, cluster: bool) -> Seed {
        let (s, errs) = run(flavor, yaml, cluster);
        assert!(errs.is_empty(), "{errs:?}");
        s.unwrap()
    }

    #[test]
    fn nocloud_has_kubevirts_layout() {
        let s = ok(
            Flavor::NoCloud,
            "{userData: \"#cloud-config\\npassword: x\\n\", networkData: \"version: 2\\n\"}",
            false,
        );
        assert_eq!(s.label, "cidata");
        assert_eq!(
            files(&s),
            [
                (
                    "meta-data",
                    "instance-id: vm1.default\nlocal-hostname: host1\n".into()
                ),
                ("user-data", "#cloud-config\npassword: x\n".into()),
                ("network-config", "version: 2\n".into()),
            ]
        );
    }

    #[test]
    fn config_drive_has_the_openstack_layout() {
        // "#!/bin/sh\necho hi\n"
        let s = ok(
            Flavor::ConfigDrive,
            "{userDataBase64: IyEvYmluL3NoCmVjaG8gaGkK}",
            false,
        );
        assert_eq!(s.label, "config-2");
        let f = files(&s);
        assert_eq!(f[0].0, "openstack/latest/meta_data.json");
        let meta: serde_json::Value = serde_json::from_str(&f[0].1).unwrap();
        assert_eq!(meta["uuid"], UUID);
        assert_eq!(meta["instance_id"], "vm1.default");
        assert_eq!(meta["local_hostname"], "host1");
        assert_eq!(
            f[1],
            ("openstack/latest/user_data", "#!/bin/sh\necho hi\n".into())
        );
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn mistakes_name_their_field() {
        let check = |yaml: &str, cluster: bool| run(Flavor::NoCloud, yaml, cluster).1;
        assert_eq!(check("{userData: a, userDataBase64: YQ==}", false), ["v"]);
        assert_eq!(
            check("{userDataBase64: '***'}", false),
            ["v.userDataBase64"]
        );
        assert_eq!(check("{}", false), ["v"]);
        assert_eq!(check("{x: 1}", false), ["v.x"]);
        assert_eq!(
            check("{secretRef: {name: s}}", false),
            ["v.secretRef"],
            "standalone has no Secrets: one error, not also 'needs userData'"
        );
        assert_eq!(check("{secretRef: {name: s}}", true), [] as [&str; 0]);
        assert_eq!(check("{secretRef: {}}", true), ["v.secretRef.name"]);
        assert_eq!(check("{userData: a, secretRef: {name: s}}", true), ["v"]);
        assert_eq!(
            check("{networkData: a, networkDataSecretRef: {name: s}}", true),
            ["v"]
        );
    }

    #[test]
    fn secret_refs_fill_the_user_and_network_data_files_at_start() {
        let s = ok(
            Flavor::ConfigDrive,
            "{secretRef: {name: ud}, networkDataSecretRef: {name: nd}}",
            true,
        );
        assert_eq!(s.files.len(), 1, "only meta_data.json until the start");
        let want = [
            (
                ObjectRef::Secret("ud".into()),
                "v.secretRef",
                &["userdata", "userData"],
                "openstack/latest/user_data",
            ),
            (
                ObjectRef::Secret("nd".into()),
                "v.networkDataSecretRef",
                &["networkdata", "networkData"],
                "openstack/latest/network_data.json",
            ),
        ];
        assert_eq!(s.from_objects.len(), 2);
        for (o, (object, field, keys, file)) in s.from_objects.iter().zip(want) {
            assert_eq!(o.object, object);
            assert_eq!(o.field, field);
            assert_eq!(
                o.take,
                Take::FirstOf {
                    keys,
                    file: file.into()
                }
            );
        }
        // NoCloud: user-data comes from the Secret, not as an empty file.
        let s = ok(Flavor::NoCloud, "{secretRef: {name: ud}}", true);
        assert_eq!(files(&s).len(), 1);
        assert_eq!(s.from_objects.len(), 1);
    }

    #[test]
    fn base64_decodes_with_and_without_padding() {
        assert_eq!(decode_base64("aGk=").unwrap(), b"hi");
        assert_eq!(decode_base64("aGk").unwrap(), b"hi");
        assert_eq!(decode_base64("aG\nk=").unwrap(), b"hi");
        assert_eq!(decode_base64("").unwrap(), b"");
        assert!(decode_base64("a").is_none());
        assert!(decode_base64("aG=k").is_none());
        assert!(decode_base64("a$==").is_none());
    }
}
