//! The endpoint picker: the server as a Gateway API Inference Extension endpoint picker (EPP,
//! protocol 004) behind Envoy's `ext_proc` filter (docs/epp.md).
//!
//! Off unless `--epp-bind-address` is given. For every HTTP request the gateway streams its
//! headers and body here; the picker reads the OpenAI body, tokenizes the prompt with the
//! model's tokenizer, asks the index through the same in-process path `LookupRoute` takes
//! ([`crate::lookup::handle`], no network hop), weighs the matches against load
//! ([`pick`]), and answers with the ordered endpoint list in the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata.
//!
//! Rooms: [`body`] (OpenAI parsing), [`pick`] (the formula, pure), [`ext_proc`] (the gRPC
//! stream), [`listen`] (the listener and the endpoints file's reloader), this module (settings,
//! the decision). The replica → `ip:port` registry is [`crate::endpoints`] and the picker's
//! counters are [`crate::metrics::epp`]: the server's state holds both whether or not the
//! picker runs. Invariants:
//! - a pick never fails for lack of a cache hit: no hint means a pick by load;
//! - a stream always ends (the gateway's close, a decode error or our answer), and whatever
//!   ends it releases the in-flight unit the pick took;
//! - no input panics: every bad body has a documented outcome (pick by load, or 400).

pub mod body;
pub mod ext_proc;
pub mod listen;
pub mod pick;

use crate::endpoints::{InFlight, Registry};
pub use crate::metrics::epp::{EppMetrics, PickReason};
use crate::state::AppState;
use anyhow::{Context, bail};
use inferencecache_proto::v1alpha1 as pb;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Header naming the destination endpoints (and the `envoy.lb` metadata key), per protocol 004.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// Dynamic-metadata namespace the gateway's load balancer reads.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// Metadata namespace carrying the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// Key of the subset hint (metadata key, or request header of the same name).
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// Response header in which the gateway reports the endpoint that served.
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Request header naming the tenant (else `--epp-tenant`).
pub const TENANT_HEADER: &str = "x-inferencecache-tenant";
/// Request header naming the LoRA adapter (else none).
pub const ADAPTER_HEADER: &str = "x-inferencecache-adapter";

/// Default body limit of `--epp-max-body-bytes` (defined with the flag, so the
/// configuration does not import the picker).
pub use crate::config::DEFAULT_EPP_MAX_BODY_BYTES as DEFAULT_MAX_BODY_BYTES;
/// How often the endpoints file's modification time and size are checked.
pub const ENDPOINTS_FILE_PERIOD: Duration = Duration::from_secs(2);
/// Prompts up to this many bytes of text are tokenized on the request's own task; longer ones
/// go to the blocking pool (bounded like `LookupRoute`'s, with [`TOKENIZE_TIMEOUT`]).
pub const INLINE_TOKENIZE_BYTES: usize = 4 * 1024;
/// What one chat message adds to the rendered prompt besides its role and content, for
/// [`INLINE_TOKENIZE_BYTES`] (ChatML's `<|im_start|>…<|im_end|>\n` is 24 bytes).
const MESSAGE_FRAMING_BYTES: usize = 32;
/// How long tokenizing one request may take before the pick goes by load.
pub const TOKENIZE_TIMEOUT: Duration = Duration::from_millis(500);

/// Validated picker settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub bind: SocketAddr,
    pub endpoints_file: Option<PathBuf>,
    pub tenant: String,
    /// Hash scheme of the lookups (what the sidecars report under).
    pub hash_scheme: String,
    pub max_body_bytes: usize,
    pub weights: pick::Weights,
    /// Every candidate at this many in flight: 429 (0: never shed).
    pub shed_in_flight: u32,
    /// Endpoints in the answer's list at most.
    pub max_endpoints: usize,
}

impl Settings {
    /// The picker's settings, or `None` when `--epp-bind-address` is not given.
    pub fn from_cli(cli: &crate::config::Cli) -> anyhow::Result<Option<Self>> {
        let Some(bind) = cli.epp_bind_address.as_deref() else {
            return Ok(None);
        };
        let bind = crate::config::parse_bind(bind, false).context("invalid --epp-bind-address")?;
        if !(cli.epp_load_weight.is_finite() && cli.epp_load_weight >= 0.0) {
            bail!("--epp-load-weight must be a finite number ≥ 0");
        }
        if !(cli.epp_inflight_capacity.is_finite() && cli.epp_inflight_capacity > 0.0) {
            bail!("--epp-inflight-capacity must be a finite number > 0");
        }
        if cli.epp_max_endpoints == 0 {
            bail!("--epp-max-endpoints must be at least 1");
        }
        if cli.epp_max_body_bytes == 0 {
            bail!("--epp-max-body-bytes must be at least 1");
        }
        let endpoints_file = cli.epp_endpoints_file.as_ref().map(PathBuf::from);
        if let Some(path) = &endpoints_file {
            crate::endpoints::load_file(path).context("invalid --epp-endpoints-file")?;
        }
        Ok(Some(Self {
            bind,
            endpoints_file,
            tenant: cli.epp_tenant.clone(),
            hash_scheme: cli.epp_hash_scheme.clone(),
            max_body_bytes: usize::try_from(cli.epp_max_body_bytes).unwrap_or(usize::MAX),
            weights: pick::Weights {
                load_weight: cli.epp_load_weight,
                inflight_capacity: cli.epp_inflight_capacity,
            },
            shed_in_flight: cli.epp_shed_in_flight,
            max_endpoints: usize::try_from(cli.epp_max_endpoints).unwrap_or(usize::MAX),
        }))
    }
}

/// What the picker answers for one request.
#[derive(Debug)]
pub enum Decision {
    /// Route to the first endpoint; the rest are fallbacks in order.
    Route {
        endpoints: Vec<String>,
        reason: PickReason,
        /// The first endpoint's in-flight unit (released when the stream ends).
        in_flight: InFlight,
    },
    /// Answer the client directly.
    Reject {
        status: u16,
        reason: PickReason,
        message: String,
    },
}

/// What the gateway told us besides the body.
#[derive(Debug, Clone, Default)]
pub struct RequestContext {
    pub path: String,
    pub tenant: Option<String>,
    pub adapter: String,
    /// Endpoints the gateway allows (empty: any).
    pub subset: Vec<String>,
}

/// The picker: settings plus the shared server state.
pub struct Picker {
    state: AppState,
    settings: Settings,
    rotation: AtomicU64,
}

impl Picker {
    pub fn new(state: AppState, settings: Settings) -> Self {
        Self {
            state,
            settings,
            rotation: AtomicU64::new(0),
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    fn registry(&self) -> &Arc<Registry> {
        self.state.endpoints()
    }

    fn metrics(&self) -> &EppMetrics {
        self.state.epp_metrics()
    }

    /// Decides for one request. `body` is `None` when it went over the body limit (or the
    /// stream ended early): the pick then goes by load over every endpoint known.
    pub async fn decide(&self, context: &RequestContext, body: Option<&[u8]>) -> Decision {
        let start = Instant::now();
        let decision = self.decide_inner(context, body).await;
        let (reason, length) = match &decision {
            Decision::Route {
                endpoints, reason, ..
            } => (*reason, endpoints.len()),
            Decision::Reject { reason, .. } => (*reason, 0),
        };
        self.metrics().pick(reason, length, start.elapsed());
        decision
    }

    async fn decide_inner(&self, context: &RequestContext, body: Option<&[u8]>) -> Decision {
        let tenant = context
            .tenant
            .clone()
            .unwrap_or_else(|| self.settings.tenant.clone());
        let chat = context.path.contains("/chat/completions");
        let parsed = match body {
            None => {
                self.metrics().body_failure("too_large");
                None
            }
            Some([]) => None,
            Some(bytes) => match body::parse(bytes, chat) {
                Ok(parsed) => Some(parsed),
                Err(body::BodyError::NotJson(err)) => {
                    self.metrics().body_failure("not_json");
                    return Decision::Reject {
                        status: 400,
                        reason: PickReason::BadRequest,
                        message: format!("request body is not a JSON object: {err}"),
                    };
                }
                Err(err) => {
                    self.metrics().body_failure(err.label());
                    // The model is still worth knowing: it narrows the candidates.
                    model_only(bytes).map(|model| body::OpenAiRequest {
                        model,
                        prompt: body::Prompt::Text(String::new()),
                        stream: false,
                    })
                }
            },
        };
        let model = parsed.as_ref().map(|p| p.model.clone()).unwrap_or_default();
        let tokens = match &parsed {
            Some(request) => self.tokenize(request).await,
            None => Vec::new(),
        };
        let prompt_tokens = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
        let scores = if tokens.is_empty() {
            Vec::new()
        } else {
            let request = pb::LookupRouteRequest {
                model_id: model.clone(),
                tenant_id: tenant.clone(),
                token_ids: tokens,
                adapter_id: context.adapter.clone(),
                hash_scheme: self.settings.hash_scheme.clone(),
                ..Default::default()
            };
            // The same in-process path as LookupRoute (H1–H13), no network hop.
            crate::lookup::handle(&self.state, &tonic::metadata::MetadataMap::new(), &request)
                .await
                .replica_scores
        };
        let candidates = self.candidates(&tenant, &model, &scores, &context.subset);
        if candidates.is_empty() {
            return Decision::Reject {
                status: 503,
                reason: PickReason::NoEndpoint,
                message: format!("no endpoint serves model {model:?}"),
            };
        }
        if self.settings.shed_in_flight > 0
            && candidates
                .iter()
                .all(|c| c.in_flight >= self.settings.shed_in_flight)
        {
            return Decision::Reject {
                status: 429,
                reason: PickReason::Shed,
                message: "every endpoint is at its in-flight limit".to_owned(),
            };
        }
        let rotation = self.rotation.fetch_add(1, Ordering::Relaxed);
        let ranked = pick::rank(candidates, prompt_tokens, self.settings.weights, rotation);
        let mut endpoints: Vec<String> = ranked.order.into_iter().map(|c| c.endpoint).collect();
        endpoints.truncate(self.settings.max_endpoints);
        let in_flight = InFlight::acquire(self.registry(), &endpoints[0]);
        Decision::Route {
            endpoints,
            reason: if ranked.prefix_hit {
                PickReason::Prefix
            } else {
                PickReason::Load
            },
            in_flight,
        }
    }

    /// The prompt's tokens, or none when the tokenizer is absent, does not know the model,
    /// fails, is saturated or is too slow (the pick then goes by load).
    async fn tokenize(&self, request: &body::OpenAiRequest) -> Vec<u32> {
        let Some(tokenizer) = self.state.tokenizer().cloned() else {
            return Vec::new();
        };
        // What the template renders: each message's text plus its framing (a body of many
        // empty messages is long work too, so each counts at least MESSAGE_FRAMING_BYTES).
        let prompt_bytes = match &request.prompt {
            body::Prompt::Messages(messages) => messages
                .iter()
                .map(|m| m.content.len() + m.role.len() + MESSAGE_FRAMING_BYTES)
                .sum(),
            body::Prompt::Text(text) => text.len(),
        };
        let deadline = Instant::now() + TOKENIZE_TIMEOUT;
        let tokens = if prompt_bytes <= INLINE_TOKENIZE_BYTES {
            // A short prompt (about a thousand tokens at most) renders and encodes in well
            // under a millisecond, not much more than handing it to the blocking pool and back
            // (two thread wake-ups, each a scheduling delay on a busy host): it runs here.
            encode(
                tokenizer.as_ref(),
                &request.model,
                &request.prompt,
                deadline,
            )
        } else {
            let Ok(permit) = self.state.tokenizer_slots().clone().try_acquire_owned() else {
                self.metrics().body_failure("tokenizer");
                return Vec::new();
            };
            let (model, prompt) = (request.model.clone(), request.prompt.clone());
            let work = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                encode(tokenizer.as_ref(), &model, &prompt, deadline)
            });
            match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), work).await {
                Ok(Ok(result)) => result,
                _ => Err(inferencecache_tokenize::TokenizeError::DeadlineExceeded),
            }
        };
        match tokens {
            Ok(tokens) if tokens.len() <= crate::lookup::MAX_LOOKUP_TOKENS => tokens,
            _ => {
                self.metrics().body_failure("tokenizer");
                Vec::new()
            }
        }
    }

    /// The endpoints this request may go to, with what the pick weighs. Replicas come from the
    /// index's live replicas of `(tenant, model)` (their stats carry the engine's pressure),
    /// the replicas that matched, and the endpoints file; without a model, every endpoint
    /// known.
    fn candidates(
        &self,
        tenant: &str,
        model: &str,
        scores: &[pb::ReplicaScore],
        subset: &[String],
    ) -> Vec<pick::Candidate> {
        let registry = self.registry();
        let mut replicas: Vec<(String, f32)> = Vec::new();
        if model.is_empty() {
            replicas.extend(registry.all_replicas().into_iter().map(|r| (r, 0.0)));
        } else {
            let state = self.state.index().cache_state(tenant, model);
            replicas.extend(
                state
                    .replicas
                    .into_iter()
                    .map(|r| (r.replica_id.to_string(), r.pressure)),
            );
            for (replica, _) in registry.file_replicas(model) {
                replicas.push((replica, 0.0));
            }
        }
        for score in scores {
            replicas.push((score.replica_id.clone(), 0.0));
        }
        let mut by_endpoint: std::collections::BTreeMap<String, pick::Candidate> =
            std::collections::BTreeMap::new();
        for (replica, pressure) in replicas {
            let Some(endpoint) = registry.endpoint_of(&replica) else {
                continue;
            };
            if !subset.is_empty() && !subset.contains(&endpoint) {
                continue;
            }
            let matched = scores
                .iter()
                .filter(|s| s.replica_id == replica)
                .map(|s| u32::try_from(s.matched_tokens).unwrap_or(0))
                .max()
                .unwrap_or(0);
            let in_flight = registry.in_flight(&endpoint).load(Ordering::Relaxed);
            let entry = by_endpoint
                .entry(endpoint.clone())
                .or_insert(pick::Candidate {
                    endpoint,
                    matched_tokens: 0,
                    pressure: 0.0,
                    in_flight,
                });
            entry.matched_tokens = entry.matched_tokens.max(matched);
            if pressure.is_finite() {
                entry.pressure = entry.pressure.max(pressure);
            }
        }
        by_endpoint.into_values().collect()
    }
}

/// Renders and encodes a prompt (messages through the model's chat template).
fn encode(
    tokenizer: &dyn inferencecache_tokenize::PromptTokenizer,
    model: &str,
    prompt: &body::Prompt,
    deadline: Instant,
) -> Result<Vec<u32>, inferencecache_tokenize::TokenizeError> {
    match prompt {
        body::Prompt::Messages(messages) => {
            tokenizer.encode_messages_until(model, messages, deadline)
        }
        body::Prompt::Text(text) if text.is_empty() => Ok(Vec::new()),
        body::Prompt::Text(text) => tokenizer.encode_text_until(model, text, deadline),
    }
}

/// The `model` of a body that is JSON but gave no prompt.
fn model_only(bytes: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    Some(value.get("model")?.as_str()?.to_owned())
}
