//! The one collector of a pipeline's problems, each placed at its key or value in the file, or
//! at the `--set` option that changed it.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Map, Value};

use super::spans::SpanIndex;
use crate::diagnostic::{suggestion, Diagnostic, Origin};
use crate::host::plugin::Registry;

pub(super) struct Checker<'a> {
    pub file: PathBuf,
    pub spans: SpanIndex,
    pub overrides: BTreeMap<String, String>,
    pub registry: &'a Registry,
    pub problems: Vec<Diagnostic>,
}

impl Checker<'_> {
    pub fn origin(&self, path: &[&str], at_key: bool) -> Origin {
        let joined = path.join(".");
        if let Some((option, _)) = self
            .overrides
            .iter()
            .find(|(key, _)| joined.starts_with(key.as_str()))
        {
            return Origin::Override(format!("{option}={}", self.overrides[option]));
        }
        let position = if at_key {
            self.spans.key(path)
        } else {
            self.spans.value(path)
        };
        match position {
            Some((line, column)) => Origin::File {
                path: self.file.clone(),
                line,
                column,
            },
            None => Origin::Pipeline(self.file.clone()),
        }
    }

    pub fn at_key(&mut self, path: &[&str], message: impl Into<String>, hint: Option<String>) {
        let mut diagnostic = Diagnostic::new(self.origin(path, true), message);
        diagnostic.hint = hint;
        self.problems.push(diagnostic);
    }

    pub fn at_value(&mut self, path: &[&str], message: impl Into<String>, hint: Option<String>) {
        let mut diagnostic = Diagnostic::new(self.origin(path, false), message);
        diagnostic.hint = hint;
        self.problems.push(diagnostic);
    }

    pub fn unknown_keys(
        &mut self,
        map: &Map<String, Value>,
        path: &[&str],
        allowed: &[&str],
        what: &str,
    ) {
        for key in map.keys().filter(|key| !allowed.contains(&key.as_str())) {
            let mut at: Vec<&str> = path.to_vec();
            at.push(key);
            let hint = suggestion(key, allowed.iter().copied(), "allowed keys");
            self.at_key(&at, format!("unknown key `{key}` in {what}"), Some(hint));
        }
    }
}
