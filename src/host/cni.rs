//! Runs CNI plugins for a VM's secondary networks, as a container runtime
//! does for a pod (the CNI spec; libcni's order and records): found by name
//! in the plugin directories, run with the spec's environment only, each
//! with a deadline and bounded output. Every ADD is recorded before the
//! first plugin runs and again with its result, in libcni's cache layout,
//! so that DEL always gets the config ADD used — after an edit of the
//! NetworkAttachmentDefinition, and after a crash at any point.

use crate::core::cni::{
    self, plugin_failure, plugin_stdin, CniError, CniResult, Command, ConfList, Record, Runtime,
};
use serde_json::Value;
use std::future::Future;
use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where Debian's `containernetworking-plugins` and the usual upstream
/// install put plugins.
pub const DEFAULT_PATH: &str = "/usr/lib/cni:/opt/cni/bin";
/// libcni's cache directory: `results/` holds one record per attachment.
pub const DEFAULT_CACHE_DIR: &str = "/var/lib/cni";
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// A VM's secondary networks as the loop drives them.
pub trait Cni: Send + Sync + 'static {
    /// Attaches one network: recorded, its plugins run in order, the result
    /// recorded. A failure is undone (DEL, record removed) before it is
    /// returned with the plugin's words.
    fn add(
        &self,
        list: &ConfList,
        rt: &Runtime,
    ) -> impl Future<Output = Result<(Value, CniResult), CniError>> + Send;
    /// Detaches the attachment of this record (its plugins in reverse, with
    /// the recorded config and result), then removes the record. A missing
    /// record is done already; a failure keeps it for the next try.
    fn del(&self, file: &str) -> impl Future<Output = Result<(), CniError>> + Send;
    /// kvirt's records (others' are left alone), with the files that could
    /// not be read.
    fn records(&self) -> (Vec<Record>, Vec<CniError>);
}

#[derive(Clone, Debug)]
pub struct ExecCni {
    /// Plugin directories, searched in order (`CNI_PATH`).
    pub path: Vec<PathBuf>,
    pub cache_dir: PathBuf,
    pub timeout: Duration,
    /// Run plugins from this network namespace instead of kvirtd's own
    /// (where the host side of their links goes): tests.
    pub host_netns: Option<PathBuf>,
}

impl Default for ExecCni {
    fn default() -> Self {
        Self {
            path: std::env::split_paths(DEFAULT_PATH).collect(),
            cache_dir: DEFAULT_CACHE_DIR.into(),
            timeout: DEFAULT_TIMEOUT,
            host_netns: None,
        }
    }
}

fn record_err(file: &str, message: impl std::fmt::Display) -> CniError {
    CniError::Record {
        file: file.into(),
        message: message.to_string(),
    }
}

impl ExecCni {
    fn results_dir(&self) -> PathBuf {
        self.cache_dir.join("results")
    }

    fn cni_path(&self) -> String {
        std::env::join_paths(&self.path)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The plugin's executable: a regular file of that name in the first
    /// directory that has one.
    fn find(&self, plugin: &str) -> Result<PathBuf, CniError> {
        self.path
            .iter()
            .map(|d| d.join(plugin))
            .find(|p| {
                std::fs::metadata(p)
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
            .ok_or_else(|| CniError::Plugin {
                plugin: plugin.into(),
                message: format!("no such plugin in {}", self.cni_path()),
            })
    }

    fn write_record(&self, r: &Record) -> Result<(), CniError> {
        let dir = self.results_dir();
        std::fs::create_dir_all(&dir).map_err(|e| record_err(&r.file_name(), e))?;
        crate::host::commit::replace_private(&dir.join(r.file_name()), &r.to_bytes())
            .map_err(|e| record_err(&r.file_name(), e))
    }

    fn read_record(&self, file: &str) -> Result<Option<Record>, CniError> {
        if file.contains('/') || file.starts_with('.') {
            return Err(record_err(file, "not a record's name"));
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(self.results_dir().join(file));
        let f = match f {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            r => r.map_err(|e| record_err(file, e))?,
        };
        if !f.metadata().is_ok_and(|m| m.is_file()) {
            return Err(record_err(file, "not a regular file"));
        }
        let mut bytes = Vec::new();
        f.take(2 * cni::MAX_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| record_err(file, e))?;
        Record::read(file, &bytes)
    }

    fn remove_record(&self, file: &str) -> Result<(), CniError> {
        match std::fs::remove_file(self.results_dir().join(file)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(record_err(file, e)),
            _ => Ok(()),
        }
    }

    /// One plugin run: its result (ADD) or nothing.
    async fn exec(
        &self,
        command: Command,
        list: &ConfList,
        i: usize,
        prev: Option<&Value>,
        rt: &Runtime,
    ) -> Result<Option<(Value, CniResult)>, CniError> {
        let plugin = list.plugins[i]["type"].as_str().unwrap_or_default();
        let exe = self.find(plugin)?;
        let stdin = plugin_stdin(list, i, prev, rt);
        let run = run(
            &exe,
            cni::env(command, rt, &self.cni_path()),
            stdin,
            self.host_netns.clone(),
        );
        let (ok, status, out, err) = match tokio::time::timeout(self.timeout, run).await {
            Ok(r) => r.map_err(|e| CniError::Plugin {
                plugin: plugin.into(),
                message: e.to_string(),
            })?,
            Err(_) => {
                return Err(CniError::Plugin {
                    plugin: plugin.into(),
                    message: format!("{} took longer than {:?}", command.as_str(), self.timeout),
                })
            }
        };
        if !ok {
            return Err(plugin_failure(plugin, &status, &out, &err));
        }
        match command {
            Command::Add => cni::parse_result(plugin, &out).map(Some),
            _ => Ok(None),
        }
    }

    async fn del_list(
        &self,
        list: &ConfList,
        rt: &Runtime,
        result: Option<&Value>,
    ) -> Result<(), CniError> {
        let prev = result.filter(|_| cni::del_gets_prev_result(&list.cni_version));
        for i in (0..list.plugins.len()).rev() {
            self.exec(Command::Del, list, i, prev, rt).await?;
        }
        Ok(())
    }
}

/// Runs `exe` with only `env`, `stdin` written, stdout and stderr read up to
/// a bound; killed when dropped (the caller's deadline). From `netns` when
/// given: a thread of its own enters it, and the child inherits it.
async fn run(
    exe: &Path,
    env: Vec<(&'static str, String)>,
    stdin: Vec<u8>,
    netns: Option<PathBuf>,
) -> std::io::Result<(bool, String, Vec<u8>, Vec<u8>)> {
    let exe = exe.to_owned();
    let go = async move {
        let mut child = tokio::process::Command::new(&exe)
            .env_clear()
            .envs(env)
            .current_dir("/")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let mut input = child.stdin.take().expect("piped");
        let mut out = child.stdout.take().expect("piped");
        let mut err = child.stderr.take().expect("piped");
        let limit = cni::MAX_BYTES as u64 + 1;
        let (mut o, mut e) = (Vec::new(), Vec::new());
        let write = async move {
            // A plugin may exit without reading it all.
            let _ = input.write_all(&stdin).await;
        };
        let mut out = (&mut out).take(limit);
        let mut err = (&mut err).take(limit);
        let (_, ro, re) = tokio::join!(write, out.read_to_end(&mut o), err.read_to_end(&mut e));
        ro?;
        re?;
        let status = child.wait().await?;
        Ok((status.success(), status.to_string(), o, e))
    };
    match netns {
        None => go.await,
        Some(path) => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            std::thread::spawn(move || {
                let r = (|| {
                    let f = std::fs::File::open(&path)?;
                    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)?;
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()?
                        .block_on(go)
                })();
                let _ = tx.send(r);
            });
            rx.await
                .map_err(|_| std::io::Error::other("plugin thread died"))?
        }
    }
}

impl Cni for ExecCni {
    async fn add(&self, list: &ConfList, rt: &Runtime) -> Result<(Value, CniResult), CniError> {
        // Every plugin is found before anything is recorded or run.
        for plugin in list.types() {
            self.find(plugin)?;
        }
        let mut record = Record::before_add(list, rt);
        let file = record.file_name();
        self.write_record(&record)?;
        let mut result: Option<(Value, CniResult)> = None;
        for i in 0..list.plugins.len() {
            let prev = result.as_ref().map(|(v, _)| v);
            match self.exec(Command::Add, list, i, prev, rt).await {
                Ok(r) => result = r,
                Err(e) => {
                    // The spec: a failed ADD still gets its DEL.
                    if let Err(undo) = self.del(&file).await {
                        tracing::warn!(network = %list.name, "undoing a failed ADD: {undo}");
                    }
                    return Err(e);
                }
            }
        }
        let Some((raw, parsed)) = result else {
            return Err(CniError::Plugin {
                plugin: list.name.clone(),
                message: "no plugin answered a result".into(),
            });
        };
        record.result = Some(raw.clone());
        if let Err(e) = self.write_record(&record) {
            let _ = self.del(&file).await;
            return Err(e);
        }
        Ok((raw, parsed))
    }

    async fn del(&self, file: &str) -> Result<(), CniError> {
        let Some(record) = self.read_record(file)? else {
            return Ok(());
        };
        let list = record.list()?;
        self.del_list(&list, &record.runtime(), record.result.as_ref())
            .await?;
        self.remove_record(file)
    }

    fn records(&self) -> (Vec<Record>, Vec<CniError>) {
        let (mut found, mut bad) = (Vec::new(), Vec::new());
        let Ok(entries) = std::fs::read_dir(self.results_dir()) else {
            return (found, bad);
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            match self.read_record(&name) {
                Ok(Some(r)) => found.push(r),
                Ok(None) => {}
                Err(err) => bad.push(err),
            }
        }
        found.sort_by_key(|r| r.file_name());
        (found, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::cni::resolve;
    use crate::host::netns::{KernelNetns, Netns};

    fn plugins_here() -> bool {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return false;
        }
        if !Path::new("/usr/lib/cni/bridge").exists() {
            eprintln!("skipped: needs containernetworking-plugins");
            return false;
        }
        true
    }

    fn sh(netns: &Path, cmd: &str) -> String {
        let out = std::process::Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["sh", "-c", cmd])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    struct World {
        dir: tempfile::TempDir,
        ns: KernelNetns,
        cni: ExecCni,
    }

    impl World {
        async fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let ns = KernelNetns::at(dir.path());
            for n in ["kvirt-c-host", "kvirt-c-vm1", "kvirt-c-vm2"] {
                ns.create(n).await.unwrap();
            }
            let cni = ExecCni {
                cache_dir: dir.path().join("cache"),
                host_netns: Some(dir.path().join("kvirt-c-host")),
                timeout: Duration::from_secs(20),
                ..Default::default()
            };
            Self { dir, ns, cni }
        }

        fn path(&self, n: &str) -> PathBuf {
            self.dir.path().join(n)
        }

        fn rt(&self, vm: &str) -> Runtime {
            let netns = self.path(&format!("kvirt-c-{vm}"));
            Runtime::for_vmi(
                "prod",
                vm,
                &format!("uid-{vm}"),
                &format!("prod_{vm}"),
                &netns.to_string_lossy(),
                "pod16477688c0e",
            )
        }

        /// A bridge network whose host-local leases live in the test's dir.
        fn bridge(&self, range: &str) -> ConfList {
            let leases = self.dir.path().join("leases");
            resolve(
                "blue",
                &format!(
                    r#"{{"cniVersion":"1.0.0","plugins":[
                      {{"type":"bridge","bridge":"kvtbr0","ipam":{{"type":"host-local","dataDir":"{}","ranges":[[{range}]]}}}},
                      {{"type":"tuning","capabilities":{{"mac":true}}}}]}}"#,
                    leases.display()
                ),
            )
            .unwrap()
        }

        fn leases(&self) -> Vec<String> {
            let d = self.dir.path().join("leases/blue");
            let mut l: Vec<String> = std::fs::read_dir(d)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains('.') && !n.starts_with("last_reserved"))
                .collect();
            l.sort();
            l
        }

        async fn end(self) {
            for n in ["kvirt-c-vm1", "kvirt-c-vm2", "kvirt-c-host"] {
                self.ns.delete(n).await.unwrap();
            }
        }
    }

    /// Tier 2: Debian's real bridge, host-local and tuning plugins in
    /// throwaway namespaces: ADD gives the address and the MAC asked for,
    /// DEL frees the lease and the link, a second DEL is a no-op, and a
    /// full pool fails the ADD with the plugin's words and leaves nothing.
    #[tokio::test]
    async fn real_plugins_add_and_del_and_leave_nothing() {
        if !plugins_here() {
            return;
        }
        let w = World::new().await;
        let one = r#"{"subnet":"10.99.0.0/24","rangeStart":"10.99.0.10","rangeEnd":"10.99.0.10"}"#;
        let list = w.bridge(one);
        let mut rt = w.rt("vm1");
        rt.capability_args
            .insert("mac".into(), "02:aa:00:00:00:01".into());
        let added = w.cni.add(&list, &rt).await;
        let inside = sh(
            &w.path("kvirt-c-vm1"),
            "ip -o addr show pod16477688c0e; ip -o link show pod16477688c0e",
        );
        let records = w.cni.records();
        let leases = w.leases();
        // The pool of one is taken: the second VM's ADD fails and is undone.
        let second = w.cni.add(&list, &w.rt("vm2")).await;
        let records_after_failure = w.cni.records().0.len();
        let del = w.cni.del(&records.0[0].file_name()).await;
        let del_again = w.cni.del(&records.0[0].file_name()).await;
        let leases_after = w.leases();
        let inside_after = sh(&w.path("kvirt-c-vm1"), "ip -o link show");
        w.end().await;

        let (_, r) = added.unwrap();
        assert_eq!(r.ips[0].address, "10.99.0.10/24");
        assert!(inside.contains("10.99.0.10/24"), "{inside}");
        assert!(inside.contains("02:aa:00:00:00:01"), "{inside}");
        assert_eq!(records.0.len(), 1, "{records:?}");
        assert!(records.0[0].result.is_some());
        assert_eq!(leases, ["10.99.0.10"]);
        let e = second.unwrap_err().to_string();
        assert!(e.contains("no IP addresses available"), "{e}");
        assert_eq!(records_after_failure, 1);
        del.unwrap();
        del_again.unwrap();
        assert!(leases_after.is_empty(), "{leases_after:?}");
        assert!(!inside_after.contains("pod16477688c0e"), "{inside_after}");
    }

    /// Tier 2: an ADD cut short (the record written, a plugin run, no
    /// result recorded) is found and undone by its record; DEL works with
    /// the recorded config after the NAD changed, and after the VM's
    /// namespace is gone; a plugin that does not exist fails clearly and
    /// runs nothing.
    #[tokio::test]
    async fn records_let_del_undo_what_a_crash_left() {
        if !plugins_here() {
            return;
        }
        let w = World::new().await;
        let list = w.bridge(r#"{"subnet":"10.98.0.0/24"}"#);
        let rt = w.rt("vm1");
        // As if kvirtd died after the first plugin: record, bridge ADD only.
        let record = Record::before_add(&list, &rt);
        w.cni.write_record(&record).unwrap();
        let partial = w.cni.exec(Command::Add, &list, 0, None, &rt).await;
        let leased = w.leases();
        let (found, bad) = w.cni.records();
        // A later edit of the network does not matter: DEL reads the record.
        let undone = w.cni.del(&found[0].file_name()).await;
        let after = (w.leases(), w.cni.records().0.len());
        // DEL after the namespace is gone.
        let added = w.cni.add(&list, &w.rt("vm2")).await;
        w.ns.delete("kvirt-c-vm2").await.unwrap();
        let file = w.cni.records().0[0].file_name();
        let gone_ns = w.cni.del(&file).await;
        let after_gone = (w.leases(), w.cni.records().0.len());
        let missing = resolve("red", r#"{"cniVersion":"1.0.0","type":"nosuchplugin"}"#).unwrap();
        let refused = w.cni.add(&missing, &w.rt("vm1")).await;
        let after_refused = w.cni.records().0.len();
        w.end().await;

        partial.unwrap();
        assert_eq!(leased.len(), 1, "{leased:?}");
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(found.len(), 1);
        assert!(found[0].result.is_none());
        undone.unwrap();
        assert_eq!(after, (vec![], 0));
        added.unwrap();
        gone_ns.unwrap();
        assert_eq!(after_gone, (vec![], 0));
        let e = refused.unwrap_err().to_string();
        assert!(e.contains("nosuchplugin: no such plugin"), "{e}");
        assert_eq!(after_refused, 0);
    }

    #[test]
    fn records_of_others_and_planted_files_are_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let cni = ExecCni {
            cache_dir: dir.path().into(),
            ..Default::default()
        };
        let results = dir.path().join("results");
        std::fs::create_dir_all(&results).unwrap();
        // Another runtime's record.
        std::fs::write(
            results.join("podnet-abc-eth0"),
            r#"{"kind":"cniCacheV1","containerId":"abc","config":"e30=","ifName":"eth0","networkName":"podnet"}"#,
        )
        .unwrap();
        // A link and a FIFO where a record would be: never followed, never blocked on.
        std::os::unix::fs::symlink("/etc/shadow", results.join("blue-x-pod1")).unwrap();
        nix::unistd::mkfifo(&results.join("blue-y-pod1"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let (found, bad) = cni.records();
        assert!(found.is_empty());
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert!(cni.read_record("../x").is_err());
    }
}
