//! What the guest agent says of logged-in users and filesystems, as
//! libvirt hands it over (typed parameters `user.<i>.name`, `fs.<i>.*`)
//! and as KubeVirt answers `userlist` and `filesystemlist`. The guest
//! wrote every value: each string is bounded, each list capped.

use serde_json::{json, Value};
use std::collections::BTreeMap;

/// A typed parameter's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Param {
    Str(String),
    UInt(u64),
    Int(i64),
}

/// More than any real guest has; a hostile one gets no further.
const MAX_ITEMS: usize = 256;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuestUser {
    pub name: String,
    pub domain: Option<String>,
    /// Seconds since the epoch.
    pub login_time: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuestFs {
    pub name: String,
    pub mountpoint: String,
    pub fstype: String,
    pub total_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    pub disk_serials: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GuestDetails {
    pub users: Vec<GuestUser>,
    pub filesystems: Vec<GuestFs>,
}

/// `prefix.<i>.rest` → (i, rest).
fn indexed<'a>(field: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let rest = field.strip_prefix(prefix)?.strip_prefix('.')?;
    let (i, rest) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    (i < MAX_ITEMS).then_some((i, rest))
}

fn text(p: &Param) -> Option<String> {
    match p {
        Param::Str(s) => Some(crate::core::status::guest_text(s)),
        _ => None,
    }
}

fn number(p: &Param) -> Option<u64> {
    match p {
        Param::UInt(n) => Some(*n),
        Param::Int(n) => u64::try_from(*n).ok(),
        Param::Str(_) => None,
    }
}

/// From `virDomainGetGuestInfo`'s parameters.
pub fn parse(params: &[(String, Param)]) -> GuestDetails {
    let mut users: BTreeMap<usize, GuestUser> = BTreeMap::new();
    let mut fss: BTreeMap<usize, GuestFs> = BTreeMap::new();
    for (field, value) in params {
        if let Some((i, rest)) = indexed(field, "user") {
            let u = users.entry(i).or_default();
            match rest {
                "name" => u.name = text(value).unwrap_or_default(),
                "domain" => u.domain = text(value),
                // libvirt gives milliseconds; KubeVirt seconds.
                "login-time" => u.login_time = number(value).map(|ms| ms as f64 / 1000.0),
                _ => {}
            }
        } else if let Some((i, rest)) = indexed(field, "fs") {
            let f = fss.entry(i).or_default();
            match rest {
                "name" => f.name = text(value).unwrap_or_default(),
                "mountpoint" => f.mountpoint = text(value).unwrap_or_default(),
                "fstype" => f.fstype = text(value).unwrap_or_default(),
                "total-bytes" => f.total_bytes = number(value),
                "used-bytes" => f.used_bytes = number(value),
                _ => {
                    if let (Some((_, "serial")), Some(s)) = (indexed(rest, "disk"), text(value)) {
                        if f.disk_serials.len() < MAX_ITEMS {
                            f.disk_serials.push(s);
                        }
                    }
                }
            }
        }
    }
    GuestDetails {
        users: users.into_values().filter(|u| !u.name.is_empty()).collect(),
        filesystems: fss.into_values().collect(),
    }
}

/// KubeVirt's VirtualMachineInstanceGuestOSUserList.
pub fn user_list(d: &GuestDetails) -> Value {
    let items: Vec<Value> = d
        .users
        .iter()
        .map(|u| {
            let mut v = json!({"userName": u.name});
            if let Some(domain) = &u.domain {
                v["domain"] = json!(domain);
            }
            if let Some(t) = u.login_time {
                v["loginTime"] = json!(t);
            }
            v
        })
        .collect();
    json!({"metadata": {}, "items": items})
}

/// KubeVirt's VirtualMachineInstanceFileSystemList.
pub fn filesystem_list(d: &GuestDetails) -> Value {
    let items: Vec<Value> = d
        .filesystems
        .iter()
        .map(|f| {
            let mut v = json!({
                "diskName": f.name,
                "mountPoint": f.mountpoint,
                "fileSystemType": f.fstype,
                "usedBytes": f.used_bytes.unwrap_or(0),
                "totalBytes": f.total_bytes.unwrap_or(0),
            });
            if !f.disk_serials.is_empty() {
                v["disk"] = f
                    .disk_serials
                    .iter()
                    .map(|s| json!({"serial": s}))
                    .collect();
            }
            v
        })
        .collect();
    json!({"metadata": {}, "items": items})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(k: &str, v: &str) -> (String, Param) {
        (k.to_owned(), Param::Str(v.to_owned()))
    }

    fn n(k: &str, v: u64) -> (String, Param) {
        (k.to_owned(), Param::UInt(v))
    }

    #[test]
    fn libvirts_parameters_become_kubevirts_lists() {
        let d = parse(&[
            n("user.count", 1),
            s("user.0.name", "alice"),
            n("user.0.login-time", 1_700_000_000_500),
            n("fs.count", 1),
            s("fs.0.name", "vda1"),
            s("fs.0.mountpoint", "/"),
            s("fs.0.fstype", "ext4"),
            n("fs.0.total-bytes", 1000),
            n("fs.0.used-bytes", 400),
            n("fs.0.disk.count", 1),
            s("fs.0.disk.0.serial", "boot"),
        ]);
        let users = user_list(&d);
        assert_eq!(users["items"][0]["userName"], "alice");
        assert_eq!(users["items"][0]["loginTime"], 1_700_000_000.5);
        let fs = filesystem_list(&d);
        assert_eq!(fs["items"][0]["mountPoint"], "/");
        assert_eq!(fs["items"][0]["usedBytes"], 400);
        assert_eq!(fs["items"][0]["disk"][0]["serial"], "boot");
    }

    #[test]
    fn a_hostile_guest_gets_bounded() {
        let long = "x".repeat(100_000);
        let mut params = vec![s("user.0.name", &long), s("user.99999999.name", "far")];
        params.extend((0..1000).map(|i| s(&format!("fs.0.disk.{i}.serial"), "d")));
        let d = parse(&params);
        assert_eq!(d.users.len(), 1);
        assert!(d.users[0].name.len() < 1000);
        assert!(d.filesystems[0].disk_serials.len() <= MAX_ITEMS);
    }
}
