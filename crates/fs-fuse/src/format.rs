//! aiosfs on disk, version 2 (version 1, without the attribute logs, is still read). Every
//! structure is little-endian and carries a crc32c.
//!
//! ```text
//! block 0                 superblock (primary)
//! inode bitmap            1 bit per inode (inode 0 is never used; 1 is the root directory)
//! block bitmap            1 bit per block of the image, metadata included
//! inode table             256-byte inodes, 16 per block
//! journal areas           one per core, each a `journal` crate area (superblock + circular log)
//! attribute logs          (version 2) one Rio attribute log per journal area, RIO_LOG_BLOCKS
//!                         blocks each: what a Rio-ordered commit (`aios mount --commit rio`)
//!                         records its ordering in, and recovery reads back
//! data                    file and directory blocks
//! last block              superblock (backup)
//! ```
//!
//! An inode maps its file with up to [`INLINE_EXTENTS`] extents (logical block, physical block,
//! length) kept in the inode itself, so a file's map is read with its inode (AIOS §3.2.1: reads
//! never wait on mapping I/O). Directory blocks hold packed entries behind a checksummed
//! header.

use crate::error::FsError;

pub const BLOCK: usize = 4096;
pub const MAGIC: [u8; 8] = *b"AIOSFS\0\x01";
pub const VERSION: u32 = 2;
/// The oldest version this build reads (version 1 has no attribute logs).
pub const OLDEST_VERSION: u32 = 1;
/// Blocks of each journal area's Rio attribute log (a header block and 960 64-byte slots).
pub const RIO_LOG_BLOCKS: u64 = 16;
/// The smallest journal area (blocks) mkfs makes. The mount commits once pending metadata
/// passes a quarter of an area's log, so a transaction takes that quarter plus what one
/// operation changes (up to about 15 blocks: a rename over a directory, or a write that
/// rewrites a file's 8 extent leaves) plus its descriptor and commit block; with 8 blocks (7
/// of log) even a mkdir's transaction did not fit and the file system went read-only.
pub const MIN_JOURNAL_BLOCKS: u64 = 32;
/// The smallest journal area a superblock may describe (what older mkfs builds made).
const MIN_JOURNAL_BLOCKS_READ: u64 = 8;
pub const INODE_BYTES: usize = 256;
pub const INODES_PER_BLOCK: usize = BLOCK / INODE_BYTES;
pub const ROOT_INO: u64 = 1;
pub const INLINE_EXTENTS: usize = 8;
/// The largest file (16 TiB, as ext4's with 4 KiB blocks): writes, fallocate and truncate past
/// it get EFBIG, and an extent mapping file blocks past it is damage.
pub const MAX_FILE_BYTES: u64 = 1 << 44;
/// Flag in an inode: its eight extent slots point at extent leaf blocks instead of holding
/// extents (`logical` = first file block the leaf maps, `physical` = the leaf block, `len` =
/// extents in it).
pub const INODE_LEAVES: u16 = 1;
/// Extents per leaf block (after a 16-byte header: magic, crc, count, owner's low 32 bits).
pub const LEAF_EXTENTS: usize = (BLOCK - 16) / 20;
pub const LEAF_MAGIC: u32 = 0x4c54_5845; // "EXTL"
pub const XATTR_MAGIC: u32 = 0x5454_4158; // "XATT"
/// Bytes of an xattr block's header: magic, crc, count, bytes used.
pub const XATTR_HEADER: usize = 16;
pub const NAME_MAX: usize = 255;
pub const DIR_MAGIC: u32 = 0x4149_4f44; // "DOIA"
/// Bytes of a directory block's header: magic, crc, entry count, bytes used.
pub const DIR_HEADER: usize = 16;

/// Where the superblock's crc32c sits: every field and the checksum are in the first 512-byte
/// sector, so a write torn at a sector boundary leaves the old or the new superblock whole.
pub const SB_CRC_AT: usize = 508;

/// File types (the `S_IFMT` bits of `mode`).
pub const S_IFMT: u32 = 0o170000;
pub const S_IFREG: u32 = 0o100000;
pub const S_IFDIR: u32 = 0o040000;
pub const S_IFLNK: u32 = 0o120000;

pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2"))
}
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4"))
}
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8"))
}
fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub(crate) fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// Blocks of the attribute logs of an image of `version` with `journals` areas: none in
/// version 1, and none where one log cannot serve a stream per area (more areas than
/// [`MAX_STREAMS`](journal::rio_ordering::MAX_STREAMS)).
fn rio_log_blocks(version: u32, journals: u32) -> u64 {
    if version >= 2 && journals <= journal::rio_ordering::MAX_STREAMS as u32 {
        journals as u64 * RIO_LOG_BLOCKS
    } else {
        0
    }
}

/// A run of blocks: `[start, start + count)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub count: u64,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.start.saturating_add(self.count)
    }
    pub fn contains(&self, b: u64) -> bool {
        b >= self.start && b < self.end()
    }
}

/// The superblock: where everything is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub version: u32,
    pub blocks: u64,
    pub inodes: u64,
    pub inode_bitmap: Region,
    pub block_bitmap: Region,
    pub inode_table: Region,
    /// First block of the journal areas, and their count and size (blocks each).
    pub journal_start: u64,
    pub journal_areas: u32,
    pub journal_blocks: u64,
    /// The Rio attribute logs, [`RIO_LOG_BLOCKS`] per journal area, between the journal and
    /// the data (empty in a version-1 image, and with more journal areas than a log has
    /// streams).
    pub rio_logs: Region,
    pub data: Region,
    pub uuid: [u8; 16],
    /// Seconds since the epoch at mkfs.
    pub created: u64,
    /// Set while mounted; a mount that finds it set runs journal recovery first.
    pub mounted: bool,
}

impl Superblock {
    /// The layout for an image of `bytes`, with `journals` areas of `journal_blocks` each and
    /// one inode per `bytes_per_inode` bytes.
    pub fn layout(
        bytes: u64,
        journals: u32,
        journal_blocks: u64,
        bytes_per_inode: u64,
    ) -> Result<Superblock, FsError> {
        let blocks = bytes / BLOCK as u64;
        let too_small = |why: String| FsError::TooSmall { bytes, why };
        if journals == 0 || journals > 256 {
            return Err(FsError::Config(format!(
                "{journals} journal areas: 1 to 256 (one per core)"
            )));
        }
        if bytes_per_inode < BLOCK as u64 {
            return Err(FsError::Config(format!(
                "{bytes_per_inode} bytes per inode: at least {BLOCK}"
            )));
        }
        let inodes = (bytes / bytes_per_inode).max(64);
        let ibm = inodes.div_ceil(BLOCK as u64 * 8);
        let bbm = blocks.div_ceil(BLOCK as u64 * 8);
        let itab = inodes.div_ceil(INODES_PER_BLOCK as u64);
        let inode_bitmap = Region {
            start: 1,
            count: ibm,
        };
        let block_bitmap = Region {
            start: inode_bitmap.end(),
            count: bbm,
        };
        let inode_table = Region {
            start: block_bitmap.end(),
            count: itab,
        };
        if journal_blocks < MIN_JOURNAL_BLOCKS {
            return Err(FsError::Config(format!(
                "journal areas of {journal_blocks} blocks: at least {MIN_JOURNAL_BLOCKS}"
            )));
        }
        let journal_start = inode_table.end();
        let journal_end = (journals as u64)
            .checked_mul(journal_blocks)
            .and_then(|j| j.checked_add(journal_start));
        let Some(journal_end) = journal_end else {
            return Err(too_small(format!(
                "{journals} journal areas of {journal_blocks} blocks are more blocks than any image holds"
            )));
        };
        let rio_logs = Region {
            start: journal_end,
            count: rio_log_blocks(VERSION, journals),
        };
        let data_start = rio_logs.end();
        // The last block holds the backup superblock; the root directory needs one data block,
        // and 16 more leave room for files.
        let need = data_start.saturating_add(2 + 16);
        if blocks < need {
            return Err(too_small(format!(
                "{blocks} blocks of {BLOCK} bytes; the metadata, {journals} journal areas of {journal_blocks} blocks and their attribute logs, with room for the root directory, the backup superblock and 16 blocks of data, need {need}"
            )));
        }
        let data = Region {
            start: data_start,
            count: blocks - 1 - data_start,
        };
        Ok(Superblock {
            version: VERSION,
            blocks,
            inodes,
            inode_bitmap,
            block_bitmap,
            inode_table,
            journal_start,
            journal_areas: journals,
            journal_blocks,
            rio_logs,
            data,
            uuid: [0; 16],
            created: 0,
            mounted: false,
        })
    }

    pub fn encode(&self, b: &mut [u8]) {
        b[..BLOCK].fill(0);
        b[0..8].copy_from_slice(&MAGIC);
        put32(b, 8, self.version);
        put32(b, 12, BLOCK as u32);
        put64(b, 16, self.blocks);
        put64(b, 24, self.inodes);
        let mut at = 32;
        for r in [
            self.inode_bitmap,
            self.block_bitmap,
            self.inode_table,
            self.data,
        ] {
            put64(b, at, r.start);
            put64(b, at + 8, r.count);
            at += 16;
        }
        put64(b, 96, self.journal_start);
        put32(b, 104, self.journal_areas);
        put64(b, 108, self.journal_blocks);
        b[116..132].copy_from_slice(&self.uuid);
        put64(b, 132, self.created);
        b[140] = self.mounted as u8;
        put64(b, 144, self.rio_logs.start);
        put64(b, 152, self.rio_logs.count);
        let c = crc(&b[..SB_CRC_AT]);
        put32(b, SB_CRC_AT, c);
    }

    /// Decode and check a superblock; `image_blocks` is the size of what it was read from.
    pub fn decode(b: &[u8], image_blocks: u64) -> Result<Superblock, FsError> {
        if b.len() < BLOCK {
            return Err(FsError::Foreign("shorter than one block".into()));
        }
        if b[0..6] != MAGIC[0..6] {
            return Err(FsError::Foreign("no aiosfs signature in block 0".into()));
        }
        if crc(&b[..SB_CRC_AT]) != u32_at(b, SB_CRC_AT) {
            return Err(FsError::Damaged("superblock checksum mismatch".into()));
        }
        if b[6..8] != MAGIC[6..8] {
            return Err(FsError::Unsupported(format!(
                "aiosfs format byte {:#04x}; this build reads format {VERSION}",
                b[7]
            )));
        }
        let version = u32_at(b, 8);
        if !(OLDEST_VERSION..=VERSION).contains(&version) {
            return Err(FsError::Unsupported(format!(
                "aiosfs version {version}; this build reads versions {OLDEST_VERSION} to {VERSION}"
            )));
        }
        if u32_at(b, 12) as usize != BLOCK {
            return Err(FsError::Unsupported(format!(
                "block size {}; this build uses {BLOCK}",
                u32_at(b, 12)
            )));
        }
        let mut regions = [Region { start: 0, count: 0 }; 4];
        for (i, r) in regions.iter_mut().enumerate() {
            *r = Region {
                start: u64_at(b, 32 + 16 * i),
                count: u64_at(b, 40 + 16 * i),
            };
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[116..132]);
        let sb = Superblock {
            version,
            blocks: u64_at(b, 16),
            inodes: u64_at(b, 24),
            inode_bitmap: regions[0],
            block_bitmap: regions[1],
            inode_table: regions[2],
            data: regions[3],
            journal_start: u64_at(b, 96),
            journal_areas: u32_at(b, 104),
            journal_blocks: u64_at(b, 108),
            rio_logs: if version >= 2 {
                Region {
                    start: u64_at(b, 144),
                    count: u64_at(b, 152),
                }
            } else {
                // Version 1 has none: an empty region where they would start.
                Region {
                    start: (u32_at(b, 104) as u64)
                        .saturating_mul(u64_at(b, 108))
                        .saturating_add(u64_at(b, 96)),
                    count: 0,
                }
            },
            uuid,
            created: u64_at(b, 132),
            mounted: b[140] != 0,
        };
        sb.check(image_blocks)?;
        Ok(sb)
    }

    /// The geometry must describe exactly this layout, inside the image.
    fn check(&self, image_blocks: u64) -> Result<(), FsError> {
        let bad = |why: String| Err(FsError::Damaged(format!("superblock: {why}")));
        if self.blocks > image_blocks {
            return bad(format!(
                "{} blocks, but the image has {image_blocks}",
                self.blocks
            ));
        }
        if self.journal_areas == 0
            || self.journal_areas > 256
            || self.journal_blocks < MIN_JOURNAL_BLOCKS_READ
        {
            return bad(format!(
                "{} journal areas of {} blocks",
                self.journal_areas, self.journal_blocks
            ));
        }
        let inode_bitmap_ok = self.inode_bitmap.start == 1
            && self.inode_bitmap.count == self.inodes.div_ceil(BLOCK as u64 * 8);
        let ok = self.inodes >= 64
            && self.inodes <= self.blocks * INODES_PER_BLOCK as u64
            && inode_bitmap_ok
            && self.block_bitmap
                == Region {
                    start: self.inode_bitmap.end(),
                    count: self.blocks.div_ceil(BLOCK as u64 * 8),
                }
            && self.inode_table
                == Region {
                    start: self.block_bitmap.end(),
                    count: self.inodes.div_ceil(INODES_PER_BLOCK as u64),
                }
            && self.journal_start == self.inode_table.end()
            && Some(self.rio_logs.start)
                == (self.journal_areas as u64)
                    .checked_mul(self.journal_blocks)
                    .and_then(|j| self.journal_start.checked_add(j))
            && self.rio_logs.count == rio_log_blocks(self.version, self.journal_areas)
            && self.data.start == self.rio_logs.end()
            && self.data.end() == self.blocks.saturating_sub(1);
        if !ok {
            return bad("regions that do not fit together".into());
        }
        Ok(())
    }

    /// Byte offset and length (bytes) of journal area `i`'s Rio attribute log; `None` in a
    /// version-1 image, which has none.
    pub fn rio_log(&self, i: u32) -> Option<(u64, usize)> {
        (self.rio_logs.count > 0).then(|| {
            (
                (self.rio_logs.start + i as u64 * RIO_LOG_BLOCKS) * BLOCK as u64,
                RIO_LOG_BLOCKS as usize * BLOCK,
            )
        })
    }

    /// Byte offset and length of journal area `i`.
    pub fn journal_area(&self, i: u32) -> (u64, u64) {
        (
            (self.journal_start + i as u64 * self.journal_blocks) * BLOCK as u64,
            self.journal_blocks,
        )
    }
}

/// A run of a file's blocks: file blocks `[logical, logical + len)` at `[physical, …)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub len: u32,
}

/// An inode (256 bytes on disk).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Inode {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    pub size: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub generation: u32,
    /// `INODE_LEAVES` or 0.
    pub flags: u16,
    /// Device number of a character or block special file.
    pub rdev: u32,
    /// Block holding the extended attributes (0: none).
    pub xattr: u64,
    /// Inline extents, or with `INODE_LEAVES` the leaf pointers.
    pub extents: Vec<Extent>,
}

impl Inode {
    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    pub fn encode(&self, b: &mut [u8]) {
        assert!(
            self.extents.len() <= INLINE_EXTENTS,
            "extents fit the inode"
        );
        b[..INODE_BYTES].fill(0);
        put32(b, 0, self.mode);
        put32(b, 4, self.uid);
        put32(b, 8, self.gid);
        put32(b, 12, self.nlink);
        put64(b, 16, self.size);
        let mut at = 24;
        for (s, ns) in [self.atime, self.mtime, self.ctime] {
            put64(b, at, s as u64);
            put32(b, at + 8, ns);
            at += 12;
        }
        put32(b, 60, self.generation);
        put16(b, 64, self.extents.len() as u16);
        put16(b, 66, self.flags);
        for (i, e) in self.extents.iter().enumerate() {
            let o = 72 + i * 20;
            put64(b, o, e.logical);
            put64(b, o + 8, e.physical);
            put32(b, o + 16, e.len);
        }
        put64(b, 232, self.xattr);
        put32(b, 240, self.rdev);
        let c = crc(&b[..INODE_BYTES - 4]);
        put32(b, INODE_BYTES - 4, c);
    }

    /// Decode an inode slot: `Ok(None)` for an all-zero (free) slot.
    pub fn decode(b: &[u8]) -> Result<Option<Inode>, String> {
        let b = &b[..INODE_BYTES];
        if b.iter().all(|&x| x == 0) {
            return Ok(None);
        }
        if crc(&b[..INODE_BYTES - 4]) != u32_at(b, INODE_BYTES - 4) {
            return Err("checksum mismatch".into());
        }
        let n = u16_at(b, 64) as usize;
        if n > INLINE_EXTENTS {
            return Err(format!("{n} extents; an inode holds {INLINE_EXTENTS}"));
        }
        let flags = u16_at(b, 66);
        if flags & !INODE_LEAVES != 0 {
            return Err(format!("unknown flags {flags:#x}"));
        }
        let t = |at: usize| (u64_at(b, at) as i64, u32_at(b, at + 8));
        Ok(Some(Inode {
            mode: u32_at(b, 0),
            uid: u32_at(b, 4),
            gid: u32_at(b, 8),
            nlink: u32_at(b, 12),
            size: u64_at(b, 16),
            atime: t(24),
            mtime: t(36),
            ctime: t(48),
            generation: u32_at(b, 60),
            flags,
            rdev: u32_at(b, 240),
            xattr: u64_at(b, 232),
            extents: (0..n)
                .map(|i| {
                    let o = 72 + i * 20;
                    Extent {
                        logical: u64_at(b, o),
                        physical: u64_at(b, o + 8),
                        len: u32_at(b, o + 16),
                    }
                })
                .collect(),
        }))
    }
}

/// A directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    /// The file type (`S_IFMT` bits >> 12).
    pub kind: u8,
    pub name: Vec<u8>,
}

impl DirEntry {
    fn bytes(&self) -> usize {
        8 + 1 + 1 + self.name.len()
    }
}

/// Pack `entries` into one directory block. Fails when they do not fit.
pub fn encode_dir_block(entries: &[DirEntry], b: &mut [u8]) -> Result<(), FsError> {
    b[..BLOCK].fill(0);
    let mut at = DIR_HEADER;
    for e in entries {
        if e.name.is_empty() || e.name.len() > NAME_MAX {
            return Err(FsError::Config(format!(
                "a name of {} bytes (1 to {NAME_MAX})",
                e.name.len()
            )));
        }
        if at + e.bytes() > BLOCK {
            return Err(FsError::Config(
                "directory entries overflow the block".into(),
            ));
        }
        put64(b, at, e.ino);
        b[at + 8] = e.kind;
        b[at + 9] = e.name.len() as u8;
        b[at + 10..at + 10 + e.name.len()].copy_from_slice(&e.name);
        at += e.bytes();
    }
    put32(b, 0, DIR_MAGIC);
    put32(b, 8, entries.len() as u32);
    put32(b, 12, at as u32);
    let c = crc(&b[8..BLOCK]);
    put32(b, 4, c);
    Ok(())
}

/// Unpack a directory block.
pub fn decode_dir_block(b: &[u8]) -> Result<Vec<DirEntry>, String> {
    if b.len() < BLOCK {
        return Err("short block".into());
    }
    if u32_at(b, 0) != DIR_MAGIC {
        return Err("not a directory block (bad magic)".into());
    }
    if crc(&b[8..BLOCK]) != u32_at(b, 4) {
        return Err("checksum mismatch".into());
    }
    let n = u32_at(b, 8) as usize;
    let used = u32_at(b, 12) as usize;
    if !(DIR_HEADER..=BLOCK).contains(&used) {
        return Err(format!("{used} bytes used in a {BLOCK}-byte block"));
    }
    let mut out = Vec::with_capacity(n.min(BLOCK / 11));
    let mut at = DIR_HEADER;
    for i in 0..n {
        if at + 10 > used {
            return Err(format!("entry {i} runs past the used bytes"));
        }
        let len = b[at + 9] as usize;
        if len == 0 || at + 10 + len > used {
            return Err(format!("entry {i} has a bad name length {len}"));
        }
        out.push(DirEntry {
            ino: u64_at(b, at),
            kind: b[at + 8],
            name: b[at + 10..at + 10 + len].to_vec(),
        });
        at += 10 + len;
    }
    if at != used {
        return Err(format!("{} bytes after the last entry", used - at));
    }
    Ok(out)
}

/// Pack up to [`LEAF_EXTENTS`] extents of file `owner` into a leaf block.
pub fn encode_leaf(owner: u64, extents: &[Extent], b: &mut [u8]) {
    assert!(extents.len() <= LEAF_EXTENTS, "a leaf holds {LEAF_EXTENTS}");
    b[..BLOCK].fill(0);
    put32(b, 0, LEAF_MAGIC);
    put32(b, 8, extents.len() as u32);
    put32(b, 12, owner as u32);
    for (i, e) in extents.iter().enumerate() {
        let o = 16 + i * 20;
        put64(b, o, e.logical);
        put64(b, o + 8, e.physical);
        put32(b, o + 16, e.len);
    }
    let c = crc(&b[8..BLOCK]);
    put32(b, 4, c);
}

/// Unpack a leaf block of file `owner`.
pub fn decode_leaf(owner: u64, b: &[u8]) -> Result<Vec<Extent>, String> {
    if b.len() < BLOCK || u32_at(b, 0) != LEAF_MAGIC {
        return Err("not an extent leaf (bad magic)".into());
    }
    if crc(&b[8..BLOCK]) != u32_at(b, 4) {
        return Err("extent leaf checksum mismatch".into());
    }
    let n = u32_at(b, 8) as usize;
    if n > LEAF_EXTENTS {
        return Err(format!(
            "extent leaf claims {n} extents (at most {LEAF_EXTENTS})"
        ));
    }
    if u32_at(b, 12) != owner as u32 {
        return Err(format!(
            "extent leaf belongs to inode {} (low bits), not {owner}",
            u32_at(b, 12)
        ));
    }
    Ok((0..n)
        .map(|i| {
            let o = 16 + i * 20;
            Extent {
                logical: u64_at(b, o),
                physical: u64_at(b, o + 8),
                len: u32_at(b, o + 16),
            }
        })
        .collect())
}

/// Extended attributes: (name, value) pairs.
pub type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// Pack extended attributes (name, value) into one block; fails when they do not fit.
pub fn encode_xattrs(attrs: &[(Vec<u8>, Vec<u8>)], b: &mut [u8]) -> Result<(), FsError> {
    b[..BLOCK].fill(0);
    let mut at = XATTR_HEADER;
    for (name, value) in attrs {
        let need = 3 + name.len() + value.len();
        if name.is_empty() || name.len() > 255 || at + need > BLOCK {
            return Err(FsError::Config(
                "extended attributes overflow their block".into(),
            ));
        }
        b[at] = name.len() as u8;
        put16(b, at + 1, value.len() as u16);
        b[at + 3..at + 3 + name.len()].copy_from_slice(name);
        b[at + 3 + name.len()..at + need].copy_from_slice(value);
        at += need;
    }
    put32(b, 0, XATTR_MAGIC);
    put32(b, 8, attrs.len() as u32);
    put32(b, 12, at as u32);
    let c = crc(&b[8..BLOCK]);
    put32(b, 4, c);
    Ok(())
}

/// Bytes the attributes take in their block (header included).
pub fn xattr_bytes<'a>(attrs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> usize {
    XATTR_HEADER
        + attrs
            .into_iter()
            .map(|(n, v)| 3 + n.len() + v.len())
            .sum::<usize>()
}

/// Unpack an xattr block.
pub fn decode_xattrs(b: &[u8]) -> Result<Xattrs, String> {
    if b.len() < BLOCK || u32_at(b, 0) != XATTR_MAGIC {
        return Err("not an xattr block (bad magic)".into());
    }
    if crc(&b[8..BLOCK]) != u32_at(b, 4) {
        return Err("xattr block checksum mismatch".into());
    }
    let n = u32_at(b, 8) as usize;
    let used = u32_at(b, 12) as usize;
    if !(XATTR_HEADER..=BLOCK).contains(&used) {
        return Err(format!("xattr block: {used} bytes used"));
    }
    let mut out = Vec::new();
    let mut at = XATTR_HEADER;
    for i in 0..n {
        if at + 3 > used {
            return Err(format!("xattr {i} runs past the used bytes"));
        }
        let nl = b[at] as usize;
        let vl = u16_at(b, at + 1) as usize;
        if nl == 0 || at + 3 + nl + vl > used {
            return Err(format!("xattr {i} has bad lengths"));
        }
        out.push((
            b[at + 3..at + 3 + nl].to_vec(),
            b[at + 3 + nl..at + 3 + nl + vl].to_vec(),
        ));
        at += 3 + nl + vl;
    }
    if at != used {
        return Err("bytes after the last xattr".into());
    }
    Ok(out)
}

/// Bit `i` of a bitmap.
pub fn bit(map: &[u8], i: u64) -> bool {
    map[(i / 8) as usize] & (1 << (i % 8)) != 0
}

pub fn set_bit(map: &mut [u8], i: u64) {
    map[(i / 8) as usize] |= 1 << (i % 8);
}

pub fn clear_bit(map: &mut [u8], i: u64) {
    map[(i / 8) as usize] &= !(1 << (i % 8));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trips_and_refuses_damage() {
        let mut sb = Superblock::layout(64 << 20, 2, 256, 16384).unwrap();
        sb.uuid = [7; 16];
        sb.created = 1_800_000_000;
        let mut b = vec![0u8; BLOCK];
        sb.encode(&mut b);
        assert_eq!(Superblock::decode(&b, sb.blocks).unwrap(), sb);
        let mut bad = b.clone();
        bad[20] ^= 1;
        assert!(matches!(
            Superblock::decode(&bad, sb.blocks),
            Err(FsError::Damaged(_))
        ));
        assert!(matches!(
            Superblock::decode(&vec![0u8; BLOCK], sb.blocks),
            Err(FsError::Foreign(_))
        ));
        // An image smaller than the superblock says.
        assert!(Superblock::decode(&b, sb.blocks - 1).is_err());
    }

    #[test]
    fn inode_and_directory_blocks_round_trip() {
        let ino = Inode {
            mode: S_IFREG | 0o644,
            uid: 1000,
            gid: 1000,
            nlink: 1,
            size: 12345,
            atime: (-5, 7),
            mtime: (1_800_000_000, 999_999_999),
            ctime: (3, 0),
            generation: 9,
            flags: 0,
            rdev: 0x0801,
            xattr: 77,
            extents: vec![
                Extent {
                    logical: 0,
                    physical: 900,
                    len: 3,
                },
                Extent {
                    logical: 10,
                    physical: 40,
                    len: 1,
                },
            ],
        };
        let mut b = vec![0u8; INODE_BYTES];
        ino.encode(&mut b);
        assert_eq!(Inode::decode(&b).unwrap(), Some(ino));
        b[100] ^= 4;
        assert!(Inode::decode(&b).is_err());
        assert_eq!(Inode::decode(&[0u8; INODE_BYTES]).unwrap(), None);

        let es: Vec<DirEntry> = (0..50)
            .map(|i| DirEntry {
                ino: i + 2,
                kind: 8,
                name: format!("file-{i}").into_bytes(),
            })
            .collect();
        let mut d = vec![0u8; BLOCK];
        encode_dir_block(&es, &mut d).unwrap();
        assert_eq!(decode_dir_block(&d).unwrap(), es);
        d[40] ^= 1;
        assert!(decode_dir_block(&d).is_err());
    }
}
