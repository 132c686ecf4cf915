//! A live migration's figures as it runs (libvirt's job statistics), and
//! how they are shown: a condition on the migration object (KubeVirt's
//! objects have no field for them; its figures are metrics only) and
//! kvirt's metrics.

use serde_json::{json, Value};

/// The condition type on a `VirtualMachineInstanceMigration` carrying its
/// figures while it runs, and how it ended.
pub const CONDITION: &str = "kvirt.io/Progress";

/// A running migration job, as the source daemon reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub data_total: u64,
    pub data_processed: u64,
    pub data_remaining: u64,
    /// Passes over guest memory so far (each after the first resends what
    /// the guest dirtied).
    pub iterations: u64,
    /// The guest's pause at the switch-over, once known.
    pub downtime_ms: Option<u64>,
    pub elapsed_ms: u64,
}

const MIB: f64 = 1024.0 * 1024.0;

impl Progress {
    /// One line: `iteration 3: 12.3 MiB of 128.0 MiB remaining, 140.2 MiB
    /// sent in 4.1 s`.
    pub fn line(&self) -> String {
        format!(
            "iteration {}: {:.1} MiB of {:.1} MiB remaining, {:.1} MiB sent in {:.1} s",
            self.iterations,
            self.data_remaining as f64 / MIB,
            self.data_total as f64 / MIB,
            self.data_processed as f64 / MIB,
            self.elapsed_ms as f64 / 1000.0,
        )
    }
}

/// The migration object's status patch with its progress condition:
/// `reason` `Running` with the figures' line while it runs, else how it
/// ended (`Succeeded`/`Failed`, with what the source said).
pub fn condition_patch(reason: &str, message: &str, now: &str) -> Value {
    json!({
        "status": {
            "conditions": [{
                "type": CONDITION,
                "status": if reason == "Failed" { "False" } else { "True" },
                "reason": reason,
                "message": message,
                "lastProbeTime": now,
                "lastTransitionTime": now,
            }]
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_figures_read_as_one_line_in_mib() {
        let p = Progress {
            data_total: 128 * 1024 * 1024,
            data_processed: 140 * 1024 * 1024 + 200 * 1024,
            data_remaining: 12 * 1024 * 1024 + 300 * 1024,
            iterations: 3,
            downtime_ms: None,
            elapsed_ms: 4100,
        };
        assert_eq!(
            p.line(),
            "iteration 3: 12.3 MiB of 128.0 MiB remaining, 140.2 MiB sent in 4.1 s"
        );
    }

    #[test]
    fn the_condition_says_running_or_how_it_ended() {
        let c = |reason| condition_patch(reason, "m", "2026-12-06T00:00:00Z");
        let running = c("Running");
        let cond = &running["status"]["conditions"][0];
        assert_eq!(cond["type"], CONDITION);
        assert_eq!(cond["status"], "True");
        assert_eq!(cond["message"], "m");
        assert_eq!(c("Failed")["status"]["conditions"][0]["status"], "False");
        assert_eq!(
            c("Succeeded")["status"]["conditions"][0]["reason"],
            "Succeeded"
        );
    }
}
