//! The leader's scheduler: the leading kvirtd (`core::election`) watches
//! the unassigned VMIs and the hosts' Leases, and assigns each new VMI to
//! the host [`placement::place`] chooses (the node label and
//! `status.nodeName`, guarded by the VMI's resourceVersion), as
//! kube-scheduler binds a pod. A VMI no host will take stays Pending with
//! a `FailedScheduling` Event saying why, and is tried again as hosts come
//! and go. The admission policy lets only the Lease's holder assign a VMI
//! to another host.

use super::lease::peer_of;
use super::source::{claim, unplaced};
use super::{VirtualMachineInstance, NODE_LABEL};
use crate::core::peers::Peer;
use crate::core::placement;
use crate::sources::{EventReason, Recorder};
use futures::{Stream, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::{info, warn};

/// How often VMIs no host took are tried again (hosts come, uncordon,
/// change their labels).
const RETRY: Duration = Duration::from_secs(5);
/// How long a VMI just assigned is left alone while the watch catches up.
const SETTLE: Duration = Duration::from_secs(15);

/// Feeds a store from a watch, waking `changed` (if any) on every event.
pub(super) fn feed<K>(
    stream: impl Stream<Item = watcher::Result<watcher::Event<K>>> + Send + 'static,
    writer: reflector::store::Writer<K>,
    changed: Option<Arc<Notify>>,
    what: &'static str,
) where
    K: kube::Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    tokio::spawn(async move {
        let stream = reflector::reflector(writer, stream).default_backoff();
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                Ok(_) => {
                    if let Some(c) = &changed {
                        c.notify_one();
                    }
                }
                Err(e) => warn!("watching {what}: {e}"),
            }
        }
    });
}

/// Places the unassigned VMIs while this host leads (the caller's runtime
/// ends with the lead), reading the hosts from `leases` (listed already,
/// [`super::lease::watch_hosts`]: they change at every renewal, at 1,000
/// hosts 100 a second, so they are read when a VMI waits, never a reason
/// to look).
pub fn run(client: kube::Client, events: Arc<dyn Recorder>, leases: Store<Lease>) {
    let changed = Arc::new(Notify::new());
    let (vmis, w) = reflector::store();
    let api: Api<VirtualMachineInstance> = Api::all(client.clone());
    let unassigned = watcher::Config::default().labels(&format!("!{NODE_LABEL}"));
    feed(
        watcher(api, unassigned),
        w,
        Some(changed.clone()),
        "unassigned VMIs",
    );
    tokio::spawn(async move {
        let _ = vmis.wait_until_ready().await;
        let mut placing = Placing::default();
        loop {
            placing
                .round(&client, &leases, &vmis, events.as_ref())
                .await;
            let _ = tokio::time::timeout(RETRY, changed.notified()).await;
        }
    });
}

/// What the scheduler remembers between rounds.
#[derive(Default)]
pub(super) struct Placing {
    /// VMIs assigned, by uid, and when (the watch has yet to drop them).
    assigned: HashMap<String, Instant>,
    /// Why a VMI found no host, as last said in its Event, by uid.
    said: HashMap<String, String>,
    /// Per host: the renewal its announcement came with, and the VMIs
    /// placed there since (its count does not know them yet).
    pending: BTreeMap<String, (String, u32)>,
}

impl Placing {
    fn peers(&mut self, leases: &Store<Lease>) -> Vec<Peer> {
        let now = jiff::Timestamp::now();
        let mut peers = Vec::new();
        for lease in leases.state() {
            let Some(peer) = peer_of(&lease, now) else {
                continue;
            };
            let Some(spec) = lease.spec.as_ref() else {
                continue;
            };
            // A host that missed two renewals may be fencing itself (it
            // stops taking VMIs then): new VMIs go elsewhere.
            let Some(renewed) = spec.renew_time.as_ref().map(|t| t.0) else {
                continue;
            };
            let half = i64::from(spec.lease_duration_seconds.unwrap_or(0)) / 2;
            if renewed.as_second() + half < now.as_second() {
                continue;
            }
            let renewed = renewed.to_string();
            let p = self.pending.entry(peer.node.clone()).or_default();
            if p.0 != renewed {
                *p = (renewed, 0);
            }
            peers.push(peer);
        }
        self.pending
            .retain(|n, _| peers.iter().any(|p| &p.node == n));
        peers
    }

    pub(super) async fn round(
        &mut self,
        client: &kube::Client,
        leases: &Store<Lease>,
        vmis: &Store<VirtualMachineInstance>,
        events: &dyn Recorder,
    ) {
        let waiting: Vec<_> = vmis.state().into_iter().filter(|v| unplaced(v)).collect();
        if waiting.is_empty() {
            self.assigned.clear();
            self.said.clear();
            return;
        }
        let peers = self.peers(leases);
        let uids: std::collections::HashSet<String> = waiting
            .iter()
            .filter_map(|v| v.metadata.uid.clone())
            .collect();
        self.assigned
            .retain(|u, at| uids.contains(u) && at.elapsed() < SETTLE);
        self.said.retain(|u, _| uids.contains(u));
        for vmi in waiting {
            let uid = vmi.metadata.uid.clone().unwrap_or_default();
            if self.assigned.contains_key(&uid) {
                continue;
            }
            self.place(client, &vmi, &uid, &peers, events).await;
        }
    }

    async fn place(
        &mut self,
        client: &kube::Client,
        vmi: &VirtualMachineInstance,
        uid: &str,
        peers: &[Peer],
        events: &dyn Recorder,
    ) {
        let key = vmi.key().map_or_else(|_| "?".into(), |k| k.to_string());
        let load: BTreeMap<String, u32> = self
            .pending
            .iter()
            .map(|(n, (_, c))| (n.clone(), *c))
            .collect();
        match placement::place(vmi, peers, &load) {
            Ok(node) => match claim(client, vmi, &node).await {
                Ok(true) => {
                    info!(vm = %key, node = %node, "assigned");
                    self.assigned.insert(uid.to_owned(), Instant::now());
                    self.said.remove(uid);
                    if let Some(p) = self.pending.get_mut(&node) {
                        p.1 += 1;
                    }
                }
                // Changed meanwhile (or gone): its next version is seen.
                Ok(false) => {}
                Err(e) => warn!(vm = %key, node = %node, "assigning: {e}"),
            },
            Err(why) => {
                if self.said.get(uid) != Some(&why) {
                    info!(vm = %key, "not placed: {why}");
                    events.record(vmi, EventReason::FailedScheduling, &why, true);
                    self.said.insert(uid.to_owned(), why);
                }
            }
        }
    }
}
