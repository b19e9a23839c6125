//! The checker on whole pipeline texts, over plugins known by their manifests alone: what a valid
//! file becomes, and that each kind of mistake is reported at its place, all of them at once.

use std::path::Path;

use super::*;
use crate::plan::tests::registry;

const VALID: &str = "
seed: 7
defaults: {seqlen: 2k}
stages:
  report:
    uses: bench/report
    needs: {run: all}
  run:
    uses: bench/run
    needs: [masks]
    timeout: 90s
  masks:
    uses: gen/masks
    matrix: {mask: [full, causal]}
";

fn parse_with(text: &str, overrides: &[&str]) -> Result<Pipeline, PipelineError> {
    let overrides: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
    parse(Path::new("dir/test.yaml"), text, &overrides, &registry())
}

/// The problems of an invalid text, each rendered as the user sees it.
fn problems(text: &str, overrides: &[&str]) -> Vec<Diagnostic> {
    match parse_with(text, overrides) {
        Err(PipelineError::Invalid(problems)) => problems,
        Err(other) => panic!("not a validation error: {other}"),
        Ok(pipeline) => panic!("accepted: {:?}", pipeline.stages.len()),
    }
}

/// The one problem of `text`, as `line:column: message`.
fn only_problem(text: &str) -> String {
    let found = problems(text, &[]);
    assert_eq!(found.len(), 1, "{found:#?}");
    match &found[0].origin {
        Origin::File { line, column, .. } => format!("{line}:{column}: {}", found[0].message),
        other => panic!("not placed in the file: {other}"),
    }
}

#[test]
fn a_valid_file_becomes_stages_in_dependency_order_with_its_defaults() {
    let pipeline = parse_with(VALID, &[]).unwrap();
    // No `name`: the file's stem.
    assert_eq!((pipeline.name.as_str(), pipeline.seed), ("test", 7));
    let names: Vec<&str> = pipeline.stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["masks", "run", "report"]);
    let [masks, run, report] = &pipeline.stages[..] else {
        unreachable!()
    };
    // `needs: [masks]` fans out (one run node per mask node); `{run: all}` collects.
    assert_eq!(
        (run.fan_out.clone(), run.collect.clone()),
        (vec![0], vec![])
    );
    assert_eq!(
        (report.fan_out.clone(), report.collect.clone()),
        (vec![], vec![1])
    );
    assert_eq!(run.timeout, Some(Duration::from_secs(90)));
    // A default reaches every stage that declares the parameter, as canonical tokens.
    assert_eq!(masks.params.get("seqlen"), Some(&serde_json::json!(2048)));
    assert_eq!(run.params.get("seqlen"), Some(&serde_json::json!(2048)));
    assert_eq!(run.params.get("kernel"), Some(&serde_json::json!("a")));
    assert_eq!(masks.matrix[0].0, "mask");
}

#[test]
fn every_problem_of_a_file_is_reported_at_once_each_at_its_line() {
    let text = "
name: 3
seed: -1
stagse: {}
defaults: {seqlne: 1k}
stages:
  masks:
    uses: gen/masks
";
    let found = problems(text, &[]);
    let lines: Vec<String> = found
        .iter()
        .map(|d| match &d.origin {
            Origin::File { line, .. } => format!("{line}: {}", d.message),
            other => format!("{other}: {}", d.message),
        })
        .collect();
    assert_eq!(
        lines,
        [
            "4: unknown key `stagse` in the pipeline",
            "2: `name` must be a string",
            "3: `seed` must be a non-negative integer, found -1",
            "5: default `seqlne` is a parameter of none of the stages",
        ]
    );
    assert_eq!(found[0].hint.as_deref(), Some("did you mean `stages`?"));
    assert_eq!(found[3].hint.as_deref(), Some("did you mean `seqlen`?"));
    let rendered = PipelineError::Invalid(found).to_string();
    assert!(
        rendered.starts_with("dir/test.yaml:4:1: unknown key `stagse`"),
        "{rendered}"
    );
    assert!(
        rendered.ends_with("4 problems in the pipeline; nothing was run"),
        "{rendered}"
    );
}

#[test]
fn a_file_without_stages_says_what_to_add() {
    for text in ["name: t\n", "stages: {}\n", ""] {
        let found = problems(text, &[]);
        assert_eq!(found.len(), 1, "{text:?}: {found:#?}");
        assert_eq!(found[0].message, "the pipeline has no stages");
        assert!(found[0]
            .hint
            .as_deref()
            .unwrap()
            .contains("uses: plugin/stage"));
    }
    let list = problems("- one\n- two\n", &[]);
    assert_eq!(
        list[0].message,
        "a pipeline must be a mapping with `stages`"
    );
    assert_eq!(
        only_problem("stages: [masks]\n"),
        "1:9: `stages` must be a mapping of stage names to stages"
    );
}

#[test]
fn needs_name_stages_of_this_pipeline_once_and_never_the_stage_itself() {
    let base = "stages:\n  masks: {uses: gen/masks}\n  run:\n    uses: bench/run\n";
    assert_eq!(
        only_problem(&format!("{base}    needs: [maks]\n")),
        "5:13: stage `run` needs `maks`, which is not a stage of this pipeline"
    );
    assert_eq!(
        only_problem(&format!("{base}    needs: run\n")),
        "5:12: stage `run` needs itself"
    );
    assert_eq!(
        only_problem(&format!("{base}    needs: [masks, masks]\n")),
        "5:20: `masks` appears twice in the `needs` of `run`"
    );
    assert_eq!(
        only_problem(&format!("{base}    needs: {{masks: some}}\n")),
        "5:20: `masks: \"some\"` must be `all` (collect every node) or `each` (one node per upstream node)"
    );
    let unknown = problems(&format!("{base}    needs: [maks]\n"), &[]);
    assert_eq!(unknown[0].hint.as_deref(), Some("did you mean `masks`?"));
}

#[test]
fn a_cycle_of_needs_is_named_stage_by_stage() {
    let text = "
stages:
  masks: {uses: gen/masks}
  a: {uses: bench/run, needs: [masks, b]}
  b: {uses: bench/run, needs: [a]}
";
    let found = problems(text, &[]);
    assert_eq!(found.len(), 1, "{found:#?}");
    let message = &found[0].message;
    assert!(
        message == "the stages depend on each other in a cycle: a → b → a"
            || message == "the stages depend on each other in a cycle: b → a → b",
        "{message}"
    );
}

#[test]
fn uses_must_name_an_installed_plugin_and_one_of_its_stages() {
    assert_eq!(
        only_problem("stages:\n  m: {uses: gen}\n"),
        "2:13: `uses: gen` must name a plugin and a stage as `plugin/stage`"
    );
    let unknown_plugin = problems("stages:\n  m: {uses: gne/masks}\n", &[]);
    assert_eq!(unknown_plugin[0].message, "unknown plugin `gne`");
    assert_eq!(
        unknown_plugin[0].hint.as_deref(),
        Some("did you mean `gen`?")
    );
    let unknown_stage = problems("stages:\n  m: {uses: gen/mask}\n", &[]);
    assert_eq!(unknown_stage[0].message, "plugin `gen` has no stage `mask`");
    assert_eq!(
        unknown_stage[0].hint.as_deref(),
        Some("did you mean `masks`?")
    );
    assert_eq!(
        only_problem("stages:\n  m: {with: {}}\n"),
        "2:3: stage `m` has no `uses`"
    );
}

#[test]
fn parameters_and_matrices_are_checked_against_the_manifest() {
    let base = "stages:\n  masks:\n    uses: gen/masks\n";
    let wrong_type = problems(&format!("{base}    with: {{seqlen: lots}}\n"), &[]);
    assert_eq!(wrong_type.len(), 1, "{wrong_type:#?}");
    assert!(
        wrong_type[0].message.starts_with("parameter `seqlen`: "),
        "{}",
        wrong_type[0].message
    );
    assert_eq!(
        only_problem(&format!("{base}    matrix: {{mask: []}}\n")),
        "4:20: matrix entry `mask` is empty, so the stage would have no nodes"
    );
    assert_eq!(
        only_problem(&format!("{base}    matrix: {{mask: full}}\n")),
        "4:20: matrix entry `mask` must be a list of values"
    );
    assert_eq!(
        only_problem(&format!("{base}    matrix: {{mask: [full, full]}}\n")),
        "4:27: matrix entry `mask` repeats the value \"full\""
    );
    let both = problems(
        &format!("{base}    with: {{mask: full}}\n    matrix: {{mask: [causal]}}\n"),
        &[],
    );
    assert_eq!(
        both[0].message,
        "`mask` is set both in `with` and in `matrix`"
    );
    let timeout = problems(&format!("{base}    timeout: soon\n"), &[]);
    assert!(
        timeout[0]
            .message
            .starts_with("`timeout: soon` is not a duration"),
        "{}",
        timeout[0].message
    );
}

#[test]
fn a_problem_an_override_made_points_at_the_option_not_the_file() {
    let found = problems(VALID, &["stages.masks.matrix.mask=[]"]);
    assert_eq!(found.len(), 1, "{found:#?}");
    assert_eq!(
        found[0].origin,
        Origin::Override("stages.masks.matrix.mask=[]".into())
    );
    // The same override with a value the manifest takes: the file is valid again.
    let pipeline = parse_with(VALID, &["stages.masks.matrix.mask=[causal]"]).unwrap();
    assert_eq!(
        pipeline.stages[0].matrix[0].1,
        vec![serde_json::json!("causal")]
    );
}

#[test]
fn a_file_parameter_is_hashed_and_a_missing_one_says_where_paths_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("pile.json"), "{}").unwrap();
    let file = dir.path().join("p.yaml");
    let text = |source: &str| {
        format!("stages:\n  masks:\n    uses: gen/masks\n    with: {{source: {source}}}\n")
    };
    let pipeline = parse(&file, &text("./pile.json"), &[], &registry()).unwrap();
    let resolved = pipeline.stages[0].params["source"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        resolved.ends_with("/pile.json") && !resolved.contains("./"),
        "{resolved}"
    );
    assert_eq!(
        pipeline.file_digests.get(&resolved),
        Some(&blake3::hash(b"{}").to_hex().to_string())
    );
    let problems = |source: &str| match parse(&file, &text(source), &[], &registry()) {
        Err(PipelineError::Invalid(problems)) => problems,
        other => panic!("{source}: {other:?}"),
    };
    let missing = problems("./pil.json");
    assert!(
        missing[0]
            .message
            .starts_with("parameter `source` of stage `masks`: cannot read "),
        "{}",
        missing[0].message
    );
    let hint = missing[0].hint.as_deref();
    assert_eq!(
        hint,
        Some("paths are relative to the pipeline file's folder")
    );
    // A directory is named as such, with no hint about folders: the path was found.
    let folder = problems("./");
    assert!(
        folder[0].message.contains("is a directory"),
        "{}",
        folder[0].message
    );
    assert_eq!(folder[0].hint, None);
}
