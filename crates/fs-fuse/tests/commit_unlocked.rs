//! A commit made by fsync (or sync) runs its device work with the file system's lock released.
//! These tests stage what can happen meanwhile with a test-only pause between the device's
//! answer and the committing thread taking the lock back (`COMMIT_TEST_PAUSE_US`): other
//! operations must go on, and whatever they change must be neither lost nor undone when the
//! commit is applied. Each ends with a remount (after a drop without unmount, so the journal
//! is replayed) and an fsck.
//!
//! The last test checks a symlink's target after its commit, before a checkpoint writes the
//! journaled block home: `readlink` read the home block and returned zeros there until the
//! commit path was reviewed for this change.
//!
//! The tests share the pause setting, so they take turns.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::ImageFile;
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, FsOptions, SetAttr, COMMIT_TEST_PAUSE_US};

const BLOCK: usize = 4096;
const PAUSE_US: u64 = 500_000;

/// The pause is one setting for the process: one staged window at a time.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn open(image: &ImageFile, opts: FsOptions) -> Arc<Fs> {
    Fs::open(fs_fuse::mount::image_factory(&image.0), opts)
        .unwrap()
        .0
}

fn create(fs: &Fs, name: &[u8]) -> u64 {
    fs.mknod(
        ROOT_INO,
        name,
        S_IFREG | 0o644,
        0,
        Caller { uid: 0, gid: 0 },
        None,
    )
    .unwrap()
    .ino
}

/// Run `during` while thread A's `fsync(ino)` commit is in its window (the device answered,
/// the lock not yet taken back, for 500 ms). Returns whether A was still in its window when
/// `during` returned.
fn in_window(fs: &Arc<Fs>, ino: u64, during: impl FnOnce()) -> bool {
    let before = fs.stats.commits.load(Ordering::Relaxed);
    COMMIT_TEST_PAUSE_US.store(PAUSE_US, Ordering::Relaxed);
    let overlapped = std::thread::scope(|s| {
        let a = s.spawn(|| fs.fsync(ino).unwrap());
        // A takes the pause (setting it back to 0) once the device has answered: from then
        // on it is in its window.
        let t0 = std::time::Instant::now();
        while COMMIT_TEST_PAUSE_US.load(Ordering::Relaxed) != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no commit took the pause"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        during();
        let overlapped = !a.is_finished();
        a.join().unwrap();
        overlapped
    });
    COMMIT_TEST_PAUSE_US.store(0, Ordering::Relaxed);
    assert!(
        fs.stats.commits.load(Ordering::Relaxed) > before,
        "fsync committed"
    );
    overlapped
}

/// Drop without unmounting (the journal is replayed at the next open), check, reopen.
fn crash_and_reopen(fs: Arc<Fs>, image: &ImageFile, opts: FsOptions) -> Arc<Fs> {
    drop(fs);
    let again = open(image, opts);
    let report = fs_fuse::fsck::fsck(&image.0).unwrap();
    assert!(report.clean(), "fsck: {:?}", report.problems);
    again
}

/// `len` bytes of `ino` at `at` all equal `byte`.
fn check(fs: &Fs, ino: u64, at: u64, len: usize, byte: u8, what: &str) {
    let got = fs.read(ino, at, len as u32).unwrap();
    let bad = got.iter().position(|&b| b != byte);
    assert!(
        got.len() == len && bad.is_none(),
        "{what}: inode {ino} at {at}: {} bytes read, byte {bad:?} is {:#x}, not {byte:#x}",
        got.len(),
        bad.map_or(0, |i| got[i])
    );
}

fn both_modes(test: impl Fn(FsOptions)) {
    let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    test(common::opts());
    test(common::opts_one_write());
}

#[test]
fn reads_writes_and_creates_go_on_while_a_commit_is_in_flight() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let (f, g) = (create(&fs, b"f"), create(&fs, b"g"));
        fs.write(g, 0, &[0x11; BLOCK]).unwrap();
        fs.sync_all().unwrap();
        // A new size: the fsync must commit (not write in place).
        fs.write(f, 0, &[0xaa; BLOCK]).unwrap();
        let mut h = 0;
        let overlapped = in_window(&fs, f, || {
            check(&fs, g, 0, BLOCK, 0x11, "g during the commit");
            fs.write(g, BLOCK as u64, &[0x22; BLOCK]).unwrap();
            h = create(&fs, b"h");
            fs.write(h, 0, &[0x33; 100]).unwrap();
            fs.lookup(ROOT_INO, b"f", false).unwrap();
        });
        assert!(
            overlapped,
            "the other operations waited for the commit to end"
        );
        fs.sync_all().unwrap();
        let fs = crash_and_reopen(fs, &image, opts);
        check(&fs, f, 0, BLOCK, 0xaa, "f");
        check(&fs, g, 0, BLOCK, 0x11, "g's first block");
        check(&fs, g, BLOCK as u64, BLOCK, 0x22, "g's second block");
        check(&fs, h, 0, 100, 0x33, "h");
    });
}

/// A block the commit carries is written again meanwhile: it stays dirty (the device has the
/// committed bytes), and the next fsync writes the new ones.
#[test]
fn a_block_written_again_during_its_commit_stays_dirty() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let f = create(&fs, b"f");
        let (x, y) = (vec![0xaa; BLOCK], vec![0x55; BLOCK]);
        fs.write(f, 0, &x).unwrap();
        assert!(in_window(&fs, f, || {
            fs.write(f, 0, &y).unwrap();
            check(&fs, f, 0, BLOCK, 0x55, "f during the commit");
        }));
        check(&fs, f, 0, BLOCK, 0x55, "f after the commit");
        // Without another fsync, a crash leaves the committed bytes.
        let fs = crash_and_reopen(fs, &image, opts.clone());
        check(
            &fs,
            f,
            0,
            BLOCK,
            0xaa,
            "f after a crash: the committed bytes",
        );
        // Again, with the fsync that follows.
        fs.write(f, 0, &x).unwrap();
        fs.sync_all().unwrap();
        fs.write(f, BLOCK as u64, &x).unwrap();
        assert!(in_window(&fs, f, || {
            fs.write(f, 0, &y).unwrap();
        }));
        fs.fsync(f).unwrap();
        let fs = crash_and_reopen(fs, &image, opts);
        check(&fs, f, 0, BLOCK, 0x55, "the last fsync's bytes");
    });
}

/// A block the commit carries is truncated away meanwhile and the file written again: the
/// new block is another one (the freed one stays quarantined), and it is not taken for
/// committed.
#[test]
fn a_file_truncated_and_rewritten_during_its_commit() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let f = create(&fs, b"f");
        let (x, z) = (vec![0xaa; BLOCK], vec![0x77; BLOCK]);
        fs.write(f, 0, &x).unwrap();
        let first = fs.bmap(f, 0).unwrap().expect("mapped");
        let size = |size| SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        assert!(in_window(&fs, f, || {
            fs.setattr(f, &size(0)).unwrap();
            fs.write(f, 0, &z).unwrap();
        }));
        let second = fs.bmap(f, 0).unwrap().expect("mapped");
        assert_ne!(
            first, second,
            "a block freed by a commit in flight was reused"
        );
        fs.fsync(f).unwrap();
        let fs = crash_and_reopen(fs, &image, opts);
        check(&fs, f, 0, BLOCK, 0x77, "f rewritten");
        assert_eq!(fs.getattr(f).unwrap().size, BLOCK as u64);
    });
}

/// Another file's fsync meanwhile waits for the commit in flight, then commits its own; a
/// file unlinked meanwhile stays gone.
#[test]
fn fsyncs_and_unlinks_during_a_commit() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let (f, g) = (create(&fs, b"f"), create(&fs, b"g"));
        let doomed = create(&fs, b"doomed");
        fs.write(doomed, 0, &[0x99; 3 * BLOCK]).unwrap();
        fs.sync_all().unwrap();
        fs.write(f, 0, &[0xaa; BLOCK]).unwrap();
        assert!(in_window(&fs, f, || {
            fs.write(g, 0, &[0xbb; 2 * BLOCK]).unwrap();
            fs.fsync(g).unwrap();
            fs.remove(ROOT_INO, b"doomed", false).unwrap();
        }));
        fs.sync_all().unwrap();
        let fs = crash_and_reopen(fs, &image, opts);
        check(&fs, f, 0, BLOCK, 0xaa, "f");
        check(&fs, g, 0, 2 * BLOCK, 0xbb, "g");
        assert_eq!(
            fs.lookup(ROOT_INO, b"doomed", false).unwrap_err(),
            libc::ENOENT
        );
    });
}

/// A symlink's target is journaled: after its commit, and before a checkpoint writes its
/// block home, `readlink` must still give the target (not the home block's old bytes).
#[test]
fn a_symlink_reads_back_after_its_commit() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let target = b"some/where/else";
        let l = fs
            .mknod(
                ROOT_INO,
                b"l",
                fs_fuse::format::S_IFLNK | 0o777,
                0,
                Caller { uid: 0, gid: 0 },
                Some(target),
            )
            .unwrap()
            .ino;
        assert_eq!(fs.readlink(l).unwrap(), target, "before the commit");
        fs.sync_all().unwrap();
        assert_eq!(fs.readlink(l).unwrap(), target, "after the commit");
        let fs = crash_and_reopen(fs, &image, opts);
        assert_eq!(fs.readlink(l).unwrap(), target, "after a remount");
    });
}

/// A truncate meanwhile cuts a block the commit carries: its zeroed tail must still go with
/// whichever commit makes the new size durable (here another file's fsync), or growing the
/// file after a crash shows the bytes the truncate cut off.
#[test]
fn a_block_truncated_during_its_commit_keeps_its_zeroed_tail_with_the_new_size() {
    both_modes(|opts| {
        let image = ImageFile::new("commit-unlocked", 16 << 20);
        let fs = open(&image, opts.clone());
        let (f, g) = (create(&fs, b"f"), create(&fs, b"g"));
        fs.write(f, 0, &[0x11; BLOCK]).unwrap();
        fs.sync_all().unwrap();
        // Block 0 of f dirty again (not fresh: the file owns it), carried by f's fsync.
        fs.write(f, 0, &[0xaa; BLOCK]).unwrap();
        // A change of the inode: the fsync commits (not in place).
        let mode = SetAttr {
            mode: Some(0o600),
            ..SetAttr::default()
        };
        fs.setattr(f, &mode).unwrap();
        let size = |size| SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        assert!(in_window(&fs, f, || {
            fs.setattr(f, &size(100)).unwrap();
            // Another file's fsync: it applies f's commit, then commits f's new size.
            fs.write(g, 0, &[0x22; BLOCK]).unwrap();
            fs.fsync(g).unwrap();
        }));
        let fs = crash_and_reopen(fs, &image, opts);
        assert_eq!(fs.getattr(f).unwrap().size, 100, "f's committed size");
        check(&fs, f, 0, 100, 0xaa, "f below its size");
        fs.setattr(f, &size(BLOCK as u64)).unwrap();
        check(&fs, f, 100, BLOCK - 100, 0, "f grown again past the cut");
    });
}
