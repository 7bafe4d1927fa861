//! Races of an in-place fsync, staged with a test-only pause between its writes and its taking
//! the lock back. In each, when fdatasync A takes the lock again the block holds the bytes A
//! wrote, at the same place, yet the device holds something else: A must leave the block
//! dirty, or the next fdatasync writes nothing and the last write is lost.
//!
//! The two tests share the pause setting, so they take turns.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::ImageFile;
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr, IN_PLACE_TEST_PAUSES, IN_PLACE_TEST_PAUSE_US};

const BLOCK: usize = 4096;

/// The pause is one setting for the process: one staged race at a time.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A fresh file system on a real O_DIRECT image, with an empty file "f" in it.
fn fresh_file() -> (ImageFile, Arc<Fs>, u64) {
    let image = ImageFile::new("in-place-race", 16 << 20);
    let fs = image.open();
    let ino = fs
        .mknod(
            ROOT_INO,
            b"f",
            S_IFREG | 0o644,
            0,
            Caller { uid: 0, gid: 0 },
            None,
        )
        .unwrap()
        .ino;
    (image, fs, ino)
}

/// Wait until an in-place fsync has begun its pause (its writes done, the lock released), then
/// turn the pause off for everyone after it. `before` is `IN_PLACE_TEST_PAUSES` before it
/// started.
fn wait_for_window(before: u64) {
    let t0 = std::time::Instant::now();
    while IN_PLACE_TEST_PAUSES.load(Ordering::SeqCst) == before {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no in-place fsync reached its pause"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    IN_PLACE_TEST_PAUSE_US.store(0, Ordering::Relaxed);
}

/// After the race: the last fdatasync leaves `want` on the device, and a remount reads it.
fn settle_and_check(fs: Arc<Fs>, image: &ImageFile, ino: u64, at: u64, want: &[u8]) {
    fs.fsync_as(ino, true).unwrap();
    let on_device = fs.read_with(ino, at, BLOCK as u32, true).unwrap();
    assert!(
        on_device == want,
        "after the last fdatasync the device holds {:#x}, not the last write {:#x}",
        on_device[0],
        want[0]
    );
    drop(fs);
    let again = image.open();
    assert!(
        again.read(ino, at, BLOCK as u32).unwrap() == want,
        "after a remount"
    );
}

/// Meanwhile another thread writes a new value, commits it (its own fdatasync, which must
/// commit because A is writing that block), and writes the old value back: the device holds
/// the new value.
#[test]
fn a_block_committed_and_written_back_meanwhile_stays_dirty() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let (image, fs, ino) = fresh_file();
    let (old, new) = (vec![0xaa; BLOCK], vec![0x55; BLOCK]);
    fs.write(ino, 0, &new).unwrap();
    fs.sync_all().unwrap();
    fs.write(ino, 0, &old).unwrap();

    // A's in-place write, then 300 ms before it takes the lock again.
    IN_PLACE_TEST_PAUSE_US.store(300_000, Ordering::Relaxed);
    let before = fs.stats.fsync_in_place.load(Ordering::Relaxed);
    let pauses = IN_PLACE_TEST_PAUSES.load(Ordering::SeqCst);
    std::thread::scope(|s| {
        let a = s.spawn(|| fs.fsync_as(ino, true).unwrap());
        wait_for_window(pauses);
        fs.write(ino, 0, &new).unwrap();
        let commits = fs.stats.commits.load(Ordering::Relaxed);
        fs.fsync_as(ino, true).unwrap();
        assert!(
            fs.stats.commits.load(Ordering::Relaxed) > commits,
            "the second fdatasync should have committed (its block was being written in place)"
        );
        fs.write(ino, 0, &old).unwrap();
        a.join().unwrap();
    });
    assert_eq!(
        fs.stats.fsync_in_place.load(Ordering::Relaxed),
        before + 1,
        "A wrote in place"
    );
    settle_and_check(fs, &image, ino, 0, &old);
}

/// Meanwhile another thread truncates the block away, a commit makes its block free again,
/// fallocate takes that same block back (zeros, written without a commit) and the old value is
/// written again: the device holds zeros.
#[test]
fn a_block_freed_and_taken_back_meanwhile_stays_dirty() {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    let (image, fs, ino) = fresh_file();
    let val = vec![0xaa; BLOCK];
    fs.write(ino, 0, &vec![0x11; 2 * BLOCK]).unwrap();
    fs.sync_all().unwrap();
    fs.write(ino, BLOCK as u64, &val).unwrap();
    let phys = |fs: &Fs| fs.bmap(ino, 1).unwrap();
    let p = phys(&fs).expect("block 1 is mapped");

    IN_PLACE_TEST_PAUSE_US.store(300_000, Ordering::Relaxed);
    let before = fs.stats.fsync_in_place.load(Ordering::Relaxed);
    let pauses = IN_PLACE_TEST_PAUSES.load(Ordering::SeqCst);
    std::thread::scope(|s| {
        let a = s.spawn(|| fs.fsync_as(ino, true).unwrap());
        wait_for_window(pauses);
        let size = |size| SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        fs.setattr(ino, &size(BLOCK as u64)).unwrap();
        fs.sync_all().unwrap();
        fs.fallocate(ino, BLOCK as u64, BLOCK as u64, 0).unwrap();
        assert_eq!(phys(&fs), Some(p), "fallocate took the same block back");
        fs.write(ino, BLOCK as u64, &val).unwrap();
        a.join().unwrap();
    });
    assert_eq!(
        fs.stats.fsync_in_place.load(Ordering::Relaxed),
        before + 1,
        "A wrote in place"
    );
    settle_and_check(fs, &image, ino, BLOCK as u64, &val);
}
