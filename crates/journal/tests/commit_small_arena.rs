//! Commits through an engine whose arena has far fewer free frames than the transaction writes
//! blocks: the application holds all but a few. A commit takes the arena's frames as it goes
//! (sending what it has built and taking back the buffers of finished writes), so it succeeds,
//! and recovery finds every block it wrote, in each commit mode. With no frame free at all and
//! nothing in flight, the commit is refused with a typed error before anything reaches the
//! device, and the set takes the next commit. A Rio-ordered handle, whose ordered device takes
//! each write with its buffer and hands it back when done, does the same.

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
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let disk = SimDisk::new(SimConfig::new(512 * BLOCK as u64, 11)).unwrap();
    let layout = Layout::per_core(0, 64, 1);
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

/// Every power cut from now on recovers `round`'s blocks.
fn check_recovers(rig: &Rig, round: u64, what: &str) {
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
        for b in DATA.into_iter().chain(META) {
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
