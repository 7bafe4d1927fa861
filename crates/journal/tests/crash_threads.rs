//! Power cuts under multi-threaded commits: several threads, each on its own engine, commit
//! concurrently to one SimDisk — into per-core areas, or all into one area (group commit) —
//! until the power is cut at a random request; then many crash images are drawn and recovered.
//!
//! Checked for every image, per thread: every block holds the version of a commit that wrote
//! it, no older than the last acknowledged commit that wrote it and no newer than the last one
//! the thread started; and whatever commit a metadata block shows, that commit's other blocks
//! are at least as new (no transaction partly applied).
//!
//! Thread scheduling makes runs differ: a failure prints its seed, which fixes the workload,
//! the disk's draws and the cut point, not the interleaving. `AIOS_SIM_MT_SEEDS` sets the
//! workloads (default 200, 50 images each).

use std::rc::Rc;
use std::sync::{Arc, Barrier};

use aios_core::{Engine, EngineConfig};
use journal::{recover_image, CommitMode, Durability, Journal, JournalSet, Layout, LogEnd, Tx};
use lbio::{CrashOptions, LbioArray, LbioConfig, SimConfig, SimDisk, SimRng};

const BLOCK: usize = 4096;
const THREADS: u64 = 3;
const AREA_BLOCKS: u64 = 24;
const HOME: u64 = THREADS * AREA_BLOCKS;
/// Per thread: metadata blocks M1 + i % 5, M2 + i % 3 and data block D + i % 16.
const M1: u64 = 0;
const M2: u64 = 5;
const D: u64 = 8;
const PER_THREAD: u64 = D + 16;
const DISK_BYTES: u64 = (HOME + THREADS * PER_THREAD) * BLOCK as u64;
const IMAGES: usize = 50;

fn blocks_of(t: u64, i: u64) -> [u64; 3] {
    let base = HOME + t * PER_THREAD;
    [base + M1 + i % 5, base + M2 + i % 3, base + D + i % 16]
}

fn content(t: u64, i: u64, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    v[..8].copy_from_slice(&(i + 1).to_le_bytes());
    v[8..16].copy_from_slice(&b.to_le_bytes());
    v[16..24].copy_from_slice(&t.to_le_bytes());
    let mut x = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b;
    for c in v[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    v
}

/// Which commit of thread `t` wrote this block image (`None`: the initial zeros).
fn decode(bytes: &[u8], t: u64, b: u64) -> Result<Option<u64>, String> {
    if bytes.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    let i1 = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    if i1 == 0 || bytes != content(t, i1 - 1, b).as_slice() {
        return Err(format!("block {b} holds bytes no commit wrote"));
    }
    Ok(Some(i1 - 1))
}

fn engine() -> (Rc<Engine>, Rc<LbioArray>) {
    let e = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let l = LbioArray::new(Rc::clone(&e), LbioConfig::default()).unwrap();
    (e, l)
}

struct ThreadLog {
    acked: Vec<u64>,
    /// The highest index started (its commit may be partly or wholly on the disk).
    started: Option<u64>,
}

#[derive(Default)]
struct Totals {
    states: usize,
    acks: u64,
    /// Cuts with commits of two or more threads in flight.
    concurrent_cuts: u64,
    groups: u64,
}

fn run(seed: u64, tot: &mut Totals) -> Result<(), String> {
    let mut rng = SimRng::new(seed);
    let shared = seed % 2 == 1;
    let layout = if shared {
        Layout::per_core(0, AREA_BLOCKS * THREADS, 1)
    } else {
        Layout::per_core(0, AREA_BLOCKS, THREADS as usize)
    };
    let mut cfg = SimConfig::new(DISK_BYTES, seed.wrapping_mul(0x2545_f491));
    cfg.plp = rng.chance(1, 4);
    let disk = SimDisk::new(cfg).map_err(|e| e.to_string())?;
    let set = {
        let (_e, l) = engine();
        JournalSet::format(&disk.open(&l).unwrap(), layout.clone()).map_err(|e| e.to_string())?
    };
    set.set_durability(if rng.chance(1, 2) {
        Durability::FuaWrites
    } else {
        Durability::Flush
    });
    let modes: Vec<CommitMode> = (0..THREADS)
        .map(|_| match rng.below(3) {
            0 => CommitMode::Overlapped,
            1 => CommitMode::Vanilla,
            _ => CommitMode::OneWrite,
        })
        .collect();
    disk.cut_power_after(20 + rng.below(600));
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let logs: Result<Vec<ThreadLog>, String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (set, disk, barrier) = (Arc::clone(&set), disk.clone(), Arc::clone(&barrier));
                let mode = modes[t as usize];
                s.spawn(move || {
                    let (_e, l) = engine();
                    let area = if shared { 0 } else { t as usize };
                    let j = Journal::new(&set, area, disk.open(&l).unwrap(), mode).unwrap();
                    barrier.wait();
                    let mut log = ThreadLog {
                        acked: Vec::new(),
                        started: None,
                    };
                    for i in 0..400u64 {
                        let [m1, m2, d] = blocks_of(t, i);
                        let mut tx = Tx::new();
                        tx.write_data(d, &content(t, i, d))
                            .and_then(|tx| tx.write_meta(m1, &content(t, i, m1)))
                            .and_then(|tx| tx.write_meta(m2, &content(t, i, m2)))
                            .expect("build tx");
                        log.started = Some(i);
                        match j.commit(&tx) {
                            Ok(_) => log.acked.push(i),
                            // The power is out (the journal may have aborted because of it):
                            // nothing else may fail a commit.
                            Err(e) if disk.powered() => {
                                return Err(format!(
                                    "seed {seed}: thread {t}'s commit {i} failed with the \
                                     power on: {e}"
                                ));
                            }
                            Err(_) => break,
                        }
                    }
                    Ok(log)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let logs = logs?;
    disk.cut_power();
    let in_flight_threads = logs
        .iter()
        .filter(|l| l.started.is_some() && l.acked.last() != l.started.as_ref())
        .count();
    tot.concurrent_cuts += (in_flight_threads >= 2) as u64;
    tot.groups += set.stats.groups.load(std::sync::atomic::Ordering::Relaxed);
    let mut checked = 0u64;
    for k in 0..IMAGES {
        let mut img = disk.crash_image(CrashOptions {
            torn: true,
            ..CrashOptions::default()
        });
        let report = recover_image(&mut img, &layout)
            .map_err(|e| format!("seed {seed} image {k}: recovery failed: {e}"))?;
        for (a, end) in &report.areas {
            if let LogEnd::Corrupt { pos, why } = end {
                return Err(format!(
                    "seed {seed} image {k}: area {a} reported damage at {pos}: {why}"
                ));
            }
        }
        for t in 0..THREADS {
            let log = &logs[t as usize];
            let base = HOME + t * PER_THREAD;
            let mut seen = std::collections::HashMap::new();
            // A data block the thread's last, unacknowledged commit was writing in place may
            // be torn between versions: legal, unless a metadata block shows that commit.
            let in_flight = log.started.filter(|n| log.acked.last() != Some(n));
            let mut torn = Vec::new();
            for b in base..base + PER_THREAD {
                let at = b as usize * BLOCK;
                let got = match decode(&img[at..at + BLOCK], t, b) {
                    Ok(g) => g,
                    Err(_)
                        if b >= base + D && in_flight.is_some_and(|n| blocks_of(t, n)[2] == b) =>
                    {
                        torn.push(b);
                        continue;
                    }
                    Err(e) => return Err(format!("seed {seed} image {k}: thread {t}: {e}")),
                };
                if let Some(j) = got {
                    if !blocks_of(t, j).contains(&b) || log.started.is_none_or(|n| j > n) {
                        return Err(format!(
                            "seed {seed} image {k}: block {b} holds thread {t}'s commit {j}, \
                             which never wrote it (started up to {:?})",
                            log.started
                        ));
                    }
                }
                let last_acked = log
                    .acked
                    .iter()
                    .rev()
                    .copied()
                    .find(|&i| blocks_of(t, i).contains(&b));
                if let Some(l) = last_acked {
                    if got.is_none_or(|j| j < l) {
                        return Err(format!(
                            "seed {seed} image {k}: block {b}: thread {t}'s acknowledged commit \
                             {l} is lost (the block holds {got:?}; shared area: {shared})"
                        ));
                    }
                }
                seen.insert(b, got);
            }
            for b in base..base + D {
                if let Some(Some(j)) = seen.get(&b) {
                    for other in blocks_of(t, *j) {
                        if torn.contains(&other) {
                            return Err(format!(
                                "seed {seed} image {k}: thread {t}'s commit {j} is applied (block \
                                 {b}) but its data block {other} is torn"
                            ));
                        }
                        let o = seen[&other];
                        if o.is_none_or(|o| o < *j) {
                            return Err(format!(
                                "seed {seed} image {k}: thread {t}'s commit {j} is partly \
                                 applied: block {b} holds it, block {other} holds {o:?}"
                            ));
                        }
                    }
                }
            }
            checked += log.acked.len() as u64;
        }
    }
    tot.states += IMAGES;
    tot.acks += checked;
    Ok(())
}

#[test]
fn power_cuts_under_concurrent_commits_lose_no_acknowledged_commit() {
    let seeds: Vec<u64> = match std::env::var("AIOS_SIM_MT_SEED") {
        Ok(s) => vec![s.parse().unwrap()],
        Err(_) => (1..=std::env::var("AIOS_SIM_MT_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(200))
            .collect(),
    };
    let t0 = std::time::Instant::now();
    let mut tot = Totals::default();
    for &seed in &seeds {
        match run(seed, &mut tot) {
            Ok(()) => {}
            Err(e) => panic!(
                "{e}\nreplay the workload with: AIOS_SIM_MT_SEED={seed} cargo test -p journal \
                 --test crash_threads"
            ),
        }
    }
    println!(
        "multi-threaded power cuts: {} workloads x {THREADS} threads, {} crash images, {} \
         acknowledged commits checked in {:.1} s, 0 violations ({} cuts with commits of several \
         threads in flight, {} group commits)",
        seeds.len(),
        tot.states,
        tot.acks,
        t0.elapsed().as_secs_f64(),
        tot.concurrent_cuts,
        tot.groups
    );
    if seeds.len() >= 50 {
        assert!(
            tot.concurrent_cuts > 0 && tot.groups > 0,
            "the workloads must overlap"
        );
    }
}
