//! kvirt as a package on a host: installed from its .deb with apt on a
//! booted test host of its own (`KVIRT_PKG_PID`, set by tests/run-all),
//! observed the way an operator would (systemctl, machinectl, journalctl,
//! the metrics endpoint), upgraded under a running VM, removed and purged.
//! The .rpm cannot be installed here: its contents and metadata are checked
//! with rpm's own queries. Without the variables these tests say so and
//! pass vacuously.

mod support;

use std::process::Command;
use std::time::Duration;
use support::{Host, BOOT};

fn host() -> Option<Host> {
    support::host("KVIRT_PKG_PID")
}

fn metrics(h: &Host) -> String {
    h.ok("busybox wget -q -O - http://127.0.0.1:9477/metrics")
}

/// The highest `systemd-analyze security` exposure the per-VM unit may
/// have; README.md records the score and what keeps it from being lower.
const VM_UNIT_EXPOSURE_MAX: f64 = 2.0;

#[test]
fn installed_observed_upgraded_removed_and_purged_as_a_package() {
    let Some(h) = host() else { return };
    let next = std::env::var("KVIRT_DEB_NEXT").expect("KVIRT_DEB_NEXT with KVIRT_PKG_PID");

    // Installed by apt, enabled and running with its STATUS= line.
    h.ok("dpkg -s kvirt | grep -q '^Status: install ok installed'");
    h.ok("systemctl is-enabled -q kvirtd");
    h.wait(
        "kvirtd reporting its VMs",
        Duration::from_secs(30),
        "systemctl status kvirtd --no-pager | grep -q 'Status: \"0 VMs\"'",
    );
    assert_eq!(h.ok("getent passwd kvirt | cut -d: -f6"), "/var/lib/kvirt");
    assert!(h
        .ok("man -w kvirtd 2>/dev/null || ls /usr/share/man/man8/kvirtd.8.gz")
        .contains("kvirtd.8"));
    // The man pages point to the manual, which is installed beside them.
    for page in ["man8/kvirtd.8.gz", "man1/kvirtctl.1.gz"] {
        let see_also = h.ok(&format!("zcat /usr/share/man/{page} | grep -A2 'SEE ALSO'"));
        assert!(
            see_also.contains("/usr/share/doc/kvirt"),
            "{page}: {see_also}"
        );
    }
    for page in manual_pages() {
        h.ok(&format!("test -s /usr/share/doc/kvirt/docs/{page}"));
    }

    h.create_vm("pkg", "run");
    h.wait_phase("pkg", "Running", BOOT);
    h.wait(
        "STATUS= counting the running VM",
        Duration::from_secs(10),
        "systemctl status kvirtd --no-pager | grep -q 'Status: \"1 VMs: 1 Running\"'",
    );
    let qemu = h.qemu_pid("pkg");

    // machined knows the VM, with its unit and leader.
    h.wait(
        "the VM registered with machined",
        Duration::from_secs(20),
        "machinectl list --no-legend | grep -q '^default.pkg *vm *kvirt'",
    );
    let machine = h.ok("machinectl status default.pkg --no-pager");
    assert!(
        machine.contains("Unit: kvirt-vm@default_pkg.service"),
        "{machine}"
    );
    assert!(machine.contains(&format!("Leader: {qemu}")), "{machine}");

    // Logs: QEMU's under the VM's unit, kvirtd's lines about it by field.
    h.wait(
        "QEMU's log in the VM unit's journal",
        Duration::from_secs(20),
        "journalctl -u kvirt-vm@default_pkg --no-pager -o cat | grep -q 'guest=default_pkg'",
    );
    let by_field = h.ok("journalctl KVIRT_VM=default/pkg --no-pager -o cat");
    assert!(by_field.contains("default/pkg: "), "{by_field}");
    let own = h.ok("journalctl -u kvirtd --no-pager -o cat");
    assert!(own.contains("ready"), "{own}");

    // Metrics: the running VM, its start, nothing failed.
    let m = metrics(&h);
    assert!(m.contains("kvirt_vms{phase=\"Running\"} 1"), "{m}");
    assert!(m.contains("kvirt_vm_start_duration_seconds_count 1"), "{m}");
    assert!(!m.contains("kvirt_reconcile_errors_total{"), "{m}");

    // The VM's unit is sandboxed as README.md says.
    let exposure: f64 = h
        .ok("systemd-analyze security --no-pager kvirt-vm@default_pkg.service | sed -n 's/.*Overall exposure level for [^:]*: \\([0-9.]*\\) .*/\\1/p'")
        .parse()
        .expect("an exposure figure");
    assert!(
        exposure <= VM_UNIT_EXPOSURE_MAX,
        "exposure {exposure} > {VM_UNIT_EXPOSURE_MAX}"
    );

    // The watchdog is armed and fed while the loop turns; nothing restarted.
    assert_eq!(h.ok("systemctl show -P WatchdogUSec kvirtd"), "30s");
    let fed = h.ok("systemctl show -P WatchdogTimestampMonotonic kvirtd");
    h.wait(
        "a watchdog ping",
        Duration::from_secs(10),
        &format!("[ \"$(systemctl show -P WatchdogTimestampMonotonic kvirtd)\" != {fed} ]"),
    );
    assert_eq!(h.ok("systemctl show -P NRestarts kvirtd"), "0");

    // A configuration mistake: kvirtd says where, is not restarted in a
    // loop, and the VM runs on meanwhile.
    h.ok("printf '[vm]\\ntask_max = 3\\n' > /etc/kvirt/kvirtd.toml.d/90-typo.toml");
    assert!(!h.succeeds("systemctl restart kvirtd"));
    assert_eq!(h.ok("systemctl show -P ExecMainStatus kvirtd"), "78");
    let status = h.ok("systemctl status kvirtd --no-pager || true");
    assert!(
        status.contains("90-typo.toml: unknown field `task_max`"),
        "{status}"
    );
    assert_eq!(h.ok("systemctl show -P NRestarts kvirtd"), "0");
    assert_eq!(h.qemu_pid("pkg"), qemu);
    h.ok("rm /etc/kvirt/kvirtd.toml.d/90-typo.toml");
    h.restart_kvirtd();

    // Upgrade under the running VM: kvirtd restarts, the VM does not.
    let invocation = h.ok("systemctl show -P InvocationID kvirtd");
    let copy = Command::new("bash")
        .args([
            "-c",
            &format!(
                "source tests/testhost/lib.sh && th_copy_in kvirt-pkg {next} /root/kvirt-next.deb"
            ),
        ])
        .status()
        .unwrap();
    assert!(copy.success());
    h.ok("DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/kvirt-next.deb");
    assert!(h
        .ok("dpkg -s kvirt | sed -n 's/^Version: //p'")
        .ends_with("-2"));
    h.wait_new_kvirtd("the upgrade", "InvocationID", &invocation);
    assert_eq!(h.qemu_pid("pkg"), qemu, "the upgrade restarted the VM");
    h.wait(
        "the upgraded kvirtd adopting the VM",
        Duration::from_secs(20),
        "busybox wget -q -O - http://127.0.0.1:9477/metrics | grep -q 'kvirt_adoptions_total{result=\"adopted\"} 1'",
    );
    assert_eq!(h.status("pkg")["status"]["phase"], "Running");

    // Removal stops kvirtd cleanly and leaves the VM running (reinstalling
    // adopts it); purge removes it and everything kvirt made, and gives
    // back the hostDisk it was lent (a hard link keeps the file to look at
    // once /var/lib/kvirt is gone: `+` in `ls -l` is an ACL).
    h.ok("ln /var/lib/kvirt/images/pkg.raw /root/pkg-disk.raw");
    let acl_mark = "ls -l /root/pkg-disk.raw | cut -c11";
    assert_eq!(h.ok(acl_mark), "+", "the VM's disk is lent by an ACL");
    h.ok("DEBIAN_FRONTEND=noninteractive apt-get remove -y -q kvirt");
    assert!(!h.succeeds("systemctl is-active -q kvirtd"));
    let log = h.ok("journalctl -u kvirtd --no-pager -o cat -n 20");
    assert!(log.contains("SIGTERM: exiting; VMs keep running"), "{log}");
    assert!(!log.contains("Main process exited, code=killed"), "{log}");
    assert_eq!(h.qemu_pid("pkg"), qemu);
    h.ok("test -e /etc/kvirt/kvirtd.toml && test -d /var/lib/kvirt");

    h.ok("DEBIAN_FRONTEND=noninteractive apt-get purge -y -q kvirt");
    h.ok("! dpkg -s kvirt 2>/dev/null | grep -q '^Status: .* installed'");
    for gone in [
        "/etc/kvirt",
        "/var/lib/kvirt",
        "/var/cache/kvirt",
        "/run/kvirt",
    ] {
        h.ok(&format!("test ! -e {gone}"));
    }
    h.ok("! pgrep qemu-system");
    h.ok("! ls /run/userdb/kvirt-vm-* 2>/dev/null");
    h.ok("! find /run/userdb -lname 'kvirt-vm-*' 2>/dev/null | grep -q .");
    h.ok("[ \"$(systemctl show -P LoadState kvirt-vm@default_pkg.service)\" = not-found ]");
    h.ok("! ip netns list | grep -q kvirt-");
    h.ok("! ip link show kvirt0 2>/dev/null");
    h.ok("! nft list table ip kvirt 2>/dev/null");
    h.ok("! nft list table bridge kvirt 2>/dev/null");
    h.ok("! machinectl list --no-legend | grep -q default.pkg");
    assert_eq!(h.ok(acl_mark), "", "the purge gave the disk back");
    h.ok("rm /root/pkg-disk.raw");
}

fn run(cmd: &str) -> String {
    let out = Command::new("bash").args(["-c", cmd]).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The manual's pages, as the tree has them (`docs/*.md`).
fn manual_pages() -> impl Iterator<Item = String> {
    let mut pages: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .collect();
    pages.sort();
    assert!(pages.len() >= 10, "{pages:?}");
    pages.into_iter()
}

#[test]
fn the_rpm_carries_the_same_files_and_declares_its_dependencies() {
    let (Ok(rpm), Ok(deb)) = (std::env::var("KVIRT_RPM"), std::env::var("KVIRT_DEB")) else {
        eprintln!("skipped: no packages in $KVIRT_RPM/$KVIRT_DEB (run tests/run-all)");
        return;
    };
    let files = run(&format!("rpm -qlp {rpm}"));
    let deb_files = run(&format!(
        "dpkg-deb -c {deb} | awk '{{print $6}}' | sed 's|^\\.||'"
    ));
    for f in [
        "/usr/sbin/kvirtd",
        "/usr/bin/kvirtctl",
        "/usr/lib/systemd/system/kvirtd.service",
        "/usr/lib/systemd/system/machine-kvirt.slice",
        "/usr/lib/sysusers.d/kvirt.conf",
        "/usr/lib/tmpfiles.d/kvirt.conf",
        "/etc/kvirt/kvirtd.toml",
        "/usr/share/kvirt/kubernetes/crd.yaml",
        "/usr/share/kvirt/kubernetes/rbac.yaml",
        "/usr/share/kvirt/kubernetes/api.yaml",
        "/usr/share/kvirt/kubernetes/network-attachment-definition-crd.yaml",
        "/usr/share/man/man8/kvirtd.8.gz",
        "/usr/share/man/man1/kvirtctl.1.gz",
        "/usr/share/doc/kvirt/README.md",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(manual_pages().map(|p| format!("/usr/share/doc/kvirt/docs/{p}")))
    {
        let f = f.as_str();
        assert!(
            files.lines().any(|l| l == f),
            "{f} not in the rpm:\n{files}"
        );
        assert!(
            deb_files.lines().any(|l| l == f),
            "{f} not in the deb:\n{deb_files}"
        );
    }
    let config = run(&format!("rpm -qcp {rpm}"));
    assert_eq!(config.trim(), "/etc/kvirt/kvirtd.toml");
    let requires = run(&format!("rpm -qRp {rpm}"));
    for dep in [
        "libvirt-daemon-driver-qemu",
        "qemu-kvm-core",
        "nftables",
        "iproute",
        "xorriso",
        "systemd",
        "libvirt.so.0()(64bit)",
        // Each VM's user is a userdb record, which nss-systemd serves.
        "libnss_systemd.so.2()(64bit)",
    ] {
        assert!(
            requires.lines().any(|l| l.trim() == dep),
            "{dep} not required:\n{requires}"
        );
    }
    let scripts = run(&format!("rpm -qp --scripts {rpm}"));
    for want in [
        "systemd-sysusers /usr/lib/sysusers.d/kvirt.conf",
        "preset kvirtd.service",
        "try-restart kvirtd.service",
        "disable --now kvirtd.service",
        "/etc/nsswitch.conf",
    ] {
        assert!(scripts.contains(want), "{want} missing:\n{scripts}");
    }
    // Its nsswitch.conf step, run on a copy: passwd and group come to ask
    // nss-systemd, once, and nothing else changes.
    let nss_step = scripts
        .split("if [ -f /etc/nsswitch.conf ]; then")
        .nth(1)
        .and_then(|rest| rest.split("\nfi\n").next())
        .expect("the rpm's %post takes care of nsswitch.conf");
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nsswitch.conf");
    std::fs::write(&conf, "passwd:  files\ngroup:   files\nshadow:  files\n").unwrap();
    let step = format!("if true; then{nss_step}\nfi\n")
        .replace("/etc/nsswitch.conf", &conf.display().to_string());
    for _ in 0..2 {
        run(&format!(
            "PATH=/usr/bin:/bin sh -c '{}'",
            step.replace('\'', "'\\''")
        ));
    }
    assert_eq!(
        std::fs::read_to_string(&conf).unwrap(),
        "passwd:  files systemd\ngroup:   files systemd\nshadow:  files\n"
    );
    let deps = run(&format!("dpkg-deb -f {deb} Depends"));
    for dep in [
        "libvirt-daemon-driver-qemu",
        "nftables",
        "iproute2",
        "xorriso",
        "libvirt0",
        // Each VM's user is a userdb record, which nss-systemd serves.
        "libnss-systemd",
    ] {
        assert!(deps.contains(dep), "{dep} not in Depends: {deps}");
    }
}

#[test]
fn lintian_and_rpmlint_find_nothing_unexplained() {
    let (Ok(rpm), Ok(deb)) = (std::env::var("KVIRT_RPM"), std::env::var("KVIRT_DEB")) else {
        eprintln!("skipped: no packages in $KVIRT_RPM/$KVIRT_DEB (run tests/run-all)");
        return;
    };
    // Errors and warnings fail; the package's lintian overrides and
    // packaging/rpm/rpmlint.toml say why the rest does not apply.
    let lintian = Command::new("lintian")
        .args(["--fail-on", "error,warning", &deb])
        .output()
        .unwrap();
    assert!(
        lintian.status.success(),
        "lintian:\n{}",
        String::from_utf8_lossy(&lintian.stdout)
    );
    let rpmlint = Command::new("rpmlint")
        .args(["-c", "packaging/rpm/rpmlint.toml", &rpm])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&rpmlint.stdout);
    assert!(rpmlint.status.success(), "rpmlint:\n{text}");
    assert!(text.contains("0 errors, 0 warnings"), "rpmlint:\n{text}");
}
