//! `sbx-bench-net`: the cost of sandbox networking (sbx_runtime::net), in a node network
//! namespace of its own (the machine's namespace, tables and routes are not touched):
//!
//! - take: a ready namespace leased from the pool (its nft element added): the request path;
//! - release: its element removed, its conntrack entries flushed, its last descriptor closed;
//! - prepare: a namespace made with its veth, addresses and routes: off the path.
//!
//! Each cycle takes one, releases it and prepares one (the pool stays at `--pool`); every
//! `--traffic-every` cycles the sandbox opens a TCP connection to the gateway first, so that
//! releases have conntrack entries to flush. After the cycles, the audit: what is left once the
//! kernel has removed the released namespaces (interfaces, nft elements, conntrack entries).
//! Prints a table; exits non-zero when anything is left.

#![forbid(unsafe_code)]

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use sbx_runtime::net::{self, NetConfig, Network, Proto};
use sbx_runtime::netns::in_netns_of_handle;

#[derive(Parser, Debug)]
struct Args {
    /// Take/release/prepare cycles.
    #[arg(long, default_value_t = 1000)]
    cycles: usize,
    /// Namespaces kept ready.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// A connection to the gateway every this many cycles (0: none).
    #[arg(long, default_value_t = 10)]
    traffic_every: usize,
    /// How long the audit waits for the kernel to remove released namespaces.
    #[arg(long, default_value_t = 120)]
    settle_secs: u64,
}

const PORT: u16 = 8053;

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v.get(i).map(|d| d.as_secs_f64() * 1e6).unwrap_or(f64::NAN)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let node = net::new_netns().context("a node namespace")?;
    let cfg = NetConfig {
        table: "sbxbench".into(),
        prefix: "sbxb".into(),
        range: "10.213.0.0/16".parse().context("range")?,
        gateway_ports: vec![(Proto::Tcp, PORT), (Proto::Udp, 53)],
        allow: Vec::new(),
        refuse: Vec::new(),
        proxy_port: None,
        pool: 0,
        ct_limit: sbx_runtime::net::DEFAULT_CT_LIMIT,
    };
    let network = in_netns_of_handle(node.try_clone()?, move || {
        Network::new(cfg).map_err(std::io::Error::other)
    })
    .context("the network")?;
    let gw = network.gateway();

    let mut prepare = Vec::new();
    let mut take = Vec::new();
    let mut release = Vec::new();
    for _ in 0..args.pool {
        let t = Instant::now();
        network.prepare()?;
        prepare.push(t.elapsed());
    }
    // The gateway is an address of the node once a veth exists.
    let listener = in_netns_of_handle(node.try_clone()?, move || {
        TcpListener::bind(SocketAddr::from((gw, PORT)))
    })
    .context("a listener on the gateway")?;
    listener.set_nonblocking(true)?;
    let start = Instant::now();
    for i in 0..args.cycles {
        let t = Instant::now();
        let lease = network.take()?;
        take.push(t.elapsed());
        if args.traffic_every > 0 && i % args.traffic_every == 0 {
            in_netns_of_handle(lease.ns_handle()?, move || {
                TcpStream::connect_timeout(&SocketAddr::from((gw, PORT)), Duration::from_secs(2))
                    .map(drop)
            })
            .context("a connection from the sandbox to the gateway")?;
            while let Ok((s, _)) = listener.accept() {
                drop(s);
            }
        }
        let t = Instant::now();
        network.release(lease)?;
        release.push(t.elapsed());
        let t = Instant::now();
        network.prepare()?;
        prepare.push(t.elapsed());
    }
    let cycles_wall = start.elapsed();
    // Empty the pool too: everything made is given back.
    while network.ready() > 0 {
        network.release(network.take()?)?;
    }
    let t = Instant::now();
    let audit = network.audit_settled(Duration::from_secs(args.settle_secs))?;
    let settle = t.elapsed();

    println!(
        "sandbox networking, {} cycles, pool {}",
        args.cycles, args.pool
    );
    println!(
        "{:<44} {:>6} {:>10} {:>10} {:>10}",
        "what", "n", "p50 us", "p99 us", "max us"
    );
    for (what, v) in [
        ("take (pool -> leased, nft element): request", &mut take),
        ("release (element, conntrack, close)", &mut release),
        ("prepare (netns + veth + addresses): off path", &mut prepare),
    ] {
        let n = v.len();
        let (p50, p99, max) = (pct(v, 0.50), pct(v, 0.99), pct(v, 1.0));
        println!("{what:<44} {n:>6} {p50:>10.0} {p99:>10.0} {max:>10.0}");
    }
    println!(
        "cycles: {:.2} s ({:.0} cycles/s, one thread)",
        cycles_wall.as_secs_f64(),
        args.cycles as f64 / cycles_wall.as_secs_f64()
    );
    println!(
        "audit after {} cycles (kernel cleanup waited {:.2} s): {} interfaces, {} nft elements, \
         {} conntrack entries, {} namespaces held; leftovers: {} interfaces, {} elements, {} \
         conntrack entries",
        args.cycles,
        settle.as_secs_f64(),
        audit.interfaces.len(),
        audit.elements.len(),
        audit.conntrack.len(),
        audit.ready + audit.leased,
        audit.leftover_interfaces.len(),
        audit.leftover_elements.len(),
        audit.leftover_conntrack.len(),
    );
    if !audit.is_clean()
        || !audit.interfaces.is_empty()
        || !audit.elements.is_empty()
        || !audit.conntrack.is_empty()
    {
        bail!("left behind: {audit:?}");
    }
    Ok(())
}
