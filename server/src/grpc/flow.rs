//! HTTP/2 flow control of the gRPC listener: the windows that make backpressure hold a
//! producer back without ever tripping h2's DATA-frame budget.
//!
//! h2 (≥ 0.4.13) charges every buffered non-final DATA frame smaller than 256 bytes
//! `256 − payload` against a per-connection budget of half the connection window, and closes
//! the connection with GOAWAY `ENHANCE_YOUR_CALM` "too_many_data_frames" when it is spent. The
//! budget comes back only as the application reads the frames. A producer over its rate (or
//! faster than ingest) is held back precisely by the server *not* reading, so with hyper's
//! defaults (1 MiB stream and connection windows, budget 512 KiB) a stream of ~40-byte
//! messages, one DATA frame each, filled the budget after ~2,400 frames and lost its
//! connection and every message in flight.
//!
//! So the windows are sized together: what a connection can have buffered is at most
//! `MAX_CONCURRENT_STREAMS × STREAM_WINDOW` bytes (6.25 MiB), and the connection window is
//! chosen so that its half covers the overhead of all of that in frames of
//! `MIN_FRAME_PAYLOAD` bytes. A client whose DATA frames carry at least 32 bytes (a message of
//! 27 bytes plus the 5-byte gRPC prefix) therefore never meets the budget, however long the
//! server holds it back; only a peer splitting data into tinier frames on many streams can,
//! which is the flood the budget exists for.

/// Per-stream receive window (the HTTP/2 default, 64 KiB).
pub const STREAM_WINDOW: u32 = 65_536;
/// Concurrent streams per connection (the RFC 9113 recommended minimum).
pub const MAX_CONCURRENT_STREAMS: u32 = 100;
/// The smallest DATA frame payload that can never exhaust the budget.
pub const MIN_FRAME_PAYLOAD: u32 = 32;
/// h2's small-frame threshold (`DEFAULT_DATA_FRAME_OVERHEAD_THRESHOLD`).
pub const SMALL_FRAME_BYTES: u32 = 256;
/// Twice the worst overhead of a full connection of minimal frames.
pub const CONNECTION_WINDOW: u32 =
    2 * MAX_CONCURRENT_STREAMS * STREAM_WINDOW * (SMALL_FRAME_BYTES - MIN_FRAME_PAYLOAD)
        / MIN_FRAME_PAYLOAD;
