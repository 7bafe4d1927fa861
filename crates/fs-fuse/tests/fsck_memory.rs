//! What fsck holds in memory (from a review on 2026-11-28): it used to read the whole inode
//! table at once, 16 GiB for a 1 TiB image with the default one inode per 16 KiB, however few
//! inodes were in use. A counting allocator (this test binary's global allocator, one test so
//! nothing else allocates meanwhile) measures the most fsck holds at once.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use fs_fuse::fsck;
use fs_fuse::mkfs::{mkfs, MkfsOptions};

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

/// Removes the test's directory however the test ends.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn fsck_reads_the_inode_table_in_bounded_pieces() {
    let dir = TempDir(std::env::temp_dir().join(format!("aiosfs-fsck-mem-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let img = dir.0.join("big-table.img");
    // 256 MiB (sparse) with an inode per 4 KiB: 65,536 inodes, a 16 MiB inode table.
    std::fs::File::create(&img)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let sb = mkfs(
        &img,
        &MkfsOptions {
            journals: 1,
            journal_blocks: 32,
            bytes_per_inode: 4096,
            force: false,
        },
    )
    .unwrap();
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
