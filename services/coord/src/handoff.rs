//! Hand-over in memory between two tiers running in one process.
//!
//! Postgres is the log the tiers meet in: what one commits, the next reads back. When both run
//! in the same process (`relay all`), the one that committed something already holds it, and
//! reading it back costs a statement, its round trip and the bytes twice over. A [`Handoff`]
//! lets the committing tier give its copy to the next tier's task that owns the key (a
//! publisher's tenant, a sequencer's endpoint), which takes what follows on from what it holds
//! and reads Postgres for anything else. Nothing depends on it: an offer that finds no inbox, or
//! a full one, is refused, and the caller announces the work as it would without it; an inbox
//! whose owner stops is dropped with what it holds, which Postgres still has.
//!
//! Inboxes are bounded in bytes, each and all together, so a task that falls behind (or a
//! tenant that makes many large changes) cannot make the process hold without limit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use uuid::Uuid;

/// The hand-over point of one kind of item `T`, keyed by what a task owns (cheap to clone).
pub struct Handoff<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Handoff<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> std::fmt::Debug for Handoff<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoff")
            .field(
                "bytes_waiting",
                &self.inner.bytes_waiting.load(Ordering::Relaxed),
            )
            .finish_non_exhaustive()
    }
}

struct Inner<T> {
    inboxes: Mutex<HashMap<Uuid, Arc<InboxState<T>>>>,
    /// Bytes offered and not yet taken, over every inbox.
    bytes_waiting: Arc<AtomicUsize>,
    max_bytes_per_inbox: usize,
    max_bytes: usize,
}

struct InboxState<T> {
    held: Mutex<Held<T>>,
    notify: Notify,
}

struct Held<T> {
    items: Vec<T>,
    bytes: usize,
    /// Its owner dropped it: an offer that found it just before must not add to it.
    closed: bool,
}

impl<T> Handoff<T> {
    /// A hand-over point whose inboxes hold at most `max_bytes_per_inbox` each and
    /// `max_bytes` together (as the offers weigh their items).
    pub fn new(max_bytes_per_inbox: usize, max_bytes: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                inboxes: Mutex::new(HashMap::new()),
                bytes_waiting: Arc::new(AtomicUsize::new(0)),
                max_bytes_per_inbox,
                max_bytes,
            }),
        }
    }

    /// The task that now owns `key` takes what is handed for it here, until the returned
    /// inbox is dropped. A later open of the same key replaces it.
    pub fn open(&self, key: Uuid) -> Inbox<T> {
        let state = Arc::new(InboxState {
            held: Mutex::new(Held {
                items: Vec::new(),
                bytes: 0,
                closed: false,
            }),
            notify: Notify::new(),
        });
        self.inner
            .inboxes
            .lock()
            .expect("not poisoned")
            .insert(key, state.clone());
        Inbox {
            key,
            state,
            handoff: self.clone(),
        }
    }

    /// Hands `items`, weighing `bytes`, to the inbox of `key`, in order after what it holds.
    /// `false` when there is no inbox for `key` or it, or all inboxes together, would hold
    /// more than their bound: nothing is handed, and the caller goes the way of Postgres.
    pub fn offer(&self, key: Uuid, items: Vec<T>, bytes: usize) -> bool {
        let Some(state) = self
            .inner
            .inboxes
            .lock()
            .expect("not poisoned")
            .get(&key)
            .cloned()
        else {
            return false;
        };
        let mut held = state.held.lock().expect("not poisoned");
        if held.closed || held.bytes + bytes > self.inner.max_bytes_per_inbox {
            return false;
        }
        let waiting = &self.inner.bytes_waiting;
        let mut total = waiting.load(Ordering::Relaxed);
        loop {
            if total + bytes > self.inner.max_bytes {
                return false;
            }
            match waiting.compare_exchange_weak(
                total,
                total + bytes,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => total = now,
            }
        }
        held.items.extend(items);
        held.bytes += bytes;
        drop(held);
        state.notify.notify_one();
        true
    }

    /// Closes the inbox of `key` if `state` is still it; answers how many items it held, which
    /// are dropped (Postgres has them).
    fn close(&self, key: Uuid, state: &Arc<InboxState<T>>) -> usize {
        let mut inboxes = self.inner.inboxes.lock().expect("not poisoned");
        if inboxes
            .get(&key)
            .is_some_and(|open| Arc::ptr_eq(open, state))
        {
            inboxes.remove(&key);
        }
        drop(inboxes);
        let mut held = state.held.lock().expect("not poisoned");
        self.inner
            .bytes_waiting
            .fetch_sub(held.bytes, Ordering::AcqRel);
        let dropped = std::mem::take(&mut held.items).len();
        held.bytes = 0;
        held.closed = true;
        dropped
    }
}

/// What is handed to one key's owner, while it owns it.
pub struct Inbox<T> {
    key: Uuid,
    state: Arc<InboxState<T>>,
    handoff: Handoff<T>,
}

impl<T> Inbox<T> {
    /// Everything handed since the last take, in the order it was offered.
    pub fn take(&self) -> Vec<T> {
        let mut held = self.state.held.lock().expect("not poisoned");
        let items = std::mem::take(&mut held.items);
        let bytes = std::mem::take(&mut held.bytes);
        self.handoff
            .inner
            .bytes_waiting
            .fetch_sub(bytes, Ordering::AcqRel);
        items
    }

    /// Resolves when something was handed since the last take (at once if it was before this
    /// call).
    pub async fn handed(&self) {
        self.state.notify.notified().await;
    }

    /// Stops taking offers (they are refused from now on, so their senders announce them the
    /// other way) and answers whether anything handed was left untaken: its owner, letting go,
    /// must then make sure the work is found again, as it would be had it been announced.
    pub fn close(self) -> bool {
        self.handoff.close(self.key, &self.state) > 0
    }
}

impl<T> Drop for Inbox<T> {
    fn drop(&mut self) {
        self.handoff.close(self.key, &self.state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_reach_the_open_inbox_in_order_and_nothing_else() {
        let handoff = Handoff::<u32>::new(100, 1_000);
        let key = Uuid::new_v4();
        assert!(!handoff.offer(key, vec![1], 1), "no inbox yet");
        let inbox = handoff.open(key);
        assert!(handoff.offer(key, vec![1, 2], 2));
        assert!(handoff.offer(key, vec![3], 1));
        assert!(!handoff.offer(Uuid::new_v4(), vec![9], 1), "another key's");
        assert_eq!(inbox.take(), vec![1, 2, 3]);
        assert_eq!(inbox.take(), Vec::<u32>::new());
        drop(inbox);
        assert!(!handoff.offer(key, vec![4], 1), "closed with its owner");
    }

    #[test]
    fn an_inbox_and_all_inboxes_hold_no_more_than_their_bounds() {
        let handoff = Handoff::<u32>::new(10, 15);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (inbox_a, inbox_b) = (handoff.open(a), handoff.open(b));
        assert!(handoff.offer(a, vec![1], 10));
        assert!(!handoff.offer(a, vec![2], 1), "a is full");
        assert!(handoff.offer(b, vec![3], 5));
        assert!(!handoff.offer(b, vec![4], 1), "all together are full");
        assert_eq!(inbox_a.take(), vec![1]);
        assert!(handoff.offer(b, vec![4], 1), "taking made room");
        drop(inbox_b);
        assert!(
            handoff.offer(a, vec![5], 10),
            "a closed inbox gives its bytes back"
        );
        assert_eq!(inbox_a.take(), vec![5]);
    }

    #[test]
    fn a_replaced_inbox_closing_leaves_its_successor_open() {
        let handoff = Handoff::<u32>::new(10, 10);
        let key = Uuid::new_v4();
        let first = handoff.open(key);
        let second = handoff.open(key);
        drop(first);
        assert!(handoff.offer(key, vec![1], 1));
        assert_eq!(second.take(), vec![1]);
    }

    #[test]
    fn closing_refuses_later_offers_and_tells_what_was_left() {
        let handoff = Handoff::<u32>::new(10, 10);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let (inbox_a, inbox_b) = (handoff.open(a), handoff.open(b));
        assert!(handoff.offer(a, vec![1], 4));
        assert!(inbox_a.close(), "1 was left untaken");
        assert!(!handoff.offer(a, vec![2], 1), "closed");
        assert!(handoff.offer(b, vec![3], 10), "a's bytes were given back");
        assert_eq!(inbox_b.take(), vec![3]);
        assert!(!inbox_b.close(), "nothing was left");
    }

    #[tokio::test]
    async fn an_offer_wakes_the_inbox_owner() {
        let handoff = Handoff::<u32>::new(10, 10);
        let key = Uuid::new_v4();
        let inbox = handoff.open(key);
        assert!(handoff.offer(key, vec![7], 1));
        tokio::time::timeout(std::time::Duration::from_secs(5), inbox.handed())
            .await
            .expect("woken by the offer made before it waited");
        assert_eq!(inbox.take(), vec![7]);
    }
}
