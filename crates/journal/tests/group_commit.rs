//! Group commit: threads sharing one journal area commit concurrently; waiting commits join the
//! next leader's journal transaction. Checked: every commit returns, grouped commits share a
//! transaction id, groups do happen, file-level transactions never join one, and after
//! reopening (recovery) the device holds every thread's last version of each block. Handles of
//! different modes share groups, and a commit gets the outcome its own handle's mode gives it,
//! whatever the mode of the group's leader.

mod common;
use common::{block_of, lbio, value_at, Gate, PausingPmr, SimPmr};

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use aios_core::{Engine, EngineConfig};
use journal::rio_ordering::{OrderedConfig, Pmr};
use journal::{
    recover_image, CommitInfo, CommitMode, Journal, JournalError, JournalSet, Layout, Tx,
};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig, SimConfig, SimDisk};

const BLOCK: usize = 4096;
const AREA_BLOCKS: u64 = 256;
const THREADS: u64 = 4;
const COMMITS: u64 = 300;
/// Thread t's metadata block and its data blocks.
fn meta_block(t: u64) -> u64 {
    AREA_BLOCKS + t
}
fn data_block(t: u64, i: u64) -> u64 {
    AREA_BLOCKS + THREADS + t * 16 + i % 16
}
fn content(t: u64, i: u64, b: u64) -> Vec<u8> {
    let mut v = vec![(t * 31 + i) as u8; BLOCK];
    v[..8].copy_from_slice(&i.to_le_bytes());
    v[8..16].copy_from_slice(&b.to_le_bytes());
    v[16..24].copy_from_slice(&t.to_le_bytes());
    v
}
const DEVICE_BYTES: u64 = (AREA_BLOCKS + THREADS + THREADS * 16) * BLOCK as u64;

struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn scratch(name: &str) -> TempFile {
    // /dev/shm allows O_DIRECT and keeps the test fast; fall back to the temp dir.
    let dir = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let p = dir.join(format!("aios-group-{name}-{}.img", std::process::id()));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(DEVICE_BYTES).unwrap();
    TempFile(p)
}

fn device(path: &Path) -> (Rc<Engine>, Rc<LbioArray>, Device) {
    let engine = Engine::new(EngineConfig {
        ring_entries: 64,
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = Device::open(
        &lbio,
        path,
        DeviceConfig {
            write: true,
            ..DeviceConfig::default()
        },
    )
    .unwrap();
    (engine, lbio, dev)
}

/// Every thread commits COMMITS transactions into area 0; returns (thread, index, tid) of each.
fn hammer(path: &Path, set: &Arc<JournalSet>, file_level: bool) -> Vec<(u64, u64, u64)> {
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (set, barrier) = (Arc::clone(set), Arc::clone(&barrier));
                s.spawn(move || {
                    let (_e, _l, dev) = device(path);
                    let mode = match t % 3 {
                        0 => CommitMode::Overlapped,
                        1 => CommitMode::Vanilla,
                        _ => CommitMode::OneWrite,
                    };
                    let j = Journal::new(&set, 0, dev, mode).unwrap();
                    barrier.wait();
                    let mut out = Vec::new();
                    for i in 0..COMMITS {
                        let mut tx = if file_level {
                            Tx::for_file(t as u32)
                        } else {
                            Tx::new()
                        };
                        let (m, d) = (meta_block(t), data_block(t, i));
                        tx.write_meta(m, &content(t, i, m)).unwrap();
                        tx.write_data(d, &content(t, i, d)).unwrap();
                        // All threads commit at once, every round: on a 2-CPU machine with
                        // commits this fast, threads left to run freely could take turns
                        // and never overlap.
                        barrier.wait();
                        let info = j.commit(&tx).unwrap();
                        out.push((t, i, info.tid));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    })
}

fn check_device(path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; BLOCK];
    for t in 0..THREADS {
        let m = meta_block(t);
        f.read_exact_at(&mut buf, m * BLOCK as u64).unwrap();
        assert_eq!(
            buf,
            content(t, COMMITS - 1, m),
            "thread {t}'s last metadata"
        );
        for i in COMMITS - 16..COMMITS {
            let d = data_block(t, i);
            f.read_exact_at(&mut buf, d * BLOCK as u64).unwrap();
            assert_eq!(buf, content(t, i, d), "thread {t}'s data of commit {i}");
        }
    }
}

/// One run of the join test on a new journal: every check but "a group formed"; returns how many
/// groups formed.
fn join_run(attempt: u32) -> u64 {
    let file = scratch(&format!("join{attempt}"));
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let set = {
        let (_e, _l, dev) = device(&file.0);
        JournalSet::format(&dev, layout.clone()).unwrap()
    };
    let done = hammer(&file.0, &set, false);
    assert_eq!(done.len() as u64, THREADS * COMMITS);
    let st = &set.stats;
    let groups = st.groups.load(Ordering::Relaxed);
    let grouped = st.grouped_commits.load(Ordering::Relaxed);
    assert_eq!(st.commits.load(Ordering::Relaxed), THREADS * COMMITS);
    // Grouped commits share a tid; distinct threads' commits in one tid are a group.
    let mut by_tid = std::collections::HashMap::<u64, Vec<u64>>::new();
    for &(t, _, tid) in &done {
        by_tid.entry(tid).or_default().push(t);
    }
    let shared: u64 = by_tid
        .values()
        .filter(|v| v.len() > 1)
        .map(|v| v.len() as u64)
        .sum();
    assert_eq!(
        shared, grouped,
        "commits sharing a tid = commits counted as grouped"
    );
    // Per thread, tids increase with its commit order.
    for t in 0..THREADS {
        let tids: Vec<u64> = done.iter().filter(|x| x.0 == t).map(|x| x.2).collect();
        assert!(tids.windows(2).all(|w| w[0] < w[1]), "thread {t}: {tids:?}");
    }
    drop(set);
    // Reopen: recovery replays the logs, and the newest version of each block wins.
    {
        let (_e, _l, dev) = device(&file.0);
        JournalSet::open(&dev, layout).unwrap();
    }
    check_device(&file.0);
    groups
}

#[test]
fn concurrent_commits_share_transactions_and_all_survive() {
    // Whether commits overlap at all is up to the scheduler: on a 2-CPU machine, with commits
    // to /dev/shm taking microseconds, a run can pass with every commit alone (about 1 run in
    // 10 here). Every run checks the data; a group must form in one of five.
    const ATTEMPTS: u32 = 5;
    let mut groups = 0;
    for attempt in 0..ATTEMPTS {
        groups = join_run(attempt);
        if groups > 0 {
            break;
        }
    }
    assert!(
        groups > 0,
        "{THREADS} threads x {COMMITS} commits on one area, {ATTEMPTS} runs, and no group formed"
    );
}

#[test]
fn file_level_transactions_never_join_a_group() {
    let file = scratch("file");
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let set = {
        let (_e, _l, dev) = device(&file.0);
        JournalSet::format(&dev, layout.clone()).unwrap()
    };
    let done = hammer(&file.0, &set, true);
    assert_eq!(set.stats.groups.load(Ordering::Relaxed), 0);
    let mut tids: Vec<u64> = done.iter().map(|x| x.2).collect();
    tids.sort_unstable();
    tids.dedup();
    assert_eq!(
        tids.len() as u64,
        THREADS * COMMITS,
        "one transaction per commit"
    );
    drop(set);
    {
        let (_e, _l, dev) = device(&file.0);
        JournalSet::open(&dev, layout).unwrap();
    }
    check_device(&file.0);
}

// Mixed modes in one group. Grouping is forced: area 0's leader is a Rio-ordered commit held
// mid-write (its attribute log blocks until released), and the commits under test queue behind
// it one at a time, so the first of them leads the next group and the others are its waiters.

/// One journal area on a simulated disk; home blocks follow it.
const MIX_AREA_BLOCKS: u64 = 64;
const MIX_HOME: u64 = MIX_AREA_BLOCKS;
/// A home block holding journaled metadata (111) not yet checkpointed.
const JOURNALED: u64 = MIX_HOME + 1;

fn mix_layout() -> Layout {
    Layout::per_core(0, MIX_AREA_BLOCKS, 1)
}

/// A journal whose block [`JOURNALED`] holds journaled metadata: a data write over it without
/// a revoke is refused by a two-phase handle (checked here) and taken by a one-write handle
/// (which journals the data too).
fn mixed_set() -> (SimDisk, Arc<JournalSet>) {
    let disk = SimDisk::new(SimConfig::new((MIX_HOME + 16) * 4096, 7)).unwrap();
    let l = lbio();
    let set = JournalSet::format(&disk.open(&l).unwrap(), mix_layout()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&l).unwrap(), CommitMode::Overlapped).unwrap();
    let mut tx = Tx::new();
    tx.write_meta(JOURNALED, &block_of(111)).unwrap();
    j.commit(&tx).unwrap();
    let mut over = Tx::new();
    over.write_data(JOURNALED, &block_of(1)).unwrap();
    assert!(matches!(
        j.commit(&over),
        Err(JournalError::DataOverJournaledBlock { block: JOURNALED })
    ));
    (disk, set)
}

/// Poll `cond` for up to 30 s.
fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(30);
    while !cond() {
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// Commit each of `queued` through a handle of its mode on a thread of its own, in order,
/// while area 0's leader is held mid-commit; each starts once the one before it waits. When
/// the held commit ends, the first leads the next group. Returns each commit's result.
fn queued_behind_a_held_leader(
    disk: &SimDisk,
    set: &Arc<JournalSet>,
    queued: Vec<(CommitMode, Tx)>,
) -> Vec<Result<CommitInfo, JournalError>> {
    let queued = queued
        .into_iter()
        .map(|(mode, tx)| Queued {
            mode,
            tx,
            disk: disk.clone(),
            no_free_frame: false,
        })
        .collect();
    queued_with_handles_behind_a_held_leader(disk, set, queued)
}

/// A commit queued behind the held leader, through a handle of `mode` on `disk` (the journal's
/// device, or another of its size), on an engine whose arena has no free frame when
/// `no_free_frame`.
struct Queued {
    mode: CommitMode,
    tx: Tx,
    disk: SimDisk,
    no_free_frame: bool,
}

/// [`queued_behind_a_held_leader`] with each commit's handle as [`Queued`] says.
fn queued_with_handles_behind_a_held_leader(
    disk: &SimDisk,
    set: &Arc<JournalSet>,
    queued: Vec<Queued>,
) -> Vec<Result<CommitInfo, JournalError>> {
    let armed = Arc::new(AtomicBool::new(false));
    let gate: Gate = Arc::new((Mutex::new((false, false)), Condvar::new()));
    // The held leader's handle outlives the commits under test: its drop checkpoints, and a
    // checkpoint would put the journaled block home under them.
    let finished = Arc::new(AtomicBool::new(false));
    let mut stalled = Vec::new();
    let results = std::thread::scope(|s| {
        let (set0, disk0, armed0, gate0, finished0) = (
            Arc::clone(set),
            disk.clone(),
            Arc::clone(&armed),
            Arc::clone(&gate),
            Arc::clone(&finished),
        );
        let leader = s.spawn(move || {
            let l = lbio();
            let pmr: Box<dyn Pmr> = Box::new(PausingPmr {
                inner: SimPmr {
                    bytes: Rc::new(RefCell::new(vec![0u8; 16 << 10])),
                    disk: disk0.clone(),
                },
                armed: Arc::clone(&armed0),
                gate: gate0,
            });
            let own = LbioArray::new(Rc::clone(l.engine()), LbioConfig::default()).unwrap();
            let j = Journal::with_rio(
                &set0,
                0,
                disk0.open(&l).unwrap(),
                disk0.open(&own).unwrap(),
                pmr,
                OrderedConfig::default(),
            )
            .unwrap();
            let mut tx = Tx::new();
            tx.write_meta(MIX_HOME + 2, &block_of(2)).unwrap();
            armed0.store(true, Ordering::SeqCst);
            j.commit(&tx).unwrap();
            while !finished0.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let held = wait_until(|| gate.0.lock().unwrap().0);
        if !held {
            stalled.push("the leader's commit never reached its attribute log".to_string());
        }
        let mut hs = Vec::new();
        for (i, q) in queued.into_iter().enumerate() {
            if !held {
                break;
            }
            let mode = q.mode;
            let set1 = Arc::clone(set);
            hs.push(s.spawn(move || {
                let l = lbio();
                let j = Journal::new(&set1, 0, q.disk.open(&l).unwrap(), q.mode).unwrap();
                let mut taken = Vec::new();
                if q.no_free_frame {
                    while let Some(b) = l.engine().try_alloc(BLOCK) {
                        taken.push(b);
                    }
                }
                j.commit(&q.tx)
            }));
            if !wait_until(|| set.waiting_commits(0) == i + 1) {
                stalled.push(format!("commit {i} ({}) never queued", mode.name()));
                break;
            }
        }
        {
            let (m, cv) = &*gate;
            m.lock().unwrap().1 = true;
            cv.notify_all();
        }
        let results: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        finished.store(true, Ordering::SeqCst);
        leader.join().unwrap();
        results
    });
    assert!(stalled.is_empty(), "{stalled:?}");
    results
}

fn data_tx(block: u64, v: u64) -> Tx {
    let mut tx = Tx::new();
    tx.write_data(block, &block_of(v)).unwrap();
    tx
}

fn meta_tx(block: u64, v: u64) -> Tx {
    let mut tx = Tx::new();
    tx.write_meta(block, &block_of(v)).unwrap();
    tx
}

/// The home image after recovery.
fn recovered(disk: &SimDisk) -> Vec<u8> {
    let mut img = disk.media();
    recover_image(&mut img, &mix_layout()).unwrap();
    img
}

#[test]
fn a_two_phase_commit_keeps_its_own_refusal_in_a_one_write_group() {
    let (disk, set) = mixed_set();
    let r = queued_behind_a_held_leader(
        &disk,
        &set,
        vec![
            // Leads the group.
            (CommitMode::OneWrite, meta_tx(MIX_HOME + 3, 3)),
            // Its own mode refuses it: the one-write leader's mode would take it.
            (CommitMode::Overlapped, data_tx(JOURNALED, 222)),
            // Accepted by both modes: joins.
            (CommitMode::Vanilla, data_tx(MIX_HOME + 4, 4)),
        ],
    );
    let lead = r[0].as_ref().expect("the one-write leader's commit");
    assert!(
        matches!(
            r[1],
            Err(JournalError::DataOverJournaledBlock { block: JOURNALED })
        ),
        "an overlapped handle's data write over journaled metadata, queued behind a one-write \
         leader, must be refused as its own handle refuses it: {:?} (leader {lead:?})",
        r[1]
    );
    let joined = r[2].as_ref().expect("the vanilla commit");
    assert_eq!(
        joined.tid, lead.tid,
        "a two-phase commit both modes take joins the group"
    );
    let img = recovered(&disk);
    assert_eq!(
        value_at(&img, JOURNALED),
        111,
        "the refused write is not on the device"
    );
    assert_eq!(value_at(&img, MIX_HOME + 3), 3);
    assert_eq!(value_at(&img, MIX_HOME + 4), 4);
}

#[test]
fn a_one_write_commit_keeps_its_own_outcome_in_a_two_phase_group() {
    let (disk, set) = mixed_set();
    let r = queued_behind_a_held_leader(
        &disk,
        &set,
        vec![
            // Leads the group.
            (CommitMode::Overlapped, meta_tx(MIX_HOME + 3, 3)),
            // Its own mode takes it (and journals the data); the leader's mode would refuse it.
            (CommitMode::OneWrite, data_tx(JOURNALED, 333)),
            // Accepted by both modes: joins.
            (CommitMode::OneWrite, data_tx(MIX_HOME + 4, 4)),
        ],
    );
    let lead = r[0].as_ref().expect("the overlapped leader's commit");
    let own = r[1].as_ref().expect(
        "a one-write handle's data write over journaled metadata, queued behind an overlapped \
         leader, is taken as its own handle takes it",
    );
    assert!(own.data_journaled, "{own:?}");
    let joined = r[2].as_ref().expect("the second one-write commit");
    assert_eq!(
        joined.tid, lead.tid,
        "a one-write commit both modes take joins the group"
    );
    let img = recovered(&disk);
    assert_eq!(value_at(&img, JOURNALED), 333);
    assert_eq!(value_at(&img, MIX_HOME + 3), 3);
    assert_eq!(value_at(&img, MIX_HOME + 4), 4);
}

#[test]
fn group_members_get_the_leaders_io_error() {
    let (disk, set) = mixed_set();
    // A device of the journal's size whose power is off: every write through it fails.
    let dead = SimDisk::new(disk.config()).unwrap();
    dead.cut_power();
    let r = queued_with_handles_behind_a_held_leader(
        &disk,
        &set,
        vec![
            // Leads the group; its writes fail.
            Queued {
                mode: CommitMode::Overlapped,
                tx: meta_tx(MIX_HOME + 3, 3),
                disk: dead,
                no_free_frame: false,
            },
            // Joins it.
            Queued {
                mode: CommitMode::Overlapped,
                tx: meta_tx(MIX_HOME + 4, 4),
                disk: disk.clone(),
                no_free_frame: false,
            },
        ],
    );
    let cause = match &r[0] {
        Err(e @ JournalError::Io(_)) => e.to_string(),
        other => panic!("the leader, writing through a dead device: {other:?}"),
    };
    match &r[1] {
        Err(JournalError::GroupFailed { cause: c, aborted }) => {
            assert_eq!(c, &cause, "the member is told the leader's error");
            assert!(aborted, "a failed write aborts the set");
        }
        other => panic!(
            "a member of a group whose leader failed with an I/O error ({cause}) must get that \
             error: {other:?}"
        ),
    }
}

#[test]
fn group_members_of_a_group_that_wrote_nothing_may_commit_again() {
    let (disk, set) = mixed_set();
    let r = queued_with_handles_behind_a_held_leader(
        &disk,
        &set,
        vec![
            // Leads the group; its arena has no frame to give, so it writes nothing.
            Queued {
                mode: CommitMode::Overlapped,
                tx: meta_tx(MIX_HOME + 3, 3),
                disk: disk.clone(),
                no_free_frame: true,
            },
            // Joins it.
            Queued {
                mode: CommitMode::Vanilla,
                tx: meta_tx(MIX_HOME + 4, 4),
                disk: disk.clone(),
                no_free_frame: false,
            },
        ],
    );
    let cause = match &r[0] {
        Err(e @ JournalError::Core(aios_core::CoreError::ArenaExhausted { .. })) => e.to_string(),
        other => panic!("the leader, with no free frame: {other:?}"),
    };
    match &r[1] {
        Err(JournalError::GroupFailed { cause: c, aborted }) => {
            assert_eq!(c, &cause, "the member is told the leader's error");
            assert!(!aborted, "nothing was written: the set goes on");
        }
        other => panic!(
            "a member of a group whose leader could not get a buffer ({cause}) must get that \
             error: {other:?}"
        ),
    }
    // The member commits again, by itself, and the set takes it.
    let l = lbio();
    let j = Journal::new(&set, 0, disk.open(&l).unwrap(), CommitMode::Vanilla).unwrap();
    j.commit(&meta_tx(MIX_HOME + 4, 4)).unwrap();
    let img = recovered(&disk);
    assert_eq!(value_at(&img, MIX_HOME + 4), 4);
    assert_ne!(value_at(&img, MIX_HOME + 3), 3, "the failed leader's block");
}
