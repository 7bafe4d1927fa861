//! `aios bench fs`: workloads through an aiosfs mount beside the same workloads on ext4, each on
//! its own `ull` device (a loop device with direct I/O over /dev/shm), in one run.
//!
//! - `randread`: fio, 4 KiB random reads at QD1 with O_DIRECT on a 64 MiB file (latency);
//! - `fsync`: fio, 4 KiB random writes each followed by fsync, at 1..N threads (Rio's Fig. 13
//!   workload; IOPS);
//! - `createsync`: files created, written (8 KiB), fsynced and closed, one in four older ones
//!   unlinked, from one thread (varmail-like; files per second);
//! - `postmark`: Debian's postmark (a mail server's small-file workload), when installed;
//! - `append`: fio, 512-byte appends each followed by fdatasync, from one thread (a write-ahead
//!   log's pattern; IOPS). Each append rewrites part of the block the previous one made
//!   durable: a file system reads that block back unless its page cache still holds it
//!   (`aios bench fs --cache-size 0` shows aiosfs without one).
//!
//! Rounds alternate the order of the two file systems; figures are medians over rounds.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::bench::fsync::Ext4Mount;
use crate::bench::ull::{UllDevice, ULL_BYTES};
use crate::bench::BenchError;

/// One measurement.
#[derive(Clone, Debug, Serialize)]
pub struct FsSample {
    pub workload: String,
    pub fs: String,
    pub threads: u32,
    /// Operations per second (fio IOPS, files per second, postmark transactions per second).
    pub ops_per_sec: f64,
    /// Mean latency per operation in µs (fio's, or wall time per file).
    pub mean_us: f64,
    pub p99_us: f64,
}

/// An aiosfs mounted by a child `aios mount --foreground`; unmounted (SIGTERM, waited) on drop.
pub struct AiosMount {
    child: Option<Child>,
    dir: PathBuf,
    pub log_line: String,
}

impl AiosMount {
    pub fn make(exe: &Path, dev: &Path, extra: &[&str]) -> Result<AiosMount, BenchError> {
        let mkfs = Command::new(exe)
            .args(["mkfs", "--force"])
            .arg(dev)
            .output()
            .map_err(|e| BenchError::Setup(format!("aios mkfs: {e}")))?;
        if !mkfs.status.success() {
            return Err(BenchError::Setup(format!(
                "aios mkfs {}: {}",
                dev.display(),
                String::from_utf8_lossy(&mkfs.stderr).trim()
            )));
        }
        let dir = std::env::temp_dir().join(format!("aios-fsbench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| BenchError::Setup(format!("{}: {e}", dir.display())))?;
        let log = dir.with_extension("log");
        let out = std::fs::File::create(&log)
            .map_err(|e| BenchError::Setup(format!("{}: {e}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        let child = Command::new(exe)
            .args(["mount", "--foreground"])
            .arg(dev)
            .arg(&dir)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| BenchError::Setup(format!("aios mount: {e}")))?;
        let mut m = AiosMount {
            child: Some(child),
            dir,
            log_line: String::new(),
        };
        let t0 = Instant::now();
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            // The mount line, then the line naming the FUSE transport.
            let mounted = text.lines().find(|l| l.starts_with("aiosfs: mounted"));
            let transport = text
                .lines()
                .find(|l| l.starts_with("aiosfs: requests over"));
            if let (Some(l), Some(t)) = (mounted, transport) {
                m.log_line = format!("{l}\n{t}");
                return Ok(m);
            }
            if let Some(Ok(Some(st))) = m.child.as_mut().map(|c| c.try_wait()) {
                m.child = None;
                return Err(BenchError::Setup(format!("aios mount exited {st}: {text}")));
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(BenchError::Setup(format!(
                    "aios mount: no mount after 60 s: {text}"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for AiosMount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(30) {
                if let Ok(Some(_)) = c.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_file(self.dir.with_extension("log"));
    }
}

/// The workloads' settings.
#[derive(Clone, Debug)]
pub struct FsBench {
    pub threads: Vec<u32>,
    pub seconds: f64,
    pub rounds: u32,
    pub workloads: Vec<String>,
}

fn fio(
    dir: &Path,
    args: &[String],
    rw_key: &str,
    seconds: f64,
) -> Result<(f64, f64, f64), BenchError> {
    let out = Command::new("fio")
        .arg(format!("--directory={}", dir.display()))
        .args(args)
        .args(["--time_based", "--output-format=json", "--group_reporting"])
        .arg(format!("--runtime={}ms", (seconds * 1000.0) as u64))
        .output()
        .map_err(|e| BenchError::Setup(format!("running fio: {e}")))?;
    if !out.status.success() {
        return Err(BenchError::Setup(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let start = text.find('{').unwrap_or(0);
    let v: serde_json::Value = serde_json::from_str(&text[start..])
        .map_err(|e| BenchError::Parse(format!("fio JSON: {e}")))?;
    let j = &v["jobs"][0][rw_key];
    let iops = j["iops"].as_f64().unwrap_or(0.0);
    let mean = j["clat_ns"]["mean"].as_f64().unwrap_or(0.0) / 1000.0;
    let p99 = j["clat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .unwrap_or(0.0)
        / 1000.0;
    Ok((iops, mean, p99))
}

/// Files created, written, fsynced; every fourth older one unlinked.
fn createsync(dir: &Path, seconds: f64) -> Result<(f64, f64, f64), BenchError> {
    let sub = dir.join("createsync");
    let _ = std::fs::remove_dir_all(&sub);
    std::fs::create_dir_all(&sub)
        .map_err(|e| BenchError::Setup(format!("{}: {e}", sub.display())))?;
    let data = vec![0x5au8; 8192];
    let mut lat = Vec::new();
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed().as_secs_f64() < seconds {
        let t = Instant::now();
        let p = sub.join(format!("m{n}"));
        let mut f = std::fs::File::create(&p)
            .map_err(|e| BenchError::Setup(format!("{}: {e}", p.display())))?;
        f.write_all(&data)
            .map_err(|e| BenchError::Setup(e.to_string()))?;
        f.sync_all().map_err(|e| BenchError::Setup(e.to_string()))?;
        drop(f);
        if n % 4 == 3 {
            let _ = std::fs::remove_file(sub.join(format!("m{}", n / 2)));
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
        n += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&sub);
    lat.sort_by(f64::total_cmp);
    let mean = lat.iter().sum::<f64>() / lat.len().max(1) as f64;
    let p99 = lat.get(lat.len() * 99 / 100).copied().unwrap_or(0.0);
    Ok((n as f64 / secs, mean, p99))
}

const POSTMARK_TX: u32 = 20_000;

/// Debian's postmark: small files created, read, appended, deleted. Transactions per second.
fn postmark(dir: &Path) -> Result<(f64, f64, f64), BenchError> {
    let sub = dir.join("postmark");
    let _ = std::fs::remove_dir_all(&sub);
    std::fs::create_dir_all(&sub).map_err(|e| BenchError::Setup(e.to_string()))?;
    let script = format!(
        "set location {}\nset number 1000\nset transactions {POSTMARK_TX}\nset size 512 16384\nrun\nquit\n",
        sub.display()
    );
    let t0 = Instant::now();
    let mut child = Command::new("postmark")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| BenchError::Setup(format!("running postmark: {e}")))?;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let out = child
        .wait_with_output()
        .map_err(|e| BenchError::Setup(e.to_string()))?;
    let secs = t0.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&sub);
    let text = String::from_utf8_lossy(&out.stdout);
    // postmark times in whole seconds: the run's wall time (file set creation and deletion
    // included) is the finer measure.
    if !out.status.success() || !text.contains("seconds of transactions") {
        return Err(BenchError::Parse(format!("postmark output: {text}")));
    }
    Ok((
        POSTMARK_TX as f64 / secs,
        secs * 1e6 / POSTMARK_TX as f64,
        0.0,
    ))
}

impl FsBench {
    /// Run every workload on both mounts; `progress` gets one line per measurement.
    pub fn run(
        &self,
        aios: &Path,
        ext4: &Path,
        progress: &mut dyn FnMut(&FsSample),
    ) -> Result<Vec<FsSample>, BenchError> {
        // The read file, written once on each and made durable.
        for dir in [aios, ext4] {
            let f = dir.join("rr.dat");
            let data: Vec<u8> = (0..64u32 << 20).map(|i| (i % 253) as u8).collect();
            std::fs::write(&f, data)
                .and_then(|_| std::fs::File::open(&f)?.sync_all())
                .map_err(|e| BenchError::Setup(format!("{}: {e}", f.display())))?;
        }
        let mut all = Vec::new();
        for round in 0..self.rounds {
            let order: Vec<(&str, &Path)> = if round % 2 == 0 {
                vec![("aiosfs", aios), ("ext4", ext4)]
            } else {
                vec![("ext4", ext4), ("aiosfs", aios)]
            };
            for w in &self.workloads {
                let threads: Vec<u32> = if w == "fsync" {
                    self.threads.clone()
                } else {
                    vec![1]
                };
                for &t in &threads {
                    for &(name, dir) in &order {
                        let (ops, mean, p99) = match w.as_str() {
                            "randread" => fio(
                                dir,
                                &[
                                    "--name=rr".into(),
                                    "--filename=rr.dat".into(),
                                    "--rw=randread".into(),
                                    "--bs=4k".into(),
                                    "--size=64m".into(),
                                    "--direct=1".into(),
                                    "--ioengine=psync".into(),
                                ],
                                "read",
                                self.seconds,
                            )?,
                            "fsync" => fio(
                                dir,
                                &[
                                    "--name=fs".into(),
                                    "--rw=randwrite".into(),
                                    "--bs=4k".into(),
                                    "--size=16m".into(),
                                    "--fsync=1".into(),
                                    "--ioengine=psync".into(),
                                    format!("--numjobs={t}"),
                                ],
                                "write",
                                self.seconds,
                            )?,
                            "createsync" => createsync(dir, self.seconds)?,
                            "postmark" => postmark(dir)?,
                            "append" => fio(
                                dir,
                                &[
                                    "--name=ap".into(),
                                    "--rw=write".into(),
                                    "--bs=512".into(),
                                    "--size=64m".into(),
                                    "--fdatasync=1".into(),
                                    "--ioengine=psync".into(),
                                ],
                                "write",
                                self.seconds,
                            )?,
                            other => {
                                return Err(BenchError::Invalid(format!(
                                    "unknown workload {other}"
                                )))
                            }
                        };
                        let s = FsSample {
                            workload: w.clone(),
                            fs: name.into(),
                            threads: t,
                            ops_per_sec: ops,
                            mean_us: mean,
                            p99_us: p99,
                        };
                        progress(&s);
                        all.push(s);
                    }
                }
            }
        }
        Ok(all)
    }
}

/// Medians over rounds, per (workload, threads, fs).
pub fn medians(samples: &[FsSample]) -> Vec<FsSample> {
    let mut keys: Vec<(String, u32, String)> = Vec::new();
    for s in samples {
        let k = (s.workload.clone(), s.threads, s.fs.clone());
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(w, t, f)| {
            let mut v: Vec<&FsSample> = samples
                .iter()
                .filter(|s| s.workload == w && s.threads == t && s.fs == f)
                .collect();
            v.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
            let mut lat: Vec<f64> = v.iter().map(|s| s.mean_us).collect();
            lat.sort_by(f64::total_cmp);
            let mid = v[v.len() / 2];
            FsSample {
                mean_us: lat[lat.len() / 2],
                ..mid.clone()
            }
        })
        .collect()
}

/// The two devices and mounts of a run (dropped in reverse: unmount, then detach).
pub struct FsBenchSetup {
    pub aios: AiosMount,
    pub ext4: Ext4Mount,
    _devs: (UllDevice, UllDevice),
}

impl FsBenchSetup {
    pub fn ull(exe: &Path, mount_args: &[&str]) -> Result<FsBenchSetup, BenchError> {
        let a = UllDevice::create(ULL_BYTES)?;
        let b = UllDevice::create(ULL_BYTES)?;
        let aios = AiosMount::make(exe, a.path(), mount_args)?;
        let ext4 = Ext4Mount::make(b.path())?;
        Ok(FsBenchSetup {
            aios,
            ext4,
            _devs: (a, b),
        })
    }
}

/// The medians as a table: one row per workload and thread count, aiosfs beside ext4, and the
/// ratio (latency for `randread`, operations per second otherwise).
pub fn print_table(out: &mut impl Write, meds: &[FsSample]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<11} {:>7} {:>12} {:>12} {:>10} {:>10} {:>8}",
        "workload", "threads", "aiosfs op/s", "ext4 op/s", "aiosfs us", "ext4 us", "ratio"
    )?;
    for m in meds.iter().filter(|m| m.fs == "aiosfs") {
        let Some(e) = meds
            .iter()
            .find(|e| e.fs == "ext4" && e.workload == m.workload && e.threads == m.threads)
        else {
            continue;
        };
        let (ratio, what) = if m.workload == "randread" {
            (m.mean_us / e.mean_us, "latency")
        } else {
            (m.ops_per_sec / e.ops_per_sec, "op/s")
        };
        writeln!(
            out,
            "{:<11} {:>7} {:>12.0} {:>12.0} {:>10.1} {:>10.1} {:>6.2}x {}",
            m.workload, m.threads, m.ops_per_sec, e.ops_per_sec, m.mean_us, e.mean_us, ratio, what
        )?;
    }
    Ok(())
}

/// Is Debian's postmark on the PATH?
pub fn postmark_installed() -> bool {
    Command::new("sh")
        .args(["-c", "command -v postmark"])
        .output()
        .is_ok_and(|o| o.status.success())
}
