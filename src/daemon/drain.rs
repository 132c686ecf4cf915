//! `kvirtctl drain`: the host cordoned, then each VM moved, stopped or
//! kept as its eviction strategy says ([`crate::core::drain`]), one at a
//! time, until nothing runs here but what must stay.

use crate::core::drain::Action;
use crate::core::key::VmKey;
use crate::core::vm::Verb;
use crate::daemon::migration::Migrate;
use crate::daemon::vms::Input;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;
use tracing::info;

/// How long the VMs stopped are waited for: their grace periods run
/// meanwhile (KubeVirt's default is 30 s), and their teardown.
const STOPPED_WITHIN: Duration = Duration::from_secs(180);

/// What each VM came to, one line each, and whether the host is empty.
pub struct Drained {
    pub lines: Vec<String>,
    pub empty: bool,
}

pub async fn drain(
    m: &dyn Migrate,
    vms: &UnboundedSender<Input>,
    to: SocketAddr,
    bandwidth: Option<u64>,
) -> Result<Drained, String> {
    if !m.standalone() {
        return Err(
            "in a cluster, a host is drained through the API server (kubectl cordon, \
                    VirtualMachineInstanceMigrations): not yet supported by kvirt"
                .into(),
        );
    }
    m.cordon(true)?;
    let mut lines = vec!["cordoned: this host takes no VM arriving".to_owned()];
    let mut kept = Vec::new();
    for (key, action) in m.drain_plan() {
        let line = match action {
            Action::Migrate => match m.migrate(key.clone(), to, bandwidth).await {
                Ok(message) => message,
                Err(e) => {
                    kept.push(key.clone());
                    format!("{key} stays: {e}")
                }
            },
            Action::StopVm(vm) => match stop(vms, &vm).await {
                Ok(_) => format!(
                    "{key}: its VirtualMachine {vm} stopped (kvirtctl start {vm} starts it again)"
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
        lines.push(line);
    }
    let left = until_only(m, &kept).await;
    let empty = left.is_empty();
    if empty {
        lines.push("drained: no VM runs here".into());
    } else {
        let names: Vec<String> = left.iter().map(VmKey::to_string).collect();
        lines.push(format!("not drained: {} still here", names.join(", ")));
    }
    Ok(Drained { lines, empty })
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
        let to = "10.0.0.2:8444".parse().unwrap();
        let d = drain(host.as_ref(), &vm_loop(host.clone()), to, None)
            .await
            .unwrap();
        assert!(d.empty, "{:?}", d.lines);
        assert_eq!(
            *host.asked.lock().unwrap(),
            [
                "cordon true",
                "migrate default/a",
                "stop default/vm",
                "migrate default/b"
            ]
        );
        assert_eq!(d.lines.last().unwrap(), "drained: no VM runs here");

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
        let d = drain(host.as_ref(), &vm_loop(host.clone()), to, None)
            .await
            .unwrap();
        assert!(!d.empty);
        assert!(d
            .lines
            .iter()
            .any(|l| l == "default/a stays: the target refused"));
        assert!(d
            .lines
            .iter()
            .any(|l| l.contains("default/c stays: evictionStrategy External")));
        assert!(d
            .lines
            .last()
            .unwrap()
            .contains("default/a, default/c still here"));
    }

    #[tokio::test]
    async fn a_cluster_host_is_not_drained_here_and_not_cordoned() {
        let host = std::sync::Arc::new(Host {
            cluster: true,
            ..Default::default()
        });
        let to = "10.0.0.2:8444".parse().unwrap();
        let e = drain(host.as_ref(), &vm_loop(host.clone()), to, None)
            .await
            .err()
            .unwrap();
        assert!(e.contains("in a cluster"), "{e}");
        assert!(host.asked.lock().unwrap().is_empty());
    }
}
