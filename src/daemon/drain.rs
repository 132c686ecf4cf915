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
