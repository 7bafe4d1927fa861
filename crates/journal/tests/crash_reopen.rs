//! Crash, recover, carry on: random workloads whose home blocks serve both as journaled metadata
//! and as in-place data, with revokes, one to three areas, two handles of different commit
//! modes on one area, Rio-ordered handles, checkpoints and logs of 6 to 19 blocks that wrap all
//! the time. A power cut at a random request; six crash images, each recovered through
//! `JournalSet::open` (or `open_rio`) and checked against a model of the acknowledged commits
//! (the one in flight applied whole or not at all, no area reported damaged, no unknown
//! transaction replayed); then the workload goes on from one recovered device, with the log
//! blocks of earlier laps and earlier recoveries still in place, for three rounds.
//!
//! `crash_sim` starts every case from a freshly formatted device; this test is about what a
//! recovered log leaves for the next generation.
//!
//! `AIOS_REOPEN_SEEDS` (default 300) sets the number of seeds; `AIOS_REOPEN_SEED=N` replays
//! one (a failure names its seed).

mod common;
use common::{block_of, lbio, SimPmr};

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use journal::rio_ordering::{self, AttrLog, MemPmr, OrderedConfig, Pmr};
use journal::rio_prefix;
use lbio::LbioConfig;

use journal::{CommitMode, Durability, Journal, JournalError, JournalSet, Layout, LogEnd, Tx};
use lbio::{CrashOptions, LbioArray, SimConfig, SimDisk, SimRng};

const HOME_BLOCKS: u64 = 12;
const ROUNDS: usize = 3;
const IMAGES: usize = 6;

#[derive(Clone, Debug)]
enum Op {
    Meta(u64, u64),
    Data(u64, u64),
    /// Revoke only (the block is freed: its content is no longer defined).
    Free(u64),
    /// Revoke and write in place.
    DataRevoke(u64, u64),
}

#[derive(Clone, Debug, Default)]
struct Model {
    vals: HashMap<u64, u64>,
    unknown: HashSet<u64>,
}

impl Model {
    fn apply(&mut self, ops: &[Op]) {
        // Data first, then frees, then metadata (a block a transaction both writes in place and
        // journals ends as the metadata has it).
        for op in ops {
            if let Op::Data(b, v) | Op::DataRevoke(b, v) = op {
                self.vals.insert(*b, *v);
                self.unknown.remove(b);
            }
        }
        for op in ops {
            if let Op::Free(b) = op {
                self.unknown.insert(*b);
            }
        }
        for op in ops {
            if let Op::Meta(b, v) = op {
                self.vals.insert(*b, *v);
                self.unknown.remove(b);
            }
        }
    }
}

fn value(img: &[u8], b: u64) -> Option<u64> {
    let blk = &img[(b * 4096) as usize..((b + 1) * 4096) as usize];
    let v = u64::from_le_bytes(blk[..8].try_into().unwrap());
    blk.chunks(8).all(|c| c == v.to_le_bytes()).then_some(v)
}

fn mode_of(rng: &mut SimRng) -> CommitMode {
    match rng.below(3) {
        0 => CommitMode::Overlapped,
        1 => CommitMode::Vanilla,
        _ => CommitMode::OneWrite,
    }
}

fn run_seed(seed: u64, lbio: &Rc<LbioArray>) -> Result<(usize, usize), String> {
    let mut rng = SimRng::new(seed);
    let areas = 1 + rng.below(3) as usize;
    let area_blocks = 6 + rng.below(14);
    let home0 = areas as u64 * area_blocks;
    let blocks = home0 + HOME_BLOCKS;
    let layout = Layout::per_core(0, area_blocks, areas);
    let mut cfg = SimConfig::new(blocks * 4096, seed.wrapping_mul(0x9e37_79b9));
    cfg.plp = rng.chance(1, 5);
    let mut disk = SimDisk::new(cfg).map_err(|e| e.to_string())?;
    let mut set = JournalSet::format(&disk.open(lbio).unwrap(), layout.clone())
        .map_err(|e| format!("seed {seed}: format: {e}"))?;
    let mut model = Model::default();
    let mut counter = seed << 24;
    let mut checked = 0;
    let mut pending_applied = 0;
    for round in 0..ROUNDS {
        set.set_durability(if rng.chance(1, 2) {
            Durability::FuaWrites
        } else {
            Durability::Flush
        });
        // One or two handles per area (two: of different modes, on the same area).
        let mut journals: Vec<Journal> = Vec::new();
        let mut rio_logs: Vec<Option<Rc<RefCell<Vec<u8>>>>> = Vec::new();
        for a in 0..areas {
            let mut rio = None;
            for i in 0..1 + rng.below(2) {
                if i == 0 && rng.chance(1, 3) {
                    let len = if rng.chance(1, 2) {
                        16 << 10
                    } else {
                        2 * 576 + 4 * 64
                    };
                    let bytes = Rc::new(RefCell::new(vec![0u8; len]));
                    let pmr: Box<dyn Pmr> = Box::new(SimPmr {
                        bytes: Rc::clone(&bytes),
                        disk: disk.clone(),
                    });
                    let own =
                        LbioArray::new(Rc::clone(lbio.engine()), LbioConfig::default()).unwrap();
                    let target = disk.open(&own).unwrap();
                    rio = Some(bytes);
                    journals.push(
                        Journal::with_rio(
                            &set,
                            a,
                            disk.open(lbio).unwrap(),
                            target,
                            pmr,
                            OrderedConfig::default(),
                        )
                        .unwrap(),
                    );
                    continue;
                }
                let m = mode_of(&mut rng);
                journals.push(Journal::new(&set, a, disk.open(lbio).unwrap(), m).unwrap());
            }
            rio_logs.push(rio);
        }
        disk.cut_power_after(1 + rng.below(300));
        let mut acked: Vec<(u64, Vec<Op>)> = Vec::new();
        let mut pending: Option<Vec<Op>> = None;
        for _ in 0..60 {
            let j = &journals[rng.below(journals.len() as u64) as usize];
            if rng.chance(1, 10) {
                if let Err(e) = j.checkpoint() {
                    if disk.powered() {
                        return Err(format!("seed {seed} round {round}: checkpoint: {e}"));
                    }
                    break;
                }
                continue;
            }
            let mut ops = Vec::new();
            let mut used = HashSet::new();
            for _ in 0..1 + rng.below(4) {
                let b = home0 + rng.below(HOME_BLOCKS);
                if !used.insert(b) {
                    continue;
                }
                counter += 1;
                ops.push(match rng.below(8) {
                    0..=3 => Op::Meta(b, counter),
                    4 | 5 => Op::Data(b, counter),
                    6 => Op::DataRevoke(b, counter),
                    _ => Op::Free(b),
                });
            }
            let mut tx = Tx::new();
            for op in &ops {
                match *op {
                    Op::Meta(b, v) => {
                        tx.write_meta(b, &block_of(v)).unwrap();
                    }
                    Op::Data(b, v) => {
                        tx.write_data(b, &block_of(v)).unwrap();
                    }
                    Op::DataRevoke(b, v) => {
                        tx.revoke(b).write_data(b, &block_of(v)).unwrap();
                    }
                    Op::Free(b) => {
                        tx.revoke(b);
                    }
                }
            }
            let r = loop {
                match j.commit(&tx) {
                    Err(JournalError::DataOverJournaledBlock { block }) => {
                        tx.revoke(block);
                    }
                    r => break r,
                }
            };
            match r {
                Ok(info) => acked.push((info.tid, ops)),
                // Refused before anything is written.
                Err(JournalError::TxTooLarge { .. }) => continue,
                Err(e) => {
                    if disk.powered() {
                        return Err(format!("seed {seed} round {round}: commit failed: {e}"));
                    }
                    pending = Some(ops);
                    break;
                }
            }
        }
        disk.cut_power();
        // Rio handles checkpoint on drop only when powered; a crash drops nothing.
        drop(journals);
        let prefix = if rio_logs.iter().any(|l| l.is_some()) {
            let scans: Vec<_> = rio_logs
                .iter()
                .map(|l| {
                    let m = match l {
                        Some(b) => {
                            let mut m = MemPmr::new(b.borrow().len());
                            m.bytes_mut().copy_from_slice(&b.borrow());
                            m
                        }
                        None => AttrLog::format(MemPmr::new(16 << 10), areas as u16)
                            .expect("format")
                            .into_pmr(),
                    };
                    rio_ordering::scan(&m).expect("scan")
                })
                .collect();
            Some(rio_prefix(&scans, cfg.plp).map_err(|e| format!("seed {seed}: {e}"))?)
        } else {
            None
        };
        acked.sort_by_key(|a| a.0);
        let mut s0 = model.clone();
        for (_, ops) in &acked {
            s0.apply(ops);
        }
        let mut s1 = s0.clone();
        if let Some(p) = &pending {
            s1.apply(p);
        }
        let pending_data: Vec<u64> = pending
            .iter()
            .flatten()
            .filter_map(|op| match op {
                Op::Data(b, _) | Op::DataRevoke(b, _) => Some(*b),
                _ => None,
            })
            .collect();
        let acked_tids: HashSet<u64> = acked.iter().map(|a| a.0).collect();
        let mut next = None;
        for k in 0..IMAGES {
            let img = disk.crash_image(CrashOptions::default());
            let mut cfg2 = SimConfig::new(blocks * 4096, seed ^ (round * 100 + k) as u64);
            cfg2.plp = cfg.plp;
            let disk2 = SimDisk::from_image(cfg2, img).map_err(|e| e.to_string())?;
            let opened = match &prefix {
                Some(p) => JournalSet::open_rio(&disk2.open(lbio).unwrap(), layout.clone(), p),
                None => JournalSet::open(&disk2.open(lbio).unwrap(), layout.clone()),
            };
            let (set2, report) =
                opened.map_err(|e| format!("seed {seed} round {round} image {k}: open: {e}"))?;
            let fail = |what: String| {
                Err(format!(
                    "seed {seed} round {round} image {k}: {what}; report {report:?}; acked {:?}; pending {pending:?}",
                    acked
                ))
            };
            for (a, end) in &report.areas {
                if let LogEnd::Corrupt { .. } = end {
                    return fail(format!("area {a} reported damage"));
                }
            }
            let extra: Vec<u64> = report
                .replayed
                .iter()
                .flatten()
                .copied()
                .filter(|t| !acked_tids.contains(t))
                .collect();
            if extra.len() > 1 || (!extra.is_empty() && pending.is_none()) {
                return fail(format!("replayed unknown transactions {extra:?}"));
            }
            let with_pending = !extra.is_empty();
            pending_applied += with_pending as usize;
            let m = if with_pending { &s1 } else { &s0 };
            let img = disk2.view();
            for b in home0..blocks {
                if m.unknown.contains(&b) || (!with_pending && pending_data.contains(&b)) {
                    continue;
                }
                let want = m.vals.get(&b).copied().unwrap_or(0);
                let got = value(&img, b);
                if got != Some(want) {
                    return fail(format!(
                        "block {b} holds {got:?}, expected {want} (pending {})",
                        if with_pending {
                            "applied"
                        } else {
                            "not applied"
                        }
                    ));
                }
            }
            checked += 1;
            if next.is_none() {
                let mut m = m.clone();
                if !with_pending {
                    for b in &pending_data {
                        m.unknown.insert(*b);
                    }
                }
                next = Some((disk2, set2, m));
            }
        }
        let (d, s, m) = next.unwrap();
        disk = d;
        set = s;
        model = m;
    }
    Ok((checked, pending_applied))
}

#[test]
fn shared_blocks_revokes_and_reopen_rounds_recover_every_acknowledged_commit() {
    let lbio = lbio();
    let seeds: Vec<u64> = match std::env::var("AIOS_REOPEN_SEED") {
        Ok(s) => vec![s.parse().unwrap()],
        Err(_) => {
            let n: u64 = std::env::var("AIOS_REOPEN_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(300);
            (1..=n).collect()
        }
    };
    let mut states = 0;
    let mut applied = 0;
    for seed in seeds {
        match run_seed(seed, &lbio) {
            Ok((c, p)) => {
                states += c;
                applied += p;
            }
            Err(e) => panic!("{e}"),
        }
    }
    println!("{states} crash states checked, pending applied in {applied}");
}
