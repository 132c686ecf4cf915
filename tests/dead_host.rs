//! Tier 3 with the cluster of `cluster.rs`: a host that dies. B's kvirtd
//! frozen (SIGSTOP) and its link to the API server cut, with two `Always`
//! VirtualMachines' VMIs on it, one on a local disk and one writing a
//! disk both hosts reach (`/srv/shared`, a shared root). B fences: its
//! watchdog restarts the frozen kvirtd, which finds its Lease unrenewed
//! for `node_dead_after_seconds` (40 in the test cluster) less
//! `self_fence_margin_seconds` (5) and kills the VM on the shared disk,
//! not the other. A, having seen B's Lease unrenewed for its duration and
//! 40 s, fails both VMIs (`NodeUnresponsive`), both VMs run again on A,
//! and the guest's own marker on the shared disk shows one writer at a
//! time; B, back, tears its stale copies down without touching A's.

mod support;

use std::time::Duration;
use support::Host;

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

/// The local VM, and the one on the shared disk.
const LOCAL: &str = "k-dead";
const SHARED: &str = "k-fence";
const MARK: &str = "/srv/shared/k-fence-mark.img";

fn unit_state(h: &Host, vm: &str) -> String {
    h.ok(&format!(
        "systemctl show -p LoadState --value kvirt-vm@default_{vm}.service"
    ))
}

fn phase_and_node(vm: &str) -> String {
    format!("kubectl get vmi {vm} -o jsonpath='{{.status.phase}} {{.status.nodeName}}'")
}

/// The VM on the shared disk: its guest (cloud-init's script) writes a
/// record of its own (a random id, a count) into the disk whose first
/// bytes are `KVIRT-MARKER-DISK`, every 200 ms, synced.
fn shared_vm() -> String {
    format!(
        r#"apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {SHARED}, namespace: default}}
spec:
  runStrategy: Always
  template:
    metadata: {{labels: {{app: {SHARED}}}}}
    spec:
      terminationGracePeriodSeconds: 15
      nodeSelector: {{zone: z1}}
      domain:
        memory: {{guest: 128Mi}}
        devices:
          disks:
          - {{name: boot, disk: {{bus: virtio}}}}
          - {{name: mark, disk: {{bus: virtio}}}}
          - {{name: seed, disk: {{bus: virtio}}}}
      volumes:
      - {{name: boot, hostDisk: {{path: /var/lib/kvirt/images/{SHARED}.raw, type: Disk}}}}
      - {{name: mark, hostDisk: {{path: {MARK}, type: Disk}}}}
      - name: seed
        cloudInitNoCloud:
          userData: |
            #!/bin/sh
            for d in /dev/vd?; do
              [ "$(head -c 17 $d)" = KVIRT-MARKER-DISK ] && dev=$d
            done
            id=$(cat /proc/sys/kernel/random/uuid)
            echo "KVIRT-MARKER $id $dev"
            (
              n=0
              while :; do
                n=$((n + 1))
                printf '%-511s\n' "$id $n" | dd of=$dev bs=512 seek=1 conv=notrunc,fsync 2>/dev/null
                sleep 0.2
              done
            ) &
"#
    )
}

/// The marker as read on A every 100 ms: (nanoseconds, guest id, count).
fn marks(a: &Host) -> Vec<(u128, String, u64)> {
    a.ok("cat /root/k-fence-mark.log")
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let t = w.next()?.parse().ok()?;
            let id = w.next()?.to_owned();
            let n = w.next()?.parse().ok()?;
            Some((t, id, n))
        })
        .collect()
}

/// One writer at a time: the first guest's record stops changing before
/// the second's first appears, and never comes back.
fn assert_one_writer_at_a_time(marks: &[(u128, String, u64)]) {
    let mut ids: Vec<&str> = Vec::new();
    for (_, id, _) in marks {
        if ids.last() != Some(&id.as_str()) {
            ids.push(id);
        }
    }
    assert_eq!(ids.len(), 2, "B's guest, then A's, once each: {ids:?}");
    let (b, a) = (ids[0], ids[1]);
    let last_b = marks.iter().filter(|m| m.1 == b).map(|m| m.2).max();
    let b_stopped = marks
        .iter()
        .find(|m| m.1 == b && Some(m.2) == last_b)
        .map(|m| m.0)
        .unwrap();
    let a_started = marks.iter().find(|m| m.1 == a).map(|m| m.0).unwrap();
    assert!(
        b_stopped < a_started,
        "B's guest wrote until {b_stopped}, A's from {a_started}"
    );
    println!(
        "B's guest stopped writing {:.1} s before A's began",
        (a_started - b_stopped) as f64 / 1e9
    );
}

#[test]
fn a_dead_hosts_vms_run_again_elsewhere_once_and_its_stale_copies_go_when_it_returns() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // A run that failed midway left B cut off.
    b.ok("nft delete table inet kvtest-cut 2>/dev/null || true; systemctl kill -s CONT kvirtd || true");
    for vm in [LOCAL, SHARED] {
        a.ok(&format!(
            "kubectl delete vm {vm} --ignore-not-found --wait=false"
        ));
        a.wait(
            &format!("no {vm} left"),
            WAIT,
            &format!("! kubectl get vm {vm} 2>/dev/null && ! kubectl get vmi {vm} 2>/dev/null"),
        );
        for h in [&a, &b] {
            h.ok(&format!(
                "cp /srv/guest/run.raw /var/lib/kvirt/images/{vm}.raw"
            ));
        }
    }
    a.ok(&format!(
        "rm -f {MARK} /root/k-fence-mark.log && truncate -s 1M {MARK} &&
         printf KVIRT-MARKER-DISK | dd of={MARK} conv=notrunc 2>/dev/null"
    ));
    // B alone claims them: A cordoned meanwhile.
    a.ok("kvirtctl drain");
    a.ok(&format!(
        "kubectl apply -f - <<'EOF'\n{}EOF",
        support::vm_manifest(LOCAL, "Always", "  nodeSelector: {zone: z1}\n")
    ));
    a.ok(&format!("kubectl apply -f - <<'EOF'\n{}EOF", shared_vm()));
    for vm in [LOCAL, SHARED] {
        a.wait(
            &format!("{vm} Running on node-b"),
            Duration::from_secs(120),
            &format!("[ \"$({})\" = 'Running node-b' ]", phase_and_node(vm)),
        );
    }
    a.ok("kvirtctl uncordon");
    // The marker as A reads it from the shared disk, every 100 ms.
    a.ok(&format!(
        "systemctl stop kvtest-mark 2>/dev/null || true; systemd-run --unit kvtest-mark --collect sh -c 'while :; do
           echo \"$(date +%s%N) $(dd if={MARK} bs=512 skip=1 count=1 2>/dev/null | tr -d \"\\0\")\"
           sleep 0.1
         done >/root/k-fence-mark.log'"
    ));
    a.wait(
        "B's guest writing its marker",
        support::BOOT,
        "[ \"$(tail -n 1 /root/k-fence-mark.log | wc -w)\" = 3 ]",
    );
    let uid = |vm: &str| {
        a.ok(&format!(
            "kubectl get vmi {vm} -o jsonpath='{{.metadata.uid}}'"
        ))
    };
    let first = [uid(LOCAL), uid(SHARED)];

    // B dies: its kvirtd frozen, its API server out of reach.
    b.ok(&format!("{CUT}\nsystemctl kill -s STOP kvirtd"));
    // Its watchdog restarts kvirtd, which fences before A acts.
    b.wait(
        "B fenced",
        Duration::from_secs(90),
        "systemctl show -p StatusText --value kvirtd | grep -q '^fenced: Lease unrenewed'",
    );
    b.wait(
        "B's QEMU of k-fence gone",
        WAIT,
        // `[,]`: the pattern matches QEMU's arguments, not its own shell.
        &format!("! pgrep -f 'guest=default_{SHARED}[,]'"),
    );
    assert!(
        !b.ok(&format!("pgrep -f 'guest=default_{LOCAL}[,]' || true"))
            .is_empty(),
        "the VM on a local disk is not fenced"
    );
    for vm in [LOCAL, SHARED] {
        a.wait(
            &format!("{vm} made anew and Running on node-a"),
            Duration::from_secs(120),
            &format!("[ \"$({})\" = 'Running node-a' ]", phase_and_node(vm)),
        );
    }
    let second = [uid(LOCAL), uid(SHARED)];
    for i in 0..2 {
        assert_ne!(first[i], second[i], "a new VMI, not the old one moved");
        let reasons = a.ok(&format!(
            "kubectl get events --field-selector involvedObject.uid={} -o jsonpath='{{.items[*].reason}}'",
            first[i]
        ));
        assert!(reasons.contains("NodeUnresponsive"), "{reasons}");
    }
    // Meanwhile B's stale copy on the local disk still runs (B knows
    // nothing yet); the fenced one stays down.
    assert_eq!(unit_state(&b, LOCAL), "loaded");
    a.wait(
        "A's guest writing its marker",
        support::BOOT,
        "[ \"$(tail -n 1 /root/k-fence-mark.log | wc -w)\" = 3 ] && \
         [ \"$(awk 'NF == 3 {print $2}' /root/k-fence-mark.log | uniq | wc -l)\" = 2 ]",
    );

    // B is back: it tears its copies down; A's run on.
    b.ok("nft delete table inet kvtest-cut; systemctl kill -s CONT kvirtd || true");
    for vm in [LOCAL, SHARED] {
        b.wait(
            &format!("B's stale copy of {vm} gone"),
            Duration::from_secs(120),
            &format!(
                "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{vm}.service)\" = not-found ]"
            ),
        );
    }
    b.wait(
        "B's fence record dropped with its VMI",
        WAIT,
        "! ls /run/kvirt/fenced/*.json 2>/dev/null",
    );
    assert!(
        b.ok("journalctl -u kvirtd --no-pager | grep -c 'self-fence: VM on shared disks stopped' || true") != "0",
        "B's journal says it fenced"
    );
    for (i, vm) in [LOCAL, SHARED].iter().enumerate() {
        assert_eq!(unit_state(&a, vm), "loaded");
        let now = a.ok(&format!(
            "kubectl get vmi {vm} -o jsonpath='{{.metadata.uid}} {{.status.phase}} {{.status.nodeName}}'"
        ));
        assert_eq!(now, format!("{} Running node-a", second[i]));
    }
    b.wait(
        "B's kvirtd running and no longer fenced",
        Duration::from_secs(120),
        "systemctl is-active -q kvirtd && ! systemctl show -p StatusText --value kvirtd | grep -q fenced",
    );
    a.ok("systemctl stop kvtest-mark || true");
    assert_one_writer_at_a_time(&marks(&a));
    for vm in [LOCAL, SHARED] {
        a.ok(&format!("kubectl delete vm {vm} --wait=false"));
        a.wait(
            &format!("{vm} gone"),
            WAIT,
            &format!("! kubectl get vmi {vm} 2>/dev/null"),
        );
        for h in [&a, &b] {
            h.ok(&format!("rm -f /var/lib/kvirt/images/{vm}.raw"));
        }
    }
    a.ok(&format!("rm -f {MARK} /root/k-fence-mark.log"));
}
