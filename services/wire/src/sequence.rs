//! The feed's sequences.
//!
//! Long form `EEEEEEEEEE.SSSSSSSSSSSSSSSSSSS` (epoch, 10 digits; seq, 19 digits; both zero-padded)
//! on events and API items; the wire file says two sequences of one subject compare as strings,
//! so [`Sequence`] orders by its text and nothing else. Short form `E.S` (`1.1045`) in a message's
//! `since` and `through`, a reset's `resume_from`, and a rewind's `since`: that is a [`Cursor`].

use std::fmt;

use serde::{Deserialize, Serialize};

/// A long-form sequence. Ordered as a string, exactly as the wire file says to compare them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sequence(String);

impl Sequence {
    /// Wraps a sequence as received. No reformatting: comparisons must see the upstream's text.
    pub fn new(text: impl Into<String>) -> Self {
        Self(text.into())
    }

    /// The long form of `epoch.seq`, zero-padded as the upstream writes it.
    pub fn from_parts(epoch: u64, seq: u64) -> Self {
        Self(format!("{epoch:010}.{seq:019}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The epoch and seq, when the text is in the long form.
    pub fn parts(&self) -> Option<(u64, u64)> {
        let (epoch, seq) = self.0.split_once('.')?;
        if epoch.len() != 10 || seq.len() != 19 {
            return None;
        }
        Some((parse_digits(epoch)?, parse_digits(seq)?))
    }
}

impl fmt::Display for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A short-form position in a track (`E.S`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor {
    pub epoch: u64,
    pub seq: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("`{0}` is not a position of the form EPOCH.SEQ")]
pub struct CursorError(pub String);

impl Cursor {
    pub fn parse(text: &str) -> Result<Self, CursorError> {
        let bad = || CursorError(text.to_owned());
        let (epoch, seq) = text.split_once('.').ok_or_else(bad)?;
        Ok(Self {
            epoch: parse_digits(epoch).ok_or_else(bad)?,
            seq: parse_digits(seq).ok_or_else(bad)?,
        })
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.epoch, self.seq)
    }
}

fn parse_digits(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_form_is_zero_padded_and_orders_as_text() {
        let a = Sequence::from_parts(1, 1045);
        assert_eq!(a.as_str(), "0000000001.0000000000000001045");
        assert_eq!(a.parts(), Some((1, 1045)));
        assert!(Sequence::from_parts(1, 999) < a);
        assert!(a < Sequence::from_parts(2, 1));
    }

    #[test]
    fn cursor_round_trips_and_refuses_other_text() {
        let c = Cursor::parse("1.1045").unwrap();
        assert_eq!(
            c,
            Cursor {
                epoch: 1,
                seq: 1045
            }
        );
        assert_eq!(c.to_string(), "1.1045");
        for bad in ["", "1", "1.", ".5", "a.b", "1.2.3", "-1.5"] {
            assert!(Cursor::parse(bad).is_err(), "{bad:?}");
        }
    }
}
