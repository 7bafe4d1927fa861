//! The ordered device: the sequencer, streams, the ORDER queue (merging whole groups, splitting
//! requests above the device's transfer limit), asynchronous execution on lbio with the
//! attribute written before the data, in-order completion per stream, and `wait` for
//! durability.
//!
//! One `OrderedDevice` lives on one engine (one thread), like everything lbio drives. It owns
//! its lbio array, so every detached completion on it is its own.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use aios_core::{Engine, FixedBuf};
use lbio::{Device, Io, LbioArray, Tag};
use smallvec::SmallVec;

use crate::attr::Attr;
use crate::error::RioError;
use crate::log::{AttrLog, Pmr, Slot};

/// Settings of an ordered device.
#[derive(Clone, Copy, Debug)]
pub struct OrderedConfig {
    /// Closed groups a stream's ORDER queue holds before sending them (1: send each group when
    /// it closes). Held groups are sent at `wait`, `poll` and `flush_queue` too.
    pub batch: usize,
    /// Merge consecutive whole groups that are contiguous on one target into one command.
    pub merge: bool,
    /// Largest merged command.
    pub max_merge_bytes: u32,
    /// On a target without power-loss protection, once this many completed commands wait for a
    /// FLUSH, one is sent in the background (no wait, nothing drained): the groups it covers
    /// become durable when it completes, and their log slots and bookkeeping are freed. Without
    /// it (0) they wait for the next `wait` or for the log to fill (which drains the device).
    /// Capped at half the log's slots. A FLUSH is sent from one of io_uring's worker threads and
    /// costs the process tens of microseconds of CPU there, so the default (4,096) spreads it
    /// over many writes.
    pub flush_ahead: usize,
}

impl Default for OrderedConfig {
    fn default() -> Self {
        OrderedConfig {
            batch: 1,
            merge: true,
            max_merge_bytes: 128 << 10,
            flush_ahead: 4096,
        }
    }
}

/// One ordered write.
#[derive(Debug)]
pub struct Write {
    pub target: u16,
    /// Byte offset on the target.
    pub offset: u64,
    pub buf: FixedBuf,
    /// An in-place update (recovery hands it to the upper layer instead of discarding it).
    pub ipu: bool,
}

/// A finished write, handed back in order (per stream: group order, then submission order).
#[derive(Debug)]
pub struct Done {
    pub stream: u16,
    pub seq: u64,
    /// The id [`OrderedDevice::submit`] returned.
    pub id: u64,
    pub result: Result<(), String>,
    pub buf: FixedBuf,
}

/// A stream leaving one ordered device for another (another thread's): everything it wrote
/// before is durable, and this says where its order goes on. `Send`: pass it over a channel and
/// [`OrderedDevice::attach`] it there. Both devices must have the same targets in the same order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamHandoff {
    pub stream: u16,
    /// The stream's next group.
    pub next_seq: u64,
    /// Per target, the stream's last group sent there (the next entry's `prev`).
    pub prev: Vec<(u16, u64)>,
    next_id: u64,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrderedStats {
    /// Writes [`OrderedDevice::submit`] took (one id each); a write it refused is not counted.
    pub requests: u64,
    /// Device commands sent (data writes; FLUSHes counted apart).
    pub device_cmds: u64,
    pub merged_cmds: u64,
    /// Runs of groups that would have gone out merged but went out one command per group: the
    /// engine's arena had no room for the merge's copy (merging only saves commands).
    pub merges_skipped: u64,
    pub split_cmds: u64,
    pub flushes: u64,
    /// Of those, FLUSHes sent in the background ([`OrderedConfig::flush_ahead`]).
    pub flushes_ahead: u64,
    /// Appends that found the log full and waited for durability.
    pub log_full_waits: u64,
    /// Log syncs before data went out (block logs only: one per batch).
    pub log_syncs: u64,
    /// Time spent in those syncs, nanoseconds: what a block log adds in front of the data.
    pub log_sync_ns: u64,
    /// Errors met sending after `submit` had taken its write (see
    /// [`OrderedDevice::submit`]): each failed the groups it hit (their [`Done`]s carry it,
    /// and `wait` reports it), or left a log sync to retry.
    pub send_errors: u64,
    /// Commands held back until an earlier command writing some of the same bytes on the same
    /// target completed (two writes on the device at once land in either order).
    pub overlap_waits: u64,
}

struct Req {
    id: u64,
    w: Write,
}

/// A command whose data waits for its log entry to be written: (offset, data, command, merged
/// requests).
type Staged = (u64, FixedBuf, Cmd, Option<Carried>);

/// A group's requests (most groups hold one: no heap allocation for those).
type GroupReqs = SmallVec<[Req; 1]>;
/// The requests a merged command carries: (id, the caller's buffer; the device got a copy).
type Carried = SmallVec<[(u64, FixedBuf); 4]>;

/// What a command hands back when it completes.
#[derive(Clone, Copy)]
enum Back {
    /// Request `id` alone, whose buffer is the command's own.
    Own(u64),
    /// A piece of split request `id` (its buffer waits in `pieces_out`).
    Piece(u64),
    /// Whole requests merged into one command (their buffers wait in `OrderedDevice::merged`
    /// under the command's tag).
    Merged,
}

/// The bytes a command on the device writes: `start..end` of `target`, lbio tag `tag`.
#[derive(Clone, Copy)]
struct Span {
    start: u64,
    end: u64,
    target: u16,
    tag: u32,
}

/// A command on the device: its entry, the groups and requests it carries. Kept small: one is
/// written at submission and read at completion for every write.
struct Cmd {
    seq: u64,
    seq_end: u64,
    back: Back,
    slot: Slot,
    stream: u16,
    target: u16,
}

#[derive(Default)]
struct Group {
    /// Commands not yet completed.
    out: u32,
    /// Commands not yet durable.
    not_durable: u32,
    /// The group's requests have ids `first_id..first_id + count` (ids are per stream and
    /// consecutive within a group).
    count: u32,
    /// Requests finished (their buffers wait in the stream's `bufs`).
    finished: u32,
    first_id: u64,
    /// Every command is sent.
    sent: bool,
    /// A write, or the FLUSH meant to make it durable, failed: the reason is in the stream's
    /// `failures`.
    failed: bool,
}

impl Group {
    fn holds(&self, id: u64) -> bool {
        id >= self.first_id && id < self.first_id + self.count as u64
    }
}

/// A stream's groups from the oldest not yet durable on, by seq.
#[derive(Default)]
struct Groups {
    base: u64,
    q: VecDeque<Group>,
}

impl Groups {
    fn get(&self, g: u64) -> Option<&Group> {
        g.checked_sub(self.base)
            .and_then(|i| self.q.get(i as usize))
    }
    fn get_mut(&mut self, g: u64) -> Option<&mut Group> {
        g.checked_sub(self.base)
            .and_then(|i| self.q.get_mut(i as usize))
    }
    /// Add group `g` (the next one).
    fn push(&mut self, g: u64, grp: Group) {
        if self.q.is_empty() {
            self.base = g;
        }
        debug_assert_eq!(g, self.base + self.q.len() as u64, "groups close in order");
        self.q.push_back(grp);
    }
    /// The groups of `a..=b` that are here (in order).
    fn range_mut(&mut self, a: u64, b: u64) -> std::collections::vec_deque::IterMut<'_, Group> {
        let len = self.q.len() as u64;
        let hi = b.saturating_add(1).saturating_sub(self.base).min(len);
        let lo = a.saturating_sub(self.base).min(hi);
        self.q.range_mut(lo as usize..hi as usize)
    }
    /// Drop the `n` oldest groups.
    fn pop_n(&mut self, n: usize) {
        self.q.drain(..n);
        self.base += n as u64;
    }
}

#[derive(Default)]
struct Stream {
    next_seq: u64,
    open: GroupReqs,
    queued: VecDeque<(u64, GroupReqs)>,
    /// By target: the last group sent to it (0: none yet).
    prev: Vec<u64>,
    groups: Groups,
    /// Ids of the stream's writes.
    next_id: u64,
    /// Groups below are handed back (in order).
    done_below: u64,
    /// Groups below are durable.
    durable_below: u64,
    /// Targets written since the last wait.
    touched: Vec<u16>,
    /// Completions in order, not yet taken (always taken whole).
    ready: Vec<Done>,
    /// Buffers of finished requests not yet handed back, by id from `bufs_base` (groups hand
    /// back in order, and their ids follow each other).
    bufs: VecDeque<Option<FixedBuf>>,
    bufs_base: u64,
    /// Why groups failed: (group, reason).
    failures: Vec<(u64, String)>,
    /// The stream lives on another device: [`OrderedDevice::attach`] brings it here.
    away: bool,
    /// An asynchronous log write holding the stream's commands failed (why): they were staged
    /// again for the next sync, and the stream's next `wait` reports it (once), unless a sync
    /// carrying them succeeded first, or a group of the stream has failed (whose failure that
    /// `wait` reports instead, as every later one does).
    log_failed: Option<String>,
}

impl Stream {
    /// Group `g` failed (the first reason stays).
    fn fail(&mut self, g: u64, why: &str) {
        if let Some(grp) = self.groups.get_mut(g) {
            if !grp.failed {
                grp.failed = true;
                self.failures.push((g, why.to_string()));
            }
        }
    }

    fn failure(&self, g: u64) -> String {
        self.failures
            .iter()
            .find(|f| f.0 == g)
            .map_or_else(String::new, |f| f.1.clone())
    }

    /// The stream's lowest failed group and why it failed.
    fn lowest_failure(&self) -> Option<&(u64, String)> {
        self.failures.iter().min_by_key(|f| f.0)
    }

    /// The requests of a merged command over groups `seq..=seq_end` finished: each buffer
    /// waits, by id, in its own group.
    fn finish_merged(&mut self, seq: u64, seq_end: u64, reqs: &mut Carried) {
        for (id, buf) in reqs.drain(..) {
            let g = (seq..=seq_end)
                .find(|&g| self.groups.get(g).is_some_and(|grp| grp.holds(id)))
                .expect("the request's group");
            self.finish(g, id, buf);
        }
    }

    /// A command carrying groups up to `seq_end` goes to `target`: the next one there links
    /// to it, and `wait` flushes the target.
    #[inline]
    fn sent_to(&mut self, target: u16, seq_end: u64) {
        let t = target as usize;
        match self.prev.get_mut(t) {
            Some(p) => *p = seq_end,
            None => {
                self.prev.resize(t + 1, 0);
                self.prev[t] = seq_end;
            }
        }
        // Most streams write one target: the last one touched is the one.
        if self.touched.last() != Some(&target) && !self.touched.contains(&target) {
            self.touched.push(target);
        }
    }

    /// Request `id`, which finished without error, goes back now (no wait in `bufs`) when its
    /// group `seq` is the oldest not handed back, is all sent and done, and holds only this
    /// request, and nothing after it finished yet: the common case of in-order completion.
    /// Otherwise its buffer comes back to the caller.
    fn hand_back_alone(
        &mut self,
        stream: u16,
        seq: u64,
        id: u64,
        buf: FixedBuf,
    ) -> Option<FixedBuf> {
        let oldest = self.done_below == seq && self.bufs.is_empty() && self.bufs_base == id;
        let Some(grp) = self
            .groups
            .get_mut(seq)
            .filter(|g| oldest && g.count == 1 && g.sent && g.out == 0 && !g.failed)
        else {
            return Some(buf);
        };
        grp.finished = 1;
        self.bufs_base += 1;
        self.done_below += 1;
        self.ready.push(Done {
            stream,
            seq,
            id,
            result: Ok(()),
            buf,
        });
        None
    }

    /// Request `id` of group `g` finished: its buffer waits for the group's turn.
    fn finish(&mut self, g: u64, id: u64, buf: FixedBuf) {
        let i = (id - self.bufs_base) as usize;
        if self.bufs.len() <= i {
            self.bufs.resize_with(i + 1, || None);
        }
        self.bufs[i] = Some(buf);
        self.groups.get_mut(g).expect("group").finished += 1;
    }
}

/// Spent request lists (of groups of several writes) kept for reuse.
const SPARE_REQS: usize = 64;

/// Writes one group may hold: its boundary entry counts them in 16 bits.
pub const MAX_GROUP_WRITES: usize = u16::MAX as usize;

/// Runs a target's list of completed, not yet durable commands has room for from the start.
const VOLATILE_RUNS: usize = 1024;

/// Completed commands not yet known durable, as runs of groups (stream, first seq, last seq):
/// a command whose groups continue the last run's extends it (one entry for a stream of
/// single-group writes completing in order), so a group appears once per command of it.
#[derive(Default)]
struct Volatile {
    runs: Vec<(u16, u64, u64)>,
    /// Commands recorded (what `flush_ahead` counts).
    cmds: usize,
}

impl Target {
    /// An empty list for the commands completing from now on, its allocation from the spares.
    fn fresh_volatile(&mut self) -> Volatile {
        let spare = self.spares.pop().unwrap_or_default();
        std::mem::replace(&mut self.volatile, spare)
    }
    /// A covered list is done with: keep its allocation.
    fn give_back(&mut self, mut v: Volatile) {
        v.clear();
        if self.spares.len() < 3 {
            self.spares.push(v);
        }
    }
}

impl Volatile {
    fn with_capacity(runs: usize) -> Volatile {
        Volatile {
            runs: Vec::with_capacity(runs),
            cmds: 0,
        }
    }
    #[inline]
    fn push(&mut self, stream: u16, seq: u64, seq_end: u64) {
        self.cmds += 1;
        if let Some(last) = self.runs.last_mut() {
            if last.0 == stream && last.2.checked_add(1) == Some(seq) {
                last.2 = seq_end;
                return;
            }
        }
        self.runs.push((stream, seq, seq_end));
    }
    fn clear(&mut self) {
        self.runs.clear();
        self.cmds = 0;
    }
    /// Take `other`'s commands back (a FLUSH whose outcome is unknown).
    fn absorb(&mut self, other: Volatile) {
        self.runs.extend(other.runs);
        self.cmds += other.cmds;
    }
}

struct Target {
    dev: Device,
    plp: bool,
    max_transfer: u32,
    /// A command's largest piece: the transfer limit, at least 4 KiB.
    piece: u64,
    /// The largest write taken (255 pieces).
    most: u64,
    /// Completed commands not yet covered by a FLUSH (non-PLP targets): (stream, seqs).
    volatile: Volatile,
    /// A background FLUSH out: its tag and the commands it covers.
    flushing: Option<(Tag, Volatile)>,
    /// `wait`'s (or a full log's) FLUSH is out: no background FLUSH starts meanwhile. Were it
    /// to fail, the commands completed while it was out fail with it (they may have reached
    /// the device before it); a background FLUSH sent meanwhile would take them from the
    /// target's list, and its success would count them durable.
    sync_flush: bool,
    /// Lists' allocations kept for the next FLUSH (three lists can be in use at once: the
    /// target's, a background FLUSH's and a `wait`'s).
    spares: Vec<Volatile>,
}

/// Rio's ordered block device over lbio targets and an attribute log.
pub struct OrderedDevice<P: Pmr> {
    engine: Rc<Engine>,
    lbio: Rc<LbioArray>,
    targets: Vec<Target>,
    log: AttrLog<P>,
    streams: Vec<Stream>,
    cfg: OrderedConfig,
    /// Commands in flight, by lbio tag.
    inflight: Vec<Option<Cmd>>,
    inflight_n: usize,
    /// The bytes each command in flight writes (one entry per command, in no order): a later
    /// command over any of them waits for it (see [`OrderedDevice::submit_cmd`]).
    spans: Vec<Span>,
    /// Background FLUSHes out.
    flushes_out: usize,
    /// The FLUSH-ahead threshold, capped by the log's size.
    flush_ahead: usize,
    /// Merged commands' requests, by tag.
    merged: Vec<Carried>,
    /// Spent request lists of groups of several writes, kept for their allocations.
    spare_reqs: Vec<GroupReqs>,
    /// Merged commands' request lists that outgrew their inline room, kept for reuse.
    spare_carried: Vec<Carried>,
    /// The groups of the command `send_queued` is building (kept for its allocation).
    run: Vec<(u64, GroupReqs)>,
    /// Split requests: pieces still out and the caller's buffer, keyed by (stream, request id)
    /// (ids are per stream).
    pieces_out: HashMap<(u16, u64), (u32, FixedBuf)>,
    /// Commands whose entries are appended to a deferred (block) log, waiting for the log sync
    /// that must precede their data: (offset, data, command, merged requests).
    staged: Vec<Staged>,
    /// The log writes asynchronously on this device's own array ([`Pmr::async_array`]).
    log_async: bool,
    /// Asynchronous log writes out, the commands whose data waits for them, and when they
    /// started.
    log_writes_out: usize,
    log_batch: Vec<Staged>,
    log_sync_t0: Option<std::time::Instant>,
    /// A write of the sync out failed (reported when the last one is in).
    log_sync_failed: Option<String>,
    /// The last asynchronous log sync failed (why), for `poll`, `wait_any` and `wait_progress`
    /// to report when they have nothing to hand back; cleared by a sync that succeeds.
    log_failure: Option<String>,
    /// Asynchronous log syncs that failed so far.
    log_write_failures: u64,
    /// Completions taken so far (progress, for `wait_progress_into`).
    reaped: u64,
    stats: OrderedStats,
}

impl<P: Pmr> OrderedDevice<P> {
    /// An ordered device over `targets` (devices opened on `lbio`, which this device then owns:
    /// every detached completion on it is taken as its own) with the attribute log `log` (one
    /// stream per log stream). Streams start at group `start[s]` (1 on a fresh log; a
    /// recovery's [`crate::Recovery::resume_marks`] after a crash, the log reopened with them);
    /// a start other than the log header's mark is refused. `start[s] == 0` means the
    /// stream lives on another device until a [`StreamHandoff`] brings it here.
    pub fn new(
        lbio: Rc<LbioArray>,
        targets: Vec<Device>,
        log: AttrLog<P>,
        start: &[u64],
        cfg: OrderedConfig,
    ) -> Result<OrderedDevice<P>, RioError> {
        if targets.is_empty() {
            return Err(RioError::Config("an ordered device needs a target".into()));
        }
        if start.len() != log.streams() as usize {
            return Err(RioError::Config(format!(
                "{} start groups for a log of {} streams",
                start.len(),
                log.streams()
            )));
        }
        if let Some((stream, &g)) = start
            .iter()
            .enumerate()
            .find(|&(_, &g)| g > crate::attr::MAX_SEQ)
        {
            return Err(RioError::Config(format!(
                "stream {stream} starts at group {g}, past the largest group {} (0 means the \
                 stream lives on another device)",
                crate::attr::MAX_SEQ
            )));
        }
        // Recovery starts each stream at the header's mark: groups below it count as durable,
        // and a stream starting past it leaves a gap that ends its prefix there (every group
        // written here would be beyond it).
        if let Some((stream, (&g, &mark))) = start
            .iter()
            .zip(log.header_marks())
            .enumerate()
            .find(|&(_, (&g, &mark))| g != 0 && g != mark)
        {
            return Err(RioError::Config(format!(
                "stream {stream} starts at group {g}, but the log's header marks it at group \
                 {mark}, where its recovery starts: start it there, or reopen the log with the \
                 marks to start at (AttrLog::reopen)"
            )));
        }
        if cfg.batch == 0 {
            return Err(RioError::Config("batch must be at least 1".into()));
        }
        if let Some(t) = targets.iter().position(|d| !d.writable()) {
            return Err(RioError::Config(format!(
                "target {t} is open read-only: an ordered device writes and FLUSHes its targets \
                 (open it for writing)"
            )));
        }
        // Merged commands and the pieces of split requests are copied into arena buffers:
        // their alignment (that of the arena's start and of its frame size) must do for every
        // target, or lbio refuses a copy when it is sent, after its group took its entry.
        let arena = lbio.engine().arena();
        let copy_align =
            1u64 << (arena.base_ptr() as u64 | arena.frame_bytes() as u64).trailing_zeros();
        if let Some((t, d)) = targets
            .iter()
            .enumerate()
            .find(|(_, d)| d.geometry().mem_align as u64 > copy_align)
        {
            return Err(RioError::Config(format!(
                "target {t} needs buffers aligned to {} bytes, but the engine's arena ({}-byte \
                 frames) gives copies aligned to {copy_align}: merged and split commands would \
                 be refused; give the engine frames of at least {} bytes",
                d.geometry().mem_align,
                arena.frame_bytes(),
                d.geometry().mem_align
            )));
        }
        let flush_ahead = cfg.flush_ahead.min(log.slots() as usize / 2);
        // Allocate at start: what a steady stream of writes tracks is sized here, so the write
        // path does not grow a collection (`tests/no_alloc.rs`). Commands in flight are bounded
        // by the lbio slots; completed commands waiting for a FLUSH by `flush_ahead` (plus what
        // completes while one is out); groups not yet durable by those two and by the log,
        // whose slots the streams share. A list that outgrows this (streams writing unevenly,
        // completions interleaving into many runs) grows once and keeps its allocation.
        let window = lbio.config().slots as usize;
        let slots = log.slots() as usize;
        let waiting = if flush_ahead > 0 {
            (flush_ahead + window).min(slots)
        } else {
            slots
        };
        let tracked = (2 * waiting + window)
            .min(slots)
            .div_ceil(start.len().max(1));
        // Runs of groups: one per stream when completions come in order.
        let runs = waiting.min(VOLATILE_RUNS);
        let n_targets = targets.len();
        let targets = targets
            .into_iter()
            .map(|dev| {
                let max_transfer = dev.geometry().max_transfer_bytes;
                let piece = (max_transfer as u64).max(4096);
                Target {
                    plp: dev.critical_route().0.power_loss_protected,
                    max_transfer,
                    piece,
                    most: piece * u8::MAX as u64,
                    dev,
                    volatile: Volatile::with_capacity(runs),
                    flushing: None,
                    sync_flush: false,
                    spares: {
                        let mut v = Vec::with_capacity(3);
                        v.push(Volatile::with_capacity(runs));
                        v.push(Volatile::with_capacity(runs));
                        v
                    },
                }
            })
            .collect();
        let streams = start
            .iter()
            .map(|&s| Stream {
                next_seq: s.max(1),
                next_id: 1,
                bufs_base: 1,
                done_below: s.max(1),
                durable_below: s.max(1),
                away: s == 0,
                prev: vec![0; n_targets],
                touched: Vec::with_capacity(n_targets),
                groups: Groups {
                    base: 0,
                    q: VecDeque::with_capacity(tracked),
                },
                ready: Vec::with_capacity(window),
                bufs: VecDeque::with_capacity(window),
                ..Stream::default()
            })
            .collect();
        let log_async = log.async_array().is_some_and(|a| Rc::ptr_eq(a, &lbio));
        Ok(OrderedDevice {
            log_async,
            log_writes_out: 0,
            log_batch: Vec::new(),
            log_sync_t0: None,
            log_sync_failed: None,
            log_failure: None,
            log_write_failures: 0,
            reaped: 0,
            flush_ahead,
            engine: Rc::clone(lbio.engine()),
            lbio,
            targets,
            log,
            streams,
            cfg,
            inflight: Vec::with_capacity(window),
            spans: Vec::with_capacity(window),
            spare_reqs: Vec::with_capacity(SPARE_REQS),
            spare_carried: Vec::with_capacity(SPARE_REQS),
            // A merge holds at most this many whole groups of 4 KiB (more, or smaller groups,
            // grow it once).
            run: Vec::with_capacity((cfg.max_merge_bytes as usize / 4096).clamp(1, 256)),
            merged: Vec::with_capacity(window),
            inflight_n: 0,
            flushes_out: 0,
            pieces_out: HashMap::new(),
            staged: Vec::new(),
            stats: OrderedStats::default(),
        })
    }

    pub fn stats(&self) -> OrderedStats {
        self.stats
    }
    pub fn log(&self) -> &AttrLog<P> {
        &self.log
    }
    pub fn streams(&self) -> u16 {
        self.streams.len() as u16
    }
    /// The group the stream's next request joins.
    pub fn next_seq(&self, stream: u16) -> u64 {
        self.streams[stream as usize].next_seq
    }

    /// Queue an ordered write on `stream`; `end_of_group` closes its group (the writes of one
    /// group may reach the device in any order; groups reach it in order). Returns the write's
    /// id, which its [`Done`] carries.
    ///
    /// Bad input (an offset, length or buffer address off the target's alignment, bounds, a
    /// buffer from another engine's arena than this device's, an unknown stream or target,
    /// overlap in the group, more than 255 pieces) is refused before the write takes a group.
    /// So is a write going straight to the device (a group of one, nothing queued) whose log
    /// entry cannot be written: it takes no group, and its buffer goes back to the arena. Any
    /// other write that fails on its way to the device (its log entry, or its submission) fails
    /// its group: its buffer, and those of the group's other requests, come back in order in
    /// [`Done`]s that carry the error, and the stream's `wait` reports the failure from then on.
    pub fn submit(&mut self, stream: u16, w: Write, end_of_group: bool) -> Result<u64, RioError> {
        let s = self.stream_index(stream)?;
        let t = self
            .targets
            .get(w.target as usize)
            .ok_or_else(|| RioError::Config(format!("target {} does not exist", w.target)))?;
        let g = t.dev.geometry();
        let len = w.buf.len() as u64;
        if len == 0
            || !lbio::aligned(w.offset, g.offset_align)
            || !lbio::aligned(len, g.offset_align)
            || w.offset
                .checked_add(len)
                .is_none_or(|end| end > g.capacity_bytes)
        {
            return Err(RioError::Config(format!(
                "write of {len} bytes at {} on target {}: must be a non-empty multiple of {} \
                 bytes, aligned, inside its {} bytes",
                w.offset, w.target, g.offset_align, g.capacity_bytes
            )));
        }
        // lbio refuses such memory when the command is sent, after the write took its group and
        // logged its entry: the group would fail, and hold the stream's log until recovery.
        let addr = w.buf.as_ptr() as u64;
        if !lbio::aligned(addr, g.mem_align) {
            return Err(RioError::Config(format!(
                "write of {len} bytes at {} on target {}: its buffer at address {addr:#x} \
                 ({addr}) is not aligned to the target's {}-byte direct-I/O memory alignment",
                w.offset, w.target, g.mem_align
            )));
        }
        // A buffer is sent as the engine's registered buffer `buf_index()`, an index into this
        // engine's registration; memory of another engine's arena lies outside it, and the
        // kernel fails the command (EFAULT) when it is sent, after the write took its group and
        // logged its entry: the group would fail, and hold the stream's log until recovery.
        if !Rc::ptr_eq(w.buf.arena(), self.engine.arena()) {
            return Err(RioError::Config(format!(
                "write of {len} bytes at {} on target {}: its buffer at address {addr:#x} comes \
                 from another engine's arena, which this engine's ring has not registered; \
                 allocate it from the ordered device's engine (that of its lbio array)",
                w.offset, w.target
            )));
        }
        let max = t.piece;
        if len > t.most {
            return Err(RioError::Config(format!(
                "a {len}-byte write on target {} splits into {} pieces of {max} bytes; at most \
                 255",
                w.target,
                len.div_ceil(max)
            )));
        }
        let st = &self.streams[s];
        if st.open.len() >= MAX_GROUP_WRITES {
            return Err(RioError::Config(format!(
                "group {} of stream {stream} holds {} writes, the most one group may (its \
                 entries count them in 16 bits): end the group before this write",
                st.next_seq,
                st.open.len()
            )));
        }
        if let Some(o) = st.open.iter().find(|r| {
            r.w.target == w.target
                && r.w.offset < w.offset + len
                && w.offset < r.w.offset + r.w.buf.len() as u64
        }) {
            return Err(RioError::OverlapInGroup {
                stream,
                seq: st.next_seq,
                target: w.target,
                offset: w.offset.max(o.w.offset),
                end: (w.offset + len).min(o.w.offset + o.w.buf.len() as u64),
            });
        }
        self.stats.requests += 1;
        let st = &mut self.streams[s];
        let id = st.next_id;
        st.next_id += 1;
        if end_of_group && self.cfg.batch <= 1 && st.open.is_empty() && st.queued.is_empty() {
            // A group of one request with nothing queued before it (every write, at batch 1):
            // straight to the device.
            let seq = st.next_seq;
            st.next_seq += 1;
            if len <= max {
                // An error here: refused before it took its group (nothing to hand back, and
                // not a request taken).
                if let Err(e) = self.send_single(stream, seq, id, w) {
                    self.stats.requests -= 1;
                    return Err(e);
                }
                if self.log.deferred() {
                    self.retry_later(|d| d.submit_staged());
                }
                return Ok(id);
            }
            let st = &mut self.streams[s];
            st.groups.push(
                seq,
                Group {
                    first_id: id,
                    count: 1,
                    ..Group::default()
                },
            );
            if let Err(e) = self.send_req(stream, seq, Req { id, w }, Some(1)) {
                self.groups_unsent(stream, seq, seq, Vec::new(), &e);
            }
            self.retry_later(|d| d.submit_staged());
            return Ok(id);
        }
        st.open.push(Req { id, w });
        if end_of_group {
            self.close_group(stream);
            if self.streams[s].queued.len() >= self.cfg.batch {
                self.retry_later(|d| d.send_queued(stream));
            }
        }
        Ok(id)
    }

    fn stream_index(&self, stream: u16) -> Result<usize, RioError> {
        if stream as usize >= self.streams.len() {
            return Err(RioError::Config(format!(
                "stream {stream}: the device has {}",
                self.streams.len()
            )));
        }
        if self.streams[stream as usize].away {
            return Err(RioError::Config(format!(
                "stream {stream} lives on another ordered device (thread): attach its handoff here \
                 first"
            )));
        }
        Ok(stream as usize)
    }

    /// Whether `stream` lives on this device.
    pub fn has_stream(&self, stream: u16) -> bool {
        self.streams.get(stream as usize).is_some_and(|s| !s.away)
    }

    /// Stream stealing, the giving side: make everything `stream` wrote durable ([`wait`]),
    /// take its completions not yet handed back, and let it go. The returned handoff brings it
    /// to another device ([`OrderedDevice::attach`]), typically on another thread; its order
    /// goes on there unbroken. Recovery then reads both devices' logs as one
    /// ([`crate::LogScan::merge`]).
    ///
    /// [`wait`]: OrderedDevice::wait
    pub fn detach(&mut self, stream: u16) -> Result<(StreamHandoff, Vec<Done>), RioError> {
        let s = self.stream_index(stream)?;
        self.wait(stream)?;
        let st = &mut self.streams[s];
        if st.durable_below != st.next_seq || !st.open.is_empty() || !st.queued.is_empty() {
            return Err(RioError::Config(format!(
                "stream {stream}: groups {}..{} are not durable after wait; cannot move it",
                st.durable_below, st.next_seq
            )));
        }
        let done: Vec<Done> = std::mem::take(&mut st.ready);
        let prev: Vec<(u16, u64)> = st
            .prev
            .iter()
            .enumerate()
            .filter(|&(_, &g)| g != 0)
            .map(|(t, &g)| (t as u16, g))
            .collect();
        let handoff = StreamHandoff {
            stream,
            next_seq: st.next_seq,
            prev,
            next_id: st.next_id,
        };
        st.away = true;
        st.prev.clear();
        st.touched.clear();
        Ok((handoff, done))
    }

    /// Stream stealing, the taking side: the stream continues here from `h`. The device must
    /// not hold the stream already (created with `start[s] == 0`, or detached before).
    pub fn attach(&mut self, h: StreamHandoff) -> Result<(), RioError> {
        let s = h.stream as usize;
        let Some(st) = self.streams.get(s) else {
            return Err(RioError::Config(format!(
                "stream {}: the device has {}",
                h.stream,
                self.streams.len()
            )));
        };
        if !st.away {
            return Err(RioError::Config(format!(
                "stream {} already lives on this device",
                h.stream
            )));
        }
        if let Some(&(t, _)) = h
            .prev
            .iter()
            .find(|(t, _)| *t as usize >= self.targets.len())
        {
            return Err(RioError::Config(format!(
                "stream {}: the handoff names target {t}; this device has {} (both devices \
                 need the same targets)",
                h.stream,
                self.targets.len()
            )));
        }
        if !(1..=crate::attr::MAX_SEQ).contains(&h.next_seq) {
            return Err(RioError::Config(format!(
                "stream {}: the handoff's next group is group {}, outside 1..={}",
                h.stream,
                h.next_seq,
                crate::attr::MAX_SEQ
            )));
        }
        let mut prev = vec![0; self.targets.len()];
        for (t, g) in h.prev {
            prev[t as usize] = g;
        }
        self.streams[s] = Stream {
            next_seq: h.next_seq,
            next_id: h.next_id,
            bufs_base: h.next_id,
            done_below: h.next_seq,
            durable_below: h.next_seq,
            prev,
            away: false,
            ..Stream::default()
        };
        self.log.durable(h.stream, h.next_seq);
        Ok(())
    }

    /// Send every closed group held in the stream's ORDER queue (and the staged commands of
    /// every stream, whose entries need the log sync first).
    ///
    /// It answers for its own stream, as [`OrderedDevice::wait`] does: an error is returned when
    /// a group of this stream failed meanwhile (say its command could not be sent), or when
    /// groups or staged commands of this stream are still held behind it (a log sync that
    /// failed, or another stream's command that could not be sent ahead of them). Another
    /// stream's command that could not be sent, or a failed sync that held only other streams'
    /// commands, is those streams' failure: it comes back in their `Done`s and from their
    /// `wait` (or their next sync). Once a group of the stream has failed, the error is the
    /// lowest failed group's, as `wait`'s is.
    pub fn flush_queue(&mut self, stream: u16) -> Result<(), RioError> {
        let s = self.stream_index(stream)?;
        let failed = self.streams[s].failures.len();
        match self.send_queued(stream) {
            Err(e)
                if !self.streams[s].queued.is_empty()
                    || self.holds_staged(stream)
                    || self.streams[s].failures.len() > failed =>
            {
                Err(self.failure_or(stream, e))
            }
            _ => Ok(()),
        }
    }

    fn send_queued(&mut self, stream: u16) -> Result<(), RioError> {
        let s = stream as usize;
        if self.streams[s].queued.is_empty() {
            return self.submit_staged();
        }
        let mut queued = std::mem::take(&mut self.streams[s].queued);
        // The groups going out as one command (a list kept for its allocation).
        let mut run = std::mem::take(&mut self.run);
        while let Some(first) = queued.pop_front() {
            // Whole groups, each on one target and following the previous one's bytes, go out
            // as one command while they fit (in a merge and in one device command: a merged
            // command is never split).
            let target_max = self.targets[first.1[0].w.target as usize].max_transfer;
            let max = self.cfg.max_merge_bytes.min(target_max) as u64;
            run.clear();
            run.push(first);
            let first_mergeable =
                self.cfg.merge && mergeable(&run[0].1, None) && group_bytes(&run[0].1) <= max;
            if first_mergeable {
                let target = run[0].1[0].w.target;
                let mut bytes = group_bytes(&run[0].1);
                let mut end = group_end(&run[0].1);
                // The merged entry counts its requests in 16 bits, as a group's entry does.
                let mut members = run[0].1.len();
                while let Some(next) = queued.front() {
                    let nb = group_bytes(&next.1);
                    if next.1[0].w.target != target
                        || !mergeable(&next.1, Some(end))
                        || bytes + nb > max
                        || members + next.1.len() > MAX_GROUP_WRITES
                    {
                        break;
                    }
                    bytes += nb;
                    members += next.1.len();
                    end = group_end(&next.1);
                    run.push(queued.pop_front().expect("front"));
                }
            }
            let requests: usize = run.iter().map(|g| g.1.len()).sum();
            let mut copy = None;
            if first_mergeable && requests > 1 {
                let len: u64 = run.iter().map(|(_, rs)| group_bytes(rs)).sum();
                // No room for the copy: the groups go out as they would unmerged, in order.
                // (Failing them would fail the stream until recovery for want of a saving.)
                copy = self.alloc_copy(len as usize).ok();
                self.stats.merges_skipped += u64::from(copy.is_none());
            }
            let sent = if let Some(buf) = copy {
                self.send_merged(stream, &mut run, buf)
            } else {
                // One command per group (a run not merged is one group).
                let mut sent = Ok(());
                let mut each = run.drain(..);
                for (seq, reqs) in each.by_ref() {
                    sent = self.send_group(stream, seq, reqs);
                    if sent.is_err() {
                        break;
                    }
                }
                // Groups after a failed one were not touched: back to the queue's front.
                for g in each.rev() {
                    queued.push_front(g);
                }
                sent
            };
            if let Err(e) = sent {
                // These groups may be partly out: `send_merged` or `send_group` failed them,
                // and every later `wait` of the stream says so. The groups behind them were not
                // touched: they stay queued, in order.
                let st = &mut self.streams[s];
                queued.append(&mut st.queued);
                st.queued = queued;
                run.clear();
                self.run = run;
                return Err(e);
            }
        }
        self.run = run;
        // Keep the queue's allocation for the next groups.
        if self.streams[s].queued.is_empty() {
            self.streams[s].queued = queued;
        }
        self.submit_staged()
    }

    fn base_attr(&self, stream: u16, target: u16, seq: u64) -> Attr {
        Attr {
            stream,
            target,
            seq,
            seq_end: seq,
            prev: self.streams[stream as usize]
                .prev
                .get(target as usize)
                .copied()
                .unwrap_or(0),
            members: 1,
            ..Attr::default()
        }
    }

    /// Whole groups `gs` (all on one target, contiguous) as one command; their buffers are
    /// copied into one, `buf` (their total length), and go back with the completions.
    fn send_merged(
        &mut self,
        stream: u16,
        gs: &mut Vec<(u64, GroupReqs)>,
        mut buf: FixedBuf,
    ) -> Result<(), RioError> {
        let target = gs[0].1[0].w.target;
        let len: u64 = gs.iter().map(|(_, rs)| group_bytes(rs)).sum();
        let mut a = self.base_attr(stream, target, gs[0].0);
        a.seq_end = gs.last().expect("non-empty").0;
        a.offset = gs[0].1[0].w.offset;
        a.len = len as u32;
        a.merged = true;
        a.boundary = true;
        a.members = gs.iter().map(|(_, rs)| rs.len() as u16).sum();
        if gs.len() == 1 {
            a.num = a.members;
        }
        a.ipu = gs.iter().flat_map(|(_, rs)| rs).any(|r| r.w.ipu);
        let (first, last) = (a.seq, a.seq_end);
        debug_assert_eq!(buf.len() as u64, len, "the copy's length");
        let mut at = 0;
        let seqs: SmallVec<[u64; 8]> = gs.iter().map(|g| g.0).collect();
        let mut originals = self.spare_carried.pop().unwrap_or_default();
        for (_, mut rs) in gs.drain(..) {
            for r in rs.drain(..) {
                let n = r.w.buf.len();
                buf[at..at + n].copy_from_slice(&r.w.buf);
                at += n;
                originals.push((r.id, r.w.buf));
            }
            self.recycle_reqs(rs);
        }
        self.stats.merged_cmds += 1;
        let r = self.issue(stream, a, buf, Back::Merged, Some(originals), &seqs);
        if let Err(e) = &r {
            // The command's requests came back with it: what is left is marking its groups.
            self.groups_unsent(stream, first, last, Vec::new(), e);
        }
        r
    }

    fn send_group(&mut self, stream: u16, seq: u64, mut reqs: GroupReqs) -> Result<(), RioError> {
        let n = reqs.len() as u16;
        let last = reqs.len() - 1;
        let mut each = reqs.drain(..).enumerate();
        while let Some((k, r)) = each.next() {
            if let Err(e) = self.send_req(stream, seq, r, (k == last).then_some(n)) {
                // The requests after it never go out.
                let rest = each.map(|(_, r)| (seq, r)).collect();
                self.groups_unsent(stream, seq, seq, rest, &e);
                return Err(e);
            }
        }
        drop(each);
        self.recycle_reqs(reqs);
        Ok(())
    }

    /// Keep a spent request list's heap allocation (a group of several writes) for the next
    /// group, so that steady groups of a few writes each do not allocate.
    fn recycle_reqs(&mut self, mut reqs: GroupReqs) {
        if reqs.spilled() && self.spare_reqs.len() < self.spare_reqs.capacity() {
            reqs.clear();
            self.spare_reqs.push(reqs);
        }
    }

    /// The common case, kept lean: group `seq` of one request `id`, within the target's
    /// transfer limit, sent as one command (what [`OrderedDevice::send_req`] does for it, with
    /// the group registered here, already sent). An error means the write was not taken: its
    /// log entry failed, and its group and id are given back.
    #[inline]
    fn send_single(&mut self, stream: u16, seq: u64, id: u64, w: Write) -> Result<(), RioError> {
        let a = Attr {
            offset: w.offset,
            len: w.buf.len() as u32,
            ipu: w.ipu,
            boundary: true,
            num: 1,
            ..self.base_attr(stream, w.target, seq)
        };
        let slot = match self.append_entry(&a) {
            Ok(slot) => slot,
            Err(e) => {
                // Nothing of the write reached the log or the device, and nothing was submitted
                // since `submit` numbered it: give its group and id back, so that the next
                // write takes them and the stream's groups stay consecutive.
                let st = &mut self.streams[stream as usize];
                st.next_seq -= 1;
                st.next_id -= 1;
                return Err(e);
            }
        };
        let st = &mut self.streams[stream as usize];
        st.groups.push(
            seq,
            Group {
                first_id: id,
                count: 1,
                out: 1,
                not_durable: 1,
                sent: true,
                ..Group::default()
            },
        );
        st.sent_to(w.target, seq);
        let cmd = Cmd {
            seq,
            seq_end: seq,
            back: Back::Own(id),
            slot,
            stream,
            target: w.target,
        };
        if self.log.deferred() {
            self.staged.push((w.offset, w.buf, cmd, None));
        } else if self.submit_cmd(w.offset, w.buf, cmd, None).is_err() {
            // The write is taken now (its entry is logged): the refusal failed its group, whose
            // `Done` carries the error (see `retry_later`).
            self.stats.send_errors += 1;
        }
        Ok(())
    }

    /// Sending after [`OrderedDevice::submit`] took its write: an error here is not lost. A
    /// command refused on its way failed its groups (their [`Done`]s carry the error, and
    /// `wait` reports it); a failed log sync left its commands staged, and the next
    /// submission, `poll`, `wait_any`, `wait_progress` or `wait` retries it and reports what
    /// still fails.
    fn retry_later(&mut self, send: impl FnOnce(&mut Self) -> Result<(), RioError>) {
        if send(self).is_err() {
            self.stats.send_errors += 1;
        }
    }

    /// Persist `a` in the log, waiting for room when it is full.
    #[inline]
    fn append_entry(&mut self, a: &Attr) -> Result<Slot, RioError> {
        match self.log.append_quick(a) {
            Ok(Some(slot)) => Ok(slot),
            Ok(None) => self.append_entry_slow(a),
            Err(e) => Err(*e),
        }
    }

    /// [`OrderedDevice::append_entry`] when the quick way is barred: the log's own `append`
    /// (which moves the header's marks first, or says why it cannot), waiting for room while
    /// the log is full.
    #[cold]
    #[inline(never)]
    fn append_entry_slow(&mut self, a: &Attr) -> Result<Slot, RioError> {
        self.slot_for_log_write()?;
        match self.log.append(a) {
            Err(RioError::LogFull { .. }) => {}
            r => return r,
        }
        loop {
            self.stats.log_full_waits += 1;
            self.make_room()?;
            self.slot_for_log_write()?;
            match self.log.append(a) {
                Err(RioError::LogFull { .. }) => continue,
                r => return r,
            }
        }
    }

    /// Take completions until a request slot of the array is free, waiting for one while
    /// something of this device's is out (its requests hold their slots until taken, done or
    /// not). `false`: none is, and nothing here frees one (another user holds them); the
    /// submission that needed it then reports the full array.
    fn await_free_slot(&mut self) -> Result<bool, RioError> {
        while self.lbio.free_slots() == 0 {
            let before = self.reaped;
            self.reap();
            if self.reaped != before {
                continue;
            }
            if self.inflight_n == 0 && self.flushes_out == 0 && self.log_writes_out == 0 {
                return Ok(false);
            }
            self.lbio.wait_done(1)?;
            self.reap();
            if self.reaped == before {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A log writing through this device's own array ([`Pmr::async_array`]) writes its header,
    /// and `wait`'s sync, with a blocking request on the array: make a request slot free for it
    /// first. (Held by this device's own writes, every slot refused it, and the append failed
    /// its group for good.)
    fn slot_for_log_write(&mut self) -> Result<(), RioError> {
        if self.log_async {
            self.await_free_slot()?;
        }
        Ok(())
    }

    /// A buffer for a copy (a merged command, a piece of a split request): when the arena is
    /// out of room, completions waiting to be taken may hold some (a finished piece's copy is
    /// freed when it is taken), so take them before giving up.
    fn alloc_copy(&mut self, len: usize) -> Result<FixedBuf, RioError> {
        loop {
            match self.engine.alloc_blocking(len) {
                Ok(b) => return Ok(b),
                Err(e) => {
                    let before = self.reaped;
                    self.reap();
                    if self.reaped == before {
                        return Err(e.into());
                    }
                }
            }
        }
    }

    /// One request of group `seq`; `last: Some(n)` on the group's last request (of `n`). Above
    /// the target's transfer limit it goes out in pieces.
    fn send_req(
        &mut self,
        stream: u16,
        seq: u64,
        r: Req,
        last: Option<u16>,
    ) -> Result<(), RioError> {
        let mut a = self.base_attr(stream, r.w.target, seq);
        a.offset = r.w.offset;
        a.len = r.w.buf.len() as u32;
        a.ipu = r.w.ipu;
        if let Some(n) = last {
            a.boundary = true;
            a.num = n;
        }
        let max = self.targets[r.w.target as usize].piece as usize;
        let len = r.w.buf.len();
        if len <= max {
            // The caller's buffer goes to the device and comes back with the completion.
            return self.issue(stream, a, r.w.buf, Back::Own(r.id), None, &[seq]);
        }
        // At most 255 (`submit` refuses larger writes).
        let pieces = len.div_ceil(max);
        // Every piece is a copy; the caller's buffer waits here until the last one completes.
        let key = (stream, r.id);
        self.pieces_out.insert(key, (pieces as u32, r.w.buf));
        for p in 0..pieces {
            let from = p * max;
            let to = (from + max).min(len);
            let mut piece = match self.alloc_copy(to - from) {
                Ok(b) => b,
                Err(e) => {
                    // This piece and the ones after it never go out.
                    self.pieces_gone(stream, seq, r.id, (pieces - p) as u32);
                    return Err(e);
                }
            };
            piece.copy_from_slice(&self.pieces_out[&key].1[from..to]);
            let mut pa = a;
            pa.offset = r.w.offset + from as u64;
            pa.len = (to - from) as u32;
            pa.split = Some((p as u8, pieces as u8));
            self.stats.split_cmds += 1;
            if let Err(e) = self.issue(stream, pa, piece, Back::Piece(r.id), None, &[seq]) {
                // That piece is accounted for (`issue` gave it up); the ones after it never go
                // out.
                self.pieces_gone(stream, seq, r.id, (pieces - p - 1) as u32);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Take what has finished, without blocking; return the completions now in order (per
    /// stream: group order, then submission order within a group).
    ///
    /// Sending what waits (queued groups, staged commands) comes first. If that fails, what is
    /// ready is still handed back; the error comes back only when nothing is (the next call
    /// retries).
    pub fn poll(&mut self) -> Result<Vec<Done>, RioError> {
        let mut out = Vec::new();
        self.poll_into(&mut out)?;
        Ok(out)
    }

    /// [`OrderedDevice::poll`], appending to `out` (no allocation once `out` has room).
    pub fn poll_into(&mut self, out: &mut Vec<Done>) -> Result<(), RioError> {
        let mut sent = self.send_waiting();
        for stream in 0..self.streams.len() as u16 {
            if sent.is_ok() && !self.streams[stream as usize].queued.is_empty() {
                sent = self.send_queued(stream);
            }
        }
        self.engine.poll_completions()?;
        self.reap();
        let had = out.len();
        self.move_ready(out);
        match sent {
            Err(e) if out.len() == had => Err(e),
            _ if out.len() == had => self.log_failure_answer(),
            _ => Ok(()),
        }
    }

    /// A failed asynchronous log sync, as the answer of a call that hands back nothing (taken:
    /// the next call retries the sync).
    fn log_failure_answer(&mut self) -> Result<(), RioError> {
        match self.log_failure.take() {
            Some(why) => Err(RioError::Config(format!("attribute log write: {why}"))),
            None => Ok(()),
        }
    }

    /// Retry staged commands (a log sync that failed, or waits): nothing to do when none are.
    #[inline]
    fn send_waiting(&mut self) -> Result<(), RioError> {
        if self.staged.is_empty() {
            Ok(())
        } else {
            self.submit_staged()
        }
    }

    /// Block until some completion is in order to hand back (or nothing is in flight), then
    /// return what is ready.
    pub fn wait_any(&mut self) -> Result<Vec<Done>, RioError> {
        loop {
            let sent = self.send_waiting();
            self.reap();
            if self.streams.iter().any(|s| !s.ready.is_empty()) {
                return Ok(self.take_ready());
            }
            // Nothing to hand back: a staged command that cannot go out is the answer.
            sent?;
            self.log_failure_answer()?;
            if self.inflight_n == 0 && self.log_writes_out == 0 {
                return Ok(self.take_ready());
            }
            self.lbio.wait_done(1)?;
        }
    }

    /// Block until at least one command finishes on the device (or none is in flight), then
    /// return what is ready in order (possibly nothing: the oldest write may still be out).
    /// For callers that keep the device busy: refill on any finished command, not only on
    /// in-order completions.
    pub fn wait_progress(&mut self) -> Result<Vec<Done>, RioError> {
        let mut out = Vec::new();
        self.wait_progress_into(&mut out)?;
        Ok(out)
    }

    /// [`OrderedDevice::wait_progress`], appending to `out` (no allocation once `out` has
    /// room).
    pub fn wait_progress_into(&mut self, out: &mut Vec<Done>) -> Result<(), RioError> {
        let sent = self.send_waiting();
        let before = self.reaped;
        self.reap();
        if self.reaped == before && (self.inflight_n > 0 || self.log_writes_out > 0) {
            self.lbio.wait_done(1)?;
            self.reap();
        }
        let had = out.len();
        self.move_ready(out);
        // A staged command that cannot go out is the answer only when nothing was handed back.
        match sent {
            Err(e) if out.len() == had && self.reaped == before => Err(e),
            _ if out.len() == had => self.log_failure_answer(),
            _ => Ok(()),
        }
    }

    /// Move every stream's in-order completions to `out`.
    fn move_ready(&mut self, out: &mut Vec<Done>) {
        for s in &mut self.streams {
            if out.is_empty() {
                // The usual case: hand the whole vector over, no copy (the caller's empty
                // vector, with its room, serves the stream next).
                std::mem::swap(out, &mut s.ready);
            } else {
                out.append(&mut s.ready);
            }
        }
    }

    /// Device commands in flight, and (asynchronous block log) those whose data waits for its
    /// log write.
    pub fn in_flight(&self) -> usize {
        self.inflight_n + self.staged.len() + self.log_batch.len()
    }

    fn take_ready(&mut self) -> Vec<Done> {
        let mut out = Vec::new();
        self.move_ready(&mut out);
        out
    }

    /// Make everything submitted on `stream` durable: close its open group, send its queue,
    /// wait for its writes, and on every target it wrote without power-loss protection log a
    /// FLUSH entry, FLUSH, and persist the entry. On `Ok`, every write of the stream survives a
    /// crash (recovery keeps it). Completions stay ready for [`OrderedDevice::poll`].
    ///
    /// A failed group is final: once one of the stream's groups has failed, this and every
    /// later `wait` fail with the failure of its lowest failed group (named in the error: the
    /// stream is durable at most up to the group before it), whichever group failed first.
    pub fn wait(&mut self, stream: u16) -> Result<(), RioError> {
        let s = self.stream_index(stream)?;
        if !self.streams[s].open.is_empty() {
            self.close_group(stream);
        }
        if let Err(e) = self.send_queued(stream) {
            // A group of this stream that could not be sent failed (every `wait` reports it);
            // the groups behind it, or this stream's commands staged behind another stream's
            // that could not be sent, are still waiting: this call cannot answer for them. A
            // failure of another stream's command alone is that stream's.
            if !self.streams[s].queued.is_empty() || self.holds_staged(stream) {
                return Err(self.failure_or(stream, e));
            }
        }
        // The stream's writes, and any background FLUSH (it may cover some of them: once it is
        // in, every group of the stream is durable after the FLUSH below).
        // An asynchronous log: its writes (the blocking sync below may not overtake them), and
        // the data they hold back. A failed log write that held this stream's commands is this
        // stream's answer (the next call retries it); one that held only other streams'
        // commands is theirs, and is not retried from here (with a log that keeps failing,
        // that would never end): the sync below writes their entries, and their data goes out
        // from the next call that sends.
        loop {
            if let Some(why) = self.streams[s].log_failed.take() {
                let e = RioError::Config(format!(
                    "stream {stream}: the attribute log write of its entries failed (they are \
                     written again at the next sync): {why}"
                ));
                return Err(self.failure_or(stream, e));
            }
            if self.holds_staged(stream) {
                // A log that cannot take this stream's entries, or a command of another stream
                // that could not be sent ahead of them, is this stream's answer while they stay
                // behind. (On `Ok` they are out: on the device, or in a log write being waited
                // for.) Another stream's command that failed with them sent is that stream's
                // failure alone.
                if let Err(e) = self.submit_staged() {
                    if self.holds_staged(stream) {
                        return Err(self.failure_or(stream, e));
                    }
                }
            }
            if self.flushes_out == 0
                && self.log_writes_out == 0
                && !self.holds_staged(stream)
                && !self.inflight.iter().flatten().any(|c| c.stream == stream)
            {
                break;
            }
            self.lbio.wait_done(1)?;
            self.reap();
        }
        let last = self.streams[s].next_seq - 1;
        if last == 0 {
            return Ok(());
        }
        // The FLUSH entry vouches, in the log, for every group of the stream up to its own,
        // never for a failed one nor any after it (`vouch_cap`).
        let marker = Some((stream, last));
        let mut owed = std::mem::take(&mut self.streams[s].touched);
        for (k, &t) in owed.iter().enumerate() {
            if let Err(e) = self.flush_target(t, marker) {
                // This target's FLUSH and the ones after it are still owed: the next `wait`
                // sends them (its commands went back to the target's list, or were failed).
                let st = &mut self.streams[s];
                for &u in &owed[k..] {
                    if !st.touched.contains(&u) {
                        st.touched.push(u);
                    }
                }
                return Err(self.failure_or(stream, e));
            }
        }
        // The list's allocation goes back to the stream (with anything touched meanwhile).
        let st = &mut self.streams[s];
        owed.clear();
        owed.append(&mut st.touched);
        st.touched = owed;
        // A background FLUSH sent meanwhile (from a completion taken above) may cover groups of
        // this stream: if it fails, they fail, and this answer must say so.
        // Errors from here on (the engine's, the log's) give way to a failed group's too.
        while self.flushes_out > 0 {
            if let Err(e) = self.lbio.wait_done(1) {
                return Err(self.failure_or(stream, e.into()));
            }
            self.reap();
        }
        // A deferred log: the persist words (and FLUSH entries) set above become durable now.
        if let Err(e) = self.slot_for_log_write().and_then(|()| self.log.sync()) {
            return Err(self.failure_or(stream, e));
        }
        // A failed group is final: the lowest one's failure is the answer (not the first one
        // recorded: groups may fail out of order, say a later one that could not be sent before
        // an earlier one failed on the device).
        match self.stream_failure(stream) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn close_group(&mut self, stream: u16) {
        let spare = self.spare_reqs.pop().unwrap_or_default();
        let st = &mut self.streams[stream as usize];
        let seq = st.next_seq;
        st.next_seq += 1;
        let reqs = std::mem::replace(&mut st.open, spare);
        st.groups.push(
            seq,
            Group {
                first_id: reqs.first().map_or(0, |r| r.id),
                count: reqs.len() as u32,
                ..Group::default()
            },
        );
        st.queued.push_back((seq, reqs));
    }

    /// Persist `a` in the log (waiting for room), then send the data.
    fn issue(
        &mut self,
        stream: u16,
        a: Attr,
        buf: FixedBuf,
        back: Back,
        merged: Option<Carried>,
        seqs: &[u64],
    ) -> Result<(), RioError> {
        let slot = match self.append_entry(&a) {
            Ok(slot) => slot,
            Err(e) => {
                let cmd = (stream, a.seq, a.seq_end, back);
                self.cmd_unsent(cmd, Some(buf), merged, false, &e);
                return Err(e);
            }
        };
        let st = &mut self.streams[stream as usize];
        for &g in seqs {
            let grp = st.groups.get_mut(g).expect("group registered at close");
            grp.out += 1;
            grp.not_durable += 1;
        }
        st.sent_to(a.target, a.seq_end);
        // A group is fully sent once its last command is out.
        let last_of_group = a.boundary && a.split.is_none_or(|(i, n)| i + 1 == n);
        if last_of_group {
            for &g in seqs {
                st.groups.get_mut(g).expect("group").sent = true;
            }
        }
        let cmd = Cmd {
            seq: a.seq,
            seq_end: a.seq_end,
            back,
            slot,
            stream,
            target: a.target,
        };
        if self.log.deferred() {
            // The entry is durable only at the next log sync: the data waits for it.
            self.staged.push((a.offset, buf, cmd, merged));
            Ok(())
        } else {
            self.submit_cmd(a.offset, buf, cmd, merged)
        }
    }

    /// Send a command to its target. Submission order is the storage order, yet two writes on
    /// the device at once complete, and land, in either order: a command over bytes that an
    /// earlier one still on the device writes waits for it to complete first (the completions
    /// taken meanwhile are accounted for as usual; none of them sends a data command).
    #[inline]
    fn submit_cmd(
        &mut self,
        offset: u64,
        buf: FixedBuf,
        cmd: Cmd,
        merged: Option<Carried>,
    ) -> Result<(), RioError> {
        let end = offset + buf.len() as u64;
        if self.overlaps_in_flight(cmd.target, offset, end) {
            self.stats.overlap_waits += 1;
            while self.overlaps_in_flight(cmd.target, offset, end) {
                let before = self.reaped;
                self.reap();
                if self.reaped == before {
                    if let Err(e) = self.lbio.wait_done(1) {
                        let e: RioError = e.into();
                        let c = (cmd.stream, cmd.seq, cmd.seq_end, cmd.back);
                        self.cmd_unsent(c, Some(buf), merged, true, &e);
                        return Err(e);
                    }
                    self.reap();
                }
            }
        }
        let target = cmd.target;
        let tag = match self.targets[cmd.target as usize]
            .dev
            .submit(Io::write(offset, buf))
        {
            Ok(tag) => tag,
            Err((e, buf)) => match self.submit_cmd_after(e, buf, offset, cmd.target) {
                Ok(tag) => tag,
                Err((e, buf)) => {
                    let c = (cmd.stream, cmd.seq, cmd.seq_end, cmd.back);
                    self.cmd_unsent(c, buf, merged, true, &e);
                    return Err(e);
                }
            },
        };
        self.stats.device_cmds += 1;
        let at = tag.0 as usize;
        if self.inflight.len() <= at {
            self.inflight.resize_with(at + 1, || None);
        }
        self.inflight_n += 1;
        self.inflight[at] = Some(cmd);
        self.spans.push(Span {
            start: offset,
            end,
            target,
            tag: tag.0,
        });
        if let Some(mut reqs) = merged {
            if self.merged.len() <= at {
                self.merged.resize_with(at + 1, Carried::new);
            }
            // The slot's empty list (and its allocation) goes to the spares.
            std::mem::swap(&mut self.merged[at], &mut reqs);
            if reqs.spilled() && self.spare_carried.len() < self.spare_carried.capacity() {
                self.spare_carried.push(reqs);
            }
        }
        Ok(())
    }

    /// Whether a command on the device writes any of `start..end` of `target`.
    #[inline]
    fn overlaps_in_flight(&self, target: u16, start: u64, end: u64) -> bool {
        self.spans
            .iter()
            .any(|s| s.target == target && s.start < end && start < s.end)
    }

    /// [`OrderedDevice::submit_cmd`] when lbio refused the command: on a full slot array, take
    /// the completions waiting (every detached one on the array is this device's), or wait for
    /// one while something of this device's is out, and submit again. Any other error, or a
    /// full array with nothing of this device's out to free a slot, is the caller's, with the
    /// buffer back.
    #[cold]
    #[inline(never)]
    fn submit_cmd_after(
        &mut self,
        mut e: lbio::LbioError,
        mut buf: Option<FixedBuf>,
        offset: u64,
        target: u16,
    ) -> Result<lbio::Tag, (RioError, Option<FixedBuf>)> {
        let refused =
            |e: &lbio::LbioError| RioError::Config(format!("submitting to target {target}: {e}"));
        loop {
            let b = match buf.take() {
                Some(b) if e.is_would_block() => b,
                b => return Err((refused(&e), b)),
            };
            let before = self.reaped;
            self.reap();
            if self.reaped == before {
                if self.inflight_n == 0 && self.flushes_out == 0 {
                    return Err((refused(&e), Some(b)));
                }
                if let Err(e) = self.lbio.wait_done(1) {
                    return Err((e.into(), Some(b)));
                }
                self.reap();
            }
            match self.targets[target as usize]
                .dev
                .submit(Io::write(offset, b))
            {
                Ok(tag) => return Ok(tag),
                Err((e2, b2)) => (e, buf) = (e2, b2),
            }
        }
    }

    /// A command that never reached the device: its log entry or its submission failed with
    /// `e`. Its groups fail (every later `wait` of the stream says so, and the durability mark
    /// stops at them), and the caller's buffers it carries finish, to be handed back with the
    /// failure in their groups' turn. `cmd`: (stream, first group, last group, what it
    /// carries); `buf`: the command's data; `merged`: a merged command's requests; `counted`:
    /// the groups count it as out (it was logged).
    #[cold]
    #[inline(never)]
    fn cmd_unsent(
        &mut self,
        cmd: (u16, u64, u64, Back),
        buf: Option<FixedBuf>,
        merged: Option<Carried>,
        counted: bool,
        e: &RioError,
    ) {
        let (stream, seq, seq_end, back) = cmd;
        let why = format!("sending it: {e}");
        let st = &mut self.streams[stream as usize];
        for g in seq..=seq_end {
            if counted {
                if let Some(grp) = st.groups.get_mut(g) {
                    grp.out -= 1;
                }
            }
            st.fail(g, &why);
        }
        match back {
            Back::Own(id) => {
                if let Some(b) = buf {
                    st.finish(seq, id, b);
                }
            }
            // The piece's data is a copy: the caller's buffer waits for the other pieces.
            Back::Piece(id) => self.pieces_gone(stream, seq, id, 1),
            Back::Merged => st.finish_merged(seq, seq_end, &mut merged.unwrap_or_default()),
        }
        self.advance(stream);
    }

    /// `n` pieces of split request `id` (group `seq`) will never complete: once no piece is out,
    /// the caller's buffer finishes (the caller fails the group).
    #[cold]
    fn pieces_gone(&mut self, stream: u16, seq: u64, id: u64, n: u32) {
        let key = (stream, id);
        let Some(left) = self.pieces_out.get_mut(&key).map(|p| &mut p.0) else {
            return;
        };
        *left -= n;
        if *left == 0 {
            let (_, buf) = self.pieces_out.remove(&key).expect("split request");
            self.streams[stream as usize].finish(seq, id, buf);
        }
        self.advance(stream);
    }

    /// Groups `first..=last` failed to go out with `e`: nothing more of them will be sent. They
    /// fail, count as sent, and `rest`, their requests that never went out, finish (their
    /// buffers are handed back with the failure in order).
    #[cold]
    #[inline(never)]
    fn groups_unsent(
        &mut self,
        stream: u16,
        first: u64,
        last: u64,
        rest: Vec<(u64, Req)>,
        e: &RioError,
    ) {
        let why = format!("sending it: {e}");
        let st = &mut self.streams[stream as usize];
        for g in first..=last {
            st.fail(g, &why);
            if let Some(grp) = st.groups.get_mut(g) {
                grp.sent = true;
            }
        }
        for (g, r) in rest {
            st.finish(g, r.id, r.w.buf);
        }
        self.advance(stream);
    }

    /// A deferred log: write the staged entries (one sync), then send their data.
    fn submit_staged(&mut self) -> Result<(), RioError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        if self.log_async {
            if self.log_writes_out > 0 {
                // They go out with the next sync, which the current one's completion starts;
                // meanwhile more join them (one log write for all).
                return Ok(());
            }
            // The log's writes take request slots on this array: wait for completions to free
            // them (back-pressure, as for data).
            while (self.lbio.free_slots() as usize) < crate::pmr::ASYNC_SYNC_WRITES
                && self.inflight_n > 0
            {
                self.lbio.wait_done(1)?;
                self.reap();
            }
            let t = std::time::Instant::now();
            let started = self.log.sync_start();
            // On an error, the writes that went out before it still come back.
            let out = match &started {
                Ok(n) => *n,
                Err(_) => self.log.sync_writes_out(),
            };
            if out > 0 {
                self.log_writes_out = out;
                self.log_sync_t0 = Some(t);
                std::mem::swap(&mut self.log_batch, &mut self.staged);
            }
            return match started {
                Err(e) => {
                    if out > 0 {
                        // The batch goes back to the staged commands once they are in.
                        self.log_sync_failed = Some(e.to_string());
                    }
                    Err(e)
                }
                Ok(_) => {
                    self.stats.log_syncs += 1;
                    if out > 0 {
                        Ok(())
                    } else {
                        // Their entries were on the device already.
                        self.send_staged()
                    }
                }
            };
        }
        let t = std::time::Instant::now();
        self.log.sync()?;
        self.stats.log_syncs += 1;
        self.stats.log_sync_ns += t.elapsed().as_nanos() as u64;
        self.send_staged()
    }

    /// Send the staged commands (their entries are durable). A command that cannot be sent
    /// stops it with an error; the ones after it stay staged. (That command failed its groups:
    /// their [`Done`]s carry the error, and their stream's `wait` reports it.)
    fn send_staged(&mut self) -> Result<(), RioError> {
        let staged = std::mem::take(&mut self.staged);
        let mut rest = staged.into_iter();
        let mut r = Ok(());
        for (offset, buf, cmd, merged) in rest.by_ref() {
            r = self.submit_cmd(offset, buf, cmd, merged);
            if r.is_err() {
                break;
            }
        }
        self.staged.extend(rest);
        r
    }

    /// The log is full: wait for completions and, on targets without power-loss protection,
    /// FLUSH, so that durable groups free their slots.
    ///
    /// The staged commands go out first (their data after their entries' sync, as always). One
    /// that lbio refuses failed its own groups (their [`Done`]s carry the error, and their
    /// stream's `wait` reports it), and a sync that failed left its commands staged for the
    /// next call; either may be another stream's. Like a failed log write or FLUSH below, it is
    /// the answer only to a caller that then finds no room.
    fn make_room(&mut self) -> Result<(), RioError> {
        let before = self.log.has_room();
        if before {
            return Ok(());
        }
        let sent = self.submit_staged();
        if sent.is_err() {
            self.stats.send_errors += 1;
        }
        let drained = self.drain_all()?;
        let flushed = self.flush_all_for_room();
        if !self.log.has_room() {
            // A staged command that could not be sent (it failed its groups) or a sync that
            // failed (its commands are still staged), a log write that failed meanwhile (its
            // entries, and maybe the oldest, wait for the next sync), or a FLUSH that failed (it
            // failed the groups it covered, and their streams' `wait` says so), is why.
            sent?;
            drained?;
            flushed?;
            // A failed group never becomes durable, so its entry (and every one after it) stays
            // live: the log cannot turn over until recovery.
            // The oldest live entry (at the tail) belongs to the stream whose durability mark
            // holds the log; its lowest failed group is what stops that mark.
            let holder = self.log.debug_tail().1.map(|(stream, _)| stream as usize);
            if let Some((stream, (g, why))) =
                holder.and_then(|i| self.streams[i].lowest_failure().map(|f| (i, f)))
            {
                return Err(RioError::Config(format!(
                    "the attribute log ({} slots) is held by writes that can never become \
                     durable: group {g} of stream {stream} failed ({why}); recover the device \
                     (reopen it and run recovery) before writing more",
                    self.log.slots()
                )));
            }
            return Err(RioError::Config(format!(
                "the attribute log ({} slots) cannot hold one group's entries: give it more room",
                self.log.slots()
            )));
        }
        Ok(())
    }

    /// FLUSH every target for room in a full log. A FLUSH that fails fails the groups it covered
    /// (their streams' `wait` reports it) and does not stop the others: it is the answer (the
    /// first one) only to a caller that then finds no room. Room made by the other targets'
    /// FLUSHes serves the caller, whose writes may not even be on the failed target.
    fn flush_all_for_room(&mut self) -> Result<(), RioError> {
        let mut first = Ok(());
        for t in 0..self.targets.len() as u16 {
            if let Err(e) = self.flush_target(t, None) {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// Wait for every command and background FLUSH in flight to complete (for room in a full
    /// log). An asynchronous log write that fails meanwhile is not retried (a log that keeps
    /// failing would hold it for ever; its commands stay staged for the next call), and the
    /// rest is still waited for: the failure is the inner `Err`, for a caller that then finds
    /// no room. (It is the failure of the streams whose commands the write held: a caller that
    /// finds room from the rest does not fail for it, nor does the group it appends for.)
    /// Likewise a staged command that cannot be sent (it failed its own groups, and the ones
    /// staged behind it go out at the next try) or a sync that cannot be done (its commands
    /// stay staged): the first such error is the inner `Err` when no log write failed.
    fn drain_all(&mut self) -> Result<Result<(), RioError>, RioError> {
        let failures = self.log_write_failures;
        let mut unsent = Ok(());
        loop {
            if self.log_write_failures == failures {
                if let Err(e) = self.submit_staged() {
                    self.stats.send_errors += 1;
                    if unsent.is_ok() {
                        unsent = Err(e);
                    }
                }
            }
            if self.inflight_n == 0 && self.flushes_out == 0 && self.log_writes_out == 0 {
                break;
            }
            self.lbio.wait_done(1)?;
            self.reap();
        }
        if self.log_write_failures == failures {
            return Ok(unsent);
        }
        let why = self.log_failure.clone().unwrap_or_default();
        Ok(Err(RioError::Config(format!("attribute log write: {why}"))))
    }

    /// The failure of `stream`'s lowest failed group, as `wait` and `flush_queue` report it
    /// (`None`: no group of the stream failed). A failed group is final, and it bounds what of
    /// the stream can be durable (groups below it may be; none from it on ever is): once one
    /// has failed, every error these calls return is this one, whichever failure was recorded
    /// first (groups may fail out of order: a later one on the device, or one that could not
    /// be sent, before an earlier one) and whatever else went wrong in the call.
    fn stream_failure(&self, stream: u16) -> Option<RioError> {
        let (g, why) = self.streams[stream as usize].lowest_failure()?;
        Some(RioError::Config(format!(
            "stream {stream}: a write failed: group {g}: {why}"
        )))
    }

    /// `e`, unless a group of `stream` has failed: then that failure ([`Self::stream_failure`]).
    fn failure_or(&self, stream: u16, e: RioError) -> RioError {
        self.stream_failure(stream).unwrap_or(e)
    }

    /// Whether commands of `stream` wait for a log sync (staged, or in the one out).
    fn holds_staged(&self, stream: u16) -> bool {
        self.staged
            .iter()
            .chain(&self.log_batch)
            .any(|(_, _, c, _)| c.stream == stream)
    }

    /// Take finished commands: set persist words (power-loss-protected targets), account
    /// groups, hand back what is now in order.
    ///
    /// Nothing here fails the caller: what goes wrong with a command is its own groups' failure
    /// (their [`Done`]s carry it, and their stream's `wait` reports it), and a failed log write
    /// is reported to the streams whose commands it held (see
    /// [`OrderedDevice::log_write_done`]). Whichever call happens to take a completion is not
    /// the one it concerns.
    fn reap(&mut self) {
        while let Some(c) = self.lbio.take_done() {
            self.reaped += 1;
            self.account(c);
        }
    }

    /// One finished command. Taken from lbio, its tag may be reused at once, so it is accounted
    /// for here and now.
    fn account(&mut self, c: lbio::Completion) {
        if self.flushes_out > 0 && self.background_flush_done(&c) {
            return;
        }
        if self.log_writes_out > 0 && self.log.sync_owns(c.tag) {
            self.log_write_done(c);
            return;
        }
        {
            let Some(cmd) = self
                .inflight
                .get_mut(c.tag.0 as usize)
                .and_then(Option::take)
            else {
                return;
            };
            self.inflight_n -= 1;
            if let Some(i) = self.spans.iter().position(|s| s.tag == c.tag.0) {
                self.spans.swap_remove(i);
            }
            if let (Ok(_), Back::Own(id), true) = (&c.result, &cmd.back, cmd.seq == cmd.seq_end) {
                if !self.targets[cmd.target as usize].plp {
                    let buf = c.buf.expect("a write returns its buffer");
                    self.own_done(&cmd, *id, buf);
                    return;
                }
            }
            let mut failed = c.result.as_ref().err().map(|e| e.to_string());
            let plp = self.targets[cmd.target as usize].plp;
            if plp && failed.is_none() {
                if let Err(e) = self.log.set_persist(cmd.slot, cmd.seq) {
                    // Nothing in the log vouches for the data: the command fails (its groups
                    // never count as durable), and is accounted for like any other.
                    failed = Some(format!("persisting its entry: {e}"));
                }
            } else if failed.is_none() {
                let t = &mut self.targets[cmd.target as usize];
                t.volatile.push(cmd.stream, cmd.seq, cmd.seq_end);
                if t.volatile.cmds >= self.flush_ahead
                    && self.flush_ahead > 0
                    && t.flushing.is_none()
                {
                    self.start_flush(cmd.target);
                }
            }
            let st = &mut self.streams[cmd.stream as usize];
            if cmd.seq == cmd.seq_end && failed.is_none() {
                // One group (every unmerged command): no range to walk.
                if let Some(grp) = st.groups.get_mut(cmd.seq) {
                    grp.out -= 1;
                    grp.not_durable -= plp as u32;
                }
            } else {
                for g in cmd.seq..=cmd.seq_end {
                    if let Some(grp) = st.groups.get_mut(g) {
                        grp.out -= 1;
                        if plp && failed.is_none() {
                            grp.not_durable -= 1;
                        }
                    }
                    if let Some(f) = &failed {
                        st.fail(g, f);
                    }
                }
            }
            // What the command hands back: its requests' buffers.
            match cmd.back {
                Back::Own(id) => {
                    let mut buf = c.buf.expect("a write returns its buffer");
                    if failed.is_none() {
                        match st.hand_back_alone(cmd.stream, cmd.seq, id, buf) {
                            None => {
                                // With power-loss protection the group is durable now.
                                if plp {
                                    self.advance_durable(cmd.stream);
                                }
                                return;
                            }
                            Some(b) => buf = b,
                        }
                    }
                    st.finish(cmd.seq, id, buf);
                }
                // A split request is finished when its last piece is (the piece's own buffer,
                // a copy, goes back to the arena here).
                Back::Piece(id) => {
                    let key = (cmd.stream, id);
                    let left = &mut self.pieces_out.get_mut(&key).expect("split request").0;
                    *left -= 1;
                    if *left == 0 {
                        let (_, buf) = self.pieces_out.remove(&key).expect("split request");
                        st.finish(cmd.seq, id, buf);
                    }
                }
                Back::Merged => {
                    // Emptied where it lies: the slot keeps the list's allocation.
                    st.finish_merged(cmd.seq, cmd.seq_end, &mut self.merged[c.tag.0 as usize]);
                }
            }
            self.advance(cmd.stream);
        }
    }

    /// The common completion, kept lean: a command of one group and one request, its own
    /// buffer, completed without error on a target without power-loss protection (what every
    /// unmerged write is there). What [`OrderedDevice::account`] does for any command, for this
    /// one: recorded as volatile (a background FLUSH once enough are), its group's count of
    /// commands out lowered, and handed back at once when it is the oldest one waiting.
    #[inline]
    fn own_done(&mut self, cmd: &Cmd, id: u64, buf: FixedBuf) {
        let t = &mut self.targets[cmd.target as usize];
        t.volatile.push(cmd.stream, cmd.seq, cmd.seq_end);
        if self.flush_ahead > 0 && t.volatile.cmds >= self.flush_ahead && t.flushing.is_none() {
            self.start_flush(cmd.target);
        }
        let st = &mut self.streams[cmd.stream as usize];
        if let Some(grp) = st.groups.get_mut(cmd.seq) {
            grp.out -= 1;
        }
        // (The group is not durable before a FLUSH covers it, and every group before it that
        // is durable was counted off when it became so: the durability mark cannot move here.)
        if let Some(buf) = st.hand_back_alone(cmd.stream, cmd.seq, id, buf) {
            st.finish(cmd.seq, id, buf);
            self.advance(cmd.stream);
        }
    }

    /// An asynchronous log write completed: once all of the sync's are in, its batch's data
    /// goes to the device and the next sync starts. A failed sync puts its batch back in front
    /// of the staged commands (its blocks are staged again); the next sync tries again. The
    /// failure is not the error of whichever call took this completion: each stream whose
    /// commands the batch held has its next `wait` report it, and `poll`, `wait_any` and
    /// `wait_progress` report it when they have nothing to hand back.
    fn log_write_done(&mut self, c: lbio::Completion) {
        self.log_writes_out -= 1;
        let r = self.log.sync_done(c);
        if let Err(e) = r {
            self.log_sync_failed = Some(e.to_string());
        }
        if self.log_writes_out > 0 {
            return;
        }
        if let Some(t0) = self.log_sync_t0.take() {
            self.stats.log_sync_ns += t0.elapsed().as_nanos() as u64;
        }
        if let Some(why) = self.log_sync_failed.take() {
            self.stats.send_errors += 1;
            self.log_write_failures += 1;
            for (_, _, cmd, _) in &self.log_batch {
                let st = &mut self.streams[cmd.stream as usize];
                if st.log_failed.is_none() {
                    st.log_failed = Some(why.clone());
                }
            }
            self.log_failure = Some(why);
            let mut batch = std::mem::take(&mut self.log_batch);
            batch.append(&mut self.staged);
            self.staged = batch;
            return;
        }
        self.log_failure = None;
        // A failed sync's batch goes out again with the next one: when that one succeeds, the
        // streams it held have their entries durable after all, and their next `wait` has no
        // failure to report (it would fail an fsync whose writes are safe).
        for (_, _, cmd, _) in &self.log_batch {
            self.streams[cmd.stream as usize].log_failed = None;
        }
        // The batch first, in order; then what was staged meanwhile (behind it: the order
        // holds).
        let meanwhile = std::mem::take(&mut self.staged);
        self.staged = std::mem::take(&mut self.log_batch);
        let sent = self.send_staged();
        self.staged.extend(meanwhile);
        // A command that could not be sent failed its groups, and what is left stays staged; a
        // sync that cannot start leaves its commands staged too. The next call retries them.
        if sent.is_err() {
            self.stats.send_errors += 1;
        } else {
            self.retry_later(|d| d.submit_staged());
        }
    }

    /// Hand back groups in order, and move the durability mark.
    fn advance(&mut self, stream: u16) {
        let st = &mut self.streams[stream as usize];
        while let Some(grp) = st.groups.get(st.done_below) {
            if !grp.sent || grp.out > 0 || grp.finished < grp.count {
                break;
            }
            let seq = st.done_below;
            let result = if grp.failed {
                Err(st.failure(seq))
            } else {
                Ok(())
            };
            // Submission order within the group: the ids follow each other, and the buffers
            // wait by id.
            for id in grp.first_id..grp.first_id + grp.count as u64 {
                debug_assert_eq!(id, st.bufs_base, "groups hand back in id order");
                let buf = st
                    .bufs
                    .pop_front()
                    .flatten()
                    .expect("a finished request's buffer");
                st.bufs_base += 1;
                st.ready.push(Done {
                    stream,
                    seq,
                    id,
                    result: result.clone(),
                    buf,
                });
            }
            st.done_below += 1;
        }
        self.advance_durable(stream);
    }

    /// Move the stream's durability mark over the groups handed back and durable (in order);
    /// the log may reuse their slots.
    fn advance_durable(&mut self, stream: u16) {
        let st = &mut self.streams[stream as usize];
        // Groups handed back (below `done_below`) whose commands are all sent and durable, from
        // the oldest kept (the groups kept start at the durability mark).
        let handed_back = if st.groups.base == st.durable_below {
            st.done_below.saturating_sub(st.durable_below) as usize
        } else {
            debug_assert!(
                st.groups.q.is_empty(),
                "groups are kept from the durability mark"
            );
            0
        };
        let n = st
            .groups
            .q
            .iter()
            .take(handed_back)
            .take_while(|grp| grp.sent && grp.not_durable == 0 && !grp.failed)
            .count();
        if n > 0 {
            st.groups.pop_n(n);
            st.durable_below += n as u64;
        }
        self.log.durable(stream, st.durable_below);
    }

    /// FLUSH target `t`: every command completed on it becomes durable. With `marker`
    /// `(stream, seq)`, a FLUSH entry of that stream is logged first and persisted after.
    fn flush_target(&mut self, t: u16, marker: Option<(u16, u64)>) -> Result<(), RioError> {
        if self.targets[t as usize].plp {
            return Ok(());
        }
        // A background FLUSH still out on this target is taken first: were it to fail after
        // this FLUSH completed (two FLUSHes on one device may complete in either order), the
        // entry below would already vouch for the groups it covered. Taken now, its failure
        // lowers `vouch_cap` before the entry is written.
        // The FLUSH also needs a request slot, which other streams' writes may all hold: as a
        // data write does, it waits for one (taking completions may start a background FLUSH
        // here, which is then taken first too).
        loop {
            while self.targets[t as usize].flushing.is_some() {
                self.lbio.wait_done(1)?;
                self.reap();
            }
            self.await_free_slot()?;
            if self.targets[t as usize].flushing.is_none() {
                break;
            }
        }
        let slot = match marker.map(|(stream, seq)| (stream, self.vouch_cap(stream, seq))) {
            Some((stream, seq)) if seq > 0 => {
                let mut m = self.base_attr(stream, t, seq);
                m.flush = true;
                m.members = 0;
                Some((self.append_marker(&m)?, stream, seq))
            }
            _ => None,
        };
        let tag = self.targets[t as usize]
            .dev
            .submit(Io::flush())
            .map_err(|(e, _)| RioError::Config(format!("FLUSH on target {t}: {e}")))?;
        self.stats.flushes += 1;
        self.targets[t as usize].sync_flush = true;
        // What had completed when the FLUSH went out is what it makes durable. (Taken only now:
        // an error before this point leaves the commands for the next FLUSH.)
        let covered = self.targets[t as usize].fresh_volatile();
        // Wait for the FLUSH, taking data completions on the way.
        let mut flushed = None;
        while flushed.is_none() {
            if let Err(e) = self.lbio.wait_done(1) {
                // The FLUSH's outcome is unknown: its commands wait for the next one.
                let target = &mut self.targets[t as usize];
                target.sync_flush = false;
                target.volatile.absorb(covered);
                return Err(e.into());
            }
            while let Some(c) = self.lbio.take_done() {
                if c.tag == tag {
                    flushed = Some(c.result);
                    self.targets[t as usize].sync_flush = false;
                    break;
                }
                self.reaped += 1;
                self.account(c);
            }
        }
        if let Err(e) = flushed.expect("set") {
            self.flush_failed(t as usize, &covered, &e);
            return Err(e.into());
        }
        // A group of the marker's range may have failed while the FLUSH was out (a background
        // FLUSH on another target): then the entry stays unpersisted, vouching for nothing.
        if let Some((slot, _, seq)) = slot.filter(|&(_, st, seq)| self.vouch_cap(st, seq) == seq) {
            if let Err(e) = self.log.set_persist(slot, seq) {
                // The entry that would certify them is not persisted: as with a failed FLUSH,
                // the groups never count as durable (their slots stay), and `wait` says so.
                self.fail_covered(
                    &covered,
                    &format!("persisting the FLUSH entry of target {t}: {e}"),
                );
                return Err(e);
            }
        }
        self.now_durable(&covered.runs);
        self.targets[t as usize].give_back(covered);
        Ok(())
    }

    /// The highest group up to `seq` that a FLUSH entry of `stream` may vouch for in the log:
    /// below the stream's lowest failed group (recovery would keep a group that never reached
    /// the device, or one a failed FLUSH may have dropped), so 0 when nothing may be vouched for.
    fn vouch_cap(&self, stream: u16, seq: u64) -> u64 {
        match self.streams[stream as usize].lowest_failure() {
            Some(&(failed, _)) => seq.min(failed - 1),
            None => seq,
        }
    }

    /// The FLUSH on target `t` that covered `covered` failed with `e`, sent by `wait` or in the
    /// background alike. Its groups never count as durable, and every later `wait` of their
    /// streams reports the failure: a FLUSH that succeeds later does not vouch for writes a
    /// failed one may have dropped. So do the completions taken while it was out (they may
    /// have reached the device before it).
    fn flush_failed(&mut self, t: usize, covered: &Volatile, e: &dyn std::fmt::Display) {
        let why = format!("FLUSH on target {t}: {e}");
        self.fail_covered(covered, &why);
        let mut meanwhile = std::mem::take(&mut self.targets[t].volatile);
        self.fail_covered(&meanwhile, &why);
        meanwhile.clear();
        self.targets[t].volatile = meanwhile;
    }

    /// A FLUSH (or what certifies it) failed for the reason `f`: fail every group it covered.
    fn fail_covered(&mut self, covered: &Volatile, f: &str) {
        for &(stream, a, b) in &covered.runs {
            for g in a..=b {
                self.streams[stream as usize].fail(g, f);
            }
        }
    }

    /// Commands `covered` (stream, seqs) are durable: count them off their groups and move the
    /// streams' marks.
    fn now_durable(&mut self, covered: &[(u16, u64, u64)]) {
        // A FLUSH covers up to `flush_ahead` commands, mostly of one stream: count them all
        // off, then move each stream's marks once.
        let mut touched: SmallVec<[u16; 4]> = SmallVec::new();
        for &(stream, a, b) in covered {
            for grp in self.streams[stream as usize].groups.range_mut(a, b) {
                grp.not_durable -= 1;
            }
            if !touched.contains(&stream) {
                touched.push(stream);
            }
        }
        for stream in touched {
            self.advance(stream);
        }
    }

    /// Send a FLUSH to target `t` covering its completed commands, without waiting. A FLUSH that
    /// cannot be submitted now (no free request slot) is left for later: the commands stay in
    /// the target's list, and `wait` or a full log flushes them.
    fn start_flush(&mut self, t: u16) {
        let target = &mut self.targets[t as usize];
        if target.sync_flush {
            // It starts after that FLUSH is in (see `Target::sync_flush`).
            return;
        }
        if let Ok(tag) = target.dev.submit(Io::flush()) {
            let covered = target.fresh_volatile();
            target.flushing = Some((tag, covered));
            self.flushes_out += 1;
            self.stats.flushes += 1;
            self.stats.flushes_ahead += 1;
        }
    }

    /// If `c` is a background FLUSH's completion, account it: on success its commands are
    /// durable; on failure they go back to wait for the next FLUSH (which reports the error).
    fn background_flush_done(&mut self, c: &lbio::Completion) -> bool {
        let Some(t) = self
            .targets
            .iter()
            .position(|t| t.flushing.as_ref().is_some_and(|f| f.0 == c.tag))
        else {
            return false;
        };
        let (_, covered) = self.targets[t].flushing.take().expect("found");
        self.flushes_out -= 1;
        match &c.result {
            Ok(_) => self.now_durable(&covered.runs),
            Err(e) => self.flush_failed(t, &covered, e),
        }
        self.targets[t].give_back(covered);
        true
    }

    fn append_marker(&mut self, m: &Attr) -> Result<Slot, RioError> {
        loop {
            self.slot_for_log_write()?;
            match self.log.append(m) {
                Ok(s) => return Ok(s),
                Err(RioError::LogFull { .. }) => {
                    self.stats.log_full_waits += 1;
                    // Room comes from durability on every target, this one included (its FLUSH
                    // is not out yet, and its commands are still in its list).
                    let drained = self.drain_all()?;
                    let flushed = self.flush_all_for_room();
                    if !self.log.has_room() {
                        drained?;
                        flushed?;
                        return Err(RioError::LogFull {
                            slots: self.log.slots(),
                        });
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
}

fn group_bytes(rs: &[Req]) -> u64 {
    rs.iter().map(|r| r.w.buf.len() as u64).sum()
}

fn group_end(rs: &[Req]) -> u64 {
    let last = rs.last().expect("non-empty");
    last.w.offset + last.w.buf.len() as u64
}

/// A group can join a merged command: all on one target, each request following the previous
/// one's bytes (from `after` when given).
fn mergeable(rs: &[Req], after: Option<u64>) -> bool {
    let t = rs[0].w.target;
    let mut at = after.unwrap_or(rs[0].w.offset);
    for r in rs {
        if r.w.target != t || r.w.offset != at {
            return false;
        }
        at += r.w.buf.len() as u64;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::Volatile;

    #[test]
    fn volatile_runs_join_consecutive_groups_and_count_every_command() {
        let mut v = Volatile::default();
        // Groups 5..=7 in one merged command, then 8 and 9 alone: one run.
        v.push(0, 5, 7);
        v.push(0, 8, 8);
        v.push(0, 9, 9);
        // A second command of group 9 covers it again: a run of its own.
        v.push(0, 9, 9);
        // Another stream, and an out-of-order completion: runs of their own.
        v.push(1, 10, 10);
        v.push(0, 4, 4);
        assert_eq!(v.runs, vec![(0, 5, 9), (0, 9, 9), (1, 10, 10), (0, 4, 4)]);
        assert_eq!(v.cmds, 6);
        // Each group appears once per command of it.
        let mut per_group = std::collections::BTreeMap::new();
        for &(s, a, b) in &v.runs {
            for g in a..=b {
                *per_group.entry((s, g)).or_insert(0) += 1;
            }
        }
        assert_eq!(per_group[&(0, 9)], 2);
        assert_eq!(per_group[&(0, 5)], 1);
        assert_eq!(per_group.len(), 7);
        v.clear();
        assert!(v.runs.is_empty() && v.cmds == 0);
    }
}
