//! `envoy.service.ext_proc.v3.ExternalProcessor` for the picker: one gRPC stream per HTTP
//! request, handled as protocol 004 describes.
//!
//! Request side, by the body mode Envoy announces in `protocol_config`:
//! - `FULL_DUPLEX_STREAMED` (recommended): headers are held unanswered while body chunks
//!   arrive; at the end of the body the picker answers the headers (destination header and
//!   metadata), then returns the body unchanged. A body past `--epp-max-body-bytes` is decided
//!   by load at that point and the rest of it streams through.
//! - `BUFFERED` / `BUFFERED_PARTIAL`: the headers are answered at once, the decision rides on
//!   the body's answer (a header mutation plus the metadata).
//! - `NONE` / `STREAMED`, or a request without a body: decided by load at the headers.
//!
//! Response side: `x-gateway-destination-endpoint-served` is read from the response headers;
//! a `FULL_DUPLEX_STREAMED` response body is passed back chunk by chunk as it comes, other
//! modes are answered with "continue". Invariant: every message Envoy expects an answer to
//! gets exactly one, in order, and the exchange ends when either side closes; whatever ends it
//! (including the gateway's reset, which drops it) releases its in-flight unit.

use super::{
    ADAPTER_HEADER, DESTINATION_HEADER, Decision, LB_NAMESPACE, Picker, RequestContext,
    SERVED_HEADER, SUBSET_KEY, SUBSET_NAMESPACE, TENANT_HEADER,
};
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// The gRPC service.
pub struct Processor {
    picker: Arc<Picker>,
}

#[tonic::async_trait]
impl ExternalProcessor for Processor {
    type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        // The exchange runs inside the response stream, polled by the task that already
        // serves this HTTP/2 stream: no task and no channel of our own per request, so a
        // message's answer is written without one more cross-task wake-up (a scheduling delay
        // on a loaded host). Dropping the stream (the gateway's reset) drops the exchange.
        let exchange = Exchange::new(self.picker.clone(), request.into_inner());
        let responses = futures_util::stream::unfold(exchange, |mut exchange| async move {
            let response = exchange.next_response().await?;
            Some((Ok(response), exchange))
        });
        Ok(Response::new(Box::pin(responses)))
    }
}

/// Serves ext_proc and the health services (`liveness`, `readiness` and the ext_proc service
/// name) on `listener` until the task is dropped.
pub async fn serve(picker: Arc<Picker>, listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    let serving = tonic_health::ServingStatus::Serving;
    reporter.set_service_status("liveness", serving).await;
    reporter
        .set_service_status(
            <ExternalProcessorServer<Processor> as tonic::server::NamedService>::NAME,
            serving,
        )
        .await;
    // `readiness` follows the server's: not while a warm restart or the replication backlog
    // loads, nor while draining (picks meanwhile go by load).
    let mut readiness = picker.state().core().readiness();
    tokio::spawn(async move {
        loop {
            let status = if *readiness.borrow_and_update() {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status("readiness", status).await;
            reporter.set_service_status("", status).await;
            if readiness.changed().await.is_err() {
                break;
            }
        }
    });
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(ExternalProcessorServer::new(Processor { picker }))
        // TCP_NODELAY: each answer is a small HTTP/2 frame written as soon as it is ready;
        // with Nagle's algorithm a write behind an unacknowledged one waits for the gateway's
        // delayed ACK (up to 40 ms on Linux).
        .serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        )
        .await?;
    Ok(())
}

/// One HTTP request's processing.
struct Exchange {
    picker: Arc<Picker>,
    inbound: Streaming<ProcessingRequest>,
    /// Answers not yet handed to the gateway, in order (a message can need two: the held
    /// headers' answer, then the body's).
    outbox: VecDeque<ProcessingResponse>,
    /// No more messages are read: the gateway closed its side, or an immediate response
    /// ended the request.
    closed: bool,
    context: RequestContext,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    body: Vec<u8>,
    /// The request headers are answered (so the body may stream through).
    headers_answered: bool,
    /// The endpoint list of the decision, once made.
    picked: Option<Vec<String>>,
    /// The first endpoint's in-flight unit, released when the exchange ends.
    in_flight: Option<crate::endpoints::InFlight>,
}

/// Why the exchange stopped early.
enum Stop {
    /// The gateway went away (or an immediate response ended the request).
    Closed,
}

impl Drop for Exchange {
    fn drop(&mut self) {
        if self.picked.is_none() && !self.body.is_empty() {
            // The gateway closed (or reset) the stream before the body ended: nothing was
            // decided.
            self.picker.metrics().body_failure("stream_closed");
        }
    }
}

impl Exchange {
    fn new(picker: Arc<Picker>, inbound: Streaming<ProcessingRequest>) -> Self {
        Self {
            picker,
            inbound,
            outbox: VecDeque::with_capacity(2),
            closed: false,
            context: RequestContext::default(),
            request_mode: BodySendMode::None,
            response_mode: BodySendMode::None,
            body: Vec::new(),
            headers_answered: false,
            picked: None,
            in_flight: None,
        }
    }

    /// The next answer for the gateway, reading and handling its messages until there is one;
    /// `None` once the exchange is over (everything answered and the gateway's side closed,
    /// or an immediate response sent).
    async fn next_response(&mut self) -> Option<ProcessingResponse> {
        loop {
            if let Some(response) = self.outbox.pop_front() {
                return Some(response);
            }
            if self.closed {
                return None;
            }
            match self.inbound.message().await {
                Ok(Some(message)) => {
                    if self.handle(message).await.is_err() {
                        self.closed = true;
                    }
                }
                Ok(None) => self.closed = true,
                Err(status) => {
                    tracing::debug!(code = ?status.code(), "epp_stream_closed");
                    self.closed = true;
                }
            }
        }
    }

    async fn handle(&mut self, message: ProcessingRequest) -> Result<(), Stop> {
        if let Some(config) = &message.protocol_config {
            self.request_mode =
                BodySendMode::try_from(config.request_body_mode).unwrap_or(BodySendMode::None);
            self.response_mode =
                BodySendMode::try_from(config.response_body_mode).unwrap_or(BodySendMode::None);
        }
        let Some(request) = message.request else {
            return Ok(());
        };
        match request {
            processing_request::Request::RequestHeaders(headers) => {
                self.context = context_of(&headers, message.metadata_context.as_ref());
                if headers.end_of_stream {
                    return self.decide_and_answer_headers(Some(&[])).await;
                }
                match self.request_mode {
                    BodySendMode::FullDuplexStreamed => Ok(()),
                    BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                        self.headers_answered = true;
                        self.send(processing_response::Response::RequestHeaders(
                            HeadersResponse::default(),
                        ))
                        .await
                    }
                    BodySendMode::None | BodySendMode::Streamed | BodySendMode::Grpc => {
                        self.decide_and_answer_headers(None).await
                    }
                }
            }
            processing_request::Request::RequestBody(body) => self.request_body(body).await,
            processing_request::Request::RequestTrailers(_) => {
                if self.request_mode == BodySendMode::FullDuplexStreamed && !self.headers_answered {
                    let body = std::mem::take(&mut self.body);
                    self.decide_and_answer_headers(Some(&body)).await?;
                }
                self.send(processing_response::Response::RequestTrailers(
                    TrailersResponse::default(),
                ))
                .await
            }
            processing_request::Request::ResponseHeaders(headers) => {
                if let (Some(picked), Some(served)) =
                    (&self.picked, header(&headers, SERVED_HEADER))
                {
                    self.picker.metrics().served(picked, &served);
                }
                self.send(processing_response::Response::ResponseHeaders(
                    HeadersResponse::default(),
                ))
                .await
            }
            processing_request::Request::ResponseBody(body) => {
                if self.response_mode == BodySendMode::FullDuplexStreamed {
                    self.send(processing_response::Response::ResponseBody(streamed(
                        body.body,
                        body.end_of_stream,
                    )))
                    .await
                } else {
                    self.send(processing_response::Response::ResponseBody(
                        BodyResponse::default(),
                    ))
                    .await
                }
            }
            processing_request::Request::ResponseTrailers(_) => {
                self.send(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                ))
                .await
            }
        }
    }

    async fn request_body(
        &mut self,
        body: envoy_types::pb::envoy::service::ext_proc::v3::HttpBody,
    ) -> Result<(), Stop> {
        let limit = self.picker.settings().max_body_bytes;
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => {
                if self.headers_answered {
                    // Decided already (an oversized body): the rest streams through.
                    return self
                        .send(processing_response::Response::RequestBody(streamed(
                            body.body,
                            body.end_of_stream,
                        )))
                        .await;
                }
                self.body.extend_from_slice(&body.body);
                if self.body.len() > limit {
                    let held = std::mem::take(&mut self.body);
                    self.decide_and_answer_headers(None).await?;
                    return self
                        .send(processing_response::Response::RequestBody(streamed(
                            held,
                            body.end_of_stream,
                        )))
                        .await;
                }
                if body.end_of_stream {
                    // Decided on the held body, which then goes back unchanged (no copy).
                    let held = std::mem::take(&mut self.body);
                    self.decide_and_answer_headers(Some(&held)).await?;
                    return self
                        .send(processing_response::Response::RequestBody(streamed(
                            held, true,
                        )))
                        .await;
                }
                Ok(())
            }
            BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                let bytes = (body.body.len() <= limit).then_some(body.body);
                let decision = self.picker.decide(&self.context, bytes.as_deref()).await;
                self.answer(decision, |response| {
                    processing_response::Response::RequestBody(BodyResponse {
                        response: Some(response),
                    })
                })
                .await
            }
            BodySendMode::None | BodySendMode::Streamed | BodySendMode::Grpc => {
                self.send(processing_response::Response::RequestBody(
                    BodyResponse::default(),
                ))
                .await
            }
        }
    }

    /// Decides (`body` `None`: by load, the body being unusable) and answers the request
    /// headers, or ends the request with an immediate response.
    async fn decide_and_answer_headers(&mut self, body: Option<&[u8]>) -> Result<(), Stop> {
        let decision = self.picker.decide(&self.context, body).await;
        self.answer(decision, |response| {
            processing_response::Response::RequestHeaders(HeadersResponse {
                response: Some(response),
            })
        })
        .await?;
        // Reached only when routed: a rejection ended the request (`Stop::Closed`).
        self.headers_answered = true;
        Ok(())
    }

    /// Answers the phase (`phase` wraps the common response) with a decision's header mutation
    /// and metadata, or ends the request with its immediate response.
    async fn answer(
        &mut self,
        decision: Decision,
        phase: fn(CommonResponse) -> processing_response::Response,
    ) -> Result<(), Stop> {
        match self.route(decision) {
            Ok((mutation, metadata)) => {
                let response = phase(CommonResponse {
                    header_mutation: Some(mutation),
                    ..Default::default()
                });
                self.send_with_metadata(response, Some(metadata)).await
            }
            Err(immediate) => self.reject(immediate).await,
        }
    }

    /// A route decision as its header mutation and metadata; a rejection as its immediate
    /// response.
    fn route(&mut self, decision: Decision) -> Result<(HeaderMutation, Struct), ImmediateResponse> {
        match decision {
            Decision::Route {
                endpoints,
                in_flight,
                ..
            } => {
                let list = endpoints.join(",");
                self.picked = Some(endpoints);
                self.in_flight = Some(in_flight);
                Ok((
                    HeaderMutation {
                        set_headers: vec![HeaderValueOption {
                            header: Some(HeaderValue {
                                key: DESTINATION_HEADER.to_owned(),
                                raw_value: list.clone().into_bytes(),
                                ..Default::default()
                            }),
                            append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
                            ..Default::default()
                        }],
                        remove_headers: Vec::new(),
                    },
                    destination_metadata(&list),
                ))
            }
            Decision::Reject {
                status, message, ..
            } => Err(ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                body: format!(
                    "{{\"error\":{{\"message\":{},\"code\":{status}}}}}",
                    json_string(&message)
                )
                .into_bytes(),
                details: format!("inferencecache_epp_{status}"),
                ..Default::default()
            }),
        }
    }

    async fn reject(&mut self, immediate: ImmediateResponse) -> Result<(), Stop> {
        self.send(processing_response::Response::ImmediateResponse(immediate))
            .await?;
        // The request ends here; Envoy closes the stream.
        Err(Stop::Closed)
    }

    async fn send(&mut self, response: processing_response::Response) -> Result<(), Stop> {
        self.send_with_metadata(response, None).await
    }

    async fn send_with_metadata(
        &mut self,
        response: processing_response::Response,
        metadata: Option<Struct>,
    ) -> Result<(), Stop> {
        self.outbox.push_back(ProcessingResponse {
            response: Some(response),
            dynamic_metadata: metadata,
            ..Default::default()
        });
        Ok(())
    }
}

/// A full-duplex body chunk passed back unchanged.
fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

/// `envoy.lb` → `x-gateway-destination-endpoint` = the list.
fn destination_metadata(list: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_HEADER.to_owned(),
            Value {
                kind: Some(Kind::StringValue(list.to_owned())),
            },
        )]
        .into_iter()
        .collect(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into_iter()
        .collect(),
    }
}

/// A request header's value (Envoy sends `raw_value`; older versions `value`).
fn header(headers: &HttpHeaders, name: &str) -> Option<String> {
    let map = headers.headers.as_ref()?;
    let found = map
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))?;
    if !found.raw_value.is_empty() {
        return String::from_utf8(found.raw_value.clone()).ok();
    }
    Some(found.value.clone())
}

/// The request's context: path, tenant and adapter headers, and the subset hint (metadata
/// `envoy.lb.subset_hint`, else the request header of the same key).
fn context_of(headers: &HttpHeaders, metadata: Option<&Metadata>) -> RequestContext {
    let non_empty = |v: Option<String>| v.map(|s| s.trim().to_owned()).filter(|s| !s.is_empty());
    let subset = metadata
        .and_then(|m| m.filter_metadata.get(SUBSET_NAMESPACE))
        .and_then(|s| s.fields.get(SUBSET_KEY))
        .map(subset_of_value)
        .or_else(|| header(headers, SUBSET_KEY).map(|v| split_list(&v)))
        .unwrap_or_default();
    RequestContext {
        path: header(headers, ":path").unwrap_or_default(),
        tenant: non_empty(header(headers, TENANT_HEADER)),
        adapter: non_empty(header(headers, ADAPTER_HEADER)).unwrap_or_default(),
        subset,
    }
}

/// A subset hint value: a comma-separated string or a list of strings.
fn subset_of_value(value: &Value) -> Vec<String> {
    match &value.kind {
        Some(Kind::StringValue(s)) => split_list(s),
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_owned()),
                _ => None,
            })
            .filter(|s| !s.is_empty())
            .collect(),
        _ => Vec::new(),
    }
}

fn split_list(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::google::protobuf::ListValue;

    fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: (*k).to_owned(),
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn context_reads_headers_and_prefers_metadata_subset() {
        let h = headers(&[
            (":path", "/v1/chat/completions"),
            ("X-InferenceCache-Tenant", " acme "),
            (SUBSET_KEY, "1.1.1.1:1, 2.2.2.2:2"),
        ]);
        let context = context_of(&h, None);
        assert_eq!(context.path, "/v1/chat/completions");
        assert_eq!(context.tenant.as_deref(), Some("acme"));
        assert_eq!(context.adapter, "");
        assert_eq!(context.subset, ["1.1.1.1:1", "2.2.2.2:2"]);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![Value {
                    kind: Some(Kind::StringValue("3.3.3.3:3".into())),
                }],
            })),
        };
        let metadata = Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_owned(),
                Struct {
                    fields: [(SUBSET_KEY.to_owned(), list)].into_iter().collect(),
                },
            )]
            .into_iter()
            .collect(),
            ..Default::default()
        };
        assert_eq!(context_of(&h, Some(&metadata)).subset, ["3.3.3.3:3"]);
    }

    #[test]
    fn metadata_names_the_list_under_envoy_lb() {
        let metadata = destination_metadata("1.1.1.1:1,2.2.2.2:2");
        let Some(Kind::StructValue(inner)) = &metadata.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is not a struct");
        };
        assert_eq!(
            inner.fields[DESTINATION_HEADER].kind,
            Some(Kind::StringValue("1.1.1.1:1,2.2.2.2:2".into()))
        );
    }
}
