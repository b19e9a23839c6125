//! CPython's `random.Random`, bit for bit: MT19937 with CPython's seeding and derived draws, so that
//! with the same seed and histogram attnbench draws the same documents and parameters as
//! LongCA-bench (Python 3.11).

const N: usize = 624;
const M: usize = 397;

#[derive(Clone)]
pub struct PyRandom {
    state: [u32; N],
    index: usize,
}

impl std::fmt::Debug for PyRandom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyRandom")
            .field("index", &self.index)
            .finish()
    }
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> Self {
        let mut key: Vec<u32> = Vec::new();
        let mut rest = seed;
        while rest > 0 {
            key.push(rest as u32);
            rest >>= 32;
        }
        if key.is_empty() {
            key.push(0);
        }
        let mut rng = PyRandom {
            state: [0; N],
            index: N,
        };
        rng.init_by_array(&key);
        rng
    }

    fn init_genrand(&mut self, seed: u32) {
        self.state[0] = seed;
        for i in 1..N {
            let previous = self.state[i - 1];
            self.state[i] = 1_812_433_253u32
                .wrapping_mul(previous ^ (previous >> 30))
                .wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let previous = self.state[i - 1];
            self.state[i] = (self.state[i] ^ (previous ^ (previous >> 30)).wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let previous = self.state[i - 1];
            self.state[i] = (self.state[i]
                ^ (previous ^ (previous >> 30)).wrapping_mul(1_566_083_941))
            .wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.state[0] = self.state[N - 1];
                i = 1;
            }
        }
        self.state[0] = 0x8000_0000;
    }

    fn twist(&mut self) {
        for i in 0..N {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % N] & 0x7fff_ffff);
            let mut next = self.state[(i + M) % N] ^ (y >> 1);
            if y & 1 != 0 {
                next ^= 0x9908_b0df;
            }
            self.state[i] = next;
        }
        self.index = 0;
    }

    /// MT19937's next 32-bit output (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `random()`: a float in [0, 1) with 53 random bits.
    pub fn random(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `getrandbits(k)` for 0 < k ≤ 64: 32-bit words from least to most significant.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k > 0 && k <= 64, "getrandbits supports 1..=64 bits");
        if k <= 32 {
            return (self.next_u32() >> (32 - k)) as u64;
        }
        let low = self.next_u32() as u64;
        let high = (self.next_u32() >> (64 - k)) as u64;
        low | (high << 32)
    }

    /// `_randbelow(n)` for n > 0: rejection sampling on `bit_length(n)` bits.
    pub fn randbelow(&mut self, n: u64) -> u64 {
        assert!(n > 0, "randbelow needs a positive bound");
        let bits = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(bits);
            if r < n {
                return r;
            }
        }
    }

    /// `randint(a, b)`, both ends inclusive.
    pub fn randint(&mut self, a: i64, b: i64) -> i64 {
        assert!(b >= a, "randint needs a <= b");
        a + self.randbelow((b - a) as u64 + 1) as i64
    }

    /// `choices(range(len(weights)), weights)[0]`: an index drawn with the given weights,
    /// accumulated left to right as CPython does.
    pub fn choice_weighted(&mut self, weights: &[f64]) -> usize {
        let mut cumulative = Vec::with_capacity(weights.len());
        let mut total = 0.0;
        for weight in weights {
            total += weight;
            cumulative.push(total);
        }
        let target = self.random() * total;
        let hi = weights.len().saturating_sub(1);
        // bisect_right(cumulative, target, 0, hi)
        cumulative[..hi].partition_point(|&c| c <= target)
    }

    /// `shuffle(items)`, in place.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values printed by CPython 3.11: `r = random.Random(42)` and the calls named.
    #[test]
    fn matches_cpython_random_42() {
        let mut rng = PyRandom::new(42);
        assert_eq!(rng.random(), 0.6394267984578837);
        assert_eq!(rng.random(), 0.025010755222666936);
        let mut rng = PyRandom::new(42);
        assert_eq!(rng.getrandbits(32), 2746317213);
        let mut rng = PyRandom::new(42);
        let draws: Vec<i64> = (0..5).map(|_| rng.randint(1, 10)).collect();
        assert_eq!(draws, vec![2, 1, 5, 4, 4]);
    }

    #[test]
    fn shuffle_matches_cpython() {
        let mut rng = PyRandom::new(42);
        let mut items: Vec<u32> = (0..10).collect();
        rng.shuffle(&mut items);
        assert_eq!(items, vec![7, 3, 2, 8, 5, 6, 9, 4, 0, 1]);
    }

    #[test]
    fn weighted_choices_and_wide_draws_match_cpython() {
        let mut rng = PyRandom::new(42);
        let picks: Vec<usize> = (0..5)
            .map(|_| rng.choice_weighted(&[0.1, 0.2, 0.3, 0.4]))
            .collect();
        assert_eq!(picks, vec![3, 0, 1, 1, 3]);
        let mut rng = PyRandom::new(7);
        assert_eq!(rng.getrandbits(40), 1040772936760);
        assert_eq!(rng.randint(0, 1_000_000_000_000), 434439589175);
    }

    #[test]
    fn large_seeds_use_several_key_words() {
        let mut a = PyRandom::new(1 << 40);
        let mut b = PyRandom::new(1 << 8);
        assert_ne!(a.next_u32(), b.next_u32());
    }
}
