//! Rio-ordered commits on a real file (O_DIRECT through lbio), with the attribute log as a
//! block log in the same file: commit, stop without a checkpoint (what a process crash leaves),
//! read the attribute log back, recover with it, and find every committed block home. Opening
//! the same journal without the attribute log is refused rather than trusted.

use std::rc::Rc;

use aios_core::{Engine, EngineConfig};
use journal::rio_ordering::{self, AttrLog, BlockPmr, OrderedConfig, Pmr};
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

#[test]
fn rio_ordered_commits_on_a_file_recover_with_their_block_log() {
    let dir = std::env::temp_dir().join(format!("aios-rio-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("journal.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(BLOCKS * 4096)
        .unwrap();
    let layout = Layout::per_core(0, AREA_BLOCKS, AREAS as usize);
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let plp = open(&lbio, &path).critical_route().0.power_loss_protected;
    let set = JournalSet::format(&open(&lbio, &path), layout.clone()).unwrap();
    let mut want = std::collections::HashMap::new();
    {
        // One Rio handle per area, each with its own lbio array for the ordered device.
        let mut handles = Vec::new();
        for a in 0..AREAS {
            let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
            let pmr: Box<dyn Pmr> = Box::new(
                BlockPmr::open(&engine, &path, log_at(a), (LOG_BLOCKS * 4096) as usize).unwrap(),
            );
            let log = AttrLog::format(pmr, AREAS as u16).unwrap();
            let j = Journal::with_rio(
                &set,
                a as usize,
                open(&lbio, &path),
                open(&own, &path),
                log,
                OrderedConfig {
                    batch: 2,
                    ..OrderedConfig::default()
                },
            )
            .unwrap();
            assert!(j.rio_ordered());
            handles.push((j, own));
        }
        // A second Rio handle on an area is refused.
        let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let pmr: Box<dyn Pmr> = Box::new(rio_ordering::MemPmr::new(4096));
        let e = Journal::with_rio(
            &set,
            0,
            open(&lbio, &path),
            open(&own, &path),
            AttrLog::format(pmr, AREAS as u16).unwrap(),
            OrderedConfig::default(),
        )
        .err()
        .expect("a second Rio handle on area 0");
        assert!(
            e.to_string().contains("already has a Rio-ordered handle"),
            "{e}"
        );

        let mut v = 0;
        for i in 0..40u64 {
            let (j, _) = &handles[(i % AREAS) as usize];
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
        let st = handles[0].0.rio_stats().unwrap();
        assert_eq!(
            st.requests,
            20 * 3,
            "data, journal run and commit block per commit"
        );
        if !plp {
            assert_eq!(st.flushes, 20, "one FLUSH per commit");
        }
        // Dropped here without a checkpoint: the metadata lives only in the journal.
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
    let dir = std::env::temp_dir().join(format!("aios-rio-big-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("journal.img");
    const DATA: u64 = 4096;
    let home = AREA_BLOCKS;
    let log_at = (home + DATA) * 4096;
    std::fs::File::create(&path)
        .unwrap()
        .set_len((home + DATA + LOG_BLOCKS) * 4096)
        .unwrap();
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 32 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let plp = open(&lbio, &path).critical_route().0.power_loss_protected;
    let set = JournalSet::format(&open(&lbio, &path), layout.clone()).unwrap();
    let log_bytes = (LOG_BLOCKS * 4096) as usize;
    let slots;
    {
        let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let pmr: Box<dyn Pmr> =
            Box::new(BlockPmr::open(&engine, &path, log_at, log_bytes).unwrap());
        let log = AttrLog::format(pmr, 1).unwrap();
        slots = log.slots() as u64;
        let j = Journal::with_rio(
            &set,
            0,
            open(&lbio, &path),
            open(&own, &path),
            log,
            OrderedConfig {
                batch: 2,
                ..OrderedConfig::default()
            },
        )
        .unwrap();
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
