//! Reading corpus shards (JSON lines, optionally zstd-compressed) and counting document lengths.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use attnbench_sdk::PluginError;
use serde_json::Value;

/// How document lengths are counted.
pub enum Counter {
    /// Whitespace-separated tokens: LongCA-bench's proxy.
    Whitespace,
    /// Tokens of a Hugging Face `tokenizer.json`.
    Tokenizer(Box<tokenizers::Tokenizer>),
}

impl Counter {
    pub fn from_file(path: &Path) -> Result<Counter, PluginError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path)
            .map_err(|err| PluginError::Params(format!("tokenizer {}: {err}", path.display())))?;
        Ok(Counter::Tokenizer(Box::new(tokenizer)))
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Counter::Whitespace => "whitespace-separated tokens",
            Counter::Tokenizer(_) => "tokens of the given tokenizer.json",
        }
    }

    fn count(&self, text: &str) -> tokenizers::Result<u64> {
        match self {
            Counter::Whitespace => Ok(text.split_whitespace().count() as u64),
            Counter::Tokenizer(tokenizer) => tokenizer.encode(text, false).map(|e| e.len() as u64),
        }
    }
}

/// The longest line (one document) a shard may have: the longest documents of real corpora are
/// tens of MB, and a line that never ends (a few KB of zstd can expand to GBs) must not be
/// gathered into memory whole.
const MAX_LINE: usize = 256 << 20;

/// The length of each document of a `.jsonl` or `.jsonl.zst` shard, at most `limit` of them.
pub fn count_tokens(
    path: &Path,
    text_field: &str,
    counter: &Counter,
    limit: u64,
) -> Result<Vec<u64>, PluginError> {
    let file = File::open(path).map_err(|err| PluginError::io(path, err))?;
    let name = path.to_string_lossy();
    let reader: Box<dyn Read> = if name.ends_with(".zst") {
        Box::new(ZstdFrames::new(BufReader::new(file)))
    } else {
        Box::new(file)
    };
    count_lines(reader, &name, text_field, counter, limit, MAX_LINE)
}

fn count_lines(
    reader: impl Read,
    name: &str,
    text_field: &str,
    counter: &Counter,
    limit: u64,
    max_line: usize,
) -> Result<Vec<u64>, PluginError> {
    let mut reader = BufReader::new(reader);
    let mut lengths = Vec::new();
    let mut bytes = Vec::new();
    for number in 0u64.. {
        if lengths.len() as u64 >= limit {
            break;
        }
        bytes.clear();
        let read = (&mut reader)
            .take(max_line as u64 + 1)
            .read_until(b'\n', &mut bytes)
            .map_err(|err| PluginError::failed(format!("{name}: line {}: {err}", number + 1)))?;
        if read == 0 {
            break;
        }
        if bytes.len() > max_line {
            return Err(PluginError::failed(format!(
                "{name}: line {} is longer than {} bytes; a JSON-lines corpus has one document per line",
                number + 1,
                max_line
            )));
        }
        let line = std::str::from_utf8(&bytes).map_err(|err| {
            PluginError::failed(format!("{name}: line {} is not UTF-8: {err}", number + 1))
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let document: Value = serde_json::from_str(line).map_err(|err| {
            PluginError::failed(format!("{name}: line {} is not JSON: {err}", number + 1))
        })?;
        let text = document
            .get(text_field)
            .and_then(Value::as_str)
            .ok_or_else(|| {
                PluginError::failed(format!(
                    "{name}: line {} has no text field `{text_field}`",
                    number + 1
                ))
            })?;
        let length = counter
            .count(text)
            .map_err(|err| PluginError::failed(format!("{name}: line {}: {err}", number + 1)))?;
        lengths.push(length);
    }
    Ok(lengths)
}

/// A reader over every frame of a zstd stream (shards are often several frames concatenated).
struct ZstdFrames<R: BufRead> {
    source: Option<R>,
    current: Option<ruzstd::decoding::StreamingDecoder<R, ruzstd::decoding::FrameDecoder>>,
}

impl<R: BufRead> ZstdFrames<R> {
    fn new(source: R) -> Self {
        ZstdFrames {
            source: Some(source),
            current: None,
        }
    }
}

impl<R: BufRead> Read for ZstdFrames<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if let Some(decoder) = self.current.as_mut() {
                let read = decoder.read(buffer)?;
                if read > 0 {
                    return Ok(read);
                }
                let decoder = self.current.take().map(|d| d.into_inner());
                self.source = decoder;
            }
            let Some(mut source) = self.source.take() else {
                return Ok(0);
            };
            if source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            let decoder = ruzstd::decoding::StreamingDecoder::new(source).map_err(|err| {
                std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not zstd: {err}"))
            })?;
            self.current = Some(decoder);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_past_the_limit_is_refused_before_it_is_gathered() {
        let shard = b"{\"text\": \"a b c\"}\n{\"text\": \"d\"}\n";
        let lengths =
            count_lines(&shard[..], "s", "text", &Counter::Whitespace, u64::MAX, 64).unwrap();
        assert_eq!(lengths, vec![3, 1]);
        let endless = std::io::repeat(b'x');
        let err =
            count_lines(endless, "s", "text", &Counter::Whitespace, u64::MAX, 64).unwrap_err();
        assert!(
            err.to_string().contains("line 1 is longer than 64 bytes"),
            "{err}"
        );
        let last_without_newline = b"{\"text\": \"a b\"}";
        let lengths = count_lines(
            &last_without_newline[..],
            "s",
            "text",
            &Counter::Whitespace,
            9,
            64,
        )
        .unwrap();
        assert_eq!(lengths, vec![2]);
    }
}
