//! Host CPUs as sets, and which VM holds which of them (KubeVirt's
//! `dedicatedCpuPlacement`, which kubelet's static CPU manager serves in a
//! pod). Pure: `host::cpus` keeps the allocation on disk, the controller
//! asks it for a VM's CPUs before its conversion and holds them from its
//! unit's start to its end.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::str::FromStr;

/// Far above any host kvirt targets (the kernel's own default NR_CPUS is
/// 8192): a typo such as "0-4000000000" is refused, not allocated.
pub const MAX_CPU: u32 = 8191;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuSetError {
    #[error("{0:?} is not a CPU list such as \"0-3,6\"")]
    Syntax(String),
    #[error("CPU {0} is beyond the highest kvirt knows ({MAX_CPU})")]
    TooHigh(u32),
    #[error("{0:?}: a range must not go down")]
    Backwards(String),
    #[error(
        "needs {want} dedicated CPUs, but only {free} of this host's {pool} dedicated CPUs ({pool_list}) are free{held}{kept}"
    )]
    NotEnough {
        want: u32,
        free: usize,
        pool: usize,
        pool_list: String,
        /// ", held by ..." or empty.
        held: String,
        /// A note that one is kept for VMs without dedicated CPUs, or empty.
        kept: &'static str,
    },
    #[error("CPUs {cpus} are held by {holder}")]
    Taken { cpus: String, holder: String },
}

/// A set of CPU numbers, written as Linux writes them (`0-3,6`): in
/// `/sys/devices/system/cpu/online`, `cpuset.cpus` and libvirt's `cpuset`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CpuSet(BTreeSet<u32>);

impl CpuSet {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    pub fn contains(&self, cpu: u32) -> bool {
        self.0.contains(&cpu)
    }

    pub fn union(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.union(&other.0).copied().collect())
    }

    pub fn minus(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.difference(&other.0).copied().collect())
    }

    pub fn and(&self, other: &CpuSet) -> CpuSet {
        CpuSet(self.0.intersection(&other.0).copied().collect())
    }

    pub fn is_disjoint(&self, other: &CpuSet) -> bool {
        self.0.is_disjoint(&other.0)
    }

    /// systemd's `AllowedCPUs` on D-Bus (`ay`): bit `n % 8` of byte
    /// `n / 8` for CPU `n`.
    pub fn to_mask(&self) -> Vec<u8> {
        let Some(&last) = self.0.last() else {
            return Vec::new();
        };
        let mut mask = vec![0u8; last as usize / 8 + 1];
        for &c in &self.0 {
            mask[c as usize / 8] |= 1 << (c % 8);
        }
        mask
    }

    pub fn from_mask(mask: &[u8]) -> CpuSet {
        let cpus = mask.iter().enumerate().flat_map(|(i, byte)| {
            (0..8u32)
                .filter(move |b| byte & (1 << b) != 0)
                .map(move |b| i as u32 * 8 + b)
        });
        CpuSet(cpus.filter(|&c| c <= MAX_CPU).collect())
    }
}

impl FromIterator<u32> for CpuSet {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        CpuSet(iter.into_iter().collect())
    }
}

impl FromStr for CpuSet {
    type Err = CpuSetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut set = BTreeSet::new();
        let text = s.trim();
        if text.is_empty() {
            return Ok(CpuSet(set));
        }
        let num = |t: &str| -> Result<u32, CpuSetError> {
            let t = t.trim();
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(CpuSetError::Syntax(s.to_owned()));
            }
            let n: u64 = t.parse().map_err(|_| CpuSetError::Syntax(s.to_owned()))?;
            u32::try_from(n)
                .ok()
                .filter(|&n| n <= MAX_CPU)
                .ok_or(CpuSetError::TooHigh(u32::try_from(n).unwrap_or(u32::MAX)))
        };
        for part in text.split(',') {
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => {
                    let n = num(part)?;
                    (n, n)
                }
            };
            if hi < lo {
                return Err(CpuSetError::Backwards(part.trim().to_owned()));
            }
            set.extend(lo..=hi);
        }
        Ok(CpuSet(set))
    }
}

impl TryFrom<String> for CpuSet {
    type Error = CpuSetError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<CpuSet> for String {
    fn from(s: CpuSet) -> String {
        s.to_string()
    }
}

impl fmt::Display for CpuSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut cpus = self.0.iter().copied().peekable();
        while let Some(lo) = cpus.next() {
            let mut hi = lo;
            while cpus.peek() == Some(&(hi + 1)) {
                hi = cpus.next().unwrap_or(hi);
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if hi == lo {
                write!(f, "{lo}")?
            } else {
                write!(f, "{lo}-{hi}")?
            }
        }
        Ok(())
    }
}

/// Which VM (by id) holds which dedicated CPUs. No CPU is held twice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Allocation {
    held: BTreeMap<String, CpuSet>,
}

impl Allocation {
    pub fn get(&self, id: &str) -> Option<&CpuSet> {
        self.held.get(id)
    }

    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.held.keys().map(String::as_str)
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Every CPU some VM holds.
    pub fn held(&self) -> CpuSet {
        self.held
            .values()
            .fold(CpuSet::default(), |all, s| all.union(s))
    }

    /// Where VMs without dedicated CPUs (and the host) run: what no VM holds.
    pub fn shared(&self, online: &CpuSet) -> CpuSet {
        online.minus(&self.held())
    }

    /// The CPUs `id` would run on: those it holds when they are as many as
    /// it wants, else the lowest `want` of `pool` no other VM holds.
    /// `keep_shared`: a VM without dedicated CPUs runs, so one CPU of
    /// `online` stays out of every VM's hold (systemd cannot give a unit no
    /// CPU at all). Changes nothing: [`Allocation::claim`] records.
    pub fn propose(
        &self,
        id: &str,
        want: u32,
        pool: &CpuSet,
        online: &CpuSet,
        keep_shared: bool,
    ) -> Result<CpuSet, CpuSetError> {
        if let Some(mine) = self.held.get(id).filter(|m| m.len() == want as usize) {
            return Ok(mine.clone());
        }
        let others: CpuSet = self
            .held
            .iter()
            .filter(|(h, _)| h.as_str() != id)
            .fold(CpuSet::default(), |all, (_, s)| all.union(s));
        let free = pool.minus(&others);
        let unheld_after = |taken: &CpuSet| online.minus(&others).minus(taken);
        let pick: CpuSet = free.iter().take(want as usize).collect();
        if pick.len() == want as usize && !(keep_shared && unheld_after(&pick).is_empty()) {
            return Ok(pick);
        }
        let kept = keep_shared && free.len() >= want as usize;
        Err(CpuSetError::NotEnough {
            want,
            free: if kept { free.len() - 1 } else { free.len() },
            pool: pool.len(),
            pool_list: pool.to_string(),
            held: self.holders_text(id),
            kept: if kept {
                "; the last one stays for the VMs without dedicated CPUs that run"
            } else {
                ""
            },
        })
    }

    fn holders_text(&self, id: &str) -> String {
        let holders: Vec<String> = self
            .held
            .iter()
            .filter(|(h, _)| h.as_str() != id)
            .map(|(h, s)| format!("{s} by {h}"))
            .collect();
        if holders.is_empty() {
            String::new()
        } else {
            format!(" (held: {})", holders.join(", "))
        }
    }

    /// Records `cpus` as `id`'s (replacing what it held). Returns whether
    /// anything changed; fails, changing nothing, when another VM holds
    /// any of them.
    pub fn claim(&mut self, id: &str, cpus: &CpuSet) -> Result<bool, CpuSetError> {
        if self.held.get(id) == Some(cpus) {
            return Ok(false);
        }
        for (holder, set) in self.held.iter().filter(|(h, _)| h.as_str() != id) {
            let both = set.and(cpus);
            if !both.is_empty() {
                return Err(CpuSetError::Taken {
                    cpus: both.to_string(),
                    holder: holder.clone(),
                });
            }
        }
        self.held.insert(id.to_owned(), cpus.clone());
        Ok(true)
    }

    pub fn release(&mut self, id: &str) -> Option<CpuSet> {
        self.held.remove(id)
    }

    /// Keeps only the ids `keep` says; returns what the others held.
    pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) -> Vec<(String, CpuSet)> {
        let gone: Vec<String> = self.held.keys().filter(|id| !keep(id)).cloned().collect();
        gone.into_iter()
            .filter_map(|id| self.held.remove(&id).map(|s| (id, s)))
            .collect()
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("an allocation serialises")
    }

    /// A file whose sets overlap is refused whole: which VM owns a CPU
    /// held twice cannot be known.
    pub fn decode(bytes: &[u8]) -> Result<Allocation, String> {
        let raw: Allocation = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let mut checked = Allocation::default();
        for (id, set) in &raw.held {
            checked.claim(id, set).map_err(|e| format!("{id}: {e}"))?;
        }
        Ok(checked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(s: &str) -> CpuSet {
        s.parse().unwrap()
    }

    #[test]
    fn lists_parse_and_print_as_linux_writes_them() {
        for (text, cpus, printed) in [
            ("", vec![], ""),
            ("0", vec![0], "0"),
            ("0-3,6", vec![0, 1, 2, 3, 6], "0-3,6"),
            (" 5,1-2 ,2 ", vec![1, 2, 5], "1-2,5"),
            ("8-8", vec![8], "8"),
            ("0,1,2,7-9", vec![0, 1, 2, 7, 8, 9], "0-2,7-9"),
        ] {
            let s = set(text);
            assert_eq!(s.iter().collect::<Vec<_>>(), cpus, "{text:?}");
            assert_eq!(s.to_string(), printed, "{text:?}");
            assert_eq!(set(printed), s);
        }
        for bad in ["a", "1-", "-1", "1--2", "1,,2", "0x3", "+1", "1 2"] {
            assert_eq!(set_err(bad), CpuSetError::Syntax(bad.into()), "{bad:?}");
        }
        assert_eq!(set_err("3-1"), CpuSetError::Backwards("3-1".into()));
        assert_eq!(set_err("0-4000000000"), CpuSetError::TooHigh(4_000_000_000));
        assert_eq!(set_err("8192"), CpuSetError::TooHigh(8192));
        assert_eq!(set_err("99999999999999"), CpuSetError::TooHigh(u32::MAX));
    }

    fn set_err(s: &str) -> CpuSetError {
        s.parse::<CpuSet>().unwrap_err()
    }

    #[test]
    fn masks_are_systemds_bytes() {
        assert_eq!(set("").to_mask(), Vec::<u8>::new());
        assert_eq!(set("0").to_mask(), [0x01]);
        assert_eq!(set("1,3").to_mask(), [0x0a]);
        assert_eq!(set("7-9").to_mask(), [0x80, 0x03]);
        for s in ["", "0", "0-63", "5,17,1000"] {
            assert_eq!(CpuSet::from_mask(&set(s).to_mask()), set(s));
        }
    }

    #[test]
    fn vms_get_disjoint_cpus_from_the_pool_and_the_numbers_when_none_are_left() {
        let (pool, online) = (set("2-5"), set("0-5"));
        let mut a = Allocation::default();
        let one = a.propose("ns_a", 2, &pool, &online, false).unwrap();
        assert_eq!(one, set("2,3"));
        // A proposal is only that: a second one before the claim is the same.
        assert_eq!(a.propose("ns_a", 2, &pool, &online, false).unwrap(), one);
        assert!(a.claim("ns_a", &one).unwrap());
        assert!(!a.claim("ns_a", &one).unwrap());
        let two = a.propose("ns_b", 1, &pool, &online, false).unwrap();
        assert_eq!(two, set("4"));
        a.claim("ns_b", &two).unwrap();
        // What it holds is its own on the next pass (and after a restart).
        assert_eq!(a.propose("ns_a", 2, &pool, &online, false).unwrap(), one);
        assert_eq!(a.shared(&online).to_string(), "0-1,5");

        let err = a.propose("ns_c", 2, &pool, &online, false).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 2 dedicated CPUs, but only 1 of this host's 4 dedicated CPUs (2-5) are free \
             (held: 2-3 by ns_a, 4 by ns_b)"
        );
        // A claim of a held CPU fails and changes nothing.
        let before = a.clone();
        assert_eq!(
            a.claim("ns_c", &set("3-5")).unwrap_err(),
            CpuSetError::Taken {
                cpus: "3".into(),
                holder: "ns_a".into()
            }
        );
        assert_eq!(a, before);

        assert_eq!(a.release("ns_a"), Some(one.clone()));
        assert_eq!(a.propose("ns_c", 2, &pool, &online, false).unwrap(), one);
    }

    #[test]
    fn the_last_cpu_stays_unheld_while_a_vm_without_dedicated_cpus_runs() {
        let all = set("0,1");
        let mut a = Allocation::default();
        a.claim("ns_a", &set("0")).unwrap();
        let err = a.propose("ns_b", 1, &all, &all, true).unwrap_err();
        assert_eq!(
            err.to_string(),
            "needs 1 dedicated CPUs, but only 0 of this host's 2 dedicated CPUs (0-1) are free \
             (held: 0 by ns_a); the last one stays for the VMs without dedicated CPUs that run"
        );
        assert_eq!(a.propose("ns_b", 1, &all, &all, false).unwrap(), set("1"));
    }

    #[test]
    fn a_file_round_trips_and_one_holding_a_cpu_twice_is_refused() {
        let mut a = Allocation::default();
        a.claim("ns_a", &set("0,2")).unwrap();
        a.claim("ns_b", &set("1")).unwrap();
        assert_eq!(Allocation::decode(&a.encode()).unwrap(), a);
        let twice = br#"{"held": {"ns_a": "0-2", "ns_b": "2"}}"#;
        assert_eq!(
            Allocation::decode(twice).unwrap_err(),
            "ns_b: CPUs 2 are held by ns_a"
        );
        assert!(Allocation::decode(br#"{"held": {"ns_a": "x"}}"#).is_err());
        let mut gone = a.clone();
        assert_eq!(
            gone.retain(|id| id == "ns_b"),
            [("ns_a".to_owned(), set("0,2"))]
        );
        assert_eq!(gone.ids().collect::<Vec<_>>(), ["ns_b"]);
    }
}
