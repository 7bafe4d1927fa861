//! Rio-ordered commits on a real file (O_DIRECT through lbio), with the attribute log as a
//! block log in the same file: commit, stop without a checkpoint (what a process crash leaves),
//! read the attribute log back, recover with it, and find every committed block home. Opening
//! the same journal without the attribute log is refused rather than trusted.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use aios_core::{Engine, EngineConfig};
use journal::rio_ordering::{self, BlockPmr, MemPmr, OrderedConfig, Pmr};
use journal::{rio_prefix, CommitMode, Journal, JournalError, JournalSet, Layout, Tx};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig};

const AREA_BLOCKS: u64 = 128;
const LOG_BLOCKS: u64 = 4;
const AREAS: u64 = 2;
/// Home blocks start after the journal areas; the attribute logs sit at the file's end.
const HOME: u64 = AREAS * AREA_BLOCKS;
const BLOCKS: u64 = HOME + 64 + AREAS * LOG_BLOCKS;

fn log_at(area: u64) -> u64 {
    (HOME + 64 + area * LOG_BLOCKS) * 4096
}

fn open(lbio: &Rc<LbioArray>, path: &std::path::Path) -> Device {
    Device::open(
        lbio,
        path,
        DeviceConfig {
            write: true,
            ..DeviceConfig::default()
        },
    )
    .unwrap()
}

fn block_of(v: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// A zeroed file of `blocks` blocks in a directory of its own (`name`), and an engine with an
/// arena of `arena` bytes and an lbio array to run on it.
fn setup(name: &str, blocks: u64, arena: usize) -> (PathBuf, PathBuf, Rc<Engine>, Rc<LbioArray>) {
    let dir = std::env::temp_dir().join(format!("aios-rio-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("journal.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(blocks * 4096)
        .unwrap();
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: arena,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    (dir, path, engine, lbio)
}

/// A Rio handle on `area` (its ordered device on an lbio array of its own), with a fresh
/// attribute log (one stream per journal area) in the `LOG_BLOCKS` blocks at byte `log_at`; and the
/// log's slot count.
fn rio_handle(
    set: &std::sync::Arc<JournalSet>,
    area: usize,
    lbio: &Rc<LbioArray>,
    path: &Path,
    log_at: u64,
) -> (Journal, u32) {
    let engine = lbio.engine();
    let own = LbioArray::new(Rc::clone(engine), LbioConfig::default()).unwrap();
    let len = (LOG_BLOCKS * 4096) as usize;
    let pmr: Box<dyn Pmr> = Box::new(BlockPmr::open(engine, path, log_at, len).unwrap());
    let cfg = OrderedConfig {
        batch: 2,
        ..OrderedConfig::default()
    };
    let j = Journal::with_rio(set, area, open(lbio, path), open(&own, path), pmr, cfg).unwrap();
    let slots = j.rio_log_slots().unwrap();
    (j, slots)
}

/// A second Rio handle on area 0, its attribute log in `log`, is refused: the area has one.
fn assert_second_rio_handle_refused(
    set: &std::sync::Arc<JournalSet>,
    lbio: &Rc<LbioArray>,
    path: &Path,
    log: Box<dyn Pmr>,
) {
    let own = LbioArray::new(Rc::clone(lbio.engine()), LbioConfig::default()).unwrap();
    let cfg = OrderedConfig::default();
    let e = Journal::with_rio(set, 0, open(lbio, path), open(&own, path), log, cfg)
        .err()
        .expect("a second Rio handle on area 0");
    assert!(
        e.to_string().contains("already has a Rio-ordered handle"),
        "{e}"
    );
}

#[test]
fn rio_ordered_commits_on_a_file_recover_with_their_block_log() {
    let (dir, path, engine, lbio) = setup("file", BLOCKS, 4 << 20);
    let layout = Layout::per_core(0, AREA_BLOCKS, AREAS as usize);
    let plp = open(&lbio, &path).critical_route().0.power_loss_protected;
    let set = JournalSet::format(&open(&lbio, &path), layout.clone()).unwrap();
    let mut want = std::collections::HashMap::new();
    {
        // One Rio handle per area, each with its own lbio array for the ordered device.
        let mut handles = Vec::new();
        for a in 0..AREAS {
            let (j, _) = rio_handle(&set, a as usize, &lbio, &path, log_at(a));
            assert!(j.rio_ordered());
            handles.push(j);
        }
        // A second Rio handle on an area is refused.
        assert_second_rio_handle_refused(&set, &lbio, &path, Box::new(MemPmr::new(4096)));

        let mut v = 0;
        for i in 0..40u64 {
            let j = &handles[(i % AREAS) as usize];
            let mut tx = Tx::for_file(i as u32);
            v += 1;
            let meta = HOME + (i % 16);
            tx.write_meta(meta, &block_of(v)).unwrap();
            want.insert(meta, v);
            v += 1;
            let data = HOME + 32 + (i % 16);
            tx.write_data(data, &block_of(v)).unwrap();
            want.insert(data, v);
            j.commit(&tx).unwrap();
        }
        let st = handles[0].rio_stats().unwrap();
        assert_eq!(
            st.requests,
            20 * 3,
            "data, journal run and commit block per commit"
        );
        if !plp {
            assert_eq!(st.flushes, 20, "one FLUSH per commit");
        }
        // Left as a process crash leaves them: forgotten, not dropped (dropping a Rio handle
        // checkpoints its area, which would put the metadata home). It lives only in the
        // journal.
        std::mem::forget(handles);
    }
    // Before recovery the metadata blocks are not home.
    let raw = std::fs::read(&path).unwrap();
    let at = |b: u64| u64::from_le_bytes(raw[(b * 4096) as usize..][..8].try_into().unwrap());
    assert_eq!(at(HOME), 0, "metadata went home before any checkpoint");

    let dev = open(&lbio, &path);
    let e = JournalSet::open(&dev, layout.clone()).unwrap_err();
    assert!(matches!(e, JournalError::RioLogsNeeded { .. }), "{e}");

    let scans: Vec<_> = (0..AREAS)
        .map(|a| {
            let pmr =
                BlockPmr::open(&engine, &path, log_at(a), (LOG_BLOCKS * 4096) as usize).unwrap();
            rio_ordering::scan(&pmr).unwrap()
        })
        .collect();
    let prefix = rio_prefix(&scans, plp).unwrap();
    assert_eq!(
        prefix,
        vec![41, 41],
        "20 commits of two groups per area, all durable"
    );
    let (set, report) = JournalSet::open_rio(&dev, layout, &prefix).unwrap();
    assert_eq!(report.replayed.iter().map(Vec::len).sum::<usize>(), 40);
    drop(set);
    drop(dev);
    let raw = std::fs::read(&path).unwrap();
    for (b, v) in want {
        let got = u64::from_le_bytes(raw[(b * 4096) as usize..][..8].try_into().unwrap());
        assert_eq!(got, v, "block {b}");
    }
    // The mode of a plain handle is unchanged by all this.
    assert_eq!(CommitMode::Overlapped.name(), "overlapped");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A transaction with far more writes than the attribute log has slots (a commit of many
/// scattered data blocks, as a file system's dirty-data limit produces) goes out over as many
/// ordered groups as it needs, and recovers whole.
#[test]
fn a_transaction_larger_than_the_attribute_log_commits_and_recovers() {
    const DATA: u64 = 4096;
    let home = AREA_BLOCKS;
    let log_at = (home + DATA) * 4096;
    let (dir, path, engine, lbio) = setup("big", home + DATA + LOG_BLOCKS, 32 << 20);
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let plp = open(&lbio, &path).critical_route().0.power_loss_protected;
    let set = JournalSet::format(&open(&lbio, &path), layout.clone()).unwrap();
    let log_bytes = (LOG_BLOCKS * 4096) as usize;
    let slots;
    {
        let (j, n) = rio_handle(&set, 0, &lbio, &path, log_at);
        slots = n as u64;
        // Every other block: nothing merges, one write per block.
        let mut tx = Tx::for_file(1);
        for i in 0..DATA / 2 {
            tx.write_data(home + 2 * i, &block_of(1000 + i)).unwrap();
        }
        tx.write_meta(home + 1, &block_of(7)).unwrap();
        j.commit(&tx).unwrap();
        let st = j.rio_stats().unwrap();
        assert!(
            st.requests > 3 * slots,
            "{} writes for a log of {slots} slots",
            st.requests
        );
        // As a crash leaves it (dropping it would checkpoint the area).
        std::mem::forget(j);
    }
    let dev = open(&lbio, &path);
    let pmr = BlockPmr::open(&engine, &path, log_at, log_bytes).unwrap();
    let prefix = rio_prefix(&[rio_ordering::scan(&pmr).unwrap()], plp).unwrap();
    let (_set, report) = JournalSet::open_rio(&dev, layout, &prefix).unwrap();
    assert_eq!(report.replayed.iter().map(Vec::len).sum::<usize>(), 1);
    drop(dev);
    let raw = std::fs::read(&path).unwrap();
    let at = |b: u64| u64::from_le_bytes(raw[(b * 4096) as usize..][..8].try_into().unwrap());
    assert_eq!(at(home + 1), 7, "the metadata block, replayed");
    for i in 0..DATA / 2 {
        assert_eq!(at(home + 2 * i), 1000 + i, "data block {}", home + 2 * i);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second Rio handle asked for on an area whose handle is still live, with its attribute log
/// in the same place as that handle's (a caller's slip, or two threads racing for the area),
/// is refused before the log is touched: every commit the first handle's log vouches for
/// recovers. `with_rio` takes the log's memory unformatted and formats it only once the area
/// is its own; it used to take a log the caller had already formatted, over the live one, and
/// the refusal came after the damage (found by a review on 2026-11-27).
#[test]
fn a_refused_rio_handle_leaves_the_live_handles_attribute_log_alone() {
    let (dir, path, engine, lbio) = setup("refused", BLOCKS, 4 << 20);
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let plp = open(&lbio, &path).critical_route().0.power_loss_protected;
    let set = JournalSet::format(&open(&lbio, &path), layout.clone()).unwrap();
    let (j, _) = rio_handle(&set, 0, &lbio, &path, log_at(0));
    for i in 0..8u64 {
        let mut tx = Tx::for_file(1);
        tx.write_meta(HOME + i, &block_of(100 + i)).unwrap();
        j.commit(&tx).unwrap();
    }
    let len = (LOG_BLOCKS * 4096) as usize;
    let pmr = BlockPmr::open(&engine, &path, log_at(0), len).unwrap();
    assert_second_rio_handle_refused(&set, &lbio, &path, Box::new(pmr));
    // As a crash leaves it (dropping it would checkpoint the area).
    std::mem::forget(j);
    let dev = open(&lbio, &path);
    let log = BlockPmr::open(&engine, &path, log_at(0), len).unwrap();
    let prefix = rio_prefix(&[rio_ordering::scan(&log).unwrap()], plp).unwrap();
    let (_set, report) = JournalSet::open_rio(&dev, layout, &prefix).unwrap();
    assert_eq!(report.replayed.iter().map(Vec::len).sum::<usize>(), 8);
    drop(dev);
    let raw = std::fs::read(&path).unwrap();
    for i in 0..8u64 {
        let b = (HOME + i) as usize * 4096;
        let got = u64::from_le_bytes(raw[b..b + 8].try_into().unwrap());
        assert_eq!(got, 100 + i, "block {}", HOME + i);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
