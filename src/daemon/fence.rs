//! The self-fence as it runs: from kvirtd's first moment in a cluster
//! (before it has a certificate or a first list of VMIs, which a host cut
//! off never gets), each second it asks how long the Lease has gone
//! unrenewed, and once [`SelfFence::due`] it kills every VM on shared disks
//! and records each (`/run/kvirt/fenced`): the loop then tears them down,
//! never starts them here again, and fails their VMIs with why once the
//! API server answers.

use crate::core::fence::{to_fence, Fenced, SelfFence};
use crate::core::key;
use crate::host::marks::Records;
use crate::host::systemd::Units;
use std::collections::BTreeSet;
use std::time::Duration;
use tracing::{error, info, warn};

/// Looks every second, for ever; `say` gets the `STATUS=` line when the
/// host fences (before kvirtd is ready, nothing else says it).
pub async fn watch<U: Units, F: Records<Fenced>>(
    units: U,
    fences: F,
    policy: SelfFence,
    unrenewed: impl Fn() -> Duration,
    say: impl Fn(&str),
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut fenced = false;
    let mut killed = BTreeSet::new();
    loop {
        tick.tick().await;
        let since = unrenewed();
        if !policy.due(since) {
            if fenced {
                // STATUS= is the loop's again (it counts the VMs fenced).
                info!("the Lease is renewed again: VMs on shared disks may start here");
                fenced = false;
                killed.clear();
            }
            continue;
        }
        let stopped = fence(&units, &fences, &policy, since, &mut killed).await;
        if !fenced || stopped > 0 {
            error!(
                unrenewed_seconds = since.as_secs(),
                stopped, "self-fence: this host could not renew its Lease"
            );
            say(&policy.status(since, fences.all().len()));
        }
        fenced = true;
    }
}

/// Kills and records every VM on shared disks that runs; how many. The
/// record comes first: whatever happens after, the VM is not started here
/// again. `killed` holds the VMIs (by uid) killed already: their units
/// live on with a daemon systemd started again, and nothing else. A kill
/// that failed, or a VM that started since, is tried on the next look.
pub async fn fence<U: Units, F: Records<Fenced>>(
    units: &U,
    fences: &F,
    policy: &SelfFence,
    since: Duration,
    killed: &mut BTreeSet<String>,
) -> usize {
    let ids = match units.list_ids().await {
        Ok(ids) => ids,
        Err(e) => {
            warn!("self-fence: listing the VMs' units: {e}");
            return 0;
        }
    };
    let mut stopped = 0;
    for id in ids {
        let name = key::unit_name_of(&id);
        let unit = match units.get(&name).await {
            Ok(Some(u)) => u,
            Ok(None) => continue,
            Err(e) => {
                warn!("self-fence: {name}: {e}");
                continue;
            }
        };
        let Some(uid) = to_fence(&unit).filter(|u| !killed.contains(*u)) else {
            continue;
        };
        let recorded = fences.get(&id).ok().flatten();
        if !recorded.as_ref().is_some_and(|f| f.holds_for(Some(uid))) {
            let record = Fenced {
                vmi_uid: uid.to_owned(),
                why: policy.why(since),
            };
            if let Err(e) = fences.set(&id, &record) {
                error!("self-fence: {e}; stopping {name} all the same");
            }
        }
        match units.kill_all(&name).await {
            Ok(()) => {
                error!(vm = %id, "self-fence: VM on shared disks stopped");
                killed.insert(uid.to_owned());
                stopped += 1;
            }
            Err(e) => error!(vm = %id, "self-fence: stopping {name}: {e}"),
        }
    }
    stopped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::plan::{UnitActivity, UnitObs};
    use crate::daemon::fake::FakeHost;
    use std::sync::{Arc, Mutex};

    fn unit(uid: &str, shared: bool) -> UnitObs {
        UnitObs::of(uid, UnitActivity::Active, shared)
    }

    fn host() -> FakeHost {
        let h = FakeHost::default();
        let mut s = h.state();
        s.units
            .insert("kvirt-vm@ns_shared.service".into(), unit("u-s", true));
        s.units
            .insert("kvirt-vm@ns_local.service".into(), unit("u-l", false));
        drop(s);
        h
    }

    fn policy() -> SelfFence {
        SelfFence::new(Duration::from_secs(60), Duration::from_secs(20)).unwrap()
    }

    #[tokio::test]
    async fn only_vms_on_shared_disks_are_killed_and_recorded_first() {
        let h = host();
        let mut killed = BTreeSet::new();
        let n = fence(&h, &h, &policy(), Duration::from_secs(41), &mut killed).await;
        assert_eq!(n, 1);
        let calls = h.state().calls.clone();
        let record = calls.iter().position(|c| c == "fenced ns_shared").unwrap();
        let kill = (calls.iter())
            .position(|c| c == "kill kvirt-vm@ns_shared.service")
            .unwrap();
        assert!(record < kill, "{calls:?}");
        assert!(!calls.iter().any(|c| c.contains("ns_local")), "{calls:?}");
        let f = Records::<Fenced>::get(&h, "ns_shared").unwrap().unwrap();
        assert_eq!(f.vmi_uid, "u-s");
        assert!(f.why.contains("41 s"), "{}", f.why);
        // Looked at again: its unit lives on (systemd started its daemon
        // again), but it was killed and recorded once.
        fence(&h, &h, &policy(), Duration::from_secs(42), &mut killed).await;
        let calls = h.state().calls.clone();
        assert_eq!(calls.iter().filter(|c| *c == "fenced ns_shared").count(), 1);
        assert_eq!(calls.iter().filter(|c| c.starts_with("kill")).count(), 1);
        // A new kvirtd (nothing killed as far as it knows) kills it again,
        // and keeps the record.
        fence(
            &h,
            &h,
            &policy(),
            Duration::from_secs(43),
            &mut BTreeSet::new(),
        )
        .await;
        let calls = h.state().calls.clone();
        assert_eq!(calls.iter().filter(|c| *c == "fenced ns_shared").count(), 1);
        assert_eq!(calls.iter().filter(|c| c.starts_with("kill")).count(), 2);
    }

    #[tokio::test]
    async fn a_kill_that_fails_leaves_the_record_and_is_tried_again() {
        let h = host();
        h.state().fail.insert("kill".into());
        let mut killed = BTreeSet::new();
        assert_eq!(
            fence(&h, &h, &policy(), Duration::from_secs(50), &mut killed).await,
            0
        );
        assert!(Records::<Fenced>::get(&h, "ns_shared").unwrap().is_some());
        h.state().fail.clear();
        assert_eq!(
            fence(&h, &h, &policy(), Duration::from_secs(51), &mut killed).await,
            1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_fences_once_due_and_says_so_once() {
        let h = host();
        let unrenewed = Arc::new(Mutex::new(Duration::from_secs(10)));
        let said = Arc::new(Mutex::new(Vec::<String>::new()));
        let (u, s) = (unrenewed.clone(), said.clone());
        let task = tokio::spawn(watch(
            h.clone(),
            h.clone(),
            policy(),
            move || *u.lock().unwrap(),
            move |m| s.lock().unwrap().push(m.into()),
        ));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(!h.state().calls.iter().any(|c| c.starts_with("kill")));
        *unrenewed.lock().unwrap() = Duration::from_secs(40);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(h.state().calls.iter().any(|c| c.starts_with("kill")));
        assert!(said.lock().unwrap()[0].starts_with("fenced: Lease unrenewed for 40 s"));
        // Said once, and killed once, not every second.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(said.lock().unwrap().len(), 1);
        assert_eq!(
            h.state()
                .calls
                .iter()
                .filter(|c| c.starts_with("kill"))
                .count(),
            1
        );
        *unrenewed.lock().unwrap() = Duration::from_secs(1);
        let kills = || {
            h.state()
                .calls
                .iter()
                .filter(|c| c.starts_with("kill"))
                .count()
        };
        let before = kills();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(kills(), before, "renewed: nothing more is killed");
        task.abort();
    }
}
