//! Replicated mode: N servers that hold the same index because they apply the same ordered log,
//! a NATS JetStream stream (`docs/scale-out.md`).
//!
//! **One apply path.** A server that accepts a producer's update, event or `/policy` push does
//! not apply it: it resolves the update's timestamp (`0` becomes its clock), queues it in the
//! [`outbox`] and acks the producer. Every server — the receiving one too — applies the stream
//! in stream order on one thread ([`apply`]), so the same records meet the same state
//! everywhere. Lookups stay in-process and never wait on NATS.
//!
//! **Decisions in one place.** Evictions decided from local state (the cap, quotas, the TTL
//! sweep) and LFU credits counted from local lookups would make servers drift apart. One
//! server, the holder of a lease in a JetStream KV bucket ([`leader`]), runs them; every entry
//! it removes is published as a conditional removal ("remove if its `last_seen` is still ≤
//! t"), which every server applies at the same stream position with the same outcome. The
//! other servers never evict on their own. Credits are counted per server and published as
//! aggregated records once a second; nobody applies a credit before it is in the stream.
//!
//! **Bootstrap.** The leader uploads a checkpoint (the warm-restart format, its header holding
//! the stream sequence it covers, cut on the apply thread between two records) to a JetStream
//! object store every `--checkpoint-interval`. A new server, a restarted one, and one that
//! finds the next record it needs already trimmed from the stream load the newest checkpoint
//! and apply the stream from the sequence after it. Until the backlog seen at start is
//! applied, gRPC health is NOT_SERVING, `/readyz` 503 and lookups answer NO_HINT.

pub mod apply;
pub mod counters;
pub mod decisions;
pub mod leader;
pub mod outbox;
pub mod record;
pub mod settings;
pub mod stores;

pub use counters::Counters;
pub use settings::Settings;

use crate::core::Core;
use crate::metrics::Family;
use anyhow::Context as _;
use inferencecache_engine::CapturedHits;
use inferencecache_proto::v1alpha1 as pb;
use record::{Body, Record};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tracing::{error, info, warn};

/// Default of `--nats-buffer`: records held while NATS is unreachable.
pub const DEFAULT_BUFFER_RECORDS: u64 = 100_000;
/// Default of `--nats-max-bytes`: no byte limit, so the stream is trimmed by age alone, and
/// `--nats-max-age` ≥ 2 × `--checkpoint-interval` keeps every record the newest checkpoint needs.
pub const DEFAULT_STREAM_MAX_BYTES: u64 = 0;
/// Distinct (entry, replica) credits a server aggregates between two credit records; more in
/// one interval are dropped (a miss of LFU protection, never a wrong entry).
const MAX_PENDING_CREDITS: usize = 65_536;
/// How often removals decided outside the apply thread (the TTL sweep) are published.
const DECISION_FLUSH: Duration = Duration::from_millis(100);
/// How often aggregated credits are published.
const CREDIT_INTERVAL: Duration = Duration::from_secs(1);

/// A random 64-bit value (process epochs, default server ids): the std hasher's random keys.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// The running replication of one server.
pub struct Replication {
    settings: Settings,
    outbox: Arc<outbox::Outbox>,
    counters: Arc<Counters>,
    credits: parking_lot::Mutex<HashMap<(record::Holder, Vec<u8>), u32>>,
    applier: parking_lot::Mutex<Option<apply::Handle>>,
}

impl Replication {
    /// Prepares replicated mode for `state` (nothing runs before [`Replication::start`]).
    pub fn new(settings: Settings) -> Arc<Self> {
        let counters = Arc::new(Counters::default());
        Arc::new(Self {
            outbox: Arc::new(outbox::Outbox::new(settings.buffer, counters.clone())),
            settings,
            counters,
            credits: parking_lot::Mutex::new(HashMap::new()),
            applier: parking_lot::Mutex::new(None),
        })
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// Records accepted here and not yet acked by the stream.
    pub fn buffered(&self) -> usize {
        self.outbox.len() + self.counters.in_flight.load(Ordering::Relaxed) as usize
    }

    /// Queues an admitted update (timestamp already resolved), split to fit a batch.
    pub async fn submit_update(&self, update: pb::CacheStateUpdate) {
        for part in record::split_update(update, record::MAX_BATCH_BYTES - 1024) {
            self.outbox
                .push(Record {
                    body: Some(Body::Update(part)),
                })
                .await;
        }
    }

    /// Queues an event (timestamp already resolved).
    pub async fn submit_event(&self, event: pb::CacheEvent) {
        self.outbox
            .push(Record {
                body: Some(Body::Event(event)),
            })
            .await;
    }

    /// Queues an accepted `/policy` push body.
    pub async fn submit_policy(&self, body: &[u8]) {
        self.outbox
            .push(Record {
                body: Some(Body::Policy(body.to_vec())),
            })
            .await;
    }

    /// Counts the credits of a delivered LFU answer (published within a second).
    pub fn credit(&self, hits: &CapturedHits) {
        if hits.is_empty() {
            return;
        }
        let mut pending = self.credits.lock();
        hits.for_each_hit(|tenant, model, scheme, adapter, replica, key| {
            let holder = record::Holder {
                tenant_id: tenant.into(),
                model_id: model.into(),
                hash_scheme: scheme.into(),
                adapter_id: adapter.into(),
                replica_id: replica.into(),
            };
            let full = pending.len() >= MAX_PENDING_CREDITS;
            match pending.get_mut(&(holder.clone(), key.to_vec())) {
                Some(n) => *n = n.saturating_add(1),
                None if full => {
                    self.counters
                        .credits_dropped
                        .fetch_add(1, Ordering::Relaxed);
                }
                None => {
                    pending.insert((holder, key.to_vec()), 1);
                }
            }
        });
    }

    fn flush_credits(&self) {
        let pending = std::mem::take(&mut *self.credits.lock());
        let mut grouped: HashMap<record::Holder, record::Credits> = HashMap::new();
        for ((holder, key), times) in pending {
            let c = grouped
                .entry(holder.clone())
                .or_insert_with(|| record::Credits {
                    holder: Some(holder),
                    ..Default::default()
                });
            c.keys.push(key);
            c.times.push(times);
        }
        for (_, c) in grouped {
            self.outbox.push_decided(Record {
                body: Some(Body::Credits(c)),
            });
        }
    }

    /// The digest of the index at the applied sequence (computed on the apply thread).
    pub async fn digest(&self) -> Option<apply::DigestAt> {
        let handle = self.applier.lock().clone()?;
        handle.digest().await
    }

    /// Connects, bootstraps and runs every replication task. Returns once the apply thread
    /// runs; the state stays *restoring* until the backlog is applied.
    pub async fn start(self: &Arc<Self>, state: Core) -> anyhow::Result<()> {
        state.begin_restore();
        let client = connect(&self.settings, self.counters.clone()).await?;
        self.counters.connected.store(true, Ordering::Relaxed);
        let js = async_nats::jetstream::new(client);
        let stores = stores::Stores::open(&js, &self.settings).await?;
        let decisions = Arc::new(decisions::Decisions::new(self.outbox.clone()));
        let handle = apply::spawn(state.clone(), self.counters.clone(), decisions.clone())?;
        // The sweep thread's removals are published within DECISION_FLUSH (the apply thread
        // publishes its own after each message).
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(DECISION_FLUSH);
            loop {
                tick.tick().await;
                decisions.flush();
            }
        });
        *self.applier.lock() = Some(handle.clone());
        tokio::spawn(self.outbox.clone().run(
            js.clone(),
            self.settings.subject(),
            self.settings.server_id.clone(),
            random_u64(),
        ));
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CREDIT_INTERVAL);
            loop {
                tick.tick().await;
                me.flush_credits();
            }
        });
        let consumer = apply::Consumer {
            stores: stores.clone(),
            handle: handle.clone(),
            counters: self.counters.clone(),
            state: state.clone(),
            checkpoint_wait: self.settings.checkpoint_interval + Duration::from_secs(5),
        };
        tokio::spawn(consumer.run());
        // The stream's head, for the lag gauges (and `/digest`).
        let (watch_stores, watch_counters) = (stores.clone(), self.counters.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                if let Some((_, last)) = watch_stores.bounds().await {
                    watch_counters
                        .stream_last_seq
                        .fetch_max(last, Ordering::Relaxed);
                }
            }
        });
        let duties = leader::Duties {
            stores,
            handle,
            counters: self.counters.clone(),
            state,
            settings: self.settings.clone(),
        };
        tokio::spawn(duties.run());
        info!(
            url = %self.settings.url,
            stream = %self.settings.stream,
            server_id = %self.settings.server_id,
            "replication_started"
        );
        Ok(())
    }

    /// The `inferencecache_replication_*` families.
    pub fn families(&self) -> Vec<Family> {
        families(&self.counters, true)
    }
}

/// The `inferencecache_replication_*` families, exported also without replication (zeros and
/// `inferencecache_replication_enabled 0`), like the checkpoint families.
pub fn families(c: &Counters, enabled: bool) -> Vec<Family> {
    let applied = c.applied_seq.load(Ordering::Relaxed);
    let last = c.stream_last_seq.load(Ordering::Relaxed);
    let gauge = |name: &str, help: &'static str, v: f64| Family::gauge(name, help, v);
    let counter = |name: &str, help: &'static str, v: u64| Family::counter(name, help, v as f64);
    vec![
        gauge(
            "inferencecache_replication_enabled",
            "1 when --nats-url is set (replicated mode)",
            f64::from(u8::from(enabled)),
        ),
        gauge(
            "inferencecache_replication_applied_sequence",
            "last stream sequence applied to this server's index",
            applied as f64,
        ),
        gauge(
            "inferencecache_replication_lag_messages",
            "stream messages published but not yet applied here",
            last.saturating_sub(applied) as f64,
        ),
        gauge(
            "inferencecache_replication_lag_seconds",
            "age of the last applied message while behind the stream's head (0 when caught up)",
            c.lag_seconds_micros.load(Ordering::Relaxed) as f64 / 1e6,
        ),
        counter(
            "inferencecache_replication_published_records_total",
            "records this server published to the stream (acked)",
            c.published.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_publish_errors_total",
            "failed publish attempts (retried with the same message ids)",
            c.publish_errors.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_dropped_records_total",
            "records dropped because the outbox was full (--nats-buffer) or too large",
            c.dropped.load(Ordering::Relaxed),
        ),
        gauge(
            "inferencecache_replication_buffered_records",
            "records waiting in the outbox",
            c.buffered.load(Ordering::Relaxed) as f64,
        ),
        counter(
            "inferencecache_replication_bootstraps_total",
            "checkpoint loads (startup and re-bootstraps)",
            c.bootstraps.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_gaps_total",
            "times the next needed record was already trimmed from the stream",
            c.gaps.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_undecodable_total",
            "stream messages that did not decode (skipped)",
            c.undecodable.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_checkpoint_uploads_total",
            "checkpoints this server uploaded as leader",
            c.checkpoint_uploads.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_checkpoint_upload_failures_total",
            "checkpoint uploads that failed",
            c.checkpoint_upload_failures.load(Ordering::Relaxed),
        ),
        counter(
            "inferencecache_replication_credits_dropped_total",
            "LFU credits dropped because too many distinct entries were credited in one second",
            c.credits_dropped.load(Ordering::Relaxed),
        ),
        gauge(
            "inferencecache_replication_leader",
            "1 while this server holds the lease (decides evictions, uploads checkpoints)",
            f64::from(u8::from(c.leader.load(Ordering::Relaxed))),
        ),
    ]
}

/// Connects to NATS with the configured credentials (retrying until it answers: a server may
/// start before NATS does).
async fn connect(
    settings: &Settings,
    counters: Arc<Counters>,
) -> anyhow::Result<async_nats::Client> {
    let mut options = async_nats::ConnectOptions::new()
        .name(format!("inferencecache-server {}", settings.server_id))
        .retry_on_initial_connect()
        .max_reconnects(None);
    if let Some(path) = &settings.creds_file {
        options = options
            .credentials_file(path)
            .await
            .with_context(|| format!("--nats-creds-file {}", path.display()))?;
    }
    if let Some(path) = &settings.token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("--nats-token-file {}", path.display()))?;
        options = options.token(token.trim().to_owned());
    }
    if let Some(path) = &settings.tls_ca_file {
        options = options
            .add_root_certificates(path.clone())
            .require_tls(true);
    }
    let client = options
        .event_callback(move |event| {
            let counters = counters.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        counters.connected.store(false, Ordering::Relaxed);
                        warn!("replication_nats_disconnected");
                    }
                    async_nats::Event::Connected => {
                        counters.connected.store(true, Ordering::Relaxed);
                        info!("replication_nats_connected");
                    }
                    other => info!(event = %other, "replication_nats_event"),
                }
            }
        })
        .connect(settings.url.as_str())
        .await
        .with_context(|| format!("connect to NATS at {}", settings.url))?;
    Ok(client)
}

/// Logs a failed start (the server keeps serving fail-open, not ready).
pub fn start_failed(err: &anyhow::Error) {
    error!(err = %format!("{err:#}"), "replication_start_failed");
}

/// The record of an admitted update: what the engine would have applied here, as a message,
/// with a timestamp `0` resolved to `now_us` (so every server ages it alike).
pub fn owned_update<'a, I>(
    admitted: inferencecache_engine::CacheStateUpdate<'a, I>,
    now_us: i64,
) -> pb::CacheStateUpdate
where
    I: Iterator<Item = inferencecache_engine::PrefixRef<'a, Vec<u8>>>,
{
    pb::CacheStateUpdate {
        replica_id: admitted.replica_id.to_owned(),
        model_id: admitted.model_id.to_owned(),
        tenant_id: admitted.tenant_id.to_owned(),
        hash_scheme: admitted.hash_scheme.to_owned(),
        timestamp_us: if admitted.timestamp_us == 0 {
            now_us
        } else {
            admitted.timestamp_us
        },
        adapter_id: admitted.adapter_id.to_owned(),
        prefixes: admitted
            .prefixes
            .map(|p| pb::PrefixEntry {
                prefix_hash: p.prefix_hash.to_vec(),
                token_count: p.token_count,
                block_hashes: p.block_hashes.to_vec(),
                block_token_counts: p.block_token_counts.to_vec(),
                tier: p.tier,
                adapter_id: p.adapter_id.to_owned(),
            })
            .collect(),
        stats: admitted.stats.map(|s| pb::ReplicaStats {
            replica_id: admitted.replica_id.to_owned(),
            cache_memory_bytes: s.cache_memory_bytes,
            hit_rate: s.hit_rate,
            pressure: s.pressure,
            client_version: String::new(),
            t2_hit_tokens: s.t2_hit_tokens,
            t2_query_tokens: s.t2_query_tokens,
            // The caller copies the producer's endpoint (the engine's update type has none).
            endpoint: String::new(),
        }),
    }
}
