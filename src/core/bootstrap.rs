//! Bootstrap tokens for joining a kvirt host (`kvirtd
//! --print-bootstrap-token --node N`): Kubernetes' own kind (a Secret
//! `kube-system/bootstrap-token-<id>` of type `bootstrap.kubernetes.io/token`,
//! as `kubeadm token create` makes), whose extra groups say that it is a
//! kvirt host's and which node it may join as.

use crate::core::csr::{token_node_group, BOOTSTRAP_GROUP};

/// A token `<id>.<secret>`: 6 and 16 characters of `[a-z0-9]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Token {
    pub id: String,
    pub secret: String,
}

impl std::fmt::Debug for Token {
    // The secret is a credential: never in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({}.<secret>)", self.id)
    }
}

const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

impl Token {
    /// A token from random bytes; `None` if they run out first. Bytes at or
    /// above 252 (7 × 36) are skipped, so every character is equally likely.
    pub fn from_random(bytes: &[u8]) -> Option<Token> {
        let mut chars = bytes
            .iter()
            .filter(|b| usize::from(**b) < ALPHABET.len() * 7)
            .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]));
        let id: String = chars.by_ref().take(6).collect();
        let secret: String = chars.take(16).collect();
        (id.len() == 6 && secret.len() == 16).then_some(Token { id, secret })
    }

    /// What a host is given: `<id>.<secret>`.
    pub fn text(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }

    /// A token as typed: `<id>.<secret>`, each of the right length and
    /// alphabet (what kube-apiserver accepts).
    pub fn parse(s: &str) -> Result<Token, String> {
        let ok = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| ALPHABET.contains(&b));
        match s.trim().split_once('.') {
            Some((id, secret)) if ok(id, 6) && ok(secret, 16) => Ok(Token {
                id: id.into(),
                secret: secret.into(),
            }),
            _ => Err("a bootstrap token is <6 of [a-z0-9]>.<16 of [a-z0-9]>".into()),
        }
    }

    /// The Secret that makes the token valid for joining `node` until
    /// `expires` (RFC 3339): authentication only (not signing), in the
    /// group every kvirt token has and the one naming its node.
    pub fn secret_yaml(&self, node: &str, expires: &str) -> String {
        format!(
            "apiVersion: v1
kind: Secret
metadata:
  name: bootstrap-token-{id}
  namespace: kube-system
  labels:
    app.kubernetes.io/part-of: kvirt
    kvirt.io/node: {node}
type: bootstrap.kubernetes.io/token
stringData:
  description: kvirt host {node} joins the cluster
  token-id: {id}
  token-secret: {secret}
  expiration: \"{expires}\"
  usage-bootstrap-authentication: \"true\"
  auth-extra-groups: {BOOTSTRAP_GROUP},{group}
",
            id = self.id,
            secret = self.secret,
            group = token_node_group(node),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_come_from_random_bytes_and_parse_back() {
        let bytes: Vec<u8> = (0..=255).collect();
        let t = Token::from_random(&bytes).unwrap();
        assert_eq!(t.id, "abcdef");
        assert_eq!(t.secret, "ghijklmnopqrstuv");
        assert_eq!(Token::parse(&t.text()).unwrap(), t);
        // Too few usable bytes: none, never a short token.
        assert_eq!(Token::from_random(&[255; 64]), None);
        for bad in [
            "abcdef",
            "abcde.ghijklmnopqrstuv",
            "ABCDEF.ghijklmnopqrstuv",
            "abcdef.ghij",
        ] {
            assert!(Token::parse(bad).is_err(), "{bad}");
        }
        assert!(!format!("{t:?}").contains(&t.secret));
    }

    #[test]
    fn the_secret_names_its_node_in_a_group_the_api_server_accepts() {
        let t = Token::parse("abcdef.0123456789abcdef").unwrap();
        let y = t.secret_yaml("b.rack1", "2026-12-07T00:00:00Z");
        assert!(y.contains("name: bootstrap-token-abcdef\n"));
        assert!(y.contains("type: bootstrap.kubernetes.io/token\n"));
        // auth-extra-groups: system:bootstrappers:[a-z0-9:-]*, so no dots.
        assert!(y.contains(
            "auth-extra-groups: system:bootstrappers:kvirt,system:bootstrappers:kvirt:node:b:rack1\n"
        ));
        assert!(y.contains("expiration: \"2026-12-07T00:00:00Z\""));
    }
}
