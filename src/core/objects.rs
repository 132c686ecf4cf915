//! Objects a VMI refers to: the Secrets, ConfigMaps and ServiceAccount
//! tokens of its volumes, and the NetworkAttachmentDefinitions of its
//! secondary networks. The converter names them ([`ObjectRef`]); the
//! controller reads them through the VMI source when the VM starts (never
//! while it runs): the seed images carry their data, the CNI plugins get
//! the networks' configs.

use std::collections::BTreeMap;

/// One object of a namespace (the VMI's, or a network's).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectRef {
    /// `k8s.cni.cncf.io/v1`: its `spec.config` as [`NAD_CONFIG`], and its
    /// `k8s.v1.cni.cncf.io/resourceName` annotation as [`NAD_RESOURCE`].
    NetworkAttachmentDefinition(String),
    Secret(String),
    ConfigMap(String),
    /// A fresh token of this ServiceAccount, with `namespace` and `ca.crt`,
    /// the files a pod's service account volume has.
    ServiceAccountToken(String),
}

impl ObjectRef {
    pub fn name(&self) -> &str {
        match self {
            ObjectRef::Secret(n)
            | ObjectRef::ConfigMap(n)
            | ObjectRef::ServiceAccountToken(n)
            | ObjectRef::NetworkAttachmentDefinition(n) => n,
        }
    }
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectRef::Secret(n) => write!(f, "secret {n:?}"),
            ObjectRef::ConfigMap(n) => write!(f, "configmap {n:?}"),
            ObjectRef::ServiceAccountToken(n) => write!(f, "serviceaccount {n:?}"),
            ObjectRef::NetworkAttachmentDefinition(n) => {
                write!(f, "network-attachment-definition {n:?}")
            }
        }
    }
}

/// A NetworkAttachmentDefinition's data: its config and device resource.
pub const NAD_CONFIG: &str = "config";
pub const NAD_RESOURCE: &str = "resourceName";
/// The annotation that ties a network to a device plugin's resource.
pub const NAD_RESOURCE_ANNOTATION: &str = "k8s.v1.cni.cncf.io/resourceName";

/// A NetworkAttachmentDefinition object's data.
pub fn nad_data(object: &serde_json::Value) -> ObjectData {
    let mut data = ObjectData::new();
    if let Some(c) = object.pointer("/spec/config").and_then(|c| c.as_str()) {
        data.insert(NAD_CONFIG.into(), c.as_bytes().to_vec());
    }
    let resource = object
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(NAD_RESOURCE_ANNOTATION))
        .and_then(|r| r.as_str());
    if let Some(r) = resource {
        data.insert(NAD_RESOURCE.into(), r.as_bytes().to_vec());
    }
    data
}

/// An object's data: key → bytes (a ConfigMap's `data` and `binaryData`
/// alike).
pub type ObjectData = BTreeMap<String, Vec<u8>>;

/// What a start read: `None` for an object that does not exist.
pub type Objects = BTreeMap<ObjectRef, Option<ObjectData>>;

/// A key that can be a file name in a seed image: Kubernetes allows only
/// `[-._a-zA-Z0-9]+`, and kvirt checks again rather than trust the API.
pub fn is_file_name(key: &str) -> bool {
    !key.is_empty()
        && key != "."
        && key != ".."
        && key.len() <= 253
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_single_safe_components() {
        for ok in ["userdata", "ca.crt", "a-b_c.d", ".hidden"] {
            assert!(is_file_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "../x", "a b", "é", &"x".repeat(254)] {
            assert!(!is_file_name(bad), "{bad}");
        }
    }
}
