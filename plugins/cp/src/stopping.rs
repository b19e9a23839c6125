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

    /// Three ranks as threads, each repetition's seconds differing per rank: every rank gets the
    /// same verdicts, the warm-up is not timed, and the run stops by the harness's rule on the
    /// slowest rank's seconds.
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
        let world = World::new(3);
        let verdicts: Vec<(Vec<Verdict>, Option<String>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let (world, harness) = (world.clone(), &harness);
                    scope.spawn(move || {
                        let group = Group::new(world, vec![0, 1, 2], rank, 0);
                        let mut shared = SharedRun::new(&group, harness, Counted::Slowest);
                        let mut seen = Vec::new();
                        for rep in 0.. {
                            let verdict = shared.after(1.0 + rank as f64 + rep as f64);
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
        });
        let timed: Vec<bool> = verdicts[0].0.iter().map(|v| v.timed).collect();
        assert_eq!(timed, [false, false, true, true, true, true, true, true]);
        assert!(verdicts.iter().all(|(seen, _)| *seen == verdicts[0].0));
        assert_eq!(verdicts[0].1.as_deref(), Some("max reps"));
        assert_eq!(verdicts[1].1, None);
    }

    /// A stable run stops at the fewest repetitions, on the root's seconds alone.
    #[test]
    fn a_stable_root_stops_at_min_reps() {
        let harness = Harness {
            warmup_reps: 1,
            warmup_s: 0.0,
            min_reps: 4,
            max_reps: 50,
            target_rel_ci: 0.05,
            ..Harness::default()
        };
        let world = World::new(2);
        let reps: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let (world, harness) = (world.clone(), &harness);
                    scope.spawn(move || {
                        let group = Group::new(world, vec![0, 1], rank, 0);
                        let mut shared = SharedRun::new(&group, harness, Counted::Root);
                        // The other rank's times vary wildly; only the root's count.
                        let mut rep = 0;
                        while !shared.after(if rank == 0 { 1.0 } else { rep as f64 }).done {
                            rep += 1;
                        }
                        rep + 1
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(reps, [5, 5]);
    }
}
