//! mkfs makes an image fsck finds clean; fsck names damage and never panics on any bytes.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fs_fuse::format::{Superblock, BLOCK, INODE_BYTES, ROOT_INO};
use fs_fuse::{fsck, mkfs, FsError, MkfsOptions};

/// An image file on the root file system (ext4: O_DIRECT works), removed when dropped.
struct Image(PathBuf);

impl Image {
    fn new(name: &str, bytes: u64) -> Image {
        let p = PathBuf::from(format!(
            "/var/tmp/aiosfs-test-{}-{name}.img",
            std::process::id()
        ));
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(bytes).unwrap();
        Image(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    fn poke(&self, byte: u64, xor: u8) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.0)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, byte).unwrap();
        b[0] ^= xor;
        f.write_all_at(&b, byte).unwrap();
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn small() -> MkfsOptions {
    MkfsOptions {
        journals: 2,
        journal_blocks: 64,
        bytes_per_inode: 16384,
        force: false,
    }
}

fn made(name: &str) -> (Image, Superblock) {
    let img = Image::new(name, 16 << 20);
    let sb = mkfs(img.path(), &small()).unwrap();
    (img, sb)
}

#[test]
fn a_fresh_image_is_clean() {
    let (img, sb) = made("fresh");
    assert_eq!(sb.blocks, 4096);
    assert_eq!(sb.journal_areas, 2);
    let r = fsck(img.path()).unwrap();
    assert!(r.clean(), "{:?}", r.problems);
    assert_eq!((r.directories, r.files, r.used_inodes), (1, 0, 1));
    assert_eq!(
        r.used_blocks,
        sb.data.start + 2,
        "metadata, root block, backup"
    );
    assert!(r.notes.is_empty(), "{:?}", r.notes);
    // Version 2: an attribute log of RIO_LOG_BLOCKS per area between journal and data.
    assert_eq!(sb.version, 2);
    assert_eq!(sb.rio_logs.start, sb.journal_start + 2 * sb.journal_blocks);
    assert_eq!(sb.rio_logs.count, 2 * fs_fuse::format::RIO_LOG_BLOCKS);
    assert_eq!(sb.data.start, sb.rio_logs.end());
}

#[test]
fn a_damaged_attribute_log_is_named_and_rio_needs_logs() {
    let (img, sb) = made("riolog");
    // Both header copies of area 1's log (the second copy starts 576 bytes in).
    let (at, _) = sb.rio_log(1).unwrap();
    img.poke(at + 8, 0x40);
    img.poke(at + 576 + 8, 0x40);
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("attribute log of journal area 1")),
        "{:?}",
        r.problems
    );

    // More areas than a log has streams: no logs, and a Rio mount says why.
    let many = Image::new("riomany", 16 << 20);
    let sb = mkfs(
        many.path(),
        &MkfsOptions {
            journals: 65,
            journal_blocks: 32,
            ..small()
        },
    )
    .unwrap();
    assert_eq!(sb.rio_logs.count, 0);
    assert!(sb.rio_log(0).is_none());
    assert!(fsck(many.path()).unwrap().clean());
    let factory = fs_fuse::mount::image_factory(many.path());
    let opts = fs_fuse::FsOptions {
        rio: true,
        arena_bytes: 2 << 20,
        ..fs_fuse::FsOptions::default()
    };
    let e = fs_fuse::Fs::open(factory.clone(), opts.clone())
        .err()
        .expect("a Rio mount of an image without logs");
    assert!(e.to_string().contains("no Rio attribute logs"), "{e}");
    // The same image opens with the overlapped commit.
    assert!(fs_fuse::Fs::open(factory, fs_fuse::FsOptions { rio: false, ..opts }).is_ok());
}

#[test]
fn mkfs_refuses_to_replace_a_file_system_unless_forced() {
    let (img, sb) = made("again");
    let e = mkfs(img.path(), &small()).unwrap_err();
    assert!(e.to_string().contains("already holds an aiosfs"), "{e}");
    assert_eq!(
        fs_fuse::read_superblock(img.path()).unwrap().uuid,
        sb.uuid,
        "unchanged"
    );
    let sb2 = mkfs(
        img.path(),
        &MkfsOptions {
            force: true,
            ..small()
        },
    )
    .unwrap();
    assert_ne!(sb2.uuid, sb.uuid);
}

#[test]
fn too_small_and_foreign_images_are_refused_with_reasons() {
    let img = Image::new("tiny", 64 << 10);
    let e = mkfs(img.path(), &small()).unwrap_err();
    assert!(matches!(e, FsError::TooSmall { .. }), "{e}");
    let zeros = Image::new("zeros", 1 << 20);
    assert!(matches!(fsck(zeros.path()), Err(FsError::Foreign(_))));
    let junk = Image::new("junk", 1 << 20);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(junk.path())
        .unwrap();
    let bytes: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    f.write_all_at(&bytes, 0).unwrap();
    assert!(matches!(fsck(junk.path()), Err(FsError::Foreign(_))));
}

#[test]
fn damage_is_named() {
    // The primary superblock: the backup is used, and the damage reported.
    let (img, sb) = made("sb");
    img.poke(20, 0x40);
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("primary superblock is damaged")),
        "{:?}",
        r.problems
    );
    assert_eq!(r.superblock.uuid, sb.uuid);

    // Both superblocks: nothing to go on.
    img.poke((sb.blocks - 1) * BLOCK as u64 + 20, 0x40);
    assert!(matches!(fsck(img.path()), Err(FsError::Damaged(_))));

    // The root inode.
    let (img, sb) = made("root");
    img.poke(
        sb.inode_table.start * BLOCK as u64 + ROOT_INO * INODE_BYTES as u64 + 17,
        1,
    );
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("inode 1: checksum mismatch")),
        "{:?}",
        r.problems
    );

    // The root directory's block.
    let (img, sb) = made("dir");
    img.poke(sb.data.start * BLOCK as u64 + 30, 0x10);
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems.iter().any(|p| p.contains("directory inode 1")),
        "{:?}",
        r.problems
    );

    // A data block marked in use that no file owns.
    let (img, sb) = made("leak");
    let b = sb.data.start + 100;
    img.poke(sb.block_bitmap.start * BLOCK as u64 + b / 8, 1 << (b % 8));
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains(&format!("block {b} is marked in use"))),
        "{:?}",
        r.problems
    );

    // An inode marked in use that holds nothing.
    let (img, sb) = made("ghost");
    img.poke(sb.inode_bitmap.start * BLOCK as u64, 1 << 5);
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems
            .iter()
            .any(|p| p.contains("inode 5 is marked in use but empty")),
        "{:?}",
        r.problems
    );

    // A journal area's superblock.
    let (img, sb) = made("journal");
    let (off, _) = sb.journal_area(1);
    img.poke(off + 8, 0xff);
    let r = fsck(img.path()).unwrap();
    assert!(
        r.problems.iter().any(|p| p.contains("journal area 1")),
        "{:?}",
        r.problems
    );
}

#[test]
fn fsck_never_panics_on_corrupted_metadata() {
    let (img, sb) = made("fuzz");
    let clean = std::fs::read(img.path()).unwrap();
    let meta_end = (sb.data.start + 1) * BLOCK as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(img.path())
        .unwrap();
    let mut outcomes = [0u32; 3];
    for round in 0..300 {
        f.write_all_at(&clean, 0).unwrap();
        let flips = 1 + next() % 8;
        for _ in 0..flips {
            // Mostly the structures that matter: superblocks, bitmaps, the first inode-table
            // block, the root directory; sometimes anywhere in the metadata.
            let byte = match next() % 5 {
                0 => next() % BLOCK as u64,
                1 => (sb.blocks - 1) * BLOCK as u64 + next() % BLOCK as u64,
                2 => sb.inode_table.start * BLOCK as u64 + next() % BLOCK as u64,
                3 => sb.data.start * BLOCK as u64 + next() % BLOCK as u64,
                _ => next() % meta_end,
            };
            let mut b = [0u8];
            use std::os::unix::fs::FileExt as _;
            let r = std::fs::File::open(img.path()).unwrap();
            r.read_exact_at(&mut b, byte).unwrap();
            b[0] ^= 1 << (next() % 8);
            f.write_all_at(&b, byte).unwrap();
        }
        let got = std::panic::catch_unwind(|| fsck(img.path()));
        match got {
            Err(_) => panic!("fsck panicked in round {round}"),
            Ok(Err(e)) => {
                if std::env::var_os("AIOS_FSCK_FUZZ_VERBOSE").is_some() {
                    println!("round {round}: {e}");
                }
                outcomes[0] += 1
            }
            Ok(Ok(r)) if r.clean() => outcomes[1] += 1,
            Ok(Ok(_)) => outcomes[2] += 1,
        }
    }
    println!(
        "refused {}, clean {}, damage reported {}",
        outcomes[0], outcomes[1], outcomes[2]
    );
    assert!(
        outcomes[2] > 100,
        "most corruptions are found: {outcomes:?}"
    );
}

/// The size a too-small refusal names is the size that works: the message used to say the
/// metadata needs `data start + 2` blocks while the check wanted 16 more, so an image of that
/// many blocks was refused saying it needed fewer blocks than it had.
#[test]
fn a_too_small_refusal_names_the_size_that_fits() {
    let jb = fs_fuse::format::MIN_JOURNAL_BLOCKS;
    for blocks in 8u64..300 {
        let why = match Superblock::layout(blocks * BLOCK as u64, 1, jb, 16384) {
            Ok(_) => continue,
            Err(FsError::TooSmall { why, .. }) => why,
            Err(e) => panic!("{blocks} blocks: {e}"),
        };
        let need: u64 = why
            .split("need ")
            .nth(1)
            .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no size in {why:?}"));
        assert!(
            need > blocks,
            "{blocks} blocks refused, saying {need} are needed: {why}"
        );
        assert!(
            Superblock::layout(need * BLOCK as u64, 1, jb, 16384).is_ok(),
            "{need} blocks, named as enough, refused"
        );
    }
}

/// Journal sizes the superblock check refuses, or whose sum overflows, are refused by the
/// layout itself (with words, not a panic or a layout its own check calls damaged).
#[test]
fn layout_refuses_journal_sizes_it_cannot_hold() {
    for (journals, jb) in [(2, u64::MAX / 2), (256, u64::MAX / 200), (1, 0), (1, 7)] {
        let r = std::panic::catch_unwind(|| Superblock::layout(64 << 20, journals, jb, 16384));
        match r.unwrap_or_else(|_| panic!("layout panicked on {journals} areas of {jb} blocks")) {
            Err(_) => {}
            Ok(sb) => {
                let mut b = vec![0u8; BLOCK];
                sb.encode(&mut b);
                Superblock::decode(&b, sb.blocks)
                    .unwrap_or_else(|e| panic!("{journals} areas of {jb} blocks: layout made {e}"));
            }
        }
    }
}

/// An image whose primary superblock is damaged still holds an aiosfs (fsck reads it from the
/// backup): mkfs without --force refuses it too, instead of formatting over it.
#[test]
fn mkfs_refuses_an_image_with_only_its_backup_superblock_intact() {
    let (img, sb) = made("backup-only");
    img.poke(20, 0x40);
    assert!(fsck(img.path()).unwrap().problems[0].contains("primary superblock is damaged"));
    let e = mkfs(img.path(), &small()).expect_err("mkfs formatted over an aiosfs");
    assert!(e.to_string().contains("already holds an aiosfs"), "{e}");
    assert_eq!(
        fsck(img.path()).unwrap().superblock.uuid,
        sb.uuid,
        "unchanged"
    );
}

/// An image that holds another file system or a partition table (its magic number is all this
/// test writes) is refused without --force, and left as it was; with --force it is formatted.
#[test]
fn mkfs_refuses_a_foreign_file_system_or_partition_table_unless_forced() {
    for (name, off, magic, what) in [
        ("ext4", 1080, &[0x53u8, 0xef][..], "ext2/ext3/ext4"),
        ("btrfs", 65600, b"_BHRfS_M", "btrfs"),
        ("xfs", 0, b"XFSB", "XFS"),
        ("mbr", 510, &[0x55, 0xaa], "MBR"),
        ("gpt", 512, b"EFI PART", "GPT"),
        ("swap", 4086, b"SWAPSPACE2", "swap"),
    ] {
        let img = Image::new(&format!("foreign-{name}"), 8 << 20);
        std::fs::OpenOptions::new()
            .write(true)
            .open(img.path())
            .unwrap()
            .write_all_at(magic, off)
            .unwrap();
        let before = std::fs::read(img.path()).unwrap();
        let e = mkfs(img.path(), &small()).expect_err("mkfs formatted over another format");
        assert!(
            e.to_string().contains(what) && e.to_string().contains("--force"),
            "{name}: {e}"
        );
        assert!(
            std::fs::read(img.path()).unwrap() == before,
            "{name}: the refused mkfs changed the image"
        );
        mkfs(
            img.path(),
            &MkfsOptions {
                force: true,
                ..small()
            },
        )
        .unwrap_or_else(|e| panic!("{name} with force: {e}"));
        assert!(fsck(img.path()).unwrap().problems.is_empty(), "{name}");
    }
}
