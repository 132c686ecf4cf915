//! Network namespaces named like `ip netns` does (`/run/netns/NAME`), so
//! `ip netns list` shows each VM's and `NetworkNamespacePath=` can enter it.

use crate::core::key::NETNS_PREFIX;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use std::future::Future;
use std::path::{Path, PathBuf};

pub const NETNS_DIR: &str = "/run/netns";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("netns {name}: {op}: {source}")]
    Sys {
        name: String,
        op: &'static str,
        source: std::io::Error,
    },
    #[error("netns {name}: bringing up lo: {message}")]
    Loopback { name: String, message: String },
    #[error("netns {name}: worker thread died")]
    Thread { name: String },
}

pub trait Netns: Send + Sync + 'static {
    /// Creates the namespace with `lo` up; an existing one is kept as is.
    fn create(&self, name: &str) -> impl Future<Output = Result<(), NetnsError>> + Send;
    /// Removes it; a missing one is not an error.
    fn delete(&self, name: &str) -> impl Future<Output = Result<(), NetnsError>> + Send;
    fn exists(&self, name: &str) -> impl Future<Output = Result<bool, NetnsError>> + Send;
    /// Names of every `kvirt-` namespace.
    fn list(&self) -> impl Future<Output = Result<Vec<String>, NetnsError>> + Send;
}

#[derive(Clone, Debug)]
pub struct KernelNetns {
    dir: PathBuf,
}

impl Default for KernelNetns {
    fn default() -> Self {
        Self {
            dir: NETNS_DIR.into(),
        }
    }
}

fn sys<'a>(name: &'a str, op: &'static str) -> impl FnOnce(nix::Error) -> NetnsError + 'a {
    move |e| NetnsError::Sys {
        name: name.into(),
        op,
        source: e.into(),
    }
}

fn io<'a>(name: &'a str, op: &'static str) -> impl FnOnce(std::io::Error) -> NetnsError + 'a {
    move |source| NetnsError::Sys {
        name: name.into(),
        op,
        source,
    }
}

impl KernelNetns {
    /// Namespaces under another directory than `/run/netns` (tests).
    pub fn at(dir: &Path) -> Self {
        Self { dir: dir.into() }
    }

    /// The namespace lives on as a bind mount of a short-lived thread's
    /// namespace: `unshare` is per thread, and never on an async worker.
    fn create_blocking(path: &Path, name: &str) -> Result<(), NetnsError> {
        if is_mountpoint(path) {
            return Ok(());
        }
        std::fs::File::create(path).map_err(io(name, "create mount point"))?;
        let owned = (path.to_owned(), name.to_owned());
        let result = std::thread::spawn(move || -> Result<(), NetnsError> {
            let (path, name) = owned;
            unshare(CloneFlags::CLONE_NEWNET).map_err(sys(&name, "unshare"))?;
            loopback_up(&name)?;
            mount(
                Some("/proc/thread-self/ns/net"),
                &path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(sys(&name, "bind mount"))
        })
        .join()
        .map_err(|_| NetnsError::Thread { name: name.into() })?;
        if result.is_err() {
            let _ = std::fs::remove_file(path);
        }
        result
    }

    fn delete_blocking(path: &Path, name: &str) -> Result<(), NetnsError> {
        match umount2(path, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
            Err(e) => return Err(sys(name, "unmount")(e)),
        }
        match std::fs::remove_file(path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(name, "remove")(e)),
        }
    }

    fn ensure_dir(&self, name: &str) -> Result<(), NetnsError> {
        std::fs::create_dir_all(&self.dir).map_err(io(name, "create /run/netns"))
    }
}

/// Runs on the thread that is inside the new namespace: the netlink socket
/// belongs to the namespace it is opened in.
fn loopback_up(name: &str) -> Result<(), NetnsError> {
    let err = |message: String| NetnsError::Loopback {
        name: name.into(),
        message,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| err(e.to_string()))?;
    rt.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(|e| err(e.to_string()))?;
        tokio::spawn(conn);
        handle
            .link()
            .set(rtnetlink::LinkUnspec::new_with_name("lo").up().build())
            .execute()
            .await
            .map_err(|e| err(e.to_string()))
    })
}

fn is_mountpoint(path: &Path) -> bool {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let p = path.to_string_lossy();
    mounts
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|mp| mp == p))
}

async fn blocking<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T, NetnsError> + Send + 'static,
) -> Result<T, NetnsError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| NetnsError::Thread { name: name.into() })?
}

impl Netns for KernelNetns {
    async fn create(&self, name: &str) -> Result<(), NetnsError> {
        self.ensure_dir(name)?;
        let path = self.dir.join(name);
        let n = name.to_owned();
        blocking(name, move || Self::create_blocking(&path, &n)).await
    }

    async fn delete(&self, name: &str) -> Result<(), NetnsError> {
        let path = self.dir.join(name);
        let n = name.to_owned();
        blocking(name, move || Self::delete_blocking(&path, &n)).await
    }

    async fn exists(&self, name: &str) -> Result<bool, NetnsError> {
        Ok(self.dir.join(name).exists())
    }

    async fn list(&self) -> Result<Vec<String>, NetnsError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(io("*", "list")(e)),
        };
        Ok(entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(NETNS_PREFIX))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tier 2: needs root; creates a throwaway namespace for real.
    #[tokio::test]
    async fn create_and_delete_a_real_namespace() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ns = KernelNetns::at(dir.path());
        let name = format!("kvirt-test_{}", std::process::id());
        ns.create(&name).await.unwrap();
        assert!(ns.exists(&name).await.unwrap());
        assert!(is_mountpoint(&dir.path().join(&name)));
        ns.create(&name).await.unwrap(); // idempotent
        assert_eq!(ns.list().await.unwrap(), vec![name.clone()]);
        ns.delete(&name).await.unwrap();
        assert!(!ns.exists(&name).await.unwrap());
        ns.delete(&name).await.unwrap(); // idempotent
    }
}
