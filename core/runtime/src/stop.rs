//! Stopping a run cleanly: signals and the time budget set the run's [`StopToken`]; the scheduler
//! starts no new node once it is set, running nodes get [`crate::host::worker::STOP_GRACE`], and the
//! record is written.
//!
//! Stop requests arrive more than once from one sender: GNU `timeout` signals the process and then
//! its whole group, batch schedulers signal every process of a job. So repeated SIGTERMs never
//! escalate — the sender's SIGKILL is the hard stop — and only a person's second Ctrl-C, at least
//! [`REPEAT_WINDOW`] after the first, ends the process at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Interrupts closer together than this are one request (a sender that signals the process and
/// its group), not a person pressing Ctrl-C twice.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(1);

/// A run's stop request, shared by everything that must see it: set by a stop signal (through
/// [`install_handler`]) or by the run's own time budget. Once set, no new node starts, running
/// in-process nodes see `is_cancelled`, running nodes get their grace, and the run record is
/// still written. A run is handed its token; nothing reads a process-wide flag.
#[derive(Clone, Default)]
pub struct StopToken(Arc<StopState>);

#[derive(Default)]
struct StopState {
    stopped: AtomicBool,
    /// Set with `stopped` when the stop came from the run's own time budget.
    budget_spent: AtomicBool,
}

impl StopToken {
    pub fn new() -> StopToken {
        StopToken::default()
    }

    /// Asks the run to stop, as a signal does.
    pub fn request(&self) {
        self.0.stopped.store(true, Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.stopped.load(Ordering::Relaxed)
    }

    /// The flag itself, for code that polls it (a worker waiting on its process).
    pub fn flag(&self) -> &AtomicBool {
        &self.0.stopped
    }

    /// Stops the run as a signal would once `deadline` has passed.
    pub fn spend_budget(&self, deadline: Option<Instant>) {
        if deadline.is_some_and(|d| Instant::now() >= d) && !self.0.stopped.load(Ordering::SeqCst) {
            self.0.budget_spent.store(true, Ordering::SeqCst);
            self.0.stopped.store(true, Ordering::SeqCst);
        }
    }

    /// Why nodes that did not start were skipped.
    pub fn reason(&self) -> &'static str {
        if self.0.budget_spent.load(Ordering::SeqCst) {
            "the run's time budget ran out"
        } else {
            "the run was interrupted"
        }
    }
}

/// Turns SIGINT and SIGTERM into stop requests on `token` for the rest of the process's life.
pub fn install_handler(token: StopToken) -> std::io::Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM])?;
    std::thread::Builder::new()
        .name("attnbench-signals".into())
        .spawn(move || {
            let mut stopped_at: Option<Instant> = None;
            for signal in signals.forever() {
                token.request();
                match stopped_at {
                    None => {
                        stopped_at = Some(Instant::now());
                        eprintln!(
                            "attnbench: stopping — no new node starts, running nodes get {} s, the run record is written (Ctrl-C again to stop at once)",
                            crate::host::worker::STOP_GRACE.as_secs()
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
