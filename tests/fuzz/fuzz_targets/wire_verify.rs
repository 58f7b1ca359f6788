//! The signature verifier on arbitrary headers and bodies: it runs before anything else on
//! every request a stranger can send. It must never panic, must accept exactly what `sign`
//! produced for the same bytes, and must refuse those bytes once any of them changes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use relay_wire::{sign, verify, SignatureHeaders, SigningSecret, VerifyError};

/// Splits a length-prefixed field off the front of `rest` (a missing length reads as none).
fn field<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let Some((&len, tail)) = rest.split_first() else {
        return &[];
    };
    let len = usize::from(len).min(tail.len());
    let (taken, remaining) = tail.split_at(len);
    *rest = remaining;
    taken
}

fuzz_target!(|data: &[u8]| {
    let mut rest = data;
    let key = field(&mut rest);
    let id = String::from_utf8_lossy(field(&mut rest)).into_owned();
    let timestamp = String::from_utf8_lossy(field(&mut rest)).into_owned();
    let signature = String::from_utf8_lossy(field(&mut rest)).into_owned();
    let body = rest;

    let secret = SigningSecret::from_bytes(if key.is_empty() {
        vec![7; 32]
    } else {
        key.to_vec()
    });
    let Ok(secret) = secret else {
        return;
    };
    let secrets = [secret];

    // Whatever arrives: an answer, never a panic.
    let headers = SignatureHeaders {
        webhook_id: Some(&id),
        webhook_timestamp: Some(&timestamp),
        webhook_signature: Some(&signature),
    };
    let now = timestamp.parse::<i64>().unwrap_or(0);
    let _ = verify(headers, body, &secrets, now);

    // What `sign` makes for these bytes verifies, at its own time.
    let signed_at = i64::from(u32::from_le_bytes(
        body.iter()
            .copied()
            .chain([0; 4])
            .take(4)
            .collect::<Vec<_>>()
            .try_into()
            .unwrap(),
    ));
    let signed_at_text = signed_at.to_string();
    let genuine = sign(&id, signed_at, body, &secrets);
    let headers = SignatureHeaders {
        webhook_id: Some(&id),
        webhook_timestamp: Some(&signed_at_text),
        webhook_signature: Some(&genuine),
    };
    assert_eq!(verify(headers, body, &secrets, signed_at), Ok(signed_at));

    // One byte more, or one changed, and the same signature is refused.
    let mut longer = body.to_vec();
    longer.push(b' ');
    assert_eq!(
        verify(headers, &longer, &secrets, signed_at),
        Err(VerifyError::NoMatchingSignature)
    );
    if let Some(first) = body.first() {
        let mut changed = body.to_vec();
        changed[0] = first ^ 1;
        assert_eq!(
            verify(headers, &changed, &secrets, signed_at),
            Err(VerifyError::NoMatchingSignature)
        );
    }
});
