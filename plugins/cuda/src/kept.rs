//! What in-process calls prepare once and reuse — work lists, split buffers — by a key of what
//! they depend on. A context-parallel rank brings the same few blocks every repetition, and
//! preparing them can take longer than their kernels; the map is bounded (emptied when full) so
//! that a long run of distinct shapes cannot hold device memory without end.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

pub struct Kept<K, V> {
    map: Mutex<HashMap<K, Arc<V>>>,
    limit: usize,
}

impl<K: Eq + Hash, V> Kept<K, V> {
    /// At most `limit` values at once.
    pub fn new(limit: usize) -> Self {
        Kept {
            map: Mutex::new(HashMap::new()),
            limit,
        }
    }

    /// The value kept for `key`, or the one `make` returns, then kept. `make` runs without the
    /// lock held (it may launch device work); a failure is returned and nothing is kept.
    pub fn get_or_make<E>(&self, key: K, make: impl FnOnce() -> Result<V, E>) -> Result<Arc<V>, E> {
        // A panic while the lock was held left the map whole: its guard is taken back.
        let kept = self
            .map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        if let Some(value) = kept {
            return Ok(value);
        }
        let made = Arc::new(make()?);
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= self.limit {
            map.clear();
        }
        map.insert(key, made.clone());
        Ok(made)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::Arc;

    use super::Kept;

    #[test]
    fn values_are_made_once_kept_up_to_the_limit_and_failures_are_not_kept() {
        let kept = Kept::new(2);
        let made = Cell::new(0);
        let get = |key: u32| {
            kept.get_or_make(key, || {
                made.set(made.get() + 1);
                Ok::<_, ()>(key * 10)
            })
        };
        let first = get(1).unwrap();
        assert!(Arc::ptr_eq(&first, &get(1).unwrap()));
        get(2).unwrap();
        // Full at 2: the third key empties the map, so 1 is made again.
        get(3).unwrap();
        assert_eq!(*get(1).unwrap(), 10);
        assert_eq!(made.get(), 4);
        assert_eq!(
            kept.get_or_make(9, || Err::<u32, _>("refused")),
            Err("refused")
        );
        assert_eq!(*kept.get_or_make(9, || Ok::<_, ()>(90)).unwrap(), 90);
    }
}
