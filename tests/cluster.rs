//! Tier 3 with a cluster: a real kube-apiserver and etcd in test host A,
//! kvirtd on A (node-a) and on B (node-b, sharing A's network), each with
//! least-privilege credentials. Tests drive the cluster with kubectl as a
//! user would. Run by `tests/run-all`, which sets `KVIRT_K8S_A_PID` and
//! `KVIRT_K8S_B_PID`; without them these tests pass vacuously.

mod support;

use std::time::{Duration, Instant};
use support::{Host, BOOT};

fn hosts() -> Option<(Host, Host)> {
    Some((
        support::host("KVIRT_K8S_A_PID")?,
        support::host("KVIRT_K8S_B_PID")?,
    ))
}

const WAIT: Duration = Duration::from_secs(60);

/// A test VMI with `labels` and extra spec lines (e.g. a nodeSelector).
fn vmi_yaml(name: &str, labels: &str, spec_extra: &str) -> String {
    support::vmi_manifest(name, labels, spec_extra, "")
}

fn apply(h: &Host, yaml: &str) {
    h.ok(&format!("kubectl apply -f - <<'VMI'\n{yaml}VMI"));
}

fn kubectl(h: &Host, args: &str) -> String {
    h.ok(&format!("kubectl {args}"))
}

fn disk(hosts: &[&Host], name: &str, kind: &str) {
    for h in hosts {
        h.ok(&format!(
            "cp /srv/guest/{kind}.raw /var/lib/kvirt/images/{name}.raw"
        ));
    }
}

/// A guest disk every VM may read, as the base of ephemeral overlays.
fn base_image(hosts: &[&Host], name: &str) {
    for h in hosts {
        h.ok(&format!(
            "cp /srv/guest/run.raw /var/lib/kvirt/images/{name}.raw
             chmod 0644 /var/lib/kvirt/images/{name}.raw"
        ));
    }
}

fn wait_vmi(h: &Host, name: &str, jsonpath: &str, value: &str, timeout: Duration) {
    h.wait(
        &format!("vmi/{name} {jsonpath}={value}"),
        timeout,
        &format!("[ \"$(kubectl get vmi {name} -o jsonpath='{{{jsonpath}}}')\" = '{value}' ]"),
    );
}

fn unit_loaded(h: &Host, name: &str) -> bool {
    h.ok(&format!(
        "systemctl show -p LoadState --value kvirt-vm@default_{name}.service"
    )) == "loaded"
}

fn host_clean(h: &Host, name: &str) -> bool {
    h.succeeds(&format!(
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{name}.service)\" = not-found ]
         [ ! -e /run/netns/kvirt-default_{name} ]
         [ ! -e /var/lib/kvirt/vms/default_{name} ] && [ ! -e /run/kvirt/vms/default_{name} ]"
    ))
}

fn events(h: &Host, name: &str) -> Vec<String> {
    kubectl(
        h,
        &format!(
            "get events --field-selector involvedObject.name={name} -o jsonpath='{{range .items[*]}}{{.reason}}{{\"\\n\"}}{{end}}'"
        ),
    )
    .lines()
    .map(str::to_owned)
    .collect()
}

fn delete(h: &Host, name: &str) {
    kubectl(h, &format!("delete vmi {name} --timeout=60s"));
}

#[test]
fn a_vmi_for_this_node_runs_reports_and_is_deleted_cleanly() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-alpha", "run");
    // Another node's VMI, created at the same time, is never touched.
    apply(
        &a,
        &vmi_yaml("k-other", "kubevirt.io/nodeName: node-elsewhere", ""),
    );
    apply(&a, &vmi_yaml("k-alpha", "kubevirt.io/nodeName: node-a", ""));
    kubectl(
        &a,
        "wait vmi/k-alpha --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );
    let row = kubectl(&a, "get vmi k-alpha --no-headers");
    assert!(
        row.contains("Running") && row.contains("node-a") && row.contains("True"),
        "{row}"
    );
    // The IP column: the VM's address, as KubeVirt shows the pod IP.
    assert!(row.contains("10.213.0."), "{row}");
    assert!(unit_loaded(&a, "k-alpha") && !unit_loaded(&b, "k-alpha"));
    let finalizers = kubectl(&a, "get vmi k-alpha -o jsonpath='{.metadata.finalizers}'");
    assert!(finalizers.contains("kvirt.io/host-cleanup"), "{finalizers}");
    a.wait(
        "Started event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-alpha | grep -q Started",
    );
    let ev = events(&a, "k-alpha");
    assert!(ev.contains(&"Created".to_string()), "{ev:?}");

    // The status patch kvirtd sends names the VMI's uid: for a VMI deleted
    // and made anew meanwhile, the API server refuses it and nothing
    // changes (kvirtd then drops it).
    let stale = a.sh(
        "kubectl patch vmi k-other --type merge -p '{\"metadata\":{\"uid\":\"00000000-0000-0000-0000-000000000000\"},\"status\":{\"phase\":\"Failed\"}}' 2>&1",
    );
    let said = String::from_utf8_lossy(&stale.stdout);
    assert!(!stale.status.success(), "{said}");
    assert!(
        said.contains("UID in precondition") || said.contains("metadata.uid"),
        "{said}"
    );
    let other = kubectl(&a, "get vmi k-other -o json");
    assert!(!other.contains("\"phase\""), "{other}");
    assert!(!other.contains("kvirt.io/host-cleanup"), "{other}");
    assert!(!unit_loaded(&a, "k-other") && !unit_loaded(&b, "k-other"));

    // `kubectl delete` returns once the VM and everything of it are gone.
    delete(&a, "k-alpha");
    assert!(host_clean(&a, "k-alpha"), "host A still has k-alpha");
    a.ok("! kubectl get vmi k-alpha");
    kubectl(&a, "delete vmi k-other --timeout=30s");
}

/// kvirtd reads Secrets, ConfigMaps and tokens only in namespaces an
/// administrator opted in: elsewhere the API server denies it, and the VMI
/// says why and how to opt in.
#[test]
fn a_namespace_not_opted_in_keeps_its_secrets_from_kvirtd() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    let can_i = |ns: &str| {
        a.sh(&format!(
            "kubectl auth can-i get secret/k-userdata -n {ns} --as=kvirt:node:node-a --as-group=kvirt:nodes"
        ))
        .status
        .success()
    };
    assert!(can_i("default"), "the tests' namespace is opted in");
    apply(
        &a,
        "apiVersion: v1
kind: Namespace
metadata: {name: k-closed}
---
apiVersion: v1
kind: Secret
metadata: {name: k-userdata, namespace: k-closed}
stringData: {userdata: \"#!/bin/sh\\necho closed\\n\"}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: k-closed
  namespace: k-closed
  labels: {kubevirt.io/nodeName: node-a}
spec:
  domain:
    memory: {guest: 128Mi}
    devices:
      disks:
      - {name: cloudinit, disk: {bus: virtio}}
  volumes:
  - name: cloudinit
    cloudInitNoCloud: {secretRef: {name: k-userdata}}
",
    );
    assert!(
        !can_i("k-closed"),
        "kvirtd may read a closed namespace's Secret"
    );
    a.wait(
        "Synchronized=False for the closed namespace",
        WAIT,
        "[ \"$(kubectl get vmi k-closed -n k-closed -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")].reason}')\" = NamespaceNotOptedIn ]",
    );
    let message = kubectl(
        &a,
        "get vmi k-closed -n k-closed -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")].message}'",
    );
    assert!(
        message.contains("namespace k-closed is not opted in")
            && message.contains("kvirtd --print-rbac --namespace k-closed"),
        "{message}"
    );
    assert_ne!(
        a.ok("systemctl show -p LoadState --value kvirt-vm@k-closed_k-closed.service"),
        "loaded"
    );
    kubectl(&a, "delete vmi k-closed -n k-closed --timeout=60s");
    kubectl(&a, "delete secret k-userdata -n k-closed");
    // No namespace controller runs in the test cluster: the namespace
    // would stay Terminating, so it is only asked to go.
    kubectl(&a, "delete namespace k-closed --wait=false");
}

#[test]
fn secrets_config_maps_and_service_accounts_reach_the_guest() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-config", "run");
    apply(
        &a,
        "apiVersion: v1
kind: Secret
metadata: {name: k-userdata}
stringData:
  userdata: |
    #!/bin/sh
    echo KVIRT-SECRET-USERDATA-$((6 * 7))
---
apiVersion: v1
kind: Secret
metadata: {name: k-app-secret}
stringData: {password: s3cr3t-pw}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: k-vm-sa}
",
    );
    let disks = "      - {name: cloudinit, disk: {bus: virtio}}
      - {name: app-config, disk: {bus: virtio}}
      - {name: app-secret, disk: {bus: virtio}}
      - {name: sa, disk: {bus: virtio}}
";
    let vmi = support::vmi_manifest("k-config", "kubevirt.io/nodeName: node-a", "", disks)
        + "  - name: cloudinit
    cloudInitNoCloud: {secretRef: {name: k-userdata}}
  - name: app-config
    configMap: {name: k-app-config}
  - name: app-secret
    secret: {secretName: k-app-secret, volumeLabel: APPSECRET}
  - name: sa
    serviceAccount: {serviceAccountName: k-vm-sa}
";
    // The ConfigMap is not there yet: the VMI waits, and says why.
    apply(&a, &vmi);
    a.wait(
        "FailedMount event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-config,reason=FailedMount -o name | grep -q .",
    );
    let ready = kubectl(
        &a,
        "get vmi k-config -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].reason} {.status.conditions[?(@.type==\"Ready\")].message}'",
    );
    assert!(
        ready.starts_with("Scheduled FailedMount")
            && ready.contains("configmap \"k-app-config\" not found"),
        "{ready}"
    );
    assert!(!unit_loaded(&a, "k-config"));
    assert!(
        a.succeeds("[ ! -e /var/lib/kvirt/vms/default_k-config ]"),
        "nothing made on the host while waiting"
    );
    kubectl(
        &a,
        "create configmap k-app-config --from-literal=greeting=hello-from-configmap",
    );
    kubectl(
        &a,
        "wait vmi/k-config --for=jsonpath='{.status.phase}'=Running --timeout=120s",
    );
    a.serial_log_shows("k-config", "KVIRT-SECRET-USERDATA-42");
    a.serial_log_shows(
        "k-config",
        "KVIRT-GUEST-FILE cfgdata/greeting hello-from-configmap",
    );
    a.serial_log_shows("k-config", "KVIRT-GUEST-FILE APPSECRET/password s3cr3t-pw");
    a.serial_log_shows("k-config", "KVIRT-GUEST-FILE cfgdata/namespace default");
    a.serial_log_shows(
        "k-config",
        "KVIRT-GUEST-FILE cfgdata/ca.crt -----BEGIN CERTIFICATE--",
    );
    // The token is the ServiceAccount's: the API server says whose it is.
    let iso = "/var/lib/kvirt/vms/default_k-config/disks/sa.iso";
    let who = a.ok(&format!(
        "t=$(mktemp) && xorriso -osirrox on -indev {iso} -extract /token $t 2>/dev/null
         printf '{{\"apiVersion\": \"authentication.k8s.io/v1\", \"kind\": \"TokenReview\", \"spec\": {{\"token\": \"%s\"}}}}' \"$(cat $t)\" |
           kubectl create -f - -o jsonpath='{{.status.user.username}}'; rm -f $t"
    ));
    assert_eq!(who, "system:serviceaccount:default:k-vm-sa");
    token_is_renewed_in_the_running_vms_iso(&a, "k-config", iso);
    // Secret data is on the host only in the VM's own, private files.
    let mode = a.ok(&format!(
        "stat -c '%a %U' {iso} /var/lib/kvirt/vms/default_k-config/disks/app-secret.iso"
    ));
    // ...of the VM's own identity.
    let user = a.ok("systemctl show -p User --value kvirt-vm@default_k-config");
    assert!(user.starts_with("kvirt-vm-"), "{user}");
    assert_eq!(mode, format!("640 {user}\n640 {user}"));
    a.ok("! journalctl -u kvirtd | grep -q s3cr3t-pw");
    delete(&a, "k-config");
    assert!(host_clean(&a, "k-config"));
    kubectl(&a, "delete secret k-userdata k-app-secret");
    kubectl(&a, "delete configmap k-app-config");
    kubectl(&a, "delete serviceaccount k-vm-sa");
}

/// The token lives an hour (`kubernetes.service_account_token_seconds`),
/// bound to no object, and is renewed in the very file QEMU holds:
/// kvirtd, restarted, cannot tell how old it is and renews it at once,
/// the VM untouched. The new token is the ServiceAccount's too.
fn token_is_renewed_in_the_running_vms_iso(a: &Host, vm: &str, iso: &str) {
    use base64::Engine;
    let qemu = a.qemu_pid(vm);
    // What QEMU reads: the ISO through its own open file.
    let held = a.ok(&format!(
        "for f in /proc/{qemu}/fd/*; do [ \"$(readlink $f)\" = {iso} ] && echo $f && break; done"
    ));
    assert!(held.starts_with("/proc/"), "QEMU holds {iso}: {held}");
    let token = || {
        a.ok(&format!(
            "t=$(mktemp) && cat {held} > $t.iso && xorriso -osirrox on -indev $t.iso -extract /token $t 2>/dev/null; cat $t; rm -f $t $t.iso"
        ))
    };
    let claims = |jwt: &str| -> serde_json::Value {
        let payload = jwt.split('.').nth(1).expect("a JWT");
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .expect("base64url");
        serde_json::from_slice(&bytes).expect("JSON claims")
    };
    let first = token();
    let c = claims(&first);
    assert_eq!(
        c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap(),
        3600
    );
    assert!(c["kubernetes.io"].get("pod").is_none(), "{c}");
    let inode = a.ok(&format!("stat -c %i {iso}"));
    a.ok("systemctl restart kvirtd");
    a.wait_until(
        "the token renewed in the ISO QEMU holds",
        Duration::from_secs(60),
        || token() != first,
    );
    let second = token();
    let who = a.ok(&format!(
        "printf '{{\"apiVersion\": \"authentication.k8s.io/v1\", \"kind\": \"TokenReview\", \"spec\": {{\"token\": \"%s\"}}}}' '{second}' |
           kubectl create -f - -o jsonpath='{{.status.user.username}}'"
    ));
    assert_eq!(who, "system:serviceaccount:default:k-vm-sa");
    assert_eq!(a.qemu_pid(vm), qemu, "the VM was not touched");
    assert_eq!(
        a.ok(&format!("stat -c %i {iso}")),
        inode,
        "written in place"
    );
    a.ok("journalctl -u kvirtd | grep -q 'renewed the serviceAccount tokens'");
}

#[test]
fn a_private_container_disk_is_pulled_with_its_pull_secret_only() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // A registry that wants a password, on A's loopback.
    let hash = bcrypt::hash("s3cret-reg", 4).unwrap();
    a.start_registry(
        "test-private-registry",
        5001,
        Some(&format!("vmuser:{hash}")),
    );
    let image = "127.0.0.1:5001/team/guest:1";
    a.ok(&format!(
        "qemu-img convert -O qcow2 /srv/guest/run.raw /tmp/private.qcow2
         ! kvirtctl push-disk {image} /tmp/private.qcow2 </dev/null
         echo s3cret-reg | kvirtctl push-disk --username vmuser {image} /tmp/private.qcow2"
    ));
    kubectl(
        &a,
        "create secret docker-registry k-regcred --docker-server=127.0.0.1:5001 --docker-username=vmuser --docker-password=s3cret-reg",
    );
    let manifest = |name: &str, secret: &str| -> String {
        support::with_boot_source(
            &support::vmi_manifest(name, "kubevirt.io/nodeName: node-a", "", ""),
            &format!("containerDisk: {{image: '{image}'{secret}}}"),
        )
    };
    apply(&a, &manifest("k-private", ", imagePullSecret: k-regcred"));
    kubectl(
        &a,
        "wait vmi/k-private --for=jsonpath='{.status.phase}'=Running --timeout=120s",
    );
    a.serial_log_shows("k-private", "KVIRT-GUEST-READY");
    // The image is in the cache now, and still no use to a VMI without
    // the credentials: it waits with the registry's answer.
    apply(&a, &manifest("k-nosecret", ""));
    a.wait(
        "ErrImagePull event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-nosecret,reason=ErrImagePull -o name | grep -q .",
    );
    let ready = kubectl(
        &a,
        "get vmi k-nosecret -o jsonpath='{.status.phase} {.status.conditions[?(@.type==\"Ready\")].reason} {.status.conditions[?(@.type==\"Ready\")].message}'",
    );
    assert!(
        ready.starts_with("Scheduled ErrImagePull") && ready.contains("not authorized"),
        "{ready}"
    );
    assert!(!unit_loaded(&a, "k-nosecret"));
    // Its digest named through another repository of that registry, or
    // through another registry (which lacks it), without credentials: the
    // cached copy is no use either.
    let digest = a.ok(&format!(
        "journalctl -u kvirtd -o cat | grep -o 'default/k-private: pulled {image} (sha256:[0-9a-f]*' | head -n1 | grep -o 'sha256:[0-9a-f]*'"
    ));
    assert!(digest.len() == 71, "{digest}");
    a.start_registry("test-public-registry", 5002, None);
    for (name, other) in [
        ("k-otherrepo", format!("127.0.0.1:5001/team/other@{digest}")),
        ("k-otherreg", format!("127.0.0.1:5002/team/guest@{digest}")),
    ] {
        apply(
            &a,
            &support::with_boot_source(
                &support::vmi_manifest(name, "kubevirt.io/nodeName: node-a", "", ""),
                &format!("containerDisk: {{image: '{other}'}}"),
            ),
        );
        a.wait(
            &format!("ErrImagePull event of {name}"),
            WAIT,
            &format!("kubectl get events --field-selector involvedObject.name={name},reason=ErrImagePull -o name | grep -q ."),
        );
        assert!(!unit_loaded(&a, name), "{name} runs");
        delete(&a, name);
    }
    a.ok("systemctl stop test-public-registry");
    delete(&a, "k-nosecret");
    delete(&a, "k-private");
    assert!(host_clean(&a, "k-private") && host_clean(&a, "k-nosecret"));
    kubectl(&a, "delete secret k-regcred");
    a.ok("systemctl stop test-private-registry");
}

/// An unassigned VMI both hosts fit: the leader places it on one, which
/// runs it; the other never does.
#[test]
fn an_unassigned_vmi_is_placed_on_one_host_and_runs_exactly_once() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a, &b], "k-race", "run");
    apply(&a, &vmi_yaml("k-race", "", "  nodeSelector: {zone: z1}\n"));
    kubectl(
        &a,
        "wait vmi/k-race --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );
    let node = kubectl(&a, "get vmi k-race -o jsonpath='{.status.nodeName}'");
    let label = kubectl(
        &a,
        "get vmi k-race -o jsonpath='{.metadata.labels.kubevirt\\.io/nodeName}'",
    );
    assert_eq!(node, label);
    let (winner, loser) = match node.as_str() {
        "node-a" => (&a, &b),
        "node-b" => (&b, &a),
        other => panic!("placed on {other:?}"),
    };
    assert!(unit_loaded(winner, "k-race"));
    assert!(!unit_loaded(loser, "k-race"), "both hosts run k-race");
    delete(&a, "k-race");
    assert!(host_clean(winner, "k-race"));
}

#[test]
fn a_bad_vmi_fails_with_an_event_while_a_good_one_runs() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-good", "run");
    apply(
        &a,
        &format!(
            "{}---\n{}",
            vmi_yaml("k-good", "kubevirt.io/nodeName: node-a", ""),
            vmi_yaml(
                "k-bad",
                "kubevirt.io/nodeName: node-a",
                "  readinessProbe: {}\n"
            )
        ),
    );
    wait_vmi(&a, "k-bad", ".status.phase", "Failed", WAIT);
    let sync = kubectl(
        &a,
        "get vmi k-bad -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")].status} {.status.conditions[?(@.type==\"Synchronized\")].message}'",
    );
    assert!(
        sync.starts_with("False") && sync.contains("spec.readinessProbe"),
        "{sync}"
    );
    a.wait(
        "SyncFailed event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-bad,reason=SyncFailed -o name | grep -q .",
    );
    assert!(!unit_loaded(&a, "k-bad"));
    // A tenant labelling its VMI for node-a does not pick node-a: the VMI
    // must fit it as a claimed one would (its nodeSelector does not).
    apply(
        &a,
        &vmi_yaml(
            "k-picky",
            "kubevirt.io/nodeName: node-a",
            "  nodeSelector: {zone: z9}\n",
        ),
    );
    wait_vmi(&a, "k-picky", ".status.phase", "Failed", WAIT);
    let sync = kubectl(
        &a,
        "get vmi k-picky -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")].message}'",
    );
    assert!(
        sync.contains("placement") && sync.contains("zone=z9"),
        "{sync}"
    );
    assert!(!unit_loaded(&a, "k-picky"));
    kubectl(
        &a,
        "wait vmi/k-good --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );
    delete(&a, "k-picky");
    delete(&a, "k-bad");
    delete(&a, "k-good");
    assert!(host_clean(&a, "k-good") && host_clean(&a, "k-bad") && host_clean(&a, "k-picky"));
}

#[test]
fn an_api_outage_leaves_vms_running_and_status_catches_up() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-steady", "run");
    disk(&[&a], "k-off", "poweroff");
    apply(
        &a,
        &vmi_yaml("k-steady", "kubevirt.io/nodeName: node-a", ""),
    );
    kubectl(
        &a,
        "wait vmi/k-steady --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );
    let pid = a.qemu_pid("k-steady");
    apply(&a, &vmi_yaml("k-off", "kubevirt.io/nodeName: node-a", ""));
    kubectl(
        &a,
        "wait vmi/k-off --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );

    a.ok("systemctl stop kube-apiserver");
    // The guest powers itself off during the outage; kvirtd cleans its host
    // side up but cannot write the status yet.
    a.wait(
        "k-off's unit collected during the outage",
        BOOT,
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_k-off.service)\" = not-found ]",
    );
    assert_eq!(
        a.qemu_pid("k-steady"),
        pid,
        "a VM restarted during the outage"
    );
    a.ok("systemctl start kube-apiserver");
    a.wait("API back", WAIT, "kubectl get --raw /readyz");
    wait_vmi(&a, "k-off", ".status.phase", "Succeeded", WAIT);
    assert_eq!(a.qemu_pid("k-steady"), pid);
    assert_eq!(
        kubectl(&a, "get vmi k-steady -o jsonpath='{.status.phase}'"),
        "Running"
    );
    delete(&a, "k-off");
    delete(&a, "k-steady");
}

#[test]
fn restarting_kvirtd_restarts_no_vm_and_repeats_no_event() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-keep", "run");
    apply(&a, &vmi_yaml("k-keep", "kubevirt.io/nodeName: node-a", ""));
    kubectl(
        &a,
        "wait vmi/k-keep --for=jsonpath='{.status.phase}'=Running --timeout=90s",
    );
    a.wait(
        "Started event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-keep | grep -q Started",
    );
    let pid = a.qemu_pid("k-keep");
    let before_rv = kubectl(
        &a,
        "get vmi k-keep -o jsonpath='{.status.phaseTransitionTimestamps}'",
    );
    let before_events = events(&a, "k-keep");
    a.ok("systemctl restart kvirtd");
    a.wait(
        "kvirtd ready",
        WAIT,
        "systemctl is-active -q kvirtd && journalctl -u kvirtd -n 20 | grep -q ready",
    );
    a.ok("systemctl kill -s KILL kvirtd");
    a.wait(
        "kvirtd back",
        WAIT,
        "systemctl is-active -q kvirtd && journalctl -u kvirtd -n 20 | grep -q ready",
    );
    assert_eq!(a.qemu_pid("k-keep"), pid);
    assert_eq!(
        kubectl(
            &a,
            "get vmi k-keep -o jsonpath='{.status.phaseTransitionTimestamps}'"
        ),
        before_rv,
        "status flapped"
    );
    assert_eq!(events(&a, "k-keep"), before_events, "duplicate events");
    delete(&a, "k-keep");
}

#[test]
fn the_lease_is_renewed_and_rbac_is_least_privilege() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    let lease = "kubectl -n kube-node-lease get lease kvirt-node-a -o jsonpath='{.spec.renewTime}'";
    a.wait("lease exists", WAIT, lease);
    let first = a.ok(lease);
    let started = Instant::now();
    a.wait(
        "lease renewed",
        Duration::from_secs(30),
        &format!("[ \"$({lease})\" != '{first}' ]"),
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(
        kubectl(
            &a,
            "-n kube-node-lease get lease kvirt-node-a -o jsonpath='{.spec.holderIdentity}'"
        ),
        "node-a"
    );
    // kvirtd's identity can do its job and no more.
    let can = |verb: &str| {
        a.sh(&format!(
            "kubectl auth can-i {verb} --as kvirt:node:node-a --as-group kvirt:nodes"
        ))
        .status
        .success()
    };
    assert!(can("patch virtualmachineinstances.kubevirt.io"));
    assert!(can("watch virtualmachineinstances.kubevirt.io"));
    // virt-controller's part: the VMIs of VirtualMachines.
    assert!(can("delete virtualmachineinstances.kubevirt.io"));
    assert!(can("create virtualmachineinstances.kubevirt.io"));
    assert!(!can("update virtualmachineinstances.kubevirt.io"));
    // Only what a VMI's volumes name, one object at a time, as kubelet.
    assert!(can("get secrets") && can("get configmaps"));
    assert!(can("create serviceaccounts --subresource=token"));
    assert!(!can("list secrets") && !can("watch secrets") && !can("create secrets"));
    assert!(!can("create serviceaccounts"));
    // VirtualMachines: watched and patched (finalizer, status), created
    // and deleted only as a pool's members, never replaced.
    assert!(can("watch virtualmachines.kubevirt.io"));
    assert!(can(
        "patch virtualmachines.kubevirt.io --subresource=status"
    ));
    assert!(can("create virtualmachines.kubevirt.io") && can("delete virtualmachines.kubevirt.io"));
    assert!(!can("update virtualmachines.kubevirt.io"));
    assert!(can("watch virtualmachinepools.pool.kubevirt.io"));
    assert!(can("watch virtualmachineinstancereplicasets.kubevirt.io"));
    assert!(!can("create virtualmachineinstancereplicasets.kubevirt.io"));
    assert!(!can("create virtualmachinepools.pool.kubevirt.io"));
    // Instancetypes and preferences: read one at a time; kept in
    // ControllerRevisions kvirtd makes and never changes or deletes.
    assert!(can(
        "get virtualmachineclusterinstancetypes.instancetype.kubevirt.io"
    ));
    assert!(!can(
        "list virtualmachineclusterinstancetypes.instancetype.kubevirt.io"
    ));
    assert!(!can(
        "patch virtualmachinepreferences.instancetype.kubevirt.io"
    ));
    assert!(can("create controllerrevisions.apps") && can("get controllerrevisions.apps"));
    assert!(!can("delete controllerrevisions.apps") && !can("update controllerrevisions.apps"));
    // ResourceQuotas bound emptyDisks: listed, never changed.
    assert!(can("list resourcequotas"));
    assert!(!can("create resourcequotas") && !can("patch resourcequotas"));
    // The shipped manifests are what kvirtd prints.
    a.ok("diff <(kvirtd --print-crd) /etc/kvirt/manifests/crd.yaml");
}

#[test]
fn efi_variables_are_kept_for_their_virtual_machine_and_go_with_it() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // A Manual VM whose VMI is made by hand (as KubeVirt's controller
    // would): kvirtd's VM loop leaves it to the test.
    apply(
        &a,
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {name: k-efi, namespace: default}\nspec: {runStrategy: Manual, template: {spec: {domain: {devices: {}}}}}\n",
    );
    let uid = kubectl(
        &a,
        "get virtualmachines.kubevirt.io k-efi -o jsonpath='{.metadata.uid}'",
    );
    assert!(!uid.is_empty());
    disk(&[&a], "k-efi", "run");
    // The VMI as KubeVirt's VirtualMachine controller makes it: owned by
    // its VM. OVMF's GRUB needs more than 128Mi.
    let vmi = support::vmi_manifest("k-efi", "kubevirt.io/nodeName: node-a", "", "")
        .replace(
            "  namespace: default\n",
            &format!(
                "  namespace: default\n  ownerReferences:\n  - {{apiVersion: kubevirt.io/v1, kind: VirtualMachine, name: k-efi, uid: {uid}}}\n"
            ),
        )
        .replace(
            "    memory: {guest: 128Mi}\n",
            "    memory: {guest: 256Mi}\n    firmware: {bootloader: {efi: {secureBoot: false, persistent: true}}}\n",
        );
    apply(&a, &vmi);
    kubectl(
        &a,
        "wait vmi/k-efi --for=jsonpath='{.status.phase}'=Running --timeout=120s",
    );
    let kept = "/var/lib/kvirt/efi-vars/default_k-efi";
    // The VMI goes (the VM is stopped): the variables stay for the VM's
    // next VMI. The teardown asked before `kubectl delete` returned.
    delete(&a, "k-efi");
    assert!(host_clean(&a, "k-efi"));
    a.ok(&format!("test -s {kept}/VARS.fd"));
    assert_eq!(
        a.ok(&format!("cat {kept}/owner")),
        format!("VirtualMachine default/k-efi {uid}")
    );
    // The VM is deleted: the next check (every 2 s here) removes them.
    kubectl(&a, "delete virtualmachines.kubevirt.io k-efi");
    a.wait(
        "the kept EFI variables removed",
        WAIT,
        &format!("[ ! -e {kept} ]"),
    );
    a.ok("journalctl -u kvirtd --no-pager | grep -q 'removed the EFI variables kept for VirtualMachine default/k-efi'");
}

/// A namespace is a tenant: one with no hostDisk roots of its own asking
/// for a disk under another namespace's root is refused with the reason,
/// and nothing of it is made on the host (not even the disk's owner
/// changes).
#[test]
fn a_tenant_cannot_use_another_namespaces_host_disk() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-tenant", "run");
    let owner_before = a.ok("stat -c %u:%g:%a /var/lib/kvirt/images/k-tenant.raw");
    a.ok("kubectl create namespace tenant-x --dry-run=client -o yaml | kubectl apply -f -");
    let yaml = vmi_yaml("k-tenant", "kubevirt.io/nodeName: node-a", "")
        .replace("namespace: default", "namespace: tenant-x");
    apply(&a, &yaml);
    a.wait(
        "k-tenant Failed",
        WAIT,
        "[ \"$(kubectl -n tenant-x get vmi k-tenant -o jsonpath='{.status.phase}')\" = Failed ]",
    );
    let sync = kubectl(
        &a,
        "-n tenant-x get vmi k-tenant -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")]}'",
    );
    assert!(sync.contains("\"status\":\"False\""), "{sync}");
    assert!(
        sync.contains("none are granted to namespace tenant-x"),
        "{sync}"
    );
    assert!(a.succeeds(
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@tenant-x_k-tenant.service)\" = not-found ]
         [ ! -e /run/netns/kvirt-tenant-x_k-tenant ] && [ ! -e /var/lib/kvirt/vms/tenant-x_k-tenant ]"
    ));
    assert_eq!(
        a.ok("stat -c %u:%g:%a /var/lib/kvirt/images/k-tenant.raw"),
        owner_before
    );
    kubectl(&a, "-n tenant-x delete vmi k-tenant --timeout=60s");
}

/// A namespace's ResourceQuota (`requests.ephemeral-storage`) bounds its
/// VMs' emptyDisks across hosts: a VMI for node-b that would take the
/// namespace past it beside node-a's VM waits, taken on by nobody, with the
/// figures in its Ready condition and an Event; it runs once node-a's VM
/// is gone.
#[test]
fn a_namespaces_resource_quota_bounds_its_vms_empty_disks_across_hosts() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    struct Quota<'a>(&'a Host);
    impl Drop for Quota<'_> {
        fn drop(&mut self) {
            self.0
                .sh("kubectl delete resourcequota kvirt-test-disks --ignore-not-found");
        }
    }
    apply(
        &a,
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: kvirt-test-disks, namespace: default}\nspec:\n  hard: {requests.ephemeral-storage: 1Gi}\n",
    );
    let _quota = Quota(&a);
    disk(&[&a], "k-quota-1", "run");
    disk(&[&b], "k-quota-2", "run");
    let with_scratch = |name: &str, node: &str| {
        support::vmi_manifest(
            name,
            &format!("kubevirt.io/nodeName: {node}"),
            "",
            "      - name: scratch\n        disk: {bus: virtio}\n",
        ) + "  - name: scratch\n    emptyDisk: {capacity: 600Mi}\n"
    };
    apply(&a, &with_scratch("k-quota-1", "node-a"));
    wait_vmi(&a, "k-quota-1", ".status.phase", "Running", BOOT);
    apply(&a, &with_scratch("k-quota-2", "node-b"));
    let ready = ".status.conditions[?(@.type==\"Ready\")]";
    wait_vmi(
        &a,
        "k-quota-2",
        &format!("{ready}.reason"),
        "ExceededQuota",
        WAIT,
    );
    assert_eq!(
        kubectl(
            &a,
            &format!("get vmi k-quota-2 -o jsonpath='{{{ready}.message}}'")
        ),
        "exceeded quota: kvirt-test-disks, requested: requests.ephemeral-storage=0.6 GiB \
         (emptyDisks), used: 0.6 GiB, limited: 1.0 GiB"
    );
    assert!(events(&a, "k-quota-2").contains(&"ExceededQuota".to_owned()));
    assert!(host_clean(&b, "k-quota-2"), "nothing of it on node-b");
    let finalizers = kubectl(&a, "get vmi k-quota-2 -o jsonpath='{.metadata.finalizers}'");
    assert!(!finalizers.contains("kvirt.io"), "{finalizers}");

    delete(&a, "k-quota-1");
    // Retried within the loop's backoff (at most 64 s), then booted.
    wait_vmi(
        &a,
        "k-quota-2",
        ".status.phase",
        "Running",
        BOOT + Duration::from_secs(70),
    );
    delete(&a, "k-quota-2");
}

/// The test cluster binds and protects claims as a real one does: a
/// kube-controller-manager's PV binder binds a claim to a matching local
/// PV, and the claim carries `kubernetes.io/pvc-protection` until it goes
/// (what persistent disks stand on; nothing here is kvirt's yet).
#[test]
fn claims_are_bound_and_protected_by_the_real_controller_manager() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    a.ok("mkdir -p /var/lib/kvirt/claims/k-pv-1");
    apply(
        &a,
        "apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: kvirt-test-local}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: k-pv-1}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: kvirt-test-local
  local: {path: /var/lib/kvirt/claims/k-pv-1}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {key: kubernetes.io/hostname, operator: In, values: [node-a]}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: k-claim-1, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: kvirt-test-local
  resources: {requests: {storage: 512Mi}}
",
    );
    let field = |what: &str, jsonpath: &str| {
        kubectl(&a, &format!("get {what} -o jsonpath='{{{jsonpath}}}'"))
    };
    a.wait(
        "k-claim-1 Bound",
        WAIT,
        "[ \"$(kubectl get pvc k-claim-1 -o jsonpath='{.status.phase}')\" = Bound ]",
    );
    assert_eq!(field("pvc k-claim-1", ".spec.volumeName"), "k-pv-1");
    assert_eq!(field("pv k-pv-1", ".spec.claimRef.name"), "k-claim-1");
    assert!(field("pvc k-claim-1", ".metadata.finalizers").contains("kubernetes.io/pvc-protection"));

    kubectl(&a, "delete pvc k-claim-1 --timeout=60s");
    a.wait(
        "k-pv-1 Released",
        WAIT,
        "[ \"$(kubectl get pv k-pv-1 -o jsonpath='{.status.phase}')\" = Released ]",
    );
    kubectl(&a, "delete pv k-pv-1 --timeout=60s");
    kubectl(&a, "delete storageclass kvirt-test-local");
}

fn vm_field(h: &Host, name: &str, jsonpath: &str) -> String {
    kubectl(h, &format!("get vm {name} -o jsonpath='{jsonpath}'"))
}

/// How many VMIs of `name` the kvirtds have created since `since` (a
/// `date +%s`), by their logs.
fn vmis_created(hosts: &[&Host], name: &str, since: &str) -> usize {
    hosts
        .iter()
        .map(|h| {
            h.ok(&format!(
                "journalctl -u kvirtd --since @{since} --no-pager | grep -c 'default/{name}: VirtualMachine: created its VMI' || true"
            ))
            .trim()
            .parse::<usize>()
            .unwrap_or(0)
        })
        .sum()
}

#[test]
fn a_virtual_machine_runs_one_vmi_across_two_kvirtds_and_obeys_its_run_strategy() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // What a failed earlier run may have left goes first.
    a.ok("kubectl delete vm k-vm --ignore-not-found --wait=false");
    a.wait(
        "no k-vm left",
        WAIT,
        "! kubectl get vm k-vm 2>/dev/null && ! kubectl get vmi k-vm 2>/dev/null",
    );
    disk(&[&a, &b], "k-vm", "run");
    let since = a.ok("date +%s");
    // Claimed by either host, as any unassigned VMI of zone z1.
    apply(
        &a,
        &support::vm_manifest("k-vm", "Always", "  nodeSelector: {zone: z1}\n"),
    );
    a.wait(
        "kubectl get vm shows k-vm Running and Ready",
        Duration::from_secs(120),
        "kubectl get vm k-vm --no-headers | grep -Eq 'Running +True'",
    );
    let vm_uid = vm_field(&a, "k-vm", "{.metadata.uid}");
    let owner = kubectl(
        &a,
        "get vmi k-vm -o jsonpath='{.metadata.ownerReferences[0].uid}'",
    );
    assert_eq!(owner, vm_uid);
    let first = kubectl(&a, "get vmi k-vm -o jsonpath='{.metadata.uid}'");
    assert_eq!(vm_field(&a, "k-vm", "{.status.created}"), "true");
    assert_eq!(vm_field(&a, "k-vm", "{.status.runStrategy}"), "Always");
    // Two kvirtds run VirtualMachines: one VMI was made, once.
    assert_eq!(vmis_created(&[&a, &b], "k-vm", &since), 1);
    let node = kubectl(&a, "get vmi k-vm -o jsonpath='{.status.nodeName}'");
    let runner = if node == "node-a" { &a } else { &b };
    assert!(unit_loaded(runner, "k-vm"));

    // Halted: the VMI goes (gracefully), the VM shows Stopped.
    kubectl(
        &a,
        "patch vm k-vm --type merge -p '{\"spec\":{\"runStrategy\":\"Halted\"}}'",
    );
    a.wait(
        "k-vm's VMI gone",
        WAIT,
        "! kubectl get vmi k-vm 2>/dev/null",
    );
    a.wait(
        "k-vm Stopped",
        WAIT,
        "[ \"$(kubectl get vm k-vm -o jsonpath='{.status.printableStatus}')\" = Stopped ]",
    );
    runner.wait(
        "k-vm's host clean",
        WAIT,
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_k-vm.service)\" = not-found ]",
    );
    assert!(host_clean(runner, "k-vm"));

    // Always again: a new VMI; the guest powering off or a kill brings
    // another (one per VM at any time).
    kubectl(
        &a,
        "patch vm k-vm --type merge -p '{\"spec\":{\"runStrategy\":\"Always\"}}'",
    );
    a.wait(
        "k-vm running a new VMI",
        Duration::from_secs(120),
        &format!(
            "[ \"$(kubectl get vmi k-vm -o jsonpath='{{.status.phase}}')\" = Running ] && [ \"$(kubectl get vmi k-vm -o jsonpath='{{.metadata.uid}}')\" != {first} ]"
        ),
    );
    assert_eq!(vmis_created(&[&a, &b], "k-vm", &since), 2);

    // kvirtctl as virtctl, through the API server: restart (a new VMI),
    // stop (runStrategy Halted), start (Always).
    let vmi_uid = || {
        kubectl(
            &a,
            "get vmi k-vm -o jsonpath='{.metadata.uid}' 2>/dev/null || true",
        )
    };
    let second = vmi_uid();
    a.ok("kvirtctl restart default/k-vm");
    a.wait(
        "k-vm restarted into a new VMI",
        Duration::from_secs(120),
        &format!(
            "[ \"$(kubectl get vmi k-vm -o jsonpath='{{.status.phase}}')\" = Running ] && [ \"$(kubectl get vmi k-vm -o jsonpath='{{.metadata.uid}}')\" != {second} ]"
        ),
    );
    a.ok("kvirtctl stop --grace 5 default/k-vm");
    assert_eq!(vm_field(&a, "k-vm", "{.spec.runStrategy}"), "Halted");
    a.wait(
        "k-vm's VMI gone",
        WAIT,
        "! kubectl get vmi k-vm 2>/dev/null",
    );
    let err = a.ok("kvirtctl stop default/k-vm 2>&1 || true");
    assert!(err.contains("not running"), "{err}");
    a.ok("kvirtctl start default/k-vm");
    assert_eq!(vm_field(&a, "k-vm", "{.spec.runStrategy}"), "Always");
    a.wait(
        "kubectl get vm shows k-vm Running again",
        Duration::from_secs(120),
        "kubectl get vm k-vm --no-headers | grep -Eq 'Running +True'",
    );
    assert!(vmi_uid() != second);
    assert_eq!(vmis_created(&[&a, &b], "k-vm", &since), 4);

    // Pause and unpause on the host that runs it: the VM shows Paused.
    let node = kubectl(&a, "get vmi k-vm -o jsonpath='{.status.nodeName}'");
    let runner = if node == "node-a" { &a } else { &b };
    runner.ok("kvirtctl pause default/k-vm");
    a.wait(
        "kubectl get vm shows k-vm Paused",
        WAIT,
        "kubectl get vm k-vm --no-headers | grep -Eq 'Paused +False'",
    );
    runner.ok("kvirtctl unpause default/k-vm");
    a.wait(
        "kubectl get vm shows k-vm Running after unpause",
        WAIT,
        "kubectl get vm k-vm --no-headers | grep -Eq 'Running +True'",
    );

    // kubectl delete vm: the VMI, the host's resources and the VM go.
    kubectl(&a, "delete vm k-vm --wait=false");
    a.wait(
        "k-vm and its VMI gone",
        Duration::from_secs(90),
        "! kubectl get vm k-vm 2>/dev/null && ! kubectl get vmi k-vm 2>/dev/null",
    );
    runner.wait(
        "k-vm's host clean",
        WAIT,
        "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_k-vm.service)\" = not-found ]",
    );
    assert!(host_clean(runner, "k-vm"));
}

/// An instancetype and a preference as real API objects: the VM's VMI is
/// sized by them, and the objects are kept in a ControllerRevision owned
/// by the VM, named in its status, so an edit changes no later run.
#[test]
fn an_instancetype_sizes_a_vm_through_the_api_and_its_revision_is_kept() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    a.ok("kubectl delete vm k-itvm --ignore-not-found --wait=false");
    a.wait(
        "no k-itvm left",
        WAIT,
        "! kubectl get vm k-itvm 2>/dev/null && ! kubectl get vmi k-itvm 2>/dev/null",
    );
    disk(&[&a, &b], "k-itvm", "run");
    let objects = |cpus: u32| {
        format!(
            "apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachineClusterInstancetype
metadata: {{name: k-it}}
spec: {{cpu: {{guest: {cpus}}}, memory: {{guest: 160Mi}}}}
---
apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachinePreference
metadata: {{name: k-pref, namespace: default}}
spec: {{cpu: {{preferredCPUTopology: cores}}, devices: {{preferredDiskBus: virtio}}}}
"
        )
    };
    apply(&a, &objects(2));
    apply(
        &a,
        "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {name: k-itvm, namespace: default}
spec:
  runStrategy: Always
  instancetype: {name: k-it}
  preference: {name: k-pref, kind: VirtualMachinePreference}
  template:
    spec:
      terminationGracePeriodSeconds: 15
      nodeSelector: {zone: z1}
      volumes:
      - name: boot
        hostDisk: {path: /var/lib/kvirt/images/k-itvm.raw, type: Disk}
",
    );
    a.wait(
        "kubectl get vm shows k-itvm Running",
        Duration::from_secs(120),
        "kubectl get vm k-itvm --no-headers | grep -Eq 'Running +True'",
    );
    let vmi = |path: &str| kubectl(&a, &format!("get vmi k-itvm -o jsonpath='{path}'"));
    assert_eq!(vmi("{.spec.domain.cpu.cores}"), "2");
    assert_eq!(vmi("{.spec.domain.memory.guest}"), "160Mi");
    assert_eq!(vmi("{.spec.domain.devices.disks[0].disk.bus}"), "virtio");
    assert_eq!(
        vmi("{.metadata.annotations.kubevirt\\.io/cluster-instancetype-name}"),
        "k-it"
    );
    let rev = vm_field(
        &a,
        "k-itvm",
        "{.status.instancetypeRef.controllerRevisionRef.name}",
    );
    assert!(rev.starts_with("k-itvm-k-it-v1beta1-"), "{rev}");
    let owner = kubectl(
        &a,
        &format!("get controllerrevision {rev} -o jsonpath='{{.metadata.ownerReferences[0].kind}}/{{.data.spec.cpu.guest}}'"),
    );
    assert_eq!(owner, "VirtualMachine/2");
    assert_eq!(
        vm_field(&a, "k-itvm", "{.status.preferenceRef.kind}"),
        "VirtualMachinePreference"
    );

    // The instancetype edited, the VMI deleted: the next run still has the
    // revision's two vCPUs.
    apply(&a, &objects(1));
    let first = vmi("{.metadata.uid}");
    kubectl(&a, "delete vmi k-itvm --wait=false");
    a.wait(
        "k-itvm running a new VMI",
        Duration::from_secs(120),
        &format!(
            "[ \"$(kubectl get vmi k-itvm -o jsonpath='{{.status.phase}}')\" = Running ] && [ \"$(kubectl get vmi k-itvm -o jsonpath='{{.metadata.uid}}')\" != {first} ]"
        ),
    );
    assert_eq!(vmi("{.spec.domain.cpu.cores}"), "2");
    assert_eq!(
        vm_field(
            &a,
            "k-itvm",
            "{.status.instancetypeRef.controllerRevisionRef.name}"
        ),
        rev
    );

    kubectl(&a, "delete vm k-itvm --wait=false");
    a.wait(
        "k-itvm and its VMI gone",
        Duration::from_secs(90),
        "! kubectl get vm k-itvm 2>/dev/null && ! kubectl get vmi k-itvm 2>/dev/null",
    );
    a.ok(&format!(
        "kubectl delete controllerrevision {rev} --ignore-not-found; \
         kubectl delete virtualmachineclusterinstancetype k-it; kubectl delete vmpref k-pref"
    ));
}

/// A VirtualMachinePool through the API server: its VMs made by whichever
/// kvirtd gets there first, once each; `kubectl scale` (the scale
/// subresource) shrinks it from the highest index; deleting it takes its
/// VMs with it.
#[test]
fn a_pool_scales_through_the_api_server() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    base_image(&[&a, &b], "k-pool-base");
    apply(
        &a,
        "apiVersion: pool.kubevirt.io/v1alpha1
kind: VirtualMachinePool
metadata: {name: k-pl, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: k-pl}}
  virtualMachineTemplate:
    metadata: {labels: {app: k-pl}}
    spec:
      runStrategy: Always
      template:
        spec:
          terminationGracePeriodSeconds: 5
          nodeSelector: {zone: z1}
          domain: {memory: {guest: 96Mi}}
          volumes:
          - name: boot
            ephemeral: {hostDisk: {path: /var/lib/kvirt/images/k-pool-base.raw, type: Disk}}
",
    );
    for vm in ["k-pl-0", "k-pl-1"] {
        a.wait(
            &format!("{vm} Running"),
            Duration::from_secs(150),
            &format!("kubectl get vm {vm} --no-headers | grep -Eq 'Running +True'"),
        );
    }
    assert_eq!(
        vm_field(&a, "k-pl-0", "{.metadata.ownerReferences[0].kind}"),
        "VirtualMachinePool"
    );
    a.wait(
        "pool status 2 ready",
        WAIT,
        "[ \"$(kubectl get vmpool k-pl -o jsonpath='{.status.readyReplicas}')\" = 2 ]",
    );
    kubectl(&a, "scale vmpool k-pl --replicas=1");
    a.wait(
        "k-pl-1 gone",
        Duration::from_secs(90),
        "! kubectl get vm k-pl-1 2>/dev/null && ! kubectl get vmi k-pl-1 2>/dev/null",
    );
    assert_eq!(
        vm_field(&a, "k-pl-0", "{.status.printableStatus}"),
        "Running"
    );
    kubectl(&a, "delete vmpool k-pl --wait=false");
    a.wait(
        "k-pl and its VMs gone",
        Duration::from_secs(90),
        "! kubectl get vmpool k-pl 2>/dev/null && ! kubectl get vm k-pl-0 2>/dev/null && ! kubectl get vmi k-pl-0 2>/dev/null",
    );
}

/// A VirtualMachineInstanceReplicaSet through the API server: its VMIs
/// named `<rs>-<index>`, one deleted replaced at once, scaled in from the
/// highest index by `kubectl scale`, and gone with it.
#[test]
fn a_replica_set_keeps_its_vmis_through_the_api_server() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    base_image(&[&a, &b], "k-rs-base");
    apply(
        &a,
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceReplicaSet
metadata: {name: k-rs, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: k-rs}}
  template:
    metadata: {labels: {app: k-rs}}
    spec:
      terminationGracePeriodSeconds: 5
      nodeSelector: {zone: z1}
      domain: {memory: {guest: 96Mi}}
      volumes:
      - name: boot
        ephemeral: {hostDisk: {path: /var/lib/kvirt/images/k-rs-base.raw, type: Disk}}
",
    );
    for vmi in ["k-rs-0", "k-rs-1"] {
        wait_vmi(
            &a,
            vmi,
            ".status.phase",
            "Running",
            Duration::from_secs(150),
        );
    }
    assert_eq!(
        kubectl(
            &a,
            "get vmi k-rs-1 -o jsonpath='{.metadata.ownerReferences[0].kind}'"
        ),
        "VirtualMachineInstanceReplicaSet"
    );
    let first = kubectl(&a, "get vmi k-rs-1 -o jsonpath='{.metadata.uid}'");
    kubectl(&a, "delete vmi k-rs-1 --wait=false");
    // Replaced at once, under the lowest name free then (k-rs-1 still
    // holds its own while it shuts down).
    a.wait(
        "k-rs-1 replaced: two VMIs running again",
        Duration::from_secs(150),
        &format!(
            "[ \"$(kubectl get vmi -l app=k-rs --no-headers | grep -c Running)\" = 2 ] && \
             ! kubectl get vmi -l app=k-rs -o jsonpath='{{.items[*].metadata.uid}}' | grep -q {first}"
        ),
    );
    a.wait(
        "replica set status 2 ready",
        WAIT,
        "[ \"$(kubectl get vmirs k-rs -o jsonpath='{.status.readyReplicas}')\" = 2 ]",
    );
    // Scaled in from the highest index: k-rs-0 stays.
    kubectl(&a, "scale vmirs k-rs --replicas=1");
    a.wait(
        "one VMI left",
        Duration::from_secs(90),
        "[ \"$(kubectl get vmi -l app=k-rs --no-headers | wc -l)\" = 1 ]",
    );
    assert_eq!(
        kubectl(&a, "get vmi k-rs-0 -o jsonpath='{.status.phase}'"),
        "Running"
    );
    kubectl(&a, "delete vmirs k-rs --wait=false");
    a.wait(
        "k-rs and its VMIs gone",
        Duration::from_secs(90),
        "! kubectl get vmirs k-rs 2>/dev/null && [ -z \"$(kubectl get vmi -l app=k-rs --no-headers 2>/dev/null)\" ]",
    );
}

/// A local PersistentVolume on node-a, in `kvirt-test-local`, bound (by
/// the real controller manager) to a claim of the same name.
fn local_claim(a: &Host, name: &str, node: &str) {
    a.ok(&format!("mkdir -p /var/lib/kvirt/claims/{name}"));
    apply(
        a,
        &format!(
            "apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: kvirt-test-local}}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {name}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: kvirt-test-local
  local: {{path: /var/lib/kvirt/claims/{name}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: {name}, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: kvirt-test-local
  volumeName: {name}
  resources: {{requests: {{storage: 512Mi}}}}
"
        ),
    );
    a.wait(
        &format!("{name} Bound"),
        WAIT,
        &format!("[ \"$(kubectl get pvc {name} -o jsonpath='{{.status.phase}}')\" = Bound ]"),
    );
}

/// A VMI on node-a with a claim as its second disk, and a script that
/// shows what the claim held and writes a marker into it.
fn claim_vmi(name: &str, claim: &str) -> String {
    let script = "#!/bin/sh\\necho \\\"KVIRT-CLAIM-WAS $(head -c 15 /dev/vdb | tr '\\\\000' .)\\\"\\nprintf KVIRT-PERSISTED >/dev/vdb && sync && echo KVIRT-CLAIM-WRITTEN\\n";
    support::vmi_manifest(
        name,
        "kubevirt.io/nodeName: node-a",
        "",
        "      - name: data\n        disk: {bus: virtio}\n      - name: seed\n        disk: {bus: virtio}\n",
    ) + &format!(
        "  - name: data\n    persistentVolumeClaim: {{claimName: {claim}}}\n  - name: seed\n    cloudInitNoCloud: {{userData: \"{script}\"}}\n"
    )
}

/// A claim's data outlives its VMI, and a pre-populated root in a claim
/// boots: kvirt makes the claim's disk.img
/// (sparse, min(request, capacity) less the 5.5 % overhead), holds the
/// claim with its finalizer while a VM uses it (a `kubectl delete pvc`
/// leaves it Terminating until the VM goes), and a second VMI on the claim
/// reads what the first wrote. A claim whose PV is on another node is
/// refused with the affinity named, and nothing is made.
#[test]
fn a_claims_data_outlives_its_vmi_and_the_claim_is_held_while_used() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    local_claim(&a, "k-claim-2", "node-a");
    local_claim(&a, "k-claim-3", "node-b");
    let pvc = |name: &str, jsonpath: &str| {
        kubectl(&a, &format!("get pvc {name} -o jsonpath='{{{jsonpath}}}'"))
    };

    disk(&[&a], "k-pvc-1", "run");
    apply(&a, &claim_vmi("k-pvc-1", "k-claim-2"));
    wait_vmi(&a, "k-pvc-1", ".status.phase", "Running", BOOT);
    a.serial_log_shows("k-pvc-1", "KVIRT-CLAIM-WAS ...............");
    a.serial_log_shows("k-pvc-1", "KVIRT-CLAIM-WRITTEN");
    let img = "/var/lib/kvirt/claims/k-claim-2/disk.img";
    // 512 MiB less 5.5 %, in whole MiB: 483 MiB.
    assert_eq!(
        a.ok(&format!("stat -c %s {img}")),
        (483u64 << 20).to_string()
    );
    assert!(pvc("k-claim-2", ".metadata.finalizers").contains("kvirt.io/pvc-in-use"));
    assert!(pvc("k-claim-2", ".metadata.annotations.kvirt\\.io/used-by").contains("node-a"));
    delete(&a, "k-pvc-1");
    assert!(!pvc("k-claim-2", ".metadata.finalizers").contains("kvirt.io/pvc-in-use"));
    // The grant went with the VM: the file is root's, 0600, as made.
    assert_eq!(a.ok(&format!("stat -c %u:%a {img}")), "0:600");

    disk(&[&a], "k-pvc-2", "run");
    apply(&a, &claim_vmi("k-pvc-2", "k-claim-2"));
    wait_vmi(&a, "k-pvc-2", ".status.phase", "Running", BOOT);
    a.serial_log_shows("k-pvc-2", "KVIRT-CLAIM-WAS KVIRT-PERSISTED");
    kubectl(&a, "delete pvc k-claim-2 --wait=false");
    assert!(!pvc("k-claim-2", ".metadata.deletionTimestamp").is_empty());
    assert_eq!(
        pvc("k-claim-2", ".status.phase"),
        "Bound",
        "held while used"
    );
    delete(&a, "k-pvc-2");
    a.wait(
        "k-claim-2 gone",
        WAIT,
        "! kubectl get pvc k-claim-2 2>/dev/null",
    );

    // A claim holding a pre-populated root (as CDI leaves it): it boots,
    // its contents as they were (the file grown to the claim's size).
    local_claim(&a, "k-root", "node-a");
    a.ok("cp /srv/guest/run.raw /var/lib/kvirt/claims/k-root/disk.img");
    let root_vmi = support::vmi_manifest("k-pvc-root", "kubevirt.io/nodeName: node-a", "", "")
        .replace(
            "hostDisk: {path: /var/lib/kvirt/images/k-pvc-root.raw, type: Disk}",
            "persistentVolumeClaim: {claimName: k-root}",
        );
    apply(&a, &root_vmi);
    wait_vmi(&a, "k-pvc-root", ".status.phase", "Running", BOOT);
    a.serial_log_shows("k-pvc-root", "KVIRT-GUEST-READY");
    a.ok("cmp -n \"$(stat -c %s /srv/guest/run.raw)\" /srv/guest/run.raw /var/lib/kvirt/claims/k-root/disk.img");
    delete(&a, "k-pvc-root");
    kubectl(&a, "delete pvc k-root --timeout=60s");
    kubectl(&a, "delete pv k-root --timeout=60s");
    a.ok("rm -rf /var/lib/kvirt/claims/k-root");

    // Another node's local volume: refused, naming why, nothing made.
    disk(&[&a], "k-pvc-3", "run");
    apply(&a, &claim_vmi("k-pvc-3", "k-claim-3"));
    wait_vmi(&a, "k-pvc-3", ".status.phase", "Failed", WAIT);
    let sync = kubectl(
        &a,
        "get vmi k-pvc-3 -o jsonpath='{.status.conditions[?(@.type==\"Synchronized\")]}'",
    );
    assert!(
        sync.contains("PVCNodeAffinity") && sync.contains("kubernetes.io/hostname"),
        "{sync}"
    );
    assert!(host_clean(&a, "k-pvc-3"));
    assert!(!a.succeeds("[ -e /var/lib/kvirt/claims/k-claim-3/disk.img ]"));
    delete(&a, "k-pvc-3");
    assert!(!pvc("k-claim-3", ".metadata.finalizers").contains("kvirt.io/pvc-in-use"));
    kubectl(&a, "delete pvc k-claim-3 --timeout=60s");
    for pv in ["k-claim-2", "k-claim-3"] {
        kubectl(&a, &format!("delete pv {pv} --timeout=60s"));
        a.ok(&format!("rm -rf /var/lib/kvirt/claims/{pv}"));
    }
}

/// The Ready condition's reason and message of a VMI.
fn ready(h: &Host, name: &str) -> (String, String) {
    let c = ".status.conditions[?(@.type==\"Ready\")]";
    (
        kubectl(h, &format!("get vmi {name} -o jsonpath='{{{c}.reason}}'")),
        kubectl(h, &format!("get vmi {name} -o jsonpath='{{{c}.message}}'")),
    )
}

/// What kvirt waits for before a claim's VM starts, with nothing made
/// meanwhile: a DataVolume until CDI says it is populated (CDI's own
/// schema is not needed: a minimal CRD stands in, its status set by the
/// test as CDI's importer would); a `WaitForFirstConsumer` claim until it
/// is bound, after kvirtd selected its node for the provisioner (the test
/// provisions, as a provisioner would on seeing the annotation).
#[test]
fn data_volumes_and_wait_for_first_consumer_claims_are_waited_for() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    apply(
        &a,
        "apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: datavolumes.cdi.kubevirt.io}
spec:
  group: cdi.kubevirt.io
  names: {kind: DataVolume, plural: datavolumes, singular: datavolume, shortNames: [dv]}
  scope: Namespaced
  versions:
  - name: v1beta1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
",
    );
    kubectl(
        &a,
        "wait crd/datavolumes.cdi.kubevirt.io --for=condition=Established --timeout=60s",
    );
    local_claim(&a, "k-dv-1", "node-a");
    apply(
        &a,
        "apiVersion: cdi.kubevirt.io/v1beta1
kind: DataVolume
metadata: {name: k-dv-1, namespace: default}
spec: {source: {blank: {}}, storage: {resources: {requests: {storage: 512Mi}}}}
status: {phase: ImportInProgress, progress: 42.0%}
",
    );
    disk(&[&a], "k-dv-vm", "run");
    let dv_vmi = claim_vmi("k-dv-vm", "k-dv-1").replace(
        "persistentVolumeClaim: {claimName: k-dv-1}",
        "dataVolume: {name: k-dv-1}",
    );
    apply(&a, &dv_vmi);
    wait_vmi(
        &a,
        "k-dv-vm",
        ".status.conditions[?(@.type==\"Ready\")].reason",
        "DataVolumeNotReady",
        WAIT,
    );
    let (_, message) = ready(&a, "k-dv-vm");
    assert!(
        message.contains("ImportInProgress") && message.contains("42.0%"),
        "{message}"
    );
    assert!(host_clean(&a, "k-dv-vm"), "nothing made while it waits");
    assert!(events(&a, "k-dv-vm").contains(&"DataVolumeNotReady".to_owned()));
    kubectl(&a, "patch dv k-dv-1 --type merge -p '{\"status\":{\"phase\":\"Succeeded\",\"progress\":\"100.0%\"}}'");
    wait_vmi(
        &a,
        "k-dv-vm",
        ".status.phase",
        "Running",
        BOOT + Duration::from_secs(70),
    );
    a.serial_log_shows("k-dv-vm", "KVIRT-CLAIM-WRITTEN");
    // KubeVirt's volumeStatus, with the claim's facts.
    let info = kubectl(
        &a,
        "get vmi k-dv-vm -o jsonpath='{.status.volumeStatus[?(@.name==\"data\")]}'",
    );
    for want in [
        "\"target\":\"vdb\"",
        "\"claimName\":\"k-dv-1\"",
        "\"volumeMode\":\"Filesystem\"",
        "\"filesystemOverhead\":\"0.055\"",
        "\"requests\":{\"storage\":\"512Mi\"}",
    ] {
        assert!(info.contains(want), "{want} not in {info}");
    }
    delete(&a, "k-dv-vm");

    apply(
        &a,
        "apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: kvirt-test-wffc}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: k-wffc-1, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: kvirt-test-wffc
  resources: {requests: {storage: 256Mi}}
",
    );
    disk(&[&a], "k-wffc-vm", "run");
    apply(&a, &claim_vmi("k-wffc-vm", "k-wffc-1"));
    a.wait(
        "k-wffc-1 selected for node-a",
        WAIT,
        "[ \"$(kubectl get pvc k-wffc-1 -o jsonpath='{.metadata.annotations.volume\\.kubernetes\\.io/selected-node}')\" = node-a ]",
    );
    let (reason, message) = ready(&a, "k-wffc-vm");
    assert_eq!(reason, "PVCNotBound", "{message}");
    assert!(host_clean(&a, "k-wffc-vm"));
    // The provisioner's part: a volume on the selected node, for the claim.
    a.ok("mkdir -p /var/lib/kvirt/claims/k-wffc-1");
    apply(
        &a,
        "apiVersion: v1
kind: PersistentVolume
metadata: {name: k-wffc-1}
spec:
  capacity: {storage: 256Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: kvirt-test-wffc
  claimRef: {namespace: default, name: k-wffc-1}
  local: {path: /var/lib/kvirt/claims/k-wffc-1}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {key: kubernetes.io/hostname, operator: In, values: [node-a]}
",
    );
    wait_vmi(
        &a,
        "k-wffc-vm",
        ".status.phase",
        "Running",
        BOOT + Duration::from_secs(70),
    );
    delete(&a, "k-wffc-vm");
    for c in ["k-dv-1", "k-wffc-1"] {
        kubectl(&a, &format!("delete pvc {c} --timeout=60s"));
        kubectl(&a, &format!("delete pv {c} --timeout=60s"));
        a.ok(&format!("rm -rf /var/lib/kvirt/claims/{c}"));
    }
    kubectl(&a, "delete dv k-dv-1 --ignore-not-found");
    kubectl(&a, "delete storageclass kvirt-test-wffc");
}

/// A ReadWriteOnce claim one node's VM uses is refused to a VMI on the
/// other node, naming where it is used, until that VM is gone; and a
/// kvirtd killed (-9) while it tears a claim's VM down converges when it
/// is back: VMI gone, claim no longer held, the VM's grant on its
/// disk.img taken back.
#[test]
fn a_claim_in_use_on_one_node_is_refused_on_the_other_and_a_crash_converges() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    for h in [&a, &b] {
        h.ok("mkdir -p /var/lib/kvirt/claims/k-shared");
    }
    apply(
        &a,
        "apiVersion: v1
kind: PersistentVolume
metadata: {name: k-shared}
spec:
  capacity: {storage: 512Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: kvirt-test-shared
  hostPath: {path: /var/lib/kvirt/claims/k-shared}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: k-shared, namespace: default}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: kvirt-test-shared
  volumeName: k-shared
  resources: {requests: {storage: 512Mi}}
",
    );
    a.wait(
        "k-shared Bound",
        WAIT,
        "[ \"$(kubectl get pvc k-shared -o jsonpath='{.status.phase}')\" = Bound ]",
    );
    disk(&[&a], "k-rwo-a", "run");
    disk(&[&b], "k-rwo-b", "run");
    apply(&a, &claim_vmi("k-rwo-a", "k-shared"));
    wait_vmi(&a, "k-rwo-a", ".status.phase", "Running", BOOT);
    apply(
        &a,
        &claim_vmi("k-rwo-b", "k-shared").replace("nodeName: node-a", "nodeName: node-b"),
    );
    wait_vmi(
        &a,
        "k-rwo-b",
        ".status.conditions[?(@.type==\"Ready\")].reason",
        "PVCInUse",
        WAIT,
    );
    let (_, message) = ready(&a, "k-rwo-b");
    assert!(
        message.contains("default/k-rwo-a") && message.contains("node node-a"),
        "{message}"
    );
    assert!(host_clean(&b, "k-rwo-b"));
    delete(&a, "k-rwo-a");
    wait_vmi(
        &a,
        "k-rwo-b",
        ".status.phase",
        "Running",
        BOOT + Duration::from_secs(70),
    );
    let img = "/var/lib/kvirt/claims/k-shared/disk.img";
    // `+`: the file has an ACL (the VM's grant) while it runs.
    assert!(
        b.ok(&format!("ls -l {img}")).starts_with("-rw-rw----+"),
        "granted while it runs"
    );

    // kvirtd dies while it tears the VM down; back, it finishes the job.
    kubectl(&a, "delete vmi k-rwo-b --wait=false");
    b.ok("systemctl kill -s KILL kvirtd.service; systemctl reset-failed kvirtd.service; systemctl start kvirtd.service");
    a.wait(
        "k-rwo-b gone",
        BOOT,
        "! kubectl get vmi k-rwo-b 2>/dev/null",
    );
    assert!(host_clean(&b, "k-rwo-b"));
    assert!(
        !kubectl(&a, "get pvc k-shared -o jsonpath='{.metadata.finalizers}'")
            .contains("kvirt.io/pvc-in-use")
    );
    assert!(
        b.ok(&format!("ls -l {img}")).starts_with("-rw------- "),
        "grant taken back"
    );
    kubectl(&a, "delete pvc k-shared --timeout=60s");
    kubectl(&a, "delete pv k-shared --timeout=60s");
    for h in [&a, &b] {
        h.ok("rm -rf /var/lib/kvirt/claims/k-shared");
    }
}

/// A Block claim on a local PV (a loop device of node-a's): the VM gets
/// the device, its data is there for the next VMI on the claim, and the
/// host's device node is left as it was.
#[test]
fn a_block_claim_boots_and_keeps_its_data() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    let dev = a.ok("cat /share/claim-loop 2>/dev/null || true");
    if dev.is_empty() {
        eprintln!("no loop device on test host A: the block claim case is skipped");
        return;
    }
    let before = a.ok(&format!("stat -c %u:%g:%a {dev}"));
    apply(
        &a,
        &format!(
            "apiVersion: v1
kind: PersistentVolume
metadata: {{name: k-block}}
spec:
  capacity: {{storage: 64Mi}}
  volumeMode: Block
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: kvirt-test-block
  local: {{path: {dev}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [node-a]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: k-block, namespace: default}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: kvirt-test-block
  volumeName: k-block
  resources: {{requests: {{storage: 64Mi}}}}
"
        ),
    );
    a.wait(
        "k-block Bound",
        WAIT,
        "[ \"$(kubectl get pvc k-block -o jsonpath='{.status.phase}')\" = Bound ]",
    );
    for (vm, was) in [
        ("k-block-1", "..............."),
        ("k-block-2", "KVIRT-PERSISTED"),
    ] {
        disk(&[&a], vm, "run");
        apply(&a, &claim_vmi(vm, "k-block"));
        wait_vmi(&a, vm, ".status.phase", "Running", BOOT);
        a.serial_log_shows(vm, &format!("KVIRT-CLAIM-WAS {was}"));
        a.serial_log_shows(vm, "KVIRT-CLAIM-WRITTEN");
        let info = kubectl(
            &a,
            &format!("get vmi {vm} -o jsonpath='{{.status.volumeStatus[?(@.name==\"data\")].persistentVolumeClaimInfo.volumeMode}}'"),
        );
        assert_eq!(info, "Block");
        delete(&a, vm);
    }
    assert_eq!(a.ok(&format!("stat -c %u:%g:%a {dev}")), before);
    kubectl(&a, "delete pvc k-block --timeout=60s");
    kubectl(&a, "delete pv k-block --timeout=60s");
}

/// A NetworkAttachmentDefinition on the bridge `kvtred`, which each host
/// has on its link `red0` (as nodes have a bridge on a NIC of a network
/// they share), its host-local addresses from
/// `10.78.0.<first>` on: host-local leases are each host's own, as on any
/// cluster's nodes, so each host's VMs get a range of their own.
fn red_nad(name: &str, first: u8) -> String {
    format!(
        "apiVersion: k8s.cni.cncf.io/v1
kind: NetworkAttachmentDefinition
metadata: {{name: {name}, namespace: default}}
spec:
  config: '{{\"cniVersion\":\"0.3.1\",\"type\":\"bridge\",\"bridge\":\"kvtred\",\"ipam\":{{\"type\":\"host-local\",\"subnet\":\"10.78.0.0/24\",\"rangeStart\":\"10.78.0.{first}\",\"rangeEnd\":\"10.78.0.{}\"}}}}'
",
        first + 9
    )
}

/// A VMI for `node` on the pod network and the network `nad`.
fn red_vmi(name: &str, node: &str, nad: &str, user_data: &str) -> String {
    let mut y = support::vmi_manifest(
        name,
        &format!("kubevirt.io/nodeName: {node}"),
        &format!("  networks: [{{name: default, pod: {{}}}}, {{name: red, multus: {{networkName: {nad}}}}}]\n"),
        "      - name: ci\n        disk: {bus: virtio}\n      interfaces: [{name: default, masquerade: {}}, {name: red, bridge: {}}]\n",
    );
    y.push_str(&format!(
        "  - name: ci\n    cloudInitNoCloud:\n      userData: |\n        #!/bin/sh\n        {user_data}\n"
    ));
    y
}

#[test]
fn secondary_networks_are_the_clusters_network_attachment_definitions() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    disk(&[&a], "k-red-a", "run");
    disk(&[&b], "k-red-b", "run");
    for h in [&a, &b] {
        h.ok(
            "{ ip link show kvtred >/dev/null 2>&1 || ip link add kvtred type bridge; } &&
             ip link set red0 master kvtred && ip link set kvtred up",
        );
    }
    // A VMI whose network does not exist yet waits, and says why.
    apply(&a, &red_vmi("k-red-a", "node-a", "red-a", "true"));
    wait_vmi(
        &a,
        "k-red-a",
        ".status.conditions[?(@.type==\"Ready\")].reason",
        "FailedCreatePodSandBox",
        WAIT,
    );
    a.wait(
        "the FailedCreatePodSandBox event",
        WAIT,
        "kubectl get events --field-selector involvedObject.name=k-red-a | grep -q FailedCreatePodSandBox",
    );
    assert!(!unit_loaded(&a, "k-red-a"));
    // Created: the VMI starts on its next try.
    apply(&a, &red_nad("red-a", 10));
    apply(&a, &red_nad("red-b", 20));
    wait_vmi(
        &a,
        "k-red-a",
        ".status.phase",
        "Running",
        Duration::from_secs(120),
    );
    apply(
        &a,
        &red_vmi(
            "k-red-b",
            "node-b",
            "red-b",
            "(while ! ping -c1 -W1 10.78.0.10 >/dev/null 2>&1; do sleep 1; done; echo KVIRT-PING-OK) &",
        ),
    );
    wait_vmi(
        &a,
        "k-red-b",
        ".status.phase",
        "Running",
        Duration::from_secs(120),
    );
    let ip = |vm: &str| {
        kubectl(
            &a,
            &format!(
                "get vmi {vm} -o jsonpath='{{.status.interfaces[?(@.name==\"red\")].ipAddress}}'"
            ),
        )
    };
    a.wait("k-red-a's red address", WAIT, "kubectl get vmi k-red-a -o jsonpath='{.status.interfaces[1].ipAddress}' | grep -q 10.78.0.10");
    assert_eq!(ip("k-red-a"), "10.78.0.10");
    assert_eq!(ip("k-red-b"), "10.78.0.20");
    // Multus's network-status on the VMI, as on a pod.
    let ns = kubectl(
        &a,
        "get vmi k-red-b -o jsonpath='{.metadata.annotations.k8s\\.v1\\.cni\\.cncf\\.io/network-status}'",
    );
    let ns: serde_json::Value = serde_json::from_str(&ns).unwrap_or_else(|e| panic!("{e}: {ns}"));
    assert_eq!(ns[1]["name"], "default/red-b", "{ns}");
    assert_eq!(ns[1]["ips"], serde_json::json!(["10.78.0.20"]), "{ns}");
    // Across hosts, guest to guest on the secondary network.
    b.wait(
        "k-red-b's guest reaches k-red-a's",
        Duration::from_secs(120),
        "grep -q KVIRT-PING-OK /run/kvirt/vms/default_k-red-b/console.log",
    );
    delete(&a, "k-red-a");
    delete(&a, "k-red-b");
    for h in [&a, &b] {
        h.ok("! ls /var/lib/cni/results 2>/dev/null | grep -q red-");
        h.ok("! ls /var/lib/cni/networks/red-a /var/lib/cni/networks/red-b 2>/dev/null | grep -q '^10\\.'");
    }
    kubectl(&a, "delete network-attachment-definitions red-a red-b");
    for h in [&a, &b] {
        h.ok("ip link del kvtred");
    }
}

/// A masquerade VMI for `node` whose disk is on the storage both hosts
/// share (a shared root: it may migrate).
fn shared_vmi(name: &str, node: &str) -> String {
    support::vmi_manifest(
        name,
        &format!("kubevirt.io/nodeName: {node}"),
        "  networks: [{name: default, pod: {}}]\n",
        "      interfaces: [{name: default, masquerade: {}, ports: [{port: 8080}]}]\n",
    )
    .replace(
        &format!("/var/lib/kvirt/images/{name}.raw"),
        &format!("/srv/shared/{name}.raw"),
    )
}

/// A migration object as a user writes one; `meta`: more of its metadata
/// (`annotations: {...}`, `labels: {...}`).
fn migration_yaml(name: &str, vmi: &str, meta: &str) -> String {
    let meta = if meta.is_empty() {
        String::new()
    } else {
        format!(", {meta}")
    };
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstanceMigration
metadata: {{name: {name}, namespace: default{meta}}}
spec: {{vmiName: {vmi}}}
"
    )
}

fn vmim_field(h: &Host, name: &str, jsonpath: &str) -> String {
    kubectl(h, &format!("get vmim {name} -o jsonpath='{{{jsonpath}}}'"))
}

/// Creates migration `name` of `vm` (`meta`: more of its metadata) and
/// waits for it to succeed; checks what KubeVirt's clients read (the VMI's
/// node, the labels, the migration's state), that kvirt labelled it for
/// the host that ran it, and that the guest counts on at `to`, never
/// restarting, answering through its pod address there, and nothing of it
/// is left at `from`.
fn migrate_and_check(a: &Host, from: &Host, to: &Host, name: &str, vm: &str, meta: &str) {
    from.wait_until("the guest counting", BOOT, || {
        from.guest_counts(vm).len() >= 2
    });
    let before = *from.guest_counts(vm).last().unwrap();
    let (from_node, to_node) = (node_of(from), node_of(to));
    apply(a, &migration_yaml(name, vm, meta));
    a.wait(
        &format!("vmim/{name} Succeeded"),
        BOOT,
        &format!("[ \"$(kubectl get vmim {name} -o jsonpath='{{.status.phase}}')\" = Succeeded ]"),
    );
    assert_eq!(
        vmim_field(a, name, ".metadata.labels.kubevirt\\.io/vmi-name"),
        vm
    );
    assert_eq!(
        vmim_field(a, name, ".metadata.labels.kvirt\\.io/host"),
        from_node
    );
    // How it went, on the object: the time and the guest's pause.
    let progress = ".status.conditions[?(@.type==\"kvirt.io/Progress\")]";
    a.wait(
        "the migration's outcome on its object",
        WAIT,
        &format!(
            "kubectl get vmim {name} -o jsonpath='{{{progress}.reason}}' | grep -qx Succeeded"
        ),
    );
    let said = vmim_field(a, name, &format!("{progress}.message"));
    assert!(
        said.contains(" moved to ") && said.contains("pause"),
        "{said}"
    );
    let state: serde_json::Value =
        serde_json::from_str(&vmim_field(a, name, ".status.migrationState")).unwrap();
    assert!(
        state["completed"] == true
            && state["failed"] == false
            && state["sourceNode"] == from_node.as_str()
            && state["targetNode"] == to_node.as_str()
            && state["migrationUid"] == vmim_field(a, name, ".metadata.uid").as_str(),
        "{state}"
    );
    wait_vmi(a, vm, ".status.nodeName", &to_node, WAIT);
    wait_vmi(
        a,
        vm,
        ".metadata.labels.kubevirt\\.io/nodeName",
        &to_node,
        WAIT,
    );
    wait_vmi(a, vm, ".status.migrationState.completed", "true", WAIT);
    assert_eq!(
        kubectl(a, &format!("get vmi {vm} -o jsonpath='{{.metadata.labels.kubevirt\\.io/migrationTargetNodeName}}'")),
        ""
    );
    wait_vmi(a, vm, ".status.phase", "Running", WAIT);
    to.assert_counts_on(vm, before);
    // The pod address is the target's now (its subnet), and answers there.
    let subnet = if to_node == "node-b" {
        "10.214.0."
    } else {
        "10.213.0."
    };
    a.wait(
        "the VMI's pod address on the target",
        WAIT,
        &format!("kubectl get vmi {vm} -o jsonpath='{{.status.interfaces[0].ipAddress}}' | grep -q '^{subnet}'"),
    );
    let ip = kubectl(
        a,
        &format!("get vmi {vm} -o jsonpath='{{.status.interfaces[0].ipAddress}}'"),
    );
    to.wait(
        "the guest answering through the target",
        WAIT,
        &format!("busybox wget -q -O- -T 5 http://{ip}:8080/ | grep -q 'KVIRT-HELLO 8080'"),
    );
    from.wait_until("nothing of the VM left on the source", WAIT, || {
        host_clean(from, vm)
    });
    for h in [from, to] {
        h.ok("[ -z \"$(ls /run/kvirt/migrations)\" ]");
    }
}

/// Creates migration `name` of `vm`, waits for it to fail, and returns why.
fn fails(a: &Host, name: &str, vm: &str, meta: &str) -> String {
    apply(a, &migration_yaml(name, vm, meta));
    a.wait(
        &format!("vmim/{name} Failed"),
        WAIT,
        &format!("[ \"$(kubectl get vmim {name} -o jsonpath='{{.status.phase}}')\" = Failed ]"),
    );
    vmim_field(a, name, ".status.migrationState.failureReason")
}

fn node_of(h: &Host) -> String {
    h.ok("sed -n 's/^node_name = \"\\(.*\\)\"/\\1/p' /etc/kvirt/kvirtd.toml.d/50-test.toml")
}

/// `VirtualMachineInstanceMigration`s through the API server, as kubectl
/// and KubeVirt's clients make them: one moves a running VMI from A to the
/// host the scheduler's rules choose (B, announced on its Lease), another
/// back to the host kvirt's annotation names, live; one naming no host
/// that could take it fails with the reason and the VM runs on, as does a
/// VMI whose disk is A's own.
#[test]
fn migration_objects_move_a_running_vmi_between_nodes_live() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // B announces where it takes migrations, for its peers to choose it.
    let announced = kubectl(
        &a,
        "get lease -n kube-node-lease kvirt-node-b -o jsonpath='{.metadata.annotations.kvirt\\.io/host}'",
    );
    assert!(
        announced.contains("\"migration\":\"10.250.0.2:8444\""),
        "{announced}"
    );
    a.ok("cp /srv/guest/run.raw /srv/shared/k-mover.raw");
    apply(&a, &shared_vmi("k-mover", "node-a"));
    wait_vmi(&a, "k-mover", ".status.phase", "Running", BOOT);
    wait_vmi(
        &a,
        "k-mover",
        ".status.conditions[?(@.type==\"LiveMigratable\")].status",
        "True",
        WAIT,
    );
    migrate_and_check(&a, &a, &b, "k-mover-1", "k-mover", "");
    // Labelled for A, whose VMI is B's: A hands it on to B, which moves it.
    migrate_and_check(
        &a,
        &b,
        &a,
        "k-mover-2",
        "k-mover",
        "annotations: {kvirt.io/target-node: node-a}, labels: {kvirt.io/host: node-a}",
    );
    // Deleting the object while its migration runs (throttled, so that
    // it is caught midway) cancels it: the VM stays on A, B keeps nothing.
    a.ok("printf '[migration]\\nbandwidth_per_migration_mib = 1\\n' >/etc/kvirt/kvirtd.toml.d/70-slow.toml
          systemctl restart kvirtd");
    let before = *a.guest_counts("k-mover").last().unwrap();
    apply(&a, &migration_yaml("k-mover-c", "k-mover", ""));
    b.wait(
        "the target's QEMU listening for the guest's memory",
        BOOT,
        "[ -S /run/kvirt/vms/default_k-mover/migration/memory.sock ]",
    );
    // Its figures while it runs: on the object, and in A's metrics.
    a.wait(
        "the migration's figures on its object",
        WAIT,
        "kubectl get vmim k-mover-c -o jsonpath='{.status.conditions[?(@.type==\"kvirt.io/Progress\")].message}' | grep -q 'MiB remaining'",
    );
    a.wait(
        "the migration's figures in A's metrics",
        WAIT,
        "busybox wget -q -O - http://127.0.0.1:9477/metrics | grep -q 'kvirt_migration_data_remaining_bytes{namespace=\"default\",name=\"k-mover\"}'",
    );
    let uid = vmim_field(&a, "k-mover-c", ".metadata.uid");
    kubectl(&a, "delete vmim k-mover-c");
    wait_vmi(
        &a,
        "k-mover",
        ".status.migrationState.migrationUid",
        &uid,
        WAIT,
    );
    wait_vmi(&a, "k-mover", ".status.migrationState.failed", "true", WAIT);
    b.wait_until("nothing of the VM left on B", WAIT, || {
        host_clean(&b, "k-mover")
    });
    a.ok("rm /etc/kvirt/kvirtd.toml.d/70-slow.toml && systemctl restart kvirtd");
    assert_eq!(
        kubectl(&a, "get vmi k-mover -o jsonpath='{.status.nodeName}'"),
        "node-a"
    );
    a.assert_counts_on_here("k-mover", before);
    // No host that could take it: Failed, with why; the VM runs on.
    let reason = fails(
        &a,
        "k-mover-3",
        "k-mover",
        "annotations: {kvirt.io/target-node: node-x}",
    );
    assert!(reason.contains("no live kvirt host node-x"), "{reason}");
    // A VMI that runs nowhere: no host takes the object up; it fails.
    let reason = fails(&a, "k-none-1", "k-none", "");
    assert_eq!(reason, "the VMI default/k-none does not exist");
    // A VMI whose disk is A's own cannot move: refused, it runs on.
    disk(&[&a], "k-local", "run");
    apply(&a, &vmi_yaml("k-local", "kubevirt.io/nodeName: node-a", ""));
    wait_vmi(&a, "k-local", ".status.phase", "Running", BOOT);
    let reason = fails(&a, "k-local-1", "k-local", "");
    assert!(reason.contains("DisksNotLiveMigratable"), "{reason}");
    for vm in ["k-mover", "k-local"] {
        assert_eq!(
            kubectl(
                &a,
                &format!("get vmi {vm} -o jsonpath='{{.status.nodeName}}'")
            ),
            "node-a"
        );
        wait_vmi(&a, vm, ".status.phase", "Running", WAIT);
    }
    kubectl(
        &a,
        "delete vmim k-mover-1 k-mover-2 k-mover-3 k-local-1 k-none-1",
    );
    delete(&a, "k-mover");
    delete(&a, "k-local");
    for h in [&a, &b] {
        for vm in ["k-mover", "k-local"] {
            h.wait_until("the VM gone", WAIT, || host_clean(h, vm));
        }
    }
    a.ok("rm -f /srv/shared/k-mover.raw");
}

/// kill -9 of either kvirtd while a migration object's migration runs
/// (throttled to 1 MiB/s, so caught midway): the target's first, then the
/// source's (whose restart finds the job, aborts it and says so on the
/// VMI). Each time the object ends `Failed`, the VM runs on at A exactly
/// once (the guest never restarted), and B keeps nothing of it.
#[test]
fn a_kvirtd_killed_midway_fails_the_migration_object_and_the_vm_runs_once() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    a.ok("cp /srv/guest/run.raw /srv/shared/k-kill.raw");
    apply(&a, &shared_vmi("k-kill", "node-a"));
    wait_vmi(&a, "k-kill", ".status.phase", "Running", BOOT);
    a.ok("printf '[migration]\\nbandwidth_per_migration_mib = 1\\n' >/etc/kvirt/kvirtd.toml.d/70-slow.toml
          systemctl restart kvirtd");
    for (n, killed) in [(1, &b), (2, &a)] {
        a.wait_until("the guest counting", BOOT, || {
            a.guest_counts("k-kill").len() >= 2
        });
        let before = *a.guest_counts("k-kill").last().unwrap();
        let name = format!("k-kill-{n}");
        apply(&a, &migration_yaml(&name, "k-kill", ""));
        b.wait(
            "the target's QEMU listening for the guest's memory",
            BOOT,
            "[ -S /run/kvirt/vms/default_k-kill/migration/memory.sock ]",
        );
        let pid = killed.ok("systemctl show -P MainPID kvirtd");
        killed.ok("systemctl kill -s KILL kvirtd");
        killed.wait_new_kvirtd("SIGKILL", "MainPID", &pid);
        a.wait(
            &format!("vmim/{name} Failed"),
            BOOT,
            &format!("[ \"$(kubectl get vmim {name} -o jsonpath='{{.status.phase}}')\" = Failed ]"),
        );
        wait_vmi(&a, "k-kill", ".status.migrationState.failed", "true", WAIT);
        if n == 2 {
            // The restarted source found the job, aborted it, and said so.
            let why = vmim_field(&a, &name, ".status.migrationState.failureReason");
            assert_eq!(why, "the source kvirtd restarted midway");
        }
        b.wait_until("nothing of the VM left on B", BOOT, || {
            host_clean(&b, "k-kill")
        });
        assert_eq!(
            kubectl(&a, "get vmi k-kill -o jsonpath='{.status.nodeName}'"),
            "node-a"
        );
        wait_vmi(&a, "k-kill", ".status.phase", "Running", WAIT);
        a.assert_counts_on_here("k-kill", before);
    }
    a.ok("rm /etc/kvirt/kvirtd.toml.d/70-slow.toml && systemctl restart kvirtd");
    kubectl(&a, "delete vmim k-kill-1 k-kill-2");
    delete(&a, "k-kill");
    for h in [&a, &b] {
        h.wait_until("the VM gone", WAIT, || host_clean(h, "k-kill"));
    }
    a.ok("rm -f /srv/shared/k-kill.raw");
}

/// `lease` (a host's Lease) announces its host cordoned, or not.
fn announced_cordoned(a: &Host, node: &str, cordoned: bool) {
    let not = if cordoned { "" } else { "!" };
    a.wait(
        &format!("{node}'s Lease announcing cordoned={cordoned}"),
        WAIT,
        &format!(
            "{not} kubectl get lease -n kube-node-lease kvirt-{node} \
               -o jsonpath='{{.metadata.annotations.kvirt\\.io/host}}' | grep -q '\"cordoned\":true'"
        ),
    );
}

/// `manifest` with its hostDisk on the storage both hosts share.
fn on_shared(manifest: &str, name: &str) -> String {
    manifest.replace(
        &format!("/var/lib/kvirt/images/{name}.raw"),
        &format!("/srv/shared/{name}.raw"),
    )
}

/// `kvirtctl drain` of a cluster host with three VMs, as KubeVirt
/// evacuates a node: a VirtualMachine's VMI (`LiveMigrate`) and a VMI of
/// its own (`LiveMigrateIfPossible`) move to the other host by migration
/// objects named and annotated as KubeVirt's evacuation names them, live
/// (the VirtualMachine follows its VMI there); the VirtualMachine whose
/// strategy is `None` is stopped as `virtctl stop` stops it. Progress
/// comes line by line; the host ends empty and cordoned: it claims no VMI
/// and no migration chooses it, until `kvirtctl uncordon`.
#[test]
fn kvirtctl_drain_empties_a_cluster_host_through_migration_objects() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // What a failed earlier run may have left goes first.
    a.ok("kvirtctl uncordon
          kubectl delete vm d-vm d-stop --ignore-not-found --wait=false
          kubectl delete vmi d-vmi --ignore-not-found --wait=false
          kubectl delete vmim -l 'kubevirt.io/vmi-name in (d-vm,d-vmi)' --ignore-not-found");
    a.wait(
        "no d- VMI left",
        WAIT,
        "! kubectl get vmi d-vm d-vmi d-stop 2>/dev/null | grep -q d-",
    );
    // B cordoned (an empty host drains at once) while the VMs are made:
    // A alone claims them.
    let out = b.ok("kvirtctl drain node-b");
    assert!(out.contains("drained: no VM runs here"), "{out}");
    announced_cordoned(&a, "node-b", true);
    a.ok(
        "cp /srv/guest/run.raw /srv/shared/d-vm.raw && cp /srv/guest/run.raw /srv/shared/d-vmi.raw",
    );
    disk(&[&a], "d-stop", "run");
    let z1 = "  nodeSelector: {zone: z1}\n";
    let vm = support::vm_manifest(
        "d-vm",
        "Always",
        &format!("{z1}  evictionStrategy: LiveMigrate\n"),
    );
    apply(&a, &on_shared(&vm, "d-vm"));
    let vmi = support::vmi_manifest(
        "d-vmi",
        "kubevirt.io/nodeName: node-a",
        "  evictionStrategy: LiveMigrateIfPossible\n",
        "",
    );
    apply(&a, &on_shared(&vmi, "d-vmi"));
    apply(
        &a,
        &support::vm_manifest(
            "d-stop",
            "Always",
            &format!("{z1}  evictionStrategy: None\n"),
        ),
    );
    for vm in ["d-vm", "d-vmi", "d-stop"] {
        wait_vmi(&a, vm, ".status.phase", "Running", BOOT);
        wait_vmi(&a, vm, ".status.nodeName", "node-a", WAIT);
    }
    assert!(b.ok("kvirtctl uncordon").contains("uncordoned"));
    announced_cordoned(&a, "node-b", false);
    let vm_uid = vm_field(&a, "d-vm", "{.metadata.uid}");
    let vmi_uid = kubectl(&a, "get vmi d-vm -o jsonpath='{.metadata.uid}'");
    let mut before = Vec::new();
    for vm in ["d-vm", "d-vmi"] {
        a.wait_until("the guest counting", BOOT, || a.guest_counts(vm).len() >= 2);
        before.push(*a.guest_counts(vm).last().unwrap());
    }
    // Named as kubectl drain names a node: the wrong host's is refused.
    let wrong = a.sh("kvirtctl drain node-b");
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && err.contains("the kvirtd of node-a, not of node-b"),
        "{err}"
    );
    let out = a.ok("kvirtctl drain node-a");
    assert!(
        out.starts_with("cordoned: this host takes no VM arriving\n")
            && out.contains("default/d-vm: migrating\n")
            && out
                .matches(" moved to node-b (migration kubevirt-evacuation-")
                .count()
                == 2
            && out.contains(
                "its VirtualMachine default/d-stop stopped (virtctl start d-stop -n default"
            )
            && out.trim_end().ends_with("drained: no VM runs here"),
        "{out}"
    );
    // The objects KubeVirt's evacuation makes, Succeeded.
    for vm in ["d-vm", "d-vmi"] {
        let field = |path: &str| {
            kubectl(
                &a,
                &format!(
                    "get vmim -l kubevirt.io/vmi-name={vm} -o jsonpath='{{.items[0].{path}}}'"
                ),
            )
        };
        assert_eq!(
            field("metadata.annotations.kubevirt\\.io/evacuationMigration"),
            "node-a"
        );
        assert_eq!(field("status.phase"), "Succeeded");
        assert!(field("metadata.name").starts_with("kubevirt-evacuation-"));
        wait_vmi(&a, vm, ".status.nodeName", "node-b", WAIT);
    }
    for (vm, before) in ["d-vm", "d-vmi"].into_iter().zip(before) {
        b.assert_counts_on(vm, before);
    }
    // The VirtualMachine follows its VMI (the same one, live) to B.
    assert_eq!(
        kubectl(&a, "get vmi d-vm -o jsonpath='{.metadata.uid}'"),
        vmi_uid
    );
    a.wait(
        "kubectl get vm shows d-vm Running and Ready",
        WAIT,
        "kubectl get vm d-vm --no-headers | grep -Eq 'Running +True'",
    );
    assert_eq!(vm_field(&a, "d-vm", "{.metadata.uid}"), vm_uid);
    // d-stop stopped as virtctl stops it: Halted, its VMI gone.
    assert_eq!(vm_field(&a, "d-stop", "{.spec.runStrategy}"), "Halted");
    a.wait(
        "d-stop's VMI gone",
        WAIT,
        "! kubectl get vmi d-stop 2>/dev/null",
    );
    for vm in ["d-vm", "d-vmi", "d-stop"] {
        a.wait_until("nothing of the VM left on A", WAIT, || host_clean(&a, vm));
    }
    // Cordoned: no migration chooses A (kvirtctl migrate, in a cluster,
    // makes the object and waits for it), until kvirtctl uncordon.
    announced_cordoned(&a, "node-a", true);
    let refused = b.sh("kvirtctl migrate default/d-vmi");
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("node-a: cordoned"),
        "{err}"
    );
    wait_vmi(&a, "d-vmi", ".status.phase", "Running", WAIT);
    assert!(a.ok("kvirtctl uncordon node-a").contains("uncordoned"));
    announced_cordoned(&a, "node-a", false);
    let back = b.ok("kvirtctl migrate default/d-vmi");
    assert!(
        back.contains("default/d-vmi moved to node-a (migration kubevirt-migrate-vm-"),
        "{back}"
    );
    wait_vmi(&a, "d-vmi", ".status.nodeName", "node-a", WAIT);
    kubectl(&a, "delete vmim -l kubevirt.io/vmi-name=d-vm");
    kubectl(&a, "delete vmim -l kubevirt.io/vmi-name=d-vmi");
    kubectl(&a, "delete vm d-vm d-stop --wait=false");
    delete(&a, "d-vmi");
    for h in [&a, &b] {
        for vm in ["d-vm", "d-vmi", "d-stop"] {
            h.wait_until("the VM gone", WAIT, || host_clean(h, vm));
        }
    }
    a.ok("rm -f /srv/shared/d-vm.raw /srv/shared/d-vmi.raw");
}

/// The holder of the election Lease (`core::election`).
fn leader(h: &Host) -> String {
    kubectl(
        h,
        "get lease -n kube-node-lease kvirt.controllers -o jsonpath='{.spec.holderIdentity}'",
    )
}

/// One kvirtd at a time runs the cluster's controllers (VirtualMachines,
/// replica sets, dead hosts): the one holding the Lease kvirt.controllers.
/// Its kvirtd stopped, the other host takes the Lease over and runs a new
/// VirtualMachine; started again, the first follows (it does not take the
/// Lease back while the new leader renews it).
#[test]
fn the_clusters_controllers_run_on_one_elected_host_and_move_when_it_stops() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    a.ok("kubectl delete vm k-lead --ignore-not-found --wait=false");
    a.wait(
        "no k-lead left",
        WAIT,
        "! kubectl get vm k-lead 2>/dev/null && ! kubectl get vmi k-lead 2>/dev/null",
    );
    a.wait(
        "a leader",
        WAIT,
        "kubectl get lease -n kube-node-lease kvirt.controllers -o jsonpath='{.spec.holderIdentity}' | grep -q node-",
    );
    let first = leader(&a);
    let (old, new, other) = if first == "node-a" {
        (&a, &b, "node-b")
    } else {
        (&b, &a, "node-a")
    };
    // Only the leader runs them: only its log says it leads.
    assert!(old.succeeds("journalctl -u kvirtd --no-pager | grep -q 'this host leads'"));
    let transitions = |h: &Host| {
        kubectl(
            h,
            "get lease -n kube-node-lease kvirt.controllers -o jsonpath='{.spec.leaseTransitions}'",
        )
        .parse::<u32>()
        .unwrap_or(0)
    };
    let before = transitions(&a);

    old.ok("systemctl stop kvirtd");
    let taken = Instant::now();
    a.wait(
        &format!("{other} leading"),
        WAIT,
        &format!(
            "[ \"$(kubectl get lease -n kube-node-lease kvirt.controllers -o jsonpath='{{.spec.holderIdentity}}')\" = {other} ]"
        ),
    );
    eprintln!(
        "the Lease moved {:?} after the leader stopped",
        taken.elapsed()
    );
    assert_eq!(transitions(&a), before + 1);
    old.ok("systemctl start kvirtd");

    // The new leader runs a new VirtualMachine (on either host).
    disk(&[&a, &b], "k-lead", "run");
    apply(
        &a,
        &support::vm_manifest("k-lead", "Always", "  nodeSelector: {zone: z1}\n"),
    );
    a.wait(
        "k-lead Running",
        Duration::from_secs(120),
        "kubectl get vm k-lead --no-headers | grep -Eq 'Running +True'",
    );
    assert!(new.succeeds(
        "journalctl -u kvirtd --no-pager -n 500 | grep -q 'default/k-lead: VirtualMachine: created its VMI'"
    ));
    old.wait(
        "the first kvirtd back",
        WAIT,
        "systemctl is-active -q kvirtd && journalctl -u kvirtd -n 50 | grep -q ready",
    );
    assert_eq!(leader(&a), other, "the first host took the Lease back");
    assert_eq!(transitions(&a), before + 1);
    a.ok("kubectl delete vm k-lead --wait=false");
    a.wait(
        "k-lead gone",
        Duration::from_secs(120),
        "! kubectl get vmi k-lead 2>/dev/null",
    );
}
