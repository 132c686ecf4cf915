//! containerDisk images: pulled from their registry once per repository
//! and manifest digest into a read-only cache that every VM of that image
//! uses as the backing file of its own overlay.
//!
//! The registry is not trusted: declared sizes are checked before a byte is
//! downloaded, actual bytes counted while streaming and unpacking (against
//! [`ImageLimits`]), every layer verified against its digest, and every
//! entry name checked before it becomes a path.
//!
//! Cache layout under `/var/cache/kvirt/images` (root's, 0700):
//! - `repos/<repository key>/<manifest digest>/`: the image's files,
//!   complete (unpacked in `.tmp/` and renamed into place, so a directory
//!   here is never partial). Keyed by registry and repository too, so
//!   naming a digest through another repository never reaches an image
//!   pulled from this one. Directories 0711, files 0600: a VM reads its
//!   disk through an ACL entry of its own identity, nobody else at all;
//! - `blobs/<digest>[.partial]`: layers being downloaded; a `.partial` left
//!   by a restart is resumed with a range request, and checked against its
//!   digest before use;
//! - `refs/<sha256 of the reference>`: the digest a tag resolved to, for
//!   `IfNotPresent`;
//! - `private/<repository key>-<digest>`: images pulled with credentials;
//!   each use asks the registry whether the VM's credentials may;
//! - `sha256/<digest>/`: entries of earlier releases, left alone.

use super::registry::{is_near, RegistryClient, RegistryError, Session};
use crate::core::image::{disk_format, parse_reference, ImageLimits, PullPolicy};
use crate::core::pullsecret::Credentials;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::future::Future;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::io::AsyncWriteExt;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("{image}: not an image reference: {message}")]
    Reference { image: String, message: String },
    #[error("{image}: not in the cache, and imagePullPolicy is Never")]
    NeverPull { image: String },
    /// What the registry answered, told without its body: a VMI's status
    /// never carries what a registry chose to say.
    #[error("{image}: registry: {source}")]
    Registry {
        image: String,
        source: RegistryError,
    },
    /// A push (`kvirtctl push-disk`): the user's own tool and registry.
    #[error("{image}: registry: push: {source}")]
    Push {
        image: String,
        source: oci_client::errors::OciDistributionError,
    },
    #[error("{image}: registry {registry} is on this host or its link (resolves to {address}); kvirt pulls from such a registry only when storage.local_registries lists it")]
    LocalRegistry {
        image: String,
        registry: String,
        address: std::net::IpAddr,
    },
    #[error("{image}: the pull took longer than {seconds} s in all (storage.image_max_pull_seconds); the next try resumes it")]
    PullTimeout { image: String, seconds: u64 },
    #[error("{image}: the registry took longer than {seconds} s to answer, or sent less than {min_kib} KiB a minute")]
    Slow {
        image: String,
        seconds: u64,
        min_kib: u64,
    },
    #[error("{image}: {path}: {op}: {source}")]
    Io {
        image: String,
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{image}: {message}")]
    Content { image: String, message: String },
    #[error("{image}: too big: {message}")]
    TooBig { image: String, message: String },
    #[error("{image}: imagePullSecret {secret:?}: {message}")]
    PullSecret {
        image: String,
        secret: String,
        message: String,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
}

/// An image in the cache: its files under `root`, never written again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedImage {
    pub image: String,
    /// The manifest digest (`sha256:…`).
    pub digest: String,
    pub root: PathBuf,
}

/// The disk file a containerDisk boots from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageDisk {
    pub path: PathBuf,
    pub format: &'static str,
    /// The image's directory in the cache (what the VM's unit may read).
    pub root: PathBuf,
    pub digest: String,
}

impl CachedImage {
    /// The disk in the image: `path` if given, else the first file in
    /// `/disk/` (KubeVirt's rule).
    pub fn disk(&self, path: Option<&str>) -> Result<ImageDisk, ImageError> {
        let content = |message: String| ImageError::Content {
            image: self.image.clone(),
            message,
        };
        let file = match path {
            Some(p) => {
                let rel = relative(Path::new(p))
                    .ok_or_else(|| content(format!("path {p:?} is not a plain path")))?;
                self.root.join(rel)
            }
            None => {
                let dir = self.root.join("disk");
                let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
                    .map_err(|_| content("has no /disk/ directory".into()))?
                    .filter_map(|e| e.ok())
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                    .map(|e| e.path())
                    .collect();
                files.sort();
                files
                    .into_iter()
                    .next()
                    .ok_or_else(|| content("has no file in /disk/".into()))?
            }
        };
        let shown = file.strip_prefix(&self.root).unwrap_or(&file).to_owned();
        match std::fs::symlink_metadata(&file) {
            Ok(m) if m.is_file() => {}
            _ => return Err(content(format!("/{} is not a file", shown.display()))),
        }
        let mut header = [0u8; 104];
        let n = std::fs::File::open(&file)
            .and_then(|mut f| read_up_to(&mut f, &mut header))
            .map_err(|source| ImageError::Io {
                image: self.image.clone(),
                path: file.clone(),
                op: "read",
                source,
            })?;
        let format =
            disk_format(&header[..n]).map_err(|m| content(format!("/{}: {m}", shown.display())))?;
        Ok(ImageDisk {
            path: file,
            format,
            root: self.root.clone(),
            digest: self.digest.clone(),
        })
    }
}

fn read_up_to(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// A tar entry's path made relative and checked: `None` for anything that
/// could leave the directory it is extracted to.
fn relative(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

pub trait Images: Send + Sync + 'static {
    /// The disk of a containerDisk (`path` in the image, or the file in
    /// `/disk/`), pulled into the cache first if the policy says so.
    /// Concurrent calls for one image share one download.
    fn disk(
        &self,
        image: &str,
        policy: PullPolicy,
        path: Option<&str>,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> impl Future<Output = Result<ImageDisk, ImageError>> + Send;
}

/// The files VMs use now (their granted disks): entries holding one are
/// never collected.
pub type InUse = Box<dyn Fn() -> Vec<PathBuf> + Send + Sync>;

/// Images from OCI registries, with the cache on the host.
pub struct OciImages {
    dir: PathBuf,
    registry: RegistryClient,
    insecure: Vec<String>,
    limits: ImageLimits,
    /// The cache is collected down to this size after each pull.
    budget: u64,
    in_use: InUse,
    /// One lock per cache entry and per layer: the second VM waits for the
    /// first one's pull and then finds the image cached, whatever
    /// reference each named it by.
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Registries on this host or its link that may be pulled from.
    local: Vec<String>,
}

/// What [`OciImages::fetch`] brings: the entry another pull made, or the
/// manifest digest, the entry's place, the downloaded layers and the
/// entry's lock.
enum Fetched {
    Cached(CachedImage),
    Layers(
        String,
        PathBuf,
        Vec<PathBuf>,
        tokio::sync::OwnedMutexGuard<()>,
    ),
}

/// A download untouched this long was abandoned (its image no longer
/// wanted, or its registry gone): collected, not resumed.
const ABANDONED: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// An entry used this recently is kept whatever the budget: its VM may be
/// between pulling it and taking its grant.
const RECENT: std::time::Duration = std::time::Duration::from_secs(600);

/// Registries spoken to over plain HTTP: loopback ones (as Docker and
/// containerd do) and those configured as insecure.
pub fn is_plain_http(registry: &str, insecure: &[String]) -> bool {
    let host = match registry.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => registry,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
        || insecure.iter().any(|i| i == registry)
}

/// The client `kvirtctl push-disk` pushes with.
fn push_client(protocol: ClientProtocol) -> Client {
    // reqwest is built without a TLS provider of its own: use ring, as kube does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::new(ClientConfig {
        protocol,
        connect_timeout: Some(std::time::Duration::from_secs(30)),
        read_timeout: Some(std::time::Duration::from_secs(60)),
        ..Default::default()
    })
}

impl OciImages {
    /// One per kvirtd: unpacking a crashed predecessor left behind in
    /// `.tmp/` is dropped (its `.partial` downloads are kept and resumed).
    pub fn new(dir: PathBuf, insecure: Vec<String>) -> Self {
        let _ = std::fs::remove_dir_all(dir.join(".tmp"));
        // Earlier releases made it world-readable.
        if dir.is_dir() {
            let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
        }
        Self {
            dir,
            registry: RegistryClient::new(Vec::new()),
            insecure,
            limits: ImageLimits::default(),
            budget: u64::MAX,
            in_use: Box::new(Vec::new),
            locks: Mutex::default(),
            local: Vec::new(),
        }
    }

    /// Registries on this host or its link that may be pulled from
    /// (`storage.local_registries`; see [`local_address`]).
    pub fn with_local_registries(mut self, local: Vec<String>) -> Self {
        self.registry = RegistryClient::new(local.clone());
        self.local = local;
        self
    }

    /// Refuses a registry on this host or its link that is not listed.
    async fn may_reach(&self, image: &str, r: &Reference) -> Result<(), ImageError> {
        let registry = r.resolve_registry();
        match local_address(registry, &self.local).await {
            None => Ok(()),
            Some(address) => Err(ImageError::LocalRegistry {
                image: image.to_owned(),
                registry: registry.to_owned(),
                address,
            }),
        }
    }

    pub fn with_limits(mut self, limits: ImageLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Collected down to `budget` bytes after each pull, least recently
    /// used first, never an entry holding one of `in_use`'s files.
    pub fn with_budget(mut self, budget: u64, in_use: InUse) -> Self {
        self.budget = budget;
        self.in_use = in_use;
        self
    }

    fn lock_for(&self, key: String) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(key).or_default().clone()
    }

    /// Where an image of this repository with this digest lives.
    fn entry_root(&self, r: &Reference, digest: &str) -> Option<PathBuf> {
        Some(
            self.dir
                .join("repos")
                .join(repo_key(r))
                .join(hex_of(digest)?),
        )
    }

    fn entry(&self, image: &str, r: &Reference, digest: &str) -> Option<CachedImage> {
        let root = self.entry_root(r, digest)?;
        root.is_dir().then(|| CachedImage {
            image: image.to_owned(),
            digest: digest.to_owned(),
            root,
        })
    }

    fn ref_file(&self, image: &str) -> PathBuf {
        let h = Sha256::digest(image.as_bytes());
        let name: String = h.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join("refs").join(name)
    }

    /// What the cache holds for `image` without asking the registry.
    fn cached(&self, image: &str, r: &Reference) -> Option<CachedImage> {
        let digest = match r.digest() {
            Some(d) => d.to_owned(),
            None => std::fs::read_to_string(self.ref_file(image)).ok()?,
        };
        self.entry(image, r, digest.trim())
    }

    fn remember(&self, image: &str, digest: &str) -> Result<(), ImageError> {
        let f = self.ref_file(image);
        let dir = f.parent().expect("refs/ has a parent");
        self.private_dir(dir)
            .map_err(io_err(image, dir, "create directory"))?;
        let tmp = f.with_extension("tmp");
        std::fs::write(&tmp, digest)
            .and_then(|_| std::fs::rename(&tmp, &f))
            .map_err(io_err(image, &f, "write"))
    }

    /// Fetches the image's layers (within `max_pull_seconds` in all) and
    /// unpacks them into the cache.
    async fn pull(
        &self,
        image: &str,
        r: &Reference,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<CachedImage, ImageError> {
        let seconds = self.limits.max_pull_seconds;
        let fetched = tokio::time::timeout(
            std::time::Duration::from_secs(seconds),
            self.fetch(image, r, auth, progress),
        )
        .await
        .map_err(|_| ImageError::PullTimeout {
            image: image.to_owned(),
            seconds,
        })??;
        let (digest, root, blobs, _one_pull) = match fetched {
            Fetched::Cached(c) => return Ok(c),
            Fetched::Layers(digest, root, blobs, guard) => (digest, root, blobs, guard),
        };
        let (dir, img, limits) = (self.dir.clone(), image.to_owned(), self.limits);
        let layers = blobs.clone();
        let into = root.clone();
        let unpacked =
            tokio::task::spawn_blocking(move || unpack(&dir, &img, &into, &layers, &limits))
                .await
                .map_err(|_| ImageError::Content {
                    image: image.to_owned(),
                    message: "unpacking: worker thread died".into(),
                })
                .and_then(|r| r);
        // Unpacked or not, the layers are of no more use.
        remove_all(&blobs);
        unpacked?;
        self.remember(image, &digest)?;
        touch(&root);
        Ok(CachedImage {
            image: image.to_owned(),
            digest,
            root,
        })
    }

    /// The image's manifest and layers, downloaded into `blobs/` (what a
    /// pull cut short leaves there is resumed), with the entry's lock
    /// held; or the entry, if another pull made it meanwhile.
    async fn fetch(
        &self,
        image: &str,
        r: &Reference,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<Fetched, ImageError> {
        let session = self.session(image, r, auth).await?;
        let (manifest, digest) = within(image, session.manifest(r))
            .await?
            .map_err(registry(image))?;
        let content = |message: String| ImageError::Content {
            image: image.to_owned(),
            message,
        };
        let root = self
            .entry_root(r, &digest)
            .ok_or_else(|| content(format!("manifest digest {digest:?}")))?;
        if auth.is_some() {
            // Marked before the first byte lands in the cache, so a crash
            // can never leave a private image looking public.
            let m = self.private_marker(r, &digest).expect("digest checked");
            let dir = m.parent().expect("private/ has a parent");
            self.private_dir(dir)
                .map_err(io_err(image, dir, "create directory"))?;
            std::fs::write(&m, b"").map_err(io_err(image, &m, "write"))?;
        }
        let lock = self.lock_for(format!("entry {}", root.display()));
        let one_pull = lock.lock_owned().await;
        if let Some(c) = self.entry(image, r, &digest) {
            self.remember(image, &digest)?;
            touch(&c.root);
            return Ok(Fetched::Cached(c));
        }
        let declared: Vec<(&str, i64)> = manifest
            .layers
            .iter()
            .map(|l| (l.digest.as_str(), l.size))
            .collect();
        let total =
            self.limits
                .check_declared(&declared)
                .map_err(|message| ImageError::TooBig {
                    image: image.to_owned(),
                    message,
                })?;
        // Room for it first: what is being downloaded counts too.
        self.collect_for(total);
        let mut done = 0;
        let mut blobs = Vec::new();
        for layer in &manifest.layers {
            let blob = self
                .blob(&session, image, r, layer, |n| {
                    progress(Progress {
                        done: done + n,
                        total,
                    })
                })
                .await;
            match blob {
                Ok(b) => blobs.push(b),
                Err(e) => {
                    remove_all(&blobs);
                    return Err(e);
                }
            }
            done += layer.size.max(0) as u64;
        }
        Ok(Fetched::Layers(digest, root, blobs, one_pull))
    }

    /// Downloads one layer into `blobs/`, resuming a partial download.
    async fn blob(
        &self,
        session: &Session,
        image: &str,
        r: &Reference,
        layer: &OciDescriptor,
        progress: impl Fn(u64),
    ) -> Result<PathBuf, ImageError> {
        let content = |message: String| ImageError::Content {
            image: image.to_owned(),
            message,
        };
        let hex = hex_of(&layer.digest)
            .ok_or_else(|| content(format!("layer digest {:?}", layer.digest)))?;
        // Per registry and repository: a slow registry holds up only its
        // own pulls of a layer, not another registry's of the same digest
        // (what lands in `blobs/<digest>` is checked against the digest).
        let source = repo_key(r);
        let lock = self.lock_for(format!("blob {source} {hex}"));
        let _one_download = lock.lock().await;
        let dir = self.dir.join("blobs");
        self.private_dir(&dir)
            .map_err(io_err(image, &dir, "create directory"))?;
        let done = dir.join(&hex);
        if done.is_file() {
            return Ok(done);
        }
        let partial = dir.join(format!("{source}-{hex}.partial"));
        let size = layer.size.max(0) as u64;
        let mut have = std::fs::metadata(&partial).map_or(0, |m| m.len());
        if have > size {
            let _ = std::fs::remove_file(&partial);
            have = 0;
        }
        let too_big = || ImageError::TooBig {
            image: image.to_owned(),
            message: format!(
                "layer {} is larger than the {size} bytes it declares",
                layer.digest
            ),
        };
        if have < size {
            let mut blob = within(image, session.blob(layer, have))
                .await?
                .map_err(registry(image))?;
            let (mut at, file) = if blob.from_start {
                // The registry sent it all again: start over.
                (0, tokio::fs::File::create(&partial).await)
            } else {
                let f = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&partial)
                    .await;
                (have, f)
            };
            let mut file = file.map_err(io_err(image, &partial, "open"))?;
            let mut pace = Pace::new();
            while let Some(chunk) = blob.chunk().await.map_err(registry(image))? {
                if !pace.keeps_up(chunk.len()) {
                    return Err(slow(image));
                }
                if at + chunk.len() as u64 > size {
                    drop(file);
                    let _ = std::fs::remove_file(&partial);
                    return Err(too_big());
                }
                file.write_all(&chunk)
                    .await
                    .map_err(io_err(image, &partial, "write"))?;
                at += chunk.len() as u64;
                progress(at);
            }
            file.flush()
                .await
                .map_err(io_err(image, &partial, "write"))?;
        }
        let check = partial.clone();
        let sum = tokio::task::spawn_blocking(move || sha256_file(&check))
            .await
            .map_err(|_| content("hashing: worker thread died".into()))?
            .map_err(io_err(image, &partial, "read"))?;
        if sum != hex {
            let _ = std::fs::remove_file(&partial);
            return Err(content(format!(
                "layer {} arrived with digest sha256:{sum}",
                layer.digest
            )));
        }
        std::fs::rename(&partial, &done).map_err(io_err(image, &done, "rename"))?;
        Ok(done)
    }
}

impl Images for OciImages {
    async fn disk(
        &self,
        image: &str,
        policy: PullPolicy,
        path: Option<&str>,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<ImageDisk, ImageError> {
        self.ensure(image, policy, auth, progress).await?.disk(path)
    }
}

impl OciImages {
    /// The image in the cache, pulled first if the policy says so.
    pub async fn ensure(
        &self,
        image: &str,
        policy: PullPolicy,
        auth: Option<&Credentials>,
        progress: &(dyn Fn(Progress) + Send + Sync),
    ) -> Result<CachedImage, ImageError> {
        let r = parse_reference(image).map_err(|message| ImageError::Reference {
            image: image.to_owned(),
            message,
        })?;
        if policy != PullPolicy::Always {
            if let Some(c) = self.cached(image, &r) {
                if self.is_private(&r, &c.digest) {
                    // A private image in the cache is not a licence to use
                    // it: the registry must say these credentials may.
                    let session = self.session(image, &r, auth).await?;
                    within(image, session.may_pull(&r))
                        .await?
                        .map_err(registry(image))?;
                }
                touch(&c.root);
                return Ok(c);
            }
        }
        if policy == PullPolicy::Never {
            return Err(ImageError::NeverPull {
                image: image.to_owned(),
            });
        }
        let pulled = self.pull(image, &r, auth, progress).await?;
        self.collect();
        Ok(pulled)
    }

    /// Drops least recently used entries until the cache is within its
    /// budget; never one that holds a file in use or was used in the last
    /// minutes. Each goes by rename first, so a crash never leaves half an
    /// entry where a VM would find it. Returns what went.
    pub fn collect(&self) -> Vec<PathBuf> {
        self.collect_for(0)
    }

    /// [`Self::collect`], with room for `incoming` bytes a pull is about to
    /// download. Downloads and unpacking in progress count against the
    /// budget too, and downloads untouched for [`ABANDONED`] go first.
    fn collect_for(&self, incoming: u64) -> Vec<PathBuf> {
        if self.budget == u64::MAX {
            return Vec::new();
        }
        let blobs = self.dir.join("blobs");
        for f in std::fs::read_dir(&blobs).into_iter().flatten().flatten() {
            let idle = f
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok());
            if idle.is_some_and(|idle| idle > ABANDONED) {
                let _ = std::fs::remove_file(f.path());
            }
        }
        let in_flight = tree_size(&blobs) + tree_size(&self.dir.join(".tmp"));
        let in_use = (self.in_use)();
        let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
        for repo in read_dirs(&self.dir.join("repos")) {
            for root in read_dirs(&repo) {
                let used = std::fs::metadata(&root)
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                entries.push((used, tree_size(&root), root));
            }
        }
        let mut total: u64 = entries
            .iter()
            .map(|e| e.1)
            .fold(in_flight.saturating_add(incoming), u64::saturating_add);
        entries.sort();
        let mut gone = Vec::new();
        for (used, size, root) in entries {
            if total <= self.budget {
                break;
            }
            let recent = used.elapsed().map_or(true, |age| age < RECENT);
            if recent || in_use.iter().any(|p| p.starts_with(&root)) {
                continue;
            }
            let trash =
                self.dir
                    .join(".tmp")
                    .join(format!("gc-{}-{}", std::process::id(), gone.len()));
            if self.private_dir(&self.dir.join(".tmp")).is_err()
                || std::fs::rename(&root, &trash).is_err()
            {
                continue;
            }
            let _ = std::fs::remove_dir_all(&trash);
            total = total.saturating_sub(size);
            gone.push(root);
        }
        gone
    }

    /// A pull's own conversation with the image's registry (refused first
    /// if the registry is on this host or its link and not listed).
    async fn session(
        &self,
        image: &str,
        r: &Reference,
        auth: Option<&Credentials>,
    ) -> Result<Session, ImageError> {
        self.may_reach(image, r).await?;
        let scheme = if is_plain_http(r.resolve_registry(), &self.insecure) {
            "http"
        } else {
            "https"
        };
        within(image, self.registry.session(scheme, r, auth))
            .await?
            .map_err(registry(image))
    }

    /// Images pulled with credentials are marked, by repository and digest.
    fn private_marker(&self, r: &Reference, digest: &str) -> Option<PathBuf> {
        let name = format!("{}-{}", repo_key(r), hex_of(digest)?);
        Some(self.dir.join("private").join(name))
    }

    fn is_private(&self, r: &Reference, digest: &str) -> bool {
        self.private_marker(r, digest).is_some_and(|m| m.exists())
    }

    /// A directory of the cache's own (root's, 0700), and the cache's top.
    fn private_dir(&self, dir: &Path) -> std::io::Result<()> {
        for d in [&self.dir, dir] {
            std::fs::create_dir_all(d)?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?;
        }
        Ok(())
    }
}

/// How long one request to a registry (a token, a manifest, the start of
/// a layer) may take in all.
const REQUEST_SECONDS: u64 = 120;
/// A layer download must bring at least this much a minute: a registry
/// that sends a byte now and then cannot hold a pull (and its lock) for
/// ever; per-read timeouts alone would let it.
const MIN_KIB_PER_MINUTE: u64 = 64;

fn slow(image: &str) -> ImageError {
    ImageError::Slow {
        image: image.to_owned(),
        seconds: REQUEST_SECONDS,
        min_kib: MIN_KIB_PER_MINUTE,
    }
}

/// `request`, bounded by [`REQUEST_SECONDS`].
async fn within<T>(image: &str, request: impl Future<Output = T>) -> Result<T, ImageError> {
    tokio::time::timeout(std::time::Duration::from_secs(REQUEST_SECONDS), request)
        .await
        .map_err(|_| slow(image))
}

/// A download's pace, by the minute.
struct Pace {
    since: tokio::time::Instant,
    bytes: u64,
}

impl Pace {
    fn new() -> Self {
        Self {
            since: tokio::time::Instant::now(),
            bytes: 0,
        }
    }

    /// Counts `n` bytes; false once a whole minute brought too few.
    fn keeps_up(&mut self, n: usize) -> bool {
        self.bytes += n as u64;
        if self.since.elapsed() < std::time::Duration::from_secs(60) {
            return true;
        }
        let ok = self.bytes >= MIN_KIB_PER_MINUTE << 10;
        *self = Self::new();
        ok
    }
}

fn registry(image: &str) -> impl FnOnce(RegistryError) -> ImageError + '_ {
    move |source| ImageError::Registry {
        image: image.to_owned(),
        source,
    }
}

/// Whether the registry `registry` (`host[:port]`) may be pulled from:
/// one on this host (loopback, `localhost`), on its link (link-local, as a
/// cloud's metadata service at 169.254.169.254 is) or unspecified only when
/// `local` lists it (as `host:port`, or `host` for any port), so a tenant
/// cannot have root reach the host's own services. This check is for the
/// error's sake: the pull's own requests resolve names without such
/// addresses too (see [`super::registry`]), so DNS answering differently
/// later (rebinding) gains nothing.
pub async fn local_address(registry: &str, local: &[String]) -> Option<std::net::IpAddr> {
    let (host, port) = match registry.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(':') && p.bytes().all(|b| b.is_ascii_digit()) => (h, p),
        _ => (registry, ""),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if local.iter().any(|l| l == registry || l == host) {
        return None;
    }
    if host == "localhost" || host.ends_with(".localhost") {
        return Some(std::net::Ipv4Addr::LOCALHOST.into());
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return is_near(&ip).then_some(ip);
    }
    let port = port.parse().unwrap_or(443);
    let found = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::lookup_host((host, port)),
    )
    .await;
    // A name that does not resolve fails the pull itself, with its own error.
    let addrs = found.ok()?.ok()?;
    addrs.map(|a| a.ip()).find(is_near)
}

/// The cache's name for a registry and repository: a path component
/// whatever the reference held.
fn repo_key(r: &Reference) -> String {
    let h = Sha256::digest(format!("{}/{}", r.resolve_registry(), r.repository()).as_bytes());
    h.iter().take(16).map(|b| format!("{b:02x}")).collect()
}

fn remove_all(files: &[PathBuf]) {
    for f in files {
        let _ = std::fs::remove_file(f);
    }
}

/// Marks an entry used now (its directory's mtime), for collection.
fn touch(root: &Path) {
    if let Ok(d) = std::fs::File::open(root) {
        let _ = d.set_modified(std::time::SystemTime::now());
    }
}

fn read_dirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

/// Bytes of the regular files under `root` (links are not followed).
fn tree_size(root: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![root.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) if m.is_file() => total += m.len(),
                _ => {}
            }
        }
    }
    total
}

fn io_err(image: &str, path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> ImageError {
    let (image, path) = (image.to_owned(), path.to_owned());
    move |source| ImageError::Io {
        image,
        path,
        op,
        source,
    }
}

/// `sha256:<64 hex>` → the hex; anything else (which could steer a path) → None.
fn hex_of(digest: &str) -> Option<String> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
    .then(|| hex.to_owned())
}

/// A directory inside an image: the VM that uses the image may pass
/// through, nobody may list it.
fn mkdir(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf)? {
            0 => break,
            n => h.update(&buf[..n]),
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// What is left of an image's [`ImageLimits`] while it unpacks.
struct Budget {
    /// Bytes out of decompression (a bomb stops here).
    stream: std::cell::Cell<u64>,
    /// Bytes written to files (sparse entries expand here).
    files: u64,
    entries: u64,
    /// Which limit was hit, once one was.
    over: std::cell::Cell<Option<&'static str>>,
    limits: ImageLimits,
}

impl Budget {
    fn new(limits: &ImageLimits) -> Self {
        Self {
            stream: std::cell::Cell::new(limits.max_unpacked_bytes),
            files: limits.max_unpacked_bytes,
            entries: limits.max_entries,
            over: std::cell::Cell::new(None),
            limits: *limits,
        }
    }

    fn exceeded(&self, what: &'static str) -> std::io::Error {
        self.over.set(Some(what));
        std::io::Error::other(format!("over the limit of {what}"))
    }

    fn message(&self) -> Option<String> {
        let what = self.over.get()?;
        Some(match what {
            "entries" => format!(
                "it unpacks to more than {} files and directories",
                self.limits.max_entries
            ),
            _ => format!(
                "it unpacks to more than {} bytes",
                self.limits.max_unpacked_bytes
            ),
        })
    }
}

/// A reader that fails once it has given more than the budget allows.
struct Counted<'a, R> {
    inner: R,
    budget: &'a Budget,
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        let left = self.budget.stream.get();
        if n as u64 > left {
            return Err(self.budget.exceeded("bytes"));
        }
        self.budget.stream.set(left - n as u64);
        Ok(n)
    }
}

/// Applies the layers in order into a fresh directory under `.tmp/` and
/// renames the result to `root`. Only directories and regular files are
/// made: links, devices and paths leaving the tree are skipped, whiteouts
/// may name only what is in the tree. Past a limit, nothing stays.
fn unpack(
    dir: &Path,
    image: &str,
    root: &Path,
    layers: &[PathBuf],
    limits: &ImageLimits,
) -> Result<(), ImageError> {
    let io = |path: &Path, op| io_err(image, path, op);
    let tmp_parent = dir.join(".tmp");
    std::fs::create_dir_all(&tmp_parent).map_err(io(&tmp_parent, "create directory"))?;
    let tmp = nix::unistd::mkdtemp(&tmp_parent.join("unpack-XXXXXX"))
        .map_err(|e| io(&tmp_parent, "create directory")(e.into()))?;
    let mut budget = Budget::new(limits);
    let result = (|| {
        mkdir(&tmp).map_err(io(&tmp, "create directory"))?;
        for layer in layers {
            let f = std::fs::File::open(layer).map_err(io(layer, "open"))?;
            if let Err(e) = unpack_layer(f, &tmp, &mut budget) {
                return Err(match budget.message() {
                    Some(message) => ImageError::TooBig {
                        image: image.to_owned(),
                        message,
                    },
                    None => io(layer, "unpack")(e),
                });
            }
        }
        let parent = root.parent().expect("an entry has a parent");
        std::fs::create_dir_all(parent).map_err(io(parent, "create directory"))?;
        std::fs::rename(&tmp, root).map_err(io(root, "rename"))
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    result
}

fn unpack_layer(mut f: std::fs::File, into: &Path, budget: &mut Budget) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    use std::os::unix::fs::OpenOptionsExt;
    let mut magic = [0u8; 4];
    let n = read_up_to(&mut f, &mut magic)?;
    f.seek(SeekFrom::Start(0))?;
    let reader: Box<dyn Read> = match &magic[..n] {
        [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(f)),
        [0x28, 0xb5, 0x2f, 0xfd] => {
            return Err(std::io::Error::other(
                "zstd layers are not supported (use gzip or plain tar)",
            ))
        }
        _ => Box::new(f),
    };
    let shared: &Budget = budget;
    let mut archive = tar::Archive::new(Counted {
        inner: reader,
        budget: shared,
    });
    let mut entries_left = shared.entries;
    let mut files_left = shared.files;
    for entry in archive.entries()? {
        let mut entry = entry?;
        entries_left = entries_left
            .checked_sub(1)
            .ok_or_else(|| shared.exceeded("entries"))?;
        let Some(rel) = relative(&entry.path()?) else {
            continue;
        };
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let parent = into.join(rel.parent().unwrap_or(Path::new("")));
        // Whiteouts: a later layer deleting what an earlier one made.
        if name == ".wh..wh..opq" {
            if let Ok(children) = std::fs::read_dir(&parent) {
                for c in children.flatten() {
                    remove_any(&c.path())?;
                }
            }
            continue;
        }
        if let Some(gone) = name.strip_prefix(".wh.") {
            // `.wh..` or `.wh...` would name the directory or its parent.
            if gone.is_empty() || gone == "." || gone == ".." {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("whiteout {:?} names no file", rel.display().to_string()),
                ));
            }
            remove_any(&parent.join(gone))?;
            continue;
        }
        let target = into.join(&rel);
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                if !target.is_dir() {
                    remove_any(&target)?;
                }
                mkdir(&target)?;
            }
            // Sparse entries are files too: their holes come out as zeros.
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                mkdir(&parent)?;
                remove_any(&target)?;
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&target)?;
                let copied = std::io::copy(&mut (&mut entry).take(files_left + 1), &mut out)?;
                files_left = files_left
                    .checked_sub(copied)
                    .ok_or_else(|| shared.exceeded("bytes"))?;
                out.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            }
            _ => {}
        }
    }
    budget.entries = entries_left;
    budget.files = files_left;
    Ok(())
}

/// A file or a directory tree, without following links; gone already is
/// fine.
pub(crate) fn remove_any(p: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(p),
        Ok(_) => std::fs::remove_file(p),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Builds a containerDisk image (one layer with the files under `/disk/`,
/// by their file names) and pushes it: what `kvirtctl push-disk` does.
pub async fn push_disk(
    files: &[PathBuf],
    image: &str,
    insecure: &[String],
    auth: Option<&Credentials>,
) -> Result<String, ImageError> {
    use oci_client::client::{Config, ImageLayer};
    let r = parse_reference(image).map_err(|message| ImageError::Reference {
        image: image.to_owned(),
        message,
    })?;
    let mut entries = Vec::new();
    for f in files {
        let name = f.file_name().ok_or_else(|| ImageError::Content {
            image: image.to_owned(),
            message: format!("{}: not a file name", f.display()),
        })?;
        entries.push((f.clone(), Path::new("disk").join(name)));
    }
    let layer = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        {
            let mut tar = tar::Builder::new(&mut gz);
            let mut dir = tar::Header::new_gnu();
            dir.set_entry_type(tar::EntryType::Directory);
            dir.set_mode(0o555);
            dir.set_size(0);
            // KubeVirt's containerDisks belong to QEMU's user in the image.
            dir.set_uid(107);
            dir.set_gid(107);
            tar.append_data(&mut dir, "disk/", std::io::empty())?;
            for (from, to) in &entries {
                let mut f = std::fs::File::open(from).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("{}: {e}", from.display()))
                })?;
                let mut h = tar::Header::new_gnu();
                h.set_size(f.metadata()?.len());
                h.set_mode(0o440);
                h.set_uid(107);
                h.set_gid(107);
                tar.append_data(&mut h, to, &mut f)?;
            }
            tar.finish()?;
        }
        gz.finish()
    })
    .await
    .map_err(|_| ImageError::Content {
        image: image.to_owned(),
        message: "worker thread died".into(),
    })?
    .map_err(|e| ImageError::Content {
        image: image.to_owned(),
        message: e.to_string(),
    })?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": []},
        "config": {},
    });
    let client = push_client(if is_plain_http(r.resolve_registry(), insecure) {
        ClientProtocol::Http
    } else {
        ClientProtocol::Https
    });
    let layers = [ImageLayer::oci_v1_gzip(layer, None)];
    let config = Config::oci_v1(config.to_string().into_bytes(), None);
    let registry_auth = auth.map_or(RegistryAuth::Anonymous, |c| {
        RegistryAuth::Basic(c.username.clone(), c.password.clone())
    });
    let pushed = client
        .push(&r, &layers, config, &registry_auth, None)
        .await
        .map_err(|source| ImageError::Push {
            image: image.to_owned(),
            source,
        })?;
    Ok(pushed.manifest_url)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tenant names a registry on the host's loopback or its link (a
    /// cloud's metadata service): refused unless the host lists it.
    #[tokio::test]
    async fn registries_on_this_host_or_its_link_are_refused_unless_listed() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        for (registry, at) in [
            ("127.0.0.1:5000", "127.0.0.1"),
            ("169.254.169.254", "169.254.169.254"),
            ("[::1]:5000", "::1"),
            ("[fe80::1]:443", "fe80::1"),
            ("0.0.0.0:80", "0.0.0.0"),
            ("localhost:5000", "127.0.0.1"),
            ("registry.localhost", "127.0.0.1"),
        ] {
            assert_eq!(
                local_address(registry, &[]).await,
                Some(ip(at)),
                "{registry}"
            );
        }
        let listed = ["127.0.0.1:5000".to_owned(), "169.254.1.1".to_owned()];
        assert_eq!(local_address("127.0.0.1:5000", &listed).await, None);
        assert!(local_address("127.0.0.1:5001", &listed).await.is_some());
        assert_eq!(local_address("169.254.1.1:8080", &listed).await, None);
        assert_eq!(local_address("192.0.2.10:5000", &[]).await, None);

        // Refused before anything is sent, with why.
        let tmp = tempfile::tempdir().unwrap();
        let images = OciImages::new(tmp.path().join("cache"), vec![]);
        let err = images
            .ensure(
                "169.254.169.254/latest/meta:1",
                PullPolicy::Always,
                None,
                &|_| {},
            )
            .await
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("storage.local_registries"), "{text}");
    }

    /// A registry that takes every connection and never answers cannot
    /// hold a pull (and the VM's start) past `max_pull_seconds`, though
    /// each request alone would wait longer.
    #[tokio::test]
    async fn a_pull_ends_within_its_time_in_all() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let tmp = tempfile::tempdir().unwrap();
        let images = OciImages::new(tmp.path().join("cache"), vec![])
            .with_local_registries(vec![format!("127.0.0.1:{port}")])
            .with_limits(ImageLimits {
                max_pull_seconds: 1,
                ..ImageLimits::default()
            });
        let image = format!("127.0.0.1:{port}/x/y:1");
        let err = images
            .ensure(&image, PullPolicy::Always, None, &|_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(err, ImageError::PullTimeout { seconds: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("storage.image_max_pull_seconds"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_layer_that_trickles_is_given_up() {
        let mut pace = Pace::new();
        assert!(pace.keeps_up(10));
        tokio::time::advance(std::time::Duration::from_secs(61)).await;
        assert!(!pace.keeps_up(10), "20 bytes in a minute");
        let mut pace = Pace::new();
        tokio::time::advance(std::time::Duration::from_secs(61)).await;
        assert!(pace.keeps_up(1 << 20), "a MiB in a minute");
    }

    #[test]
    fn plain_http_only_for_loopback_and_configured_registries() {
        assert!(is_plain_http("127.0.0.1:5000", &[]));
        assert!(is_plain_http("localhost:5000", &[]));
        assert!(is_plain_http("[::1]:5000", &[]));
        assert!(!is_plain_http("quay.io", &[]));
        assert!(!is_plain_http("10.0.0.1:5000", &[]));
        assert!(is_plain_http("10.0.0.1:5000", &["10.0.0.1:5000".into()]));
    }

    #[test]
    fn digests_never_become_paths_outside_the_cache() {
        let good = format!("sha256:{}", "0123456789abcdef".repeat(4));
        assert_eq!(hex_of(&good).unwrap().len(), 64);
        assert_eq!(hex_of("sha256:../../etc"), None);
        assert_eq!(hex_of(&good.to_uppercase()), None);
        assert_eq!(hex_of(&format!("sha512:{}", "0".repeat(64))), None);
        assert_eq!(
            relative(Path::new("./disk/a.img")),
            Some("disk/a.img".into())
        );
        assert_eq!(
            relative(Path::new("/disk/a.img")),
            Some("disk/a.img".into())
        );
        assert_eq!(relative(Path::new("disk/../../x")), None);
        assert_eq!(relative(Path::new("/")), None);
    }

    fn tar_of(entries: &[(&str, Option<&[u8]>)], gzip: bool) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in entries {
            let mut h = tar::Header::new_gnu();
            match data {
                Some(d) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(d.len() as u64);
                    h.set_mode(0o400);
                    b.append_data(&mut h, path, *d).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o700);
                    b.append_data(&mut h, path, std::io::empty()).unwrap();
                }
            }
        }
        let raw = b.into_inner().unwrap();
        if !gzip {
            return raw;
        }
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        gz.finish().unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// A hostile registry's layer: arbitrary bytes, or a real layer
        /// with bytes changed. It unpacks or fails, never panics, and
        /// nothing appears beside the tree it unpacks into.
        #[test]
        fn any_layer_unpacks_or_fails_inside_its_tree(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..2048),
            edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..6),
            gzip in proptest::prelude::any::<bool>(),
            real in proptest::prelude::any::<bool>(),
        ) {
            let mut layer = if real {
                tar_of(
                    &[("disk", None), ("disk/a.img", Some(b"data")), ("disk/b", Some(b"y"))],
                    gzip,
                )
            } else {
                raw
            };
            for (at, byte) in edits {
                if !layer.is_empty() {
                    let i = at % layer.len();
                    layer[i] = byte;
                }
            }
            let t = tempfile::tempdir().unwrap();
            let file = t.path().join("layer");
            std::fs::write(&file, &layer).unwrap();
            let into = t.path().join("root");
            std::fs::create_dir(&into).unwrap();
            let mut budget = Budget::new(&ImageLimits::default());
            let _ = unpack_layer(std::fs::File::open(&file).unwrap(), &into, &mut budget);
            let mut beside: Vec<_> = std::fs::read_dir(t.path())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            beside.sort();
            proptest::prop_assert_eq!(beside, vec!["layer", "root"]);
        }
    }

    #[test]
    fn layers_unpack_in_order_with_whiteouts_and_nothing_escapes() {
        let t = tempfile::tempdir().unwrap();
        let l1 = t.path().join("l1");
        let l2 = t.path().join("l2");
        std::fs::write(
            &l1,
            tar_of(
                &[
                    ("disk/", None),
                    ("disk/old.img", Some(b"old")),
                    ("etc/", None),
                    ("etc/junk", Some(b"j")),
                ],
                true,
            ),
        )
        .unwrap();
        // A symlink out of the tree, then a file "through" it.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "disk/escape", "/etc").unwrap();
        for (p, d) in [
            ("disk/.wh.old.img", &b""[..]),
            ("etc/.wh..wh..opq", b""),
            ("disk/new.img", b"QFI\xfb"),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(d.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, p, d).unwrap();
        }
        std::fs::write(&l2, b.into_inner().unwrap()).unwrap();

        let cache = t.path().join("cache");
        let hex = "ab".repeat(32);
        let root = cache.join("repos/r").join(&hex);
        unpack(&cache, "img", &root, &[l1, l2], &ImageLimits::default()).unwrap();
        let mut files: Vec<_> = walk(&root);
        files.sort();
        assert_eq!(files, ["disk", "disk/new.img", "etc"]);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&root.join("disk/new.img")), 0o600, "root's alone");
        assert_eq!(mode(&root.join("disk")), 0o711, "passable, not listable");
        assert_eq!(mode(&root), 0o711);
        assert_eq!(std::fs::read_dir(cache.join(".tmp")).unwrap().count(), 0);

        let img = CachedImage {
            image: "img".into(),
            digest: format!("sha256:{hex}"),
            root: root.clone(),
        };
        let err = img.disk(None).unwrap_err().to_string();
        assert!(err.contains("not a qcow2"), "{err}");
        std::fs::write(root.join("disk/new.img"), [0u8; 512]).unwrap();
        assert_eq!(img.disk(None).unwrap().format, "raw");
        assert_eq!(
            img.disk(Some("/disk/new.img")).unwrap().path,
            root.join("disk/new.img")
        );
        assert!(img
            .disk(Some("../x"))
            .unwrap_err()
            .to_string()
            .contains("plain path"));
        assert!(img
            .disk(Some("etc"))
            .unwrap_err()
            .to_string()
            .contains("not a file"));
    }

    fn unpack_one(
        layer: Vec<u8>,
        limits: ImageLimits,
    ) -> (tempfile::TempDir, Result<(), ImageError>) {
        let t = tempfile::tempdir().unwrap();
        let file = t.path().join("layer");
        std::fs::write(&file, layer).unwrap();
        let cache = t.path().join("cache");
        let root = cache.join("repos/r/e");
        let r = unpack(&cache, "img", &root, &[file], &limits);
        (t, r)
    }

    fn left_in(t: &tempfile::TempDir) -> Vec<String> {
        let cache = t.path().join("cache");
        let mut all = walk(&cache);
        all.retain(|p| p != ".tmp" && p != "repos" && p != "repos/r");
        all
    }

    /// A decompression bomb, a tree of too many entries, and sparse
    /// entries that expand: each stops at its limit and leaves nothing.
    #[test]
    fn unpacking_stops_at_the_limits_and_leaves_nothing() {
        let small = ImageLimits {
            max_unpacked_bytes: 1 << 20,
            max_entries: 10,
            ..ImageLimits::default()
        };
        // 16 MiB of zeros: ~16 KiB of gzip.
        let zeros = vec![0u8; 16 << 20];
        let bomb = tar_of(&[("disk/", None), ("disk/bomb.img", Some(&zeros))], true);
        assert!(bomb.len() < 100 << 10, "{}", bomb.len());
        let (t, r) = unpack_one(bomb, small);
        let err = r.unwrap_err();
        assert!(matches!(err, ImageError::TooBig { .. }), "{err}");
        assert!(err.to_string().contains("more than 1048576 bytes"), "{err}");
        assert_eq!(left_in(&t), Vec::<String>::new());

        let names: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
        let many: Vec<(&str, Option<&[u8]>)> = names
            .iter()
            .map(|n| (n.as_str(), Some(&b"x"[..])))
            .collect();
        let (t, r) = unpack_one(tar_of(&many, false), small);
        let err = r.unwrap_err().to_string();
        assert!(err.contains("more than 10 files"), "{err}");
        assert_eq!(left_in(&t), Vec::<String>::new());

        // A GNU sparse entry: a few bytes in the archive, 64 MiB as a file.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::GNUSparse);
        h.set_size(1);
        {
            let gnu = h.as_gnu_mut().unwrap();
            // One byte of data at the end; the rest is a hole.
            let octal = |n: u64| format!("{n:011o}\0").into_bytes();
            gnu.sparse[0].offset.copy_from_slice(&octal((64 << 20) - 1));
            gnu.sparse[0].numbytes.copy_from_slice(&octal(1));
            gnu.realsize.copy_from_slice(&octal(64 << 20));
        }
        h.set_path("sparse.img").unwrap();
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        let (t, r) = unpack_one(b.into_inner().unwrap(), small);
        let err = r.unwrap_err().to_string();
        assert!(err.contains("more than 1048576 bytes"), "{err}");
        assert_eq!(left_in(&t), Vec::<String>::new());
    }

    /// `.wh..` and `.wh...` would delete the directory or its parent.
    #[test]
    fn whiteouts_naming_no_file_are_refused() {
        for bad in ["disk/.wh..", "disk/.wh...", ".wh..."] {
            let layer = tar_of(
                &[("disk/", None), ("disk/a", Some(b"a")), (bad, Some(b""))],
                false,
            );
            let (t, r) = unpack_one(layer, ImageLimits::default());
            let err = r.unwrap_err().to_string();
            assert!(err.contains("names no file"), "{bad}: {err}");
            assert_eq!(left_in(&t), Vec::<String>::new(), "{bad}");
        }
    }

    #[test]
    fn collection_keeps_what_is_in_use_or_recent_and_drops_the_oldest() {
        let t = tempfile::tempdir().unwrap();
        let cache = t.path().join("cache");
        let entry = |repo: &str, name: &str, bytes: usize, age_s: u64| {
            let root = cache.join("repos").join(repo).join(name);
            std::fs::create_dir_all(root.join("disk")).unwrap();
            std::fs::write(root.join("disk/d.img"), vec![1u8; bytes]).unwrap();
            let d = std::fs::File::open(&root).unwrap();
            d.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(age_s))
                .unwrap();
            root
        };
        let oldest = entry("a", "1", 400, 9000);
        let used = entry("a", "2", 400, 8000);
        let older = entry("b", "3", 400, 7000);
        let recent = entry("b", "4", 400, 10);
        let in_use = used.join("disk/d.img");
        let images = OciImages::new(cache.clone(), vec![])
            .with_budget(900, Box::new(move || vec![in_use.clone()]));
        let gone = images.collect();
        // 1600 bytes, budget 900: the oldest two that may go, in age order.
        assert_eq!(gone, [oldest.clone(), older.clone()]);
        assert!(!oldest.exists() && !older.exists());
        assert!(used.exists() && recent.exists());
        assert!(images.collect().is_empty(), "within budget, or kept");

        // Downloads in progress count, and so does a pull about to start:
        // room is made for them. A download abandoned for a day goes.
        let blobs = cache.join("blobs");
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::write(blobs.join("x-1.partial"), vec![0u8; 50]).unwrap();
        let abandoned = blobs.join("y-2.partial");
        std::fs::write(&abandoned, vec![0u8; 5000]).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&abandoned)
            .unwrap()
            .set_modified(std::time::SystemTime::now() - ABANDONED * 2)
            .unwrap();
        let third = entry("c", "5", 40, 6000);
        assert!(images.collect().is_empty(), "800 + 40, and 50 in flight");
        assert!(!abandoned.exists());
        assert_eq!(images.collect_for(20), [third], "20 more to come");
        assert!(blobs.join("x-1.partial").exists(), "in progress: kept");
    }

    fn walk(root: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_owned()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                out.push(p.strip_prefix(root).unwrap().display().to_string());
                if e.file_type().unwrap().is_dir() {
                    stack.push(p);
                }
            }
        }
        out
    }
}
