//! A kvirt host's identity in a cluster, and which certificate requests
//! for one a joined kvirtd approves.
//!
//! A host is the user `kvirt:node:<node>` in the group `kvirt:nodes`, by a
//! client certificate of the signer `kubernetes.io/kube-apiserver-client`
//! (kube-controller-manager signs it once approved). It gets its first one
//! with a bootstrap token made for its node (the token's Secret puts it in
//! the group `system:bootstrappers:kvirt:node:<node>`), later ones with its
//! current identity. No new component approves: the leading kvirtd
//! reviews requests with [`review`], which approves only the exact shape
//! kvirtd itself asks for and denies any other request that claims to be
//! kvirt's; a request that is not kvirt's at all is left to others. No
//! host approves its own, so the others review the leader's ([`reviews`]).
//! (`system:` is reserved for Kubernetes' own identities, hence `kvirt:`.)

use sha2::{Digest, Sha256};

/// The signer whose certificates kube-apiserver accepts as client identities.
pub const SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// Every kvirt host's group: what the RBAC of `kvirtd --print-rbac` binds.
pub const NODES_GROUP: &str = "kvirt:nodes";
/// The prefix of a host's user name (its certificate's common name).
pub const NODE_USER_PREFIX: &str = "kvirt:node:";
/// The group of every bootstrap token made for a kvirt host (it may ask for
/// a certificate: `system:node-bootstrapper`).
pub const BOOTSTRAP_GROUP: &str = "system:bootstrappers:kvirt";
/// ...and the group that names the node a token is for.
const TOKEN_NODE_GROUP_PREFIX: &str = "system:bootstrappers:kvirt:node:";
/// What a bootstrap token's user name starts with.
const TOKEN_USER_PREFIX: &str = "system:bootstrap:";
/// The usages kvirtd asks for: a client certificate, nothing more.
pub const USAGES: [&str; 2] = ["digital signature", "client auth"];
/// The shortest life the API server lets a request ask for.
pub const MIN_SECONDS: u32 = 600;

/// The user name of `node`'s kvirtd.
pub fn node_user(node: &str) -> String {
    format!("{NODE_USER_PREFIX}{node}")
}

/// The node a user name is the kvirtd of, if it is one.
pub fn node_of_user(user: &str) -> Option<&str> {
    user.strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
}

/// The group a bootstrap token for `node` adds. A token's extra groups may
/// hold only `[a-z0-9:-]`: a node name's dots become colons (a node name
/// has none of those, so the mapping goes back unambiguously).
pub fn token_node_group(node: &str) -> String {
    format!("{TOKEN_NODE_GROUP_PREFIX}{}", node.replace('.', ":"))
}

/// The node a bootstrap token's group names.
fn node_of_token_group(group: &str) -> Option<String> {
    group
        .strip_prefix(TOKEN_NODE_GROUP_PREFIX)
        .filter(|n| !n.is_empty())
        .map(|n| n.replace(':', "."))
}

/// The request's object name: the node's, and its key's (a SHA-256 of the
/// public key, in part). A kvirtd that restarts with the same pending key
/// finds the request it made before, instead of making a second one.
pub fn request_name(node: &str, public_key_der: &[u8]) -> String {
    let digest = Sha256::digest(public_key_der);
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("kvirt-node-{node}-{hex}")
}

/// When a certificate valid from `not_before` to `not_after` (seconds) is
/// renewed: at 70–90 % of its life, by `jitter` (0 to 1), so hosts that
/// joined together do not all ask at once (as kubelet's rotation does).
pub fn renew_at(not_before: i64, not_after: i64, jitter: f64) -> i64 {
    let life = (not_after - not_before).max(0) as f64;
    not_before + (life * (0.7 + 0.2 * jitter.clamp(0.0, 1.0))).round() as i64
}

/// What a certificate request asks for, and who asked (set by the API
/// server from the requester's credentials: not forgeable).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub name: String,
    pub signer: String,
    /// The requester.
    pub username: String,
    pub groups: Vec<String>,
    pub usages: Vec<String>,
    pub expiration_seconds: Option<i64>,
    /// The certificate's subject: its common names and organisations, and
    /// how many other attributes it has.
    pub common_names: Vec<String>,
    pub organizations: Vec<String>,
    pub other_subject_attributes: usize,
    /// The extensions it asks for, by name (`subjectAltName`, ...).
    pub extensions: Vec<String>,
    /// Whether its public key is one kvirtd would make (ECDSA P-256, or
    /// RSA of 2048 bits or more, or Ed25519).
    pub strong_key: bool,
}

/// What a joined kvirtd does with a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not kvirt's business: another approver's, or an administrator's.
    NotOurs,
    Approve,
    Deny(String),
}

/// Which pending requests of [`SIGNER`] a kvirtd reviews.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reviews {
    /// Every one (the leader's part).
    All,
    /// Those of this host only, labelled with its node by the kvirtd that
    /// asks (`HOST_LABEL`): the leader's own, which it may not approve.
    OfHost(String),
    /// None: no host is known to lead.
    Nothing,
}

/// What `own_node`'s kvirtd reviews, leading or not, while `holder` holds
/// the election Lease. One host reviews each request (every host
/// reviewing every request cost each new one a delivery to every host and
/// a race to decide it) but the leader's, which the others review.
pub fn reviews(leading: bool, holder: Option<&str>, own_node: &str) -> Reviews {
    match holder {
        _ if leading => Reviews::All,
        Some(h) if h != own_node && !h.is_empty() => Reviews::OfHost(h.to_owned()),
        // Held by this host, which does not (or no longer) lead: it stands
        // down or is about to lead; nobody to review for meanwhile.
        _ => Reviews::Nothing,
    }
}

/// The review of a pending request of [`SIGNER`]. A request is kvirt's if
/// it names a kvirt identity or comes from one (a kvirt bootstrap token or
/// a kvirt host): such a request is approved only if it is exactly what
/// kvirtd asks for, for the node its requester may speak for, living at
/// most `max_seconds`; otherwise it is denied, saying why.
pub fn review(r: &Request, max_seconds: u32) -> Verdict {
    if r.signer != SIGNER || !is_kvirts(r) {
        return Verdict::NotOurs;
    }
    match problem(r, max_seconds) {
        None => Verdict::Approve,
        Some(why) => Verdict::Deny(why),
    }
}

/// Whether a request touches kvirt's identities at all.
fn is_kvirts(r: &Request) -> bool {
    let asks = r
        .common_names
        .iter()
        .any(|c| c.starts_with(NODE_USER_PREFIX))
        || r.organizations.iter().any(|o| o == NODES_GROUP);
    let from = r
        .groups
        .iter()
        .any(|g| g == NODES_GROUP || g == BOOTSTRAP_GROUP)
        || node_of_user(&r.username).is_some();
    asks || from
}

/// Why a kvirt request is not to be approved, if it is not.
fn problem(r: &Request, max_seconds: u32) -> Option<String> {
    let node = match r.common_names.as_slice() {
        [cn] => match node_of_user(cn) {
            Some(node) => node,
            None => {
                return Some(format!(
                    "common name {cn:?} is not {NODE_USER_PREFIX}<node>"
                ))
            }
        },
        cns => return Some(format!("{} common names, not one", cns.len())),
    };
    if r.organizations != [NODES_GROUP] || r.other_subject_attributes != 0 {
        return Some(format!(
            "subject must be CN={NODE_USER_PREFIX}{node}, O={NODES_GROUP} and nothing else"
        ));
    }
    if !r.extensions.is_empty() {
        return Some(format!(
            "asks for extensions ({}): a kvirt host's certificate has none, no alternative names",
            r.extensions.join(", ")
        ));
    }
    let mut usages: Vec<&str> = r.usages.iter().map(String::as_str).collect();
    usages.sort_unstable();
    usages.dedup();
    if usages != ["client auth"] && usages != ["client auth", "digital signature"] {
        return Some(format!(
            "usages {:?}: only client auth (and digital signature)",
            r.usages
        ));
    }
    match r.expiration_seconds {
        Some(s) if s >= i64::from(MIN_SECONDS) && s <= i64::from(max_seconds) => {}
        Some(s) => {
            return Some(format!(
                "asks for {s} s of life, not {MIN_SECONDS}–{max_seconds}"
            ))
        }
        None => {
            return Some(format!(
                "names no expirationSeconds (at most {max_seconds})"
            ))
        }
    }
    if !r.strong_key {
        return Some("its key is not ECDSA P-256, Ed25519 or RSA ≥ 2048".into());
    }
    may_speak_for(r, node)
}

/// Whether the requester may ask for `node`'s identity: a bootstrap token
/// made for that node, or that node's own kvirtd (renewal).
fn may_speak_for(r: &Request, node: &str) -> Option<String> {
    if let Some(own) = node_of_user(&r.username) {
        if own == node && r.groups.iter().any(|g| g == NODES_GROUP) {
            return None;
        }
        return Some(format!("{} may renew only its own identity", r.username));
    }
    if r.username.starts_with(TOKEN_USER_PREFIX) && r.groups.iter().any(|g| g == BOOTSTRAP_GROUP) {
        let named: Vec<String> = r
            .groups
            .iter()
            .filter_map(|g| node_of_token_group(g))
            .collect();
        return match named.as_slice() {
            [n] if n == node => None,
            [n] => Some(format!("the bootstrap token is for node {n}, not {node}")),
            [] => Some(format!(
                "the bootstrap token names no node (auth-extra-groups {TOKEN_NODE_GROUP_PREFIX}<node>)"
            )),
            _ => Some("the bootstrap token names more than one node".into()),
        };
    }
    Some(format!(
        "requested by {}: neither a kvirt bootstrap token for {node} nor {}",
        r.username,
        node_user(node)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_reviews_every_request_and_the_others_the_leaders_own() {
        assert_eq!(reviews(true, Some("a"), "a"), Reviews::All);
        assert_eq!(reviews(false, Some("a"), "b"), Reviews::OfHost("a".into()));
        assert_eq!(reviews(false, None, "b"), Reviews::Nothing, "no leader yet");
        assert_eq!(reviews(false, Some(""), "b"), Reviews::Nothing);
        assert_eq!(
            reviews(false, Some("b"), "b"),
            Reviews::Nothing,
            "never for its own requests"
        );
    }

    fn joining(node: &str) -> Request {
        Request {
            name: "kvirt-node-x".into(),
            signer: SIGNER.into(),
            username: "system:bootstrap:abcdef".into(),
            groups: vec![
                "system:bootstrappers".into(),
                BOOTSTRAP_GROUP.into(),
                token_node_group(node),
                "system:authenticated".into(),
            ],
            usages: USAGES.map(String::from).to_vec(),
            expiration_seconds: Some(86_400),
            common_names: vec![node_user(node)],
            organizations: vec![NODES_GROUP.into()],
            other_subject_attributes: 0,
            extensions: vec![],
            strong_key: true,
        }
    }

    fn denied(r: &Request) -> String {
        match review(r, 7 * 86_400) {
            Verdict::Deny(why) => why,
            v => panic!("{v:?} for {r:?}"),
        }
    }

    #[test]
    fn a_host_joining_with_its_own_token_or_renewing_itself_is_approved() {
        assert_eq!(review(&joining("node-b"), 86_400), Verdict::Approve);
        // A node name with dots rides the token's group as colons.
        assert_eq!(
            review(&joining("b.rack1.example"), 86_400),
            Verdict::Approve
        );
        let renewal = Request {
            username: node_user("node-b"),
            groups: vec![NODES_GROUP.into(), "system:authenticated".into()],
            ..joining("node-b")
        };
        assert_eq!(review(&renewal, 86_400), Verdict::Approve);
    }

    #[test]
    fn anything_but_the_exact_request_is_denied_with_why() {
        let other_node = Request {
            common_names: vec![node_user("node-a")],
            ..joining("node-b")
        };
        assert!(denied(&other_node).contains("token is for node node-b, not node-a"));
        let sans = Request {
            extensions: vec!["subjectAltName".into()],
            ..joining("node-b")
        };
        assert!(denied(&sans).contains("subjectAltName"));
        let masters = Request {
            organizations: vec![NODES_GROUP.into(), "system:masters".into()],
            ..joining("node-b")
        };
        assert!(denied(&masters).contains("nothing else"));
        let server = Request {
            usages: vec!["server auth".into(), "client auth".into()],
            ..joining("node-b")
        };
        assert!(denied(&server).contains("usages"));
        let long = Request {
            expiration_seconds: Some(365 * 86_400),
            ..joining("node-b")
        };
        assert!(denied(&long).contains("s of life"));
        let forever = Request {
            expiration_seconds: None,
            ..joining("node-b")
        };
        assert!(denied(&forever).contains("expirationSeconds"));
        let weak = Request {
            strong_key: false,
            ..joining("node-b")
        };
        assert!(denied(&weak).contains("key"));
        let cn = Request {
            common_names: vec!["admin".into()],
            ..joining("node-b")
        };
        assert!(denied(&cn).contains("is not kvirt:node:"));
        // A host renews only itself; a kvirt token of no node joins none.
        let theft = Request {
            username: node_user("node-a"),
            groups: vec![NODES_GROUP.into()],
            ..joining("node-b")
        };
        assert!(denied(&theft).contains("only its own"));
        let anonymous_token = Request {
            groups: vec![BOOTSTRAP_GROUP.into()],
            ..joining("node-b")
        };
        assert!(denied(&anonymous_token).contains("names no node"));
        // Someone else entirely asking for a kvirt host's name.
        let stranger = Request {
            username: "alice".into(),
            groups: vec!["system:authenticated".into()],
            ..joining("node-b")
        };
        assert!(denied(&stranger).contains("requested by alice"));
    }

    #[test]
    fn requests_that_are_not_kvirts_are_left_to_others() {
        let kubelet = Request {
            signer: "kubernetes.io/kube-apiserver-client-kubelet".into(),
            ..joining("node-b")
        };
        assert_eq!(review(&kubelet, 86_400), Verdict::NotOurs);
        let human = Request {
            username: "alice".into(),
            groups: vec!["system:authenticated".into()],
            common_names: vec!["alice".into()],
            organizations: vec!["devs".into()],
            ..joining("node-b")
        };
        assert_eq!(review(&human, 86_400), Verdict::NotOurs);
    }

    #[test]
    fn renewal_comes_between_seventy_and_ninety_percent_of_the_life() {
        assert_eq!(renew_at(1000, 2000, 0.0), 1700);
        assert_eq!(renew_at(1000, 2000, 1.0), 1900);
        assert_eq!(renew_at(1000, 2000, 0.5), 1800);
        assert_eq!(renew_at(1000, 2000, 7.0), 1900);
        assert_eq!(renew_at(2000, 1000, 0.5), 2000);
    }

    #[test]
    fn names_are_stable_and_go_back_and_forth() {
        assert_eq!(node_of_user(&node_user("n1")), Some("n1"));
        assert_eq!(node_of_user("kvirt:node:"), None);
        assert_eq!(
            node_of_token_group(&token_node_group("b.rack1")).as_deref(),
            Some("b.rack1")
        );
        let a = request_name("node-b", b"key one");
        assert_eq!(a, request_name("node-b", b"key one"));
        assert_ne!(a, request_name("node-b", b"key two"));
        assert!(a.starts_with("kvirt-node-node-b-") && a.len() == "kvirt-node-node-b-".len() + 16);
    }
}
