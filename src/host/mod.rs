//! One adapter per external system, each behind its own narrow trait (a
//! thin real implementation; `daemon::fake` records calls for tests):
//! systemd units and machined, network namespaces, links, nftables and
//! DHCP, address leases, libvirt, VM files, container images, the journal.
//! Everything here touches the host; what it decides comes from `core`.

pub mod beneath;
pub mod bridging;
pub mod bus;
pub mod capacity;
pub mod cni;
pub mod commit;
pub mod consolelog;
pub mod cpus;
pub mod dhcp;
pub mod fence;
pub mod grants;
pub mod growth;
pub mod hugepages;
pub mod identity;
pub mod image;
pub mod ipam;
pub mod journal;
pub mod libvirt;
pub mod linkreap;
pub mod logwatch;
pub mod machined;
pub mod marks;
pub mod migrate;
pub mod netns;
pub mod network;
pub mod nft;
pub mod pidfd;
pub mod qemulog;
pub mod registry;
pub mod removals;
pub mod storage;
pub mod systemd;
pub mod tunnel;
