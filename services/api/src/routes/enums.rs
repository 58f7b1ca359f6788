//! The fixed sets of values more than one route takes or answers, and how a text (a stored
//! column, a query parameter) becomes one of the API's enums.
//!
//! Every enum of the API is spelt by serde alone (`rename_all = "snake_case"`): its JSON, its
//! schema in the OpenAPI document, the query parameters it parses and the stored text it is read
//! from all go through that one spelling, so none of them can drift from the others.

use serde::de::{DeserializeOwned, IntoDeserializer};
use serde::{Deserialize, Deserializer, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// Which of the upstream's products an endpoint receives, fixed when it is registered: `feed`
/// (the wire file's messages of events on tracks; its state has `tracks`) or `stories` (the
/// stories API's events, seed 000; its state has `stories`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EndpointSource {
    Feed,
    Stories,
}

/// Whether the front tier takes an endpoint's messages: `active`, or `paused` (it answers 410,
/// which the upstream takes as paused until the endpoint is resumed there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EndpointStatus {
    Active,
    Paused,
}

/// The value `text` spells, as the enum's JSON spells it; `None` for a text that spells none.
pub fn parse_spelt<T: DeserializeOwned>(text: &str) -> Option<T> {
    use serde::de::value::{Error, StrDeserializer};
    T::deserialize(StrDeserializer::<Error>::new(text)).ok()
}

/// A stored text (`what` names its column) as the enum the API answers it as. A text the API
/// names no value for is an internal error (the store and the API disagree), never a panic.
pub fn stored<T: DeserializeOwned>(what: &str, text: &str) -> Result<T, ApiError> {
    parse_spelt(text).ok_or_else(|| {
        ApiError::Internal(format!(
            "the stored {what} {:?} is none of the values the API answers",
            text.chars().take(64).collect::<String>()
        ))
    })
}

/// How a value is spelt in JSON (for a store's filter, a log line, a metric's label, a detail).
pub fn spelling<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(text)) => text,
        other => other.map(|v| v.to_string()).unwrap_or_default(),
    }
}

/// A request's enum field (`#[serde(deserialize_with = "enums::from_string")]`): a string that
/// spells one of the values. Anything else is refused as any string field refuses it
/// ("expected a string"), where serde's own form of an enum would take `{"feed": null}` as
/// `feed` and expect a "string or map".
pub fn from_string<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    let text = String::deserialize(deserializer)?;
    T::deserialize(IntoDeserializer::<D::Error>::into_deserializer(
        text.as_str(),
    ))
}

/// [`from_string`] for an optional field: null or absent is `None` (with `#[serde(default)]`).
pub fn from_optional_string<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: DeserializeOwned,
{
    Option::<String>::deserialize(deserializer)?
        .map(|text| {
            T::deserialize(IntoDeserializer::<D::Error>::into_deserializer(
                text.as_str(),
            ))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_store::endpoints::{self as store, StoriesSettings};

    #[test]
    fn stored_texts_read_as_the_store_writes_them() {
        for status in [store::EndpointStatus::Active, store::EndpointStatus::Paused] {
            let read: EndpointStatus = stored("status", status.as_str()).unwrap();
            assert_eq!(spelling(&read), status.as_str());
        }
        let stories = store::Source::Stories(StoriesSettings {
            mode: Default::default(),
            tickers: vec![],
        });
        for source in [store::Source::Feed, stories] {
            let read: EndpointSource = stored("source", source.kind()).unwrap();
            assert_eq!(spelling(&read), source.kind());
        }
        assert!(matches!(
            stored::<EndpointStatus>("status", "deleting"),
            Err(ApiError::Internal(_))
        ));
        assert_eq!(parse_spelt::<EndpointSource>("Feed"), None);
    }
}
