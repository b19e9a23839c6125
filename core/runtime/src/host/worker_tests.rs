//! The host's side of the worker protocol against real processes: shell scripts that speak the
//! JSON-lines protocol as `attnbench worker` does, then finish, fail, crash or hang.

use std::cell::RefCell;
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::AtomicBool;

use super::*;

/// A worker executable that says it is ready, then answers every node with `node` (shell).
fn fake_worker(dir: &Path, node: &str) -> PathBuf {
    let path = dir.join("worker.sh");
    let script = format!(
        "#!/bin/sh\necho '{{\"type\":\"ready\",\"plugin\":\"fake\",\"pid\":1}}'\nwhile read line; do\n{node}\ndone\n"
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

const DONE_MARK: &str = r"printf '\001attnbench-node-done\n' >&2";

#[derive(Default)]
struct Recorded(RefCell<Vec<String>>);

impl ServiceSink for Recorded {
    fn log(&self, level: LogLevel, message: &str) {
        self.0.borrow_mut().push(format!("{level:?}: {message}"));
    }
    fn progress(&self, done: u64, total: u64, message: &str) {
        self.0
            .borrow_mut()
            .push(format!("{done}/{total} {message}"));
    }
    fn is_cancelled(&self) -> bool {
        false
    }
}

fn run(
    worker: &mut Worker,
    timeout: Option<Duration>,
    log: Option<File>,
) -> (WorkerOutcome, Vec<String>) {
    let sink = Recorded::default();
    let outcome = worker.run("stage", "{}", timeout, &AtomicBool::new(false), &sink, log);
    (outcome, sink.0.into_inner())
}

#[test]
fn a_node_returns_its_result_with_logs_progress_and_stderr_in_their_places() {
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(
        dir.path(),
        &format!(
            "echo 'plugin says hi' >&2\n\
             echo '{{\"type\":\"log\",\"level\":\"warn\",\"message\":\"careful\"}}'\n\
             echo '{{\"type\":\"progress\",\"done\":1,\"total\":2,\"message\":\"half\"}}'\n\
             echo '{{\"type\":\"done\",\"ok\":true,\"output\":\"{{}}\"}}'\n{DONE_MARK}"
        ),
    );
    let mut worker = Worker::spawn(&exe, Path::new("libfake.so"), &[]).unwrap();
    let log_path = dir.path().join("node.log");
    let (outcome, seen) = run(&mut worker, None, Some(File::create(&log_path).unwrap()));
    assert!(
        matches!(outcome, WorkerOutcome::Finished(Ok(ref out)) if out == "{}"),
        "{outcome:?}"
    );
    assert_eq!(seen, ["Warn: careful", "1/2 half"]);
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert_eq!(log, "[stderr] plugin says hi\n");
    // The same worker takes the next node.
    let (again, _) = run(&mut worker, None, None);
    assert!(matches!(again, WorkerOutcome::Finished(Ok(_))), "{again:?}");
    assert!(worker.is_alive());
}

#[test]
fn a_failed_node_keeps_its_failure_kind() {
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(
        dir.path(),
        &format!(
            "echo '{{\"type\":\"done\",\"ok\":false,\"output\":\"needs 90 GiB\",\"failure\":\"out_of_memory\"}}'\n{DONE_MARK}"
        ),
    );
    let mut worker = Worker::spawn(&exe, Path::new("libfake.so"), &[]).unwrap();
    match run(&mut worker, None, None).0 {
        WorkerOutcome::Finished(Err(failure)) => {
            assert_eq!(failure.kind, FailureKind::OutOfMemory);
            assert_eq!(failure.message, "needs 90 GiB");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_worker_that_dies_is_named_by_its_signal_and_last_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(dir.path(), "echo 'about to fault' >&2\nkill -SEGV $$");
    let mut worker = Worker::spawn(&exe, Path::new("libfake.so"), &[]).unwrap();
    match run(&mut worker, None, None).0 {
        WorkerOutcome::Crashed(reason) => {
            assert!(
                reason.starts_with("worker died of signal 11 (SIGSEGV"),
                "{reason}"
            );
            assert!(reason.contains("about to fault"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(!worker.is_alive());
}

#[test]
fn a_node_past_its_timeout_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let exe = fake_worker(dir.path(), "sleep 30");
    let mut worker = Worker::spawn(&exe, Path::new("libfake.so"), &[]).unwrap();
    let start = Instant::now();
    let (outcome, _) = run(&mut worker, Some(Duration::from_millis(300)), None);
    assert!(matches!(outcome, WorkerOutcome::TimedOut), "{outcome:?}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(!worker.is_alive());
}

#[test]
fn a_worker_that_cannot_start_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fatal.sh");
    std::fs::write(
        &path,
        "#!/bin/sh\necho '{\"type\":\"fatal\",\"error\":\"libfake.so is not a plugin\"}'\n",
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    let error = Worker::spawn(&path, Path::new("libfake.so"), &[])
        .err()
        .unwrap();
    assert!(
        matches!(&error, SpawnError::Fatal(message) if message == "libfake.so is not a plugin"),
        "{error}"
    );
    let missing = Worker::spawn(&dir.path().join("absent"), Path::new("libfake.so"), &[])
        .err()
        .unwrap();
    assert!(matches!(missing, SpawnError::Start { .. }), "{missing}");
    assert!(missing.to_string().starts_with("cannot start a worker"));
}
