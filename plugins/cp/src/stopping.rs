//! The harness's stopping rule across rank processes. Each rank times its own passes, but the
//! ranks must agree on how many repetitions run (every repetition is collective): after each,
//! every rank sends its seconds to rank 0 over the ranks' TCP mesh, rank 0 feeds one figure of
//! them (the slowest rank's, or its own) to the SDK's [`HarnessRun`], and sends every rank the
//! verdict: whether that repetition was a timed one, and whether another follows. So GPU ranks
//! warm up, stop when the median is stable, and respect the time cap exactly as one process
//! under the same [`Harness`] does.

use attnbench_sdk::measure::{Harness, HarnessRun};

use crate::comm::{Communicator, Group};

/// Tags of the ranks' seconds and of rank 0's verdict (apart from the methods' and the barrier's).
const SECONDS: u32 = 0xfff0;
const VERDICT: u32 = 0xfff1;

/// Which of the ranks' seconds a repetition counts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counted {
    /// The slowest rank's: the collective ends when the last rank does.
    Slowest,
    /// Rank 0's (a decode step ends when the root holds the merged result).
    Root,
}

/// What rank 0 decided after a repetition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// The repetition was a timed one (not a warm-up).
    pub timed: bool,
    /// No repetition follows.
    pub done: bool,
}

/// One rank's side of a shared timing run over `group` (every rank of the run, rank 0 first).
pub(crate) struct SharedRun<'a> {
    group: &'a Group,
    counted: Counted,
    /// Rank 0's run of the rule; `None` on the other ranks.
    run: Option<HarnessRun<'a>>,
    stopped: Option<String>,
}

impl<'a> SharedRun<'a> {
    pub(crate) fn new(group: &'a Group, harness: &'a Harness, counted: Counted) -> SharedRun<'a> {
        SharedRun {
            group,
            counted,
            run: (group.rank() == 0).then(|| HarnessRun::new(harness)),
            stopped: None,
        }
    }

    /// After a repetition that took this rank `seconds`: rank 0's verdict, the same on every rank.
    pub(crate) fn after(&mut self, seconds: f64) -> Verdict {
        let Some(run) = self.run.as_mut() else {
            self.group.send(0, SECONDS, vec![seconds]);
            let verdict = self.group.take(0, VERDICT);
            return Verdict {
                timed: verdict.first() == Some(&1.0),
                done: verdict.get(1) == Some(&1.0),
            };
        };
        let mut counted = seconds;
        for member in 1..self.group.size() {
            let theirs = self.group.take(member, SECONDS).first().copied();
            if self.counted == Counted::Slowest {
                counted = counted.max(theirs.unwrap_or(f64::INFINITY));
            }
        }
        let timed = !run.warming_up();
        let timing = run.record(counted);
        let done = timing.is_some();
        if let Some(timing) = timing {
            self.stopped = Some(timing.stopped);
        }
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        for member in 1..self.group.size() {
            self.group
                .send(member, VERDICT, vec![flag(timed), flag(done)]);
        }
        Verdict { timed, done }
    }

    /// Why the run stopped (`stable`, `time cap`, `max reps`), on rank 0 once it has.
    pub(crate) fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;

    /// `ranks` threads sharing one run, rank `r`'s repetition `i` taking `seconds(r, i)`: each
    /// rank's verdicts, and why rank 0's run stopped.
    fn shared_run(
        ranks: usize,
        harness: &Harness,
        counted: Counted,
        seconds: impl Fn(usize, usize) -> f64 + Sync,
    ) -> Vec<(Vec<Verdict>, Option<String>)> {
        let world = World::new(ranks);
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..ranks)
                .map(|rank| {
                    let (world, seconds) = (world.clone(), &seconds);
                    scope.spawn(move || {
                        let group = Group::new(world, (0..ranks).collect(), rank, 0);
                        let mut shared = SharedRun::new(&group, harness, counted);
                        let mut seen = Vec::new();
                        for rep in 0.. {
                            let verdict = shared.after(seconds(rank, rep));
                            seen.push(verdict);
                            if verdict.done {
                                break;
                            }
                        }
                        (seen, shared.stopped().map(str::to_string))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Each repetition's seconds differing per rank: every rank gets the same verdicts, the
    /// warm-up is not timed, and the run stops by the harness's rule.
    #[test]
    fn every_rank_follows_rank_zeros_verdicts() {
        let harness = Harness {
            warmup_reps: 2,
            warmup_s: 0.0,
            min_reps: 3,
            max_reps: 6,
            max_time_s: 60.0,
            target_rel_ci: 0.0,
            ..Harness::default()
        };
        let runs = shared_run(3, &harness, Counted::Slowest, |rank, rep| {
            1.0 + rank as f64 + rep as f64
        });
        let timed: Vec<bool> = runs[0].0.iter().map(|v| v.timed).collect();
        assert_eq!(timed, [false, false, true, true, true, true, true, true]);
        assert!(runs.iter().all(|(seen, _)| *seen == runs[0].0));
        assert_eq!(runs[0].1.as_deref(), Some("max reps"));
        assert_eq!(runs[1].1, None);
    }

    /// A stable run stops at the fewest repetitions, on the root's seconds alone (the other
    /// rank's vary wildly); on the slowest rank's, the same run goes on to the most.
    #[test]
    fn the_counted_seconds_decide() {
        let harness = Harness {
            warmup_reps: 1,
            warmup_s: 0.0,
            min_reps: 4,
            max_reps: 12,
            max_time_s: 60.0,
            target_rel_ci: 0.05,
            ..Harness::default()
        };
        let seconds = |rank: usize, rep: usize| if rank == 0 { 1.0 } else { (rep * rep) as f64 };
        let root = shared_run(2, &harness, Counted::Root, seconds);
        assert_eq!((root[0].0.len(), root[1].0.len()), (5, 5));
        assert_eq!(root[0].1.as_deref(), Some("stable"));
        let slowest = shared_run(2, &harness, Counted::Slowest, seconds);
        assert_eq!(slowest[1].0.len(), 13);
        assert_eq!(slowest[0].1.as_deref(), Some("max reps"));
    }
}
