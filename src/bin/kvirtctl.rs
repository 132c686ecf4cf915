//! kvirtctl: look at and into the VMs kvirtd runs on this host.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvirt::core::convert::{self, ConvertContext, DomainType};
use kvirt::core::cpuset::CpuSet;
use kvirt::core::instancetype::ObjectKey;
use kvirt::core::key::VmKey;
use kvirt::core::kinds;
use kvirt::core::layout::HostLayout;
use kvirt::daemon::config::{Config, DEFAULT_PATH};
use kvirt::daemon::control::Request;
use kvirt::host::beneath::Beneath;
use kvirt::sources::manifest::{read_all_status, ManifestDir};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Operator CLI for kvirt: list VMs, show their status, attach to their
/// serial console, and convert VMI manifests to libvirt domain XML offline.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// kvirtd's configuration file, for its directories.
    #[arg(long, short, global = true, default_value = DEFAULT_PATH)]
    config: PathBuf,
    /// In a cluster: the user's kubeconfig (default: $KUBECONFIG, then
    /// ~/.kube/config). start, stop, restart, pause, unpause, soft-reboot
    /// and console go through the API server as that user, as virtctl's do.
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List VMs on this host, like `kubectl get vmi`.
    Ls,
    /// Print one VM's VMI object with its status, as JSON.
    Status {
        /// NAMESPACE/NAME
        vm: String,
    },
    /// Print one VirtualMachine with its status, as JSON.
    Vm {
        /// NAMESPACE/NAME
        vm: String,
    },
    /// Start a VirtualMachine (as `virtctl start`): a Halted one becomes
    /// Always, a Manual one gets a start request.
    Start {
        /// NAMESPACE/NAME
        vm: String,
        /// Start the VMI with its vCPUs stopped (`startStrategy: Paused`);
        /// unpause it to run.
        #[arg(long)]
        paused: bool,
    },
    /// Stop a VirtualMachine gracefully (as `virtctl stop`): it becomes
    /// Halted (a Manual one gets a stop request) and stays stopped.
    Stop {
        /// NAMESPACE/NAME
        vm: String,
        /// Seconds the guest has to shut down (at most its own
        /// terminationGracePeriodSeconds).
        #[arg(long)]
        grace: Option<u64>,
        /// Do not wait for the guest: with no --grace, 0 seconds.
        #[arg(long)]
        force: bool,
    },
    /// Restart a VirtualMachine: its VMI is stopped and a new one started.
    Restart {
        /// NAMESPACE/NAME
        vm: String,
        /// Do not wait for the guest: its VMI is stopped within 1 second
        /// (as `virtctl restart --force`).
        #[arg(long)]
        force: bool,
    },
    /// Pause a running VM (its VMI's vCPUs stop; Ready=False, Paused=True).
    Pause {
        /// NAMESPACE/NAME of a VMI or a VirtualMachine
        vm: String,
    },
    /// Unpause a paused VM.
    Unpause {
        /// NAMESPACE/NAME of a VMI or a VirtualMachine
        vm: String,
    },
    /// Reboot the guest in the same QEMU: through the guest agent, else
    /// the ACPI power button.
    SoftReboot {
        /// NAMESPACE/NAME of a VMI or a VirtualMachine
        vm: String,
    },
    /// Live-migrate a running VMI to another kvirt host: its guest goes on
    /// there. Standalone, to the kvirtd at --to (its manifest moves with
    /// it); in a cluster, by a VirtualMachineInstanceMigration.
    Migrate {
        /// NAMESPACE/NAME of a VMI
        vm: String,
        /// The target kvirtd's migration port (its `migration.listen`),
        /// ADDRESS:PORT; in a cluster, left out: the VMI's scheduling
        /// rules choose among the kvirt hosts (a migration object is made)
        #[arg(long)]
        to: Option<String>,
        /// The most the migration may use, in MiB/s (KubeVirt's
        /// `bandwidthPerMigration`); without it, as fast as it goes
        #[arg(long)]
        bandwidth: Option<u64>,
    },
    /// Empty this host for maintenance: cordon it (no VM arrives), then
    /// live-migrate each VMI whose evictionStrategy is LiveMigrate or
    /// LiveMigrateIfPossible to the kvirtd at --to (in a cluster, by a
    /// migration object each, to the hosts their rules choose), stop the
    /// VirtualMachines of the others as their strategy says, and name what
    /// stays, each line as it happens. Fails unless the host ends empty.
    Drain {
        /// This host's node name (as kubectl drain names one): a drain run
        /// on another host by mistake is refused
        node: Option<String>,
        /// The target kvirtd's migration port, ADDRESS:PORT (standalone)
        #[arg(long)]
        to: Option<String>,
        /// The most each migration may use, in MiB/s
        #[arg(long)]
        bandwidth: Option<u64>,
    },
    /// Lift `drain`'s cordon: VMs may arrive here again.
    Uncordon {
        /// This host's node name, checked as drain's
        node: Option<String>,
    },
    /// Attach to a VM's serial console (detach with Ctrl-]).
    Console {
        /// NAMESPACE/NAME
        vm: String,
    },
    /// Convert a manifest (YAML or JSON) of a VMI, VM, pool or replica set
    /// to the libvirt domain XML of the VMI it makes, offline.
    Domxml {
        file: PathBuf,
        /// Domain type to produce.
        #[arg(long, value_enum, default_value = "kvm")]
        domain_type: DomainTypeArg,
        /// Print the VMI with KubeVirt's defaults applied (YAML), not XML.
        #[arg(long)]
        defaulted: bool,
    },
    /// Package files (a qcow2 or raw disk; a kernel and initrd for
    /// kernelBoot) as a containerDisk image, each at /disk/<file name>, and
    /// push it to a registry.
    PushDisk {
        /// Where to push it: REGISTRY/REPOSITORY:TAG. Loopback registries
        /// and [storage] insecure_registries are reached over plain HTTP.
        image: String,
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Log in to the registry as this user; the password is read from
        /// standard input (as `docker login --password-stdin`).
        #[arg(long)]
        username: Option<String>,
    },
    /// Print this manual page (roff) for packaging.
    #[command(hide = true)]
    Man,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum DomainTypeArg {
    Kvm,
    Qemu,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let explicit = args.config != Path::new(DEFAULT_PATH);
    let config = || Config::load(&args.config, explicit);
    let user = args.kubeconfig.clone();
    // In a cluster the API server decides, with the user's own rights.
    let in_cluster = |c: &Config| c.source.kind == kvirt::daemon::config::SourceKind::Kubernetes;
    match args.command {
        Command::Ls => ls(&config()?.layout()),
        Command::Status { vm } => status(&config()?.layout(), &vm),
        Command::Console { vm } => {
            let config = config()?;
            if in_cluster(&config) {
                api_console(user.as_deref(), &vm)
            } else {
                console(&config.layout(), &vm)
            }
        }
        Command::Vm { vm } => show_vm(&config()?.layout(), &vm),
        Command::Start { vm, paused } => request(
            &config()?,
            user.as_deref(),
            Request {
                paused,
                ..asks("start", vm)
            },
        ),
        Command::Stop { vm, grace, force } => request(
            &config()?,
            user.as_deref(),
            Request {
                grace: grace.or(force.then_some(0)),
                ..asks("stop", vm)
            },
        ),
        Command::Restart { vm, force } => request(
            &config()?,
            user.as_deref(),
            Request {
                force,
                ..asks("restart", vm)
            },
        ),
        Command::Pause { vm } => request(&config()?, user.as_deref(), asks("pause", vm)),
        Command::Unpause { vm } => request(&config()?, user.as_deref(), asks("unpause", vm)),
        Command::SoftReboot { vm } => request(&config()?, user.as_deref(), asks("soft-reboot", vm)),
        Command::Migrate { vm, to, bandwidth } => control(
            &config()?.layout(),
            &Request {
                to,
                bandwidth,
                ..asks("migrate", vm)
            },
        ),
        Command::Drain {
            node,
            to,
            bandwidth,
        } => control(
            &config()?.layout(),
            &Request {
                action: "drain".into(),
                node,
                to,
                bandwidth,
                ..Default::default()
            },
        ),
        Command::Uncordon { node } => control(
            &config()?.layout(),
            &Request {
                action: "uncordon".into(),
                node,
                ..Default::default()
            },
        ),
        Command::Domxml {
            file,
            domain_type,
            defaulted,
        } => domxml(&config()?, &file, domain_type, defaulted),
        Command::PushDisk {
            image,
            files,
            username,
        } => {
            let insecure = config()?.storage.insecure_registries;
            let auth = match username {
                None => None,
                Some(username) => {
                    let mut password = String::new();
                    std::io::stdin()
                        .read_line(&mut password)
                        .context("reading the password from standard input")?;
                    Some(kvirt::core::pullsecret::Credentials {
                        username,
                        password: password.trim_end_matches(['\r', '\n']).to_owned(),
                    })
                }
            };
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let url = rt.block_on(kvirt::host::image::push_disk(
                &files,
                &image,
                &insecure,
                auth.as_ref(),
            ))?;
            println!("{url}");
            Ok(())
        }
        Command::Man => {
            use clap::CommandFactory;
            kvirt::daemon::man::render(
                Args::command().name("kvirtctl"),
                "1",
                &[
                    (
                        "/etc/kvirt/kvirtd.toml",
                        "kvirtd's configuration, for its directories",
                    ),
                    (
                        "/run/kvirt/status/",
                        "each VMI with its status (standalone)",
                    ),
                    (
                        "/run/kvirt/control.sock",
                        "kvirtd's control socket, root's alone",
                    ),
                    (
                        "/run/kvirt/vms/<ns>_<name>/serial.sock",
                        "a VM's serial console",
                    ),
                ],
                &mut std::io::stdout(),
            )?;
            Ok(())
        }
    }
}

/// Kubernetes' short age form: 42s, 5m, 3h, 2d.
fn age(created: Option<&str>) -> String {
    let Some(t) = created.and_then(|c| c.parse::<jiff::Timestamp>().ok()) else {
        return "<unknown>".into();
    };
    let secs = (jiff::Timestamp::now().as_second() - t.as_second()).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn ls(layout: &HostLayout) -> Result<()> {
    let rows: Vec<[String; 7]> = read_all_status(layout)
        .iter()
        .map(|v| {
            let ip = v
                .status
                .interfaces
                .first()
                .and_then(|i| i.get("ipAddress"))
                .and_then(|i| i.as_str())
                .unwrap_or("");
            let created = v
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.to_string());
            [
                v.metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".into()),
                v.metadata.name.clone().unwrap_or_default(),
                v.status.phase.map(|p| format!("{p:?}")).unwrap_or_default(),
                ready(v),
                ip.to_owned(),
                v.status.node_name.clone().unwrap_or_default(),
                age(created.as_deref()),
            ]
        })
        .collect();
    let mut out = std::io::stdout().lock();
    table(
        &mut out,
        ["NAMESPACE", "NAME", "PHASE", "READY", "IP", "NODE", "AGE"],
        &rows,
    )?;
    let records = kvirt::sources::manifest::VmRecords {
        dir: layout.virtual_machines_dir(),
    }
    .load_all();
    if !records.is_empty() {
        let rows: Vec<[String; 5]> = records
            .iter()
            .map(|(key, r)| {
                let st = &r.vm.status;
                let created =
                    r.vm.metadata
                        .creation_timestamp
                        .as_ref()
                        .map(|t| t.0.to_string());
                [
                    key.namespace().to_owned(),
                    key.name().to_owned(),
                    age(created.as_deref()),
                    st["printableStatus"].as_str().unwrap_or("").to_owned(),
                    if st["ready"] == true { "True" } else { "False" }.into(),
                ]
            })
            .collect();
        writeln!(out, "\nVIRTUAL MACHINES")?;
        table(
            &mut out,
            ["NAMESPACE", "NAME", "AGE", "STATUS", "READY"],
            &rows,
        )?;
    }
    let unusable = kvirt::sources::manifest::read_manifest_errors(&layout.manifest_errors_file());
    if !unusable.is_empty() {
        writeln!(out, "\nMANIFESTS NOT USED")?;
        for (path, error) in unusable {
            writeln!(out, "{path}: {error}")?;
        }
    }
    Ok(())
}

/// Columns padded to their widest cell, as kubectl prints them.
fn table<const N: usize>(
    out: &mut impl Write,
    header: [&str; N],
    rows: &[[String; N]],
) -> Result<()> {
    let header = header.map(String::from);
    let mut widths = header.clone().map(|h| h.len());
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.len());
        }
    }
    for r in std::iter::once(&header).chain(rows) {
        let line: Vec<String> = r
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        writeln!(out, "{}", line.join("   ").trim_end())?;
    }
    Ok(())
}

fn show_vm(layout: &HostLayout, vm: &str) -> Result<()> {
    let key = VmKey::parse(vm)?;
    let records = kvirt::sources::manifest::VmRecords {
        dir: layout.virtual_machines_dir(),
    }
    .load_all();
    let r = records
        .get(&key)
        .with_context(|| format!("no VirtualMachine {key} on this host"))?;
    println!("{}", serde_json::to_string_pretty(&r.vm)?);
    Ok(())
}

fn asks(action: &str, vm: String) -> Request {
    Request {
        action: action.into(),
        vm,
        ..Default::default()
    }
}

/// start, stop, restart, pause, unpause, soft-reboot: kvirtd's control
/// socket on a standalone host; in a cluster, KubeVirt's subresource
/// through the API server as the user (pause, unpause and soft-reboot name
/// a VMI, as `virtctl ... vmi` does).
fn request(config: &Config, kubeconfig: Option<&Path>, req: Request) -> Result<()> {
    if config.source.kind != kvirt::daemon::config::SourceKind::Kubernetes {
        return control(&config.layout(), &req);
    }
    let key = VmKey::parse(&req.vm)?;
    let action = req.action.as_str();
    // virtctl's bodies (StartOptions, StopOptions, RestartOptions).
    let (resource, sub, body) = match action {
        "start" => (
            "virtualmachines",
            action,
            serde_json::json!({ "paused": req.paused }),
        ),
        "restart" if req.force => (
            "virtualmachines",
            action,
            serde_json::json!({ "gracePeriodSeconds": 0 }),
        ),
        "restart" => ("virtualmachines", action, serde_json::json!({})),
        "stop" => (
            "virtualmachines",
            "stop",
            serde_json::json!({ "gracePeriod": req.grace }),
        ),
        "soft-reboot" => (
            "virtualmachineinstances",
            "softreboot",
            serde_json::json!({}),
        ),
        _ => ("virtualmachineinstances", action, serde_json::json!({})),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = user_client(kubeconfig).await?;
        kvirt::sources::cluster::subresources::put(&client, &key, resource, sub, &body)
            .await
            .map_err(anyhow::Error::msg)
    })
    .with_context(|| format!("{action} {key}"))?;
    let what = if resource == "virtualmachines" {
        "VM"
    } else {
        "VMI"
    };
    println!("{what} {key} was scheduled to {action}");
    Ok(())
}

/// The user's client: `--kubeconfig`, else what kubectl would use.
async fn user_client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(p) => {
            let kc = kube::config::Kubeconfig::read_from(p)?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// A VMI's serial console through the API server (detach with Ctrl-]).
fn api_console(kubeconfig: Option<&Path>, vm: &str) -> Result<()> {
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let key = VmKey::parse(vm)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let client = user_client(kubeconfig).await?;
        let ws = kvirt::sources::cluster::subresources::connect(&client, &key, "console")
            .await
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("console of {key}"))?;
        let (mut tx, mut rx) = ws.split();
        let (in_tx, mut in_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
        let detach_tx = in_tx.clone();
        let raw = keyboard(
            &key,
            move |b| in_tx.blocking_send(b.to_vec()).is_ok(),
            // Ctrl-] itself stands for the detach.
            move || drop(detach_tx.blocking_send(vec![0x1d])),
        )?;
        let mut out = std::io::stdout();
        let mut input_open = true;
        let mut why = None;
        loop {
            tokio::select! {
                b = in_rx.recv(), if input_open => match b {
                    Some(b) if b == [0x1d] => break,
                    Some(b) => { tx.send(Message::Binary(b.into())).await?; }
                    None => input_open = false,
                },
                m = rx.next() => match m {
                    Some(Ok(Message::Binary(b))) => { out.write_all(&b)?; out.flush()?; }
                    Some(Ok(Message::Close(frame))) => { why = frame.map(|f| f.reason.to_string()); break; }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => { why = Some(e.to_string()); break; }
                    None => break,
                },
            }
        }
        drop(raw);
        if let Some(why) = why.filter(|w| !w.is_empty()) {
            eprintln!("\r\nconsole closed: {why}");
        }
        anyhow::Ok(())
    })
}

/// One request to kvirtd's control socket; its refusal is an error.
fn control(layout: &HostLayout, req: &Request) -> Result<()> {
    let path = layout.control_socket();
    let show = &mut |line: &str| {
        println!("{line}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let answer = kvirt::daemon::control::call_with(&path, req, show)
        .with_context(|| format!("asking kvirtd at {}", path.display()))?;
    if !answer.ok {
        bail!("{}", answer.message);
    }
    println!("{}", answer.message);
    Ok(())
}

/// The `Ready` condition, with its reason when not ready for a reason
/// other than not running (`False (DaemonUnresponsive)`).
fn ready(v: &kvirt::core::vmi::VirtualMachineInstance) -> String {
    let Some(c) = v.status.conditions.iter().find(|c| c.type_ == "Ready") else {
        return String::new();
    };
    match c.reason.as_deref() {
        Some(r) if c.status != "True" && r != "NotRunning" => format!("{} ({r})", c.status),
        _ => c.status.clone(),
    }
}

fn status(layout: &HostLayout, vm: &str) -> Result<()> {
    let key = VmKey::parse(vm)?;
    let path = layout.vm(&key).status_file;
    let text = kvirt::sources::manifest::read_status(&path)
        .with_context(|| format!("no status for {key} ({})", path.display()))?;
    println!("{text}");
    Ok(())
}

fn console(layout: &HostLayout, vm: &str) -> Result<()> {
    let key = VmKey::parse(vm)?;
    let paths = layout.vm(&key);
    let path = paths.serial_socket();
    // The VM's user can plant a link there: the socket is found beneath
    // its runtime directory, never followed elsewhere.
    let stream = Beneath::open(&paths.runtime_dir)
        .and_then(|d| d.socket(path.strip_prefix(&paths.runtime_dir).unwrap_or(&path)))
        .and_then(|s| UnixStream::connect(s.path()))
        .with_context(|| format!("connecting to {key}'s serial console at {}", path.display()))?;
    let mut writer = stream.try_clone()?;
    let closer = stream.try_clone()?;
    let raw = keyboard(
        &key,
        move |b| writer.write_all(b).is_ok(),
        move || drop(closer.shutdown(std::net::Shutdown::Both)),
    )?;
    let mut reader = stream;
    let mut out = std::io::stdout();
    let mut buf = [0u8; 4096];
    loop {
        match reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.write_all(&buf[..n])?;
                out.flush()?;
            }
        }
    }
    drop(raw);
    Ok(())
}

/// A console's keyboard: the terminal in raw mode (until the guard is
/// dropped), and a thread handing what is typed to `send`, until end of
/// input (the console stays attached for output), a failed send, or
/// Ctrl-] (what came before it is sent, then `detach`).
fn keyboard(
    key: &VmKey,
    mut send: impl FnMut(&[u8]) -> bool + Send + 'static,
    detach: impl FnOnce() + Send + 'static,
) -> Result<Option<RawTty>> {
    let tty = nix::unistd::isatty(std::io::stdin()).unwrap_or(false);
    if tty {
        eprintln!("Connected to {key}; detach with Ctrl-]");
    }
    let raw = tty.then(RawTty::enter).transpose()?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        let mut stdin = std::io::stdin().lock();
        while let Ok(n) = stdin.read(&mut buf) {
            let typed = &buf[..n];
            match typed.iter().position(|&b| b == 0x1d) {
                _ if n == 0 => return,
                Some(i) => {
                    if i > 0 {
                        send(&typed[..i]);
                    }
                    return detach();
                }
                None if !send(typed) => return,
                None => {}
            }
        }
    });
    Ok(raw)
}

/// Puts the terminal in raw mode for the console, restoring it on drop.
struct RawTty(nix::sys::termios::Termios);

impl RawTty {
    fn enter() -> Result<Self> {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin)?;
        let mut raw = saved.clone();
        cfmakeraw(&mut raw);
        tcsetattr(&stdin, SetArg::TCSANOW, &raw)?;
        Ok(Self(saved))
    }
}

impl Drop for RawTty {
    fn drop(&mut self) {
        let _ = nix::sys::termios::tcsetattr(
            std::io::stdin(),
            nix::sys::termios::SetArg::TCSANOW,
            &self.0,
        );
    }
}

fn domxml(config: &Config, file: &Path, domain_type: DomainTypeArg, defaulted: bool) -> Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let docs: Vec<serde_json::Value> = if file.extension().is_some_and(|e| e == "json") {
        vec![serde_json::from_str(&text)?]
    } else {
        let mut docs = Vec::new();
        for d in serde_norway::Deserializer::from_str(&text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(d)?;
            if !v.is_null() {
                docs.push(v);
            }
        }
        docs
    };
    // The instancetypes and preferences of the file itself, else the
    // manifest directory's.
    let mut objects = ManifestDir::new(config.source.directory.clone(), None)
        .scan()
        .instancetypes;
    for d in &docs {
        if let Some(Ok(key)) = ObjectKey::of_object(d) {
            let mut d = d.clone();
            if key.kind.namespaced() && d.pointer("/metadata/namespace").is_none() {
                d["metadata"]["namespace"] = "default".into();
            }
            objects.insert(key, d);
        }
    }
    let doc = docs
        .iter()
        .find(|d| ObjectKey::of_object(d).is_none())
        .with_context(|| format!("{} holds no VMI, VM, pool or replica set", file.display()))?;
    let mut vmi = kinds::first_instance(doc, &|k| objects.get(k).cloned())
        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    vmi.metadata
        .uid
        .get_or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
    let key = vmi.key()?;
    let domain_type = match domain_type {
        DomainTypeArg::Kvm => DomainType::Kvm,
        DomainTypeArg::Qemu => DomainType::Qemu,
    };
    if defaulted {
        kvirt::core::defaults::apply(&mut vmi, &key, domain_type);
        print!("{}", serde_norway::to_string(&vmi)?);
        return Ok(());
    }
    let layout = config.layout();
    let paths = layout.vm(&key);
    let roots = config.host_disk_roots();
    let claims = config.claims().map_err(anyhow::Error::msg)?;
    // Dedicated CPUs as kvirtd would place them on a host that holds none:
    // the first of those it dedicates (of all, when it dedicates none).
    let pool = config.vm.dedicated_cpus().map_err(anyhow::Error::msg)?;
    let placed: Option<CpuSet> = convert::dedicated_cpus_wanted(&vmi).map(|n| {
        let all = (0..).take(n as usize).collect();
        let first: CpuSet = pool.iter().take(n as usize).collect();
        if first.len() == n as usize {
            first
        } else {
            all
        }
    });
    let ctx = ConvertContext {
        key: &key,
        paths: &paths,
        domain_type,
        host_disk_roots: roots.of(key.namespace()),
        shared_roots: &[],
        // The XML does not depend on what the objects hold.
        cluster: true,
        // Nor on the host it is made on: it may be for another.
        capacity: None,
        limits: config.vm.limits().map_err(anyhow::Error::msg)?,
        claims: &claims,
        dedicated_cpus: placed.as_ref(),
    };
    match convert::convert_all_errors(&vmi, &ctx) {
        Ok(c) => {
            print!("{}", c.domain_xml);
            Ok(())
        }
        Err(errors) => {
            for e in &errors {
                eprintln!("error: {e}");
            }
            bail!(
                "{} cannot be converted ({} problems)",
                file.display(),
                errors.len()
            )
        }
    }
}
