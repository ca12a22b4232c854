//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-<n>` (files are
//! named by index, so re-running overwrites the same files).

use std::path::PathBuf;

fn main() -> std::io::Result<()> {
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    for (target, seeds) in inferencecache_fuzz_harness::seeds::all() {
        let dir = corpus.join(target);
        std::fs::create_dir_all(&dir)?;
        for (i, seed) in seeds.iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i:02}")), seed)?;
        }
        println!("{target}: {} seeds", seeds.len());
    }
    Ok(())
}
