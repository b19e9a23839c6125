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
