//! The shared part of the cache: frames, index, the global free list, files and counters.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use aios_core::SharedRegion;

use crate::error::CacheError;
use crate::frames::{self, FrameTable, Key, State, NO_KEY};
use crate::hazard::Hazards;
use crate::index::Index;

/// Bytes per page (and per frame).
pub const PAGE_BYTES: usize = 4096;

/// A file the cache holds pages of. Ids are small integers, handed out by
/// [`PageCache::add_file`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId(pub u16);

/// How misses are served: AIOS's asynchronous read path, the vanilla one, or a step between
/// (the ablation of AIOS Fig. 13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    /// Take frames from a per-handle pool refilled in batches after the read is submitted
    /// (else: from the shared free list, under its lock, before submitting).
    pub pool: bool,
    /// Insert the page into the index after the read is submitted; duplicates are resolved at
    /// completion (else: insert first, then submit).
    pub lazy_index: bool,
    /// Read into the frames as registered (fixed) buffers (else: plain reads, pages pinned per
    /// I/O by the kernel).
    pub fixed: bool,
}

impl Mode {
    /// Everything on: the AIOS read path.
    pub const AIOS: Mode = Mode {
        pool: true,
        lazy_index: true,
        fixed: true,
    };
    /// Allocate, index, then submit, with unregistered buffers.
    pub const VANILLA: Mode = Mode {
        pool: false,
        lazy_index: false,
        fixed: false,
    };
    /// Vanilla plus registered buffers.
    pub const FIXED: Mode = Mode {
        pool: false,
        lazy_index: false,
        fixed: true,
    };
    /// Registered buffers and the frame pool, indexing before the submit.
    pub const FIXED_POOL: Mode = Mode {
        pool: true,
        lazy_index: false,
        fixed: true,
    };

    /// The mode's name in reports.
    pub fn name(self) -> &'static str {
        match (self.pool, self.lazy_index, self.fixed) {
            (true, true, true) => "aios",
            (false, false, false) => "vanilla",
            (false, false, true) => "fixed",
            (true, false, true) => "fixed+pool",
            (true, true, false) => "pool+lazy",
            (true, false, false) => "pool",
            (false, true, true) => "fixed+lazy",
            (false, true, false) => "lazy",
        }
    }
}

/// Cache settings, validated once by [`PageCache::new`].
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    /// Bytes of page frames (fixed at start; the cache never holds more).
    pub capacity_bytes: usize,
    /// Frames a handle's pool takes from (and lazy release gives back to) the shared free list at
    /// once.
    pub pool_batch: u32,
    /// Pages read ahead of a sequential stream (0 turns readahead off).
    pub readahead_pages: u32,
    /// Back the frames with huge pages when available.
    pub huge_pages: bool,
    /// A read that misses several consecutive pages reads them with one scattered request
    /// into their frames (one device command per max transfer where the device takes vectored
    /// commands); otherwise one request per page.
    pub vectored_reads: bool,
    /// Microseconds a reader waits for a page that another handle is reading before it reads
    /// the page itself (lazy-indexing modes only; its frame is then abandoned as a duplicate).
    /// A handle's reads complete only when that handle next drives its engine: a readahead
    /// whose handle has gone idle would otherwise hold its pages' readers for as long.
    pub foreign_read_wait_us: u32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            capacity_bytes: 64 << 20,
            pool_batch: 32,
            readahead_pages: 16,
            huge_pages: true,
            vectored_reads: true,
            foreign_read_wait_us: 500,
        }
    }
}

impl CacheConfig {
    /// The smallest `capacity_bytes` [`PageCache::new`] takes with this `pool_batch`.
    pub fn min_capacity_bytes(&self) -> usize {
        self.pool_batch as usize * MIN_HANDLE_FRAMES_FACTOR as usize * PAGE_BYTES
    }
}

/// Counters, shared by all handles.
#[derive(Debug, Default)]
pub struct Counters {
    /// Published by each handle every 256 hits, at each of its misses and when it drops.
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    /// Misses that lost a lazy-indexing race (their frame was abandoned).
    pub duplicates: AtomicU64,
    /// Misses that found the page being read by someone else and waited for it.
    pub waited: AtomicU64,
    pub evictions: AtomicU64,
    pub writebacks: AtomicU64,
    pub readahead_pages: AtomicU64,
    pub read_errors: AtomicU64,
    /// Waits for another handle's read that ran past `foreign_read_wait_us`: the reader read
    /// the page itself.
    pub foreign_waits_cut: AtomicU64,
    /// Readahead frames still in flight that a writer took out of the index (it wrote the
    /// page into a frame of its own instead of waiting for the read).
    pub readahead_stolen: AtomicU64,
    /// The same for a reader's frame (its read in flight, or orphaned by a failed wait): the
    /// reader still gets what it read, and the frame is not cached.
    pub reads_superseded: AtomicU64,
    /// Pool refills a miss did while its read was in flight that failed (nothing evictable, or
    /// the write back of other dirty pages failed; those stay dirty for the next `sync`). The
    /// miss still returns its page: the refill was for later misses, which try again.
    pub refills_failed: AtomicU64,
}

/// A snapshot of the cache's shared counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheMetrics {
    pub hits: u64,
    pub misses: u64,
    pub duplicates: u64,
    pub waited: u64,
    pub evictions: u64,
    pub writebacks: u64,
    pub readahead_pages: u64,
    pub read_errors: u64,
    pub foreign_waits_cut: u64,
    pub readahead_stolen: u64,
    pub reads_superseded: u64,
    /// Pool refills a miss did while its read was in flight that failed (nothing evictable, or
    /// the write back of other dirty pages failed; those stay dirty for the next `sync`). The
    /// miss still returned its page: the refill was for later misses, which try again.
    pub refills_failed: u64,
    /// Readahead pages in flight now, over all handles (at most [`PageCache::readahead_limit`]).
    pub readahead_in_flight: u32,
    /// Frames in the shared free list now (frames in handles' pools are not counted).
    pub free_frames: u32,
    pub frames: u32,
}

/// What a request a handle gave up on was doing (see [`LostRequest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LostKind {
    /// A reader's read (its reader gone): the frames carry that reader's pins.
    Read,
    /// Readahead: one frame, no pin, one share of the readahead budget.
    Readahead,
    /// A write back: each frame pinned by it and flagged [`frames::LOST`].
    Writeback,
}

/// A request a dropped handle left in flight on an engine that kept failing (its
/// quarantine): its frames stay out of the pool, and its write back's pages refuse writers,
/// until a handle on the same lbio array takes its completion, or that array is dropped and
/// its drop drained the engine ([`lbio::Fate::Drained`]; see
/// [`crate::CacheHandle::settle_lost`]). Only then can the device no longer read from or write
/// into those frames.
pub(crate) struct LostRequest {
    /// The lbio array the request was sent on: names it (no other array's fate is the same
    /// while this is held) and says whether its drop drained the engine.
    pub(crate) fate: lbio::ArrayFate,
    pub(crate) tag: u32,
    pub(crate) kind: LostKind,
    pub(crate) frames: Vec<u32>,
}

pub(crate) struct FileInfo {
    pub(crate) size: u64,
}

/// The page cache shared by all cores: create once, then one [`crate::CacheHandle`] per thread.
pub struct PageCache {
    pub(crate) cfg: CacheConfig,
    pub(crate) region: Arc<SharedRegion>,
    pub(crate) frames: FrameTable,
    pub(crate) index: Index,
    pub(crate) hazards: Hazards,
    free: Mutex<Vec<u32>>,
    clock: AtomicUsize,
    files: Mutex<Vec<FileInfo>>,
    pub(crate) counters: Counters,
    /// Frames held by readahead in flight, over all handles: see [`PageCache::readahead_limit`].
    readahead_in_flight: AtomicU32,
    /// Requests of dropped handles whose engines kept failing, until their completions are
    /// taken or their arrays are dropped and drained (see [`LostRequest`]); `lost_len` mirrors
    /// its length, so a completion of no request of its handle's own, and a look for drained
    /// arrays, take no lock while there are none.
    lost: Mutex<Vec<LostRequest>>,
    pub(crate) lost_len: AtomicU32,
    /// Frames to be freed that a zero-copy guard still held through a hazard slot (see
    /// [`PageCache::retire`]); `retired_len` mirrors the list's length, so a handle looking
    /// for them takes no lock while there are none.
    retired: Mutex<Vec<u32>>,
    pub(crate) retired_len: AtomicU32,
}

impl std::fmt::Debug for PageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageCache")
            .field("cfg", &self.cfg)
            .field("metrics", &self.metrics())
            .finish()
    }
}

/// Handles a cache can serve at once is not limited; this many frames per handle are needed.
pub const MIN_HANDLE_FRAMES_FACTOR: u32 = 2;

impl PageCache {
    /// Map the frames and build the index. Capacity must hold at least two pool batches.
    pub fn new(cfg: CacheConfig) -> Result<Arc<PageCache>, CacheError> {
        if cfg.pool_batch == 0 || cfg.pool_batch > 4096 {
            return Err(CacheError::Config(format!(
                "pool_batch {} must be in 1..=4096",
                cfg.pool_batch
            )));
        }
        let frames = (cfg.capacity_bytes / PAGE_BYTES).min(u32::MAX as usize - 1) as u32;
        let needed = cfg.pool_batch * MIN_HANDLE_FRAMES_FACTOR;
        if frames < needed {
            return Err(CacheError::CapacityTooSmall {
                capacity_bytes: cfg.capacity_bytes,
                frames,
                needed,
                batch: cfg.pool_batch,
            });
        }
        let region = Arc::new(SharedRegion::map(
            frames as usize * PAGE_BYTES,
            cfg.huge_pages,
        )?);
        // Copy-out hits copy with the faster of two routines on this machine (measured once per
        // process, a few milliseconds; see `aios_core::copy::calibrate`).
        aios_core::copy::calibrate();
        Ok(Arc::new(PageCache {
            cfg,
            region,
            frames: FrameTable::new(frames),
            index: Index::new(frames),
            hazards: Hazards::new(),
            free: Mutex::new((0..frames).rev().collect()),
            clock: AtomicUsize::new(0),
            files: Mutex::new(Vec::new()),
            counters: Counters::default(),
            readahead_in_flight: AtomicU32::new(0),
            lost: Mutex::new(Vec::new()),
            lost_len: AtomicU32::new(0),
            retired: Mutex::new(Vec::new()),
            retired_len: AtomicU32::new(0),
        }))
    }

    /// The settings.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// Register a file of `size` bytes; each handle then attaches its own device for it.
    pub fn add_file(&self, size: u64) -> Result<FileId, CacheError> {
        let mut files = self.lock_files();
        if files.len() >= u16::MAX as usize {
            return Err(CacheError::Config("at most 65535 files per cache".into()));
        }
        if size.div_ceil(PAGE_BYTES as u64) >= frames::MAX_PAGES_PER_FILE {
            return Err(CacheError::Config(format!(
                "a file of {size} bytes has more than 2^48 pages"
            )));
        }
        files.push(FileInfo { size });
        Ok(FileId(files.len() as u16 - 1))
    }

    fn lock_files(&self) -> std::sync::MutexGuard<'_, Vec<FileInfo>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Size of `file` in bytes.
    pub fn file_size(&self, file: FileId) -> Option<u64> {
        self.lock_files().get(file.0 as usize).map(|f| f.size)
    }

    /// Counters now.
    pub fn metrics(&self) -> CacheMetrics {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CacheMetrics {
            hits: l(&c.hits),
            misses: l(&c.misses),
            duplicates: l(&c.duplicates),
            waited: l(&c.waited),
            evictions: l(&c.evictions),
            writebacks: l(&c.writebacks),
            readahead_pages: l(&c.readahead_pages),
            read_errors: l(&c.read_errors),
            foreign_waits_cut: l(&c.foreign_waits_cut),
            readahead_stolen: l(&c.readahead_stolen),
            reads_superseded: l(&c.reads_superseded),
            refills_failed: l(&c.refills_failed),
            readahead_in_flight: self.readahead_in_flight.load(Ordering::Relaxed),
            free_frames: self.lock_free().len() as u32,
            frames: self.frames.len(),
        }
    }

    /// The most frames readahead in flight may hold at once, over all handles: half the cache.
    /// Only the handle that issued a readahead completes it, when it next drives its engine, so
    /// until then its frames can be neither read from nor evicted; without a bound, an idle
    /// handle's readahead could leave other handles no frame to take.
    pub fn readahead_limit(&self) -> u32 {
        self.frames.len() / 2
    }

    /// Reserve one frame for a readahead: false when the limit is reached (read no further).
    pub(crate) fn reserve_readahead(&self) -> bool {
        let limit = self.readahead_limit();
        self.readahead_in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// A readahead reserved with [`Self::reserve_readahead`] completed or was not issued.
    pub(crate) fn end_readahead(&self) {
        self.readahead_in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// The requests dropped handles gave up on (see [`LostRequest`]).
    pub(crate) fn lock_lost(&self) -> std::sync::MutexGuard<'_, Vec<LostRequest>> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep a frame that is to be freed (out of the index, no pin, no I/O) while a zero-copy
    /// guard taken before it left the index still holds it through a hazard slot: a guard's
    /// drop only empties its slot, and looks at nothing shared. Handles free such frames once
    /// no slot holds them, when they next take frames (a pool refill, a miss without a pool)
    /// and when they drop. No guard can take the frame meanwhile: it is out of the index.
    pub(crate) fn retire(&self, frame: u32) {
        let mut retired = self.lock_retired();
        retired.push(frame);
        self.retired_len
            .store(retired.len() as u32, Ordering::Relaxed);
    }

    /// The frames [`Self::retire`] keeps.
    pub(crate) fn lock_retired(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.retired.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The frames in the shared free list now (for tests).
    #[cfg(test)]
    pub(crate) fn free_list(&self) -> std::collections::HashSet<u32> {
        self.lock_free().iter().copied().collect()
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Address of a frame's bytes.
    pub(crate) fn frame_ptr(&self, frame: u32) -> *mut u8 {
        debug_assert!(frame < self.frames.len());
        // SAFETY: frame < frames, and the region holds frames * PAGE_BYTES bytes.
        unsafe { self.region.as_ptr().add(frame as usize * PAGE_BYTES) }
    }

    /// Move up to `n` free frames into `out` (one lock). Returns how many moved.
    pub(crate) fn take_free(&self, out: &mut Vec<u32>, n: usize) -> usize {
        let mut free = self.lock_free();
        let k = n.min(free.len());
        let at = free.len() - k;
        out.extend(free.drain(at..));
        k
    }

    /// Give frames back to the free list (one lock).
    pub(crate) fn give_free(&self, frames: &mut Vec<u32>) {
        if frames.is_empty() {
            return;
        }
        self.lock_free().append(frames);
    }

    /// Give one frame back to the free list.
    pub(crate) fn give_one(&self, frame: u32) {
        self.lock_free().push(frame);
    }

    /// One free frame from the shared list, or by evicting one.
    pub(crate) fn take_one(&self) -> Result<u32, CacheError> {
        if let Some(f) = self.lock_free().pop() {
            return Ok(f);
        }
        self.evict_one()
    }

    /// CLOCK: sweep the hand until a frame that is indexed, valid, clean, unpinned (no pin count,
    /// no hazard slot) and not recently referenced can be taken; referenced frames get a second chance. Dirty frames are
    /// skipped (they must be written back first: [`crate::CacheHandle::sync`] or writeback).
    pub(crate) fn evict_one(&self) -> Result<u32, CacheError> {
        let n = self.frames.len() as usize;
        // Two full sweeps: the first may only clear referenced bits.
        for _ in 0..2 * n {
            let f = (self.clock.fetch_add(1, Ordering::Relaxed) % n) as u32;
            let s = self.frames.state(f);
            if !s.has(frames::VALID | frames::INDEXED)
                || s.pins() > 0
                || s.flags() & (frames::IO | frames::DIRTY | frames::BUSY) != 0
            {
                continue;
            }
            if s.has(frames::REFERENCED) {
                self.frames
                    .cas(f, s, s.with_flags(s.flags() & !frames::REFERENCED));
                continue;
            }
            let key = self.frames.key(f);
            // Claim it: bump the version so optimistic readers of the old page fail.
            if !self
                .frames
                .cas(f, s, State::new(s.version().wrapping_add(1), 0, 0))
            {
                continue;
            }
            if self.hazards.protects(f) {
                // A zero-copy guard holds it (it published its slot before our claim): give it
                // back, referenced, with a new version.
                self.frames.update(f, |cur| {
                    Some(State::new(
                        cur.version().wrapping_add(1),
                        0,
                        s.flags() | frames::REFERENCED,
                    ))
                });
                continue;
            }
            self.index.remove(Key(key), f);
            self.frames.meta(f).key.store(NO_KEY, Ordering::Release);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            return Ok(f);
        }
        Err(CacheError::NoEvictableFrame {
            frames: self.frames.len(),
        })
    }
}
