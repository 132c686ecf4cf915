//! The host ends of VMs' veths, deleted in batches.
//!
//! Deleting a network device waits out RCU grace periods while it holds
//! the kernel's network lock (RTNL), which every other link change and
//! every tap close of a stopping QEMU also needs. One by one, 150 veths
//! took 2.85–3.2 s to delete on the 2-core test machine (19 ms each);
//! put in one link group and deleted as the group (one `RTM_DELLINK`, the
//! kernel's `unregister_netdevice_many`) they took 56–62 ms. So deletes
//! that arrive while one is under way wait for it and then go together;
//! a lone delete goes at once, by its index, as before.
//!
//! The group is [`GROUP`]. Before a batch is deleted, every link in that
//! group must be one of the batch: a kvirt veth left in it by a crash
//! between the two steps is put back in the default group (its VM's own
//! teardown comes for it), and a link kvirt did not name stops the batch
//! from going by group at all: its links are then deleted one by one and
//! the stranger is left alone.

use crate::host::network::{in_netns, nl, NetworkError};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// "kvir": a group id no one picks by accident (the kernel's default is 0).
pub const GROUP: u32 = 0x6b76_6972;

/// One host link to delete: its index (checked to be the VM's by the
/// caller) and its name, for messages and the group check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Doomed {
    pub index: u32,
    pub name: String,
}

/// Deletes links, all of one batch, each with its own result (a link that
/// is already gone is deleted). The real one is [`Netlink`].
pub trait Unlink: Send + Sync + 'static {
    fn unlink(&self, links: &[Doomed]) -> Vec<Result<(), String>>;
}

/// Batches deletes: the first goes alone; those that come while a batch
/// is under way go together in the next.
pub struct LinkReaper<U: Unlink = Netlink> {
    unlink: Arc<U>,
    queue: Arc<Mutex<Queue>>,
}

impl<U: Unlink> Clone for LinkReaper<U> {
    fn clone(&self) -> Self {
        Self {
            unlink: self.unlink.clone(),
            queue: self.queue.clone(),
        }
    }
}

type Waiter = (Doomed, oneshot::Sender<Result<(), String>>);

#[derive(Default)]
struct Queue {
    pending: Vec<Waiter>,
    /// A drain is running: new deletes only join the queue.
    busy: bool,
}

impl Default for LinkReaper<Netlink> {
    fn default() -> Self {
        Self::new(Netlink)
    }
}

impl<U: Unlink> LinkReaper<U> {
    pub fn new(unlink: U) -> Self {
        Self {
            unlink: Arc::new(unlink),
            queue: Arc::default(),
        }
    }

    /// Deletes the link and returns once it is gone (or failed to go).
    /// Needs a tokio runtime: the batches run on its blocking threads.
    pub async fn delete(&self, link: Doomed) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.pending.push((link, tx));
            !std::mem::replace(&mut q.busy, true)
        };
        if lead {
            let me = self.clone();
            tokio::task::spawn_blocking(move || me.drain());
        }
        rx.await
            .unwrap_or_else(|_| Err("the link reaper stopped".into()))
    }

    /// Deletes batches until none is waiting, then lets the next delete
    /// lead again.
    fn drain(&self) {
        loop {
            let batch = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                if q.pending.is_empty() {
                    q.busy = false;
                    return;
                }
                std::mem::take(&mut q.pending)
            };
            let (links, waiters): (Vec<Doomed>, Vec<_>) = batch.into_iter().unzip();
            // A panic here must not leave the queue busy with no drain:
            // every later delete would wait for ever.
            let unlinked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.unlink.unlink(&links)
            }));
            let mut results = unlinked
                .unwrap_or_else(|_| vec![Err("deleting the link panicked".into()); links.len()])
                .into_iter();
            for w in waiters {
                // A waiter that went away (its teardown was cancelled) is
                // fine: the link is gone all the same.
                let _ = w.send(
                    results
                        .next()
                        .unwrap_or_else(|| Err("no result for this link".into())),
                );
            }
        }
    }
}

/// The kernel's: by index when alone, by [`GROUP`] when many.
pub struct Netlink;

impl Unlink for Netlink {
    fn unlink(&self, links: &[Doomed]) -> Vec<Result<(), String>> {
        if links.len() > 1 {
            match by_group(links.to_vec()) {
                Ok(()) => return links.iter().map(|_| Ok(())).collect(),
                Err(e) => tracing::warn!("deleting {} links as a group: {e}", links.len()),
            }
        }
        links
            .iter()
            .map(|l| one_by_one(l.clone()).map_err(|e| e.to_string()))
            .collect()
    }
}

fn gone(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::ENODEV)
}

fn one_by_one(link: Doomed) -> Result<(), NetworkError> {
    in_netns(None, move |h| {
        Box::pin(async move {
            match h.link().del(link.index).execute().await {
                Err(e) if gone(&e) => Ok(()),
                r => r.map_err(nl(format!("delete {}", link.name))),
            }
        })
    })
}

/// Puts the links in [`GROUP`], checks that the group holds nothing else,
/// and deletes it. Nothing is deleted when a stranger is in the group.
fn by_group(links: Vec<Doomed>) -> Result<(), NetworkError> {
    in_netns(None, move |h| {
        Box::pin(async move {
            for l in &links {
                match set_group(&h, l.index, GROUP).await {
                    Err(e) if gone(&e) => {}
                    r => r.map_err(nl(format!("group {}", l.name)))?,
                }
            }
            for (index, name) in members(&h).await? {
                if links.iter().any(|l| l.index == index) {
                    continue;
                }
                if !crate::host::network::is_host_veth_name(&name) {
                    return Err(NetworkError::Netlink {
                        what: format!("link group {GROUP}"),
                        message: format!("{name} is in it and is not kvirt's"),
                    });
                }
                // Not this batch's (a crash came between grouping and the
                // delete): out of the way, its own teardown deletes it.
                match set_group(&h, index, 0).await {
                    Err(e) if gone(&e) => {}
                    r => r.map_err(nl(format!("ungroup {name}")))?,
                }
            }
            let mut m = rtnetlink::packet_route::link::LinkMessage::default();
            m.attributes
                .push(rtnetlink::packet_route::link::LinkAttribute::Group(GROUP));
            match h.link().del_with_message(m).execute().await {
                // Nothing left in the group: all were gone already.
                Err(e) if gone(&e) => Ok(()),
                r => r.map_err(nl(format!("delete link group {GROUP}"))),
            }
        })
    })
}

async fn set_group(h: &rtnetlink::Handle, index: u32, group: u32) -> Result<(), rtnetlink::Error> {
    let mut m = rtnetlink::packet_route::link::LinkMessage::default();
    m.header.index = index;
    m.attributes
        .push(rtnetlink::packet_route::link::LinkAttribute::Group(group));
    h.link().set(m).execute().await
}

/// Every link of this namespace in [`GROUP`]: index and name.
async fn members(h: &rtnetlink::Handle) -> Result<Vec<(u32, String)>, NetworkError> {
    use futures::TryStreamExt;
    use rtnetlink::packet_route::link::LinkAttribute;
    let mut links = h.link().get().execute();
    let mut found = Vec::new();
    while let Some(l) = links.try_next().await.map_err(nl("list links"))? {
        let in_group = l
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::Group(GROUP)));
        if !in_group {
            continue;
        }
        let name = l.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        found.push((l.header.index, name.unwrap_or_default()));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Condvar;

    /// Records each batch; the first one waits for `release` so that
    /// others can queue behind it; a link named "bad" fails.
    #[derive(Default)]
    struct Recording {
        batches: Mutex<Vec<Vec<String>>>,
        gate: (Mutex<bool>, Condvar),
    }

    impl Recording {
        fn release(&self) {
            *self.gate.0.lock().unwrap() = true;
            self.gate.1.notify_all();
        }
    }

    impl Unlink for Arc<Recording> {
        fn unlink(&self, links: &[Doomed]) -> Vec<Result<(), String>> {
            let first = {
                let mut b = self.batches.lock().unwrap();
                b.push(links.iter().map(|l| l.name.clone()).collect());
                b.len() == 1
            };
            if first {
                let open = self.gate.0.lock().unwrap();
                drop(self.gate.1.wait_while(open, |open| !*open).unwrap());
            }
            links
                .iter()
                .map(|l| match l.name.as_str() {
                    "bad" => Err("refused".to_string()),
                    _ => Ok(()),
                })
                .collect()
        }
    }

    fn doomed(index: u32, name: &str) -> Doomed {
        Doomed {
            index,
            name: name.into(),
        }
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deletes_that_come_during_a_batch_go_together_in_the_next() {
        let rec = Arc::new(Recording::default());
        let reaper = LinkReaper::new(rec.clone());
        let first = tokio::spawn({
            let r = reaper.clone();
            async move { r.delete(doomed(1, "a")).await }
        });
        until("the first batch started", || {
            !rec.batches.lock().unwrap().is_empty()
        })
        .await;
        let later: Vec<_> = ["b", "bad", "c"]
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                let r = reaper.clone();
                tokio::spawn(async move { r.delete(doomed(i as u32 + 2, n)).await })
            })
            .collect();
        until("three deletes queued", || {
            reaper.queue.lock().unwrap().pending.len() == 3
        })
        .await;
        rec.release();
        assert_eq!(first.await.unwrap(), Ok(()));
        let results: Vec<_> = futures::future::join_all(later)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(results, vec![Ok(()), Err("refused".into()), Ok(())]);
        let batches = rec.batches.lock().unwrap().clone();
        assert_eq!(batches.len(), 2, "{batches:?}");
        assert_eq!(batches[0], vec!["a"]);
        let mut second = batches[1].clone();
        second.sort();
        assert_eq!(second, vec!["b", "bad", "c"]);
        // Idle again: the next delete leads a batch of its own.
        until("the drain ended", || !reaper.queue.lock().unwrap().busy).await;
        assert_eq!(reaper.delete(doomed(9, "d")).await, Ok(()));
        assert_eq!(rec.batches.lock().unwrap().len(), 3);
    }

    struct Panicky;

    impl Unlink for Panicky {
        fn unlink(&self, links: &[Doomed]) -> Vec<Result<(), String>> {
            assert!(links.iter().all(|l| l.name != "boom"), "boom");
            links.iter().map(|_| Ok(())).collect()
        }
    }

    #[tokio::test]
    async fn a_delete_that_panics_fails_alone_and_the_next_goes_on() {
        let reaper = LinkReaper::new(Panicky);
        let failed = reaper.delete(doomed(1, "boom")).await;
        assert!(failed.is_err_and(|e| e.contains("panicked")));
        assert_eq!(reaper.delete(doomed(2, "a")).await, Ok(()));
    }

    /// Tier 2, root: the kernel's side in a throwaway namespace standing
    /// in for the host. A batch goes by group; a kvirt veth left in the
    /// group is put back and kept; a stranger in the group makes the batch
    /// go one by one and is kept.
    #[tokio::test]
    async fn a_batch_goes_by_group_and_leaves_what_is_not_its_own() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let ns = crate::host::netns::KernelNetns::at(dir.path());
        use crate::host::netns::Netns;
        ns.create("kvirt-tr-host").await.unwrap();
        let host = dir.path().join("kvirt-tr-host");
        let result = std::thread::spawn(move || {
            use std::os::fd::AsFd;
            let f = std::fs::File::open(&host).unwrap();
            nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let name = |n: u32| format!("kv{n:012x}");
            let batch: Vec<Doomed> = (1..=3).map(|n| veth(&name(n), None)).collect();
            veth(&name(4), Some(GROUP));
            let first = Netlink.unlink(&batch);
            let after_first = groups();
            let batch: Vec<Doomed> = (5..=6).map(|n| veth(&name(n), None)).collect();
            veth("admin0", Some(GROUP));
            let second = Netlink.unlink(&batch);
            (first, after_first, second, groups())
        })
        .join();
        ns.delete("kvirt-tr-host").await.unwrap();
        let (first, after_first, second, after_second) = result.unwrap();
        assert!(
            first.iter().chain(&second).all(Result::is_ok),
            "{first:?} {second:?}"
        );
        let has = |g: &[(String, u32)], n: &str| g.iter().find(|(m, _)| m == n).map(|(_, g)| *g);
        for n in 1..=3 {
            assert_eq!(
                has(&after_first, &format!("kv{n:012x}")),
                None,
                "{after_first:?}"
            );
        }
        assert_eq!(
            has(&after_first, "kv000000000004"),
            Some(0),
            "{after_first:?}"
        );
        assert_eq!(
            has(&after_second, "kv000000000005"),
            None,
            "{after_second:?}"
        );
        assert_eq!(
            has(&after_second, "kv000000000006"),
            None,
            "{after_second:?}"
        );
        assert_eq!(
            has(&after_second, "admin0"),
            Some(GROUP),
            "{after_second:?}"
        );
        assert_eq!(
            has(&after_second, "kv000000000004"),
            Some(0),
            "{after_second:?}"
        );
    }

    /// A veth pair in this thread's namespace, its first end put in
    /// `group`.
    fn veth(name: &str, group: Option<u32>) -> Doomed {
        let (n, peer) = (name.to_owned(), format!("{name}p"));
        let index = in_netns(None, move |h| {
            Box::pin(async move {
                let req = rtnetlink::LinkVeth::new(&n, &peer).build();
                h.link().add(req).execute().await.map_err(nl("add"))?;
                let i = crate::host::network::index_of(&h, &n).await?.unwrap();
                if let Some(g) = group {
                    set_group(&h, i, g).await.map_err(nl("group"))?;
                }
                Ok(i)
            })
        })
        .unwrap();
        Doomed {
            index,
            name: name.into(),
        }
    }

    /// Every link of this thread's namespace with its group.
    fn groups() -> Vec<(String, u32)> {
        in_netns(None, |h| {
            Box::pin(async move {
                use futures::TryStreamExt;
                use rtnetlink::packet_route::link::LinkAttribute;
                let mut out = Vec::new();
                let mut links = h.link().get().execute();
                while let Some(l) = links.try_next().await.map_err(nl("list"))? {
                    let mut name = String::new();
                    let mut group = 0;
                    for a in &l.attributes {
                        match a {
                            LinkAttribute::IfName(n) => name = n.clone(),
                            LinkAttribute::Group(g) => group = *g,
                            _ => {}
                        }
                    }
                    out.push((name, group));
                }
                Ok(out)
            })
        })
        .unwrap()
    }
}
