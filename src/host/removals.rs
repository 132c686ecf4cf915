//! Units systemd has removed, told to whoever waits for one: one reader
//! of `UnitRemoved` for every stop. A signal stream per stop had each of
//! 250 VMs stopping at once parse every unit's removal, and take a bus
//! slot to subscribe before it could signal its VM.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::sync::oneshot;

type Waiting = HashMap<String, Vec<oneshot::Sender<()>>>;

/// Who waits for which unit's removal; clones share it.
#[derive(Clone, Default)]
pub struct Removals(Arc<Mutex<Waiting>>);

impl Removals {
    /// A wait for `unit`'s removal, registered now: a removal after this
    /// call (and before the caller acts on the unit) is not missed.
    pub fn wait_for(&self, unit: &str) -> Removal {
        let (tx, rx) = oneshot::channel();
        let mut waiting = self.lock();
        let list = waiting.entry(unit.to_owned()).or_default();
        list.retain(|w| !w.is_closed());
        list.push(tx);
        Removal {
            rx,
            unit: unit.to_owned(),
            of: self.clone(),
        }
    }

    /// systemd removed `unit`: everyone waiting for it is told.
    pub fn removed(&self, unit: &str) {
        let told = self.lock().remove(unit);
        for w in told.into_iter().flatten() {
            let _ = w.send(());
        }
    }

    /// How many units someone waits for.
    pub fn watched(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        // Nothing panics while holding it; a poisoned map is still whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Resolves once the unit is removed; never, if no removal comes (the
/// caller bounds it). Dropped, it leaves nothing behind.
pub struct Removal {
    rx: oneshot::Receiver<()>,
    unit: String,
    of: Removals,
}

impl Future for Removal {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(()),
            // Only a told waiter's sender is ever dropped: not reached.
            Poll::Ready(Err(_)) | Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Removal {
    fn drop(&mut self) {
        self.rx.close();
        let mut waiting = self.of.lock();
        if let Some(list) = waiting.get_mut(&self.unit) {
            list.retain(|w| !w.is_closed());
            if list.is_empty() {
                waiting.remove(&self.unit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn resolves(r: &mut Removal) -> bool {
        tokio::time::timeout(Duration::from_millis(50), r)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_removal_reaches_every_waiter_of_its_unit_and_no_other() {
        let removals = Removals::default();
        let (mut a1, mut a2) = (removals.wait_for("a"), removals.wait_for("a"));
        let mut b = removals.wait_for("b");
        removals.removed("a");
        assert!(resolves(&mut a1).await && resolves(&mut a2).await);
        assert!(!resolves(&mut b).await, "b was not removed");
        // Told once: a later wait for the same name waits for the next.
        let mut again = removals.wait_for("a");
        assert!(!resolves(&mut again).await);
    }

    #[tokio::test]
    async fn a_removal_before_the_wait_is_not_taken_for_a_later_one() {
        let removals = Removals::default();
        removals.removed("a");
        let mut a = removals.wait_for("a");
        assert!(!resolves(&mut a).await);
    }

    #[test]
    fn dropped_waits_leave_nothing_behind() {
        let removals = Removals::default();
        let kept = removals.wait_for("a");
        drop(removals.wait_for("a"));
        drop(removals.wait_for("b"));
        assert_eq!(removals.watched(), 1, "only a is waited for");
        drop(kept);
        assert_eq!(removals.watched(), 0);
        // A removal nobody waits for is a no-op.
        removals.removed("c");
        assert_eq!(removals.watched(), 0);
    }
}
