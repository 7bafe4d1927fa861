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
    /// Mean latency per operation in µs: fio's (for `fsync` and `append`, the write's and
    /// the fsync's or fdatasync's that follows it, which fio times apart), the wall time per
    /// file (`createsync`), or per transaction (`postmark`).
    pub mean_us: f64,
    /// 99th percentile per operation in µs, where it is measured as a whole: `None` for
    /// postmark (it reports no latencies) and for fio's write + sync operations, whose two
    /// calls fio times apart (see `sync_p99_us`).
    pub p99_us: Option<f64>,
    /// Workloads that follow each write with an fsync or fdatasync: the mean µs of that call
    /// alone (part of `mean_us`) ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_mean_us: Option<f64>,
    /// ... and its 99th percentile.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sync_p99_us: Option<f64>,
}

/// What one workload run measured.
struct Measured {
    ops_per_sec: f64,
    mean_us: f64,
    p99_us: Option<f64>,
    sync_mean_us: Option<f64>,
    sync_p99_us: Option<f64>,
}

impl Measured {
    fn whole(ops_per_sec: f64, mean_us: f64, p99_us: Option<f64>) -> Measured {
        Measured {
            ops_per_sec,
            mean_us,
            p99_us,
            sync_mean_us: None,
            sync_p99_us: None,
        }
    }
}

/// An aiosfs mounted by a child `aios mount --foreground`; unmounted (SIGTERM, waited) on drop.
pub struct AiosMount {
    child: Option<Child>,
    dir: PathBuf,
    pub log_line: String,
    /// On SIGINT/SIGTERM: stop the mount process and remove the mount point (dropping the
    /// mount does the same with the child handle it keeps).
    undo: crate::bench::cleanup::Undo,
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
        let (pid, d) = (child.id(), dir.clone());
        let undo = crate::bench::cleanup::register("the aiosfs mount", move || {
            // SIGTERM makes the mount commit and unmount; wait for it to have exited (nobody
            // reaps it on this path: it stays a zombie until the process ends).
            let _ = aios_core::sys::terminate(pid);
            crate::bench::cleanup::wait_exited(&[pid], Duration::from_secs(30));
            remove_mount_point(&d);
        });
        let mut m = AiosMount {
            child: Some(child),
            dir,
            log_line: String::new(),
            undo,
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
        self.undo.cancel();
        if let Some(mut c) = self.child.take() {
            let _ = aios_core::sys::terminate(c.id());
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
        remove_mount_point(&self.dir);
    }
}

/// Detach whatever is still mounted at `dir`, then remove it and its log.
fn remove_mount_point(dir: &Path) {
    let _ = Command::new("umount")
        .arg("-l")
        .arg(dir)
        .stderr(Stdio::null())
        .status();
    let _ = std::fs::remove_dir(dir);
    let _ = std::fs::remove_file(dir.with_extension("log"));
}

/// The workloads' settings.
#[derive(Clone, Debug)]
pub struct FsBench {
    pub threads: Vec<u32>,
    pub seconds: f64,
    pub rounds: u32,
    pub workloads: Vec<String>,
}

fn fio(dir: &Path, args: &[String], rw_key: &str, seconds: f64) -> Result<Measured, BenchError> {
    let out = Command::new("fio")
        .arg(format!("--directory={}", dir.display()))
        .args(args)
        // Percentiles of the whole latency (`lat_ns`), which fio leaves out unless asked.
        .args([
            "--time_based",
            "--output-format=json",
            "--group_reporting",
            "--lat_percentiles=1",
        ])
        .arg(crate::bench::fio::runtime_arg(seconds))
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
    fio_measured(&v["jobs"][0], rw_key)
}

/// The figures of one fio job (`--group_reporting`) from its JSON. An operation of a job that
/// syncs after every write (`--fsync=1`, `--fdatasync=1`) is the write and the sync: fio times
/// the two calls apart, so the mean per operation is the sum of their means, and no
/// percentile of the whole can be had from the two.
fn fio_measured(job: &serde_json::Value, rw_key: &str) -> Result<Measured, BenchError> {
    let j = &job[rw_key];
    let num = |v: &serde_json::Value, what: &str| {
        v.as_f64()
            .ok_or_else(|| BenchError::Parse(format!("fio JSON: no {what}")))
    };
    let iops = num(&j["iops"], "iops")?;
    let mean = num(&j["lat_ns"]["mean"], "lat_ns.mean")? / 1000.0;
    let p99 = j["lat_ns"]["percentile"]["99.000000"]
        .as_f64()
        .map(|ns| ns / 1000.0);
    let sync = &job["sync"];
    // `lat_ns.N`, not `total_ios`: fio 3.33 leaves `total_ios` at 0 for fdatasync.
    if sync["lat_ns"]["N"].as_u64().unwrap_or(0) == 0 {
        // A job's own p99 is always there when fio is asked for it (`--lat_percentiles=1`):
        // without it the p99 was null for every run, quietly.
        let p99 = p99.ok_or_else(|| {
            BenchError::Parse(
                "fio JSON: no lat_ns.percentile (fio run without --lat_percentiles=1?)".into(),
            )
        })?;
        return Ok(Measured::whole(iops, mean, Some(p99)));
    }
    let sync_mean = num(&sync["lat_ns"]["mean"], "sync.lat_ns.mean")? / 1000.0;
    Ok(Measured {
        ops_per_sec: iops,
        mean_us: mean + sync_mean,
        p99_us: None,
        sync_mean_us: Some(sync_mean),
        sync_p99_us: sync["lat_ns"]["percentile"]["99.000000"]
            .as_f64()
            .map(|ns| ns / 1000.0),
    })
}

/// Files created, written, fsynced; every fourth older one unlinked.
fn createsync(dir: &Path, seconds: f64) -> Result<Measured, BenchError> {
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
    let p99 = lat.get(lat.len() * 99 / 100).copied();
    Ok(Measured::whole(n as f64 / secs, mean, p99))
}

const POSTMARK_TX: u32 = 20_000;

/// Debian's postmark: small files created, read, appended, deleted. Transactions per second.
fn postmark(dir: &Path) -> Result<Measured, BenchError> {
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
    Ok(Measured::whole(
        POSTMARK_TX as f64 / secs,
        secs * 1e6 / POSTMARK_TX as f64,
        None,
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
                        let m = match w.as_str() {
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
                            ops_per_sec: m.ops_per_sec,
                            mean_us: m.mean_us,
                            p99_us: m.p99_us,
                            sync_mean_us: m.sync_mean_us,
                            sync_p99_us: m.sync_p99_us,
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

/// Medians over rounds, per (workload, threads, fs): the round with the median operations per
/// second, with the median mean latencies over all rounds.
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
            let median = |f: fn(&FsSample) -> Option<f64>| -> Option<f64> {
                let mut x: Vec<f64> = v.iter().filter_map(|s| f(s)).collect();
                x.sort_by(f64::total_cmp);
                x.get(x.len() / 2).copied()
            };
            let mid = v[v.len() / 2];
            FsSample {
                mean_us: median(|s| Some(s.mean_us)).unwrap_or(mid.mean_us),
                sync_mean_us: median(|s| s.sync_mean_us),
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
    writeln!(
        out,
        "'us' = mean µs per operation; for fsync and append, the write and the fsync or \
         fdatasync after it (fio times the two apart: JSON sync_mean_us, sync_p99_us)"
    )?;
    Ok(())
}

/// Is Debian's postmark on the PATH?
pub fn postmark_installed() -> bool {
    Command::new("sh")
        .args(["-c", "command -v postmark"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job as fio 3.33 writes it with `--group_reporting`, cut to the fields read here.
    fn job(sync_ios: u64) -> serde_json::Value {
        serde_json::json!({
            "write": {
                "iops": 5800.0,
                "lat_ns": { "mean": 7990.0, "percentile": { "99.000000": 21000 } },
                "clat_ns": { "mean": 7786.0 }
            },
            "sync": {
                "total_ios": 0,
                "lat_ns": {
                    "mean": 161972.0,
                    "N": sync_ios,
                    "percentile": { "99.000000": 411000 }
                }
            }
        })
    }

    #[test]
    fn a_write_followed_by_a_sync_counts_both_calls() {
        let m = fio_measured(&job(2906), "write").unwrap();
        assert_eq!(m.ops_per_sec, 5800.0);
        assert!(
            (m.mean_us - (7.990 + 161.972)).abs() < 1e-9,
            "{}",
            m.mean_us
        );
        assert_eq!(m.p99_us, None);
        assert_eq!(m.sync_mean_us, Some(161.972));
        assert_eq!(m.sync_p99_us, Some(411.0));
    }

    #[test]
    fn a_job_without_syncs_reports_its_own_latency() {
        let m = fio_measured(&job(0), "write").unwrap();
        assert!((m.mean_us - 7.990).abs() < 1e-9);
        assert_eq!(m.p99_us, Some(21.0));
        assert_eq!(m.sync_mean_us, None);
        let no_sync_section = serde_json::json!({ "read": job(0)["write"].clone() });
        let m = fio_measured(&no_sync_section, "read").unwrap();
        assert_eq!(m.p99_us, Some(21.0));
    }

    #[test]
    fn a_job_without_figures_is_an_error() {
        assert!(fio_measured(&serde_json::json!({}), "write").is_err());
    }

    /// fio leaves `lat_ns.percentile` out unless run with `--lat_percentiles=1`: `bench fs`
    /// ran it so, and every randread row said `p99_us: null` without a word.
    #[test]
    fn a_job_without_its_percentiles_is_an_error() {
        let mut j = job(0);
        j["write"]["lat_ns"]
            .as_object_mut()
            .unwrap()
            .remove("percentile");
        let Err(e) = fio_measured(&j, "write") else {
            panic!("a job without its percentiles was taken (p99 null)");
        };
        assert!(e.to_string().contains("lat_percentiles"), "{e}");
    }

    #[test]
    fn medians_take_the_middle_mean_over_rounds() {
        let s = |ops: f64, mean: f64, sync: f64| FsSample {
            workload: "fsync".into(),
            fs: "aiosfs".into(),
            threads: 1,
            ops_per_sec: ops,
            mean_us: mean,
            p99_us: None,
            sync_mean_us: Some(sync),
            sync_p99_us: None,
        };
        let m = medians(&[
            s(10.0, 90.0, 80.0),
            s(30.0, 30.0, 20.0),
            s(20.0, 50.0, 40.0),
        ]);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].ops_per_sec, 20.0);
        assert_eq!(m[0].mean_us, 50.0);
        assert_eq!(m[0].sync_mean_us, Some(40.0));
    }
}
