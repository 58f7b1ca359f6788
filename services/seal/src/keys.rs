//! Key-encryption keys: the operator's keys that wrap every data key.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom, SystemRandom};
use zeroize::Zeroizing;

use crate::{DataKey, UnsealError, DATA_KEY_LEN};

/// Most bytes of a key id.
const MAX_KEY_ID_LEN: usize = 64;

/// A key-encryption key's name, stored beside every value sealed under it: 1 to 64 ASCII
/// letters, digits, `-`, `_` or `.`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(String);

impl KeyId {
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let valid = !text.is_empty()
            && text.len() <= MAX_KEY_ID_LEN
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if valid {
            Ok(Self(text.to_owned()))
        } else {
            Err(KeyError::BadId(text.chars().take(MAX_KEY_ID_LEN).collect()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why a set of keys was refused. No variant carries key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("no key-encryption key is configured: set RELAY_SEAL_KEYS_FILE to a file of `<id>=<base64 of 32 random bytes>` lines (the first is the current key), or RELAY_SEAL_KEYS to the same lines; `relay keys generate --id <id>` prints one")]
    NoKeys,
    #[error("key entry {0} is not `<id>=<base64 key>`")]
    NotAnEntry(usize),
    #[error("`{0}` is not a key id: use 1 to 64 ASCII letters, digits, `-`, `_` or `.`")]
    BadId(String),
    #[error("key `{0}` is not base64 of exactly 32 bytes")]
    BadKey(String),
    #[error("key `{0}` is given twice")]
    Repeated(String),
}

/// The operator's key-encryption keys: one current, which wraps every new data key, and any
/// number of older ones that still unwrap what they wrapped. A KMS can implement this trait;
/// the relay calls it only when it writes a secret, loads one into a cache or re-seals one,
/// never per message.
pub trait KeyEncryptionKeys: Send + Sync {
    /// The key new data keys are wrapped under.
    fn current(&self) -> &KeyId;
    /// Every key this process may unwrap with.
    fn ids(&self) -> Vec<KeyId>;
    /// Whether `id` is one of [`Self::ids`].
    fn holds(&self, id: &str) -> bool;
    /// `data_key` wrapped under the current key, bound to `aad`.
    fn wrap(&self, data_key: &DataKey, aad: &[u8], random: &dyn SecureRandom) -> Vec<u8>;
    /// A data key wrapped under `id` and bound to `aad`.
    fn unwrap(&self, id: &str, wrapped: &[u8], aad: &[u8]) -> Result<DataKey, UnsealError>;
}

/// Keys the operator gives the process in a file or an environment variable.
pub struct LocalKeys {
    /// In the order given; the first is current.
    keys: Vec<(KeyId, LessSafeKey)>,
}

impl LocalKeys {
    /// Parses `<id>=<base64 of 32 bytes>` entries, one per line (or separated by commas or
    /// spaces); blank lines and lines starting with `#` are skipped. The first entry is the
    /// current key.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        let mut keys: Vec<(KeyId, LessSafeKey)> = Vec::new();
        let entries = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.starts_with('#'))
            .flat_map(|line| line.split(|c: char| c == ',' || c.is_whitespace()))
            .filter(|entry| !entry.is_empty());
        for (n, entry) in entries.enumerate() {
            let (id, key) = entry.split_once('=').ok_or(KeyError::NotAnEntry(n + 1))?;
            let id = KeyId::parse(id)?;
            let bytes = Zeroizing::new(
                BASE64
                    .decode(key)
                    .map_err(|_| KeyError::BadKey(id.0.clone()))?,
            );
            if bytes.len() != DATA_KEY_LEN {
                return Err(KeyError::BadKey(id.0));
            }
            if keys.iter().any(|(known, _)| *known == id) {
                return Err(KeyError::Repeated(id.0));
            }
            let key = UnboundKey::new(&AES_256_GCM, &bytes).expect("the key is 32 bytes");
            keys.push((id, LessSafeKey::new(key)));
        }
        if keys.is_empty() {
            return Err(KeyError::NoKeys);
        }
        Ok(Self { keys })
    }

    /// A new key's entry, `<id>=<base64>`, for the operator to keep.
    pub fn generate_entry(id: &str) -> Result<String, KeyError> {
        let id = KeyId::parse(id)?;
        let mut key = Zeroizing::new([0u8; DATA_KEY_LEN]);
        SystemRandom::new()
            .fill(&mut key[..])
            .expect("the operating system's random source works");
        Ok(format!("{id}={}", BASE64.encode(&key[..])))
    }

    fn key(&self, id: &str) -> Option<&LessSafeKey> {
        self.keys
            .iter()
            .find(|(known, _)| known.as_str() == id)
            .map(|(_, key)| key)
    }
}

impl KeyEncryptionKeys for LocalKeys {
    fn current(&self) -> &KeyId {
        &self.keys[0].0
    }

    fn ids(&self) -> Vec<KeyId> {
        self.keys.iter().map(|(id, _)| id.clone()).collect()
    }

    fn holds(&self, id: &str) -> bool {
        self.key(id).is_some()
    }

    fn wrap(&self, data_key: &DataKey, aad: &[u8], random: &dyn SecureRandom) -> Vec<u8> {
        let mut nonce = [0u8; NONCE_LEN];
        random
            .fill(&mut nonce)
            .expect("the operating system's random source works");
        let mut wrapped = Vec::with_capacity(NONCE_LEN + DATA_KEY_LEN + 16);
        wrapped.extend_from_slice(&nonce);
        wrapped.extend_from_slice(data_key.bytes());
        let (nonce_part, key_part) = wrapped.split_at_mut(NONCE_LEN);
        let tag = self.keys[0]
            .1
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                key_part,
            )
            .expect("AES-GCM seals 32 bytes");
        debug_assert_eq!(nonce_part, nonce);
        wrapped.extend_from_slice(tag.as_ref());
        wrapped
    }

    fn unwrap(&self, id: &str, wrapped: &[u8], aad: &[u8]) -> Result<DataKey, UnsealError> {
        let key = self
            .key(id)
            .ok_or_else(|| UnsealError::UnknownKey(id.to_owned()))?;
        if wrapped.len() != NONCE_LEN + DATA_KEY_LEN + 16 {
            return Err(UnsealError::Malformed);
        }
        let (nonce, sealed) = wrapped.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| UnsealError::Malformed)?;
        let mut buffer = Zeroizing::new(sealed.to_vec());
        let opened = key
            .open_in_place(nonce, Aad::from(aad), &mut buffer)
            .map_err(|_| UnsealError::Refused(id.to_owned()))?;
        DataKey::from_bytes(opened).ok_or(UnsealError::Malformed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_from_lines_or_one_line_and_the_first_is_current() {
        let a = LocalKeys::generate_entry("2026-12").unwrap();
        let b = LocalKeys::generate_entry("old").unwrap();
        let keys = LocalKeys::parse(&format!("# keys\n{a}\n\n{b}\n")).unwrap();
        assert_eq!(keys.current().as_str(), "2026-12");
        assert!(keys.holds("old") && !keys.holds("other"));
        let keys = LocalKeys::parse(&format!("{b}, {a}")).unwrap();
        assert_eq!(keys.current().as_str(), "old");
        assert_eq!(keys.ids().len(), 2);
    }

    #[test]
    fn bad_entries_are_refused_without_showing_the_key() {
        let err = |text: &str| LocalKeys::parse(text).err().unwrap();
        assert_eq!(err(""), KeyError::NoKeys);
        assert_eq!(err("# only a comment"), KeyError::NoKeys);
        assert_eq!(err("justakey"), KeyError::NotAnEntry(1));
        assert_eq!(err("k=c2hvcnQ="), KeyError::BadKey("k".into()));
        assert_eq!(err("k=not base64!"), KeyError::BadKey("k".into()));
        assert_eq!(err("k=c2hvcnQ= x"), KeyError::BadKey("k".into()));
        let entry = LocalKeys::generate_entry("a").unwrap();
        assert_eq!(err(&format!("{entry} x")), KeyError::NotAnEntry(2));
        let entry = LocalKeys::generate_entry("k").unwrap();
        assert_eq!(
            err(&format!("{entry}\n{entry}")),
            KeyError::Repeated("k".into())
        );
        assert!(matches!(err("bad/id=AAAA"), KeyError::BadId(_)));
        let shown = err("k=c2VjcmV0LXNob3J0").to_string();
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
    }
}
