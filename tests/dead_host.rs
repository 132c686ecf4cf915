//! Tier 3 with the cluster of `cluster.rs`: a host that dies. B's kvirtd
//! frozen (SIGSTOP) and its link to the API server cut, with an `Always`
//! VirtualMachine's VMI on it: A, having seen B's Lease unrenewed for its
//! duration and `node_dead_after_seconds` (10 in the test cluster), fails
//! the VMI (`NodeUnresponsive`), the VM runs again on A, and B, back, tears
//! its stale copy down without touching A's.

mod support;

use std::time::Duration;
use support::{serial, Host};

fn hosts() -> Option<(Host, Host)> {
    Some((
        support::host("KVIRT_K8S_A_PID")?,
        support::host("KVIRT_K8S_B_PID")?,
    ))
}

const WAIT: Duration = Duration::from_secs(60);
const CUT: &str = "nft add table inet kvtest-cut
    nft add chain inet kvtest-cut out '{ type filter hook output priority 0; }'
    nft add rule inet kvtest-cut out ip daddr 10.250.0.1 tcp dport 6443 drop";

fn unit_state(h: &Host, vm: &str) -> String {
    h.ok(&format!(
        "systemctl show -p LoadState --value kvirt-vm@default_{vm}.service"
    ))
}

#[test]
fn a_dead_hosts_vm_runs_again_elsewhere_and_its_stale_copy_goes_when_it_returns() {
    let Some((a, b)) = hosts() else { return };
    let _g = serial();
    let vm = "k-dead";
    a.ok(&format!(
        "kubectl delete vm {vm} --ignore-not-found --wait=false"
    ));
    a.wait(
        "no k-dead left",
        WAIT,
        &format!("! kubectl get vm {vm} 2>/dev/null && ! kubectl get vmi {vm} 2>/dev/null"),
    );
    for h in [&a, &b] {
        h.ok(&format!(
            "cp /srv/guest/run.raw /var/lib/kvirt/images/{vm}.raw"
        ));
    }
    // B alone claims it: A cordoned meanwhile.
    a.ok("kvirtctl drain");
    a.ok(&format!(
        "kubectl apply -f - <<'EOF'\n{}EOF",
        support::vm_manifest(vm, "Always", "  nodeSelector: {zone: z1}\n")
    ));
    a.wait(
        "k-dead Running on node-b",
        Duration::from_secs(120),
        &format!("[ \"$(kubectl get vmi {vm} -o jsonpath='{{.status.phase}} {{.status.nodeName}}')\" = 'Running node-b' ]"),
    );
    a.ok("kvirtctl uncordon");
    let first = a.ok(&format!(
        "kubectl get vmi {vm} -o jsonpath='{{.metadata.uid}}'"
    ));
    assert_eq!(unit_state(&b, vm), "loaded");

    // B dies: its kvirtd frozen, its API server out of reach.
    b.ok(&format!("{CUT}\nsystemctl kill -s STOP kvirtd"));
    a.wait(
        "k-dead made anew and Running on node-a",
        Duration::from_secs(120),
        &format!(
            "[ \"$(kubectl get vmi {vm} -o jsonpath='{{.status.phase}} {{.status.nodeName}}')\" = 'Running node-a' ]"
        ),
    );
    let second = a.ok(&format!(
        "kubectl get vmi {vm} -o jsonpath='{{.metadata.uid}}'"
    ));
    assert_ne!(first, second, "a new VMI, not the old one moved");
    let reasons = a.ok(&format!(
        "kubectl get events --field-selector involvedObject.uid={first} -o jsonpath='{{.items[*].reason}}'"
    ));
    assert!(reasons.contains("NodeUnresponsive"), "{reasons}");
    // Meanwhile B's stale copy still runs (B knows nothing yet).
    assert_eq!(unit_state(&b, vm), "loaded");

    // B is back: it tears its copy down; A's runs on.
    b.ok("nft delete table inet kvtest-cut; systemctl kill -s CONT kvirtd || true");
    b.wait(
        "B's stale copy of k-dead gone",
        Duration::from_secs(120),
        &format!(
            "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{vm}.service)\" = not-found ]"
        ),
    );
    assert_eq!(unit_state(&a, vm), "loaded");
    let now = a.ok(&format!(
        "kubectl get vmi {vm} -o jsonpath='{{.metadata.uid}} {{.status.phase}} {{.status.nodeName}}'"
    ));
    assert_eq!(now, format!("{second} Running node-a"));
    b.wait(
        "B's kvirtd running",
        Duration::from_secs(120),
        "systemctl is-active -q kvirtd",
    );
    a.ok(&format!("kubectl delete vm {vm} --wait=false"));
    a.wait(
        "k-dead gone",
        WAIT,
        &format!("! kubectl get vmi {vm} 2>/dev/null"),
    );
    for h in [&a, &b] {
        h.ok(&format!("rm -f /var/lib/kvirt/images/{vm}.raw"));
    }
}
