//! Joins the ranks of a multi-process run over TCP. Every rank opens a listener; rank 0 also
//! listens on the meeting port (`MASTER_ADDR:MASTER_PORT`), collects each rank's listener address
//! and sends everyone the table; then each rank connects to the ranks below it and accepts the
//! ones above, giving a full mesh of streams. A reader thread per stream puts the frames it
//! receives (sender, tag, length, f64 values) into this rank's mailbox.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::comm::World;
use crate::launch::RankInfo;

/// How long ranks wait for each other to show up.
const JOIN_TIMEOUT: Duration = Duration::from_secs(120);

/// Why a rank could not join the others.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{step}: nobody came within {} s", JOIN_TIMEOUT.as_secs())]
    NobodyCame { step: &'static str },
    #[error("cannot reach {address} within {} s: {source}", JOIN_TIMEOUT.as_secs())]
    Unreachable {
        address: String,
        source: std::io::Error,
    },
    #[error("rank 0 cannot listen on port {port} (MASTER_PORT): {source}")]
    MeetingPort { port: u16, source: std::io::Error },
    #[error("rendezvous: a malformed message ({0})")]
    Malformed(serde_json::Error),
    #[error("rendezvous: unexpected greeting {0}")]
    Greeting(serde_json::Value),
    #[error("{step}: rank {rank} in a world of {world}")]
    OutsideWorld {
        step: &'static str,
        rank: usize,
        world: usize,
    },
}

fn failed(step: &'static str) -> impl Fn(std::io::Error) -> JoinError {
    move |source| JoinError::Io { step, source }
}

/// Accepts one connection, giving up at `deadline`.
fn accept(
    listener: &TcpListener,
    deadline: Instant,
    what: &'static str,
) -> Result<TcpStream, JoinError> {
    listener.set_nonblocking(true).map_err(failed(what))?;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false).map_err(failed(what))?;
                return Ok(stream);
            }
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(JoinError::NobodyCame { step: what });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(err) => return Err(failed(what)(err)),
        }
    }
}

/// Connects to `address`, retrying until `deadline` (the other side may not listen yet).
fn connect(address: &str, deadline: Instant) -> Result<TcpStream, JoinError> {
    loop {
        match TcpStream::connect(address) {
            Ok(stream) => return Ok(stream),
            Err(source) if Instant::now() > deadline => {
                return Err(JoinError::Unreachable {
                    address: address.to_string(),
                    source,
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn read_line(stream: &TcpStream) -> Result<serde_json::Value, JoinError> {
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .map_err(failed("rendezvous"))?;
    serde_json::from_str(&line).map_err(JoinError::Malformed)
}

/// The table of every rank's listener, from rank 0's meeting point.
fn rendezvous(info: &RankInfo, own_port: u16, deadline: Instant) -> Result<Vec<String>, JoinError> {
    let meeting = format!("{}:{}", info.master_addr, info.master_port);
    if info.rank != 0 {
        let mut stream = connect(&meeting, deadline)?;
        writeln!(stream, "{}", json!({"rank": info.rank, "port": own_port}))
            .map_err(failed("rendezvous"))?;
        let table = read_line(&stream)?;
        return serde_json::from_value(table).map_err(JoinError::Malformed);
    }
    let listener = TcpListener::bind(("0.0.0.0", info.master_port)).map_err(|source| {
        JoinError::MeetingPort {
            port: info.master_port,
            source,
        }
    })?;
    let mut table = vec![String::new(); info.world];
    table[0] = format!("{}:{own_port}", info.master_addr);
    let mut streams = Vec::new();
    for _ in 1..info.world {
        let stream = accept(&listener, deadline, "rank 0 waiting for the other ranks")?;
        let hello = read_line(&stream)?;
        let (Some(rank), Some(port)) = (hello["rank"].as_u64(), hello["port"].as_u64()) else {
            return Err(JoinError::Greeting(hello));
        };
        let host = stream.peer_addr().map_err(failed("rendezvous"))?.ip();
        let slot = table
            .get_mut(rank as usize)
            .ok_or(JoinError::OutsideWorld {
                step: "rendezvous",
                rank: rank as usize,
                world: info.world,
            })?;
        *slot = format!("{host}:{port}");
        streams.push(stream);
    }
    for mut stream in streams {
        writeln!(stream, "{}", json!(table)).map_err(failed("rendezvous"))?;
    }
    Ok(table)
}

/// This rank's world: its mailbox, and a stream to every other rank.
pub fn join(info: &RankInfo) -> Result<Arc<World>, JoinError> {
    let deadline = Instant::now() + JOIN_TIMEOUT;
    let listener = TcpListener::bind("0.0.0.0:0").map_err(failed("listen"))?;
    let own_port = listener.local_addr().map_err(failed("listen"))?.port();
    let table = rendezvous(info, own_port, deadline)?;
    let mut links: Vec<Option<TcpStream>> = (0..info.world).map(|_| None).collect();
    for (peer, address) in table.iter().enumerate().take(info.rank) {
        let mut stream = connect(address, deadline)?;
        stream
            .write_all(&(info.rank as u32).to_le_bytes())
            .map_err(failed("mesh"))?;
        links[peer] = Some(stream);
    }
    for _ in info.rank + 1..info.world {
        let mut stream = accept(&listener, deadline, "waiting for higher ranks")?;
        let mut peer = [0u8; 4];
        stream.read_exact(&mut peer).map_err(failed("mesh"))?;
        let peer = u32::from_le_bytes(peer) as usize;
        *links.get_mut(peer).ok_or(JoinError::OutsideWorld {
            step: "mesh",
            rank: peer,
            world: info.world,
        })? = Some(stream);
    }
    let mut readers = Vec::new();
    let mut writers = Vec::new();
    for link in links {
        match link {
            Some(stream) => {
                stream.set_nodelay(true).map_err(failed("mesh"))?;
                readers.push(Some(stream.try_clone().map_err(failed("mesh"))?));
                writers.push(Some(Mutex::new(stream)));
            }
            None => {
                readers.push(None);
                writers.push(None);
            }
        }
    }
    let world = World::with_links(writers);
    let me = info.rank;
    for stream in readers.into_iter().flatten() {
        let world = world.clone();
        std::thread::spawn(move || read_frames(stream, &world, me));
    }
    Ok(world)
}

/// Delivers the frames arriving on `stream` until it closes.
fn read_frames(stream: TcpStream, world: &World, me: usize) {
    let mut reader = BufReader::with_capacity(1 << 20, stream);
    let mut header = [0u8; 16];
    while reader.read_exact(&mut header).is_ok() {
        let from = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let tag = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let count = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes")) as usize;
        let mut bytes = vec![0u8; count * 8];
        if reader.read_exact(&mut bytes).is_err() {
            return;
        }
        let data = bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        world.deliver(from, me, tag, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{Communicator, Group};

    #[test]
    fn ranks_meet_over_loopback_and_exchange() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let n = 4;
        let results: Vec<Vec<Vec<f64>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    scope.spawn(move || {
                        let info = RankInfo {
                            rank,
                            world: n,
                            local_rank: rank,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            source: "test",
                        };
                        let world = join(&info).unwrap();
                        let group = Group::new(world.clone(), (0..n).collect(), rank, 0);
                        group.barrier();
                        let gathered = group.all_gather(1, vec![rank as f64; 3]);
                        assert_eq!(world.sent_elements(rank), 3 * (n as u64 - 1));
                        gathered
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for gathered in results {
            for (j, block) in gathered.iter().enumerate() {
                assert_eq!(block, &vec![j as f64; 3]);
            }
        }
    }
}
