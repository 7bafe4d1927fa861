//! One thread's view of the cache: its engine and lbio array, its frame pool, its devices.
//!
//! The asynchronous read path (AIOS §3.2) lives in [`CacheHandle::read`]: on a miss it takes a
//! frame from the handle's pool of pre-registered frames and submits the read at once; only then
//! does it insert the page into the index (lazy indexing) and refill the pool, while the device
//! works. Freed frames collect in a release batch and go back to the shared free list together
//! (lazy release).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ops::Deref;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aios_core::Engine;
use lbio::{ArrayFate, Class, Device, Fate, Io, LbioArray, LbioError, RawBuf, RawIov, Tag};

use crate::cache::{FileId, LostKind, LostRequest, Mode, PageCache, PAGE_BYTES};
use crate::error::CacheError;
use crate::frames::{self, Key, State, NO_KEY};
use crate::hazard;
use crate::index::Insert;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A reader waits for it on this handle.
    Read,
    /// Nobody waits: readahead.
    Readahead,
    /// Writing a dirty frame back; the handle holds a pin on it.
    Writeback,
    /// A read whose reader returned early (its wait for the engine failed): its completion
    /// releases the frames the reader held.
    Orphan,
}

#[derive(Clone, Copy, Debug)]
struct Pending {
    /// The frame read or written; for a run, the first of them.
    frame: u32,
    /// A run: its frames are `run_frames[run_at..run_at + run_len]` for a read,
    /// `wb.frames[..]` for a writeback (`run_len` 0: just `frame`).
    run_at: u16,
    run_len: u16,
    kind: Kind,
    /// A write back a failed wait left in flight: counted in its frames'
    /// [`frames::FrameMeta::parked`] until it completes (or is lost with the handle).
    parked: bool,
}

/// The longest a writer waits for another handle's read of a page before superseding it,
/// however many it superseded before (see `CacheHandle::put`), in µs.
const MAX_WRITER_PATIENCE_US: u64 = 100_000;

/// A file served by this handle.
#[derive(Clone)]
struct Attached {
    device: Rc<Device>,
    size: u64,
}

/// Most pages whose reads one multi-page read sends before waiting.
pub const MISS_BATCH: usize = 32;

/// Dirty pages one writeback pass pins, sorts into runs, writes and waits for.
pub const WRITEBACK_BATCH: usize = 256;

/// A writeback pass's pages: (key, frame) sorted by key, the frames in that order, and the
/// iovecs of its run writes (boxed: the kernel reads them at a stable address).
struct WbBuf {
    keys: [(u64, u32); WRITEBACK_BATCH],
    frames: [u32; WRITEBACK_BATCH],
    iov: [libc::iovec; WRITEBACK_BATCH],
}

impl WbBuf {
    fn empty() -> WbBuf {
        WbBuf {
            keys: [(0, 0); WRITEBACK_BATCH],
            frames: [0; WRITEBACK_BATCH],
            iov: [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; WRITEBACK_BATCH],
        }
    }
}

/// Hits a handle counts before adding them to the cache's shared counter.
const HIT_PUBLISH_BATCH: u64 = 256;

/// Sequential-stream detection per file.
#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    next_page: u64,
    run: u32,
}

/// A thread's handle on a [`PageCache`]. Not `Send`: create one per thread, each with its own
/// engine and lbio array.
pub struct CacheHandle {
    cache: Arc<PageCache>,
    engine: Rc<Engine>,
    lbio: Rc<LbioArray>,
    /// `lbio`'s fate: names the array in the cache's list of lost requests.
    lbio_fate: ArrayFate,
    region_index: u16,
    mode: Mode,
    /// Per file: its device on this handle and its size (copied at attach, so the read path
    /// takes no shared lock to check bounds).
    files: RefCell<Vec<Option<Attached>>>,
    /// Hits not yet added to the shared counter: published in batches, so hits on different
    /// cores do not all write one cache line.
    unpublished_hits: Cell<u64>,
    pool: RefCell<Vec<u32>>,
    release: RefCell<Vec<u32>>,
    pending: RefCell<Vec<Option<Pending>>>,
    /// Reads in `pending` whose reader returned early ([`Kind::Orphan`]): their runs still
    /// name `run_frames` and `run_iov`, so no new read rewrites those until they complete.
    orphans: Cell<u32>,
    /// The frames of the run reads of the one multi-page read in progress, and the iovecs
    /// their requests carry (boxed: the kernel reads them at a stable address).
    run_frames: RefCell<[u32; MISS_BATCH]>,
    run_iov: RefCell<Box<[libc::iovec; MISS_BATCH]>>,
    wb: RefCell<Box<WbBuf>>,
    streams: RefCell<Vec<Stream>>,
    /// Entry of the last miss to its SQE entering the kernel, ns (the submission latency, AIOS
    /// Fig. 14); taken by [`CacheHandle::take_submit_ns`].
    last_submit_ns: Cell<Option<u64>>,
    /// One read in this many takes the clock at entry for `last_submit_ns` (0, the default:
    /// none; a clock read per call is a sizeable part of a hit).
    timing: Cell<u32>,
    /// Reads since the last timed one.
    timing_tick: Cell<u32>,
    last_error: RefCell<Option<LbioError>>,
    /// Why the last failed read failed (taken by its reader).
    read_error: RefCell<Option<LbioError>>,
    /// This handle's block of hazard slots (`None` past [`hazard::MAX_BLOCKS`] handles: its guards
    /// pin by count).
    hazard_block: Option<usize>,
    /// Bit `i` set: slot `i` of the block is free.
    hazard_free: Cell<u16>,
    /// Frames this handle's guards pin by count, each with the number of such guards: a write
    /// from this handle to one of them is refused ([`CacheError::GuardHeld`]) rather than
    /// waited for forever. (A map: a list searched at each drop cost time quadratic in the
    /// guards held.)
    own_pins: RefCell<HashMap<u32, u32>>,
}

/// Frames held by guards pinned by count a handle holds before its map of them grows (guards pin by count
/// once the handle's hazard slots are taken).
const OWN_PINS_PREALLOCATED: usize = 64;

/// A page pinned in the cache: its bytes, without a copy. Dropping it unpins the page.
pub struct PageGuard<'a> {
    handle: &'a CacheHandle,
    frame: u32,
    abandoned: bool,
    /// The hazard slot holding the page, or `None` when it is pinned by count.
    slot: Option<u8>,
}

impl Deref for PageGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the frame is pinned (by count or hazard slot) and valid: no eviction, no writer
        // (both need zero pins and no slot holding it) and no read into it until the guard drops.
        unsafe { std::slice::from_raw_parts(self.handle.cache.frame_ptr(self.frame), PAGE_BYTES) }
    }
}

impl Drop for PageGuard<'_> {
    fn drop(&mut self) {
        match self.slot {
            Some(slot) => self.handle.release_slot(slot),
            None => {
                let mut own = self.handle.own_pins.borrow_mut();
                if let Some(n) = own.get_mut(&self.frame) {
                    *n -= 1;
                    if *n == 0 {
                        own.remove(&self.frame);
                    }
                }
                drop(own);
                self.handle.unpin(self.frame, self.abandoned);
            }
        }
    }
}

impl CacheHandle {
    /// A handle for this thread: registers the cache's frames with `engine` (as a fixed buffer)
    /// and takes a first pool batch.
    pub fn new(
        cache: &Arc<PageCache>,
        engine: &Rc<Engine>,
        lbio: &Rc<LbioArray>,
        mode: Mode,
    ) -> Result<CacheHandle, CacheError> {
        let region_index = engine.register_region(&cache.region)?;
        let batch = cache.cfg.pool_batch as usize;
        let slots = lbio.config().slots as usize;
        let h = CacheHandle {
            cache: Arc::clone(cache),
            engine: Rc::clone(engine),
            lbio: Rc::clone(lbio),
            lbio_fate: lbio.fate(),
            region_index,
            mode,
            files: RefCell::new(Vec::new()),
            unpublished_hits: Cell::new(0),
            pool: RefCell::new(Vec::with_capacity(2 * batch)),
            release: RefCell::new(Vec::with_capacity(2 * batch)),
            pending: RefCell::new(vec![None; slots]),
            orphans: Cell::new(0),
            run_frames: RefCell::new([0; MISS_BATCH]),
            run_iov: RefCell::new(Box::new(
                [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; MISS_BATCH],
            )),
            wb: RefCell::new(Box::new(WbBuf::empty())),
            streams: RefCell::new(Vec::new()),
            last_submit_ns: Cell::new(None),
            timing: Cell::new(0),
            timing_tick: Cell::new(0),
            last_error: RefCell::new(None),
            read_error: RefCell::new(None),
            hazard_block: cache.hazards.claim(),
            hazard_free: Cell::new(((1u32 << hazard::SLOTS) - 1) as u16),
            own_pins: RefCell::new(HashMap::with_capacity(OWN_PINS_PREALLOCATED)),
        };
        h.settle_lost();
        if mode.pool {
            h.refill()?;
        }
        Ok(h)
    }

    /// The cache this handle works on.
    pub fn cache(&self) -> &Arc<PageCache> {
        &self.cache
    }
    /// How misses are served.
    pub fn mode(&self) -> Mode {
        self.mode
    }
    /// The submission latency of the last read that missed since the previous call: ns from the
    /// read call's entry to its SQE being in the ring as the `io_uring_enter` that submits it
    /// starts (for a multi-page read, its first batch). `None` when no read missed since.
    ///
    /// Recorded only while [`CacheHandle::time_submissions`] is on.
    pub fn take_submit_ns(&self) -> Option<u64> {
        self.last_submit_ns.take()
    }

    /// Record the submission latency of one read in `every` (0: none, the default). A timed
    /// read takes the clock twice, about 50 ns on a machine whose clock source is the TSC, so a
    /// benchmark that also times whole reads samples: every read it times pays 1/`every` of it.
    pub fn time_submissions(&self, every: u32) {
        self.timing.set(every);
        self.timing_tick.set(0);
    }

    fn entry_clock(&self) -> Option<Instant> {
        let every = self.timing.get();
        if every == 0 {
            return None;
        }
        let tick = self.timing_tick.get() + 1;
        if tick < every {
            self.timing_tick.set(tick);
            return None;
        }
        self.timing_tick.set(0);
        Some(Instant::now())
    }

    fn record_submit(&self, entry: Option<Instant>) {
        if let Some(t0) = entry {
            self.last_submit_ns
                .set(Some(t0.elapsed().as_nanos() as u64));
        }
    }

    /// Serve `file` on this handle from `device` (opened on this handle's lbio array). The
    /// device must hold at least the file's size.
    pub fn attach(&self, file: FileId, device: Device) -> Result<(), CacheError> {
        let size = self
            .cache
            .file_size(file)
            .ok_or(CacheError::UnknownFile(file))?;
        if device.geometry().capacity_bytes < size {
            return Err(CacheError::Config(format!(
                "device of {} bytes is smaller than file {file:?} ({size} bytes)",
                device.geometry().capacity_bytes
            )));
        }
        let mut files = self.files.borrow_mut();
        let i = file.0 as usize;
        if files.len() <= i {
            files.resize(i + 1, None);
            self.streams.borrow_mut().resize(i + 1, Stream::default());
        }
        files[i] = Some(Attached {
            device: Rc::new(device),
            size,
        });
        Ok(())
    }

    fn attached(&self, file: FileId) -> Result<Attached, CacheError> {
        self.files
            .borrow()
            .get(file.0 as usize)
            .and_then(|d| d.clone())
            .ok_or(CacheError::UnknownFile(file))
    }

    fn device(&self, file: FileId) -> Result<Rc<Device>, CacheError> {
        self.attached(file).map(|a| a.device)
    }

    fn check_range(&self, file: FileId, offset: u64, len: usize) -> Result<(), CacheError> {
        let size = self
            .files
            .borrow()
            .get(file.0 as usize)
            .and_then(|d| d.as_ref().map(|a| a.size))
            .ok_or(CacheError::UnknownFile(file))?;
        if len == 0 {
            return Err(CacheError::Empty(file));
        }
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(CacheError::PastEnd {
                file,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }

    fn count_hit(&self) {
        let n = self.unpublished_hits.get() + 1;
        if n >= HIT_PUBLISH_BATCH {
            self.publish_hits_now(n);
        } else {
            self.unpublished_hits.set(n);
        }
    }

    /// Count misses (after their reads were submitted), publishing this handle's hits with them.
    fn count_misses(&self, n: u64) {
        self.publish_metrics();
        self.cache.counters.misses.fetch_add(n, Ordering::Relaxed);
    }

    fn publish_hits_now(&self, n: u64) {
        self.unpublished_hits.set(0);
        if n > 0 {
            self.cache.counters.hits.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Add this handle's uncounted hits to the cache's metrics (done by itself every
    /// 256 hits, at every miss and when the handle drops).
    pub fn publish_metrics(&self) {
        self.publish_hits_now(self.unpublished_hits.get());
    }

    /// Read `buf.len()` bytes of `file` at `offset` into `buf`, through the cache.
    ///
    /// A read spanning several pages sends the reads of all its missing pages (up to
    /// [`MISS_BATCH`] at a time) before it waits for any of them: each run of consecutive
    /// missing pages as one scattered request into its frames (with
    /// [`CacheConfig::vectored_reads`](crate::CacheConfig::vectored_reads)).
    pub fn read(&self, file: FileId, offset: u64, buf: &mut [u8]) -> Result<(), CacheError> {
        let entry = self.entry_clock();
        self.check_range(file, offset, buf.len())?;
        let first = offset / PAGE_BYTES as u64;
        let last = (offset + buf.len() as u64 - 1) / PAGE_BYTES as u64;
        if first == last {
            let in_page = (offset % PAGE_BYTES as u64) as usize;
            return self.read_page(Key::new(file.0, first), entry, |frame| {
                // SAFETY: `frame` points at a whole page and `in_page + buf.len() <= PAGE_BYTES`;
                // the caller of this closure pins or re-validates the frame around the copy.
                unsafe {
                    aios_core::copy::copy_nonoverlapping(
                        frame.add(in_page),
                        buf.as_mut_ptr(),
                        buf.len(),
                    )
                }
            });
        }
        let mut page = first;
        while page <= last {
            let end = (page + MISS_BATCH as u64 - 1).min(last);
            self.read_batch(file, offset, buf, page, end, entry)?;
            page = end + 1;
        }
        Ok(())
    }

    /// Pages `first..=last` of a read of `buf.len()` bytes at `offset`: hits are copied at once;
    /// the misses are all submitted, then indexed, then waited for and copied.
    fn read_batch(
        &self,
        file: FileId,
        offset: u64,
        buf: &mut [u8],
        first: u64,
        last: u64,
        entry: Option<Instant>,
    ) -> Result<(), CacheError> {
        // The part of `buf` page `page` fills, and where in the page it starts.
        let len = buf.len() as u64;
        let span = move |page: u64| -> (usize, usize, usize) {
            let page_start = page * PAGE_BYTES as u64;
            let from = page_start.max(offset);
            let to = (page_start + PAGE_BYTES as u64).min(offset + len);
            (
                (from - offset) as usize,
                (to - from) as usize,
                (from - page_start) as usize,
            )
        };
        let copy_out = |buf: &mut [u8], page: u64, frame: *const u8| {
            let (at, n, in_page) = span(page);
            // SAFETY: `frame` points at a whole page and `in_page + n <= PAGE_BYTES`; the frame
            // is pinned or re-validated by the caller around the copy.
            unsafe {
                aios_core::copy::copy_nonoverlapping(
                    frame.add(in_page),
                    buf[at..at + n].as_mut_ptr(),
                    n,
                )
            }
        };
        let mut missing = [0u64; MISS_BATCH];
        let mut n_missing = 0;
        for page in first..=last {
            let hit = self.try_hit(Key::new(file.0, page), |frame| copy_out(buf, page, frame))?;
            if !hit {
                missing[n_missing] = page;
                n_missing += 1;
            }
        }
        if n_missing == 0 {
            return Ok(());
        }
        if n_missing == 1 {
            let page = missing[0];
            return self.read_missing(Key::new(file.0, page), entry, |frame| {
                copy_out(buf, page, frame)
            });
        }
        let dev = self.device(file)?;
        self.settle_orphans()?;
        // Claim a frame for every miss and submit each run of consecutive pages as one
        // scattered read (one request per page without `vectored_reads`). Pages raced by
        // another reader or refused for lack of a frame or a slot are read one by one afterwards.
        let vectored = self.cache.cfg.vectored_reads;
        // (page, frame, run, abandoned, removals) per page read: the pages of a run share its
        // number (not its tag: lbio may hand a finished run's tag to the next run at once);
        // `removals` is its index line's count from before the read (see `index_late`).
        let mut reads = [(0u64, 0u32, 0usize, false, 0u32); MISS_BATCH];
        let mut since = [0u32; MISS_BATCH];
        let mut runs = 0usize;
        let mut n_reads = 0;
        let mut retry = [0u64; MISS_BATCH];
        let mut n_retry = 0;
        let mut failure: Option<CacheError> = None;
        // The run being gathered: its first page and its frames in `run_frames[at..at + len]`.
        let (mut run_page, mut run_at, mut run_len) = (0u64, 0usize, 0usize);
        let mut used = 0;
        let mut i = 0;
        while i <= n_missing {
            let page = missing.get(i).copied().filter(|_| i < n_missing);
            let extends = page.is_some_and(|p| vectored && p == run_page + run_len as u64);
            if run_len > 0 && !extends {
                let first = Key::new(file.0, run_page);
                match self.submit_read(first, run_at, run_len, &dev) {
                    Ok(_) => {
                        runs += 1;
                        let run = self.run_frames.borrow();
                        for k in 0..run_len {
                            let (page, frame) = (run_page + k as u64, run[run_at + k]);
                            reads[n_reads] = (page, frame, runs, false, since[run_at + k]);
                            n_reads += 1;
                        }
                    }
                    Err(CacheError::Io(LbioError::NoFreeSlot { .. })) if n_reads > 0 => {
                        for k in 0..run_len {
                            retry[n_retry] = run_page + k as u64;
                            n_retry += 1;
                        }
                        retry_rest(&missing[i..n_missing], &mut retry, &mut n_retry);
                        break;
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
                run_len = 0;
            }
            let Some(page) = page else {
                break;
            };
            match self.claim_frame(Key::new(file.0, page)) {
                Ok(Some(frame)) => {
                    self.run_frames.borrow_mut()[used] = frame;
                    since[used] = self.cache.index.removals(Key::new(file.0, page));
                    if run_len == 0 {
                        (run_page, run_at) = (page, used);
                    }
                    run_len += 1;
                    used += 1;
                }
                Ok(None) => {
                    retry[n_retry] = page;
                    n_retry += 1;
                }
                Err(CacheError::NoEvictableFrame { .. }) if n_reads + run_len > 0 => {
                    // Read what has frames; the rest one by one once they come back.
                    retry_rest(&missing[i..n_missing], &mut retry, &mut n_retry);
                    i = n_missing;
                    continue;
                }
                Err(e) => {
                    self.undo_claims(file, run_page, run_at, run_len);
                    failure = Some(e);
                    break;
                }
            }
            i += 1;
        }
        if n_reads > 0 {
            self.record_submit(entry);
            if let Err(e) = self.engine.submit() {
                failure.get_or_insert(e.into());
            }
            self.count_misses(n_reads as u64);
        }
        // While the device works: lazy indexing, pool refill, readahead.
        for r in &mut reads[..n_reads] {
            r.3 = self.index_late(Key::new(file.0, r.0), r.1, r.4);
        }
        if let Err(e) = self.after_submit(file, first, last, &dev) {
            failure.get_or_insert(e);
        }
        let mut waited: Option<(usize, bool)> = None;
        for (k, &(page, frame, run, abandoned, _)) in reads[..n_reads].iter().enumerate() {
            let failed = match waited {
                Some((r, failed)) if r == run => failed,
                _ => {
                    let failed = match self.wait_frame(frame) {
                        Ok(f) => f,
                        Err(e) => {
                            // The engine failed: the frames still in flight may still be the
                            // kernel's. Their completions release them.
                            self.orphan_reads(reads[k..n_reads].iter().map(|r| (r.1, r.3)));
                            return Err(e);
                        }
                    };
                    if failed {
                        let e = self.take_error();
                        failure.get_or_insert(e);
                    }
                    waited = Some((run, failed));
                    failed
                }
            };
            if failed {
                self.unpin(frame, true);
            } else {
                copy_out(buf, page, self.cache.frame_ptr(frame));
                self.unpin(frame, abandoned);
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        for &page in &retry[..n_retry] {
            self.read_page(Key::new(file.0, page), None, |frame| {
                copy_out(buf, page, frame)
            })?;
        }
        Ok(())
    }

    /// Pin page `page` of `file` and return it without copying.
    pub fn get(&self, file: FileId, page: u64) -> Result<PageGuard<'_>, CacheError> {
        let entry = self.entry_clock();
        // A page past 2^52 has no byte offset (saturated: refused as past the end).
        self.check_range(file, page.saturating_mul(PAGE_BYTES as u64), 1)?;
        let key = Key::new(file.0, page);
        loop {
            if let Some(frame) = self.lookup(key) {
                let slot = match self.protect(frame, key) {
                    Protect::Held(slot) => Some(Some(slot)),
                    Protect::NoSlot if self.cache.frames.pin(frame, key) => Some(None),
                    Protect::Changed | Protect::NoSlot => None,
                };
                if let Some(slot) = slot {
                    self.cache.frames.mark(frame, frames::REFERENCED);
                    self.count_hit();
                    return Ok(self.guard(frame, false, slot));
                }
                if self.wait_for(frame, self.reader_cut())? {
                    continue;
                }
                // Another handle's read is slow to complete: the miss below reads it here.
            }
            match self.miss(key, entry)? {
                Some((frame, abandoned)) => {
                    // The miss left the frame pinned by count; an indexed frame moves to a hazard
                    // slot (published while the count still holds it), so a write from this
                    // handle can tell its own guard. An abandoned frame keeps the count: it is
                    // freed when that drops.
                    let slot = match self.free_slot() {
                        Some((block, slot)) if !abandoned => {
                            self.cache.hazards.protect(block, slot, frame);
                            self.take_slot(slot);
                            self.cache.frames.unpin(frame);
                            Some(slot as u8)
                        }
                        _ => None,
                    };
                    return Ok(self.guard(frame, abandoned, slot));
                }
                None => continue,
            }
        }
    }

    /// A guard on `frame`, held through hazard slot `slot` or (`None`) by a pin count this
    /// handle notes as its own.
    fn guard(&self, frame: u32, abandoned: bool, slot: Option<u8>) -> PageGuard<'_> {
        if slot.is_none() {
            *self.own_pins.borrow_mut().entry(frame).or_insert(0) += 1;
        }
        PageGuard {
            handle: self,
            frame,
            abandoned,
            slot,
        }
    }

    /// Hold `frame` (found for `key`) through one of this handle's hazard slots: publish it,
    /// then check the frame still holds the page, valid, in the index and not being written.
    /// (A frame found by a lookup may have been evicted and reused since for the same page by a
    /// miss that lost the lazy-indexing race: valid, with the key, but abandoned and out of
    /// the index, and freed by its reader with no look at the hazard slots.)
    fn protect(&self, frame: u32, key: Key) -> Protect {
        let Some((block, slot)) = self.free_slot() else {
            return Protect::NoSlot;
        };
        let frames = &self.cache.frames;
        let s1 = frames.state(frame);
        if !s1.has(frames::VALID | frames::INDEXED)
            || s1.has(frames::BUSY)
            || frames.key(frame) != key.0
        {
            return Protect::Changed;
        }
        self.cache.hazards.protect(block, slot, frame);
        let s2 = frames.state_after_protect(frame);
        if s2.version() != s1.version()
            || !s2.has(frames::VALID | frames::INDEXED)
            || s2.has(frames::BUSY)
            || frames.key(frame) != key.0
        {
            self.cache.hazards.clear(block, slot);
            return Protect::Changed;
        }
        self.take_slot(slot);
        Protect::Held(slot as u8)
    }

    /// This handle's block and a free slot in it, if any.
    fn free_slot(&self) -> Option<(usize, usize)> {
        let block = self.hazard_block?;
        let free = self.hazard_free.get();
        (free != 0).then(|| (block, free.trailing_zeros() as usize))
    }

    fn take_slot(&self, slot: usize) {
        self.hazard_free.set(self.hazard_free.get() & !(1 << slot));
    }

    fn release_slot(&self, slot: u8) {
        let block = self.hazard_block.expect("a slot implies a block");
        self.cache.hazards.clear(block, slot as usize);
        self.hazard_free.set(self.hazard_free.get() | 1 << slot);
    }

    /// Copy one page's bytes out with `copy` (given the frame's address).
    fn read_page(
        &self,
        key: Key,
        entry: Option<Instant>,
        mut copy: impl FnMut(*const u8),
    ) -> Result<(), CacheError> {
        if self.try_hit(key, &mut copy)? {
            return Ok(());
        }
        self.read_missing(key, entry, copy)
    }

    /// [`Self::read_page`] for a page just looked up and not found: the miss first, the index
    /// again only when another reader's frame turned up meanwhile.
    fn read_missing(
        &self,
        key: Key,
        entry: Option<Instant>,
        mut copy: impl FnMut(*const u8),
    ) -> Result<(), CacheError> {
        loop {
            if let Some((frame, abandoned)) = self.miss(key, entry)? {
                copy(self.cache.frame_ptr(frame));
                self.unpin(frame, abandoned);
                return Ok(());
            }
            if self.try_hit(key, &mut copy)? {
                return Ok(());
            }
        }
    }

    /// The frame standing for `key` in the index. The first lines of each candidate frame are
    /// prefetched as soon as its slot is read, so the frame's bytes are on their way while its
    /// key and state load (a hit on a page that left the CPU's caches would otherwise wait for
    /// the two one after the other).
    #[inline]
    fn lookup(&self, key: Key) -> Option<u32> {
        let cache = &*self.cache;
        cache.index.get_seeing(key, &cache.frames, |frame| {
            prefetch_lines(cache.frame_ptr(frame))
        })
    }

    /// Copy a resident page out with `copy`: `false` when the page is not in the index. A page
    /// being read or written is waited for.
    fn try_hit(&self, key: Key, mut copy: impl FnMut(*const u8)) -> Result<bool, CacheError> {
        let frames = &self.cache.frames;
        loop {
            let Some(frame) = self.lookup(key) else {
                return Ok(false);
            };
            let s1 = frames.state(frame);
            // In the index too: a stale lookup's frame may hold the page abandoned (see
            // `protect`), in a `store` race with the old bytes.
            if s1.has(frames::VALID | frames::INDEXED)
                && !s1.has(frames::BUSY)
                && frames.key(frame) == key.0
            {
                copy(self.cache.frame_ptr(frame));
                // The copy's loads are ordered before the second state load (on x86-64 only
                // the compiler needed telling; weaker CPUs could take them after it).
                std::sync::atomic::fence(Ordering::Acquire);
                let s2 = frames.state(frame);
                // Optimistic read: valid only if nobody changed the frame meanwhile.
                if s2.version() == s1.version() && s2.has(frames::VALID) && !s2.has(frames::BUSY) {
                    frames.mark(frame, frames::REFERENCED);
                    self.count_hit();
                    return Ok(true);
                }
                continue;
            }
            if !self.wait_for(frame, self.reader_cut())? {
                // Another handle's read is slow to complete: a miss reads it here.
                return Ok(false);
            }
        }
    }

    /// How long a reader waits for another handle's read before reading the page itself
    /// ([`Self::wait_for`]): `foreign_read_wait_us` in a lazy-indexing mode; without limit in
    /// the vanilla order, where a miss that finds the page indexed waits for it anyway.
    fn reader_cut(&self) -> Option<Duration> {
        self.mode
            .lazy_index
            .then(|| Duration::from_micros(self.cache.cfg.foreign_read_wait_us as u64))
    }

    /// A frame found in the index but not readable yet (being read, being written): wait for it
    /// to settle, driving this handle's I/O meanwhile (it may be ours). `Ok(false)`: after
    /// `cut`, a read that is another handle's is still in flight, and the caller should read
    /// the page itself: that handle's read completes only when it next drives its engine. A
    /// read of this handle's own is waited for however long the device takes (reading it again
    /// would only add to the device's load).
    fn wait_for(&self, frame: u32, cut: Option<Duration>) -> Result<bool, CacheError> {
        let before = self.cache.frames.state(frame);
        self.cache.counters.waited.fetch_add(1, Ordering::Relaxed);
        let limit = cut.map(|d| Instant::now() + d);
        let mut rounds = 0u32;
        loop {
            self.poll()?;
            let now = self.cache.frames.state(frame);
            if now != before || !now.has(frames::IO) {
                return Ok(true);
            }
            rounds += 1;
            if let Some(limit) = limit {
                // A read (not a writeback: its bytes are valid and newer than the device's).
                if !now.has(frames::VALID) && rounds % 8 == 0 && Instant::now() >= limit {
                    if self.reads_frame(frame) {
                        return self.wait_for(frame, None);
                    }
                    self.cache
                        .counters
                        .foreign_waits_cut
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(false);
                }
            }
            if self.engine.has_work() {
                self.engine.wait(1)?;
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Whether one of this handle's reads in flight (readahead included) reads into `frame`.
    /// A scan of the pending table: only for a wait that has run long.
    fn reads_frame(&self, frame: u32) -> bool {
        let run = self.run_frames.borrow();
        self.pending.borrow().iter().flatten().any(|p| {
            matches!(p.kind, Kind::Read | Kind::Readahead | Kind::Orphan)
                && (p.frame == frame
                    || run[p.run_at as usize..(p.run_at + p.run_len) as usize].contains(&frame))
        })
    }

    /// A frame for a miss: from the pool (refilled later, off the critical path) or, without a
    /// pool, from the shared free list under its lock (evicting when it is empty).
    fn take_frame(&self) -> Result<u32, CacheError> {
        if self.mode.pool {
            if let Some(f) = self.pool.borrow_mut().pop() {
                return Ok(f);
            }
            self.refill()?;
            return self
                .pool
                .borrow_mut()
                .pop()
                .ok_or(CacheError::NoEvictableFrame {
                    frames: self.cache.frames.len(),
                });
        }
        self.take_shared()
    }

    fn take_shared(&self) -> Result<u32, CacheError> {
        self.reclaim_retired();
        match self.cache.take_one() {
            Err(CacheError::NoEvictableFrame { .. }) => {
                // A failed write back (of any attached file) may still have cleaned others:
                // report it only when no frame can be taken after it.
                let written = self.writeback_all();
                self.flush_release();
                match self.cache.take_one() {
                    Ok(f) => Ok(f),
                    Err(e) => Err(written.err().unwrap_or(e)),
                }
            }
            r => r,
        }
    }

    /// Fill the pool up to one batch: free frames first, then evictions.
    fn refill(&self) -> Result<(), CacheError> {
        let batch = self.cache.cfg.pool_batch as usize;
        self.reclaim_retired();
        self.flush_release();
        let mut pool = self.pool.borrow_mut();
        if pool.len() >= batch {
            return Ok(());
        }
        let want = batch - pool.len();
        let got = self.cache.take_free(&mut pool, want);
        for _ in got..want {
            match self.cache.evict_one() {
                Ok(f) => pool.push(f),
                Err(e) if pool.is_empty() => {
                    drop(pool);
                    // Everything left is dirty: write it back, then the frames are evictable.
                    // A failed write back may still have cleaned other pages: report it
                    // only when nothing can be evicted after it.
                    let written = self.writeback_all();
                    let f = self
                        .cache
                        .evict_one()
                        .map_err(|_| written.err().unwrap_or(e))?;
                    self.pool.borrow_mut().push(f);
                    return Ok(());
                }
                Err(_) => break,
            }
        }
        Ok(())
    }

    /// Lazy release: give the batch of freed frames back at once.
    fn flush_release(&self) {
        let mut r = self.release.borrow_mut();
        if self.mode.pool {
            // Keep them for this handle's own pool first.
            let mut pool = self.pool.borrow_mut();
            let room = (2 * self.cache.cfg.pool_batch as usize).saturating_sub(pool.len());
            let k = room.min(r.len());
            let at = r.len() - k;
            pool.extend(r.drain(at..));
        }
        self.cache.give_free(&mut r);
    }

    /// Free a frame this handle owns (no pins, out of the index).
    fn free_frame(&self, frame: u32) {
        let frames = &self.cache.frames;
        frames.meta(frame).key.store(NO_KEY, Ordering::Release);
        frames.update(frame, |s| {
            Some(State::new(s.version().wrapping_add(1), 0, 0))
        });
        if self.mode.pool {
            let mut r = self.release.borrow_mut();
            r.push(frame);
            if r.len() >= self.cache.cfg.pool_batch as usize {
                drop(r);
                self.flush_release();
            }
        } else {
            self.cache.give_one(frame);
        }
    }

    /// Drop a reader's (or guard's) pin on `frame`, and free the frame if it is not to stay
    /// cached (`abandoned`, or flagged abandoned, failed or replaced) and this unpin let go of
    /// it last: no pin left, its read done, and out of the index. A frame a writer superseded
    /// stays flagged indexed until that writer has taken it out of the index; the writer frees
    /// it then if no pin is left (see [`Self::supersede`]), so exactly one of them does. A
    /// lost frame a `store` replaced ([`frames::REPLACED`]; a guard pinned by count held it)
    /// may be held by a zero-copy guard too: see [`Self::free_unindexed`].
    fn unpin(&self, frame: u32, abandoned: bool) {
        let now = self.cache.frames.unpin(frame);
        if (abandoned || now.flags() & (frames::ABANDONED | frames::FAILED | frames::REPLACED) != 0)
            && now.pins() == 0
            && now.flags() & (frames::IO | frames::INDEXED) == 0
        {
            if now.has(frames::REPLACED) {
                self.free_unindexed(frame);
            } else {
                self.free_frame(frame);
            }
        }
    }

    /// The first `len` bytes of a frame as request memory: registered (the cache's region) or
    /// plain, by mode.
    ///
    /// # Safety
    /// The caller owns the frame's bytes for the request's lifetime (see [`RawBuf::new`]).
    unsafe fn frame_buf(&self, frame: u32, len: usize) -> RawBuf {
        let ptr = NonNull::new(self.cache.frame_ptr(frame)).expect("frames are mapped");
        // SAFETY: the frame lies in the region registered as `region_index`; ownership is the
        // caller's contract.
        unsafe {
            RawBuf::new(
                ptr,
                len.min(PAGE_BYTES) as u32,
                self.mode.fixed.then_some(self.region_index),
            )
        }
    }

    /// `frames` as a scattered request's memory: one page each, the last `last_len` bytes of
    /// its frame, described in `iov` (registered or plain, by mode, like [`Self::frame_buf`]).
    ///
    /// # Safety
    /// The caller owns the frames' bytes for the request's lifetime and keeps `iov` in place,
    /// unchanged, until it completes (see [`RawIov::new`]).
    unsafe fn frames_iov(
        &self,
        frames: &[u32],
        iov: &mut [libc::iovec],
        last_len: usize,
    ) -> RawIov {
        for (slot, &f) in iov.iter_mut().zip(frames) {
            *slot = libc::iovec {
                iov_base: self.cache.frame_ptr(f).cast(),
                iov_len: PAGE_BYTES,
            };
        }
        if let Some(last) = iov[..frames.len()].last_mut() {
            last.iov_len = last_len.min(PAGE_BYTES);
        }
        let ptr = NonNull::new(iov.as_mut_ptr()).expect("a non-empty slice");
        // SAFETY: the frames lie in the region registered as `region_index`; the rest is the
        // caller's contract.
        unsafe {
            RawIov::new(
                ptr,
                frames.len() as u16,
                self.mode.fixed.then_some(self.region_index),
            )
        }
    }

    /// Serve a miss: `Some((frame, abandoned))` with the frame pinned and valid, or `None` when
    /// another reader's frame for the page turned up (the caller looks again).
    fn miss(&self, key: Key, entry: Option<Instant>) -> Result<Option<(u32, bool)>, CacheError> {
        let file = FileId(key.file());
        let dev = self.device(file)?;
        let Some((frame, removals)) = self.start_read(key, &dev)? else {
            return Ok(None);
        };
        // The SQE is in the ring: what is timed ends here, as it enters the kernel.
        self.record_submit(entry);
        // A failed submit leaves the read queued in the ring (nothing takes an SQE back): it
        // goes in with the next call, so the frame is the read's until it completes. Wait for
        // it like any other, then report the failure.
        let submitted = self.engine.submit();
        self.count_misses(1);
        // The work the reader does not need before the device answers.
        let abandoned = self.index_late(key, frame, removals);
        let after = match submitted {
            Ok(()) => self.after_submit(file, key.page(), key.page(), &dev),
            Err(e) => Err(e.into()),
        };
        self.finish_read(frame, abandoned)?;
        // A writer may have superseded the frame while its read was in flight (only then: see
        // `supersede`), so the flag is final now. Such a frame is the reader's alone, as an
        // abandoned one is.
        let abandoned = abandoned || self.cache.frames.state(frame).has(frames::ABANDONED);
        if let Err(e) = after {
            self.unpin(frame, abandoned);
            return Err(e);
        }
        Ok(Some((frame, abandoned)))
    }

    /// Take a frame for `key` and queue its read, held (it reaches the kernel with the caller's
    /// next submit): the frame, pinned, and its index line's removal count from before the
    /// read (for [`Self::index_late`]), or `None` when the vanilla order found the page
    /// already indexed by another reader.
    fn start_read(&self, key: Key, dev: &Device) -> Result<Option<(u32, u32)>, CacheError> {
        self.settle_orphans()?;
        let Some(frame) = self.claim_frame(key)? else {
            return Ok(None);
        };
        let removals = self.cache.index.removals(key);
        self.run_frames.borrow_mut()[0] = frame;
        self.submit_read(key, 0, 1, dev)?;
        Ok(Some((frame, removals)))
    }

    /// Take a frame for `key`, pinned and flagged in I/O (in the vanilla order also indexed
    /// now): `None` when the vanilla order found the page already indexed by another reader.
    fn claim_frame(&self, key: Key) -> Result<Option<u32>, CacheError> {
        let cache = &*self.cache;
        let frames = &cache.frames;
        let frame = self.take_frame()?;
        frames.meta(frame).key.store(key.0, Ordering::Release);
        let v = frames.state(frame).version().wrapping_add(1);
        frames.set_owned(frame, State::new(v, 1, frames::IO));
        if !self.mode.lazy_index {
            // Vanilla order: index first, then submit.
            if let Insert::Present(_) = cache.index.insert(key, frame, frames) {
                frames.unpin(frame);
                self.free_frame(frame);
                return Ok(None);
            }
            frames.mark(frame, frames::INDEXED);
        }
        Ok(Some(frame))
    }

    /// Give back claimed frames `run_frames[at..at + len]` (pages `first..`) that will not be
    /// read.
    fn undo_claims(&self, file: FileId, first: u64, at: usize, len: usize) {
        for k in 0..len {
            let frame = self.run_frames.borrow()[at + k];
            let key = Key::new(file.0, first + k as u64);
            // In the vanilla order the frame is indexed already.
            self.drop_unsent(key, frame, true, !self.mode.lazy_index);
        }
    }

    /// Give back `frame`, claimed for a read of `key` that was never sent (`pinned` by the
    /// caller's claim; `indexed` already, in the vanilla order and for readahead). A writer may
    /// have superseded it meanwhile (see [`Self::supersede`]): then the index entry is the
    /// writer's to remove, and of the two the later to let go of the frame frees it.
    fn drop_unsent(&self, key: Key, frame: u32, pinned: bool, indexed: bool) {
        let frames = &self.cache.frames;
        if indexed {
            self.cache.index.remove(key, frame);
        }
        let now = frames
            .update(frame, |s| {
                let gone = if s.has(frames::ABANDONED) {
                    frames::IO
                } else {
                    frames::IO | frames::INDEXED
                };
                let pins = s.pins() - pinned as u16;
                Some(s.with_flags(s.flags() & !gone).with_pins(pins).bumped())
            })
            .expect("always updated");
        if now.pins() == 0 && !now.has(frames::INDEXED) {
            self.free_frame(frame);
        }
    }

    /// Queue, held, the read of the `len` pages from `first` into their claimed frames
    /// `run_frames[at..at + len]`: one request for them all, scattered over the frames. On
    /// failure the frames are given back.
    fn submit_read(
        &self,
        first: Key,
        at: usize,
        len: usize,
        dev: &Device,
    ) -> Result<Tag, CacheError> {
        let offset = first.page() * PAGE_BYTES as u64;
        let frame = self.run_frames.borrow()[at];
        // The run's last page may be the file's, cut short by the device's end.
        let last_frame = self.run_frames.borrow()[at + len - 1];
        let last_at = offset + (len as u64 - 1) * PAGE_BYTES as u64;
        let last_len = self.tail_read_len(dev, last_frame, last_at);
        let io = if len == 1 {
            // SAFETY: the frame is ours (taken from the pool or free list, pinned, flagged IO):
            // nobody reads or writes its bytes until the IO flag clears at completion.
            let raw = unsafe { self.frame_buf(frame, last_len) };
            // SAFETY: as above, for the request's lifetime.
            unsafe { Io::read_raw(offset, raw) }
        } else {
            let mut iov = self.run_iov.borrow_mut();
            let run = self.run_frames.borrow();
            // SAFETY: the frames are ours, as above; the iovecs stay put (boxed, rewritten only
            // by a later multi-page read, which starts after every read of this one has
            // completed).
            let v =
                unsafe { self.frames_iov(&run[at..at + len], &mut iov[at..at + len], last_len) };
            // SAFETY: as above.
            unsafe { Io::readv_raw(offset, v) }
        };
        match self.engine.hold_submissions(|| dev.submit(io)) {
            Ok(tag) => {
                self.pending.borrow_mut()[tag.0 as usize] = Some(Pending {
                    frame,
                    run_at: if len > 1 { at as u16 } else { 0 },
                    run_len: if len > 1 { len as u16 } else { 0 },
                    kind: Kind::Read,
                    parked: false,
                });
                Ok(tag)
            }
            Err((e, _)) => {
                self.undo_claims(FileId(first.file()), first.page(), at, len);
                Err(e.into())
            }
        }
    }

    /// Lazy indexing, after the read was submitted: insert the frame, or mark it abandoned when
    /// another reader's frame for the page got there first (returns whether it was abandoned).
    ///
    /// Also abandoned when an entry of the page's index line left the index since `removals`
    /// was read, before the read was queued: that entry may have been a newer copy of the page
    /// (written and written back, or stored, then evicted, all while the read was in flight),
    /// and the read's bytes, from before it, would then stay cached for good.
    fn index_late(&self, key: Key, frame: u32, removals: u32) -> bool {
        if !self.mode.lazy_index {
            return false;
        }
        let cache = &*self.cache;
        // Completions are taken on this thread only: a read that already failed (its completion
        // taken by a poll since the submit, a pool refill's writeback say) stays out of the
        // index, where its completion could not remove it; one still in flight is removed by
        // its completion.
        if cache.frames.state(frame).has(frames::FAILED) {
            return false;
        }
        match cache
            .index
            .insert_unless_removed(key, frame, &cache.frames, removals)
        {
            Insert::Inserted => {
                cache.frames.mark(frame, frames::INDEXED);
                false
            }
            Insert::Present(_) => {
                cache.frames.mark(frame, frames::ABANDONED);
                cache.counters.duplicates.fetch_add(1, Ordering::Relaxed);
                true
            }
            Insert::Stale => {
                cache.frames.mark(frame, frames::ABANDONED);
                true
            }
        }
    }

    /// The rest of the work a miss does while its read is in flight: refill the pool when it
    /// runs low, and read ahead of a sequential stream.
    fn after_submit(
        &self,
        file: FileId,
        first: u64,
        last: u64,
        dev: &Device,
    ) -> Result<(), CacheError> {
        if self.mode.pool
            && self.pool.borrow().len() < self.cache.cfg.pool_batch as usize / 2
            && self.refill().is_err()
        {
            // The refill is for later misses: this one holds its frames already. Nothing to
            // evict (this read's own frames may be why), or a failed write back of other pages
            // (they stay dirty, and the next `sync` writes them and reports it), is no failure
            // of this read; the next miss that needs a frame refills again and reports its own.
            self.cache
                .counters
                .refills_failed
                .fetch_add(1, Ordering::Relaxed);
        }
        self.readahead(file, first, last, dev)
    }

    /// Take a read of `key` still in flight in `frame` (a reader's, an orphaned one's, or a
    /// readahead; this handle's or another's) out of the page's service, for a writer (see
    /// [`Self::put`]): the writer then puts the page in a frame of its own and never waits for
    /// that read, which only the handle that sent it completes, when that handle next drives
    /// its engine (it may be idle, or its wait may have failed).
    ///
    /// Three steps. The frame is flagged abandoned while still indexed and in I/O (one update,
    /// so the read's completion, which ends the I/O in an update of its own, sees it either
    /// before or after, never in between); it leaves the index; it loses its indexed flag. The
    /// completion of a read so flagged leaves the frame invalid while it is still flagged
    /// indexed (nobody can find it valid), and never clears that flag. The read's reader still
    /// gets the bytes it read, as a reader whose frame was abandoned as a duplicate does. Of
    /// this writer, the completion and the reader, the one whose own step leaves the frame with
    /// no pin, no I/O and out of the index frees it.
    ///
    /// `false` when the frame is no such read now: done (the caller looks again), not indexed
    /// yet (its reader is between its insert and its flag) or being superseded by another
    /// writer.
    fn supersede(&self, key: Key, frame: u32) -> bool {
        let frames = &self.cache.frames;
        let taken = frames.update(frame, |s| {
            (s.has(frames::IO | frames::INDEXED)
                && s.flags() & (frames::VALID | frames::ABANDONED) == 0
                && frames.key(frame) == key.0)
                .then(|| s.with_flags(s.flags() | frames::ABANDONED).bumped())
        });
        let Some(taken) = taken else {
            return false;
        };
        self.cache.index.remove(key, frame);
        let now = frames
            .update(frame, |s| {
                Some(s.with_flags(s.flags() & !frames::INDEXED).bumped())
            })
            .expect("always updated");
        // A reader's frame carries its reader's pin while its read is in flight; a
        // readahead's carries none.
        let counter = if taken.pins() == 0 {
            &self.cache.counters.readahead_stolen
        } else {
            &self.cache.counters.reads_superseded
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if now.pins() == 0 && !now.has(frames::IO) {
            self.free_frame(frame);
        }
        true
    }

    /// Wait for a miss's read; on failure the frame is released and the error returned.
    fn finish_read(&self, frame: u32, abandoned: bool) -> Result<(), CacheError> {
        match self.wait_frame(frame) {
            Ok(false) => Ok(()),
            Ok(true) => {
                self.unpin(frame, true);
                Err(self.take_error())
            }
            Err(e) => {
                // The engine failed with the read in flight: its completion releases the frame.
                self.orphan_reads([(frame, abandoned)].into_iter());
                Err(e)
            }
        }
    }

    /// A reader gives up on its reads (its wait for the engine failed): every read of this
    /// handle's still in flight becomes an orphan, whose completion releases its frames (unpins
    /// them, and frees them if abandoned or failed); of `unfinished` (frame, abandoned), those
    /// already done are released now.
    fn orphan_reads(&self, unfinished: impl Iterator<Item = (u32, bool)>) {
        let mut n = 0;
        for p in self.pending.borrow_mut().iter_mut().flatten() {
            if p.kind == Kind::Read {
                p.kind = Kind::Orphan;
                n += 1;
            }
        }
        self.orphans.set(self.orphans.get() + n);
        let frames = &self.cache.frames;
        for (frame, abandoned) in unfinished {
            let s = frames.state(frame);
            if s.has(frames::IO) {
                continue;
            }
            self.unpin(frame, abandoned);
        }
        self.read_error.borrow_mut().take();
    }

    /// Wait until no orphaned read is in flight: their runs name `run_frames` and `run_iov`,
    /// which a new read is about to rewrite.
    fn settle_orphans(&self) -> Result<(), CacheError> {
        if self.orphans.get() == 0 {
            return Ok(());
        }
        self.settle(|p| p.kind == Kind::Orphan)
    }

    /// Wait, trying a failed wait again ([`Engine::wait_retrying`]), until no request of this
    /// handle's that `which` picks is in flight.
    fn settle(&self, which: impl Fn(&Pending) -> bool) -> Result<(), CacheError> {
        let busy = || self.pending.borrow().iter().flatten().any(&which);
        while busy() {
            self.engine.wait_retrying()?;
            self.poll()?;
            if busy() && !self.engine.has_work() && self.lbio.done_len() == 0 {
                return Err(CacheError::Config(
                    "requests in flight that the engine does not hold".into(),
                ));
            }
        }
        Ok(())
    }

    /// Readahead for sequential streams: when a miss on pages `first..=last` continues the
    /// previous one, read the next `readahead_pages` as background requests. Random access never
    /// reaches the threshold.
    fn readahead(
        &self,
        file: FileId,
        first: u64,
        last: u64,
        dev: &Device,
    ) -> Result<(), CacheError> {
        let ra = self.cache.cfg.readahead_pages as u64;
        if ra == 0 {
            return Ok(());
        }
        let (sequential, next) = {
            let mut streams = self.streams.borrow_mut();
            let s = &mut streams[file.0 as usize];
            if first == s.next_page && first > 0 {
                s.run += 1;
            } else {
                s.run = 0;
            }
            s.next_page = last + 1;
            (s.run >= 1, last + 1)
        };
        if !sequential {
            return Ok(());
        }
        let size = self.attached(file)?.size;
        let last = size.div_ceil(PAGE_BYTES as u64);
        let frames = &self.cache.frames;
        for page in next..(next + ra).min(last) {
            let k = Key::new(file.0, page);
            if self.cache.index.get(k, frames).is_some() {
                continue;
            }
            // Readahead is optional: none past its share of the cache, or without a frame.
            if !self.cache.reserve_readahead() {
                return Ok(());
            }
            let Ok(frame) = self.take_frame() else {
                self.cache.end_readahead();
                return Ok(());
            };
            frames.meta(frame).key.store(k.0, Ordering::Release);
            frames.update(frame, |s| {
                Some(State::new(s.version().wrapping_add(1), 0, frames::IO))
            });
            if let Insert::Present(_) = self.cache.index.insert(k, frame, frames) {
                self.free_frame(frame);
                self.cache.end_readahead();
                continue;
            }
            frames.mark(frame, frames::INDEXED);
            let len = self.tail_read_len(dev, frame, page * PAGE_BYTES as u64);
            // SAFETY: the frame is ours and flagged IO until the completion clears it.
            let raw = unsafe { self.frame_buf(frame, len) };
            // SAFETY: as above.
            let io =
                unsafe { Io::read_raw(page * PAGE_BYTES as u64, raw) }.class(Class::Background);
            match dev.submit(io) {
                Ok(tag) => {
                    self.pending.borrow_mut()[tag.0 as usize] = Some(Pending {
                        frame,
                        run_at: 0,
                        run_len: 0,
                        kind: Kind::Readahead,
                        parked: false,
                    });
                    self.cache
                        .counters
                        .readahead_pages
                        .fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    // No slot: readahead is optional. Undo.
                    self.drop_unsent(k, frame, false, true);
                    self.cache.end_readahead();
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Process finished requests of this handle.
    pub fn poll(&self) -> Result<(), CacheError> {
        while let Some(c) = self.lbio.take_done() {
            self.complete(c.tag, c.result.err());
        }
        Ok(())
    }

    fn complete(&self, tag: Tag, error: Option<LbioError>) {
        let frames = &self.cache.frames;
        let mut pending = self.pending.borrow_mut();
        let Some(p) = pending[tag.0 as usize].as_mut() else {
            drop(pending);
            self.complete_lost(tag, error.is_some());
            return;
        };
        let frame = p.frame;
        // A run's frame list is borrowed only for runs (most completions are single pages).
        let (run, wb);
        let (at, len) = (p.run_at as usize, p.run_len as usize);
        let list = match (len, p.kind) {
            (0, _) => std::slice::from_ref(&p.frame),
            (_, Kind::Writeback) => {
                wb = self.wb.borrow();
                &wb.frames[at..at + len]
            }
            _ => {
                run = self.run_frames.borrow();
                &run[at..at + len]
            }
        };
        // A read a writer superseded ([`Self::supersede`]): its frame only leaves I/O, invalid
        // if the writer has not taken it out of the index yet (so nobody can find it valid
        // there), and the index is the writer's to change. Decided in the same update that
        // ends the I/O, so a writer cannot slip in between. (A readahead is abandoned only so;
        // a reader's frame also when it lost the indexing race, never indexed then.)
        let mut stolen = false;
        for &frame in list {
            if p.parked {
                // Before the pin goes: a writer that finds the pin finds the count too, or
                // waits a moment for the pin.
                frames.meta(frame).parked.fetch_sub(1, Ordering::SeqCst);
            }
            let readahead = p.kind == Kind::Readahead;
            let now = match (p.kind, &error) {
                (Kind::Read | Kind::Orphan, None) | (Kind::Readahead, None) => {
                    frames.update(frame, |s| {
                        let superseded =
                            s.has(frames::ABANDONED) && (readahead || s.has(frames::INDEXED));
                        stolen = readahead && superseded;
                        Some(if superseded {
                            s.with_flags(s.flags() & !frames::IO).bumped()
                        } else {
                            s.with_flags((s.flags() & !frames::IO) | frames::VALID)
                                .bumped()
                        })
                    })
                }
                (Kind::Read | Kind::Orphan, Some(_)) | (Kind::Readahead, Some(_)) => {
                    // Leave no poisoned page behind: out of the index before anyone can wait
                    // on it. (Of a superseded frame's removal and this one, the second finds
                    // nothing: the frame is not freed before both are done.)
                    let key = Key(frames.key(frame));
                    self.cache.index.remove(key, frame);
                    self.cache
                        .counters
                        .read_errors
                        .fetch_add(1, Ordering::Relaxed);
                    frames.update(frame, |s| {
                        stolen = readahead && s.has(frames::ABANDONED);
                        // A superseded frame keeps its indexed flag for the writer to clear.
                        let gone = if s.has(frames::ABANDONED) {
                            frames::IO
                        } else {
                            frames::IO | frames::INDEXED
                        };
                        Some(s.with_flags((s.flags() & !gone) | frames::FAILED).bumped())
                    })
                }
                (Kind::Writeback, None) => {
                    frames.update(frame, |s| Some(s.with_flags(s.flags() & !frames::DIRTY)));
                    self.unpin_written(frame);
                    self.cache
                        .counters
                        .writebacks
                        .fetch_add(1, Ordering::Relaxed);
                    None
                }
                (Kind::Writeback, Some(_)) => {
                    self.unpin_written(frame);
                    None
                }
            };
            // A stolen readahead frame (unpinned) the writer has taken out of the index
            // already: freed here (else by the writer, once it has).
            if stolen && now.is_some_and(|n| !n.has(frames::INDEXED)) {
                self.free_frame(frame);
            }
            // An orphan's frame: what its reader would have done with it (freed if failed,
            // abandoned or superseded, and let go of last).
            if p.kind == Kind::Orphan {
                self.unpin(frame, error.is_some());
            }
        }
        match p.kind {
            Kind::Read => {
                // The reader waits on the frames' state, not on the tag: lbio may hand the
                // tag to another request as soon as this one is taken.
                pending[tag.0 as usize] = None;
                if let Some(e) = error {
                    self.read_error.borrow_mut().replace(e);
                }
            }
            Kind::Readahead => {
                let failed = error.is_some();
                pending[tag.0 as usize] = None;
                drop(pending);
                self.cache.end_readahead();
                // A stolen frame was dealt with above.
                if failed && !stolen {
                    self.free_frame(frame);
                }
            }
            Kind::Writeback => {
                pending[tag.0 as usize] = None;
                if let Some(e) = error {
                    self.last_error.borrow_mut().replace(e);
                }
            }
            Kind::Orphan => {
                pending[tag.0 as usize] = None;
                self.orphans.set(self.orphans.get() - 1);
            }
        }
    }

    /// Drive I/O until the read into `frame` (pinned by the caller) completes; whether it
    /// failed.
    fn wait_frame(&self, frame: u32) -> Result<bool, CacheError> {
        loop {
            self.poll()?;
            let s = self.cache.frames.state(frame);
            if !s.has(frames::IO) {
                return Ok(s.has(frames::FAILED));
            }
            self.engine.wait(1)?;
        }
    }

    /// Bytes to read into `frame` for the page at `offset`: a whole page, or as much as the
    /// device holds when the page runs past its end (the last page of a file whose size is not a
    /// whole number of pages, on a device of that size). The rest of the frame is zeroed then, so
    /// a guard on the page never shows another page's bytes.
    fn tail_read_len(&self, dev: &Device, frame: u32, offset: u64) -> usize {
        let len = device_len(dev, offset);
        if len < PAGE_BYTES {
            // SAFETY: the frame is ours (claimed for this read, flagged IO, not yet submitted):
            // nobody else reads or writes its bytes; `len < PAGE_BYTES` keeps the range inside it.
            unsafe {
                std::ptr::write_bytes(self.cache.frame_ptr(frame).add(len), 0, PAGE_BYTES - len)
            };
        }
        len
    }

    fn take_error(&self) -> CacheError {
        match self.read_error.borrow_mut().take() {
            Some(e) => CacheError::Io(e),
            None => CacheError::Config("read failed without an error".into()),
        }
    }
}

impl CacheHandle {
    /// Write `data` into `file` at `offset` through the cache (pages become dirty; [`Self::sync`]
    /// makes them durable).
    pub fn write(&self, file: FileId, offset: u64, data: &[u8]) -> Result<(), CacheError> {
        self.put(file, offset, data, true)
    }

    /// Record that the device now holds `data` at `offset` of `file`, written there by the
    /// caller without the cache (a journal's in-place data write, say): the pages are cached
    /// clean, replacing any copy the cache had, so later reads hit and none returns the bytes
    /// the device held before. Whole pages only (`offset` and the length multiples of
    /// [`PAGE_BYTES`]); a page that is dirty in the cache is replaced and becomes clean.
    ///
    /// Call it after the device write completed. A read that missed on one of these pages
    /// before then may have read the old bytes; its frame is either not indexed yet (this call
    /// indexes the new bytes first and the read's frame is abandoned) or indexed and in flight
    /// (this call supersedes it without waiting: the frame leaves the index and the new bytes go
    /// into a frame of their own), so the old bytes never stay in the cache.
    pub fn store(&self, file: FileId, offset: u64, data: &[u8]) -> Result<(), CacheError> {
        let page = PAGE_BYTES as u64;
        if offset % page != 0 || data.len() % PAGE_BYTES != 0 {
            return Err(CacheError::Config(format!(
                "store of {} bytes at offset {offset}: offset and length must be multiples of {PAGE_BYTES}",
                data.len()
            )));
        }
        self.put(file, offset, data, false)
    }

    /// [`Self::write`] (`dirty`) or [`Self::store`].
    fn put(&self, file: FileId, offset: u64, data: &[u8], dirty: bool) -> Result<(), CacheError> {
        self.check_range(file, offset, data.len())?;
        let frames = &self.cache.frames;
        let mut done = 0usize;
        // The page whose lost frame this `store` took out of the index: its copy is flagged
        // `REWRITE` (see `frames::REWRITE`).
        let mut took_lost: Option<u64> = None;
        // How long to wait for another handle's read of a page before superseding it, and the
        // page it is for: doubled each time this call supersedes a read of that page again
        // (see below), and back to `foreign_read_wait_us` on the next page.
        let first_patience = self.cache.cfg.foreign_read_wait_us as u64;
        let mut patience = (u64::MAX, first_patience);
        while done < data.len() {
            let at = offset + done as u64;
            let page = at / PAGE_BYTES as u64;
            let in_page = (at % PAGE_BYTES as u64) as usize;
            let n = (PAGE_BYTES - in_page).min(data.len() - done);
            let key = Key::new(file.0, page);
            let frame = match self.cache.index.get(key, frames) {
                Some(f) => f,
                None if n == PAGE_BYTES => {
                    // A whole page: no need to read it first.
                    let f = self.take_frame()?;
                    frames.meta(f).key.store(key.0, Ordering::Release);
                    frames.update(f, |s| {
                        Some(State::new(
                            s.version().wrapping_add(1),
                            0,
                            frames::VALID | frames::BUSY,
                        ))
                    });
                    if let Insert::Present(_) = self.cache.index.insert(key, f, frames) {
                        self.free_frame(f);
                        continue;
                    }
                    frames.mark(f, frames::INDEXED);
                    let rewrite = took_lost == Some(page);
                    self.fill(f, in_page, &data[done..done + n], dirty, rewrite);
                    if rewrite {
                        self.end_rewrite_unless_lost(key, f);
                    }
                    done += n;
                    continue;
                }
                None => {
                    // Part of a page: bring it in, then modify it (the loop finds it). A miss
                    // of its own, not `read_page`: a reader that finds another handle's read
                    // of the page in flight waits for it (in the vanilla order, where that read
                    // was indexed before it was sent, without limit), and a writer waits for no
                    // read. When the vanilla order finds the page indexed meanwhile (`None`),
                    // the loop looks again and supersedes that read below.
                    if let Some((f, abandoned)) = self.miss(key, None)? {
                        self.unpin(f, abandoned);
                    }
                    continue;
                }
            };
            // Take the frame exclusively: valid, in the index (not a stale lookup's abandoned
            // frame: see `protect`), not in flight, no pins.
            let claimed = frames.update(frame, |s| {
                (s.has(frames::VALID | frames::INDEXED)
                    && s.flags() & (frames::IO | frames::BUSY) == 0
                    && s.pins() == 0
                    && frames.key(frame) == key.0)
                    .then(|| s.with_flags(s.flags() | frames::BUSY).bumped())
            });
            if claimed.is_none() {
                let s = frames.state(frame);
                // A read in flight, whichever handle sent it: not waited for. Such a read
                // completes only when its handle next drives its engine, which may be never
                // (its thread idle, or waiting for this very write, or its wait failed). Its
                // frame is superseded (its reader still gets what it read) and the page goes
                // into a frame of this writer's own: as a whole page, or read first.
                //
                // A reader's read (it holds its reader's pin) is waited for a while first,
                // `foreign_read_wait_us`, twice as long each time this call supersedes a read of
                // the same page again: two writers of parts of one page that is not cached each
                // read it first, and each could supersede the other's read for ever, one's read
                // going out as the other's lands. A live reader's read lands within the
                // device's time; the growing wait outlasts it. Readahead (no pin, nobody
                // waiting for it, its handle maybe idle) is superseded at once, as before.
                if s.has(frames::IO) && !s.has(frames::VALID) && frames.key(frame) == key.0 {
                    if s.pins() > 0 {
                        if patience.0 != page {
                            patience = (page, first_patience);
                        }
                        if self.wait_for(frame, Some(Duration::from_micros(patience.1)))? {
                            continue;
                        }
                        patience.1 = patience.1.saturating_mul(2).min(MAX_WRITER_PATIENCE_US);
                    }
                    if !self.supersede(key, frame) {
                        // Being indexed by its reader, or superseded by another writer, now.
                        std::thread::yield_now();
                    }
                    continue;
                }
                // Pinned by a guard of this handle's own: it would never go.
                if s.pins() > 0 && self.own_pins.borrow().contains_key(&frame) {
                    return Err(CacheError::GuardHeld { file, page });
                }
                // Pinned for good by a write back a dropped handle gave up on.
                if s.has(frames::LOST) && frames.key(frame) == key.0 {
                    if dirty {
                        return Err(CacheError::WritebackLost { file, page });
                    }
                    // A `store`: the device holds newer bytes than the lost frame, which must
                    // neither be read nor written back over them. It leaves the index, clean
                    // and flagged `REPLACED`, and the page goes into a frame of its own; the
                    // frame itself is freed by whoever lets go of it last: the lost write's
                    // completion (see `complete_lost`), a guard pinned by count, or this
                    // store. Held BUSY meanwhile, so that of two such stores one takes it, and
                    // that completion, releasing its pin, leaves the freeing to this one.
                    let taken = frames.update(frame, |s| {
                        (s.has(frames::LOST | frames::INDEXED)
                            && !s.has(frames::BUSY)
                            && frames.key(frame) == key.0)
                            .then(|| s.with_flags(s.flags() | frames::BUSY))
                    });
                    if taken.is_none() {
                        std::thread::yield_now();
                        continue;
                    }
                    took_lost = Some(page);
                    self.cache.index.remove(key, frame);
                    let now = frames
                        .update(frame, |s| {
                            let gone = frames::DIRTY | frames::INDEXED | frames::BUSY;
                            Some(
                                s.with_flags((s.flags() & !gone) | frames::REPLACED)
                                    .bumped(),
                            )
                        })
                        .expect("always updated");
                    // The lost write completed meanwhile, and no guard pins it by count: free
                    // it here.
                    if now.pins() == 0 && !now.has(frames::IO) {
                        self.free_unindexed(frame);
                    }
                    continue;
                }
                // Pinned by a write back of this handle's own left in flight by a failed wait:
                // only this handle's engine completes it (waiting for the frame below would
                // only poll).
                if self
                    .pending
                    .borrow()
                    .iter()
                    .flatten()
                    .any(|p| p.kind == Kind::Writeback)
                {
                    self.settle(|p| p.kind == Kind::Writeback)?;
                    continue;
                }
                // Pinned by a write back of another live handle's that its failed wait left in
                // flight: only that handle completes it, when it next drives its engine, and
                // its thread may be idle or waiting for this one. Not waited for; nor is the
                // page put in a fresh frame (the old write could land after the new bytes were
                // written back).
                if frames.meta(frame).parked.load(Ordering::SeqCst) > 0
                    && frames.key(frame) == key.0
                {
                    return Err(CacheError::WritebackInFlightOnOtherHandle { file, page });
                }
                // Pinned for a moment (a reader copying out, a writeback pass of a live handle
                // in progress), held by a guard, or not the page's any more: look again.
                self.cache.counters.waited.fetch_add(1, Ordering::Relaxed);
                self.poll()?;
                std::thread::yield_now();
                continue;
            }
            if frames.key(frame) != key.0 {
                // Recycled between the lookup and the claim: undo and look again.
                frames.update(frame, |s| {
                    Some(s.with_flags(s.flags() & !frames::BUSY).bumped())
                });
                continue;
            }
            if self.cache.hazards.protects(frame) {
                // A zero-copy guard holds the page: give it back and wait for the guard to go,
                // unless the guard is this handle's own (it would never go).
                frames.update(frame, |s| {
                    Some(s.with_flags(s.flags() & !frames::BUSY).bumped())
                });
                if self
                    .hazard_block
                    .is_some_and(|b| self.cache.hazards.protects_in(b, frame))
                {
                    return Err(CacheError::GuardHeld { file, page });
                }
                self.poll()?;
                std::thread::yield_now();
                continue;
            }
            let claimed = claimed.expect("claimed above");
            if claimed.has(frames::REWRITE) && dirty {
                // A stored copy of a page whose lost write is still out: a write's bytes would
                // go out in a write back the lost one may overtake, as with the lost frame.
                frames.update(frame, |s| {
                    Some(s.with_flags(s.flags() & !frames::BUSY).bumped())
                });
                return Err(CacheError::WritebackLost { file, page });
            }
            let rewrite = took_lost == Some(page) || claimed.has(frames::REWRITE);
            self.fill(frame, in_page, &data[done..done + n], dirty, rewrite);
            if rewrite {
                self.end_rewrite_unless_lost(key, frame);
            }
            done += n;
        }
        Ok(())
    }

    /// Copy `bytes` into a frame this handle holds BUSY, then publish it as valid, and dirty or
    /// clean; dirty and flagged [`frames::REWRITE`] when `rewrite` (a `store` of a page whose
    /// lost write may still land).
    fn fill(&self, frame: u32, in_page: usize, bytes: &[u8], dirty: bool, rewrite: bool) {
        // SAFETY: the frame is flagged BUSY by us: optimistic readers retry, pinners and other
        // writers wait, eviction skips it.
        unsafe {
            aios_core::copy::copy_nonoverlapping(
                bytes.as_ptr(),
                self.cache.frame_ptr(frame).add(in_page),
                bytes.len(),
            );
        }
        let set = match (rewrite, dirty) {
            (true, _) => frames::DIRTY | frames::REWRITE,
            (false, true) => frames::DIRTY,
            (false, false) => 0,
        };
        self.cache.frames.update(frame, |s| {
            let kept = s.flags() & !(frames::BUSY | frames::DIRTY | frames::REWRITE);
            Some(s.with_flags(kept | frames::VALID | set).bumped())
        });
    }

    /// After a `store` flagged `frame` (the page `key`'s copy) [`frames::REWRITE`]: if no lost
    /// write of the page is out any more (its completion was taken before the flag was set, so
    /// [`Self::complete_lost`] could not clear it), the flag goes here. The copy stays dirty:
    /// the lost write may have landed after the caller's own write of the page.
    fn end_rewrite_unless_lost(&self, key: Key, frame: u32) {
        let frames = &self.cache.frames;
        let lost = self.cache.lock_lost();
        if !page_has_lost_write(&lost, frames, key) {
            clear_rewrite(frames, frame, key);
        }
    }

    /// Write every dirty page of `file` back (background-class requests), wait for them, and
    /// flush the device.
    pub fn sync(&self, file: FileId) -> Result<(), CacheError> {
        // Pages a lost write back held, whose array has gone since, are written now too.
        self.settle_lost();
        let dev = self.device(file)?;
        self.writeback(Some(file))?;
        dev.flush_blocking()?;
        Ok(())
    }

    /// Write back the dirty pages of every file attached here.
    fn writeback_all(&self) -> Result<(), CacheError> {
        self.writeback(None)
    }

    /// Write dirty pages back, in passes of up to [`WRITEBACK_BATCH`] pages: pin them, sort
    /// them by file and page, and send each run of consecutive pages as one scattered
    /// background write from its frames (lbio cuts it into `split_bytes` pieces); then wait
    /// for the pass.
    fn writeback(&self, only: Option<FileId>) -> Result<(), CacheError> {
        let done = self.writeback_passes(only);
        if done.is_err() {
            self.park_writebacks();
        }
        done
    }

    /// A writeback that failed may leave writes of its own in flight (its wait for them
    /// failed): they hold their frames' pins until this handle next drives its engine, which
    /// its thread may never do (idle, or waiting for another handle's writer). Each is counted
    /// in its frames' [`frames::FrameMeta::parked`] until it completes, so that another
    /// handle's write of those pages is refused
    /// ([`CacheError::WritebackInFlightOnOtherHandle`]) rather than waited for.
    fn park_writebacks(&self) {
        let frames = &self.cache.frames;
        let wb = self.wb.borrow();
        for p in self.pending.borrow_mut().iter_mut().flatten() {
            if p.kind != Kind::Writeback || p.parked {
                continue;
            }
            p.parked = true;
            for &frame in written_frames(p, &wb) {
                frames.meta(frame).parked.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// [`Self::writeback`]'s passes.
    fn writeback_passes(&self, only: Option<FileId>) -> Result<(), CacheError> {
        let frames = &self.cache.frames;
        // A pass whose wait failed left writes in flight naming `wb`: they must complete before
        // this pass rewrites it.
        self.settle(|p| p.kind == Kind::Writeback)?;
        let mut scan = 0;
        let mut failure: Option<CacheError> = None;
        // A stored page a lost write may still land under (`frames::REWRITE`): not written now
        // (that write could land after this one), and reported, so that this `sync` does not
        // answer Ok while the page's bytes on the device may yet be overwritten.
        let mut held_back: Option<CacheError> = None;
        while scan < frames.len() && failure.is_none() {
            let mut n = 0;
            {
                let mut wb = self.wb.borrow_mut();
                while scan < frames.len() && n < WRITEBACK_BATCH {
                    let frame = scan;
                    scan += 1;
                    let key = Key(frames.key(frame));
                    if key.0 == NO_KEY
                        || only.is_some_and(|f| f.0 != key.file())
                        || self.attached(FileId(key.file())).is_err()
                    {
                        continue;
                    }
                    // Pin a dirty, valid, settled frame: writers wait for the pin to go. One a
                    // writer holds this moment (BUSY: copying in, or backing off a guard) is
                    // waited for, not skipped: the bytes written into it before this call must
                    // go out too. (A writer holds it for a copy; none waits on this thread.)
                    let pinned = loop {
                        let pinned = frames.update(frame, |s| {
                            (s.has(frames::DIRTY | frames::VALID)
                                && s.flags() & (frames::BUSY | frames::IO | frames::REWRITE) == 0
                                && s.pins() < u16::MAX
                                && frames.key(frame) == key.0)
                                .then(|| s.with_pins(s.pins() + 1))
                        });
                        let s = frames.state(frame);
                        if pinned.is_none()
                            && s.has(frames::DIRTY | frames::VALID | frames::BUSY)
                            && frames.key(frame) == key.0
                        {
                            std::thread::yield_now();
                            continue;
                        }
                        break pinned;
                    };
                    if pinned.is_some() {
                        wb.keys[n] = (key.0, frame);
                        n += 1;
                    } else if held_back.is_none() {
                        let s = frames.state(frame);
                        if s.has(frames::DIRTY | frames::VALID | frames::REWRITE)
                            && frames.key(frame) == key.0
                        {
                            held_back = Some(CacheError::WritebackLost {
                                file: FileId(key.file()),
                                page: key.page(),
                            });
                        }
                    }
                }
                wb.keys[..n].sort_unstable();
                for i in 0..n {
                    wb.frames[i] = wb.keys[i].1;
                }
            }
            let mut i = 0;
            while i < n {
                let (first, len) = {
                    let wb = self.wb.borrow();
                    let k0 = wb.keys[i].0;
                    let mut len = 1;
                    while i + len < n && wb.keys[i + len].0 == k0 + len as u64 {
                        len += 1;
                    }
                    (Key(k0), len)
                };
                if failure.is_none() {
                    if let Err(e) = self.submit_writeback(first, i, len) {
                        failure = Some(e);
                    }
                }
                if failure.is_some() {
                    // Not sent: let the pages go, still dirty.
                    for k in i..i + len {
                        frames.unpin(self.wb.borrow().frames[k]);
                    }
                }
                i += len;
            }
            // The pass's iovecs and frame list stay in use until its last write completes.
            self.settle(|p| p.kind == Kind::Writeback)?;
        }
        let late = self.last_error.borrow_mut().take();
        match (failure, late) {
            (Some(e), _) => Err(e),
            (None, Some(e)) => Err(e.into()),
            (None, None) => held_back.map_or(Ok(()), Err),
        }
    }

    /// The background write of the `len` pinned dirty pages from `first` (frames
    /// `wb.frames[at..at + len]`): scattered over the frames when there are several.
    fn writeback_io(&self, dev: &Device, first: Key, at: usize, len: usize) -> Io {
        let offset = first.page() * PAGE_BYTES as u64;
        let frame = self.wb.borrow().frames[at];
        // The last page of the device is written only as far as the device goes.
        let last_len = device_len(dev, offset + (len as u64 - 1) * PAGE_BYTES as u64);
        let io = if len == 1 {
            // SAFETY: pinned: no writer or eviction touches the bytes until the write completes.
            let raw = unsafe { self.frame_buf(frame, last_len) };
            // SAFETY: as above.
            unsafe { Io::write_raw(offset, raw) }
        } else {
            let mut wb = self.wb.borrow_mut();
            let wb = &mut **wb;
            // SAFETY: the frames are pinned as above; the iovecs stay put until the pass has
            // waited for its writes.
            let v = unsafe {
                self.frames_iov(
                    &wb.frames[at..at + len],
                    &mut wb.iov[at..at + len],
                    last_len,
                )
            };
            // SAFETY: as above.
            unsafe { Io::writev_raw(offset, v) }
        };
        io.class(Class::Background)
    }

    /// Send [`Self::writeback_io`] (waiting for a slot when all are busy) and track it.
    fn submit_writeback(&self, first: Key, at: usize, len: usize) -> Result<(), CacheError> {
        let dev = self.device(FileId(first.file()))?;
        let frame = self.wb.borrow().frames[at];
        let tag = loop {
            match dev.submit(self.writeback_io(&dev, first, at, len)) {
                Ok(t) => break t,
                Err((LbioError::NoFreeSlot { .. }, _)) => {
                    self.engine.wait(1)?;
                    self.poll()?;
                }
                Err((e, _)) => return Err(e.into()),
            }
        };
        self.pending.borrow_mut()[tag.0 as usize] = Some(Pending {
            frame,
            run_at: if len > 1 { at as u16 } else { 0 },
            run_len: if len > 1 { len as u16 } else { 0 },
            kind: Kind::Writeback,
            parked: false,
        });
        Ok(())
    }

    /// The engine kept failing with reads still in flight, which may write into their frames at
    /// any time: those frames are not freed (they stay in I/O), but leave the index, so no
    /// other handle waits on a read nobody will complete. Frames being written back stay
    /// pinned and indexed (their bytes may be the page's only copy) and are marked
    /// [`frames::LOST`]: the write may land after any later write of the page, so writers
    /// refuse those pages rather than wait for the pin. The iovecs of run reads and writes are
    /// leaked with them: lbio issues a background request's later pieces from them as tokens
    /// come back, and the kernel reads a queued SQE's iovecs when it is entered at last.
    ///
    /// Each request goes into the cache's list of lost ones (see [`LostRequest`]): a handle on
    /// the same lbio array that later takes its completion releases its frames then
    /// ([`Self::complete_lost`]), and so does any handle once that array has been dropped and
    /// its drop drained the engine ([`Self::settle_lost`]). The entry holds the array's
    /// [`ArrayFate`], which names it (no other array's is the same while it is held).
    fn quarantine(&self) {
        let frames = &self.cache.frames;
        let run = self.run_frames.borrow();
        let (mut reads, mut writes) = (false, false);
        // Held while the frames are flagged: a completion settling another lost write of the
        // same frame sees either both the flag and this entry or neither.
        let mut lost = self.cache.lock_lost();
        for (tag, p) in self.pending.borrow().iter().enumerate() {
            let Some(p) = p else { continue };
            let wb = self.wb.borrow();
            let list = match (p.run_len, p.kind) {
                (0, _) => std::slice::from_ref(&p.frame),
                (_, Kind::Writeback) => {
                    &wb.frames[p.run_at as usize..(p.run_at + p.run_len) as usize]
                }
                _ => &run[p.run_at as usize..(p.run_at + p.run_len) as usize],
            };
            let kind = match p.kind {
                Kind::Writeback => LostKind::Writeback,
                Kind::Readahead => LostKind::Readahead,
                Kind::Read | Kind::Orphan => LostKind::Read,
            };
            lost.push(LostRequest {
                fate: self.lbio_fate.clone(),
                tag: tag as u32,
                kind,
                frames: list.to_vec(),
            });
            if p.kind == Kind::Writeback {
                writes |= p.run_len > 0;
                for &frame in list {
                    frames.mark(frame, frames::LOST);
                    // LOST now answers writers (it is looked at first).
                    if p.parked {
                        frames.meta(frame).parked.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                continue;
            }
            reads |= p.run_len > 0;
            for &frame in list {
                // Flagged abandoned first, while still indexed, as a writer superseding the
                // read does; a frame flagged so already is out of the index, or a writer's to
                // take out (and its indexed flag the writer's to clear: of it and the lost
                // read's completion, the later frees the frame).
                let took = frames.update(frame, |s| {
                    (!s.has(frames::ABANDONED))
                        .then(|| s.with_flags(s.flags() | frames::ABANDONED).bumped())
                });
                if took.is_some() {
                    self.cache.index.remove(Key(frames.key(frame)), frame);
                    frames.update(frame, |s| {
                        Some(s.with_flags(s.flags() & !frames::INDEXED).bumped())
                    });
                }
            }
        }
        self.cache
            .lost_len
            .store(lost.len() as u32, Ordering::Relaxed);
        drop(lost);
        if reads {
            let fresh = Box::new(
                [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; MISS_BATCH],
            );
            Box::leak(std::mem::replace(&mut *self.run_iov.borrow_mut(), fresh));
        }
        if writes {
            let fresh = Box::new(WbBuf::empty());
            Box::leak(std::mem::replace(&mut *self.wb.borrow_mut(), fresh));
        }
    }

    /// The completion of a request this handle did not send, on its lbio array: if it is one
    /// a dropped handle gave up on ([`Self::quarantine`]), the device is done with its frames
    /// now, and they are released ([`Self::release_lost`]; `failed`: the request failed).
    fn complete_lost(&self, tag: Tag, failed: bool) {
        if self.cache.lost_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut lost = self.cache.lock_lost();
        let Some(i) = lost
            .iter()
            .position(|r| r.fate.same_array(&self.lbio_fate) && r.tag == tag.0)
        else {
            return;
        };
        let r = lost.swap_remove(i);
        self.cache
            .lost_len
            .store(lost.len() as u32, Ordering::Relaxed);
        self.release_lost(&lost, &r, failed);
    }

    /// Settle the lost requests (those a dropped handle's quarantine gave up on) whose lbio
    /// array has been dropped and drained by its drop ([`Fate::Drained`]): nothing takes their
    /// completions any more (the drop drove the engine, but nobody reads what completed), and
    /// the device no longer touches their frames, so they are released as a taken
    /// completion's are. A write back's outcome is unknown: it counts as failed, and its pages
    /// stay dirty, so the next `sync` writes them (again: the same bytes). Requests
    /// whose array is alive, or was dropped while its ring kept failing ([`Fate::Abandoned`]:
    /// the device may still write into their frames), stay lost.
    ///
    /// Called when a handle is created, when one drops, and at the start of each `sync`; a
    /// caller that drops arrays and wants their frames back sooner may call it too. One
    /// relaxed atomic load while no request is lost; else the list's lock and a look at each
    /// entry's fate. Never on the hit path.
    pub fn settle_lost(&self) {
        if self.cache.lost_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut lost = self.cache.lock_lost();
        // All of them out of the list first: a write back settled here is out no more for the
        // checks of the others (another lost write of the same frame or page).
        let mut settled = Vec::new();
        let mut i = 0;
        while i < lost.len() {
            if lost[i].fate.get() == Fate::Drained {
                settled.push(lost.swap_remove(i));
            } else {
                i += 1;
            }
        }
        if settled.is_empty() {
            return;
        }
        self.cache
            .lost_len
            .store(lost.len() as u32, Ordering::Relaxed);
        for r in &settled {
            self.release_lost(&lost, r, true);
        }
    }

    /// Release the frames of a lost request `r` the device is done with (its completion taken,
    /// or its array drained), taken out of `lost` (the cache's list, whose lock the caller
    /// holds). `failed`: the request failed, or its outcome is unknown.
    ///
    /// - A read's or a readahead's frames (out of the index) leave I/O and are freed once no
    ///   pin is left; a readahead gives its share of the readahead budget back.
    /// - A write back's frames lose their pin and, unless another lost write of the page is
    ///   still out, their [`frames::LOST`] flag: writers take the page again. A write that
    ///   succeeded leaves the page clean (no writer changed it under the pin); one that failed
    ///   leaves it dirty, so the next `sync` writes it (nothing is lost then either). A copy a
    ///   `store` put in the page's place loses [`frames::REWRITE`] unless another lost write
    ///   of the page is still out. A frame a `store` took out of the index meanwhile
    ///   ([`frames::REPLACED`]) is freed by whichever of them and a guard pinned by count lets
    ///   go of it last, or retired while a zero-copy guard still holds it through a hazard
    ///   slot (see [`Self::free_unindexed`]).
    fn release_lost(&self, lost: &[LostRequest], r: &LostRequest, failed: bool) {
        let frames = &self.cache.frames;
        for &frame in &r.frames {
            match r.kind {
                LostKind::Read | LostKind::Readahead => {
                    let now = frames
                        .update(frame, |s| {
                            Some(s.with_flags(s.flags() & !frames::IO).bumped())
                        })
                        .expect("always updated");
                    if r.kind == LostKind::Read {
                        // The departed reader's pin (a run's frames carry one each).
                        self.unpin(frame, true);
                    } else if now.pins() == 0 && !now.has(frames::INDEXED) {
                        self.free_frame(frame);
                    }
                }
                LostKind::Writeback => {
                    let still_lost = lost
                        .iter()
                        .any(|o| o.kind == LostKind::Writeback && o.frames.contains(&frame));
                    // A copy a `store` put in this frame's place waits for no other lost write
                    // of the page now: it may be written back again (it stays dirty), after
                    // this one. (Under the list's lock, as the `store`'s own check.)
                    let key = Key(frames.key(frame));
                    if !page_has_lost_write(lost, frames, key) {
                        if let Some(copy) = self.cache.index.get(key, frames) {
                            clear_rewrite(frames, copy, key);
                        }
                    }
                    frames.update(frame, |s| {
                        let mut flags = s.flags();
                        if !still_lost {
                            flags &= !frames::LOST;
                        }
                        if !failed {
                            flags &= !frames::DIRTY;
                        }
                        Some(s.with_flags(flags))
                    });
                    self.unpin_written(frame);
                }
            }
            if r.kind == LostKind::Readahead {
                self.cache.end_readahead();
            }
        }
    }

    /// Drop a write back's pin. A frame a `store` took out of the index while a lost write of
    /// it was still out ([`frames::REPLACED`]; see [`Self::complete_lost`]) is freed by
    /// whoever lets go of it last, and this pass may have pinned it too, before the store.
    fn unpin_written(&self, frame: u32) {
        let now = self.cache.frames.unpin(frame);
        if now.pins() == 0
            && now.flags() & (frames::INDEXED | frames::IO | frames::BUSY | frames::LOST) == 0
            && now.has(frames::VALID | frames::REPLACED)
        {
            self.free_unindexed(frame);
        }
    }

    /// Free a frame no pin holds that left the index while guards could still find it there
    /// (a lost write back's frame a `store` replaced). A zero-copy guard taken before may still
    /// hold it through a hazard slot, and its bytes must not change under it: the frame is
    /// retired then ([`PageCache::retire`]), and freed by [`Self::reclaim_retired`] once no
    /// slot holds it.
    fn free_unindexed(&self, frame: u32) {
        if self.cache.hazards.protects(frame) {
            self.cache.retire(frame);
        } else {
            self.free_frame(frame);
        }
    }

    /// Free the retired frames no hazard slot holds any more (see [`PageCache::retire`]):
    /// their guards have dropped, and none can take them again (they are out of the index).
    /// One relaxed load while there are none.
    fn reclaim_retired(&self) {
        if self.cache.retired_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut retired = self.cache.lock_retired();
        retired.retain(|&frame| {
            let held = self.cache.hazards.protects(frame);
            if !held {
                self.free_frame(frame);
            }
            held
        });
        self.cache
            .retired_len
            .store(retired.len() as u32, Ordering::Relaxed);
    }

    /// Frames held in this handle's pool and release batch (not in the shared free list).
    pub fn held_frames(&self) -> usize {
        self.pool.borrow().len() + self.release.borrow().len()
    }

    /// Give every frame this handle holds back to the shared free list.
    pub fn give_back(&self) {
        self.flush_release();
        self.cache.give_free(&mut self.pool.borrow_mut());
    }
}

impl Drop for CacheHandle {
    fn drop(&mut self) {
        // Readahead (or reads and writes a failed wait left) still in flight owns frames: let
        // it land first. A failed wait is tried again (an enter refused for want of memory
        // leaves its SQEs for the next one).
        if self.settle(|_| true).is_err() {
            self.quarantine();
        }
        // Other handles' lost requests whose arrays have gone since (this handle's own array
        // is still alive here: their requests stay lost until another handle settles them).
        self.settle_lost();
        self.reclaim_retired();
        self.give_back();
        self.publish_metrics();
        if let Some(b) = self.hazard_block {
            self.cache.hazards.release(b);
        }
    }
}

/// What [`CacheHandle::protect`] got.
enum Protect {
    /// The page is held through this slot.
    Held(u8),
    /// The frame changed (evicted, being written or read): look again.
    Changed,
    /// No hazard slot free on this handle: pin by count instead.
    NoSlot,
}

/// Whether a lost write back of the page `key` is still out (`lost`: the cache's list).
fn page_has_lost_write(lost: &[LostRequest], frames: &frames::FrameTable, key: Key) -> bool {
    lost.iter()
        .any(|r| r.kind == LostKind::Writeback && r.frames.iter().any(|&f| frames.key(f) == key.0))
}

/// Clear [`frames::REWRITE`] on `frame` if it is still the page `key`'s copy and flagged so
/// (it stays dirty: the next `sync` writes it).
fn clear_rewrite(frames: &frames::FrameTable, frame: u32, key: Key) {
    frames.update(frame, |s| {
        (s.has(frames::REWRITE) && frames.key(frame) == key.0)
            .then(|| s.with_flags(s.flags() & !frames::REWRITE))
    });
}

/// The frames a write back request writes: `p.frame`, or its run in `wb`.
fn written_frames<'a>(p: &'a Pending, wb: &'a WbBuf) -> &'a [u32] {
    match p.run_len {
        0 => std::slice::from_ref(&p.frame),
        n => &wb.frames[p.run_at as usize..(p.run_at + n) as usize],
    }
}

/// Bytes of the page at `offset` that lie on `dev`: [`PAGE_BYTES`], or fewer for a page that
/// runs past the device's end.
fn device_len(dev: &Device, offset: u64) -> usize {
    dev.geometry()
        .capacity_bytes
        .saturating_sub(offset)
        .min(PAGE_BYTES as u64) as usize
}

/// Put every page of `rest` on the retry list.
fn retry_rest(rest: &[u64], retry: &mut [u64; MISS_BATCH], n: &mut usize) {
    for &p in rest {
        retry[*n] = p;
        *n += 1;
    }
}

/// Lines of a frame [`CacheHandle::lookup`] prefetches.
const PREFETCH_LINES: usize = 2;

/// Hint the CPU to bring the first [`PREFETCH_LINES`] cache lines at `p` into L1. Only a hint: it
/// never faults and changes no state a program can see.
#[inline(always)]
fn prefetch_lines(p: *const u8) {
    for i in 0..PREFETCH_LINES {
        // `wrapping_add` computes the address without claiming it is in bounds.
        aios_core::hint::prefetch_ptr(p.wrapping_add(i * 64));
    }
}
