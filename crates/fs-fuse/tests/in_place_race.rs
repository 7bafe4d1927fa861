//! One race of an in-place fsync, staged: while fdatasync A writes a block's old value in
//! place, another thread writes a new value, commits it (its own fdatasync, which must commit
//! because A is writing that block), and writes the old value back. When A takes the lock
//! again the block holds the bytes A wrote, yet the device holds the newer value: A must leave
//! the block dirty, or the next fdatasync writes nothing and the old value is lost.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{fresh_image, opts};
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, IN_PLACE_TEST_PAUSE_US};
use fs_fuse::mount::image_factory;

const BLOCK: usize = 4096;

#[test]
fn a_block_committed_and_written_back_meanwhile_stays_dirty() {
    let path =
        std::env::temp_dir().join(format!("aiosfs-in-place-race-{}.img", std::process::id()));
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(path.clone());
    std::fs::write(&path, fresh_image(16 << 20)).unwrap();
    let (fs, _) = Fs::open(image_factory(&path), opts()).unwrap();
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
    let (old, new) = (vec![0xaa; BLOCK], vec![0x55; BLOCK]);
    fs.write(ino, 0, &new).unwrap();
    fs.sync_all().unwrap();
    fs.write(ino, 0, &old).unwrap();

    // A's in-place write, then 300 ms before it takes the lock again.
    IN_PLACE_TEST_PAUSE_US.store(300_000, Ordering::Relaxed);
    let before = fs.stats.fsync_in_place.load(Ordering::Relaxed);
    std::thread::scope(|s| {
        let a = s.spawn(|| fs.fsync_as(ino, true).unwrap());
        // A reads the pause as it starts; its one-block write is over long before 100 ms (if
        // not, the commit below waits for it, and the race is staged all the same).
        std::thread::sleep(Duration::from_millis(100));
        IN_PLACE_TEST_PAUSE_US.store(0, Ordering::Relaxed);
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
    fs.fsync_as(ino, true).unwrap();
    let on_device = fs.read_with(ino, 0, BLOCK as u32, true).unwrap();
    assert!(
        on_device == old,
        "after the last fdatasync the device holds {:#x}, not the last write {:#x}",
        on_device[0],
        old[0]
    );
    drop(fs);
    let (again, _) = Fs::open(image_factory(&path), opts()).unwrap();
    assert!(
        again.read(ino, 0, BLOCK as u32).unwrap() == old,
        "after a remount"
    );
}
