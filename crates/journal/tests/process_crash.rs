//! A real process crash: a child process commits transactions in a loop on an `O_DIRECT` file
//! and reports each acknowledgement to the parent over a pipe; the parent kills it with SIGKILL
//! at a random moment, recovers the journal and checks that every acknowledged commit is there,
//! and that no transaction shows up partly applied. Each repetition kills the child twice: the
//! second child starts by recovering what the first one left and commits on from there, so
//! recovery followed by more commits is covered as well. The child commits from two threads at
//! once: each into its own area (per-core journals), or, every other pair of repetitions, both
//! into one area, where their commits form groups (group commit).
//!
//! The child is this same test binary (it has no libtest harness), started with
//! `AIOS_JOURNAL_CHILD` set. `AIOS_CRASH_REPS` sets the repetitions (default 24, vanilla and
//! overlapped commit in turn); `AIOS_CRASH_SEED` replays the kill schedule of a failing run
//! (its seed is printed); `AIOS_CRASH_DIR` is where the file goes (default: the temp dir, which
//! must allow `O_DIRECT`).

use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use aios_core::{Engine, EngineConfig};
use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig, SimRng};

const BLOCK: usize = 4096;
/// Two journal areas of 32 blocks: a checkpoint every few commits, so kills land in checkpoints
/// too.
const AREAS: usize = 2;
const AREA_BLOCKS: u64 = 32;
const HOME: u64 = AREAS as u64 * AREA_BLOCKS;
/// Committing threads in the child, each with its own blocks.
const THREADS: u64 = 2;
/// Blocks of one thread: thread t's commit i writes metadata blocks M1 + i % 5 and M2 + i % 3 and
/// data block D + i % 64, all offset by t * PER_THREAD.
const M1: u64 = 0;
const M2: u64 = 5;
const D: u64 = 8;
const DATA_BLOCKS: u64 = 64;
const PER_THREAD: u64 = D + DATA_BLOCKS;
const FILE_BYTES: u64 = (HOME + THREADS * PER_THREAD) * BLOCK as u64;

fn blocks_of(t: u64, i: u64) -> [u64; 3] {
    let base = HOME + t * PER_THREAD;
    [
        base + M1 + i % 5,
        base + M2 + i % 3,
        base + D + i % DATA_BLOCKS,
    ]
}

/// Block `b` as commit `i` writes it: the pair (i + 1, b) and a fill derived from both.
fn content(i: u64, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    v[..8].copy_from_slice(&(i + 1).to_le_bytes());
    v[8..16].copy_from_slice(&b.to_le_bytes());
    let mut x = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b;
    for c in v[16..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// Which commit wrote this block image: `Ok(None)` for the initial zeros, `Err` for anything that
/// no commit wrote (torn or foreign bytes).
fn decode(bytes: &[u8], b: u64) -> Result<Option<u64>, String> {
    if bytes.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let i1 = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    if i1 == 0 || bytes != content(i1 - 1, b).as_slice() {
        return Err(format!("block {b} holds bytes no commit wrote"));
    }
    Ok(Some(i1 - 1))
}

fn stack(path: &Path) -> (Rc<Engine>, Rc<LbioArray>, Device, Device) {
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 2 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine");
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).expect("lbio");
    let cfg = || DeviceConfig {
        write: true,
        ..DeviceConfig::default()
    };
    let a = Device::open(&lbio, path, cfg()).expect("open the journal file");
    let b = Device::open(&lbio, path, cfg()).expect("open the journal file");
    (engine, lbio, a, b)
}

fn layout() -> Layout {
    Layout::per_core(0, AREA_BLOCKS, AREAS)
}

/// The child: format (first phase) or recover (second), then THREADS threads commit, thread t
/// from index `start[t]` on, each writing `(t, i)` to stdout once commit i is acknowledged. With
/// `shared`, both threads commit into area 0 (group commit); otherwise thread t into area t.
/// Runs until killed.
fn child(
    path: &Path,
    mode: CommitMode,
    start: [u64; THREADS as usize],
    format: bool,
    shared: bool,
) -> ! {
    // A panic anywhere (a commit that failed, a broken ack pipe) ends the whole process at once
    // with its own exit code: otherwise the other thread would commit on until the parent's
    // SIGKILL, and the parent would take the run for a good one.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        std::process::exit(CHILD_PANICKED);
    }));
    let set = {
        let (_engine, _lbio, a, _) = stack(path);
        if format {
            JournalSet::format(&a, layout()).expect("format")
        } else {
            JournalSet::open(&a, layout()).expect("recover").0
        }
    };
    let out = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (set, out, path) = (set.clone(), out.clone(), path.to_path_buf());
            std::thread::spawn(move || {
                let (_engine, _lbio, dev, _) = stack(&path);
                let area = if shared { 0 } else { t as usize };
                let j = Journal::new(&set, area, dev, mode).expect("journal");
                for i in start[t as usize].. {
                    let [m1, m2, d] = blocks_of(t, i);
                    let mut tx = Tx::new();
                    tx.write_data(d, &content(i, d))
                        .and_then(|tx| tx.write_meta(m1, &content(i, m1)))
                        .and_then(|tx| tx.write_meta(m2, &content(i, m2)))
                        .expect("build tx");
                    j.commit(&tx).expect("commit");
                    // Acknowledged: tell the parent.
                    let mut msg = [0u8; 16];
                    msg[..8].copy_from_slice(&t.to_le_bytes());
                    msg[8..].copy_from_slice(&i.to_le_bytes());
                    let mut o = out.lock().unwrap();
                    o.write_all(&msg).expect("ack pipe");
                    o.flush().expect("ack pipe");
                }
            })
        })
        .collect();
    for t in threads {
        let _ = t.join();
    }
    // A thread only ends by panicking (its message is on stderr), and the hook exits first.
    std::process::exit(2)
}

/// The child's exit code when any of its threads panicked.
const CHILD_PANICKED: i32 = 3;

/// What the parent knows, per thread: the highest index it may have started (`issued`), and the
/// acknowledged indices.
struct Model {
    issued: [Option<u64>; THREADS as usize],
    acked: [Vec<u64>; THREADS as usize],
}

impl Model {
    fn last_acked_writer(&self, t: u64, b: u64) -> Option<u64> {
        self.acked[t as usize]
            .iter()
            .rev()
            .copied()
            .find(|&i| blocks_of(t, i).contains(&b))
    }

    /// Check the recovered file: each block holds the version of a commit that wrote it, no
    /// older than its last acknowledged writer and not beyond what was issued; and whatever
    /// commit a metadata block shows, that commit's other blocks are at least as new.
    fn check(&self, file: &std::fs::File) -> Result<(), String> {
        for t in 0..THREADS {
            let base = HOME + t * PER_THREAD;
            let issued = self.issued[t as usize];
            let mut seen = std::collections::HashMap::new();
            for b in base..base + PER_THREAD {
                let mut buf = vec![0u8; BLOCK];
                file.read_exact_at(&mut buf, b * BLOCK as u64)
                    .map_err(|e| format!("reading block {b}: {e}"))?;
                let got = decode(&buf, b)?;
                if let Some(j) = got {
                    if !blocks_of(t, j).contains(&b) || issued.is_none_or(|n| j > n) {
                        return Err(format!(
                            "block {b} holds thread {t}'s commit {j}, which never wrote it \
                             (issued up to {issued:?})"
                        ));
                    }
                }
                if let Some(l) = self.last_acked_writer(t, b) {
                    if got.is_none_or(|j| j < l) {
                        return Err(format!(
                            "block {b}: thread {t}'s acknowledged commit {l} is lost (the block \
                             holds {got:?})"
                        ));
                    }
                }
                seen.insert(b, got);
            }
            for b in base..base + D {
                if let Some(Some(j)) = seen.get(&b) {
                    for other in blocks_of(t, *j) {
                        let o = seen[&other];
                        if o.is_none_or(|o| o < *j) {
                            return Err(format!(
                                "thread {t}'s commit {j} is partly applied: block {b} holds it, \
                                 block {other} holds {o:?}"
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

struct Run {
    acks: Vec<(u64, u64)>,
    killed_after: Duration,
}

/// Start a child, kill it `delay` after its first acknowledgement, and collect every ack.
fn run_child(
    path: &Path,
    mode: CommitMode,
    start: [u64; THREADS as usize],
    format: bool,
    shared: bool,
    delay: Duration,
) -> Result<Run, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("AIOS_JOURNAL_CHILD", path)
        .env("AIOS_JOURNAL_MODE", mode.name())
        .env("AIOS_JOURNAL_START", start.map(|s| s.to_string()).join(","))
        .env("AIOS_JOURNAL_FORMAT", if format { "1" } else { "0" })
        .env("AIOS_JOURNAL_SHARED", if shared { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning the child: {e}"))?;
    let mut pipe = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut acks = Vec::new();
        let mut b = [0u8; 16];
        while pipe.read_exact(&mut b).is_ok() {
            let t = u64::from_le_bytes(b[..8].try_into().unwrap());
            let i = u64::from_le_bytes(b[8..].try_into().unwrap());
            if acks.is_empty() {
                let _ = tx.send(());
            }
            acks.push((t, i));
        }
        acks
    });
    let first = rx.recv_timeout(Duration::from_secs(60));
    let t0 = Instant::now();
    if first.is_ok() {
        std::thread::sleep(delay);
    }
    let _ = child.kill(); // SIGKILL
    let status = child.wait().map_err(|e| e.to_string())?;
    let acks = reader.join().unwrap();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    if status.code() == Some(CHILD_PANICKED) {
        return Err(format!(
            "a thread of the child panicked (exit code {CHILD_PANICKED}: a commit or an ack \
             failed); its stderr:\n{err}"
        ));
    }
    if first.is_err() || status.signal() != Some(libc_sigkill()) {
        return Err(format!(
            "the child did not run until killed ({status}); its stderr:\n{err}"
        ));
    }
    // A panic just before the kill (the hook had not exited yet) still shows on stderr.
    if err.contains("panicked") {
        return Err(format!(
            "a thread of the child panicked before the kill; its stderr:\n{err}"
        ));
    }
    Ok(Run {
        acks,
        killed_after: t0.elapsed(),
    })
}

fn libc_sigkill() -> i32 {
    9
}

fn main() {
    if let Some(path) = std::env::var_os("AIOS_JOURNAL_CHILD") {
        let mode = match std::env::var("AIOS_JOURNAL_MODE").as_deref() {
            Ok("vanilla") => CommitMode::Vanilla,
            Ok("one-write") => CommitMode::OneWrite,
            _ => CommitMode::Overlapped,
        };
        let mut start = [0u64; THREADS as usize];
        if let Ok(s) = std::env::var("AIOS_JOURNAL_START") {
            for (slot, v) in start.iter_mut().zip(s.split(',')) {
                *slot = v.parse().expect("AIOS_JOURNAL_START: indices");
            }
        }
        let format = std::env::var("AIOS_JOURNAL_FORMAT").as_deref() == Ok("1");
        let shared = std::env::var("AIOS_JOURNAL_SHARED").as_deref() == Ok("1");
        child(Path::new(&path), mode, start, format, shared);
    }
    // Under `cargo test` libtest options may be passed; a listing run (`--list`) gets one line.
    if std::env::args().any(|a| a == "--list") {
        println!("process_crash: test");
        return;
    }
    let reps: u32 = std::env::var("AIOS_CRASH_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let seed: u64 = std::env::var("AIOS_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    let dir: PathBuf = std::env::var_os("AIOS_CRASH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    println!(
        "process crash: {reps} repetitions, AIOS_CRASH_SEED={seed}, files in {}",
        dir.display()
    );
    let mut rng = SimRng::new(seed);
    let path = dir.join(format!("aios-journal-crash-{}.img", std::process::id()));
    let mut total_acks = 0usize;
    let mut failures = Vec::new();
    for rep in 0..reps {
        let mode = match rep % 3 {
            0 => CommitMode::Vanilla,
            1 => CommitMode::Overlapped,
            _ => CommitMode::OneWrite,
        };
        // Every other pair of repetitions, both threads share area 0 (group commit).
        let shared = rep % 4 >= 2;
        let r = (|| -> Result<String, String> {
            let f = std::fs::File::create(&path).map_err(|e| e.to_string())?;
            f.set_len(FILE_BYTES).map_err(|e| e.to_string())?;
            drop(f);
            let mut model = Model {
                issued: [None; THREADS as usize],
                acked: Default::default(),
            };
            let mut start = [0u64; THREADS as usize];
            let mut line = Vec::new();
            for phase in 0..2 {
                let delay = Duration::from_micros(rng.below(60_000));
                let run = run_child(&path, mode, start, phase == 0, shared, delay)?;
                for t in 0..THREADS {
                    let k = t as usize;
                    let mine: Vec<u64> =
                        run.acks.iter().filter(|a| a.0 == t).map(|a| a.1).collect();
                    if let Some((n, w)) = mine
                        .iter()
                        .enumerate()
                        .find(|(n, &i)| i != start[k] + *n as u64)
                    {
                        return Err(format!(
                            "thread {t}: ack {n} is {w}, expected {}",
                            start[k] + n as u64
                        ));
                    }
                    // The thread may have started the commit after its last ack.
                    let next = start[k] + mine.len() as u64;
                    model.issued[k] = Some(next);
                    model.acked[k].extend(&mine);
                    start[k] = next + 1;
                }
                total_acks += run.acks.len();
                // Recover in this process, as the next user of the file would, and check.
                {
                    let (_e, _l, dev, _) = stack(&path);
                    let (_, report) = JournalSet::open(&dev, layout())
                        .map_err(|e| format!("recovery failed: {e}"))?;
                    if !report.corrupt.is_empty() {
                        return Err(format!(
                            "a process crash cannot damage the log, yet recovery reports areas \
                             {:?} corrupt",
                            report.corrupt
                        ));
                    }
                }
                let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
                model.check(&file)?;
                line.push(format!(
                    "{} acks, killed {:.1} ms after the first",
                    run.acks.len(),
                    run.killed_after.as_secs_f64() * 1e3
                ));
            }
            Ok(line.join("; "))
        })();
        let what = format!(
            "{} {}",
            mode.name(),
            if shared { "shared area" } else { "per-core" }
        );
        match r {
            Ok(s) => println!("rep {rep:>2} {what:<22} ok: {s}"),
            Err(e) => {
                println!("rep {rep:>2} {what:<22} FAILED: {e}");
                failures.push(rep);
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    println!("{total_acks} acknowledged commits checked across {reps} repetitions");
    // The summary line libtest prints, so suite totals count this test too.
    println!(
        "test result: {}. {} passed; {} failed; 0 ignored; 0 measured; 0 filtered out",
        if failures.is_empty() { "ok" } else { "FAILED" },
        failures.is_empty() as u32,
        !failures.is_empty() as u32
    );
    if !failures.is_empty() {
        eprintln!(
            "process crash: repetitions {failures:?} failed; replay with AIOS_CRASH_SEED={seed}"
        );
        std::process::exit(1);
    }
}
