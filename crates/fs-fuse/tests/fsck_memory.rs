//! What fsck holds in memory (from a review on 2026-11-28): it used to read the whole inode
//! table at once, 16 GiB for a 1 TiB image with the default one inode per 16 KiB, however few
//! inodes were in use, and it kept a map from every block a file owns to its inode (several
//! GiB for a full 1 TiB image). A counting allocator (this test binary's global allocator; the
//! tests take turns, so nothing else allocates meanwhile) measures the most fsck holds at once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use fs_fuse::format::{Superblock, BLOCK, ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, FsOptions};
use fs_fuse::fsck;
use fs_fuse::mkfs::{mkfs, MkfsOptions};

mod common;

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout goes to the system allocator unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) };
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// One test at a time: the counters are the whole process's.
static SERIAL: Mutex<()> = Mutex::new(());

/// Blocks the file of [`fsck_tracks_owned_blocks_in_a_bitmap`] owns.
const OWNED: u64 = 500_000;

/// Removes the test's directory however the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("aiosfs-fsck-mem-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn fsck_reads_the_inode_table_in_bounded_pieces() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("table");
    // 256 MiB (sparse) with an inode per 4 KiB: 65,536 inodes, a 16 MiB inode table.
    let (img, sb) = image(&dir, "big-table.img", 256 << 20, 4096);
    let table = sb.inode_table.count * 4096;
    assert_eq!(table, 16 << 20);
    let base = NOW.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let rep = fsck(&img).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    assert!(rep.clean(), "fsck: {:?}", rep.problems);
    assert_eq!(rep.used_inodes, 1);
    eprintln!("fsck held at most {peak} bytes at once; the inode table is {table} bytes");
    // A 1 MiB piece of the table, the 128 KiB journal area, the bitmaps and the report: well
    // under a quarter of the table.
    assert!(
        peak < (table / 4) as usize,
        "fsck held {peak} bytes at once; the inode table is {table} bytes"
    );
}

/// A sparse image file of `bytes`, made by mkfs with one journal area of 32 blocks and one
/// inode per `bytes_per_inode`.
fn image(dir: &TempDir, name: &str, bytes: u64, bytes_per_inode: u64) -> (PathBuf, Superblock) {
    let img = dir.0.join(name);
    std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
    let sb = mkfs(
        &img,
        &MkfsOptions {
            journals: 1,
            journal_blocks: 32,
            bytes_per_inode,
            force: false,
        },
    )
    .unwrap();
    (img, sb)
}

/// Half a million blocks owned by one file. fsck used to keep a map from every owned block to
/// its inode (tens of bytes a block: several GiB for a full 1 TiB image); it now keeps a bit a
/// block (and a second bitmap only when a block is owned twice).
#[test]
fn fsck_tracks_owned_blocks_in_a_bitmap() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("owned");
    // 2 GiB (sparse): 524,288 blocks; an inode per MiB (a 512 KiB inode table).
    let (img, sb) = image(&dir, "owned.img", 2 << 30, 1 << 20);
    // One block written through the file system, then (unmounted) its extent grown to
    // `OWNED` blocks and those marked in use, as `large_free.rs` does: nothing writes 2 GiB.
    let fs = Fs::open(
        fs_fuse::mount::image_factory(&img),
        FsOptions {
            arena_bytes: 2 << 20,
            cache_bytes: 256 << 10,
            ..FsOptions::default()
        },
    )
    .unwrap()
    .0;
    let caller = Caller { uid: 0, gid: 0 };
    let f = fs
        .mknod(ROOT_INO, b"f", S_IFREG | 0o644, 0, caller, None)
        .unwrap()
        .ino;
    fs.write(f, 0, &vec![0x11u8; BLOCK]).unwrap();
    fs.unmount().unwrap();
    drop(fs);
    common::grow_first_extent(&img, f, OWNED);

    let base = NOW.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let rep = fsck(&img).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - base;
    assert!(rep.clean(), "fsck: {:?}", rep.problems);
    assert_eq!(rep.used_inodes, 2);
    assert_eq!(rep.used_blocks, sb.data.start + 1 + 1 + OWNED);
    // Four bits a block of the image (the block bitmap and the owned-once bitmap take two),
    // plus what does not grow with the blocks owned: at most a 1 MiB piece of the inode table,
    // the 128 KiB journal area, and 256 KiB for the rest.
    let bound = (sb.blocks / 2 + (1 << 20) + 32 * BLOCK as u64 + (256 << 10)) as usize;
    eprintln!(
        "fsck held at most {peak} bytes at once for {OWNED} owned blocks of {}; bound {bound}",
        sb.blocks
    );
    assert!(
        peak < bound,
        "fsck held {peak} bytes at once for {OWNED} owned blocks of {}; the bound is {bound}",
        sb.blocks
    );
}
