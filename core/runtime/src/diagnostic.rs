//! Errors that point at the place in a pipeline file (or `--set` option) that caused them.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `file:line:column`, 1-based.
    File {
        path: PathBuf,
        line: usize,
        column: usize,
    },
    /// A `--set` option from the command line.
    Override(String),
    /// The pipeline as a whole.
    Pipeline(PathBuf),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub origin: Origin,
    pub message: String,
    pub hint: Option<String>,
}

impl Diagnostic {
    pub fn new(origin: Origin, message: impl Into<String>) -> Self {
        Diagnostic {
            origin,
            message: message.into(),
            hint: None,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { path, line, column } => write!(f, "{}:{line}:{column}", path.display()),
            Origin::Override(option) => write!(f, "--set {option}"),
            Origin::Pipeline(path) => write!(f, "{}", path.display()),
        }
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.origin, self.message)?;
        if let Some(hint) = &self.hint {
            write!(f, "\n  hint: {hint}")?;
        }
        Ok(())
    }
}

pub use attnbench_sdk::{nearest, suggestion};
