//! kvirtd as an aggregated API server: what the API server says about its
//! front proxy, SubjectAccessReviews of the users it names, and this
//! host's address in the Endpoints (and its EndpointSlice) of the Service
//! `kvirt/kvirt-api` that the APIService routes to.
//!
//! The aggregator (with `--enable-aggregator-routing`) and its
//! availability check read the Service's `Endpoints`, not EndpointSlices
//! (Kubernetes 1.33, `k8s.io/apiserver/pkg/util/proxy.ResolveEndpoint`):
//! every kvirtd keeps its own subset of that one object, and its own
//! EndpointSlice for everything else that reads slices.

use crate::core::subresource::requestheader::{
    RequestHeader, RequestHeaderError, User, CONFIGMAP_NAME, CONFIGMAP_NAMESPACE,
};
use crate::core::subresource::{Access, GROUP};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, EndpointAddress, EndpointPort, EndpointSubset, Endpoints,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use tracing::{info, warn};

pub const NAMESPACE: &str = "kvirt";
pub const SERVICE: &str = "kvirt-api";
/// The Service's port name: the aggregator matches Endpoints ports by it.
pub const PORT_NAME: &str = "https";
pub const MANAGED_BY: &str = "kvirt.io";

#[derive(Debug, thiserror::Error)]
pub enum AggregationError {
    #[error(transparent)]
    RequestHeader(#[from] RequestHeaderError),
    #[error("SubjectAccessReview: {0}")]
    Review(Box<kube::Error>),
    #[error("{NAMESPACE}/{SERVICE} endpoints: {0}")]
    Endpoints(Box<kube::Error>),
    #[error(
        "{NAMESPACE}/{SERVICE} endpoints: lost {0} races to other hosts' writes; tried again later"
    )]
    Contended(u32),
    #[error("watching {CONFIGMAP_NAMESPACE}/{CONFIGMAP_NAME}: {0}")]
    Watch(String),
}

/// Whether `user` may do what `access` names, and the authoriser's reason.
pub async fn review(
    client: &kube::Client,
    user: &User,
    access: &Access,
) -> Result<(bool, String), AggregationError> {
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
            groups: Some(user.groups.clone()),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                group: Some(GROUP.into()),
                version: Some(access.version.into()),
                resource: Some(access.resource.into()),
                subresource: Some(access.subresource.into()),
                namespace: Some(access.namespace.clone()),
                name: Some(access.name.clone()),
                verb: Some(access.verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SubjectAccessReview> = Api::all(client.clone());
    let r = api
        .create(&PostParams::default(), &sar)
        .await
        .map_err(|e| AggregationError::Review(Box::new(e)))?;
    let status = r.status.unwrap_or_default();
    Ok((status.allowed, status.reason.unwrap_or_default()))
}

fn endpoints_err(e: kube::Error) -> AggregationError {
    AggregationError::Endpoints(Box::new(e))
}

/// This host's subset: its address (not ready while kvirtd stops) and port.
fn subset(node: &str, addr: SocketAddr, ready: bool) -> EndpointSubset {
    let address = EndpointAddress {
        ip: addr.ip().to_string(),
        node_name: Some(node.to_owned()),
        ..Default::default()
    };
    EndpointSubset {
        addresses: ready.then(|| vec![address.clone()]),
        not_ready_addresses: (!ready).then(|| vec![address]),
        ports: Some(vec![EndpointPort {
            name: Some(PORT_NAME.into()),
            port: addr.port().into(),
            protocol: Some("TCP".into()),
            ..Default::default()
        }]),
    }
}

fn subset_node(s: &EndpointSubset) -> Option<&str> {
    subset_nodes(s).next()
}

/// Every node a subset names: the API server repacks the subsets of one
/// Endpoints object (addresses with the same ports in one subset), so one
/// subset holds many hosts' addresses.
fn subset_nodes(s: &EndpointSubset) -> impl Iterator<Item = &str> {
    s.addresses
        .iter()
        .chain(s.not_ready_addresses.iter())
        .flatten()
        .filter_map(|a| a.node_name.as_deref())
}

/// Whether the subsets list `node`'s address `addr`, ready (pure).
pub fn lists(subsets: &[EndpointSubset], node: &str, addr: SocketAddr) -> bool {
    let ip = addr.ip().to_string();
    subsets.iter().any(|s| {
        s.ports
            .iter()
            .flatten()
            .any(|p| p.name.as_deref() == Some(PORT_NAME) && p.port == i32::from(addr.port()))
            && s.addresses
                .iter()
                .flatten()
                .any(|a| a.ip == ip && a.node_name.as_deref() == Some(node))
    })
}

/// The subsets with `node`'s addresses replaced by `mine` (kept as they
/// are when `None`), and those of the nodes `gone` dropped, address by
/// address (pure).
pub fn merged_subsets(
    current: &[EndpointSubset],
    node: &str,
    mine: Option<EndpointSubset>,
    gone: &[String],
) -> Vec<EndpointSubset> {
    let keep = |a: &EndpointAddress| {
        a.node_name
            .as_deref()
            .is_some_and(|n| (n != node || mine.is_none()) && !gone.iter().any(|g| g == n))
    };
    let only = |list: &Option<Vec<EndpointAddress>>| {
        let kept: Vec<EndpointAddress> =
            list.iter().flatten().filter(|a| keep(a)).cloned().collect();
        (!kept.is_empty()).then_some(kept)
    };
    let mut out: Vec<EndpointSubset> = current
        .iter()
        .map(|s| EndpointSubset {
            addresses: only(&s.addresses),
            not_ready_addresses: only(&s.not_ready_addresses),
            ports: s.ports.clone(),
        })
        .filter(|s| s.addresses.is_some() || s.not_ready_addresses.is_some())
        .collect();
    out.extend(mine);
    out.sort_by(|a, b| subset_node(a).cmp(&subset_node(b)));
    out
}

/// How many times a write that lost a race is redone before giving up.
const WRITE_TRIES: u32 = 8;

/// The wait before redoing a write that lost race `n` (0-based): random
/// within a window doubling from 100 ms to at most 6.4 s. Hosts that start
/// together all write the one object at once; redone at once, the same
/// ones collide again (seen at 100 hosts: a fifth gave up after 8 tries).
fn backoff(node: &str, n: u32) -> Duration {
    use std::hash::BuildHasher;
    let window = 100u64 << n.min(6);
    let random = std::collections::hash_map::RandomState::new().hash_one((
        node,
        n,
        std::time::SystemTime::now(),
    ));
    Duration::from_millis(random % window)
}

/// Replaces this host's subset of the Endpoints (made if missing), with
/// those of `gone` nodes removed; a write that loses a race is redone
/// after a random wait, and after [`WRITE_TRIES`] losses it is an error
/// (the caller tries again on its next period).
async fn write_endpoints(
    client: &kube::Client,
    node: &str,
    mine: Option<EndpointSubset>,
    gone: &[String],
) -> Result<(), AggregationError> {
    let api: Api<Endpoints> = Api::namespaced(client.clone(), NAMESPACE);
    for n in 0..WRITE_TRIES {
        if n > 0 {
            tokio::time::sleep(backoff(node, n - 1)).await;
        }
        let current = api.get_opt(SERVICE).await.map_err(endpoints_err)?;
        let r = match current {
            None => {
                let Some(mine) = mine.clone() else {
                    return Ok(());
                };
                let ep: Endpoints = serde_json::from_value(json!({
                    "metadata": {
                        "name": SERVICE,
                        "namespace": NAMESPACE,
                        "labels": {
                            "app.kubernetes.io/part-of": "kvirt",
                            // Each kvirtd keeps its own slice: the mirroring
                            // controller must not add one more.
                            "endpointslice.kubernetes.io/skip-mirror": "true",
                        },
                    },
                }))
                .expect("static Endpoints");
                let ep = Endpoints {
                    subsets: Some(vec![mine]),
                    ..ep
                };
                api.create(&PostParams::default(), &ep).await.map(drop)
            }
            Some(mut ep) => {
                let subsets = ep.subsets.take().unwrap_or_default();
                let merged = merged_subsets(&subsets, node, mine.clone(), gone);
                if merged == subsets {
                    return Ok(());
                }
                ep.subsets = Some(merged);
                api.replace(SERVICE, &PostParams::default(), &ep)
                    .await
                    .map(drop)
            }
        };
        match r {
            Ok(()) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(endpoints_err(e)),
        }
    }
    Err(AggregationError::Contended(WRITE_TRIES))
}

fn slice_name(node: &str) -> String {
    format!("{SERVICE}-{node}")
}

/// This host's EndpointSlice (pure).
pub fn slice(node: &str, addr: SocketAddr, ready: bool) -> serde_json::Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": slice_name(node),
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": SERVICE,
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
                "app.kubernetes.io/part-of": "kvirt",
            },
        },
        "addressType": if addr.is_ipv4() { "IPv4" } else { "IPv6" },
        "endpoints": [{
            "addresses": [addr.ip().to_string()],
            "conditions": {"ready": ready, "serving": ready, "terminating": !ready},
            "nodeName": node,
        }],
        "ports": [{"name": PORT_NAME, "port": addr.port(), "protocol": "TCP"}],
    })
}

/// Publishes this host's address, ready or not.
pub async fn publish(
    client: &kube::Client,
    node: &str,
    addr: SocketAddr,
    ready: bool,
) -> Result<(), AggregationError> {
    write_endpoints(client, node, Some(subset(node, addr, ready)), &[]).await?;
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    api.patch(
        &slice_name(node),
        &PatchParams::apply("kvirtd").force(),
        &Patch::Apply(&slice(node, addr, ready)),
    )
    .await
    .map_err(endpoints_err)?;
    Ok(())
}

/// Publishes this host's address, ready: the `first` time, or if it is
/// no longer in the Endpoints (one read; someone edited them, or the
/// leader pruned this host while it was away).
pub async fn keep_published(
    client: &kube::Client,
    node: &str,
    addr: SocketAddr,
    first: bool,
) -> Result<(), AggregationError> {
    if !first {
        let api: Api<Endpoints> = Api::namespaced(client.clone(), NAMESPACE);
        let ep = api.get_opt(SERVICE).await.map_err(endpoints_err)?;
        if ep.is_some_and(|ep| lists(ep.subsets.as_deref().unwrap_or_default(), node, addr)) {
            return Ok(());
        }
    }
    publish(client, node, addr, true).await
}

/// The front proxy's CA, names and headers, each time the API server's
/// ConfigMap changes (a watch of that one object).
pub fn front_proxy(
    client: kube::Client,
) -> impl futures::Stream<Item = Result<RequestHeader, AggregationError>> + Send {
    use futures::StreamExt;
    use kube::runtime::{watcher, WatchStreamExt};
    let api: Api<ConfigMap> = Api::namespaced(client, CONFIGMAP_NAMESPACE);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={CONFIGMAP_NAME}"));
    watcher(api, cfg)
        .default_backoff()
        .applied_objects()
        .map(|r| match r {
            Ok(cm) => Ok(RequestHeader::from_data(&cm.data.unwrap_or_default())?),
            Err(e) => Err(AggregationError::Watch(e.to_string())),
        })
}

/// The address of the kvirtd of `node`, as it published it.
pub async fn peer(
    client: &kube::Client,
    node: &str,
) -> Result<Option<SocketAddr>, AggregationError> {
    let api: Api<Endpoints> = Api::namespaced(client.clone(), NAMESPACE);
    let Some(ep) = api.get_opt(SERVICE).await.map_err(endpoints_err)? else {
        return Ok(None);
    };
    Ok(ep.subsets.iter().flatten().find_map(|s| {
        let a = s
            .addresses
            .iter()
            .flatten()
            .find(|a| a.node_name.as_deref() == Some(node))?;
        let ip: IpAddr = a.ip.parse().ok()?;
        let port = s
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(PORT_NAME))?
            .port;
        Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
    }))
}

/// The nodes of `ep` (other than `node`) whose Lease is missing or
/// overdue by more than `grace` at `now` (pure).
pub fn stale<L: std::borrow::Borrow<Lease>>(
    ep: &Endpoints,
    node: &str,
    leases: &[L],
    now: i64,
    grace: Duration,
) -> Vec<String> {
    let mut gone = vec![];
    for other in ep.subsets.iter().flatten().flat_map(subset_nodes) {
        if other == node || gone.iter().any(|g| g == other) {
            continue;
        }
        let name = super::lease::lease_name(other);
        let spec = leases
            .iter()
            .map(|l| l.borrow())
            .find(|l| l.metadata.name.as_deref() == Some(name.as_str()))
            .and_then(|l| l.spec.as_ref());
        let expired = spec.is_none_or(|s| {
            let renewed = s.renew_time.as_ref().map(|t| t.0.as_second()).unwrap_or(0);
            let duration = i64::from(s.lease_duration_seconds.unwrap_or(0));
            renewed + duration + grace.as_secs() as i64 <= now
        });
        if expired {
            gone.push(other.to_owned());
        }
    }
    gone
}

/// Nodes whose kvirtd let its Lease run out (by `grace` beyond its
/// duration) while its address is still published: their addresses and
/// slices are removed, so the aggregator stops sending users there. The
/// Leases are the leader's store of them (no list).
pub async fn prune<L: std::borrow::Borrow<Lease>>(
    client: &kube::Client,
    node: &str,
    leases: &[L],
    grace: Duration,
) -> Result<(), AggregationError> {
    let api: Api<Endpoints> = Api::namespaced(client.clone(), NAMESPACE);
    let Some(ep) = api.get_opt(SERVICE).await.map_err(endpoints_err)? else {
        return Ok(());
    };
    let now = jiff::Timestamp::now().as_second();
    let gone = stale(&ep, node, leases, now, grace);
    if gone.is_empty() {
        return Ok(());
    }
    info!(nodes = ?gone, "removing the API endpoints of hosts whose lease ran out");
    // A failure only delays the change to the next period.
    if let Err(e) = write_endpoints(client, node, None, &gone).await {
        warn!("{e}");
    }
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    for g in gone {
        if let Err(e) = slices
            .delete(&slice_name(&g), &DeleteParams::default())
            .await
        {
            warn!("removing EndpointSlice {}: {e}", slice_name(&g));
        }
    }
    Ok(())
}

/// While this host leads (the caller's runtime): stale hosts' API
/// addresses pruned every `period`, judged from `leases` (listed already,
/// [`super::lease::watch_hosts`]).
pub fn keep_pruned(
    client: kube::Client,
    node: String,
    leases: kube::runtime::reflector::Store<Lease>,
    period: Duration,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period.max(Duration::from_secs(2)));
        loop {
            tick.tick().await;
            if let Err(e) = prune(&client, &node, &leases.state(), period).await {
                warn!("pruning stale API endpoints: {e}");
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_lost_write_waits_a_random_time_within_a_doubling_window() {
        for n in 0..10 {
            let cap = Duration::from_millis(100 << n.min(6));
            assert!((0..50).all(|_| backoff("node-1", n) < cap));
        }
        // Random, not one fixed wait every host would share.
        let waits: std::collections::BTreeSet<_> = (0..50).map(|_| backoff("node-1", 6)).collect();
        assert!(waits.len() > 10, "{waits:?}");
    }

    #[test]
    fn each_host_replaces_only_its_own_subset() {
        let a = subset("node-a", addr("10.0.0.1:8443"), true);
        let b = subset("node-b", addr("10.0.0.2:8443"), true);
        let merged = merged_subsets(std::slice::from_ref(&a), "node-b", Some(b.clone()), &[]);
        assert_eq!(merged, vec![a.clone(), b.clone()]);
        // Stopping: b's address moves to notReadyAddresses.
        let b_down = subset("node-b", addr("10.0.0.2:8443"), false);
        let merged = merged_subsets(&merged, "node-b", Some(b_down.clone()), &[]);
        assert_eq!(merged, vec![a.clone(), b_down.clone()]);
        assert!(merged[1].addresses.is_none());
        // A host gone is removed by another, which keeps its own as it is.
        let merged = merged_subsets(&merged, "node-a", None, &["node-b".into()]);
        assert_eq!(merged, vec![a]);
    }

    /// The API server repacks the subsets: hosts on one port share one
    /// subset. A host's write keeps the others' addresses in it, and each
    /// host still finds its own.
    #[test]
    fn a_repacked_subset_keeps_the_other_hosts_addresses() {
        let a = subset("node-a", addr("10.0.0.1:8443"), true);
        let b = subset("node-b", addr("10.0.0.2:8443"), true);
        let mut packed = a.clone();
        packed
            .addresses
            .as_mut()
            .unwrap()
            .extend(b.addresses.clone().unwrap());
        let packed = vec![packed];
        assert!(lists(&packed, "node-a", addr("10.0.0.1:8443")));
        assert!(lists(&packed, "node-b", addr("10.0.0.2:8443")));
        assert!(!lists(&packed, "node-b", addr("10.0.0.2:9443")));
        assert!(!lists(&packed, "node-c", addr("10.0.0.2:8443")));
        // node-a writes its own again: node-b's address stays.
        let merged = merged_subsets(&packed, "node-a", Some(a.clone()), &[]);
        assert!(lists(&merged, "node-a", addr("10.0.0.1:8443")));
        assert!(lists(&merged, "node-b", addr("10.0.0.2:8443")));
        // node-b gone: only its address goes.
        let merged = merged_subsets(&packed, "node-a", None, &["node-b".into()]);
        assert_eq!(merged, vec![a]);
        let ep = Endpoints {
            subsets: Some(packed),
            ..Default::default()
        };
        assert_eq!(
            stale::<Lease>(&ep, "node-a", &[], 0, Duration::ZERO),
            ["node-b"]
        );
    }

    #[test]
    fn the_slice_is_kvirts_and_names_the_service() {
        let s = slice("node-a", addr("10.0.0.1:8443"), false);
        assert_eq!(
            s["metadata"]["labels"]["kubernetes.io/service-name"],
            SERVICE
        );
        assert_eq!(
            s["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"],
            "kvirt.io"
        );
        assert_eq!(s["endpoints"][0]["conditions"]["ready"], false);
        assert_eq!(s["ports"][0]["port"], 8443);
    }
}
