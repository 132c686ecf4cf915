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
#[test]
fn a_hosts_migration_port_lets_in_its_peers_identity_only() {
    let Some((a, _b)) = hosts() else { return };
    let _g = a.turn();
    a.ok("rm -rf /var/tmp/other-pki && kvirtd --make-api-pki /var/tmp/other-pki >/dev/null");
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
