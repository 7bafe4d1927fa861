//! Typed errors of the engine, each naming the value that was wrong and what would be right.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong setting up or driving an [`Engine`](crate::Engine).
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A configuration value is out of range; the message names it and the valid range.
    #[error("invalid engine configuration: {0}")]
    Config(String),

    /// The arena cannot be pinned under the current memlock limit.
    #[error(
        "RLIMIT_MEMLOCK is {limit} bytes but the engine must pin {needed} bytes of registered \
         buffers; raise it (e.g. `ulimit -l {fix_kib}` in the shell, `LimitMEMLOCK=` in a systemd \
         unit, or memlock in /etc/security/limits.conf), run with CAP_IPC_LOCK, or lower arena_bytes"
    )]
    MemlockTooLow {
        limit: u64,
        needed: u64,
        fix_kib: u64,
    },

    /// Mapping the arena failed.
    #[error("could not map a {bytes}-byte buffer arena: {source}")]
    ArenaMap { bytes: usize, source: io::Error },

    /// Registering the arena with io_uring failed.
    #[error(
        "io_uring refused to register the {bytes}-byte buffer arena: {source}{hint}",
        hint = if source.raw_os_error() == Some(libc::ENOMEM) {
            " (ENOMEM here usually means RLIMIT_MEMLOCK is too low: raise `ulimit -l` or lower arena_bytes)"
        } else { "" }
    )]
    RegisterBuffers { bytes: usize, source: io::Error },

    /// The ring could not be created with any flag combination tried.
    #[error("io_uring_setup failed with {entries} entries and flags [{flags}]: {source}")]
    RingSetup {
        entries: u32,
        flags: String,
        source: io::Error,
    },

    /// An IOPOLL ring was configured but the kernel refused it.
    #[error("an IOPOLL ring was configured but could not be created: {0}")]
    IopollUnavailable(io::Error),

    /// No run of free frames is long enough, and no I/O in flight could free one.
    #[error(
        "the arena has no run of {needed} free frames ({free} of {frames} free, {frame_bytes} bytes \
         each) and no I/O is in flight to free one; raise arena_bytes or drop buffers"
    )]
    ArenaExhausted {
        needed: usize,
        free: u32,
        frames: u32,
        frame_bytes: usize,
    },

    /// All registered-file slots are taken.
    #[error("all {max_files} registered-file slots are in use; raise EngineConfig::max_files")]
    FilesExhausted { max_files: u32 },

    /// All completion-sink slots are taken.
    #[error("all {0} completion-sink slots of the engine are in use")]
    SinksExhausted(usize),

    /// A buffer range does not fit the buffer.
    // The end is not computed: `start + len` may overflow (which `set_range` reports as this).
    #[error(
        "buffer range of {len} bytes at {start} does not fit the buffer's {capacity}-byte capacity"
    )]
    BufferRange {
        start: usize,
        len: usize,
        capacity: usize,
    },

    /// The engine was used from a thread other than the one that created it.
    #[error("the engine belongs to the thread that created it; it was used from another thread")]
    WrongThread,

    /// A path could not be opened or examined.
    #[error("{path}: {source}")]
    Path { path: PathBuf, source: io::Error },

    /// A path given as an NVMe passthrough device is not one.
    #[error("{path} is not an NVMe namespace passthrough device: {why}")]
    NotNvme { path: PathBuf, why: String },

    /// An NVMe controller's persistent memory region cannot be used.
    #[error("{path}: no usable NVMe persistent memory region (PMR): {why}")]
    Pmr { path: PathBuf, why: String },

    /// An io_uring or other system call failed while driving the engine.
    #[error("{op}: {source}")]
    Sys { op: &'static str, source: io::Error },
}
