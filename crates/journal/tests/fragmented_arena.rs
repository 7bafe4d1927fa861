//! A commit whose data and log blocks are consecutive goes out as few long writes, each from one
//! buffer of frames in a row. When the engine's arena has no such run free (fragmented by
//! buffers held elsewhere), the commit still succeeds, from shorter buffers, and recovery finds
//! every block it wrote. In each commit mode.

use std::rc::Rc;

use aios_core::{Engine, EngineConfig, FixedBuf};
use journal::{recover_image, CommitMode, Journal, JournalSet, Layout, Tx};
use lbio::{CrashOptions, LbioArray, LbioConfig, SimConfig, SimDisk};

const BLOCK: usize = 4096;
const DATA: std::ops::Range<u64> = 300..308;
const META: [u64; 2] = [200, 201];

fn fill(block: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (block as usize * 31 + i / 8) as u8)
        .collect()
}

/// Take every free frame of the arena, then give back every other one: half the arena is free,
/// and no two free frames are neighbours.
fn fragment(engine: &Engine) -> Vec<FixedBuf> {
    let mut all = Vec::new();
    while let Some(b) = engine.try_alloc(BLOCK) {
        all.push(b);
    }
    assert!(all.len() >= 64, "arena of {} frames", all.len());
    let mut kept = Vec::new();
    for (i, b) in all.into_iter().enumerate() {
        if i % 2 == 0 {
            kept.push(b);
        }
    }
    kept
}

fn commit_with_fragmented_arena(mode: CommitMode) {
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let disk = SimDisk::new(SimConfig::new(512 * BLOCK as u64, 7)).unwrap();
    let dev = disk.open(&lbio).unwrap();
    let layout = Layout::per_core(0, 64, 1);
    let set = JournalSet::format(&dev, layout.clone()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), mode).unwrap();

    let _held = fragment(&engine);
    assert!(
        engine.try_alloc(2 * BLOCK).is_none(),
        "the arena still has two free frames in a row"
    );
    let mut tx = Tx::new();
    for b in DATA {
        tx.write_data(b, &fill(b)).unwrap();
    }
    for b in META {
        tx.write_meta(b, &fill(b)).unwrap();
    }
    j.commit(&tx)
        .unwrap_or_else(|e| panic!("{}: commit with a fragmented arena: {e}", mode.name()));

    // Acknowledged, so durable: any power cut now leaves it recoverable.
    for _ in 0..8 {
        let mut img = disk.crash_image(CrashOptions::default());
        let report = recover_image(&mut img, &layout).unwrap();
        assert!(report.corrupt.is_empty(), "{}: {report:?}", mode.name());
        for b in DATA.chain(META) {
            let at = b as usize * BLOCK;
            assert!(
                img[at..at + BLOCK] == fill(b)[..],
                "{}: block {b} after recovery",
                mode.name()
            );
        }
    }
}

#[test]
fn overlapped_commit_needs_no_run_of_free_frames() {
    commit_with_fragmented_arena(CommitMode::Overlapped);
}

#[test]
fn vanilla_commit_needs_no_run_of_free_frames() {
    commit_with_fragmented_arena(CommitMode::Vanilla);
}

#[test]
fn one_write_commit_needs_no_run_of_free_frames() {
    commit_with_fragmented_arena(CommitMode::OneWrite);
}
