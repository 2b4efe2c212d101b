//! Reed-Solomon erasure coding of a byte range into a stripe of `k` data and `m` parity shards.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::{FuncError, checksum};

#[cfg(feature = "codecs")]
mod code;
#[cfg(feature = "codecs")]
pub use code::{
    ec_encode, ec_encode_bytes, ec_rebuild, ec_reconstruct, ec_reconstruct_shards,
    ec_reconstruct_verified,
};

/// Most shards (`k + m`) a stripe may have: the order of GF(2^8), the field the code works in.
pub const MAX_SHARDS: usize = 256;

/// An erasure code: `k` data shards and `m` parity shards; any `k` of the `k + m` rebuild the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EcSpec {
    pub k: u8,
    pub m: u8,
}

impl EcSpec {
    /// A validated spec: `k >= 1`, `m >= 1`, `k + m <= MAX_SHARDS`.
    pub fn new(k: u8, m: u8) -> Result<Self, FuncError> {
        let spec = EcSpec { k, m };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks the constraints of [`EcSpec::new`]; every function checks its spec with this.
    pub fn validate(self) -> Result<(), FuncError> {
        if self.k == 0 || self.m == 0 || self.total() > MAX_SHARDS {
            return Err(FuncError::BadEcSpec {
                k: self.k,
                m: self.m,
                max: MAX_SHARDS,
            });
        }
        Ok(())
    }

    /// `k + m`.
    pub fn total(self) -> usize {
        usize::from(self.k) + usize::from(self.m)
    }

    /// Length of every shard of a stripe that holds `len` bytes: `ceil(len / k)`.
    pub fn shard_len(self, len: u64) -> u64 {
        len.div_ceil(u64::from(self.k.max(1)))
    }
}

/// One shard and the CRC-32C of its bytes, computed when the shard was made. The CRC travels and
/// is stored with the shard, so a reader tells a corrupt shard from a good one and can treat it
/// as missing ([`ec_reconstruct_verified`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub data: Bytes,
    pub crc: u32,
}

impl Shard {
    /// A shard with its CRC computed now.
    pub fn new(data: Bytes) -> Self {
        let crc = checksum(&data);
        Shard { data, crc }
    }

    /// Whether the bytes still match the CRC.
    pub fn is_intact(&self) -> bool {
        checksum(&self.data) == self.crc
    }
}

/// An encoded stripe.
///
/// Invariants: `shards.len() == spec.k + spec.m`; shard `i < k` holds bytes `i*L .. (i+1)*L` of
/// the original (`L = spec.shard_len(len)`), the last data shards zero-padded past `len`; shards
/// `k..k+m` are parity; every shard is exactly `L` bytes (0 for an empty stripe). `len` is kept
/// because padding cannot be told from data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stripe {
    pub spec: EcSpec,
    /// Length of the original bytes.
    pub len: u64,
    pub shards: Vec<Shard>,
}

impl Stripe {
    /// The shards as the `Option` slots the reconstruct functions take, all present.
    pub fn into_slots(self) -> Vec<Option<Shard>> {
        self.shards.into_iter().map(Some).collect()
    }
}

/// What [`ec_rebuild`] returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebuilt {
    /// All `k + m` shards, intact ones as given and rebuilt ones with fresh CRCs.
    pub shards: Vec<Shard>,
    /// Indices of the shards that were missing or corrupt and are now rebuilt, ascending.
    pub rebuilt: Vec<usize>,
}
