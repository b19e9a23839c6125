//! Reading corpus shards (JSON lines, optionally zstd-compressed) and counting document lengths.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use attnbench_sdk::PluginError;
use serde_json::Value;

/// The length, in whitespace-separated tokens (LongCA-bench's proxy), of each document of a
/// `.jsonl` or `.jsonl.zst` shard, at most `limit` of them.
pub fn count_tokens(path: &Path, text_field: &str, limit: u64) -> Result<Vec<u64>, PluginError> {
    let file = File::open(path).map_err(|err| PluginError::io(&path.to_path_buf(), err))?;
    let name = path.to_string_lossy();
    let reader: Box<dyn Read> = if name.ends_with(".zst") {
        Box::new(ZstdFrames::new(BufReader::new(file)))
    } else {
        Box::new(file)
    };
    let mut lengths = Vec::new();
    for (number, line) in BufReader::new(reader).lines().enumerate() {
        if lengths.len() as u64 >= limit {
            break;
        }
        let line =
            line.map_err(|err| PluginError::failed(format!("{name}: line {}: {err}", number + 1)))?;
        if line.trim().is_empty() {
            continue;
        }
        let document: Value = serde_json::from_str(&line).map_err(|err| {
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
        lengths.push(text.split_whitespace().count() as u64);
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
