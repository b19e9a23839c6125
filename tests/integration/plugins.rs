//! Plugin libraries: a third-party plugin built outside the workspace loads and runs; libraries
//! that cannot be plugins are refused in one sentence.

use attnbench_tests::{build_example_plugin, stderr, stdout, target_dir, Sandbox};

/// Checks that the refusal is one line and mentions every fragment.
fn one_sentence(output: &std::process::Output, fragments: &[&str]) {
    assert_eq!(output.status.code(), Some(2));
    let text = stderr(output);
    assert_eq!(
        text.trim_end().lines().count(),
        1,
        "one line, not a layout dump:\n{text}"
    );
    for fragment in fragments {
        assert!(text.contains(fragment), "`{fragment}` in {text}");
    }
}

/// Runs `pipeline` (written as kernel.yaml) with the plugins of `plugins/` and returns its record.
fn run_with_plugins(sandbox: &Sandbox, pipeline: &str) -> serde_json::Value {
    sandbox.write("kernel.yaml", pipeline);
    let run = sandbox
        .command(&["run", "kernel.yaml"])
        .env("ATTNBENCH_PLUGIN_PATH", sandbox.path().join("plugins"))
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", stderr(&run));
    sandbox.last_record()
}

/// The example plugin built with `features` into the sandbox's `plugins/`.
fn example_plugin(sandbox: &Sandbox, features: &[&str]) -> std::path::PathBuf {
    let plugins = sandbox.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    build_example_plugin(features, &plugins, "libexample_kernel.so")
}

#[test]
fn a_third_party_plugin_built_outside_the_workspace_runs_in_a_pipeline() {
    let sandbox = Sandbox::new();
    example_plugin(&sandbox, &[]);

    let listed = sandbox.run(&["plugins", "list", "--plugin-dir", "plugins"]);
    assert!(
        stdout(&listed).contains("example-kernel 0.3.1"),
        "{}",
        stdout(&listed)
    );

    let record = run_with_plugins(
        &sandbox,
        "name: kernel\nseed: 5\nstages:\n  attention:\n    uses: example-kernel/attention\n    matrix: {seqlen: [128, 256], causal: [false, true]}\n    with: {reps: 2}\n",
    );
    let nodes = record["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 4);
    for node in nodes {
        assert_eq!(node["status"], "ok", "{node}");
        let measurement: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(format!(
                "{}/measurement.json",
                node["artifact"].as_str().unwrap()
            ))
            .unwrap(),
        )
        .unwrap();
        assert!(
            measurement["tflops"].as_f64().unwrap() > 0.0,
            "{measurement}"
        );
        // Machine-scoped: the environment fingerprint is part of the key.
        assert!(node["key_parts"]["environment"].is_string(), "{node}");
    }
    assert_eq!(record["plugins"][0]["name"], "example-kernel");
    assert_eq!(record["plugins"][0]["version"], "0.3.1");
}

#[test]
fn a_plugin_of_another_abi_major_is_refused_in_one_sentence() {
    let sandbox = Sandbox::new();
    let foreign = build_example_plugin(&["foreign-abi-major"], sandbox.path(), "libforeign.so");
    let output = sandbox.run(&["plugins", "info", foreign.to_str().unwrap()]);
    one_sentence(
        &output,
        &[
            "built for plugin ABI 2.0.0",
            "this attnbench speaks ABI 1.2.0",
            "rebuild the plugin",
        ],
    );
}

#[test]
fn a_plugin_of_an_older_abi_minor_loads_runs_and_passes_the_conformance_suite() {
    // ABI 1.1 sent a failure's message alone; the host still loads such a plugin and runs it.
    let sandbox = Sandbox::new();
    let older = example_plugin(&sandbox, &["abi-1-1"]);
    let record = run_with_plugins(
        &sandbox,
        "name: kernel\nstages:\n  attention:\n    uses: example-kernel/attention\n    with: {seqlen: 128, reps: 2}\n",
    );
    assert_eq!(record["plugins"][0]["abi"], "1.1.0", "{record}");
    assert_eq!(record["nodes"][0]["status"], "ok", "{record}");

    let checked = sandbox.run(&["plugins", "check", older.to_str().unwrap()]);
    assert!(
        checked.status.success(),
        "{}{}",
        stdout(&checked),
        stderr(&checked)
    );
}

#[test]
fn a_library_that_is_not_a_plugin_is_refused_in_one_sentence() {
    let deps = target_dir().join("deps");
    let not_a_plugin = std::fs::read_dir(&deps)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "so") && p.to_string_lossy().contains("serde_derive")
        })
        .expect("a proc-macro shared library in target/*/deps");
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["plugins", "info", not_a_plugin.to_str().unwrap()]);
    one_sentence(
        &output,
        &["is a shared library but not an attnbench plugin"],
    );

    let junk = sandbox.write("libjunk.so", "not an ELF file");
    let output = sandbox.run(&["plugins", "info", junk.to_str().unwrap()]);
    one_sentence(&output, &["cannot load", "libjunk.so"]);

    // In a plugin directory it is skipped with its reason, and the rest still works.
    let listed = sandbox.run(&["plugins", "list", "--plugin-dir", "."]);
    assert!(stdout(&listed).contains("skipped"), "{}", stdout(&listed));
    assert!(stdout(&listed).contains("testkit"), "{}", stdout(&listed));
}

#[test]
fn a_missing_library_is_refused_in_one_sentence() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["plugins", "info", "./libnowhere.so"]);
    one_sentence(&output, &["plugin library ./libnowhere.so does not exist"]);
}

#[test]
fn plugin_info_shows_the_manifest() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["plugins", "info", "testkit"]);
    let text = stdout(&output);
    assert!(output.status.success());
    assert!(
        text.contains("testkit/echo-worker") && text.contains("isolation: worker"),
        "{text}"
    );
    let json = sandbox.run(&["plugins", "info", "testkit", "--json"]);
    let manifest: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(manifest["abi"], "1.2.0");
    let unknown = sandbox.run(&["plugins", "info", "testkid"]);
    assert!(
        stderr(&unknown).contains("did you mean `testkit`?"),
        "{}",
        stderr(&unknown)
    );
}

/// `attnbench ARGS` with `plugins` on the plugin path and the fixture's load trace going to
/// `trace`; returns attnbench's own process id with its output.
fn traced(
    sandbox: &Sandbox,
    plugins: &std::path::Path,
    trace: &std::path::Path,
    args: &[&str],
) -> (u32, std::process::Output) {
    let child = sandbox
        .command(args)
        .env("ATTNBENCH_PLUGIN_PATH", plugins)
        .env("EXAMPLE_KERNEL_LOAD_TRACE", trace)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("attnbench starts");
    let pid = child.id();
    let output = child.wait_with_output().expect("attnbench finishes");
    assert!(
        output.status.success(),
        "attnbench {args:?}: {}",
        stderr(&output)
    );
    (pid, output)
}

/// The ids of the processes that loaded the traced library so far, in order.
fn loads(trace: &std::path::Path) -> Vec<u32> {
    std::fs::read_to_string(trace)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

#[test]
fn only_running_a_stage_loads_a_plugin_library_into_attnbench() {
    let sandbox = Sandbox::new();
    let plugins = sandbox.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    // Builds with other features share the fixture's output file; this copy must be the traced one.
    let library = (0..3)
        .map(|_| build_example_plugin(&["load-trace"], &plugins, "libexample_kernel.so"))
        .find(|library| {
            let bytes = std::fs::read(library).unwrap();
            bytes
                .windows(b"EXAMPLE_KERNEL_LOAD_TRACE".len())
                .any(|w| w == b"EXAMPLE_KERNEL_LOAD_TRACE")
        })
        .expect("the fixture built with its load trace");
    let trace = sandbox.path().join("loads.txt");
    sandbox.write(
        "kernel.yaml",
        "name: kernel\nseed: 5\nstages:\n  attention:\n    uses: example-kernel/attention\n    with: {seqlen: 64, reps: 1}\n",
    );

    // A library not seen before is read by a helper process, never by attnbench itself.
    let (pid, planned) = traced(&sandbox, &plugins, &trace, &["plan", "kernel.yaml"]);
    assert!(
        stdout(&planned).contains("example-kernel/attention"),
        "{}",
        stdout(&planned)
    );
    let first = loads(&trace);
    assert!(
        !first.contains(&pid),
        "`plan` ran the plugin's initialiser in its own process ({pid}): {first:?}"
    );
    assert_eq!(first.len(), 1, "one helper read the manifest: {first:?}");

    // Known now: commands that only need manifests, or another plugin, never load it.
    for args in [
        &["plan", "kernel.yaml"][..],
        &["run", "kernel.yaml", "--dry-run"],
        &["explain", "kernel.yaml", "attention"],
        &["plugins", "list"],
        &["plugins", "info", "example-kernel"],
        &["mask", "show", "--mask", "causal", "--seqlen", "1k"],
    ] {
        traced(&sandbox, &plugins, &trace, args);
        assert_eq!(
            loads(&trace),
            first,
            "`attnbench {}` loaded it",
            args.join(" ")
        );
    }

    // Other bytes (a rebuild) are another key: the manifest is read afresh, again outside.
    let mut bytes = std::fs::read(&library).unwrap();
    bytes.extend_from_slice(b"rebuilt");
    std::fs::write(&library, bytes).unwrap();
    let (pid, _) = traced(&sandbox, &plugins, &trace, &["plan", "kernel.yaml"]);
    let second = loads(&trace);
    assert_eq!(
        second.len(),
        2,
        "a changed library is read again: {second:?}"
    );
    assert!(!second.contains(&pid), "{second:?}");

    // Running its in-process stage loads it, in attnbench's own process.
    let (pid, _) = traced(&sandbox, &plugins, &trace, &["run", "kernel.yaml"]);
    assert_eq!(sandbox.statuses()["attention"], "ok");
    assert_eq!(loads(&trace)[2..], [pid], "run loaded it once, itself");
}
