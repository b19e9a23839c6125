//! Bounds on what a pipeline may ask for. Each is checked while the pipeline is validated, so
//! absurd input is refused with its place in the file instead of exhausting memory, hanging on a
//! FIFO or panicking later in the scheduler.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use attnbench_sdk::{ParamSpec, ParamType, ValueError};
use serde_json::{Map, Value};

use super::spans::SpanIndex;
use crate::diagnostic::{Diagnostic, Origin};

/// Nodes one plan may have. Planning costs about 1 µs and 1 KB per node, so a million is a second
/// and a gigabyte; running that many even at a second each takes eleven days. A matrix beyond
/// this is a typo (one axis too many), and refusing it from the product of the axes' lengths
/// costs nothing, whereas expanding 10⁷ nodes would take many gigabytes first.
pub const MAX_NODES: u64 = 1_000_000;

/// Bytes of a pipeline file. A 100,000-node matrix is written in about 130 KB; the limit only
/// keeps `/dev/zero` or a runaway generator from being read into memory.
pub const MAX_PIPELINE_BYTES: u64 = 16 << 20;

/// Bytes of a file that a `file` parameter names. Such files are hashed into cache keys at every
/// `plan` and `run` (about a second per GiB), and the stages that read them (mask histograms,
/// Python kernel modules) read them whole.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Shortest stage timeout: anything shorter cannot even start a worker.
pub const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Longest stage timeout. Deadlines are computed as `now + timeout`, which must not overflow;
/// a week is already far past any single benchmark node.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);

/// `bytes` as people read them: `16 MiB`, `1 GiB`, `512 bytes`.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift {
            let value = bytes as f64 / (1u64 << shift) as f64;
            return if bytes.is_multiple_of(1 << shift) {
                format!("{} {unit}", bytes >> shift)
            } else {
                format!("{value:.1} {unit}")
            };
        }
    }
    format!("{bytes} bytes")
}

/// What kind of file `metadata` describes, for messages that refuse it.
fn kind(metadata: &Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let ty = metadata.file_type();
    if ty.is_dir() {
        "a directory"
    } else if ty.is_fifo() {
        "a FIFO (named pipe)"
    } else if ty.is_char_device() {
        "a character device"
    } else if ty.is_block_device() {
        "a block device"
    } else if ty.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Opens `path` without blocking: opening a FIFO for reading waits for a writer, and the path
/// may have been replaced by one since it was checked.
fn open_nonblocking(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

/// Reads at most `limit` bytes of `reader` into `sink`; `Err(read)` when there were more.
fn copy_bounded(
    reader: impl Read,
    limit: u64,
    mut sink: impl FnMut(&[u8]),
) -> std::io::Result<Result<u64, u64>> {
    let mut reader = reader.take(limit + 1);
    let mut buffer = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let read = match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        total += read as u64;
        if total > limit {
            return Ok(Err(total));
        }
        sink(&buffer[..read]);
    }
    Ok(Ok(total))
}

/// The text of a pipeline file. Pipes (`<(generate)`, `/dev/stdin`) are read as a shell would,
/// devices and directories refused; either way no more than [`MAX_PIPELINE_BYTES`] is read.
pub fn read_pipeline(path: &Path) -> std::io::Result<String> {
    let invalid = |message: String| std::io::Error::new(std::io::ErrorKind::InvalidData, message);
    let metadata = std::fs::metadata(path)?;
    let ty = metadata.file_type();
    if !(ty.is_file() || std::os::unix::fs::FileTypeExt::is_fifo(&ty)) {
        return Err(invalid(format!(
            "it is {}; give a YAML file",
            kind(&metadata)
        )));
    }
    if metadata.len() > MAX_PIPELINE_BYTES {
        return Err(invalid(format!(
            "it is {}, more than the limit of {} for a pipeline file",
            format_bytes(metadata.len()),
            format_bytes(MAX_PIPELINE_BYTES)
        )));
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    if let Err(read) = copy_bounded(File::open(path)?, MAX_PIPELINE_BYTES, |chunk| {
        bytes.extend_from_slice(chunk)
    })? {
        return Err(invalid(format!(
            "it grew past {} while being read, more than the limit of {} for a pipeline file",
            format_bytes(read),
            format_bytes(MAX_PIPELINE_BYTES)
        )));
    }
    String::from_utf8(bytes).map_err(|_| invalid("it is not UTF-8 text".into()))
}

/// Why a `file` parameter's file was refused.
#[derive(Debug, thiserror::Error)]
pub enum FileParamError {
    /// It could not be opened or read: missing, unreadable, or gone while being read.
    #[error("cannot read {}: {source}", .path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not a regular file (a directory, a FIFO, a device…): `kind` says which.
    #[error("{} is {kind}; a `file` parameter must name a regular file", .path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    /// Larger than [`MAX_FILE_BYTES`] (or grew past it while being read).
    #[error("{} is {}, more than the limit of {} for a `file` parameter", .path.display(),
            format_bytes(*.bytes), format_bytes(MAX_FILE_BYTES))]
    TooLarge { path: PathBuf, bytes: u64 },
}

/// The canonical path and blake3 digest of a file a `file` parameter names, streamed so that
/// memory stays flat; refuses anything but a regular file of at most [`MAX_FILE_BYTES`].
pub fn hash_file(path: &Path) -> Result<(PathBuf, String), FileParamError> {
    let not_regular = |metadata: &Metadata| FileParamError::NotRegular {
        path: path.to_path_buf(),
        kind: kind(metadata),
    };
    let too_large = |bytes: u64| FileParamError::TooLarge {
        path: path.to_path_buf(),
        bytes,
    };
    let cannot = |source: std::io::Error| FileParamError::Unreadable {
        path: path.to_path_buf(),
        source,
    };
    // `stat` first: it neither blocks on a FIFO nor reads a device.
    let metadata = std::fs::metadata(path).map_err(cannot)?;
    if !metadata.is_file() {
        return Err(not_regular(&metadata));
    }
    if metadata.len() > MAX_FILE_BYTES {
        return Err(too_large(metadata.len()));
    }
    let file = open_nonblocking(path).map_err(cannot)?;
    // The path may have changed between `stat` and `open`; what was opened is what counts.
    let opened = file.metadata().map_err(cannot)?;
    if !opened.is_file() {
        return Err(not_regular(&opened));
    }
    let mut hasher = blake3::Hasher::new();
    if let Err(read) = copy_bounded(file, MAX_FILE_BYTES, |chunk| {
        hasher.update(chunk);
    })
    .map_err(cannot)?
    {
        return Err(too_large(read));
    }
    let resolved = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    Ok((resolved, hasher.finalize().to_hex().to_string()))
}

fn allowed_timeouts() -> String {
    format!(
        "{} to {}",
        humantime::format_duration(MIN_TIMEOUT),
        humantime::format_duration(MAX_TIMEOUT)
    )
}

/// Why a stage's timeout or matrix size is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LimitError {
    #[error("`timeout: {text}` is not a duration ({reason}); write seconds (`90`) or a duration (`90s`, `5m`)")]
    NotADuration { text: String, reason: String },
    #[error("`timeout` must be a duration, found {found}; write seconds (`90`) or a duration (`90s`, `5m`)")]
    TimeoutType { found: String },
    #[error(
        "`timeout: {shown}` is outside the allowed range {}",
        allowed_timeouts()
    )]
    TimeoutRange { shown: String },
    #[error("the plugin declares a timeout of {seconds} s, outside the allowed range {}; set the stage's `timeout:`", allowed_timeouts())]
    DeclaredTimeout { seconds: f64 },
    #[error("the matrix of stage `{stage}` has {} nodes ({axes}), more than the limit of {} nodes per plan", thousands(*.nodes), thousands(u128::from(MAX_NODES)))]
    Matrix {
        stage: String,
        nodes: u128,
        /// Each axis and its length, `mask: 12 × seqlen: 7`.
        axes: String,
    },
}

/// A stage's `timeout`: seconds (`90`, `2.5`) or a duration (`90s`, `5m`), within
/// [`MIN_TIMEOUT`]..=[`MAX_TIMEOUT`].
pub fn timeout(value: &Value) -> Result<Duration, LimitError> {
    let seconds = match value {
        Value::Number(number) => number.as_f64(),
        Value::String(text) => match humantime::parse_duration(text.trim()) {
            Ok(duration) => Some(duration.as_secs_f64()),
            Err(err) => {
                return Err(LimitError::NotADuration {
                    text: text.clone(),
                    reason: err.to_string(),
                })
            }
        },
        other => {
            return Err(LimitError::TimeoutType {
                found: other.to_string(),
            })
        }
    };
    let shown = match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    };
    seconds
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| (MIN_TIMEOUT..=MAX_TIMEOUT).contains(d))
        .ok_or(LimitError::TimeoutRange { shown })
}

/// A plugin's declared `timeout_s`, which is not the user's to fix but must not panic either.
pub fn declared_timeout(seconds: f64) -> Result<Duration, LimitError> {
    Duration::try_from_secs_f64(seconds)
        .ok()
        .filter(|d| (MIN_TIMEOUT..=MAX_TIMEOUT).contains(d))
        .ok_or(LimitError::DeclaredTimeout { seconds })
}

/// Every key given twice in one mapping: the document is ambiguous, so nothing else is checked.
pub fn duplicate_keys(file: &Path, spans: &SpanIndex) -> Vec<Diagnostic> {
    spans
        .duplicates()
        .iter()
        .map(|duplicate| {
            let origin = Origin::File {
                path: file.to_path_buf(),
                line: duplicate.at.0,
                column: duplicate.at.1,
            };
            let message = format!(
                "duplicate key `{}` (first at line {}, column {}); YAML would keep only the last one",
                duplicate.path, duplicate.first.0, duplicate.first.1
            );
            Diagnostic::new(origin, message)
        })
        .collect()
}

/// Refuses a stage's `matrix` whose axes multiply past [`MAX_NODES`], naming each axis' length.
pub fn matrix_size(stage_name: &str, matrix: &Map<String, Value>) -> Result<(), LimitError> {
    let length = |values: &Value| values.as_array().map_or(1, Vec::len);
    let nodes = matrix_nodes(matrix.values().map(length));
    if nodes <= u128::from(MAX_NODES) {
        return Ok(());
    }
    let axes: Vec<String> = matrix
        .iter()
        .map(|(key, values)| format!("{key}: {}", length(values)))
        .collect();
    Err(LimitError::Matrix {
        stage: stage_name.to_string(),
        nodes,
        axes: axes.join(" × "),
    })
}

/// Nodes of a matrix with axes of these lengths, exactly (u128 cannot overflow for any matrix a
/// file under [`MAX_PIPELINE_BYTES`] can spell out, and saturates beyond).
pub fn matrix_nodes(lengths: impl IntoIterator<Item = usize>) -> u128 {
    lengths.into_iter().fold(1u128, |product, length| {
        product.saturating_mul(length as u128)
    })
}

/// Refuses numbers a stage cannot mean: sizes past 2⁵³ (the SDK's size limit; a size written
/// with a suffix is checked when it is parsed, a plain number only here).
pub fn check_number(param: &ParamSpec, value: &Value) -> Result<(), ValueError> {
    check_value(&param.ty, value)
}

fn check_value(ty: &ParamType, value: &Value) -> Result<(), ValueError> {
    match (ty, value) {
        (ParamType::Size, Value::Number(number)) => match number.as_u64() {
            Some(size) => attnbench_sdk::parse_size(&size.to_string())
                .map(drop)
                .map_err(ValueError::Size),
            None => Ok(()),
        },
        (ParamType::List(item), Value::Array(items)) => {
            items.iter().try_for_each(|value| check_value(item, value))
        }
        _ => Ok(()),
    }
}

/// `1000000` as `1,000,000`.
pub fn thousands(value: u128) -> String {
    let digits = value.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn timeouts_outside_the_range_are_refused_without_panicking() {
        assert_eq!(timeout(&json!(90)), Ok(Duration::from_secs(90)));
        assert_eq!(timeout(&json!("5m")), Ok(Duration::from_secs(300)));
        for bad in [
            json!(1e300),
            json!(-1),
            json!(0),
            json!(1e-9),
            json!(f64::MAX),
            json!("1000000000years"),
            json!("8days"),
        ] {
            let err = timeout(&bad).unwrap_err();
            let in_range_words = err.to_string().contains("allowed range 1ms to 7days");
            assert!(
                matches!(err, LimitError::TimeoutRange { .. }) && in_range_words
                    || matches!(err, LimitError::NotADuration { .. }),
                "{bad}: {err}"
            );
        }
        assert!(timeout(&json!(null)).is_err());
        assert!(declared_timeout(f64::NAN).is_err());
        assert!(declared_timeout(1e300).is_err());
        assert_eq!(declared_timeout(60.0), Ok(Duration::from_secs(60)));
    }

    #[test]
    fn the_matrix_product_does_not_overflow() {
        assert_eq!(matrix_nodes([5, 20_000]), 100_000);
        assert_eq!(
            matrix_nodes([usize::MAX, usize::MAX, usize::MAX]),
            u128::MAX
        );
        assert_eq!(thousands(10_000_000), "10,000,000");
        assert_eq!(thousands(999), "999");
        assert_eq!(format_bytes(16 << 20), "16 MiB");
        assert_eq!(format_bytes(1536), "1.5 KiB");
    }

    #[test]
    fn special_files_are_refused_before_they_are_read() {
        let err = hash_file(Path::new("/dev/zero")).unwrap_err();
        assert!(
            matches!(
                err,
                FileParamError::NotRegular {
                    kind: "a character device",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("/dev/zero is a character device"),
            "{err}"
        );
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let err = hash_file(&fifo).unwrap_err().to_string();
        assert!(err.contains("is a FIFO"), "{err}");
        let err = hash_file(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        let missing = hash_file(&dir.path().join("missing.json")).unwrap_err();
        assert!(
            matches!(missing, FileParamError::Unreadable { .. }),
            "{missing}"
        );
        let file = dir.path().join("f.json");
        std::fs::write(&file, "{}").unwrap();
        let (_, digest) = hash_file(&file).unwrap();
        assert_eq!(digest, blake3::hash(b"{}").to_hex().to_string());
        let err = read_pipeline(Path::new("/dev/zero")).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
    }
}
