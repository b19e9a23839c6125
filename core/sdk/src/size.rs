//! Token counts written the way people say them: `1k`, `64K`, `1M` (powers of two) or plain integers.

/// The largest size a parameter may have: 2⁵³, the largest integer that JSON readers holding
/// numbers as doubles (Python's `json` with floats, JavaScript, the report's plots) keep exactly,
/// and far beyond any sequence length or byte count a machine holds (8 Pi).
pub const MAX_SIZE: u64 = 1 << 53;

/// Why a size is refused, naming it as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("`{0}` is not a size; write an integer or one with a suffix k, M or G (powers of two), e.g. 4k")]
    NotASize(String),
    #[error("`{0}` is too large: sizes may be at most 2^53 = {MAX_SIZE}")]
    TooLarge(String),
}

/// Refuses a size above [`MAX_SIZE`], naming it as written.
pub fn check_size(value: u64, written: &str) -> Result<u64, SizeError> {
    if value > MAX_SIZE {
        Err(SizeError::TooLarge(written.to_string()))
    } else {
        Ok(value)
    }
}

/// Parses `1k` = 1024, `64K` = 65536, `1M` = 1048576, `2G`, or a plain non-negative integer.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let trimmed = text.trim();
    let (digits, shift) = match trimmed.chars().last() {
        Some('k' | 'K') => (&trimmed[..trimmed.len() - 1], 10),
        Some('m' | 'M') => (&trimmed[..trimmed.len() - 1], 20),
        Some('g' | 'G') => (&trimmed[..trimmed.len() - 1], 30),
        _ => (trimmed, 0),
    };
    let value: u64 = digits
        .trim()
        .parse()
        .map_err(|_| SizeError::NotASize(text.to_string()))?;
    let value = value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeError::TooLarge(text.to_string()))?;
    check_size(value, trimmed)
}

/// The shortest exact spelling of a size: 1024 → `1k`, 1536 → `1536`, 1048576 → `1M`.
pub fn format_size(value: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "k")] {
        let unit = 1u64 << shift;
        if value >= unit && value.is_multiple_of(unit) {
            return format!("{}{suffix}", value / unit);
        }
    }
    value.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_powers_of_two() {
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("768k"), Ok(768 * 1024));
        assert_eq!(parse_size("4096"), Ok(4096));
    }

    #[test]
    fn garbage_is_refused_with_a_hint() {
        let err = parse_size("4x").unwrap_err();
        assert_eq!(err, SizeError::NotASize("4x".into()));
        assert!(err.to_string().contains("suffix k, M or G"), "{err}");
        assert!(parse_size("k").is_err());
        assert!(parse_size("-1k").is_err());
        assert!(parse_size("99999999999999999G").is_err());
    }

    #[test]
    fn absurd_sizes_are_refused_with_the_limit() {
        assert_eq!(parse_size("8388608G"), Ok(MAX_SIZE));
        let err = parse_size("8388609G").unwrap_err();
        assert!(err.to_string().contains("at most 2^53"), "{err}");
        assert!(check_size(u64::MAX, "18446744073709551615").is_err());
    }

    #[test]
    fn formatting_round_trips() {
        for value in [1, 1000, 1024, 1536, 65536, 1 << 20, 3 << 30] {
            assert_eq!(parse_size(&format_size(value)), Ok(value));
        }
        assert_eq!(format_size(16384), "16k");
    }
}
