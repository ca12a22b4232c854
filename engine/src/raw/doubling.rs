//! Arrays of chunks of doubling length that never move (the replica slots of a scope, the run
//! ids of a partition): chunk `k` holds `base << k` entries and starts at entry
//! `base · (2^k − 1)`, so a new entry is at most one chunk allocation and a reader finds any
//! entry with one chunk-pointer load.

/// Chunk and offset of entry `i` in chunks of doubling length starting at `base` (a power of
/// two).
#[inline]
pub(crate) fn place(i: usize, base: usize) -> (usize, usize) {
    let x = i / base + 1;
    let k = (usize::BITS - 1 - x.leading_zeros()) as usize;
    (k, i - base * ((1 << k) - 1))
}

#[cfg(test)]
mod tests {
    #[test]
    fn entries_fall_in_their_chunks() {
        let cases = [
            (0, (0, 0)),
            (3, (0, 3)),
            (4, (1, 0)),
            (11, (1, 7)),
            (12, (2, 0)),
        ];
        for (i, want) in cases {
            assert_eq!(super::place(i, 4), want, "entry {i}");
        }
    }
}
