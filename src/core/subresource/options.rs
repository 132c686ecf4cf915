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
        VmAction::Start => Verb::Start { paused: o.paused },
        VmAction::Stop => Verb::Stop {
            grace: grace(o.grace_period)?,
        },
        // virt-api's own checks and words: only a forced restart (0) has a
        // grace period.
        VmAction::Restart => match o.grace_period_seconds {
            None => Verb::Restart { force: false },
            Some(0) => Verb::Restart { force: true },
            Some(g) if g > 0 => {
                return Err(ApiError::bad_request(
                    "For force restart, only gracePeriod=0 is supported for now",
                ))
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "gracePeriod has to be greater or equal to 0",
                ))
            }
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
        let start = |paused| Some(Verb::Start { paused });
        assert_eq!(verb(VmAction::Start, b"").unwrap(), start(false));
        assert_eq!(verb(VmAction::Start, b"{}").unwrap(), start(false));
        assert_eq!(
            verb(VmAction::Start, br#"{"paused":true}"#).unwrap(),
            start(true)
        );
        assert_eq!(
            verb(VmAction::Stop, br#"{"gracePeriod":0}"#).unwrap(),
            Some(Verb::Stop { grace: Some(0) })
        );
        let restart = |force| Some(Verb::Restart { force });
        assert_eq!(verb(VmAction::Restart, b"{}").unwrap(), restart(false));
        assert_eq!(
            verb(VmAction::Restart, br#"{"gracePeriodSeconds":0}"#).unwrap(),
            restart(true)
        );
        assert_eq!(
            verb(VmAction::Stop, br#"{"dryRun":["All"]}"#).unwrap(),
            None
        );
    }

    #[test]
    fn what_kvirt_cannot_honour_is_refused() {
        for (a, body, why) in [
            (VmAction::Stop, &br#"{"gracePeriod":-1}"#[..], "negative"),
            (
                VmAction::Restart,
                br#"{"gracePeriodSeconds":5}"#,
                "only gracePeriod=0",
            ),
            (
                VmAction::Restart,
                br#"{"gracePeriodSeconds":-1}"#,
                "greater or equal to 0",
            ),
            (VmAction::Stop, br#"{"dryRun":["Some"]}"#, "only All"),
            (VmAction::Stop, b"not json", "unmarshal"),
        ] {
            let e = verb(a, body).unwrap_err();
            assert_eq!(e.code, 400, "{a:?} {body:?}");
            assert!(e.message.contains(why), "{a:?}: {}", e.message);
        }
    }
}
