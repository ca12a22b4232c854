#![no_main]
//! cargo-fuzz target; the body and its checks are in `inferencecache_fuzz_harness::checkpoint_file`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| inferencecache_fuzz_harness::checkpoint_file(data));
