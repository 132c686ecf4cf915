//! The loop on the recording fakes: the API conversation with the host,
//! without root.

use kvirt::core::convert::{DiskPrep, DomainType, HostDiskRoots};
use kvirt::core::cpuset::CpuSet;
use kvirt::core::key::VmKey;
use kvirt::core::layout::{DaemonKind, HostLayout};
use kvirt::core::migration::Mark;
use kvirt::core::objects::ObjectRef;
use kvirt::core::plan::{DomainState, GuestAgent, Migrating, UnitActivity};
use kvirt::core::trigger::Trigger;
use kvirt::core::unit::Prop;
use kvirt::core::vmi::{Phase, VirtualMachineInstance};
use kvirt::daemon::controller::{Controller, Settings, VmiView};
use kvirt::daemon::fake::FakeHost;
use kvirt::host::cpus::DedicatedCpus;
use kvirt::host::storage::Owner;
use kvirt::sources::EventReason;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

type Ctl = Controller<FakeHost>;

fn settings() -> Settings {
    Settings {
        node_name: "node-1".into(),
        layout: HostLayout::default(),
        host_disk_roots: HostDiskRoots::Host(vec!["/var/lib/kvirt/images".into()]),
        shared_roots: vec!["/srv/shared".into()],
        cluster: true,
        daemon: DaemonKind::Virtqemud,
        daemon_path: "/usr/sbin/virtqemud".into(),
        domain_type: DomainType::Qemu,
        user: "kvirt".into(),
        probe_owner: Some(Owner { uid: 999, gid: 999 }),
        slice: "machine-kvirt.slice".into(),
        overhead_bytes: 256 << 20,
        tasks_max: 1024,
        shutdown_resend: Duration::from_secs(5),
        capacity: None,
        limits: kvirt::core::convert::Limits::default(),
        placement: None,
        token_renewal: Some(Duration::from_secs(2880)),
        claims: Default::default(),
        claim_roots: vec!["/var/lib/kvirt/claims".into()],
        cni_global_namespaces: vec!["default".into()],
        starts_at_once: 4,
    }
}

fn controller(host: &FakeHost) -> Arc<Ctl> {
    Controller::new(host.deps(), settings())
}

fn vmi(name: &str, uid: &str, extra_spec: &str) -> VirtualMachineInstance {
    VirtualMachineInstance::from_yaml(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: {name}\n  namespace: default\n  uid: {uid}\nspec:\n  terminationGracePeriodSeconds: 2\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{}}\n{extra_spec}"
    ))
    .unwrap()
}

fn set(vmis: &[VirtualMachineInstance]) -> BTreeMap<VmKey, VirtualMachineInstance> {
    vmis.iter().map(|v| (v.key().unwrap(), v.clone())).collect()
}

fn phase(host: &FakeHost, name: &str) -> Option<Phase> {
    host.state()
        .statuses
        .get(&VmKey::new("default", name).unwrap())
        .and_then(|v| v.status.phase)
}

/// Why the VMI was refused: it is Failed with `Synchronized=False`.
fn refused(host: &FakeHost, namespace: &str, name: &str) -> String {
    let key = VmKey::new(namespace, name).unwrap();
    let st = host.state().statuses[&key].clone();
    assert_eq!(st.status.phase, Some(Phase::Failed));
    let sync = st
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Synchronized")
        .unwrap()
        .clone();
    assert_eq!(sync.status, "False");
    sync.message.unwrap_or_default()
}

fn reasons(host: &FakeHost) -> Vec<EventReason> {
    host.state().events.iter().map(|e| e.1).collect()
}

#[tokio::test]
async fn a_new_vmi_becomes_a_running_vm_in_order() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let changed = ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    assert_eq!(changed, vec!["default_vm1".to_string()]);
    ctl.reconcile("default_vm1").await.unwrap();
    let calls: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| !c.starts_with("save"))
        .collect();
    assert_eq!(
        calls,
        vec![
            // The namespace's quota, before the VMI is taken on.
            "allowance default",
            "hold default/vm1",
            "identity default_vm1",
            "mkdir /var/lib/kvirt/vms/default_vm1",
            "netns add kvirt-default_vm1",
            "net setup default_vm1",
            "start kvirt-vm@default_vm1.service",
            "define default_vm1",
            "start-domain default_vm1",
            "register-machine default.vm1",
        ]
    );
    let st = host.state().statuses[&VmKey::new("default", "vm1").unwrap()].clone();
    assert_eq!(st.status.phase, Some(Phase::Running));
    assert_eq!(st.status.node_name.as_deref(), Some("node-1"));
    assert_eq!(st.status.extra["qosClass"], "BestEffort");
    let phases: Vec<Phase> = st
        .status
        .phase_transition_timestamps
        .iter()
        .map(|p| p.phase)
        .collect();
    assert_eq!(phases, vec![Phase::Scheduled, Phase::Running]);
    assert_eq!(
        reasons(&host),
        vec![EventReason::Created, EventReason::Started]
    );
    assert_eq!(
        host.state().domains["default_vm1"].uid.as_deref(),
        Some("u1")
    );

    // The pod interface, with the leased address, as KubeVirt reports it.
    let iface = &st.status.interfaces[0];
    assert_eq!(iface["name"], "default");
    assert_eq!(iface["ipAddress"], "10.213.0.2");
    assert_eq!(iface["ipAddresses"], serde_json::json!(["10.213.0.2"]));
    assert_eq!(iface["infoSource"], "domain");

    // Level-triggered: a second pass with nothing changed does nothing, and
    // writes nothing.
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.take_calls().is_empty());
}

/// A dual-stack host: the pod interface lists both addresses, IPv4 first,
/// as KubeVirt reports a dual-stack pod's.
#[tokio::test]
async fn a_dual_stack_vm_reports_both_pod_addresses() {
    let host = FakeHost::default();
    host.state().dual_stack = true;
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let st = host.state().statuses[&VmKey::new("default", "vm1").unwrap()].clone();
    let iface = &st.status.interfaces[0];
    assert_eq!(iface["ipAddress"], "10.213.0.2");
    assert_eq!(
        iface["ipAddresses"],
        serde_json::json!(["10.213.0.2", "fd00:6b76::2"])
    );
}

/// Every VMI says whether it could migrate, as KubeVirt's do: a disk kvirt
/// made (containerDisk overlay) is copied, a hostDisk under a shared root
/// stays, one elsewhere keeps the VM on its host.
#[tokio::test]
async fn every_running_vmi_says_whether_it_could_live_migrate() {
    let host = FakeHost::default();
    let roots = vec!["/var/lib/kvirt/images".into(), "/srv/shared".into()];
    let ctl: Arc<Ctl> = Controller::new(
        host.deps(),
        Settings {
            host_disk_roots: HostDiskRoots::Host(roots),
            ..settings()
        },
    );
    let disk =
        |path: &str| format!("  volumes: [{{name: d, hostDisk: {{path: {path}, type: Disk}}}}]\n");
    ctl.set_vmis(set(&[
        vmi("plain", "u1", ""),
        vmi("shared", "u2", &disk("/srv/shared/vm.img")),
        vmi("local", "u3", &disk("/var/lib/kvirt/images/vm.img")),
    ]))
    .await;
    for name in ["plain", "shared", "local"] {
        ctl.reconcile(&format!("default_{name}")).await.unwrap();
        assert_eq!(phase(&host, name), Some(Phase::Running), "{name}");
    }
    let yes = Some(("True".to_string(), None));
    assert_eq!(condition(&host, "plain", "LiveMigratable"), yes);
    assert_eq!(condition(&host, "shared", "LiveMigratable"), yes);
    assert_eq!(
        condition(&host, "local", "LiveMigratable"),
        Some((
            "False".to_string(),
            Some("DisksNotLiveMigratable".to_string())
        ))
    );
}

fn mark(role: Migrating, vmi: Option<VirtualMachineInstance>) -> Mark {
    Mark {
        migration_uid: "m1".into(),
        role,
        vmi_uid: "u1".into(),
        peer: "10.251.0.2:8444".into(),
        vmi: vmi.map(Box::new),
        committed: false,
    }
}

/// A VM migrating away (its mark kept): the domain leaving is the end of
/// the migration, not of the VM, and nothing starts it here again, not
/// even a kvirtd restarted meanwhile (the source daemon completes a
/// migration whose client died).
#[tokio::test]
async fn a_vm_migrating_away_is_never_started_here_again_even_by_a_new_kvirtd() {
    let host = FakeHost::default();
    let v = vmi("vm1", "u1", "");
    let ctl = controller(&host);
    ctl.set_vmis(set(std::slice::from_ref(&v))).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    host.state()
        .marks
        .insert("default_vm1".into(), mark(Migrating::Outgoing, None));
    host.state().domains.remove("default_vm1");
    host.take_calls();
    let restarted = controller(&host);
    restarted.set_vmis(set(std::slice::from_ref(&v))).await;
    restarted.reconcile("default_vm1").await.unwrap();
    let calls = host.take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("define") || c.starts_with("start")),
        "{calls:?}"
    );
    assert!(
        calls
            .iter()
            .any(|c| c == "stop kvirt-vm@default_vm1.service"),
        "the rest of it goes: {calls:?}"
    );
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running), "not failed");
    // A mark of an older instance of the name holds nothing of a new one.
    let newer = vmi("vm1", "u2", "");
    restarted.set_vmis(set(&[newer])).await;
    restarted.reconcile("default_vm1").await.unwrap();
    restarted.reconcile("default_vm1").await.unwrap();
    assert!(host
        .take_calls()
        .iter()
        .any(|c| c == "start-domain default_vm1"));
}

/// A VM that left by migration: its mark holds while its VMI is listed
/// here (its manifest not yet removed), and goes once the VMI is gone and
/// nothing of it is left, so the name is free for a new instance.
#[tokio::test]
async fn a_vm_that_left_drops_its_mark_once_its_vmi_is_gone_too() {
    let host = FakeHost::default();
    let v = vmi("vm1", "u1", "");
    let ctl = controller(&host);
    ctl.set_vmis(set(std::slice::from_ref(&v))).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.state()
        .marks
        .insert("default_vm1".into(), mark(Migrating::Outgoing, None));
    host.state().domains.remove("default_vm1");
    host.take_calls();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.state().marks.contains_key("default_vm1"));
    ctl.set_vmis(BTreeMap::new()).await;
    ctl.reconcile("default_vm1").await.unwrap();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host.state().marks.contains_key("default_vm1"));
    assert!(!host
        .take_calls()
        .iter()
        .any(|c| c.starts_with("start-domain")));
}

/// A self-fence: the VM on a shared disk is killed and recorded (the
/// local one is not); the loop fails its VMI with why, never starts it
/// again, even by a new kvirtd, and drops the record once the VMI is gone.
#[tokio::test]
async fn a_fenced_vm_fails_with_why_and_is_never_started_here_again() {
    let host = FakeHost::default();
    let roots = vec!["/var/lib/kvirt/images".into(), "/srv/shared".into()];
    let settings = || Settings {
        host_disk_roots: HostDiskRoots::Host(roots.clone()),
        ..settings()
    };
    let ctl: Arc<Ctl> = Controller::new(host.deps(), settings());
    let disk =
        |path: &str| format!("  volumes: [{{name: d, hostDisk: {{path: {path}, type: Disk}}}}]\n");
    let vmis = set(&[
        vmi("shared", "u1", &disk("/srv/shared/vm.img")),
        vmi("local", "u2", &disk("/var/lib/kvirt/images/vm.img")),
    ]);
    ctl.set_vmis(vmis.clone()).await;
    for id in ["default_shared", "default_local"] {
        ctl.reconcile(id).await.unwrap();
    }
    let units = host.state().units.clone();
    assert!(units["kvirt-vm@default_shared.service"].shared_disks);
    assert!(!units["kvirt-vm@default_local.service"].shared_disks);

    let policy =
        kvirt::core::fence::SelfFence::new(Duration::from_secs(60), Duration::from_secs(15))
            .unwrap();
    let mut killed = Default::default();
    let n =
        kvirt::daemon::fence::fence(&host, &host, &policy, Duration::from_secs(46), &mut killed)
            .await;
    assert_eq!(n, 1);
    host.take_calls();
    ctl.reconcile("default_shared").await.unwrap();
    assert_eq!(phase(&host, "shared"), Some(Phase::Failed));
    let key = VmKey::new("default", "shared").unwrap();
    let ready = ready_message(&host, "shared");
    assert!(
        ready.starts_with("fenced: this host could not renew its Lease for 46 s"),
        "{ready}"
    );
    let events = host.state().events.clone();
    assert!(
        events
            .iter()
            .any(|(k, _, m)| k == &key && m.starts_with("fenced:")),
        "{events:?}"
    );
    ctl.reconcile("default_local").await.unwrap();
    assert_eq!(phase(&host, "local"), Some(Phase::Running));
    assert_eq!(ctl.fenced_count(), 1);

    // A new kvirtd, the failure not written (the API server away): the
    // VMI as it was, not final. Nothing of it starts; it fails again.
    host.state().statuses.remove(&key);
    let again: Arc<Ctl> = Controller::new(host.deps(), settings());
    again.set_vmis(vmis).await;
    again.reconcile("default_shared").await.unwrap();
    again.reconcile("default_shared").await.unwrap();
    let calls = host.take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.contains("start") && c.contains("shared")),
        "{calls:?}"
    );
    assert_eq!(phase(&host, "shared"), Some(Phase::Failed));
    // Its VMI gone (failed, deleted by its VirtualMachine): the record too.
    again
        .set_vmis(set(&[vmi(
            "local",
            "u2",
            &disk("/var/lib/kvirt/images/vm.img"),
        )]))
        .await;
    again.reconcile("default_shared").await.unwrap();
    assert_eq!(again.fenced_count(), 0);
}

/// One migration of a VM at a time: of two claims at once, one wins and
/// the other is told why; once the mark goes, the VM may migrate again.
#[tokio::test]
async fn a_vm_takes_part_in_one_migration_at_a_time() {
    let host = FakeHost::default();
    let ctl = std::sync::Arc::new(controller(&host));
    let claims: Vec<_> = [Migrating::Outgoing, Migrating::Incoming]
        .into_iter()
        .map(|role| {
            let ctl = ctl.clone();
            std::thread::spawn(move || ctl.claim_mark("default_vm1", &mark(role, None)))
        })
        .collect();
    let results: Vec<_> = claims.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    let refused = results.iter().find_map(|r| r.clone().err()).unwrap();
    assert!(refused.contains("another migration"), "{refused}");
    assert!(ctl
        .claim_mark("default_vm1", &mark(Migrating::Outgoing, None))
        .is_err());
    ctl.clear_mark("default_vm1").unwrap();
    ctl.claim_mark("default_vm1", &mark(Migrating::Outgoing, None))
        .unwrap();
}

/// A VM arriving: its mark holds the VMI (no source lists it yet), and
/// everything is made but its domain, which the migration brings; the
/// status stays the source's to write.
#[tokio::test]
async fn a_vm_to_receive_is_prepared_without_its_domain_though_no_source_lists_it() {
    let host = FakeHost::default();
    host.state().marks.insert(
        "default_vm1".into(),
        mark(Migrating::Incoming, Some(vmi("vm1", "u1", ""))),
    );
    let ctl = controller(&host);
    ctl.set_vmis(BTreeMap::new()).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let calls = host.take_calls();
    assert!(
        calls
            .iter()
            .any(|c| c == "start kvirt-vm@default_vm1.service"),
        "{calls:?}"
    );
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("define") || c.starts_with("start-domain")),
        "{calls:?}"
    );
    assert_eq!(phase(&host, "vm1"), None, "the source reports it");
    // The migration brings the domain: still nothing to do here.
    host.state().domains.insert(
        "default_vm1".into(),
        kvirt::core::plan::DomainObs {
            state: DomainState::Paused,
            uid: Some("u1".into()),
            paused: None,
            machine: None,
            agent: false,
        },
    );
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.take_calls().iter().all(|c| !c.contains("domain")));
}

#[tokio::test]
async fn a_restarted_daemon_adopts_without_touching_the_vm() {
    let host = FakeHost::default();
    let first = controller(&host);
    first.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    first.reconcile("default_vm1").await.unwrap();
    let before = host.state().statuses.clone();
    let events = host.state().events.len();
    host.take_calls();
    drop(first);

    let second = controller(&host);
    second.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    let errors = second.reconcile_all().await;
    assert!(errors.is_empty(), "{errors:?}");
    assert!(host.take_calls().is_empty(), "adoption must not act");
    assert_eq!(host.state().statuses, before, "no status flapping");
    assert_eq!(host.state().events.len(), events, "no duplicate events");
}

#[tokio::test]
async fn a_vms_daemon_restarted_by_systemd_is_an_event_and_nothing_else() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let before = host.state().statuses.clone();
    host.take_calls();
    let unit = "kvirt-vm@default_vm1.service";
    // Between passes systemd restarted the daemon (its QEMU ran on), then
    // the daemon is up again with the domain it reconnected to.
    host.state().units.get_mut(unit).unwrap().activity = UnitActivity::Activating;
    ctl.reconcile("default_vm1").await.unwrap();
    {
        let mut s = host.state();
        let u = s.units.get_mut(unit).unwrap();
        u.activity = UnitActivity::Active;
        u.restarts = 1;
    }
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.take_calls().is_empty(), "the VM was touched");
    assert_eq!(host.state().statuses, before, "status flapped");
    assert_eq!(reasons(&host).last(), Some(&EventReason::DaemonRestarted));
    // Once: the next pass has nothing new to say.
    let n = host.state().events.len();
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(host.state().events.len(), n);
}

#[tokio::test]
async fn a_daemon_that_does_not_answer_is_reported_and_its_vm_left_alone() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", ""), vmi("vm2", "u2", "")]))
        .await;
    assert!(ctl.reconcile_all().await.is_empty());
    host.take_calls();
    host.state().unresponsive.insert("default_vm1".into());
    assert!(ctl.reconcile_all().await.is_empty());
    let calls = host.take_calls();
    assert!(
        calls.iter().all(|c| c.starts_with("save")),
        "the VMs were touched: {calls:?}"
    );
    let ready = |name: &str| {
        let st = host.state().statuses[&VmKey::new("default", name).unwrap()].clone();
        assert_eq!(st.status.phase, Some(Phase::Running));
        let c = st
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .unwrap()
            .clone();
        (c.status, c.reason)
    };
    assert_eq!(
        ready("vm1"),
        ("False".into(), Some("DaemonUnresponsive".into()))
    );
    assert_eq!(ready("vm2").0, "True");
    // The condition says why: here, a call that timed out.
    let message = ready_message(&host, "vm1");
    assert!(
        message.contains("does not answer: VM default_vm1: its libvirt daemon did not answer"),
        "{message}"
    );
    assert_eq!(
        reasons(&host).last(),
        Some(&EventReason::DaemonUnresponsive)
    );
    // Once per episode; and Ready again once it answers.
    let n = host.state().events.len();
    assert!(ctl.reconcile_all().await.is_empty());
    assert_eq!(host.state().events.len(), n);
    host.state().unresponsive.clear();
    assert!(ctl.reconcile_all().await.is_empty());
    assert_eq!(ready("vm1").0, "True");
    assert!(host.take_calls().iter().all(|c| c.starts_with("save")));

    // Deleted while it does not answer: its unit's stop takes it all.
    host.state().unresponsive.insert("default_vm1".into());
    ctl.set_vmis(set(&[vmi("vm2", "u2", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host
        .state()
        .units
        .contains_key("kvirt-vm@default_vm1.service"));
}

/// A removal cut short (its unit's stop failed after the VM's runtime
/// directory, with the daemon's socket, was gone) is finished by the next
/// pass: nothing can be asked of the daemon, and its unit still stops.
#[tokio::test]
async fn a_vm_whose_daemon_cannot_be_reached_is_still_removed() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.state().unreachable.insert("default_vm1".into());
    ctl.set_vmis(BTreeMap::new()).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host
        .state()
        .units
        .contains_key("kvirt-vm@default_vm1.service"));
    assert!(host.state().netns.is_empty() && host.state().dirs.is_empty());
}

#[tokio::test]
async fn an_identity_is_kept_while_its_unit_may_still_run() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let uid = host.state().identities["default_vm1"];
    // The unit's stop fails: the rest of the teardown goes on, but the
    // VM's number stays its own (its processes may run as it).
    host.fail("stop kvirt-vm@default_vm1");
    ctl.set_vmis(BTreeMap::new()).await;
    let e = ctl.reconcile("default_vm1").await.unwrap_err().to_string();
    assert!(e.contains("identity kept"), "{e}");
    assert_eq!(host.state().identities.get("default_vm1"), Some(&uid));
    assert!(host.state().netns.is_empty(), "the rest was torn down");
    // Once the unit is gone, the identity goes too.
    host.heal("stop kvirt-vm@default_vm1");
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host.state().identities.contains_key("default_vm1"));
}

#[tokio::test]
async fn guest_poweroff_is_succeeded_and_the_unit_is_collected() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.take_calls();
    host.guest_poweroff("default_vm1");
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Succeeded));
    let calls: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| !c.starts_with("save"))
        .collect();
    assert_eq!(
        calls,
        vec![
            "unregister-machine default.vm1",
            "stop kvirt-vm@default_vm1.service",
            "net teardown default_vm1",
            "netns del kvirt-default_vm1",
            "rmdir /var/lib/kvirt/vms/default_vm1",
            // Its runtime directory becomes its console's tail, root's,
            // and its number is free at once.
            "keep /run/kvirt/vms/default_vm1",
            "revoke 100000",
            "identity release default_vm1",
        ]
    );
    assert!(host.state().units.is_empty());
    assert!(host
        .state()
        .kept
        .contains(std::path::Path::new("/run/kvirt/vms/default_vm1")));
    assert!(!host.state().identities.contains_key("default_vm1"));
    // Final is final: nothing restarts it.
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.take_calls().is_empty());
    assert_eq!(reasons(&host).last(), Some(&EventReason::Stopped));
}

#[tokio::test(start_paused = true)]
async fn a_removed_vmi_is_shut_down_gracefully_then_its_unit_stopped() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.take_calls();
    host.state().guests_ignore_acpi = true;

    let changed = ctl.set_vmis(BTreeMap::new()).await;
    assert_eq!(changed, vec!["default_vm1".to_string()]);
    let started = tokio::time::Instant::now();
    ctl.reconcile("default_vm1").await.unwrap();
    let took = started.elapsed();
    let calls = host.take_calls();
    assert_eq!(
        calls[..2],
        ["unregister-machine default.vm1", "shutdown default_vm1"]
    );
    // The unit's stop ends the guest that ignored the button: no libvirt
    // destroy first.
    assert!(!calls.iter().any(|c| c.starts_with("destroy")), "{calls:?}");
    assert_eq!(
        calls[calls.len() - 7..],
        [
            "stop kvirt-vm@default_vm1.service",
            "net teardown default_vm1",
            "netns del kvirt-default_vm1",
            "rmdir /var/lib/kvirt/vms/default_vm1",
            "rmdir /run/kvirt/vms/default_vm1",
            "revoke 100000",
            "identity release default_vm1",
        ]
    );
    // The grace period (2 s, from the unit) was honoured, not more.
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert!(host.state().netns.is_empty() && host.state().dirs.is_empty());
    assert!(host.state().addresses.is_empty(), "address not released");
}

#[tokio::test(start_paused = true)]
async fn the_grace_period_counts_from_when_the_deletion_was_seen() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.state().guests_ignore_acpi = true;
    ctl.set_vmis(BTreeMap::new()).await;
    let seen = tokio::time::Instant::now();
    // Its pass comes late (a hundred others went first).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let took = seen.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_millis(2500),
        "the 2 s grace ends 2 s after the deletion was seen, not after the pass began: {took:?}"
    );
    assert!(host.state().units.is_empty());
    // A VMI made again under the same name gets its whole grace period.
    ctl.set_vmis(set(&[vmi("vm1", "u2", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    ctl.set_vmis(BTreeMap::new()).await;
    let seen = tokio::time::Instant::now();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(
        seen.elapsed() >= Duration::from_secs(2),
        "{:?}",
        seen.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_cooperative_guest_does_not_wait_out_its_grace_period() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.take_calls();
    ctl.set_vmis(BTreeMap::new()).await;
    let started = tokio::time::Instant::now();
    ctl.reconcile("default_vm1").await.unwrap();
    let calls = host.take_calls();
    assert_eq!(calls[1], "shutdown default_vm1");
    assert!(calls.contains(&"stop kvirt-vm@default_vm1.service".to_string()));
    // Off after the first press (seen at the next look, a second later):
    // the grace period (2 s) is not waited out.
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_invalid_vmi_fails_alone_and_touches_nothing() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let bad = vmi(
        "bad",
        "u2",
        "  volumes:\n  - name: d\n    hostDisk: {path: /etc/shadow, type: Disk}\n",
    );
    let bad = {
        let mut b = bad;
        b.spec.domain.devices.disks =
            serde_json::from_str(r#"[{"name":"d","disk":{"bus":"virtio"}}]"#).unwrap();
        b
    };
    ctl.set_vmis(set(&[bad, vmi("good", "u3", "")])).await;
    assert!(ctl.reconcile_all().await.is_empty());

    let why = refused(&host, "default", "bad");
    assert!(why.contains("spec.volumes[0].hostDisk.path"), "{why}");
    assert!(host
        .state()
        .events
        .iter()
        .any(|e| e.0.name() == "bad" && e.1 == EventReason::SyncFailed));
    let touched: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| c.contains("bad") && !c.starts_with("save"))
        .collect();
    assert!(touched.is_empty(), "{touched:?}");
    assert_eq!(phase(&host, "good"), Some(Phase::Running));
}

#[tokio::test]
async fn a_failed_start_rolls_back_and_reports_why() {
    let host = FakeHost::default();
    host.fail("define");
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let st = host.state().statuses[&VmKey::new("default", "vm1").unwrap()].clone();
    assert_eq!(st.status.phase, Some(Phase::Failed));
    assert!(
        st.status
            .reason
            .as_deref()
            .unwrap()
            .contains("cannot start"),
        "{:?}",
        st.status.reason
    );
    let s = host.state();
    assert!(s.units.is_empty(), "unit left: {:?}", s.units);
    assert!(s.netns.is_empty());
    assert!(!s
        .dirs
        .contains(std::path::Path::new("/var/lib/kvirt/vms/default_vm1")));
    // The status stays readable.
    assert!(s
        .dirs
        .contains(std::path::Path::new("/run/kvirt/vms/default_vm1")));
}

#[tokio::test]
async fn leftovers_without_a_vmi_are_cleaned_up_on_start() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("orphan", "u9", "")])).await;
    ctl.reconcile("default_orphan").await.unwrap();
    host.take_calls();

    let restarted = controller(&host);
    restarted.set_vmis(BTreeMap::new()).await;
    assert!(restarted.reconcile_all().await.is_empty());
    let s = host.state();
    assert!(s.units.is_empty() && s.netns.is_empty() && s.dirs.is_empty());
}

#[tokio::test]
async fn a_replaced_manifest_replaces_the_vm() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "old", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    ctl.set_vmis(set(&[vmi("vm1", "new", "")])).await;
    let r = ctl.reconcile("default_vm1").await.unwrap();
    assert!(r.requeue_after.is_some());
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(
        host.state().domains["default_vm1"].uid.as_deref(),
        Some("new")
    );
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

/// A manifest edited while the old instance's start is under way (chaos
/// seed 1796337339813738289): the old pass's outcome is the old
/// instance's. Before, its Running landed on the new VMI, which then
/// counted as a running VM whose unit had disappeared, and failed.
#[tokio::test]
async fn a_vmi_replaced_during_its_predecessors_start_runs_as_itself() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "old", "")])).await;
    let gate = host.gate("start kvirt-vm@default_vm1");
    let pass = tokio::spawn({
        let ctl = ctl.clone();
        async move { ctl.reconcile("default_vm1").await }
    });
    wait_for(|| host.state().calls.iter().any(|c| c.starts_with("start "))).await;
    ctl.set_vmis(set(&[vmi("vm1", "new", "")])).await;
    gate.add_permits(100);
    pass.await.unwrap().unwrap();
    let (now, _) = ctl.view("default_vm1");
    assert_eq!(
        now.unwrap().status.phase,
        None,
        "the new instance took the old one's outcome"
    );
    for _ in 0..5 {
        ctl.reconcile("default_vm1").await.unwrap();
    }
    assert_eq!(
        host.state().domains["default_vm1"].uid.as_deref(),
        Some("new")
    );
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert!(
        !reasons(&host).contains(&EventReason::Stopped),
        "{:?}",
        host.state().events
    );
}

/// VMs start a few at a time (`vm.starts_at_once`; 250 begun at once on 2
/// CPUs all missed the start timeout): the others wait their turn before
/// anything of them is made, and one deleted while it waits never starts.
#[tokio::test]
async fn vms_wait_their_turn_to_start_and_one_deleted_meanwhile_never_starts() {
    let host = FakeHost::default();
    let one_at_a_time = Settings {
        starts_at_once: 1,
        ..settings()
    };
    let ctl = Controller::new(host.deps(), one_at_a_time);
    let (vm1, vm2, vm3) = (
        vmi("vm1", "u1", ""),
        vmi("vm2", "u2", ""),
        vmi("vm3", "u3", ""),
    );
    ctl.set_vmis(set(&[vm1.clone(), vm2, vm3.clone()])).await;
    let gate = host.gate("start kvirt-vm@default_vm1");
    let pass = |id: &'static str| {
        let ctl = ctl.clone();
        tokio::spawn(async move { ctl.reconcile(id).await })
    };
    let started = |name: &str| {
        let call = format!("start kvirt-vm@default_{name}");
        host.state().calls.iter().any(|c| c.starts_with(&call))
    };
    let first = pass("default_vm1");
    wait_for(|| started("vm1")).await;
    let (second, third) = (pass("default_vm2"), pass("default_vm3"));
    wait_for(|| {
        phase(&host, "vm2") == Some(Phase::Scheduled)
            && phase(&host, "vm3") == Some(Phase::Scheduled)
    })
    .await;

    ctl.set_vmis(set(&[vm1, vm3])).await;
    second.await.unwrap().unwrap();
    assert!(!started("vm2"), "a VMI deleted while it waited started");
    assert!(
        !started("vm3"),
        "two VMs starting at once: {:?}",
        host.state().calls
    );
    assert!(!host.state().netns.iter().any(|n| n.contains("vm2")));

    gate.add_permits(100);
    first.await.unwrap().unwrap();
    third.await.unwrap().unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert_eq!(phase(&host, "vm3"), Some(Phase::Running));
    ctl.reconcile("default_vm2").await.unwrap();
    let (vmi2, gone) = ctl.view("default_vm2");
    assert!(
        vmi2.is_none() && gone,
        "something of the deleted VMI is left"
    );
    assert!(!started("vm2"));
}

#[tokio::test]
async fn the_loop_runs_vms_from_triggers() {
    let host = FakeHost::default();
    let (_ctl, tx, task) = running_loop(&host);
    tx.send(Trigger::Vmis(set(&[
        vmi("a", "ua", ""),
        vmi("b", "ub", ""),
    ])))
    .unwrap();
    wait_for(|| {
        phase(&host, "a") == Some(Phase::Running) && phase(&host, "b") == Some(Phase::Running)
    })
    .await;

    host.guest_poweroff("default_a");
    tx.send(Trigger::Vm("default_a".into())).unwrap();
    wait_for(|| phase(&host, "a") == Some(Phase::Succeeded)).await;
    assert_eq!(
        host.state().domains["default_b"].state,
        DomainState::Running
    );
    drop(tx);
    task.abort();
}

#[tokio::test]
async fn limits_keep_a_vm_from_starting_but_never_stop_one_that_runs() {
    let with_disk = |name: &str, uid: &str| {
        VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: {name}, namespace: default, uid: {uid}}}\nspec:\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{disks: [{{name: d}}]}}\n  volumes: [{{name: d, emptyDisk: {{capacity: 2Gi}}}}]\n"
        ))
        .unwrap()
    };
    let host = FakeHost::default();
    let before = controller(&host);
    before.set_vmis(set(&[with_disk("runs", "u1")])).await;
    before.reconcile("default_runs").await.unwrap();
    assert_eq!(phase(&host, "runs"), Some(Phase::Running));

    // kvirtd restarts with a lower limit: the running VM is left alone...
    let lower = Settings {
        limits: kvirt::core::convert::Limits {
            max_disk_bytes: 1 << 30,
            ..Default::default()
        },
        ..settings()
    };
    let after: Arc<Ctl> = Controller::new(host.deps(), lower);
    after
        .set_vmis(set(&[with_disk("runs", "u1"), with_disk("new", "u2")]))
        .await;
    host.take_calls();
    after.reconcile("default_runs").await.unwrap();
    assert_eq!(phase(&host, "runs"), Some(Phase::Running));
    let calls = host.take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("stop") || c.starts_with("shutdown")),
        "{calls:?}"
    );
    // ...and a new one asking as much is refused before anything is made.
    after.reconcile("default_new").await.unwrap();
    let why = refused(&host, "default", "new");
    assert!(why.contains("vm.max_disk_size"), "{why}");
    let calls = host.take_calls();
    assert!(
        !calls.iter().any(|c| c.contains("default_new")),
        "{calls:?}"
    );
}

#[tokio::test]
async fn a_vmi_labelled_for_this_node_runs_only_where_the_node_would_have_claimed_it() {
    let host = FakeHost::default();
    let facts = |taints: Vec<kvirt::core::scheduling::Taint>| kvirt::core::scheduling::HostFacts {
        node_name: "node-1".into(),
        labels: [("zone".to_string(), "z1".to_string())].into(),
        taints,
        scheduler_name: "kvirt".into(),
    };
    let dedicated = kvirt::core::scheduling::Taint {
        key: "dedicated".into(),
        value: "vms".into(),
        effect: "NoSchedule".into(),
    };
    let untainted: Arc<Ctl> = Controller::new(
        host.deps(),
        Settings {
            placement: Some(facts(vec![])),
            ..settings()
        },
    );
    untainted.set_vmis(set(&[vmi("early", "u0", "")])).await;
    untainted.reconcile("default_early").await.unwrap();
    assert_eq!(phase(&host, "early"), Some(Phase::Running));

    // The node label alone (a tenant may set it) is not enough.
    let ctl: Arc<Ctl> = Controller::new(
        host.deps(),
        Settings {
            placement: Some(facts(vec![dedicated])),
            ..settings()
        },
    );
    let tolerates =
        "  tolerations: [{key: dedicated, operator: Equal, value: vms, effect: NoSchedule}]\n";
    ctl.set_vmis(set(&[
        vmi("early", "u0", ""),
        vmi(
            "elsewhere",
            "u1",
            &format!("{tolerates}  nodeSelector: {{zone: z2}}\n"),
        ),
        vmi("intolerant", "u2", ""),
        vmi(
            "other-scheduler",
            "u3",
            &format!("{tolerates}  schedulerName: volcano\n"),
        ),
        vmi(
            "fits",
            "u4",
            &format!("{tolerates}  nodeSelector: {{zone: z1}}\n"),
        ),
    ]))
    .await;
    host.take_calls();
    for (name, why) in [
        ("elsewhere", "nodeSelector zone=z2"),
        ("intolerant", "dedicated=vms:NoSchedule"),
        ("other-scheduler", "volcano"),
    ] {
        ctl.reconcile(&format!("default_{name}")).await.unwrap();
        let msg = refused(&host, "default", name);
        assert!(
            msg.contains("placement") && msg.contains(why),
            "{name}: {msg}"
        );
    }
    assert!(
        host.take_calls().iter().all(|c| !c.starts_with("start")),
        "nothing of them was made"
    );
    ctl.reconcile("default_fits").await.unwrap();
    assert_eq!(phase(&host, "fits"), Some(Phase::Running));
    // A VM that ran before the taint came runs on: placement is admission.
    ctl.reconcile("default_early").await.unwrap();
    assert_eq!(phase(&host, "early"), Some(Phase::Running));
    assert!(reasons(&host).contains(&EventReason::SyncFailed));
}

/// A guest agent connecting and going away in a loop (each change wakes
/// the VM) gets a few status writes a second, not one per change, and the
/// last state still reaches the status.
#[tokio::test(start_paused = true)]
async fn a_flapping_guest_agent_cannot_flood_the_status_store() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("flap", "u1", "")])).await;
    ctl.reconcile("default_flap").await.unwrap();
    host.take_calls();
    let mut deferred = None;
    for i in 0..200 {
        {
            let mut s = host.state();
            if i % 2 == 0 {
                s.agents.insert("default_flap".into(), Default::default());
            } else {
                s.agents.remove("default_flap");
            }
        }
        deferred = ctl.reconcile("default_flap").await.unwrap().requeue_after;
    }
    let saves = || {
        host.take_calls()
            .iter()
            .filter(|c| c.starts_with("save"))
            .count()
    };
    assert!(saves() <= 5, "a burst of five at most");
    let metrics = ctl.metrics().encode();
    let deferred_writes: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvirt_status_writes_deferred_total "))
        .and_then(|n| n.trim().parse().ok())
        .expect("the deferral metric");
    assert!(deferred_writes >= 150, "{deferred_writes}");
    // The last change (the agent gone) is written once the budget allows,
    // by the pass the deferral asked for.
    let wait = deferred.expect("a deferred write asks for a pass");
    assert!(wait <= Duration::from_secs(1), "{wait:?}");
    tokio::time::advance(wait).await;
    ctl.reconcile("default_flap").await.unwrap();
    assert_eq!(saves(), 1);
    let st = host.state().statuses[&VmKey::new("default", "flap").unwrap()].clone();
    assert!(st
        .status
        .conditions
        .iter()
        .all(|c| c.type_ != "AgentConnected"));
}

#[tokio::test]
async fn a_pass_that_panics_is_reported_and_retried_and_holds_up_no_other_vm() {
    let host = FakeHost::default();
    host.state().panic.insert("define default_a".into());
    let (_ctl, tx, task) = running_loop(&host);
    tx.send(Trigger::Vmis(set(&[
        vmi("a", "ua", ""),
        vmi("b", "ub", ""),
    ])))
    .unwrap();
    wait_for(|| phase(&host, "b") == Some(Phase::Running)).await;
    wait_for(|| {
        host.state().events.iter().any(|(k, r, m)| {
            k.name() == "a"
                && *r == EventReason::SyncFailed
                && m.contains("panicked: injected panic: define default_a")
        })
    })
    .await;
    // The loop still knows the pass ended: the retry (after its backoff)
    // runs the VM once the bug is gone.
    host.state().panic.clear();
    wait_for(|| phase(&host, "a") == Some(Phase::Running)).await;
    let panics = host
        .state()
        .events
        .iter()
        .filter(|(k, r, _)| k.name() == "a" && *r == EventReason::SyncFailed)
        .count();
    assert_eq!(panics, 1, "one Event for a run of panics");
    drop(tx);
    task.abort();
}

/// A controller on `host` with its loop running: the trigger sender and
/// the loop's task.
fn running_loop(
    host: &FakeHost,
) -> (
    Arc<Ctl>,
    tokio::sync::mpsc::UnboundedSender<Trigger>,
    tokio::task::JoinHandle<()>,
) {
    let ctl = controller(host);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(ctl.clone().run(tx.clone(), rx, None));
    (ctl, tx, task)
}

async fn wait_for(cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met in time"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn status_written_during_an_outage_catches_up_correctly() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    host.fail("save");
    host.guest_poweroff("default_vm1");
    assert!(ctl.reconcile("default_vm1").await.is_err());
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running), "not written yet");
    // The host was cleaned meanwhile; the truth (Succeeded) must not turn
    // into "unit disappeared" on the retry.
    assert!(ctl.reconcile("default_vm1").await.is_err());
    host.heal("save");
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Succeeded));
    let events: Vec<EventReason> = reasons(&host);
    assert_eq!(
        events
            .iter()
            .filter(|r| **r == EventReason::Stopped)
            .count(),
        1,
        "{events:?}"
    );
}

#[tokio::test]
async fn a_deleted_vmi_is_released_only_once_its_host_side_is_gone() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let v = vmi("vm1", "u1", "");
    ctl.set_vmis(set(std::slice::from_ref(&v))).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.state().held.contains(&v.key().unwrap()));
    host.take_calls();

    // Deletion requested: the object stays (held) until the host is clean.
    let mut deleting = v.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    host.fail("netns del");
    ctl.set_vmis(set(std::slice::from_ref(&deleting))).await;
    // A failing teardown step must not release the VMI.
    let _ = ctl.reconcile("default_vm1").await;
    host.heal("netns del");
    ctl.reconcile("default_vm1").await.unwrap();
    let calls = host.take_calls();
    assert_eq!(
        calls.last().map(String::as_str),
        Some("release default/vm1"),
        "{calls:?}"
    );
    assert_eq!(
        calls.iter().filter(|c| c.starts_with("release")).count(),
        1,
        "{calls:?}"
    );
    let s = host.state();
    assert!(s.units.is_empty() && s.netns.is_empty() && s.dirs.is_empty());
}

#[tokio::test]
async fn a_restarted_daemon_reattaches_dhcp_without_touching_the_vm() {
    let host = FakeHost::default();
    let first = controller(&host);
    first.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    first.reconcile("default_vm1").await.unwrap();
    drop(first);
    // kvirtd's own DHCP server died with it; the lease persisted.
    host.state().dhcp.clear();
    host.take_calls();

    let second = controller(&host);
    second.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    assert!(second.reconcile_all().await.is_empty());
    assert_eq!(host.take_calls(), vec!["net attach default_vm1"]);
    assert_eq!(
        host.state().addresses["default_vm1"].to_string(),
        "10.213.0.2"
    );
}

#[tokio::test]
async fn no_interface_means_no_network() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let mut v = vmi("vm1", "u1", "");
    v.spec.domain.devices.autoattach_pod_interface = Some(false);
    ctl.set_vmis(set(&[v])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.state().addresses.is_empty());
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

#[tokio::test]
async fn machined_trouble_never_stops_a_vm() {
    let host = FakeHost::default();
    host.fail("register-machine");
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert!(host.state().machines.is_empty());
    // Level-triggered: the next pass registers it once machined answers.
    host.heal("register-machine");
    ctl.reconcile("default_vm1").await.unwrap();
    let m = host.state().machines.get("default.vm1").cloned().unwrap();
    assert_eq!(m.unit, "kvirt-vm@default_vm1.service");
    assert!(m.pid_file.ends_with("xdg/libvirt/qemu/run/default_vm1.pid"));

    // A host without machined is never asked.
    let bare = FakeHost::default();
    bare.state().no_machined = true;
    let ctl = controller(&bare);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&bare, "vm1"), Some(Phase::Running));
    assert!(!bare.take_calls().iter().any(|c| c.contains("machine")));
}

const CONTAINER_DISK: &str = "  volumes:\n    - {name: root, containerDisk: {image: 'registry.example:5000/disks/guest:1'}}\n";

fn with_root_disk(name: &str, uid: &str) -> VirtualMachineInstance {
    let mut v = vmi(name, uid, CONTAINER_DISK);
    v.spec.domain.devices.disks =
        vec![serde_json::from_value(serde_json::json!({"name": "root"})).unwrap()];
    v
}

#[tokio::test]
async fn a_container_disk_is_pulled_before_anything_is_made_and_bound_read_only() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[with_root_disk("vm1", "u1")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let calls: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| !c.starts_with("save"))
        .collect();
    assert_eq!(
        &calls[..6],
        [
            "allowance default",
            "hold default/vm1",
            "pull registry.example:5000/disks/guest:1",
            "identity default_vm1",
            "mkdir /var/lib/kvirt/vms/default_vm1",
            "disk /var/lib/kvirt/vms/default_vm1/disks/root.overlay.qcow2",
        ]
    );
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert_eq!(
        reasons(&host),
        [
            EventReason::Created,
            EventReason::Pulled,
            EventReason::Started
        ]
    );
    let pulled = host.state().events[1].2.clone();
    assert!(
        pulled.starts_with("pulled registry.example:5000/disks/guest:1 (sha256:"),
        "{pulled}"
    );
    // The VM's unit sees this image of the cache, read-only, and no other.
    let spec = host.state().unit_specs["kvirt-vm@default_vm1.service"].clone();
    let binds = spec
        .properties
        .iter()
        .find_map(|p| match p {
            Prop::Binds("BindReadOnlyPaths", b) => Some(b.clone()),
            _ => None,
        })
        .expect("BindReadOnlyPaths");
    assert_eq!(binds.len(), 1);
    assert!(
        binds[0].0.starts_with("/var/cache/kvirt/images/sha256/"),
        "{binds:?}"
    );
}

/// Nothing of `vm` was made on the host (only its status saved), and it
/// waits in Scheduled, not failed: the reason in its Ready condition and an
/// Event. Returns the condition's message.
fn waits_with_nothing_made(host: &FakeHost, vm: &str, reason: EventReason) -> String {
    waits_in(host, vm, reason, Some(Phase::Scheduled))
}

/// Waits with nothing made, in `phase`: a VMI kvirt has not taken on
/// (held) stays where it was, as KubeVirt's stays Pending.
fn waits_in(host: &FakeHost, vm: &str, reason: EventReason, phase: Option<Phase>) -> String {
    let calls = host.take_calls();
    let id = format!("default_{vm}");
    assert!(
        !calls
            .iter()
            .any(|c| c.contains(&id) && !c.starts_with("save")),
        "nothing of {vm} on the host: {calls:?}"
    );
    let st = host.state().statuses[&VmKey::new("default", vm).unwrap()].clone();
    assert_eq!(st.status.phase, phase);
    let ready = st
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        ready.reason.as_deref(),
        Some(format!("{reason:?}").as_str())
    );
    assert!(reasons(host).contains(&reason));
    ready.message.clone().unwrap_or_default()
}

#[tokio::test]
async fn a_failed_pull_leaves_nothing_and_is_retried_while_the_vmi_waits() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    host.fail("pull ");
    ctl.set_vmis(set(&[with_root_disk("vm1", "u1"), vmi("vm2", "u2", "")]))
        .await;
    let err = ctl.reconcile("default_vm1").await.unwrap_err();
    assert_eq!(err.reason(), "image");
    assert!(err.to_string().contains("injected failure: pull"), "{err}");
    ctl.reconcile("default_vm2").await.unwrap();
    let message = waits_with_nothing_made(&host, "vm1", EventReason::ErrImagePull);
    assert!(message.contains("volume root"), "{message}");
    // The other VM never noticed.
    assert_eq!(phase(&host, "vm2"), Some(Phase::Running));

    // The registry is back: the next pass (the loop's backoff) runs it.
    host.heal("pull ");
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    let st = host.state().statuses[&VmKey::new("default", "vm1").unwrap()].clone();
    let ready = st
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.status, "True");
}

fn with_scratch(name: &str, uid: &str, capacity: &str) -> VirtualMachineInstance {
    VirtualMachineInstance::from_yaml(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: {name}, namespace: default, uid: {uid}}}\nspec:\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{disks: [{{name: d}}]}}\n  volumes: [{{name: d, emptyDisk: {{capacity: {capacity}}}}}]\n"
    ))
    .unwrap()
}

/// A namespace's ResourceQuota bounds its VMs' emptyDisks, VMs on other
/// hosts included: a VMI that does not fit waits with the figures and
/// nothing is made; it starts once the quota allows; a quota lowered
/// never stops a VM that runs; a quota that cannot be read starts nothing
/// that might not fit.
#[tokio::test]
async fn a_namespaces_quota_bounds_its_vms_empty_disks_across_hosts() {
    use kvirt::core::quota::{bounds, Claim};
    let host = FakeHost::default();
    let ctl = controller(&host);
    let quota = |figure: &str| {
        bounds([(
            "disks".to_owned(),
            vec![("requests.ephemeral-storage".to_owned(), figure.to_owned())],
        )])
    };
    {
        let mut s = host.state();
        s.quotas.insert("default".into(), quota("1Gi"));
        let elsewhere = Claim {
            name: "elsewhere".into(),
            uid: "u0".into(),
            created: "2026-01-01T00:00:00Z".into(),
            bytes: 512 << 20,
            admitted: true,
        };
        s.other_claims.insert("default".into(), vec![elsewhere]);
    }
    ctl.set_vmis(set(&[
        with_scratch("vm1", "u1", "768Mi"),
        vmi("vm2", "u2", ""),
    ]))
    .await;
    let err = ctl.reconcile("default_vm1").await.unwrap_err();
    assert_eq!(err.reason(), "quota");
    ctl.reconcile("default_vm2").await.unwrap();
    let message = waits_in(&host, "vm1", EventReason::ExceededQuota, None);
    assert_eq!(
        message,
        "exceeded quota: disks, requested: requests.ephemeral-storage=0.8 GiB (emptyDisks), \
         used: 0.5 GiB, limited: 1.0 GiB"
    );
    assert!(!host
        .state()
        .held
        .contains(&VmKey::new("default", "vm1").unwrap()));
    assert_eq!(phase(&host, "vm2"), Some(Phase::Running), "no emptyDisk");

    // The other host's VM goes: vm1 fits and starts.
    host.state().other_claims.clear();
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));

    // Lowered under it, the quota stops nothing and admits no more.
    host.state().quotas.insert("default".into(), quota("100Mi"));
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    ctl.set_vmis(set(&[
        with_scratch("vm1", "u1", "768Mi"),
        vmi("vm2", "u2", ""),
        with_scratch("vm3", "u3", "1Mi"),
    ]))
    .await;
    host.take_calls();
    assert_eq!(
        ctl.reconcile("default_vm3").await.unwrap_err().reason(),
        "quota"
    );
    waits_in(&host, "vm3", EventReason::ExceededQuota, None);

    // A quota that cannot be read: nothing that might not fit starts.
    host.state().quotas.clear();
    host.fail("allowance ");
    assert_eq!(
        ctl.reconcile("default_vm3").await.unwrap_err().reason(),
        "quota"
    );
    let message = waits_in(&host, "vm3", EventReason::QuotaUnknown, None);
    assert!(message.contains("ResourceQuotas"), "{message}");
    host.heal("allowance ");
    ctl.reconcile("default_vm3").await.unwrap();
    assert_eq!(phase(&host, "vm3"), Some(Phase::Running));
}

#[tokio::test]
async fn a_connected_guest_agent_shows_in_the_status_and_goes_with_it() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[vmi("vm1", "u1", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    let status = |host: &FakeHost| {
        host.state().statuses[&VmKey::new("default", "vm1").unwrap()]
            .status
            .clone()
    };
    let agent_cond = |host: &FakeHost| {
        status(host)
            .conditions
            .into_iter()
            .find(|c| c.type_ == "AgentConnected")
    };
    assert!(agent_cond(&host).is_none());

    // The guest starts its agent: the agent's event wakes the VM.
    let mut os_info = BTreeMap::new();
    os_info.insert("prettyName".to_string(), "Fedora Linux 41".to_string());
    host.state()
        .agents
        .insert("default_vm1".into(), GuestAgent { os_info });
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(agent_cond(&host).unwrap().status, "True");
    assert_eq!(
        status(&host).extra["guestOSInfo"],
        serde_json::json!({"prettyName": "Fedora Linux 41"})
    );
    // Nothing new: nothing written.
    host.take_calls();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.take_calls().is_empty());

    host.state().agents.clear();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(agent_cond(&host).is_none());
    assert!(!status(&host).extra.contains_key("guestOSInfo"));
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

/// A VMI with a cloud-init Secret and a ConfigMap disk.
fn with_config_volumes(name: &str, uid: &str) -> VirtualMachineInstance {
    let mut v = vmi(
        name,
        uid,
        "  volumes:
  - name: ci
    cloudInitNoCloud: {secretRef: {name: userdata}}
  - name: app
    configMap: {name: app-config}
  - name: sa
    serviceAccount: {serviceAccountName: default}
",
    );
    v.spec.domain.devices.disks = ["ci", "app", "sa"]
        .map(|d| serde_json::from_value(serde_json::json!({ "name": d })).unwrap())
        .to_vec();
    v
}

fn seed_of(host: &FakeHost, volume: &str) -> kvirt::core::convert::seed::Seed {
    host.state()
        .disks
        .iter()
        .find_map(|d| match d {
            DiskPrep::SeedIso {
                volume: v, seed, ..
            } if v == volume => Some(seed.clone()),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no seed for {volume}"))
}

#[tokio::test]
async fn cluster_objects_are_read_at_start_and_a_missing_one_is_waited_for() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let put = |r: ObjectRef, pairs: &[(&str, &str)]| {
        let data = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect();
        host.state().objects.insert(("default".into(), r), data);
    };
    put(
        ObjectRef::Secret("userdata".into()),
        &[("userdata", "#!/bin/sh\necho hi\n")],
    );
    put(
        ObjectRef::ServiceAccountToken("default".into()),
        &[("token", "t0k3n"), ("namespace", "default")],
    );
    ctl.set_vmis(set(&[
        with_config_volumes("vm1", "u1"),
        vmi("vm2", "u2", ""),
    ]))
    .await;

    // The ConfigMap does not exist yet: nothing is made, the VMI waits.
    let err = ctl.reconcile("default_vm1").await.unwrap_err();
    assert_eq!(err.reason(), "objects");
    assert!(
        err.to_string()
            .contains("spec.volumes[1].configMap: configmap \"app-config\" not found"),
        "{err}"
    );
    ctl.reconcile("default_vm2").await.unwrap();
    waits_with_nothing_made(&host, "vm1", EventReason::FailedMount);
    assert_eq!(phase(&host, "vm2"), Some(Phase::Running));

    // Created: the next pass reads each object once and writes its data.
    put(
        ObjectRef::ConfigMap("app-config".into()),
        &[("app.conf", "x=1")],
    );
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    let reads: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| c.starts_with("read "))
        .collect();
    assert_eq!(
        reads,
        [
            "read default/secret \"userdata\"",
            "read default/configmap \"app-config\"",
            "read default/serviceaccount \"default\"",
        ]
    );
    let ci = seed_of(&host, "ci");
    assert_eq!(
        ci.files[1],
        ("user-data".into(), b"#!/bin/sh\necho hi\n".to_vec())
    );
    assert!(ci.from_objects.is_empty());
    assert!(
        !format!("{ci:?}").contains("echo hi"),
        "secrets stay out of logs"
    );
    let app = seed_of(&host, "app");
    assert_eq!((app.label.as_str(), app.files.len()), ("cfgdata", 1));
    let sa = seed_of(&host, "sa");
    assert_eq!(sa.files[1], ("token".into(), b"t0k3n".to_vec()));

    // A running VM never rereads them, even when they are gone.
    host.state().objects.clear();
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host.take_calls().iter().any(|c| c.starts_with("read ")));
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

/// serviceAccount tokens are bound to no object (a VMI cannot be one), so
/// they are short-lived and renewed in the running VM's ISO, in place,
/// once four fifths of their life are over; only the token is read again.
/// A failed renewal is retried and leaves the VM running; after a kvirtd
/// restart, which cannot tell how old they are, they are renewed at once.
#[tokio::test(start_paused = true)]
async fn a_running_vms_service_account_token_is_renewed_before_it_lapses() {
    let host = FakeHost::default();
    let put = |token: &str| {
        for (r, k, v) in [
            (ObjectRef::Secret("userdata".into()), "userdata", "x"),
            (ObjectRef::ConfigMap("app-config".into()), "app.conf", "x"),
            (
                ObjectRef::ServiceAccountToken("default".into()),
                "token",
                token,
            ),
        ] {
            let data = [(k.to_string(), v.as_bytes().to_vec())]
                .into_iter()
                .collect();
            host.state().objects.insert(("default".into(), r), data);
        }
    };
    let reads = |host: &FakeHost| -> Vec<String> {
        host.take_calls()
            .into_iter()
            .filter(|c| c.starts_with("read ") || c.starts_with("reseed "))
            .collect()
    };
    let renewed = |host: &FakeHost| {
        let s = host.state();
        let (path, seed) = s.reseeded.last().cloned().expect("an ISO written anew");
        let token = seed
            .files
            .iter()
            .find(|(f, _)| f == "token")
            .unwrap()
            .1
            .clone();
        (path, String::from_utf8(token).unwrap(), s.reseeded.len())
    };
    put("t1");
    let ctl = controller(&host);
    ctl.set_vmis(set(&[with_config_volumes("vm1", "u1")])).await;
    let r = ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    let every = Duration::from_secs(2880);
    assert_eq!(r.requeue_after, Some(every));
    reads(&host);

    // Not due yet: nothing is read.
    tokio::time::advance(Duration::from_secs(2000)).await;
    let r = ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(reads(&host), Vec::<String>::new());
    assert_eq!(r.requeue_after, Some(Duration::from_secs(880)));

    // Due: the token alone is asked for again and written over the ISO.
    put("t2");
    tokio::time::advance(Duration::from_secs(880)).await;
    let r = ctl.reconcile("default_vm1").await.unwrap();
    let sa_iso = "/var/lib/kvirt/vms/default_vm1/disks/sa.iso";
    assert_eq!(
        reads(&host),
        [
            "read default/serviceaccount \"default\"".to_owned(),
            format!("reseed {sa_iso}")
        ]
    );
    assert_eq!(renewed(&host), (sa_iso.into(), "t2".into(), 1));
    assert_eq!(r.requeue_after, Some(every));

    // The API server refuses: tried again in a minute, the VM runs on.
    tokio::time::advance(every).await;
    host.fail("read default/serviceaccount");
    let r = ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(r.requeue_after, Some(Duration::from_secs(60)));
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    host.heal("read default/serviceaccount");
    put("t3");
    tokio::time::advance(Duration::from_secs(60)).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(renewed(&host).1, "t3");

    // kvirtd restarted: renewed on its first pass.
    put("t4");
    reads(&host);
    let again = controller(&host);
    again
        .set_vmis(set(&[with_config_volumes("vm1", "u1")]))
        .await;
    let r = again.reconcile("default_vm1").await.unwrap();
    assert_eq!(renewed(&host).1, "t4");
    assert_eq!(r.requeue_after, Some(every));
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

/// A namespace an administrator has not opted in: its VMI that reads a
/// Secret is refused with why and how to fix it (Synchronized=False),
/// nothing is made, other VMs run; opted in, it runs.
#[tokio::test]
async fn objects_of_a_namespace_not_opted_in_are_refused_with_why() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    host.state().closed_namespaces.insert("default".into());
    ctl.set_vmis(set(&[
        with_config_volumes("vm1", "u1"),
        vmi("vm2", "u2", ""),
    ]))
    .await;
    let err = ctl.reconcile("default_vm1").await.unwrap_err();
    assert_eq!(err.reason(), "objects");
    ctl.reconcile("default_vm2").await.unwrap();
    let message = waits_with_nothing_made(&host, "vm1", EventReason::NamespaceNotOptedIn);
    assert!(
        message.contains("namespace default is not opted in")
            && message.contains("kvirtd --print-rbac --namespace default"),
        "{message}"
    );
    let sync = |host: &FakeHost| {
        host.state().statuses[&VmKey::new("default", "vm1").unwrap()]
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == "Synchronized")
            .map(|c| (c.status.clone(), c.reason.clone()))
    };
    assert_eq!(
        sync(&host),
        Some(("False".into(), Some("NamespaceNotOptedIn".into())))
    );
    assert_eq!(phase(&host, "vm2"), Some(Phase::Running));

    // Opted in (and the objects there): it runs, in sync.
    host.state().closed_namespaces.clear();
    for (r, k) in [
        (ObjectRef::Secret("userdata".into()), "userdata"),
        (ObjectRef::ConfigMap("app-config".into()), "app.conf"),
        (ObjectRef::ServiceAccountToken("default".into()), "token"),
    ] {
        let data = [(k.to_string(), b"x".to_vec())].into_iter().collect();
        host.state().objects.insert(("default".into(), r), data);
    }
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert_eq!(sync(&host), None);
}

#[tokio::test]
async fn a_pull_secret_gives_the_pull_its_registry_credentials() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let mut v = vmi(
        "vm1",
        "u1",
        "  volumes:\n    - {name: root, containerDisk: {image: 'registry.example:5000/disks/guest:1', imagePullSecret: regcred}}\n",
    );
    v.spec.domain.devices.disks =
        vec![serde_json::from_value(serde_json::json!({"name": "root"})).unwrap()];
    ctl.set_vmis(set(&[v])).await;

    // No such Secret yet: the VMI waits, nothing is pulled or made.
    let err = ctl.reconcile("default_vm1").await.unwrap_err();
    assert_eq!(err.reason(), "image");
    assert!(
        err.to_string()
            .contains("imagePullSecret \"regcred\": not found"),
        "{err}"
    );
    assert!(!host.take_calls().iter().any(|c| c.starts_with("pull ")));
    assert!(reasons(&host).contains(&EventReason::ErrImagePull));

    // "dm11c2VyOnB3" is "vmuser:pw".
    let config = r#"{"auths": {"registry.example:5000": {"auth": "dm11c2VyOnB3"}}}"#;
    host.state().objects.insert(
        ("default".into(), ObjectRef::Secret("regcred".into())),
        [(".dockerconfigjson".to_string(), config.as_bytes().to_vec())].into(),
    );
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host
        .take_calls()
        .contains(&"pull registry.example:5000/disks/guest:1 as vmuser".to_string()));
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
}

/// Plants kept EFI variables as the host would have them.
fn keep(host: &FakeHost, id: &str, owner: &str, active: bool) {
    let k = kvirt::core::efivars::Kept {
        id: id.into(),
        owner: kvirt::core::efivars::Owner::parse(owner),
        active,
    };
    host.state().kept_efi_vars.insert(id.into(), k);
}

fn kept_ids(host: &FakeHost) -> Vec<String> {
    host.state().kept_efi_vars.keys().cloned().collect()
}

#[tokio::test]
async fn kept_efi_variables_go_once_their_virtual_machine_is_gone() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    host.state().virtual_machines = Some(["default/alive u1".to_string()].into());
    keep(&host, "default_a", "VirtualMachine default/alive u1", false);
    keep(&host, "default_b", "VirtualMachine default/alive u0", false);
    keep(&host, "default_c", "VirtualMachine default/gone u2", false);
    keep(&host, "default_d", "VirtualMachine default/gone u3", true);
    keep(
        &host,
        "default_e",
        "VirtualMachineInstance default/e",
        false,
    );
    keep(&host, "default_f", "unreadable", false);
    // The cluster cannot say for c: it stays until a sweep can ask.
    host.fail("get vm default/gone u2");
    ctl.sweep_efi_vars(None).await;
    assert_eq!(
        kept_ids(&host),
        [
            "default_a",
            "default_c",
            "default_d",
            "default_e",
            "default_f"
        ],
        "b's VirtualMachine was made anew; a runs; e is a VMI's; f unknown"
    );
    host.heal("get vm default/gone u2");

    // The loop sweeps on its trigger.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(ctl.clone().run(tx.clone(), rx, None));
    tx.send(Trigger::EfiVars).unwrap();
    wait_for(|| !host.state().kept_efi_vars.contains_key("default_c")).await;
    assert_eq!(
        kept_ids(&host),
        ["default_a", "default_d", "default_e", "default_f"]
    );
    drop(tx);
    task.abort();

    // Without a cluster nobody can tell: everything stays.
    host.state().virtual_machines = None;
    keep(&host, "default_g", "VirtualMachine default/gone u4", false);
    ctl.sweep_efi_vars(None).await;
    assert!(kept_ids(&host).contains(&"default_g".to_string()));
}

#[tokio::test]
async fn a_vm_torn_down_after_its_virtual_machine_went_leaves_no_efi_variables() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    host.state().virtual_machines = Some(Default::default());
    let v = vmi("vm1", "u1", "");
    ctl.set_vmis(set(std::slice::from_ref(&v))).await;
    ctl.reconcile("default_vm1").await.unwrap();
    // Kept at teardown for a VirtualMachine that is already gone; another
    // VM's are left to the periodic sweep.
    keep(&host, "default_vm1", "VirtualMachine default/vm u9", false);
    keep(
        &host,
        "default_other",
        "VirtualMachine default/other u8",
        false,
    );
    ctl.set_vmis(BTreeMap::new()).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(host.state().dirs.is_empty());
    assert_eq!(kept_ids(&host), ["default_other"]);
    let calls = host.take_calls();
    assert!(
        calls.contains(&"get vm default/vm u9".to_string())
            && calls.last().map(String::as_str) == Some("identity release default_vm1"),
        "{calls:?}"
    );
}

/// In a cluster a namespace is a tenant: a hostDisk under another
/// namespace's root is refused before anything is made, and the owner's
/// VM is checked against its own roots only.
#[tokio::test]
async fn a_tenant_reaches_only_the_host_disk_roots_of_its_namespace() {
    let host = FakeHost::default();
    let mut s = settings();
    s.host_disk_roots =
        HostDiskRoots::Namespaces(BTreeMap::from([("x".into(), vec!["/srv/x".into()])]));
    let ctl = Controller::new(host.deps(), s);
    let with_disk = |ns: &str, name: &str, uid: &str| {
        let mut v = VirtualMachineInstance::from_yaml(&format!(
            "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata:\n  name: {name}\n  namespace: {ns}\n  uid: {uid}\nspec:\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{}}\n  volumes:\n  - name: d\n    hostDisk: {{path: /srv/x/disk.img, type: Disk}}\n"
        ))
        .unwrap();
        v.spec.domain.devices.disks =
            serde_json::from_str(r#"[{"name":"d","disk":{"bus":"virtio"}}]"#).unwrap();
        v
    };
    ctl.set_vmis(set(&[
        with_disk("y", "thief", "u1"),
        with_disk("x", "owner", "u2"),
    ]))
    .await;
    assert!(ctl.reconcile_all().await.is_empty());

    let why = refused(&host, "y", "thief");
    assert!(why.contains("spec.volumes[0].hostDisk.path"), "{why}");
    assert!(why.contains("none are granted to namespace y"), "{why}");
    let touched: Vec<String> = host
        .take_calls()
        .into_iter()
        .filter(|c| c.contains("thief") && !c.starts_with("save"))
        .collect();
    assert!(touched.is_empty(), "{touched:?}");

    let owner = host.state().statuses[&VmKey::new("x", "owner").unwrap()].clone();
    assert_eq!(owner.status.phase, Some(Phase::Running));
    assert_eq!(
        host.state().disk_roots[std::path::Path::new("/srv/x/disk.img")],
        [std::path::PathBuf::from("/srv/x")]
    );
}

/// Each VM runs as its own identity: its directories, disks, tap and unit
/// are made for it, no two VMs share one, and it goes with the VM.
#[tokio::test]
async fn each_vm_has_an_identity_of_its_own_for_everything_of_it() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[with_root_disk("vm1", "u1"), vmi("vm2", "u2", "")]))
        .await;
    assert!(ctl.reconcile_all().await.is_empty());
    let (one, two) = {
        let s = host.state();
        (s.identities["default_vm1"], s.identities["default_vm2"])
    };
    assert_ne!(one, two);
    {
        let s = host.state();
        for (id, uid) in [("default_vm1", one), ("default_vm2", two)] {
            let state_dir = std::path::PathBuf::from(format!("/var/lib/kvirt/vms/{id}"));
            assert_eq!(s.owners[&state_dir], Some((uid, uid)), "{id}");
            let spec = &s.unit_specs[&format!("kvirt-vm@{id}.service")];
            let user = spec.properties.iter().find_map(|p| match p {
                Prop::Str("User", u) => Some(u.clone()),
                _ => None,
            });
            assert_eq!(user, Some(format!("kvirt-vm-{uid}")), "{id}");
        }
        assert_eq!(s.tap_owners["default_vm2"], (two, two));
        let overlay =
            std::path::Path::new("/var/lib/kvirt/vms/default_vm1/disks/root.overlay.qcow2");
        assert_eq!(s.owners[overlay], Some((one, one)));
    }

    ctl.set_vmis(set(&[vmi("vm2", "u2", "")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert!(!host.state().identities.contains_key("default_vm1"));
    assert_eq!(host.state().identities["default_vm2"], two);
}

/// kvirt's own daemon probes QEMU as kvirt's user, then goes: a daemon
/// left by a kvirtd that died mid-probe is stopped first.
#[tokio::test]
async fn the_capability_probe_runs_as_kvirt_and_stops() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.refresh_capabilities().await.unwrap();
    let calls = host.take_calls();
    assert_eq!(
        calls,
        [
            "mkdir probe 999",
            "stop kvirt-probe.service",
            "start kvirt-probe.service",
            "probe qemu:///session?socket=/run/kvirt/probe/libvirt/virtqemud-sock",
            "stop kvirt-probe.service",
        ]
    );
    let spec = host.state().unit_specs["kvirt-probe.service"].clone();
    assert!(spec.properties.contains(&Prop::Str("User", "kvirt".into())));
    // A failed probe still stops the daemon, and says why.
    host.fail("probe");
    assert!(ctl.refresh_capabilities().await.is_err());
    assert_eq!(
        host.take_calls().last().map(String::as_str),
        Some("stop kvirt-probe.service")
    );
}

/// What the VMI's `Ready` condition says.
fn ready_message(host: &FakeHost, name: &str) -> String {
    host.state().statuses[&VmKey::new("default", name).unwrap()]
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .and_then(|c| c.message.clone())
        .unwrap_or_default()
}

fn condition(host: &FakeHost, name: &str, type_: &str) -> Option<(String, Option<String>)> {
    host.state().statuses[&VmKey::new("default", name).unwrap()]
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

#[tokio::test]
async fn pause_unpause_and_start_paused_show_as_kubevirt_shows_them() {
    use kvirt::daemon::controller::{VmiAction, VmiView};
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[
        vmi("vm1", "u1", ""),
        vmi("vm2", "u2", "  startStrategy: Paused\n"),
    ]))
    .await;
    // Not running yet: nothing to pause.
    let early = ctl.act("default_vm1", VmiAction::Pause).await.unwrap_err();
    assert!(early.contains("not running"), "{early}");
    ctl.reconcile("default_vm1").await.unwrap();
    ctl.reconcile("default_vm2").await.unwrap();
    assert_eq!(condition(&host, "vm1", "Ready").unwrap().0, "True");
    // Started paused: Running, Paused, not Ready.
    assert_eq!(phase(&host, "vm2"), Some(Phase::Running));
    assert_eq!(
        condition(&host, "vm2", "Paused"),
        Some(("True".into(), Some("PausedStartStrategy".into())))
    );
    assert_eq!(condition(&host, "vm2", "Ready").unwrap().0, "False");

    // Paused on request: the same, with the user's reason; its domain
    // event makes the next pass.
    ctl.act("default_vm1", VmiAction::Pause).await.unwrap();
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert_eq!(
        condition(&host, "vm1", "Paused"),
        Some(("True".into(), Some("PausedByUser".into())))
    );
    assert_eq!(
        condition(&host, "vm1", "Ready"),
        Some(("False".into(), Some("Paused".into())))
    );
    let twice = ctl.act("default_vm1", VmiAction::Pause).await.unwrap_err();
    assert!(twice.contains("already paused"), "{twice}");
    let reboot = ctl
        .act("default_vm1", VmiAction::SoftReboot)
        .await
        .unwrap_err();
    assert!(reboot.contains("unpause it first"), "{reboot}");

    ctl.act("default_vm1", VmiAction::Unpause).await.unwrap();
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(condition(&host, "vm1", "Paused"), None);
    assert_eq!(condition(&host, "vm1", "Ready").unwrap().0, "True");
    ctl.act("default_vm1", VmiAction::SoftReboot).await.unwrap();
    assert!(host
        .take_calls()
        .iter()
        .any(|c| c == "soft-reboot default_vm1"));

    // QEMU pausing the guest by itself (a disk error) shows the same way.
    {
        let mut s = host.state();
        let dom = s.domains.get_mut("default_vm1").unwrap();
        dom.state = DomainState::Paused;
        dom.paused = Some("PausedIOError".into());
    }
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert_eq!(
        condition(&host, "vm1", "Paused"),
        Some(("True".into(), Some("PausedIOError".into())))
    );
    assert_eq!(condition(&host, "vm1", "Ready").unwrap().0, "False");
    let unknown = ctl.act("default_vm9", VmiAction::Pause).await.unwrap_err();
    assert!(unknown.contains("no VMI"), "{unknown}");
}

/// A VMI whose only disk is the claim `claim`.
fn with_claim(name: &str, uid: &str, claim: &str) -> VirtualMachineInstance {
    VirtualMachineInstance::from_yaml(&format!(
        "apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {{name: {name}, namespace: default, uid: {uid}}}\nspec:\n  terminationGracePeriodSeconds: 2\n  domain:\n    memory: {{guest: 64Mi}}\n    devices: {{disks: [{{name: d}}]}}\n  volumes: [{{name: d, persistentVolumeClaim: {{claimName: {claim}}}}}]\n"
    ))
    .unwrap()
}

/// A claim of `default` as the cluster has it: `phase`, and bound to a PV
/// whose spec is `pv_spec` (a flow map).
fn put_claim(host: &FakeHost, name: &str, phase: &str, pv_spec: &str) {
    let pvc = serde_norway::from_str(&format!(
        "metadata: {{name: {name}, namespace: default}}\nspec: {{accessModes: [ReadWriteOnce], volumeName: pv-{name}, resources: {{requests: {{storage: 1Gi}}}}}}\nstatus: {{phase: {phase}, capacity: {{storage: 1Gi}}}}"
    ))
    .unwrap();
    let pv =
        serde_norway::from_str(&format!("metadata: {{name: pv-{name}}}\nspec: {pv_spec}")).unwrap();
    host.state().claims.insert(
        ("default".into(), name.into()),
        kvirt::sources::ClaimObjects {
            pvc: Some(pvc),
            pv: Some(pv),
            binding_mode: None,
        },
    );
}

/// Claims, by the scripted API: a claim this host cannot reach fails its
/// VMI with the claim's reason and makes nothing; an unbound one waits; a
/// reachable one is held before anything is made, is the disk, and is let
/// go when the VMI goes, before the VMI itself.
#[tokio::test]
async fn claims_are_held_while_used_and_an_unreachable_one_fails_with_its_reason() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let here = "{local: {path: /var/lib/kvirt/claims/data}, nodeAffinity: {required: {nodeSelectorTerms: [{matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [node-1]}]}]}}}";
    put_claim(&host, "data", "Bound", here);
    put_claim(
        &host,
        "far",
        "Bound",
        "{csi: {driver: ebs.csi.aws.com, volumeHandle: v}}",
    );
    put_claim(&host, "later", "Pending", here);
    let good = with_claim("good", "u1", "data");
    ctl.set_vmis(set(&[
        good.clone(),
        with_claim("cloud", "u2", "far"),
        with_claim("waiting", "u3", "later"),
    ]))
    .await;

    ctl.reconcile("default_cloud").await.unwrap();
    assert_eq!(phase(&host, "cloud"), Some(Phase::Failed));
    let st = host.state().statuses[&VmKey::new("default", "cloud").unwrap()].clone();
    let sync = st
        .status
        .conditions
        .iter()
        .find(|c| c.type_ == "Synchronized")
        .unwrap();
    assert_eq!(sync.reason.as_deref(), Some("PVCNotSupported"));
    assert!(sync
        .message
        .as_deref()
        .unwrap_or("")
        .contains("csi (driver ebs.csi.aws.com)"));
    let calls = host.take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.contains("default_cloud") || c.contains("hold claim")),
        "{calls:?}"
    );

    let err = ctl.reconcile("default_waiting").await.unwrap_err();
    assert_eq!(err.reason(), "claims");
    waits_with_nothing_made(&host, "waiting", EventReason::PVCNotBound);

    ctl.reconcile("default_good").await.unwrap();
    assert_eq!(phase(&host, "good"), Some(Phase::Running));
    let calls = host.take_calls();
    let first_host_call = calls
        .iter()
        .position(|c| c.contains("default_good"))
        .unwrap();
    let held = calls
        .iter()
        .position(|c| c == "hold claim default/data")
        .unwrap();
    assert!(
        held < first_host_call,
        "held before anything is made: {calls:?}"
    );
    let users = host.state().claim_users[&("default".to_owned(), "data".to_owned())].clone();
    assert_eq!(users.len(), 1);
    assert_eq!(
        (users[0].node.as_str(), users[0].uid.as_str()),
        ("node-1", "u1")
    );
    let st = host.state().statuses[&VmKey::new("default", "good").unwrap()].clone();
    let vs = &st.status.extra["volumeStatus"][0];
    assert_eq!(vs["persistentVolumeClaimInfo"]["claimName"], "data");
    // A disk without a bus is SATA, KubeVirt's default on amd64.
    assert_eq!(vs["target"], "sda");

    let mut deleting = good.clone();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::now()),
    );
    ctl.set_vmis(set(&[deleting])).await;
    ctl.reconcile("default_good").await.unwrap();
    let calls = host.take_calls();
    let released = calls
        .iter()
        .position(|c| c == "release claim default/data")
        .unwrap();
    assert_eq!(
        calls.get(released + 1).map(String::as_str),
        Some("release default/good"),
        "{calls:?}"
    );
    assert!(host.state().claim_users[&("default".to_owned(), "data".to_owned())].is_empty());
}

/// Standalone, the configured claims are all there are: a VM naming one
/// runs; kvirtd restarted with that claim configured away leaves the
/// running VM alone, and only a new start is refused.
#[tokio::test]
async fn a_claim_configured_away_never_stops_the_vm_that_uses_it() {
    let host = FakeHost::default();
    let roots = vec![std::path::PathBuf::from("/var/lib/kvirt/claims")];
    let data = kvirt::core::pvc::configured(
        "data",
        "/var/lib/kvirt/claims/data",
        "Filesystem",
        Some("1Gi"),
        false,
        &roots,
    )
    .unwrap();
    let standalone = |claims: Vec<kvirt::core::pvc::Pvc>| Settings {
        cluster: false,
        claims: kvirt::core::convert::Claims::known(
            claims.into_iter().map(|c| (c.name.clone(), c)).collect(),
            0.055,
        ),
        ..settings()
    };
    let ctl = Controller::new(host.deps(), standalone(vec![data]));
    ctl.set_vmis(set(&[with_claim("vm1", "u1", "data")])).await;
    ctl.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    assert!(host
        .state()
        .disks
        .iter()
        .any(|d| matches!(d, DiskPrep::Claim { .. })));

    let restarted = Controller::new(host.deps(), standalone(vec![]));
    restarted
        .set_vmis(set(&[
            with_claim("vm1", "u1", "data"),
            with_claim("vm2", "u2", "data"),
        ]))
        .await;
    host.take_calls();
    restarted.reconcile("default_vm1").await.unwrap();
    assert_eq!(phase(&host, "vm1"), Some(Phase::Running));
    let calls = host.take_calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.starts_with("stop") || c.starts_with("shutdown")),
        "{calls:?}"
    );
    restarted.reconcile("default_vm2").await.unwrap();
    assert_eq!(phase(&host, "vm2"), Some(Phase::Failed));
}

/// What a unit was started with as `AllowedCPUs`, as a CPU list.
fn unit_cpus(host: &FakeHost, id: &str) -> Option<String> {
    let s = host.state();
    let spec = s.unit_specs.get(&format!("kvirt-vm@{id}.service"))?;
    spec.properties.iter().find_map(|p| match p {
        Prop::Bytes("AllowedCPUs", mask) => Some(CpuSet::from_mask(mask).to_string()),
        _ => None,
    })
}

fn dedicated(name: &str, uid: &str, cores: u32) -> VirtualMachineInstance {
    let mut v = vmi(name, uid, "");
    v.spec.domain.cpu = Some(
        serde_json::from_value(serde_json::json!({"cores": cores, "dedicatedCpuPlacement": true}))
            .unwrap(),
    );
    v
}

#[tokio::test]
async fn dedicated_cpus_are_held_alone_refused_with_the_numbers_and_kept_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dedicated-cpus.json");
    let (pool, online): (CpuSet, CpuSet) = ("1-3".parse().unwrap(), "0-3".parse().unwrap());
    let open = || Arc::new(DedicatedCpus::open(&file, pool.clone(), online.clone()).unwrap());
    let host = FakeHost::default();
    host.state().cpus = Some(open());
    let (_ctl, tx, task) = running_loop(&host);
    let (a, b, s) = (
        dedicated("a", "ua", 2),
        dedicated("b", "ub", 1),
        vmi("s", "us", ""),
    );
    tx.send(Trigger::Vmis(set(&[a.clone(), b.clone(), s.clone()])))
        .unwrap();
    let running = |n: &str| phase(&host, n) == Some(Phase::Running);
    wait_for(|| running("a") && running("b") && running("s")).await;
    // Disjoint, and the VM without dedicated CPUs on what is left.
    let (ca, cb) = (
        unit_cpus(&host, "default_a").unwrap(),
        unit_cpus(&host, "default_b").unwrap(),
    );
    let (ca, cb): (CpuSet, CpuSet) = (ca.parse().unwrap(), cb.parse().unwrap());
    assert_eq!((ca.len(), cb.len()), (2, 1));
    assert!(ca.is_disjoint(&cb) && pool.minus(&ca).minus(&cb).is_empty());
    let calls = host.take_calls();
    assert!(
        calls.contains(&"cpus kvirt-vm@default_s.service 0".to_string()),
        "{calls:?}"
    );

    // None left: the next one waits, with the numbers, nothing made.
    let c = dedicated("c", "uc", 1);
    let all = [a.clone(), b.clone(), s.clone(), c.clone()];
    tx.send(Trigger::Vmis(set(&all))).unwrap();
    let waits = || {
        host.state()
            .events
            .iter()
            .any(|e| e.1 == EventReason::FailedScheduling)
    };
    wait_for(waits).await;
    assert_ne!(phase(&host, "c"), Some(Phase::Failed));
    assert_eq!(
        condition(&host, "c", "Ready"),
        Some(("False".into(), Some("FailedScheduling".into())))
    );
    let st = host.state().statuses[&VmKey::new("default", "c").unwrap()].clone();
    let ready = st.status.conditions.iter().find(|c| c.type_ == "Ready");
    let why = ready.and_then(|c| c.message.clone()).unwrap_or_default();
    assert!(
        why.contains(
            "needs 1 dedicated CPUs, but only 0 of this host's 3 dedicated CPUs (1-3) are free"
        ),
        "{why}"
    );
    assert!(!host
        .take_calls()
        .iter()
        .any(|c| c.contains("start kvirt-vm@default_c")));

    // kvirtd restarts: every VM keeps its CPUs, none is touched.
    drop(tx);
    task.abort();
    host.state().cpus = Some(open());
    let (after, tx, task) = running_loop(&host);
    after.converge_cpus().await;
    tx.send(Trigger::Vmis(set(&all))).unwrap();
    wait_for(|| running("a") && running("b")).await;
    let held = host.deps().cpus;
    assert_eq!(
        (held.held_by("default_a"), held.held_by("default_b")),
        (Some(ca.clone()), Some(cb))
    );
    assert!(!host
        .take_calls()
        .iter()
        .any(|c| c.starts_with("stop") || c.starts_with("define")));

    // A unit moved onto a held CPU by hand is moved back on its next pass.
    host.take_calls();
    if let Some(u) = host.state().units.get_mut("kvirt-vm@default_s.service") {
        u.allowed_cpus = Some("0-3".parse().unwrap());
    }
    tx.send(Trigger::Vm("default_s".into())).unwrap();
    let moved = || {
        host.state()
            .calls
            .contains(&"cpus kvirt-vm@default_s.service 0".to_string())
    };
    wait_for(moved).await;

    // a goes: its CPUs are let go, and the waiting VM starts on one of them.
    tx.send(Trigger::Vmis(set(&[b.clone(), s.clone(), c.clone()])))
        .unwrap();
    wait_for(|| running("c")).await;
    let cc: CpuSet = unit_cpus(&host, "default_c").unwrap().parse().unwrap();
    assert_eq!(cc.len(), 1);
    assert!(ca.and(&cc) == cc, "{cc} within {ca}");
    assert_eq!(held.held_by("default_a"), None);
    drop(tx);
    task.abort();
}

#[tokio::test]
async fn a_host_that_dedicates_no_cpus_refuses_a_vmi_asking_for_them() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    ctl.set_vmis(set(&[dedicated("d", "ud", 1), vmi("s", "us", "")]))
        .await;
    ctl.reconcile("default_d").await.unwrap();
    ctl.reconcile("default_s").await.unwrap();
    let why = refused(&host, "default", "d");
    assert!(
        why.contains("this host dedicates no CPUs to VMs (vm.dedicated_cpus"),
        "{why}"
    );
    // The others run on any CPU, as before.
    assert_eq!(phase(&host, "s"), Some(Phase::Running));
    assert_eq!(unit_cpus(&host, "default_s"), None);
}

#[tokio::test]
async fn a_running_vm_keeps_running_when_its_host_stops_dedicating_cpus() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dedicated-cpus.json");
    let (pool, online): (CpuSet, CpuSet) = ("1-3".parse().unwrap(), "0-3".parse().unwrap());
    let host = FakeHost::default();
    host.state().cpus = Some(Arc::new(DedicatedCpus::open(&file, pool, online).unwrap()));
    let before = controller(&host);
    before.set_vmis(set(&[dedicated("a", "ua", 2)])).await;
    before.reconcile("default_a").await.unwrap();
    assert_eq!(phase(&host, "a"), Some(Phase::Running));

    // kvirtd comes back with vm.dedicated_cpus emptied: the VM runs on.
    host.state().cpus = None;
    let after = controller(&host);
    after.set_vmis(set(&[dedicated("a", "ua", 2)])).await;
    host.take_calls();
    after.reconcile("default_a").await.unwrap();
    assert_eq!(phase(&host, "a"), Some(Phase::Running));
    let calls = host.take_calls();
    assert!(
        !calls.iter().any(|c| c.starts_with("stop")
            || c.starts_with("shutdown")
            || c.starts_with("destroy")),
        "{calls:?}"
    );
}

fn with_networks(name: &str, uid: &str, networks: &[&str]) -> VirtualMachineInstance {
    let mut v = vmi(name, uid, "");
    let mut ifaces = vec![serde_json::json!({"name": "default", "masquerade": {}})];
    let mut nets = vec![serde_json::json!({"name": "default", "pod": {}})];
    for (i, n) in networks.iter().enumerate() {
        let name = format!("net{i}");
        ifaces.push(serde_json::json!({"name": name, "bridge": {}}));
        nets.push(serde_json::json!({"name": name, "multus": {"networkName": n}}));
    }
    v.spec.domain.devices.interfaces = serde_json::from_value(ifaces.into()).unwrap();
    v.spec.networks = serde_json::from_value(nets.into()).unwrap();
    v
}

#[tokio::test]
async fn secondary_networks_are_resolved_at_start_and_a_bad_one_is_waited_for() {
    let host = FakeHost::default();
    let ctl = controller(&host);
    let nad = |ns: &str, name: &str, config: &str, resource: Option<&str>| {
        let mut data: kvirt::core::objects::ObjectData =
            [("config".to_string(), config.as_bytes().to_vec())].into();
        if let Some(r) = resource {
            data.insert("resourceName".into(), r.as_bytes().to_vec());
        }
        host.state().objects.insert(
            (
                ns.into(),
                ObjectRef::NetworkAttachmentDefinition(name.into()),
            ),
            data,
        );
    };
    let bridge = r#"{"cniVersion":"1.0.0","type":"bridge","bridge":"br1"}"#;
    nad("default", "blue", bridge, None);
    nad("infra", "red", bridge, None);
    nad("default", "sriov", bridge, Some("intel.com/sriov"));
    nad(
        "default",
        "broken",
        r#"{"cniVersion":"1.0.0","type":"../../bin/sh"}"#,
        None,
    );
    nad("default", "named", "", None);
    host.state().cni_files.insert(
        "named".into(),
        r#"{"cniVersion":"0.3.1","name":"named","type":"ptp"}"#.into(),
    );
    ctl.set_vmis(set(&[
        with_networks("ok", "u1", &["blue", "named"]),
        with_networks("missing", "u2", &["green"]),
        with_networks("foreign", "u3", &["infra/red"]),
        with_networks("device", "u4", &["sriov"]),
        with_networks("bad", "u5", &["broken"]),
    ]))
    .await;

    for (vm, why) in [
        (
            "missing",
            "network-attachment-definition default/green not found",
        ),
        (
            "foreign",
            "may be used only from network.cni_global_namespaces",
        ),
        ("device", "device resource \"intel.com/sriov\""),
        (
            "bad",
            "plugins[0].type \"../../bin/sh\" is not a plugin's file name",
        ),
    ] {
        let err = ctl.reconcile(&format!("default_{vm}")).await.unwrap_err();
        assert!(err.to_string().contains(why), "{vm}: {err}");
        let message = waits_with_nothing_made(&host, vm, EventReason::FailedCreatePodSandBox);
        assert!(message.contains(why), "{vm}: {message}");
    }
    ctl.reconcile("default_ok").await.unwrap();
    assert_eq!(phase(&host, "ok"), Some(Phase::Running));
    assert_eq!(
        host.state().attached["default_ok"],
        ["blue", "named"],
        "the NAD's config, and the named file's"
    );
    let st = host.state().statuses[&VmKey::new("default", "ok").unwrap()].clone();
    let ifaces: Vec<(String, String)> = st
        .status
        .interfaces
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap().to_owned(),
                i["podInterfaceName"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        ifaces,
        [
            ("default".to_owned(), "eth0".to_owned()),
            ("net0".to_owned(), kvirt::core::cni::pod_iface_name("net0")),
            ("net1".to_owned(), kvirt::core::cni::pod_iface_name("net1")),
        ]
    );
    let ips: Vec<&str> = st
        .status
        .interfaces
        .iter()
        .filter_map(|i| i["ipAddress"].as_str())
        .collect();
    assert_eq!(ips[1..], ["10.99.0.10", "10.99.1.10"]);
    // Multus's network-status, as on a pod.
    let ns: serde_json::Value = serde_json::from_str(
        &st.metadata.annotations.as_ref().unwrap()["k8s.v1.cni.cncf.io/network-status"],
    )
    .unwrap();
    assert_eq!(ns[0]["default"], true);
    assert_eq!(ns[1]["name"], "default/blue");
    assert_eq!(ns[1]["ips"], serde_json::json!(["10.99.0.10"]));
    assert_eq!(ns[2]["name"], "default/named");
    // Gone: its attachments go with it.
    ctl.set_vmis(set(&[])).await;
    ctl.reconcile("default_ok").await.unwrap();
    assert!(!host.state().attached.contains_key("default_ok"));
}
