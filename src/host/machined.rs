//! systemd-machined: each running VM registered as a machine of class `vm`
//! with its unit, so `machinectl list` and `machinectl status` show it.
//!
//! Registration is a courtesy to operators, never a condition for running:
//! a host without machined (no systemd-container package) runs VMs the same.

use crate::core::key;
use crate::host::beneath::Beneath;
use crate::host::bus::Bus;
use std::future::Future;
use std::path::{Path, PathBuf};
use zbus_systemd::machine1::ManagerProxy;

#[derive(Debug, thiserror::Error)]
pub enum MachinedError {
    #[error("machine {name}: D-Bus: {source}")]
    Bus {
        name: String,
        source: Box<zbus::Error>,
    },
    #[error("machine {name}: QEMU's pid file {path}: {message}")]
    Leader {
        name: String,
        path: PathBuf,
        message: String,
    },
}

/// What machined is told about one VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineSpec {
    pub name: String,
    /// The VMI UID as 16 bytes (machined's machine id), or empty.
    pub uuid: Vec<u8>,
    /// The VM's unit: the leader must be in its cgroup.
    pub unit: String,
    /// The VM's runtime directory (its parent is root's)...
    pub runtime_dir: PathBuf,
    /// ...and libvirt's pid file for the domain below it, which the VM's
    /// user can write: QEMU is the machine's leader.
    pub pid_file: PathBuf,
}

impl MachineSpec {
    pub fn new(id: &str, vmi_uid: &str, runtime_dir: PathBuf, pid_file: PathBuf) -> Self {
        Self {
            name: key::machine_name_of(id),
            uuid: uuid_bytes(vmi_uid).map(Vec::from).unwrap_or_default(),
            unit: key::unit_name_of(id),
            runtime_dir,
            pid_file,
        }
    }
}

/// libvirt's pid file holds a number and a newline.
const MAX_PID_FILE: u64 = 32;

/// A UUID's 16 bytes; None for anything that is not one.
fn uuid_bytes(uid: &str) -> Option<[u8; 16]> {
    let hex: String = uid.chars().filter(|c| *c != '-').collect();
    if hex.len() != 32 || uid.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

pub trait Machines: Send + Sync + 'static {
    /// Whether the machine is registered; None when machined is not there.
    fn registered(
        &self,
        name: &str,
    ) -> impl Future<Output = Result<Option<bool>, MachinedError>> + Send;
    fn register(
        &self,
        spec: &MachineSpec,
    ) -> impl Future<Output = Result<(), MachinedError>> + Send;
    /// Forgets the machine, leaving its unit alone; gone already is fine.
    fn unregister(&self, name: &str) -> impl Future<Output = Result<(), MachinedError>> + Send;
}

#[derive(Clone)]
pub struct Machined {
    bus: Bus,
}

impl Machined {
    pub fn new(bus: Bus) -> Self {
        Self { bus }
    }

    async fn manager(&self, name: &str) -> Result<ManagerProxy<'static>, MachinedError> {
        ManagerProxy::new(self.bus.connection())
            .await
            .map_err(|source| MachinedError::Bus {
                name: name.into(),
                source: Box::new(source),
            })
    }
}

fn error_name(e: &zbus::Error) -> Option<&str> {
    match e {
        zbus::Error::MethodError(name, _, _) => Some(name.as_str()),
        _ => None,
    }
}

fn machined_absent(e: &zbus::Error) -> bool {
    matches!(
        error_name(e),
        Some(
            "org.freedesktop.DBus.Error.ServiceUnknown"
                | "org.freedesktop.DBus.Error.NameHasNoOwner"
                | "org.freedesktop.systemd1.LoadFailed"
                | "org.freedesktop.systemd1.NoSuchUnit"
        )
    )
}

fn no_such_machine(e: &zbus::Error) -> bool {
    error_name(e) == Some("org.freedesktop.machine1.NoSuchMachine")
}

/// QEMU's PID from libvirt's pid file, checked to be in the VM's unit so a
/// stale file can never hand machined someone else's process.
fn leader(spec: &MachineSpec) -> Result<u32, MachinedError> {
    let err = |message: String| MachinedError::Leader {
        name: spec.name.clone(),
        path: spec.pid_file.clone(),
        message,
    };
    let rel = spec
        .pid_file
        .strip_prefix(&spec.runtime_dir)
        .map_err(|_| err("not in the VM's runtime directory".into()))?;
    let text = Beneath::open(&spec.runtime_dir)
        .and_then(|d| d.read(rel, MAX_PID_FILE))
        .map_err(|e| err(e.to_string()))?;
    let text = String::from_utf8_lossy(&text);
    let pid: u32 = text
        .trim()
        .parse()
        .map_err(|_| err(format!("not a PID: {:?}", text.trim())))?;
    let cgroup = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("cgroup"))
        .map_err(|e| err(format!("process {pid}: {e}")))?;
    if !cgroup
        .lines()
        .any(|l| l.ends_with(&format!("/{}", spec.unit)))
    {
        return Err(err(format!("process {pid} is not in {}", spec.unit)));
    }
    Ok(pid)
}

impl Machines for Machined {
    async fn registered(&self, name: &str) -> Result<Option<bool>, MachinedError> {
        let manager = self.manager(name).await?;
        match self.bus.call(manager.get_machine(name.into())).await {
            Ok(_) => Ok(Some(true)),
            Err(e) if no_such_machine(&e) => Ok(Some(false)),
            Err(e) if machined_absent(&e) => Ok(None),
            Err(source) => Err(MachinedError::Bus {
                name: name.into(),
                source: Box::new(source),
            }),
        }
    }

    async fn register(&self, spec: &MachineSpec) -> Result<(), MachinedError> {
        // Reading a file the VM's user controls: off the async workers.
        let owned = spec.clone();
        let pid = tokio::task::spawn_blocking(move || leader(&owned))
            .await
            .map_err(|e| MachinedError::Leader {
                name: spec.name.clone(),
                path: spec.pid_file.clone(),
                message: format!("worker thread died: {e}"),
            })??;
        let manager = self.manager(&spec.name).await?;
        self.bus
            .call(manager.register_machine(
                spec.name.clone(),
                spec.uuid.clone(),
                "kvirt".into(),
                "vm".into(),
                pid,
                String::new(),
            ))
            .await
            .map(drop)
            .map_err(|source| MachinedError::Bus {
                name: spec.name.clone(),
                source: Box::new(source),
            })
    }

    async fn unregister(&self, name: &str) -> Result<(), MachinedError> {
        let manager = self.manager(name).await?;
        match self.bus.call(manager.unregister_machine(name.into())).await {
            Ok(()) => Ok(()),
            Err(e) if no_such_machine(&e) || machined_absent(&e) => Ok(()),
            Err(source) => Err(MachinedError::Bus {
                name: name.into(),
                source: Box::new(source),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vmi_uid_is_the_machine_id() {
        let s = MachineSpec::new(
            "default_vm1",
            "0f8e4c3a-1b2d-4e5f-8a9b-0c1d2e3f4a5b",
            "/run".into(),
            "/run/x.pid".into(),
        );
        assert_eq!(s.name, "default.vm1");
        assert_eq!(s.unit, "kvirt-vm@default_vm1.service");
        assert_eq!(
            s.uuid,
            [
                0x0f, 0x8e, 0x4c, 0x3a, 0x1b, 0x2d, 0x4e, 0x5f, 0x8a, 0x9b, 0x0c, 0x1d, 0x2e, 0x3f,
                0x4a, 0x5b
            ]
        );
        // machined takes an empty id as "none"; a non-UUID never becomes one.
        assert!(
            MachineSpec::new("a_b", "not-a-uuid", "/".into(), "/x".into())
                .uuid
                .is_empty()
        );
        assert!(MachineSpec::new(
            "a_b",
            "0f8e4c3a1b2d4e5f8a9b0c1d2e3f4a5bxxxx",
            "/".into(),
            "/x".into()
        )
        .uuid
        .is_empty());
    }

    #[test]
    fn a_stale_pid_file_names_no_leader() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("vm.pid");
        let spec = MachineSpec::new("default_vm1", "", dir.path().into(), pid_file.clone());
        assert!(matches!(leader(&spec), Err(MachinedError::Leader { .. })));
        std::fs::write(&pid_file, "garbage\n").unwrap();
        let e = leader(&spec).unwrap_err().to_string();
        assert!(e.contains("not a PID"), "{e}");
        // This test's own process is not in the VM's unit.
        std::fs::write(&pid_file, format!("{}\n", std::process::id())).unwrap();
        let e = leader(&spec).unwrap_err().to_string();
        assert!(e.contains("is not in kvirt-vm@default_vm1.service"), "{e}");
        // Planted by the VM's user: a link, a FIFO, a huge file. None is
        // followed, blocks or is read whole.
        std::fs::remove_file(&pid_file).unwrap();
        std::os::unix::fs::symlink("/proc/self/stat", &pid_file).unwrap();
        assert!(leader(&spec).is_err());
        std::fs::remove_file(&pid_file).unwrap();
        nix::unistd::mkfifo(&pid_file, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let e = leader(&spec).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&pid_file).unwrap();
        std::fs::write(
            &pid_file,
            format!("{}\n{}", std::process::id(), " ".repeat(4096)),
        )
        .unwrap();
        let e = leader(&spec).unwrap_err().to_string();
        assert!(e.contains("larger than"), "{e}");
    }
}
