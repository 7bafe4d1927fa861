//! Extended attributes, symlinks, ownership and statfs through `Fs` on a SimDisk: sizes at
//! their limits, xattr blocks taken and given back, and what a power cut after an fsync
//! leaves (only the writes made durable: `SimDisk::media`).

mod common;

use common::fresh_image;
use fs_fuse::format::{ROOT_INO, S_IFDIR, S_IFLNK, S_IFREG, XATTR_HEADER};
use fs_fuse::fs::{Caller, Fs, SetAttr};
use fs_fuse::fsck_image;
use lbio::SimDisk;
use std::sync::Arc;

const BLOCK: usize = 4096;
const ROOT: Caller = Caller { uid: 0, gid: 0 };

fn create(fs: &Fs, parent: u64, name: &[u8], mode: u32) -> u64 {
    fs.mknod(parent, name, mode, 0, ROOT, None).unwrap().ino
}

/// Cut the power now; the durable image, checked by fsck, mounted again.
fn power_cut(disk: &SimDisk, fs: Arc<Fs>) -> (SimDisk, Arc<Fs>) {
    disk.cut_power();
    drop(fs);
    let image = disk.media();
    let report = fsck_image(&image).unwrap();
    assert!(report.clean(), "fsck: {:?}", report.problems);
    common::open(image, 7).unwrap()
}

/// Unmount, fsck, mount again.
fn remount(disk: &SimDisk, fs: Arc<Fs>) -> (SimDisk, Arc<Fs>) {
    fs.unmount().unwrap();
    drop(fs);
    let image = disk.view();
    let report = fsck_image(&image).unwrap();
    assert!(report.clean(), "fsck: {:?}", report.problems);
    common::open(image, 8).unwrap()
}

#[test]
fn xattrs_at_their_limit_survive_a_power_cut_after_fsync() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = create(&fs, ROOT_INO, b"f", S_IFREG | 0o644);
    fs.sync_all().unwrap();
    let free0 = fs.statfs().bfree;
    let name = b"user.big";
    let most = BLOCK - XATTR_HEADER - 3 - name.len();
    assert_eq!(
        fs.setxattr(f, name, &vec![7; most + 1], 0),
        Err(libc::ENOSPC)
    );
    fs.setxattr(f, name, &vec![7; most], 0).unwrap();
    assert_eq!(fs.getxattr(f, name).unwrap(), vec![7; most]);
    fs.fsync(f).unwrap();
    assert_eq!(fs.statfs().bfree, free0 - 1, "one xattr block");
    assert_eq!(fs.getattr(f).unwrap().blocks, 8);
    let (disk, fs) = power_cut(&disk, fs);
    assert_eq!(fs.getxattr(f, name).unwrap(), vec![7; most]);
    assert_eq!(fs.listxattr(f).unwrap(), b"user.big\0");
    // Replaced by a smaller one, then a second added, then both removed.
    fs.setxattr(f, name, b"v", libc::XATTR_REPLACE).unwrap();
    fs.setxattr(f, b"user.two", b"", libc::XATTR_CREATE)
        .unwrap();
    assert_eq!(
        fs.setxattr(f, b"user.two", b"x", libc::XATTR_CREATE),
        Err(libc::EEXIST)
    );
    fs.fsync(f).unwrap();
    let (disk, fs) = power_cut(&disk, fs);
    assert_eq!(fs.getxattr(f, name).unwrap(), b"v");
    assert_eq!(fs.getxattr(f, b"user.two").unwrap(), b"");
    fs.removexattr(f, name).unwrap();
    fs.removexattr(f, b"user.two").unwrap();
    assert_eq!(fs.removexattr(f, b"user.two"), Err(libc::ENODATA));
    fs.fsync(f).unwrap();
    assert_eq!(fs.getattr(f).unwrap().blocks, 0);
    let (disk, fs) = power_cut(&disk, fs);
    assert_eq!(fs.listxattr(f).unwrap(), b"");
    assert_eq!(fs.getattr(f).unwrap().blocks, 0);
    assert_eq!(fs.statfs().bfree, free0, "the xattr block was given back");
    let (_disk, fs) = remount(&disk, fs);
    assert_eq!(fs.statfs().bfree, free0);
}

#[test]
fn symlinks_at_the_length_limit_read_back() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 2).unwrap();
    let d = create(&fs, ROOT_INO, b"d", S_IFDIR | 0o755);
    let long: Vec<u8> = (0..BLOCK).map(|i| b'a' + (i % 26) as u8).collect();
    let l = fs
        .mknod(d, b"l", S_IFLNK | 0o777, 0, ROOT, Some(&long))
        .unwrap();
    assert_eq!(l.size, BLOCK as u64);
    let s = fs
        .mknod(d, b"s", S_IFLNK | 0o777, 0, ROOT, Some(b"x"))
        .unwrap();
    assert_eq!(fs.readlink(l.ino).unwrap(), long);
    fs.fsync(d).unwrap();
    assert_eq!(fs.readlink(l.ino).unwrap(), long);
    let (disk, fs) = power_cut(&disk, fs);
    let l2 = fs.lookup(d, b"l", false).unwrap();
    assert_eq!(fs.readlink(l2.ino).unwrap(), long);
    assert_eq!(fs.readlink(s.ino).unwrap(), b"x");
    // Removed and made again over the same blocks.
    fs.remove(d, b"l", false).unwrap();
    fs.sync_all().unwrap();
    let l3 = fs
        .mknod(d, b"l", S_IFLNK | 0o777, 0, ROOT, Some(b"short"))
        .unwrap();
    fs.sync_all().unwrap();
    assert_eq!(fs.readlink(l3.ino).unwrap(), b"short");
    let (_disk, fs) = remount(&disk, fs);
    assert_eq!(fs.readlink(l3.ino).unwrap(), b"short");
}

#[test]
fn writes_truncates_and_chowns_clear_set_id_bits() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 3).unwrap();
    let f = create(&fs, ROOT_INO, b"f", S_IFREG | 0o6755);
    fs.setxattr(f, b"security.capability", b"cap", 0).unwrap();
    fs.setxattr(f, b"user.keep", b"k", 0).unwrap();
    fs.write_as(f, 0, b"x", false).unwrap();
    let a = fs.getattr(f).unwrap();
    assert_eq!(a.mode & 0o7777, 0o6755, "a privileged write keeps the bits");
    assert_eq!(fs.getxattr(f, b"security.capability"), Err(libc::ENODATA));
    fs.write(f, 0, b"y").unwrap();
    assert_eq!(fs.getattr(f).unwrap().mode & 0o7777, 0o755);
    // set-group-ID without group-execute stays (mandatory locking's mark).
    fs.setattr(
        f,
        &SetAttr {
            mode: Some(0o2644),
            ..SetAttr::default()
        },
    )
    .unwrap();
    fs.write(f, 0, b"z").unwrap();
    assert_eq!(fs.getattr(f).unwrap().mode & 0o7777, 0o2644);
    fs.setattr(
        f,
        &SetAttr {
            mode: Some(0o4711),
            ..SetAttr::default()
        },
    )
    .unwrap();
    fs.setattr(
        f,
        &SetAttr {
            uid: Some(5),
            kill_privs: true,
            ..SetAttr::default()
        },
    )
    .unwrap();
    let a = fs.getattr(f).unwrap();
    assert_eq!((a.uid, a.mode & 0o7777), (5, 0o711));
    fs.fsync(f).unwrap();
    let (_disk, fs) = power_cut(&disk, fs);
    let a = fs.getattr(f).unwrap();
    assert_eq!((a.uid, a.mode & 0o7777), (5, 0o711));
    assert_eq!(fs.getxattr(f, b"user.keep").unwrap(), b"k");
}

/// A new file in a new directory, fsynced (the file only): after a power cut it is there by
/// its path, with its bytes.
#[test]
fn a_new_file_in_a_new_directory_is_found_by_its_path_after_its_fsync() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 4).unwrap();
    let a = create(&fs, ROOT_INO, b"a", S_IFDIR | 0o755);
    let b = create(&fs, a, b"b", S_IFDIR | 0o755);
    let f = create(&fs, b, b"f", S_IFREG | 0o644);
    fs.write(f, 0, &[0x5a; 3 * BLOCK + 7]).unwrap();
    fs.fsync(f).unwrap();
    let (_disk, fs) = power_cut(&disk, fs);
    let a = fs.lookup(ROOT_INO, b"a", false).unwrap().ino;
    let b = fs.lookup(a, b"b", false).unwrap().ino;
    let f2 = fs.lookup(b, b"f", false).unwrap();
    assert_eq!(f2.ino, f);
    assert_eq!(
        fs.read(f, 0, 4 * BLOCK as u32).unwrap(),
        vec![0x5a; 3 * BLOCK + 7]
    );
}

/// statfs after many operations equals what a remount counts from the bitmaps.
#[test]
fn statfs_is_exact_after_creates_xattrs_links_and_removes() {
    let (disk, fs) = common::open(fresh_image(8 << 20), 5).unwrap();
    let s0 = fs.statfs();
    let d = create(&fs, ROOT_INO, b"d", S_IFDIR | 0o755);
    let mut inos = Vec::new();
    for i in 0..300u32 {
        let name = format!("file-with-a-long-name-{i:05}");
        let ino = create(&fs, d, name.as_bytes(), S_IFREG | 0o644);
        if i % 3 == 0 {
            fs.write(ino, (i as u64 % 5) * BLOCK as u64, &[1; 100])
                .unwrap();
        }
        if i % 5 == 0 {
            fs.setxattr(ino, b"user.a", &[2; 300], 0).unwrap();
        }
        if i % 7 == 0 {
            fs.mknod(
                d,
                format!("sym-{i}").as_bytes(),
                S_IFLNK | 0o777,
                0,
                ROOT,
                Some(b"t"),
            )
            .unwrap();
        }
        inos.push((name, ino));
    }
    // (A new xattr block is taken by the commit that writes it.)
    fs.sync_all().unwrap();
    let mid = fs.statfs();
    let (disk, fs) = remount(&disk, fs);
    let m = fs.statfs();
    assert_eq!((m.bfree, m.ffree), (mid.bfree, mid.ffree), "after creates");
    for (i, (name, ino)) in inos.iter().enumerate() {
        if i % 2 == 0 {
            fs.remove(d, name.as_bytes(), false).unwrap();
        } else if i % 5 == 0 {
            fs.removexattr(*ino, b"user.a").unwrap();
        }
    }
    for i in (0..300).step_by(7) {
        fs.remove(d, format!("sym-{i}").as_bytes(), false).unwrap();
    }
    fs.sync_all().unwrap();
    let mid = fs.statfs();
    let (disk, fs) = remount(&disk, fs);
    let m = fs.statfs();
    assert_eq!((m.bfree, m.ffree), (mid.bfree, mid.ffree), "after removes");
    for (i, (name, _)) in inos.iter().enumerate() {
        if i % 2 == 1 {
            fs.remove(d, name.as_bytes(), false).unwrap();
        }
    }
    fs.remove(ROOT_INO, b"d", true).unwrap();
    let (_disk, fs) = remount(&disk, fs);
    let m = fs.statfs();
    assert_eq!((m.bfree, m.ffree), (s0.bfree, s0.ffree), "all gone");
}

/// A directory of thousands of entries over many extents (its blocks interleaved with file
/// data, so it needs extent leaves), emptied and filled again, checked through readdir,
/// lookups, a power cut after a directory fsync, and a remount.
#[test]
fn a_directory_of_many_entries_over_extent_leaves() {
    let (disk, fs) = common::open(fresh_image(32 << 20), 9).unwrap();
    let d = create(&fs, ROOT_INO, b"big", S_IFDIR | 0o755);
    let name = |i: u32| format!("{i:0>200}").into_bytes();
    let n = 1200u32;
    for i in 0..n {
        let ino = create(&fs, d, &name(i), S_IFREG | 0o644);
        fs.forget(ino, 1);
        if i % 19 == 0 {
            fs.write(ino, 0, &[i as u8; BLOCK]).unwrap();
        }
    }
    let count = |fs: &Fs| {
        let mut k = 0;
        fs.readdir(d, 0, |_, _, _, _| {
            k += 1;
            false
        })
        .unwrap();
        k
    };
    assert_eq!(count(&fs), n as usize + 2);
    fs.fsync(d).unwrap();
    let (disk, fs) = power_cut(&disk, fs);
    assert_eq!(count(&fs), n as usize + 2);
    for i in (0..n).step_by(3) {
        fs.lookup(d, &name(i), false).unwrap();
        fs.remove(d, &name(i), false).unwrap();
    }
    for i in 0..n / 3 {
        let ino = create(&fs, d, format!("new{i}").as_bytes(), S_IFREG | 0o644);
        fs.forget(ino, 1);
    }
    fs.fsync(d).unwrap();
    let (disk, fs) = power_cut(&disk, fs);
    assert_eq!(count(&fs), n as usize + 2);
    for i in 0..n {
        let r = fs.lookup(d, &name(i), false);
        assert_eq!(r.is_ok(), i % 3 != 0, "{i}");
    }
    for i in 0..n / 3 {
        fs.lookup(d, format!("new{i}").as_bytes(), false).unwrap();
    }
    let (_disk, fs) = remount(&disk, fs);
    assert_eq!(count(&fs), n as usize + 2);
}
