//! A real single-node Slurm cluster for one test: munged, slurmctld and slurmd started in a
//! scratch folder on free ports, stopped when the value is dropped. Needs Debian's `slurm-wlm`
//! and `munge` and root (the daemons run as the user who starts them); `.ci/run` installs both.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub struct SlurmCluster {
    dir: tempfile::TempDir,
}

impl SlurmCluster {
    /// Starts the cluster and waits until its node is idle.
    pub fn start() -> SlurmCluster {
        for daemon in ["munged", "slurmctld", "slurmd", "sbatch"] {
            assert!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {daemon}")])
                    .output()
                    .is_ok_and(|o| o.status.success()),
                "a real Slurm is needed for this test: `{daemon}` is not installed \
                 (apt-get install slurm-wlm munge)"
            );
        }
        let dir = tempfile::tempdir().expect("a temporary directory");
        let root = dir.path().to_path_buf();
        let root = root.as_path();
        for sub in ["spool", "state", "log"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key)
            .unwrap();
        std::fs::write(root.join("munge.key"), key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            root.join("munge.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let at = |name: &str| root.join(name).display().to_string();
        must(Command::new("munged").args([
            format!("--socket={}", at("munge.sock")),
            format!("--key-file={}", at("munge.key")),
            format!("--pid-file={}", at("munged.pid")),
            format!("--log-file={}", at("log/munged.log")),
            format!("--seed-file={}", at("munge.seed")),
            "--force".into(),
        ]));
        let host = short_hostname();
        let (ctld_port, slurmd_port) = (free_port(), free_port());
        let conf = format!(
            "ClusterName=attnbench-test\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={sock}\n\
             SlurmctldPort={ctld_port}\nSlurmdPort={slurmd_port}\n\
             StateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
             SlurmctldPidFile={ctld_pid}\nSlurmdPidFile={slurmd_pid}\n\
             SlurmctldLogFile={ctld_log}\nSlurmdLogFile={slurmd_log}\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n\
             SchedulerParameters=sched_interval=2,bf_interval=2\n\
             SlurmdParameters=config_overrides\nMinJobAge=3600\nReturnToService=2\n\
             JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n\
             MpiDefault=none\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN\n\
             PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
            sock = at("munge.sock"),
            state = at("state"),
            spool = at("spool"),
            ctld_pid = at("slurmctld.pid"),
            slurmd_pid = at("slurmd.pid"),
            ctld_log = at("log/slurmctld.log"),
            slurmd_log = at("log/slurmd.log"),
        );
        std::fs::write(root.join("slurm.conf"), conf).unwrap();
        let cluster = SlurmCluster { dir };
        must(cluster.command("slurmctld").args(["-f", &at("slurm.conf")]));
        must(cluster.command("slurmd").args(["-f", &at("slurm.conf")]));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let state = cluster.command("sinfo").args(["-h", "-o", "%T"]).output();
            let state = state.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
            if state.as_deref().is_ok_and(|s| s == "idle") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the test cluster's node is not idle after 30 s ({state:?}); logs in {}",
                cluster.path().join("log").display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        cluster
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn conf(&self) -> PathBuf {
        self.path().join("slurm.conf")
    }

    /// `program` with this cluster's `SLURM_CONF`.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new(program);
        command.env("SLURM_CONF", self.conf());
        command
    }

    /// `attnbench ARGS` in `sandbox`, on this cluster.
    pub fn attnbench(&self, sandbox: &crate::Sandbox, args: &[&str]) -> Command {
        let mut command = sandbox.command(args);
        command.env("SLURM_CONF", self.conf());
        command
    }

    /// `attnbench ARGS` in `sandbox`, on this cluster, run to its end.
    pub fn run(&self, sandbox: &crate::Sandbox, args: &[&str]) -> Output {
        self.attnbench(sandbox, args)
            .output()
            .expect("attnbench starts")
    }

    /// `squeue`'s job ids in `state` of jobs named `name`.
    pub fn jobs(&self, name: &str, state: &str) -> Vec<String> {
        let out = self
            .command("squeue")
            .args(["-h", "-n", name, "-t", state, "-o", "%i"])
            .output()
            .expect("squeue runs");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect()
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        let _ = self.command("scontrol").arg("shutdown").output();
        std::thread::sleep(Duration::from_millis(500));
        for pid_file in ["slurmd.pid", "slurmctld.pid", "munged.pid"] {
            if let Ok(pid) = std::fs::read_to_string(self.path().join(pid_file)) {
                let _ = Command::new("kill").arg(pid.trim()).output();
            }
        }
    }
}

fn must(command: &mut Command) -> Output {
    let output = command.output().expect("the daemon starts");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn short_hostname() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("the hostname");
    name.trim()
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
