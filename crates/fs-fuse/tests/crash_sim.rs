//! Power cuts under an fsync-heavy aiosfs workload on a SimDisk (no FUSE): the file system's
//! own code paths (`Fs`), a device without power-loss protection, the power cut at a random
//! request, then many crash images per cut (any subset of the writes that were not durable,
//! torn at sector boundaries). Every image must check clean with fsck (as the journal's replay
//! leaves it), mount, and hold every file exactly as its last acknowledged fsync or fdatasync (half
//! of them; those files are found by inode, fdatasync not covering the name) left it when
//! nothing touched it since.
//!
//! The cuts take the commit modes in turn: overlapped; Rio-ordered (`FsOptions::rio`: data,
//! journal and commit block sent together, ordered through the journal area's attribute log,
//! which is a block log on the same SimDisk and so part of every crash image); one-write
//! (`CommitMode::OneWrite`: data journaled too, everything in one write, a torn commit told by
//! its checksum).
//!
//! `AIOS_FS_SIM_CUTS` (default 400) × `AIOS_FS_SIM_IMAGES` (default 25) crash states;
//! `AIOS_FS_SIM_SEED` replays one schedule.

mod common;

use common::{factory, fresh_image, opts, opts_one_write, opts_rio};
use fs_fuse::format::{ROOT_INO, S_IFDIR, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr};
use fs_fuse::fsck_image;
use lbio::{CrashOptions, SimConfig, SimDisk, SimRng};

const ROOT: Caller = Caller { uid: 0, gid: 0 };

struct File {
    name: Vec<u8>,
    ino: u64,
    content: Vec<u8>,
    /// Content at the last acknowledged fsync, if nothing changed the file since.
    acked: Option<Vec<u8>>,
    /// That acknowledgement came from fdatasync, which makes the data durable but not the
    /// file's name (as on ext4): it is checked through the inode rather than the name.
    by_ino: bool,
}

/// Run the workload until it ends or the power goes; the files whose acknowledged content must
/// survive.
/// The commit modes the cuts take in turn.
const MODES: [&str; 3] = ["overlapped", "Rio-ordered", "one-write"];

fn workload(disk: &SimDisk, seed: u64, ops: u32, mode: usize) -> (Vec<File>, u64) {
    let mut rng = SimRng::new(seed);
    let mut files: Vec<File> = Vec::new();
    let mut acks = 0;
    let o = match mode {
        0 => opts(),
        1 => opts_rio(),
        _ => opts_one_write(),
    };
    let fs = match Fs::open(factory(disk), o) {
        Ok((fs, _)) => fs,
        Err(e) => {
            // Only a power cut early enough to land in the mount itself may stop it.
            assert!(
                !disk.powered(),
                "mounting failed with the power on ({}, seed {seed}, after {} requests): {e}",
                MODES[mode],
                disk.started()
            );
            return (files, 0);
        }
    };
    let mut next_name = 0u32;
    for _ in 0..ops {
        let r: Result<(), i32> = (|| {
            match rng.below(20) {
                0..=1 if files.len() < 12 => {
                    next_name += 1;
                    let name = format!("f{next_name}").into_bytes();
                    let a = fs.mknod(ROOT_INO, &name, S_IFREG | 0o644, 0, ROOT, None)?;
                    files.push(File {
                        name,
                        ino: a.ino,
                        content: Vec::new(),
                        acked: None,
                        by_ino: false,
                    });
                }
                2..=8 if !files.is_empty() => {
                    let f = rng.below(files.len() as u64) as usize;
                    let off = rng.below(48 << 10) as usize;
                    let len = 1 + rng.below(12 << 10) as usize;
                    let byte = rng.next_u64() as u8;
                    let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                    let n = fs.write(files[f].ino, off as u64, &data)?;
                    assert_eq!(n, len);
                    let c = &mut files[f].content;
                    if c.len() < off + len {
                        c.resize(off + len, 0);
                    }
                    c[off..off + len].copy_from_slice(&data);
                    files[f].acked = None;
                }
                9 if !files.is_empty() => {
                    let f = rng.below(files.len() as u64) as usize;
                    let size = rng.below(60 << 10);
                    fs.setattr(
                        files[f].ino,
                        &SetAttr {
                            size: Some(size),
                            ..SetAttr::default()
                        },
                    )?;
                    files[f].content.resize(size as usize, 0);
                    files[f].acked = None;
                }
                10 if !files.is_empty() => {
                    // Punch a hole.
                    let f = rng.below(files.len() as u64) as usize;
                    let off = rng.below(40 << 10);
                    let len = 1 + rng.below(20 << 10);
                    fs.fallocate(
                        files[f].ino,
                        off,
                        len,
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    )?;
                    let c = &mut files[f].content;
                    let end = ((off + len) as usize).min(c.len());
                    if (off as usize) < end {
                        c[off as usize..end].fill(0);
                    }
                    files[f].acked = None;
                }
                11 if files.len() > 1 => {
                    // Rename, sometimes over another file.
                    let f = rng.below(files.len() as u64) as usize;
                    let newname = if rng.below(3) == 0 {
                        files[rng.below(files.len() as u64) as usize].name.clone()
                    } else {
                        next_name += 1;
                        format!("f{next_name}").into_bytes()
                    };
                    if newname != files[f].name {
                        fs.rename(ROOT_INO, &files[f].name.clone(), ROOT_INO, &newname, 0)?;
                        let ino = files[f].ino;
                        files.retain(|x| x.name != newname);
                        let x = files.iter_mut().find(|x| x.ino == ino).expect("renamed");
                        x.name = newname;
                        x.acked = None;
                    }
                }
                12 if files.len() > 3 => {
                    let f = rng.below(files.len() as u64) as usize;
                    fs.remove(ROOT_INO, &files[f].name, false)?;
                    files.remove(f);
                }
                13 => {
                    let name = format!("d{}", rng.below(4)).into_bytes();
                    match fs.mknod(ROOT_INO, &name, S_IFDIR | 0o755, 0, ROOT, None) {
                        Err(libc::EEXIST) => fs.remove(ROOT_INO, &name, true)?,
                        r => {
                            r?;
                        }
                    }
                }
                _ if !files.is_empty() => {
                    let f = rng.below(files.len() as u64) as usize;
                    let datasync = rng.below(2) == 0;
                    fs.fsync_as(files[f].ino, datasync)?;
                    files[f].acked = Some(files[f].content.clone());
                    files[f].by_ino = datasync;
                    acks += 1;
                }
                _ => {}
            }
            Ok(())
        })();
        if r.is_err() {
            assert!(
                !disk.powered(),
                "an operation failed with the power on: errno {r:?}"
            );
            break;
        }
    }
    (files, acks)
}

#[test]
fn power_cuts_under_fsync_load() {
    // 400 cuts × 25 images = 10,000 states in a release build; a test build (cargo test
    // --workspace) runs 20 cuts, and the test command runs the full count in it with
    // AIOS_FS_SIM_CUTS=400 (the crates it exercises are optimized there, see Cargo.toml).
    let default_cuts = if cfg!(debug_assertions) { 20 } else { 400 };
    let cuts: u64 = std::env::var("AIOS_FS_SIM_CUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_cuts);
    let per_cut: u64 = std::env::var("AIOS_FS_SIM_IMAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(25);
    let seed0: u64 = std::env::var("AIOS_FS_SIM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    // A fresh 4 MiB aiosfs, made by mkfs on a file and loaded as the SimDisk's media.
    let base = fresh_image(4 << 20);
    let bytes = base.len() as u64;

    // One uncut run per commit mode: how many requests the workload makes.
    let totals: Vec<u64> = (0..MODES.len())
        .map(|mode| {
            let disk = SimDisk::from_image(SimConfig::new(bytes, seed0), base.clone()).unwrap();
            let (_, acks_full) = workload(&disk, seed0, 300, mode);
            assert!(
                acks_full > 20,
                "the workload acknowledged only {acks_full} fsyncs ({})",
                MODES[mode]
            );
            disk.started()
        })
        .collect();

    // Cuts split over two threads (each its own engines); cut i uses seed i of the schedule and
    // commit mode i mod 3.
    let mut rng = SimRng::new(seed0 ^ 0xabcdef);
    let schedule: Vec<(u64, u64, usize)> = (0..cuts)
        .map(|i| {
            let mode = i as usize % MODES.len();
            (rng.next_u64(), 1 + rng.below(totals[mode]), mode)
        })
        .collect();
    let t0 = std::time::Instant::now();
    let threads = 2;
    let results: Vec<(u64, u64, u64)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|w| {
                let (schedule, base, totals) = (&schedule, &base, &totals);
                s.spawn(move || {
                    let (mut states, mut checked_files, mut acked) = (0u64, 0u64, 0u64);
                    for (cut, &(seed, at, mode)) in schedule.iter().enumerate().skip(w).step_by(threads) {
                        let mut cfg = SimConfig::new(bytes, seed);
                        cfg.power_cut_after = Some(at);
                        let disk = SimDisk::from_image(cfg, base.clone()).unwrap();
                        let (files, acks) = workload(&disk, seed0, 300, mode);
                        let total = totals[mode];
                        acked += acks;
                        disk.cut_power();
                        for k in 0..per_cut {
                            let image = disk.crash_image(CrashOptions {
                                torn: k % 2 == 0,
                                bit_flips: 0,
                            });
                            let mode = MODES[mode];
                            let ctx = format!(
                                "cut {cut} ({mode}, request {at} of {total}, seed {seed}), image {k}"
                            );
                            let report = fsck_image(&image)
                                .unwrap_or_else(|e| panic!("{ctx}: fsck refused: {e}"));
                            assert!(report.clean(), "{ctx}: fsck: {:?}", report.problems);
                            let (_d, fs) = common::open(image, seed ^ k)
                                .unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
                            for f in &files {
                                let Some(want) = &f.acked else { continue };
                                let found = if f.by_ino {
                                    fs.getattr(f.ino)
                                } else {
                                    fs.lookup(ROOT_INO, &f.name, false)
                                };
                                let a = found.unwrap_or_else(|e| {
                                    panic!(
                                        "{ctx}: {:?} (inode {}, fsynced) is missing: errno {e}",
                                        String::from_utf8_lossy(&f.name),
                                        f.ino
                                    )
                                });
                                assert_eq!(
                                    a.size,
                                    want.len() as u64,
                                    "{ctx}: size of {:?}",
                                    String::from_utf8_lossy(&f.name)
                                );
                                let got = fs.read(a.ino, 0, want.len() as u32 + 1).unwrap();
                                assert!(
                                    got == *want,
                                    "{ctx}: contents of {:?} differ from its acknowledged fsync",
                                    String::from_utf8_lossy(&f.name)
                                );
                                checked_files += 1;
                            }
                            states += 1;
                        }
                    }
                    (states, checked_files, acked)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let states: u64 = results.iter().map(|r| r.0).sum();
    let checked_files: u64 = results.iter().map(|r| r.1).sum();
    let acked: u64 = results.iter().map(|r| r.2).sum();
    let rio_cuts = schedule.iter().filter(|c| c.2 == 1).count();
    let one_write_cuts = schedule.iter().filter(|c| c.2 == 2).count();
    println!(
        "{states} crash states ({cuts} power cuts × {per_cut} images; {rio_cuts} cuts Rio-ordered, {one_write_cuts} one-write) checked in {:.1} s: fsck clean, mounted, {checked_files} fsynced files intact ({acked} fsyncs acknowledged before the cuts); 0 violations",
        t0.elapsed().as_secs_f64()
    );
    // Each cut falls anywhere in a workload that acknowledges dozens of fsyncs, so acknowledged
    // files must have been found and compared (a single cut may come before the first fsync;
    // ten or more cannot all).
    if cuts >= 10 && per_cut > 0 {
        assert!(
            checked_files > 0,
            "no fsynced file was checked across {cuts} cuts ({acked} fsyncs acknowledged)"
        );
    }
}
