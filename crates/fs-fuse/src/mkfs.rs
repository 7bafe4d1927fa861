//! `mkfs`: write a fresh, empty aiosfs (root directory only) on an image or device.

use std::path::Path;
use std::rc::Rc;

use aios_core::{Engine, EngineConfig};
use journal::{JournalSet, Layout};
use lbio::{Device, DeviceConfig, LbioArray, LbioConfig};

use crate::error::FsError;
use crate::format::{
    encode_dir_block, set_bit, DirEntry, Inode, Superblock, BLOCK, INODE_BYTES, ROOT_INO, S_IFDIR,
};
use crate::fsck;
use crate::lock::ImageLock;

/// Settings of `mkfs`.
#[derive(Clone, Debug)]
pub struct MkfsOptions {
    /// Journal areas: one per core that will commit (`aios mount` runs one worker per core).
    pub journals: u32,
    /// Blocks of each journal area.
    pub journal_blocks: u64,
    /// One inode per this many bytes of the image.
    pub bytes_per_inode: u64,
    /// Write over an image that already holds an aiosfs or anything else recognisable.
    pub force: bool,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        MkfsOptions {
            journals: std::thread::available_parallelism().map_or(1, |n| n.get()) as u32,
            journal_blocks: 2048,
            bytes_per_inode: 16384,
            force: false,
        }
    }
}

/// What another file system, partition table or volume format a device or image begins with
/// says it is (read from its first 68 KiB, where they all put their magic numbers); `None` when
/// none is there. mkfs without `force` refuses such a target as it refuses an aiosfs.
fn foreign_signature(path: &Path) -> Result<Option<&'static str>, FsError> {
    use std::io::Read;
    let mut head = Vec::with_capacity(68 << 10);
    std::fs::File::open(path)
        .and_then(|f| f.take(68 << 10).read_to_end(&mut head))
        .map_err(|e| FsError::io(path, e))?;
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    // (offset, magic, name): ext2/3/4's superblock magic 0xEF53 at byte 56 of block 1024,
    // btrfs's in its superblock at 64 KiB, XFS's, LUKS's and squashfs's at the start, a swap
    // area's at the end of its first 4 KiB page, GPT's header in sector 1, and the boot
    // signature that ends an MBR partition table or a FAT boot sector.
    const SIGNATURES: [(usize, &[u8], &str); 8] = [
        (1080, &[0x53, 0xef], "an ext2/ext3/ext4 file system"),
        (65600, b"_BHRfS_M", "a btrfs file system"),
        (0, b"XFSB", "an XFS file system"),
        (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
        (0, b"hsqs", "a squashfs image"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (512, b"EFI PART", "a GPT partition table"),
        (510, &[0x55, 0xaa], "an MBR partition table or boot sector"),
    ];
    Ok(SIGNATURES
        .iter()
        .find(|&&(off, magic, _)| at(off, magic))
        .map(|&(_, _, name)| name))
}

fn now() -> (u64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

/// Make an empty aiosfs on `path` (a file or block device). Refuses, changing nothing, when the
/// target already holds an aiosfs and `force` is not set, or when a mount or another mkfs holds
/// its lock ([`FsError::InUse`], even with `force`; see [`ImageLock`]).
pub fn mkfs(path: &Path, opts: &MkfsOptions) -> Result<Superblock, FsError> {
    let _lock = ImageLock::exclusive(path)?;
    let bytes = std::fs::File::open(path)
        .and_then(|f| fsck::size_of(&f))
        .map_err(|e| FsError::io(path, e))?;
    if !opts.force {
        if let Ok(sb) = fsck::any_superblock(path) {
            return Err(FsError::Config(format!(
                "{} already holds an aiosfs ({} blocks, made at {} s); pass --force to replace it",
                path.display(),
                sb.blocks,
                sb.created
            )));
        }
        if let Some(what) = foreign_signature(path)? {
            return Err(FsError::Config(format!(
                "{} already holds {what}; pass --force to replace it",
                path.display()
            )));
        }
    }
    // Small images get smaller journal areas (a quarter of the image at most), but never
    // smaller than every transaction needs.
    let blocks = bytes / BLOCK as u64;
    let journal_blocks = opts
        .journal_blocks
        .min(blocks / 4 / opts.journals.max(1) as u64)
        .max(crate::format::MIN_JOURNAL_BLOCKS);
    let mut sb = Superblock::layout(bytes, opts.journals, journal_blocks, opts.bytes_per_inode)?;
    let (secs, nanos) = now();
    sb.created = secs;
    let mut seed = secs ^ ((nanos as u64) << 32) ^ std::process::id() as u64;
    for b in sb.uuid.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }

    let engine = Engine::new(EngineConfig {
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })?;
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
    let dev = Device::open(
        &lbio,
        path,
        DeviceConfig {
            write: true,
            ..DeviceConfig::default()
        },
    )?;
    let write = |block: u64, bytes: &[u8]| -> Result<(), FsError> {
        for (i, chunk) in bytes.chunks(1 << 20).enumerate() {
            let mut b = engine.alloc_blocking(chunk.len())?;
            b.set_len(chunk.len())?;
            b.copy_from_slice(chunk);
            dev.write_at_blocking(block * BLOCK as u64 + (i << 20) as u64, b, false)?;
        }
        Ok(())
    };

    // The root directory: inode 1, one data block with "." and "..".
    let root_block = sb.data.start;
    let root = Inode {
        mode: S_IFDIR | 0o755,
        uid: 0,
        gid: 0,
        nlink: 2,
        size: BLOCK as u64,
        atime: (secs as i64, nanos),
        mtime: (secs as i64, nanos),
        ctime: (secs as i64, nanos),
        generation: 1,
        flags: 0,
        rdev: 0,
        xattr: 0,
        extents: vec![crate::format::Extent {
            logical: 0,
            physical: root_block,
            len: 1,
        }],
    };

    // Bitmaps: inode 0 (never used) and the root; every metadata block, the root's block and
    // the backup superblock.
    let mut ibm = vec![0u8; sb.inode_bitmap.count as usize * BLOCK];
    set_bit(&mut ibm, 0);
    set_bit(&mut ibm, ROOT_INO);
    let mut bbm = vec![0u8; sb.block_bitmap.count as usize * BLOCK];
    for b in 0..sb.data.start {
        set_bit(&mut bbm, b);
    }
    set_bit(&mut bbm, root_block);
    set_bit(&mut bbm, sb.blocks - 1);
    write(sb.inode_bitmap.start, &ibm)?;
    write(sb.block_bitmap.start, &bbm)?;

    // The inode table, zeroed, with the root in slot 1.
    let mut first = vec![0u8; BLOCK];
    root.encode(&mut first[ROOT_INO as usize * INODE_BYTES..]);
    write(sb.inode_table.start, &first)?;
    let zeros = vec![0u8; 1 << 20];
    let mut b = sb.inode_table.start + 1;
    while b < sb.inode_table.end() {
        let n = ((sb.inode_table.end() - b) as usize).min(zeros.len() / BLOCK);
        write(b, &zeros[..n * BLOCK])?;
        b += n as u64;
    }

    let mut dir = vec![0u8; BLOCK];
    let dot = |name: &[u8]| DirEntry {
        ino: ROOT_INO,
        kind: (S_IFDIR >> 12) as u8,
        name: name.to_vec(),
    };
    encode_dir_block(&[dot(b"."), dot(b"..")], &mut dir)?;
    write(root_block, &dir)?;

    // The journal areas (the journal crate's own format), then the superblocks.
    let areas = (0..sb.journal_areas).map(|i| sb.journal_area(i)).collect();
    JournalSet::format(&dev, Layout { areas })?;
    // Every area's Rio attribute log, empty (each written with FUA as it is formatted).
    for a in (0..sb.journal_areas).filter(|&a| sb.rio_log(a).is_some()) {
        let cfg = DeviceConfig {
            write: true,
            ..DeviceConfig::default()
        };
        crate::rio::format_log(&sb, a, Device::open(&lbio, path, cfg)?)?;
    }
    let mut sbb = vec![0u8; BLOCK];
    sb.encode(&mut sbb);
    write(sb.blocks - 1, &sbb)?;
    dev.flush_blocking()?;
    write(0, &sbb)?;
    dev.flush_blocking()?;
    Ok(sb)
}
