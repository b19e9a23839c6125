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

/// The closest of `candidates` to `word`, if it is close enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|candidate| (strsim::damerau_levenshtein(word, candidate), candidate))
        .filter(|(distance, candidate)| *distance <= (word.len().max(candidate.len()) / 3).max(2))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// "did you mean `x`?" or a list of what exists.
pub fn suggestion<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    what: &str,
) -> String {
    let candidates: Vec<&str> = candidates.into_iter().collect();
    match nearest(word, candidates.iter().copied()) {
        Some(best) => format!("did you mean `{best}`?"),
        None => {
            if candidates.is_empty() {
                format!("there are no {what}")
            } else {
                format!("{what}: {}", candidates.join(", "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_finds_typos_only() {
        let names = ["kernel", "direction", "seqlen"];
        assert_eq!(nearest("kernal", names), Some("kernel"));
        assert_eq!(nearest("seqlens", names), Some("seqlen"));
        assert_eq!(nearest("zzz", names), None);
    }
}
