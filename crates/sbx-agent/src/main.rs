//! `sbx-agent`: PID 1 of every sandbox.
//!
//! `sbx-agent init` is started by the node with an `InitConfig` on stdin (or forked, the same,
//! by `sbx-agent zygote`, which the node starts once). It builds the sandbox
//! (sbx-runtime's init stages), whose PID 1 execs `sbx-agent serve` from the binary bound
//! read-only inside the sandbox; that serves the node on the abstract socket PID 1 bound in
//! the sandbox's network namespace:
//! it starts commands, keeps their output in a ring, reaps every zombie, enforces deadlines and
//! reports exits with usage.

#![forbid(unsafe_code)]

mod awake;
mod exec;
mod fs;
mod lease;
mod ring;
mod server;
mod users;
mod watch;

use std::io::Read;

/// Stage 0 of a sandbox: its `InitConfig` on stdin, `pid N` (the agent's host pid) or the
/// error on stdout or stderr (sbx-runtime's `init`).
fn init() -> std::convert::Infallible {
    let mut cfg = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut cfg) {
        eprintln!("sbx-agent: reading config: {e}");
        std::process::exit(1);
    }
    let cfg: sbx_runtime::init::InitConfig = match serde_json::from_slice(&cfg) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sbx-agent: bad config: {e}");
            std::process::exit(1);
        }
    };
    let defaults = exec::Defaults {
        env: cfg.image_env.clone(),
        user: cfg.image_user.clone(),
        workdir: cfg.image_workdir.clone(),
        hostname: cfg.hostname.clone(),
        rlimits: cfg.runtime.rlimits.clone(),
    };
    // Run in process only when the image cannot exec the agent's binary, or the sandbox is a
    // run's own (never checkpointed). Such a sandbox never sleeps either: no /run/sbx/awake in
    // it (a copy-up of /run through the overlay, a socket, a task).
    let awake = !cfg.scratch;
    let Err(e) = sbx_runtime::init::enter(&cfg, |listener| server::run(listener, defaults, awake));
    eprintln!("sbx-agent: {e}");
    std::process::exit(1);
}

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("init") => {
            init();
        }
        // Started once by the node: forks a stage 0 (`init`) for each sandbox
        // (sbx-runtime's `zygote`).
        Some("zygote") => {
            if let Err(e) = sbx_runtime::zygote::serve(init) {
                eprintln!("sbx-agent zygote: {e}");
                std::process::exit(1);
            }
        }
        // PID 1 of the sandbox, exec'd by init from inside it: serves the node on the
        // listener it inherits.
        Some("serve") => {
            let cfg: sbx_runtime::init::AgentArgs =
                match serde_json::from_str(&args.next().unwrap_or_default()) {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("sbx-agent: bad arguments: {e}");
                        std::process::exit(1);
                    }
                };
            let listener = match sbx_runtime::init::agent_listener() {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("sbx-agent: {e}");
                    std::process::exit(1);
                }
            };
            let defaults = exec::Defaults {
                env: cfg.image_env,
                user: cfg.image_user,
                workdir: cfg.image_workdir,
                hostname: cfg.hostname,
                rlimits: cfg.rlimits,
            };
            server::run(listener, defaults, true);
        }
        Some("--version") => println!("sbx-agent {}", env!("CARGO_PKG_VERSION")),
        _ => {
            eprintln!("usage: sbx-agent init   (started by sandboxd, config on stdin)");
            std::process::exit(2);
        }
    }
}
