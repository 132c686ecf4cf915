//! Live migration's tier: two standalone test hosts as two machines would
//! be (each its own network namespace, a bridge between them, one shared
//! directory at `/srv/shared`, one kvirt CA), booted by `tests/run-all`
//! (`kvirt_testhost_pair`), which sets `KVIRT_MIG_A_PID` and
//! `KVIRT_MIG_B_PID`; without them these tests pass vacuously.
//!
//! What migration stands on, on real hosts: the link and the storage, the
//! migration port between two real kvirtds, and the `LiveMigratable`
//! condition as the hosts' configuration makes it.

mod support;

use std::time::Duration;
use support::{vmi_manifest, Host, BOOT};

fn hosts() -> Option<(Host, Host)> {
    Some((
        support::host("KVIRT_MIG_A_PID")?,
        support::host("KVIRT_MIG_B_PID")?,
    ))
}

#[test]
fn the_hosts_have_networks_of_their_own_and_share_only_link_and_storage() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    // Two network namespaces: each host sees only its own address.
    let addrs = |h: &Host| h.ok("ip -4 -o addr show dev mig0 | awk '{print $4}'");
    assert_eq!(addrs(&a), "10.251.0.1/24");
    assert_eq!(addrs(&b), "10.251.0.2/24");
    assert!(!a.succeeds("ip -4 -o addr | grep -q 10.251.0.2/"));
    assert_ne!(
        a.ok("readlink /proc/1/ns/net"),
        b.ok("readlink /proc/1/ns/net")
    );
    // The link carries TCP between them (B's migration port).
    a.ok("timeout 10 bash -c '</dev/tcp/10.251.0.2/8444'");
    // One directory, written on A, read on B at the same path.
    let token = format!("{:?}", std::time::SystemTime::now());
    a.ok(&format!("echo '{token}' > /srv/shared/pair-check"));
    assert_eq!(b.ok("cat /srv/shared/pair-check"), token);
    b.ok("rm /srv/shared/pair-check");
}

/// A's kvirtd identity (its own certificate of the pair's CA) is what B's
/// migration port lets in over the link; a client without one, or with a
/// certificate of another CA, is refused at the handshake and gets no byte.
/// A certificate renewed on B's disk is what B serves from the next
/// connection, its kvirtd not restarted.
#[test]
fn a_hosts_migration_port_lets_in_its_peers_identity_only() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    a.ok("rm -rf /var/tmp/other-pki && kvirtd --make-api-pki /var/tmp/other-pki >/dev/null");
    support::assert_migration_port_lets_in_only(
        &a,
        "10.251.0.2:8444",
        "/etc/kvirt/pki",
        "/var/tmp/other-pki",
    );
    let pid = b.ok("systemctl show -P MainPID kvirtd");
    let fingerprint = "openssl x509 -noout -fingerprint -sha256";
    let served = || {
        a.ok(&format!(
            "timeout 30 openssl s_client -connect 10.251.0.2:8444 \
               -cert /etc/kvirt/pki/api.crt -key /etc/kvirt/pki/api.key </dev/null 2>/dev/null \
             | {fingerprint}"
        ))
    };
    let before = served();
    b.ok("kvirtd --make-api-pki /etc/kvirt/pki >/dev/null");
    let renewed = b.ok(&format!("{fingerprint} -in /etc/kvirt/pki/api.crt"));
    assert_ne!(before, renewed);
    assert_eq!(served(), renewed, "B serves its renewed certificate");
    assert_eq!(b.ok("systemctl show -P MainPID kvirtd"), pid);
    support::assert_migration_port_lets_in_only(
        &a,
        "10.251.0.2:8444",
        "/etc/kvirt/pki",
        "/var/tmp/other-pki",
    );
    a.ok("rm -rf /var/tmp/other-pki");
}

/// With `/srv/shared` a shared root, a VM whose disk is there could move;
/// the same guest on A's own disk could not, and says so.
#[test]
fn a_vm_on_shared_storage_could_migrate_and_one_on_local_storage_could_not() {
    let Some((a, _b)) = hosts() else { return };
    let _g = a.turn();
    a.ok("cp /srv/guest/run.raw /srv/shared/shared-disk.raw");
    let shared = vmi_manifest("shared-disk", "", "", "").replace(
        "/var/lib/kvirt/images/shared-disk.raw",
        "/srv/shared/shared-disk.raw",
    );
    a.put_manifest("shared-disk", "", &shared);
    a.create_vm("local-disk", "run");
    for vm in ["shared-disk", "local-disk"] {
        a.wait_phase(vm, "Running", BOOT);
    }
    let condition = |vm: &str| {
        let st = a.status(vm)["status"].clone();
        st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "LiveMigratable")
            .cloned()
            .unwrap_or_else(|| panic!("no LiveMigratable: {st}"))
    };
    assert_eq!(condition("shared-disk")["status"], "True");
    let local = condition("local-disk");
    assert_eq!(local["status"], "False", "{local}");
    assert_eq!(local["reason"], "DisksNotLiveMigratable", "{local}");
    assert!(
        local["message"]
            .as_str()
            .unwrap()
            .contains("/var/lib/kvirt/images/local-disk.raw"),
        "{local}"
    );
    a.remove_vm_and_wait_gone("shared-disk");
    a.remove_vm_and_wait_gone("local-disk");
    a.ok("rm -f /srv/shared/shared-disk.raw");
    a.wait(
        "nothing left",
        Duration::from_secs(30),
        "! ls /run/kvirt/vms | grep -q disk",
    );
}

/// True on a host that keeps no migration mark.
const NO_MARKS: &str = "[ -z \"$(ls /run/kvirt/migrations)\" ]";

/// A masquerade VM whose disk is on the shared storage, running on `h`.
fn shared_vm(h: &Host, vm: &str) {
    shared_vm_with(h, vm, "");
}

/// [`shared_vm`] with `spec_extra` lines in its spec.
fn shared_vm_with(h: &Host, vm: &str, spec_extra: &str) {
    h.ok(&format!("cp /srv/guest/run.raw /srv/shared/{vm}.raw"));
    let manifest = vmi_manifest(
        vm,
        "",
        &format!("  networks: [{{name: default, pod: {{}}}}]\n{spec_extra}"),
        "      interfaces: [{name: default, masquerade: {}, ports: [{port: 8080}]}]\n",
    )
    .replace(
        &format!("/var/lib/kvirt/images/{vm}.raw"),
        &format!("/srv/shared/{vm}.raw"),
    );
    h.put_manifest(vm, "", &manifest);
    h.wait_phase(vm, "Running", BOOT);
}

/// Moves `vm` from `from` to `to` (its migration port `addr`) and checks
/// the move: the target runs it from a manifest of its own, Running on
/// its node, the guest answering there through its new pod address; the
/// guest counts on from where it was (the same boot: no second READY);
/// the source keeps nothing of it (unit, namespace, lease, rules,
/// manifest, mark).
fn move_and_check(from: &Host, to: &Host, vm: &str, addr: &str, node: &str) {
    from.wait_until("the guest counting", BOOT, || {
        from.guest_counts(vm).len() >= 2
    });
    let before = *from.guest_counts(vm).last().unwrap();
    let out = from.ok(&format!("kvirtctl migrate default/{vm} --to {addr}"));
    // The time and the guest's pause, as the benchmark reads them.
    assert!(
        out.contains("moved to") && out.contains(" s, the guest paused "),
        "{out}"
    );
    to.wait_phase(vm, "Running", BOOT);
    to.wait_until("the VMI's migrationState completed", BOOT, || {
        to.try_status(vm)
            .is_ok_and(|s| s["status"]["migrationState"]["completed"] == true)
    });
    let st = to.status(vm);
    assert_eq!(st["status"]["nodeName"], node, "{st}");
    let ms = &st["status"]["migrationState"];
    assert!(
        ms["targetNode"] == node
            && ms["sourceNode"]
                .as_str()
                .is_some_and(|s| s != node && !s.is_empty())
            && ms["failed"] == false
            && ms["mode"] == "PreCopy"
            && ms["migrationUid"].as_str().is_some_and(|u| !u.is_empty())
            && ms["startTimestamp"].as_str() <= ms["endTimestamp"].as_str(),
        "{ms}"
    );
    to.ok(&format!(
        "grep -q '\"uid\"' /etc/kvirt/vmis.d/default_{vm}.json"
    ));
    to.assert_counts_on(vm, before);
    let ip = st["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_else(|| panic!("no pod address on the target: {st}"))
        .to_owned();
    to.wait(
        "the guest answering through the target",
        Duration::from_secs(60),
        &format!("busybox wget -q -O- -T 5 http://{ip}:8080/ | grep -q 'KVIRT-HELLO 8080'"),
    );
    from.wait_gone(vm);
    from.ok(&format!(
        "! ls /etc/kvirt/vmis.d | grep -q {vm}; {NO_MARKS}"
    ));
    to.ok(NO_MARKS);
}

/// `kvirtctl migrate` moves a running guest on shared storage from A to
/// B and back, live: the same boot of the guest throughout.
#[test]
fn a_running_guest_moves_to_the_other_host_and_back_without_restarting() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "mover");
    move_and_check(&a, &b, "mover", "10.251.0.2:8444", "kvirt-mig-b");
    move_and_check(&b, &a, "mover", "10.251.0.1:8444", "kvirt-mig-a");
    a.ok("rm /etc/kvirt/vmis.d/default_mover.json");
    a.wait_gone("mover");
    a.ok("rm -f /srv/shared/mover.raw");
}

/// Writes `pattern` into the guest's disk whose file is `disk` (in the
/// VM's disks directory) at `at` through `h`'s QEMU, as the guest would:
/// HMP's `qemu-io` on the device the file is attached to, then a flush
/// (qemu-io's own output goes to QEMU's log; only errors come back).
fn guest_writes(h: &Host, vm: &str, disk: &str, pattern: &str, at: &str) {
    let virsh = format!(
        "virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_{vm}/xdg/libvirt/virtqemud-sock' \
           qemu-monitor-command --hmp default_{vm}"
    );
    let out = h.ok(&format!(
        "dev=$({virsh} 'info block' | awk -v d='/{disk} ' 'index($0, d) {{f=1}} f && /Attached to:/ {{print $3; exit}}')
         [ -n \"$dev\" ]
         {virsh} \"qemu-io -d $dev \\\"write -P {pattern} {at} 64k\\\"\"
         {virsh} \"qemu-io -d $dev flush\""
    ));
    assert!(out.trim().is_empty(), "{out}");
}

/// Whether the running VM's disk file `disk` on `h` holds `pattern` at
/// `at`: read over its base, if any, as the guest sees it.
fn disk_holds(h: &Host, vm: &str, disk: &str, pattern: &str, at: &str) -> bool {
    let out = h.sh(&format!(
        "qemu-io -r -U -f qcow2 /var/lib/kvirt/vms/default_{vm}/disks/{disk} \
           -c 'read -P {pattern} {at} 64k'"
    ));
    let said = String::from_utf8_lossy(&out.stdout);
    out.status.success() && said.contains("read 65536/65536") && !said.contains("failed")
}

/// A containerDisk VM with an emptyDisk migrates with both copied: what
/// was written to its overlay and to its empty disk on one host is read
/// back from the other's (the overlay over the image pulled there), A to
/// B and back, the guest never restarting.
#[test]
fn a_container_disk_vm_moves_with_its_overlay_copied_and_back() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    // The same image (the same digest) in each host's own registry.
    let image = "127.0.0.1:5000/kvirt/guest:1";
    a.start_registry("test-registry", 5000, None);
    a.ok(&format!(
        "qemu-img convert -O qcow2 /srv/guest/run.raw /tmp/guest.qcow2
         kvirtctl push-disk {image} /tmp/guest.qcow2
         rm -rf /srv/shared/registry && cp -a /var/lib/test-registry /srv/shared/registry"
    ));
    b.ok("rm -rf /var/lib/test-registry && cp -a /srv/shared/registry /var/lib/test-registry");
    b.start_registry("test-registry", 5000, None);
    a.ok("rm -rf /srv/shared/registry");
    let manifest = support::with_boot_source(
        &vmi_manifest(
            "copied",
            "",
            "  networks: [{name: default, pod: {}}]\n",
            "      - name: scratch\n        disk: {bus: virtio}\n      \
             interfaces: [{name: default, masquerade: {}, ports: [{port: 8080}]}]\n",
        ),
        &format!("containerDisk: {{image: '{image}'}}"),
    ) + "  - name: scratch\n    emptyDisk: {capacity: 64Mi}\n";
    a.put_manifest("copied", "", &manifest);
    a.wait_phase("copied", "Running", BOOT);
    let (boot, scratch) = ("boot.overlay.qcow2", "scratch.qcow2");
    let holds =
        |h: &Host, disk: &str, pattern: &str, at: &str| disk_holds(h, "copied", disk, pattern, at);
    // Written on A (the guest never reads its disks), read back on B.
    guest_writes(&a, "copied", boot, "0x5a", "40M");
    guest_writes(&a, "copied", scratch, "0x3c", "8M");
    assert!(holds(&a, boot, "0x5a", "40M") && !holds(&a, boot, "0xa5", "40M"));
    move_and_check(&a, &b, "copied", "10.251.0.2:8444", "kvirt-mig-b");
    assert!(
        holds(&b, boot, "0x5a", "40M"),
        "the overlay's write made on A is on B"
    );
    assert!(
        holds(&b, scratch, "0x3c", "8M"),
        "the empty disk's write made on A is on B"
    );
    guest_writes(&b, "copied", boot, "0xa5", "44M");
    move_and_check(&b, &a, "copied", "10.251.0.1:8444", "kvirt-mig-a");
    assert!(holds(&a, boot, "0x5a", "40M") && holds(&a, boot, "0xa5", "44M"));
    assert!(holds(&a, scratch, "0x3c", "8M"));
    a.ok("rm /etc/kvirt/vmis.d/default_copied.json");
    a.wait_gone("copied");

    // A tag that names another image at the target by now: only the
    // overlay would be copied, over other bytes. Refused; the VM stays.
    let retagged = "127.0.0.1:5000/kvirt/guest:2";
    a.ok(&format!("kvirtctl push-disk {retagged} /tmp/guest.qcow2"));
    b.ok(&format!(
        "qemu-img convert -O qcow2 /srv/guest/poweroff.raw /tmp/other.qcow2
         kvirtctl push-disk {retagged} /tmp/other.qcow2"
    ));
    a.put_manifest(
        "retagged",
        "",
        &support::with_boot_source(
            &vmi_manifest("retagged", "", "", ""),
            &format!("containerDisk: {{image: '{retagged}'}}"),
        ),
    );
    a.wait_phase("retagged", "Running", BOOT);
    let out = a.sh("kvirtctl migrate default/retagged --to 10.251.0.2:8444");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("lies over"), "{err}");
    assert_eq!(a.phase("retagged").as_deref(), Some("Running"));
    b.wait_gone("retagged");
    b.ok(NO_MARKS);
    a.ok(NO_MARKS);
    a.remove_vm_and_wait_gone("retagged");
    // B pulled the image once and let go of the VM's overlay.
    b.ok("! ls /var/lib/kvirt/vms | grep -q copied");
}

/// A commit whose answer was lost, at a target that restarted since it
/// took the VM on: the source, its mark and the VM's manifest kept (as
/// such a loss leaves them), tries again on its own; the target knows
/// the VM it runs by its VMI's uid and says so; the source lets go
/// without a restart of its own, never starting the VM; it runs once.
#[test]
fn a_commit_whose_answer_was_lost_is_retried_until_the_source_lets_go() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "lost");
    move_and_check(&a, &b, "lost", "10.251.0.2:8444", "kvirt-mig-b");
    let manifest = b.ok("cat /etc/kvirt/vmis.d/default_lost.json");
    let uid = b.status("lost")["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    // B forgets what it committed; A is put back as the loss left it: the
    // mark first (A never starts a VM it marked as leaving), then the
    // manifest.
    kill_kvirtd(&b);
    a.ok(&format!(
        "mkdir -p -m 700 /run/kvirt/migrations
         printf '%s' '{{\"migrationUid\":\"answer-lost\",\"role\":\"outgoing\",\"vmiUid\":\"{uid}\",\"peer\":\"10.251.0.2:8444\"}}' \
           >/run/kvirt/migrations/default_lost.json
         chmod 600 /run/kvirt/migrations/default_lost.json
         cat >/etc/kvirt/vmis.d/default_lost.json <<'EOF'
{manifest}
EOF"
    ));
    a.wait(
        "A letting go: its manifest and mark gone",
        Duration::from_secs(120),
        &format!("[ ! -e /etc/kvirt/vmis.d/default_lost.json ] && {NO_MARKS}"),
    );
    a.ok("journalctl -u kvirtd -o cat | grep -q 'ended at the target'");
    runs_exactly_once(&b, &a, "lost");
    b.ok("rm /etc/kvirt/vmis.d/default_lost.json");
    b.wait_gone("lost");
    a.ok("rm -f /srv/shared/lost.raw");
}

/// A VM whose disk only its host reaches is refused with its condition's
/// reason; it runs on where it was, and neither host keeps anything of
/// the attempt.
#[test]
fn a_vm_that_cannot_migrate_is_refused_and_runs_on() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    a.create_vm("stayer", "run");
    a.wait_phase("stayer", "Running", BOOT);
    let out = a.sh("kvirtctl migrate default/stayer --to 10.251.0.2:8444");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("DisksNotLiveMigratable"), "{err}");
    assert_eq!(a.phase("stayer").as_deref(), Some("Running"));
    a.ok(&format!(
        "{NO_MARKS} && test -f /etc/kvirt/vmis.d/stayer.yaml"
    ));
    b.ok(&format!(
        "{NO_MARKS} && ! systemctl -q is-active kvirt-vm@default_stayer"
    ));
    a.remove_vm_and_wait_gone("stayer");
}

/// A VMI deleted while it migrates stops everywhere, as in KubeVirt: the
/// source aborts the migration before it shuts the guest down (its
/// daemon would not under a running job), the target, told, tears down
/// what it prepared, and the migration ends failed; neither host starts
/// the VM again or keeps anything of it.
#[test]
fn a_vm_deleted_while_it_migrates_stops_on_both_hosts() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "deleted");
    start_slow_migration(&a, &b, "deleted", "10.251.0.2:8444");
    a.ok("rm /etc/kvirt/vmis.d/deleted.yaml");
    a.wait(
        "kvirtctl migrate to end",
        BOOT,
        "! systemctl -q is-active kvirt-test-migrate",
    );
    a.ok("! journalctl -u kvirtd -o cat | grep -q 'default/deleted moved to'");
    for h in [&a, &b] {
        h.wait_gone("deleted");
        h.wait("no mark left", Duration::from_secs(60), NO_MARKS);
        h.ok("[ ! -e /etc/kvirt/vmis.d/default_deleted.json ]");
    }
    a.ok("journalctl -u kvirtd -o cat | grep -q 'its migration is aborted first'");
    a.ok("rm -f /srv/shared/deleted.raw");
}

/// `kvirtctl drain` of a host with three VMs: the two whose
/// evictionStrategy lets them migrate (`LiveMigrate`,
/// `LiveMigrateIfPossible`) move to the other host live, the
/// VirtualMachine whose strategy is `None` is stopped; the host ends
/// empty and cordoned (across a restart): a migration to it is refused
/// until `kvirtctl uncordon`.
#[test]
fn kvirtctl_drain_moves_what_may_migrate_and_stops_the_rest() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm_with(&a, "dr-live", "  evictionStrategy: LiveMigrate\n");
    shared_vm_with(
        &a,
        "dr-maybe",
        "  evictionStrategy: LiveMigrateIfPossible\n",
    );
    a.put_manifest(
        "dr-vm",
        "run",
        &support::vm_manifest("dr-vm", "Always", "  evictionStrategy: None\n"),
    );
    for vm in ["dr-live", "dr-maybe", "dr-vm"] {
        a.wait_phase(vm, "Running", BOOT);
    }
    for vm in ["dr-live", "dr-maybe"] {
        a.wait_until("the guest counting", BOOT, || a.guest_counts(vm).len() >= 2);
    }
    let out = a.ok("kvirtctl drain --to 10.251.0.2:8444");
    assert!(
        out.matches(" moved to 10.251.0.2:8444").count() == 2
            && out.contains("VirtualMachine default/dr-vm stopped")
            && out.contains("drained: no VM runs here"),
        "{out}"
    );
    for vm in ["dr-live", "dr-maybe"] {
        b.wait_phase(vm, "Running", BOOT);
        a.wait_gone(vm);
    }
    a.wait_gone("dr-vm");
    a.ok("test -f /etc/kvirt/vmis.d/dr-vm.yaml && test -f /var/lib/kvirt/cordoned");
    // Cordoned, across a restart: nothing arrives.
    kill_kvirtd(&a);
    let refused = b.sh("kvirtctl migrate default/dr-live --to 10.251.0.1:8444");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("cordoned"),
        "{err}"
    );
    b.ok(&format!(
        "systemctl -q is-active kvirt-vm@default_dr-live && {NO_MARKS}"
    ));
    a.ok(&format!(
        "{NO_MARKS} && ! systemctl -q is-active kvirt-vm@default_dr-live"
    ));
    a.wait(
        "systemctl status kvirtd saying so",
        Duration::from_secs(30),
        "systemctl show -P StatusText kvirtd | grep -q 'cordoned (kvirtctl uncordon)'",
    );
    assert!(a.ok("kvirtctl uncordon").contains("uncordoned"));
    a.ok("test ! -e /var/lib/kvirt/cordoned");
    a.wait(
        "the status line without the cordon",
        Duration::from_secs(30),
        "! systemctl show -P StatusText kvirtd | grep -q cordoned",
    );
    move_and_check(&b, &a, "dr-live", "10.251.0.1:8444", "kvirt-mig-a");
    a.ok("rm /etc/kvirt/vmis.d/default_dr-live.json");
    a.wait_gone("dr-live");
    b.ok("rm /etc/kvirt/vmis.d/default_dr-maybe.json");
    b.wait_gone("dr-maybe");
    a.remove_vm_and_wait_gone("dr-vm");
    a.ok("rm -f /srv/shared/dr-live.raw /srv/shared/dr-maybe.raw");
}

/// A migration that does not end in time is aborted
/// (`migration.timeout_seconds`): once for a guest too slow to move in it
/// (1 MiB/s), once with the hosts' link cut midway (nothing moves; the
/// source's timer ends it; the link back, the target tears down what it
/// prepared). Each time the VM runs on at the source exactly once, its
/// `migrationState` says it failed, and the target keeps nothing.
#[test]
fn a_migration_that_does_not_end_in_time_or_loses_its_link_fails_and_the_vm_stays() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "late");
    a.ok(
        "printf '[migration]\\ntimeout_seconds = 8\\n' >/etc/kvirt/kvirtd.toml.d/70-short.toml
          systemctl restart kvirtd",
    );
    a.wait_phase("late", "Running", BOOT);
    let slow = a.sh("kvirtctl migrate default/late --to 10.251.0.2:8444 --bandwidth 1");
    let err = String::from_utf8_lossy(&slow.stderr);
    assert!(
        !slow.status.success()
            && err.contains("default/late stays here")
            && err.contains("the migration did not end within 8 s"),
        "{err}"
    );
    runs_exactly_once(&a, &b, "late");
    let failed = |a: &Host| {
        a.wait_until("the VMI's migrationState failed", BOOT, || {
            a.try_status("late").is_ok_and(|s| {
                let ms = &s["status"]["migrationState"];
                ms["failed"] == true && ms["completed"] == false
            })
        })
    };
    failed(&a);
    // The link cut while the guest's memory is on its way.
    start_slow_migration(&a, &b, "late", "10.251.0.2:8444");
    b.ok("ip link set mig0 down");
    a.wait(
        "kvirtctl migrate to give up",
        BOOT,
        "! systemctl -q is-active kvirt-test-migrate",
    );
    b.ok("ip link set mig0 up");
    runs_exactly_once(&a, &b, "late");
    failed(&a);
    a.ok("rm /etc/kvirt/kvirtd.toml.d/70-short.toml && systemctl restart kvirtd");
    a.remove_vm_and_wait_gone("late");
    a.ok("rm -f /srv/shared/late.raw");
}

/// Starts `kvirtctl migrate` of `vm` from `from` to `addr` throttled to
/// 1 MiB/s, in a unit of its own (it outlives this call), and waits until
/// the guest's memory is on its way: the target's QEMU listens for it.
fn start_slow_migration(from: &Host, to: &Host, vm: &str, addr: &str) {
    from.ok(&format!(
        "systemctl reset-failed kvirt-test-migrate 2>/dev/null || true
         systemd-run --unit=kvirt-test-migrate --collect \
           kvirtctl migrate default/{vm} --to {addr} --bandwidth 1"
    ));
    to.wait(
        "the target's QEMU listening for the guest's memory",
        BOOT,
        &format!("[ -S /run/kvirt/vms/default_{vm}/migration/memory.sock ]"),
    );
}

/// Kills `h`'s kvirtd (SIGKILL) and waits for systemd to start it again.
fn kill_kvirtd(h: &Host) {
    let before = h.ok("systemctl show -P MainPID kvirtd");
    h.ok("systemctl kill -s KILL kvirtd");
    h.wait_new_kvirtd("SIGKILL", "MainPID", &before);
}

/// The guest runs exactly once across the two hosts: one QEMU of it, on
/// `on`, Running there, never booted twice; `off` keeps nothing of it.
fn runs_exactly_once(on: &Host, off: &Host, vm: &str) {
    on.wait_phase(vm, "Running", BOOT);
    off.wait(
        "the other host's unit gone",
        Duration::from_secs(120),
        &format!("! systemctl -q is-active kvirt-vm@default_{vm}"),
    );
    off.wait_gone(vm);
    assert_eq!(
        on.ok(&format!("pgrep -fc '[q]emu-system.*guest=default_{vm},'")),
        "1"
    );
    for h in [on, off] {
        h.wait("no migration mark left", BOOT, NO_MARKS);
    }
    let before = on.guest_counts(vm).last().copied().unwrap_or(0);
    on.wait_until("the guest counting on", BOOT, || {
        on.guest_counts(vm).last().is_some_and(|&c| c > before)
    });
    let boots = on.ok(&format!(
        "grep -ac KVIRT-GUEST-READY /run/kvirt/vms/default_{vm}/console.log || true"
    ));
    assert!(boots == "0" || boots == "1", "booted {boots} times here");
}

/// The source kvirtd killed while the guest's memory is on its way: the
/// new kvirtd finds its mark and finishes the migration one way or the
/// other (here: the job aborted, the target told, the VM stays); the guest
/// runs exactly once, and neither host keeps a mark.
#[test]
fn the_source_kvirtd_killed_midway_leaves_the_guest_running_once() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "src-killed");
    start_slow_migration(&a, &b, "src-killed", "10.251.0.2:8444");
    kill_kvirtd(&a);
    // Settled when neither host keeps a mark; then one host has it.
    a.wait_until("the migration settled", Duration::from_secs(180), || {
        [&a, &b].iter().all(|h| h.succeeds(NO_MARKS))
    });
    let (on, off) = if a.succeeds("systemctl -q is-active kvirt-vm@default_src-killed") {
        (&a, &b)
    } else {
        (&b, &a)
    };
    runs_exactly_once(on, off, "src-killed");
    on.ok("rm -f /etc/kvirt/vmis.d/src-killed.yaml /etc/kvirt/vmis.d/default_src-killed.json");
    on.wait_gone("src-killed");
    a.ok("rm -f /srv/shared/src-killed.raw");
}

/// The target kvirtd killed while the guest's memory is on its way: the
/// tunnel goes with it, the migration fails, the VM runs on at the
/// source, and the target, started again, tears down what it prepared.
/// (Before that, a second migration of the VM while one runs is refused.)
#[test]
fn the_target_kvirtd_killed_midway_leaves_the_guest_at_the_source() {
    let Some((a, b)) = hosts() else { return };
    let _g = a.turn();
    shared_vm(&a, "dst-killed");
    start_slow_migration(&a, &b, "dst-killed", "10.251.0.2:8444");
    let second = a.sh("kvirtctl migrate default/dst-killed --to 10.251.0.2:8444");
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && err.contains("another migration"),
        "{err}"
    );
    kill_kvirtd(&b);
    a.wait(
        "kvirtctl migrate to give up",
        BOOT,
        "! systemctl -q is-active kvirt-test-migrate",
    );
    runs_exactly_once(&a, &b, "dst-killed");
    a.ok("test -f /etc/kvirt/vmis.d/dst-killed.yaml");
    a.wait_until("the VMI's migrationState failed", BOOT, || {
        a.try_status("dst-killed").is_ok_and(|s| {
            let ms = &s["status"]["migrationState"];
            ms["failed"] == true && ms["completed"] == false && ms["failureReason"].is_string()
        })
    });
    a.remove_vm_and_wait_gone("dst-killed");
    a.ok("rm -f /srv/shared/dst-killed.raw");
}
