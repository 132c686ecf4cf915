//! `kvirtd --print-bootstrap-token` and `kvirtd join`: adding a host to a
//! cluster in two commands, one on each side.

use super::JoinArgs;
use anyhow::{bail, Context, Result};
use kvirt::core::bootstrap::Token;
use kvirt::core::key::is_dns_subdomain;
use kvirt::daemon::config::{Config, SourceKind};
use kvirt::daemon::join::{self, Files, Joined};
use kvirt::daemon::serve::Notice;
use kvirt::host::commit::replace_private;
use std::io::Read as _;
use std::path::Path;
use std::time::Duration;
use tracing::{error, info};

/// The Secret on stdout, the command for the host on stderr (so that
/// stdout goes to `kubectl apply -f -` as it is).
pub fn print_bootstrap_token(node: &str, seconds: u64) -> Result<()> {
    if !is_dns_subdomain(node) {
        bail!("--node {node:?}: not a node name");
    }
    let mut bytes = [0u8; 64];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    let token = Token::from_random(&bytes).context("not enough randomness")?;
    let expires = jiff::Timestamp::now() + jiff::SignedDuration::from_secs(seconds as i64);
    print!(
        "{}",
        token.secret_yaml(node, &expires.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
    );
    eprintln!(
        "node {node} joins until {expires} with:\n  \
         kvirtd join --server <API server URL> --ca-file <the cluster's CA> --token {} --node {node}",
        token.text()
    );
    Ok(())
}

/// The drop-in that makes this host a member of the cluster as `node`:
/// first in name order, so an operator's own drop-ins still override it.
fn dropin(node: &str) -> String {
    format!(
        "# Written by `kvirtd join`: this host is node {node} of a cluster.\n\
         node_name = \"{node}\"\n[source]\nkind = \"kubernetes\"\n"
    )
}

pub fn join_cluster(config_path: &Path, explicit: bool, args: &JoinArgs) -> Result<()> {
    let config = Config::load(config_path, explicit)?;
    let node = args
        .node
        .clone()
        .unwrap_or_else(|| config.node_name.clone());
    if !is_dns_subdomain(&node) {
        bail!("node name {node:?}: not a DNS subdomain (--node)");
    }
    let token = Token::parse(&args.token).map_err(anyhow::Error::msg)?;
    let ca = std::fs::read(&args.ca_file)
        .with_context(|| format!("--ca-file {}", args.ca_file.display()))?;
    if !ca.starts_with(b"-----BEGIN CERTIFICATE-----") {
        bail!(
            "--ca-file {}: not a PEM certificate",
            args.ca_file.display()
        );
    }
    let k = &config.kubernetes;
    let files = Files::of(k);
    let text = join::bootstrap_kubeconfig(&args.server, &ca, &token.text());
    replace_private(&files.bootstrap, text.as_bytes())
        .with_context(|| files.bootstrap.display().to_string())?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let now = jiff::Timestamp::now().as_second();
    let joined = rt.block_on(join::ensure(
        &files,
        &files.bootstrap,
        &node,
        k.certificate_seconds,
        now,
        false,
        |name| {
            println!(
                "waiting for certificate request {name} to be approved \
                 (by a joined kvirtd, or: kubectl certificate approve {name})"
            )
        },
    ))?;
    match joined {
        Joined::Already => println!(
            "{} already holds node {node}'s identity",
            files.kubeconfig.display()
        ),
        Joined::Issued(name) => println!(
            "joined as kvirt:node:{node} ({name}): {}",
            files.kubeconfig.display()
        ),
    }
    let dir = kvirt::daemon::config::drop_in_dir(config_path);
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("10-join.toml");
    std::fs::write(&file, dropin(&node)).with_context(|| file.display().to_string())?;
    restart_if_harmless(&config)
}

/// kvirtd restarted as a cluster member; unless it runs VMs of manifests
/// (standalone), which would stop: then the operator says when.
fn restart_if_harmless(config: &Config) -> Result<()> {
    let manifests = config.source.kind == SourceKind::Directory
        && std::fs::read_dir(&config.source.directory)
            .map(|d| {
                d.flatten().any(|e| {
                    e.path()
                        .extension()
                        .is_some_and(|x| x == "yaml" || x == "yml" || x == "json")
                })
            })
            .unwrap_or(false);
    if manifests {
        println!(
            "kvirtd runs VMs of {}, which stop when it restarts as a cluster member: \
             restart it when they may (systemctl restart kvirtd)",
            config.source.directory.display()
        );
        return Ok(());
    }
    let status = std::process::Command::new("systemctl")
        .args(["try-restart", "kvirtd.service"])
        .status();
    match status {
        Ok(s) if s.success() => {
            info!("kvirtd restarted (if it ran) as a cluster member");
            Ok(())
        }
        other => {
            error!("systemctl try-restart kvirtd.service: {other:?}");
            bail!("restart kvirtd yourself: systemctl restart kvirtd")
        }
    }
}

/// At start in a cluster: while the node kubeconfig is missing, or holds
/// this node's identity run out, one is asked for with the bootstrap
/// kubeconfig, retried until it comes (systemd is told why it waits).
pub async fn bootstrap_identity(config: &Config) -> Result<()> {
    let k = &config.kubernetes;
    let files = Files::of(k);
    let node = &config.node_name;
    let now = || jiff::Timestamp::now().as_second();
    if !join::needed(&files, node, now())? {
        return Ok(());
    }
    if std::fs::symlink_metadata(&files.bootstrap).is_err() {
        bail!(
            "no valid identity in {} and no bootstrap kubeconfig at {}: run kvirtd join",
            files.kubeconfig.display(),
            files.bootstrap.display()
        );
    }
    let status = |s: &str| {
        let _ = sd_notify::notify(&[
            sd_notify::NotifyState::Status(s),
            sd_notify::NotifyState::ExtendTimeoutUsec(60_000_000),
            sd_notify::NotifyState::Watchdog,
        ]);
    };
    loop {
        status("joining: asking for this node's identity");
        let asked = join::ensure(
            &files,
            &files.bootstrap,
            node,
            k.certificate_seconds,
            now(),
            false,
            |name| {
                let line = format!(
                    "joining: waiting for approval of {name} (kubectl certificate approve {name})"
                );
                info!("{line}");
                status(&line);
            },
        );
        // The wait keeps telling systemd it is alive.
        let mut asked = std::pin::pin!(asked);
        let result = loop {
            tokio::select! {
                r = &mut asked => break r,
                _ = tokio::time::sleep(Duration::from_secs(10)) => status("joining: waiting for approval"),
            }
        };
        match result {
            Ok(j) => {
                info!("this node's identity: {j:?}");
                return Ok(());
            }
            Err(e) => {
                error!("joining: {e}");
                status(&format!("joining failed, retrying in 30 s: {e}"));
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        }
    }
}

/// Renews this host's identity at 70–90 % of its certificate's life, with
/// the identity itself (a joined kvirtd approves it, this one included),
/// then re-executes kvirtd in place (same PID: systemd and the VMs see no
/// restart) so every client uses the new certificate. An identity run out
/// asks again with the bootstrap kubeconfig if there is one; without one,
/// `notice` says so on `STATUS=` (the VMs run on). An identity kvirt did
/// not make (an administrator's kubeconfig) is left alone.
pub fn renew_in_background(config: &Config, notice: Notice) {
    let k = &config.kubernetes;
    let files = Files::of(k);
    let node = config.node_name.clone();
    let seconds = k.certificate_seconds;
    tokio::spawn(async move {
        loop {
            let held = match join::current(&files.kubeconfig) {
                Ok(Some(h)) if h.user == kvirt::core::csr::node_user(&node) => h,
                _ => return,
            };
            let mut byte = [0u8; 1];
            let _ = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut byte));
            let at = kvirt::core::csr::renew_at(
                held.not_before,
                held.not_after,
                f64::from(byte[0]) / 255.0,
            );
            let now = jiff::Timestamp::now().as_second();
            info!(
                renew_at = at,
                expires = held.not_after,
                "this node's certificate"
            );
            tokio::time::sleep(Duration::from_secs((at - now).max(0) as u64)).await;
            let now = jiff::Timestamp::now().as_second();
            let with =
                if now >= held.not_after && std::fs::symlink_metadata(&files.bootstrap).is_ok() {
                    &files.bootstrap
                } else {
                    &files.kubeconfig
                };
            match join::ensure(&files, with, &node, seconds, now, true, |name| {
                info!("renewing: waiting for approval of {name}")
            })
            .await
            {
                Ok(j) => {
                    info!("this node's identity renewed ({j:?}): kvirtd re-executes to use it");
                    reexec();
                }
                Err(e) => {
                    error!("renewing this node's identity: {e}; again in 60 s");
                    if now >= held.not_after {
                        *notice.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(expired(&files, held.not_after));
                    }
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }
        }
    });
}

/// What `STATUS=` says of an identity run out that could not be renewed.
fn expired(files: &Files, not_after: i64) -> String {
    let at = jiff::Timestamp::from_second(not_after)
        .map(|t| t.to_string())
        .unwrap_or_else(|_| not_after.to_string());
    let how = if std::fs::symlink_metadata(&files.bootstrap).is_ok() {
        format!(
            "its bootstrap kubeconfig {} was refused",
            files.bootstrap.display()
        )
    } else {
        format!(
            "no bootstrap kubeconfig ({}) to ask again with: kvirtd join",
            files.bootstrap.display()
        )
    };
    format!("this host's certificate expired at {at} and {how}; VMs run on, the API server is out of reach")
}

/// kvirtd again, in this process: its arguments and environment as they
/// were (systemd's notify socket and watchdog included).
fn reexec() {
    use std::os::unix::ffi::OsStrExt;
    let args: Vec<std::ffi::CString> = std::env::args_os()
        .filter_map(|a| std::ffi::CString::new(a.as_bytes()).ok())
        .collect();
    let exe = c"/proc/self/exe";
    let e = nix::unistd::execv(exe, &args);
    error!("re-executing kvirtd: {e:?}; exiting for systemd to start it again");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_run_out_says_when_and_what_would_renew_it() {
        let t = tempfile::tempdir().unwrap();
        let files = Files {
            kubeconfig: t.path().join("kubeconfig"),
            bootstrap: t.path().join("bootstrap-kubeconfig"),
        };
        let none = expired(&files, 1_800_000_000);
        assert!(none.contains("expired at 2027-01-15T08:00:00Z"), "{none}");
        assert!(none.contains("no bootstrap kubeconfig"), "{none}");
        assert!(none.contains("kvirtd join"), "{none}");
        assert!(none.contains("VMs run on"), "{none}");
        std::fs::write(&files.bootstrap, "x").unwrap();
        let refused = expired(&files, 1_800_000_000);
        assert!(refused.contains("was refused"), "{refused}");
    }
}
