//! fsck on blocks owned more than once. fsck tracks owned blocks as a bitmap (it kept a map
//! from every owned block to its inode before); the owners of a block owned twice are found by
//! a second walk of the inodes. These tests check that the problems still name them, as the
//! map did: "block B belongs to inode X and inode Y", one problem each time a block already
//! owned is owned again (by another file, or by the same one).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fs_fuse::format::{clear_bit, Inode, Superblock, BLOCK, INODES_PER_BLOCK, INODE_BYTES};
use fs_fuse::format::{ROOT_INO, S_IFREG};
use fs_fuse::fs::{Caller, Fs, FsOptions};
use fs_fuse::{fsck, mkfs, MkfsOptions};

const B: u64 = BLOCK as u64;
const ROOT: Caller = Caller { uid: 0, gid: 0 };

/// A sparse image file, removed when dropped.
struct Image(PathBuf);

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// An unmounted image holding files named `files`, each of the given blocks (written through
/// the file system); their inode numbers.
fn image_with(tag: &str, files: &[(&str, usize)]) -> (Image, Superblock, Vec<u64>) {
    let img =
        Image(std::env::temp_dir().join(format!("aiosfs-owners-{tag}-{}.img", std::process::id())));
    std::fs::File::create(&img.0)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let sb = mkfs(
        &img.0,
        &MkfsOptions {
            journals: 1,
            journal_blocks: 32,
            bytes_per_inode: 1 << 16,
            force: false,
        },
    )
    .unwrap();
    let fs = Fs::open(
        fs_fuse::mount::image_factory(&img.0),
        FsOptions {
            arena_bytes: 2 << 20,
            cache_bytes: 256 << 10,
            ..FsOptions::default()
        },
    )
    .unwrap()
    .0;
    let mut inos = Vec::new();
    for (name, blocks) in files {
        let f = fs
            .mknod(ROOT_INO, name.as_bytes(), S_IFREG | 0o644, 0, ROOT, None)
            .unwrap()
            .ino;
        fs.write(f, 0, &vec![0x5au8; blocks * BLOCK]).unwrap();
        inos.push(f);
    }
    fs.unmount().unwrap();
    drop(fs);
    let clean = fsck(&img.0).unwrap();
    assert!(
        clean.clean(),
        "the image made is damaged: {:?}",
        clean.problems
    );
    (img, sb, inos)
}

/// Inode `ino` of the unmounted image, changed by `change`.
fn edit_inode(path: &Path, sb: &Superblock, ino: u64, change: impl FnOnce(&mut Inode)) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut blk = vec![0u8; BLOCK];
    let tb = sb.inode_table.start + ino / INODES_PER_BLOCK as u64;
    let at = (ino % INODES_PER_BLOCK as u64) as usize * INODE_BYTES;
    file.read_exact_at(&mut blk, tb * B).unwrap();
    let mut i = Inode::decode(&blk[at..at + INODE_BYTES]).unwrap().unwrap();
    change(&mut i);
    i.encode(&mut blk[at..at + INODE_BYTES]);
    file.write_all_at(&blk, tb * B).unwrap();
}

/// Inode `ino` of the unmounted image.
fn inode(path: &Path, sb: &Superblock, ino: u64) -> Inode {
    let mut out = None;
    edit_inode(path, sb, ino, |i| out = Some(i.clone()));
    out.unwrap()
}

/// Marks block `b` free in the unmounted image's block bitmap.
fn free_block(path: &Path, sb: &Superblock, b: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let at = (sb.block_bitmap.start * B) + b / 8;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).unwrap();
    clear_bit(&mut byte, b % 8);
    file.write_all_at(&byte, at).unwrap();
}

/// The inodes a problem "block {b} belongs to inode X and inode Y" names, for that block.
fn owners_named(p: &str, b: u64) -> Option<(u64, u64)> {
    let rest = p.strip_prefix(&format!("block {b} belongs to inode "))?;
    let (x, y) = rest.split_once(" and inode ")?;
    Some((x.parse().ok()?, y.parse().ok()?))
}

/// A block owned by three files, and a block mapped twice by one file.
#[test]
fn fsck_names_every_owner_of_a_block_owned_twice() {
    let (img, sb, inos) = image_with("three", &[("a", 1), ("b", 1), ("c", 1), ("d", 2)]);
    let (a, b, c, d) = (inos[0], inos[1], inos[2], inos[3]);
    let shared = inode(&img.0, &sb, a).extents[0].physical;
    // b and c map a's block in place of their own, which are freed.
    for f in [b, c] {
        let own = inode(&img.0, &sb, f).extents[0].physical;
        edit_inode(&img.0, &sb, f, |i| i.extents[0].physical = shared);
        free_block(&img.0, &sb, own);
    }
    // d maps its first block at file blocks 0 and 1; its second block is freed.
    let di = inode(&img.0, &sb, d);
    assert_eq!((di.extents.len(), di.extents[0].len), (1, 2));
    let q = di.extents[0].physical;
    edit_inode(&img.0, &sb, d, |i| {
        i.extents[0].len = 1;
        let mut second = i.extents[0];
        second.logical = 1;
        i.extents.push(second);
    });
    free_block(&img.0, &sb, q + 1);

    let r = fsck(&img.0).unwrap();
    assert_eq!(r.problems.len(), 3, "{:?}", r.problems);
    // Owned three times: two problems, naming the three files between them.
    let pairs: Vec<(u64, u64)> = r
        .problems
        .iter()
        .filter_map(|p| owners_named(p, shared))
        .collect();
    assert_eq!(pairs.len(), 2, "{:?}", r.problems);
    let mut named: Vec<u64> = pairs.iter().flat_map(|&(x, y)| [x, y]).collect();
    named.sort_unstable();
    named.dedup();
    assert_eq!(named, vec![a, b, c], "{:?}", r.problems);
    assert!(pairs.iter().all(|&(x, y)| x != y), "{:?}", r.problems);
    assert!(
        r.problems
            .contains(&format!("block {q} belongs to inode {d} and inode {d}")),
        "{:?}",
        r.problems
    );
}

/// 300 blocks owned twice: the report lists 200 problems and counts the rest, as for any
/// other problem.
#[test]
fn fsck_counts_the_owners_of_blocks_past_the_listed_problems() {
    let (img, sb, inos) = image_with("many", &[("a", 300), ("b", 1)]);
    let (a, b) = (inos[0], inos[1]);
    let ai = inode(&img.0, &sb, a);
    assert_eq!(ai.flags, 0, "a's extents are in its inode");
    let blocks: u64 = ai.extents.iter().map(|e| e.len as u64).sum();
    assert_eq!(blocks, 300);
    let own = inode(&img.0, &sb, b).extents[0].physical;
    edit_inode(&img.0, &sb, b, |i| {
        i.extents = ai.extents.clone();
        i.size = ai.size;
    });
    free_block(&img.0, &sb, own);

    let r = fsck(&img.0).unwrap();
    assert_eq!(r.problems.len(), 201, "{:?}", r.problems);
    assert_eq!(r.problems[200], "… and 100 more problems");
    let mut seen = std::collections::HashSet::new();
    for p in &r.problems[..200] {
        let blk: u64 = p
            .strip_prefix("block ")
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{p:?}"));
        assert!(
            ai.extents
                .iter()
                .any(|e| blk >= e.physical && blk < e.physical + e.len as u64),
            "{p:?}"
        );
        let pair = owners_named(p, blk).unwrap_or_else(|| panic!("{p:?}"));
        assert!(pair == (a, b) || pair == (b, a), "{p:?}");
        assert!(seen.insert(blk), "named twice: {p:?}");
    }
}
