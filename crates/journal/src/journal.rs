//! Journal areas, transactions, commit (vanilla, overlapped, Rio-ordered), checkpoint, and
//! recovery on a device.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use aios_core::{Engine, FixedBuf};
use lbio::{Device, IoFuture, LbioError};
use rio_ordering::{AttrLog, LogScan, OrderedConfig, OrderedDevice, Pmr};
use smallvec::SmallVec;

use crate::error::JournalError;
use crate::format::{
    self, Header, Kind, Superblock, BLOCK, FLAG_FILE_TX, FLAG_ONE_WRITE, FLAG_RIO,
    REVOKES_PER_BLOCK, TAGS_PER_DESC,
};
use crate::recovery::{self, AreaLog, LogEnd};

/// Where the journal areas lie on the device, in bytes (each 4 KiB-aligned); every other block
/// of the device is a home block transactions may write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// (offset in bytes, blocks) of each area, one per core.
    pub areas: Vec<(u64, u64)>,
}

impl Layout {
    /// `count` areas of `blocks` blocks each, back to back from byte `offset`. An area whose
    /// offset does not fit 64 bits gets `u64::MAX`, which formatting or opening refuses as a
    /// [`JournalError::Layout`].
    pub fn per_core(offset: u64, blocks: u64, count: usize) -> Layout {
        let area_bytes = blocks.saturating_mul(BLOCK as u64);
        Layout {
            areas: (0..count as u64)
                .map(|i| (offset.saturating_add(i.saturating_mul(area_bytes)), blocks))
                .collect(),
        }
    }

    fn validate(&self, device_bytes: u64) -> Result<(), JournalError> {
        if self.areas.is_empty() {
            return Err(JournalError::Layout("no journal area".into()));
        }
        let min = 1 + format::tx_blocks(1, 0) + 1;
        // Each area's end first, in checked arithmetic: an area whose byte range does not fit
        // 64 bits lies past any device (the overlap test below compares ends).
        for (i, &(off, blocks)) in self.areas.iter().enumerate() {
            if Layout::end(off, blocks).is_none() {
                return Err(JournalError::Layout(format!(
                    "area {i} of {blocks} blocks from byte {off} ends past the device's \
                     {device_bytes} (past the largest byte offset)"
                )));
            }
        }
        for (i, &(off, blocks)) in self.areas.iter().enumerate() {
            if off % BLOCK as u64 != 0 {
                return Err(JournalError::Layout(format!(
                    "area {i} starts at byte {off}, not a multiple of {BLOCK}"
                )));
            }
            if blocks < min {
                return Err(JournalError::RegionTooSmall {
                    area: i,
                    blocks,
                    needed: min,
                });
            }
            if off + blocks * BLOCK as u64 > device_bytes {
                return Err(JournalError::Layout(format!(
                    "area {i} ends at byte {} past the device's {device_bytes}",
                    off + blocks * BLOCK as u64
                )));
            }
            for (j, &(o2, b2)) in self.areas.iter().enumerate().skip(i + 1) {
                if off < o2 + b2 * BLOCK as u64 && o2 < off + blocks * BLOCK as u64 {
                    return Err(JournalError::Layout(format!("areas {i} and {j} overlap")));
                }
            }
        }
        Ok(())
    }

    /// The byte just past an area, when it fits a `u64`.
    fn end(off: u64, blocks: u64) -> Option<u64> {
        blocks.checked_mul(BLOCK as u64)?.checked_add(off)
    }

    fn in_area(&self, block: u64) -> Option<usize> {
        // A block number too large to have a byte offset lies in no area (callers check it
        // against the device's end as well).
        let byte = block.checked_mul(BLOCK as u64)?;
        self.areas
            .iter()
            .position(|&(off, n)| byte >= off && byte < off + n * BLOCK as u64)
    }
}

/// How a commit is carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitMode {
    /// Data writes, wait; prepare and write the journal blocks, wait; FLUSH; prepare and write
    /// the commit block, wait. Preparation sits on the critical path.
    Vanilla,
    /// AIOS §3.3: prepare journal and commit blocks while the data writes are in flight, issue
    /// the journal writes without waiting for the data, wait for all, FLUSH, commit with FUA.
    Overlapped,
    /// One device round trip per commit: the data blocks are journaled too (as in a data-journaling
    /// file system), and the commit block goes out in the same write as the other log blocks,
    /// with the data also written in place alongside; then one wait (FUA writes, or a FLUSH
    /// after plain ones). Nothing orders the commit block after the rest, so recovery tells a
    /// whole transaction from a torn one by the commit block's chained checksum alone, which
    /// now covers the data too. The price: every data block is written twice (log and home),
    /// the log fills faster, and damage inside an area's last transaction reads as a torn tail
    /// (dropped) rather than as corruption, which the two-phase modes can tell apart. A
    /// transaction whose log blocks, data included, would take more than half the area's log
    /// commits overlapped instead.
    OneWrite,
}

impl CommitMode {
    pub fn name(self) -> &'static str {
        match self {
            CommitMode::Vanilla => "vanilla",
            CommitMode::Overlapped => "overlapped",
            CommitMode::OneWrite => "one-write",
        }
    }
}

/// How a commit makes its data and journal blocks durable before writing the commit block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Plain writes, then one FLUSH (skipped on a device with power-loss protection).
    Flush,
    /// Every data and journal block written with FUA (`RWF_DSYNC` on files and block devices,
    /// the FUA bit on NVMe), durable at its completion; no FLUSH.
    FuaWrites,
}

impl Durability {
    pub fn name(self) -> &'static str {
        match self {
            Durability::Flush => "flush",
            Durability::FuaWrites => "fua",
        }
    }
}

/// What [`JournalSet::format`] / [`JournalSet::open`] measured to choose the [`Durability`]:
/// medians of single 4 KiB requests on the journal's device, in µs.
#[derive(Clone, Debug, PartialEq)]
pub struct DurabilityProbe {
    pub write_us: f64,
    pub fua_write_us: f64,
    pub flush_us: f64,
    pub chosen: Durability,
    pub why: String,
}

/// Time plain writes, FUA writes and FLUSHes at byte `at` (a free log block, written with
/// zeros) and choose: FUA writes when one costs less than a write and a FLUSH after it.
fn probe_durability(dev: &Device, at: u64) -> Result<DurabilityProbe, JournalError> {
    let caps = dev.critical_route().0;
    let untimed = |chosen, why: &str| DurabilityProbe {
        write_us: 0.0,
        fua_write_us: 0.0,
        flush_us: 0.0,
        chosen,
        why: why.to_string(),
    };
    if caps.power_loss_protected {
        return Ok(untimed(
            Durability::Flush,
            "the device has no volatile write cache: no FLUSH, plain writes",
        ));
    }
    if !caps.fua {
        return Ok(untimed(Durability::Flush, "the device has no FUA writes"));
    }
    let engine = dev.lbio().engine();
    let mut w = Vec::new();
    let mut f = Vec::new();
    let mut fw = Vec::new();
    let time = |out: &mut Vec<f64>, fut: lbio::IoFuture<'_>| -> Result<(), JournalError> {
        let t = Instant::now();
        engine.block_on(fut)??;
        out.push(t.elapsed().as_secs_f64() * 1e6);
        Ok(())
    };
    // Rounds of (write, FLUSH, FUA write), each judged on its own: on a noisy machine a burst of
    // interference lands on all three of a round, where comparing separate medians (12 rounds)
    // let it tip the choice: in one `aios bench fsync --rounds 5` run, one of the ten formats
    // chose FLUSH on the loop device, where a FUA write costs about half a write and a FLUSH.
    // The block written is zeros: the arena hands buffers out as their last user left them, and
    // a stale copy of a sealed log block left at the log's next position would be read back by
    // recovery's scan for later commits.
    for _ in 0..PROBE_ROUNDS {
        let mut b = alloc(engine)?;
        b.fill(0);
        time(&mut w, dev.write_at(at, b, false))?;
        time(&mut f, dev.flush())?;
        let mut b = alloc(engine)?;
        b.fill(0);
        time(&mut fw, dev.write_at(at, b, true))?;
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    // Per round: what a FUA write saves over a write and a FLUSH (negative: it costs more).
    let saved: Vec<f64> = (0..w.len()).map(|i| w[i] + f[i] - fw[i]).collect();
    let (write_us, flush_us, fua_write_us, saved_us) = (med(w), med(f), med(fw), med(saved));
    let chosen = if saved_us > 0.0 {
        Durability::FuaWrites
    } else {
        Durability::Flush
    };
    Ok(DurabilityProbe {
        write_us,
        fua_write_us,
        flush_us,
        chosen,
        why: format!(
            "FUA write {fua_write_us:.1} us vs write {write_us:.1} us + FLUSH {flush_us:.1} us \
             (medians of {PROBE_ROUNDS} rounds; per round a FUA write saved {saved_us:.1} us, median)"
        ),
    })
}

/// Rounds of the durability probe (a round: a write, a FLUSH, a FUA write).
const PROBE_ROUNDS: usize = 24;

/// A transaction being built: ordered data (written in place before the commit), journaled
/// metadata, revokes.
///
/// A transaction holds a copy of each block. [`Tx::clear`] empties it for the next one and
/// keeps those copies' memory, so a thread that reuses one `Tx` commits without allocating
/// once it has built its largest transaction.
#[derive(Default)]
pub struct Tx {
    data: Vec<(u64, Vec<u8>)>,
    metas: Vec<(u64, Vec<u8>)>,
    revokes: Revokes,
    file: Option<u32>,
    /// Block copies of cleared writes, for the next ones.
    spare: Vec<Vec<u8>>,
    /// Where each block is in `data` and `metas` once a list is longer than [`LINEAR_FIND`]
    /// (built on the first lookup past that; kept with their memory across [`Tx::clear`]).
    data_index: HashMap<u64, usize>,
    meta_index: HashMap<u64, usize>,
}

/// Up to this many blocks in a list, a transaction finds a block by looking at each.
const LINEAR_FIND: usize = 32;

/// Where `block` is in `list`, by a scan while the list is short, else through `index`
/// (rebuilt when it does not cover the list: it is cleared whenever an entry is removed).
fn find_block(
    list: &[(u64, Vec<u8>)],
    index: &mut HashMap<u64, usize>,
    block: u64,
) -> Option<usize> {
    if list.len() <= LINEAR_FIND {
        return list.iter().position(|(b, _)| *b == block);
    }
    if index.len() != list.len() {
        index.clear();
        index.extend(list.iter().enumerate().map(|(i, (b, _))| (*b, i)));
    }
    index.get(&block).copied()
}

/// A transaction's revoked blocks in the order first revoked, each once. Past [`LINEAR_FIND`]
/// of them a set beside the list answers membership (deleting a large file revokes thousands
/// of blocks, and every revoke, and every block a group commit joins, asks).
#[derive(Clone, Default)]
struct Revokes {
    list: Vec<u64>,
    /// Empty while `list` is at most [`LINEAR_FIND`] long; else holds exactly its blocks.
    set: HashSet<u64>,
}

impl Revokes {
    fn contains(&self, block: u64) -> bool {
        if self.list.len() <= LINEAR_FIND {
            self.list.contains(&block)
        } else {
            self.set.contains(&block)
        }
    }

    /// Add `block` unless it is there already.
    fn insert(&mut self, block: u64) {
        if self.contains(block) {
            return;
        }
        self.list.push(block);
        if self.list.len() > LINEAR_FIND {
            if self.set.is_empty() {
                self.set.extend(self.list.iter().copied());
            } else {
                self.set.insert(block);
            }
        }
    }

    fn clear(&mut self) {
        self.list.clear();
        self.set.clear();
    }

    /// Keep only the blocks `keep` picks (in their order).
    fn retain(&mut self, mut keep: impl FnMut(u64) -> bool) {
        self.list.retain(|&b| keep(b));
        self.set.clear();
        if self.list.len() > LINEAR_FIND {
            self.set.extend(self.list.iter().copied());
        }
    }

    fn as_slice(&self) -> &[u64] {
        &self.list
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

impl std::fmt::Debug for Tx {
    /// The written blocks' numbers (not their bytes), revokes and kind.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let blocks = |v: &[(u64, Vec<u8>)]| v.iter().map(|(b, _)| *b).collect::<Vec<u64>>();
        f.debug_struct("Tx")
            .field("data", &blocks(&self.data))
            .field("metas", &blocks(&self.metas))
            .field("revokes", &self.revokes.as_slice())
            .field("file", &self.file)
            .finish()
    }
}

impl Clone for Tx {
    /// The writes, revokes and kind (not the spare memory).
    fn clone(&self) -> Tx {
        Tx {
            data: self.data.clone(),
            metas: self.metas.clone(),
            revokes: self.revokes.clone(),
            file: self.file,
            spare: Vec::new(),
            data_index: HashMap::new(),
            meta_index: HashMap::new(),
        }
    }
}

/// A transaction's two lists of block copies.
#[derive(Clone, Copy)]
enum Which {
    Data,
    Meta,
}

/// `bytes` in `reuse`'s memory when there is one.
fn copy_into(reuse: Option<Vec<u8>>, bytes: &[u8]) -> Vec<u8> {
    match reuse {
        Some(mut v) => {
            v.clear();
            v.extend_from_slice(bytes);
            v
        }
        None => bytes.to_vec(),
    }
}

fn check_len(block: u64, bytes: &[u8]) -> Result<(), JournalError> {
    if bytes.len() != BLOCK {
        return Err(JournalError::BlockLen {
            block,
            len: bytes.len(),
        });
    }
    Ok(())
}

impl Tx {
    pub fn new() -> Tx {
        Tx::default()
    }

    /// A file-level transaction (FastResponse §3.4): it carries only `file`'s own metadata and
    /// data, and is committed by the calling thread alone.
    pub fn for_file(file: u32) -> Tx {
        Tx {
            file: Some(file),
            ..Tx::default()
        }
    }

    /// The data blocks (home block, bytes), in the order they were first written.
    pub fn data_blocks(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        self.data.iter().map(|(b, d)| (*b, d.as_slice()))
    }

    /// The bytes this transaction journals for metadata block `block`, if it journals it.
    pub fn meta_block(&self, block: u64) -> Option<&[u8]> {
        self.metas
            .iter()
            .find(|(b, _)| *b == block)
            .map(|(_, d)| d.as_slice())
    }

    /// Write `bytes` (one block) in place at home block `block`; durable before the commit.
    pub fn write_data(&mut self, block: u64, bytes: &[u8]) -> Result<&mut Tx, JournalError> {
        check_len(block, bytes)?;
        self.put(Which::Data, block, bytes);
        Ok(self)
    }

    /// Journal `bytes` (one block) as the new content of metadata block `block`.
    pub fn write_meta(&mut self, block: u64, bytes: &[u8]) -> Result<&mut Tx, JournalError> {
        check_len(block, bytes)?;
        self.put(Which::Meta, block, bytes);
        Ok(self)
    }

    /// Empty the transaction for the next one, keeping its memory (and its kind: a file-level
    /// transaction stays one, for the same file).
    pub fn clear(&mut self) {
        let spare = &mut self.spare;
        spare.extend(
            self.data
                .drain(..)
                .chain(self.metas.drain(..))
                .map(|(_, d)| d),
        );
        self.revokes.clear();
        self.data_index.clear();
        self.meta_index.clear();
    }

    /// Revoke `block`: older journaled versions of it are never replayed (it is being freed or
    /// reused for data).
    pub fn revoke(&mut self, block: u64) -> &mut Tx {
        self.revokes.insert(block);
        self
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty() && self.metas.is_empty() && self.revokes.is_empty()
    }

    /// Join `later` onto this transaction (group commit): its writes come after ours, so a
    /// block both write ends as `later` has it and `later`'s revokes cancel our metadata for
    /// the block. Refused (false, `self` unchanged) when the union would not fit `log_len` log
    /// blocks or when `later` writes in place a block this one journals.
    fn absorb(&mut self, later: &Tx, log_len: u64, scratch: &mut Tx) -> bool {
        for (b, _) in &later.data {
            if !later.revokes.contains(*b)
                && find_block(&self.metas, &mut self.meta_index, *b).is_some()
            {
                return false;
            }
        }
        // The union is built in `scratch` (its memory reused), and taken only if it fits.
        let m = scratch;
        m.copy_from(self);
        for (b, d) in &later.data {
            m.put(Which::Data, *b, d);
        }
        if !later.revokes.is_empty() {
            // Blocks the later transaction frees: no earlier version of them is kept, data
            // included (a one-write commit would log that data under the revoke's own id, and
            // replay would put it into the freed block), except the data the later
            // transaction itself writes there. One pass over each list, not a search per
            // revoke: a group can join thousands of either.
            let rewritten: HashSet<u64> = later.data.iter().map(|(b, _)| *b).collect();
            m.remove_where(Which::Meta, |b| later.revokes.contains(b));
            m.remove_where(Which::Data, |b| {
                later.revokes.contains(b) && !rewritten.contains(&b)
            });
            for &b in later.revokes.as_slice() {
                m.revokes.insert(b);
            }
        }
        if !later.metas.is_empty() && !m.revokes.is_empty() {
            // Journaled again by the later transaction: no longer revoked.
            let journaled: HashSet<u64> = later.metas.iter().map(|(b, _)| *b).collect();
            m.revokes.retain(|b| !journaled.contains(&b));
        }
        for (b, d) in &later.metas {
            m.put(Which::Meta, *b, d);
        }
        if m.log_blocks() > log_len {
            return false;
        }
        std::mem::swap(self, m);
        true
    }

    /// Take every block `gone` picks out of the data or metadata list, in one pass (their
    /// copies kept as spare memory; the others keep their order).
    fn remove_where(&mut self, which: Which, mut gone: impl FnMut(u64) -> bool) {
        let (list, index) = match which {
            Which::Data => (&mut self.data, &mut self.data_index),
            Which::Meta => (&mut self.metas, &mut self.meta_index),
        };
        let spare = &mut self.spare;
        let before = list.len();
        list.retain_mut(|(b, d)| {
            if gone(*b) {
                spare.push(std::mem::take(d));
                false
            } else {
                true
            }
        });
        if list.len() != before {
            // Entries moved.
            index.clear();
        }
    }

    /// `bytes` as block `block`'s new content in the data or metadata list (a copy, in spare
    /// memory when there is some).
    fn put(&mut self, which: Which, block: u64, bytes: &[u8]) {
        let (list, index) = match which {
            Which::Data => (&mut self.data, &mut self.data_index),
            Which::Meta => (&mut self.metas, &mut self.meta_index),
        };
        match find_block(list, index, block) {
            Some(i) => {
                let d = &mut list[i].1;
                d.clear();
                d.extend_from_slice(bytes);
            }
            None => {
                list.push((block, copy_into(self.spare.pop(), bytes)));
                if !index.is_empty() {
                    index.insert(block, list.len() - 1);
                }
            }
        }
    }

    /// Make this transaction a copy of `other` (writes, revokes, kind), in its own memory.
    fn copy_from(&mut self, other: &Tx) {
        self.clear();
        for (b, d) in &other.data {
            let c = copy_into(self.spare.pop(), d);
            self.data.push((*b, c));
        }
        for (b, d) in &other.metas {
            let c = copy_into(self.spare.pop(), d);
            self.metas.push((*b, c));
        }
        self.revokes.clone_from(&other.revokes);
        self.file = other.file;
    }

    /// Log blocks the transaction takes in the two-phase modes (a [`CommitMode::OneWrite`]
    /// commit journals the data blocks too).
    pub fn log_blocks(&self) -> u64 {
        self.log_blocks_with(false)
    }

    fn log_blocks_with(&self, data_logged: bool) -> u64 {
        let logged = self.metas.len() + if data_logged { self.data.len() } else { 0 };
        format::tx_blocks(logged, self.revokes.len())
    }
}

/// A committed transaction. A commit that went out in a group (group commit) gets the group's:
/// every member has the same id, and `log_blocks` and `data_journaled` are the whole group's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommitInfo {
    pub tid: u64,
    pub area: usize,
    pub log_blocks: u64,
    /// The data blocks went through the log (a one-write commit): until a checkpoint, an
    /// in-place write of one of them that bypasses the journal would be undone by replay.
    pub data_journaled: bool,
}

/// What recovery found and did.
#[derive(Clone, Debug)]
pub struct RecoveryReport {
    /// Per area: committed transactions replayed, and how its log ended.
    pub areas: Vec<(usize, LogEnd)>,
    /// Ids of the transactions replayed, per area, in log order.
    pub replayed: Vec<Vec<u64>>,
    /// Home blocks written.
    pub blocks_written: usize,
    /// Areas whose log was damaged before its end.
    pub corrupt: Vec<usize>,
}

#[derive(Debug)]
struct AreaState {
    /// Blocks ever appended (monotonic); the log position is this modulo the log length.
    head: u64,
    tail: u64,
    generation: u64,
    /// A thread is committing into this area (the leader); others queue behind it.
    leader: bool,
    /// A handle commits into this area with Rio ordering (its stream is this area's).
    rio_owned: bool,
    /// The log holds Rio-ordered commits not yet checkpointed: recovery keeps them only as far
    /// as the Rio handle's attribute log shows them durable, so that log must outlive them.
    rio_unhomed: bool,
    /// Commits waiting for the leader, in arrival order.
    queue: std::collections::VecDeque<Arc<Waiter>>,
}

impl AreaState {
    fn new(head: u64, generation: u64) -> AreaState {
        AreaState {
            head,
            tail: head,
            generation,
            leader: false,
            rio_owned: false,
            rio_unhomed: false,
            queue: Default::default(),
        }
    }
}

/// A commit request waiting behind an area's leader.
///
/// Each handle has one, reused for every commit that waits (a handle's thread waits for one
/// commit at a time): the transaction is copied into memory the waiter keeps.
struct Waiter {
    req: Mutex<Request>,
    state: Mutex<WaitState>,
    cv: Condvar,
}

/// A waiting commit.
struct Request {
    tx: Tx,
    /// It may join another thread's group (not a file-level transaction, and the handle allows
    /// it).
    joinable: bool,
    /// Its handle's mode is one-write ([`Journal::one_write_mode`]): the leader judges the
    /// request by this mode as well as its own.
    one_write_mode: bool,
}

enum WaitState {
    Waiting,
    /// Committed in a group; the result is this request's.
    Done(Result<CommitInfo, JournalError>),
    /// The area is this request's to commit (the previous leader passed it on).
    Lead,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let req = self.req.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Waiter")
            .field("log_blocks", &req.tx.log_blocks())
            .field("joinable", &req.joinable)
            .field("one_write_mode", &req.one_write_mode)
            .finish()
    }
}

impl Waiter {
    fn new() -> Waiter {
        Waiter {
            req: Mutex::new(Request {
                tx: Tx::new(),
                joinable: false,
                one_write_mode: false,
            }),
            state: Mutex::new(WaitState::Waiting),
            cv: Condvar::new(),
        }
    }

    fn finish(&self, to: WaitState) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = to;
        self.cv.notify_one();
    }
}

/// Counters.
#[derive(Debug, Default)]
pub struct JournalStats {
    pub commits: AtomicU64,
    pub checkpoints: AtomicU64,
    pub log_blocks_written: AtomicU64,
    pub flushes_skipped: AtomicU64,
    /// Journal transactions that carried more than one commit (group commit) ...
    pub groups: AtomicU64,
    /// ... and the commits they carried.
    pub grouped_commits: AtomicU64,
    /// Where commit time goes, summed over commits (ns): preparing buffers (descriptor, tags,
    /// checksums, copies; overlapped with the device in overlapped mode) ...
    pub prepare_ns: AtomicU64,
    /// ... from the start of the commit until its data and journal blocks are written ...
    pub writes_ns: AtomicU64,
    /// ... the FLUSH before the commit block ...
    pub flush_ns: AtomicU64,
    /// ... and the commit block's durable write.
    pub commit_ns: AtomicU64,
}

impl JournalStats {
    /// Mean nanoseconds per commit of (prepare, writes, flush, commit block).
    pub fn mean_phases_ns(&self) -> Option<[f64; 4]> {
        let n = self.commits.load(Ordering::Relaxed);
        if n == 0 {
            return None;
        }
        let per = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / n as f64;
        Some([
            per(&self.prepare_ns),
            per(&self.writes_ns),
            per(&self.flush_ns),
            per(&self.commit_ns),
        ])
    }
}

/// Entries [`Versions`] has room for from the start (more grow it once).
const VERSIONS_PREALLOCATED: usize = 1 << 16;

/// Journaled metadata not yet checkpointed: block → (tid, bytes), newest only. No bytes: a
/// one-write commit's data block, written home already (a checkpoint only flushes it). A
/// commit records its versions when it takes its id, before its writes go out, under the lock
/// its checks against the versions hold: so the entries follow id order (as recovery replays
/// them), and a commit on another area sees one still in flight. The
/// block copies of entries dropped (revoked, replaced by home data, checkpointed) are kept for
/// later entries, so steady commits and checkpoints do not allocate.
struct Versions {
    map: HashMap<u64, (u64, Vec<u8>)>,
    spare: Vec<Vec<u8>>,
    /// Blocks revoked by a commit whose writes are still going out: block → that commit's id.
    /// Until the revoke is durable, the journaled copy it drops may still be replayed, so an
    /// in-place write to the block is refused as if the copy were still kept (unless it
    /// revokes the block itself).
    revoking: HashMap<u64, u64>,
    /// Blocks a commit is writing in place (its data) whose writes are still going out: block
    /// → that commit's id. Writes from different areas are not ordered by id, and recovery
    /// puts back a one-write commit's logged copy by id: a later commit to the block waits
    /// until the earlier one's write is done, so the block's home copy follows id order.
    homing: HashMap<u64, u64>,
}

impl Versions {
    fn with_capacity(n: usize) -> Versions {
        Versions {
            map: HashMap::with_capacity(n),
            spare: Vec::new(),
            revoking: HashMap::with_capacity(n.min(1 << 12)),
            homing: HashMap::with_capacity(n.min(1 << 12)),
        }
    }

    /// Commit `tid` revokes `block`: no version of it is kept, and until [`Self::revoked`]
    /// the revoke is in flight.
    fn revoke(&mut self, block: u64, tid: u64) {
        self.remove(block);
        self.revoking.insert(block, tid);
    }

    /// Commit `tid`'s revoke of `block` is durable (a later commit's in-flight revoke of the
    /// same block stays).
    fn revoked(&mut self, block: u64, tid: u64) {
        if self.revoking.get(&block) == Some(&tid) {
            self.revoking.remove(&block);
        }
    }

    /// Whether an in-place write to `block` could be overwritten by a replay: a journaled copy
    /// is kept, or a revoke of one is not durable yet.
    fn replayable(&self, block: &u64) -> bool {
        self.map.get(block).is_some_and(|(_, d)| !d.is_empty()) || self.revoking.contains_key(block)
    }

    fn get(&self, block: &u64) -> Option<&(u64, Vec<u8>)> {
        self.map.get(block)
    }

    /// Keep a dropped entry's copy (an entry for home data has none).
    fn keep(spare: &mut Vec<Vec<u8>>, mut copy: Vec<u8>) {
        if copy.capacity() > 0 {
            copy.clear();
            spare.push(copy);
        }
    }

    /// `block` is revoked: no version of it is kept.
    fn remove(&mut self, block: u64) {
        if let Some((_, d)) = self.map.remove(&block) {
            Versions::keep(&mut self.spare, d);
        }
    }

    /// `block`'s newest version is at home already (a one-write commit's data).
    fn record_home(&mut self, block: u64, tid: u64) {
        if let Some((_, d)) = self.map.insert(block, (tid, Vec::new())) {
            Versions::keep(&mut self.spare, d);
        }
    }

    /// `block`'s newest version is `bytes`, journaled by `tid`.
    fn record(&mut self, block: u64, tid: u64, bytes: &[u8]) {
        let spare = &mut self.spare;
        let (t, kept) = self
            .map
            .entry(block)
            .or_insert_with(|| (0, spare.pop().unwrap_or_default()));
        *t = tid;
        kept.clear();
        kept.extend_from_slice(bytes);
    }

    /// Everything is home: drop every entry, keeping the copies. (No commit is in flight, so
    /// no revoke is either.)
    fn clear(&mut self) {
        for (_, (_, d)) in self.map.drain() {
            Versions::keep(&mut self.spare, d);
        }
        self.revoking.clear();
    }
}

/// The journal areas of one device, shared by all cores: one [`Journal`] handle per thread.
pub struct JournalSet {
    layout: Layout,
    device_bytes: u64,
    areas: Vec<Mutex<AreaState>>,
    next_tid: AtomicU64,
    /// Commits hold it shared; a checkpoint holds it alone (no commit runs meanwhile).
    gate: RwLock<()>,
    /// Committed metadata not yet checkpointed (see [`Versions`]).
    versions: Mutex<Versions>,
    /// A commit or checkpoint failed part-way: the on-disk log may hold blocks this process no
    /// longer accounts for, so nothing more is written until the journal is reopened (recovery).
    aborted: std::sync::atomic::AtomicBool,
    /// Transactions below this id are home (the last checkpoint, or the recovery, that finished).
    home_below: AtomicU64,
    /// The id a checkpoint writing superblocks now will set as the areas' tail.
    checkpoint_target: AtomicU64,
    pub stats: JournalStats,
    /// 0: FLUSH, 1: FUA writes.
    durability: std::sync::atomic::AtomicU8,
    probe: DurabilityProbe,
}

impl std::fmt::Debug for JournalSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalSet")
            .field("layout", &self.layout)
            .field("next_tid", &self.next_tid)
            .finish()
    }
}

/// Requests waited for together: up to this many without a heap allocation.
const JOIN_INLINE: usize = 32;

/// Run `futs` to completion together on `engine`; the first error wins. A finished request's
/// buffer goes back to the arena at once.
fn join_all<'a>(
    engine: &Engine,
    futs: impl IntoIterator<Item = IoFuture<'a>>,
) -> Result<(), JournalError> {
    struct JoinAll<'a> {
        futs: SmallVec<[Option<IoFuture<'a>>; JOIN_INLINE]>,
        err: Option<LbioError>,
    }
    impl Future for JoinAll<'_> {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            let this = &mut *self;
            let mut pending = false;
            for slot in this.futs.iter_mut() {
                if let Some(f) = slot {
                    // `IoFuture` is `Unpin`: polled where it lies.
                    match Pin::new(f).poll(cx) {
                        Poll::Ready(r) => {
                            if let Err(e) = r {
                                this.err.get_or_insert(e);
                            }
                            *slot = None;
                        }
                        Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        }
    }
    let mut j = JoinAll {
        futs: futs.into_iter().map(Some).collect(),
        err: None,
    };
    engine.block_on(&mut j)?;
    match j.err {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Requests started now (polled once, so they reach the device), waited for later; and the
/// arena buffers for more of them ([`Inflight::buf`]).
struct Inflight<'a> {
    futs: SmallVec<[IoFuture<'a>; 4]>,
    /// The first failure among requests that finished before [`Inflight::wait`].
    failed: Option<LbioError>,
    /// A frame taken before the commit took its id ([`Journal::commit_led`]): used when the
    /// arena has none free and nothing of this commit's is in flight to give one back.
    spare: Option<FixedBuf>,
}

impl<'a> Inflight<'a> {
    fn new() -> Self {
        Inflight {
            futs: SmallVec::new(),
            failed: None,
            spare: None,
        }
    }

    /// With `spare` to fall back on ([`Inflight::spare`]).
    fn with_spare(spare: Option<FixedBuf>) -> Self {
        Inflight {
            spare,
            ..Inflight::new()
        }
    }

    /// A buffer for a run of up to `blocks` consecutive blocks, as [`alloc_run`] gives it when
    /// the arena has frames free (the usual case: nothing else happens). When it has none, the
    /// spare frame, else the buffers of these requests: wait until one of them has finished and
    /// take the finished ones back (lbio keeps a finished request's buffer until it is polled).
    /// Only with nothing of these in flight and no spare does it wait for the engine's other
    /// I/O, failing (`ArenaExhausted`) when there is none.
    fn buf(&mut self, engine: &Engine, blocks: usize) -> Result<FixedBuf, JournalError> {
        loop {
            if let Some(b) = try_run(engine, blocks) {
                return Ok(b);
            }
            if let Some(b) = self.spare.take() {
                return Ok(b);
            }
            if self.futs.is_empty() {
                return alloc(engine);
            }
            self.reclaim(engine)?;
        }
    }

    /// Wait until at least one request has finished, and drop the finished ones (their buffers
    /// go back to the arena). A failure is kept for [`Inflight::wait`].
    fn reclaim(&mut self, engine: &Engine) -> Result<(), JournalError> {
        let (futs, failed) = (&mut self.futs, &mut self.failed);
        engine.block_on(std::future::poll_fn(|cx| {
            let before = futs.len();
            futs.retain(|f| match Pin::new(f).poll(cx) {
                Poll::Ready(r) => {
                    if let Err(e) = r {
                        failed.get_or_insert(e);
                    }
                    false
                }
                Poll::Pending => true,
            });
            if futs.len() < before {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }))?;
        Ok(())
    }
    fn start(&mut self, mut f: IoFuture<'a>) {
        let mut cx = Context::from_waker(Waker::noop());
        // The first poll submits the request.
        match Pin::new(&mut f).poll(&mut cx) {
            Poll::Pending => self.futs.push(f),
            Poll::Ready(Ok(_)) => {}
            Poll::Ready(Err(e)) => {
                self.failed.get_or_insert(e);
            }
        }
    }
    fn wait(self, engine: &Engine) -> Result<(), JournalError> {
        let r = join_all(engine, self.futs);
        match self.failed {
            Some(e) => Err(e.into()),
            None => r,
        }
    }
}

/// Where a transaction's log blocks are built ([`Journal::build_journal`]).
trait LogSink {
    /// Log block `i` of the transaction, to be built; blocks are asked for in log order, each
    /// once.
    fn block(&mut self, i: usize) -> Result<&mut [u8], JournalError>;
}

/// Log blocks built straight into the buffers they are written from, one per run of
/// consecutive log positions from `head`, each run's write started as soon as the run is
/// built. The buffers come from [`Inflight::buf`]: a transaction's log needs no more free
/// frames than one block, and where the arena has them it is one write per run of
/// consecutive log positions ([`Journal::log_run`]).
struct LogWriter<'w, 'd> {
    j: &'d Journal,
    w: &'w mut Inflight<'d>,
    head: u64,
    /// Log blocks the writes carry (the one-write commit block included).
    total: usize,
    fua: bool,
    /// The run being built (device byte, buffer) and how many of its blocks are handed out.
    run: Option<(u64, FixedBuf)>,
    filled: usize,
}

impl<'w, 'd> LogWriter<'w, 'd> {
    fn new(j: &'d Journal, w: &'w mut Inflight<'d>, head: u64, total: usize, fua: bool) -> Self {
        LogWriter {
            j,
            w,
            head,
            total,
            fua,
            run: None,
            filled: 0,
        }
    }

    fn send_run(&mut self) {
        if let Some((at, buf)) = self.run.take() {
            self.w.start(self.j.dev.write_at(at, buf, self.fua));
        }
    }

    /// Start the last run's write: every block is built.
    fn finish(mut self) {
        self.send_run();
    }
}

impl LogSink for LogWriter<'_, '_> {
    fn block(&mut self, i: usize) -> Result<&mut [u8], JournalError> {
        if let Some((_, buf)) = &self.run {
            if self.filled == buf.len() / BLOCK {
                self.send_run();
            }
        }
        let buf = match &mut self.run {
            Some((_, buf)) => buf,
            run => {
                let (start, len) = self.j.log_run(self.head, i, self.total, usize::MAX);
                let buf = self.w.buf(&self.j.engine, len)?;
                self.filled = 0;
                &mut run.insert((start, buf)).1
            }
        };
        let k = self.filled;
        self.filled += 1;
        Ok(&mut buf[k * BLOCK..(k + 1) * BLOCK])
    }
}

/// A Rio-ordered commit's data and journal writes, each handed to the ordered device as soon
/// as it is built. A write closes its group when the next one would take the group past `cap`
/// attribute log entries, so each built write waits for the next before it is submitted: where
/// the arena has frames free, these are the groups, writes and buffers of a commit that built
/// them all first. The buffers come from the arena's free frames, else the spare frame taken
/// before the commit's id, else from this commit's own writes: the group being built is closed
/// at once (sent), and the ordered device hands finished writes back with their buffers. So a
/// Rio commit needs one free frame. Groups still go out in order, and the commit block's group
/// follows them all (it is taken after [`RioWriter::close`]).
///
/// The ordered device sends a group whose writes follow each other on the device, or such
/// whole groups queued together, as one command copied into a buffer of their total length
/// from the arena. Runs cut short by the arena would make such groups where the arena has no
/// room for the copy: once the arena runs short ([`RioWriter::short`]), a write that follows the
/// one before it on the device starts a group, and a closed group is sent before the next one
/// closes.
struct RioWriter<'a> {
    j: &'a Journal,
    dev: &'a mut OrderedDevice<Box<dyn Pmr>>,
    /// Finished writes taken back (kept empty between calls; the list is the handle's).
    done: &'a mut Vec<rio_ordering::Done>,
    stream: u16,
    /// A write's largest piece: it takes one attribute log entry per piece.
    max: usize,
    /// The most entries one group holds.
    cap: usize,
    /// A frame taken before the commit's id ([`Journal::commit_led`]).
    spare: Option<FixedBuf>,
    /// The last write built, not yet submitted, with its entries.
    pending: Option<(rio_ordering::Write, usize)>,
    /// Entries of the open group's writes submitted so far.
    in_group: usize,
    /// The arena could not give a buffer as long as a run: from then on no group is built that
    /// the ordered device would copy into one buffer.
    short: bool,
    /// The first of this commit's writes that came back failed.
    failed: Option<String>,
    /// Time spent submitting and waiting for writes (not preparation).
    io: Duration,
    /// The journal blocks: `total` of them from log position `head`; the run being built and
    /// how many of its blocks are handed out.
    head: u64,
    total: usize,
    run: Option<(u64, FixedBuf)>,
    filled: usize,
}

impl RioWriter<'_> {
    /// A built write (`ipu`: data in place): the one built before it is submitted now, closing
    /// its group when this one would take the group past its entries.
    fn put(&mut self, offset: u64, buf: FixedBuf, ipu: bool) -> Result<(), JournalError> {
        let entries = buf.len().div_ceil(self.max);
        if let Some((p, e)) = self.pending.take() {
            self.in_group += e;
            let follows = offset == p.offset + p.buf.len() as u64;
            let end = self.in_group + entries > self.cap || (self.short && follows);
            self.submit(p, end)?;
        }
        let w = rio_ordering::Write {
            target: 0,
            offset,
            buf,
            ipu,
        };
        self.pending = Some((w, entries));
        Ok(())
    }

    fn submit(&mut self, w: rio_ordering::Write, end: bool) -> Result<(), JournalError> {
        let t = Instant::now();
        let mut r = self.dev.submit(self.stream, w, end).map(|_| ());
        if end {
            self.in_group = 0;
            if self.short && r.is_ok() {
                // Not queued behind the next group (the device would merge them).
                r = self.dev.flush_queue(self.stream);
            }
        }
        self.io += t.elapsed();
        r?;
        Ok(())
    }

    /// Submit the write built last, closing its group (the open group, if any: a group is
    /// open only while a write is pending).
    fn close(&mut self) -> Result<(), JournalError> {
        if let Some((p, _)) = self.pending.take() {
            self.submit(p, true)?;
        }
        Ok(())
    }

    /// Hand the journal run being built to [`RioWriter::put`].
    fn send_run(&mut self) -> Result<(), JournalError> {
        match self.run.take() {
            Some((at, buf)) => self.put(at, buf, false),
            None => Ok(()),
        }
    }

    /// A buffer for a run of up to `blocks` blocks, as [`Inflight::buf`] takes one: the
    /// arena's free frames (the longest power-of-two run it has, the usual case), else the
    /// spare, else this commit's finished writes' buffers (its open group is closed to send
    /// them); only with none of its writes on the ordered device does it wait for the engine's
    /// other I/O, failing (`ArenaExhausted`) when there is none.
    fn buf(&mut self, blocks: usize) -> Result<FixedBuf, JournalError> {
        let engine = &self.j.engine;
        loop {
            if let Some(b) = try_run(engine, blocks) {
                self.short |= b.len() / BLOCK < blocks;
                return Ok(b);
            }
            self.short = true;
            if let Some(b) = self.spare.take() {
                return Ok(b);
            }
            self.close()?;
            let t = Instant::now();
            // Sends what the device queues, then takes what has finished; waits for a command
            // to finish when nothing had.
            self.dev.poll_into(self.done)?;
            if self.done.is_empty() {
                if self.dev.in_flight() == 0 {
                    self.io += t.elapsed();
                    return alloc(engine);
                }
                self.dev.wait_progress_into(self.done)?;
            }
            self.io += t.elapsed();
            // Their buffers go back to the arena; a failure is kept for the commit's answer.
            for d in self.done.drain(..) {
                if let Err(why) = d.result {
                    self.failed.get_or_insert_with(|| {
                        format!("write {} of group {} failed: {why}", d.id, d.seq)
                    });
                }
            }
        }
    }
}

impl LogSink for RioWriter<'_> {
    fn block(&mut self, i: usize) -> Result<&mut [u8], JournalError> {
        if let Some((_, buf)) = &self.run {
            if self.filled == buf.len() / BLOCK {
                self.send_run()?;
            }
        }
        let buf = match self.run {
            Some((_, ref mut buf)) => buf,
            None => {
                // A run is at most one write the ordered device takes: it refuses one that
                // splits into more than 255 device requests, and a write's entries must fit
                // one group.
                let most = (self.max / BLOCK).max(1);
                let (start, len) = self.j.log_run(self.head, i, self.total, most);
                let buf = self.buf(len)?;
                self.filled = 0;
                &mut self.run.insert((start, buf)).1
            }
        };
        let k = self.filled;
        self.filled += 1;
        Ok(&mut buf[k * BLOCK..(k + 1) * BLOCK])
    }
}

fn alloc(engine: &Engine) -> Result<FixedBuf, JournalError> {
    Ok(engine.alloc_blocking(BLOCK)?)
}

/// A buffer for a run of up to `blocks` consecutive blocks: all of them when the arena has
/// that many frames free in a row, else the longest power-of-two fraction it has (down to one
/// block, which waits for in-flight I/O to give a frame back if it must). The caller writes
/// the rest of the run from further buffers, so a fragmented arena costs more writes, never a
/// failed commit.
fn alloc_run(engine: &Engine, blocks: usize) -> Result<FixedBuf, JournalError> {
    match try_run(engine, blocks) {
        Some(b) => Ok(b),
        None => alloc(engine),
    }
}

/// The longest run of up to `blocks` blocks the arena has free now, halving from `blocks`
/// down to one; `None` when not even one frame is free (nothing waited for).
fn try_run(engine: &Engine, blocks: usize) -> Option<FixedBuf> {
    let mut len = blocks.max(1);
    loop {
        if let Some(b) = engine.try_alloc_run(len * BLOCK) {
            return Some(b);
        }
        if len == 1 {
            return None;
        }
        len /= 2;
    }
}

/// Writes gathered to be sent and waited for together ([`join_all`]).
type Batch<'a> = SmallVec<[IoFuture<'a>; JOIN_INLINE]>;

/// A one-block buffer for the next write of `batch`. A gathered write is not sent before the
/// batch is waited for, so its buffer does not come back meanwhile: when the arena has no
/// frame free, the batch goes out and is waited for first, and a batch never needs more
/// frames than the arena can give (down to one).
fn alloc_in_batch(engine: &Engine, batch: &mut Batch<'_>) -> Result<FixedBuf, JournalError> {
    if let Some(b) = engine.try_alloc_run(BLOCK) {
        return Ok(b);
    }
    join_all(engine, batch.drain(..))?;
    alloc(engine)
}

/// Wait until none of `dev`'s commands is on the device, handing finished writes (their
/// buffers) to `done`. Commands it cannot send (a failed attribute log holds them back) are
/// not on the device, and are left; so is everything when waiting itself fails.
fn drain_rio(dev: &mut OrderedDevice<Box<dyn Pmr>>, done: &mut Vec<rio_ordering::Done>) {
    loop {
        let before = dev.in_flight();
        if before == 0 {
            return;
        }
        // Waits for a command when one is on the device; sends held-back ones first.
        let _ = dev.wait_progress_into(done);
        if dev.in_flight() >= before {
            return;
        }
    }
}

/// Write `(home block, bytes)` pairs in place, at most 32 in flight (fewer when the arena has
/// fewer frames free), and wait for all.
fn write_home<'d>(
    dev: &Device,
    blocks: impl IntoIterator<Item = (u64, &'d [u8])>,
) -> Result<(), JournalError> {
    let engine = dev.lbio().engine();
    let mut futs: Batch<'_> = SmallVec::new();
    for (block, data) in blocks {
        let mut b = alloc_in_batch(engine, &mut futs)?;
        b.copy_from_slice(data);
        futs.push(dev.write_at(block * BLOCK as u64, b, false));
        if futs.len() >= JOIN_INLINE {
            join_all(engine, futs.drain(..))?;
        }
    }
    join_all(engine, futs)?;
    Ok(())
}

/// (home block, bytes) pairs recovery writes.
type HomeWrites<'a> = Vec<(u64, &'a [u8])>;

/// What recovery writes home after parsing every area's log, checked against the layout, and the
/// report of it.
fn plan_recovery<'a>(
    logs: &'a [AreaLog],
    layout: &Layout,
    device_bytes: u64,
) -> Result<(HomeWrites<'a>, RecoveryReport), JournalError> {
    let from = recovery::home_below(logs);
    let writes = recovery::merge(logs, from);
    for (block, _) in &writes {
        if *block >= device_bytes / BLOCK as u64 || layout.in_area(*block).is_some() {
            return Err(JournalError::NotHomeBlock {
                block: *block,
                why: "a replayed transaction names it".into(),
            });
        }
    }
    let report = RecoveryReport {
        areas: logs
            .iter()
            .enumerate()
            .map(|(i, l)| (i, l.end.clone()))
            .collect(),
        replayed: logs
            .iter()
            .map(|l| l.txs.iter().map(|t| t.tid).filter(|&t| t >= from).collect())
            .collect(),
        blocks_written: writes.len(),
        corrupt: logs
            .iter()
            .enumerate()
            .filter(|(_, l)| matches!(l.end, LogEnd::Corrupt { .. }))
            .map(|(i, _)| i)
            .collect(),
    };
    Ok((writes, report))
}

/// Parse area `index` of `layout` from its bytes, refusing a superblock written for a journal
/// of another number of areas: recovery with such a layout would leave the areas it lacks
/// unreplayed (their acknowledged commits dropped) and take their blocks for home blocks.
fn parse_area_of(
    area: &[u8],
    index: usize,
    layout: &Layout,
    prefix_end: Option<&[u64]>,
) -> Result<AreaLog, JournalError> {
    let log = recovery::parse_area_rio(area, index, prefix_end.map(|p| p[index]))?;
    let areas = layout.areas.len();
    if log.superblock.area_count as usize != areas {
        return Err(JournalError::BadSuperblock {
            area: index,
            why: format!(
                "it belongs to a journal of {} areas; the layout has {areas}",
                log.superblock.area_count
            ),
        });
    }
    Ok(log)
}

/// Blocks one read of [`read_range`] or one zeroing write of [`JournalSet::format`] covers
/// where the arena has that many frames free in a row (256 KiB).
const RANGE_RUN: usize = 64;

/// Read `len` bytes (whole blocks) from byte `offset`, in reads of up to [`RANGE_RUN`] blocks
/// through one buffer: as long a run as the arena has free, down to a single block.
fn read_range(dev: &Device, offset: u64, len: u64) -> Result<Vec<u8>, JournalError> {
    let engine = dev.lbio().engine();
    let mut out = Vec::with_capacity(len as usize);
    let blocks = len.div_ceil(BLOCK as u64).max(1) as usize;
    let mut buf = alloc_run(engine, blocks.min(RANGE_RUN))?;
    let chunk = buf.len() as u64;
    let mut at = 0;
    while at < len {
        let n = chunk.min(len - at);
        buf.set_len(n as usize)?;
        buf = dev.read_at_blocking(offset + at, buf)?;
        out.extend_from_slice(&buf[..n as usize]);
        at += n;
    }
    Ok(out)
}

impl JournalSet {
    fn new(
        layout: Layout,
        device_bytes: u64,
        states: Vec<AreaState>,
        next_tid: u64,
        probe: DurabilityProbe,
    ) -> Self {
        // One entry per logged block at most (a block logged twice keeps one): sized for the
        // logs, up to a bound, so commits do not grow it.
        let versions_capacity = layout
            .areas
            .iter()
            .map(|&(_, blocks)| blocks as usize)
            .sum::<usize>()
            .min(VERSIONS_PREALLOCATED);
        JournalSet {
            durability: std::sync::atomic::AtomicU8::new(
                (probe.chosen == Durability::FuaWrites) as u8,
            ),
            probe,
            layout,
            device_bytes,
            areas: states.into_iter().map(Mutex::new).collect(),
            next_tid: AtomicU64::new(next_tid),
            gate: RwLock::new(()),
            versions: Mutex::new(Versions::with_capacity(versions_capacity)),
            aborted: std::sync::atomic::AtomicBool::new(false),
            home_below: AtomicU64::new(next_tid),
            checkpoint_target: AtomicU64::new(next_tid),
            stats: JournalStats::default(),
        }
    }

    fn log_len(&self, area: usize) -> u64 {
        self.layout.areas[area].1 - 1
    }

    fn area_byte(&self, area: usize, block_in_area: u64) -> u64 {
        self.layout.areas[area].0 + block_in_area * BLOCK as u64
    }

    fn log_byte(&self, area: usize, seq: u64) -> u64 {
        self.area_byte(area, 1 + seq % self.log_len(area))
    }

    fn lock_area(&self, area: usize) -> std::sync::MutexGuard<'_, AreaState> {
        self.areas[area].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_versions(&self) -> std::sync::MutexGuard<'_, Versions> {
        self.versions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Zero every area's log on `dev`, write fresh superblocks (empty logs) and flush.
    ///
    /// The logs are zeroed because recovery reads a committed transaction beyond the log's end
    /// as damage: the log blocks of a journal formatted here before would otherwise make the
    /// fresh journal look damaged.
    pub fn format(
        dev: &Device,
        layout: Layout,
    ) -> Result<std::sync::Arc<JournalSet>, JournalError> {
        let bytes = dev.geometry().capacity_bytes;
        layout.validate(bytes)?;
        let engine = dev.lbio().engine();
        let n = layout.areas.len();
        // One buffer of zeros, as long a run as the arena has free (up to RANGE_RUN blocks).
        let longest = layout.areas.iter().map(|&(_, b)| b - 1).max().unwrap_or(1);
        let mut zeros = alloc_run(engine, (longest as usize).min(RANGE_RUN))?;
        let zero_run = (zeros.len() / BLOCK) as u64;
        zeros.fill(0);
        for &(off, blocks) in &layout.areas {
            let mut b = 1;
            while b < blocks {
                let run = zero_run.min(blocks - b);
                zeros.set_len(run as usize * BLOCK)?;
                zeros = dev.write_at_blocking(off + b * BLOCK as u64, zeros, false)?;
                b += run;
            }
        }
        drop(zeros);
        let mut futs: Batch<'_> = SmallVec::new();
        for (i, &(off, blocks)) in layout.areas.iter().enumerate() {
            let mut b = alloc_in_batch(engine, &mut futs)?;
            Superblock {
                area_blocks: blocks,
                area_index: i as u32,
                area_count: n as u32,
                tail_pos: 0,
                tail_tid: 1,
                generation: 1,
            }
            .encode(&mut b);
            futs.push(dev.write_at(off, b, false));
        }
        join_all(engine, futs)?;
        engine.block_on(dev.flush())??;
        // The first log block of area 0 is free: time the durability primitives there.
        let probe = probe_durability(dev, layout.areas[0].0 + BLOCK as u64)?;
        let states = (0..n).map(|_| AreaState::new(0, 1)).collect();
        Ok(std::sync::Arc::new(JournalSet::new(
            layout, bytes, states, 1, probe,
        )))
    }

    /// Recover the journal on `dev`: parse every area, replay the committed transactions (merged
    /// by id, newest version of a block wins, revokes respected), make the result durable, and
    /// start each area's log afresh.
    ///
    /// A journal holding Rio-ordered commits ([`Journal::with_rio`]) is refused
    /// ([`JournalError::RioLogsNeeded`]): open it with [`JournalSet::open_rio`].
    pub fn open(
        dev: &Device,
        layout: Layout,
    ) -> Result<(std::sync::Arc<JournalSet>, RecoveryReport), JournalError> {
        Self::open_with(dev, layout, None)
    }

    /// [`JournalSet::open`] for a journal whose commits may be Rio-ordered: `prefix_end[area]`
    /// is where the area's stream's durable prefix ends, from the areas' attribute logs
    /// ([`rio_prefix`]). A Rio-ordered commit at or past it is dropped as the torn tail (its
    /// fsync was never acknowledged). Format fresh attribute logs afterwards.
    pub fn open_rio(
        dev: &Device,
        layout: Layout,
        prefix_end: &[u64],
    ) -> Result<(std::sync::Arc<JournalSet>, RecoveryReport), JournalError> {
        Self::open_with(dev, layout, Some(prefix_end))
    }

    fn open_with(
        dev: &Device,
        layout: Layout,
        prefix_end: Option<&[u64]>,
    ) -> Result<(std::sync::Arc<JournalSet>, RecoveryReport), JournalError> {
        let bytes = dev.geometry().capacity_bytes;
        layout.validate(bytes)?;
        let mut logs: Vec<AreaLog> = Vec::new();
        recovery::check_rio_prefix(layout.areas.len(), prefix_end)?;
        for (i, &(off, blocks)) in layout.areas.iter().enumerate() {
            let img = read_range(dev, off, blocks * BLOCK as u64)?;
            logs.push(parse_area_of(&img, i, &layout, prefix_end)?);
        }
        recovery::apply_rio_prefix(&mut logs, prefix_end)?;
        let engine = dev.lbio().engine();
        let (writes, report) = plan_recovery(&logs, &layout, bytes)?;
        write_home(dev, writes)?;
        engine.block_on(dev.flush())??;
        let next_tid = logs.iter().map(|l| l.max_tid_seen).max().unwrap_or(0) + 1;
        let mut futs: Batch<'_> = SmallVec::new();
        let mut states = Vec::new();
        for (i, l) in logs.iter().enumerate() {
            let mut b = alloc_in_batch(engine, &mut futs)?;
            let sb = Superblock {
                tail_pos: l.end_pos,
                tail_tid: next_tid,
                generation: l.superblock.generation + 1,
                ..l.superblock
            };
            sb.encode(&mut b);
            futs.push(dev.write_at(layout.areas[i].0, b, true));
            states.push(AreaState::new(l.end_pos, sb.generation));
        }
        join_all(engine, futs)?;
        // Area 0's next log block is free (its log restarts there): time the primitives there.
        let (off0, blocks0) = layout.areas[0];
        let free = off0 + (1 + logs[0].end_pos % (blocks0 - 1)) * BLOCK as u64;
        let probe = probe_durability(dev, free)?;
        Ok((
            std::sync::Arc::new(JournalSet::new(layout, bytes, states, next_tid, probe)),
            report,
        ))
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// How commits make data and journal blocks durable (chosen by measurement at open).
    pub fn durability(&self) -> Durability {
        if self.durability.load(Ordering::Relaxed) == 1 {
            Durability::FuaWrites
        } else {
            Durability::Flush
        }
    }

    /// Override the measured choice.
    pub fn set_durability(&self, d: Durability) {
        self.durability
            .store((d == Durability::FuaWrites) as u8, Ordering::Relaxed);
    }

    /// Whether area `area` has a Rio-ordered handle now ([`Journal::with_rio`]; at most one).
    pub fn rio_owned(&self, area: usize) -> bool {
        area < self.areas.len() && self.lock_area(area).rio_owned
    }

    /// What was measured at open, and why the durability was chosen.
    pub fn durability_probe(&self) -> &DurabilityProbe {
        &self.probe
    }

    /// Transaction id the next commit gets.
    pub fn next_tid(&self) -> u64 {
        self.next_tid.load(Ordering::Relaxed)
    }

    /// The newest journaled copy of metadata block `block` while a checkpoint has not yet
    /// written it home (until then the home block holds an older version); `None` when the
    /// home block is current. A commit's copies are recorded as its writes go out, so a commit
    /// still in flight is seen too (if it fails, the set is aborted).
    pub fn unhomed_copy(&self, block: u64) -> Option<Vec<u8>> {
        let versions = self.lock_versions();
        match versions.get(&block) {
            Some((_, d)) if !d.is_empty() => Some(d.clone()),
            _ => None,
        }
    }

    /// Transactions with smaller ids are all home (checkpointed, or replayed at open).
    pub fn home_below(&self) -> u64 {
        self.home_below.load(Ordering::SeqCst)
    }

    /// The tail id the latest checkpoint to start writes into the superblocks (equal to
    /// [`JournalSet::home_below`] unless one is in progress or was cut short).
    pub fn checkpoint_target(&self) -> u64 {
        self.checkpoint_target.load(Ordering::SeqCst)
    }

    /// Free log blocks in `area` now.
    pub fn free_log_blocks(&self, area: usize) -> u64 {
        let s = self.lock_area(area);
        self.log_len(area) - (s.head - s.tail)
    }

    /// Commits waiting now for `area`'s leader (to join its group, or to lead the next one).
    pub fn waiting_commits(&self, area: usize) -> usize {
        self.lock_area(area).queue.len()
    }
}

/// One thread's handle on a [`JournalSet`]: its area, and the device as opened on its engine.
pub struct Journal {
    set: std::sync::Arc<JournalSet>,
    area: usize,
    dev: Device,
    engine: Rc<Engine>,
    mode: CommitMode,
    /// Skip FLUSH: the device declares power-loss protection.
    plp: bool,
    /// Let this handle's commits join (and take in) other threads' commits to the same area.
    group_commit: bool,
    /// Rio ordering in place of the FLUSH between journal and commit ([`Journal::with_rio`]).
    rio: Option<RioStream>,
    /// This handle's place in its area's queue when a commit has to wait (reused).
    waiter: Arc<Waiter>,
    /// A group's transaction, and the scratch it is built in (memory kept between groups).
    merged: std::cell::RefCell<Tx>,
    scratch: std::cell::RefCell<Tx>,
}

/// A handle's Rio stream: the ordered device (its own lbio array over the journal's device)
/// and the stream, which is the area's index.
/// Finished writes a Rio commit takes back at once without growing its list: the data runs,
/// the log runs and the commit block of a transaction (a larger one grows it once).
const RIO_DONE_CAPACITY: usize = 64;

struct RioStream {
    dev: std::cell::RefCell<OrderedDevice<Box<dyn Pmr>>>,
    stream: u16,
    /// Finished writes handed back by the ordered device (kept for its allocation).
    done: std::cell::RefCell<Vec<rio_ordering::Done>>,
}

impl Drop for Journal {
    fn drop(&mut self) {
        if self.rio.is_some() {
            // This handle's attribute log is what vouches for the area's Rio-ordered commits,
            // and the next Rio handle on the area starts a fresh one: put them home first. A
            // failed checkpoint aborts the set (reopening it recovers with this log), and
            // `with_rio` refuses the area while they are not home.
            if self.set.lock_area(self.area).rio_unhomed {
                let _ = self.checkpoint();
            }
            self.set.lock_area(self.area).rio_owned = false;
        }
    }
}

impl Journal {
    /// A handle committing into `area`, through `dev` (the journal's device opened on this
    /// thread's lbio array).
    pub fn new(
        set: &std::sync::Arc<JournalSet>,
        area: usize,
        dev: Device,
        mode: CommitMode,
    ) -> Result<Journal, JournalError> {
        if area >= set.layout.areas.len() {
            return Err(JournalError::Layout(format!(
                "area {area}: the layout has {}",
                set.layout.areas.len()
            )));
        }
        if dev.geometry().capacity_bytes != set.device_bytes {
            return Err(JournalError::Layout(format!(
                "device of {} bytes; the journal set was opened on one of {}",
                dev.geometry().capacity_bytes,
                set.device_bytes
            )));
        }
        let plp = dev.critical_route().0.power_loss_protected;
        Ok(Journal {
            set: std::sync::Arc::clone(set),
            area,
            engine: Rc::clone(dev.lbio().engine()),
            dev,
            mode,
            plp,
            group_commit: true,
            rio: None,
            waiter: Arc::new(Waiter::new()),
            merged: Default::default(),
            scratch: Default::default(),
        })
    }

    /// A handle whose commits are **Rio-ordered** (Rio §4.7): a commit's data, journal blocks and
    /// commit block go to the device together as two ordered groups on the area's stream (data
    /// and journal blocks first, then the commit block), with no wait and no FLUSH between them;
    /// the commit ends with the stream's `wait`, which FLUSHes once (on a device without
    /// power-loss protection) and marks the groups durable in the attribute log. The commit
    /// block records its group, and recovery ([`JournalSet::open_rio`]) keeps the transaction
    /// only when the attribute log shows that group durable. Every commit still ends durable, so
    /// a block freed by one is reused only after a real FLUSH.
    ///
    /// `target` is the journal's device opened on an lbio array of its own (the ordered device
    /// takes that array); `log` is the memory of the handle's attribute log, which this call
    /// formats afresh with one stream per journal area, once the area is this handle's (the
    /// logs [`JournalSet::open_rio`] recovered from are spent).
    /// At most one Rio handle per area. Preparation is overlapped-style; group commit still lets
    /// other handles' commits join this one.
    ///
    /// Dropping the handle checkpoints the journal when its area's log holds Rio-ordered
    /// commits: recovery trusts those only as far as this handle's attribute log shows them
    /// durable, and the next Rio handle on the area starts a fresh log (a crash does not drop
    /// the handle, and leaves the log to recovery).
    ///
    /// This call refuses, leaving `log` untouched, an area that still has a Rio handle
    /// ([`JournalSet::rio_owned`]) or whose last handle's drop could not checkpoint: its log
    /// still vouches for commits not yet home, so a new log in its place must wait.
    pub fn with_rio(
        set: &std::sync::Arc<JournalSet>,
        area: usize,
        dev: Device,
        target: Device,
        log: Box<dyn Pmr>,
        cfg: OrderedConfig,
    ) -> Result<Journal, JournalError> {
        let mut j = Journal::new(set, area, dev, CommitMode::Overlapped)?;
        if Rc::ptr_eq(target.lbio(), j.dev.lbio()) {
            return Err(JournalError::Layout(
                "the Rio target must be opened on an lbio array of its own (the ordered device \
                 owns the array's completions)"
                    .into(),
            ));
        }
        if target.geometry().capacity_bytes != set.device_bytes {
            return Err(JournalError::Layout(format!(
                "Rio target of {} bytes; the journal's device has {}",
                target.geometry().capacity_bytes,
                set.device_bytes
            )));
        }
        let areas = set.layout.areas.len();
        let streams = u16::try_from(areas).map_err(|_| {
            JournalError::Layout(format!(
                "{areas} journal areas: an attribute log has at most {} streams",
                u16::MAX
            ))
        })?;
        // The area first, then the log: formatting `log` over a log that still vouches for
        // commits not yet home would lose them at the next crash.
        {
            let mut a = set.lock_area(area);
            if a.rio_owned {
                return Err(JournalError::Layout(format!(
                    "journal area {area} already has a Rio-ordered handle (one stream per area)"
                )));
            }
            if a.rio_unhomed {
                return Err(JournalError::Layout(format!(
                    "journal area {area} still holds Rio-ordered commits that only the previous \
                     handle's attribute log vouches for (its checkpoint failed): reopen the \
                     journal with JournalSet::open_rio and that log"
                )));
            }
            a.rio_owned = true;
        }
        let start: Vec<u64> = (0..areas).map(|a| (a == area) as u64).collect();
        let lbio = Rc::clone(target.lbio());
        let ordered = match AttrLog::format(log, streams)
            .and_then(|log| OrderedDevice::new(lbio, vec![target], log, &start, cfg))
        {
            Ok(o) => o,
            Err(e) => {
                set.lock_area(area).rio_owned = false;
                return Err(e.into());
            }
        };
        j.rio = Some(RioStream {
            dev: std::cell::RefCell::new(ordered),
            stream: area as u16,
            done: std::cell::RefCell::new(Vec::with_capacity(RIO_DONE_CAPACITY)),
        });
        Ok(j)
    }

    /// Whether commits go out Rio-ordered ([`Journal::with_rio`]).
    pub fn rio_ordered(&self) -> bool {
        self.rio.is_some()
    }

    /// The attribute slots of a Rio handle's log ([`Journal::with_rio`] formats it).
    pub fn rio_log_slots(&self) -> Option<u32> {
        self.rio.as_ref().map(|r| r.dev.borrow().log().slots())
    }

    /// The Rio ordered device's counters (commands, FLUSHes, log syncs), for a Rio handle.
    pub fn rio_stats(&self) -> Option<rio_ordering::OrderedStats> {
        self.rio.as_ref().map(|r| r.dev.borrow().stats())
    }

    pub fn set(&self) -> &std::sync::Arc<JournalSet> {
        &self.set
    }
    pub fn area(&self) -> usize {
        self.area
    }
    pub fn mode(&self) -> CommitMode {
        self.mode
    }
    pub fn set_mode(&mut self, mode: CommitMode) {
        self.mode = mode;
    }
    /// Turn group commit on (the default) or off for this handle's commits.
    pub fn set_group_commit(&mut self, on: bool) {
        self.group_commit = on;
    }
    pub fn device(&self) -> &Device {
        &self.dev
    }

    fn validate(&self, tx: &Tx) -> Result<(), JournalError> {
        if tx.is_empty() {
            return Err(JournalError::EmptyTx);
        }
        let log_len = self.set.log_len(self.area);
        let needed = self.log_blocks(tx);
        if needed > log_len {
            return Err(JournalError::TxTooLarge {
                needed,
                log_blocks: log_len,
            });
        }
        let blocks = self.set.device_bytes / BLOCK as u64;
        for &b in tx
            .data
            .iter()
            .map(|(b, _)| b)
            .chain(tx.metas.iter().map(|(b, _)| b))
            .chain(tx.revokes.as_slice())
        {
            if b >= blocks {
                return Err(JournalError::NotHomeBlock {
                    block: b,
                    why: format!("the device has {blocks} blocks"),
                });
            }
            if let Some(a) = self.set.layout.in_area(b) {
                return Err(JournalError::NotHomeBlock {
                    block: b,
                    why: format!("it lies in journal area {a}"),
                });
            }
        }
        Ok(())
    }

    /// Commit `tx`: on `Ok` it is durable (its data, metadata and revokes survive any crash).
    ///
    /// One thread at a time commits into an area. A commit that finds the area busy waits; with
    /// group commit on (the default) the next thread to commit takes every waiting transaction
    /// it can fit into one journal transaction, so concurrent commits share one set of journal
    /// writes, one FLUSH and one commit block. A file-level transaction ([`Tx::for_file`]) never
    /// joins a group: the calling thread commits it itself.
    pub fn commit(&self, tx: &Tx) -> Result<CommitInfo, JournalError> {
        self.validate(tx)?;
        let joinable = self.group_commit && tx.file.is_none();
        {
            let mut area = self.set.lock_area(self.area);
            if area.leader {
                // This handle's waiter: no leader holds it now (its last request was answered
                // before this thread could commit again).
                let me = &self.waiter;
                {
                    let mut req = me.req.lock().unwrap_or_else(|p| p.into_inner());
                    req.tx.copy_from(tx);
                    req.joinable = joinable;
                    req.one_write_mode = self.one_write_mode();
                }
                *me.state.lock().unwrap_or_else(|p| p.into_inner()) = WaitState::Waiting;
                area.queue.push_back(Arc::clone(me));
                drop(area);
                let mut st = me.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    match std::mem::replace(&mut *st, WaitState::Waiting) {
                        WaitState::Waiting => {
                            st = me.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                        }
                        WaitState::Done(r) => return r,
                        WaitState::Lead => break,
                    }
                }
            } else {
                area.leader = true;
            }
        }
        // This thread leads the area now: commit `tx` (with whatever joins it), then pass the
        // area on to the next waiter.
        let r = self.lead(tx, joinable);
        let mut area = self.set.lock_area(self.area);
        match area.queue.pop_front() {
            Some(next) => {
                drop(area);
                next.finish(WaitState::Lead);
            }
            None => area.leader = false,
        }
        r
    }

    /// Commit `own` as the area's leader, joined (when `join`) by waiting joinable commits.
    fn lead(&self, own: &Tx, join: bool) -> Result<CommitInfo, JournalError> {
        let log_len = self.set.log_len(self.area);
        let mut members: SmallVec<[Arc<Waiter>; 8]> = SmallVec::new();
        // The group's transaction, built in memory the handle keeps.
        let mut merged = self.merged.borrow_mut();
        let mut area = self.set.lock_area(self.area);
        // Nobody waiting (the usual case): commit `own` as it is, without copying it.
        if join && !area.queue.is_empty() {
            merged.copy_from(own);
            let mut scratch = self.scratch.borrow_mut();
            // A transaction that would be refused for writing in place over journaled blocks
            // commits by itself, so that its error stays its own. Whether it is refused depends
            // on the mode (a one-write commit journals its data, and such a write is no
            // conflict), and the group commits in this handle's mode: so a waiter joins only
            // when this mode and its own handle's both take it. One that either would refuse
            // stays in the queue and later commits by itself, in its own mode, with exactly the
            // outcome that mode gives (its own commit makes the check, under the versions lock,
            // as any commit does).
            //
            // Rather than taking only waiters of this handle's mode: handles of both kinds on
            // one area still share groups whenever nothing conflicts (nearly always), and the
            // second check is skipped for a waiter of this handle's kind, so same-mode groups
            // cost what they did. Rather than refusing a waiter from here with its error: the
            // refusal belongs to the commit's own check, made when its id is taken.
            let mine = self.one_write_mode();
            let refused = |t: &Tx, theirs: bool| {
                let versions = self.set.lock_versions();
                self.data_conflict_as(&versions, t, mine).is_some()
                    || (theirs != mine && self.data_conflict_as(&versions, t, theirs).is_some())
            };
            let own_ok = !refused(own, mine);
            // Those that join leave the queue; the others keep their order.
            area.queue.retain(|w| {
                let req = w.req.lock().unwrap_or_else(|p| p.into_inner());
                let joins = own_ok
                    && req.joinable
                    && !refused(&req.tx, req.one_write_mode)
                    && merged.absorb(&req.tx, log_len, &mut scratch);
                if joins {
                    members.push(Arc::clone(w));
                }
                !joins
            });
        }
        drop(area);
        let tx: &Tx = if members.is_empty() { own } else { &merged };
        let mut r = self.commit_led(tx, members.len() as u64 + 1);
        if !members.is_empty() && matches!(r, Err(JournalError::DataOverJournaledBlock { .. })) {
            // Another area journaled a block the group writes in place since the check: the
            // others go back to the front of the queue, untouched, and this one commits alone.
            let mut area = self.set.lock_area(self.area);
            for w in members.drain(..).rev() {
                area.queue.push_front(w);
            }
            drop(area);
            r = self.commit_led(own, 1);
        }
        let st = &self.set.stats;
        if !members.is_empty() {
            st.groups.fetch_add(1, Ordering::Relaxed);
            st.grouped_commits
                .fetch_add(members.len() as u64 + 1, Ordering::Relaxed);
        }
        // Whether the failure, if any, aborted the set (it may not have: a commit that cannot
        // get a frame fails before writing anything).
        let aborted = r.is_err() && self.set.aborted.load(Ordering::SeqCst);
        for w in members {
            // (A group refused for writing over journaled blocks was put back above: no
            // member is left to get that error.) The others get the leader's error: its text,
            // and whether the set is aborted by it.
            w.finish(WaitState::Done(match &r {
                Ok(info) => Ok(*info),
                Err(JournalError::Aborted) => Err(JournalError::Aborted),
                Err(e) => Err(JournalError::GroupFailed {
                    cause: e.to_string(),
                    aborted,
                }),
            }));
        }
        r
    }

    /// Write `tx` into the area (checkpointing first when the log lacks room) and make it
    /// durable; the caller leads the area. `members` commits are in it.
    fn commit_led(&self, tx: &Tx, members: u64) -> Result<CommitInfo, JournalError> {
        loop {
            // One frame of the arena, taken before anything else (and before any lock: taking
            // it may wait for this engine's other I/O): with it the commit can always go on,
            // taking back its own finished writes' buffers for more ([`Inflight::buf`]). Where
            // not even one can be had, the commit fails here, having written nothing, taken no
            // id and recorded nothing: the set goes on. (An aborted set says so first.)
            self.check_aborted()?;
            let spare = alloc(&self.engine)?;
            {
                let _shared = self.set.gate.read().unwrap_or_else(|p| p.into_inner());
                // The checks against other areas' commits, the id and the record of this
                // commit's versions happen under one hold of the versions lock: a commit on
                // another area that takes an id after this one sees this one's versions (even
                // while its writes are in flight), and versions are recorded in id order, the
                // order recovery replays them in.
                let mut versions = self.set.lock_versions();
                if tx.data.iter().any(|(b, _)| versions.homing.contains_key(b)) {
                    // Another area's in-place write of one of these blocks is in flight: this
                    // commit's write must come after it (a later id). Try again once it is done.
                    drop(versions);
                    drop(_shared);
                    drop(spare);
                    std::thread::yield_now();
                    continue;
                }
                let tx = &*self.with_implied_revokes(&versions, tx);
                let needed = self.log_blocks(tx);
                let head = {
                    let area = self.set.lock_area(self.area);
                    (self.set.log_len(self.area) - (area.head - area.tail) >= needed)
                        .then_some(area.head)
                };
                if let Some(head) = head {
                    // An aborted set takes nothing: say so before judging the transaction.
                    self.check_aborted()?;
                    if let Some(block) = self.data_conflict_in(&versions, tx) {
                        return Err(JournalError::DataOverJournaledBlock { block });
                    }
                    let tid = self.set.next_tid.fetch_add(1, Ordering::Relaxed);
                    for &b in tx.revokes.as_slice() {
                        versions.revoke(b, tid);
                    }
                    // One-write data goes home in the commit's own write: the checkpoint's FLUSH
                    // is all it needs, so only its id is kept (no bytes).
                    let home_done = self.one_write(tx);
                    for (b, _) in tx.data.iter().filter(|_| home_done) {
                        versions.record_home(*b, tid);
                    }
                    for (b, d) in &tx.metas {
                        versions.record(*b, tid, d);
                    }
                    for (b, _) in &tx.data {
                        versions.homing.insert(*b, tid);
                    }
                    drop(versions);
                    // A failed write aborts the set: no checkpoint writes the versions just
                    // recorded, and reopening it recovers from what the device holds.
                    if let Err(e) = self.write_tx(tx, tid, head, spare) {
                        self.set.aborted.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                    if !tx.revokes.as_slice().is_empty() || !tx.data.is_empty() {
                        let mut versions = self.set.lock_versions();
                        for &b in tx.revokes.as_slice() {
                            versions.revoked(b, tid);
                        }
                        for (b, _) in &tx.data {
                            versions.homing.remove(b);
                        }
                    }
                    // Durable: advance the head.
                    {
                        let mut area = self.set.lock_area(self.area);
                        area.head += needed;
                        if self.rio.is_some() {
                            area.rio_unhomed = true;
                        }
                    }
                    let st = &self.set.stats;
                    st.commits.fetch_add(members, Ordering::Relaxed);
                    st.log_blocks_written.fetch_add(needed, Ordering::Relaxed);
                    return Ok(CommitInfo {
                        tid,
                        area: self.area,
                        log_blocks: needed,
                        data_journaled: home_done,
                    });
                }
            }
            // The checkpoint may need every frame the arena has.
            drop(spare);
            self.checkpoint()?;
        }
    }

    /// Log blocks `tx` takes in this handle's mode.
    fn log_blocks(&self, tx: &Tx) -> u64 {
        tx.log_blocks_with(self.one_write(tx))
    }

    /// Whether `tx` commits in one write: a one-write handle (no Rio) and a transaction whose
    /// log blocks, its data included, fit half the area's log. A larger one commits overlapped
    /// (its data written once, in place, and not through the log), so a large fsync neither
    /// fails for want of log room nor empties the log for one transaction.
    fn one_write(&self, tx: &Tx) -> bool {
        self.one_write_as(self.one_write_mode(), tx)
    }

    /// Whether this handle's mode commits in one write (a one-write handle without Rio); which
    /// of its transactions do is [`Self::one_write`].
    fn one_write_mode(&self) -> bool {
        self.mode == CommitMode::OneWrite && self.rio.is_none()
    }

    /// [`Self::one_write`] for a handle on this area whose mode is one-write or not (another
    /// handle's, for a group's waiter).
    fn one_write_as(&self, one_write_mode: bool, tx: &Tx) -> bool {
        one_write_mode && tx.log_blocks_with(true) <= self.set.log_len(self.area) / 2
    }

    /// The blocks `tx` journals, in log order: in the one-write mode its data blocks, then its
    /// metadata (a block in both ends as the metadata has it, on replay as in the two-phase
    /// modes after a checkpoint).
    fn logged<'t>(&self, tx: &'t Tx) -> impl Iterator<Item = &'t (u64, Vec<u8>)> + Clone {
        let data: &[(u64, Vec<u8>)] = if self.one_write(tx) { &tx.data } else { &[] };
        data.iter().chain(&tx.metas)
    }

    /// A block `tx` writes in place that holds journaled metadata not yet checkpointed (and
    /// that `tx` does not revoke). None in the one-write mode: its data is journaled too, and
    /// replay (newest id last) and checkpoints write the newer version.
    ///
    /// A one-write commit's data block is no conflict either: [`Self::with_implied_revokes`]
    /// revokes its journaled copy (the in-place write is the newer version). The caller holds
    /// the versions lock.
    fn data_conflict_in(&self, versions: &Versions, tx: &Tx) -> Option<u64> {
        self.data_conflict_as(versions, tx, self.one_write_mode())
    }

    /// [`Self::data_conflict_in`] for a handle on this area whose mode is one-write or not.
    fn data_conflict_as(&self, versions: &Versions, tx: &Tx, one_write_mode: bool) -> Option<u64> {
        if self.one_write_as(one_write_mode, tx) {
            return None;
        }
        tx.data
            .iter()
            .find(|(b, _)| versions.replayable(b) && !tx.revokes.contains(*b))
            .map(|(b, _)| *b)
    }

    /// `tx`, revoking the blocks it writes in place whose newest journaled version is a
    /// one-write commit's data (home already): replay must not put that older copy back over
    /// this write. Unchanged (no copy) in the usual case.
    fn with_implied_revokes<'t>(
        &self,
        versions: &Versions,
        tx: &'t Tx,
    ) -> std::borrow::Cow<'t, Tx> {
        use std::borrow::Cow;
        if self.one_write(tx) || tx.data.is_empty() {
            return Cow::Borrowed(tx);
        }
        let implied: Vec<u64> = tx
            .data
            .iter()
            .map(|(b, _)| *b)
            .filter(|b| {
                versions.get(b).is_some_and(|(_, d)| d.is_empty()) && !tx.revokes.contains(*b)
            })
            .collect();
        if implied.is_empty() {
            return Cow::Borrowed(tx);
        }
        let mut t = tx.clone();
        for b in implied {
            t.revokes.insert(b);
        }
        Cow::Owned(t)
    }

    fn check_aborted(&self) -> Result<(), JournalError> {
        if self.set.aborted.load(Ordering::SeqCst) {
            return Err(JournalError::Aborted);
        }
        Ok(())
    }

    /// The transaction's log blocks but its commit block.
    fn journal_blocks(&self, tx: &Tx) -> usize {
        self.log_blocks(tx) as usize - 1
    }

    /// Build the transaction's journal blocks (all its log blocks but the commit block) into
    /// `bufs`, in log order. Returns their number and chained checksum.
    fn build_journal(
        &self,
        tx: &Tx,
        tid: u64,
        bufs: &mut impl LogSink,
    ) -> Result<(usize, u32), JournalError> {
        let (flags, file) = match tx.file {
            Some(f) => (FLAG_FILE_TX, f),
            None => (0, 0),
        };
        let mut rest = self.logged(tx);
        let mut left = rest.clone().count();
        let n = self.journal_blocks(tx);
        let mut chain = 0u32;
        let mut at = 0;
        // Each logged block's crc32c, taken for its tag and chained from it (no second pass
        // over a block logged as it is).
        let mut crcs = [0u32; TAGS_PER_DESC];
        // A descriptor per TAGS_PER_DESC logged blocks, and one when none is logged.
        loop {
            let count = left.min(TAGS_PER_DESC);
            {
                let d = bufs.block(at)?;
                Header {
                    kind: Kind::Descriptor,
                    tid,
                    area: self.area as u32,
                    count: count as u32,
                    flags,
                    file,
                }
                .write(d);
                for (i, (home, data)) in rest.clone().take(count).enumerate() {
                    crcs[i] = format::crc(data);
                    format::put_tag(d, i, *home, crcs[i]);
                    if format::needs_escape(data) {
                        format::put_tag_flags(d, i, format::TAG_ESCAPED);
                    }
                }
                format::seal(d);
                chain = format::chain_block(chain, format::sealed_crc(d));
            }
            at += 1;
            for (i, (_, data)) in rest.by_ref().take(count).enumerate() {
                let m = bufs.block(at)?;
                m.copy_from_slice(data);
                if format::needs_escape(data) {
                    // The log never holds a journaled block that reads as a log block.
                    format::escape(m);
                    chain = format::crc_chain(chain, m);
                } else {
                    chain = format::chain_block(chain, crcs[i]);
                }
                at += 1;
            }
            left -= count;
            if left == 0 {
                break;
            }
        }
        for group in tx.revokes.as_slice().chunks(REVOKES_PER_BLOCK) {
            let r = bufs.block(at)?;
            Header {
                kind: Kind::Revoke,
                tid,
                area: self.area as u32,
                count: group.len() as u32,
                flags,
                file,
            }
            .write(r);
            for (i, b) in group.iter().enumerate() {
                format::put_u64(r, format::HEADER + 8 * i, *b);
            }
            format::seal(r);
            chain = format::chain_block(chain, format::sealed_crc(r));
            at += 1;
        }
        debug_assert_eq!(at, n, "journal blocks counted and built");
        Ok((n, chain))
    }

    /// The run of consecutive log positions that starts at the transaction's log block `i` of
    /// `total` (from log position `head`): its device byte and length in blocks, at most
    /// `most` (a run ends where the log wraps).
    fn log_run(&self, head: u64, i: usize, total: usize, most: usize) -> (u64, usize) {
        let at = |k: usize| self.set.log_byte(self.area, head + k as u64);
        let start = at(i);
        let mut len = 1;
        while i + len < total && len < most && at(i + len) == start + (len * BLOCK) as u64 {
            len += 1;
        }
        (start, len)
    }

    fn prepare_commit(
        &self,
        tx: &Tx,
        tid: u64,
        blocks: usize,
        chain: u32,
        rio_group: Option<u64>,
    ) -> Result<FixedBuf, JournalError> {
        let mut c = alloc(&self.engine)?;
        self.fill_commit(&mut c, tx, tid, blocks, chain, rio_group);
        Ok(c)
    }

    /// Write the commit block of `tx` (id `tid`, `blocks` journal blocks before it with the
    /// chained checksum `chain`) into `c`.
    fn fill_commit(
        &self,
        c: &mut [u8],
        tx: &Tx,
        tid: u64,
        blocks: usize,
        chain: u32,
        rio_group: Option<u64>,
    ) {
        let (mut flags, file) = match tx.file {
            Some(f) => (FLAG_FILE_TX, f),
            None => (0, 0),
        };
        if rio_group.is_some() {
            flags |= FLAG_RIO;
        } else if self.one_write(tx) {
            flags |= FLAG_ONE_WRITE;
        }
        Header {
            kind: Kind::Commit,
            tid,
            area: self.area as u32,
            count: 0,
            flags,
            file,
        }
        .write(c);
        format::put_u32(c, format::HEADER, blocks as u32);
        format::put_u32(c, format::HEADER + 4, chain);
        if let Some(g) = rio_group {
            format::put_u64(c, format::HEADER + 8, g);
        }
        format::seal(c);
    }

    /// The longest write a commit sends: the device's largest transfer, 4 KiB to 1 MiB.
    fn max_write(&self) -> usize {
        (self.dev.geometry().max_transfer_bytes as usize).clamp(BLOCK, 1 << 20)
    }

    /// Send the transaction's data in place as [`Self::for_data_runs`] cuts it, each write
    /// started as soon as its buffer is filled, from buffers [`Inflight::buf`] gives: the data needs
    /// no more free frames than one block.
    fn send_data<'d>(
        &'d self,
        tx: &Tx,
        w: &mut Inflight<'d>,
        fua: bool,
    ) -> Result<(), JournalError> {
        self.for_data_runs(
            tx,
            w,
            |w, len| w.buf(&self.engine, len),
            |w, at, buf| {
                w.start(self.dev.write_at(at, buf, fua));
                Ok(())
            },
        )
    }

    /// Cut the transaction's data into as few writes as possible, in block order: blocks that
    /// follow each other go out as one write of at most [`Self::max_write`] bytes (shorter
    /// where the arena has no free frames in a row that long). A buffer for each from `take`
    /// (given the run's length in blocks; a shorter buffer shortens the run), filled, then
    /// handed to `put` with its device byte.
    fn for_data_runs<S>(
        &self,
        tx: &Tx,
        state: &mut S,
        mut take: impl FnMut(&mut S, usize) -> Result<FixedBuf, JournalError>,
        mut put: impl FnMut(&mut S, u64, FixedBuf) -> Result<(), JournalError>,
    ) -> Result<(), JournalError> {
        let max = self.max_write();
        let mut order: SmallVec<[&(u64, Vec<u8>); 8]> = tx.data.iter().collect();
        order.sort_unstable_by_key(|(b, _)| *b);
        let per = (max / BLOCK).max(1);
        let mut k = 0;
        while k < order.len() {
            let start = order[k].0;
            let mut len = 1;
            while k + len < order.len() && order[k + len].0 == start + len as u64 && len < per {
                len += 1;
            }
            let mut buf = take(state, len)?;
            len = buf.len() / BLOCK;
            for (i, (_, d)) in order[k..k + len].iter().enumerate() {
                buf[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(d);
            }
            put(state, start * BLOCK as u64, buf)?;
            k += len;
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), JournalError> {
        if self.plp {
            self.set
                .stats
                .flushes_skipped
                .fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.engine.block_on(self.dev.flush())??;
        Ok(())
    }

    /// Build the transaction's journal blocks (all its log blocks but the commit block) into
    /// the buffers they are written from and start each run's write as it is built
    /// ([`LogWriter`]). Returns their number and chained checksum.
    fn send_journal<'d>(
        &'d self,
        tx: &Tx,
        tid: u64,
        head: u64,
        w: &mut Inflight<'d>,
        fua: bool,
    ) -> Result<(usize, u32), JournalError> {
        let mut out = LogWriter::new(self, w, head, self.journal_blocks(tx), fua);
        let built = self.build_journal(tx, tid, &mut out)?;
        out.finish();
        Ok(built)
    }

    /// Write `tx` as transaction `tid` at log position `head` and make it durable. `spare` is
    /// a frame of the handle's arena, taken before the id: a buffer to fall back on.
    fn write_tx(&self, tx: &Tx, tid: u64, head: u64, spare: FixedBuf) -> Result<(), JournalError> {
        if let Some(rio) = &self.rio {
            return self.write_tx_rio(rio, tx, tid, head, spare);
        }
        let dev = &self.dev;
        // FUA on every data and journal block makes the FLUSH before the commit unneeded, on a
        // device whose writes honour it (the set's choice may have been measured on another).
        let fua = !self.plp
            && self.set.durability() == Durability::FuaWrites
            && dev.critical_route().0.fua;
        let log = |i: usize| self.set.log_byte(self.area, head + i as u64);
        let commit_fua = dev.critical_route().0.fua;
        let st = &self.set.stats;
        let add = |a: &AtomicU64, from: Instant| {
            a.fetch_add(from.elapsed().as_nanos() as u64, Ordering::Relaxed);
        };
        let start = Instant::now();
        let mut prep = Duration::ZERO;
        // Buffer preparation, timed into `prep` wherever it happens.
        fn timed<R>(prep: &mut Duration, f: impl FnOnce() -> R) -> R {
            let t = Instant::now();
            let r = f();
            *prep += t.elapsed();
            r
        }
        // Wait for a commit's data and journal writes, then FLUSH unless they were FUA writes.
        let settle = |w: Inflight<'_>, durable: bool| -> Result<(), JournalError> {
            w.wait(&self.engine)?;
            add(&st.writes_ns, start);
            let t = Instant::now();
            if !durable {
                self.flush()?;
            }
            add(&st.flush_ns, t);
            Ok(())
        };
        // Buffers come from `Inflight::buf` as each write is built: the arena's free frames
        // when it has them (the usual case), else `spare`, else the buffers of this commit's
        // finished writes, taken back. So a commit needs one free frame, not one per block;
        // `spare` was taken before the id, and once it is used a write of this commit is in
        // flight to give a frame back. The `?`s below that follow started writes therefore fail
        // only when an engine wait fails; lbio then keeps the buffers of the writes still out
        // (a dropped `Inflight` leaves them to it) until they end.
        // A one-write handle commits a transaction too large for one write overlapped.
        let mode = match self.mode {
            CommitMode::OneWrite if !self.one_write(tx) => CommitMode::Overlapped,
            m => m,
        };
        let mut w = Inflight::with_spare(Some(spare));
        let c = match mode {
            CommitMode::OneWrite => {
                // The data in place (plain writes: the log copy is what makes it durable; a
                // checkpoint's FLUSH makes the home copy durable before the log is reused).
                {
                    let _plug = self.engine.plug();
                    timed(&mut prep, || self.send_data(tx, &mut w, false))?;
                }
                // The log blocks, the data among them, with the commit block last: one write
                // (two where the log wraps, more from a fragmented or nearly full arena;
                // recovery reads any missing piece as a torn tail by the checksum chain).
                let log_fua = fua && commit_fua;
                {
                    let _plug = self.engine.plug();
                    timed(&mut prep, || -> Result<(), JournalError> {
                        let n = self.journal_blocks(tx);
                        let mut out = LogWriter::new(self, &mut w, head, n + 1, log_fua);
                        let (n, chain) = self.build_journal(tx, tid, &mut out)?;
                        self.fill_commit(out.block(n)?, tx, tid, n, chain, None);
                        out.finish();
                        Ok(())
                    })?;
                }
                settle(w, log_fua)?;
                // The commit block went out with the rest.
                None
            }
            CommitMode::Vanilla => {
                timed(&mut prep, || self.send_data(tx, &mut w, fua))?;
                w.wait(&self.engine)?;
                let mut w = Inflight::new();
                let (n, chain) = {
                    let _plug = self.engine.plug();
                    timed(&mut prep, || self.send_journal(tx, tid, head, &mut w, fua))?
                };
                settle(w, fua)?;
                let c = timed(&mut prep, || self.prepare_commit(tx, tid, n, chain, None));
                Some((c?, n))
            }
            CommitMode::Overlapped => {
                {
                    let _plug = self.engine.plug();
                    timed(&mut prep, || self.send_data(tx, &mut w, fua))?;
                }
                // The data is on its way: prepare the journal while the device works.
                let (n, chain) = {
                    let _plug = self.engine.plug();
                    timed(&mut prep, || self.send_journal(tx, tid, head, &mut w, fua))?
                };
                let c = timed(&mut prep, || -> Result<_, JournalError> {
                    let mut c = w.buf(&self.engine, 1)?;
                    self.fill_commit(&mut c, tx, tid, n, chain, None);
                    Ok(c)
                })?;
                settle(w, fua)?;
                Some((c, n))
            }
        };
        st.prepare_ns
            .fetch_add(prep.as_nanos() as u64, Ordering::Relaxed);
        let Some((c, n)) = c else {
            return Ok(());
        };
        let t = Instant::now();
        self.engine
            .block_on(dev.write_at(log(n), c, commit_fua))??;
        if !commit_fua && !self.plp {
            // No FUA on this device: a flush makes the commit block durable.
            self.engine.block_on(dev.flush())??;
        }
        add(&st.commit_ns, t);
        Ok(())
    }

    /// The Rio-ordered commit: the data (in place, contiguous blocks merged) and the journal
    /// blocks as one group, then the commit block as the next group, all sent without waiting;
    /// then the stream's `wait` (writes done, one FLUSH where the device has a volatile cache,
    /// groups marked durable in the attribute log).
    ///
    /// A transaction with more writes than a quarter of the attribute log's slots is spread
    /// over as many groups as it needs (in order, the commit block's group after them all): a
    /// group must fit the log, and the ordered device frees slots of durable groups when the
    /// log runs full. Each write is handed to the ordered device as it is built
    /// ([`RioWriter`]); when the arena runs out of frames, the group being built goes out at
    /// once (one more group, still before the commit block's) and the commit takes its
    /// finished writes' buffers back, so it needs one free frame (`spare`, taken before the
    /// id, if the arena has none).
    fn write_tx_rio(
        &self,
        rio: &RioStream,
        tx: &Tx,
        tid: u64,
        head: u64,
        spare: FixedBuf,
    ) -> Result<(), JournalError> {
        let st = &self.set.stats;
        let start = Instant::now();
        let mut dev = rio.dev.borrow_mut();
        let mut done = rio.done.borrow_mut();
        let s = rio.stream;
        let cap = (dev.log().slots() as usize / 4).max(1);
        let mut w = RioWriter {
            j: self,
            dev: &mut dev,
            done: &mut done,
            stream: s,
            max: self.max_write(),
            cap,
            spare: Some(spare),
            pending: None,
            in_group: 0,
            short: false,
            failed: None,
            io: Duration::ZERO,
            head,
            total: self.journal_blocks(tx),
            run: None,
            filled: 0,
        };
        // Buffer preparation only: submitting may wait for the attribute log's sync.
        let mut prep = Duration::ZERO;
        // Every exit once a write may have gone out comes through here: a submission refused
        // part-way (its attribute log entry could not be written, say) leaves the writes sent
        // before it on the device.
        let waited: Result<(), JournalError> = 'send: {
            let built = self.send_rio_journal(tx, tid, &mut w);
            prep += start.elapsed().saturating_sub(w.io);
            let (n, chain) = match built {
                Ok(b) => b,
                Err(e) => break 'send Err(e),
            };
            // The commit block's group follows the data-and-journal groups (all closed now).
            let (t, io) = (Instant::now(), w.io);
            let mut c = match w.buf(1) {
                Ok(c) => c,
                Err(e) => break 'send Err(e),
            };
            // No more buffers to take: the spare frame, if unused, goes back (the ordered
            // device may copy merged groups into arena memory).
            w.spare = None;
            let group = w.dev.next_seq(s);
            self.fill_commit(&mut c, tx, tid, n, chain, Some(group));
            prep += t.elapsed().saturating_sub(w.io - io);
            let at = self.set.log_byte(self.area, head + n as u64);
            let commit = rio_ordering::Write {
                target: 0,
                offset: at,
                buf: c,
                ipu: false,
            };
            if let Err(e) = w.dev.submit(s, commit, true) {
                break 'send Err(e.into());
            }
            w.dev.wait(s).map_err(Into::into)
        };
        let failed_before = w.failed.take();
        drop(w);
        st.prepare_ns
            .fetch_add(prep.as_nanos() as u64, Ordering::Relaxed);
        // Hand the buffers back whatever happened, then report the first failure.
        let polled = dev.poll_into(&mut done);
        let failed = failed_before.or_else(|| {
            done.iter().position(|d| d.result.is_err()).map(|i| {
                let d = done.swap_remove(i);
                format!(
                    "write {} of group {} failed: {}",
                    d.id,
                    d.seq,
                    d.result.err().unwrap_or_default()
                )
            })
        });
        if waited.is_err() || polled.is_err() || failed.is_some() {
            // A failed commit returns only once none of its writes is on the device: the set
            // is aborted, and the caller may reopen (recover) the journal next, which must not
            // find one of them landing behind it. (`wait` returns early on a failure.)
            drain_rio(&mut dev, &mut done);
        }
        done.clear();
        drop(done);
        waited?;
        polled?;
        if let Some(f) = failed {
            return Err(JournalError::Rio(rio_ordering::RioError::Config(f)));
        }
        st.writes_ns
            .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if self.plp {
            st.flushes_skipped.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// A Rio-ordered commit's data and journal blocks, built and handed to `w` in order, their
    /// last group closed. Returns the number of journal blocks and their chained checksum.
    fn send_rio_journal(
        &self,
        tx: &Tx,
        tid: u64,
        w: &mut RioWriter<'_>,
    ) -> Result<(usize, u32), JournalError> {
        self.for_data_runs(
            tx,
            w,
            |w, len| w.buf(len),
            |w, at, buf| w.put(at, buf, true),
        )?;
        let built = self.build_journal(tx, tid, w)?;
        w.send_run()?;
        w.close()?;
        Ok(built)
    }

    /// Write every committed metadata block home (newest version), make it durable, and empty
    /// every area's log. Runs alone: commits on other threads wait for it.
    pub fn checkpoint(&self) -> Result<(), JournalError> {
        let set = &*self.set;
        let _alone = set.gate.write().unwrap_or_else(|p| p.into_inner());
        self.check_aborted()?;
        let r = self.checkpoint_alone();
        if r.is_err() {
            set.aborted.store(true, Ordering::SeqCst);
        }
        r
    }

    fn checkpoint_alone(&self) -> Result<(), JournalError> {
        let set = &*self.set;
        {
            // The kept versions go home from where they lie. No commit runs meanwhile (the
            // checkpoint holds the gate alone); a group leader judging which waiters may join
            // waits for the lock, and sees the versions as they are until the checkpoint ends.
            // No area lock is taken here while this one is held. (A leader takes its area's
            // lock, then this one, to judge its waiters, and `commit_led` this one, then its
            // area's: the two orders never meet, because only an area's one leader takes both
            // for that area.)
            let versions = set.lock_versions();
            write_home(
                &self.dev,
                versions
                    .map
                    .iter()
                    .filter(|(_, (_, d))| !d.is_empty())
                    .map(|(b, (_, d))| (*b, d.as_slice())),
            )?;
            self.engine.block_on(self.dev.flush())??;
        }
        // Every log is now redundant: move each tail to its head. Ids below the next one are
        // all home, so the new tail id is the next id.
        let tail_tid = set.next_tid.load(Ordering::Relaxed);
        set.checkpoint_target.store(tail_tid, Ordering::SeqCst);
        let mut futs: Batch<'_> = SmallVec::new();
        let mut heads: SmallVec<[u64; JOIN_INLINE]> = SmallVec::new();
        for (i, &(off, blocks)) in set.layout.areas.iter().enumerate() {
            let mut b = alloc_in_batch(&self.engine, &mut futs)?;
            let mut a = set.lock_area(i);
            a.generation += 1;
            Superblock {
                area_blocks: blocks,
                area_index: i as u32,
                area_count: set.layout.areas.len() as u32,
                tail_pos: a.head % (blocks - 1),
                tail_tid,
                generation: a.generation,
            }
            .encode(&mut b);
            heads.push(a.head);
            futs.push(self.dev.write_at(off, b, true));
        }
        join_all(&self.engine, futs)?;
        if !self.dev.critical_route().0.fua {
            self.engine.block_on(self.dev.flush())??;
        }
        for (i, h) in heads.into_iter().enumerate() {
            let mut a = set.lock_area(i);
            a.tail = h;
            a.rio_unhomed = false;
        }
        // All home: the versions go, their copies kept for later commits.
        set.lock_versions().clear();
        set.home_below.store(tail_tid, Ordering::SeqCst);
        set.stats.checkpoints.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Recovery applied to a device image in memory (what [`JournalSet::open`] would write home),
/// without resetting the logs: for crash simulation at scale and for inspecting images.
pub fn recover_image(image: &mut [u8], layout: &Layout) -> Result<RecoveryReport, JournalError> {
    recover_image_with(image, layout, None)
}

/// [`recover_image`] for Rio-ordered commits, given where each area's durable prefix ends
/// ([`rio_prefix`]; see [`JournalSet::open_rio`]).
pub fn recover_image_rio(
    image: &mut [u8],
    layout: &Layout,
    prefix_end: &[u64],
) -> Result<RecoveryReport, JournalError> {
    recover_image_with(image, layout, Some(prefix_end))
}

/// Per journal area, where its Rio stream's durable prefix ends: Rio recovery (Rio §4.4) of the
/// attribute logs the areas' Rio handles wrote (one per area, in area order, each with one
/// stream per area; an area without a Rio handle may pass a fresh log). `plp`: the device has
/// power-loss protection.
pub fn rio_prefix(scans: &[LogScan], plp: bool) -> Result<Vec<u64>, JournalError> {
    scans
        .iter()
        .enumerate()
        .map(|(area, scan)| {
            let r = rio_ordering::recover(scan, &|_| plp);
            r.streams.get(area).map(|s| s.prefix_end).ok_or_else(|| {
                JournalError::Layout(format!(
                    "attribute log {area} has {} streams; it needs one per journal area",
                    r.streams.len()
                ))
            })
        })
        .collect()
}

fn recover_image_with(
    image: &mut [u8],
    layout: &Layout,
    prefix_end: Option<&[u64]>,
) -> Result<RecoveryReport, JournalError> {
    layout.validate(image.len() as u64)?;
    let mut logs = Vec::new();
    recovery::check_rio_prefix(layout.areas.len(), prefix_end)?;
    for (i, &(off, blocks)) in layout.areas.iter().enumerate() {
        let area = &image[off as usize..(off + blocks * BLOCK as u64) as usize];
        logs.push(parse_area_of(area, i, layout, prefix_end)?);
    }
    recovery::apply_rio_prefix(&mut logs, prefix_end)?;
    let (writes, report) = plan_recovery(&logs, layout, image.len() as u64)?;
    for (b, d) in writes {
        let at = (b * BLOCK as u64) as usize;
        image[at..at + BLOCK].copy_from_slice(d);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(v: u8) -> Vec<u8> {
        vec![v; BLOCK]
    }

    /// A group commit's join gives what joining one revoke and one block at a time gives (the
    /// plain model below, the way joins were first written): random pairs of transactions,
    /// small and past the index and set thresholds, with blocks written, journaled and revoked
    /// on both sides; also whether the join is refused.
    #[test]
    fn joins_match_a_one_at_a_time_model() {
        type Lists = (Vec<(u64, u8)>, Vec<(u64, u8)>, Vec<u64>);
        fn lists(t: &Tx) -> Lists {
            let l = |v: &[(u64, Vec<u8>)]| v.iter().map(|(b, d)| (*b, d[0])).collect();
            (l(&t.data), l(&t.metas), t.revokes.as_slice().to_vec())
        }
        fn model(first: &Tx, later: &Tx) -> Option<Lists> {
            let (mut data, mut metas, mut revokes) = lists(first);
            let (ldata, lmetas, lrevokes) = lists(later);
            if ldata
                .iter()
                .any(|(b, _)| metas.iter().any(|(m, _)| m == b) && !lrevokes.contains(b))
            {
                return None;
            }
            let put = |list: &mut Vec<(u64, u8)>, b: u64, v: u8| match list
                .iter_mut()
                .find(|(x, _)| *x == b)
            {
                Some(e) => e.1 = v,
                None => list.push((b, v)),
            };
            for &(b, v) in &ldata {
                put(&mut data, b, v);
            }
            for &b in &lrevokes {
                metas.retain(|(x, _)| *x != b);
                if !ldata.iter().any(|(x, _)| *x == b) {
                    data.retain(|(x, _)| *x != b);
                }
                if !revokes.contains(&b) {
                    revokes.push(b);
                }
            }
            for &(b, v) in &lmetas {
                revokes.retain(|x| *x != b);
                put(&mut metas, b, v);
            }
            Some((data, metas, revokes))
        }
        let mut x = 0x1234_5678_9abc_def1u64;
        let mut next = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let (mut joined, mut refused) = (0, 0);
        for case in 0..400u32 {
            let ops = if case % 4 == 0 { 150 } else { 20 };
            let range = if case % 4 == 0 { 120 } else { 30 };
            let mut txs = [Tx::new(), Tx::new()];
            for t in &mut txs {
                for _ in 0..next(ops) {
                    let b = next(range);
                    let v = next(250) as u8 + 1;
                    match next(3) {
                        0 => {
                            t.write_data(b, &block(v)).unwrap();
                        }
                        1 => {
                            t.write_meta(b, &block(v)).unwrap();
                        }
                        _ => {
                            t.revoke(b);
                        }
                    }
                }
            }
            let [mut first, later] = txs;
            let want = model(&first, &later);
            let before = lists(&first);
            let ok = first.absorb(&later, u64::MAX, &mut Tx::new());
            match want {
                Some(w) => {
                    assert!(ok, "case {case}: refused");
                    assert_eq!(lists(&first), w, "case {case}");
                    joined += 1;
                }
                None => {
                    assert!(!ok, "case {case}: joined");
                    assert_eq!(lists(&first), before, "case {case}: changed when refused");
                    refused += 1;
                }
            }
            // The indexes still find every block after the join.
            for (b, _) in lists(&first).0 {
                assert!(find_block(&first.data, &mut first.data_index, b).is_some());
            }
        }
        assert!(
            joined > 50 && refused > 50,
            "joined {joined}, refused {refused}"
        );
    }

    /// Revokes keep first-revoke order with no repeats, across the switch to the set and back
    /// below it: random revokes and removals match a plain model, and so do a clear, a copy and
    /// a group commit joining two transactions with many revokes.
    #[test]
    fn revokes_match_a_plain_list() {
        let mut r = Revokes::default();
        let mut model: Vec<u64> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..6000u32 {
            // Phases that grow past LINEAR_FIND and shrink back under it.
            let grow = (step / 500) % 2 == 0;
            let b = next() % 120;
            if next() % 4 != 0 || (grow && next() % 2 == 0) {
                if grow {
                    r.insert(b);
                    if !model.contains(&b) {
                        model.push(b);
                    }
                } else {
                    r.retain(|x| x != b);
                    model.retain(|&m| m != b);
                }
            } else {
                assert_eq!(r.contains(b), model.contains(&b), "step {step}, block {b}");
            }
            assert_eq!(r.as_slice(), model.as_slice(), "step {step}");
            assert_eq!(r.set.is_empty(), model.len() <= LINEAR_FIND, "step {step}");
            if !r.set.is_empty() {
                assert_eq!(r.set.len(), model.len(), "step {step}");
            }
        }
        let mut tx = Tx::new();
        let mut later = Tx::new();
        for b in 0..200u64 {
            tx.revoke(b);
            tx.revoke(b);
        }
        for b in 100..400u64 {
            later.revoke(b);
        }
        later.write_meta(150, &block(1)).unwrap();
        assert!(tx.absorb(&later, 10_000, &mut Tx::new()));
        let want: Vec<u64> = (0..400).filter(|&b| b != 150).collect();
        assert_eq!(tx.revokes.as_slice(), want.as_slice());
        assert!(!tx.revokes.contains(150) && tx.revokes.contains(399));
        let mut copy = Tx::new();
        copy.copy_from(&tx);
        assert_eq!(copy.revokes.as_slice(), want.as_slice());
        assert!(copy.revokes.contains(250));
        tx.clear();
        assert!(tx.revokes.is_empty() && !tx.revokes.contains(0));
        tx.revoke(7);
        assert_eq!(tx.revokes.as_slice(), [7]);
    }

    /// Past [`LINEAR_FIND`] blocks a transaction finds them through an index: rewrites,
    /// removals and writes after removals keep the same lists as a plain model (order of first
    /// write, rewrites in place), also across `clear` and `copy_from`.
    #[test]
    fn large_transactions_keep_their_blocks_in_order() {
        let mut tx = Tx::new();
        for round in 0..3u8 {
            let mut model: Vec<(u64, u8)> = Vec::new();
            let put = |tx: &mut Tx, model: &mut Vec<(u64, u8)>, b: u64, v: u8| {
                tx.put(Which::Data, b, &block(v));
                match model.iter_mut().find(|(m, _)| *m == b) {
                    Some(e) => e.1 = v,
                    None => model.push((b, v)),
                }
            };
            for b in 0..300u64 {
                put(&mut tx, &mut model, b * 7 % 1000, (b % 251) as u8 ^ round);
            }
            for b in (0..300u64).step_by(3) {
                put(&mut tx, &mut model, b * 7 % 1000, 0xee ^ round);
            }
            for b in (0..300u64).step_by(5) {
                tx.remove_where(Which::Data, |x| x == b * 7 % 1000);
                model.retain(|(m, _)| *m != b * 7 % 1000);
            }
            for b in (0..300u64).step_by(10) {
                put(&mut tx, &mut model, b * 7 % 1000, 0x11 ^ round);
            }
            let check = |tx: &Tx| {
                let got: Vec<(u64, u8)> = tx.data_blocks().map(|(b, d)| (b, d[0])).collect();
                assert_eq!(got, model, "round {round}");
                assert!(tx.data_blocks().all(|(_, d)| d.iter().all(|&x| x == d[0])));
            };
            check(&tx);
            let mut copy = Tx::new();
            copy.copy_from(&tx);
            check(&copy);
            // A rewrite after copy_from finds the block (the index is rebuilt).
            let (b, _) = model[model.len() / 2];
            copy.put(Which::Data, b, &block(0x42));
            assert_eq!(copy.data_blocks().count(), model.len());
            tx.clear();
        }
    }

    #[test]
    fn a_group_drops_data_for_a_block_a_later_member_frees() {
        let mut first = Tx::new();
        first.write_data(10, &block(1)).unwrap();
        first.write_data(11, &block(2)).unwrap();
        first.write_meta(20, &block(3)).unwrap();
        let mut later = Tx::new();
        later.revoke(10);
        later.revoke(11);
        later.write_data(11, &block(4)).unwrap();
        assert!(first.absorb(&later, 100, &mut Tx::new()));
        // Block 10 is freed by the later member: the earlier data for it goes (a one-write
        // commit would log it under the revoke's own id). Block 11 is freed and written again
        // by the later member: its new data stays.
        let data: Vec<(u64, u8)> = first.data.iter().map(|(b, d)| (*b, d[0])).collect();
        assert_eq!(data, vec![(11, 4)]);
        assert_eq!(first.revokes.as_slice(), [10, 11]);
        assert_eq!(first.metas.len(), 1);
    }
}
