//! Live migration's libvirt half, as KubeVirt's virt-launcher drives it:
//! the source VM's daemon moves its running domain peer-to-peer to the
//! target VM's daemon, every connection on a unix socket that kvirtd
//! carries between the hosts ([`crate::host::tunnel`]); the job's progress
//! while it runs; its abort.

use crate::host::libvirt::{DomainRef, LibvirtError};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;
use virt::sys;

/// Where the source daemon sends its domain. Each socket is the source end
/// of a tunnel channel, at the path the target's daemon, QEMU or NBD
/// server listens on there (QEMU is told one path for both ends).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigrateTo {
    pub daemon_socket: PathBuf,
    pub memory_socket: PathBuf,
    pub disks_socket: PathBuf,
    /// The disks (by target name, `vda`) copied through the target's NBD
    /// server; every other disk is on storage both hosts reach. Empty: no
    /// disk is copied.
    pub copied_disks: Vec<String>,
    /// The domain as the target defines it (its own paths), when it
    /// differs from the source's.
    pub dest_xml: Option<String>,
    /// The most the migration stream may use, in MiB/s (KubeVirt's
    /// `bandwidthPerMigration`); `None`: as fast as it goes.
    pub bandwidth_mib: Option<u64>,
}

impl MigrateTo {
    /// The target daemon as the source daemon dials it.
    pub fn daemon_uri(&self) -> String {
        format!(
            "qemu+unix:///session?socket={}",
            self.daemon_socket.display()
        )
    }

    pub fn memory_uri(&self) -> String {
        format!("unix://{}", self.memory_socket.display())
    }

    pub fn disks_uri(&self) -> String {
        format!("unix://{}", self.disks_socket.display())
    }

    /// KubeVirt's flags: live, peer-to-peer between the daemons, defined on
    /// the target and forgotten by the source (nothing there to restart
    /// it), throttled until it converges, and an incremental copy of the
    /// disks that are not shared (a containerDisk overlay's top, whose
    /// base the target has pulled). Unsafe in libvirt's words only: kvirt
    /// asks once every writable disk is copied or on storage the
    /// administrator declared shared (`core::migration::migratable`), and
    /// libvirt's own check knows only the network filesystems it
    /// recognises (a directory shared otherwise, as the test pair's, it
    /// refuses).
    pub fn flags(&self) -> u32 {
        let mut f = sys::VIR_MIGRATE_LIVE
            | sys::VIR_MIGRATE_PEER2PEER
            | sys::VIR_MIGRATE_PERSIST_DEST
            | sys::VIR_MIGRATE_UNDEFINE_SOURCE
            | sys::VIR_MIGRATE_AUTO_CONVERGE
            | sys::VIR_MIGRATE_UNSAFE;
        if !self.copied_disks.is_empty() {
            f |= sys::VIR_MIGRATE_NON_SHARED_INC;
        }
        f
    }

    /// libvirt's typed parameters for [`MigrateTo::flags`].
    pub fn parameters(&self) -> virt::domain::MigrateParameters {
        let copies = !self.copied_disks.is_empty();
        virt::domain::MigrateParameters {
            uri: Some(self.memory_uri()),
            disks_uri: copies.then(|| self.disks_uri()),
            migrate_disks: self.copied_disks.clone(),
            dest_xml: self.dest_xml.clone(),
            persist_xml: self.dest_xml.clone(),
            bandwidth: self.bandwidth_mib,
            ..Default::default()
        }
    }
}

pub use crate::core::progress::Progress;

/// The source's side of a migration, one VM's daemon at a time.
pub trait LiveMigration: Send + Sync + 'static {
    /// Moves the running domain; returns once the target runs it (or the
    /// migration failed, was aborted, or took longer than `timeout`, when
    /// it is aborted and the domain keeps running here). Runs on a
    /// connection of its own: the VM's other calls go on meanwhile.
    fn migrate(
        &self,
        d: &DomainRef,
        to: &MigrateTo,
        timeout: Duration,
    ) -> impl Future<Output = Result<(), LibvirtError>> + Send;
    /// The running job's progress; `None` when no job runs.
    fn progress(
        &self,
        d: &DomainRef,
    ) -> impl Future<Output = Result<Option<Progress>, LibvirtError>> + Send;
    /// The job that last ended on the domain here; a migration's
    /// statistics (its downtime among them) reach its target too.
    fn finished(
        &self,
        d: &DomainRef,
    ) -> impl Future<Output = Result<Option<Progress>, LibvirtError>> + Send;
    /// Aborts the running job (the domain keeps running here).
    fn abort(&self, d: &DomainRef) -> impl Future<Output = Result<(), LibvirtError>> + Send;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(copied: &[&str]) -> MigrateTo {
        MigrateTo {
            daemon_socket: "/run/kvirt/vms/ns_a/migration/daemon.sock".into(),
            memory_socket: "/run/kvirt/vms/ns_a/migration/memory.sock".into(),
            disks_socket: "/run/kvirt/vms/ns_a/migration/disks.sock".into(),
            copied_disks: copied.iter().map(|d| d.to_string()).collect(),
            dest_xml: None,
            bandwidth_mib: None,
        }
    }

    #[test]
    fn kubevirts_flags_and_unix_uris() {
        let shared = to(&[]);
        assert_eq!(
            shared.daemon_uri(),
            "qemu+unix:///session?socket=/run/kvirt/vms/ns_a/migration/daemon.sock"
        );
        let f = shared.flags();
        for flag in [
            sys::VIR_MIGRATE_LIVE,
            sys::VIR_MIGRATE_PEER2PEER,
            sys::VIR_MIGRATE_PERSIST_DEST,
            sys::VIR_MIGRATE_UNDEFINE_SOURCE,
            sys::VIR_MIGRATE_AUTO_CONVERGE,
            sys::VIR_MIGRATE_UNSAFE,
        ] {
            assert_eq!(f & flag, flag, "{flag:#x}");
        }
        // Never tunnelled through the daemons, never post-copy.
        assert_eq!(f & sys::VIR_MIGRATE_TUNNELLED, 0);
        assert_eq!(f & sys::VIR_MIGRATE_POSTCOPY, 0);
        assert_eq!(f & sys::VIR_MIGRATE_NON_SHARED_INC, 0);
        let p = shared.parameters();
        assert_eq!(
            p.uri.as_deref(),
            Some("unix:///run/kvirt/vms/ns_a/migration/memory.sock")
        );
        assert!(p.disks_uri.is_none() && p.migrate_disks.is_empty());
    }

    #[test]
    fn only_the_disks_named_are_copied() {
        let copying = to(&["vdb"]);
        assert_eq!(
            copying.flags() & sys::VIR_MIGRATE_NON_SHARED_INC,
            sys::VIR_MIGRATE_NON_SHARED_INC
        );
        let p = copying.parameters();
        assert_eq!(p.migrate_disks, vec!["vdb".to_string()]);
        assert_eq!(
            p.disks_uri.as_deref(),
            Some("unix:///run/kvirt/vms/ns_a/migration/disks.sock")
        );
    }
}
