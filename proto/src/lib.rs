//! Generated types for the `inferencecache.v1alpha1` gRPC contract.
//!
//! The `.proto` file next to this crate (`proto/inferencecache/v1alpha1/inferencecache.proto`)
//! is the source; `build.rs` compiles it with `protox`, so building needs no system `protoc`.
//! Nothing generated is checked in, so generated code cannot drift from the proto. The wire
//! shape itself is frozen by `tests/wire_compat.rs` against `wire-baseline.txt`.

/// Messages, enums, client and server for `inferencecache.v1alpha1`.
#[allow(clippy::all, missing_docs)]
pub mod v1alpha1 {
    tonic::include_proto!("inferencecache.v1alpha1");
}

/// Encoded `FileDescriptorSet` of the contract, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    tonic::include_file_descriptor_set!("inferencecache_descriptor");

/// Fully qualified service name.
pub const SERVICE_NAME: &str = "inferencecache.v1alpha1.InferenceCache";
