//! The leader's routing of migration objects: a
//! `VirtualMachineInstanceMigration` a user (or `virtctl`, or a client of
//! KubeVirt's) makes names only its VMI; the leading kvirtd watches the
//! objects not yet labelled for a host and labels each for the host its
//! VMI runs on ([`HOST_LABEL`], `core::migration::route`), or fails it if
//! its VMI runs nowhere. Each host then watches only the objects labelled
//! with its name: no host watches every migration of the cluster.

use super::migrations::KubeMigrations;
use super::scheduler::feed;
use crate::core::key::VmKey;
use crate::core::migration::{route, Migration, MigrationPhase, Route, HOST_LABEL};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tracing::{info, warn};

/// How often objects left waiting are looked at again.
const RETRY: Duration = Duration::from_secs(5);
/// How long an object just labelled is left alone while the watch
/// catches up (it leaves the watch's selection then).
const SETTLE: Duration = Duration::from_secs(15);
/// How long an object whose VMI runs nowhere waits before it is failed: a
/// VMI just made may be placed meanwhile.
pub const UNPLACED_AFTER: Duration = Duration::from_secs(10);

/// Routes the migration objects while this host leads (the caller's
/// runtime ends with the lead).
pub fn run(client: kube::Client) {
    let objects = KubeMigrations { client };
    let changed = Arc::new(Notify::new());
    let (store, w) = reflector::store();
    let unrouted = watcher::Config::default().labels(&format!("!{HOST_LABEL}"));
    feed(
        watcher(objects.all(), unrouted),
        w,
        Some(changed.clone()),
        "migration objects for no host",
    );
    tokio::spawn(async move {
        let _ = store.wait_until_ready().await;
        let mut routing = Routing::default();
        loop {
            routing.round(&objects, &store).await;
            let _ = tokio::time::timeout(RETRY, changed.notified()).await;
        }
    });
}

/// What the router remembers between rounds, by object uid.
#[derive(Default)]
pub(super) struct Routing {
    /// Objects labelled, and when (the watch has yet to drop them).
    routed: HashMap<String, Instant>,
    /// Objects whose VMI ran nowhere, since when.
    unplaced: HashMap<String, Instant>,
}

impl Routing {
    pub(super) async fn round(&mut self, objects: &KubeMigrations, store: &Store<Migration>) {
        let open: Vec<_> = (store.state().into_iter())
            .filter(|m| !m.status.phase.is_some_and(MigrationPhase::is_final))
            .filter(|m| m.metadata.deletion_timestamp.is_none())
            .collect();
        let uids: std::collections::HashSet<String> = (open.iter())
            .filter_map(|m| m.metadata.uid.clone())
            .collect();
        self.routed
            .retain(|u, at| uids.contains(u) && at.elapsed() < SETTLE);
        self.unplaced.retain(|u, _| uids.contains(u));
        for m in open {
            let uid = m.metadata.uid.clone().unwrap_or_default();
            if !self.routed.contains_key(&uid) {
                self.one(objects, &m, uid).await;
            }
        }
    }

    async fn one(&mut self, objects: &KubeMigrations, m: &Migration, uid: String) {
        let ns = m.metadata.namespace.as_deref().unwrap_or("default");
        let name = m.metadata.name.clone().unwrap_or_default();
        let Ok(key) = VmKey::new(ns, &m.spec.vmi_name) else {
            let why = format!("{:?} is not a VMI's name", m.spec.vmi_name);
            return self.fail_when_due(objects, m, uid, &why).await;
        };
        let vmi = match objects.vmi(&key).await {
            Ok(v) => v,
            Err(e) => return warn!(migration = %name, "{e}"),
        };
        match route(m, &key.to_string(), vmi.as_ref()) {
            Route::Host(node) => match objects.route(m, &node).await {
                Ok(true) => {
                    info!(migration = %name, vm = %key, %node, "migration object routed");
                    self.routed.insert(uid, Instant::now());
                }
                Ok(false) => {}
                Err(e) => warn!(migration = %name, "{e}"),
            },
            Route::Fail(why) => self.fail_when_due(objects, m, uid, &why).await,
            Route::Stay => {}
        }
    }

    async fn fail_when_due(
        &mut self,
        objects: &KubeMigrations,
        m: &Migration,
        uid: String,
        why: &str,
    ) {
        let first = *self
            .unplaced
            .entry(uid.clone())
            .or_insert_with(Instant::now);
        if first.elapsed() < UNPLACED_AFTER {
            return;
        }
        let name = m.metadata.name.clone().unwrap_or_default();
        match objects.fail(m, why).await {
            Ok(true) => {
                info!(migration = %name, "migration object failed: {why}");
                self.routed.insert(uid, Instant::now());
            }
            Ok(false) => {}
            Err(e) => warn!(migration = %name, "{e}"),
        }
    }
}
