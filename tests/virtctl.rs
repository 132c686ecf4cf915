//! Tier 3 with a cluster: KubeVirt's own `virtctl` (v1.9.0, built from its
//! Go module) against the `subresources.kubevirt.io` API every kvirtd
//! serves behind the real kube-apiserver's aggregator, and raw requests to
//! each kvirtd's port (to prove forwarding and authentication). Run by
//! `tests/run-all` with `KVIRT_K8S_A_PID` and `KVIRT_K8S_B_PID`; without
//! them these tests pass vacuously.

mod support;

use std::time::Duration;
use support::Host;

const WAIT: Duration = Duration::from_secs(90);
const NODE_A: &str = "10.250.0.1:8443";
const NODE_B: &str = "10.250.0.2:8443";
const SUB: &str = "/apis/subresources.kubevirt.io/v1/namespaces/default";

fn hosts() -> Option<(Host, Host)> {
    Some((
        support::host("KVIRT_K8S_A_PID")?,
        support::host("KVIRT_K8S_B_PID")?,
    ))
}

fn api_available(a: &Host) {
    a.ok("kubectl wait --for=condition=Available --timeout=90s apiservice/v1.subresources.kubevirt.io");
}

/// A running VMI on `node` (`a` or `b`), its disk on that host.
fn running_vmi(a: &Host, on: &Host, name: &str, node: &str) {
    on.ok(&format!(
        "cp /srv/guest/run.raw /var/lib/kvirt/images/{name}.raw"
    ));
    let yaml = support::vmi_manifest(name, &format!("kubevirt.io/nodeName: {node}"), "", "");
    a.ok(&format!("kubectl apply -f - <<'VMI'\n{yaml}VMI"));
    a.ok(&format!(
        "kubectl wait vmi/{name} --for=jsonpath='{{.status.phase}}'=Running --timeout=90s"
    ));
    on.wait(
        "the guest's first marker",
        WAIT,
        &format!("grep -q KVIRT-GUEST-ALIVE /run/kvirt/vms/default_{name}/console.log"),
    );
}

fn delete_vmi(a: &Host, name: &str) {
    a.ok(&format!("kubectl delete vmi {name} --timeout=60s"));
}

/// Waits until the VMI's condition `type_` has status `want` ("" for absent).
fn wait_condition(a: &Host, name: &str, type_: &str, want: &str) {
    a.wait(
        &format!("{name}: {type_}={want:?}"),
        WAIT,
        &format!(
            "[ \"$(kubectl get vmi {name} -o jsonpath='{{.status.conditions[?(@.type==\"{type_}\")].status}}')\" = '{want}' ]"
        ),
    );
}

fn condition(a: &Host, name: &str, type_: &str) -> String {
    a.ok(&format!(
        "kubectl get vmi {name} -o jsonpath='{{.status.conditions[?(@.type==\"{type_}\")].status}}'"
    ))
}

/// One raw HTTP/1.1 exchange with the kvirtd at `addr`, made in host A
/// (which shares its network with B): `cert` names the client certificate
/// (`front-proxy-client`, `admin`, or none), `headers` more lines. Reads
/// until the answer holds `until` (or the peer closes), at most 30 s.
fn raw(
    a: &Host,
    addr: &str,
    method: &str,
    path: &str,
    cert: Option<&str>,
    headers: &str,
    until: &str,
) -> String {
    let cert = cert
        .map(|c| format!(",cert=/etc/kvirt/pki/{c}.crt,key=/etc/kvirt/pki/{c}.key"))
        .unwrap_or_default();
    a.ok(&format!(
        "out=$(mktemp) fifo=$(mktemp -u) && mkfifo $fifo
         deframe() {{ perl -0777 -e '{DEFRAME}' <$out; }}
         timeout 40 socat -t 1 - OPENSSL:{addr},cafile=/etc/kvirt/pki/api-ca.crt,commonname=kvirt-api.kvirt.svc{cert} <$fifo >$out 2>/dev/null &
         pid=$!
         {{ printf '{method} {path} HTTP/1.1\\r\\nHost: kvirt-api.kvirt.svc\\r\\nContent-Length: 0\\r\\n{headers}\\r\\n'
            for i in $(seq 300); do deframe | grep -aq -- '{until}' && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
         }} >$fifo
         wait $pid || true
         deframe | cat -v"
    ))
}

/// The response as a client reads it: the head as it came, then, after a
/// `101`, the payload of each WebSocket frame without the frame's header.
/// The console's bytes come in as many frames as the guest's writes took
/// (`KVIRT-GUEST-ALIV` in one, `E 3` in the next), so the raw stream need
/// not hold a line whole. Server frames are never masked (RFC 6455 5.1).
/// Perl without a single quote: it is put between the shell's.
const DEFRAME: &str = r#"
    local $/; my $s = <STDIN>; my $h = index($s, "\r\n\r\n");
    if ($h < 0 || substr($s, 0, 12) ne "HTTP/1.1 101") { print $s; exit }
    print substr($s, 0, $h + 4); my $p = $h + 4;
    while ($p + 2 <= length $s) {
        my $n = ord(substr($s, $p + 1, 1)) & 127; $p += 2;
        if ($n == 126) { last if $p + 2 > length $s; $n = unpack("n", substr($s, $p, 2)); $p += 2 }
        elsif ($n == 127) { last if $p + 8 > length $s; $n = unpack("Q>", substr($s, $p, 8)); $p += 8 }
        print substr($s, $p, $n); $p += $n;
    }
"#;

const ADMIN: &str = "X-Remote-User: kvirt-test-admin\\r\\nX-Remote-Group: system:masters\\r\\n";

fn upgrade(user: &str) -> String {
    format!(
        "{user}Upgrade: websocket\\r\\nConnection: Upgrade\\r\\nSec-WebSocket-Version: 13\\r\\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\nSec-WebSocket-Protocol: plain.kubevirt.io\\r\\n"
    )
}

#[test]
fn the_api_is_registered_available_and_discoverable() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    let list = a.ok("kubectl get --raw /apis/subresources.kubevirt.io/v1");
    for r in [
        "virtualmachineinstances/console",
        "virtualmachineinstances/vnc",
        "virtualmachineinstances/pause",
        "virtualmachines/start",
    ] {
        assert!(list.contains(r), "{r} in {list}");
    }
    // virtctl compares the server's version with its own, and is silent.
    let v = a.ok("virtctl version 2>&1");
    assert!(
        v.contains("Server Version: version.Info{GitVersion:\"v1.9.0\""),
        "{v}"
    );
    // Each kvirtd published its own address, ready, and its own slice.
    let ep = a.ok("kubectl -n kvirt get endpoints kvirt-api -o jsonpath='{.subsets[*].addresses[*].nodeName}'");
    assert!(ep.contains("node-a") && ep.contains("node-b"), "{ep}");
    let slices = a.ok(
        "kubectl -n kvirt get endpointslices -l endpointslice.kubernetes.io/managed-by=kvirt.io \
         -o jsonpath='{.items[*].metadata.name}'",
    );
    assert!(
        slices.contains("kvirt-api-node-a") && slices.contains("kvirt-api-node-b"),
        "{slices}"
    );
}

#[test]
fn virtctl_pauses_unpauses_and_reads_the_guest_on_either_host() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    running_vmi(&a, &a, "v-pa", "node-a");
    running_vmi(&a, &b, "v-pb", "node-b");
    // The aggregator picks either kvirtd: each call reaches the VMI's host
    // directly or through the other one.
    for name in ["v-pa", "v-pb"] {
        for _ in 0..2 {
            let out = a.ok(&format!("virtctl pause vmi {name}"));
            assert!(
                out.contains(&format!("VMI {name} was scheduled to pause")),
                "{out}"
            );
            wait_condition(&a, name, "Paused", "True");
            let again = a.sh(&format!("virtctl pause vmi {name} 2>&1"));
            assert!(!again.status.success());
            assert!(String::from_utf8_lossy(&again.stdout).contains("VMI is already paused"));
            a.ok(&format!("virtctl unpause vmi {name}"));
            wait_condition(&a, name, "Paused", "");
        }
        wait_condition(&a, name, "AgentConnected", "True");
        let info = a.ok(&format!("virtctl guestosinfo {name}"));
        assert!(info.contains("kvirt test guest"), "{info}");
        let users = a.ok(&format!("virtctl userlist {name}"));
        assert!(users.contains("\"userName\": \"kvirt\""), "{users}");
        let fs = a.ok(&format!("virtctl fslist {name}"));
        assert!(fs.contains("\"mountPoint\": \"/\""), "{fs}");
    }
    assert_eq!(condition(&a, "v-pa", "Paused"), "");
    // A soft reboot goes to the guest agent: the guest says so and boots
    // again in the same QEMU.
    let qemu = a.ok("systemctl show -p MainPID --value kvirt-vm@default_v-pa.service");
    let out = a.ok("virtctl soft-reboot v-pa");
    assert!(
        out.contains("VMI v-pa was scheduled to soft-reboot"),
        "{out}"
    );
    a.wait(
        "the guest rebooting through its agent",
        WAIT,
        "grep -q KVIRT-GUEST-AGENT-REBOOT /run/kvirt/vms/default_v-pa/console.log",
    );
    assert_eq!(
        a.ok("systemctl show -p MainPID --value kvirt-vm@default_v-pa.service"),
        qemu
    );
    delete_vmi(&a, "v-pa");
    delete_vmi(&a, "v-pb");
}

#[test]
fn virtctl_console_reads_and_types_and_a_new_session_takes_over() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    running_vmi(&a, &b, "v-con", "node-b");
    // The guest's marker read, then a typed line echoed back by its tty.
    let out = a.ok("out=$(mktemp)
         { for i in $(seq 300); do grep -aq KVIRT-GUEST-ALIVE $out && break; sleep 0.1; done
           printf 'kvirt-typed-line\\r'
           for i in $(seq 300); do grep -aq kvirt-typed-line $out && break; sleep 0.1; done
         } | timeout 60 virtctl console v-con >$out 2>&1 || true
         cat -v $out");
    assert!(out.contains("KVIRT-GUEST-ALIVE"), "{out}");
    assert!(out.contains("kvirt-typed-line"), "{out}");
    // A second session takes the console over: the first is closed saying why.
    let out = a.ok("first=$(mktemp) second=$(mktemp)
         (sleep 100 | timeout 60 virtctl console v-con >$first 2>&1) &
         for i in $(seq 300); do grep -aq KVIRT-GUEST-ALIVE $first && break; sleep 0.1; done
         { for i in $(seq 300); do grep -aq KVIRT-GUEST-ALIVE $second && break; sleep 0.1; done; } |
           timeout 60 virtctl console v-con >$second 2>&1 || true
         for i in $(seq 300); do grep -aq 'took over' $first && break; sleep 0.1; done
         cat -v $first; echo '--- the second session:'; cat -v $second");
    assert!(
        out.contains("a new connection took over the session"),
        "{out}"
    );
    // kvirtctl's console goes the same way, as the user of ~/.kube/config.
    let out = a.ok("out=$(mktemp)
         kvirtctl console default/v-con </dev/null >$out 2>&1 &
         pid=$!
         for i in $(seq 300); do grep -aq KVIRT-GUEST-ALIVE $out && break; sleep 0.1; done
         kill $pid || true
         cat -v $out");
    assert!(out.contains("KVIRT-GUEST-ALIVE"), "{out}");
    // The benchmark's console figures (tests/bench --console), 3 sessions.
    // In base64: systemd-run, which runs each test command, would expand
    // the script's `${...}` itself.
    let script = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        include_str!("bench.d/console-rtt.sh"),
    );
    let json = a.ok(&format!(
        "echo {script} | base64 -d >/tmp/console-rtt.sh && bash /tmp/console-rtt.sh 3 v-con"
    ));
    eprintln!("console through the API server: {json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["open_us"]["p50"].as_u64().unwrap() > 0, "{json}");
    assert!(v["echo_us"]["p50"].as_u64().unwrap() > 0, "{json}");
    delete_vmi(&a, "v-con");
}

#[test]
fn each_kvirtd_serves_or_forwards_and_strangers_get_nothing() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    running_vmi(&a, &a, "v-fw", "node-a");
    let vmi = |sub: &str| format!("{SUB}/virtualmachineinstances/v-fw/{sub}");
    for addr in [NODE_A, NODE_B] {
        // As the API server's front proxy, for an admin.
        let front = |method: &str, path: &str, websocket: bool, until: &str| {
            let headers = if websocket {
                upgrade(ADMIN)
            } else {
                ADMIN.to_owned()
            };
            raw(
                &a,
                addr,
                method,
                path,
                Some("front-proxy-client"),
                &headers,
                until,
            )
        };
        // Console bytes and the VNC handshake, from the host that runs the
        // VMI (A) and through the other (B), byte for byte.
        let out = front("GET", &vmi("console"), true, "KVIRT-GUEST-ALIVE");
        assert!(out.starts_with("HTTP/1.1 101"), "{addr}: {out}");
        assert!(out.contains("KVIRT-GUEST-ALIVE"), "{addr}: {out}");
        let out = front("GET", &vmi("vnc"), true, "RFB 003.008");
        assert!(out.contains("RFB 003.008"), "{addr}: {out}");
        for (sub, paused) in [("pause", "True"), ("unpause", "")] {
            let out = front("PUT", &vmi(sub), false, "HTTP/1.1");
            assert!(out.starts_with("HTTP/1.1 200"), "{addr} {sub}: {out}");
            wait_condition(&a, "v-fw", "Paused", paused);
        }

        // No client certificate: 401, and not one byte of the console.
        let console = vmi("console");
        let out = raw(
            &a,
            addr,
            "GET",
            &console,
            None,
            &upgrade(ADMIN),
            "Unauthorized",
        );
        assert!(out.starts_with("HTTP/1.1 401"), "{addr}: {out}");
        assert!(!out.contains("KVIRT-GUEST"), "{addr}: {out}");
        // A certificate of the cluster's CA (not the front proxy's) naming
        // a user in headers: a forged user, refused in the TLS handshake.
        let out = raw(
            &a,
            addr,
            "GET",
            &console,
            Some("admin"),
            &upgrade(ADMIN),
            "KVIRT-GUEST-ALIVE",
        );
        assert!(!out.contains("HTTP/1.1"), "{addr}: {out}");
    }
    delete_vmi(&a, "v-fw");
}

#[test]
fn a_user_bound_to_view_reads_the_guest_but_cannot_touch_it() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    running_vmi(&a, &a, "v-view", "node-a");
    a.ok(
        "kubectl create rolebinding kvirt-viewer --clusterrole=kvirt.io:view --user=kvirt-viewer \
          --dry-run=client -o yaml | kubectl apply -f -",
    );
    let viewer = "KUBECONFIG=/etc/kvirt/kubeconfigs/kvirt-viewer.kubeconfig";
    wait_condition(&a, "v-view", "AgentConnected", "True");
    let info = a.ok(&format!("{viewer} virtctl guestosinfo v-view"));
    assert!(info.contains("kvirt test guest"), "{info}");
    for cmd in [
        "console v-view --timeout 1",
        "pause vmi v-view",
        "stop v-view",
    ] {
        let out = a.sh(&format!(
            "{viewer} timeout 60 virtctl {cmd} </dev/null 2>&1"
        ));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success() && text.contains("forbidden"),
            "{cmd}: {text}"
        );
    }
    assert_eq!(condition(&a, "v-view", "Paused"), "");
    delete_vmi(&a, "v-view");
}

#[test]
fn virtctl_starts_stops_and_restarts_a_vm() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    a.ok("cp /srv/guest/run.raw /var/lib/kvirt/images/v-vm.raw");
    let vm = support::vm_manifest(
        "v-vm",
        "Halted",
        "  nodeSelector: {kvirt.io/host: node-a}\n",
    );
    a.ok(&format!("kubectl apply -f - <<'VM'\n{vm}VM"));
    // expand: the VMI spec kvirt would run (its defaults filled in).
    let out = a.ok("virtctl expand --vm v-vm -o json");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["metadata"]["name"], "v-vm", "{out}");
    assert!(
        v["spec"]["template"]["spec"]["domain"]["firmware"]["uuid"].is_string(),
        "{out}"
    );
    // start --paused: the VMI starts with its vCPUs stopped, the VM is Always.
    let out = a.ok("virtctl start --paused v-vm");
    assert!(out.contains("VM v-vm was scheduled to start"), "{out}");
    a.wait(
        "the VM shown Paused",
        WAIT,
        "kubectl get vm v-vm -o jsonpath='{.status.printableStatus}' | grep -qx Paused",
    );
    let vmi_field = |f: &str| a.ok(&format!("kubectl get vmi v-vm -o jsonpath='{{{f}}}'"));
    assert_eq!(vmi_field(".spec.startStrategy"), "Paused");
    assert_eq!(vmi_field(".status.phase"), "Running");
    assert_eq!(
        a.ok("kubectl get vm v-vm -o jsonpath='{.spec.runStrategy}'"),
        "Always"
    );
    let again = a.sh("virtctl start v-vm 2>&1");
    assert!(!again.status.success());
    // restart --force: the old VMI's grace is cut to 1 s first (a paused
    // guest would ignore the power button for all of its 30), then a new
    // VMI comes, unpaused.
    let uid = vmi_field(".metadata.uid");
    // (One script: a background watch ends with the script's unit.)
    let watched = a.ok(&format!(
        "f=$(mktemp)
         kubectl get vmi v-vm -w -o jsonpath='{{.metadata.uid}} {{.spec.terminationGracePeriodSeconds}}{{\"\\n\"}}' >$f 2>&1 &
         w=$!
         for i in $(seq 300); do grep -q {uid} $f && break; sleep 0.1; done
         virtctl restart --force --grace-period=0 v-vm >&2
         for i in $(seq 900); do
           u=$(kubectl get vmi v-vm -o jsonpath='{{.metadata.uid}}' 2>/dev/null || true)
           [ -n \"$u\" ] && [ \"$u\" != {uid} ] && break
           sleep 0.1
         done
         kill $w
         cat $f"
    ));
    assert!(watched.contains(&format!("{uid} 1\n")), "{watched}");
    a.ok("kubectl wait vmi/v-vm --for=jsonpath='{.status.phase}'=Running --timeout=90s");
    assert_eq!(vmi_field(".spec.startStrategy"), "");
    let refused = a.sh("virtctl restart --force --grace-period=5 v-vm 2>&1");
    let refused = String::from_utf8_lossy(&refused.stdout);
    assert!(
        refused.contains("only gracePeriod=0 is supported"),
        "{refused}"
    );
    let out = a.ok("virtctl stop v-vm");
    assert!(out.contains("VM v-vm was scheduled to stop"), "{out}");
    a.wait("the VMI gone", WAIT, "! kubectl get vmi v-vm");
    let missing = a.sh("virtctl start v-nothing 2>&1");
    assert!(String::from_utf8_lossy(&missing.stdout).contains("not found"));
    a.ok("kubectl delete vm v-vm --timeout=60s");
}

#[test]
fn restarting_kvirtd_closes_the_console_and_leaves_the_vm_running() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    running_vmi(&a, &a, "v-rs", "node-a");
    let qemu = a.ok("systemctl show -p MainPID --value kvirt-vm@default_v-rs.service");
    let out = a.ok("first=$(mktemp)
         (sleep 100 | timeout 90 virtctl console v-rs >$first 2>&1) &
         for i in $(seq 300); do grep -aq KVIRT-GUEST-ALIVE $first && break; sleep 0.1; done
         systemctl restart kvirtd
         for i in $(seq 300); do grep -aq 'kvirtd is stopping' $first && break; sleep 0.1; done
         cat -v $first");
    assert!(
        out.contains("kvirtd is stopping; the VM keeps running"),
        "{out}"
    );
    assert_eq!(
        a.ok("systemctl show -p MainPID --value kvirt-vm@default_v-rs.service"),
        qemu
    );
    // A new session works once kvirtd serves again.
    a.wait(
        "a new console session",
        WAIT,
        "out=$(mktemp)
         { for i in $(seq 100); do grep -aq KVIRT-GUEST-ALIVE $out && break; sleep 0.1; done; } |
           timeout 20 virtctl console v-rs >$out 2>&1 || true
         grep -aq KVIRT-GUEST-ALIVE $out",
    );
    delete_vmi(&a, "v-rs");
}

#[test]
fn a_host_that_stops_is_not_ready_and_one_gone_loses_its_address() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    let subsets = "kubectl -n kvirt get endpoints kvirt-api -o jsonpath='{range .subsets[*]}{.addresses[*].nodeName}:{.notReadyAddresses[*].nodeName};{end}'";
    b.ok("systemctl stop kvirtd");
    // Stopping, B marks its address not ready: the aggregator stops
    // sending users there.
    let out = a.ok(subsets);
    assert!(out.contains(":node-b;"), "{out}");
    // Its Lease runs out (8 s in the test cluster): A removes its
    // address and slice.
    a.wait(
        "node-b's address removed",
        WAIT,
        &format!("! {subsets} | grep -q node-b"),
    );
    a.wait(
        "node-b's slice removed",
        WAIT,
        "! kubectl -n kvirt get endpointslice kvirt-api-node-b",
    );
    b.ok("systemctl start kvirtd");
    a.wait(
        "node-b ready again",
        WAIT,
        &format!("{subsets} | grep -q 'node-b:'"),
    );
    a.wait(
        "node-b's slice back",
        WAIT,
        "kubectl -n kvirt get endpointslice kvirt-api-node-b",
    );
}

/// A kvirtd cut off from the API server for longer than its Lease loses
/// its address to the leader; once its renewals resume it finds the
/// address gone and writes it again, without a restart (an idle host
/// otherwise reads the Endpoints once an hour).
#[test]
fn a_host_cut_off_from_the_api_server_publishes_its_address_again_when_back() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    let pid = b.ok("systemctl show -p MainPID --value kvirtd");
    let ready = "kubectl -n kvirt get endpoints kvirt-api -o jsonpath='{.subsets[*].addresses[*].nodeName}'";
    b.ok("nft add table inet kvtest-cut
          nft add chain inet kvtest-cut out '{ type filter hook output priority 0; }'
          nft add rule inet kvtest-cut out ip daddr 10.250.0.1 tcp dport 6443 drop");
    a.wait(
        "node-b's address removed while it is away",
        WAIT,
        &format!("! {ready} | grep -q node-b"),
    );
    b.ok("nft delete table inet kvtest-cut");
    a.wait(
        "node-b's address back",
        WAIT,
        &format!("{ready} | grep -q node-b"),
    );
    assert_eq!(b.ok("systemctl show -p MainPID --value kvirtd"), pid);
    api_available(&a);
}

/// `virtctl migrate` asks kvirt's API for a migration of a running VMI,
/// as of KubeVirt's: a `VirtualMachineInstanceMigration` named as virt-api
/// names them, labelled with its VMI; `virtctl migrate-cancel` finds it by
/// that label and deletes it midway (throttled, so that it is caught), and
/// the VMI stays on A; the next one moves it to B.
#[test]
fn virtctl_migrate_moves_a_running_vmi_through_a_migration_object() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    api_available(&a);
    a.ok("cp /srv/guest/run.raw /srv/shared/v-mig.raw");
    let yaml = support::vmi_manifest("v-mig", "kubevirt.io/nodeName: node-a", "", "")
        .replace("/var/lib/kvirt/images/v-mig.raw", "/srv/shared/v-mig.raw");
    a.ok(&format!("kubectl apply -f - <<'VMI'\n{yaml}VMI"));
    a.ok("kubectl wait vmi/v-mig --for=jsonpath='{.status.phase}'=Running --timeout=90s");
    wait_condition(&a, "v-mig", "LiveMigratable", "True");
    let objects = || a.ok("kubectl get vmim -l kubevirt.io/vmi-name=v-mig -o name");
    a.ok("printf '[migration]\\nbandwidth_per_migration_mib = 1\\n' >/etc/kvirt/kvirtd.toml.d/70-slow.toml
          systemctl restart kvirtd");
    let out = a.ok("virtctl migrate v-mig 2>&1");
    assert!(out.contains("v-mig was scheduled to migrate"), "{out}");
    let first = objects();
    assert!(
        first.starts_with("virtualmachineinstancemigration.kubevirt.io/kubevirt-migrate-vm-"),
        "{first}"
    );
    b.wait(
        "the target's QEMU listening for the guest's memory",
        WAIT,
        "[ -S /run/kvirt/vms/default_v-mig/migration/memory.sock ]",
    );
    a.ok("virtctl migrate-cancel v-mig");
    a.wait(
        "the migration object gone",
        WAIT,
        &format!("! kubectl get {first}"),
    );
    a.ok("kubectl wait vmi/v-mig --for=jsonpath='{.status.migrationState.failed}'=true --timeout=60s");
    b.wait(
        "nothing of the VM on B",
        WAIT,
        "[ ! -e /run/kvirt/vms/default_v-mig ] && ! systemctl -q is-active kvirt-vm@default_v-mig",
    );
    assert_eq!(
        a.ok("kubectl get vmi v-mig -o jsonpath='{.status.nodeName}'"),
        "node-a"
    );
    a.ok("rm /etc/kvirt/kvirtd.toml.d/70-slow.toml && systemctl restart kvirtd");
    // Unthrottled, the next one moves it.
    a.ok("virtctl migrate v-mig");
    let name = objects();
    a.ok(&format!(
        "kubectl wait {name} --for=jsonpath='{{.status.phase}}'=Succeeded --timeout=120s"
    ));
    a.ok("kubectl wait vmi/v-mig --for=jsonpath='{.status.nodeName}'=node-b --timeout=60s");
    b.wait(
        "the guest counting on B",
        WAIT,
        "grep -q KVIRT-GUEST-ALIVE /run/kvirt/vms/default_v-mig/console.log",
    );
    // Nothing left to cancel: virtctl says so.
    assert!(!a.sh("virtctl migrate-cancel v-mig 2>&1").status.success());
    // No such VM: nothing is made.
    let out = a.sh("virtctl migrate v-none 2>&1");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && said.contains("not found"),
        "{said}"
    );
    assert_eq!(
        a.ok("kubectl get vmim -l kubevirt.io/vmi-name=v-none -o name"),
        ""
    );
    a.ok(&format!("kubectl delete {name}"));
    delete_vmi(&a, "v-mig");
    a.ok("rm -f /srv/shared/v-mig.raw");
}
