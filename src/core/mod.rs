//! Everything pure: what a VMI means, what the host should look like for
//! it, and what to do about the difference. Plain functions and data,
//! tested without root; nothing here does I/O (`tests/architecture.rs`
//! keeps it so).
//!
//! `vmi` → `convert` (domain XML, disks, network) and `unit` (the VM's
//! systemd unit) → `plan` (steps from desired and observed state) →
//! `status` (what the VMI reports), with `phase` the transition table.

pub mod acl;
pub mod bootstrap;
pub mod budget;
pub mod cni;
pub mod convert;
pub mod cpuset;
pub mod csr;
pub mod defaults;
pub mod dhcp;
pub mod dhcp6;
pub mod drain;
pub mod efivars;
pub mod election;
pub mod fence;
pub mod guestinfo;
pub mod identity;
pub mod image;
pub mod instancetype;
pub mod ipam;
pub mod key;
pub mod kinds;
pub mod layout;
pub mod liveness;
pub mod migration;
pub mod nft;
pub mod objects;
pub mod peers;
pub mod phase;
pub mod placement;
pub mod plan;
pub mod pool;
pub mod progress;
pub mod pullsecret;
pub mod pvc;
pub mod quantity;
pub mod quota;
pub mod runstrategy;
pub mod scheduling;
pub mod status;
pub mod subresource;
pub mod trigger;
pub mod unit;
pub mod vm;
pub mod vmi;
