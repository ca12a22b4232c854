//! Observer streams (spec `server.md` §8.5–§8.6, D5): `StreamCacheEvents` and `StreamMetrics`.
//!
//! The index reports applied changes to [`Broadcaster`] (its change sink) from writer threads.
//! Publishing never waits: each subscriber owns a bounded queue, and an event that does not fit
//! is dropped for that subscriber and counted. With no subscriber the index builds no event at
//! all ([`ChangeSink::is_active`] is one relaxed load).

use crate::metrics::{Family, Metrics};
use arc_swap::ArcSwap;
use inferencecache_engine::{ChangeEvent, ChangeKind, ChangeSink, Index, PROBE_TENANT};
use inferencecache_proto::v1alpha1 as pb;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::Status;

/// Default per-subscriber buffer (`streams.buffer_events`).
pub const DEFAULT_BUFFER_EVENTS: usize = 4096;
/// Default limit on concurrent observer streams (`streams.max_subscribers`, both RPCs).
pub const DEFAULT_MAX_SUBSCRIBERS: usize = 64;

/// Which events a subscriber wants.
#[derive(Debug, Clone)]
struct Filter {
    model: String,
    tenant: String,
    /// Bit `t` set = wire type `t` wanted; 0 = every type.
    types: u8,
    /// A filter naming only types outside 1–4 matches nothing.
    match_nothing: bool,
}

impl Filter {
    fn new(req: &pb::StreamEventsRequest) -> Self {
        let mut types = 0u8;
        for t in &req.types {
            if (1..=4).contains(t) {
                types |= 1 << t;
            }
        }
        Self {
            model: req.model_id.clone(),
            tenant: req.tenant_id.clone(),
            types,
            match_nothing: !req.types.is_empty() && types == 0,
        }
    }

    fn wants(&self, wire_type: i32, tenant: &str, model: &str) -> bool {
        !self.match_nothing
            && (self.types == 0 || self.types & (1 << wire_type) != 0)
            && (self.model.is_empty() || self.model == model)
            && (self.tenant.is_empty() || self.tenant == tenant)
    }
}

struct Subscriber {
    id: u64,
    filter: Filter,
    queue: mpsc::Sender<Result<pb::CacheEvent, Status>>,
}

/// Fans index changes out to `StreamCacheEvents` subscribers and owns the shared subscriber
/// limit and the shutdown signal of both observer RPCs.
pub struct Broadcaster {
    subscribers: ArcSwap<Vec<Arc<Subscriber>>>,
    event_subscribers: AtomicUsize,
    open_streams: Arc<AtomicUsize>,
    next_id: AtomicUsize,
    max_subscribers: usize,
    buffer_events: usize,
    metrics: Arc<Metrics>,
    shutdown: watch::Sender<bool>,
}

impl Broadcaster {
    pub fn new(metrics: Arc<Metrics>, buffer_events: usize, max_subscribers: usize) -> Self {
        Self {
            subscribers: ArcSwap::from_pointee(Vec::new()),
            event_subscribers: AtomicUsize::new(0),
            open_streams: Arc::new(AtomicUsize::new(0)),
            next_id: AtomicUsize::new(1),
            max_subscribers,
            buffer_events: buffer_events.max(1),
            metrics,
            shutdown: watch::channel(false).0,
        }
    }

    /// Ends every observer stream with OK (called before the graceful gRPC stop).
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    fn admit(&self) -> Result<SlotGuard, Status> {
        let mut current = self.open_streams.load(Ordering::Relaxed);
        loop {
            if current >= self.max_subscribers {
                return Err(Status::resource_exhausted("too many observer streams"));
            }
            match self.open_streams.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(SlotGuard(self.open_streams.clone())),
                Err(seen) => current = seen,
            }
        }
    }

    /// Opens a `StreamCacheEvents` subscription.
    pub fn subscribe(
        self: &Arc<Self>,
        req: &pb::StreamEventsRequest,
    ) -> Result<ObserverStream<pb::CacheEvent>, Status> {
        let slot = self.admit()?;
        let (tx, rx) = mpsc::channel(self.buffer_events);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) as u64;
        let sub = Arc::new(Subscriber {
            id,
            filter: Filter::new(req),
            queue: tx,
        });
        self.subscribers.rcu(|cur| {
            let mut next = Vec::with_capacity(cur.len() + 1);
            next.extend(cur.iter().cloned());
            next.push(sub.clone());
            next
        });
        self.event_subscribers.fetch_add(1, Ordering::Release);
        let unsubscribe = Unsubscribe {
            broadcaster: self.clone(),
            id,
        };
        Ok(ObserverStream::new(
            rx,
            self.shutdown.subscribe(),
            slot,
            Some(unsubscribe),
        ))
    }

    fn remove(&self, id: u64) {
        self.subscribers.rcu(|cur| {
            cur.iter()
                .filter(|s| s.id != id)
                .cloned()
                .collect::<Vec<_>>()
        });
        self.event_subscribers.fetch_sub(1, Ordering::Release);
    }

    /// Opens a `StreamMetrics` subscription: a first sample now, then about one per second.
    pub fn subscribe_metrics(
        self: &Arc<Self>,
        req: &pb::StreamMetricsRequest,
        index: Arc<Index>,
    ) -> Result<ObserverStream<pb::Metric>, Status> {
        let slot = self.admit()?;
        let (tx, rx) = mpsc::channel(1024);
        let names = req.names.clone();
        let metrics = self.metrics.clone();
        let mut stop = self.shutdown.subscribe();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
                let families = metrics.gather(&index);
                let ts = now_us();
                for metric in samples(&families, &names, ts) {
                    if tx.send(Ok(metric)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(ObserverStream::new(
            rx,
            self.shutdown.subscribe(),
            slot,
            None,
        ))
    }
}

/// The name prefix of the contract's metric families (server.md §11).
const CONTRACT_PREFIX: &str = "inferencecache_";

fn now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// One `Metric` per exposition sample of the requested families. With `names` empty, every
/// `inferencecache_*` family: the process collector (`process_*`, not contract) is sent only
/// when named (server.md §8.6).
pub fn samples(families: &[Family], names: &[String], timestamp_us: i64) -> Vec<pb::Metric> {
    let wanted = |f: &Family| {
        if names.is_empty() {
            return f.name.starts_with(CONTRACT_PREFIX);
        }
        names.iter().any(|n| {
            *n == f.name || n == f.declared_name() || f.samples.iter().any(|s| s.name == *n)
        })
    };
    families
        .iter()
        .filter(|f| wanted(f))
        .flat_map(|f| {
            f.samples.iter().map(move |s| pb::Metric {
                name: s.name.clone(),
                r#type: f.kind.to_string(),
                labels: s.labels.iter().cloned().collect(),
                value: s.value,
                timestamp_us,
            })
        })
        .collect()
}

impl ChangeSink for Broadcaster {
    fn is_active(&self) -> bool {
        self.event_subscribers.load(Ordering::Relaxed) > 0
    }

    fn publish(&self, event: &ChangeEvent<'_>) {
        if event.tenant_id == PROBE_TENANT {
            return;
        }
        let wire_type = match event.kind {
            ChangeKind::Added => 1,
            ChangeKind::Removed => 2,
            ChangeKind::Stats => 3,
            ChangeKind::Cleared => 4,
        };
        let subscribers = self.subscribers.load();
        let mut message: Option<pb::CacheEvent> = None;
        for sub in subscribers.iter() {
            if !sub.filter.wants(wire_type, event.tenant_id, event.model_id) {
                continue;
            }
            let msg = message
                .get_or_insert_with(|| pb::CacheEvent {
                    r#type: wire_type,
                    replica_id: event.replica_id.to_string(),
                    model_id: event.model_id.to_string(),
                    tenant_id: event.tenant_id.to_string(),
                    prefix_hash: event.prefix_hash.to_vec(),
                    timestamp_us: event.timestamp_us,
                    adapter_id: event.adapter_id.to_string(),
                })
                .clone();
            // Never wait on a subscriber: a full queue drops the event for it alone.
            if let Err(mpsc::error::TrySendError::Full(_)) = sub.queue.try_send(Ok(msg)) {
                self.metrics
                    .stream_events_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Releases one observer-stream slot when the stream is dropped.
pub struct SlotGuard(Arc<AtomicUsize>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Unsubscribe {
    broadcaster: Arc<Broadcaster>,
    id: u64,
}

impl Drop for Unsubscribe {
    fn drop(&mut self) {
        self.broadcaster.remove(self.id);
    }
}

/// A server stream that ends (OK) at shutdown and releases its slot when dropped.
pub struct ObserverStream<T> {
    rx: mpsc::Receiver<Result<T, Status>>,
    stop: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    stopped: bool,
    _slot: SlotGuard,
    _unsubscribe: Option<Unsubscribe>,
}

impl<T> ObserverStream<T> {
    fn new(
        rx: mpsc::Receiver<Result<T, Status>>,
        mut stop: watch::Receiver<bool>,
        slot: SlotGuard,
        unsubscribe: Option<Unsubscribe>,
    ) -> Self {
        let stop = Box::pin(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        Self {
            rx,
            stop,
            stopped: false,
            _slot: slot,
            _unsubscribe: unsubscribe,
        }
    }
}

impl<T> Stream for ObserverStream<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.stopped || self.stop.as_mut().poll(cx).is_ready() {
            self.stopped = true;
            return Poll::Ready(None);
        }
        self.rx.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters() {
        let f = Filter::new(&pb::StreamEventsRequest {
            model_id: "m".into(),
            tenant_id: String::new(),
            types: vec![2, 4],
        });
        assert!(f.wants(2, "t", "m"));
        assert!(!f.wants(1, "t", "m"));
        assert!(!f.wants(2, "t", "other"));
        let none = Filter::new(&pb::StreamEventsRequest {
            types: vec![0, 9],
            ..Default::default()
        });
        assert!(!none.wants(1, "t", "m"));
        let all = Filter::new(&pb::StreamEventsRequest::default());
        assert!(all.wants(3, "any", "thing"));
    }
}
