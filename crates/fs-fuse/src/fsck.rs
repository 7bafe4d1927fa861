//! `fsck`: check every structure of an aiosfs image and report in plain words. It only reads.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::FsError;
use crate::format::{
    bit, decode_dir_block, decode_leaf, decode_xattrs, set_bit, Extent, Inode, Superblock, BLOCK,
    INODES_PER_BLOCK, INODE_BYTES, INODE_LEAVES, MAX_FILE_BYTES, ROOT_INO, S_IFDIR, S_IFLNK,
    S_IFMT, S_IFREG,
};

/// What `fsck` found.
#[derive(Clone, Debug)]
pub struct Report {
    pub superblock: Superblock,
    /// Damage, one sentence each. Empty: the image is clean.
    pub problems: Vec<String>,
    /// Facts worth knowing that are not damage (a journal holding transactions to replay).
    pub notes: Vec<String>,
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub other: u64,
    pub used_blocks: u64,
    pub used_inodes: u64,
}

impl Report {
    pub fn clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Bounded, so a badly damaged image gives a readable report.
const MAX_PROBLEMS: usize = 200;

/// Inode table blocks fsck reads at a time (1 MiB).
const ITAB_CHUNK_BLOCKS: u64 = 256;

/// Blocks of a directory's extent fsck reads at a time (1 MiB).
const DIR_CHUNK_BLOCKS: u64 = 256;

enum Src<'a> {
    File(File),
    Mem(&'a [u8]),
}

struct Img<'a> {
    f: Src<'a>,
    bytes: u64,
    blocks: u64,
    path: String,
    /// Blocks as the journal's replay will leave them (committed, not yet written home).
    overlay: HashMap<u64, Vec<u8>>,
}

impl<'a> Img<'a> {
    fn mem(image: &'a [u8]) -> Img<'a> {
        Img {
            f: Src::Mem(image),
            bytes: image.len() as u64,
            blocks: image.len() as u64 / BLOCK as u64,
            path: "(image in memory)".into(),
            overlay: HashMap::new(),
        }
    }
    fn open(path: &Path) -> Result<Img<'static>, FsError> {
        let f = File::open(path).map_err(|e| FsError::io(path, e))?;
        let bytes = size_of(&f).map_err(|e| FsError::io(path, e))?;
        Ok(Img {
            f: Src::File(f),
            bytes,
            blocks: bytes / BLOCK as u64,
            path: path.display().to_string(),
            overlay: HashMap::new(),
        })
    }
    fn read(&self, block: u64, count: u64) -> Result<Vec<u8>, FsError> {
        let mut b = vec![0u8; (count as usize) * BLOCK];
        let at = block * BLOCK as u64;
        match &self.f {
            Src::File(f) => f.read_exact_at(&mut b, at).map_err(|e| FsError::Io {
                path: self.path.clone(),
                source: e,
            })?,
            Src::Mem(m) => {
                let end = at.saturating_add(b.len() as u64);
                if end > m.len() as u64 {
                    return Err(FsError::Io {
                        path: self.path.clone(),
                        source: std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    });
                }
                b.copy_from_slice(&m[at as usize..end as usize]);
            }
        }
        for i in 0..count {
            if let Some(v) = self.overlay.get(&(block + i)) {
                b[i as usize * BLOCK..(i as usize + 1) * BLOCK].copy_from_slice(v);
            }
        }
        Ok(b)
    }
}

/// Bytes of an open image file or block device (a block device's metadata says 0).
pub(crate) fn size_of(f: &File) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    let mut g = f;
    g.seek(SeekFrom::End(0))
}

/// The primary superblock, checked (what `mount` and `mkfs` look at first).
pub fn read_superblock(path: &Path) -> Result<Superblock, FsError> {
    let img = Img::open(path)?;
    if img.blocks < 2 {
        return Err(FsError::Foreign(format!(
            "{} bytes: smaller than any aiosfs",
            img.bytes
        )));
    }
    Superblock::decode(&img.read(0, 1)?, img.blocks)
}

/// The superblock of the image at `path`: the primary, or the backup in the last block when
/// the primary is damaged (what fsck and the mount fall back on; so `mkfs` without `--force`
/// leaves such an image alone too).
pub(crate) fn any_superblock(path: &Path) -> Result<Superblock, FsError> {
    superblock_in(&Img::open(path)?).map(|(sb, _)| sb)
}

/// The superblock fsck checks the image by, and what it found wrong with the primary or the
/// backup on the way.
fn superblock_in(img: &Img<'_>) -> Result<(Superblock, Option<String>), FsError> {
    if img.blocks < 2 {
        return Err(FsError::Foreign(format!(
            "{} bytes: smaller than any aiosfs",
            img.bytes
        )));
    }
    match Superblock::decode(&img.read(0, 1)?, img.blocks) {
        Ok(sb) => {
            let problem = match Superblock::decode(&img.read(sb.blocks - 1, 1)?, img.blocks) {
                Ok(b) if b.uuid == sb.uuid && b.blocks == sb.blocks => None,
                Ok(_) => Some(format!(
                    "the backup superblock (block {}) describes another file system",
                    sb.blocks - 1
                )),
                Err(e) => Some(format!(
                    "the backup superblock (block {}) is unreadable: {e}",
                    sb.blocks - 1
                )),
            };
            Ok((sb, problem))
        }
        Err(e @ (FsError::Damaged(_) | FsError::Foreign(_))) => {
            // The primary is damaged (or lost its signature): the backup sits in the image's
            // last block when the image is exactly the file system's size.
            match Superblock::decode(&img.read(img.blocks - 1, 1)?, img.blocks) {
                Ok(b) => Ok((
                    b,
                    Some(format!(
                        "the primary superblock is damaged ({e}); the backup in block {} is intact",
                        img.blocks - 1
                    )),
                )),
                Err(_) if matches!(e, FsError::Foreign(_)) => Err(e),
                Err(_) => {
                    let why = match e {
                        FsError::Damaged(w) => w,
                        other => other.to_string(),
                    };
                    Err(FsError::Damaged(format!("{why}, and no intact backup")))
                }
            }
        }
        Err(e) => Err(e),
    }
}

/// Check the image at `path`. `Err` when it is not an aiosfs (or unreadable); otherwise the
/// report lists every problem found.
pub fn fsck(path: &Path) -> Result<Report, FsError> {
    let img = Img::open(path)?;
    check(img, power_loss_protected(path))
}

/// [`fsck`] of an image held in memory (crash tests check thousands of them), read as from a
/// device with a volatile write cache (a SimDisk).
pub fn fsck_image(image: &[u8]) -> Result<Report, FsError> {
    check(Img::mem(image), false)
}

/// Whether the device at `path` has power-loss protection, as the mount will see it (Rio
/// recovery reads the attribute logs differently then). Unknown: no.
fn power_loss_protected(path: &Path) -> bool {
    let probe = || -> Result<bool, FsError> {
        let engine = aios_core::Engine::new(aios_core::EngineConfig {
            arena_bytes: 1 << 20,
            huge_pages: false,
            ..aios_core::EngineConfig::default()
        })?;
        let lbio = lbio::LbioArray::new(engine, lbio::LbioConfig::default())?;
        let dev = lbio::Device::open(&lbio, path, lbio::DeviceConfig::default())?;
        let plp = dev.critical_route().0.power_loss_protected;
        Ok(plp)
    };
    probe().unwrap_or(false)
}

/// Problems found: the first [`MAX_PROBLEMS`] in words, the rest only counted.
struct Problems {
    list: Vec<String>,
    more: u64,
    /// Drops everything: for the passes that only look again at what was checked already.
    quiet: bool,
}

impl Problems {
    fn new() -> Problems {
        Problems {
            list: Vec::new(),
            more: 0,
            quiet: false,
        }
    }

    fn quiet() -> Problems {
        Problems {
            quiet: true,
            ..Problems::new()
        }
    }

    fn push(&mut self, p: String) {
        if self.quiet {
            return;
        }
        if self.list.len() < MAX_PROBLEMS {
            self.list.push(p);
        } else {
            self.more += 1;
        }
    }

    /// Problems still listed in words before they are only counted.
    fn room(&self) -> usize {
        MAX_PROBLEMS - self.list.len()
    }

    /// `n` problems found past the list's room, counted without words.
    /// (Under a live mount, which `aios fsck` warns about, the image may change between the
    /// passes that count and name problems, so the two need not agree.)
    fn count_unlisted(&mut self, n: u64) {
        self.more += n;
    }

    fn into_list(mut self) -> Vec<String> {
        if self.more > 0 {
            self.list.push(format!("… and {} more problems", self.more));
        }
        self.list
    }
}

/// The blocks of the data region that files own (extents, extent leaves, xattr blocks): a bit
/// a block, and a second bitmap, made when a block is first owned again, of the blocks owned
/// more than once. Which inodes own those is found by a second walk of the inodes
/// ([`name_owners`]), only when there are any.
struct Owned {
    start: u64,
    once: Vec<u8>,
    again: Vec<u8>,
    /// Times a block already owned was owned again: one problem each.
    repeats: u64,
}

impl Owned {
    fn new(data: crate::format::Region) -> Owned {
        Owned {
            start: data.start,
            once: vec![0u8; data.count.div_ceil(8) as usize],
            again: Vec::new(),
            repeats: 0,
        }
    }

    /// A file owns block `b` (in the data region).
    fn own(&mut self, b: u64) {
        let i = b - self.start;
        if bit(&self.once, i) {
            if self.again.is_empty() {
                self.again = vec![0u8; self.once.len()];
            }
            set_bit(&mut self.again, i);
            self.repeats += 1;
        } else {
            set_bit(&mut self.once, i);
        }
    }

    fn owned(&self, b: u64) -> bool {
        bit(&self.once, b - self.start)
    }

    /// The first `n` blocks owned more than once, in block order.
    fn repeated(&self, n: usize) -> Vec<u64> {
        let mut out = Vec::new();
        for (k, &byte) in self.again.iter().enumerate() {
            if out.len() == n {
                break;
            }
            if byte == 0 {
                continue;
            }
            for j in 0..8 {
                if byte & (1 << j) != 0 && out.len() < n {
                    out.push(self.start + k as u64 * 8 + j);
                }
            }
        }
        out
    }
}

/// What the checks after the walk of the inode table need of an inode in use (its extents are
/// read again where a check needs them).
#[derive(Clone, Copy)]
struct Node {
    ino: u64,
    mode: u32,
    nlink: u32,
}

impl Node {
    fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }
}

/// The inode in use numbered `ino`, in `nodes` (in inode order).
fn node(nodes: &[Node], ino: u64) -> Option<&Node> {
    nodes
        .binary_search_by_key(&ino, |n| n.ino)
        .ok()
        .map(|k| &nodes[k])
}

/// Calls `each(ino, slot)` for every inode slot of the table from inode 1 on, reading the
/// table in pieces of [`ITAB_CHUNK_BLOCKS`] (read whole, it took 16 GiB for a 1 TiB image with
/// one inode per 16 KiB, however few inodes were in use). `each` returns whether to go on.
fn each_slot<F>(img: &Img<'_>, sb: &Superblock, mut each: F) -> Result<(), FsError>
where
    F: FnMut(u64, &[u8]) -> Result<bool, FsError>,
{
    let mut tb = 0u64;
    while tb < sb.inode_table.count && tb * (INODES_PER_BLOCK as u64) < sb.inodes {
        let n = (sb.inode_table.count - tb).min(ITAB_CHUNK_BLOCKS);
        let chunk = img.read(sb.inode_table.start + tb, n)?;
        for (k, slot) in chunk.chunks_exact(INODE_BYTES).enumerate() {
            let ino = tb * INODES_PER_BLOCK as u64 + k as u64;
            if ino == 0 {
                continue;
            }
            if ino >= sb.inodes || !each(ino, slot)? {
                return Ok(());
            }
        }
        tb += n;
    }
    Ok(())
}

/// Inode `ino`'s extents: inline, or read from its extent leaves (those that check out). `own`
/// hears each block of the data region its xattr block and leaves take; what is wrong with
/// them goes to `out`.
fn extents_of(
    img: &Img<'_>,
    sb: &Superblock,
    ino: u64,
    i: Inode,
    out: &mut Problems,
    own: &mut dyn FnMut(u64, &mut Problems),
) -> Result<Vec<Extent>, FsError> {
    if i.xattr != 0 {
        if !sb.data.contains(i.xattr) {
            out.push(format!(
                "inode {ino}: xattr block {} lies outside the data region",
                i.xattr
            ));
        } else {
            own(i.xattr, out);
            if !out.quiet {
                if let Err(why) = decode_xattrs(&img.read(i.xattr, 1)?) {
                    out.push(format!("inode {ino}: xattr block {}: {why}", i.xattr));
                }
            }
        }
    }
    if i.flags & INODE_LEAVES == 0 {
        return Ok(i.extents);
    }
    let mut all = Vec::new();
    for (k, leaf) in i.extents.iter().enumerate() {
        if !sb.data.contains(leaf.physical) {
            out.push(format!(
                "inode {ino}: extent leaf {k} (block {}) lies outside the data region",
                leaf.physical
            ));
            continue;
        }
        own(leaf.physical, out);
        match decode_leaf(ino, &img.read(leaf.physical, 1)?) {
            Ok(es) if es.len() == leaf.len as usize => all.extend(es),
            Ok(es) => out.push(format!(
                "inode {ino}: extent leaf {k} holds {} extents, the inode says {}",
                es.len(),
                leaf.len
            )),
            Err(why) => out.push(format!(
                "inode {ino}: extent leaf {k} (block {}): {why}",
                leaf.physical
            )),
        }
    }
    Ok(all)
}

/// Whether extent `e` lies inside the data region (an empty one does not count).
fn in_data(sb: &Superblock, e: &Extent) -> bool {
    e.physical >= sb.data.start && e.physical.saturating_add(e.len as u64) <= sb.data.end()
}

/// Checks inode `ino`'s extents (not empty, in order, inside the largest file and the data
/// region); `own` hears each block of those inside the data region.
fn data_extents(
    sb: &Superblock,
    ino: u64,
    es: &[Extent],
    out: &mut Problems,
    own: &mut dyn FnMut(u64, &mut Problems),
) {
    let mut last_end = 0u64;
    for (k, e) in es.iter().enumerate() {
        if e.len == 0 {
            out.push(format!("inode {ino}: extent {k} is empty"));
            continue;
        }
        if k > 0 && e.logical < last_end {
            out.push(format!(
                "inode {ino}: extent {k} overlaps or precedes the one before"
            ));
        }
        last_end = e.logical.saturating_add(e.len as u64);
        if last_end > MAX_FILE_BYTES / BLOCK as u64 {
            out.push(format!(
                "inode {ino}: extent {k} maps file blocks {}.. past the largest file",
                e.logical
            ));
        }
        let end = e.physical.saturating_add(e.len as u64);
        if !in_data(sb, e) {
            out.push(format!(
                "inode {ino}: extent {k} (blocks {}..{end}) lies outside the data region {}..{}",
                e.physical,
                sb.data.start,
                sb.data.end()
            ));
            continue;
        }
        for b in e.physical..end {
            own(b, out);
        }
    }
}

/// The problems naming the owners of blocks owned more than once, at most `room` of them: a
/// second walk of every inode in use, in the order of the first, that follows only the first
/// `room` such blocks. A block owned by inodes A, then B, then C is "A and B", then "B and C".
fn name_owners(
    img: &Img<'_>,
    sb: &Superblock,
    ibm: &[u8],
    owned: &Owned,
    room: usize,
) -> Result<Vec<String>, FsError> {
    let mut last: HashMap<u64, Option<u64>> = owned
        .repeated(room)
        .into_iter()
        .map(|b| (b, None))
        .collect();
    let mut named = Vec::new();
    let mut quiet = Problems::quiet();
    each_slot(img, sb, |ino, slot| {
        if !bit(ibm, ino) {
            return Ok(true);
        }
        let Ok(Some(i)) = Inode::decode(slot) else {
            return Ok(true);
        };
        let mut note = |b: u64, _: &mut Problems| {
            if let Some(l) = last.get_mut(&b) {
                if let Some(other) = l.replace(ino) {
                    if named.len() < room {
                        named.push(format!(
                            "block {b} belongs to inode {other} and inode {ino}"
                        ));
                    }
                }
            }
        };
        let es = extents_of(img, sb, ino, i, &mut quiet, &mut note)?;
        data_extents(sb, ino, &es, &mut quiet, &mut note);
        Ok(named.len() < room)
    })?;
    Ok(named)
}

fn check(img: Img<'_>, plp: bool) -> Result<Report, FsError> {
    let mut problems = Problems::new();
    let mut notes = Vec::new();
    let (sb, problem) = superblock_in(&img)?;
    if let Some(p) = problem {
        problems.push(p);
    }
    if sb.mounted {
        notes.push(
            "marked mounted: it was not unmounted cleanly (mount replays the journal)".into(),
        );
    }
    // Journal areas first: what they hold committed is what mount's replay writes home, so the
    // structures are checked as they will be after it (fsck itself writes nothing).
    let mut img = img;
    // The attribute logs say which Rio-ordered commits are durable (version 2 images).
    let prefix = if sb.rio_log(0).is_some() {
        let b = BLOCK as u64;
        match crate::rio::prefixes(&sb, plp, &mut |at, len| img.read(at / b, len as u64 / b)) {
            Ok(p) => p,
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        }
    } else {
        None
    };
    let mut logs = Vec::new();
    for a in 0..sb.journal_areas {
        let (off, blocks) = sb.journal_area(a);
        let area = img.read(off / BLOCK as u64, blocks)?;
        let p = prefix.as_ref().map(|p| p[a as usize]);
        match journal::recovery::parse_area_rio(&area, a as usize, p) {
            Err(e) => problems.push(format!("journal area {a}: {e}")),
            Ok(log) => {
                if let journal::LogEnd::Corrupt { pos, why } = &log.end {
                    problems.push(format!(
                        "journal area {a} is damaged at log block {pos}: {why}"
                    ));
                }
                logs.push(log);
            }
        }
    }
    if logs.len() == sb.journal_areas as usize {
        match journal::recovery::apply_rio_prefix(&mut logs, prefix.as_deref()) {
            Ok(0) => {}
            Ok(n) => notes.push(format!(
                "{n} Rio-ordered commits are past what the attribute logs show durable (never acknowledged; mount drops them)"
            )),
            Err(e) => problems.push(format!("journal: {e}")),
        }
    }
    let from = journal::recovery::home_below(&logs);
    let pending: usize = logs
        .iter()
        .map(|l| l.txs.iter().filter(|t| t.tid >= from).count())
        .sum();
    if pending > 0 {
        notes.push(format!(
            "the journal holds {pending} committed transactions not yet written home (mount replays them; checked as replayed)"
        ));
    }
    let mut overlay = HashMap::new();
    for (b, data) in journal::recovery::merge(&logs, from) {
        if b < img.blocks {
            overlay.insert(b, data.to_vec());
        }
    }
    img.overlay = overlay;

    let ibm = img.read(sb.inode_bitmap.start, sb.inode_bitmap.count)?;
    let bbm = img.read(sb.block_bitmap.start, sb.block_bitmap.count)?;

    // Inodes, read in pieces of the table. Of each inode in use only its type and link count
    // are kept; its extents (and leaves, and xattr block) are checked as it is read, and the
    // blocks they take marked in `owned`, a bit a block of the data region.
    let mut nodes: Vec<Node> = Vec::new();
    let mut owned = Owned::new(sb.data);
    if !bit(&ibm, 0) {
        problems.push("inode 0 (reserved) is marked free".into());
    }
    each_slot(&img, &sb, |ino, slot| {
        let used = bit(&ibm, ino);
        let i = match Inode::decode(slot) {
            Err(why) => {
                problems.push(format!("inode {ino}: {why}"));
                return Ok(true);
            }
            Ok(None) if used => {
                problems.push(format!("inode {ino} is marked in use but empty"));
                return Ok(true);
            }
            Ok(None) => return Ok(true),
            Ok(Some(_)) if !used => {
                problems.push(format!("inode {ino} holds an inode but is marked free"));
                return Ok(true);
            }
            Ok(Some(i)) => i,
        };
        nodes.push(Node {
            ino,
            mode: i.mode,
            nlink: i.nlink,
        });
        let (mode, size) = (i.mode, i.size);
        // Extent leaves and xattr blocks, then extents: each block of the data region owned
        // by one inode, once, and marked in use.
        let mut own = |b: u64, out: &mut Problems| {
            owned.own(b);
            if !bit(&bbm, b) {
                out.push(format!("block {b} of inode {ino} is marked free"));
            }
        };
        let es = extents_of(&img, &sb, ino, i, &mut problems, &mut own)?;
        data_extents(&sb, ino, &es, &mut problems, &mut own);
        // The mount reads a directory's `size / BLOCK` blocks from file block 0 on, and a
        // symlink's target (at most one block) from file block 0.
        let mapped = |l: u64| {
            es.iter()
                .any(|e| e.len > 0 && l >= e.logical && l - e.logical < e.len as u64)
        };
        match mode & S_IFMT {
            S_IFDIR => {
                let blocks = size / BLOCK as u64;
                let total: u64 = es.iter().map(|e| e.len as u64).sum();
                let inside = es
                    .iter()
                    .all(|e| e.len == 0 || e.logical.saturating_add(e.len as u64) <= blocks);
                if size % BLOCK as u64 != 0 || blocks == 0 || total != blocks || !inside {
                    problems.push(format!(
                        "directory inode {ino}: size {size} does not match its {total} mapped blocks"
                    ));
                }
            }
            S_IFLNK if size > BLOCK as u64 || !mapped(0) => problems.push(format!(
                "symlink inode {ino}: a target of {size} bytes{}",
                if mapped(0) {
                    " is longer than a block"
                } else {
                    " without its block"
                }
            )),
            _ => {}
        }
        Ok(true)
    })?;
    for ino in sb.inodes..(sb.inode_bitmap.count * BLOCK as u64 * 8) {
        if bit(&ibm, ino) {
            problems.push(format!("inode bitmap bit {ino} is set past the last inode"));
            break;
        }
    }
    // Blocks owned more than once: their owners are named by a second walk, for as many as
    // the report lists.
    if owned.repeats > 0 {
        let room = problems.room();
        let named = if room > 0 {
            name_owners(&img, &sb, &ibm, &owned, room)?
        } else {
            Vec::new()
        };
        let n = named.len() as u64;
        for p in named {
            problems.push(p);
        }
        problems.count_unlisted(owned.repeats.saturating_sub(n));
    }
    for b in 0..sb.data.start {
        if !bit(&bbm, b) {
            problems.push(format!("metadata block {b} is marked free"));
            break;
        }
    }
    if !bit(&bbm, sb.blocks - 1) {
        problems.push("the backup superblock's block is marked free".into());
    }
    let mut used_blocks = sb.data.start + 1;
    for b in sb.data.start..sb.data.end() {
        if bit(&bbm, b) {
            used_blocks += 1;
            if !owned.owned(b) {
                problems.push(format!("block {b} is marked in use but no file owns it"));
            }
        }
    }
    drop(owned);

    // Directories: entries, "." and "..", types, names; link counts and reachability. Each
    // directory's inode and extent leaves are read again, and its blocks in pieces.
    let mut refs: HashMap<u64, u32> = HashMap::new();
    let mut parent_of: HashMap<u64, u64> = HashMap::new();
    let mut dotdot: HashMap<u64, u64> = HashMap::new();
    let mut children: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut subdirs: HashMap<u64, u32> = HashMap::new();
    let mut quiet = Problems::quiet();
    let mut table_block: Option<(u64, Vec<u8>)> = None;
    for n in nodes.iter().filter(|n| n.is_dir()) {
        let ino = n.ino;
        let tb = ino / INODES_PER_BLOCK as u64;
        if table_block.as_ref().is_none_or(|(at, _)| *at != tb) {
            table_block = Some((tb, img.read(sb.inode_table.start + tb, 1)?));
        }
        let slot = &table_block.as_ref().expect("read above").1
            [(ino % INODES_PER_BLOCK as u64) as usize * INODE_BYTES..];
        let Ok(Some(i)) = Inode::decode(slot) else {
            continue; // read the same way above
        };
        let es = extents_of(&img, &sb, ino, i, &mut quiet, &mut |_, _| {})?;
        let mut names = HashSet::new();
        let (mut dot, mut dd) = (false, false);
        for e in &es {
            if !in_data(&sb, e) {
                continue; // reported above
            }
            let mut done = 0u64;
            while done < e.len as u64 {
                let count = (e.len as u64 - done).min(DIR_CHUNK_BLOCKS);
                let blocks = img.read(e.physical + done, count)?;
                for (k, blk) in blocks.chunks(BLOCK).enumerate() {
                    let at = e.physical + done + k as u64;
                    let entries = match decode_dir_block(blk) {
                        Ok(x) => x,
                        Err(why) => {
                            problems.push(format!("directory inode {ino}, block {at}: {why}"));
                            continue;
                        }
                    };
                    for d in entries {
                        let name = String::from_utf8_lossy(&d.name).into_owned();
                        if !names.insert(d.name.clone()) {
                            problems
                                .push(format!("directory inode {ino} has two entries {name:?}"));
                        }
                        if d.name == b"." {
                            dot = true;
                            if d.ino != ino {
                                problems.push(format!(
                                    "directory inode {ino}: \".\" points to {}",
                                    d.ino
                                ));
                            }
                            continue;
                        }
                        if d.name == b".." {
                            dd = true;
                            dotdot.insert(ino, d.ino);
                            continue;
                        }
                        if d.name.contains(&b'/') || d.name.contains(&0) {
                            problems.push(format!(
                                "directory inode {ino}: entry {name:?} has a '/' or NUL"
                            ));
                        }
                        if d.ino == ROOT_INO {
                            problems.push(format!(
                                "directory inode {ino}: {name:?} names the root directory"
                            ));
                            continue;
                        }
                        let Some(target) = node(&nodes, d.ino) else {
                            problems.push(format!(
                                "directory inode {ino}: {name:?} points to inode {}, which is not in use",
                                d.ino
                            ));
                            continue;
                        };
                        if (target.mode & S_IFMT) >> 12 != d.kind as u32 {
                            problems.push(format!(
                                "directory inode {ino}: {name:?} says type {} but inode {} is type {}",
                                d.kind,
                                d.ino,
                                (target.mode & S_IFMT) >> 12
                            ));
                        }
                        *refs.entry(d.ino).or_default() += 1;
                        children.entry(ino).or_default().push(d.ino);
                        if target.is_dir() {
                            *subdirs.entry(ino).or_default() += 1;
                            if let Some(p) = parent_of.insert(d.ino, ino) {
                                problems.push(format!(
                                    "directory inode {} is in two directories ({p} and {ino})",
                                    d.ino
                                ));
                            }
                        }
                    }
                }
                done += count;
            }
        }
        if !dot || !dd {
            problems.push(format!("directory inode {ino} lacks \".\" or \"..\""));
        }
    }
    drop(table_block);
    match node(&nodes, ROOT_INO) {
        Some(r) if r.is_dir() => {}
        _ => problems.push("the root directory (inode 1) is missing or not a directory".into()),
    }
    for (&d, &p) in &dotdot {
        let want = if d == ROOT_INO {
            ROOT_INO
        } else {
            parent_of.get(&d).copied().unwrap_or(0)
        };
        if want != 0 && p != want {
            problems.push(format!(
                "directory inode {d}: \"..\" points to {p}, its parent is {want}"
            ));
        }
    }
    // Reachability from the root.
    let mut seen = HashSet::from([ROOT_INO]);
    let mut q = VecDeque::from([ROOT_INO]);
    while let Some(d) = q.pop_front() {
        for &c in children.get(&d).map_or(&[][..], |v| &v[..]) {
            if seen.insert(c) {
                q.push_back(c);
            }
        }
    }
    let (mut files, mut directories, mut symlinks, mut other) = (0, 0, 0, 0);
    let mut orphans = 0u64;
    for i in &nodes {
        let ino = i.ino;
        match i.mode & S_IFMT {
            S_IFREG => files += 1,
            S_IFDIR => directories += 1,
            S_IFLNK => symlinks += 1,
            _ => other += 1,
        }
        if i.nlink == 0
            && ino != ROOT_INO
            && !refs.contains_key(&ino)
            && !parent_of.contains_key(&ino)
        {
            // Unlinked while open when the process stopped: freed by the next mount.
            orphans += 1;
            continue;
        }
        if !seen.contains(&ino) {
            problems.push(format!(
                "inode {ino} is in use but in no directory reachable from the root"
            ));
        }
        let want = if i.is_dir() {
            2 + subdirs.get(&ino).copied().unwrap_or(0)
        } else {
            refs.get(&ino).copied().unwrap_or(0)
        };
        if i.nlink != want {
            problems.push(format!(
                "inode {ino} has link count {}, found {want}",
                i.nlink
            ));
        }
    }

    if orphans > 0 {
        notes.push(format!(
            "{orphans} unlinked inodes still allocated (open when the file system stopped; the next mount frees them)"
        ));
    }
    let used_inodes = nodes.len() as u64;
    Ok(Report {
        superblock: sb,
        problems: problems.into_list(),
        notes,
        files,
        directories,
        symlinks,
        other,
        used_blocks,
        used_inodes,
    })
}
