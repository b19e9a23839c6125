use serde_json::json;

use super::*;

fn harness() -> Value {
    json!({"timer": "wall", "warmup_reps": 1, "warmup_s": 0.0, "min_reps": 1, "max_reps": 1,
           "max_time_s": 1.0, "target_rel_ci": 0.01})
}

/// A version-1 record: everything beside the result in one `environment` map.
fn version_one(environment: Value) -> Value {
    json!({
        "kernel": "cuda-flash", "plugin": "cuda", "plugin_version": "0.1.0",
        "mask": {"pattern": "causal", "seqlen": 1024, "area": 1, "documents": 1, "params": {}},
        "shape": {"batch": 1, "heads_q": 4, "heads_kv": 2, "head_dim": 64, "dtype": "bf16"},
        "direction": "fwd", "status": "ok", "flops": 10, "harness": harness(),
        "environment": environment,
    })
}

fn machine() -> Value {
    json!({"os": "linux", "arch": "x86_64", "kernel": "6.1", "cpu": "c", "logical_cpus": 2,
           "memory_bytes": 1, "attnbench_version": "0.1.0", "gpus": ["NVIDIA H200 (driver 580)"]})
}

fn with(mut base: Value, extra: Value) -> Value {
    for (key, value) in extra.as_object().unwrap() {
        base[key] = value.clone();
    }
    base
}

#[test]
fn a_written_record_reads_back_the_same() {
    let record: Measurement = serde_json::from_value(version_one(with(
        machine(),
        json!({"gpu": "NVIDIA H200", "compute_capability": "9.0", "driver_version": 13000,
               "flash_forward": "wgmma", "phases": {"upload_s": 0.5}}),
    )))
    .unwrap();
    // Records written before `unsupported_scope` existed read as saying nothing about it.
    assert_eq!(record.unsupported_scope, None);
    let written = serde_json::to_value(Measurement {
        record_version: RECORD_VERSION,
        unsupported_scope: Some(UnsupportedScope::Machine),
        ..record.clone()
    })
    .unwrap();
    assert_eq!(written["record_version"], RECORD_VERSION);
    assert_eq!(written["unsupported_scope"], "machine");
    assert!(written.get("environment").is_none(), "{written}");
    let back: Measurement = serde_json::from_value(written).unwrap();
    assert_eq!(back.machine, record.machine);
    assert_eq!(back.unsupported_scope, Some(UnsupportedScope::Machine));
    assert_eq!(
        (back.gpu, back.phases, back.details),
        (record.gpu, record.phases, record.details)
    );
}

#[test]
fn a_version_one_gpu_record_splits_into_machine_gpu_phases_and_details() {
    let record: Measurement = serde_json::from_value(version_one(with(
        machine(),
        json!({"gpu": "NVIDIA H200", "compute_capability": "9.0", "memory_bytes_gpu": 5,
               "multiprocessors": 132, "l2_bytes": 62914560, "driver_version": 13000,
               "libraries": ["libcuda.so.1"], "clocks_before": {"sm_mhz": 1980},
               "flash_forward": "wgmma", "phases": {"upload_s": 0.5}}),
    )))
    .unwrap();
    assert_eq!(record.record_version, 1);
    // Version 1's shape held the dtype and a batch, and no length (the mask's).
    assert_eq!(
        (record.shape.heads_q, record.shape.seqlen, record.dtype),
        (4, 1024, crate::reference::Element::Bf16)
    );
    assert_eq!(record.machine.cpu, "c");
    assert_eq!(record.machine.gpus, ["NVIDIA H200 (driver 580)"]);
    let gpu = record.gpu.as_ref().expect("the cuda plugin's GPU keys");
    assert_eq!(
        (gpu.name.as_str(), gpu.compute_capability.as_str()),
        ("NVIDIA H200", "9.0")
    );
    assert_eq!(
        (gpu.multiprocessors, gpu.l2_bytes),
        (Some(132), Some(62914560))
    );
    assert_eq!(gpu.driver_version.as_deref(), Some("13000"));
    assert_eq!(gpu.clocks_before["sm_mhz"], 1980);
    assert_eq!(record.phases["upload_s"], 0.5);
    assert_eq!(record.details["flash_forward"], "wgmma");
    assert_eq!(record.details["memory_bytes_gpu"], 5);
    assert!(!record.details.contains_key("gpu"), "{:?}", record.details);
    let software = record.software();
    assert!(
        software.contains(&("gpu", "NVIDIA H200".to_string())),
        "{software:?}"
    );
    assert!(
        software.contains(&("driver_version", "13000".to_string())),
        "{software:?}"
    );
}

#[test]
fn a_version_one_python_record_finds_its_gpu_by_device() {
    let record: Measurement = serde_json::from_value(version_one(with(
        machine(),
        json!({"device": "cuda:0", "device_name": "NVIDIA H200", "capability": "9.0",
               "torch": "2.11", "python": {"version": "3.12"}}),
    )))
    .unwrap();
    assert_eq!(
        record.gpu.as_ref().map(|g| g.name.as_str()),
        Some("NVIDIA H200")
    );
    assert_eq!(record.details["torch"], "2.11");
    assert!(record.software().iter().any(|(key, _)| *key == "python"));
    let on_cpu: Measurement =
        serde_json::from_value(version_one(with(machine(), json!({"device": "cpu"})))).unwrap();
    assert!(on_cpu.gpu.is_none());
}

#[test]
fn version_one_context_parallel_runs_read_as_ranks() {
    let threads: Measurement = serde_json::from_value(version_one(with(
        machine(),
        json!({"context_parallel": {
            "method": "ring_p2p", "world": 2, "ulysses": 1, "ring": 2, "windows": 1,
            "placement": "ring_inner", "backend": "threads", "attention": "builtin",
            "launcher": "threads", "throughput": "per rank",
            "bytes_sent_forward": [8, 8], "formula_forward": 8,
            "bytes_sent_backward": [16, 16], "formula_backward": 16,
            "forward_s_per_rank": [0.1, 0.2], "backward_s_per_rank": [0.3, 0.4]}}),
    )))
    .unwrap();
    let cp = threads.cp.expect("a CP section");
    assert_eq!(cp.ranks.len(), 2);
    assert_eq!(cp.ranks[1].forward.total_s, Some(0.2));
    assert_eq!(cp.ranks[0].backward.total_s, Some(0.3));
    assert_eq!(
        cp.cell(),
        json!([
            "ring_p2p",
            2,
            1,
            2,
            1,
            "ring_inner",
            "zigzag",
            "threads",
            "builtin"
        ])
    );

    let nccl: Measurement = serde_json::from_value(version_one(with(
        machine(),
        json!({"context_parallel": {
            "method": "ulysses", "world": 2, "ulysses": 2, "ring": 1, "windows": 1,
            "placement": "ring_inner", "backend": "nccl", "attention": "cuda/flash",
            "launcher": "processes", "throughput": "per GPU", "devices": ["a", "b"],
            "bytes_sent_forward": [8, 8], "formula_forward": 8,
            "bytes_sent_backward": [16, 16], "formula_backward": 16,
            "ranks": [{"device": "a", "forward": {"total_s": 0.1, "kernels_s": 0.05},
                       "backward": {"total_s": 0.2}},
                      {"device": "b", "forward": {"total_s": 0.1}, "backward": {"total_s": 0.2}}]}}),
    )))
    .unwrap();
    let cp = nccl.cp.expect("a CP section");
    assert_eq!(cp.ranks[0].device.as_deref(), Some("a"));
    assert_eq!(cp.ranks[0].forward.kernels_s, Some(0.05));
}

#[test]
fn a_record_of_a_newer_layout_is_refused_with_what_to_do() {
    let mut newer = version_one(machine());
    newer["record_version"] = json!(RECORD_VERSION + 1);
    let error = serde_json::from_value::<Measurement>(newer)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("newer") && error.contains("upgrade attnbench"),
        "{error}"
    );
}
