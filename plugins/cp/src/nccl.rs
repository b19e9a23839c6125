//! The NCCL communicator: one NCCL communicator per group of ranks (a Ulysses group, a ring, the
//! world), with its own stream. Each operation starts when the rank's compute stream has
//! produced what it sends (an event), and the compute stream waits for what it receives (an
//! event) only where the method takes it: an [`Communicator::exchange`] issues its send and its
//! receive together in one NCCL group as soon as it is called, so a ring's next block travels
//! while the current one is computed, and [`Communicator::recv`] makes the compute stream wait.
//! The groups' NCCL ids travel from each group's first member over the ranks' TCP mesh.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView};
use cudarc::nccl::{Comm, Id, ReduceOp};

use crate::comm::{Communicator, Group, PointToPoint};
use crate::device::{check, DeviceStore, DeviceValues, GpuError, Kind, Spans};
use crate::local::Partial;

/// Tag of the TCP message that carries a group's NCCL id.
const NCCL_ID: u32 = 0xfffe;

/// The NCCL id of the group `host` spans: made by its first member, handed to the others over
/// the TCP mesh `host` runs on.
pub fn group_id(host: &Group) -> Result<Id, GpuError> {
    if host.rank() == 0 {
        let id = Id::new().map_err(GpuError::nccl("unique id"))?;
        let bytes: Vec<f64> = id.internal().iter().map(|&b| b as f64).collect();
        for member in 1..host.size() {
            host.send(member, NCCL_ID, bytes.clone());
        }
        Ok(id)
    } else {
        let bytes = host.take(0, NCCL_ID);
        let mut internal = [0 as std::ffi::c_char; 128];
        if bytes.len() != internal.len() {
            return Err(GpuError::NcclId(bytes.len()));
        }
        for (slot, byte) in internal.iter_mut().zip(bytes) {
            *slot = byte as std::ffi::c_char;
        }
        Ok(Id::uninit(internal))
    }
}

/// A message an exchange started: where it lands, when it has, and what was sent with it (kept
/// alive until then).
struct Incoming {
    values: DeviceValues,
    landed: CudaEvent,
    _sent: DeviceValues,
}

pub struct NcclGroup<'a> {
    comm: Comm,
    stream: Arc<CudaStream>,
    store: &'a DeviceStore,
    pending: Mutex<HashMap<(usize, u32), VecDeque<Incoming>>>,
    sent_bytes: AtomicU64,
    /// Events around every operation on the group's stream since [`NcclGroup::take_busy_seconds`].
    busy: Spans,
}

fn nccl<T>(what: &str, result: Result<T, cudarc::nccl::result::NcclError>) -> T {
    result.unwrap_or_else(|err| panic!("NCCL {what}: {err:?}"))
}

impl<'a> NcclGroup<'a> {
    /// This rank's member of the group `host` spans (the same members, in the same order), its
    /// operations on `stream`.
    pub fn join(
        host: &Group,
        stream: Arc<CudaStream>,
        store: &'a DeviceStore,
    ) -> Result<NcclGroup<'a>, GpuError> {
        let id = group_id(host)?;
        let comm = Comm::from_rank(stream.clone(), host.rank(), host.size(), id).map_err(
            GpuError::nccl(format!("communicator of {} ranks", host.size())),
        )?;
        Ok(NcclGroup {
            comm,
            stream,
            store,
            pending: Mutex::new(HashMap::new()),
            sent_bytes: AtomicU64::new(0),
            busy: Spans::default(),
        })
    }

    /// Seconds the group's stream spent in NCCL operations since the last call, waits for peers
    /// included: the communication a profiler shows, some of it hidden behind compute.
    pub fn take_busy_seconds(&self) -> f64 {
        self.busy.take_seconds()
    }

    /// Bytes this rank has sent in this group so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent_bytes.load(Ordering::Relaxed)
    }

    /// The group's stream waits for what the compute stream has queued so far; returns when
    /// the operation that follows starts (a timing event).
    fn after_compute(&self) -> CudaEvent {
        let ready = check("event", self.store.stream.record_event(None));
        check("stream wait", self.stream.wait(&ready));
        Spans::mark(&self.stream)
    }

    /// An event when the group's stream has done what is queued on it so far, the operation
    /// since `started` counted as busy time.
    fn landed(&self, started: CudaEvent) -> CudaEvent {
        let landed = Spans::mark(&self.stream);
        self.busy.push(started, Spans::mark(&self.stream));
        landed
    }

    fn count(&self, x: &DeviceValues) {
        let bytes = (x.len * self.store.element_bytes(x.kind)) as u64;
        self.sent_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// A new buffer like `x`.
    fn like(&self, x: &DeviceValues) -> DeviceValues {
        self.store.uninitialised(x.len, x.kind)
    }
}

/// The bytes of `x`, as NCCL moves them.
fn bytes(store: &DeviceStore, x: &DeviceValues) -> usize {
    x.len * store.element_bytes(x.kind)
}

fn view<'b>(store: &DeviceStore, x: &'b DeviceValues) -> CudaView<'b, u8> {
    x.buffer().slice(0..bytes(store, x))
}

/// The buffer of a value this group just made (no one else holds it).
fn unique(x: &mut DeviceValues) -> &mut CudaSlice<u8> {
    x.buffer_mut().expect("a receive buffer is the group's own")
}

impl Communicator for NcclGroup<'_> {
    type Values = DeviceValues;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn exchange(&self, to: usize, from: usize, tag: u32, data: DeviceValues) {
        assert!(
            to != self.rank() && from != self.rank(),
            "an exchange is between two other members"
        );
        // Buffers come from the compute stream's pool: made before the group's stream is
        // ordered after it, so that they exist when NCCL writes them.
        let mut incoming = self.like(&data);
        let started = self.after_compute();
        let n = bytes(self.store, &data);
        {
            let outgoing = view(self.store, &data);
            let landing = unique(&mut incoming).slice_mut(0..n);
            let mut group = self.comm.group();
            nccl("send", group.send(outgoing, to as i32));
            nccl("receive", group.recv(landing, from as i32));
        }
        self.count(&data);
        let landed = self.landed(started);
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((from, tag))
            .or_default()
            .push_back(Incoming {
                values: incoming,
                landed,
                _sent: data,
            });
    }

    fn recv(&self, from: usize, tag: u32) -> DeviceValues {
        let incoming = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&(from, tag))
            .and_then(VecDeque::pop_front)
            .unwrap_or_else(|| {
                panic!("a receive from member {from} (tag {tag:#x}) that no exchange started")
            });
        check("stream wait", self.store.stream.wait(&incoming.landed));
        incoming.values
    }

    fn barrier(&self) {
        let one = self.store.uninitialised(1, Kind::Accumulator);
        let mut sum = self.store.uninitialised(1, Kind::Accumulator);
        // A barrier's wait is not communication: its span is dropped.
        drop(self.after_compute());
        nccl(
            "barrier",
            self.comm.all_reduce(
                &view(self.store, &one),
                &mut unique(&mut sum).slice_mut(0..4),
                &ReduceOp::Sum,
            ),
        );
        check("barrier", self.stream.synchronize());
    }

    fn all_to_all(&self, _tag: u32, chunks: Vec<DeviceValues>) -> Vec<DeviceValues> {
        let me = self.rank();
        let mut received: Vec<DeviceValues> = chunks.iter().map(|c| self.like(c)).collect();
        let started = self.after_compute();
        {
            let outgoing: Vec<CudaView<u8>> = chunks.iter().map(|c| view(self.store, c)).collect();
            let landing: Vec<_> = received
                .iter_mut()
                .zip(&chunks)
                .map(|(r, c)| {
                    let n = bytes(self.store, c);
                    unique(r).slice_mut(0..n)
                })
                .collect();
            let mut group = self.comm.group();
            for (member, (out, land)) in outgoing.into_iter().zip(landing).enumerate() {
                if member != me {
                    nccl("all-to-all send", group.send(out, member as i32));
                    nccl("all-to-all receive", group.recv(land, member as i32));
                }
            }
        }
        for (member, chunk) in chunks.iter().enumerate() {
            if member != me {
                self.count(chunk);
            }
        }
        check("stream wait", self.store.stream.wait(&self.landed(started)));
        received[me] = chunks[me].clone();
        received
    }

    fn all_gather(&self, _tag: u32, data: DeviceValues) -> Vec<DeviceValues> {
        let n = self.size();
        if n == 1 {
            // A group of one gathers what it holds: no copy through NCCL.
            return vec![data];
        }
        let len = data.len;
        let mut all = self.store.uninitialised(n * len, data.kind);
        let started = self.after_compute();
        let total = n * bytes(self.store, &data);
        nccl(
            "all-gather",
            self.comm.all_gather(
                &view(self.store, &data),
                &mut unique(&mut all).slice_mut(0..total),
            ),
        );
        self.sent_bytes.fetch_add(
            ((n - 1) * bytes(self.store, &data)) as u64,
            Ordering::Relaxed,
        );
        check("stream wait", self.store.stream.wait(&self.landed(started)));
        use crate::local::Store;
        (0..n)
            .map(|member| {
                self.store
                    .gather(&[(&all, member * len..(member + 1) * len)])
            })
            .collect()
    }

    fn reduce_scatter(&self, _tag: u32, mut chunks: Vec<DeviceValues>) -> DeviceValues {
        use crate::local::Store;
        let n = self.size();
        let len = chunks[0].len;
        assert!(
            chunks
                .iter()
                .all(|c| c.len == len && c.kind == Kind::Accumulator),
            "reduce-scatter sums equal f32 chunks"
        );
        if n == 1 {
            // A group of one keeps its own sum: no copy through NCCL.
            return chunks.pop().expect("one chunk a member");
        }
        let parts: Vec<_> = chunks.iter().map(|c| (c, 0..len)).collect();
        let packed = self.store.gather(&parts);
        let mut mine = self.store.uninitialised(len, Kind::Accumulator);
        let started = self.after_compute();
        {
            // SAFETY: both buffers hold f32 values (their kind), as many as the lengths say.
            let send = unsafe { packed.buffer().transmute::<f32>(n * len) }
                .expect("the packed chunks hold n × len f32 values");
            let mut receive = unsafe { unique(&mut mine).transmute_mut::<f32>(len) }
                .expect("the receive buffer holds len f32 values");
            nccl(
                "reduce-scatter",
                self.comm
                    .reduce_scatter(&send, &mut receive, &ReduceOp::Sum),
            );
        }
        self.sent_bytes
            .fetch_add(((n - 1) * len * 4) as u64, Ordering::Relaxed);
        check("stream wait", self.store.stream.wait(&self.landed(started)));
        mine
    }
}

/// O and LSE go as two operations of one NCCL group: one latency per hop.
impl PointToPoint for NcclGroup<'_> {
    fn send_partial(&self, to: usize, _tag: u32, partial: Partial<DeviceValues>) {
        let started = self.after_compute();
        {
            let (out, lse) = (
                view(self.store, &partial.out),
                view(self.store, &partial.lse),
            );
            let mut group = self.comm.group();
            nccl("send", group.send(out, to as i32));
            nccl("send", group.send(lse, to as i32));
        }
        self.count(&partial.out);
        self.count(&partial.lse);
        // The partial's buffers are freed on the compute stream when dropped here: it waits for
        // the send first.
        check("stream wait", self.store.stream.wait(&self.landed(started)));
    }

    fn receive_partial(
        &self,
        from: usize,
        _tag: u32,
        like: &Partial<DeviceValues>,
    ) -> Partial<DeviceValues> {
        let (mut out, mut lse) = (self.like(&like.out), self.like(&like.lse));
        let started = self.after_compute();
        {
            let (n_out, n_lse) = (bytes(self.store, &like.out), bytes(self.store, &like.lse));
            let out = unique(&mut out).slice_mut(0..n_out);
            let lse = unique(&mut lse).slice_mut(0..n_lse);
            let mut group = self.comm.group();
            nccl("receive", group.recv(out, from as i32));
            nccl("receive", group.recv(lse, from as i32));
        }
        check("stream wait", self.store.stream.wait(&self.landed(started)));
        Partial { out, lse }
    }
}
