//! Standalone mode: VMIs from a directory of manifests (kubelet's static
//! pods are the model), watched with inotify; status as JSON files next to
//! each VM's runtime files. (Events go to the log: `daemon`'s LogRecorder.)

use super::{SourceError, StatusStore};
use crate::core::instancetype::ObjectKey;
use crate::core::key::VmKey;
use crate::core::layout::HostLayout;
use crate::core::vm::{Book, VirtualMachine};
use crate::core::vmi::{VirtualMachineInstance, VmiStatus};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tracing::{error, warn};

/// The VMIs this host should run, keyed by VM, and the manifests that
/// could not be read (reported, never fatal).
#[derive(Debug, Default)]
pub struct Snapshot {
    pub vmis: BTreeMap<VmKey, VirtualMachineInstance>,
    /// VirtualMachines: their VMIs are made by kvirtd (`daemon::vms`).
    pub vms: BTreeMap<VmKey, VirtualMachine>,
    /// Instancetypes and preferences, for the VMs that name them.
    pub instancetypes: BTreeMap<ObjectKey, serde_json::Value>,
    /// NetworkAttachmentDefinitions by (namespace, name), for the VMIs'
    /// secondary networks.
    pub networks: Networks,
    pub errors: Vec<SourceError>,
}

/// The manifests' NetworkAttachmentDefinitions: by (namespace, name).
pub type Networks = BTreeMap<(String, String), crate::core::objects::ObjectData>;

pub const NAD_KIND: &str = "NetworkAttachmentDefinition";

/// Kubernetes refuses objects larger than this (etcd's request limit);
/// so does kvirt, before parsing.
pub const MAX_MANIFEST: u64 = 1536 << 10;

/// What is known of one file: the identity it was read at, and what it held.
#[derive(Debug)]
struct Reading {
    stamp: Stamp,
    result: Result<Vec<Object>, String>,
}

/// One document of a manifest.
#[derive(Clone, Debug)]
enum Object {
    Vmi(Box<VirtualMachineInstance>),
    Vm(Box<VirtualMachine>),
    Instancetype(Box<(ObjectKey, serde_json::Value)>),
    Network(Box<((String, String), crate::core::objects::ObjectData)>),
}

/// Device, inode, size and modification time: a file whose stamp is
/// unchanged is not read again.
type Stamp = (u64, u64, u64, i64, i64);

#[derive(Debug, Default)]
struct DirState {
    readings: BTreeMap<PathBuf, Reading>,
    /// Files opened for writing and not closed yet: their last complete
    /// reading stands until they are.
    writing: BTreeSet<PathBuf>,
    /// Each unusable file's error as last reported: said once per change.
    reported: BTreeMap<PathBuf, String>,
}

/// The manifest directory as kvirtd sees it. Each file is read only when
/// complete (closed after writing, or moved in) and when it changed; only
/// regular files (a link is followed only to one), opened without
/// blocking and read up to [`MAX_MANIFEST`]. Unusable files are reported
/// once per change, in the log and in `manifest-errors/errors.json` for
/// `kvirtctl ls`.
#[derive(Debug)]
pub struct ManifestDir {
    dir: PathBuf,
    errors_file: Option<PathBuf>,
    state: std::sync::Mutex<DirState>,
}

impl ManifestDir {
    pub fn new(dir: PathBuf, errors_file: Option<PathBuf>) -> Self {
        Self {
            dir,
            errors_file,
            state: Default::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, DirState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads what changed and returns every VMI the directory defines.
    pub fn scan(&self) -> Snapshot {
        let mut st = self.state();
        self.scan_locked(&mut st)
    }

    fn scan_locked(&self, st: &mut DirState) -> Snapshot {
        let mut snap = Snapshot::default();
        let files = match manifest_files(&self.dir) {
            Ok(f) => f,
            Err(source) => {
                // Nothing is known: keep every VM as last read rather than
                // stop them all for a directory that cannot be listed.
                snap.errors.push(SourceError::Io {
                    path: self.dir.clone(),
                    op: "read directory",
                    source,
                });
                return self.assemble(st, snap);
            }
        };
        st.readings.retain(|p, _| files.contains(p));
        st.writing.retain(|p| files.contains(p));
        for path in &files {
            if st.writing.contains(path) {
                continue;
            }
            let stamp = stamp_of(path);
            if let (Some(r), Ok(s)) = (st.readings.get(path), &stamp) {
                if r.stamp == *s {
                    continue;
                }
            }
            let reading = match stamp {
                // Removed since the listing (250 manifests deleted at once
                // each warned here): gone, as the next listing will say.
                Err(e) if vanished(path, &e) => {
                    st.readings.remove(path);
                    continue;
                }
                Ok(stamp) => Reading {
                    stamp,
                    result: read_manifest(path).map_err(|e| e.to_string()),
                },
                Err(e) => Reading {
                    stamp: Default::default(),
                    result: Err(e.to_string()),
                },
            };
            st.readings.insert(path.clone(), reading);
        }
        self.assemble(st, snap)
    }

    /// The snapshot from the readings: the first manifest of a name wins,
    /// later duplicates are errors. Errors new since the last report are
    /// logged and written for `kvirtctl ls`.
    fn assemble(&self, st: &mut DirState, mut snap: Snapshot) -> Snapshot {
        for (path, r) in &st.readings {
            let vmis = match &r.result {
                Ok(v) => v,
                Err(message) => {
                    snap.errors.push(SourceError::Manifest {
                        path: path.clone(),
                        message: message.clone(),
                    });
                    continue;
                }
            };
            for object in vmis {
                if let Object::Network(n) = object {
                    let (key, data) = &**n;
                    if snap.networks.insert(key.clone(), data.clone()).is_some() {
                        snap.errors.push(SourceError::Manifest {
                            path: path.clone(),
                            message: format!(
                                "{NAD_KIND} {}/{} is already defined by another manifest",
                                key.0, key.1
                            ),
                        });
                    }
                    continue;
                }
                if let Object::Instancetype(it) = object {
                    let (key, obj) = &**it;
                    if snap
                        .instancetypes
                        .insert(key.clone(), obj.clone())
                        .is_some()
                    {
                        snap.errors.push(SourceError::Manifest {
                            path: path.clone(),
                            message: format!("{key} is already defined by another manifest"),
                        });
                    }
                    continue;
                }
                let key = match object {
                    Object::Vmi(v) => v.key().map_err(|e| e.to_string()),
                    Object::Vm(v) => v.key().map_err(|e| e.to_string()),
                    Object::Instancetype(_) | Object::Network(_) => continue,
                };
                let key = match key {
                    Ok(k) => k,
                    Err(message) => {
                        snap.errors.push(SourceError::Manifest {
                            path: path.clone(),
                            message,
                        });
                        continue;
                    }
                };
                // A VM's VMI has the VM's name: one name, one of either.
                if snap.vmis.contains_key(&key) || snap.vms.contains_key(&key) {
                    snap.errors.push(SourceError::Manifest {
                        path: path.clone(),
                        message: format!("{key} is already defined by another manifest"),
                    });
                    continue;
                }
                match object {
                    Object::Vmi(v) => snap.vmis.insert(key, (**v).clone()).is_none(),
                    Object::Vm(v) => snap.vms.insert(key, (**v).clone()).is_none(),
                    Object::Instancetype(_) | Object::Network(_) => continue,
                };
            }
        }
        let mut now: BTreeMap<PathBuf, String> = BTreeMap::new();
        for e in &snap.errors {
            let (path, message) = match e {
                SourceError::Manifest { path, message } => (path.clone(), message.clone()),
                other => (self.dir.clone(), other.to_string()),
            };
            if st.reported.get(&path) != Some(&message) {
                warn!("manifest {}: {message}", path.display());
            }
            now.insert(path, message);
        }
        if now != st.reported {
            if let Some(file) = &self.errors_file {
                if let Err(e) = write_errors(file, &now) {
                    warn!("writing {}: {e}", file.display());
                }
            }
            st.reported = now;
        }
        snap
    }

    /// Watches the directory on a thread of its own: a file is read once
    /// it is complete, and the whole directory again every `resync` (in
    /// case an event was missed). Each snapshot is sent while the state is
    /// held, so snapshots arrive in the order they were taken.
    pub fn watch(
        self: std::sync::Arc<Self>,
        mut send: impl FnMut(Snapshot) -> bool + Send + 'static,
        resync: std::time::Duration,
    ) -> std::io::Result<()> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        use std::os::fd::AsFd;
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)?;
        inotify.add_watch(
            &self.dir,
            AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_MODIFY
                | AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_MOVED_FROM
                | AddWatchFlags::IN_DELETE
                | AddWatchFlags::IN_ATTRIB,
        )?;
        let timeout = PollTimeout::try_from(resync).unwrap_or(PollTimeout::MAX);
        std::thread::Builder::new()
            .name("manifest-watch".into())
            .spawn(move || loop {
                let mut fds = [PollFd::new(inotify.as_fd(), PollFlags::POLLIN)];
                if let Err(e) = poll(&mut fds, timeout) {
                    if e != nix::errno::Errno::EINTR {
                        error!("watching {}: {e}", self.dir.display());
                        break;
                    }
                }
                let events = match inotify.read_events() {
                    Ok(ev) => ev,
                    Err(nix::errno::Errno::EAGAIN) => Vec::new(),
                    Err(e) => {
                        error!("watching {}: {e}", self.dir.display());
                        break;
                    }
                };
                let mut st = self.state();
                for ev in &events {
                    let Some(name) = &ev.name else { continue };
                    let path = self.dir.join(name);
                    // Data written, not yet closed. (Creating alone is
                    // not writing: a link or a hard link is complete.)
                    if ev.mask.contains(AddWatchFlags::IN_MODIFY) {
                        st.writing.insert(path);
                    } else if ev.mask.intersects(
                        AddWatchFlags::IN_CLOSE_WRITE
                            | AddWatchFlags::IN_MOVED_TO
                            | AddWatchFlags::IN_MOVED_FROM
                            | AddWatchFlags::IN_DELETE,
                    ) {
                        st.writing.remove(&path);
                    }
                }
                if !send(self.scan_locked(&mut st)) {
                    break;
                }
            })?;
        Ok(())
    }
}

/// The candidate files: `*.yaml`, `*.yml`, `*.json`, not hidden (editors'
/// and tools' temporary files are).
fn manifest_files(dir: &Path) -> std::io::Result<BTreeSet<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeSet::new()),
        r => r?,
    };
    Ok(entries
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect())
}

/// The manifest file that holds the VMI `key` (of `uid`) and nothing
/// else: what a migration away removes, once the target took it on.
pub fn file_of_vmi(dir: &Path, key: &VmKey, uid: &str) -> Result<PathBuf, String> {
    let files = manifest_files(dir).map_err(|e| format!("listing {}: {e}", dir.display()))?;
    for path in files {
        let Ok(objects) = read_manifest(&path) else {
            continue;
        };
        let holds = |o: &Object| match o {
            Object::Vmi(v) => v.key().is_ok_and(|k| &k == key) && v.uid() == Some(uid),
            _ => false,
        };
        match objects.iter().filter(|o| holds(o)).count() {
            0 => continue,
            _ if objects.len() == 1 => return Ok(path),
            _ => {
                return Err(format!(
                    "{} holds other objects too: give the VMI a manifest of its own to move it",
                    path.display()
                ))
            }
        }
    }
    Err(format!(
        "no manifest of its own in {} (a VirtualMachine's VMI moves only with its \
         VirtualMachine, which kvirt does not migrate yet)",
        dir.display()
    ))
}

/// A standalone host's VMIs are its manifests: a migration moves the
/// manifest with the VM (written at the target, then removed here).
pub struct ManifestHandover {
    pub dir: PathBuf,
}

impl super::Handover for ManifestHandover {
    fn standalone(&self) -> bool {
        true
    }

    fn may_let_go(&self, key: &VmKey, vmi_uid: &str) -> Result<(), String> {
        file_of_vmi(&self.dir, key, vmi_uid).map(|_| ())
    }

    fn let_go<'a>(
        &'a self,
        vmi: &'a VirtualMachineInstance,
        _state: &'a crate::core::migration::MigrationState,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let key = vmi.key().map_err(|e| e.to_string())?;
            let file = file_of_vmi(&self.dir, &key, vmi.uid().unwrap_or_default())?;
            match std::fs::remove_file(&file) {
                Ok(()) => {
                    tracing::info!(manifest = %file.display(), "the VM's manifest moved with it");
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(format!("removing {}: {e}", file.display())),
            }
        })
    }

    fn take_on(&self, vmi: &VirtualMachineInstance) -> Result<bool, String> {
        let file = write_arrived(&self.dir, vmi)?;
        tracing::info!(manifest = %file.display(), "the VM's manifest written");
        Ok(true)
    }
}

/// Writes the manifest of a VMI that arrived by migration, whole (a new
/// file, then a rename): its UID and creation time kept, so the host runs
/// it as the same instance. Returns the file.
pub fn write_arrived(dir: &Path, vmi: &VirtualMachineInstance) -> Result<PathBuf, String> {
    let key = vmi.key().map_err(|e| e.to_string())?;
    let mut doc = serde_json::to_value(vmi).map_err(|e| e.to_string())?;
    if let Some(o) = doc.as_object_mut() {
        o.remove("status");
        o.insert("apiVersion".into(), "kubevirt.io/v1".into());
        o.insert("kind".into(), "VirtualMachineInstance".into());
    }
    if let Some(m) = doc.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        for k in [
            "resourceVersion",
            "generation",
            "managedFields",
            "deletionTimestamp",
        ] {
            m.remove(k);
        }
    }
    let mut path = dir.join(format!("{}.json", key.id()));
    if path.exists() {
        let uid = vmi.uid().unwrap_or("x");
        path = dir.join(format!("{}-{}.json", key.id(), &uid[..uid.len().min(8)]));
    }
    let text = serde_json::to_vec_pretty(&doc).map_err(|e| e.to_string())?;
    let tmp = dir.join(format!(".{}.arriving", key.id()));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|e| format!("writing {}: {e}", path.display()))?;
    Ok(path)
}

/// Whether `path` failed with `e` because it is no longer there at all
/// (not a link to nothing, which is an error to report).
fn vanished(path: &Path, e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        && std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
}

fn stamp_of(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// `manifest-errors/errors.json`: `[{"path": ..., "error": ...}]`, replaced
/// atomically (only root writes where it lives).
fn write_errors(file: &Path, errors: &BTreeMap<PathBuf, String>) -> std::io::Result<()> {
    let list: Vec<serde_json::Value> = errors
        .iter()
        .map(|(p, e)| serde_json::json!({"path": p, "error": e}))
        .collect();
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension("json.tmp");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // Root's alone: the manifests' paths name the host's tenants.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(&list).expect("JSON"))?;
    }
    std::fs::rename(&tmp, file)
}

/// The manifests kvirtd reported as unusable: (path, error).
pub fn read_manifest_errors(file: &Path) -> Vec<(String, String)> {
    let Some(text) = read_status(file) else {
        return vec![];
    };
    let list: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap_or_default();
    list.iter()
        .filter_map(|v| {
            Some((
                v.get("path")?.as_str()?.to_owned(),
                v.get("error")?.as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// One manifest's text: a regular file (links followed to one), opened
/// without blocking, at most [`MAX_MANIFEST`] bytes.
fn read_text(path: &Path) -> Result<String, SourceError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |op| {
        move |source| SourceError::Io {
            path: path.into(),
            op,
            source,
        }
    };
    let bad = |message: String| SourceError::Manifest {
        path: path.into(),
        message,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io("open"))?;
    let meta = f.metadata().map_err(io("stat"))?;
    if !meta.is_file() {
        return Err(bad(format!("not a regular file ({:?})", meta.file_type())));
    }
    let mut bytes = Vec::new();
    f.take(MAX_MANIFEST + 1)
        .read_to_end(&mut bytes)
        .map_err(io("read"))?;
    if bytes.len() as u64 > MAX_MANIFEST {
        return Err(bad(format!(
            "larger than {MAX_MANIFEST} bytes, the most Kubernetes accepts for an object"
        )));
    }
    String::from_utf8(bytes).map_err(|_| bad("not UTF-8 text".into()))
}

fn read_manifest(path: &Path) -> Result<Vec<Object>, SourceError> {
    let bad = |message: String| SourceError::Manifest {
        path: path.into(),
        message,
    };
    let text = read_text(path)?;
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
    let mut objects = Vec::new();
    for doc in docs {
        let kind = doc.get("kind").and_then(|k| k.as_str());
        if kind == Some(crate::core::pool::KIND)
            || kind == Some(crate::core::pool::REPLICA_SET_KIND)
        {
            objects.extend(pool_members(doc).map_err(bad)?);
        } else {
            objects.push(doc);
        }
    }
    objects
        .into_iter()
        .map(|doc| {
            if let Some(key) = ObjectKey::of_object(&doc) {
                let key = key.map_err(bad)?;
                let mut doc = doc;
                if key.kind.namespaced() && doc.pointer("/metadata/namespace").is_none() {
                    doc["metadata"]["namespace"] = "default".into();
                }
                // What the API server would give it: a stable UID, a generation.
                if doc.pointer("/metadata/uid").is_none() {
                    doc["metadata"]["uid"] = manifest_uid(&doc).into();
                }
                return Ok(Object::Instancetype(Box::new((key, doc))));
            }
            let kind = doc.get("kind").and_then(|k| k.as_str()).unwrap_or("");
            if kind == NAD_KIND {
                return network_object(&doc).map_err(bad);
            }
            if kind == crate::core::vm::KIND {
                // Its UID and generation are kvirtd's to give (`vm::settle_identity`):
                // an edited VM is the same VM.
                let mut vm = VirtualMachine::from_value(doc).map_err(|e| bad(e.to_string()))?;
                vm.metadata
                    .namespace
                    .get_or_insert_with(|| "default".into());
                if vm.metadata.creation_timestamp.is_none() {
                    vm.metadata.creation_timestamp =
                        modified.map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time);
                }
                vm.status = serde_json::Value::Null;
                return Ok(Object::Vm(Box::new(vm)));
            }
            if kind != "VirtualMachineInstance" {
                return Err(bad(format!(
                    "kind {kind:?} is none of VirtualMachineInstance, VirtualMachine, \
                     VirtualMachinePool, VirtualMachine(Cluster)Instancetype, \
                     VirtualMachine(Cluster)Preference, NetworkAttachmentDefinition"
                )));
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
            Ok(Object::Vmi(Box::new(vmi)))
        })
        .collect()
}

/// A pool's VMs, as manifests: it is a pool of standalone VMs, scaled by
/// editing `replicas`; a replica set's are VMs that always run its
/// template (see `ReplicaSet::standalone_member`). Its UID follows from
/// its kind and name (so the VMs' owner does not change with an edit).
fn pool_members(mut doc: serde_json::Value) -> Result<Vec<serde_json::Value>, String> {
    let kind = doc
        .get("kind")
        .and_then(|k| k.as_str())
        .unwrap_or("")
        .to_owned();
    let ns = doc
        .pointer("/metadata/namespace")
        .and_then(|n| n.as_str())
        .unwrap_or("default")
        .to_owned();
    let name = doc
        .pointer("/metadata/name")
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_owned();
    if let Some(meta) = doc.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        meta.insert("namespace".into(), ns.clone().into());
        let of = if kind == crate::core::pool::KIND {
            "pool"
        } else {
            "replicaset"
        };
        let uid = crate::core::key::uuid_form(&Sha256::digest(format!("{of}:{ns}/{name}")));
        meta.insert("uid".into(), uid.into());
    }
    let vms = if kind == crate::core::pool::KIND {
        crate::core::pool::members(&crate::core::pool::Pool::from_value(doc)?)?
    } else {
        crate::core::pool::ReplicaSet::from_value(doc)?.standalone_members()?
    };
    vms.iter()
        .map(|v| serde_json::to_value(v).map_err(|e| e.to_string()))
        .collect()
}

/// A NetworkAttachmentDefinition manifest (`k8s.cni.cncf.io/v1`), in
/// `default` unless it names a namespace.
fn network_object(doc: &serde_json::Value) -> Result<Object, String> {
    let version = doc.get("apiVersion").and_then(|v| v.as_str());
    if version != Some("k8s.cni.cncf.io/v1") {
        return Err(format!(
            "{NAD_KIND}: apiVersion {version:?} must be k8s.cni.cncf.io/v1"
        ));
    }
    let text = |p: &str| doc.pointer(p).and_then(|v| v.as_str());
    let name = text("/metadata/name").unwrap_or_default();
    let namespace = text("/metadata/namespace").unwrap_or("default");
    for part in [name, namespace] {
        if crate::core::cni::NetworkRef::parse(part, "default").is_err() || part.contains('/') {
            return Err(format!("{NAD_KIND}: {part:?} is not a DNS name"));
        }
    }
    let data = crate::core::objects::nad_data(doc);
    Ok(Object::Network(Box::new((
        (namespace.to_owned(), name.to_owned()),
        data,
    ))))
}

/// A UUID-shaped digest of the manifest (status excluded).
fn manifest_uid(doc: &serde_json::Value) -> String {
    let mut doc = doc.clone();
    if let Some(o) = doc.as_object_mut() {
        o.remove("status");
    }
    crate::core::key::uuid_form(&Sha256::digest(doc.to_string().as_bytes()))
}

/// Status as `/run/kvirt/status/<id>.json` (the VMI object with its
/// status), written atomically into a directory only root can enter.
#[derive(Clone, Debug)]
pub struct FileStatusStore {
    pub host: HostLayout,
    /// The manifests' NetworkAttachmentDefinitions, as last scanned.
    pub networks: std::sync::Arc<std::sync::Mutex<Networks>>,
}

impl FileStatusStore {
    pub fn new(host: HostLayout) -> Self {
        Self {
            host,
            networks: Default::default(),
        }
    }

    /// Takes the NetworkAttachmentDefinitions of a scan.
    pub fn set_networks(&self, networks: &Networks) {
        *self.networks.lock().unwrap_or_else(|p| p.into_inner()) = networks.clone();
    }
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

    /// Only NetworkAttachmentDefinitions exist without a cluster: the
    /// manifests' own.
    async fn object(
        &self,
        namespace: &str,
        object: &crate::core::objects::ObjectRef,
    ) -> Result<Option<crate::core::objects::ObjectData>, SourceError> {
        match object {
            crate::core::objects::ObjectRef::NetworkAttachmentDefinition(name) => Ok(self
                .networks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&(namespace.to_owned(), name.clone()))
                .cloned()),
            other => Err(SourceError::Object {
                namespace: namespace.into(),
                object: other.clone(),
                message: "there is no cluster to read it from".into(),
            }),
        }
    }

    async fn forget(&self, id: &str) {
        let path = self.host.vm_by_id(id).status_file;
        match tokio::fs::remove_file(&path).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                warn!("removing {}: {e}", path.display())
            }
            _ => {}
        }
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

/// A standalone VirtualMachine as kvirtd keeps it: the object with its
/// status (what `kvirtctl` shows) and kvirt's record of it ([`Book`]), in
/// one file so that a crash never separates them.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VmRecord {
    pub vm: VirtualMachine,
    pub book: Book,
}

/// `/var/lib/kvirt/virtualmachines/<id>.json`, replaced atomically in a
/// directory only root can enter.
#[derive(Clone, Debug)]
pub struct VmRecords {
    pub dir: PathBuf,
}

impl VmRecords {
    fn path(&self, key: &VmKey) -> PathBuf {
        self.dir.join(format!("{}.json", key.id()))
    }

    /// Every record that can be read; one that cannot is reported and left
    /// where it is (never taken for an empty one).
    pub fn load_all(&self) -> BTreeMap<VmKey, VmRecord> {
        let mut out = BTreeMap::new();
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return out;
        };
        for path in entries.filter_map(|e| Some(e.ok()?.path())) {
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let record = read_status(&path)
                .ok_or_else(|| "not a readable regular file".to_owned())
                .and_then(|t| serde_json::from_str::<VmRecord>(&t).map_err(|e| e.to_string()))
                .and_then(|r| Ok((r.vm.key().map_err(|e| e.to_string())?, r)));
            match record {
                Ok((key, r)) => {
                    out.insert(key, r);
                }
                Err(e) => warn!("{}: {e}", path.display()),
            }
        }
        out
    }

    pub fn save(&self, key: &VmKey, record: &VmRecord) -> Result<(), SourceError> {
        let path = self.path(key);
        let io = |op| {
            let path = path.clone();
            move |source| SourceError::Io { path, op, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(io("create directory"))?;
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod"))?;
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_vec_pretty(record).expect("a record serializes");
        std::fs::write(&tmp, json).map_err(io("write"))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io("sync"))?;
        std::fs::rename(&tmp, &path).map_err(io("rename"))
    }

    pub fn remove(&self, key: &VmKey) {
        let path = self.path(key);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                warn!("removing {}: {e}", path.display())
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::trigger::Trigger;

    const VMI: &str = "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: a\nspec:\n  domain:\n    devices: {}\n";

    fn scan_dir(dir: &Path) -> Snapshot {
        ManifestDir::new(dir.into(), None).scan()
    }

    #[test]
    fn a_manifest_removed_after_the_listing_is_gone_not_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let gone = tmp.path().join("gone.yaml");
        let e = stamp_of(&gone).unwrap_err();
        assert!(vanished(&gone, &e));
        // A link to nothing is there, and reported.
        let dangling = tmp.path().join("dangling.yaml");
        std::os::unix::fs::symlink(tmp.path().join("nothing"), &dangling).unwrap();
        let e = stamp_of(&dangling).unwrap_err();
        assert!(!vanished(&dangling, &e));
        let s = scan_dir(tmp.path());
        assert_eq!(s.errors.len(), 1, "{:?}", s.errors);
    }

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

    #[test]
    fn virtual_machines_are_read_and_share_names_with_no_vmi() {
        let tmp = tempfile::tempdir().unwrap();
        let vm = "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata:\n  name: a\nspec:\n  runStrategy: Always\n  template:\n    spec:\n      domain: {devices: {}}\n";
        std::fs::write(tmp.path().join("vm.yaml"), vm).unwrap();
        std::fs::write(tmp.path().join("z.yaml"), VMI).unwrap();
        let s = scan_dir(tmp.path());
        let key = VmKey::new("default", "a").unwrap();
        assert_eq!(s.vms[&key].spec.run_strategy.as_deref(), Some("Always"));
        assert!(s.vmis.is_empty());
        assert!(
            s.errors
                .iter()
                .any(|e| e.to_string().contains("already defined")),
            "{:?}",
            s.errors
        );
    }

    #[tokio::test]
    async fn network_attachment_definitions_are_read_for_the_vmis_that_name_them() {
        use crate::core::objects::{ObjectRef, NAD_CONFIG, NAD_RESOURCE};
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("nets.yaml"),
            "apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\nmetadata: {name: blue}\n\
             spec: {config: '{\"cniVersion\":\"1.0.0\",\"type\":\"bridge\"}'}\n---\n\
             apiVersion: k8s.cni.cncf.io/v1\nkind: NetworkAttachmentDefinition\n\
             metadata: {name: sriov, namespace: infra, annotations: {k8s.v1.cni.cncf.io/resourceName: intel.com/sriov}}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("bad.yaml"),
            "apiVersion: v1\nkind: NetworkAttachmentDefinition\nmetadata: {name: x}\n",
        )
        .unwrap();
        let snap = ManifestDir::new(dir.path().into(), None).scan();
        let blue = &snap.networks[&("default".to_owned(), "blue".to_owned())];
        assert!(String::from_utf8_lossy(&blue[NAD_CONFIG]).contains("bridge"));
        let sriov = &snap.networks[&("infra".to_owned(), "sriov".to_owned())];
        assert_eq!(sriov[NAD_RESOURCE], b"intel.com/sriov");
        assert!(snap
            .errors
            .iter()
            .any(|e| e.to_string().contains("k8s.cni.cncf.io/v1")));
        // The status store hands them out by namespace.
        let store = FileStatusStore::new(HostLayout::default());
        store.set_networks(&snap.networks);
        let nad = |n: &str| ObjectRef::NetworkAttachmentDefinition(n.into());
        assert!(store
            .object("default", &nad("blue"))
            .await
            .unwrap()
            .is_some());
        assert!(store.object("infra", &nad("blue")).await.unwrap().is_none());
        assert!(store
            .object("default", &ObjectRef::Secret("s".into()))
            .await
            .is_err());
    }

    #[test]
    fn instancetypes_and_preferences_are_read_for_the_vms_that_name_them() {
        use crate::core::instancetype::Kind;
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("types.yaml"),
            "apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachineClusterInstancetype\n\
             metadata: {name: u1.small}\nspec: {cpu: {guest: 1}, memory: {guest: 2Gi}}\n---\n\
             apiVersion: instancetype.kubevirt.io/v1beta1\nkind: VirtualMachinePreference\n\
             metadata: {name: fedora}\nspec: {devices: {preferredDiskBus: virtio}}\n",
        )
        .unwrap();
        std::fs::write(
            tmp.path().join("old.yaml"),
            "apiVersion: instancetype.kubevirt.io/v1alpha1\nkind: VirtualMachinePreference\nmetadata: {name: old}\n",
        )
        .unwrap();
        let s = scan_dir(tmp.path());
        let keys: Vec<_> = s.instancetypes.keys().cloned().collect();
        assert_eq!(keys.len(), 2, "{keys:?}");
        let pref = ObjectKey {
            kind: Kind::VirtualMachinePreference,
            namespace: Some("default".into()),
            name: "fedora".into(),
        };
        // A stable UID, as the API server would give it.
        assert!(s.instancetypes[&pref].pointer("/metadata/uid").is_some());
        let e: Vec<String> = s.errors.iter().map(|e| e.to_string()).collect();
        assert!(
            e.iter()
                .any(|e| e.contains("must be instancetype.kubevirt.io/v1beta1")),
            "{e:?}"
        );
    }

    #[test]
    fn a_pool_is_its_vms_and_scales_by_its_replicas() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = |n: u32| {
            format!(
                "apiVersion: pool.kubevirt.io/v1alpha1\nkind: VirtualMachinePool\nmetadata: {{name: web}}\n\
                 spec:\n  replicas: {n}\n  selector: {{matchLabels: {{app: web}}}}\n  virtualMachineTemplate:\n    \
                 metadata: {{labels: {{app: web}}}}\n    spec:\n      runStrategy: Always\n      template:\n        \
                 spec: {{domain: {{devices: {{}}}}}}\n"
            )
        };
        std::fs::write(tmp.path().join("pool.yaml"), pool(3)).unwrap();
        let s = scan_dir(tmp.path());
        let names: Vec<String> = s.vms.keys().map(|k| k.name().to_owned()).collect();
        assert_eq!(names, ["web-0", "web-1", "web-2"], "{:?}", s.errors);
        let owner = |s: &Snapshot| {
            s.vms[&VmKey::new("default", "web-0").unwrap()]
                .metadata
                .owner_references
                .clone()
                .unwrap()[0]
                .uid
                .clone()
        };
        let first = owner(&s);
        std::fs::write(tmp.path().join("pool.yaml"), pool(1)).unwrap();
        let s = scan_dir(tmp.path());
        assert_eq!(s.vms.len(), 1);
        // The same pool, edited: the same owner.
        assert_eq!(owner(&s), first);
        std::fs::write(
            tmp.path().join("pool.yaml"),
            pool(1).replace("spec:\n  replicas", "spec:\n  autohealing: {}\n  replicas"),
        )
        .unwrap();
        let s = scan_dir(tmp.path());
        assert!(s.vms.is_empty());
        assert!(
            s.errors[0].to_string().contains("spec.autohealing"),
            "{:?}",
            s.errors
        );
        // A replica set: VMs that always run its template, named by index.
        std::fs::write(
            tmp.path().join("pool.yaml"),
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstanceReplicaSet\nmetadata: {name: r}\n\
             spec:\n  replicas: 2\n  selector: {matchLabels: {app: r}}\n  template:\n    \
             metadata: {labels: {app: r}}\n    spec: {domain: {memory: {guest: 64Mi}}}\n",
        )
        .unwrap();
        let s = scan_dir(tmp.path());
        assert!(s.errors.is_empty(), "{:?}", s.errors);
        let names: Vec<String> = s.vms.keys().map(|k| k.to_string()).collect();
        assert_eq!(names, ["default/r-0", "default/r-1"]);
        let vm = s.vms.values().next().unwrap();
        assert_eq!(
            serde_json::to_value(vm).unwrap()["spec"]["runStrategy"],
            "Always"
        );
    }

    #[test]
    fn only_bounded_regular_files_are_read_and_errors_said_once() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::write(d.join("a.yaml"), VMI).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("zero.yaml")).unwrap();
        nix::unistd::mkfifo(&d.join("fifo.yaml"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let big = format!("{VMI}#{}\n", "x".repeat(MAX_MANIFEST as usize));
        std::fs::write(d.join("big.yaml"), big).unwrap();
        // A link to a regular file is a manifest like any other.
        let elsewhere = tempfile::tempdir().unwrap();
        let target = elsewhere.path().join("b.yaml");
        std::fs::write(&target, VMI.replace("name: a", "name: b")).unwrap();
        std::os::unix::fs::symlink(&target, d.join("b.yaml")).unwrap();

        let errors = elsewhere.path().join("errors.json");
        let m = ManifestDir::new(d.into(), Some(errors.clone()));
        let s = m.scan();
        let names: Vec<&str> = s.vmis.keys().map(|k| k.name()).collect();
        assert_eq!(names, ["a", "b"]);
        let said: Vec<(String, String)> = read_manifest_errors(&errors);
        assert_eq!(said.len(), 3, "{said:?}");
        let of = |f: &str| {
            said.iter()
                .find(|(p, _)| p.ends_with(f))
                .map(|(_, e)| e.clone())
                .unwrap_or_default()
        };
        assert!(of("zero.yaml").contains("not a regular file"), "{said:?}");
        assert!(of("fifo.yaml").contains("not a regular file"), "{said:?}");
        assert!(of("big.yaml").contains("larger than"), "{said:?}");
        // Unchanged, nothing is written (or logged) again; fixed, it goes.
        let written = std::fs::metadata(&errors).unwrap().modified().unwrap();
        m.scan();
        assert_eq!(
            std::fs::metadata(&errors).unwrap().modified().unwrap(),
            written
        );
        std::fs::remove_file(d.join("big.yaml")).unwrap();
        m.scan();
        assert_eq!(read_manifest_errors(&errors).len(), 2);
    }

    async fn next(
        rx: &mut tokio::sync::mpsc::UnboundedReceiver<Trigger>,
    ) -> BTreeMap<VmKey, VirtualMachineInstance> {
        match tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv()).await {
            Ok(Some(Trigger::Vmis(v))) => v,
            other => panic!("no snapshot: {other:?}"),
        }
    }

    #[tokio::test]
    async fn a_manifest_is_read_once_it_is_complete() {
        use std::io::Write;
        let tmp = tempfile::tempdir().unwrap();
        let m = std::sync::Arc::new(ManifestDir::new(tmp.path().into(), None));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        m.clone()
            .watch(
                move |s| tx.send(Trigger::Vmis(s.vmis)).is_ok(),
                std::time::Duration::from_secs(3600),
            )
            .unwrap();
        // Half of it written, still open: not read (nor reported).
        let path = tmp.path().join("a.yaml");
        let mut f = std::fs::File::create(&path).unwrap();
        let (head, tail) = VMI.split_at(VMI.len() / 2);
        f.write_all(head.as_bytes()).unwrap();
        f.flush().unwrap();
        loop {
            let snap = next(&mut rx).await;
            assert!(snap.is_empty(), "read half-written: {snap:?}");
            if m.state().writing.contains(&path) {
                break;
            }
        }
        f.write_all(tail.as_bytes()).unwrap();
        drop(f);
        loop {
            if !next(&mut rx).await.is_empty() {
                break;
            }
        }
        assert!(m.scan().errors.is_empty());
    }

    #[tokio::test]
    async fn status_round_trips() {
        let tmp = tempfile::tempdir().unwrap();
        let store = FileStatusStore::new(HostLayout {
            runtime_dir: tmp.path().into(),
            ..HostLayout::default()
        });
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
        // A VM gone for good takes its status with it.
        store.forget(&key.id()).await;
        assert!(store.load(&key).await.is_none());
        assert!(read_all_status(&store.host).is_empty());
    }
}
