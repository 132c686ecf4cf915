//! A cluster host's drain: each VMI that may migrate moved by a
//! `VirtualMachineInstanceMigration` made as KubeVirt's evacuation
//! controller makes one (`kubevirt-evacuation-`, annotated with the node),
//! which this host then acts on like any other (`daemon::vmim`); each
//! VirtualMachine to stop stopped as `virtctl stop` does, through the API
//! server, so its VM controller (any kvirtd) sees it. `kvirtctl migrate`
//! in a cluster makes its object the same way, as a user's (as `virtctl
//! migrate` does).

use crate::core::key::VmKey;
use crate::core::migration::MigrationPhase;
use crate::core::vm::Verb;
use crate::daemon::drain::Evict;
use crate::sources::cluster::migrations::KubeMigrations;
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::time::Duration;
use tracing::warn;

/// How often a drain's migration object is read while it runs.
const POLL: Duration = Duration::from_secs(1);

pub struct Evacuation {
    pub objects: KubeMigrations,
    /// This host's node name, the one being emptied.
    pub node: String,
    /// The longest one migration object is waited for.
    pub within: Duration,
}

impl Evict for Evacuation {
    fn migrate(&self, key: VmKey, evacuation: bool) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let evacuating = evacuation.then_some(self.node.as_str());
            let name = self
                .objects
                .create(&key, BTreeMap::new(), evacuating, Some(&self.node))
                .await
                .map_err(|e| format!("making its migration: {e}"))?;
            self.ended(&key, &name).await
        })
    }

    fn stop(&self, vm: VmKey) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let client = self.objects.client.clone();
            crate::sources::cluster::vms::request(client, &vm, Verb::Stop { grace: None }).await
        })
    }
}

impl Evacuation {
    /// Waits until migration `name` of `key` ends; where the VM went, or
    /// why it did not.
    async fn ended(&self, key: &VmKey, name: &str) -> Result<String, String> {
        let deadline = tokio::time::Instant::now() + self.within;
        loop {
            match self.objects.get(key.namespace(), name).await {
                Ok(Some(m)) => {
                    let state = m.status.migration_state.unwrap_or_default();
                    match m.status.phase {
                        Some(MigrationPhase::Succeeded) => {
                            return Ok(format!(
                                "{key} moved to {} (migration {name})",
                                state.target_node
                            ))
                        }
                        Some(MigrationPhase::Failed) => {
                            let why = state.failure_reason.unwrap_or_default();
                            return Err(format!("migration {name} failed: {why}"));
                        }
                        _ => {}
                    }
                }
                Ok(None) => return Err(format!("migration {name} was deleted")),
                // The API server away for a while: the migration goes on.
                Err(e) => warn!("{e}"),
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "migration {name} did not end within {} s",
                    self.within.as_secs()
                ));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}
