//! One rank of a context-parallel job: `attnbench-cp-rank JOB.json`, started by the `cp` stage's
//! `processes` backend, or by srun / mpirun / torchrun across machines.

use std::process::ExitCode;

fn main() -> ExitCode {
    let Some(job) = std::env::args_os().nth(1) else {
        eprintln!("usage: attnbench-cp-rank JOB.json   (rank and world from RANK/WORLD_SIZE, Slurm, MPI or torchrun)");
        return ExitCode::from(2);
    };
    match attnbench_cp::rank_main(std::path::Path::new(&job)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("attnbench-cp-rank: {err}");
            ExitCode::FAILURE
        }
    }
}
