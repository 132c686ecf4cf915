//! Converts every VMI in `tests/fixtures/vmis/` and compares with the
//! snapshot in `tests/snapshots/`; produced XML must pass libvirt's own
//! schema (`virt-xml-validate`).
//!
//! Fixture conventions, in leading comments:
//! - `# expect-error: FIELD` (repeatable): conversion must fail with exactly
//!   these error fields, in order;
//! - `# domain-type: qemu`: convert for TCG instead of KVM;
//! - `# source: directory`: convert as a standalone kvirtd (no cluster
//!   objects); the default is a cluster's VMI.
//!
//! Update snapshots with `INSTA_UPDATE=always cargo test --test convert`
//! (or `cargo insta review`) and review the diff.

use kvirt::core::convert::{convert, convert_all_errors, ConvertContext, DomainType};
use kvirt::core::layout::HostLayout;
use kvirt::core::vmi::VirtualMachineInstance;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const HOST_DISK_ROOT: &str = "/srv/vms";

struct Fixture {
    name: String,
    yaml: String,
    expect_errors: Vec<String>,
    domain_type: DomainType,
    cluster: bool,
}

fn fixtures() -> Vec<Fixture> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vmis");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 10, "fixtures missing in {}", dir.display());
    paths
        .into_iter()
        .map(|p| {
            let yaml = std::fs::read_to_string(&p).unwrap();
            let directive = |name: &str| -> Vec<String> {
                yaml.lines()
                    .filter_map(|l| l.strip_prefix(&format!("# {name}:")))
                    .map(|v| v.trim().to_owned())
                    .collect()
            };
            let domain_type = match directive("domain-type").first().map(String::as_str) {
                None | Some("kvm") => DomainType::Kvm,
                Some("qemu") => DomainType::Qemu,
                Some(other) => panic!("{}: unknown domain-type {other}", p.display()),
            };
            let cluster = match directive("source").first().map(String::as_str) {
                None | Some("cluster") => true,
                Some("directory") => false,
                Some(other) => panic!("{}: unknown source {other}", p.display()),
            };
            Fixture {
                cluster,
                name: p.file_stem().unwrap().to_string_lossy().into_owned(),
                expect_errors: directive("expect-error"),
                domain_type,
                yaml,
            }
        })
        .collect()
}

/// `[storage.claims]` of the fixtures' standalone host.
fn configured_claims() -> kvirt::core::convert::Claims {
    use kvirt::core::pvc::configured;
    let roots = [PathBuf::from("/var/lib/kvirt/claims")];
    let data = configured(
        "data",
        "/var/lib/kvirt/claims/data",
        "Filesystem",
        Some("2Gi"),
        false,
        &roots,
    );
    let base = configured(
        "base",
        "/var/lib/kvirt/claims/base",
        "Filesystem",
        None,
        true,
        &roots,
    );
    let fast = configured("fast", "/dev/loop7", "Block", None, false, &roots);
    let by_name = [data, base, fast]
        .into_iter()
        .map(|c| {
            let c = c.unwrap();
            (c.name.clone(), c)
        })
        .collect();
    kvirt::core::convert::Claims::known(by_name, 0.055)
}

fn convert_fixture(
    f: &Fixture,
) -> Result<kvirt::core::convert::Converted, Vec<kvirt::core::convert::ConvertError>> {
    let vmi =
        VirtualMachineInstance::from_yaml(&f.yaml).unwrap_or_else(|e| panic!("{}: {e}", f.name));
    let key = vmi.key().unwrap();
    let paths = HostLayout::default().vm(&key);
    let roots = [PathBuf::from(HOST_DISK_ROOT)];
    // Standalone, the host's configured claims are all there are; in a
    // cluster each start reads its own (not here).
    let claims = if f.cluster {
        kvirt::core::convert::NO_CLAIMS.clone()
    } else {
        configured_claims()
    };
    // Dedicated CPUs as a host dedicating 4-7 would place them.
    let placed: Option<kvirt::core::cpuset::CpuSet> =
        kvirt::core::convert::dedicated_cpus_wanted(&vmi).map(|n| (4..4 + n).collect());
    let ctx = ConvertContext {
        key: &key,
        paths: &paths,
        domain_type: f.domain_type,
        host_disk_roots: &roots,
        shared_roots: &[],
        cluster: f.cluster,
        capacity: None,
        limits: kvirt::core::convert::Limits::default(),
        claims: &claims,
        dedicated_cpus: placed.as_ref(),
    };
    let all = convert_all_errors(&vmi, &ctx);
    // `convert` must agree with `convert_all_errors` and report the first.
    match (&all, convert(&vmi, &ctx)) {
        (Ok(a), Ok(b)) => assert_eq!(a, &b),
        (Err(a), Err(b)) => assert_eq!(a[0], b),
        _ => panic!("{}: convert and convert_all_errors disagree", f.name),
    }
    all
}

fn snapshot(name: &str, body: &str) {
    insta::with_settings!({
        snapshot_path => "snapshots",
        prepend_module_to_snapshot => false,
        omit_expression => true,
    }, {
        insta::assert_snapshot!(name, body);
    });
}

/// Runs libvirt's schema check; skipped (loudly) where libvirt-clients is
/// not installed.
fn validate(name: &str, xml: &str) {
    let mut file = tempfile::Builder::new().suffix(".xml").tempfile().unwrap();
    std::io::Write::write_all(&mut file, xml.as_bytes()).unwrap();
    match Command::new("virt-xml-validate")
        .arg(file.path())
        .arg("domain")
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "{name}: virt-xml-validate failed:\n{}{}\n{xml}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        ),
        // tests/run-all installs it (libvirt-clients); a missing validator
        // must not pass for a valid domain.
        Err(e) => panic!("virt-xml-validate (from libvirt-clients): {e}"),
    }
}

#[test]
fn fixtures_convert_as_snapshotted() {
    for f in fixtures() {
        let body = match convert_fixture(&f) {
            Ok(c) => {
                assert!(
                    f.expect_errors.is_empty(),
                    "{}: converted but expected {:?}",
                    f.name,
                    f.expect_errors
                );
                validate(&f.name, &c.domain_xml);
                let mut body = format!("resources: {:?}\n", c.resources);
                for d in &c.disks {
                    writeln!(body, "prep: {d:?}").unwrap();
                }
                body.push_str("---\n");
                body.push_str(&c.domain_xml);
                body
            }
            Err(errs) => {
                let got: Vec<&str> = errs.iter().map(|e| e.field.as_str()).collect();
                assert_eq!(
                    got, f.expect_errors,
                    "{}: wrong error fields: {errs:#?}",
                    f.name
                );
                errs.iter().map(|e| format!("error: {e}\n")).collect()
            }
        };
        snapshot(&f.name, &body);
    }
}

#[test]
fn vmi_round_trips_through_json() {
    for f in fixtures() {
        let vmi = VirtualMachineInstance::from_yaml(&f.yaml).unwrap();
        let mut untyped: serde_json::Value = serde_norway::from_str(&f.yaml).unwrap();
        // `null` reads as absent and is not written back.
        drop_nulls(&mut untyped);
        assert_eq!(serde_json::to_value(&vmi).unwrap(), untyped, "{}", f.name);
    }
}

fn drop_nulls(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.retain(|_, v| !v.is_null());
            m.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

#[test]
fn error_display_names_the_field() {
    let f = fixtures()
        .into_iter()
        .find(|f| f.name == "bad-lun")
        .unwrap();
    let vmi = VirtualMachineInstance::from_yaml(&f.yaml).unwrap();
    let key = vmi.key().unwrap();
    let paths = HostLayout::default().vm(&key);
    let err = convert(
        &vmi,
        &ConvertContext {
            key: &key,
            paths: &paths,
            domain_type: DomainType::Kvm,
            host_disk_roots: &[PathBuf::from(HOST_DISK_ROOT)],
            shared_roots: &[],
            cluster: false,
            capacity: None,
            limits: kvirt::core::convert::Limits::default(),
            claims: &kvirt::core::convert::NO_CLAIMS,
            dedicated_cpus: None,
        },
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "spec.domain.devices.disks[0].lun: LUN (SCSI passthrough) disks are not supported"
    );
}

/// `kvirtctl domxml` takes every kind that makes VMIs, and `--defaulted`
/// shows the VMI as KubeVirt would have stored it.
#[test]
fn kvirtctl_domxml_takes_every_kind_and_shows_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let ctl = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvirtctl"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let spec = "      domain: {memory: {guest: 64Mi}}\n      volumes: [{name: root, emptyDisk: {capacity: 1Gi}}]\n";
    let vm = dir.path().join("vm.yaml");
    std::fs::write(
        &vm,
        format!("apiVersion: kubevirt.io/v1\nkind: VirtualMachine\nmetadata: {{name: web}}\nspec:\n  runStrategy: Always\n  template:\n    spec:\n{spec}"),
    )
    .unwrap();
    let (ok, xml, err) = ctl(&["domxml", "--domain-type", "qemu", vm.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(xml.contains("<name>default_web</name>"), "{xml}");
    // The volume without a disk is a SATA disk; the VM's UUID is KubeVirt's.
    assert!(xml.contains(r#"<target dev="sda" bus="sata"/>"#), "{xml}");
    assert!(
        xml.contains(&format!(
            "<uuid>{}</uuid>",
            kvirt::core::defaults::vm_firmware_uuid("web")
        )),
        "{xml}"
    );

    let (ok, yaml, err) = ctl(&["domxml", "--defaulted", vm.to_str().unwrap()]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_norway::from_str(&yaml).unwrap();
    assert_eq!(v["kind"], "VirtualMachineInstance");
    assert_eq!(
        v["spec"]["domain"]["devices"]["disks"][0]["disk"]["bus"],
        "sata"
    );
    assert_eq!(
        v["spec"]["domain"]["devices"]["interfaces"][0]["masquerade"],
        serde_json::json!({})
    );
    assert_eq!(v["spec"]["domain"]["machine"]["type"], "q35");
    assert_eq!(v["spec"]["domain"]["cpu"]["model"], "host-model");

    let pool = dir.path().join("pool.yaml");
    std::fs::write(
        &pool,
        format!("apiVersion: pool.kubevirt.io/v1alpha1\nkind: VirtualMachinePool\nmetadata: {{name: p}}\nspec:\n  replicas: 2\n  virtualMachineTemplate:\n    spec:\n      runStrategy: Always\n      template:\n        spec:\n{}", spec.lines().map(|l| format!("    {l}\n")).collect::<String>()),
    )
    .unwrap();
    let (ok, xml, err) = ctl(&["domxml", "--domain-type", "qemu", pool.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(xml.contains("<name>default_p-0</name>"), "{xml}");

    let pod = dir.path().join("pod.yaml");
    std::fs::write(&pod, "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n").unwrap();
    let (ok, _, err) = ctl(&["domxml", pod.to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("none of the kinds kvirt runs"), "{err}");
}

/// The shape of KubeVirt's instancetype examples, in one file: the
/// instancetype and preference beside the VM expand it; a template that
/// also sets the guest's memory is refused as KubeVirt's admission refuses
/// it (its own `vm-cirros-csmall` example does this).
#[test]
fn kvirtctl_domxml_expands_a_vms_instancetype_and_preference() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vm.yaml");
    let vm = |memory: &str| {
        format!(
            "apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachineInstancetype
metadata: {{name: clarge}}
spec: {{cpu: {{guest: 4}}, memory: {{guest: 2Gi}}}}
---
apiVersion: instancetype.kubevirt.io/v1beta1
kind: VirtualMachinePreference
metadata: {{name: virtio}}
spec: {{devices: {{preferredDiskBus: virtio, preferredInterfaceModel: virtio}}}}
---
apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata: {{name: vm-clarge}}
spec:
  instancetype: {{kind: VirtualMachineInstancetype, name: clarge}}
  preference: {{kind: VirtualMachinePreference, name: virtio}}
  runStrategy: Halted
  template:
    spec:
      domain:
        devices:
          disks:
          - {{name: root, disk: {{}}}}
{memory}      volumes:
      - {{name: root, emptyDisk: {{capacity: 1Gi}}}}
"
        )
    };
    std::fs::write(&file, vm("")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvirtctl"))
        .args(["--config", "/dev/null", "domxml", "--domain-type", "qemu"])
        .arg(&file)
        .output()
        .unwrap();
    let xml = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        xml.contains(r#"<vcpu placement="static">4</vcpu>"#),
        "{xml}"
    );
    assert!(
        xml.contains(r#"<topology sockets="4" cores="1" threads="1"/>"#),
        "{xml}"
    );
    assert!(
        xml.contains(r#"<memory unit="b">2147483648</memory>"#),
        "{xml}"
    );
    assert!(xml.contains(r#"<target dev="vda" bus="virtio"/>"#), "{xml}");

    std::fs::write(&file, vm("        memory: {guest: 128Mi}\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvirtctl"))
        .args(["--config", "/dev/null", "domxml"])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("VM field(s) spec.template.spec.domain.memory.guest conflicts with selected instance type"),
        "{err}"
    );
}
