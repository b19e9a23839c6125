//! Stopping a run cleanly: signals and the time budget set one flag; the scheduler starts no new
//! node once it is set, running nodes get [`crate::worker::STOP_GRACE`], and the record is written.
//!
//! Stop requests arrive more than once from one sender: GNU `timeout` signals the process and then
//! its whole group, batch schedulers signal every process of a job. So repeated SIGTERMs never
//! escalate — the sender's SIGKILL is the hard stop — and only a person's second Ctrl-C, at least
//! [`REPEAT_WINDOW`] after the first, ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Set by a stop signal or a spent time budget: no new node starts, running in-process nodes see
/// `is_cancelled`, running nodes get their grace, and the run record is still written.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Set with [`INTERRUPTED`] when the stop came from the run's own time budget.
static BUDGET_SPENT: AtomicBool = AtomicBool::new(false);

/// Interrupts closer together than this are one request (a sender that signals the process and
/// its group), not a person pressing Ctrl-C twice.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

pub fn requested() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// Stops the run as a signal would once `deadline` has passed.
pub fn spend_budget(deadline: Option<Instant>) {
    if deadline.is_some_and(|d| Instant::now() >= d) && !INTERRUPTED.load(Ordering::SeqCst) {
        BUDGET_SPENT.store(true, Ordering::SeqCst);
        INTERRUPTED.store(true, Ordering::SeqCst);
    }
}

/// A budget spent by an earlier run of this process does not stop the next one.
pub fn forget_spent_budget() {
    if BUDGET_SPENT.swap(false, Ordering::SeqCst) {
        INTERRUPTED.store(false, Ordering::SeqCst);
    }
}

/// Why nodes that did not start were skipped.
pub fn reason() -> &'static str {
    if BUDGET_SPENT.load(Ordering::SeqCst) {
        "the run's time budget ran out"
    } else {
        "the run was interrupted"
    }
}

/// Turns SIGINT and SIGTERM into stop requests for the rest of the process's life.
pub fn install_handler() -> std::io::Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    std::thread::Builder::new()
        .name("attnbench-signals".into())
        .spawn(move || {
            let mut stopped_at: Option<Instant> = None;
            for signal in signals.forever() {
                INTERRUPTED.store(true, Ordering::SeqCst);
                match stopped_at {
                    None => {
                        stopped_at = Some(Instant::now());
                        eprintln!(
                            "attnbench: stopping — no new node starts, running nodes get {} s, the run record is written (Ctrl-C again to stop at once)",
                            crate::worker::STOP_GRACE.as_secs()
                        );
                    }
                    Some(at) if signal == SIGINT && at.elapsed() >= REPEAT_WINDOW => {
                        eprintln!("attnbench: stopped at once; nodes still running are lost, the run record names what finished");
                        std::process::exit(130);
                    }
                    Some(_) => {}
                }
            }
        })?;
    Ok(())
}
