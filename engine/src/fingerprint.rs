//! Token fingerprint: turns token ids into a chain of per-block prefix hashes.
//!
//! The construction is **frozen** (`fingerprint.md`): it is shared with the reference
//! implementation, SGLang Model Gateway's KV index and the Python gateway client, so any change
//! breaks every consumer. The golden vectors in `engine/testdata/fingerprint_golden.json` and the
//! anchors in this module's tests pin it down.
//!
//! # Construction
//!
//! - Hash function: XXH3-64 with seed [`SEED`] (1337). One-shot and streaming XXH3 give the same
//!   value; this module uses one-shot hashing.
//! - **Content hash** of a block ([`content_hash`]): XXH3-64 over the concatenation of the block's
//!   token ids, each encoded as a little-endian `u32` (4 bytes per token).
//! - **Chaining** ([`next_prefix`]): XXH3-64 over 16 bytes, the previous prefix hash as a
//!   little-endian `u64` followed by the block's content hash as a little-endian `u64`.
//! - **Prefix hashes** of a sequence with block size `bs` and an optional parent prefix hash
//!   ([`prefix_hashes_from`]):
//!   - `prefix[0] = content[0]` without a parent;
//!   - `prefix[0] = next(parent, content[0])` with a parent (a suffix continuing an earlier
//!     sequence whose last prefix hash is `parent`);
//!   - `prefix[i] = next(prefix[i - 1], content[i])` for `i >= 1`.
//! - **Full blocks only**: `n = tokens.len() / bs`; trailing tokens short of a block are dropped.
//!   `bs == 0` or `n == 0` gives an empty result. The spec's "`bs <= 0` → empty" rule is the
//!   caller's business: callers holding a signed block size map `bs <= 0` to an empty result
//!   before calling into this module (or pass `0`).
//! - **Wire form** ([`to_wire`]): each `u64` prefix hash travels as 8 bytes, big-endian.
//! - **Chain for a lookup** ([`chain`]): the wire forms of `prefix[0..n]` and the token counts
//!   `[bs; n]`.
//!
//! Adapter, model, tenant and hash scheme are not part of the hash; they partition the index.
//!
//! # Cost
//!
//! Hashing never allocates: on little-endian targets a block's `&[u32]` is hashed in place as its
//! bytes (which are exactly the little-endian encoding), and chaining hashes a 16-byte stack
//! buffer. [`for_each_prefix`] and [`prefix_iter`] produce the chain without allocating; the
//! `Vec`-returning functions allocate only their result, sized exactly once.

use core::iter::FusedIterator;
use core::slice::ChunksExact;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// XXH3-64 seed of every hash in the fingerprint (frozen).
pub const SEED: u64 = 1337;

/// Number of full blocks of `bs` tokens in a sequence of `len` tokens; `0` when `bs == 0`.
#[inline]
#[must_use]
pub const fn block_count(len: usize, bs: usize) -> usize {
    match len.checked_div(bs) {
        Some(n) => n,
        None => 0,
    }
}

/// Content hash of one block: XXH3-64 (seed [`SEED`]) over the tokens as little-endian `u32`s.
///
/// Any slice length is accepted (the empty slice hashes the empty input); callers normally pass
/// exactly one block of `bs` tokens. Does not allocate.
#[inline]
#[must_use]
pub fn content_hash(block: &[u32]) -> u64 {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the pointer comes from a live `&[u32]`, so it is non-null and valid for reads of
        // `size_of_val(block)` bytes (which fits in `isize`, as for any slice) for the lifetime of
        // `block`, which bounds the new slice. `u8` has alignment 1 and `u32` has no padding or
        // invalid bit patterns, so every byte is an initialised `u8`. Nothing mutates `block`
        // while the shared borrow lives. On a little-endian target these bytes are exactly the
        // tokens' little-endian encoding that the construction requires.
        let bytes = unsafe {
            core::slice::from_raw_parts(block.as_ptr().cast::<u8>(), core::mem::size_of_val(block))
        };
        xxh3_64_with_seed(bytes, SEED)
    }
    #[cfg(not(target_endian = "little"))]
    {
        content_hash_portable(block)
    }
}

/// Endian-independent content hash: streams the tokens' little-endian bytes through a stack
/// buffer into a seeded XXH3 state (streaming and one-shot XXH3 are equal). Used on big-endian
/// targets, and by the tests to check the in-place path.
#[cfg(any(test, not(target_endian = "little")))]
fn content_hash_portable(block: &[u32]) -> u64 {
    const CHUNK_TOKENS: usize = 64;
    let mut state = xxhash_rust::xxh3::Xxh3::with_seed(SEED);
    let mut buf = [0u8; CHUNK_TOKENS * 4];
    for chunk in block.chunks(CHUNK_TOKENS) {
        for (dst, token) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        state.update(&buf[..chunk.len() * 4]);
    }
    state.digest()
}

/// Chaining step: XXH3-64 (seed [`SEED`]) over `le_u64(prev) ‖ le_u64(content)`.
///
/// Also the sequence hash of the W1M benchmark (`benchmarks.md` §2). Does not allocate.
#[inline]
#[must_use]
pub fn next_prefix(prev: u64, content: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&prev.to_le_bytes());
    buf[8..].copy_from_slice(&content.to_le_bytes());
    xxh3_64_with_seed(&buf, SEED)
}

/// Wire form of a hash: 8 bytes, big-endian.
#[inline]
#[must_use]
pub const fn to_wire(hash: u64) -> [u8; 8] {
    hash.to_be_bytes()
}

/// Inverse of [`to_wire`].
#[inline]
#[must_use]
pub const fn from_wire(wire: [u8; 8]) -> u64 {
    u64::from_be_bytes(wire)
}

/// Non-allocating iterator over the prefix hashes of a token sequence; see [`prefix_iter`].
#[derive(Debug, Clone)]
pub struct PrefixHashes<'a> {
    blocks: ChunksExact<'a, u32>,
    prev: Option<u64>,
}

impl Iterator for PrefixHashes<'_> {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        let content = content_hash(self.blocks.next()?);
        let prefix = match self.prev {
            Some(prev) => next_prefix(prev, content),
            None => content,
        };
        self.prev = Some(prefix);
        Some(prefix)
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl ExactSizeIterator for PrefixHashes<'_> {}

impl FusedIterator for PrefixHashes<'_> {}

/// Iterator over the prefix hashes of the full blocks of `tokens` (block size `bs`), continuing
/// from `parent` when given. Yields nothing when `bs == 0` or `tokens.len() < bs`; the partial
/// tail is ignored. Does not allocate.
#[inline]
#[must_use]
pub fn prefix_iter(tokens: &[u32], bs: usize, parent: Option<u64>) -> PrefixHashes<'_> {
    let blocks = if bs == 0 {
        // `chunks_exact(0)` panics; an empty slice in blocks of 1 yields nothing.
        tokens[..0].chunks_exact(1)
    } else {
        tokens.chunks_exact(bs)
    };
    PrefixHashes {
        blocks,
        prev: parent,
    }
}

/// Calls `f` with each prefix hash in order (block 0 first), continuing from `parent` when
/// given. Same rules as [`prefix_iter`]; does not allocate.
#[inline]
pub fn for_each_prefix(tokens: &[u32], bs: usize, parent: Option<u64>, f: impl FnMut(u64)) {
    prefix_iter(tokens, bs, parent).for_each(f);
}

/// Prefix hashes of the full blocks of `tokens` with block size `bs` and no parent.
///
/// Empty when `bs == 0` or `tokens.len() < bs`; trailing tokens short of a block are dropped.
#[must_use]
pub fn prefix_hashes(tokens: &[u32], bs: usize) -> Vec<u64> {
    prefix_hashes_from(tokens, bs, None)
}

/// Prefix hashes of the full blocks of `tokens`, continuing from the parent prefix hash `parent`
/// (`prefix[0] = next_prefix(parent, content[0])`) or starting fresh when `parent` is `None`.
///
/// Empty when `bs == 0` or `tokens.len() < bs`; trailing tokens short of a block are dropped.
#[must_use]
pub fn prefix_hashes_from(tokens: &[u32], bs: usize, parent: Option<u64>) -> Vec<u64> {
    prefix_iter(tokens, bs, parent).collect()
}

/// Chain for a lookup: the wire forms (8 bytes big-endian) of the prefix hashes of the full
/// blocks, and the token count of each block (`[bs; n]`).
///
/// Both vectors are empty when `bs == 0` or `tokens.len() < bs`. They are also empty when `bs`
/// exceeds `i32::MAX`, since such a block's token count is not representable on the wire (and
/// would need more than 8 GiB of tokens to form a single block).
#[must_use]
pub fn chain(tokens: &[u32], bs: usize) -> (Vec<[u8; 8]>, Vec<i32>) {
    let Ok(count) = i32::try_from(bs) else {
        return (Vec::new(), Vec::new());
    };
    let hashes: Vec<[u8; 8]> = prefix_iter(tokens, bs, None).map(to_wire).collect();
    let counts = vec![count; hashes.len()];
    (hashes, counts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::Xxh3;

    /// Standard base64 (RFC 4648, with padding); enough for the 8-byte wire anchors.
    fn base64(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for group in bytes.chunks(3) {
            let b = [
                group[0],
                group.get(1).copied().unwrap_or(0),
                group.get(2).copied().unwrap_or(0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= group.len() {
                    out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    fn range(a: u32, b: u32) -> Vec<u32> {
        (a..=b).collect()
    }

    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn base64_encoder_matches_rfc4648_vectors() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foob"), "Zm9vYg==");
        assert_eq!(base64(b"fooba"), "Zm9vYmE=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    // F02: the frozen anchors, independent of the golden file.

    #[test]
    fn f02_content_anchor() {
        let c = content_hash(&range(1, 16));
        assert_eq!(c, 16_863_443_419_780_771_464);
        assert_eq!(base64(&to_wire(c)), "6gb8caXubog=");
    }

    #[test]
    fn f02_multi_block_anchor() {
        let p = prefix_hashes(&range(0, 63), 16);
        assert_eq!(p.len(), 4);
        assert_eq!(p[3], 3_888_788_807_566_526_800);
    }

    #[test]
    fn f02_parent_anchor() {
        let p = prefix_hashes_from(&range(50, 81), 16, Some(0xDEAD_BEEF));
        assert_eq!(p.len(), 2);
        assert_eq!(p[1], 2_998_384_554_010_166_533);
    }

    #[test]
    fn f02_tokenizer_anchor() {
        let p = prefix_hashes(&[14990, 1879], 2);
        assert_eq!(p.len(), 1);
        assert_eq!(base64(&to_wire(p[0])), "I48zwHwdhp4=");
        let (hashes, counts) = chain(&[14990, 1879], 2);
        assert_eq!(base64(&hashes[0]), "I48zwHwdhp4=");
        assert_eq!(counts, vec![2]);
    }

    #[test]
    fn construction_matches_definition() {
        let tokens = range(0, 63);
        let contents: Vec<u64> = tokens
            .chunks_exact(16)
            .map(|b| xxh3_64_with_seed(&le_bytes(b), SEED))
            .collect();
        let mut expected = vec![contents[0]];
        for &c in &contents[1..] {
            let prev = *expected.last().unwrap();
            let mut input = prev.to_le_bytes().to_vec();
            input.extend_from_slice(&c.to_le_bytes());
            expected.push(xxh3_64_with_seed(&input, SEED));
        }
        assert_eq!(prefix_hashes(&tokens, 16), expected);

        let parent = 0xDEAD_BEEF;
        let with_parent = prefix_hashes_from(&tokens, 16, Some(parent));
        assert_eq!(with_parent[0], next_prefix(parent, contents[0]));
        for i in 1..with_parent.len() {
            assert_eq!(with_parent[i], next_prefix(with_parent[i - 1], contents[i]));
        }
    }

    #[test]
    fn parent_continues_an_earlier_sequence() {
        // The suffix after k full blocks, chained from the k-th prefix hash, continues the chain.
        let tokens: Vec<u32> = (0..200u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        for bs in [1, 2, 16, 32] {
            let whole = prefix_hashes(&tokens, bs);
            for k in 1..whole.len() {
                let rest = prefix_hashes_from(&tokens[k * bs..], bs, Some(whole[k - 1]));
                assert_eq!(rest, whole[k..], "bs {bs} k {k}");
            }
        }
    }

    // F04: streaming and one-shot XXH3 agree.

    #[test]
    fn f04_streaming_equals_one_shot() {
        for tokens in [vec![1u32, 2, 3], (0..16).collect(), (0..40).collect()] {
            let bytes = le_bytes(&tokens);
            let one_shot = xxh3_64_with_seed(&bytes, SEED);

            let mut per_token = Xxh3::with_seed(SEED);
            for t in &tokens {
                per_token.update(&t.to_le_bytes());
            }
            let mut whole = Xxh3::with_seed(SEED);
            whole.update(&bytes);

            assert_eq!(per_token.digest(), one_shot, "{tokens:?}");
            assert_eq!(whole.digest(), one_shot, "{tokens:?}");
            assert_eq!(content_hash(&tokens), one_shot, "{tokens:?}");
            assert_eq!(content_hash_portable(&tokens), one_shot, "{tokens:?}");
        }
    }

    #[test]
    fn portable_path_matches_in_place_path() {
        // Lengths around XXH3's internal thresholds (16/128/240 bytes, 1 KiB stripes) and the
        // portable path's 64-token chunks.
        let tokens: Vec<u32> = (0..2_000u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
        for len in (0..=130).chain([255, 256, 257, 300, 1_000, 1_024, 2_000]) {
            let block = &tokens[..len];
            assert_eq!(
                content_hash(block),
                xxh3_64_with_seed(&le_bytes(block), SEED),
                "len {len}"
            );
            assert_eq!(
                content_hash_portable(block),
                content_hash(block),
                "len {len}"
            );
        }
    }

    // F05: chain() behaviour.

    #[test]
    fn f05_chain_counts_and_partial_tail() {
        let tokens = range(100, 119); // 20 tokens: one block of 16 plus a 4-token tail.
        let (hashes, counts) = chain(&tokens, 16);
        assert_eq!(hashes.len(), 1);
        assert_eq!(counts, vec![16]);
        assert_eq!(hashes[0], to_wire(content_hash(&tokens[..16])));

        let tokens = range(0, 70);
        let (hashes, counts) = chain(&tokens, 16);
        assert_eq!(counts, vec![16; 4]);
        let expected: Vec<[u8; 8]> = prefix_hashes(&tokens, 16)
            .into_iter()
            .map(to_wire)
            .collect();
        assert_eq!(hashes, expected);
        assert_eq!(hashes, chain(&tokens[..64], 16).0, "tail must not matter");
    }

    #[test]
    fn f05_chain_empty_cases() {
        let empty = (Vec::<[u8; 8]>::new(), Vec::<i32>::new());
        assert_eq!(chain(&range(0, 9), 16), empty, "fewer than bs tokens");
        assert_eq!(chain(&[], 16), empty, "no tokens");
        assert_eq!(chain(&range(0, 9), 0), empty, "bs == 0");
        assert_eq!(chain(&[], 0), empty, "bs == 0, no tokens");
        assert_eq!(chain(&range(0, 9), usize::MAX), empty, "bs beyond i32");
        assert!(prefix_hashes(&range(0, 9), 0).is_empty());
        assert!(prefix_hashes_from(&range(0, 9), 0, Some(7)).is_empty());
        assert!(prefix_hashes_from(&range(0, 9), 16, Some(7)).is_empty());
        assert_eq!(prefix_iter(&range(0, 9), 0, None).len(), 0);
        let mut called = false;
        for_each_prefix(&range(0, 9), 16, None, |_| called = true);
        assert!(!called);
    }

    #[test]
    fn f05_chain_of_prefix_is_prefix_of_chain() {
        let tokens: Vec<u32> = (0..300u32)
            .map(|i| i.wrapping_mul(0x85EB_CA6B) ^ i)
            .collect();
        for bs in [1, 2, 3, 16, 32, 128] {
            let (whole_h, whole_c) = chain(&tokens, bs);
            assert_eq!(whole_h.len(), tokens.len() / bs);
            assert_eq!(whole_c, vec![i32::try_from(bs).unwrap(); whole_h.len()]);
            for k in 0..=whole_h.len() {
                let (h, c) = chain(&tokens[..k * bs], bs);
                assert_eq!(h, whole_h[..k], "bs {bs} k {k}");
                assert_eq!(c, whole_c[..k], "bs {bs} k {k}");
            }
        }
    }

    #[test]
    fn iterator_forms_agree() {
        let tokens: Vec<u32> = (0..100u32).collect();
        for parent in [None, Some(0), Some(u64::MAX)] {
            let v = prefix_hashes_from(&tokens, 16, parent);
            let mut seen = Vec::new();
            for_each_prefix(&tokens, 16, parent, |h| seen.push(h));
            assert_eq!(seen, v);
            let it = prefix_iter(&tokens, 16, parent);
            assert_eq!(it.len(), block_count(tokens.len(), 16));
            assert_eq!(it.collect::<Vec<_>>(), v);
        }
        assert_eq!(block_count(100, 0), 0);
        assert_eq!(block_count(100, 16), 6);
    }

    #[test]
    fn wire_round_trip() {
        for h in [0, 1, 0xDEAD_BEEF, u64::MAX, 16_863_443_419_780_771_464] {
            assert_eq!(from_wire(to_wire(h)), h);
            assert_eq!(to_wire(h)[7], h.to_le_bytes()[0]);
        }
    }
}
