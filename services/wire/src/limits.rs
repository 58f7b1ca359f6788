//! The wire file's limits, in the units it gives them.

/// Bodies up to this many bytes must be accepted; a receiver may refuse anything larger (413).
pub const MAX_BODY_BYTES: usize = 1_048_576;
/// A message of several items' events is at most this large; one item larger is sent alone.
pub const MESSAGE_BYTES: usize = 262_144;
/// A message holds at most this many events.
pub const MAX_EVENTS: usize = 200;
/// The upstream waits this long for an answer before counting the attempt failed.
pub const SEND_TIMEOUT_S: u64 = 15;
/// Only this many bytes of an answer's body are read by the upstream.
pub const ANSWER_BYTES_READ: usize = 65_536;
/// A Retry-After longer than this is cut to it.
pub const RETRY_AFTER_MAX_S: u64 = 3_600;
/// The longest backoff between attempts.
pub const BACKOFF_MAX_S: u64 = 3_600;
/// After this long failing, the key's notice address is mailed.
pub const NOTICE_AFTER_S: u64 = 86_400;
/// After this long failing, the endpoint is paused.
pub const PAUSE_AFTER_S: u64 = 432_000;
/// After this long failing, the backlog is replaced by a reset (reason `behind`).
pub const RESET_AFTER_FAILING_S: u64 = 86_400;
/// A signature's timestamp may differ from the receiver's clock by this much, either way.
pub const TIMESTAMP_TOLERANCE_S: i64 = 300;
/// How long the old secret keeps signing after a rotation, by default.
pub const ROTATION_OVERLAP_S: u64 = 86_400;
/// The longest rotation overlap the upstream allows.
pub const ROTATION_OVERLAP_MAX_S: u64 = 604_800;
