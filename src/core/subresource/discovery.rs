//! Discovery documents of the group, listing what kvirt serves (and only
//! that: a client that asks discovery before calling learns the truth),
//! and the version document virtctl compares with its own.

use super::{VmAction, VmiAction, GROUP, VERSIONS};
use serde_json::{json, Value};

/// The KubeVirt release whose API kvirt serves: `virtctl version` shows it
/// as the server's, and virtctl of that minor version warns of nothing.
pub const KUBEVIRT_VERSION: &str = "v1.9.0";

const VMI_ACTIONS: [VmiAction; 8] = [
    VmiAction::Console,
    VmiAction::Vnc,
    VmiAction::Pause,
    VmiAction::Unpause,
    VmiAction::SoftReboot,
    VmiAction::GuestOsInfo,
    VmiAction::UserList,
    VmiAction::FilesystemList,
];
const VM_ACTIONS: [VmAction; 5] = [
    VmAction::Start,
    VmAction::Stop,
    VmAction::Restart,
    VmAction::ExpandSpec,
    VmAction::Migrate,
];

/// `GET /apis/subresources.kubevirt.io`
pub fn group() -> Value {
    let versions: Vec<Value> = VERSIONS
        .iter()
        .map(|v| json!({"groupVersion": format!("{GROUP}/{v}"), "version": v}))
        .collect();
    json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": versions,
        "preferredVersion": versions[0],
    })
}

/// `GET /apis/subresources.kubevirt.io/{version}`: each entry as virt-api
/// writes it (name and namespaced only), listing what kvirt serves.
pub fn resources(version: &str) -> Value {
    let entry = |name: String| {
        json!({
            "name": name,
            "singularName": "",
            "namespaced": true,
            "kind": "",
            "verbs": null,
        })
    };
    let mut list: Vec<Value> = VMI_ACTIONS
        .iter()
        .map(|a| entry(format!("virtualmachineinstances/{}", a.name())))
        .collect();
    list.extend(
        VM_ACTIONS
            .iter()
            .map(|a| entry(format!("virtualmachines/{}", a.name()))),
    );
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": format!("{GROUP}/{version}"),
        "resources": list,
    })
}

/// `GET .../version`: KubeVirt's `version.Info`, with kvirt's own build in
/// `gitCommit` so an operator sees which kvirt answered.
pub fn version(kvirt_version: &str, platform: &str) -> Value {
    json!({
        "gitVersion": KUBEVIRT_VERSION,
        "gitCommit": format!("kvirt-{kvirt_version}"),
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
        "goVersion": "",
        "compiler": "kvirt",
        "platform": platform,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_lists_what_is_served() {
        let r = resources("v1");
        assert_eq!(r["groupVersion"], "subresources.kubevirt.io/v1");
        let names: Vec<&str> = r["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        for want in [
            "virtualmachineinstances/console",
            "virtualmachineinstances/vnc",
            "virtualmachineinstances/pause",
            "virtualmachines/start",
            "virtualmachines/expand-spec",
            "virtualmachines/migrate",
        ] {
            assert!(names.contains(&want), "{want} in {names:?}");
        }
        // Not served: not listed.
        assert!(!names.iter().any(|n| n.ends_with("/addvolume")));
        assert_eq!(group()["preferredVersion"]["version"], "v1");
        assert_eq!(
            version("0.1.0", "linux/x86_64")["gitVersion"],
            KUBEVIRT_VERSION
        );
    }
}
