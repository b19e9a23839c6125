//! The Python bridge with a real interpreter: the numpy backend under the SDK's kernel-benchmark
//! protocol against the f64 reference (every output, or sampled rows past `check_max_seqlen`), a third-party
//! module, backends that cannot import, a worker that dies mid-node, and a missing interpreter.

use attnbench_tests::{measurement_of, measurements, node, python_with_numpy, stderr, Sandbox};
use serde_json::Value;
use std::path::Path;

fn measurement(record: &Value, id: &str) -> Value {
    measurement_of(node(record, id))
}

/// Runs the sandbox's `p.yaml`, which must succeed, and returns its record.
fn run_ok(sandbox: &Sandbox) -> Value {
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert!(run.status.success(), "{}", stderr(&run));
    sandbox.last_record()
}

fn python() -> String {
    python_with_numpy().display().to_string()
}

#[test]
fn the_numpy_backend_matches_the_reference_forward_and_backward() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "p.yaml",
        &format!(
            r#"name: numpy-bridge
seed: 3
defaults: {{heads_q: 4, heads_kv: 2, head_dim: 16}}
stages:
  masks:
    uses: masks/generate
    matrix: {{mask: [full, causal_document, share_question, sliding_window, global_sliding_window], seqlen: [192]}}
    with: {{window: 24}}
  bench:
    uses: python/benchmark
    needs: [masks]
    matrix: {{dtype: [f32, bf16], direction: [fwd, bwd]}}
    with: {{kernel: numpy, python: "{python}", min_reps: 3, max_time_s: 0.2}}
"#
        ),
    );
    let record = run_ok(&sandbox);
    let mut checked = 0;
    for (id, m) in measurements(&record, "bench") {
        assert_eq!(m["status"], "ok", "{id}: {m}");
        let correctness = &m["correctness"];
        assert_eq!(correctness["passed"], true, "{id}: {correctness}");
        let errors = correctness["errors"].as_object().unwrap();
        let expected = if m["direction"] == "fwd" { 2 } else { 5 };
        assert_eq!(
            errors.len(),
            expected,
            "{id}: every output checked: {correctness}"
        );
        assert!(m["time_s"]["p50"].as_f64().unwrap() > 0.0);
        assert!(m["memory"]["peak_bytes"].as_u64().unwrap() > 0, "{m}");
        checked += 1;
    }
    assert_eq!(checked, 20);
    // Each node keeps the IR's encodings it handed the worker: documents as varlen, a mask with
    // two key intervals a row refused with the reason.
    let kept = |id: &str| -> Value {
        let folder = node(&record, id)["artifact"].as_str().unwrap().to_string();
        let text = std::fs::read_to_string(Path::new(&folder).join("encodings.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    };
    let documents = kept("bench[mask=causal_document,seqlen=192,dtype=f32,direction=fwd]");
    assert_eq!(documents["varlen"]["encoding"]["right"], 0, "{documents}");
    let global = kept("bench[mask=global_sliding_window,seqlen=192,dtype=f32,direction=fwd]");
    assert!(
        global["varlen"]["refused"]
            .as_str()
            .is_some_and(|why| why.contains("separate key intervals")),
        "{global}"
    );
}

#[test]
fn beyond_the_full_check_the_host_checks_sampled_rows_of_its_own_inputs() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "p.yaml",
        &format!(
            r#"stages:
  masks:
    uses: masks/generate
    with: {{mask: causal_document, seqlen: 320}}
  bench:
    uses: python/benchmark
    needs: [masks]
    matrix: {{direction: [fwd, bwd]}}
    with: {{kernel: numpy, python: "{python}", dtype: f32, heads_q: 4, heads_kv: 1, head_dim: 32, check_max_seqlen: 256, check_rows: 8, min_reps: 3, max_time_s: 0.2}}
"#
        ),
    );
    let record = run_ok(&sandbox);
    for id in ["bench[direction=fwd]", "bench[direction=bwd]"] {
        let m = measurement(&record, id);
        let correctness = &m["correctness"];
        assert_eq!(correctness["passed"], true, "{id}: {correctness}");
        assert!(
            correctness["checked"].as_str().unwrap().contains("8 rows"),
            "{correctness}"
        );
        assert_eq!(
            correctness["reference"], "per-row f64 reference from the mask's slices",
            "{correctness}"
        );
        // The SDK's protocol steps, and the worker's own beside them.
        for phase in [
            "inputs_s",
            "prepare_s",
            "first_run_s",
            "check_s",
            "timing_s",
            "load_inputs_s",
        ] {
            assert!(
                m["phases"][phase].is_number(),
                "{id}: {phase} in {}",
                m["phases"]
            );
        }
    }
    let bwd = measurement(&record, "bench[direction=bwd]");
    assert!(
        bwd["correctness"]["errors"]["dq"].as_f64().unwrap() < 1e-4,
        "{bwd}"
    );
}

/// MLA-shaped heads (V narrower than Q and K): the numpy backend runs them, checked in full
/// against the SDK's reference and, past `check_max_seqlen`, on sampled rows; a
/// backend whose adapter takes one head dim says so instead of running.
#[test]
fn a_value_head_dim_apart_from_the_query_one_is_run_and_checked_or_refused() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "p.yaml",
        &format!(
            r#"defaults: {{heads_q: 4, heads_kv: 2, head_dim: 24, head_dim_v: 16}}
stages:
  masks:
    uses: masks/generate
    matrix: {{mask: [causal_document], seqlen: [128, 320]}}
  bench:
    uses: python/benchmark
    needs: [masks]
    matrix: {{direction: [fwd, bwd]}}
    with: {{kernel: numpy, python: "{python}", dtype: f32, check_max_seqlen: 256, check_rows: 8, min_reps: 3, max_time_s: 0.2}}
  refused:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: fa2, python: "{python}"}}
"#
        ),
    );
    let record = run_ok(&sandbox);
    let mut checked = 0;
    for (id, m) in measurements(&record, "bench") {
        assert_eq!(m["status"], "ok", "{id}: {m}");
        assert_eq!(
            m["correctness"]["passed"], true,
            "{id}: {}",
            m["correctness"]
        );
        checked += 1;
    }
    assert_eq!(checked, 4);
    for (id, m) in measurements(&record, "refused") {
        assert_eq!(m["status"], "unsupported", "{id}: {m}");
        let reason = m["reason"].as_str().unwrap();
        assert!(reason.contains("head_dim_v 16"), "{id}: {reason}");
    }
}

#[test]
fn kernel_variants_are_named_apart_and_merge_into_separate_cells() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "p.yaml",
        &format!(
            r#"stages:
  masks:
    uses: masks/generate
    with: {{mask: causal, seqlen: 128}}
  bench:
    uses: python/benchmark
    needs: [masks]
    matrix: {{layout: [auto, bhsd], gqa: [native, expand]}}
    with: {{kernel: numpy, python: "{python}", dtype: f32, heads_q: 4, heads_kv: 2, head_dim: 16, min_reps: 3, max_time_s: 0.2}}
"#
        ),
    );
    let record = run_ok(&sandbox);
    let named = |id: &str| {
        measurement(&record, id)["kernel"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(named("bench[layout=auto,gqa=native]"), "numpy");
    assert_eq!(named("bench[layout=bhsd,gqa=native]"), "numpy layout=bhsd");
    assert_eq!(
        named("bench[layout=bhsd,gqa=expand]"),
        "numpy layout=bhsd gqa=expand"
    );
    let expand = measurement(&record, "bench[layout=auto,gqa=expand]");
    assert_eq!(expand["status"], "unsupported", "{expand}");
    assert!(
        expand["reason"]
            .as_str()
            .unwrap()
            .contains("applies to the SDPA kernels"),
        "{expand}"
    );
    let out = sandbox.path().join("merged");
    let cache = sandbox.cache();
    let report = sandbox.run(&[
        "report",
        "--table",
        "--out",
        out.to_str().unwrap(),
        cache.to_str().unwrap(),
    ]);
    assert!(report.status.success(), "{}", stderr(&report));
    assert!(
        String::from_utf8_lossy(&report.stdout).starts_with("4 measurements"),
        "every variant is its own cell: {}",
        String::from_utf8_lossy(&report.stdout)
    );
}

#[test]
fn a_third_party_module_is_benchmarked_and_a_missing_package_is_unsupported() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "my_kernel.py",
        r#"import numpy as np

BACKEND = "numpy"

def attention(q, k, v, mask, scale):
    heads, s, _ = q.shape
    group = heads // k.shape[0]
    allowed = mask["dense"]
    out = np.zeros(q.shape, dtype=np.float32)
    lse = np.full((heads, s), -np.inf, dtype=np.float32)
    for h in range(heads):
        scores = (q[h].astype(np.float64) @ k[h // group].T.astype(np.float64)) * scale
        scores = np.where(allowed, scores, -np.inf)
        top = scores.max(axis=1, keepdims=True)
        live = np.isfinite(top[:, 0])
        top[~live] = 0.0
        weights = np.exp(scores - top)
        total = weights.sum(axis=1, keepdims=True)
        total[~live] = 1.0
        out[h] = (weights / total) @ v[h // group]
        lse[h][live] = (top[:, 0] + np.log(total[:, 0]))[live]
    return out, lse
"#,
    );
    sandbox.write(
        "p.yaml",
        &format!(
            r#"stages:
  masks:
    uses: masks/generate
    with: {{mask: prefix_lm_document, seqlen: 128}}
  mine:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: module, module: my_kernel.py, python: "{python}", dtype: f32, heads_q: 4, heads_kv: 2, head_dim: 16, min_reps: 3, max_time_s: 0.2}}
  flash:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: fa2, python: "{python}", heads_q: 4, heads_kv: 2, head_dim: 16}}
"#
        ),
    );
    let record = run_ok(&sandbox);
    let mine = measurement(&record, "mine");
    assert_eq!(mine["status"], "ok", "{mine}");
    assert_eq!(mine["kernel"], "module:my_kernel");
    assert_eq!(mine["correctness"]["passed"], true, "{mine}");
    let flash = measurement(&record, "flash");
    assert_eq!(flash["status"], "unsupported", "{flash}");
    let reason = flash["reason"].as_str().unwrap();
    assert!(reason.contains("not importable"), "{reason}");
    // Not the mask's fault but this machine's: another machine with flash_attn runs the node.
    assert_eq!(flash["unsupported_scope"], "machine", "{flash}");
}

#[test]
fn a_worker_that_dies_fails_its_node_and_the_next_node_gets_a_fresh_one() {
    let sandbox = Sandbox::new();
    let python = python();
    sandbox.write(
        "dies.py",
        "import os, signal\nBACKEND = \"numpy\"\n\ndef attention(q, k, v, mask, scale):\n    os.kill(os.getpid(), signal.SIGSEGV)\n",
    );
    sandbox.write(
        "p.yaml",
        &format!(
            r#"stages:
  masks:
    uses: masks/generate
    with: {{mask: causal, seqlen: 64}}
  dies:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: module, module: dies.py, python: "{python}", dtype: f32, heads_q: 2, heads_kv: 1, head_dim: 8}}
  after:
    uses: python/benchmark
    needs: [masks, dies]
    with: {{kernel: numpy, python: "{python}", dtype: f32, heads_q: 2, heads_kv: 1, head_dim: 8, min_reps: 3, max_time_s: 0.1}}
  alone:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: numpy, python: "{python}", dtype: f32, heads_q: 2, heads_kv: 1, head_dim: 8, min_reps: 3, max_time_s: 0.1}}
"#
        ),
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let record = sandbox.last_record();
    let dies = node(&record, "dies");
    assert_eq!(dies["status"], "error", "{dies}");
    let error = dies["error"].as_str().unwrap();
    assert!(
        error.contains("crashed") && error.contains("signal 11"),
        "{error}"
    );
    assert_eq!(node(&record, "after")["status"], "skipped");
    let alone = measurement(&record, "alone");
    assert_eq!(
        alone["status"], "ok",
        "a fresh worker served the next node: {alone}"
    );
}

#[test]
fn a_missing_interpreter_is_one_sentence() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  masks:\n    uses: masks/generate\n    with: {mask: causal, seqlen: 64}\n  bench:\n    uses: python/benchmark\n    needs: [masks]\n    with: {kernel: numpy, python: /nonexistent/python3}\n",
    );
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert_eq!(run.status.code(), Some(1));
    let record = sandbox.last_record();
    let error = node(&record, "bench")["error"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        error.contains("cannot start the Python interpreter `/nonexistent/python3`")
            && error.contains("ATTNBENCH_PYTHON"),
        "{error}"
    );
    assert!(!error.contains('\n'), "{error}");
}

#[test]
fn the_bridge_passes_its_own_protocol_and_adapter_checks() {
    let python = python();
    let script = attnbench_tests::workspace_root().join("plugins/python/bridge/test_bridge.py");
    let output = std::process::Command::new(&python)
        .arg(&script)
        .args(["--python", &python, "--quick"])
        .output()
        .expect("python starts");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && text.contains(" 0 failed"),
        "{text}\n{}",
        stderr(&output)
    );
}

#[test]
fn a_hanging_kernel_times_out_and_takes_its_python_worker_with_it() {
    let sandbox = Sandbox::new();
    let python = python();
    let pid_file = sandbox.path().join("hung.pid");
    sandbox.write(
        "hangs.py",
        &format!(
            "import os, time\nBACKEND = \"numpy\"\n\ndef attention(q, k, v, mask, scale):\n    open({:?}, \"w\").write(str(os.getpid()))\n    time.sleep(3600)\n",
            pid_file.display().to_string()
        ),
    );
    sandbox.write(
        "p.yaml",
        &format!(
            r#"stages:
  masks:
    uses: masks/generate
    with: {{mask: causal, seqlen: 64}}
  hangs:
    uses: python/benchmark
    needs: [masks]
    timeout: 3s
    with: {{kernel: module, module: hangs.py, python: "{python}", dtype: f32, heads_q: 2, heads_kv: 1, head_dim: 8}}
  alone:
    uses: python/benchmark
    needs: [masks]
    with: {{kernel: numpy, python: "{python}", dtype: f32, heads_q: 2, heads_kv: 1, head_dim: 8, min_reps: 3, max_time_s: 0.1}}
"#
        ),
    );
    let started = std::time::Instant::now();
    let run = sandbox.run(&["run", "p.yaml", "-q"]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    assert!(started.elapsed().as_secs() < 60, "the hang was cut short");
    let record = sandbox.last_record();
    assert_eq!(node(&record, "hangs")["status"], "timeout");
    assert_eq!(measurement(&record, "alone")["status"], "ok");
    // The hung interpreter died with its worker (PR_SET_PDEATHSIG).
    let pid = std::fs::read_to_string(&pid_file).expect("the module ran");
    std::thread::sleep(std::time::Duration::from_millis(300));
    // Gone, or a zombie waiting for whoever inherited it to reap it.
    let state = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
    let running = state
        .rsplit(')')
        .next()
        .and_then(|rest| rest.split_whitespace().next())
        .is_some_and(|state| state != "Z" && state != "X");
    assert!(!running, "the hung Python worker {pid} still runs: {state}");
}

#[test]
fn a_script_planted_in_the_shared_temp_folder_is_never_run() {
    // Earlier versions ran `$TMPDIR/attnbench-python/attnbench_bridge-<hash>.py` when it existed:
    // whoever created it first had their code run by every user of the machine.
    let sandbox = Sandbox::new();
    let python = python();
    let tmp = sandbox.path().join("shared-tmp");
    let planted_dir = tmp.join("attnbench-python");
    std::fs::create_dir_all(&planted_dir).unwrap();
    let source = std::fs::read(
        attnbench_tests::workspace_root().join("plugins/python/bridge/serve_bridge.py"),
    )
    .unwrap();
    let hash = blake3::hash(&source).to_hex();
    let marker = sandbox.path().join("planted-code-ran");
    std::fs::write(
        planted_dir.join(format!("attnbench_bridge-{}.py", &hash[..16])),
        format!("open({:?}, 'w').write('x')\n", marker.display().to_string()),
    )
    .unwrap();
    sandbox.write(
        "p.yaml",
        &format!(
            "stages:\n  masks:\n    uses: masks/generate\n    with: {{mask: causal, seqlen: 64}}\n  bench:\n    uses: python/benchmark\n    needs: [masks]\n    with: {{kernel: numpy, python: \"{python}\", heads_q: 2, heads_kv: 2, head_dim: 16, min_reps: 1, max_time_s: 0.05}}\n"
        ),
    );
    let run = sandbox
        .command(&["run", "p.yaml", "-q"])
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    assert!(!marker.exists(), "the planted script ran");
    assert!(run.status.success(), "{}", stderr(&run));
    assert_eq!(measurement(&sandbox.last_record(), "bench")["status"], "ok");
}

/// FA4's wheel installs `flash_attn/cute` alone: `import flash_attn` then succeeds as a namespace
/// package with no FA2 in it, which `doctor` must not report as FlashAttention 2.
#[test]
fn doctor_does_not_take_a_namespace_package_for_flash_attention_2() {
    let sandbox = Sandbox::new();
    let site = sandbox.path().join("site");
    std::fs::create_dir_all(site.join("flash_attn/cute")).unwrap();
    std::fs::write(
        site.join("flash_attn/cute/__init__.py"),
        "__version__ = '4.0.0'\ndef flash_attn_func(*args, **kwargs):\n    raise NotImplementedError\n",
    )
    .unwrap();
    let doctor = sandbox
        .command(&["doctor"])
        .env("ATTNBENCH_PYTHON", python())
        .env("PYTHONPATH", &site)
        .output()
        .unwrap();
    let text = attnbench_tests::stdout(&doctor);
    assert!(doctor.status.success(), "{}", stderr(&doctor));
    assert!(
        text.contains("flash_attn: only a namespace package"),
        "{text}"
    );
    assert!(text.contains("flash_attn.cute 4.0.0"), "{text}");
}
