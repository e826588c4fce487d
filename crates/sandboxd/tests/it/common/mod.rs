//! The fixture of sandboxd's integration tests: a real node, on loopback, with its own data
//! directory and its own cgroup folder, making real sandboxes.
//!
//! Every node is started with `--cgroup-name sbx-test-<pid>-<n>`, so tests that run at the same
//! time (and a dev node on the machine) never see each other's sandboxes. [`TestNode::leftovers`]
//! lists what is left of the node's sandboxes on the host; dropping a node stops it and removes
//! everything it may have left, so that a failing test leaves nothing behind.
//!
//! A node of the tests is small: no warm pool, a 512 MiB disk, no network (`--egress-default
//! none`); a test that needs more asks for it with its arguments (`TestNode::start_with`).
//!
//! `node` is the node's lifecycle, `http` the requests and answers, `host` what is left on the
//! host, `data` small helpers; everything is re-exported here (`common::X`).

mod data;
mod host;
mod http;
mod node;
#[path = "../../support/ports.rs"]
pub mod ports;

pub use data::*;
pub use host::HostLock;
pub use http::*;
pub use node::*;
