//! kvirtd: runs the VMIs assigned to this host, one transient systemd unit
//! and one network namespace per VM, no pods.

#[path = "kvirtd/join.rs"]
mod join;

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvirt::core::convert::DomainType;
use kvirt::core::layout::{HostLayout, LEGACY_STATUS};
use kvirt::core::peers::Announcement;
use kvirt::core::trigger::Trigger;
use kvirt::daemon::api::run::ApiSettings;
use kvirt::daemon::config::{Config, Emulation, SourceKind, DEFAULT_PATH};
use kvirt::daemon::control;
use kvirt::daemon::controller::VmiView;
use kvirt::daemon::controller::{Adapters, Deps, LogRecorder, Settings};
use kvirt::daemon::fake::FakeHost;
use kvirt::daemon::migration::Migrate;
use kvirt::daemon::serve::{serve, Notice, Sources};
use kvirt::daemon::vms::{Input as VmInput, Vms};
use kvirt::host::beneath::Beneath;
use kvirt::host::consolelog;
use kvirt::host::cpus::DedicatedCpus;
use kvirt::host::fence::RenewalClock;
use kvirt::host::identity::{HostUsers, IdentityStore};
use kvirt::host::image::OciImages;
use kvirt::host::journal::{self, Journal};
use kvirt::host::libvirt::Libvirt;
use kvirt::host::logwatch::LogWatch;
use kvirt::host::machined::Machined;
use kvirt::host::marks::{FileFences, FileMarks};
use kvirt::host::netns::KernelNetns;
use kvirt::host::network::{HostNetwork, NetworkSettings};
use kvirt::host::qemulog::Forwarder;
use kvirt::host::storage::{HostStorage, Owner};
use kvirt::host::systemd::{SystemdBus, Units};
use kvirt::sources::cluster;
use kvirt::sources::manifest::{self, FileStatusStore, VmRecords};
use kvirt::sources::{Recorder, StatusStore};
use std::marker::PhantomData;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tracing::{debug, error, info, warn};

/// Runs KubeVirt VirtualMachineInstances on this host without pods.
///
/// Each VM becomes a transient unit `kvirt-vm@<namespace>_<name>.service`
/// running its own libvirt daemon, unprivileged, in the network namespace
/// `kvirt-<namespace>_<name>`, which gets a pod-like network (a veth from
/// the bridge `kvirt0`, KubeVirt's masquerade binding, DHCP served by
/// kvirtd). VMIs come from a directory of manifests (`/etc/kvirt/vmis.d`,
/// status in `/run/kvirt/status/<namespace>_<name>.json`) or, with
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
    /// Print the VirtualMachineInstance and VirtualMachine CRDs
    /// (kubevirt.io/v1 compatible, for clusters without KubeVirt) and exit.
    #[arg(long)]
    print_crd: bool,
    /// Print the least-privilege RBAC kvirtd needs in a cluster and exit.
    #[arg(long)]
    print_rbac: bool,
    /// With --print-rbac: opt this namespace in (repeatable), letting
    /// kvirtd read the Secrets, ConfigMaps and ServiceAccount tokens its
    /// VMIs' volumes name there. Namespaces not opted in get none.
    #[arg(long = "namespace", requires = "print_rbac", value_name = "NS")]
    namespaces: Vec<String>,
    /// Print what registers kvirt's subresources.kubevirt.io API (what
    /// virtctl calls) with the API server: the Namespace kvirt, the Service
    /// kvirt-api, the APIServices (caBundle: the file [api] ca names) and
    /// the RBAC kvirtd needs to serve it; then exit.
    #[arg(long)]
    print_api_service: bool,
    /// Make a CA in DIR (unless it has one) and a new serving certificate
    /// signed by it for kvirtd's API port (api-ca.crt, api-ca.key, api.crt,
    /// api.key), then exit. For a test or small cluster: copy api-ca.crt,
    /// api.crt and api.key to each host's /etc/kvirt/pki.
    #[arg(long, value_name = "DIR")]
    make_api_pki: Option<PathBuf>,
    /// Print a bootstrap token's Secret (for `kubectl apply -f -`) that
    /// lets the host --node NODE join once, and on stderr the `kvirtd join`
    /// command to run there; then exit.
    #[arg(long, requires = "node")]
    print_bootstrap_token: bool,
    /// With --print-bootstrap-token: the node the token joins.
    #[arg(long, requires = "print_bootstrap_token", value_name = "NODE")]
    node: Option<String>,
    /// With --print-bootstrap-token: how long the token may be used.
    #[arg(
        long,
        default_value_t = 3600,
        requires = "print_bootstrap_token",
        value_name = "SECONDS"
    )]
    token_seconds: u64,
    #[command(subcommand)]
    command: Option<Command>,
    /// Run as a simulated host, for benchmarks of the control plane
    /// (tests/bench --fleet): the configured cluster's API server sees a
    /// host like any other, but every host part (systemd, libvirt, the
    /// network, disks, identities) is the recording fake of kvirt's own
    /// tests: no VM runs, and nothing on this machine is touched but the
    /// directories of [paths].
    #[arg(long)]
    simulate: bool,
    /// Print this manual page (roff) for packaging.
    #[arg(long, hide = true)]
    print_man: bool,
    /// A VM unit's ExecStop= (not for people): SIGTERM to every other
    /// process of the unit this runs in.
    #[arg(long, hide = true)]
    stop_unit_processes: bool,
    /// The package's purge (not for people): give back every hostDisk and
    /// image lent to a VM, once every VM is stopped.
    #[arg(long, hide = true)]
    give_back_grants: bool,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Join this host to a cluster: write the bootstrap kubeconfig
    /// ([kubernetes] bootstrap_kubeconfig) from TOKEN, ask for this host's
    /// identity with it (kvirt:node:<node>), wait until a joined kvirtd or
    /// an administrator (kubectl certificate approve) approves it, write
    /// the node kubeconfig, make the host a cluster one
    /// (kvirtd.toml.d/10-join.toml) and restart kvirtd if no VM of a
    /// manifest would stop for it.
    Join(JoinArgs),
}

#[derive(clap::Args)]
struct JoinArgs {
    /// The API server, e.g. https://10.0.0.1:6443.
    #[arg(long)]
    server: String,
    /// The cluster's CA certificate (PEM): the API server is checked with it.
    #[arg(long, value_name = "FILE")]
    ca_file: PathBuf,
    /// The bootstrap token (kvirtd --print-bootstrap-token): <id>.<secret>.
    #[arg(long)]
    token: String,
    /// This host's node name (default: node_name of the configuration).
    #[arg(long)]
    node: Option<String>,
}

/// `--stop-unit-processes`: each process of this process's cgroup pinned
/// by a pidfd, checked to be in it still, then sent SIGTERM (never this
/// process, which ignores it). Fails where there is no unified hierarchy
/// to list them from, so the unit's ExecStop falls back to `systemctl kill`.
fn stop_unit_processes() -> Result<()> {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: SIG_IGN installs no handler code.
    unsafe { signal(Signal::SIGTERM, SigHandler::SigIgn) }?;
    let cgroup =
        kvirt::host::pidfd::cgroup_of(std::process::id()).context("no unified cgroup hierarchy")?;
    anyhow::ensure!(cgroup != "/", "not in a unit's cgroup");
    if !kvirt::host::pidfd::can_list(&cgroup) {
        anyhow::bail!("cannot list the processes of {cgroup}");
    }
    kvirt::host::pidfd::signal_cgroup(&cgroup, libc::SIGTERM);
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.stop_unit_processes {
        return stop_unit_processes();
    }
    if args.give_back_grants {
        let grants = kvirt::host::grants::Grants::new(HostLayout::default().grants_dir());
        let n = grants.give_back_all()?;
        println!("gave back what {n} VM identities were lent");
        return Ok(());
    }
    if args.print_man {
        use clap::CommandFactory;
        kvirt::daemon::man::render(
            Args::command().name("kvirtd"),
            "8",
            &[
                (
                    "/etc/kvirt/kvirtd.toml",
                    "the configuration (docs/configuration.md)",
                ),
                (
                    "/etc/kvirt/kvirtd.toml.d/*.toml",
                    "drop-ins, merged key by key in name order",
                ),
                (
                    "/etc/kvirt/vmis.d/",
                    "VMI and VirtualMachine manifests (standalone)",
                ),
                ("/etc/kvirt/kubeconfig", "the node identity in a cluster"),
                ("/var/lib/kvirt/", "VMs' state, leases, identities, grants"),
                (
                    "/run/kvirt/",
                    "VMs' runtime files, status, the control socket",
                ),
                ("/var/cache/kvirt/", "the containerDisk image cache"),
            ],
            &mut std::io::stdout(),
        )?;
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
            for ns in &args.namespaces {
                if kvirt::core::key::VmKey::new(ns, "x").is_err() {
                    anyhow::bail!("--namespace {ns:?}: not a namespace name");
                }
                print!("---\n{}", cluster::opt_in_yaml(ns));
            }
        }
        return Ok(());
    }
    if args.print_bootstrap_token {
        let node = args.node.as_deref().unwrap_or_default();
        return join::print_bootstrap_token(node, args.token_seconds);
    }
    if let Some(Command::Join(join)) = &args.command {
        init_logging();
        let explicit = args.config != Path::new(DEFAULT_PATH);
        return join::join_cluster(&args.config, explicit, join);
    }
    if let Some(dir) = &args.make_api_pki {
        for f in kvirt::daemon::api::pki::make(dir)? {
            println!("{}", f.display());
        }
        return Ok(());
    }
    let explicit = args.config != Path::new(DEFAULT_PATH);
    if args.print_api_service {
        let config = Config::load(&args.config, explicit)?;
        let ca = std::fs::read(&config.api.ca)
            .with_context(|| format!("api.ca {}", config.api.ca.display()))?;
        kvirt::daemon::api::tls::certificates(&ca, &config.api.ca.display().to_string())?;
        print!("{}", cluster::api_service_yaml(&ca));
        return Ok(());
    }
    init_logging();
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
    // Each libvirt call runs on a blocking thread, and a burst of starts
    // uses ~100 of them: glibc would give each its own arena (up to 8 per
    // core), whose freed pages it keeps. Two arenas serve a two-thread
    // runtime as well and hold far less.
    // SAFETY: mallopt only changes a limit of the allocator.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // An idle blocking thread leaves after 2 s instead of 10: after a
        // burst the pool shrinks back while the host settles.
        .thread_keep_alive(Duration::from_secs(2))
        .build()?;
    let r = rt.block_on(run(config, args.simulate));
    if r.is_ok() {
        // Stopped as asked: exit without tearing anything down. Closing
        // each VM's libvirt connection is a call to its daemon (0.24 s of
        // a restart at 250 VMs); the daemons see their connection end as
        // after a crash of kvirtd, which every state write is made to
        // survive. And a libvirt call stuck on a stopped VM daemon keeps
        // its blocking thread, which dropping the runtime would wait for.
        std::process::exit(0);
    }
    rt.shutdown_background();
    r
}

/// Raises the soft limit on open files to the hard one, as systemd.exec(5)
/// asks of a program that needs more than the 1,024 a service gets: kvirtd
/// holds a few per VM (its daemon's connection, its logs), and deleting
/// 250 VMs at once ran out ("Too many open files", the 250-VM benchmark).
/// Says the limit kvirtd runs with.
fn raise_open_files() -> String {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard.to_string(),
            Err(e) => format!("{soft} (raising it to {hard}: {e})"),
        },
        Ok((soft, _)) => soft.to_string(),
        Err(e) => format!("unknown ({e})"),
    }
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

/// Each VM's QEMU log into the journal under its unit, and each VM's
/// console log kept to its cap: whenever a log changed (at most once a
/// second), every second while lines wait (for QEMU's pid, or past a VM's
/// share of a pass), and every five minutes in case a change went unseen
/// (each such pass looks at every VM: once a minute, they were half of
/// kvirtd's CPU between resyncs at 100 idle VMs).
fn tend_vm_logs(layout: HostLayout, slice: &str) -> Result<()> {
    let fwd = match Journal::connect() {
        Ok(journal) => Some(Forwarder::new(journal, layout.clone(), slice)),
        Err(_) => {
            warn!("no journal: QEMU logs stay in each VM's cache directory");
            None
        }
    };
    let watch = LogWatch::new(layout.clone()).context("watching the VMs' logs")?;
    let mut told = std::collections::HashMap::new();
    std::thread::Builder::new()
        .name("vm-logs".into())
        .spawn(move || loop {
            // A directory made since the last pass gets its watch first,
            // so nothing written after the pass goes unseen.
            watch.rewatch();
            let mut pending = false;
            if let Some(f) = &fwd {
                let pass = f.pass();
                pending = pass.pending;
                for e in pass.errors {
                    warn!("{e}");
                }
            }
            let capped = consolelog::cap_all(&layout, consolelog::MAX_SIZE);
            for e in consolelog::untold(&mut told, capped) {
                warn!("{e}");
            }
            std::thread::sleep(Duration::from_secs(1));
            let wait = if pending {
                Duration::ZERO
            } else {
                Duration::from_secs(300)
            };
            if let Err(e) = watch.wait(wait) {
                // Not expected of a valid inotify descriptor; looking once
                // a second still tends every log.
                debug!("watching the VMs' logs: {e}");
            }
        })?;
    Ok(())
}

/// systemd's drop-in user records (`nss-systemd` serves them).
const USERDB: &str = "/run/userdb";

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
        host_disk_roots: config.host_disk_roots(),
        shared_roots: config.storage.shared_roots.clone(),
        cluster: config.source.kind == kvirt::daemon::config::SourceKind::Kubernetes,
        daemon,
        daemon_path,
        domain_type,
        user: config.vm.user.clone(),
        probe_owner: Owner::lookup(&config.vm.user)
            .inspect_err(|e| warn!("{e}: no capability probe, each new VM probes QEMU itself"))
            .ok(),
        slice: config.vm.slice.clone(),
        overhead_bytes: config.vm.overhead_mib << 20,
        tasks_max: config.vm.tasks_max,
        shutdown_resend: Duration::from_secs(5),
        capacity: kvirt::host::capacity::read()
            .inspect_err(|e| {
                warn!("the host's memory and CPUs: {e}; VMs are not checked against them")
            })
            .ok(),
        limits: config.vm.limits().map_err(anyhow::Error::msg)?,
        placement: (config.source.kind == kvirt::daemon::config::SourceKind::Kubernetes)
            .then(|| config.host_facts()),
        token_renewal: (config.source.kind == kvirt::daemon::config::SourceKind::Kubernetes)
            .then(|| Duration::from_secs(config.kubernetes.service_account_token_seconds * 4 / 5)),
        claims: config.claims().map_err(anyhow::Error::msg)?,
        claim_roots: config.storage.claim_roots.clone(),
        cni_global_namespaces: config.network.cni_global_namespaces.clone(),
        starts_at_once: config
            .vm
            .starts_at_once(std::thread::available_parallelism().map_or(1, usize::from)),
    })
}

async fn run(config: Config, simulate: bool) -> Result<()> {
    let settings = settings(&config)?;
    info!(
        node = %settings.node_name,
        daemon = ?settings.daemon,
        domain_type = settings.domain_type.as_str(),
        source = ?config.source.kind,
        open_files = %raise_open_files(),
        "starting"
    );

    // A burst of starts runs each VM's calls on a thread of its own, and
    // glibc keeps what they freed: ~15 MiB more at 100 VMs than kvirtd
    // needs once they run. Handing it back once a minute costs a walk of
    // the heap (well under a millisecond).
    tokio::spawn(async {
        let mut every = tokio::time::interval(Duration::from_secs(60));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            // SAFETY: malloc_trim only returns free heap pages to the kernel.
            unsafe { libc::malloc_trim(0) };
        }
    });

    let (tx, rx) = unbounded_channel::<Trigger>();
    if simulate {
        return run_simulated(&config, settings, (tx, rx)).await;
    }
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
    let machines = Machined::new(systemd.bus());
    let storage = HostStorage::new(settings.layout.clone())
        .with_reserve(
            config
                .storage
                .free_space_reserve_bytes()
                .map_err(anyhow::Error::msg)?,
        )
        .with_vm_limit(settings.limits.max_disk_bytes);
    storage
        .seal_records()
        .context("making kvirt's records of its VMs root's alone")?;
    let network = host_network(&config, &settings)?;
    let (identities, dropped) = IdentityStore::open(
        settings.layout.identities_file(),
        USERDB.into(),
        config.vm.identities,
    )
    .context("VM identities")?;
    for d in dropped {
        warn!("{d}");
    }
    match storage.sweep_staging() {
        Ok(0) => {}
        Ok(n) => info!("removed {n} half-made files a previous kvirtd left in staging"),
        Err(e) => warn!("sweeping staging: {e}"),
    }
    let cpus = dedicated_cpus(&config, &settings)?;
    let units = systemd.reading_cpus(cpus.enabled());
    let host = Host {
        cpus,
        units,
        network,
        hypervisor: Libvirt::new(lv_tx),
        machines,
        storage,
        users: HostUsers(Arc::new(identities)),
        marks: FileMarks::marks(settings.layout.migrations_dir()),
        fences: FileFences::fences(settings.layout.fenced_dir()),
        images: {
            let layout = settings.layout.clone();
            OciImages::new(
                settings.layout.images_dir(),
                config.storage.insecure_registries.clone(),
            )
            .with_local_registries(config.storage.local_registries.clone())
            .with_limits(config.storage.image_limits().map_err(anyhow::Error::msg)?)
            .with_budget(
                config
                    .storage
                    .image_cache_bytes()
                    .map_err(anyhow::Error::msg)?,
                Box::new(move || {
                    kvirt::host::grants::Grants::new(layout.grants_dir()).lent_paths()
                }),
            )
        },
    };
    let resync = Duration::from_secs(config.source.resync_seconds);
    tend_vm_logs(settings.layout.clone(), &settings.slice)?;
    // Metrics are for watching VMs, never a reason not to run them.
    let metrics = match config.metrics.address() {
        Some(addr) => tokio::net::TcpListener::bind(addr)
            .await
            .inspect_err(|e| error!("metrics.listen {addr}: {e}; no metrics endpoint"))
            .ok(),
        None => None,
    };
    match config.source.kind {
        SourceKind::Directory => {
            let dir = config.source.directory.clone();
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            migrate_status(&settings.layout);
            let status = FileStatusStore::new(settings.layout.clone());
            let manifests = Arc::new(manifest::ManifestDir::new(
                dir,
                Some(settings.layout.manifest_errors_file()),
            ));
            // VirtualMachines' VMIs join the manifests' own: kvirtd adopts
            // what their records say runs before anything moves on.
            let mut vms = Vms::open(VmRecords {
                dir: settings.layout.virtual_machines_dir(),
            });
            // /run is empty after a reboot: no marker, a new boot.
            let marker = settings.layout.runtime_dir.join("booted");
            if !marker.exists() {
                vms.forget_last_boot();
                std::fs::create_dir_all(&settings.layout.runtime_dir)
                    .and_then(|()| std::fs::write(&marker, b""))
                    .with_context(|| format!("writing {}", marker.display()))?;
            }
            let scan = manifests.scan();
            status.set_networks(&scan.networks);
            let initial = vms.take(scan);
            let control_path = settings.layout.control_socket();
            let control_group = config.control.gid().map_err(anyhow::Error::msg)?;
            let control_node = settings.node_name.clone();
            let networks_of = status.clone();
            let ready = move |tx: UnboundedSender<Trigger>,
                              view: Arc<dyn VmiView>,
                              migrate: Option<Arc<dyn Migrate>>| {
                let (in_tx, in_rx) = unbounded_channel();
                let snapshots = in_tx.clone();
                let networks = networks_of.clone();
                manifests.watch(
                    move |snap| {
                        networks.set_networks(&snap.networks);
                        snapshots.send(VmInput::Manifests(snap)).is_ok()
                    },
                    resync,
                )?;
                let ctx = control::Ctx {
                    node: control_node,
                    to: in_tx,
                    view: view.clone(),
                    migrate,
                    evict: None,
                };
                serve_control(&control_path, control_group, ctx);
                tokio::spawn(vms.run(view, in_rx, tx));
                Ok(())
            };
            let sources = Sources {
                initial,
                ready,
                list: None::<fn() -> _>,
                resync,
                efi_vars_check: None,
                migrations: Some(migration_setup(
                    &config,
                    Arc::new(manifest::ManifestHandover {
                        dir: config.source.directory.clone(),
                    }),
                    // No Lease to announce a cordon on.
                    Arc::default(),
                )),
                stop: None,
                notice: Notice::default(),
            };
            let deps = host.deps(status, LogRecorder);
            Ok(serve(deps, settings, metrics, (tx, rx), sources).await?)
        }
        SourceKind::Kubernetes => {
            let units = host.units.clone();
            run_cluster(
                &config,
                settings,
                metrics,
                (tx, rx),
                &units,
                move |status, events| host.deps(status, events),
            )
            .await
        }
    }
}

/// A host in a cluster: the VMIs assigned to it from the API server, its
/// Lease, claims, VirtualMachines, migrations objects and virtctl's API.
/// The host's parts come from `deps_of` (`kvirtd --simulate`: the fake).
async fn run_cluster<A: Adapters, U: Units + Clone + Send + Sync + 'static>(
    config: &Config,
    settings: Settings,
    metrics: Option<tokio::net::TcpListener>,
    (tx, rx): (UnboundedSender<Trigger>, UnboundedReceiver<Trigger>),
    units: &U,
    deps_of: impl FnOnce(cluster::status::KubeStatus, cluster::events::KubeEvents) -> Deps<A>,
) -> Result<()> {
    let resync = Duration::from_secs(config.source.resync_seconds);
    let k = &config.kubernetes;
    let fence = k.self_fence();
    let renewals = start_self_fence(fence, &settings, units);
    join::bootstrap_identity(config).await?;
    let notice = Notice::default();
    join::renew_in_background(config, notice.clone());
    let (client, ca_pem) = cluster::client(&k.kubeconfig).await?;
    let node = settings.node_name.clone();
    let election = cluster::leader::run(
        client.clone(),
        node.clone(),
        Duration::from_secs(k.lease_seconds),
    );
    // The leader approves certificates; the others the leader's own, as
    // none approves its own.
    if k.approve_certificates {
        cluster::csr::run(
            client.clone(),
            k.max_certificate_seconds,
            node.clone(),
            election.clone(),
        );
    }
    let leading = election.leading;
    while_leading(leading.clone(), {
        let (client, node) = (client.clone(), node.clone());
        let dead_after = Duration::from_secs(k.node_dead_after_seconds);
        let lease = Duration::from_secs(k.lease_seconds);
        let vms = k.virtual_machines;
        move || {
            let events = Arc::new(cluster::events::KubeEvents::new(client.clone(), &node));
            // One watch of the host Leases for the three.
            let (c, n) = (client.clone(), node.clone());
            tokio::spawn(async move {
                let leases = cluster::lease::watch_hosts(c.clone()).await;
                cluster::reaper::run(
                    c.clone(),
                    n.clone(),
                    dead_after,
                    events.clone(),
                    leases.clone(),
                );
                cluster::scheduler::run(c.clone(), events, leases.clone());
                cluster::routing::run(c.clone());
                cluster::aggregation::keep_pruned(c, n, leases, lease);
            });
            if vms {
                cluster::vms::run(client.clone());
                cluster::replicas::run(client.clone());
            }
        }
    });
    info!("waiting for the first list of this node's VMIs");
    let store = cluster::source::watch_node(client.clone(), &node, tx.clone()).await;
    let initial = cluster::source::snapshot(&store);
    // The Lease announces the host to its peers: what it offers
    // VMIs, its migration port, its cordon.
    let facts = config.host_facts();
    let migration_port = config
        .migration
        .listen_address()
        .ok()
        .flatten()
        .map(|a| a.to_string());
    let cordon = settings.layout.cordon_file();
    let (r, counted, api_renewals) = (renewals.clone(), store.clone(), renewals.clone());
    // The leader's scheduler gives new VMIs to hosts that take them: in
    // claim mode, and not about to fence themselves.
    let claims = k.claim;
    // A cordon is announced at once, not at the next renewal.
    let announce = Arc::new(tokio::sync::Notify::new());
    tokio::spawn(cluster::lease::heartbeat(
        client.clone(),
        node.clone(),
        Duration::from_secs(k.lease_seconds),
        announce.clone(),
        move || {
            let fenced = fence.is_some_and(|f| f.due(r.unrenewed()));
            Announcement::of(&facts, migration_port.clone(), cordon.exists())
                .taking(claims && !fenced, counted.state().len())
        },
        move || renewals.renewed(),
    ));
    let control_path = settings.layout.control_socket();
    let control_group = config.control.gid().map_err(anyhow::Error::msg)?;
    // virtctl's API is never a reason not to run VMs.
    let api = api_settings(config, Duration::from_secs(k.lease_seconds)).unwrap_or_else(|e| {
        error!("subresources.kubevirt.io (virtctl) not served: {e:#}");
        None
    });
    let running_api = Arc::new(tokio::sync::Mutex::new(None));
    let (api_client, api_node, api_layout) =
        (client.clone(), node.clone(), settings.layout.clone());
    let api_running = running_api.clone();
    let (vmim_client, vmim_node) = (client.clone(), node.clone());
    let control_node = node.clone();
    let ready = move |_tx: UnboundedSender<Trigger>,
                      view: Arc<dyn VmiView>,
                      migrate: Option<Arc<dyn Migrate>>| {
        let objects = cluster::migrations::KubeMigrations {
            client: vmim_client,
        };
        // A drain moves VMs by migration objects, as virtctl's do.
        let evict = migrate.as_ref().map(|_| {
            Arc::new(kvirt::daemon::evacuate::Evacuation {
                objects: objects.clone(),
                node: vmim_node.clone(),
                within: control::MIGRATE_DEADLINE,
            }) as Arc<dyn kvirt::daemon::drain::Evict>
        });
        if let Some(m) = migrate.clone() {
            tokio::spawn(kvirt::daemon::vmim::run(
                objects,
                vmim_node,
                view.clone(),
                m,
            ));
        }
        if let Some(api) = api {
            let v = view.clone();
            tokio::spawn(async move {
                // virtctl's API is for users, never a reason not to
                // run VMs: a failure to serve it is logged.
                match kvirt::daemon::api::run::start(
                    api,
                    api_node,
                    api_client,
                    v,
                    api_layout,
                    api_renewals,
                )
                .await
                {
                    Ok(r) => *api_running.lock().await = Some(r),
                    Err(e) => error!("subresources.kubevirt.io (virtctl) not served: {e}"),
                }
            });
        }
        // pause, unpause, soft-reboot of the VMIs this host runs;
        // a VM's start, stop and restart go through the API server.
        let (in_tx, mut in_rx) = unbounded_channel();
        tokio::spawn(async move {
            while let Some(VmInput::Command { reply, .. }) = in_rx.recv().await {
                let _ = reply.send(Err("in a cluster, kvirtctl start, stop and restart \
                        go through the API server (its kubeconfig)"
                    .into()));
            }
        });
        let ctx = control::Ctx {
            node: control_node,
            to: in_tx,
            view,
            migrate,
            evict,
        };
        serve_control(&control_path, control_group, ctx);
        Ok(())
    };
    let list = move || cluster::source::snapshot(&store);
    let status = cluster::status::KubeStatus {
        client: client.clone(),
        ca_pem,
        token: cluster::status::TokenSpec {
            seconds: k.service_account_token_seconds as i64,
            audiences: k.service_account_token_audiences.clone(),
        },
    };
    let handover_client = client.clone();
    let events = cluster::events::KubeEvents::new(client, &node);
    let sources = Sources {
        initial,
        ready,
        list: Some(list),
        resync,
        efi_vars_check: Some(Duration::from_secs(k.efi_vars_check_seconds.max(1))),
        // In a cluster, migration objects move VMIs (`daemon::vmim`).
        migrations: Some(migration_setup(
            config,
            Arc::new(cluster::migrations::KubeHandover {
                client: handover_client,
            }),
            announce,
        )),
        stop: Some(Box::new(move || {
            Box::pin(async move {
                if let Some(r) = running_api.lock().await.take() {
                    r.stop().await;
                }
            })
        })),
        notice,
    };
    let deps = deps_of(status, events);
    Ok(serve(deps, settings, metrics, (tx, rx), sources).await?)
}

/// The cluster's controllers (`core::election`), run while this host
/// leads, on a runtime of their own: when it stands down, that runtime is
/// shut down, which ends every task they spawned (watches, loops, calls in
/// flight), while this kvirtd runs its VMs on, API server or not.
fn while_leading(
    mut leading: tokio::sync::watch::Receiver<bool>,
    start: impl Fn() + Send + Sync + 'static,
) {
    tokio::spawn(async move {
        loop {
            if leading.wait_for(|l| *l).await.is_err() {
                return;
            }
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("kvirt-lead")
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    error!("the cluster's controllers not started: {e}");
                    return;
                }
            };
            {
                // What start() spawns runs on the controllers' runtime.
                let _in = rt.enter();
                start();
            }
            let _ = leading.wait_for(|l| !*l).await;
            rt.shutdown_background();
            warn!("this host stood down: the cluster's controllers stopped");
        }
    });
}

/// `--simulate`: a cluster host whose parts are `daemon::fake`'s.
async fn run_simulated(
    config: &Config,
    mut settings: Settings,
    channel: (UnboundedSender<Trigger>, UnboundedReceiver<Trigger>),
) -> Result<()> {
    if config.source.kind != SourceKind::Kubernetes {
        bail!("--simulate: a simulated host is a cluster's ([source] kind = \"kubernetes\")");
    }
    // Nothing to probe: the fake's QEMU is no QEMU.
    settings.probe_owner = None;
    let fake = FakeHost::default();
    // Units and domains changing wake their VM, as systemd's and
    // libvirt's events do.
    let (events, mut changed) = unbounded_channel::<String>();
    fake.state().wake = Some(events);
    let wake = channel.0.clone();
    tokio::spawn(async move {
        while let Some(id) = changed.recv().await {
            if wake.send(Trigger::Vm(id)).is_err() {
                break;
            }
        }
    });
    // The fake keeps every call for tests to read; a long run drops them.
    let calls = fake.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(60));
        loop {
            every.tick().await;
            calls.take_calls();
        }
    });
    let units = fake.clone();
    run_cluster(
        config,
        settings,
        None,
        channel,
        &units,
        move |status, events| fake.simulated(status, events),
    )
    .await
}

/// Other kvirtds' way in for migrations, and this one's way out.
fn migration_setup(
    config: &Config,
    handover: Arc<dyn kvirt::sources::Handover>,
    announce: Arc<tokio::sync::Notify>,
) -> kvirt::daemon::migration::Setup {
    let a = &config.api;
    let listen = config
        .migration
        .listen_address()
        .inspect_err(|e| error!("migration.listen: {e}; this host takes no migrations"))
        .ok()
        .flatten();
    kvirt::daemon::migration::Setup {
        listen,
        cert: a.cert.clone(),
        key: a.key.clone(),
        ca: a.ca.clone(),
        handover,
        timeout: Duration::from_secs(config.migration.timeout_seconds),
        eviction_strategy: config.migration.eviction_strategy,
        bandwidth: Some(config.migration.bandwidth_per_migration_mib).filter(|b| *b > 0),
        announce,
    }
}

/// The API port's settings, or `None` when it is not served. Without an
/// address configured, the one this host reaches the API server from.
fn api_settings(config: &Config, lease: Duration) -> Result<Option<ApiSettings>> {
    let a = &config.api;
    let Some(listen) = a.listen_address().map_err(anyhow::Error::msg)? else {
        return Ok(None);
    };
    let address = match a.advertised().map_err(anyhow::Error::msg)? {
        Some(ip) => ip,
        None => route_to_api_server(&config.kubernetes.kubeconfig).context(
            "api.address is empty: finding the address this host reaches the API server from",
        )?,
    };
    Ok(Some(ApiSettings {
        listen,
        address,
        cert: a.cert.clone(),
        key: a.key.clone(),
        ca: a.ca.clone(),
        lease,
    }))
}

/// The local address of a route to the API server (a UDP socket's
/// connect sends nothing).
fn route_to_api_server(kubeconfig: &Path) -> Result<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let server = kc
        .clusters
        .iter()
        .find_map(|c| c.cluster.as_ref()?.server.clone())
        .context("the kubeconfig names no server")?;
    let uri: http::Uri = server.parse().with_context(|| format!("server {server}"))?;
    let host = uri
        .host()
        .context("server without a host")?
        .trim_matches(['[', ']']);
    let port = uri.port_u16().unwrap_or(443);
    let target = (host, port)
        .to_socket_addrs()?
        .next()
        .with_context(|| format!("resolving {host}"))?;
    let bind: std::net::SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let sock = std::net::UdpSocket::bind(bind)?;
    sock.connect(target)?;
    Ok(sock.local_addr()?.ip())
}

/// kvirtd's control socket; without it kvirtd still runs every VM.
fn serve_control(path: &Path, group: Option<u32>, ctx: control::Ctx) {
    match control::bind(path, group) {
        Ok(l) => {
            tokio::spawn(control::serve(l, group, ctx));
        }
        Err(e) => error!(
            "control socket {}: {e}; kvirtctl start, stop, restart, pause, unpause and \
             soft-reboot are unavailable",
            path.display()
        ),
    }
}

/// Status files of kvirt before 0.2 lived in each VM's runtime directory;
/// they move to root's status directory once, read through [`Beneath`] so
/// a VM's planted link or FIFO is left where it is.
fn migrate_status(layout: &HostLayout) {
    let Ok(vms) = Beneath::open(&layout.vms_runtime_dir()).and_then(|d| d.entries()) else {
        return;
    };
    for id in vms {
        let paths = layout.vm_by_id(&id.to_string_lossy());
        if paths.status_file.exists() {
            continue;
        }
        let Ok(dir) = Beneath::open(&paths.runtime_dir) else {
            continue;
        };
        let moved = dir
            .read(LEGACY_STATUS, manifest::MAX_STATUS_FILE)
            .and_then(|text| {
                let status_dir = layout.status_dir();
                std::fs::create_dir_all(&status_dir)?;
                std::fs::set_permissions(&status_dir, std::fs::Permissions::from_mode(0o700))?;
                let tmp = paths.status_file.with_extension("json.tmp");
                std::fs::write(&tmp, text)?;
                std::fs::rename(&tmp, &paths.status_file)
            })
            .and_then(|()| dir.remove(LEGACY_STATUS));
        match moved {
            Ok(()) => info!(
                "moved {} to {}",
                paths.legacy_status_file().display(),
                paths.status_file.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!("{}: not moved: {e}", paths.legacy_status_file().display()),
        }
    }
}

/// The host's VM network: bridge, egress NAT and the persisted leases.
fn host_network(config: &Config, settings: &Settings) -> Result<HostNetwork> {
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
    let subnet: kvirt::core::ipam::Subnet = n.subnet.parse().context("network.subnet")?;
    let subnet6 = (!n.subnet6.is_empty())
        .then(|| kvirt::core::ipam::Subnet6::parse(&n.subnet6, &subnet))
        .transpose()
        .context("network.subnet6")?;
    let net_settings = NetworkSettings {
        cni: kvirt::host::cni::ExecCni {
            path: n.cni_path.clone(),
            cache_dir: n.cni_cache_dir.clone(),
            timeout: Duration::from_secs(n.cni_timeout_seconds),
            host_netns: None,
        },
        cni_config_dir: n.cni_config_dir.clone(),
        subnet,
        subnet6,
        mtu: n.mtu,
        dns,
        dhcp_lease_secs: n.dhcp_lease_seconds,
        netns_dir: kvirt::host::netns::NETNS_DIR.into(),
    };
    let leases = settings.layout.leases_file();
    let (network, dropped) =
        HostNetwork::start(net_settings, leases).context("setting up the host network")?;
    for d in dropped {
        warn!("address lease dropped: {d}");
    }
    Ok(network)
}

/// The host-side adapters, the same whatever the VMIs come from.
struct Host {
    cpus: Arc<DedicatedCpus>,
    units: SystemdBus,
    network: HostNetwork,
    hypervisor: Libvirt,
    storage: HostStorage,
    machines: Machined,
    images: OciImages,
    users: HostUsers,
    marks: FileMarks,
    fences: FileFences,
}

impl Host {
    /// The controller's parts: these adapters, and the source's status
    /// store and recorder.
    fn deps<St: StatusStore, R: Recorder>(self, status: St, recorder: R) -> Deps<Real<St, R>> {
        Deps {
            units: self.units,
            netns: KernelNetns::default(),
            network: self.network,
            hypervisor: self.hypervisor,
            storage: self.storage,
            status,
            recorder,
            machines: self.machines,
            images: self.images,
            users: self.users,
            marks: self.marks,
            fences: self.fences,
            cpus: self.cpus,
        }
    }
}

/// The CPUs VMs may hold alone (configured), checked against those kvirtd
/// may run on, and who held them before this start.
fn dedicated_cpus(config: &Config, settings: &Settings) -> Result<Arc<DedicatedCpus>> {
    let pool = config.vm.dedicated_cpus().map_err(anyhow::Error::msg)?;
    if pool.is_empty() {
        return Ok(Arc::new(DedicatedCpus::none()));
    }
    let online = kvirt::host::cpus::online().context("the CPUs kvirtd may run on")?;
    let missing = pool.minus(&online);
    if !missing.is_empty() {
        bail!(
            "vm.dedicated_cpus: CPUs {missing} are not among those this host runs kvirtd on ({online})"
        );
    }
    let file = settings.layout.dedicated_cpus_file();
    let cpus = DedicatedCpus::open(&file, pool.clone(), online.clone())
        .context("the dedicated CPUs VMs held")?;
    info!(dedicated = %pool, online = %online, "CPUs for VMs with dedicated CPUs");
    Ok(Arc::new(cpus))
}

/// The self-fence (`daemon::fence`), if configured, started first of all:
/// a host cut off never gets further than the wait for its identity or its
/// first list of VMIs. Returns the clock of the Lease's renewals it counts
/// from, which the heartbeat sets.
fn start_self_fence<U: Units + Clone + Send + Sync + 'static>(
    fence: Option<kvirt::core::fence::SelfFence>,
    settings: &Settings,
    units: &U,
) -> Arc<RenewalClock> {
    let renewals = Arc::new(RenewalClock::open(settings.layout.lease_renewed_file()));
    if let Some(policy) = fence {
        let r = renewals.clone();
        tokio::spawn(kvirt::daemon::fence::watch(
            units.clone(),
            FileFences::fences(settings.layout.fenced_dir()),
            policy,
            move || r.unrenewed(),
            |line| {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Status(line)]);
            },
        ));
    }
    renewals
}

/// The real adapters, with the status store and recorder of the source.
struct Real<St, R>(PhantomData<(St, R)>);

impl<St: StatusStore, R: Recorder> Adapters for Real<St, R> {
    type Units = SystemdBus;
    type Netns = KernelNetns;
    type Network = HostNetwork;
    type Hypervisor = Libvirt;
    type Storage = HostStorage;
    type Machines = Machined;
    type Images = OciImages;
    type Users = HostUsers;
    type Status = St;
    type Recorder = R;
    type Marks = FileMarks;
    type Fences = FileFences;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a VM's user may have left where kvirt once wrote the status:
    /// a link to root's file, a FIFO. Only a real file moves.
    #[test]
    fn old_status_files_move_and_planted_ones_stay() {
        let t = tempfile::tempdir().unwrap();
        let layout = HostLayout {
            state_dir: t.path().join("lib"),
            runtime_dir: t.path().join("run"),
            cache_dir: t.path().join("cache"),
        };
        let vm = |id: &str| {
            let p = layout.vm_by_id(id);
            std::fs::create_dir_all(&p.runtime_dir).unwrap();
            p
        };
        let (real, linked, fifo) = (vm("default_a"), vm("default_b"), vm("default_c"));
        std::fs::write(
            real.legacy_status_file(),
            "{\"kind\": \"VirtualMachineInstance\"}",
        )
        .unwrap();
        let secret = t.path().join("secret");
        std::fs::write(&secret, "root's").unwrap();
        std::os::unix::fs::symlink(&secret, linked.legacy_status_file()).unwrap();
        nix::unistd::mkfifo(
            &fifo.legacy_status_file(),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();

        migrate_status(&layout);
        assert!(std::fs::read_to_string(&real.status_file)
            .unwrap()
            .contains("VirtualMachineInstance"));
        assert!(!real.legacy_status_file().exists());
        assert!(!linked.status_file.exists() && !fifo.status_file.exists());
        assert_eq!(std::fs::read_to_string(&secret).unwrap(), "root's");
        let mode = std::fs::metadata(layout.status_dir())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
