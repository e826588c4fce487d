//! `sbx-node`: the node's core as a library. The table of sandboxes and their verbs (run,
//! create, exec, files, sleep, snapshots, forks, volumes, templates), the agent client, the
//! store, images, the sandboxes' network (namespaces, rules) and the ready checks' kinds. It
//! speaks no HTTP, DNS or TLS: the services that do (sbx-net) are given to it when it is built.
//! No front end:
//! the HTTP API, E2B, previews and the functions interface are crates of their own or modules
//! of `sandboxd`, which depend on this one and never the other way.

#![forbid(unsafe_code)]

pub(crate) mod agent;
pub mod config;
pub(crate) mod fail;
pub mod image;
pub mod node;
pub mod probe;
pub mod store;
pub mod sync;
