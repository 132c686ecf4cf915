//! PersistentVolumeClaims as kvirt runs them without kubelet: which claims
//! a VMI names, whether a claim's volume is one this host can reach (and
//! how), what size a new `disk.img` gets, and who uses a claim. Pure: the
//! sources bring the cluster's objects (or the host's configuration), the
//! host makes the files.

use crate::core::quantity::Quantity;
use crate::core::scheduling::{self, HostFacts};
use crate::core::vmi::VmiSpec;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// kvirtd's own finalizer on a claim one of its VMs uses: no pod holds the
/// claim, and `kubernetes.io/pvc-protection` counts pods only.
pub const FINALIZER: &str = "kvirt.io/pvc-in-use";
/// Who uses the claim: a JSON list of [`User`]s.
pub const USERS_ANNOTATION: &str = "kvirt.io/used-by";
/// What a provisioner of a `WaitForFirstConsumer` class waits for.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// CDI's default share of a filesystem volume kept for the file system.
pub const DEFAULT_FILESYSTEM_OVERHEAD: f64 = 0.055;
/// KubeVirt's `MinimumReservePVCBytes`: left free beside a new disk.img.
pub const RESERVE_BYTES: u64 = 131_072;
/// KubeVirt's `LessPVCSpaceToleration`: a disk.img may be this much
/// smaller than asked, in percent, when the volume has less room.
pub const TOLERATION_PERCENT: u64 = 10;
/// The guest disk in a filesystem volume, as KubeVirt names it.
pub const DISK_IMG: &str = "disk.img";

const MIB: u64 = 1 << 20;

/// A volume of the VMI that names a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimUse {
    pub volume: String,
    pub claim: String,
    pub read_only: bool,
    /// Through a DataVolume of the claim's name.
    pub data_volume: bool,
}

/// The claims a VMI's volumes name, in order, each once.
pub fn claims_of(spec: &VmiSpec) -> Vec<ClaimUse> {
    let mut out: Vec<ClaimUse> = Vec::new();
    for v in &spec.volumes {
        let u = match (&v.persistent_volume_claim, &v.data_volume) {
            (Some(c), _) => ClaimUse {
                volume: v.name.clone(),
                claim: c.claim_name.clone(),
                read_only: c.read_only == Some(true),
                data_volume: false,
            },
            (None, Some(d)) => ClaimUse {
                volume: v.name.clone(),
                claim: d.name.clone(),
                read_only: false,
                data_volume: true,
            },
            (None, None) => continue,
        };
        if !out.iter().any(|o| o.claim == u.claim) {
            out.push(u);
        }
    }
    out
}

/// Where a claim's data is on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `volumeMode: Filesystem`: the volume's root directory, below the
    /// claim root it is reached through.
    Directory { root: PathBuf, dir: PathBuf },
    /// `volumeMode: Block`: the host's device node.
    Block(PathBuf),
}

/// A claim this host can use: what the converter and the host need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pvc {
    pub name: String,
    pub backend: Backend,
    /// The volume is read-only (a ReadOnlyMany-only claim).
    pub read_only: bool,
    /// `status.capacity.storage`, else the request.
    pub capacity: Option<Quantity>,
    pub request: Option<Quantity>,
    pub access_modes: Vec<String>,
}

impl Pvc {
    pub fn volume_mode(&self) -> &'static str {
        match self.backend {
            Backend::Directory { .. } => "Filesystem",
            Backend::Block(_) => "Block",
        }
    }

    /// The size a new disk.img gets: min(request, capacity) rounded down
    /// to 1 MiB, less the file system's overhead, as KubeVirt sizes it.
    pub fn disk_bytes(&self, overhead: f64) -> Result<u64, String> {
        let bytes = |q: &Option<Quantity>| q.as_ref().and_then(|q| q.to_bytes().ok());
        let usable = match (bytes(&self.request), bytes(&self.capacity)) {
            (Some(r), Some(c)) => r.min(c),
            (Some(x), None) | (None, Some(x)) => x,
            (None, None) => return Err(format!("claim {} has no size", self.name)),
        };
        let usable = usable / MIB * MIB;
        let target = ((usable as f64) * (1.0 - overhead)) as u64 / MIB * MIB;
        if target == 0 {
            return Err(format!(
                "claim {} is too small for a disk ({usable} bytes, overhead {overhead})",
                self.name
            ));
        }
        Ok(target)
    }

    /// `status.volumeStatus[].persistentVolumeClaimInfo`, as KubeVirt fills it.
    pub fn info(&self, overhead: f64) -> Value {
        let mut info = json!({
            "claimName": self.name,
            "accessModes": self.access_modes,
            "volumeMode": self.volume_mode(),
        });
        if let Some(c) = &self.capacity {
            info["capacity"] = json!({"storage": c.to_string()});
        }
        if let Some(r) = &self.request {
            info["requests"] = json!({"storage": r.to_string()});
        }
        if matches!(self.backend, Backend::Directory { .. }) {
            info["filesystemOverhead"] = json!(format!("{overhead}"));
        }
        info
    }
}

/// Why a claim cannot be used now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unusable {
    /// It may become usable: the VMI waits (`Pending`, the reason shown).
    Wait {
        reason: &'static str,
        message: String,
    },
    /// It cannot: the VMI is refused with the reason.
    Refuse {
        reason: &'static str,
        message: String,
    },
}

impl Unusable {
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Wait { reason, .. } | Self::Refuse { reason, .. } => reason,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Self::Wait { message, .. } | Self::Refuse { message, .. } => message,
        }
    }
}

fn refuse(reason: &'static str, message: String) -> Unusable {
    Unusable::Refuse { reason, message }
}

fn wait(reason: &'static str, message: String) -> Unusable {
    Unusable::Wait { reason, message }
}

/// The fields of a PV's spec that are not its volume source.
const NOT_SOURCES: &[&str] = &[
    "accessModes",
    "capacity",
    "claimRef",
    "mountOptions",
    "nodeAffinity",
    "persistentVolumeReclaimPolicy",
    "storageClassName",
    "volumeMode",
    "volumeAttributesClassName",
];

/// A Bound claim and its PV, checked against this host and the claim
/// roots (`storage.claim_roots`): which volume kinds kvirt reaches without
/// kubelet (a `local` or `hostPath` directory below a root, or a `local`
/// block device), and whether the PV's node affinity selects this host.
pub fn resolve(
    pvc: &PersistentVolumeClaim,
    pv: Option<&PersistentVolume>,
    host: &HostFacts,
    roots: &[PathBuf],
) -> Result<Pvc, Unusable> {
    let name = pvc.metadata.name.clone().unwrap_or_default();
    if pvc.metadata.deletion_timestamp.is_some() {
        return Err(refuse(
            "PVCTerminating",
            format!("claim {name} is being deleted"),
        ));
    }
    let spec = pvc.spec.clone().unwrap_or_default();
    let status = pvc.status.clone().unwrap_or_default();
    if status.phase.as_deref() != Some("Bound") {
        let phase = status.phase.unwrap_or_else(|| "Pending".into());
        return Err(wait(
            "PVCNotBound",
            format!("claim {name} is {phase}, not Bound"),
        ));
    }
    let Some(pv) = pv else {
        return Err(wait(
            "PVCNotBound",
            format!("claim {name} is Bound but its PersistentVolume is not found"),
        ));
    };
    let pv_name = pv.metadata.name.clone().unwrap_or_default();
    let pv_spec = pv.spec.clone().unwrap_or_default();
    affinity(&pv_spec, host).map_err(|why| {
        refuse(
            "PVCNodeAffinity",
            format!(
                "claim {name}: PersistentVolume {pv_name} is not reachable from node {} ({why})",
                host.node_name
            ),
        )
    })?;
    let block = spec.volume_mode.as_deref() == Some("Block");
    let (path, kind) = match (&pv_spec.local, &pv_spec.host_path) {
        (Some(l), _) => (l.path.clone(), "local"),
        (None, Some(h)) => (h.path.clone(), "hostPath"),
        (None, None) => {
            return Err(refuse(
                "PVCNotSupported",
                format!(
                    "claim {name}: PersistentVolume {pv_name} is of kind {}; kvirt runs local \
                     and hostPath volumes only (no CSI node client yet)",
                    kind_of(&pv_spec)
                ),
            ))
        }
    };
    let path = lexical_path(&path).map_err(|why| {
        refuse(
            "PVCNotSupported",
            format!("claim {name}: {kind} path {path:?} of {pv_name} {why}"),
        )
    })?;
    let backend = if block {
        if kind != "local" || !path.starts_with("/dev/") {
            return Err(refuse(
                "PVCNotSupported",
                format!(
                    "claim {name}: a Block claim needs a local PersistentVolume on a device \
                     under /dev ({pv_name} is {kind} {})",
                    path.display()
                ),
            ));
        }
        Backend::Block(path)
    } else {
        let root = roots
            .iter()
            .filter(|r| path.starts_with(r) && path != **r)
            .max_by_key(|r| r.components().count())
            .ok_or_else(|| {
                refuse(
                    "PVCNotSupported",
                    format!(
                        "claim {name}: {kind} path {} of {pv_name} is not below a claim root ({})",
                        path.display(),
                        list(roots)
                    ),
                )
            })?;
        Backend::Directory {
            root: root.clone(),
            dir: path,
        }
    };
    let modes = status.access_modes.clone().or(spec.access_modes.clone());
    let access_modes = modes.unwrap_or_default();
    let read_only = !access_modes.is_empty() && access_modes.iter().all(|m| m == "ReadOnlyMany");
    let storage = |m: Option<
        BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { m.and_then(|m| m.get("storage").map(|q| Quantity::new(&q.0))) };
    Ok(Pvc {
        name,
        backend,
        read_only,
        capacity: storage(status.capacity),
        request: storage(spec.resources.and_then(|r| r.requests)),
        access_modes,
    })
}

/// A claim of the host's own configuration (standalone), checked by the
/// rules a cluster's PV is: a directory below a claim root, or a device.
pub fn configured(
    name: &str,
    path: &str,
    volume_mode: &str,
    capacity: Option<&str>,
    read_only: bool,
    roots: &[PathBuf],
) -> Result<Pvc, String> {
    let path = lexical_path(path).map_err(|why| format!("path {path:?} {why}"))?;
    let backend = match volume_mode {
        "Filesystem" => {
            let root = roots
                .iter()
                .filter(|r| path.starts_with(r) && path != **r)
                .max_by_key(|r| r.components().count())
                .ok_or_else(|| {
                    format!(
                        "{} is not below a claim root ({})",
                        path.display(),
                        list(roots)
                    )
                })?;
            Backend::Directory {
                root: root.clone(),
                dir: path,
            }
        }
        "Block" if path.starts_with("/dev/") => Backend::Block(path),
        "Block" => return Err(format!("{} is not a device under /dev", path.display())),
        other => return Err(format!("volume_mode {other:?} is not Filesystem or Block")),
    };
    let capacity = match capacity {
        Some(c) => {
            let q: Quantity = c.parse().map_err(|e| format!("capacity {c:?}: {e}"))?;
            q.to_bytes().map_err(|e| format!("capacity {c:?}: {e}"))?;
            Some(q)
        }
        None if matches!(backend, Backend::Directory { .. }) && !read_only => {
            return Err("capacity is needed to make its disk.img".into())
        }
        None => None,
    };
    Ok(Pvc {
        name: name.to_owned(),
        backend,
        read_only,
        capacity,
        request: None,
        access_modes: vec![if read_only {
            "ReadOnlyMany"
        } else {
            "ReadWriteOnce"
        }
        .into()],
    })
}

fn list(roots: &[PathBuf]) -> String {
    if roots.is_empty() {
        return "none are configured: storage.claim_roots".into();
    }
    let r: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    r.join(", ")
}

/// The PV's volume source, by its field name (`csi`, `nfs`, ...).
fn kind_of(spec: &k8s_openapi::api::core::v1::PersistentVolumeSpec) -> String {
    let v = serde_json::to_value(spec).unwrap_or_default();
    let kinds: Vec<&str> = v
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .map(String::as_str)
        .filter(|k| !NOT_SOURCES.contains(k))
        .collect();
    match (kinds.first(), &spec.csi) {
        (_, Some(csi)) => format!("csi (driver {})", csi.driver),
        (Some(k), None) => (*k).to_owned(),
        (None, None) => "none".into(),
    }
}

/// A path as written: absolute and normalised, so that the root it is
/// below is the one it is reached through (the host opens it beneath that
/// root's fd, never following links out of it).
fn lexical_path(raw: &str) -> Result<PathBuf, &'static str> {
    if !raw.starts_with('/') {
        return Err("is not absolute");
    }
    if raw.chars().any(char::is_control)
        || raw.ends_with('/')
        || raw[1..]
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err("is not a normalised path");
    }
    Ok(PathBuf::from(raw))
}

/// The PV's required node affinity against this host; none means any.
fn affinity(
    spec: &k8s_openapi::api::core::v1::PersistentVolumeSpec,
    host: &HostFacts,
) -> Result<(), String> {
    let Some(required) = spec
        .node_affinity
        .as_ref()
        .and_then(|a| a.required.as_ref())
    else {
        return Ok(());
    };
    let mut host = host.clone();
    // kubelet's own label of every node.
    (host.labels)
        .entry("kubernetes.io/hostname".into())
        .or_insert_with(|| host.node_name.clone());
    let terms = serde_json::to_value(&required.node_selector_terms).unwrap_or_default();
    scheduling::selector_terms_match(&terms, &host)
}

/// A DataVolume's state, as CDI reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataVolume {
    pub phase: String,
    pub progress: Option<String>,
    pub message: Option<String>,
}

/// A DataVolume is used once populated (CDI's `IsPopulated`); a Failed
/// one fails the start with CDI's message.
pub fn data_volume_ready(name: &str, dv: Option<&DataVolume>) -> Result<(), Unusable> {
    let Some(dv) = dv else {
        return Err(wait(
            "DataVolumeNotFound",
            format!("DataVolume {name} does not exist"),
        ));
    };
    match dv.phase.as_str() {
        "Succeeded" | "PendingPopulation" => Ok(()),
        "Failed" => Err(refuse(
            "DataVolumeFailed",
            format!(
                "DataVolume {name} failed: {}",
                dv.message.as_deref().unwrap_or("no message")
            ),
        )),
        phase => {
            let phase = if phase.is_empty() { "Pending" } else { phase };
            let progress = dv.progress.as_deref().map(|p| format!(", {p}"));
            Err(wait(
                "DataVolumeNotReady",
                format!(
                    "DataVolume {name} is {phase}{}",
                    progress.unwrap_or_default()
                ),
            ))
        }
    }
}

/// One VMI that uses a claim, as recorded on the claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub node: String,
    pub vmi: String,
    pub uid: String,
}

/// The users recorded in the claim's annotation (none when absent or
/// unreadable: only kvirtd writes it).
pub fn users(annotations: Option<&BTreeMap<String, String>>) -> Vec<User> {
    annotations
        .and_then(|a| a.get(USERS_ANNOTATION))
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default()
}

/// Whether `me` may use a claim others use: ReadWriteOnce allows users on
/// one node, ReadWriteOncePod one user, the Many modes anyone.
pub fn conflict(name: &str, access_modes: &[String], users: &[User], me: &User) -> Option<String> {
    let has = |m: &str| access_modes.iter().any(|x| x == m);
    if has("ReadWriteMany") || has("ReadOnlyMany") {
        return None;
    }
    let single_pod = has("ReadWriteOncePod");
    let other = users
        .iter()
        .filter(|u| u.uid != me.uid)
        .find(|u| single_pod || u.node != me.node)?;
    Some(format!(
        "claim {name} ({}) is in use by VMI {} on node {}",
        access_modes.join(", "),
        other.vmi,
        other.node
    ))
}

/// A claim file's size on a volume with `free` bytes available: the
/// target, or less within the toleration (then `true`), or why not.
pub fn fit(path: &Path, target: u64, free: u64) -> Result<(u64, bool), String> {
    let available = free.saturating_sub(RESERVE_BYTES) / MIB * MIB;
    if target <= available {
        return Ok((target, false));
    }
    if (target - available).saturating_mul(100) <= target.saturating_mul(TOLERATION_PERCENT) {
        return Ok((available, true));
    }
    Err(format!(
        "{}: the volume has {available} bytes free (keeping {RESERVE_BYTES}), less than the \
         {target} bytes asked, beyond the {TOLERATION_PERCENT} % toleration",
        path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pvc(yaml: &str) -> PersistentVolumeClaim {
        serde_norway::from_str(yaml).unwrap()
    }

    fn pv(yaml: &str) -> PersistentVolume {
        serde_norway::from_str(yaml).unwrap()
    }

    const BOUND: &str = "metadata: {name: c}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}, volumeName: v}
status: {phase: Bound, accessModes: [ReadWriteOnce], capacity: {storage: 2Gi}}";

    fn host() -> HostFacts {
        HostFacts {
            node_name: "node-a".into(),
            ..Default::default()
        }
    }

    fn roots() -> Vec<PathBuf> {
        vec!["/var/lib/kvirt/claims".into()]
    }

    fn local(path: &str, node: &str) -> PersistentVolume {
        pv(&format!(
            "metadata: {{name: v}}
spec:
  local: {{path: {path}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [{node}]}}]"
        ))
    }

    #[test]
    fn a_local_directory_on_this_node_is_used_below_its_root() {
        let p = resolve(
            &pvc(BOUND),
            Some(&local("/var/lib/kvirt/claims/v", "node-a")),
            &host(),
            &roots(),
        )
        .unwrap();
        assert_eq!(
            p.backend,
            Backend::Directory {
                root: "/var/lib/kvirt/claims".into(),
                dir: "/var/lib/kvirt/claims/v".into()
            }
        );
        assert!(!p.read_only);
        // min(1Gi request, 2Gi capacity) less 5.5 %, in whole MiB.
        assert_eq!(p.disk_bytes(0.055).unwrap(), 967 * MIB);
        assert_eq!(p.disk_bytes(0.0).unwrap(), 1 << 30);
        let info = p.info(0.055);
        assert_eq!(info["volumeMode"], "Filesystem");
        assert_eq!(info["capacity"]["storage"], "2Gi");
        assert_eq!(info["requests"]["storage"], "1Gi");
    }

    #[test]
    fn what_this_host_cannot_reach_is_refused_with_the_reason() {
        let refused =
            |pv: PersistentVolume| match resolve(&pvc(BOUND), Some(&pv), &host(), &roots()) {
                Err(Unusable::Refuse { reason, message }) => (reason, message),
                other => panic!("{other:?}"),
            };
        let (r, m) = refused(local("/var/lib/kvirt/claims/v", "node-b"));
        assert_eq!(r, "PVCNodeAffinity");
        assert!(
            m.contains("node-a") && m.contains("kubernetes.io/hostname"),
            "{m}"
        );
        let (r, m) = refused(pv(
            "metadata: {name: v}\nspec: {csi: {driver: ebs.csi.aws.com, volumeHandle: x}}",
        ));
        assert_eq!(r, "PVCNotSupported");
        assert!(m.contains("csi (driver ebs.csi.aws.com)"), "{m}");
        let (_, m) = refused(pv(
            "metadata: {name: v}\nspec: {nfs: {server: s, path: /x}}",
        ));
        assert!(m.contains("kind nfs"), "{m}");
        for bad in [
            "/etc",
            "/var/lib/kvirt/claims/../../etc",
            "/var/lib/kvirt/claims",
            "rel",
        ] {
            let (r, m) = refused(local(bad, "node-a"));
            assert_eq!(r, "PVCNotSupported", "{bad}: {m}");
        }
    }

    #[test]
    fn unbound_claims_wait_and_deleted_ones_are_refused() {
        let pending = pvc("metadata: {name: c}\nspec: {}\nstatus: {phase: Pending}");
        assert!(matches!(
            resolve(&pending, None, &host(), &roots()),
            Err(Unusable::Wait {
                reason: "PVCNotBound",
                ..
            })
        ));
        let mut gone = pvc(BOUND);
        gone.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-01-01T00:00:00Z".parse().unwrap(),
            ));
        assert!(matches!(
            resolve(&gone, None, &host(), &roots()),
            Err(Unusable::Refuse {
                reason: "PVCTerminating",
                ..
            })
        ));
    }

    /// The claim `pvc_yaml` bound to a local PV at `path` on node-a.
    fn on_node_a(pvc_yaml: &str, path: &str) -> Result<Pvc, Unusable> {
        resolve(
            &pvc(pvc_yaml),
            Some(&local(path, "node-a")),
            &host(),
            &roots(),
        )
    }

    #[test]
    fn block_claims_need_a_local_device() {
        let block = BOUND.replace("resources:", "volumeMode: Block, resources:");
        let p = on_node_a(&block, "/dev/loop3").unwrap();
        assert_eq!(p.backend, Backend::Block("/dev/loop3".into()));
        assert!(on_node_a(&block, "/var/lib/kvirt/claims/v").is_err());
    }

    #[test]
    fn read_only_many_claims_are_read_only() {
        let rox = BOUND.replace("ReadWriteOnce", "ReadOnlyMany");
        assert!(
            on_node_a(&rox, "/var/lib/kvirt/claims/v")
                .unwrap()
                .read_only
        );
    }

    #[test]
    fn read_write_once_is_one_node_and_once_pod_one_user() {
        let me = User {
            node: "a".into(),
            vmi: "ns/me".into(),
            uid: "1".into(),
        };
        let same_node = User {
            node: "a".into(),
            vmi: "ns/x".into(),
            uid: "2".into(),
        };
        let other_node = User {
            node: "b".into(),
            vmi: "ns/y".into(),
            uid: "3".into(),
        };
        let rwo = ["ReadWriteOnce".to_owned()];
        assert_eq!(
            conflict("c", &rwo, &[same_node.clone(), me.clone()], &me),
            None
        );
        let m = conflict("c", &rwo, std::slice::from_ref(&other_node), &me).unwrap();
        assert!(m.contains("ns/y") && m.contains("node b"), "{m}");
        assert!(conflict("c", &["ReadWriteOncePod".into()], &[same_node], &me).is_some());
        assert_eq!(
            conflict("c", &["ReadWriteMany".into()], &[other_node], &me),
            None
        );
    }

    #[test]
    fn a_smaller_volume_is_tolerated_within_ten_percent() {
        let p = Path::new("/x/disk.img");
        let gib = 1u64 << 30;
        assert_eq!(fit(p, gib, 2 * gib), Ok((gib, false)));
        let (size, tolerated) = fit(p, gib, gib - 50 * MIB).unwrap();
        assert!(tolerated && size < gib && size % MIB == 0);
        let e = fit(p, gib, gib / 2).unwrap_err();
        assert!(e.contains("10 %") && e.contains(&gib.to_string()), "{e}");
    }

    #[test]
    fn data_volumes_wait_until_populated() {
        let dv = |phase: &str| DataVolume {
            phase: phase.into(),
            progress: Some("42.0%".into()),
            message: Some("boom".into()),
        };
        assert!(data_volume_ready("d", Some(&dv("Succeeded"))).is_ok());
        assert!(data_volume_ready("d", Some(&dv("PendingPopulation"))).is_ok());
        let w = data_volume_ready("d", Some(&dv("ImportInProgress"))).unwrap_err();
        assert!(
            matches!(w, Unusable::Wait { .. }) && w.message().contains("42.0%"),
            "{w:?}"
        );
        let f = data_volume_ready("d", Some(&dv("Failed"))).unwrap_err();
        assert!(matches!(f, Unusable::Refuse { .. }) && f.message().contains("boom"));
        assert!(matches!(
            data_volume_ready("d", None),
            Err(Unusable::Wait { .. })
        ));
    }
}
