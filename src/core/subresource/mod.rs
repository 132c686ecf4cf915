//! KubeVirt's aggregated API `subresources.kubevirt.io`, as virt-api
//! serves it and `virtctl` calls it: which request is which
//! ([`route`]), what a user must be allowed to make it ([`Route::access`]),
//! discovery and version documents, and the `Status` bodies of errors.
//! Pure: the server that speaks HTTP is `daemon::api`.

pub mod admit;
pub mod discovery;
pub mod error;
pub mod options;
pub mod requestheader;

use crate::core::key::VmKey;
pub use error::ApiError;

pub const GROUP: &str = "subresources.kubevirt.io";
/// virt-api serves both; virtctl of KubeVirt 1.x calls `v1`.
pub const VERSIONS: [&str; 2] = ["v1", "v1alpha3"];

/// What a VirtualMachine's subresource asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmAction {
    Start,
    Stop,
    Restart,
    /// `GET expand-spec`: the VM with its instancetype and preference
    /// applied.
    ExpandSpec,
    /// `PUT migrate`: a `VirtualMachineInstanceMigration` of the VM's VMI.
    Migrate,
}

/// What a VirtualMachineInstance's subresource asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmiAction {
    Pause,
    Unpause,
    SoftReboot,
    Console,
    Vnc,
    GuestOsInfo,
    UserList,
    FilesystemList,
}

impl VmiAction {
    /// Served by the host that runs the VMI, and nowhere else.
    pub fn name(self) -> &'static str {
        match self {
            VmiAction::Pause => "pause",
            VmiAction::Unpause => "unpause",
            VmiAction::SoftReboot => "softreboot",
            VmiAction::Console => "console",
            VmiAction::Vnc => "vnc",
            VmiAction::GuestOsInfo => "guestosinfo",
            VmiAction::UserList => "userlist",
            VmiAction::FilesystemList => "filesystemlist",
        }
    }

    pub fn is_stream(self) -> bool {
        matches!(self, VmiAction::Console | VmiAction::Vnc)
    }

    /// Reads the guest agent: nothing changes.
    pub fn is_query(self) -> bool {
        matches!(
            self,
            VmiAction::GuestOsInfo | VmiAction::UserList | VmiAction::FilesystemList
        )
    }
}

impl VmAction {
    pub fn name(self) -> &'static str {
        match self {
            VmAction::Start => "start",
            VmAction::Stop => "stop",
            VmAction::Restart => "restart",
            VmAction::ExpandSpec => "expand-spec",
            VmAction::Migrate => "migrate",
        }
    }
}

/// One request of the group, by path and method.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /apis/subresources.kubevirt.io`
    Group,
    /// `GET /apis/subresources.kubevirt.io/{version}`
    Resources {
        version: &'static str,
    },
    /// `GET .../{version}/version`
    Version,
    /// `GET .../{version}/healthz`
    Healthz,
    Vm {
        key: VmKey,
        action: VmAction,
    },
    Vmi {
        key: VmKey,
        action: VmiAction,
    },
}

/// The authorisation a route needs, as KubeVirt's RBAC names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    pub verb: &'static str,
    pub version: &'static str,
    pub resource: &'static str,
    pub subresource: &'static str,
    pub namespace: String,
    pub name: String,
}

impl Route {
    /// What a SubjectAccessReview must allow; `None` for discovery, version
    /// and health, which every authenticated caller may read.
    pub fn access(&self, version: &'static str) -> Option<Access> {
        let (resource, subresource, key, verb) = match self {
            Route::Group | Route::Resources { .. } | Route::Version | Route::Healthz => {
                return None
            }
            Route::Vm { key, action } => (
                "virtualmachines",
                action.name(),
                key,
                match action {
                    VmAction::ExpandSpec => "get",
                    _ => "update",
                },
            ),
            Route::Vmi { key, action } => (
                "virtualmachineinstances",
                action.name(),
                key,
                match action {
                    VmiAction::Pause | VmiAction::Unpause | VmiAction::SoftReboot => "update",
                    _ => "get",
                },
            ),
        };
        Some(Access {
            verb,
            version,
            resource,
            subresource,
            namespace: key.namespace().to_owned(),
            name: key.name().to_owned(),
        })
    }

    /// The method each route answers to.
    fn method(&self) -> &'static str {
        match self {
            Route::Vm {
                action: VmAction::ExpandSpec,
                ..
            } => "GET",
            Route::Vm { .. }
            | Route::Vmi {
                action: VmiAction::Pause | VmiAction::Unpause | VmiAction::SoftReboot,
                ..
            } => "PUT",
            _ => "GET",
        }
    }
}

/// The route of `method path`, and the group version it was asked in.
pub fn route(method: &str, path: &str) -> Result<(Route, &'static str), ApiError> {
    let not_found = || ApiError::not_found_path(path);
    let rest = path
        .strip_prefix("/apis/")
        .and_then(|p| p.strip_prefix(GROUP))
        .ok_or_else(not_found)?;
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() {
        return check_method(method, Route::Group, VERSIONS[0]);
    }
    let rest = rest.strip_prefix('/').ok_or_else(not_found)?;
    let (version, rest) = rest.split_once('/').unwrap_or((rest, ""));
    let version = *VERSIONS
        .iter()
        .find(|v| **v == version)
        .ok_or_else(not_found)?;
    let parts: Vec<&str> = if rest.is_empty() {
        vec![]
    } else {
        rest.split('/').collect()
    };
    let route = match parts.as_slice() {
        [] => Route::Resources { version },
        ["version"] => Route::Version,
        ["healthz"] => Route::Healthz,
        ["namespaces", ns, resource, name, sub] => {
            let key = VmKey::new(ns, name).map_err(|_| not_found())?;
            match *resource {
                "virtualmachines" => Route::Vm {
                    key,
                    action: vm_action(sub).ok_or_else(not_found)?,
                },
                "virtualmachineinstances" => Route::Vmi {
                    key,
                    action: vmi_action(sub).ok_or_else(not_found)?,
                },
                _ => return Err(not_found()),
            }
        }
        _ => return Err(not_found()),
    };
    check_method(method, route, version)
}

fn check_method(
    method: &str,
    route: Route,
    version: &'static str,
) -> Result<(Route, &'static str), ApiError> {
    if method == route.method() {
        Ok((route, version))
    } else {
        Err(ApiError::method_not_allowed(method))
    }
}

fn vm_action(s: &str) -> Option<VmAction> {
    Some(match s {
        "start" => VmAction::Start,
        "stop" => VmAction::Stop,
        "restart" => VmAction::Restart,
        "expand-spec" => VmAction::ExpandSpec,
        "migrate" => VmAction::Migrate,
        _ => return None,
    })
}

fn vmi_action(s: &str) -> Option<VmiAction> {
    Some(match s {
        "pause" => VmiAction::Pause,
        "unpause" => VmiAction::Unpause,
        "softreboot" => VmiAction::SoftReboot,
        "console" => VmiAction::Console,
        "vnc" => VmiAction::Vnc,
        "guestosinfo" => VmiAction::GuestOsInfo,
        "userlist" => VmiAction::UserList,
        "filesystemlist" => VmiAction::FilesystemList,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ns: &str, name: &str) -> VmKey {
        VmKey::new(ns, name).unwrap()
    }

    #[test]
    fn routes_name_the_object_and_its_subresource() {
        let cases = [
            ("GET", "/apis/subresources.kubevirt.io", Route::Group),
            (
                "GET",
                "/apis/subresources.kubevirt.io/v1",
                Route::Resources { version: "v1" },
            ),
            (
                "GET",
                "/apis/subresources.kubevirt.io/v1alpha3/",
                Route::Resources {
                    version: "v1alpha3",
                },
            ),
            ("GET", "/apis/subresources.kubevirt.io/v1/version", Route::Version),
            ("GET", "/apis/subresources.kubevirt.io/v1/healthz", Route::Healthz),
            (
                "PUT",
                "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/start",
                Route::Vm {
                    key: key("ns", "vm"),
                    action: VmAction::Start,
                },
            ),
            (
                "GET",
                "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/console",
                Route::Vmi {
                    key: key("ns", "vm"),
                    action: VmiAction::Console,
                },
            ),
            (
                "PUT",
                "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/softreboot",
                Route::Vmi {
                    key: key("ns", "vm"),
                    action: VmiAction::SoftReboot,
                },
            ),
        ];
        for (method, path, want) in cases {
            assert_eq!(route(method, path).unwrap().0, want, "{method} {path}");
        }
    }

    #[test]
    fn anything_else_is_not_found_or_not_allowed() {
        for path in [
            "/apis/kubevirt.io/v1",
            "/apis/subresources.kubevirt.iox/v1",
            "/apis/subresources.kubevirt.io/v2",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/migrate",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/pods/vm/console",
            "/apis/subresources.kubevirt.io/v1/namespaces/NS/virtualmachineinstances/vm/console",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/../console",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/console/x",
        ] {
            assert_eq!(route("GET", path).unwrap_err().code, 404, "{path}");
        }
        let e = route(
            "GET",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/start",
        )
        .unwrap_err();
        assert_eq!(e.code, 405);
    }

    #[test]
    fn access_is_kubevirts_rbac_vocabulary() {
        let (r, v) = route(
            "PUT",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachines/vm/stop",
        )
        .unwrap();
        let a = r.access(v).unwrap();
        assert_eq!(
            (a.verb, a.resource, a.subresource, a.namespace.as_str()),
            ("update", "virtualmachines", "stop", "ns")
        );
        let (r, v) = route(
            "GET",
            "/apis/subresources.kubevirt.io/v1/namespaces/ns/virtualmachineinstances/vm/guestosinfo",
        )
        .unwrap();
        let a = r.access(v).unwrap();
        assert_eq!((a.verb, a.subresource), ("get", "guestosinfo"));
        assert!(Route::Version.access("v1").is_none());
    }
}
