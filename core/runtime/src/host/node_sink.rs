//! What a running node's plugin reports to the host — log lines, progress, the cancellation
//! question — and in-process stages run on a thread of their own, so that a stop can leave one
//! behind.

use std::fs::File;
use std::io::Write;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use attnbench_abi::LogLevel;

use attnbench_sdk::StageFailure;

use crate::host::plugin::Plugin;
use crate::host::services::{trace_plugin_log, ServiceSink};
use crate::host::worker::STOP_GRACE;
use crate::run::NodeFailure;
use crate::stop::StopToken;

/// The sink of one node: its log file and the tracing output get every line; progress goes to
/// `progress`, which draws it or carries it to the thread that does.
pub struct NodeSink<P> {
    pub node: String,
    pub plugin: String,
    pub log: Mutex<Option<File>>,
    pub stop: StopToken,
    pub progress: P,
}

impl<P: Fn(u64, u64, &str)> ServiceSink for NodeSink<P> {
    fn log(&self, level: LogLevel, message: &str) {
        trace_plugin_log(&self.plugin, &self.node, level, message);
        if let Ok(mut log) = self.log.lock() {
            if let Some(file) = log.as_mut() {
                let _ = writeln!(file, "[{}] {message}", level.as_str());
            }
        }
    }

    fn progress(&self, done: u64, total: u64, message: &str) {
        (self.progress)(done, total, message);
    }

    fn is_cancelled(&self) -> bool {
        self.stop.requested()
    }
}

enum FromStage {
    Progress(u64, u64, String),
    Done(Result<String, StageFailure>),
}

/// Runs an in-process stage on its own thread and waits for it. Once the run is stopped the
/// stage has [`STOP_GRACE`] to return; a plugin that never asks `is_cancelled` is then left
/// behind (its result, if it ever comes, is dropped) so the stop still ends the run on time.
pub fn run_detached(
    plugin: Arc<Plugin>,
    stage: String,
    request_json: String,
    node: String,
    log: Option<File>,
    stop: &StopToken,
    on_progress: &dyn Fn(u64, u64, &str),
) -> Result<String, NodeFailure> {
    let (sender, receiver) = mpsc::channel::<FromStage>();
    let progress_sender = Mutex::new(sender.clone());
    let sink = NodeSink {
        node: node.clone(),
        plugin: plugin.manifest.name.clone(),
        log: Mutex::new(log),
        stop: stop.clone(),
        progress: move |done: u64, total: u64, message: &str| {
            if let Ok(sender) = progress_sender.lock() {
                let _ = sender.send(FromStage::Progress(done, total, message.to_string()));
            }
        },
    };
    std::thread::Builder::new()
        .name(format!("node {node}"))
        .spawn(move || {
            let result = plugin.run(&stage, &request_json, &sink);
            let _ = sender.send(FromStage::Done(result));
        })
        .map_err(|err| NodeFailure::Error(format!("cannot start a thread for the node: {err}")))?;
    let mut stopped_at: Option<Instant> = None;
    loop {
        match receiver.recv_timeout(Duration::from_millis(100)) {
            Ok(FromStage::Progress(done, total, message)) => on_progress(done, total, &message),
            Ok(FromStage::Done(result)) => return result.map_err(NodeFailure::Stage),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if stop.requested()
                    && stopped_at.get_or_insert_with(Instant::now).elapsed() >= STOP_GRACE
                {
                    return Err(NodeFailure::Interrupted(format!(
                        "the run was stopped and the node was not done {}s later; it runs in process and did not stop when asked, so it was left behind",
                        STOP_GRACE.as_secs()
                    )));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(NodeFailure::Crashed(
                    "the stage's thread ended without a result (it panicked); see the node's log"
                        .into(),
                ))
            }
        }
    }
}
