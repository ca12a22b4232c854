//! Compiles the wire contract with `protox` (pure Rust), so no system `protoc` is needed.

use prost::Message;
use std::path::PathBuf;

const PROTO: &str = "inferencecache/v1alpha1/inferencecache.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let include = manifest_dir.clone();
    let file = manifest_dir.join(PROTO);
    println!("cargo:rerun-if-changed={}", file.display());

    let descriptors = protox::compile([&file], [&include])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("inferencecache_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
