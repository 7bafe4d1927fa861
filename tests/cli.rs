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

/// The JSON lines a command printed on stdout; the command must have succeeded.
/// The stderr of a bench run (`what`) that must have been refused before it made a device at
/// `p` (removed if it was) or printed anything: failed, no panic, no device described.
fn refused_before_a_device(out: std::process::Output, p: &str, what: &str) -> String {
    let left = std::path::Path::new(p).exists();
    let _ = std::fs::remove_file(p);
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{what}: {e}");
    assert!(!e.contains("panicked"), "{what}: {e}");
    assert!(
        !e.contains("preparing") && !e.contains("device:") && !e.contains("devices:"),
        "{what}: {e}"
    );
    assert!(out.stdout.is_empty(), "{what} ran the bench: {e}");
    assert!(!left, "{what} made {p}");
    e
}

fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `aios probe --json --samples N PATH`, which must succeed: its JSON.
fn probe_json(path: impl AsRef<std::ffi::OsStr>, samples: u32) -> serde_json::Value {
    let out = aios()
        .args(["probe", "--json", "--samples", &samples.to_string()])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn probe_reports_alignment_and_a_route_with_its_reason() {
    let f = Scratch::new("probe", 8 << 20);
    let v = probe_json(&f.0, 20);
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
fn bench_settles_before_each_timed_run() {
    // `--settle-ms` idles before the run: a 0.2 s run with 1.5 s of settle cannot finish in
    // less than 1.7 s (a lower bound that sleeping guarantees, not a speed threshold).
    let f = Scratch::new("settle", 8 << 20);
    let go = |ms: &str| {
        let t = std::time::Instant::now();
        let out = aios()
            .args([
                "bench",
                "lbio",
                "--json",
                "--seconds",
                "0.2",
                "--qd",
                "4",
                "--settle-ms",
                ms,
                "--device",
            ])
            .arg(&f.0)
            .output()
            .unwrap();
        json_lines(&out);
        t.elapsed()
    };
    let with = go("1500");
    assert!(
        with >= std::time::Duration::from_millis(1700),
        "took {with:?} with 1.5 s of settle"
    );
    // 0 turns it off and is accepted.
    go("0");
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
    // A directory is named as one, whichever command is given it.
    for args in [
        &["probe", "/tmp"][..],
        &["bench", "lbio", "--device", "/tmp", "--seconds", "0.1"][..],
        &["bench", "pagecache", "--device", "/tmp", "--seconds", "0.1"][..],
    ] {
        let e = run(args);
        assert!(
            e.contains("/tmp") && e.contains("a directory"),
            "{args:?}: {e}"
        );
    }

    // Settings that cannot work are refused before any device is made: each of these would
    // otherwise create a 1 GiB ull device first (`preparing the device`, `device:` lines).
    for (args, what) in [
        (&["bench", "lbio", "--qd", "0"][..], "--qd"),
        (&["bench", "ordered", "--streams", "1,0"][..], "--streams"),
        (&["bench", "ordered", "--qd", "600"][..], "600"),
        (&["bench", "ordered", "--rounds", "0"][..], "--rounds"),
        (&["bench", "ordered", "--seconds", "0"][..], "--seconds"),
        (&["bench", "fsync", "--threads", "0"][..], "--threads"),
        (&["bench", "fsync", "--seconds", "0"][..], "--seconds"),
        (&["bench", "pagecache", "--bs", "6k"][..], "6144"),
        (&["bench", "pagecache", "--seconds", "0"][..], "--seconds"),
        (
            &["bench", "pagecache", "--cache", "128k"][..],
            "--cache 128k: the page cache under test needs at least 256k",
        ),
        (
            &["bench", "fs", "--workloads", "randread,bogus"][..],
            "bogus",
        ),
        (&["bench", "fs", "--threads", "0"][..], "--threads"),
        (&["demo", "--seconds", "0"][..], "--seconds"),
    ] {
        let out = aios().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(what), "{args:?}: {e}");
        assert!(
            !e.contains("device:") && !e.contains("preparing"),
            "{args:?}: {e}"
        );
        assert!(out.stdout.is_empty(), "{args:?} printed {:?}", out.stdout);
    }
}

/// ull devices that would not fit in /dev/shm (memory) are refused before the first is made:
/// `bench scale` made one per thread and filled the machine's memory part way.
#[test]
fn ull_devices_larger_than_memory_are_refused_up_front() {
    {
        let args = &["bench", "scale", "--threads", "4", "--size", "4096g"][..];
        let out = aios().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains("--size") && e.contains("/dev/shm"),
            "{args:?}: {e}"
        );
        assert!(
            !e.contains("creating ull") && !e.contains("device:"),
            "{args:?}: {e}"
        );
    }
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

#[test]
fn bench_fsync_json_lines_carry_the_documented_fields() {
    // A file the bench creates (and removes): the journal modes only, as ext4 needs a mount.
    let p = format!("/var/tmp/aios-cli-fsync-{}.img", std::process::id());
    let plots = std::env::temp_dir().join(format!("aios-cli-fsync-{}", std::process::id()));
    let out = aios()
        .args([
            "bench",
            "fsync",
            "--modes",
            "vanilla,overlapped",
            "--threads",
            "1,2",
            "--seconds",
            "0.1",
            "--rounds",
            "1",
            "--size",
            "64m",
            "--json",
            "--out",
        ])
        .arg(&plots)
        .args(["--device", &p])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&plots);
    let lines = json_lines(&out);
    assert!(
        !std::path::Path::new(&p).exists(),
        "the created file is removed"
    );
    assert_eq!(lines.len(), 4, "2 modes x 2 thread counts");
    for v in &lines {
        assert!(["vanilla", "overlapped"].contains(&v["mode"].as_str().unwrap()));
        assert!(v["threads"].as_u64().unwrap() >= 1);
        assert!(v["iops"].as_f64().unwrap() > 0.0);
        let mean = v["lat_us_mean"].as_f64().unwrap();
        assert!(
            mean > 0.0 && v["lat_us_p99"].as_f64().unwrap() >= v["lat_us_p50"].as_f64().unwrap()
        );
        assert!(v["phases_us"]["commit"].as_f64().unwrap() > 0.0);
        assert!(v["lat_vs_vanilla"].as_f64().unwrap() > 0.0);
    }
    // Refusals name the fix.
    let e = aios()
        .args(["bench", "fsync", "--device", &p, "--modes", "ext4"])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("--ext4-dir"));
    let e = aios()
        .args([
            "bench", "fsync", "--device", &p, "--modes", "vanilla", "--plp",
        ])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("--plp"));
}

#[test]
fn bench_fsync_ext4_anchors_report_how_often_ext4_committed_its_journal() {
    if !aios::core::sys::is_root() {
        eprintln!("SKIPPED: the ull device and an ext4 mount need root");
        return;
    }
    let plots = std::env::temp_dir().join(format!("aios-cli-fsync-e4-{}", std::process::id()));
    let out = aios()
        .args([
            "bench",
            "fsync",
            "--device",
            "ull",
            "--modes",
            "overlapped,ext4,ext4-meta",
            "--seconds",
            "0.3",
            "--rounds",
            "1",
            "--json",
            "--out",
        ])
        .arg(&plots)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&plots);
    let lines = json_lines(&out);
    let row = |mode: &str| {
        lines
            .iter()
            .find(|v| v["mode"] == mode)
            .unwrap_or_else(|| panic!("no {mode} line in {lines:?}"))
    };
    let per = |mode: &str| {
        row(mode)["jbd2_commits_per_fsync"]
            .as_f64()
            .unwrap_or_else(|| panic!("{mode}: no jbd2 commit count (the /proc/fs/jbd2 lookup)"))
    };
    // An overwrite's fsync commits ext4's journal about once a clock tick (at most 1,000 a
    // second): at 4,000 fsyncs a second or more, on under a quarter of them (plus the few of
    // the file's preparation).
    let ext4_iops = row("ext4")["iops"].as_f64().unwrap();
    assert!(
        (0.0..=1.5).contains(&per("ext4")),
        "ext4: {} commits per fsync",
        per("ext4")
    );
    if ext4_iops >= 4000.0 {
        assert!(
            per("ext4") < 0.3,
            "ext4 at {ext4_iops:.0} fsyncs/s: {} commits per fsync",
            per("ext4")
        );
    }
    // With the inode changed by every write, every fsync commits: this needs multigrain
    // timestamps (Linux 6.13 and later), where reading the mtime makes its next update
    // fine-grained.
    if kernel_at_least(6, 13) {
        assert!(
            per("ext4-meta") > 0.9,
            "ext4-meta: {} commits per fsync",
            per("ext4-meta")
        );
    } else {
        eprintln!("SKIPPED the ext4-meta count: this kernel predates multigrain timestamps");
    }
    let o = row("overlapped");
    assert!(o["iops_vs_ext4"].as_f64().unwrap() > 0.0);
    assert!(o["iops_vs_ext4_meta"].as_f64().unwrap() > 0.0);
    assert!(o.get("jbd2_commits_per_fsync").is_none());
}

/// Whether the running kernel is at least `major.minor`.
fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (ma, mi) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (ma, mi) >= (major, minor)
}

/// A loop device over a file in /dev/shm (root only); detached on drop.
struct Loop {
    dev: String,
    img: PathBuf,
}
impl Loop {
    fn new(name: &str) -> Option<Loop> {
        if !aios::core::sys::is_root() {
            eprintln!("SKIPPED: loop devices need root");
            return None;
        }
        let img = PathBuf::from(format!(
            "/dev/shm/aios-cli-{name}-{}.img",
            std::process::id()
        ));
        std::fs::write(&img, vec![1u8; 8 << 20]).unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show", "--direct-io=on"])
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let l = Loop { dev, img };
        // The kernel keeps the write-cache setting across attachments: start from the default.
        std::fs::write(l.write_cache_attr(), "write back").unwrap();
        Some(l)
    }
    fn write_cache_attr(&self) -> String {
        let name = self.dev.trim_start_matches("/dev/");
        format!("/sys/block/{name}/queue/write_cache")
    }
}
impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::fs::write(self.write_cache_attr(), "write back");
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
        let _ = std::fs::remove_file(&self.img);
    }
}

#[test]
fn probe_reads_whether_a_block_device_has_a_volatile_write_cache() {
    let Some(l) = Loop::new("vwc") else { return };
    let probe = || probe_json(&l.dev, 5);
    // A loop device starts as "write back": it has a volatile cache.
    assert_eq!(probe()["volatile_write_cache"], true);
    let name = l.dev.trim_start_matches("/dev/");
    std::fs::write(
        format!("/sys/block/{name}/queue/write_cache"),
        "write through",
    )
    .unwrap();
    assert_eq!(probe()["volatile_write_cache"], false);
}

#[test]
fn bench_ordered_runs_rio_with_a_pmr_and_a_block_log_and_refuses_a_block_log_on_sim() {
    let dir = std::env::temp_dir().join(format!("aios-cli-ordered-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ordered.img");
    let out = aios()
        .args(["bench", "ordered", "--device"])
        .arg(&path)
        .args([
            "--size",
            "64m",
            "--streams",
            "1",
            "--modes",
            "rio,orderless",
            "--log",
            "pmr,block",
            "--batch",
            "4",
            "--seconds",
            "0.1",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let lines = json_lines(&out);
    let block = lines
        .iter()
        .find(|l| l["mode"] == "rio" && l["log"] == "block")
        .expect("a rio run with the block log");
    assert!(block["log_syncs"].as_u64().unwrap() > 0, "{block}");
    assert!(block["log_sync_us_mean"].as_f64().unwrap() > 0.0, "{block}");
    assert!(block["lat_us_mean"].as_f64().unwrap() > 0.0, "{block}");
    let pmr = lines
        .iter()
        .find(|l| l["mode"] == "rio" && l["log"] == "pmr")
        .expect("a rio run with the PMR log");
    assert!(pmr.get("log_syncs").is_none(), "{pmr}");
    assert!(lines.iter().any(|l| l["mode"] == "orderless"));
    assert!(!path.exists(), "the bench removes the file it created");
    std::fs::remove_dir_all(&dir).unwrap();

    let out = aios()
        .args(["bench", "ordered", "--device", "sim", "--log", "block"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("--log block") && e.contains("device path"),
        "{e}"
    );
}

#[test]
fn bench_ordered_on_sim_reads_latencies_on_the_simulated_clock() {
    let out = aios()
        .args([
            "bench",
            "ordered",
            "--device",
            "sim",
            "--streams",
            "1",
            "--modes",
            "rio,sync,orderless",
            "--sim-writes",
            "2000",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let lines = json_lines(&out);
    let sync = lines
        .iter()
        .find(|l| l["mode"] == "sync" && l.get("round").is_some())
        .expect("a sync run");
    assert_eq!(sync["clock"], "simulated");
    // One write at a time: the writes' latencies add up to the run's simulated time.
    let per_write = sync["seconds"].as_f64().unwrap() * 1e6 / sync["writes"].as_f64().unwrap();
    let mean = sync["lat_us_mean"].as_f64().unwrap();
    assert!(
        (mean - per_write).abs() <= per_write * 0.01,
        "mean {mean} µs, {per_write} µs of simulated time per write: {sync}"
    );
    // The CPU time on sim is the simulator's: no CPU-efficiency ratio.
    let rio = lines
        .iter()
        .find(|l| l["mode"] == "rio")
        .expect("a rio run");
    assert!(rio["iops_vs_orderless"].as_f64().is_some(), "{rio}");
    assert!(
        rio.get("cpu_eff_vs_orderless").is_none_or(|v| v.is_null()),
        "{rio}"
    );
}

#[test]
fn mkfs_then_fsck_and_the_exit_codes_of_fsck() {
    let img = Scratch::new("mkfs", 0);
    let out = aios()
        .args([
            "mkfs",
            "--size",
            "32m",
            "--journals",
            "1",
            "--journal-blocks",
            "64",
        ])
        .arg(&img.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("8192 blocks of 4 KiB"));
    // A second mkfs refuses and changes nothing.
    let again = aios().arg("mkfs").arg(&img.0).output().unwrap();
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));
    let ok = aios()
        .args(["fsck", "--json"])
        .arg(&img.0)
        .output()
        .unwrap();
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    let v: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(v["clean"], true);
    assert_eq!(v["directories"], 1);
    // Damage (a bit of the root directory's inode) is exit status 4, with the problem named.
    let sb = aios::fs::read_superblock(&img.0).unwrap();
    let byte = sb.inode_table.start * 4096 + 256 + 30;
    let mut bytes = std::fs::read(&img.0).unwrap();
    bytes[byte as usize] ^= 1;
    std::fs::write(&img.0, &bytes).unwrap();
    let bad = aios().arg("fsck").arg(&img.0).output().unwrap();
    assert_eq!(bad.status.code(), Some(4));
    assert!(String::from_utf8_lossy(&bad.stdout).contains("inode 1: checksum mismatch"));
    // Mounting it refuses with the problem named, and changes nothing (no FUSE needed: the
    // check comes first).
    let mp = std::env::temp_dir().join(format!("aios-cli-mnt-{}", std::process::id()));
    std::fs::create_dir_all(&mp).unwrap();
    let m = aios()
        .args(["mount", "--foreground"])
        .arg(&img.0)
        .arg(&mp)
        .output()
        .unwrap();
    assert!(!m.status.success());
    let e = String::from_utf8_lossy(&m.stderr);
    assert!(
        e.contains("inode 1: checksum mismatch") && e.contains("was not changed"),
        "{e}"
    );
    assert!(
        std::fs::read(&img.0).unwrap() == bytes,
        "a refused mount wrote to the image"
    );
    // Not an aiosfs: exit status 8, and mount refuses it the same way.
    let junk = Scratch::new("fsck-junk", 1 << 20);
    let foreign = aios().arg("fsck").arg(&junk.0).output().unwrap();
    assert_eq!(foreign.status.code(), Some(8));
    assert!(String::from_utf8_lossy(&foreign.stderr).contains("not an aiosfs image"));
    let before = std::fs::read(&junk.0).unwrap();
    let m = aios()
        .args(["mount", "--foreground"])
        .arg(&junk.0)
        .arg(&mp)
        .output()
        .unwrap();
    assert!(!m.status.success());
    assert!(String::from_utf8_lossy(&m.stderr).contains("not an aiosfs image"));
    assert!(std::fs::read(&junk.0).unwrap() == before);
    let _ = std::fs::remove_dir(&mp);
}

/// The route follows from whether io_uring hands the probe's reads to an io-wq worker: it does
/// for a file in /dev/shm opened O_DIRECT (tmpfs reads cannot be issued without blocking), and
/// it does not for a loop device, however its latency swings.
#[test]
fn probe_sees_io_uring_punt_to_io_wq_on_tmpfs_and_not_on_a_loop_device() {
    let shm = format!("/dev/shm/aios-cli-punt-{}.img", std::process::id());
    std::fs::write(&shm, vec![3u8; 4 << 20]).unwrap();
    let v = probe_json(&shm, 10);
    let _ = std::fs::remove_file(&shm);
    assert!(v["io_wq_workers"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["punts_to_io_wq"], true, "{v}");
    assert_eq!(v["critical_route"], "sync pread/pwrite", "{v}");
    assert!(v["critical_reason"]
        .as_str()
        .unwrap()
        .contains("io-wq worker(s) served its reads"));

    let Some(l) = Loop::new("punt") else { return };
    for _ in 0..3 {
        let v = probe_json(&l.dev, 10);
        assert_eq!(v["io_wq_workers"], 0, "{v}");
        assert_eq!(v["critical_route"], "io_uring", "{v}");
    }
}

/// Settings that cannot work are refused up front, naming the option and what it takes: not
/// taken for another value (a block size past u64), not blamed on the device, not found out
/// after the whole bench ran (the plot), not run anyway (zero seconds over the network).
#[test]
fn bench_refuses_settings_naming_the_option_not_something_else() {
    let f = Scratch::new("refuse", 1 << 20);
    let path = f.0.to_str().unwrap();
    let fails = |args: &[&str]| {
        let out = aios().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // 2^54 + 4 KiB wrapped to 4 KiB in the multiplication.
    let e = fails(&[
        "bench",
        "lbio",
        "--bs",
        "18014398509481988k",
        "--device",
        "/nonexistent-dir/x.img",
    ]);
    assert!(e.contains("18014398509481988k"), "{e}");
    let e = fails(&[
        "bench",
        "lbio",
        "--device",
        path,
        "--span",
        "1k",
        "--seconds",
        "0.1",
    ]);
    assert!(e.contains("--span 1024") && e.contains("4096"), "{e}");
    let e = fails(&["bench", "scale", "--device", "mem", "--qd", "300"]);
    assert!(e.contains("--qd 300") && e.contains("--slots"), "{e}");
    let e = fails(&["bench", "lbio", "--seconds", "inf"]);
    assert!(e.contains("--seconds inf") && e.contains("finite"), "{e}");
    let plot = format!("/var/tmp/aios-cli-plot-{}.txt", std::process::id());
    for args in [
        &["bench", "lbio", "--device", "/nonexistent-dir/x.img"][..],
        &[
            "bench",
            "scale",
            "--device",
            "mem",
            "--size",
            "4m",
            "--threads",
            "1",
            "--rounds",
            "1",
            "--seconds",
            "0.1",
        ][..],
    ] {
        let out = aios().args(args).args(["--plot", &plot]).output().unwrap();
        let _ = std::fs::remove_file(&plot);
        assert!(!out.status.success(), "{args:?} should fail");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains("--plot") && e.contains(".png"), "{args:?}: {e}");
        assert!(out.stdout.is_empty(), "{args:?} ran the bench: {e}");
    }
    // A hot set under a page is not blamed on the device, after the cold runs.
    let e = fails(&["bench", "pagecache", "--device", path, "--hot", "1k"]);
    assert!(e.contains("--hot 1024"), "{e}");
    assert!(!e.contains("device:"), "{e}");
    let e = fails(&[
        "bench",
        "fsync",
        "--device",
        path,
        "--destructive",
        "--modes",
        "ext4",
        "--ext4-dir",
        "/nonexistent-dir",
    ]);
    assert!(e.contains("--ext4-dir /nonexistent-dir"), "{e}");
    // Over the network: the checks of the local bench apply too.
    let e = fails(&[
        "bench",
        "ordered",
        "--targets",
        "127.0.0.1:1",
        "--seconds",
        "0",
    ]);
    assert!(e.contains("--seconds 0"), "{e}");
    let e = fails(&["bench", "ordered", "--targets", "netns:0"]);
    assert!(e.contains("netns:0") && e.contains("1 or more"), "{e}");
    // Local-device options over the network, and a stripe without a volume, are refused rather
    // than ignored.
    for opt in [
        &["--log", "block"][..],
        &["--sim-writes", "100"],
        &["--flush-ahead", "8"],
        &["--device", "sim"],
        &["--destructive"],
    ] {
        let mut args = vec!["bench", "ordered", "--targets", "127.0.0.1:1"];
        args.extend_from_slice(opt);
        let e = fails(&args);
        assert!(
            e.contains(opt[0]) && e.contains("--targets"),
            "{opt:?}: {e}"
        );
    }
    let e = fails(&["bench", "ordered", "--device", "sim", "--stripe", "64k"]);
    assert!(e.contains("--stripe") && e.contains("--targets"), "{e}");
    // It became the minimum (now 32) without a word.
    let img = format!("/var/tmp/aios-cli-jb-{}.img", std::process::id());
    let e = fails(&["mkfs", &img, "--size", "64m", "--journal-blocks", "0"]);
    assert!(!std::path::Path::new(&img).exists(), "{img} was made");
    assert!(e.contains("--journal-blocks") && e.contains("32.."), "{e}");
}

/// `--in-capsule 0` is what its help says: every write's data follows an R2T.
#[test]
fn target_takes_in_capsule_0() {
    let f = Scratch::new("target-r2t", 1 << 20);
    let (mut child, _log, first) = spawn_target(&f.0, &["--in-capsule", "0"]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(first.contains("aios target: serving"), "{first}");
}

/// `aios target` on `dev` with `opts`, listening on a free loopback port: the child, its log
/// (stderr) and the log's first line (the "serving … on ADDR" line once it listens).
fn spawn_target(
    dev: &std::path::Path,
    opts: &[&str],
) -> (
    std::process::Child,
    std::io::BufReader<std::process::ChildStderr>,
    String,
) {
    use std::io::BufRead;
    let mut child = aios()
        .args(["target", "--listen", "127.0.0.1:0"])
        .args(opts)
        .arg("--device")
        .arg(dev)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    let _ = log.read_line(&mut first);
    (child, log, first)
}

/// `aios target --max-connections N` serves N connections at once: one more is closed when
/// accepted, and the log says why, naming the option.
#[test]
fn target_refuses_connections_past_max_connections() {
    use std::io::{BufRead, Read};
    let f = Scratch::new("target-maxconn", 1 << 20);
    let (mut child, mut log, first) = spawn_target(&f.0, &["--max-connections", "1"]);
    let addr = first
        .split(" on ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok());
    let Some(addr) = addr else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("no address in {first:?}");
    };
    // Accepted in the order they come: the first is served, the second is one too many.
    let _served = std::net::TcpStream::connect(addr).unwrap();
    let mut extra = std::net::TcpStream::connect(addr).unwrap();
    extra
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let got = extra.read(&mut [0u8; 64]);
    let closed = matches!(got, Ok(0))
        || matches!(&got, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset);
    let mut line = String::new();
    if closed {
        let _ = log.read_line(&mut line);
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(closed, "the second connection with 1 allowed: {got:?}");
    assert!(
        line.contains("refused") && line.contains("--max-connections 1"),
        "{line}"
    );
}

/// A failed mkfs removes the file its --size created; a mount refused for its --cache-size
/// leaves the image as it was (not marked mounted).
#[test]
fn failed_mkfs_and_mount_leave_nothing_behind() {
    let new = PathBuf::from(format!(
        "/var/tmp/aios-cli-mkfs-new-{}.img",
        std::process::id()
    ));
    let out = aios()
        .args(["mkfs", "--size", "1k"])
        .arg(&new)
        .output()
        .unwrap();
    let left = new.exists();
    let _ = std::fs::remove_file(&new);
    assert!(!out.status.success());
    assert!(!left, "the failed mkfs left {}", new.display());

    let img = Scratch::new("mount-cache", 0);
    let out = aios()
        .args(["mkfs", "--size", "32m"])
        .arg(&img.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = std::fs::read(&img.0).unwrap();
    let mp = std::env::temp_dir().join(format!("aios-cli-mnt-cache-{}", std::process::id()));
    std::fs::create_dir_all(&mp).unwrap();
    let m = aios()
        .args(["mount", "--foreground", "--cache-size", "1k"])
        .arg(&img.0)
        .arg(&mp)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&mp);
    assert!(!m.status.success());
    let e = String::from_utf8_lossy(&m.stderr);
    assert!(e.contains("--cache-size") && e.contains("8k"), "{e}");
    assert!(
        std::fs::read(&img.0).unwrap() == before,
        "a refused mount wrote to the image"
    );
    // A missing mountpoint is named as the mountpoint (it read "IMAGE: MOUNTPOINT: …"), and
    // refused before a background file system and its log are made.
    let missing = mp.join("missing");
    let name = img.0.file_name().unwrap().to_string_lossy().to_string();
    let log = PathBuf::from(format!("/var/tmp/aios-mount-{name}.log"));
    let m = aios()
        .arg("mount")
        .arg(&img.0)
        .arg(&missing)
        .output()
        .unwrap();
    let made_log = log.exists();
    let _ = std::fs::remove_file(&log);
    assert!(!m.status.success());
    let e = String::from_utf8_lossy(&m.stderr);
    assert!(
        e.contains(&format!("mountpoint {}", missing.display())),
        "{e}"
    );
    assert!(!made_log, "the refused mount left {}", log.display());
}

/// Run `aios ARGS`, send it SIGINT once a line of its stderr holds `ready`, and wait for it:
/// its process id, exit code and stderr up to that line (not read to its end: a process the
/// bench left running would hold it open).
fn interrupt_when(args: &[&str], ready: &str) -> (u32, Option<i32>, String) {
    use std::io::BufRead;
    let mut child = aios()
        .args(args)
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    let mut line = String::new();
    while err.read_line(&mut line).unwrap_or(0) > 0 {
        seen.push_str(&line);
        if line.contains(ready) {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            break;
        }
        line.clear();
    }
    let st = child.wait().unwrap();
    assert!(seen.contains(ready), "never saw {ready:?}: {seen}");
    (child.id(), st.code(), seen)
}

/// Ctrl-C in the middle of a run removes the file the bench created for it.
#[test]
fn an_interrupted_bench_removes_the_file_it_created() {
    let p = format!("/var/tmp/aios-cli-sigint-{}.img", std::process::id());
    let (_, code, err) = interrupt_when(
        &[
            "bench",
            "lbio",
            "--device",
            &p,
            "--size",
            "16m",
            "--seconds",
            "60",
            "--completion",
            "wait",
            "--settle-ms",
            "0",
        ],
        "bench round 1/1",
    );
    let left = std::path::Path::new(&p).exists();
    let _ = std::fs::remove_file(&p);
    assert!(!left, "the interrupted bench left {p}: {err}");
    assert_eq!(code, Some(130), "{err}");
}

/// Ctrl-C in a run over network namespaces removes the namespaces and the targets' files.
#[test]
fn an_interrupted_network_bench_removes_its_namespaces() {
    if !aios::core::sys::is_root() {
        eprintln!("SKIPPED: network namespaces need root");
        return;
    }
    let (pid, code, err) = interrupt_when(
        &[
            "bench",
            "ordered",
            "--targets",
            "netns:1",
            "--size",
            "16m",
            "--seconds",
            "60",
            "--rounds",
            "1",
            "--modes",
            "orderless",
        ],
        "round 1/1",
    );
    // The names aios::netlab gives the first target's namespace, link and device.
    let tag = pid % 10000;
    let (ns, link, img) = (
        format!("aios-t0-{tag}"),
        format!("aih0-{tag}"),
        format!("/dev/shm/aios-netlab-{tag}-0.img"),
    );
    let netns = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left_ns = String::from_utf8_lossy(&netns.stdout).contains(&ns);
    let left_img = std::path::Path::new(&img).exists();
    // Whatever the bench left, this test does not: the target process, link, namespace, file.
    if let Ok(pids) = Command::new("ip").args(["netns", "pids", &ns]).output() {
        for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
            let _ = Command::new("kill").arg(pid).status();
        }
    }
    let _ = Command::new("ip").args(["link", "del", &link]).output();
    let _ = Command::new("ip").args(["netns", "del", &ns]).output();
    let _ = std::fs::remove_file(&img);
    assert!(
        !left_ns && !left_img,
        "left {ns}: {left_ns}, {img}: {left_img}; {err}"
    );
    assert_eq!(code, Some(130), "{err}");
}

/// A `--seconds` too long for a deadline on the clock is refused up front: it passed the check
/// (finite, above 0) and panicked when the first run computed its deadline (exit 101), after
/// the device was made.
#[test]
fn bench_refuses_seconds_past_what_the_clock_holds() {
    let p = format!("/var/tmp/aios-cli-long-{}.img", std::process::id());
    for args in [
        &[
            "bench",
            "lbio",
            "--device",
            &p,
            "--size",
            "4m",
            "--seconds",
            "1e30",
            "--completion",
            "wait",
            "--settle-ms",
            "0",
        ][..],
        &[
            "bench",
            "scale",
            "--device",
            "mem",
            "--size",
            "4m",
            "--threads",
            "1",
            "--rounds",
            "1",
            "--seconds",
            "1e19",
            "--settle-ms",
            "0",
        ][..],
    ] {
        let out = aios().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let e = refused_before_a_device(out, &p, &format!("{args:?}"));
        assert!(
            e.contains("--seconds") && e.contains("at most"),
            "{args:?}: {e}"
        );
    }
}

/// `bench fsync`'s settings are checked before its devices are made: the rio modes with fewer
/// --areas than threads were refused only after the journal's device (and, on ull, a second
/// device made ext4) had been prepared and the table's header printed.
#[test]
fn bench_fsync_refuses_its_settings_before_preparing_a_device() {
    let p = format!("/var/tmp/aios-cli-fsync-areas-{}.img", std::process::id());
    let out = aios()
        .args([
            "bench",
            "fsync",
            "--device",
            &p,
            "--size",
            "64m",
            "--modes",
            "rio-blocklog",
            "--threads",
            "2",
            "--areas",
            "1",
            "--seconds",
            "0.1",
        ])
        .output()
        .unwrap();
    let e = refused_before_a_device(out, &p, "--areas 1 with 2 threads");
    assert!(e.contains("--areas"), "{e}");
}

/// `--slots` past what an lbio array takes is refused by name before a device is made: above
/// 2^31 it overflowed (a panic in debug builds) while the engine was sized, and up to there
/// lbio refused it after the device was ready, naming no option.
#[test]
fn bench_refuses_slots_past_lbio_s_limit_naming_the_option() {
    let p = format!("/var/tmp/aios-cli-slots-{}.img", std::process::id());
    for (args, slots) in [
        (
            &[
                "bench",
                "scale",
                "--device",
                "mem",
                "--size",
                "4m",
                "--threads",
                "1",
                "--rounds",
                "1",
                "--seconds",
                "0.1",
                "--settle-ms",
                "0",
                "--qd",
                "1",
            ][..],
            "4294967295",
        ),
        (
            &[
                "bench",
                "lbio",
                "--device",
                &p,
                "--size",
                "4m",
                "--seconds",
                "0.1",
                "--completion",
                "wait",
                "--settle-ms",
                "0",
            ][..],
            "2000000",
        ),
    ] {
        let out = aios().args(args).args(["--slots", slots]).output().unwrap();
        let e = refused_before_a_device(out, &p, &format!("{args:?}"));
        assert!(e.contains("--slots") && e.contains(slots), "{args:?}: {e}");
    }
}

/// Over the network a stream count is 16 bits: `--streams 65537` ran as 1 stream (65536 as
/// none) and failed on something else. It is refused by name before any connection.
#[test]
fn bench_ordered_over_the_network_refuses_streams_past_16_bits() {
    for n in ["65536", "65537"] {
        let out = aios()
            .args([
                "bench",
                "ordered",
                "--targets",
                "127.0.0.1:1",
                "--seconds",
                "0.1",
                "--streams",
                n,
            ])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{n}: {e}");
        assert!(e.contains(&format!("--streams {n}")), "{n}: {e}");
        assert!(out.stdout.is_empty(), "{n}: printed {:?}", out.stdout);
    }
}

/// `aios target` refuses an attribute log it cannot hold, naming the option, before it opens
/// the device or listens: `--log-bytes 100g` aborted the process on the allocation ("memory
/// allocation of 107374182400 bytes failed"), and `--attr-log file:` (no path) said only ": No
/// such file or directory". (Found by a review of the CLI on 2026-11-28.)
#[test]
fn target_refuses_a_log_it_cannot_hold_naming_the_option() {
    let dev = format!("/var/tmp/aios-cli-target-log-{}.img", std::process::id());
    std::fs::File::create(&dev)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    for (args, name) in [
        (&["--log-bytes", "100g"][..], "--log-bytes"),
        (
            &["--attr-log", "file:", "--log-bytes", "1m"][..],
            "--attr-log",
        ),
    ] {
        let out = aios()
            .args(["target", "--listen", "127.0.0.1:0", "--device", &dev])
            .args(args)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        if out.status.code() != Some(1) || !e.contains(name) {
            let _ = std::fs::remove_file(&dev);
        }
        assert_eq!(out.status.code(), Some(1), "{args:?}: {e}");
        assert!(e.contains(name), "{args:?}: {e}");
    }
    // A log serves 1 to 64 streams: 0 was refused by the log without naming the option.
    for n in ["0", "65"] {
        let out = aios()
            .args(["target", "--listen", "127.0.0.1:0", "--device", &dev])
            .args(["--streams", n])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !e.contains("--streams") {
            let _ = std::fs::remove_file(&dev);
        }
        assert!(!out.status.success(), "--streams {n} was taken");
        assert!(e.contains("--streams"), "--streams {n}: {e}");
    }
    std::fs::remove_file(&dev).unwrap();
}

/// `--device mem` is lbio's RAM backend (`bench scale`), never a file called `mem`: `bench lbio`,
/// `bench pagecache` and `bench fsync` created and filled `./mem` in the working directory and
/// ran on it. They cannot run on RAM and refuse it by name, before a device is made.
/// `bench scale`'s device list names `--device` when an element is empty (`--device ,` said only
/// "no device to run on") or is `ull` or `mem`, which in a list were taken as file paths.
/// (Found by a review of the CLI on 2026-11-28.)
#[test]
fn benches_refuse_mem_and_bad_device_lists_naming_the_option() {
    // The working directory of the runs, removed with whatever they left in it.
    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let d = Dir(PathBuf::from(format!(
        "/var/tmp/aios-cli-mem-{}",
        std::process::id()
    )));
    let dir = &d.0;
    std::fs::create_dir_all(dir).unwrap();
    let mem = dir.join("mem");
    let mem = mem.to_str().unwrap();
    let quick = ["--seconds", "0.1", "--rounds", "1", "--size", "4m"];
    for (args, want) in [
        (
            &["bench", "lbio", "--device", "mem", "--completion", "wait"][..],
            "--device mem",
        ),
        (&["bench", "pagecache", "--device", "mem"], "--device mem"),
        (
            &["bench", "fsync", "--device", "mem", "--modes", "vanilla"],
            "--device mem",
        ),
        (
            &["bench", "ordered", "--device", "mem", "--streams", "1"],
            "--device mem",
        ),
        (
            &["bench", "scale", "--device", ",", "--threads", "1"],
            "--device \",\"",
        ),
        (
            &["bench", "scale", "--device", "mem,x.img", "--threads", "1"],
            "--device \"mem,x.img\"",
        ),
    ] {
        let out = aios()
            .args(args)
            .args(quick)
            .current_dir(dir)
            .output()
            .unwrap();
        let e = refused_before_a_device(out, mem, &format!("{args:?}"));
        assert!(e.contains(want), "{args:?}: {e}");
        assert!(!dir.join("x.img").exists(), "{args:?} made x.img");
    }
    std::fs::remove_dir(dir).unwrap();
}

/// Unmounts everything mounted on a directory (a stacked mount too), waiting at most about
/// 10 s, then removes the directory.
struct MountDir(PathBuf);
impl MountDir {
    fn new(name: &str) -> MountDir {
        let p = PathBuf::from(format!("/var/tmp/aios-cli-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        MountDir(p)
    }
    fn mounted(&self) -> bool {
        let Ok(canon) = self.0.canonicalize() else {
            return false;
        };
        let want = canon.to_string_lossy().into_owned();
        std::fs::read_to_string("/proc/self/mounts")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(1) == Some(want.as_str()))
    }
}
impl Drop for MountDir {
    fn drop(&mut self) {
        for _ in 0..50 {
            if !self.mounted() {
                break;
            }
            let _ = Command::new("umount").arg(&self.0).status();
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// An image a running `aios mount` serves is refused by a second mount and by `mkfs --force`,
/// naming the image and the process: both went ahead, two file systems wrote one image, and
/// the mkfs left the mount serving blocks no longer its own. A mountpoint that is already a
/// mount point is refused by name: the wait for the background mount took the mount already
/// there for the new one and said "serving", and the new mount then hid it.
/// (Found by a review of the CLI on 2026-11-28.)
#[test]
fn mount_and_mkfs_refuse_an_image_in_use_and_a_mountpoint_already_mounted() {
    if !aios::core::sys::is_root() || !std::path::Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED: mounting through FUSE needs root and /dev/fuse");
        return;
    }
    let img = Scratch::new("inuse", 0);
    let other = Scratch::new("inuse-other", 0);
    for i in [&img.0, &other.0] {
        let out = aios()
            .args(["mkfs", "--force", "--size", "32m", "--journals", "1"])
            .arg(i)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let log = |n: &str| format!("/var/tmp/aios-cli-inuse-{n}-{}.log", std::process::id());
    let (log1, log2, log3) = (log("1"), log("2"), log("3"));
    let (mp1, mp2) = (MountDir::new("inuse-mp1"), MountDir::new("inuse-mp2"));
    let out = aios()
        .arg("mount")
        .arg(&img.0)
        .arg(&mp1.0)
        .args(["--threads", "1", "--log", &log1])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let uuid = aios::fs::read_superblock(&img.0).unwrap().uuid;

    let second = aios()
        .arg("mount")
        .arg(&img.0)
        .arg(&mp2.0)
        .args(["--threads", "1", "--log", &log2])
        .output()
        .unwrap();
    let second_mounted = mp2.mounted();
    let wiped = aios()
        .args(["mkfs", "--force"])
        .arg(&img.0)
        .output()
        .unwrap();
    let uuid_after = aios::fs::read_superblock(&img.0).map(|s| s.uuid);
    let checked = aios().arg("fsck").arg(&img.0).output().unwrap();
    let stacked = aios()
        .arg("mount")
        .arg(&other.0)
        .arg(&mp1.0)
        .args(["--threads", "1", "--log", &log3])
        .output()
        .unwrap();
    let mp1_path = mp1.0.clone();
    drop(mp2);
    drop(mp1);
    let log3_made = std::path::Path::new(&log3).exists();
    for l in [&log1, &log2, &log3] {
        let _ = std::fs::remove_file(l);
    }

    let e = String::from_utf8_lossy(&second.stderr);
    assert!(
        !second.status.success() && !second_mounted,
        "a second mount of one image went ahead: {e}"
    );
    assert!(
        e.contains(&format!("{}: in use", img.0.display())) && e.contains("aios mount"),
        "{e}"
    );
    let e = String::from_utf8_lossy(&wiped.stderr);
    assert!(
        !wiped.status.success(),
        "mkfs --force under a live mount went ahead: {e}"
    );
    assert!(e.contains(&format!("{}: in use", img.0.display())), "{e}");
    assert_eq!(uuid_after.ok(), Some(uuid), "mkfs wrote under the mount");
    // fsck still runs under a live mount (read only), but says its findings may not be real.
    let e = String::from_utf8_lossy(&checked.stderr);
    assert!(
        e.contains("warning") && e.contains("open for writing by process"),
        "fsck under a live mount gave no warning: {e}"
    );
    let e = String::from_utf8_lossy(&stacked.stderr);
    assert!(
        !stacked.status.success(),
        "a mount over a mount point went ahead: {e}"
    );
    assert!(
        e.contains(&format!(
            "mountpoint {}: already a mount point",
            mp1_path.display()
        )),
        "{e}"
    );
    assert!(!log3_made, "the refused mount made its log");
}

/// `aios mkfs --force` and `aios mount` of an image whose lock another holder has (a running
/// `aios mount` or `aios mkfs` holds it; here this test, through `aios::fs::ImageLock`) are
/// refused, naming the image and the holder's process, with the image unchanged and no mount
/// log made; once the holder lets go, mkfs goes ahead. The in-use check read /proc for
/// processes with the image open for writing, so two mounts started at the same instant both
/// passed it; the lock is taken and refused in one step. (The holder here has the image open
/// read only, which the /proc check does not see: before the lock, mkfs wrote over the image.)
#[test]
fn mkfs_and_mount_refuse_an_image_whose_lock_is_held() {
    let img = Scratch::new("locked", 0);
    let out = aios()
        .args(["mkfs", "--force", "--size", "32m", "--journals", "1"])
        .arg(&img.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = std::fs::read(&img.0).unwrap();
    let held = aios::fs::ImageLock::exclusive(&img.0).unwrap();
    let wiped = aios()
        .args(["mkfs", "--force"])
        .arg(&img.0)
        .output()
        .unwrap();
    let mp = MountDir::new("locked-mp");
    let log = format!("/var/tmp/aios-cli-locked-{}.log", std::process::id());
    let mounted = aios()
        .arg("mount")
        .arg(&img.0)
        .arg(&mp.0)
        .args(["--threads", "1", "--log", &log])
        .output()
        .unwrap();
    let was_mounted = mp.mounted();
    drop(mp);
    let log_made = std::path::Path::new(&log).exists();
    let _ = std::fs::remove_file(&log);
    let after = std::fs::read(&img.0).unwrap();
    drop(held);

    let by = format!(
        "{}: in use, locked by process {} (",
        img.0.display(),
        std::process::id()
    );
    let e = String::from_utf8_lossy(&wiped.stderr);
    assert!(
        !wiped.status.success(),
        "mkfs --force went ahead on a locked image: {e}"
    );
    assert!(e.contains(&by), "{e}");
    let e = String::from_utf8_lossy(&mounted.stderr);
    assert!(
        !mounted.status.success() && !was_mounted,
        "a mount of a locked image went ahead: {e}"
    );
    assert!(e.contains(&by), "{e}");
    assert!(after == before, "a refused command changed the image");
    assert!(!log_made, "the refused mount made its log");
    let out = aios()
        .args(["mkfs", "--force"])
        .arg(&img.0)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mkfs after the lock was let go: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A directory given as the image is refused by `aios mount` before a background file system
/// and its log are made: it started one, which failed ("Is a directory") and left its log in
/// /var/tmp. (Found by a review of the CLI on 2026-11-28.)
#[test]
fn mount_refuses_a_directory_as_the_image_leaving_no_log() {
    let dir = MountDir::new("dir-image");
    let mp = MountDir::new("dir-image-mp");
    let name = dir.0.file_name().unwrap().to_string_lossy().to_string();
    let log = PathBuf::from(format!("/var/tmp/aios-mount-{name}.log"));
    let out = aios().arg("mount").arg(&dir.0).arg(&mp.0).output().unwrap();
    let made_log = log.exists();
    let _ = std::fs::remove_file(&log);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{e}");
    assert!(
        e.contains(&format!("{}: a directory, not an image", dir.0.display())),
        "{e}"
    );
    assert!(!made_log, "the refused mount left {}", log.display());
}
