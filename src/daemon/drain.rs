//! `kvirtctl drain`: the host cordoned, then each VM moved, stopped or
//! kept as its eviction strategy says ([`crate::core::drain`]), one at a
//! time, until nothing runs here but what must stay. How a VM is moved or
//! stopped is [`Evict`]'s: a standalone host does it itself ([`Direct`]),
//! a cluster's through the API server (`daemon::evacuate`).

use crate::core::drain::Action;
use crate::core::key::VmKey;
use crate::core::vm::Verb;
use crate::daemon::migration::Migrate;
use crate::daemon::vms::Input;
use futures::future::BoxFuture;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::info;

/// How long the VMs stopped are waited for: their grace periods run
/// meanwhile (KubeVirt's default is 30 s), and their teardown.
const STOPPED_WITHIN: Duration = Duration::from_secs(180);

/// How a drain moves a VM away and stops a VirtualMachine.
pub trait Evict: Send + Sync {
    /// Moves the VMI `key` to another host; the answer says where.
    /// `evacuation`: for a drain (in a cluster its migration object says
    /// so, as KubeVirt's evacuation marks its own), else a user's.
    fn migrate(&self, key: VmKey, evacuation: bool) -> BoxFuture<'_, Result<String, String>>;
    /// Stops the VirtualMachine `vm`, as `kvirtctl stop` (or `virtctl
    /// stop`) does.
    fn stop(&self, vm: VmKey) -> BoxFuture<'_, Result<String, String>>;
}

/// A standalone host's drain: each VM to the kvirtd at `to`, each
/// VirtualMachine stopped by this host's VM loop.
pub struct Direct<'a> {
    pub migrate: &'a dyn Migrate,
    pub vms: &'a UnboundedSender<Input>,
    pub to: SocketAddr,
    pub bandwidth: Option<u64>,
}

impl Evict for Direct<'_> {
    fn migrate(&self, key: VmKey, _: bool) -> BoxFuture<'_, Result<String, String>> {
        self.migrate.migrate(key, self.to, self.bandwidth)
    }

    fn stop(&self, vm: VmKey) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move { stop(self.vms, &vm).await })
    }
}

/// Whether the host ended empty, and the line that says so.
pub struct Drained {
    pub summary: String,
    pub empty: bool,
}

/// Drains the host; `report` gets each line as it happens (what each VM
/// came to), for the caller to show while the drain goes on.
pub async fn drain(
    m: &dyn Migrate,
    evict: &dyn Evict,
    report: &(dyn Fn(String) + Sync),
) -> Result<Drained, String> {
    m.cordon(true)?;
    report("cordoned: this host takes no VM arriving".to_owned());
    let mut kept = Vec::new();
    for (key, action) in m.drain_plan() {
        let line = match action {
            Action::Migrate => {
                report(format!("{key}: migrating"));
                evict.migrate(key.clone(), true).await.unwrap_or_else(|e| {
                    kept.push(key.clone());
                    format!("{key} stays: {e}")
                })
            }
            Action::StopVm(vm) => match evict.stop(vm.clone()).await {
                Ok(_) => format!(
                    "{key}: its VirtualMachine {vm} stopped ({})",
                    start_again(m, &vm)
                ),
                Err(e) => {
                    kept.push(key.clone());
                    format!("{key} stays: stopping {vm}: {e}")
                }
            },
            Action::Stays(why) => {
                kept.push(key.clone());
                format!("{key} stays: {why}")
            }
        };
        info!("drain: {line}");
        report(line);
    }
    let left = until_only(m, &kept).await;
    let empty = left.is_empty();
    let summary = if empty {
        "drained: no VM runs here".to_owned()
    } else {
        let names: Vec<String> = left.iter().map(VmKey::to_string).collect();
        format!("not drained: {} still here", names.join(", "))
    };
    Ok(Drained { summary, empty })
}

/// How a user starts the VirtualMachine `vm` again.
fn start_again(m: &dyn Migrate, vm: &VmKey) -> String {
    match m.standalone() {
        true => format!("kvirtctl start {vm} starts it again"),
        false => format!(
            "virtctl start {} -n {} starts it again",
            vm.name(),
            vm.namespace()
        ),
    }
}

/// Asks the VM loop to stop the VirtualMachine `vm`, as `kvirtctl stop`.
async fn stop(vms: &UnboundedSender<Input>, vm: &VmKey) -> Result<String, String> {
    let (reply, rx) = oneshot::channel();
    let command = Input::Command {
        key: vm.clone(),
        verb: Verb::Stop { grace: None },
        reply,
    };
    vms.send(command).map_err(|_| "kvirtd is shutting down")?;
    rx.await.map_err(|_| "kvirtd dropped the request")?
}

/// Waits (at most [`STOPPED_WITHIN`]) until no VM but `kept` is here;
/// what is still here then.
async fn until_only(m: &dyn Migrate, kept: &[VmKey]) -> Vec<VmKey> {
    let deadline = tokio::time::Instant::now() + STOPPED_WITHIN;
    loop {
        let here = m.still_here();
        let others = here.iter().any(|k| !kept.contains(k));
        if !others || tokio::time::Instant::now() > deadline {
            return here;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::BoxFuture;
    use std::sync::Mutex;

    /// A host with VMs `plan`ned; `migrate` fails for the names in `stuck`;
    /// a VM stopped or moved leaves `here`. Records what was asked.
    #[derive(Default)]
    struct Host {
        plan: Vec<(VmKey, Action)>,
        stuck: Vec<String>,
        here: Mutex<Vec<VmKey>>,
        asked: Mutex<Vec<String>>,
        cluster: bool,
    }

    impl Migrate for Host {
        fn migrate(
            &self,
            key: VmKey,
            to: SocketAddr,
            _: Option<u64>,
        ) -> BoxFuture<'_, Result<String, String>> {
            self.asked.lock().unwrap().push(format!("migrate {key}"));
            let stuck = self.stuck.contains(&key.name().to_owned());
            if !stuck {
                self.here.lock().unwrap().retain(|k| k != &key);
            }
            Box::pin(async move {
                match stuck {
                    true => Err("the target refused".into()),
                    false => Ok(format!("{key} moved to {to}")),
                }
            })
        }
        fn cordon(&self, on: bool) -> Result<(), String> {
            self.asked.lock().unwrap().push(format!("cordon {on}"));
            Ok(())
        }
        fn drain_plan(&self) -> Vec<(VmKey, Action)> {
            self.plan.clone()
        }
        fn still_here(&self) -> Vec<VmKey> {
            self.here.lock().unwrap().clone()
        }
        fn standalone(&self) -> bool {
            !self.cluster
        }
    }

    fn key(name: &str) -> VmKey {
        VmKey::new("default", name).unwrap()
    }

    /// The VM loop's part: each stop is answered, and its VMI leaves.
    fn vm_loop(host: std::sync::Arc<Host>) -> UnboundedSender<Input> {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(Input::Command { key, verb, reply }) = rx.recv().await {
                assert_eq!(verb, Verb::Stop { grace: None });
                host.asked.lock().unwrap().push(format!("stop {key}"));
                host.here
                    .lock()
                    .unwrap()
                    .retain(|k| k.name() != "vmi-of-vm");
                let _ = reply.send(Ok("stopping".into()));
            }
        });
        tx
    }

    /// Drains `host` to `to` through its own migrations and VM loop; the
    /// lines reported, the summary last.
    async fn drained(host: std::sync::Arc<Host>) -> (Vec<String>, bool) {
        let vms = vm_loop(host.clone());
        let direct = Direct {
            migrate: host.as_ref(),
            vms: &vms,
            to: "10.0.0.2:8444".parse().unwrap(),
            bandwidth: None,
        };
        let lines = Mutex::new(Vec::new());
        let report = |l: String| lines.lock().unwrap().push(l);
        let d = drain(host.as_ref(), &direct, &report).await.unwrap();
        let mut lines = lines.into_inner().unwrap();
        lines.push(d.summary);
        (lines, d.empty)
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_cordons_first_then_moves_stops_and_names_what_stays() {
        let host = std::sync::Arc::new(Host {
            plan: vec![
                (key("a"), Action::Migrate),
                (key("vmi-of-vm"), Action::StopVm(key("vm"))),
                (key("b"), Action::Migrate),
            ],
            here: Mutex::new(vec![key("a"), key("b"), key("vmi-of-vm")]),
            ..Default::default()
        });
        let (lines, empty) = drained(host.clone()).await;
        assert!(empty, "{lines:?}");
        assert_eq!(
            *host.asked.lock().unwrap(),
            [
                "cordon true",
                "migrate default/a",
                "stop default/vm",
                "migrate default/b"
            ]
        );
        // Each VM's line as it happens: before a migration, and after.
        assert_eq!(lines[1], "default/a: migrating");
        assert_eq!(lines[2], "default/a moved to 10.0.0.2:8444");
        assert!(
            lines[3].contains("default/vm stopped (kvirtctl start default/vm"),
            "{lines:?}"
        );
        assert_eq!(lines.last().unwrap(), "drained: no VM runs here");

        // One that does not move, one that must stay: named, not empty.
        let host = std::sync::Arc::new(Host {
            plan: vec![
                (key("a"), Action::Migrate),
                (key("c"), Action::Stays("evictionStrategy External".into())),
            ],
            stuck: vec!["a".into()],
            here: Mutex::new(vec![key("a"), key("c")]),
            ..Default::default()
        });
        let (lines, empty) = drained(host).await;
        assert!(!empty);
        assert!(lines
            .iter()
            .any(|l| l == "default/a stays: the target refused"));
        assert!(lines
            .iter()
            .any(|l| l.contains("default/c stays: evictionStrategy External")));
        assert!(lines
            .last()
            .unwrap()
            .contains("default/a, default/c still here"));
    }

    /// A cluster's way of moving and stopping, recorded.
    struct Objects<'a>(&'a Host);

    impl Evict for Objects<'_> {
        fn migrate(&self, key: VmKey, evacuation: bool) -> BoxFuture<'_, Result<String, String>> {
            assert!(evacuation);
            self.0.asked.lock().unwrap().push(format!("vmim {key}"));
            self.0.here.lock().unwrap().retain(|k| k != &key);
            Box::pin(async move { Ok(format!("{key} moved to node-b")) })
        }
        fn stop(&self, vm: VmKey) -> BoxFuture<'_, Result<String, String>> {
            self.0.asked.lock().unwrap().push(format!("halt {vm}"));
            self.0
                .here
                .lock()
                .unwrap()
                .retain(|k| k.name() != "vmi-of-vm");
            Box::pin(async { Ok("stopping".into()) })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cluster_host_is_drained_through_its_evict_and_names_virtctl() {
        let host = Host {
            plan: vec![
                (key("a"), Action::Migrate),
                (key("vmi-of-vm"), Action::StopVm(key("vm"))),
            ],
            here: Mutex::new(vec![key("a"), key("vmi-of-vm")]),
            cluster: true,
            ..Default::default()
        };
        let lines = Mutex::new(Vec::new());
        let report = |l: String| lines.lock().unwrap().push(l);
        let d = drain(&host, &Objects(&host), &report).await.unwrap();
        assert!(d.empty);
        assert_eq!(
            *host.asked.lock().unwrap(),
            ["cordon true", "vmim default/a", "halt default/vm"]
        );
        let lines = lines.into_inner().unwrap();
        assert!(
            lines[3].ends_with("(virtctl start vm -n default starts it again)"),
            "{lines:?}"
        );
    }
}
