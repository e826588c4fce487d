//! Fair shares of what the node serves its sandboxes at once (the proxy's connections, the
//! DNS's TCP connections and questions in flight): a cap per sandbox address and one for
//! all. Past either, [`Shares::take`] says no at once: the caller refuses (closes, answers
//! SERVFAIL) rather than queue the sandbox ahead of the others.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// The counts, by peer address.
pub struct Shares {
    per_peer: usize,
    total: usize,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    by_peer: HashMap<IpAddr, usize>,
    all: usize,
}

/// One place taken; given back when dropped.
pub struct Share {
    shares: Arc<Shares>,
    peer: IpAddr,
}

impl Shares {
    /// At most `per_peer` places for one address and `total` for all (0: none).
    pub fn new(per_peer: usize, total: usize) -> Arc<Shares> {
        Arc::new(Shares {
            per_peer,
            total,
            held: Mutex::new(Held::default()),
        })
    }

    /// A place for `peer`, or `None` where its share (or everybody's) is full.
    pub fn take(self: &Arc<Self>, peer: IpAddr) -> Option<Share> {
        let mut h = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if h.all >= self.total {
            return None;
        }
        let mine = h.by_peer.entry(peer).or_insert(0);
        if *mine >= self.per_peer {
            return None;
        }
        *mine += 1;
        h.all += 1;
        Some(Share {
            shares: self.clone(),
            peer,
        })
    }

    /// The places `peer` holds.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn held(&self, peer: IpAddr) -> usize {
        let h = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        h.by_peer.get(&peer).copied().unwrap_or(0)
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut h = self
            .shares
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        h.all = h.all.saturating_sub(1);
        if let Some(n) = h.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                h.by_peer.remove(&self.peer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_has_its_share_and_all_have_the_total() {
        let s = Shares::new(2, 3);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap());
        let a1 = s.take(a).unwrap();
        let a2 = s.take(a).unwrap();
        assert!(s.take(a).is_none(), "a's share is full");
        let b1 = s.take(b).unwrap();
        assert!(s.take(b).is_none(), "the total is full");
        drop(a1);
        assert_eq!(s.held(a), 1);
        let b2 = s.take(b).unwrap();
        drop((a2, b1, b2));
        assert_eq!((s.held(a), s.held(b)), (0, 0));
        assert!(s.held.lock().unwrap().by_peer.is_empty());
        assert_eq!(s.held.lock().unwrap().all, 0);
    }
}
