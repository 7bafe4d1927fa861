//! Running fio as the anchor: the same workload on the same device, parsed from its JSON.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::bench::{BenchError, Sample, Workload};

/// fio engines the bench compares against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FioEngine {
    /// `io_uring` with `fixedbufs` and `registerfiles`.
    IoUring,
    /// `psync` (pread/pwrite), QD1.
    Psync,
}

impl FioEngine {
    /// Name used in reports.
    pub fn label(self) -> &'static str {
        match self {
            FioEngine::IoUring => "fio-io_uring",
            FioEngine::Psync => "fio-psync",
        }
    }
}

/// Whether `fio` is on the PATH, and its version.
pub fn fio_version() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Run fio once on `device` for workload `w`, reading `span` bytes of it.
pub fn run_fio(
    device: &Path,
    span: u64,
    w: &Workload,
    engine: FioEngine,
) -> Result<Sample, BenchError> {
    run_fio_jobs(&[device], span, w, engine)
}

/// Run fio once with one job per entry of `devices` (the same device may appear more than
/// once), all at once, reported as one group: IOPS summed, latency over every job's requests,
/// CPU seconds of all the jobs together.
pub fn run_fio_jobs(
    devices: &[&Path],
    span: u64,
    w: &Workload,
    engine: FioEngine,
) -> Result<Sample, BenchError> {
    if devices.is_empty() {
        return Err(BenchError::Invalid("fio needs at least one device".into()));
    }
    let mut cmd = Command::new("fio");
    // Options before the first --name apply to every job.
    cmd.arg("--direct=1")
        .arg(format!("--rw={}", w.rw.fio_name()))
        .arg(format!("--bs={}", w.bs))
        .arg(format!("--size={span}"))
        .arg("--time_based")
        .arg(runtime_arg(w.seconds))
        .arg("--norandommap")
        .arg("--randrepeat=0")
        .arg("--lat_percentiles=1")
        .arg("--clat_percentiles=0")
        .arg("--percentile_list=1:5:10:20:30:40:50:60:70:80:90:95:99:99.5:99.9:99.99")
        .arg("--output-format=json");
    match engine {
        FioEngine::IoUring => {
            cmd.arg("--ioengine=io_uring")
                .arg("--fixedbufs")
                .arg("--registerfiles")
                .arg(format!("--iodepth={}", w.qd));
        }
        FioEngine::Psync => {
            cmd.arg("--ioengine=psync").arg("--iodepth=1");
        }
    }
    if devices.len() > 1 {
        cmd.arg("--group_reporting");
    }
    for (j, d) in devices.iter().enumerate() {
        cmd.arg(format!("--name=aios-anchor-{j}"))
            .arg(format!("--filename={}", d.display()));
    }
    let out = cmd.output().map_err(|e| {
        BenchError::Setup(format!(
            "running fio: {e} (install it: apt-get install fio)"
        ))
    })?;
    if !out.status.success() {
        return Err(BenchError::Setup(format!(
            "fio failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    // fio may print notes before the JSON object.
    let json_start = text
        .find('{')
        .ok_or_else(|| BenchError::Parse("fio printed no JSON".into()))?;
    let v: Value = serde_json::from_str(&text[json_start..])
        .map_err(|e| BenchError::Parse(format!("fio JSON: {e}")))?;
    let mut s = parse_fio(&v, w, engine)?;
    if devices.len() > 1 {
        // A group's usr_cpu/sys_cpu are the jobs' average share of a CPU (fio sums both the
        // CPU time and the run times of the jobs it groups): all of them used `jobs` times it.
        let jobs = devices.len() as f64;
        s.cpu_s *= jobs;
        s.iops_per_cpu_s /= jobs;
    }
    Ok(s)
}

fn num(v: &Value, path: &[&str]) -> Result<f64, BenchError> {
    let mut cur = v;
    for p in path {
        cur = cur
            .get(p)
            .ok_or_else(|| BenchError::Parse(format!("fio JSON has no {}", path.join("."))))?;
    }
    cur.as_f64()
        .ok_or_else(|| BenchError::Parse(format!("fio JSON {} is not a number", path.join("."))))
}

/// Turn fio's JSON report into a [`Sample`].
pub fn parse_fio(v: &Value, w: &Workload, engine: FioEngine) -> Result<Sample, BenchError> {
    let job = v
        .get("jobs")
        .and_then(|j| j.get(0))
        .ok_or_else(|| BenchError::Parse("fio JSON has no jobs[0]".into()))?;
    let dir = if w.rw.is_read() { "read" } else { "write" };
    let stats = &job[dir];
    let iops = num(stats, &["iops"])?;
    let runtime_s = num(stats, &["runtime"])? / 1000.0;
    let mean_ns = num(stats, &["lat_ns", "mean"])?;
    let pct = stats
        .get("lat_ns")
        .and_then(|l| l.get("percentile"))
        .and_then(Value::as_object)
        .ok_or_else(|| BenchError::Parse("fio JSON has no lat_ns.percentile".into()))?;
    let mut cdf: Vec<(f64, f64)> = pct
        .iter()
        .filter_map(|(k, val)| Some((k.parse::<f64>().ok()? / 100.0, val.as_f64()? / 1000.0)))
        .collect();
    cdf.sort_by(|a, b| a.0.total_cmp(&b.0));
    let at = |q: f64| {
        cdf.iter()
            .find(|(p, _)| (*p - q).abs() < 1e-9)
            .map(|(_, us)| *us)
            .ok_or_else(|| {
                BenchError::Parse(format!("fio JSON lacks the {}th percentile", q * 100.0))
            })
    };
    let usr = num(job, &["usr_cpu"])?;
    let sys = num(job, &["sys_cpu"])?;
    let cpu_s = (usr + sys) / 100.0 * runtime_s;
    Ok(Sample {
        workload: w.rw.name().to_string(),
        engine: engine.label().to_string(),
        bs: w.bs,
        qd: if engine == FioEngine::Psync { 1 } else { w.qd },
        iops,
        lat_us_mean: mean_ns / 1000.0,
        lat_us_p50: at(0.50)?,
        lat_us_p99: at(0.99)?,
        lat_us_p999: at(0.999)?,
        cpu_s,
        iops_per_cpu_s: if cpu_s > 0.0 {
            iops * runtime_s / cpu_s
        } else {
            0.0
        },
        seconds: runtime_s,
        cdf,
        ..Sample::default()
    })
}

/// fio's `--runtime` for a run of `seconds`, in whole milliseconds rounded up: at least 1
/// (fio reads 0 as no limit).
pub fn runtime_arg(seconds: f64) -> String {
    format!("--runtime={}ms", ((seconds * 1000.0).ceil() as u64).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::Rw;

    /// A run under a millisecond still gives fio a time limit: `--runtime=0ms` is none at all,
    /// and fio then ran over its whole span (26 ms against the 0.5 ms of the run beside it,
    /// with the ratio of the two still printed; found by a review of the CLI on 2026-11-28).
    #[test]
    fn fio_gets_a_runtime_of_at_least_one_millisecond() {
        assert_eq!(runtime_arg(0.0005), "--runtime=1ms");
        assert_eq!(runtime_arg(0.0015), "--runtime=2ms");
        assert_eq!(runtime_arg(2.0), "--runtime=2000ms");
    }

    #[test]
    fn parses_fio_json_latency_and_cpu() {
        let v: Value = serde_json::from_str(
            r#"{"jobs":[{"usr_cpu":10.0,"sys_cpu":40.0,
              "read":{"iops":50000.0,"runtime":2000,
                "lat_ns":{"mean":19500.0,"percentile":{"50.000000":19000,"99.000000":30000,"99.900000":45000}}}}]}"#,
        )
        .unwrap();
        let w = Workload {
            rw: Rw::RandRead,
            bs: 4096,
            qd: 1,
            seconds: 2.0,
        };
        let s = parse_fio(&v, &w, FioEngine::IoUring).unwrap();
        assert_eq!(s.iops, 50000.0);
        assert_eq!(s.lat_us_mean, 19.5);
        assert_eq!(s.lat_us_p99, 30.0);
        assert_eq!(s.lat_us_p999, 45.0);
        assert!((s.cpu_s - 1.0).abs() < 1e-9);
        assert!((s.iops_per_cpu_s - 100000.0).abs() < 1e-6);
    }

    #[test]
    fn missing_fields_are_errors_not_panics() {
        let v: Value = serde_json::from_str(r#"{"jobs":[{"read":{}}]}"#).unwrap();
        let w = Workload {
            rw: Rw::RandRead,
            bs: 4096,
            qd: 1,
            seconds: 1.0,
        };
        assert!(matches!(
            parse_fio(&v, &w, FioEngine::Psync),
            Err(BenchError::Parse(_))
        ));
    }
}
