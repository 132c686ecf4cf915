//! A CA and a serving certificate for kvirtd's API port, for a test or
//! small cluster (`kvirtd --make-api-pki DIR`); production may bring its
//! own. The certificate names the service the aggregator dials
//! (`kvirt-api.kvirt.svc`) and serves as the client certificate kvirtds
//! forward users to each other with.

use super::tls::SERVICE_NAME;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub const CA_CERT: &str = "api-ca.crt";
pub const CA_KEY: &str = "api-ca.key";
pub const CERT: &str = "api.crt";
pub const KEY: &str = "api.key";

const CA_DAYS: i64 = 3650;
const CERT_DAYS: i64 = 365;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Cert {
        what: &'static str,
        source: rcgen::Error,
    },
}

fn cert_err(what: &'static str) -> impl FnOnce(rcgen::Error) -> PkiError {
    move |source| PkiError::Cert { what, source }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.into(),
        source,
    }
}

/// Validity from now for `days`.
fn validity(params: &mut CertificateParams, days: i64) {
    let now = jiff::Timestamp::now();
    let date = |t: jiff::Timestamp| {
        let d = t.to_zoned(jiff::tz::TimeZone::UTC).date();
        rcgen::date_time_ymd(d.year().into(), d.month() as u8, d.day() as u8)
    };
    params.not_before = date(now - jiff::SignedDuration::from_hours(24));
    params.not_after = date(now + jiff::SignedDuration::from_hours(24 * days));
}

/// Writes a file only root may read, whole or not at all.
fn write_private(path: &Path, text: &str, mode: u32) -> Result<(), PkiError> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err(&tmp))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))
}

/// Makes the CA in `dir` unless it is there, then a new certificate and
/// key signed by it. Returns the files written.
pub fn make(dir: &Path) -> Result<Vec<PathBuf>, PkiError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let (ca_cert, ca_key) = (dir.join(CA_CERT), dir.join(CA_KEY));
    let mut written = vec![];
    if !ca_cert.exists() || !ca_key.exists() {
        let key = KeyPair::generate().map_err(cert_err("CA key"))?;
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA"))?;
        p.distinguished_name
            .push(DnType::CommonName, "kvirt-api-ca");
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        validity(&mut p, CA_DAYS);
        let cert = p.self_signed(&key).map_err(cert_err("CA"))?;
        write_private(&ca_key, &key.serialize_pem(), 0o600)?;
        write_private(&ca_cert, &cert.pem(), 0o644)?;
        written.extend([ca_cert.clone(), ca_key.clone()]);
    }
    let ca_pem = std::fs::read_to_string(&ca_cert).map_err(io_err(&ca_cert))?;
    let ca_key_pem = std::fs::read_to_string(&ca_key).map_err(io_err(&ca_key))?;
    let signer = KeyPair::from_pem(&ca_key_pem).map_err(cert_err("CA key"))?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, signer).map_err(cert_err("CA"))?;
    let key = KeyPair::generate().map_err(cert_err("key"))?;
    let mut p =
        CertificateParams::new(vec![SERVICE_NAME.to_owned()]).map_err(cert_err("certificate"))?;
    p.distinguished_name.push(DnType::CommonName, SERVICE_NAME);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.use_authority_key_identifier_extension = true;
    validity(&mut p, CERT_DAYS);
    let cert = p
        .signed_by(&key, &issuer)
        .map_err(cert_err("certificate"))?;
    let (cert_path, key_path) = (dir.join(CERT), dir.join(KEY));
    write_private(&key_path, &key.serialize_pem(), 0o600)?;
    write_private(&cert_path, &cert.pem(), 0o644)?;
    written.extend([cert_path, key_path]);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::api::tls::{common_name, Identity};
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_made_pki_serves_and_keys_stay_private() {
        let t = tempfile::tempdir().unwrap();
        let first = make(t.path()).unwrap();
        assert_eq!(first.len(), 4);
        // A second run keeps the CA and issues a new certificate.
        let ca_before = std::fs::read(t.path().join(CA_CERT)).unwrap();
        assert_eq!(make(t.path()).unwrap().len(), 2);
        assert_eq!(std::fs::read(t.path().join(CA_CERT)).unwrap(), ca_before);
        for k in [CA_KEY, KEY] {
            let mode = std::fs::metadata(t.path().join(k))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{k}");
        }
        let id = Identity::load(
            &t.path().join(CERT),
            &t.path().join(KEY),
            &t.path().join(CA_CERT),
        )
        .unwrap();
        assert_eq!(common_name(&id.chain[0]).as_deref(), Some(SERVICE_NAME));
        id.server_config(id.peers.clone()).unwrap();
        id.client_config().unwrap();
    }
}
