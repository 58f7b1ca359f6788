//! One owned tenant's changes between Postgres and the broker, as books: what is held of each
//! endpoint, what is sent and awaits its confirm, what was confirmed in turn and waits to be
//! marked. Pure: no IO, no clock (the caller says when), so every interleaving of sends and
//! confirms can be played in a unit test; the tenant's loop (`tenant`) carries it out.
//!
//! # The window
//! Up to `window` changes of one endpoint are sent before the first of them is confirmed, in
//! change_seq order, all on the tenant's one channel: publishes on one channel reach a queue in
//! the order they were published. The tenant as a whole has at most `max_in_flight` publishes
//! awaiting their confirm.
//!
//! RabbitMQ does not promise to confirm in publish order, so each endpoint's sent changes are
//! kept in order with whether each was acked, and only the run of acked changes at the front
//! leaves the window ("confirmed in turn") to be marked: marking moves a cursor that says
//! "everything up to here".
//!
//! # Going back
//! A nack or a return of a change puts it and every change of its endpoint sent after it (acked
//! or not) back at the head of the endpoint's queue, in order, to be sent again from there; a
//! lost channel does the same from each endpoint's first unconfirmed change. The changes sent
//! before the refused one stay in the window awaiting their own confirms (a nack may overtake
//! the acks of changes the queue already holds: RabbitMQ confirms a persistent message once it
//! is written, and refuses one at once); if one of them is refused in turn, it goes back with
//! everything after it, resends included.
//!
//! What goes back is always the end of a window, and what is sent is always added behind what
//! stays: so each window is in change_seq order and in publish order at once, the copy of a
//! change that is confirmed in turn was published after the confirmed copy of every change
//! before it, and every other copy of it (refused, or in doubt) was published before its
//! confirmed one. On one channel that is the order of the queue: whatever the broker made of the
//! first copies, the last copy of each change_seq comes after the last copy of every earlier
//! one. Each publish has a [`SendId`] of its own; the outcome of one put back (a late ack, say)
//! is ignored: its resend's outcome is the one that counts, so a change is never confirmed
//! twice nor out of turn.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use uuid::Uuid;

use crate::outbox::OutboxChange;

/// Changes a tenant may hold in memory (read or handed, not yet confirmed in turn), per change it
/// may have in flight: what one tenant can take of the process's memory is bounded by its
/// `max_in_flight`, whatever its endpoints' windows.
pub(crate) const HELD_PER_IN_FLIGHT: usize = 16;
/// Most changes of an endpoint held, at least: what an endpoint with a window of one reads ahead.
const MIN_READ_AHEAD: usize = 16;

/// One publish: which one it was, among every publish of the tenant's task.
pub(crate) type SendId = u64;

/// The bounds a [`Stream`] keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Most changes of one endpoint sent and not yet confirmed in turn.
    pub window: usize,
    /// Most publishes of the tenant awaiting their confirm (those put back included, until
    /// their outcome comes).
    pub max_in_flight: usize,
    /// Most changes of one endpoint held (queued or sent): twice its window, so a window's worth
    /// waits to be sent while a window is in flight.
    pub read_ahead: usize,
    /// Most changes of the tenant held; also the most confirmed and not yet marked before
    /// sending stops (marks failing: what a crash would send again stays bounded).
    pub max_held: usize,
}

impl Limits {
    /// The bounds for a tenant with `max_in_flight` publishes and `window` per endpoint (a
    /// window above `max_in_flight` could never fill).
    pub(crate) fn new(max_in_flight: usize, window: usize) -> Self {
        let max_in_flight = max_in_flight.max(1);
        let window = window.clamp(1, max_in_flight);
        let max_held = max_in_flight * HELD_PER_IN_FLIGHT;
        Self {
            window,
            max_in_flight,
            read_ahead: (2 * window).max(MIN_READ_AHEAD).min(max_held),
            max_held,
        }
    }
}

/// A change to publish now.
#[derive(Debug)]
pub(crate) struct ToSend {
    pub change: OutboxChange,
    pub id: SendId,
    /// It was sent before and put back: this is a resend.
    pub again: bool,
    /// The endpoint's changes in its window with this one.
    pub in_window: usize,
}

/// What an ack did.
#[derive(Debug)]
pub(crate) enum Acked {
    /// The publish had been put back: its resend's outcome counts, not this one.
    Ignored,
    /// Booked; these changes (none, when an earlier one is still unconfirmed) are now confirmed
    /// in turn, in change_seq order.
    InTurn(Vec<OutboxChange>),
}

/// A change read or handed, waiting to be sent.
#[derive(Debug)]
struct Queued {
    change: OutboxChange,
    again: bool,
}

/// A change sent, in its endpoint's window.
#[derive(Debug)]
struct Sent {
    change: OutboxChange,
    id: SendId,
    acked: bool,
}

/// What is held of one endpoint; dropped once it holds nothing.
#[derive(Debug, Default)]
struct Lane {
    /// Sent, in change_seq order; the first is never acked (an acked run at the front is
    /// confirmed in turn at once).
    sent: VecDeque<Sent>,
    /// Not sent (or put back), in change_seq order, after everything in `sent`.
    queued: VecDeque<Queued>,
}

impl Lane {
    fn len(&self) -> usize {
        self.sent.len() + self.queued.len()
    }
}

/// How far an endpoint's stream has been read, kept while the tenant is owned: later reads ask
/// only for what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    epoch: u64,
    /// The highest change_seq held in `epoch`.
    through: i64,
}

/// The tenant's changes between Postgres and the broker.
#[derive(Debug)]
pub(crate) struct Stream {
    limits: Limits,
    lanes: HashMap<Uuid, Lane>,
    positions: HashMap<Uuid, Position>,
    /// Endpoints that may send now (a change queued, room in the window), each at most once.
    ready: VecDeque<Uuid>,
    in_ready: HashSet<Uuid>,
    /// Endpoints whose last read filled their room: more may wait in Postgres.
    pub capped: HashSet<Uuid>,
    /// Endpoints to read next.
    pub wanted: HashSet<Uuid>,
    /// Read every endpoint with a backlog next.
    pub sweep: bool,
    /// Changes held: queued or sent, not yet confirmed in turn.
    held: usize,
    /// Changes in the endpoints' windows.
    sending: usize,
    /// Publishes put back whose outcome has still to come.
    stale: usize,
    /// Confirmed in turn, not yet in a mark.
    confirmed: Vec<(Uuid, i64)>,
    /// When the first of `confirmed` was confirmed.
    first_unmarked_at: Option<Instant>,
    next_id: SendId,
}

impl Stream {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            lanes: HashMap::new(),
            positions: HashMap::new(),
            ready: VecDeque::new(),
            in_ready: HashSet::new(),
            capped: HashSet::new(),
            wanted: HashSet::new(),
            sweep: false,
            held: 0,
            sending: 0,
            stale: 0,
            confirmed: Vec::new(),
            first_unmarked_at: None,
            next_id: 0,
        }
    }

    pub(crate) fn limits(&self) -> Limits {
        self.limits
    }

    /// Nothing held and nothing waiting to be marked.
    pub(crate) fn is_empty(&self) -> bool {
        self.held == 0 && self.confirmed.is_empty()
    }

    /// Changes held (queued or sent, not yet confirmed in turn).
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Publishes awaiting their confirm, or sent and waiting for an earlier one's.
    pub(crate) fn in_flight(&self) -> usize {
        self.sending + self.stale
    }

    /// Confirmed in turn, not yet in a mark.
    pub(crate) fn unmarked(&self) -> usize {
        self.confirmed.len()
    }

    /// When the first change confirmed since the last mark was confirmed.
    pub(crate) fn first_unmarked_at(&self) -> Option<Instant> {
        self.first_unmarked_at
            .filter(|_| !self.confirmed.is_empty())
    }

    /// The highest change_seq held of `endpoint` (0: none yet): where its next read starts.
    pub(crate) fn held_through(&self, endpoint: Uuid) -> i64 {
        self.positions.get(&endpoint).map_or(0, |p| p.through)
    }

    /// Room for more changes of `endpoint`.
    pub(crate) fn room(&self, endpoint: Uuid) -> usize {
        let held = self.lanes.get(&endpoint).map_or(0, Lane::len);
        self.limits.read_ahead.saturating_sub(held)
    }

    /// Takes in what a read returned for `asked` (endpoint, room asked for).
    /// Returns how many were not held already.
    pub(crate) fn add_read(&mut self, asked: &[(Uuid, usize)], changes: Vec<OutboxChange>) -> u64 {
        let mut returned: HashMap<Uuid, usize> = HashMap::new();
        let mut taken = 0;
        for change in changes {
            *returned.entry(change.key().0).or_default() += 1;
            taken += u64::from(self.hold(change));
        }
        for (endpoint, room) in asked {
            if returned.get(endpoint).copied().unwrap_or(0) >= *room {
                self.capped.insert(*endpoint);
            } else {
                self.capped.remove(endpoint);
            }
        }
        taken
    }

    /// Takes in changes the sequencer of this process handed over, in the order it committed
    /// them: each that follows on from what is held of its endpoint (the next change_seq, the
    /// same epoch) while the endpoint and the tenant have room. An endpoint with one that does
    /// not follow on is read from the outbox instead, from where the stream is. Returns how
    /// many were queued.
    pub(crate) fn add_handed(&mut self, handed: Vec<OutboxChange>) -> u64 {
        let mut taken = 0;
        for change in handed {
            let (endpoint, seq) = change.key();
            let position = self.positions.get(&endpoint).copied();
            let epoch = change.message.epoch();
            let same_epoch = position.is_some_and(|p| p.epoch == epoch);
            if same_epoch && position.is_some_and(|p| seq <= p.through) {
                continue;
            }
            let follows = same_epoch && position.is_some_and(|p| p.through == seq - 1);
            if follows && self.room(endpoint) > 0 && self.held < self.limits.max_held {
                taken += u64::from(self.hold(change));
            } else {
                self.wanted.insert(endpoint);
            }
        }
        taken
    }

    /// Queues `change` behind what is held of its endpoint, unless it is held already (read
    /// again before its mark, or handed and read both) or of an older epoch than what is held:
    /// whether it was queued. A change of a newer epoch first drops what is held of the older
    /// one (see [`Stream::reset`]).
    fn hold(&mut self, change: OutboxChange) -> bool {
        let (endpoint, seq) = change.key();
        let epoch = change.message.epoch();
        let position = *self
            .positions
            .entry(endpoint)
            .or_insert(Position { epoch, through: 0 });
        if epoch < position.epoch {
            return false;
        }
        if epoch > position.epoch {
            self.reset(endpoint, epoch);
        } else if seq <= position.through {
            return false;
        }
        self.positions.insert(
            endpoint,
            Position {
                epoch,
                through: seq,
            },
        );
        self.lanes
            .entry(endpoint)
            .or_default()
            .queued
            .push_back(Queued {
                change,
                again: false,
            });
        self.held += 1;
        self.make_ready(endpoint);
        true
    }

    /// A new epoch of `endpoint`'s stream: what is held of the old one will never be sent nor
    /// marked (its changes are gone from the outbox, and its change_seqs mean other changes
    /// now). Its publishes in flight are put back for good.
    fn reset(&mut self, endpoint: Uuid, epoch: u64) {
        if let Some(lane) = self.lanes.remove(&endpoint) {
            self.held -= lane.len();
            self.sending -= lane.sent.len();
            self.stale += lane.sent.iter().filter(|s| !s.acked).count();
        }
        self.confirmed.retain(|(e, _)| *e != endpoint);
        self.capped.remove(&endpoint);
        self.positions
            .insert(endpoint, Position { epoch, through: 0 });
    }

    /// Whether the next publish may go now: an endpoint is ready, the tenant's bound of
    /// publishes in flight has room, and not too many confirmed changes wait for their mark.
    pub(crate) fn may_send(&self) -> bool {
        !self.ready.is_empty()
            && self.in_flight() < self.limits.max_in_flight
            && self.confirmed.len() < self.limits.max_held
    }

    /// The next change to send: the head of the first ready endpoint's queue. Endpoints take
    /// turns, a change each.
    pub(crate) fn next_to_send(&mut self) -> Option<ToSend> {
        if !self.may_send() {
            return None;
        }
        while let Some(endpoint) = self.ready.pop_front() {
            self.in_ready.remove(&endpoint);
            let window = self.limits.window;
            let Some(lane) = self.lanes.get_mut(&endpoint) else {
                continue;
            };
            if lane.sent.len() >= window {
                continue;
            }
            let Some(Queued { change, again }) = lane.queued.pop_front() else {
                continue;
            };
            let id = self.next_id;
            self.next_id += 1;
            lane.sent.push_back(Sent {
                change: change.clone(),
                id,
                acked: false,
            });
            let in_window = lane.sent.len();
            self.sending += 1;
            self.make_ready(endpoint);
            return Some(ToSend {
                change,
                id,
                again,
                in_window,
            });
        }
        None
    }

    /// The broker acked publish `id` of `endpoint`'s change `seq`; `now` is when.
    pub(crate) fn acked(&mut self, endpoint: Uuid, seq: i64, id: SendId, now: Instant) -> Acked {
        let Some(at) = self.sent_index(endpoint, seq, id) else {
            self.stale = self.stale.saturating_sub(1);
            return Acked::Ignored;
        };
        let lane = self.lanes.get_mut(&endpoint).expect("found above");
        lane.sent[at].acked = true;
        let mut in_turn = Vec::new();
        while lane.sent.front().is_some_and(|s| s.acked) {
            let sent = lane.sent.pop_front().expect("checked");
            in_turn.push(sent.change);
        }
        if in_turn.is_empty() {
            return Acked::InTurn(in_turn);
        }
        self.sending -= in_turn.len();
        self.held -= in_turn.len();
        if self.confirmed.is_empty() {
            self.first_unmarked_at = Some(now);
        }
        self.confirmed.extend(in_turn.iter().map(OutboxChange::key));
        self.after_leaving(endpoint);
        Acked::InTurn(in_turn)
    }

    /// Publish `id` of `endpoint`'s change `seq` was nacked or returned: it and every change of
    /// the endpoint sent after it go back to the head of its queue, in order. `None` when that
    /// publish had been put back already (its resend's outcome counts); otherwise how many
    /// changes went back.
    pub(crate) fn refused(&mut self, endpoint: Uuid, seq: i64, id: SendId) -> Option<usize> {
        let Some(at) = self.sent_index(endpoint, seq, id) else {
            self.stale = self.stale.saturating_sub(1);
            return None;
        };
        Some(self.go_back(endpoint, at, Some(id)))
    }

    /// The channel is gone, and with it every confirm still to come (the caller drops them): every
    /// sent change of every endpoint goes back. Returns how many went back.
    pub(crate) fn link_lost(&mut self) -> usize {
        let endpoints: Vec<Uuid> = self
            .lanes
            .iter()
            .filter(|(_, lane)| !lane.sent.is_empty())
            .map(|(endpoint, _)| *endpoint)
            .collect();
        let put_back = endpoints
            .into_iter()
            .map(|e| self.go_back(e, 0, None))
            .sum();
        self.stale = 0;
        put_back
    }

    /// Takes what waits to be marked, in the order it was confirmed.
    pub(crate) fn take_marks(&mut self) -> Vec<(Uuid, i64)> {
        self.first_unmarked_at = None;
        std::mem::take(&mut self.confirmed)
    }

    /// A mark of `keys` failed: they wait again, before what was confirmed since.
    pub(crate) fn mark_failed(&mut self, mut keys: Vec<(Uuid, i64)>, now: Instant) {
        keys.append(&mut self.confirmed);
        self.confirmed = keys;
        self.first_unmarked_at = Some(now);
    }

    /// Where publish `id` of (`endpoint`, `seq`) is in the endpoint's window, if it is still
    /// there as that publish.
    fn sent_index(&self, endpoint: Uuid, seq: i64, id: SendId) -> Option<usize> {
        let lane = self.lanes.get(&endpoint)?;
        let at = lane
            .sent
            .binary_search_by_key(&seq, |s| s.change.key().1)
            .ok()?;
        (lane.sent[at].id == id && !lane.sent[at].acked).then_some(at)
    }

    /// Puts `endpoint`'s sent changes from the `from`th on back at the head of its queue. Those
    /// whose outcome has not come (all unacked but `outcome_of`) become stale: still in flight
    /// at the broker.
    fn go_back(&mut self, endpoint: Uuid, from: usize, outcome_of: Option<SendId>) -> usize {
        let Some(lane) = self.lanes.get_mut(&endpoint) else {
            return 0;
        };
        let count = lane.sent.len().saturating_sub(from);
        for _ in 0..count {
            let sent = lane.sent.pop_back().expect("counted");
            if !sent.acked && Some(sent.id) != outcome_of {
                self.stale += 1;
            }
            lane.queued.push_front(Queued {
                change: sent.change,
                again: true,
            });
        }
        self.sending -= count;
        self.make_ready(endpoint);
        count
    }

    /// Changes of `endpoint` were confirmed in turn: it may send more, and read more.
    fn after_leaving(&mut self, endpoint: Uuid) {
        let held = self.lanes.get(&endpoint).map_or(0, Lane::len);
        if held == 0 {
            self.lanes.remove(&endpoint);
        } else {
            self.make_ready(endpoint);
        }
        // Read again once half the read-ahead is free, so a busy endpoint's queue refills while
        // its window is in flight rather than after it drained.
        if self.capped.contains(&endpoint) && self.room(endpoint) * 2 >= self.limits.read_ahead {
            self.wanted.insert(endpoint);
        }
    }

    /// Marks `endpoint` ready if it has a change queued and room in its window.
    fn make_ready(&mut self, endpoint: Uuid) {
        let Some(lane) = self.lanes.get(&endpoint) else {
            return;
        };
        if !lane.queued.is_empty()
            && lane.sent.len() < self.limits.window
            && self.in_ready.insert(endpoint)
        {
            self.ready.push_back(endpoint);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_store::changes::Unpublished;
    use relay_store::EndpointId;
    use time::OffsetDateTime;

    const TENANT: Uuid = Uuid::from_u128(1);

    fn endpoint(n: u128) -> Uuid {
        Uuid::from_u128(0x100 + n)
    }

    /// Change `seq` of `endpoint` in `epoch`, as the outbox holds it.
    fn change(endpoint: Uuid, epoch: i64, seq: i64) -> OutboxChange {
        let row = Unpublished {
            endpoint: EndpointId(endpoint),
            epoch,
            change_seq: seq,
            kind: "item".into(),
            operation: "upsert".into(),
            subject: format!("announcement:{seq}"),
            item_kind: Some("announcement".into()),
            generation: 1,
            sequence: Some(format!("{seq}")),
            event_id: Some(format!("evt_{seq}")),
            reload_generation: None,
            snapshot: false,
            item: Some(r#"{"feed_item_id": "announcement:1"}"#.into()),
            parts_diff: r#"{"added": [], "changed": [], "removed": []}"#.into(),
            created_at: OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap(),
            story_version: None,
            ticker: None,
            merged_into: None,
        };
        OutboxChange::from_row(TENANT, row).unwrap()
    }

    fn changes(
        endpoint: Uuid,
        epoch: i64,
        seqs: std::ops::RangeInclusive<i64>,
    ) -> Vec<OutboxChange> {
        seqs.map(|seq| change(endpoint, epoch, seq)).collect()
    }

    /// A stream holding `seqs` of each of `endpoints` (epoch 1), as one read.
    fn holding(limits: Limits, endpoints: &[Uuid], seqs: std::ops::RangeInclusive<i64>) -> Stream {
        let mut stream = Stream::new(limits);
        let mut read = Vec::new();
        let mut asked = Vec::new();
        for &e in endpoints {
            read.extend(changes(e, 1, seqs.clone()));
            asked.push((e, limits.read_ahead));
        }
        stream.add_read(&asked, read);
        stream
    }

    /// Everything sendable now: (endpoint, seq, id, again).
    fn send_all(stream: &mut Stream) -> Vec<(Uuid, i64, SendId, bool)> {
        std::iter::from_fn(|| stream.next_to_send())
            .map(|s| {
                let (e, seq) = s.change.key();
                (e, seq, s.id, s.again)
            })
            .collect()
    }

    fn seqs_of(sends: &[(Uuid, i64, SendId, bool)]) -> Vec<i64> {
        sends.iter().map(|s| s.1).collect()
    }

    fn in_turn(acked: Acked) -> Vec<i64> {
        match acked {
            Acked::InTurn(changes) => changes.iter().map(|c| c.key().1).collect(),
            Acked::Ignored => panic!("ignored"),
        }
    }

    fn limits(max_in_flight: usize, window: usize) -> Limits {
        Limits::new(max_in_flight, window)
    }

    #[test]
    fn the_read_ahead_covers_the_window_and_the_tenant_bound_holds() {
        let l = limits(256, 64);
        assert_eq!((l.window, l.read_ahead, l.max_held), (64, 128, 4096));
        // A window of one reads ahead as before.
        assert_eq!(limits(256, 1).read_ahead, 16);
        // A window is never above the tenant's bound, nor the read-ahead above the held bound.
        let l = limits(2, 64);
        assert_eq!((l.window, l.read_ahead, l.max_held), (2, 16, 32));
        let l = limits(1, 1);
        assert_eq!((l.window, l.read_ahead, l.max_held), (1, 16, 16));
        assert!(limits(4, 4).read_ahead >= 4);
    }

    #[test]
    fn an_endpoint_sends_in_order_up_to_its_window() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 4), &[e], 1..=10);
        let sent = send_all(&mut stream);
        assert_eq!(seqs_of(&sent), [1, 2, 3, 4]);
        assert!(sent.iter().all(|s| !s.3), "first sends");
        assert_eq!(stream.in_flight(), 4);
        // A confirm of the first frees one place: the next change goes.
        assert_eq!(in_turn(stream.acked(e, 1, sent[0].2, Instant::now())), [1]);
        assert_eq!(seqs_of(&send_all(&mut stream)), [5]);
    }

    #[test]
    fn the_window_counts_the_changes_sent_in_it() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 3), &[e], 1..=5);
        let windows: Vec<usize> = std::iter::from_fn(|| stream.next_to_send())
            .map(|s| s.in_window)
            .collect();
        assert_eq!(windows, [1, 2, 3]);
    }

    #[test]
    fn out_of_order_confirms_mark_only_the_confirmed_prefix() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 8), &[e], 1..=5);
        let sent = send_all(&mut stream);
        let now = Instant::now();
        assert_eq!(
            in_turn(stream.acked(e, 3, sent[2].2, now)),
            Vec::<i64>::new()
        );
        assert_eq!(
            in_turn(stream.acked(e, 2, sent[1].2, now)),
            Vec::<i64>::new()
        );
        assert_eq!(stream.unmarked(), 0, "nothing before 1 is confirmed");
        assert_eq!(in_turn(stream.acked(e, 1, sent[0].2, now)), [1, 2, 3]);
        assert_eq!(
            in_turn(stream.acked(e, 5, sent[4].2, now)),
            Vec::<i64>::new()
        );
        assert_eq!(in_turn(stream.acked(e, 4, sent[3].2, now)), [4, 5]);
        assert_eq!(
            stream.take_marks(),
            (1..=5).map(|s| (e, s)).collect::<Vec<_>>()
        );
        assert!(stream.is_empty());
        assert_eq!(stream.in_flight(), 0);
    }

    #[test]
    fn a_nack_in_the_middle_sends_it_and_everything_after_again_and_late_acks_are_ignored() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 8), &[e], 1..=6);
        let first = send_all(&mut stream);
        assert_eq!(seqs_of(&first), [1, 2, 3, 4, 5, 6]);
        let now = Instant::now();
        assert_eq!(in_turn(stream.acked(e, 1, first[0].2, now)), [1]);
        // 4 acked ahead of 2 and 3; then 3 is nacked while 2 is still out.
        assert_eq!(
            in_turn(stream.acked(e, 4, first[3].2, now)),
            Vec::<i64>::new()
        );
        assert_eq!(stream.refused(e, 3, first[2].2), Some(4));
        // 2 stays in the window; 5 and 6 are still out at the broker: all count against the
        // tenant's bound.
        assert_eq!(stream.in_flight(), 3);
        let again = send_all(&mut stream);
        assert_eq!(seqs_of(&again), [3, 4, 5, 6], "it and everything after it");
        assert!(again.iter().all(|s| s.3), "resends");
        // Late outcomes of the copies put back: ignored, each once.
        assert_eq!(stream.refused(e, 5, first[4].2), None);
        assert!(matches!(
            stream.acked(e, 6, first[5].2, now),
            Acked::Ignored
        ));
        assert_eq!(stream.in_flight(), 5, "the stale ones' outcomes came");
        // An ack of a copy put back never confirms the change: its resend must be acked.
        assert!(matches!(
            stream.acked(e, 4, first[3].2, now),
            Acked::Ignored
        ));
        assert_eq!(stream.unmarked(), 1);
        // 2's own ack counts: it was never put back.
        assert_eq!(in_turn(stream.acked(e, 2, first[1].2, now)), [2]);
        for (i, s) in again.iter().enumerate().rev() {
            let turn = in_turn(stream.acked(e, s.1, s.2, now));
            assert_eq!(turn, if i == 0 { vec![3, 4, 5, 6] } else { vec![] });
        }
        assert_eq!(
            stream.take_marks(),
            (1..=6).map(|s| (e, s)).collect::<Vec<_>>(),
            "each change confirmed once, in order"
        );
        assert_eq!(stream.in_flight(), 0);
    }

    #[test]
    fn a_change_refused_before_its_successors_resends_goes_back_with_them() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 8), &[e], 1..=3);
        let first = send_all(&mut stream);
        // 2 is nacked while 1 awaits its confirm; 2 and 3 are sent again.
        assert_eq!(stream.refused(e, 2, first[1].2), Some(2));
        let second = send_all(&mut stream);
        assert_eq!(seqs_of(&second), [2, 3]);
        // Then 1 is nacked: it goes back with the resends behind it, which go out after it.
        assert_eq!(stream.refused(e, 1, first[0].2), Some(3));
        let third = send_all(&mut stream);
        assert_eq!(seqs_of(&third), [1, 2, 3]);
        assert!(
            third.windows(2).all(|w| w[0].2 < w[1].2),
            "published in order"
        );
        assert!(matches!(
            stream.acked(e, 2, second[0].2, Instant::now()),
            Acked::Ignored
        ));
        for s in third.iter().rev() {
            let _ = stream.acked(e, s.1, s.2, Instant::now());
        }
        assert_eq!(stream.take_marks(), [(e, 1), (e, 2), (e, 3)]);
        assert_eq!(
            stream.in_flight(),
            2,
            "the first two copies of 3 have not answered"
        );
    }

    #[test]
    fn a_resend_refused_again_goes_back_again() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 4), &[e], 1..=2);
        let first = send_all(&mut stream);
        assert_eq!(stream.refused(e, 1, first[0].2), Some(2));
        let second = send_all(&mut stream);
        assert_eq!(stream.refused(e, 1, second[0].2), Some(2));
        // The first round's 2 answers late, after the second round's 1 was refused.
        assert_eq!(stream.refused(e, 2, first[1].2), None);
        let third = send_all(&mut stream);
        assert_eq!(seqs_of(&third), [1, 2]);
        assert!(matches!(
            stream.acked(e, 2, second[1].2, Instant::now()),
            Acked::Ignored
        ));
        assert_eq!(
            in_turn(stream.acked(e, 2, third[1].2, Instant::now())),
            Vec::<i64>::new()
        );
        assert_eq!(
            in_turn(stream.acked(e, 1, third[0].2, Instant::now())),
            [1, 2]
        );
        assert_eq!(stream.in_flight(), 0);
    }

    #[test]
    fn trouble_on_one_endpoint_leaves_the_others_windows_alone() {
        let (a, b) = (endpoint(1), endpoint(2));
        let mut stream = holding(limits(256, 4), &[a, b], 1..=3);
        let sent = send_all(&mut stream);
        assert_eq!(sent.len(), 6);
        let a1 = sent.iter().find(|s| s.0 == a && s.1 == 1).unwrap();
        assert_eq!(stream.refused(a, 1, a1.2), Some(3));
        let again = send_all(&mut stream);
        assert!(again.iter().all(|s| s.0 == a), "{again:?}");
        for s in sent.iter().filter(|s| s.0 == b) {
            let _ = stream.acked(b, s.1, s.2, Instant::now());
        }
        assert_eq!(stream.take_marks(), [(b, 1), (b, 2), (b, 3)]);
    }

    #[test]
    fn a_lost_link_puts_every_window_back_and_forgets_the_confirms_to_come() {
        let (a, b) = (endpoint(1), endpoint(2));
        let mut stream = holding(limits(256, 4), &[a, b], 1..=3);
        let sent = send_all(&mut stream);
        let a2 = sent.iter().find(|s| s.0 == a && s.1 == 2).unwrap();
        let _ = stream.acked(a, 2, a2.2, Instant::now());
        assert_eq!(stream.link_lost(), 6);
        assert_eq!(
            stream.in_flight(),
            0,
            "the confirms to come were dropped with the link"
        );
        let again = send_all(&mut stream);
        let mut of_a: Vec<i64> = again.iter().filter(|s| s.0 == a).map(|s| s.1).collect();
        assert_eq!(of_a, [1, 2, 3]);
        of_a = again.iter().filter(|s| s.0 == b).map(|s| s.1).collect();
        assert_eq!(of_a, [1, 2, 3]);
        assert!(again.iter().all(|s| s.3));
    }

    #[test]
    fn the_tenants_bound_counts_every_publish_out_stale_ones_too() {
        let (a, b) = (endpoint(1), endpoint(2));
        let mut stream = holding(limits(3, 2), &[a, b], 1..=4);
        let sent = send_all(&mut stream);
        assert_eq!(sent.len(), 3, "{sent:?}");
        // Endpoints take turns.
        assert_eq!(sent.iter().filter(|s| s.0 == a).count(), 2);
        let first_of = |e| sent.iter().find(|s| s.0 == e && s.1 == 1).unwrap().2;
        // a's window goes back: its second publish is still out, so one place stays taken.
        assert_eq!(stream.refused(a, 1, first_of(a)), Some(2));
        assert_eq!(stream.in_flight(), 2);
        assert_eq!(send_all(&mut stream).len(), 1);
        assert!(!stream.may_send());
        assert!(matches!(
            stream.acked(
                a,
                2,
                sent.iter().find(|s| s.0 == a && s.1 == 2).unwrap().2,
                Instant::now()
            ),
            Acked::Ignored
        ));
        assert_eq!(send_all(&mut stream).len(), 1);
        assert_eq!(stream.in_flight(), 3);
    }

    #[test]
    fn sending_stops_while_too_many_confirmed_changes_wait_for_their_mark() {
        let e = endpoint(1);
        let l = limits(1, 1);
        let mut stream = holding(l, &[e], 1..=16);
        for _ in 0..l.max_held - 1 {
            let s = stream.next_to_send().unwrap();
            let (_, seq) = s.change.key();
            let _ = stream.acked(e, seq, s.id, Instant::now());
        }
        let read = changes(e, 1, 17..=20);
        stream.add_read(&[(e, 4)], read);
        let s = stream.next_to_send().unwrap();
        let _ = stream.acked(e, s.change.key().1, s.id, Instant::now());
        assert_eq!(stream.unmarked(), l.max_held);
        assert!(
            stream.next_to_send().is_none(),
            "marks fail: nothing more is sent"
        );
        let marks = stream.take_marks();
        stream.mark_failed(marks, Instant::now());
        assert!(!stream.may_send());
        let marks = stream.take_marks();
        assert_eq!(marks.len(), 16);
        assert!(stream.next_to_send().is_some());
    }

    #[test]
    fn reads_and_handed_changes_are_held_once_within_the_read_ahead() {
        let e = endpoint(1);
        let l = limits(256, 4);
        let mut stream = Stream::new(l);
        assert_eq!(stream.room(e), l.read_ahead);
        assert_eq!(stream.add_read(&[(e, 8)], changes(e, 1, 1..=8)), 8);
        assert!(stream.capped.contains(&e), "the read filled its room");
        assert_eq!(stream.held_through(e), 8);
        // Read again before its mark, or handed after it was read: held once.
        assert_eq!(stream.add_read(&[(e, 8)], changes(e, 1, 5..=9)), 1);
        assert_eq!(stream.add_handed(changes(e, 1, 9..=10)), 1);
        // A handed change that does not follow on is read from the outbox instead.
        assert_eq!(stream.add_handed(changes(e, 1, 12..=12)), 0);
        assert!(stream.wanted.contains(&e));
        assert_eq!(stream.held(), 10);
        assert_eq!(stream.room(e), l.read_ahead - 10);
        // As the window's changes are confirmed the endpoint is read again once half its
        // read-ahead is free, not only when its queue is empty.
        stream.wanted.clear();
        stream.capped.insert(e);
        let mut confirmed = 0;
        while !stream.wanted.contains(&e) {
            let s = stream.next_to_send().unwrap();
            let _ = stream.acked(e, s.change.key().1, s.id, Instant::now());
            confirmed += 1;
        }
        assert_eq!(stream.room(e), l.read_ahead / 2);
        assert!(stream.held() > 0 && confirmed < 10);
    }

    #[test]
    fn a_new_epoch_drops_what_is_held_of_the_old_one() {
        let e = endpoint(1);
        let mut stream = holding(limits(256, 4), &[e], 1..=6);
        let sent = send_all(&mut stream);
        let now = Instant::now();
        let _ = stream.acked(e, 1, sent[0].2, now);
        assert_eq!(stream.unmarked(), 1);
        // The outbox now holds the new epoch, numbered from 1 again.
        assert_eq!(stream.add_read(&[(e, 16)], changes(e, 2, 1..=2)), 2);
        assert_eq!(stream.held(), 2);
        assert_eq!(
            stream.unmarked(),
            0,
            "the old epoch's change_seqs mean other changes now"
        );
        assert_eq!(stream.held_through(e), 2);
        // The old epoch's publishes are still out: stale, ignored when they answer.
        assert_eq!(stream.in_flight(), 3);
        assert!(matches!(stream.acked(e, 2, sent[1].2, now), Acked::Ignored));
        assert_eq!(stream.refused(e, 3, sent[2].2), None);
        let again = send_all(&mut stream);
        assert_eq!(seqs_of(&again), [1, 2]);
        assert!(again.iter().all(|s| !s.3));
        assert!(matches!(stream.acked(e, 4, sent[3].2, now), Acked::Ignored));
        // A late change of the old epoch is not taken.
        assert_eq!(stream.add_read(&[(e, 16)], changes(e, 1, 7..=7)), 0);
        assert_eq!(stream.add_handed(changes(e, 1, 7..=7)), 0);
        assert_eq!(
            in_turn(stream.acked(e, 2, again[1].2, now)),
            Vec::<i64>::new()
        );
        assert_eq!(in_turn(stream.acked(e, 1, again[0].2, now)), [1, 2]);
        assert_eq!(stream.take_marks(), [(e, 1), (e, 2)]);
        assert_eq!(stream.in_flight(), 0);
    }

    /// SplitMix64: a seeded source of numbers, enough for the model below.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Verdict {
        Ack,
        Nack,
        Return,
    }

    /// One seeded run against a model of one channel: publishes reach the broker in the order
    /// they were made; the broker acks (the message enters the queue), nacks or returns each; the
    /// confirms come back in any order; now and then the channel is lost with what the broker
    /// had not taken yet, and the confirms still to come. Changes arrive in reads as the room
    /// allows. Checked all along: the books match what is out, every bound holds, marks are
    /// each endpoint's changes once and in order, and only changes the broker holds are marked.
    /// At the end every change was marked and, in the queue, the last copy of each change_seq
    /// comes after the last copy of every earlier one.
    fn model_run(seed: u64) {
        let mut rng = Rng(seed);
        let endpoints: Vec<Uuid> = (0..1 + rng.below(3) as u128).map(endpoint).collect();
        let total: i64 = 20 + rng.below(80) as i64;
        let l = limits(1 + rng.below(12), 1 + rng.below(10));
        let mut stream = Stream::new(l);
        // Publishes the broker has not taken yet, in channel order; outcomes not yet told.
        let mut channel: VecDeque<(Uuid, i64, SendId)> = VecDeque::new();
        let mut told: Vec<(Uuid, i64, SendId, Verdict)> = Vec::new();
        let mut queue: Vec<(Uuid, i64)> = Vec::new();
        let mut marked: HashMap<Uuid, i64> = HashMap::new();
        let mut written: HashMap<Uuid, i64> = HashMap::new();
        let mut steps = 0;
        loop {
            steps += 1;
            assert!(
                steps < 200_000,
                "seed {seed}: no progress ({l:?}): marked {marked:?} of {total}, written \
                 {written:?}, channel {channel:?}, told {told:?}, {stream:#?}"
            );
            // The books against the model.
            assert_eq!(
                stream.in_flight(),
                channel.len()
                    + told.len()
                    + stream
                        .lanes
                        .values()
                        .flat_map(|l| &l.sent)
                        .filter(|s| s.acked)
                        .count(),
                "seed {seed}: publishes out"
            );
            assert!(stream.in_flight() <= l.max_in_flight, "seed {seed}");
            assert!(stream.held() <= l.max_held, "seed {seed}");
            for lane in stream.lanes.values() {
                assert!(lane.sent.len() <= l.window, "seed {seed}: window");
                assert!(
                    lane.sent
                        .iter()
                        .zip(lane.sent.iter().skip(1))
                        .all(|(a, b)| { a.change.key().1 < b.change.key().1 && a.id < b.id }),
                    "seed {seed}: a window out of change_seq or publish order"
                );
                assert!(lane.len() <= l.read_ahead, "seed {seed}: read-ahead");
            }
            for (e, seq) in stream.take_marks() {
                let last = marked.entry(e).or_insert(0);
                assert_eq!(seq, *last + 1, "seed {seed}: {e} marked out of turn");
                assert!(
                    queue.contains(&(e, seq)),
                    "seed {seed}: {e}:{seq} marked, not in the queue"
                );
                *last = seq;
            }
            let done = endpoints.iter().all(|e| marked.get(e) == Some(&total));
            if done {
                assert!(stream.is_empty(), "seed {seed}");
                break;
            }
            match rng.below(100) {
                // The outbox is read (new changes written up to `total`).
                0..=9 => {
                    let mut asked = Vec::new();
                    let mut read = Vec::new();
                    let mut budget = l.max_held - stream.held();
                    // Each read starts from another endpoint, as reads of wanted endpoints do.
                    let first = rng.below(endpoints.len());
                    for i in 0..endpoints.len() {
                        let e = endpoints[(first + i) % endpoints.len()];
                        let room = stream.room(e).min(budget);
                        if room == 0 {
                            continue;
                        }
                        budget -= room;
                        let written = written.entry(e).or_insert(0);
                        *written = (*written + rng.below(30) as i64).min(total);
                        let from = stream
                            .held_through(e)
                            .max(marked.get(&e).copied().unwrap_or(0));
                        let through = (*written).min(from + room as i64);
                        read.extend((from + 1..=through).map(|s| change(e, 1, s)));
                        asked.push((e, room));
                    }
                    stream.add_read(&asked, read);
                }
                10..=39 => {
                    for _ in 0..rng.below(8) {
                        let Some(send) = stream.next_to_send() else {
                            break;
                        };
                        let (e, seq) = send.change.key();
                        channel.push_back((e, seq, send.id));
                    }
                }
                40..=69 => {
                    if let Some((e, seq, id)) = channel.pop_front() {
                        let verdict = match rng.below(10) {
                            0 => Verdict::Nack,
                            1 => Verdict::Return,
                            _ => Verdict::Ack,
                        };
                        if verdict == Verdict::Ack {
                            queue.push((e, seq));
                        }
                        told.push((e, seq, id, verdict));
                    }
                }
                70..=97 => {
                    if !told.is_empty() {
                        let (e, seq, id, verdict) = told.swap_remove(rng.below(told.len()));
                        match verdict {
                            Verdict::Ack => {
                                let _ = stream.acked(e, seq, id, Instant::now());
                            }
                            Verdict::Nack | Verdict::Return => {
                                let _ = stream.refused(e, seq, id);
                            }
                        }
                    }
                }
                _ => {
                    // The channel is lost: the broker took some of what was on the way.
                    let taken = rng.below(channel.len() + 1);
                    for (e, seq, _) in channel.drain(..).take(taken) {
                        queue.push((e, seq));
                    }
                    told.clear();
                    stream.link_lost();
                }
            }
        }
        for &e in &endpoints {
            let mut last_copy: HashMap<i64, usize> = HashMap::new();
            for (at, _) in queue.iter().enumerate().filter(|(_, (q, _))| *q == e) {
                last_copy.insert(queue[at].1, at);
            }
            for seq in 2..=total {
                assert!(
                    last_copy[&seq] > last_copy[&(seq - 1)],
                    "seed {seed}: the last copy of {e}:{seq} came before the last of {}",
                    seq - 1
                );
            }
        }
    }

    #[test]
    fn every_interleaving_of_confirms_nacks_returns_and_lost_links_keeps_order() {
        let seeds: Vec<u64> = match std::env::var("RELAY_TEST_SEED") {
            Ok(seed) => vec![seed.parse().expect("RELAY_TEST_SEED is a number")],
            Err(_) => (0..500).collect(),
        };
        for seed in seeds {
            model_run(seed);
        }
    }
}
