//! The element types a KV cache can store keys and values in, as the user
//! names them (`--kv-cache f32|f16|q8`), and what one row of each costs.

use std::fmt;
use std::str::FromStr;

/// How a KV cache stores keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheType {
    /// f32: exact (what `:exact` backends keep for the oracle tests).
    F32,
    /// f16: a relative error of at most 2^-11 per value.
    F16,
    /// llama.cpp's q8_0: blocks of [`Q8_BLOCK`] values, each block one f16
    /// scale `d` (its largest magnitude / 127) and the values as int8,
    /// `x = d * q`: an error of at most `d / 2` per value.
    Q8,
}

/// Values per q8 block (one scale each).
pub const Q8_BLOCK: usize = 32;

impl KvCacheType {
    /// Bytes of `values` keys (or values) in this type; for q8 `values` is a
    /// multiple of [`Q8_BLOCK`] (a head dim): 34 bytes per 32 values.
    pub fn bytes(self, values: usize) -> usize {
        match self {
            KvCacheType::F32 => 4 * values,
            KvCacheType::F16 => 2 * values,
            KvCacheType::Q8 => values + 2 * values.div_ceil(Q8_BLOCK),
        }
    }

    /// The name `--kv-cache` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheType::F32 => "f32",
            KvCacheType::F16 => "f16",
            KvCacheType::Q8 => "q8",
        }
    }
}

impl fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvCacheType {
    type Err = String;

    fn from_str(text: &str) -> Result<KvCacheType, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "f32" | "exact" => Ok(KvCacheType::F32),
            "f16" => Ok(KvCacheType::F16),
            "q8" | "q8_0" => Ok(KvCacheType::Q8),
            _ => Err("expected f32 (or exact), f16 or q8 (llama.cpp's q8_0)".to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_rows_cost_what_they_hold() {
        for t in [KvCacheType::F32, KvCacheType::F16, KvCacheType::Q8] {
            assert_eq!(t.name().parse::<KvCacheType>(), Ok(t));
        }
        assert_eq!("Q8_0".parse::<KvCacheType>(), Ok(KvCacheType::Q8));
        assert_eq!("exact".parse::<KvCacheType>(), Ok(KvCacheType::F32));
        assert!("q4".parse::<KvCacheType>().unwrap_err().contains("f16 or q8"));
        assert_eq!([KvCacheType::F32, KvCacheType::F16, KvCacheType::Q8].map(|t| t.bytes(128)), [512, 256, 136]);
    }
}
