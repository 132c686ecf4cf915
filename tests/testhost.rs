//! Tier 3: kvirtd on a booted systemd test host (see tests/testhost/), with
//! real systemd, libvirt, QEMU (TCG) and kernel namespaces. Run by
//! `tests/run-all`, which boots the host and sets `KVIRT_TESTHOST_PID`;
//! without it these tests say so and pass vacuously (`cargo test` alone).
//!
//! The tests share one host and one kvirtd, so they run one at a time.

mod support;

use std::time::{Duration, Instant};
use support::{Host, BOOT};

fn host() -> Option<Host> {
    support::host("KVIRT_TESTHOST_PID")
}

#[test]
fn a_manifest_becomes_a_running_vm_that_survives_kvirtd_restarts() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("alpha", "run");
    h.wait_phase("alpha", "Running", BOOT);
    // QEMU's own lines (libvirt's command line first) reach the VM's
    // journal within seconds of the start (they once took ~37 s), sent as
    // a process of the VM's unit: against its rate limit, not kvirtd's.
    h.wait(
        "QEMU's lines in alpha's journal",
        Duration::from_secs(15),
        "journalctl _SYSTEMD_UNIT=kvirt-vm@default_alpha.service SYSLOG_IDENTIFIER=qemu -o cat | grep -q qemu-system",
    );

    // The unit is active and is the VM's: its daemon and QEMU in its cgroup.
    h.ok("systemctl is-active kvirt-vm@default_alpha");
    let status = h.ok("systemctl status --no-pager --lines=0 kvirt-vm@default_alpha || true");
    assert!(status.contains("qemu-system"), "{status}");
    assert!(status.contains("machine-kvirt.slice"), "{status}");
    let pid = h.qemu_pid("alpha");
    let cgroup = h.ok(&format!("cat /proc/{pid}/cgroup"));
    assert!(
        cgroup.contains("kvirt-vm@default_alpha.service"),
        "{cgroup}"
    );
    // QEMU runs in the VM's own network namespace, as the VM's own user.
    h.ok(&format!(
        "[ \"$(stat -L -c %i /run/netns/kvirt-default_alpha)\" = \"$(stat -L -c %i /proc/{pid}/ns/net)\" ]"
    ));
    let user = h.ok("systemctl show -p User --value kvirt-vm@default_alpha");
    assert!(user.starts_with("kvirt-vm-"), "{user}");
    assert_eq!(h.ok(&format!("stat -c %U /proc/{pid}")), user);
    // The unit carries the VM's limits: guest memory plus the overhead.
    assert_eq!(
        h.ok("systemctl show -p MemoryMax --value kvirt-vm@default_alpha"),
        ((128u64 + 256) << 20).to_string()
    );
    // The guest agent's channel is there, and the test guest's agent on it
    // shows in the status as KubeVirt's does: AgentConnected, guestOSInfo.
    h.ok("[ -S /run/kvirt/vms/default_alpha/qga.sock ]");
    h.wait(
        "alpha's guest agent in its status",
        Duration::from_secs(60),
        "grep -q '\"prettyName\": \"kvirt test guest 1\"' /run/kvirt/status/default_alpha.json",
    );
    let st = h.status("alpha")["status"].clone();
    let agent = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "AgentConnected")
        .cloned();
    assert_eq!(
        agent.map(|c| c["status"].clone()),
        Some("True".into()),
        "{st}"
    );
    assert_eq!(st["guestOSInfo"]["id"], "kvirt-test", "{st}");
    // Its disk is a hostDisk on this host alone: it could not migrate, and
    // says why as KubeVirt does.
    let migratable = st["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "LiveMigratable")
        .cloned()
        .unwrap_or_default();
    assert_eq!(migratable["status"], "False", "{st}");
    assert_eq!(migratable["reason"], "DisksNotLiveMigratable", "{st}");
    assert!(st["guestOSInfo"]["kernelRelease"].is_string(), "{st}");
    // QEMU's capabilities, probed by kvirt's own daemon as kvirt's user
    // (no VM runs as it); each VM starts from a copy of its own.
    h.wait(
        "the capability probe",
        Duration::from_secs(60),
        "ls /var/cache/kvirt/probe/cache/libvirt/qemu/cache/capabilities/*.xml",
    );
    h.ok("ls /var/lib/kvirt/vms/default_alpha/cache/libvirt/qemu/cache/capabilities/*.xml");
    h.console_shows("alpha", "KVIRT-GUEST");
    let node = h.ok("hostname");
    assert_eq!(h.status("alpha")["status"]["nodeName"], node.as_str());
    let ls = h.ok("kvirtctl ls");
    assert!(
        ls.lines()
            .any(|l| l.contains("alpha") && l.contains("Running") && l.contains(&node)),
        "{ls}"
    );
    let transitions = h.status("alpha")["status"]["phaseTransitionTimestamps"].clone();
    assert_eq!(
        transitions.as_array().map(Vec::len),
        Some(2),
        "{transitions}"
    );

    // Restarted, then killed: the VM never notices.
    h.restart_kvirtd();
    assert_eq!(h.qemu_pid("alpha"), pid);
    let main_pid = h.ok("systemctl show -p MainPID --value kvirtd");
    h.ok("systemctl kill -s KILL kvirtd");
    h.wait_new_kvirtd("SIGKILL", "MainPID", &main_pid);
    assert_eq!(h.qemu_pid("alpha"), pid, "the VM was restarted");
    let after = h.status("alpha");
    assert_eq!(after["status"]["phase"], "Running");
    assert_eq!(
        after["status"]["phaseTransitionTimestamps"], transitions,
        "status flapped"
    );
    h.console_shows("alpha", "KVIRT-GUEST-ALIVE");

    h.remove_vm_and_wait_gone("alpha");
}

#[test]
fn a_guest_powering_off_is_succeeded_and_its_unit_collected() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("bravo", "poweroff");
    h.wait_phase("bravo", "Succeeded", BOOT);
    h.wait(
        "unit collected",
        Duration::from_secs(20),
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_bravo.service)\" = not-found ]",
    );
    h.ok("[ ! -e /run/netns/kvirt-default_bravo ]");
    let log = h.ok("cat /run/kvirt/vms/default_bravo/console.log");
    assert!(log.contains("KVIRT-GUEST-POWEROFF"), "{log}");
    // What is left is the console's tail, root's: no tmpfs, no identity.
    h.wait(
        "the runtime directory kept as the console's tail",
        Duration::from_secs(20),
        "! mountpoint -q /run/kvirt/vms/default_bravo
         [ \"$(stat -c '%U %a' /run/kvirt/vms/default_bravo)\" = 'root 700' ]
         [ \"$(ls /run/kvirt/vms/default_bravo)\" = console.log ]
         [ $(stat -c %s /run/kvirt/vms/default_bravo/console.log) -le 65536 ]
         ! grep -q default_bravo /var/lib/kvirt/identities/identities.json",
    );
    // Final stays final: no restart on a kvirtd restart.
    h.restart_kvirtd();
    assert_eq!(h.status("bravo")["status"]["phase"], "Succeeded");
    h.ok("! systemctl is-active -q kvirt-vm@default_bravo");
    h.remove_vm_and_wait_gone("bravo");
}

#[test]
fn a_removed_manifest_shuts_the_vm_down_within_its_grace_period() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("charlie", "run");
    h.wait_phase("charlie", "Running", BOOT);
    // Printed once at boot: the serial log has it even if nobody listened.
    h.wait(
        "charlie booted",
        BOOT,
        "grep -q KVIRT-GUEST-READY /run/kvirt/vms/default_charlie/console.log",
    );
    let started = Instant::now();
    h.ok("rm /etc/kvirt/vmis.d/charlie.yaml");
    h.wait_gone("charlie");
    // Grace is 20 s; allow for the unit's stop and polling.
    assert!(
        started.elapsed() < Duration::from_secs(35),
        "{:?}",
        started.elapsed()
    );
    h.ok("rm -f /var/lib/kvirt/images/charlie.raw");
}

#[test]
fn bad_vmis_fail_clearly_while_others_run() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("delta", "run");
    h.put_manifest(
        "bad-field",
        "",
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: bad-field}
spec:
  domain:
    memory: {guest: 64Mi}
    devices: {}
    launchSecurity: {}
",
    );
    h.put_manifest(
        "bad-disk",
        "",
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: bad-disk}
spec:
  domain:
    memory: {guest: 64Mi}
    devices:
      disks: [{name: d, disk: {bus: virtio}}]
  volumes:
  - name: d
    hostDisk: {path: /etc/shadow, type: Disk}
",
    );
    h.wait_phase("bad-field", "Failed", Duration::from_secs(30));
    h.wait_phase("bad-disk", "Failed", Duration::from_secs(30));
    let sync = |vm: &str| {
        let st = h.status(vm);
        let c = st["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Synchronized").cloned())
            .unwrap_or_else(|| panic!("{vm}: no Synchronized condition: {st}"));
        assert_eq!(c["status"], "False", "{c}");
        c["message"].as_str().unwrap_or_default().to_owned()
    };
    let m = sync("bad-field");
    assert!(m.contains("spec.domain.launchSecurity"), "{m}");
    let m = sync("bad-disk");
    assert!(m.contains("spec.volumes[0].hostDisk.path"), "{m}");
    // Nothing of them reached the host.
    h.ok("[ \"$(systemctl show -p LoadState --value kvirt-vm@default_bad-field.service)\" = not-found ]");
    h.ok("[ ! -e /run/netns/kvirt-default_bad-disk ]");
    h.wait_phase("delta", "Running", BOOT);
    // A VM's unit sees its own directories only, not the others'.
    let pid = h.qemu_pid("delta");
    let seen = h.ok(&format!(
        "nsenter -t {pid} -m ls /run/kvirt/vms /var/lib/kvirt/vms"
    ));
    assert!(seen.contains("default_delta"), "{seen}");
    assert!(
        !seen.contains("bad-field") && !seen.contains("bad-disk"),
        "{seen}"
    );
    // Nothing of the bad VMIs was made: only their status exists.
    assert!(h.succeeds("ls /run/kvirt/status | grep -q bad-field"));
    assert!(h.succeeds("! ls /run/kvirt/vms /var/lib/kvirt/vms | grep -q bad-"));
    h.ok("rm /etc/kvirt/vmis.d/bad-field.yaml /etc/kvirt/vmis.d/bad-disk.yaml");
    h.wait_gone("bad-field");
    h.wait_gone("bad-disk");
    h.remove_vm_and_wait_gone("delta");
}

#[test]
fn libvirtd_works_as_the_vms_daemon_too() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok("sed -i 's/^daemon = .*/daemon = \"libvirtd\"/' /etc/kvirt/kvirtd.toml.d/50-test.toml && grep -q 'daemon = \"libvirtd\"' /etc/kvirt/kvirtd.toml.d/50-test.toml");
    h.restart_kvirtd();
    h.create_vm("echo", "run");
    h.wait_phase("echo", "Running", BOOT);
    let exec = h.ok("systemctl show -p ExecStart --value kvirt-vm@default_echo");
    assert!(exec.contains("/libvirtd"), "{exec}");
    h.ok("[ -S /run/kvirt/vms/default_echo/xdg/libvirt/libvirt-sock ]");
    h.console_shows("echo", "KVIRT-GUEST");
    h.remove_vm_and_wait_gone("echo");
    h.ok("sed -i 's/^daemon = .*/daemon = \"virtqemud\"/' /etc/kvirt/kvirtd.toml.d/50-test.toml");
    h.restart_kvirtd();
}

/// A VMI with the pod interface (masquerade) and, when given, its ports.
fn net_vm(h: &Host, vm: &str, ports: &[u16]) {
    let ports = if ports.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = ports.iter().map(|p| format!("{{port: {p}}}")).collect();
        format!(", ports: [{}]", list.join(", "))
    };
    let manifest = support::vmi_manifest(
        vm,
        "",
        "  networks: [{name: default, pod: {}}]\n",
        &format!("      interfaces: [{{name: default, masquerade: {{}}{ports}}}]\n"),
    );
    h.put_manifest(vm, "run", &manifest);
}

fn pod_ip(h: &Host, vm: &str) -> String {
    h.status(vm)["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap_or_else(|| panic!("{vm} has no address: {}", h.status(vm)))
        .to_owned()
}

fn guest_ip_lines(h: &Host, vm: &str) -> usize {
    h.ok(&format!(
        "grep -c KVIRT-GUEST-IP /run/kvirt/vms/default_{vm}/console.log || true"
    ))
    .parse()
    .unwrap_or(0)
}

fn http(h: &Host, from_netns: Option<&str>, ip: &str, port: u16) -> bool {
    let prefix = from_netns.map_or(String::new(), |n| format!("ip netns exec {n} "));
    h.succeeds(&format!(
        "{prefix}busybox wget -q -O- -T 5 http://{ip}:{port}/ | grep -q 'KVIRT-HELLO {port}'"
    ))
}

#[test]
fn vms_get_a_pod_like_network_with_dhcp_and_port_forwarding() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    net_vm(&h, "web", &[8080]);
    net_vm(&h, "any", &[]);
    for vm in ["web", "any"] {
        h.wait_phase(vm, "Running", BOOT);
        h.wait(
            &format!("{vm}'s guest leased its address"),
            BOOT,
            &format!("grep -q KVIRT-GUEST-IP /run/kvirt/vms/default_{vm}/console.log"),
        );
    }
    // The guest got KubeVirt's masquerade address, its router and DNS.
    let lease = h.ok("grep -m1 KVIRT-GUEST-IP /run/kvirt/vms/default_web/console.log");
    assert!(
        lease.contains("KVIRT-GUEST-IP 10.0.2.2 router=10.0.2.1 dns=192.0.2.53 mtu=1500"),
        "{lease}"
    );
    let (web, any) = (pod_ip(&h, "web"), pod_ip(&h, "any"));
    assert_ne!(web, any);
    assert!(
        web.starts_with("10.213.0.") && any.starts_with("10.213.0."),
        "{web} {any}"
    );
    let st = h.status("web");
    assert_eq!(st["status"]["interfaces"][0]["name"], "default");
    h.ok(&format!(
        "ip netns exec kvirt-default_web ip -br addr show eth0 | grep -q {web}/24"
    ));

    // Listed port forwarded, unlisted refused; no ports listed: all forwarded.
    h.wait(
        "web answers on 8080",
        BOOT,
        &format!("busybox wget -q -O- -T 5 http://{web}:8080/"),
    );
    assert!(http(&h, None, &web, 8080));
    assert!(!http(&h, None, &web, 9090), "unlisted port reachable");
    h.wait(
        "any answers",
        BOOT,
        &format!("busybox wget -q -O- -T 5 http://{any}:8080/"),
    );
    assert!(http(&h, None, &any, 8080) && http(&h, None, &any, 9090));
    // Another VM's address is reachable from a VM's network.
    assert!(http(&h, Some("kvirt-default_web"), &any, 9090));

    // kvirtd restarted: the guest keeps its address and renews it (the
    // test config leases for 20 s, so a renewal comes every ~10 s).
    let before = guest_ip_lines(&h, "web");
    h.restart_kvirtd();
    h.wait(
        "the guest renewed its lease from the restarted kvirtd",
        Duration::from_secs(40),
        &format!(
            "[ $(grep -c 'KVIRT-GUEST-IP 10.0.2.2' /run/kvirt/vms/default_web/console.log) -gt {before} ]"
        ),
    );
    assert_eq!(pod_ip(&h, "web"), web);
    assert!(http(&h, None, &web, 8080));

    for vm in ["web", "any"] {
        h.remove_vm_and_wait_gone(vm);
    }
    h.ok("! ip -br link | grep -q '^kv[0-9a-f]\\{12\\}'");
}

/// The test host's IPv6 VM range (`network.subnet6`, tests/common.sh).
const SUBNET6: &str = "fd00:6b76::";

/// Dual stack, KubeVirt's IPv6 masquerade: the guest leases `fd10:0:2::2`
/// by DHCPv6 (busybox's udhcpc6), reaches the host's IPv6 address with its
/// pod address as the source (NAT), cannot send from another address, and
/// a listed port is forwarded over IPv6 while another is not.
#[test]
fn a_dual_stack_guest_gets_kubevirts_ipv6_by_dhcpv6_and_is_reached_through_nat() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let gw6 = format!("{SUBNET6}1");
    // Counters on the host by ICMPv6 payload length (the ping sizes below
    // plus 8): the guest's own pings, and those from a spoofed address.
    h.ok("nft -f - <<'NFT'\ntable ip6 kvirt_spy6\ndelete table ip6 kvirt_spy6\ntable ip6 kvirt_spy6 {\n  chain pre {\n    type filter hook prerouting priority -300; policy accept;\n    ip6 length 1119 ip6 saddr fd10:0:2::/120 counter\n    ip6 length 1119 counter\n    ip6 length 1230 counter\n  }\n}\nNFT");
    let script = format!(
        "#!/bin/sh\n(\n  i=0; while [ $i -lt 90 ] && ! ping -c 1 -W 1 -s 1111 {gw6} >/dev/null 2>&1; do i=$((i + 1)); sleep 1; done\n  ping -c 3 -s 1111 {gw6} >/dev/null 2>&1 && echo KVIRT-PING6-OK\n  ip -6 addr add fd10:0:2::77/120 dev eth0\n  i=0; while [ $i -lt 10 ] && ip -6 addr show dev eth0 | grep -q tentative; do i=$((i + 1)); sleep 1; done\n  ping -c 3 -s 1222 -I fd10:0:2::77 {gw6} >/dev/null 2>&1 && echo KVIRT-SPOOF6-ANSWERED\n  echo KVIRT-SPOOF6-DONE\n) &\n"
    );
    let user_data: String = script.lines().map(|l| format!("        {l}\n")).collect();
    let manifest = support::vmi_manifest(
        "dual",
        "",
        "  networks: [{name: default, pod: {}}]\n",
        "      - name: cloudinit\n        disk: {bus: virtio}\n      interfaces: [{name: default, masquerade: {}, ports: [{port: 8080}]}]\n",
    ) + "  - name: cloudinit\n    cloudInitNoCloud:\n      userData: |\n"
        + &user_data;
    h.put_manifest("dual", "run", &manifest);
    h.wait_phase("dual", "Running", BOOT);
    // (busybox writes the address out in full)
    h.serial_log_shows(
        "dual",
        "KVIRT-GUEST-DHCP6 fd10:0000:0002:0000:0000:0000:0000:0002",
    );
    // Both pod addresses in the status, IPv4 first; the IPv6 one is the
    // range plus the IPv4 address's host part.
    let pod4 = pod_ip(&h, "dual");
    let last: u8 = pod4.rsplit('.').next().unwrap().parse().unwrap();
    let pod6 = format!("{SUBNET6}{last:x}");
    let st = h.status("dual");
    assert_eq!(
        st["status"]["interfaces"][0]["ipAddresses"],
        serde_json::json!([pod4, pod6]),
        "{st}"
    );
    let eth0 = h.ok("ip netns exec kvirt-default_dual ip -o -6 addr show dev eth0");
    assert!(eth0.contains(&format!("{pod6}/64")), "{eth0}");
    // The namespace's DHCPv6 server is kvirtd's socket on the bridge.
    h.ok("ip netns exec kvirt-default_dual ss -Hluan | grep -q ':547 '");
    h.serial_log_shows("dual", "KVIRT-SPOOF6-DONE");
    let log = h.ok("cat /run/kvirt/vms/default_dual/console.log");
    assert!(log.contains("KVIRT-PING6-OK"), "the guest's pings: {log}");
    assert!(!log.contains("KVIRT-SPOOF6-ANSWERED"), "{log}");
    let count = |rule: &str| -> u64 {
        h.ok(&format!(
            "nft list chain ip6 kvirt_spy6 pre | grep '{rule} counter' | sed 's/.*packets \\([0-9]*\\).*/\\1/'"
        ))
        .parse()
        .unwrap_or_else(|e| panic!("{rule}: {e}"))
    };
    assert!(count("ip6 length 1119") > 0, "the guest's own pings");
    assert_eq!(
        count("ip6 length 1119 ip6 saddr fd10:0:2::/120"),
        0,
        "not masqueraded"
    );
    assert_eq!(
        count("ip6 length 1230"),
        0,
        "the spoofed source reached the host"
    );
    h.ok("nft delete table ip6 kvirt_spy6");
    // Inbound over IPv6: the listed port reaches the guest, another not.
    let url = format!("[{pod6}]");
    assert!(http(&h, None, &url, 8080), "port 8080 over IPv6");
    assert!(!http(&h, None, &url, 9090), "an unlisted port over IPv6");
    h.remove_vm_and_wait_gone("dual");
    // Gone from the host's IPv6 senders with the VM.
    assert!(!h.succeeds(&format!(
        "nft list set bridge kvirt vm_sources6 | grep -q '{pod6}'"
    )));
}

#[test]
fn twenty_vms_come_and_go_leaving_no_network_state_or_open_file() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let mut seen = std::collections::BTreeMap::new();
    let mut files = Vec::new();
    for round in 0..4 {
        let names: Vec<String> = (0..5).map(|i| format!("loop-{round}-{i}")).collect();
        for n in &names {
            net_vm(&h, n, &[]);
        }
        let mut live = std::collections::BTreeSet::new();
        for n in &names {
            h.wait_phase(n, "Running", BOOT);
            let ip = pod_ip(&h, n);
            assert!(live.insert(ip.clone()), "{ip} handed to two live VMs");
            seen.insert(n.clone(), ip);
        }
        if round == 0 {
            // kvirtd runs ahead of the guests (spinning ones starved its
            // restart), and nothing of its VMs inherits that.
            let kvirtd =
                h.ok("awk '{print $19}' /proc/$(systemctl show -p MainPID --value kvirtd)/stat");
            assert_eq!(kvirtd.trim(), "-5");
            let vms = h.ok(
                "for d in /proc/[0-9]*; do case $(cat $d/comm 2>/dev/null) in \
                 qemu-system*|virtqemud) awk '{print $19}' $d/stat;; esac; done | sort -u",
            );
            assert_eq!(vms.trim(), "0", "the nice values of VMs' processes");
        }
        // All five at once, as a user's `kubectl delete` of a set: their
        // grace periods run side by side.
        h.remove_vms_and_wait_gone(&names);
        // kvirtd's open files once the first five went (what it opens
        // once and keeps is open by then) against after the other 15.
        files.push(h.ok("ls /proc/$(systemctl show -p MainPID --value kvirtd)/fd | wc -l"));
    }
    assert_eq!(seen.len(), 20);
    let count = |s: &String| s.parse::<u32>().unwrap();
    assert!(
        count(&files[3]) <= count(&files[0]) + 3,
        "kvirtd's open files after each round of five VMs: {files:?}"
    );
    // Its limit is raised to the hard one (a service gets 1,024, which 250
    // VMs outgrew).
    let limits =
        h.ok("grep 'Max open files' /proc/$(systemctl show -p MainPID --value kvirtd)/limits");
    let nums: Vec<&str> = limits.split_whitespace().skip(3).take(2).collect();
    assert!(
        nums.len() == 2 && nums[0] == nums[1] && nums[0] != "1024",
        "{limits}"
    );
    h.ok("! ip -br link | grep -q '^kv[0-9a-f]\\{12\\}'");
    h.ok("! ip netns list | grep -q kvirt-");
    h.ok("! grep -q '\"ip\"' /var/lib/kvirt/network/leases.json");
    h.ok("[ -z \"$(ls -A /run/kvirt/vms)\" ] && [ -z \"$(ls -A /var/lib/kvirt/vms)\" ]");
}

/// The manifests the host tests write are VMIs kvirt converts (no host needed).
#[test]
fn the_test_manifests_convert() {
    use kvirt::core::convert::{convert, ConvertContext, DomainType};
    let layout = kvirt::core::layout::HostLayout::default();
    let manifests = [
        support::vmi_manifest("plain", "", "", ""),
        support::vmi_manifest(
            "placed",
            "kubevirt.io/nodeName: n1",
            "  nodeSelector: {zone: z1}\n",
            "",
        ),
        support::vmi_manifest(
            "net",
            "",
            "  networks: [{name: default, pod: {}}]\n",
            "      interfaces: [{name: default, masquerade: {}, ports: [{port: 8080}]}]\n",
        ),
    ];
    for m in manifests {
        let mut vmi = kvirt::core::vmi::VirtualMachineInstance::from_yaml(&m)
            .unwrap_or_else(|e| panic!("{e}\n{m}"));
        vmi.metadata.uid = Some("u".into());
        let key = vmi.key().unwrap();
        let paths = layout.vm(&key);
        let ctx = ConvertContext {
            key: &key,
            paths: &paths,
            domain_type: DomainType::Qemu,
            host_disk_roots: &["/var/lib/kvirt/images".into()],
            shared_roots: &[],
            cluster: false,
            capacity: None,
            limits: kvirt::core::convert::Limits::default(),
            claims: &kvirt::core::convert::NO_CLAIMS,
            dedicated_cpus: None,
        };
        let c = convert(&vmi, &ctx).unwrap_or_else(|e| panic!("{e}\n{m}"));
        assert!(c.network.is_some());
    }
}

#[test]
fn cloud_init_and_downward_api_disks_reach_the_guest() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let seed_disk = "      - name: cloudinit\n        disk: {bus: virtio}\n";
    let nocloud = support::vmi_manifest("nocloud", "", "", seed_disk)
        + "  - name: cloudinit\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n        echo KVIRT-CLOUDINIT-$((6 * 7))\n";
    // "#!/bin/sh\necho KVIRT-CONFIGDRIVE-$((6 * 7))\n", and the VMI's
    // name and labels on a downwardAPI disk.
    let config_drive = support::vmi_manifest(
        "configdrive",
        "team: blue",
        "",
        &format!("{seed_disk}      - name: podinfo\n        disk: {{}}\n"),
    ) + "  - name: cloudinit\n    cloudInitConfigDrive:\n      userDataBase64: IyEvYmluL3NoCmVjaG8gS1ZJUlQtQ09ORklHRFJJVkUtJCgoNiAqIDcpKQo=\n"
        + "  - name: podinfo\n    downwardAPI:\n      volumeLabel: PODINFO\n      fields:\n"
        + "      - {path: name, fieldRef: {fieldPath: metadata.name}}\n"
        + "      - {path: labels, fieldRef: {fieldPath: metadata.labels}}\n";
    // KubeVirt's vmi-sata shape: volumes and no disks; each gets a SATA
    // disk (KubeVirt's defaults), booted from and read by the guest.
    let sata = "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: sata}
spec:
  terminationGracePeriodSeconds: 15
  domain:
    memory: {guest: 128Mi}
  volumes:
  - name: boot
    hostDisk: {path: /var/lib/kvirt/images/sata.raw, type: Disk}
  - name: cloudinit
    cloudInitNoCloud:
      userData: |
        #!/bin/sh
        echo KVIRT-SATA-$((6 * 7))
";
    h.put_manifest("nocloud", "run", &nocloud);
    h.put_manifest("configdrive", "run", &config_drive);
    h.put_manifest("sata", "run", sata);
    h.wait_phase("nocloud", "Running", BOOT);
    h.wait_phase("configdrive", "Running", BOOT);
    h.wait_phase("sata", "Running", BOOT);
    h.serial_log_shows("sata", "KVIRT-SATA-42");
    let xml = h.ok(
        "virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_sata/xdg/libvirt/virtqemud-sock' \
         dumpxml default_sata",
    );
    assert_eq!(xml.matches("bus='sata'").count(), 2, "{xml}");
    // The seed is an ISO in the VM's own state directory.
    h.ok("test -f /var/lib/kvirt/vms/default_nocloud/disks/cloudinit.cloud-init.iso");
    h.serial_log_shows("nocloud", "KVIRT-GUEST-SEED cidata meta-data user-data");
    h.serial_log_shows("nocloud", "KVIRT-CLOUDINIT-42");
    h.serial_log_shows("configdrive", "KVIRT-GUEST-SEED config-2 openstack");
    h.serial_log_shows("configdrive", "KVIRT-CONFIGDRIVE-42");
    h.serial_log_shows("configdrive", "KVIRT-GUEST-FILE PODINFO/name configdrive");
    h.serial_log_shows(
        "configdrive",
        "KVIRT-GUEST-FILE PODINFO/labels team=\"blue\"",
    );
    h.remove_vm_and_wait_gone("nocloud");
    h.remove_vm_and_wait_gone("configdrive");
    h.remove_vm_and_wait_gone("sata");
}

#[test]
fn container_disks_kernel_boot_and_ephemeral_volumes_boot_over_read_only_bases() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // A real registry (Debian's docker-registry) on the test host's loopback.
    h.start_registry("test-registry", 5000, None);
    // The test guest as a qcow2 containerDisk, pushed by kvirtctl.
    let image = "127.0.0.1:5000/kvirt/guest:1";
    h.ok(&format!(
        "qemu-img convert -O qcow2 /srv/guest/run.raw /tmp/guest.qcow2
         kvirtctl push-disk {image} /tmp/guest.qcow2"
    ));
    for vm in ["cd1", "cd2"] {
        let manifest = support::with_boot_source(
            &support::vmi_manifest(vm, "", "", ""),
            &format!("containerDisk: {{image: '{image}'}}"),
        );
        h.put_manifest(vm, "", &manifest);
    }
    for vm in ["cd1", "cd2"] {
        h.wait_phase(vm, "Running", BOOT);
        h.serial_log_shows(vm, "KVIRT-GUEST-READY");
    }
    // One copy in the cache, pulled once; each VM writes to its own overlay
    // over it, through a read-only bind of that image only.
    assert_eq!(h.ok("ls -d /var/cache/kvirt/images/repos/*/* | wc -l"), "1");
    let cached = h.ok("ls /var/cache/kvirt/images/repos/*/*/disk/guest.qcow2");
    // The cache is root's; the VMs read their image by grants of their own.
    h.ok(&format!(
        "[ \"$(stat -c %U {cached})\" = root ]
         ! setpriv --reuid=65534 --regid=65534 --clear-groups head -c1 {cached} >/dev/null 2>&1
         ! setpriv --reuid=65534 --regid=65534 --clear-groups ls /var/cache/kvirt/images >/dev/null 2>&1"
    ));
    let said = |what: &str| {
        h.ok(&format!(
            "journalctl -u kvirtd -o cat | grep -o 'default/cd[12]: {what}' | sort -u | wc -l"
        ))
    };
    assert_eq!(said(&format!("pulled {image} (sha256:")), "1");
    assert_eq!(
        said(&format!(
            "{image} (sha256:[0-9a-f]*) is already on the host"
        )),
        "1"
    );
    for vm in ["cd1", "cd2"] {
        let info = h.ok(&format!(
            "qemu-img info -U --output=json /var/lib/kvirt/vms/default_{vm}/disks/boot.overlay.qcow2"
        ));
        let info: serde_json::Value = serde_json::from_str(&info).unwrap();
        assert_eq!(info["full-backing-filename"], cached.as_str(), "{info}");
        assert_eq!(info["backing-filename-format"], "qcow2");
        let binds = h.ok(&format!(
            "systemctl show -p BindReadOnlyPaths --value kvirt-vm@default_{vm}.service"
        ));
        assert!(binds.contains("/var/cache/kvirt/images/repos/"), "{binds}");
    }
    // Direct kernel boot from an image of the same cache: the test guest's
    // kernel and initrd, copied into the VM's own directory.
    let kernel_image = "127.0.0.1:5000/kvirt/kernel:1";
    h.ok(&format!(
        "kvirtctl push-disk {kernel_image} /srv/guest/vmlinuz /srv/guest/initrd.img"
    ));
    h.put_manifest(
        "kb1",
        "",
        &format!(
            "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: kb1
  namespace: default
spec:
  terminationGracePeriodSeconds: 15
  domain:
    memory: {{guest: 128Mi}}
    firmware:
      kernelBoot:
        kernelArgs: console=ttyS0 kvirt.mode=run
        container:
          image: '{kernel_image}'
          kernelPath: /disk/vmlinuz
          initrdPath: /disk/initrd.img
    devices: {{}}
"
        ),
    );
    h.wait_phase("kb1", "Running", BOOT);
    h.serial_log_shows("kb1", "KVIRT-GUEST-READY");
    let user = h.ok("systemctl show -p User --value kvirt-vm@default_kb1");
    assert!(user.starts_with("kvirt-vm-"), "{user}");
    assert_eq!(
        h.ok("stat -c '%U %a' /var/lib/kvirt/vms/default_kb1/disks/kernel"),
        format!("{user} 640")
    );
    assert_eq!(h.ok("ls -d /var/cache/kvirt/images/repos/*/* | wc -l"), "2");

    // An ephemeral volume: the same overlay, over a hostDisk that is only read.
    h.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/golden.raw
          chmod 0644 /var/lib/kvirt/images/golden.raw
          sha256sum /var/lib/kvirt/images/golden.raw >/tmp/golden.sum");
    let manifest = support::with_boot_source(
        &support::vmi_manifest("eph1", "", "", ""),
        "ephemeral: {hostDisk: {path: /var/lib/kvirt/images/golden.raw, type: Disk}}",
    );
    h.put_manifest("eph1", "", &manifest);
    h.wait_phase("eph1", "Running", BOOT);
    h.serial_log_shows("eph1", "KVIRT-GUEST-READY");
    let info = h.ok(
        "qemu-img info -U --output=json /var/lib/kvirt/vms/default_eph1/disks/boot.overlay.qcow2",
    );
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["full-backing-filename"], "/var/lib/kvirt/images/golden.raw",
        "{info}"
    );
    assert_eq!(info["backing-filename-format"], "raw");
    h.remove_vm_and_wait_gone("eph1");
    h.ok("sha256sum -c --quiet /tmp/golden.sum && rm /var/lib/kvirt/images/golden.raw /tmp/golden.sum");

    // The VMs go, their overlays with them; the cached images stay.
    h.remove_vm_and_wait_gone("cd1");
    h.remove_vm_and_wait_gone("cd2");
    h.remove_vm_and_wait_gone("kb1");
    h.ok(&format!("test -f {cached}"));
    h.ok("systemctl stop test-registry; rm -rf /var/lib/test-registry /tmp/guest.qcow2");
}

#[test]
fn efi_guests_boot_through_ovmf_and_secure_boot_refuses_an_unsigned_loader() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // The test guest's disk has an unsigned GRUB as its removable-media
    // loader: plain OVMF boots it; Secure Boot (the default, as in KubeVirt)
    // refuses it, which shows its keys are enrolled and enforced. One at a
    // time: OVMF under TCG is slow enough alone.
    let efi = |vm: &str, efi: &str| {
        support::vmi_manifest(vm, "", "", "").replace(
            "    memory: {guest: 128Mi}\n",
            // GRUB loads the kernel and initrd into memory OVMF has left
            // free: 128Mi is too little.
            &format!(
                "    memory: {{guest: 256Mi}}\n    firmware: {{bootloader: {{efi: {efi}}}}}\n"
            ),
        )
    };
    let shows = |vm: &str, marker: &str| {
        h.wait(
            &format!("{marker} in {vm}'s serial log"),
            Duration::from_secs(240),
            &format!("grep -qF -- '{marker}' /run/kvirt/vms/default_{vm}/console.log"),
        )
    };
    let qemu = |vm: &str| h.ok(&format!("tr '\\0' ' ' </proc/{}/cmdline", h.qemu_pid(vm)));

    h.put_manifest("efisb", "run", &efi("efisb", "{}"));
    h.wait_phase("efisb", "Running", BOOT);
    let sb = qemu("efisb");
    assert!(
        sb.contains("OVMF_CODE_4M.ms.fd") || sb.contains("OVMF_CODE_4M.secboot.fd"),
        "{sb}"
    );
    assert!(sb.contains("smm=on"), "{sb}");
    shows("efisb", "Access Denied");
    h.remove_vm_and_wait_gone("efisb");

    h.put_manifest("efi", "run", &efi("efi", "{secureBoot: false}"));
    h.wait_phase("efi", "Running", BOOT);
    let plain = qemu("efi");
    assert!(plain.contains("OVMF_CODE_4M.fd"), "{plain}");
    // The variables are the VM's own copy, in its own state directory.
    let vars = h.ok("find /var/lib/kvirt/vms/default_efi -name '*VARS*'");
    assert!(!vars.is_empty(), "no NVRAM file of the VM's own");
    shows("efi", "KVIRT-GUEST-READY");
    h.remove_vm_and_wait_gone("efi");
    assert!(
        h.succeeds("[ ! -e /var/lib/kvirt/efi-vars/default_efi ]"),
        "variables kept for a VM that did not ask"
    );

    // Persistent variables: what the firmware wrote in one run (its boot
    // entries) is kept when the VM goes and is there from the next start.
    let template = "/usr/share/OVMF/OVMF_VARS_4M.fd";
    let kept = "/var/lib/kvirt/efi-vars/default_efip/VARS.fd";
    let nvram = "/var/lib/kvirt/vms/default_efip/config/libvirt/qemu/nvram/default_efip_VARS.fd";
    let manifest = efi("efip", "{secureBoot: false, persistent: true}");
    h.put_manifest("efip", "run", &manifest);
    h.wait_phase("efip", "Running", BOOT);
    shows("efip", "KVIRT-GUEST-READY");
    h.remove_vm_and_wait_gone("efip");
    assert!(
        h.succeeds(&format!("! cmp -s {kept} {template}")),
        "nothing kept"
    );
    let first = h.ok(&format!("sha256sum <{kept}"));
    h.put_manifest("efip", "run", &manifest);
    h.wait_phase("efip", "Running", BOOT);
    // Never the template: it started from the kept copy.
    assert!(h.succeeds(&format!("! cmp -s {nvram} {template}")));
    assert!(h.succeeds(&format!(
        "[ -f {kept} ] && [ \"$(stat -c %a {kept})\" = 600 ]"
    )));
    shows("efip", "KVIRT-GUEST-READY");
    h.remove_vm_and_wait_gone("efip");
    assert!(h.succeeds(&format!("[ -f {kept} ]")), "{first}");
    h.ok("rm -r /var/lib/kvirt/efi-vars/default_efip");
}

/// Hugepages reserved on this machine's kernel (the test host shares it)
/// for one test; the count before comes back when it ends.
struct ReservedHugepages {
    before: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const HUGEPAGES_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB";

fn read_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// 2 MiB pages nobody has: free and not reserved by a mapping.
fn available_2m() -> u64 {
    read_u64(&format!("{HUGEPAGES_2M}/free_hugepages"))
        - read_u64(&format!("{HUGEPAGES_2M}/resv_hugepages"))
}

impl ReservedHugepages {
    fn more(pages: u64) -> Self {
        let before = read_u64(NR_HUGEPAGES);
        std::fs::write(NR_HUGEPAGES, (before + pages).to_string()).unwrap();
        assert_eq!(
            read_u64(NR_HUGEPAGES),
            before + pages,
            "the kernel could not set aside {pages} hugepages"
        );
        Self { before }
    }
}

impl Drop for ReservedHugepages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

#[test]
fn hugepages_back_a_guest_and_a_vm_that_does_not_fit_fails_with_why() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let _pages = ReservedHugepages::more(64);
    let available = available_2m();
    assert!(available >= 64, "{available}");
    let hp = |vm: &str, guest: &str| {
        support::vmi_manifest(vm, "", "", "").replace(
            "    memory: {guest: 128Mi}\n",
            &format!("    memory: {{guest: {guest}, hugepages: {{pageSize: 2Mi}}}}\n"),
        )
    };
    // 128Mi is 64 pages of 2 MiB.
    h.put_manifest("hp", "run", &hp("hp", "128Mi"));
    h.wait_phase("hp", "Running", BOOT);
    h.serial_log_shows("hp", "KVIRT-GUEST-READY");
    let cmdline = h.ok(&format!("tr '\\0' ' ' </proc/{}/cmdline", h.qemu_pid("hp")));
    assert!(
        cmdline.contains("\"mem-path\":\"/dev/hugepages/kvirt/default_hp/"),
        "{cmdline}"
    );
    assert_eq!(
        available_2m(),
        available - 64,
        "the guest's pages are taken"
    );
    // Hugepages are not charged to the memory cgroup: the unit's limit is
    // the overhead alone.
    assert_eq!(
        h.ok("systemctl show -p MemoryMax --value kvirt-vm@default_hp"),
        (256u64 << 20).to_string()
    );

    // More than is left: the VM fails with the reason, nothing of it stays.
    let left = available_2m();
    h.put_manifest("hp2", "run", &hp("hp2", &format!("{}Mi", 2 * (left + 1))));
    h.wait_phase("hp2", "Failed", BOOT);
    let reason = h.status("hp2").to_string();
    assert!(
        reason.contains(&format!(
            "{} hugepages of 2 MiB are needed and {left} are free",
            left + 1
        )),
        "{reason}"
    );
    assert!(h.succeeds("[ ! -e /dev/hugepages/kvirt/default_hp2 ]"));

    h.remove_vm_and_wait_gone("hp2");
    h.remove_vm_and_wait_gone("hp");
    assert!(h.succeeds("[ ! -e /dev/hugepages/kvirt/default_hp ]"));
    assert_eq!(available_2m(), available, "the pages are back");
}

// ------------------------------------------------------------------ hostile
//
// The guest is hostile, and after an escape it runs as its QEMU: these tests
// act as a VM's QEMU would, from inside its unit's namespaces with its uid.

/// Runs `script` as VM `vm`'s QEMU would: in its mount and network
/// namespaces, as its own user, without capabilities.
fn as_vm(h: &Host, vm: &str, script: &str) -> String {
    let pid = h.qemu_pid(vm);
    h.ok(&format!(
        "uid=$(stat -c %u /proc/{pid})
         nsenter -t {pid} -m -n -S $uid -G $uid -- /bin/busybox sh -c '{}'",
        script.replace('\'', "'\\''")
    ))
}

/// Every line of `out` that says something leaked.
fn leaks(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.starts_with("LEAK")).collect()
}

#[test]
fn a_vm_that_escaped_into_its_qemu_reaches_nothing_of_another() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("ea", "run");
    h.create_vm("eb", "run");
    for vm in ["ea", "eb"] {
        h.wait_phase(vm, "Running", BOOT);
        h.serial_log_shows(vm, "KVIRT-GUEST-READY");
    }
    let b = h.qemu_pid("eb");
    let (ua, ub) = (
        h.ok(&format!("stat -c %U /proc/{}", h.qemu_pid("ea"))),
        h.ok(&format!("stat -c %U /proc/{b}")),
    );
    assert!(
        ua.starts_with("kvirt-vm-") && ub.starts_with("kvirt-vm-") && ua != ub,
        "{ua} {ub}"
    );
    let tries = [
        ("signal B's QEMU", format!("kill -0 {b}")),
        ("B's environment", format!("head -c1 /proc/{b}/environ")),
        ("B's memory", format!("head -c1 /proc/{b}/mem")),
        ("B's open files", format!("ls /proc/{b}/fd")),
        ("B's root", format!("ls /proc/{b}/root/")),
        (
            "B's disk via its root",
            format!("head -c1 /proc/{b}/root/var/lib/kvirt/images/eb.raw"),
        ),
        ("B's disk", "head -c1 /var/lib/kvirt/images/eb.raw".into()),
        ("B's state", "ls /var/lib/kvirt/vms/default_eb".into()),
        (
            "B's overlay or ISOs",
            "ls /var/lib/kvirt/vms/default_eb/disks".into(),
        ),
        (
            "B's console log",
            "head -c1 /run/kvirt/vms/default_eb/console.log".into(),
        ),
        (
            "B's libvirt socket",
            "ls /run/kvirt/vms/default_eb/xdg".into(),
        ),
        ("the system bus", "busctl --system list --no-pager".into()),
        (
            "the probe's capability cache",
            "ls /var/cache/kvirt/probe".into(),
        ),
        (
            "a write to the capability cache",
            "touch /var/cache/kvirt/probe/cache/x".into(),
        ),
        // kvirt's records name every tenant of the host.
        (
            "the host's VM identities",
            "head -c1 /var/lib/kvirt/identities/identities.json".into(),
        ),
        (
            "the host's address leases",
            "ls /var/lib/kvirt/network".into(),
        ),
        ("the hostDisk grants", "ls /var/lib/kvirt/grants".into()),
        ("other VMs' log positions", "ls /run/kvirt/qemu-log".into()),
        ("the VMs' status", "ls /run/kvirt/status".into()),
    ];
    let script: String = tries
        .iter()
        .map(|(what, cmd)| format!("if {cmd} >/dev/null 2>&1; then echo \"LEAK {what}\"; fi\n"))
        .collect();
    // What A may do, so the attempts above are known to run as A, in A.
    let own = "if [ \"$(ls /var/lib/kvirt/images/)\" != ea.raw ]; then echo LEAK other hostDisks listed; fi
               head -c1 /var/lib/kvirt/images/ea.raw >/dev/null && \
               head -c1 /run/kvirt/vms/default_ea/console.log >/dev/null && \
               [ $(id -u) != 0 ] && echo OWN-OK";
    let out = as_vm(&h, "ea", &format!("{script}{own}"));
    assert!(leaks(&out).is_empty(), "{out}");
    assert!(out.contains("OWN-OK"), "{out}");
    // A local user outside every VM reads none of kvirt's records either;
    // root does, so they are there to be read.
    let records = "/var/lib/kvirt/identities/identities.json /var/lib/kvirt/network/leases.json \
                   /var/lib/kvirt/grants /run/kvirt/qemu-log /run/kvirt/status";
    h.ok(&format!("for f in {records}; do test -e $f; done"));
    let local = h.ok(&format!(
        "for f in {records}; do
           if setpriv --reuid=65534 --regid=65534 --clear-groups \
                sh -c \"if [ -d $f ]; then ls $f; else head -c1 $f; fi\" >/dev/null 2>&1; then
             echo LEAK $f
           fi
         done; echo DONE"
    ));
    assert!(
        leaks(&local).is_empty() && local.contains("DONE"),
        "{local}"
    );
    // Seen but untouchable: without ProtectProc=invisible (it breaks
    // libvirt's check of its client, kvirtd) B's QEMU is listed.
    h.remove_vm_and_wait_gone("ea");
    h.remove_vm_and_wait_gone("eb");
}

#[test]
fn links_and_fifos_a_vm_plants_never_steer_kvirtd() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("pa", "run");
    h.create_vm("pb", "run");
    for vm in ["pa", "pb"] {
        h.wait_phase(vm, "Running", BOOT);
    }
    let fingerprint = "stat -c '%n %u %g %a' /etc /etc/shadow /etc/passwd /etc/kvirt /dev/zero; sha256sum /etc/shadow /etc/passwd";
    let before = h.ok(fingerprint);
    // Everywhere A can write that kvirtd reads or writes: links to root's
    // files and to an endless device, and FIFOs.
    as_vm(
        &h,
        "pa",
        "set -e
         rt=/run/kvirt/vms/default_pa st=/var/lib/kvirt/vms/default_pa
         mv $rt/console.log $rt/console.log.real
         ln -s /etc/shadow $rt/console.log
         ln -s /etc/passwd $rt/console.log.1
         mkfifo $rt/status.json
         for p in $rt/xdg/libvirt/qemu/run/*.pid; do rm -f $p; ln -s /etc/shadow $p; done
         mkdir -p $st/cache/libvirt/qemu/log
         for l in $st/cache/libvirt/qemu/log/*.log; do rm -f $l; mkfifo $l; done
         ln -s /dev/zero $st/cache/libvirt/qemu/log/zero.log
         rm -rf $st/config/libvirt/qemu/nvram
         ln -s /etc $st/config/libvirt/qemu/nvram
         rm -rf $st/cache/libvirt/qemu/cache/capabilities
         ln -s /etc $st/cache/libvirt/qemu/cache/capabilities",
    );
    // Passes of the log forwarder and the console cap; a restart (adoption,
    // status migration); then the VM's teardown.
    h.restart_kvirtd();
    h.wait(
        "kvirtd tried the planted console log",
        Duration::from_secs(30),
        "journalctl -u kvirtd --no-pager -o cat | grep -q 'console log /run/kvirt/vms/default_pa/console.log'",
    );
    h.restart_kvirtd();
    h.wait_phase("pb", "Running", BOOT);
    h.remove_vm_and_wait_gone("pa");
    h.ok("systemctl is-active -q kvirtd");
    assert_eq!(
        h.ok(fingerprint),
        before,
        "root touched a file through a VM's link"
    );
    assert_eq!(h.status("pb")["status"]["phase"], "Running");
    h.remove_vm_and_wait_gone("pb");
}

#[test]
fn a_guest_printing_forever_leaves_its_console_log_at_its_cap() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let seed = "      - name: cloudinit\n        disk: {bus: virtio}\n";
    let manifest = support::vmi_manifest("flood", "", "", seed)
        + "  - name: cloudinit\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n        line=$(printf 'KVIRT-FLOOD-%0240d' 0)\n        ( while :; do echo \"$line\"; done >/dev/console ) &\n";
    h.put_manifest("flood", "run", &manifest);
    h.wait_phase("flood", "Running", BOOT);
    let log = "/run/kvirt/vms/default_flood/console.log";
    h.wait(
        "the console log rotated at its cap",
        Duration::from_secs(300),
        &format!("[ -s {log}.1 ]"),
    );
    const CAP: u64 = 2 << 20;
    // Samples while the guest goes on printing: the log never grows past
    // its cap by more than a second's output (kvirtd looks once a second).
    let mut largest = 0;
    for _ in 0..10 {
        let sizes = h.ok(&format!("stat -c %s {log} {log}.1"));
        let mut s = sizes.lines().map(|l| l.parse::<u64>().unwrap());
        let (now, backup) = (s.next().unwrap(), s.next().unwrap());
        assert!(backup <= CAP, "backup {backup}");
        largest = largest.max(now);
        std::thread::sleep(Duration::from_millis(700));
    }
    assert!(largest <= 2 * CAP, "the log reached {largest} bytes");
    assert!(h
        .ok(&format!("tail -c 300 {log}.1"))
        .contains("KVIRT-FLOOD"));
    h.remove_vm_and_wait_gone("flood");
}

#[test]
fn spoofed_addresses_and_macs_from_a_guest_reach_neither_the_host_nor_another_vm() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    net_vm(&h, "victim", &[]);
    h.wait_phase("victim", "Running", BOOT);
    let victim = pod_ip(&h, "victim");
    // Counters, by packet length (the ping sizes below), on the host and in
    // the victim's namespace: outside kvirt's tables, which it recreates.
    let spy = |netns: &str| {
        let rules: String = [1139, 1250, 1361, 1472, 1583]
            .iter()
            .map(|len| format!("    ip length {len} counter\n"))
            .collect();
        h.ok(&format!(
            "{netns}nft -f - <<'NFT'\ntable ip kvirt_spy {{\n  chain pre {{\n    type filter hook prerouting priority -300; policy accept;\n{rules}  }}\n}}\nNFT"
        ));
    };
    spy("");
    spy("ip netns exec kvirt-default_victim ");
    let count = |netns: Option<&str>, len: u32| -> u64 {
        let prefix = netns.map_or(String::new(), |n| format!("ip netns exec {n} "));
        h.ok(&format!(
            "{prefix}nft list chain ip kvirt_spy pre | grep 'ip length {len} ' | sed 's/.*packets \\([0-9]*\\).*/\\1/'"
        ))
        .parse()
        .unwrap()
    };
    // The hostile guest: legit pings first (they must arrive), then from
    // another pod's address, then with another MAC.
    let script = format!(
        "#!/bin/sh\n(\n  while ! ip addr show eth0 | grep -q 'inet 10.0.2.2'; do sleep 1; done\n  ping -c 3 -s 1111 10.213.0.1 >/dev/null 2>&1\n  ping -c 3 -s 1444 {victim} >/dev/null 2>&1\n  ip addr add 10.213.0.99/32 dev eth0\n  ping -c 3 -s 1222 -I 10.213.0.99 10.213.0.1 >/dev/null 2>&1\n  ping -c 3 -s 1222 -I 10.213.0.99 {victim} >/dev/null 2>&1\n  ip link set eth0 down\n  ip link set eth0 address 02:de:ad:be:ef:01\n  ip link set eth0 up\n  ip route add default via 10.0.2.1 2>/dev/null\n  ping -c 3 -s 1333 10.213.0.1 >/dev/null 2>&1\n  ping -c 3 -s 1555 {victim} >/dev/null 2>&1\n  echo KVIRT-SPOOF-DONE\n) &\n"
    );
    let user_data: String = script.lines().map(|l| format!("        {l}\n")).collect();
    let seed = "      - name: cloudinit\n        disk: {bus: virtio}\n";
    let manifest = support::vmi_manifest(
        "spoofer",
        "",
        "  networks: [{name: default, pod: {}}]\n",
        &format!("{seed}      interfaces: [{{name: default, masquerade: {{}}}}]\n"),
    ) + "  - name: cloudinit\n    cloudInitNoCloud:\n      userData: |\n"
        + &user_data;
    h.put_manifest("spoofer", "run", &manifest);
    h.wait_phase("spoofer", "Running", BOOT);
    h.serial_log_shows("spoofer", "KVIRT-SPOOF-DONE");
    // 1111 and 1444 byte pings (IP lengths 1139 and 1472) are the guest's
    // own: they arrive, so the counters count.
    assert!(count(None, 1139) > 0, "the guest's own pings to the host");
    assert!(
        count(Some("kvirt-default_victim"), 1472) > 0,
        "its own to the victim"
    );
    for (netns, len) in [
        (None, 1250),
        (Some("kvirt-default_victim"), 1250),
        (None, 1361),
        (Some("kvirt-default_victim"), 1583),
    ] {
        assert_eq!(
            count(netns, len),
            0,
            "spoofed ({len} bytes) reached {netns:?}"
        );
    }
    h.ok("nft delete table ip kvirt_spy");
    h.remove_vm_and_wait_gone("spoofer");
    h.remove_vm_and_wait_gone("victim");
}

/// The unit's main process: the VM's libvirt daemon.
fn daemon_pid(h: &Host, vm: &str) -> String {
    h.ok(&format!("systemctl show -P MainPID kvirt-vm@default_{vm}"))
}

/// A process of the VM's unit other than its daemon (what an escaped QEMU
/// is: the VM's user, in the VM's unit) takes the daemon's socket. kvirtd,
/// root, checks who listens before it speaks: it says nothing to it, and
/// once the daemon's socket is back the VM is as it was.
#[test]
fn a_listener_planted_for_the_vms_daemon_is_never_spoken_to() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("mole", "run");
    h.wait_phase("mole", "Running", BOOT);
    let qemu = h.qemu_pid("mole");
    let dir = "/run/kvirt/vms/default_mole/xdg/libvirt";
    let uid = h.ok("stat -c %u /run/kvirt/vms/default_mole");
    let cgroup = h.ok("systemctl show -P ControlGroup kvirt-vm@default_mole");
    h.ok(&format!(
        "mv {dir}/virtqemud-sock {dir}/real-sock; rm -f /tmp/heard"
    ));
    // socat, moved into the VM's unit, then as the VM's user.
    // (On a hybrid host, into the unit's cgroup of each hierarchy.) The
    // script waits for the socket: until socat has left the script's own
    // transient unit, the end of that unit would take it along.
    h.ok(&format!(
        "(for d in /sys/fs/cgroup/systemd /sys/fs/cgroup/unified /sys/fs/cgroup; do [ -e $d{cgroup}/cgroup.procs ] && echo $BASHPID > $d{cgroup}/cgroup.procs; done; exec setpriv --reuid={uid} --regid={uid} --clear-groups socat -u UNIX-LISTEN:{dir}/virtqemud-sock,fork OPEN:/tmp/heard,creat,append) </dev/null >/dev/null 2>&1 &
         for i in $(seq 100); do [ -S {dir}/virtqemud-sock ] && exit 0; sleep 0.1; done; exit 1"
    ));
    // A new kvirtd connects afresh.
    let since = h.ok("date +%s");
    let main = h.ok("systemctl show -P MainPID kvirtd");
    h.ok("systemctl kill -s KILL kvirtd");
    h.wait_new_kvirtd("SIGKILL", "MainPID", &main);
    // It connects (to learn who listens), sends nothing, and leaves the VM
    // alone as one whose daemon does not answer, saying why.
    h.wait(
        "kvirtd refusing the planted listener",
        Duration::from_secs(60),
        &format!("journalctl -u kvirtd --since @{since} --no-pager | grep -q 'default/mole: the VM.s libvirt daemon does not answer: .*listened on by pid [0-9]*, not the VM.s daemon'"),
    );
    h.ok("[ -e /tmp/heard ] && ! [ -s /tmp/heard ]");
    assert_eq!(h.qemu_pid("mole"), qemu);
    // The daemon's socket back: the same QEMU, Running, as before.
    h.ok(&format!(
        "pkill -x socat; rm -f {dir}/virtqemud-sock; mv {dir}/real-sock {dir}/virtqemud-sock"
    ));
    let main = h.ok("systemctl show -P MainPID kvirtd");
    h.ok("systemctl kill -s KILL kvirtd");
    h.wait_new_kvirtd("SIGKILL", "MainPID", &main);
    // Paused and unpaused through the daemon: kvirtd speaks to it again.
    h.wait(
        "kvirtd speaking to the VM's daemon again",
        Duration::from_secs(60),
        "kvirtctl pause default/mole || kvirtctl pause default/mole 2>&1 | grep -q 'already paused'",
    );
    h.ok("kvirtctl unpause default/mole");
    h.wait_phase("mole", "Running", BOOT);
    assert_eq!(h.qemu_pid("mole"), qemu, "the VM was restarted");
    h.ok("! [ -s /tmp/heard ]");
    h.remove_vm_and_wait_gone("mole");
}

#[test]
fn a_vm_outlives_its_libvirt_daemon_but_not_a_stop_on_purpose() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.create_vm("phoenix", "run");
    h.wait_phase("phoenix", "Running", BOOT);
    h.console_shows("phoenix", "KVIRT-GUEST-ALIVE");
    let (qemu, daemon) = (h.qemu_pid("phoenix"), daemon_pid(&h, "phoenix"));
    let transitions = h.status("phoenix")["status"]["phaseTransitionTimestamps"].clone();
    // QEMU's log in the journal, its command line included, is QEMU's
    // (tagged with its pid), never kvirtd's, which forwards it; the
    // command line (an argument per line) is one entry.
    h.wait(
        "QEMU's command line in the journal as QEMU's",
        Duration::from_secs(30),
        &format!("journalctl -t qemu KVIRT_VM=default/phoenix _PID={qemu} -o cat --no-pager | grep -q -- '-name guest=default_phoenix'"),
    );
    h.ok(&format!(
        "[ \"$(journalctl -t qemu KVIRT_VM=default/phoenix _PID={qemu} -o json --output-fields=MESSAGE --no-pager | grep -- '-name guest=default_phoenix' | grep -c -- '-msg timestamp=on')\" = 1 ]"
    ));
    let kvirtd = h.ok("systemctl show -P MainPID kvirtd");
    h.ok(&format!(
        "! journalctl -t qemu KVIRT_VM=default/phoenix --no-pager | grep -q 'qemu\\[{kvirtd}\\]'"
    ));
    // journald itself places them in the VM's unit, from QEMU's cgroup.
    h.ok("journalctl -t qemu _SYSTEMD_UNIT=kvirt-vm@default_phoenix.service --no-pager | grep -q -- '-name guest=default_phoenix'");

    // The daemon dies hard: systemd starts another in the same unit, and
    // the VM never notices.
    h.ok(&format!("kill -KILL {daemon}"));
    h.wait(
        "the VM's daemon started again",
        Duration::from_secs(60),
        &format!(
            "systemctl is-active -q kvirt-vm@default_phoenix
             [ \"$(systemctl show -P NRestarts kvirt-vm@default_phoenix)\" = 1 ]
             [ \"$(systemctl show -P MainPID kvirt-vm@default_phoenix)\" != {daemon} ]"
        ),
    );
    assert_eq!(h.qemu_pid("phoenix"), qemu, "QEMU was restarted");
    h.wait(
        "kvirtd's Event about it",
        Duration::from_secs(60),
        "journalctl -u kvirtd --no-pager | grep -q 'default/phoenix: .*reason=DaemonRestarted'",
    );
    let st = h.status("phoenix");
    assert_eq!(st["status"]["phase"], "Running");
    assert_eq!(
        st["status"]["phaseTransitionTimestamps"], transitions,
        "status flapped"
    );
    // The guest runs on and the new daemon serves it: its guest agent,
    // then a graceful shutdown asked through it.
    h.console_shows("phoenix", "KVIRT-GUEST-ALIVE");
    h.wait(
        "the agent through the new daemon",
        Duration::from_secs(60),
        "grep -q '\"prettyName\": \"kvirt test guest 1\"' /run/kvirt/status/default_phoenix.json",
    );

    // A stop on purpose takes QEMU with it, cleanly: ExecStop= has
    // systemd signal the whole unit and is not itself among the killed.
    h.ok("systemctl stop kvirt-vm@default_phoenix");
    h.wait(
        "QEMU gone with its unit",
        Duration::from_secs(60),
        &format!("! kill -0 {qemu} 2>/dev/null"),
    );
    h.ok("! journalctl -u kvirt-vm@default_phoenix --no-pager | grep 'Control process exited'");
    // ...by kvirtd through pidfds (`--stop-unit-processes`), not through
    // `systemctl kill` (a client request to systemd: costly for many VMs
    // at once), which is only its fallback.
    h.ok("! journalctl -u kvirt-vm@default_phoenix --no-pager | grep 'on client request'");
    h.wait_phase("phoenix", "Failed", Duration::from_secs(60));
    h.remove_vm_and_wait_gone("phoenix");

    // kvirtd's own teardown, through a restarted daemon: graceful.
    h.create_vm("phoenix", "run");
    h.wait_phase("phoenix", "Running", BOOT);
    h.serial_log_shows("phoenix", "KVIRT-GUEST-READY");
    h.ok(&format!("kill -KILL {}", daemon_pid(&h, "phoenix")));
    h.wait(
        "the VM's daemon started again",
        Duration::from_secs(60),
        "systemctl is-active -q kvirt-vm@default_phoenix
         [ \"$(systemctl show -P NRestarts kvirt-vm@default_phoenix)\" = 1 ]",
    );
    let since = h.ok("date +%s");
    h.remove_vm_and_wait_gone("phoenix");
    let log = h.ok(&format!(
        "journalctl -u kvirtd --no-pager --since @{since} | grep default/phoenix || true"
    ));
    assert!(!log.contains("grace period over"), "{log}");
    // ...and no stop job: kvirtd signals the daemon, which says
    // STOPPING=1 and exits, and systemd sets up no mount namespace for
    // ExecStop=.
    let unit_log = h.ok(&format!(
        "journalctl -u kvirt-vm@default_phoenix --no-pager -o cat --since @{since}"
    ));
    // From the restarted daemon on: `since` has a second's granularity,
    // and the log of the kill just before may share that second.
    let teardown = unit_log
        .rsplit_once("Started kvirt-vm@default_phoenix")
        .map_or(unit_log.as_str(), |(_, after)| after);
    assert!(teardown.contains("Deactivated successfully"), "{unit_log}");
    assert!(!teardown.contains("Stopping kvirt-vm@"), "{unit_log}");
    assert!(!teardown.contains("Failed with result"), "{unit_log}");
}

#[test]
fn a_stopped_libvirt_daemon_holds_up_only_its_own_vm() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // A stopped daemon sends nothing: kvirtd notices it on its next look,
    // the resync (every 5 min by default), shortened here.
    struct Resync<'a>(&'a Host);
    impl Drop for Resync<'_> {
        fn drop(&mut self) {
            self.0.sh(
                "rm -f /etc/kvirt/kvirtd.toml.d/50-test-resync.toml && systemctl restart kvirtd",
            );
        }
    }
    h.ok("mkdir -p /etc/kvirt/kvirtd.toml.d && printf '[source]\nresync_seconds = 20\n' > /etc/kvirt/kvirtd.toml.d/50-test-resync.toml && systemctl restart kvirtd");
    let _resync = Resync(&h);
    h.create_vm("frozen", "run");
    h.wait_phase("frozen", "Running", BOOT);
    let daemon = daemon_pid(&h, "frozen");
    h.ok(&format!("kill -STOP {daemon}"));
    // Undone whatever happens below: a stopped daemon would outlive the test.
    struct Cont<'a>(&'a Host, String);
    impl Drop for Cont<'_> {
        fn drop(&mut self) {
            self.0.sh(&format!("kill -CONT {}", self.1));
        }
    }
    let _cont = Cont(&h, daemon.clone());

    // Another VM comes and goes as usual meanwhile, started no later than
    // one libvirt call timeout (15 s) even though the frozen VM's passes
    // are waiting on theirs.
    let asked = Instant::now();
    h.create_vm("thawed", "run");
    h.wait_phase("thawed", "Running", BOOT);
    assert!(
        asked.elapsed() < Duration::from_secs(15),
        "the other VM took {:?} to run",
        asked.elapsed()
    );
    // Printed once at boot: in the log; its console answers live.
    h.serial_log_shows("thawed", "KVIRT-GUEST-READY");
    h.console_shows("thawed", "KVIRT-GUEST-ALIVE");
    h.remove_vm_and_wait_gone("thawed");

    // The stuck one is reported: not Ready, with why, an Event, and in ls.
    h.wait(
        "frozen reported",
        Duration::from_secs(90),
        "grep -q DaemonUnresponsive /run/kvirt/status/default_frozen.json",
    );
    assert_eq!(h.status("frozen")["status"]["phase"], "Running");
    let ls = h.ok("kvirtctl ls");
    assert!(
        ls.lines()
            .any(|l| l.contains("frozen") && l.contains("False (DaemonUnresponsive)")),
        "{ls}"
    );
    h.ok("journalctl -u kvirtd --no-pager | grep -q 'default/frozen: .*reason=DaemonUnresponsive'");
    h.ok("systemctl is-active -q kvirtd");
    // A kvirtd restart meanwhile: READY (`systemctl restart` of a
    // Type=notify unit returns at READY) waits for no stuck daemon, not
    // even one call timeout (15 s).
    let restarted = Instant::now();
    h.ok("systemctl restart kvirtd");
    assert!(
        restarted.elapsed() < Duration::from_secs(15),
        "READY took {:?} with a stopped daemon",
        restarted.elapsed()
    );

    // Continued, it is Ready again, the same VM.
    let qemu = h.qemu_pid("frozen");
    h.ok(&format!("kill -CONT {daemon}"));
    h.wait(
        "frozen Ready again",
        Duration::from_secs(90),
        "! grep -q DaemonUnresponsive /run/kvirt/status/default_frozen.json",
    );
    assert_eq!(h.qemu_pid("frozen"), qemu);
    h.remove_vm_and_wait_gone("frozen");
}

#[test]
fn kvirtd_is_ready_at_once_while_a_vm_waits_out_its_grace_period() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // A guest that ignores the power button: its deletion waits out the
    // whole grace period.
    let seed = "      - name: cloudinit\n        disk: {bus: virtio}\n";
    let manifest = support::vmi_manifest("stubborn", "", "", seed)
        .replace(
            "terminationGracePeriodSeconds: 15",
            "terminationGracePeriodSeconds: 300",
        )
        + "  - name: cloudinit\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n        killall acpid && echo KVIRT-DEAF\n";
    h.put_manifest("stubborn", "run", &manifest);
    h.wait_phase("stubborn", "Running", BOOT);
    h.serial_log_shows("stubborn", "KVIRT-GUEST-READY");
    h.serial_log_shows("stubborn", "KVIRT-DEAF");
    let since = h.ok("date +%s");
    h.ok("rm /etc/kvirt/vmis.d/stubborn.yaml");
    h.wait(
        "the shutdown under way",
        Duration::from_secs(30),
        &format!(
            "journalctl -u kvirtd --no-pager --since @{since} | grep -q 'default/stubborn: acting.*ShutdownDomain'"
        ),
    );
    // systemctl restart returns once the new kvirtd said READY.
    let took = h
        .ok("s=$(date +%s%N); systemctl restart kvirtd; echo $(( ($(date +%s%N) - s) / 1000000 ))");
    let ms: u64 = took.parse().unwrap();
    eprintln!("kvirtd restarted and READY in {ms} ms during a 300 s grace period");
    assert!(ms < 30_000, "READY waited: {ms} ms");
    // The deletion is still under way. Rather than wait out 300 s, the
    // domain is ended by hand: the new kvirtd finishes the deletion.
    h.ok("systemctl is-active -q kvirt-vm@default_stubborn");
    // (kvirtd stops the unit, daemon and all, as soon as the domain goes:
    // virsh may lose its connection before it reads the answer.)
    h.ok("virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_stubborn/xdg/libvirt/virtqemud-sock' destroy default_stubborn >/dev/null 2>&1 || true");
    h.wait_gone("stubborn");
    h.ok("rm -f /var/lib/kvirt/images/stubborn.raw");
}

#[test]
fn long_names_run_and_what_cannot_fit_is_refused_up_front() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // Long enough that libvirt's monitor socket under the VM's state
    // directory would pass the Unix socket path limit.
    let long = "a-vm-whose-name-is-long-enough-to-matter";
    h.create_vm(long, "run");
    h.wait_phase(long, "Running", BOOT);
    h.serial_log_shows(long, "KVIRT-GUEST-READY");
    h.remove_vm_and_wait_gone(long);

    // As long as Kubernetes allows (a 63-character name; the namespace
    // too, as the converter's tests show): it runs under a shortened id.
    let longest = "l".repeat(63);
    let id = kvirt::core::key::VmKey::new("default", &longest)
        .unwrap()
        .id();
    assert!(id.len() < longest.len(), "{id}");
    h.create_vm(&longest, "run");
    h.wait_phase(&longest, "Running", BOOT);
    h.serial_log_shows(&longest, "KVIRT-GUEST-READY");
    h.ok(&format!("systemctl is-active -q kvirt-vm@{id}.service"));
    assert!(h.ok("kvirtctl ls").contains(&longest));
    h.ok(&format!("rm -f /etc/kvirt/vmis.d/{longest}.yaml"));
    h.wait(
        "the longest VM gone",
        Duration::from_secs(40),
        &format!("[ \"$(systemctl show -p LoadState --value kvirt-vm@{id}.service)\" = not-found ] && [ ! -e /var/lib/kvirt/vms/{id} ]"),
    );
    h.ok(&format!("rm -f /var/lib/kvirt/images/{longest}.raw"));

    // Too large for the host: refused with the limit named, and nothing of
    // it made.
    let huge = "huge";
    h.put_manifest(
        huge,
        "",
        &support::vmi_manifest(huge, "", "", "").replace("guest: 128Mi", "guest: 1Ti"),
    );
    h.wait_phase(huge, "Failed", Duration::from_secs(60));
    let st = h.status(huge)["status"].clone();
    assert!(
        st["reason"]
            .as_str()
            .unwrap_or("")
            .contains("of guest memory does not fit this host's"),
        "{st}"
    );
    h.ok(&format!(
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{huge}.service)\" = not-found ]
         [ ! -e /var/lib/kvirt/vms/default_{huge} ]"
    ));
    h.remove_vm_and_wait_gone(huge);
}

/// xorshift64*: the chaos test's choices, repeatable from a printed seed.
struct Chaos(u64);

impl Chaos {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[derive(Default)]
struct ChaosVm {
    present: bool,
    generation: u32,
    /// Its QEMU or its daemon was killed before it ran: Failed is as
    /// right as Running.
    may_fail: bool,
    /// QEMU's PID when last seen running, for the same-QEMU check.
    qemu: Option<String>,
    /// The QEMU the last kill hit: until kvirtd notices, the status may
    /// still say Running.
    killed_qemu: Option<String>,
}

/// SIGKILLs of kvirtd, of VMs' libvirt daemons and of QEMUs at random
/// points among creates, deletes and edits; then everything converges:
/// each VM that should run runs (the same QEMU unless it was touched),
/// nothing is left of the others. `KVIRT_CHAOS_SEED` repeats a run,
/// `KVIRT_CHAOS_CYCLES` (default 30) makes it longer.
#[test]
fn chaos_kills_at_random_points_and_everything_converges() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let random: u64 = std::env::var("KVIRT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    let cycles: u32 = std::env::var("KVIRT_CHAOS_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    chaos_run(&h, random, cycles);
}

/// Chaos runs that once failed, replayed (their first 20 cycles: the
/// pacing is real time, so a seed replays its operations, not their exact
/// timing): 1796337339813738289 edited `chaos0` while its previous
/// instance was being started, and the old start's Running landed on the
/// new VMI, which then failed as a running VM whose unit had gone
/// (`a_vmi_replaced_during_its_predecessors_start_runs_as_itself` is the
/// same race on the fakes, deterministic). `KVIRT_CHAOS_SEED` with
/// `KVIRT_CHAOS_CYCLES=30` replays one whole.
const CHAOS_ONCE_FAILED: &[u64] = &[1_796_337_339_813_738_289, 1_796_389_352_919_579_155];

#[test]
fn chaos_runs_that_once_failed_converge() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    for &seed in CHAOS_ONCE_FAILED {
        chaos_run(&h, seed, 20);
    }
}

/// One chaos run of `cycles` from `seed` (see above).
fn chaos_run(h: &Host, seed: u64, cycles: u32) {
    eprintln!("chaos: seed {seed}, {cycles} cycles (KVIRT_CHAOS_SEED={seed} repeats it)");
    let mut rng = Chaos(seed);
    let names = ["chaos0", "chaos1", "chaos2"];
    let mut vms: std::collections::BTreeMap<&str, ChaosVm> =
        names.iter().map(|n| (*n, ChaosVm::default())).collect();
    for n in names {
        // From a run cut short on the same host, if any.
        h.ok(&format!("rm -f /etc/kvirt/vmis.d/{n}.yaml"));
        h.wait_gone(n);
        h.ok(&format!(
            "cp /srv/guest/run.raw /var/lib/kvirt/images/{n}.raw"
        ));
    }
    let manifest = |vm: &str, generation: u32| {
        support::vmi_manifest(
            vm,
            &format!("generation: \"{generation}\""),
            "  networks: [{name: default, pod: {}}]\n",
            "      interfaces: [{name: default, masquerade: {}}]\n",
        )
    };
    let running = |vm: &str| h.phase(vm).as_deref() == Some("Running");
    // The status is of the latest manifest: right after an edit it still
    // shows the VM being replaced (Running, or Failed if its QEMU was
    // killed), until the new one has started.
    let current = |vm: &str, generation: u32| {
        h.succeeds(&format!(
            "grep -q '\"generation\": \"{generation}\"' /run/kvirt/status/default_{vm}.json"
        ))
    };
    for cycle in 0..cycles {
        let vm = names[rng.below(names.len() as u64) as usize];
        let op = rng.below(100);
        let state = vms.get_mut(vm).unwrap();
        let did = match op {
            0..=29 if !state.present => {
                state.present = true;
                state.generation += 1;
                state.may_fail = false;
                state.qemu = None;
                state.killed_qemu = None;
                h.put_manifest(vm, "", &manifest(vm, state.generation));
                format!("create {vm}")
            }
            30..=44 if state.present => {
                state.present = false;
                h.ok(&format!("rm /etc/kvirt/vmis.d/{vm}.yaml"));
                format!("delete {vm}")
            }
            0..=59 if state.present => {
                state.generation += 1;
                state.may_fail = false;
                state.qemu = None;
                state.killed_qemu = None;
                h.put_manifest(vm, "", &manifest(vm, state.generation));
                format!("edit {vm} (generation {})", state.generation)
            }
            60..=74 => {
                let main = h.ok("systemctl show -P MainPID kvirtd");
                h.ok("systemctl kill -s KILL kvirtd");
                h.wait_new_kvirtd("SIGKILL", "MainPID", &main);
                "kill -9 kvirtd".into()
            }
            75..=87 => {
                let pid = daemon_pid(h, vm);
                if pid == "0" || pid.is_empty() {
                    continue;
                }
                if !running(vm) {
                    state.may_fail = true;
                }
                h.sh(&format!("kill -KILL {pid}"));
                format!("kill -9 {vm}'s daemon")
            }
            88..=99 => {
                let pid = h.ok(&format!(
                    "{{ pgrep -f '[q]emu-system.*guest=default_{vm},' || true; }} | head -n1"
                ));
                if pid.is_empty() {
                    continue;
                }
                state.may_fail = true;
                state.qemu = None;
                h.sh(&format!("kill -KILL {pid}"));
                state.killed_qemu = Some(pid);
                format!("kill -9 {vm}'s QEMU")
            }
            _ => continue,
        };
        eprintln!("chaos {cycle}: {did}");
        // Pacing, so kills land at different points of kvirtd's work.
        std::thread::sleep(Duration::from_millis(rng.below(1500)));
        for (vm, s) in vms.iter_mut() {
            // Running as its latest manifest says: right after an edit the
            // status still shows the VM being replaced.
            if s.present
                && !s.may_fail
                && s.qemu.is_none()
                && current(vm, s.generation)
                && running(vm)
            {
                let pid = h.ok(&format!(
                    "{{ pgrep -f '[q]emu-system.*guest=default_{vm},' || true; }} | head -n1"
                ));
                s.qemu = (!pid.is_empty()).then_some(pid);
            }
        }
    }

    for (vm, s) in &vms {
        if !s.present {
            h.wait_gone(vm);
            continue;
        }
        if s.may_fail {
            // Running counts only with a QEMU that was not killed: right
            // after a kill the status may not have caught up yet.
            let killed = s.killed_qemu.as_deref().unwrap_or("none");
            h.wait_until(&format!("{vm} settled"), BOOT, || {
                if !current(vm, s.generation) {
                    return false;
                }
                match h.phase(vm).as_deref() {
                    Some("Failed") => true,
                    Some("Running") => h.succeeds(&format!(
                        "pgrep -f '[q]emu-system.*guest=default_{vm},' | grep -qvx '{killed}'"
                    )),
                    _ => false,
                }
            });
            if !running(vm) {
                // Failed: nothing of it runs any more.
                h.wait(
                    &format!("{vm}'s unit gone"),
                    Duration::from_secs(60),
                    &format!(
                        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{vm}.service)\" = not-found ]
                         ! pgrep -f '[q]emu-system.*guest=default_{vm},'
                         [ ! -e /run/netns/kvirt-default_{vm} ]"
                    ),
                );
                continue;
            }
        }
        h.wait_until(
            &format!("{vm} running as its latest manifest"),
            BOOT,
            || current(vm, s.generation) && running(vm),
        );
        h.wait(
            &format!("{vm}'s QEMU"),
            BOOT,
            &format!("pgrep -f '[q]emu-system.*guest=default_{vm},'"),
        );
        if let (Some(before), false) = (&s.qemu, s.may_fail) {
            assert_eq!(&h.qemu_pid(vm), before, "{vm}'s QEMU was replaced");
        }
        h.ok(&format!("systemctl is-active -q kvirt-vm@default_{vm}"));
    }
    // Every address leased and every anti-spoofing element belongs to a
    // VM that runs.
    let runs: Vec<&str> = vms
        .iter()
        .filter(|(vm, s)| s.present && running(vm))
        .map(|(vm, _)| *vm)
        .collect();
    let leases = h.ok("cat /var/lib/kvirt/network/leases.json");
    for vm in names {
        assert_eq!(
            leases.contains(&format!("default_{vm}\"")),
            runs.contains(&vm),
            "{vm}: {leases}"
        );
    }
    // The host's anti-spoofing set holds exactly the running VMs' pod
    // addresses (other VMs on the host included).
    // (A VM replaced by the last edit reports its new address with the
    // pass after its start: converged within a deadline.)
    let ip = "grep -oE '([0-9]+\\.){3}[0-9]+'";
    let elements = format!("{{ nft list set bridge kvirt vm_sources | {ip} || true; }} | sort -u");
    let addresses = format!(
        "{{ cat /run/kvirt/status/*.json | grep '\"ipAddress\"' | {ip} || true; }} | sort -u"
    );
    let converged = format!("[ \"$({elements})\" = \"$({addresses})\" ]");
    if !h.succeeds(&converged) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && !h.succeeds(&converged) {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    assert_eq!(h.ok(&elements), h.ok(&addresses), "{runs:?}");

    for vm in names {
        h.ok(&format!("rm -f /etc/kvirt/vmis.d/{vm}.yaml"));
    }
    for vm in names {
        h.wait_gone(vm);
        h.ok(&format!("rm -f /var/lib/kvirt/images/{vm}.raw"));
    }
    h.ok("! grep -q '\"ip\"' /var/lib/kvirt/network/leases.json");
}

/// journald keeps a file per uid that logged (8 MiB each, `user-<uid>.
/// journal`): VMs coming and going reuse their identities, lowest first,
/// so the files do not pile up one per VM ever run (a host once filled its
/// disk after ~700). `KVIRT_JOURNAL_CYCLES` (default 5) makes it longer.
#[test]
fn vms_coming_and_going_leave_no_journal_file_each() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let cycles: u32 = std::env::var("KVIRT_JOURNAL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let files = || -> usize {
        h.ok("find /var/log/journal /run/log/journal -name 'user-*.journal' 2>/dev/null | wc -l")
            .parse()
            .unwrap()
    };
    let size = || h.ok("du -sk /var/log/journal 2>/dev/null | cut -f1 || echo 0");
    let (files_before, size_before) = (files(), size());
    let mut users = std::collections::BTreeSet::new();
    for _ in 0..cycles {
        h.create_vm("journal", "run");
        h.wait_phase("journal", "Running", BOOT);
        users.insert(h.ok("systemctl show -p User --value kvirt-vm@default_journal"));
        h.remove_vm_and_wait_gone("journal");
    }
    eprintln!(
        "{cycles} VMs one after another: identities {users:?}; user journal files {files_before} -> {}; /var/log/journal {size_before} -> {} KiB",
        files(),
        size()
    );
    assert_eq!(users.len(), 1, "each VM took a new identity: {users:?}");
    assert!(files() <= files_before + 1, "a journal file per VM");
}

#[test]
fn the_manifest_directory_survives_links_fifos_huge_and_half_written_files() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let dir = "/etc/kvirt/vmis.d";
    h.ok(&format!(
        "ln -s /dev/zero {dir}/zero.yaml
         mkfifo {dir}/fifo.yaml
         head -c 3000000 /dev/zero | tr '\\0' '#' > {dir}/huge.yaml"
    ));
    h.wait(
        "the bad manifests listed",
        Duration::from_secs(30),
        "kvirtctl ls | grep -A3 'MANIFESTS NOT USED' | grep -c 'yaml:' | grep -qx 3",
    );
    let ls = h.ok("kvirtctl ls");
    assert!(ls.contains("zero.yaml: not a regular file"), "{ls}");
    assert!(ls.contains("huge.yaml: larger than"), "{ls}");
    // Neither blocked nor bloated: a VM made now starts as usual.
    let rss: u64 = h
        .ok("systemctl show -P MemoryCurrent kvirtd")
        .parse()
        .unwrap_or(0);
    assert!(rss < 256 << 20, "kvirtd uses {rss} bytes");
    h.ok("systemctl is-active -q kvirtd");

    // Half written, still open: not read until it is closed.
    let manifest = support::vmi_manifest("half", "", "", "");
    let (head, tail) = manifest.split_at(manifest.len() / 2);
    h.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/half.raw");
    assert!(!manifest.contains('\''));
    // The negative check waits a few seconds: kvirtd would have read the
    // half within that (it reacts to each write's inotify event at once).
    h.ok(&format!(
        "exec 3>{dir}/half.yaml
         printf '%s' '{head}' >&3
         sleep 3
         ! kvirtctl ls | grep -q half
         printf '%s' '{tail}' >&3
         exec 3>&-"
    ));
    h.wait_phase("half", "Running", BOOT);
    h.remove_vm_and_wait_gone("half");

    h.ok(&format!(
        "rm {dir}/zero.yaml {dir}/fifo.yaml {dir}/huge.yaml"
    ));
    h.wait(
        "the list emptied",
        Duration::from_secs(30),
        "! kvirtctl ls | grep -q 'MANIFESTS NOT USED'",
    );
}

/// The VirtualMachine as kvirtd keeps it (object and status).
fn vm_record(h: &Host, vm: &str) -> serde_json::Value {
    let out = h.ok(&format!("kvirtctl vm default/{vm}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn wait_vm_status(h: &Host, vm: &str, printable: &str, timeout: Duration) {
    h.wait(
        &format!("VirtualMachine {vm} {printable}"),
        timeout,
        &format!("kvirtctl vm default/{vm} | grep -q '\"printableStatus\": \"{printable}\"'"),
    );
}

fn vmi_uid(h: &Host, vm: &str) -> String {
    h.status(vm)["metadata"]["uid"]
        .as_str()
        .unwrap_or("")
        .to_owned()
}

/// Waits for the VM's VMI to be another than `before` and Running.
fn wait_new_vmi_running(h: &Host, vm: &str, before: &str, timeout: Duration) -> String {
    h.wait_until(&format!("a new VMI of {vm} running"), timeout, || {
        h.phase(vm).as_deref() == Some("Running") && vmi_uid(h, vm) != before
    });
    vmi_uid(h, vm)
}

#[test]
fn virtual_machines_stay_up_by_their_run_strategy_and_obey_kvirtctl() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // With a CPU limit: a quota on the VM's unit, as on a pod's cgroup.
    let manifest = support::vm_manifest("vmr", "RerunOnFailure", "").replace(
        "memory: {guest: 128Mi}\n",
        "memory: {guest: 128Mi}\n        resources: {limits: {cpu: 500m}}\n",
    );
    assert!(manifest.contains("cpu: 500m"), "{manifest}");
    h.put_manifest("vmr", "run", &manifest);
    wait_vm_status(&h, "vmr", "Running", BOOT);
    assert_eq!(
        h.ok("systemctl show -p CPUQuotaPerSecUSec --value kvirt-vm@default_vmr"),
        "500ms"
    );
    let first = vmi_uid(&h, "vmr");
    let vmi = h.status("vmr");
    let owner = &vmi["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "VirtualMachine", "{vmi}");
    assert_eq!(owner["controller"], true, "{vmi}");
    assert_eq!(owner["uid"], vm_record(&h, "vmr")["metadata"]["uid"]);
    assert_eq!(vmi["metadata"]["labels"]["app"], "vmr");
    let rec = vm_record(&h, "vmr");
    assert_eq!(rec["status"]["ready"], true, "{rec}");
    assert_eq!(rec["status"]["runStrategy"], "RerunOnFailure", "{rec}");

    // QEMU killed: the VMI failed; a new one comes after the backoff.
    let qemu = h.qemu_pid("vmr");
    h.ok(&format!("kill -KILL {qemu}"));
    wait_vm_status(&h, "vmr", "CrashLoopBackOff", Duration::from_secs(30));
    let rec = vm_record(&h, "vmr");
    assert_eq!(
        rec["status"]["startFailure"]["consecutiveFailCount"], 1,
        "{rec}"
    );
    assert_eq!(
        rec["status"]["startFailure"]["lastFailedVMIUID"],
        first.as_str()
    );
    let second = wait_new_vmi_running(&h, "vmr", &first, BOOT);
    wait_vm_status(&h, "vmr", "Running", BOOT);

    // restart: a new VMI and a new QEMU.
    let qemu = h.qemu_pid("vmr");
    h.ok("kvirtctl restart default/vmr");
    let third = wait_new_vmi_running(&h, "vmr", &second, BOOT);
    h.wait(
        "a new QEMU for vmr",
        BOOT,
        &format!(
            "p=$(pgrep -f '[q]emu-system.*guest=default_vmr,' | head -n1); [ -n \"$p\" ] && [ \"$p\" != {qemu} ]"
        ),
    );

    // stop: gracefully, and it stays stopped across a kvirtd restart.
    h.serial_log_shows("vmr", "KVIRT-GUEST-READY");
    h.ok("kvirtctl stop default/vmr");
    wait_vm_status(&h, "vmr", "Stopped", Duration::from_secs(40));
    h.wait_gone("vmr");
    assert_eq!(vm_record(&h, "vmr")["status"]["runStrategy"], "Halted");
    h.restart_kvirtd();
    // The new kvirtd's VM loop answers: the VM is still stopped.
    h.wait(
        "kvirtd's VM loop after the restart",
        Duration::from_secs(30),
        "out=$(kvirtctl stop default/vmr 2>&1 || true); grep -q 'not running' <<<\"$out\"",
    );
    wait_vm_status(&h, "vmr", "Stopped", Duration::from_secs(10));
    h.ok("[ \"$(systemctl show -p LoadState --value kvirt-vm@default_vmr.service)\" = not-found ]");

    // start --paused: a fourth VMI, its vCPUs stopped until unpaused; the
    // VM is Always again.
    h.ok("kvirtctl start --paused default/vmr");
    wait_new_vmi_running(&h, "vmr", &third, BOOT);
    wait_vm_status(&h, "vmr", "Paused", BOOT);
    assert_eq!(h.status("vmr")["spec"]["startStrategy"], "Paused");
    assert_eq!(vm_record(&h, "vmr")["status"]["runStrategy"], "Always");
    h.ok("kvirtctl unpause default/vmr");
    wait_vm_status(&h, "vmr", "Running", BOOT);
    let machine = h.status("vmr")["status"]["machine"]["type"].clone();
    assert!(
        machine.as_str().is_some_and(|m| m.starts_with("pc-")),
        "status.machine: {machine}"
    );

    // pause: the guest stops printing; Running, Paused, not Ready.
    let log = "/run/kvirt/vms/default_vmr/console.log";
    h.serial_log_shows("vmr", "KVIRT-GUEST-ALIVE 2");
    h.ok("kvirtctl pause default/vmr");
    wait_vm_status(&h, "vmr", "Paused", Duration::from_secs(30));
    let st = h.status("vmr")["status"].clone();
    let cond = |t: &str| {
        st["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == t)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(st["phase"], "Running", "{st}");
    assert_eq!(
        (
            cond("Paused")["status"].clone(),
            cond("Paused")["reason"].clone()
        ),
        ("True".into(), "PausedByUser".into()),
        "{st}"
    );
    assert_eq!(cond("Ready")["status"], "False", "{st}");
    // Three of its 2-second ticks go by without a line.
    h.ok(&format!(
        "n=$(grep -c ALIVE {log}); sleep 6; [ \"$(grep -c ALIVE {log})\" = \"$n\" ]"
    ));
    let err = h.ok("kvirtctl pause default/vmr 2>&1 || true");
    assert!(err.contains("already paused"), "{err}");
    let paused_at = h.ok(&format!("grep -c ALIVE {log}"));
    h.ok("kvirtctl unpause default/vmr");
    wait_vm_status(&h, "vmr", "Running", Duration::from_secs(30));
    h.wait(
        "vmr printing again",
        Duration::from_secs(30),
        &format!("[ \"$(grep -c ALIVE {log})\" -gt {paused_at} ]"),
    );

    // soft-reboot: through the guest agent, in the same QEMU.
    h.wait(
        "vmr's guest agent",
        Duration::from_secs(60),
        "grep -q AgentConnected /run/kvirt/status/default_vmr.json",
    );
    let qemu = h.qemu_pid("vmr");
    h.ok("kvirtctl soft-reboot default/vmr");
    h.serial_log_shows("vmr", "KVIRT-GUEST-AGENT-REBOOT");
    h.wait(
        "vmr booted again",
        BOOT,
        &format!("[ \"$(grep -c KVIRT-GUEST-READY {log})\" -ge 2 ]"),
    );
    assert_eq!(h.qemu_pid("vmr"), qemu);

    // A VMI is not a VM: refused, with why.
    let err = h.ok("kvirtctl stop default/nosuch 2>&1 || true");
    assert!(err.contains("no VirtualMachine"), "{err}");

    // The manifest removed: the VM and everything of it go.
    h.ok("rm /etc/kvirt/vmis.d/vmr.yaml");
    h.wait_gone("vmr");
    h.wait(
        "vmr's record removed",
        Duration::from_secs(30),
        "[ ! -e /var/lib/kvirt/virtualmachines/default_vmr.json ]",
    );
    h.ok("rm -f /var/lib/kvirt/images/vmr.raw");
}

#[test]
fn an_always_vm_comes_back_after_poweroff_and_after_a_reboot() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // A guest that powers itself off after booting: each run ends Succeeded.
    h.put_manifest(
        "vma",
        "poweroff",
        &support::vm_manifest("vma", "Always", ""),
    );
    h.put_manifest("vmh", "run", &support::vm_manifest("vmh", "Halted", ""));
    h.wait(
        "vma's first VMI",
        BOOT,
        "grep -q '\"uid\"' /run/kvirt/status/default_vma.json",
    );
    let first = vmi_uid(&h, "vma");
    h.wait(
        "vma running a second VMI after its guest powered off",
        BOOT * 2,
        &format!(
            "grep -q '\"uid\"' /run/kvirt/status/default_vma.json && ! grep -q '\"uid\": \"{first}\"' /run/kvirt/status/default_vma.json"
        ),
    );
    assert_eq!(
        vm_record(&h, "vma")["status"]["startFailure"],
        serde_json::Value::Null
    );
    // Halted: nothing runs.
    wait_vm_status(&h, "vmh", "Stopped", Duration::from_secs(30));
    h.ok("[ ! -e /run/kvirt/status/default_vmh.json ]");

    // startStrategy Paused: it starts with its vCPUs stopped, then runs
    // once unpaused.
    h.put_manifest(
        "vmp",
        "run",
        &support::vmi_manifest("vmp", "", "  startStrategy: Paused\n", ""),
    );
    h.wait_phase("vmp", "Running", BOOT);
    h.wait(
        "vmp paused by its start strategy",
        Duration::from_secs(30),
        "grep -q '\"reason\": \"Paused' /run/kvirt/status/default_vmp.json",
    );
    h.ok("sleep 4; ! grep -q KVIRT-GUEST /run/kvirt/vms/default_vmp/console.log");
    h.ok("kvirtctl unpause default/vmp");
    h.serial_log_shows("vmp", "KVIRT-GUEST-READY");
    h.remove_vm_and_wait_gone("vmp");

    // An edited template: the next run (each poweroff makes one) is of it.
    h.ok("sed -i 's/app: vma}/app: vma, edited: \"yes\"}/' /etc/kvirt/vmis.d/vma.yaml");
    h.wait(
        "a VMI of vma's edited template",
        BOOT * 2,
        "grep -q '\"edited\": \"yes\"' /run/kvirt/status/default_vma.json",
    );
    assert_eq!(vm_record(&h, "vma")["status"]["desiredGeneration"], 2);
    // Stopped, given a guest that stays up, started: it runs.
    h.ok("kvirtctl stop default/vma");
    wait_vm_status(&h, "vma", "Stopped", Duration::from_secs(40));
    h.wait_gone("vma");
    h.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/vma.raw");
    h.ok("kvirtctl start default/vma");
    wait_vm_status(&h, "vma", "Running", BOOT);
    h.serial_log_shows("vma", "KVIRT-GUEST-READY mode=run");
    let before = vmi_uid(&h, "vma");

    // A reboot, as the host sees one: kvirtd and every VM stop, /run is
    // emptied (and so are the VMs' runtime tmpfs, gone with their mounts).
    // Always runs again (a new VMI), Halted stays down.
    h.ok("systemctl stop kvirtd
          systemctl stop 'kvirt-vm@*.service'
          for n in $(ip netns list | awk '/^kvirt-/ {print $1}'); do ip netns delete $n; done
          for m in $(awk '$2 ~ \"^/run/kvirt/vms/\" {print $2}' /proc/self/mounts); do umount -l $m; done
          rm -rf /run/kvirt/*
          systemctl start kvirtd");
    wait_new_vmi_running(&h, "vma", &before, BOOT);
    wait_vm_status(&h, "vma", "Running", BOOT);
    assert_eq!(vm_record(&h, "vmh")["status"]["printableStatus"], "Stopped");

    h.ok("kvirtctl stop --force default/vma");
    wait_vm_status(&h, "vma", "Stopped", Duration::from_secs(30));
    for vm in ["vma", "vmh"] {
        h.remove_vm_and_wait_gone(vm);
    }
}

/// A VM with `claim` as its second disk (as the cluster's tests do): its
/// script shows what the claim held and writes a marker into it.
fn claim_manifest(vm: &str, claim: &str) -> String {
    support::vmi_manifest(
        vm,
        "",
        "",
        "      - name: data\n        disk: {bus: virtio}\n      - name: seed\n        disk: {bus: virtio}\n",
    ) + &format!(
        "  - name: data\n    persistentVolumeClaim: {{claimName: {claim}}}\n  - name: seed\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n        echo \"KVIRT-CLAIM-WAS $(head -c 15 /dev/vdb | tr '\\000' .)\"\n        printf KVIRT-PERSISTED >/dev/vdb && sync && echo KVIRT-CLAIM-WRITTEN\n"
    )
}

/// Standalone claims (`[storage.claims]`): the same manifest as in a
/// cluster. A filesystem claim's disk.img and a block claim on a loop
/// device keep what a VM wrote for the next VM; the block device reaches
/// the VM as a node of its own in its state directory (the host's `/dev`
/// node untouched) and its unit may use that device only. An unknown
/// claim is refused with the configured ones listed.
#[test]
fn standalone_claims_keep_their_data_for_the_next_vm() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // The loop device the harness made for this host (`th_loop`), if the
    // kernel has them.
    let block = h.ok("cat /share/claim-loop 2>/dev/null || true");
    if block.is_empty() {
        eprintln!("no loop device on this test host: the block claim case is skipped");
    }
    struct Undo<'a>(&'a Host);
    impl Drop for Undo<'_> {
        fn drop(&mut self) {
            self.0.sh(
                "rm -f /etc/kvirt/kvirtd.toml.d/50-test-claims.toml; systemctl restart kvirtd; \
                 rm -rf /var/lib/kvirt/claims/st-data",
            );
        }
    }
    let _undo = Undo(&h);
    let mut config =
        "[storage.claims.st-data]\npath = \"/var/lib/kvirt/claims/st-data\"\ncapacity = \"64Mi\"\n"
            .to_owned();
    if !block.is_empty() {
        config +=
            &format!("[storage.claims.st-block]\npath = \"{block}\"\nvolume_mode = \"Block\"\n");
    }
    h.ok(&format!(
        "mkdir -p /var/lib/kvirt/claims/st-data /etc/kvirt/kvirtd.toml.d && cat > /etc/kvirt/kvirtd.toml.d/50-test-claims.toml <<'EOF'\n{config}EOF\nsystemctl restart kvirtd"
    ));
    let mut claims = vec!["st-data"];
    if !block.is_empty() {
        claims.push("st-block");
    }
    let block_before = (!block.is_empty()).then(|| h.ok(&format!("stat -c %u:%g:%a {block}")));
    for claim in &claims {
        let first = format!("{claim}-1");
        h.put_manifest(&first, "run", &claim_manifest(&first, claim));
        h.wait_phase(&first, "Running", BOOT);
        h.serial_log_shows(&first, "KVIRT-CLAIM-WAS ...............");
        h.serial_log_shows(&first, "KVIRT-CLAIM-WRITTEN");
        // kvirtctl shows the VM's claims, as KubeVirt's volumeStatus.
        let shown = h.ok(&format!("kvirtctl status default/{first}"));
        let st: serde_json::Value = serde_json::from_str(&shown).unwrap();
        let data = &st["status"]["volumeStatus"][1];
        assert_eq!(data["name"], "data", "{shown}");
        assert_eq!(
            data["persistentVolumeClaimInfo"]["claimName"], *claim,
            "{shown}"
        );
        if *claim == "st-block" {
            let node = format!("/var/lib/kvirt/vms/default_{first}/claims/data");
            let uid = h.ok(&format!("stat -c %u /var/lib/kvirt/vms/default_{first}"));
            assert_eq!(
                h.ok(&format!("stat -c %F:%u:%a {node}")),
                format!("block special file:{uid}:600")
            );
            let allowed = h.ok(&format!(
                "systemctl show -p DeviceAllow --value kvirt-vm@default_{first}.service"
            ));
            assert!(allowed.contains(&format!("{block} rw")), "{allowed}");
            assert_eq!(
                h.ok(&format!("stat -c %u:%g:%a {block}")),
                block_before.clone().unwrap()
            );
        } else {
            // 64 MiB less 5.5 %, in whole MiB; sparse.
            let img = "/var/lib/kvirt/claims/st-data/disk.img";
            assert_eq!(
                h.ok(&format!("stat -c %s {img}")),
                (60u64 << 20).to_string()
            );
        }
        h.remove_vm_and_wait_gone(&first);
        let second = format!("{claim}-2");
        h.put_manifest(&second, "run", &claim_manifest(&second, claim));
        h.wait_phase(&second, "Running", BOOT);
        h.serial_log_shows(&second, "KVIRT-CLAIM-WAS KVIRT-PERSISTED");
        h.remove_vm_and_wait_gone(&second);
    }
    assert_eq!(
        h.ok("stat -c %u:%a /var/lib/kvirt/claims/st-data/disk.img"),
        "0:600"
    );
    h.put_manifest("st-unknown", "run", &claim_manifest("st-unknown", "nobody"));
    h.wait_phase("st-unknown", "Failed", Duration::from_secs(30));
    let status = h.status("st-unknown").to_string();
    assert!(
        status.contains("not configured on this host") && status.contains("st-data"),
        "{status}"
    );
    h.remove_vm_and_wait_gone("st-unknown");
}

/// The manifests of an instancetype of `cpus` vCPUs and `mem` of memory
/// and a preference (cores, virtio disks), as KubeVirt's objects.
fn instancetype_manifests(cpus: u32, mem: &str) -> String {
    format!(
        "apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachineClusterInstancetype
metadata: {{name: t1.small}}
spec:
  cpu: {{guest: {cpus}}}
  memory: {{guest: {mem}}}
---
apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachinePreference
metadata: {{name: tiny-linux}}
spec:
  cpu: {{preferredCPUTopology: cores}}
  devices: {{preferredDiskBus: virtio}}
  requirements: {{cpu: {{guest: 1}}, memory: {{guest: 64Mi}}}}
"
    )
}

#[test]
fn a_vm_from_an_instancetype_and_preference_keeps_them_until_its_matcher_changes() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.put_manifest("types", "", &instancetype_manifests(2, "160Mi"));
    // No CPU, memory or disks of its own: the instancetype sizes it, the
    // preference picks the topology and the bus of its volume's disk.
    let vm = "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: itvm}
spec:
  runStrategy: Always
  instancetype: {name: t1.small}
  preference: {name: tiny-linux, kind: VirtualMachinePreference}
  template:
    spec:
      terminationGracePeriodSeconds: 15
      volumes:
      - name: boot
        hostDisk: {path: /var/lib/kvirt/images/itvm.raw, type: Disk}
";
    h.put_manifest("itvm", "run", vm);
    h.wait_phase("itvm", "Running", BOOT);
    h.serial_log_shows("itvm", " cpus=2");
    let virsh =
        "virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_itvm/xdg/libvirt/virtqemud-sock'";
    let xml = h.ok(&format!("{virsh} dumpxml default_itvm"));
    for want in [
        "sockets='1'",
        "cores='2'",
        "<memory unit='KiB'>163840</memory>",
        "bus='virtio'",
    ] {
        assert!(xml.contains(want), "{want} in {xml}");
    }
    let rec = vm_record(&h, "itvm");
    let st = &rec["status"];
    assert_eq!(st["instancetypeRef"]["name"], "t1.small", "{rec}");
    assert_eq!(
        st["preferenceRef"]["kind"], "VirtualMachinePreference",
        "{rec}"
    );
    let uid = vmi_uid(&h, "itvm");

    // An edited instancetype changes nothing of the VM, not even after a
    // restart: it keeps the revision it captured, as KubeVirt's VMs do.
    h.put_manifest("types", "", &instancetype_manifests(1, "128Mi"));
    h.ok("kvirtctl restart default/itvm");
    let again = wait_new_vmi_running(&h, "itvm", &uid, BOOT);
    let xml = h.ok(&format!("{virsh} dumpxml default_itvm"));
    assert!(xml.contains("<memory unit='KiB'>163840</memory>"), "{xml}");

    // Naming another object captures that one (at the next start).
    h.put_manifest(
        "types2",
        "",
        &instancetype_manifests(1, "128Mi")
            .replace("t1.small", "t1.tiny")
            .replace("tiny-linux", "unused"),
    );
    h.put_manifest("itvm", "", &vm.replace("name: t1.small", "name: t1.tiny"));
    h.ok("kvirtctl restart default/itvm");
    wait_new_vmi_running(&h, "itvm", &again, BOOT);
    let xml = h.ok(&format!("{virsh} dumpxml default_itvm"));
    assert!(xml.contains("<memory unit='KiB'>131072</memory>"), "{xml}");

    // A VM whose template conflicts with its instancetype is refused with
    // KubeVirt's words, and runs nothing.
    h.put_manifest(
        "itbad",
        "",
        &vm.replace("itvm", "itbad").replace(
            "      terminationGracePeriodSeconds: 15\n",
            "      domain: {cpu: {sockets: 2}}\n",
        ),
    );
    wait_vm_status(&h, "itbad", "Failure", Duration::from_secs(30));
    let rec = vm_record(&h, "itbad");
    assert!(
        rec.to_string().contains(
            "VM field(s) spec.template.spec.domain.cpu.sockets conflicts with selected instance type"
        ),
        "{rec}"
    );
    h.ok("rm -f /etc/kvirt/vmis.d/itbad.yaml /etc/kvirt/vmis.d/types2.yaml");
    h.remove_vm_and_wait_gone("itvm");
    h.ok("rm -f /etc/kvirt/vmis.d/types.yaml");
}

fn pool_manifest(replicas: u32) -> String {
    format!(
        "apiVersion: pool.kubevirt.io/v1alpha1
kind: VirtualMachinePool
metadata: {{name: pl}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: pl}}}}
  virtualMachineTemplate:
    metadata: {{labels: {{app: pl}}}}
    spec:
      runStrategy: Always
      template:
        spec:
          terminationGracePeriodSeconds: 5
          domain: {{memory: {{guest: 96Mi}}}}
          volumes:
          - name: boot
            ephemeral: {{hostDisk: {{path: /var/lib/kvirt/images/pool-base.raw, type: Disk}}}}
"
    )
}

#[test]
fn a_pool_of_three_scales_to_five_and_to_one() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // One read-only base; each VM boots from an overlay of its own.
    h.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/pool-base.raw
          chmod 0644 /var/lib/kvirt/images/pool-base.raw");
    h.put_manifest("pl", "", &pool_manifest(3));
    for i in 0..3 {
        h.wait_phase(&format!("pl-{i}"), "Running", BOOT);
    }
    let rec = vm_record(&h, "pl-1");
    assert_eq!(
        rec["metadata"]["ownerReferences"][0]["kind"], "VirtualMachinePool",
        "{rec}"
    );
    assert_eq!(rec["metadata"]["labels"]["app"], "pl", "{rec}");

    h.put_manifest("pl", "", &pool_manifest(5));
    for i in 3..5 {
        h.wait_phase(&format!("pl-{i}"), "Running", BOOT);
    }
    // Scaled in from the highest index: pl-0 stays, untouched.
    let uid0 = vmi_uid(&h, "pl-0");
    h.put_manifest("pl", "", &pool_manifest(1));
    for i in 1..5 {
        h.wait_gone(&format!("pl-{i}"));
    }
    assert_eq!(h.phase("pl-0").as_deref(), Some("Running"));
    assert_eq!(vmi_uid(&h, "pl-0"), uid0);
    h.ok("rm -f /etc/kvirt/vmis.d/pl.yaml");
    h.wait_gone("pl-0");
    h.ok("rm -f /var/lib/kvirt/images/pool-base.raw");
}

#[test]
fn a_standalone_replica_set_keeps_its_vmis_running_and_replaces_one_that_ends() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/rs-base.raw
          chmod 0644 /var/lib/kvirt/images/rs-base.raw");
    let rs = "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceReplicaSet
metadata: {name: rs}
spec:
  replicas: 2
  selector: {matchLabels: {app: rs}}
  template:
    metadata: {labels: {app: rs}}
    spec:
      terminationGracePeriodSeconds: 5
      domain: {memory: {guest: 96Mi}}
      volumes:
      - name: boot
        ephemeral: {hostDisk: {path: /var/lib/kvirt/images/rs-base.raw, type: Disk}}
";
    h.put_manifest("rs", "", rs);
    for vm in ["rs-0", "rs-1"] {
        h.wait_phase(vm, "Running", BOOT);
    }
    let rec = vm_record(&h, "rs-1");
    assert_eq!(
        rec["metadata"]["ownerReferences"][0]["kind"], "VirtualMachineInstanceReplicaSet",
        "{rec}"
    );
    assert_eq!(h.status("rs-1")["metadata"]["labels"]["app"], "rs");
    // Its VMI ends (QEMU killed): a new one runs in its place.
    let uid = vmi_uid(&h, "rs-1");
    h.ok(&format!("kill -9 {}", h.qemu_pid("rs-1")));
    wait_new_vmi_running(&h, "rs-1", &uid, BOOT);
    assert_eq!(h.phase("rs-0").as_deref(), Some("Running"));
    h.ok("rm -f /etc/kvirt/vmis.d/rs.yaml");
    for vm in ["rs-0", "rs-1"] {
        h.wait_gone(vm);
    }
    h.ok("rm -f /var/lib/kvirt/images/rs-base.raw");
}

/// `vmi_manifest`'s VMI with `cores` vCPUs, each on a dedicated host CPU.
fn dedicated_manifest(vm: &str, cores: usize) -> String {
    support::vmi_manifest(vm, "", "", "").replace(
        "    memory: {guest: 128Mi}\n",
        &format!("    memory: {{guest: 128Mi}}\n    cpu: {{cores: {cores}, dedicatedCpuPlacement: true}}\n"),
    )
}

/// The CPUs any thread of `vm`'s QEMU may run on.
fn qemu_cpus(h: &Host, vm: &str) -> String {
    let pid = h.qemu_pid(vm);
    let lists = h.ok(&format!(
        "grep -h Cpus_allowed_list /proc/{pid}/task/*/status | awk '{{print $2}}'"
    ));
    let all = lists
        .lines()
        .fold(kvirt::core::cpuset::CpuSet::default(), |all, l| {
            all.union(&l.parse().unwrap())
        });
    all.to_string()
}

#[test]
fn dedicated_cpus_are_pinned_disjoint_and_kept_across_a_kvirtd_restart() {
    use kvirt::core::cpuset::CpuSet;
    let Some(h) = host() else { return };
    let _g = h.turn();
    // Every CPU is handed out; dc-a takes all but one.
    let online = h.ok("taskset -pc $(systemctl show -P MainPID kvirtd) | sed 's/.*: //'");
    let online: CpuSet = online.parse().unwrap();
    let n = online.len();
    assert!(n >= 2, "the test host has fewer than 2 CPUs: {online}");
    struct Undo<'a>(&'a Host);
    impl Drop for Undo<'_> {
        fn drop(&mut self) {
            self.0.sh(
                "rm -f /etc/kvirt/vmis.d/dc-*.yaml /etc/kvirt/kvirtd.toml.d/50-test-cpus.toml; \
                 systemctl restart kvirtd",
            );
        }
    }
    let _undo = Undo(&h);
    h.ok(&format!(
        "mkdir -p /etc/kvirt/kvirtd.toml.d && printf '[vm]\\ndedicated_cpus = \"{online}\"\\n' \
         > /etc/kvirt/kvirtd.toml.d/50-test-cpus.toml && systemctl restart kvirtd"
    ));
    let unit_cpus = |vm: &str| {
        h.ok(&format!(
            "systemctl show -P AllowedCPUs kvirt-vm@default_{vm}.service"
        ))
    };
    let waits_saying = |vm: &str, why: &str| {
        h.wait_until(
            &format!("{vm} waiting for CPUs"),
            Duration::from_secs(60),
            || h.try_status(vm).is_ok_and(|s| s.to_string().contains(why)),
        );
        assert_ne!(h.phase(vm).as_deref(), Some("Running"));
        assert_ne!(h.phase(vm).as_deref(), Some("Failed"));
        assert!(!h.succeeds(&format!(
            "systemctl is-active -q kvirt-vm@default_{vm}.service"
        )));
    };

    // A VM without dedicated CPUs runs on all of them, until one is held.
    h.put_manifest("dc-s", "run", &support::vmi_manifest("dc-s", "", "", ""));
    h.wait_phase("dc-s", "Running", BOOT);
    assert_eq!(unit_cpus("dc-s"), online.to_string());
    h.put_manifest("dc-a", "run", &dedicated_manifest("dc-a", n - 1));
    h.wait_phase("dc-a", "Running", BOOT);
    let a = unit_cpus("dc-a");
    let sa: CpuSet = a.parse().unwrap();
    assert!(sa.len() == n - 1 && sa.and(&online) == sa, "{a}");
    let rest = online.minus(&sa).to_string();
    // It is moved off the held CPU at once, and back if moved by hand.
    assert_eq!(unit_cpus("dc-s"), rest);
    h.ok(&format!(
        "systemctl set-property --runtime kvirt-vm@default_dc-s.service AllowedCPUs={online}"
    ));
    h.wait(
        "dc-s moved back off the held CPU",
        Duration::from_secs(60),
        &format!("[ \"$(systemctl show -P AllowedCPUs kvirt-vm@default_dc-s.service)\" = {rest} ]"),
    );
    // The domain pins its vCPU there, and every QEMU thread runs only there.
    let xml = h.ok(
        "virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_dc-a/xdg/libvirt/virtqemud-sock' \
         dumpxml default_dc-a",
    );
    let first = sa.iter().next().unwrap();
    assert!(
        xml.contains(&format!("<vcpupin vcpu='0' cpuset='{first}'/>")),
        "{xml}"
    );
    assert_eq!(qemu_cpus(&h, "dc-a"), a);

    // The last CPU stays for dc-s: the next dedicated VM waits, saying why.
    h.put_manifest("dc-b", "run", &dedicated_manifest("dc-b", 1));
    waits_saying(
        "dc-b",
        "the last one stays for the VMs without dedicated CPUs",
    );

    // kvirtd restarts: dc-a keeps its QEMU and its CPU, dc-b still waits.
    let pid = h.qemu_pid("dc-a");
    h.restart_kvirtd();
    h.wait_phase("dc-a", "Running", BOOT);
    assert_eq!(h.qemu_pid("dc-a"), pid);
    assert_eq!(unit_cpus("dc-a"), a);
    let held = h.ok("cat /run/kvirt/dedicated-cpus.json");
    assert!(
        held.contains("default_dc-a") && !held.contains("default_dc-b"),
        "{held}"
    );
    waits_saying("dc-b", "dedicated CPUs");

    // dc-s goes: dc-b starts on the other CPU, disjoint from dc-a's.
    h.remove_vm_and_wait_gone("dc-s");
    h.wait_phase("dc-b", "Running", BOOT);
    assert_eq!(unit_cpus("dc-b"), rest);
    assert_eq!(qemu_cpus(&h, "dc-b"), rest);

    // None left at all: a third waits, and starts once dc-a lets go.
    h.put_manifest("dc-c", "run", &dedicated_manifest("dc-c", 1));
    waits_saying(
        "dc-c",
        &format!("needs 1 dedicated CPUs, but only 0 of this host's {n} dedicated CPUs"),
    );
    h.remove_vm_and_wait_gone("dc-a");
    h.wait_phase("dc-c", "Running", BOOT);
    assert_eq!(unit_cpus("dc-c"), first.to_string());
    assert_eq!(qemu_cpus(&h, "dc-c"), first.to_string());
    for vm in ["dc-b", "dc-c"] {
        h.remove_vm_and_wait_gone(vm);
    }
    assert_eq!(
        h.ok("tr -d ' \\n' < /run/kvirt/dedicated-cpus.json"),
        "{\"held\":{}}"
    );
}

/// Raw TPM 2.0 commands (owner hierarchy, empty password session) the
/// guest sends to /dev/tpm0: NV index 0x01500000 of 8 bytes, defined,
/// written with "KVIRTTPM", read. Octal escapes for busybox's printf.
fn tpm_commands() -> (String, String, String) {
    // Authorization: its size, then TPM_RS_PW, no nonce, no attributes,
    // an empty password.
    let pw = ["00000009", "40000009", "0000", "00", "0000"].concat();
    let (owner, index) = ("40000001", "01500000");
    let define = [
        "8002", "0000002d", "0000012a", owner, &pw, "0000", // empty auth
        "000e", index, "000b", "00020002", "0000",
        "0008", // public: SHA-256, owner RW, 8 bytes
    ]
    .concat();
    let write = [
        "8002",
        "0000002b",
        "00000137",
        owner,
        index,
        &pw,
        "0008",
        "4b5649525454504d",
        "0000",
    ]
    .concat();
    let read = [
        "8002", "00000023", "0000014e", owner, index, &pw, "0008", "0000",
    ]
    .concat();
    let octal = |h: &str| -> String {
        let bytes: Vec<u8> = (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&h[i..i + 2], 16).unwrap())
            .collect();
        // The command's size field is its length.
        assert_eq!(
            u32::from_be_bytes(bytes[2..6].try_into().unwrap()) as usize,
            bytes.len()
        );
        bytes.iter().map(|b| format!("\\{b:03o}")).collect()
    };
    (octal(&define), octal(&write), octal(&read))
}

/// A VirtualMachine with a TPM (`tpm` is its YAML) whose guest reads NV
/// index 0x01500000 at boot, and defines and writes it when empty.
fn tpm_vm_manifest(vm: &str, tpm: &str) -> String {
    let (define, write, read) = tpm_commands();
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: {vm}}}
spec:
  runStrategy: Always
  template:
    spec:
      terminationGracePeriodSeconds: 15
      domain:
        memory: {{guest: 128Mi}}
        devices:
          tpm: {tpm}
          disks:
          - {{name: boot, disk: {{bus: virtio}}}}
          - {{name: seed, disk: {{bus: virtio}}}}
      volumes:
      - name: boot
        hostDisk: {{path: /var/lib/kvirt/images/{vm}.raw, type: Disk}}
      - name: seed
        cloudInitNoCloud:
          userData: |
            #!/bin/sh
            tpm() {{ exec 3<>/dev/tpm0; printf \"$1\" >&3; dd bs=4096 count=1 <&3 2>/dev/null | od -An -tx1 | tr -d ' \\n'; exec 3>&-; }}
            [ -e /dev/tpm0 ] || {{ echo KVIRT-TPM-NONE; exit 0; }}
            r=$(tpm '{read}')
            case $r in
              *4b5649525454504d*) echo KVIRT-TPM-READ KVIRTTPM ;;
              *) d=$(tpm '{define}'); w=$(tpm '{write}')
                 echo \"KVIRT-TPM-WROTE $(echo $d | cut -c13-20) $(echo $w | cut -c13-20)\" ;;
            esac
"
    )
}

#[test]
fn a_persistent_tpm_keeps_what_the_guest_wrote_across_restarts_and_a_plain_one_does_not() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    // The persistent one's name is as long as a VM id gets unshortened:
    // swtpm's socket would not fit under its own runtime directory.
    let p = format!("tpmp-{}", "x".repeat(46));
    let p = p.as_str();
    h.put_manifest(p, "run", &tpm_vm_manifest(p, "{persistent: true}"));
    h.put_manifest("tpm", "run", &tpm_vm_manifest("tpm", "{}"));
    for vm in [p, "tpm"] {
        h.wait_phase(vm, "Running", BOOT);
        h.serial_log_shows(vm, "KVIRT-TPM-WROTE 00000000 00000000");
    }
    let virsh = |vm: &str| {
        format!("virsh -c 'qemu:///session?socket=/run/kvirt/vms/default_{vm}/xdg/libvirt/virtqemud-sock' dumpxml default_{vm}")
    };
    let xml = h.ok(&virsh(p));
    assert!(
        xml.contains("<tpm model='tpm-crb'>") && xml.contains("persistent_state='yes'"),
        "{xml}"
    );
    assert!(h.ok(&virsh("tpm")).contains("<tpm model='tpm-tis'>"));
    // swtpm runs as the VM's own user, in its unit.
    let pid = h.ok(&format!(
        "pgrep -f '[s]wtpm socket.*default_{p}/' | head -n1"
    ));
    assert_eq!(
        h.ok(&format!("stat -c %U /proc/{pid}")),
        h.ok(&format!("stat -c %U /var/lib/kvirt/vms/default_{p}"))
    );
    assert!(h
        .ok(&format!("cat /proc/{pid}/cgroup"))
        .contains(&format!("kvirt-vm@default_{p}.service")));

    // Restarted: the persistent TPM has the value, the plain one is new.
    for vm in [p, "tpm"] {
        let uid = vmi_uid(&h, vm);
        h.ok(&format!("kvirtctl restart default/{vm}"));
        wait_new_vmi_running(&h, vm, &uid, BOOT);
    }
    h.serial_log_shows(p, "KVIRT-TPM-READ KVIRTTPM");
    h.serial_log_shows("tpm", "KVIRT-TPM-WROTE 00000000 00000000");
    let kept = format!("/var/lib/kvirt/efi-vars/default_{p}");
    assert!(h.succeeds(&format!(
        "[ \"$(stat -c %a {kept}/tpm2-00.permall)\" = 600 ]"
    )));

    // Standalone, kept state stays until removed by hand (as EFI
    // variables do); only the persistent TPM's is kept at all.
    for vm in [p, "tpm"] {
        h.remove_vm_and_wait_gone(vm);
    }
    assert!(h.succeeds(&format!("[ -s {kept}/tpm2-00.permall ]")));
    assert!(h.succeeds("[ ! -e /var/lib/kvirt/efi-vars/default_tpm ]"));
    h.ok(&format!("rm -r {kept}"));
}

/// A NetworkAttachmentDefinition in the manifest directory: Debian's bridge
/// plugin on host bridge `kvtblue`, addresses from host-local in
/// `10.77.0.10`–`.11` (a pool of two).
const BLUE_NAD: &str = r#"apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: blue}
spec:
  config: '{"cniVersion":"1.0.0","type":"bridge","bridge":"kvtblue","ipam":{"type":"host-local","ranges":[[{"subnet":"10.77.0.0/24","rangeStart":"10.77.0.10","rangeEnd":"10.77.0.11"}]]}}'
"#;

/// A VM on the pod network and on `blue` (bridge binding); `user_data` a
/// script its cloud-init seed runs.
fn blue_vm(h: &Host, vm: &str, user_data: &str) {
    let mut manifest = support::vmi_manifest(
        vm,
        "",
        "  networks: [{name: default, pod: {}}, {name: blue, multus: {networkName: blue}}]\n",
        "      - name: ci\n        disk: {bus: virtio}\n      interfaces: [{name: default, masquerade: {}}, {name: blue, bridge: {}}]\n",
    );
    let script: String = user_data
        .lines()
        .map(|l| format!("        {l}\n"))
        .collect();
    manifest.push_str(&format!(
        "  - name: ci\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n{script}"
    ));
    h.put_manifest(vm, "run", &manifest);
}

fn blue_leases(h: &Host) -> String {
    h.ok("ls /var/lib/cni/networks/blue 2>/dev/null | grep '^10\\.' || true")
}

#[test]
fn vms_on_a_secondary_bridge_network_get_its_addresses_and_reach_each_other() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok(&format!(
        "cat > /etc/kvirt/vmis.d/blue-net.yaml <<'NAD'\n{BLUE_NAD}NAD"
    ));
    blue_vm(&h, "sec-a", "true");
    h.wait_phase("sec-a", "Running", BOOT);
    h.serial_log_shows("sec-a", "KVIRT-GUEST-IP-eth1 10.77.0.10");
    // The second VM's guest pings the first's over the secondary network.
    blue_vm(
        &h,
        "sec-b",
        "(while ! ping -c1 -W1 10.77.0.10 >/dev/null 2>&1; do sleep 1; done; echo KVIRT-PING-OK) &",
    );
    h.wait_phase("sec-b", "Running", BOOT);
    h.serial_log_shows("sec-b", "KVIRT-GUEST-IP-eth1 10.77.0.11");
    h.serial_log_shows("sec-b", "KVIRT-PING-OK");
    // The pod network works beside it.
    h.serial_log_shows("sec-b", "KVIRT-GUEST-IP 10.0.2.2 router=10.0.2.1");
    let st = h.status("sec-a");
    let blue = &st["status"]["interfaces"][1];
    assert_eq!(blue["name"], "blue", "{st}");
    assert_eq!(blue["ipAddress"], "10.77.0.10", "{st}");
    assert_eq!(blue["infoSource"], "domain, multus-status", "{st}");
    let pod_iface = blue["podInterfaceName"].as_str().unwrap().to_owned();
    assert!(
        pod_iface.starts_with("pod") && pod_iface.len() == 14,
        "{st}"
    );
    // Multus's network-status, as on a pod.
    let ns: serde_json::Value = serde_json::from_str(
        st["metadata"]["annotations"]["k8s.v1.cni.cncf.io/network-status"]
            .as_str()
            .unwrap_or_else(|| panic!("no network-status: {st}")),
    )
    .unwrap();
    assert_eq!(ns[1]["name"], "default/blue", "{ns}");
    assert_eq!(ns[1]["interface"], pod_iface.as_str(), "{ns}");
    assert_eq!(ns[1]["ips"], serde_json::json!(["10.77.0.10"]), "{ns}");
    // No spec MAC: the guest has the plugin's interface's, KubeVirt's
    // order (and its DHCP lease above, answered only to the guest's MAC,
    // shows the domain has it too).
    assert!(ns[1]["mac"].is_string(), "{ns}");
    assert_eq!(blue["mac"], ns[1]["mac"], "{st}");
    // Each attachment is recorded where libcni keeps them.
    let uid = st["metadata"]["uid"].as_str().unwrap();
    h.ok(&format!(
        "test -s /var/lib/cni/results/blue-{uid}-{pod_iface}"
    ));
    // Inside the VM's namespace: KubeVirt's bridge binding, the tap the
    // VM's user's, the stand-in holding the plugin's address.
    let links = h.ok("ip netns exec kvirt-default_sec-a ip -o link show");
    let hash = &pod_iface[3..];
    for l in [
        format!("{hash}-nic"),
        format!("k6t-{hash}"),
        format!("tap{hash}"),
    ] {
        assert!(links.contains(&l), "{l}: {links}");
    }
    let addrs = h.ok(&format!(
        "ip netns exec kvirt-default_sec-a ip -o addr show {pod_iface}"
    ));
    assert!(addrs.contains("10.77.0.10/24"), "{addrs}");

    // The pool is used up: a third VM's ADD fails, is undone, and its VMI
    // says why; the others run on.
    blue_vm(&h, "sec-c", "true");
    h.wait_phase("sec-c", "Failed", BOOT);
    let why = h.status("sec-c").to_string();
    assert!(why.contains("no IP addresses available"), "{why}");
    assert_eq!(blue_leases(&h), "10.77.0.10\n10.77.0.11");
    assert_eq!(h.phase("sec-a").as_deref(), Some("Running"));

    // kvirtd restarts under them: the VMs run on, their DHCP is served again.
    let qemu = h.qemu_pid("sec-a");
    h.restart_kvirtd();
    h.wait(
        "sec-a's DHCP server on blue again",
        Duration::from_secs(60),
        &format!("ip netns exec kvirt-default_sec-a ss -lun | grep -q '%k6t-{hash}:67'"),
    );
    assert_eq!(h.qemu_pid("sec-a"), qemu);

    // The network's config changes before the VMs go: DEL uses the
    // recorded one. sec-a goes while kvirtd is down: the next kvirtd finds
    // its attachment in the records and deletes it.
    h.ok("sed -i 's/\"bridge\",\"bridge\"/\"nosuchplugin\",\"bridge\"/' /etc/kvirt/vmis.d/blue-net.yaml");
    h.ok("systemctl stop kvirtd && rm /etc/kvirt/vmis.d/sec-a.yaml && systemctl start kvirtd");
    h.wait_gone("sec-a");
    h.ok("rm -f /var/lib/kvirt/images/sec-a.raw");
    assert_eq!(blue_leases(&h), "10.77.0.11");
    h.ok(&format!("! ls /var/lib/cni/results | grep -q {uid}"));
    for vm in ["sec-b", "sec-c"] {
        h.remove_vm_and_wait_gone(vm);
    }
    assert_eq!(blue_leases(&h), "");
    h.ok("! ls /var/lib/cni/results | grep -q blue-");
    // A port whose peer was in a namespace just deleted goes when the
    // kernel has finished with that namespace (asynchronously): waited
    // for, with a deadline, not assumed (ci-13b saw one a moment later).
    h.wait(
        "no port left on kvtblue",
        Duration::from_secs(30),
        "[ -z \"$(ip -o link show master kvtblue)\" ]",
    );
    h.ok("rm -f /etc/kvirt/vmis.d/blue-net.yaml && ip link del kvtblue");
}

/// `amber`: bridge + host-local, then `held-tuning`, a stand-in that
/// waits before each command (`/run/kvirt-held-<CMD>` says it is waiting)
/// until the test releases it (`/run/kvirt-release-<CMD>`), then is tuning.
const AMBER_NAD: &str = r#"apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: amber}
spec:
  config: '{"cniVersion":"1.0.0","plugins":[{"type":"bridge","bridge":"kvtamber","ipam":{"type":"host-local","ranges":[[{"subnet":"10.78.0.0/24"}]]}},{"type":"held-tuning"}]}'
"#;

fn amber_vm(h: &Host, vm: &str) {
    let manifest = support::vmi_manifest(
        vm,
        "",
        "  networks: [{name: default, pod: {}}, {name: amber, multus: {networkName: amber}}]\n",
        "      interfaces: [{name: default, masquerade: {}}, {name: amber, bridge: {}}]\n",
    );
    h.put_manifest(vm, "run", &manifest);
}

fn amber_records(h: &Host) -> usize {
    h.ok("ls /var/lib/cni/results | grep -c '^amber-' || true")
        .parse()
        .unwrap()
}

fn amber_leases(h: &Host) -> usize {
    h.ok("ls /var/lib/cni/networks/amber 2>/dev/null | grep -c '^10\\.' || true")
        .parse()
        .unwrap()
}

/// kvirtd killed (`systemctl kill -s KILL`, its plugins with it) at a
/// chain's exact points: between the two plugins of an ADD (the first's
/// lease and port made, the record written) and between them on DEL. Each
/// next kvirtd converges from the records: the VM runs after all, then goes
/// leaving no lease, port or record; another VM on the network runs on
/// untouched throughout.
#[test]
fn kvirtd_killed_between_a_chains_plugins_converges_from_the_records() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok("mkdir -p /opt/cni/bin && cat > /opt/cni/bin/held-tuning <<'SH'\n#!/bin/sh\ntouch /run/kvirt-held-$CNI_COMMAND\nwhile [ ! -e /run/kvirt-release-$CNI_COMMAND ]; do sleep 0.1; done\nexec /usr/lib/cni/tuning\nSH\nchmod 755 /opt/cni/bin/held-tuning && rm -f /run/kvirt-held-* /run/kvirt-release-*");
    h.ok(&format!(
        "cat > /etc/kvirt/vmis.d/amber-net.yaml <<'NAD'\n{AMBER_NAD}NAD"
    ));
    h.ok("touch /run/kvirt-release-ADD /run/kvirt-release-DEL /run/kvirt-release-CHECK");
    amber_vm(&h, "amb-a");
    h.wait_phase("amb-a", "Running", BOOT);
    let witness = h.qemu_pid("amb-a");
    let kill = |h: &Host| {
        let before = h.ok("systemctl show -P NRestarts kvirtd");
        // Every process of kvirtd's unit (the held plugin too): with
        // `KillMode=process` a crash of kvirtd alone would leave the plugin
        // running on (see the note in docs/networking.md).
        h.ok("systemctl kill -s KILL kvirtd");
        h.wait(
            "kvirtd restarted",
            Duration::from_secs(60),
            &format!(
                "systemctl is-active -q kvirtd && [ \"$(systemctl show -P NRestarts kvirtd)\" -gt {before} ]"
            ),
        );
    };

    // Between the plugins of an ADD.
    h.ok("rm -f /run/kvirt-release-ADD /run/kvirt-held-ADD");
    amber_vm(&h, "amb-b");
    h.wait(
        "amb-b's ADD held after bridge",
        BOOT,
        "[ -e /run/kvirt-held-ADD ]",
    );
    assert_eq!(
        amber_records(&h),
        2,
        "amb-b's record, before its plugins ran"
    );
    assert_eq!(amber_leases(&h), 2, "the first plugin's lease is made");
    kill(&h);
    h.ok("touch /run/kvirt-release-ADD");
    h.wait_phase("amb-b", "Running", BOOT);
    assert_eq!(amber_leases(&h), 2, "the cut-short ADD was undone");
    assert_eq!(h.qemu_pid("amb-a"), witness);

    // Between the plugins of a DEL (tuning's comes first).
    h.ok("rm -f /run/kvirt-release-DEL /run/kvirt-held-DEL");
    h.ok("rm /etc/kvirt/vmis.d/amb-b.yaml");
    h.wait("amb-b's DEL held", BOOT, "[ -e /run/kvirt-held-DEL ]");
    kill(&h);
    h.ok("touch /run/kvirt-release-DEL");
    h.wait_gone("amb-b");
    h.ok("rm -f /var/lib/kvirt/images/amb-b.raw");
    assert_eq!(amber_leases(&h), 1);
    assert_eq!(amber_records(&h), 1);
    assert_eq!(h.qemu_pid("amb-a"), witness);
    assert_eq!(h.phase("amb-a").as_deref(), Some("Running"));

    h.remove_vm_and_wait_gone("amb-a");
    assert_eq!(amber_leases(&h), 0);
    h.ok("! ls /var/lib/cni/results | grep -q amber-");
    h.wait(
        "no port left on kvtamber",
        Duration::from_secs(30),
        "[ -z \"$(ip -o link show master kvtamber)\" ]",
    );
    h.ok("rm -f /etc/kvirt/vmis.d/amber-net.yaml /opt/cni/bin/held-tuning /run/kvirt-held-* /run/kvirt-release-* && ip link del kvtamber");
}

/// A chained config (bridge, then tuning with the `mac` capability) with
/// static addressing, as a VM's only network: the guest takes the spec's
/// MAC, is handed the static address and gateway by DHCP, and answers the
/// host across the network's bridge (the plugin's gateway).
#[test]
fn a_chained_static_network_alone_serves_the_guest_with_the_specs_mac() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok(
        "cat > /etc/kvirt/vmis.d/green-net.yaml <<'NAD'
apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {name: green}
spec:
  config: '{\"cniVersion\":\"1.0.0\",\"name\":\"green\",\"plugins\":[{\"type\":\"bridge\",\"bridge\":\"kvtgreen\",\"isGateway\":true,\"ipam\":{\"type\":\"static\",\"addresses\":[{\"address\":\"10.79.0.5/24\",\"gateway\":\"10.79.0.1\"}]}},{\"type\":\"tuning\",\"capabilities\":{\"mac\":true}}]}'
NAD",
    );
    let manifest = support::vmi_manifest(
        "sec-green",
        "",
        "  networks: [{name: green, multus: {networkName: green}}]\n",
        "      interfaces: [{name: green, bridge: {}, macAddress: '02:00:00:00:79:05'}]\n",
    );
    h.put_manifest("sec-green", "run", &manifest);
    h.wait_phase("sec-green", "Running", BOOT);
    // Its only NIC is the guest's eth0.
    h.serial_log_shows("sec-green", "KVIRT-GUEST-IP 10.79.0.5 router=10.79.0.1");
    let st = h.status("sec-green");
    let green = &st["status"]["interfaces"][0];
    assert_eq!(green["name"], "green", "{st}");
    assert_eq!(green["mac"], "02:00:00:00:79:05", "{st}");
    assert_eq!(green["ipAddress"], "10.79.0.5", "{st}");
    assert_eq!(
        st["status"]["interfaces"].as_array().unwrap().len(),
        1,
        "{st}"
    );
    // The host reaches the guest through the plugin's bridge.
    h.wait(
        "the guest answering on green",
        Duration::from_secs(60),
        "busybox ping -c1 -W1 10.79.0.5 >/dev/null",
    );
    let arp = h.ok("ip neigh show 10.79.0.5");
    assert!(arp.contains("02:00:00:00:79:05"), "{arp}");
    h.remove_vm_and_wait_gone("sec-green");
    h.ok("! ls /var/lib/cni/results 2>/dev/null | grep -q green-");
    let ports = h.ok("ip -o link show master kvtgreen || true");
    assert!(ports.is_empty(), "{ports}");
    h.ok("rm -f /etc/kvirt/vmis.d/green-net.yaml && ip link del kvtgreen");
}

/// The mechanism kvirt's migration stands on, driven through kvirt's own
/// adapter (`host::migrate::LiveMigration` on `host::libvirt::Libvirt`):
/// two session libvirt daemons, run as the VMs' own are (transient units,
/// kvirt's user), move a live guest peer-to-peer with every connection on
/// a unix socket (`qemu+unix:///session?socket=`, a `unix://` migration
/// URI), as KubeVirt's virt-launchers do. First a throttled migration is
/// aborted midway (the guest runs on at the source); then one completes:
/// the target runs the same domain, the source keeps nothing, and the
/// guest's counter on its serial console (one file both QEMUs append to)
/// goes on from where it was, never restarting.
#[test]
fn two_session_daemons_move_a_live_guest_over_unix_sockets_only() {
    use kvirt::host::libvirt::{DomainRef, Libvirt};
    use kvirt::host::migrate::{LiveMigration, MigrateTo};
    let Some(h) = host() else { return };
    let _g = h.turn();
    let pair = SessionPair::start(&h, "/var/tmp/kvirt-mig-mechanism");
    let (dir, inside) = (pair.dir, |side: &str| pair.uri(side));
    let counter = || -> Vec<u64> {
        h.ok(&format!(
            "grep -ao 'KVIRT-GUEST-ALIVE [0-9]*' {dir}/serial.log | cut -d' ' -f2 || true"
        ))
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect()
    };
    let counts_past = |n: u64| {
        h.wait_until(&format!("the counter past {n}"), BOOT, || {
            counter().last().is_some_and(|&c| c > n)
        })
    };
    counts_past(1);

    // kvirt's adapter, from this (the machine's) side: the source daemon's
    // socket through the test host's root; the target as the source
    // daemon, inside the test host, dials it.
    let source = DomainRef {
        id: "mechanism".into(),
        uri: format!(
            "qemu+unix:///session?socket=/proc/{}/root{dir}/a/run/libvirt/virtqemud-sock",
            h.pid
        ),
        name: "mig".into(),
        socket: None,
    };
    let to = MigrateTo {
        daemon_socket: format!("{dir}/b/run/libvirt/virtqemud-sock").into(),
        memory_socket: format!("{dir}/shared/memory.sock").into(),
        disks_socket: format!("{dir}/shared/disks.sock").into(),
        copied_disks: vec![],
        dest_xml: None,
        bandwidth_mib: Some(1),
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let lv = Libvirt::new(tx);
    let on = |side: &str| h.ok(&format!("virsh -q -c '{}' list --all --name", inside(side)));
    rt.block_on(async {
        // Throttled to 1 MiB/s: still running when it is aborted.
        let job = {
            let (lv, source, to) = (lv.clone(), source.clone(), to.clone());
            tokio::spawn(async move { lv.migrate(&source, &to, Duration::from_secs(600)).await })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let progress = loop {
            match lv.progress(&source).await.unwrap() {
                Some(p) if p.data_processed > 0 => break p,
                _ if std::time::Instant::now() > deadline => panic!("no migration job seen"),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        assert!(progress.data_remaining > 0, "{progress:?}");
        lv.abort(&source).await.unwrap();
        let aborted = job.await.unwrap();
        assert!(aborted.is_err(), "{aborted:?}");
    });
    assert_eq!(
        on("a"),
        "mig",
        "the aborted migration left the VM running at the source"
    );
    assert_eq!(on("b"), "", "and nothing at the target");
    let before = *counter().last().unwrap();
    counts_past(before);

    let full = MigrateTo {
        bandwidth_mib: None,
        ..to
    };
    rt.block_on(lv.migrate(&source, &full, Duration::from_secs(300)))
        .unwrap();
    assert_eq!(on("a"), "", "the source keeps nothing");
    assert_eq!(on("b"), "mig");
    assert_eq!(
        h.ok(&format!("virsh -q -c '{}' domstate mig", inside("b"))),
        "running"
    );
    let moved = *counter().last().unwrap();
    counts_past(moved + 1);
    let all = counter();
    assert!(
        all.windows(2).all(|w| w[1] == w[0] + 1),
        "the counter never restarts, repeats or skips back: {all:?}"
    );
    assert_eq!(
        h.ok(&format!("grep -ac KVIRT-GUEST-READY {dir}/serial.log")),
        "1",
        "booted once, never again"
    );
    pair.stop();
}

/// Two session libvirt daemons on host `h`, as the VMs' own run (transient
/// units, kvirt's user), with a guest `mig` running in daemon `a` whose
/// serial console both QEMUs append to `<dir>/serial.log`.
struct SessionPair<'h> {
    h: &'h Host,
    dir: &'static str,
}

impl<'h> SessionPair<'h> {
    fn unit(&self, side: &str) -> String {
        format!("kvirt-sessions{}-{side}", self.dir.replace('/', "-"))
    }

    /// The daemon's URI, as seen inside the test host.
    fn uri(&self, side: &str) -> String {
        format!(
            "qemu+unix:///session?socket={}/{side}/run/libvirt/virtqemud-sock",
            self.dir
        )
    }

    fn start(h: &'h Host, dir: &'static str) -> Self {
        let pair = SessionPair { h, dir };
        let (ua, ub) = (pair.unit("a"), pair.unit("b"));
        let mut setup = format!(
            "systemctl stop {ua} {ub} 2>/dev/null || true
             systemctl reset-failed {ua} {ub} 2>/dev/null || true
             rm -rf {dir}; mkdir -p {dir}/shared
             cp /srv/guest/run.raw {dir}/run.raw\n"
        );
        for side in ["a", "b"] {
            setup += &format!(
                "mkdir -p {dir}/{side}/config/libvirt {dir}/{side}/run {dir}/{side}/cache
                 printf 'keepalive_interval = -1\\n' > {dir}/{side}/config/libvirt/virtqemud.conf
                 chown -R kvirt:kvirt {dir}
                 systemd-run --collect --unit={u} -p User=kvirt -p Group=kvirt \
                   -E HOME={dir}/{side} -E XDG_RUNTIME_DIR={dir}/{side}/run \
                   -E XDG_CONFIG_HOME={dir}/{side}/config -E XDG_CACHE_HOME={dir}/{side}/cache \
                   /usr/sbin/virtqemud --timeout 0
                 for i in $(seq 100); do [ -S {dir}/{side}/run/libvirt/virtqemud-sock ] && break; sleep 0.1; done\n",
                u = pair.unit(side)
            );
        }
        h.ok(&setup);
        let xml = format!(
            "<domain type='qemu'><name>mig</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>
               <os><type arch='x86_64' machine='q35'>hvm</type></os>
               <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>
                 <disk type='file' device='disk'><driver name='qemu' type='raw'/>
                   <source file='{dir}/run.raw'/><target dev='vda' bus='virtio'/><readonly/></disk>
                 <serial type='file'><source path='{dir}/serial.log' append='on'/></serial>
                 <memballoon model='none'/></devices></domain>"
        );
        h.ok(&format!(
            "cat > {dir}/dom.xml <<'XML'\n{xml}\nXML
             virsh -q -c '{a}' create {dir}/dom.xml",
            a = pair.uri("a")
        ));
        pair
    }

    /// The domains daemon `side` has, by name.
    fn domains(&self, side: &str) -> String {
        self.h.ok(&format!(
            "virsh -q -c '{}' list --all --name",
            self.uri(side)
        ))
    }

    fn stop(&self) {
        self.h.ok(&format!(
            "systemctl stop {} {}; rm -rf {}",
            self.unit("a"),
            self.unit("b"),
            self.dir
        ));
    }
}

/// What kvirt's migration must be built around (measured, so guarded):
/// a peer-to-peer migration is the source daemon's job, not its client's.
/// The client that asked for it (kvirtd, in kvirt) dying midway does not
/// stop it: the source daemon completes it, and the VM ends up at the
/// target alone. A kvirtd restarted meanwhile must therefore know the VM
/// was leaving, and never start it again at the source.
#[test]
fn a_migration_goes_on_when_the_client_that_asked_for_it_dies() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    let pair = SessionPair::start(&h, "/var/tmp/kvirt-mig-client");
    let dir = pair.dir;
    h.wait(
        "the guest counting",
        BOOT,
        &format!("grep -aq 'KVIRT-GUEST-ALIVE 2' {dir}/serial.log"),
    );
    // The client: virsh, killed once the job is seen moving (throttled to
    // 2 MiB/s so that it is still running then).
    h.ok(&format!(
        "virsh -q -c '{a}' migrate --live --p2p --persistent --undefinesource --bandwidth 2 \
           mig '{b}' --migrateuri unix://{dir}/shared/memory.sock >/dev/null 2>&1 &
         client=$!
         for i in $(seq 200); do
           virsh -q -c '{a}' domjobinfo mig 2>/dev/null | grep -q 'Outgoing migration' && break
           sleep 0.1
         done
         virsh -q -c '{a}' domjobinfo mig | grep -q 'Outgoing migration'
         kill -9 $client",
        a = pair.uri("a"),
        b = pair.uri("b")
    ));
    h.wait_until("the migration done without its client", BOOT, || {
        pair.domains("a").is_empty() && pair.domains("b") == "mig"
    });
    assert_eq!(
        h.ok(&format!("virsh -q -c '{}' domstate mig", pair.uri("b"))),
        "running"
    );
    pair.stop();
}

/// kvirtd's migration port (`[migration] listen`) lets only kvirt's peers
/// in: a client without a certificate, or with one of another CA, is
/// refused at the handshake and gets no byte; kvirt's own certificate
/// completes it, and a migration this host has not prepared is cut cleanly.
#[test]
fn the_migration_port_answers_only_kvirts_peers() {
    let Some(h) = host() else { return };
    let _g = h.turn();
    h.ok("rm -rf /var/tmp/kvirt-pki /var/tmp/other-pki
          kvirtd --make-api-pki /var/tmp/kvirt-pki >/dev/null
          kvirtd --make-api-pki /var/tmp/other-pki >/dev/null
          mkdir -p /etc/kvirt/kvirtd.toml.d
          printf '[migration]\\nlisten = \"127.0.0.1:8444\"\\n[api]\\ncert = \"/var/tmp/kvirt-pki/api.crt\"\\nkey = \"/var/tmp/kvirt-pki/api.key\"\\nca = \"/var/tmp/kvirt-pki/api-ca.crt\"\\n' \
            > /etc/kvirt/kvirtd.toml.d/60-migration.toml");
    h.restart_kvirtd();
    h.wait(
        "the migration port",
        Duration::from_secs(30),
        "ss -ltnH 'sport = :8444' | grep -q LISTEN",
    );
    support::assert_migration_port_lets_in_only(
        &h,
        "127.0.0.1:8444",
        "/var/tmp/kvirt-pki",
        "/var/tmp/other-pki",
    );
    h.ok("rm -f /etc/kvirt/kvirtd.toml.d/60-migration.toml; rm -rf /var/tmp/kvirt-pki /var/tmp/other-pki");
    h.restart_kvirtd();
    assert!(!h.succeeds("ss -ltnH 'sport = :8444' | grep -q LISTEN"));
}
