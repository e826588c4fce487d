//! `sbx-guest`: programs that run inside sandboxes, kept apart from the host's code that
//! starts them. The node hands them to a sandbox as text (a start command's arguments): nothing
//! of them is on a sandbox's disk, and the host's front ends only name them.
//!
//! - [`interp`]: E2B's code interpreter (`code-interpreter-v1`): a Python standard-library HTTP
//!   server with a Python kernel, and node's JavaScript kernel.

#![forbid(unsafe_code)]

pub mod interp {
    //! E2B's code interpreter server (`interp/server.py`; its protocol in its docstring) and
    //! the JavaScript kernel it runs under node (`interp/kernel.js`, its first argument). Their
    //! behaviour is tested by sbx-e2b (`interp.rs`: python3 and node run them on the host).

    /// The server (Python 3 standard library), its Python kernel included.
    pub const SERVER_PY: &str = include_str!("interp/server.py");

    /// The JavaScript kernel, run by node; the server takes it as its first argument.
    pub const KERNEL_JS: &str = include_str!("interp/kernel.js");
}
