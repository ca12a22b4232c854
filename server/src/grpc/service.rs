//! The gRPC service: translates `inferencecache.v1alpha1.InferenceCache` calls into engine calls.
//!
//! Consumer RPCs never turn request content into an error (contract §5): every outcome is an OK
//! response with a reason code.

use crate::lookup;
use crate::state::AppState;
use crate::streams::ObserverStream;
use crate::translate::{Reason, apply_event};
use inferencecache_engine::PROBE_TENANT;
use inferencecache_proto::v1alpha1 as pb;
use inferencecache_proto::v1alpha1::inference_cache_server::InferenceCache;
use tonic::{Request, Response, Status, Streaming};

/// The `InferenceCache` service implementation.
#[derive(Clone)]
pub struct CacheService {
    state: AppState,
}

impl CacheService {
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl InferenceCache for CacheService {
    async fn render_template(
        &self,
        _request: Request<pb::RenderTemplateRequest>,
    ) -> Result<Response<pb::RenderTemplateResponse>, Status> {
        Ok(Response::new(pb::RenderTemplateResponse {
            reason_code: Reason::OK.into(),
            ..Default::default()
        }))
    }

    async fn lookup_route(
        &self,
        request: Request<pb::LookupRouteRequest>,
    ) -> Result<Response<pb::LookupRouteResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        Ok(Response::new(
            lookup::handle(&self.state, &metadata, &message).await,
        ))
    }

    async fn lookup_pd_route(
        &self,
        _request: Request<pb::LookupPdRouteRequest>,
    ) -> Result<Response<pb::LookupPdRouteResponse>, Status> {
        Ok(Response::new(pb::LookupPdRouteResponse {
            reason_code: Reason::NoHint.code().into(),
            ..Default::default()
        }))
    }

    async fn get_cache_state(
        &self,
        request: Request<pb::GetCacheStateRequest>,
    ) -> Result<Response<pb::GetCacheStateResponse>, Status> {
        let req = request.into_inner();
        // §8.1: the reserved tenant gets an empty answer; summary is always present.
        if req.tenant_id == PROBE_TENANT {
            return Ok(Response::new(pb::GetCacheStateResponse {
                replicas: Vec::new(),
                summary: Some(pb::CacheSummary::default()),
                server_instance_id: self.state.instance_id().to_string(),
                replica_digest: None,
            }));
        }
        let state = self
            .state
            .index()
            .cache_state(&req.tenant_id, &req.model_id);
        // A producer's anti-entropy question: the digest of its replica's entries. Asked while
        // a warm restart loads, it waits for the load, so it never compares a partial index.
        let replica_digest = if req.replica_id.is_empty() {
            None
        } else {
            self.state.core().wait_restored().await;
            let digest =
                self.state
                    .index()
                    .replica_digest(&req.tenant_id, &req.model_id, &req.replica_id);
            Some(pb::ReplicaDigest {
                entries: i64::try_from(digest.entries).unwrap_or(i64::MAX),
                digest: digest.hash.to_be_bytes().to_vec(),
            })
        };
        Ok(Response::new(pb::GetCacheStateResponse {
            replicas: state
                .replicas
                .into_iter()
                .map(|r| pb::ReplicaStats {
                    replica_id: r.replica_id.to_string(),
                    cache_memory_bytes: r.cache_memory_bytes,
                    hit_rate: r.hit_rate,
                    pressure: r.pressure,
                    client_version: String::new(),
                    t2_hit_tokens: r.t2_hit_tokens,
                    t2_query_tokens: r.t2_query_tokens,
                    endpoint: String::new(),
                })
                .collect(),
            summary: Some(pb::CacheSummary {
                total_prefixes: state.total_prefixes,
                hot_prefixes: state.hot_prefixes,
            }),
            server_instance_id: self.state.instance_id().to_string(),
            replica_digest,
        }))
    }

    async fn report_cache_state(
        &self,
        request: Request<Streaming<pb::CacheStateUpdate>>,
    ) -> Result<Response<pb::Ack>, Status> {
        // §9.2: producer credentials are checked before any message is read.
        if let Some(auth) = self.state.auth() {
            auth.check_producer(request.metadata())?;
        }
        let peer = request.remote_addr();
        let mut stream = request.into_inner();
        // §8.2: each message is applied as it arrives; a broken stream ends with its status and
        // everything received before stays applied. Limits cut what is over them (never an
        // error), and the rate limit delays the next read instead of dropping.
        while let Some(update) = stream.message().await? {
            self.state.ingest_limited(peer, &update).await;
        }
        Ok(Response::new(self.state.ack()))
    }

    async fn publish_event(
        &self,
        request: Request<pb::CacheEvent>,
    ) -> Result<Response<pb::Ack>, Status> {
        if let Some(auth) = self.state.auth() {
            auth.check_producer(request.metadata())?;
        }
        let peer = request.remote_addr();
        let event = request.into_inner();
        // §8.3: the reserved tenant is acknowledged and dropped.
        if event.tenant_id != PROBE_TENANT {
            self.state.charge_event(peer).await;
            if let Some(replication) = self.state.replication() {
                self.state.metrics().observe_event(event.r#type);
                let mut event = event;
                if event.timestamp_us == 0 {
                    event.timestamp_us = self.state.index().now_us();
                }
                replication.submit_event(event).await;
                return Ok(Response::new(self.state.ack()));
            }
            // A removal applied before a warm restart's load would be undone by it.
            self.state.core().wait_restored().await;
            self.state.metrics().observe_event(event.r#type);
            apply_event(self.state.index(), &event);
        }
        Ok(Response::new(self.state.ack()))
    }

    type StreamCacheEventsStream = ObserverStream<pb::CacheEvent>;

    async fn stream_cache_events(
        &self,
        request: Request<pb::StreamEventsRequest>,
    ) -> Result<Response<Self::StreamCacheEventsStream>, Status> {
        // §8.5: live changes only (no history), bounded per-subscriber queue.
        let stream = self.state.broadcaster().subscribe(request.get_ref())?;
        Ok(Response::new(stream))
    }

    type StreamMetricsStream = ObserverStream<pb::Metric>;

    async fn stream_metrics(
        &self,
        request: Request<pb::StreamMetricsRequest>,
    ) -> Result<Response<Self::StreamMetricsStream>, Status> {
        // §8.6: a sample now, then about one per second.
        let stream = self
            .state
            .broadcaster()
            .subscribe_metrics(request.get_ref(), self.state.index().clone())?;
        Ok(Response::new(stream))
    }
}
