//! Each caller's share of the control plane. The listener's connections are shared by every
//! tenant, and a request holds one until it is answered: a tenant whose calls are slow (a
//! rewind waits on the tenant's own upstream) could hold them all. So each caller may have only
//! so many requests in flight ([`Envelope::requests`]: each tenant, and the operators together),
//! and each tenant only so many rewinds ([`Envelope::rewinds`]), each of which ends by its
//! deadline ([`Envelope::rewind_deadline`]). Past a bound the request is answered 429 with
//! Retry-After before its handler runs, and its connection closed.
//!
//! [`admit`] is the first middleware every request meets: it verifies the bearer token once,
//! keeps what it found in the request's extensions for the extractors of `auth` (which do not
//! verify it again), and takes the caller's place among its requests in flight.
//!
//! The bookkeeping ([`InFlight`]) keeps a count per key only while a request holds it: the
//! entry of a key whose last request ended is removed, so memory follows the requests in
//! flight (bounded by the listener's connections), never the tenants ever seen.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::{Authenticated, Caller};
use crate::error::ApiError;
use crate::routes::AppState;

/// How many requests each key has in flight, up to a limit.
pub struct InFlight<K> {
    limit: u32,
    held: Arc<Mutex<HashMap<K, u32>>>,
}

/// One request's place among its key's in flight, given back when dropped.
pub struct Slot<K: Eq + Hash> {
    key: Option<K>,
    held: Arc<Mutex<HashMap<K, u32>>>,
}

impl<K: Eq + Hash + Clone> InFlight<K> {
    /// At least one request per key is let in, whatever `limit` says.
    pub fn new(limit: u32) -> Self {
        Self {
            limit: limit.max(1),
            held: Arc::default(),
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// A place for one more request of `key`, unless it has `limit` in flight.
    pub fn try_enter(&self, key: K) -> Option<Slot<K>> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key.clone()).or_default();
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(Slot {
            key: Some(key),
            held: self.held.clone(),
        })
    }

    /// How many requests `key` has in flight.
    #[cfg(test)]
    pub fn held(&self, key: &K) -> u32 {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.get(key).copied().unwrap_or(0)
    }

    /// How many keys have a request in flight: the entries kept.
    #[cfg(test)]
    pub fn keys(&self) -> usize {
        self.held
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl<K: Eq + Hash> Drop for Slot<K> {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&key);
            }
        }
    }
}

/// The control plane's bounds per caller, as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeLimits {
    /// Requests one tenant (or the operators, together) may have in flight.
    pub max_requests_per_tenant: u32,
    /// Rewinds one tenant may have in flight.
    pub max_rewinds_per_tenant: u32,
    /// Rewinds all tenants together may have in flight: each holds an upstream answer of up to
    /// the wire file's largest body, so this bounds the control plane's memory however many
    /// tenants rewind at once.
    pub max_rewinds: u32,
    /// The longest a rewind waits on the tenant's upstream before it is answered 502.
    pub rewind_timeout: Duration,
}

/// The defaults: far more requests in flight than a tenant's tools make (each is answered in
/// milliseconds), few rewinds (one per restore is the need), and a rewind deadline well under
/// the HTTP client's timeout.
pub const ENVELOPE_LIMITS: EnvelopeLimits = EnvelopeLimits {
    max_requests_per_tenant: 32,
    max_rewinds_per_tenant: 2,
    max_rewinds: 16,
    rewind_timeout: Duration::from_secs(3),
};

/// The bounds and what each caller holds of them now.
pub struct Envelope {
    pub requests: InFlight<Caller>,
    pub rewinds: InFlight<relay_store::TenantId>,
    /// Every tenant's rewinds together (one key).
    pub all_rewinds: InFlight<()>,
    pub rewind_deadline: Duration,
}

impl Envelope {
    pub fn new(limits: &EnvelopeLimits) -> Self {
        Self {
            requests: InFlight::new(limits.max_requests_per_tenant),
            rewinds: InFlight::new(limits.max_rewinds_per_tenant),
            all_rewinds: InFlight::new(limits.max_rewinds),
            rewind_deadline: limits.rewind_timeout,
        }
    }
}

/// The longest a caller over its bound on requests is told to wait: the control plane's
/// requests are answered in milliseconds, but for the rewinds.
const REQUESTS_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Identifies the caller once, then lets the request in if the caller has room for it (held
/// until the answer is made), or answers 429. A request without a valid token is let through
/// unbounded: its handler's extractor answers it 401 straight away.
pub async fn admit(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    let authenticated = Authenticated::of(request.headers(), &state.verifier);
    let slot = match authenticated.caller() {
        Some(caller) => match state.envelope.requests.try_enter(caller) {
            Some(slot) => Some(slot),
            None => {
                state
                    .metrics
                    .throttled
                    .with_label_values(&["requests"])
                    .inc();
                let who = match caller {
                    Caller::Tenant(_) => "this tenant has",
                    Caller::Operators => "the operators have",
                };
                return ApiError::TooManyRequests {
                    detail: format!(
                        "{who} {} requests in flight already, the most allowed \
                         (RELAY_API_MAX_REQUESTS_PER_TENANT); retry once some are answered",
                        state.envelope.requests.limit()
                    ),
                    retry_after: REQUESTS_RETRY_AFTER,
                }
                .into_response();
            }
        },
        None => None,
    };
    request.extensions_mut().insert(authenticated);
    let response = next.run(request).await;
    drop(slot);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_at_most_its_limit_and_its_entry_goes_when_idle() {
        let bound = InFlight::new(2);
        let a = bound.try_enter("a").unwrap();
        let a2 = bound.try_enter("a").unwrap();
        assert!(bound.try_enter("a").is_none(), "a is at its limit");
        let b = bound.try_enter("b").expect("another key has its own share");
        assert_eq!(
            (bound.held(&"a"), bound.held(&"b"), bound.keys()),
            (2, 1, 2)
        );

        drop(a);
        assert_eq!(bound.held(&"a"), 1);
        let a3 = bound.try_enter("a").expect("a place was given back");
        drop(b);
        assert_eq!(
            bound.keys(),
            1,
            "b's entry is removed with its last request"
        );
        drop((a2, a3));
        assert_eq!(bound.keys(), 0, "no entry is kept for an idle key");
    }

    #[test]
    fn many_keys_leave_no_entry_behind() {
        let bound = InFlight::new(1);
        for key in 0..10_000u32 {
            let slot = bound.try_enter(key).unwrap();
            assert!(bound.try_enter(key).is_none());
            drop(slot);
        }
        assert_eq!(bound.keys(), 0);
        let held: Vec<_> = (0..100u32).filter_map(|k| bound.try_enter(k)).collect();
        assert_eq!(bound.keys(), 100);
        drop(held);
        assert_eq!(bound.keys(), 0);
    }

    #[test]
    fn a_limit_of_zero_still_lets_one_in() {
        let bound = InFlight::new(0);
        let slot = bound.try_enter(()).unwrap();
        assert!(bound.try_enter(()).is_none());
        drop(slot);
        assert!(bound.try_enter(()).is_some());
    }
}
