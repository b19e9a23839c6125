//! The Python worker: one interpreter per native worker process, started on first use and kept
//! for the nodes that follow, speaking JSON lines — requests on its stdin, one reply per line on
//! its stdout, and within a request that times a kernel, a report of each repetition answered by
//! the host's harness. Its stderr is passed through to the node's log (the last lines are kept to explain
//! a death). It is killed with the native worker (PR_SET_PDEATHSIG), so a node timeout ends both.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attnbench_sdk::measure::{Harness, HarnessRun};
use attnbench_sdk::PluginError;
use serde_json::{json, Value};

/// One file of the `attnbench_bridge` package, for [`FILES`].
macro_rules! package_file {
    ($name:literal) => {
        (
            concat!("attnbench_bridge/", $name),
            include_str!(concat!("../bridge/attnbench_bridge/", $name)),
        )
    };
}

/// The worker's source, embedded so that the plugin library is all a user installs: the
/// launcher and the `attnbench_bridge` package beside it, as (path in the worker's folder, text).
const FILES: [(&str, &str); 19] = [
    ("serve_bridge.py", include_str!("../bridge/serve_bridge.py")),
    package_file!("__init__.py"),
    package_file!("cudnn.py"),
    package_file!("decode.py"),
    package_file!("dispatch.py"),
    package_file!("encodings.py"),
    package_file!("exchange.py"),
    package_file!("flash.py"),
    package_file!("flashinfer.py"),
    package_file!("flashmask.py"),
    package_file!("flex_forms.py"),
    package_file!("harness.py"),
    package_file!("numpy_kernel.py"),
    package_file!("problem.py"),
    package_file!("protocol.py"),
    package_file!("sdpa_flex.py"),
    package_file!("session.py"),
    package_file!("support.py"),
    package_file!("user_module.py"),
];

/// The protocol version the worker's greeting must state.
const PROTOCOL: u64 = 3;

/// Lines of the worker's stderr kept to explain how it died.
const TAIL_LINES: usize = 30;

pub struct Bridge {
    python: String,
    child: Child,
    requests: ChildStdin,
    replies: BufReader<ChildStdout>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    next_id: u64,
    /// The worker's greeting: protocol, Python version and executable.
    pub hello: Value,
    /// The private folder of the script the interpreter runs, removed with the bridge.
    _script_dir: tempfile::TempDir,
}

/// What a request came back with.
pub enum Reply {
    Ok(Value),
    /// The worker raised: its one-sentence error (the traceback went to the log).
    Failed(String),
    /// The worker refused the request's parameters (the bridge's `BadRequest`): what is wrong.
    BadParams(String),
    /// The worker is gone: how it ended and its last stderr lines.
    Died(String),
}

/// Writes the worker's source into a folder made for this worker alone. `mkdir` under a random
/// name with mode 0700 means nobody else can have put a file there first or swap it afterwards:
/// a fixed name in a shared temp folder would run whatever another user of the machine planted.
/// Returns the folder and the launcher's path.
fn write_script() -> Result<(tempfile::TempDir, PathBuf), PluginError> {
    let dir = tempfile::Builder::new()
        .prefix("attnbench-python-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()
        .map_err(|err| PluginError::io(&std::env::temp_dir(), err))?;
    let package = dir.path().join("attnbench_bridge");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&package)
        .map_err(|err| PluginError::io(&package, err))?;
    for (name, text) in FILES {
        let path = dir.path().join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .map_err(|err| PluginError::io(&path, err))?;
    }
    let launcher = dir.path().join("serve_bridge.py");
    Ok((dir, launcher))
}

impl Bridge {
    pub fn start(python: &str) -> Result<Bridge, PluginError> {
        let (script_dir, script) = write_script()?;
        let mut command = Command::new(python);
        // -B: the folder is this worker's alone and goes with it, so no bytecode is written.
        command
            .arg("-B")
            .arg("-u")
            .arg(&script)
            // The native worker's bridge lives in a static, never dropped, and the interpreter
            // dies with the worker: it removes the folder itself once it has imported the
            // package, or every worker process would leave one behind.
            .arg("--remove-own-folder")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = command.spawn().map_err(|err| {
            PluginError::failed(format!(
                "cannot start the Python interpreter `{python}`: {err}; set the stage's `python` parameter or ATTNBENCH_PYTHON to an interpreter"
            ))
        })?;
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let stderr = child.stderr.take().expect("piped above");
        let tail = stderr_tail.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[python] {line}");
                let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        });
        let mut bridge = Bridge {
            python: python.to_string(),
            requests: child.stdin.take().expect("piped above"),
            replies: BufReader::new(child.stdout.take().expect("piped above")),
            child,
            stderr_tail,
            next_id: 1,
            hello: Value::Null,
            _script_dir: script_dir,
        };
        let hello = match bridge.read_line() {
            Some(value) => value,
            None => return Err(PluginError::failed(bridge.death())),
        };
        if hello["type"] != "hello" || hello["protocol"] != PROTOCOL {
            return Err(PluginError::failed(format!(
                "`{python}` ran the attnbench bridge but greeted with {hello} (expected protocol {PROTOCOL})"
            )));
        }
        bridge.hello = hello;
        Ok(bridge)
    }

    pub fn python(&self) -> &str {
        &self.python
    }

    fn read_line(&mut self) -> Option<Value> {
        let mut line = String::new();
        loop {
            line.clear();
            match self.replies.read_line(&mut line) {
                Ok(0) | Err(_) => return None,
                Ok(_) if line.trim().is_empty() => continue,
                Ok(_) => return serde_json::from_str(line.trim()).ok(),
            }
        }
    }

    /// Sends one request and waits for its reply. While the request runs, the worker reports
    /// each timed repetition it makes and `harness` answers whether another follows (the rule
    /// of every attnbench measurement, in one place: [`HarnessRun`]).
    pub fn request(&mut self, op: &str, params: Value, harness: Option<&Harness>) -> Reply {
        let id = self.next_id;
        self.next_id += 1;
        if !self.send(&json!({"id": id, "op": op, "params": params})) {
            return Reply::Died(self.death());
        }
        let mut run: Option<HarnessRun> = None;
        loop {
            let Some(message) = self.read_line() else {
                return Reply::Died(self.death());
            };
            if message["id"] != id {
                // The worker is out of step (it may be waiting for an answer of its own): it
                // goes, so the next request starts on a fresh one.
                let why = format!("the Python worker answered request {id} with {message}");
                return Reply::Died(format!("{why}; {}", self.death()));
            }
            if message["type"] != "rep" {
                return reply_of(message);
            }
            let answer = match (harness, message["seconds"].as_f64()) {
                (None, _) => json!({"id": id, "error": format!("a `{op}` request times nothing")}),
                (Some(_), None) => {
                    json!({"id": id, "error": "a repetition's report needs `seconds`, a number"})
                }
                (Some(harness), Some(seconds)) => {
                    // Reported once it ran: the run's clock starts when the first repetition
                    // began, as a loop of the host's own would.
                    let began = || {
                        let took = Duration::try_from_secs_f64(seconds).unwrap_or_default();
                        Instant::now()
                            .checked_sub(took)
                            .unwrap_or_else(Instant::now)
                    };
                    let timing = run
                        .get_or_insert_with(|| HarnessRun::since(harness, began()))
                        .record(seconds);
                    if timing.is_some() {
                        run = None;
                    }
                    json!({"id": id, "timing": timing})
                }
            };
            if !self.send(&answer) {
                return Reply::Died(self.death());
            }
        }
    }

    fn send(&mut self, message: &Value) -> bool {
        writeln!(self.requests, "{message}")
            .and_then(|_| self.requests.flush())
            .is_ok()
    }

    /// How the worker ended, with its last stderr lines.
    fn death(&mut self) -> String {
        let _ = self.child.kill();
        let how = match self.child.wait() {
            Ok(status) => match (status.code(), status.signal()) {
                (Some(code), _) => format!("exited with status {code}"),
                (None, Some(signal)) => format!("was killed by signal {signal}"),
                _ => "ended".to_string(),
            },
            Err(err) => format!("could not be waited for ({err})"),
        };
        // Give the stderr thread a moment to take the last lines.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let tail = self.stderr_tail.lock().unwrap_or_else(|e| e.into_inner());
        let last: Vec<&str> = tail
            .iter()
            .rev()
            .take(5)
            .rev()
            .map(String::as_str)
            .collect();
        format!(
            "the Python worker (`{}`) {how}; its last stderr lines: {}",
            self.python,
            if last.is_empty() {
                "(none)".to_string()
            } else {
                last.join(" | ")
            }
        )
    }
}

/// A request's final message: its result, or its error.
fn reply_of(message: Value) -> Reply {
    if message["ok"] == true {
        return Reply::Ok(message["result"].clone());
    }
    let error = message["error"]
        .as_str()
        .unwrap_or("the Python worker failed without saying why")
        .to_string();
    if message["kind"] == "params" {
        Reply::BadParams(error)
    } else {
        Reply::Failed(error)
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        let _ = writeln!(self.requests, "{}", json!({"id": 0, "op": "shutdown"}));
        let _ = self.requests.flush();
        for _ in 0..40 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    /// A module added to the package but not to [`super::FILES`] would be missing from every
    /// installed worker: an ImportError on the GPU machine, not a build error here.
    #[test]
    fn every_file_of_the_package_is_embedded() {
        let package =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bridge/attnbench_bridge");
        let mut on_disk: Vec<String> = std::fs::read_dir(&package)
            .unwrap()
            .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
            .filter(|name| name.ends_with(".py"))
            .map(|name| format!("attnbench_bridge/{name}"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = super::FILES
            .iter()
            .map(|(name, _)| name.to_string())
            .filter(|name| name.starts_with("attnbench_bridge/"))
            .collect();
        embedded.sort();
        assert_eq!(embedded, on_disk);
    }
}
