//! The v1 message parser on arbitrary bytes: a signed body is attacker-shaped once a secret
//! leaks, and the front tier parses every verified body. It must never panic, and what it
//! accepts must be what it accepts again (the sequencer parses the stored body a second time).
#![no_main]

use libfuzzer_sys::fuzz_target;
use relay_wire::Message;

fuzz_target!(|body: &[u8]| {
    let first = Message::parse(body);
    let second = Message::parse(body);
    assert_eq!(first, second, "parsing the same bytes twice disagreed");
    if let Ok(message) = first {
        assert_eq!(message.v, 1);
        // Nothing the relay keeps as text may hold a NUL: Postgres refuses it in text columns,
        // and a refused statement fails every message sharing it.
        let texts = [
            message.access_version.as_deref(),
            message.since.as_deref(),
            message.through.as_deref(),
            message.track.as_ref().map(|t| t.as_str()),
        ];
        for text in texts.into_iter().flatten() {
            assert!(!text.contains('\0'), "a NUL in a message field: {text:?}");
        }
        for event in &message.events {
            assert!(
                !event.id.contains('\0'),
                "a NUL in an event id: {:?}",
                event.id
            );
        }
    }
});
