//! Property tests of everything that reads untrusted bytes: a guest's DHCP
//! packets, VMI manifests, kvirtd's own state files (a crash can leave any
//! prefix of them). Whatever the input: no panic, and bounded output.
//!
//! The suite runs a short pass; `PROPTEST_CASES=20000 cargo test --test
//! fuzz` (the README's fuzz command) runs a long one.

use dhcproto::v4::{Message, Opcode};
use dhcproto::Encodable;
use kvirt::core::convert::{convert, ConvertContext, DomainType, HostCapacity};
use kvirt::core::dhcp::{handle_datagram, LeaseConfig};
use kvirt::core::identity::{IdRange, Identities};
use kvirt::core::ipam::{Leases, Subnet};
use kvirt::core::key::VmKey;
use kvirt::core::layout::{HostLayout, VmPaths};
use kvirt::core::plan::{plan, Desired, DomainObs, DomainState, Observed, UnitActivity, UnitObs};
use kvirt::core::quantity::{parse_bytes, parse_millis};
use kvirt::core::status::next_status;
use kvirt::core::vmi::VirtualMachineInstance;
use proptest::prelude::*;
use std::net::Ipv4Addr;

const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];

/// A real DISCOVER from our guest, as the seed mutations start from.
fn discover() -> Vec<u8> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest).set_chaddr(&MAC);
    m.opts_mut().insert(dhcproto::v4::DhcpOption::MessageType(
        dhcproto::v4::MessageType::Discover,
    ));
    m.to_vec().unwrap()
}

const VMI: &str = "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: vm, namespace: ns, uid: 0f2d3a9c-1111-4222-8333-444455556666}
spec:
  domain:
    memory: {guest: 64Mi}
    cpu: {cores: 2}
    devices:
      disks:
      - name: boot
        disk: {bus: virtio}
      interfaces:
      - name: default
        masquerade: {}
  networks:
  - name: default
    pod: {}
  volumes:
  - name: boot
    hostDisk: {path: /srv/vms/a.img, type: Disk}
";

/// Quantities as a VMI author may write them: numbers of any size with any
/// suffix, and text that is no quantity at all.
fn quantity() -> impl Strategy<Value = String> {
    prop_oneof![
        (
            any::<u64>(),
            proptest::sample::select(vec![
                "", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "m", "e3", "e18"
            ])
        )
            .prop_map(|(n, s)| format!("{n}{s}")),
        "[0-9.eE+-]{0,24}[a-zA-Z]{0,3}",
    ]
}

/// The context a host with 64 GiB and 64 CPUs converts in.
fn context<'a>(key: &'a VmKey, paths: &'a VmPaths) -> ConvertContext<'a> {
    ConvertContext {
        key,
        paths,
        domain_type: DomainType::Qemu,
        host_disk_roots: &[],
        shared_roots: &[],
        cluster: false,
        capacity: Some(HostCapacity {
            memory_bytes: 64 << 30,
            cpus: 64,
        }),
        limits: kvirt::core::convert::Limits::default(),
        claims: &kvirt::core::convert::NO_CLAIMS,
        dedicated_cpus: None,
    }
}

/// Converts whatever parsed; the XML is bounded by the input's size.
fn convert_any(vmi: &VirtualMachineInstance, input_len: usize) {
    let Ok(key) = vmi.key() else { return };
    let paths = HostLayout::default().vm(&key);
    let ctx = ConvertContext {
        host_disk_roots: &["/srv/vms".into()],
        shared_roots: &[],
        ..context(&key, &paths)
    };
    if let Ok(c) = convert(vmi, &ctx) {
        assert!(
            c.domain_xml.len() < 64 * 1024 + 64 * input_len,
            "{} bytes of XML from {input_len} bytes",
            c.domain_xml.len()
        );
    }
}

/// `base` with up to 8 bytes overwritten, inserted or cut.
fn mutated(base: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    let n = base.len();
    proptest::collection::vec((0..n.max(1), any::<u8>(), 0..3u8), 0..8).prop_map(move |edits| {
        let mut b = base.clone();
        for (at, byte, how) in edits {
            let at = at.min(b.len());
            match how {
                0 if at < b.len() => b[at] = byte,
                1 => b.insert(at, byte),
                _ => b.truncate(at.max(1)),
            }
        }
        b
    })
}

proptest! {
    // Cases from PROPTEST_CASES (256 by default); a failure prints its
    // minimal input rather than writing a file into the tree.
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn dhcp_answers_any_packet_without_panicking(
        bytes in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..600),
            mutated(discover()),
        ]
    ) {
        let lease = LeaseConfig::masquerade(MAC, vec![Ipv4Addr::new(10, 0, 2, 3)], 1500);
        // What the server does with each datagram.
        if let Ok(Some((_, reply, _))) = handle_datagram(&bytes, &lease) {
            // A reply fits one Ethernet frame, and goes to our guest only.
            let wire = reply.to_vec().unwrap();
            prop_assert!(wire.len() <= 1500, "{} bytes", wire.len());
            prop_assert_eq!(reply.chaddr(), &MAC[..]);
        }
    }

    #[test]
    fn any_manifest_parses_and_converts_or_is_refused(
        bytes in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..400),
            mutated(VMI.as_bytes().to_vec()),
        ]
    ) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(vmi) = VirtualMachineInstance::from_yaml(&text) {
            convert_any(&vmi, bytes.len());
        }
        if let Ok(vmi) = VirtualMachineInstance::from_json(&text) {
            convert_any(&vmi, bytes.len());
        }
    }

    #[test]
    fn any_field_values_convert_plan_and_report_without_panicking(
        grace in prop_oneof![-5i64..100_000, any::<i64>()],
        memory in quantity(),
        cores in prop_oneof![0i64..300, any::<i64>()],
        sockets in prop_oneof![0i64..10, any::<i64>()],
        disk in quantity(),
        cpu_limit in quantity(),
        phase in proptest::sample::select(vec!["", "Pending", "Scheduled", "Running", "Succeeded", "Failed"]),
        state in 0usize..6,
    ) {
        let yaml = format!(
            "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {{name: vm, namespace: ns, uid: u1}}
spec:
  terminationGracePeriodSeconds: {grace}
  domain:
    memory: {{guest: \"{memory}\"}}
    cpu: {{cores: {cores}, sockets: {sockets}}}
    resources: {{limits: {{cpu: \"{cpu_limit}\"}}}}
    devices: {{disks: [{{name: a}}]}}
  volumes: [{{name: a, emptyDisk: {{capacity: \"{disk}\"}}}}]
status: {{phase: \"{phase}\"}}
"
        );
        let Ok(vmi) = VirtualMachineInstance::from_yaml(&yaml) else { return Ok(()) };
        convert_any(&vmi, yaml.len());
        let key = vmi.key().unwrap();
        let paths = HostLayout::default().vm(&key);
        let invalid = convert(&vmi, &context(&key, &paths)).err().map(|e| e.to_string());
        let desired = Desired {
            uid: "u1".into(),
            grace: vmi.termination_grace_period(),
            phase: vmi.status.phase,
            invalid,
            migrating: None,
            fenced: None,
        };
        let states = [DomainState::Running, DomainState::Paused, DomainState::Shutdown,
                      DomainState::Crashed, DomainState::Shutoff, DomainState::Other];
        let obs = Observed {
            unit: Some(UnitObs {
                activity: UnitActivity::Active,
                uid: Some("u1".into()),
                daemon: None,
                grace: Some(vmi.termination_grace_period()),
                domain_name: None,
                result: String::new(),
                restarts: 0,
                main_pid: None,
                allowed_cpus: None,
                shared_disks: false,
            }),
            domain: Some(DomainObs {
                state: states[state],
                uid: Some("u1".into()),
                paused: None,
                machine: None,
                agent: false,
            }),
            ..Observed::default()
        };
        for (d, o) in [(Some(&desired), &obs), (None, &obs), (Some(&desired), &Observed::default())] {
            let p = plan(d, o);
            let _ = next_status(&vmi.status, &p.outcome, "node", "2026-01-01T00:00:00Z");
        }
    }

    #[test]
    fn state_files_are_read_or_refused_never_trusted_blindly(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        cut in 0usize..200,
    ) {
        let subnet = Subnet::new(Ipv4Addr::new(10, 213, 0, 0), 24).unwrap();
        let range = IdRange::new(0x7000_0000, 0x7000_0100).unwrap();
        let _ = Leases::decode(&bytes, subnet);
        let _ = Identities::decode(&bytes, range);
        // Any prefix of a good file (a crash mid-write without the rename).
        let mut good = Leases::new(subnet);
        let _ = good.allocate("ns_vm", "u1");
        let text = good.encode();
        let _ = Leases::decode(&text[..cut.min(text.len())], subnet);
    }

    #[test]
    fn quantities_and_keys_parse_or_are_refused(s in ".{0,40}") {
        let _ = parse_bytes(&s);
        let _ = parse_millis(&s);
        if let Ok(k) = VmKey::parse(&s) {
            prop_assert!(k.id().len() <= 238);
        }
    }
}
