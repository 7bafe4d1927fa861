//! Typed page-cache errors, each naming the wrong value and what would be right.

use lbio::LbioError;

use crate::FileId;

/// Everything a page-cache call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// A read or write reaches past the end of the file.
    #[error(
        "{len}-byte access at offset {offset} of file {file:?} runs past its end ({size} bytes)"
    )]
    PastEnd {
        file: FileId,
        offset: u64,
        len: usize,
        size: u64,
    },
    /// A read or write of zero bytes.
    #[error("zero-length access to file {0:?}: pass a non-empty buffer")]
    Empty(FileId),
    /// The file id was never added, or this handle has no device attached for it.
    #[error("file {0:?} is not open on this cache handle: add it with PageCache::add_file and attach a device")]
    UnknownFile(FileId),
    /// The configured capacity cannot hold what the cache needs to work.
    #[error("page cache capacity {capacity_bytes} bytes holds {frames} frames; it needs at least {needed} (one pool batch per handle, {batch} frames)")]
    CapacityTooSmall {
        capacity_bytes: usize,
        frames: u32,
        needed: u32,
        batch: u32,
    },
    /// Every frame is pinned or dirty and none could be evicted.
    #[error(
        "no frame can be evicted: all {frames} are pinned, in flight or dirty; sync or drop guards"
    )]
    NoEvictableFrame { frames: u32 },
    /// A write to a page this same handle holds a zero-copy guard on (it would wait forever).
    #[error("page {page} of file {file:?} is held by a PageGuard of this handle: drop the guard before writing the page")]
    GuardHeld { file: FileId, page: u64 },
    /// A write to a page whose write back a handle gave up on (its engine kept failing): that
    /// write may still reach the device whenever its engine is entered again, after any later
    /// one, so the page is not written again through this cache until a handle on the same
    /// lbio array takes that write's completion. Its bytes still read, and a
    /// `sync` still writes them out. (A `store` of the page is taken: the lost copy leaves the
    /// cache, so that a `sync` never writes it over the stored bytes.)
    #[error("page {page} of file {file:?} has a write back in flight that a dropped handle gave up on (its engine kept failing): the write may still land at any time, so the page cannot be changed through this cache")]
    WritebackLost { file: FileId, page: u64 },
    /// A write or `store` to a page whose write back another live handle has in flight and has
    /// not completed: that handle's wait for it failed (its engine's `io_uring_enter` failing,
    /// say), and only that handle completes the write, when it next drives its engine (any
    /// call into the cache that polls, such as a read or a `sync`). Its thread may be idle, or
    /// waiting for this writer, so the write is refused rather than waited for. Retry once that
    /// handle has polled. (Taking a fresh frame instead would let the old write land after the
    /// new bytes were written back.) A handle's own such writes are waited for, not refused.
    #[error("page {page} of file {file:?} has a write back in flight on another cache handle whose wait for it failed: it completes only when that handle next polls its engine; retry after it has")]
    WritebackInFlightOnOtherHandle { file: FileId, page: u64 },
    /// A configuration value is out of range.
    #[error("invalid page cache configuration: {0}")]
    Config(String),
    /// The device failed the request (the page is not cached).
    #[error(transparent)]
    Io(#[from] LbioError),
    /// An engine-level failure.
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
}
