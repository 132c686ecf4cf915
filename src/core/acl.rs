//! POSIX access ACLs as data (the `system.posix_acl_access` xattr), for
//! giving a VM's identity a hostDisk for the VM's life without changing the
//! file's owner, so a disk shared by several VMs is usable by each, and the
//! file is as it was once the last VM goes.

/// `POSIX_ACL_XATTR_VERSION`.
const VERSION: u32 = 2;

const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;
/// The id of entries that name nobody (`ACL_UNDEFINED_ID`).
const NO_ID: u32 = u32::MAX;

pub const READ: u16 = 4;
pub const WRITE: u16 = 2;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a POSIX ACL: {0}")]
pub struct AclError(&'static str);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    tag: u16,
    id: u32,
    perm: u16,
}

/// An access ACL, its entries in the kernel's order (by tag, then id).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acl(Vec<Entry>);

impl Acl {
    /// The ACL a file without one has: its mode bits.
    pub fn from_mode(mode: u32) -> Self {
        let bits = |shift: u32| ((mode >> shift) & 7) as u16;
        Self(vec![
            Entry {
                tag: USER_OBJ,
                id: NO_ID,
                perm: bits(6),
            },
            Entry {
                tag: GROUP_OBJ,
                id: NO_ID,
                perm: bits(3),
            },
            Entry {
                tag: OTHER,
                id: NO_ID,
                perm: bits(0),
            },
        ])
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, AclError> {
        let (head, rest) = bytes.split_at_checked(4).ok_or(AclError("too short"))?;
        if u32::from_le_bytes(head.try_into().expect("4 bytes")) != VERSION {
            return Err(AclError("unknown version"));
        }
        if rest.len() % 8 != 0 {
            return Err(AclError("truncated entry"));
        }
        let entries = rest
            .chunks_exact(8)
            .map(|e| Entry {
                tag: u16::from_le_bytes([e[0], e[1]]),
                perm: u16::from_le_bytes([e[2], e[3]]),
                id: u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
            })
            .collect();
        let acl = Self(entries);
        let has = |t| acl.0.iter().filter(|e| e.tag == t).count() == 1;
        if !(has(USER_OBJ) && has(GROUP_OBJ) && has(OTHER)) {
            return Err(AclError("an owner, group or other entry is missing"));
        }
        Ok(acl)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = VERSION.to_le_bytes().to_vec();
        for e in &self.0 {
            out.extend(e.tag.to_le_bytes());
            out.extend(e.perm.to_le_bytes());
            out.extend(e.id.to_le_bytes());
        }
        out
    }

    /// The ACL a file has while it is lent to VMs: `baseline` (the file's
    /// own ACL before the first loan) with an entry for each borrower.
    /// The mask must let the borrowers in, and a mask grants every named
    /// entry and the owning group as much, so those are first cut to what
    /// the baseline's mask let them have: nobody else gains anything, and
    /// with no loans left the baseline is back exactly.
    pub fn lent(baseline: &Acl, loans: &[(u32, u16)]) -> Acl {
        if loans.is_empty() {
            return baseline.clone();
        }
        let mask = baseline.0.iter().find(|e| e.tag == MASK).map(|e| e.perm);
        let mut a = Acl(baseline
            .0
            .iter()
            .filter(|e| {
                e.tag != MASK && !loans.iter().any(|(uid, _)| e.tag == USER && e.id == *uid)
            })
            .map(|e| match (e.tag, mask) {
                (USER | GROUP | GROUP_OBJ, Some(m)) => Entry {
                    perm: e.perm & m,
                    ..*e
                },
                _ => *e,
            })
            .collect());
        a.0.extend(loans.iter().map(|&(id, perm)| Entry {
            tag: USER,
            id,
            perm,
        }));
        a.settle();
        a
    }

    /// Gives `uid` these permissions (its entry replaced if it had one).
    pub fn grant(&mut self, uid: u32, perm: u16) {
        self.0.retain(|e| !(e.tag == USER && e.id == uid));
        self.0.push(Entry {
            tag: USER,
            id: uid,
            perm,
        });
        self.settle();
    }

    /// Takes `uid`'s entry away.
    pub fn revoke(&mut self, uid: u32) {
        self.0.retain(|e| !(e.tag == USER && e.id == uid));
        self.settle();
    }

    pub fn perm_of(&self, uid: u32) -> Option<u16> {
        self.0
            .iter()
            .find(|e| e.tag == USER && e.id == uid)
            .map(|e| e.perm)
    }

    /// No named entries: the mode bits say it all, and the xattr can go.
    pub fn is_minimal(&self) -> bool {
        !self.0.iter().any(|e| matches!(e.tag, USER | GROUP))
    }

    /// The permission bits of the file's mode this ACL stands for (the
    /// group bits are the mask's when there is one).
    pub fn mode_bits(&self) -> u32 {
        let perm = |t| {
            self.0
                .iter()
                .find(|e| e.tag == t)
                .map_or(0, |e| u32::from(e.perm))
        };
        let group = if self.0.iter().any(|e| e.tag == MASK) {
            perm(MASK)
        } else {
            perm(GROUP_OBJ)
        };
        perm(USER_OBJ) << 6 | group << 3 | perm(OTHER)
    }

    /// The mask is the union of the named entries and the owning group, as
    /// `setfacl` computes it; a minimal ACL has none. Kernel order.
    fn settle(&mut self) {
        self.0.retain(|e| e.tag != MASK);
        if !self.is_minimal() {
            let perm = self
                .0
                .iter()
                .filter(|e| matches!(e.tag, USER | GROUP | GROUP_OBJ))
                .fold(0, |m, e| m | e.perm);
            self.0.push(Entry {
                tag: MASK,
                id: NO_ID,
                perm,
            });
        }
        self.0.sort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_adds_a_user_and_a_mask_and_a_revoke_takes_both_away() {
        let base = Acl::from_mode(0o600);
        assert!(base.is_minimal());
        assert_eq!(base.mode_bits(), 0o600);
        let mut a = base.clone();
        a.grant(100_001, READ | WRITE);
        assert!(!a.is_minimal());
        assert_eq!(a.perm_of(100_001), Some(6));
        // The group bits now show the mask, as `ls -l` does (rw-rw----+).
        assert_eq!(a.mode_bits(), 0o660);
        a.grant(100_002, READ);
        a.grant(100_001, READ | WRITE);
        assert_eq!(Acl::decode(&a.encode()).unwrap(), a);
        a.revoke(100_001);
        assert_eq!(a.perm_of(100_001), None);
        assert_eq!(a.mode_bits(), 0o640);
        a.revoke(100_002);
        assert_eq!(a, base, "back to the mode bits alone");
    }

    #[test]
    fn a_grant_never_widens_the_owning_group() {
        let mut a = Acl::from_mode(0o640);
        a.grant(100_001, READ | WRITE);
        a.revoke(100_001);
        assert_eq!(a.mode_bits(), 0o640);
    }

    /// getfacl: user::rw- user:1000:rw- group::rw- mask::r-- other::---
    fn masked() -> Acl {
        Acl(vec![
            Entry {
                tag: USER_OBJ,
                id: NO_ID,
                perm: 6,
            },
            Entry {
                tag: USER,
                id: 1000,
                perm: 6,
            },
            Entry {
                tag: GROUP_OBJ,
                id: NO_ID,
                perm: 6,
            },
            Entry {
                tag: MASK,
                id: NO_ID,
                perm: 4,
            },
            Entry {
                tag: OTHER,
                id: NO_ID,
                perm: 0,
            },
        ])
    }

    #[test]
    fn a_loan_widens_nobody_elses_rights_and_gives_back_exactly_what_was_there() {
        let base = masked();
        let effective = |a: &Acl, uid: u32| {
            let mask = a.0.iter().find(|e| e.tag == MASK).map_or(7, |e| e.perm);
            a.perm_of(uid).map(|p| p & mask)
        };
        assert_eq!(effective(&base, 1000), Some(READ));
        let lent = Acl::lent(&base, &[(100_001, READ | WRITE)]);
        assert_eq!(effective(&lent, 100_001), Some(READ | WRITE));
        assert_eq!(
            effective(&lent, 1000),
            Some(READ),
            "user 1000 stays read-only"
        );
        let group = lent.0.iter().find(|e| e.tag == GROUP_OBJ).unwrap().perm;
        assert_eq!(group, READ, "and so does the owning group");
        // Two borrowers, then one, then none: the baseline, byte for byte.
        let two = Acl::lent(&base, &[(100_001, READ | WRITE), (100_002, READ)]);
        assert_eq!(effective(&two, 100_002), Some(READ));
        assert_eq!(Acl::lent(&base, &[(100_002, READ)]).perm_of(100_001), None);
        assert_eq!(Acl::lent(&base, &[]).encode(), base.encode());
        // A file with no ACL of its own comes back to its mode bits alone.
        let plain = Acl::from_mode(0o640);
        let l = Acl::lent(&plain, &[(100_001, READ | WRITE)]);
        assert_eq!(l.mode_bits(), 0o660);
        assert!(Acl::lent(&plain, &[]).is_minimal());
    }

    #[test]
    fn the_kernels_encoding() {
        // getfacl: user::rw- user:1000:r-- group::--- mask::r-- other::---
        let bytes = [
            2, 0, 0, 0, //
            1, 0, 6, 0, 255, 255, 255, 255, //
            2, 0, 4, 0, 232, 3, 0, 0, //
            4, 0, 0, 0, 255, 255, 255, 255, //
            16, 0, 4, 0, 255, 255, 255, 255, //
            32, 0, 0, 0, 255, 255, 255, 255,
        ];
        let mut a = Acl::from_mode(0o600);
        a.grant(1000, READ);
        assert_eq!(a.encode(), bytes);
        assert_eq!(Acl::decode(&bytes).unwrap(), a);
        assert!(Acl::decode(&bytes[..10]).is_err());
        assert!(Acl::decode(&[1, 0, 0, 0]).is_err());
        assert!(Acl::decode(&[2, 0, 0, 0]).is_err(), "no owner entry");
    }
}
