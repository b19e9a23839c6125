//! `cp/links`: what the links between this machine's GPUs deliver to the collectives the
//! context-parallel methods use — a send/recv ring (Ring P2P), all-to-all (Ulysses), all-gather
//! and reduce-scatter (Ring AllGather) and all-reduce — through NCCL, one process per GPU (the
//! `attnbench-cp-rank` binary, started as the `processes` backend starts context-parallel ranks),
//! every result checked, timed with CUDA events on the communicator's stream. Per collective and
//! size it reports the algorithm and bus bandwidth (nccl-tests' conventions), and per collective
//! the latency and bus bandwidth of a straight-line fit of time against size: the link
//! parameters the cost model (`cp/model`) assumes.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::comm::Group;
use crate::device::GpuError;
use crate::launch::RankInfo;
use crate::processes::RankError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    SendRecv,
    AllToAll,
    AllGather,
    ReduceScatter,
    AllReduce,
}

impl Collective {
    pub const ALL: [Collective; 5] = [
        Collective::SendRecv,
        Collective::AllToAll,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Collective::SendRecv => "send_recv",
            Collective::AllToAll => "all_to_all",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllReduce => "all_reduce",
        }
    }

    pub fn parse(name: &str) -> Option<Collective> {
        Collective::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Bus over algorithm bandwidth (nccl-tests): the share of a message's bytes that crosses
    /// each rank's links, so that bus bandwidths compare across collectives and world sizes (on
    /// one rank nothing crosses one).
    pub fn bus_factor(self, ranks: usize) -> f64 {
        let n = ranks as f64;
        match self {
            Collective::SendRecv => (n - 1.0).min(1.0),
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            _ => (n - 1.0) / n,
        }
    }

    /// Elements of the send and the receive buffer for a message of `count` elements (a
    /// multiple of `ranks`): the size is the larger buffer, as nccl-tests counts it.
    pub fn buffers(self, count: usize, ranks: usize) -> (usize, usize) {
        match self {
            Collective::AllGather => (count / ranks, count),
            Collective::ReduceScatter => (count, count / ranks),
            _ => (count, count),
        }
    }
}

/// The value rank `rank` puts at element `i` of its send buffer: small integers, so that every
/// sum over ranks is exact in f32 and a check can demand equality.
fn pattern(rank: usize, i: usize) -> f32 {
    (rank * 7 + i % 13) as f32
}

/// What rank `me` of `ranks` must receive from `collective` on a message of `count` elements.
pub fn expected(collective: Collective, me: usize, ranks: usize, count: usize) -> Vec<f32> {
    let chunk = count / ranks;
    let sum = |i: usize| (0..ranks).map(|r| pattern(r, i)).sum::<f32>();
    let (_, received) = collective.buffers(count, ranks);
    (0..received)
        .map(|i| match collective {
            Collective::SendRecv => pattern((me + ranks - 1) % ranks, i),
            Collective::AllReduce => sum(i),
            Collective::AllGather => pattern(i / chunk, i % chunk),
            Collective::ReduceScatter => sum(me * chunk + i),
            Collective::AllToAll => pattern(i / chunk, me * chunk + i % chunk),
        })
        .collect()
}

/// Message sizes from `min` to `max` bytes, ×4 apart, `max` included; each a whole number of f32
/// elements per rank.
pub fn sizes(min: u64, max: u64, ranks: usize) -> Vec<u64> {
    let unit = 4 * ranks as u64;
    let round = |bytes: u64| (bytes / unit).max(1) * unit;
    let mut sizes = Vec::new();
    let mut bytes = min.max(1);
    while bytes < max {
        sizes.push(round(bytes));
        bytes *= 4;
    }
    sizes.push(round(max));
    sizes.dedup();
    sizes
}

/// Everything a rank needs; read by `attnbench-cp-rank` (the `kind` tells it from an attention job).
#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename = "links")]
pub struct LinksJob {
    pub ranks: usize,
    pub sizes: Vec<u64>,
    pub collectives: Vec<Collective>,
    /// Timed samples per collective and size; each sample repeats the call for ≥ 5 ms.
    pub samples: usize,
    /// Each rank writes `rank-<r>.json` here.
    pub results: PathBuf,
}

/// One collective at one size as one rank timed it: the median of its samples, per call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Timed {
    pub collective: Collective,
    pub bytes: u64,
    pub seconds: f64,
}

#[derive(Serialize, Deserialize)]
pub struct RankLinks {
    pub device: String,
    pub nccl_version: i32,
    pub timed: Vec<Timed>,
}

/// One call of `collective` from `send` into `receive` on the communicator's stream. All-to-all
/// runs as ranks − 1 pairwise exchanges (send to me + s, receive from me − s) and a local copy.
fn issue(
    collective: Collective,
    comm: &Comm,
    stream: &Arc<CudaStream>,
    send: &CudaSlice<f32>,
    receive: &mut CudaSlice<f32>,
) -> Result<(), GpuError> {
    let (me, n) = (comm.rank(), comm.world_size());
    let failed = || GpuError::nccl(collective.name());
    match collective {
        Collective::AllGather => comm.all_gather(send, receive).map(drop).map_err(failed()),
        Collective::ReduceScatter => comm
            .reduce_scatter(send, receive, &ReduceOp::Sum)
            .map(drop)
            .map_err(failed()),
        Collective::AllReduce => comm
            .all_reduce(send, receive, &ReduceOp::Sum)
            .map(drop)
            .map_err(failed()),
        Collective::SendRecv => {
            let (outgoing, incoming) = (send.slice(..), receive.slice_mut(..));
            let mut group = comm.group();
            group
                .send(outgoing, ((me + 1) % n) as i32)
                .map_err(failed())?;
            group
                .recv(incoming, ((me + n - 1) % n) as i32)
                .map(drop)
                .map_err(failed())
        }
        Collective::AllToAll => {
            let chunk = send.len() / n;
            let own = send.slice(me * chunk..(me + 1) * chunk);
            stream
                .memcpy_dtod(&own, &mut receive.slice_mut(me * chunk..(me + 1) * chunk))
                .map_err(GpuError::driver("all-to-all's local chunk"))?;
            for step in 1..n {
                let (to, from) = ((me + step) % n, (me + n - step) % n);
                let outgoing = send.slice(to * chunk..(to + 1) * chunk);
                let incoming = receive.slice_mut(from * chunk..(from + 1) * chunk);
                let mut group = comm.group();
                group.send(outgoing, to as i32).map_err(failed())?;
                group.recv(incoming, from as i32).map_err(failed())?;
            }
            Ok(())
        }
    }
}

/// Seconds per call of `collective` over `reps` calls, by CUDA events around them.
fn time_calls(
    reps: usize,
    collective: Collective,
    comm: &Comm,
    stream: &Arc<CudaStream>,
    send: &CudaSlice<f32>,
    receive: &mut CudaSlice<f32>,
) -> Result<f64, GpuError> {
    use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
    let start = stream
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(GpuError::driver("timing event"))?;
    for _ in 0..reps {
        issue(collective, comm, stream, send, receive)?;
    }
    let end = stream
        .record_event(Some(CU_EVENT_DEFAULT))
        .map_err(GpuError::driver("timing event"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(GpuError::driver("timing event"))?;
    Ok(ms as f64 * 1e-3 / reps as f64)
}

/// The largest of every rank's `seconds`.
fn slowest(comm: &Comm, stream: &Arc<CudaStream>, seconds: f64) -> Result<f64, GpuError> {
    let mine = stream
        .clone_htod(&[seconds as f32])
        .map_err(GpuError::driver("agreement buffer"))?;
    let mut all = stream
        .alloc_zeros::<f32>(1)
        .map_err(GpuError::driver("agreement buffer"))?;
    comm.all_reduce(&mine, &mut all, &ReduceOp::Max)
        .map_err(GpuError::nccl("agreement"))?;
    let all = stream
        .clone_dtoh(&all)
        .map_err(GpuError::driver("agreement buffer"))?;
    Ok(all[0] as f64)
}

/// Runs this process's rank of `job`: joins the others, then every collective at every size,
/// checked once, then timed.
pub fn run_rank(job: &LinksJob, info: &RankInfo) -> Result<RankLinks, RankError> {
    attnbench_sdk::libraries::require("libcuda", "NVIDIA driver").map_err(GpuError::from)?;
    attnbench_sdk::libraries::require("libnccl", "NCCL").map_err(GpuError::from)?;
    if info.world != job.ranks {
        return Err(RankError::World {
            started: info.world,
            launcher: info.source,
            needed: job.ranks,
        });
    }
    let ctx = CudaContext::new(info.local_rank).map_err(GpuError::driver(format!(
        "cannot open GPU {} (LOCAL_RANK) for rank {}",
        info.local_rank, info.rank
    )))?;
    let device = ctx.name().map_err(GpuError::driver("device name"))?;
    let stream = ctx.new_stream().map_err(GpuError::driver("stream"))?;
    let world = crate::tcp::join(info)?;
    let id = crate::nccl::group_id(&Group::new(world, (0..info.world).collect(), info.rank, 0))?;
    let comm = Comm::from_rank(stream.clone(), info.rank, info.world, id)
        .map_err(GpuError::nccl("communicator"))?;
    let nccl_version =
        cudarc::nccl::result::get_nccl_version().map_err(GpuError::nccl("version"))?;
    let mut timed = Vec::new();
    for &collective in &job.collectives {
        for &bytes in &job.sizes {
            let count = (bytes / 4) as usize;
            let (sent, received) = collective.buffers(count, info.world);
            let values: Vec<f32> = (0..sent).map(|i| pattern(info.rank, i)).collect();
            let send = stream
                .clone_htod(&values)
                .map_err(GpuError::driver("send buffer"))?;
            let mut receive = stream
                .alloc_zeros::<f32>(received)
                .map_err(GpuError::driver("receive buffer"))?;
            issue(collective, &comm, &stream, &send, &mut receive)?;
            let got = stream
                .clone_dtoh(&receive)
                .map_err(GpuError::driver("receive buffer"))?;
            let want = expected(collective, info.rank, info.world, count);
            if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                return Err(RankError::Received {
                    collective: collective.name(),
                    bytes,
                    rank: info.rank,
                    element: i,
                    got: got[i],
                    want: want[i],
                });
            }
            let once = time_calls(1, collective, &comm, &stream, &send, &mut receive)?;
            // Every rank must make the same number of calls, or the last ones wait forever
            // for partners: the count follows the slowest rank's first call.
            let once = slowest(&comm, &stream, once)?;
            let reps = ((5e-3 / once.max(1e-7)) as usize).clamp(1, 200);
            let mut samples = (0..job.samples.max(1))
                .map(|_| time_calls(reps, collective, &comm, &stream, &send, &mut receive))
                .collect::<Result<Vec<f64>, GpuError>>()?;
            samples.sort_by(f64::total_cmp);
            timed.push(Timed {
                collective,
                bytes,
                seconds: samples[samples.len() / 2],
            });
        }
    }
    Ok(RankLinks {
        device,
        nccl_version,
        timed,
    })
}

/// Runs this process's rank of the links job in `text` (from `path`) and writes its result.
pub fn rank_main(text: &[u8], path: &Path) -> Result<(), RankError> {
    let job: LinksJob =
        serde_json::from_slice(text).map_err(RankError::job(path, "a links job"))?;
    let info = RankInfo::from_env()?;
    crate::processes::run_rank_catching(&job.results, info.rank, || run_rank(&job, &info))
}

/// One collective at one size over all ranks: the slowest rank's time per call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub collective: Collective,
    pub bytes: u64,
    pub seconds: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
}

/// A collective's time against size as a line: `latency + bytes · factor / bus bandwidth`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fit {
    pub collective: Collective,
    pub latency_us: f64,
    /// `None` on one rank, where nothing crosses a link.
    pub bus_gbs: Option<f64>,
}

/// The rows of every rank's timings (the slowest rank per cell) and each collective's fit.
pub fn assemble(ranks: usize, results: &[RankLinks]) -> (Vec<Row>, Vec<Fit>) {
    let mut rows: Vec<Row> = Vec::new();
    for result in results {
        for t in &result.timed {
            match rows
                .iter_mut()
                .find(|r| r.collective == t.collective && r.bytes == t.bytes)
            {
                Some(row) => row.seconds = row.seconds.max(t.seconds),
                None => rows.push(Row {
                    collective: t.collective,
                    bytes: t.bytes,
                    seconds: t.seconds,
                    algbw_gbs: 0.0,
                    busbw_gbs: 0.0,
                }),
            }
        }
    }
    for row in &mut rows {
        row.algbw_gbs = row.bytes as f64 / row.seconds / 1e9;
        row.busbw_gbs = row.algbw_gbs * row.collective.bus_factor(ranks);
    }
    let fits = Collective::ALL
        .into_iter()
        .filter_map(|collective| {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|r| r.collective == collective)
                .map(|r| (r.bytes as f64, r.seconds))
                .collect();
            let (intercept, slope) = line(&points)?;
            let factor = collective.bus_factor(ranks);
            Some(Fit {
                collective,
                latency_us: intercept.max(0.0) * 1e6,
                bus_gbs: (factor > 0.0 && slope > 0.0).then(|| factor / slope / 1e9),
            })
        })
        .collect();
    (rows, fits)
}

/// The artifact file of a `cp/links` node.
pub const FILE: &str = "links.json";

/// The content of [`FILE`]: the devices, NCCL's version, the rows and the fits ([`assemble`]).
pub fn record(
    ranks: usize,
    results: &[RankLinks],
    rows: &[Row],
    fits: &[Fit],
) -> serde_json::Value {
    serde_json::json!({
        "ranks": ranks,
        "devices": results.iter().map(|r| r.device.clone()).collect::<Vec<_>>(),
        "nccl_version": results.first().map(|r| r.nccl_version),
        "rows": rows,
        "fits": fits,
    })
}

/// Least-squares line through `points` (x, y): (intercept, slope); `None` under two points.
fn line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    if points.len() < 2 {
        return None;
    }
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (sxy, sxx) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    (sxx > 0.0).then(|| (my - sxy / sxx * mx, sxy / sxx))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each rank must receive, worked out from every rank's send buffer directly.
    #[test]
    fn expected_results_follow_from_the_send_buffers() {
        for n in [1, 2, 3, 4] {
            let count = 12 * n;
            let sent = |c: Collective, r: usize| -> Vec<f32> {
                (0..c.buffers(count, n).0).map(|i| pattern(r, i)).collect()
            };
            let chunk = count / n;
            for me in 0..n {
                let all_gather: Vec<f32> = (0..n)
                    .flat_map(|r| sent(Collective::AllGather, r))
                    .collect();
                assert_eq!(expected(Collective::AllGather, me, n, count), all_gather);
                let all_to_all: Vec<f32> = (0..n)
                    .flat_map(|r| {
                        sent(Collective::AllToAll, r)[me * chunk..(me + 1) * chunk].to_vec()
                    })
                    .collect();
                assert_eq!(expected(Collective::AllToAll, me, n, count), all_to_all);
                let summed = |c: Collective, range: std::ops::Range<usize>| -> Vec<f32> {
                    range.map(|i| (0..n).map(|r| sent(c, r)[i]).sum()).collect()
                };
                assert_eq!(
                    expected(Collective::ReduceScatter, me, n, count),
                    summed(Collective::ReduceScatter, me * chunk..(me + 1) * chunk)
                );
                assert_eq!(
                    expected(Collective::AllReduce, me, n, count),
                    summed(Collective::AllReduce, 0..count)
                );
                assert_eq!(
                    expected(Collective::SendRecv, me, n, count),
                    sent(Collective::SendRecv, (me + n - 1) % n)
                );
            }
        }
    }

    /// The rank binary tells a links job from an attention job by its `kind`.
    #[test]
    fn a_links_job_says_its_kind() {
        let job = LinksJob {
            ranks: 2,
            sizes: vec![4096],
            collectives: vec![Collective::AllToAll],
            samples: 3,
            results: "ranks".into(),
        };
        let text = serde_json::to_value(&job).unwrap();
        assert_eq!(text["kind"], "links");
        assert_eq!(text["collectives"][0], "all_to_all");
        let back: LinksJob = serde_json::from_value(text).unwrap();
        assert_eq!(back.sizes, vec![4096]);
    }

    #[test]
    fn sizes_grow_fourfold_and_split_evenly() {
        assert_eq!(
            sizes(4096, 1 << 20, 3),
            vec![4092, 16380, 65532, 262140, 1048572]
        );
        assert_eq!(sizes(4096, 4096, 8), vec![4096]);
    }

    /// Times made by a known line give back its latency and bus bandwidth; the slowest rank
    /// counts.
    #[test]
    fn the_fit_recovers_latency_and_bandwidth() {
        let ranks = 4;
        let timed = |slow: f64| -> Vec<Timed> {
            [1u64 << 20, 1 << 24, 1 << 28]
                .into_iter()
                .map(|bytes| Timed {
                    collective: Collective::AllGather,
                    bytes,
                    // 10 µs + bytes · 3/4 at 300 GB/s of bus bandwidth.
                    seconds: slow * (10e-6 + bytes as f64 * 0.75 / 300e9),
                })
                .collect()
        };
        let results: Vec<RankLinks> = [1.0, 1.0 + 1e-9]
            .into_iter()
            .map(|slow| RankLinks {
                device: "gpu".into(),
                nccl_version: 22809,
                timed: timed(slow),
            })
            .collect();
        let (rows, fits) = assemble(ranks, &results);
        assert_eq!(rows.len(), 3);
        // 256 MiB: 671 µs of transfer after 10 µs of latency.
        assert!((295.0..296.5).contains(&rows[2].busbw_gbs), "{rows:?}");
        assert_eq!(fits.len(), 1);
        assert!((fits[0].latency_us - 10.0).abs() < 0.01, "{fits:?}");
        assert!((fits[0].bus_gbs.unwrap() - 300.0).abs() < 0.01, "{fits:?}");
    }
}
