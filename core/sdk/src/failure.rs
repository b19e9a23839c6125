//! How a stage's failure crosses the ABI: its kind, which the host acts on, and the message people
//! read. Since ABI 1.2 the error side of `run` is this as JSON; before it, the message alone.

use serde::{Deserialize, Serialize};

/// What kind of failure a stage reports. A kind this host does not know (added by a later minor
/// version) reads as `Failed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The node's parameters are wrong: the pipeline has to change.
    Params,
    /// The library has no stage of that name.
    UnknownStage,
    /// Reading or writing a file failed.
    Io,
    /// The stage panicked; the message says where.
    Panicked,
    /// The device could not hold what the stage needed.
    OutOfMemory,
    /// Anything else the stage reports.
    #[serde(other)]
    Failed,
}

/// A stage's failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct StageFailure {
    #[serde(rename = "failure")]
    pub kind: FailureKind,
    pub message: String,
}

impl StageFailure {
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        StageFailure {
            kind,
            message: message.into(),
        }
    }

    /// The text a plugin of this ABI returns.
    pub fn to_wire(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| self.message.clone())
    }

    /// The failure a plugin built for ABI `abi` returned as `text`. Before 1.2 the text is the
    /// message alone, and the SDK's export started a caught panic's message with "plugin
    /// panicked", the one kind such a plugin can be told by.
    pub fn from_wire(abi: &str, text: String) -> Self {
        if types_failures(abi) {
            if let Ok(failure) = serde_json::from_str::<StageFailure>(&text) {
                return failure;
            }
        }
        let kind = if text.starts_with("plugin panicked") {
            FailureKind::Panicked
        } else {
            FailureKind::Failed
        };
        StageFailure::new(kind, text)
    }
}

/// Whether a plugin built for ABI `abi` returns its failures typed (1.2 and later).
pub fn types_failures(abi: &str) -> bool {
    let mut parts = abi.split('.').map(|part| part.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (1, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typed_failure_round_trips_and_an_unknown_kind_reads_as_failed() {
        let failure = StageFailure::new(FailureKind::Params, "`seqlen` must be positive");
        assert_eq!(StageFailure::from_wire("1.2.0", failure.to_wire()), failure);
        let later = r#"{"failure": "from_a_later_minor", "message": "m"}"#.to_string();
        assert_eq!(
            StageFailure::from_wire("1.3.0", later).kind,
            FailureKind::Failed
        );
    }

    #[test]
    fn older_plugins_send_the_message_alone() {
        let panicked = StageFailure::from_wire("1.1.0", "plugin panicked: at lib.rs:3".into());
        assert_eq!(panicked.kind, FailureKind::Panicked);
        let json_looking = r#"{"failure": "params", "message": "m"}"#.to_string();
        let old = StageFailure::from_wire("1.1.0", json_looking.clone());
        assert_eq!((old.kind, old.message), (FailureKind::Failed, json_looking));
    }
}
