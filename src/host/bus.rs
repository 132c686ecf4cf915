//! kvirtd's one system-bus connection, and a bound on the calls it has
//! out at once. dbus-daemon refuses a connection's method call once 128
//! of its calls await replies (`max_replies_per_connection`, its default
//! on the system bus): a few hundred VMs stopping or being looked at
//! together, each pass with one call out, would get errors for some of
//! them. Each call waits for a slot instead.

use std::future::Future;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Calls kvirtd keeps out on the system bus at once: half the bus's
/// per-connection limit, leaving room for the match rules zbus adds and
/// anything else sharing the connection.
pub const CALLS_IN_FLIGHT: usize = 64;
const _: () = assert!(
    CALLS_IN_FLIGHT < 128,
    "under dbus-daemon's max_replies_per_connection"
);

/// The connection and its slots; clones share both.
#[derive(Clone)]
pub struct Bus {
    conn: zbus::Connection,
    slots: Arc<Semaphore>,
}

impl Bus {
    pub async fn system() -> zbus::Result<Self> {
        Ok(Self::new(
            zbus::Connection::system().await?,
            CALLS_IN_FLIGHT,
        ))
    }

    fn new(conn: zbus::Connection, slots: usize) -> Self {
        Self {
            conn,
            slots: Arc::new(Semaphore::new(slots)),
        }
    }

    pub fn connection(&self) -> &zbus::Connection {
        &self.conn
    }

    /// Runs `call` (one method call, or a property read) once a slot is
    /// free, holding the slot until its reply.
    pub async fn call<T>(&self, call: impl Future<Output = T>) -> T {
        bounded(&self.slots, call).await
    }
}

async fn bounded<T>(slots: &Semaphore, call: impl Future<Output = T>) -> T {
    // Never closed: acquire cannot fail.
    let _slot = slots.acquire().await.ok();
    call.await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn slots(n: usize) -> Arc<Semaphore> {
        Arc::new(Semaphore::new(n))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_calls_are_out_at_once_than_the_slots() {
        let slots = slots(3);
        let out = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let calls = (0..40).map(|_| {
            let (slots, out, most) = (slots.clone(), out.clone(), most.clone());
            tokio::spawn(async move {
                bounded(&slots, async {
                    let now = out.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    out.fetch_sub(1, Ordering::SeqCst);
                })
                .await
            })
        });
        for c in calls.collect::<Vec<_>>() {
            c.await.unwrap();
        }
        assert_eq!(most.load(Ordering::SeqCst), 3, "calls out at once");
        assert_eq!(slots.available_permits(), 3, "every slot handed back");
    }
}
