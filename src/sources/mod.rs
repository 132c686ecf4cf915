//! Where VMIs come from and where their status and Events go: a directory
//! of manifests ([`manifest`], standalone) or a Kubernetes API server
//! ([`cluster`]). Both feed the loop with [`Trigger`]s and implement the
//! write side below; neither knows the loop itself.
//!
//! [`Trigger`]: crate::core::trigger::Trigger

pub mod cluster;
pub mod manifest;

use crate::core::key::VmKey;
use crate::core::migration::MigrationState;
use crate::core::objects::{ObjectData, ObjectRef};
use crate::core::pvc::{DataVolume, User};
use crate::core::quota::{Claim, Hard};
use crate::core::vmi::VirtualMachineInstance;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use std::future::Future;
use std::path::PathBuf;

/// Kubernetes' timestamp form: RFC 3339, UTC, whole seconds.
pub fn now_rfc3339() -> String {
    let now = jiff::Timestamp::now();
    jiff::Timestamp::from_second(now.as_second())
        .unwrap_or(now)
        .to_string()
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{path}: {message}")]
    Manifest { path: PathBuf, message: String },
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("reading {object} in namespace {namespace}: {message}")]
    Object {
        namespace: String,
        object: ObjectRef,
        message: String,
    },
    /// kvirtd may not read the namespace's Secrets, ConfigMaps and tokens:
    /// an administrator has not opted it in.
    #[error(
        "namespace {namespace} is not opted in: kvirtd may not read its Secrets, ConfigMaps or \
         ServiceAccount tokens ({object}); an administrator opts it in with \
         `kvirtd --print-rbac --namespace {namespace} | kubectl apply -f -`"
    )]
    NotOptedIn {
        namespace: String,
        object: ObjectRef,
    },
    #[error("claim {namespace}/{name}: {message}")]
    Claim {
        namespace: String,
        name: String,
        message: String,
    },
    #[error("reading the ResourceQuotas and VMIs of namespace {namespace}: {message}")]
    Allowance { namespace: String, message: String },
    #[error("reading VirtualMachine {namespace}/{name}: {message}")]
    VirtualMachine {
        namespace: String,
        name: String,
        message: String,
    },
}

/// Where a VMI's ownership lives, as a live migration hands it from host
/// to host: a manifest file (standalone), or the VMI's node in the API
/// server (a cluster).
pub trait Handover: Send + Sync + 'static {
    /// Whether this host's VMIs are its manifests, which it may move and
    /// stop itself.
    fn standalone(&self) -> bool;
    /// Whether the VMI of `key` (instance `vmi_uid`) could be let go: asked
    /// before a migration starts.
    fn may_let_go(&self, key: &VmKey, vmi_uid: &str) -> Result<(), String>;
    /// Source: the VM runs at `state.target_node` now (its commit is
    /// confirmed): its VMI becomes that host's, `state` recorded on it.
    fn let_go<'a>(
        &'a self,
        vmi: &'a VirtualMachineInstance,
        state: &'a MigrationState,
    ) -> futures::future::BoxFuture<'a, Result<(), String>>;
    /// Target: the VM arrived. `Ok(true)`: the VMI is this host's now;
    /// `Ok(false)`: it is once a source of this host lists it (the source
    /// hands it over).
    fn take_on(&self, vmi: &VirtualMachineInstance) -> Result<bool, String>;
}

/// The write side of a VMI source: the status kvirtd owns, and the hold
/// that keeps a VMI from vanishing before its VM is cleaned up.
pub trait StatusStore: Send + Sync + 'static {
    fn load(&self, key: &VmKey) -> impl Future<Output = Option<VirtualMachineInstance>> + Send;
    /// Saves the VMI with its new status; only called when the status changed.
    fn save(
        &self,
        vmi: &VirtualMachineInstance,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;
    /// Called before anything of the VM is made on the host (a finalizer).
    fn hold(
        &self,
        _vmi: &VirtualMachineInstance,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }
    /// Called once a deleted VMI's VM is entirely gone from the host.
    fn release(
        &self,
        _vmi: &VirtualMachineInstance,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }
    /// Called once the VM of a VMI that is no longer wanted is entirely
    /// gone from the host: its status goes too, so the same manifest put
    /// back later (the same UID) starts afresh.
    fn forget(&self, _id: &str) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// An object in the VMI's namespace its volumes name, `None` when it
    /// does not exist. Only a cluster has them.
    fn object(
        &self,
        namespace: &str,
        object: &ObjectRef,
    ) -> impl Future<Output = Result<Option<ObjectData>, SourceError>> + Send {
        let err = SourceError::Object {
            namespace: namespace.into(),
            object: object.clone(),
            message: "there is no cluster to read it from".into(),
        };
        async { Err(err) }
    }
    /// What bounds the emptyDisks of `namespace`'s VMs (its
    /// ResourceQuotas' `ephemeral-storage`) and what each of its VMIs
    /// claims. Without a cluster there are no quotas.
    fn allowance(
        &self,
        _namespace: &str,
    ) -> impl Future<Output = Result<(Vec<Hard>, Vec<Claim>), SourceError>> + Send {
        async { Ok((Vec::new(), Vec::new())) }
    }
    /// A claim of `namespace` as the cluster has it: the PVC, its bound
    /// PV and its StorageClass's binding mode. Only a cluster has them.
    fn claim(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<ClaimObjects, SourceError>> + Send {
        let err = SourceError::Claim {
            namespace: namespace.into(),
            name: name.into(),
            message: "there is no cluster to read it from".into(),
        };
        async { Err(err) }
    }
    /// The DataVolume `namespace/name`, `None` when there is none.
    fn data_volume(
        &self,
        namespace: &str,
        name: &str,
    ) -> impl Future<Output = Result<Option<DataVolume>, SourceError>> + Send {
        let err = SourceError::Claim {
            namespace: namespace.into(),
            name: name.into(),
            message: "DataVolumes need a cluster".into(),
        };
        async { Err(err) }
    }
    /// A `WaitForFirstConsumer` claim is bound for `node`: what the
    /// scheduler does for a pod.
    fn select_node(
        &self,
        _namespace: &str,
        _name: &str,
        _node: &str,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }
    /// `user` is recorded on the claim, with kvirt's finalizer, unless
    /// the claim's access modes forbid it (then `Ok(Err(why))`).
    fn hold_claim(
        &self,
        _namespace: &str,
        _name: &str,
        _user: &User,
    ) -> impl Future<Output = Result<Result<(), String>, SourceError>> + Send {
        async { Ok(Ok(())) }
    }
    /// The VMI of `uid` no longer uses the claim: its record goes, and
    /// the finalizer with the last one.
    fn release_claim(
        &self,
        _namespace: &str,
        _name: &str,
        _uid: &str,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        async { Ok(()) }
    }
    /// Whether the VirtualMachine `namespace/name` with this uid still
    /// exists and is not being deleted. Without a cluster there is nobody
    /// to ask, and the answer is yes: what it owns stays.
    fn virtual_machine_exists(
        &self,
        _namespace: &str,
        _name: &str,
        _uid: &str,
    ) -> impl Future<Output = Result<bool, SourceError>> + Send {
        async { Ok(true) }
    }
}

/// A claim as the cluster has it.
#[derive(Clone, Debug, Default)]
pub struct ClaimObjects {
    pub pvc: Option<PersistentVolumeClaim>,
    pub pv: Option<PersistentVolume>,
    /// The StorageClass's `volumeBindingMode`.
    pub binding_mode: Option<String>,
}

/// KubeVirt's event reasons, as kvirtd records them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    Created,
    Started,
    ShuttingDown,
    Stopped,
    SyncFailed,
    /// A containerDisk is in the image cache (kubelet's reasons).
    Pulled,
    ErrImagePull,
    /// A Secret, ConfigMap or ServiceAccount a volume names cannot be read
    /// (kubelet's reason when a pod's volume cannot be set up).
    FailedMount,
    /// A volume reads Secrets, ConfigMaps or tokens of a namespace an
    /// administrator has not opted in.
    NamespaceNotOptedIn,
    /// The VM's libvirt daemon died and systemd started it again.
    DaemonRestarted,
    /// The VM's libvirt daemon does not answer.
    DaemonUnresponsive,
    /// The VMI's node stopped renewing its Lease: the VMI is failed so
    /// that its VirtualMachine runs it again elsewhere (KubeVirt's reason).
    NodeUnresponsive,
    /// The VM's emptyDisks do not fit its namespace's ResourceQuota.
    ExceededQuota,
    /// The namespace's ResourceQuotas cannot be read: nothing starts
    /// that might not fit them.
    QuotaUnknown,
    /// A claim is not Bound yet (or its PV is not found).
    PVCNotBound,
    /// A DataVolume is not populated yet.
    DataVolumeNotReady,
    /// A ReadWriteOnce claim is used by a VMI on another node.
    PVCInUse,
    /// A claim's disk is smaller than asked, within KubeVirt's toleration.
    ToleratedSmallPV,
    /// Too few of the host's dedicated CPUs are free (kube-scheduler's
    /// reason when no node has room for a pod).
    FailedScheduling,
    /// A secondary network cannot be attached: its
    /// NetworkAttachmentDefinition is missing or unusable, or a CNI plugin
    /// failed (kubelet's reason when a pod's network cannot be set up).
    FailedCreatePodSandBox,
}

/// Where Events about a VMI go (the log in standalone mode, Event objects
/// in a cluster). Recording never blocks the loop and never fails it.
pub trait Recorder: Send + Sync + 'static {
    fn record(
        &self,
        vmi: &VirtualMachineInstance,
        reason: EventReason,
        message: &str,
        warning: bool,
    );
}
