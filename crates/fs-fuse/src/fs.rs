//! The mounted file system: aiosfs's in-memory state over its on-disk format, with every change
//! made durable through the journal. It knows nothing of FUSE (`mount.rs` adapts it), so the
//! same code runs under SimDisk crash tests.
//!
//! - **Metadata** (inodes, bitmaps, directory blocks, extent leaves, xattr blocks, symlink
//!   targets) is loaded on first use and kept in memory; a change marks what it touched dirty.
//!   A commit encodes the dirty blocks from memory and hands them to the journal as one
//!   transaction, so the image only ever moves from one consistent state to the next. Metadata
//!   never goes home except through the journal's checkpoint.
//! - **File data** written through the mount waits in per-file dirty blocks. A commit writes them
//!   in place (`Tx::write_data`) before its commit block, ordered-mode style: `fsync(file)`
//!   carries that file's dirty blocks and every other file's blocks allocated since the last
//!   commit, so no committed extent ever points at unwritten blocks.
//! - **Block reuse**: a freed block is not handed out again until the commit that freed it is
//!   durable (the journal's commit includes the FLUSH, or FUA writes), and a freed block that was
//!   ever journaled is revoked in that commit, so no replay can overwrite its next owner's data.
//! - Each worker thread has its own engine, lbio array, device and journal handle (its own
//!   journal area); one mutex guards the file system's state, and a commit holds it.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use aios_core::{Engine, EngineConfig};
use journal::format::REVOKES_PER_BLOCK;
use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
use lbio::{Device, LbioArray, LbioConfig};
use pagecache::{CacheConfig, CacheHandle, CacheMetrics, FileId, Mode, PageCache};
use smallvec::SmallVec;

use crate::error::FsError;
use crate::format::{
    bit, clear_bit, decode_dir_block, decode_leaf, decode_xattrs, encode_dir_block, encode_leaf,
    encode_xattrs, set_bit, xattr_bytes, DirEntry, Extent, Inode, Superblock, BLOCK,
    INLINE_EXTENTS, INODES_PER_BLOCK, INODE_BYTES, INODE_LEAVES, LEAF_EXTENTS, NAME_MAX, ROOT_INO,
    S_IFDIR, S_IFLNK, S_IFMT,
};

/// An errno value (`libc::ENOENT`, …).
pub type Errno = i32;
pub type FsResult<T> = Result<T, Errno>;

const B: u64 = BLOCK as u64;
/// Device runs a read keeps inline: [`Fs::read_into`] allocates only for a range of more
/// extents than this.
pub const READ_RUNS_INLINE: usize = 16;

/// Tests only: microseconds an in-place fsync sleeps between its writes and taking the lock
/// again, to widen the window in which other threads commit and write the same blocks. 0 (no
/// sleep) unless a test sets it.
#[doc(hidden)]
pub static IN_PLACE_TEST_PAUSE_US: AtomicU64 = AtomicU64::new(0);
/// Tests only: in-place fsyncs that have begun that pause (their writes done, the lock not yet
/// taken back), so a test can act once one is in its window.
#[doc(hidden)]
pub static IN_PLACE_TEST_PAUSES: AtomicU64 = AtomicU64::new(0);
/// Tests only: microseconds the next commit made with the state lock released sleeps between
/// the device's answer and taking the lock again, to widen the window in which other threads
/// work beside it (that commit sets it back to 0). 0 (no sleep) unless a test sets it.
#[doc(hidden)]
pub static COMMIT_TEST_PAUSE_US: AtomicU64 = AtomicU64::new(0);

#[doc(hidden)]
/// Test only: when nonzero, the step of freeing a large range (`Fs::free_range`) that would
/// make this many commits between its steps stops there with EIO instead, as if the file
/// system had stopped (a test then drops it without unmounting: a crash after those commits).
/// Set back to 0 when it fires.
pub static FREE_TEST_STOP_AFTER: AtomicU64 = AtomicU64::new(0);
thread_local! {
    /// Tests only: microseconds this thread's next read sleeps between finding its blocks
    /// (under the state lock) and reading them (that read sets it back to 0, and sets
    /// [`READ_TEST_PAUSED`]). Per thread: the other tests of a binary read beside the one
    /// that sets it. 0 (no sleep) unless a test sets it.
    #[doc(hidden)]
    pub static READ_TEST_PAUSE_US: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
/// Tests only: a read took its [`READ_TEST_PAUSE_US`] pause (the test clears it).
#[doc(hidden)]
pub static READ_TEST_PAUSED: AtomicBool = AtomicBool::new(false);
/// The journaled-block mark of a block whose commit is in flight (its id is not known yet).
const TID_IN_FLIGHT: u64 = u64::MAX;

/// The device's answer to a commit in flight without the state lock, for whoever applies it.
#[derive(Default)]
struct CommitSignal {
    /// The commit's id and whether it journaled the data (`None`: nothing to write), or why
    /// it failed.
    result: Mutex<Option<CommitResult>>,
    ready: Condvar,
}

type CommitResult = Result<Option<(u64, bool)>, String>;

/// Commit `tx` through this worker's journal handle, as a [`CommitResult`].
fn journal_commit(ctx: &Ctx, tx: &Tx) -> CommitResult {
    ctx.journal
        .commit(tx)
        .map(|i| Some((i.tid, i.data_journaled)))
        .map_err(|e| e.to_string())
}

impl CommitSignal {
    fn set(&self, r: CommitResult) {
        *self.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.ready.notify_all();
    }

    fn wait(&self) -> CommitResult {
        let mut g = self.result.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return r.clone();
            }
            g = self.ready.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// What a built transaction covers, to bring the state up to date once it is committed.
struct AfterCommit {
    tx: Arc<Tx>,
    /// The data blocks, as (inode, logical block, physical block), in the transaction's order.
    written: Vec<(u64, u64, u64)>,
    meta_blocks: Vec<u64>,
    /// Blocks freed before the transaction was built: allocatable once it is durable.
    quarantined: Vec<u64>,
    /// One-write mode: each data block's journaled mark before the commit (see
    /// [`Fs::build_commit`]); empty otherwise.
    data_marks: Vec<Option<u64>>,
    file: bool,
    /// Xattrs this commit had to leave for a later one (no block for them) belong to the file
    /// it commits, or it commits everything: the caller gets ENOSPC once it is applied.
    short: bool,
    /// Revoke records in the transaction.
    revokes: usize,
}

/// A commit whose device work runs with the state lock released.
struct Committing {
    signal: Arc<CommitSignal>,
    after: AfterCommit,
}

/// Extents a file can have: eight leaves of [`LEAF_EXTENTS`].
pub const MAX_EXTENTS: usize = INLINE_EXTENTS * LEAF_EXTENTS;

pub use crate::format::MAX_FILE_BYTES;

/// Extent leaf blocks a map of `extents` extents takes (none while they fit the inode).
/// A partial block a punched hole zeroes: file block, byte range, and the block as read
/// ([`Fs::read_for_zeroing`]).
type ZeroEdge = (u64, usize, usize, Option<Box<[u8]>>);

/// The most blocks one step of [`Fs::free_range`] frees (1 GiB): the blocks freed and
/// quarantined until the commit are held in memory one by one.
const FREE_STEP_BLOCKS: u64 = 1 << 18;

/// Where the next step of [`Fs::free_range`] starts: the lowest `c` in `[a, b)` such that
/// unmapping `[c, b)` of `n` frees at most [`FREE_STEP_BLOCKS`] blocks, and dirties block-bitmap
/// blocks not already in `dirty_bbm` and adds revoke blocks (one record for each freed block in
/// `journaled`, [`REVOKES_PER_BLOCK`] to a log block) that together number at most `budget`;
/// `a` when all of `[a, b)` fits. Always below `b` when something is mapped there, so every
/// step makes progress.
fn free_cut(
    n: &Node,
    a: u64,
    b: u64,
    budget: usize,
    dirty_bbm: &BTreeSet<u64>,
    journaled: &HashMap<u64, u64>,
) -> u64 {
    let per = B * 8;
    let per_revoke_block = REVOKES_PER_BLOCK as u64;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut blocks = 0u64;
    let mut revokes = 0u64;
    for (&s, &(p, len)) in n.map.range(..b).rev() {
        let e = s + len as u64;
        if e <= a {
            break;
        }
        let (lo, hi) = (a.max(s), b.min(e));
        let mut top = hi;
        while top > lo {
            // The run of [lo, top) whose blocks share the bitmap block of the last one.
            let bm = (p + (top - 1 - s)) / per;
            let low = (bm * per).checked_sub(p).map_or(lo, |d| (s + d).max(lo));
            if !dirty_bbm.contains(&bm) && seen.insert(bm) && seen.len() > budget {
                return top;
            }
            // Revoke records the rest of the budget holds beside the bitmap blocks.
            let room = (budget - seen.len()) as u64 * per_revoke_block;
            if revokes > room {
                // This run's bitmap block does not fit beside the revokes taken so far.
                return top;
            }
            let mut cut = low;
            if !journaled.is_empty() {
                // The run's journaled blocks, physical [p + low - s, p + top - s).
                let (plo, phi) = (p + (low - s), p + (top - s));
                let mut hits: Vec<u64> = if phi - plo <= journaled.len() as u64 {
                    (plo..phi).filter(|q| journaled.contains_key(q)).collect()
                } else {
                    journaled
                        .keys()
                        .copied()
                        .filter(|q| (plo..phi).contains(q))
                        .collect()
                };
                if revokes + hits.len() as u64 > room {
                    // Stop just above the first journaled block that no longer fits.
                    hits.sort_unstable_by(|x, y| y.cmp(x));
                    let q = hits[(room - revokes) as usize];
                    cut = s + (q - p) + 1;
                }
                revokes += hits.len() as u64;
            }
            if blocks + (top - low) > FREE_STEP_BLOCKS {
                cut = cut.max(top - (FREE_STEP_BLOCKS - blocks));
            }
            if cut > low {
                // Nothing taken yet (a budget of one bitmap block, no room left for a revoke
                // block): the top block all the same, so that the step makes progress.
                return if blocks == 0 && cut == top {
                    top - 1
                } else {
                    cut
                };
            }
            blocks += top - low;
            top = low;
        }
    }
    a
}

fn leaves_for(extents: usize) -> usize {
    if extents <= INLINE_EXTENTS {
        0
    } else {
        extents.div_ceil(LEAF_EXTENTS)
    }
}

/// Changes older than this are committed by the next operation (or the mount's flusher).
pub const COMMIT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// Slots of a directory block (the smallest entry takes 11 bytes).
const DIR_SLOTS: u64 = 512;

/// Opens the file system's device on a worker's lbio array (a file, a block device or a
/// SimDisk).
pub type DeviceFactory = Arc<dyn Fn(&Rc<LbioArray>) -> Result<Device, FsError> + Send + Sync>;

/// Settings of a mounted file system.
#[derive(Clone, Debug)]
pub struct FsOptions {
    pub commit_mode: CommitMode,
    /// Rio-ordered commits (`aios mount --commit rio`, Rio §4.7): a worker that takes a journal
    /// area of its own commits through the area's attribute log, with no FLUSH between journal
    /// and commit block (one FLUSH at the end makes the commit durable). A worker that finds
    /// every area already taken by a Rio handle commits with `commit_mode` into a shared area
    /// (counted in [`FsStats::shared_handles`]). Needs an image with attribute logs.
    pub rio: bool,
    /// Dirty file data (bytes) above which a writer commits everything.
    pub dirty_limit: usize,
    /// Registered arena of each worker's engine.
    pub arena_bytes: usize,
    /// How a worker waits for its I/O: sleep in `io_uring_enter`, spin on the completion
    /// queue (no wake-up latency; the worker's core is busy while it waits), or spin for a
    /// bounded time and then sleep (the default, [`aios_core::CompletionMode::hybrid`]).
    pub completion: aios_core::CompletionMode,
    /// Bytes of the page cache that holds clean file data for all workers (`pagecache`, AIOS's
    /// read path), or 0 for none (every read of clean data goes to the device).
    pub cache_bytes: usize,
}

impl Default for FsOptions {
    fn default() -> Self {
        FsOptions {
            commit_mode: CommitMode::Overlapped,
            rio: false,
            dirty_limit: 16 << 20,
            arena_bytes: 48 << 20,
            completion: aios_core::CompletionMode::hybrid(),
            cache_bytes: 64 << 20,
        }
    }
}

/// Attributes of a file, as `stat` reports them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub size: u64,
    /// 512-byte sectors allocated.
    pub blocks: u64,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub generation: u32,
}

/// Who asks (for the owner of what they create).
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

/// Changes of `setattr`; `None` leaves a field alone.
#[derive(Clone, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Option<(i64, u32)>>,
    pub mtime: Option<Option<(i64, u32)>>,
    /// Clear set-user-ID, set-group-ID (when group-executable) and `security.capability` of a
    /// regular file, as a chown, or a truncate by a process without `CAP_FSETID`, does
    /// (`FATTR_KILL_SUIDGID`).
    pub kill_privs: bool,
}

/// `statfs` figures.
#[derive(Clone, Copy, Debug)]
pub struct StatFs {
    pub blocks: u64,
    pub bfree: u64,
    pub files: u64,
    pub ffree: u64,
}

/// Counters of a mounted file system.
#[derive(Debug, Default)]
pub struct FsStats {
    pub commits: AtomicU64,
    pub fsync_commits: AtomicU64,
    /// fsyncs that had only data in blocks the file owned: written in place, no transaction.
    pub fsync_in_place: AtomicU64,
    pub data_blocks_written: AtomicU64,
    pub meta_blocks_written: AtomicU64,
    pub reads: AtomicU64,
    /// Workers committing Rio-ordered, each on an area of its own (`FsOptions::rio`).
    pub rio_handles: AtomicU64,
    /// Workers of a Rio mount that found every area taken and commit with the commit mode into
    /// a shared area.
    pub shared_handles: AtomicU64,
    /// Commits made between two steps of freeing a range too large for one transaction.
    pub free_steps: AtomicU64,
    /// Revoke records committed (one per freed block whose journaled copy was not yet home).
    pub revokes: AtomicU64,
    /// The most log blocks one committed transaction took besides journaled data: its
    /// metadata, revoke blocks, descriptors and commit block.
    pub largest_tx_log_blocks: AtomicU64,
}

fn dec(n: &mut u32) {
    *n = n.saturating_sub(1);
}

/// The time stamped on writes: the kernel's coarse clock, as Linux file systems stamp changes,
/// so a burst of writes within one clock tick changes the inode once (and an fsync after the
/// others has only data to make durable).
pub fn change_time() -> (i64, u32) {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_REALTIME_COARSE) {
        Ok(t) => (t.tv_sec(), t.tv_nsec() as u32),
        Err(_) => now(),
    }
}

pub fn now() -> (i64, u32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

struct Ctx {
    /// This worker's handle on the data cache (dropped before the journal: it holds the same
    /// engine).
    cache: Option<(CacheHandle, FileId)>,
    journal: Journal,
}

impl Ctx {
    fn dev(&self) -> &Device {
        self.journal.device()
    }
    fn engine(&self) -> &Rc<Engine> {
        self.dev().lbio().engine()
    }
    fn read_blocks(&self, block: u64, count: u64) -> FsResult<Vec<u8>> {
        let len = (count * B) as usize;
        let buf = self.engine().alloc_blocking(len).map_err(io_err)?;
        let buf = self
            .dev()
            .read_at_blocking(block * B, buf)
            .map_err(io_err)?;
        Ok(buf[..len].to_vec())
    }
    /// File data from `block` on into `dst`: through the page cache (straight into `dst`)
    /// unless `direct` (or the mount has none).
    fn read_data(&self, fs: &Fs, block: u64, dst: &mut [u8], direct: bool) -> FsResult<()> {
        self.read_bytes(fs, block * B, dst, direct)
    }

    /// The device's bytes from byte `at` on into `dst` (any offset and length): through the
    /// page cache unless `direct` (or the mount has none), else the blocks covering them read
    /// into an arena buffer and the part asked for copied out. No heap allocation either way.
    fn read_bytes(&self, fs: &Fs, at: u64, dst: &mut [u8], direct: bool) -> FsResult<()> {
        match &self.cache {
            Some((h, file)) if !direct && !fs.cache_off.load(Ordering::Acquire) => {
                h.read(*file, at, dst).map_err(io_err)
            }
            _ => {
                let skip = (at % B) as usize;
                let len = (skip + dst.len()).next_multiple_of(BLOCK);
                let buf = self.engine().alloc_blocking(len).map_err(io_err)?;
                let buf = self
                    .dev()
                    .read_at_blocking(at - skip as u64, buf)
                    .map_err(io_err)?;
                dst.copy_from_slice(&buf[skip..skip + dst.len()]);
                Ok(())
            }
        }
    }

    /// `bytes` of file data are now on the device at `block`: the page cache keeps them, and
    /// drops whatever copy it had. If it cannot, no worker reads through the cache again (a
    /// stale copy could stay in it).
    fn stored(&self, fs: &Fs, block: u64, bytes: &[u8]) {
        let Some((h, file)) = &self.cache else { return };
        if fs.cache_off.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = h.store(*file, block * B, bytes) {
            eprintln!(
                "aiosfs: the page cache could not take the new bytes of block {block} ({e}); \
                 reads go to the device from now on"
            );
            fs.cache_off.store(true, Ordering::Release);
        }
    }

    fn write_block(&self, block: u64, bytes: &[u8]) -> FsResult<()> {
        let mut buf = self.engine().alloc_blocking(bytes.len()).map_err(io_err)?;
        buf.set_len(bytes.len()).map_err(io_err)?;
        buf.copy_from_slice(bytes);
        self.dev()
            .write_at_blocking(block * B, buf, false)
            .map_err(io_err)?;
        Ok(())
    }
}

fn io_err<E: std::fmt::Display>(e: E) -> Errno {
    eprintln!("aiosfs: I/O error: {e}");
    libc::EIO
}

thread_local! {
    static CTX: RefCell<HashMap<u64, Rc<Ctx>>> = RefCell::new(HashMap::new());
}

static NEXT_FS_ID: AtomicU64 = AtomicU64::new(1);

/// A directory's entries, indexed by name; block `b`'s entries sit in `blocks[b]`, in slots
/// whose positions are stable while it is loaded (they are `readdir`'s cookies).
#[derive(Default)]
struct Dir {
    index: HashMap<Vec<u8>, (u32, u16)>,
    blocks: Vec<DBlock>,
    dirty: BTreeSet<u32>,
}

#[derive(Default, Clone)]
struct DBlock {
    slots: Vec<Option<DirEntry>>,
    used: usize,
}

fn entry_bytes(name: &[u8]) -> usize {
    10 + name.len()
}

impl Dir {
    fn get(&self, name: &[u8]) -> Option<&DirEntry> {
        let &(b, s) = self.index.get(name)?;
        self.blocks[b as usize].slots[s as usize].as_ref()
    }
    fn remove(&mut self, name: &[u8]) -> Option<DirEntry> {
        let (b, s) = self.index.remove(name)?;
        let blk = &mut self.blocks[b as usize];
        let e = blk.slots[s as usize].take()?;
        blk.used -= entry_bytes(&e.name);
        self.dirty.insert(b);
        Some(e)
    }
    /// Place an entry in the first block with room; `None` when a new block is needed.
    fn insert(&mut self, e: DirEntry) -> Result<(), DirEntry> {
        let need = entry_bytes(&e.name);
        for (bi, blk) in self.blocks.iter_mut().enumerate() {
            if blk.used + need <= BLOCK {
                let slot = match blk.slots.iter().position(Option::is_none) {
                    Some(s) => s,
                    None if (blk.slots.len() as u64) < DIR_SLOTS => {
                        blk.slots.push(None);
                        blk.slots.len() - 1
                    }
                    None => continue,
                };
                blk.used += need;
                self.index.insert(e.name.clone(), (bi as u32, slot as u16));
                blk.slots[slot] = Some(e);
                self.dirty.insert(bi as u32);
                return Ok(());
            }
        }
        Err(e)
    }
    fn push_block(&mut self, e: DirEntry) {
        let bi = self.blocks.len() as u32;
        self.index.insert(e.name.clone(), (bi, 0));
        self.blocks.push(DBlock {
            used: crate::format::DIR_HEADER + entry_bytes(&e.name),
            slots: vec![Some(e)],
        });
        self.dirty.insert(bi);
    }
    /// Entries other than "." and ".." (a damaged directory may lack either).
    fn children(&self) -> usize {
        let dots = [&b"."[..], &b".."[..]]
            .into_iter()
            .filter(|d| self.index.contains_key(*d))
            .count();
        self.index.len() - dots
    }
}

struct Node {
    attr: Inode,
    /// logical block -> (physical block, length)
    map: BTreeMap<u64, (u64, u32)>,
    leaves: Vec<u64>,
    dir: Option<Dir>,
    xattrs: Option<crate::format::Xattrs>,
    dirty: BTreeMap<u64, Box<[u8]>>,
    /// Blocks allocated since the last commit (their data must reach the device before any
    /// commit that maps them).
    fresh: BTreeSet<u64>,
    /// Size or block map changed (or the inode is new) since the last commit: what
    /// `fdatasync` must commit, where a change of times or owner alone need not be.
    layout_dirty: bool,
    lookups: u64,
    opens: u32,
}

impl Node {
    fn phys(&self, l: u64) -> Option<u64> {
        let (&start, &(p, len)) = self.map.range(..=l).next_back()?;
        (l < start + len as u64).then(|| p + (l - start))
    }
    /// Would mapping `l` -> `p` create a new extent (rather than grow one)?
    fn joins(&self, l: u64, p: u64) -> bool {
        if let Some((&s, &(pp, len))) = self.map.range(..l).next_back() {
            if s + len as u64 == l && pp + len as u64 == p && len < u32::MAX {
                return true;
            }
        }
        matches!(self.map.get(&(l + 1)), Some(&(np, _)) if np == p + 1)
    }
    fn map_block(&mut self, l: u64, p: u64) {
        let mut start = l;
        let mut phys = p;
        let mut len = 1u32;
        if let Some((&s, &(pp, plen))) = self.map.range(..l).next_back() {
            if s + plen as u64 == l && pp + plen as u64 == p {
                start = s;
                phys = pp;
                len = plen + 1;
            }
        }
        if let Some(&(np, nlen)) = self.map.get(&(l + 1)) {
            if np == p + 1 {
                self.map.remove(&(l + 1));
                len += nlen;
            }
        }
        self.map.insert(start, (phys, len));
    }
    /// Unmap logical blocks `[a, b)`; returns the physical blocks freed.
    fn unmap(&mut self, a: u64, b: u64) -> Vec<u64> {
        let mut freed = Vec::new();
        let keys: Vec<u64> = self
            .map
            .range(..b)
            .rev()
            .take_while(|(&s, &(_, len))| s + len as u64 > a)
            .map(|(&s, _)| s)
            .collect();
        for s in keys {
            let (p, len) = self.map.remove(&s).expect("key");
            let e = s + len as u64;
            let (lo, hi) = (a.max(s), b.min(e));
            freed.extend((lo..hi).map(|l| p + (l - s)));
            if s < lo {
                self.map.insert(s, (p, (lo - s) as u32));
            }
            if hi < e {
                self.map.insert(hi, (p + (hi - s), (e - hi) as u32));
            }
        }
        freed
    }
    fn mapped_blocks(&self) -> u64 {
        self.map.values().map(|&(_, l)| l as u64).sum::<u64>()
            + self.leaves.len() as u64
            + (self.attr.xattr != 0) as u64
    }
    fn attr(&self, ino: u64) -> Attr {
        let a = &self.attr;
        Attr {
            ino,
            mode: a.mode,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: a.rdev,
            size: a.size,
            blocks: self.mapped_blocks() * (B / 512),
            atime: a.atime,
            mtime: a.mtime,
            ctime: a.ctime,
            generation: a.generation,
        }
    }
    fn kind(&self) -> u8 {
        ((self.attr.mode & S_IFMT) >> 12) as u8
    }
}

struct State {
    ibm: Vec<u8>,
    bbm: Vec<u8>,
    dirty_ibm: BTreeSet<u64>,
    dirty_bbm: BTreeSet<u64>,
    nodes: HashMap<u64, Node>,
    itab_loaded: HashSet<u64>,
    dirty_nodes: BTreeSet<u64>,
    /// Extent leaves of the nodes in `dirty_nodes` (counted when a node is first marked and
    /// when it takes a leaf; never less than the commit writes): [`Fs::meta_pending`] counts
    /// them, since a dirty inode's commit writes all its leaves.
    dirty_leaves: usize,
    /// The directories among `dirty_nodes`: the only nodes whose blocks can be dirty, kept
    /// apart so [`Fs::meta_pending`], asked after every change, looks at a few nodes rather
    /// than at every dirty one.
    dirty_dirs: BTreeSet<u64>,
    /// Files holding dirty data blocks (a commit looks at these, not at every node).
    dirty_data: BTreeSet<u64>,
    dirty_xattrs: BTreeSet<u64>,
    /// Metadata blocks whose content is fixed at creation (symlink targets).
    new_meta: BTreeMap<u64, Vec<u8>>,
    revokes: BTreeSet<u64>,
    /// Blocks journaled and not yet checkpointed, with the id of the last commit that journaled
    /// each (freeing one revokes it). Entries below the journal's `home_below` are dropped.
    journaled: HashMap<u64, u64>,
    /// The `home_below` the entries were last pruned at.
    journaled_pruned_at: u64,
    /// Freed since the last commit: not allocatable until it is durable.
    quarantine: HashSet<u64>,
    /// Physical blocks an fsync is writing in place with the lock released
    /// ([`Fs::write_in_place`]): another fsync of them commits instead. `true` once a commit
    /// has written the block since, or it was freed: the in-place copy is no longer the
    /// device's newest, or no longer the file's.
    in_place: HashMap<u64, bool>,
    free_blocks: u64,
    free_inodes: u64,
    block_cursor: u64,
    inode_cursor: u64,
    dirty_bytes: usize,
    failed: Option<String>,
    generation: u32,
    last_commit: std::time::Instant,
    /// The commit in flight with the lock released, if any ([`Fs::commit_unlocked`]).
    committing: Option<Committing>,
}

/// A mounted aiosfs.
pub struct Fs {
    id: u64,
    sb: Superblock,
    factory: DeviceFactory,
    set: Arc<JournalSet>,
    state: Mutex<State>,
    next_area: AtomicUsize,
    /// Held while a worker picks its area in a Rio mount (check and take in one step).
    rio_pick: Mutex<()>,
    /// Data writes in place with the state lock released hold this shared; a commit holds it
    /// exclusively, so no two writes of one block are ever in flight together. Taken only with
    /// the state lock held, and an fsync lets go of it before it takes the lock again, so the
    /// two cannot deadlock.
    in_place_gate: std::sync::RwLock<()>,
    /// A read holds this shared from finding its blocks (under the state lock) until it has
    /// read them (without it); blocks a commit frees become allocatable only once it has been
    /// held exclusively, so no read can get the bytes of a block's next owner. Taken with the
    /// state lock held, and a read lets go of the state lock before it reads.
    read_gate: std::sync::RwLock<()>,
    opts: FsOptions,
    log_len: u64,
    /// The page cache for clean file data (keyed by physical block: file 0 is the device).
    cache: Option<(Arc<PageCache>, FileId)>,
    /// Set when a store into the cache failed: reads go to the device from then on.
    cache_off: std::sync::atomic::AtomicBool,
    pub stats: FsStats,
}

impl Drop for Fs {
    fn drop(&mut self) {
        // This thread's engine for this file system (other threads' go with the threads).
        let _ = CTX.try_with(|m| m.borrow_mut().remove(&self.id));
    }
}

/// What `Fs::open` did and chose.
#[derive(Clone, Debug)]
pub struct OpenReport {
    pub replayed_transactions: usize,
    pub replayed_blocks: usize,
    pub orphans_freed: u64,
    pub durability: String,
    pub was_mounted: bool,
}

impl Fs {
    /// Open the aiosfs on the device `factory` opens: check the superblock, replay the
    /// journal, mark it mounted, load the bitmaps and free orphans. The caller checks the image
    /// (fsck) before, so a damaged one is refused before anything is written.
    pub fn open(factory: DeviceFactory, opts: FsOptions) -> Result<(Arc<Fs>, OpenReport), FsError> {
        let engine = Engine::new(EngineConfig {
            arena_bytes: opts.arena_bytes.min(8 << 20),
            huge_pages: false,
            ..EngineConfig::default()
        })?;
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
        let dev = factory(&lbio)?;
        let bytes = dev.geometry().capacity_bytes;
        let read = |block: u64, count: u64| -> Result<Vec<u8>, FsError> {
            let buf = engine.alloc_blocking((count * B) as usize)?;
            Ok(dev.read_at_blocking(block * B, buf)?[..(count * B) as usize].to_vec())
        };
        let mut sb = Superblock::decode(&read(0, 1)?, bytes / B)?;
        if opts.rio && sb.rio_log(0).is_none() {
            return Err(crate::rio::no_logs());
        }
        // The page cache before anything is written: a cache the settings cannot build refuses
        // the mount with the image as it was (not marked mounted, its journal not replayed).
        let cache = if opts.cache_bytes > 0 {
            let frames = (opts.cache_bytes / pagecache::PAGE_BYTES) as u32;
            let cfg = CacheConfig {
                capacity_bytes: opts.cache_bytes,
                pool_batch: (frames / 16).clamp(1, 32),
                // The kernel already reads ahead of a sequential reader (FUSE sends reads of
                // up to 128 KiB); and a read still in flight when a request returns would be
                // completed only by that worker's next request.
                readahead_pages: 0,
                huge_pages: true,
                vectored_reads: true,
                ..CacheConfig::default()
            };
            let pc = PageCache::new(cfg).map_err(|e| {
                FsError::Config(format!("page cache of {} bytes: {e}", opts.cache_bytes))
            })?;
            let file = pc
                .add_file(bytes)
                .map_err(|e| FsError::Config(format!("page cache: {e}")))?;
            Some((pc, file))
        } else {
            None
        };
        let was_mounted = sb.mounted;
        let areas = (0..sb.journal_areas).map(|i| sb.journal_area(i)).collect();
        // A version-2 image's attribute logs say which Rio-ordered commits are durable.
        let plp = dev.critical_route().0.power_loss_protected;
        let prefix = crate::rio::prefixes(&sb, plp, &mut |at, len| read(at / B, len as u64 / B))?;
        let (set, rec) = match &prefix {
            Some(p) => JournalSet::open_rio(&dev, Layout { areas }, p)?,
            None => JournalSet::open(&dev, Layout { areas })?,
        };
        if !rec.corrupt.is_empty() {
            return Err(FsError::Damaged(format!(
                "journal areas {:?} are damaged (replayed up to the damage)",
                rec.corrupt
            )));
        }
        sb.mounted = true;
        let mut sbb = vec![0u8; BLOCK];
        sb.encode(&mut sbb);
        let mut buf = engine.alloc_blocking(BLOCK)?;
        buf.set_len(BLOCK)?;
        buf.copy_from_slice(&sbb);
        dev.write_at_blocking(0, buf, false)?;
        dev.flush_blocking()?;
        let ibm = read(sb.inode_bitmap.start, sb.inode_bitmap.count)?;
        let bbm = read(sb.block_bitmap.start, sb.block_bitmap.count)?;
        let mut free_blocks = 0;
        for b in sb.data.start..sb.data.end() {
            free_blocks += !bit(&bbm, b) as u64;
        }
        let mut free_inodes = 0;
        for i in 1..sb.inodes {
            free_inodes += !bit(&ibm, i) as u64;
        }
        let probe = set.durability_probe();
        let durability = format!("{} ({})", probe.chosen.name(), probe.why);
        let log_len = sb.journal_blocks - 1;
        let fs = Arc::new(Fs {
            id: NEXT_FS_ID.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State {
                ibm,
                bbm,
                dirty_ibm: BTreeSet::new(),
                dirty_bbm: BTreeSet::new(),
                nodes: HashMap::new(),
                itab_loaded: HashSet::new(),
                dirty_nodes: BTreeSet::new(),
                dirty_leaves: 0,
                dirty_dirs: BTreeSet::new(),
                dirty_data: BTreeSet::new(),
                dirty_xattrs: BTreeSet::new(),
                new_meta: BTreeMap::new(),
                revokes: BTreeSet::new(),
                journaled: HashMap::new(),
                journaled_pruned_at: 0,
                quarantine: HashSet::new(),
                in_place: HashMap::new(),
                free_blocks,
                free_inodes,
                block_cursor: sb.data.start,
                inode_cursor: 2,
                dirty_bytes: 0,
                failed: None,
                generation: now().0 as u32,
                last_commit: std::time::Instant::now(),
                committing: None,
            }),
            sb,
            factory,
            set,
            next_area: AtomicUsize::new(0),
            rio_pick: Mutex::new(()),
            in_place_gate: std::sync::RwLock::new(()),
            read_gate: std::sync::RwLock::new(()),
            opts,
            log_len,
            cache,
            cache_off: std::sync::atomic::AtomicBool::new(false),
            stats: FsStats::default(),
        });
        drop(dev);
        let orphans = fs
            .free_orphans()
            .map_err(|e| FsError::Damaged(format!("freeing orphan inodes failed: errno {e}")))?;
        Ok((
            fs,
            OpenReport {
                replayed_transactions: rec.replayed.iter().map(Vec::len).sum(),
                replayed_blocks: rec.blocks_written,
                orphans_freed: orphans,
                durability,
                was_mounted,
            },
        ))
    }

    /// Dirty data that triggers a commit: the option, but at most a quarter of a worker's arena
    /// (a commit's buffers all come from it).
    fn dirty_limit(&self) -> usize {
        self.opts.dirty_limit.min(self.opts.arena_bytes / 4)
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn journal_set(&self) -> &Arc<JournalSet> {
        &self.set
    }

    pub fn options(&self) -> &FsOptions {
        &self.opts
    }

    /// The data cache's counters (`None` without one), with every worker's hits so far on
    /// this thread published first.
    pub fn cache_metrics(&self) -> Option<CacheMetrics> {
        let (pc, _) = self.cache.as_ref()?;
        if let Some(c) = CTX.with(|m| m.borrow().get(&self.id).cloned()) {
            if let Some((h, _)) = &c.cache {
                h.publish_metrics();
            }
        }
        Some(pc.metrics())
    }

    fn ctx(&self) -> FsResult<Rc<Ctx>> {
        if let Some(c) = CTX.with(|m| m.borrow().get(&self.id).cloned()) {
            return Ok(c);
        }
        let engine = Engine::new(EngineConfig {
            arena_bytes: self.opts.arena_bytes,
            completion: self.opts.completion,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .map_err(io_err)?;
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).map_err(io_err)?;
        let dev = (self.factory)(&lbio).map_err(io_err)?;
        let journal = if self.opts.rio {
            self.rio_journal(&engine, &lbio, dev)?
        } else {
            let area = self.next_area.fetch_add(1, Ordering::Relaxed) % self.areas();
            Journal::new(&self.set, area, dev, self.opts.commit_mode).map_err(io_err)?
        };
        let cache = match &self.cache {
            Some((pc, file)) => {
                let h = CacheHandle::new(pc, &engine, &lbio, Mode::AIOS).map_err(io_err)?;
                h.attach(*file, (self.factory)(&lbio).map_err(io_err)?)
                    .map_err(io_err)?;
                Some((h, *file))
            }
            None => None,
        };
        let c = Rc::new(Ctx { cache, journal });
        CTX.with(|m| m.borrow_mut().insert(self.id, Rc::clone(&c)));
        Ok(c)
    }

    fn areas(&self) -> usize {
        self.sb.journal_areas as usize
    }

    /// A worker's journal handle in a Rio mount: Rio-ordered on the first area (from its turn
    /// on) that has no Rio handle yet, whose attribute log `with_rio` formats afresh (the one
    /// recovery read is spent); when every area has one, a `commit_mode` handle on its turn's
    /// area.
    fn rio_journal(
        &self,
        engine: &Rc<Engine>,
        lbio: &Rc<LbioArray>,
        dev: Device,
    ) -> FsResult<Journal> {
        let _pick = self.rio_pick.lock().unwrap_or_else(|p| p.into_inner());
        let turn = self.next_area.fetch_add(1, Ordering::Relaxed);
        let n = self.areas();
        let Some(area) = (0..n)
            .map(|i| (turn + i) % n)
            .find(|&a| !self.set.rio_owned(a))
        else {
            self.stats.shared_handles.fetch_add(1, Ordering::Relaxed);
            return Journal::new(&self.set, turn % n, dev, self.opts.commit_mode).map_err(io_err);
        };
        // The ordered device runs on an lbio array of its own (over the same engine).
        let own = LbioArray::new(Rc::clone(engine), LbioConfig::default()).map_err(io_err)?;
        let target = (self.factory)(&own).map_err(io_err)?;
        let log =
            crate::rio::log_region(&self.sb, area as u32, (self.factory)(lbio).map_err(io_err)?)
                .map_err(io_err)?;
        let j = Journal::with_rio(
            &self.set,
            area,
            dev,
            target,
            log,
            crate::rio::ordered_config(),
        )
        .map_err(io_err)?;
        self.stats.rio_handles.fetch_add(1, Ordering::Relaxed);
        Ok(j)
    }

    /// Forget this thread's engine for this file system (a worker that is done).
    pub fn release_thread(&self) {
        CTX.with(|m| m.borrow_mut().remove(&self.id));
    }

    fn lock(&self) -> FsResult<MutexGuard<'_, State>> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        Ok(st)
    }

    /// Take no more changes: every later write, commit and sync says EIO, as after a failed
    /// commit, until the file system is mounted again (recovery then replays what was
    /// committed). For a request handler that panicked: the state it was changing may be half
    /// updated, and committing it could write that to the device.
    pub fn fail(&self, why: &str) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.failed.is_none() {
            let msg = format!("{why}; the file system is read-only until remounted");
            eprintln!("aiosfs: {msg}");
            st.failed = Some(msg);
        }
    }

    /// Whether the file system has stopped taking changes ([`Fs::fail`], a failed commit).
    pub fn failed(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .failed
            .is_some()
    }

    fn writable(&self, st: &State) -> FsResult<()> {
        match &st.failed {
            Some(_) => Err(libc::EIO),
            None => Ok(()),
        }
    }

    // ----- loading -------------------------------------------------------------------------

    fn load_itab(&self, st: &mut State, ctx: &Ctx, tb: u64) -> FsResult<()> {
        if st.itab_loaded.contains(&tb) {
            return Ok(());
        }
        let blk = ctx.read_blocks(self.sb.inode_table.start + tb, 1)?;
        for s in 0..INODES_PER_BLOCK as u64 {
            let ino = tb * INODES_PER_BLOCK as u64 + s;
            if ino == 0 || ino >= self.sb.inodes || !bit(&st.ibm, ino) {
                continue;
            }
            let slot = &blk[s as usize * INODE_BYTES..(s as usize + 1) * INODE_BYTES];
            let inode = match Inode::decode(slot) {
                Ok(Some(i)) => i,
                Ok(None) => {
                    eprintln!("aiosfs: inode {ino} is marked in use but empty (run aios fsck)");
                    return Err(libc::EIO);
                }
                Err(why) => {
                    eprintln!("aiosfs: inode {ino}: {why} (run aios fsck)");
                    return Err(libc::EIO);
                }
            };
            let mut node = Node {
                map: BTreeMap::new(),
                leaves: Vec::new(),
                dir: None,
                xattrs: None,
                dirty: BTreeMap::new(),
                fresh: BTreeSet::new(),
                layout_dirty: false,
                lookups: 0,
                opens: 0,
                attr: inode,
            };
            // `attr.extents` keeps the on-disk form (inline extents or leaf pointers) until the
            // node is encoded again: every change to the map marks the node dirty.
            let extents = node.attr.extents.clone();
            let all = if node.attr.flags & INODE_LEAVES != 0 {
                let mut all = Vec::new();
                for leaf in &extents {
                    self.check_data_block(leaf.physical, ino)?;
                    let b = ctx.read_blocks(leaf.physical, 1)?;
                    all.extend(decode_leaf(ino, &b).map_err(|why| {
                        eprintln!("aiosfs: inode {ino}: {why} (run aios fsck)");
                        libc::EIO
                    })?);
                    node.leaves.push(leaf.physical);
                }
                all
            } else {
                extents
            };
            for e in all {
                if e.len == 0 {
                    continue;
                }
                if e.logical.saturating_add(e.len as u64) > MAX_FILE_BYTES / B {
                    eprintln!(
                        "aiosfs: inode {ino} maps file block {} on, past the largest file (run aios fsck)",
                        e.logical
                    );
                    return Err(libc::EIO);
                }
                self.check_data_block(e.physical, ino)?;
                self.check_data_block(e.physical + e.len as u64 - 1, ino)?;
                node.map.insert(e.logical, (e.physical, e.len));
            }
            st.nodes.insert(ino, node);
        }
        st.itab_loaded.insert(tb);
        Ok(())
    }

    fn check_data_block(&self, b: u64, ino: u64) -> FsResult<()> {
        if self.sb.data.contains(b) {
            Ok(())
        } else {
            eprintln!(
                "aiosfs: inode {ino} points at block {b}, outside the data region (run aios fsck)"
            );
            Err(libc::EIO)
        }
    }

    fn node<'a>(&self, st: &'a mut State, ctx: &Ctx, ino: u64) -> FsResult<&'a mut Node> {
        if ino == 0 || ino >= self.sb.inodes {
            return Err(libc::ENOENT);
        }
        if !st.nodes.contains_key(&ino) {
            self.load_itab(st, ctx, ino / INODES_PER_BLOCK as u64)?;
        }
        st.nodes.get_mut(&ino).ok_or(libc::ENOENT)
    }

    fn load_dir(&self, st: &mut State, ctx: &Ctx, ino: u64) -> FsResult<()> {
        let n = self.node(st, ctx, ino)?;
        if !n.attr.is_dir() {
            return Err(libc::ENOTDIR);
        }
        if n.dir.is_some() {
            return Ok(());
        }
        let nblocks = n.attr.size / B;
        let mut dir = Dir::default();
        for l in 0..nblocks {
            let Some(p) = n.phys(l) else {
                eprintln!("aiosfs: directory {ino} has a hole at block {l} (run aios fsck)");
                return Err(libc::EIO);
            };
            let b = ctx.read_blocks(p, 1)?;
            let entries = decode_dir_block(&b).map_err(|why| {
                eprintln!("aiosfs: directory {ino}, block {p}: {why} (run aios fsck)");
                libc::EIO
            })?;
            let mut blk = DBlock {
                slots: Vec::with_capacity(entries.len()),
                used: crate::format::DIR_HEADER,
            };
            for (s, e) in entries.into_iter().enumerate() {
                blk.used += entry_bytes(&e.name);
                dir.index.insert(e.name.clone(), (l as u32, s as u16));
                blk.slots.push(Some(e));
            }
            dir.blocks.push(blk);
        }
        n.dir = Some(dir);
        Ok(())
    }

    fn dir<'a>(&self, st: &'a mut State, ctx: &Ctx, ino: u64) -> FsResult<&'a mut Dir> {
        self.load_dir(st, ctx, ino)?;
        Ok(st
            .nodes
            .get_mut(&ino)
            .and_then(|n| n.dir.as_mut())
            .expect("loaded"))
    }

    fn load_xattrs(&self, st: &mut State, ctx: &Ctx, ino: u64) -> FsResult<()> {
        let n = self.node(st, ctx, ino)?;
        if n.xattrs.is_some() {
            return Ok(());
        }
        let x = if n.attr.xattr == 0 {
            Vec::new()
        } else {
            self.check_data_block(n.attr.xattr, ino)?;
            decode_xattrs(&ctx.read_blocks(n.attr.xattr, 1)?).map_err(|why| {
                eprintln!("aiosfs: inode {ino}: {why} (run aios fsck)");
                libc::EIO
            })?
        };
        n.xattrs = Some(x);
        Ok(())
    }

    // ----- allocation ----------------------------------------------------------------------

    fn alloc_block(&self, st: &mut State, goal: Option<u64>) -> FsResult<u64> {
        let data = self.sb.data;
        let start = goal
            .filter(|&g| data.contains(g))
            .unwrap_or(st.block_cursor.max(data.start));
        let mut b = start;
        let mut scanned = 0;
        while scanned < data.count {
            if b >= data.end() {
                b = data.start;
            }
            if b % 8 == 0 && st.bbm[(b / 8) as usize] == 0xff && b + 8 <= data.end() {
                b += 8;
                scanned += 8;
                continue;
            }
            if !bit(&st.bbm, b) && !st.quarantine.contains(&b) {
                set_bit(&mut st.bbm, b);
                st.dirty_bbm.insert(b / (B * 8));
                st.free_blocks = st.free_blocks.saturating_sub(1);
                st.block_cursor = b + 1;
                return Ok(b);
            }
            b += 1;
            scanned += 1;
        }
        Err(libc::ENOSPC)
    }

    fn free_block(&self, st: &mut State, b: u64) {
        if !self.sb.data.contains(b) || !bit(&st.bbm, b) {
            // Only a damaged image maps a block twice or one marked free: leave the bitmap.
            eprintln!(
                "aiosfs: freeing block {b}, which is not an allocated data block (run aios fsck)"
            );
            return;
        }
        clear_bit(&mut st.bbm, b);
        st.dirty_bbm.insert(b / (B * 8));
        st.quarantine.insert(b);
        // An fsync writing it in place must not count that write for whatever owns the block
        // next (fallocate's zeros reach it without a commit).
        if let Some(superseded) = st.in_place.get_mut(&b) {
            *superseded = true;
        }
        st.free_blocks += 1;
        if st.journaled.remove(&b).is_some() {
            st.revokes.insert(b);
        }
        st.new_meta.remove(&b);
    }

    /// Give `ino` the extent leaf blocks a map of `extents` extents needs, before its map grows
    /// to that: a commit that found no block for a leaf could commit nothing, and the blocks
    /// freed meanwhile become allocatable only through a commit, so the file system could never
    /// commit again. ENOSPC (nothing taken) when there is no block; EFBIG past
    /// [`MAX_EXTENTS`]. The inode is marked: a leaf taken here is written with it.
    fn reserve_leaves(&self, st: &mut State, ino: u64, extents: usize) -> FsResult<()> {
        let need = leaves_for(extents);
        if need > INLINE_EXTENTS {
            return Err(libc::EFBIG);
        }
        let had = st.nodes[&ino].leaves.len();
        while st.nodes[&ino].leaves.len() < need {
            let goal = st.nodes[&ino].leaves.last().map(|b| b + 1);
            match self.alloc_block(st, goal) {
                Ok(b) => st.nodes.get_mut(&ino).expect("node").leaves.push(b),
                Err(e) => {
                    let taken = st.nodes.get_mut(&ino).expect("node").leaves.split_off(had);
                    for b in taken {
                        self.unalloc(st, b);
                    }
                    return Err(e);
                }
            }
        }
        let now_has = st.nodes[&ino].leaves.len();
        if now_has > had {
            // Counted here when the node is marked already (`touch` counts a node's leaves
            // only when it first marks it).
            if st.dirty_nodes.contains(&ino) {
                st.dirty_leaves += now_has - had;
            }
            Self::touch(st, ino);
        }
        Ok(())
    }

    /// Take back block `p`, allocated by the operation under way and never committed: it is
    /// allocatable again at once.
    fn unalloc(&self, st: &mut State, p: u64) {
        self.free_block(st, p);
        st.quarantine.remove(&p);
    }

    /// Free the blocks `ino` maps at file blocks `[a, b)`, top down, in steps that each fit one
    /// journal transaction (at most [`FREE_STEP_BLOCKS`] blocks, and a quarter of a journal
    /// area of block-bitmap blocks), with a commit between two steps. A file of a terabyte
    /// spans more bitmap blocks than an area holds: freed at once, its commit was refused
    /// (`TxTooLarge`) and the file system went read-only. Each commit leaves a consistent
    /// image: the inode maps what is not yet freed, and with `size_floor` (a truncate) its size
    /// is cut to the end of what it still maps past `size_floor`, so a crash leaves the file
    /// shorter, never with freed blocks inside. Dirty blocks of each step's range are dropped
    /// with it (not before: a commit writes a fresh block that its inode maps). On a commit's
    /// error the blocks above the step reached stay freed, and everything is marked.
    fn free_range(
        &self,
        st: &mut State,
        ctx: &Ctx,
        ino: u64,
        a: u64,
        mut b: u64,
        size_floor: Option<u64>,
    ) -> FsResult<()> {
        let budget = self.free_step_budget();
        loop {
            let c = free_cut(&st.nodes[&ino], a, b, budget, &st.dirty_bbm, &st.journaled);
            let n = st.nodes.get_mut(&ino).expect("node");
            let gone: Vec<u64> = n.dirty.range(c..b).map(|(&l, _)| l).collect();
            for l in &gone {
                n.dirty.remove(l);
            }
            let fresh: Vec<u64> = n.fresh.range(c..b).copied().collect();
            for l in &fresh {
                n.fresh.remove(l);
            }
            st.dirty_bytes -= gone.len() * BLOCK;
            let freed = st.nodes.get_mut(&ino).expect("node").unmap(c, b);
            for p in freed {
                self.free_block(st, p);
            }
            let n = st.nodes.get_mut(&ino).expect("node");
            if let Some(floor) = size_floor {
                n.attr.size = n.attr.size.min(floor.max(c.saturating_mul(B)));
            }
            n.layout_dirty = true;
            Self::touch(st, ino);
            if c == a {
                return Ok(());
            }
            let steps = self.stats.free_steps.fetch_add(1, Ordering::Relaxed) + 1;
            self.commit_locked_short(st, ctx, None)?;
            if FREE_TEST_STOP_AFTER
                .compare_exchange(steps, 0, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                return Err(libc::EIO);
            }
            b = c;
        }
    }

    /// A block to map at file block `l` of `ino` (a hole), with the extent leaf the map then
    /// needs, if any, taken too (see [`Self::reserve_leaves`]). Out of blocks with some freed
    /// since the last commit, it commits once to make them allocatable; that commit carries the
    /// inode, since it maps the blocks the operation under way took before this one (the
    /// caller marks the inode again afterwards). `before_commit` runs just before that commit
    /// (fallocate makes its zeros durable there); its error is returned, with no commit.
    fn alloc_for_map(
        &self,
        st: &mut State,
        ctx: &Ctx,
        ino: u64,
        l: u64,
        before_commit: &mut dyn FnMut() -> FsResult<()>,
    ) -> FsResult<u64> {
        let mut committed = false;
        loop {
            let n = &st.nodes[&ino];
            let goal = l.checked_sub(1).and_then(|pl| n.phys(pl)).map(|p| p + 1);
            let r = self.alloc_block(st, goal).and_then(|p| {
                let n = &st.nodes[&ino];
                if n.joins(l, p) {
                    return Ok(p);
                }
                let more = n.map.len() + 1;
                let r = if more > MAX_EXTENTS {
                    Err(libc::EFBIG)
                } else {
                    self.reserve_leaves(st, ino, more)
                };
                match r {
                    Ok(()) => Ok(p),
                    Err(e) => {
                        self.unalloc(st, p);
                        Err(e)
                    }
                }
            });
            match r {
                Err(libc::ENOSPC) if !committed && !st.quarantine.is_empty() => {
                    // Blocks freed since the last commit come back once it is durable.
                    before_commit()?;
                    st.nodes.get_mut(&ino).expect("node").layout_dirty = true;
                    Self::touch(st, ino);
                    // Xattrs it leaves for later (no block for them until it is durable) are
                    // for an fsync or sync to report, not this operation: it goes on, and says
                    // ENOSPC only if it still finds no block.
                    self.commit_locked_short(st, ctx, None)?;
                    committed = true;
                }
                r => return r,
            }
        }
    }

    fn alloc_inode(&self, st: &mut State, ctx: &Ctx) -> FsResult<u64> {
        let n = self.sb.inodes;
        let mut i = st.inode_cursor.max(2);
        for _ in 0..n {
            if i >= n {
                i = 2;
            }
            if !bit(&st.ibm, i) {
                // Load its table block before the slot is used, so the block's other inodes
                // are in memory when it is encoded.
                self.load_itab(st, ctx, i / INODES_PER_BLOCK as u64)?;
                set_bit(&mut st.ibm, i);
                st.dirty_ibm.insert(i / (B * 8));
                st.free_inodes = st.free_inodes.saturating_sub(1);
                st.inode_cursor = i + 1;
                return Ok(i);
            }
            i += 1;
        }
        Err(libc::ENOSPC)
    }

    /// Free an inode with no links and no users: its blocks and its slot.
    ///
    /// A file too large to free in one transaction is freed in steps first
    /// ([`Self::free_range`]): until the last, the inode stays allocated with no links, an
    /// orphan that the next mount frees should the file system stop in between. If a step's
    /// commit fails it is left so, to the next mount.
    fn destroy(&self, st: &mut State, ino: u64) {
        let Some(n) = st.nodes.get(&ino) else {
            return;
        };
        let budget = self.free_step_budget();
        if free_cut(n, 0, u64::MAX, budget, &st.dirty_bbm, &st.journaled) > 0 {
            let r = self
                .ctx()
                .and_then(|ctx| self.free_range(st, &ctx, ino, 0, u64::MAX, None));
            if let Err(e) = r {
                eprintln!(
                    "aiosfs: freeing inode {ino} stopped (errno {e}); the next mount frees it"
                );
                return;
            }
        }
        let Some(mut n) = st.nodes.remove(&ino) else {
            return;
        };
        let mut blocks: Vec<u64> = n.unmap(0, u64::MAX);
        blocks.append(&mut n.leaves);
        if n.attr.xattr != 0 {
            blocks.push(n.attr.xattr);
        }
        for b in blocks {
            self.free_block(st, b);
        }
        st.dirty_bytes -= n.dirty.len() * BLOCK;
        clear_bit(&mut st.ibm, ino);
        st.dirty_ibm.insert(ino / (B * 8));
        st.free_inodes += 1;
        Self::touch(st, ino);
        st.dirty_xattrs.remove(&ino);
        st.dirty_data.remove(&ino);
    }

    fn maybe_destroy(&self, st: &mut State, ino: u64) {
        if let Some(n) = st.nodes.get(&ino) {
            let dead = if n.attr.is_dir() {
                n.attr.nlink < 2
            } else {
                n.attr.nlink == 0
            };
            if dead && n.lookups == 0 && n.opens == 0 {
                self.destroy(st, ino);
                // Frees come one by one from the kernel's FORGETs, with no operation's
                // `settle` after them: commit before the freed inodes outgrow a transaction.
                if self.meta_pending(st) * 4 > self.log_len {
                    let r = self
                        .ctx()
                        .and_then(|ctx| self.commit_locked_short(st, &ctx, None));
                    if let Err(e) = r {
                        eprintln!("aiosfs: commit after freeing inode {ino} failed (errno {e})");
                    }
                }
            }
        }
    }

    fn touch(st: &mut State, ino: u64) {
        if st.dirty_nodes.insert(ino) {
            st.dirty_leaves += st.nodes.get(&ino).map_or(0, |n| n.leaves.len());
        }
        // Not only on the first touch: an inode number freed and dirtied since the last commit
        // may come back as a directory before the next one.
        if st.nodes.get(&ino).is_some_and(|n| n.attr.is_dir()) {
            st.dirty_dirs.insert(ino);
        }
    }

    // ----- commit --------------------------------------------------------------------------

    /// The metadata blocks one step of a large free may dirty (see [`free_cut`]): a quarter
    /// of the log, so that a step's commit always fits.
    fn free_step_budget(&self) -> usize {
        (self.log_len / 4).max(1) as usize
    }

    /// Metadata blocks the next commit would write, roughly, and the log blocks its revoke
    /// records take. A directory whose blocks changed is always among the dirty directories
    /// (every change to it touches it), so only those are looked at, not every node in memory.
    fn meta_pending(&self, st: &State) -> u64 {
        let dirs: usize = st
            .dirty_dirs
            .iter()
            .filter_map(|i| st.nodes.get(i)?.dir.as_ref().map(|d| d.dirty.len()))
            .sum();
        (st.dirty_nodes.len() * 2
            + st.dirty_leaves
            + dirs
            + st.dirty_ibm.len()
            + st.dirty_bbm.len()
            + st.new_meta.len()
            + st.revokes.len().div_ceil(REVOKES_PER_BLOCK)) as u64
            + st.dirty_xattrs.len() as u64
    }

    /// After a change: commit when the pending metadata nears a quarter of a journal area, or
    /// the dirty data passes the limit.
    fn settle(&self, st: &mut State, ctx: &Ctx) -> FsResult<()> {
        // A commit in flight still counts its data and freed blocks until it is applied: they
        // are not pending (a commit here would wait for it with the lock held, for nothing).
        let (flying_bytes, flying_freed) = st.committing.as_ref().map_or((0, 0), |c| {
            (c.after.written.len() * BLOCK, c.after.quarantined.len())
        });
        if self.meta_pending(st) * 4 > self.log_len
            || st.dirty_bytes.saturating_sub(flying_bytes) > self.dirty_limit()
            || st.quarantine.len().saturating_sub(flying_freed) > 4096
            || st.last_commit.elapsed() > COMMIT_INTERVAL
        {
            // The change is complete whatever this commit leaves for later: xattrs waiting
            // for a block (a full disk) are not this operation's, and an fsync or sync says
            // ENOSPC for them. Said here, the caller was told a change failed that was made
            // and committed.
            self.commit_locked_short(st, ctx, None)?;
        }
        Ok(())
    }

    /// Encode every dirty metadata block and commit it, with `file`'s dirty data (all files'
    /// when `None`) and every file's freshly allocated blocks, holding the state lock
    /// throughout (a commit in flight without the lock is finished first).
    fn commit_locked(&self, st: &mut State, ctx: &Ctx, file: Option<u64>) -> FsResult<()> {
        if self.commit_locked_short(st, ctx, file)? {
            return Err(libc::ENOSPC);
        }
        Ok(())
    }

    /// [`Self::commit_locked`], telling a commit that left xattrs for later for want of a
    /// block (`Ok(true)`: it went through all the same) from one that failed.
    fn commit_locked_short(&self, st: &mut State, ctx: &Ctx, file: Option<u64>) -> FsResult<bool> {
        self.finish_inflight(st, ctx)?;
        self.writable(st)?;
        let after = self.build_commit(st, ctx, file)?;
        let short = after.short;
        let result = if after.tx.is_empty() {
            Ok(None)
        } else {
            journal_commit(ctx, &after.tx)
        };
        self.apply_commit(st, ctx, after, result)?;
        Ok(short)
    }

    /// Commit as [`Self::commit_locked`] does, with the state lock released while the device
    /// works, so that other operations (reads, lookups, writes, creates) go on meanwhile.
    ///
    /// The transaction is built under the lock, and the commit is recorded in
    /// `State::committing` before the lock goes. Whoever next needs the state the commit
    /// leaves behind — another commit, an in-place fsync, a lock-held commit deep in an
    /// operation — finishes it first ([`Self::finish_inflight`]): it waits for the device's
    /// answer (which needs no lock, so waiting with the lock held cannot deadlock) and applies
    /// it. So at most one commit is in flight, transactions reach the journal in the order
    /// they were built, and no block is written by two requests at once.
    fn commit_unlocked(
        &self,
        mut st: MutexGuard<'_, State>,
        ctx: &Ctx,
        file: Option<u64>,
    ) -> FsResult<()> {
        self.finish_inflight(&mut st, ctx)?;
        self.writable(&st)?;
        let after = self.build_commit(&mut st, ctx, file)?;
        let short = if after.short {
            Err(libc::ENOSPC)
        } else {
            Ok(())
        };
        if after.tx.is_empty() {
            return self.apply_commit(&mut st, ctx, after, Ok(None)).and(short);
        }
        let signal = Arc::new(CommitSignal::default());
        let tx = Arc::clone(&after.tx);
        st.committing = Some(Committing {
            signal: Arc::clone(&signal),
            after,
        });
        drop(st);
        // Should this thread unwind before the answer is in, threads waiting for it get an
        // error rather than waiting for ever.
        struct Unwinding<'a>(&'a CommitSignal);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                let mut r = self.0.result.lock().unwrap_or_else(|p| p.into_inner());
                if r.is_none() {
                    *r = Some(Err("the committing thread panicked".into()));
                    self.0.ready.notify_all();
                }
            }
        }
        let _unwinding = Unwinding(&signal);

        let result = journal_commit(ctx, &tx);
        signal.set(result.clone());
        let pause = COMMIT_TEST_PAUSE_US.swap(0, Ordering::Relaxed);
        if pause > 0 {
            std::thread::sleep(std::time::Duration::from_micros(pause));
        }

        let mut st = self.lock()?;
        if st
            .committing
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(&c.signal, &signal))
        {
            let c = st.committing.take().expect("checked");
            return self.apply_commit(&mut st, ctx, c.after, result).and(short);
        }
        // Another thread finished it (and reported a failure the same way).
        result.map(|_| ()).map_err(|_| libc::EIO).and(short)
    }

    /// Finish the commit in flight without the lock, if there is one: wait for the device's
    /// answer (with the lock held: the committing thread needs no lock to get it) and apply
    /// it. Every commit, and every in-place fsync, starts from here.
    fn finish_inflight(&self, st: &mut State, ctx: &Ctx) -> FsResult<()> {
        if let Some(c) = st.committing.take() {
            let result = c.signal.wait();
            self.apply_commit(st, ctx, c.after, result)?;
        }
        Ok(())
    }

    /// As [`Self::finish_inflight`], but waiting for the device with the lock released (for
    /// callers that hold the guard itself, such as fsync).
    ///
    /// One wait with the lock released, for the commit in flight now; if another thread started
    /// a commit in the meantime, that one is finished with the lock held, so no further commit
    /// can start ahead of this caller. (Waiting with the lock released until none is in flight
    /// could go on for as long as other threads keep committing.) The lock itself is not fair:
    /// threads that take it first, including ones that commit with it held deep inside an
    /// operation, still go ahead.
    fn settle_inflight<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        ctx: &Ctx,
    ) -> FsResult<MutexGuard<'a, State>> {
        if let Some(signal) = st.committing.as_ref().map(|c| Arc::clone(&c.signal)) {
            drop(st);
            // The outcome is applied (and a failure reported) by `finish_inflight` below, or
            // was by whoever took the lock first.
            let _ = signal.wait();
            st = self.lock()?;
        }
        // The same commit: its answer is in, so this applies it without waiting. Another one,
        // started while the lock was released: this waits for it with the lock held.
        self.finish_inflight(&mut st, ctx)?;
        Ok(st)
    }

    /// Build the next transaction from everything pending, under the lock: the dirty sets it
    /// covers are taken (changes made after this land in the next one), the blocks it
    /// journals are marked journaled (so that freeing one while it is in flight revokes it),
    /// and the blocks it frees stay quarantined until [`Self::apply_commit`].
    fn build_commit(&self, st: &mut State, ctx: &Ctx, file: Option<u64>) -> FsResult<AfterCommit> {
        // No fsync's in-place data write is in flight while a commit is built; none starts
        // until the commit is applied (fsync finishes a commit in flight first).
        let _gate = self
            .in_place_gate
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let mut tx = match file {
            Some(ino) => Tx::for_file(ino as u32),
            None => Tx::new(),
        };
        // Data first: it is written in place, durable before the commit block.
        let mut written: Vec<(u64, u64, u64)> = Vec::new();
        for &ino in &st.dirty_data {
            let Some(n) = st.nodes.get(&ino) else {
                continue;
            };
            let all = file.is_none_or(|f| f == ino);
            for (&l, buf) in &n.dirty {
                if !all && !n.fresh.contains(&l) {
                    continue;
                }
                let p = n.phys(l).expect("dirty blocks are mapped");
                tx.write_data(p, buf).map_err(io_err)?;
                written.push((ino, l, p));
            }
        }
        // Blocks an fsync is writing in place meanwhile: this commit's copy is newer.
        for (_, _, p) in &written {
            if let Some(superseded) = st.in_place.get_mut(p) {
                *superseded = true;
            }
        }
        // Inodes: extent leaves (may allocate or free leaf blocks), xattr blocks.
        // What this commit takes out of the state goes back when it stops short of the device
        // (no block left for an extent leaf): the next commit writes it. Dropped, an inode
        // could name an xattr block never written, and a symlink's target or an fsynced xattr
        // would be lost.
        let mut metas: BTreeMap<u64, Vec<u8>> = std::mem::take(&mut st.new_meta);
        let xattrs: Vec<u64> = std::mem::take(&mut st.dirty_xattrs).into_iter().collect();
        let mut deferred: SmallVec<[u64; 4]> = SmallVec::new();
        for &ino in &xattrs {
            let Some(n) = st.nodes.get(&ino) else {
                continue;
            };
            let list = n.xattrs.clone().unwrap_or_default();
            let old = n.attr.xattr;
            if list.is_empty() {
                if old != 0 {
                    self.free_block(st, old);
                    // (A copy an earlier commit left for this one must not reach a free block.)
                    metas.remove(&old);
                    st.nodes.get_mut(&ino).expect("node").attr.xattr = 0;
                }
            } else {
                let mut blk = vec![0u8; BLOCK];
                let b = match encode_xattrs(&list, &mut blk) {
                    Ok(()) if old != 0 => Some(old),
                    Ok(()) => self.alloc_block(st, None).ok(),
                    Err(_) => None,
                };
                let Some(b) = b else {
                    // No block for it now (the disk is full; the blocks this commit frees are
                    // free only once it is durable): the xattrs wait for a later commit, the
                    // rest goes ahead, and an fsync of this file (or of everything) says
                    // ENOSPC, since they are not durable.
                    st.dirty_xattrs.insert(ino);
                    deferred.push(ino);
                    continue;
                };
                metas.insert(b, blk);
                st.nodes.get_mut(&ino).expect("node").attr.xattr = b;
            }
            Self::touch(st, ino);
        }
        let dirty: Vec<u64> = st.dirty_nodes.iter().copied().collect();
        for &ino in &dirty {
            let Some(n) = st.nodes.get(&ino) else {
                continue;
            };
            let extents: Vec<Extent> = n
                .map
                .iter()
                .map(|(&l, &(p, len))| Extent {
                    logical: l,
                    physical: p,
                    len,
                })
                .collect();
            let need_leaves = leaves_for(extents.len());
            let mut leaves = n.leaves.clone();
            while leaves.len() > need_leaves {
                let b = leaves.pop().expect("leaf");
                self.free_block(st, b);
                metas.remove(&b);
            }
            let had = leaves.len();
            while leaves.len() < need_leaves {
                let goal = leaves.last().map(|b| b + 1);
                match self.alloc_block(st, goal) {
                    Ok(b) => leaves.push(b),
                    Err(e) => {
                        // The leaves taken for this inode go back; the inode stays dirty.
                        for &b in &leaves[had..] {
                            self.free_block(st, b);
                            st.quarantine.remove(&b);
                        }
                        st.new_meta = metas;
                        return Err(e);
                    }
                }
            }
            let n = st.nodes.get_mut(&ino).expect("node");
            if need_leaves == 0 {
                n.attr.flags &= !INODE_LEAVES;
                n.attr.extents = extents;
            } else {
                n.attr.flags |= INODE_LEAVES;
                n.attr.extents = Vec::new();
                for (chunk, &lb) in extents.chunks(LEAF_EXTENTS).zip(&leaves) {
                    let mut blk = vec![0u8; BLOCK];
                    encode_leaf(ino, chunk, &mut blk);
                    metas.insert(lb, blk);
                    n.attr.extents.push(Extent {
                        logical: chunk[0].logical,
                        physical: lb,
                        len: chunk.len() as u32,
                    });
                }
            }
            n.leaves = leaves;
        }
        // Directory blocks (a directory whose blocks changed is a dirty node).
        for &ino in &dirty {
            let Some(n) = st.nodes.get_mut(&ino) else {
                continue;
            };
            let Some(dirty) = n.dir.as_mut().map(|d| std::mem::take(&mut d.dirty)) else {
                continue;
            };
            for bi in dirty {
                let Some(p) = n.phys(bi as u64) else { continue };
                let d = n.dir.as_ref().expect("dir");
                let entries: Vec<DirEntry> = d.blocks[bi as usize]
                    .slots
                    .iter()
                    .flatten()
                    .cloned()
                    .collect();
                let mut blk = vec![0u8; BLOCK];
                encode_dir_block(&entries, &mut blk).map_err(|e| {
                    eprintln!("aiosfs: directory {ino}: {e}");
                    libc::EIO
                })?;
                metas.insert(p, blk);
            }
        }
        // Inode table blocks.
        let tblocks: BTreeSet<u64> = dirty.iter().map(|i| i / INODES_PER_BLOCK as u64).collect();
        for tb in tblocks {
            let mut blk = vec![0u8; BLOCK];
            for s in 0..INODES_PER_BLOCK as u64 {
                let ino = tb * INODES_PER_BLOCK as u64 + s;
                if let Some(n) = st.nodes.get(&ino) {
                    n.attr.encode(&mut blk[s as usize * INODE_BYTES..]);
                }
            }
            metas.insert(self.sb.inode_table.start + tb, blk);
        }
        // Bitmaps last: leaf and xattr allocations above changed them.
        for bi in std::mem::take(&mut st.dirty_ibm) {
            let at = (bi * B) as usize;
            metas.insert(
                self.sb.inode_bitmap.start + bi,
                st.ibm[at..at + BLOCK].to_vec(),
            );
        }
        for bi in std::mem::take(&mut st.dirty_bbm) {
            let at = (bi * B) as usize;
            metas.insert(
                self.sb.block_bitmap.start + bi,
                st.bbm[at..at + BLOCK].to_vec(),
            );
        }
        for (&b, bytes) in &metas {
            tx.write_meta(b, bytes).map_err(io_err)?;
        }
        let mut revokes = 0;
        for &b in &st.revokes {
            if !metas.contains_key(&b) {
                tx.revoke(b);
                revokes += 1;
            }
        }
        st.revokes.clear();
        st.last_commit = std::time::Instant::now();
        // What this transaction covers is no longer pending: later changes mark it again.
        st.dirty_dirs.clear();
        st.dirty_leaves = 0;
        for ino in std::mem::take(&mut st.dirty_nodes) {
            if let Some(n) = st.nodes.get_mut(&ino) {
                n.layout_dirty = false;
            }
        }
        let meta_blocks: Vec<u64> = metas.into_keys().collect();
        for &b in &meta_blocks {
            st.journaled.insert(b, TID_IN_FLIGHT);
        }
        // A one-write commit may journal the data too: until it is known whether it did,
        // freeing one of its blocks revokes it and no fsync writes one in place.
        // The marks they had before are kept, to be put back if it did not.
        let data_marks: Vec<Option<u64>> = if ctx.journal.mode() == CommitMode::OneWrite {
            written
                .iter()
                .map(|(_, _, p)| st.journaled.insert(*p, TID_IN_FLIGHT))
                .collect()
        } else {
            Vec::new()
        };
        Ok(AfterCommit {
            tx: Arc::new(tx),
            written,
            meta_blocks,
            quarantined: st.quarantine.iter().copied().collect(),
            data_marks,
            file: file.is_some(),
            short: deferred.iter().any(|&i| file.is_none_or(|f| f == i)),
            revokes,
        })
    }

    /// Bring the state up to date after the commit `after` ended with `result` (the journal's
    /// id for it and whether it journaled the data, `None` when there was nothing to write,
    /// or the error). A data block leaves its file's dirty set only if it still sits where it
    /// was written and holds the bytes written (it may have changed, or moved, while the
    /// commit was in flight).
    fn apply_commit(
        &self,
        st: &mut State,
        ctx: &Ctx,
        after: AfterCommit,
        result: CommitResult,
    ) -> FsResult<()> {
        let committed = match result {
            Ok(c) => c,
            Err(e) => {
                let msg = format!(
                    "journal commit failed: {e}; the file system is read-only until remounted"
                );
                eprintln!("aiosfs: {msg}");
                st.failed = Some(msg);
                return Err(libc::EIO);
            }
        };
        self.stats.commits.fetch_add(1, Ordering::Relaxed);
        if after.file {
            self.stats.fsync_commits.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .data_blocks_written
            .fetch_add(after.written.len() as u64, Ordering::Relaxed);
        self.stats
            .meta_blocks_written
            .fetch_add(after.meta_blocks.len() as u64, Ordering::Relaxed);
        if committed.is_some() {
            self.stats
                .revokes
                .fetch_add(after.revokes as u64, Ordering::Relaxed);
            self.stats
                .largest_tx_log_blocks
                .fetch_max(after.tx.log_blocks(), Ordering::Relaxed);
        }
        if !after.quarantined.is_empty() {
            // Reads that found one of these blocks before it was freed have read it.
            drop(self.read_gate.write().unwrap_or_else(|p| p.into_inner()));
        }
        for b in &after.quarantined {
            st.quarantine.remove(b);
        }
        let (tid, data_journaled) = committed.unwrap_or((TID_IN_FLIGHT, false));
        // The marks made when the commit was built become the commit's id, or what they were
        // before, except where a block was freed (and its mark dropped) meanwhile.
        let mut resolve = |b: u64, mark: Option<u64>| {
            if st.journaled.get(&b) == Some(&TID_IN_FLIGHT) {
                match mark {
                    Some(t) => st.journaled.insert(b, t),
                    None => st.journaled.remove(&b),
                };
            }
        };
        for &b in &after.meta_blocks {
            resolve(b, Some(tid));
        }
        // A one-write commit journals the data too: freeing such a block must revoke it, and
        // the in-place fsync path must not write it (replay would put this copy back).
        for (&(_, _, p), &before) in after.written.iter().zip(&after.data_marks) {
            resolve(p, if data_journaled { Some(tid) } else { before });
        }
        // Blocks whose journaled copies are all home (a checkpoint moved the logs past them):
        // no replay brings them back, so freeing needs no revoke and in-place writes are safe.
        let home = self.set.home_below();
        if home > st.journaled_pruned_at {
            st.journaled.retain(|_, t| *t >= home);
            st.journaled_pruned_at = home;
        }
        // The transaction's data blocks are in the order they were built, one per entry of
        // `written`, unless a damaged image maps one block twice (the transaction then holds
        // it once, with the later bytes): look those up.
        let aligned = after.tx.data_blocks().count() == after.written.len();
        let mut in_order = after.tx.data_blocks();
        for (ino, l, p) in &after.written {
            let bytes = if aligned {
                in_order.next().map(|(_, d)| d)
            } else {
                after.tx.data_blocks().find(|(b, _)| b == p).map(|(_, d)| d)
            };
            let Some(bytes) = bytes else { continue };
            let Some(n) = st.nodes.get_mut(ino) else {
                continue;
            };
            if n.phys(*l) != Some(*p) {
                continue;
            }
            // Still fresh when its bytes changed meanwhile: a truncate or punch zeroed part
            // of it (marking it fresh so that the next commit, whichever file's, carries it
            // with the new size), or a write did; the device holds the older bytes.
            if n.dirty.get(l).is_some_and(|d| **d == *bytes) {
                n.fresh.remove(l);
                n.dirty.remove(l);
                st.dirty_bytes -= BLOCK;
                ctx.stored(self, *p, bytes);
            }
        }
        let nodes = &st.nodes;
        st.dirty_data
            .retain(|i| nodes.get(i).is_some_and(|n| !n.dirty.is_empty()));
        Ok(())
    }

    /// Make everything durable (all files' data and all metadata).
    pub fn sync_all(&self) -> FsResult<()> {
        let ctx = self.ctx()?;
        let st = self.settle_inflight(self.lock()?, &ctx)?;
        if st.failed.is_some() {
            return Err(libc::EIO);
        }
        self.commit_unlocked(st, &ctx, None)
    }

    /// Commit when anything changed since the last commit (the mount's periodic flusher).
    pub fn sync_if_dirty(&self) -> FsResult<bool> {
        let ctx = self.ctx()?;
        let st = self.settle_inflight(self.lock()?, &ctx)?;
        if st.failed.is_some() {
            return Ok(false);
        }
        let dirty = self.meta_pending(&st) > 0
            || st.dirty_bytes > 0
            || !st.revokes.is_empty()
            || !st.quarantine.is_empty();
        if dirty {
            self.commit_unlocked(st, &ctx, None)?;
        }
        Ok(dirty)
    }

    /// `fsync`/`fdatasync`: one file-level transaction with the file's dirty data, the
    /// metadata changed since the last commit and every file's freshly allocated blocks.
    ///
    /// When nothing but the file's data in blocks it already owned changed since the last commit
    /// (no metadata at all is pending: an overwrite within one timestamp tick), there is nothing
    /// to journal: the blocks are written in place and made durable (FUA writes, or writes and
    /// a FLUSH, as the journal chose for the device), with no journal transaction.
    pub fn fsync(&self, ino: u64) -> FsResult<()> {
        self.fsync_as(ino, false)
    }

    /// `fsync` (`datasync` false) or `fdatasync` (`datasync` true).
    ///
    /// The file's blocks are written in place, with no transaction, when nothing the call
    /// must make durable is pending beyond the data of blocks the file already owned: for
    /// fsync, nothing about the regular file's inode or xattrs changed since the last commit;
    /// for fdatasync, neither its size nor its block map did (new times or a new owner are not
    /// needed to read the data back, as POSIX says and ext4 does). Other files' pending
    /// changes do not force a commit: the blocks written belong to this file alone. Anything
    /// else is one file-level transaction carrying all pending metadata.
    pub fn fsync_as(&self, ino: u64, datasync: bool) -> FsResult<()> {
        let ctx = self.ctx()?;
        // A commit in flight may carry this file's changes: it is finished before deciding.
        let mut st = self.settle_inflight(self.lock()?, &ctx)?;
        self.node(&mut st, &ctx, ino)?;
        self.writable(&st)?;
        let n = &st.nodes[&ino];
        let own = n.attr.mode & S_IFMT == libc::S_IFREG
            && n.fresh.is_empty()
            && if datasync {
                !n.layout_dirty
            } else {
                !st.dirty_nodes.contains(&ino) && !st.dirty_xattrs.contains(&ino)
            };
        let data_only = own
            || (self.meta_pending(&st) == 0
                && st.revokes.is_empty()
                && st.quarantine.is_empty()
                && n.fresh.is_empty());
        // A block a one-write commit journaled must be written through the journal again: the
        // journal cannot see an in-place write, and its replay would put the older copy back.
        let journaled = n
            .dirty
            .keys()
            .any(|&l| n.phys(l).is_some_and(|p| st.journaled.contains_key(&p)));
        // Blocks another fsync is writing in place right now: a commit waits for that write.
        let busy = !st.in_place.is_empty()
            && n.dirty
                .keys()
                .any(|&l| n.phys(l).is_some_and(|p| st.in_place.contains_key(&p)));
        if data_only && !journaled && !busy {
            return self.write_in_place(st, &ctx, ino);
        }
        self.commit_unlocked(st, &ctx, Some(ino))
    }

    /// Write `ino`'s dirty blocks home and make them durable (the fsync fast path), with the
    /// state lock released during the device's work, so fsyncs of different files overlap.
    ///
    /// The blocks are copied out under the lock and marked in `in_place`; the writes go out
    /// holding `in_place_gate` shared (a commit, which writes data home too, holds it
    /// exclusively). Back under the lock, a block leaves the file's dirty set only if it still
    /// holds the bytes written, at the same place, and no commit wrote it in between: one
    /// written again meanwhile stays dirty for the next fsync or commit (even if its bytes went
    /// back to the ones written here: a commit may have put newer ones on the device), and the
    /// page cache is given only bytes that are the newest on the device. Without arena memory
    /// for the copies it commits instead.
    fn write_in_place(&self, mut st: MutexGuard<'_, State>, ctx: &Ctx, ino: u64) -> FsResult<()> {
        let pause = IN_PLACE_TEST_PAUSE_US.load(Ordering::Relaxed);
        let n = st.nodes.get(&ino).expect("node");
        if n.dirty.is_empty() {
            return Ok(());
        }
        // Runs of physically contiguous blocks, at most 256 blocks each: (first physical
        // block, logical blocks).
        let mut runs: Vec<(u64, Vec<u64>)> = Vec::new();
        for &l in n.dirty.keys() {
            let p = n.phys(l).expect("dirty blocks are mapped");
            match runs.last_mut() {
                Some((start, ls)) if *start + ls.len() as u64 == p && ls.len() < 256 => ls.push(l),
                _ => runs.push((p, vec![l])),
            }
        }
        let bufs: Result<Vec<_>, _> = runs
            .iter()
            .map(|(_, ls)| {
                let len = ls.len() * BLOCK;
                let mut buf = ctx.engine().alloc_blocking(len)?;
                buf.set_len(len)?;
                for (i, l) in ls.iter().enumerate() {
                    buf[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&n.dirty[l]);
                }
                Ok::<_, aios_core::CoreError>(buf)
            })
            .collect();
        let Ok(bufs) = bufs else {
            return self.commit_locked(&mut st, ctx, Some(ino));
        };
        for (p, ls) in &runs {
            for b in *p..*p + ls.len() as u64 {
                let fresh = st.in_place.insert(b, false).is_none();
                debug_assert!(fresh, "block {b} written in place twice at once");
            }
        }
        let gate = self.in_place_gate.read().unwrap_or_else(|p| p.into_inner());
        drop(st);

        let plp = ctx.dev().critical_route().0.power_loss_protected;
        let fua = !plp && self.set.durability() == journal::Durability::FuaWrites;
        let flush = !plp && !fua;
        let mut result = Ok(());
        let mut written = Vec::with_capacity(bufs.len());
        for ((p, _), buf) in runs.iter().zip(bufs) {
            match ctx.dev().write_at_blocking(p * B, buf, fua) {
                Ok(buf) => written.push(buf),
                Err(e) => {
                    result = Err(io_err(e));
                    break;
                }
            }
        }
        if result.is_ok() && flush {
            result = ctx.dev().flush_blocking().map_err(io_err);
        }
        drop(gate);
        if pause > 0 {
            IN_PLACE_TEST_PAUSES.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_micros(pause));
        }

        let mut st = self.lock()?;
        // Per block, in run order: did a commit write it while it was in flight here?
        let superseded: Vec<bool> = runs
            .iter()
            .flat_map(|(p, ls)| *p..*p + ls.len() as u64)
            .map(|b| st.in_place.remove(&b).unwrap_or(false))
            .collect();
        if let Err(e) = result {
            let msg = "an in-place data write for fsync failed; the file system is read-only until remounted";
            eprintln!("aiosfs: {msg}");
            st.failed = Some(msg.into());
            return Err(e);
        }
        let blocks: u64 = runs.iter().map(|(_, ls)| ls.len() as u64).sum();
        let st = &mut *st;
        if let Some(n) = st.nodes.get_mut(&ino) {
            let mut k = 0;
            for ((p, ls), buf) in runs.iter().zip(&written) {
                for (i, &l) in ls.iter().enumerate() {
                    let bytes = &buf[i * BLOCK..(i + 1) * BLOCK];
                    let same = !superseded[k]
                        && n.phys(l) == Some(p + i as u64)
                        && !n.fresh.contains(&l)
                        && n.dirty.get(&l).is_some_and(|d| **d == *bytes);
                    k += 1;
                    if same {
                        n.dirty.remove(&l);
                        st.dirty_bytes -= BLOCK;
                        ctx.stored(self, p + i as u64, bytes);
                    }
                }
            }
            if n.dirty.is_empty() {
                st.dirty_data.remove(&ino);
            }
        }
        self.stats.fsync_in_place.fetch_add(1, Ordering::Relaxed);
        self.stats
            .data_blocks_written
            .fetch_add(blocks, Ordering::Relaxed);
        Ok(())
    }

    /// Clean unmount: commit, checkpoint every journal area, mark the superblock not mounted.
    pub fn unmount(&self) -> Result<(), FsError> {
        let ctx = self
            .ctx()
            .map_err(|e| FsError::Config(format!("errno {e}")))?;
        let mut st = self
            .lock()
            .map_err(|e| FsError::Config(format!("errno {e}")))?;
        if let Some(f) = &st.failed {
            return Err(FsError::Config(f.clone()));
        }
        self.commit_locked(&mut st, &ctx, None)
            .map_err(|e| FsError::Config(format!("final commit failed: errno {e}")))?;
        ctx.journal.checkpoint()?;
        let mut sb = self.sb.clone();
        sb.mounted = false;
        let mut b = vec![0u8; BLOCK];
        sb.encode(&mut b);
        ctx.write_block(0, &b)
            .map_err(|e| FsError::Config(format!("superblock write failed: errno {e}")))?;
        ctx.dev().flush_blocking()?;
        st.failed = Some("unmounted".into());
        Ok(())
    }

    fn free_orphans(&self) -> FsResult<u64> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        let mut orphans = Vec::new();
        for tb in 0..self.sb.inode_table.count {
            let any = (0..INODES_PER_BLOCK as u64)
                .map(|s| tb * INODES_PER_BLOCK as u64 + s)
                .any(|i| i > 0 && i < self.sb.inodes && bit(&st.ibm, i));
            if !any {
                continue;
            }
            self.load_itab(&mut st, &ctx, tb)?;
        }
        for (&ino, n) in &st.nodes {
            // The root is never an orphan: a root with no links is damage (fsck says so).
            if n.attr.nlink == 0 && ino != ROOT_INO {
                orphans.push(ino);
            }
        }
        for &ino in &orphans {
            self.destroy(&mut st, ino);
            // Many orphans may span more inode table blocks than one transaction holds.
            if self.meta_pending(&st) * 4 > self.log_len {
                self.commit_locked_short(&mut st, &ctx, None)?;
            }
        }
        if !orphans.is_empty() {
            self.commit_locked(&mut st, &ctx, None)?;
        }
        Ok(orphans.len() as u64)
    }

    // ----- operations ----------------------------------------------------------------------

    pub fn getattr(&self, ino: u64) -> FsResult<Attr> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        Ok(self.node(&mut st, &ctx, ino)?.attr(ino))
    }

    /// Look `name` up in `parent`; counts a lookup reference when `count` (FUSE's rule).
    pub fn lookup(&self, parent: u64, name: &[u8], count: bool) -> FsResult<Attr> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        let e = self
            .dir(&mut st, &ctx, parent)?
            .get(name)
            .ok_or(libc::ENOENT)?
            .ino;
        let n = self.node(&mut st, &ctx, e)?;
        if count {
            n.lookups += 1;
        }
        Ok(n.attr(e))
    }

    pub fn forget(&self, ino: u64, n: u64) {
        let Ok(mut st) = self.lock() else { return };
        if let Some(node) = st.nodes.get_mut(&ino) {
            node.lookups = node.lookups.saturating_sub(n);
            self.maybe_destroy(&mut st, ino);
        }
    }

    /// Count an open of `ino`, for callers that drive `Fs` themselves: an unlinked file stays
    /// until its opens are [`Fs::release`]d and its lookups forgotten. The mount counts none
    /// (the kernel opens files without asking, and keeps their lookups while they are open).
    pub fn open_file(&self, ino: u64) -> FsResult<()> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.node(&mut st, &ctx, ino)?.opens += 1;
        Ok(())
    }

    /// Undo one [`Fs::open_file`]; frees the file if it was unlinked and nothing else holds it.
    pub fn release(&self, ino: u64) {
        let Ok(mut st) = self.lock() else { return };
        if let Some(node) = st.nodes.get_mut(&ino) {
            node.opens = node.opens.saturating_sub(1);
            self.maybe_destroy(&mut st, ino);
        }
    }

    fn check_name(name: &[u8]) -> FsResult<()> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
            return Err(libc::EINVAL);
        }
        Ok(())
    }

    /// Before an operation that may take `need` blocks changes anything: when they are free
    /// only once the blocks freed since the last commit come back (those count as free but
    /// may be taken only after it), commit first.
    fn room_for(&self, st: &mut State, ctx: &Ctx, need: u64) -> FsResult<()> {
        if !st.quarantine.is_empty() && st.free_blocks < st.quarantine.len() as u64 + need {
            // Xattrs this commit leaves for later are not this operation's (see
            // `alloc_for_map`): it goes on with the room the commit made.
            self.commit_locked_short(st, ctx, None)?;
        }
        Ok(())
    }

    /// [`Self::room_for`] a new entry added by link or rename: a directory block and that
    /// directory's extent leaf.
    fn room_for_entry(&self, st: &mut State, ctx: &Ctx) -> FsResult<()> {
        self.room_for(st, ctx, 2)
    }

    /// Add `name` -> `ino` to directory `parent` (growing it by a block when full).
    fn add_entry(
        &self,
        st: &mut State,
        ctx: &Ctx,
        parent: u64,
        name: &[u8],
        ino: u64,
        kind: u8,
    ) -> FsResult<()> {
        let e = DirEntry {
            ino,
            kind,
            name: name.to_vec(),
        };
        let d = self.dir(st, ctx, parent)?;
        if let Err(e) = d.insert(e) {
            let nb = d.blocks.len() as u64;
            let n = st.nodes.get(&parent).expect("parent");
            if n.map.len() >= MAX_EXTENTS {
                return Err(libc::ENOSPC);
            }
            let goal = nb.checked_sub(1).and_then(|l| n.phys(l)).map(|p| p + 1);
            let p = self.alloc_block(st, goal)?;
            let n = &st.nodes[&parent];
            if !n.joins(nb, p) {
                // A new extent: the extent leaf it needs, if any, is taken now.
                if let Err(e) = self.reserve_leaves(st, parent, n.map.len() + 1) {
                    self.unalloc(st, p);
                    return Err(if e == libc::EFBIG { libc::ENOSPC } else { e });
                }
            }
            let n = st.nodes.get_mut(&parent).expect("parent");
            n.map_block(nb, p);
            n.attr.size = (nb + 1) * B;
            n.dir.as_mut().expect("dir").push_block(e);
        }
        let t = now();
        let n = st.nodes.get_mut(&parent).expect("parent");
        n.attr.mtime = t;
        n.attr.ctime = t;
        Self::touch(st, parent);
        Ok(())
    }

    fn new_node(
        &self,
        st: &mut State,
        mode: u32,
        caller: Caller,
        parent_gid_mode: (u32, u32),
        rdev: u32,
    ) -> Node {
        let t = now();
        st.generation = st.generation.wrapping_add(1);
        let (pgid, pmode) = parent_gid_mode;
        let (gid, mut mode) = if pmode & libc::S_ISGID != 0 {
            (pgid, mode)
        } else {
            (caller.gid, mode)
        };
        if pmode & libc::S_ISGID != 0 && mode & S_IFMT == S_IFDIR {
            mode |= libc::S_ISGID;
        }
        Node {
            attr: Inode {
                mode,
                uid: caller.uid,
                gid,
                nlink: if mode & S_IFMT == S_IFDIR { 2 } else { 1 },
                size: 0,
                atime: t,
                mtime: t,
                ctime: t,
                generation: st.generation,
                flags: 0,
                rdev,
                xattr: 0,
                extents: Vec::new(),
            },
            map: BTreeMap::new(),
            leaves: Vec::new(),
            dir: None,
            xattrs: Some(Vec::new()),
            dirty: BTreeMap::new(),
            fresh: BTreeSet::new(),
            layout_dirty: true,
            lookups: 1,
            opens: 0,
        }
    }

    /// Create a file, directory, special file or symlink named `name` in `parent`.
    pub fn mknod(
        &self,
        parent: u64,
        name: &[u8],
        mode: u32,
        rdev: u32,
        caller: Caller,
        symlink: Option<&[u8]>,
    ) -> FsResult<Attr> {
        Self::check_name(name)?;
        // A symlink's target lives in one block (the kernel's own limit, PATH_MAX, is the same).
        if symlink.is_some_and(|t| t.len() > BLOCK) {
            return Err(libc::ENAMETOOLONG);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let pn = self.node(&mut st, &ctx, parent)?;
        if !pn.attr.is_dir() {
            return Err(libc::ENOTDIR);
        }
        if pn.attr.nlink < 2 {
            return Err(libc::ENOENT); // removed while open
        }
        let pgm = (pn.attr.gid, pn.attr.mode);
        if self.dir(&mut st, &ctx, parent)?.get(name).is_some() {
            return Err(libc::EEXIST);
        }
        let is_dir = mode & S_IFMT == S_IFDIR;
        if is_dir && st.nodes[&parent].attr.nlink >= u32::MAX - 1 {
            return Err(libc::EMLINK);
        }
        // Blocks this needs at most: a directory block for the parent and the extent leaf
        // its map may then need, and one for a new directory or symlink target.
        self.room_for(&mut st, &ctx, 2 + (is_dir || symlink.is_some()) as u64)?;
        let ino = self.alloc_inode(&mut st, &ctx)?;
        let mut node = self.new_node(&mut st, mode, caller, pgm, rdev);
        let undo = |st: &mut State| {
            clear_bit(&mut st.ibm, ino);
            st.free_inodes += 1;
        };
        if is_dir {
            let p = match self.alloc_block(&mut st, None) {
                Ok(p) => p,
                Err(e) => {
                    undo(&mut st);
                    return Err(e);
                }
            };
            node.map_block(0, p);
            node.attr.size = B;
            let mut d = Dir::default();
            let dot = |n: &[u8], i: u64| DirEntry {
                ino: i,
                kind: (S_IFDIR >> 12) as u8,
                name: n.to_vec(),
            };
            d.push_block(dot(b".", ino));
            d.insert(dot(b"..", parent)).expect("room for ..");
            node.dir = Some(d);
        }
        if let Some(target) = symlink {
            let p = match self.alloc_block(&mut st, None) {
                Ok(p) => p,
                Err(e) => {
                    undo(&mut st);
                    return Err(e);
                }
            };
            let mut blk = vec![0u8; BLOCK];
            blk[..target.len()].copy_from_slice(target);
            st.new_meta.insert(p, blk);
            node.map_block(0, p);
            node.attr.size = target.len() as u64;
        }
        let kind = node.kind();
        st.nodes.insert(ino, node);
        Self::touch(&mut st, ino);
        if let Err(e) = self.add_entry(&mut st, &ctx, parent, name, ino, kind) {
            // Roll back: nothing about the new inode was committed, so its block (a new
            // directory's, or a symlink's target) is allocatable again at once, as every
            // rollback's block is (`unalloc`). Left in quarantine by `destroy`, it stayed
            // unusable until the next commit, which could not use it either: on a full disk
            // that commit left another file's new xattrs for later (ENOSPC).
            let own = st.nodes[&ino].phys(0);
            self.destroy(&mut st, ino);
            if let Some(p) = own {
                st.quarantine.remove(&p);
            }
            return Err(e);
        }
        if is_dir {
            st.nodes.get_mut(&parent).expect("parent").attr.nlink += 1;
        }
        let attr = st.nodes[&ino].attr(ino);
        self.settle(&mut st, &ctx)?;
        Ok(attr)
    }

    pub fn readlink(&self, ino: u64) -> FsResult<Vec<u8>> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        let n = self.node(&mut st, &ctx, ino)?;
        if n.attr.mode & S_IFMT != S_IFLNK {
            return Err(libc::EINVAL);
        }
        let len = n.attr.size as usize;
        let p = n.phys(0).ok_or(libc::EIO)?;
        if len > BLOCK {
            return Err(libc::EIO);
        }
        if let Some(b) = st.new_meta.get(&p) {
            return Ok(b[..len].to_vec());
        }
        // Journaled and not yet home: the home block is older (zeros, or a former owner's).
        let in_flight = st
            .committing
            .as_ref()
            .and_then(|c| c.after.tx.meta_block(p));
        if let Some(b) = in_flight {
            return Ok(b[..len].to_vec());
        }
        if let Some(b) = self.set.unhomed_copy(p) {
            return Ok(b[..len].to_vec());
        }
        Ok(ctx.read_blocks(p, 1)?[..len].to_vec())
    }

    pub fn link(&self, ino: u64, parent: u64, name: &[u8]) -> FsResult<Attr> {
        Self::check_name(name)?;
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let n = self.node(&mut st, &ctx, ino)?;
        if n.attr.is_dir() {
            return Err(libc::EPERM);
        }
        if n.attr.nlink >= 65000 {
            return Err(libc::EMLINK);
        }
        let kind = n.kind();
        let pn = self.node(&mut st, &ctx, parent)?;
        if pn.attr.nlink < 2 {
            return Err(libc::ENOENT);
        }
        if self.dir(&mut st, &ctx, parent)?.get(name).is_some() {
            return Err(libc::EEXIST);
        }
        self.room_for_entry(&mut st, &ctx)?;
        self.add_entry(&mut st, &ctx, parent, name, ino, kind)?;
        let n = st.nodes.get_mut(&ino).expect("node");
        n.attr.nlink += 1;
        n.attr.ctime = now();
        n.lookups += 1;
        let a = n.attr(ino);
        Self::touch(&mut st, ino);
        self.settle(&mut st, &ctx)?;
        Ok(a)
    }

    /// `unlink` (`dir` false) or `rmdir` (`dir` true).
    pub fn remove(&self, parent: u64, name: &[u8], dir: bool) -> FsResult<()> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        if dir && name == b"." {
            return Err(libc::EINVAL);
        }
        if dir && name == b".." {
            return Err(libc::ENOTEMPTY);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let e = self
            .dir(&mut st, &ctx, parent)?
            .get(name)
            .ok_or(libc::ENOENT)?
            .clone();
        let n = self.node(&mut st, &ctx, e.ino)?;
        let is_dir = n.attr.is_dir();
        if dir && !is_dir {
            return Err(libc::ENOTDIR);
        }
        if !dir && is_dir {
            return Err(libc::EISDIR);
        }
        if is_dir && self.dir(&mut st, &ctx, e.ino)?.children() > 0 {
            return Err(libc::ENOTEMPTY);
        }
        self.dir(&mut st, &ctx, parent)?.remove(name);
        let t = now();
        let p = st.nodes.get_mut(&parent).expect("parent");
        p.attr.mtime = t;
        p.attr.ctime = t;
        if is_dir {
            dec(&mut p.attr.nlink);
        }
        Self::touch(&mut st, parent);
        let n = st.nodes.get_mut(&e.ino).expect("node");
        n.attr.ctime = t;
        n.attr.nlink = if is_dir {
            0
        } else {
            n.attr.nlink.saturating_sub(1)
        };
        Self::touch(&mut st, e.ino);
        self.maybe_destroy(&mut st, e.ino);
        self.settle(&mut st, &ctx)
    }

    /// Is `anc` an ancestor of (or equal to) directory `d`?
    fn is_ancestor(&self, st: &mut State, ctx: &Ctx, anc: u64, mut d: u64) -> FsResult<bool> {
        for _ in 0..100_000 {
            if d == anc {
                return Ok(true);
            }
            if d == ROOT_INO {
                return Ok(false);
            }
            d = self.dir(st, ctx, d)?.get(b"..").ok_or(libc::EIO)?.ino;
        }
        Err(libc::ELOOP)
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> FsResult<()> {
        // Flags first, as Linux checks them: unknown ones (`RENAME_WHITEOUT` too, which aiosfs
        // does not offer) and `RENAME_EXCHANGE` with `RENAME_NOREPLACE` are EINVAL.
        let exchange_noreplace = libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE;
        if flags & !exchange_noreplace != 0 || flags & exchange_noreplace == exchange_noreplace {
            return Err(libc::EINVAL);
        }
        Self::check_name(newname)?;
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        // "." and ".." are not entries to move or replace (Linux says EBUSY): moved, "." would
        // leave its directory named twice and without it.
        if [name, newname].iter().any(|n| *n == b"." || *n == b"..") {
            return Err(libc::EBUSY);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let src = self
            .dir(&mut st, &ctx, parent)?
            .get(name)
            .ok_or(libc::ENOENT)?
            .clone();
        let np = self.node(&mut st, &ctx, newparent)?;
        if !np.attr.is_dir() {
            return Err(libc::ENOTDIR);
        }
        if np.attr.nlink < 2 {
            return Err(libc::ENOENT); // removed while open, as in mknod and link
        }
        let dst = self.dir(&mut st, &ctx, newparent)?.get(newname).cloned();
        let src_dir = self.node(&mut st, &ctx, src.ino)?.attr.is_dir();
        if flags & libc::RENAME_EXCHANGE != 0 {
            let dst = dst.ok_or(libc::ENOENT)?;
            let dst_dir = self.node(&mut st, &ctx, dst.ino)?.attr.is_dir();
            if (src_dir && self.is_ancestor(&mut st, &ctx, src.ino, newparent)?)
                || (dst_dir && self.is_ancestor(&mut st, &ctx, dst.ino, parent)?)
            {
                return Err(libc::EINVAL);
            }
            if parent != newparent {
                for (d, is_dir) in [(src.ino, src_dir), (dst.ino, dst_dir)] {
                    if is_dir {
                        self.dotdot_ready(&mut st, &ctx, d)?;
                    }
                }
            }
            self.replace_entry(&mut st, &ctx, parent, name, dst.ino, dst.kind)?;
            self.replace_entry(&mut st, &ctx, newparent, newname, src.ino, src.kind)?;
            if parent != newparent {
                if src_dir {
                    self.set_dotdot(&mut st, &ctx, src.ino, newparent)?;
                    dec(&mut st.nodes.get_mut(&parent).expect("p").attr.nlink);
                    st.nodes.get_mut(&newparent).expect("p").attr.nlink += 1;
                }
                if dst_dir {
                    self.set_dotdot(&mut st, &ctx, dst.ino, parent)?;
                    dec(&mut st.nodes.get_mut(&newparent).expect("p").attr.nlink);
                    st.nodes.get_mut(&parent).expect("p").attr.nlink += 1;
                }
            }
            let t = now();
            for i in [src.ino, dst.ino, parent, newparent] {
                st.nodes.get_mut(&i).expect("n").attr.ctime = t;
                Self::touch(&mut st, i);
            }
            // Both directories' entries changed.
            for i in [parent, newparent] {
                st.nodes.get_mut(&i).expect("p").attr.mtime = t;
            }
            return self.settle(&mut st, &ctx);
        }
        if let Some(d) = &dst {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(libc::EEXIST);
            }
            if d.ino == src.ino {
                return Ok(()); // two links to one file: nothing to do
            }
            let dst_dir = self.node(&mut st, &ctx, d.ino)?.attr.is_dir();
            if src_dir && !dst_dir {
                return Err(libc::ENOTDIR);
            }
            if !src_dir && dst_dir {
                return Err(libc::EISDIR);
            }
            if dst_dir && self.dir(&mut st, &ctx, d.ino)?.children() > 0 {
                return Err(libc::ENOTEMPTY);
            }
        }
        if src_dir && self.is_ancestor(&mut st, &ctx, src.ino, newparent)? {
            return Err(libc::EINVAL);
        }
        if src_dir
            && dst.is_none()
            && parent != newparent
            && st.nodes[&newparent].attr.nlink >= u32::MAX - 1
        {
            return Err(libc::EMLINK);
        }
        if src_dir && parent != newparent {
            self.dotdot_ready(&mut st, &ctx, src.ino)?;
        }
        if dst.is_none() {
            self.room_for_entry(&mut st, &ctx)?;
        }
        let t = now();
        // Target first (it can fail on a full disk), then the source goes.
        match &dst {
            Some(d) => {
                self.replace_entry(&mut st, &ctx, newparent, newname, src.ino, src.kind)?;
                let n = st.nodes.get_mut(&d.ino).expect("dst");
                n.attr.ctime = t;
                if n.attr.is_dir() {
                    n.attr.nlink = 0;
                    dec(&mut st.nodes.get_mut(&newparent).expect("np").attr.nlink);
                } else {
                    dec(&mut n.attr.nlink);
                }
                Self::touch(&mut st, d.ino);
            }
            None => self.add_entry(&mut st, &ctx, newparent, newname, src.ino, src.kind)?,
        }
        self.dir(&mut st, &ctx, parent)?.remove(name);
        if src_dir && parent != newparent {
            self.set_dotdot(&mut st, &ctx, src.ino, newparent)?;
            dec(&mut st.nodes.get_mut(&parent).expect("p").attr.nlink);
            st.nodes.get_mut(&newparent).expect("np").attr.nlink += 1;
        }
        for i in [parent, newparent] {
            let n = st.nodes.get_mut(&i).expect("p");
            n.attr.mtime = t;
            n.attr.ctime = t;
            Self::touch(&mut st, i);
        }
        st.nodes.get_mut(&src.ino).expect("src").attr.ctime = t;
        Self::touch(&mut st, src.ino);
        // Last: freeing a large file commits between its steps, and each commit must find
        // the rename whole.
        if let Some(d) = &dst {
            self.maybe_destroy(&mut st, d.ino);
        }
        self.settle(&mut st, &ctx)
    }

    fn replace_entry(
        &self,
        st: &mut State,
        ctx: &Ctx,
        dir: u64,
        name: &[u8],
        ino: u64,
        kind: u8,
    ) -> FsResult<()> {
        let d = self.dir(st, ctx, dir)?;
        let &(b, s) = d.index.get(name).ok_or(libc::ENOENT)?;
        let e = d.blocks[b as usize].slots[s as usize]
            .as_mut()
            .expect("slot");
        e.ino = ino;
        e.kind = kind;
        d.dirty.insert(b);
        Ok(())
    }

    /// Before a rename changes anything: load directory `dir`, which it moves to another
    /// parent, and check it has "..", so that [`Self::set_dotdot`] cannot fail later. Failing
    /// there, part way (one directory's entry changed and marked, the other's changed and not
    /// yet), the next commit would write one directory without the other.
    fn dotdot_ready(&self, st: &mut State, ctx: &Ctx, dir: u64) -> FsResult<()> {
        match self.dir(st, ctx, dir)?.get(b"..") {
            Some(_) => Ok(()),
            None => {
                eprintln!("aiosfs: directory {dir} has no \"..\" (run aios fsck)");
                Err(libc::EIO)
            }
        }
    }

    fn set_dotdot(&self, st: &mut State, ctx: &Ctx, dir: u64, parent: u64) -> FsResult<()> {
        self.replace_entry(st, ctx, dir, b"..", parent, (S_IFDIR >> 12) as u8)
    }

    /// Directory entries from cookie `offset` on: (cookie of the next, ino, kind, name).
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
        mut add: impl FnMut(u64, u64, u8, &[u8]) -> bool,
    ) -> FsResult<()> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        let d = self.dir(&mut st, &ctx, ino)?;
        let (mut b, mut s) = (offset / DIR_SLOTS, offset % DIR_SLOTS);
        while (b as usize) < d.blocks.len() {
            let blk = &d.blocks[b as usize];
            while (s as usize) < blk.slots.len() {
                if let Some(e) = &blk.slots[s as usize] {
                    let next = b * DIR_SLOTS + s + 1;
                    if add(next, e.ino, e.kind, &e.name) {
                        return Ok(());
                    }
                }
                s += 1;
            }
            b += 1;
            s = 0;
        }
        Ok(())
    }

    pub fn setattr(&self, ino: u64, set: &SetAttr) -> FsResult<Attr> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let kill_privs = set.kill_privs && set.mode.is_none();
        if kill_privs {
            // Read before anything changes: `kill_privs` below can fail only here, and failing
            // there would leave the owner, mode and size changed in memory with the inode
            // unmarked (the next change of it would commit them, after an EIO).
            self.load_xattrs(&mut st, &ctx, ino)?;
        }
        let t = now();
        if let Some(size) = set.size {
            if size > MAX_FILE_BYTES {
                return Err(libc::EFBIG);
            }
            let n = self.node(&mut st, &ctx, ino)?;
            if n.attr.is_dir() {
                return Err(libc::EISDIR);
            }
            self.truncate(&mut st, &ctx, ino, size)?;
            let n = st.nodes.get_mut(&ino).expect("node");
            n.attr.mtime = t;
            n.attr.ctime = t;
        }
        let n = self.node(&mut st, &ctx, ino)?;
        if let Some(m) = set.mode {
            n.attr.mode = (n.attr.mode & S_IFMT) | (m & 0o7777);
        }
        if let Some(u) = set.uid {
            n.attr.uid = u;
        }
        if let Some(g) = set.gid {
            n.attr.gid = g;
        }
        if let Some(a) = set.atime {
            n.attr.atime = a.unwrap_or(t);
        }
        if let Some(m) = set.mtime {
            n.attr.mtime = m.unwrap_or(t);
        }
        n.attr.ctime = t;
        if kill_privs {
            self.kill_privs(&mut st, &ctx, ino, true)?;
        }
        let n = st.nodes.get_mut(&ino).expect("node");
        let a = n.attr(ino);
        Self::touch(&mut st, ino);
        self.settle(&mut st, &ctx)?;
        Ok(a)
    }

    /// Drop the `security.capability` xattr of regular file `ino`, and with `suidgid` clear
    /// set-user-ID and set-group-ID when group-executable, as Linux does on a write, truncate
    /// or chown (the bits only for a process without `CAP_FSETID`; the capability always);
    /// `true` when something changed (the caller touches the node).
    fn kill_privs(&self, st: &mut State, ctx: &Ctx, ino: u64, suidgid: bool) -> FsResult<bool> {
        let n = st.nodes.get_mut(&ino).expect("node");
        if n.attr.mode & S_IFMT != libc::S_IFREG {
            return Ok(false);
        }
        let mut changed = false;
        if suidgid
            && (n.attr.mode & libc::S_ISUID != 0
                || n.attr.mode & (libc::S_ISGID | 0o010) == (libc::S_ISGID | 0o010))
        {
            n.attr.mode &= !(libc::S_ISUID | libc::S_ISGID);
            changed = true;
        }
        if n.attr.xattr != 0 || n.xattrs.as_ref().is_some_and(|x| !x.is_empty()) {
            self.load_xattrs(st, ctx, ino)?;
            let n = st.nodes.get_mut(&ino).expect("node");
            let x = n.xattrs.as_mut().expect("loaded");
            if let Some(pos) = x.iter().position(|(k, _)| k == b"security.capability") {
                x.remove(pos);
                st.dirty_xattrs.insert(ino);
                changed = true;
            }
        }
        Ok(changed)
    }

    fn truncate(&self, st: &mut State, ctx: &Ctx, ino: u64, size: u64) -> FsResult<()> {
        let old = st.nodes[&ino].attr.size;
        if size < old {
            // Zero the rest of the last block, so growing the file later reads zeros. First:
            // it may read the block and fail, and nothing may have changed then (freed
            // blocks with the inode unmarked would be written free while the inode on disk
            // still maps them). The block is below `keep`, so it is not freed below.
            if size % B != 0 {
                let l = size / B;
                self.zero_in_block(st, ctx, ino, l, (size % B) as usize, BLOCK)?;
            }
            // In steps for a large file, the size going down with each (see `free_range`).
            self.free_range(st, ctx, ino, size.div_ceil(B), u64::MAX, Some(size))?;
        }
        let n = st.nodes.get_mut(&ino).expect("node");
        n.layout_dirty = true;
        n.attr.size = size;
        Self::touch(st, ino);
        Ok(())
    }

    /// Zero bytes `[from, to)` of file block `l` if it is mapped.
    fn zero_in_block(
        &self,
        st: &mut State,
        ctx: &Ctx,
        ino: u64,
        l: u64,
        from: usize,
        to: usize,
    ) -> FsResult<()> {
        // The zeroed block goes with whichever commit comes next (as a fresh block does), not
        // only with this file's fsync: that commit carries the size or the freed blocks that
        // the zeroing belongs with, and without it the old bytes would come back past the
        // new end after a crash.
        let read = self.read_for_zeroing(st.nodes.get(&ino).expect("node"), ctx, l)?;
        self.zero_read_block(st, ino, l, from, to, read);
        Ok(())
    }

    /// The first half of [`Self::zero_in_block`], which changes nothing: block `l` of `n` read
    /// from the device when it is mapped and not dirty (`None` otherwise: a dirty block is
    /// zeroed in memory, a hole needs nothing).
    fn read_for_zeroing(&self, n: &Node, ctx: &Ctx, l: u64) -> FsResult<Option<Box<[u8]>>> {
        if n.dirty.contains_key(&l) {
            return Ok(None);
        }
        let Some(p) = n.phys(l) else { return Ok(None) };
        let mut b = vec![0u8; BLOCK];
        ctx.read_data(self, p, &mut b, false)?;
        Ok(Some(b.into_boxed_slice()))
    }

    /// The second half of [`Self::zero_in_block`]: zero bytes `[from, to)` of block `l`, in
    /// its dirty copy or in `read` ([`Self::read_for_zeroing`]'s answer, taken under the same
    /// hold of the lock), which becomes its dirty copy.
    fn zero_read_block(
        &self,
        st: &mut State,
        ino: u64,
        l: u64,
        from: usize,
        to: usize,
        read: Option<Box<[u8]>>,
    ) {
        let n = st.nodes.get_mut(&ino).expect("node");
        if let Some(buf) = n.dirty.get_mut(&l) {
            buf[from..to].fill(0);
            n.fresh.insert(l);
            return;
        }
        let Some(mut b) = read else { return };
        b[from..to].fill(0);
        n.fresh.insert(l);
        n.dirty.insert(l, b);
        st.dirty_bytes += BLOCK;
        st.dirty_data.insert(ino);
    }

    /// The device block holding block `block` of file `ino` (as FIBMAP answers), `None` for a
    /// hole.
    pub fn bmap(&self, ino: u64, block: u64) -> FsResult<Option<u64>> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        Ok(self.node(&mut st, &ctx, ino)?.phys(block))
    }

    /// Read up to `size` bytes at `offset`, clean data through the page cache.
    pub fn read(&self, ino: u64, offset: u64, size: u32) -> FsResult<Vec<u8>> {
        self.read_with(ino, offset, size, false)
    }

    /// Read up to `size` bytes at `offset`; `direct` (a file opened `O_DIRECT`) reads clean
    /// data from the device and leaves the page cache alone, as `O_DIRECT` does on a kernel
    /// file system. Dirty data comes from memory either way.
    pub fn read_with(&self, ino: u64, offset: u64, size: u32, direct: bool) -> FsResult<Vec<u8>> {
        // In pieces, so that a large `size` asks for no more memory than the file holds.
        const PIECE: usize = 1 << 20;
        let size = size as usize;
        let mut out = Vec::new();
        while out.len() < size {
            let (at, want) = (out.len(), (size - out.len()).min(PIECE));
            out.resize(at + want, 0);
            let n = self.read_into(ino, offset + at as u64, &mut out[at..], direct)?;
            out.truncate(at + n);
            if n < want {
                break;
            }
        }
        Ok(out)
    }

    /// Read up to `dst.len()` bytes at `offset` straight into `dst` (a FUSE reply's buffer);
    /// returns how many, fewer at the end of the file and 0 past it. `direct` as for
    /// [`Fs::read_with`]. Allocates nothing on the heap for a file of up to
    /// [`READ_RUNS_INLINE`] extents in the range read: clean data goes from the page cache (or
    /// an arena buffer, `direct`) into `dst`, dirty data from memory, holes are zeroed.
    pub fn read_into(
        &self,
        ino: u64,
        offset: u64,
        dst: &mut [u8],
        direct: bool,
    ) -> FsResult<usize> {
        let ctx = self.ctx()?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        // Runs of the read that lie contiguously on the device, as (offset in `dst`, device
        // byte, length): found under the lock, read after it.
        let mut runs: SmallVec<[(usize, u64, usize); READ_RUNS_INLINE]> = SmallVec::new();
        let len;
        let _reading;
        {
            let mut st = self.lock()?;
            let n = self.node(&mut st, &ctx, ino)?;
            if n.attr.is_dir() {
                return Err(libc::EISDIR);
            }
            if offset >= n.attr.size || dst.is_empty() {
                return Ok(0);
            }
            // (A damaged inode may claim any size: nothing here may overflow.)
            let end = n.attr.size.min(offset.saturating_add(dst.len() as u64));
            len = (end - offset) as usize;
            for l in offset / B..=(end - 1) / B {
                // The part of block `l` in the read: [from, to) in file bytes.
                let from = (l * B).max(offset);
                let to = (l * B).saturating_add(B).min(end);
                let (at, k, in_block) = ((from - offset) as usize, (to - from) as usize, from % B);
                if let Some(d) = n.dirty.get(&l) {
                    let i = in_block as usize;
                    dst[at..at + k].copy_from_slice(&d[i..i + k]);
                } else if let Some(p) = n.phys(l) {
                    let byte = p * B + in_block;
                    match runs.last_mut() {
                        Some((o, rb, c)) if *o + *c == at && *rb + *c as u64 == byte => *c += k,
                        _ => runs.push((at, byte, k)),
                    }
                } else {
                    dst[at..at + k].fill(0);
                }
            }
            _reading = (!runs.is_empty())
                .then(|| self.read_gate.read().unwrap_or_else(|p| p.into_inner()));
        }
        let pause = READ_TEST_PAUSE_US.with(|p| p.replace(0));
        if pause != 0 {
            READ_TEST_PAUSED.store(true, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_micros(pause));
        }
        for &(at, byte, k) in &runs {
            ctx.read_bytes(self, byte, &mut dst[at..at + k], direct)?;
        }
        Ok(len)
    }

    /// Write `data` at `offset`, clearing set-user-ID and set-group-ID as a write by an
    /// unprivileged process does; returns the bytes written.
    pub fn write(&self, ino: u64, offset: u64, data: &[u8]) -> FsResult<usize> {
        self.write_as(ino, offset, data, true)
    }

    /// Write `data` at `offset`. Any write drops the `security.capability` xattr; with
    /// `kill_privs` it also clears set-user-ID and set-group-ID (when group-executable), as
    /// Linux does for a writer without `CAP_FSETID` (the kernel says which in
    /// `FUSE_WRITE_KILL_SUIDGID`).
    pub fn write_as(
        &self,
        ino: u64,
        offset: u64,
        data: &[u8],
        kill_privs: bool,
    ) -> FsResult<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        let end = offset.checked_add(data.len() as u64).ok_or(libc::EFBIG)?;
        if end > MAX_FILE_BYTES {
            return Err(libc::EFBIG);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        let n = self.node(&mut st, &ctx, ino)?;
        if n.attr.is_dir() {
            return Err(libc::EISDIR);
        }
        // The xattrs `kill_privs` looks at below, read before anything changes: failing there,
        // after blocks were mapped and marked in use, would leave the inode unmarked, and the
        // next commit would write the bitmap without it.
        self.load_xattrs(&mut st, &ctx, ino)?;
        let first = offset / B;
        let last = (end - 1) / B;
        let mut done = 0usize;
        let mut allocated = false;
        for l in first..=last {
            let bstart = l * B;
            let from = offset.max(bstart) - bstart;
            let to = end.min(bstart + B) - bstart;
            let src = &data[done..done + (to - from) as usize];
            let n = st.nodes.get_mut(&ino).expect("node");
            if let Some(buf) = n.dirty.get_mut(&l) {
                buf[from as usize..to as usize].copy_from_slice(src);
            } else if let Some(p) = n.phys(l) {
                let mut b = vec![0u8; BLOCK];
                if from != 0 || to != B {
                    if let Err(e) = ctx.read_data(self, p, &mut b, false) {
                        // Only the first or last block is read. Failing at the last, blocks
                        // before it may be mapped already: the bytes so far are written (as
                        // Linux answers), and the inode is marked below with them.
                        if done > 0 {
                            break;
                        }
                        return Err(e);
                    }
                }
                b[from as usize..to as usize].copy_from_slice(src);
                n.dirty.insert(l, b.into_boxed_slice());
                st.dirty_bytes += BLOCK;
                st.dirty_data.insert(ino);
            } else {
                // Over scattered free blocks each block may dirty a bitmap block of its own:
                // commit what is written so far before the metadata outgrows a transaction.
                if self.meta_pending(&st) * 2 > self.log_len {
                    let n = st.nodes.get_mut(&ino).expect("node");
                    n.attr.size = n.attr.size.max(offset + done as u64);
                    n.layout_dirty = true;
                    Self::touch(&mut st, ino);
                    self.commit_locked_short(&mut st, &ctx, None)?;
                }
                let p = match self.alloc_for_map(&mut st, &ctx, ino, l, &mut || Ok(())) {
                    Ok(p) => p,
                    // Out of space or extents part way: the bytes so far are written.
                    Err(libc::ENOSPC | libc::EFBIG) if done > 0 => break,
                    Err(e) => return Err(e),
                };
                let n = st.nodes.get_mut(&ino).expect("node");
                n.map_block(l, p);
                n.fresh.insert(l);
                allocated = true;
                let mut b = vec![0u8; BLOCK];
                b[from as usize..to as usize].copy_from_slice(src);
                n.dirty.insert(l, b.into_boxed_slice());
                st.dirty_bytes += BLOCK;
                st.dirty_data.insert(ino);
            }
            done += (to - from) as usize;
        }
        let t = change_time();
        let n = st.nodes.get_mut(&ino).expect("node");
        let wend = offset + done as u64;
        let mut changed = allocated;
        if wend > n.attr.size {
            n.attr.size = wend;
            changed = true;
        }
        if changed {
            n.layout_dirty = true;
        }
        if n.attr.mtime != t || n.attr.ctime != t {
            n.attr.mtime = t;
            n.attr.ctime = t;
            changed = true;
        }
        changed |= self.kill_privs(&mut st, &ctx, ino, kill_privs)?;
        if changed {
            Self::touch(&mut st, ino);
        }
        self.settle(&mut st, &ctx)?;
        Ok(done)
    }

    /// `fallocate`: mode 0 or `FALLOC_FL_KEEP_SIZE` allocate (zeroed), `FALLOC_FL_PUNCH_HOLE
    /// | FALLOC_FL_KEEP_SIZE` frees.
    pub fn fallocate(&self, ino: u64, offset: u64, len: u64, mode: i32) -> FsResult<()> {
        let end = offset.checked_add(len).ok_or(libc::EFBIG)?;
        if len == 0 {
            return Err(libc::EINVAL);
        }
        if end > MAX_FILE_BYTES {
            return Err(libc::EFBIG);
        }
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let punch = mode & libc::FALLOC_FL_PUNCH_HOLE != 0;
        if mode & !(libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE) != 0 || (punch && !keep)
        {
            return Err(libc::EOPNOTSUPP);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        if self.node(&mut st, &ctx, ino)?.attr.is_dir() {
            return Err(libc::EISDIR);
        }
        let t = now();
        if punch {
            // Whole blocks are freed up to the end of the range, past the size too (blocks
            // that `FALLOC_FL_KEEP_SIZE` allocated there), as on Linux. Partial blocks are
            // zeroed only below the size: past it a block reads as zeros already.
            let size = st.nodes[&ino].attr.size;
            {
                let (a, b) = (offset.div_ceil(B), end / B);
                // A hole inside one extent splits it in two: the map grows by one, and may
                // need another extent leaf first (refused past the most a file can have).
                let n = &st.nodes[&ino];
                let splits = a < b
                    && n.map
                        .range(..a)
                        .next_back()
                        .is_some_and(|(&s, &(_, len))| s.saturating_add(len as u64) > b);
                // Freed in steps, the first step's cut may fall inside the extent that runs
                // past the hole's end even when it starts inside the hole: that step splits it,
                // and the commit after it must find a leaf for the extent more.
                let budget = self.free_step_budget();
                let splits = splits
                    || (a < b
                        && n.map
                            .range(..b)
                            .next_back()
                            .is_some_and(|(&s, &(_, len))| s.saturating_add(len as u64) > b)
                        && free_cut(n, a, b, budget, &st.dirty_bbm, &st.journaled) > a);
                let mut leaves_had = n.leaves.len();
                if splits {
                    let more = n.map.len() + 1;
                    let r = match self.reserve_leaves(&mut st, ino, more) {
                        Err(libc::ENOSPC) if !st.quarantine.is_empty() => {
                            // Blocks freed since the last commit come back once it is durable.
                            // Xattrs it leaves for later are not the punch's to report.
                            self.commit_locked_short(&mut st, &ctx, None)?;
                            leaves_had = st.nodes[&ino].leaves.len();
                            self.reserve_leaves(&mut st, ino, more)
                        }
                        r => r,
                    };
                    r.map_err(|_| libc::ENOSPC)?;
                }
                // The partial blocks at either end (below the size) are read before anything
                // changes: a read that fails then leaves the file as it was, where freeing the
                // whole blocks first left them punched behind an error.
                let end = end.min(size);
                let mut edges: SmallVec<[(u64, usize, usize); 2]> = SmallVec::new();
                if offset < end {
                    let (fl, ll) = (offset / B, (end - 1) / B);
                    if offset % B != 0 || fl == ll {
                        let to = if fl == ll {
                            (end - fl * B) as usize
                        } else {
                            BLOCK
                        };
                        edges.push((fl, (offset % B) as usize, to));
                    }
                    if ll != fl && end % B != 0 {
                        edges.push((ll, 0, (end % B) as usize));
                    }
                }
                // A block inside the whole-block range is freed, not zeroed.
                edges.retain(|e| !(a..b).contains(&e.0));
                let mut zeroed: SmallVec<[ZeroEdge; 2]> = SmallVec::new();
                for &(l, from, to) in &edges {
                    match self.read_for_zeroing(st.nodes.get(&ino).expect("node"), &ctx, l) {
                        Ok(buf) => zeroed.push((l, from, to, buf)),
                        Err(e) => {
                            // Give back a leaf taken above for the split (never committed).
                            let had = st.nodes[&ino].leaves.len().min(leaves_had);
                            let taken = st.nodes.get_mut(&ino).expect("node").leaves.split_off(had);
                            for p in taken {
                                self.unalloc(&mut st, p);
                            }
                            return Err(e);
                        }
                    }
                }
                // The edges first: the freeing may commit between its steps, and a commit may
                // take a dirty edge block out of memory.
                for (l, from, to, read) in zeroed {
                    self.zero_read_block(&mut st, ino, l, from, to, read);
                }
                if a < b {
                    // In steps for a large range: a crash between two leaves the upper part
                    // of the hole punched (see `free_range`).
                    self.free_range(&mut st, &ctx, ino, a, b, None)?;
                }
            }
        } else {
            // The inode is re-encoded by any commit from here on, so a block it maps is never
            // left allocated with no owner, even when the loop stops part way (out of space,
            // too many extents, an I/O error): the blocks allocated so far stay the file's,
            // past its size when the size does not grow.
            st.nodes.get_mut(&ino).expect("node").layout_dirty = true;
            Self::touch(&mut st, ino);
            let zeros = vec![0u8; BLOCK];
            // Blocks mapped (file block, block) whose zeros were written since the last FLUSH:
            // durable before any commit maps them (a commit with FUA writes sends no FLUSH of
            // its own).
            let mut unflushed: Vec<(u64, u64)> = Vec::new();
            let r: FsResult<()> = 'alloc: {
                for l in offset / B..end.div_ceil(B) {
                    let n = st.nodes.get(&ino).expect("node");
                    if n.phys(l).is_some() || n.dirty.contains_key(&l) {
                        continue;
                    }
                    // The block, and for a new extent the extent leaf it needs, if any. Out of
                    // blocks for either with some freed since the last commit, commit once to
                    // make those allocatable (as a write does), the zeros written so far made
                    // durable first.
                    let mut flush_zeros = || {
                        if !unflushed.is_empty() {
                            ctx.dev().flush_blocking().map_err(io_err)?;
                            unflushed.clear();
                        }
                        Ok(())
                    };
                    if self.meta_pending(&st) * 2 > self.log_len {
                        // As in a write: commit before the metadata outgrows a transaction,
                        // the zeros of the blocks it maps made durable first.
                        if let Err(e) = flush_zeros() {
                            break 'alloc Err(e);
                        }
                        st.nodes.get_mut(&ino).expect("node").layout_dirty = true;
                        Self::touch(&mut st, ino);
                        if let Err(e) = self.commit_locked_short(&mut st, &ctx, None) {
                            break 'alloc Err(e);
                        }
                    }
                    let p = match self.alloc_for_map(&mut st, &ctx, ino, l, &mut flush_zeros) {
                        Ok(p) => p,
                        Err(e) => break 'alloc Err(e),
                    };
                    // Zeros reach the block before any commit maps it.
                    if let Err(e) = ctx.write_block(p, &zeros) {
                        self.unalloc(&mut st, p);
                        break 'alloc Err(e);
                    }
                    ctx.stored(self, p, &zeros);
                    st.nodes.get_mut(&ino).expect("node").map_block(l, p);
                    unflushed.push((l, p));
                }
                Ok(())
            };
            // Whatever the loop did, the inode goes with the next commit (it maps every block
            // allocated, and a commit inside the loop may have taken it since).
            st.nodes.get_mut(&ino).expect("node").layout_dirty = true;
            Self::touch(&mut st, ino);
            if !unflushed.is_empty() {
                if let Err(e) = ctx.dev().flush_blocking() {
                    // Their zeros may not be durable: mapped by the next commit, the blocks
                    // could show a deleted file's bytes after a power cut. They go back (never
                    // committed: a commit inside the loop came after a FLUSH, which emptied
                    // the list), and the file keeps only what it had and what such a commit
                    // made durable. Unmapped top down, the map ends as it was at that point.
                    for &(l, p) in unflushed.iter().rev() {
                        let freed = st.nodes.get_mut(&ino).expect("node").unmap(l, l + 1);
                        debug_assert_eq!(freed, [p]);
                        for q in freed {
                            self.unalloc(&mut st, q);
                        }
                    }
                    return Err(io_err(e));
                }
            }
            r?;
            let n = st.nodes.get_mut(&ino).expect("node");
            if !keep && end > n.attr.size {
                n.attr.size = end;
                n.attr.mtime = t;
            }
        }
        let n = st.nodes.get_mut(&ino).expect("node");
        n.attr.ctime = t;
        if punch {
            // The file's bytes changed (as on ext4 and XFS).
            n.attr.mtime = t;
        }
        n.layout_dirty = true;
        Self::touch(&mut st, ino);
        self.settle(&mut st, &ctx)
    }

    pub fn statfs(&self) -> StatFs {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        StatFs {
            blocks: self.sb.data.count,
            bfree: st.free_blocks,
            files: self.sb.inodes - 1,
            ffree: st.free_inodes,
        }
    }

    // ----- extended attributes -------------------------------------------------------------

    pub fn getxattr(&self, ino: u64, name: &[u8]) -> FsResult<Vec<u8>> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.load_xattrs(&mut st, &ctx, ino)?;
        let x = st.nodes[&ino].xattrs.as_ref().expect("loaded");
        x.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .ok_or(libc::ENODATA)
    }

    pub fn listxattr(&self, ino: u64) -> FsResult<Vec<u8>> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.load_xattrs(&mut st, &ctx, ino)?;
        let mut out = Vec::new();
        for (n, _) in st.nodes[&ino].xattrs.as_ref().expect("loaded") {
            out.extend_from_slice(n);
            out.push(0);
        }
        Ok(out)
    }

    /// `setxattr` with `XATTR_CREATE` / `XATTR_REPLACE` flags.
    pub fn setxattr(&self, ino: u64, name: &[u8], value: &[u8], flags: i32) -> FsResult<()> {
        if name.is_empty() || name.len() > 255 {
            return Err(libc::ERANGE);
        }
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        self.load_xattrs(&mut st, &ctx, ino)?;
        let n = st.nodes.get_mut(&ino).expect("node");
        let x = n.xattrs.as_mut().expect("loaded");
        let pos = x.iter().position(|(k, _)| k == name);
        if pos.is_some() && flags & libc::XATTR_CREATE != 0 {
            return Err(libc::EEXIST);
        }
        if pos.is_none() && flags & libc::XATTR_REPLACE != 0 {
            return Err(libc::ENODATA);
        }
        let others = x
            .iter()
            .filter(|(k, _)| k != name)
            .map(|(k, v)| (&k[..], &v[..]));
        if xattr_bytes(others.chain([(name, value)])) > BLOCK {
            return Err(libc::ENOSPC);
        }
        match pos {
            Some(i) => x[i].1 = value.to_vec(),
            None => x.push((name.to_vec(), value.to_vec())),
        }
        n.attr.ctime = now();
        st.dirty_xattrs.insert(ino);
        Self::touch(&mut st, ino);
        self.settle(&mut st, &ctx)
    }

    pub fn removexattr(&self, ino: u64, name: &[u8]) -> FsResult<()> {
        let ctx = self.ctx()?;
        let mut st = self.lock()?;
        self.writable(&st)?;
        self.load_xattrs(&mut st, &ctx, ino)?;
        let n = st.nodes.get_mut(&ino).expect("node");
        let x = n.xattrs.as_mut().expect("loaded");
        let pos = x.iter().position(|(k, _)| k == name).ok_or(libc::ENODATA)?;
        x.remove(pos);
        n.attr.ctime = now();
        st.dirty_xattrs.insert(ino);
        Self::touch(&mut st, ino);
        self.settle(&mut st, &ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Node {
        Node {
            attr: Inode::default(),
            map: BTreeMap::new(),
            leaves: Vec::new(),
            dir: None,
            xattrs: None,
            dirty: BTreeMap::new(),
            fresh: BTreeSet::new(),
            layout_dirty: false,
            lookups: 0,
            opens: 0,
        }
    }

    #[test]
    fn extent_map_merges_and_splits() {
        let mut n = node();
        for l in 0..4 {
            n.map_block(l, 100 + l);
        }
        assert_eq!(n.map.len(), 1);
        n.map_block(10, 200);
        n.map_block(9, 199);
        assert_eq!(n.map.len(), 2);
        assert_eq!(n.phys(9), Some(199));
        assert_eq!(n.phys(5), None);
        // Filling the gap with blocks that line up joins nothing (physical runs differ).
        assert_eq!(n.unmap(1, 3), vec![101, 102]);
        assert_eq!(n.map.len(), 3);
        assert_eq!(n.phys(0), Some(100));
        assert_eq!(n.phys(3), Some(103));
        assert_eq!(n.unmap(0, u64::MAX).len(), 4);
        assert!(n.map.is_empty());
    }
}
