//! A TLS configuration made from this host's certificate, key and CA,
//! made again when one of those files changes: a renewed certificate or
//! a new CA takes effect at the next connection, without restarting
//! kvirtd (and so without touching a migration under way, whose
//! connections keep the configuration they began with).

use super::tls::{Identity, TlsError};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::Mutex;
use tracing::{info, warn};

/// What tells one version of a file from another without reading it.
type Stamp = Vec<Option<(i64, i64, u64, u64)>>;

/// The configuration `make` builds from the identity in `files`, kept
/// until a file changes. A set that does not load (a renewal caught
/// halfway: the certificate written, the key not yet) keeps the last good
/// configuration and is tried again at the next use.
pub struct Reloading<T: Clone> {
    files: [PathBuf; 3],
    make: fn(&Identity) -> Result<T, TlsError>,
    current: Mutex<(Stamp, T)>,
}

impl<T: Clone> Reloading<T> {
    /// Loads the identity now: a configuration that does not load at the
    /// start is an error, as before.
    pub fn new(
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
        make: fn(&Identity) -> Result<T, TlsError>,
    ) -> Result<Self, TlsError> {
        let files = [cert, key, ca];
        let stamp = stamp(&files);
        let config = make(&Identity::load(&files[0], &files[1], &files[2])?)?;
        Ok(Self {
            files,
            make,
            current: Mutex::new((stamp, config)),
        })
    }

    /// The configuration for a new connection.
    pub fn get(&self) -> T {
        let now = stamp(&self.files);
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if now != current.0 {
            let [cert, key, ca] = &self.files;
            match Identity::load(cert, key, ca).and_then(|i| (self.make)(&i)) {
                Ok(config) => {
                    info!(cert = %cert.display(), "the TLS identity changed on disk: new connections use it");
                    *current = (now, config);
                }
                // Not stamped: tried again at the next use.
                Err(e) => warn!(
                    "the TLS identity changed on disk but does not load, keeping the last: {e}"
                ),
            }
        }
        current.1.clone()
    }
}

fn stamp(files: &[PathBuf]) -> Stamp {
    files
        .iter()
        .map(|f| {
            let m = std::fs::metadata(f).ok()?;
            Some((m.mtime(), m.mtime_nsec(), m.ino(), m.len()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::pki;
    use std::sync::Arc;

    fn chain(i: &Identity) -> Result<Arc<Vec<u8>>, TlsError> {
        Ok(Arc::new(i.chain[0].to_vec()))
    }

    #[test]
    fn a_renewed_certificate_is_used_from_the_next_connection_and_a_broken_one_never() {
        let dir = tempfile::tempdir().unwrap();
        pki::make(dir.path()).unwrap();
        let files = |n: &str| dir.path().join(n);
        let r = Reloading::new(
            files(pki::CERT),
            files(pki::KEY),
            files(pki::CA_CERT),
            chain,
        )
        .unwrap();
        let first = r.get();
        assert!(
            Arc::ptr_eq(&first, &r.get()),
            "unchanged files: the same configuration"
        );
        pki::make(dir.path()).unwrap();
        let renewed = r.get();
        assert_ne!(first, renewed, "the renewed certificate is used");
        // Half a renewal: a certificate that does not parse keeps the last.
        std::fs::write(files(pki::CERT), "not a certificate").unwrap();
        assert!(Arc::ptr_eq(&renewed, &r.get()));
        pki::make(dir.path()).unwrap();
        assert_ne!(renewed, r.get(), "tried again, and loaded once whole");
    }
}
