//! Without a GPU (here and in CI) the cuda plugin still loads, doctor says where it looked for a
//! driver, and GPU stages fail with one sentence. (On a GPU machine, scripts/gpu-check.sh runs
//! the real thing.)

use attnbench_tests::{stderr, stdout, Sandbox};

fn has_driver() -> bool {
    [
        "/usr/local/nvidia/lib64",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
    ]
    .iter()
    .any(|dir| {
        std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("libcuda.so"))
            })
            .unwrap_or(false)
    })
}

#[test]
fn without_a_gpu_the_cuda_plugin_loads_and_refuses_in_one_sentence() {
    if has_driver() {
        eprintln!("an NVIDIA driver is installed here; this test covers machines without one");
        return;
    }
    let sandbox = Sandbox::new();
    let listed = sandbox.run(&["plugins", "list"]);
    assert!(stdout(&listed).contains("cuda "), "{}", stdout(&listed));

    let doctor = sandbox.run(&["doctor"]);
    let text = stdout(&doctor);
    assert!(doctor.status.success());
    assert!(text.contains("gpu: no NVIDIA driver found"), "{text}");
    assert!(
        text.contains("(searched "),
        "doctor says where it looked: {text}"
    );
    assert!(
        text.contains("python backends"),
        "doctor says which Python backends import: {text}"
    );
    assert!(
        text.contains("flash_attn: not importable") || text.contains("  flash_attn "),
        "{text}"
    );

    sandbox.write("g.yaml", "stages:\n  masks:\n    uses: masks/generate\n    with: {mask: causal, seqlen: 1k}\n  gemm:\n    uses: cuda/gemm\n  bench:\n    uses: cuda/benchmark\n    needs: [masks]\n  links:\n    uses: cp/links\n  ring:\n    uses: cp/threads\n    needs: [masks]\n    with: {backend: nccl, attention: cuda/flash, world: 2, heads_q: 8, heads_kv: 2, head_dim: 128}\n");
    let run = sandbox.run(&["run", "g.yaml"]);
    assert_eq!(run.status.code(), Some(1), "{}", stderr(&run));
    let record = sandbox.last_record();
    for id in ["gemm", "bench", "links", "ring"] {
        let node = record["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == id)
            .unwrap();
        assert_eq!(node["status"], "error", "{node}");
        let error = node["error"].as_str().unwrap();
        // A GPU rank's error comes with which rank said it.
        let error = error
            .strip_prefix("rank 0 exit status: 1: attnbench-cp-rank: ")
            .unwrap_or(error);
        assert!(error.starts_with("this stage needs a GPU, but the NVIDIA driver library (libcuda.so) could not be loaded"), "{error}");
        assert_eq!(error.lines().count(), 1, "{error}");
    }
}

#[test]
fn every_cuda_kernel_source_compiles_with_nvrtc_for_hopper() {
    let python = attnbench_tests::python_with_nvrtc();
    let root = attnbench_tests::workspace_root();
    let mut sources: Vec<_> = ["plugins/cuda/kernels", "plugins/cp/kernels"]
        .iter()
        .flat_map(|dir| std::fs::read_dir(root.join(dir)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    assert!(sources.len() >= 3, "{sources:?}");
    // sm_90a as the plugin compiles for Hopper (its wgmma kernels), sm_90 as any other target
    // sees the same file without them.
    for arch in ["sm_90", "sm_90a"] {
        let output = std::process::Command::new(&python)
            .arg(root.join("scripts/nvrtc-check.py"))
            .args(["--arch", arch])
            .args(&sources)
            .output()
            .expect("python runs");
        let text = stdout(&output);
        assert!(output.status.success(), "{text}\n{}", stderr(&output));
        for source in &sources {
            assert!(
                text.contains(&format!("{}: compiles for {arch}", source.display())),
                "{text}"
            );
        }
    }
}
