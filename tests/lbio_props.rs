//! Property test: random reads, writes and flushes through lbio on a real O_DIRECT file agree
//! with an in-memory model of the file, on the io_uring route and on the sync route.
//!
//! Requests are split at a small max transfer, mixed between the critical and background classes,
//! some writes are FUA, and all three interfaces are used: blocking, async (`block_on`, one future
//! or several polled together) and detached (`submit` + `wait_done` + `take_done`, several in
//! flight at once). Requests that are in flight together never overlap a write, since their order
//! is not defined.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::Poll;

use aios_core::{Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{Class, Device, DeviceConfig, Io, LbioArray, LbioConfig, LbioError, RouteChoice};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Bytes of the test file.
const DEVICE_BYTES: u64 = 1 << 20;
/// Largest request.
const MAX_IO_BYTES: u64 = 256 << 10;
/// Cases per route; each opens a fresh file and engine.
const CASES: u32 = 64;

/// A file under /var/tmp (ext4 with O_DIRECT), removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(tag: &str) -> TempFile {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = PathBuf::from(format!(
            "/var/tmp/aios-lbio-props-{}-{tag}-{n}.img",
            std::process::id()
        ));
        let f = std::fs::File::create(&path).expect("create the test file");
        f.set_len(DEVICE_BYTES).expect("size the test file");
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

fn open(lbio: &Rc<LbioArray>, path: &Path, route: RouteChoice, max_transfer: u32) -> Device {
    let cfg = DeviceConfig {
        write: true,
        route,
        max_transfer_bytes: Some(max_transfer),
        probe: ProbeOptions {
            latency_samples: 0,
            try_iopoll: false,
        },
        ..DeviceConfig::default()
    };
    Device::open(lbio, path, cfg).expect("open the test file")
}

fn engine() -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 8 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// The file system's direct-I/O alignment: requests are generated in multiples of it.
fn device_alignment() -> u64 {
    let file = TempFile::new("align");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open(&lbio, file.path(), RouteChoice::Ring, 1 << 20);
    let g = *dev.geometry();
    assert_eq!(g.capacity_bytes, DEVICE_BYTES);
    assert!(g.mem_align <= 4096, "arena frames are 4 KiB aligned: {g:?}");
    println!("device geometry: {g:?}");
    g.offset_align as u64
}

#[derive(Clone, Copy, Debug)]
enum Api {
    Blocking,
    Async,
    Detached,
}

/// One request: offsets and lengths in bytes, already aligned and inside the device.
#[derive(Clone, Copy, Debug)]
struct Req {
    write: bool,
    offset: u64,
    len: u64,
    seed: u8,
    fua: bool,
    background: bool,
}

impl Req {
    fn overlaps(&self, o: &Req) -> bool {
        self.offset < o.offset + o.len && o.offset < self.offset + self.len
    }
    fn class(&self) -> Class {
        if self.background {
            Class::Background
        } else {
            Class::Critical
        }
    }
    fn io(&self, buf: FixedBuf) -> Io {
        let io = if self.write {
            Io::write(self.offset, buf).fua(self.fua)
        } else {
            Io::read(self.offset, buf)
        };
        io.class(self.class())
    }
}

#[derive(Clone, Debug)]
enum Step {
    One(Req, Api),
    Flush(Api, bool),
    /// Several detached requests in flight at once.
    Detached(Vec<Req>),
    /// Several futures polled together.
    Futures(Vec<Req>),
}

fn req(unit: u64) -> impl Strategy<Value = Req> {
    let units = DEVICE_BYTES / unit;
    let max_len = MAX_IO_BYTES / unit;
    (
        any::<bool>(),
        1..=max_len,
        any::<u64>(),
        any::<u8>(),
        prop::bool::weighted(0.2),
        prop::bool::weighted(0.3),
    )
        .prop_map(move |(write, len, at, seed, fua, background)| Req {
            write,
            offset: (at % (units - len + 1)) * unit,
            len: len * unit,
            seed,
            fua: write && fua,
            background,
        })
}

fn api() -> impl Strategy<Value = Api> {
    prop_oneof![Just(Api::Blocking), Just(Api::Async), Just(Api::Detached)]
}

fn step(unit: u64) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (req(unit), api()).prop_map(|(r, a)| Step::One(r, a)),
        1 => (api(), any::<bool>()).prop_map(|(a, bg)| Step::Flush(a, bg)),
        2 => prop::collection::vec(req(unit), 2..8).prop_map(Step::Detached),
        2 => prop::collection::vec(req(unit), 2..8).prop_map(Step::Futures),
    ]
}

fn case(unit: u64) -> impl Strategy<Value = (u32, Vec<Step>)> {
    // Max transfer: smaller than, equal to and larger than the 32 KiB background split.
    let max_transfer = prop_oneof![Just(8192u32), Just(32768), Just(65536)];
    (max_transfer, prop::collection::vec(step(unit), 1..32))
}

/// Requests in flight together must not overlap a write: drop those that would.
fn independent(reqs: &[Req]) -> Vec<Req> {
    let mut kept: Vec<Req> = Vec::new();
    for r in reqs {
        if kept
            .iter()
            .all(|k| !(k.overlaps(r) && (k.write || r.write)))
        {
            kept.push(*r);
        }
    }
    kept
}

fn byte(seed: u8, i: u64) -> u8 {
    ((i.wrapping_mul(0x9e37_79b1) >> 13) as u8) ^ seed
}

struct Run<'a> {
    engine: &'a Rc<Engine>,
    lbio: &'a Rc<LbioArray>,
    dev: &'a Device,
    model: Vec<u8>,
}

impl Run<'_> {
    /// A buffer for `r`: the write's bytes, or a fill the read must overwrite.
    fn buffer(&self, r: &Req) -> FixedBuf {
        let mut b = self
            .engine
            .try_alloc(r.len as usize)
            .expect("the arena holds every buffer of a step");
        if r.write {
            for (i, x) in b.iter_mut().enumerate() {
                *x = byte(r.seed, r.offset + i as u64);
            }
        } else {
            b.fill(0xee);
        }
        b
    }

    /// Check a finished request against the model (reads) or apply it to the model (writes).
    fn finish(
        &mut self,
        r: &Req,
        result: Result<Option<FixedBuf>, LbioError>,
    ) -> Result<(), TestCaseError> {
        let buf = match result {
            Ok(b) => b.expect("reads and writes carry their buffer back"),
            Err(e) => return Err(TestCaseError::fail(format!("{r:?} failed: {e}"))),
        };
        prop_assert_eq!(buf.len() as u64, r.len);
        let range = r.offset as usize..(r.offset + r.len) as usize;
        if r.write {
            self.model[range].copy_from_slice(&buf);
        } else if buf[..] != self.model[range.clone()] {
            let first = (0..buf.len())
                .find(|&i| buf[i] != self.model[range.start + i])
                .unwrap_or(0);
            return Err(TestCaseError::fail(format!(
                "{r:?}: byte {} of the device reads {:#x}, the model has {:#x}",
                range.start + first,
                buf[first],
                self.model[range.start + first]
            )));
        }
        Ok(())
    }

    fn one(&mut self, r: &Req, api: Api) -> Result<(), TestCaseError> {
        let buf = self.buffer(r);
        let result = match api {
            Api::Blocking => self.dev.run_blocking(r.io(buf)),
            Api::Async => self
                .engine
                .block_on(self.dev.future(r.io(buf)))
                .map_err(|e| TestCaseError::fail(e.to_string()))?,
            Api::Detached => {
                let tag = self
                    .engine
                    .hold_submissions(|| self.dev.submit(r.io(buf)))
                    .map_err(|(e, _)| TestCaseError::fail(e.to_string()))?;
                self.lbio
                    .wait_done(1)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let c = self.lbio.take_done().expect("the request is done");
                prop_assert_eq!(c.tag, tag);
                prop_assert!(self.lbio.take_done().is_none());
                c.result.map(|n| {
                    assert_eq!(n as u64, r.len);
                    c.buf
                })
            }
        };
        self.finish(r, result)
    }

    fn flush(&mut self, api: Api, background: bool) -> Result<(), TestCaseError> {
        let class = if background {
            Class::Background
        } else {
            Class::Critical
        };
        let io = || Io::flush().class(class);
        let result = match api {
            Api::Blocking => self.dev.run_blocking(io()),
            Api::Async => self
                .engine
                .block_on(self.dev.future(io()))
                .map_err(|e| TestCaseError::fail(e.to_string()))?,
            Api::Detached => {
                self.dev
                    .submit(io())
                    .map_err(|(e, _)| TestCaseError::fail(e.to_string()))?;
                self.lbio
                    .wait_done(1)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                let c = self.lbio.take_done().expect("the flush is done");
                c.result.map(|_| c.buf)
            }
        };
        match result {
            Ok(None) => Ok(()),
            Ok(Some(_)) => Err(TestCaseError::fail("a flush came back with a buffer")),
            Err(e) => Err(TestCaseError::fail(format!("flush failed: {e}"))),
        }
    }

    fn detached(&mut self, reqs: &[Req]) -> Result<(), TestCaseError> {
        let reqs = independent(reqs);
        let mut tags = Vec::with_capacity(reqs.len());
        // Held: the whole batch reaches the kernel in one io_uring_enter.
        self.engine.hold_submissions(|| {
            for r in &reqs {
                match self.dev.submit(r.io(self.buffer(r))) {
                    Ok(tag) => tags.push(tag),
                    Err((e, _)) => return Err(TestCaseError::fail(format!("{r:?}: {e}"))),
                }
            }
            Ok(())
        })?;
        self.lbio
            .wait_done(reqs.len())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(self.lbio.done_len(), reqs.len());
        let mut seen = vec![false; reqs.len()];
        while let Some(c) = self.lbio.take_done() {
            let i = tags
                .iter()
                .position(|t| *t == c.tag)
                .expect("a tag we submitted");
            prop_assert!(!seen[i], "request {} completed twice", i);
            seen[i] = true;
            let len = reqs[i].len;
            let result = c.result.map(|n| {
                assert_eq!(n as u64, len);
                c.buf
            });
            self.finish(&reqs[i], result)?;
        }
        prop_assert!(seen.iter().all(|s| *s), "every request completed once");
        Ok(())
    }

    fn futures(&mut self, reqs: &[Req]) -> Result<(), TestCaseError> {
        let reqs = independent(reqs);
        let dev = self.dev;
        let mut futs: Vec<Pin<Box<lbio::IoFuture<'_>>>> = reqs
            .iter()
            .map(|r| Box::pin(dev.future(r.io(self.buffer(r)))))
            .collect();
        let mut results: Vec<Option<Result<Option<FixedBuf>, LbioError>>> =
            reqs.iter().map(|_| None).collect();
        self.engine
            .block_on(std::future::poll_fn(|cx| {
                for (f, out) in futs.iter_mut().zip(results.iter_mut()) {
                    if out.is_none() {
                        if let Poll::Ready(r) = f.as_mut().poll(cx) {
                            *out = Some(r);
                        }
                    }
                }
                if results.iter().all(Option::is_some) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            }))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        drop(futs);
        for (r, result) in reqs.iter().zip(results) {
            self.finish(r, result.expect("every future finished"))?;
        }
        Ok(())
    }
}

fn run_case(route: RouteChoice, max_transfer: u32, steps: &[Step]) -> Result<(), TestCaseError> {
    let file = TempFile::new(match route {
        RouteChoice::Sync => "sync",
        _ => "ring",
    });
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open(&lbio, file.path(), route, max_transfer);
    let expect_name = match route {
        RouteChoice::Sync => "sync",
        _ => "io_uring",
    };
    prop_assert_eq!(dev.critical_route().0.name, expect_name);
    prop_assert_eq!(dev.background_route().0.name, "io_uring");
    prop_assert_eq!(dev.geometry().max_transfer_bytes, max_transfer);

    let mut run = Run {
        engine: &engine,
        lbio: &lbio,
        dev: &dev,
        model: vec![0u8; DEVICE_BYTES as usize],
    };
    for s in steps {
        match s {
            Step::One(r, api) => run.one(r, *api)?,
            Step::Flush(api, bg) => run.flush(*api, *bg)?,
            Step::Detached(reqs) => run.detached(reqs)?,
            Step::Futures(reqs) => run.futures(reqs)?,
        }
    }

    // The whole device through lbio, and the file through the kernel's own read path.
    let whole = Req {
        write: false,
        offset: 0,
        len: DEVICE_BYTES,
        seed: 0,
        fua: false,
        background: true,
    };
    run.one(&whole, Api::Blocking)?;
    let model = std::mem::take(&mut run.model);
    let on_disk = std::fs::read(file.path()).expect("read the file back");
    prop_assert!(on_disk == model, "the file's bytes differ from the model");

    let m = lbio.metrics();
    prop_assert_eq!(m.errors, 0);
    prop_assert!(!engine.has_work());
    prop_assert_eq!(lbio.free_slots(), lbio.config().slots);
    prop_assert_eq!(engine.arena().free_frames(), engine.arena().frames());
    Ok(())
}

fn check_route(route: RouteChoice) {
    let unit = device_alignment();
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    });
    let result = runner.run(&case(unit), |(max_transfer, steps)| {
        run_case(route, max_transfer, &steps)
    });
    if let Err(e) = result {
        panic!("{route:?} route: {e}");
    }
}

#[test]
fn ring_route_agrees_with_a_model() {
    check_route(RouteChoice::Ring);
}

#[test]
fn sync_route_agrees_with_a_model() {
    check_route(RouteChoice::Sync);
}

/// The splitting paths are really taken: a request over max transfer is split, and a large
/// background request is cut at the 32 KiB split.
#[test]
fn requests_are_split_on_a_real_file() {
    let file = TempFile::new("split");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open(&lbio, file.path(), RouteChoice::Ring, 8192);
    let mut buf = engine.try_alloc(65536).unwrap();
    for (i, x) in buf.iter_mut().enumerate() {
        *x = byte(7, i as u64);
    }
    let buf = dev.write_at_blocking(0, buf, true).unwrap();
    let m = lbio.metrics();
    assert_eq!((m.requests, m.pieces, m.split_requests), (1, 8, 1));

    let dev64 = open(&lbio, file.path(), RouteChoice::Ring, 1 << 20);
    let back = dev64
        .run_blocking(Io::read(0, buf).class(Class::Background))
        .unwrap()
        .unwrap();
    let m = lbio.metrics();
    assert_eq!(
        (m.requests, m.pieces, m.split_requests),
        (2, 10, 2),
        "two 32 KiB pieces"
    );
    assert!(back
        .iter()
        .enumerate()
        .all(|(i, &x)| x == byte(7, i as u64)));
}
