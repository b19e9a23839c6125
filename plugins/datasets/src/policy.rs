//! What the downloader accepts from a server: which redirects it follows, and which `206`
//! answers it appends to a partial download.

use std::path::Path;

use reqwest::Url;

/// Whether a redirect from `from` to `to` may be followed: never to another scheme than http(s)
/// nor from https down to http; to the same origin (scheme, host, port) always; elsewhere only
/// to a host the manifest lists in `redirect_hosts`.
pub fn redirect_allowed(from: &Url, to: &Url, hosts: &[String]) -> bool {
    if !matches!(to.scheme(), "http" | "https") {
        return false;
    }
    if from.scheme() == "https" && to.scheme() != "https" {
        return false;
    }
    from.origin() == to.origin() || hosts.iter().any(|pattern| host_matches(pattern, to))
}

/// Why following `current` → `to` is refused; `from` names `current` in the sentence.
pub fn redirect_refusal(from: &str, current: &Url, to: &Url, manifest: &Path) -> String {
    if !matches!(to.scheme(), "http" | "https") {
        return format!("{from} redirects to {to}, which is not http(s)");
    }
    if current.scheme() == "https" && to.scheme() == "http" {
        return format!("{from} redirects to {to}, from https down to plain http");
    }
    let host = match (to.host_str(), to.port()) {
        (Some(name), Some(port)) => format!("{name}:{port}"),
        (Some(name), None) => name.to_string(),
        (None, _) => to.to_string(),
    };
    format!(
        "{from} redirects to {to}, another origin; list \"{host}\" in `redirect_hosts:` of {} if you trust that host",
        manifest.display()
    )
}

/// `host`, `host:port` or `*.domain` (any subdomain of it, not the domain itself).
pub fn host_matches(pattern: &str, url: &Url) -> bool {
    let Some(host) = url.host_str() else {
        return false;
    };
    let (name, port) = split_port(pattern);
    if port.is_some_and(|p| Some(p) != url.port_or_known_default()) {
        return false;
    }
    let name = name.to_ascii_lowercase();
    match name.strip_prefix("*.") {
        Some(domain) => host
            .strip_suffix(domain)
            .is_some_and(|rest| rest.ends_with('.') && rest.len() > 1),
        None => host == name,
    }
}

/// A `redirect_hosts` entry that names no host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a host; write `cdn.example.org`, `cdn.example.org:8443` or `*.example.org` (no scheme or path)")]
pub struct HostPatternError(pub String);

/// Why a `206` answer cannot continue a partial download.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error("it has no Content-Range")]
    Missing,
    #[error("its Content-Range `{0}` is malformed")]
    Malformed(String),
    #[error("its Content-Range `{value}` starts at byte {start}, not at {offset} where the partial download ends")]
    Start {
        value: String,
        start: u64,
        offset: u64,
    },
    #[error("its Content-Range `{0}` stops before the end of the file")]
    Short(String),
    #[error("its Content-Range `{value}` disagrees with Content-Length {length}")]
    Length { value: String, length: u64 },
}

/// Checks a `redirect_hosts` entry; the error says what a valid one looks like.
pub fn check_host_pattern(pattern: &str) -> Result<(), HostPatternError> {
    let (name, _) = split_port(pattern);
    let bare = name.strip_prefix("*.").unwrap_or(name);
    let valid = !bare.is_empty()
        && !bare.contains('*')
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || ".-[]:".contains(c));
    if valid && !pattern.ends_with(':') {
        Ok(())
    } else {
        Err(HostPatternError(pattern.to_string()))
    }
}

fn split_port(pattern: &str) -> (&str, Option<u16>) {
    match pattern.rsplit_once(':') {
        // An IPv6 literal's colons are inside its brackets.
        Some((name, port))
            if !name.ends_with(':') && (!name.contains(':') || name.ends_with(']')) =>
        {
            match port.parse() {
                Ok(port) => (name, Some(port)),
                Err(_) => (pattern, None),
            }
        }
        _ => (pattern, None),
    }
}

/// What a `206` answer covers, once it is known to continue the partial download.
#[derive(Debug, PartialEq, Eq)]
pub struct Continuation {
    /// The whole file's size, when the server says it.
    pub total: Option<u64>,
}

/// Checks a `206`'s `Content-Range` against a request for the bytes from `offset` to the end:
/// it must start at `offset`, run to the end of the file, and agree with `Content-Length`.
pub fn check_content_range(
    header: Option<&str>,
    offset: u64,
    length: Option<u64>,
) -> Result<Continuation, RangeError> {
    let value = header.ok_or(RangeError::Missing)?;
    let malformed = || RangeError::Malformed(value.to_string());
    let spec = value.trim().strip_prefix("bytes ").ok_or_else(malformed)?;
    let (range, total) = spec.split_once('/').ok_or_else(malformed)?;
    let (start, end) = range.split_once('-').ok_or_else(malformed)?;
    let start: u64 = start.trim().parse().map_err(|_| malformed())?;
    let end: u64 = end.trim().parse().map_err(|_| malformed())?;
    let total: Option<u64> = match total.trim() {
        "*" => None,
        total => Some(total.parse().map_err(|_| malformed())?),
    };
    if end < start {
        return Err(malformed());
    }
    if start != offset {
        return Err(RangeError::Start {
            value: value.to_string(),
            start,
            offset,
        });
    }
    if let Some(total) = total {
        if end + 1 != total {
            return Err(RangeError::Short(value.to_string()));
        }
    }
    if let Some(length) = length {
        if length != end - start + 1 {
            return Err(RangeError::Length {
                value: value.to_string(),
                length,
            });
        }
    }
    Ok(Continuation {
        total: total.or(Some(end + 1)),
    })
}

/// The total size a `416` answer gives (`Content-Range: bytes */N`), if any.
pub fn unsatisfied_total(header: Option<&str>) -> Option<u64> {
    header?.trim().strip_prefix("bytes */")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> Url {
        Url::parse(text).unwrap()
    }

    #[test]
    fn redirects_stay_in_the_origin_unless_the_host_is_listed() {
        let from = url("https://huggingface.co/datasets/x/resolve/main/a.zst");
        assert!(redirect_allowed(
            &from,
            &url("https://huggingface.co/other"),
            &[]
        ));
        assert!(!redirect_allowed(
            &from,
            &url("https://cdn-lfs.hf.co/a"),
            &[]
        ));
        assert!(!redirect_allowed(
            &from,
            &url("https://huggingface.co:444/a"),
            &[]
        ));
        let hosts = vec!["*.hf.co".to_string()];
        assert!(redirect_allowed(
            &from,
            &url("https://cas-bridge.xethub.hf.co/a"),
            &hosts
        ));
        assert!(!redirect_allowed(&from, &url("https://hf.co/a"), &hosts));
        assert!(!redirect_allowed(
            &from,
            &url("https://evilhf.co/a"),
            &hosts
        ));
        assert!(
            !redirect_allowed(&from, &url("http://cdn.hf.co/a"), &hosts),
            "no downgrade"
        );
        assert!(!redirect_allowed(&from, &url("file:///etc/passwd"), &hosts));
        let local = url("http://127.0.0.1:8000/a");
        let ports = vec!["127.0.0.1:9000".to_string()];
        assert!(redirect_allowed(
            &local,
            &url("http://127.0.0.1:9000/b"),
            &ports
        ));
        assert!(!redirect_allowed(
            &local,
            &url("http://127.0.0.1:9001/b"),
            &ports
        ));
    }

    #[test]
    fn host_patterns_are_checked() {
        for good in [
            "cdn.example.org",
            "cdn.example.org:8443",
            "*.hf.co",
            "127.0.0.1:80",
            "[::1]:80",
        ] {
            assert!(check_host_pattern(good).is_ok(), "{good}");
        }
        for bad in [
            "https://cdn.example.org",
            "cdn.example.org/path",
            "*",
            "a.*.org",
            "",
            "x:",
        ] {
            assert!(check_host_pattern(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_206_must_continue_where_the_partial_ends() {
        assert_eq!(
            check_content_range(Some("bytes 100-199/200"), 100, Some(100)),
            Ok(Continuation { total: Some(200) })
        );
        assert_eq!(
            check_content_range(Some("bytes 100-199/*"), 100, None),
            Ok(Continuation { total: Some(200) })
        );
        let wrong_start = check_content_range(Some("bytes 0-199/200"), 100, Some(200)).unwrap_err();
        assert!(
            wrong_start
                .to_string()
                .contains("starts at byte 0, not at 100"),
            "{wrong_start}"
        );
        assert_eq!(
            check_content_range(Some("bytes 100-149/200"), 100, Some(50)),
            Err(RangeError::Short("bytes 100-149/200".into()))
        );
        assert!(check_content_range(None, 100, Some(100)).is_err());
        assert!(check_content_range(Some("bytes 100-149/200"), 100, Some(50)).is_err());
        assert!(check_content_range(Some("bytes 100-199/200"), 100, Some(7)).is_err());
        assert!(check_content_range(Some("items 100-199/200"), 100, None).is_err());
        assert!(check_content_range(Some("bytes 199-100/200"), 199, None).is_err());
        assert_eq!(unsatisfied_total(Some("bytes */200")), Some(200));
        assert_eq!(unsatisfied_total(Some("bytes 0-1/200")), None);
    }
}
