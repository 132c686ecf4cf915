//! A namespace's allowance for its VMs' emptyDisks: the `ephemeral-storage`
//! of its ResourceQuotas, as a pod's emptyDir counts against them.
//!
//! kvirt has no pods for the quota controller to count, so each kvirtd
//! decides alone, from the same facts every other kvirtd sees: the
//! namespace's VMIs and their emptyDisk capacities. VMIs kvirt has admitted
//! (they hold its finalizer) count first, whatever the quota is now, so a
//! quota lowered never stops a VM. The rest are admitted in order of
//! creation while they fit: two hosts deciding at once about two VMIs
//! decide alike, and the namespace never goes over.

use crate::core::quantity::Quantity;
use crate::core::vmi::{Phase, VirtualMachineInstance};

/// The ResourceQuota keys whose figure bounds emptyDisks.
pub const KEYS: &[&str] = &[
    "requests.ephemeral-storage",
    "limits.ephemeral-storage",
    "ephemeral-storage",
];

/// One bound: the ResourceQuota, its key and its figure in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hard {
    pub quota: String,
    pub key: String,
    pub bytes: u64,
}

/// A VMI of the namespace as the allowance sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub name: String,
    pub uid: String,
    /// `metadata.creationTimestamp` (RFC 3339, which sorts as time does).
    pub created: String,
    pub bytes: u64,
    /// kvirt admitted it (it holds kvirt's finalizer).
    pub admitted: bool,
}

/// The bounds of these quotas (`name`, `hard`) that concern emptyDisks.
/// A figure that cannot be read bounds to zero: a quota kvirt cannot
/// understand must not be taken as none.
pub fn bounds(quotas: impl IntoIterator<Item = (String, Vec<(String, String)>)>) -> Vec<Hard> {
    let mut out = Vec::new();
    for (quota, hard) in quotas {
        for (key, value) in hard {
            if KEYS.contains(&key.as_str()) {
                out.push(Hard {
                    quota: quota.clone(),
                    key,
                    bytes: Quantity::new(value).to_bytes().unwrap_or(0),
                });
            }
        }
    }
    out
}

/// A VMI as the allowance counts it (`finalizer`: kvirt's): `None` for
/// one that holds nothing and never will (finished or deleted before kvirt
/// admitted it).
pub fn claim_of(vmi: &VirtualMachineInstance, finalizer: &str) -> Option<Claim> {
    let m = &vmi.metadata;
    let admitted = m.finalizers.iter().flatten().any(|f| f == finalizer);
    let finished = matches!(vmi.status.phase, Some(Phase::Succeeded | Phase::Failed));
    if !admitted && (finished || m.deletion_timestamp.is_some()) {
        return None;
    }
    Some(Claim {
        name: m.name.clone().unwrap_or_default(),
        uid: m.uid.clone().unwrap_or_default(),
        created: m
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        bytes: empty_disk_bytes(vmi),
        admitted,
    })
}

/// What a VMI's emptyDisks may grow to, together.
pub fn empty_disk_bytes(vmi: &VirtualMachineInstance) -> u64 {
    vmi.spec
        .volumes
        .iter()
        .filter_map(|v| v.empty_disk.as_ref())
        .map(|e| e.capacity.to_bytes().unwrap_or(u64::MAX))
        .fold(0u64, u64::saturating_add)
}

/// Whether the VMI `uid` fits every bound, beside what the namespace's
/// other VMIs hold; `Err` says which quota, with the figures.
pub fn admits(bounds: &[Hard], claims: &[Claim], uid: &str) -> Result<(), String> {
    let Some(this) = claims.iter().find(|c| c.uid == uid) else {
        return Ok(());
    };
    if this.admitted || this.bytes == 0 {
        return Ok(());
    }
    let held: u64 = claims
        .iter()
        .filter(|c| c.admitted)
        .map(|c| c.bytes)
        .fold(0, u64::saturating_add);
    let mut waiting: Vec<&Claim> = claims.iter().filter(|c| !c.admitted).collect();
    waiting.sort_by(|a, b| (&a.created, &a.name).cmp(&(&b.created, &b.name)));
    for hard in bounds {
        let mut used = held;
        for c in &waiting {
            let after = used.saturating_add(c.bytes);
            if c.uid == uid {
                if after > hard.bytes {
                    return Err(refusal(hard, this, used));
                }
                break;
            }
            if after <= hard.bytes {
                used = after;
            }
        }
    }
    Ok(())
}

fn refusal(hard: &Hard, this: &Claim, used: u64) -> String {
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    format!(
        "exceeded quota: {}, requested: {}={} (emptyDisks), used: {}, limited: {}",
        hard.quota,
        hard.key,
        gib(this.bytes),
        gib(used),
        gib(hard.bytes)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(name: &str, created: &str, gib: u64, admitted: bool) -> Claim {
        Claim {
            name: name.into(),
            uid: format!("uid-{name}"),
            created: created.into(),
            bytes: gib << 30,
            admitted,
        }
    }

    fn ten_gib() -> Vec<Hard> {
        bounds([(
            "disks".to_owned(),
            vec![
                ("requests.ephemeral-storage".into(), "10Gi".into()),
                ("requests.cpu".into(), "4".into()),
            ],
        )])
    }

    #[test]
    fn only_ephemeral_storage_bounds_and_an_unreadable_figure_bounds_to_zero() {
        assert_eq!(
            ten_gib(),
            vec![Hard {
                quota: "disks".into(),
                key: "requests.ephemeral-storage".into(),
                bytes: 10 << 30,
            }]
        );
        let odd = bounds([(
            "odd".to_owned(),
            vec![("ephemeral-storage".into(), "lots".into())],
        )]);
        assert_eq!(odd[0].bytes, 0);
        let claims = [claim("a", "2026-01-01T00:00:00Z", 1, false)];
        assert!(admits(&odd, &claims, "uid-a").is_err());
    }

    /// Admitted VMs count first, whatever the quota says now; the others
    /// in order of creation, each only if it fits, so every host decides
    /// alike and the namespace never goes over.
    #[test]
    fn admitted_vms_count_first_then_the_oldest_that_fit() {
        let t = |s: u32| format!("2026-01-01T00:00:{s:02}Z");
        let claims = [
            claim("running", &t(9), 6, true),
            claim("old", &t(1), 3, false),
            claim("huge", &t(2), 8, false),
            claim("new", &t(3), 1, false),
            claim("newer", &t(4), 1, false),
        ];
        let hard = ten_gib();
        assert_eq!(admits(&hard, &claims, "uid-running"), Ok(()));
        assert_eq!(admits(&hard, &claims, "uid-old"), Ok(()));
        let err = admits(&hard, &claims, "uid-huge").unwrap_err();
        assert_eq!(
            err,
            "exceeded quota: disks, requested: requests.ephemeral-storage=8.0 GiB (emptyDisks), \
             used: 9.0 GiB, limited: 10.0 GiB"
        );
        // huge does not fit, so it holds nothing back: new fits beside
        // running and old; newer would be the 11th GiB.
        assert_eq!(admits(&hard, &claims, "uid-new"), Ok(()));
        assert!(admits(&hard, &claims, "uid-newer").is_err());

        // A quota lowered under running VMs stops none of them, and
        // admits nothing more.
        let lowered = bounds([(
            "disks".to_owned(),
            vec![("ephemeral-storage".into(), "1Gi".into())],
        )]);
        assert_eq!(admits(&lowered, &claims, "uid-running"), Ok(()));
        assert!(admits(&lowered, &claims, "uid-new").is_err());

        // No emptyDisk, no quota to fit; no quota, nothing to fit.
        let diskless = [claim("none", &t(5), 0, false)];
        assert_eq!(admits(&lowered, &diskless, "uid-none"), Ok(()));
        assert_eq!(admits(&[], &claims, "uid-huge"), Ok(()));
    }

    #[test]
    fn a_capacity_that_cannot_be_read_counts_as_everything() {
        let vmi: VirtualMachineInstance = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "x", "namespace": "n"},
            "spec": {"domain": {"devices": {}}, "volumes": [
                {"name": "a", "emptyDisk": {"capacity": "1Gi"}},
                {"name": "b", "emptyDisk": {"capacity": "2Gi"}},
                {"name": "c", "containerDisk": {"image": "r/x"}},
            ]},
        }))
        .unwrap();
        assert_eq!(empty_disk_bytes(&vmi), 3 << 30);
        let mut odd = vmi.clone();
        odd.spec.volumes[0].empty_disk.as_mut().unwrap().capacity = Quantity::new("nonsense");
        assert_eq!(empty_disk_bytes(&odd), u64::MAX);

        // Held while kvirt's finalizer is on it; nothing once finished or
        // deleted before kvirt took it.
        let c = claim_of(&vmi, "kvirt.io/f").unwrap();
        assert_eq!((c.bytes, c.admitted), (3 << 30, false));
        let mut failed = vmi.clone();
        failed.status.phase = Some(Phase::Failed);
        assert_eq!(claim_of(&failed, "kvirt.io/f"), None);
        failed.metadata.finalizers = Some(vec!["kvirt.io/f".into()]);
        assert!(claim_of(&failed, "kvirt.io/f").unwrap().admitted);
    }
}
