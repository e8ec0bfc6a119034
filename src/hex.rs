//! Lowercase hex of digests (sha256, sha1), as caches, manifests and APIs spell them.

/// `bytes` as lowercase hex, two digits each.
pub fn lower(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_lowercase_digits_per_byte() {
        assert_eq!(super::lower(&[0x00, 0x0f, 0xab, 0xff]), "000fabff");
    }
}
