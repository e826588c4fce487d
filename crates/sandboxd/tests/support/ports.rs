//! Which process holds a TCP port: a server a test starts on a port chosen free may find it
//! taken by another process meanwhile (another test's server, an outgoing connection's
//! ephemeral port), which then answers in its place. Shared by the `it` and `fleet` harnesses.

use std::fs;

/// Whether process `pid` holds a listening TCP socket on `port` (in this network namespace).
pub fn listens_on(pid: u32, port: u16) -> bool {
    let inodes = listening_inodes(port);
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        fs::read_link(fd.path()).is_ok_and(|l| {
            l.to_str()
                .and_then(|s| s.strip_prefix("socket:["))
                .and_then(|s| s.strip_suffix(']'))
                .is_some_and(|i| inodes.iter().any(|x| x == i))
        })
    })
}

/// The inodes of the listening sockets on `port` (/proc/net/tcp and tcp6: the local address
/// `ADDR:PORT` in hex, state `0A` is LISTEN, the inode in the tenth column).
fn listening_inodes(port: u16) -> Vec<String> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in fs::read_to_string(table)
            .unwrap_or_default()
            .lines()
            .skip(1)
        {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let local_port = cols
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if cols.len() > 9 && cols[3] == "0A" && local_port == Some(port) {
                out.push(cols[9].to_string());
            }
        }
    }
    out
}

/// The port of an `http://HOST:PORT/...` URL or a `HOST:PORT` address.
pub fn port_of(url: &str) -> Option<u16> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host_port = rest.split('/').next()?;
    host_port.rsplit_once(':')?.1.parse().ok()
}

#[test]
fn a_listener_is_found_under_its_process() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    assert!(listens_on(std::process::id(), port));
    assert!(!listens_on(1, port));
    drop(l);
    assert!(!listens_on(std::process::id(), port));
    assert_eq!(
        port_of(&format!("http://127.0.0.1:{port}/healthz")),
        Some(port)
    );
    assert_eq!(port_of("127.0.0.1:7700"), Some(7700));
}
