//! kvirt: KubeVirt VirtualMachineInstances on bare-metal hosts, without pods.
//!
//! The pure core (`vmi` → `convert`/`unit` → `plan` → `status`) is plain
//! functions; each external system (`systemd`, `netns`, `libvirt`,
//! `storage`, `source`) is one narrow trait with a thin real adapter, and
//! `fake` has recording fakes of all of them for tests. `controller` is the
//! level-triggered loop that ties them together, one key per VM.

pub mod cluster;
pub mod config;
pub mod controller;
pub mod convert;
pub mod dhcp;
pub mod efivars;
pub mod fake;
pub mod hugepages;
pub mod image;
pub mod ipam;
pub mod journal;
pub mod key;
pub mod layout;
pub mod libvirt;
pub mod machined;
pub mod metrics;
pub mod netns;
pub mod network;
pub mod nft;
pub mod objects;
pub mod phase;
pub mod plan;
pub mod pullsecret;
pub mod qemulog;
pub mod quantity;
pub mod source;
pub mod status;
pub mod storage;
pub mod systemd;
pub mod unit;
pub mod vmi;
