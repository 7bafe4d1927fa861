//! Unit tests of the slot array, classes and backends.
//!
//! Two test backends see what the array does with a request: [`Recorder`] logs every piece it is
//! given and completes it inline on shared RAM (splitting and ordering), and [`Tracked`] forwards
//! pieces to a real [`FileBackend`] but takes their completions through its own sink before
//! handing them to the array, so it knows exactly how many pieces are outstanding at any moment
//! (the token budget).

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Waker};

use aios_core::{CompletionSink, CoreError, Engine, EngineConfig, FixedBuf, SinkId};

use crate::*;

const KIB: usize = 1024;

fn engine() -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 256,
        arena_bytes: 8 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine")
}

fn array(engine: &Rc<Engine>, cfg: LbioConfig) -> Rc<LbioArray> {
    LbioArray::new(Rc::clone(engine), cfg).expect("lbio array")
}

/// A buffer of `len` bytes whose byte `i` is `seed + i / 512` (every sector differs).
fn patterned(engine: &Engine, len: usize, seed: u8) -> FixedBuf {
    let mut b = engine.try_alloc(len).expect("arena has room");
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_add((i / 512) as u8);
    }
    b
}

fn is_patterned(b: &[u8], seed: u8) -> bool {
    b.iter()
        .enumerate()
        .all(|(i, &x)| x == seed.wrapping_add((i / 512) as u8))
}

fn geometry(capacity_bytes: u64, align: u32, max_transfer_bytes: u32) -> Geometry {
    Geometry {
        capacity_bytes,
        logical_block: align,
        mem_align: align,
        offset_align: align,
        max_transfer_bytes,
    }
}

/// Which of a device's two backends saw a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Critical,
    Background,
}

/// One piece as a backend saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seen {
    route: Route,
    op: Op,
    offset: u64,
    len: u32,
    fua: bool,
}

/// Shared RAM that logs every piece and completes it inline.
struct Recorder {
    route: Route,
    mem: Rc<MemBackend>,
    log: Rc<RefCell<Vec<Seen>>>,
}

impl Backend for Recorder {
    fn caps(&self) -> Caps {
        self.mem.caps()
    }

    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        self.log.borrow_mut().push(Seen {
            route: self.route,
            op: piece.op,
            offset: piece.offset,
            len: piece.len,
            fua: piece.fua,
        });
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

/// A RAM device whose two routes log into one shared log.
fn recorded_device(
    lbio: &Rc<LbioArray>,
    capacity: usize,
    max_transfer: u32,
) -> (Device, Rc<RefCell<Vec<Seen>>>) {
    let mem = Rc::new(MemBackend::new(capacity));
    let log = Rc::new(RefCell::new(Vec::new()));
    let backend = |route| {
        Box::new(Recorder {
            route,
            mem: Rc::clone(&mem),
            log: Rc::clone(&log),
        })
    };
    let dev = Device::from_backends(
        lbio,
        backend(Route::Critical),
        backend(Route::Background),
        geometry(capacity as u64, 512, max_transfer),
        true,
    )
    .expect("device");
    (dev, log)
}

/// A file in /var/tmp (ext4, O_DIRECT), removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, bytes: u64) -> TempFile {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!(
            "/var/tmp/lbio-unit-{}-{n}-{name}.img",
            std::process::id()
        ));
        let f = std::fs::File::create(&path).expect("create test file");
        f.set_len(bytes).expect("size test file");
        TempFile(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `file` opened for writing, its critical requests on the io_uring route.
fn ring_device(lbio: &Rc<LbioArray>, file: &TempFile) -> Device {
    Device::open(
        lbio,
        file.path(),
        DeviceConfig {
            write: true,
            route: RouteChoice::Ring,
            ..DeviceConfig::default()
        },
    )
    .unwrap()
}

/// Takes the completions of [`Tracked`] pieces (so it sees each one end), then hands them to the
/// lbio array, whose sink they were meant for.
struct Tracker {
    lbio: Weak<LbioArray>,
    /// Tags of pieces started and not completed, with whether they came from the background route.
    in_flight: RefCell<Vec<(u64, Route)>>,
    max_background: Cell<usize>,
    max_critical: Cell<usize>,
    log: RefCell<Vec<Seen>>,
}

impl Tracker {
    fn new(lbio: &Rc<LbioArray>) -> (Rc<Tracker>, SinkId) {
        let t = Rc::new(Tracker {
            lbio: Rc::downgrade(lbio),
            in_flight: RefCell::new(Vec::new()),
            max_background: Cell::new(0),
            max_critical: Cell::new(0),
            log: RefCell::new(Vec::new()),
        });
        let sink = lbio
            .engine()
            .register_sink(Rc::downgrade(&t) as Weak<dyn CompletionSink>)
            .expect("sink slot");
        (t, sink)
    }

    fn outstanding(&self, route: Route) -> usize {
        self.in_flight
            .borrow()
            .iter()
            .filter(|(_, r)| *r == route)
            .count()
    }

    fn background_pieces(&self) -> Vec<Seen> {
        self.log
            .borrow()
            .iter()
            .filter(|s| s.route == Route::Background)
            .copied()
            .collect()
    }
}

impl CompletionSink for Tracker {
    fn complete(&self, payload: u64, result: i32, flags: u32) {
        {
            let mut f = self.in_flight.borrow_mut();
            let i = f
                .iter()
                .position(|(tag, _)| *tag == payload)
                .expect("a completion for a piece we started");
            f.remove(i);
        }
        if let Some(lbio) = self.lbio.upgrade() {
            lbio.complete(payload, result, flags);
        }
    }
}

/// A real `FileBackend` whose completions go through a [`Tracker`].
struct Tracked {
    route: Route,
    file: FileBackend,
    tracker: Rc<Tracker>,
    sink: SinkId,
}

impl Backend for Tracked {
    fn caps(&self) -> Caps {
        self.file.caps()
    }

    unsafe fn start(
        &self,
        engine: &Engine,
        _lbio_sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let t = &self.tracker;
        t.log.borrow_mut().push(Seen {
            route: self.route,
            op: piece.op,
            offset: piece.offset,
            len: piece.len,
            fua: piece.fua,
        });
        // Counted before the push: a push that finds the SQ full may dispatch completions.
        t.in_flight.borrow_mut().push((tag, self.route));
        let n = t.outstanding(self.route);
        let max = match self.route {
            Route::Critical => &t.max_critical,
            Route::Background => &t.max_background,
        };
        max.set(max.get().max(n));
        // SAFETY: the caller's contract on `piece` is passed on unchanged; the completion reaches
        // the array through the tracker's sink, after the kernel is done with the buffer.
        let r = unsafe { self.file.start(engine, self.sink, tag, piece) };
        if !matches!(r, Ok(Started::Queued)) {
            let mut f = t.in_flight.borrow_mut();
            let i = f.iter().rposition(|(x, _)| *x == tag).expect("just pushed");
            f.remove(i);
        }
        r
    }
}

/// A device over a real O_DIRECT file whose two routes are tracked by one tracker.
fn tracked_device(lbio: &Rc<LbioArray>, file: &TempFile, bytes: u64) -> (Device, Rc<Tracker>) {
    let engine = lbio.engine();
    let fd = Rc::new(aios_core::sys::open_direct(file.path(), true).expect("O_DIRECT open"));
    let file_backend = FileBackend::new(engine, fd, false).expect("register file");
    let (tracker, sink) = Tracker::new(lbio);
    let backend = |route| {
        Box::new(Tracked {
            route,
            file: file_backend.clone(),
            tracker: Rc::clone(&tracker),
            sink,
        })
    };
    let dev = Device::from_backends(
        lbio,
        backend(Route::Critical),
        backend(Route::Background),
        geometry(bytes, 4096, 1 << 20),
        true,
    )
    .expect("device");
    (dev, tracker)
}

fn drain(engine: &Engine) {
    while engine.has_work() {
        engine.wait(1).expect("wait");
    }
}

// ---------------------------------------------------------------------------------------------
// Splitting and ordering

#[test]
fn critical_request_is_split_at_max_transfer_and_completes_as_one() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (dev, log) = recorded_device(&lbio, 1 << 20, 8192);

    let buf = patterned(&engine, 64 * KIB, 3);
    let buf = dev.write_at_blocking(128 * KIB as u64, buf, true).unwrap();
    let want: Vec<Seen> = (0..8)
        .map(|i| Seen {
            route: Route::Critical,
            op: Op::Write,
            offset: 128 * KIB as u64 + i * 8192,
            len: 8192,
            fua: true,
        })
        .collect();
    assert_eq!(
        *log.borrow(),
        want,
        "eight FUA pieces of max transfer, in order"
    );
    let m = lbio.metrics();
    assert_eq!((m.requests, m.pieces, m.split_requests), (1, 8, 1));

    // A length that is not a multiple of max transfer: the last piece is the remainder.
    log.borrow_mut().clear();
    let mut buf = buf;
    buf.set_len(20 * KIB).unwrap();
    buf.fill(0);
    let back = dev.read_at_blocking(128 * KIB as u64, buf).unwrap();
    let lens: Vec<(u64, u32)> = log.borrow().iter().map(|s| (s.offset, s.len)).collect();
    let base = 128 * KIB as u64;
    assert_eq!(
        lens,
        [(base, 8192), (base + 8192, 8192), (base + 16384, 4096)]
    );
    assert!(log
        .borrow()
        .iter()
        .all(|s| s.op == Op::Read && s.route == Route::Critical));
    assert!(
        is_patterned(&back, 3),
        "the pieces land in the right parts of the buffer"
    );
    assert_eq!(lbio.metrics().split_requests, 2);
}

#[test]
fn request_within_max_transfer_is_one_piece() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (dev, log) = recorded_device(&lbio, 1 << 20, 8192);
    let buf = patterned(&engine, 8192, 1);
    dev.write_at_blocking(0, buf, false).unwrap();
    assert_eq!(log.borrow().len(), 1);
    assert_eq!(lbio.metrics().split_requests, 0);
}

#[test]
fn background_request_is_split_into_split_bytes_pieces_in_lba_order() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    assert_eq!(lbio.config().split_bytes, 32 << 10, "default split");
    let (dev, log) = recorded_device(&lbio, 2 << 20, 1 << 20);

    let base = 512 * KIB as u64;
    let buf = patterned(&engine, 256 * KIB + 8 * KIB, 9);
    let buf = dev
        .run_blocking(Io::write(base, buf).class(Class::Background))
        .unwrap()
        .unwrap();
    let seen = log.borrow().clone();
    assert!(seen
        .iter()
        .all(|s| s.route == Route::Background && s.op == Op::Write));
    let got: Vec<(u64, u32)> = seen.iter().map(|s| (s.offset, s.len)).collect();
    let mut want: Vec<(u64, u32)> = (0..8).map(|i| (base + i * 32768, 32768)).collect();
    want.push((base + 8 * 32768, 8192));
    assert_eq!(
        got, want,
        "32 KiB pieces in ascending LBA order, then the remainder"
    );

    // Read it back through the critical route (one piece: under max transfer).
    log.borrow_mut().clear();
    let mut buf = buf;
    buf.fill(0);
    let back = dev.read_at_blocking(base, buf).unwrap();
    assert!(is_patterned(&back, 9));
    assert_eq!(log.borrow().len(), 1);
    assert_eq!(log.borrow()[0].route, Route::Critical);
}

#[test]
fn background_pieces_are_also_capped_at_max_transfer() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (dev, log) = recorded_device(&lbio, 1 << 20, 16 * KIB as u32);
    let buf = patterned(&engine, 64 * KIB, 4);
    let buf = dev
        .run_blocking(Io::write(0, buf).class(Class::Background))
        .unwrap()
        .unwrap();
    let lens: Vec<u32> = log.borrow().iter().map(|s| s.len).collect();
    assert_eq!(lens, [16384; 4], "min(split_bytes, max transfer)");
    let back = dev
        .run_blocking(Io::read(0, buf).class(Class::Background))
        .unwrap()
        .unwrap();
    assert!(is_patterned(&back, 4));
}

#[test]
fn custom_split_bytes_is_honoured() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            split_bytes: 4096,
            ..LbioConfig::default()
        },
    );
    let (dev, log) = recorded_device(&lbio, 1 << 20, 1 << 20);
    let buf = patterned(&engine, 16 * KIB, 4);
    dev.run_blocking(Io::write(4096, buf).class(Class::Background))
        .unwrap();
    let got: Vec<(u64, u32)> = log.borrow().iter().map(|s| (s.offset, s.len)).collect();
    assert_eq!(
        got,
        [(4096, 4096), (8192, 4096), (12288, 4096), (16384, 4096)]
    );
}

// ---------------------------------------------------------------------------------------------
// The token budget, with real asynchronous I/O

#[test]
fn background_pieces_in_flight_never_exceed_the_token_budget() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    assert_eq!(lbio.config().max_inflight_background, 8);
    let file = TempFile::new("tokens", 4 << 20);
    let (dev, tracker) = tracked_device(&lbio, &file, 4 << 20);

    // Three background writes: 1 MiB (32 pieces) and two of 256 KiB (8 pieces each).
    let requests = [
        (0u64, 1 << 20, 11u8),
        (1 << 20, 256 * KIB, 12),
        (2 << 20, 256 * KIB, 13),
    ];
    for &(off, len, seed) in &requests {
        let io = Io::write(off, patterned(&engine, len, seed)).class(Class::Background);
        dev.submit(io).map_err(|(e, _)| e).unwrap();
    }
    assert_eq!(
        tracker.outstanding(Route::Background),
        8,
        "the first eight pieces go out at once, the rest wait for tokens"
    );
    lbio.wait_done(3).unwrap();
    for _ in 0..3 {
        let c = lbio.take_done().expect("three detached completions");
        c.result.unwrap();
    }
    assert!(lbio.take_done().is_none());
    assert_eq!(
        tracker.max_background.get(),
        8,
        "never more than the budget in flight"
    );
    assert_eq!(tracker.outstanding(Route::Background), 0);

    // Every piece went out in order: request by request, ascending LBA within each.
    let pieces = tracker.background_pieces();
    assert_eq!(pieces.len(), 32 + 8 + 8);
    assert!(pieces.iter().all(|p| p.len == 32768 && p.op == Op::Write));
    let offsets: Vec<u64> = pieces.iter().map(|p| p.offset).collect();
    let mut sorted = offsets.clone();
    sorted.sort_unstable();
    assert_eq!(offsets, sorted);
    assert!(
        lbio.metrics().throttled_pieces >= 1,
        "the later requests found no token"
    );

    // The bytes are all there.
    for &(off, len, seed) in &requests {
        let back = dev
            .read_at_blocking(off, engine.try_alloc(len).unwrap())
            .unwrap();
        assert!(is_patterned(&back, seed), "request at {off}");
    }
    assert_eq!(lbio.free_slots(), lbio.config().slots);
}

#[test]
fn critical_requests_bypass_the_token_budget() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("bypass", 4 << 20);
    let (dev, tracker) = tracked_device(&lbio, &file, 4 << 20);

    let bg = Io::write(0, patterned(&engine, 1 << 20, 5)).class(Class::Background);
    dev.submit(bg).map_err(|(e, _)| e).unwrap();
    assert_eq!(
        tracker.outstanding(Route::Background),
        8,
        "every token taken"
    );
    for i in 0..4u64 {
        let io = Io::write((2 << 20) + i * 65536, patterned(&engine, 65536, 6));
        dev.submit(io).map_err(|(e, _)| e).unwrap();
    }
    assert_eq!(
        tracker.outstanding(Route::Critical),
        4,
        "critical writes are issued at once while background holds every token"
    );
    assert_eq!(tracker.outstanding(Route::Background), 8);
    lbio.wait_done(5).unwrap();
    while let Some(c) = lbio.take_done() {
        c.result.unwrap();
    }
    assert_eq!(tracker.max_background.get(), 8);
    assert_eq!(tracker.max_critical.get(), 4);
}

#[test]
fn each_device_has_its_own_token_budget() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (fa, fb) = (
        TempFile::new("budget-a", 1 << 20),
        TempFile::new("budget-b", 1 << 20),
    );
    let (a, ta) = tracked_device(&lbio, &fa, 1 << 20);
    let (b, tb) = tracked_device(&lbio, &fb, 1 << 20);
    for (dev, seed) in [(&a, 1u8), (&b, 2)] {
        let io = Io::write(0, patterned(&engine, 512 * KIB, seed)).class(Class::Background);
        dev.submit(io).map_err(|(e, _)| e).unwrap();
    }
    assert_eq!(ta.outstanding(Route::Background), 8);
    assert_eq!(
        tb.outstanding(Route::Background),
        8,
        "device a's pieces do not use b's tokens"
    );
    lbio.wait_done(2).unwrap();
    while let Some(c) = lbio.take_done() {
        c.result.unwrap();
    }
    for (dev, seed) in [(&a, 1u8), (&b, 2)] {
        let back = dev
            .read_at_blocking(0, engine.try_alloc(512 * KIB).unwrap())
            .unwrap();
        assert!(is_patterned(&back, seed));
    }
}

#[test]
fn a_smaller_budget_is_honoured() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_inflight_background: 2,
            ..LbioConfig::default()
        },
    );
    let file = TempFile::new("budget-2", 1 << 20);
    let (dev, tracker) = tracked_device(&lbio, &file, 1 << 20);
    let io = Io::read(0, engine.try_alloc(512 * KIB).unwrap()).class(Class::Background);
    let back = dev.run_blocking(io).unwrap().unwrap();
    assert!(back.iter().all(|&x| x == 0), "a fresh file reads as zeros");
    assert_eq!(tracker.max_background.get(), 2);
    assert_eq!(tracker.background_pieces().len(), 16);
}

#[test]
fn throttled_pieces_counts_every_piece_that_waited_for_a_token() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("throttled", 1 << 20);
    let (dev, _tracker) = tracked_device(&lbio, &file, 1 << 20);
    let io = Io::write(0, patterned(&engine, 1 << 20, 1)).class(Class::Background);
    dev.run_blocking(io).unwrap();
    // 32 pieces, 8 tokens: the last 24 pieces each waited for a token.
    assert_eq!(lbio.metrics().throttled_pieces, 24);
}

// ---------------------------------------------------------------------------------------------
// Slots

#[test]
fn slot_exhaustion_is_back_pressure_and_gives_the_buffer_back() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            slots: 4,
            ..LbioConfig::default()
        },
    );
    let dev = Device::memory(&lbio, 1 << 20).unwrap();
    // Memory completes inline; a detached request holds its slot until it is taken.
    for i in 0..4u64 {
        dev.submit(Io::write(i * 4096, patterned(&engine, 4096, i as u8)))
            .map_err(|(e, _)| e)
            .unwrap();
    }
    assert_eq!(lbio.free_slots(), 0);
    let (err, buf) = dev
        .submit(Io::read(0, patterned(&engine, 8192, 77)))
        .expect_err("no slot left");
    assert!(matches!(err, LbioError::NoFreeSlot { slots: 4 }), "{err:?}");
    assert!(err.is_would_block());
    assert!(err.to_string().contains('4'), "{err}");
    let buf = buf.expect("the refused request's buffer comes back");
    assert_eq!(buf.len(), 8192);
    assert!(is_patterned(&buf, 77), "untouched");
    assert_eq!(lbio.metrics().slot_exhausted, 1);

    // A blocking call with nothing in flight to free a slot fails instead of hanging.
    let blocked = dev.read_at_blocking(0, engine.try_alloc(4096).unwrap());
    assert!(matches!(blocked, Err(LbioError::NoFreeSlot { slots: 4 })));

    let first = lbio.take_done().expect("a completion");
    first.result.unwrap();
    assert_eq!(lbio.free_slots(), 1);
    let tag = dev.submit(Io::read(0, buf)).map_err(|(e, _)| e).unwrap();
    let c = lbio.take_done().expect("the rest");
    assert_ne!(c.tag, tag);
    while let Some(c) = lbio.take_done() {
        if c.tag == tag {
            assert!(is_patterned(&c.buf.unwrap()[..4096], 0));
        }
    }
    assert_eq!(lbio.free_slots(), 4, "every slot back once taken");
}

#[test]
fn dropped_future_does_not_leak_its_slot_or_buffer() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("orphan", 2 << 20);
    let (dev, tracker) = tracked_device(&lbio, &file, 2 << 20);
    let slots = lbio.config().slots;
    let frames = engine.arena().frames();
    let mut cx = Context::from_waker(Waker::noop());

    {
        let fut = dev.read_at(0, engine.try_alloc(64 * KIB).unwrap());
        let mut fut = pin!(fut);
        assert!(
            fut.as_mut().poll(&mut cx).is_pending(),
            "the read is in the kernel"
        );
        let bg = dev.future(
            Io::read(64 * KIB as u64, engine.try_alloc(1 << 20).unwrap()).class(Class::Background),
        );
        let mut bg = pin!(bg);
        assert!(bg.as_mut().poll(&mut cx).is_pending());
        assert_eq!(lbio.free_slots(), slots - 2);
        assert_eq!(tracker.outstanding(Route::Background), 8);
    }
    // Dropped while the kernel still owns the buffers: the slots keep them until it is done.
    assert_eq!(lbio.free_slots(), slots - 2);
    assert!(engine.arena().free_frames() < frames);
    drain(&engine);
    assert_eq!(
        lbio.free_slots(),
        slots,
        "orphaned slots freed at completion"
    );
    assert_eq!(
        engine.arena().free_frames(),
        frames,
        "and their buffers given back"
    );
    assert_eq!(
        tracker.background_pieces().len(),
        32,
        "the orphan ran to its end"
    );

    // Its tokens came back too: a new background request gets the whole budget.
    let io = Io::write(0, patterned(&engine, 1 << 20, 8)).class(Class::Background);
    dev.submit(io).map_err(|(e, _)| e).unwrap();
    assert_eq!(tracker.outstanding(Route::Background), 8);
    lbio.wait_done(1).unwrap();
    lbio.take_done().unwrap().result.unwrap();
}

#[test]
fn dropped_future_on_an_inline_device_frees_its_slot() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let dev = Device::memory(&lbio, 1 << 20).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    {
        let fut = dev.write_at(0, patterned(&engine, 4096, 1), false);
        let mut fut = pin!(fut);
        assert!(fut.as_mut().poll(&mut cx).is_ready());
    }
    {
        // Never polled: nothing was submitted.
        let _fut = dev.read_at(0, engine.try_alloc(4096).unwrap());
    }
    assert_eq!(lbio.free_slots(), lbio.config().slots);
    assert_eq!(engine.arena().free_frames(), engine.arena().frames());
}

#[test]
fn async_waits_for_a_slot_instead_of_failing() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            slots: 2,
            ..LbioConfig::default()
        },
    );
    let file = TempFile::new("slot-wait", 1 << 20);
    let (dev, _tracker) = tracked_device(&lbio, &file, 1 << 20);
    // Six futures on two slots, polled together: the later ones wait for slots and then run.
    let mut futs: Vec<_> = (0..6u64)
        .map(|i| Box::pin(dev.write_at(i * 4096, patterned(&engine, 4096, i as u8), false)))
        .collect();
    let mut done = vec![false; futs.len()];
    engine
        .block_on(std::future::poll_fn(|cx| {
            for (f, d) in futs.iter_mut().zip(done.iter_mut()) {
                if !*d {
                    if let Poll::Ready(r) = f.as_mut().poll(cx) {
                        r.unwrap();
                        *d = true;
                    }
                }
            }
            if done.iter().all(|d| *d) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }))
        .unwrap();
    drop(futs);
    for i in 0..6u64 {
        let back = dev
            .read_at_blocking(i * 4096, engine.try_alloc(4096).unwrap())
            .unwrap();
        assert!(is_patterned(&back, i as u8), "write {i}");
    }
    assert_eq!(lbio.free_slots(), 2);
}

// ---------------------------------------------------------------------------------------------
// Devices going away

#[test]
fn device_dropped_with_critical_requests_in_flight_closes_after_them() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_devices: 1,
            ..LbioConfig::default()
        },
    );
    let file = TempFile::new("close-critical", 1 << 20);
    let (dev, _tracker) = tracked_device(&lbio, &file, 1 << 20);
    dev.submit(Io::write(0, patterned(&engine, 64 * KIB, 3)))
        .map_err(|(e, _)| e)
        .unwrap();
    drop(dev);
    assert!(
        matches!(
            Device::memory(&lbio, 4096),
            Err(LbioError::TooManyDevices { max: 1 })
        ),
        "the device slot is held until its request ends"
    );
    lbio.wait_done(1).unwrap();
    lbio.take_done().unwrap().result.unwrap();
    assert!(Device::memory(&lbio, 4096).is_ok(), "and freed after");
}

#[test]
fn device_dropped_with_a_background_request_in_flight_closes_after_it() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("close-background", 1 << 20);
    let (dev, _tracker) = tracked_device(&lbio, &file, 1 << 20);
    let io = Io::write(0, patterned(&engine, 64 * KIB, 3)).class(Class::Background);
    dev.submit(io).map_err(|(e, _)| e).unwrap();
    drop(dev);
    lbio.wait_done(1).unwrap();
    lbio.take_done().unwrap().result.unwrap();
    assert_eq!(lbio.free_slots(), lbio.config().slots);
}

#[test]
fn dropping_the_array_does_not_hand_out_a_buffer_the_kernel_still_owns() {
    use std::io::Write;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    // One frame, so a frame handed out again is the one the read targets.
    let engine = Engine::new(EngineConfig {
        ring_entries: 8,
        arena_bytes: 4096,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = array(&engine, LbioConfig::default());
    // A read from a socket stays in the kernel until the peer sends.
    let (ours, peer) = UnixStream::pair().unwrap();
    let backend = FileBackend::new(&engine, Rc::new(OwnedFd::from(ours)), false).unwrap();
    let dev = Device::from_backends(
        &lbio,
        Box::new(backend.clone()),
        Box::new(backend),
        geometry(1 << 20, 512, 1 << 20),
        true,
    )
    .unwrap();
    dev.submit(Io::read(0, engine.try_alloc(4096).unwrap()))
        .map_err(|(e, _)| e)
        .unwrap();
    assert!(engine.has_work(), "the read waits for the peer");

    // The peer sends a little later. Only the order matters: were it late, a broken array would
    // go unnoticed, but a correct one can never fail (and one whose drop waits is unblocked).
    let writer = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        (&peer).write_all(&[0x55; 4096]).unwrap();
        peer
    });
    drop(dev);
    drop(lbio);
    let mut reused = match engine.try_alloc(4096) {
        Some(b) => b,
        None => {
            drain(&engine);
            engine
                .try_alloc(4096)
                .expect("the frame comes back once the read is done")
        }
    };
    reused.fill(0xaa);
    drain(&engine);
    let _peer = writer.join().unwrap();
    assert!(
        reused.iter().all(|&b| b == 0xaa),
        "the kernel wrote a dropped array's read into a buffer handed out again"
    );
}

#[test]
fn device_slots_are_limited_and_reused() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_devices: 2,
            ..LbioConfig::default()
        },
    );
    let a = Device::memory(&lbio, 4096).unwrap();
    let b = Device::memory(&lbio, 4096).unwrap();
    let e = Device::memory(&lbio, 4096).unwrap_err();
    assert!(matches!(e, LbioError::TooManyDevices { max: 2 }), "{e:?}");
    assert!(e.to_string().contains("max_devices"), "{e}");
    drop(a);
    let _c = Device::memory(&lbio, 4096).expect("a closed device's slot is reused");
    drop(b);
}

// ---------------------------------------------------------------------------------------------
// Flush, read-only, device errors

#[test]
fn flush_reaches_the_backend_and_completes() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (dev, log) = recorded_device(&lbio, 1 << 20, 1 << 20);
    dev.flush_blocking().unwrap();
    assert!(engine.block_on(dev.flush()).unwrap().unwrap().is_none());
    dev.run_blocking(Io::flush().class(Class::Background))
        .unwrap();
    let seen = log.borrow().clone();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.op == Op::Flush && s.len == 0));
    assert_eq!(seen[2].route, Route::Background);

    // Through the ring on a real file (fdatasync), detached.
    let file = TempFile::new("flush", 1 << 20);
    let (fdev, tracker) = tracked_device(&lbio, &file, 1 << 20);
    fdev.write_at_blocking(0, patterned(&engine, 4096, 1), false)
        .unwrap();
    let tag = fdev.submit(Io::flush()).map_err(|(e, _)| e).unwrap();
    lbio.wait_done(1).unwrap();
    let c = lbio.take_done().unwrap();
    assert_eq!(c.tag, tag);
    assert_eq!(c.result.unwrap(), 0);
    assert!(c.buf.is_none());
    assert_eq!(tracker.log.borrow().last().unwrap().op, Op::Flush);
    assert!(engine.block_on(fdev.flush()).unwrap().unwrap().is_none());
}

#[test]
fn read_only_device_refuses_writes_and_flushes() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let mem = Rc::new(MemBackend::new(1 << 20));
    let log = Rc::new(RefCell::new(Vec::new()));
    let backend = || {
        Box::new(Recorder {
            route: Route::Critical,
            mem: Rc::clone(&mem),
            log: Rc::clone(&log),
        })
    };
    let dev = Device::from_backends(
        &lbio,
        backend(),
        backend(),
        geometry(1 << 20, 512, 1 << 20),
        false,
    )
    .unwrap();

    let e = dev
        .write_at_blocking(0, patterned(&engine, 4096, 1), false)
        .unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Write)), "{e:?}");
    assert!(e.to_string().contains("read-only"), "{e}");
    let (e, buf) = dev
        .submit(Io::write(0, patterned(&engine, 4096, 2)))
        .unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Write)));
    assert!(is_patterned(&buf.expect("buffer given back"), 2));
    let e = engine.block_on(dev.flush()).unwrap().unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Flush)), "{e:?}");
    let e = engine
        .block_on(dev.future(Io::write(0, patterned(&engine, 4096, 1)).class(Class::Background)))
        .unwrap()
        .unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Write)));
    assert!(log.borrow().is_empty(), "nothing reached the device");

    let back = dev
        .read_at_blocking(0, engine.try_alloc(4096).unwrap())
        .unwrap();
    assert!(back.iter().all(|&x| x == 0), "reads still work");
    assert_eq!(lbio.free_slots(), lbio.config().slots);
}

/// RAM that fails (or shortens) pieces at one offset.
struct Faulty {
    mem: MemBackend,
    bad_offset: u64,
    result: i32,
}

impl Backend for Faulty {
    fn caps(&self) -> Caps {
        self.mem.caps()
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        if piece.offset == self.bad_offset {
            return Ok(Started::Done(self.result));
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

fn faulty_device(lbio: &Rc<LbioArray>, bad_offset: u64, result: i32) -> Device {
    let backend = || {
        Box::new(Faulty {
            mem: MemBackend::new(1 << 20),
            bad_offset,
            result,
        })
    };
    Device::from_backends(
        lbio,
        backend(),
        backend(),
        geometry(1 << 20, 512, 4096),
        true,
    )
    .unwrap()
}

#[test]
fn a_failed_piece_fails_the_whole_request_with_its_errno() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let dev = faulty_device(&lbio, 8192 + 4096, -libc::EIO);
    let e = dev
        .write_at_blocking(8192, patterned(&engine, 12288, 1), false)
        .unwrap_err();
    match &e {
        LbioError::Io {
            op: Op::Write,
            offset: 8192,
            len: 12288,
            source,
        } => assert_eq!(source.raw_os_error(), Some(libc::EIO)),
        other => panic!("expected an I/O error for the whole request, got {other:?}"),
    }
    assert!(e.to_string().contains("8192"), "{e}");
    let m = lbio.metrics();
    assert_eq!((m.errors, m.pieces), (1, 3), "every piece was still issued");
    assert_eq!(lbio.free_slots(), lbio.config().slots);
    // Requests that miss the bad piece are unaffected.
    dev.write_at_blocking(0, patterned(&engine, 8192, 1), false)
        .unwrap();
}

#[test]
fn a_short_piece_is_reported_as_short() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let dev = faulty_device(&lbio, 4096, 512);
    let tag = dev
        .submit(Io::read(0, engine.try_alloc(8192).unwrap()))
        .map_err(|(e, _)| e)
        .unwrap();
    let c = lbio.take_done().unwrap();
    assert_eq!(c.tag, tag);
    match c.result {
        Err(LbioError::Short {
            op: Op::Read,
            offset: 0,
            done: 4608,
            len: 8192,
        }) => {}
        other => panic!("expected a short read, got {other:?}"),
    }
    assert_eq!(
        c.buf.map(|b| b.len()),
        Some(8192),
        "the buffer still comes back"
    );
}

// ---------------------------------------------------------------------------------------------
// Configuration and static size

#[test]
fn config_is_validated_and_names_the_bad_value() {
    let engine = engine();
    let bad = [
        (
            LbioConfig {
                slots: 0,
                ..LbioConfig::default()
            },
            "slots 0",
        ),
        (
            LbioConfig {
                slots: MAX_SLOTS + 1,
                ..LbioConfig::default()
            },
            "1048577",
        ),
        (
            LbioConfig {
                max_inflight_background: 0,
                ..LbioConfig::default()
            },
            "max_inflight_background 0",
        ),
        (
            LbioConfig {
                split_bytes: 3000,
                ..LbioConfig::default()
            },
            "split_bytes 3000",
        ),
        (
            LbioConfig {
                max_devices: 0,
                ..LbioConfig::default()
            },
            "max_devices",
        ),
    ];
    for (cfg, needle) in bad {
        match LbioArray::new(Rc::clone(&engine), cfg) {
            Err(e @ LbioError::Config(_)) => assert!(e.to_string().contains(needle), "{e}"),
            Err(e) => panic!("{cfg:?}: expected a config error, got {e:?}"),
            Ok(_) => panic!("{cfg:?} was accepted"),
        }
    }
}

#[test]
fn geometry_is_validated() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let mem = || Box::new(MemBackend::new(1 << 20));
    for g in [geometry(1 << 20, 500, 4000), geometry(1 << 20, 512, 4000)] {
        let e = Device::from_backends(&lbio, mem(), mem(), g, true).unwrap_err();
        assert!(matches!(e, LbioError::Config(_)), "{e:?}");
        assert!(e.to_string().contains("4000"), "{e}");
    }
}

#[test]
fn static_bytes_fit_the_aios_budget() {
    let bytes = LbioArray::static_bytes(1024);
    println!(
        "LbioArray::static_bytes(1024) = {bytes} bytes ({:.1} KiB; AIOS Table 2: 192 KiB of lbio \
         array per core)",
        bytes as f64 / 1024.0
    );
    assert!(bytes <= 256 << 10, "{bytes} bytes of static lbio state");
    assert!(
        bytes >= 1024 * 8,
        "at least a tag and a free-list entry per slot"
    );
    assert_eq!(LbioArray::static_bytes(2048), 2 * bytes, "linear in slots");
}

#[test]
fn raw_buffers_in_a_registered_shared_region_and_in_plain_memory_round_trip() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("raw", 1 << 20);
    let dev = ring_device(&lbio, &file);
    let region = std::sync::Arc::new(aios_core::SharedRegion::map(64 * KIB, false).unwrap());
    let index = engine.register_region(&region).unwrap();
    assert_eq!(index, 1, "slot 0 is the arena");
    assert_eq!(
        engine.register_region(&region).unwrap(),
        1,
        "same region, same index"
    );
    let base = std::ptr::NonNull::new(region.as_ptr()).unwrap();
    // SAFETY: the region is 64 KiB; these 8 KiB are used only by the requests below, each of
    // which completes before the memory is touched again.
    let (first, second) = unsafe {
        std::ptr::write_bytes(base.as_ptr(), 0x5a, 8 * KIB);
        (
            RawBuf::new(base, 8 * KIB as u32, Some(index)),
            RawBuf::new(base.add(16 * KIB), 8 * KIB as u32, Some(index)),
        )
    };
    // SAFETY: as above.
    let done = dev
        .run_blocking(unsafe { Io::write_raw(64 * KIB as u64, first) })
        .unwrap();
    assert!(done.is_none(), "a raw request carries no arena buffer back");
    // SAFETY: as above.
    dev.run_blocking(unsafe { Io::read_raw(64 * KIB as u64, second) })
        .unwrap();
    // SAFETY: the read completed; nothing else uses these bytes.
    let got = unsafe { std::slice::from_raw_parts(base.as_ptr().add(16 * KIB), 8 * KIB) };
    assert!(got.iter().all(|&b| b == 0x5a));

    // Unregistered memory: a plain read, the kernel pins the pages for the I/O.
    let mut plain = vec![0u8; 12 * KIB];
    let at = (plain.as_mut_ptr() as usize).next_multiple_of(4096) - plain.as_ptr() as usize;
    // SAFETY: `plain` outlives the blocking read; 8 KiB from `at` fit in it.
    let raw = unsafe {
        RawBuf::new(
            std::ptr::NonNull::new(plain.as_mut_ptr().add(at)).unwrap(),
            8 * KIB as u32,
            None,
        )
    };
    // SAFETY: as above.
    dev.run_blocking(unsafe { Io::read_raw(64 * KIB as u64, raw) })
        .unwrap();
    assert!(plain[at..at + 8 * KIB].iter().all(|&b| b == 0x5a));

    // A raw buffer is validated like any other.
    // SAFETY: refused before it reaches the device.
    let odd = unsafe { RawBuf::new(base.add(1), 4096, Some(index)) };
    let e = dev
        .run_blocking(unsafe { Io::read_raw(0, odd) })
        .unwrap_err();
    assert!(matches!(e, LbioError::Unaligned { .. }), "{e}");
}

/// Pieces as a backend saw them: (offset, len, segments).
type PieceLog = Rc<RefCell<Vec<(u64, u32, u16)>>>;

/// RAM that logs each piece and declares vectored pieces or not.
struct Scatter {
    mem: Rc<MemBackend>,
    vectored: bool,
    log: PieceLog,
}

impl Backend for Scatter {
    fn caps(&self) -> Caps {
        Caps {
            vectored: self.vectored,
            ..self.mem.caps()
        }
    }

    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        assert!(
            self.vectored || piece.iov_count == 0,
            "a backend without Caps::vectored got a vectored piece"
        );
        self.log
            .borrow_mut()
            .push((piece.offset, piece.len, piece.iov_count));
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

fn scatter_device(
    lbio: &Rc<LbioArray>,
    capacity: usize,
    max_transfer: u32,
    vectored: bool,
) -> (Device, PieceLog) {
    let mem = Rc::new(MemBackend::new(capacity));
    let log = Rc::new(RefCell::new(Vec::new()));
    let backend = || {
        Box::new(Scatter {
            mem: Rc::clone(&mem),
            vectored,
            log: Rc::clone(&log),
        })
    };
    let dev = Device::from_backends(
        lbio,
        backend(),
        backend(),
        geometry(capacity as u64, 512, max_transfer),
        true,
    )
    .expect("device");
    (dev, log)
}

/// Memory for scattered segments: one 4 KiB-aligned block of a plain allocation.
struct SegMem {
    mem: Vec<u8>,
    at: usize,
}

impl SegMem {
    fn new(bytes: usize) -> SegMem {
        let mut mem = vec![0u8; bytes + 4096];
        let at = (mem.as_mut_ptr() as usize).next_multiple_of(4096) - mem.as_ptr() as usize;
        SegMem { mem, at }
    }
    fn ptr(&mut self, off: usize) -> *mut u8 {
        self.mem[self.at + off..].as_mut_ptr()
    }
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        &self.mem[self.at + off..self.at + off + len]
    }
}

/// Segments of `lens` placed in `mem` with `gap` bytes between them, in order or reversed.
fn layout(mem: &mut SegMem, lens: &[usize], gap: usize, reversed: bool) -> Vec<libc::iovec> {
    let mut offs = Vec::new();
    let mut at = 0;
    for &l in lens {
        offs.push(at);
        at += l + gap;
    }
    if reversed {
        // The memory order no longer follows the device order.
        let total = at;
        offs = lens
            .iter()
            .zip(&offs)
            .map(|(&l, &o)| total - gap - o - l)
            .collect();
    }
    offs.iter()
        .zip(lens)
        .map(|(&o, &l)| libc::iovec {
            iov_base: mem.ptr(o).cast(),
            iov_len: l,
        })
        .collect()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

    /// A scattered request moves exactly its segments' bytes to and from consecutive device
    /// offsets, in pieces no longer than the max transfer, as one request: vectored pieces only
    /// where the backend takes them, and never fewer bytes than asked.
    #[test]
    fn scattered_requests_round_trip_in_pieces_within_the_max_transfer(
        sectors in proptest::collection::vec(1usize..=16, 1..=40),
        max_sectors in 1u32..=64,
        start_sector in 0u64..64,
        gap_sectors in 0usize..=2,
        reversed in proptest::bool::ANY,
        vectored in proptest::bool::ANY,
        background in proptest::bool::ANY,
    ) {
        let engine = engine();
        let lbio = array(&engine, LbioConfig { split_bytes: 4096, ..LbioConfig::default() });
        let capacity = 1 << 20;
        let max = max_sectors * 512;
        let (dev, log) = scatter_device(&lbio, capacity, max, vectored);
        let lens: Vec<usize> = sectors.iter().map(|s| s * 512).collect();
        let total: usize = lens.iter().sum();
        let offset = start_sector * 512;
        let class = if background { Class::Background } else { Class::Critical };

        // Device bytes: a pattern written the ordinary way.
        let buf = patterned(&engine, total, 7);
        dev.write_at_blocking(offset, buf, false).unwrap();
        log.borrow_mut().clear();

        // Scattered read: each segment gets its own part of the pattern.
        let mut mem = SegMem::new(total + lens.len() * 1024 + 4096);
        let segs = layout(&mut mem, &lens, gap_sectors * 512, reversed);
        // SAFETY: `segs` and `mem` outlive the blocking request; nothing else touches them.
        let iov = unsafe {
            RawIov::new(std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap(), segs.len() as u16, None)
        };
        proptest::prop_assert_eq!(iov.bytes(), total as u64);
        let before = lbio.metrics();
        // SAFETY: as above.
        let done = dev.run_blocking(unsafe { Io::readv_raw(offset, iov) }.class(class)).unwrap();
        proptest::prop_assert!(done.is_none());
        let mut expect_at = 0;
        for s in &segs {
            let off = s.iov_base as usize - mem.ptr(0) as usize;
            let got = mem.bytes(off, s.iov_len);
            for (i, &b) in got.iter().enumerate() {
                let want = 7u8.wrapping_add(((expect_at + i) / 512) as u8);
                proptest::prop_assert_eq!(b, want, "segment byte {} of device byte {}", i, expect_at + i);
            }
            expect_at += s.iov_len;
        }
        let pieces = log.borrow().clone();
        let limit = if background { max.min(4096) } else { max };
        let mut next = offset;
        for &(o, l, n) in &pieces {
            proptest::prop_assert_eq!(o, next, "pieces cover the range in order");
            proptest::prop_assert!(l <= limit, "piece of {} over the {}-byte limit", l, limit);
            proptest::prop_assert!(vectored || n == 0);
            proptest::prop_assert!(n != 1, "a one-segment piece goes out as a plain one");
            next += l as u64;
        }
        proptest::prop_assert_eq!(next, offset + total as u64);
        let m = lbio.metrics();
        proptest::prop_assert_eq!(m.requests - before.requests, 1);
        proptest::prop_assert_eq!(
            m.vectored_pieces - before.vectored_pieces,
            pieces.iter().filter(|p| p.2 > 0).count() as u64
        );
        // Segments that fit the limit together are never sent one by one by a vectored backend.
        if vectored && lens.iter().all(|&l| l <= limit as usize) && total <= limit as usize && lens.len() > 1 {
            proptest::prop_assert_eq!(pieces.len(), 1);
        }

        // Scattered write of the same memory to another place, read back contiguous.
        let dest = offset + 512 * 1024;
        log.borrow_mut().clear();
        // SAFETY: as above.
        let iov = unsafe {
            RawIov::new(std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap(), segs.len() as u16, None)
        };
        // SAFETY: as above.
        dev.run_blocking(unsafe { Io::writev_raw(dest, iov) }.class(class)).unwrap();
        let back = dev.read_at_blocking(dest, engine.try_alloc(total).unwrap()).unwrap();
        proptest::prop_assert!(is_patterned(&back, 7));
    }
}

#[test]
fn scattered_reads_into_registered_frames_are_one_command_on_a_file() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("readv", 1 << 20);
    let open = |max: Option<u32>| {
        Device::open(
            &lbio,
            file.path(),
            DeviceConfig {
                write: true,
                route: RouteChoice::Ring,
                max_transfer_bytes: max,
                ..DeviceConfig::default()
            },
        )
        .unwrap()
    };
    let dev = open(None);
    let fixed = engine.supports_vectored_fixed();
    assert_eq!(dev.critical_route().0.vectored, fixed);
    let buf = patterned(&engine, 128 * KIB, 3);
    dev.write_at_blocking(0, buf, false).unwrap();

    let region = std::sync::Arc::new(aios_core::SharedRegion::map(256 * KIB, false).unwrap());
    let index = engine.register_region(&region).unwrap();
    // 32 frames, every other 4 KiB of the region, in reverse: frame k holds device page k.
    let segs: Vec<libc::iovec> = (0..32)
        .map(|k| libc::iovec {
            // SAFETY: inside the 256 KiB region.
            iov_base: unsafe { region.as_ptr().add((62 - 2 * k) * 4 * KIB) }.cast(),
            iov_len: 4 * KIB,
        })
        .collect();
    let check = |what: &str| {
        for (k, s) in segs.iter().enumerate() {
            // SAFETY: the read completed; nothing else uses the region.
            let got = unsafe { std::slice::from_raw_parts(s.iov_base.cast::<u8>(), 4 * KIB) };
            let want: Vec<u8> = (0..4 * KIB)
                .map(|i| 3u8.wrapping_add(((k * 4 * KIB + i) / 512) as u8))
                .collect();
            assert!(got == &want[..], "{what}: frame {k} holds the wrong bytes");
        }
    };
    for (label, idx, max, pieces) in [
        ("registered", Some(index), None, 1u64),
        ("unregistered", None, None, 1),
        (
            "registered, 16 KiB max transfer",
            Some(index),
            Some(16 * KIB as u32),
            8,
        ),
    ] {
        let d = if max.is_some() { open(max) } else { open(None) };
        // SAFETY: the region outlives the blocking read.
        unsafe { std::ptr::write_bytes(region.as_ptr(), 0, 256 * KIB) };
        let before = lbio.metrics();
        // SAFETY: `segs` and the region outlive the blocking read; nothing else touches them.
        let iov = unsafe {
            RawIov::new(
                std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap(),
                32,
                idx,
            )
        };
        // SAFETY: as above.
        d.run_blocking(unsafe { Io::readv_raw(0, iov) }).unwrap();
        check(label);
        let m = lbio.metrics();
        let (p, v) = (
            m.pieces - before.pieces,
            m.vectored_pieces - before.vectored_pieces,
        );
        if fixed {
            assert_eq!((p, v), (pieces, pieces), "{label}");
        } else {
            assert_eq!(
                (p, v),
                (32, 0),
                "{label}: one piece per segment without READV_FIXED"
            );
        }
    }

    // And back: a scattered FUA write from the frames lands in device order.
    // SAFETY: as above.
    let iov = unsafe {
        RawIov::new(
            std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap(),
            32,
            Some(index),
        )
    };
    // SAFETY: as above.
    dev.run_blocking(unsafe { Io::writev_raw(256 * KIB as u64, iov) }.fua(true))
        .unwrap();
    let back = dev
        .read_at_blocking(256 * KIB as u64, engine.try_alloc(128 * KIB).unwrap())
        .unwrap();
    assert!(is_patterned(&back, 3));
}

#[test]
fn scattered_requests_are_validated_segment_by_segment() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let (dev, log) = scatter_device(&lbio, 64 * KIB, 64 * KIB as u32, true);
    let mut mem = SegMem::new(16 * KIB);
    let seg = |mem: &mut SegMem, off: usize, len: usize| libc::iovec {
        iov_base: mem.ptr(off).cast(),
        iov_len: len,
    };
    let cases = [
        (vec![], 0u64, "empty"),
        (
            vec![seg(&mut mem, 0, 4096), seg(&mut mem, 4096, 100)],
            0,
            "segment length",
        ),
        (
            vec![seg(&mut mem, 0, 4096), seg(&mut mem, 4097, 512)],
            0,
            "segment address",
        ),
        (
            vec![seg(&mut mem, 0, 4096), seg(&mut mem, 4096, 0)],
            0,
            "segment length",
        ),
        (vec![seg(&mut mem, 0, 4096)], 62 * KIB as u64, "past end"),
        (vec![seg(&mut mem, 0, 4096)], 100, "offset"),
    ];
    for (segs, offset, what) in cases {
        let ptr = if segs.is_empty() {
            std::ptr::NonNull::dangling()
        } else {
            std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap()
        };
        // SAFETY: refused before it reaches the device.
        let iov = unsafe { RawIov::new(ptr, segs.len() as u16, None) };
        // SAFETY: as above.
        let e = dev
            .run_blocking(unsafe { Io::readv_raw(offset, iov) })
            .unwrap_err();
        let ok = match what {
            "empty" => matches!(e, LbioError::Empty(Op::Read)),
            "past end" => matches!(e, LbioError::PastEnd { .. }),
            w => matches!(e, LbioError::Unaligned { what, .. } if what.starts_with(w)),
        };
        assert!(ok, "{what}: got {e}");
    }
    assert!(
        log.borrow().is_empty(),
        "nothing refused reached the device"
    );
    assert_eq!(lbio.free_slots(), lbio.config().slots);
}

#[test]
fn scattered_requests_on_the_sync_route_use_preadv_and_pwritev() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("preadv", 1 << 20);
    let dev = Device::open(
        &lbio,
        file.path(),
        DeviceConfig {
            write: true,
            route: RouteChoice::Sync,
            ..DeviceConfig::default()
        },
    )
    .unwrap();
    assert!(dev.critical_route().0.vectored);
    let mut mem = SegMem::new(64 * KIB);
    let lens = [4 * KIB, 8 * KIB, 4 * KIB, 12 * KIB];
    let segs = layout(&mut mem, &lens, 4 * KIB, true);
    for (k, s) in segs.iter().enumerate() {
        // SAFETY: each segment lies in `mem`, which nothing else uses.
        unsafe { std::ptr::write_bytes(s.iov_base.cast::<u8>(), 0x40 + k as u8, s.iov_len) };
    }
    let ptr = std::ptr::NonNull::new(segs.as_ptr().cast_mut()).unwrap();
    let before = lbio.metrics();
    // SAFETY: `segs` and `mem` outlive the blocking requests; nothing else touches them.
    let iov = unsafe { RawIov::new(ptr, 4, None) };
    // SAFETY: as above.
    dev.run_blocking(unsafe { Io::writev_raw(8 * KIB as u64, iov) }.fua(true))
        .unwrap();
    let back = dev
        .read_at_blocking(8 * KIB as u64, engine.try_alloc(28 * KIB).unwrap())
        .unwrap();
    let mut at = 0;
    for (k, &l) in lens.iter().enumerate() {
        assert!(
            back[at..at + l].iter().all(|&b| b == 0x40 + k as u8),
            "segment {k}"
        );
        at += l;
    }
    for s in &segs {
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(s.iov_base.cast::<u8>(), 0, s.iov_len) };
    }
    // SAFETY: as above.
    dev.run_blocking(unsafe { Io::readv_raw(8 * KIB as u64, RawIov::new(ptr, 4, None)) })
        .unwrap();
    for (k, s) in segs.iter().enumerate() {
        // SAFETY: the read completed.
        let got = unsafe { std::slice::from_raw_parts(s.iov_base.cast::<u8>(), s.iov_len) };
        assert!(
            got.iter().all(|&b| b == 0x40 + k as u8),
            "segment {k} read back"
        );
    }
    let m = lbio.metrics();
    assert_eq!(
        m.vectored_pieces - before.vectored_pieces,
        2,
        "one preadv, one pwritev"
    );
}

/// A critical request of 65,536 pieces (a 512-byte max transfer, 32 MiB) on an asynchronous
/// backend finishes only when every piece has: its count of pieces in flight was 16 bits and
/// wrapped to 0, so the request finished (and freed its slot and buffer) while the pieces
/// were still queued (found by a review, 2026-11-27).
#[test]
fn a_request_of_65536_pieces_finishes_after_all_of_them() {
    let bytes: u64 = 32 << 20;
    // Declared first: dropped last, after the engine has drained.
    let region = aios_core::SharedRegion::map(bytes as usize, false).unwrap();
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let mut cfg = SimConfig::new(bytes, 1);
    cfg.max_transfer_bytes = 512;
    let disk = SimDisk::new(cfg).unwrap();
    let dev = disk.open(&lbio).unwrap();
    let base = std::ptr::NonNull::new(region.as_ptr()).unwrap();
    // SAFETY: the region outlives the request (waited for below); unregistered memory.
    let raw = unsafe { RawBuf::new(base, bytes as u32, None) };
    // SAFETY: as above.
    let tag = dev
        .submit(unsafe { Io::read_raw(0, raw) })
        .map_err(|e| e.0)
        .unwrap();
    assert_eq!(
        lbio.done_len(),
        0,
        "request {tag:?} finished while its 65,536 pieces are queued"
    );
    lbio.wait_done(1).unwrap();
    let c = lbio.take_done().unwrap();
    assert_eq!(c.tag, tag);
    c.result.unwrap();
}

/// A device dropped with a background request still waiting for a token, whose piece then
/// fails at once (a SimDisk after a power cut refuses new pieces at start): both requests fail
/// and the device closes. The device used to go away inside the token pump, which then
/// panicked looking for it ("device is open").
#[test]
fn a_closing_device_whose_queued_background_request_fails_at_once_closes() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_inflight_background: 1,
            ..LbioConfig::default()
        },
    );
    let disk = SimDisk::new(SimConfig::new(1 << 20, 3)).unwrap();
    let dev = disk.open(&lbio).unwrap();
    for i in 0..2u64 {
        let mut b = engine.try_alloc(4096).unwrap();
        b.fill(1);
        dev.submit(Io::write(i * 4096, b).class(Class::Background))
            .map_err(|e| e.0)
            .unwrap();
    }
    drop(dev);
    disk.cut_power();
    let mut failed = 0;
    while failed < 2 {
        lbio.wait_done(1).unwrap();
        while let Some(c) = lbio.take_done() {
            assert!(c.result.is_err());
            failed += 1;
        }
    }
}

/// A geometry with a max transfer of 0 is refused (requests would split into endless
/// zero-length pieces).
#[test]
fn a_zero_max_transfer_is_refused() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let mut cfg = SimConfig::new(1 << 20, 1);
    cfg.max_transfer_bytes = 0;
    let disk = SimDisk::new(cfg).unwrap();
    let e = disk.open(&lbio).unwrap_err().to_string();
    assert!(e.contains("max transfer a non-zero multiple"), "{e}");
}

/// A soft device that fails the engine's next wait (its `advance` errs once).
struct FailingWait(Cell<bool>);

impl aios_core::SoftDevice for FailingWait {
    fn pending(&self) -> u32 {
        u32::from(self.0.get())
    }
    fn advance(&self, _engine: &Engine) -> Result<(), CoreError> {
        self.0.set(false);
        Err(CoreError::Sys {
            op: "io_uring_enter",
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        })
    }
}

/// A blocking request whose wait fails gives its slot back once the I/O ends: nobody is left
/// to take its completion. (It stayed taken for good: a review found it by reading.)
#[test]
fn a_blocking_request_whose_wait_fails_frees_its_slot_when_it_ends() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("waitfail", 1 << 20);
    let dev = ring_device(&lbio, &file);
    let slots = lbio.free_slots();
    let soft: Rc<dyn aios_core::SoftDevice> = Rc::new(FailingWait(Cell::new(true)));
    engine.attach_soft_device(Rc::downgrade(&soft));
    let buf = engine.try_alloc(4096).unwrap();
    let e = dev.run_blocking(Io::read(0, buf));
    assert!(e.is_err(), "the wait failed: {e:?}");
    drain(&engine);
    assert_eq!(lbio.free_slots(), slots, "the slot came back");
    // And the device goes on working.
    let buf = engine.try_alloc(4096).unwrap();
    assert!(dev.run_blocking(Io::read(0, buf)).is_ok());
}

/// A device on NOP completions (result 0 is the whole piece) whose push can make the engine
/// reap at once, as a push that finds the submission queue full does (`io_uring_enter` answers
/// EBUSY and the engine dispatches what has completed to make room).
struct ReapingNop {
    reap_in_push: Rc<Cell<bool>>,
}

impl Backend for ReapingNop {
    fn caps(&self) -> Caps {
        Caps {
            name: "reaping-nop",
            asynchronous: true,
            fua: true,
            flush: true,
            iopoll: false,
            power_loss_protected: false,
            vectored: false,
        }
    }
    fn outcome(&self, res: i32, len: u32) -> Outcome {
        if res < 0 {
            Outcome::Failed(PieceError::Errno(-res))
        } else {
            Outcome::Bytes(len)
        }
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        _piece: &Piece,
    ) -> Result<Started, CoreError> {
        engine.push_nop(sink, tag)?;
        if self.reap_in_push.get() {
            // Its own completion (posted when the NOP was submitted) is dispatched now, inside
            // the push.
            engine.poll_completions()?;
        }
        Ok(Started::Queued)
    }
}

/// A waker that counts its wakes.
struct CountingWaker(AtomicU32);

impl std::task::Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// A future's request whose last piece completes inside a push the token pump makes while it
/// handles an earlier piece's completion is woken: that completion was deferred (the array was
/// busy) and nobody applied it, so the future was never woken and `block_on` parked for good
/// with nothing in flight (found by a review).
#[test]
fn a_completion_deferred_inside_the_token_pump_wakes_its_future() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_inflight_background: 1,
            split_bytes: 512,
            ..LbioConfig::default()
        },
    );
    let reap_in_push = Rc::new(Cell::new(false));
    let backend = || {
        Box::new(ReapingNop {
            reap_in_push: Rc::clone(&reap_in_push),
        })
    };
    let dev = Device::from_backends(
        &lbio,
        backend(),
        backend(),
        geometry(1 << 20, 512, 4096),
        true,
    )
    .unwrap();
    let wakes = std::sync::Arc::new(CountingWaker(AtomicU32::new(0)));
    let waker = Waker::from(std::sync::Arc::clone(&wakes));
    let mut cx = Context::from_waker(&waker);
    // Two 512-byte background pieces, one token: the second goes out from the first's
    // completion.
    let fut = dev.future(Io::read(0, engine.try_alloc(1024).unwrap()).class(Class::Background));
    let mut fut = pin!(fut);
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    reap_in_push.set(true);
    drain(&engine);
    assert!(!engine.has_work(), "nothing left in flight");
    assert!(
        wakes.0.load(Ordering::Relaxed) > 0,
        "the future was woken when its request finished"
    );
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(r) => assert_eq!(r.unwrap().map(|b| b.len()), Some(1024)),
        Poll::Pending => panic!("the request finished"),
    }
    assert_eq!(lbio.free_slots(), lbio.config().slots);
}

/// RAM that refuses a piece whose memory is not aligned to `mem_align`, as direct I/O does.
struct DmaAligned {
    mem: Rc<MemBackend>,
    mem_align: usize,
    log: Rc<RefCell<Vec<(usize, u32)>>>,
}

impl Backend for DmaAligned {
    fn caps(&self) -> Caps {
        self.mem.caps()
    }
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        self.log.borrow_mut().push((piece.ptr as usize, piece.len));
        if piece.op != Op::Flush && (piece.ptr as usize) % self.mem_align != 0 {
            return Ok(Started::Done(-libc::EINVAL));
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

/// A device whose memory alignment (4 KiB) is coarser than its offset alignment (512 bytes):
/// every piece of a split request starts at an address the device takes. Background requests
/// were cut at `split_bytes` or the offset alignment, whichever was larger, so 512-byte
/// `split_bytes` gave pieces at buffer + 512, which the device refused (found by a review).
#[test]
fn split_pieces_keep_the_memory_alignment() {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            split_bytes: 512,
            ..LbioConfig::default()
        },
    );
    let mem = Rc::new(MemBackend::new(1 << 20));
    let log = Rc::new(RefCell::new(Vec::new()));
    let backend = || {
        Box::new(DmaAligned {
            mem: Rc::clone(&mem),
            mem_align: 4096,
            log: Rc::clone(&log),
        })
    };
    let g = Geometry {
        mem_align: 4096,
        ..geometry(1 << 20, 512, 1 << 20)
    };
    let dev = Device::from_backends(&lbio, backend(), backend(), g, true).unwrap();
    let buf = patterned(&engine, 16 * KIB, 3);
    assert!(
        buf.as_ptr().addr() % 4096 == 0,
        "the arena's frames are 4 KiB"
    );
    let io = Io::write(0, buf).class(Class::Background);
    let buf = dev
        .run_blocking(io)
        .expect("the split write goes through")
        .unwrap();
    assert!(log.borrow().len() > 1, "the request was split");
    assert!(
        log.borrow().iter().all(|(p, _)| p % 4096 == 0),
        "{:?}",
        log.borrow()
    );
    let back = dev.read_at_blocking(0, buf).unwrap();
    assert!(is_patterned(&back, 3));

    // A max transfer that would cut a critical request off the memory alignment is refused.
    let g = Geometry {
        mem_align: 4096,
        ..geometry(1 << 20, 512, 6144)
    };
    let e = Device::from_backends(&lbio, backend(), backend(), g, true).unwrap_err();
    assert!(matches!(e, LbioError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("6144"), "{e}");
}

/// Records the completions it is handed.
struct CountingSink(Cell<u32>);

impl CompletionSink for CountingSink {
    fn complete(&self, _payload: u64, _result: i32, _flags: u32) {
        self.0.set(self.0.get() + 1);
    }
}

/// `wait_done` asked for more detached requests than are in flight returns once those are
/// done: it kept waiting while the engine had any work at all, so another user's operation
/// that takes long (a network receive) held it up, for good if it never completes (found by a
/// review). A NOP of another sink stands in for that operation: it must still be undispatched.
#[test]
fn wait_done_does_not_wait_for_other_work_on_the_engine() {
    let engine = engine();
    let lbio = array(&engine, LbioConfig::default());
    let dev = Device::memory(&lbio, 1 << 20).unwrap();
    let other = Rc::new(CountingSink(Cell::new(0)));
    let sink = engine
        .register_sink(Rc::downgrade(&other) as Weak<dyn CompletionSink>)
        .unwrap();
    // One detached write, done at once (the memory device completes inline).
    dev.submit(Io::write(0, patterned(&engine, 4096, 1)))
        .map_err(|e| e.0)
        .unwrap();
    engine.push_nop(sink, 7).unwrap();
    assert!(engine.has_work());
    lbio.wait_done(2).unwrap();
    assert_eq!(lbio.done_len(), 1);
    assert_eq!(
        other.0.get(),
        0,
        "wait_done waited for an operation that is not one of its requests"
    );
    lbio.take_done().unwrap().result.unwrap();
    drain(&engine);
    assert_eq!(other.0.get(), 1);
}

/// An array dropped with a request in flight whose first wait fails once (an `io_uring_enter`
/// refused for want of memory) still gives the request's buffer back once the kernel is done
/// with it: it took one failed wait for an unusable ring and leaked every slot's buffer for
/// the engine's lifetime (found by a review).
#[test]
fn an_array_dropped_while_a_wait_fails_once_gives_its_buffers_back() {
    let engine = engine();
    let frames = engine.arena().free_frames();
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("dropfail", 1 << 20);
    let dev = ring_device(&lbio, &file);
    // Held: the read's SQE is queued, not yet handed to the kernel.
    engine
        .hold_submissions(|| dev.submit(Io::read(0, engine.try_alloc(64 * KIB).unwrap())))
        .map_err(|e| e.0)
        .unwrap();
    assert!(engine.arena().free_frames() < frames);
    engine.fail_next_enters(1);
    drop(dev);
    drop(lbio);
    engine.fail_next_enters(0);
    drain(&engine);
    assert_eq!(
        engine.arena().free_frames(),
        frames,
        "the read's buffer went back to the arena"
    );
}

/// An array's fate ([`LbioArray::fate`]) is `Open` while it lives, and after its drop says
/// whether the drop drained the engine (`Drained`: here a read in flight, the ring working)
/// or gave up on a ring that kept failing (`Abandoned`: the read may still land). It names
/// its array: handles of one array are the same, another array's are not.
#[test]
fn an_arrays_fate_says_whether_its_drop_drained_the_engine() {
    let engine = engine();
    let file = TempFile::new("fate", 1 << 20);
    let dropped_with_a_read_in_flight = |fail: bool| {
        let lbio = array(&engine, LbioConfig::default());
        let dev = ring_device(&lbio, &file);
        let fate = lbio.fate();
        assert_eq!(fate.get(), Fate::Open);
        assert!(fate.same_array(&lbio.fate()));
        // Held: the read's SQE is queued, not yet handed to the kernel.
        engine
            .hold_submissions(|| dev.submit(Io::read(0, engine.try_alloc(64 * KIB).unwrap())))
            .map_err(|e| e.0)
            .unwrap();
        if fail {
            engine.fail_next_enters(u32::MAX);
        }
        drop(dev);
        drop(lbio);
        engine.fail_next_enters(0);
        fate
    };
    let drained = dropped_with_a_read_in_flight(false);
    assert_eq!(drained.get(), Fate::Drained);
    let abandoned = dropped_with_a_read_in_flight(true);
    assert_eq!(abandoned.get(), Fate::Abandoned);
    assert!(!drained.same_array(&abandoned));
    drain(&engine);
}

// ---------------------------------------------------------------------------------------------
// From a review on 2026-11-28: `wait_done` and waits that fail after dispatching completions.

/// `wait_done` says it submits what is queued; when enough detached requests are already done
/// it returned at once, leaving requests submitted under `hold_submissions` in the submission
/// queue: the kernel never saw them, so an event loop waiting on the engine's eventfd for
/// their completion waits for ever.
#[test]
fn wait_done_submits_held_requests_even_when_enough_are_done() {
    let engine = Engine::new(EngineConfig {
        ring_entries: 256,
        arena_bytes: 8 << 20,
        huge_pages: false,
        eventfd: true,
        ..EngineConfig::default()
    })
    .expect("engine");
    let lbio = array(&engine, LbioConfig::default());
    let file = TempFile::new("waitdone-submit", 1 << 20);
    let dev = ring_device(&lbio, &file);
    // One detached read, done and not yet taken.
    dev.submit(Io::read(0, engine.try_alloc(4096).unwrap()))
        .map_err(|e| e.0)
        .unwrap();
    lbio.wait_done(1).unwrap();
    assert_eq!(lbio.done_len(), 1);
    engine.drain_eventfd();
    // A second one, held (plugged) for the next wait.
    engine
        .hold_submissions(|| dev.submit(Io::read(4096, engine.try_alloc(4096).unwrap())))
        .map_err(|e| e.0)
        .unwrap();
    let enters = engine.metrics().enters;
    lbio.wait_done(1).unwrap();
    // The second read must now be with the kernel: its completion signals the eventfd.
    let mut pfd = libc::pollfd {
        fd: engine.eventfd().unwrap(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ready = unsafe { libc::poll(&mut pfd, 1, 2000) };
    assert!(
        ready == 1,
        "the held read never reached the kernel (enters before/after wait_done: {enters}/{})",
        engine.metrics().enters
    );
    drain(&engine);
    while let Some(c) = lbio.take_done() {
        c.result.unwrap();
    }
}

/// Another user of the engine whose completion handler queues a follow-up NOP under
/// `hold_submissions` (as the page cache queues its next read); at its second completion the
/// kernel refuses the next `io_uring_enter` (ENOMEM, through the fault-injection hook).
struct FollowUp {
    engine: Rc<Engine>,
    sink: Cell<Option<SinkId>>,
    seen: Cell<u32>,
}

impl CompletionSink for FollowUp {
    fn complete(&self, _payload: u64, _result: i32, _flags: u32) {
        let n = self.seen.get() + 1;
        self.seen.set(n);
        if n <= 2 {
            let sink = self.sink.get().unwrap();
            self.engine
                .hold_submissions(|| self.engine.push_nop(sink, n as u64))
                .unwrap();
        }
        if n == 2 {
            self.engine.fail_next_enters(1);
        }
    }
}

/// The rig of the two tests below: one background token; a detached background read holds it,
/// so the request under test waits behind it and goes out from that read's completion (its
/// completion then sits in the CQ for the next wait), and `FollowUp`'s first NOP is queued.
fn failing_wait_rig() -> (Rc<Engine>, Rc<LbioArray>, Device, Rc<FollowUp>) {
    let engine = engine();
    let lbio = array(
        &engine,
        LbioConfig {
            max_inflight_background: 1,
            ..LbioConfig::default()
        },
    );
    let backend = || {
        Box::new(ReapingNop {
            reap_in_push: Rc::new(Cell::new(false)),
        })
    };
    let dev = Device::from_backends(
        &lbio,
        backend(),
        backend(),
        geometry(1 << 20, 512, 4096),
        true,
    )
    .unwrap();
    let other = Rc::new(FollowUp {
        engine: Rc::clone(&engine),
        sink: Cell::new(None),
        seen: Cell::new(0),
    });
    let sink = engine
        .register_sink(Rc::downgrade(&other) as Weak<dyn CompletionSink>)
        .unwrap();
    other.sink.set(Some(sink));
    dev.submit(Io::read(0, engine.try_alloc(4096).unwrap()).class(Class::Background))
        .map_err(|e| e.0)
        .unwrap();
    engine.push_nop(sink, 0).unwrap();
    (engine, lbio, dev, other)
}

/// A blocking request that completed (successfully) inside a wait which then failed to submit
/// other queued work is returned, not thrown away: `Engine::wait` dispatched its completion,
/// then returned the error of the `io_uring_enter` that followed, and `run_blocking` orphaned
/// the finished request, dropping its buffer and reporting a failure for a read that worked.
#[test]
fn a_blocking_request_completed_by_a_wait_that_then_fails_is_not_lost() {
    let (engine, lbio, dev, _other) = failing_wait_rig();
    let frames = engine.arena().free_frames();
    let r =
        dev.run_blocking(Io::read(4096, engine.try_alloc(4096).unwrap()).class(Class::Background));
    let m = lbio.metrics();
    drain(&engine);
    assert!(
        r.is_ok(),
        "the read completed without error (requests {}, errors {}), yet run_blocking said {r:?}",
        m.requests,
        m.errors
    );
    drop(r);
    assert_eq!(engine.arena().free_frames(), frames);
}

/// The same through `block_on`: the future's request completes inside a wait that then fails
/// to submit other queued work; `block_on` returned the error and dropped the finished future,
/// whose read had worked.
#[test]
fn a_future_completed_by_a_wait_that_then_fails_is_not_lost() {
    let (engine, lbio, dev, _other) = failing_wait_rig();
    let r = engine.block_on(
        dev.future(Io::read(4096, engine.try_alloc(4096).unwrap()).class(Class::Background)),
    );
    let m = lbio.metrics();
    drain(&engine);
    assert!(
        matches!(r, Ok(Ok(Some(_)))),
        "the read completed without error (requests {}, errors {}), yet block_on said {r:?}",
        m.requests,
        m.errors
    );
}
