//! A secret held in memory as text.

use zeroize::Zeroizing;

/// Text that is a secret (an upstream API key, a broker URL with its password): its `Debug`
/// shows no part of it, and its memory is wiped when it is dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretText(Zeroizing<String>);

impl SecretText {
    pub fn new(text: &str) -> Self {
        Self(Zeroizing::new(text.to_owned()))
    }

    /// The secret itself, for the one place that sends it (a request header, a connection).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for SecretText {
    fn from(text: String) -> Self {
        Self(Zeroizing::new(text))
    }
}

impl From<&str> for SecretText {
    fn from(text: &str) -> Self {
        Self::new(text)
    }
}

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretText(<redacted>)")
    }
}
