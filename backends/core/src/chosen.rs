//! Greedy tokens chosen on the device and fed back without a round trip.
//!
//! A backend whose logits live in device memory can pick the greedy token
//! there ([`Backend::choose_greedy`]), embed it for the next forward pass
//! ([`Backend::embed_chosen`]) and read it back later
//! ([`Backend::start_reading_chosen`], [`Backend::finish_reading_chosen`]):
//! the host records token t+1 while the device still works on token t, and
//! the device never waits for the host between tokens.
//!
//! The choice is `sampling::argmax`'s: the first largest logit, NaN never
//! winning, and index 0 when the first logit is NaN. Backends reduce in
//! parts; [`Best`] is the order every part and every merge keeps.

use std::any::Any;

/// Where a part of the vocabulary has no candidate (all NaN).
pub const NO_TOKEN: u32 = u32::MAX;

/// One part's best logit and its index ([`NO_TOKEN`] when none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Best {
    pub value: f32,
    pub index: u32,
}

impl Best {
    pub const NONE: Best = Best { value: f32::NEG_INFINITY, index: NO_TOKEN };

    /// Whether `self` beats `other`: a real index beats none, then the larger
    /// value, then the lower index (values equal as floats, so +0 = -0).
    pub fn beats(&self, other: &Best) -> bool {
        self.index != NO_TOKEN
            && (other.index == NO_TOKEN || self.value > other.value || (self.value == other.value && self.index < other.index))
    }

    /// The best of `logits[start..]`'s values, indexed from `start`; a NaN
    /// logit is no candidate, except that a NaN at index 0 is chosen outright
    /// (its value is then +inf, which only index 0 can hold against ties).
    pub fn of(logits: &[f32], start: u32) -> Best {
        let mut best = Best::NONE;
        for (i, &v) in logits.iter().enumerate() {
            let index = start + i as u32;
            let cand = match (v.is_nan(), index) {
                (true, 0) => Best { value: f32::INFINITY, index: 0 },
                (true, _) => continue,
                _ => Best { value: v, index },
            };
            if cand.beats(&best) {
                best = cand;
            }
        }
        best
    }

    /// The token that parts' bests (from `[value bits, index]` pairs) choose:
    /// 0 when no part has a candidate (every logit NaN).
    pub fn merge(pairs: &[[u32; 2]]) -> u32 {
        let mut best = Best::NONE;
        for &[bits, index] in pairs {
            let cand = Best { value: f32::from_bits(bits), index };
            if cand.beats(&best) {
                best = cand;
            }
        }
        if best.index == NO_TOKEN {
            0
        } else {
            best.index
        }
    }
}

/// The rule as a plain scan (the tests' oracle): the first logit greater
/// than the best so far, starting from logit 0 (which a NaN then keeps).
pub fn scan(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A chosen token's read-back, started and not finished yet.
pub struct PendingRead(pub Box<dyn Any + Send>);

#[cfg(test)]
mod tests {
    use super::*;

    fn chosen(logits: &[f32], part: usize) -> u32 {
        let pairs: Vec<[u32; 2]> = logits
            .chunks(part)
            .enumerate()
            .map(|(k, c)| {
                let b = Best::of(c, (k * part) as u32);
                [b.value.to_bits(), b.index]
            })
            .collect();
        Best::merge(&pairs)
    }

    #[test]
    fn parts_choose_what_a_plain_scan_chooses() {
        let nan = f32::NAN;
        let (inf, ninf) = (f32::INFINITY, f32::NEG_INFINITY);
        let cases: Vec<Vec<f32>> = vec![
            vec![1.0, 3.0, 3.0, 2.0],
            vec![nan, 5.0, 7.0],
            vec![2.0, nan, 7.0, nan],
            vec![-0.0, 0.0, 0.0],
            vec![0.0, -0.0],
            vec![ninf, ninf, ninf],
            vec![1.0, inf, inf, 2.0],
            vec![nan, nan, nan],
            vec![ninf, nan, -1.0],
        ];
        for l in &cases {
            for part in 1..=l.len() {
                assert_eq!(chosen(l, part), scan(l), "{l:?} in parts of {part}");
            }
        }
        let mut x = 12345u32;
        for n in 1..60 {
            let l: Vec<f32> = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(1664525).wrapping_add(1013904223);
                    ((x >> 24) % 7) as f32 - 3.0
                })
                .collect();
            for part in [1, 3, 8, 64] {
                assert_eq!(chosen(&l, part), scan(&l), "{l:?} in parts of {part}");
            }
        }
    }
}
