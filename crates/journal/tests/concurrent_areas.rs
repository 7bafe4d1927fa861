//! Concurrent commits: two areas' commits racing on one block written in place (a read, the
//! recovered image and the block after a checkpoint must agree), and group commit formed
//! deterministically behind a held leader (many groups of mixed modes, refusals inside groups,
//! the log filling, checked against a model after every round).
//!
//! `AIOS_RACE_ROUNDS` (default 20,000), `AIOS_GROUP_ROUNDS` (default 300), `AIOS_GROUP_SEED`.

mod common;
use common::{block_of, lbio, two_area_race, value_at};

use std::sync::{Arc, Mutex};

use journal::{recover_image, CommitMode, Journal, JournalSet, Layout, Tx};
use lbio::{SimConfig, SimDisk};

fn rounds() -> u64 {
    std::env::var("AIOS_RACE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000)
}

/// Two threads on two areas write block `shared` in place at the same moment, each with its own
/// mode. Once both are acknowledged, what a read returns must be what recovery gives, and a
/// checkpoint must leave that version home.
fn data_race(modes: [CommitMode; 2], rounds: u64) {
    let shared = 129;
    let mut bad = Vec::new();
    two_area_race(
        modes,
        rounds,
        |_, v, shared, _, tx| {
            tx.write_data(shared, &block_of(v)).unwrap();
        },
        |r| {
            let live = value_at(&r.disk.view(), shared);
            let mut img = r.disk.media();
            recover_image(&mut img, r.layout).unwrap();
            let recovered = value_at(&img, shared);
            r.checkpointer.checkpoint().unwrap();
            let after = value_at(&r.disk.view(), shared);
            if live != recovered || after != recovered {
                bad.push((r.committed, live, recovered, after));
            }
        },
    );
    assert!(
        bad.is_empty(),
        "{modes:?}: {} of {rounds} rounds where a read, recovery and the checkpoint disagree \
         ((tid, value) per thread, read before, recovered, read after checkpoint), first: {:?}",
        bad.len(),
        &bad[..bad.len().min(4)]
    );
}

#[test]
fn two_one_write_commits_racing_on_a_data_block_agree_with_recovery() {
    data_race([CommitMode::OneWrite, CommitMode::OneWrite], rounds());
}

#[test]
fn an_overlapped_and_a_one_write_commit_racing_on_a_data_block_agree_with_recovery() {
    data_race([CommitMode::Overlapped, CommitMode::OneWrite], rounds());
}

// ---------------------------------------------------------------------------------------------
// Many groups formed deterministically: area 0's leader is a Rio-ordered commit held mid-write
// (its attribute log blocks until released), and each round's commits queue behind it one at a
// time, so the first leads the next group and the others are its waiters. The commits are
// random mixes of metadata, in-place data and revoke-with-data over a few shared blocks, from
// handles of random modes. After each round the recovered device, the set's kept copies and
// (now and then) a checkpoint must all give the model: the acknowledged commits applied in id
// order, a group's members in queue order.

use common::{Gate, PausingPmr, SimPmr};
use journal::rio_ordering::{self, OrderedConfig, Pmr};
use journal::JournalError;
use journal::{recover_image_rio, rio_prefix};
use lbio::SimRng;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Condvar;
use std::time::{Duration, Instant};

const G_AREA: u64 = 40;
const G_HOME: u64 = G_AREA;
const G_LEAD: u64 = G_HOME;
const G_SHARED: u64 = 6;

fn g_layout() -> Layout {
    Layout::per_core(0, G_AREA, 1)
}

fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(30);
    while !cond() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Meta(u64, u64),
    Data(u64, u64),
    RevokeData(u64, u64),
}

fn tx_of(ops: &[Op]) -> Tx {
    let mut tx = Tx::new();
    for op in ops {
        match *op {
            Op::Meta(b, v) => {
                tx.write_meta(b, &block_of(v)).unwrap();
            }
            Op::Data(b, v) => {
                tx.write_data(b, &block_of(v)).unwrap();
            }
            Op::RevokeData(b, v) => {
                tx.revoke(b);
                tx.write_data(b, &block_of(v)).unwrap();
            }
        }
    }
    tx
}

#[test]
fn many_deterministic_groups_of_mixed_modes_match_a_model() {
    let rounds: u64 = std::env::var("AIOS_GROUP_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let disk = SimDisk::new(SimConfig::new((G_HOME + 16) * 4096, 5)).unwrap();
    let l0 = lbio();
    let set = JournalSet::format(&disk.open(&l0).unwrap(), g_layout()).unwrap();
    let checkpointer =
        Journal::new(&set, 0, disk.open(&l0).unwrap(), CommitMode::Overlapped).unwrap();
    let armed = Arc::new(AtomicBool::new(false));
    let gate: Gate = Arc::new((Mutex::new((false, false)), Condvar::new()));
    let (go_tx, go_rx) = std::sync::mpsc::channel::<Option<u64>>();
    let (res_tx, res_rx) = std::sync::mpsc::channel::<(Result<u64, JournalError>, Vec<u8>)>();
    let mut model = [0u64; G_SHARED as usize];
    let mut rng = SimRng::new(
        std::env::var("AIOS_GROUP_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(42),
    );
    let (mut grouped, mut refused, mut members_total) = (0u64, 0u64, 0u64);
    let mut lead_value = 0u64;
    std::thread::scope(|s| {
        let go_tx = go_tx;
        let (set0, disk0, armed0, gate0) = (
            Arc::clone(&set),
            disk.clone(),
            Arc::clone(&armed),
            Arc::clone(&gate),
        );
        s.spawn(move || {
            let l = lbio();
            let bytes = Rc::new(RefCell::new(vec![0u8; 16 << 10]));
            let pmr: Box<dyn Pmr> = Box::new(PausingPmr {
                inner: SimPmr {
                    bytes: Rc::clone(&bytes),
                    disk: disk0.clone(),
                },
                armed: Arc::clone(&armed0),
                gate: gate0,
            });
            let own =
                lbio::LbioArray::new(Rc::clone(l.engine()), lbio::LbioConfig::default()).unwrap();
            let j = Journal::with_rio(
                &set0,
                0,
                disk0.open(&l).unwrap(),
                disk0.open(&own).unwrap(),
                pmr,
                OrderedConfig::default(),
            )
            .unwrap();
            while let Ok(Some(v)) = go_rx.recv() {
                let mut tx = Tx::new();
                tx.write_meta(G_LEAD, &block_of(v)).unwrap();
                armed0.store(true, Ordering::SeqCst);
                let r = j.commit(&tx).map(|i| i.tid);
                res_tx.send((r, bytes.borrow().clone())).unwrap();
            }
        });
        for round in 0..rounds {
            {
                let mut g = gate.0.lock().unwrap();
                *g = (false, false);
            }
            lead_value = 1_000_000 + round;
            go_tx.send(Some(lead_value)).unwrap();
            assert!(
                wait_until(|| gate.0.lock().unwrap().0),
                "round {round}: leader not held"
            );
            let k = 2 + rng.below(5) as usize;
            let mut plans = Vec::new();
            for i in 0..k {
                let mode = match rng.below(3) {
                    0 => CommitMode::Vanilla,
                    1 => CommitMode::Overlapped,
                    _ => CommitMode::OneWrite,
                };
                let n = 1 + rng.below(3);
                let mut ops = Vec::new();
                for o in 0..n {
                    let b = G_HOME + 1 + rng.below(G_SHARED - 1);
                    if ops.iter().any(|op: &Op| match *op {
                        Op::Meta(x, _) | Op::Data(x, _) | Op::RevokeData(x, _) => x == b,
                    }) {
                        continue;
                    }
                    let v = (round + 1) * 1000 + i as u64 * 10 + o;
                    ops.push(match rng.below(3) {
                        0 => Op::Meta(b, v),
                        1 => Op::Data(b, v),
                        _ => Op::RevokeData(b, v),
                    });
                }
                plans.push((mode, ops));
            }
            let results: Vec<Result<journal::CommitInfo, JournalError>> =
                std::thread::scope(|s2| {
                    let mut hs = Vec::new();
                    for (i, (mode, ops)) in plans.iter().enumerate() {
                        let (set1, disk1) = (Arc::clone(&set), disk.clone());
                        let (mode, tx) = (*mode, tx_of(ops));
                        hs.push(s2.spawn(move || {
                            let l = lbio();
                            let j = Journal::new(&set1, 0, disk1.open(&l).unwrap(), mode).unwrap();
                            j.commit(&tx)
                        }));
                        assert!(
                            wait_until(|| set.waiting_commits(0) == i + 1),
                            "round {round}: commit {i} never queued"
                        );
                    }
                    {
                        let (m, cv) = &*gate;
                        m.lock().unwrap().1 = true;
                        cv.notify_all();
                    }
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
            let (lead, log) = res_rx.recv().unwrap();
            let lead = lead.expect("the held Rio leader's commit");
            // The model: acknowledged commits in (tid, queue order).
            let mut done: Vec<(u64, usize)> = Vec::new();
            let mut tids = std::collections::HashMap::<u64, u64>::new();
            for (i, r) in results.iter().enumerate() {
                match r {
                    Ok(info) => {
                        assert!(info.tid > lead, "round {round}: commit {i} {info:?}");
                        done.push((info.tid, i));
                        *tids.entry(info.tid).or_default() += 1;
                    }
                    Err(JournalError::DataOverJournaledBlock { block }) => {
                        refused += 1;
                        let (mode, ops) = &plans[i];
                        assert!(
                            *mode != CommitMode::OneWrite
                                && ops
                                    .iter()
                                    .any(|op| matches!(op, Op::Data(b, _) if b == block)),
                            "round {round}: commit {i} ({mode:?}, {ops:?}) refused for {block}"
                        );
                    }
                    Err(e) => panic!("round {round}: commit {i}: {e}"),
                }
            }
            for &n in tids.values() {
                if n > 1 {
                    grouped += 1;
                    members_total += n;
                }
            }
            done.sort_unstable();
            // Commits of one group are concurrent (all queued before any returned): any order
            // among them is a valid outcome, but one order for all their blocks.
            let mut by_tid: Vec<Vec<usize>> = Vec::new();
            let mut last = None;
            for &(tid, i) in &done {
                if last != Some(tid) {
                    by_tid.push(Vec::new());
                    last = Some(tid);
                }
                by_tid.last_mut().unwrap().push(i);
            }
            // Recovery from the durable media.
            let mut img = disk.media();
            let mut m = rio_ordering::MemPmr::new(log.len());
            m.bytes_mut().copy_from_slice(&log);
            let prefix = rio_prefix(&[rio_ordering::scan(&m).unwrap()], false).unwrap();
            let report = recover_image_rio(&mut img, &g_layout(), &prefix).unwrap();
            assert!(report.corrupt.is_empty(), "{report:?}");
            let view = disk.view();
            let mut target = [0u64; G_SHARED as usize];
            for (k, t) in target.iter_mut().enumerate() {
                let b = G_HOME + k as u64;
                let rec = value_at(&img, b);
                let kept = set
                    .unhomed_copy(b)
                    .map(|d| u64::from_le_bytes(d[..8].try_into().unwrap()));
                let live = kept.unwrap_or(value_at(&view, b));
                assert_eq!(
                    rec, live,
                    "round {round}, block {b}: recovered {rec}, kept {kept:?}, read {live}; \
                     plans {plans:?}; results {results:?}"
                );
                *t = rec;
            }
            fn apply(
                model: [u64; G_SHARED as usize],
                groups: &[Vec<usize>],
                plans: &[(CommitMode, Vec<Op>)],
                target: &[u64; G_SHARED as usize],
            ) -> bool {
                let Some((g, rest)) = groups.split_first() else {
                    return model[1..] == target[1..];
                };
                fn perms(v: &mut Vec<usize>, k: usize, out: &mut Vec<Vec<usize>>) {
                    if k == v.len() {
                        out.push(v.clone());
                        return;
                    }
                    for i in k..v.len() {
                        v.swap(k, i);
                        perms(v, k + 1, out);
                        v.swap(k, i);
                    }
                }
                let mut all = Vec::new();
                perms(&mut g.clone(), 0, &mut all);
                all.into_iter().any(|order| {
                    let mut m = model;
                    for i in order {
                        for op in &plans[i].1 {
                            let (Op::Meta(b, v) | Op::Data(b, v) | Op::RevokeData(b, v)) = *op;
                            m[(b - G_HOME) as usize] = v;
                        }
                    }
                    apply(m, rest, plans, target)
                })
            }
            assert!(
                apply(model, &by_tid, &plans, &target),
                "round {round}: no order of the acknowledged commits (groups {by_tid:?}) gives \
                 the recovered blocks {target:?} from {model:?}; plans {plans:?}; results \
                 {results:?}"
            );
            assert_eq!(
                target[0], lead_value,
                "round {round}: the held leader's block"
            );
            model = target;
            if round % 7 == 6 {
                checkpointer.checkpoint().unwrap();
                let view = disk.view();
                for (k, &want) in model.iter().enumerate() {
                    let b = G_HOME + k as u64;
                    assert_eq!(
                        value_at(&view, b),
                        want,
                        "round {round}: after checkpoint, {b}"
                    );
                }
            }
        }
        go_tx.send(None).unwrap();
    });
    println!(
        "{rounds} rounds: {grouped} groups of {members_total} commits, {refused} refused, \
         {} checkpoints",
        set.stats.checkpoints.load(Ordering::Relaxed)
    );
    assert!(grouped > rounds / 2, "{grouped} groups in {rounds} rounds");
}
