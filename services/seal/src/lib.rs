//! Secrets sealed at rest: every signing secret, upstream API key and broker URL the relay stores
//! is kept in Postgres only as a sealed value that a backup, a replica or a stray `SELECT` cannot
//! open.
//!
//! Envelope encryption: each value is sealed with AES-256-GCM under a data key of its own, drawn
//! fresh for it; the data key is sealed ("wrapped") under a key-encryption key the operator holds
//! outside the database ([`KeyEncryptionKeys`]: a file or an environment variable today,
//! [`LocalKeys`]; a KMS can implement the same trait). The wrapping key's id is stored beside each
//! value, so the relay can count what is sealed under which key and re-wrap the data keys under a
//! new one without touching the values ([`Keyring::reseal`]).
//!
//! Both seals bind the value to where it is stored: the column and the row's identity (an
//! endpoint or a tenant id, [`Field`]) are the associated data, so a sealed value copied into
//! another row, or another column, fails to open there.
//!
//! The one way to drive it: [`Keyring::seal`] on write, [`Keyring::unseal`] on read,
//! [`Keyring::reseal`] in a rotation; [`Keyring::census_refusal`] decides whether a process may
//! start over what the database holds.
//!
//! Layout of a sealed value (version 1): `0x01`, the wrapped data key's length (two bytes, big
//! endian), the wrapped data key, the value's 12-byte nonce, the value's ciphertext and its
//! 16-byte tag.

mod keys;
mod secret;

pub use keys::{KeyEncryptionKeys, KeyError, KeyId, LocalKeys};
pub use secret::SecretText;

use std::sync::Arc;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::rand::{SecureRandom as _, SystemRandom};
use uuid::Uuid;
use zeroize::Zeroizing;

const VERSION: u8 = 1;
/// Bytes of a data key (AES-256).
pub const DATA_KEY_LEN: usize = 32;
const TAG_LEN: usize = 16;
const AAD_PREFIX: &[u8] = b"relay-seal/v1\0";
const FINGERPRINT_PREFIX: &[u8] = b"relay-seal/fingerprint/v1\0";

/// Where a sealed value lives: its table and column, and the identity of its row (the endpoint
/// or tenant it belongs to). Sealing binds the value to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    /// `table.column`, such as `endpoint_secrets.secret`.
    pub column: &'static str,
    /// The endpoint or tenant the row belongs to.
    pub row: Uuid,
}

impl Field {
    fn aad(&self) -> Vec<u8> {
        let mut aad = Vec::with_capacity(AAD_PREFIX.len() + self.column.len() + 17);
        aad.extend_from_slice(AAD_PREFIX);
        aad.extend_from_slice(self.column.as_bytes());
        aad.push(0);
        aad.extend_from_slice(self.row.as_bytes());
        aad
    }

    /// The associated data of the data key's wrapping: the value's, and the wrapping key's id,
    /// so a value's key id cannot be swapped for another's either.
    fn wrap_aad(&self, key_id: &str) -> Vec<u8> {
        let mut aad = self.aad();
        aad.push(0);
        aad.extend_from_slice(key_id.as_bytes());
        aad
    }
}

/// A value as stored: the id of the key-encryption key that wraps its data key, and the sealed
/// bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Sealed {
    pub key_id: String,
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for Sealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealed({}, {} bytes)", self.key_id, self.bytes.len())
    }
}

/// Why a stored value could not be opened. None of them says anything of the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsealError {
    #[error("the value is sealed under key `{0}`, which is not configured (RELAY_SEAL_KEYS / RELAY_SEAL_KEYS_FILE)")]
    UnknownKey(String),
    #[error("the value is not in a sealed layout this relay reads")]
    Malformed,
    #[error("the value does not open under key `{0}` for this row: the key's bytes differ from those it was sealed with, or the value was moved from another row")]
    Refused(String),
}

/// A data key, wiped from memory when dropped.
pub struct DataKey(Zeroizing<[u8; DATA_KEY_LEN]>);

impl DataKey {
    fn generate(random: &SystemRandom) -> Self {
        let mut key = Zeroizing::new([0u8; DATA_KEY_LEN]);
        random
            .fill(&mut key[..])
            .expect("the operating system's random source works");
        Self(key)
    }

    /// Wraps bytes that are already a data key (a [`KeyEncryptionKeys`] unwrapping one).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let mut key = Zeroizing::new([0u8; DATA_KEY_LEN]);
        if bytes.len() != DATA_KEY_LEN {
            return None;
        }
        key.copy_from_slice(bytes);
        Some(Self(key))
    }

    /// The key's bytes, for a [`KeyEncryptionKeys`] to wrap.
    pub fn bytes(&self) -> &[u8] {
        &self.0[..]
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, &self.0[..]).expect("a data key is 32 bytes"),
        )
    }
}

/// Counts of what the database holds, by the key that seals it (`None`: stored in plain text,
/// from before the relay sealed its secrets), for [`Keyring::census_refusal`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Census {
    /// `(table.column, key id or None, values)`.
    pub counts: Vec<(String, Option<String>, i64)>,
}

impl Census {
    /// Values in plain text.
    pub fn plaintext(&self) -> i64 {
        self.counts
            .iter()
            .filter(|(_, key, _)| key.is_none())
            .map(|(_, _, n)| n)
            .sum()
    }

    /// Values sealed under a key other than `current`.
    pub fn under_old_keys(&self, current: &str) -> i64 {
        self.counts
            .iter()
            .filter(|(_, key, _)| key.as_deref().is_some_and(|key| key != current))
            .map(|(_, _, n)| n)
            .sum()
    }
}

/// The keys a process seals and opens values with.
#[derive(Clone)]
pub struct Keyring {
    keys: Arc<dyn KeyEncryptionKeys>,
    random: SystemRandom,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.keys.current().as_str())
            .field("keys", &self.keys.ids())
            .finish()
    }
}

impl Keyring {
    pub fn new(keys: Arc<dyn KeyEncryptionKeys>) -> Self {
        Self {
            keys,
            random: SystemRandom::new(),
        }
    }

    /// The key new values are sealed under.
    pub fn current(&self) -> &KeyId {
        self.keys.current()
    }

    /// Every key configured, the current one first.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.ids()
    }

    /// Seals `value` for `field` under a fresh data key wrapped by the current key.
    pub fn seal(&self, value: &[u8], field: Field) -> Sealed {
        let data_key = DataKey::generate(&self.random);
        let key_id = self.keys.current().as_str().to_owned();
        let wrapped = self
            .keys
            .wrap(&data_key, &field.wrap_aad(&key_id), &self.random);
        let mut nonce = [0u8; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .expect("the operating system's random source works");
        let mut sealed_value = value.to_vec();
        data_key
            .aead()
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(field.aad()),
                &mut sealed_value,
            )
            .expect("AES-GCM seals any value under 64 GiB");
        Sealed {
            key_id,
            bytes: Parts {
                wrapped: &wrapped,
                nonce: &nonce,
                value: &sealed_value,
            }
            .to_bytes(),
        }
    }

    /// Opens a value sealed for `field`.
    pub fn unseal(&self, sealed: &Sealed, field: Field) -> Result<Zeroizing<Vec<u8>>, UnsealError> {
        let parts = Parts::of(&sealed.bytes)?;
        let data_key = self.unwrap(sealed, parts.wrapped, field)?;
        let mut value = Zeroizing::new(parts.value.to_vec());
        let nonce =
            Nonce::try_assume_unique_for_key(parts.nonce).map_err(|_| UnsealError::Malformed)?;
        let len = data_key
            .aead()
            .open_in_place(nonce, Aad::from(field.aad()), &mut value)
            .map_err(|_| UnsealError::Refused(sealed.key_id.clone()))?
            .len();
        value.truncate(len);
        Ok(value)
    }

    /// Opens a value sealed for `field` that holds text.
    pub fn unseal_text(&self, sealed: &Sealed, field: Field) -> Result<SecretText, UnsealError> {
        let bytes = self.unseal(sealed, field)?;
        std::str::from_utf8(&bytes)
            .map(SecretText::new)
            .map_err(|_| UnsealError::Malformed)
    }

    /// The same value with its data key wrapped under the current key, or `None` when it is
    /// already. The value's own ciphertext is kept: a rotation re-wraps data keys only.
    pub fn reseal(&self, sealed: &Sealed, field: Field) -> Result<Option<Sealed>, UnsealError> {
        let current = self.keys.current().as_str();
        if sealed.key_id == current {
            return Ok(None);
        }
        let parts = Parts::of(&sealed.bytes)?;
        let data_key = self.unwrap(sealed, parts.wrapped, field)?;
        // Prove the value opens before its old wrapping is given up.
        self.unseal(sealed, field)?;
        let wrapped = self
            .keys
            .wrap(&data_key, &field.wrap_aad(current), &self.random);
        Ok(Some(Sealed {
            key_id: current.to_owned(),
            bytes: Parts {
                wrapped: &wrapped,
                ..parts
            }
            .to_bytes(),
        }))
    }

    fn unwrap(
        &self,
        sealed: &Sealed,
        wrapped: &[u8],
        field: Field,
    ) -> Result<DataKey, UnsealError> {
        if !self.keys.holds(&sealed.key_id) {
            return Err(UnsealError::UnknownKey(sealed.key_id.clone()));
        }
        self.keys
            .unwrap(&sealed.key_id, wrapped, &field.wrap_aad(&sealed.key_id))
    }

    /// Why a process must not start over a database holding `census`, or `None` when it may:
    /// values in plain text, or sealed under a key this process was not given.
    pub fn census_refusal(&self, census: &Census) -> Option<String> {
        let plaintext = census.plaintext();
        if plaintext > 0 {
            return Some(format!(
                "{plaintext} secret(s) are stored in plain text ({}); run `relay migrate` with \
                 the keys set (RELAY_SEAL_KEYS_FILE or RELAY_SEAL_KEYS) to seal them before \
                 starting a tier",
                columns_of(census, |key| key.is_none())
            ));
        }
        let mut missing: Vec<&str> = census
            .counts
            .iter()
            .filter_map(|(_, key, n)| key.as_deref().filter(|key| *n > 0 && !self.keys.holds(key)))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return None;
        }
        let lines: Vec<String> = missing
            .iter()
            .map(|key| {
                let values: i64 = census
                    .counts
                    .iter()
                    .filter(|(_, k, _)| k.as_deref() == Some(key))
                    .map(|(_, _, n)| n)
                    .sum();
                format!(
                    "key `{key}` seals {values} value(s) ({}) but is not configured",
                    columns_of(census, |k| k == Some(key))
                )
            })
            .collect();
        Some(format!(
            "{}: add it back to RELAY_SEAL_KEYS_FILE / RELAY_SEAL_KEYS after the current key, \
             run `relay keys rotate` to re-seal its values under the current key, and only then \
             remove it",
            lines.join("; ")
        ))
    }

    /// A digest of a signing secret that tells whether an endpoint holds it already, without
    /// opening its sealed secrets: HMAC-SHA256 keyed by the secret itself over the column and
    /// the row. It reveals no more of the secret than one message the secret signed does.
    pub fn fingerprint(secret: &[u8], field: Field) -> [u8; 32] {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let mut context = ring::hmac::Context::with_key(&key);
        context.update(FINGERPRINT_PREFIX);
        context.update(field.column.as_bytes());
        context.update(&[0]);
        context.update(field.row.as_bytes());
        let tag = context.sign();
        let mut digest = [0u8; 32];
        digest.copy_from_slice(tag.as_ref());
        digest
    }
}

/// The tables and columns whose counts match `which`, for an error message.
fn columns_of(census: &Census, which: impl Fn(Option<&str>) -> bool) -> String {
    let mut columns: Vec<String> = census
        .counts
        .iter()
        .filter(|(_, key, n)| *n > 0 && which(key.as_deref()))
        .map(|(column, _, n)| format!("{column}: {n}"))
        .collect();
    columns.sort_unstable();
    columns.join(", ")
}

/// A sealed value's parts.
struct Parts<'a> {
    wrapped: &'a [u8],
    nonce: &'a [u8],
    value: &'a [u8],
}

impl<'a> Parts<'a> {
    fn of(bytes: &'a [u8]) -> Result<Self, UnsealError> {
        let [version, hi, lo, rest @ ..] = bytes else {
            return Err(UnsealError::Malformed);
        };
        if *version != VERSION {
            return Err(UnsealError::Malformed);
        }
        let wrapped_len = usize::from(u16::from_be_bytes([*hi, *lo]));
        if rest.len() < wrapped_len + NONCE_LEN + TAG_LEN {
            return Err(UnsealError::Malformed);
        }
        let (wrapped, rest) = rest.split_at(wrapped_len);
        let (nonce, value) = rest.split_at(NONCE_LEN);
        Ok(Self {
            wrapped,
            nonce,
            value,
        })
    }

    fn to_bytes(&self) -> Vec<u8> {
        let wrapped_len = u16::try_from(self.wrapped.len()).expect("a wrapped data key is short");
        let mut bytes =
            Vec::with_capacity(3 + self.wrapped.len() + self.nonce.len() + self.value.len());
        bytes.push(VERSION);
        bytes.extend_from_slice(&wrapped_len.to_be_bytes());
        bytes.extend_from_slice(self.wrapped);
        bytes.extend_from_slice(self.nonce);
        bytes.extend_from_slice(self.value);
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyring(text: &str) -> Keyring {
        Keyring::new(Arc::new(LocalKeys::parse(text).unwrap()))
    }

    const K1: &str = "k1=AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const K2: &str = "k2=HxweHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=";

    fn field(row: u128) -> Field {
        Field {
            column: "endpoint_secrets.secret",
            row: Uuid::from_u128(row),
        }
    }

    #[test]
    fn a_sealed_value_opens_for_its_own_row_only() {
        let keys = keyring(K1);
        let sealed = keys.seal(b"whsec_secret", field(1));
        assert_eq!(sealed.key_id, "k1");
        assert!(!sealed
            .bytes
            .windows(b"whsec_secret".len())
            .any(|w| w == b"whsec_secret"));
        assert_eq!(
            &keys.unseal(&sealed, field(1)).unwrap()[..],
            b"whsec_secret"
        );
        assert_eq!(
            keys.unseal(&sealed, field(2)),
            Err(UnsealError::Refused("k1".into()))
        );
        let other_column = Field {
            column: "webhook_endpoints.upstream_api_key",
            row: Uuid::from_u128(1),
        };
        assert!(keys.unseal(&sealed, other_column).is_err());
    }

    #[test]
    fn two_seals_of_one_value_differ() {
        let keys = keyring(K1);
        assert_ne!(keys.seal(b"v", field(1)), keys.seal(b"v", field(1)));
    }

    #[test]
    fn a_rotation_rewraps_under_the_current_key_and_keeps_the_value() {
        let old = keyring(K1);
        let sealed = old.seal(b"qk_live_key", field(7));
        let both = keyring(&format!("{K2}\n{K1}"));
        let resealed = both.reseal(&sealed, field(7)).unwrap().unwrap();
        assert_eq!(resealed.key_id, "k2");
        assert_eq!(both.reseal(&resealed, field(7)).unwrap(), None);
        let new_only = keyring(K2);
        assert_eq!(
            &new_only.unseal(&resealed, field(7)).unwrap()[..],
            b"qk_live_key"
        );
        assert_eq!(
            new_only.unseal(&sealed, field(7)),
            Err(UnsealError::UnknownKey("k1".into()))
        );
        // A moved value is not re-sealed into the row it was moved to.
        assert!(both.reseal(&sealed, field(8)).is_err());
    }

    #[test]
    fn a_key_id_swapped_or_a_key_with_other_bytes_refuses() {
        let keys = keyring(K1);
        let mut sealed = keys.seal(b"v", field(1));
        let impostor = keyring("k1=HxweHRwbGhkYFxYVFBMSERAPDg0MCwoJCAcGBQQDAgE=");
        assert_eq!(
            impostor.unseal(&sealed, field(1)),
            Err(UnsealError::Refused("k1".into()))
        );
        let both = keyring(&format!("{K1}\n{K2}"));
        sealed.key_id = "k2".into();
        assert!(both.unseal(&sealed, field(1)).is_err());
    }

    #[test]
    fn truncated_or_foreign_bytes_are_malformed() {
        let keys = keyring(K1);
        let sealed = keys.seal(b"value", field(1));
        for len in [0, 1, 3, 40, sealed.bytes.len() - 30] {
            let cut = Sealed {
                key_id: "k1".into(),
                bytes: sealed.bytes[..len].to_vec(),
            };
            assert!(keys.unseal(&cut, field(1)).is_err(), "{len}");
        }
        let mut other_version = sealed.clone();
        other_version.bytes[0] = 2;
        assert_eq!(
            keys.unseal(&other_version, field(1)),
            Err(UnsealError::Malformed)
        );
    }

    #[test]
    fn start_up_is_refused_over_plaintext_or_a_missing_key() {
        let keys = keyring(&format!("{K2}\n{K1}"));
        let census = |counts: &[(&str, Option<&str>, i64)]| Census {
            counts: counts
                .iter()
                .map(|(c, k, n)| (c.to_string(), k.map(str::to_owned), *n))
                .collect(),
        };
        assert_eq!(
            keys.census_refusal(&census(&[("a.b", Some("k1"), 3), ("a.b", Some("k2"), 1)])),
            None
        );
        let plaintext = keys
            .census_refusal(&census(&[("a.b", None, 2), ("a.b", Some("k1"), 3)]))
            .unwrap();
        assert!(plaintext.contains("2 secret(s)") && plaintext.contains("relay migrate"));
        let missing = keys
            .census_refusal(&census(&[("a.b", Some("k0"), 4), ("c.d", Some("k0"), 1)]))
            .unwrap();
        assert!(
            missing.contains("key `k0` seals 5 value(s) (a.b: 4, c.d: 1)"),
            "{missing}"
        );
        assert!(missing.contains("relay keys rotate"));
        let c = census(&[
            ("a.b", Some("k1"), 3),
            ("a.b", Some("k2"), 1),
            ("c.d", None, 0),
        ]);
        assert_eq!(c.under_old_keys("k2"), 3);
        assert_eq!(c.plaintext(), 0);
    }

    #[test]
    fn a_fingerprint_depends_on_the_secret_and_the_row() {
        let a = Keyring::fingerprint(b"0123456789abcdef", field(1));
        assert_eq!(a, Keyring::fingerprint(b"0123456789abcdef", field(1)));
        assert_ne!(a, Keyring::fingerprint(b"0123456789abcdeg", field(1)));
        assert_ne!(a, Keyring::fingerprint(b"0123456789abcdef", field(2)));
    }
}
