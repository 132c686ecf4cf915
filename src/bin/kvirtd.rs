//! kvirtd: runs the VMIs assigned to this host, one transient systemd unit
//! and one network namespace per VM, no pods.

use anyhow::{Context, Result};
use clap::Parser;
use kvirt::core::convert::DomainType;
use kvirt::core::key::VmKey;
use kvirt::core::layout::HostLayout;
use kvirt::core::trigger::Trigger;
use kvirt::core::vmi::VirtualMachineInstance;
use kvirt::daemon::config::{Config, Emulation, SourceKind, DEFAULT_PATH};
use kvirt::daemon::controller::{Controller, Deps, LogRecorder, Settings};
use kvirt::host::image::OciImages;
use kvirt::host::journal::{self, Journal};
use kvirt::host::libvirt::Libvirt;
use kvirt::host::machined::Machined;
use kvirt::host::netns::KernelNetns;
use kvirt::host::network::{HostNetwork, NetworkSettings};
use kvirt::host::qemulog::Forwarder;
use kvirt::host::storage::{HostStorage, Owner};
use kvirt::host::systemd::SystemdBus;
use kvirt::sources::cluster;
use kvirt::sources::manifest::{scan_dir, FileStatusStore, Snapshot};
use kvirt::sources::{Recorder, StatusStore};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tracing::{error, info, warn};

/// Runs KubeVirt VirtualMachineInstances on this host without pods.
///
/// Each VM becomes a transient unit `kvirt-vm@<namespace>_<name>.service`
/// running its own libvirt daemon, unprivileged, in the network namespace
/// `kvirt-<namespace>_<name>`, which gets a pod-like network (a veth from
/// the bridge `kvirt0`, KubeVirt's masquerade binding, DHCP served by
/// kvirtd). VMIs come from a directory of manifests (`/etc/kvirt/vmis.d`,
/// status in `/run/kvirt/vms/<namespace>_<name>/status.json`) or, with
/// `[source] kind = "kubernetes"`, from an API server (the VMIs labelled
/// `kubevirt.io/nodeName=<node>`, status patched on the object). Restarting
/// kvirtd never stops a VM: on start it adopts what runs and cleans up what
/// has no VMI.
///
/// Configuration: /etc/kvirt/kvirtd.toml (every key optional, the shipped
/// file documents them), then /etc/kvirt/kvirtd.toml.d/*.toml in name
/// order, merged key by key. An invalid configuration exits with status 78.
///
/// Run by systemd (kvirtd.service, Type=notify): READY after adoption,
/// STATUS= with VM counts per phase, watchdog pings while the loop turns.
/// Logs go to the journal; lines about a VM carry KVIRT_VM=<ns>/<name> and
/// reach `journalctl -u kvirt-vm@<ns>_<name>` together with the VM's QEMU
/// log. Each running VM is registered with systemd-machined as
/// <ns>.<name>. Prometheus metrics: http://127.0.0.1:9477/metrics
/// ([metrics] listen). Set KVIRT_LOG (e.g. debug) for more detail.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Configuration file (TOML).
    #[arg(long, short, default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// Check the configuration and exit.
    #[arg(long)]
    check_config: bool,
    /// Print the VirtualMachineInstance CRD (kubevirt.io/v1 compatible, for
    /// clusters without KubeVirt) and exit.
    #[arg(long)]
    print_crd: bool,
    /// Print the least-privilege RBAC kvirtd needs in a cluster and exit.
    #[arg(long)]
    print_rbac: bool,
    /// Print this manual page (roff) for packaging.
    #[arg(long, hide = true)]
    print_man: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.print_man {
        use clap::CommandFactory;
        clap_mangen::Man::new(Args::command().name("kvirtd"))
            .section("8")
            .render(&mut std::io::stdout())?;
        return Ok(());
    }
    if args.print_crd || args.print_rbac {
        if args.print_crd {
            print!("{}", cluster::CRD_YAML);
        }
        if args.print_crd && args.print_rbac {
            println!("---");
        }
        if args.print_rbac {
            print!("{}", cluster::RBAC_YAML);
        }
        return Ok(());
    }
    init_logging();
    let explicit = args.config != Path::new(DEFAULT_PATH);
    let config = match Config::load(&args.config, explicit) {
        Ok(c) => c,
        Err(e) => {
            // systemd shows the STATUS= line; RestartPreventExitStatus=78
            // keeps it from retrying what only an edit can fix.
            error!("{e}");
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(&e.to_string())]);
            std::process::exit(EX_CONFIG);
        }
    };
    if args.check_config {
        println!("{} is valid", args.config.display());
        return Ok(());
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(config))
}

/// To the journal with kvirt's fields when systemd runs kvirtd, plain text
/// on stderr otherwise.
fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("KVIRT_LOG").unwrap_or_else(|_| "info".into());
    let journal = Journal::stderr_is_journal()
        .then(Journal::connect)
        .and_then(Result::ok);
    let registry = tracing_subscriber::registry().with(filter);
    match journal {
        Some(j) => registry.with(journal::Layer::new(j)).init(),
        None => registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .init(),
    }
}

/// Each VM's QEMU log into the journal under its unit, once a second.
fn forward_qemu_logs(layout: HostLayout) -> Result<()> {
    let Ok(journal) = Journal::connect() else {
        warn!("no journal: QEMU logs stay in each VM's cache directory");
        return Ok(());
    };
    let fwd = Forwarder::new(journal, layout);
    std::thread::Builder::new()
        .name("qemu-log".into())
        .spawn(move || loop {
            for e in fwd.pass() {
                warn!("{e}");
            }
            std::thread::sleep(Duration::from_secs(1));
        })?;
    Ok(())
}

/// sysexits.h: configuration error.
const EX_CONFIG: i32 = 78;

fn find_binary(name: &str) -> Option<PathBuf> {
    [
        "/usr/sbin",
        "/usr/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
        "/sbin",
    ]
    .iter()
    .map(|d| Path::new(d).join(name))
    .find(|p| p.is_file())
}

nix::ioctl_none!(kvm_get_api_version, 0xAE, 0x00);

fn kvm_usable() -> bool {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    else {
        return false;
    };
    // SAFETY: KVM_GET_API_VERSION takes no argument.
    matches!(unsafe { kvm_get_api_version(f.as_raw_fd()) }, Ok(12))
}

fn settings(config: &Config) -> Result<Settings> {
    let daemon = config.daemon_kind(|b| find_binary(b).is_some());
    let daemon_path = find_binary(daemon.binary_name())
        .with_context(|| format!("the VM daemon {} is not installed", daemon.binary_name()))?;
    let domain_type = match config.vm.emulation {
        Emulation::Always => DomainType::Qemu,
        Emulation::Never => DomainType::Kvm,
        Emulation::Auto if kvm_usable() => DomainType::Kvm,
        Emulation::Auto => DomainType::Qemu,
    };
    Ok(Settings {
        node_name: config.node_name.clone(),
        layout: config.layout(),
        host_disk_roots: config.storage.host_disk_roots.clone(),
        cluster: config.source.kind == kvirt::daemon::config::SourceKind::Kubernetes,
        daemon,
        daemon_path,
        domain_type,
        user: config.vm.user.clone(),
        slice: config.vm.slice.clone(),
        overhead_bytes: config.vm.overhead_mib << 20,
        tasks_max: config.vm.tasks_max,
        shutdown_resend: Duration::from_secs(5),
    })
}

fn scan(dir: &Path) -> Snapshot {
    let snap = scan_dir(dir);
    for e in &snap.errors {
        warn!("manifest skipped: {e}");
    }
    snap
}

/// inotify on the manifest directory: every change sends a fresh scan.
fn watch_dir(dir: PathBuf, tx: UnboundedSender<Trigger>) -> Result<()> {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_CLOEXEC)?;
    inotify.add_watch(
        &dir,
        AddWatchFlags::IN_CREATE
            | AddWatchFlags::IN_DELETE
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_MOVED_TO
            | AddWatchFlags::IN_MOVED_FROM
            | AddWatchFlags::IN_MODIFY,
    )?;
    std::thread::Builder::new()
        .name("manifest-watch".into())
        .spawn(move || loop {
            match inotify.read_events() {
                Ok(_) => {
                    if tx.send(Trigger::Vmis(scan(&dir).vmis)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    error!("watching {}: {e}", dir.display());
                    break;
                }
            }
        })?;
    Ok(())
}

/// `STATUS=` as `systemctl status kvirtd` shows it: VM counts per phase.
fn status_line(counts: &BTreeMap<String, usize>) -> String {
    let total: usize = counts.values().sum();
    let parts: Vec<String> = counts.iter().map(|(p, n)| format!("{n} {p}")).collect();
    if parts.is_empty() {
        "0 VMs".to_string()
    } else {
        format!("{total} VMs: {}", parts.join(", "))
    }
}

async fn run(config: Config) -> Result<()> {
    let settings = settings(&config)?;
    let owner = Owner::lookup(&config.vm.user).with_context(|| {
        format!(
            "the VM user {:?} must exist (installed by kvirt's sysusers.d file)",
            config.vm.user
        )
    })?;
    info!(
        node = %settings.node_name,
        daemon = ?settings.daemon,
        domain_type = settings.domain_type.as_str(),
        source = ?config.source.kind,
        "starting"
    );

    let (tx, rx) = unbounded_channel::<Trigger>();
    // Domain events and unit changes name a VM id; both just wake it.
    let (lv_tx, lv_rx) = unbounded_channel::<String>();
    let (unit_tx, unit_rx) = unbounded_channel::<String>();
    for mut from in [lv_rx, unit_rx] {
        let to = tx.clone();
        tokio::spawn(async move {
            while let Some(id) = from.recv().await {
                if to.send(Trigger::Vm(id)).is_err() {
                    break;
                }
            }
        });
    }
    let systemd = SystemdBus::connect()
        .await
        .context("connecting to systemd over D-Bus")?;
    systemd.watch(unit_tx).await.context("watching units")?;
    let machines = Machined::new(systemd.connection());
    let network = host_network(&config, &settings, owner)?;
    let host = Host {
        units: systemd,
        network,
        hypervisor: Libvirt::new(lv_tx),
        machines,
        storage: HostStorage {
            host: settings.layout.clone(),
            owner: Some(owner),
        },
        images: OciImages::new(
            settings.layout.images_dir(),
            config.storage.insecure_registries.clone(),
        ),
    };
    let resync = Duration::from_secs(config.source.resync_seconds);
    forward_qemu_logs(settings.layout.clone())?;
    // Metrics are for watching VMs, never a reason not to run them.
    let metrics = match config.metrics.address() {
        Some(addr) => tokio::net::TcpListener::bind(addr)
            .await
            .inspect_err(|e| error!("metrics.listen {addr}: {e}; no metrics endpoint"))
            .ok(),
        None => None,
    };
    let daemon = Daemon {
        host,
        settings,
        metrics,
        tx,
        rx,
    };

    match config.source.kind {
        SourceKind::Directory => {
            let dir = config.source.directory.clone();
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let status = FileStatusStore {
                host: daemon.settings.layout.clone(),
            };
            let initial = scan(&dir).vmis;
            let watch = dir.clone();
            let ready = move |tx: UnboundedSender<Trigger>| watch_dir(watch, tx);
            let list = move || scan(&dir).vmis;
            let sources = Sources {
                initial,
                ready,
                list,
                resync,
                efi_vars_check: None,
            };
            daemon.serve(status, LogRecorder, sources).await
        }
        SourceKind::Kubernetes => {
            let k = &config.kubernetes;
            let (client, ca_pem) = cluster::client(&k.kubeconfig).await?;
            let node = daemon.settings.node_name.clone();
            info!("waiting for the first list of this node's VMIs");
            let store = cluster::source::watch_node(client.clone(), &node, daemon.tx.clone()).await;
            let initial = cluster::source::snapshot(&store);
            tokio::spawn(cluster::lease::heartbeat(
                client.clone(),
                node.clone(),
                Duration::from_secs(k.lease_seconds),
            ));
            let claim = k
                .claim
                .then(|| (client.clone(), node.clone(), k.node_labels.clone()));
            let ready = move |_tx: UnboundedSender<Trigger>| {
                if let Some((client, node, labels)) = claim {
                    cluster::source::claim_unassigned(client, node, labels);
                }
                Ok(())
            };
            let list = move || cluster::source::snapshot(&store);
            let status = cluster::status::KubeStatus {
                client: client.clone(),
                ca_pem,
            };
            let events = cluster::events::KubeEvents::new(client, &node);
            let sources = Sources {
                initial,
                ready,
                list,
                resync,
                efi_vars_check: Some(Duration::from_secs(k.efi_vars_check_seconds.max(1))),
            };
            daemon.serve(status, events, sources).await
        }
    }
}

/// The host's VM network: bridge, egress NAT and the persisted leases.
fn host_network(config: &Config, settings: &Settings, owner: Owner) -> Result<HostNetwork> {
    let n = &config.network;
    let dns = if n.dns.is_empty() {
        // systemd-resolved's stub (127.0.0.53) is unreachable from a guest;
        // its upstream list is.
        let text = ["/run/systemd/resolve/resolv.conf", "/etc/resolv.conf"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        kvirt::core::dhcp::host_dns(&text)
    } else {
        n.dns.clone()
    };
    let net_settings = NetworkSettings {
        subnet: n.subnet.parse().context("network.subnet")?,
        mtu: n.mtu,
        dns,
        dhcp_lease_secs: n.dhcp_lease_seconds,
        netns_dir: kvirt::host::netns::NETNS_DIR.into(),
        tap_uid: owner.uid,
        tap_gid: owner.gid,
    };
    let leases = settings.layout.state_dir.join("network/leases.json");
    let (network, dropped) =
        HostNetwork::start(net_settings, leases).context("setting up the host network")?;
    for d in dropped {
        warn!("address lease dropped: {d}");
    }
    Ok(network)
}

/// The host-side adapters, the same whatever the VMIs come from.
struct Host {
    units: SystemdBus,
    network: HostNetwork,
    hypervisor: Libvirt,
    storage: HostStorage,
    machines: Machined,
    images: OciImages,
}

/// Where the VMIs come from: the first full set, how to start the change
/// feed once ready, and the full set again for each resync.
struct Sources<Ready, List> {
    initial: BTreeMap<VmKey, VirtualMachineInstance>,
    ready: Ready,
    list: List,
    resync: Duration,
    /// How often to look for EFI variables whose VirtualMachine is gone;
    /// only a cluster has VirtualMachines.
    efi_vars_check: Option<Duration>,
}

/// Everything but the VMI source: the same for a directory or a cluster.
struct Daemon {
    host: Host,
    settings: Settings,
    metrics: Option<tokio::net::TcpListener>,
    tx: UnboundedSender<Trigger>,
    rx: UnboundedReceiver<Trigger>,
}

impl Daemon {
    /// Adopts, reports ready, then runs the loop until SIGTERM.
    async fn serve<St: StatusStore, R: Recorder>(
        self,
        status: St,
        recorder: R,
        sources: Sources<
            impl FnOnce(UnboundedSender<Trigger>) -> Result<()>,
            impl Fn() -> BTreeMap<VmKey, VirtualMachineInstance> + Send + 'static,
        >,
    ) -> Result<()> {
        let Daemon {
            host,
            settings,
            metrics,
            tx,
            rx,
        } = self;
        let deps = Deps {
            units: host.units,
            netns: KernelNetns::default(),
            network: host.network,
            hypervisor: host.hypervisor,
            storage: host.storage,
            status,
            recorder,
            machines: host.machines,
            images: host.images,
        };
        let ctl = Controller::new(deps, settings);

        // Adoption before serving: every VM the host has is matched or cleaned.
        ctl.set_vmis(sources.initial).await;
        for (id, e) in ctl.reconcile_all().await {
            journal::vm_span(&id, None).in_scope(|| warn!("first pass: {e}"));
        }
        let status = status_line(&ctl.phase_counts());
        let _ = sd_notify::notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status(&status),
        ]);
        info!("ready: {status}");
        (sources.ready)(tx.clone())?;

        if let Some(listener) = metrics {
            info!("metrics on http://{}/metrics", listener.local_addr()?);
            let c = ctl.clone();
            tokio::spawn(kvirt::daemon::metrics::serve(listener, move || {
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
                let _ = ticker_tx.send(Trigger::Vmis(list()));
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
            move || c.phase_counts(),
            tx.clone(),
            |state| {
                let _ = sd_notify::notify(std::slice::from_ref(state));
            },
        ));

        let loop_task = tokio::spawn(ctl.run(tx, rx));
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => info!("SIGTERM: exiting; VMs keep running"),
            _ = tokio::signal::ctrl_c() => info!("interrupted: exiting; VMs keep running"),
            r = loop_task => r.context("controller loop")?,
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        Ok(())
    }
}

/// `STATUS=` every two seconds, and the watchdog: each beat asks the loop
/// to answer, and systemd is pinged only when the previous beat was
/// answered, so a wedged loop gets kvirtd restarted (its VMs keep running).
async fn keepalive(
    watchdog: Option<Duration>,
    answered: impl Fn() -> u64,
    counts: impl Fn() -> BTreeMap<String, usize>,
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
        let status = status_line(&counts());
        if status != last {
            notify(&sd_notify::NotifyState::Status(&status));
            last = status;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

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
            || BTreeMap::from([("Running".to_string(), 2)]),
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
        assert_eq!(status_line(&BTreeMap::new()), "0 VMs");
        let counts = BTreeMap::from([("Running".to_string(), 2), ("Scheduled".to_string(), 1)]);
        assert_eq!(status_line(&counts), "3 VMs: 2 Running, 1 Scheduled");
    }
}
