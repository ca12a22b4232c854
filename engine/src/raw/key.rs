//! The key room: how the storage names a block's key. Every key has a 64-bit [`digest`] (an
//! 8-byte key's big-endian value, else its XXH3-64), which slots hold and walks compare; a key
//! of another length also has a [`long_part`], its bytes, which a run keeps and compares too
//! (`block_run.rs`, "Keys of other lengths"). This file holds the key in each form the storage
//! and the index pass around: a chain's keys as a write or a walk takes them ([`Keys`],
//! [`EightByteKeys`], the [`Request`] a walk follows), a key's bytes as a run names it
//! ([`KeyBytes`], borrowed under a guard) and owned ([`KeyBytesOwned`], which outlives the guard:
//! captured LFU hits, eviction candidates).
//!
//! It imports nothing: the runs, the store and the index name keys through it.

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

/// A key as runs name it: its digest and its long part (its bytes if it is not 8 bytes long;
/// `raw::block_run`, "Keys of other lengths").
#[inline]
pub fn key_parts(key: &[u8]) -> (u64, Option<&[u8]>) {
    (digest(key), long_part(key))
}

/// The 64-bit digest of a key: an 8-byte key's big-endian value, else XXH3-64.
#[inline]
pub fn digest(b: &[u8]) -> u64 {
    match <[u8; 8]>::try_from(b) {
        Ok(a) => u64::from_be_bytes(a),
        Err(_) => xxhash_rust::xxh3::xxh3_64(b),
    }
}

/// The part of a key a run compares besides its digest: the bytes of a key of another length
/// than 8 (an 8-byte key is its digest's big-endian bytes, so it has none).
#[inline]
pub fn long_part(key: &[u8]) -> Option<&[u8]> {
    (key.len() != 8).then_some(key)
}

/// A chain's keys as the store takes them: their digests (what slots hold and walks compare)
/// and, when some may be of another length than 8 bytes, the keys themselves (`bytes[i]` is the
/// key whose digest is `digests[i]`: an 8-byte key's big-endian value, else its XXH3-64; see
/// `block_run.rs`, "Keys of other lengths"). Without bytes every key is 8 bytes long.
pub struct Keys<'a, K = [u8; 8]> {
    pub(crate) digests: &'a [u64],
    pub(crate) bytes: Option<&'a [K]>,
}

impl<K> Clone for Keys<'_, K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Keys<'_, K> {}

impl<'a, K> Keys<'a, K> {
    /// 8-byte keys, given as their values (their own digests).
    pub fn eight(digests: &'a [u64]) -> Self {
        Keys {
            digests,
            bytes: None,
        }
    }
}

impl<'a> From<&'a [u64]> for Keys<'a> {
    fn from(digests: &'a [u64]) -> Self {
        Keys::eight(digests)
    }
}

impl<'a, const N: usize> From<&'a [u64; N]> for Keys<'a> {
    fn from(digests: &'a [u64; N]) -> Self {
        Keys::from(&digests[..])
    }
}

impl<'a> From<&'a Vec<u64>> for Keys<'a> {
    fn from(digests: &'a Vec<u64>) -> Self {
        Keys::from(&digests[..])
    }
}

impl<'a, K: AsRef<[u8]>> Keys<'a, K> {
    /// Keys of any length with their digests; `None` when the two differ in length.
    pub fn with_bytes(digests: &'a [u64], bytes: &'a [K]) -> Option<Self> {
        (digests.len() == bytes.len()).then_some(Keys {
            digests,
            bytes: Some(bytes),
        })
    }

    /// Keys in the chain.
    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// No key.
    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    /// Key `i`'s digest.
    #[inline]
    pub(crate) fn digest(&self, i: usize) -> u64 {
        self.digests[i]
    }

    /// Key `i`'s long part ([`long_part`]): its bytes if it is not 8 bytes long.
    #[inline]
    pub(crate) fn long(&self, i: usize) -> Option<&'a [u8]> {
        self.bytes.and_then(|b| long_part(b[i].as_ref()))
    }

    /// Keys `range` of these.
    pub(crate) fn range(&self, range: std::ops::Range<usize>) -> Self {
        Keys {
            digests: &self.digests[range.clone()],
            bytes: self.bytes.map(|b| &b[range]),
        }
    }
}

/// The keys a walk follows (`RunStore::walk_from`): their digests and, for keys of other
/// lengths than 8 bytes, their bytes.
pub trait Request {
    /// Number of keys.
    fn len(&self) -> usize;
    /// Key `i`'s digest.
    fn digest(&self, i: usize) -> u64;
    /// Key `i`'s long part ([`long_part`]): its bytes if it is not 8 bytes long.
    fn long(&self, i: usize) -> Option<&[u8]>;
    /// Whether some key may be of another length than 8 bytes (its bytes must be compared).
    fn any_long(&self) -> bool;
    /// How many of `run_keys` equal the digests of keys `from..`, in order, before the first
    /// that differs (the caller keeps `from + run_keys.len() ≤ len`).
    #[inline]
    fn leading_digests(&self, from: usize, run_keys: &[u64]) -> usize {
        count_leading(run_keys, |j| self.digest(from + j))
    }
}

/// How many of `run_keys` equal `digest(0..)`, in order, before the first that differs. Four
/// at a time with one branch per four: a walk usually compares a stretch to its end.
#[inline(always)]
fn count_leading(run_keys: &[u64], digest: impl Fn(usize) -> u64) -> usize {
    let mut m = 0;
    while let Some(four) = run_keys.get(m..m + 4) {
        let differ = (digest(m) ^ four[0])
            | (digest(m + 1) ^ four[1])
            | (digest(m + 2) ^ four[2])
            | (digest(m + 3) ^ four[3]);
        if differ != 0 {
            break;
        }
        m += 4;
    }
    while m < run_keys.len() && digest(m) == run_keys[m] {
        m += 1;
    }
    m
}

impl<K: AsRef<[u8]>> Request for Keys<'_, K> {
    #[inline]
    fn len(&self) -> usize {
        self.digests.len()
    }
    #[inline]
    fn digest(&self, i: usize) -> u64 {
        self.digests[i]
    }
    #[inline]
    fn long(&self, i: usize) -> Option<&[u8]> {
        Keys::long(self, i)
    }
    #[inline]
    fn any_long(&self) -> bool {
        self.bytes.is_some()
    }
}

/// 8-byte keys read in place: a key's digest is its big-endian value, so a walk computes the
/// digests it compares as it goes, and a request that stops early never computes the rest.
/// Every key must be 8 bytes long ([`EightByteKeys::new`] checks).
#[derive(Clone, Copy)]
pub struct EightByteKeys<'a, K>(&'a [K]);

impl<'a, K: AsRef<[u8]>> EightByteKeys<'a, K> {
    /// `keys` read in place, if every one is 8 bytes long.
    #[inline]
    pub fn new(keys: &'a [K]) -> Option<Self> {
        keys.iter()
            .all(|k| k.as_ref().len() == 8)
            .then_some(EightByteKeys(keys))
    }
}

impl<K: AsRef<[u8]>> Request for EightByteKeys<'_, K> {
    #[inline]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn digest(&self, i: usize) -> u64 {
        digest(self.0[i].as_ref())
    }
    #[inline]
    fn long(&self, _: usize) -> Option<&[u8]> {
        None
    }
    #[inline]
    fn any_long(&self) -> bool {
        false
    }
    #[inline]
    fn leading_digests(&self, from: usize, run_keys: &[u64]) -> usize {
        leading_in(self.0, from, run_keys, |k| digest(k.as_ref()))
    }
}

/// [`Request::leading_digests`] over a request held as a slice: one subslice as long as
/// `run_keys`, so no bounds check per key.
#[inline(always)]
fn leading_in<T>(keys: &[T], from: usize, run_keys: &[u64], digest: impl Fn(&T) -> u64) -> usize {
    match keys.get(from..from + run_keys.len()) {
        Some(request) => count_leading(run_keys, |j| digest(&request[j])),
        None => 0,
    }
}

/// 8-byte keys given as their digests, their big-endian values: nothing to compute per key.
#[derive(Clone, Copy)]
pub struct Digests<'a>(&'a [u64]);

impl<'a> Digests<'a> {
    /// The 8-byte keys whose big-endian values are `digests`.
    #[inline]
    pub fn new(digests: &'a [u64]) -> Self {
        Digests(digests)
    }

    /// The first `n` keys (`n ≤ len`).
    #[inline]
    pub fn prefix(self, n: usize) -> Self {
        Digests(&self.0[..n])
    }
}

impl Request for Digests<'_> {
    #[inline]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline]
    fn digest(&self, i: usize) -> u64 {
        self.0[i]
    }
    #[inline]
    fn long(&self, _: usize) -> Option<&[u8]> {
        None
    }
    #[inline]
    fn any_long(&self) -> bool {
        false
    }
    #[inline]
    fn leading_digests(&self, from: usize, run_keys: &[u64]) -> usize {
        leading_in(self.0, from, run_keys, |&digest| digest)
    }
}

/// Calls `f` with the one key of digest `digest` and long part `long` as [`Keys`].
pub(crate) fn one_key<R>(
    digest: u64,
    long: Option<&[u8]>,
    f: impl FnOnce(Keys<'_, &[u8]>) -> R,
) -> R {
    let digests = [digest];
    let bytes = long.map(|l| [l]);
    f(Keys {
        digests: &digests,
        bytes: bytes.as_ref().map(|b| &b[..]),
    })
}

/// A key's bytes as a run names it: an 8-byte key rebuilt from its digest, or the bytes of a
/// key of another length (a key copied out of a run to build another, a key a removal reports).
pub enum KeyBytes<'g> {
    Eight([u8; 8]),
    Long(&'g [u8]),
}

impl<'g> KeyBytes<'g> {
    /// The key with `digest` and long part `long` ([`long_part`]).
    #[inline]
    pub fn new(digest: u64, long: Option<&'g [u8]>) -> Self {
        match long {
            Some(bytes) => KeyBytes::Long(bytes),
            None => KeyBytes::Eight(digest.to_be_bytes()),
        }
    }
}

impl AsRef<[u8]> for KeyBytes<'_> {
    fn as_ref(&self) -> &[u8] {
        match self {
            KeyBytes::Eight(bytes) => bytes,
            KeyBytes::Long(bytes) => bytes,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_eight_byte_key_is_its_own_digest() {
        assert_eq!(digest(&7u64.to_be_bytes()), 7);
        assert_eq!(digest(b"abc"), xxhash_rust::xxh3::xxh3_64(b"abc"));
    }
}
