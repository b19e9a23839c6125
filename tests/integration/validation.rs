//! Every validation error names file:line:column, explains itself with a hint, and nothing runs.

use attnbench_tests::{stderr, Sandbox};

/// Runs `text` as a pipeline and returns stderr, checking that validation refused it.
fn refused(text: &str, extra: &[&str]) -> String {
    let sandbox = Sandbox::new();
    sandbox.write("p.yaml", text);
    let mut args = vec!["run", "p.yaml"];
    args.extend_from_slice(extra);
    let output = sandbox.run(&args);
    assert_eq!(
        output.status.code(),
        Some(2),
        "validation errors exit 2:\n{}",
        stderr(&output)
    );
    assert!(!sandbox.cache().join("runs").exists(), "nothing ran");
    stderr(&output)
}

#[test]
fn yaml_syntax() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n   with: {value: 1}\n",
        &[],
    );
    assert!(text.starts_with("p.yaml:4:"), "{text}");
    assert!(text.contains("invalid YAML"), "{text}");
}

#[test]
fn unknown_plugin_suggests_the_nearest() {
    let text = refused("stages:\n  a:\n    uses: testkt/echo\n", &[]);
    assert!(
        text.contains("p.yaml:3:11: unknown plugin `testkt`"),
        "{text}"
    );
    assert!(text.contains("hint: did you mean `testkit`?"), "{text}");
}

#[test]
fn unknown_stage_suggests_the_nearest() {
    let text = refused("stages:\n  a:\n    uses: testkit/ecko\n", &[]);
    assert!(
        text.contains("p.yaml:3:11: plugin `testkit` has no stage `ecko`"),
        "{text}"
    );
    assert!(text.contains("did you mean `echo`?"), "{text}");
}

#[test]
fn unknown_parameter_suggests_the_nearest() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    with:\n      sleep_sm: 3\n",
        &[],
    );
    assert!(
        text.contains("p.yaml:5:7: `testkit/echo` has no parameter `sleep_sm`"),
        "{text}"
    );
    assert!(text.contains("did you mean `sleep_ms`?"), "{text}");
}

#[test]
fn unknown_default_lists_each_parameter_once() {
    let text = refused(
        "defaults: {dtype: bf16}\nstages:\n  a:\n    uses: testkit/echo\n  b:\n    uses: testkit/echo\n",
        &[],
    );
    assert!(
        text.contains("p.yaml:1:12: default `dtype` is a parameter of none of the stages"),
        "{text}"
    );
    let hint = text.lines().find(|l| l.contains("hint:")).expect("a hint");
    assert_eq!(hint.matches("sleep_ms").count(), 1, "{hint}");
}

#[test]
fn wrong_type() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    with: {sleep_ms: soon}\n",
        &[],
    );
    assert!(
        text.contains(
            "p.yaml:4:22: parameter `sleep_ms`: expected an integer, found the string `soon`"
        ),
        "{text}"
    );
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    matrix: {size: [1k, 2q]}\n",
        &[],
    );
    assert!(text.contains("p.yaml:4:25: matrix entry `size`"), "{text}");
    assert!(text.contains("suffix k, M or G"), "{text}");
}

#[test]
fn cycle() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    needs: [c]\n  b:\n    uses: testkit/echo\n    needs: [a]\n  c:\n    uses: testkit/echo\n    needs: [b]\n",
        &[],
    );
    assert!(
        text.contains("the stages depend on each other in a cycle"),
        "{text}"
    );
    assert!(
        text.contains("a → b → c → a")
            || text.contains("b → c → a → b")
            || text.contains("c → a → b → c"),
        "{text}"
    );
    assert!(text.contains("p.yaml:"), "{text}");
}

#[test]
fn unknown_needs() {
    let text = refused("stages:\n  masks:\n    uses: testkit/echo\n  bench:\n    uses: testkit/echo\n    needs: [mask]\n", &[]);
    assert!(
        text.contains(
            "p.yaml:6:13: stage `bench` needs `mask`, which is not a stage of this pipeline"
        ),
        "{text}"
    );
    assert!(text.contains("did you mean `masks`?"), "{text}");
}

#[test]
fn empty_matrix() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    matrix:\n      size: []\n",
        &[],
    );
    assert!(
        text.contains("p.yaml:5:13: matrix entry `size` is empty"),
        "{text}"
    );
}

#[test]
fn bad_override_names_the_option() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n",
        &["--set", "stages.a.with.sleep_ms=never"],
    );
    assert!(
        text.contains(
            "--set stages.a.with.sleep_ms=never: parameter `sleep_ms`: expected an integer"
        ),
        "{text}"
    );
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n",
        &["--set", "stages.a.with"],
    );
    assert!(text.contains("expected KEY=VALUE"), "{text}");
}

#[test]
fn several_problems_are_reported_together() {
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    wiht: {}\n  b:\n    uses: testkit/nope\n",
        &[],
    );
    assert!(text.contains("unknown key `wiht`"), "{text}");
    assert!(text.contains("did you mean `with`?"), "{text}");
    assert!(text.contains("has no stage `nope`"), "{text}");
    assert!(
        text.contains("2 problems in the pipeline; nothing was run"),
        "{text}"
    );
}

#[test]
fn sizes_and_overrides_expand_the_matrix() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "p.yaml",
        "stages:\n  a:\n    uses: testkit/echo\n    matrix: {size: [1k, 64K, 1M, 4096]}\n",
    );
    let output = sandbox.run(&[
        "plan",
        pipeline.to_str().unwrap(),
        "--set",
        "stages.a.matrix.size=[2k, 3000]",
    ]);
    let text = attnbench_tests::stdout(&output);
    assert!(
        text.contains("a[size=2k]") && text.contains("a[size=3000]"),
        "{text}"
    );
    assert!(!text.contains("a[size=1M]"), "{text}");
    let output = sandbox.run(&["plan", pipeline.to_str().unwrap()]);
    let text = attnbench_tests::stdout(&output);
    for id in ["a[size=1k]", "a[size=64k]", "a[size=1M]", "a[size=4k]"] {
        assert!(text.contains(id), "{id} in {text}");
    }
}

#[test]
fn a_matrix_key_shared_with_the_upstream_stage_pairs_equal_values_only() {
    let sandbox = Sandbox::new();
    let pipeline = sandbox.write(
        "p.yaml",
        "stages:\n  a:\n    uses: testkit/echo\n    matrix: {size: [1, 2], value: [x, y]}\n  b:\n    uses: testkit/echo\n    needs: [a]\n    matrix: {size: [1, 2, 3]}\n",
    );
    let output = sandbox.run(&["plan", pipeline.to_str().unwrap()]);
    let text = attnbench_tests::stdout(&output);
    assert!(output.status.success(), "{}", stderr(&output));
    // Each b node joins the a node of its own size: 2 sizes × 2 values, no size 3 (no a has it).
    for id in ["b[size=1,value=x]", "b[size=2,value=y]"] {
        assert!(text.contains(id), "{id} in {text}");
    }
    assert_eq!(text.matches("b[").count(), 4, "{text}");
    assert!(!text.contains("size=3"), "{text}");
}

/// Like [`refused`], for input the old code choked on: `plan` under a 4 GiB address-space limit
/// and a deadline, so that a regression fails the test instead of the machine.
fn refused_quickly(sandbox: &Sandbox, args: &[&str]) -> String {
    use std::os::unix::process::CommandExt;
    let mut command = sandbox.command(args);
    command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 4 << 30,
                rlim_max: 4 << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &limit);
            Ok(())
        });
    }
    let mut child = command.spawn().expect("attnbench starts");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for attnbench") {
            break status;
        }
        if start.elapsed() > std::time::Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("attnbench {args:?} was still running after 20 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut text)
        .expect("stderr is text");
    assert_eq!(status.code(), Some(2), "refusals exit 2:\n{text}");
    assert_eq!(text.trim_end().lines().count(), 1, "one line:\n{text}");
    text
}

#[test]
fn duplicate_keys_are_refused_at_every_level() {
    // The second `stages:` used to replace the first: `a` silently vanished.
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\nname: twice\nstages:\n  b:\n    uses: testkit/echo\n",
        &[],
    );
    assert!(
        text.contains("p.yaml:5:1: duplicate key `stages` (first at line 1, column 1)"),
        "{text}"
    );
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    with:\n      value: 1\n      sleep_ms: 0\n      value: 2\n",
        &[],
    );
    assert!(
        text.contains(
            "p.yaml:7:7: duplicate key `stages.a.with.value` (first at line 5, column 7)"
        ),
        "{text}"
    );
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n",
        &["--set", "stages.a.with={value: 1, value: 2}"],
    );
    assert!(
        text.contains("--set stages.a.with={value: 1, value: 2}: duplicate key `value`"),
        "{text}"
    );
}

#[test]
fn file_parameters_must_be_bounded_regular_files() {
    let sandbox = Sandbox::new();
    let fifo = sandbox.path().join("fifo.json");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `name` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    // /dev/zero was read until memory ran out; a FIFO without a writer hung `plan`.
    for (file, kind) in [("/dev/zero", "a character device"), ("fifo.json", "a FIFO")] {
        sandbox.write(
            "p.yaml",
            &format!("stages:\n  m:\n    uses: masks/generate\n    with: {{mask: causal, seqlen: 1k, distribution: {file}}}\n"),
        );
        let text = refused_quickly(&sandbox, &["plan", "p.yaml"]);
        assert!(text.starts_with("p.yaml:4:"), "{text}");
        assert!(text.contains(&format!("{file} is {kind}")), "{text}");
        assert!(text.contains("must name a regular file"), "{text}");
    }
    // Above the limit: refused from its size, without reading it.
    let big = std::fs::File::create(sandbox.path().join("big.json")).unwrap();
    big.set_len((1 << 30) + 1).unwrap();
    sandbox.write(
        "p.yaml",
        "stages:\n  m:\n    uses: masks/generate\n    with: {mask: causal, seqlen: 1k, distribution: big.json}\n",
    );
    let text = refused_quickly(&sandbox, &["plan", "p.yaml"]);
    assert!(
        text.contains("big.json is 1.0 GiB, more than the limit of 1 GiB for a `file` parameter"),
        "{text}"
    );
    // The pipeline file itself.
    let text = refused_quickly(&sandbox, &["plan", "/dev/zero"]);
    assert!(
        text.contains("cannot read pipeline /dev/zero: it is a character device"),
        "{text}"
    );
}

#[test]
fn a_matrix_past_the_node_limit_is_refused_before_it_is_expanded() {
    // A 70 KB file of 10⁷ nodes grew past 7.5 GB before it aborted.
    let sizes: Vec<String> = (1..=1000).map(|n| n.to_string()).collect();
    let values: Vec<String> = (1..=10_000).map(|n| n.to_string()).collect();
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        &format!(
            "stages:\n  grid:\n    uses: testkit/echo\n    matrix:\n      size: [{}]\n      value: [{}]\n",
            sizes.join(", "),
            values.join(", ")
        ),
    );
    let start = std::time::Instant::now();
    let text = refused_quickly(&sandbox, &["plan", "p.yaml"]);
    assert!(
        text.contains("p.yaml:4:5: the matrix of stage `grid` has 10,000,000 nodes (size: 1000 × value: 10000), more than the limit of 1,000,000 nodes per plan"),
        "{text}"
    );
    assert!(start.elapsed().as_secs_f64() < 5.0, "{:?}", start.elapsed());
}

#[test]
fn absurd_numbers_are_refused_with_the_allowed_range() {
    // 1e300 panicked with a backtrace; 1e-12 became a zero timeout; 30 days overflowed nothing
    // here but is no timeout anyone means.
    for (timeout, shown) in [
        ("1e300", "1e+300"),
        ("1e-12", "1e-12"),
        ("30days", "30days"),
        ("-5", "-5"),
    ] {
        let text = refused(
            &format!("stages:\n  a:\n    uses: testkit/echo\n    timeout: {timeout}\n"),
            &[],
        );
        assert!(
            text.contains(&format!(
                "p.yaml:4:14: `timeout: {shown}` is outside the allowed range 1ms to 7days"
            )),
            "{text}"
        );
        assert!(!text.contains("panicked"), "{text}");
    }
    let text = refused(
        "stages:\n  a:\n    uses: testkit/echo\n    with: {size: 18446744073709551615}\n",
        &[],
    );
    assert!(
        text.contains("p.yaml:4:18: parameter `size`: `18446744073709551615` is too large: sizes may be at most 2^53"),
        "{text}"
    );
}

/// Numbers past what the machine can represent are refused or mean "no limit", never a panic.
#[test]
fn absurd_command_line_numbers_do_not_panic() {
    let sandbox = Sandbox::new();
    sandbox.write(
        "p.yaml",
        "stages:\n  a:\n    uses: testkit/echo\n    with: {value: 1}\n",
    );
    let run = sandbox.run(&["run", "p.yaml", "-q", "--time-budget", "100000000years"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let show = sandbox.run(&[
        "mask",
        "show",
        "--mask",
        "causal",
        "--seqlen",
        "4294967295",
        "--heads-q",
        "64",
    ]);
    assert!(!show.status.success(), "{}", stderr(&show));
    let text = stderr(&show);
    assert!(text.contains("do not fit in 64 bits"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}

/// Every shipped pipeline (the GPU check-up's under `pipelines/checks/` too) passes the checker against the workspace's plugins, and the GPU
/// pipelines draw their documents from LongCA-bench's published Pile histogram, not the
/// synthetic stand-in.
#[test]
fn every_shipped_pipeline_plans() {
    let sandbox = Sandbox::new();
    let dir = attnbench_tests::workspace_root().join("pipelines");
    let mut planned = 0;
    let paths = [dir.clone(), dir.join("checks")]
        .into_iter()
        .flat_map(|folder| std::fs::read_dir(folder).unwrap())
        .map(|entry| entry.unwrap().path());
    for path in paths {
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let plan = sandbox.run(&["plan", path.to_str().unwrap(), "--summary"]);
        assert!(
            plan.status.success(),
            "{}: {}",
            path.display(),
            stderr(&plan)
        );
        let name = path.file_name().unwrap().to_string_lossy();
        if [
            "dense-kernels.yaml",
            "context-parallel-gpu.yaml",
            "naive-gpu.yaml",
            "model-shapes.yaml",
        ]
        .contains(&&*name)
        {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(
                text.contains("source: ../datasets/longca-pile.yaml")
                    && text.contains("distribution: input"),
                "{name} draws its documents from the Pile histogram"
            );
        }
        planned += 1;
    }
    assert!(planned >= 10, "{planned} pipelines");
}
