//! The reference consumer: rebuilds each endpoint's copy from a tenant's change messages, as the
//! message's contract says a consumer may. Pure: messages in, a copy and counts out, no IO.
//! `relay tail` runs it over a queue; the tests run it over what the publisher sent.
//!
//! A queue delivers in order until a consumer's nack or a lost connection puts messages back:
//! then a quorum queue may deliver a later change before an earlier one. So a change ahead of the
//! next one is held until its predecessors arrive, a change already applied (or held) is dropped
//! as a repeat, and whatever is still held at the end names changes that never came.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::message::{ChangeMessage, DecodeError, Operation};

/// What the consumer did with one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// The endpoint's next change: applied, and with it every held change it was the last
    /// missing predecessor of.
    Applied,
    /// A change_seq already applied or held for the endpoint in its epoch (a redelivery):
    /// dropped.
    Duplicate,
    /// A change_seq past the next one: held until the changes before it arrive.
    Held { expected: i64 },
    /// Another tenant's change: not applied, and counted (a queue holds one tenant's changes).
    OtherTenant,
    /// A change of an epoch older than the one followed for the endpoint (sent before a restore
    /// of the relay's database, delivered after the new epoch's first): dropped.
    Stale,
}

/// One subject of a rebuilt copy.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaItem {
    pub item_kind: Option<String>,
    pub generation: u64,
    pub sequence: Option<String>,
    /// The change that wrote it.
    pub change_seq: i64,
    pub item: Value,
}

/// One endpoint's rebuilt copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndpointReplica {
    /// The epoch of the change stream followed (0: none yet).
    pub epoch: u64,
    /// The last change_seq applied in it (0: none yet).
    pub last_change_seq: i64,
    pub items: BTreeMap<String, ReplicaItem>,
    /// Changes of the epoch that came ahead of a predecessor, by change_seq.
    held: BTreeMap<i64, ChangeMessage>,
}

/// Counts of what [`ReferenceConsumer::receive`] answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ConsumerStats {
    pub messages: u64,
    /// Changes applied (a held one when its predecessors came).
    pub applied: u64,
    pub duplicates: u64,
    /// Changes that came ahead of a predecessor, and were held for it.
    pub reordered: u64,
    /// Changes held now, waiting for a predecessor that has not come.
    pub waiting: u64,
    pub other_tenant: u64,
    /// Removals of a subject the rebuilt copy did not hold (a consumer resumed from a position
    /// whose copy it did not keep).
    pub removals_of_nothing: u64,
    /// Changes of an epoch older than the one followed.
    pub stale: u64,
    /// Snapshots begun: each replaced what was held of its endpoint.
    pub snapshots: u64,
}

/// Rebuilds one tenant's copies from its change messages.
#[derive(Debug, Clone)]
pub struct ReferenceConsumer {
    tenant: Uuid,
    endpoints: BTreeMap<Uuid, EndpointReplica>,
    stats: ConsumerStats,
}

impl ReferenceConsumer {
    pub fn new(tenant: Uuid) -> Self {
        Self {
            tenant,
            endpoints: BTreeMap::new(),
            stats: ConsumerStats::default(),
        }
    }

    pub fn tenant(&self) -> Uuid {
        self.tenant
    }

    /// Takes the endpoint's changes up to `last_change_seq` of `epoch` as applied already: a
    /// consumer resuming from the position it saved (it keeps its copy itself). Changes at or
    /// before it are dropped as repeats.
    pub fn resume(&mut self, endpoint: Uuid, epoch: u64, last_change_seq: i64) {
        let replica = self.endpoints.entry(endpoint).or_default();
        replica.epoch = epoch;
        replica.last_change_seq = last_change_seq;
        replica.held.clear();
    }

    /// [`receive_with`](Self::receive_with), without being told what was applied.
    pub fn receive(&mut self, message: &ChangeMessage) -> Received {
        self.receive_with(message, &mut |_| {})
    }

    /// Follows each endpoint's stream as the message contract says: a change of an older epoch
    /// is dropped ([`Received::Stale`]); a greater epoch starts over at change_seq 1; a
    /// change_seq applied or held before in the epoch is dropped; the next one is applied, then
    /// every held one that now follows; one further ahead is held. `snapshot_begin` forgets what
    /// was held of the endpoint: the snapshot's upserts that follow are the whole copy.
    /// `on_apply` is called with each change applied, in change_seq order.
    pub fn receive_with(
        &mut self,
        message: &ChangeMessage,
        on_apply: &mut dyn FnMut(&ChangeMessage),
    ) -> Received {
        let stats = &mut self.stats;
        stats.messages += 1;
        if message.tenant_id != self.tenant {
            stats.other_tenant += 1;
            return Received::OtherTenant;
        }
        let replica = self
            .endpoints
            .entry(message.webhook_endpoint_id)
            .or_default();
        if message.epoch < replica.epoch {
            stats.stale += 1;
            return Received::Stale;
        }
        if message.epoch > replica.epoch {
            // The older epoch's held changes can never be applied now: its stream is over.
            stats.stale += replica.held.len() as u64;
            replica.epoch = message.epoch;
            replica.last_change_seq = 0;
            replica.held.clear();
        }
        if message.change_seq <= replica.last_change_seq
            || replica.held.contains_key(&message.change_seq)
        {
            stats.duplicates += 1;
            return Received::Duplicate;
        }
        let expected = replica.last_change_seq + 1;
        if message.change_seq > expected {
            stats.reordered += 1;
            replica.held.insert(message.change_seq, message.clone());
            return Received::Held { expected };
        }
        apply(replica, message, stats);
        on_apply(message);
        while let Some(next) = replica.held.remove(&(replica.last_change_seq + 1)) {
            apply(replica, &next, stats);
            on_apply(&next);
        }
        Received::Applied
    }

    /// Decodes a message body and receives it ([`receive_with`](Self::receive_with)).
    pub fn receive_body_with(
        &mut self,
        body: &[u8],
        on_apply: &mut dyn FnMut(&ChangeMessage),
    ) -> Result<(ChangeMessage, Received), DecodeError> {
        let message = ChangeMessage::decode(body)?;
        let received = self.receive_with(&message, on_apply);
        Ok((message, received))
    }

    pub fn stats(&self) -> ConsumerStats {
        ConsumerStats {
            waiting: self.endpoints.values().map(|r| r.held.len() as u64).sum(),
            ..self.stats
        }
    }

    /// The changes that never came: for each endpoint with changes held, its epoch and the
    /// change_seqs missing before the first of them.
    pub fn missing(&self) -> Vec<(Uuid, u64, RangeInclusive<i64>)> {
        self.endpoints
            .iter()
            .filter_map(|(endpoint, replica)| {
                let (&first_held, _) = replica.held.first_key_value()?;
                Some((
                    *endpoint,
                    replica.epoch,
                    replica.last_change_seq + 1..=first_held - 1,
                ))
            })
            .collect()
    }

    pub fn endpoints(&self) -> &BTreeMap<Uuid, EndpointReplica> {
        &self.endpoints
    }

    /// The endpoint's items, subject to item JSON (empty for an endpoint never seen).
    pub fn items(&self, endpoint: Uuid) -> BTreeMap<String, Value> {
        self.endpoints
            .get(&endpoint)
            .map(|r| {
                r.items
                    .iter()
                    .map(|(s, i)| (s.clone(), i.item.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The endpoint's epoch followed and the last change_seq applied in it ((0, 0): none yet).
    pub fn position(&self, endpoint: Uuid) -> (u64, i64) {
        self.endpoints
            .get(&endpoint)
            .map_or((0, 0), |r| (r.epoch, r.last_change_seq))
    }
}

/// Applies the endpoint's next change to its replica.
fn apply(replica: &mut EndpointReplica, message: &ChangeMessage, stats: &mut ConsumerStats) {
    replica.last_change_seq = message.change_seq;
    stats.applied += 1;
    match (&message.operation, &message.item) {
        (Operation::Upsert, Some(item)) => {
            replica.items.insert(
                message.subject.clone(),
                ReplicaItem {
                    item_kind: message.item_kind.clone(),
                    generation: message.generation,
                    sequence: message.sequence.clone(),
                    change_seq: message.change_seq,
                    item: item.clone(),
                },
            );
        }
        (Operation::SnapshotBegin, _) => {
            replica.items.clear();
            stats.snapshots += 1;
        }
        (Operation::SnapshotEnd, _) => {}
        // `ChangeMessage::decode` refuses an upsert without an item; one built by hand is taken
        // as a removal of the subject.
        (Operation::Upsert | Operation::Remove, _) => {
            if replica.items.remove(&message.subject).is_none() {
                stats.removals_of_nothing += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::PartsDiff;
    use serde_json::json;
    use time::OffsetDateTime;

    fn change(tenant: u128, seq: i64, subject: &str, upsert: bool) -> ChangeMessage {
        ChangeMessage {
            v: 1,
            tenant_id: Uuid::from_u128(tenant),
            webhook_endpoint_id: Uuid::from_u128(9),
            epoch: 1,
            change_seq: seq,
            operation: if upsert {
                Operation::Upsert
            } else {
                Operation::Remove
            },
            subject: subject.into(),
            item_kind: Some("announcement".into()),
            generation: 1,
            sequence: Some(format!("1.{seq}")),
            event_id: Some(format!("evt_{seq}")),
            reload_generation: None,
            snapshot: false,
            item: upsert.then(|| json!({"v": seq})),
            parts_diff: PartsDiff::default(),
            changed_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn changes_in_order_with_redeliveries_rebuild_the_copy_once_each() {
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        let sent = [
            change(1, 1, "a", true),
            change(1, 2, "b", true),
            change(1, 2, "b", true),
            change(1, 3, "a", false),
            change(1, 1, "a", true),
            change(1, 4, "b", true),
        ];
        let answers: Vec<Received> = sent.iter().map(|m| consumer.receive(m)).collect();
        assert_eq!(
            answers,
            [
                Received::Applied,
                Received::Applied,
                Received::Duplicate,
                Received::Applied,
                Received::Duplicate,
                Received::Applied
            ]
        );
        let endpoint = Uuid::from_u128(9);
        assert_eq!(
            consumer.items(endpoint),
            BTreeMap::from([("b".to_owned(), json!({"v": 4}))])
        );
        assert_eq!(consumer.position(endpoint), (1, 4));
        assert_eq!(consumer.stats().waiting, 0);
    }

    #[test]
    fn a_change_ahead_is_held_until_its_predecessors_come() {
        // Redelivered after a nack with requeue: 3 and 4 ahead of 2, 4 twice, then 2.
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        let mut applied = Vec::new();
        let mut receive = |consumer: &mut ReferenceConsumer, m: ChangeMessage| {
            consumer.receive_with(&m, &mut |a| applied.push(a.change_seq))
        };
        assert_eq!(
            receive(&mut consumer, change(1, 1, "a", true)),
            Received::Applied
        );
        assert_eq!(
            receive(&mut consumer, change(1, 3, "a", false)),
            Received::Held { expected: 2 }
        );
        assert_eq!(
            receive(&mut consumer, change(1, 4, "a", true)),
            Received::Held { expected: 2 }
        );
        assert_eq!(
            receive(&mut consumer, change(1, 4, "a", true)),
            Received::Duplicate
        );
        assert_eq!(consumer.stats().waiting, 2);
        assert_eq!(consumer.missing(), [(endpoint, 1, 2..=2)]);
        assert_eq!(
            receive(&mut consumer, change(1, 2, "a", true)),
            Received::Applied
        );
        assert_eq!(applied, [1, 2, 3, 4]);
        // Applied in order: a's last write is 4's upsert, not 3's removal.
        assert_eq!(
            consumer.items(endpoint),
            BTreeMap::from([("a".to_owned(), json!({"v": 4}))])
        );
        let stats = consumer.stats();
        assert_eq!(
            (
                stats.applied,
                stats.reordered,
                stats.duplicates,
                stats.waiting
            ),
            (4, 2, 1, 0)
        );
        assert!(consumer.missing().is_empty());
    }

    #[test]
    fn a_change_that_never_comes_is_named_and_another_tenants_is_counted() {
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        assert_eq!(
            consumer.receive(&change(1, 2, "a", true)),
            Received::Held { expected: 1 }
        );
        assert_eq!(
            consumer.receive(&change(2, 3, "a", true)),
            Received::OtherTenant
        );
        let stats = consumer.stats();
        assert_eq!(
            (stats.waiting, stats.other_tenant, stats.messages),
            (1, 1, 2)
        );
        assert_eq!(consumer.position(Uuid::from_u128(9)), (1, 0));
        assert_eq!(consumer.missing(), [(Uuid::from_u128(9), 1, 1..=1)]);
    }

    #[test]
    fn a_resumed_consumer_starts_after_its_saved_position() {
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        consumer.resume(endpoint, 1, 5);
        assert_eq!(
            consumer.receive(&change(1, 5, "a", true)),
            Received::Duplicate
        );
        assert_eq!(
            consumer.receive(&change(1, 6, "a", true)),
            Received::Applied
        );
        assert_eq!(consumer.position(endpoint), (1, 6));
    }

    /// A change of `epoch` (a snapshot's when `operation` is a marker or `in_snapshot`).
    fn of_epoch(
        epoch: u64,
        seq: i64,
        subject: &str,
        operation: Operation,
        in_snapshot: bool,
    ) -> ChangeMessage {
        let mut message = change(1, seq, subject, operation == Operation::Upsert);
        message.epoch = epoch;
        message.operation = operation;
        if operation.is_marker() || in_snapshot {
            message.snapshot = true;
            message.event_id = None;
        }
        if operation.is_marker() {
            message.subject = String::new();
        }
        message
    }

    #[test]
    fn a_new_epoch_starts_over_its_snapshot_replaces_the_copy_and_the_old_epoch_is_stale() {
        use Operation::*;
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        for seq in 1..=3 {
            consumer.receive(&of_epoch(1, seq, &format!("old{seq}"), Upsert, false));
        }
        let restored = [
            of_epoch(7, 1, "", SnapshotBegin, false),
            of_epoch(7, 2, "old1", Upsert, true),
            of_epoch(7, 3, "kept", Upsert, true),
            of_epoch(7, 4, "", SnapshotEnd, false),
            of_epoch(7, 5, "live", Upsert, false),
        ];
        let answers: Vec<Received> = restored.iter().map(|m| consumer.receive(m)).collect();
        assert_eq!(answers, [Received::Applied; 5]);
        // The old epoch's change 4 and a redelivery of its 2, come late: dropped.
        assert_eq!(
            consumer.receive(&of_epoch(1, 4, "old4", Upsert, false)),
            Received::Stale
        );
        assert_eq!(
            consumer.receive(&of_epoch(1, 2, "old2", Upsert, false)),
            Received::Stale
        );
        // A redelivery within the new epoch: a duplicate, as ever.
        assert_eq!(consumer.receive(&restored[2]), Received::Duplicate);
        let subjects: Vec<String> = consumer.items(endpoint).into_keys().collect();
        assert_eq!(subjects, ["kept", "live", "old1"]);
        assert_eq!(consumer.position(endpoint), (7, 5));
        let stats = consumer.stats();
        assert_eq!(
            (
                stats.stale,
                stats.snapshots,
                stats.duplicates,
                stats.waiting
            ),
            (2, 1, 1, 0)
        );
    }
}
