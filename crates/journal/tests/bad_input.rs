//! Bad input gets typed errors, and recovery never panics on any bytes (bounded fuzzing of the
//! recovery parser: random and mutated images; `AIOS_FUZZ_SECONDS` sets the budget, default 5).

use std::rc::Rc;

use journal::{
    format, recover_image, recovery, CommitMode, Journal, JournalError, JournalSet, Layout, Tx,
};
use lbio::{SimConfig, SimDisk, SimRng};

mod common;
use common::lbio;

#[test]
fn layouts_and_transactions_that_cannot_work_are_refused() {
    let lbio = lbio();
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 1)).unwrap();
    let dev = disk.open(&lbio).unwrap();
    let e = JournalSet::format(&dev, Layout::per_core(0, 3, 1)).unwrap_err();
    assert!(
        matches!(e, JournalError::RegionTooSmall { blocks: 3, .. }),
        "{e}"
    );
    let e = JournalSet::format(&dev, Layout::per_core(0, 100, 1)).unwrap_err();
    assert!(e.to_string().contains("past the device"), "{e}");
    let e = JournalSet::format(
        &dev,
        Layout {
            areas: vec![(0, 8), (4096, 8)],
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");

    let layout = Layout::per_core(0, 8, 1);
    let set = JournalSet::format(&dev, layout).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
    assert!(matches!(j.commit(&Tx::new()), Err(JournalError::EmptyTx)));
    let mut big = Tx::new();
    for b in 0..8 {
        big.write_meta(20 + b, &[1; 4096]).unwrap();
    }
    let e = j.commit(&big).unwrap_err();
    assert!(
        matches!(
            e,
            JournalError::TxTooLarge {
                needed: 10,
                log_blocks: 7
            }
        ),
        "{e}"
    );
    let mut tx = Tx::new();
    assert!(matches!(
        tx.write_meta(20, &[0; 100]),
        Err(JournalError::BlockLen { len: 100, .. })
    ));
    tx.write_meta(3, &[0; 4096]).unwrap();
    let e = j.commit(&tx).unwrap_err();
    assert!(e.to_string().contains("journal area 0"), "{e}");
    let mut tx = Tx::new();
    tx.write_data(64, &[0; 4096]).unwrap();
    assert!(matches!(
        j.commit(&tx),
        Err(JournalError::NotHomeBlock { block: 64, .. })
    ));
    // Data over journaled, not yet checkpointed metadata needs a revoke first.
    let mut tx = Tx::new();
    tx.write_meta(30, &[5; 4096]).unwrap();
    j.commit(&tx).unwrap();
    let mut tx = Tx::new();
    tx.write_data(30, &[6; 4096]).unwrap();
    assert!(matches!(
        j.commit(&tx),
        Err(JournalError::DataOverJournaledBlock { block: 30 })
    ));
    tx.revoke(30);
    j.commit(&tx).unwrap();
}

#[test]
fn a_corrupted_superblock_or_descriptor_is_reported() {
    let lbio = lbio();
    let layout = Layout::per_core(0, 16, 1);
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 2)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::Vanilla).unwrap();
    for i in 0..3u64 {
        let mut tx = Tx::new();
        tx.write_meta(40 + i, &[i as u8 + 1; 4096]).unwrap();
        j.commit(&tx).unwrap();
    }
    let image = disk.media();

    let mut bad_sb = image.clone();
    bad_sb[40] ^= 0xff;
    let e = recover_image(&mut bad_sb, &layout).unwrap_err();
    assert!(
        matches!(&e, JournalError::BadSuperblock { area: 0, why } if why.contains("checksum")),
        "{e}"
    );
    let e = JournalSet::open(
        &SimDisk::from_image(SimConfig::new(64 * 4096, 3), {
            let mut b = image.clone();
            b[..8].fill(0);
            b
        })
        .unwrap()
        .open(&lbio)
        .unwrap(),
        layout.clone(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("magic"), "{e}");

    // The second transaction's descriptor (log block 3, area block 4) damaged: reported, and
    // only the first transaction is replayed.
    let mut bad_desc = image.clone();
    bad_desc[4 * 4096 + 8] ^= 1;
    let report = recover_image(&mut bad_desc, &layout).unwrap();
    assert_eq!(report.corrupt, vec![0]);
    assert_eq!(report.replayed[0].len(), 1);

    // Undamaged, through the device: all three come back and the log starts afresh.
    let disk2 = SimDisk::from_image(SimConfig::new(64 * 4096, 4), image).unwrap();
    let (set2, report) = JournalSet::open(&disk2.open(&lbio).unwrap(), layout.clone()).unwrap();
    assert_eq!(report.replayed, vec![vec![1, 2, 3]]);
    assert!(report.corrupt.is_empty());
    assert_eq!(set2.next_tid(), 4);
    let view = disk2.view();
    for i in 0..3usize {
        assert!(view[(40 + i) * 4096..(41 + i) * 4096]
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
}

#[test]
fn a_one_write_commit_whose_descriptor_was_lost_is_a_torn_tail() {
    let lbio = lbio();
    let layout = Layout::per_core(0, 32, 1);
    let disk = SimDisk::new(SimConfig::new(128 * 4096, 5)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::OneWrite).unwrap();
    for i in 0..2u64 {
        let mut tx = Tx::new();
        tx.write_data(60 + i, &[i as u8 + 1; 4096]).unwrap();
        tx.write_meta(50, &[i as u8 + 7; 4096]).unwrap();
        j.commit(&tx).unwrap();
    }
    let image = disk.media();
    let area = &image[..32 * 4096];
    let whole = recovery::parse_area(area, 0).unwrap();
    assert_eq!(whole.txs.len(), 2);
    assert_eq!(whole.end, recovery::LogEnd::Clean);
    // The second transaction's first block (its descriptor) never landed; its commit block,
    // written in the same request, did.
    let second = &whole.txs[1];
    let mut lost = area.to_vec();
    let at = (1 + second.pos as usize) * 4096;
    lost[at..at + 4096].fill(0);
    let log = recovery::parse_area(&lost, 0).unwrap();
    assert_eq!(log.txs.len(), 1);
    assert_eq!(
        log.end,
        recovery::LogEnd::TornTail {
            tid: second.tid,
            pos: second.pos
        }
    );
}

/// Recovery on arbitrary bytes returns (an error or a report) and never panics.
#[test]
fn recovery_never_panics_on_any_bytes() {
    let budget: f64 = std::env::var("AIOS_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let lbio = lbio();
    let layout = Layout::per_core(0, 16, 2);
    // A valid image to mutate: two areas with committed transactions and revokes.
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 5)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
    for a in 0..2usize {
        let j = Journal::new(&set, a, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
        for i in 0..4u64 {
            let mut tx = Tx::for_file(a as u32);
            tx.write_meta(40 + i, &[i as u8; 4096]).unwrap();
            if i == 2 {
                tx.revoke(41);
            }
            j.commit(&tx).unwrap();
        }
    }
    let base = disk.media();
    let mut rng = SimRng::new(0xf022);
    let t0 = std::time::Instant::now();
    let mut runs = 0u64;
    while t0.elapsed().as_secs_f64() < budget {
        let mut img = base.clone();
        match rng.below(4) {
            // Random bytes in a few places.
            0 => {
                for _ in 0..1 + rng.below(16) {
                    let at = rng.below(img.len() as u64) as usize;
                    img[at] = rng.next_u64() as u8;
                }
            }
            // A whole block of garbage.
            1 => {
                let b = rng.below(32) as usize;
                for x in &mut img[b * 4096..(b + 1) * 4096] {
                    *x = rng.next_u64() as u8;
                }
            }
            // A valid-looking header with random fields, resealed.
            2 => {
                let b = 1 + rng.below(31) as usize;
                let blk = &mut img[b * 4096..(b + 1) * 4096];
                format::put_u32(blk, 0, format::LOG_MAGIC);
                format::put_u32(blk, 4, 1 + rng.below(3) as u32);
                format::put_u64(blk, 8, rng.below(12));
                format::put_u32(blk, 16, rng.below(3) as u32);
                format::put_u32(blk, 20, rng.next_u64() as u32 % 600);
                for i in 0..8 {
                    format::put_u64(blk, 32 + 8 * i, rng.next_u64() % 200);
                }
                format::seal(blk);
            }
            // A resealed superblock with random positions and ids.
            _ => {
                let a = rng.below(2) as usize * 16 * 4096;
                let sb = &mut img[a..a + 4096];
                format::put_u64(sb, 16, rng.below(40));
                format::put_u64(sb, 32, rng.next_u64() % 64);
                format::put_u64(sb, 40, rng.below(12));
                let c = format::crc(&sb[..format::SB_CRC_AT]);
                format::put_u32(sb, format::SB_CRC_AT, c);
            }
        }
        let _ = recover_image(&mut img, &layout);
        for a in 0..2 {
            let _ = recovery::parse_area(&img[a * 16 * 4096..(a + 1) * 16 * 4096], a);
        }
        runs += 1;
    }
    println!("recovery fuzzing: {runs} images in {budget} s, no panic");
    assert!(runs > 100);
}

/// Formatting again over a journal that was used (a reformatted device) leaves no trace of the
/// old log: the old transactions are neither replayed nor read as damage, whether the old log
/// had wrapped or not.
#[test]
fn a_journal_formatted_over_a_used_one_starts_empty() {
    let lbio = lbio();
    for txs in [3u64, 40] {
        let disk = SimDisk::new(SimConfig::new(64 * 4096, 1)).unwrap();
        let layout = Layout::per_core(0, 16, 1);
        let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
        let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
        for i in 0..txs {
            let mut tx = Tx::new();
            tx.write_meta(40 + i % 8, &[i as u8 + 1; 4096]).unwrap();
            j.commit(&tx).unwrap();
        }
        drop(j);
        drop(set);
        let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout.clone()).unwrap();
        drop(set);
        let (_set, report) = JournalSet::open(&disk.open(&lbio).unwrap(), layout).unwrap();
        assert!(
            report.corrupt.is_empty(),
            "{txs} old transactions: {report:?}"
        );
        assert!(
            report.replayed.iter().all(|r| r.is_empty()),
            "{txs} old transactions replayed: {report:?}"
        );
    }
}

/// A sealed transaction (descriptor, one metadata block, commit block with the right chained
/// checksum) at the start of a one-area journal, naming `home_tag` with id `tid`: what
/// recovery sees when the bytes are well-formed but the values are not.
fn sealed_tx_image(home_tag: u64, tid: u64) -> (Vec<u8>, Layout) {
    use format::{Header, Kind, Superblock, BLOCK};
    let area_blocks = 16u64;
    let layout = Layout::per_core(0, area_blocks, 1);
    let mut img = vec![0u8; ((area_blocks + 32) * 4096) as usize];
    Superblock {
        area_blocks,
        area_index: 0,
        area_count: 1,
        tail_pos: 0,
        tail_tid: 1,
        generation: 1,
    }
    .encode(&mut img[..BLOCK]);
    let meta = vec![0xabu8; BLOCK];
    let mut d = vec![0u8; BLOCK];
    Header {
        kind: Kind::Descriptor,
        tid,
        area: 0,
        count: 1,
        flags: 0,
        file: 0,
    }
    .write(&mut d);
    format::put_tag(&mut d, 0, home_tag, format::crc(&meta));
    format::seal(&mut d);
    let chain = format::crc_chain(format::crc_chain(0, &d), &meta);
    let mut c = vec![0u8; BLOCK];
    Header {
        kind: Kind::Commit,
        tid,
        area: 0,
        count: 0,
        flags: 0,
        file: 0,
    }
    .write(&mut c);
    format::put_u32(&mut c, format::HEADER, 2);
    format::put_u32(&mut c, format::HEADER + 4, chain);
    format::seal(&mut c);
    img[BLOCK..2 * BLOCK].copy_from_slice(&d);
    img[2 * BLOCK..3 * BLOCK].copy_from_slice(&meta);
    img[3 * BLOCK..4 * BLOCK].copy_from_slice(&c);
    (img, layout)
}

/// Well-sealed log blocks carrying values no journal writes: a home block whose byte offset
/// does not fit 64 bits (it used to overflow, and in a release build wrap onto a real home
/// block), and the largest transaction id (its successor overflowed). Recovery refuses the
/// first with a typed error and writes nothing; the second is not taken for a transaction.
#[test]
fn recovery_refuses_out_of_range_blocks_and_ids() {
    let (mut img, layout) = sealed_tx_image((1u64 << 52) + 20, 1);
    let before = img.clone();
    match recover_image(&mut img, &layout) {
        Err(JournalError::NotHomeBlock { block, .. }) => assert_eq!(block, (1u64 << 52) + 20),
        other => panic!("a home block past the device: {other:?}"),
    }
    assert!(
        img == before,
        "nothing is written home when the plan is refused"
    );

    // The same transaction naming a real home block is replayed (the image itself is sound).
    let (mut img, layout) = sealed_tx_image(20, 1);
    let report = recover_image(&mut img, &layout).unwrap();
    assert_eq!(report.replayed, vec![vec![1]]);
    assert_eq!(img[20 * 4096], 0xab);

    for tid in [u64::MAX, format::MAX_TID + 1] {
        let (mut img, layout) = sealed_tx_image(20, tid);
        let report = recover_image(&mut img, &layout).unwrap();
        assert!(
            report.replayed.iter().all(|r| r.is_empty()),
            "id {tid}: {report:?}"
        );
        assert_eq!(img[20 * 4096], 0, "id {tid} was replayed");
        let log = recovery::parse_area(&img[..16 * 4096], 0).unwrap();
        assert!(log.max_tid_seen <= format::MAX_TID, "id {tid}: {log:?}");
    }
    // A superblock whose tail id is past the range is a bad superblock.
    let (mut img, layout) = sealed_tx_image(20, 1);
    format::put_u64(&mut img[..4096], 40, u64::MAX);
    let c = format::crc(&img[..format::SB_CRC_AT]);
    format::put_u32(&mut img[..4096], format::SB_CRC_AT, c);
    assert!(matches!(
        recover_image(&mut img, &layout),
        Err(JournalError::BadSuperblock { area: 0, .. })
    ));
}

/// The durability probe that `JournalSet::format` runs writes zeros into area 0's first log
/// block, whatever the engine's buffers held before (it used to write them as they were).
#[test]
fn the_durability_probe_writes_zeros() {
    let lbio = lbio();
    let engine = Rc::clone(lbio.engine());
    // Leave every buffer of the arena full of a sealed-looking pattern.
    let mut held = Vec::new();
    while let Some(mut b) = engine.try_alloc(4096) {
        b.fill(0x5a);
        held.push(b);
    }
    assert!(!held.is_empty());
    drop(held);
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 3)).unwrap();
    let layout = Layout::per_core(0, 16, 1);
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout).unwrap();
    // The probe timed its writes (a device without FUA, or with power-loss protection, skips it).
    assert!(
        set.durability_probe().fua_write_us > 0.0,
        "{:?}",
        set.durability_probe()
    );
    let media = disk.media();
    assert!(
        media[4096..2 * 4096].iter().all(|&b| b == 0),
        "area 0's first log block holds old buffer bytes"
    );
}

/// A sealed superblock whose generation is the largest a `u64` holds: no journal writes one
/// (generations start at 1 and grow by one per checkpoint or recovery), so it is damaged or
/// crafted bytes. Opening the journal must refuse it with a typed error; it used to compute
/// the next generation as `generation + 1` and panic on the overflow (a debug build), or wrap
/// to 0 (a release build).
#[test]
fn a_superblock_generation_past_the_range_is_a_bad_superblock() {
    let (mut img, layout) = sealed_tx_image(20, 1);
    format::put_u64(&mut img[..4096], 48, u64::MAX);
    let c = format::crc(&img[..format::SB_CRC_AT]);
    format::put_u32(&mut img[..4096], format::SB_CRC_AT, c);
    let bytes = img.len() as u64;
    let disk = SimDisk::from_image(SimConfig::new(bytes, 6), img).unwrap();
    let lbio = lbio();
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        JournalSet::open(&disk.open(&lbio).unwrap(), layout.clone()).map(|_| ())
    }));
    match opened {
        Ok(Err(JournalError::BadSuperblock { area: 0, why })) => {
            assert!(why.contains("generation"), "{why}")
        }
        Ok(other) => panic!("a generation of u64::MAX: {other:?}"),
        Err(_) => panic!("opening a journal whose superblock generation is u64::MAX panicked"),
    }
}

/// Layouts whose areas' byte ranges do not fit 64 bits (a layout read from a damaged file
/// system superblock, say) are refused with a typed error. Checking them computed the end of
/// each area as `offset + blocks * 4096`, which overflowed: a panic in a debug build, and in a
/// release build a wrapped end that could pass the check. `Layout::per_core` computed the
/// offsets of such areas unchecked as well.
#[test]
fn layouts_past_the_byte_range_are_refused() {
    let lbio = lbio();
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 1)).unwrap();
    let dev = disk.open(&lbio).unwrap();
    let layouts = [
        vec![(0, u64::MAX / 4096 + 2)],
        vec![(u64::MAX - 4095, 8)],
        // The second area is the one that does not fit (it is compared with the first for
        // overlap before its own range is checked).
        vec![(0, 8), (8 * 4096, u64::MAX / 2048)],
    ];
    // `Layout::per_core` with areas past the byte range (it computed each offset unchecked: a
    // panic in a debug build) gives such layouts too.
    let per_core = std::panic::catch_unwind(|| {
        [
            Layout::per_core(0, u64::MAX / 4096, 3),
            Layout::per_core(u64::MAX - 4095, 8, 2),
        ]
    })
    .expect("Layout::per_core panicked");
    for layout in per_core {
        let r = JournalSet::format(&dev, layout.clone()).map(|_| ());
        assert!(
            matches!(r, Err(JournalError::Layout(_))),
            "{layout:?}: {r:?}"
        );
    }
    for areas in layouts {
        let layout = Layout {
            areas: areas.clone(),
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            JournalSet::format(&dev, layout.clone()).map(|_| ())
        }));
        match r {
            Ok(Err(JournalError::Layout(why))) => {
                assert!(why.contains("past the device"), "{areas:?}: {why}")
            }
            Ok(other) => panic!("{areas:?}: {other:?}"),
            Err(_) => panic!("{areas:?}: checking the layout panicked"),
        }
        let mut img = vec![0u8; 64 * 4096];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            recover_image(&mut img, &layout).map(|_| ())
        }));
        assert!(
            matches!(r, Ok(Err(JournalError::Layout(_)))),
            "{areas:?}: recover_image did not refuse the layout"
        );
    }
}

/// A transaction that wraps past the end of the log, damaged after the wrap: the position
/// recovery reports is a log position (under the log's length), the block that is damaged.
#[test]
fn damage_past_the_logs_wrap_is_reported_at_its_log_position() {
    use format::{Header, Kind, Superblock, BLOCK};
    let area_blocks = 16u64;
    let log_len = area_blocks - 1;
    let mut area = vec![0u8; (area_blocks as usize) * BLOCK];
    let tail = log_len - 1;
    Superblock {
        area_blocks,
        area_index: 0,
        area_count: 1,
        tail_pos: tail,
        tail_tid: 1,
        generation: 1,
    }
    .encode(&mut area[..BLOCK]);
    let meta = vec![0x5au8; BLOCK];
    let header = |kind, count| Header {
        kind,
        tid: 1,
        area: 0,
        count,
        flags: 0,
        file: 0,
    };
    let mut d = vec![0u8; BLOCK];
    header(Kind::Descriptor, 1).write(&mut d);
    format::put_tag(&mut d, 0, 40, format::crc(&meta));
    format::seal(&mut d);
    let chain = format::crc_chain(format::crc_chain(0, &d), &meta);
    let mut c = vec![0u8; BLOCK];
    header(Kind::Commit, 0).write(&mut c);
    format::put_u32(&mut c, format::HEADER, 2);
    format::put_u32(&mut c, format::HEADER + 4, chain);
    format::seal(&mut c);
    // Log position p is area block 1 + p: the descriptor in the log's last block, the metadata
    // block and the commit block after the wrap, at log positions 0 and 1.
    let put = |area: &mut [u8], pos: u64, b: &[u8]| {
        let at = (1 + pos as usize) * BLOCK;
        area[at..at + BLOCK].copy_from_slice(b);
    };
    put(&mut area, tail, &d);
    put(&mut area, 0, &meta);
    put(&mut area, 1, &c);
    let whole = recovery::parse_area(&area, 0).unwrap();
    assert_eq!(whole.txs.len(), 1);
    assert_eq!(whole.end_pos, 2);

    // The metadata block (log position 0) damaged; the commit block is intact.
    let mut bad = area.clone();
    bad[BLOCK + 100] ^= 1;
    let log = recovery::parse_area(&bad, 0).unwrap();
    assert!(log.txs.is_empty());
    match &log.end {
        recovery::LogEnd::Corrupt { pos, why } => {
            assert_eq!(*pos, 0, "{why}");
        }
        e => panic!("expected corruption, got {e:?}"),
    }

    // The commit block lost, and a later transaction's commit block in the log: corruption,
    // and the message names the log block where the commit block should be, position 1.
    let mut lost = area.clone();
    put(&mut lost, 1, &[0u8; BLOCK]);
    let mut later = vec![0u8; BLOCK];
    Header {
        tid: 2,
        ..header(Kind::Commit, 0)
    }
    .write(&mut later);
    format::seal(&mut later);
    put(&mut lost, 5, &later);
    let log = recovery::parse_area(&lost, 0).unwrap();
    match &log.end {
        recovery::LogEnd::Corrupt { pos, why } => {
            assert_eq!(*pos, 1, "{why}");
            assert!(why.contains("log block 1 is not"), "{why}");
        }
        e => panic!("expected corruption, got {e:?}"),
    }
}

/// A journal of two areas opened with a layout of one (the same first area): each superblock
/// says how many areas the journal has, and nothing checked it. `open` replayed area 0 alone,
/// dropped area 1's acknowledged commit without a word, and from then on treated area 1's
/// blocks as home blocks. It is refused now, on the device and on an image.
#[test]
fn a_layout_with_another_number_of_areas_is_refused() {
    let lbio = lbio();
    let two = Layout::per_core(0, 16, 2);
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 6)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), two.clone()).unwrap();
    let j = Journal::new(&set, 1, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
    let mut tx = Tx::new();
    tx.write_meta(40, &[7; 4096]).unwrap();
    j.commit(&tx).unwrap();
    drop(j);
    drop(set);
    let image = disk.media();

    for areas in [1, 3] {
        let other = Layout::per_core(0, 16, areas);
        let e = recover_image(&mut image.clone(), &other).unwrap_err();
        assert!(
            matches!(&e, JournalError::BadSuperblock { area: 0, why } if why.contains("2 areas")),
            "{areas} areas: {e}"
        );
        let r = JournalSet::open(&disk.open(&lbio).unwrap(), other);
        assert!(
            matches!(&r, Err(JournalError::BadSuperblock { area: 0, .. })),
            "{areas} areas: {:?}",
            r.map(|(_, report)| report)
        );
    }
    // The right layout still recovers the commit.
    let (_set, report) = JournalSet::open(&disk.open(&lbio).unwrap(), two).unwrap();
    assert_eq!(report.replayed, vec![vec![], vec![1]]);
    assert!(disk.view()[40 * 4096..41 * 4096].iter().all(|&b| b == 7));
}

/// Once a failed commit has aborted the set, every commit is refused with `Aborted` (reopen the
/// journal). A commit writing data over journaled metadata got `DataOverJournaledBlock`
/// instead: the caller, told to add a revoke, would do so and only then learn that the set
/// takes nothing.
#[test]
fn a_commit_on_an_aborted_set_is_told_so_first() {
    let lbio = lbio();
    let disk = SimDisk::new(SimConfig::new(64 * 4096, 7)).unwrap();
    let set = JournalSet::format(&disk.open(&lbio).unwrap(), Layout::per_core(0, 16, 1)).unwrap();
    let j = Journal::new(&set, 0, disk.open(&lbio).unwrap(), CommitMode::Overlapped).unwrap();
    let mut tx = Tx::new();
    tx.write_meta(30, &[5; 4096]).unwrap();
    j.commit(&tx).unwrap();
    disk.cut_power();
    let mut tx = Tx::new();
    tx.write_meta(31, &[6; 4096]).unwrap();
    let e = j.commit(&tx).unwrap_err();
    assert!(matches!(e, JournalError::Io(_)), "{e}");
    let e = j.commit(&tx).unwrap_err();
    assert!(matches!(e, JournalError::Aborted), "{e}");
    let mut tx = Tx::new();
    tx.write_data(30, &[7; 4096]).unwrap();
    let e = j.commit(&tx).unwrap_err();
    assert!(matches!(e, JournalError::Aborted), "{e}");
}
