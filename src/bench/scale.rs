//! Per-core scaling: `T` threads, each with its own engine, lbio array and device handle (the
//! per-core engine of AIOS §3.1), nothing shared between them, run at once for the same time;
//! beside fio with `T` jobs on the same devices, in alternating rounds.
//!
//! What the numbers mean: `scaling` is a run's IOPS ÷ the same engine's one-thread IOPS in the
//! same round, `efficiency` that ÷ `T`. On the `mem` device (RAM behind lbio's `MemBackend`,
//! written once before the run) there is no device to wait for: the figures are the engines'
//! own cost plus each request's 4 KiB copy, and whether that stays per core (with the memory
//! system's limits in it once the threads' data outgrows the caches). On `ull` each thread gets
//! a loop device of its own, since one
//! loop device is served by one kernel worker and would cap every thread count at that
//! worker's rate.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use aios_core::{CompletionMode, Engine, EngineConfig};
use hdrhistogram::Histogram;
use lbio::{Class, Device, DeviceConfig, LbioArray, LbioConfig};
use serde::Serialize;

use crate::bench::compare::{settle, Progress};
use crate::bench::fio::{run_fio_jobs, FioEngine};
use crate::bench::{
    lbio_engine_config, median, new_histogram, quantile_us, run_lbio_timed, run_threads,
    BenchError, LbioRunOptions, Workload,
};

/// The devices the threads read or write.
#[derive(Clone, Debug)]
pub enum ScaleDevices {
    /// A RAM device of this many bytes per thread (`MemBackend`), written before the run.
    Mem { bytes: usize },
    /// Thread `t` uses `paths[t % paths.len()]`.
    Paths(Vec<PathBuf>),
}

/// A scaling run's settings.
#[derive(Clone, Debug)]
pub struct ScaleConfig {
    pub devices: ScaleDevices,
    /// Per thread: block size, queue depth, seconds.
    pub workload: Workload,
    pub threads: Vec<u32>,
    pub rounds: u32,
    pub completion: CompletionMode,
    /// Pin thread `t` to CPU `t % nproc`.
    pub pin: bool,
    pub slots: u32,
    /// Bytes of each device the offsets cover (default: all of it).
    pub span: Option<u64>,
    /// Also run fio (io_uring, fixedbufs, registerfiles) with one job per thread.
    pub fio: bool,
    pub write: bool,
    pub settle: Duration,
}

/// One run at one thread count, printed as a table row or one JSON line.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ScaleSample {
    pub workload: String,
    pub engine: String,
    pub threads: u32,
    pub bs: u32,
    /// Queue depth per thread.
    pub qd: u32,
    /// All threads together.
    pub iops: f64,
    pub iops_per_thread: f64,
    pub lat_us_mean: f64,
    pub lat_us_p50: f64,
    pub lat_us_p99: f64,
    pub lat_us_p999: f64,
    /// The process's CPU seconds over the timed part (fio: its jobs').
    pub cpu_s: f64,
    pub iops_per_cpu_s: f64,
    pub seconds: f64,
    /// IOPS ÷ the same engine's one-thread IOPS in the same round (median over rounds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scaling: Option<f64>,
    /// `scaling` ÷ threads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub efficiency: Option<f64>,
    /// Ours ÷ fio's IOPS at the same thread count, same round.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_ratio_vs_fio: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    pub device: String,
}

/// Everything one thread needs, built on that thread (engines are not `Send`).
struct ThreadStack {
    _engine: Rc<Engine>,
    _lbio: Rc<LbioArray>,
    dev: Device,
}

fn thread_stack(cfg: &ScaleConfig, t: u32, engines: u32) -> Result<ThreadStack, BenchError> {
    let w = &cfg.workload;
    let engine = Engine::new(EngineConfig {
        huge_pages: false,
        ..lbio_engine_config(w.bs, w.qd, cfg.slots, engines)
    })?;
    engine.set_completion_mode(cfg.completion);
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots: cfg.slots,
            ..LbioConfig::default()
        },
    )?;
    let dev = match &cfg.devices {
        ScaleDevices::Mem { bytes } => {
            let dev = Device::memory(&lbio, *bytes)?;
            fill_memory(&engine, &dev, *bytes)?;
            dev
        }
        ScaleDevices::Paths(p) => Device::open(
            &lbio,
            &p[t as usize % p.len()],
            DeviceConfig {
                write: cfg.write,
                ..crate::bench::pagecache::device_config()
            },
        )?,
    };
    Ok(ThreadStack {
        _engine: engine,
        _lbio: lbio,
        dev,
    })
}

/// Write every byte of a RAM device once, with non-zero data, as `ull`'s image is filled: an
/// untouched one would serve reads from the kernel's shared zero page and fault on each first
/// write, neither of which a device does.
fn fill_memory(engine: &Rc<Engine>, dev: &Device, bytes: usize) -> Result<(), BenchError> {
    const CHUNK: usize = 1 << 20;
    let mut buf = engine.alloc_blocking(CHUNK.min(bytes))?;
    buf.fill(0x5a);
    let mut off = 0;
    while off < bytes {
        let n = CHUNK.min(bytes - off);
        if n < buf.len() {
            buf = engine.alloc_blocking(n)?;
            buf.fill(0x5a);
        }
        buf = dev.write_at_blocking(off as u64, buf, false)?;
        off += n;
    }
    Ok(())
}

fn device_label(cfg: &ScaleConfig, threads: u32) -> String {
    match &cfg.devices {
        ScaleDevices::Mem { bytes } => format!("mem ({} MiB per thread)", bytes >> 20),
        ScaleDevices::Paths(p) => {
            let used: Vec<String> = p
                .iter()
                .take(threads as usize)
                .map(|p| p.display().to_string())
                .collect();
            used.join(",")
        }
    }
}

/// One lbio run with `threads` threads at once.
pub fn run_lbio_threads(cfg: &ScaleConfig, threads: u32) -> Result<ScaleSample, BenchError> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let w = cfg.workload;
    let (results, _wall, cpu) = run_threads(threads, |t, ready| {
        // A thread whose setup fails reaches the start anyway (when `ready` drops), so the
        // others are never left waiting.
        let mut start = || ready.wait();
        (|| {
            if cfg.pin {
                aios_core::fuse_ring::pin_current_thread(t as usize % ncpu).map_err(|e| {
                    BenchError::Setup(format!(
                        "pinning thread {t} to CPU {}: {e}",
                        t as usize % ncpu
                    ))
                })?;
            }
            let stack = thread_stack(cfg, t, threads)?;
            let span = cfg
                .span
                .unwrap_or(u64::MAX)
                .min(stack.dev.geometry().capacity_bytes);
            let opts = LbioRunOptions {
                class: Class::Critical,
                completion: cfg.completion,
                span,
                plug: crate::bench::compare::plug_auto(w.qd, cfg.completion),
            };
            run_lbio_timed(&stack.dev, &w, opts, &mut start)
        })()
    });
    let mut hist = new_histogram();
    let mut iops = 0.0;
    let mut ops = 0u64;
    let mut seconds: f64 = 0.0;
    let mut engine = String::new();
    for r in results {
        let r = r?;
        hist.add(&r.hist)
            .map_err(|e| BenchError::Setup(format!("merging latency histograms: {e}")))?;
        iops += r.ops as f64 / r.elapsed;
        ops += r.ops;
        seconds = seconds.max(r.elapsed);
        engine = r.engine;
    }
    Ok(sample(
        &w,
        engine,
        threads,
        iops,
        ops,
        cpu,
        seconds,
        &hist,
        device_label(cfg, threads),
    ))
}

#[allow(clippy::too_many_arguments)]
fn sample(
    w: &Workload,
    engine: String,
    threads: u32,
    iops: f64,
    ops: u64,
    cpu: f64,
    seconds: f64,
    hist: &Histogram<u64>,
    device: String,
) -> ScaleSample {
    ScaleSample {
        workload: w.rw.name().to_string(),
        engine,
        threads,
        bs: w.bs,
        qd: w.qd,
        iops,
        iops_per_thread: iops / threads as f64,
        lat_us_mean: hist.mean() / 1000.0,
        lat_us_p50: quantile_us(hist, 0.5),
        lat_us_p99: quantile_us(hist, 0.99),
        lat_us_p999: quantile_us(hist, 0.999),
        cpu_s: cpu,
        iops_per_cpu_s: if cpu > 0.0 { ops as f64 / cpu } else { 0.0 },
        seconds,
        device,
        ..ScaleSample::default()
    }
}

/// fio with one job per thread on the same devices the threads use.
fn run_fio_threads(cfg: &ScaleConfig, threads: u32, span: u64) -> Result<ScaleSample, BenchError> {
    let ScaleDevices::Paths(paths) = &cfg.devices else {
        return Err(BenchError::Invalid(
            "fio cannot run on the mem device (it is lbio's RAM backend)".into(),
        ));
    };
    let devs: Vec<&Path> = (0..threads as usize)
        .map(|t| paths[t % paths.len()].as_path())
        .collect();
    let s = run_fio_jobs(&devs, span, &cfg.workload, FioEngine::IoUring)?;
    Ok(ScaleSample {
        workload: s.workload,
        engine: s.engine,
        threads,
        bs: s.bs,
        qd: s.qd,
        iops: s.iops,
        iops_per_thread: s.iops / threads as f64,
        lat_us_mean: s.lat_us_mean,
        lat_us_p50: s.lat_us_p50,
        lat_us_p99: s.lat_us_p99,
        lat_us_p999: s.lat_us_p999,
        cpu_s: s.cpu_s,
        iops_per_cpu_s: s.iops_per_cpu_s,
        seconds: s.seconds,
        device: device_label(cfg, threads),
        ..ScaleSample::default()
    })
}

/// Ratios within one round: scaling against the same engine's one-thread run, and ours ÷ fio
/// at the same thread count.
fn add_ratios(round: &mut [ScaleSample]) {
    let snapshot: Vec<(String, u32, f64)> = round
        .iter()
        .map(|s| (s.engine.clone(), s.threads, s.iops))
        .collect();
    let find = |engine_is_fio: bool, engine: &str, threads: u32| {
        snapshot
            .iter()
            .find(|(e, t, _)| {
                *t == threads
                    && (e.starts_with("fio") == engine_is_fio)
                    && (engine_is_fio || e == engine)
            })
            .map(|x| x.2)
    };
    for s in round.iter_mut() {
        let fio = s.engine.starts_with("fio");
        if let Some(one) = find(fio, &s.engine, 1).filter(|v| *v > 0.0) {
            s.scaling = Some(s.iops / one);
            s.efficiency = Some(s.iops / one / s.threads as f64);
        }
        if !fio {
            s.iops_ratio_vs_fio = find(true, "", s.threads)
                .filter(|v| *v > 0.0)
                .map(|f| s.iops / f);
        }
    }
}

/// Per (engine kind, thread count): the sample with the median IOPS, its ratios replaced by the
/// medians of the per-round ratios.
fn medians(all: &[ScaleSample]) -> Vec<ScaleSample> {
    let mut keys: Vec<(bool, u32)> = Vec::new();
    for s in all {
        let k = (s.engine.starts_with("fio"), s.threads);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.sort_by_key(|&(fio, t)| (t, fio));
    keys.into_iter()
        .filter_map(|(fio, t)| {
            let mut v: Vec<&ScaleSample> = all
                .iter()
                .filter(|s| s.threads == t && s.engine.starts_with("fio") == fio)
                .collect();
            v.sort_by(|a, b| a.iops.total_cmp(&b.iops));
            let mut m = (*v.get(v.len() / 2)?).clone();
            m.round = None;
            m.scaling = median(v.iter().filter_map(|s| s.scaling).collect());
            m.efficiency = median(v.iter().filter_map(|s| s.efficiency).collect());
            m.iops_ratio_vs_fio = median(v.iter().filter_map(|s| s.iops_ratio_vs_fio).collect());
            Some(m)
        })
        .collect()
}

/// Every thread count in every round (order rotating from round to round, lbio and fio
/// alternating); each sample goes to `emit` once its round is complete. Returns the medians.
pub fn run_scale(
    cfg: &ScaleConfig,
    progress: &Progress,
    emit: &mut dyn FnMut(&ScaleSample),
) -> Result<Vec<ScaleSample>, BenchError> {
    if cfg.threads.is_empty() || cfg.threads.contains(&0) {
        return Err(BenchError::Invalid(
            "--threads takes thread counts of 1 or more".into(),
        ));
    }
    if let ScaleDevices::Paths(p) = &cfg.devices {
        if p.is_empty() {
            return Err(BenchError::Invalid("no device to run on".into()));
        }
    }
    let span = match (&cfg.devices, cfg.span) {
        (_, Some(s)) => s,
        (ScaleDevices::Mem { bytes }, None) => *bytes as u64,
        (ScaleDevices::Paths(p), None) => p
            .iter()
            .map(|p| crate::bench::pagecache::device_bytes(p))
            .collect::<Result<Vec<u64>, BenchError>>()?
            .into_iter()
            .min()
            .unwrap_or(0),
    };
    let mut runs: Vec<(u32, bool)> = Vec::new();
    for &t in &cfg.threads {
        runs.push((t, false));
        if cfg.fio {
            runs.push((t, true));
        }
    }
    let mut all = Vec::new();
    for round in 0..cfg.rounds {
        let mut this_round = Vec::with_capacity(runs.len());
        for i in 0..runs.len() {
            // Rotate who goes first; within a thread count lbio and fio swap order each round.
            let (t, fio) = runs[(i + round as usize) % runs.len()];
            progress.step(&format!(
                "scale round {}/{} · {} · {} bs={} qd={} x{t} thread(s) · {}s",
                round + 1,
                cfg.rounds,
                if fio { "fio-io_uring" } else { "lbio" },
                cfg.workload.rw.name(),
                cfg.workload.bs,
                cfg.workload.qd,
                cfg.workload.seconds
            ));
            settle(cfg.settle);
            let mut s = if fio {
                run_fio_threads(cfg, t, span)?
            } else {
                run_lbio_threads(cfg, t)?
            };
            s.round = Some(round + 1);
            this_round.push(s);
        }
        progress.done();
        this_round.sort_by_key(|s| (s.threads, s.engine.starts_with("fio")));
        add_ratios(&mut this_round);
        for s in &this_round {
            emit(s);
        }
        all.extend(this_round);
    }
    Ok(medians(&all))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Rw;

    fn cfg(threads: Vec<u32>) -> ScaleConfig {
        ScaleConfig {
            devices: ScaleDevices::Mem { bytes: 8 << 20 },
            workload: Workload {
                rw: Rw::RandRead,
                bs: 4096,
                qd: 8,
                seconds: 0.05,
            },
            threads,
            rounds: 2,
            completion: CompletionMode::Wait,
            pin: false,
            slots: 64,
            span: None,
            fio: false,
            write: false,
            settle: Duration::ZERO,
        }
    }

    #[test]
    fn threads_run_their_own_engines_and_their_requests_add_up() {
        let c = cfg(vec![1, 2]);
        let mut seen = Vec::new();
        let meds = run_scale(&c, &Progress::new(true), &mut |s| seen.push(s.clone())).unwrap();
        assert_eq!(seen.len(), 4, "two thread counts in two rounds");
        assert_eq!(meds.len(), 2);
        for s in &seen {
            assert!(s.engine.starts_with("lbio"), "{}", s.engine);
            assert!(s.iops > 0.0 && s.lat_us_mean > 0.0, "{s:?}");
            assert!((s.iops_per_thread * s.threads as f64 - s.iops).abs() < 1e-6 * s.iops);
            // Ratios come from the same round's one-thread run.
            let one = seen
                .iter()
                .find(|o| o.round == s.round && o.threads == 1)
                .unwrap();
            let scaling = s.scaling.expect("a one-thread run in every round");
            assert!((scaling - s.iops / one.iops).abs() < 1e-9);
            assert!((s.efficiency.unwrap() - scaling / s.threads as f64).abs() < 1e-9);
            assert!(s.iops_ratio_vs_fio.is_none(), "no fio run asked for");
        }
        assert_eq!(meds[0].threads, 1);
        assert_eq!(meds[0].scaling, Some(1.0));
        assert_eq!(meds[1].threads, 2);
    }

    #[test]
    fn a_thread_whose_setup_fails_releases_the_others() {
        // Slots below the queue depth: every thread fails its setup check after building its
        // engine; the run must end with that error instead of hanging at the barrier.
        let mut c = cfg(vec![3]);
        c.slots = 4;
        let r = run_scale(&c, &Progress::new(true), &mut |_| {});
        let e = r.expect_err("queue depth 8 on 4 slots").to_string();
        assert!(e.contains('8') && e.contains('4'), "{e}");
    }

    #[test]
    fn fio_is_refused_on_the_mem_device_and_bad_thread_counts_are_named() {
        let mut c = cfg(vec![1]);
        c.fio = true;
        let e = run_scale(&c, &Progress::new(true), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("mem device"), "{e}");
        let c = cfg(vec![]);
        let e = run_scale(&c, &Progress::new(true), &mut |_| {}).unwrap_err();
        assert!(e.to_string().contains("--threads"), "{e}");
    }

    #[test]
    fn round_ratios_pair_each_engine_with_its_own_one_thread_run_and_fio() {
        let s = |engine: &str, threads: u32, iops: f64| ScaleSample {
            engine: engine.into(),
            threads,
            iops,
            ..ScaleSample::default()
        };
        let mut round = vec![
            s("lbio-io_uring", 1, 100.0),
            s("fio-io_uring", 1, 80.0),
            s("lbio-io_uring", 4, 300.0),
            s("fio-io_uring", 4, 400.0),
        ];
        add_ratios(&mut round);
        assert_eq!(round[2].scaling, Some(3.0));
        assert_eq!(round[2].efficiency, Some(0.75));
        assert_eq!(round[3].scaling, Some(5.0));
        assert_eq!(round[0].iops_ratio_vs_fio, Some(1.25));
        assert_eq!(round[2].iops_ratio_vs_fio, Some(0.75));
        assert_eq!(round[3].iops_ratio_vs_fio, None);
    }
}
