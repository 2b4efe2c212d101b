//! File times: signed nanoseconds since the Unix epoch (`i64`, negative before 1970; the range is
//! 1677-09-21 to 2262-04-11).
//!
//! **Encoding.** A file time is serialized as the two's-complement bit pattern of the `i64` in a
//! `u64` ([`nanos`], [`opt_nanos`]), not as an `i64`: postcard writes a `u64` as a plain varint
//! and an `i64` as a zigzag varint, and Raft logs and snapshots hold file times written as `u64`.
//! So a time at or after 1970 encodes to the same bytes as the equal `u64`, and log entries,
//! snapshots and messages with unsigned times decode to the same values. A time before 1970
//! takes the 10-byte varint of its bit pattern. Changing this encoding changes what every stored
//! log entry and snapshot means.
//!
//! Delegation and session times are the leader's clock as `u64` and stay so; [`file_time`] turns
//! such a clock reading into a file time.

/// The file time of a clock reading in ns since the epoch (`u64`, as commands are stamped with):
/// the same number, saturated at the end of the `i64` range (year 2262).
pub fn file_time(clock_ns: u64) -> i64 {
    i64::try_from(clock_ns).unwrap_or(i64::MAX)
}

/// `#[serde(with = "nacre_api::meta::time::nanos")]` for an `i64` file time: encoded as the `u64`
/// of the same bits (see the module doc).
pub mod nanos {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(t: &i64, s: S) -> Result<S::Ok, S::Error> {
        // Two's complement: 0..=i64::MAX map to themselves, negatives to the upper half.
        (*t as u64).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
        u64::deserialize(d).map(|bits| bits as i64)
    }
}

/// `#[serde(with = "nacre_api::meta::time::opt_nanos")]` for an `Option<i64>` file time: encoded
/// as an `Option<u64>` of the same bits.
pub mod opt_nanos {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(t: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
        t.map(|t| t as u64).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        Option::<u64>::deserialize(d).map(|t| t.map(|bits| bits as i64))
    }
}

#[cfg(test)]
mod tests;
