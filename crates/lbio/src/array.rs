//! The per-engine lbio array: preallocated request slots whose index is the tag.
//!
//! A request (`Lbio`) takes a free slot, its pieces go straight to the backend — no merging, no
//! scheduling (AIOS §3.1) — and each completion names the slot in its `user_data`, so completing
//! costs an array index. Critical requests are issued at once, split only at the device's max
//! transfer; background requests wait for one of the device's tokens (default 8) and are split
//! into `split_bytes` pieces issued in LBA order (FastResponse §3.3).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::Waker;

use aios_core::{CompletionSink, CoreError, Engine, FixedBuf, SinkId};

use crate::backend::{Backend, Op, Outcome, Piece, PieceError, Started};
use crate::error::LbioError;

/// Slot-array settings, validated once by [`LbioArray::new`].
#[derive(Clone, Copy, Debug)]
pub struct LbioConfig {
    /// Request slots per engine (the most requests in flight at once).
    pub slots: u32,
    /// Background pieces in flight per device (the token budget).
    pub max_inflight_background: u32,
    /// Background requests are cut into pieces of this many bytes (at least a device's block).
    pub split_bytes: u32,
    /// Devices that can be open on this array at once.
    pub max_devices: u16,
}

impl Default for LbioConfig {
    fn default() -> Self {
        LbioConfig {
            slots: 1024,
            max_inflight_background: 8,
            split_bytes: 32 << 10,
            max_devices: 16,
        }
    }
}

/// The most slots an array may have (tags must fit the completion payload).
pub const MAX_SLOTS: u32 = 1 << TAG_BITS;
/// A completion payload carries the slot index in its low bits and the piece's length above
/// them, so a backend whose completions report only success (NVMe passthrough) still yields a
/// byte count without a lookup.
const TAG_BITS: u32 = 20;

impl LbioConfig {
    fn validate(&self) -> Result<(), LbioError> {
        if self.slots == 0 || self.slots > MAX_SLOTS {
            return Err(LbioError::Config(format!(
                "slots {} must be in 1..={MAX_SLOTS}",
                self.slots
            )));
        }
        if self.max_inflight_background == 0 {
            return Err(LbioError::Config(
                "max_inflight_background 0 would never issue a background request; use >= 1".into(),
            ));
        }
        if self.split_bytes < 512 || !self.split_bytes.is_power_of_two() {
            return Err(LbioError::Config(format!(
                "split_bytes {} must be a power of two of at least 512",
                self.split_bytes
            )));
        }
        if self.max_devices == 0 {
            return Err(LbioError::Config("max_devices must be at least 1".into()));
        }
        Ok(())
    }
}

/// Latency class of a request (DESIGN.md "two request classes").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Someone waits on it: issued at once.
    Critical,
    /// Writeback, readahead, scans: throttled by tokens and split into pieces in LBA order.
    Background,
}

/// A request slot's index: the tag carried in `user_data`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tag(pub u32);

/// A finished request handed back by [`LbioArray::take_done`].
#[derive(Debug)]
pub struct Completion {
    pub tag: Tag,
    /// Bytes transferred, or why it failed.
    pub result: Result<u32, LbioError>,
    /// The request's buffer (reads: filled), `None` for flushes.
    pub buf: Option<FixedBuf>,
}

/// Counters of one lbio array.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LbioMetrics {
    pub requests: u64,
    pub pieces: u64,
    /// Requests that needed more than one piece.
    pub split_requests: u64,
    /// Background pieces that had to wait for a token.
    pub throttled_pieces: u64,
    /// Submissions refused because every slot was busy.
    pub slot_exhausted: u64,
    pub errors: u64,
    /// Pieces that carried several memory segments as one device command.
    pub vectored_pieces: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Active,
    Done,
}

/// Who collects a finished request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A future, woken through the slot's waker.
    Future,
    /// A blocking caller polling the slot.
    Blocking,
    /// Nobody waits on the slot: the completion goes to the done queue.
    Detached,
    /// Its future was dropped: free the slot when the I/O ends.
    Orphaned,
}

/// One request: everything lbio needs to issue and complete it, in a preallocated slot.
struct Lbio {
    state: State,
    owner: Owner,
    op: Op,
    class: Class,
    fua: bool,
    /// Every piece has been handed to the backend.
    issued_all: bool,
    dev: u16,
    /// Pieces started and not completed.
    outstanding: u32,
    offset: u64,
    len: u32,
    /// Bytes handed to the backend so far (pieces go out in LBA order).
    issued: u32,
    /// Bytes reported done.
    done: u32,
    /// First failure seen.
    error: Option<PieceError>,
    buf: Option<FixedBuf>,
    raw: Option<RawBuf>,
    iov: Option<RawIov>,
    /// Scattered requests: the segment the next piece starts in, and how far into it.
    seg: u16,
    seg_off: u32,
    waker: Option<Waker>,
}

impl Lbio {
    const EMPTY: Lbio = Lbio {
        state: State::Free,
        owner: Owner::Detached,
        op: Op::Read,
        class: Class::Critical,
        fua: false,
        issued_all: false,
        dev: 0,
        outstanding: 0,
        offset: 0,
        len: 0,
        issued: 0,
        done: 0,
        error: None,
        buf: None,
        raw: None,
        iov: None,
        seg: 0,
        seg_off: 0,
        waker: None,
    };
}

/// Where a device's requests go, and its limits; held by the array for the device's lifetime.
struct DevState {
    critical: Box<dyn Backend>,
    background: Box<dyn Backend>,
    max_transfer: u32,
    /// The size background requests are cut into: `split_bytes`, but never below the device's
    /// block or memory alignment (a piece must stay aligned) nor above its max transfer.
    bg_piece: u32,
    /// Whether the critical and the background backend take vectored pieces.
    vectored: [bool; 2],
    tokens: u32,
    bg_queue: VecDeque<u32>,
    active: u32,
    closing: bool,
}

impl DevState {
    /// The backend a request class goes to.
    fn backend(&self, background: bool) -> &dyn Backend {
        if background {
            &*self.background
        } else {
            &*self.critical
        }
    }
}

/// Memory a request moves data to or from that is not an arena [`FixedBuf`]: e.g. a page-cache
/// frame in a [`SharedRegion`](aios_core::SharedRegion) registered with the engine, or (with no
/// index) ordinary memory the kernel pins per I/O.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuf {
    ptr: std::ptr::NonNull<u8>,
    len: u32,
    index: Option<u16>,
}

impl RawBuf {
    /// `len` bytes at `ptr`; `index` is the engine's registered-buffer index that contains them
    /// (`None`: unregistered memory).
    ///
    /// # Safety
    /// From submission until the request completes, the bytes must stay valid and be used by
    /// nobody else (writable for reads); with `Some(index)` they must lie inside that registered
    /// buffer of the engine the request goes through.
    pub unsafe fn new(ptr: std::ptr::NonNull<u8>, len: u32, index: Option<u16>) -> RawBuf {
        RawBuf { ptr, len, index }
    }
    /// Start address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    /// Length in bytes.
    pub fn len(&self) -> u32 {
        self.len
    }
    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The registered buffer holding it, if any.
    pub fn index(&self) -> Option<u16> {
        self.index
    }
}

/// The most segments one vectored device command carries (Linux's `UIO_MAXIOV`).
pub const MAX_PIECE_SEGMENTS: usize = 1024;

/// Scattered memory for one request: an array of iovecs, each segment outside the arena (e.g.
/// page-cache frames in a registered shared region), moved to or from consecutive device
/// offsets. Backends that declare [`Caps::vectored`](crate::Caps::vectored) get them as one
/// command (`READV_FIXED`/`WRITEV_FIXED`, `preadv`), up to the device's max transfer; others
/// get one piece per segment. Either way the request completes once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawIov {
    iov: std::ptr::NonNull<libc::iovec>,
    count: u16,
    bytes: u64,
    index: Option<u16>,
}

impl RawIov {
    /// The `count` iovecs at `iov`; `index` is the engine's registered-buffer index that holds
    /// every segment (`None`: unregistered memory).
    ///
    /// # Safety
    /// The iovec array must be readable now, and from submission until the request completes
    /// both it and every segment it describes must stay valid and be used by nobody else
    /// (segments writable for reads). With `Some(index)` every segment must lie inside that
    /// registered buffer of the engine the request goes through.
    pub unsafe fn new(
        iov: std::ptr::NonNull<libc::iovec>,
        count: u16,
        index: Option<u16>,
    ) -> RawIov {
        // SAFETY: the caller guarantees `count` readable iovecs.
        let segs = unsafe { std::slice::from_raw_parts(iov.as_ptr(), count as usize) };
        RawIov {
            iov,
            count,
            bytes: segs.iter().map(|s| s.iov_len as u64).sum(),
            index,
        }
    }
    /// The segments.
    pub fn segments(&self) -> &[libc::iovec] {
        // SAFETY: `new`'s contract keeps the array readable while the value is in use.
        unsafe { std::slice::from_raw_parts(self.iov.as_ptr(), self.count as usize) }
    }
    /// Bytes in all segments.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// The registered buffer holding the segments, if any.
    pub fn index(&self) -> Option<u16> {
        self.index
    }
}

/// A validated request ready for a slot.
pub(crate) struct Request {
    pub(crate) op: Op,
    pub(crate) class: Class,
    pub(crate) fua: bool,
    pub(crate) offset: u64,
    pub(crate) len: u32,
    pub(crate) buf: Option<FixedBuf>,
    pub(crate) raw: Option<RawBuf>,
    pub(crate) iov: Option<RawIov>,
}

/// A request's fields without its buffer, to rebuild it when a submission is refused.
#[derive(Clone, Copy)]
pub(crate) struct Shape {
    op: Op,
    class: Class,
    fua: bool,
    offset: u64,
    len: u32,
    raw: Option<RawBuf>,
    iov: Option<RawIov>,
}

impl Request {
    pub(crate) fn shape(&self) -> Shape {
        Shape {
            op: self.op,
            class: self.class,
            fua: self.fua,
            offset: self.offset,
            len: self.len,
            raw: self.raw,
            iov: self.iov,
        }
    }
}

impl Shape {
    pub(crate) fn with_buf(self, buf: Option<FixedBuf>) -> Request {
        Request {
            op: self.op,
            class: self.class,
            fua: self.fua,
            offset: self.offset,
            len: self.len,
            buf,
            raw: self.raw,
            iov: self.iov,
        }
    }
}

struct Inner {
    slots: Box<[Lbio]>,
    free: Vec<u32>,
    done: VecDeque<u32>,
    /// Detached requests submitted and not yet finished.
    detached: u32,
    devs: Vec<Option<DevState>>,
    slot_waiters: Vec<Waker>,
    metrics: LbioMetrics,
}

/// What became of an [`LbioArray`]'s requests, as its [`ArrayFate`] tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// The array is alive: its requests may still be in flight.
    Open,
    /// The array was dropped, and nothing of it was in flight any more when it went (its drop
    /// drained the engine): the device no longer reads or writes any memory its requests named.
    Drained,
    /// The array was dropped while the engine kept failing with requests of it in flight: the
    /// device may still read or write their memory at any time.
    Abandoned,
}

const FATE_OPEN: u8 = 0;
const FATE_DRAINED: u8 = 1;
const FATE_ABANDONED: u8 = 2;

/// A cloneable, thread-safe handle on what became of one [`LbioArray`] ([`LbioArray::fate`]):
/// [`Fate::Open`] while the array lives, then what its drop found. Also names the array: two
/// handles are [`ArrayFate::same_array`] when taken from the same one, and an array's handle
/// keeps that name from any other array for as long as it is held.
#[derive(Clone, Debug)]
pub struct ArrayFate(Arc<AtomicU8>);

impl ArrayFate {
    /// What became of the array. After [`Fate::Drained`] or [`Fate::Abandoned`] it never
    /// changes; a [`Fate::Drained`] read here also makes everything the device did to the
    /// requests' memory visible to this thread.
    pub fn get(&self) -> Fate {
        match self.0.load(Ordering::Acquire) {
            FATE_OPEN => Fate::Open,
            FATE_DRAINED => Fate::Drained,
            _ => Fate::Abandoned,
        }
    }

    /// Whether `self` and `other` were taken from the same array.
    pub fn same_array(&self, other: &ArrayFate) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The per-engine lbio slot array (AIOS Fig. 7's per-core lbio row).
pub struct LbioArray {
    engine: Rc<Engine>,
    /// Set by the drop (see [`LbioArray::fate`]).
    fate: ArrayFate,
    sink: SinkId,
    cfg: LbioConfig,
    inner: RefCell<Inner>,
    /// Completions that arrived while `inner` was borrowed (the engine reaped inside a push):
    /// applied as soon as the borrow ends.
    deferred: RefCell<VecDeque<(u64, i32)>>,
    has_deferred: Cell<bool>,
}

impl LbioArray {
    /// Allocate the slot array and register it with `engine` as a completion sink.
    pub fn new(engine: Rc<Engine>, cfg: LbioConfig) -> Result<Rc<LbioArray>, LbioError> {
        cfg.validate()?;
        let n = cfg.slots as usize;
        let mut slots = Vec::with_capacity(n);
        slots.resize_with(n, || Lbio::EMPTY);
        let mut registered: Result<SinkId, CoreError> = Err(CoreError::SinksExhausted(0));
        let array = Rc::new_cyclic(|weak: &Weak<LbioArray>| {
            registered = engine.register_sink(weak.clone() as Weak<dyn CompletionSink>);
            LbioArray {
                // On a registration failure `new` returns the error before anyone sees this value.
                sink: *registered.as_ref().unwrap_or(&SinkId(u8::MAX)),
                engine: Rc::clone(&engine),
                fate: ArrayFate(Arc::new(AtomicU8::new(FATE_OPEN))),
                cfg,
                inner: RefCell::new(Inner {
                    slots: slots.into_boxed_slice(),
                    free: (0..cfg.slots).rev().collect(),
                    done: VecDeque::with_capacity(n),
                    detached: 0,
                    devs: (0..cfg.max_devices).map(|_| None).collect(),
                    slot_waiters: Vec::with_capacity(64),
                    metrics: LbioMetrics::default(),
                }),
                deferred: RefCell::new(VecDeque::with_capacity(n * 2)),
                has_deferred: Cell::new(false),
            }
        });
        registered?;
        Ok(array)
    }

    /// The engine this array submits to.
    pub fn engine(&self) -> &Rc<Engine> {
        &self.engine
    }
    /// A handle on what becomes of this array, for a user that lets memory outlive it: after
    /// the array's drop it says whether the drop drained the engine ([`Fate::Drained`]: the
    /// device no longer touches any memory the array's requests named, completed or not) or
    /// gave up on a ring that kept failing ([`Fate::Abandoned`]: it may still).
    pub fn fate(&self) -> ArrayFate {
        self.fate.clone()
    }
    /// The configuration in force.
    pub fn config(&self) -> &LbioConfig {
        &self.cfg
    }
    /// A snapshot of the counters.
    pub fn metrics(&self) -> LbioMetrics {
        self.inner.borrow().metrics
    }
    /// Slots free now.
    pub fn free_slots(&self) -> u32 {
        self.inner.borrow().free.len() as u32
    }

    /// Bytes of per-engine state fixed at start for `slots` slots (AIOS Table 2 counts 192 KiB
    /// of lbio array per core): the slot array, its free list, its done queue and the deferred
    /// completion queue. Each open device adds a background queue of 4 bytes per slot.
    pub fn static_bytes(slots: u32) -> usize {
        let n = slots as usize;
        n * std::mem::size_of::<Lbio>() + n * 4 + n * 4 + n * 2 * std::mem::size_of::<(u64, i32)>()
    }

    /// Give a device a slot in the array, with a full token budget. `block` is the alignment
    /// a piece boundary needs: in offsets and lengths, and in memory, since a split request's
    /// pieces start that far into its buffer (`max_transfer` is a multiple of it).
    pub(crate) fn add_device(
        &self,
        critical: Box<dyn Backend>,
        background: Box<dyn Backend>,
        max_transfer: u32,
        block: u32,
    ) -> Result<u16, LbioError> {
        let mut inner = self.inner.borrow_mut();
        let idx = inner
            .devs
            .iter()
            .position(Option::is_none)
            .ok_or(LbioError::TooManyDevices {
                max: self.cfg.max_devices,
            })?;
        let vectored = [critical.caps().vectored, background.caps().vectored];
        inner.devs[idx] = Some(DevState {
            critical,
            background,
            max_transfer,
            bg_piece: self.cfg.split_bytes.max(block).min(max_transfer),
            vectored,
            tokens: self.cfg.max_inflight_background,
            bg_queue: VecDeque::with_capacity(self.cfg.slots as usize),
            active: 0,
            closing: false,
        });
        Ok(idx as u16)
    }

    /// Close device `idx` once its last request has completed.
    pub(crate) fn close_device(&self, idx: u16) {
        let mut inner = self.inner.borrow_mut();
        if let Some(d) = inner.devs[idx as usize].as_mut() {
            d.closing = true;
            if d.active == 0 {
                inner.devs[idx as usize] = None;
            }
        }
    }

    /// Put `req` in a free slot and start it. On refusal the buffer comes back with the error.
    pub(crate) fn submit(
        &self,
        dev: u16,
        req: Request,
        owner: Owner,
    ) -> Result<Tag, (LbioError, Option<FixedBuf>)> {
        let r = self.submit_locked(dev, req, owner);
        self.apply_deferred();
        r
    }

    fn submit_locked(
        &self,
        dev: u16,
        req: Request,
        owner: Owner,
    ) -> Result<Tag, (LbioError, Option<FixedBuf>)> {
        let mut guard = self.inner.borrow_mut();
        let inner = &mut *guard;
        let Some(tag) = inner.free.pop() else {
            inner.metrics.slot_exhausted += 1;
            return Err((
                LbioError::NoFreeSlot {
                    slots: self.cfg.slots,
                },
                req.buf,
            ));
        };
        let slot = &mut inner.slots[tag as usize];
        debug_assert_eq!(slot.state, State::Free);
        *slot = Lbio {
            state: State::Active,
            owner,
            op: req.op,
            class: req.class,
            fua: req.fua,
            issued_all: false,
            dev,
            outstanding: 0,
            offset: req.offset,
            len: req.len,
            issued: 0,
            done: 0,
            error: None,
            buf: req.buf,
            raw: req.raw,
            iov: req.iov,
            seg: 0,
            seg_off: 0,
            waker: None,
        };
        inner.metrics.requests += 1;
        if owner == Owner::Detached {
            inner.detached += 1;
        }
        let d = inner.devs[dev as usize]
            .as_mut()
            .expect("a Device handle keeps its slot open");
        d.active += 1;
        match req.class {
            Class::Critical => {
                self.issue_critical(inner, tag);
                self.finish_if_done(inner, tag);
            }
            Class::Background => {
                let d = inner.devs[dev as usize].as_mut().expect("device is open");
                d.bg_queue.push_back(tag);
                self.pump(inner, dev, false);
            }
        }
        Ok(Tag(tag))
    }

    /// Issue every piece of a critical request, split only at the device's max transfer.
    fn issue_critical(&self, inner: &mut Inner, tag: u32) {
        let dev = inner.slots[tag as usize].dev as usize;
        let max = inner.devs[dev]
            .as_ref()
            .expect("device is open")
            .max_transfer;
        loop {
            let done = self.issue_piece(inner, tag, max, true);
            if done {
                return;
            }
        }
    }

    /// Issue the next piece of slot `tag` (at most `max` bytes). Returns whether every piece has
    /// now been issued.
    fn issue_piece(&self, inner: &mut Inner, tag: u32, max: u32, critical: bool) -> bool {
        let slot = &mut inner.slots[tag as usize];
        let mut piece = Piece {
            op: slot.op,
            offset: slot.offset + slot.issued as u64,
            ptr: std::ptr::null_mut(),
            len: (slot.len - slot.issued).min(max),
            fua: slot.fua,
            buf_index: None,
            iov: std::ptr::null(),
            iov_count: 0,
        };
        match (slot.buf.as_mut(), slot.raw, slot.iov) {
            (Some(b), _, _) => {
                // SAFETY: `issued + len <= len <= buf.len()` (checked at submission).
                piece.ptr = unsafe { b.as_mut_ptr().add(slot.issued as usize) };
                piece.buf_index = Some(b.buf_index());
            }
            (None, Some(r), _) => {
                // SAFETY: as above, `len <= raw.len()`.
                piece.ptr = unsafe { r.as_ptr().add(slot.issued as usize) };
                piece.buf_index = r.index();
            }
            (None, None, Some(v)) => {
                // Only scattered requests ask whether the backend takes vectored pieces.
                let vectored = inner.devs[slot.dev as usize]
                    .as_ref()
                    .expect("device is open")
                    .vectored[!critical as usize];
                piece.buf_index = v.index();
                Self::next_segments(slot, &v, &mut piece, max, vectored);
                if piece.iov_count > 0 {
                    inner.metrics.vectored_pieces += 1;
                }
            }
            (None, None, None) => {}
        }
        let slot = &mut inner.slots[tag as usize];
        let piece_len = piece.len;
        slot.issued += piece_len;
        slot.issued_all = slot.issued == slot.len;
        if slot.issued_all && slot.issued != piece_len {
            // More than one piece: count the split once, at the last piece.
            inner.metrics.split_requests += 1;
        }
        let issued_all = slot.issued_all;
        slot.outstanding += 1;
        inner.metrics.pieces += 1;
        let backend = inner.devs[slot.dev as usize]
            .as_ref()
            .expect("device is open")
            .backend(!critical);
        // SAFETY: the slot owns the buffer until the request finishes, which needs every piece's
        // completion; the device's backends stay alive while it has active requests.
        let payload = tag as u64 | (piece_len as u64) << TAG_BITS;
        let started = unsafe { backend.start(&self.engine, self.sink, payload, &piece) };
        match started {
            Ok(Started::Queued) => {}
            Ok(Started::Done(res)) => {
                let outcome = backend.outcome_of(payload, res, piece_len);
                self.piece_done(inner, tag, outcome, !critical)
            }
            Err(e) => {
                let errno = match &e {
                    CoreError::Sys { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
                    _ => libc::EIO,
                };
                self.piece_done(
                    inner,
                    tag,
                    Outcome::Failed(PieceError::Errno(errno)),
                    !critical,
                );
            }
        }
        issued_all
    }

    /// The memory of a scattered request's next piece (at most `max` bytes): as many whole
    /// segments as fit, as one vectored piece, when the backend takes them and there are two or
    /// more; else the next part of the current segment. Advances the slot's segment cursor.
    fn next_segments(slot: &mut Lbio, v: &RawIov, piece: &mut Piece, max: u32, vectored: bool) {
        let segs = v.segments();
        let at = slot.seg as usize;
        if vectored && slot.seg_off == 0 {
            let mut n = 0;
            let mut bytes = 0u64;
            while at + n < segs.len()
                && n < MAX_PIECE_SEGMENTS
                && bytes + segs[at + n].iov_len as u64 <= max as u64
            {
                bytes += segs[at + n].iov_len as u64;
                n += 1;
            }
            if n >= 2 {
                piece.ptr = segs[at].iov_base.cast();
                piece.len = bytes as u32;
                piece.iov = segs[at..].as_ptr();
                piece.iov_count = n as u16;
                slot.seg += n as u16;
                return;
            }
        }
        let s = segs[at];
        let left = s.iov_len as u64 - slot.seg_off as u64;
        let len = left.min(max as u64) as u32;
        // SAFETY: `seg_off < iov_len`: the cursor moves past a segment once it is used up.
        piece.ptr = unsafe { s.iov_base.cast::<u8>().add(slot.seg_off as usize) };
        piece.len = len;
        if len as u64 == left {
            slot.seg += 1;
            slot.seg_off = 0;
        } else {
            slot.seg_off += len;
        }
    }

    /// Issue queued background pieces while the device has tokens. `after_wait` marks a pump
    /// run by a completion: the pieces it issues had been waiting for a token.
    fn pump(&self, inner: &mut Inner, dev: u16, after_wait: bool) {
        loop {
            // A closing device goes away when its last request finishes, which a piece that
            // completes at once (a failed start) can do inside this loop.
            let Some(d) = inner.devs[dev as usize].as_mut() else {
                return;
            };
            if d.tokens == 0 {
                return;
            }
            let Some(&tag) = d.bg_queue.front() else {
                return;
            };
            d.tokens -= 1;
            let max = d.bg_piece;
            if after_wait {
                inner.metrics.throttled_pieces += 1;
            }
            if self.issue_piece(inner, tag, max, false) {
                let d = inner.devs[dev as usize].as_mut().expect("device is open");
                d.bg_queue.pop_front();
                self.finish_if_done(inner, tag);
            }
        }
    }

    /// Account one finished piece; a background piece gives its token back.
    fn piece_done(&self, inner: &mut Inner, tag: u32, outcome: Outcome, background: bool) {
        let slot = &mut inner.slots[tag as usize];
        debug_assert!(slot.outstanding > 0);
        slot.outstanding -= 1;
        match outcome {
            Outcome::Bytes(n) => slot.done += n,
            Outcome::Failed(e) => {
                if slot.error.is_none() {
                    slot.error = Some(e);
                }
            }
        }
        if background {
            let dev = slot.dev as usize;
            inner.devs[dev].as_mut().expect("device is open").tokens += 1;
        }
    }

    /// If every piece of `tag` was issued and completed, hand the request to its owner. The
    /// check is inline (every submission asks, and is seldom done at once); the hand-off is not.
    #[inline(always)]
    fn finish_if_done(&self, inner: &mut Inner, tag: u32) {
        let slot = &inner.slots[tag as usize];
        if slot.state != State::Active || !slot.issued_all || slot.outstanding > 0 {
            return;
        }
        self.finish(inner, tag);
    }

    #[inline(never)]
    fn finish(&self, inner: &mut Inner, tag: u32) {
        let slot = &mut inner.slots[tag as usize];
        slot.state = State::Done;
        if slot.error.is_some() || slot.done != slot.len {
            inner.metrics.errors += 1;
        }
        let dev = slot.dev as usize;
        match slot.owner {
            Owner::Future => {
                if let Some(w) = slot.waker.take() {
                    w.wake();
                }
            }
            Owner::Blocking => {}
            Owner::Detached => {
                inner.detached -= 1;
                inner.done.push_back(tag);
            }
            Owner::Orphaned => self.release(inner, tag),
        }
        let d = inner.devs[dev].as_mut().expect("device is open");
        d.active -= 1;
        if d.closing && d.active == 0 {
            inner.devs[dev] = None;
        }
    }

    fn release(&self, inner: &mut Inner, tag: u32) {
        let slot = &mut inner.slots[tag as usize];
        slot.state = State::Free;
        slot.buf = None;
        slot.raw = None;
        slot.iov = None;
        slot.waker = None;
        inner.free.push(tag);
        if !inner.slot_waiters.is_empty() {
            for w in inner.slot_waiters.drain(..) {
                w.wake();
            }
        }
    }

    fn result_of(slot: &Lbio) -> Result<u32, LbioError> {
        if let Some(e) = slot.error {
            Err(match e {
                PieceError::Errno(errno) => LbioError::Io {
                    op: slot.op,
                    offset: slot.offset,
                    len: slot.len,
                    source: std::io::Error::from_raw_os_error(errno),
                },
                PieceError::Nvme(status) => LbioError::Nvme {
                    op: slot.op,
                    offset: slot.offset,
                    len: slot.len,
                    status,
                },
            })
        } else if slot.done != slot.len {
            Err(LbioError::Short {
                op: slot.op,
                offset: slot.offset,
                done: slot.done,
                len: slot.len,
            })
        } else {
            Ok(slot.len)
        }
    }

    /// If request `tag` is done, free its slot and return its completion.
    pub(crate) fn try_take(&self, tag: Tag) -> Option<Completion> {
        // Completions that came in while the array was busy (a reap nested in a push) first:
        // the engine has counted their CQEs already, so a caller waiting on one of them would
        // otherwise find nothing left to wait for.
        self.apply_deferred();
        self.take_in(&mut self.inner.borrow_mut(), tag)
    }

    fn take_in(&self, inner: &mut Inner, tag: Tag) -> Option<Completion> {
        let slot = &mut inner.slots[tag.0 as usize];
        if slot.state != State::Done {
            return None;
        }
        let result = Self::result_of(slot);
        let buf = slot.buf.take();
        self.release(inner, tag.0);
        Some(Completion { tag, result, buf })
    }

    /// Remember `waker` for request `tag` (a future waiting on it).
    pub(crate) fn set_waker(&self, tag: Tag, waker: &Waker) {
        let mut inner = self.inner.borrow_mut();
        let slot = &mut inner.slots[tag.0 as usize];
        match &slot.waker {
            Some(w) if w.will_wake(waker) => {}
            _ => slot.waker = Some(waker.clone()),
        }
    }

    /// Wake `waker` when a slot frees up.
    pub(crate) fn wait_for_slot(&self, waker: &Waker) {
        self.inner.borrow_mut().slot_waiters.push(waker.clone());
    }

    /// The future for `tag` was dropped: free the slot now if done, else when the I/O ends.
    pub(crate) fn orphan(&self, tag: Tag) {
        let mut inner = self.inner.borrow_mut();
        let inner = &mut *inner;
        let slot = &mut inner.slots[tag.0 as usize];
        match slot.state {
            State::Done => self.release(inner, tag.0),
            State::Active => {
                slot.owner = Owner::Orphaned;
                slot.waker = None;
            }
            State::Free => {}
        }
    }

    /// Next finished detached request (submitted with [`Device::submit`](crate::Device::submit)),
    /// without waiting.
    pub fn take_done(&self) -> Option<Completion> {
        self.apply_deferred();
        let mut inner = self.inner.borrow_mut();
        let tag = inner.done.pop_front()?;
        self.take_in(&mut inner, Tag(tag))
    }

    /// Detached requests finished and not yet taken.
    pub fn done_len(&self) -> usize {
        self.inner.borrow().done.len()
    }

    /// Submit what is queued and wait until at least `min` detached requests are done (fewer if
    /// fewer are in flight: once none is left in flight it returns, whatever other work the
    /// engine carries).
    pub fn wait_done(&self, min: usize) -> Result<(), LbioError> {
        loop {
            self.apply_deferred();
            let (done, detached) = {
                let inner = self.inner.borrow();
                (inner.done.len(), inner.detached)
            };
            if done >= min || detached == 0 || !self.engine.has_work() {
                // What is held still goes to the kernel, as documented (nothing to do, and no
                // system call, when nothing is queued).
                self.engine.submit()?;
                return Ok(());
            }
            self.engine.wait(1)?;
        }
    }

    /// Apply completions that arrived while `inner` was borrowed. Asked on every submit, wait
    /// and take, and seldom needed: the check is inline, the work out of line.
    #[inline(always)]
    fn apply_deferred(&self) {
        if self.has_deferred.get() {
            self.apply_deferred_now();
        }
    }

    #[cold]
    #[inline(never)]
    fn apply_deferred_now(&self) {
        loop {
            let next = self.deferred.borrow_mut().pop_front();
            match next {
                Some((payload, res)) => {
                    self.complete_piece(&mut self.inner.borrow_mut(), payload, res)
                }
                None => break,
            }
        }
        self.has_deferred.set(false);
    }

    fn complete_piece(&self, inner: &mut Inner, payload: u64, res: i32) {
        let tag = (payload & (MAX_SLOTS as u64 - 1)) as u32;
        let piece_len = (payload >> TAG_BITS) as u32;
        let slot = &inner.slots[tag as usize];
        let dev = slot.dev;
        let background = slot.class == Class::Background;
        let outcome = inner.devs[dev as usize]
            .as_ref()
            .expect("a device stays open while it has requests")
            .backend(background)
            .outcome_of(payload, res, piece_len);
        self.piece_done(inner, tag, outcome, background);
        self.finish_if_done(inner, tag);
        // The device may have closed with this completion (its handle was dropped earlier).
        if background && inner.devs[dev as usize].is_some() {
            self.pump(inner, dev, true);
        }
    }
}

impl Drop for LbioArray {
    fn drop(&mut self) {
        // Slot buffers still targeted by in-flight SQEs must not go back to the arena before the
        // kernel is done with them. This array can no longer receive completions (its weak
        // handle is dead), so drain the engine until nothing is in flight.
        let busy = self
            .inner
            .get_mut()
            .slots
            .iter()
            .any(|s| s.state == State::Active && s.outstanding > 0);
        // A failed wait is tried again (`Engine::drain_all`); only a ring that keeps failing is
        // given up on: then the buffers are leaked rather than let the kernel write into frames
        // someone else owns.
        let fate = if busy && !self.engine.drain_all() {
            for slot in self.inner.get_mut().slots.iter_mut() {
                if let Some(b) = slot.buf.take() {
                    std::mem::forget(b);
                }
            }
            FATE_ABANDONED
        } else {
            FATE_DRAINED
        };
        // Release: the drain's completions (and the device's accesses they report) happen
        // before a `Drained` that `ArrayFate::get` reads.
        self.fate.0.store(fate, Ordering::Release);
    }
}

impl CompletionSink for LbioArray {
    fn complete(&self, payload: u64, result: i32, _flags: u32) {
        match self.inner.try_borrow_mut() {
            Ok(mut inner) => {
                self.complete_piece(&mut inner, payload, result);
                drop(inner);
                // A piece the token pump started for this completion may have made the engine
                // reap inside its push, deferring those completions. Nobody else need come by to
                // apply them: a future waiting on one would never be woken, and `block_on` would
                // park with nothing in flight.
                self.apply_deferred();
            }
            Err(_) => {
                // The engine reaped inside one of our own pushes: apply it when that borrow
                // ends.
                self.deferred.borrow_mut().push_back((payload, result));
                self.has_deferred.set(true);
            }
        }
    }
}
