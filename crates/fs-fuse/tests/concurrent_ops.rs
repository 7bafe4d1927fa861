//! Several threads on one `Fs`: creates, writes, truncates, punches, renames, unlinks,
//! xattrs and fsyncs, each thread in a directory of its own and all of them in one shared
//! directory. Every thread's files must hold what its model says, through the file system and
//! after a crash (drop without unmount) and replay; fsck must be clean and statfs must match
//! what the remount counts. `AIOS_FS_OPS_SEED` picks the workload; `AIOS_FS_OPS_PAUSE_US`
//! holds each in-place fsync that long (widening its race window).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::ImageFile;
use fs_fuse::format::{ROOT_INO, S_IFDIR, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr};
use lbio::SimRng;

const ROOT: Caller = Caller { uid: 0, gid: 0 };
const THREADS: u64 = 4;
const ROUNDS: usize = 2000;

/// name -> (ino, content, xattr)
type Model = BTreeMap<Vec<u8>, (u64, Vec<u8>, Option<Vec<u8>>)>;

fn worker(fs: &Fs, t: u64, dir: u64, shared: u64) -> Model {
    let seed: u64 = std::env::var("AIOS_FS_OPS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut rng = SimRng::new(0x1234 + t + seed * 100);
    let mut files: Model = BTreeMap::new();
    let mut next = 0u32;
    for _ in 0..ROUNDS {
        let pick = |rng: &mut SimRng, files: &Model| -> Option<Vec<u8>> {
            if files.is_empty() {
                return None;
            }
            files
                .keys()
                .nth(rng.below(files.len() as u64) as usize)
                .cloned()
        };
        match rng.below(16) {
            0 | 1 => {
                next += 1;
                let name = format!("f{next}").into_bytes();
                let a = fs
                    .mknod(dir, &name, S_IFREG | 0o644, 0, ROOT, None)
                    .unwrap();
                // The kernel's lookup reference, let go: an unlinked file is freed at once.
                fs.forget(a.ino, 1);
                files.insert(name, (a.ino, Vec::new(), None));
            }
            2..=5 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                let off = rng.below(40 << 10) as usize;
                let len = 1 + rng.below(10 << 10) as usize;
                let byte = rng.next_u64() as u8;
                let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                let f = files.get_mut(&k).unwrap();
                assert_eq!(fs.write(f.0, off as u64, &data).unwrap(), len);
                if f.1.len() < off + len {
                    f.1.resize(off + len, 0);
                }
                f.1[off..off + len].copy_from_slice(&data);
            }
            6 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                let f = files.get_mut(&k).unwrap();
                let size = rng.below(50 << 10);
                fs.setattr(
                    f.0,
                    &SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    },
                )
                .unwrap();
                f.1.resize(size as usize, 0);
            }
            7 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                let f = files.get_mut(&k).unwrap();
                let off = rng.below(40 << 10);
                let len = 1 + rng.below(20 << 10);
                fs.fallocate(
                    f.0,
                    off,
                    len,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                )
                .unwrap();
                let end = ((off + len) as usize).min(f.1.len());
                if (off as usize) < end {
                    f.1[off as usize..end].fill(0);
                }
            }
            8 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                next += 1;
                let newname = format!("f{next}").into_bytes();
                fs.rename(dir, &k, dir, &newname, 0).unwrap();
                let f = files.remove(&k).unwrap();
                files.insert(newname, f);
            }
            9 if files.len() > 3 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                fs.remove(dir, &k, false).unwrap();
                files.remove(&k);
            }
            10 => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                let f = files.get_mut(&k).unwrap();
                let v = vec![rng.next_u64() as u8; rng.below(2000) as usize];
                fs.setxattr(f.0, b"user.x", &v, 0).unwrap();
                f.2 = Some(v);
            }
            11 => {
                // The shared directory: names any thread may take.
                let name = format!("s{}", rng.below(8)).into_bytes();
                match rng.below(3) {
                    0 => match fs.mknod(shared, &name, S_IFREG | 0o644, 0, ROOT, None) {
                        Ok(a) => fs.forget(a.ino, 1),
                        Err(libc::EEXIST) => {}
                        Err(e) => panic!("shared create: {e}"),
                    },
                    1 => match fs.remove(shared, &name, false) {
                        Ok(()) | Err(libc::ENOENT) => {}
                        Err(e) => panic!("shared unlink: {e}"),
                    },
                    _ => {
                        let to = format!("s{}", rng.below(8)).into_bytes();
                        match fs.rename(shared, &name, shared, &to, 0) {
                            Ok(()) | Err(libc::ENOENT) => {}
                            Err(e) => panic!("shared rename: {e}"),
                        }
                    }
                }
            }
            12 => fs.sync_all().unwrap(),
            _ => {
                let Some(k) = pick(&mut rng, &files) else {
                    continue;
                };
                fs.fsync_as(files[&k].0, rng.below(2) == 0).unwrap();
            }
        }
    }
    files
}

fn check(fs: &Fs, dir: u64, files: &Model, what: &str) {
    let mut names = Vec::new();
    fs.readdir(dir, 0, |_, _, _, n| {
        names.push(n.to_vec());
        false
    })
    .unwrap();
    names.retain(|n| n != b"." && n != b"..");
    names.sort();
    let want: Vec<Vec<u8>> = files.keys().cloned().collect();
    assert_eq!(names, want, "{what}: entries of {dir}");
    for (name, (ino, content, x)) in files {
        let a = fs.lookup(dir, name, false).unwrap();
        assert_eq!(a.ino, *ino, "{what}");
        assert_eq!(a.size, content.len() as u64, "{what}: size of inode {ino}");
        let got = fs.read(*ino, 0, content.len() as u32 + 1).unwrap();
        if let Some(i) = got.iter().zip(content).position(|(a, b)| a != b) {
            panic!(
                "{what}: inode {ino} byte {i}: {:#x}, not {:#x}",
                got[i], content[i]
            );
        }
        assert_eq!(
            fs.getxattr(*ino, b"user.x").ok(),
            x.clone(),
            "{what}: xattr of {ino}"
        );
    }
}

#[test]
fn threads_racing_on_one_file_system_leave_it_consistent() {
    let image = ImageFile::new("concurrent-ops", 64 << 20);
    let fs = image.open();
    if let Some(us) = std::env::var("AIOS_FS_OPS_PAUSE_US")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        fs_fuse::fs::IN_PLACE_TEST_PAUSE_US.store(us, std::sync::atomic::Ordering::Relaxed);
    }
    let shared = fs
        .mknod(ROOT_INO, b"shared", S_IFDIR | 0o755, 0, ROOT, None)
        .unwrap()
        .ino;
    let dirs: Vec<u64> = (0..THREADS)
        .map(|t| {
            fs.mknod(
                ROOT_INO,
                format!("d{t}").as_bytes(),
                S_IFDIR | 0o755,
                0,
                ROOT,
                None,
            )
            .unwrap()
            .ino
        })
        .collect();
    let models: Vec<Model> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (fs, dirs) = (&fs, &dirs);
                s.spawn(move || worker(fs, t, dirs[t as usize], shared))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (t, m) in models.iter().enumerate() {
        check(&fs, dirs[t], m, "live");
    }
    fs.sync_all().unwrap();
    let sf = fs.statfs();
    drop(fs);
    let fs: Arc<Fs> = image.open();
    let report = fs_fuse::fsck::fsck(&image.0).unwrap();
    assert!(report.clean(), "fsck: {:?}", report.problems);
    for (t, m) in models.iter().enumerate() {
        check(&fs, dirs[t], m, "after a crash and replay");
    }
    let sf2 = fs.statfs();
    assert_eq!((sf.bfree, sf.ffree), (sf2.bfree, sf2.ffree), "statfs");
}
