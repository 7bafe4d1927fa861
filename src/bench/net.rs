//! `aios bench ordered --targets …`: 4 KiB ordered writes to a volume striped over target
//! servers (rio-net) — Rio against orderless writes and synchronous ordering (write, wait,
//! FLUSH every target, wait), with CPU per request for the initiator and, when the bench
//! started them itself (`--targets netns:N`), for the targets.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rio_net::{Volume, VolumeConfig};
use serde::Serialize;

use crate::bench::ordered::OrderedMode;
use crate::bench::{median, new_histogram, quantile_us, record_since, xorshift, BenchError};
use crate::netlab::proc_cpu_s;

/// One measured run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NetSample {
    pub mode: String,
    pub targets: u32,
    pub streams: u32,
    pub qd: u32,
    pub writes: u64,
    pub seconds: f64,
    pub iops: f64,
    pub lat_us_mean: f64,
    pub lat_us_p99: f64,
    /// Initiator CPU microseconds per write.
    pub init_cpu_us_per_req: f64,
    /// All targets' CPU microseconds per write (when their processes are known).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_cpu_us_per_req: Option<f64>,
    pub flushes: u64,
    /// Merged commands the volume sent (rio with `batch` above 1) and the groups they carried.
    pub merged_cmds: u64,
    pub merged_groups: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_orderless: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iops_vs_sync: Option<f64>,
}

/// The benchmark.
pub struct NetBench {
    pub targets: Vec<SocketAddr>,
    /// Target processes whose CPU time to count.
    pub target_pids: Vec<u32>,
    pub modes: Vec<OrderedMode>,
    pub streams: u32,
    pub qd: u32,
    pub seconds: f64,
    pub rounds: u32,
    /// Rio: groups held before sending (`VolumeConfig::batch`; above 1 they may merge).
    pub batch: u32,
    /// Sequential writes, each stream in its own part of the volume (random otherwise).
    pub seq: bool,
    /// The volume's stripe unit (bytes).
    pub stripe: u32,
}

impl NetBench {
    /// Every round; `progress` names each run as it starts (one rewritten line on a terminal,
    /// plain lines otherwise).
    pub fn run(
        &self,
        progress: &crate::bench::compare::Progress,
        emit: &mut dyn FnMut(&NetSample),
    ) -> Result<Vec<NetSample>, BenchError> {
        let mut all: Vec<NetSample> = Vec::new();
        for round in 0..self.rounds.max(1) {
            let mut modes = self.modes.clone();
            if round % 2 == 1 {
                modes.reverse();
            }
            let mut this = Vec::new();
            for &m in &modes {
                progress.step(&format!(
                    "round {}/{}: {}",
                    round + 1,
                    self.rounds.max(1),
                    m.name()
                ));
                let mut s = self.run_mode(m)?;
                s.round = Some(round + 1);
                this.push(s);
            }
            progress.done();
            ratios(&mut this);
            for s in &this {
                emit(s);
            }
            all.extend(this);
        }
        let mut meds = Vec::new();
        for &m in &self.modes {
            let xs: Vec<&NetSample> = all.iter().filter(|s| s.mode == m.name()).collect();
            let med = |f: &dyn Fn(&NetSample) -> f64| {
                median(xs.iter().map(|s| f(s)).collect()).unwrap_or(0.0)
            };
            let medo = |f: &dyn Fn(&NetSample) -> Option<f64>| {
                median(xs.iter().filter_map(|s| f(s)).collect())
            };
            meds.push(NetSample {
                mode: format!("{} (median)", m.name()),
                targets: self.targets.len() as u32,
                streams: self.streams,
                qd: self.qd,
                writes: med(&|s| s.writes as f64) as u64,
                seconds: med(&|s| s.seconds),
                iops: med(&|s| s.iops),
                lat_us_mean: med(&|s| s.lat_us_mean),
                lat_us_p99: med(&|s| s.lat_us_p99),
                init_cpu_us_per_req: med(&|s| s.init_cpu_us_per_req),
                target_cpu_us_per_req: medo(&|s| s.target_cpu_us_per_req),
                flushes: med(&|s| s.flushes as f64) as u64,
                merged_cmds: med(&|s| s.merged_cmds as f64) as u64,
                merged_groups: med(&|s| s.merged_groups as f64) as u64,
                round: None,
                iops_vs_orderless: medo(&|s| s.iops_vs_orderless),
                iops_vs_sync: medo(&|s| s.iops_vs_sync),
            });
        }
        Ok(meds)
    }

    fn run_mode(&self, mode: OrderedMode) -> Result<NetSample, BenchError> {
        let net = |e: rio_net::NetError| BenchError::Setup(format!("network volume: {e}"));
        let mut cfg = VolumeConfig::new(self.targets.clone(), self.streams as u16);
        cfg.window = self.qd;
        cfg.batch = self.batch;
        cfg.stripe = self.stripe;
        let (mut v, _) = Volume::open(cfg).map_err(net)?;
        let blocks = v.bytes() / 4096;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        // Sequential: stream s writes its own region of the volume, block after block.
        let region = (blocks / self.streams.max(1) as u64).max(1);
        let mut cursor = vec![0u64; self.streams as usize];
        let seq = self.seq;
        let mut next_off = |s: u16, x: &mut u64| -> u64 {
            if seq {
                let c = &mut cursor[s as usize];
                let b = s as u64 * region + *c % region;
                *c += 1;
                b * 4096
            } else {
                xorshift(x) % blocks * 4096
            }
        };
        let mut lat = new_histogram();
        let mut started: std::collections::HashMap<(u16, u64), Instant> = Default::default();
        let streams = self.streams as u16;
        let tcpu0: Option<f64> = self.target_cpu();
        let cpu0 = aios_core::sys::process_cpu_time();
        let t0 = Instant::now();
        let deadline = t0 + Duration::from_secs_f64(self.seconds);
        let mut writes = 0u64;
        let mut inflight = 0u32;
        let qd_total = self.qd * self.streams;
        // `qd` is the commands each stream keeps on the wire (the volume's window) in both
        // modes. A Rio write leaves the window when the targets complete it and is handed back
        // when a trailing FLUSH makes it durable, so the benchmark may hold more Rio writes
        // than `qd` (up to the volume's hold limit); `submit` waits while the window is full.
        let cap = match mode {
            OrderedMode::Rio => qd_total * rio_net::HELD_PER_WINDOW,
            _ => qd_total,
        };
        let mut s = 0u16;
        let alloc = |v: &Volume| -> Result<_, BenchError> {
            let mut b = v
                .alloc(4096)
                .ok_or_else(|| BenchError::Setup("the volume's arena is exhausted".into()))?;
            b.fill(0x5a);
            Ok(b)
        };
        match mode {
            OrderedMode::Sync => {
                while Instant::now() < deadline {
                    let off = next_off(s, &mut x);
                    let since = Instant::now();
                    let b = alloc(&v)?;
                    v.write_orderless(s, off, b).map_err(net)?;
                    let d = v.wait_any().map_err(net)?;
                    if let Some(Err(e)) = d.iter().map(|d| d.result.clone()).next() {
                        return Err(BenchError::Setup(e));
                    }
                    drop(d);
                    v.flush_all(s).map_err(net)?;
                    record_since(&mut lat, since);
                    writes += 1;
                    s = (s + 1) % streams;
                }
            }
            OrderedMode::Rio | OrderedMode::Orderless => {
                let rio = mode == OrderedMode::Rio;
                loop {
                    let now = Instant::now();
                    if now < deadline {
                        while inflight < cap {
                            let off = next_off(s, &mut x);
                            let b = alloc(&v)?;
                            let id = if rio {
                                v.submit(s, off, b, true).map_err(net)?
                            } else {
                                v.write_orderless(s, off, b).map_err(net)?
                            };
                            started.insert((s, id), Instant::now());
                            inflight += 1;
                            s = (s + 1) % streams;
                        }
                    } else if inflight == 0 {
                        break;
                    } else if rio {
                        for st in 0..streams {
                            v.wait(st).map_err(net)?;
                        }
                    }
                    for d in v.wait_any().map_err(net)? {
                        if let Err(e) = d.result {
                            return Err(BenchError::Setup(e));
                        }
                        if let Some(t) = started.remove(&(d.stream, d.id)) {
                            record_since(&mut lat, t);
                        }
                        inflight -= 1;
                        writes += 1;
                    }
                }
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        let cpu = (aios_core::sys::process_cpu_time() - cpu0).as_secs_f64();
        let tcpu = match (tcpu0, self.target_cpu()) {
            (Some(a), Some(b)) => Some(b - a),
            _ => None,
        };
        let st = v.stats();
        let flushes = st.flushes;
        Ok(NetSample {
            mode: mode.name().into(),
            targets: self.targets.len() as u32,
            streams: self.streams,
            qd: self.qd,
            writes,
            seconds,
            iops: writes as f64 / seconds,
            lat_us_mean: lat.mean() / 1000.0,
            lat_us_p99: quantile_us(&lat, 0.99),
            init_cpu_us_per_req: cpu * 1e6 / writes.max(1) as f64,
            target_cpu_us_per_req: tcpu.map(|t| t * 1e6 / writes.max(1) as f64),
            flushes,
            merged_cmds: st.merged_cmds,
            merged_groups: st.merged_groups,
            ..NetSample::default()
        })
    }

    fn target_cpu(&self) -> Option<f64> {
        if self.target_pids.is_empty() {
            return None;
        }
        self.target_pids.iter().map(|&p| proc_cpu_s(p)).sum()
    }
}

fn ratios(round: &mut [NetSample]) {
    let get = |m: &str| round.iter().find(|s| s.mode == m).map(|s| s.iops);
    let (o, y) = (get("orderless"), get("sync"));
    for s in round.iter_mut() {
        s.iops_vs_orderless = o.filter(|&o| o > 0.0).map(|o| s.iops / o);
        s.iops_vs_sync = y.filter(|&y| y > 0.0).map(|y| s.iops / y);
    }
}

pub fn print_header(out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<20} {:>7} {:>7} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>9}",
        "mode",
        "targets",
        "streams",
        "IOPS",
        "lat_us",
        "p99_us",
        "init_us/w",
        "tgt_us/w",
        "x_orderl",
        "x_sync"
    )
}

pub fn print_row(out: &mut impl std::io::Write, s: &NetSample) -> std::io::Result<()> {
    let r = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
    writeln!(
        out,
        "{:<20} {:>7} {:>7} {:>9.0} {:>9.1} {:>9.1} {:>10.2} {:>10} {:>9} {:>9}",
        s.mode,
        s.targets,
        s.streams,
        s.iops,
        s.lat_us_mean,
        s.lat_us_p99,
        s.init_cpu_us_per_req,
        r(s.target_cpu_us_per_req),
        r(s.iops_vs_orderless),
        r(s.iops_vs_sync)
    )
}
