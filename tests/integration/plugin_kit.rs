//! The plugin authoring kit: a scaffolded plugin builds, is found, passes its own test and the
//! conformance suite; the suite catches a kernel that is wrong.

use attnbench_tests::{
    cargo_outside, python_with_numpy, stderr, stdout, target_dir, workspace_root, Sandbox,
};

fn scaffold(sandbox: &Sandbox, name: &str, kind: &str) -> std::path::PathBuf {
    let sdk = workspace_root().join("core/sdk");
    let output = sandbox.run(&[
        "plugin",
        "new",
        name,
        "--kind",
        kind,
        "--path",
        ".",
        "--sdk",
        sdk.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        stdout(&output).contains("plugins check"),
        "it says what to do next: {}",
        stdout(&output)
    );
    sandbox.path().join(name)
}

#[test]
fn a_scaffolded_kernel_plugin_builds_tests_and_passes_the_conformance_suite() {
    let sandbox = Sandbox::new();
    let crate_dir = scaffold(&sandbox, "my-kernel", "kernel");
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
    assert!(
        manifest.contains("attnbench-sdk") && !manifest.contains("abi_stable"),
        "{manifest}"
    );
    let target = cargo_outside(&crate_dir, &["build"]);
    cargo_outside(&crate_dir, &["test"]);
    let library = sandbox.path().join("libmy_kernel.so");
    std::fs::copy(target.join("debug/libmy_kernel.so"), &library).unwrap();

    let listed = sandbox.run(&["plugins", "list", "--plugin-dir", "."]);
    assert!(stdout(&listed).contains("my-kernel"), "{}", stdout(&listed));
    let checked = sandbox.run(&["plugins", "check", library.to_str().unwrap()]);
    assert!(
        checked.status.success(),
        "{}\n{}",
        stdout(&checked),
        stderr(&checked)
    );
    let text = stdout(&checked);
    assert!(
        text.contains("pass attention: causal_document: matches the reference"),
        "{text}"
    );
    assert!(
        text.contains("no backward"),
        "the forward-only kernel says so for bwd: {text}"
    );
}

#[test]
fn a_scaffolded_stage_plugin_builds_and_passes() {
    let sandbox = Sandbox::new();
    let crate_dir = scaffold(&sandbox, "my-stage", "stage");
    let target = cargo_outside(&crate_dir, &["build"]);
    let library = sandbox.path().join("libmy_stage.so");
    std::fs::copy(target.join("debug/libmy_stage.so"), &library).unwrap();
    let checked = sandbox.run(&["plugins", "check", library.to_str().unwrap(), "--json"]);
    assert!(checked.status.success(), "{}", stdout(&checked));
    let reports: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    assert_eq!(reports[0]["plugin"], "my-stage");
    assert!(reports[0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["passed"] == true));
}

#[test]
fn the_conformance_suite_catches_a_wrong_kernel() {
    let sandbox = Sandbox::new();
    let testkit = target_dir().join("libattnbench_testkit.so");
    let checked = sandbox.run(&["plugins", "check", testkit.to_str().unwrap(), "--json"]);
    assert_eq!(checked.status.code(), Some(1), "a failed check exits 1");
    let reports: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    let checks = reports[0]["checks"].as_array().unwrap();
    let find = |name: &str| {
        checks
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("{name} in {checks:?}"))
    };
    assert_eq!(find("wrong-kernel: causal")["passed"], false);
    assert!(find("wrong-kernel: causal")["detail"]
        .as_str()
        .unwrap()
        .contains("differs from the reference"));
    assert!(find("wrong-kernel: full")["detail"]
        .as_str()
        .unwrap()
        .contains("must be `unsupported`"));
    assert_eq!(find("echo: rejects bad parameters")["passed"], true);
}

#[test]
fn bad_names_and_places_are_refused() {
    let sandbox = Sandbox::new();
    let output = sandbox.run(&["plugin", "new", "9lives"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        stderr(&output).contains("is not a plugin name"),
        "{}",
        stderr(&output)
    );
    std::fs::create_dir(sandbox.path().join("taken")).unwrap();
    let output = sandbox.run(&["plugin", "new", "taken", "--path", "."]);
    assert!(
        stderr(&output).contains("already exists"),
        "{}",
        stderr(&output)
    );
}

/// On an interpreter without numpy, the Python plugin's default kernel cannot run here at all:
/// the suite skips its mask checks with the import's error instead of failing every pattern.
#[test]
fn a_python_without_numpy_skips_the_kernel_checks_with_the_reason() {
    let sandbox = Sandbox::new();
    // -S leaves site-packages out, so the tests' numpy is not importable.
    let bare = sandbox.write(
        "bare-python",
        &format!(
            "#!/bin/sh\nexec '{}' -S \"$@\"\n",
            python_with_numpy().display()
        ),
    );
    std::fs::set_permissions(&bare, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let checked = sandbox
        .command(&["plugins", "check", "python", "--json"])
        .env("ATTNBENCH_PYTHON", &bare)
        .output()
        .unwrap();
    assert!(checked.status.success(), "{}", stdout(&checked));
    let reports: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    let checks = reports[0]["checks"].as_array().unwrap();
    let skipped: Vec<_> = checks.iter().filter(|c| c["skipped"] == true).collect();
    assert_eq!(skipped.len(), 1, "{checks:?}");
    assert_eq!(skipped[0]["name"], "benchmark: every mask pattern");
    let reason = skipped[0]["detail"].as_str().unwrap();
    assert!(reason.contains("numpy not importable"), "{reason}");
    assert!(checks.iter().all(|c| c["passed"] == true), "{checks:?}");
}

/// Every first-party plugin passes its own conformance suite on this machine: the CP plugin's
/// kernel stage writes its gathered outputs for the check, the Python plugin's default kernel
/// (numpy) runs on the tests' interpreter, and the GPU plugin's kernel checks are skipped with the
/// reason on a machine without a GPU (and run, and pass, on one with a GPU).
#[test]
fn first_party_plugins_pass_the_conformance_suite() {
    const FIRST_PARTY: [&str; 7] = ["masks", "datasets", "cpu", "python", "cp", "report", "cuda"];
    let sandbox = Sandbox::new();
    let mut args = vec!["plugins", "check"];
    args.extend(FIRST_PARTY);
    args.push("--json");
    let checked = sandbox
        .command(&args)
        .env("ATTNBENCH_PYTHON", python_with_numpy())
        .output()
        .unwrap();
    assert!(checked.status.success(), "{}", stdout(&checked));
    let reports: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    let checks = |plugin: &str| -> Vec<serde_json::Value> {
        let report = reports
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["plugin"] == plugin);
        report.unwrap_or_else(|| panic!("{plugin} in {reports}"))["checks"]
            .as_array()
            .unwrap()
            .clone()
    };
    for plugin in FIRST_PARTY {
        let checks = checks(plugin);
        assert!(checks.len() >= 3, "{plugin}: {checks:?}");
        assert!(
            checks.iter().all(|c| c["passed"] == true),
            "{plugin}: {checks:?}"
        );
    }
    // The kernels that run here are checked against the reference, not skipped.
    for (plugin, check) in [("python", "benchmark: causal"), ("cp", "threads: causal")] {
        let checks = checks(plugin);
        let causal = checks.iter().find(|c| c["name"] == check);
        let detail = causal.map(|c| c["detail"].as_str().unwrap_or_default());
        assert!(
            detail.is_some_and(|d| d.contains("matches the reference")),
            "{plugin}: {causal:?}"
        );
    }
    for check in checks("cuda") {
        assert_eq!(check["passed"], true, "{check}");
        if check["skipped"] == true {
            assert!(
                check["detail"].as_str().unwrap().contains("needs a GPU"),
                "{check}"
            );
        }
    }
}
