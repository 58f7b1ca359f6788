//! The reference consumer: rebuilds each endpoint's copy from a tenant's change messages, as the
//! message's contract says a consumer may. Pure: messages in, a copy and counts out, no IO.
//! `relay tail` runs it over a queue; the tests run it over what the publisher sent.
//!
//! A queue delivers in order until a consumer's nack or a lost connection puts messages back:
//! then a quorum queue may deliver a later change before an earlier one. So a change ahead of the
//! next one is held until its predecessors arrive, a change already applied (or held) is dropped
//! as a repeat, and whatever is still held at the end names changes that never came.
//!
//! A stories endpoint's messages ([`StoryMessage`]) follow the same stream rules (they share the
//! endpoint's change_seq and epochs); they rebuild its copy of the stories (one row per story,
//! kept closed once the story closed, as seed 000's table) and the set of stories it notified.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::message::{
    ChangeMessage, DecodeError, Delivered, Operation, StoryMessage, StoryOperation,
};

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

/// One story of a stories endpoint's rebuilt copy: seed 000's row (`stories` table).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaStory {
    pub ticker: Option<String>,
    pub version: u64,
    /// Closed for good: the row stays, with no snapshot.
    pub closed: bool,
    /// The snapshot; `None` once closed.
    pub story: Option<Value>,
}

/// One endpoint's rebuilt copy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EndpointReplica {
    /// The epoch of the change stream followed (0: none yet).
    pub epoch: u64,
    /// The last change_seq applied in it (0: none yet).
    pub last_change_seq: i64,
    /// A feed endpoint's copy, by subject.
    pub items: BTreeMap<String, ReplicaItem>,
    /// A stories endpoint's copy, by story id: open and closed rows.
    pub stories: BTreeMap<String, ReplicaStory>,
    /// A stories endpoint's notifications applied, by story id and then by epoch: how many in
    /// each (the relay claims each story's once, so 1 in an epoch; more is a notification sent
    /// twice under distinct change_seqs, which no redelivery makes). A later epoch may carry one
    /// again: a resync carries the notifications not yet recorded as published, and a restored
    /// relay claims again what it notified after the backup (docs/stories.md).
    pub notified: BTreeMap<String, BTreeMap<u64, u64>>,
    /// Changes of the epoch that came ahead of a predecessor, by change_seq.
    held: BTreeMap<i64, Delivered>,
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
    /// Stories endpoints' changes applied (kinds `story` and `notification`; counted in
    /// `applied` too).
    pub story_changes: u64,
    /// Notifications applied.
    pub notifications: u64,
    /// Drops of a story the rebuilt copy did not hold open (a consumer resumed from a position
    /// whose copy it did not keep).
    pub drops_of_nothing: u64,
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

    /// A feed message: [`receive_delivered_with`](Self::receive_delivered_with), `on_apply`
    /// called with each feed change applied (a feed endpoint's stream holds no other kind).
    pub fn receive_with(
        &mut self,
        message: &ChangeMessage,
        on_apply: &mut dyn FnMut(&ChangeMessage),
    ) -> Received {
        self.follow(Change::Item(message), &mut |applied| match applied {
            None => on_apply(message),
            Some(Delivered::Item(held)) => on_apply(held),
            Some(Delivered::Story(_)) => {}
        })
    }

    /// A stories endpoint's message, without being told what was applied.
    pub fn receive_story(&mut self, message: &StoryMessage) -> Received {
        self.follow(Change::Story(message), &mut |_| {})
    }

    /// A message of either kind, without being told what was applied.
    pub fn receive_delivered(&mut self, message: &Delivered) -> Received {
        self.receive_delivered_with(message, &mut |_| {})
    }

    /// Follows each endpoint's stream as the message contract says, whatever the message's
    /// kind: a change of an older epoch is dropped ([`Received::Stale`]); a greater epoch starts
    /// over at change_seq 1; a change_seq applied or held before in the epoch is dropped; the
    /// next one is applied, then every held one that now follows; one further ahead is held.
    /// `snapshot_begin` forgets what was held of the endpoint (its items and stories; not the
    /// notifications, which were acted on): the snapshot's upserts that follow are the whole
    /// copy. `on_apply` is called with each change applied, in change_seq order.
    pub fn receive_delivered_with(
        &mut self,
        message: &Delivered,
        on_apply: &mut dyn FnMut(&Delivered),
    ) -> Received {
        self.follow(Change::of(message), &mut |applied| {
            on_apply(applied.unwrap_or(message))
        })
    }

    /// The stream rules; `on_apply` is told `None` for `message` itself, and each held change
    /// applied after it.
    fn follow(
        &mut self,
        message: Change<'_>,
        on_apply: &mut dyn FnMut(Option<&Delivered>),
    ) -> Received {
        let stats = &mut self.stats;
        stats.messages += 1;
        if message.tenant() != self.tenant {
            stats.other_tenant += 1;
            return Received::OtherTenant;
        }
        let replica = self.endpoints.entry(message.endpoint()).or_default();
        let (epoch, change_seq) = (message.epoch(), message.change_seq());
        if epoch < replica.epoch {
            stats.stale += 1;
            return Received::Stale;
        }
        if epoch > replica.epoch {
            // The older epoch's held changes can never be applied now: its stream is over.
            stats.stale += replica.held.len() as u64;
            replica.epoch = epoch;
            replica.last_change_seq = 0;
            replica.held.clear();
        }
        if change_seq <= replica.last_change_seq || replica.held.contains_key(&change_seq) {
            stats.duplicates += 1;
            return Received::Duplicate;
        }
        let expected = replica.last_change_seq + 1;
        if change_seq > expected {
            stats.reordered += 1;
            replica.held.insert(change_seq, message.to_delivered());
            return Received::Held { expected };
        }
        apply(replica, message, stats);
        on_apply(None);
        while let Some(next) = replica.held.remove(&(replica.last_change_seq + 1)) {
            apply(replica, Change::of(&next), stats);
            on_apply(Some(&next));
        }
        Received::Applied
    }

    /// Decodes a message body of either kind ([`Delivered::decode`]) and receives it
    /// ([`receive_delivered_with`](Self::receive_delivered_with)).
    pub fn receive_body_with(
        &mut self,
        body: &[u8],
        on_apply: &mut dyn FnMut(&Delivered),
    ) -> Result<(Delivered, Received), DecodeError> {
        let message = Delivered::decode(body)?;
        let received = self.receive_delivered_with(&message, on_apply);
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

    /// The stories endpoint's copy, story id to its row, open and closed (empty for an
    /// endpoint never seen).
    pub fn stories(&self, endpoint: Uuid) -> BTreeMap<String, ReplicaStory> {
        self.endpoints
            .get(&endpoint)
            .map(|r| r.stories.clone())
            .unwrap_or_default()
    }

    /// The ids of the stories the endpoint notified.
    pub fn notifications(&self, endpoint: Uuid) -> BTreeSet<String> {
        self.endpoints
            .get(&endpoint)
            .map(|r| r.notified.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// How many notifications of each story the endpoint sent in one epoch, at most (repeats of
    /// one change_seq dropped): every count is 1 when each story was notified at most once in
    /// each epoch, which is the relay's promise (a later epoch may repeat one: see
    /// [`EndpointReplica::notified`]).
    pub fn notification_counts(&self, endpoint: Uuid) -> BTreeMap<String, u64> {
        self.endpoints
            .get(&endpoint)
            .map(|r| {
                r.notified
                    .iter()
                    .map(|(id, epochs)| (id.clone(), epochs.values().copied().max().unwrap_or(0)))
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

/// A message of either kind, borrowed.
#[derive(Debug, Clone, Copy)]
enum Change<'a> {
    Item(&'a ChangeMessage),
    Story(&'a StoryMessage),
}

impl<'a> Change<'a> {
    fn of(message: &'a Delivered) -> Self {
        match message {
            Delivered::Item(m) => Change::Item(m),
            Delivered::Story(m) => Change::Story(m),
        }
    }

    fn to_delivered(self) -> Delivered {
        match self {
            Change::Item(m) => Delivered::Item(m.clone()),
            Change::Story(m) => Delivered::Story(m.clone()),
        }
    }

    fn tenant(self) -> Uuid {
        match self {
            Change::Item(m) => m.tenant_id,
            Change::Story(m) => m.tenant_id,
        }
    }

    fn endpoint(self) -> Uuid {
        match self {
            Change::Item(m) => m.webhook_endpoint_id,
            Change::Story(m) => m.webhook_endpoint_id,
        }
    }

    fn epoch(self) -> u64 {
        match self {
            Change::Item(m) => m.epoch,
            Change::Story(m) => m.epoch,
        }
    }

    fn change_seq(self) -> i64 {
        match self {
            Change::Item(m) => m.change_seq,
            Change::Story(m) => m.change_seq,
        }
    }
}

/// Applies the endpoint's next change to its replica.
fn apply(replica: &mut EndpointReplica, message: Change<'_>, stats: &mut ConsumerStats) {
    replica.last_change_seq = message.change_seq();
    stats.applied += 1;
    match message {
        Change::Item(message) => apply_item(replica, message, stats),
        Change::Story(message) => apply_story(replica, message, stats),
    }
}

/// A stories endpoint's change, applied as the relay applied it to its copy (in change_seq
/// order, so each write is what the relay's made: no version check here).
fn apply_story(replica: &mut EndpointReplica, message: &StoryMessage, stats: &mut ConsumerStats) {
    stats.story_changes += 1;
    let id = &message.story_id;
    match message.operation {
        StoryOperation::Saved => {
            replica.stories.insert(
                id.clone(),
                ReplicaStory {
                    ticker: message.ticker.clone(),
                    version: message.version,
                    closed: false,
                    // `StoryMessage::decode` refuses a save without its snapshot.
                    story: Some(message.story.clone().unwrap_or(Value::Null)),
                },
            );
        }
        StoryOperation::Closed => {
            replica.stories.insert(
                id.clone(),
                ReplicaStory {
                    ticker: message.ticker.clone(),
                    version: message.version,
                    closed: true,
                    story: None,
                },
            );
        }
        StoryOperation::Dropped => {
            // The relay drops open rows only; a closed row stays, as in its copy.
            if replica.stories.get(id).is_some_and(|row| !row.closed) {
                replica.stories.remove(id);
            } else {
                stats.drops_of_nothing += 1;
            }
        }
        StoryOperation::Notified => {
            stats.notifications += 1;
            *replica
                .notified
                .entry(id.clone())
                .or_default()
                .entry(replica.epoch)
                .or_default() += 1;
        }
    }
}

/// A feed endpoint's change.
fn apply_item(replica: &mut EndpointReplica, message: &ChangeMessage, stats: &mut ConsumerStats) {
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
            replica.stories.clear();
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

    fn story(seq: i64, id: &str, operation: StoryOperation, version: u64) -> StoryMessage {
        use crate::message::StoryKind;
        let has_story = operation.has_story();
        StoryMessage {
            v: 1,
            kind: if operation == StoryOperation::Notified {
                StoryKind::Notification
            } else {
                StoryKind::Story
            },
            tenant_id: Uuid::from_u128(1),
            webhook_endpoint_id: Uuid::from_u128(9),
            epoch: 1,
            change_seq: seq,
            operation,
            story_id: id.into(),
            ticker: Some("ALFA B".into()),
            version,
            story: has_story.then(|| json!({"id": id, "version": version})),
            merged_into: None,
            event_id: (operation != StoryOperation::Dropped).then(|| format!("evt_{seq}")),
            reload_round: (operation == StoryOperation::Dropped).then_some(1),
            snapshot: false,
            changed_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn stories_are_rebuilt_from_changes_out_of_order_and_twice() {
        use StoryOperation::*;
        let endpoint = Uuid::from_u128(9);
        let mut merged = story(4, "a", Closed, 3);
        merged.merged_into = Some("b".into());
        let sent = [
            story(1, "a", Saved, 1),
            story(2, "b", Saved, 1),
            story(3, "a", Saved, 2),
            merged,
            story(5, "b", Saved, 2),
            story(6, "b", Notified, 2),
            story(7, "c", Saved, 1),
            story(8, "c", Dropped, 1),
        ];
        // Through bodies, as a queue delivers them: 5..8 ahead of 2..4, 6 three times, 3 twice.
        let order = [0, 4, 5, 5, 6, 7, 1, 2, 2, 3, 5];
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        let mut applied = Vec::new();
        for &i in &order {
            let body = sent[i].encode();
            consumer
                .receive_body_with(&body, &mut |m| {
                    applied.push((m.change_seq(), m.operation()))
                })
                .unwrap();
        }
        let seqs: Vec<i64> = applied.iter().map(|a| a.0).collect();
        assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
        assert_eq!(applied[3].1, "closed");
        assert_eq!(
            consumer.stories(endpoint),
            BTreeMap::from([
                (
                    "a".to_owned(),
                    ReplicaStory {
                        ticker: Some("ALFA B".into()),
                        version: 3,
                        closed: true,
                        story: None
                    }
                ),
                (
                    "b".to_owned(),
                    ReplicaStory {
                        ticker: Some("ALFA B".into()),
                        version: 2,
                        closed: false,
                        story: Some(json!({"id": "b", "version": 2}))
                    }
                ),
            ])
        );
        assert_eq!(
            consumer.notifications(endpoint),
            BTreeSet::from(["b".to_owned()])
        );
        assert_eq!(
            consumer.notification_counts(endpoint),
            BTreeMap::from([("b".to_owned(), 1)])
        );
        assert!(consumer.items(endpoint).is_empty());
        assert_eq!(consumer.position(endpoint), (1, 8));
        let stats = consumer.stats();
        assert_eq!(
            (
                stats.messages,
                stats.applied,
                stats.story_changes,
                stats.duplicates,
                stats.reordered,
                stats.notifications,
                stats.waiting,
                stats.drops_of_nothing
            ),
            (11, 8, 8, 3, 4, 1, 0, 0)
        );
        assert!(consumer.missing().is_empty());
    }

    #[test]
    fn a_story_notified_twice_under_distinct_change_seqs_is_counted_twice() {
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        let first = story(1, "a", StoryOperation::Notified, 1);
        let second = story(2, "a", StoryOperation::Notified, 2);
        for message in [&first, &second, &first] {
            consumer.receive_story(message);
        }
        assert_eq!(consumer.notification_counts(endpoint)["a"], 2);
        assert_eq!(consumer.stats().duplicates, 1);
    }

    #[test]
    fn a_story_notified_again_in_a_later_epoch_is_not_a_repeat() {
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        consumer.receive_story(&story(1, "a", StoryOperation::Notified, 1));
        let again = StoryMessage {
            epoch: 2,
            ..story(1, "a", StoryOperation::Notified, 1)
        };
        consumer.receive_story(&again);
        assert_eq!(consumer.position(endpoint), (2, 1));
        assert_eq!(consumer.notification_counts(endpoint)["a"], 1);
        assert_eq!(consumer.stats().notifications, 2);
    }

    #[test]
    fn a_held_story_change_waits_for_its_predecessor_and_a_missing_one_is_named() {
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        assert_eq!(
            consumer.receive_story(&story(2, "a", StoryOperation::Closed, 4)),
            Received::Held { expected: 1 }
        );
        assert!(consumer.stories(endpoint).is_empty());
        assert_eq!(consumer.missing(), [(endpoint, 1, 1..=1)]);
        // The feed's `receive_with` tells nothing of a story change it released.
        let mut told = 0;
        let first = change(1, 1, "x", true);
        assert_eq!(
            consumer.receive_with(&first, &mut |_| told += 1),
            Received::Applied
        );
        assert_eq!(told, 1);
        assert!(consumer.stories(endpoint)["a"].closed);
        assert_eq!(consumer.position(endpoint), (1, 2));
    }

    #[test]
    fn a_drop_takes_the_open_row_and_leaves_a_closed_one() {
        use StoryOperation::*;
        let endpoint = Uuid::from_u128(9);
        let mut consumer = ReferenceConsumer::new(Uuid::from_u128(1));
        for message in [
            story(1, "open", Saved, 1),
            story(2, "shut", Closed, 2),
            story(3, "open", Dropped, 1),
            story(4, "shut", Dropped, 2),
        ] {
            assert_eq!(consumer.receive_story(&message), Received::Applied);
        }
        let stories = consumer.stories(endpoint);
        assert_eq!(stories.keys().collect::<Vec<_>>(), ["shut"]);
        assert_eq!(consumer.stats().drops_of_nothing, 1);
    }
}
