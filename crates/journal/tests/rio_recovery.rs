//! Recovery of Rio-ordered commits without their attribute logs: whatever part of a
//! Rio-ordered transaction a crash left on the device, `recover_image` / `JournalSet::open`
//! refuse it (`RioLogsNeeded`) rather than judge it, as they refuse an intact one; only the
//! attribute log can say whether a Rio-ordered commit block is evidence of damage.

mod common;
use common::{block_of, lbio, value_at, SimPmr};

use std::rc::Rc;

use journal::rio_ordering::{self, MemPmr, OrderedConfig};
use journal::{
    recover_image, recover_image_rio, rio_prefix, Journal, JournalError, JournalSet, Layout,
    LogEnd, Tx,
};
use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk};

const AREA_BLOCKS: u64 = 16;
const BLOCKS: u64 = AREA_BLOCKS + 32;

/// One Rio-ordered commit (a metadata block) in a fresh one-area journal, left as a process
/// crash leaves it (no checkpoint): the device's bytes and the layout.
fn one_rio_commit() -> (Vec<u8>, Layout) {
    let lbio = lbio();
    let disk = SimDisk::new(SimConfig::new(BLOCKS * 4096, 11)).unwrap();
    let layout = Layout::per_core(0, AREA_BLOCKS, 1);
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let own = LbioArray::new(Rc::clone(lbio.engine()), LbioConfig::default()).unwrap();
    let j = Journal::with_rio(
        &set,
        0,
        disk.open(&lbio).unwrap(),
        disk.open(&own).unwrap(),
        Box::new(MemPmr::new(16 << 10)),
        OrderedConfig::default(),
    )
    .unwrap();
    let mut tx = Tx::new();
    tx.write_meta(AREA_BLOCKS + 3, &block_of(7)).unwrap();
    assert_eq!(j.commit(&tx).unwrap().tid, 1);
    // A crash does not drop the handle (dropping it checkpoints the area).
    std::mem::forget(j);
    (disk.media(), layout)
}

/// Log position `pos` of area 0 zeroed (that block of the transaction never landed).
fn lose(img: &[u8], pos: u64) -> Vec<u8> {
    let mut img = img.to_vec();
    let at = ((1 + pos) * 4096) as usize;
    img[at..at + 4096].fill(0);
    img
}

/// The Rio-ordered transaction's descriptor or its metadata block lost, its commit block
/// landed (the ordered device sends them together, with nothing ordering them on the device):
/// with the attribute log showing the commit not durable it is a torn tail, and without the
/// attribute log recovery must refuse, as it refuses the whole transaction. It used to take
/// the Rio commit block for evidence of damage and report the area corrupt.
#[test]
fn a_torn_rio_commit_without_attribute_logs_is_refused_not_called_damage() {
    let (img, layout) = one_rio_commit();
    // Whole: refused without the attribute log.
    let e = recover_image(&mut img.clone(), &layout).unwrap_err();
    assert!(
        matches!(e, JournalError::RioLogsNeeded { area: 0, tid: 1 }),
        "{e}"
    );
    // Log positions 0, 1, 2: descriptor, metadata block, commit block.
    for (lost, what) in [(0, "descriptor"), (1, "metadata block")] {
        let torn = lose(&img, lost);
        // Nothing on the attribute log durable (a fresh one's prefix ends at 1): a torn tail.
        let report = recover_image_rio(&mut torn.clone(), &layout, &[1]).unwrap();
        assert!(
            !matches!(report.areas[0].1, LogEnd::Corrupt { .. }),
            "{what} lost, attribute log says not durable: {report:?}"
        );
        let r = recover_image(&mut torn.clone(), &layout);
        assert!(
            matches!(r, Err(JournalError::RioLogsNeeded { area: 0, tid: 1 })),
            "{what} lost, no attribute log: {r:?}"
        );
        let disk = SimDisk::from_image(SimConfig::new(BLOCKS * 4096, 12), torn).unwrap();
        let lbio = lbio();
        let r = JournalSet::open(&disk.open(&lbio).unwrap(), layout.clone()).map(|(_, r)| r);
        assert!(
            matches!(r, Err(JournalError::RioLogsNeeded { area: 0, tid: 1 })),
            "{what} lost, JournalSet::open: {r:?}"
        );
    }
}

/// A Rio-ordered transaction whose journal blocks are one long run on a device that takes
/// small requests: the run goes out in writes the ordered device takes (it refuses one that
/// splits into more than 255 pieces, or whose entries do not fit a group of the attribute
/// log), and the commit succeeds and recovers.
#[test]
fn a_long_journal_run_commits_rio_ordered_on_a_device_of_small_requests() {
    const AREA: u64 = 600;
    const METAS: u64 = 300;
    let lbio = lbio();
    let mut cfg = SimConfig::new((AREA + METAS + 8) * 4096, 21);
    cfg.max_transfer_bytes = 4096;
    let disk = SimDisk::new(cfg).unwrap();
    let layout = Layout::per_core(0, AREA, 1);
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let own = LbioArray::new(Rc::clone(lbio.engine()), LbioConfig::default()).unwrap();
    let bytes = Rc::new(std::cell::RefCell::new(vec![0u8; 64 << 10]));
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
        OrderedConfig::default(),
    )
    .unwrap();
    let mut tx = Tx::new();
    for b in 0..METAS {
        tx.write_meta(AREA + b, &block_of(b + 1)).unwrap();
    }
    let r = j.commit(&tx);
    assert!(r.is_ok(), "{r:?}");
    // Recovered from the device and the attribute log as a crash leaves them.
    std::mem::forget(j);
    let mut log = MemPmr::new(bytes.borrow().len());
    log.bytes_mut().copy_from_slice(&bytes.borrow());
    let prefix = rio_prefix(&[rio_ordering::scan(&log).unwrap()], false).unwrap();
    let mut img = disk.media();
    let report = recover_image_rio(&mut img, &layout, &prefix).unwrap();
    assert_eq!(report.replayed, vec![vec![1]], "{report:?}");
    for b in 0..METAS {
        assert_eq!(value_at(&img, AREA + b), b + 1, "block {}", AREA + b);
    }
}
