//! End-to-end runs of the `aios` binary: probe, bench (table and JSON), refusal of bad input.

use std::path::PathBuf;
use std::process::Command;

fn aios() -> Command {
    Command::new(env!("CARGO_BIN_EXE_aios"))
}

struct Scratch(PathBuf);
impl Scratch {
    fn new(name: &str, bytes: usize) -> Scratch {
        let p = PathBuf::from(format!(
            "/var/tmp/aios-cli-{name}-{}.img",
            std::process::id()
        ));
        let data: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, data).unwrap();
        Scratch(p)
    }
}
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn probe_reports_alignment_and_a_route_with_its_reason() {
    let f = Scratch::new("probe", 8 << 20);
    let out = aios()
        .args(["probe", "--json", "--samples", "20"])
        .arg(&f.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["kind"], "regular file");
    assert_eq!(v["capacity_bytes"], 8 << 20);
    assert!(v["dio_offset_align"].as_u64().unwrap() >= 512);
    assert!(v["uring_qd1_us"].as_f64().unwrap() > 0.0);
    assert!(["io_uring", "sync pread/pwrite"].contains(&v["critical_route"].as_str().unwrap()));
    assert!(!v["critical_reason"].as_str().unwrap().is_empty());
    // IOPOLL is tried, and on these virtual disks refused with a reason.
    if v["iopoll"] == false {
        assert!(!v["iopoll_reason"].as_str().unwrap().is_empty());
    }
}

#[test]
fn bench_json_lines_carry_the_documented_fields() {
    let f = Scratch::new("bench", 8 << 20);
    let out = aios()
        .args([
            "bench",
            "lbio",
            "--json",
            "--seconds",
            "0.3",
            "--qd",
            "4",
            "--device",
        ])
        .arg(&f.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1, "one run, one line: {text}");
    let s = &lines[0];
    for k in [
        "workload",
        "engine",
        "bs",
        "qd",
        "iops",
        "lat_us_mean",
        "lat_us_p50",
        "lat_us_p99",
        "lat_us_p999",
        "cpu_s",
        "iops_per_cpu_s",
    ] {
        assert!(s.get(k).is_some(), "missing {k} in {s}");
    }
    assert_eq!(s["workload"], "randread");
    assert_eq!(s["bs"], 4096);
    assert_eq!(s["qd"], 4);
    assert!(s["iops"].as_f64().unwrap() > 0.0);
    assert!(s["lat_us_p50"].as_f64().unwrap() <= s["lat_us_p99"].as_f64().unwrap());
}

#[test]
fn bench_vs_fio_adds_ratios_when_fio_is_installed() {
    if Command::new("fio").arg("--version").output().is_err() {
        eprintln!("SKIPPED: fio is not installed (scripts/test.sh installs it)");
        return;
    }
    let f = Scratch::new("fio", 8 << 20);
    let out = aios()
        .args([
            "bench",
            "lbio",
            "--json",
            "--vs-fio",
            "--rounds",
            "1",
            "--seconds",
            "0.5",
        ])
        .arg("--device")
        .arg(&f.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let engines: Vec<&str> = lines
        .iter()
        .map(|l| l["engine"].as_str().unwrap())
        .collect();
    assert!(engines.contains(&"fio-io_uring"), "{engines:?}");
    assert!(engines.contains(&"fio-psync"), "{engines:?}");
    let ours = lines
        .iter()
        .find(|l| l["engine"].as_str().unwrap().starts_with("lbio"))
        .unwrap();
    assert!(ours["ratio_vs_fio"].as_f64().unwrap() > 0.0);
    assert!(ours["ratio_vs_fio_psync"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_refuses_bad_input_with_the_value_and_the_fix() {
    let f = Scratch::new("bad", 1 << 20);
    let run = |args: &[&str]| {
        let out = aios().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let path = f.0.to_str().unwrap();
    let e = run(&["bench", "lbio", "--device", path, "--qd", "5000"]);
    assert!(e.contains("5000") && e.contains("1024"), "{e}");
    let e = run(&[
        "bench",
        "lbio",
        "--device",
        path,
        "--rw",
        "randwrite",
        "--seconds",
        "0.1",
    ]);
    assert!(e.contains("--destructive"), "{e}");
    let e = run(&["bench", "lbio", "--device", "/nonexistent-dir/x.img"]);
    assert!(e.contains("/nonexistent-dir"), "{e}");
    let e = run(&[
        "bench",
        "lbio",
        "--device",
        path,
        "--bs",
        "1000",
        "--seconds",
        "0.1",
    ]);
    assert!(e.contains("1000") && e.contains("512"), "{e}");
    let e = run(&["probe", "/nonexistent-device"]);
    assert!(e.contains("no such device"), "{e}");
}

#[test]
fn bench_writes_to_a_file_it_created_and_cleans_up() {
    let p = format!("/var/tmp/aios-cli-created-{}.img", std::process::id());
    let out = aios()
        .args([
            "bench",
            "lbio",
            "--rw",
            "randwrite",
            "--seconds",
            "0.2",
            "--size",
            "4m",
            "--device",
            &p,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !std::path::Path::new(&p).exists(),
        "the bench removes the file it created"
    );
}
