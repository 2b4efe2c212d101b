//! Fuzzes postcard body decoding of the messages every nacre process understands.
//!
//! Decoding arbitrary bytes must never panic. A body that decodes must also survive a round trip
//! (re-encoding it and decoding that gives the same value), and rendering it must not panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nacre_proto::msg::RemoteError;
use nacre_proto::msg::sys::{EchoRequest, PingRequest, PingResponse};
use nacre_proto::{decode_body, encode_body};

/// Decodes `$input` as `$ty`; on success checks the round trip and yields the value.
/// (A macro rather than a generic fn so that this crate needs no direct serde dependency.)
macro_rules! round_trip {
    ($ty:ty, $what:literal, $input:expr) => {
        match decode_body::<$ty>($what, $input) {
            Err(_) => None,
            Ok(value) => {
                let again = encode_body(&value);
                match decode_body::<$ty>($what, &again) {
                    Ok(back) => assert_eq!(
                        back, value,
                        concat!($what, " does not survive a round trip")
                    ),
                    Err(e) => panic!("re-encoded {} does not decode: {e}; value {value:?}", $what),
                }
                let _ = format!("{value:?}");
                Some(value)
            }
        }
    };
}

fuzz_target!(|input: &[u8]| {
    if let Some(e) = round_trip!(RemoteError, "error", input) {
        let _ = e.to_string();
        let _ = e.code();
    }
    let _ = round_trip!(PingResponse, "ping response", input);
    let _ = round_trip!(PingRequest, "ping request", input);
    let _ = round_trip!(EchoRequest, "echo request", input);
});
