//! The request body bytes a process holds while its handlers read them: bounded for the whole
//! process and for each client.
//!
//! A body is charged as its bytes arrive, never from the length it claims, and the charge is
//! given back when its request has been answered. A request whose body would not fit when it
//! arrives is refused before a byte of it is read (503 with Retry-After); one whose bytes stop
//! fitting while they arrive (others took the room meanwhile) fails at that frame the same way.
//! So what strangers send can hold at most the budget, and one client at most its share of it,
//! however many connections it opens or however slowly it sends.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The process's body bytes in flight by default: 64 bodies of the wire file's largest (1 MiB).
pub const DEFAULT_BODY_BYTES_IN_FLIGHT: usize = 64 * 1024 * 1024;
/// One client's share by default: a quarter of the process's, so three other clients always
/// find room, and still sixteen of the largest bodies at once.
pub const DEFAULT_BODY_BYTES_PER_CLIENT: usize = 16 * 1024 * 1024;

/// The body bytes in flight a process allows, for all its listeners together and per client.
/// Cloning shares it.
#[derive(Clone)]
pub struct BodyBudget {
    inner: Arc<Inner>,
}

struct Inner {
    total: usize,
    per_client: usize,
    state: Mutex<InFlight>,
    gauge: Mutex<Option<prometheus::IntGauge>>,
}

#[derive(Default)]
struct InFlight {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

impl Default for BodyBudget {
    fn default() -> Self {
        Self::new(DEFAULT_BODY_BYTES_IN_FLIGHT, DEFAULT_BODY_BYTES_PER_CLIENT)
    }
}

impl std::fmt::Debug for BodyBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyBudget")
            .field("total", &self.inner.total)
            .field("per_client", &self.inner.per_client)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl BodyBudget {
    /// `total` bytes for the process, at most `per_client` of them one client's (each at least
    /// 1; a share over the total is the total).
    pub fn new(total: usize, per_client: usize) -> Self {
        let total = total.max(1);
        Self {
            inner: Arc::new(Inner {
                total,
                per_client: per_client.clamp(1, total),
                state: Mutex::default(),
                gauge: Mutex::default(),
            }),
        }
    }

    pub fn total(&self) -> usize {
        self.inner.total
    }

    pub fn per_client(&self) -> usize {
        self.inner.per_client
    }

    /// Body bytes held now.
    pub fn in_flight(&self) -> usize {
        self.lock().total
    }

    /// Shows the bytes in flight in `gauge` from now on.
    pub(crate) fn show_in(&self, gauge: prometheus::IntGauge) {
        gauge.set(self.in_flight() as i64);
        *self.inner.gauge.lock().unwrap_or_else(|p| p.into_inner()) = Some(gauge);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn show(&self, total: usize) {
        if let Some(gauge) = &*self.inner.gauge.lock().unwrap_or_else(|p| p.into_inner()) {
            gauge.set(total as i64);
        }
    }

    /// Whether `want` more bytes of `client`'s fit now (nothing is taken).
    pub(crate) fn has_room(&self, client: IpAddr, want: usize) -> bool {
        let state = self.lock();
        let held = state.by_client.get(&client).copied().unwrap_or(0);
        state.total.saturating_add(want) <= self.inner.total
            && held.saturating_add(want) <= self.inner.per_client
    }

    /// Takes `bytes` for `client` if they fit in both bounds.
    fn try_take(&self, client: IpAddr, bytes: usize) -> bool {
        let total = {
            let mut state = self.lock();
            let held = state.by_client.get(&client).copied().unwrap_or(0);
            if state.total.saturating_add(bytes) > self.inner.total
                || held.saturating_add(bytes) > self.inner.per_client
            {
                return false;
            }
            state.total += bytes;
            *state.by_client.entry(client).or_default() += bytes;
            state.total
        };
        self.show(total);
        true
    }

    fn give_back(&self, client: IpAddr, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let total = {
            let mut state = self.lock();
            state.total = state.total.saturating_sub(bytes);
            if let Some(held) = state.by_client.get_mut(&client) {
                *held = held.saturating_sub(bytes);
                if *held == 0 {
                    state.by_client.remove(&client);
                }
            }
            state.total
        };
        self.show(total);
    }

    #[cfg(test)]
    fn clients(&self) -> usize {
        self.lock().by_client.len()
    }
}

/// What one request's body has taken of the budget; given back when the last holder (the
/// request's answer, the body) lets go.
pub(crate) struct RequestCharge {
    budget: BodyBudget,
    client: IpAddr,
    bytes: AtomicUsize,
}

impl RequestCharge {
    pub(crate) fn new(budget: BodyBudget, client: IpAddr) -> Self {
        Self {
            budget,
            client,
            bytes: AtomicUsize::new(0),
        }
    }

    /// Charges `bytes` more to the request; false (nothing taken) when they do not fit.
    pub(crate) fn take(&self, bytes: usize) -> bool {
        if !self.budget.try_take(self.client, bytes) {
            return false;
        }
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        true
    }
}

impl Drop for RequestCharge {
    fn drop(&mut self) {
        self.budget.give_back(self.client, *self.bytes.get_mut());
    }
}

/// The body did not fit in the process's budget of body bytes in flight, or in its client's
/// share of it.
#[derive(Debug, Clone, Copy)]
pub struct BodyBudgetSpent;

impl std::fmt::Display for BodyBudgetSpent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the relay is reading as many request bodies as it allows now")
    }
}

impl StdError for BodyBudgetSpent {}

impl BodyBudgetSpent {
    /// True when `error` or one of its causes is a [`BodyBudgetSpent`] (body readers wrap it).
    pub fn is_cause_of(error: &(dyn StdError + 'static)) -> bool {
        crate::has_cause::<BodyBudgetSpent>(error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_fit_the_total_and_each_clients_share_and_go_back_when_dropped() {
        let budget = BodyBudget::new(100, 60);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let first = RequestCharge::new(budget.clone(), a);
        assert!(first.take(50));
        assert!(budget.has_room(a, 10) && !budget.has_room(a, 11));
        assert!(!first.take(11), "past a's share");
        assert!(first.take(10));
        let second = RequestCharge::new(budget.clone(), b);
        assert!(second.take(40));
        assert!(!second.take(1), "past the total");
        assert!(!budget.has_room(b, 1));
        assert_eq!(budget.in_flight(), 100);
        drop(first);
        assert_eq!(budget.in_flight(), 40);
        assert!(budget.has_room(a, 60));
        drop(second);
        assert_eq!((budget.in_flight(), budget.clients()), (0, 0));
    }

    #[test]
    fn a_share_is_at_most_the_total() {
        let budget = BodyBudget::new(10, 1000);
        assert_eq!((budget.total(), budget.per_client()), (10, 10));
    }
}
