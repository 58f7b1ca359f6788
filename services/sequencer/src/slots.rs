//! Worker slots: at most `max_concurrent_endpoints` endpoints worked at once in this process, and
//! at most a tenant's share of them for any one tenant, so that a tenant with many endpoints, or
//! whose upstream hangs (a worker waits on its refetch reads), cannot delay another tenant's
//! applies.
//!
//! A worker takes its tenant's slot before one of the process's, so a tenant at its share waits
//! without holding any of the process's slots.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use relay_store::TenantId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most workers one tenant may hold: `share` of `max` (a fraction in (0, 1]), rounded up,
/// at least one.
pub fn tenant_cap(max: usize, share: f64) -> usize {
    let share = if share.is_finite() {
        share.clamp(0.0, 1.0)
    } else {
        1.0
    };
    ((max as f64 * share).ceil() as usize).clamp(1, max.max(1))
}

/// The process's slots and each tenant's.
pub struct Slots {
    all: Arc<Semaphore>,
    per_tenant: usize,
    tenants: Mutex<HashMap<TenantId, Arc<Semaphore>>>,
}

/// One worker's hold: a slot of its tenant's and one of the process's. Dropping it gives both
/// back.
pub struct Slot {
    _tenant: OwnedSemaphorePermit,
    _lane: Option<OwnedSemaphorePermit>,
    _all: OwnedSemaphorePermit,
}

impl Slots {
    pub fn new(max: usize, tenant_share: f64) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            all: Arc::new(Semaphore::new(max)),
            per_tenant: tenant_cap(max, tenant_share),
            tenants: Mutex::new(HashMap::new()),
        })
    }

    /// One of the process's slots alone: for the read that tells a new worker its tenant.
    pub async fn take_any(&self) -> OwnedSemaphorePermit {
        self.all
            .clone()
            .acquire_owned()
            .await
            .expect("the slots' semaphore is never closed")
    }

    /// A slot for a worker of `tenant`: its tenant's first, then the process's.
    pub async fn take(&self, tenant: TenantId) -> Slot {
        self.take_in(tenant, || None).await
    }

    /// [`Slots::take`] within the lane `lane` names once the tenant's slot is taken (a semaphore
    /// with fewer permits than the process's slots, which the tenants it is named for share), or
    /// none: the tenant's slot first, so a tenant queues behind its own; then the lane's, so the
    /// tenants in the lane queue behind one another and never hold the slots left outside it;
    /// then the process's. The lane is asked for after the tenant's slot, which may have been
    /// long in coming: whether the tenant belongs in the lane may have changed meanwhile.
    pub async fn take_in(
        &self,
        tenant: TenantId,
        lane: impl FnOnce() -> Option<Arc<Semaphore>>,
    ) -> Slot {
        let tenant = self
            .of(tenant)
            .acquire_owned()
            .await
            .expect("a tenant's semaphore is never closed");
        let lane = match lane() {
            Some(lane) => Some(
                lane.acquire_owned()
                    .await
                    .expect("a lane's semaphore is never closed"),
            ),
            None => None,
        };
        Slot {
            _tenant: tenant,
            _lane: lane,
            _all: self.take_any().await,
        }
    }

    /// [`Slots::take_in`] when a slot is free now (its tenant's, the lane's and the
    /// process's); `None` otherwise, holding nothing. A reload records that it waits only when
    /// this fails.
    pub fn try_take_in(
        &self,
        tenant: TenantId,
        lane: impl FnOnce() -> Option<Arc<Semaphore>>,
    ) -> Option<Slot> {
        let tenant = self.of(tenant).try_acquire_owned().ok()?;
        let lane = match lane() {
            Some(lane) => Some(lane.try_acquire_owned().ok()?),
            None => None,
        };
        let all = self.all.clone().try_acquire_owned().ok()?;
        Some(Slot {
            _tenant: tenant,
            _lane: lane,
            _all: all,
        })
    }

    /// [`Slots::take`] for a worker already holding one of the process's slots (`held`): kept
    /// when its tenant has a slot free; otherwise given back while it waits for its tenant's.
    pub async fn take_holding(&self, tenant: TenantId, held: OwnedSemaphorePermit) -> Slot {
        match self.of(tenant).try_acquire_owned() {
            Ok(tenant) => Slot {
                _tenant: tenant,
                _lane: None,
                _all: held,
            },
            Err(_) => {
                drop(held);
                self.take(tenant).await
            }
        }
    }

    /// Forgets the semaphores of tenants with no worker holding or awaiting a slot (each holder
    /// and waiter keeps a reference), so the map stays as small as the tenants at work.
    pub fn forget_idle(&self) {
        self.tenants
            .lock()
            .expect("the slots' map is never poisoned")
            .retain(|_, semaphore| Arc::strong_count(semaphore) > 1);
    }

    fn of(&self, tenant: TenantId) -> Arc<Semaphore> {
        self.tenants
            .lock()
            .expect("the slots' map is never poisoned")
            .entry(tenant)
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_tenant)))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_gets_its_share_rounded_up_and_at_least_one_slot() {
        assert_eq!(tenant_cap(128, 0.5), 64);
        assert_eq!(tenant_cap(3, 0.5), 2);
        assert_eq!(tenant_cap(1, 0.5), 1);
        assert_eq!(tenant_cap(10, 0.01), 1);
        assert_eq!(tenant_cap(10, 1.0), 10);
        assert_eq!(tenant_cap(10, 7.0), 10);
        assert_eq!(tenant_cap(10, f64::NAN), 10);
    }

    #[tokio::test]
    async fn a_tenant_at_its_share_waits_without_holding_a_slot_of_the_process() {
        let slots = Slots::new(4, 0.5);
        let (a, b) = (
            TenantId(uuid::Uuid::new_v4()),
            TenantId(uuid::Uuid::new_v4()),
        );
        let held = [slots.take(a).await, slots.take(a).await];
        // A third of A's waits; B still gets the two slots left.
        let waiting = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.take(a).await })
        };
        let any = slots.take_any().await;
        let b_slot = slots.take_holding(b, any).await;
        let b_second = slots.take(b).await;
        assert!(!waiting.is_finished());
        drop(held);
        drop((b_slot, b_second));
        waiting.await.unwrap();
        slots.forget_idle();
        assert!(slots.tenants.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_slot_free_now_is_taken_at_once_and_none_past_the_tenants_share() {
        // The default reload slots: two, a tenant at most one.
        let slots = Slots::new(2, 0.5);
        let (a, b, c) = (
            TenantId(uuid::Uuid::new_v4()),
            TenantId(uuid::Uuid::new_v4()),
            TenantId(uuid::Uuid::new_v4()),
        );
        let a_slot = slots.try_take_in(a, || None).expect("a slot is free");
        // A at its share: nothing for A, and A's try holds nothing of the process's.
        assert!(slots.try_take_in(a, || None).is_none());
        let b_slot = slots
            .try_take_in(b, || None)
            .expect("B's share and a slot of the process's are free");
        // Every slot of the process held: nothing for C, and C's try holds nothing of C's.
        assert!(slots.try_take_in(c, || None).is_none());
        drop(a_slot);
        let c_slot = slots.try_take_in(c, || None).expect("A gave its slot back");
        drop((b_slot, c_slot));
        slots.forget_idle();
        assert!(slots.tenants.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn tenants_in_a_lane_share_its_slots_and_never_take_those_left_outside_it() {
        // Three slots, a tenant at most two; a lane of two for the failing tenants A and C.
        let slots = Slots::new(3, 0.5);
        let lane = Arc::new(Semaphore::new(2));
        let (a, b, c) = (
            TenantId(uuid::Uuid::new_v4()),
            TenantId(uuid::Uuid::new_v4()),
            TenantId(uuid::Uuid::new_v4()),
        );
        let a_slots = [
            slots.take_in(a, || Some(lane.clone())).await,
            slots.take_in(a, || Some(lane.clone())).await,
        ];
        // The lane is full: C waits behind A, holding nothing of the process's.
        assert!(slots.try_take_in(c, || Some(lane.clone())).is_none());
        let waiting = {
            let (slots, lane) = (slots.clone(), lane.clone());
            tokio::spawn(async move { slots.take_in(c, || Some(lane.clone())).await })
        };
        tokio::task::yield_now().await;
        // B, outside the lane, still finds the slot the lane leaves.
        let b_slot = slots
            .try_take_in(b, || None)
            .expect("the slot outside the lane");
        assert!(!waiting.is_finished());
        drop(a_slots);
        let c_slot = waiting.await.unwrap();
        drop((b_slot, c_slot));
        assert_eq!(lane.available_permits(), 2);
    }
}
