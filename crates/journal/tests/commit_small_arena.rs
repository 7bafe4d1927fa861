//! Commits through an engine whose arena has far fewer free frames than the transaction writes
//! blocks: the application holds all but a few. A commit takes the arena's frames as it goes
//! (sending what it has built and taking back the buffers of finished writes), so it succeeds,
//! and recovery finds every block it wrote, in each commit mode. With no frame free at all and
//! nothing in flight, the commit is refused with a typed error before anything reaches the
//! device, and the set takes the next commit. A Rio-ordered handle, whose ordered device takes
//! each write with its buffer and hands it back when done, does the same, and never leaves the
//! ordered device a merge copy that the arena has no room for.

mod common;
use common::SimPmr;

use std::cell::RefCell;
use std::rc::Rc;

use aios_core::{CoreError, Engine, EngineConfig, FixedBuf};
use journal::rio_ordering::{self, MemPmr, OrderedConfig};
use journal::{
    recover_image, recover_image_rio, rio_prefix, CommitMode, Journal, JournalError, JournalSet,
    Layout, Tx,
};
use lbio::{CrashOptions, LbioArray, LbioConfig, SimConfig, SimDisk};

const BLOCK: usize = 4096;
/// In-place data: a run of six blocks in a row and three scattered ones.
const DATA: [u64; 9] = [300, 301, 302, 303, 304, 305, 310, 320, 330];
/// Journaled metadata: seven blocks.
const META: [u64; 7] = [200, 201, 202, 203, 210, 220, 230];

fn fill(block: u64, round: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (block as usize * 31 + round as usize * 7 + i / 8) as u8)
        .collect()
}

fn tx_of(round: u64) -> Tx {
    let mut tx = Tx::new();
    for b in DATA {
        tx.write_data(b, &fill(b, round)).unwrap();
    }
    for b in META {
        tx.write_meta(b, &fill(b, round)).unwrap();
    }
    tx
}

struct Rig {
    engine: Rc<Engine>,
    disk: SimDisk,
    layout: Layout,
    journal: Journal,
    /// A Rio-ordered handle's attribute log (persistent memory emulated in RAM).
    rio_log: Option<Rc<RefCell<Vec<u8>>>>,
}

/// Which handle commits: one of a mode, or a Rio-ordered one whose ordered device sends
/// closed groups `batch` at a time.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Handle {
    Plain(CommitMode),
    Rio { batch: usize },
}

impl Handle {
    fn name(self) -> &'static str {
        match self {
            Handle::Plain(m) => m.name(),
            Handle::Rio { batch: 1 } => "rio",
            Handle::Rio { .. } => "rio (batched groups)",
        }
    }
}

/// A one-area journal on a 512-block SimDisk, committed to through an engine of a 1 MiB arena
/// (256 frames).
fn rig(handle: Handle) -> Rig {
    rig_of(handle, Sizes::default())
}

/// What [`rig_of`] builds: the arena, the SimDisk, the journal area (from block 0), the
/// device's largest request, and the ordered device's largest merged command.
struct Sizes {
    arena_bytes: usize,
    disk_blocks: u64,
    area_blocks: u64,
    max_transfer: u32,
    max_merge: u32,
}

impl Default for Sizes {
    fn default() -> Self {
        Sizes {
            arena_bytes: 1 << 20,
            disk_blocks: 512,
            area_blocks: 64,
            max_transfer: SimConfig::new(0, 0).max_transfer_bytes,
            max_merge: OrderedConfig::default().max_merge_bytes,
        }
    }
}

fn rig_of(handle: Handle, sizes: Sizes) -> Rig {
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: sizes.arena_bytes,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let disk = SimDisk::new(SimConfig {
        max_transfer_bytes: sizes.max_transfer,
        ..SimConfig::new(sizes.disk_blocks * BLOCK as u64, 11)
    })
    .unwrap();
    let layout = Layout::per_core(0, sizes.area_blocks, 1);
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let (journal, rio_log) = match handle {
        Handle::Plain(mode) => (
            Journal::new(&set, 0, disk.open(&lbio).unwrap(), mode).unwrap(),
            None,
        ),
        Handle::Rio { batch } => {
            // The ordered device on an lbio array of its own, over the same engine (its
            // buffers come from the same arena).
            let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
            let bytes = Rc::new(RefCell::new(vec![0u8; 16 << 10]));
            let pmr = SimPmr {
                bytes: Rc::clone(&bytes),
                disk: disk.clone(),
            };
            let j = Journal::with_rio(
                &set,
                0,
                disk.open(&lbio).unwrap(),
                disk.open(&own).unwrap(),
                Box::new(pmr),
                OrderedConfig {
                    batch,
                    max_merge_bytes: sizes.max_merge,
                    ..OrderedConfig::default()
                },
            )
            .unwrap();
            (j, Some(bytes))
        }
    };
    Rig {
        engine,
        disk,
        layout,
        journal,
        rio_log,
    }
}

/// Take every frame of the arena but `free`.
fn hold_all_but(engine: &Engine, free: usize) -> Vec<FixedBuf> {
    let mut held = Vec::new();
    while let Some(b) = engine.try_alloc(BLOCK) {
        held.push(b);
    }
    assert!(held.len() >= free + DATA.len() + META.len());
    held.truncate(held.len() - free);
    held
}

/// Take every frame of the arena but the `free` highest, which lie in one run.
fn hold_all_but_a_run(engine: &Engine, free: usize) -> Vec<FixedBuf> {
    let mut held = hold_all_but(engine, 0);
    held.sort_by_key(|b| b.as_ptr() as usize);
    held.truncate(held.len() - free);
    held
}

/// Every power cut from now on recovers `round`'s blocks.
fn check_recovers(rig: &Rig, round: u64, what: &str) {
    check_recovers_of(rig, &[&DATA, &META], round, what);
}

/// Every power cut from now on recovers `round`'s bytes in `blocks`.
fn check_recovers_of(rig: &Rig, blocks: &[&[u64]], round: u64, what: &str) {
    for _ in 0..8 {
        let mut img = rig.disk.crash_image(CrashOptions::default());
        let report = match &rig.rio_log {
            None => recover_image(&mut img, &rig.layout).unwrap(),
            Some(bytes) => {
                // The attribute log as the crash leaves it says how far the stream is durable.
                let mut log = MemPmr::new(bytes.borrow().len());
                log.bytes_mut().copy_from_slice(&bytes.borrow());
                let prefix = rio_prefix(&[rio_ordering::scan(&log).unwrap()], false).unwrap();
                recover_image_rio(&mut img, &rig.layout, &prefix).unwrap()
            }
        };
        assert!(report.corrupt.is_empty(), "{what}: {report:?}");
        for &b in blocks.iter().copied().flatten() {
            let at = b as usize * BLOCK;
            assert!(
                img[at..at + BLOCK] == fill(b, round)[..],
                "{what}: block {b} after recovery"
            );
        }
    }
}

fn commits_fit_an_arena_with_few_free_frames(handle: Handle) {
    {
        for free in [1, 3] {
            let what = format!("{} with {free} free frames", handle.name());
            let rig = rig(handle);
            let held = hold_all_but(&rig.engine, free);
            // Eight rounds: the log (63 blocks) wraps, and full logs checkpoint.
            for round in 0..8 {
                let info = match rig.journal.commit(&tx_of(round)) {
                    Ok(info) => info,
                    Err(e) => {
                        // Whether the failure cost the set: the same commit again, every frame
                        // free.
                        drop(held);
                        let again = rig.journal.commit(&tx_of(round));
                        panic!(
                            "{what}: commit {round}: {e}; the same commit again, every frame \
                             free: {again:?}"
                        )
                    }
                };
                assert_eq!(
                    info.data_journaled,
                    handle == Handle::Plain(CommitMode::OneWrite),
                    "{what}"
                );
                check_recovers(&rig, round, &what);
            }
            let checkpoints = rig
                .journal
                .set()
                .stats
                .checkpoints
                .load(std::sync::atomic::Ordering::Relaxed);
            assert!(checkpoints > 0, "{what}: no checkpoint ran");
            assert_eq!(
                rig.engine.arena().free_frames() as usize,
                free,
                "{what}: the commits gave back every frame they took"
            );
            drop(held);
        }
    }
}

fn a_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on(handle: Handle) {
    {
        let what = handle.name();
        let rig = rig(handle);
        rig.journal.commit(&tx_of(0)).unwrap();
        let started = rig.disk.started();
        let held = hold_all_but(&rig.engine, 0);
        match rig.journal.commit(&tx_of(1)) {
            Err(JournalError::Core(CoreError::ArenaExhausted { free: 0, .. })) => {}
            other => panic!("{what}: with every frame held: {other:?}"),
        }
        assert_eq!(
            rig.disk.started(),
            started,
            "{what}: the refused commit sent requests"
        );
        check_recovers(&rig, 0, what);
        drop(held);
        let info = rig.journal.commit(&tx_of(2)).unwrap_or_else(|e| {
            panic!("{what}: the commit after a refused one (frames free again): {e}")
        });
        assert_eq!(info.tid, 2, "{what}: the refused commit took no id");
        check_recovers(&rig, 2, what);
    }
}

#[test]
fn vanilla_commits_fit_an_arena_with_few_free_frames() {
    commits_fit_an_arena_with_few_free_frames(Handle::Plain(CommitMode::Vanilla));
}

#[test]
fn overlapped_commits_fit_an_arena_with_few_free_frames() {
    commits_fit_an_arena_with_few_free_frames(Handle::Plain(CommitMode::Overlapped));
}

#[test]
fn one_write_commits_fit_an_arena_with_few_free_frames() {
    commits_fit_an_arena_with_few_free_frames(Handle::Plain(CommitMode::OneWrite));
}

#[test]
fn a_vanilla_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on() {
    a_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on(Handle::Plain(
        CommitMode::Vanilla,
    ));
}

#[test]
fn an_overlapped_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on() {
    a_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on(Handle::Plain(
        CommitMode::Overlapped,
    ));
}

#[test]
fn a_one_write_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on() {
    a_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on(Handle::Plain(
        CommitMode::OneWrite,
    ));
}

#[test]
fn rio_commits_fit_an_arena_with_few_free_frames() {
    commits_fit_an_arena_with_few_free_frames(Handle::Rio { batch: 1 });
}

/// Closed groups held two at a time (as aiosfs configures its Rio handles): the ordered
/// device merges whole groups that follow each other on the device into one copied command.
#[test]
fn rio_commits_with_batched_groups_fit_an_arena_with_few_free_frames() {
    commits_fit_an_arena_with_few_free_frames(Handle::Rio { batch: 2 });
}

#[test]
fn a_rio_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on() {
    a_commit_with_no_frame_to_be_had_is_refused_and_the_set_goes_on(Handle::Rio { batch: 1 });
}

/// Journaled metadata alone: its log blocks and the commit block follow each other on the
/// device.
fn meta_tx_of(round: u64) -> Tx {
    let mut tx = Tx::new();
    for b in META {
        tx.write_meta(b, &fill(b, round)).unwrap();
    }
    tx
}

/// With closed groups held two at a time (as aiosfs runs its Rio handles), the ordered device
/// sends the journal run's group and the commit block's group, which follow each other on the
/// device, as one command copied into a buffer of their total length from the arena. That copy
/// is asked for when the commit block's group closes, after the commit took its id and every
/// buffer it builds. For each count of free frames from the fewest the commit's own buffers take
/// (the frame taken before its id, the 8-block journal run, the commit block) up to more than
/// they and the copy take together, the commit goes through (unmerged where the copy cannot be
/// had, merged as before where it can), every power cut recovers it, and with every frame free
/// again the next commit goes through too. Before the fix, with 10 to 18 free frames: "Rio
/// ordering: stream 0: a write failed: sending it: the arena has no run of 9 free frames (1 of
/// 256 free, ...)", and the next commit got `Aborted`.
#[test]
fn a_batched_rio_commit_whose_merge_copy_finds_no_room_goes_out_unmerged() {
    let handle = Handle::Rio { batch: 2 };
    let journal_blocks = {
        let rig = rig(handle);
        rig.journal.commit(&meta_tx_of(0)).unwrap().log_blocks as usize - 1
    };
    for free in journal_blocks + 2..=2 * journal_blocks + 4 {
        let what = format!("{} with {free} free frames", handle.name());
        let rig = rig(handle);
        let merged = || rig.journal.rio_stats().unwrap().merged_cmds;
        // Every frame free: the journal run and the commit block go out as one copied command.
        rig.journal.commit(&meta_tx_of(0)).unwrap();
        assert_eq!(merged(), 1, "{what}: the first commit was not merged");
        let held = hold_all_but_a_run(&rig.engine, free);
        let frames = rig.engine.arena().free_frames();
        if let Err(e) = rig.journal.commit(&meta_tx_of(1)) {
            drop(held);
            let again = rig.journal.commit(&meta_tx_of(1));
            panic!("{what}: {e}; the same commit again, every frame free: {again:?}");
        }
        if free == journal_blocks + 2 {
            // The frame taken before the id is all that is left for a copy of the run and the
            // commit block together.
            assert_eq!(merged(), 1, "{what}: a copy with no room for it");
        }
        assert_eq!(
            rig.engine.arena().free_frames(),
            frames,
            "{what}: the commit gave back every frame it took"
        );
        if free == 2 * journal_blocks + 4 {
            // Room for every buffer and the copy: merged as before.
            assert_eq!(merged(), 2, "{what}: not merged with room for the copy");
        }
        check_recovers_of(&rig, &[&META], 1, &what);
        drop(held);
        let info = rig
            .journal
            .commit(&meta_tx_of(2))
            .unwrap_or_else(|e| panic!("{what}: the next commit, every frame free: {e}"));
        assert_eq!(info.tid, 3, "{what}");
        check_recovers_of(&rig, &[&META], 2, &what);
    }
}

/// Journaled metadata alone, 300 blocks from block 1000: a commit's log run is cut into a run
/// of 1 MiB, the longest write a commit sends, and the rest.
fn long_meta_tx_of(round: u64) -> Tx {
    let mut tx = Tx::new();
    for b in 1000..1300u64 {
        tx.write_meta(b, &fill(b, round)).unwrap();
    }
    tx
}

/// An ordered device that merges commands of up to 4 MiB, on a device that takes them, holding
/// closed groups three at a time. The commit's 302 log blocks go out as a run of 1 MiB and the
/// rest, and the commit block follows them on the device: the device copies them into one
/// command when it sends them, after the commit took its id, and the commit takes buffers
/// while the copy waits in the queue. For each count of free frames around where the arena has
/// room for the commit's buffers and the copy together (and a few far below), the commit goes
/// through (unmerged where the copy cannot be had) and every power cut recovers it. Before the
/// fix it failed, and aborted the set, with 304 and with 600 to 606 free frames ("the arena has
/// no run of 303 free frames"); with the fix but no check of the queued copy when a buffer is
/// taken, with 605 ("no run of 302 free frames"); with a group of following runs left to the
/// device to copy, with 304.
#[test]
fn a_rio_commit_whose_queued_runs_merge_fits_a_short_arena() {
    let handle = Handle::Rio { batch: 3 };
    let sizes = || Sizes {
        arena_bytes: 8 << 20,
        disk_blocks: 2048,
        area_blocks: 1000,
        max_transfer: 4 << 20,
        max_merge: 4 << 20,
    };
    let journal_blocks = {
        let rig = rig_of(handle, sizes());
        let info = rig.journal.commit(&long_meta_tx_of(0)).unwrap();
        // The runs and the commit block, merged into one command.
        assert_eq!(rig.journal.rio_stats().unwrap().merged_cmds, 1);
        info.log_blocks as usize - 1
    };
    assert!(journal_blocks > 256);
    let metas: Vec<u64> = (1000..1300).collect();
    let near = 2 * journal_blocks - 4..=2 * journal_blocks + 6;
    for free in [1, 2, journal_blocks, journal_blocks + 2]
        .into_iter()
        .chain(near)
    {
        let what = format!("{} with {free} free frames", handle.name());
        let rig = rig_of(handle, sizes());
        let merged = || rig.journal.rio_stats().unwrap().merged_cmds;
        rig.journal.commit(&long_meta_tx_of(0)).unwrap();
        let held = hold_all_but_a_run(&rig.engine, free);
        let frames = rig.engine.arena().free_frames();
        if let Err(e) = rig.journal.commit(&long_meta_tx_of(1)) {
            drop(held);
            let again = rig.journal.commit(&long_meta_tx_of(1));
            panic!("{what}: {e}; the same commit again, every frame free: {again:?}");
        }
        if free == 2 * journal_blocks + 6 {
            // Room for every buffer and the copy: merged as before.
            assert_eq!(merged(), 2, "{what}: not merged with room for the copy");
        }
        assert_eq!(
            rig.engine.arena().free_frames(),
            frames,
            "{what}: the commit gave back every frame it took"
        );
        check_recovers_of(&rig, &[&metas], 1, &what);
        drop(held);
    }
}
