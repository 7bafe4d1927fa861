//! Side-by-side comparison: lbio and its anchors on the same device, in alternating rounds, with
//! ratios taken within each round and summarised as medians (DESIGN.md "Measuring").

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use aios_core::CompletionMode;
use lbio::{Class, Device};

use crate::bench::fio::{run_fio, FioEngine};
use crate::bench::{median, run_lbio, run_pread, BenchError, LbioRunOptions, Sample, Workload};

/// One side of a comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Contender {
    Lbio,
    Fio(FioEngine),
    /// The project's own `pread` loop (used when fio is not installed).
    Pread,
}

/// What to compare.
pub struct Comparison<'a> {
    pub dev: &'a Device,
    pub path: PathBuf,
    pub span: u64,
    pub workload: Workload,
    pub contenders: Vec<Contender>,
    pub rounds: u32,
    pub class: Class,
    pub completion: CompletionMode,
    /// Plug lbio's submissions into the next wait (see `LbioRunOptions::plug`).
    pub plug: bool,
    /// Idle time before every timed run, every contender's alike (see [`settle`]).
    pub settle: Duration,
}

/// Sleep for `d` before a timed run, so that the run starts from an idle machine rather than
/// on the heels of the work before it (the bench's own setup, the previous contender, a
/// busy-polling calibration sample).
///
/// Why it matters: on the 2-vCPU VM this was built on, where waking the other vCPU costs tens
/// of µs, whether a loop device's worker runs on the reader's vCPU or on the other one appears
/// to depend on how busy the reader's CPU has been lately: the effect fades with idle time as
/// the kernel's load tracking does (a half-life of about 32 ms). A QD1 reader that started
/// right after CPU-heavy work read 4 KiB in 69-75 µs on average for the whole run; the same
/// program after idling 100 ms or more, 12-26 µs (p50 5.2 µs). fio starts each run as a fresh
/// process after its own idle moments, so without a pause the comparison measured lbio's
/// aftermath of its setup against fio's clean start.
pub fn settle(d: Duration) {
    if !d.is_zero() {
        std::thread::sleep(d);
    }
}

/// Progress on stderr: one rewritten line on a terminal, plain lines otherwise.
pub struct Progress {
    tty: bool,
    quiet: bool,
}

impl Progress {
    pub fn new(quiet: bool) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            quiet,
        }
    }
    pub fn step(&self, msg: &str) {
        if self.quiet {
            return;
        }
        let mut e = std::io::stderr();
        if self.tty {
            let _ = write!(e, "\r\x1b[2K{msg}");
        } else {
            let _ = writeln!(e, "{msg}");
        }
        let _ = e.flush();
    }
    pub fn done(&self) {
        if self.tty && !self.quiet {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }
}

fn run_one(c: &Comparison<'_>, who: Contender) -> Result<Sample, BenchError> {
    match who {
        Contender::Lbio => run_lbio(
            c.dev,
            &c.workload,
            LbioRunOptions {
                class: c.class,
                completion: c.completion,
                span: c.span,
                plug: c.plug,
            },
        ),
        Contender::Fio(e) => run_fio(&c.path, c.span, &c.workload, e),
        Contender::Pread => run_pread(&c.path, &c.workload, c.span),
    }
}

/// Run every contender once per round, rotating who goes first; each sample is handed to
/// `emit` as soon as its round is complete (with its ratios). Returns all samples and the
/// per-contender medians.
pub fn run_comparison(
    c: &Comparison<'_>,
    progress: &Progress,
    label: &str,
    emit: &mut dyn FnMut(&Sample),
) -> Result<(Vec<Sample>, Vec<Sample>), BenchError> {
    let n = c.contenders.len();
    let mut all: Vec<Sample> = Vec::new();
    for round in 0..c.rounds {
        let mut this_round: Vec<Sample> = Vec::with_capacity(n);
        for i in 0..n {
            let who = c.contenders[(i + round as usize) % n];
            progress.step(&format!(
                "{label} round {}/{} · {} · {} bs={} qd={} · {}s",
                round + 1,
                c.rounds,
                name(who),
                c.workload.rw.name(),
                c.workload.bs,
                c.workload.qd,
                c.workload.seconds
            ));
            settle(c.settle);
            let mut s = run_one(c, who)?;
            s.round = Some(round + 1);
            s.device = Some(c.path.display().to_string());
            this_round.push(s);
        }
        add_ratios(&mut this_round);
        progress.done();
        for s in &this_round {
            emit(s);
        }
        all.extend(this_round);
    }
    Ok((all.clone(), medians(&all, c)))
}

fn name(c: Contender) -> &'static str {
    match c {
        Contender::Lbio => "lbio",
        Contender::Fio(e) => e.label(),
        Contender::Pread => "pread",
    }
}

/// Ratios of lbio samples against the anchors of the same round.
fn add_ratios(round: &mut [Sample]) {
    let find = |engine: &str| round.iter().find(|s| s.engine == engine).cloned();
    let uring = find("fio-io_uring");
    let psync = find("fio-psync").or_else(|| find("pread"));
    for s in round.iter_mut().filter(|s| s.engine.starts_with("lbio")) {
        if let Some(f) = &uring {
            s.ratio_vs_fio = Some(s.lat_us_mean / f.lat_us_mean);
            s.iops_ratio_vs_fio = Some(s.iops / f.iops);
        }
        if let Some(p) = &psync {
            s.ratio_vs_fio_psync = Some(s.lat_us_mean / p.lat_us_mean);
        }
    }
}

/// Per-engine medians over the rounds (round = None marks a median line).
fn medians(all: &[Sample], c: &Comparison<'_>) -> Vec<Sample> {
    let mut engines: Vec<String> = Vec::new();
    for s in all {
        if !engines.contains(&s.engine) {
            engines.push(s.engine.clone());
        }
    }
    engines
        .iter()
        .filter_map(|e| {
            let of: Vec<&Sample> = all.iter().filter(|s| &s.engine == e).collect();
            let m = |f: &dyn Fn(&Sample) -> f64| median(of.iter().map(|s| f(s)).collect());
            let mo = |f: &dyn Fn(&Sample) -> Option<f64>| {
                let v: Vec<f64> = of.iter().filter_map(|s| f(s)).collect();
                median(v)
            };
            let first = of.first()?;
            Some(Sample {
                workload: first.workload.clone(),
                engine: e.clone(),
                bs: first.bs,
                qd: first.qd,
                iops: m(&|s| s.iops)?,
                lat_us_mean: m(&|s| s.lat_us_mean)?,
                lat_us_p50: m(&|s| s.lat_us_p50)?,
                lat_us_p99: m(&|s| s.lat_us_p99)?,
                lat_us_p999: m(&|s| s.lat_us_p999)?,
                cpu_s: m(&|s| s.cpu_s)?,
                iops_per_cpu_s: m(&|s| s.iops_per_cpu_s)?,
                seconds: m(&|s| s.seconds)?,
                round: None,
                device: Some(c.path.display().to_string()),
                ratio_vs_fio: mo(&|s| s.ratio_vs_fio),
                iops_ratio_vs_fio: mo(&|s| s.iops_ratio_vs_fio),
                ratio_vs_fio_psync: mo(&|s| s.ratio_vs_fio_psync),
                cpu_latency_us: first.cpu_latency_us,
                // The plot uses the run whose mean is the median one.
                cdf: of
                    .iter()
                    .min_by(|a, b| {
                        let med = median(of.iter().map(|s| s.lat_us_mean).collect()).unwrap_or(0.0);
                        (a.lat_us_mean - med)
                            .abs()
                            .total_cmp(&(b.lat_us_mean - med).abs())
                    })
                    .map(|s| s.cdf.clone())
                    .unwrap_or_default(),
            })
        })
        .collect()
}

/// Whether `path` is usable for writes without destroying someone's data: a file the bench
/// created, or the user said so.
pub fn check_write_allowed(
    path: &Path,
    created_here: bool,
    destructive: bool,
) -> Result<(), BenchError> {
    if created_here || destructive {
        return Ok(());
    }
    Err(BenchError::Invalid(format!(
        "a write workload overwrites {}; pass --destructive to allow it (or use --device ull, or \
         a path that does not exist yet, which the bench creates)",
        path.display()
    )))
}

/// `--plug auto`: plug at QD1 only when busy-polling or spinning first (`hybrid`): the
/// submission rides on the first poll's `io_uring_enter`. A sleeping caller, and any caller
/// above QD1, submits at once.
pub fn plug_auto(qd: u32, mode: CompletionMode) -> bool {
    qd == 1 && mode != CompletionMode::Wait
}

/// What [`choose_completion`] measured.
#[derive(Clone, Copy, Debug)]
pub struct CompletionChoice {
    pub mode: CompletionMode,
    /// Median over the rounds of each mode's mean latency, µs (at the workload's queue depth,
    /// so also inversely proportional to its throughput).
    pub poll_us: f64,
    pub wait_us: f64,
}

impl CompletionChoice {
    /// The chosen mode, as the benches print it.
    pub fn chosen(&self) -> &'static str {
        match self.mode {
            CompletionMode::BusyPoll => "busy-polling",
            CompletionMode::Wait => "sleeping",
            CompletionMode::Hybrid { .. } => "spinning, then sleeping",
        }
    }
}

/// How much faster busy-polling must measure above QD1 to be chosen: it keeps a core busy for
/// as long as requests are in flight, where a sleeping caller's cost scales with completions.
pub const POLL_GAIN_ABOVE_QD1: f64 = 1.05;

/// Busy-polling the completion queue saves the caller's wake-ups, but the device's own work may
/// need the CPU the caller spins on (a loop device's worker thread, the softirq that completes
/// its requests; on a VM whose idle vCPUs halt, which CPU that worker gets decides the latency).
/// Neither mode wins everywhere, so this measures both on `dev` at the workload's queue depth:
/// `rounds` short runs of each, alternating, and picks one by the median of their mean
/// latencies (at a fixed queue depth, inversely proportional to throughput):
/// - at QD1, busy-polling unless sleeping is more than 3% faster (a tie goes to the mode with
///   no wake-up);
/// - above QD1, sleeping unless busy-polling is more than [`POLL_GAIN_ABOVE_QD1`] faster (a tie
///   goes to the mode that does not spend a core).
///
/// On the 2-vCPU AMD EPYC VM of earlier sessions, polling at QD32 on the `ull` device cost
/// about 30% more CPU for the same IOPS; on the 2-vCPU Intel Xeon VM of 2026-11-26 it gave
/// 1.14–1.35× fio's IOPS per round (two runs of five alternating rounds; medians 1.277× and
/// 1.300×) where sleeping had tied with fio.
///
/// `plug` says whether each mode plugs (the caller's rule, so that each is measured as it would
/// run); `opts.plug` is not used.
///
/// The samples are taken in the process that then runs the bench, each after `pause` of idle
/// (the bench's `--settle-ms`, the pause every timed run gets): on the 2-vCPU VM this was built
/// on, a thread that has just busy-polled the `ull` device, or done anything else CPU-heavy,
/// sleeps slowly for as long as it keeps reading (the loop worker keeps waking on the other,
/// halted vCPU). Without the pause, the sleeping samples measured that aftermath of the
/// busy-polling ones: on 2026-11-24 sleeping read 96.3 us against busy-polling's 58.9 us, and
/// the bench that followed, busy-polling, took 2.0x fio's latency. With a 250 ms pause,
/// sleeping read 11.5-15.0 us against 15.7-27.0 us in nine calibrations that day, and was
/// chosen every time.
pub fn choose_completion(
    dev: &Device,
    w: &Workload,
    opts: LbioRunOptions,
    plug: &dyn Fn(CompletionMode) -> bool,
    rounds: u32,
    seconds: f64,
    pause: Duration,
) -> Result<CompletionChoice, BenchError> {
    let short = Workload { seconds, ..*w };
    let (mut poll, mut wait) = (Vec::new(), Vec::new());
    for r in 0..rounds.max(1) {
        let order = if r % 2 == 0 {
            [CompletionMode::BusyPoll, CompletionMode::Wait]
        } else {
            [CompletionMode::Wait, CompletionMode::BusyPoll]
        };
        for mode in order {
            settle(pause);
            let s = run_lbio(
                dev,
                &short,
                LbioRunOptions {
                    completion: mode,
                    plug: plug(mode),
                    ..opts
                },
            )?;
            if mode == CompletionMode::BusyPoll {
                poll.push(s.lat_us_mean);
            } else {
                wait.push(s.lat_us_mean);
            }
        }
    }
    let (poll_us, wait_us) = (
        median(poll).unwrap_or(f64::NAN),
        median(wait).unwrap_or(f64::NAN),
    );
    let poll_wins = if w.qd <= 1 {
        let wait_wins = wait_us * 1.03 < poll_us;
        !wait_wins
    } else {
        poll_us * POLL_GAIN_ABOVE_QD1 < wait_us
    };
    let mode = if poll_wins {
        CompletionMode::BusyPoll
    } else {
        CompletionMode::Wait
    };
    Ok(CompletionChoice {
        mode,
        poll_us,
        wait_us,
    })
}
