//! `aios bench pagecache`: the page cache's read path beside the kernel's page cache, O_DIRECT
//! `pread` and raw lbio, on one device, in alternating rounds (DESIGN.md "Measuring").
//!
//! * **cold**: random reads of `bs` bytes at offsets drawn without repetition (a permutation of
//!   the device's `bs` blocks), so every read misses. The page cache under test is new for every
//!   run (full after its capacity, evicting from then on). The kernel's page cache reads the same
//!   device with buffered `pread`, after `POSIX_FADV_DONTNEED` on the range (outside the timed
//!   part), and on the whole device once before the run: a 4 KiB DONTNEED leaves a large folio
//!   in place (a file's written pages, a sequential read's), which would then serve "cold"
//!   reads from memory. Its default readahead reads an isolated random read as one request of its size;
//!   `POSIX_FADV_RANDOM` would make it read a 128 KiB miss one page at a time, so it is not set.
//! * **hits**: 4 KiB reads of pages already cached, uniformly at random over a hot set: copy-out
//!   (`CacheHandle::read`), zero-copy (`CacheHandle::get`, one byte touched) and the kernel's hot
//!   buffered `pread`; beside them two copy floors with no lookup, from a buffer of the hot set's
//!   size mapped as the cache's frames are (huge pages where the kernel gives them) and, like
//!   them, one for all threads: `memcpy` (the platform's) and `copy` (`aios_core::copy`, the
//!   routine copy-out hits use). Hits are timed in batches of [`HIT_BATCH`] (a clock read per hit would
//!   be a sizeable part of one); the latency columns are batch means.
//!
//! * **submission latency** (cold page-cache reads): from the read call's entry to its SQE
//!   entering the kernel, timed on one read in [`SUBMIT_SAMPLE`] (the clock reads it takes are
//!   not in the other reads' latency).
//!
//! Every buffer a reader copies into (and the copy floors' source) starts on a 4 KiB boundary:
//! a 4 KiB copy's speed depends on where its ends fall, and that must not differ by reader.
//!
//! Every thread has its own engine, lbio array, device handle and cache handle; the cache is
//! shared. CPU seconds are the threads' own (getrusage RUSAGE_THREAD), summed.

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use aios_core::sys::{self, Advice};
use aios_core::{CompletionMode, Engine, EngineConfig, ProbeOptions};
use hdrhistogram::Histogram;
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig, RouteChoice};
use pagecache::{CacheConfig, CacheHandle, FileId, Mode, PageCache, PAGE_BYTES};
use serde::Serialize;

use crate::bench::compare::Progress;
use crate::bench::report::human_bytes;
use crate::bench::{
    aligned_memory_engine, cdf_us, median, new_histogram, quantile_us, xorshift, BenchError,
    PageAligned,
};

/// Hits timed together.
pub const HIT_BATCH: u64 = 64;

/// Cold reads of the page cache time their submission latency one in this many.
pub const SUBMIT_SAMPLE: u32 = 8;

/// What reads the device in a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// The page cache under test, in a mode.
    Cache(Mode),
    /// The page cache in AIOS mode with `vectored_reads` off: a multi-page miss is one request
    /// per page (cold reads above 4 KiB, to compare with one scattered request per run).
    CachePerPage,
    /// The page cache in AIOS mode through its zero-copy guard (`get`): hits, and cold 4 KiB
    /// reads (the guard is taken and dropped; no byte is copied out, as with raw lbio).
    CacheZeroCopy,
    /// Buffered `pread`: the kernel's page cache.
    Kernel,
    /// `pread` on an `O_DIRECT` descriptor (cold only).
    ODirect,
    /// lbio's own blocking read into an arena buffer (cold only).
    Lbio,
    /// A plain `memcpy` of 4 KiB from a random page of a buffer as large as the hot set, mapped
    /// as the cache's frames are (hits only): the platform's copy, with no lookup at all.
    Memcpy,
    /// The same copies through [`aios_core::copy::copy`], the routine the page cache copies
    /// out with (hits only): the floor under its copy-out hits.
    Copy,
}

impl Reader {
    /// The `mode` field of a report line.
    pub fn mode(self, hot: bool) -> &'static str {
        match self {
            Reader::Cache(m) => m.name(),
            Reader::CachePerPage => "aios-per-page",
            Reader::CacheZeroCopy if hot => "aios",
            Reader::CacheZeroCopy => "aios-zero-copy",
            Reader::Kernel if hot => "kernel-hot",
            Reader::Kernel => "kernel-cold",
            Reader::ODirect => "odirect",
            Reader::Lbio => "lbio",
            Reader::Memcpy => "memcpy",
            Reader::Copy => "copy",
        }
    }
    /// The `engine` field of a report line.
    pub fn engine(self) -> &'static str {
        match self {
            Reader::Cache(_) | Reader::CachePerPage | Reader::CacheZeroCopy => "pagecache",
            Reader::Kernel => "kernel",
            Reader::ODirect => "pread-odirect",
            Reader::Lbio => "lbio",
            Reader::Memcpy | Reader::Copy => "memory",
        }
    }
}

/// One run: which reader, cold or hot, block size, threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    pub reader: Reader,
    pub hot: bool,
    /// Hits: bytes of the hot set (0 for cold runs).
    pub hot_bytes: u64,
    pub bs: u32,
    pub threads: u32,
}

impl Case {
    /// The `workload` field of a report line.
    pub fn workload(&self) -> &'static str {
        match (self.hot, self.reader) {
            (false, _) => "cold-randread",
            (true, Reader::CacheZeroCopy) => "hit-zerocopy",
            (true, _) => "hit-randread",
        }
    }
}

/// The benchmark's settings.
#[derive(Clone, Debug)]
pub struct PagecacheBench {
    /// The device (or file) every reader reads.
    pub path: PathBuf,
    /// How reports name the device (`ull`, a path).
    pub device_name: String,
    /// Block sizes of the cold reads.
    pub cold_bs: Vec<u32>,
    /// Thread counts.
    pub threads: Vec<u32>,
    /// Page-cache modes for cold reads.
    pub modes: Vec<Mode>,
    /// Run the cold workloads.
    pub cold: bool,
    /// Also run the hit workloads.
    pub hits: bool,
    /// Seconds per run.
    pub seconds: f64,
    pub rounds: u32,
    /// Capacity of the page cache under test.
    pub cache_bytes: usize,
    /// Hot-set sizes of the hit workloads (each one a run per reader).
    pub hot_sets: Vec<u64>,
    /// How every reader's thread waits for completions; `None`: [`completion_for`] its thread
    /// count. Raw lbio and the cache's readers always wait the same way in one run.
    pub completion: Option<CompletionMode>,
}

/// One measured run, a table row or a JSON line: the foundation's fields plus `mode`, `bs` as
/// text, the submission latency and ratios within the round.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PcSample {
    pub workload: String,
    pub engine: String,
    pub mode: String,
    pub bs: String,
    pub qd: u32,
    pub threads: u32,
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
    pub device: String,
    /// Hits: the hot set the reads draw from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hot_set: Option<String>,
    /// Read entry → SQE entering the kernel, median (µs); page-cache misses only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_us_p50: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_us_mean: Option<f64>,
    /// Mean latency ÷ the kernel's cold buffered read's (same round, bs and threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_kernel_cold: Option<f64>,
    /// Mean latency − raw lbio's (µs): for the page cache, against the raw lbio reads paired
    /// with its misses in the same run; otherwise against the lbio run of the same round, bs and
    /// threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta_us_vs_lbio: Option<f64>,
    /// Median latency − the paired raw lbio reads' median (µs; page cache only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta_us_vs_lbio_p50: Option<f64>,
    /// Mean latency of the raw lbio reads paired with the page cache's misses (µs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paired_lbio_us_mean: Option<f64>,
    /// Throughput ÷ the kernel's hot buffered `pread` (same round and threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_ratio_vs_kernel_hot: Option<f64>,
    /// Throughput ÷ the same reader's with one thread (same round).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scaling_vs_one_thread: Option<f64>,
    /// Page-cache misses that lost a lazy-indexing race, and evictions, in the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicates: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evictions: Option<u64>,
    #[serde(skip)]
    pub cdf: Vec<(f64, f64)>,
    #[serde(skip)]
    pub submit_cdf: Vec<(f64, f64)>,
    #[serde(skip)]
    case: Option<Case>,
}

impl PcSample {
    /// The run this sample measured.
    pub fn case(&self) -> Option<Case> {
        self.case
    }
}

/// What one thread measured.
struct ThreadOut {
    ops: u64,
    hist: Histogram<u64>,
    submit: Histogram<u64>,
    /// Raw lbio reads paired with page-cache misses.
    paired: Histogram<u64>,
    elapsed: Duration,
    cpu: Duration,
}

impl ThreadOut {
    fn new() -> ThreadOut {
        ThreadOut {
            ops: 0,
            hist: new_histogram(),
            submit: new_histogram(),
            paired: new_histogram(),
            elapsed: Duration::ZERO,
            cpu: Duration::ZERO,
        }
    }
}

/// A permutation of `0..n`: `i ↦ (a·i + c) mod n` with `gcd(a, n) = 1`.
struct Permutation {
    n: u64,
    a: u64,
    c: u64,
}

impl Permutation {
    fn new(n: u64, seed: u64) -> Permutation {
        let mut a = (0x9e37_79b9_7f4a_7c15u64 % n.max(2)) | 1;
        while gcd(a, n) != 1 {
            a += 2;
        }
        Permutation {
            n,
            a,
            c: seed % n.max(1),
        }
    }
    fn at(&self, i: u64) -> u64 {
        ((self.a as u128 * (i % self.n) as u128 + self.c as u128) % self.n as u128) as u64
    }
}

/// A cold run's raw lbio read paired with a cache read (none in hot runs), timed into
/// `out.paired`.
fn paired_read(
    paired: &Option<RefCell<(Device, Option<aios_core::FixedBuf>)>>,
    off: u64,
    out: &mut ThreadOut,
) -> Result<(), BenchError> {
    if let Some(p) = paired {
        let mut p = p.borrow_mut();
        let (dev, b) = &mut *p;
        let buf = b.take().expect("one buffer, returned by each read");
        let t = Instant::now();
        let buf = dev.read_at_blocking(off, buf)?;
        out.paired
            .saturating_record((t.elapsed().as_nanos() as u64).max(1));
        *b = Some(buf);
    }
    Ok(())
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// How the threads of a run wait for completions: busy-polled (lbio's policy for a critical QD1
/// request) up to one thread per CPU, and beyond that spinning for at most 100 µs per wait
/// before sleeping ([`CompletionMode::hybrid`]). A spinning thread yields its CPU after a few
/// empty polls, so the kernel's side of the I/O (the loop device's worker, softirqs) still runs
/// when every CPU has a spinner; a sleeping one pays a halted CPU's wake-up per completion. On
/// the 2 vCPU VM, two threads: busy-polling gave 1.5–1.7× the journal's commit IOPS and 0.55×
/// the page cache's cold-read latency of sleeping (2026-11-25). Four threads, against sleeping
/// (two alternating runs each, the same day): the overlapped commit 31.5k and 32.0k IOPS against
/// 26.5k and 27.3k, the page cache's cold 4 KiB read 31.8 and 34.0 µs against 36.4 and 37.2 µs.
pub fn completion_for(threads: u32) -> CompletionMode {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    if threads <= cores {
        CompletionMode::BusyPoll
    } else {
        CompletionMode::hybrid()
    }
}

/// Cold-read block sizes: multiples of 4 KiB (the cache's page) that fit the device (when its
/// size is known).
pub fn check_block_sizes(bs: &[u32], capacity: Option<u64>) -> Result<(), BenchError> {
    match bs
        .iter()
        .find(|&&b| b == 0 || b % 4096 != 0 || capacity.is_some_and(|c| b as u64 > c))
    {
        Some(b) => Err(BenchError::Invalid(format!(
            "block size {b} must be a multiple of 4 KiB (the cache's page) and fit the device"
        ))),
        None => Ok(()),
    }
}

/// An engine, lbio array and device (`write`: opened for writing too) for one bench thread.
pub(crate) fn thread_stack(
    path: &std::path::Path,
    arena: usize,
    completion: CompletionMode,
    write: bool,
) -> Result<(Rc<Engine>, Rc<LbioArray>, Device), BenchError> {
    let engine = Engine::new(EngineConfig {
        arena_bytes: arena.next_power_of_two().max(1 << 20),
        ring_entries: 256,
        huge_pages: false,
        ..EngineConfig::default()
    })?;
    engine.set_completion_mode(completion);
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots: 128,
            ..LbioConfig::default()
        },
    )?;
    let dev = Device::open(
        &lbio,
        path,
        DeviceConfig {
            write,
            ..device_config()
        },
    )?;
    Ok((engine, lbio, dev))
}

/// How the bench opens its lbio devices: routes chosen by a short probe, no IOPOLL.
pub(crate) fn device_config() -> DeviceConfig {
    DeviceConfig {
        route: RouteChoice::Auto,
        probe: ProbeOptions {
            latency_samples: 50,
            try_iopoll: false,
        },
        ..DeviceConfig::default()
    }
}

fn setup_err(what: &str) -> impl Fn(std::io::Error) -> BenchError + '_ {
    move |e| BenchError::Setup(format!("{what}: {e}"))
}

impl PagecacheBench {
    /// Every run of one round, in the order they go (reversed on odd rounds by the caller).
    pub fn cases(&self) -> Vec<Case> {
        let mut v = Vec::new();
        for &threads in &self.threads {
            for &bs in self.cold_bs.iter().filter(|_| self.cold) {
                let mut readers = vec![Reader::Kernel, Reader::ODirect, Reader::Lbio];
                readers.extend(self.modes.iter().map(|&m| Reader::Cache(m)));
                if bs > PAGE_BYTES as u32 && self.modes.contains(&Mode::AIOS) {
                    readers.push(Reader::CachePerPage);
                }
                if bs == PAGE_BYTES as u32 && self.modes.contains(&Mode::AIOS) {
                    readers.push(Reader::CacheZeroCopy);
                }
                for reader in readers {
                    v.push(Case {
                        reader,
                        hot: false,
                        hot_bytes: 0,
                        bs,
                        threads,
                    });
                }
            }
            if self.hits {
                for &hot_bytes in &self.hot_sets {
                    for reader in [
                        Reader::Kernel,
                        Reader::Memcpy,
                        Reader::Copy,
                        Reader::Cache(Mode::AIOS),
                        Reader::CacheZeroCopy,
                    ] {
                        v.push(Case {
                            reader,
                            hot: true,
                            hot_bytes,
                            bs: PAGE_BYTES as u32,
                            threads,
                        });
                    }
                }
            }
        }
        v
    }

    /// The cold cases' page caches are `cache_bytes` (the hit cases size their own): too small
    /// a one is refused before anything runs (the CLI asks before it sets up the device).
    pub fn check_cache(&self) -> Result<(), BenchError> {
        let cold_cache = self.cases().iter().any(|c| {
            !c.hot
                && matches!(
                    c.reader,
                    Reader::Cache(_) | Reader::CachePerPage | Reader::CacheZeroCopy
                )
        });
        let least = CacheConfig::default().min_capacity_bytes();
        if cold_cache && self.cache_bytes < least {
            return Err(BenchError::Invalid(format!(
                "--cache {}: the page cache under test needs at least {} (two pool batches of \
                 4 KiB frames)",
                human_bytes(self.cache_bytes as u64),
                human_bytes(least as u64)
            )));
        }
        Ok(())
    }

    /// Run every case for `rounds` rounds; `emit` sees each sample as it is measured (with its
    /// ratios filled in once its round's anchors are in). Returns all samples and the medians.
    pub fn run(
        &self,
        progress: &Progress,
        emit: &mut dyn FnMut(&PcSample),
    ) -> Result<(Vec<PcSample>, Vec<PcSample>), BenchError> {
        crate::bench::check_seconds(self.seconds)?;
        let capacity = device_bytes(&self.path)?;
        check_block_sizes(&self.cold_bs, Some(capacity))?;
        if self.threads.is_empty() || self.threads.contains(&0) {
            return Err(BenchError::Invalid("--threads needs counts >= 1".into()));
        }
        let cases = self.cases();
        self.check_cache()?;
        let mut all = Vec::new();
        for round in 0..self.rounds.max(1) {
            let mut order = cases.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut this_round = Vec::with_capacity(order.len());
            for (i, c) in order.iter().enumerate() {
                progress.step(&format!(
                    "pagecache round {}/{} run {}/{}: {} {} {} x{} thread(s)",
                    round + 1,
                    self.rounds.max(1),
                    i + 1,
                    order.len(),
                    c.workload(),
                    c.reader.mode(c.hot),
                    human_bytes(c.bs.into()),
                    c.threads
                ));
                let mut s = self.run_case(*c, capacity, round)?;
                s.round = Some(round + 1);
                this_round.push(s);
            }
            progress.done();
            fill_ratios(&mut this_round);
            this_round.sort_by_key(|s| order_key(&cases, s));
            for s in &this_round {
                emit(s);
            }
            all.extend(this_round);
        }
        let meds = medians(&cases, &all);
        Ok((all, meds))
    }

    fn run_case(&self, c: Case, capacity: u64, round: u32) -> Result<PcSample, BenchError> {
        let span = if c.hot {
            c.hot_bytes.min(capacity) / PAGE_BYTES as u64 * PAGE_BYTES as u64
        } else {
            capacity / c.bs as u64 * c.bs as u64
        };
        if span == 0 {
            return Err(BenchError::Invalid(
                "the device is smaller than one block".into(),
            ));
        }
        let cache = match c.reader {
            Reader::Cache(_) | Reader::CachePerPage | Reader::CacheZeroCopy => {
                let cap = if c.hot {
                    (span as usize + (c.threads as usize * 4 * 32 * PAGE_BYTES))
                        .max(self.cache_bytes)
                } else {
                    self.cache_bytes
                };
                Some(
                    PageCache::new(CacheConfig {
                        capacity_bytes: cap,
                        readahead_pages: 0,
                        vectored_reads: c.reader != Reader::CachePerPage,
                        ..CacheConfig::default()
                    })
                    .map_err(|e| BenchError::Setup(format!("page cache: {e}")))?,
                )
            }
            _ => None,
        };
        let file = match &cache {
            Some(cache) => Some(
                cache
                    .add_file(capacity)
                    .map_err(|e| BenchError::Setup(format!("page cache: {e}")))?,
            ),
            None => None,
        };
        // Held open for the run: a block device's page cache is dropped at its last close.
        let _warm = if c.hot && c.reader == Reader::Kernel {
            Some(warm_kernel(&self.path, span)?)
        } else {
            None
        };
        // The copy floors copy from memory of the hot set's size mapped as the cache's frames
        // are (transparent huge pages where the kernel gives them: on 4 KiB pages the copies
        // from a hot set past the TLB's reach would pay walks the frames do not), every page
        // written up front, and shared by all threads as the frames are (two cores reading the
        // same lines scale worse than each reading its own: 1.72-1.83x against 1.85-2.01x for
        // 4 KiB copies from 1 MiB on the Intel VM). What it holds does not matter to a copy.
        let floor = match c.reader {
            Reader::Memcpy | Reader::Copy => Some(Arc::new(
                aios_core::MappedBytes::new(span as usize, 0x5a, CacheConfig::default().huge_pages)
                    .map_err(|e| BenchError::Setup(format!("copy floor's memory: {e}")))?,
            )),
            _ => None,
        };
        let barrier = Barrier::new(c.threads as usize);
        let warm_done = Barrier::new(c.threads as usize);
        let seed = 0x5eed_0000 + round as u64 * 7919 + c.bs as u64;
        let outs: Vec<Result<ThreadOut, BenchError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..c.threads)
                .map(|t| {
                    let cache = cache.clone();
                    let floor = floor.clone();
                    let barrier = &barrier;
                    let warm_done = &warm_done;
                    scope.spawn(move || {
                        let ctx = ThreadCtx {
                            t,
                            case: c,
                            span,
                            seconds: self.seconds,
                            seed,
                            path: &self.path,
                            completion: self
                                .completion
                                .unwrap_or_else(|| completion_for(c.threads)),
                            cache,
                            file,
                            floor,
                            start: barrier,
                            warm_done,
                        };
                        ctx.run()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(BenchError::Setup("a benchmark thread panicked".into()))
                    })
                })
                .collect()
        });
        let mut total = ThreadOut::new();
        for o in outs {
            let o = o?;
            total.ops += o.ops;
            total
                .hist
                .add(&o.hist)
                .map_err(|e| BenchError::Setup(e.to_string()))?;
            total
                .submit
                .add(&o.submit)
                .map_err(|e| BenchError::Setup(e.to_string()))?;
            total
                .paired
                .add(&o.paired)
                .map_err(|e| BenchError::Setup(e.to_string()))?;
            total.elapsed = total.elapsed.max(o.elapsed);
            total.cpu += o.cpu;
        }
        let elapsed = total.elapsed.as_secs_f64().max(1e-9);
        let cpu = total.cpu.as_secs_f64();
        let h = &total.hist;
        let mut s = PcSample {
            workload: c.workload().into(),
            engine: c.reader.engine().into(),
            mode: c.reader.mode(c.hot).into(),
            bs: human_bytes(c.bs.into()),
            qd: 1,
            threads: c.threads,
            iops: total.ops as f64 / elapsed,
            lat_us_mean: h.mean() / 1000.0,
            lat_us_p50: quantile_us(h, 0.5),
            lat_us_p99: quantile_us(h, 0.99),
            lat_us_p999: quantile_us(h, 0.999),
            cpu_s: cpu,
            iops_per_cpu_s: if cpu > 0.0 {
                total.ops as f64 / cpu
            } else {
                0.0
            },
            seconds: elapsed,
            device: self.device_name.clone(),
            cdf: cdf_us(h),
            case: Some(c),
            hot_set: c.hot.then(|| human_bytes(c.hot_bytes)),
            ..PcSample::default()
        };
        if !total.submit.is_empty() {
            let sh = &total.submit;
            s.submit_us_p50 = Some(quantile_us(sh, 0.5));
            s.submit_us_mean = Some(sh.mean() / 1000.0);
            s.submit_cdf = cdf_us(sh);
        }
        if !total.paired.is_empty() {
            let ph = &total.paired;
            s.paired_lbio_us_mean = Some(ph.mean() / 1000.0);
            s.delta_us_vs_lbio = Some(s.lat_us_mean - ph.mean() / 1000.0);
            s.delta_us_vs_lbio_p50 = Some(s.lat_us_p50 - quantile_us(ph, 0.5));
        }
        if let Some(cache) = &cache {
            let m = cache.metrics();
            s.duplicates = Some(m.duplicates);
            s.evictions = Some(m.evictions);
        }
        Ok(s)
    }
}

/// Bytes of the device or file at `path`.
pub(crate) fn device_bytes(path: &std::path::Path) -> Result<u64, BenchError> {
    let f = std::fs::File::open(path).map_err(setup_err(&path.display().to_string()))?;
    let st = sys::statx(f.as_raw_fd()).map_err(setup_err(&path.display().to_string()))?;
    if st.is_block_device() {
        sys::block_device_bytes(f.as_raw_fd()).map_err(setup_err(&path.display().to_string()))
    } else if st.is_dir() {
        Err(BenchError::Invalid(format!(
            "{}: a directory, not a device: name a block device or a file",
            path.display()
        )))
    } else {
        Ok(st.size)
    }
}

/// Bring `0..span` of `path` into the kernel's page cache. The returned descriptor keeps it
/// there: the kernel drops a block device's cached pages when its last opener closes it.
fn warm_kernel(path: &std::path::Path, span: u64) -> Result<std::os::fd::OwnedFd, BenchError> {
    let fd = sys::open_buffered(path, false).map_err(setup_err(&path.display().to_string()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0;
    while off < span {
        let n = (span - off).min(buf.len() as u64) as usize;
        sys::pread_into(fd.as_raw_fd(), &mut buf[..n], off)
            .map_err(setup_err("warming the kernel's page cache"))?;
        off += n as u64;
    }
    Ok(fd)
}

struct ThreadCtx<'a> {
    t: u32,
    case: Case,
    span: u64,
    seconds: f64,
    seed: u64,
    path: &'a std::path::Path,
    completion: CompletionMode,
    cache: Option<Arc<PageCache>>,
    file: Option<FileId>,
    /// The copy floors' source, one for all threads (as the cache's frames are).
    floor: Option<Arc<aios_core::MappedBytes>>,
    start: &'a Barrier,
    warm_done: &'a Barrier,
}

impl ThreadCtx<'_> {
    fn run(&self) -> Result<ThreadOut, BenchError> {
        // Every thread reaches both barriers, also when its setup failed, so no thread hangs.
        let prepared = self.prepare();
        self.warm_done.wait();
        let prepared = prepared.and_then(|p| {
            self.warm(&p)?;
            Ok(p)
        });
        self.start.wait();
        let mut p = prepared?;
        let cpu0 = sys::thread_cpu_time();
        let t0 = Instant::now();
        let mut out = self.measure(&mut p, t0 + Duration::from_secs_f64(self.seconds))?;
        out.elapsed = t0.elapsed();
        out.cpu = sys::thread_cpu_time() - cpu0;
        if let Prepared::Cache { h, .. } = &p {
            h.publish_metrics();
        }
        Ok(out)
    }

    fn prepare(&self) -> Result<Prepared, BenchError> {
        let bs = self.case.bs as usize;
        Ok(match self.case.reader {
            Reader::Kernel => {
                let fd = sys::open_buffered(self.path, false)
                    .map_err(setup_err(&self.path.display().to_string()))?;
                if !self.case.hot {
                    // The whole range first: the DONTNEED before each read drops only the
                    // folios that lie wholly inside that read's range, and a large folio (a
                    // file's pages as it was written, a sequential read's) would otherwise
                    // survive it and serve the "cold" read from memory.
                    sys::fadvise(fd.as_raw_fd(), 0, 0, Advice::DontNeed)
                        .map_err(setup_err("posix_fadvise(DONTNEED) of the whole range"))?;
                }
                Prepared::Fd {
                    fd,
                    buf: PageAligned::new(bs, 0),
                    engine: None,
                }
            }
            Reader::ODirect => {
                let fd = sys::open_direct(self.path, false)
                    .map_err(setup_err(&self.path.display().to_string()))?;
                let engine = aligned_memory_engine(bs)?;
                Prepared::Fd {
                    fd,
                    buf: PageAligned::new(0, 0),
                    engine: Some(engine),
                }
            }
            Reader::Memcpy | Reader::Copy => Prepared::Mem {
                src: self
                    .floor
                    .clone()
                    .ok_or_else(|| BenchError::Setup("copy floor without its memory".into()))?,
                buf: PageAligned::new(bs, 0),
                ours: self.case.reader == Reader::Copy,
            },
            Reader::Lbio => {
                let (engine, lbio, dev) = thread_stack(self.path, 2 * bs, self.completion, false)?;
                Prepared::Lbio {
                    engine,
                    _lbio: lbio,
                    dev,
                }
            }
            Reader::Cache(_) | Reader::CachePerPage | Reader::CacheZeroCopy => {
                let mode = match self.case.reader {
                    Reader::Cache(m) => m,
                    _ => Mode::AIOS,
                };
                let cache = self.cache.as_ref().expect("cache cases carry a cache");
                let file = self.file.expect("cache cases carry a file");
                let (engine, lbio, dev) =
                    thread_stack(self.path, (2 * bs).max(1 << 20), self.completion, false)?;
                // Cold runs pair every miss with a raw lbio read of another block on the same
                // engine, so the two are compared under the same conditions.
                let paired = if self.case.hot {
                    None
                } else {
                    let raw = Device::open(&lbio, self.path, device_config())?;
                    let b = engine.alloc_blocking(bs)?;
                    Some(RefCell::new((raw, Some(b))))
                };
                let h = CacheHandle::new(cache, &engine, &lbio, mode)
                    .map_err(|e| BenchError::Setup(format!("cache handle: {e}")))?;
                h.attach(file, dev)
                    .map_err(|e| BenchError::Setup(format!("attaching the device: {e}")))?;
                // One cold read in SUBMIT_SAMPLE times its submission: the two clock reads
                // it takes would otherwise be in every read's latency (raw lbio takes none).
                h.time_submissions(if self.case.hot { 0 } else { SUBMIT_SAMPLE });
                Prepared::Cache {
                    h: Box::new(h),
                    file,
                    buf: PageAligned::new(bs, 0),
                    paired,
                    _engine: engine,
                    _lbio: lbio,
                }
            }
        })
    }

    /// Hot runs: thread 0 brings the hot set into the cache under test.
    fn warm(&self, p: &Prepared) -> Result<(), BenchError> {
        if !self.case.hot || self.t != 0 {
            return Ok(());
        }
        if let Prepared::Cache { h, file, .. } = p {
            let mut buf = vec![0u8; 32 * PAGE_BYTES];
            let mut off = 0;
            while off < self.span {
                let n = (self.span - off).min(buf.len() as u64) as usize;
                h.read(*file, off, &mut buf[..n])
                    .map_err(|e| BenchError::Setup(format!("warming the cache: {e}")))?;
                off += n as u64;
            }
        }
        Ok(())
    }

    fn measure(&self, p: &mut Prepared, deadline: Instant) -> Result<ThreadOut, BenchError> {
        if self.case.hot {
            self.measure_hits(p, deadline)
        } else {
            self.measure_cold(p, deadline)
        }
    }

    fn measure_cold(&self, p: &mut Prepared, deadline: Instant) -> Result<ThreadOut, BenchError> {
        let bs = self.case.bs as u64;
        let blocks = self.span / bs;
        let perm = Permutation::new(blocks, self.seed);
        let threads = self.case.threads as u64;
        let mut out = ThreadOut::new();
        let mut i = self.t as u64;
        let mut lbio_buf = match p {
            Prepared::Lbio { engine, .. } => Some(engine.alloc_blocking(bs as usize)?),
            _ => None,
        };
        let mut odirect_buf = match p {
            Prepared::Fd {
                engine: Some(e), ..
            } => Some(e.alloc_blocking(bs as usize)?),
            _ => None,
        };
        let p = &mut *p;
        // Each thread takes every `threads`-th block of the permutation: no block is read twice.
        while i < blocks {
            let off = perm.at(i) * bs;
            i += threads;
            let lat = match p {
                Prepared::Mem { .. } => {
                    return Err(BenchError::Invalid(
                        "the copy floors have no cold workload".into(),
                    ))
                }
                Prepared::Fd { fd, buf, engine } => {
                    let fd = fd.as_raw_fd();
                    if engine.is_none() {
                        sys::fadvise(fd, off, bs, Advice::DontNeed)
                            .map_err(setup_err("posix_fadvise(DONTNEED)"))?;
                    }
                    let t = Instant::now();
                    let r = match odirect_buf.as_mut() {
                        Some(b) => sys::pread_into(fd, &mut b[..], off),
                        None => sys::pread_into(fd, buf, off),
                    };
                    let ns = t.elapsed();
                    r.map_err(setup_err("pread"))?;
                    ns
                }
                Prepared::Lbio { dev, .. } => {
                    let b = lbio_buf.take().expect("one buffer, returned by each read");
                    let t = Instant::now();
                    let b = dev.read_at_blocking(off, b)?;
                    let ns = t.elapsed();
                    lbio_buf = Some(b);
                    ns
                }
                Prepared::Cache {
                    h,
                    file,
                    buf,
                    paired,
                    ..
                } => {
                    // The paired raw read: the block `blocks / 2` further on in the
                    // permutation's order, which the cache never reads in this run's time. It
                    // goes before the cache's read on odd reads and after it on even ones. Always
                    // after it, the raw reads' median was 7 µs against the cache's 18.5 µs in
                    // four of five rounds of one run on `ull` (2026-11-27; cause not traced);
                    // alternating, the two medians came within 0.1–0.5 µs.
                    let poff = perm.at((i - threads + blocks / 2) % blocks) * bs;
                    let raw_first = out.ops % 2 == 1;
                    if raw_first {
                        paired_read(paired, poff, &mut out)?;
                    }
                    let t = Instant::now();
                    let r = if self.case.reader == Reader::CacheZeroCopy {
                        h.get(*file, off / PAGE_BYTES as u64).map(drop)
                    } else {
                        h.read(*file, off, buf)
                    };
                    let ns = t.elapsed();
                    r.map_err(|e| BenchError::Setup(format!("page cache read at {off}: {e}")))?;
                    if let Some(s) = h.take_submit_ns() {
                        out.submit.saturating_record(s.max(1));
                    }
                    if !raw_first {
                        paired_read(paired, poff, &mut out)?;
                    }
                    ns
                }
            };
            out.hist.saturating_record((lat.as_nanos() as u64).max(1));
            out.ops += 1;
            if out.ops % 16 == 0 && Instant::now() >= deadline {
                break;
            }
        }
        Ok(out)
    }

    fn measure_hits(&self, p: &mut Prepared, deadline: Instant) -> Result<ThreadOut, BenchError> {
        let pages = self.span / PAGE_BYTES as u64;
        let mut out = ThreadOut::new();
        let mut x = self.seed ^ (0x1234_5678_9abc_def1 + self.t as u64 * 0x1000_0000_0001);
        let mut sink = 0u8;
        let mut buf = PageAligned::new(PAGE_BYTES, 0);
        loop {
            let t = Instant::now();
            if t >= deadline {
                break;
            }
            for _ in 0..HIT_BATCH {
                let page = xorshift(&mut x) % pages;
                let off = page * PAGE_BYTES as u64;
                match p {
                    Prepared::Fd { fd, .. } => {
                        sys::pread_into(fd.as_raw_fd(), &mut buf, off)
                            .map_err(setup_err("pread"))?;
                        sink ^= buf[0];
                    }
                    Prepared::Cache { h, file, .. } => {
                        if self.case.reader == Reader::CacheZeroCopy {
                            let g = h.get(*file, page).map_err(|e| {
                                BenchError::Setup(format!("page cache get {page}: {e}"))
                            })?;
                            sink ^= g[0];
                        } else {
                            h.read(*file, off, &mut buf).map_err(|e| {
                                BenchError::Setup(format!("page cache read at {off}: {e}"))
                            })?;
                            sink ^= buf[0];
                        }
                    }
                    Prepared::Mem { src, buf, ours } => {
                        let at = off as usize;
                        if *ours {
                            aios_core::copy::copy(buf, &src[at..at + PAGE_BYTES]);
                        } else {
                            buf.copy_from_slice(&src[at..at + PAGE_BYTES]);
                        }
                        sink ^= buf[0];
                    }
                    Prepared::Lbio { .. } => {
                        return Err(BenchError::Invalid("lbio has no hit workload".into()))
                    }
                }
            }
            let per = t.elapsed().as_nanos() as u64 / HIT_BATCH;
            out.hist.saturating_record_n(per.max(1), HIT_BATCH);
            out.ops += HIT_BATCH;
        }
        std::hint::black_box(sink);
        Ok(out)
    }
}

enum Prepared {
    /// The copy floors: the hot set (mapped as the frames are) and a destination page; `ours`:
    /// through `aios_core::copy` rather than `memcpy`.
    Mem {
        src: Arc<aios_core::MappedBytes>,
        buf: PageAligned,
        ours: bool,
    },
    Fd {
        fd: std::os::fd::OwnedFd,
        buf: PageAligned,
        /// O_DIRECT: the engine whose arena gives aligned memory.
        engine: Option<Rc<Engine>>,
    },
    Lbio {
        engine: Rc<Engine>,
        _lbio: Rc<LbioArray>,
        dev: Device,
    },
    Cache {
        h: Box<CacheHandle>,
        file: FileId,
        buf: PageAligned,
        /// Cold runs: a second device on the same lbio array and a buffer for the paired raw
        /// lbio reads.
        paired: Option<RefCell<(Device, Option<aios_core::FixedBuf>)>>,
        _engine: Rc<Engine>,
        _lbio: Rc<LbioArray>,
    },
}

/// Ratios within one round: against the kernel's cold read and raw lbio (same bs and threads),
/// the kernel's hot read (same threads), and one thread (same reader and bs).
fn fill_ratios(round: &mut [PcSample]) {
    let find = |v: &[PcSample], pred: &dyn Fn(&Case) -> bool| -> Option<PcSample> {
        v.iter().find(|s| s.case.is_some_and(|c| pred(&c))).cloned()
    };
    let snapshot = round.to_vec();
    for s in round.iter_mut() {
        let Some(c) = s.case else { continue };
        if !c.hot {
            if let Some(k) = find(&snapshot, &|o| {
                !o.hot && o.reader == Reader::Kernel && o.bs == c.bs && o.threads == c.threads
            }) {
                if k.lat_us_mean > 0.0 {
                    s.ratio_vs_kernel_cold = Some(s.lat_us_mean / k.lat_us_mean);
                }
            }
            if s.paired_lbio_us_mean.is_none() {
                if let Some(l) = find(&snapshot, &|o| {
                    !o.hot && o.reader == Reader::Lbio && o.bs == c.bs && o.threads == c.threads
                }) {
                    s.delta_us_vs_lbio = Some(s.lat_us_mean - l.lat_us_mean);
                }
            }
        } else if let Some(k) = find(&snapshot, &|o| {
            o.hot
                && o.reader == Reader::Kernel
                && o.threads == c.threads
                && o.hot_bytes == c.hot_bytes
        }) {
            if k.iops > 0.0 {
                s.iops_ratio_vs_kernel_hot = Some(s.iops / k.iops);
            }
        }
        if c.threads > 1 {
            if let Some(one) = find(&snapshot, &|o| {
                o.hot == c.hot
                    && o.hot_bytes == c.hot_bytes
                    && o.reader == c.reader
                    && o.bs == c.bs
                    && o.threads == 1
            }) {
                if one.iops > 0.0 {
                    s.scaling_vs_one_thread = Some(s.iops / one.iops);
                }
            }
        }
    }
}

fn order_key(cases: &[Case], s: &PcSample) -> usize {
    s.case
        .and_then(|c| cases.iter().position(|x| *x == c))
        .unwrap_or(usize::MAX)
}

/// Per case, the median of every figure over the rounds (ratios: the median of the per-round
/// ratios); the CDFs are the median round's (by mean latency).
fn medians(cases: &[Case], all: &[PcSample]) -> Vec<PcSample> {
    let mut out = Vec::new();
    for c in cases {
        let runs: Vec<&PcSample> = all.iter().filter(|s| s.case == Some(*c)).collect();
        if runs.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&PcSample) -> f64| median(runs.iter().map(|s| f(s)).collect());
        let med_opt = |f: &dyn Fn(&PcSample) -> Option<f64>| {
            median(runs.iter().filter_map(|s| f(s)).collect())
        };
        let mut by_lat: Vec<&&PcSample> = runs.iter().collect();
        by_lat.sort_by(|a, b| a.lat_us_mean.total_cmp(&b.lat_us_mean));
        let mid = by_lat[by_lat.len() / 2];
        let mut m = (*mid).clone();
        m.round = None;
        m.iops = med(&|s| s.iops).unwrap_or(0.0);
        m.lat_us_mean = med(&|s| s.lat_us_mean).unwrap_or(0.0);
        m.lat_us_p50 = med(&|s| s.lat_us_p50).unwrap_or(0.0);
        m.lat_us_p99 = med(&|s| s.lat_us_p99).unwrap_or(0.0);
        m.lat_us_p999 = med(&|s| s.lat_us_p999).unwrap_or(0.0);
        m.cpu_s = med(&|s| s.cpu_s).unwrap_or(0.0);
        m.iops_per_cpu_s = med(&|s| s.iops_per_cpu_s).unwrap_or(0.0);
        m.seconds = med(&|s| s.seconds).unwrap_or(0.0);
        m.submit_us_p50 = med_opt(&|s| s.submit_us_p50);
        m.submit_us_mean = med_opt(&|s| s.submit_us_mean);
        m.ratio_vs_kernel_cold = med_opt(&|s| s.ratio_vs_kernel_cold);
        m.delta_us_vs_lbio = med_opt(&|s| s.delta_us_vs_lbio);
        m.delta_us_vs_lbio_p50 = med_opt(&|s| s.delta_us_vs_lbio_p50);
        m.paired_lbio_us_mean = med_opt(&|s| s.paired_lbio_us_mean);
        m.iops_ratio_vs_kernel_hot = med_opt(&|s| s.iops_ratio_vs_kernel_hot);
        m.scaling_vs_one_thread = med_opt(&|s| s.scaling_vs_one_thread);
        out.push(m);
    }
    out
}

/// The table header.
pub fn print_header(out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>5} {:<14} {:<14} {:>5} {:>5} {:>3} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9} {:>8} {:>9} {:>8} {:>8}",
        "round",
        "workload",
        "mode",
        "bs",
        "hot",
        "thr",
        "IOPS",
        "mean us",
        "p50 us",
        "p99 us",
        "IOPS/cpu-s",
        "submit us",
        "/k-cold",
        "-lbio us",
        "/k-hot",
        "/1 thr"
    )
}

/// One table row.
pub fn print_row(out: &mut impl std::io::Write, s: &PcSample) -> std::io::Result<()> {
    let round = s.round.map_or("med".to_string(), |r| r.to_string());
    let x = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
    let f = |r: Option<f64>, p: usize| r.map(|r| format!("{r:.p$}")).unwrap_or_default();
    writeln!(
        out,
        "{:>5} {:<14} {:<14} {:>5} {:>5} {:>3} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>10.0} {:>9} {:>8} {:>9} {:>8} {:>8}",
        round,
        s.workload,
        s.mode,
        s.bs,
        s.hot_set.as_deref().unwrap_or(""),
        s.threads,
        s.iops,
        s.lat_us_mean,
        s.lat_us_p50,
        s.lat_us_p99,
        s.iops_per_cpu_s,
        f(s.submit_us_p50, 3),
        x(s.ratio_vs_kernel_cold),
        f(s.delta_us_vs_lbio, 2),
        x(s.iops_ratio_vs_kernel_hot),
        x(s.scaling_vs_one_thread)
    )
}

/// The samples (median runs) to plot as CDFs: `submit` picks the submission-latency CDF of
/// page-cache cold reads of `bs`, else the read-latency CDF of every cold reader of `bs`.
pub fn cdf_series(
    meds: &[PcSample],
    bs: u32,
    threads: u32,
    submit: bool,
) -> Vec<crate::bench::Sample> {
    meds.iter()
        .filter(|s| {
            s.case
                .is_some_and(|c| !c.hot && c.bs == bs && c.threads == threads)
        })
        .filter(|s| !submit || !s.submit_cdf.is_empty())
        .map(|s| {
            let (cdf, mean) = if submit {
                (s.submit_cdf.clone(), s.submit_us_mean.unwrap_or(0.0))
            } else {
                (s.cdf.clone(), s.lat_us_mean)
            };
            let q = |p: f64| {
                cdf.iter()
                    .find(|(qq, _)| *qq >= p)
                    .map_or(0.0, |&(_, us)| us)
            };
            crate::bench::Sample {
                engine: s.mode.clone(),
                lat_us_mean: mean,
                lat_us_p99: q(0.99),
                lat_us_p999: q(0.999),
                cdf,
                ..crate::bench::Sample::default()
            }
        })
        .collect()
}
