//! "Did you mean …?" for names people type.

/// The closest of `candidates` to `word`, if it is close enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|candidate| (strsim::damerau_levenshtein(word, candidate), candidate))
        .filter(|(distance, candidate)| *distance <= (word.len().max(candidate.len()) / 3).max(2))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// "did you mean `x`?", or the list of what exists (`what: a, b, c`).
pub fn suggestion<'a>(
    word: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    what: &str,
) -> String {
    // Each name once, in first-seen order: stages of one plugin share most of their parameters.
    let mut unique: Vec<&str> = Vec::new();
    for candidate in candidates {
        if !unique.contains(&candidate) {
            unique.push(candidate);
        }
    }
    let candidates = unique;
    match nearest(word, candidates.iter().copied()) {
        Some(best) => format!("did you mean `{best}`?"),
        None if candidates.is_empty() => format!("there are no {what}"),
        None => format!("{what}: {}", candidates.join(", ")),
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
        assert_eq!(
            suggestion("zzz", names, "parameters"),
            "parameters: kernel, direction, seqlen"
        );
        assert_eq!(
            suggestion("zzz", ["seqlen", "kernel", "seqlen"], "parameters"),
            "parameters: seqlen, kernel"
        );
    }
}
