//! kvirt: KubeVirt VirtualMachineInstances on bare-metal hosts, without pods.
//!
//! The tree is the architecture, and `tests/architecture.rs` checks that
//! imports only point down:
//!
//! - [`core`]: everything pure. The VMI model, the converter to domain
//!   XML, unit properties, nftables rules as data, `plan(desired,
//!   observed) -> steps` and the status it reports. No I/O.
//! - [`host`]: one adapter per external system (systemd, libvirt, the
//!   kernel's namespaces and links, storage, registries, the journal),
//!   each behind a narrow trait. Uses `core`.
//! - [`sources`]: where VMIs come from and where their status and Events
//!   go: a directory of manifests, or a Kubernetes API server. Uses `core`.
//! - [`daemon`]: the level-triggered loop that composes them, one key per
//!   VM, with its configuration, metrics and a recording fake of every
//!   adapter for its tests.

pub mod core;
pub mod daemon;
pub mod host;
pub mod sources;
