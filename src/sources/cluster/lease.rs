//! The host's heartbeat: a Lease in `kube-node-lease`, renewed on a period.

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use std::time::Duration;
use tracing::warn;

pub const LEASE_NAMESPACE: &str = "kube-node-lease";

pub fn lease_name(node: &str) -> String {
    format!("kvirt-{node}")
}

/// The applied Lease (pure): holder, duration and renew time.
pub fn lease_patch(node: &str, duration: Duration, now: &str) -> serde_json::Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": { "name": lease_name(node), "namespace": LEASE_NAMESPACE },
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

/// Renews forever, every quarter of the lease duration (kubelet's ratio);
/// failures are logged and retried on the next tick.
pub async fn heartbeat(client: kube::Client, node: String, duration: Duration) {
    let api: Api<Lease> = Api::namespaced(client, LEASE_NAMESPACE);
    let params = PatchParams::apply("kvirtd").force();
    let mut tick = tokio::time::interval(duration / 4);
    loop {
        tick.tick().await;
        let now = micro_time(jiff::Timestamp::now());
        let patch = lease_patch(&node, duration, &now);
        if let Err(e) = api
            .patch(&lease_name(&node), &params, &Patch::Apply(&patch))
            .await
        {
            warn!("renewing lease {}: {e}", lease_name(&node));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_names_the_holder() {
        let p = lease_patch("node-1", Duration::from_secs(40), "2026-01-01T00:00:00Z");
        assert_eq!(p["metadata"]["name"], "kvirt-node-1");
        assert_eq!(p["spec"]["holderIdentity"], "node-1");
        assert_eq!(p["spec"]["leaseDurationSeconds"], 40);
        let t: jiff::Timestamp = "2026-01-01T00:00:00.5Z".parse().unwrap();
        assert_eq!(micro_time(t), "2026-01-01T00:00:00.500000Z");
    }
}
