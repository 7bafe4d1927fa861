//! Benchmarks: lbio workloads, the `pread` baseline, fio as the anchor, and the reports.
//!
//! Latency is measured per request from just before submission to the moment its completion is
//! taken, recorded in an HDR histogram (ns). CPU is the process's user + system time over the
//! run (getrusage), so IOPS per CPU-second compares CPU efficiency (Rio's metric).

pub mod cleanup;
pub mod compare;
pub mod fio;
pub mod fsbench;
pub mod fsync;
pub mod net;
pub mod ordered;
pub mod pagecache;
pub mod report;
pub mod scale;
pub mod ull;

use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use aios_core::{sys, CompletionMode, FixedBuf};
use hdrhistogram::Histogram;
use lbio::{Class, Device, Io, LbioError};
use serde::Serialize;

/// Errors of the benchmark harness.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{0}")]
    Setup(String),
    #[error("could not parse: {0}")]
    Parse(String),
    #[error(transparent)]
    Lbio(#[from] LbioError),
    #[error(transparent)]
    Core(#[from] aios_core::CoreError),
    #[error("{0}")]
    Invalid(String),
}

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    #[value(name = "randread")]
    RandRead,
    #[value(name = "randwrite")]
    RandWrite,
    #[value(name = "read")]
    Read,
    #[value(name = "write")]
    Write,
}

impl Rw {
    /// Name as in fio.
    pub fn name(self) -> &'static str {
        match self {
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
        }
    }
    /// fio's `--rw` value.
    pub fn fio_name(self) -> &'static str {
        self.name()
    }
    /// Reads rather than writes.
    pub fn is_read(self) -> bool {
        matches!(self, Rw::RandRead | Rw::Read)
    }
    fn is_random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }
}

/// One workload: pattern, block size, queue depth, duration.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub rw: Rw,
    pub bs: u32,
    pub qd: u32,
    pub seconds: f64,
}

/// One measured run of one engine, printed as a table row or one JSON line.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    pub workload: String,
    pub engine: String,
    pub bs: u32,
    pub qd: u32,
    pub iops: f64,
    pub lat_us_mean: f64,
    pub lat_us_p50: f64,
    pub lat_us_p99: f64,
    pub lat_us_p999: f64,
    pub cpu_s: f64,
    pub iops_per_cpu_s: f64,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Ours ÷ fio io_uring mean latency, same round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_fio: Option<f64>,
    /// Ours ÷ fio io_uring IOPS, same round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_ratio_vs_fio: Option<f64>,
    /// Ours ÷ fio psync mean latency, same round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_fio_psync: Option<f64>,
    /// The PM QoS CPU wake-up latency (µs) held for the whole run (`--cpu-latency-us`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_latency_us: Option<u32>,
    /// Latency CDF points (quantile, µs) for plots.
    #[serde(skip)]
    pub cdf: Vec<(f64, f64)>,
}

/// A latency histogram in nanoseconds (1 ns .. 100 s, 3 significant digits).
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static histogram bounds are valid")
}

/// A sample of `ops` requests over `elapsed` seconds and `cpu` CPU-seconds, latencies from `hist`.
fn measured(
    w: &Workload,
    engine: String,
    qd: u32,
    ops: u64,
    elapsed: f64,
    cpu: f64,
    hist: &Histogram<u64>,
) -> Sample {
    let mut s = Sample {
        workload: w.rw.name().to_string(),
        engine,
        bs: w.bs,
        qd,
        iops: ops as f64 / elapsed,
        cpu_s: cpu,
        iops_per_cpu_s: if cpu > 0.0 { ops as f64 / cpu } else { 0.0 },
        seconds: elapsed,
        ..Sample::default()
    };
    fill_from_histogram(&mut s, hist);
    s
}

fn fill_from_histogram(s: &mut Sample, h: &Histogram<u64>) {
    s.lat_us_mean = h.mean() / 1000.0;
    s.lat_us_p50 = quantile_us(h, 0.50);
    s.lat_us_p99 = quantile_us(h, 0.99);
    s.lat_us_p999 = quantile_us(h, 0.999);
    s.cdf = cdf_us(h);
}

/// The value at quantile `q` of a histogram in ns, in µs.
pub fn quantile_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// The points (quantile, µs) of a histogram in ns, for latency CDF plots.
pub fn cdf_us(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    h.iter_quantiles(4)
        .map(|v| {
            (
                v.quantile_iterated_to(),
                v.value_iterated_to() as f64 / 1000.0,
            )
        })
        .collect()
}

/// Offsets for a workload: uniformly random or sequential (wrapping), in `bs` units.
struct Offsets {
    x: u64,
    blocks: u64,
    next_seq: u64,
    bs: u64,
    random: bool,
}

impl Offsets {
    fn new(span: u64, bs: u32, random: bool, seed: u64) -> Offsets {
        Offsets {
            x: seed | 1,
            blocks: (span / bs as u64).max(1),
            next_seq: 0,
            bs: bs as u64,
            random,
        }
    }
    fn next(&mut self) -> u64 {
        if self.random {
            self.x ^= self.x << 13;
            self.x ^= self.x >> 7;
            self.x ^= self.x << 17;
            (self.x % self.blocks) * self.bs
        } else {
            let o = self.next_seq;
            self.next_seq = (self.next_seq + 1) % self.blocks;
            o * self.bs
        }
    }
}

/// How an lbio run submits.
#[derive(Clone, Copy, Debug)]
pub struct LbioRunOptions {
    pub class: Class,
    pub completion: CompletionMode,
    /// Bytes of the device the offsets cover.
    pub span: u64,
    /// Hold submissions so they reach the kernel with the next wait (plugging).
    pub plug: bool,
}

/// Run `w` on `dev` through lbio's detached API: keep `qd` requests in flight; each completion is
/// timed and replaced by a new request; the replacements and the wait go out in one
/// `io_uring_enter`.
pub fn run_lbio(dev: &Device, w: &Workload, opts: LbioRunOptions) -> Result<Sample, BenchError> {
    let r = run_lbio_timed(dev, w, opts, &mut || {})?;
    Ok(measured(
        w, r.engine, w.qd, r.ops, r.elapsed, r.cpu, &r.hist,
    ))
}

/// What one timed lbio run did (see [`run_lbio_timed`]).
pub struct LbioRun {
    /// Requests completed in the timed part.
    pub ops: u64,
    /// Seconds of the timed part.
    pub elapsed: f64,
    /// The process's CPU seconds over the timed part (every thread's).
    pub cpu: f64,
    /// Per-request latency (ns).
    pub hist: Histogram<u64>,
    /// `lbio-<route>[-poll|-hybrid]`.
    pub engine: String,
}

/// [`run_lbio`]'s loop: buffers, a warm-up request, then `start()`, then the timed run. Threads
/// that each drive their own device call `start` to line their timed parts up (a barrier).
pub fn run_lbio_timed(
    dev: &Device,
    w: &Workload,
    opts: LbioRunOptions,
    start: &mut dyn FnMut(),
) -> Result<LbioRun, BenchError> {
    dev.check_queue_depth(w.qd)?;
    let lbio = Rc::clone(dev.lbio());
    let engine = Rc::clone(lbio.engine());
    engine.set_completion_mode(opts.completion);
    let g = *dev.geometry();
    if w.bs % g.offset_align != 0 {
        return Err(BenchError::Invalid(format!(
            "block size {} is not a multiple of the device's {}-byte alignment",
            w.bs, g.offset_align
        )));
    }
    let span = opts.span.min(g.capacity_bytes);
    if span < w.bs as u64 {
        return Err(BenchError::Invalid(format!(
            "the device holds {span} bytes, less than one {}-byte block",
            w.bs
        )));
    }
    let mut bufs: Vec<FixedBuf> = Vec::with_capacity(w.qd as usize);
    for _ in 0..w.qd {
        let mut b = engine.alloc_blocking(w.bs as usize)?;
        b.fill(0xa5);
        bufs.push(b);
    }
    let mut offsets = Offsets::new(span, w.bs, w.rw.is_random(), 0x1234_5678);
    let mut starts = vec![Instant::now(); lbio.config().slots as usize];
    let mut hist = new_histogram();
    let make = |off: u64, buf: FixedBuf| -> Io {
        let io = if w.rw.is_read() {
            Io::read(off, buf)
        } else {
            Io::write(off, buf)
        };
        io.class(opts.class)
    };
    let submit = |io: Io, starts: &mut [Instant]| -> Result<(), BenchError> {
        let t = Instant::now();
        // Held, a submission goes out with the next wait (one io_uring_enter for both);
        // otherwise at once.
        let r = if opts.plug {
            engine.hold_submissions(|| dev.submit(io))
        } else {
            dev.submit(io)
        };
        match r {
            Ok(tag) => {
                starts[tag.0 as usize] = t;
                Ok(())
            }
            Err((e, _)) => Err(e.into()),
        }
    };

    // Warm-up: a short burst so first-touch costs stay out of the measurement.
    let warm = bufs.pop().expect("qd >= 1");
    submit(make(0, warm), &mut starts)?;
    lbio.wait_done(1)?;
    let c = lbio.take_done().expect("warm-up completion");
    c.result?;
    bufs.push(c.buf.expect("data requests carry a buffer"));

    start();
    let cpu0 = sys::process_cpu_time();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(w.seconds);
    let mut inflight = 0u32;
    for b in bufs.drain(..) {
        submit(make(offsets.next(), b), &mut starts)?;
        inflight += 1;
    }
    let mut ops = 0u64;
    let mut failure: Option<LbioError> = None;
    while inflight > 0 {
        lbio.wait_done(1)?;
        // Inline (sync-route) resubmissions complete at once and land in this same queue, so the
        // clock and the deadline are read per completion.
        while let Some(c) = lbio.take_done() {
            let now = Instant::now();
            let accepting = now < deadline && failure.is_none();
            inflight -= 1;
            let lat = now.duration_since(starts[c.tag.0 as usize]).as_nanos() as u64;
            if let Err(e) = c.result {
                failure.get_or_insert(e);
                continue;
            }
            hist.saturating_record(lat.max(1));
            ops += 1;
            if accepting {
                let buf = c.buf.expect("data requests carry a buffer");
                submit(make(offsets.next(), buf), &mut starts)?;
                inflight += 1;
            }
        }
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = (sys::process_cpu_time() - cpu0).as_secs_f64();
    if let Some(e) = failure {
        return Err(e.into());
    }
    let (caps, _) = dev.critical_route();
    let route = if opts.class == Class::Background {
        dev.background_route().0.name
    } else {
        caps.name
    };
    let engine = format!(
        "lbio-{route}{}",
        match opts.completion {
            CompletionMode::BusyPoll if route.starts_with("io_uring") => "-poll",
            CompletionMode::Hybrid { .. } if route.starts_with("io_uring") => "-hybrid",
            _ => "",
        }
    );
    Ok(LbioRun {
        ops,
        elapsed,
        cpu,
        hist,
        engine,
    })
}

/// The project's own baseline: a plain `pread`/`pwrite` loop on an `O_DIRECT` descriptor, QD1,
/// into an aligned buffer from a small engine's arena.
pub fn run_pread(path: &Path, w: &Workload, span: u64) -> Result<Sample, BenchError> {
    use std::os::fd::AsRawFd;
    let write = !w.rw.is_read();
    let fd = sys::open_direct(path, write)
        .map_err(|e| BenchError::Setup(format!("{}: {e}", path.display())))?;
    let engine = aligned_memory_engine(w.bs as usize)?;
    let mut buf = engine.alloc_blocking(w.bs as usize)?;
    buf.fill(0xa5);
    let mut offsets = Offsets::new(span, w.bs, w.rw.is_random(), 0x8765_4321);
    let mut hist = new_histogram();
    let cpu0 = sys::process_cpu_time();
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(w.seconds);
    let mut ops = 0u64;
    loop {
        let t = Instant::now();
        if t >= deadline {
            break;
        }
        let off = offsets.next();
        let r = if write {
            sys::pwrite_from(fd.as_raw_fd(), &buf, off, false)
        } else {
            sys::pread_into(fd.as_raw_fd(), &mut buf, off)
        };
        r.map_err(|e| BenchError::Setup(format!("pread/pwrite at offset {off}: {e}")))?;
        hist.saturating_record((t.elapsed().as_nanos() as u64).max(1));
        ops += 1;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu = (sys::process_cpu_time() - cpu0).as_secs_f64();
    Ok(measured(
        w,
        "pread".to_string(),
        1,
        ops,
        elapsed,
        cpu,
        &hist,
    ))
}

/// A small engine whose arena serves as aligned memory (at least `bytes`) for plain `O_DIRECT`
/// `pread`/`pwrite` baselines.
pub fn aligned_memory_engine(bytes: usize) -> Result<Rc<aios_core::Engine>, BenchError> {
    Ok(aios_core::Engine::new(aios_core::EngineConfig {
        ring_entries: 8,
        arena_bytes: bytes.max(4096),
        huge_pages: false,
        max_files: 1,
        ..aios_core::EngineConfig::default()
    })?)
}

/// The engine an lbio bench runs on: an arena for `qd` buffers of `bs` bytes plus 1 MiB (at
/// least 4 MiB, at most 1 GiB, within the memlock share of one of `engines` engines alive at
/// once) and a ring sized for `slots` requests.
pub fn lbio_engine_config(bs: u32, qd: u32, slots: u32, engines: u32) -> aios_core::EngineConfig {
    let arena = arena_within_memlock(
        (bs as usize * qd as usize + (1 << 20))
            .next_power_of_two()
            .max(4 << 20),
        engines,
    );
    aios_core::EngineConfig {
        arena_bytes: arena.min(1 << 30),
        ring_entries: slots.next_power_of_two().clamp(64, 4096),
        ..aios_core::EngineConfig::default()
    }
}

/// One thread's place at the start of [`run_threads`]: [`Start::wait`] arrives (once; later
/// calls return at once), and a thread that never called it (its setup failed, or it panicked)
/// arrives when its `Start` drops, so the others and the clock are never left waiting.
pub struct Start<'a> {
    barrier: &'a std::sync::Barrier,
    arrived: std::cell::Cell<bool>,
}

impl Start<'_> {
    /// Arrive at the start and wait for every other thread to.
    pub fn wait(&self) {
        if !self.arrived.replace(true) {
            self.barrier.wait();
        }
    }
}

impl Drop for Start<'_> {
    fn drop(&mut self) {
        self.wait();
    }
}

/// Run `f(t, ready)` on `threads` threads at once. Each thread prepares, then calls
/// `ready.wait()`; the clocks start when all have. Returns the threads' results (in order), the
/// wall seconds and the process CPU seconds from that start until the last thread ends. A
/// thread that panics is a panic here too (with its message), not a wait for ever.
pub fn run_threads<R: Send>(
    threads: u32,
    f: impl Fn(u32, &Start<'_>) -> R + Sync,
) -> (Vec<R>, f64, f64) {
    let (results, wall, user, system) = run_threads_split(threads, f);
    (results, wall, user + system)
}

/// [`run_threads`] with the process CPU seconds split: `(results, wall, user, system)`.
pub fn run_threads_split<R: Send>(
    threads: u32,
    f: impl Fn(u32, &Start<'_>) -> R + Sync,
) -> (Vec<R>, f64, f64, f64) {
    let ready = std::sync::Barrier::new(threads as usize + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (f, ready) = (&f, &ready);
                s.spawn(move || {
                    let start = Start {
                        barrier: ready,
                        arrived: std::cell::Cell::new(false),
                    };
                    f(t, &start)
                })
            })
            .collect();
        ready.wait();
        let (user0, sys0) = sys::process_cpu_split();
        let t0 = Instant::now();
        let results: Vec<R> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect();
        let wall = t0.elapsed().as_secs_f64();
        let (user1, sys1) = sys::process_cpu_split();
        (
            results,
            wall,
            user1.saturating_sub(user0).as_secs_f64(),
            sys1.saturating_sub(sys0).as_secs_f64(),
        )
    })
}

/// The arena for each of `engines` bench engines alive at once: `wanted`, or, in a process whose
/// pinned memory is limited (no `CAP_IPC_LOCK`, finite `RLIMIT_MEMLOCK`), what a quarter of the
/// limit allows — the previous run's arenas can still be counted while the kernel tears their
/// rings down. Never below 1 MiB.
pub fn arena_within_memlock(wanted: usize, engines: u32) -> usize {
    if sys::has_cap_ipc_lock() {
        return wanted;
    }
    match sys::memlock_limit() {
        Ok(Some(limit)) => {
            let share = (limit / 4 / engines.max(1) as u64) as usize;
            let pow2 = if share == 0 {
                0
            } else {
                1 << (usize::BITS - 1 - share.leading_zeros())
            };
            wanted.min(pow2).max(1 << 20)
        }
        _ => wanted,
    }
}

/// The benches' random offsets: xorshift64 (`x` must not be 0).
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// The longest `--seconds` taken (about 31 years): a run's deadline is the monotonic clock plus
/// this, and much further out it no longer fits a `Duration` or an `Instant` (a panic).
pub const MAX_SECONDS: f64 = 1e9;

/// `--seconds` must be a positive, finite number of seconds, at most [`MAX_SECONDS`].
pub fn check_seconds(seconds: f64) -> Result<(), BenchError> {
    if seconds <= 0.0 || !seconds.is_finite() {
        return Err(BenchError::Invalid(format!(
            "--seconds {seconds}: a finite number of seconds above 0 (e.g. 0.5 or 5)"
        )));
    }
    if seconds > MAX_SECONDS {
        return Err(BenchError::Invalid(format!(
            "--seconds {seconds:e}: at most {MAX_SECONDS:e} (about 31 years)"
        )));
    }
    Ok(())
}

/// Record the time since `since` (nanoseconds) in a latency histogram.
pub fn record_since(h: &mut hdrhistogram::Histogram<u64>, since: std::time::Instant) {
    h.saturating_record(since.elapsed().as_nanos() as u64);
}

/// Median of a list (NaN-free inputs).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Heap bytes that start on a 4 KiB page boundary, for the buffers a benchmark copies into and
/// out of. How fast a 4 KiB copy runs depends on how its source and destination are aligned (an
/// ordinary `Vec<u8>` starts wherever the allocator puts it), so every reader in a comparison
/// copies between page-aligned buffers and none wins or loses by where the heap happened to be.
pub struct PageAligned {
    /// `len` bytes plus up to a page of slack, of which `at..at + len` is used.
    bytes: Vec<u8>,
    at: usize,
    len: usize,
}

impl PageAligned {
    /// `len` bytes, each `fill`.
    pub fn new(len: usize, fill: u8) -> PageAligned {
        let bytes = vec![fill; len + 4095];
        let at = bytes.as_ptr().align_offset(4096);
        PageAligned { bytes, at, len }
    }
}

impl std::ops::Deref for PageAligned {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[self.at..self.at + self.len]
    }
}

impl std::ops::DerefMut for PageAligned {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.at..self.at + self.len]
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    /// A thread that panics before it reaches the start makes `run_threads` panic with its
    /// message, after the other threads ran. (Found by a review of the CLI on 2026-11-28: a
    /// `bench scale` worker's overflow panic left the main thread waiting at the start for
    /// ever.)
    #[test]
    fn a_thread_that_panics_before_the_start_is_a_panic_not_a_hang() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let ran = std::sync::atomic::AtomicU32::new(0);
            let r = std::panic::catch_unwind(|| {
                super::run_threads(3, |t, ready| {
                    if t == 1 {
                        panic!("thread 1's setup failed");
                    }
                    ready.wait();
                    ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                })
            });
            let msg = r
                .err()
                .and_then(|p| p.downcast_ref::<&str>().map(|s| s.to_string()));
            let _ = tx.send((msg, ran.into_inner()));
        });
        let (msg, ran) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("run_threads waited for ever for the thread that panicked");
        assert_eq!(msg.as_deref(), Some("thread 1's setup failed"));
        assert_eq!(ran, 2, "the other threads ran");
    }
}
