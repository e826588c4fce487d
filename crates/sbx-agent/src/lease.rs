//! The agent as the watchdog of its node's lease (a node of a fleet,
//! [`sbx_proto::HostMsg::Lease`]).
//!
//! A node of a fleet holds its sandboxes only while its lease with the control plane runs; a
//! node that cannot renew it fences itself (it freezes its sandboxes). A node that is stopped
//! (SIGSTOP) or killed cannot, and the sandboxes' processes would run on without it while
//! another node may be given them: so the node tells each agent until when its lease runs
//! (CLOCK_BOOTTIME, in milliseconds), at every renewal, and the agent, PID 1 of the sandbox,
//! stops every other process of it (`kill(-1, SIGSTOP)`) once that time passes without a newer
//! lease. A lease in the future continues them (`kill(-1, SIGCONT)`).
//!
//! - An agent never told a lease never stops anything (a node without a control plane sends
//!   none); `until_ms: None` turns the watchdog off (what it stopped goes on).
//! - Before a checkpoint (`SetDumpable` true) the watchdog is turned off, without continuing
//!   anything: a sandbox restored later (a wake, on this node or another) is sent its new
//!   node's lease, never judged by the old one.
//! - A deadline the timer sees much later than it was due ([`LATE`]: the agent itself did not
//!   run, its cgroup was frozen, by an idle pause or its node's own fence) waits [`GRACE`]
//!   for a newer lease first: the node that thawed it sends one at once. A node that is gone
//!   sends none, and the processes stop after the grace.
//! - Processes a user stopped on purpose are continued by a renewal too (the agent does not
//!   tell its stops from theirs).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use tokio::sync::Notify;

/// How much later than due a deadline may be seen and still count as seen on time.
pub const LATE: Duration = Duration::from_millis(300);
/// How long a deadline seen late waits for a newer lease.
pub const GRACE: Duration = Duration::from_millis(1500);

/// What stops and continues the sandbox's other processes: `true` stops, `false` continues.
pub type Stopper = Box<dyn Fn(bool)>;
/// The clock of leases (CLOCK_BOOTTIME, milliseconds).
pub type Clock = Box<dyn Fn() -> u64>;

#[derive(Debug, Default)]
struct State {
    until: Option<u64>,
    stopped: bool,
    /// Moved on at every change: a wait that began before one looks again.
    generation: u64,
}

pub struct Watchdog {
    state: RefCell<State>,
    changed: Notify,
    stopper: Stopper,
    clock: Clock,
}

impl Watchdog {
    pub fn new(stopper: Stopper, clock: Clock) -> Rc<Watchdog> {
        Rc::new(Watchdog {
            state: RefCell::new(State::default()),
            changed: Notify::new(),
            stopper,
            clock,
        })
    }

    /// The watchdog of PID 1 of a sandbox: stops and continues every other process of it.
    pub fn of_sandbox() -> Rc<Watchdog> {
        Watchdog::new(
            Box::new(|stop| {
                let sig = if stop { libc::SIGSTOP } else { libc::SIGCONT };
                if let Err(e) = sbx_runtime::process::signal_all_others(sig) {
                    eprintln!("sbx-agent: the lease's signal {sig}: {e}");
                }
            }),
            Box::new(sbx_runtime::process::boottime_ms),
        )
    }

    /// Whether the sandbox's processes are stopped now.
    #[cfg(test)]
    pub fn stopped(&self) -> bool {
        self.state.borrow().stopped
    }

    /// A lease from the node (see the module's notes); whether the processes are stopped
    /// after it.
    pub fn set(&self, until: Option<u64>) -> bool {
        let now = (self.clock)();
        let mut st = self.state.borrow_mut();
        st.until = until;
        st.generation = st.generation.wrapping_add(1);
        match until {
            Some(t) if t <= now => {
                if !st.stopped {
                    (self.stopper)(true);
                    st.stopped = true;
                }
            }
            _ => {
                if st.stopped {
                    (self.stopper)(false);
                    st.stopped = false;
                }
            }
        }
        let stopped = st.stopped;
        drop(st);
        self.changed.notify_one();
        stopped
    }

    /// Turns the watchdog off before a checkpoint; what it stopped stays stopped.
    pub fn disarm(&self) {
        let mut st = self.state.borrow_mut();
        st.until = None;
        st.generation = st.generation.wrapping_add(1);
        drop(st);
        self.changed.notify_one();
    }

    /// Stops the processes once the lease runs out (for as long as the agent lives).
    pub async fn run(self: Rc<Self>) {
        loop {
            let (until, generation, stopped) = {
                let st = self.state.borrow();
                (st.until, st.generation, st.stopped)
            };
            let Some(t) = until.filter(|_| !stopped) else {
                self.changed.notified().await;
                continue;
            };
            let now = (self.clock)();
            if t > now {
                let wait = Duration::from_millis(t - now);
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = self.changed.notified() => continue,
                }
                let late = (self.clock)().saturating_sub(t);
                if late > LATE.as_millis() as u64 {
                    tokio::select! {
                        _ = tokio::time::sleep(GRACE) => {}
                        _ = self.changed.notified() => continue,
                    }
                }
            } else {
                // Found run out already (a lease that came late, or the first look after a
                // freeze): a newer one may be on its way.
                tokio::select! {
                    _ = tokio::time::sleep(GRACE) => {}
                    _ = self.changed.notified() => continue,
                }
            }
            let mut st = self.state.borrow_mut();
            if st.generation == generation && !st.stopped && st.until == Some(t) {
                (self.stopper)(true);
                st.stopped = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use tokio::task::LocalSet;

    /// A watchdog on a clock that follows tokio's (paused in tests), recording its signals.
    fn dog() -> (Rc<Watchdog>, Rc<RefCell<Vec<bool>>>, u64) {
        let calls = Rc::new(RefCell::new(Vec::new()));
        let c = calls.clone();
        let start = tokio::time::Instant::now();
        let base = 1_000_000u64;
        let dog = Watchdog::new(
            Box::new(move |stop| c.borrow_mut().push(stop)),
            Box::new(move || base + start.elapsed().as_millis() as u64),
        );
        (dog, calls, base)
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_runs_out_stops_and_a_new_one_continues() {
        let local = LocalSet::new();
        local
            .run_until(async {
                let (dog, calls, base) = dog();
                tokio::task::spawn_local(dog.clone().run());
                // No lease: nothing ever stops.
                tokio::time::sleep(Duration::from_secs(60)).await;
                assert!(calls.borrow().is_empty());
                assert!(!dog.set(Some(base + 60_000 + 2_000)));
                tokio::time::sleep(Duration::from_millis(1_900)).await;
                assert!(calls.borrow().is_empty(), "not before its time");
                // A renewal pushes it on.
                dog.set(Some(base + 60_000 + 4_000));
                tokio::time::sleep(Duration::from_millis(2_000)).await;
                assert!(calls.borrow().is_empty(), "renewed");
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert_eq!(*calls.borrow(), vec![true], "stopped once it ran out");
                assert!(dog.stopped());
                tokio::time::sleep(Duration::from_secs(5)).await;
                assert_eq!(calls.borrow().len(), 1, "stopped once");
                // A lease in the future continues them; one in the past stops them at once.
                let now = base + start_ms(&dog);
                assert!(!dog.set(Some(now + 3_000)));
                assert_eq!(*calls.borrow(), vec![true, false]);
                assert!(dog.set(Some(now - 1)));
                assert_eq!(*calls.borrow(), vec![true, false, true]);
                // No lease: the watchdog is off, and what it stopped goes on.
                assert!(!dog.set(None));
                assert_eq!(*calls.borrow(), vec![true, false, true, false]);
                tokio::time::sleep(Duration::from_secs(30)).await;
                assert_eq!(calls.borrow().len(), 4);
            })
            .await;
    }

    fn start_ms(dog: &Watchdog) -> u64 {
        (dog.clock)() - 1_000_000
    }

    #[tokio::test(start_paused = true)]
    async fn disarmed_before_a_checkpoint_it_stops_nothing() {
        let local = LocalSet::new();
        local
            .run_until(async {
                let (dog, calls, base) = dog();
                tokio::task::spawn_local(dog.clone().run());
                dog.set(Some(base + 1_000));
                dog.disarm();
                tokio::time::sleep(Duration::from_secs(10)).await;
                assert!(calls.borrow().is_empty());
            })
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_seen_late_waits_for_a_newer_lease() {
        let local = LocalSet::new();
        local
            .run_until(async {
                let calls = Rc::new(RefCell::new(Vec::new()));
                let c = calls.clone();
                let start = tokio::time::Instant::now();
                // The clock jumps 10 s when the agent "was frozen".
                let jump = Rc::new(Cell::new(0u64));
                let j = jump.clone();
                let dog = Watchdog::new(
                    Box::new(move |stop| c.borrow_mut().push(stop)),
                    Box::new(move || start.elapsed().as_millis() as u64 + j.get()),
                );
                dog.set(Some(2_000));
                // Frozen: by the time the timer fires, the clock is far past the deadline.
                jump.set(10_000);
                tokio::task::spawn_local(dog.clone().run());
                tokio::time::sleep(Duration::from_millis(500)).await;
                assert!(calls.borrow().is_empty(), "waits for the node's new lease");
                // The node's lease comes in the grace: nothing was stopped.
                dog.set(Some(20_000));
                tokio::time::sleep(Duration::from_secs(3)).await;
                assert!(calls.borrow().is_empty());
                // No new lease after a late deadline: stopped after the grace.
                jump.set(30_000);
                dog.set(Some(start.elapsed().as_millis() as u64 + 30_000 + 100));
                jump.set(40_000);
                tokio::time::sleep(Duration::from_millis(200)).await;
                assert!(calls.borrow().is_empty());
                tokio::time::sleep(GRACE).await;
                assert_eq!(*calls.borrow(), vec![true]);
            })
            .await;
    }
}
