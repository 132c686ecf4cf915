//! A VM's directories and disk files on the host.
//!
//! A VM's own directories are its user's to write, so root never acts
//! there by name: each is opened once (its parent is root's) and
//! everything below it goes through [`Beneath`]. Files root makes for the
//! VM (overlays, ISOs, copies) are made in a root-only staging directory
//! and renamed into place.

use crate::core::acl;
use crate::core::convert::seed::Seed;
use crate::core::convert::{Backing, DiskPrep};
use crate::core::efivars::{self, Kept};
use crate::host::beneath::{Beneath, Ids};
use crate::host::grants::Grants;
use crate::host::growth::Growth;
use crate::host::hugepages;
use crate::host::image::ImageDisk;

/// Files pulled from container images for one VM, by `ImageNeed` key.
pub type Pulled = std::collections::BTreeMap<String, ImageDisk>;

fn kernel_dest(d: &DiskPrep) -> Option<&Path> {
    match d {
        DiskPrep::KernelBoot { kernel, .. } => kernel.as_ref().map(|f| f.dest.as_path()),
        _ => None,
    }
}

fn initrd_dest(d: &DiskPrep) -> Option<&Path> {
    match d {
        DiskPrep::KernelBoot { initrd, .. } => initrd.as_ref().map(|f| f.dest.as_path()),
        _ => None,
    }
}
use crate::core::layout::{HostLayout, VmPaths};
use nix::fcntl::OFlag;
use nix::unistd::{Gid, Uid};
use std::fs::File;
use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tracing::warn;

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Disk { path: PathBuf, message: String },
    #[error("user {0:?} does not exist")]
    NoUser(String),
    #[error("worker thread died")]
    Thread,
}

/// Who owns the VM's files: the unprivileged user its daemon runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

impl Owner {
    pub fn lookup(user: &str) -> Result<Self, StorageError> {
        let u = nix::unistd::User::from_name(user)
            .ok()
            .flatten()
            .ok_or_else(|| StorageError::NoUser(user.into()))?;
        Ok(Self {
            uid: u.uid.as_raw(),
            gid: u.gid.as_raw(),
        })
    }
}

/// What a VM's files are made for: `owner` is the VM's identity (`None`
/// keeps them the caller's, for tests without root).
pub trait Storage: Send + Sync + 'static {
    fn create_dirs(
        &self,
        paths: &VmPaths,
        owner: Option<Owner>,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Creates or checks one disk; `roots` re-checks hostDisks after
    /// symlinks; `images` has the files pulled for it, by `ImageNeed` key.
    /// `Some`: what the VMI's Events should say of it (a claim's disk
    /// smaller than the claim, KubeVirt's `ToleratedSmallPV`).
    fn prepare_disk(
        &self,
        disk: &DiskPrep,
        roots: &[PathBuf],
        images: &Pulled,
        owner: Option<Owner>,
    ) -> impl Future<Output = Result<Option<String>, StorageError>> + Send;
    fn remove_dir(&self, dir: &Path) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Removes VM `id`'s directories on the host's hugetlbfs mounts.
    fn remove_hugepages(&self, id: &str) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Keeps the EFI variables of a VM that asked for it (`efi.persistent`)
    /// before its state directory goes; an error keeps the directory too.
    fn keep_efi_vars(
        &self,
        paths: &VmPaths,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Every VM's kept EFI variables, with their owner.
    fn kept_efi_vars(&self) -> impl Future<Output = Result<Vec<Kept>, StorageError>> + Send;
    /// Removes VM `id`'s kept EFI variables, once their owner is gone.
    fn remove_kept_efi_vars(
        &self,
        id: &str,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
    fn exists(&self, dir: &Path) -> impl Future<Output = bool> + Send;
    /// Takes back every hostDisk given to identity `uid` (its VM is gone).
    fn revoke_grants(&self, uid: u32) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// The capability probe's directories, for kvirt's own user.
    fn create_probe_dirs(
        &self,
        owner: Owner,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Ids of VMs that have a state or runtime directory.
    fn list_ids(&self) -> impl Future<Output = Vec<String>> + Send;
    /// What is at `dir`, a VM's runtime directory.
    fn runtime_dir(&self, dir: &Path) -> impl Future<Output = RuntimeDir> + Send;
    /// Replaces a finished VM's runtime directory (its tmpfs, its
    /// identity's) by the last [`KEPT_CONSOLE`] bytes of its console log.
    fn keep_console_log(
        &self,
        paths: &VmPaths,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
    /// Writes a seed ISO made anew over the one a running VM has (a
    /// serviceAccount disk's token renewed), in place.
    fn rewrite_seed_iso(
        &self,
        path: &Path,
        seed: &Seed,
        owner: Option<Owner>,
    ) -> impl Future<Output = Result<(), StorageError>> + Send;
}

/// In a VM's kept EFI variables directory (root's, out of the VM's reach):
/// the variables, its TPM's state and where that lies in the VM's state
/// directory (the domain's UUID names it), whose they are, and a mark that
/// a VM using them runs.
const EFI_VARS: &str = "VARS.fd";
const TPM_STATE: &str = "tpm2-00.permall";
const TPM_PATH: &str = "tpm-path";
const EFI_OWNER: &str = "owner";
const EFI_ACTIVE: &str = "active";
/// Far above libvirt's QEMU capabilities (about 1 MiB), far below harm.
const MAX_CAPABILITIES: u64 = 32 << 20;
/// Far above any OVMF variable store (540 KiB) or swtpm state (some
/// 100 KiB), far below harm.
const MAX_EFI_VARS: u64 = 16 << 20;

/// The VM's QEMU driver settings. QEMU writes its own log and the serial
/// log straight to files: a virtlogd per VM would cost ~5 MiB PSS each.
/// The daemon never acts on the guest when it is itself told to stop:
/// libvirt's session defaults would managed-save or power off running
/// guests then, where kvirtd alone decides (a restarted daemon must find
/// its guest running; a stopped VM has had its grace period).
const QEMU_CONF: &str = "# Written by kvirtd for this VM only.
stdio_handler = \"file\"
auto_shutdown_try_save = \"none\"
auto_shutdown_try_shutdown = \"none\"
auto_shutdown_poweroff = \"none\"
";
/// The VM's daemon serves one VM and kvirtd, one call at a time, so it
/// keeps one thread per pool rather than libvirt's default of five (each
/// costs memory in every VM), and does not ping kvirtd (libvirt's default
/// is every five seconds: at 100 VMs the pings were most of kvirtd's idle
/// CPU; a unix socket closes when either side dies, and kvirtd pings the
/// daemon to notice a hung one). Written for either daemon: each reads its
/// own.
const DAEMON_CONF: &str = "# Written by kvirtd for this VM only.
min_workers = 1
max_workers = 4
prio_workers = 1
admin_min_workers = 1
admin_max_workers = 1
keepalive_interval = -1
";

#[derive(Clone, Debug)]
pub struct HostStorage {
    pub host: HostLayout,
    /// Whose the files are that this instance makes: set per VM by
    /// [`HostStorage::for_vm`].
    owner: Option<Owner>,
    /// What of the VMs' file system stays free: a writable disk (an
    /// emptyDisk, an overlay) that could grow past it is refused.
    reserve: u64,
    /// What one VM's emptyDisks and overlays may grow to together
    /// (`vm.max_disk_size`).
    vm_limit: u64,
}

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> StorageError {
    let path = path.to_owned();
    move |source| StorageError::Io { path, op, source }
}

impl HostStorage {
    pub fn new(host: HostLayout) -> Self {
        Self {
            host,
            owner: None,
            reserve: 0,
            vm_limit: u64::MAX,
        }
    }

    /// One VM's emptyDisks and overlays together may grow to `bytes` at
    /// most (`vm.max_disk_size`): an overlay's size is its image's, known
    /// only once pulled, so this is checked as each is made.
    pub fn with_vm_limit(mut self, bytes: u64) -> Self {
        self.vm_limit = bytes;
        self
    }

    /// Keeps `bytes` of the VMs' file system free (`storage.free_space_reserve`).
    pub fn with_reserve(mut self, bytes: u64) -> Self {
        self.reserve = bytes;
        self
    }

    /// A writable disk of the VM may grow to `size` (sparse, it takes
    /// nothing yet): refused unless the file system holding `dir` has that
    /// much free above the reserve, so VMs cannot fill the host's disk
    /// with disks it could never have held.
    /// What the other writable disks may still take counts as taken, and
    /// the disk is recorded before it is made (see `host::growth`).
    fn room_for(&self, dir: &Path, disk: &Path, size: u64) -> Result<(), StorageError> {
        let st = nix::sys::statvfs::statvfs(dir).map_err(|e| io(dir, "statvfs")(e.into()))?;
        let growth = self.growth();
        let (id, rel) = self.state_rel(disk)?;
        let vm_total = growth.vm_total(&id, rel).saturating_add(size);
        if vm_total > self.vm_limit {
            return Err(StorageError::Disk {
                path: disk.to_owned(),
                message: format!(
                    "may grow to {size} bytes: the VM's emptyDisks and overlays would total {vm_total} bytes, more than vm.max_disk_size ({} bytes)",
                    self.vm_limit
                ),
            });
        }
        room(&st, self.reserve, growth.pending(), disk, size)?;
        growth
            .record(&id, rel, size)
            .map_err(io(&growth.dir, "record disk size"))
    }

    fn growth(&self) -> Growth {
        Growth {
            dir: self.host.disk_growth_dir(),
            vms: self.host.vms_state_dir(),
        }
    }

    /// The VM id and the path below its state directory of `path`.
    fn state_rel<'p>(&self, path: &'p Path) -> Result<(String, &'p Path), StorageError> {
        let refuse = || StorageError::Disk {
            path: path.to_owned(),
            message: "not in a VM's state directory".into(),
        };
        let rel = path
            .strip_prefix(self.host.vms_state_dir())
            .map_err(|_| refuse())?;
        let mut parts = rel.components();
        let id = parts.next().ok_or_else(refuse)?;
        let id = id.as_os_str().to_str().ok_or_else(refuse)?.to_owned();
        Ok((id, parts.as_path()))
    }

    /// What a predecessor killed mid-way left in the staging directory:
    /// seed ISOs (secrets, tokens) and half-made disks nobody will finish.
    /// For kvirtd's start, before any VM is prepared.
    pub fn sweep_staging(&self) -> std::io::Result<usize> {
        let staging = self.host.state_dir.join(".staging");
        let mut swept = 0;
        let entries = match std::fs::read_dir(&staging) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        for e in entries.flatten() {
            crate::host::image::remove_any(&e.path())?;
            swept += 1;
        }
        Ok(swept)
    }

    /// kvirt's records of every VM made root's alone (see
    /// `HostLayout::root_only_dirs`), also where an earlier kvirt left them
    /// readable. For kvirtd's start, before anything is written there.
    pub fn seal_records(&self) -> std::io::Result<()> {
        for dir in self.host.root_only_dirs() {
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        }
        // Where an earlier kvirt kept a record beside other files: moved
        // into its directory (unless one is there already: the newer), or
        // dropped where it is remade anyway. A crash between the two
        // leaves the old one, moved at the next start.
        for (old, new) in self.host.legacy_record_files() {
            let moved = match new {
                Some(new) if std::fs::symlink_metadata(&new).is_err() => {
                    std::fs::rename(&old, &new)
                }
                _ => std::fs::remove_file(&old),
            };
            match moved {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    }

    /// This storage, making files for the VM whose identity is `owner`.
    fn for_vm(&self, owner: Option<Owner>) -> Self {
        Self {
            host: self.host.clone(),
            owner,
            reserve: self.reserve,
            vm_limit: self.vm_limit,
        }
    }

    fn ids(&self) -> Option<Ids> {
        self.owner.map(|o| (o.uid, o.gid))
    }

    /// A file of root's (staged, never the VM's) handed to the VM's user.
    fn own(&self, path: &Path) -> Result<(), StorageError> {
        if let Some(o) = self.owner {
            nix::unistd::chown(path, Some(Uid::from_raw(o.uid)), Some(Gid::from_raw(o.gid)))
                .map_err(|e| io(path, "chown")(e.into()))?;
        }
        Ok(())
    }

    /// The probe's capability cache, as a copy of the VM's own: whatever
    /// its libvirt writes there, no other VM reads.
    fn copy_capabilities(&self, to: &Beneath) -> std::io::Result<()> {
        let probe = self.host.probe_dir();
        let from = self.host.probe_capabilities_dir();
        let Ok(from) =
            Beneath::open(&probe).and_then(|p| p.dir(from.strip_prefix(&probe).unwrap_or(&from)))
        else {
            return Ok(());
        };
        for name in from.entries()? {
            let Some(name) = name.to_str().filter(|n| n.ends_with(".xml")) else {
                continue;
            };
            let xml = from.read(name, MAX_CAPABILITIES)?;
            to.write(name, &xml, 0o600, self.ids())?;
        }
        Ok(())
    }

    /// The probe's directories, kvirt's user's.
    fn create_probe_dirs_blocking(&self, owner: Owner) -> Result<(), StorageError> {
        let ids = Some((owner.uid, owner.gid));
        let made = |base: &Path, dir: &Path, subdirs: &[&str]| -> Result<(), StorageError> {
            let name = dir.strip_prefix(base).unwrap_or(dir);
            let d = Beneath::open(base)
                .and_then(|b| b.mkdir(&name.to_string_lossy(), 0o700, ids))
                .map_err(io(dir, "create directory"))?;
            for sub in subdirs {
                d.mkdir(sub, 0o700, ids)
                    .map_err(io(&dir.join(sub), "create directory"))?;
            }
            Ok(())
        };
        std::fs::create_dir_all(&self.host.cache_dir)
            .map_err(io(&self.host.cache_dir, "create directory"))?;
        std::fs::create_dir_all(&self.host.runtime_dir)
            .map_err(io(&self.host.runtime_dir, "create directory"))?;
        made(
            &self.host.cache_dir,
            &self.host.probe_dir(),
            &["config", "cache"],
        )?;
        made(&self.host.runtime_dir, &self.host.probe_runtime_dir(), &[])
    }

    /// A directory on a path only root controls (`/var/lib/kvirt/vms`...).
    fn mkdir(&self, dir: &Path, mode: u32, owned: bool) -> Result<(), StorageError> {
        std::fs::create_dir_all(dir).map_err(io(dir, "create directory"))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(io(dir, "chmod"))?;
        if owned {
            self.own(dir)?;
        }
        Ok(())
    }

    /// The directory holding `path`, a file in one of a VM's own
    /// directories, reached beneath that directory; and the file's name.
    fn vm_parent(&self, path: &Path) -> Result<(Beneath, String), StorageError> {
        let (vm, rel) = self.vm_dir_of(path)?;
        let name = rel
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| StorageError::Disk {
                path: path.to_owned(),
                message: "not a file in a VM's own directory".into(),
            })?;
        let inner = rel.parent().unwrap_or(Path::new(""));
        let dir = if inner.as_os_str().is_empty() {
            vm
        } else {
            vm.dir(inner).map_err(io(&vm.path().join(inner), "open"))?
        };
        Ok((dir, name.to_owned()))
    }

    /// The VM directory (state or runtime) holding `path`, and the path
    /// below it.
    fn vm_dir_of<'p>(&self, path: &'p Path) -> Result<(Beneath, &'p Path), StorageError> {
        let refuse = || StorageError::Disk {
            path: path.to_owned(),
            message: "not in a VM's own directory".into(),
        };
        let base = [self.host.vms_state_dir(), self.host.vms_runtime_dir()]
            .into_iter()
            .find(|b| path.starts_with(b))
            .ok_or_else(refuse)?;
        let rel = path.strip_prefix(&base).map_err(|_| refuse())?;
        let mut parts = rel.components();
        let id = parts.next().ok_or_else(refuse)?;
        let vm = Beneath::open(&base.join(id)).map_err(io(&base.join(id), "open"))?;
        Ok((vm, parts.as_path()))
    }

    /// Moves a staged file of root's to `dest` in a VM's directory,
    /// replacing whatever is there without following it.
    fn place(&self, staged: &Path, dest: &Path) -> Result<(), StorageError> {
        let (dir, name) = self.vm_parent(dest)?;
        dir.rename_in(staged, &name)
            .map_err(io(dest, "rename into place"))
    }

    fn create_dirs_blocking(&self, p: &VmPaths) -> Result<(), StorageError> {
        // Parents belong to root and only let owners of a VM's own directory in.
        for parent in [self.host.vms_state_dir(), self.host.vms_runtime_dir()] {
            self.mkdir(&parent, 0o711, false)?;
        }
        let ids = self.ids();
        let made =
            |base: &Path, dir: &Path, subdirs: &[PathBuf]| -> Result<Beneath, StorageError> {
                let name = dir.strip_prefix(base).unwrap_or(dir);
                let top = Beneath::open(base)
                    .and_then(|b| b.mkdir(&name.to_string_lossy(), 0o700, ids))
                    .map_err(io(dir, "create directory"))?;
                for sub in subdirs {
                    let rel = sub.strip_prefix(dir).unwrap_or(sub);
                    top.mkdir_all(rel, 0o700, ids)
                        .map_err(io(sub, "create directory"))?;
                }
                Ok(top)
            };
        // The runtime directory is a tmpfs of its own, of a bounded size:
        // on /run itself a VM could fill the host's /run (systemd's own
        // runtime state) through what its QEMU writes there.
        // A finished instance's kept console log makes way.
        if is_kept(&p.runtime_dir) {
            std::fs::remove_dir_all(&p.runtime_dir).map_err(io(&p.runtime_dir, "remove"))?;
        }
        made(&self.host.vms_runtime_dir(), &p.runtime_dir, &[])?;
        self.own_tmpfs(&p.runtime_dir)?;
        made(
            &self.host.vms_runtime_dir(),
            &p.runtime_dir,
            &[p.xdg_runtime_dir()],
        )?;
        // libvirt makes the rest of its cache itself, but these are the
        // parents of the capability cache's mount point.
        let state = made(
            &self.host.vms_state_dir(),
            &p.state_dir,
            &[p.xdg_config_dir(), p.disk_dir()],
        )?;
        let caps = p.capabilities_dir();
        let caps_dir = state
            .mkdir_all(caps.strip_prefix(&p.state_dir).unwrap_or(&caps), 0o700, ids)
            .map_err(io(&caps, "create directory"))?;
        // A VM that starts before the probe has finished probes QEMU itself.
        if let Err(e) = self.copy_capabilities(&caps_dir) {
            warn!("capability cache not copied to {}: {e}", caps.display());
        }
        let conf = p.qemu_conf();
        let conf_dir = conf.parent().expect("qemu.conf has a parent");
        let rel = conf_dir.strip_prefix(&p.state_dir).unwrap_or(conf_dir);
        let dir = state
            .mkdir_all(rel, 0o700, ids)
            .map_err(io(conf_dir, "create directory"))?;
        for (name, text) in [
            ("qemu.conf", QEMU_CONF),
            ("virtqemud.conf", DAEMON_CONF),
            ("libvirtd.conf", DAEMON_CONF),
        ] {
            dir.write(name, text.as_bytes(), 0o600, ids)
                .map_err(io(&conf_dir.join(name), "write"))?;
        }
        Ok(())
    }

    /// Mounts a tmpfs of [`RUNTIME_DIR_BYTES`] on `dir` (a VM's runtime
    /// directory, just made in root's `/run/kvirt/vms`), unless one is
    /// there already (a start that a crash cut short).
    fn own_tmpfs(&self, dir: &Path) -> Result<(), StorageError> {
        use nix::mount::{mount, MsFlags};
        if is_mount_point(dir) {
            return Ok(());
        }
        let mut options = format!("size={RUNTIME_DIR_BYTES},mode=0700");
        if let Some((uid, gid)) = self.ids() {
            options.push_str(&format!(",uid={uid},gid={gid}"));
        }
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        // Through the directory's fd: the one just made, whatever its name
        // leads to by now.
        let d = Beneath::open(dir).map_err(io(dir, "open"))?;
        let target = format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(&d))
        );
        mount(
            Some("tmpfs"),
            target.as_str(),
            Some("tmpfs"),
            flags,
            Some(options.as_str()),
        )
        .map_err(|e| io(dir, "mount its tmpfs")(e.into()))
    }

    fn prepare_disk_blocking(
        &self,
        disk: &DiskPrep,
        roots: &[PathBuf],
        images: &Pulled,
    ) -> Result<(), StorageError> {
        match disk {
            DiskPrep::CreateQcow2 {
                path, size_bytes, ..
            } => {
                // An emptyDisk lives as long as the VM's state directory.
                let (dir, name) = self.vm_parent(path)?;
                match dir.file(&name, OFlag::O_RDONLY) {
                    Ok(_) => return Ok(()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(path, "open")(e)),
                }
                self.room_for(&self.host.state_dir, path, *size_bytes)?;
                self.staged("disk", |work| {
                    let tmp = work.join("disk.qcow2");
                    qemu_img_create(&tmp, &[], Some(*size_bytes))?;
                    self.own(&tmp)?;
                    self.place(&tmp, path)
                })
            }
            DiskPrep::KernelBoot { image, .. } => {
                for need in disk.image_needs() {
                    let Some(pulled) = images.get(need.key) else {
                        return Err(StorageError::Disk {
                            path: disk.path().to_owned(),
                            message: format!("{image} is not in the image cache"),
                        });
                    };
                    let dest = match need.key {
                        crate::core::convert::kernelboot::KERNEL => kernel_dest(disk),
                        _ => initrd_dest(disk),
                    };
                    if let Some(dest) = dest {
                        self.place_copy(&pulled.path, dest)?;
                    }
                }
                Ok(())
            }
            DiskPrep::Overlay {
                volume,
                path,
                backing,
            } => {
                let (base, format, size) = match (backing, images.get(volume)) {
                    (Backing::Image { image, .. }, None) => {
                        return Err(StorageError::Disk {
                            path: path.clone(),
                            message: format!("{image} is not in the image cache"),
                        })
                    }
                    (Backing::Image { .. }, Some(d)) => {
                        // The cache is root's alone: the VM reads its own
                        // image, for its life, and no other.
                        self.grant(&d.path, acl::READ)?;
                        (d.path.clone(), d.format, None)
                    }
                    (Backing::HostDisk(base), _) => self.ephemeral_base(base, roots)?,
                };
                // A fresh overlay may grow to its base's size.
                let grows_to = match size {
                    Some(s) => s,
                    None => image_virtual_size(&base).map_err(io(&base, "read"))?,
                };
                self.room_for(&self.host.state_dir, path, grows_to)?;
                // A fresh write layer on every start, as KubeVirt's is.
                let base = base.to_string_lossy();
                self.staged("overlay", |work| {
                    let tmp = work.join("overlay.qcow2");
                    // With the base's size given, qemu-img does not open
                    // a hostDisk base by name (`-u`): root reads only what
                    // it opened beneath the root.
                    let unsafe_flag: &[&str] = if size.is_some() { &["-u"] } else { &[] };
                    let options = [unsafe_flag, &["-F", format, "-b", &base]].concat();
                    qemu_img_create(&tmp, &options, size)?;
                    self.own(&tmp)?;
                    self.place(&tmp, path)
                })
            }
            DiskPrep::CreateRawIfMissing {
                path, size_bytes, ..
            } => {
                let how = HostOpen::Create(NewDisk::HostDisk {
                    size: *size_bytes,
                    reserve: self.reserve,
                });
                let (file, real) = host_disk(path, roots, how)?;
                self.grant_file(&file, &real, acl::READ | acl::WRITE)
            }
            DiskPrep::SeedIso { path, seed, .. } => self.seed_iso(path, seed),
            DiskPrep::EfiVars {
                owner,
                nvram,
                kept_dir,
            } => self.restore_kept(owner, nvram, kept_dir, EFI_VARS),
            DiskPrep::TpmState {
                owner,
                state,
                kept_dir,
            } => self.restore_kept(owner, state, kept_dir, TPM_STATE),
            DiskPrep::Hugepages {
                vm,
                page_bytes,
                pages,
                qemu_conf,
            } => self.hugepages(vm, *page_bytes, *pages, qemu_conf),
            DiskPrep::RequireExisting { path, .. } => {
                let (file, real) = host_disk(path, roots, HostOpen::Existing)?;
                self.grant_file(&file, &real, acl::READ | acl::WRITE)
            }
            DiskPrep::Claim {
                root,
                path,
                size_bytes,
                ..
            } => self.claim_disk(root, path, *size_bytes).map(|_| ()),
            DiskPrep::ClaimDevice {
                device,
                node,
                read_only,
                ..
            } => self.claim_device(device, node, *read_only),
        }
    }

    /// A filesystem claim's disk.img, opened beneath its claim root like a
    /// hostDisk (a link, FIFO or device is refused): made sparse if
    /// missing, grown offline when the claim grew (KubeVirt's
    /// `ExpandDisks`), never shrunk, its owner and mode left as they are.
    /// `Some`: the disk is smaller than the claim asks (KubeVirt's
    /// `ToleratedSmallPV`), which the VMI's Events say.
    fn claim_disk(
        &self,
        root: &Path,
        path: &Path,
        size: Option<u64>,
    ) -> Result<Option<String>, StorageError> {
        let roots = [root.to_owned()];
        let Some(target) = size else {
            let (file, real) = host_disk(path, &roots, HostOpen::Existing)?;
            return self.grant_file(&file, &real, acl::READ).map(|()| None);
        };
        let how = HostOpen::Create(NewDisk::Claim { size: target });
        let (file, real) = host_disk(path, &roots, how)?;
        let mut len = file.metadata().map_err(io(path, "stat"))?.len();
        if len < target {
            let st =
                nix::sys::statvfs::fstatvfs(&file).map_err(|e| io(path, "statvfs")(e.into()))?;
            // Room for the whole disk, as for a new one: a sparse file
            // holds only what it has allocated.
            let held =
                std::os::unix::fs::MetadataExt::blocks(&file.metadata().map_err(io(path, "stat"))?)
                    * 512;
            let free = st.blocks_available() as u64 * st.fragment_size() as u64 + held;
            match crate::core::pvc::fit(path, target, free) {
                Ok((size, false)) if size == target => {
                    // The same inode, opened for writing through its fd.
                    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
                    let w = std::fs::OpenOptions::new()
                        .write(true)
                        .open(format!("/proc/self/fd/{fd}"))
                        .map_err(io(path, "reopen to grow"))?;
                    w.set_len(target).map_err(io(path, "grow"))?;
                    tracing::info!(path = %path.display(), from = len, to = target, "claim disk grown");
                    len = target;
                }
                _ => tracing::warn!(
                    path = %path.display(),
                    "the claim grew to {target} bytes but its volume has no room to grow disk.img ({len} bytes)"
                ),
            }
        }
        self.grant_file(&file, &real, acl::READ | acl::WRITE)?;
        Ok((len < target).then(|| {
            format!(
                "{}: {len} bytes, less than the {target} the claim asks: its volume has no \
                 more room",
                path.display()
            )
        }))
    }

    /// A block claim: the host's device checked to be a block device, and
    /// a node of it made for the VM in its own state directory (through
    /// the directory's fd: the VM can write there), the VM's own, 0600.
    /// The host's `/dev` node is never changed.
    fn claim_device(
        &self,
        device: &Path,
        node: &Path,
        read_only: bool,
    ) -> Result<(), StorageError> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let disk_err = |message: String| StorageError::Disk {
            path: device.to_owned(),
            message,
        };
        let meta = std::fs::metadata(device).map_err(io(device, "stat"))?;
        if !meta.file_type().is_block_device() {
            return Err(disk_err("is not a block device".into()));
        }
        let (dir, name) = match (node.parent(), node.file_name().and_then(|n| n.to_str())) {
            (Some(d), Some(n)) => (d, n),
            _ => return Err(disk_err("has no node path".into())),
        };
        let vms = self.host.vms_state_dir();
        let rel = dir
            .strip_prefix(&vms)
            .map_err(|_| disk_err(format!("{} is not in a VM's directory", node.display())))?;
        let top = Beneath::open(&vms).map_err(io(&vms, "open"))?;
        // Traversable: the VM opens the node through it.
        let parent = top.make_missing(rel, 0o755).map_err(io(dir, "make"))?;
        parent.remove(name).map_err(io(node, "remove"))?;
        let mode = if read_only { 0o400 } else { 0o600 };
        let owner = self.owner.map(|o| (o.uid, o.gid));
        parent
            .mknod_block(name, mode, meta.rdev(), owner)
            .map_err(io(node, "mknod"))
    }

    /// Lends the VM's identity `perm` on a hostDisk (or a cached image)
    /// for the VM's life (see [`Grants`]).
    fn grant(&self, path: &Path, perm: u16) -> Result<(), StorageError> {
        let Some(owner) = self.owner else {
            return Ok(());
        };
        let real = std::fs::canonicalize(path).map_err(io(path, "resolve"))?;
        self.grants().lend(&real, owner.uid, perm)
    }

    /// [`HostStorage::grant`] on a file root already holds open.
    fn grant_file(&self, file: &File, real: &Path, perm: u16) -> Result<(), StorageError> {
        let Some(owner) = self.owner else {
            return Ok(());
        };
        self.grants().lend_file(file, real, owner.uid, perm)
    }

    fn grants(&self) -> Grants {
        Grants::new(self.host.grants_dir())
    }
}

/// The VM's variables and TPM state into its kept directory, when a VM
/// that keeps them ran.
fn keep_efi_vars(state_dir: &Path, nvram: &Path, kept: &Path) -> Result<(), StorageError> {
    let active = kept.join(EFI_ACTIVE);
    if !active.exists() {
        return Ok(());
    }
    keep_file(state_dir, nvram, &kept.join(EFI_VARS))?;
    match std::fs::read_to_string(kept.join(TPM_PATH)) {
        Ok(tpm) => keep_file(state_dir, Path::new(tpm.trim()), &kept.join(TPM_STATE))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(&kept.join(TPM_PATH), "read")(e)),
    }
    std::fs::remove_file(&active).map_err(io(&active, "remove"))
}

/// One file of the VM's into `to`. The file is the VM user's: it is opened
/// without following links, must be a regular file of a sane size, and
/// replaces the kept copy only once whole.
fn keep_file(state_dir: &Path, file: &Path, to: &Path) -> Result<(), StorageError> {
    use std::os::unix::fs::OpenOptionsExt;
    let refuse = |message: String| StorageError::Disk {
        path: file.to_owned(),
        message,
    };
    let Ok(rel) = file.strip_prefix(state_dir) else {
        return Err(refuse(format!("not in {}", state_dir.display())));
    };
    match Beneath::open(state_dir).and_then(|d| d.file(rel, OFlag::O_RDONLY)) {
        // Never started (or no such device): nothing new to keep.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io(file, "open")(e)),
        Ok(f) => {
            let meta = f.metadata().map_err(io(file, "stat"))?;
            if !meta.is_file() || meta.len() > MAX_EFI_VARS {
                return Err(refuse(format!(
                    "not a regular file of at most {MAX_EFI_VARS} bytes: not kept"
                )));
            }
            let tmp = to.with_extension("tmp");
            let mut out = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io(&tmp, "create"))?;
            std::io::copy(&mut std::io::Read::take(&f, MAX_EFI_VARS), &mut out)
                .and_then(|_| out.sync_all())
                .map_err(io(&tmp, "write"))?;
            std::fs::rename(&tmp, to).map_err(io(to, "rename into place"))
        }
    }
}

/// A qcow2 at `path`: empty of `size` bytes, or over a backing file.
fn qemu_img_create(path: &Path, options: &[&str], size: Option<u64>) -> Result<(), StorageError> {
    let out = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .args(options)
        .arg(path)
        .args(size.map(|s| s.to_string()))
        .output()
        .map_err(io(path, "run qemu-img"))?;
    if !out.status.success() {
        return Err(StorageError::Disk {
            path: path.to_owned(),
            message: format!(
                "qemu-img create failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(())
}

impl HostStorage {
    /// An ephemeral volume's base: an existing file under the roots, only
    /// read, which must not itself lead QEMU to other files.
    fn ephemeral_base(
        &self,
        base: &Path,
        roots: &[PathBuf],
    ) -> Result<(PathBuf, &'static str, Option<u64>), StorageError> {
        let disk_err = |message: String| StorageError::Disk {
            path: base.to_owned(),
            message,
        };
        let (file, real) = host_disk(base, roots, HostOpen::Existing)?;
        let mut header = Vec::with_capacity(104);
        std::io::Read::read_to_end(&mut std::io::Read::take(&file, 104), &mut header)
            .map_err(io(&real, "read"))?;
        let format = crate::core::image::disk_format(&header).map_err(disk_err)?;
        let len = file.metadata().map_err(io(&real, "stat"))?.len();
        let size = crate::core::image::virtual_size(&header, len);
        // Only read, through the VM's own overlay.
        self.grant_file(&file, &real, acl::READ)?;
        Ok((real, format, Some(size)))
    }

    /// Files for the VM's disk directory are made in a root-only staging
    /// directory on the same file system and renamed into place, so nothing
    /// the VM's user can write there (a planted symlink) steers root.
    fn staged(
        &self,
        what: &str,
        make: impl FnOnce(&Path) -> Result<(), StorageError>,
    ) -> Result<(), StorageError> {
        let staging = self.host.state_dir.join(".staging");
        self.mkdir(&staging, 0o700, false)?;
        let work = nix::unistd::mkdtemp(&staging.join(format!("{what}-XXXXXX")))
            .map_err(|e| io(&staging, "create staging directory")(e.into()))?;
        let result = make(&work);
        let _ = std::fs::remove_dir_all(&work);
        result
    }

    /// Puts the EFI variables (or TPM state: `name`) this owner's VM left
    /// back where libvirt looks for them, and marks the VM as one whose
    /// state is kept when it goes. What another owner left (a VM of the
    /// same name made anew) is dropped: the firmware and the TPM start
    /// afresh.
    fn restore_kept(
        &self,
        owner: &str,
        file: &Path,
        kept: &Path,
        name: &str,
    ) -> Result<(), StorageError> {
        let parent = kept.parent().expect("efi-vars/ has a parent");
        self.mkdir(parent, 0o700, false)?;
        self.mkdir(kept, 0o700, false)?;
        let owner_file = kept.join(EFI_OWNER);
        if std::fs::read_to_string(&owner_file).ok().as_deref() != Some(owner) {
            for stale in [EFI_VARS, TPM_STATE, TPM_PATH] {
                let stale = kept.join(stale);
                match std::fs::remove_file(&stale) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(io(&stale, "remove")(e))
                    }
                    _ => {}
                }
            }
            std::fs::write(&owner_file, owner).map_err(io(&owner_file, "write"))?;
        }
        let copy = kept.join(name);
        if copy.is_file() {
            let (vm, rel) = self.vm_dir_of(file)?;
            let dir = rel.parent().unwrap_or(Path::new(""));
            vm.mkdir_all(dir, 0o700, self.ids())
                .map_err(io(&vm.path().join(dir), "create directory"))?;
            self.place_copy(&copy, file)?;
        }
        // Which TPM state this run keeps: the one its TPM restore names
        // (it comes after the variables'), none when it keeps only those.
        let at = kept.join(TPM_PATH);
        if name == TPM_STATE {
            std::fs::write(&at, file.as_os_str().as_encoded_bytes()).map_err(io(&at, "write"))?;
        } else {
            match std::fs::remove_file(&at) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io(&at, "remove")(e))
                }
                _ => {}
            }
        }
        let active = kept.join(EFI_ACTIVE);
        std::fs::write(&active, b"").map_err(io(&active, "write"))
    }

    /// The VM's own directory on the hugetlbfs of its page size, named in
    /// its libvirt's qemu.conf, once enough pages are known to be free
    /// (QEMU's own error would only say it could not allocate memory).
    fn hugepages(
        &self,
        vm: &str,
        page_bytes: u64,
        pages: u64,
        qemu_conf: &Path,
    ) -> Result<(), StorageError> {
        let refuse = |message: String| StorageError::Disk {
            path: qemu_conf.to_owned(),
            message,
        };
        let mount = hugepages::host_mount(page_bytes).map_err(refuse)?;
        let free = hugepages::available_pages(page_bytes).map_err(refuse)?;
        if free < pages {
            return Err(refuse(format!(
                "{pages} hugepages of {} are needed and {free} are free",
                hugepages::human(page_bytes)
            )));
        }
        let dir = hugepages::vm_dir(&mount, vm);
        self.mkdir(dir.parent().expect("kvirt/ has a parent"), 0o711, false)?;
        self.mkdir(&dir, 0o700, true)?;
        let line = format!("hugetlbfs_mount = {:?}\n", dir.display().to_string());
        let (dir, name) = self.vm_parent(qemu_conf)?;
        let mut f = dir
            .file(&name, OFlag::O_WRONLY | OFlag::O_APPEND)
            .map_err(io(qemu_conf, "open"))?;
        std::io::Write::write_all(&mut f, line.as_bytes()).map_err(io(qemu_conf, "write"))
    }

    fn seed_iso(&self, path: &Path, seed: &Seed) -> Result<(), StorageError> {
        self.staged("seed", |work| self.seed_iso_in(work, path, seed))
    }

    /// A private copy of a file from the image cache (the VM's user may
    /// read it; nobody changes the cached original).
    fn place_copy(&self, from: &Path, to: &Path) -> Result<(), StorageError> {
        self.staged("copy", |work| {
            let tmp = work.join("file");
            std::fs::copy(from, &tmp).map_err(io(from, "copy"))?;
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o640))
                .map_err(io(&tmp, "chmod"))?;
            self.own(&tmp)?;
            self.place(&tmp, to)
        })
    }

    fn seed_iso_in(&self, work: &Path, path: &Path, seed: &Seed) -> Result<(), StorageError> {
        let iso = make_iso(work, path, seed)?;
        std::fs::set_permissions(&iso, std::fs::Permissions::from_mode(0o640))
            .map_err(io(&iso, "chmod"))?;
        self.own(&iso)?;
        self.place(&iso, path)
    }

    fn keep_console_log_blocking(&self, dir: &Path) -> Result<(), StorageError> {
        let tail = Beneath::open(dir)
            .map(|d| console_tail(&d, KEPT_CONSOLE))
            .unwrap_or_default();
        // The tmpfs and all the VM wrote there go; root's copy stays.
        if is_mount_point(dir) {
            nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| io(dir, "unmount")(e.into()))?;
        }
        match std::fs::remove_dir_all(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(dir, "remove")(e)),
            _ => {}
        }
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        let kept = Beneath::open(&self.host.vms_runtime_dir())
            .and_then(|parent| parent.mkdir(&name, 0o700, None))
            .map_err(io(dir, "create directory"))?;
        kept.write("console.log", &tail, 0o600, None)
            .map_err(io(dir, "keep the console log"))
    }

    /// The seed ISO at `path` made again from `seed` (a serviceAccount
    /// disk's token renewed) and written over the one the VM has, in place:
    /// QEMU keeps the file open, so the guest reads the new one once it
    /// rereads the disk. The file is the VM's user's: it is opened beneath
    /// the VM's directory, never followed through a link nor opened as a
    /// FIFO or device, and must still be the VM's one file with room for
    /// the new image (what follows it is left as it was).
    fn rewrite_seed_iso_blocking(&self, path: &Path, seed: &Seed) -> Result<(), StorageError> {
        let refuse = |message: String| StorageError::Disk {
            path: path.to_owned(),
            message,
        };
        self.staged("seed", |work| {
            let iso = make_iso(work, path, seed)?;
            let new = std::fs::read(&iso).map_err(io(&iso, "read"))?;
            let (dir, name) = self.vm_parent(path)?;
            let f = dir.file(&name, OFlag::O_WRONLY).map_err(io(path, "open"))?;
            let st = nix::sys::stat::fstat(&f).map_err(|e| io(path, "stat")(e.into()))?;
            if self.owner.is_some_and(|o| o.uid != st.st_uid) || st.st_nlink != 1 {
                return Err(refuse("is no longer the VM's own image".into()));
            }
            if new.len() as u64 > st.st_size as u64 {
                return Err(refuse(format!(
                    "the new image ({} bytes) is larger than the disk the guest has ({} bytes)",
                    new.len(),
                    st.st_size
                )));
            }
            std::os::unix::fs::FileExt::write_all_at(&f, &new, 0)
                .and_then(|()| f.sync_data())
                .map_err(io(path, "write"))
        })
    }
}

/// A seed ISO with `seed`'s files, made in `work` (root's staging
/// directory): its path there.
fn make_iso(work: &Path, path: &Path, seed: &Seed) -> Result<PathBuf, StorageError> {
    let refuse = |message: String| StorageError::Disk {
        path: path.to_owned(),
        message,
    };
    if let Some(o) = seed.from_objects.first() {
        return Err(refuse(format!("{}: {} was not read", o.field, o.object)));
    }
    let files = work.join("files");
    for (rel, bytes) in &seed.files {
        let safe = Path::new(rel)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !safe {
            return Err(refuse(format!("{rel:?} is not a path inside the image")));
        }
        let f = files.join(rel);
        if let Some(parent) = f.parent() {
            std::fs::create_dir_all(parent).map_err(io(parent, "create directory"))?;
        }
        std::fs::write(&f, bytes).map_err(io(&f, "write"))?;
    }
    let iso = work.join("seed.iso");
    let out = std::process::Command::new("xorrisofs")
        .args(["-quiet", "-input-charset", "utf-8", "-joliet", "-rock"])
        .args(["-volid", &seed.label, "-output"])
        .arg(&iso)
        .arg(&files)
        .output()
        .map_err(io(path, "run xorrisofs"))?;
    if !out.status.success() {
        return Err(StorageError::Disk {
            path: path.to_owned(),
            message: format!(
                "xorrisofs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(iso)
}

/// What is kept of a finished VM's console log: enough to see why it
/// ended, little enough for any number of finished VMIs.
pub const KEPT_CONSOLE: u64 = 64 << 10;

/// The last `max` bytes of the console log and its backup in `dir` (the
/// VM's): read beneath it, never through a link, never from a FIFO, and
/// only the end of a file however large.
fn console_tail(dir: &Beneath, max: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut out = Vec::new();
    for name in ["console.log.1", "console.log"] {
        let Ok(f) = dir.file(name, OFlag::O_RDONLY) else {
            continue;
        };
        let len = f.metadata().map_or(0, |m| m.len());
        let take = len.min(max);
        let mut buf = vec![0; take as usize];
        if f.read_exact_at(&mut buf, len - take).is_ok() {
            out.extend(buf);
        }
    }
    let cut = out.len().saturating_sub(max as usize);
    out.split_off(cut)
}

/// The size of each VM's runtime directory (its own tmpfs): sockets, pid
/// files, libvirt's state and the console log (capped at 2 MiB, with one
/// backup) fit many times over.
pub const RUNTIME_DIR_BYTES: u64 = 16 << 20;

/// Whether a disk that may grow to `size` fits the file system `st`
/// describes, above `reserve`.
fn room(
    st: &nix::sys::statvfs::Statvfs,
    reserve: u64,
    pending: u64,
    disk: &Path,
    size: u64,
) -> Result<(), StorageError> {
    let free = st.blocks_available() * st.fragment_size();
    if size > free.saturating_sub(reserve).saturating_sub(pending) {
        return Err(StorageError::Disk {
            path: disk.to_owned(),
            message: format!(
                "may grow to {size} bytes, and the host has {free} bytes free, of which {reserve} are kept free (storage.free_space_reserve) and {pending} may still be taken by the VMs' other disks"
            ),
        });
    }
    Ok(())
}

/// Whether `dir` is a finished VM's kept console log: root's (kvirtd's),
/// and no tmpfs of its own.
/// What is at a VM's runtime directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeDir {
    Absent,
    /// The VM's own (a tmpfs, once it has been made).
    Live,
    /// Only a finished VM's kept console log: root's, no tmpfs.
    Kept,
}

fn is_kept(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(dir).is_ok_and(|m| {
        m.is_dir() && m.uid() == nix::unistd::geteuid().as_raw() && !is_mount_point(dir)
    })
}

/// Whether `dir` is the root of a mount (another file system than its
/// parent's; a link is never one).
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(d), Some(Ok(parent))) = (
        std::fs::symlink_metadata(dir),
        dir.parent().map(std::fs::symlink_metadata),
    ) else {
        return false;
    };
    d.is_dir() && d.dev() != parent.dev()
}

/// The size a guest sees of the disk file `path` (root's, in the image
/// cache: read by name).
fn image_virtual_size(path: &Path) -> std::io::Result<u64> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let mut header = Vec::with_capacity(104);
    f.take(104).read_to_end(&mut header)?;
    Ok(crate::core::image::virtual_size(&header, len))
}

/// How a hostDisk is opened.
#[derive(Clone, Copy)]
enum HostOpen {
    /// The file must be there (hostDisk `Disk`, an ephemeral base).
    Existing,
    /// Made when missing.
    Create(NewDisk),
}

/// How a missing hostDisk or claim disk is made.
#[derive(Clone, Copy)]
enum NewDisk {
    /// `DiskOrCreate`: its missing directories made too, of this size, and
    /// only when its file system has that much free above `reserve`.
    HostDisk { size: u64, reserve: u64 },
    /// A claim's disk.img: its directory (the volume) must exist; of this
    /// size, or less within KubeVirt's toleration (the caller tells the
    /// VMI).
    Claim { size: u64 },
}

impl NewDisk {
    fn dir(self, top: &Beneath, parent: &Path) -> std::io::Result<Beneath> {
        match self {
            Self::HostDisk { .. } => top.make_missing(parent, 0o755),
            Self::Claim { .. } => top.dir(parent),
        }
    }

    /// The size to make it, on a file system with `st` free.
    fn size(self, st: &nix::sys::statvfs::Statvfs, path: &Path) -> Result<u64, StorageError> {
        match self {
            Self::HostDisk { size, reserve } => {
                // The admin's roots: not counted against the VMs' own disks.
                room(st, reserve, 0, path, size)?;
                Ok(size)
            }
            Self::Claim { size } => {
                let free = st.blocks_available() * st.fragment_size();
                let (size, _) = crate::core::pvc::fit(path, size, free).map_err(|message| {
                    StorageError::Disk {
                        path: path.to_owned(),
                        message,
                    }
                })?;
                Ok(size)
            }
        }
    }
}

/// A hostDisk, opened beneath the allowed root it is written under, with
/// the rules of the VM's own directories ([`Beneath`]): a link anywhere on
/// the way, or a FIFO or device at the end, is refused, so a local user
/// who can write below a root cannot swap a directory for a link between
/// a check and a use and steer root's create or ACL elsewhere. Missing
/// directories of a new disk are made through fds too. Returns the open
/// file (what is lent is this inode) and its path below the real root.
fn host_disk(
    path: &Path,
    roots: &[PathBuf],
    how: HostOpen,
) -> Result<(File, PathBuf), StorageError> {
    let disk_err = |message: String| StorageError::Disk {
        path: path.to_owned(),
        message,
    };
    // The deepest root the path is written under (the converter checked
    // the path as written; roots are the administrator's, trusted by name).
    let root = roots
        .iter()
        .filter(|r| path.starts_with(r))
        .max_by_key(|r| r.components().count())
        .ok_or_else(|| disk_err("is outside the allowed hostDisk roots".into()))?;
    let rel = path.strip_prefix(root).unwrap_or(path);
    let real_root = std::fs::canonicalize(root).map_err(io(root, "resolve"))?;
    let real = real_root.join(rel);
    let (Some(name), parent) = (rel.file_name(), rel.parent().unwrap_or(Path::new(""))) else {
        return Err(disk_err("names no file below its root".into()));
    };
    let no_links = |e: std::io::Error| match e.raw_os_error() {
        Some(libc::ELOOP | libc::EXDEV | libc::ENOTDIR) => disk_err(format!(
            "{e}: a hostDisk is reached below its root without following links"
        )),
        _ if e.kind() == std::io::ErrorKind::NotFound && matches!(how, HostOpen::Existing) => {
            disk_err("hostDisk does not exist (type Disk needs an existing file)".into())
        }
        _ => io(path, "open")(e),
    };
    let top = Beneath::open(&real_root).map_err(io(&real_root, "open"))?;
    let file = match how {
        HostOpen::Existing => top.file(rel, OFlag::O_RDONLY).map_err(no_links)?,
        HostOpen::Create(new) => {
            let dir = new.dir(&top, parent).map_err(no_links)?;
            let name = name
                .to_str()
                .ok_or_else(|| disk_err("is not UTF-8".into()))?;
            match dir.file(name, OFlag::O_RDONLY) {
                Ok(f) => return Ok((f, real)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(no_links(e)),
            }
            // Sparse, it takes nothing yet; the guest may fill it.
            let st =
                nix::sys::statvfs::fstatvfs(&dir).map_err(|e| io(path, "statvfs")(e.into()))?;
            let size = new.size(&st, path)?;
            // root's, 0600: the VM is given it by an ACL entry.
            match dir.create(name, 0o600) {
                Ok(f) => {
                    f.set_len(size).map_err(io(path, "size disk"))?;
                    f
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    dir.file(name, OFlag::O_RDONLY).map_err(no_links)?
                }
                Err(e) => return Err(no_links(e)),
            }
        }
    };
    Ok((file, real))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| StorageError::Thread)?
}

impl Storage for HostStorage {
    async fn create_dirs(&self, paths: &VmPaths, owner: Option<Owner>) -> Result<(), StorageError> {
        let (this, p) = (self.for_vm(owner), paths.clone());
        blocking(move || this.create_dirs_blocking(&p)).await
    }

    async fn prepare_disk(
        &self,
        disk: &DiskPrep,
        roots: &[PathBuf],
        images: &Pulled,
        owner: Option<Owner>,
    ) -> Result<Option<String>, StorageError> {
        let (this, d, r, i) = (
            self.for_vm(owner),
            disk.clone(),
            roots.to_vec(),
            images.clone(),
        );
        blocking(move || match &d {
            DiskPrep::Claim {
                root,
                path,
                size_bytes,
                ..
            } => this.claim_disk(root, path, *size_bytes),
            _ => this.prepare_disk_blocking(&d, &r, &i).map(|()| None),
        })
        .await
    }

    async fn runtime_dir(&self, dir: &Path) -> RuntimeDir {
        let dir = dir.to_owned();
        let state = move || {
            Ok(match std::fs::symlink_metadata(&dir) {
                Err(_) => RuntimeDir::Absent,
                Ok(_) if is_kept(&dir) => RuntimeDir::Kept,
                Ok(_) => RuntimeDir::Live,
            })
        };
        // A stat that cannot be made: say it is there, as `exists` did not.
        blocking(state).await.unwrap_or(RuntimeDir::Live)
    }

    async fn keep_console_log(&self, paths: &VmPaths) -> Result<(), StorageError> {
        let (this, dir) = (self.clone(), paths.runtime_dir.clone());
        blocking(move || this.keep_console_log_blocking(&dir)).await
    }

    async fn rewrite_seed_iso(
        &self,
        path: &Path,
        seed: &Seed,
        owner: Option<Owner>,
    ) -> Result<(), StorageError> {
        let (this, p, s) = (self.for_vm(owner), path.to_owned(), seed.clone());
        blocking(move || this.rewrite_seed_iso_blocking(&p, &s)).await
    }

    async fn remove_dir(&self, dir: &Path) -> Result<(), StorageError> {
        let dir = dir.to_owned();
        let growth = self.growth();
        let vms = self.host.vms_state_dir();
        blocking(move || {
            // A VM's runtime directory is a tmpfs of its own: gone with it.
            if is_mount_point(&dir) {
                nix::mount::umount2(&dir, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(|e| io(&dir, "unmount")(e.into()))?;
            }
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io(&dir, "remove")(e))
                }
                _ => {}
            }
            // A state directory's disks are gone with it, then their record.
            match (dir.parent(), dir.file_name()) {
                (Some(parent), Some(id)) if parent == vms => growth
                    .forget(&id.to_string_lossy())
                    .map_err(io(&growth.dir, "forget disk sizes")),
                _ => Ok(()),
            }
        })
        .await
    }

    async fn keep_efi_vars(&self, paths: &VmPaths) -> Result<(), StorageError> {
        let (state, nvram, kept) = (
            paths.state_dir.clone(),
            paths.nvram(),
            paths.efi_vars_dir.clone(),
        );
        blocking(move || keep_efi_vars(&state, &nvram, &kept)).await
    }

    async fn kept_efi_vars(&self) -> Result<Vec<Kept>, StorageError> {
        let dir = self.host.efi_vars_dir();
        blocking(move || {
            let entries = match std::fs::read_dir(&dir) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
                r => r.map_err(io(&dir, "read directory"))?,
            };
            let mut kept = Vec::new();
            for e in entries {
                let e = e.map_err(io(&dir, "read directory"))?;
                let Ok(id) = e.file_name().into_string() else {
                    continue;
                };
                let d = e.path();
                kept.push(Kept {
                    owner: std::fs::read_to_string(d.join(EFI_OWNER))
                        .ok()
                        .and_then(|o| efivars::Owner::parse(&o)),
                    active: d.join(EFI_ACTIVE).exists(),
                    id,
                });
            }
            kept.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(kept)
        })
        .await
    }

    async fn remove_kept_efi_vars(&self, id: &str) -> Result<(), StorageError> {
        self.remove_dir(&self.host.efi_vars_dir().join(id)).await
    }

    async fn remove_hugepages(&self, id: &str) -> Result<(), StorageError> {
        for dir in hugepages::host_vm_dirs(id) {
            self.remove_dir(&dir).await?;
        }
        Ok(())
    }

    async fn exists(&self, dir: &Path) -> bool {
        dir.exists()
    }

    async fn revoke_grants(&self, uid: u32) -> Result<(), StorageError> {
        let this = self.clone();
        blocking(move || this.grants().give_back(uid)).await
    }

    async fn create_probe_dirs(&self, owner: Owner) -> Result<(), StorageError> {
        let this = self.clone();
        blocking(move || this.create_probe_dirs_blocking(owner)).await
    }

    async fn list_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = [self.host.vms_state_dir(), self.host.vms_runtime_dir()]
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::key::VmKey;

    /// Storage in a temporary root with one VM's directories made.
    /// A temporary directory whose mounts (VMs' runtime tmpfs) go with it.
    struct Tmp(tempfile::TempDir);

    impl Tmp {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }

        fn path(&self) -> &Path {
            self.0.path()
        }
    }

    impl Drop for Tmp {
        fn drop(&mut self) {
            let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            let mut below: Vec<&str> = (mounts.lines())
                .filter_map(|l| l.split(' ').nth(4))
                .filter(|m| Path::new(m).starts_with(self.0.path()))
                .collect();
            below.sort_by_key(|m| std::cmp::Reverse(m.len()));
            for m in below {
                let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }

    async fn vm_dirs() -> (Tmp, HostStorage, VmPaths) {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let p = s.host.vm(&VmKey::new("ns", "vm").unwrap());
        s.create_dirs(&p, None).await.unwrap();
        (tmp, s, p)
    }

    fn storage(root: &Path) -> HostStorage {
        HostStorage::new(HostLayout {
            state_dir: root.join("lib"),
            runtime_dir: root.join("run"),
            cache_dir: root.join("cache"),
        })
    }

    /// A kill -9 mid-way through making a seed ISO leaves its secrets in
    /// staging; the next start sweeps them, links and all, following none.
    #[test]
    fn kvirts_records_of_its_vms_are_made_root_s_alone() {
        let t = Tmp::new();
        let host = HostLayout {
            state_dir: t.path().join("lib"),
            runtime_dir: t.path().join("run"),
            cache_dir: t.path().join("cache"),
        };
        // As an earlier kvirt left them: readable by anyone, and the
        // identities and manifests' errors beside other files.
        for d in host.root_only_dirs() {
            std::fs::create_dir_all(&d).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let [(old_ids, _), (old_errors, _)] = host.legacy_record_files();
        std::fs::write(&old_ids, r#"{"ns_a": 1}"#).unwrap();
        std::fs::write(&old_errors, "[]").unwrap();
        HostStorage::new(host.clone()).seal_records().unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        for d in host.root_only_dirs() {
            assert_eq!(mode(&d), 0o700, "{}", d.display());
        }
        assert_eq!(
            std::fs::read_to_string(host.identities_file()).unwrap(),
            r#"{"ns_a": 1}"#
        );
        assert!(!old_ids.exists() && !old_errors.exists());
        // A file not made yet stays unmade; a second start changes nothing,
        // and an old file found beside a new one is the stale one.
        assert!(!host.manifest_errors_file().exists());
        std::fs::write(&old_ids, "{}").unwrap();
        HostStorage::new(host.clone()).seal_records().unwrap();
        assert!(host.leases_file().parent().unwrap().is_dir());
        assert!(!old_ids.exists());
        assert_eq!(
            std::fs::read_to_string(host.identities_file()).unwrap(),
            r#"{"ns_a": 1}"#
        );
    }

    #[test]
    fn the_next_start_sweeps_staging() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        assert_eq!(s.sweep_staging().unwrap(), 0, "nothing there yet");
        let staging = tmp.path().join("lib/.staging");
        std::fs::create_dir_all(staging.join("seed-abc123/cidata")).unwrap();
        std::fs::write(staging.join("seed-abc123/cidata/user-data"), "password: x").unwrap();
        let outside = tmp.path().join("keep");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("f"), "kept").unwrap();
        std::os::unix::fs::symlink(&outside, staging.join("link")).unwrap();
        assert_eq!(s.sweep_staging().unwrap(), 2);
        assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
        assert_eq!(std::fs::read_to_string(outside.join("f")).unwrap(), "kept");
    }

    #[tokio::test]
    async fn efi_variables_are_kept_for_their_owner_and_never_through_links() {
        let (tmp, s, p) = vm_dirs().await;
        let prep = |owner: &str| DiskPrep::EfiVars {
            owner: owner.into(),
            nvram: p.nvram(),
            kept_dir: p.efi_vars_dir.clone(),
        };
        let kept = p.efi_vars_dir.join(EFI_VARS);
        // First run: nothing kept yet, libvirt makes the file from its template.
        s.prepare_disk(&prep("vm A"), &[], &Pulled::new(), None)
            .await
            .unwrap();
        assert!(!p.nvram().exists());
        std::fs::create_dir_all(p.nvram().parent().unwrap()).unwrap();
        std::fs::write(p.nvram(), b"vars of run 1").unwrap();
        s.keep_efi_vars(&p).await.unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), b"vars of run 1");
        // Kept once: a second teardown (no run in between) changes nothing.
        std::fs::write(p.nvram(), b"stale").unwrap();
        s.keep_efi_vars(&p).await.unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), b"vars of run 1");

        // Next run of the same VM: they come back, over whatever is there.
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"untouched").unwrap();
        std::fs::remove_file(p.nvram()).unwrap();
        std::os::unix::fs::symlink(&victim, p.nvram()).unwrap();
        s.prepare_disk(&prep("vm A"), &[], &Pulled::new(), None)
            .await
            .unwrap();
        assert_eq!(std::fs::read(p.nvram()).unwrap(), b"vars of run 1");
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");

        // The VM's user makes the file a link: it is refused, not read, and
        // the kept copy stays as it was.
        std::fs::remove_file(p.nvram()).unwrap();
        std::fs::write(tmp.path().join("secret"), b"host secret").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), p.nvram()).unwrap();
        assert!(s.keep_efi_vars(&p).await.is_err());
        assert_eq!(std::fs::read(&kept).unwrap(), b"vars of run 1");

        // Another owner (the VM made anew): the firmware starts afresh.
        std::fs::remove_file(p.nvram()).unwrap();
        s.prepare_disk(&prep("vm B"), &[], &Pulled::new(), None)
            .await
            .unwrap();
        assert!(!kept.exists() && !p.nvram().exists());
    }

    #[tokio::test]
    async fn tpm_state_is_kept_beside_efi_variables_and_dropped_for_another_owner() {
        let (tmp, s, p) = vm_dirs().await;
        let state = p.tpm_state("6a1a24a1-0000-4000-8000-000000000001");
        let prep = |owner: &str| DiskPrep::TpmState {
            owner: owner.into(),
            state: state.clone(),
            kept_dir: p.efi_vars_dir.clone(),
        };
        let efi = |owner: &str| DiskPrep::EfiVars {
            owner: owner.into(),
            nvram: p.nvram(),
            kept_dir: p.efi_vars_dir.clone(),
        };
        let kept = p.efi_vars_dir.join(TPM_STATE);
        let prepare = |d: DiskPrep| {
            let s = &s;
            async move { s.prepare_disk(&d, &[], &Pulled::new(), None).await }
        };
        // First run: swtpm_setup makes the state; it is kept when the VM goes.
        prepare(efi("vm A")).await.unwrap();
        prepare(prep("vm A")).await.unwrap();
        assert!(!state.exists());
        std::fs::create_dir_all(state.parent().unwrap()).unwrap();
        std::fs::write(&state, b"tpm of run 1").unwrap();
        std::fs::create_dir_all(p.nvram().parent().unwrap()).unwrap();
        std::fs::write(p.nvram(), b"vars of run 1").unwrap();
        s.keep_efi_vars(&p).await.unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), b"tpm of run 1");
        assert_eq!(
            std::fs::read(p.efi_vars_dir.join(EFI_VARS)).unwrap(),
            b"vars of run 1"
        );

        // Next run: it comes back, the VM's own, never through a link.
        std::fs::remove_dir_all(p.state_dir.join("config/libvirt/qemu/swtpm")).unwrap();
        prepare(prep("vm A")).await.unwrap();
        assert_eq!(std::fs::read(&state).unwrap(), b"tpm of run 1");
        std::fs::remove_file(&state).unwrap();
        std::fs::write(tmp.path().join("secret"), b"host secret").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), &state).unwrap();
        assert!(s.keep_efi_vars(&p).await.is_err());
        assert_eq!(std::fs::read(&kept).unwrap(), b"tpm of run 1");

        // A run keeping only the variables (its TPM no longer persistent)
        // leaves the kept TPM state as it was.
        std::fs::remove_file(&state).unwrap();
        prepare(efi("vm A")).await.unwrap();
        std::fs::write(&state, b"a TPM not kept").unwrap();
        s.keep_efi_vars(&p).await.unwrap();
        assert_eq!(std::fs::read(&kept).unwrap(), b"tpm of run 1");

        // Another owner: neither the variables nor the TPM come back.
        std::fs::remove_file(&state).unwrap();
        prepare(prep("vm B")).await.unwrap();
        assert!(!kept.exists() && !state.exists());
        assert!(!p.efi_vars_dir.join(EFI_VARS).exists());
    }

    #[tokio::test]
    async fn kept_efi_variables_are_listed_with_their_owner_and_removed() {
        let (_tmp, s, p) = vm_dirs().await;
        assert_eq!(s.kept_efi_vars().await.unwrap(), []);
        let owner = "VirtualMachine ns/vm u1";
        let prep = DiskPrep::EfiVars {
            owner: owner.into(),
            nvram: p.nvram(),
            kept_dir: p.efi_vars_dir.clone(),
        };
        s.prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap();
        let listed = |active| {
            vec![Kept {
                id: "ns_vm".into(),
                owner: efivars::Owner::parse(owner),
                active,
            }]
        };
        assert_eq!(s.kept_efi_vars().await.unwrap(), listed(true));
        s.keep_efi_vars(&p).await.unwrap();
        assert_eq!(s.kept_efi_vars().await.unwrap(), listed(false));
        s.remove_kept_efi_vars("ns_vm").await.unwrap();
        assert!(!p.efi_vars_dir.exists());
        assert_eq!(s.kept_efi_vars().await.unwrap(), []);
    }

    #[tokio::test]
    async fn creates_and_removes_a_vms_directories() {
        let (_tmp, s, p) = vm_dirs().await;
        assert!(p.capabilities_dir().is_dir());
        assert!(p.xdg_runtime_dir().is_dir());
        let conf = std::fs::read_to_string(p.qemu_conf()).unwrap();
        assert!(conf.contains("stdio_handler = \"file\""), "{conf}");
        assert!(conf.contains("auto_shutdown_poweroff = \"none\""), "{conf}");
        assert_eq!(s.list_ids().await, vec!["ns_vm".to_string()]);
        s.remove_dir(&p.state_dir).await.unwrap();
        s.remove_dir(&p.state_dir).await.unwrap();
        assert!(!p.state_dir.exists());

        // The runtime directory is a tmpfs of its own: what the VM writes
        // there stops at its size, not at the host's /run; made again
        // (a start cut short) it is not mounted twice; it goes whole.
        assert!(is_mount_point(&p.runtime_dir));
        let big = vec![0u8; RUNTIME_DIR_BYTES as usize + 4096];
        let err = std::fs::write(p.runtime_dir.join("fill"), &big).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        std::fs::remove_file(p.runtime_dir.join("fill")).unwrap();
        s.create_dirs(&p, None).await.unwrap();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let at = p.runtime_dir.to_string_lossy().into_owned();
        assert_eq!(
            mounts
                .lines()
                .filter(|l| l.split(' ').nth(4) == Some(&at))
                .count(),
            1,
            "mounted twice"
        );
        assert!(p.xdg_runtime_dir().is_dir());
        s.remove_dir(&p.runtime_dir).await.unwrap();
        assert!(!p.runtime_dir.exists());
        assert!(!std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&at));
    }

    /// An emptyDisk or overlay that could grow past the host's free space
    /// (less its reserve) is refused with the figures, and nothing is made.
    #[tokio::test]
    async fn writable_disks_never_grow_past_the_hosts_free_space() {
        let (tmp, s, p) = vm_dirs().await;
        let free = {
            let st = nix::sys::statvfs::statvfs(&s.host.state_dir).unwrap();
            st.blocks_available() as u64 * st.fragment_size() as u64
        };
        let tight = s.clone().with_reserve(free.saturating_sub(1 << 20));
        let disk = |size: u64| DiskPrep::CreateQcow2 {
            volume: "e".into(),
            path: p.empty_disk("e"),
            size_bytes: size,
        };
        let err = tight
            .prepare_disk(&disk(64 << 20), &[], &Pulled::new(), None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("storage.free_space_reserve"), "{err}");
        assert!(err.contains(&(64u64 << 20).to_string()), "{err}");
        assert!(!p.empty_disk("e").exists());
        if qemu_img() {
            let small = HostStorage::new(tight.host.clone());
            small
                .prepare_disk(&disk(64 << 20), &[], &Pulled::new(), None)
                .await
                .unwrap();
        }
        // What another VM's disk may still take counts as taken: a 1 GiB
        // emptyDisk made, another VM's 1 GiB one does not fit in 1.5 GiB.
        const GIB: u64 = 1 << 30;
        if qemu_img() && free > 4 * GIB {
            let roomy = s.clone().with_reserve(free - 3 * GIB / 2);
            let big = DiskPrep::CreateQcow2 {
                volume: "big".into(),
                path: p.empty_disk("big"),
                size_bytes: GIB,
            };
            roomy
                .prepare_disk(&big, &[], &Pulled::new(), None)
                .await
                .unwrap();
            let other = s.host.vm(&VmKey::new("ns", "other").unwrap());
            s.create_dirs(&other, None).await.unwrap();
            let second = DiskPrep::CreateQcow2 {
                volume: "e".into(),
                path: other.empty_disk("e"),
                size_bytes: GIB,
            };
            let err = roomy
                .prepare_disk(&second, &[], &Pulled::new(), None)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("may still be taken by the VMs' other disks"),
                "{err}"
            );
            // The first VM gone, its disk's share is free again.
            s.remove_dir(&p.state_dir).await.unwrap();
            roomy
                .prepare_disk(&second, &[], &Pulled::new(), None)
                .await
                .unwrap();
        }
        // One VM's emptyDisks and overlays together: at most vm.max_disk_size
        // (an overlay's size is known only as it is made).
        if qemu_img() {
            let limited = s.clone().with_vm_limit(100 << 20);
            let vm = s.host.vm(&VmKey::new("ns", "limited").unwrap());
            s.create_dirs(&vm, None).await.unwrap();
            let empty = |name: &str| DiskPrep::CreateQcow2 {
                volume: name.into(),
                path: vm.empty_disk(name),
                size_bytes: 64 << 20,
            };
            limited
                .prepare_disk(&empty("one"), &[], &Pulled::new(), None)
                .await
                .unwrap();
            let err = limited
                .prepare_disk(&empty("two"), &[], &Pulled::new(), None)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(
                    "would total 134217728 bytes, more than vm.max_disk_size (104857600 bytes)"
                ),
                "{err}"
            );
            assert!(!vm.empty_disk("two").exists());
        }
        // A DiskOrCreate hostDisk is made only where it fits too.
        let root = tmp.path().join("hostdisks");
        std::fs::create_dir(&root).unwrap();
        let host_disk = DiskPrep::CreateRawIfMissing {
            volume: "h".into(),
            path: root.join("vm/disk.img"),
            size_bytes: 64 << 20,
        };
        let roots = [root.clone()];
        let err = tight
            .prepare_disk(&host_disk, &roots, &Pulled::new(), None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("storage.free_space_reserve"), "{err}");
        assert!(!root.join("vm/disk.img").exists());
        if nix::unistd::geteuid().is_root() {
            let roomy = HostStorage::new(tight.host.clone());
            roomy
                .prepare_disk(&host_disk, &roots, &Pulled::new(), None)
                .await
                .unwrap();
            let made = std::fs::metadata(root.join("vm/disk.img")).unwrap();
            assert_eq!(made.len(), 64 << 20);
            // There already: kept as it is, whatever the space now.
            tight
                .prepare_disk(&host_disk, &roots, &Pulled::new(), None)
                .await
                .unwrap();
        }
    }

    #[tokio::test]
    async fn cloud_init_seeds_are_isos_with_their_label_and_files() {
        if std::process::Command::new("xorrisofs")
            .arg("-version")
            .output()
            .is_err()
        {
            eprintln!("skipped: no xorrisofs (tests/run-all installs it)");
            return;
        }
        let (tmp, s, p) = vm_dirs().await;
        let iso = p.cloud_init_iso("ci");
        // Whatever the VM's user planted there is replaced, never followed.
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"untouched").unwrap();
        std::os::unix::fs::symlink(&victim, &iso).unwrap();
        let mut seed = Seed::new("cidata");
        seed.files = vec![
            ("meta-data".into(), b"instance-id: vm.ns\n".to_vec()),
            ("user-data".into(), b"#!/bin/sh\necho KVIRT-SEED\n".to_vec()),
        ];
        let prep = DiskPrep::SeedIso {
            volume: "ci".into(),
            path: iso.clone(),
            seed,
        };
        s.prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        let bytes = std::fs::read(&iso).unwrap();
        // ISO 9660: the primary volume descriptor at sector 16 names it.
        assert_eq!(&bytes[32769..32774], b"CD001");
        assert_eq!(&bytes[32808..32814], b"cidata");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("echo KVIRT-SEED"));
        assert!(text.contains("user-data"), "Rock Ridge/Joliet long names");
        // Again (a restart): replaced in place, no staging left behind.
        s.prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap();
        let staging = s.host.state_dir.join(".staging");
        assert_eq!(std::fs::read_dir(staging).unwrap().count(), 0);
    }

    /// A finished VM's runtime directory (its tmpfs) becomes the last
    /// 64 KiB of its console, root's; what the VM planted there is neither
    /// followed nor waited on; the next instance gets a directory of its own.
    #[tokio::test]
    async fn a_finished_vm_leaves_only_its_consoles_tail() {
        use std::os::unix::fs::MetadataExt;
        let (tmp, s, p) = vm_dirs().await;
        let rt = &p.runtime_dir;
        std::fs::write(rt.join("console.log.1"), vec![b'a'; 100 << 10]).unwrap();
        let mut newest = vec![b'b'; 10 << 10];
        newest.extend(b"END");
        std::fs::write(rt.join("console.log"), &newest).unwrap();
        std::fs::write(rt.join("qga.sock"), b"x").unwrap();
        s.keep_console_log(&p).await.unwrap();
        let kept = std::fs::read(rt.join("console.log")).unwrap();
        assert_eq!(kept.len() as u64, KEPT_CONSOLE);
        assert!(kept.ends_with(&newest) && kept.starts_with(b"aaaa"));
        let names: Vec<_> = std::fs::read_dir(rt)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["console.log"]);
        assert!(!is_mount_point(rt));
        let meta = std::fs::metadata(rt).unwrap();
        assert_eq!(
            (meta.uid(), meta.mode() & 0o777),
            (nix::unistd::geteuid().as_raw(), 0o700)
        );
        assert_eq!(s.runtime_dir(rt).await, RuntimeDir::Kept);

        // Planted: a link to a secret, a FIFO with no writer.
        let other = s.host.vm(&VmKey::new("ns", "planted").unwrap());
        s.create_dirs(&other, None).await.unwrap();
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, b"s3cret").unwrap();
        std::os::unix::fs::symlink(&secret, other.runtime_dir.join("console.log")).unwrap();
        nix::unistd::mkfifo(
            &other.runtime_dir.join("console.log.1"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (s2, o2) = (s.clone(), other.clone());
        std::thread::spawn(move || {
            tx.send(s2.keep_console_log_blocking(&o2.runtime_dir))
                .unwrap()
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("keeping the log blocked")
            .unwrap();
        assert_eq!(
            std::fs::read(other.runtime_dir.join("console.log")).unwrap(),
            b""
        );
        assert_eq!(std::fs::read(&secret).unwrap(), b"s3cret");

        // The next instance of the name: a directory of its own again.
        s.create_dirs(&p, None).await.unwrap();
        assert!(!rt.join("console.log").exists());
        if nix::unistd::geteuid().is_root() {
            assert_eq!(
                s.runtime_dir(rt).await,
                RuntimeDir::Live,
                "a tmpfs of its own again"
            );
        }
        s.remove_dir(rt).await.unwrap();
        assert!(!rt.exists());
    }

    #[tokio::test]
    async fn a_renewed_token_is_written_into_the_iso_qemu_holds_and_nowhere_else() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        if std::process::Command::new("xorrisofs")
            .arg("-version")
            .output()
            .is_err()
        {
            eprintln!("skipped: no xorrisofs (tests/run-all installs it)");
            return;
        }
        let (tmp, s, p) = vm_dirs().await;
        let iso = p.cloud_init_iso("sa");
        let seed = |token: &str| {
            let mut seed = Seed::new("cfgdata");
            seed.files = vec![("token".into(), token.as_bytes().to_vec())];
            seed
        };
        let prep = DiskPrep::SeedIso {
            volume: "sa".into(),
            path: iso.clone(),
            seed: seed("old-token-AAAA"),
        };
        s.prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap();
        // QEMU's open file: the same inode must carry the new token.
        let held = std::fs::File::open(&iso).unwrap();
        let (ino, len) = (
            held.metadata().unwrap().ino(),
            held.metadata().unwrap().len(),
        );
        s.rewrite_seed_iso(&iso, &seed("new-token-BBBB"), None)
            .await
            .unwrap();
        let after = std::fs::read(format!("/proc/self/fd/{}", held.as_raw_fd())).unwrap();
        let text = String::from_utf8_lossy(&after);
        assert!(text.contains("new-token-BBBB") && !text.contains("old-token-AAAA"));
        assert_eq!(
            (std::fs::metadata(&iso).unwrap().ino(), after.len() as u64),
            (ino, len)
        );

        // What the VM's user puts in its place is never written through.
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"untouched").unwrap();
        std::fs::remove_file(&iso).unwrap();
        std::os::unix::fs::symlink(&victim, &iso).unwrap();
        assert!(s.rewrite_seed_iso(&iso, &seed("t"), None).await.is_err());
        std::fs::remove_file(&iso).unwrap();
        nix::unistd::mkfifo(&iso, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // A FIFO with no reader: refused at once, never waited on.
        assert!(s.rewrite_seed_iso(&iso, &seed("t"), None).await.is_err());
        std::fs::remove_file(&iso).unwrap();
        std::fs::hard_link(&victim, &iso).unwrap();
        assert!(s.rewrite_seed_iso(&iso, &seed("t"), None).await.is_err());
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        // Truncated by the VM: the new image does not fit, and says so.
        std::fs::remove_file(&iso).unwrap();
        std::fs::write(&iso, b"").unwrap();
        let e = s
            .rewrite_seed_iso(&iso, &seed("t"), None)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("larger than the disk"), "{e}");
        let staging = s.host.state_dir.join(".staging");
        assert_eq!(std::fs::read_dir(staging).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn claim_disks_are_made_sparse_grown_never_shrunk_and_never_a_planted_file() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let root = tmp.path().join("claims");
        let (vol, outside) = (root.join("pv-1"), tmp.path().join("outside"));
        std::fs::create_dir_all(&vol).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let prep = |dir: &Path, size: Option<u64>| DiskPrep::Claim {
            volume: "v".into(),
            root: root.clone(),
            path: dir.join("disk.img"),
            size_bytes: size,
        };
        let prepare = |p: DiskPrep| {
            let s = &s;
            async move { s.prepare_disk(&p, &[], &Pulled::new(), None).await }
        };
        // Missing: made sparse, of the size asked.
        prepare(prep(&vol, Some(4 << 20))).await.unwrap();
        let img = vol.join("disk.img");
        let meta = std::fs::metadata(&img).unwrap();
        assert_eq!(meta.len(), 4 << 20);
        assert_eq!(std::os::unix::fs::MetadataExt::blocks(&meta), 0, "sparse");
        // The claim grew: grown offline, its contents kept.
        std::fs::write(&img, b"guest data").unwrap();
        prepare(prep(&vol, Some(8 << 20))).await.unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
        assert!(std::fs::read(&img).unwrap().starts_with(b"guest data"));
        // Smaller than the file: never shrunk.
        prepare(prep(&vol, Some(1 << 20))).await.unwrap();
        assert_eq!(std::fs::metadata(&img).unwrap().len(), 8 << 20);
        // Read-only: must exist, never made.
        let ro = root.join("pv-ro");
        std::fs::create_dir_all(&ro).unwrap();
        assert!(prepare(prep(&ro, None)).await.is_err());
        assert!(!ro.join("disk.img").exists());
        // A link, a FIFO, a link to a directory outside: refused, nothing made.
        let linked = root.join("pv-link");
        std::fs::create_dir_all(&linked).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", linked.join("disk.img")).unwrap();
        let fifo = root.join("pv-fifo");
        std::fs::create_dir_all(&fifo).unwrap();
        nix::unistd::mkfifo(&fifo.join("disk.img"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("pv-out")).unwrap();
        let device = root.join("pv-dev");
        std::fs::create_dir_all(&device).unwrap();
        let null = std::os::unix::fs::MetadataExt::rdev(&std::fs::metadata("/dev/null").unwrap());
        nix::sys::stat::mknod(
            &device.join("disk.img"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
            null,
        )
        .unwrap();
        for (dir, size) in [
            (&linked, Some(1 << 20)),
            (&linked, None),
            (&fifo, Some(1 << 20)),
            (&device, Some(1 << 20)),
            (&device, None),
            (&root.join("pv-out"), Some(1 << 20)),
        ] {
            let e = prepare(prep(dir, size)).await.unwrap_err();
            assert!(
                e.to_string().contains("without following links")
                    || e.to_string().contains("not a regular file"),
                "{}: {e}",
                dir.display()
            );
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(std::fs::symlink_metadata(linked.join("disk.img"))
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[tokio::test]
    async fn a_claim_with_less_room_gets_a_smaller_disk_within_the_toleration_and_says_so() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let root = tmp.path().join("claims");
        let vol = root.join("small");
        std::fs::create_dir_all(&vol).unwrap();
        // A 10 MiB volume: 10 MiB asked is 1 MiB (10 %) more than it has
        // above KubeVirt's reserve; 12 MiB is more than the toleration.
        nix::mount::mount(
            Some("tmpfs"),
            &vol,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=10m"),
        )
        .unwrap();
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = nix::mount::umount(self.0);
            }
        }
        let _u = Unmount(&vol);
        let prep = |size: u64| DiskPrep::Claim {
            volume: "v".into(),
            root: root.clone(),
            path: vol.join("disk.img"),
            size_bytes: Some(size),
        };
        let too_big = s
            .prepare_disk(&prep(12 << 20), &[], &Pulled::new(), None)
            .await;
        let e = too_big.unwrap_err().to_string();
        assert!(
            e.contains("10 % toleration") && e.contains(&(12u64 << 20).to_string()),
            "{e}"
        );
        assert!(!vol.join("disk.img").exists(), "nothing made");
        let notice = s
            .prepare_disk(&prep(10 << 20), &[], &Pulled::new(), None)
            .await
            .unwrap()
            .expect("a smaller disk is said");
        let len = std::fs::metadata(vol.join("disk.img")).unwrap().len();
        assert_eq!(len, 9 << 20);
        assert!(notice.contains(&len.to_string()), "{notice}");
    }

    #[tokio::test]
    async fn host_disks_stay_under_their_roots_even_through_symlinks() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let root = tmp.path().join("images");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("secret.img"), b"x").unwrap();
        std::os::unix::fs::symlink(outside.join("secret.img"), root.join("link.img")).unwrap();
        let roots = vec![root.clone()];
        let err = s
            .prepare_disk(
                &DiskPrep::RequireExisting {
                    volume: "v".into(),
                    path: root.join("link.img"),
                },
                &roots,
                &Pulled::new(),
                None,
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("without following links"), "{err}");

        let new = root.join("sub/new.img");
        s.prepare_disk(
            &DiskPrep::CreateRawIfMissing {
                volume: "v".into(),
                path: new.clone(),
                size_bytes: 1 << 20,
            },
            &roots,
            &Pulled::new(),
            None,
        )
        .await
        .unwrap();
        assert_eq!(std::fs::metadata(&new).unwrap().len(), 1 << 20);

        let missing = s
            .prepare_disk(
                &DiskPrep::RequireExisting {
                    volume: "v".into(),
                    path: root.join("none.img"),
                },
                &roots,
                &Pulled::new(),
                None,
            )
            .await
            .unwrap_err();
        assert!(missing.to_string().contains("does not exist"), "{missing}");
    }

    /// A local user who can write below a hostDisk root swaps a directory
    /// of the path for a link (to `/etc`, say), or plants a FIFO: root
    /// creates nothing, lends nothing and blocks on nothing outside.
    #[tokio::test]
    async fn host_disk_paths_through_swapped_links_never_steer_root() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let root = tmp.path().join("images");
        let etc = tmp.path().join("etc");
        std::fs::create_dir_all(root.join("team")).unwrap();
        std::fs::create_dir_all(&etc).unwrap();
        std::fs::write(etc.join("shadow"), b"root's").unwrap();
        std::fs::set_permissions(etc.join("shadow"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        // The directory the VMI names is now a link to "/etc".
        std::fs::remove_dir(root.join("team")).unwrap();
        std::os::unix::fs::symlink(&etc, root.join("team")).unwrap();
        let roots = vec![root.clone()];
        let vm = Some(Owner {
            uid: 300_010,
            gid: 300_010,
        });
        let try_prep = |prep: DiskPrep| {
            let s = &s;
            let roots = &roots;
            async move { s.prepare_disk(&prep, roots, &Pulled::new(), vm).await }
        };
        let create = try_prep(DiskPrep::CreateRawIfMissing {
            volume: "v".into(),
            path: root.join("team/new/disk.img"),
            size_bytes: 1 << 20,
        });
        let err = create.await.unwrap_err();
        assert!(err.to_string().contains("without following links"), "{err}");
        let existing = try_prep(DiskPrep::RequireExisting {
            volume: "v".into(),
            path: root.join("team/shadow"),
        });
        assert!(existing.await.is_err());
        let or_create = try_prep(DiskPrep::CreateRawIfMissing {
            volume: "v".into(),
            path: root.join("team/shadow"),
            size_bytes: 1 << 20,
        });
        assert!(or_create.await.is_err());
        let base = try_prep(DiskPrep::Overlay {
            volume: "v".into(),
            path: tmp.path().join("overlay.qcow2"),
            backing: Backing::HostDisk(root.join("team/shadow")),
        });
        assert!(base.await.is_err());
        let mut names: Vec<_> = std::fs::read_dir(&etc)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        assert_eq!(names, ["shadow"], "root made something through the link");
        let shadow = std::fs::File::open(etc.join("shadow")).unwrap();
        assert!(crate::host::grants::read_acl(&shadow).unwrap().is_minimal());
        assert_eq!(std::fs::read(etc.join("shadow")).unwrap(), b"root's");

        // A FIFO where the disk should be: refused at once, never waited on.
        nix::unistd::mkfifo(&root.join("fifo.img"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        for prep in [
            DiskPrep::RequireExisting {
                volume: "v".into(),
                path: root.join("fifo.img"),
            },
            DiskPrep::CreateRawIfMissing {
                volume: "v".into(),
                path: root.join("fifo.img"),
                size_bytes: 1 << 20,
            },
        ] {
            let r = tokio::time::timeout(std::time::Duration::from_secs(10), try_prep(prep)).await;
            assert!(r.expect("blocked on a FIFO").is_err());
        }
    }

    fn qemu_img() -> bool {
        let ok = std::process::Command::new("qemu-img")
            .arg("--version")
            .output()
            .is_ok();
        if !ok {
            eprintln!("skipped: no qemu-img (tests/run-all installs it)");
        }
        ok
    }

    fn root_pulled(d: &ImageDisk) -> Pulled {
        [("root".to_owned(), d.clone())].into_iter().collect()
    }

    fn backing_of(overlay: &Path) -> (String, String) {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json", "-U"])
            .arg(overlay)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["full-backing-filename"].as_str().unwrap_or("").to_owned(),
            v["backing-filename-format"]
                .as_str()
                .unwrap_or("")
                .to_owned(),
        )
    }

    #[tokio::test]
    async fn overlays_are_fresh_qcow2s_over_their_base() {
        if !qemu_img() {
            return;
        }
        let (tmp, s, p) = vm_dirs().await;
        let base = tmp.path().join("cache/disk.raw");
        std::fs::create_dir_all(base.parent().unwrap()).unwrap();
        std::fs::write(&base, vec![0u8; 1 << 20]).unwrap();
        let overlay = p.overlay("root");
        let prep = DiskPrep::Overlay {
            volume: "root".into(),
            path: overlay.clone(),
            backing: Backing::Image {
                image: "example.org/disk:1".into(),
                pull_policy: crate::core::image::PullPolicy::IfNotPresent,
                pull_secret: None,
                path: None,
            },
        };
        let err = s
            .prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not in the image cache"), "{err}");
        let disk = ImageDisk {
            path: base.clone(),
            format: "raw",
            root: base.parent().unwrap().to_owned(),
            digest: "sha256:0".into(),
        };
        s.prepare_disk(&prep, &[], &root_pulled(&disk), None)
            .await
            .unwrap();
        assert_eq!(
            backing_of(&overlay),
            (base.display().to_string(), "raw".to_owned())
        );
        // What the guest wrote is gone at the next start.
        std::fs::write(&overlay, b"guest data").unwrap();
        s.prepare_disk(&prep, &[], &root_pulled(&disk), None)
            .await
            .unwrap();
        assert_eq!(backing_of(&overlay).1, "raw");
        assert_eq!(std::fs::read(&base).unwrap(), vec![0u8; 1 << 20]);
    }

    #[tokio::test]
    async fn ephemeral_bases_are_checked_before_use() {
        if !qemu_img() {
            return;
        }
        let (tmp, s, p) = vm_dirs().await;
        let root = tmp.path().join("images");
        std::fs::create_dir_all(&root).unwrap();
        let prep = |base: &Path| DiskPrep::Overlay {
            volume: "e".into(),
            path: p.overlay("e"),
            backing: Backing::HostDisk(base.to_owned()),
        };
        let roots = vec![root.clone()];
        let missing = s
            .prepare_disk(&prep(&root.join("none.img")), &roots, &Pulled::new(), None)
            .await
            .unwrap_err();
        assert!(missing.to_string().contains("does not exist"), "{missing}");

        // A qcow2 base that points QEMU at another host file is refused.
        let sneaky = root.join("sneaky.qcow2");
        let out = std::process::Command::new("qemu-img")
            .args([
                "create",
                "-q",
                "-f",
                "qcow2",
                "-F",
                "raw",
                "-b",
                "/etc/shadow",
                "-u",
            ])
            .arg(&sneaky)
            .arg("1M")
            .status()
            .unwrap();
        assert!(out.success());
        let err = s
            .prepare_disk(&prep(&sneaky), &roots, &Pulled::new(), None)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("backing file"), "{err}");

        let good = root.join("base.qcow2");
        qemu_img_create(&good, &[], Some(1 << 20)).unwrap();
        s.prepare_disk(&prep(&good), &roots, &Pulled::new(), None)
            .await
            .unwrap();
        assert_eq!(
            backing_of(&p.overlay("e")),
            (good.display().to_string(), "qcow2".to_owned())
        );
        // qemu-img is told the base's size (it never opens a hostDisk by
        // name as root): the guest sees the base's, raw or qcow2.
        assert_eq!(virtual_size_of(&p.overlay("e")), 1 << 20);
        let raw = root.join("base.raw");
        std::fs::write(&raw, vec![0u8; 3 << 20]).unwrap();
        std::fs::remove_file(p.overlay("e")).unwrap();
        s.prepare_disk(&prep(&raw), &roots, &Pulled::new(), None)
            .await
            .unwrap();
        assert_eq!(virtual_size_of(&p.overlay("e")), 3 << 20);
    }

    fn virtual_size_of(image: &Path) -> u64 {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "--output=json", "-U"])
            .arg(image)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["virtual-size"].as_u64().unwrap()
    }

    #[tokio::test]
    async fn kernel_boot_files_are_private_copies_placed_safely() {
        let (tmp, s, p) = vm_dirs().await;
        let cached = tmp.path().join("cache/vmlinuz");
        std::fs::create_dir_all(cached.parent().unwrap()).unwrap();
        std::fs::write(&cached, b"kernel bytes").unwrap();
        // Whatever the VM's user planted there is replaced, never followed.
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, b"untouched").unwrap();
        std::os::unix::fs::symlink(&victim, p.kernel_file()).unwrap();
        let prep = DiskPrep::KernelBoot {
            image: "example.org/k:1".into(),
            pull_policy: crate::core::image::PullPolicy::IfNotPresent,
            pull_secret: None,
            kernel: Some(crate::core::convert::ImageFile {
                path_in_image: "/disk/vmlinuz".into(),
                dest: p.kernel_file(),
            }),
            initrd: None,
        };
        let err = s
            .prepare_disk(&prep, &[], &Pulled::new(), None)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("not in the image cache"), "{err}");
        let pulled: Pulled = [(
            crate::core::convert::kernelboot::KERNEL.to_owned(),
            ImageDisk {
                path: cached.clone(),
                format: "raw",
                root: cached.parent().unwrap().to_owned(),
                digest: "sha256:0".into(),
            },
        )]
        .into_iter()
        .collect();
        s.prepare_disk(&prep, &[], &pulled, None).await.unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
        assert_eq!(std::fs::read(p.kernel_file()).unwrap(), b"kernel bytes");
        let mode = std::fs::symlink_metadata(p.kernel_file())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o640);
    }

    /// What a VM's user can do to its own directories before root next
    /// acts there: swap a directory for a link out. Nothing root makes,
    /// writes, copies or reads for the VM then lands outside or is read
    /// from outside.
    #[tokio::test]
    async fn planted_directory_links_never_steer_root() {
        if !qemu_img() {
            return;
        }
        let (tmp, s, p) = vm_dirs().await;
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("VARS.fd"), b"root's secret").unwrap();
        std::fs::write(outside.join("qemu.conf"), b"root's").unwrap();
        let swap = |dir: &Path| {
            std::fs::remove_dir_all(dir).unwrap();
            std::os::unix::fs::symlink(&outside, dir).unwrap();
        };
        let listing = || {
            let mut l: Vec<String> = std::fs::read_dir(&outside)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            l.sort();
            l
        };
        let before = listing();

        swap(&p.disk_dir());
        let empty = DiskPrep::CreateQcow2 {
            volume: "e".into(),
            path: p.empty_disk("e"),
            size_bytes: 1 << 20,
        };
        assert!(s
            .prepare_disk(&empty, &[], &Pulled::new(), None)
            .await
            .is_err());
        let base = tmp.path().join("base.qcow2");
        qemu_img_create(&base, &[], Some(1 << 20)).unwrap();
        let overlay = DiskPrep::Overlay {
            volume: "o".into(),
            path: p.overlay("o"),
            backing: Backing::HostDisk(base.clone()),
        };
        assert!(s
            .prepare_disk(&overlay, &[tmp.path().into()], &Pulled::new(), None)
            .await
            .is_err());

        // The libvirt config directory, where qemu.conf and the EFI
        // variables live.
        swap(&p.xdg_config_dir());
        assert!(s.create_dirs(&p, None).await.is_err());
        let nvram_dir = p.nvram().parent().unwrap().to_owned();
        std::fs::remove_file(p.xdg_config_dir()).unwrap();
        std::fs::create_dir_all(nvram_dir.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&outside, &nvram_dir).unwrap();
        std::fs::create_dir_all(&p.efi_vars_dir).unwrap();
        std::fs::write(p.efi_vars_dir.join(EFI_ACTIVE), b"").unwrap();
        let name = p.nvram().file_name().unwrap().to_owned();
        std::fs::write(outside.join(&name), b"root's secret").unwrap();
        assert!(s.keep_efi_vars(&p).await.is_err());
        assert!(
            !p.efi_vars_dir.join(EFI_VARS).exists(),
            "read through a link"
        );
        std::fs::remove_file(outside.join(&name)).unwrap();

        assert_eq!(listing(), before, "root wrote outside the VM's directories");
        assert_eq!(std::fs::read(outside.join("qemu.conf")).unwrap(), b"root's");
    }

    /// Each VM starts from a copy of the probe's capability cache, its own
    /// to write: none reads what another wrote.
    #[tokio::test]
    async fn vms_start_from_their_own_copy_of_the_probes_capabilities() {
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let me = Owner {
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
        };
        s.create_probe_dirs(me).await.unwrap();
        let caps = s.host.probe_capabilities_dir();
        std::fs::create_dir_all(&caps).unwrap();
        std::fs::write(caps.join("0123.xml"), b"<qemuCaps/>").unwrap();
        std::fs::write(caps.join("notes.txt"), b"ignored").unwrap();
        let a = s.host.vm(&VmKey::new("ns", "a").unwrap());
        let b = s.host.vm(&VmKey::new("ns", "b").unwrap());
        s.create_dirs(&a, None).await.unwrap();
        // VM a's libvirt rewrites its copy; b still gets the probe's.
        std::fs::write(a.capabilities_dir().join("0123.xml"), b"<evil/>").unwrap();
        s.create_dirs(&b, None).await.unwrap();
        assert_eq!(
            std::fs::read(b.capabilities_dir().join("0123.xml")).unwrap(),
            b"<qemuCaps/>"
        );
        assert!(!b.capabilities_dir().join("notes.txt").exists());
        assert_eq!(
            std::fs::read(caps.join("0123.xml")).unwrap(),
            b"<qemuCaps/>"
        );
    }

    /// hostDisks are given to each VM's identity by an ACL entry for its
    /// life: the owner and mode stay, a disk shared by two VMs is each's,
    /// and when both have gone the file is exactly as it was.
    #[tokio::test]
    async fn host_disks_are_lent_by_acl_and_given_back_as_they_were() {
        use std::os::unix::fs::MetadataExt;
        let tmp = Tmp::new();
        let s = storage(tmp.path());
        let root = tmp.path().join("images");
        std::fs::create_dir_all(&root).unwrap();
        let disk = root.join("shared.img");
        std::fs::write(&disk, b"disk").unwrap();
        std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o600)).unwrap();
        let before = std::fs::metadata(&disk).unwrap();
        let prep = DiskPrep::RequireExisting {
            volume: "v".into(),
            path: disk.clone(),
        };
        let roots = vec![root.clone()];
        let vm = |uid| Some(Owner { uid, gid: uid });
        for uid in [300_001, 300_002] {
            s.prepare_disk(&prep, &roots, &Pulled::new(), vm(uid))
                .await
                .unwrap();
        }
        let acl_of =
            || crate::host::grants::read_acl(&std::fs::File::open(&disk).unwrap()).unwrap();
        assert_eq!(acl_of().perm_of(300_001), Some(6));
        assert_eq!(acl_of().perm_of(300_002), Some(6));
        let during = std::fs::metadata(&disk).unwrap();
        assert_eq!(
            (during.uid(), during.gid()),
            (before.uid(), before.gid()),
            "owner kept"
        );

        s.revoke_grants(300_001).await.unwrap();
        assert_eq!(acl_of().perm_of(300_001), None);
        assert_eq!(acl_of().perm_of(300_002), Some(6), "the other VM keeps it");
        s.revoke_grants(300_002).await.unwrap();
        s.revoke_grants(300_002).await.unwrap();
        let after = std::fs::metadata(&disk).unwrap();
        assert!(acl_of().is_minimal());
        assert_eq!(after.mode(), before.mode(), "mode as it was");
        assert_eq!((after.uid(), after.gid()), (before.uid(), before.gid()));

        // Replaced by a link while lent: the link is not followed back.
        s.prepare_disk(&prep, &roots, &Pulled::new(), vm(300_003))
            .await
            .unwrap();
        let outside = tmp.path().join("outside.img");
        std::fs::write(&outside, b"root's").unwrap();
        std::fs::remove_file(&disk).unwrap();
        std::os::unix::fs::symlink(&outside, &disk).unwrap();
        s.revoke_grants(300_003).await.unwrap();
        assert!(
            crate::host::grants::read_acl(&std::fs::File::open(&outside).unwrap())
                .unwrap()
                .is_minimal()
        );
    }
}
