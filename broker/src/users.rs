//! Users: RabbitMQ's password hashing and the users table the broker keeps (replicated state,
//! changed only through `Op::PutUser` and `Op::DeleteUser` in `Broker::apply`).
//!
//! Hashes are RabbitMQ's `rabbit_password_hashing_sha256`: base64 of a 4-byte salt followed by
//! SHA-256(salt ++ password), so a `password_hash` exported from RabbitMQ logs in here with the
//! same password. The salt is drawn by the caller (the op carries the hash), which keeps
//! `apply` deterministic.

use base64::Engine;
use sha2::{Digest, Sha256};

/// A user as the broker keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub password_hash: String,
    pub tags: Vec<String>,
}

/// RabbitMQ's SHA-256 password hash of `password` with `salt`.
pub fn hash_password(password: &str, salt: [u8; 4]) -> String {
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut raw = salt.to_vec();
    raw.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// Whether `password` matches a stored hash (anything that is not a well-formed hash matches
/// nothing).
pub fn password_matches(password_hash: &str, password: &str) -> bool {
    let Ok(raw) = base64::engine::general_purpose::STANDARD.decode(password_hash) else {
        return false;
    };
    if raw.len() != 4 + 32 {
        return false;
    }
    let salt = [raw[0], raw[1], raw[2], raw[3]];
    // Recompute with the stored salt and compare the encodings (the client never sees the
    // hash, so the comparison's timing gives nothing away worth a constant-time compare).
    hash_password(password, salt) == password_hash
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_as_rabbitmq_does() {
        // RabbitMQ's layout: the 4 salt bytes, then SHA-256(salt ++ password), base64. (A hash
        // exported from a real RabbitMQ is checked with issue 14's definitions import.)
        let h = hash_password("guest", [0x90, 0x8d, 0xc6, 0x0a]);
        assert!(password_matches(&h, "guest"));
        assert!(!password_matches(&h, "guesT"));
        assert!(!password_matches("not base64!", "guest"));
        assert!(!password_matches("AAAA", "guest"));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&h)
            .unwrap();
        assert_eq!(&raw[..4], &[0x90, 0x8d, 0xc6, 0x0a]);
        assert_eq!(raw.len(), 36);
    }
}
