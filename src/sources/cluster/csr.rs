//! Certificate requests for kvirt hosts' identities: asking for one (a
//! joining or renewing kvirtd) and reviewing others' (the leader every
//! one, the others the leader's: `core::csr::reviews`; each as
//! `core::csr::review` says). The request's PKCS#10 is read here; what
//! to make of it is core's.

use crate::core::csr::{review, reviews, Request, Reviews, Verdict, MIN_SECONDS, SIGNER};
use crate::core::migration::HOST_LABEL;
use crate::sources::cluster::leader::Election;
use futures::StreamExt;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition, CertificateSigningRequestSpec,
};
use k8s_openapi::ByteString;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use std::time::Duration;
use tracing::{info, warn};
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_PKCS1_RSAENCRYPTION, OID_SIG_ED25519,
    OID_X509_COMMON_NAME, OID_X509_ORGANIZATION_NAME,
};
use x509_parser::prelude::{FromDer, X509CertificationRequest};

#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("certificate request {name}: {op}: {source}")]
    Api {
        name: String,
        op: &'static str,
        source: Box<kube::Error>,
    },
    #[error("certificate request {name} was denied: {reason}")]
    Denied { name: String, reason: String },
    #[error("certificate request {name} failed: {reason}")]
    Failed { name: String, reason: String },
}

fn api<'a>(name: &'a str, op: &'static str) -> impl FnOnce(kube::Error) -> CsrError + 'a {
    move |e| CsrError::Api {
        name: name.into(),
        op,
        source: Box::new(e),
    }
}

/// What a request asks for and who asked, read from its object and its
/// PKCS#10; `Err` says why it cannot be read (a request kvirt cannot read
/// is never approved by it).
pub fn facts(csr: &CertificateSigningRequest) -> Result<Request, String> {
    let spec = &csr.spec;
    let (_, pem) = x509_parser::pem::parse_x509_pem(&spec.request.0)
        .map_err(|e| format!("not a PEM certificate request: {e}"))?;
    let (_, req) = X509CertificationRequest::from_der(&pem.contents)
        .map_err(|e| format!("not a PKCS#10 request: {e}"))?;
    req.verify_signature()
        .map_err(|e| format!("its signature does not verify: {e}"))?;
    let info = &req.certification_request_info;
    let text = |oid| -> Vec<String> {
        (info.subject.iter_attributes())
            .filter(|a| a.attr_type() == &oid)
            .map(|a| {
                a.as_str()
                    .map(String::from)
                    .unwrap_or_else(|_| "<not text>".into())
            })
            .collect()
    };
    let common_names = text(OID_X509_COMMON_NAME);
    let organizations = text(OID_X509_ORGANIZATION_NAME);
    let other_subject_attributes =
        info.subject.iter_attributes().count() - common_names.len() - organizations.len();
    let extensions = req
        .requested_extensions()
        .map(|exts| {
            exts.map(|e| match e {
                x509_parser::extensions::ParsedExtension::SubjectAlternativeName(_) => {
                    "subjectAltName".to_owned()
                }
                other => format!("{other:?}").chars().take(40).collect(),
            })
            .collect()
        })
        .unwrap_or_default();
    Ok(Request {
        name: csr.metadata.name.clone().unwrap_or_default(),
        signer: spec.signer_name.clone(),
        username: spec.username.clone().unwrap_or_default(),
        groups: spec.groups.clone().unwrap_or_default(),
        usages: spec.usages.clone().unwrap_or_default(),
        expiration_seconds: spec.expiration_seconds.map(i64::from),
        common_names,
        organizations,
        other_subject_attributes,
        extensions,
        strong_key: strong_key(&info.subject_pki),
    })
}

/// ECDSA P-256, Ed25519 or RSA of 2048 bits or more.
fn strong_key(spki: &x509_parser::x509::SubjectPublicKeyInfo) -> bool {
    let alg = &spki.algorithm.algorithm;
    if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok());
        return curve == Some(OID_EC_P256);
    }
    if *alg == OID_PKCS1_RSAENCRYPTION {
        return matches!(spki.parsed(), Ok(x509_parser::public_key::PublicKey::RSA(k)) if k.key_size() >= 2048);
    }
    *alg == OID_SIG_ED25519
}

/// Approved, denied or failed already: nothing for a reviewer to do.
fn decided(csr: &CertificateSigningRequest) -> Option<(&str, String)> {
    let conditions = csr.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| matches!(c.type_.as_str(), "Approved" | "Denied" | "Failed"))
        .map(|c| (c.type_.as_str(), c.message.clone().unwrap_or_default()))
}

/// Reviews pending requests of [`SIGNER`] as they come, those this host
/// is to review while the election stands as it does (`reviews`); its
/// watch is made again when that changes. A decision is written with the
/// object's resourceVersion, so two kvirtds deciding at once conflict
/// instead of both writing. A decision that failed to be written (the API
/// server away, a policy changed) is tried again at the next look over
/// every pending request, every [`RECHECK`], from the watch's own copy:
/// nothing is listed again but what the watch itself needs.
pub fn run(client: kube::Client, max_seconds: u32, own_node: String, mut election: Election) {
    let csrs: Api<CertificateSigningRequest> = Api::all(client);
    let own_user = crate::core::csr::node_user(&own_node);
    tokio::spawn(async move {
        let mut scope = scope_of(&mut election, &own_node);
        loop {
            let what = match &scope {
                Reviews::All => "every request (this host leads)".to_owned(),
                Reviews::OfHost(h) => format!("those of the leader, {h}"),
                Reviews::Nothing => "none (no host leads)".to_owned(),
            };
            info!("certificate requests reviewed here: {what}");
            let review = review_while(&csrs, scope.clone(), max_seconds, &own_user);
            tokio::pin!(review);
            scope = loop {
                tokio::select! {
                    () = &mut review => return,
                    r = election.leading.changed() => if r.is_err() { return },
                    r = election.holder.changed() => if r.is_err() { return },
                }
                let now = scope_of(&mut election, &own_node);
                if now != scope {
                    break now;
                }
            };
        }
    });
}

fn scope_of(election: &mut Election, own_node: &str) -> Reviews {
    reviews(
        *election.leading.borrow_and_update(),
        election.holder.borrow_and_update().as_deref(),
        own_node,
    )
}

/// Reviews the requests of `scope` until the watch ends (never, but for
/// the caller dropping this).
async fn review_while(
    csrs: &Api<CertificateSigningRequest>,
    scope: Reviews,
    max_seconds: u32,
    own_user: &str,
) {
    let signer = watcher::Config::default().fields(&format!("spec.signerName={SIGNER}"));
    let config = match scope {
        Reviews::All => signer,
        Reviews::OfHost(node) => signer.labels(&format!("{HOST_LABEL}={node}")),
        Reviews::Nothing => return std::future::pending().await,
    };
    let (seen, writer) = reflector::store();
    let mut stream = reflector::reflector(writer, watcher(csrs.clone(), config))
        .default_backoff()
        .applied_objects()
        .boxed();
    let mut recheck = tokio::time::interval(RECHECK);
    recheck.tick().await;
    loop {
        let batch = tokio::select! {
            event = stream.next() => match event {
                Some(Ok(csr)) => vec![csr],
                Some(Err(e)) => {
                    warn!("certificate requests: {e}");
                    continue;
                }
                None => return,
            },
            _ = recheck.tick() => (seen.state().iter())
                .filter(|c| decided(c).is_none())
                .map(|c| (**c).clone())
                .collect(),
        };
        for csr in batch {
            // Never its own: another host (or an administrator)
            // approves this host's renewal, so a host alone cannot
            // grant itself anything (the admission policy
            // kvirt-node-csr-approval holds any host to that).
            if csr.spec.username.as_deref() == Some(own_user) {
                continue;
            }
            if let Err(e) = consider(csrs, &csr, max_seconds).await {
                warn!("{e}");
            }
        }
    }
}

/// How often pending requests are looked over again.
const RECHECK: Duration = Duration::from_secs(30);

/// One request reviewed, and the verdict written.
async fn consider(
    csrs: &Api<CertificateSigningRequest>,
    csr: &CertificateSigningRequest,
    max_seconds: u32,
) -> Result<(), CsrError> {
    if decided(csr).is_some() {
        return Ok(());
    }
    let name = csr.metadata.name.clone().unwrap_or_default();
    let verdict = match facts(csr) {
        Ok(r) => review(&r, max_seconds),
        Err(why) if csr.spec.signer_name == SIGNER && names_kvirt(csr) => Verdict::Deny(why),
        Err(_) => Verdict::NotOurs,
    };
    let (type_, reason, message) = match verdict {
        Verdict::NotOurs => return Ok(()),
        Verdict::Approve => (
            "Approved",
            "KvirtNodeIdentity",
            "a kvirt host's own identity, asked for as kvirtd asks".to_owned(),
        ),
        Verdict::Deny(why) => ("Denied", "KvirtNodeIdentityRefused", why),
    };
    let patch = serde_json::json!({
        "metadata": {"resourceVersion": csr.metadata.resource_version},
        "status": {"conditions": [CertificateSigningRequestCondition {
            type_: type_.into(),
            status: "True".into(),
            reason: Some(reason.into()),
            message: Some(message.clone()),
            ..Default::default()
        }]},
    });
    match csrs
        .patch_approval(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            info!(request = %name, "certificate request {}: {message}", type_.to_lowercase());
            Ok(())
        }
        // Another kvirtd decided first.
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(api(&name, "deciding")(e)),
    }
}

/// Whether an unreadable request still claims kvirt's names (by its
/// object's name or its requester): denied, not left pending.
fn names_kvirt(csr: &CertificateSigningRequest) -> bool {
    let user = csr.spec.username.as_deref().unwrap_or_default();
    let groups = csr.spec.groups.as_deref().unwrap_or_default();
    crate::core::csr::node_of_user(user).is_some()
        || groups
            .iter()
            .any(|g| g == crate::core::csr::BOOTSTRAP_GROUP || g == crate::core::csr::NODES_GROUP)
}

/// Asks for a certificate: the request `name` made with `pem` (PKCS#10)
/// unless it exists already (a kvirtd that stopped midway finds its own),
/// then waited for until it is issued, denied or failed. `waiting` is told
/// once that it waits, with the request's name (for an administrator's
/// `kubectl certificate approve`).
pub async fn request(
    client: kube::Client,
    node: &str,
    name: &str,
    pem: &str,
    seconds: u32,
    waiting: impl FnOnce(&str),
) -> Result<String, CsrError> {
    let csrs: Api<CertificateSigningRequest> = Api::all(client);
    if csrs
        .get_opt(name)
        .await
        .map_err(api(name, "reading"))?
        .is_none()
    {
        let csr = CertificateSigningRequest {
            metadata: ObjectMeta {
                name: Some(name.into()),
                // The host's label: while it leads, the other hosts
                // review its requests (`core::csr::reviews`).
                labels: Some(
                    [
                        ("app.kubernetes.io/part-of".into(), "kvirt".into()),
                        (HOST_LABEL.into(), node.into()),
                    ]
                    .into(),
                ),
                ..Default::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(pem.as_bytes().to_vec()),
                signer_name: SIGNER.into(),
                usages: Some(crate::core::csr::USAGES.map(String::from).to_vec()),
                expiration_seconds: Some(seconds.max(MIN_SECONDS) as i32),
                ..Default::default()
            },
            status: None,
        };
        match csrs.create(&PostParams::default(), &csr).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => return Err(api(name, "creating")(e)),
        }
    }
    let mut waiting = Some(waiting);
    let mut pause = Duration::from_millis(250);
    loop {
        let csr = csrs.get(name).await.map_err(api(name, "reading"))?;
        match decided(&csr) {
            Some(("Denied", reason)) => {
                return Err(CsrError::Denied {
                    name: name.into(),
                    reason,
                })
            }
            Some(("Failed", reason)) => {
                return Err(CsrError::Failed {
                    name: name.into(),
                    reason,
                })
            }
            _ => {}
        }
        if let Some(cert) = csr.status.and_then(|s| s.certificate) {
            if !cert.0.is_empty() {
                return String::from_utf8(cert.0).map_err(|_| CsrError::Failed {
                    name: name.into(),
                    reason: "the issued certificate is not PEM text".into(),
                });
            }
        }
        if let Some(w) = waiting.take() {
            w(name);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(pem: &str, user: &str, groups: &[&str]) -> CertificateSigningRequest {
        CertificateSigningRequest {
            metadata: ObjectMeta {
                name: Some("r".into()),
                ..Default::default()
            },
            spec: CertificateSigningRequestSpec {
                request: ByteString(pem.as_bytes().to_vec()),
                signer_name: SIGNER.into(),
                username: Some(user.into()),
                groups: Some(groups.iter().map(|g| g.to_string()).collect()),
                usages: Some(vec!["digital signature".into(), "client auth".into()]),
                expiration_seconds: Some(3600),
                ..Default::default()
            },
            status: None,
        }
    }

    fn pem(cn: &str, orgs: &[&str], sans: &[&str]) -> String {
        let mut p =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        for o in orgs {
            p.distinguished_name
                .push(rcgen::DnType::OrganizationName, *o);
        }
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        p.serialize_request(&key).unwrap().pem().unwrap()
    }

    #[test]
    fn a_request_is_read_from_its_pkcs10_as_the_reviewer_needs_it() {
        let token = [
            "system:bootstrappers:kvirt",
            "system:bootstrappers:kvirt:node:node-b",
        ];
        let r = facts(&csr(
            &pem("kvirt:node:node-b", &["kvirt:nodes"], &[]),
            "system:bootstrap:abcdef",
            &token,
        ))
        .unwrap();
        assert_eq!(r.common_names, ["kvirt:node:node-b"]);
        assert_eq!(r.organizations, ["kvirt:nodes"]);
        assert_eq!(r.other_subject_attributes, 0);
        assert!(r.extensions.is_empty() && r.strong_key);
        assert_eq!(review(&r, 86_400), Verdict::Approve);
        let with_sans = facts(&csr(
            &pem("kvirt:node:node-b", &["kvirt:nodes"], &["node-b"]),
            "system:bootstrap:abcdef",
            &token,
        ))
        .unwrap();
        assert_eq!(with_sans.extensions, ["subjectAltName"]);
        assert!(matches!(review(&with_sans, 86_400), Verdict::Deny(_)));
        // Garbage is not read, and says so.
        assert!(facts(&csr("junk", "u", &[])).unwrap_err().contains("PEM"));
    }
}
