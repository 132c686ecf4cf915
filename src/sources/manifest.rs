//! Standalone mode: VMIs from a directory of manifests (kubelet's static
//! pods are the model), watched with inotify; status as JSON files next to
//! each VM's runtime files. (Events go to the log: `daemon`'s LogRecorder.)

use super::{SourceError, StatusStore};
use crate::core::key::VmKey;
use crate::core::layout::HostLayout;
use crate::core::trigger::Trigger;
use crate::core::vmi::{VirtualMachineInstance, VmiStatus};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{error, warn};

/// The VMIs this host should run, keyed by VM, and the manifests that
/// could not be read (reported, never fatal).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub vmis: BTreeMap<VmKey, VirtualMachineInstance>,
    pub errors: Vec<SourceError>,
}

/// Reads every `*.yaml`, `*.yml` and `*.json` file in `dir`, sorted by name;
/// a file may hold several YAML documents. The first manifest of a name wins,
/// later duplicates are errors.
pub fn scan_dir(dir: &Path) -> Snapshot {
    let mut snap = Snapshot::default();
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| Some(e.ok()?.path())).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return snap,
        Err(source) => {
            snap.errors.push(SourceError::Io {
                path: dir.into(),
                op: "read directory",
                source,
            });
            return snap;
        }
    };
    files.retain(|p| {
        p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
            && !p
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
    });
    files.sort();
    for path in files {
        match read_manifest(&path) {
            Ok(vmis) => {
                for vmi in vmis {
                    let key = match vmi.key() {
                        Ok(k) => k,
                        Err(e) => {
                            snap.errors.push(SourceError::Manifest {
                                path: path.clone(),
                                message: e.to_string(),
                            });
                            continue;
                        }
                    };
                    if snap.vmis.contains_key(&key) {
                        snap.errors.push(SourceError::Manifest {
                            path: path.clone(),
                            message: format!("VMI {key} is already defined by another manifest"),
                        });
                        continue;
                    }
                    snap.vmis.insert(key, vmi);
                }
            }
            Err(e) => snap.errors.push(e),
        }
    }
    snap
}

/// [`scan_dir`], each manifest that could not be read logged.
pub fn scan(dir: &Path) -> Snapshot {
    let snap = scan_dir(dir);
    for e in &snap.errors {
        warn!("manifest skipped: {e}");
    }
    snap
}

/// inotify on the manifest directory: every change sends a fresh scan.
pub fn watch(dir: PathBuf, tx: UnboundedSender<Trigger>) -> std::io::Result<()> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(
        &dir,
        AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_MODIFY,
    )?;
    std::thread::Builder::new()
        .name("manifest-watch".into())
        .spawn(move || loop {
            match inotify.read_events() {
                Ok(_) => {
                    if tx.send(Trigger::Vmis(scan(&dir).vmis)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    error!("watching {}: {e}", dir.display());
                    break;
                }
            }
        })?;
    Ok(())
}

fn read_manifest(path: &Path) -> Result<Vec<VirtualMachineInstance>, SourceError> {
    let bad = |message: String| SourceError::Manifest {
        path: path.into(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|source| SourceError::Io {
        path: path.into(),
        op: "read",
        source,
    })?;
    let docs: Vec<serde_json::Value> = if path.extension().is_some_and(|e| e == "json") {
        vec![serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?]
    } else {
        let mut docs = Vec::new();
        for doc in serde_norway::Deserializer::from_str(&text) {
            let v: serde_json::Value =
                serde::Deserialize::deserialize(doc).map_err(|e| bad(e.to_string()))?;
            if !v.is_null() {
                docs.push(v);
            }
        }
        docs
    };
    let modified = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| jiff::Timestamp::try_from(t).ok());
    docs.into_iter()
        .map(|doc| {
            let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or("");
            if kind != "VirtualMachineInstance" {
                return Err(bad(format!("kind {kind:?} is not VirtualMachineInstance")));
            }
            // Like a static pod: the manifest's content is its identity, so
            // editing it replaces the VM and an unchanged file keeps it.
            let uid = manifest_uid(&doc);
            let mut vmi: VirtualMachineInstance =
                serde_json::from_value(doc).map_err(|e| bad(e.to_string()))?;
            vmi.metadata.uid.get_or_insert(uid);
            vmi.metadata
                .namespace
                .get_or_insert_with(|| "default".into());
            if vmi.metadata.creation_timestamp.is_none() {
                vmi.metadata.creation_timestamp =
                    modified.map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time);
            }
            vmi.status = VmiStatus::default();
            Ok(vmi)
        })
        .collect()
}

/// A UUID-shaped digest of the manifest (status excluded).
fn manifest_uid(doc: &serde_json::Value) -> String {
    let mut doc = doc.clone();
    if let Some(o) = doc.as_object_mut() {
        o.remove("status");
    }
    let h = Sha256::digest(doc.to_string().as_bytes());
    let x: String = h.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &x[..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

/// Status as `/run/kvirt/status/<id>.json` (the VMI object with its
/// status), written atomically into a directory only root can enter.
#[derive(Clone, Debug)]
pub struct FileStatusStore {
    pub host: HostLayout,
}

impl StatusStore for FileStatusStore {
    async fn load(&self, key: &VmKey) -> Option<VirtualMachineInstance> {
        let path = self.host.vm(key).status_file;
        let text = tokio::task::spawn_blocking(move || read_status(&path))
            .await
            .ok()??;
        VirtualMachineInstance::from_json(&text).ok()
    }

    async fn save(&self, vmi: &VirtualMachineInstance) -> Result<(), SourceError> {
        let key = vmi.key().map_err(|e| SourceError::Manifest {
            path: PathBuf::new(),
            message: e.to_string(),
        })?;
        let path = self.host.vm(&key).status_file;
        let io = |op| {
            let path = path.clone();
            move |source| SourceError::Io { path, op, source }
        };
        let dir = path.parent().expect("status file has a parent");
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(io("create directory"))?;
        tokio::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .await
            .map_err(io("chmod"))?;
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_vec_pretty(vmi).expect("a VMI serializes");
        tokio::fs::write(&tmp, json).await.map_err(io("write"))?;
        tokio::fs::rename(&tmp, &path).await.map_err(io("rename"))
    }
}

/// A VMI's status is its whole object: far below this, unless a manifest
/// carries a disk's worth of user data.
pub const MAX_STATUS_FILE: u64 = 16 << 20;

/// One status file's text; `None` when there is none, or it is not a
/// regular file of a sane size.
pub fn read_status(path: &Path) -> Option<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    f.take(MAX_STATUS_FILE + 1).read_to_string(&mut text).ok()?;
    (text.len() as u64 <= MAX_STATUS_FILE).then_some(text)
}

/// Every standalone VMI's status (for `kvirtctl ls`).
pub fn read_all_status(host: &HostLayout) -> Vec<VirtualMachineInstance> {
    let Ok(entries) = std::fs::read_dir(host.status_dir()) else {
        return vec![];
    };
    let mut vmis: Vec<VirtualMachineInstance> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            if path.extension()? != "json" {
                return None;
            }
            VirtualMachineInstance::from_json(&read_status(&path)?).ok()
        })
        .collect();
    vmis.sort_by(|a, b| {
        (&a.metadata.namespace, &a.metadata.name).cmp(&(&b.metadata.namespace, &b.metadata.name))
    });
    vmis
}

#[cfg(test)]
mod tests {
    use super::*;

    const VMI: &str = "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: a\nspec:\n  domain:\n    devices: {}\n";

    #[test]
    fn scans_manifests_with_stable_uids_and_reports_bad_ones() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("a.yaml"), VMI).unwrap();
        std::fs::write(tmp.path().join("b.yaml"), "kind: [").unwrap();
        std::fs::write(tmp.path().join("c.yml"), VMI).unwrap(); // duplicate name
        std::fs::write(
            tmp.path().join("d.yaml"),
            "kind: Pod\nmetadata: {name: p}\n",
        )
        .unwrap();
        std::fs::write(tmp.path().join("notes.txt"), "ignored").unwrap();
        let s = scan_dir(tmp.path());
        let key = VmKey::new("default", "a").unwrap();
        assert_eq!(s.vmis.len(), 1);
        let uid = s.vmis[&key].uid().unwrap().to_owned();
        assert_eq!(s.errors.len(), 3, "{:?}", s.errors);
        assert!(s
            .errors
            .iter()
            .any(|e| e.to_string().contains("already defined")));
        assert!(s.errors.iter().any(|e| e.to_string().contains("\"Pod\"")));
        // Same content, same uid; edited content, new uid.
        assert_eq!(scan_dir(tmp.path()).vmis[&key].uid().unwrap(), uid);
        std::fs::write(
            tmp.path().join("a.yaml"),
            VMI.replace("devices: {}", "devices: {disks: []}"),
        )
        .unwrap();
        assert_ne!(scan_dir(tmp.path()).vmis[&key].uid().unwrap(), uid);
    }

    #[tokio::test]
    async fn status_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStatusStore {
            host: HostLayout {
                runtime_dir: tmp.path().into(),
                ..HostLayout::default()
            },
        };
        let mut vmi = VirtualMachineInstance::from_yaml(VMI).unwrap();
        vmi.metadata.namespace = Some("default".into());
        vmi.status.phase = Some(crate::core::vmi::Phase::Running);
        store.save(&vmi).await.unwrap();
        let key = VmKey::new("default", "a").unwrap();
        assert_eq!(
            store.load(&key).await.unwrap().status.phase,
            vmi.status.phase
        );
        assert_eq!(read_all_status(&store.host).len(), 1);
    }
}
