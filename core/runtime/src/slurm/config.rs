//! Where nodes run, and how Slurm is asked for them: the `executor:` section of a pipeline or of
//! the user's config file (`$ATTNBENCH_CONFIG`, else `~/.config/attnbench/config.yaml`), with
//! `--executor` over both. The pipeline's fields win over the config file's, field by field, so
//! a site's partition and account live in one file and pipelines stay portable.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutorKind {
    /// Every node on this machine, in process or in worker processes.
    #[default]
    Local,
    /// Worker-isolated nodes (measurements, CP runs) as Slurm jobs; the rest here.
    Slurm,
}

impl ExecutorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutorKind::Local => "local",
            ExecutorKind::Slurm => "slurm",
        }
    }
}

/// One `executor:` section as written: every field optional, so that sections can be layered.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorSection {
    pub kind: Option<ExecutorKind>,
    pub partition: Option<String>,
    pub account: Option<String>,
    pub qos: Option<String>,
    /// More `sbatch` options, passed as written (`--constraint=h200`, `--reservation=x`).
    pub extra: Option<Vec<String>>,
    /// GPUs a node of the cluster has: how many tasks of a CP stage share one node.
    pub gpus_per_node: Option<usize>,
    /// A job still pending after this long is cancelled and its node skipped.
    #[serde(default, with = "humantime_serde_opt")]
    pub start_within: Option<Duration>,
    /// How often the queue asks Slurm about its jobs.
    #[serde(default, with = "humantime_serde_opt")]
    pub poll: Option<Duration>,
}

impl ExecutorSection {
    /// Reads a section from its JSON form: `slurm`, `local` or a mapping of the fields above.
    pub fn from_value(value: &Value) -> Result<ExecutorSection, SectionError> {
        if let Value::String(kind) = value {
            return serde_json::from_value::<ExecutorKind>(value.clone())
                .map(|kind| ExecutorSection {
                    kind: Some(kind),
                    ..ExecutorSection::default()
                })
                .map_err(|_| SectionError::NotAnExecutor(kind.clone()));
        }
        serde_json::from_value::<ExecutorSection>(value.clone()).map_err(SectionError::Fields)
    }

    /// This section with `under`'s fields filling what it leaves unset.
    pub fn over(self, under: ExecutorSection) -> ExecutorSection {
        ExecutorSection {
            kind: self.kind.or(under.kind),
            partition: self.partition.or(under.partition),
            account: self.account.or(under.account),
            qos: self.qos.or(under.qos),
            extra: self.extra.or(under.extra),
            gpus_per_node: self.gpus_per_node.or(under.gpus_per_node),
            start_within: self.start_within.or(under.start_within),
            poll: self.poll.or(under.poll),
        }
    }

    /// The settings a Slurm queue runs with.
    pub fn slurm(&self) -> SlurmSettings {
        SlurmSettings {
            partition: self.partition.clone(),
            account: self.account.clone(),
            qos: self.qos.clone(),
            extra: self.extra.clone().unwrap_or_default(),
            gpus_per_node: self.gpus_per_node.unwrap_or(8).max(1),
            start_within: self.start_within,
            poll: self.poll.unwrap_or(Duration::from_secs(2)),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SlurmSettings {
    pub partition: Option<String>,
    pub account: Option<String>,
    pub qos: Option<String>,
    pub extra: Vec<String>,
    pub gpus_per_node: usize,
    pub start_within: Option<Duration>,
    pub poll: Duration,
}

/// The user's config file: `$ATTNBENCH_CONFIG`, else `~/.config/attnbench/config.yaml`.
pub fn user_config_path() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ATTNBENCH_CONFIG") {
        return Some(PathBuf::from(path));
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config")))?;
    Some(base.join("attnbench").join("config.yaml"))
}

/// The `executor:` section of the user's config file; none when the file does not exist.
pub fn user_section() -> Result<ExecutorSection, ConfigError> {
    let Some(path) = user_config_path() else {
        return Ok(ExecutorSection::default());
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            return Ok(ExecutorSection::default())
        }
        Err(source) => return Err(ConfigError::Unreadable { path, source }),
    };
    let document: Value = match serde_norway::from_str(&text) {
        Ok(document) => document,
        Err(source) => return Err(ConfigError::Yaml { path, source }),
    };
    match document.get("executor") {
        None | Some(Value::Null) => Ok(ExecutorSection::default()),
        Some(value) => ExecutorSection::from_value(value)
            .map_err(|source| ConfigError::Section { path, source }),
    }
}

/// What is wrong with an `executor:` section.
#[derive(Debug, thiserror::Error)]
pub enum SectionError {
    #[error("`{0}` is not an executor; expected `local` or `slurm`")]
    NotAnExecutor(String),
    /// An unknown field or a value of the wrong form (a duration that does not parse…).
    #[error("{0}")]
    Fields(serde_json::Error),
}

/// Why the user's config file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: invalid YAML: {source}", path.display())]
    Yaml {
        path: PathBuf,
        source: serde_norway::Error,
    },
    #[error("{}: `executor`: {source}", path.display())]
    Section { path: PathBuf, source: SectionError },
}

/// Durations as humans write them (`30m`, `2s`), for optional fields.
mod humantime_serde_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text = Option::<String>::deserialize(d)?;
        text.map(|text| {
            humantime::parse_duration(&text).map_err(|err| {
                serde::de::Error::custom(format!(
                    "`{text}` is not a duration ({err}); e.g. 30m, 90s"
                ))
            })
        })
        .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sections_read_the_short_and_the_long_form_and_layer() {
        let short = ExecutorSection::from_value(&json!("slurm")).unwrap();
        assert_eq!(short.kind, Some(ExecutorKind::Slurm));
        let long = ExecutorSection::from_value(&json!({
            "partition": "gpu", "start_within": "30m", "extra": ["--constraint=h200"]
        }))
        .unwrap();
        let site =
            ExecutorSection::from_value(&json!({"partition": "cpu", "account": "lab"})).unwrap();
        let merged = long.over(short).over(site).slurm();
        assert_eq!(merged.partition.as_deref(), Some("gpu"));
        assert_eq!(merged.account.as_deref(), Some("lab"));
        assert_eq!(merged.start_within, Some(Duration::from_secs(1800)));
        assert_eq!(merged.extra, ["--constraint=h200"]);
    }

    #[test]
    fn bad_sections_name_what_is_wrong() {
        let kind = ExecutorSection::from_value(&json!("k8s")).unwrap_err();
        assert!(
            matches!(&kind, SectionError::NotAnExecutor(k) if k == "k8s"),
            "{kind}"
        );
        let field = ExecutorSection::from_value(&json!({"partiton": "gpu"})).unwrap_err();
        assert!(field.to_string().contains("partiton"), "{field}");
        let time = ExecutorSection::from_value(&json!({"poll": "soon"})).unwrap_err();
        assert!(
            time.to_string().contains("`soon` is not a duration"),
            "{time}"
        );
    }
}
