//! [`LiveMigration`] on the VMs' own daemons.

use super::{close, defined, Conn, Libvirt, CALL_TIMEOUT};
use crate::host::libvirt::{DomainRef, LibvirtError};
use crate::host::migrate::{LiveMigration, MigrateTo, Progress};
use std::time::Duration;
use virt::domain::Domain;
use virt::sys;

impl LiveMigration for Libvirt {
    async fn migrate(
        &self,
        d: &DomainRef,
        to: &MigrateTo,
        timeout: Duration,
    ) -> Result<(), LibvirtError> {
        let (this, dr, to) = (self.clone(), d.clone(), to.clone());
        let call = tokio::task::spawn_blocking(move || {
            // A connection of its own: the call blocks it for as long as
            // the migration runs, and the VM's other calls go on.
            let mut own: Option<Conn> = None;
            let result = this.connect(&mut own, &dr).and_then(|conn| {
                let dom = Domain::lookup_by_name(&conn.0, &dr.name)
                    .map_err(Libvirt::err(&dr.id, "lookup domain"))?;
                dom.migrate_to_uri3(Some(&to.daemon_uri()), to.parameters(), to.flags())
                    .map_err(Libvirt::err(&dr.id, "migrate"))
            });
            if let Some(c) = own.take() {
                close(c);
            }
            result
        });
        match tokio::time::timeout(timeout, call).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(LibvirtError::Thread { id: d.id.clone() }),
            Err(_) => {
                // Aborted, the blocked call returns and the domain runs on here.
                if let Err(e) = self.abort(d).await {
                    tracing::warn!("aborting a migration that took too long: {e}");
                }
                Err(LibvirtError::MigrationTimedOut {
                    id: d.id.clone(),
                    timeout,
                })
            }
        }
    }

    async fn progress(&self, d: &DomainRef) -> Result<Option<Progress>, LibvirtError> {
        self.blocking(d, "migration progress", CALL_TIMEOUT, |this, slot, d| {
            let Some(dom) = this.lookup(slot, d)?.1 else {
                return Ok(None);
            };
            job_progress(&dom, 0).map_err(Libvirt::err(&d.id, "job stats"))
        })
        .await
    }

    async fn finished(&self, d: &DomainRef) -> Result<Option<Progress>, LibvirtError> {
        self.blocking(d, "finished job", CALL_TIMEOUT, |this, slot, d| {
            let Some(dom) = this.lookup(slot, d)?.1 else {
                return Ok(None);
            };
            job_progress(&dom, sys::VIR_DOMAIN_JOB_STATS_COMPLETED)
                .map_err(Libvirt::err(&d.id, "finished job stats"))
        })
        .await
    }

    async fn abort(&self, d: &DomainRef) -> Result<(), LibvirtError> {
        self.blocking(d, "abort migration", CALL_TIMEOUT, |this, slot, d| {
            let dom = defined(this.lookup(slot, d)?.1, d, "abort migration")?;
            // SAFETY: dom is a live domain handle of an open connection.
            if unsafe { sys::virDomainAbortJob(dom.as_ptr()) } < 0 {
                let e = virt::error::Error::last_error();
                return Err(Libvirt::err(&d.id, "abort migration")(e));
            }
            Ok(())
        })
        .await
    }
}

/// The domain's running job (`flags` 0) or the last one ended
/// (`VIR_DOMAIN_JOB_STATS_COMPLETED`), read through libvirt's own
/// typed-parameter accessors: the virt crate's `get_job_stats` makes a
/// `Vec` of libvirt's pointer, which is null when no job runs.
fn job_progress(dom: &Domain, flags: u32) -> Result<Option<Progress>, virt::error::Error> {
    let mut kind: libc::c_int = 0;
    let mut params: sys::virTypedParameterPtr = std::ptr::null_mut();
    let mut n: libc::c_int = 0;
    // SAFETY: out-pointers to locals; libvirt allocates `params`, freed below.
    let ret =
        unsafe { sys::virDomainGetJobStats(dom.as_ptr(), &mut kind, &mut params, &mut n, flags) };
    if ret < 0 {
        return Err(virt::error::Error::last_error());
    }
    let get = |name: &std::ffi::CStr| -> Option<u64> {
        let mut v: libc::c_ulonglong = 0;
        // SAFETY: `params` and `n` as libvirt returned them (a null list
        // has nothing to find); `name` is NUL-terminated.
        let found = unsafe { sys::virTypedParamsGetULLong(params, n, name.as_ptr(), &mut v) };
        (found == 1).then_some(v)
    };
    let progress = (kind != sys::VIR_DOMAIN_JOB_NONE as libc::c_int).then(|| Progress {
        data_total: get(sys::VIR_DOMAIN_JOB_DATA_TOTAL).unwrap_or(0),
        data_processed: get(sys::VIR_DOMAIN_JOB_DATA_PROCESSED).unwrap_or(0),
        data_remaining: get(sys::VIR_DOMAIN_JOB_DATA_REMAINING).unwrap_or(0),
        iterations: get(sys::VIR_DOMAIN_JOB_MEMORY_ITERATION).unwrap_or(0),
        downtime_ms: get(sys::VIR_DOMAIN_JOB_DOWNTIME),
        elapsed_ms: get(sys::VIR_DOMAIN_JOB_TIME_ELAPSED).unwrap_or(0),
    });
    // SAFETY: what libvirt allocated above, freed once.
    unsafe { sys::virTypedParamsFree(params, n) };
    Ok(progress)
}
