//! Timestamps a program sees change, through `Fs` (the code the FUSE mount runs), from a
//! review on 2026-11-28; each test failed before its fix.

mod common;

use common::fresh_image;
use fs_fuse::format::{ROOT_INO, S_IFDIR, S_IFREG};
use fs_fuse::fs::{Caller, Fs, SetAttr};

const ROOT: Caller = Caller { uid: 0, gid: 0 };
/// A time long past, set first so that any change shows.
const OLD: (i64, u32) = (1_000_000, 0);

fn mk(fs: &Fs, parent: u64, name: &[u8], mode: u32) -> u64 {
    fs.mknod(parent, name, mode, 0, ROOT, None).unwrap().ino
}

fn set_old(fs: &Fs, ino: u64) {
    fs.setattr(
        ino,
        &SetAttr {
            atime: Some(Some(OLD)),
            mtime: Some(Some(OLD)),
            ..SetAttr::default()
        },
    )
    .unwrap();
    assert_eq!(fs.getattr(ino).unwrap().mtime, OLD);
}

/// A punched hole changes the file's bytes: its mtime changes with its ctime, as on ext4 and
/// XFS (rsync and make go by size and mtime; the size stays). It used to keep the old mtime.
#[test]
fn a_punched_hole_changes_mtime() {
    let (_disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let f = mk(&fs, ROOT_INO, b"f", S_IFREG | 0o644);
    fs.write(f, 0, &[1u8; 3 * 4096]).unwrap();
    set_old(&fs, f);
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    fs.fallocate(f, 4096, 4096, mode).unwrap();
    let a = fs.getattr(f).unwrap();
    assert_eq!(a.size, 3 * 4096);
    assert_ne!(a.ctime, OLD);
    assert_ne!(a.mtime, OLD, "punch left the mtime alone");
    assert_eq!(a.mtime, a.ctime);
}

/// `RENAME_EXCHANGE` changes an entry of each directory: both directories' mtimes change, as
/// for any other rename (ext4 sets them). It used to set only their ctimes.
#[test]
fn rename_exchange_changes_both_directories_mtimes() {
    let (_disk, fs) = common::open(fresh_image(8 << 20), 1).unwrap();
    let a = mk(&fs, ROOT_INO, b"a", S_IFDIR | 0o755);
    let b = mk(&fs, ROOT_INO, b"b", S_IFDIR | 0o755);
    let x = mk(&fs, a, b"x", S_IFREG | 0o644);
    let y = mk(&fs, b, b"y", S_IFDIR | 0o755);
    set_old(&fs, a);
    set_old(&fs, b);
    fs.rename(a, b"x", b, b"y", libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs.lookup(a, b"x", false).unwrap().ino, y);
    assert_eq!(fs.lookup(b, b"y", false).unwrap().ino, x);
    for d in [a, b] {
        let t = fs.getattr(d).unwrap();
        assert_ne!(t.ctime, OLD);
        assert_ne!(t.mtime, OLD, "directory {d}: exchange left its mtime alone");
    }
    // Within one directory too.
    let z = mk(&fs, a, b"z", S_IFREG | 0o644);
    set_old(&fs, a);
    fs.rename(a, b"x", a, b"z", libc::RENAME_EXCHANGE).unwrap();
    assert_eq!(fs.lookup(a, b"x", false).unwrap().ino, z);
    assert_ne!(fs.getattr(a).unwrap().mtime, OLD);
}
