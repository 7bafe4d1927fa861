//! Process crashes of a mounted aiosfs (its own `main`, no libtest harness).
//!
//! Each run mounts the image (`aios mount --foreground`, a child process), starts an
//! fsync-heavy workload from two threads — appends fsynced every four records, overwrites of
//! eight blocks each fsynced, small files created and fsynced, older ones unlinked — and
//! SIGKILLs the file system at a random moment. Then `aios fsck` must find the image clean (as
//! the journal's replay leaves it, before anything is written), the image is mounted again and
//! every fsync-acknowledged byte must be there; the file system is unmounted with SIGTERM and
//! `aios fsck` must find it clean once more. A workload error before the kill fails the test;
//! each run starts by unlinking the files of the runs before it.
//!
//! Runs alternate in pairs between the overlapped commit and `--commit rio` (Rio-ordered
//! commits through the journal areas' attribute logs), so both transports meet both modes.
//!
//! Needs root and /dev/fuse (skips with a message otherwise). `AIOS_FS_CRASH_RUNS` (default
//! 20) and `AIOS_FS_CRASH_SEED` (to replay a kill schedule).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aios::lbio::SimRng;

const AIOS: &str = env!("CARGO_BIN_EXE_aios");
const BLK: usize = 4096;

/// A block whose every byte depends on (run, thread, kind, index, version).
fn block(run: u64, t: u64, kind: u64, idx: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLK];
    let mut x =
        (run << 48) ^ (t << 40) ^ (kind << 36) ^ (idx << 16) ^ version ^ 0x9e37_79b9_7f4a_7c15;
    for (i, chunk) in b.chunks_mut(8).enumerate() {
        if i < 4 {
            let v = [run, t, idx, version][i];
            chunk.copy_from_slice(&v.to_le_bytes());
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    b
}

#[derive(Default)]
struct Model {
    /// Records of `log-t` acknowledged (fsync returned).
    log: HashMap<u64, u64>,
    /// Block -> last acknowledged version, per thread.
    ow: HashMap<(u64, u64), u64>,
    /// Created files fsynced and not since unlinked: name -> content.
    files: HashMap<String, Vec<u8>>,
    acks: u64,
}

fn mounted(mp: &Path) -> bool {
    let want = mp.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split(' ').nth(1) == Some(want.as_str()))
    })
}

fn mount(image: &Path, mp: &Path, log: &Path, transport: &str, commit: &str) -> Child {
    let out = File::create(log).expect("log");
    let child = Command::new(AIOS)
        .args([
            "mount",
            "--foreground",
            "--transport",
            transport,
            "--commit",
            commit,
        ])
        .arg(image)
        .arg(mp)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log"))
        .stderr(out)
        .spawn()
        .expect("aios mount");
    let t0 = Instant::now();
    while !mounted(mp)
        || !std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains("aiosfs: mounted")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no mount after 60 s: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

fn fsck(image: &Path, when: &str) {
    let out = Command::new(AIOS)
        .arg("fsck")
        .arg(image)
        .output()
        .expect("aios fsck");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "aios fsck {when} exited {}:\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn workload(
    mp: PathBuf,
    run: u64,
    t: u64,
    seed: u64,
    model: Arc<Mutex<Model>>,
    stop: Arc<AtomicBool>,
) -> Result<(), (Instant, std::io::Error)> {
    let mut rng = SimRng::new(seed);
    let open = |name: &str| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(mp.join(name))
    };
    let failed = |e: std::io::Error| (Instant::now(), e);
    let log = open(&format!("r{run}-log-{t}")).map_err(failed)?;
    let ow = open(&format!("r{run}-ow-{t}")).map_err(failed)?;
    let mut created: Vec<String> = Vec::new();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let r: std::io::Result<()> = (|| {
            // Append one record; fsync every fourth.
            log.write_all_at(&block(run, t, 1, i, 0), i * BLK as u64)?;
            if i % 4 == 3 {
                log.sync_all()?;
                let mut m = model.lock().unwrap();
                m.log.insert(t, i + 1);
                m.acks += 1;
            }
            // Overwrite one of eight blocks, fsync.
            let k = rng.below(8);
            ow.write_all_at(&block(run, t, 2, k, i + 1), k * BLK as u64)?;
            ow.sync_data()?;
            {
                let mut m = model.lock().unwrap();
                m.ow.insert((t, k), i + 1);
                m.acks += 1;
            }
            // Create a small file and fsync it; unlink an old one now and then.
            if i % 3 == 0 {
                let name = format!("r{run}-c-{t}-{i}");
                let len = 1 + rng.below(3 * BLK as u64) as usize;
                let content: Vec<u8> = block(run, t, 3, i, 0)
                    .into_iter()
                    .cycle()
                    .take(len)
                    .collect();
                let mut f = File::create(mp.join(&name))?;
                f.write_all(&content)?;
                f.sync_all()?;
                let mut m = model.lock().unwrap();
                m.files.insert(name.clone(), content);
                m.acks += 1;
                created.push(name);
            }
            if i % 7 == 6 && created.len() > 4 {
                let victim = created.remove(rng.below(created.len() as u64 - 2) as usize);
                model.lock().unwrap().files.remove(&victim);
                std::fs::remove_file(mp.join(&victim))?;
            }
            Ok(())
        })();
        // An error ends the thread: the caller tells the kill's from an earlier failure.
        r.map_err(failed)?;
        i += 1;
    }
    Ok(())
}

fn verify(mp: &Path, run: u64, m: &Model) -> Result<u64, String> {
    let mut checked = 0;
    for (&t, &n) in &m.log {
        let f =
            File::open(mp.join(format!("r{run}-log-{t}"))).map_err(|e| format!("log-{t}: {e}"))?;
        let mut b = vec![0u8; BLK];
        for i in 0..n {
            f.read_exact_at(&mut b, i * BLK as u64)
                .map_err(|e| format!("log-{t} record {i} of {n} acknowledged: {e}"))?;
            if b != block(run, t, 1, i, 0) {
                return Err(format!("log-{t} record {i} of {n} acknowledged differs"));
            }
            checked += 1;
        }
    }
    for (&(t, k), &v) in &m.ow {
        let f =
            File::open(mp.join(format!("r{run}-ow-{t}"))).map_err(|e| format!("ow-{t}: {e}"))?;
        let mut b = vec![0u8; BLK];
        f.read_exact_at(&mut b, k * BLK as u64)
            .map_err(|e| format!("ow-{t} block {k}: {e}"))?;
        let got = u64::from_le_bytes(b[24..32].try_into().unwrap());
        if got < v || b != block(run, t, 2, k, got) {
            return Err(format!(
                "ow-{t} block {k}: version {v} was acknowledged, found version {got}{}",
                if got >= v {
                    " with damaged contents"
                } else {
                    ""
                }
            ));
        }
        checked += 1;
    }
    for (name, content) in &m.files {
        let mut got = Vec::new();
        File::open(mp.join(name))
            .and_then(|mut f| f.read_to_end(&mut got))
            .map_err(|e| format!("{name} (created and fsynced): {e}"))?;
        if &got != content {
            return Err(format!(
                "{name}: {} bytes, {} acknowledged, contents differ",
                got.len(),
                content.len()
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

fn stop_cleanly(mut child: Child, mp: &Path, log: &Path) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let t0 = Instant::now();
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            assert!(
                st.success(),
                "aios mount exited {st} after SIGTERM; its log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "aios mount did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !mounted(mp),
        "still mounted after the process exited; its log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

fn main() {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1).unwrap_or("1").to_string())
        });
    if uid.as_deref() != Some("0") || !Path::new("/dev/fuse").exists() {
        println!("fs_crash: skipped (needs root and /dev/fuse)");
        return;
    }
    let runs: u64 = std::env::var("AIOS_FS_CRASH_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("AIOS_FS_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!(
        "fs_crash: {runs} runs, seed {seed} (AIOS_FS_CRASH_SEED={seed} replays the kill schedule)"
    );
    let dir = std::env::temp_dir().join(format!("aios-fs-crash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("fs.img");
    let mp = dir.join("mnt");
    std::fs::create_dir_all(&mp).unwrap();
    let log = dir.join("mount.log");
    File::create(&image).unwrap().set_len(256 << 20).unwrap();
    let st = Command::new(AIOS)
        .arg("mkfs")
        .arg(&image)
        .args(["--journals", "2"])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "mkfs: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    let mut rng = SimRng::new(seed);
    let (mut total_acks, mut total_checked) = (0, 0);
    let t_all = Instant::now();
    let mut over_uring = 0;
    let mut rio_runs = 0;
    let mut runs_with_acks = 0;
    for run in 0..runs {
        // Every other run takes FUSE over io_uring when the kernel offers it; the others read
        // /dev/fuse. Runs 2 and 3 of every four commit Rio-ordered.
        let transport = if run % 2 == 0 { "auto" } else { "classic" };
        let commit = if run % 4 >= 2 { "rio" } else { "overlapped" };
        let child = mount(&image, &mp, &log, transport, commit);
        // Earlier runs' files go first, so that the image never fills however many runs there
        // are (it did after about 47, and the workload then failed with ENOSPC).
        for e in std::fs::read_dir(&mp).expect("the mount") {
            let path = e.expect("a directory entry").path();
            std::fs::remove_file(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let model = Arc::new(Mutex::new(Model::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2)
            .map(|t| {
                let (mp, model, stop) = (mp.clone(), Arc::clone(&model), Arc::clone(&stop));
                let s = rng.next_u64();
                std::thread::spawn(move || workload(mp, run, t, s, model, stop))
            })
            .collect();
        let delay = 80 + rng.below(600);
        std::thread::sleep(Duration::from_millis(delay));
        let mut child = child;
        let killed_at = Instant::now();
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        if std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("requests over io_uring")
        {
            over_uring += 1;
        }
        let _ = Command::new("umount").arg("-l").arg(&mp).status();
        for (t, w) in workers.into_iter().enumerate() {
            // Errors are expected once the file system is killed, never before.
            if let Err((at, e)) = w.join().unwrap() {
                assert!(
                    at >= killed_at,
                    "run {run} (seed {seed}): thread {t} failed {} ms before the kill: {e}\nmount log:\n{}",
                    (killed_at - at).as_millis(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        }
        let m = std::mem::take(&mut *model.lock().unwrap());
        fsck(&image, &format!("after the kill of run {run}"));
        let child = mount(&image, &mp, &log, transport, commit);
        let checked = verify(&mp, run, &m);
        let mounted_log = std::fs::read_to_string(&log).unwrap_or_default();
        let checked = match checked {
            Ok(n) => n,
            Err(e) => {
                stop_cleanly(child, &mp, &log);
                panic!("run {run} (killed after {delay} ms, seed {seed}): {e}\nmount log:\n{mounted_log}");
            }
        };
        stop_cleanly(child, &mp, &log);
        let stopped_log = std::fs::read_to_string(&log).unwrap_or_default();
        if commit == "rio" {
            // The verifying mount committed Rio-ordered on an area of its own (its unmount
            // log says how many workers did).
            assert!(
                stopped_log.contains("Rio-ordered: ") && !stopped_log.contains("Rio-ordered: 0 workers"),
                "run {run}: a --commit rio mount with no Rio-ordered worker; its log:\n{stopped_log}"
            );
            rio_runs += 1;
        }
        fsck(&image, &format!("after the clean unmount of run {run}"));
        println!(
            "run {run:2} ({commit:10}): killed after {delay:3} ms, {:4} fsyncs acknowledged, {checked:5} blocks/files checked; {}",
            m.acks,
            mounted_log.lines().find(|l| l.contains("mounted")).map_or("", |l| l.split("recovery ").nth(1).unwrap_or(""))
        );
        total_acks += m.acks;
        total_checked += checked;
        runs_with_acks += (m.acks > 0) as u64;
    }
    println!(
        "fs_crash: {runs} SIGKILLs ({over_uring} of them with FUSE over io_uring, {rio_runs} with Rio-ordered commits), {total_acks} acknowledged fsyncs, {total_checked} blocks/files checked, fsck clean every time ({:.1} s)",
        t_all.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    if runs > 0 {
        assert!(
            total_acks > 0 && total_checked > 0,
            "fs_crash (seed {seed}): {total_acks} fsyncs acknowledged and {total_checked} \
             blocks/files checked across {runs} runs: the workload did no work"
        );
        // A kill 80 ms in may come before the first fsync returns, but not in most runs.
        assert!(
            2 * runs_with_acks >= runs,
            "fs_crash (seed {seed}): only {runs_with_acks} of {runs} runs had an fsync \
             acknowledged before the kill"
        );
        // The "auto" runs (every other one, run 0 among them) take FUSE over io_uring when the
        // kernel's fuse module has it enabled.
        let uring_enabled = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
            .is_ok_and(|v| matches!(v.trim(), "Y" | "y" | "1"));
        if uring_enabled {
            assert!(
                over_uring > 0,
                "fs_crash (seed {seed}): the fuse module has enable_uring set, yet none of the \
                 {runs} runs mounted with requests over io_uring"
            );
        }
    }
}
