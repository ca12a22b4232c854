//! ZMQ subscriber (spec `sidecar.md` §3): SUB socket → ordered reporter input.
//!
//! The subscriber is the only place that sees sequence numbers, so it owns the ordering
//! guarantee the reporter relies on: every batch it forwards is either the next one of its
//! publisher or comes right after an [`Input::Resync`]. Concretely:
//! - after every dial (startup and each reconnect) it cannot know what it missed: it sends a
//!   resync, then applies everything the engine's replay buffer still holds (oldest first);
//! - a gap is filled from the replay socket when the buffer still holds all of it, else it
//!   resyncs (and replays the buffer);
//! - a sequence going backwards (not explained by an overlapping replay) is an engine restart:
//!   resync;
//! - a batch applied from a replay is never applied again when the live stream delivers it.
//!
//! Without `--engine-replay-endpoint` the resyncs still happen; the index then rebuilds from
//! live events only (a miss until the engine stores again, never a false entry).

use crate::replay;
use crate::reporter::Input;
use crate::sequence::{Tracker, Verdict};
use crate::telemetry::{ResyncReason, Telemetry};
use crate::wire::{EventBatch, decode_batch_lenient, split_message};
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use zeromq::{Socket, SocketEvent, SocketRecv, SubSocket, ZmqMessage};

/// Capacity of the subscriber → reporter channel.
pub const CHANNEL_CAPACITY: usize = 256;
/// Pause before redialing after a failure or a lost connection.
pub const RETRY_DELAY: Duration = Duration::from_millis(500);
/// Bound on one dial attempt.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Silence after subscribing that earns a warning (wrong endpoint or topic, events disabled).
pub const SILENCE_WARNING: Duration = Duration::from_secs(60);

/// Subscriber settings.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// Engine PUB endpoint (the SUB socket connects).
    pub endpoint: String,
    /// Subscription prefix.
    pub topic: String,
    /// Engine replay ROUTER endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// Silence after subscribing that logs a warning.
    pub silence_warning: Duration,
    /// Shared counters.
    pub telemetry: Arc<Telemetry>,
}

impl SubscriberConfig {
    /// Defaults for one endpoint and topic.
    pub fn new(endpoint: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            topic: topic.into(),
            replay_endpoint: None,
            silence_warning: SILENCE_WARNING,
            telemetry: Arc::default(),
        }
    }
}

/// A publisher of the endpoint: topic and data-parallel rank.
type PublisherKey = (Bytes, Option<i64>);

/// The reporter went away: stop.
struct Closed;

/// Sequence state of one connection.
struct Session<'a> {
    cfg: &'a SubscriberConfig,
    tx: &'a mpsc::Sender<Input>,
    trackers: HashMap<PublisherKey, Tracker>,
}

impl<'a> Session<'a> {
    fn new(cfg: &'a SubscriberConfig, tx: &'a mpsc::Sender<Input>) -> Self {
        Self {
            cfg,
            tx,
            trackers: HashMap::new(),
        }
    }

    async fn send(&self, input: Input) -> Result<(), Closed> {
        self.tx.send(input).await.map_err(|_| Closed)
    }

    fn decode(&self, payload: &[u8], source: &str) -> Option<EventBatch> {
        match decode_batch_lenient(payload) {
            Ok(decoded) => {
                for e in &decoded.dropped {
                    Telemetry::inc(&self.cfg.telemetry.malformed_events);
                    warn!(
                        event = "malformed_event",
                        source,
                        err = %e,
                        "dropping one malformed event; applying the rest of its batch"
                    );
                }
                Some(decoded.batch)
            }
            Err(e) => {
                Telemetry::inc(&self.cfg.telemetry.decode_failures);
                warn!(
                    source,
                    err = %e,
                    "undecodable_batch"
                );
                None
            }
        }
    }

    /// Clears the replica, then applies what the engine's buffer holds.
    async fn resync_and_replay(&mut self, reason: ResyncReason) -> Result<(), Closed> {
        self.trackers.clear();
        self.send(Input::Resync(reason)).await?;
        let Some(endpoint) = self.cfg.replay_endpoint.as_deref() else {
            return Ok(());
        };
        let answer = match replay::request(endpoint, 0).await {
            Ok(a) => a,
            Err(e) => {
                Telemetry::inc(&self.cfg.telemetry.replay_failures);
                warn!(
                    replay_endpoint = %endpoint,
                    err = %e,
                    "replay_failed"
                );
                return Ok(());
            }
        };
        let topic = self.cfg.topic.as_bytes();
        let mut applied = 0usize;
        for r in answer {
            if !r.topic.starts_with(topic) {
                continue;
            }
            let Some(batch) = self.decode(&r.payload, "replay") else {
                continue;
            };
            let key = (r.topic.clone(), batch.data_parallel_rank);
            self.trackers
                .entry(key)
                .or_default()
                .applied_replayed(r.seq);
            Telemetry::inc(&self.cfg.telemetry.batches_replayed);
            applied += 1;
            self.send(Input::Batch(batch)).await?;
        }
        info!(reason = reason.as_str(), batches = applied, "replayed");
        Ok(())
    }

    /// Fills `[from, to)` of `key` from the replay socket; false when it cannot be filled
    /// completely (nothing is applied then).
    async fn fill(&mut self, key: &PublisherKey, from: u64, to: u64) -> Result<bool, Closed> {
        let Some(endpoint) = self.cfg.replay_endpoint.as_deref() else {
            return Ok(false);
        };
        let answer = match replay::request(endpoint, from).await {
            Ok(a) => a,
            Err(e) => {
                Telemetry::inc(&self.cfg.telemetry.replay_failures);
                warn!(replay_endpoint = %endpoint, err = %e, "replay_failed");
                return Ok(false);
            }
        };
        let mut missing = Vec::new();
        let mut expect = from;
        for r in answer {
            if r.seq < from || r.seq >= to || r.topic != key.0 {
                continue;
            }
            let Some(batch) = self.decode(&r.payload, "replay") else {
                return Ok(false);
            };
            if batch.data_parallel_rank != key.1 {
                continue;
            }
            if r.seq != expect {
                // The buffer no longer holds the start of the gap.
                return Ok(false);
            }
            expect += 1;
            missing.push((r.seq, batch));
        }
        if expect != to {
            return Ok(false);
        }
        for (seq, batch) in missing {
            self.trackers
                .entry(key.clone())
                .or_default()
                .applied_live(seq);
            Telemetry::inc(&self.cfg.telemetry.batches_replayed);
            self.send(Input::Batch(batch)).await?;
        }
        Ok(true)
    }

    /// Handles one live message.
    async fn on_message(&mut self, msg: &ZmqMessage) -> Result<(), Closed> {
        let frames: Vec<&[u8]> = msg.iter().map(|b| b.as_ref()).collect();
        let Some(parts) = split_message(&frames) else {
            return Ok(());
        };
        if parts.payload.is_empty() {
            return Ok(());
        }
        let telemetry = Arc::clone(&self.cfg.telemetry);
        telemetry.event_arrived();
        let Some(batch) = self.decode(parts.payload, "live") else {
            return Ok(());
        };
        Telemetry::inc(&telemetry.batches_live);
        let Some(seq) = parts.seq else {
            // An unnumbered publisher: nothing to check.
            return self.send(Input::Batch(batch)).await;
        };
        let key: PublisherKey = (
            Bytes::copy_from_slice(parts.topic),
            batch.data_parallel_rank,
        );
        let verdict = self.trackers.entry(key.clone()).or_default().classify(seq);
        let resync = match verdict {
            Verdict::Apply => None,
            Verdict::Duplicate => {
                Telemetry::inc(&telemetry.batches_duplicate);
                return Ok(());
            }
            Verdict::Gap { from } => {
                Telemetry::inc(&telemetry.gaps);
                warn!(
                    from,
                    to = seq,
                    rank = batch.data_parallel_rank,
                    "sequence_gap"
                );
                if self.fill(&key, from, seq).await? {
                    Telemetry::inc(&telemetry.gaps_filled);
                    None
                } else {
                    Some(ResyncReason::GapUnfillable)
                }
            }
            Verdict::Restart => {
                warn!(
                    seq,
                    expected = self.trackers.get(&key).and_then(Tracker::next),
                    "engine_restart"
                );
                Some(ResyncReason::EngineRestart)
            }
        };
        if let Some(reason) = resync {
            self.resync_and_replay(reason).await?;
            let tracker = self.trackers.entry(key.clone()).or_default();
            if tracker.classify(seq) == Verdict::Duplicate {
                Telemetry::inc(&telemetry.batches_duplicate);
                return Ok(());
            }
        }
        self.trackers.entry(key).or_default().applied_live(seq);
        self.send(Input::Batch(batch)).await
    }
}

/// Stream of socket events (connects, disconnects).
type MonitorStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = SocketEvent> + Send>>;

async fn dial(endpoint: &str, topic: &str) -> Result<(SubSocket, MonitorStream), String> {
    let mut sock = SubSocket::new();
    // Before connecting, so no disconnect goes unseen.
    let monitor: MonitorStream = Box::pin(sock.monitor());
    match tokio::time::timeout(DIAL_TIMEOUT, sock.connect(endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("dial timed out".into()),
    }
    sock.subscribe(topic).await.map_err(|e| e.to_string())?;
    Ok((sock, monitor))
}

/// Runs until cancelled: dial, subscribe, resync + replay, then the live stream with sequence
/// checks. Dropping the sender on return closes the reporter's input.
pub async fn run(cfg: SubscriberConfig, tx: mpsc::Sender<Input>, cancel: CancellationToken) {
    let mut first = true;
    'outer: loop {
        let dialed = tokio::select! {
            _ = cancel.cancelled() => break,
            r = dial(&cfg.endpoint, &cfg.topic) => r,
        };
        let (mut sock, mut monitor) = match dialed {
            Ok(s) => s,
            Err(e) => {
                warn!(endpoint = %cfg.endpoint, err = %e, "engine_dial_failed");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(RETRY_DELAY) => continue,
                }
            }
        };
        info!(endpoint = %cfg.endpoint, topic = %cfg.topic, "engine_subscribed");
        let reason = if first {
            ResyncReason::Startup
        } else {
            ResyncReason::Reconnect
        };
        first = false;
        let mut session = Session::new(&cfg, &tx);
        if session.resync_and_replay(reason).await.is_err() {
            break;
        }
        let silence = tokio::time::sleep(cfg.silence_warning);
        tokio::pin!(silence);
        let mut heard = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => break 'outer,
                Some(ev) = monitor.next() => {
                    if let SocketEvent::Disconnected(_) = ev {
                        warn!(endpoint = %cfg.endpoint, "engine_connection_lost");
                        drop(sock.close().await);
                        tokio::select! {
                            _ = cancel.cancelled() => break 'outer,
                            _ = tokio::time::sleep(RETRY_DELAY) => continue 'outer,
                        }
                    }
                }
                _ = &mut silence, if !heard => {
                    heard = true;
                    warn!(
                        endpoint = %cfg.endpoint,
                        topic = %cfg.topic,
                        seconds = cfg.silence_warning.as_secs(),
                        hint = "check the engine's --kv-events-config endpoint and topic",
                        "no_events"
                    );
                }
                m = sock.recv() => match m {
                    Ok(m) => {
                        heard = true;
                        if session.on_message(&m).await.is_err() {
                            break 'outer;
                        }
                    }
                    Err(e) => {
                        warn!(endpoint = %cfg.endpoint, err = %e, "engine_receive_failed");
                        drop(sock.close().await);
                        tokio::select! {
                            _ = cancel.cancelled() => break 'outer,
                            _ = tokio::time::sleep(RETRY_DELAY) => continue 'outer,
                        }
                    }
                }
            }
        }
    }
    info!(endpoint = %cfg.endpoint, "subscriber_stopped");
}
