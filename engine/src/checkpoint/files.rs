//! A state directory's checkpoint files.
//!
//! - `checkpoint.current`: the newest complete checkpoint;
//! - `checkpoint.previous`: the one before it, kept until a newer one is complete;
//! - `checkpoint.tmp`: a checkpoint being written (never read).
//!
//! A write goes to `checkpoint.tmp`, is fsynced, then `current` is renamed to `previous`, `tmp`
//! to `current`, and the directory is fsynced. A crash at any point leaves at least one complete
//! checkpoint among `current` and `previous` (between the two renames, only `previous`), and a
//! restore tries `current`, then `previous`, refusing any that does not check.

use super::format::FormatError;
use super::read::{RestoreReport, check, restore};
use super::write::{WriteOptions, WriteReport, write_checkpoint};
use crate::Index;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// File name of the newest checkpoint.
pub const CURRENT: &str = "checkpoint.current";
/// File name of the previous checkpoint.
pub const PREVIOUS: &str = "checkpoint.previous";
/// File name of a checkpoint being written.
pub const TEMPORARY: &str = "checkpoint.tmp";

/// Why a checkpoint file could not be used.
#[derive(Debug)]
pub struct Refused {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub reason: FormatError,
}

/// Result of [`restore_newest`].
#[derive(Debug, Default)]
pub struct DirRestore {
    /// The file restored and what it held; `None` if nothing was restored.
    pub restored: Option<(PathBuf, RestoreReport)>,
    /// Files found and refused, in the order tried.
    pub refused: Vec<Refused>,
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes a checkpoint of `index` into `dir` (created if missing) and rotates it in.
pub fn write_to_dir(index: &Index, dir: &Path, opts: &WriteOptions<'_>) -> io::Result<WriteReport> {
    fs::create_dir_all(dir)?;
    let tmp = dir.join(TEMPORARY);
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)?;
    let written = (|| {
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let report = write_checkpoint(index, &mut w, opts)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok::<_, io::Error>(report)
    })();
    let report = match written {
        Ok(r) => r,
        Err(e) => {
            // A failed write (disk full, I/O error) leaves the complete checkpoints alone.
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
    };
    let current = dir.join(CURRENT);
    if current.exists() {
        fs::rename(&current, dir.join(PREVIOUS))?;
    }
    fs::rename(&tmp, &current)?;
    sync_dir(dir)?;
    Ok(report)
}

/// Checks every checkpoint in `dir` without loading it: `(file, report or reason)`.
pub fn check_dir(dir: &Path) -> Vec<(PathBuf, Result<RestoreReport, FormatError>)> {
    [CURRENT, PREVIOUS]
        .iter()
        .map(|n| dir.join(n))
        .filter(|p| p.exists())
        .map(|p| {
            let r = File::open(&p).map_err(FormatError::from).and_then(check);
            (p, r)
        })
        .collect()
}

/// Restores the newest checkpoint of `dir` that checks into `index` (which should be empty):
/// `current` first, then `previous`. Missing files are not refusals; an unreadable directory
/// is reported as a refusal of `current`.
pub fn restore_newest(index: &Index, dir: &Path) -> DirRestore {
    let mut out = DirRestore::default();
    for name in [CURRENT, PREVIOUS] {
        let path = dir.join(name);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                out.refused.push(Refused {
                    path,
                    reason: FormatError::Io(e),
                });
                continue;
            }
        };
        match restore(index, file) {
            Ok(report) => {
                out.restored = Some((path, report));
                return out;
            }
            Err(reason) => out.refused.push(Refused { path, reason }),
        }
    }
    out
}

/// Flushes a writer and syncs the file under it (for callers that write checkpoints to files
/// of their own).
pub fn sync_file(mut w: BufWriter<File>) -> io::Result<()> {
    w.flush()?;
    w.into_inner().map_err(|e| e.into_error())?.sync_all()
}
