//! The keys that seal secrets at rest, as operators watch a rotation: what each key seals, and
//! how many values remain under an old one (0 before an old key may be removed).

use axum::extract::State;
use axum::Json;
use relay_seal::Census;
use relay_store::Keyring;
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::auth::Operator;
use crate::error::{ApiError, ErrorBody};

/// What the database holds under which key.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeysState {
    /// The key new values are sealed under (the first configured).
    pub current_key: String,
    /// Every key this process opens values with, the current one first.
    pub configured_keys: Vec<String>,
    /// Values sealed under a key other than the current one: `relay keys rotate` re-seals
    /// them; an old key may be removed once this is 0 on every process.
    pub under_old_keys: i64,
    /// Values stored in plain text by an older relay (`relay migrate` seals them).
    pub plaintext: i64,
    pub values: Vec<SealedCount>,
}

/// How many values of one column one key seals.
#[derive(Debug, Serialize, ToSchema)]
pub struct SealedCount {
    /// `table.column`.
    pub column: String,
    /// `null`: stored in plain text.
    pub key_id: Option<String>,
    pub values: i64,
}

impl KeysState {
    pub fn of(keys: &Keyring, census: Census) -> Self {
        let current_key = keys.current().as_str().to_owned();
        Self {
            under_old_keys: census.under_old_keys(&current_key),
            plaintext: census.plaintext(),
            configured_keys: keys.ids().iter().map(|id| id.as_str().to_owned()).collect(),
            current_key,
            values: census
                .counts
                .into_iter()
                .map(|(column, key_id, values)| SealedCount {
                    column,
                    key_id,
                    values,
                })
                .collect(),
        }
    }
}

#[utoipa::path(
    get, path = "/v1/keys", tag = "keys", security(("bearer" = [])),
    responses(
        (status = 200, body = KeysState),
        (status = 401, body = ErrorBody), (status = 403, body = ErrorBody),
    )
)]
/// What each key-encryption key seals, and how many values remain under an old one (operators
/// only).
pub async fn keys_state(
    State(state): State<AppState>,
    _operator: Operator,
) -> Result<Json<KeysState>, ApiError> {
    let census = relay_store::sealing::census(&state.pool).await?;
    Ok(Json(KeysState::of(&state.sealing, census)))
}
