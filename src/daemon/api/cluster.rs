//! [`Cluster`] through the API server, with kvirtd's own identity: reads
//! of the VMI (where it runs), SubjectAccessReviews, VirtualMachine
//! requests as `kvirtctl` makes them, and the other kvirtds' addresses.

use super::{BoxFuture, Cluster};
use crate::core::key::VmKey;
use crate::core::subresource::requestheader::User;
use crate::core::subresource::{Access, ApiError};
use crate::core::vm::Verb;
use crate::core::vmi::{VirtualMachineInstance, NODE_LABEL};
use crate::sources::cluster::{aggregation, instancetypes, migrations, vms};
use kube::api::Api;
use std::net::SocketAddr;

pub struct KubeCluster {
    pub client: kube::Client,
}

fn kube_error(e: kube::Error) -> ApiError {
    match e {
        kube::Error::Api(s) => ApiError::new(s.code, "InternalError", s.message),
        e => ApiError::internal(e.to_string()),
    }
}

/// kvirt's refusals of a VM request, as virt-api answers them.
fn vm_refusal(key: &VmKey, message: String) -> ApiError {
    if message.starts_with("no VirtualMachine") {
        ApiError::not_found("virtualmachine", key.name())
    } else if message.starts_with("VM ") {
        ApiError::conflict_on("virtualmachine", key.name(), &message)
    } else {
        // An API error while reading or writing.
        ApiError::internal(message)
    }
}

impl Cluster for KubeCluster {
    fn review<'a>(
        &'a self,
        user: &'a User,
        access: &'a Access,
    ) -> BoxFuture<'a, Result<(bool, String), String>> {
        Box::pin(async move {
            aggregation::review(&self.client, user, access)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn vmi_node<'a>(&'a self, key: &'a VmKey) -> BoxFuture<'a, Result<Option<String>, ApiError>> {
        Box::pin(async move {
            let api: Api<VirtualMachineInstance> =
                Api::namespaced(self.client.clone(), key.namespace());
            let Some(vmi) = api.get_opt(key.name()).await.map_err(kube_error)? else {
                return Ok(None);
            };
            let node = vmi
                .status
                .node_name
                .clone()
                .or_else(|| vmi.metadata.labels.as_ref()?.get(NODE_LABEL).cloned())
                .unwrap_or_default();
            Ok(Some(node))
        })
    }

    fn vm_request<'a>(
        &'a self,
        key: &'a VmKey,
        verb: Verb,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async move {
            vms::request(self.client.clone(), key, verb)
                .await
                .map_err(|m| vm_refusal(key, m))
        })
    }

    fn expand_spec<'a>(
        &'a self,
        key: &'a VmKey,
    ) -> BoxFuture<'a, Result<serde_json::Value, ApiError>> {
        Box::pin(async move {
            match instancetypes::expand(&self.client, key).await {
                Ok(Some(vm)) => Ok(vm),
                Ok(None) => Err(ApiError::not_found("virtualmachine", key.name())),
                Err(e) => Err(ApiError::internal(e)),
            }
        })
    }

    fn migrate<'a>(
        &'a self,
        key: &'a VmKey,
        added_node_selector: std::collections::BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<String, ApiError>> {
        Box::pin(async move {
            let api: Api<VirtualMachineInstance> =
                Api::namespaced(self.client.clone(), key.namespace());
            let Some(vmi) = api.get_opt(key.name()).await.map_err(kube_error)? else {
                return Err(ApiError::not_found("virtualmachine", key.name()));
            };
            if vmi.status.phase != Some(crate::core::vmi::Phase::Running) {
                // virt-api's answer for a VM without a running VMI.
                return Err(ApiError::conflict_on(
                    "virtualmachine",
                    key.name(),
                    "VM is not running",
                ));
            }
            let objects = migrations::KubeMigrations {
                client: self.client.clone(),
            };
            // Labelled for the VMI's host at once: the leader need not.
            let host = vmi.metadata.labels.as_ref().and_then(|l| l.get(NODE_LABEL));
            objects
                .create(key, added_node_selector, None, host.map(String::as_str))
                .await
                .map(|name| format!("migration {name} made"))
                .map_err(kube_error)
        })
    }

    fn peer<'a>(&'a self, node: &'a str) -> BoxFuture<'a, Result<Option<SocketAddr>, String>> {
        Box::pin(async move {
            aggregation::peer(&self.client, node)
                .await
                .map_err(|e| e.to_string())
        })
    }
}
