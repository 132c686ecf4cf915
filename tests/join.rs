//! Tier 3 with the cluster of `cluster.rs`: how kvirt hosts get their
//! identities. Both hosts joined as the README says (`tests/common.sh`
//! `kvirt_k8s_join`: a bootstrap token, `kvirtd join`; node-a approved by
//! the administrator, node-b by node-a's kvirtd), and here: what a joined
//! kvirtd approves and denies, an expired token, and a kvirtd killed while
//! its request waits. Real kube-apiserver (bootstrap token authentication)
//! and kube-controller-manager (the client certificate signer).

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

/// A bootstrap token for `node`, made as an administrator makes it.
fn token(a: &Host, node: &str) -> String {
    a.ok(&format!(
        "kvirtd --print-bootstrap-token --node {node} 2>/tmp/hint | kubectl apply -f - >/dev/null
         sed -n 's/.* --token \\([^ ]*\\) .*/\\1/p' /tmp/hint"
    ))
}

/// Creates a certificate request `name` on A as the holder of `token`, for
/// the subject `subj` (openssl's `/O=.../CN=...`), with `extra` openssl
/// request arguments; prints kubectl's output.
fn request_as_token(a: &Host, token: &str, name: &str, subj: &str, extra: &str) -> String {
    a.ok(&format!(
        "cd $(mktemp -d)
         openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out k 2>/dev/null
         openssl req -new -key k -subj '{subj}' {extra} -out r
         cat >csr.yaml <<EOF
apiVersion: certificates.k8s.io/v1
kind: CertificateSigningRequest
metadata: {{name: {name}}}
spec:
  signerName: kubernetes.io/kube-apiserver-client
  usages: [digital signature, client auth]
  expirationSeconds: 3600
  request: $(base64 -w0 r)
EOF
         kubectl --kubeconfig=/dev/null --server=https://127.0.0.1:6443 \
           --certificate-authority=/etc/kvirt/pki/ca.crt --token='{token}' create --validate=false -f csr.yaml 2>&1 || true"
    ))
}

fn condition(a: &Host, name: &str) -> String {
    a.ok(&format!(
        "kubectl get csr {name} -o jsonpath='{{.status.conditions[0].type}} {{.status.conditions[0].message}}'"
    ))
}

fn wait_decided(a: &Host, name: &str) -> String {
    a.wait(
        &format!("csr/{name} decided"),
        WAIT,
        &format!("kubectl get csr {name} -o jsonpath='{{.status.conditions[0].type}}' | grep -q ."),
    );
    condition(a, name)
}

/// The requests the next test makes.
const CASES: &str = "join-alice join-wrong-node join-sans join-admins join-node-c";

#[test]
fn hosts_join_by_token_and_only_exact_requests_are_approved() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // Each host is its own node's identity, from a key that never left it.
    for (h, node) in [(&a, "node-a"), (&b, "node-b")] {
        let who = h.ok(
            "kubectl --kubeconfig=/etc/kvirt/kubeconfig auth whoami -o jsonpath='{.status.userInfo.username} {.status.userInfo.groups}'",
        );
        assert!(who.starts_with(&format!("kvirt:node:{node} ")), "{who}");
        assert!(who.contains("kvirt:nodes"), "{who}");
        h.ok(
            "[ \"$(stat -c '%U %a' /etc/kvirt/kubeconfig)\" = 'root 600' ]
              [ ! -e /etc/kvirt/kubeconfig.pending-key ]",
        );
    }
    // One host reviews the cluster's requests, the leader; the other only
    // the leader's own (which no host approves for itself).
    a.wait(
        "a host leads",
        WAIT,
        "kubectl get lease -n kube-node-lease kvirt.controllers -o jsonpath='{.spec.holderIdentity}' | grep -q node-",
    );
    let leader = a.ok(
        "kubectl get lease -n kube-node-lease kvirt.controllers -o jsonpath='{.spec.holderIdentity}'",
    );
    for (h, node) in [(&a, "node-a"), (&b, "node-b")] {
        let expected = if node == leader {
            "every request (this host leads)".to_owned()
        } else {
            format!("those of the leader, {leader}")
        };
        h.wait(
            &format!("{node} reviews {expected}"),
            WAIT,
            &format!(
                "journalctl -u kvirtd -o cat --no-pager | grep 'certificate requests reviewed here' | tail -n1 | grep -qF '{expected}'"
            ),
        );
    }
    // node-b's request was approved by node-a's kvirtd, as kvirt's.
    let b_csr = a.ok("kubectl get csr -o name | grep kvirt-node-node-b- | head -1 | cut -d/ -f2");
    let approved = a.ok(&format!(
        "kubectl get csr {b_csr} -o jsonpath='{{.status.conditions[0].type}} {{.status.conditions[0].reason}}'"
    ));
    assert_eq!(approved, "Approved KvirtNodeIdentity");

    // Someone else's request (not kvirt's) is left to others; seen first.
    a.ok(&format!("kubectl delete csr --ignore-not-found {CASES}"));
    a.ok("cd $(mktemp -d)
          openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out k 2>/dev/null
          openssl req -new -key k -subj '/CN=alice/O=devs' -out r
          kubectl apply -f - <<EOF
apiVersion: certificates.k8s.io/v1
kind: CertificateSigningRequest
metadata: {name: join-alice}
spec:
  signerName: kubernetes.io/kube-apiserver-client
  usages: [client auth]
  expirationSeconds: 3600
  request: $(base64 -w0 r)
EOF");
    let c = token(&a, "node-c");
    let cases = [
        (
            "join-wrong-node",
            "/O=kvirt:nodes/CN=kvirt:node:node-a",
            "",
            "token is for node node-c, not node-a",
        ),
        (
            "join-sans",
            "/O=kvirt:nodes/CN=kvirt:node:node-c",
            "-addext subjectAltName=DNS:node-c",
            "subjectAltName",
        ),
        (
            "join-admins",
            "/O=kvirt:nodes/O=admins/CN=kvirt:node:node-c",
            "",
            "nothing else",
        ),
    ];
    for (name, subj, extra, why) in cases {
        request_as_token(&a, &c, name, subj, extra);
        let decided = wait_decided(&a, name);
        assert!(
            decided.starts_with("Denied ") && decided.contains(why),
            "{name}: {decided}"
        );
        // A denied request gets no certificate.
        assert_eq!(
            a.ok(&format!(
                "kubectl get csr {name} -o jsonpath='{{.status.certificate}}'"
            )),
            ""
        );
    }
    // The exact request with node-c's token is approved and signed.
    request_as_token(
        &a,
        &c,
        "join-node-c",
        "/O=kvirt:nodes/CN=kvirt:node:node-c",
        "",
    );
    assert!(wait_decided(&a, "join-node-c").starts_with("Approved "));
    a.wait(
        "node-c's certificate signed by kube-controller-manager",
        WAIT,
        "kubectl get csr join-node-c -o jsonpath='{.status.certificate}' | base64 -d |
           openssl x509 -noout -subject | grep -q 'CN *= *kvirt:node:node-c'",
    );
    // Seen before the others, alice's is still pending: not kvirt's to decide.
    assert_eq!(condition(&a, "join-alice"), "");
    // An expired token is refused by the API server itself.
    let expired = a.ok(
        "kvirtd --print-bootstrap-token --node node-d 2>/tmp/hint-d |
           sed 's/expiration: .*/expiration: \"2020-01-01T00:00:00Z\"/' | kubectl apply -f - >/dev/null
         sed -n 's/.* --token \\([^ ]*\\) .*/\\1/p' /tmp/hint-d",
    );
    let refused = request_as_token(
        &a,
        &expired,
        "join-expired",
        "/O=kvirt:nodes/CN=kvirt:node:node-d",
        "",
    );
    assert!(refused.contains("Unauthorized"), "{refused}");
    assert!(!a.succeeds("kubectl get csr join-expired"));
    a.ok(&format!("kubectl delete csr {CASES}"));
    a.ok(
        "kubectl -n kube-system delete secret -l kvirt.io/node=node-c
          kubectl -n kube-system delete secret -l kvirt.io/node=node-d",
    );
}

/// node-b joined with a 600 s certificate (`tests/common.sh`): by 70–90 %
/// of its life kvirtd asked for the next one with its own identity, had it
/// approved by a joined kvirtd and re-executed in place to use it.
fn node_b_renewed_its_identity_in_place(a: &Host, b: &Host) {
    b.wait(
        "node-b's kvirtd renewed its identity and re-executed",
        Duration::from_secs(600),
        "journalctl -u kvirtd --no-pager | grep -q \"identity renewed.*re-executes\"",
    );
    let renewals = a.ok(
        "kubectl get csr -o jsonpath='{range .items[*]}{.metadata.name} {.spec.username} {.status.conditions[0].type} {.status.conditions[0].reason}{\"\\n\"}{end}' |
           grep '^kvirt-node-node-b-' | grep -c ' kvirt:node:node-b Approved KvirtNodeIdentity$'",
    );
    assert!(renewals.parse::<u32>().unwrap() >= 1, "{renewals}");
    let who = b.ok("kubectl --kubeconfig=/etc/kvirt/kubeconfig auth whoami -o jsonpath='{.status.userInfo.username}'");
    assert_eq!(who, "kvirt:node:node-b");
    // The renewed kvirtd talks to the API server with it: its Lease moves on.
    let lease = "kubectl -n kube-node-lease get lease kvirt-node-b -o jsonpath='{.spec.renewTime}'";
    let before = a.ok(lease);
    a.wait(
        "node-b's Lease renewed after the re-execution",
        WAIT,
        &format!("[ \"$({lease})\" != '{before}' ]"),
    );
    b.ok("systemctl is-active -q kvirtd");
}

#[test]
fn a_kvirtd_killed_while_its_request_waits_converges_to_one_identity() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // First (it would reset the clock): the first identity's renewal.
    node_b_renewed_its_identity_in_place(&a, &b);
    let before = a.ok("kubectl get csr -o name | grep -c kvirt-node-node-b- || true");
    // No approver for now: node-a's kvirtd (the only joined one) stopped;
    // its VMs run on without it.
    a.ok("systemctl stop kvirtd");
    let t = token(&a, "node-b");
    b.ok(&format!(
        "sed -i 's/^    token: .*/    token: {t}/' /etc/kvirt/bootstrap-kubeconfig
         mv /etc/kvirt/kubeconfig /root/kubeconfig.old
         systemctl restart --no-block kvirtd"
    ));
    b.wait(
        "node-b's kvirtd waiting for its request's approval",
        WAIT,
        "[ -s /etc/kvirt/kubeconfig.pending-key ] &&
         systemctl show -p StatusText --value kvirtd | grep -q 'waiting for approval'",
    );
    let pending = a.ok("kubectl get csr -o name | grep kvirt-node-node-b- | wc -l");
    assert_eq!(
        pending.parse::<u32>().unwrap(),
        before.parse::<u32>().unwrap() + 1
    );
    // Killed there; systemd starts it again, with the same key waiting.
    b.ok("systemctl kill -s KILL kvirtd");
    b.wait(
        "node-b's kvirtd started again and waiting",
        WAIT,
        "systemctl show -p StatusText --value kvirtd | grep -q 'waiting for approval'",
    );
    a.ok("systemctl start kvirtd");
    b.wait(
        "node-b's kvirtd joined and running",
        WAIT,
        "systemctl is-active -q kvirtd && [ -s /etc/kvirt/kubeconfig ] &&
         [ ! -e /etc/kvirt/kubeconfig.pending-key ]",
    );
    // One request for the restarts, approved: no second identity asked for.
    let after = a.ok("kubectl get csr -o name | grep kvirt-node-node-b- | wc -l");
    assert_eq!(after, pending);
    let who = b.ok("kubectl --kubeconfig=/etc/kvirt/kubeconfig auth whoami -o jsonpath='{.status.userInfo.username}'");
    assert_eq!(who, "kvirt:node:node-b");
    let undecided = a.ok(
        "kubectl get csr --no-headers -o custom-columns=N:.metadata.name,C:.status.conditions[0].type |
           awk '$1 ~ /^kvirt-node-/ && $2 == \"<none>\"'",
    );
    assert_eq!(undecided, "");
    b.ok("rm -f /root/kubeconfig.old");
    a.ok("kubectl -n kube-system delete secret -l kvirt.io/node=node-b");
}

/// kubectl as `node`'s kvirtd (impersonated by the administrator: the
/// admission policies see the impersonated user), on the server but
/// changing nothing; its output and error.
fn as_node(a: &Host, node: &str, args: &str) -> String {
    a.ok(&format!(
        "kubectl --as=kvirt:node:{node} --as-group=kvirt:nodes {args} 2>&1 || true"
    ))
}

const FENCED: &str = "ValidatingAdmissionPolicy 'kvirt-node-restriction'";

#[test]
fn a_hosts_identity_writes_only_its_own_nodes_objects() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // A VMI of another node (node-x: no host runs it, nothing reacts).
    a.ok("kubectl apply -f - <<'EOF'
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: fenced
  namespace: default
  labels: {kubevirt.io/nodeName: node-x}
spec:
  domain: {devices: {}, memory: {guest: 64Mi}}
EOF");
    let dry = "--dry-run=server -n default";
    // node-b may not write node-x's VMI: status, labels, finalizers...
    for patch in [
        r#"{"status":{"phase":"Failed"}}"#,
        r#"{"metadata":{"labels":{"kubevirt.io/nodeName":"node-b"}}}"#,
        r#"{"metadata":{"finalizers":["example.com/keep"]}}"#,
    ] {
        let out = as_node(
            &a,
            "node-b",
            &format!("patch vmi fenced {dry} --type=merge -p '{patch}'"),
        );
        assert!(
            out.contains(FENCED) && out.contains("only its node writes it"),
            "{patch}: {out}"
        );
    }
    // ...nor delete it (no VirtualMachine controls it).
    let out = as_node(&a, "node-b", &format!("delete vmi fenced {dry}"));
    assert!(out.contains(FENCED), "{out}");
    // Its own node may (the same writes, as node-x).
    let out = as_node(
        &a,
        "node-x",
        &format!(
            "patch vmi fenced {dry} --type=merge -p '{{\"status\":{{\"phase\":\"Failed\"}}}}'"
        ),
    );
    assert!(out.contains("patched"), "{out}");
    // Another host's Lease, kubelet's Lease name, another's EndpointSlice.
    let out = as_node(
        &a,
        "node-b",
        r#"-n kube-node-lease patch lease kvirt-node-a --dry-run=server --type=merge -p '{"spec":{"holderIdentity":"node-b"}}'"#,
    );
    assert!(out.contains(FENCED), "{out}");
    // The election Lease: held only as itself, never deleted.
    let out = as_node(
        &a,
        "node-x",
        r#"-n kube-node-lease patch lease kvirt.controllers --dry-run=server --type=merge -p '{"spec":{"holderIdentity":"node-b"}}'"#,
    );
    assert!(out.contains(FENCED), "{out}");
    // (RBAC grants no host a delete of Leases at all.)
    let out = as_node(
        &a,
        "node-x",
        "-n kube-node-lease delete lease kvirt.controllers --dry-run=server",
    );
    assert!(out.contains("forbidden"), "{out}");
    let out = as_node(
        &a,
        "node-x",
        r#"-n kube-node-lease patch lease kvirt.controllers --dry-run=server --type=merge -p '{"spec":{"holderIdentity":"node-x"}}'"#,
    );
    assert!(out.contains("patched"), "{out}");
    // Assigning an unassigned VMI to another host is the leader's only
    // (kvirt-leader-assigns reads the election Lease); to itself, any
    // host's. The VMI fits no host, so the real leader leaves it alone.
    a.ok("kubectl apply -f - <<'EOF'
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: unplaced, namespace: default}
spec:
  nodeSelector: {kvirt.test/nowhere: 'true'}
  domain: {devices: {}, memory: {guest: 64Mi}}
EOF");
    let leader = a.ok(
        "kubectl -n kube-node-lease get lease kvirt.controllers -o jsonpath='{.spec.holderIdentity}'",
    );
    let other = if leader.trim() == "node-a" {
        "node-b"
    } else {
        "node-a"
    };
    let assign = |as_: &str, to: &str| {
        as_node(
            &a,
            as_,
            &format!(
                "patch vmi unplaced {dry} --type=merge -p \
                 '{{\"metadata\":{{\"labels\":{{\"kubevirt.io/nodeName\":\"{to}\"}}}},\"status\":{{\"nodeName\":\"{to}\"}}}}'"
            ),
        )
    };
    let out = assign(other, "node-x");
    assert!(
        out.contains("kvirt-leader-assigns") && out.contains("only while it holds the Lease"),
        "{out}"
    );
    assert!(assign(leader.trim(), "node-x").contains("patched"));
    assert!(assign(other, other).contains("patched"));
    // Label and status.nodeName must agree.
    let out = as_node(
        &a,
        leader.trim(),
        &format!(
            "patch vmi unplaced {dry} --type=merge -p \
             '{{\"metadata\":{{\"labels\":{{\"kubevirt.io/nodeName\":\"node-x\"}}}},\"status\":{{\"nodeName\":\"{other}\"}}}}'"
        ),
    );
    assert!(out.contains(FENCED), "{out}");
    // The leader's scheduler says why it stays Pending, as kube-scheduler
    // does for a pod no node fits.
    a.wait(
        "a FailedScheduling Event naming the nodeSelector",
        std::time::Duration::from_secs(30),
        "kubectl get events -n default --field-selector involvedObject.name=unplaced,reason=FailedScheduling \
           -o jsonpath='{.items[*].message}' | grep -q 'nodeSelector kvirt.test/nowhere=true'",
    );
    a.ok("kubectl delete vmi unplaced --wait=false");
    // Secrets: only in opted-in namespaces (default is; kube-system never).
    assert_eq!(
        as_node(&a, "node-b", "auth can-i get secrets -n kube-system"),
        "no"
    );
    assert_eq!(
        as_node(&a, "node-b", "auth can-i get secrets -n default"),
        "yes"
    );
    a.ok("kubectl delete vmi fenced --wait=false");
}

#[test]
fn a_host_never_approves_its_own_certificate_request() {
    let Some((a, b)) = hosts() else { return };
    let _g = support::pair_turn(&a, &b);
    // No kvirtd reviewing meanwhile: the policy alone is tried.
    a.ok("systemctl stop kvirtd");
    a.ok("kubectl delete csr --ignore-not-found join-self
          kubectl --as=kvirt:node:node-b --as-group=kvirt:nodes create -f - <<EOF
apiVersion: certificates.k8s.io/v1
kind: CertificateSigningRequest
metadata: {name: join-self}
spec:
  signerName: kubernetes.io/kube-apiserver-client
  usages: [digital signature, client auth]
  expirationSeconds: 3600
  request: $(cd $(mktemp -d) && openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out k 2>/dev/null &&
    openssl req -new -key k -subj '/O=kvirt:nodes/CN=kvirt:node:node-b' | base64 -w0)
EOF");
    let approve = |node: &str| as_node(&a, node, "certificate approve join-self");
    let own = approve("node-b");
    assert!(
        own.contains("kvirt-node-csr-approval") && own.contains("never its own"),
        "{own}"
    );
    assert_eq!(condition(&a, "join-self"), "", "nothing was written");
    // Another host may (the policy lets it; kvirtd's review would too).
    let other = approve("node-a");
    assert!(other.contains("approved"), "{other}");
    a.ok("kubectl delete csr join-self; systemctl start kvirtd");
}
