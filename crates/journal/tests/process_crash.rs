//! A real process crash: a child process commits transactions in a loop on an `O_DIRECT` file
//! and reports each acknowledgement to the parent over a pipe; the parent kills it with SIGKILL
//! at a random moment, recovers the journal and checks that every acknowledged commit is there,
//! and that no transaction shows up partly applied. Each repetition kills the child twice: the
//! second child starts by recovering what the first one left and commits on from there, so
//! recovery followed by more commits is covered as well.
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
/// Commit i writes metadata blocks M1 + i % 5 and M2 + i % 3 and data block D + i % 64.
const M1: u64 = HOME;
const M2: u64 = HOME + 5;
const D: u64 = HOME + 8;
const DATA_BLOCKS: u64 = 64;
const FILE_BYTES: u64 = (D + DATA_BLOCKS) * BLOCK as u64;

fn blocks_of(i: u64) -> [u64; 3] {
    [M1 + i % 5, M2 + i % 3, D + i % DATA_BLOCKS]
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

/// The child: format (first phase) or recover (second), then commit from `start` on, alternating
/// areas, writing each acknowledged index to stdout. Runs until killed.
fn child(path: &Path, mode: CommitMode, start: u64, format: bool) -> ! {
    let (_engine, _lbio, a, b) = stack(path);
    let set = if format {
        JournalSet::format(&a, layout()).expect("format")
    } else {
        JournalSet::open(&a, layout()).expect("recover").0
    };
    let journals = [
        Journal::new(&set, 0, a, mode).expect("journal 0"),
        Journal::new(&set, 1, b, mode).expect("journal 1"),
    ];
    let mut out = std::io::stdout().lock();
    for i in start.. {
        let [m1, m2, d] = blocks_of(i);
        let mut tx = Tx::new();
        tx.write_data(d, &content(i, d))
            .and_then(|tx| tx.write_meta(m1, &content(i, m1)))
            .and_then(|tx| tx.write_meta(m2, &content(i, m2)))
            .expect("build tx");
        journals[(i % AREAS as u64) as usize]
            .commit(&tx)
            .expect("commit");
        // Acknowledged: tell the parent.
        out.write_all(&i.to_le_bytes()).expect("ack pipe");
        out.flush().expect("ack pipe");
    }
    unreachable!("the index space is not exhausted before the kill")
}

/// What the parent knows: the highest index any child started (`issued`), and per block the
/// last acknowledged commit that wrote it.
struct Model {
    issued: Option<u64>,
    acked: Vec<u64>,
}

impl Model {
    fn last_acked_writer(&self, b: u64) -> Option<u64> {
        self.acked
            .iter()
            .rev()
            .copied()
            .find(|&i| blocks_of(i).contains(&b))
    }

    /// Check the recovered file: each block holds the version of a commit that wrote it, no
    /// older than its last acknowledged writer and not beyond what was issued; and whatever
    /// commit a metadata block shows, that commit's other blocks are at least as new.
    fn check(&self, file: &std::fs::File) -> Result<(), String> {
        let mut seen = std::collections::HashMap::new();
        for b in M1..D + DATA_BLOCKS {
            let mut buf = vec![0u8; BLOCK];
            file.read_exact_at(&mut buf, b * BLOCK as u64)
                .map_err(|e| format!("reading block {b}: {e}"))?;
            let got = decode(&buf, b)?;
            if let Some(j) = got {
                if !blocks_of(j).contains(&b) || self.issued.is_none_or(|n| j > n) {
                    return Err(format!(
                        "block {b} holds commit {j}, which never wrote it (issued up to {:?})",
                        self.issued
                    ));
                }
            }
            if let Some(l) = self.last_acked_writer(b) {
                if got.is_none_or(|j| j < l) {
                    return Err(format!(
                        "block {b}: acknowledged commit {l} is lost (the block holds {got:?})"
                    ));
                }
            }
            seen.insert(b, got);
        }
        for b in M1..D {
            if let Some(Some(j)) = seen.get(&b) {
                for other in blocks_of(*j) {
                    let o = seen[&other];
                    if o.is_none_or(|o| o < *j) {
                        return Err(format!(
                            "commit {j} is partly applied: block {b} holds it, block {other} \
                             holds {o:?}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

struct Run {
    acks: Vec<u64>,
    killed_after: Duration,
}

/// Start a child, kill it `delay` after its first acknowledgement, and collect every ack.
fn run_child(
    path: &Path,
    mode: CommitMode,
    start: u64,
    format: bool,
    delay: Duration,
) -> Result<Run, String> {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("AIOS_JOURNAL_CHILD", path)
        .env("AIOS_JOURNAL_MODE", mode.name())
        .env("AIOS_JOURNAL_START", start.to_string())
        .env("AIOS_JOURNAL_FORMAT", if format { "1" } else { "0" })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawning the child: {e}"))?;
    let mut pipe = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut acks = Vec::new();
        let mut b = [0u8; 8];
        while pipe.read_exact(&mut b).is_ok() {
            let i = u64::from_le_bytes(b);
            if acks.is_empty() {
                let _ = tx.send(());
            }
            acks.push(i);
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
    if first.is_err() || status.signal() != Some(libc_sigkill()) {
        return Err(format!(
            "the child did not run until killed ({status}); its stderr:\n{err}"
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
            _ => CommitMode::Overlapped,
        };
        let start = std::env::var("AIOS_JOURNAL_START")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let format = std::env::var("AIOS_JOURNAL_FORMAT").as_deref() == Ok("1");
        child(Path::new(&path), mode, start, format);
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
        let mode = if rep % 2 == 0 {
            CommitMode::Vanilla
        } else {
            CommitMode::Overlapped
        };
        let r = (|| -> Result<String, String> {
            let f = std::fs::File::create(&path).map_err(|e| e.to_string())?;
            f.set_len(FILE_BYTES).map_err(|e| e.to_string())?;
            drop(f);
            let mut model = Model {
                issued: None,
                acked: Vec::new(),
            };
            let mut start = 0u64;
            let mut line = Vec::new();
            for phase in 0..2 {
                let delay = Duration::from_micros(rng.below(60_000));
                let run = run_child(&path, mode, start, phase == 0, delay)?;
                if let Some((k, w)) = run
                    .acks
                    .iter()
                    .enumerate()
                    .find(|(k, &i)| i != start + *k as u64)
                {
                    return Err(format!("ack {k} is {w}, expected {}", start + k as u64));
                }
                // The child may have started the commit after its last ack.
                let next = start + run.acks.len() as u64;
                model.issued = Some(next);
                model.acked.extend(&run.acks);
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
                start = next + 1;
            }
            Ok(line.join("; "))
        })();
        match r {
            Ok(s) => println!("rep {rep:>2} {:<10} ok: {s}", mode.name()),
            Err(e) => {
                println!("rep {rep:>2} {:<10} FAILED: {e}", mode.name());
                failures.push(rep);
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    println!("{total_acks} acknowledged commits checked across {reps} repetitions");
    if !failures.is_empty() {
        eprintln!(
            "process crash: repetitions {failures:?} failed; replay with AIOS_CRASH_SEED={seed}"
        );
        std::process::exit(1);
    }
}
