//! The election of `core::election` against the API server: every host
//! watches the one election Lease (no request while it follows); only the
//! leader writes, renewing it, or a host taking it over once its holder
//! let it run out. Both writes are guarded by the Lease's version: of two
//! hosts taking it at once, one wins and the other follows.

use super::lease::LEASE_NAMESPACE;
use crate::core::election::{self, Seen, Step, LEASE};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::{info, warn};

/// The Lease as this host last saw it, and when it saw that version.
#[derive(Default)]
struct View {
    /// Who holds it, told to whoever follows the election (`Election`).
    holder: watch::Sender<Option<String>>,
    /// Whether the watch delivered its first state: before, nothing is
    /// known and nothing is taken.
    synced: bool,
    lease: Option<Lease>,
    seen: Option<Seen>,
}

impl View {
    fn note(&mut self, lease: Option<Lease>, now: Instant) {
        let version = lease
            .as_ref()
            .and_then(|l| l.metadata.resource_version.clone());
        let same = match (&self.seen, &version) {
            (Some(s), Some(v)) => &s.version == v,
            _ => false,
        };
        if !same {
            self.seen = lease.as_ref().map(|l| Seen {
                holder: l.spec.as_ref().and_then(|s| s.holder_identity.clone()),
                version: version.clone().unwrap_or_default(),
                at: now,
            });
            let holder = self.seen.as_ref().and_then(|s| s.holder.clone());
            self.holder.send_if_modified(|h| {
                let changed = *h != holder;
                *h = holder;
                changed
            });
        }
        self.lease = lease;
    }
}

/// What this host knows of the election.
#[derive(Clone)]
pub struct Election {
    /// Whether this host leads. When it stands down (it could not renew
    /// in time, or another host holds the Lease) it says `false`, and the
    /// caller stops everything the lead started; it may lead again later.
    pub leading: watch::Receiver<bool>,
    /// The node the Lease names as its holder, as last seen (it may have
    /// stopped renewing it).
    pub holder: watch::Receiver<Option<String>>,
}

/// Runs the election for `node` until kvirtd exits.
pub fn run(client: kube::Client, node: String, duration: Duration) -> Election {
    let (tx, rx) = watch::channel(false);
    let api: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let view = View::default();
    let holder = view.holder.subscribe();
    let view = Arc::new(Mutex::new(view));
    tokio::spawn(follow(api.clone(), view.clone()));
    tokio::spawn(elect(api, node, duration, view, tx));
    Election {
        leading: rx,
        holder,
    }
}

type Shared = Arc<Mutex<View>>;

fn lock(view: &Shared) -> std::sync::MutexGuard<'_, View> {
    view.lock().unwrap_or_else(|p| p.into_inner())
}

/// The watch of the one election Lease: what the view holds.
async fn follow(api: Api<Lease>, view: Shared) {
    let feed = watcher(
        api,
        watcher::Config::default().fields(&format!("metadata.name={LEASE}")),
    )
    .default_backoff();
    let mut feed = std::pin::pin!(feed);
    while let Some(event) = feed.next().await {
        let mut v = lock(&view);
        match event {
            Ok(watcher::Event::Apply(l) | watcher::Event::InitApply(l)) => {
                v.note(Some(l), Instant::now())
            }
            Ok(watcher::Event::Delete(_)) => v.note(None, Instant::now()),
            Ok(watcher::Event::Init) => {}
            Ok(watcher::Event::InitDone) => {
                if v.lease.is_none() {
                    v.note(None, Instant::now());
                }
                v.synced = true;
            }
            Err(e) => warn!("watching the election Lease {LEASE}: {e}"),
        }
    }
}

/// Each tick, the step `core::election` says, and whether this host
/// leads after it.
async fn elect(
    api: Api<Lease>,
    node: String,
    duration: Duration,
    view: Shared,
    tx: watch::Sender<bool>,
) {
    // Nothing is known before the watch's first state; it comes at once
    // when the API server answers (a restarted leader renews at once).
    while !lock(&view).synced {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut tick = tokio::time::interval(election::renew_every(duration));
    let mut renewed: Option<Instant> = None;
    loop {
        tick.tick().await;
        let (step, lease) = {
            let v = lock(&view);
            let now = Instant::now();
            (
                election::step(&node, v.seen.as_ref(), duration, now),
                v.lease.clone(),
            )
        };
        let leading = *tx.borrow();
        if step == Step::Follow && leading {
            warn!("{LEASE}: another host holds it now; standing down");
            let _ = tx.send(false);
            continue;
        }
        if step != Step::Follow {
            match write(&api, lease, &node, duration, step == Step::Take).await {
                Ok(l) => {
                    renewed = Some(Instant::now());
                    lock(&view).note(Some(l), Instant::now());
                    if !leading {
                        info!("{LEASE}: this host leads; it runs the cluster's controllers");
                        let _ = tx.send(true);
                    }
                }
                // Lost a race for it, or the API server is away.
                Err(e) => info!("{LEASE}: not written: {e}"),
            }
        }
        if *tx.borrow()
            && renewed.is_none_or(|r| election::must_stand_down(r, duration, Instant::now()))
        {
            warn!("{LEASE}: not renewed in time; standing down");
            let _ = tx.send(false);
        }
    }
}

/// The Lease written as held by `node` now, over the version last seen
/// (or created when there is none); `take` counts a transition.
async fn write(
    api: &Api<Lease>,
    lease: Option<Lease>,
    node: &str,
    duration: Duration,
    take: bool,
) -> Result<Lease, kube::Error> {
    let now = MicroTime(jiff::Timestamp::now());
    let seconds = i32::try_from(duration.as_secs()).unwrap_or(i32::MAX);
    let pp = PostParams::default();
    let Some(mut lease) = lease else {
        let fresh = Lease {
            metadata: ObjectMeta {
                name: Some(LEASE.into()),
                namespace: Some(LEASE_NAMESPACE.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(node.into()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return api.create(&pp, &fresh).await;
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    if take {
        spec.holder_identity = Some(node.into());
        spec.acquire_time = Some(now.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(seconds);
    spec.renew_time = Some(now);
    // The version read rides along: a write over a newer one conflicts.
    api.replace(LEASE, &pp, &lease).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: &str, version: &str) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(LEASE.into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.into()),
                ..Default::default()
            }),
        }
    }

    /// A renewal counts from when this host saw it: the same version seen
    /// again (a re-list) does not restart the count; a new one does.
    #[test]
    fn a_renewal_counts_from_when_it_was_first_seen_here() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(5);
        let mut v = View::default();
        v.note(Some(lease("b", "1")), t0);
        v.note(Some(lease("b", "1")), later);
        assert_eq!(v.seen.as_ref().map(|s| s.at), Some(t0));
        v.note(Some(lease("b", "2")), later);
        assert_eq!(v.seen.as_ref().map(|s| s.at), Some(later));
        assert_eq!(
            v.seen.as_ref().and_then(|s| s.holder.clone()),
            Some("b".into())
        );
        v.note(None, later);
        assert!(v.seen.is_none());
    }
}
