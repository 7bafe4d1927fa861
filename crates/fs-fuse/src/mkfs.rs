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

fn now() -> (u64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs(), d.subsec_nanos())
}

/// Make an empty aiosfs on `path` (a file or block device). Refuses, changing nothing, when the
/// target already holds an aiosfs and `force` is not set.
pub fn mkfs(path: &Path, opts: &MkfsOptions) -> Result<Superblock, FsError> {
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
