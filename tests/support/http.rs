//! A small HTTP/1.1 file server on loopback for download tests: serves byte ranges, answers 404
//! for unknown paths, and can cut a response in the middle once to exercise resuming.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A request as the server saw it: path and `Range` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub path: String,
    pub range: Option<String>,
}

pub struct HttpServer {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
}

impl HttpServer {
    /// Serves `files` (path → bytes). The first GET of each path in `cut_once` announces the whole
    /// body but sends only half of it before closing the connection.
    pub fn start(files: HashMap<String, Vec<u8>>, cut_once: HashSet<String>) -> HttpServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen_by_server, stop_server) = (Arc::clone(&seen), Arc::clone(&stop));
        let cut = Arc::new(Mutex::new(cut_once));
        let files = Arc::new(files);
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stop_server.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = stream else { continue };
                let (files, seen, cut) = (
                    Arc::clone(&files),
                    Arc::clone(&seen_by_server),
                    Arc::clone(&cut),
                );
                std::thread::spawn(move || serve(stream, &files, &seen, &cut));
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

fn serve(
    mut stream: TcpStream,
    files: &HashMap<String, Vec<u8>>,
    seen: &Mutex<Vec<Seen>>,
    cut: &Mutex<HashSet<String>>,
) {
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
    if let Ok(mut seen) = seen.lock() {
        seen.push(Seen {
            path: path.clone(),
            range: range.clone(),
        });
    }
    let Some(body) = files.get(&path) else {
        let _ = stream.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
        );
        return;
    };
    let start = range
        .as_deref()
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
    let cut_now = cut.lock().map(|mut c| c.remove(&path)).unwrap_or(false);
    let _ = stream.write_all(head.as_bytes());
    if cut_now {
        let _ = stream.write_all(&rest[..rest.len() / 2]);
        let _ = stream.flush();
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let _ = stream.write_all(rest);
}
