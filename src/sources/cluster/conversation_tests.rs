//! The API conversation, scripted: each test plays the API server's side
//! of the exchange over a mock transport and checks every request kvirtd
//! makes (method, path, patch type, body). No cluster, no root.

use super::source::claim;
use super::status::KubeStatus;
use super::{FINALIZER, KUBEVIRT_FINALIZER};
use crate::core::vmi::{Phase, VirtualMachineInstance};
use crate::sources::StatusStore;
use http::{Request, Response};
use kube::client::Body;
use serde_json::{json, Value};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn client() -> (kube::Client, Handle) {
    let (svc, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(svc, "default"), handle)
}

const PATH: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances/vm1";

fn object(finalizers: &[&str]) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {
            "name": "vm1", "namespace": "default", "uid": "u1",
            "resourceVersion": "42", "finalizers": finalizers,
        },
        "spec": {"domain": {"devices": {}}},
    })
}

fn vmi() -> VirtualMachineInstance {
    serde_json::from_value(object(&[])).unwrap()
}

/// kvirtd's status store over the scripted API.
fn store(client: kube::Client) -> KubeStatus {
    KubeStatus {
        client,
        ca_pem: None,
        token: Default::default(),
    }
}

/// Expects one request; returns (method, path, content-type, JSON body).
async fn next(
    handle: &mut Handle,
) -> (
    String,
    String,
    String,
    Value,
    tower_test::mock::SendResponse<Response<Body>>,
) {
    let (req, send) = handle.next_request().await.expect("a request");
    let method = req.method().to_string();
    let path = req.uri().path().to_owned();
    let ctype = req
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = req.into_body().collect_bytes().await.unwrap();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    (method, path, ctype, body, send)
}

/// The API server's answer to a request it refuses: a `Status` object.
fn fail(
    send: tower_test::mock::SendResponse<Response<Body>>,
    code: u16,
    reason: Option<&str>,
    message: &str,
) {
    let mut status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "code": code, "message": message});
    if let Some(r) = reason {
        status["reason"] = r.into();
    }
    reply(send, code, status);
}

fn reply(send: tower_test::mock::SendResponse<Response<Body>>, code: u16, body: Value) {
    send.send_response(
        Response::builder()
            .status(code)
            .body(Body::from(serde_json::to_vec(&body).unwrap()))
            .unwrap(),
    );
}

#[tokio::test]
async fn status_is_one_merge_patch_of_owned_fields() {
    let (client, mut api) = client();
    let mut v = vmi();
    v.status.phase = Some(Phase::Running);
    v.status.node_name = Some("node-1".into());
    let server = tokio::spawn(async move {
        let (method, path, ctype, body, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("PATCH", PATH));
        assert_eq!(ctype, "application/merge-patch+json");
        assert_eq!(
            body,
            json!({"metadata": {"uid": "u1"}, "status": {"phase": "Running", "nodeName": "node-1"}})
        );
        reply(send, 200, object(&[]));
    });
    store(client).save(&v).await.unwrap();
    server.await.unwrap();
}

/// The VMI was deleted and made anew under its name while this status
/// was on its way: the API server refuses the patch by its uid, and that
/// is the end of it (the new object gets its own status).
#[tokio::test]
async fn a_status_for_a_replaced_vmi_is_refused_and_dropped() {
    let (client, mut api) = client();
    let mut v = vmi();
    v.status.phase = Some(Phase::Running);
    let server = tokio::spawn(async move {
        let (method, _, _, body, send) = next(&mut api).await;
        assert_eq!(method, "PATCH");
        assert_eq!(body["metadata"]["uid"], "u1");
        fail(
            send,
            409,
            Some("Conflict"),
            "Operation cannot be fulfilled on virtualmachineinstances.kubevirt.io \"vm1\": Precondition failed: UID in precondition: u1, UID in object meta: u2",
        );
    });
    store(client).save(&v).await.unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn hold_adds_the_finalizer_guarded_by_resource_version() {
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("GET", PATH));
        reply(send, 200, object(&["someone/else"]));
        let (method, _, ctype, body, send) = next(&mut api).await;
        assert_eq!(method, "PATCH");
        assert_eq!(ctype, "application/merge-patch+json");
        assert_eq!(
            body,
            json!({"metadata": {"resourceVersion": "42", "finalizers": ["someone/else", FINALIZER]}})
        );
        reply(send, 200, object(&["someone/else", FINALIZER]));
    });
    store(client).hold(&vmi()).await.unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn release_drops_ours_and_kubevirts_finalizer_only() {
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut api).await;
        reply(
            send,
            200,
            object(&[FINALIZER, "other/one", KUBEVIRT_FINALIZER]),
        );
        let (method, _, _, body, send) = next(&mut api).await;
        assert_eq!(method, "PATCH");
        assert_eq!(
            body,
            json!({"metadata": {"resourceVersion": "42", "finalizers": ["other/one"]}})
        );
        reply(send, 200, object(&["other/one"]));
    });
    store(client).release(&vmi()).await.unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn release_of_a_vanished_or_replaced_vmi_patches_nothing() {
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 404, Some("NotFound"), "gone");
        let (_, _, _, _, send) = next(&mut api).await;
        let mut replaced = object(&[FINALIZER]);
        replaced["metadata"]["uid"] = json!("another-uid");
        reply(send, 200, replaced);
    });
    let store = store(client);
    store.release(&vmi()).await.unwrap();
    store.release(&vmi()).await.unwrap();
    server.await.unwrap();
}

#[tokio::test]
async fn a_lost_claim_race_is_a_clean_no() {
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (method, path, _, body, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("PATCH", PATH));
        assert_eq!(body["metadata"]["resourceVersion"], "42");
        assert_eq!(body["metadata"]["labels"]["kubevirt.io/nodeName"], "node-1");
        fail(send, 409, Some("Conflict"), "the object has been modified");
    });
    assert!(!claim(&client, &vmi(), "node-1").await.unwrap());
    server.await.unwrap();
}

#[tokio::test]
async fn an_unreachable_api_is_an_error_to_retry() {
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 503, None, "unavailable");
    });
    let mut v = vmi();
    v.status.phase = Some(Phase::Running);
    let err = store(client).save(&v).await.unwrap_err();
    assert!(err.to_string().contains("patch status"), "{err}");
    server.await.unwrap();
}

#[tokio::test]
async fn objects_are_read_as_a_pod_volume_would_be() {
    use crate::core::objects::ObjectRef;
    let (client, mut api) = client();
    let server = tokio::spawn(async move {
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!(
            (method.as_str(), path.as_str()),
            ("GET", "/api/v1/namespaces/ns1/secrets/s1")
        );
        // "aGk=" is "hi": the data arrives decoded.
        reply(
            send,
            200,
            json!({"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": "s1"}, "data": {"userdata": "aGk="}}),
        );
        let (_, path, _, _, send) = next(&mut api).await;
        assert_eq!(path, "/api/v1/namespaces/ns1/configmaps/c1");
        reply(
            send,
            200,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "c1"}, "data": {"a": "1"}, "binaryData": {"b": "Ag=="}}),
        );
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 404, Some("NotFound"), "configmaps \"gone\" not found");
        let (method, path, _, body, send) = next(&mut api).await;
        assert_eq!(
            (method.as_str(), path.as_str()),
            (
                "POST",
                "/api/v1/namespaces/ns1/serviceaccounts/default/token"
            )
        );
        assert_eq!(
            (
                &body["spec"]["expirationSeconds"],
                &body["spec"]["audiences"]
            ),
            (&json!(600), &json!(["https://api.example"]))
        );
        reply(
            send,
            201,
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"audiences": []}, "status": {"token": "t0k3n", "expirationTimestamp": "2027-11-29T00:00:00Z"}}),
        );
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 403, Some("Forbidden"), "forbidden");
    });
    let store = KubeStatus {
        client,
        ca_pem: Some(b"PEM".to_vec()),
        token: super::status::TokenSpec {
            seconds: 600,
            audiences: vec!["https://api.example".into()],
        },
    };
    let secret = store
        .object("ns1", &ObjectRef::Secret("s1".into()))
        .await
        .unwrap();
    assert_eq!(secret.unwrap()["userdata"], b"hi");
    let cm = store
        .object("ns1", &ObjectRef::ConfigMap("c1".into()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (cm["a"].as_slice(), cm["b"].as_slice()),
        (&b"1"[..], &[2u8][..])
    );
    let gone = store
        .object("ns1", &ObjectRef::ConfigMap("gone".into()))
        .await
        .unwrap();
    assert!(gone.is_none());
    let sa = store
        .object("ns1", &ObjectRef::ServiceAccountToken("default".into()))
        .await
        .unwrap()
        .unwrap();
    let files: Vec<(&str, &[u8])> = sa.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    assert_eq!(
        files,
        [
            ("ca.crt", &b"PEM"[..]),
            ("namespace", b"ns1"),
            ("token", b"t0k3n")
        ]
    );
    let err = store
        .object("ns1", &ObjectRef::Secret("locked".into()))
        .await
        .unwrap_err();
    // Forbidden: the namespace is not opted in, and the error says how.
    let err = err.to_string();
    assert!(
        err.contains("namespace ns1 is not opted in")
            && err.contains("(secret \"locked\")")
            && err.contains("kvirtd --print-rbac --namespace ns1"),
        "{err}"
    );
    server.await.unwrap();
}

#[tokio::test]
async fn a_virtual_machine_exists_only_with_its_uid_and_until_deleted() {
    let (client, mut api) = client();
    let vm = |meta: Value| json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": meta});
    let server = tokio::spawn(async move {
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!(
            (method.as_str(), path.as_str()),
            (
                "GET",
                "/apis/kubevirt.io/v1/namespaces/ns1/virtualmachines/vm1"
            )
        );
        reply(send, 200, vm(json!({"name": "vm1", "uid": "u1"})));
        let (_, _, _, _, send) = next(&mut api).await;
        reply(send, 200, vm(json!({"name": "vm1", "uid": "u2"})));
        let (_, _, _, _, send) = next(&mut api).await;
        reply(
            send,
            200,
            vm(json!({"name": "vm1", "uid": "u1", "deletionTimestamp": "2026-11-29T00:00:00Z"})),
        );
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 404, Some("NotFound"), "not found");
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 403, Some("Forbidden"), "forbidden");
    });
    let store = store(client);
    let exists = || store.virtual_machine_exists("ns1", "vm1", "u1");
    assert!(exists().await.unwrap(), "same uid");
    assert!(!exists().await.unwrap(), "made anew under the same name");
    assert!(!exists().await.unwrap(), "being deleted");
    assert!(!exists().await.unwrap(), "gone");
    let err = exists().await.unwrap_err();
    assert!(
        err.to_string().contains("reading VirtualMachine ns1/vm1"),
        "{err}"
    );
    server.await.unwrap();
}

fn vm_object() -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {
            "name": "web", "namespace": "default", "uid": "vm-u", "generation": 1,
            "resourceVersion": "7", "finalizers": [super::vms::VM_FINALIZER],
        },
        "spec": {
            "runStrategy": "Always",
            "template": {"spec": {"domain": {"devices": {}}}},
        },
    })
}

/// A VM loop that knows `vm` (and no VMI).
fn vms_with(client: kube::Client, vm: Value) -> super::vms::Vms {
    use crate::core::vm::VirtualMachine;
    use kube::runtime::{reflector, watcher};
    let (vm_r, mut vm_w) = reflector::store::<VirtualMachine>();
    let vm: VirtualMachine = serde_json::from_value(vm).unwrap();
    vm_w.apply_watcher_event(&watcher::Event::Apply(vm));
    let (vmi_r, _vmi_w) = reflector::store::<VirtualMachineInstance>();
    super::vms::Vms {
        client,
        vms: vm_r,
        vmis: vmi_r,
        revisions: Default::default(),
    }
}

/// Two kvirtds see the same VM without a VMI. Each writes its decision to
/// the VM's status first, guarded by the resourceVersion it decided on:
/// the one refused (409) makes nothing; the other makes the one VMI.
#[tokio::test]
async fn of_two_kvirtds_deciding_on_a_vm_only_the_one_whose_status_lands_acts() {
    use crate::core::key::VmKey;
    let key = VmKey::new("default", "web").unwrap();
    let vms_of = |client: kube::Client| vms_with(client, vm_object());
    const STATUS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/web/status";
    const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances";

    // The loser: its status write is refused, and it asks nothing more.
    let (c, mut api) = client();
    let loser = vms_of(c);
    let k = key.clone();
    let task = tokio::spawn(async move { loser.reconcile(&k).await });
    let (method, path, ctype, body, send) = next(&mut api).await;
    assert_eq!((method.as_str(), path.as_str()), ("PATCH", STATUS));
    assert_eq!(ctype, "application/merge-patch+json");
    assert_eq!(body["metadata"]["resourceVersion"], "7");
    assert_eq!(body["status"]["created"], true);
    fail(send, 409, Some("Conflict"), "the object has been modified");
    let again = task.await.unwrap().unwrap();
    assert_eq!(again, Some(std::time::Duration::from_secs(1)));
    // (The client is gone with the task: no request is pending, or can be.)
    let more = tokio::time::timeout(std::time::Duration::from_millis(200), api.next_request());
    assert!(
        matches!(more.await, Err(_) | Ok(None)),
        "the loser made another request"
    );

    // The winner: its status lands, then it creates the VM's VMI.
    let (c, mut api) = client();
    let winner = vms_of(c);
    let task = tokio::spawn(async move { winner.reconcile(&key).await });
    let (_, path, _, _, send) = next(&mut api).await;
    assert_eq!(path, STATUS);
    reply(send, 200, vm_object());
    let (method, path, _, body, send) = next(&mut api).await;
    assert_eq!((method.as_str(), path.as_str()), ("POST", VMIS));
    assert_eq!(body["metadata"]["name"], "web");
    assert!(body["metadata"]["uid"].is_null(), "{body}");
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "vm-u");
    assert_eq!(body["metadata"]["ownerReferences"][0]["controller"], true);
    let mut made = body.clone();
    made["metadata"]["uid"] = "vmi-1".into();
    reply(send, 201, made);
    task.await.unwrap().unwrap();
}

/// A namespace's allowance: its ResourceQuotas listed, and its VMIs only
/// when one bounds ephemeral storage; each VMI claims its emptyDisks, held
/// ones admitted, finished ones not yet taken on claiming nothing.
#[tokio::test]
async fn a_namespaces_allowance_is_its_quotas_and_its_vmis_claims() {
    let (client, mut api) = client();
    let list = |kind: &str, items: Value| json!({"apiVersion": "v1", "kind": kind, "metadata": {}, "items": items});
    let server = tokio::spawn(async move {
        let quotas = "/api/v1/namespaces/ns1/resourcequotas";
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("GET", quotas));
        let cpu_only =
            json!([{"metadata": {"name": "cpu"}, "spec": {"hard": {"requests.cpu": "4"}}}]);
        reply(send, 200, list("ResourceQuotaList", cpu_only));

        let (_, path, _, _, send) = next(&mut api).await;
        assert_eq!(path, quotas);
        let disks = json!([{"metadata": {"name": "disks"},
            "spec": {"hard": {"limits.ephemeral-storage": "10Gi", "pods": "3"}}}]);
        reply(send, 200, list("ResourceQuotaList", disks));
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!(
            (method.as_str(), path.as_str()),
            (
                "GET",
                "/apis/kubevirt.io/v1/namespaces/ns1/virtualmachineinstances"
            )
        );
        let vmi = |name: &str, finalizers: Value, phase: &str| {
            json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": name, "namespace": "ns1", "uid": name,
                    "creationTimestamp": "2026-12-04T10:00:00Z", "finalizers": finalizers},
                "spec": {"domain": {"devices": {}},
                    "volumes": [{"name": "s", "emptyDisk": {"capacity": "1Gi"}}]},
                "status": {"phase": phase}})
        };
        let items = json!([
            vmi("held", json!([FINALIZER]), "Running"),
            vmi("waiting", json!([]), "Pending"),
            vmi("failed", json!([]), "Failed"),
        ]);
        reply(send, 200, list("VirtualMachineInstanceList", items));
        let (_, _, _, _, send) = next(&mut api).await;
        fail(send, 403, Some("Forbidden"), "forbidden");
    });
    let store = store(client);
    let (bounds, claims) = store.allowance("ns1").await.unwrap();
    assert!(bounds.is_empty() && claims.is_empty(), "no VMI list");
    let (bounds, claims) = store.allowance("ns1").await.unwrap();
    assert_eq!(bounds.len(), 1);
    assert_eq!(bounds[0].bytes, 10 << 30);
    let seen: Vec<(&str, bool, u64)> = claims
        .iter()
        .map(|c| (c.name.as_str(), c.admitted, c.bytes))
        .collect();
    assert_eq!(seen, [("held", true, 1 << 30), ("waiting", false, 1 << 30)]);
    let err = store.allowance("ns1").await.unwrap_err();
    assert!(
        err.to_string()
            .contains("ResourceQuotas and VMIs of namespace ns1"),
        "{err}"
    );
    server.await.unwrap();
}

/// A VM naming an instancetype: the object is read once and kept in a
/// ControllerRevision owned by the VM, named in the status written before
/// the VMI is made from it; a VM whose status names a revision reads only
/// the revision, never the (perhaps edited) object.
#[tokio::test]
async fn an_instancetype_is_kept_as_a_revision_and_later_read_from_it() {
    use crate::core::key::VmKey;
    let key = VmKey::new("default", "web").unwrap();

    const OBJECT: &str =
        "/apis/instancetype.kubevirt.io/v1beta1/virtualmachineclusterinstancetypes/small";
    const REVISIONS: &str = "/apis/apps/v1/namespaces/default/controllerrevisions";
    const STATUS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachines/web/status";
    const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances";
    let small = json!({
        "apiVersion": "instancetype.kubevirt.io/v1beta1",
        "kind": "VirtualMachineClusterInstancetype",
        "metadata": {"name": "small", "uid": "it-u", "generation": 2, "resourceVersion": "3"},
        "spec": {"cpu": {"guest": 2}, "memory": {"guest": "256Mi"}},
    });
    let mut vm = vm_object();
    vm["spec"]["instancetype"] = json!({"name": "small"});

    let (c, mut api) = client();
    let first = vms_with(c, vm.clone());
    let k = key.clone();
    let task = tokio::spawn(async move { first.reconcile(&k).await });
    let (method, path, _, _, send) = next(&mut api).await;
    assert_eq!((method.as_str(), path.as_str()), ("GET", OBJECT));
    reply(send, 200, small.clone());
    let (method, path, _, body, send) = next(&mut api).await;
    assert_eq!((method.as_str(), path.as_str()), ("POST", REVISIONS));
    let rev = "web-small-v1beta1-it-u-2";
    assert_eq!(body["metadata"]["name"], rev);
    assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "vm-u");
    assert_eq!(
        body["metadata"]["labels"]["instancetype.kubevirt.io/object-name"],
        "small"
    );
    assert_eq!(body["data"]["spec"]["cpu"]["guest"], 2);
    reply(send, 201, body.clone());
    let (_, path, _, body, send) = next(&mut api).await;
    assert_eq!(path, STATUS);
    assert_eq!(
        body["status"]["instancetypeRef"]["controllerRevisionRef"]["name"],
        rev
    );
    let mut with_ref = vm.clone();
    with_ref["status"] = body["status"].clone();
    reply(send, 200, with_ref.clone());
    let (method, path, _, body, send) = next(&mut api).await;
    assert_eq!((method.as_str(), path.as_str()), ("POST", VMIS));
    assert_eq!(body["spec"]["domain"]["cpu"]["sockets"], 2);
    assert_eq!(body["spec"]["domain"]["memory"]["guest"], "256Mi");
    let mut made = body.clone();
    made["metadata"]["uid"] = "vmi-1".into();
    reply(send, 201, made);
    task.await.unwrap().unwrap();

    // Later: the status names the revision; only it is read.
    let (c, mut api) = client();
    let later = std::sync::Arc::new(vms_with(c, with_ref));
    let (l, k) = (later.clone(), key.clone());
    let task = tokio::spawn(async move { l.reconcile(&k).await });
    let (method, path, _, _, send) = next(&mut api).await;
    assert_eq!(
        (method.as_str(), path.as_str()),
        ("GET", format!("{REVISIONS}/{rev}").as_str())
    );
    reply(
        send,
        200,
        json!({"apiVersion": "apps/v1", "kind": "ControllerRevision",
               "metadata": {"name": rev, "namespace": "default"}, "revision": 0,
               "data": crate::core::instancetype::Revision::of("web", &small).object}),
    );
    let (method, path, _, _, send) = next(&mut api).await;
    assert_ne!(path, OBJECT, "the object was read again");
    assert_eq!(method, "PATCH");
    reply(send, 200, vm_object());
    let (method, _, _, body, send) = next(&mut api).await;
    assert_eq!(method, "POST");
    assert_eq!(body["spec"]["domain"]["cpu"]["sockets"], 2);
    reply(send, 201, body.clone());
    task.await.unwrap().unwrap();

    // And once read, a revision is not read again.
    let task = tokio::spawn(async move { later.reconcile(&key).await });
    let (_, path, _, _, _send) = next(&mut api).await;
    assert!(!path.contains("controllerrevisions"), "read again: {path}");
    task.abort();
}

/// The leader's scheduler over stores of Leases and unassigned VMIs: one
/// guarded merge patch puts the VMI on the least-loaded host that takes
/// new VMIs; a VMI no host fits gets one FailedScheduling Event, not a
/// request, however often it is looked at.
#[tokio::test]
async fn the_scheduler_assigns_a_vmi_to_the_least_loaded_host_once() {
    use super::lease::{lease_patch, micro_time};
    use super::scheduler::Placing;
    use crate::core::peers::Announcement;
    use crate::sources::{EventReason, Recorder};
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::runtime::{reflector, watcher};
    use std::sync::Mutex;

    #[derive(Default)]
    struct Said(Mutex<Vec<(String, String)>>);
    impl Recorder for Said {
        fn record(&self, vmi: &VirtualMachineInstance, r: EventReason, msg: &str, _: bool) {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            assert_eq!(r, EventReason::FailedScheduling);
            self.0.lock().unwrap().push((name, msg.to_owned()));
        }
    }
    let now = micro_time(jiff::Timestamp::now());
    let (leases, mut lw) = reflector::store::<Lease>();
    for (node, vmis, claims) in [
        ("node-a", 3, true),
        ("node-b", 1, true),
        ("node-c", 0, false),
    ] {
        let a = Announcement::default().taking(claims, vmis);
        let l = lease_patch(node, std::time::Duration::from_secs(40), &now, &a);
        lw.apply_watcher_event(&watcher::Event::Apply(serde_json::from_value(l).unwrap()));
    }
    let (vmis, mut vw) = reflector::store::<VirtualMachineInstance>();
    vw.apply_watcher_event(&watcher::Event::Apply(vmi()));
    let said = Said::default();
    let mut placing = Placing::default();

    let (c, mut api) = client();
    let round = placing.round(&c, &leases, &vmis, &said);
    let answer = async {
        let (method, path, ctype, body, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("PATCH", PATH));
        assert_eq!(ctype, "application/merge-patch+json");
        assert_eq!(body["metadata"]["resourceVersion"], "42");
        assert_eq!(body["metadata"]["labels"]["kubevirt.io/nodeName"], "node-b");
        assert_eq!(body["status"]["nodeName"], "node-b");
        reply(send, 200, object(&[]));
    };
    tokio::join!(round, answer);
    // Looked at again before the watch drops it: not assigned twice.
    placing.round(&c, &leases, &vmis, &said).await;
    let more = tokio::time::timeout(std::time::Duration::from_millis(100), api.next_request());
    assert!(matches!(more.await, Err(_) | Ok(None)), "assigned twice");

    // A VMI no host fits: an Event saying why, once; no request.
    let mut nowhere = object(&[]);
    nowhere["metadata"]["uid"] = "u2".into();
    nowhere["metadata"]["name"] = "vm2".into();
    nowhere["spec"]["nodeSelector"] = json!({"zone": "z9"});
    vw.apply_watcher_event(&watcher::Event::Delete(vmi()));
    vw.apply_watcher_event(&watcher::Event::Apply(
        serde_json::from_value(nowhere).unwrap(),
    ));
    placing.round(&c, &leases, &vmis, &said).await;
    placing.round(&c, &leases, &vmis, &said).await;
    let events = said.0.lock().unwrap().clone();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "vm2");
    assert!(
        events[0].1.contains("node-a: nodeSelector zone=z9"),
        "{events:?}"
    );
    assert!(
        events[0].1.contains("node-c: takes no new VMIs"),
        "{events:?}"
    );
    let more = tokio::time::timeout(std::time::Duration::from_millis(100), api.next_request());
    assert!(matches!(more.await, Err(_) | Ok(None)), "a request for vm2");
}

#[tokio::test]
async fn the_leader_labels_a_new_migration_object_for_its_vmis_host_once() {
    use super::migrations::KubeMigrations;
    use super::routing::Routing;
    use crate::core::migration::Migration;
    use kube::runtime::{reflector, watcher};

    const VMIMS: &str = "/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstancemigrations";
    let vmim = |name: &str, uid: &str, vmi: &str| -> Migration {
        serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstanceMigration",
            "metadata": {"name": name, "namespace": "default", "uid": uid, "resourceVersion": "7"},
            "spec": {"vmiName": vmi},
        }))
        .unwrap()
    };
    let (store, mut w) = reflector::store::<Migration>();
    w.apply_watcher_event(&watcher::Event::Apply(vmim("m1", "mu1", "vm1")));
    let (c, mut api) = client();
    let objects = KubeMigrations { client: c };
    let mut routing = Routing::default();

    let round = routing.round(&objects, &store);
    let answer = async {
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("GET", PATH));
        let mut vmi = object(&[]);
        vmi["metadata"]["labels"] = json!({"kubevirt.io/nodeName": "node-b"});
        reply(send, 200, vmi);
        let (method, path, ctype, body, send) = next(&mut api).await;
        assert_eq!(
            (method.as_str(), path.as_str()),
            ("PATCH", &*format!("{VMIMS}/m1"))
        );
        assert_eq!(ctype, "application/merge-patch+json");
        assert_eq!(body["metadata"]["labels"]["kvirt.io/host"], "node-b");
        assert_eq!(body["metadata"]["resourceVersion"], "7");
        assert_eq!(body["metadata"]["uid"], "mu1");
        assert!(body.get("status").is_none(), "{body}");
        reply(
            send,
            200,
            serde_json::to_value(vmim("m1", "mu1", "vm1")).unwrap(),
        );
    };
    tokio::join!(round, answer);
    // Looked at again before the watch drops it: not labelled twice.
    routing.round(&objects, &store).await;
    let more = tokio::time::timeout(std::time::Duration::from_millis(100), api.next_request());
    assert!(matches!(more.await, Err(_) | Ok(None)), "labelled twice");

    // A VMI that does not exist (yet): its object is not failed at once.
    w.apply_watcher_event(&watcher::Event::Delete(vmim("m1", "mu1", "vm1")));
    w.apply_watcher_event(&watcher::Event::Apply(vmim("m2", "mu2", "vm1")));
    let round = routing.round(&objects, &store);
    let answer = async {
        let (method, path, _, _, send) = next(&mut api).await;
        assert_eq!((method.as_str(), path.as_str()), ("GET", PATH));
        fail(send, 404, Some("NotFound"), "not found");
    };
    tokio::join!(round, answer);
    let more = tokio::time::timeout(std::time::Duration::from_millis(100), api.next_request());
    assert!(matches!(more.await, Err(_) | Ok(None)), "failed at once");
}
