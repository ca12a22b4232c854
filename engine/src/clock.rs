//! Injectable clocks (index.md §0 "Time").

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// The index clock: microseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    /// Current time in µs since the Unix epoch.
    fn now_us(&self) -> i64;
}

/// Wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> i64 {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => d.as_micros() as i64,
            Err(_) => 0,
        }
    }
}

/// A settable clock for tests.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicI64,
}

impl ManualClock {
    /// A clock reading `now_us`.
    pub fn new(now_us: i64) -> Self {
        Self {
            now: AtomicI64::new(now_us),
        }
    }
    /// Set the current time (µs).
    pub fn set_us(&self, now_us: i64) {
        self.now.store(now_us, Ordering::SeqCst);
    }
    /// Move the clock by `delta_us` (may be negative).
    pub fn advance_us(&self, delta_us: i64) {
        self.now.fetch_add(delta_us, Ordering::SeqCst);
    }
    /// Move the clock by `ms` milliseconds.
    pub fn advance_ms(&self, ms: i64) {
        self.advance_us(ms * 1000);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> i64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// Stored timestamp resolution: every `now` and every timestamp is truncated to ms the same way.
#[inline]
pub(crate) fn us_to_ms(us: i64) -> i64 {
    us.div_euclid(1000)
}
