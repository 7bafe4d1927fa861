//! A full disk and power cuts around commits, fallocate and truncate (from a review on
//! 2026-11-27; each test failed before its fix): a commit that runs out of blocks for an xattr
//! block or an extent leaf keeps what it took out of the file system's state for the next
//! commit; fallocate that stops part way leaves its blocks owned by the file; fallocate's zeros
//! are durable before a commit maps their blocks, also with FUA writes (no FLUSH in a commit);
//! and the zeroed tail of a truncated block goes with whichever commit carries the new size.

mod common;

use std::sync::Arc;

use common::{factory, fresh_image, opts};
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr};
use fs_fuse::fsck_image;
use lbio::{SimConfig, SimDisk};

const ROOT: Caller = Caller { uid: 0, gid: 0 };

fn mk(fs: &Fs, name: &[u8]) -> u64 {
    fs.mknod(ROOT_INO, name, S_IFREG | 0o644, 0, ROOT, None)
        .unwrap()
        .ino
}

/// Fill the disk with file "fill" until ENOSPC, then shrink it by `leave` blocks and commit, so
/// exactly `leave` blocks are free (none quarantined).
fn fill_leaving(fs: &Fs, leave: u64) -> u64 {
    let fill = mk(fs, b"fill");
    let chunk = vec![0xabu8; 1 << 16];
    let mut off = 0u64;
    loop {
        match fs.write(fill, off, &chunk) {
            Ok(n) => off += n as u64,
            Err(e) => {
                assert_eq!(e, libc::ENOSPC);
                break;
            }
        }
    }
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, 0, "{:?}", fs.statfs());
    let size = fs.getattr(fill).unwrap().size;
    let new = (size / 4096 - leave) * 4096;
    fs.setattr(
        fill,
        &SetAttr {
            size: Some(new),
            ..SetAttr::default()
        },
    )
    .unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, leave, "{:?}", fs.statfs());
    fill
}

/// Unmount `fs` (the last handle on it) and check with fsck that the image `disk` then holds
/// is clean; returns the image.
fn unmount_clean(fs: Arc<Fs>, disk: &SimDisk) -> Vec<u8> {
    fs.unmount().unwrap();
    drop(fs);
    let image = disk.media();
    let rep = fsck_image(&image).unwrap();
    assert!(
        rep.clean(),
        "fsck after a clean unmount: {:?}",
        rep.problems
    );
    image
}

/// An xattr whose block cannot be allocated at commit time (full disk) stays pending: once
/// space is freed an fsync commits it, and it is there after a remount (it used to be dropped).
#[test]
fn an_xattr_whose_commit_ran_out_of_space_is_kept_for_the_next() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let a = mk(&fs, b"a");
    fs.sync_all().unwrap();
    let fill = fill_leaving(&fs, 0);
    fs.setxattr(a, b"user.k", b"v", 0).unwrap();
    // No block for the xattr: not durable, and the fsync says so.
    assert_eq!(fs.fsync(a), Err(libc::ENOSPC));
    assert_eq!(fs.getxattr(a, b"user.k").unwrap(), b"v");
    // Make room. The commit that frees the filler's blocks cannot use them yet (they are free
    // once it is durable), so it still reports the xattr; the next one commits it.
    fs.remove(ROOT_INO, b"fill", false).unwrap();
    fs.forget(fill, 1);
    assert_eq!(fs.sync_all(), Err(libc::ENOSPC));
    fs.fsync(a).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    let image = disk.media();
    let rep = fsck_image(&image).unwrap();
    assert!(rep.clean(), "fsck: {:?}", rep.problems);
    let (_d, fs) = common::open(image, 2).unwrap();
    assert_eq!(
        fs.getxattr(a, b"user.k"),
        Ok(b"v".to_vec()),
        "xattr acknowledged by fsync is gone after remount"
    );
}

/// Two new xattr blocks, one free block: the first inode gets the block in the failed build;
/// its contents reach the device with a later commit (they used to be dropped, leaving the
/// inode pointing at a block fsck calls damaged).
#[test]
fn an_xattr_block_allocated_by_a_commit_that_ran_out_of_space_is_written() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let a = mk(&fs, b"a");
    let b = mk(&fs, b"b");
    fs.sync_all().unwrap();
    let fill = fill_leaving(&fs, 1);
    fs.setxattr(a, b"user.k", b"va", 0).unwrap();
    fs.setxattr(b, b"user.k", b"vb", 0).unwrap();
    // The one free block goes to one of the two xattr blocks; the other waits, and whichever
    // file it belongs to hears ENOSPC from its fsync.
    let (ra, rb) = (fs.fsync(a), fs.fsync(b));
    assert!(
        [ra, rb].contains(&Err(libc::ENOSPC)) && [ra, rb].contains(&Ok(())),
        "{ra:?} {rb:?}"
    );
    fs.remove(ROOT_INO, b"fill", false).unwrap();
    fs.forget(fill, 1);
    assert_eq!(fs.sync_all(), Err(libc::ENOSPC));
    fs.sync_all().unwrap();
    unmount_clean(fs, &disk);
}

/// fallocate that runs out of space part way keeps the blocks it allocated owned by the file
/// (they used to be marked allocated with no inode mapping them: fsck called the image
/// damaged).
#[test]
fn fallocate_out_of_space_leaves_its_blocks_owned() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let c = mk(&fs, b"c");
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 3);
    let r = fs.fallocate(c, 0, 10 * 4096, 0);
    assert_eq!(r, Err(libc::ENOSPC));
    println!("after fallocate: {:?}", fs.getattr(c).unwrap());
    unmount_clean(fs, &disk);
}

/// With FUA durability (no FLUSH in a commit), fallocate's zeros are made durable before the
/// fsync's commit maps their block: after a power cut the file reads zeros there (it used to
/// read the data of the file deleted before).
#[test]
fn fallocate_zeros_are_durable_before_a_fua_commit_maps_them() {
    let image = fresh_image(8 << 20);
    let disk = SimDisk::from_image(SimConfig::new(image.len() as u64, 7), image).unwrap();
    let (fs, _) = Fs::open(factory(&disk), opts()).unwrap();
    fs.journal_set()
        .set_durability(journal::Durability::FuaWrites);
    let f = mk(&fs, b"f");
    fs.write(f, 0, &[0x11u8; 4096]).unwrap();
    let a = mk(&fs, b"a");
    fs.write(a, 0, &[0xaau8; 4096]).unwrap();
    fs.sync_all().unwrap();
    let pa = fs.bmap(a, 0).unwrap().unwrap();
    let pf = fs.bmap(f, 0).unwrap().unwrap();
    println!("f block 0 at {pf}, a block 0 at {pa}");
    fs.remove(ROOT_INO, b"a", false).unwrap();
    fs.forget(a, 1);
    fs.sync_all().unwrap();
    fs.fallocate(f, 4096, 4096, 0).unwrap();
    assert_eq!(fs.bmap(f, 1).unwrap(), Some(pa), "took a's old block");
    assert_eq!(fs.read(f, 4096, 4096).unwrap(), vec![0u8; 4096]);
    fs.fsync(f).unwrap();
    // Power cut now: only what is durable survives.
    let crash = disk.media();
    drop(fs);
    let (_d, fs) = common::open(crash, 3).unwrap();
    let got = fs.read(f, 4096, 4096).unwrap();
    assert_eq!(got.len(), 4096, "size after fsync");
    assert!(
        got.iter().all(|&b| b == 0),
        "fallocated range after fsync + power cut reads {:#x}.. (the deleted file's data)",
        got[0]
    );
}

/// A truncate inside a block zeroes the block's tail; an fsync of another file commits the new
/// size, and the zeroed block with it. After a power cut, growing the file shows zeros (it
/// used to show the bytes the truncate cut off).
#[test]
fn a_truncated_tail_is_zeroed_by_another_files_fsync() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = mk(&fs, b"f");
    let g = mk(&fs, b"g");
    fs.write(f, 0, &[0x5au8; 4096]).unwrap();
    fs.fsync(f).unwrap();
    fs.setattr(
        f,
        &SetAttr {
            size: Some(100),
            ..SetAttr::default()
        },
    )
    .unwrap();
    fs.write(g, 0, b"hello").unwrap();
    fs.fsync(g).unwrap();
    let crash = disk.media();
    drop(fs);
    let rep = fsck_image(&crash).unwrap();
    assert!(rep.clean(), "{:?}", rep.problems);
    let (_d, fs) = common::open(crash, 3).unwrap();
    assert_eq!(
        fs.getattr(f).unwrap().size,
        100,
        "the truncate was committed"
    );
    fs.setattr(
        f,
        &SetAttr {
            size: Some(4096),
            ..SetAttr::default()
        },
    )
    .unwrap();
    let got = fs.read(f, 0, 4096).unwrap();
    assert!(
        got[100..].iter().all(|&b| b == 0),
        "bytes past the truncated size came back after growing the file: {:#x}",
        got[100]
    );
}

/// A read that found its blocks and has not read them yet, while the file is truncated, the
/// freeing commit lands, and another file's write takes the freed block (the only free one)
/// and is fsynced: the read returns the truncated file's old bytes, never the new owner's.
/// (From the same review, by reading; before the fix the freed block was allocatable at once,
/// and this test read the other file's bytes.) The pause is the reading thread's own: the
/// other tests in this binary read beside it (when it was a global switch, one of them once
/// took the pause, and this read then came after the truncate).
#[test]
fn a_read_in_flight_never_returns_the_next_owners_bytes() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    let (_disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = mk(&fs, b"f");
    let g = mk(&fs, b"g");
    fs.write(f, 0, &[0x5au8; 4096]).unwrap();
    fs.sync_all().unwrap();
    // Nothing else is free: g's block can only be the one f frees.
    let _fill = fill_leaving(&fs, 0);
    fs_fuse::fs::READ_TEST_PAUSED.store(false, Ordering::Relaxed);
    let read = std::thread::scope(|s| {
        let r = s.spawn(|| {
            fs_fuse::fs::READ_TEST_PAUSE_US.with(|p| p.set(300_000));
            fs.read(f, 0, 4096).unwrap()
        });
        let t0 = std::time::Instant::now();
        while !fs_fuse::fs::READ_TEST_PAUSED.load(Ordering::Relaxed) {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the read took no pause"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // The read has its block and sleeps: free it, commit, give it to g.
        fs.setattr(
            f,
            &SetAttr {
                size: Some(0),
                ..SetAttr::default()
            },
        )
        .unwrap();
        fs.sync_all().unwrap();
        fs.write(g, 0, &[0xc3u8; 4096]).unwrap();
        fs.fsync(g).unwrap();
        r.join().unwrap()
    });
    assert_eq!(read.len(), 4096);
    assert!(
        read.iter().all(|&b| b == 0x5a),
        "the read returned another file's bytes ({:#x}…)",
        read[0]
    );
}

/// As above, with blocks freed and not yet committed when fallocate runs out: it commits to
/// free them, takes them, and runs out again. The blocks taken after that commit stay owned by
/// the file too (the inode, taken by that commit, is marked again).
#[test]
fn fallocate_out_of_space_after_a_commit_inside_it_leaves_its_blocks_owned() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let c = mk(&fs, b"c");
    let x = mk(&fs, b"x");
    fs.write(x, 0, &[0x77u8; 3 * 4096]).unwrap();
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 2);
    // x's three blocks are freed, and wait for a commit before they can be taken again.
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    let r = fs.fallocate(c, 0, 10 * 4096, 0);
    assert_eq!(r, Err(libc::ENOSPC));
    unmount_clean(fs, &disk);
}

/// A write that runs out of blocks part way, with blocks freed since the last commit, commits to
/// make them allocatable. That commit carries the blocks the write took before it: it must
/// carry the inode that maps them too. (From a review on 2026-11-28: it did not, and a power
/// cut right after it left a block marked in use that no file owned; fsck called the image
/// damaged, and the mount refuses such an image.)
#[test]
fn a_commit_inside_a_write_carries_the_inode_that_maps_its_blocks() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = mk(&fs, b"f");
    let x = mk(&fs, b"x");
    fs.write(x, 0, &[0x77u8; 3 * 4096]).unwrap();
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 1);
    // x's blocks are freed, and wait for a commit before they can be taken again.
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    // Block 0 takes the one free block; block 1 needs that commit.
    assert_eq!(fs.write(f, 0, &[0x42u8; 2 * 4096]), Ok(2 * 4096));
    // Power cut now: the commit inside the write is durable, nothing after it.
    let crash = disk.media();
    drop(fs);
    let rep = fsck_image(&crash).unwrap();
    assert!(
        rep.clean(),
        "power cut after a commit inside a write: {:?}",
        rep.problems
    );
}

/// A file of eight extents (all its inode holds) on a full disk: a write that makes a ninth
/// needs a block for an extent leaf as well. It used to take the data block and leave the leaf
/// to the commit, which found no block, failed, and failed ever after: the blocks freed by
/// deleting a file become allocatable only through a commit, so no space could be freed, and
/// the file system could not even unmount cleanly. Now the write gets ENOSPC, and once space
/// is freed it goes through and survives a remount.
#[test]
fn a_write_that_needs_an_extent_leaf_on_a_full_disk_says_enospc_and_commits_go_on() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let g = mk(&fs, b"g");
    // Eight one-block extents: every other block.
    for i in 0..8u64 {
        fs.write(g, 2 * i * 4096, &[i as u8 + 1; 4096]).unwrap();
    }
    fs.sync_all().unwrap();
    let fill = fill_leaving(&fs, 1);
    // A ninth extent: one block for its data, and one for the leaf the map now needs.
    let r = fs.write(g, 16 * 4096, &[0x99u8; 4096]);
    assert_eq!(r, Err(libc::ENOSPC));
    // Make room: the commit that frees the filler's blocks must go through.
    fs.remove(ROOT_INO, b"fill", false).unwrap();
    fs.forget(fill, 1);
    fs.sync_all().unwrap();
    fs.write(g, 16 * 4096, &[0x99u8; 4096]).unwrap();
    fs.fsync(g).unwrap();
    let image = unmount_clean(fs, &disk);
    let (_d, fs) = common::open(image, 2).unwrap();
    assert_eq!(fs.read(g, 16 * 4096, 4096).unwrap(), vec![0x99u8; 4096]);
    assert_eq!(fs.read(g, 14 * 4096, 4096).unwrap(), vec![8u8; 4096]);
}

/// Punching a hole inside an extent splits it in two. On a file with all the extents it can
/// have, the punch is refused (it used to go through, and the next commit panicked encoding an
/// inode with a ninth extent leaf).
#[test]
fn a_punch_that_would_split_an_extent_past_the_limit_is_refused() {
    use fs_fuse::fs::MAX_EXTENTS;
    let (disk, fs) = common::open(fresh_image(16 << 20), 1).unwrap();
    let f = mk(&fs, b"f");
    // MAX_EXTENTS - 1 one-block extents (every other block), then one of three blocks.
    let last = 2 * (MAX_EXTENTS as u64 - 1);
    for i in 0..MAX_EXTENTS as u64 - 1 {
        fs.write(f, 2 * i * 4096, &[1u8; 4096]).unwrap();
    }
    fs.write(f, last * 4096, &[2u8; 3 * 4096]).unwrap();
    fs.sync_all().unwrap();
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(
        fs.fallocate(f, (last + 1) * 4096, 4096, mode),
        Err(libc::ENOSPC)
    );
    // Punching a whole extent joins nothing and splits nothing: fine.
    fs.fallocate(f, 0, 4096, mode).unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.read(f, 0, 4096).unwrap(), vec![0u8; 4096]);
    assert_eq!(
        fs.read(f, (last + 1) * 4096, 4096).unwrap(),
        vec![2u8; 4096]
    );
    unmount_clean(fs, &disk);
}

/// Blocks that fallocate with `FALLOC_FL_KEEP_SIZE` allocated past the end of a file are freed
/// by a hole punched over them, as on Linux; the size stays. (From a review on 2026-11-28: the
/// punch was cut at the size, so those blocks stayed allocated until a truncate or an unlink.)
#[test]
fn a_punch_past_the_end_frees_the_blocks_kept_there() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = mk(&fs, b"f");
    fs.write(f, 0, &[0x5au8; 6000]).unwrap();
    fs.sync_all().unwrap();
    let before = fs.statfs().bfree;
    // Blocks 2..8, all past the end (6000 bytes end in block 1).
    fs.fallocate(f, 2 * 4096, 6 * 4096, libc::FALLOC_FL_KEEP_SIZE)
        .unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, before - 6);
    assert_eq!(fs.getattr(f).unwrap().size, 6000);
    // From inside block 0 to past the allocated blocks: block 0 is zeroed from 2048, block 1
    // (the last one inside the size) and every block past the end are freed.
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fs.fallocate(f, 2048, 10 * 4096, mode).unwrap();
    for l in 1..8 {
        assert_eq!(fs.bmap(f, l).unwrap(), None, "file block {l} still mapped");
    }
    assert!(fs.bmap(f, 0).unwrap().is_some());
    assert_eq!(
        fs.getattr(f).unwrap().size,
        6000,
        "a punch changed the size"
    );
    // The freed blocks come back once the commit that frees them is durable.
    fs.sync_all().unwrap();
    fs.sync_all().unwrap();
    assert_eq!(
        fs.statfs().bfree,
        before + 1,
        "blocks past the end not freed"
    );
    let got = fs.read(f, 0, 8192).unwrap();
    assert_eq!(got.len(), 6000);
    assert!(got[..2048].iter().all(|&b| b == 0x5a));
    assert!(got[2048..].iter().all(|&b| b == 0));
    unmount_clean(fs, &disk);
}

/// A file of eight extents on a full disk, with blocks freed since the last commit: fallocate
/// that makes a ninth extent takes the one free block for its data and needs another for the
/// extent leaf. As a write does, it commits to make the freed blocks allocatable and goes on.
/// (From a review on 2026-11-28: it said ENOSPC, with space waiting only for a commit.)
#[test]
fn fallocate_that_needs_an_extent_leaf_commits_for_freed_blocks() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let g = mk(&fs, b"g");
    let x = mk(&fs, b"x");
    for i in 0..8u64 {
        fs.write(g, 2 * i * 4096, &[i as u8 + 1; 4096]).unwrap();
    }
    fs.write(x, 0, &[0x77u8; 3 * 4096]).unwrap();
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 1);
    // x's blocks are freed, and wait for a commit before they can be taken again.
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    assert_eq!(fs.fallocate(g, 16 * 4096, 4096, 0), Ok(()));
    assert_eq!(fs.getattr(g).unwrap().size, 17 * 4096);
    fs.fsync(g).unwrap();
    let image = unmount_clean(fs, &disk);
    let (_d, fs) = common::open(image, 2).unwrap();
    assert_eq!(fs.read(g, 16 * 4096, 4096).unwrap(), vec![0u8; 4096]);
    assert_eq!(fs.read(g, 14 * 4096, 4096).unwrap(), vec![8u8; 4096]);
}

/// mkdir in a directory whose blocks are full and which has all eight extents its inode holds
/// needs three blocks: the new directory's, one more for the parent, and an extent leaf for the
/// parent's map. With two free and some freed since the last commit, it commits first to make
/// those allocatable. (From a review on 2026-11-28: the check counted two, and mkdir said
/// ENOSPC with space waiting only for a commit.)
#[test]
fn mkdir_that_needs_a_leaf_for_its_parent_commits_for_freed_blocks() {
    use fs_fuse::format::S_IFDIR;
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let d = fs
        .mknod(ROOT_INO, b"d", S_IFDIR | 0o755, 0, ROOT, None)
        .unwrap()
        .ino;
    let spacer = mk(&fs, b"spacer");
    let x = mk(&fs, b"x");
    fs.write(x, 0, &[0x77u8; 3 * 4096]).unwrap();
    // Eight directory blocks of 255-byte names (15 fit a block), each followed on the device
    // by a spacer block, so each is an extent of its own.
    let mut names = 0u32;
    for blk in 0..8u64 {
        for _ in 0..15 {
            let mut name = format!("{names:05}").into_bytes();
            name.resize(255, b'n');
            fs.link(spacer, d, &name).unwrap();
            names += 1;
        }
        assert_eq!(fs.getattr(d).unwrap().size, (blk + 1) * 4096);
        fs.write(spacer, blk * 4096, &[1u8; 4096]).unwrap();
    }
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 2);
    // x's blocks are freed, and wait for a commit before they can be taken again.
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    // A name too long for the room left in any of the eight blocks.
    let mut sub = b"sub".to_vec();
    sub.resize(255, b's');
    let r = fs.mknod(d, &sub, S_IFDIR | 0o755, 0, ROOT, None);
    assert!(r.is_ok(), "mkdir: {r:?}");
    assert_eq!(fs.getattr(d).unwrap().size, 9 * 4096);
    let image = unmount_clean(fs, &disk);
    let (_d, fs) = common::open(image, 2).unwrap();
    assert!(fs.lookup(d, &sub, false).is_ok());
}

/// link and rename into a directory whose block is full need a new directory block. With the
/// disk full and blocks freed since the last commit, they commit first to make those
/// allocatable, as mknod does. (From a review on 2026-11-28: both said ENOSPC with space
/// waiting only for a commit, so `ln` or `mv` right after `rm` failed on a full disk.)
#[test]
fn link_and_rename_into_a_full_directory_commit_for_freed_blocks() {
    use fs_fuse::format::S_IFDIR;
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let d = fs
        .mknod(ROOT_INO, b"d", S_IFDIR | 0o755, 0, ROOT, None)
        .unwrap()
        .ino;
    let f = mk(&fs, b"f");
    let g = mk(&fs, b"g");
    let x = mk(&fs, b"x");
    fs.write(x, 0, &[0x77u8; 3 * 4096]).unwrap();
    // 15 names of 255 bytes fill d's one block.
    for i in 0..15 {
        let mut name = format!("{i:05}").into_bytes();
        name.resize(255, b'n');
        fs.link(f, d, &name).unwrap();
    }
    assert_eq!(fs.getattr(d).unwrap().size, 4096);
    fs.sync_all().unwrap();
    let _fill = fill_leaving(&fs, 0);
    // x's blocks are freed, and wait for a commit before they can be taken again.
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    let linked = [b'l'; 255];
    let r = fs.link(f, d, &linked);
    assert!(r.is_ok(), "link: {r:?}");
    assert_eq!(fs.getattr(d).unwrap().size, 2 * 4096);
    // The second block is full too now (a 255-byte name each, 15 fit).
    for i in 0..14 {
        let mut name = format!("m{i:04}").into_bytes();
        name.resize(255, b'm');
        fs.link(f, d, &name).unwrap();
    }
    fs.sync_all().unwrap();
    let y = mk(&fs, b"y");
    fs.write(y, 0, &[0x66u8; 4096]).unwrap();
    fs.sync_all().unwrap();
    // Again the only free block waits for a commit.
    let _fill2 = fill_leaving_named(&fs, b"fill2");
    fs.remove(ROOT_INO, b"y", false).unwrap();
    fs.forget(y, 1);
    let moved = [b'r'; 255];
    let r = fs.rename(ROOT_INO, b"g", d, &moved, 0);
    assert_eq!(r, Ok(()), "rename");
    assert_eq!(fs.lookup(d, &moved, false).unwrap().ino, g);
    assert_eq!(fs.getattr(d).unwrap().size, 3 * 4096);
    let image = unmount_clean(fs, &disk);
    let (_d, fs) = common::open(image, 2).unwrap();
    assert_eq!(fs.lookup(d, &linked, false).unwrap().ino, f);
    assert_eq!(fs.lookup(d, &moved, false).unwrap().ino, g);
    assert_eq!(fs.lookup(ROOT_INO, b"g", false), Err(libc::ENOENT));
}

/// Write file `name` until the disk is full and commit (no block left free).
fn fill_leaving_named(fs: &Fs, name: &[u8]) -> u64 {
    let fill = mk(fs, name);
    let chunk = vec![0xcdu8; 1 << 16];
    let mut off = 0u64;
    while let Ok(n) = fs.write(fill, off, &chunk) {
        off += n as u64;
    }
    fs.sync_all().unwrap();
    assert_eq!(fs.statfs().bfree, 0, "{:?}", fs.statfs());
    fill
}

/// A change that is complete in itself, on a full disk where another file's new xattrs wait for
/// a block. The commit the change made on its way out (more dirty data than the limit: a
/// quarter of the 2 MiB arena here) went through, leaving those xattrs for later, and the
/// change returned ENOSPC: the caller was told the write failed, and it was written and
/// committed. ENOSPC for waiting xattrs is for an fsync or sync to say (they are not durable);
/// here the write succeeds.
#[test]
fn a_change_whose_own_commit_leaves_another_files_xattrs_for_later_succeeds() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let a = mk(&fs, b"a");
    fs.sync_all().unwrap();
    let fill = fill_leaving(&fs, 0);
    fs.setxattr(a, b"user.k", b"v", 0).unwrap();
    // 160 of the filler's blocks again (no block needed): 640 KiB dirty, past the limit.
    let data = vec![0x5au8; 160 * 4096];
    assert_eq!(fs.write(fill, 0, &data), Ok(data.len()));
    // The write is committed: only the xattr still waits.
    assert_eq!(fs.sync_all(), Err(libc::ENOSPC));
    assert_eq!(fs.read(fill, 0, 160 * 4096).unwrap(), data);
    fs.remove(ROOT_INO, b"fill", false).unwrap();
    fs.forget(fill, 1);
    assert_eq!(fs.sync_all(), Err(libc::ENOSPC));
    fs.fsync(a).unwrap();
    unmount_clean(fs, &disk);
}

/// A full disk with blocks freed since the last commit (file "x" removed) and another file's
/// new xattrs waiting for a block (file "a"): the stage for the three tests below. The commit
/// an operation makes there to make the freed blocks allocatable cannot give the xattrs a
/// block (the freed ones come back only once it is durable), so it leaves them for later; the
/// operation then has its room, and must not fail because of them. Returns `(a, x's blocks)`.
fn full_with_freed_blocks_and_waiting_xattrs(fs: &Fs, x_blocks: u64) -> u64 {
    let a = mk(fs, b"a");
    let x = mk(fs, b"x");
    fs.write(x, 0, &vec![0x77u8; (x_blocks * 4096) as usize])
        .unwrap();
    fs.sync_all().unwrap();
    let _fill = fill_leaving(fs, 0);
    fs.setxattr(a, b"user.k", b"v", 0).unwrap();
    fs.remove(ROOT_INO, b"x", false).unwrap();
    fs.forget(x, 1);
    a
}

/// mknod and link, with the stage above: `room_for` commits first, and that commit left a's
/// xattrs for later. (From a review on 2026-11-28, by reading: both said ENOSPC, with the
/// room they needed made by that very commit.)
#[test]
fn mknod_and_link_whose_commit_leaves_another_files_xattrs_for_later_succeed() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let a = full_with_freed_blocks_and_waiting_xattrs(&fs, 3);
    let r = fs.mknod(ROOT_INO, b"n", S_IFREG | 0o644, 0, ROOT, None);
    assert!(r.is_ok(), "mknod: {r:?}");
    // The same stage again: n takes x's three blocks, and its only link goes.
    let n = r.unwrap().ino;
    fs.write(n, 0, &[0x55u8; 3 * 4096]).unwrap();
    assert_eq!(fs.sync_all(), Err(libc::ENOSPC), "a's xattrs still wait");
    fs.remove(ROOT_INO, b"n", false).unwrap();
    fs.forget(n, 1);
    let r = fs.link(a, ROOT_INO, b"a2");
    assert!(r.is_ok(), "link: {r:?}");
    // The xattrs are for an fsync to report, and go out once a commit finds a block.
    assert_eq!(fs.fsync(a), Ok(()));
    unmount_clean(fs, &disk);
}

/// A write into a hole, with the stage above: `alloc_for_map` finds no block, commits, and
/// that commit left a's xattrs for later. (From a review on 2026-11-28, by reading: the write
/// said ENOSPC, with the blocks it needed made allocatable by that very commit.)
#[test]
fn a_write_whose_commit_for_freed_blocks_leaves_another_files_xattrs_for_later_succeeds() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let w = mk(&fs, b"w");
    let a = full_with_freed_blocks_and_waiting_xattrs(&fs, 3);
    assert_eq!(fs.write(w, 0, &[0x42u8; 2 * 4096]), Ok(2 * 4096));
    assert_eq!(fs.read(w, 0, 2 * 4096).unwrap(), vec![0x42u8; 2 * 4096]);
    assert_eq!(fs.fsync(a), Ok(()));
    unmount_clean(fs, &disk);
}

/// A hole punched inside an extent of a file with all eight inline extents needs an extent
/// leaf for the split; with the stage above there is none until the punch's commit, and that
/// commit left a's xattrs for later. (From a review on 2026-11-28, by reading: the punch said
/// ENOSPC, with the leaf it needed made allocatable by that very commit.)
#[test]
fn a_punch_whose_commit_for_a_leaf_leaves_another_files_xattrs_for_later_succeeds() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let g = mk(&fs, b"g");
    // Seven one-block extents (every other block), then one of three blocks at 14..17.
    for i in 0..7u64 {
        fs.write(g, 2 * i * 4096, &[i as u8 + 1; 4096]).unwrap();
    }
    fs.write(g, 14 * 4096, &[9u8; 3 * 4096]).unwrap();
    let a = full_with_freed_blocks_and_waiting_xattrs(&fs, 3);
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(fs.fallocate(g, 15 * 4096, 4096, mode), Ok(()));
    assert_eq!(fs.bmap(g, 15).unwrap(), None);
    assert_eq!(fs.read(g, 15 * 4096, 4096).unwrap(), vec![0u8; 4096]);
    assert_eq!(fs.read(g, 16 * 4096, 4096).unwrap(), vec![9u8; 4096]);
    assert_eq!(fs.fsync(a), Ok(()));
    unmount_clean(fs, &disk);
}

/// A mkdir or symlink that took the last free block for its own block, then found no block for
/// its parent's new directory block, is rolled back (ENOSPC). Its block was never committed, so
/// it is free again at once: the next commit can give it to another file's new xattrs. (From a
/// review on 2026-11-28: the rollback put it into quarantine, free only after the next commit,
/// and that commit, an fsync of the other file, said ENOSPC with one block really free.)
#[test]
fn a_mkdir_or_symlink_rolled_back_for_a_parent_block_frees_its_block_at_once() {
    use fs_fuse::format::{S_IFDIR, S_IFLNK};
    for symlink in [false, true] {
        let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
        let d = fs
            .mknod(ROOT_INO, b"d", S_IFDIR | 0o755, 0, ROOT, None)
            .unwrap()
            .ino;
        let f = mk(&fs, b"f");
        let a = mk(&fs, b"a");
        // 15 names of 255 bytes fill d's one block.
        for i in 0..15 {
            let mut name = format!("{i:05}").into_bytes();
            name.resize(255, b'n');
            fs.link(f, d, &name).unwrap();
        }
        assert_eq!(fs.getattr(d).unwrap().size, 4096);
        fs.sync_all().unwrap();
        let _fill = fill_leaving(&fs, 1);
        let mut name = b"new".to_vec();
        name.resize(255, b's');
        let r = if symlink {
            fs.mknod(d, &name, S_IFLNK | 0o777, 0, ROOT, Some(b"target"))
        } else {
            fs.mknod(d, &name, S_IFDIR | 0o755, 0, ROOT, None)
        };
        assert_eq!(r.map(|_| ()), Err(libc::ENOSPC), "symlink {symlink}");
        assert_eq!(fs.lookup(d, &name, false), Err(libc::ENOENT));
        assert_eq!(fs.statfs().bfree, 1);
        // a's new xattrs need a block at the commit its fsync makes: the one left.
        fs.setxattr(a, b"user.k", b"v", 0).unwrap();
        assert_eq!(fs.fsync(a), Ok(()), "symlink {symlink}: fsync of a");
        assert_eq!(fs.statfs().bfree, 0);
        let image = unmount_clean(fs, &disk);
        let (_d, fs) = common::open(image, 2).unwrap();
        assert_eq!(fs.getxattr(a, b"user.k"), Ok(b"v".to_vec()));
    }
}
