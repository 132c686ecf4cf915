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

/// KubeVirt's MigrateOptions: what `virtctl migrate` sends.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MigrateOptions {
    #[serde(default)]
    dry_run: Vec<String>,
    #[serde(default)]
    added_node_selector: std::collections::BTreeMap<String, String>,
}

/// The `addedNodeSelector` a `migrate` body asks for; `None` for a dry run.
pub fn migrate(
    body: &[u8],
) -> Result<Option<std::collections::BTreeMap<String, String>>, ApiError> {
    let o: MigrateOptions = parse(body)?;
    check_dry_run(&o.dry_run)?;
    Ok(o.dry_run.is_empty().then_some(o.added_node_selector))
}

/// A request's body as virt-api reads it: empty is the defaults.
fn parse<T: Default + serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "Can not unmarshal Request body to struct, error: {e}"
        ))
    })
}

fn check_dry_run(dry_run: &[String]) -> Result<(), ApiError> {
    if dry_run.iter().any(|d| d != "All") {
        return Err(ApiError::bad_request(format!(
            "dryRun {dry_run:?}: only All is valid"
        )));
    }
    Ok(())
}

/// What a VM subresource's body asks; `None` for a dry run (checked, not
/// done). Options kvirt cannot honour are refused.
pub fn verb(action: VmAction, body: &[u8]) -> Result<Option<Verb>, ApiError> {
    let o: Options = parse(body)?;
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
        VmAction::ExpandSpec | VmAction::Migrate => {
            return Err(ApiError::bad_request(format!(
                "{} takes no run options",
                action.name()
            )))
        }
    };
    check_dry_run(&o.dry_run)?;
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
        let selector = migrate(br#"{"addedNodeSelector":{"zone":"z2"}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(selector.get("zone").map(String::as_str), Some("z2"));
        assert_eq!(migrate(b"").unwrap(), Some(Default::default()));
        assert_eq!(migrate(br#"{"dryRun":["All"]}"#).unwrap(), None);
        assert!(migrate(br#"{"dryRun":["Some"]}"#).is_err());
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
