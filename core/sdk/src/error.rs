use std::path::Path;

use crate::FailureKind;

/// Why a stage could not produce its result. The message reaches the user as the node's error.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("invalid parameters: {0}")]
    Params(String),
    #[error("unknown stage `{stage}`; this plugin has: {known}")]
    UnknownStage { stage: String, known: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The device could not hold what the stage needed: a kernel records such a node as `oom`.
    #[error("{0}")]
    OutOfMemory(String),
    #[error("{0}")]
    Failed(String),
    /// The kernel cannot run this case, found out while running it (a library refusing its
    /// first call): a kernel benchmark records the cell `unsupported` with this reason.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An in-process attention backend refused or failed a call.
    #[error(transparent)]
    Attention(#[from] crate::attention::AttentionError),
}

impl PluginError {
    /// The kind the host receives beside the message.
    pub fn kind(&self) -> FailureKind {
        match self {
            PluginError::Params(_) => FailureKind::Params,
            PluginError::UnknownStage { .. } => FailureKind::UnknownStage,
            PluginError::Io { .. } => FailureKind::Io,
            PluginError::OutOfMemory(_) => FailureKind::OutOfMemory,
            PluginError::Failed(_) | PluginError::Unsupported(_) | PluginError::Attention(_) => {
                FailureKind::Failed
            }
        }
    }

    pub fn failed(message: impl Into<String>) -> Self {
        PluginError::Failed(message.into())
    }

    pub fn io(path: &Path, source: std::io::Error) -> Self {
        PluginError::Io {
            context: path.display().to_string(),
            source,
        }
    }
}
