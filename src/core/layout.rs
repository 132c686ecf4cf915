//! Where a VM's files live on the host. Pure: paths only, nothing touched.

use crate::core::key::VmKey;
use std::path::{Path, PathBuf};

/// Where session libvirt keeps its QEMU capability cache, below
/// `$XDG_CACHE_HOME`.
const CAPABILITIES: &str = "libvirt/qemu/cache/capabilities";

/// The status file's name in a VM's runtime directory before 0.2.
pub const LEGACY_STATUS: &str = "status.json";

/// Which libvirt daemon serves a VM; decides the socket name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DaemonKind {
    Virtqemud,
    Libvirtd,
}

impl DaemonKind {
    pub fn binary_name(self) -> &'static str {
        match self {
            Self::Virtqemud => "virtqemud",
            Self::Libvirtd => "libvirtd",
        }
    }

    fn socket_name(self) -> &'static str {
        match self {
            Self::Virtqemud => "virtqemud-sock",
            Self::Libvirtd => "libvirt-sock",
        }
    }
}

/// The most bytes of a Unix socket path (`sun_path`, its NUL excluded).
pub const MAX_SOCKET_PATH: usize = 107;

/// The host-wide roots, from the config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    pub state_dir: PathBuf,
    pub runtime_dir: PathBuf,
    pub cache_dir: PathBuf,
}

impl Default for HostLayout {
    fn default() -> Self {
        Self {
            state_dir: "/var/lib/kvirt".into(),
            runtime_dir: "/run/kvirt".into(),
            cache_dir: "/var/cache/kvirt".into(),
        }
    }
}

impl HostLayout {
    pub fn vms_state_dir(&self) -> PathBuf {
        self.state_dir.join("vms")
    }

    pub fn vms_runtime_dir(&self) -> PathBuf {
        self.runtime_dir.join("vms")
    }

    /// Standalone VMIs' status, by VM id: root's alone, out of every VM's
    /// reach (a VM's own directories are its user's to plant links in).
    pub fn status_dir(&self) -> PathBuf {
        self.runtime_dir.join("status")
    }

    /// Each VirtualMachine's object, status and kvirt's record of it: kept
    /// across reboots, as a cluster keeps the object (a stopped VM stays
    /// stopped).
    pub fn virtual_machines_dir(&self) -> PathBuf {
        self.state_dir.join("virtualmachines")
    }

    /// kvirtd's control socket (`kvirtctl start|stop|...` of standalone VMs).
    pub fn control_socket(&self) -> PathBuf {
        self.runtime_dir.join("control.sock")
    }

    /// The manifests kvirtd cannot use, with why (for `kvirtctl ls`).
    pub fn manifest_errors_file(&self) -> PathBuf {
        self.runtime_dir.join("manifest-errors").join("errors.json")
    }

    /// containerDisk images, shared by every VM (see `image`).
    pub fn images_dir(&self) -> PathBuf {
        self.cache_dir.join("images")
    }

    /// kvirt's own libvirt daemon that probes QEMU once (as kvirt's user,
    /// which no VM runs as): its config and cache...
    pub fn probe_dir(&self) -> PathBuf {
        self.cache_dir.join("probe")
    }

    /// ...its socket...
    pub fn probe_runtime_dir(&self) -> PathBuf {
        self.runtime_dir.join("probe")
    }

    pub fn probe_uri(&self, daemon: DaemonKind) -> String {
        let socket = self
            .probe_runtime_dir()
            .join("libvirt")
            .join(daemon.socket_name());
        format!("qemu:///session?socket={}", socket.display())
    }

    /// ...and the capability cache it leaves, which each VM starts from (a
    /// copy of its own): a fresh daemon would probe QEMU for ~0.5 s.
    pub fn probe_capabilities_dir(&self) -> PathBuf {
        self.probe_dir().join("cache").join(CAPABILITIES)
    }

    /// Which hostDisks each VM identity was given (POSIX ACL entries), by
    /// uid: taken back when the identity goes.
    pub fn grants_dir(&self) -> PathBuf {
        self.state_dir.join("grants")
    }

    /// EFI variables kept for VMs that ask for them (`efi.persistent`),
    /// by VM id: they outlive the VMI, as KubeVirt's backend storage does.
    pub fn efi_vars_dir(&self) -> PathBuf {
        self.state_dir.join("efi-vars")
    }

    /// Which dedicated CPUs each VM holds: under `/run`, as after a
    /// reboot no VM runs to hold any.
    pub fn dedicated_cpus_file(&self) -> PathBuf {
        self.runtime_dir.join("dedicated-cpus.json")
    }

    /// Which uid each VM has. In a directory of its own: a VM's unit hides
    /// kvirt's records by mounting over them, and systemd mounting over a
    /// file that kvirtd is replacing at that moment (another VM's identity
    /// saved) fails the unit's start ("Failed to mount ... No such file or
    /// directory"); a directory is never replaced.
    pub fn identities_file(&self) -> PathBuf {
        self.state_dir.join("identities").join("identities.json")
    }

    /// Where earlier kvirts kept the identities and the manifests' errors,
    /// beside other files: moved or removed at start.
    pub fn legacy_record_files(&self) -> [(PathBuf, Option<PathBuf>); 2] {
        [
            (
                self.state_dir.join("identities.json"),
                Some(self.identities_file()),
            ),
            (self.runtime_dir.join("manifest-errors.json"), None),
        ]
    }

    /// The migrations this host takes part in, one root-only file per VM
    /// id. Under the runtime directory: a mark must not outlive the VM's
    /// processes, which a reboot ends.
    pub fn migrations_dir(&self) -> PathBuf {
        self.runtime_dir.join("migrations")
    }

    /// The VMs a self-fence stopped, one root-only file per VM id, kept
    /// until their VMI is gone; and the time of this host's last Lease
    /// renewal, which a kvirtd restarted while its host is cut off fences
    /// from. Under the runtime directory: a reboot ends every VM anyway.
    pub fn fenced_dir(&self) -> PathBuf {
        self.runtime_dir.join("fenced")
    }

    pub fn lease_renewed_file(&self) -> PathBuf {
        self.fenced_dir().join("lease-renewed")
    }

    /// Present while the host is cordoned (`kvirtctl drain`, until
    /// `kvirtctl uncordon`): kept across restarts and reboots.
    pub fn cordon_file(&self) -> PathBuf {
        self.state_dir.join("cordoned")
    }

    /// Which address each VM has.
    pub fn leases_file(&self) -> PathBuf {
        self.state_dir.join("network").join("leases.json")
    }

    /// What each VM's writable disks may grow to (`host::growth`).
    pub fn disk_growth_dir(&self) -> PathBuf {
        self.state_dir.join("disk-growth")
    }

    /// How far each VM's QEMU log has been forwarded to the journal.
    pub fn log_positions_dir(&self) -> PathBuf {
        self.runtime_dir.join("qemu-log")
    }

    /// kvirt's records of every VM on the host (names, uids, addresses,
    /// grants, VirtualMachines, status, log positions, the manifests'
    /// errors): directories root's alone (0700), and hidden from every VM's
    /// unit, so no VM or local user lists the host's tenants.
    pub fn root_only_dirs(&self) -> Vec<PathBuf> {
        vec![
            parent(&self.leases_file()),
            self.grants_dir(),
            self.virtual_machines_dir(),
            self.efi_vars_dir(),
            self.status_dir(),
            self.log_positions_dir(),
            self.disk_growth_dir(),
            parent(&self.identities_file()),
            parent(&self.manifest_errors_file()),
            self.fenced_dir(),
        ]
    }

    pub fn vm(&self, key: &VmKey) -> VmPaths {
        VmPaths::new(self, &key.id())
    }

    /// Paths of a VM known only by its id (found on the host, VMI gone).
    pub fn vm_by_id(&self, id: &str) -> VmPaths {
        VmPaths::new(self, id)
    }
}

/// The directory a record file of kvirt's sits in.
fn parent(file: &Path) -> PathBuf {
    file.parent().map(PathBuf::from).unwrap_or_default()
}

/// One VM's directories and sockets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmPaths {
    /// `/var/lib/kvirt/vms/<id>`: disks kvirt creates, libvirt's config.
    pub state_dir: PathBuf,
    /// `/run/kvirt/vms/<id>`: sockets, logs, status.
    pub runtime_dir: PathBuf,
    /// `/var/lib/kvirt/efi-vars/<id>`: kept EFI variables, outside the
    /// VM's own directories.
    pub efi_vars_dir: PathBuf,
    /// `/run/kvirt/status/<id>.json`: the VMI with its status (standalone).
    pub status_file: PathBuf,
    id: String,
}

impl VmPaths {
    fn new(host: &HostLayout, id: &str) -> Self {
        Self {
            state_dir: host.vms_state_dir().join(id),
            runtime_dir: host.vms_runtime_dir().join(id),
            efi_vars_dir: host.efi_vars_dir().join(id),
            status_file: host.status_dir().join(format!("{id}.json")),
            id: id.to_owned(),
        }
    }

    /// Where session libvirt keeps the domain's EFI variables (made from
    /// the firmware's template when missing).
    pub fn nvram(&self) -> PathBuf {
        self.xdg_config_dir()
            .join("libvirt/qemu/nvram")
            .join(format!("{}_VARS.fd", self.id))
    }

    /// The daemon's `XDG_RUNTIME_DIR`; session libvirt puts its socket under it.
    pub fn xdg_runtime_dir(&self) -> PathBuf {
        self.runtime_dir.join("xdg")
    }

    pub fn xdg_config_dir(&self) -> PathBuf {
        self.state_dir.join("config")
    }

    /// Where the VM's unit sees [`Self::xdg_config_dir`]: a short fixed
    /// path on the tmpfs that hides the other VMs. libvirt binds the QEMU
    /// monitor below it (`libvirt/qemu/lib/domain-<n>-<name>/monitor.sock`),
    /// which under the state directory would pass the Unix socket path
    /// limit for all but the shortest names.
    pub fn unit_config_dir(&self) -> PathBuf {
        self.runtime_dir
            .parent()
            .unwrap_or(&self.runtime_dir)
            .join(".config")
    }

    /// Where the VM's unit sees its runtime directory too: a short fixed
    /// path on the tmpfs that hides the other VMs, under which its daemon
    /// runs (`XDG_RUNTIME_DIR`), so the sockets libvirt names itself there
    /// (swtpm's, `libvirt/qemu/run/swtpm/<id>-<name>-swtpm.sock`) fit the
    /// Unix socket path limit whatever the VM's name.
    pub fn unit_runtime_dir(&self) -> PathBuf {
        self.runtime_dir
            .parent()
            .unwrap_or(&self.runtime_dir)
            .join(".run")
    }

    /// The daemon's `XDG_RUNTIME_DIR` as its unit sees it: the same
    /// directory as [`Self::xdg_runtime_dir`].
    pub fn unit_xdg_runtime_dir(&self) -> PathBuf {
        self.unit_runtime_dir().join("xdg")
    }

    /// The longest Unix socket path the VM's libvirt daemon and QEMU bind
    /// for a domain of this name: the daemon's admin socket and QEMU's in
    /// the runtime directory, the monitor in libvirt's per-domain directory
    /// (`domain-<id>-<the name's first 20 characters>`; the id assumed
    /// below 1000), and a TPM's swtpm socket (`<id>-<those 20>-swtpm.sock`).
    pub fn longest_socket_path(&self, domain_name: &str) -> usize {
        let short: String = domain_name.chars().take(20).collect();
        let monitor = self
            .unit_config_dir()
            .join(format!("libvirt/qemu/lib/domain-999-{short}/monitor.sock"));
        let swtpm = self
            .unit_xdg_runtime_dir()
            .join(format!("libvirt/qemu/run/swtpm/999-{short}-swtpm.sock"));
        [
            swtpm,
            self.xdg_runtime_dir().join("libvirt/virtqemud-admin-sock"),
            self.serial_socket(),
            self.guest_agent_socket(),
            self.vnc_socket(),
            monitor,
        ]
        .iter()
        .map(|p| p.as_os_str().len())
        .max()
        .unwrap_or(0)
    }

    /// The TPM's state, where session libvirt has swtpm keep it for the
    /// domain of this UUID (only the file of a TPM 2.0's permanent state).
    pub fn tpm_state(&self, uuid: &str) -> PathBuf {
        self.xdg_config_dir()
            .join("libvirt/qemu/swtpm")
            .join(uuid)
            .join("tpm2/tpm2-00.permall")
    }

    /// Session libvirt reads its QEMU driver config from here.
    pub fn qemu_conf(&self) -> PathBuf {
        self.xdg_config_dir().join("libvirt/qemu.conf")
    }

    pub fn xdg_cache_dir(&self) -> PathBuf {
        self.state_dir.join("cache")
    }

    /// The VM's own capability cache, started from the probe's.
    pub fn capabilities_dir(&self) -> PathBuf {
        self.xdg_cache_dir().join(CAPABILITIES)
    }

    pub fn libvirt_socket(&self, daemon: DaemonKind) -> PathBuf {
        self.xdg_runtime_dir()
            .join("libvirt")
            .join(daemon.socket_name())
    }

    pub fn libvirt_uri(&self, daemon: DaemonKind) -> String {
        format!(
            "qemu:///session?socket={}",
            self.libvirt_socket(daemon).display()
        )
    }

    /// Where session libvirt writes QEMU's log (`<domain>.log`).
    pub fn qemu_log_dir(&self) -> PathBuf {
        self.xdg_cache_dir().join("libvirt/qemu/log")
    }

    /// Where session libvirt records QEMU's PID for a domain.
    /// The VM's libvirt daemon's pid files (one of them exists).
    pub fn daemon_pid_files(&self) -> [PathBuf; 2] {
        let dir = self.xdg_runtime_dir().join("libvirt");
        [dir.join("virtqemud.pid"), dir.join("libvirtd.pid")]
    }

    pub fn qemu_pid_file(&self, domain_name: &str) -> PathBuf {
        self.xdg_runtime_dir()
            .join("libvirt/qemu/run")
            .join(format!("{domain_name}.pid"))
    }

    pub fn serial_socket(&self) -> PathBuf {
        self.runtime_dir.join("serial.sock")
    }

    pub fn serial_log(&self) -> PathBuf {
        self.runtime_dir.join("console.log")
    }

    /// The QEMU guest agent's virtio-serial channel.
    pub fn guest_agent_socket(&self) -> PathBuf {
        self.runtime_dir.join("qga.sock")
    }

    pub fn vnc_socket(&self) -> PathBuf {
        self.runtime_dir.join("vnc.sock")
    }

    /// Where kvirt before 0.2 kept the status: in the VM's runtime
    /// directory, which its user can write. Read once (safely) to migrate.
    pub fn legacy_status_file(&self) -> PathBuf {
        self.runtime_dir.join(LEGACY_STATUS)
    }

    /// Disks kvirt creates for the VM (emptyDisk).
    pub fn disk_dir(&self) -> PathBuf {
        self.state_dir.join("disks")
    }

    pub fn cloud_init_iso(&self, volume: &str) -> PathBuf {
        self.disk_dir().join(format!("{volume}.cloud-init.iso"))
    }

    /// A configMap/secret/serviceAccount volume's ISO.
    pub fn config_iso(&self, volume: &str) -> PathBuf {
        self.disk_dir().join(format!("{volume}.iso"))
    }

    pub fn empty_disk(&self, volume: &str) -> PathBuf {
        self.disk_dir().join(format!("{volume}.qcow2"))
    }

    /// Direct kernel boot's copies of the image's kernel and initrd.
    pub fn kernel_file(&self) -> PathBuf {
        self.disk_dir().join("kernel")
    }

    pub fn initrd_file(&self) -> PathBuf {
        self.disk_dir().join("initrd")
    }

    /// A block claim's device node, made for the VM alone: in its state
    /// directory, since `/run` is mounted `nodev` (its nodes cannot be
    /// opened).
    pub fn claim_device(&self, volume: &str) -> PathBuf {
        self.state_dir.join("claims").join(volume)
    }

    /// The VM's writable layer over a containerDisk or ephemeral base.
    pub fn overlay(&self, volume: &str) -> PathBuf {
        self.disk_dir().join(format!("{volume}.overlay.qcow2"))
    }

    pub fn is_under(&self, path: &Path) -> bool {
        path.starts_with(&self.state_dir) || path.starts_with(&self.runtime_dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kubernetes_name_fits_the_sockets() {
        let layout = HostLayout::default();
        for (ns, name) in [
            ("n".repeat(63), "v".repeat(63)),
            ("n".repeat(63), "v".repeat(253)),
            (
                "default".to_owned(),
                "a-vm-whose-name-is-long-enough-to-matter".to_owned(),
            ),
        ] {
            let key = VmKey::new(&ns, &name).unwrap();
            let longest = layout.vm(&key).longest_socket_path(&key.domain_name());
            assert!(longest <= MAX_SOCKET_PATH, "{key}: {longest}");
        }
        // The longest id that is its domain name still fits exactly.
        let key = VmKey::new("default", &"v".repeat(crate::core::key::MAX_ID_LEN - 8)).unwrap();
        assert_eq!(key.id(), key.domain_name());
        assert_eq!(
            layout.vm(&key).longest_socket_path(&key.domain_name()),
            MAX_SOCKET_PATH
        );
    }
}
