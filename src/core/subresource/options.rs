//! The bodies of `start`, `stop` and `restart` (KubeVirt's StartOptions,
//! StopOptions, RestartOptions), read into kvirt's own request.

use super::{ApiError, VmAction};
use crate::core::vm::Verb;
use serde::Deserialize;

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Options {
    #[serde(default)]
    paused: bool,
    #[serde(default)]
    grace_period: Option<i64>,
    #[serde(default)]
    grace_period_seconds: Option<i64>,
    #[serde(default)]
    dry_run: Vec<String>,
}

/// What a VM subresource's body asks; `None` for a dry run (checked, not
/// done). Options kvirt cannot honour are refused.
pub fn verb(action: VmAction, body: &[u8]) -> Result<Option<Verb>, ApiError> {
    let o: Options = if body.iter().all(u8::is_ascii_whitespace) {
        Options::default()
    } else {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!(
                "Can not unmarshal Request body to struct, error: {e}"
            ))
        })?
    };
    let grace = |g: Option<i64>| -> Result<Option<u64>, ApiError> {
        g.map(|g| {
            u64::try_from(g)
                .map_err(|_| ApiError::bad_request(format!("gracePeriod {g} must not be negative")))
        })
        .transpose()
    };
    let verb = match action {
        VmAction::Start if o.paused => {
            return Err(ApiError::bad_request(
                "kvirt does not start a VirtualMachine paused yet (start it, then pause its VMI)",
            ))
        }
        VmAction::Start => Verb::Start,
        VmAction::Stop => Verb::Stop {
            grace: grace(o.grace_period)?,
        },
        VmAction::Restart => match grace(o.grace_period_seconds)? {
            // A forced restart (grace 0) has no equivalent in kvirt's
            // restart, which stops with the VMI's own grace period.
            Some(g) => {
                return Err(ApiError::bad_request(format!(
                    "kvirt does not restart with gracePeriodSeconds={g} yet: stop --grace-period, then start"
                )))
            }
            None => Verb::Restart,
        },
        VmAction::ExpandSpec => return Err(ApiError::bad_request("expand-spec takes no options")),
    };
    if o.dry_run.iter().any(|d| d != "All") {
        return Err(ApiError::bad_request(format!(
            "dryRun {:?}: only All is valid",
            o.dry_run
        )));
    }
    Ok((o.dry_run.is_empty()).then_some(verb))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_become_kvirts_verbs() {
        assert_eq!(verb(VmAction::Start, b"").unwrap(), Some(Verb::Start));
        assert_eq!(verb(VmAction::Start, b"{}").unwrap(), Some(Verb::Start));
        assert_eq!(
            verb(VmAction::Stop, br#"{"gracePeriod":0}"#).unwrap(),
            Some(Verb::Stop { grace: Some(0) })
        );
        assert_eq!(verb(VmAction::Restart, b"{}").unwrap(), Some(Verb::Restart));
        assert_eq!(
            verb(VmAction::Stop, br#"{"dryRun":["All"]}"#).unwrap(),
            None
        );
    }

    #[test]
    fn what_kvirt_cannot_honour_is_refused() {
        for (a, body) in [
            (VmAction::Start, &br#"{"paused":true}"#[..]),
            (VmAction::Stop, br#"{"gracePeriod":-1}"#),
            (VmAction::Restart, br#"{"gracePeriodSeconds":0}"#),
            (VmAction::Stop, br#"{"dryRun":["Some"]}"#),
            (VmAction::Stop, b"not json"),
        ] {
            assert_eq!(verb(a, body).unwrap_err().code, 400, "{a:?} {body:?}");
        }
    }
}
