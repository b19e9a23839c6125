//! Where each key and value of a YAML document sits, so that validation errors can point at
//! `file:line:column`. serde_norway parses the document; this index only remembers positions.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// 1-based line and column.
pub type Position = (usize, usize);

#[derive(Debug, Default)]
pub struct SpanIndex {
    keys: HashMap<String, Position>,
    values: HashMap<String, Position>,
    duplicates: Vec<Duplicate>,
}

/// A key given twice in one mapping. serde keeps only the last one, so without this a second
/// `stages:` block would silently replace the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicate {
    /// The key itself, e.g. `stages`.
    pub key: String,
    /// The key's path, e.g. `stages.bench.with.kernel`.
    pub path: String,
    /// Where the key is repeated.
    pub at: Position,
    /// Where it was first given.
    pub first: Position,
}

impl SpanIndex {
    /// Indexes `text`; a document that does not parse yields an empty index (the YAML error is
    /// reported by the real parser).
    pub fn build(text: &str) -> Self {
        let mut builder = Builder::default();
        let mut parser = Parser::new_from_str(text);
        if parser.load(&mut builder, false).is_err() {
            return SpanIndex::default();
        }
        builder.index
    }

    /// Position of the key at `path` (e.g. `["stages", "bench", "with", "kernel"]`), falling back
    /// to the nearest enclosing entry that is known.
    pub fn key(&self, path: &[&str]) -> Option<Position> {
        self.lookup(&self.keys, path)
    }

    /// Position of the value at `path`, falling back like [`SpanIndex::key`].
    pub fn value(&self, path: &[&str]) -> Option<Position> {
        self.lookup(&self.values, path)
    }

    /// Keys repeated within one mapping, in document order.
    pub fn duplicates(&self) -> &[Duplicate] {
        &self.duplicates
    }

    fn lookup(&self, map: &HashMap<String, Position>, path: &[&str]) -> Option<Position> {
        (1..=path.len()).rev().find_map(|len| {
            let joined = path[..len].join(".");
            map.get(&joined).or_else(|| self.keys.get(&joined)).copied()
        })
    }
}

enum Frame {
    Map {
        key: Option<String>,
        seen: HashMap<String, Position>,
    },
    Seq {
        next: usize,
    },
}

#[derive(Default)]
struct Builder {
    index: SpanIndex,
    frames: Vec<Frame>,
    path: Vec<String>,
}

impl Builder {
    /// The path segment of the value about to be read in the innermost container, or `None`
    /// when the next scalar is a mapping key.
    fn child_segment(&self) -> Option<String> {
        match self.frames.last() {
            Some(Frame::Map { key: Some(key), .. }) => Some(key.clone()),
            Some(Frame::Map { key: None, .. }) => None,
            Some(Frame::Seq { next }) => Some(next.to_string()),
            None => Some(String::new()),
        }
    }

    fn value_done(&mut self) {
        match self.frames.last_mut() {
            Some(Frame::Map { key, .. }) => *key = None,
            Some(Frame::Seq { next }) => *next += 1,
            None => {}
        }
    }

    fn joined(&self, segment: &str) -> String {
        let mut parts: Vec<&str> = self
            .path
            .iter()
            .map(String::as_str)
            .filter(|s| !s.is_empty())
            .collect();
        if !segment.is_empty() {
            parts.push(segment);
        }
        parts.join(".")
    }
}

impl MarkedEventReceiver for Builder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        let position = (mark.line(), mark.col() + 1);
        match event {
            Event::Scalar(text, ..) => match self.child_segment() {
                None => {
                    let joined = self.joined(&text);
                    if let Some(Frame::Map { key, seen }) = self.frames.last_mut() {
                        if let Some(&first) = seen.get(&text) {
                            self.index.duplicates.push(Duplicate {
                                key: text.clone(),
                                path: joined.clone(),
                                at: position,
                                first,
                            });
                        } else {
                            seen.insert(text.clone(), position);
                        }
                        *key = Some(text);
                    }
                    self.index.keys.insert(joined, position);
                }
                Some(segment) => {
                    let joined = self.joined(&segment);
                    self.index.values.insert(joined, position);
                    self.value_done();
                }
            },
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let segment = self.child_segment().unwrap_or_default();
                let joined = self.joined(&segment);
                self.index.values.insert(joined, position);
                self.path.push(segment);
                self.frames
                    .push(if matches!(event, Event::MappingStart(..)) {
                        Frame::Map {
                            key: None,
                            seen: HashMap::new(),
                        }
                    } else {
                        Frame::Seq { next: 0 }
                    });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.frames.pop();
                self.path.pop();
                self.value_done();
            }
            Event::Alias(_) => self.value_done(),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_have_their_positions() {
        let text = "name: x\nstages:\n  masks:\n    uses: masks/generate\n    matrix: {seqlen: [1k, 2k]}\n";
        let index = SpanIndex::build(text);
        assert_eq!(index.key(&["name"]), Some((1, 1)));
        assert_eq!(index.key(&["stages", "masks"]), Some((3, 3)));
        assert_eq!(index.value(&["stages", "masks", "uses"]), Some((4, 11)));
        assert_eq!(
            index.key(&["stages", "masks", "matrix", "seqlen"]),
            Some((5, 14))
        );
        assert_eq!(
            index.value(&["stages", "masks", "matrix", "seqlen", "1"]),
            Some((5, 27))
        );
        // Unknown paths fall back to the nearest known ancestor.
        assert_eq!(index.key(&["stages", "masks", "with", "x"]), Some((3, 3)));
        assert!(index.duplicates().is_empty());
    }

    #[test]
    fn repeated_keys_are_found_at_every_level() {
        let text = "stages:\n  a: {uses: x, uses: y}\nname: n\nstages:\n  b: {}\n";
        let index = SpanIndex::build(text);
        let found: Vec<(&str, &str, Position, Position)> = index
            .duplicates()
            .iter()
            .map(|d| (d.key.as_str(), d.path.as_str(), d.at, d.first))
            .collect();
        assert_eq!(
            found,
            [
                ("uses", "stages.a.uses", (2, 16), (2, 7)),
                ("stages", "stages", (4, 1), (1, 1)),
            ]
        );
        // The same key in two different mappings is no repetition.
        let index = SpanIndex::build("a: {x: 1}\nb: {x: 2}\nc: [{x: 1}, {x: 2}]\n");
        assert!(index.duplicates().is_empty(), "{:?}", index.duplicates());
    }
}
