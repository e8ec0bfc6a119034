//! Rotary position embedding as a model defines it: plain RoPE (`theta`) or
//! YaRN-scaled (Peng et al. 2023, "YaRN: Efficient Context Window Extension
//! of Large Language Models"; the `rope_scaling` keys transformers reads).
//! The angles and the attention factor are computed here once, on the host,
//! in f64; every backend rotates with the table [`Rope::table`] gives, so the
//! CPU and the GPU agree bit for bit on its values.

use std::f64::consts::PI;

/// How positions become rotation angles.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// The base of the frequencies: pair `i` of `d` rotary dims turns at
    /// `theta^(-2i/d)` radians per position.
    pub theta: f32,
    pub yarn: Option<Yarn>,
}

/// YaRN ("NTK-by-parts" interpolation and an attention factor): pairs that
/// turn more than `beta_fast` times over the trained context keep their
/// frequency, pairs that turn fewer than `beta_slow` times are slowed by
/// `factor`, those between blend linearly; cos and sin are multiplied by
/// `attention_factor` (so the rotated part of each query-key product by its
/// square).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// How much longer the context is than the one the model was trained at.
    pub factor: f64,
    /// The trained context (`original_max_position_embeddings`).
    pub original_context: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub attention_factor: f64,
    /// Round the blend's bounds to whole pairs (floor, ceil), as the paper does.
    pub truncate: bool,
}

impl Yarn {
    /// The paper's attention factor for a context `factor` times longer:
    /// `0.1 ln(factor) + 1` (1 at factor 1 or less); with DeepSeek's `mscale`
    /// and `mscale_all_dim` (both non-zero), the ratio of that formula at each.
    pub fn default_attention_factor(factor: f64, mscale: Option<f64>, mscale_all_dim: Option<f64>) -> f64 {
        let m = |scale: f64| if factor <= 1.0 { 1.0 } else { 0.1 * scale * factor.ln() + 1.0 };
        match (mscale, mscale_all_dim) {
            (Some(a), Some(b)) if a != 0.0 && b != 0.0 => m(a) / m(b),
            _ => m(1.0),
        }
    }

    /// The (fractional) pair index whose wavelength fits `rotations` times
    /// into the trained context, for `dims` rotary dims at base `theta`.
    fn pair_turning(&self, rotations: f64, dims: f64, theta: f64) -> f64 {
        dims * (self.original_context / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln())
    }

    /// The pair range `[low, high]` over which the blend goes from the
    /// original frequency (below `low`) to the slowed one (above `high`).
    fn blend_range(&self, dims: usize, theta: f64) -> (f64, f64) {
        let d = dims as f64;
        let (mut low, mut high) = (self.pair_turning(self.beta_fast, d, theta), self.pair_turning(self.beta_slow, d, theta));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        (low.max(0.0), high.min(d - 1.0))
    }
}

impl Rope {
    pub fn plain(theta: f32) -> Rope {
        Rope { theta, yarn: None }
    }

    /// Radians per position of each of the `rotary_dim / 2` pairs.
    pub fn inverse_frequencies(&self, rotary_dim: usize) -> Vec<f64> {
        let half = rotary_dim / 2;
        let theta = self.theta as f64;
        let original = (0..half).map(|i| theta.powf(-((2 * i) as f64) / rotary_dim as f64));
        let Some(yarn) = self.yarn else {
            return original.collect();
        };
        let (low, mut high) = yarn.blend_range(rotary_dim, theta);
        if high == low {
            high += 0.001; // a one-pair range still blends
        }
        original
            .enumerate()
            .map(|(i, f)| {
                // 0: keep the trained frequency; 1: slow it by the factor.
                let slowed = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                f / yarn.factor * slowed + f * (1.0 - slowed)
            })
            .collect()
    }

    /// What cos and sin are multiplied by: YaRN's attention factor, else 1.
    pub fn magnitude(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.attention_factor)
    }

    /// `[tokens, rotary_dim / 2, (cos, sin)]` for positions
    /// `start_pos..start_pos + tokens`: every backend's rotation table.
    pub fn table(&self, rotary_dim: usize, start_pos: usize, tokens: usize) -> Vec<f32> {
        let inv_freq = self.inverse_frequencies(rotary_dim);
        let m = self.magnitude();
        let mut table = Vec::with_capacity(tokens * inv_freq.len() * 2);
        for t in 0..tokens {
            let pos = (start_pos + t) as f64;
            for f in &inv_freq {
                let a = pos * f;
                if self.yarn.is_some() {
                    table.extend([(a.cos() * m) as f32, (a.sin() * m) as f32]);
                } else {
                    table.extend([a.cos() as f32, a.sin() as f32]);
                }
            }
        }
        table
    }

    /// Rotates the first `rotary_dim` values of each `head_dim`-wide head of
    /// `x` (rotate-half layout), token `t` of `x` at `start_pos + t`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, heads_per_token: usize, rotary_dim: usize, start_pos: usize) {
        let half = rotary_dim / 2;
        let tokens = x.len() / (heads_per_token * head_dim).max(1);
        let table = self.table(rotary_dim, start_pos, tokens);
        for (tok, cs) in x.chunks_exact_mut(heads_per_token * head_dim).zip(table.chunks_exact(half.max(1) * 2)) {
            for head in tok.chunks_exact_mut(head_dim) {
                for (i, cs) in cs.chunks_exact(2).enumerate() {
                    let (c, s) = (cs[0], cs[1]);
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * c - b * s;
                    head[i + half] = b * c + a * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn(factor: f64) -> Rope {
        Rope {
            theta: 1e6,
            yarn: Some(Yarn {
                factor,
                original_context: 2048.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attention_factor: Yarn::default_attention_factor(factor, None, None),
                truncate: true,
            }),
        }
    }

    #[test]
    fn yarn_keeps_fast_pairs_slows_slow_ones_and_blends_between() {
        let (plain, scaled) = (Rope::plain(1e6).inverse_frequencies(32), yarn(4.0).inverse_frequencies(32));
        // 32 dims at 1e6 over 2048 positions: pairs up to 2 turn 32+ times, from 7 on fewer than once.
        assert_eq!(yarn(4.0).yarn.unwrap().blend_range(32, 1e6), (2.0, 7.0));
        for i in 0..=2 {
            assert_eq!(scaled[i], plain[i], "pair {i} keeps its frequency");
        }
        for i in 7..16 {
            assert!((scaled[i] - plain[i] / 4.0).abs() <= 1e-15 * plain[i], "pair {i} is slowed by the factor");
        }
        // Pair 4 is 2/5 of the way: 0.6 of the original plus 0.4 of the slowed.
        assert!((scaled[4] - plain[4] * (0.6 + 0.4 / 4.0)).abs() <= 1e-15 * plain[4]);
    }

    #[test]
    fn attention_factor_follows_the_paper_and_deepseek_mscale() {
        assert!((Yarn::default_attention_factor(4.0, None, None) - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        assert_eq!(Yarn::default_attention_factor(1.0, None, None), 1.0);
        assert_eq!(Yarn::default_attention_factor(40.0, Some(0.707), Some(0.707)), 1.0);
        assert_eq!(Yarn::default_attention_factor(40.0, Some(1.0), Some(0.0)), Yarn::default_attention_factor(40.0, None, None));
        // The table carries it: cos^2 + sin^2 is its square.
        let t = yarn(4.0).table(32, 100, 1);
        let m = 0.1 * 4f64.ln() + 1.0;
        assert!(((t[6] * t[6] + t[7] * t[7]) as f64 - m * m).abs() < 1e-5);
    }

    #[test]
    fn plain_table_is_cos_and_sin_of_position_times_frequency() {
        let t = Rope::plain(1e4).table(8, 3, 2);
        let f = 1e4f64.powf(-2.0 / 8.0);
        assert_eq!((t[10], t[11]), (((4.0 * f).cos()) as f32, ((4.0 * f).sin()) as f32));
    }
}
