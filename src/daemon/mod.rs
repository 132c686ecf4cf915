//! What composes the rest: the controller (the level-triggered loop over
//! `host` adapters and a `sources` status store), its configuration and
//! metrics, a recording fake of every adapter for the loop's tests, and
//! the man pages of the binaries.

pub mod api;
pub mod config;
pub mod control;
pub mod controller;
pub mod drain;
pub mod evacuate;
pub mod fake;
pub mod fence;
pub mod join;
pub mod man;
pub mod metrics;
pub mod migration;
pub mod serve;
pub mod vmim;
pub mod vms;
