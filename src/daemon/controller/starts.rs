//! How many VMs start at once. A start runs the VM's libvirt daemon to
//! READY, then QEMU, and the starts share the host's CPUs: 250 begun
//! together on 2 CPUs got none of their daemons to READY within systemd's
//! 90 s job timeout (each progressing, none finishing), while 30 at a time
//! each got there within a minute. So a pass that would create its VM
//! first takes one of `Settings::starts_at_once` slots, after what may be
//! slow and uses no CPU (reading its objects, pulling its images) and
//! before its unit's job is made, whose timeout then counts from when it
//! can run. A VMI deleted or replaced while its pass waits ends the wait:
//! its next pass acts on what it is now.

use super::{Adapters, Controller};
use tokio::sync::SemaphorePermit;
use tracing::info;

/// The default of `vm.starts_at_once`: a few per CPU, never fewer than 4
/// nor more than 64.
pub fn starts_at_once(cpus: usize) -> usize {
    (2 * cpus).clamp(4, 64)
}

impl<A: Adapters> Controller<A> {
    /// A start slot for `id`'s instance `uid`, or `None` once that
    /// instance is no longer wanted (deleted, replaced, gone).
    pub(super) async fn start_slot(&self, id: &str, uid: &str) -> Option<SemaphorePermit<'_>> {
        if let Ok(slot) = self.starts.try_acquire() {
            return Some(slot);
        }
        info!(
            at_once = self.settings.starts_at_once,
            "waiting to start: as many VMs are starting"
        );
        let mut changed = self.vmis_changed.subscribe();
        let slot = self.starts.acquire();
        tokio::pin!(slot);
        // Looked at once subscribed: a change just before counts too.
        while self.still_wanted(id, uid) {
            tokio::select! {
                // Never closed: acquire cannot fail.
                s = &mut slot => return s.ok(),
                _ = changed.changed() => {}
            }
        }
        info!("no longer wanted before its start");
        None
    }

    fn still_wanted(&self, id: &str, uid: &str) -> bool {
        self.vmis()
            .get(id)
            .is_some_and(|v| v.uid() == Some(uid) && v.metadata.deletion_timestamp.is_none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vms_start_a_few_per_cpu_at_once() {
        assert_eq!(starts_at_once(1), 4, "at least a few, however small");
        assert_eq!(starts_at_once(2), 4);
        assert_eq!(starts_at_once(8), 16);
        assert_eq!(starts_at_once(128), 64, "at most a bus's worth");
    }
}
