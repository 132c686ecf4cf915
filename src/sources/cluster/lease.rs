//! The host's heartbeat: a Lease in `kube-node-lease`, renewed on a period,
//! which also announces the host to its peers (what it offers VMIs, where
//! it takes migrations: [`crate::core::peers`]).

use crate::core::peers::{Announcement, Peer, ANNOUNCEMENT};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::reflector::Store;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

pub const LEASE_NAMESPACE: &str = "kube-node-lease";

pub fn lease_name(node: &str) -> String {
    format!("kvirt-{node}")
}

/// The label on kvirt's Leases (peers list them by it).
pub const HOST_LABEL: &str = "kvirt.io/host";

/// The applied Lease (pure): holder, duration, renew time and the host's
/// announcement.
pub fn lease_patch(
    node: &str,
    duration: Duration,
    now: &str,
    announced: &Announcement,
) -> serde_json::Value {
    let announced = serde_json::to_string(announced).unwrap_or_default();
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": lease_name(node),
            "namespace": LEASE_NAMESPACE,
            "labels": { HOST_LABEL: "" },
            "annotations": { ANNOUNCEMENT: announced },
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": duration.as_secs(),
            "renewTime": now,
        }
    })
}

/// Kubernetes' MicroTime: RFC 3339 in UTC with exactly six fractional digits.
pub fn micro_time(t: jiff::Timestamp) -> String {
    format!(
        "{}.{:06}Z",
        t.strftime("%Y-%m-%dT%H:%M:%S"),
        t.subsec_microsecond()
    )
}

/// The peer a kvirt Lease announces, if it is current at `now` (pure).
pub fn peer_of(lease: &Lease, now: jiff::Timestamp) -> Option<Peer> {
    let spec = lease.spec.as_ref()?;
    let node = spec.holder_identity.clone()?;
    if lease.metadata.name.as_deref() != Some(lease_name(&node).as_str()) {
        return None;
    }
    let renewed = spec.renew_time.as_ref()?.0;
    let seconds = i64::from(spec.lease_duration_seconds?);
    if renewed
        .checked_add(jiff::SignedDuration::from_secs(seconds))
        .ok()?
        < now
    {
        return None;
    }
    let announced = lease.metadata.annotations.as_ref()?.get(ANNOUNCEMENT)?;
    let announced = serde_json::from_str(announced).ok()?;
    Some(Peer { node, announced })
}

/// The kvirt hosts whose Leases are current.
pub async fn peers(client: &kube::Client) -> Result<Vec<Peer>, kube::Error> {
    let api: Api<Lease> = Api::namespaced(client.clone(), LEASE_NAMESPACE);
    let leases = api.list(&ListParams::default().labels(HOST_LABEL)).await?;
    let now = jiff::Timestamp::now();
    Ok(leases.iter().filter_map(|l| peer_of(l, now)).collect())
}

/// The kvirt host Leases, watched into a store (one watch, which the
/// leader's dead-host check, scheduler and address pruning share: every
/// renewal of every host reaches it once); returned once the first list
/// is in. Waited for here, once: kube-rs wakes only the last of several
/// tasks waiting on clones of one store (a futures oneshot keeps one
/// waker), and the others would wait forever.
pub async fn watch_hosts(client: kube::Client) -> Store<Lease> {
    use futures::StreamExt;
    use kube::runtime::{reflector, watcher, WatchStreamExt};
    let api: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let (reader, writer) = reflector::store();
    let feed = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default().labels(HOST_LABEL)),
    )
    .default_backoff();
    tokio::spawn(async move {
        let mut feed = std::pin::pin!(feed);
        while let Some(r) = feed.next().await {
            if let Err(e) = r {
                warn!("watching the hosts' Leases: {e}");
            }
        }
    });
    let _ = reader.wait_until_ready().await;
    reader
}

/// Renews forever, every quarter of the lease duration (kubelet's ratio)
/// and whenever `now` is told, with what `announce` says of the host
/// then, telling `renewed` of each renewal the API server took (the
/// self-fence counts from the last); failures are logged and retried on
/// the next tick.
pub async fn heartbeat(
    client: kube::Client,
    node: String,
    duration: Duration,
    now: Arc<tokio::sync::Notify>,
    announce: impl Fn() -> Announcement + Send + 'static,
    renewed: impl Fn() + Send + 'static,
) {
    let api: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let params = PatchParams::apply("kvirtd").force();
    let mut tick = tokio::time::interval(duration / 4);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // What it announces changed (a cordon): renewed at once.
            _ = now.notified() => {}
        }
        let now = micro_time(jiff::Timestamp::now());
        let patch = lease_patch(&node, duration, &now, &announce());
        match api
            .patch(&lease_name(&node), &params, &Patch::Apply(&patch))
            .await
        {
            Ok(_) => renewed(),
            Err(e) => warn!("renewing lease {}: {e}", lease_name(&node)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_the_holder() {
        let announced = Announcement {
            migration: "10.0.0.1:8444".into(),
            ..Default::default()
        };
        let p = lease_patch(
            "node-1",
            Duration::from_secs(40),
            "2026-01-01T00:00:00Z",
            &announced,
        );
        assert_eq!(p["metadata"]["name"], "kvirt-node-1");
        assert_eq!(p["spec"]["holderIdentity"], "node-1");
        assert_eq!(p["spec"]["leaseDurationSeconds"], 40);
        let t: jiff::Timestamp = "2026-01-01T00:00:00.5Z".parse().unwrap();
        assert_eq!(micro_time(t), "2026-01-01T00:00:00.500000Z");
        // What the API server stores, read back by a peer: current while
        // the lease lasts, then gone.
        let lease: Lease = serde_json::from_value(p).unwrap();
        let peer = peer_of(&lease, t).unwrap();
        assert_eq!(peer.node, "node-1");
        assert_eq!(peer.announced, announced);
        let later: jiff::Timestamp = "2026-01-01T00:00:41Z".parse().unwrap();
        assert_eq!(peer_of(&lease, later), None);
    }

    #[test]
    fn a_lease_of_another_name_or_without_an_announcement_is_no_peer() {
        let t: jiff::Timestamp = "2026-01-01T00:00:01Z".parse().unwrap();
        let announced = Announcement::default();
        let mut p = lease_patch(
            "node-1",
            Duration::from_secs(40),
            "2026-01-01T00:00:00Z",
            &announced,
        );
        p["spec"]["holderIdentity"] = "node-2".into();
        assert_eq!(peer_of(&serde_json::from_value(p).unwrap(), t), None);
        let mut p = lease_patch(
            "node-1",
            Duration::from_secs(40),
            "2026-01-01T00:00:00Z",
            &announced,
        );
        p["metadata"]["annotations"] = json!({});
        assert_eq!(peer_of(&serde_json::from_value(p).unwrap(), t), None);
    }
}
