//! The scheduler's bookkeeping, apart from running anything: which nodes may start, given what
//! has finished. A node becomes ready when its last input finishes; an exclusive node (a
//! measurement) starts only when nothing else runs, and nothing starts while it runs.

use std::collections::VecDeque;

pub(crate) struct Frontier {
    dependents: Vec<Vec<usize>>,
    /// Inputs of each node that have not finished yet.
    pending: Vec<usize>,
    ready: VecDeque<usize>,
    /// Ready nodes that must wait for an exclusive node, or for the machine to be idle.
    held: VecDeque<usize>,
    in_flight: usize,
    running_exclusive: Option<usize>,
    finished: usize,
}

impl Frontier {
    /// `inputs[i]`: the nodes node `i` reads.
    pub fn new<'a>(inputs: impl ExactSizeIterator<Item = &'a [usize]>) -> Frontier {
        let count = inputs.len();
        let mut dependents = vec![Vec::new(); count];
        let mut pending = vec![0; count];
        for (index, node_inputs) in inputs.enumerate() {
            pending[index] = node_inputs.len();
            for &input in node_inputs {
                dependents[input].push(index);
            }
        }
        let ready = (0..count).filter(|&i| pending[i] == 0).collect();
        Frontier {
            dependents,
            pending,
            ready,
            held: VecDeque::new(),
            in_flight: 0,
            running_exclusive: None,
            finished: 0,
        }
    }

    /// The next ready node, in the order nodes became ready.
    pub fn next_ready(&mut self) -> Option<usize> {
        self.ready.pop_front()
    }

    /// Starts `node` if exclusivity allows it now, else holds it until a node finishes; returns
    /// whether it started.
    pub fn try_start(&mut self, node: usize, exclusive: bool) -> bool {
        if self.running_exclusive.is_some() || (exclusive && self.in_flight > 0) {
            self.held.push_back(node);
            return false;
        }
        if exclusive {
            self.running_exclusive = Some(node);
        }
        self.in_flight += 1;
        true
    }

    /// A started node finished: its dependents may become ready, held nodes get another chance.
    pub fn finished(&mut self, node: usize) {
        self.in_flight -= 1;
        if self.running_exclusive == Some(node) {
            self.running_exclusive = None;
        }
        self.ready.extend(self.held.drain(..));
        self.settle(node);
    }

    /// A ready node ended without starting (skipped): its dependents see it as finished.
    pub fn skipped(&mut self, node: usize) {
        self.settle(node);
    }

    /// With nothing running, held nodes may start: returns whether there were any.
    pub fn release_held(&mut self) -> bool {
        if self.in_flight > 0 || self.held.is_empty() {
            return false;
        }
        self.ready.extend(self.held.drain(..));
        true
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    pub fn all_finished(&self) -> bool {
        self.finished == self.pending.len()
    }

    fn settle(&mut self, node: usize) {
        self.finished += 1;
        for &dependent in &self.dependents[node] {
            self.pending[dependent] -= 1;
            if self.pending[dependent] == 0 {
                self.ready.push_back(dependent);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Frontier;

    fn frontier(inputs: &[&[usize]]) -> Frontier {
        Frontier::new(inputs.iter().copied())
    }

    fn drain(f: &mut Frontier) -> Vec<usize> {
        std::iter::from_fn(|| f.next_ready()).collect()
    }

    #[test]
    fn nodes_become_ready_when_their_last_input_finishes() {
        // 0 → 1 → 3, 0 → 2 → 3
        let mut f = frontier(&[&[], &[0], &[0], &[1, 2]]);
        assert_eq!(drain(&mut f), [0]);
        assert!(f.try_start(0, false));
        f.finished(0);
        assert_eq!(drain(&mut f), [1, 2]);
        assert!(f.try_start(1, false) && f.try_start(2, false));
        f.finished(1);
        assert_eq!(drain(&mut f), Vec::<usize>::new());
        f.finished(2);
        assert_eq!(drain(&mut f), [3]);
        assert!(f.try_start(3, false));
        f.finished(3);
        assert!(f.all_finished());
    }

    #[test]
    fn an_exclusive_node_waits_for_an_idle_machine_and_runs_alone() {
        // 0 and 1 are roots, 2 reads 0; 1 is a measurement.
        let mut f = frontier(&[&[], &[], &[0]]);
        assert_eq!(drain(&mut f), [0, 1]);
        assert!(f.try_start(0, false));
        assert!(
            !f.try_start(1, true),
            "one node runs: the measurement waits"
        );
        f.finished(0);
        assert_eq!(
            drain(&mut f),
            [1, 2],
            "the held node comes back before the new one"
        );
        assert!(f.try_start(1, true));
        assert!(
            !f.try_start(2, false),
            "nothing starts beside a measurement"
        );
        assert_eq!(f.in_flight(), 1);
        f.finished(1);
        assert_eq!(drain(&mut f), [2]);
        assert!(f.try_start(2, false));
        f.finished(2);
        assert!(f.all_finished());
    }

    #[test]
    fn a_skipped_node_releases_its_dependents_without_running() {
        let mut f = frontier(&[&[], &[0], &[1]]);
        assert_eq!(drain(&mut f), [0]);
        f.skipped(0);
        assert_eq!(drain(&mut f), [1]);
        f.skipped(1);
        assert_eq!(drain(&mut f), [2]);
        assert_eq!(f.in_flight(), 0);
        f.skipped(2);
        assert!(f.all_finished());
    }

    #[test]
    fn held_nodes_are_released_only_when_nothing_runs() {
        let mut f = frontier(&[&[], &[]]);
        assert_eq!(drain(&mut f), [0, 1]);
        assert!(f.try_start(0, true));
        assert!(!f.try_start(1, true));
        assert!(!f.release_held(), "a measurement still runs");
        f.finished(0);
        assert_eq!(drain(&mut f), [1]);
        assert!(!f.release_held(), "nothing is held any more");
    }
}
