//! The per-VM transient service as data: VM → systemd properties, pure.
//!
//! youki's libcgroups is the model: limits and sandboxing become a list of
//! properties here, and only the systemd adapter knows about D-Bus.

use crate::core::cpuset::CpuSet;
use crate::core::key::VmKey;
use crate::core::layout::{DaemonKind, HostLayout, VmPaths};
use std::path::PathBuf;

/// Environment keys recorded on the unit so adoption can match it to a VMI
/// without trusting the (possibly shortened) unit name.
pub const ENV_UID: &str = "KVIRT_VMI_UID";
pub const ENV_NAMESPACE: &str = "KVIRT_VMI_NAMESPACE";
pub const ENV_NAME: &str = "KVIRT_VMI_NAME";
pub const ENV_DAEMON: &str = "KVIRT_DAEMON";
pub const ENV_GRACE: &str = "KVIRT_GRACE_SECONDS";
/// systemd's user database services a VM's processes never ask (nss-systemd
/// reads the drop-in records itself); another service on the host is still
/// asked. Not `1`: that also skips group membership, and the group lookups
/// fail (systemd 257).
pub const USERDB_BYPASS: [&str; 6] = [
    "io.systemd.DynamicUser",
    "io.systemd.Machine",
    "io.systemd.Home",
    "io.systemd.Multiplexer",
    "io.systemd.NameServiceSwitch",
    "io.systemd.DropIn",
];
/// Set (`1`) on the unit of a VM whose disks other hosts reach: what a
/// self-fence stops, known from the unit alone while the API is away.
pub const ENV_SHARED_DISKS: &str = "KVIRT_SHARED_DISKS";

/// One systemd unit property, typed so the adapter can map each to its
/// D-Bus signature without guessing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prop {
    Str(&'static str, String),
    Bool(&'static str, bool),
    U32(&'static str, u32),
    U64(&'static str, u64),
    I32(&'static str, i32),
    /// `AllowedCPUs`: a CPU bit mask (`ay`).
    Bytes(&'static str, Vec<u8>),
    Strs(&'static str, Vec<String>),
    /// `ExecStart`: argv, argv[0] included.
    Exec(&'static str, Vec<String>),
    /// `ExecStopEx` and the like: argv, and flags (`privileged` is the
    /// `+` prefix of a unit file).
    ExecEx(&'static str, Vec<String>, Vec<&'static str>),
    /// `BindPaths`: (source, destination), neither optional.
    Binds(&'static str, Vec<(String, String)>),
    /// `TemporaryFileSystem`: (path, options).
    TmpFs(&'static str, Vec<(String, String)>),
    /// `DeviceAllow`: (device, rwm).
    Devices(&'static str, Vec<(String, String)>),
    /// `RestrictAddressFamilies`, `SystemCallFilter`: only these are allowed.
    AllowList(&'static str, Vec<String>),
}

impl Prop {
    pub fn name(&self) -> &'static str {
        match self {
            Prop::Str(n, _)
            | Prop::Bool(n, _)
            | Prop::U32(n, _)
            | Prop::U64(n, _)
            | Prop::I32(n, _)
            | Prop::Bytes(n, _)
            | Prop::Strs(n, _)
            | Prop::Exec(n, _)
            | Prop::ExecEx(n, _, _)
            | Prop::Binds(n, _)
            | Prop::TmpFs(n, _)
            | Prop::Devices(n, _)
            | Prop::AllowList(n, _) => n,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitSpec {
    pub name: String,
    pub properties: Vec<Prop>,
}

/// What the unit needs to know about one VM.
#[derive(Clone, Debug)]
pub struct UnitInput<'a> {
    pub key: &'a VmKey,
    pub uid: &'a str,
    pub paths: &'a VmPaths,
    pub host: &'a HostLayout,
    pub daemon: DaemonKind,
    pub daemon_path: PathBuf,
    pub user: &'a str,
    pub slice: &'a str,
    pub memory_max_bytes: u64,
    pub cpu_weight: u64,
    /// `resources.limits.cpu` in millicores: CPU time per second.
    pub cpu_limit_millis: Option<u64>,
    pub tasks_max: u64,
    pub grace_seconds: u64,
    /// Files outside the VM's own directories QEMU must write (hostDisks).
    pub extra_rw_paths: Vec<PathBuf>,
    /// Files and directories QEMU only reads: containerDisk images in the
    /// image cache, ephemeral bases.
    pub extra_ro_paths: Vec<PathBuf>,
    /// The hostDisk and claim roots, hidden but for the VM's own disks.
    pub hidden_roots: Vec<PathBuf>,
    /// Block claims' host devices the VM may use (`true`: writable).
    pub devices: Vec<(PathBuf, bool)>,
    /// The CPUs it runs on: its dedicated ones, or those no VM holds.
    /// `None`: any (the host dedicates no CPUs).
    pub allowed_cpus: Option<&'a CpuSet>,
    /// It writes disks other hosts reach ([`ENV_SHARED_DISKS`]).
    pub shared_disks: bool,
}

/// systemd's CPUWeight for a Kubernetes CPU request: 1 CPU = the default
/// weight 100, clamped to systemd's range.
pub fn cpu_weight(cpu_request_millis: Option<u64>) -> u64 {
    cpu_request_millis.map_or(100, |m| (m / 10).clamp(1, 10_000))
}

pub fn unit_spec(i: &UnitInput) -> UnitSpec {
    let p = i.paths;
    let s = |v: &std::path::Path| v.display().to_string();
    let mut env = vec![
        format!("XDG_RUNTIME_DIR={}", s(&p.unit_xdg_runtime_dir())),
        format!("XDG_CONFIG_HOME={}", s(&p.unit_config_dir())),
        format!("XDG_CACHE_HOME={}", s(&p.xdg_cache_dir())),
        format!("HOME={}", s(&p.state_dir)),
        format!("{ENV_UID}={}", i.uid),
        format!("{ENV_NAMESPACE}={}", i.key.namespace()),
        format!("{ENV_NAME}={}", i.key.name()),
        format!("{ENV_DAEMON}={}", i.daemon.binary_name()),
        format!("{ENV_GRACE}={}", i.grace_seconds),
        // One malloc arena: the daemon idles between a few calls, and each
        // extra arena is private memory multiplied by every VM.
        "MALLOC_ARENA_MAX=1".to_owned(),
        // The daemon looks up its user and group when it starts and again
        // on SIGTERM, and each lookup asked PID 1 and machined over varlink
        // and waited for both: with 250 units stopping, PID 1 took 0.3 to
        // 2.9 s to answer, most of each daemon's exit. Its user is one of
        // kvirt's drop-in records and root is in /etc/passwd: none of
        // systemd's own services holds either.
        format!("SYSTEMD_BYPASS_USERDB={}", USERDB_BYPASS.join(":")),
    ];
    if i.shared_disks {
        env.push(format!("{ENV_SHARED_DISKS}=1"));
    }
    let mut rw = vec![s(&p.state_dir), s(&p.runtime_dir)];
    rw.extend(i.extra_rw_paths.iter().map(|x| s(x)));
    // The VM's own directories, and its hostDisks, bound over the tmpfs
    // that hides every other VM's and every other disk under the roots.
    let mut binds = vec![
        (s(&p.state_dir), s(&p.state_dir)),
        (s(&p.runtime_dir), s(&p.runtime_dir)),
        (s(&p.xdg_config_dir()), s(&p.unit_config_dir())),
        (s(&p.runtime_dir), s(&p.unit_runtime_dir())),
    ];
    binds.extend(i.extra_rw_paths.iter().map(|x| (s(x), s(x))));
    let mut hidden = vec![
        (s(&i.host.vms_state_dir()), "ro".to_owned()),
        (s(&i.host.vms_runtime_dir()), "ro".to_owned()),
        (s(&i.host.cache_dir), "ro".to_owned()),
    ];
    hidden.extend(i.hidden_roots.iter().map(|r| (s(r), "ro".to_owned())));

    let mut properties = vec![
        Prop::Str("Description", format!("kvirt VM {}", i.key)),
        Prop::Exec(
            "ExecStart",
            vec![s(&i.daemon_path), "--timeout".into(), "0".into()],
        ),
        // Both daemons notify readiness once their socket listens, so the
        // start job completing means the socket is there.
        Prop::Str("Type", "notify".into()),
        Prop::Str("NotifyAccess", "main".into()),
        // The VM's own identity: no other VM's process can signal, trace
        // or read it, and its files are its own (no group shares them).
        Prop::Str("User", i.user.into()),
        Prop::Str("Group", i.user.into()),
        Prop::U32("UMask", 0o077),
        Prop::Strs("Environment", env),
        Prop::Str(
            "NetworkNamespacePath",
            format!("/run/netns/{}", i.key.netns_name()),
        ),
        Prop::Str("Slice", i.slice.into()),
        Prop::Str("CollectMode", "inactive-or-failed".into()),
        Prop::U64("MemoryMax", i.memory_max_bytes),
        Prop::U64("CPUWeight", i.cpu_weight),
        // CPUQuota=: a limit of 500m is 500 ms of CPU per second.
        Prop::U64(
            "CPUQuotaPerSecUSec",
            i.cpu_limit_millis.map_or(u64::MAX, |m| m.max(1) * 1000),
        ),
        Prop::U64("TasksMax", i.tasks_max),
        // kvirtd shuts the guest down first; this only bounds a stuck daemon.
        Prop::U64("TimeoutStopUSec", 30_000_000),
        // The daemon dying (signal, OOM, crash) is not the VM's end, as
        // with libvirtd.service: systemd kills only the daemon and starts
        // it again in the same unit, where it reconnects to the running
        // QEMU from its state files.
        Prop::Str("KillMode", "process".into()),
        Prop::Str("Restart", "on-failure".into()),
        Prop::U64("RestartUSec", 200_000),
        // A stop on purpose (kvirtd's teardown, `systemctl stop`) still
        // takes all of it: ExecStop= runs for those and not when the
        // daemon died. It runs outside the sandbox (`+`): setting that up
        // again for one kill cost ~100 ms of CPU per VM.
        Prop::ExecEx(
            "ExecStopEx",
            vec!["/bin/sh".into(), "-c".into(), stop_all(&i.key.unit_name())],
            vec!["privileged"],
        ),
    ];
    if let Some(cpus) = i.allowed_cpus {
        properties.push(Prop::Bytes("AllowedCPUs", cpus.to_mask()));
    }
    properties.extend(sandbox());
    for p in properties.iter_mut() {
        if let Prop::Devices("DeviceAllow", allowed) = p {
            allowed.extend(
                i.devices
                    .iter()
                    .map(|(d, rw)| (s(d), if *rw { "rw" } else { "r" }.to_owned())),
            );
        }
    }
    // kvirt's records of every VM (names, uids, addresses...) are root's
    // alone anyway; the VM does not even see them.
    for p in properties.iter_mut() {
        if let Prop::Strs("InaccessiblePaths", paths) = p {
            paths.extend(i.host.root_only_dirs().iter().map(|p| format!("-{}", s(p))));
        }
    }
    properties.extend([
        Prop::TmpFs("TemporaryFileSystem", hidden),
        Prop::Binds("BindPaths", binds),
        Prop::Strs("ReadWritePaths", rw),
    ]);
    if !i.extra_ro_paths.is_empty() {
        // Bound over the tmpfs that hides the image cache: the VM sees its
        // own images and no others.
        properties.push(Prop::Binds(
            "BindReadOnlyPaths",
            i.extra_ro_paths.iter().map(|x| (s(x), s(x))).collect(),
        ));
    }
    UnitSpec {
        name: i.key.unit_name(),
        properties,
    }
}

/// Where the packages install kvirtd, which a VM's unit runs to stop.
pub const KVIRTD: &str = "/usr/sbin/kvirtd";

/// The unit's ExecStop: SIGTERM to every process of the unit's cgroup, as
/// `systemctl kill --kill-who=all` would, but by kvirtd
/// (`--stop-unit-processes`), which pins each process by a pidfd and
/// checks it is still in the unit before signalling it, so a pid reused
/// by another process since the list was read is never hit. Not
/// `systemctl`: a hundred of them at once each hold a connection to
/// systemd, which sends every unit change to every such connection (the
/// stop of 100 VMs took 6 s more). Where kvirtd cannot (no unified
/// hierarchy, or kvirt removed under running VMs) `systemctl kill` it is.
/// The shell ignores the signal itself, and a process already gone does
/// not fail the stop. Nothing in it comes from the VM or its VMI.
fn stop_all(unit: &str) -> String {
    [
        "trap '' TERM".to_owned(),
        format!("[ -x {KVIRTD} ] && {KVIRTD} --stop-unit-processes && exit 0"),
        format!("exec systemctl kill --kill-who=all --signal=SIGTERM {unit}"),
    ]
    .join("; ")
}

/// What every unit that runs libvirt and QEMU for kvirt keeps out:
/// privileges, kernel knobs, foreign ABIs, and devices other than KVM's
/// and the tun driver's.
fn sandbox() -> Vec<Prop> {
    vec![
        Prop::Bool("NoNewPrivileges", true),
        Prop::U64("CapabilityBoundingSet", 0),
        Prop::Str("ProtectSystem", "strict".into()),
        Prop::Str("ProtectHome", "yes".into()),
        Prop::Bool("PrivateTmp", true),
        Prop::Bool("ProtectKernelTunables", true),
        Prop::Bool("ProtectKernelModules", true),
        Prop::Bool("ProtectKernelLogs", true),
        Prop::Bool("ProtectControlGroups", true),
        Prop::Bool("ProtectClock", true),
        Prop::Bool("ProtectHostname", true),
        Prop::Bool("RestrictSUIDSGID", true),
        Prop::Bool("RestrictRealtime", true),
        Prop::Bool("LockPersonality", true),
        // No namespaces of its own (session libvirt makes none), no foreign
        // ABIs, only the sockets libvirt and QEMU use. Not here:
        // MemoryDenyWriteExecute (QEMU's TCG writes the code it runs),
        // ProtectProc=invisible (libvirt reads its client's /proc entry to
        // identify kvirtd: root's connection fails, "Cannot find start
        // time for pid") and PrivatePIDs= (libvirt as its PID 1 leaves
        // QEMU zombies: a define or destroy then waits 40 s), both measured
        // with systemd 257 and libvirt 11.3.
        Prop::U64("RestrictNamespaces", 0),
        Prop::Strs("SystemCallArchitectures", vec!["native".into()]),
        Prop::AllowList(
            "RestrictAddressFamilies",
            ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
                .map(String::from)
                .to_vec(),
        ),
        Prop::Bool("RemoveIPC", true),
        // No system bus: nothing of libvirt's session daemon or QEMU needs
        // it, a hostile QEMU has no business there, and the bus daemon
        // resolving each VM user's UID went through machined, which was
        // itself waiting on the bus daemon to register a VM: under a burst
        // of starts each such wait ran into the 25 s D-Bus timeout.
        // Nor the journal's files: a VM's number is reused once its VM is
        // gone, and journald lets a uid read its own `user-<uid>.journal`,
        // which holds what the number's earlier VMs logged.
        Prop::Strs(
            "InaccessiblePaths",
            ["-/run/dbus", "-/var/log/journal", "-/run/log/journal"]
                .map(String::from)
                .to_vec(),
        ),
        // What a service normally needs: no mounts, module loading, raw I/O,
        // clock or reboot. Anything else fails with EPERM instead of
        // killing the VM.
        Prop::AllowList("SystemCallFilter", vec!["@system-service".into()]),
        Prop::I32("SystemCallErrorNumber", libc::EPERM),
        Prop::Str("DevicePolicy", "closed".into()),
        Prop::Devices(
            "DeviceAllow",
            vec![
                ("/dev/kvm".into(), "rw".into()),
                ("/dev/net/tun".into(), "rw".into()),
            ],
        ),
    ]
}

/// The unit of kvirt's capability probe.
pub const PROBE_UNIT: &str = "kvirt-probe.service";

/// What the probe's unit needs to know.
#[derive(Clone, Debug)]
pub struct ProbeInput<'a> {
    pub host: &'a HostLayout,
    pub daemon_path: PathBuf,
    /// kvirt's own user, which no VM runs as: what it leaves no VM wrote.
    pub user: &'a str,
    pub slice: &'a str,
}

/// kvirt's own libvirt daemon, run once per kvirtd start to probe QEMU,
/// so each VM starts from a capability cache that no VM wrote. It sees no
/// VM and has no network.
pub fn probe_spec(i: &ProbeInput) -> UnitSpec {
    let s = |v: &std::path::Path| v.display().to_string();
    let (dir, run) = (i.host.probe_dir(), i.host.probe_runtime_dir());
    let mut properties = vec![
        Prop::Str("Description", "kvirt QEMU capability probe".into()),
        Prop::Exec(
            "ExecStart",
            vec![s(&i.daemon_path), "--timeout".into(), "0".into()],
        ),
        Prop::Str("Type", "notify".into()),
        Prop::Str("NotifyAccess", "main".into()),
        Prop::Str("User", i.user.into()),
        Prop::Str("Group", i.user.into()),
        Prop::U32("UMask", 0o077),
        Prop::Strs(
            "Environment",
            vec![
                format!("XDG_RUNTIME_DIR={}", s(&run)),
                format!("XDG_CONFIG_HOME={}", s(&dir.join("config"))),
                format!("XDG_CACHE_HOME={}", s(&dir.join("cache"))),
                format!("HOME={}", s(&dir)),
            ],
        ),
        Prop::Str("Slice", i.slice.into()),
        Prop::Str("CollectMode", "inactive-or-failed".into()),
        Prop::Bool("PrivateNetwork", true),
    ];
    properties.extend(sandbox());
    properties.extend([
        Prop::TmpFs(
            "TemporaryFileSystem",
            vec![
                (s(&i.host.vms_state_dir()), "ro".into()),
                (s(&i.host.vms_runtime_dir()), "ro".into()),
            ],
        ),
        Prop::Strs("ReadWritePaths", vec![s(&dir), s(&run)]),
    ]);
    UnitSpec {
        name: PROBE_UNIT.into(),
        properties,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input<'a>(key: &'a VmKey, paths: &'a VmPaths, host: &'a HostLayout) -> UnitInput<'a> {
        UnitInput {
            key,
            uid: "u-1",
            paths,
            host,
            daemon: DaemonKind::Virtqemud,
            daemon_path: "/usr/sbin/virtqemud".into(),
            user: "kvirt",
            slice: "machine-kvirt.slice",
            memory_max_bytes: 1 << 30,
            cpu_weight: 100,
            cpu_limit_millis: Some(1500),
            tasks_max: 1024,
            grace_seconds: 30,
            extra_rw_paths: vec!["/var/lib/kvirt/images/a.img".into()],
            extra_ro_paths: vec![],
            hidden_roots: vec!["/var/lib/kvirt/images".into(), "/srv/vms".into()],
            devices: Vec::new(),
            allowed_cpus: None,
            shared_disks: false,
        }
    }

    fn find<'a>(u: &'a UnitSpec, name: &str) -> &'a Prop {
        u.properties
            .iter()
            .find(|p| p.name() == name)
            .unwrap_or_else(|| panic!("{name} missing"))
    }

    #[test]
    fn a_dying_daemon_is_restarted_without_its_qemu_but_a_stop_takes_all() {
        let host = HostLayout::default();
        let key = VmKey::new("default", "vm1").unwrap();
        let paths = host.vm(&key);
        let u = unit_spec(&input(&key, &paths, &host));
        assert_eq!(
            find(&u, "KillMode"),
            &Prop::Str("KillMode", "process".into())
        );
        assert_eq!(
            find(&u, "Restart"),
            &Prop::Str("Restart", "on-failure".into())
        );
        let Prop::ExecEx(_, stop, flags) = find(&u, "ExecStopEx") else {
            panic!()
        };
        let script = stop.last().unwrap();
        assert_eq!(stop[..2], ["/bin/sh", "-c"]);
        assert!(script.starts_with("trap '' TERM;"), "{script}");
        assert!(
            script.contains("/usr/sbin/kvirtd --stop-unit-processes && exit 0;"),
            "{script}"
        );
        assert!(
            script.contains(
                "systemctl kill --kill-who=all --signal=SIGTERM kvirt-vm@default_vm1.service"
            ),
            "{script}"
        );
        assert_eq!(flags, &["privileged"]);
    }

    #[test]
    fn unit_runs_the_daemon_unprivileged_in_the_vm_netns() {
        let host = HostLayout::default();
        let key = VmKey::new("default", "vm1").unwrap();
        let paths = host.vm(&key);
        let u = unit_spec(&input(&key, &paths, &host));
        assert_eq!(u.name, "kvirt-vm@default_vm1.service");
        assert_eq!(
            find(&u, "ExecStart"),
            &Prop::Exec(
                "ExecStart",
                vec!["/usr/sbin/virtqemud".into(), "--timeout".into(), "0".into()]
            )
        );
        assert_eq!(find(&u, "User"), &Prop::Str("User", "kvirt".into()));
        assert_eq!(
            find(&u, "NetworkNamespacePath"),
            &Prop::Str(
                "NetworkNamespacePath",
                "/run/netns/kvirt-default_vm1".into()
            )
        );
        assert_eq!(find(&u, "MemoryMax"), &Prop::U64("MemoryMax", 1 << 30));
        assert_eq!(
            find(&u, "CPUQuotaPerSecUSec"),
            &Prop::U64("CPUQuotaPerSecUSec", 1_500_000)
        );
        let Prop::Strs(_, env) = find(&u, "Environment") else {
            panic!()
        };
        assert!(env.contains(&"KVIRT_VMI_UID=u-1".to_string()));
        // A busy PID 1 is never waited for to look up the VM's own user.
        let bypass = env
            .iter()
            .find_map(|e| e.strip_prefix("SYSTEMD_BYPASS_USERDB="))
            .expect("userdb bypass");
        for service in ["io.systemd.DynamicUser", "io.systemd.Multiplexer"] {
            assert!(bypass.split(':').any(|s| s == service), "{bypass}");
        }
        // The runtime directory at a short fixed path too (see `binds`).
        assert!(env.contains(&"XDG_RUNTIME_DIR=/run/kvirt/vms/.run/xdg".to_string()));
    }

    #[test]
    fn unit_sees_only_its_own_directories() {
        let host = HostLayout::default();
        let key = VmKey::new("default", "vm1").unwrap();
        let paths = host.vm(&key);
        let u = unit_spec(&input(&key, &paths, &host));
        let Prop::TmpFs(_, hidden) = find(&u, "TemporaryFileSystem") else {
            panic!()
        };
        assert!(hidden.contains(&("/var/lib/kvirt/vms".into(), "ro".into())));
        assert!(hidden.contains(&("/run/kvirt/vms".into(), "ro".into())));
        // Every hostDisk root is hidden; the VM's own disk is bound in.
        assert!(hidden.contains(&("/var/lib/kvirt/images".into(), "ro".into())));
        assert!(hidden.contains(&("/srv/vms".into(), "ro".into())));
        let Prop::Binds(_, binds) = find(&u, "BindPaths") else {
            panic!()
        };
        assert!(binds.iter().all(|(src, _)| !src.contains("vm2")));
        assert!(binds.contains(&(
            "/var/lib/kvirt/images/a.img".into(),
            "/var/lib/kvirt/images/a.img".into()
        )));
        // kvirt's records of every VM are not even there to try.
        let Prop::Strs(_, records) = find(&u, "InaccessiblePaths") else {
            panic!()
        };
        for r in [
            "-/var/lib/kvirt/identities",
            "-/run/kvirt/manifest-errors",
            "-/var/lib/kvirt/network",
            "-/var/lib/kvirt/grants",
            "-/run/kvirt/status",
            "-/run/kvirt/qemu-log",
            // Nor the journal files the VM's reused number may share.
            "-/var/log/journal",
            "-/run/log/journal",
        ] {
            assert!(records.contains(&r.to_owned()), "{r}: {records:?}");
        }
        // Nothing is shared with other VMs: no capability cache, no group.
        assert!(binds.iter().all(|(src, _)| !src.starts_with("/var/cache")));
        assert_eq!(find(&u, "UMask"), &Prop::U32("UMask", 0o077));
        assert_eq!(
            find(&u, "CapabilityBoundingSet"),
            &Prop::U64("CapabilityBoundingSet", 0)
        );
        assert!(u.properties.iter().all(|p| p.name() != "BindReadOnlyPaths"));
    }

    #[test]
    fn unit_reads_its_own_images_and_no_others() {
        let host = HostLayout::default();
        let key = VmKey::new("default", "vm1").unwrap();
        let paths = host.vm(&key);
        let image = "/var/cache/kvirt/images/sha256/ab12";
        let u = unit_spec(&UnitInput {
            extra_ro_paths: vec![image.into()],
            ..input(&key, &paths, &host)
        });
        // The cache as a whole stays hidden; only this image is bound in.
        let Prop::TmpFs(_, hidden) = find(&u, "TemporaryFileSystem") else {
            panic!()
        };
        assert!(hidden.contains(&("/var/cache/kvirt".into(), "ro".into())));
        assert_eq!(
            find(&u, "BindReadOnlyPaths"),
            &Prop::Binds("BindReadOnlyPaths", vec![(image.into(), image.into())])
        );
    }

    #[test]
    fn a_unit_runs_on_its_cpus_only_when_the_host_places_them() {
        let host = HostLayout::default();
        let key = VmKey::new("default", "vm1").unwrap();
        let paths = host.vm(&key);
        let u = unit_spec(&input(&key, &paths, &host));
        assert!(u.properties.iter().all(|p| p.name() != "AllowedCPUs"));
        let cpus: CpuSet = "1,9".parse().unwrap();
        let u = unit_spec(&UnitInput {
            allowed_cpus: Some(&cpus),
            ..input(&key, &paths, &host)
        });
        assert_eq!(
            find(&u, "AllowedCPUs"),
            &Prop::Bytes("AllowedCPUs", vec![0b10, 0b10])
        );
    }

    #[test]
    fn the_probe_runs_as_kvirt_and_sees_no_vm() {
        let host = HostLayout::default();
        let u = probe_spec(&ProbeInput {
            host: &host,
            daemon_path: "/usr/sbin/virtqemud".into(),
            user: "kvirt",
            slice: "machine-kvirt.slice",
        });
        assert_eq!(u.name, PROBE_UNIT);
        assert_eq!(find(&u, "User"), &Prop::Str("User", "kvirt".into()));
        assert_eq!(
            find(&u, "PrivateNetwork"),
            &Prop::Bool("PrivateNetwork", true)
        );
        let Prop::Strs(_, env) = find(&u, "Environment") else {
            panic!()
        };
        assert!(env.contains(&"XDG_CACHE_HOME=/var/cache/kvirt/probe/cache".to_string()));
        let Prop::TmpFs(_, hidden) = find(&u, "TemporaryFileSystem") else {
            panic!()
        };
        assert!(hidden.contains(&("/var/lib/kvirt/vms".into(), "ro".into())));
        assert_eq!(
            host.probe_capabilities_dir(),
            PathBuf::from("/var/cache/kvirt/probe/cache/libvirt/qemu/cache/capabilities")
        );
    }

    #[test]
    fn cpu_weight_follows_requests() {
        assert_eq!(cpu_weight(None), 100);
        assert_eq!(cpu_weight(Some(1000)), 100);
        assert_eq!(cpu_weight(Some(2500)), 250);
        assert_eq!(cpu_weight(Some(1)), 1);
    }
}
