//! The VMI phase machine: which phase may follow which, checked.

use crate::core::vmi::Phase;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("phase {from:?} cannot become {to:?}")]
pub struct TransitionError {
    pub from: Phase,
    pub to: Phase,
}

/// Whether a VMI in this phase is done: KubeVirt never leaves these.
pub fn is_final(p: Phase) -> bool {
    matches!(p, Phase::Succeeded | Phase::Failed)
}

/// KubeVirt's phase order as far as one host drives it: Pending/Scheduling
/// belong to the cluster, Scheduled is "this host took it", and the two final
/// phases are terminal.
pub fn check(from: Option<Phase>, to: Phase) -> Result<(), TransitionError> {
    use Phase::*;
    let Some(from) = from else { return Ok(()) };
    let ok = from == to
        || match from {
            Pending | Scheduling | Unknown => true,
            Scheduled => matches!(to, Running | Succeeded | Failed),
            Running => matches!(to, Succeeded | Failed),
            Succeeded | Failed => false,
        };
    if ok {
        Ok(())
    } else {
        Err(TransitionError { from, to })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Phase::*;

    #[test]
    fn transition_table() {
        let cases = [
            (None, Scheduled, true),
            (Some(Pending), Scheduled, true),
            (Some(Scheduled), Running, true),
            (Some(Scheduled), Failed, true),
            (Some(Running), Succeeded, true),
            (Some(Running), Failed, true),
            (Some(Running), Running, true),
            (Some(Running), Scheduled, false),
            (Some(Succeeded), Running, false),
            (Some(Failed), Running, false),
            (Some(Succeeded), Failed, false),
            (Some(Failed), Scheduled, false),
        ];
        for (from, to, ok) in cases {
            assert_eq!(check(from, to).is_ok(), ok, "{from:?} -> {to:?}");
        }
    }
}
