//! The key room: how the storage names a block's key. A key of 8 bytes (the common case) is
//! held inline; a longer key keeps its bytes on the heap. This file holds the owned form, which
//! outlives the guard a borrowed key came from (captured LFU hits, eviction candidates).

/// A key's bytes, owned: 8-byte keys inline, longer keys boxed.
#[derive(Clone)]
pub(crate) enum KeyBytesOwned {
    Short([u8; 8]),
    Long(Box<[u8]>),
}

impl KeyBytesOwned {
    /// The key's bytes.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            KeyBytesOwned::Short(a) => a,
            KeyBytesOwned::Long(b) => b,
        }
    }
}

/// The owned form of the key `k`.
pub(crate) fn own_key(k: &[u8]) -> KeyBytesOwned {
    match <[u8; 8]>::try_from(k) {
        Ok(a) => KeyBytesOwned::Short(a),
        Err(_) => KeyBytesOwned::Long(k.into()),
    }
}
