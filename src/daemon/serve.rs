//! kvirtd's life once its parts are built: adopt what the host runs, report
//! READY, serve metrics, keep `STATUS=` and the watchdog going while the
//! loop turns, and run the loop until SIGTERM. VMs keep running after it.

use crate::core::key::VmKey;
use crate::core::trigger::Trigger;
use crate::core::vmi::VirtualMachineInstance;
use crate::daemon::controller::{Adapters, Controller, Deps, Settings, VmiView};
use crate::daemon::migration::{Migrate, Migrations};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tracing::{info, warn};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("starting the VMI source's change feed: {0}")]
    Source(std::io::Error),
    #[error("waiting for SIGTERM: {0}")]
    Signal(std::io::Error),
    #[error("controller loop: {0}")]
    Loop(tokio::task::JoinError),
}

/// Where the VMIs come from: the first full set, how to start the change
/// feed once ready, and the full set again for each resync.
pub struct Sources<Ready, List> {
    pub initial: BTreeMap<VmKey, VirtualMachineInstance>,
    pub ready: Ready,
    /// `None` where the change feed resyncs itself (the manifest directory).
    pub list: Option<List>,
    pub resync: Duration,
    /// How often to look for EFI variables whose VirtualMachine is gone;
    /// only a cluster has VirtualMachines.
    pub efi_vars_check: Option<Duration>,
    /// How this kvirtd takes part in live migrations; `None`: not at all.
    pub migrations: Option<crate::daemon::migration::Setup>,
    /// What to finish at SIGTERM before exiting (at most [`STOP_WAIT`]).
    pub stop: Option<Stop>,
    /// What the source has to say on `STATUS=` beside the VM counts.
    pub notice: Notice,
}

/// A line for `STATUS=` from outside the loop (an identity run out that
/// nothing renews), until taken back.
pub type Notice = std::sync::Arc<std::sync::Mutex<Option<String>>>;

fn notice_of(n: &Notice) -> Option<String> {
    n.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

pub type Stop =
    Box<dyn FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send>;

/// How long SIGTERM waits for [`Sources::stop`].
const STOP_WAIT: Duration = Duration::from_secs(3);

/// How long READY waits for the first pass over every VM. A host of a few
/// VMs has passed over them all within ~100 ms and is READY then; at 250
/// VMs no wait ends with every pass done (they finish in the loop), so
/// what is waited here is only added to a restart (it was 500 ms: 37 %
/// of a restart at 250 VMs).
const ADOPTION_WAIT: Duration = Duration::from_millis(200);

/// Adopts, reports ready, then runs the loop until SIGTERM.
pub async fn serve<A: Adapters>(
    deps: Deps<A>,
    settings: Settings,
    metrics: Option<tokio::net::TcpListener>,
    (tx, rx): (UnboundedSender<Trigger>, UnboundedReceiver<Trigger>),
    sources: Sources<
        impl FnOnce(
            UnboundedSender<Trigger>,
            std::sync::Arc<dyn VmiView>,
            Option<std::sync::Arc<dyn Migrate>>,
        ) -> std::io::Result<()>,
        impl Fn() -> BTreeMap<VmKey, VirtualMachineInstance> + Send + 'static,
    >,
) -> Result<(), ServeError> {
    let ctl = Controller::new(deps, settings);
    // What VMs gone while kvirtd was down held is free again, and what is
    // held stays theirs alone.
    ctl.converge_cpus().await;

    // Adoption before serving: every VM the host has is matched or cleaned
    // by the loop's first pass. READY waits for that pass only briefly: a
    // VM in its grace period, or whose daemon does not answer, finishes
    // in the loop while kvirtd serves the rest.
    ctl.set_vmis(sources.initial).await;
    let (adopted_tx, adopted) = tokio::sync::oneshot::channel();
    let loop_task = tokio::spawn(ctl.clone().run(tx.clone(), rx, Some(adopted_tx)));
    if tokio::time::timeout(ADOPTION_WAIT, adopted).await.is_err() {
        info!("ready before every VM's first pass ended: the rest finish in the loop");
    }
    let notice = sources.notice.clone();
    let status = status_line(
        &ctl.phase_counts(),
        ctl.cordoned(),
        ctl.fenced_count(),
        notice_of(&notice).as_deref(),
    );
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]);
    info!("ready: {status}");
    // Migrations are never a reason not to run VMs: a failure is logged.
    let migrate: Option<std::sync::Arc<dyn Migrate>> = match sources.migrations {
        Some(setup) => {
            let port = setup.listen.is_some();
            match Migrations::start(setup, ctl.clone(), tx.clone()).await {
                Ok(m) => Some(m),
                // Asked for a port it cannot serve: an error. Without one,
                // a host without kvirt's identity just sends no VM away.
                Err(e) if port => {
                    tracing::error!("{e}; this host takes part in no migrations");
                    None
                }
                Err(e) => {
                    info!("{e}: this host migrates no VMs");
                    None
                }
            }
        }
        None => None,
    };
    (sources.ready)(tx.clone(), ctl.clone(), migrate).map_err(ServeError::Source)?;
    let probe = ctl.clone();
    tokio::spawn(async move {
        match probe.refresh_capabilities().await {
            Ok(()) => info!("QEMU capabilities probed for new VMs to start from"),
            Err(e) => warn!("QEMU capability probe: {e}; new VMs probe QEMU themselves"),
        }
    });

    if let Some(listener) = metrics {
        if let Ok(addr) = listener.local_addr() {
            info!("metrics on http://{addr}/metrics");
        }
        let c = ctl.clone();
        tokio::spawn(super::metrics::serve(listener, move || {
            c.metrics().set_phases(&c.phase_counts());
            c.metrics().encode()
        }));
    }

    let (resync, list, ticker_tx) = (sources.resync, sources.list, tx.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(resync);
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Some(list) = &list {
                let _ = ticker_tx.send(Trigger::Vmis(list()));
            }
            let _ = ticker_tx.send(Trigger::Resync);
        }
    });
    if let Some(period) = sources.efi_vars_check {
        let tx = tx.clone();
        tokio::spawn(async move {
            // The first tick is at once: VMs deleted while kvirtd was down.
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                if tx.send(Trigger::EfiVars).is_err() {
                    break;
                }
            }
        });
    }
    let (a, c) = (ctl.clone(), ctl.clone());
    tokio::spawn(keepalive(
        sd_notify::watchdog_enabled(),
        move || a.heartbeat(),
        move || {
            status_line(
                &c.phase_counts(),
                c.cordoned(),
                c.fenced_count(),
                notice_of(&notice).as_deref(),
            )
        },
        tx.clone(),
        |state| {
            let _ = sd_notify::notify(std::slice::from_ref(state));
        },
    ));

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(ServeError::Signal)?;
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: exiting; VMs keep running"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: exiting; VMs keep running"),
        r = loop_task => r.map_err(ServeError::Loop)?,
    }
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    if let Some(stop) = sources.stop {
        if tokio::time::timeout(STOP_WAIT, stop()).await.is_err() {
            warn!("stopping: gave up waiting for the API port to close");
        }
    }
    Ok(())
}

/// `STATUS=` every two seconds, and the watchdog: each beat asks the loop
/// to answer, and systemd is pinged only when the previous beat was
/// answered, so a wedged loop gets kvirtd restarted (its VMs keep running).
async fn keepalive(
    watchdog: Option<Duration>,
    answered: impl Fn() -> u64,
    status: impl Fn() -> String,
    tx: UnboundedSender<Trigger>,
    notify: impl Fn(&sd_notify::NotifyState),
) {
    let period = watchdog
        .map(|w| (w / 4).min(Duration::from_secs(2)))
        .unwrap_or(Duration::from_secs(2));
    let mut tick = tokio::time::interval(period);
    let mut sent = 0u64;
    let mut last = String::new();
    loop {
        tick.tick().await;
        if watchdog.is_some() && answered() == sent {
            notify(&sd_notify::NotifyState::Watchdog);
        }
        sent += 1;
        let _ = tx.send(Trigger::Heartbeat(sent));
        let status = status();
        if status != last {
            notify(&sd_notify::NotifyState::Status(&status));
            last = status;
        }
    }
}

/// `STATUS=` as `systemctl status kvirtd` shows it: VM counts per phase,
/// the cordon a drain left, the VMs a self-fence stopped, and the source's
/// notice.
fn status_line(
    counts: &BTreeMap<String, usize>,
    cordoned: bool,
    fenced: usize,
    notice: Option<&str>,
) -> String {
    let total: usize = counts.values().sum();
    let parts: Vec<String> = counts.iter().map(|(p, n)| format!("{n} {p}")).collect();
    let mut line = if parts.is_empty() {
        "0 VMs".to_string()
    } else {
        format!("{total} VMs: {}", parts.join(", "))
    };
    if cordoned {
        line.push_str("; cordoned (kvirtctl uncordon)");
    }
    if fenced > 0 {
        line.push_str(&format!(
            "; {fenced} fenced (stopped: this host could not renew its Lease)"
        ));
    }
    if let Some(n) = notice {
        line.push_str("; ");
        line.push_str(n);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc::unbounded_channel;

    #[tokio::test(start_paused = true)]
    async fn the_watchdog_is_fed_only_while_the_loop_answers() {
        let answered = Arc::new(AtomicU64::new(0));
        let wedged = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(Mutex::new(Vec::<String>::new()));
        let (tx, mut rx) = unbounded_channel();
        // The loop's part: answer each heartbeat, unless wedged.
        let (a, w) = (answered.clone(), wedged.clone());
        tokio::spawn(async move {
            while let Some(t) = rx.recv().await {
                if let (Trigger::Heartbeat(n), false) = (t, w.load(Ordering::SeqCst)) {
                    a.store(n, Ordering::SeqCst);
                }
            }
        });
        let (a, s) = (answered.clone(), sent.clone());
        tokio::spawn(keepalive(
            Some(Duration::from_secs(8)),
            move || a.load(Ordering::SeqCst),
            || "2 VMs: 2 Running".to_string(),
            tx,
            move |state| s.lock().unwrap().push(state.to_string()),
        ));
        let pings = || {
            let mut s = sent.lock().unwrap();
            let n = s.iter().filter(|l| l.as_str() == "WATCHDOG=1").count();
            s.clear();
            n
        };
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(pings() >= 4, "fed every 2 s while the loop answers");
        wedged.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(1)).await;
        pings();
        tokio::time::sleep(Duration::from_secs(20)).await;
        assert_eq!(pings(), 0, "a wedged loop starves the watchdog");
        wedged.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(pings() >= 3, "fed again once the loop answers");
    }

    #[test]
    fn status_counts_vms_per_phase() {
        assert_eq!(status_line(&BTreeMap::new(), false, 0, None), "0 VMs");
        let counts = BTreeMap::from([("Running".to_string(), 2), ("Scheduled".to_string(), 1)]);
        assert_eq!(
            status_line(&counts, false, 0, None),
            "3 VMs: 2 Running, 1 Scheduled"
        );
        assert_eq!(
            status_line(&counts, true, 0, None),
            "3 VMs: 2 Running, 1 Scheduled; cordoned (kvirtctl uncordon)"
        );
        assert_eq!(
            status_line(&counts, false, 1, None),
            "3 VMs: 2 Running, 1 Scheduled; 1 fenced (stopped: this host could not renew its Lease)"
        );
        assert_eq!(
            status_line(&counts, false, 0, Some("certificate expired")),
            "3 VMs: 2 Running, 1 Scheduled; certificate expired"
        );
    }
}
