//! The checkpoint file's byte format: a header, then checksummed sections, then an end section.
//!
//! ```text
//! file    := header section* end
//! header  := magic "ICCHECKP" | version u32 | flags u32 | created_ms i64 | stream_seq u64
//!            | xxh3-64 of the 32 bytes before it                               (40 bytes)
//! section := kind u8 | 0u8 0u8 0u8 | payload_len u32 | payload | xxh3-64(kind..payload)
//! end     := a section of kind END whose payload is: sections u64 varint | entries u64 varint
//! ```
//!
//! All integers in the framing are little-endian; payloads use LEB128 varints (zigzag for
//! signed values) and length-prefixed byte strings. Every length read from a file is checked
//! against what remains of its payload before anything is allocated, and a payload is at most
//! [`MAX_PAYLOAD`] bytes, so a hostile file costs at most one payload buffer to reject.
//!
//! A file is valid only if its header checksum matches, its version is [`VERSION`], every
//! section's checksum matches and the end section counts exactly the sections before it. A torn
//! write (no end section), a truncation at any byte, a flipped bit or an unknown version is
//! refused with a [`FormatError`] that names the reason.
//!
//! `stream_seq` is the position of a replication log that the checkpoint covers (0 when it
//! covers none): a replicated server restores the checkpoint and then applies the log from the
//! next sequence.

use std::fmt;
use std::io::{self, Read, Write};
use xxhash_rust::xxh3::Xxh3;

/// File magic.
pub const MAGIC: [u8; 8] = *b"ICCHECKP";
/// The one format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Header length in bytes, checksum included.
pub const HEADER_LEN: usize = 40;
/// Largest section payload (bytes).
pub const MAX_PAYLOAD: usize = 16 << 20;
/// Target payload size of the sections a writer produces: small enough that a restore holds
/// only a few at a time, large enough that framing is noise.
pub const TARGET_PAYLOAD: usize = 256 << 10;

/// Section kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SectionKind {
    /// A partition's names and its replica table (defines the next partition number).
    Partition = 1,
    /// Entries of one partition, grouped by replica.
    Entries = 2,
    /// Replica stats of one (tenant, model).
    Stats = 3,
    /// An opaque named blob the embedding server stores with the index (e.g. its policy layer).
    Blob = 4,
    /// How many entries the sections of one (partition, shard) that follow hold (a hint the
    /// restore presizes the shard with).
    ShardSize = 5,
    /// The last section: counts of what came before.
    End = 255,
}

impl SectionKind {
    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Partition,
            2 => Self::Entries,
            3 => Self::Stats,
            4 => Self::Blob,
            5 => Self::ShardSize,
            255 => Self::End,
            _ => return None,
        })
    }
}

/// Why a checkpoint file was refused.
#[derive(Debug)]
pub enum FormatError {
    /// Reading the file failed.
    Io(io::Error),
    /// The file is shorter than a header.
    Empty,
    /// The first bytes are not the magic.
    BadMagic,
    /// The header's checksum does not match.
    HeaderChecksum,
    /// A version this build does not read.
    UnknownVersion(u32),
    /// The file ends inside a section, or before its end section (a torn or truncated write).
    Truncated {
        /// Sections read completely before the cut.
        sections: u64,
    },
    /// A section's checksum does not match.
    SectionChecksum {
        /// Index of the section (0-based).
        section: u64,
    },
    /// A section has a kind this build does not know, a non-zero reserved byte or an
    /// oversized payload.
    BadSection {
        /// Index of the section (0-based).
        section: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A section's payload does not decode.
    BadPayload {
        /// Index of the section (0-based).
        section: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// The end section's counts disagree with the sections read.
    CountMismatch,
    /// Bytes follow the end section.
    TrailingBytes,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "read failed: {e}"),
            Self::Empty => write!(f, "file shorter than a checkpoint header"),
            Self::BadMagic => write!(f, "not a checkpoint file (bad magic)"),
            Self::HeaderChecksum => write!(f, "header checksum mismatch"),
            Self::UnknownVersion(v) => {
                write!(f, "unknown checkpoint version {v} (reads {VERSION})")
            }
            Self::Truncated { sections } => {
                write!(
                    f,
                    "truncated after {sections} complete sections (no end section)"
                )
            }
            Self::SectionChecksum { section } => write!(f, "section {section}: checksum mismatch"),
            Self::BadSection { section, reason } => write!(f, "section {section}: {reason}"),
            Self::BadPayload { section, reason } => {
                write!(f, "section {section}: payload does not decode: {reason}")
            }
            Self::CountMismatch => write!(f, "end section counts disagree with the file"),
            Self::TrailingBytes => write!(f, "bytes after the end section"),
        }
    }
}

impl std::error::Error for FormatError {}

impl From<io::Error> for FormatError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// The decoded file header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Wall-clock time the checkpoint was started (ms since the epoch).
    pub created_ms: i64,
    /// Replication log position covered (0 = none).
    pub stream_seq: u64,
}

/// Encodes a header.
pub fn encode_header(h: &Header) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&0u32.to_le_bytes());
    out[16..24].copy_from_slice(&h.created_ms.to_le_bytes());
    out[24..32].copy_from_slice(&h.stream_seq.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&out[0..32]);
    out[32..40].copy_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes and checks a header.
pub fn decode_header(b: &[u8]) -> Result<Header, FormatError> {
    if b.len() < HEADER_LEN {
        return Err(FormatError::Empty);
    }
    if b[0..8] != MAGIC {
        return Err(FormatError::BadMagic);
    }
    let word = |r: std::ops::Range<usize>| -> [u8; 8] {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[r]);
        a
    };
    if xxhash_rust::xxh3::xxh3_64(&b[0..32]) != u64::from_le_bytes(word(32..40)) {
        return Err(FormatError::HeaderChecksum);
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[8..12]);
    let version = u32::from_le_bytes(v);
    if version != VERSION {
        return Err(FormatError::UnknownVersion(version));
    }
    Ok(Header {
        created_ms: i64::from_le_bytes(word(16..24)),
        stream_seq: u64::from_le_bytes(word(24..32)),
    })
}

fn section_checksum(kind: u8, payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&[kind, 0, 0, 0]);
    h.update(&(payload.len() as u32).to_le_bytes());
    h.update(payload);
    h.digest()
}

/// Appends one framed section to `out`. `payload` must be at most [`MAX_PAYLOAD`] bytes.
pub fn frame_section(out: &mut Vec<u8>, kind: SectionKind, payload: &[u8]) {
    debug_assert!(payload.len() <= MAX_PAYLOAD);
    let k = kind as u8;
    out.extend_from_slice(&[k, 0, 0, 0]);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&section_checksum(k, payload).to_le_bytes());
}

/// Writes the end section for `sections` sections and `entries` entries.
pub fn write_end(w: &mut impl Write, sections: u64, entries: u64) -> io::Result<()> {
    let mut p = Vec::with_capacity(20);
    put_uvarint(&mut p, sections);
    put_uvarint(&mut p, entries);
    let mut framed = Vec::with_capacity(p.len() + 16);
    frame_section(&mut framed, SectionKind::End, &p);
    w.write_all(&framed)
}

/// Reads sections one by one from a stream positioned after the header, checking each one.
pub struct SectionReader<R> {
    r: R,
    index: u64,
    entries_seen: u64,
    check_entries: bool,
    done: bool,
}

/// One section read and checked: its kind and payload.
pub struct Section {
    /// The section's kind.
    pub kind: SectionKind,
    /// The checked payload.
    pub payload: Vec<u8>,
    /// Index in the file (0-based).
    pub index: u64,
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` if the stream ended before the first byte,
/// an error (mapped by the caller to truncation) if it ended inside.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => {
                return if got == 0 {
                    Ok(false)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

impl<R: Read> SectionReader<R> {
    /// A reader over `r`, which must be positioned right after the header.
    pub fn new(r: R) -> Self {
        Self {
            r,
            index: 0,
            entries_seen: 0,
            check_entries: true,
            done: false,
        }
    }

    /// A reader that does not check the end section's entry count (for a second pass over a
    /// file whose first pass did).
    pub fn without_entry_check(r: R) -> Self {
        Self {
            check_entries: false,
            ..Self::new(r)
        }
    }

    /// Adds to the entry count the end section is checked against (the caller decodes entry
    /// sections; the reader only frames them).
    pub fn count_entries(&mut self, n: u64) {
        self.entries_seen = self.entries_seen.saturating_add(n);
    }

    /// The next non-end section, or `Ok(None)` after a valid end section (whose counts are
    /// checked against the sections read and the entries counted with
    /// [`SectionReader::count_entries`]).
    pub fn next_section(&mut self) -> Result<Option<Section>, FormatError> {
        if self.done {
            return Ok(None);
        }
        let truncated = |sections| FormatError::Truncated { sections };
        let mut head = [0u8; 8];
        match read_full(&mut self.r, &mut head) {
            Ok(true) => {}
            Ok(false) => return Err(truncated(self.index)),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(truncated(self.index));
            }
            Err(e) => return Err(e.into()),
        }
        let section = self.index;
        let kind = SectionKind::from_byte(head[0]).ok_or(FormatError::BadSection {
            section,
            reason: "unknown section kind",
        })?;
        if head[1..4] != [0, 0, 0] {
            return Err(FormatError::BadSection {
                section,
                reason: "reserved bytes are not zero",
            });
        }
        let mut len = [0u8; 4];
        len.copy_from_slice(&head[4..8]);
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_PAYLOAD {
            return Err(FormatError::BadSection {
                section,
                reason: "payload larger than the format allows",
            });
        }
        let mut payload = vec![0u8; len];
        let mut sum = [0u8; 8];
        let complete = read_full(&mut self.r, &mut payload).and_then(|ok| {
            if ok || len == 0 {
                read_full(&mut self.r, &mut sum)
            } else {
                Ok(false)
            }
        });
        match complete {
            Ok(true) => {}
            Ok(false) => return Err(truncated(self.index)),
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(truncated(self.index));
            }
            Err(e) => return Err(e.into()),
        }
        if section_checksum(head[0], &payload) != u64::from_le_bytes(sum) {
            return Err(FormatError::SectionChecksum { section });
        }
        self.index += 1;
        if kind == SectionKind::End {
            let mut c = Cursor::new(&payload);
            let bad = |reason| FormatError::BadPayload { section, reason };
            let sections = c.uvarint().map_err(bad)?;
            let entries = c.uvarint().map_err(bad)?;
            if sections != section || (self.check_entries && entries != self.entries_seen) {
                return Err(FormatError::CountMismatch);
            }
            let mut extra = [0u8; 1];
            if read_full(&mut self.r, &mut extra)? {
                return Err(FormatError::TrailingBytes);
            }
            self.done = true;
            return Ok(None);
        }
        Ok(Some(Section {
            kind,
            payload,
            index: section,
        }))
    }
}

// ------------------------------------------------------------------------------------------
// Payload primitives

/// Appends an unsigned LEB128 varint.
pub fn put_uvarint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends a zigzag-encoded signed varint.
pub fn put_ivarint(out: &mut Vec<u8>, v: i64) {
    put_uvarint(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// Appends a length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_uvarint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A bounds-checked reader over one payload.
pub struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `b`.
    pub fn new(b: &'a [u8]) -> Self {
        Self { b, at: 0 }
    }

    /// Whether every byte was consumed.
    pub fn is_empty(&self) -> bool {
        self.at >= self.b.len()
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.b.len() - self.at
    }

    /// One byte.
    pub fn byte(&mut self) -> Result<u8, &'static str> {
        let v = *self
            .b
            .get(self.at)
            .ok_or("payload ends inside a byte field")?;
        self.at += 1;
        Ok(v)
    }

    /// An unsigned varint (at most 10 bytes, no overflow).
    pub fn uvarint(&mut self) -> Result<u64, &'static str> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let b = self.byte().map_err(|_| "payload ends inside a varint")?;
            if i == 9 && b > 1 {
                return Err("varint overflows 64 bits");
            }
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes")
    }

    /// A zigzag signed varint.
    pub fn ivarint(&mut self) -> Result<i64, &'static str> {
        let u = self.uvarint()?;
        Ok(((u >> 1) as i64) ^ -((u & 1) as i64))
    }

    /// A varint that must fit `max`.
    pub fn bounded(&mut self, max: u64, what: &'static str) -> Result<u64, &'static str> {
        let v = self.uvarint()?;
        if v > max {
            return Err(what);
        }
        Ok(v)
    }

    /// `n` raw bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if n > self.remaining() {
            return Err("length runs past the payload");
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    /// A length-prefixed byte string of at most `max` bytes.
    pub fn bytes(&mut self, max: usize) -> Result<&'a [u8], &'static str> {
        let n = self.uvarint()?;
        if n > max as u64 {
            return Err("string longer than the format allows");
        }
        self.take(n as usize)
    }

    /// A length-prefixed UTF-8 string of at most `max` bytes.
    pub fn str(&mut self, max: usize) -> Result<&'a str, &'static str> {
        std::str::from_utf8(self.bytes(max)?).map_err(|_| "string is not UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_at_their_edges() {
        for v in [0u64, 1, 127, 128, 16_383, 16_384, u32::MAX as u64, u64::MAX] {
            let mut b = Vec::new();
            put_uvarint(&mut b, v);
            assert_eq!(Cursor::new(&b).uvarint(), Ok(v));
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX, -1_000_000] {
            let mut b = Vec::new();
            put_ivarint(&mut b, v);
            assert_eq!(Cursor::new(&b).ivarint(), Ok(v));
        }
        assert!(Cursor::new(&[0xff; 11]).uvarint().is_err());
        assert!(
            Cursor::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02])
                .uvarint()
                .is_err()
        );
    }

    #[test]
    fn header_checks_magic_checksum_and_version() {
        let h = Header {
            created_ms: 1_700_000_000_000,
            stream_seq: 42,
        };
        let b = encode_header(&h);
        assert_eq!(decode_header(&b).ok(), Some(h));
        assert!(matches!(decode_header(&b[..39]), Err(FormatError::Empty)));
        let mut bad = b;
        bad[0] ^= 1;
        assert!(matches!(decode_header(&bad), Err(FormatError::BadMagic)));
        let mut bad = b;
        bad[20] ^= 1;
        assert!(matches!(
            decode_header(&bad),
            Err(FormatError::HeaderChecksum)
        ));
        let mut v2 = b;
        v2[8] = 2;
        let sum = xxhash_rust::xxh3::xxh3_64(&v2[0..32]);
        v2[32..40].copy_from_slice(&sum.to_le_bytes());
        assert!(matches!(
            decode_header(&v2),
            Err(FormatError::UnknownVersion(2))
        ));
    }

    fn file_of(sections: &[(SectionKind, &[u8])], entries: u64) -> Vec<u8> {
        let mut b = Vec::new();
        for (k, p) in sections {
            frame_section(&mut b, *k, p);
        }
        write_end(&mut b, sections.len() as u64, entries).unwrap();
        b
    }

    fn read_all(b: &[u8], entries_per_section: u64) -> Result<Vec<Vec<u8>>, FormatError> {
        let mut r = SectionReader::new(b);
        let mut out = Vec::new();
        while let Some(s) = r.next_section()? {
            r.count_entries(entries_per_section);
            out.push(s.payload);
        }
        Ok(out)
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_refused() {
        let b = file_of(
            &[
                (SectionKind::Blob, b"hello"),
                (SectionKind::Entries, b"world!"),
            ],
            2,
        );
        assert_eq!(
            read_all(&b, 1).unwrap(),
            vec![b"hello".to_vec(), b"world!".to_vec()]
        );
        for cut in 0..b.len() {
            assert!(
                read_all(&b[..cut], 1).is_err(),
                "a cut at {cut} must be refused"
            );
        }
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(read_all(&c, 1).is_err(), "a flip at {i} must be refused");
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(matches!(
            read_all(&extra, 1),
            Err(FormatError::TrailingBytes)
        ));
        assert!(matches!(read_all(&b, 2), Err(FormatError::CountMismatch)));
    }
}
