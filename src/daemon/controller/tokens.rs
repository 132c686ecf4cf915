//! serviceAccount disks' tokens, renewed while their VM runs. A pod's
//! projected token is bound to its pod and rotated by kubelet; a VMI is
//! no object a token can be bound to, so kvirt asks for a short-lived one
//! (`kubernetes.service_account_token_seconds`) and writes a new one into
//! the disk's ISO, in place, when four fifths of its life are over. The
//! guest sees it once it rereads the disk; a token of a VM that is gone
//! lapses within that lifetime.

use super::{Adapters, Controller};
use crate::core::convert::{Converted, DiskPrep};
use crate::core::key::VmKey;
use crate::core::objects::{ObjectRef, Objects};
use crate::core::vmi::VirtualMachineInstance;
use crate::host::storage::Storage;
use crate::sources::StatusStore;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{info, warn};

/// After a failed renewal, the next try.
pub(super) const RENEW_RETRY: Duration = Duration::from_secs(60);

/// When one VMI's tokens are next renewed.
#[derive(Clone, Debug)]
pub(super) struct Due {
    uid: String,
    at: Instant,
}

/// The seed ISOs of a VM that carry a serviceAccount token.
fn token_disks(conv: &Converted) -> impl Iterator<Item = &DiskPrep> {
    conv.disks.iter().filter(|d| match d {
        DiskPrep::SeedIso { seed, .. } => seed
            .object_refs()
            .any(|r| matches!(r, ObjectRef::ServiceAccountToken(_))),
        _ => false,
    })
}

impl<A: Adapters> Controller<A> {
    /// For a running VM: renews its serviceAccount disks' tokens when they
    /// are due (`made`: this pass wrote them), and says when next. `None`:
    /// it has none, or tokens are not renewed (standalone).
    pub(super) async fn renew_tokens(
        &self,
        vmi: &VirtualMachineInstance,
        key: &VmKey,
        conv: &Converted,
        made: bool,
    ) -> Option<Duration> {
        let id = key.id();
        let (Some(every), true) = (
            self.settings.token_renewal,
            token_disks(conv).next().is_some(),
        ) else {
            self.forget_tokens(&id);
            return None;
        };
        let uid = vmi.uid().unwrap_or_default().to_owned();
        let now = Instant::now();
        // Not known (kvirtd just started: it cannot tell how old they
        // are) or of an earlier VMI: renewed now.
        let known = self.token_due().get(&id).cloned();
        let wait = match known {
            _ if made => Some(every),
            Some(d) if d.uid == uid && d.at > now => return Some(d.at - now),
            _ => None,
        };
        let next = match wait {
            Some(w) => w,
            None => match self.renew_now(key, conv).await {
                Ok(n) => {
                    info!(disks = n, "renewed the serviceAccount tokens");
                    every
                }
                Err(e) => {
                    warn!(retry_in = ?RENEW_RETRY, "renewing a serviceAccount token: {e}");
                    RENEW_RETRY
                }
            },
        };
        self.token_due().insert(
            id,
            Due {
                uid,
                at: now + next,
            },
        );
        Some(next)
    }

    /// Reads each token disk's objects again and writes its ISO anew.
    async fn renew_now(&self, key: &VmKey, conv: &Converted) -> Result<usize, String> {
        let owner = self.owner(&key.id());
        let mut n = 0;
        for d in token_disks(conv) {
            let DiskPrep::SeedIso { path, seed, .. } = d else {
                continue;
            };
            let mut objects = Objects::new();
            for r in seed.object_refs() {
                let data = self
                    .deps
                    .status
                    .object(key.namespace(), r)
                    .await
                    .map_err(|e| e.to_string())?;
                objects.insert(r.clone(), data);
            }
            let seed = seed.resolve(&objects)?;
            self.deps
                .storage
                .rewrite_seed_iso(path, &seed, owner)
                .await
                .map_err(|e| e.to_string())?;
            n += 1;
        }
        Ok(n)
    }

    pub(super) fn forget_tokens(&self, id: &str) {
        self.token_due().remove(id);
    }

    fn token_due(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Due>> {
        self.tokens.lock().unwrap_or_else(|p| p.into_inner())
    }
}
