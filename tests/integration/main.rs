//! The integration tests, one binary with a module per area: each drives the real `attnbench`
//! binary, real plugin libraries and real worker processes (helpers in `attnbench_tests`).

mod cache;
mod cache_common;
mod cache_transfer;
mod context_parallel;
mod datasets;
mod decode;
mod faults;
mod gpu;
mod plugin_kit;
mod plugins;
mod python;
mod quickstart;
mod report;
mod scheduling;
mod shapes;
mod slurm;
mod sparse;
mod validation;
