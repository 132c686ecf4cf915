//! Kubernetes: kvirtd as the node agent of a cluster without KubeVirt's
//! pods. VMIs labelled for this node come from a watch; status goes back as
//! a merge patch of the fields kvirtd owns (KubeVirt's VMI CRD has no status
//! subresource); Events, a finalizer and a Lease as a node agent keeps them.

/// `kube::Resource` for one of kvirt's own object types (KubeVirt's
/// kinds, namespaced, no dynamic type).
macro_rules! resource {
    ($t:ty, $kind:expr, $group:expr, $version:expr, $plural:expr) => {
        impl kube::Resource for $t {
            type DynamicType = ();
            type Scope = k8s_openapi::NamespaceResourceScope;
            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

pub mod aggregation;
pub mod claims;
pub mod csr;
pub mod events;
pub mod instancetypes;
pub mod leader;
pub mod lease;
pub mod migrations;
pub mod reaper;
pub mod replicas;
pub mod routing;
pub mod scheduler;
pub mod source;
pub mod status;
pub mod subresources;
pub mod vms;

use crate::core::vmi::VirtualMachineInstance;
use std::path::Path;

pub use crate::core::vmi::NODE_LABEL;
/// kvirt's own finalizer: the VMI stays until its VM is gone from the host.
pub const FINALIZER: &str = "kvirt.io/host-cleanup";
/// KubeVirt's, removed once the VMI is final and the host clean, as
/// virt-controller would.
pub const KUBEVIRT_FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";

/// The VMI and VM CRDs shipped for clusters without KubeVirt.
pub const CRD_YAML: &str = include_str!("../../../packaging/kubernetes/crd.yaml");
/// The least-privilege RBAC kvirtd needs.
pub const RBAC_YAML: &str = include_str!("../../../packaging/kubernetes/rbac.yaml");

/// What registers `subresources.kubevirt.io` (`@CA_BUNDLE@` to fill).
pub const API_YAML: &str = include_str!("../../../packaging/kubernetes/api.yaml");

/// [`API_YAML`] with the CA that signs every kvirtd's serving certificate.
pub fn api_service_yaml(ca_pem: &[u8]) -> String {
    use base64::Engine;
    API_YAML.replace(
        "@CA_BUNDLE@",
        &base64::engine::general_purpose::STANDARD.encode(ca_pem),
    )
}

/// The RoleBinding that opts `namespace` in: kvirtd may read the Secrets,
/// ConfigMaps and ServiceAccount tokens its VMIs' volumes name there.
pub fn opt_in_yaml(namespace: &str) -> String {
    format!(
        "apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: kvirt-node-volumes
  namespace: {namespace}
  labels:
    app.kubernetes.io/part-of: kvirt
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: kvirt-node-volumes
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: kvirt:nodes
"
    )
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig { path: String, message: String },
    #[error("{object}: {message}")]
    Invalid { object: String, message: String },
    #[error("VMI {vmi}: {op}: {source}")]
    Api {
        vmi: String,
        op: &'static str,
        source: Box<kube::Error>,
    },
}

/// Wraps an API error with the object it was about and what was done.
pub(crate) fn api_error(
    object: String,
    op: &'static str,
) -> impl FnOnce(kube::Error) -> ClusterError {
    move |e| ClusterError::Api {
        vmi: object,
        op,
        source: Box::new(e),
    }
}

resource!(
    VirtualMachineInstance,
    "VirtualMachineInstance",
    "kubevirt.io",
    "v1",
    "virtualmachineinstances"
);

/// A client from a kubeconfig file (kvirtd is a host daemon, not a pod),
/// and the CA the API server's certificate is checked against, as PEM: a
/// serviceAccount disk gives it to the guest as `ca.crt`.
pub async fn client(path: &Path) -> Result<(kube::Client, Option<Vec<u8>>), ClusterError> {
    let err = |message: String| ClusterError::Kubeconfig {
        path: path.display().to_string(),
        message,
    };
    let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| err(e.to_string()))?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| err(e.to_string()))?;
    let ca = cfg.root_cert.as_deref().map(pem_certificates);
    let client = kube::Client::try_from(cfg).map_err(|e| err(e.to_string()))?;
    Ok((client, ca))
}

/// DER certificates as one PEM bundle.
fn pem_certificates(ders: &[Vec<u8>]) -> Vec<u8> {
    use base64::Engine as _;
    let mut pem = String::new();
    for der in ders {
        let b64 = base64::engine::general_purpose::STANDARD.encode(der);
        pem.push_str("-----BEGIN CERTIFICATE-----\n");
        for line in b64.as_bytes().chunks(64) {
            pem.push_str(&String::from_utf8_lossy(line));
            pem.push('\n');
        }
        pem.push_str("-----END CERTIFICATE-----\n");
    }
    pem.into_bytes()
}

fn api_err(
    vmi: &VirtualMachineInstance,
    op: &'static str,
) -> impl FnOnce(kube::Error) -> ClusterError {
    let name = vmi.key().map_or_else(|_| "?".into(), |k| k.to_string());
    move |e| ClusterError::Api {
        vmi: name,
        op,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod conversation_tests;

#[cfg(test)]
mod tests {
    #[test]
    fn certificates_become_pem_lines_of_64() {
        let pem = String::from_utf8(super::pem_certificates(&[vec![0u8; 60], vec![1]])).unwrap();
        let lines: Vec<&str> = pem.lines().collect();
        assert_eq!(lines[0], "-----BEGIN CERTIFICATE-----");
        assert_eq!(lines[1].len(), 64);
        assert_eq!(lines[2], "AAAAAAAAAAAAAAAA");
        assert_eq!(lines[3], "-----END CERTIFICATE-----");
        assert_eq!(
            &lines[4..],
            [
                "-----BEGIN CERTIFICATE-----",
                "AQ==",
                "-----END CERTIFICATE-----"
            ]
        );
    }
}
