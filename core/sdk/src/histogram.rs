//! Document-length histograms, in LongCA-bench's JSON format (`{"[64,96)": 0.07, ...}`), and the
//! document sampler that draws from them exactly as LongCA-bench's `generate_seqlens` does.

use serde_json::{Map, Value};

use crate::rng::PyRandom;

#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    /// Inclusive lower bound.
    pub lo: u64,
    /// Upper bound as written (`[lo,hi)`); LongCA-bench's sampler draws it inclusively.
    pub hi: u64,
    pub weight: f64,
}

/// What is wrong with a histogram file.
#[derive(Debug, thiserror::Error)]
pub enum HistogramError {
    #[error("not JSON: {0}")]
    NotJson(serde_json::Error),
    #[error("expected a JSON object mapping \"[lo,hi)\" to weights")]
    NotAnObject,
    #[error("bucket `{bucket}`: `{part}` is too large")]
    TooLarge { bucket: String, part: String },
    #[error("bucket `{0}` must hold two integers, like \"[64,96)\"")]
    NotTwoIntegers(String),
    #[error("bucket `{0}` ends before it starts")]
    Reversed(String),
    #[error("bucket `{bucket}`: the weight must be a non-negative number, found {found}")]
    Weight { bucket: String, found: String },
    #[error("the histogram has no buckets")]
    NoBuckets,
    #[error("the histogram's weights sum to zero")]
    ZeroWeight,
    #[error("every bucket holds only zero-length documents")]
    OnlyEmptyDocuments,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<Bucket>,
}

impl Histogram {
    /// Parses LongCA-bench's format: a JSON object whose keys hold two integers and whose values
    /// are non-negative weights, in file order.
    pub fn from_longca_json(text: &str) -> Result<Histogram, HistogramError> {
        let value: Value = serde_json::from_str(text).map_err(HistogramError::NotJson)?;
        let map = value.as_object().ok_or(HistogramError::NotAnObject)?;
        let mut buckets = Vec::with_capacity(map.len());
        for (key, weight) in map {
            let numbers: Vec<u64> = key
                .split(|c: char| !c.is_ascii_digit())
                .filter(|part| !part.is_empty())
                .map(|part| {
                    part.parse::<u64>().map_err(|_| HistogramError::TooLarge {
                        bucket: key.clone(),
                        part: part.to_string(),
                    })
                })
                .collect::<Result<_, _>>()?;
            let [lo, hi] = numbers[..] else {
                return Err(HistogramError::NotTwoIntegers(key.clone()));
            };
            if hi < lo {
                return Err(HistogramError::Reversed(key.clone()));
            }
            let weight = weight
                .as_f64()
                .filter(|w| w.is_finite() && *w >= 0.0)
                .ok_or_else(|| HistogramError::Weight {
                    bucket: key.clone(),
                    found: weight.to_string(),
                })?;
            buckets.push(Bucket { lo, hi, weight });
        }
        let histogram = Histogram { buckets };
        histogram.check()?;
        Ok(histogram)
    }

    fn check(&self) -> Result<(), HistogramError> {
        if self.buckets.is_empty() {
            return Err(HistogramError::NoBuckets);
        }
        if self.buckets.iter().map(|b| b.weight).sum::<f64>() <= 0.0 {
            return Err(HistogramError::ZeroWeight);
        }
        if self.buckets.iter().all(|b| b.hi == 0) {
            return Err(HistogramError::OnlyEmptyDocuments);
        }
        Ok(())
    }

    pub fn to_longca_json(&self) -> String {
        let mut map = Map::new();
        for bucket in &self.buckets {
            map.insert(
                format!("[{},{})", bucket.lo, bucket.hi),
                Value::from(bucket.weight),
            );
        }
        serde_json::to_string_pretty(&Value::Object(map)).unwrap_or_default()
    }

    /// attnbench's built-in histogram when no corpus is given. It is not measured from any
    /// corpus: document lengths are log-uniform between 32 and 64K tokens (equal weight per
    /// power-of-two octave), which exercises short and long documents alike.
    pub fn synthetic() -> Histogram {
        let buckets = (5..16)
            .map(|octave| Bucket {
                lo: 1 << octave,
                hi: 1 << (octave + 1),
                weight: 1.0,
            })
            .collect();
        Histogram { buckets }
    }

    /// Document lengths summing to exactly `total`, drawn like LongCA-bench's `generate_seqlens`:
    /// normalise the weights (left-to-right sum), then until the total is reached pick a bucket
    /// with `choices`, draw `randint(lo, hi)` (both ends inclusive), clip to what remains and
    /// raise zero to one.
    pub fn sample_documents(&self, total: u64, rng: &mut PyRandom) -> Vec<u64> {
        let sum: f64 = self.buckets.iter().fold(0.0, |acc, b| acc + b.weight);
        let weights: Vec<f64> = self.buckets.iter().map(|b| b.weight / sum).collect();
        let mut documents = Vec::new();
        let mut current = 0u64;
        while current < total {
            let remaining = total - current;
            let bucket = &self.buckets[rng.choice_weighted(&weights)];
            let drawn = rng.randint(bucket.lo as i64, bucket.hi as i64) as u64;
            let length = drawn.min(remaining).max(1);
            documents.push(length);
            current += length;
        }
        documents
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_longca_format_in_order() {
        let text = r#"{"[0,32)": 0.25, "[32,64)": 0.5, "[64,9000)": 0.25}"#;
        let histogram = Histogram::from_longca_json(text).unwrap();
        assert_eq!(
            histogram.buckets[2],
            Bucket {
                lo: 64,
                hi: 9000,
                weight: 0.25
            }
        );
        assert_eq!(
            Histogram::from_longca_json(&histogram.to_longca_json()).unwrap(),
            histogram
        );
    }

    #[test]
    fn malformed_histograms_are_refused_with_the_reason() {
        use HistogramError as E;
        let refused = |text: &str| Histogram::from_longca_json(text).unwrap_err();
        assert!(matches!(refused("[1, 2]"), E::NotAnObject));
        assert!(refused("[1, 2]").to_string().contains("JSON object"));
        assert!(matches!(refused(r#"{"[1,2,3)": 1}"#), E::NotTwoIntegers(key) if key == "[1,2,3)"));
        assert!(matches!(refused(r#"{"[9,2)": 1}"#), E::Reversed(key) if key == "[9,2)"));
        assert!(matches!(refused(r#"{"[1,2)": -1}"#), E::Weight { .. }));
        assert!(matches!(refused(r#"{"[1,2)": 0}"#), E::ZeroWeight));
        assert!(matches!(refused("{}"), E::NoBuckets));
    }

    #[test]
    fn documents_sum_to_the_total() {
        let mut rng = PyRandom::new(1);
        for total in [1, 7, 1000, 65536] {
            let documents = Histogram::synthetic().sample_documents(total, &mut rng);
            assert_eq!(documents.iter().sum::<u64>(), total);
            assert!(documents.iter().all(|&d| d >= 1));
        }
    }
}
