//! Who this process is among the ranks of a multi-process run, from the variables the usual
//! launchers set: torchrun-style (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`; attnbench's own local launcher sets these too), Open MPI
//! (`OMPI_COMM_WORLD_RANK`, …), MPICH/Intel MPI (`PMI_RANK`, `PMI_SIZE`) and Slurm
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the job's node list). Rank 0's host is
//! where everyone meets: `MASTER_ADDR`, or under Slurm the first node of the job.

use std::collections::HashMap;

/// The default port of the meeting point when no launcher names one.
pub const DEFAULT_PORT: u16 = 29517;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankInfo {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Which launcher's variables were used.
    pub source: &'static str,
}

/// The first host of a Slurm node list: `node[03-05,09],gpu7` → `node03`.
pub fn first_host(nodelist: &str) -> Option<String> {
    let first = nodelist.trim();
    if first.is_empty() {
        return None;
    }
    let bracket = first.find('[');
    let comma = first.find(',');
    match (bracket, comma) {
        (Some(open), comma) if comma.is_none_or(|c| open < c) => {
            let prefix = &first[..open];
            let inside = &first[open + 1..first[open..].find(']')? + open];
            let range = inside.split(',').next()?;
            let start = range.split('-').next()?;
            Some(format!("{prefix}{start}"))
        }
        (_, Some(comma)) => Some(first[..comma].to_string()),
        _ => Some(first.to_string()),
    }
}

/// Why this process's launcher variables name no rank.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum LauncherError {
    #[error("{name}={value} is not a number")]
    NotANumber { name: &'static str, value: String },
    #[error("MASTER_PORT={0} is not a port")]
    NotAPort(String),
    #[error("{launcher}: rank {rank} of {world} ranks")]
    RankOutOfRange {
        launcher: &'static str,
        rank: usize,
        world: usize,
    },
    #[error("no launcher variables found: set RANK and WORLD_SIZE (with MASTER_ADDR and MASTER_PORT), or start the ranks with srun, mpirun or torchrun")]
    Missing,
}

impl RankInfo {
    /// From this process's environment.
    pub fn from_env() -> Result<RankInfo, LauncherError> {
        RankInfo::from_vars(&std::env::vars().collect())
    }

    pub fn from_vars(vars: &HashMap<String, String>) -> Result<RankInfo, LauncherError> {
        let get = |name: &str| vars.get(name).map(String::as_str);
        let number = |name: &'static str| -> Result<Option<usize>, LauncherError> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| LauncherError::NotANumber {
                            name,
                            value: v.to_string(),
                        })
                })
                .transpose()
        };
        let launchers: [(&'static str, [&str; 3]); 4] = [
            ("torchrun", ["RANK", "WORLD_SIZE", "LOCAL_RANK"]),
            (
                "Open MPI",
                [
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                ],
            ),
            ("MPI (PMI)", ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"]),
            ("Slurm", ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]),
        ];
        for (source, [rank, world, local]) in launchers {
            let (Some(rank), Some(world)) = (number(rank)?, number(world)?) else {
                continue;
            };
            if world == 0 || rank >= world {
                return Err(LauncherError::RankOutOfRange {
                    launcher: source,
                    rank,
                    world,
                });
            }
            let slurm_host = || {
                get("SLURM_JOB_NODELIST")
                    .or(get("SLURM_NODELIST"))
                    .and_then(first_host)
            };
            let master_addr = get("MASTER_ADDR")
                .map(String::from)
                .or_else(|| (source == "Slurm").then(slurm_host).flatten())
                .unwrap_or_else(|| "127.0.0.1".into());
            let master_port = match get("MASTER_PORT") {
                Some(port) => port
                    .trim()
                    .parse()
                    .map_err(|_| LauncherError::NotAPort(port.to_string()))?,
                None => DEFAULT_PORT,
            };
            return Ok(RankInfo {
                rank,
                world,
                local_rank: number(local)?.unwrap_or(0),
                master_addr,
                master_port,
                source,
            });
        }
        Err(LauncherError::Missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn each_launcher_is_understood() {
        let torchrun = RankInfo::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (
                torchrun.rank,
                torchrun.world,
                torchrun.master_addr.as_str(),
                torchrun.master_port
            ),
            (3, 8, "10.0.0.1", 1234)
        );
        let slurm = RankInfo::from_vars(&vars(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ]))
        .unwrap();
        assert_eq!(
            (
                slurm.rank,
                slurm.world,
                slurm.local_rank,
                slurm.master_addr.as_str(),
                slurm.master_port,
                slurm.source
            ),
            (9, 16, 1, "gpu07", DEFAULT_PORT, "Slurm")
        );
        let mpi = RankInfo::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "9"),
        ]))
        .unwrap();
        assert_eq!((mpi.rank, mpi.world, mpi.source), (0, 2, "Open MPI"));
    }

    #[test]
    fn nonsense_is_one_sentence() {
        let error = RankInfo::from_vars(&vars(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert_eq!(error.to_string(), "torchrun: rank 4 of 4 ranks");
        let error = RankInfo::from_vars(&vars(&[])).unwrap_err();
        assert_eq!(error, LauncherError::Missing);
        assert!(error.to_string().contains("srun, mpirun or torchrun"));
        let error = RankInfo::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert_eq!(error.to_string(), "RANK=x is not a number");
    }

    #[test]
    fn slurm_node_lists_give_their_first_host() {
        assert_eq!(first_host("node[03-05,09],gpu7").as_deref(), Some("node03"));
        assert_eq!(first_host("gpu7,gpu8").as_deref(), Some("gpu7"));
        assert_eq!(first_host("single").as_deref(), Some("single"));
        assert_eq!(first_host("a1,b[2-3]").as_deref(), Some("a1"));
        assert_eq!(first_host(""), None);
    }
}
