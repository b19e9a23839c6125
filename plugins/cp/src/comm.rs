//! The communicator the context-parallel methods are written against, and the world its groups
//! live in: ranks are threads of this process (`threads`), or processes joined over TCP (`tcp`,
//! see `tcp.rs`), one rank each. Messages are vectors delivered into per-rank mailboxes, and every
//! element sent is counted, so a method's traffic can be compared with its formula.
//!
//! Sends never block (a posted send is a handed-over buffer, or a frame written to a socket),
//! receives wait for their message: a method that posts its next send before it computes overlaps
//! the two, as on a GPU. The methods never send alone: every send is half of an
//! [`Communicator::exchange`] that names where the matching receive comes from, as NCCL needs
//! (a ring whose ranks each send before receiving waits forever unless the pair is one group).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::local::Partial;

/// How long a receive waits before it gives up on its peer.
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(600);

/// The tag barriers use.
const BARRIER_TAG: u32 = 0xffff;

/// Point-to-point and collective operations among the members of one group, on the values of
/// a [`crate::local::Store`].
pub trait Communicator {
    type Values;

    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// Hands `data` to member `to` while the next message with `tag` from member `from` starts on
    /// its way here, to be taken by [`Communicator::recv`]: one step of a ring, whose receive a
    /// GPU communicator must start together with the send (rings move equal blocks, so the
    /// incoming message is the size of `data`).
    fn exchange(&self, to: usize, from: usize, tag: u32, data: Self::Values);
    /// The message from member `from` with `tag` that an exchange started, waiting for it.
    fn recv(&self, from: usize, tag: u32) -> Self::Values;
    /// Waits until every member has reached the barrier.
    fn barrier(&self);
    /// Member j receives `chunks[j]`; returns what each member sent here, by member.
    fn all_to_all(&self, tag: u32, chunks: Vec<Self::Values>) -> Vec<Self::Values>;
    /// Every member's `data`, by member.
    fn all_gather(&self, tag: u32, data: Self::Values) -> Vec<Self::Values>;
    /// The sum over members of their `chunks[me]`.
    fn reduce_scatter(&self, tag: u32, chunks: Vec<Self::Values>) -> Self::Values;
}

/// A partial result handed from one member to another and nothing coming back: how decoding's
/// tree and ring combine the ranks' partials. The receiver knows what arrives (a partial the
/// shape of its own), as NCCL needs to post the receive.
pub trait PointToPoint: Communicator {
    /// Hands `partial` to member `to` (does not wait for it to arrive).
    fn send_partial(&self, to: usize, tag: u32, partial: Partial<Self::Values>);
    /// The partial member `from` sent with `tag`, the shape of `like`; later work waits for it.
    fn receive_partial(
        &self,
        from: usize,
        tag: u32,
        like: &Partial<Self::Values>,
    ) -> Partial<Self::Values>;
}

/// A message waiting in a mailbox: from whom, and with which tag.
type Key = (usize, u32);

/// One mailbox per rank of the world.
struct Mailbox {
    queues: Mutex<HashMap<Key, VecDeque<Vec<f64>>>>,
    ready: Condvar,
}

/// All ranks: the mailboxes of those in this process, links to those in others, and what each
/// local rank has sent.
pub struct World {
    mailboxes: Vec<Mailbox>,
    sent_elements: Vec<AtomicU64>,
    /// Streams to ranks in other processes; `None` for ranks in this one.
    links: Vec<Option<Mutex<TcpStream>>>,
}

impl World {
    /// `size` ranks, all threads of this process.
    pub fn new(size: usize) -> Arc<World> {
        World::with_links((0..size).map(|_| None).collect())
    }

    pub(crate) fn with_links(links: Vec<Option<Mutex<TcpStream>>>) -> Arc<World> {
        let size = links.len();
        Arc::new(World {
            mailboxes: (0..size)
                .map(|_| Mailbox {
                    queues: Mutex::new(HashMap::new()),
                    ready: Condvar::new(),
                })
                .collect(),
            sent_elements: (0..size).map(|_| AtomicU64::new(0)).collect(),
            links,
        })
    }

    /// Elements world rank `rank` has sent so far, over every group.
    pub fn sent_elements(&self, rank: usize) -> u64 {
        self.sent_elements[rank].load(Ordering::Relaxed)
    }

    /// Puts a message from `from` into the mailbox of local rank `to`.
    pub(crate) fn deliver(&self, from: usize, to: usize, tag: u32, data: Vec<f64>) {
        let mailbox = &self.mailboxes[to];
        let mut queues = mailbox.queues.lock().unwrap_or_else(|e| e.into_inner());
        queues.entry((from, tag)).or_default().push_back(data);
        mailbox.ready.notify_all();
    }

    fn post(&self, from: usize, to: usize, tag: u32, data: Vec<f64>) {
        self.sent_elements[from].fetch_add(data.len() as u64, Ordering::Relaxed);
        match &self.links[to] {
            None => self.deliver(from, to, tag, data),
            Some(link) => {
                let mut frame = Vec::with_capacity(16 + data.len() * 8);
                frame.extend((from as u32).to_le_bytes());
                frame.extend(tag.to_le_bytes());
                frame.extend((data.len() as u64).to_le_bytes());
                for value in &data {
                    frame.extend(value.to_le_bytes());
                }
                let mut stream = link.lock().unwrap_or_else(|e| e.into_inner());
                if let Err(err) = stream.write_all(&frame) {
                    panic!("rank {from} could not send to rank {to}: {err}");
                }
            }
        }
    }

    fn take(&self, me: usize, from: usize, tag: u32) -> Vec<f64> {
        let mailbox = &self.mailboxes[me];
        let mut queues = mailbox.queues.lock().unwrap_or_else(|e| e.into_inner());
        let deadline = std::time::Instant::now() + RECEIVE_TIMEOUT;
        loop {
            if let Some(data) = queues.get_mut(&(from, tag)).and_then(VecDeque::pop_front) {
                return data;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                panic!("rank {me} waited {} s for a message from rank {from} (tag {tag:#x}); is that rank alive?", RECEIVE_TIMEOUT.as_secs());
            }
            queues = mailbox
                .ready
                .wait_timeout(queues, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A group of world ranks (in group order) as seen by one of them. Groups keep their messages
/// apart by tag space, so a rank can be in several (Ulysses and ring) at once.
pub struct Group {
    world: Arc<World>,
    members: Vec<usize>,
    me: usize,
    space: u32,
    /// The lengths of the messages this member's exchanges started, by (member, tag): what a GPU
    /// communicator allocates for them, so receiving anything else is a method's mistake.
    started: Mutex<HashMap<Key, VecDeque<usize>>>,
}

impl Group {
    /// `members` are world ranks; `space` must differ between groups a rank belongs to.
    pub fn new(world: Arc<World>, members: Vec<usize>, world_rank: usize, space: u32) -> Self {
        let me = members
            .iter()
            .position(|&m| m == world_rank)
            .expect("a rank builds only the groups it belongs to");
        Group {
            world,
            members,
            me,
            space,
            started: Mutex::new(HashMap::new()),
        }
    }

    fn tag(&self, tag: u32) -> u32 {
        self.space << 16 | tag
    }
}

/// World rank `w`'s groups under `layout`: everyone, its Ulysses group and its ring (tag spaces
/// 0, 1 and 2).
pub fn rank_groups(world: &Arc<World>, layout: &crate::layout::Layout, w: usize) -> [Group; 3] {
    let (u, r) = layout.coords(w);
    let group = |members: Vec<usize>, space| Group::new(world.clone(), members, w, space);
    [
        group((0..layout.world()).collect(), 0),
        group(
            (0..layout.ulysses)
                .map(|i| layout.world_rank(i, r))
                .collect(),
            1,
        ),
        group(
            (0..layout.ring).map(|i| layout.world_rank(u, i)).collect(),
            2,
        ),
    ]
}

impl Group {
    /// Hands `data` to member `to` (does not wait): a protocol's own message, outside the
    /// methods' exchanges.
    pub fn send(&self, to: usize, tag: u32, data: Vec<f64>) {
        let (from, to) = (self.members[self.me], self.members[to]);
        self.world.post(from, to, self.tag(tag), data);
    }

    /// The next message from member `from` with `tag`, waiting for it; the counterpart of
    /// [`Group::send`].
    pub fn take(&self, from: usize, tag: u32) -> Vec<f64> {
        let (me, from) = (self.members[self.me], self.members[from]);
        self.world.take(me, from, self.tag(tag))
    }
}

/// A partial travels as one message, O then LSE, so the values counted are what a GPU sends.
impl PointToPoint for Group {
    fn send_partial(&self, to: usize, tag: u32, partial: Partial<Vec<f64>>) {
        let mut values = partial.out;
        values.extend(partial.lse);
        self.send(to, tag, values);
    }

    fn receive_partial(
        &self,
        from: usize,
        tag: u32,
        like: &Partial<Vec<f64>>,
    ) -> Partial<Vec<f64>> {
        let mut out = self.take(from, tag);
        let expected = like.out.len() + like.lse.len();
        assert_eq!(
            out.len(),
            expected,
            "member {from} sent a partial of {} values where {expected} were expected",
            out.len()
        );
        let lse = out.split_off(like.out.len());
        Partial { out, lse }
    }
}

/// The collectives as the ring algorithms NCCL also uses, so that the elements counted are what
/// a GPU run sends.
impl Communicator for Group {
    type Values = Vec<f64>;

    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    /// The receive is a later mailbox read, so only the send happens now.
    fn exchange(&self, to: usize, from: usize, tag: u32, data: Vec<f64>) {
        assert!(
            to != self.me && from != self.me,
            "an exchange is between two other members"
        );
        self.started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((from, tag))
            .or_default()
            .push_back(data.len());
        self.send(to, tag, data);
    }

    /// Only what an exchange started, of the length it sent: what a GPU communicator can do.
    fn recv(&self, from: usize, tag: u32) -> Vec<f64> {
        let expected = self
            .started
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&(from, tag))
            .and_then(VecDeque::pop_front)
            .unwrap_or_else(|| {
                panic!("member {} receives from member {from} (tag {tag:#x}) what no exchange of its own started", self.me)
            });
        let message = self.take(from, tag);
        assert_eq!(
            message.len(),
            expected,
            "member {from} sent {} values where this member's exchange sent {expected} (rings move equal blocks)",
            message.len()
        );
        message
    }

    /// An all-gather of nothing.
    fn barrier(&self) {
        self.all_gather(BARRIER_TAG, Vec::new());
    }

    fn all_to_all(&self, tag: u32, mut chunks: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        let (me, n) = (self.rank(), self.size());
        let lengths: Vec<usize> = chunks.iter().map(Vec::len).collect();
        for (to, chunk) in chunks.iter_mut().enumerate() {
            if to != me {
                self.send(to, tag, std::mem::take(chunk));
            }
        }
        let own = std::mem::take(&mut chunks[me]);
        (0..n)
            .map(|from| {
                if from == me {
                    return own.clone();
                }
                let chunk = self.take(from, tag);
                // A GPU communicator receives into a buffer the size of the chunk sent back.
                assert_eq!(
                    chunk.len(),
                    lengths[from],
                    "member {from} sent {} values for the {} this member sent it",
                    chunk.len(),
                    lengths[from]
                );
                chunk
            })
            .collect()
    }

    /// Through a ring: N − 1 steps, each passing one block on.
    fn all_gather(&self, tag: u32, data: Vec<f64>) -> Vec<Vec<f64>> {
        let (me, n) = (self.rank(), self.size());
        let mut blocks = vec![Vec::new(); n];
        blocks[me] = data;
        for step in 0..n - 1 {
            let outgoing = (me + n - step) % n;
            self.send((me + 1) % n, tag, blocks[outgoing].clone());
            let incoming = (me + n - step - 1) % n;
            blocks[incoming] = self.take((me + n - 1) % n, tag);
        }
        blocks
    }

    /// Through a ring: N − 1 steps, each passing one partial sum on.
    fn reduce_scatter(&self, tag: u32, chunks: Vec<Vec<f64>>) -> Vec<f64> {
        let (me, n) = (self.rank(), self.size());
        // Partial sums travel towards their owner: the one started here for member
        // (me + n − 1) mod n goes first, each member adding its own share.
        let mut partial = chunks[(me + n - 1) % n].clone();
        for step in 0..n - 1 {
            self.send((me + 1) % n, tag, partial);
            let received = self.take((me + n - 1) % n, tag);
            let owner = (me + 2 * n - step - 2) % n;
            partial = received
                .iter()
                .zip(&chunks[owner])
                .map(|(a, b)| a + b)
                .collect();
        }
        partial
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_threads<T: Send>(n: usize, work: impl Fn(Group) -> T + Sync) -> (Vec<T>, Arc<World>) {
        let world = World::new(n);
        let results = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let group = Group::new(world.clone(), (0..n).collect(), rank, 0);
                    let work = &work;
                    scope.spawn(move || work(group))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        (results, world)
    }

    /// What a GPU communicator cannot do fails here too: taking a message no exchange of one's
    /// own started, or one of another length than the exchange sent.
    #[test]
    fn receives_must_match_an_exchange() {
        let unstarted = std::panic::catch_unwind(|| {
            on_threads(2, |group| {
                group.send(1 - group.rank(), 5, vec![1.0]);
                group.recv(1 - group.rank(), 5)
            })
        });
        assert!(unstarted.is_err());
        let (results, _) = on_threads(3, |group| {
            let (me, n) = (group.rank(), group.size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            group.exchange(next, prev, 6, vec![me as f64; 2]);
            let equal = group.recv(prev, 6);
            // Member 0 sends a longer block than the others expect.
            group.exchange(next, prev, 7, vec![me as f64; if me == 0 { 3 } else { 2 }]);
            let unequal =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| group.recv(prev, 7)));
            (equal, unequal.is_err())
        });
        for (me, (equal, failed)) in results.iter().enumerate() {
            assert_eq!(equal, &vec![((me + 2) % 3) as f64; 2]);
            // Member 1 gets member 0's longer block; member 0 expects one as long as its own.
            assert_eq!(*failed, me <= 1, "member {me}");
        }
    }

    #[test]
    fn collectives_deliver_and_count_what_the_ring_algorithms_send() {
        for n in [1, 2, 3, 5] {
            let (results, world) = on_threads(n, |group| {
                let me = group.rank() as f64;
                let gathered = group.all_gather(1, vec![me; 4]);
                let chunks = (0..n).map(|j| vec![me * 10.0 + j as f64; 2]).collect();
                let exchanged = group.all_to_all(2, chunks);
                let reduced =
                    group.reduce_scatter(3, (0..n).map(|j| vec![me + j as f64; 3]).collect());
                (gathered, exchanged, reduced)
            });
            for (rank, (gathered, exchanged, reduced)) in results.iter().enumerate() {
                for (j, block) in gathered.iter().enumerate() {
                    assert_eq!(block, &vec![j as f64; 4]);
                }
                for (j, block) in exchanged.iter().enumerate() {
                    assert_eq!(block, &vec![j as f64 * 10.0 + rank as f64; 2]);
                }
                let expected: f64 = (0..n).map(|j| (j + rank) as f64).sum();
                assert_eq!(reduced, &vec![expected; 3], "n={n} rank={rank}");
                // all-gather (n−1)·4, all-to-all (n−1)·2, reduce-scatter (n−1)·3
                assert_eq!(world.sent_elements(rank), (n as u64 - 1) * 9);
            }
        }
    }
}
