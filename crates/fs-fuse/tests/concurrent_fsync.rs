//! fsyncs of different files write their data in place at the same time (the state lock is
//! released during the device's work), and fsyncs of one file by several threads, with writes
//! to it going on meanwhile, may overlap too. Every block must end with its last write: read
//! through the file system, then from the image as the threads left it (no unmount, no final
//! commit), mounted again. The image is a real file written with O_DIRECT, so each write
//! takes the device's time and the threads' writes do overlap; each in-place fsync also waits
//! 2 ms before it takes the lock back, so the others often commit and rewrite its blocks in
//! that window. `tests/in_place_race.rs` stages one such race step by step.

mod common;

use std::sync::Arc;

use common::ImageFile;
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs};
use lbio::SimRng;

const ROOT: Caller = Caller { uid: 0, gid: 0 };
const BLOCK: usize = 4096;
const THREADS: usize = 4;
/// Blocks of each thread's own file, and of the shared file (thread t writes its blocks
/// t, t + THREADS, …).
const BLOCKS: u64 = 16;
const ROUNDS: usize = 1500;

/// What a thread leaves: its own file's last stamp per block, and the last stamp of each of
/// its blocks of the shared file.
/// The two values shared blocks flip between (no thread's stamp: those are below 2^34).
const FLIP: [u64; 2] = [u64::MAX - 1, u64::MAX - 2];

type Outcome = (Vec<u64>, Vec<(u64, u64)>);

/// Block `b`'s bytes for stamp `s`: the stamp in every 8 bytes, the block number in the first.
fn bytes(b: u64, s: u64) -> Vec<u8> {
    let mut v = vec![0u8; BLOCK];
    for (i, c) in v.chunks_mut(8).enumerate() {
        c.copy_from_slice(&(if i == 0 { b } else { s }).to_le_bytes());
    }
    v
}

fn check(fs: &Fs, ino: u64, last: &[u64], what: &str) {
    for (b, &s) in last.iter().enumerate() {
        if s == u64::MAX {
            continue;
        }
        let got = fs
            .read(ino, b as u64 * BLOCK as u64, BLOCK as u32)
            .expect("read");
        let stamp = u64::from_le_bytes(got[8..16].try_into().unwrap());
        assert!(
            got == bytes(b as u64, s),
            "{what}: inode {ino} block {b}: stamp {stamp}, last write {s}"
        );
    }
}

#[test]
fn concurrent_fsyncs_keep_every_last_write() {
    let image = ImageFile::new("concurrent", 32 << 20);
    let fs = image.open();
    // Each in-place fsync waits a little before it takes the lock back, so the others often
    // commit and rewrite its blocks in between.
    fs_fuse::fs::IN_PLACE_TEST_PAUSE_US.store(2000, std::sync::atomic::Ordering::Relaxed);
    let mk = |name: &str| {
        fs.mknod(ROOT_INO, name.as_bytes(), S_IFREG | 0o644, 0, ROOT, None)
            .expect("create")
            .ino
    };
    let shared = mk("shared");
    let own: Vec<u64> = (0..THREADS).map(|t| mk(&format!("own-{t}"))).collect();
    // Every block written and committed once, so later fsyncs find them mapped and can write
    // them in place.
    for &ino in own.iter().chain([&shared]) {
        for b in 0..BLOCKS {
            fs.write(ino, b * BLOCK as u64, &bytes(b, 0)).unwrap();
        }
    }
    fs.sync_all().unwrap();
    let before = fs
        .stats
        .fsync_in_place
        .load(std::sync::atomic::Ordering::Relaxed);

    let results: Vec<Outcome> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, own) = (Arc::clone(&fs), own[t]);
                s.spawn(move || {
                    let mut rng = SimRng::new(0x5eed + t as u64);
                    let mut last_own = vec![0u64; BLOCKS as usize];
                    // Each shared block's last stamp, and the one before it: written back
                    // right after an fsync, it makes a block's contents go A, B, A.
                    let mut hist = (vec![0u64; BLOCKS as usize], vec![0u64; BLOCKS as usize]);
                    // Write shared block `b` with stamp `s`, keeping (last, previous) stamps.
                    let put = |b: u64, s: u64, hist: &mut (Vec<u64>, Vec<u64>)| {
                        fs.write(shared, b * BLOCK as u64, &bytes(b, s)).unwrap();
                        hist.1[b as usize] = hist.0[b as usize];
                        hist.0[b as usize] = s;
                    };
                    for round in 1..=ROUNDS as u64 {
                        let stamp = (t as u64) << 32 | round;
                        let mine = t as u64 + THREADS as u64 * rng.below(BLOCKS / THREADS as u64);
                        match rng.below(6) {
                            0 | 1 => {
                                // One of this thread's blocks of the shared file, fsynced
                                // later: another thread's fsync of the file may be writing an
                                // older copy of it in place meanwhile. Half the time one of
                                // two fixed values, so contents repeat.
                                let s = if rng.chance(1, 2) {
                                    FLIP[rng.below(2) as usize]
                                } else {
                                    stamp
                                };
                                put(mine, s, &mut hist);
                            }
                            2 => {
                                fs.fsync_as(shared, true).unwrap();
                                // Only this thread writes these blocks: each reads back from
                                // the device (O_DIRECT) as its last write, whatever the other
                                // fsyncs did meanwhile.
                                for b in (t as u64..BLOCKS).step_by(THREADS) {
                                    let s = hist.0[b as usize];
                                    if s != 0 {
                                        let got = fs
                                            .read_with(shared, b * BLOCK as u64, BLOCK as u32, true)
                                            .unwrap();
                                        assert!(
                                            got == bytes(b, s),
                                            "round {round}: shared block {b} lost write {s}"
                                        );
                                    }
                                }
                                // A block back to its value before: if this fsync committed
                                // while another thread's in-place write of the older value
                                // was in flight, that write must not count for this one.
                                let before = hist.1[mine as usize];
                                if rng.chance(1, 2) && before != 0 {
                                    put(mine, before, &mut hist);
                                }
                            }
                            _ => {
                                // One or two blocks of its own file, then its fsync.
                                for _ in 0..1 + rng.below(2) {
                                    let b = rng.below(BLOCKS);
                                    fs.write(own, b * BLOCK as u64, &bytes(b, stamp)).unwrap();
                                    last_own[b as usize] = stamp;
                                }
                                // fdatasync: in place whenever the block map is unchanged (an
                                // fsync also needs the coarse clock not to have ticked).
                                fs.fsync_as(own, true).unwrap();
                            }
                        }
                    }
                    fs.fsync_as(shared, true).unwrap();
                    let mine = (0..BLOCKS)
                        .filter(|b| b % THREADS as u64 == t as u64)
                        .map(|b| (b, hist.0[b as usize]))
                        .collect();
                    (last_own, mine)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let in_place = fs
        .stats
        .fsync_in_place
        .load(std::sync::atomic::Ordering::Relaxed)
        - before;
    assert!(
        in_place > (THREADS * ROUNDS / 10) as u64,
        "only {in_place} fsyncs were written in place"
    );
    let mut last_shared = vec![u64::MAX; BLOCKS as usize];
    for (_, mine) in &results {
        for &(b, s) in mine {
            last_shared[b as usize] = s;
        }
    }
    for (t, (last_own, _)) in results.iter().enumerate() {
        check(&fs, own[t], last_own, "through the file system");
    }
    check(&fs, shared, &last_shared, "through the file system");

    // The image as the threads left it, mounted again (the journal replayed): every fsynced
    // write is there.
    drop(fs);
    let again = image.open();
    for (t, (last_own, _)) in results.iter().enumerate() {
        check(&again, own[t], last_own, "after a remount");
    }
    check(&again, shared, &last_shared, "after a remount");
}
