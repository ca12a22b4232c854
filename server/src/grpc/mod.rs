//! The gRPC room: the `InferenceCache` service ([`service`]), how it is served ([`serve`]:
//! health, reflection, TLS, the connection gate) and the HTTP/2 windows that keep backpressure
//! from costing a producer its connection ([`flow`]).

pub mod flow;
pub mod serve;
pub mod service;

pub use serve::serve_grpc;
pub use service::CacheService;

/// Largest request message accepted by default (contract §5: larger → RESOURCE_EXHAUSTED);
/// `--max-message-bytes` changes it.
pub const MAX_MESSAGE_BYTES: usize = crate::limits::DEFAULT_MAX_MESSAGE_BYTES as usize;
