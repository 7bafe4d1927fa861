//! Freeing a file too large for one journal transaction (a review on 2026-11-28 noted it open):
//! an unlink, truncate or punched hole of a file whose blocks span more block-bitmap blocks
//! than a journal area holds. Each used to free everything at once; the commit carrying it was
//! refused (`TxTooLarge`), and the file system went read-only (EIO) with the change lost.
//!
//! The images are sparse files of 4.5 GiB with a journal area of 32 blocks (the smallest mkfs
//! makes: a log of 31), so a file of 34 bitmap blocks' worth (4.25 GiB, one extent) is enough.
//! The file is made by writing one block through the file system and then, on the unmounted
//! image, growing its extent and marking the blocks in use: fsck checks the result clean
//! before each test goes on, and nothing writes 4 GiB.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use common::{opts, opts_one_write};
use fs_fuse::format::BLOCK;
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr, FREE_TEST_STOP_AFTER};
use fs_fuse::{fsck, mkfs, MkfsOptions};

mod common;

const ROOT: Caller = Caller { uid: 0, gid: 0 };
const B: u64 = BLOCK as u64;
/// The file's blocks: 34 block-bitmap blocks' worth.
const BIG: u64 = 34 * 8 * B;

/// The tests share `FREE_TEST_STOP_AFTER`: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// A sparse image file, removed when dropped.
struct Image(PathBuf);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Image {
    fn open(&self) -> Arc<Fs> {
        Fs::open(fs_fuse::mount::image_factory(&self.0), opts())
            .unwrap()
            .0
    }

    /// fsck's problems and notes.
    fn fsck(&self) -> (Vec<String>, Vec<String>) {
        let r = fsck(&self.0).unwrap();
        (r.problems, r.notes)
    }
}

/// An image holding file "f" of [`BIG`] blocks in one extent, unmounted; its inode number.
fn image_with_big_file(tag: &str) -> (Image, u64) {
    image_with_big_file_in(tag, 1)
}

/// [`image_with_big_file`] on an image of `journals` journal areas (of 32 blocks each).
fn image_with_big_file_in(tag: &str, journals: u32) -> (Image, u64) {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let path = std::env::temp_dir().join(format!(
        "aiosfs-large-{tag}-{}-{}.img",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let img = Image(path);
    std::fs::File::create(&img.0)
        .unwrap()
        .set_len(9 << 29)
        .unwrap();
    mkfs(
        &img.0,
        &MkfsOptions {
            journals,
            journal_blocks: 32,
            bytes_per_inode: 1 << 20,
            force: false,
        },
    )
    .unwrap();
    let fs = img.open();
    let f = fs
        .mknod(ROOT_INO, b"f", S_IFREG | 0o644, 0, ROOT, None)
        .unwrap()
        .ino;
    fs.write(f, 0, &vec![0x11u8; BLOCK]).unwrap();
    fs.unmount().unwrap();
    drop(fs);

    // Grow its one extent to BIG blocks, and mark them in use.
    common::grow_first_extent(&img.0, f, BIG);
    assert_eq!(
        img.fsck().0,
        Vec::<String>::new(),
        "the image made is damaged"
    );
    (img, f)
}

/// Unmount, then fsck: clean, with no note (no orphan left).
fn unmount_and_check(fs: Arc<Fs>, img: &Image) {
    fs.unmount().unwrap();
    drop(fs);
    assert_eq!(img.fsck(), (Vec::new(), Vec::new()));
}

#[test]
fn unlinking_a_file_too_large_for_one_transaction_frees_it_in_steps() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, _) = image_with_big_file("unlink");
    let fs = img.open();
    let free = fs.statfs().bfree;
    assert_eq!(fs.remove(ROOT_INO, b"f", false), Ok(()));
    fs.sync_all().unwrap();
    assert!(fs.stats.free_steps.load(Ordering::Relaxed) > 0);
    assert_eq!(fs.statfs().bfree, free + BIG);
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(fs.statfs().bfree, free + BIG);
    assert_eq!(fs.lookup(ROOT_INO, b"f", false), Err(libc::ENOENT));
    unmount_and_check(fs, &img);
}

#[test]
fn truncating_a_file_too_large_for_one_transaction_frees_it_in_steps() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file("truncate");
    let fs = img.open();
    let free = fs.statfs().bfree;
    let r = fs.setattr(
        f,
        &SetAttr {
            size: Some(100),
            ..SetAttr::default()
        },
    );
    assert_eq!(r.map(|a| a.size), Ok(100));
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, free + BIG - 1);
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(fs.getattr(f).unwrap().size, 100);
    assert_eq!(fs.read(f, 0, 200).unwrap(), vec![0x11u8; 100]);
    unmount_and_check(fs, &img);
}

#[test]
fn punching_a_hole_too_large_for_one_transaction_frees_it_in_steps() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file("punch");
    let fs = img.open();
    let free = fs.statfs().bfree;
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(fs.fallocate(f, B, (BIG - 1) * B, punch), Ok(()));
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, free + BIG - 1);
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(fs.getattr(f).unwrap().size, BIG * B);
    assert_eq!(fs.read(f, 0, 4096).unwrap(), vec![0x11u8; 4096]);
    assert_eq!(fs.bmap(f, 1).unwrap(), None);
    unmount_and_check(fs, &img);
}

/// The file system stops (here: dropped without an unmount, after the first step's commit)
/// in the middle of freeing an unlinked file: the image is consistent, the file an orphan
/// (fsck's note), and the next mount frees the rest of it, in steps too.
#[test]
fn a_stop_between_the_steps_of_an_unlink_leaves_an_orphan_the_next_mount_frees() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, _) = image_with_big_file("orphan");
    let fs = img.open();
    let free = fs.statfs().bfree;
    FREE_TEST_STOP_AFTER.store(1, Ordering::Relaxed);
    assert_eq!(fs.remove(ROOT_INO, b"f", false), Ok(()));
    assert_eq!(FREE_TEST_STOP_AFTER.load(Ordering::Relaxed), 0, "no step");
    drop(fs);
    let (problems, notes) = img.fsck();
    assert_eq!(problems, Vec::<String>::new());
    assert!(
        notes.iter().any(|n| n.contains("unlinked")),
        "no orphan noted: {notes:?}"
    );
    let (fs, report) = Fs::open(fs_fuse::mount::image_factory(&img.0), opts()).unwrap();
    assert_eq!(report.orphans_freed, 1);
    assert_eq!(fs.statfs().bfree, free + BIG);
    unmount_and_check(fs, &img);
}

/// The same stop in the middle of a truncate: the file is left shorter, with every block it
/// still maps inside its size and no block freed inside it.
#[test]
fn a_stop_between_the_steps_of_a_truncate_leaves_a_shorter_file() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file("stop-truncate");
    let fs = img.open();
    FREE_TEST_STOP_AFTER.store(1, Ordering::Relaxed);
    let r = fs.setattr(
        f,
        &SetAttr {
            size: Some(0),
            ..SetAttr::default()
        },
    );
    assert_eq!(r.map(|_| ()), Err(libc::EIO));
    drop(fs);
    assert_eq!(img.fsck().0, Vec::<String>::new());
    let fs = img.open();
    let size = fs.getattr(f).unwrap().size;
    assert!(size > 0 && size < BIG * B, "size {size}");
    let last = size / B - 1;
    assert!(fs.bmap(f, last).unwrap().is_some());
    assert_eq!(fs.bmap(f, last + 1).unwrap(), None);
    assert_eq!(fs.read(f, 0, 4096).unwrap(), vec![0x11u8; 4096]);
    unmount_and_check(fs, &img);
}

/// A file with `n` extents of one block each (file blocks 0, 2, 4, ..): past 1,421 extents
/// its map takes all eight extent leaves.
fn leafy_file(fs: &Fs, name: &[u8], n: u64) -> u64 {
    let f = fs
        .mknod(ROOT_INO, name, S_IFREG | 0o644, 0, ROOT, None)
        .unwrap()
        .ino;
    for i in 0..n {
        fs.write(f, 2 * i * B, &[0x22u8; 8]).unwrap();
    }
    f
}

/// Files whose maps take extent leaves changed before a large truncate. The pending metadata
/// was counted as two blocks an inode, though each of them commits its eight leaves too: three
/// such inodes (27 blocks to write) counted 6, so nothing committed them, and the truncate's
/// first step added its quarter of a log of bitmap blocks to them. That commit was refused
/// ("transaction needs .. log blocks but the journal area's log has 31"), and the file system
/// went read-only with the truncate and the changes lost. A dirty inode's leaves now count.
#[test]
fn a_step_after_changes_to_files_with_extent_leaves_still_fits_its_transaction() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file("leafy");
    let fs = img.open();
    let leafy: Vec<u64> = (0..3u8)
        .map(|i| leafy_file(&fs, &[b'l', b'0' + i], 1_500))
        .collect();
    fs.sync_all().unwrap();
    let free = fs.statfs().bfree;
    for &l in &leafy {
        let set = SetAttr {
            mode: Some(0o600),
            ..SetAttr::default()
        };
        assert_eq!(fs.setattr(l, &set).map(|_| ()), Ok(()));
    }
    let r = fs.setattr(
        f,
        &SetAttr {
            size: Some(100),
            ..SetAttr::default()
        },
    );
    assert_eq!(r.map(|a| a.size), Ok(100));
    fs.sync_all().unwrap();
    assert!(fs.stats.free_steps.load(Ordering::Relaxed) > 0);
    assert_eq!(fs.statfs().bfree, free + BIG - 1);
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(fs.getattr(f).unwrap().size, 100);
    for &l in &leafy {
        assert_eq!(fs.getattr(l).unwrap().mode & 0o7777, 0o600);
    }
    unmount_and_check(fs, &img);
}

/// Freeing journaled blocks adds a revoke record each to the step's transaction (507 to a log
/// block), and the budget that bounds a step counted only its block-bitmap blocks: a step could
/// take its quarter of a log in bitmap blocks and as many log blocks again in revoke records.
/// Here 6,120 blocks at the top of the file were journaled by one-write commits, two in each
/// of 255 journal areas (so no area fills and no checkpoint sends them home), and the file is
/// unlinked. The first step freed seven bitmap blocks' worth with all 6,120 revokes: a
/// transaction of 24 log blocks, more than its quarter (7) and what was pending before it (at
/// most another quarter) together. A step now counts the revoke blocks it adds against the
/// same quarter. (Limits today keep the sum under a whole log: revokes cannot outnumber the
/// blocks journaled since the last checkpoint, at most 256 areas' logs; the count makes the
/// bound hold by itself.)
#[test]
fn a_free_step_counts_the_revoke_records_it_adds() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file_in("revokes", 256);
    let (fs, _) = Fs::open(fs_fuse::mount::image_factory(&img.0), opts_one_write()).unwrap();
    let log_len = fs.superblock().journal_blocks - 1;
    let areas = fs.superblock().journal_areas as u64;
    assert_eq!((log_len, areas), (31, 256));
    // Each commit of 12 data blocks and (at most) the inode's table block takes 15 log blocks,
    // half a log: a one-write commit journals its data. A thread's first request gives it the
    // next area, so each turn of the loop commits in an area of its own.
    let per_commit = 12u64;
    let mut l = BIG;
    for _ in 1..areas {
        fs.release_thread();
        for _ in 0..2 {
            l -= per_commit;
            let n = fs
                .write(f, l * B, &vec![0x33u8; (per_commit * B) as usize])
                .unwrap();
            assert_eq!(n as u64, per_commit * B);
            fs.sync_all().unwrap();
        }
    }
    fs.release_thread();
    let journaled = BIG - l;
    assert_eq!(journaled, 6_120);
    let free = fs.statfs().bfree;
    let revokes = fs.stats.revokes.load(Ordering::Relaxed);
    assert_eq!(fs.remove(ROOT_INO, b"f", false), Ok(()));
    fs.sync_all().unwrap();
    assert!(!fs.failed());
    assert!(fs.stats.free_steps.load(Ordering::Relaxed) > 0);
    assert_eq!(
        fs.stats.revokes.load(Ordering::Relaxed) - revokes,
        journaled,
        "the journaled blocks freed were not all revoked (a checkpoint sent some home?)"
    );
    // A step's own share is a quarter of a log, bitmap and revoke blocks together; what was
    // pending before it is at most another quarter. The inode table and directory blocks of
    // the unlink, a descriptor and a commit block come on top.
    let largest = fs.stats.largest_tx_log_blocks.load(Ordering::Relaxed);
    assert!(
        largest <= log_len / 2 + 2,
        "a transaction of {largest} log blocks; a step's budget is {} of a log of {log_len}",
        log_len / 4
    );
    assert_eq!(fs.statfs().bfree, free + BIG);
    unmount_and_check(fs, &img);
    let (fs, _) = Fs::open(fs_fuse::mount::image_factory(&img.0), opts_one_write()).unwrap();
    assert_eq!(fs.statfs().bfree, free + BIG);
    assert_eq!(fs.lookup(ROOT_INO, b"f", false), Err(libc::ENOENT));
    unmount_and_check(fs, &img);
}

/// A hole punched in steps that starts where an extent starts and ends
/// inside it: the first step's cut falls inside that extent, above the hole's start, so the
/// step's unmap splits it in two, and the commit between the steps sees one extent more than
/// the file had. The punch reserves a leaf for a split only when the extent starts below the
/// hole. With the file at the most extents it can have (1,632), that commit must encode a map
/// of 1,633 extents: nine leaf pointers for an inode of eight.
#[test]
fn a_stepped_punch_that_splits_an_extent_of_a_file_at_its_most_extents() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, f) = image_with_big_file("split-step");
    let fs = img.open();
    // 1,631 more extents of one block each past the big one: 1,632 in all.
    for i in 0..1_631u64 {
        fs.write(f, (BIG + 1 + 2 * i) * B, &[0x44u8; 8]).unwrap();
    }
    fs.sync_all().unwrap();
    // The one block more would be refused: the map is full.
    assert_eq!(
        fs.write(f, (BIG + 2 * 1_631 + 5) * B, &[1u8]),
        Err(libc::EFBIG)
    );
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        fs.fallocate(f, 0, (BIG - 1) * B, punch)
    }));
    assert!(r.is_ok(), "the punch panicked");
    let r = r.unwrap();
    assert!(r == Ok(()) || r == Err(libc::ENOSPC), "punch: {r:?}");
    fs.sync_all().unwrap();
    assert!(!fs.failed());
    unmount_and_check(fs, &img);
}

/// A 64 MiB image with the smallest journal area `mkfs` allows (32 blocks), mounted, holding
/// 800 files (50 inode table blocks' worth, 16 inodes a block) of 100 bytes each, unlinked
/// while their lookups are held, then synced: the image, the file system and their inodes.
fn held_unlinked_files(tag: &str) -> (Image, Arc<Fs>, Vec<u64>) {
    let path = std::env::temp_dir().join(format!("aiosfs-{tag}-{}.img", std::process::id()));
    let img = Image(path);
    std::fs::File::create(&img.0)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    mkfs(
        &img.0,
        &MkfsOptions {
            journals: 1,
            journal_blocks: 32,
            bytes_per_inode: 16 << 10,
            force: false,
        },
    )
    .unwrap();
    let fs = img.open();
    let n = 50 * 16;
    let mut inos = Vec::new();
    for i in 0..n {
        let name = format!("o{i}").into_bytes();
        let a = fs
            .mknod(ROOT_INO, &name, S_IFREG | 0o644, 0, ROOT, None)
            .unwrap();
        fs.write(a.ino, 0, &[0x55u8; 100]).unwrap();
        inos.push(a.ino);
    }
    for i in 0..n {
        let name = format!("o{i}").into_bytes();
        assert_eq!(fs.remove(ROOT_INO, &name, false), Ok(()));
    }
    fs.sync_all().unwrap();
    (img, fs, inos)
}

/// Many files unlinked while still held open (their lookups not forgotten) when the file
/// system stops: orphans, which the next mount frees. It freed them all and committed once:
/// with the orphans spread over more inode table blocks than a journal area's log holds, that
/// one transaction is refused, the open fails ("freeing orphan inodes failed"), and the image,
/// which fsck calls clean, can never be mounted again.
#[test]
fn the_mount_frees_more_orphans_than_one_transaction_holds() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, fs, inos) = held_unlinked_files("orphans");
    // The process holding them stops: no forget, no unmount.
    drop(fs);
    let (problems, notes) = img.fsck();
    assert_eq!(problems, Vec::<String>::new());
    assert!(notes.iter().any(|x| x.contains("unlinked")), "{notes:?}");
    let (fs, report) = Fs::open(fs_fuse::mount::image_factory(&img.0), opts())
        .unwrap_or_else(|e| panic!("the image fsck calls clean does not mount: {e}"));
    assert_eq!(report.orphans_freed, inos.len() as u64);
    unmount_and_check(fs, &img);
}

/// The same files, unlinked while held open, then let go on a live mount (the kernel's
/// FORGETs as the processes close them): each forget frees its file, and nothing commits in
/// between, so the next commit carries every freed inode and is refused as too large. The
/// file system goes read-only with everything pending lost.
#[test]
fn forgetting_many_unlinked_files_keeps_each_commit_inside_the_log() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, fs, inos) = held_unlinked_files("forgets");
    let free = fs.statfs().bfree;
    for &ino in &inos {
        fs.forget(ino, 1);
    }
    assert_eq!(fs.sync_all(), Ok(()));
    assert!(!fs.failed());
    assert_eq!(fs.statfs().bfree, free + inos.len() as u64);
    unmount_and_check(fs, &img);
}

/// An image whose only free blocks, but for a few, lie one in each block-bitmap block's range
/// (34 of them, 32,768 blocks apart), mounted; file "f" holds the rest, "g" is empty.
fn fragmented(tag: &str) -> (Image, Arc<Fs>, u64) {
    let (img, f) = image_with_big_file(tag);
    // Grow f over the whole data region but two blocks (one for the extent leaf its holes
    // will need).
    let fs = img.open();
    let data = fs.superblock().data;
    let p0 = fs.bmap(f, 0).unwrap().unwrap();
    let g = fs
        .mknod(ROOT_INO, b"g", S_IFREG | 0o644, 0, ROOT, None)
        .unwrap()
        .ino;
    fs.unmount().unwrap();
    drop(fs);
    let blocks = data.end() - p0 - 2;
    common::grow_first_extent(&img.0, f, blocks);
    assert_eq!(img.fsck().0, Vec::<String>::new());
    let fs = img.open();
    // One free block in each bitmap block's range: holes 32,768 blocks apart.
    let per = 8 * B;
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    let mut holes = 0;
    let mut l = 100;
    while l < blocks {
        assert_eq!(fs.fallocate(f, l * B, B, punch), Ok(()), "hole at {l}");
        holes += 1;
        l += per;
    }
    fs.sync_all().unwrap();
    assert!(holes >= 33, "{holes} holes");
    (img, fs, g)
}

/// One write whose blocks land in more block-bitmap blocks than a journal
/// area's log holds: on a fragmented disk, a write of 128 KiB takes 32 blocks, one free block
/// in each of 32 bitmap blocks' ranges. Nothing commits inside the write (only `settle` after
/// it), so its commit carries all 32 bitmap blocks and is refused as larger than the log: the
/// file system goes read-only, and the write and everything pending are lost.
#[test]
fn a_write_over_scattered_free_blocks_keeps_its_commit_inside_the_log() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, fs, g) = fragmented("scattered-write");
    let r = fs.write(g, 0, &vec![0x66u8; 32 * BLOCK]);
    assert_eq!(r, Ok(32 * BLOCK));
    assert_eq!(fs.sync_all(), Ok(()));
    assert!(!fs.failed());
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(
        fs.read(g, 0, 32 * BLOCK as u32).unwrap(),
        vec![0x66u8; 32 * BLOCK]
    );
    unmount_and_check(fs, &img);
}

/// The same with fallocate: 32 blocks from 32 bitmap blocks' ranges, one
/// commit refused, the file system read-only.
#[test]
fn a_fallocate_over_scattered_free_blocks_keeps_its_commit_inside_the_log() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let (img, fs, g) = fragmented("scattered-fallocate");
    assert_eq!(fs.fallocate(g, 0, 32 * B, 0), Ok(()));
    assert_eq!(fs.sync_all(), Ok(()));
    assert!(!fs.failed());
    unmount_and_check(fs, &img);
    let fs = img.open();
    assert_eq!(fs.getattr(g).unwrap().size, 32 * B);
    assert_eq!(
        fs.read(g, 0, 32 * BLOCK as u32).unwrap(),
        vec![0u8; 32 * BLOCK]
    );
    unmount_and_check(fs, &img);
}
