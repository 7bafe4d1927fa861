//! `aios bench ordered`: 4 KiB ordered writes — Rio's ordered device, against synchronous
//! ordering (each write waited for and FLUSHed before the next, as Linux orders writes) and
//! against orderless writes (no ordering at all: the ceiling).
//!
//! Each stream is a thread with its own engine and device handle. `rio` keeps `qd` writes in
//! flight per stream, each its own group (so every write is ordered after the one before), with
//! an ORDER queue of `batch` groups (merging contiguous ones); the run ends with `wait` (every
//! write durable). On `sim` (a SimDisk without power-loss protection, device time modelled
//! with parallel units and a costly FLUSH) throughput is measured in simulated device time.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use std::collections::VecDeque;

use aios_core::{CompletionMode, Engine, EngineConfig, FixedBuf, ProbeOptions};
use hdrhistogram::Histogram;
use lbio::{Device, DeviceConfig, Io, LbioArray, LbioConfig, RouteChoice, SimConfig, SimDisk};
use rio_ordering::{AttrLog, BlockPmr, MemPmr, OrderedConfig, OrderedDevice, Pmr, Write};
use serde::Serialize;

use crate::bench::compare::Progress;
use crate::bench::{
    arena_within_memlock, median, new_histogram, quantile_us, run_threads_split, xorshift,
    BenchError,
};

const BS: usize = 4096;
/// Rio's PMR is 2 MiB per target (§5); the emulated one is the same size.
const PMR_BYTES: usize = 2 << 20;
/// A block log per stream, at the end of the device (outside every stream's data region).
const BLOCK_LOG_BYTES: u64 = 1 << 20;

/// Where Rio keeps its attribute log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogKind {
    /// Persistent memory, emulated in RAM (what a device with a PMR offers).
    Pmr,
    /// Blocks on the target device itself (hardware without a PMR): written with FUA ahead of
    /// each batch's data, the thread waiting for each write (`pwrite` with `RWF_DSYNC`).
    Block,
    /// The same blocks written asynchronously on the ordered device's own ring: a batch's data
    /// goes out from its log write's completion, and the writes submitted meanwhile share the
    /// next log write.
    #[value(name = "block-async")]
    #[serde(rename = "block-async")]
    BlockAsync,
}

impl LogKind {
    pub fn name(self) -> &'static str {
        match self {
            LogKind::Pmr => "pmr",
            LogKind::Block => "block",
            LogKind::BlockAsync => "block-async",
        }
    }
}

/// What orders the writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OrderedMode {
    /// Rio's ordered device.
    Rio,
    /// Write, wait, FLUSH, wait, then the next write.
    Sync,
    /// Plain asynchronous writes, no ordering.
    Orderless,
}

impl OrderedMode {
    pub fn name(self) -> &'static str {
        match self {
            OrderedMode::Rio => "rio",
            OrderedMode::Sync => "sync",
            OrderedMode::Orderless => "orderless",
        }
    }
}

/// Where the writes go.
#[derive(Clone, Debug)]
pub enum OrderedTarget {
    /// A block device or file (the `ull` loop device, or one the user named).
    Path(PathBuf),
    /// A SimDisk per stream, no power-loss protection.
    Sim,
}

/// One measured run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OrderedSample {
    pub mode: String,
    /// Rio's attribute log: `pmr` (emulated persistent memory) or `block` (on the device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
    pub streams: u32,
    pub batch: u32,
    pub iops: f64,
    /// Per write, from submission to its (in-order) completion; sync: write + FLUSH.
    pub lat_us_mean: f64,
    pub lat_us_p99: f64,
    /// Block log: syncs (attribute-block writes ahead of a batch's data) and their mean time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_syncs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_sync_us_mean: Option<f64>,
    pub iops_per_cpu_s: f64,
    /// Data commands sent to the device (merging makes fewer than writes).
    pub device_cmds: u64,
    pub flushes: u64,
    pub writes: u64,
    /// `io_uring_enter` calls per write, and waits that slept in the kernel per write.
    pub enters_per_write: f64,
    pub sleeps_per_write: f64,
    pub seconds: f64,
    pub cpu_s: f64,
    /// `cpu_s` split: user space and the kernel (the kernel's share includes what the block
    /// layer and io_uring do for the process, and interrupts that arrive while it runs). The
    /// split comes from the kernel's tick sampling: a guide to where the time goes, not as
    /// exact as `cpu_s`.
    pub cpu_user_s: f64,
    pub cpu_sys_s: f64,
    /// Each per write, in µs.
    pub user_us_per_write: f64,
    pub sys_us_per_write: f64,
    /// Whose clock `seconds` is: `wall` or `simulated`.
    pub clock: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    pub device: String,
    /// IOPS ÷ orderless IOPS (same round, streams).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_orderless: Option<f64>,
    /// IOPS per CPU-second ÷ orderless's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_eff_vs_orderless: Option<f64>,
    /// IOPS ÷ synchronous ordering's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_sync: Option<f64>,
}

/// The benchmark.
#[derive(Clone, Debug)]
pub struct OrderedBench {
    pub target: OrderedTarget,
    pub device_name: String,
    pub modes: Vec<OrderedMode>,
    pub streams: Vec<u32>,
    /// ORDER-queue batch sizes (rio only; the other modes run once per stream count).
    pub batches: Vec<u32>,
    /// Attribute logs to run rio with.
    pub logs: Vec<LogKind>,
    pub qd: u32,
    /// Sequential writes (each stream in its own region) instead of random ones.
    pub sequential: bool,
    /// Wall seconds per run (device paths).
    pub seconds: f64,
    /// Writes per stream per run (sim).
    pub sim_writes: u64,
    pub rounds: u32,
    /// Rio's background FLUSH after this many completed writes
    /// ([`OrderedConfig::flush_ahead`]; 0: none).
    pub flush_ahead: usize,
}

struct Run {
    lat: Histogram<u64>,
    log_syncs: u64,
    log_sync_ns: u64,
    enters: u64,
    sleeps: u64,
    writes: u64,
    device_cmds: u64,
    flushes: u64,
    /// Simulated ns (sim) — the longest stream's.
    sim_ns: u64,
}

/// Offsets for one stream: its own region of `region` bytes from `base`.
struct Offsets {
    base: u64,
    blocks: u64,
    next: u64,
    x: u64,
    sequential: bool,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        let b = if self.sequential {
            let b = self.next;
            self.next = (self.next + 1) % self.blocks;
            b
        } else {
            xorshift(&mut self.x) % self.blocks
        };
        self.base + b * BS as u64
    }
}

/// One run: mode, streams, batch, and rio's log.
pub type Case = (OrderedMode, u32, u32, Option<LogKind>);

fn case_matches(c: &Case, x: &OrderedSample) -> bool {
    c.0.name() == x.mode
        && c.1 == x.streams
        && c.2 == x.batch
        && c.3.map(|l| l.name().to_string()) == x.log
}

impl OrderedBench {
    /// Every run of one round.
    pub fn cases(&self) -> Vec<Case> {
        let mut v = Vec::new();
        for &s in &self.streams {
            for &m in &self.modes {
                if m == OrderedMode::Rio {
                    for &l in &self.logs {
                        for &b in &self.batches {
                            v.push((m, s, b, Some(l)));
                        }
                    }
                } else {
                    v.push((m, s, 1, None));
                }
            }
        }
        v
    }

    pub fn validate(&self) -> Result<(), BenchError> {
        if self.streams.is_empty() || self.streams.contains(&0) {
            return Err(BenchError::Invalid("--streams needs counts >= 1".into()));
        }
        if self.batches.is_empty() || self.batches.contains(&0) {
            return Err(BenchError::Invalid("--batch needs sizes >= 1".into()));
        }
        if self.logs.is_empty() {
            return Err(BenchError::Invalid("--log needs pmr, block or both".into()));
        }
        if matches!(self.target, OrderedTarget::Sim)
            && self.modes.contains(&OrderedMode::Rio)
            && (self.logs.contains(&LogKind::Block) || self.logs.contains(&LogKind::BlockAsync))
        {
            return Err(BenchError::Invalid(
                "--log block keeps the log on the device's blocks: it needs a device path, not sim"
                    .into(),
            ));
        }
        if self.qd == 0 || self.qd > 512 {
            return Err(BenchError::Invalid(format!(
                "--qd {} must be 1..=512",
                self.qd
            )));
        }
        crate::bench::check_seconds(self.seconds)?;
        Ok(())
    }

    /// All rounds; `emit` sees each sample when its round is complete. Returns all samples and
    /// the medians.
    pub fn run(
        &self,
        progress: &Progress,
        emit: &mut dyn FnMut(&OrderedSample),
    ) -> Result<(Vec<OrderedSample>, Vec<OrderedSample>), BenchError> {
        self.validate()?;
        let cases = self.cases();
        let mut all = Vec::new();
        for round in 0..self.rounds.max(1) {
            let mut order = cases.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            let mut this = Vec::new();
            for (i, &(m, s, b, l)) in order.iter().enumerate() {
                progress.step(&format!(
                    "ordered round {}/{} run {}/{}: {}{} x{s} stream(s) batch {b}",
                    round + 1,
                    self.rounds.max(1),
                    i + 1,
                    order.len(),
                    m.name(),
                    l.map_or(String::new(), |l| format!(" ({} log)", l.name()))
                ));
                let mut smp = self.run_case(m, s, b, l)?;
                smp.round = Some(round + 1);
                this.push(smp);
            }
            progress.done();
            fill_ratios(&mut this);
            this.sort_by_key(|x| cases.iter().position(|c| case_matches(c, x)));
            for x in &this {
                emit(x);
            }
            all.extend(this);
        }
        let meds = medians(&cases, &all, &self.device_name);
        Ok((all, meds))
    }

    fn run_case(
        &self,
        mode: OrderedMode,
        streams: u32,
        batch: u32,
        log: Option<LogKind>,
    ) -> Result<OrderedSample, BenchError> {
        let sim = matches!(self.target, OrderedTarget::Sim);
        let (runs, elapsed, cpu_user, cpu_sys) = run_threads_split(streams, |t, barrier| {
            self.stream_thread(
                mode,
                t,
                streams,
                batch,
                log.unwrap_or(LogKind::Pmr),
                barrier,
            )
        });
        let mut lat = new_histogram();
        let (mut log_syncs, mut log_sync_ns) = (0, 0);
        let mut writes = 0;
        let mut cmds = 0;
        let mut flushes = 0;
        let mut sim_ns = 0;
        let (mut enters, mut sleeps) = (0, 0);
        for r in runs {
            let r = r?;
            lat.add(&r.lat)
                .map_err(|e| BenchError::Setup(format!("latency histogram: {e}")))?;
            log_syncs += r.log_syncs;
            log_sync_ns += r.log_sync_ns;
            enters += r.enters;
            sleeps += r.sleeps;
            writes += r.writes;
            cmds += r.device_cmds;
            flushes += r.flushes;
            sim_ns = sim_ns.max(r.sim_ns);
        }
        let seconds = if sim { sim_ns as f64 / 1e9 } else { elapsed };
        let cpu = cpu_user + cpu_sys;
        let per_write = |s: f64| s * 1e6 / writes.max(1) as f64;
        let block =
            matches!(log, Some(LogKind::Block | LogKind::BlockAsync)) && mode == OrderedMode::Rio;
        Ok(OrderedSample {
            mode: mode.name().into(),
            log: log.map(|l| l.name().into()),
            streams,
            batch,
            iops: writes as f64 / seconds.max(1e-9),
            lat_us_mean: lat.mean() / 1000.0,
            lat_us_p99: quantile_us(&lat, 0.99),
            log_syncs: block.then_some(log_syncs),
            log_sync_us_mean: block.then(|| log_sync_ns as f64 / 1000.0 / log_syncs.max(1) as f64),
            iops_per_cpu_s: if cpu > 0.0 { writes as f64 / cpu } else { 0.0 },
            device_cmds: cmds,
            flushes,
            writes,
            seconds,
            cpu_s: cpu,
            cpu_user_s: cpu_user,
            cpu_sys_s: cpu_sys,
            user_us_per_write: per_write(cpu_user),
            sys_us_per_write: per_write(cpu_sys),
            clock: if sim { "simulated" } else { "wall" }.into(),
            device: self.device_name.clone(),
            enters_per_write: enters as f64 / writes.max(1) as f64,
            sleeps_per_write: sleeps as f64 / writes.max(1) as f64,
            ..OrderedSample::default()
        })
    }

    fn stream_thread(
        &self,
        mode: OrderedMode,
        t: u32,
        streams: u32,
        batch: u32,
        log: LogKind,
        barrier: &crate::bench::Start<'_>,
    ) -> Result<Run, BenchError> {
        let ready = self.open_stream(streams);
        barrier.wait();
        let (engine, lbio, dev, disk) = ready?;
        let cap = dev.geometry().capacity_bytes;
        // Block logs (one per stream) sit at the end, outside the data regions.
        let logs_at = match &self.target {
            OrderedTarget::Path(_) => cap.saturating_sub(BLOCK_LOG_BYTES * streams as u64),
            OrderedTarget::Sim => cap,
        };
        let region = (logs_at / streams as u64) / BS as u64 * BS as u64;
        let mut offs = Offsets {
            base: t as u64 * region,
            blocks: (region / BS as u64).max(1),
            next: 0,
            x: 0x9e37_79b9_7f4a_7c15 ^ (t as u64 + 1),
            sequential: self.sequential,
        };
        let budget = Budget {
            deadline: Instant::now() + Duration::from_secs_f64(self.seconds),
            writes: disk.as_ref().map(|_| self.sim_writes),
            clock: match &disk {
                Some(d) => Clock::Sim(d.clone()),
                None => Clock::Wall(Instant::now()),
            },
        };
        let mut run = match (mode, log, &self.target) {
            (OrderedMode::Rio, LogKind::Block | LogKind::BlockAsync, OrderedTarget::Path(p)) => {
                let at = logs_at + t as u64 * BLOCK_LOG_BYTES;
                let region = if log == LogKind::Block {
                    BlockPmr::open(&engine, p, at, BLOCK_LOG_BYTES as usize)
                } else {
                    // The log's own handle on the ordered device's array: its writes complete
                    // there, and the ordered device sends each batch's data from them.
                    let cfg = DeviceConfig {
                        write: true,
                        route: RouteChoice::Ring,
                        ..DeviceConfig::default()
                    };
                    BlockPmr::on_device(Device::open(&lbio, p, cfg)?, at, BLOCK_LOG_BYTES as usize)
                }
                .map_err(|e| BenchError::Setup(format!("block log: {e}")))?;
                run_rio(
                    &engine,
                    lbio,
                    dev,
                    region,
                    &mut offs,
                    self.qd,
                    batch,
                    self.flush_ahead,
                    &budget,
                )?
            }
            (OrderedMode::Rio, ..) => run_rio(
                &engine,
                lbio,
                dev,
                MemPmr::new(PMR_BYTES),
                &mut offs,
                self.qd,
                batch,
                self.flush_ahead,
                &budget,
            )?,
            (OrderedMode::Sync, ..) => run_sync(&engine, &dev, &mut offs, &budget)?,
            (OrderedMode::Orderless, ..) => {
                run_orderless(&engine, &lbio, &dev, &mut offs, self.qd, &budget)?
            }
        };
        run.sim_ns = disk.map_or(0, |d| d.sim_time_ns());
        let m = engine.metrics();
        run.enters = m.enters;
        run.sleeps = m.sleeps;
        Ok(run)
    }

    #[allow(clippy::type_complexity)]
    fn open_stream(
        &self,
        streams: u32,
    ) -> Result<(Rc<Engine>, Rc<LbioArray>, Device, Option<SimDisk>), BenchError> {
        let engine = Engine::new(EngineConfig {
            arena_bytes: arena_within_memlock(16 << 20, streams),
            ring_entries: 1024,
            huge_pages: false,
            ..EngineConfig::default()
        })?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
        engine.set_completion_mode(if streams < cores {
            CompletionMode::BusyPoll
        } else {
            CompletionMode::Wait
        });
        let lbio = LbioArray::new(
            Rc::clone(&engine),
            LbioConfig {
                slots: 1024,
                ..LbioConfig::default()
            },
        )?;
        match &self.target {
            OrderedTarget::Path(p) => {
                let dev = Device::open(
                    &lbio,
                    p,
                    DeviceConfig {
                        write: true,
                        route: RouteChoice::Auto,
                        probe: ProbeOptions {
                            latency_samples: 50,
                            try_iopoll: false,
                        },
                        ..DeviceConfig::default()
                    },
                )?;
                Ok((engine, lbio, dev, None))
            }
            OrderedTarget::Sim => {
                let disk = SimDisk::new(SimConfig::new(64 << 20, 0x5eed))?;
                let dev = disk.open(&lbio)?;
                Ok((engine, lbio, dev, Some(disk)))
            }
        }
    }
}

struct Budget {
    deadline: Instant,
    /// Sim: a fixed number of writes instead of a deadline.
    writes: Option<u64>,
    /// The clock latencies are read on.
    clock: Clock,
}

/// The clock of a run's latencies: the wall clock on a device; on `sim` the SimDisk's
/// simulated clock, the one its IOPS are counted in (the wall time of a simulated write is the
/// simulator's CPU time, not the device's).
enum Clock {
    Wall(Instant),
    Sim(SimDisk),
}

impl Budget {
    fn more(&self, done: u64) -> bool {
        match self.writes {
            Some(n) => done < n,
            None => Instant::now() < self.deadline,
        }
    }

    /// Nanoseconds on the run's clock.
    fn now_ns(&self) -> u64 {
        match &self.clock {
            Clock::Wall(t0) => t0.elapsed().as_nanos() as u64,
            Clock::Sim(d) => d.sim_time_ns(),
        }
    }

    /// Record the time from `since` (a [`Budget::now_ns`]) to now.
    fn record_since(&self, h: &mut hdrhistogram::Histogram<u64>, since: u64) {
        h.saturating_record(self.now_ns().saturating_sub(since).max(1));
    }
}

fn fill(engine: &Engine, n: usize) -> Result<Vec<FixedBuf>, BenchError> {
    (0..n)
        .map(|i| {
            let mut b = engine.alloc_blocking(BS)?;
            b.fill(i as u8 | 1);
            Ok(b)
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn run_rio<P: Pmr>(
    engine: &Rc<Engine>,
    lbio: Rc<LbioArray>,
    dev: Device,
    region: P,
    offs: &mut Offsets,
    qd: u32,
    batch: u32,
    flush_ahead: usize,
    budget: &Budget,
) -> Result<Run, BenchError> {
    let rio = |e: rio_ordering::RioError| BenchError::Setup(format!("rio: {e}"));
    let log = AttrLog::format(region, 1).map_err(rio)?;
    let mut lat = new_histogram();
    // Submission times of the writes not yet completed, oldest first (completions come back
    // in submission order).
    let mut started: VecDeque<u64> = VecDeque::with_capacity(qd as usize + 8);
    let mut od = OrderedDevice::new(
        lbio,
        vec![dev],
        log,
        &[1],
        OrderedConfig {
            batch: batch as usize,
            merge: true,
            flush_ahead,
            ..OrderedConfig::default()
        },
    )
    .map_err(rio)?;
    // Buffers for the queue depth, for the batch the ORDER queue fills while those are out (so
    // that a batch of 32 has the next batch to form while one merged command is on the
    // device), and a few more: commands that finished on the device wait for the older ones
    // before their buffers come back in order, and the device stays busy meanwhile (more than
    // a few only spreads the copies over more cache).
    let mut free = fill(engine, qd as usize + batch as usize + 8)?;
    let mut got: Vec<rio_ordering::Done> = Vec::with_capacity(qd as usize + 8);
    let mut issued = 0u64;
    let mut done = 0u64;
    loop {
        while budget.more(issued) && od.in_flight() < qd as usize {
            let Some(buf) = free.pop() else { break };
            od.submit(
                0,
                Write {
                    target: 0,
                    offset: offs.next(),
                    buf,
                    ipu: false,
                },
                true,
            )
            .map_err(rio)?;
            started.push_back(budget.now_ns());
            issued += 1;
        }
        if done == issued {
            break;
        }
        // Everything queued goes out before waiting (the unplug).
        od.flush_queue(0).map_err(rio)?;
        od.wait_progress_into(&mut got).map_err(rio)?;
        for d in got.drain(..) {
            d.result
                .map_err(|e| BenchError::Setup(format!("rio write: {e}")))?;
            budget.record_since(
                &mut lat,
                started.pop_front().expect("a submission per completion"),
            );
            free.push(d.buf);
            done += 1;
        }
    }
    od.wait(0).map_err(rio)?;
    let st = od.stats();
    Ok(Run {
        lat,
        log_syncs: st.log_syncs,
        log_sync_ns: st.log_sync_ns,
        writes: done,
        device_cmds: st.device_cmds,
        flushes: st.flushes,
        sim_ns: 0,
        enters: 0,
        sleeps: 0,
    })
}

fn run_sync(
    engine: &Engine,
    dev: &Device,
    offs: &mut Offsets,
    budget: &Budget,
) -> Result<Run, BenchError> {
    let mut buf = Some(fill(engine, 1)?.pop().expect("one"));
    let mut n = 0u64;
    let mut lat = new_histogram();
    while budget.more(n) {
        let t = budget.now_ns();
        let b = dev.write_at_blocking(offs.next(), buf.take().expect("buffer"), false)?;
        buf = Some(b);
        dev.flush_blocking()?;
        budget.record_since(&mut lat, t);
        n += 1;
    }
    Ok(Run {
        lat,
        log_syncs: 0,
        log_sync_ns: 0,
        writes: n,
        device_cmds: n,
        flushes: n,
        sim_ns: 0,
        enters: 0,
        sleeps: 0,
    })
}

fn run_orderless(
    engine: &Engine,
    lbio: &LbioArray,
    dev: &Device,
    offs: &mut Offsets,
    qd: u32,
    budget: &Budget,
) -> Result<Run, BenchError> {
    let mut free = fill(engine, qd as usize)?;
    let mut issued = 0u64;
    let mut done = 0u64;
    let mut lat = new_histogram();
    // Submission time by lbio tag.
    let mut started: Vec<Option<u64>> = Vec::new();
    loop {
        while budget.more(issued) {
            let Some(buf) = free.pop() else { break };
            let tag = dev
                .submit(Io::write(offs.next(), buf))
                .map_err(|(e, _)| e)?;
            let at = tag.0 as usize;
            if started.len() <= at {
                started.resize(at + 1, None);
            }
            started[at] = Some(budget.now_ns());
            issued += 1;
        }
        if done == issued {
            break;
        }
        lbio.wait_done(1)?;
        while let Some(c) = lbio.take_done() {
            c.result?;
            if let Some(t) = started.get_mut(c.tag.0 as usize).and_then(Option::take) {
                budget.record_since(&mut lat, t);
            }
            free.push(c.buf.expect("writes carry a buffer"));
            done += 1;
        }
    }
    Ok(Run {
        lat,
        log_syncs: 0,
        log_sync_ns: 0,
        writes: done,
        device_cmds: done,
        flushes: 0,
        sim_ns: 0,
        enters: 0,
        sleeps: 0,
    })
}

fn fill_ratios(round: &mut [OrderedSample]) {
    let find = |r: &[OrderedSample], mode: &str, s: u32| {
        r.iter()
            .find(|x| x.mode == mode && x.streams == s)
            .map(|x| (x.iops, x.iops_per_cpu_s))
    };
    for i in 0..round.len() {
        let s = round[i].streams;
        let ol = find(round, "orderless", s);
        let sy = find(round, "sync", s);
        let x = &mut round[i];
        if x.mode != "orderless" {
            x.iops_vs_orderless = ol.map(|(iops, _)| x.iops / iops);
            // On sim the CPU time is mostly the simulator's (see the legend).
            if x.clock != "simulated" {
                x.cpu_eff_vs_orderless = ol.map(|(_, eff)| x.iops_per_cpu_s / eff);
            }
        }
        if x.mode != "sync" {
            x.iops_vs_sync = sy.map(|(iops, _)| x.iops / iops);
        }
    }
}

fn medians(cases: &[Case], all: &[OrderedSample], device: &str) -> Vec<OrderedSample> {
    let mut out = Vec::new();
    for c in cases {
        let &(m, s, b, l) = c;
        let mine: Vec<&OrderedSample> = all.iter().filter(|x| case_matches(c, x)).collect();
        if mine.is_empty() {
            continue;
        }
        let med = |f: &dyn Fn(&OrderedSample) -> f64| {
            median(mine.iter().map(|x| f(x)).collect()).unwrap_or(0.0)
        };
        let med_opt = |f: &dyn Fn(&OrderedSample) -> Option<f64>| {
            median(mine.iter().filter_map(|x| f(x)).collect())
        };
        out.push(OrderedSample {
            mode: m.name().into(),
            log: l.map(|l| l.name().into()),
            streams: s,
            batch: b,
            iops: med(&|x| x.iops),
            lat_us_mean: med(&|x| x.lat_us_mean),
            lat_us_p99: med(&|x| x.lat_us_p99),
            log_syncs: med_opt(&|x| x.log_syncs.map(|n| n as f64)).map(|n| n as u64),
            log_sync_us_mean: med_opt(&|x| x.log_sync_us_mean),
            iops_per_cpu_s: med(&|x| x.iops_per_cpu_s),
            device_cmds: med(&|x| x.device_cmds as f64) as u64,
            flushes: med(&|x| x.flushes as f64) as u64,
            writes: med(&|x| x.writes as f64) as u64,
            enters_per_write: med(&|x| x.enters_per_write),
            sleeps_per_write: med(&|x| x.sleeps_per_write),
            seconds: med(&|x| x.seconds),
            cpu_s: med(&|x| x.cpu_s),
            cpu_user_s: med(&|x| x.cpu_user_s),
            cpu_sys_s: med(&|x| x.cpu_sys_s),
            user_us_per_write: med(&|x| x.user_us_per_write),
            sys_us_per_write: med(&|x| x.sys_us_per_write),
            clock: mine[0].clock.clone(),
            round: None,
            device: device.into(),
            iops_vs_orderless: med_opt(&|x| x.iops_vs_orderless),
            cpu_eff_vs_orderless: med_opt(&|x| x.cpu_eff_vs_orderless),
            iops_vs_sync: med_opt(&|x| x.iops_vs_sync),
        });
    }
    out
}

/// The table header.
pub fn print_header(out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>5} {:<10} {:>4} {:>5} {:>10} {:>11} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "round",
        "mode",
        "strm",
        "batch",
        "IOPS",
        "IOPS/cpu-s",
        "lat us",
        "p99 us",
        "writes",
        "cmds",
        "flushes",
        "/orderless",
        "cpu/orderl",
        "/sync"
    )
}

/// One table row.
pub fn print_row(out: &mut impl std::io::Write, s: &OrderedSample) -> std::io::Result<()> {
    let round = s.round.map_or("med".to_string(), |r| r.to_string());
    let ratio = |r: Option<f64>| r.map(|r| format!("{r:.3}x")).unwrap_or_default();
    writeln!(
        out,
        "{:>5} {:<10} {:>4} {:>5} {:>10.0} {:>11.0} {:>8.1} {:>8.1} {:>9} {:>8} {:>8} {:>9} {:>9} {:>9}",
        round,
        match &s.log {
            Some(l) if l != "pmr" => format!("{}/{l}", s.mode),
            _ => s.mode.clone(),
        },
        s.streams,
        s.batch,
        s.iops,
        s.iops_per_cpu_s,
        s.lat_us_mean,
        s.lat_us_p99,
        s.writes,
        s.device_cmds,
        s.flushes,
        ratio(s.iops_vs_orderless),
        ratio(s.cpu_eff_vs_orderless),
        ratio(s.iops_vs_sync)
    )
}

/// What the columns mean.
pub fn legend() -> &'static str {
    "4 KiB writes, each its own group (ordered after the one before); rio = Rio's ordered device \
     (attribute log on an emulated 2 MiB PMR, ORDER queue of 'batch' groups, merging contiguous \
     ones, wait at the end); sync = write, wait, FLUSH, wait; orderless = plain writes, no \
     ordering. 'cmds' = data commands sent; '/orderless' = IOPS ÷ orderless's; 'cpu/orderl' = \
     IOPS per CPU-second ÷ orderless's; '/sync' = IOPS ÷ sync's (same round and streams; 'med': \
     medians over rounds). 'lat us' = mean µs from submission to in-order completion (sync: \
     write + FLUSH), 'p99 us' its 99th percentile. rio/block = the attribute log in blocks at the \
     end of the device instead of the PMR: one FUA write of the batch's attribute blocks ahead of \
     its data (JSON: log_syncs, log_sync_us_mean — the latency it adds). On sim the clock of IOPS \
     and latencies is the SimDisk's simulated device time, and the CPU time is mostly the \
     simulator's own (it keeps a copy of every write until a FLUSH): 'IOPS/cpu-s' there does not \
     measure the stack, and 'cpu/orderl' is left out."
}
