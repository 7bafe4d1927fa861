//! Recovery and format on an engine whose arena cannot give a long buffer: one configured with
//! a single 4 KiB frame, and a large one with every frame but one held by the application.
//! Each must leave the device exactly as the same call on a roomy arena does, report the same,
//! and keep its typed errors. Recovery reads whole areas (longer than its 256 KiB reads),
//! writes more home blocks than it keeps in flight at once, and writes one superblock per
//! area; format zeroes areas longer than its 64-block zero buffer.

use std::rc::Rc;

use aios_core::{Engine, EngineConfig, FixedBuf};
use journal::{CommitMode, Journal, JournalError, JournalSet, Layout, Tx};
use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk};

const BLOCK: usize = 4096;
/// Two areas of 100 blocks (400 KiB each): recovery reads each in more than one 256 KiB piece.
const AREA_BLOCKS: u64 = 100;
const AREAS: usize = 2;
const HOME: u64 = AREA_BLOCKS * AREAS as u64;
const DEVICE_BLOCKS: u64 = HOME + 200;

fn engine(arena_bytes: usize) -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap()
}

fn layout() -> Layout {
    Layout::per_core(0, AREA_BLOCKS, AREAS)
}

fn fill(block: u64, round: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (block as usize * 7 + round as usize * 13 + i / 16) as u8)
        .collect()
}

/// An arena as a busy application leaves it: how the journal call gets its buffers.
enum Arena {
    /// A roomy arena, nothing held (the normal case).
    Roomy,
    /// Configured with one 4 KiB frame.
    OneFrame,
    /// 1 MiB, every frame but one held elsewhere.
    AllButOneHeld,
}

/// An lbio array on an engine whose arena is as `arena` says, and the buffers held to make it so.
fn array(arena: &Arena) -> (Rc<LbioArray>, Vec<FixedBuf>) {
    let e = match arena {
        Arena::Roomy => engine(4 << 20),
        Arena::OneFrame => engine(BLOCK),
        Arena::AllButOneHeld => engine(1 << 20),
    };
    let mut held = Vec::new();
    if let Arena::AllButOneHeld = arena {
        while let Some(b) = e.try_alloc(BLOCK) {
            held.push(b);
        }
        held.pop();
        assert_eq!(held.len(), 255);
    }
    assert!(
        e.try_alloc_run(2 * BLOCK).is_none() || matches!(arena, Arena::Roomy),
        "the arena still has two frames in a row"
    );
    (LbioArray::new(e, LbioConfig::default()).unwrap(), held)
}

/// A two-area journal left as a crash leaves it: 40 metadata blocks over several commits in
/// each area (some rewritten, some revoked), data in place, no checkpoint. The device's bytes.
fn crashed_journal() -> Vec<u8> {
    let (lbio, _held) = array(&Arena::Roomy);
    let disk = SimDisk::new(SimConfig::new(DEVICE_BLOCKS * BLOCK as u64, 5)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout()).unwrap();
    let handles: Vec<Journal> = (0..AREAS)
        .map(|a| Journal::new(&set, a, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap())
        .collect();
    let mut tx = Tx::new();
    for round in 0..3u64 {
        for (a, j) in handles.iter().enumerate() {
            tx.clear();
            for k in 0..20u64 {
                let b = HOME + a as u64 * 20 + k;
                tx.write_meta(b, &fill(b, round)).unwrap();
            }
            tx.write_data(HOME + 100 + round, &fill(HOME + 100 + round, round))
                .unwrap();
            if round == 2 {
                tx.clear();
                tx.revoke(HOME + a as u64 * 20);
                tx.write_meta(HOME + 60 + a as u64, &fill(1, round))
                    .unwrap();
            }
            j.commit(&tx).unwrap();
        }
    }
    for j in handles {
        std::mem::forget(j);
    }
    disk.media()
}

/// `JournalSet::open` on a copy of `image` through an arena as `arena` says: the report (as
/// text) and the device's bytes after it.
fn open_with(image: &[u8], arena: &Arena) -> Result<(String, Vec<u8>), JournalError> {
    let (lbio, _held) = array(arena);
    let disk = SimDisk::from_image(
        SimConfig::new(DEVICE_BLOCKS * BLOCK as u64, 9),
        image.to_vec(),
    )
    .unwrap();
    let (set, report) = JournalSet::open(&disk.open(&lbio).unwrap(), layout())?;
    Ok((
        format!("{report:?} next_tid {}", set.next_tid()),
        disk.media(),
    ))
}

#[test]
fn recovery_with_small_arena_buffers_matches_the_normal_case() {
    let image = crashed_journal();
    let (want_report, want) = open_with(&image, &Arena::Roomy).unwrap();
    assert!(
        want_report.contains("replayed: [[1, 3, 5], [2, 4, 6]]"),
        "{want_report}"
    );
    // Block HOME + 1 holds its last journaled version (round 1); HOME, journaled by area 0
    // and then revoked, is not replayed.
    let at = |b: u64| b as usize * BLOCK..(b as usize + 1) * BLOCK;
    assert!(want[at(HOME + 1)] == fill(HOME + 1, 1)[..]);
    assert!(want[at(HOME)] != fill(HOME, 1)[..]);
    for arena in [Arena::OneFrame, Arena::AllButOneHeld] {
        let name = match arena {
            Arena::Roomy => "roomy",
            Arena::OneFrame => "one frame",
            Arena::AllButOneHeld => "all but one frame held",
        };
        let (report, got) =
            open_with(&image, &arena).unwrap_or_else(|e| panic!("{name}: open failed: {e}"));
        assert_eq!(report, want_report, "{name}");
        assert!(got == want, "{name}: the device differs after recovery");
    }
}

#[test]
fn recovery_with_small_arena_buffers_keeps_its_typed_errors() {
    let mut image = crashed_journal();
    // Area 1's superblock damaged.
    image[AREA_BLOCKS as usize * BLOCK + 40] ^= 1;
    for arena in [Arena::Roomy, Arena::OneFrame, Arena::AllButOneHeld] {
        match open_with(&image, &arena) {
            Err(JournalError::BadSuperblock { area: 1, why }) => {
                assert!(why.contains("checksum"), "{why}")
            }
            other => panic!("{:?}", other.map(|r| r.0)),
        }
    }
}

#[test]
fn format_with_small_arena_buffers_matches_the_normal_case() {
    // A device full of old bytes: format must zero every log block.
    let old: Vec<u8> = (0..DEVICE_BLOCKS as usize * BLOCK)
        .map(|i| (i / 512) as u8 | 1)
        .collect();
    let format_with = |arena: &Arena| {
        let (lbio, _held) = array(arena);
        let disk =
            SimDisk::from_image(SimConfig::new(DEVICE_BLOCKS * BLOCK as u64, 3), old.clone())
                .unwrap();
        JournalSet::format(&disk.open(&lbio).unwrap(), layout())?;
        Ok::<_, JournalError>(disk.media())
    };
    let want = format_with(&Arena::Roomy).unwrap();
    assert!(want[BLOCK..AREA_BLOCKS as usize * BLOCK]
        .iter()
        .all(|&b| b == 0));
    for arena in [Arena::OneFrame, Arena::AllButOneHeld] {
        let got = format_with(&arena).unwrap_or_else(|e| panic!("format failed: {e}"));
        assert!(got == want, "the device differs after format");
    }
}
