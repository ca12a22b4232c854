//! The gRPC room: the `InferenceCache` service.

pub mod service;
