//! Cluster objects a VMI's volumes refer to: Secrets, ConfigMaps and
//! ServiceAccount tokens. The converter names them ([`ObjectRef`]); the
//! controller reads them through the VMI source when the VM starts (never
//! while it runs), and the seed images carry their data.

use std::collections::BTreeMap;

/// One object in the VMI's namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ObjectRef {
    Secret(String),
    ConfigMap(String),
    /// A fresh token of this ServiceAccount, with `namespace` and `ca.crt`,
    /// the files a pod's service account volume has.
    ServiceAccountToken(String),
}

impl std::fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ObjectRef::Secret(n) => write!(f, "secret {n:?}"),
            ObjectRef::ConfigMap(n) => write!(f, "configmap {n:?}"),
            ObjectRef::ServiceAccountToken(n) => write!(f, "serviceaccount {n:?}"),
        }
    }
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
