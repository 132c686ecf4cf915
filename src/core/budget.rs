//! How often a VM may have its status written: a token bucket per VM and
//! one for the whole host, so no guest (an agent connecting and going away
//! in a loop) and no burst of VMs floods the status store (etcd, in a
//! cluster). A write over budget is not lost: the status is the truth in
//! memory, and the write waits until the buckets allow it, carrying every
//! change made meanwhile (coalesced). Pure: the caller gives the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: f64,
}

impl Rate {
    /// A few writes a second per VM: every phase change of a start fits
    /// its burst at once.
    pub const PER_VM: Rate = Rate {
        per_second: 2.0,
        burst: 5.0,
    };
    /// The host's writes together.
    pub const PER_HOST: Rate = Rate {
        per_second: 50.0,
        burst: 200.0,
    };
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: Rate, now: Instant) -> Self {
        Self {
            tokens: rate.burst,
            at: now,
        }
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let secs = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + secs * rate.per_second).min(rate.burst);
        self.at = now;
    }

    /// How long until one token is there.
    fn wait(&self, rate: Rate) -> Duration {
        Duration::from_secs_f64(((1.0 - self.tokens) / rate.per_second).max(0.0))
    }
}

#[derive(Debug)]
pub struct WriteBudget {
    per_vm: Rate,
    per_host: Rate,
    vms: HashMap<String, Bucket>,
    host: Option<Bucket>,
}

impl WriteBudget {
    pub fn new(per_vm: Rate, per_host: Rate) -> Self {
        Self {
            per_vm,
            per_host,
            vms: HashMap::new(),
            host: None,
        }
    }

    /// Takes one write for `id` now, or says how long until it may.
    pub fn take(&mut self, id: &str, now: Instant) -> Result<(), Duration> {
        let (per_vm, per_host) = (self.per_vm, self.per_host);
        let host = self.host.get_or_insert_with(|| Bucket::full(per_host, now));
        host.refill(per_host, now);
        let vm = self
            .vms
            .entry(id.to_owned())
            .or_insert_with(|| Bucket::full(per_vm, now));
        vm.refill(per_vm, now);
        if vm.tokens < 1.0 || host.tokens < 1.0 {
            return Err(vm.wait(per_vm).max(host.wait(per_host)));
        }
        vm.tokens -= 1.0;
        host.tokens -= 1.0;
        Ok(())
    }

    /// A VM gone: its bucket goes too (a full one is what a new VM gets).
    pub fn forget(&mut self, id: &str) {
        self.vms.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_writes_its_burst_then_at_its_rate_and_others_are_not_held_up() {
        let t0 = Instant::now();
        let mut b = WriteBudget::new(Rate::PER_VM, Rate::PER_HOST);
        for _ in 0..5 {
            assert_eq!(b.take("a", t0), Ok(()));
        }
        let wait = b.take("a", t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        assert_eq!(b.take("b", t0), Ok(()), "another VM has its own bucket");
        assert_eq!(b.take("a", t0 + wait), Ok(()));
        assert!(b.take("a", t0 + wait).is_err());
        // A second later: two more, not five.
        let t1 = t0 + wait + Duration::from_secs(1);
        assert_eq!(b.take("a", t1), Ok(()));
        assert_eq!(b.take("a", t1), Ok(()));
        assert!(b.take("a", t1).is_err());
    }

    #[test]
    fn the_host_budget_holds_for_all_vms_together() {
        let t0 = Instant::now();
        let host = Rate {
            per_second: 10.0,
            burst: 20.0,
        };
        let mut b = WriteBudget::new(Rate::PER_VM, host);
        let ok = (0..100)
            .filter(|i| b.take(&format!("vm{i}"), t0).is_ok())
            .count();
        assert_eq!(ok, 20);
        let wait = b.take("vm200", t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(100));
        b.forget("vm0");
        assert_eq!(b.take("vm200", t0 + wait), Ok(()));
    }
}
