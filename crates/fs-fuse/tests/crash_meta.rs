//! Power cuts (as in `crash_sim.rs`) under a workload of the operations that test leaves out:
//! xattrs set, replaced and removed, symlinks up to a block long, hard links, chmod and chown,
//! utimens, files in subdirectories, directory fsyncs. Every crash image must check clean,
//! mount, and hold each file acknowledged by an fsync (untouched since) with its bytes, its
//! xattrs, mode, owner and mtime; each symlink acknowledged by an fsync of its directory with
//! its target.

mod common;

use common::{factory, fresh_image, opts, opts_one_write, opts_rio};
use fs_fuse::format::{ROOT_INO, S_IFDIR, S_IFLNK, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr};
use fs_fuse::fsck_image;
use lbio::{CrashOptions, SimConfig, SimDisk, SimRng};

const ROOT: Caller = Caller { uid: 0, gid: 0 };

#[derive(Clone, Debug, PartialEq)]
struct Meta {
    content: Vec<u8>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    mode: u32,
    uid: u32,
    mtime: (i64, u32),
}

struct File {
    parent: u64,
    name: Vec<u8>,
    ino: u64,
    now: Meta,
    acked: Option<Meta>,
}

struct Link {
    parent: u64,
    name: Vec<u8>,
    target: Vec<u8>,
    acked: bool,
}

fn workload(disk: &SimDisk, seed: u64, ops: u32, mode: usize) -> (Vec<File>, Vec<Link>, u64) {
    let mut rng = SimRng::new(seed);
    let mut files: Vec<File> = Vec::new();
    let mut links: Vec<Link> = Vec::new();
    let mut acks = 0;
    let o = match mode {
        0 => opts(),
        1 => opts_rio(),
        _ => opts_one_write(),
    };
    let Ok((fs, _)) = Fs::open(factory(disk), o) else {
        assert!(!disk.powered());
        return (files, links, 0);
    };
    let mut dirs = vec![ROOT_INO];
    let mut next = 0u32;
    for _ in 0..ops {
        let r: Result<(), i32> = (|| {
            match rng.below(24) {
                0 | 1 if files.len() < 12 => {
                    next += 1;
                    let parent = dirs[rng.below(dirs.len() as u64) as usize];
                    let name = format!("f{next}").into_bytes();
                    let a = fs.mknod(parent, &name, S_IFREG | 0o644, 0, ROOT, None)?;
                    files.push(File {
                        parent,
                        name,
                        ino: a.ino,
                        now: Meta {
                            content: Vec::new(),
                            xattrs: Vec::new(),
                            mode: a.mode,
                            uid: a.uid,
                            mtime: a.mtime,
                        },
                        acked: None,
                    });
                }
                2 if dirs.len() < 5 => {
                    next += 1;
                    let parent = dirs[rng.below(dirs.len() as u64) as usize];
                    let a = fs.mknod(
                        parent,
                        format!("d{next}").as_bytes(),
                        S_IFDIR | 0o755,
                        0,
                        ROOT,
                        None,
                    )?;
                    dirs.push(a.ino);
                }
                3..=7 if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    let off = rng.below(24 << 10) as usize;
                    let len = 1 + rng.below(8 << 10) as usize;
                    let byte = rng.next_u64() as u8;
                    let data: Vec<u8> = (0..len).map(|i| byte.wrapping_add(i as u8)).collect();
                    fs.write(f.ino, off as u64, &data)?;
                    let c = &mut f.now.content;
                    if c.len() < off + len {
                        c.resize(off + len, 0);
                    }
                    c[off..off + len].copy_from_slice(&data);
                    f.now.xattrs.retain(|(k, _)| k != b"security.capability");
                    let a = fs.getattr(f.ino)?;
                    f.now.mtime = a.mtime;
                    f.now.mode = a.mode;
                    f.acked = None;
                }
                8 | 9 if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    let names: [&[u8]; 3] = [b"user.a", b"user.bb", b"security.capability"];
                    let name = names[rng.below(3) as usize].to_vec();
                    let vlen = rng.below(1500) as usize;
                    let v = vec![rng.next_u64() as u8; vlen];
                    match fs.setxattr(f.ino, &name, &v, 0) {
                        Err(libc::ENOSPC) => return Ok(()),
                        r => r?,
                    }
                    match f.now.xattrs.iter_mut().find(|(k, _)| *k == name) {
                        Some(x) => x.1 = v,
                        None => f.now.xattrs.push((name, v)),
                    }
                    f.acked = None;
                }
                10 if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    if f.now.xattrs.is_empty() {
                        return Ok(());
                    }
                    let i = rng.below(f.now.xattrs.len() as u64) as usize;
                    let (k, _) = f.now.xattrs.remove(i);
                    fs.removexattr(f.ino, &k)?;
                    f.acked = None;
                }
                11 if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    let set = SetAttr {
                        mode: Some(rng.below(0o7777) as u32),
                        uid: Some(rng.below(3) as u32),
                        mtime: Some(Some((
                            rng.below(1 << 30) as i64,
                            rng.below(1_000_000_000) as u32,
                        ))),
                        ..SetAttr::default()
                    };
                    let a = fs.setattr(f.ino, &set)?;
                    (f.now.mode, f.now.uid, f.now.mtime) = (a.mode, a.uid, a.mtime);
                    f.acked = None;
                }
                12 if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    let size = rng.below(30 << 10);
                    let a = fs.setattr(
                        f.ino,
                        &SetAttr {
                            size: Some(size),
                            ..SetAttr::default()
                        },
                    )?;
                    f.now.content.resize(size as usize, 0);
                    (f.now.mode, f.now.mtime) = (a.mode, a.mtime);
                    f.acked = None;
                }
                13 if links.len() < 10 => {
                    next += 1;
                    let parent = dirs[rng.below(dirs.len() as u64) as usize];
                    let len = 1 + rng.below(4096) as usize;
                    let target: Vec<u8> = (0..len)
                        .map(|i| b'a' + ((i + next as usize) % 26) as u8)
                        .collect();
                    let name = format!("l{next}").into_bytes();
                    fs.mknod(parent, &name, S_IFLNK | 0o777, 0, ROOT, Some(&target))?;
                    links.push(Link {
                        parent,
                        name,
                        target,
                        acked: false,
                    });
                }
                14 if links.len() > 2 => {
                    let i = rng.below(links.len() as u64) as usize;
                    fs.remove(links[i].parent, &links[i].name, false)?;
                    links.remove(i);
                }
                15 if !files.is_empty() => {
                    // A hard link elsewhere, then the old name goes: the file moves.
                    let i = rng.below(files.len() as u64) as usize;
                    next += 1;
                    let parent = dirs[rng.below(dirs.len() as u64) as usize];
                    let name = format!("h{next}").into_bytes();
                    fs.link(files[i].ino, parent, &name)?;
                    fs.forget(files[i].ino, 1);
                    let f = &mut files[i];
                    fs.remove(f.parent, &f.name, false)?;
                    (f.parent, f.name) = (parent, name);
                    f.acked = None;
                }
                16 if files.len() > 4 => {
                    let i = rng.below(files.len() as u64) as usize;
                    fs.remove(files[i].parent, &files[i].name, false)?;
                    fs.forget(files[i].ino, 1);
                    files.remove(i);
                }
                17 => {
                    let d = dirs[rng.below(dirs.len() as u64) as usize];
                    fs.fsync(d)?;
                    for l in links.iter_mut().filter(|l| l.parent == d) {
                        l.acked = true;
                    }
                    acks += 1;
                }
                _ if !files.is_empty() => {
                    let i = rng.below(files.len() as u64) as usize;
                    let f = &mut files[i];
                    fs.fsync(f.ino)?;
                    f.acked = Some(f.now.clone());
                    acks += 1;
                }
                _ => {}
            }
            Ok(())
        })();
        if let Err(e) = r {
            assert!(
                !disk.powered(),
                "an operation failed with the power on: errno {e}"
            );
            break;
        }
    }
    (files, links, acks)
}

#[test]
fn power_cuts_under_metadata_load() {
    let cuts: u64 = std::env::var("AIOS_FS_META_CUTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let per_cut = 8;
    let seed0: u64 = std::env::var("AIOS_FS_META_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x3e7a);
    let base = fresh_image(4 << 20);
    let bytes = base.len() as u64;
    let totals: Vec<u64> = (0..3)
        .map(|mode| {
            let disk = SimDisk::from_image(SimConfig::new(bytes, seed0), base.clone()).unwrap();
            let (_, _, acks) = workload(&disk, seed0, 300, mode);
            assert!(acks > 20);
            disk.started()
        })
        .collect();
    let mut rng = SimRng::new(seed0 ^ 0x77);
    let mut checked = 0;
    for cut in 0..cuts {
        let mode = cut as usize % 3;
        let (seed, at) = (rng.next_u64(), 1 + rng.below(totals[mode]));
        let mut cfg = SimConfig::new(bytes, seed);
        cfg.power_cut_after = Some(at);
        let disk = SimDisk::from_image(cfg, base.clone()).unwrap();
        let (files, links, _) = workload(&disk, seed0, 300, mode);
        disk.cut_power();
        for k in 0..per_cut {
            let image = disk.crash_image(CrashOptions {
                torn: k % 2 == 0,
                bit_flips: 0,
            });
            let ctx = format!("cut {cut} (mode {mode}, request {at}, seed {seed}), image {k}");
            let report = fsck_image(&image).unwrap();
            assert!(report.clean(), "{ctx}: fsck: {:?}", report.problems);
            let (_d, fs) =
                common::open(image, seed ^ k).unwrap_or_else(|e| panic!("{ctx}: mount: {e}"));
            for f in &files {
                let Some(want) = &f.acked else { continue };
                let a = fs.lookup(f.parent, &f.name, false).unwrap_or_else(|e| {
                    panic!("{ctx}: {:?} missing: {e}", String::from_utf8_lossy(&f.name))
                });
                assert_eq!(a.ino, f.ino, "{ctx}");
                let mut x = Vec::new();
                for n in fs
                    .listxattr(f.ino)
                    .unwrap()
                    .split(|&c| c == 0)
                    .filter(|n| !n.is_empty())
                {
                    x.push((n.to_vec(), fs.getxattr(f.ino, n).unwrap()));
                }
                let got = Meta {
                    content: fs.read(f.ino, 0, want.content.len() as u32 + 1).unwrap(),
                    xattrs: x,
                    mode: a.mode,
                    uid: a.uid,
                    mtime: a.mtime,
                };
                let mut w = want.clone();
                w.xattrs.sort();
                let mut g = got;
                g.xattrs.sort();
                if g != w {
                    panic!(
                        "{ctx}: inode {}: content ok {}, xattrs ok {}, mode {:o}/{:o}, uid {}/{}, mtime {:?}/{:?}",
                        f.ino,
                        g.content == w.content,
                        g.xattrs == w.xattrs,
                        g.mode, w.mode, g.uid, w.uid, g.mtime, w.mtime
                    );
                }
                checked += 1;
            }
            for l in links.iter().filter(|l| l.acked) {
                let a = fs.lookup(l.parent, &l.name, false).unwrap_or_else(|e| {
                    panic!(
                        "{ctx}: symlink {:?} missing: {e}",
                        String::from_utf8_lossy(&l.name)
                    )
                });
                assert_eq!(
                    fs.readlink(a.ino).unwrap(),
                    l.target,
                    "{ctx}: symlink target"
                );
            }
        }
    }
    println!("{checked} files checked");
    assert!(checked > 0);
}
