//! `clock` → `<clock>` with its timers.

use super::domain::{Clock, Timer};
use super::Errors;
use crate::core::vmi;

pub(super) fn convert(c: Option<&vmi::Clock>, errs: &mut Errors) -> Clock {
    const PATH: &str = "spec.domain.clock";
    let mut out = Clock {
        offset: "utc",
        adjustment: None,
        timezone: None,
        timers: Vec::new(),
    };
    let Some(c) = c else {
        return out;
    };
    errs.reject_extra(PATH, &c.extra);
    match (&c.utc, &c.timezone) {
        (Some(_), Some(_)) => errs.add(PATH, "set only one of utc and timezone"),
        (Some(utc), None) => {
            errs.reject_extra(&format!("{PATH}.utc"), &utc.extra);
            out.adjustment = utc.offset_seconds.map(|s| s.to_string());
        }
        (None, Some(tz)) => {
            // libvirt's own pattern for time zone names; also keeps paths out.
            let ok = !tz.is_empty()
                && !tz.starts_with('/')
                && !tz.split('/').any(|p| p == "..")
                && tz
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"_.+-/".contains(&b));
            if ok {
                out.offset = "timezone";
                out.timezone = Some(tz.clone());
            } else {
                errs.add(
                    format!("{PATH}.timezone"),
                    format!("{tz:?} is not a time zone name"),
                );
            }
        }
        (None, None) => {}
    }
    if let Some(t) = &c.timer {
        let path = format!("{PATH}.timer");
        errs.reject_extra(&path, &t.extra);
        let timers = [
            (
                "hpet",
                "hpet",
                &t.hpet,
                &["delay", "catchup", "merge", "discard"][..],
            ),
            ("kvm", "kvmclock", &t.kvm, &[][..]),
            ("pit", "pit", &t.pit, &["delay", "catchup", "discard"][..]),
            ("rtc", "rtc", &t.rtc, &["delay", "catchup"][..]),
            ("hyperv", "hypervclock", &t.hyperv, &[][..]),
        ];
        for (field, name, timer, policies) in timers {
            let Some(timer) = timer else { continue };
            let path = format!("{path}.{field}");
            errs.reject_extra(&path, &timer.extra);
            let tickpolicy = timer.tick_policy.as_deref().and_then(|p| {
                let found = policies.iter().copied().find(|&q| q == p);
                if found.is_none() {
                    errs.add(
                        format!("{path}.tickPolicy"),
                        format!("{p:?} is not one of {policies:?}"),
                    );
                }
                found
            });
            out.timers.push(Timer {
                name,
                present: timer.present.map(|p| if p { "yes" } else { "no" }),
                tickpolicy,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::DomainType;

    fn conv(clock: &str) -> Result<String, Vec<String>> {
        let v = vmi(&format!(
            "domain: {{memory: {{guest: 64Mi}}, clock: {clock}}}"
        ));
        run(&v, DomainType::Kvm)
            .map(|c| c.domain_xml)
            .map_err(|e| e.into_iter().map(|e| e.field).collect())
    }

    #[test]
    fn offsets() {
        assert!(run(&vmi(MEM), DomainType::Kvm)
            .unwrap()
            .domain_xml
            .contains("<clock offset=\"utc\"/>"));
        assert!(conv("{utc: {offsetSeconds: -3600}}")
            .unwrap()
            .contains("<clock offset=\"utc\" adjustment=\"-3600\"/>"));
        assert!(conv("{timezone: Europe/Berlin}")
            .unwrap()
            .contains("<clock offset=\"timezone\" timezone=\"Europe/Berlin\"/>"));
    }

    #[test]
    fn timers() {
        let x =
            conv("{utc: {}, timer: {hpet: {present: false}, rtc: {tickPolicy: catchup}, kvm: {}, hyperv: {}}}")
                .unwrap();
        assert!(
            x.contains(
                "<clock offset=\"utc\">\n    <timer name=\"hpet\" present=\"no\"/>\n    \
                 <timer name=\"kvmclock\" present=\"yes\"/>\n    \
                 <timer name=\"rtc\" present=\"yes\" tickpolicy=\"catchup\"/>\n    \
                 <timer name=\"hypervclock\" present=\"yes\"/>\n  </clock>"
            ),
            "{x}"
        );
    }

    #[test]
    fn errors() {
        assert_eq!(
            conv("{utc: {}, timezone: UTC}").unwrap_err(),
            ["spec.domain.clock"]
        );
        assert_eq!(
            conv("{timezone: ../../etc/passwd}").unwrap_err(),
            ["spec.domain.clock.timezone"]
        );
        assert_eq!(
            conv("{timer: {rtc: {tickPolicy: merge, track: guest}, tsc: {}}}").unwrap_err(),
            [
                "spec.domain.clock.timer.tsc",
                "spec.domain.clock.timer.rtc.track",
                "spec.domain.clock.timer.rtc.tickPolicy"
            ]
        );
    }
}
