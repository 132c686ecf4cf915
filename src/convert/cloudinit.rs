//! `cloudInitNoCloud` / `cloudInitConfigDrive` volumes → the files of the
//! seed image the guest's cloud-init reads, as KubeVirt lays them out:
//!
//! - NoCloud: volume label `cidata`; `meta-data`, `user-data`,
//!   `network-config`;
//! - ConfigDrive: volume label `config-2`; `openstack/latest/meta_data.json`,
//!   `user_data`, `network_data.json`.
//!
//! The image itself is made by the runtime (an ISO 9660 with Rock Ridge and
//! Joliet names); here it is only data.

use super::Errors;
use crate::key::VmKey;
use crate::vmi::CloudInit;

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

/// One seed image: its volume label and its files, by relative path.
#[derive(Clone, PartialEq, Eq)]
pub struct Seed {
    pub label: &'static str,
    pub files: Vec<(String, Vec<u8>)>,
}

/// Files as text, so logs and snapshots read like the seed.
impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let files: Vec<(&str, std::borrow::Cow<'_, str>)> = self
            .files
            .iter()
            .map(|(p, b)| (p.as_str(), String::from_utf8_lossy(b)))
            .collect();
        f.debug_struct("Seed")
            .field("label", &self.label)
            .field("files", &files)
            .finish()
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
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    let mut padding = false;
    for c in s.bytes().filter(|c| !c.is_ascii_whitespace()) {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => {
                padding = true;
                continue;
            }
            _ => return None,
        };
        if padding {
            return None;
        }
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    // A lone 6-bit group cannot end a valid encoding.
    (bits < 6).then_some(out)
}

pub(super) fn seed(
    flavor: Flavor,
    ci: &CloudInit,
    path: &str,
    key: &VmKey,
    hostname: &str,
    uuid: &str,
    errs: &mut Errors,
) -> Option<Seed> {
    for k in ci.extra.keys() {
        let why = if k.ends_with("SecretRef") || k == "secretRef" {
            "Secrets need a cluster; kvirt does not read them yet"
        } else {
            super::UNSUPPORTED
        };
        errs.add(format!("{path}.{k}"), why);
    }
    let user = data(&ci.user_data, &ci.user_data_base64, path, "userData", errs);
    let network = data(
        &ci.network_data,
        &ci.network_data_base64,
        path,
        "networkData",
        errs,
    );
    let nothing = [
        &ci.user_data,
        &ci.user_data_base64,
        &ci.network_data,
        &ci.network_data_base64,
    ]
    .iter()
    .all(|d| d.is_none());
    if nothing && ci.extra.is_empty() {
        errs.add(path, "needs userData, userDataBase64 or networkData");
    }
    let instance_id = format!("{}.{}", key.name(), key.namespace());
    let files = match flavor {
        Flavor::NoCloud => {
            let meta = format!("instance-id: {instance_id}\nlocal-hostname: {hostname}\n");
            let mut files = vec![("meta-data".to_string(), meta.into_bytes())];
            files.push(("user-data".into(), user.unwrap_or_default()));
            if let Some(n) = network {
                files.push(("network-config".into(), n));
            }
            files
        }
        Flavor::ConfigDrive => {
            let meta = serde_json::json!({
                "instance_id": instance_id,
                "local_hostname": hostname,
                "hostname": hostname,
                "uuid": uuid,
            });
            let dir = "openstack/latest";
            let mut files = vec![(
                format!("{dir}/meta_data.json"),
                meta.to_string().into_bytes(),
            )];
            if let Some(u) = user {
                files.push((format!("{dir}/user_data"), u));
            }
            if let Some(n) = network {
                files.push((format!("{dir}/network_data.json"), n));
            }
            files
        }
    };
    Some(Seed {
        label: flavor.label(),
        files,
    })
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

    #[test]
    fn nocloud_has_kubevirts_layout() {
        let mut errs = Errors::default();
        let s = seed(
            Flavor::NoCloud,
            &ci("{userData: \"#cloud-config\\npassword: x\\n\", networkData: \"version: 2\\n\"}"),
            "spec.volumes[1].cloudInitNoCloud",
            &key(),
            "vm1",
            "u",
            &mut errs,
        )
        .unwrap();
        assert!(errs.0.is_empty(), "{:?}", errs.0);
        assert_eq!(s.label, "cidata");
        assert_eq!(
            files(&s),
            [
                (
                    "meta-data",
                    "instance-id: vm1.default\nlocal-hostname: vm1\n".into()
                ),
                ("user-data", "#cloud-config\npassword: x\n".into()),
                ("network-config", "version: 2\n".into()),
            ]
        );
    }

    #[test]
    fn config_drive_has_the_openstack_layout() {
        let mut errs = Errors::default();
        // "#!/bin/sh\necho hi\n"
        let s = seed(
            Flavor::ConfigDrive,
            &ci("{userDataBase64: IyEvYmluL3NoCmVjaG8gaGkK}"),
            "p",
            &key(),
            "host1",
            "5b9b0f4e-0000-4000-8000-000000000001",
            &mut errs,
        )
        .unwrap();
        assert!(errs.0.is_empty(), "{:?}", errs.0);
        assert_eq!(s.label, "config-2");
        let f = files(&s);
        assert_eq!(f[0].0, "openstack/latest/meta_data.json");
        let meta: serde_json::Value = serde_json::from_str(&f[0].1).unwrap();
        assert_eq!(meta["uuid"], "5b9b0f4e-0000-4000-8000-000000000001");
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
        let check = |yaml: &str| {
            let mut errs = Errors::default();
            seed(Flavor::NoCloud, &ci(yaml), "v", &key(), "h", "u", &mut errs);
            errs.0.into_iter().map(|e| e.field).collect::<Vec<_>>()
        };
        assert_eq!(check("{userData: a, userDataBase64: YQ==}"), ["v"]);
        assert_eq!(check("{userDataBase64: '***'}"), ["v.userDataBase64"]);
        assert_eq!(check("{}"), ["v"]);
        assert_eq!(
            check("{secretRef: {name: s}}"),
            ["v.secretRef"],
            "one error, not also 'needs userData'"
        );
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
