//! Journaled blocks whose bytes look like log blocks (a file holding a copy of a journal image,
//! or bytes crafted to look like one). The log holds them as they are given, and recovery reads
//! every log block that starts with the log magic and is sealed as a log block of its own: such
//! a block must be neither replayed as a transaction nor taken as evidence of damage or as the
//! largest id in use.

mod common;
use common::{block_of, lbio};

use journal::format::{self, Header, Kind, BLOCK};
use journal::{recover_image, CommitMode, Journal, JournalSet, Layout, LogEnd, Tx};
use lbio::{SimConfig, SimDisk};

/// A sealed log block of area 0: `kind`, id `tid`, with `fill` run over it before sealing.
fn log_block(kind: Kind, tid: u64, count: u32, fill: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    Header {
        kind,
        tid,
        area: 0,
        count,
        flags: 0,
        file: 0,
    }
    .write(&mut b);
    fill(&mut b);
    format::seal(&mut b);
    b
}

/// A whole transaction as three blocks (descriptor, metadata, commit) that writes `bytes` to
/// home block `home` under id `tid`.
fn crafted_tx(tid: u64, home: u64, bytes: &[u8]) -> [Vec<u8>; 3] {
    let d = log_block(Kind::Descriptor, tid, 1, |d| {
        format::put_tag(d, 0, home, format::crc(bytes))
    });
    let chain = format::crc_chain(format::crc_chain(0, &d), bytes);
    let c = log_block(Kind::Commit, tid, 0, |c| {
        format::put_u32(c, format::HEADER, 2);
        format::put_u32(c, format::HEADER + 4, chain);
    });
    [d, bytes.to_vec(), c]
}

/// A one-write commit journals a file's data: here three blocks that together read as a
/// transaction writing home block 150. A checkpoint, then a commit of 59 log blocks, leave the
/// log's head (where recovery's scan of the area stops) on the first of them. Recovery must not
/// replay them: it wrote 0xee… over block 150, which no commit wrote.
#[test]
fn journaled_data_that_reads_as_a_transaction_is_not_replayed() {
    let layout = Layout::per_core(0, 64, 1); // a log of 63 blocks
    let disk = SimDisk::new(SimConfig::new(256 * 4096, 1)).unwrap();
    let lbio = lbio();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::OneWrite).unwrap();

    let evil = block_of(0xeeee_eeee_eeee_eeee);
    let file = crafted_tx(1 << 40, 150, &evil);
    let mut tx = Tx::new();
    for (i, b) in file.iter().enumerate() {
        tx.write_data(100 + i as u64, b).unwrap();
    }
    let info = j.commit(&tx).unwrap();
    assert!(info.data_journaled, "a one-write commit");
    assert_eq!(info.log_blocks, 5, "descriptor, three data blocks, commit");
    // Log positions 1..=3 hold the file's blocks; the log restarts at 5.
    j.checkpoint().unwrap();
    let mut tx = Tx::new();
    for b in 0..57 {
        tx.write_meta(160 + b, &block_of(b + 1)).unwrap();
    }
    assert_eq!(j.commit(&tx).unwrap().log_blocks, 59);
    assert_eq!(set.free_log_blocks(0), 4, "the head is at log position 1");

    let mut img = disk.media();
    let report = recover_image(&mut img, &layout).unwrap();
    let at = 150 * BLOCK;
    assert!(
        img[at..at + BLOCK].iter().all(|&b| b == 0),
        "block 150, written by no commit, was replayed from a file's data: {report:?}"
    );
    assert_eq!(report.replayed, vec![vec![2]], "{report:?}");
    assert_eq!(report.areas[0].1, LogEnd::Clean, "{report:?}");
    // The file's own blocks are as written.
    for (i, b) in file.iter().enumerate() {
        let at = (100 + i) * BLOCK;
        assert_eq!(&img[at..at + BLOCK], &b[..], "data block {}", 100 + i);
    }
}

/// Metadata whose bytes are a sealed commit block of the area with the largest id a journal
/// uses, committed and not checkpointed. Recovery called the clean log damaged ("a later
/// transaction commits") and took that id as the largest in use: the reopened journal's next
/// id was 2^63, and its superblocks, written with that tail id, made the next open fail.
#[test]
fn journaled_metadata_that_reads_as_a_commit_block_is_neither_damage_nor_an_id() {
    let layout = Layout::per_core(0, 64, 1);
    let disk = SimDisk::new(SimConfig::new(256 * 4096, 1)).unwrap();
    let lbio = lbio();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
    let lookalike = log_block(Kind::Commit, format::MAX_TID, 0, |_| {});
    let mut tx = Tx::new();
    tx.write_meta(150, &lookalike).unwrap();
    j.commit(&tx).unwrap();
    drop(j);
    drop(set);

    // A crash: recovery from what is durable. The block comes back exactly as journaled.
    let mut img = disk.media();
    let report = recover_image(&mut img, &layout).unwrap();
    assert_eq!(report.areas[0].1, LogEnd::Clean, "{report:?}");
    assert_eq!(report.replayed, vec![vec![1]], "{report:?}");
    assert_eq!(&img[150 * BLOCK..151 * BLOCK], &lookalike[..]);

    // Reopened (recovery on the device) twice: ids go on from 2.
    let (set, report) = JournalSet::open(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    assert!(report.corrupt.is_empty(), "{report:?}");
    assert_eq!(set.next_tid(), 2);
    drop(set);
    let (set, _) = JournalSet::open(&disk.open(&lbio).unwrap(), layout).unwrap();
    assert_eq!(set.next_tid(), 2);
    assert_eq!(&disk.media()[150 * BLOCK..151 * BLOCK], &lookalike[..]);
}
