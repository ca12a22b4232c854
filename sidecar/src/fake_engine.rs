//! The test publisher behind `inferencecache-fake-engine` (spec `sidecar.md` §10).

use crate::wire::{TAG_BLOCK_STORED, encode};
use clap::Parser;
use inferencecache_engine::fingerprint::{prefix_hashes, to_wire};
use rmpv::Value;

/// Engine hash of global block 0; block i is `BASE_ENGINE_HASH + i`.
pub const BASE_ENGINE_HASH: u64 = 0xE000;
/// Upper bound on published tokens.
pub const MAX_TOKENS: u64 = 1 << 24;

/// Fake engine flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "inferencecache-fake-engine",
    version,
    about = "Publishes BlockStored batches over ZMQ like an engine (tests and demos)"
)]
pub struct FakeCli {
    /// PUB endpoint to bind (port 0 picks a free port; the bound endpoint is printed).
    #[arg(long, default_value = "tcp://0.0.0.0:5557")]
    pub bind: String,
    /// Topic frame.
    #[arg(long, default_value = "kv-events")]
    pub topic: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 128, allow_hyphen_values = true)]
    pub block_size: i64,
    /// Blocks to publish.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    pub num_blocks: i64,
    /// BlockStored events the blocks are split across (chained by parent_block_hash).
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    pub events: i64,
    /// First token id.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true)]
    pub start_token: i64,
    /// Republish period.
    #[arg(long, default_value = "500ms", allow_hyphen_values = true)]
    pub interval: String,
    /// Send token_ids as nil (the sidecar then cannot index anything).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub omit_token_ids: bool,
}

/// Validated fake-engine plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub block_size: usize,
    pub num_blocks: usize,
    pub events: usize,
    pub start_token: u32,
    pub omit_token_ids: bool,
}

impl Plan {
    /// Validates sizes: positive sizes, total tokens ≤ 2^24, token range within u32, events in
    /// `[1, num_blocks]`.
    pub fn new(
        block_size: i64,
        num_blocks: i64,
        events: i64,
        start_token: i64,
        omit_token_ids: bool,
    ) -> Result<Self, String> {
        if block_size <= 0 {
            return Err("--block-size must be positive".into());
        }
        if num_blocks <= 0 {
            return Err("--num-blocks must be positive".into());
        }
        let total = (block_size as u64).saturating_mul(num_blocks as u64);
        if total > MAX_TOKENS {
            return Err(format!("total tokens {total} exceed 2^24"));
        }
        if start_token < 0 || (start_token as u64) + total - 1 > u64::from(u32::MAX) {
            return Err("token range must fit in u32".into());
        }
        if events < 1 || events > num_blocks {
            return Err("--events must be in [1, num-blocks]".into());
        }
        Ok(Self {
            block_size: block_size as usize,
            num_blocks: num_blocks as usize,
            events: events as usize,
            start_token: start_token as u32,
            omit_token_ids,
        })
    }

    /// All published tokens, `start..start+n-1`.
    pub fn tokens(&self) -> Vec<u32> {
        let n = (self.block_size * self.num_blocks) as u32;
        (0..n).map(|i| self.start_token + i).collect()
    }

    /// Blocks per event: the first `num_blocks % events` events get one extra block.
    pub fn split(&self) -> Vec<usize> {
        let base = self.num_blocks / self.events;
        let extra = self.num_blocks % self.events;
        (0..self.events)
            .map(|i| base + usize::from(i < extra))
            .collect()
    }

    /// The batch value `[0.0, [BlockStored tuples…]]`.
    pub fn batch(&self) -> Value {
        let tokens = self.tokens();
        let mut events = Vec::with_capacity(self.events);
        let mut first = 0usize;
        for count in self.split() {
            let hashes: Vec<Value> = (first..first + count)
                .map(|i| Value::from(BASE_ENGINE_HASH + i as u64))
                .collect();
            let parent = if first == 0 {
                Value::Nil
            } else {
                Value::from(BASE_ENGINE_HASH + first as u64 - 1)
            };
            let token_ids = if self.omit_token_ids {
                Value::Nil
            } else {
                Value::Array(
                    tokens[first * self.block_size..(first + count) * self.block_size]
                        .iter()
                        .map(|t| Value::from(*t))
                        .collect(),
                )
            };
            events.push(Value::Array(vec![
                Value::from(TAG_BLOCK_STORED),
                Value::Array(hashes),
                parent,
                token_ids,
                Value::from(self.block_size as u64),
                Value::Nil,
            ]));
            first += count;
        }
        Value::Array(vec![Value::F64(0.0), Value::Array(events)])
    }

    /// The msgpack payload.
    pub fn payload(&self) -> Vec<u8> {
        encode(&self.batch())
    }

    /// `(prefix hash wire form, token count)` a lookup should find, one per block.
    pub fn expected(&self) -> Vec<([u8; 8], i32)> {
        if self.omit_token_ids {
            return Vec::new();
        }
        prefix_hashes(&self.tokens(), self.block_size)
            .into_iter()
            .enumerate()
            .map(|(i, h)| (to_wire(h), ((i + 1) * self.block_size) as i32))
            .collect()
    }

    /// The `EXPECT` lines printed at startup.
    pub fn expect_lines(&self) -> Vec<String> {
        if self.omit_token_ids {
            return vec![format!(
                "EXPECT no index entries ({} blocks published without token_ids)",
                self.num_blocks
            )];
        }
        self.expected()
            .iter()
            .enumerate()
            .map(|(i, (h, n))| format!("EXPECT prefix_hash[{i}]={} token_count={n}", hex(h)))
            .collect()
    }
}

/// Lower-case hex of bytes.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
