//! Standalone VirtualMachines: kvirtd plays virt-controller's part. Each
//! VM manifest's VMI is made, stopped and made anew here ([`vm::advance`])
//! and handed to the VMI loop with the manifests' own VMIs; what that loop
//! reports back ([`VmiView`]) moves the VMs on. Level-triggered like the
//! VMI loop: every pass looks at every VM, and what is kept of each
//! ([`VmRecords`]) is written before its VMI is handed on, so a crash at
//! any point resumes with the same VMI (the same UID) or none.

use crate::core::instancetype::{self, ObjectKey};
use crate::core::key::VmKey;
use crate::core::trigger::Trigger;
use crate::core::vm::{self, Book, Change, Seen, Verb, VirtualMachine};
use crate::core::vmi::VirtualMachineInstance;
use crate::daemon::controller::VmiView;
use crate::host::journal;
use crate::sources::manifest::{Snapshot, VmRecord, VmRecords};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;
use tracing::{info, warn};

/// What wakes the VM loop besides the VMI loop's passes.
#[derive(Debug)]
pub enum Input {
    Manifests(Snapshot),
    /// `kvirtctl start|stop|restart`: the answer says what was done, or why not.
    Command {
        key: VmKey,
        verb: Verb,
        reply: oneshot::Sender<Result<String, String>>,
    },
}

pub struct Vms {
    records: VmRecords,
    vms: BTreeMap<VmKey, VirtualMachine>,
    /// The manifests' own VMIs, handed on as they are.
    vmis: BTreeMap<VmKey, VirtualMachineInstance>,
    /// The manifests' instancetypes and preferences.
    instancetypes: BTreeMap<ObjectKey, serde_json::Value>,
    /// What is kept of each VM (also of a deleted one, until its VMI is
    /// gone from the host).
    kept: BTreeMap<VmKey, VmRecord>,
    /// The last VMI set handed to the VMI loop.
    sent: Option<BTreeMap<VmKey, VirtualMachineInstance>>,
    /// What the set is made of changed since it was last built: the set
    /// is not built again otherwise (at 250 VMIs, rebuilding and comparing
    /// it after every VMI pass was a tenth of an idle kvirtd's CPU).
    stale: bool,
    /// Why a VM cannot be advanced, as last logged.
    said: BTreeMap<VmKey, String>,
}

/// What the VMI loop shows of the VM's VMI: only the book's own counts.
fn seen_of(view: &dyn VmiView, key: &VmKey, book: &Book) -> Seen {
    let (vmi, gone) = view.view(&key.id());
    let mine = book.vmi.as_ref().and_then(|v| v.uid());
    Seen {
        vmi: vmi.filter(|v| mine.is_some() && v.uid() == mine),
        gone,
    }
}

impl Vms {
    pub fn open(records: VmRecords) -> Self {
        let kept = records.load_all();
        Self {
            records,
            vms: BTreeMap::new(),
            vmis: BTreeMap::new(),
            instancetypes: BTreeMap::new(),
            kept,
            sent: None,
            stale: true,
            said: BTreeMap::new(),
        }
    }

    /// Takes a manifest snapshot; returns the VMIs to run as things stand
    /// (the manifests' and those the records hold), nothing advanced yet:
    /// what kvirtd adopts on start.
    pub fn take(&mut self, snap: Snapshot) -> BTreeMap<VmKey, VirtualMachineInstance> {
        self.vmis = snap.vmis;
        self.stale = true;
        self.vms = snap.vms;
        self.instancetypes = snap.instancetypes;
        for (key, vm) in self.vms.iter_mut() {
            let record = self.kept.entry(key.clone()).or_default();
            vm::settle_identity(vm, &mut record.book, fresh_uid);
        }
        self.vmi_set()
    }

    /// The host rebooted: every VMI of the last boot ended with it (as
    /// KubeVirt's VMIs on a node that went down), and each VM's strategy
    /// decides what runs now. Kept first, so a crash does not undo it.
    pub fn forget_last_boot(&mut self) {
        self.stale = true;
        for (key, r) in self.kept.iter_mut() {
            if let Some(v) = r.book.vmi.take() {
                info!(vm = %key, vmi_uid = ?v.uid(), "the host rebooted: the VM's VMI ended with it");
                r.book.running_since = None;
                if let Err(e) = self.records.save(key, r) {
                    warn!("{e}");
                }
            }
        }
    }

    fn vmi_set(&self) -> BTreeMap<VmKey, VirtualMachineInstance> {
        let mut set = self.vmis.clone();
        for (key, r) in &self.kept {
            if let Some(v) = &r.book.vmi {
                // A deleted VM's VMI being stopped keeps its name until
                // gone; a VMI manifest of that name waits for it.
                set.insert(key.clone(), v.clone());
            }
        }
        set
    }

    /// One pass over every VM; returns when the next one is due at the
    /// latest (a start waiting out its backoff).
    pub fn pass(&mut self, view: &dyn VmiView, now: i64) -> Option<Duration> {
        let mut wake: Option<Duration> = None;
        let keys: BTreeSet<VmKey> = self.vms.keys().chain(self.kept.keys()).cloned().collect();
        for key in keys {
            let span = journal::vm_span(&key.id(), Some(&key));
            let _in = span.enter();
            let deleted = !self.vms.contains_key(&key);
            let mut record = self.kept.get(&key).cloned().unwrap_or_default();
            let vm = match self.vms.get(&key) {
                Some(vm) => vm.clone(),
                None => record.vm.clone(),
            };
            if let (false, Ok(wanted)) = (deleted, vm.wanted()) {
                let name = key.name().to_owned();
                record.book.captured =
                    instancetype::settle(&wanted, &record.book.captured, &name, &|k| {
                        self.instancetypes.get(k).cloned()
                    });
            }
            let seen = seen_of(view, &key, &record.book);
            match vm::advance(&vm, &mut record.book, &seen, now, deleted) {
                Ok((changes, wait)) => {
                    self.said.remove(&key);
                    for c in changes {
                        log_change(&c);
                    }
                    if let Some(w) = wait {
                        wake = Some(wake.map_or(w, |x| x.min(w)));
                    }
                }
                Err(why) => {
                    if self.said.get(&key) != Some(&why) {
                        warn!("VirtualMachine cannot run: {why}");
                        self.said.insert(key.clone(), why);
                    }
                }
            }
            let seen = seen_of(view, &key, &record.book);
            if deleted && record.book.vmi.is_none() && seen.gone {
                info!("VirtualMachine deleted: nothing of it is left");
                self.records.remove(&key);
                self.kept.remove(&key);
                self.stale = true;
                continue;
            }
            let mut shown = vm;
            shown.status = vm::status(&shown, &record.book, &seen, now, deleted);
            record.vm = shown;
            if self.kept.get(&key) != Some(&record) {
                // Kept before the VMI it names is handed on.
                if let Err(e) = self.records.save(&key, &record) {
                    warn!("{e}");
                    continue;
                }
                self.kept.insert(key, record);
                self.stale = true;
            }
        }
        wake
    }

    fn command(&mut self, view: &dyn VmiView, key: &VmKey, verb: Verb) -> Result<String, String> {
        let Some(vm) = self.vms.get(key).cloned() else {
            return Err(if self.vmis.contains_key(key) {
                format!(
                    "{key} is a VirtualMachineInstance: start, stop and restart apply to \
                     VirtualMachines (remove its manifest to stop it)"
                )
            } else {
                format!("no VirtualMachine {key} on this host")
            });
        };
        let mut record = self.kept.get(key).cloned().unwrap_or_default();
        let seen = seen_of(view, key, &record.book);
        vm::request(&vm, &mut record.book, &seen, verb)?;
        self.records.save(key, &record).map_err(|e| e.to_string())?;
        // The loop's next pass (right after this answer) carries it out.
        self.kept.insert(key.clone(), record);
        self.stale = true;
        Ok(verb.scheduled(key))
    }

    /// Hands the VMI loop the set when it changed.
    fn publish(&mut self, to: &UnboundedSender<Trigger>) -> bool {
        if !std::mem::take(&mut self.stale) {
            return true;
        }
        let set = self.vmi_set();
        if self.sent.as_ref() == Some(&set) {
            return true;
        }
        self.sent = Some(set.clone());
        to.send(Trigger::Vmis(set)).is_ok()
    }

    /// The loop: a pass after each manifest change, command, VMI pass and
    /// due backoff, until the inputs close.
    pub async fn run(
        mut self,
        view: Arc<dyn VmiView>,
        mut inputs: UnboundedReceiver<Input>,
        to: UnboundedSender<Trigger>,
    ) {
        let mut passes = view.passes();
        let mut due: Option<tokio::time::Instant> = None;
        loop {
            // First of all: nothing else may come (a host with no VM left
            // after a reboot has no VMI passes to wake this loop).
            if let Some(w) = self.pass(view.as_ref(), unix_now()) {
                // A second late rather than early: the backoff is in seconds.
                let at = tokio::time::Instant::now() + w + Duration::from_millis(500);
                due = Some(due.map_or(at, |d| d.min(at)));
            }
            if !self.publish(&to) {
                return;
            }
            let sleep = async {
                match due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                input = inputs.recv() => match input {
                    None => return,
                    Some(Input::Manifests(snap)) => {
                        self.take(snap);
                    }
                    Some(Input::Command { key, verb, reply }) => {
                        let r = self.command(view.as_ref(), &key, verb);
                        let _ = reply.send(r);
                    }
                },
                changed = passes.changed() => if changed.is_err() { return },
                _ = sleep => due = None,
            }
        }
    }
}

fn log_change(c: &Change) {
    match c {
        Change::Created(uid) => info!(vmi_uid = %uid, "VirtualMachine: created its VMI"),
        Change::Stopping(uid) => info!(vmi_uid = %uid, "VirtualMachine: stopping its VMI"),
        Change::Removed(uid) => info!(vmi_uid = %uid, "VirtualMachine: its VMI is gone"),
        Change::Halted => info!("VirtualMachine ran once: now Halted"),
        Change::Unhalted => info!("VirtualMachine started paused: now Always"),
        Change::Waiting(d) => info!(
            retry_in = ?d,
            "VirtualMachine: start failed, backing off (CrashLoopBackOff)"
        ),
    }
}

fn unix_now() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// A random UUID (version 4) for a VM whose manifest names none.
fn fresh_uid() -> String {
    use std::io::Read;
    let mut b = [0u8; 16];
    if let Err(e) = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)) {
        // Unique enough without: the time and the process.
        warn!("/dev/urandom: {e}");
        let seed = format!("{:?}{}", std::time::SystemTime::now(), std::process::id());
        b.copy_from_slice(&<sha2::Sha256 as sha2::Digest>::digest(seed.as_bytes())[..16]);
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    crate::core::key::uuid_form(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(names: &[&str]) -> Snapshot {
        let vmis = names.iter().map(|n| {
            let vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": n, "namespace": "default", "uid": format!("u-{n}")},
            }))
            .unwrap();
            (VmKey::new("default", n).unwrap(), vmi)
        });
        Snapshot {
            vmis: vmis.collect(),
            ..Default::default()
        }
    }

    /// The set goes to the VMI loop once per change of what it is made
    /// of, and is not even built again in between (each VMI pass wakes
    /// this loop).
    #[test]
    fn the_vmi_set_is_built_and_sent_once_per_change() {
        let dir = tempfile::tempdir().unwrap();
        let mut vms = Vms::open(VmRecords {
            dir: dir.path().into(),
        });
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let sent = |rx: &mut UnboundedReceiver<Trigger>| match rx.try_recv() {
            Ok(Trigger::Vmis(set)) => Some(set.len()),
            _ => None,
        };
        vms.take(snapshot(&["a"]));
        assert!(vms.publish(&tx));
        assert_eq!(sent(&mut rx), Some(1));
        assert!(!vms.stale);
        assert!(vms.publish(&tx));
        assert_eq!(sent(&mut rx), None);
        vms.take(snapshot(&["a", "b"]));
        assert!(vms.stale);
        assert!(vms.publish(&tx));
        assert_eq!(sent(&mut rx), Some(2));
        // The same manifests again: built, found equal, not sent.
        vms.take(snapshot(&["a", "b"]));
        assert!(vms.publish(&tx));
        assert_eq!(sent(&mut rx), None);
    }
}
