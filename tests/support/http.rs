//! A small HTTP/1.1 server on loopback for download tests. Besides honest files (byte ranges,
//! 404 for unknown paths, a response cut in the middle once to exercise resuming) it can play the
//! hostile server a downloader must survive: an endless body, a stall, a redirect elsewhere, a
//! `206` whose `Content-Range` is not the range asked for, a `Content-Length` far too large.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request as the server saw it: path and `Range` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub path: String,
    pub range: Option<String>,
}

/// What the server does for one path.
#[derive(Debug, Clone)]
pub enum Behaviour {
    /// Serves the bytes, honouring `Range: bytes=N-`.
    File(Vec<u8>),
    /// Like `File`, but the first GET announces the whole body, sends half of it and closes.
    CutOnce(Vec<u8>),
    /// `200` without a `Content-Length`, then bytes until the client goes away.
    Endless,
    /// `200` announcing this many bytes, then bytes until the client goes away.
    Huge(u64),
    /// Headers announcing the body, its first half, then nothing more until the server is dropped.
    Stall(Vec<u8>),
    /// `302 Found` to this location (absolute, or relative to the server).
    Redirect(String),
    /// The first GET is cut in the middle like `CutOnce`; a range request is then answered `206`
    /// with `Content-Range: bytes 0-…` and the whole body, whatever range was asked for.
    WrongRange(Vec<u8>),
}

pub struct HttpServer {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
}

struct Shared {
    routes: HashMap<String, Behaviour>,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    cut_done: Mutex<HashSet<String>>,
}

impl HttpServer {
    /// Serves `files` (path → bytes). The first GET of each path in `cut_once` announces the whole
    /// body but sends only half of it before closing the connection.
    pub fn start(files: HashMap<String, Vec<u8>>, cut_once: HashSet<String>) -> HttpServer {
        let routes = files
            .into_iter()
            .map(|(path, body)| {
                let behaviour = if cut_once.contains(&path) {
                    Behaviour::CutOnce(body)
                } else {
                    Behaviour::File(body)
                };
                (path, behaviour)
            })
            .collect();
        HttpServer::serve(routes)
    }

    /// Serves each path as its [`Behaviour`] says; other paths get `404`.
    pub fn serve(routes: HashMap<String, Behaviour>) -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            routes,
            seen: Arc::clone(&seen),
            stop: Arc::clone(&stop),
            cut_done: Mutex::new(HashSet::new()),
        });
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || handle(stream, &shared));
            }
        });
        HttpServer { addr, seen, stop }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}/{}", self.addr, path.trim_start_matches('/'))
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn handle(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(stream.try_clone().expect("clone the stream"));
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let path = request_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .trim_start_matches('/')
        .to_string();
    let mut range = None;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("range") {
                range = Some(value.trim().to_string());
            }
        }
    }
    if let Ok(mut seen) = shared.seen.lock() {
        seen.push(Seen {
            path: path.clone(),
            range: range.clone(),
        });
    }
    let first_time = shared
        .cut_done
        .lock()
        .map(|mut done| done.insert(path.clone()))
        .unwrap_or(false);
    match shared.routes.get(&path) {
        None => {
            let _ = stream.write_all(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
            );
        }
        Some(Behaviour::File(body)) => send_file(&mut stream, body, range.as_deref(), false),
        Some(Behaviour::CutOnce(body)) => {
            send_file(&mut stream, body, range.as_deref(), first_time)
        }
        Some(Behaviour::WrongRange(body)) if range.is_some() => {
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes 0-{}/{}\r\nConnection: close\r\n\r\n",
                body.len(),
                body.len().saturating_sub(1),
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(body);
        }
        Some(Behaviour::WrongRange(body)) => send_file(&mut stream, body, None, first_time),
        Some(Behaviour::Endless) => {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
            flood(&mut stream, &shared.stop);
        }
        Some(Behaviour::Huge(length)) => {
            let head =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n");
            let _ = stream.write_all(head.as_bytes());
            flood(&mut stream, &shared.stop);
        }
        Some(Behaviour::Stall(body)) => {
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body[..body.len() / 2]);
            let _ = stream.flush();
            // Held open, silent, for as long as the test needs it (bounded so threads end).
            let until = Instant::now() + Duration::from_secs(120);
            while !shared.stop.load(Ordering::SeqCst) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(Behaviour::Redirect(location)) => {
            let head = format!(
                "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
            let _ = stream.write_all(head.as_bytes());
        }
    }
}

fn send_file(stream: &mut TcpStream, body: &[u8], range: Option<&str>, cut: bool) {
    let start = range
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.trim_end_matches('-').parse::<usize>().ok())
        .unwrap_or(0);
    if start > body.len() {
        let _ = stream.write_all(
            b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        );
        return;
    }
    let rest = &body[start..];
    let head = if range.is_some() {
        format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{}\r\nConnection: close\r\n\r\n",
            rest.len(),
            body.len().saturating_sub(1),
            body.len()
        )
    } else {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            rest.len()
        )
    };
    let _ = stream.write_all(head.as_bytes());
    if cut {
        let _ = stream.write_all(&rest[..rest.len() / 2]);
        let _ = stream.flush();
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let _ = stream.write_all(rest);
}

/// Writes filler until the client hangs up or the server is dropped.
fn flood(stream: &mut TcpStream, stop: &AtomicBool) {
    let chunk = vec![b'x'; 1 << 16];
    while !stop.load(Ordering::SeqCst) {
        if stream.write_all(&chunk).is_err() {
            break;
        }
    }
}
