//! Read errors part way through an operation (from a review on 2026-11-28; each test failed
//! before its fix): an operation that gets EIO from the device must not leave the file
//! system's in-memory metadata half changed and unmarked, where the next commit writes one part
//! (the block bitmap, a directory) without the other (the inode, the other directory).
//!
//! The device is RAM ([`FaultyDisk`]) whose reads of chosen blocks fail with EIO. Each test
//! remounts before it injects the error, so the block is not in the page cache (a fresh mount
//! has an empty one) and the read reaches the device. After the failed operation the error is
//! lifted, everything is committed and the file system unmounted, and fsck must find the image
//! clean.
//!
//! The device also keeps a write cache: a write is durable once written with FUA or once a
//! FLUSH after it succeeds, and its FLUSHes can be made to fail ([`FaultyDisk::fail_flushes`]).
//! [`FaultyDisk::durable`] is what a power cut would leave.

mod common;

use std::collections::HashSet;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use aios_core::{CoreError, Engine, SinkId};
use common::{fresh_image, opts};
use fs_fuse::format::{Inode, Superblock, BLOCK, INODES_PER_BLOCK, INODE_BYTES, ROOT_INO};
use fs_fuse::format::{S_IFDIR, S_IFREG};
use fs_fuse::fs::{Caller, DeviceFactory, Fs, SetAttr};
use fs_fuse::{fsck_image, FsError};
use lbio::{Backend, Caps, Device, Geometry, LbioArray, Op, Piece, Started};

const ROOT: Caller = Caller { uid: 0, gid: 0 };
const B: u64 = BLOCK as u64;

struct Shared {
    /// What reads see: every completed write.
    mem: Mutex<Vec<u8>>,
    /// What survives a power cut: FUA writes, and every write completed before a FLUSH that
    /// succeeded.
    durable: Mutex<Vec<u8>>,
    /// Blocks (of [`BLOCK`] bytes) whose reads fail with EIO.
    bad: Mutex<HashSet<u64>>,
    /// FLUSHes fail with EIO (and make nothing durable) while set.
    bad_flush: AtomicBool,
}

/// An image in RAM, shared by every device opened on it (each worker and the page cache open
/// their own), whose reads of chosen blocks fail with EIO until [`FaultyDisk::heal`].
#[derive(Clone)]
struct FaultyDisk(Arc<Shared>);

impl FaultyDisk {
    fn new(image: Vec<u8>) -> FaultyDisk {
        FaultyDisk(Arc::new(Shared {
            durable: Mutex::new(image.clone()),
            mem: Mutex::new(image),
            bad: Mutex::new(HashSet::new()),
            bad_flush: AtomicBool::new(false),
        }))
    }

    fn fail_reads(&self, block: u64) {
        self.0.bad.lock().unwrap().insert(block);
    }

    /// From now on, every FLUSH fails with EIO until [`FaultyDisk::heal`].
    fn fail_flushes(&self) {
        self.0.bad_flush.store(true, Ordering::Relaxed);
    }

    fn heal(&self) {
        self.0.bad.lock().unwrap().clear();
        self.0.bad_flush.store(false, Ordering::Relaxed);
    }

    fn image(&self) -> Vec<u8> {
        self.0.mem.lock().unwrap().clone()
    }

    /// The image a power cut now would leave: only what is durable.
    fn durable(&self) -> Vec<u8> {
        self.0.durable.lock().unwrap().clone()
    }

    fn factory(&self) -> DeviceFactory {
        let shared = Arc::clone(&self.0);
        Arc::new(move |lbio: &Rc<LbioArray>| {
            let bytes = shared.mem.lock().unwrap().len() as u64;
            let geometry = Geometry {
                capacity_bytes: bytes,
                logical_block: 512,
                mem_align: 512,
                offset_align: 512,
                max_transfer_bytes: 1 << 20,
            };
            Device::from_backends(
                lbio,
                Box::new(FaultyBackend(Arc::clone(&shared))),
                Box::new(FaultyBackend(Arc::clone(&shared))),
                geometry,
                true,
            )
            .map_err(FsError::from)
        })
    }
}

struct FaultyBackend(Arc<Shared>);

impl Backend for FaultyBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: "faulty memory",
            asynchronous: false,
            fua: true,
            flush: true,
            iopoll: false,
            power_loss_protected: false,
            vectored: true,
        }
    }

    unsafe fn start(
        &self,
        _engine: &Engine,
        _sink: SinkId,
        _tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let mut mem = self.0.mem.lock().unwrap();
        let (off, len) = (piece.offset as usize, piece.len as usize);
        if off.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Ok(Started::Done(-libc::EINVAL));
        }
        if piece.op == Op::Read && len > 0 {
            let bad = self.0.bad.lock().unwrap();
            let (first, last) = (off as u64 / B, (off + len - 1) as u64 / B);
            if (first..=last).any(|b| bad.contains(&b)) {
                return Ok(Started::Done(-libc::EIO));
            }
        }
        if piece.op == Op::Flush {
            if self.0.bad_flush.load(Ordering::Relaxed) {
                return Ok(Started::Done(-libc::EIO));
            }
            // Every write completed so far (each completes before it returns here).
            self.0.durable.lock().unwrap().copy_from_slice(&mem);
        }
        // SAFETY: the caller's contract on `piece` is passed on; `mem` is a separate heap
        // allocation, which no segment can overlap.
        let r = unsafe { lbio::piece_in_memory(&mut mem, piece) };
        if piece.op == Op::Write && piece.fua && r > 0 {
            self.0.durable.lock().unwrap()[off..off + len].copy_from_slice(&mem[off..off + len]);
        }
        Ok(Started::Done(r))
    }
}

fn mount(disk: &FaultyDisk) -> Arc<Fs> {
    Fs::open(disk.factory(), opts()).unwrap().0
}

/// Unmount `fs` (the last handle on it) and mount the image again: a fresh page cache, so
/// the next read of a block reaches the device.
fn remount(fs: Arc<Fs>, disk: &FaultyDisk) -> Arc<Fs> {
    fs.unmount().unwrap();
    drop(fs);
    mount(disk)
}

/// Lift the injected errors, commit everything, unmount, and return what fsck finds wrong.
fn commit_and_fsck(fs: Arc<Fs>, disk: &FaultyDisk) -> Vec<String> {
    disk.heal();
    fs.sync_all().unwrap();
    fs.unmount().unwrap();
    drop(fs);
    fsck_image(&disk.image()).unwrap().problems
}

/// Inode `ino` as the image holds it at home (after an unmount: everything checkpointed).
fn inode_on_image(disk: &FaultyDisk, ino: u64) -> Inode {
    let img = disk.image();
    let sb = Superblock::decode(&img[..BLOCK], img.len() as u64 / B).unwrap();
    let tb = sb.inode_table.start + ino / INODES_PER_BLOCK as u64;
    let at = (tb * B) as usize + (ino % INODES_PER_BLOCK as u64) as usize * INODE_BYTES;
    Inode::decode(&img[at..at + INODE_BYTES]).unwrap().unwrap()
}

fn mk(fs: &Fs, parent: u64, name: &[u8], mode: u32) -> u64 {
    fs.mknod(parent, name, mode, 0, ROOT, None).unwrap().ino
}

/// A disk with file "f" holding `blocks` blocks of 0x11 (committed and unmounted).
fn disk_with_file(blocks: u64) -> (FaultyDisk, Arc<Fs>, u64) {
    let disk = FaultyDisk::new(fresh_image(8 << 20));
    let fs = mount(&disk);
    let f = mk(&fs, ROOT_INO, b"f", S_IFREG | 0o644);
    if blocks > 0 {
        fs.write(f, 0, &vec![0x11u8; (blocks * B) as usize])
            .unwrap();
    }
    let fs = remount(fs, &disk);
    (disk, fs, f)
}

/// The device itself: a read of a bad block fails, of a good one does not.
#[test]
fn the_faulty_disk_fails_reads_of_chosen_blocks() {
    let (disk, fs, f) = disk_with_file(2);
    let p = fs.bmap(f, 1).unwrap().unwrap();
    disk.fail_reads(p);
    assert_eq!(fs.read(f, 0, 4096).unwrap(), vec![0x11u8; 4096]);
    assert_eq!(fs.read(f, 4096, 4096), Err(libc::EIO));
    disk.heal();
    assert_eq!(fs.read(f, 4096, 4096).unwrap(), vec![0x11u8; 4096]);
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
}

/// A write that allocates a block for a hole and then fails to read a block it overwrites
/// in part. It returned EIO with the new block mapped and marked in use but the inode not
/// marked: the next commit wrote the bitmap without the inode (fsck: "block N is marked in
/// use but no file owns it"). Now it stops there and returns the bytes written so far, as
/// Linux does, and the inode goes with the next commit.
#[test]
fn a_write_whose_partial_block_read_fails_keeps_its_allocated_blocks_owned() {
    let (disk, fs, f) = disk_with_file(0);
    // Block 1 on the device, block 0 a hole.
    fs.write(f, B, &vec![0x22u8; BLOCK]).unwrap();
    let fs = remount(fs, &disk);
    disk.fail_reads(fs.bmap(f, 1).unwrap().unwrap());
    // Block 0 whole (allocated), then the first 100 bytes of block 1 (read, fails).
    let r = fs.write(f, 0, &vec![0x33u8; BLOCK + 100]);
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    assert_eq!(
        r,
        Ok(BLOCK),
        "the bytes before the failing block are written"
    );
    let fs = mount(&disk);
    assert_eq!(fs.read(f, 0, 4096).unwrap(), vec![0x33u8; 4096]);
    assert_eq!(fs.read(f, B, 4096).unwrap(), vec![0x22u8; 4096]);
    fs.unmount().unwrap();
}

/// A write to a file with xattrs whose xattr block cannot be read (a write drops
/// `security.capability`, so it loads them). It returned EIO after allocating and mapping
/// its blocks, without marking the inode (fsck: "block N is marked in use but no file owns
/// it"). Now the xattrs are loaded before anything changes: EIO, and nothing written.
#[test]
fn a_write_whose_xattr_block_read_fails_changes_nothing() {
    let (disk, fs, f) = disk_with_file(0);
    fs.setxattr(f, b"user.a", b"1", 0).unwrap();
    let fs = remount(fs, &disk);
    let xattr = inode_on_image(&disk, f).xattr;
    assert_ne!(xattr, 0);
    disk.fail_reads(xattr);
    assert_eq!(fs.write(f, 0, &vec![0x44u8; BLOCK]), Err(libc::EIO));
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.getattr(f).unwrap().size, 0);
    assert_eq!(fs.getxattr(f, b"user.a").unwrap(), b"1");
    fs.unmount().unwrap();
}

/// A truncate to the middle of a block whose read (to zero its tail) fails. It freed the
/// blocks past the new end first and returned EIO without marking the inode: the next commit
/// wrote the bitmap with them free while the inode on disk still mapped them (fsck: "block N
/// of inode I is marked free"; they could be handed out twice). Now the block is zeroed
/// before anything is freed: EIO, and the file is as it was.
#[test]
fn a_truncate_whose_tail_block_read_fails_frees_nothing() {
    let (disk, fs, f) = disk_with_file(3);
    disk.fail_reads(fs.bmap(f, 0).unwrap().unwrap());
    let r = fs.setattr(
        f,
        &SetAttr {
            size: Some(100),
            ..SetAttr::default()
        },
    );
    assert_eq!(r.map(|_| ()), Err(libc::EIO));
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.getattr(f).unwrap().size, 3 * B);
    assert_eq!(fs.read(f, 0, 3 * 4096).unwrap(), vec![0x11u8; 3 * BLOCK]);
    fs.unmount().unwrap();
}

/// A punched hole whose partial first block cannot be read (to zero its part). It freed the
/// whole blocks of the range and returned EIO without marking the inode (fsck: "block N of
/// inode I is marked free"). A first fix marked the inode, so the image stayed consistent, but
/// the whole blocks stayed punched behind the error. Now both partial blocks are read before
/// anything changes: EIO, and the file is as it was.
#[test]
fn a_punch_whose_partial_block_read_fails_changes_nothing() {
    let (disk, fs, f) = disk_with_file(3);
    let first = fs.bmap(f, 1).unwrap();
    disk.fail_reads(fs.bmap(f, 0).unwrap().unwrap());
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // Bytes 100.. of block 0 (read, fails) and all of block 1.
    assert_eq!(fs.fallocate(f, 100, 2 * B - 100, punch), Err(libc::EIO));
    assert_eq!(
        fs.bmap(f, 1).unwrap(),
        first,
        "the failed punch freed block 1"
    );
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.bmap(f, 1).unwrap(), first);
    assert_eq!(fs.read(f, 0, 3 * 4096).unwrap(), vec![0x11u8; 3 * BLOCK]);
    fs.unmount().unwrap();
}

/// A punched hole whose partial last block cannot be read. It freed the whole block between,
/// zeroed the first block's part in memory (a dirty block the next commit wrote), then
/// returned EIO: the caller was told nothing happened and two of its three parts had. Now
/// nothing changes: EIO, and the file reads as before, after a commit and a remount too.
#[test]
fn a_punch_whose_last_partial_block_read_fails_changes_nothing() {
    let (disk, fs, f) = disk_with_file(3);
    let first = fs.bmap(f, 1).unwrap();
    disk.fail_reads(fs.bmap(f, 2).unwrap().unwrap());
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // Bytes 100.. of block 0 (read), all of block 1, the first 100 of block 2 (read, fails).
    assert_eq!(fs.fallocate(f, 100, 2 * B, punch), Err(libc::EIO));
    assert_eq!(
        fs.bmap(f, 1).unwrap(),
        first,
        "the failed punch freed block 1"
    );
    assert_eq!(
        fs.read(f, 0, 4096).unwrap(),
        vec![0x11u8; 4096],
        "the failed punch zeroed part of block 0"
    );
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.read(f, 0, 3 * 4096).unwrap(), vec![0x11u8; 3 * BLOCK]);
    fs.unmount().unwrap();
}

/// A chown (with `FATTR_KILL_SUIDGID`) of a file whose xattr block cannot be read. It set the
/// new owner in memory, then returned EIO without marking the inode: the owner the caller was
/// told did not change stayed in memory, and the next change of the inode made it durable.
/// Now the xattrs are loaded before anything changes.
#[test]
fn a_chown_whose_xattr_block_read_fails_changes_nothing() {
    let (disk, fs, f) = disk_with_file(1);
    fs.setxattr(f, b"user.a", b"1", 0).unwrap();
    let fs = remount(fs, &disk);
    disk.fail_reads(inode_on_image(&disk, f).xattr);
    let chown = SetAttr {
        uid: Some(1000),
        kill_privs: true,
        ..SetAttr::default()
    };
    assert_eq!(fs.setattr(f, &chown).map(|_| ()), Err(libc::EIO));
    assert_eq!(
        fs.getattr(f).unwrap().uid,
        0,
        "the failed chown changed the owner"
    );
    disk.heal();
    // Any later change of the inode commits it.
    fs.write(f, 0, b"x").unwrap();
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.getattr(f).unwrap().uid, 0, "the failed chown is durable");
    fs.unmount().unwrap();
}

/// Directories "a" and "b" in the root, directory "a/x", and (with `y`) directory "b/y";
/// unmounted and mounted again.
fn two_dirs(y: bool) -> (FaultyDisk, Arc<Fs>, [u64; 4]) {
    let disk = FaultyDisk::new(fresh_image(8 << 20));
    let fs = mount(&disk);
    let a = mk(&fs, ROOT_INO, b"a", S_IFDIR | 0o755);
    let b = mk(&fs, ROOT_INO, b"b", S_IFDIR | 0o755);
    let x = mk(&fs, a, b"x", S_IFDIR | 0o755);
    let y = if y {
        mk(&fs, b, b"y", S_IFDIR | 0o755)
    } else {
        0
    };
    let fs = remount(fs, &disk);
    (disk, fs, [a, b, x, y])
}

/// A rename of directory "a/x" to "b/x" whose read of x's block (to point its ".." at b)
/// fails. It had added b's entry (b marked) and dropped a's (a not marked) before the read,
/// and returned EIO: the next commit wrote b and not a, so x was in both (fsck: "directory
/// inode X is in two directories"). Now the moved directory is loaded before anything
/// changes: EIO, and nothing moved.
#[test]
fn a_rename_whose_directory_read_fails_moves_nothing() {
    let (disk, fs, [a, b, x, _]) = two_dirs(false);
    fs.lookup(a, b"x", false).unwrap();
    fs.lookup(b, b"x", false).unwrap_err();
    disk.fail_reads(fs.bmap(x, 0).unwrap().unwrap());
    assert_eq!(fs.rename(a, b"x", b, b"x", 0), Err(libc::EIO));
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.lookup(a, b"x", false).unwrap().ino, x);
    assert_eq!(fs.lookup(b, b"x", false), Err(libc::ENOENT));
    fs.unmount().unwrap();
}

/// `RENAME_EXCHANGE` of directories "a/x" and "b/y" whose read of x's block fails. It swapped
/// both entries in memory (neither directory marked) and returned EIO; the next change of
/// each directory committed the swap with x's ".." still at a and y's at b (fsck: '".."
/// points to A, its parent is B'). Now both directories are loaded first: EIO, nothing
/// swapped.
#[test]
fn a_rename_exchange_whose_directory_read_fails_swaps_nothing() {
    let (disk, fs, [a, b, x, y]) = two_dirs(true);
    disk.fail_reads(fs.bmap(x, 0).unwrap().unwrap());
    let r = fs.rename(a, b"x", b, b"y", libc::RENAME_EXCHANGE);
    assert_eq!(r, Err(libc::EIO));
    disk.heal();
    // Later changes of both directories commit them.
    mk(&fs, a, b"f1", S_IFREG | 0o644);
    mk(&fs, b, b"f2", S_IFREG | 0o644);
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.lookup(a, b"x", false).unwrap().ino, x);
    assert_eq!(fs.lookup(b, b"y", false).unwrap().ino, y);
    fs.unmount().unwrap();
}

/// A punched hole strictly inside an extent of a file with all eight inline extents: the
/// split makes a ninth, so the punch first takes an extent leaf block. Its last partial block
/// then cannot be read: EIO, and the leaf must go back at once. Kept, the file held a block it
/// did not need (statfs one block short, until a commit dropped the unused leaf), and on a
/// disk with no other free block the next allocation said ENOSPC.
#[test]
fn a_punch_that_took_an_extent_leaf_gives_it_back_when_its_edge_read_fails() {
    let (disk, fs, f) = disk_with_file(0);
    // Blocks 0..3 (one extent), then 4, 6, .., 16: eight extents, the most an inode holds
    // without a leaf.
    fs.write(f, 0, &vec![0x11u8; 3 * BLOCK]).unwrap();
    for l in (4..=16).step_by(2) {
        fs.write(f, l * B, &vec![0x11u8; BLOCK]).unwrap();
    }
    let fs = remount(fs, &disk);
    assert_eq!(inode_on_image(&disk, f).extents.len(), 8);
    let before = fs.read(f, 0, 17 * 4096).unwrap();
    // Again: a fresh page cache, so the edge block's read reaches the device.
    let fs = remount(fs, &disk);
    let free = fs.statfs().bfree;
    let mid = fs.bmap(f, 1).unwrap();
    disk.fail_reads(fs.bmap(f, 2).unwrap().unwrap());
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // Bytes 100.. of block 0 (read), all of block 1, the first 100 of block 2 (read, fails).
    assert_eq!(fs.fallocate(f, 100, 2 * B, punch), Err(libc::EIO));
    assert_eq!(
        fs.statfs().bfree,
        free,
        "the failed punch kept its extent leaf"
    );
    assert_eq!(
        fs.bmap(f, 1).unwrap(),
        mid,
        "the failed punch freed block 1"
    );
    assert_eq!(commit_and_fsck(fs, &disk), Vec::<String>::new());
    let fs = mount(&disk);
    assert_eq!(fs.statfs().bfree, free);
    assert_eq!(fs.read(f, 0, 17 * 4096).unwrap(), before);
    fs.unmount().unwrap();
}

/// fallocate whose last FLUSH fails, with FUA commits (no FLUSH of their own). The zeros it
/// wrote to the block it took (a deleted file's) are not durable. It returned EIO with the
/// block still mapped and the inode marked, so the next commit (another file's fsync) mapped
/// the block durably, and after a power cut the file read the deleted file's bytes there. Now
/// the blocks whose zeros are not durable go back: the hole stays a hole. (From a review on
/// 2026-11-28, by reading.)
#[test]
fn fallocate_whose_flush_fails_maps_no_block_whose_zeros_are_not_durable() {
    let disk = FaultyDisk::new(fresh_image(8 << 20));
    let fs = mount(&disk);
    fs.journal_set()
        .set_durability(journal::Durability::FuaWrites);
    let f = mk(&fs, ROOT_INO, b"f", S_IFREG | 0o644);
    let g = mk(&fs, ROOT_INO, b"g", S_IFREG | 0o644);
    // f: block 0 written, block 1 a hole inside the size.
    fs.write(f, 0, &vec![0x11u8; BLOCK]).unwrap();
    let size = SetAttr {
        size: Some(2 * B),
        ..SetAttr::default()
    };
    fs.setattr(f, &size).unwrap();
    let a = mk(&fs, ROOT_INO, b"a", S_IFREG | 0o644);
    fs.write(a, 0, &vec![0xaau8; BLOCK]).unwrap();
    fs.sync_all().unwrap();
    let pa = fs.bmap(a, 0).unwrap().unwrap();
    fs.remove(ROOT_INO, b"a", false).unwrap();
    fs.forget(a, 1);
    // The commit that frees a's block, then one that makes it allocatable.
    fs.sync_all().unwrap();
    fs.sync_all().unwrap();
    let free = fs.statfs().bfree;
    disk.fail_flushes();
    assert_eq!(fs.fallocate(f, B, B, 0), Err(libc::EIO));
    let (mapped, free_after) = (fs.bmap(f, 1).unwrap(), fs.statfs().bfree);
    // Another file's fsync commits whatever is marked (the inode of f with it).
    fs.write(g, 0, b"g").unwrap();
    fs.fsync(g).unwrap();
    // Power cut now.
    let crash = disk.durable();
    drop(fs);
    let rep = fsck_image(&crash).unwrap();
    assert!(rep.clean(), "fsck of the crash image: {:?}", rep.problems);
    let fs = mount(&FaultyDisk::new(crash));
    let got = fs.read(f, B, BLOCK as u32).unwrap();
    assert!(
        got.iter().all(|&b| b == 0),
        "after the failed fallocate, a commit and a power cut, f's block 1 (mapped to {mapped:?}, \
         a's old block {pa}) reads {:#x}: the deleted file's bytes",
        got[0]
    );
    assert_eq!(
        mapped, None,
        "a block whose zeros are not durable stays mapped"
    );
    assert_eq!(free_after, free, "the block went back");
}
