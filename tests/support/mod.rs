//! Driving a booted test host from the tests: shell snippets run inside it
//! as real services, polled conditions with deadlines, the VMs' files.
#![allow(dead_code)]

use std::process::{Command, Output};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Tests sharing a host and its kvirtd run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub const BOOT: Duration = Duration::from_secs(90);

/// Every test VMI: boots the copy of a guest disk named after it.
/// `labels` is a flow-map body, `spec_extra` lines at spec level (two
/// spaces in), `devices_extra` lines under `devices` (six spaces in).
/// The id of the VM `default/<vm>`: its unit's, directories' and status
/// file's name.
pub fn id_of(vm: &str) -> String {
    kvirt::core::key::VmKey::new("default", vm)
        .map(|k| k.id())
        .unwrap_or_else(|_| format!("default_{vm}"))
}

pub fn vmi_manifest(name: &str, labels: &str, spec_extra: &str, devices_extra: &str) -> String {
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {name}
  namespace: default
  labels: {{{labels}}}
spec:
  terminationGracePeriodSeconds: 15
{spec_extra}  domain:
    memory: {{guest: 128Mi}}
    devices:
      disks:
      - name: boot
        disk: {{bus: virtio}}
{devices_extra}  volumes:
  - name: boot
    hostDisk: {{path: /var/lib/kvirt/images/{name}.raw, type: Disk}}
"
    )
}

/// A VirtualMachine whose template is `vmi_manifest`'s (labelled
/// `app: <name>`), with `spec_extra` lines in the template's spec.
pub fn vm_manifest(name: &str, strategy: &str, spec_extra: &str) -> String {
    let vmi = vmi_manifest(name, "", spec_extra, "");
    let spec = vmi.split_once("spec:\n").unwrap().1;
    let template: String = spec.lines().map(|l| format!("    {l}\n")).collect();
    format!(
        "apiVersion: kubevirt.io/v1
kind: VirtualMachine
metadata:
  name: {name}
  namespace: default
spec:
  runStrategy: {strategy}
  template:
    metadata:
      labels: {{app: {name}}}
    spec:
{template}"
    )
}

/// `manifest` (from `vmi_manifest`) with another source for its boot
/// volume than its hostDisk: `source` is one YAML line such as
/// `containerDisk: {image: ...}`.
pub fn with_boot_source(manifest: &str, source: &str) -> String {
    let out: String = manifest
        .lines()
        .map(|l| {
            if l.starts_with("    hostDisk:") {
                format!("    {source}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    assert!(out.contains(source), "{out}");
    out
}

/// The test host whose PID 1 is in the environment variable `var`, or
/// `None` (the test then passes vacuously, saying so).
pub fn host(var: &str) -> Option<Host> {
    match std::env::var(var) {
        Ok(pid) if !pid.is_empty() => Some(Host { pid }),
        _ => {
            eprintln!("skipped: no test host in ${var} (run tests/run-all)");
            None
        }
    }
}

pub struct Host {
    pub pid: String,
}

/// A test's turn on a host. When the test fails, what it left is cleared
/// away (its VMs, a stopped daemon, a stopped kvirtd), so the next test
/// fails only of its own.
pub struct Turn<'a> {
    host: &'a Host,
    _serial: std::sync::MutexGuard<'static, ()>,
    since: Instant,
    wall: std::time::SystemTime,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        record_time(self.since.elapsed());
        if !std::thread::panicking() {
            return;
        }
        // No asserting here: a second panic would abort every test.
        let h = self.host;
        eprintln!(
            "=== the host's journals ===\n{}",
            h.journals_since(self.wall)
        );
        h.sh("pkill -CONT -f 'virtqemud|libvirtd' || true
              systemctl start kvirtd || true
              rm -f /etc/kvirt/vmis.d/*.yaml /etc/kvirt/vmis.d/.*.tmp");
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline
            && !h.succeeds(
                "! systemctl list-units --all --plain --no-legend 'kvirt-vm@*' | grep -q .",
            )
        {
            std::thread::sleep(Duration::from_millis(500));
        }
        h.sh("rm -f /var/lib/kvirt/images/*.raw");
    }
}

/// A cluster test's turn on its two hosts: one such test at a time, and
/// when it fails, what each host's kvirtd and control plane logged during
/// it is printed with the failure (a CI run keeps no host to look at
/// afterwards: an official run's console test once failed with a closed
/// session and a 503, and nothing said which side went away).
pub struct PairTurn<'a> {
    hosts: [&'a Host; 2],
    _serial: std::sync::MutexGuard<'static, ()>,
    since: std::time::SystemTime,
}

pub fn pair_turn<'a>(a: &'a Host, b: &'a Host) -> PairTurn<'a> {
    PairTurn {
        hosts: [a, b],
        _serial: serial(),
        since: std::time::SystemTime::now(),
    }
}

impl Drop for PairTurn<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for (n, h) in self.hosts.iter().enumerate() {
                eprintln!("=== host {n} ===\n{}", h.journals_since(self.since));
            }
        }
    }
}

/// How long a test held its host, appended to `$KVIRT_TEST_TIMES` (one
/// `seconds<TAB>test` line; `tests/run-all` prints the slowest): where the
/// suite's time goes, measured rather than guessed.
fn record_time(took: Duration) {
    let Some(path) = std::env::var_os("KVIRT_TEST_TIMES") else {
        return;
    };
    let name = std::thread::current().name().unwrap_or("?").to_owned();
    let line = format!("{:.1}\t{name}\n", took.as_secs_f64());
    let file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path);
    // One short write per line: lines of tests on other threads never mix.
    let _ = file.and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
}

impl Host {
    /// This test's turn: tests sharing a host and its kvirtd run one at a
    /// time, and a failed one leaves nothing behind.
    pub fn turn(&self) -> Turn<'_> {
        Turn {
            host: self,
            _serial: serial(),
            since: Instant::now(),
            wall: std::time::SystemTime::now(),
        }
    }

    /// Runs a shell snippet inside the host as a real service (the
    /// container's own capabilities, not ours).
    pub fn sh(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.pid, "-a"])
            .args([
                "systemd-run",
                "--wait",
                "--pipe",
                "--quiet",
                "--collect",
                "-E",
                "HOME=/root",
            ])
            .args(["--", "/bin/bash", "-euo", "pipefail", "-c", script])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("nsenter runs")
    }

    /// A registry (Debian's docker-registry) as unit `name` on this host's
    /// loopback `port`, answering once this returns; with `htpasswd` (a
    /// `user:bcrypt` line) it wants a login.
    pub fn start_registry(&self, name: &str, port: u16, htpasswd: Option<&str>) {
        let auth = match htpasswd {
            Some(line) => {
                self.ok(&format!("echo '{line}' >/etc/{name}.htpasswd"));
                format!("auth: {{htpasswd: {{realm: kvirt-test, path: /etc/{name}.htpasswd}}}}\\n")
            }
            None => String::new(),
        };
        self.ok(&format!(
            "mkdir -p /var/lib/{name}
             printf 'version: 0.1\\nlog: {{level: warn, accesslog: {{disabled: true}}}}\\nstorage: {{filesystem: {{rootdirectory: /var/lib/{name}}}}}\\nhttp: {{addr: 127.0.0.1:{port}}}\\n{auth}' >/etc/{name}.yml
             systemctl is-active -q {name} || systemd-run -q --unit={name} docker-registry serve /etc/{name}.yml"
        ));
        self.wait(
            "the registry answering",
            Duration::from_secs(30),
            // 200, or the 401 of one that wants a login (wget fails on it,
            // and pipefail is on).
            &format!("{{ busybox wget -S -O /dev/null http://127.0.0.1:{port}/v2/ 2>&1 || true; }} | grep -q 'HTTP/1.1 [24]0[01]'"),
        );
    }

    /// Runs it and returns stdout, failing the test with everything on error.
    pub fn ok(&self, script: &str) -> String {
        let out = self.sh(script);
        assert!(
            out.status.success(),
            "in test host: {script}\nexit: {:?}\nstdout: {}\nstderr: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// kvirtd's journal since `since` (its last 120 lines), its automatic
    /// restarts (a crash, the watchdog, the memory bound) and, where the
    /// host runs them, the control plane's last lines: for a failure's
    /// report, so never an assertion itself.
    pub fn journals_since(&self, since: std::time::SystemTime) -> String {
        let at = since
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let out = self.sh(&format!(
            "for u in kvirtd kube-apiserver etcd; do
               systemctl show -p Id -p NRestarts -p ActiveEnterTimestamp $u | tr '\\n' ' '; echo
             done
             journalctl --no-pager -o short-precise --since @{at} -u kvirtd | tail -n 120
             echo '--- control plane'
             journalctl --no-pager -o short-precise --since @{at} -u kube-apiserver -u etcd | tail -n 40
             true"
        ));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn succeeds(&self, script: &str) -> bool {
        self.sh(script).status.success()
    }

    /// Polls `script` until it succeeds; on timeout fails with `what` and
    /// what kvirtd and the VMs were doing.
    pub fn wait(&self, what: &str, timeout: Duration, script: &str) {
        self.wait_until(what, timeout, || self.succeeds(script));
    }

    /// Polls `done` until it holds; on timeout fails as `wait` does.
    pub fn wait_until(&self, what: &str, timeout: Duration, done: impl Fn() -> bool) {
        let deadline = Instant::now() + timeout;
        while !done() {
            if Instant::now() > deadline {
                let log = self.sh("journalctl -u kvirtd --no-pager -n 60
                     systemctl list-units 'kvirt-vm@*' --all --no-pager
                     journalctl -u 'kvirt-vm@*' --no-pager -n 40
                     tail -n 20 /run/kvirt/vms/*/console.log || true");
                panic!(
                    "timed out after {timeout:?} waiting for: {what}\n{}",
                    String::from_utf8_lossy(&log.stdout)
                );
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// The VM's status file, read through the host's root.
    pub fn status(&self, vm: &str) -> serde_json::Value {
        self.try_status(vm)
            .unwrap_or_else(|e| panic!("default/{vm}'s status: {e}"))
    }

    pub fn try_status(&self, vm: &str) -> Result<serde_json::Value, String> {
        let id = id_of(vm);
        let path = format!("/proc/{}/root/run/kvirt/status/{id}.json", self.pid);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
        serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
    }

    /// The VM's phase now (`status.phase`; the file also lists past
    /// phases, so a text search cannot tell), None without a status.
    pub fn phase(&self, vm: &str) -> Option<String> {
        let st = self.try_status(vm).ok()?;
        st["status"]["phase"].as_str().map(str::to_owned)
    }

    /// The guest's counter (`KVIRT-GUEST-ALIVE <n>`, one each 2 s) in its
    /// serial log here; empty without a log.
    pub fn guest_counts(&self, vm: &str) -> Vec<u64> {
        self.ok(&format!(
            "grep -ao 'KVIRT-GUEST-ALIVE [0-9]*' /run/kvirt/vms/default_{vm}/console.log 2>/dev/null | cut -d' ' -f2 || true"
        ))
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect()
    }

    /// The guest, which stayed here, counts on past `before`, never
    /// having restarted.
    pub fn assert_counts_on_here(&self, vm: &str, before: u64) {
        self.wait_until("the guest counting on here", BOOT, || {
            self.guest_counts(vm)
                .last()
                .is_some_and(|n| *n > before + 1)
        });
        let after = self.guest_counts(vm);
        assert!(
            after.windows(2).all(|w| w[1] == w[0] + 1),
            "the guest never restarted: {after:?}"
        );
    }

    /// The guest, moved here live, counts on from `before` (its last count
    /// at the other host): the same boot, never restarted.
    pub fn assert_counts_on(&self, vm: &str, before: u64) {
        self.wait_until("the guest counting on here", BOOT, || {
            self.guest_counts(vm).len() >= 2
        });
        let after = self.guest_counts(vm);
        assert!(
            after[0] > before && after.windows(2).all(|w| w[1] == w[0] + 1),
            "the counter goes on from {before}, never restarting: {after:?}"
        );
        self.ok(&format!(
            "! grep -q KVIRT-GUEST-READY /run/kvirt/vms/default_{vm}/console.log"
        ));
    }

    pub fn wait_phase(&self, vm: &str, phase: &str, timeout: Duration) {
        self.wait_until(&format!("{vm} phase {phase}"), timeout, || {
            self.phase(vm).as_deref() == Some(phase)
        });
    }

    /// A VMI booting a copy of one of the test guest disks, dropped into the
    /// manifest directory atomically (as an editor or config tool would).
    pub fn create_vm(&self, vm: &str, disk: &str) {
        self.put_manifest(vm, disk, &vmi_manifest(vm, "", "", ""));
    }

    pub fn put_manifest(&self, vm: &str, disk: &str, manifest: &str) {
        if !disk.is_empty() {
            self.ok(&format!(
                "cp /srv/guest/{disk}.raw /var/lib/kvirt/images/{vm}.raw"
            ));
        }
        self.ok(&format!(
            "cat > /etc/kvirt/vmis.d/.{vm}.tmp <<'MANIFEST'\n{manifest}MANIFEST\nmv /etc/kvirt/vmis.d/.{vm}.tmp /etc/kvirt/vmis.d/{vm}.yaml"
        ));
    }

    pub fn qemu_pid(&self, vm: &str) -> String {
        self.ok(&format!(
            // [q]: the pattern must not match this script's own command line.
            "pgrep -f '[q]emu-system.*guest=default_{vm},' | head -n1"
        ))
    }

    pub fn remove_vm_and_wait_gone(&self, vm: &str) {
        self.ok(&format!("rm -f /etc/kvirt/vmis.d/{vm}.yaml"));
        self.wait_gone(vm);
        self.ok(&format!("rm -f /var/lib/kvirt/images/{vm}.raw"));
    }

    /// Several VMs' manifests removed at once, then each waited for.
    pub fn remove_vms_and_wait_gone(&self, vms: &[String]) {
        let files: Vec<String> = vms
            .iter()
            .map(|vm| format!("/etc/kvirt/vmis.d/{vm}.yaml"))
            .collect();
        self.ok(&format!("rm -f {}", files.join(" ")));
        for vm in vms {
            self.wait_gone(vm);
            self.ok(&format!("rm -f /var/lib/kvirt/images/{vm}.raw"));
        }
    }

    pub fn wait_gone(&self, vm: &str) {
        self.wait(
            &format!("everything of {vm} removed"),
            Duration::from_secs(40),
            &format!(
                "[ \"$(systemctl show -p LoadState --value kvirt-vm@default_{vm}.service)\" = not-found ]
                 ! ip netns list | grep -qw 'kvirt-default_{vm}'
                 [ ! -e /run/netns/kvirt-default_{vm} ]
                 [ ! -e /var/lib/kvirt/vms/default_{vm} ] && [ ! -e /run/kvirt/vms/default_{vm} ]
                 [ ! -e /sys/class/net/kv$(printf %s default_{vm} | sha256sum | cut -c1-12) ]
                 ! grep -qF '\"default_{vm}\"' /var/lib/kvirt/network/leases.json 2>/dev/null
                 ! pgrep -f '[q]emu-system.*guest=default_{vm},'"
            ),
        );
    }

    pub fn console_shows(&self, vm: &str, marker: &str) {
        self.wait(
            &format!("{marker} on {vm}'s serial socket"),
            Duration::from_secs(60),
            // The console prints until detached: cut it off after 5 s.
            &format!(
                "{{ timeout 5 kvirtctl console default/{vm} </dev/null || true; }} | grep -q -m1 {marker}"
            ),
        );
    }

    /// Everything the guest printed since it started (the serial log),
    /// for markers printed once at boot.
    pub fn serial_log_shows(&self, vm: &str, marker: &str) {
        // A kernel booting under TCG on two loaded cores (ci-23a: the
        // suite beside a release build) may take over a minute.
        self.wait(
            &format!("{marker} in {vm}'s serial log"),
            Duration::from_secs(120),
            &format!(
                "grep -qF -- '{marker}' /run/kvirt/vms/{}/console.log",
                id_of(vm)
            ),
        );
    }

    /// Waits until a new kvirtd is active: its `property` (MainPID,
    /// InvocationID) no longer `before`.
    pub fn wait_new_kvirtd(&self, why: &str, property: &str, before: &str) {
        self.wait(
            &format!("kvirtd active again after {why}"),
            Duration::from_secs(30),
            &format!(
                "systemctl is-active -q kvirtd && [ \"$(systemctl show -P {property} kvirtd)\" != {before} ]"
            ),
        );
    }

    pub fn restart_kvirtd(&self) {
        self.ok("systemctl restart kvirtd");
        self.wait(
            "kvirtd active",
            Duration::from_secs(30),
            "systemctl is-active -q kvirtd",
        );
    }
}

/// kvirtd's migration port at `addr`, tried from host `h` with a header
/// for a migration never prepared: a client without a certificate, or
/// with the one of PKI directory `stranger` (another CA), is refused by a
/// TLS alert and gets no byte; one with the certificate of PKI directory
/// `ours` is not refused, and gets no byte either.
pub fn assert_migration_port_lets_in_only(h: &Host, addr: &str, ours: &str, stranger: &str) {
    for pki in [None, Some(stranger)] {
        let (bytes, alert, out) = migration_port_probe(h, addr, pki);
        assert_eq!(bytes, 0, "{pki:?}: {out}");
        assert!(alert, "{pki:?} refused by an alert: {out}");
    }
    let (bytes, alert, out) = migration_port_probe(h, addr, Some(ours));
    assert_eq!(bytes, 0, "{out}");
    assert!(!alert, "{ours}'s certificate is not refused: {out}");
}

/// What a TLS client gets back (bytes), whether it was refused by an
/// alert, and what `openssl s_client` said.
fn migration_port_probe(h: &Host, addr: &str, pki: Option<&str>) -> (usize, bool, String) {
    let cert = pki
        .map(|p| format!(" -cert {p}/api.crt -key {p}/api.key"))
        .unwrap_or_default();
    let out = h.ok(&format!(
        "printf 'kvirt-migration/1 0000-never-prepared memory\\n' |
           timeout 30 openssl s_client -connect {addr} -quiet{cert} \
           > /var/tmp/probe.out 2> /var/tmp/probe.err || true
         echo \"bytes=$(wc -c < /var/tmp/probe.out)\"
         cat /var/tmp/probe.err; rm -f /var/tmp/probe.out /var/tmp/probe.err"
    ));
    let bytes = out
        .lines()
        .find_map(|l| l.strip_prefix("bytes="))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{out}"));
    (bytes, out.contains(" alert "), out)
}
