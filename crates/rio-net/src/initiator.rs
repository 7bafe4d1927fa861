//! The initiator: a volume striped over target servers (`stripe` bytes round robin, 4 KiB by
//! default, as in Rio's Fig. 10(c,d)), with Rio's sequencer on top.
//!
//! - One NVMe/TCP I/O connection per (stream, target), so a stream's commands to a target travel
//!   one in-order channel (Rio principle 2), plus one admin connection per target.
//! - A write is split at stripe boundaries; each piece is one command carrying the attribute
//!   (its group's `seq`, the group's previous group on that target as `prev`, the request count
//!   on the group's final piece).
//! - **A write is handed back ([`Done`]) once it and every write before it on its stream is
//!   durable**: at its completion on targets with power-loss protection, after an ordered FLUSH
//!   otherwise. The initiator keeps each write's buffer until then, so it can replay writes a
//!   failed target lost. A stream whose writes have all completed but are not yet durable
//!   sends the FLUSHes itself; [`Volume::wait`] does so at once.
//! - A connection that fails, or goes quiet with commands out for `io_timeout`, starts
//!   recovery: reconnect (retrying for `reconnect_for`), fence every target (connections from
//!   before may write no more), collect every target's attribute log,
//!   build the global order ([`rio_ordering::recover`] over the merged logs), zero the data of
//!   writes beyond each stream's durable prefix, reset the targets' logs to the prefix, and
//!   replay the writes this initiator still holds. [`Volume::open`] runs the same recovery for
//!   an initiator that starts after a crash (nothing to replay: the volume is cut back to the
//!   prefix, and in-place updates beyond it are reported).

use smallvec::SmallVec;
use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::rc::Rc;
use std::time::{Duration, Instant};

use aios_core::{Engine, EngineConfig, FixedBuf};
use rio_ordering::{recover, scan, Attr, LogScan, MemPmr};

use crate::conn::{deadline_after, wait_fds, Conn, Transport};
use crate::error::NetError;
use crate::pdu::{self, op, Cqe, Digests, Pdu, Sqe, WireAttr};
use crate::target::{LBA, MAX_DATA, MAX_PDU};

/// Settings of a volume.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    pub targets: Vec<SocketAddr>,
    pub streams: u16,
    /// Stripe unit in bytes (a multiple of 4 KiB).
    pub stripe: u32,
    /// Requests per stream in flight (sent and not yet completed by the targets); submitting
    /// more waits. Ordered writes that completed but are not yet durable leave the window
    /// (their FLUSH trails them) and are held, up to [`HELD_PER_WINDOW`] × `window` per
    /// stream, until they are handed back.
    pub window: u32,
    pub digests: Digests,
    /// A connection with commands out that receives nothing this long counts as failed
    /// (`Duration::MAX`: never).
    pub io_timeout: Duration,
    /// How long to keep trying to reach a failed target, and to retry a recovery that fails
    /// (one started by a failed connection or by a group that failed on a target's device).
    pub reconnect_for: Duration,
    pub subnqn: String,
    pub hostnqn: String,
    /// Registered arena for write and read buffers.
    pub arena_bytes: usize,
    /// Print recovery steps to stderr.
    pub verbose: bool,
    /// TCP, or RDMA (feature `rdma`): then write data is pulled by the targets with RDMA READ
    /// from this volume's arena.
    pub transport: Transport,
    /// Closed groups a stream holds before sending them (1: every group goes out as it
    /// closes). Above 1, consecutive held groups whose writes lie on one target, each
    /// following the one before, and fit in `max_merge_bytes` together go out as one merged
    /// command (their data copied into one buffer of the arena). [`Volume::poll`], [`Volume::wait`],
    /// [`Volume::wait_any`] and a full window send what is held.
    pub batch: u32,
    /// Largest merged command (bytes): at most a target's [`MAX_DATA`].
    pub max_merge_bytes: u32,
    /// Commands a stream's requests not yet handed back may take in all (one per stripe a
    /// request touches): a request past it waits, and one that alone takes more is refused.
    /// At most (and by default) [`MAX_PIECES`].
    pub max_commands: u32,
}

impl VolumeConfig {
    pub fn new(targets: Vec<SocketAddr>, streams: u16) -> VolumeConfig {
        VolumeConfig {
            targets,
            streams,
            stripe: 4096,
            window: 64,
            digests: Digests::default(),
            io_timeout: Duration::from_secs(5),
            reconnect_for: Duration::from_secs(30),
            subnqn: "nqn.2026-11.io.aios:target".into(),
            hostnqn: "nqn.2026-11.io.aios:initiator".into(),
            arena_bytes: 32 << 20,
            verbose: false,
            transport: Transport::Tcp,
            batch: 1,
            max_merge_bytes: 128 << 10,
            max_commands: MAX_PIECES,
        }
    }
}

/// Writes a stream may hold (completed, waiting to become durable) per unit of window.
pub const HELD_PER_WINDOW: u32 = 8;

/// Commands a stream may have taken and not handed back, over all its requests (one per stripe
/// a request touches). Each of a stream's connections names a command by a 16-bit id, and a
/// group counts its commands in 16 bits: this keeps both in range, with room left for the
/// FLUSHes and marks a connection sends besides. A request that alone would take more is
/// refused; otherwise a request waits until enough of the ones before it are handed back.
pub const MAX_PIECES: u32 = 65_536 - 1_024;

/// Zeroing commands recovery keeps out on one connection at once.
const ZEROES_OUT: u32 = 4096;

/// I/O queue entries asked for beyond the window: the FLUSH, mark and `flush_all` FLUSH a
/// stream may have out on a connection besides its requests.
const QUEUE_EXTRA: u32 = 8;

/// The largest attribute log recovery reads from a target.
pub const MAX_LOG_BYTES: u64 = 1 << 30;

/// Bytes of a log image besides its slots: the header's two copies, rounded up to the
/// persistent region's block (at most 2 MiB: see `rio_ordering::AttrLog::format`), and the
/// tail shorter than a slot.
const LOG_HEADER_ALLOWANCE: u64 = 4 << 20;

/// The largest window the volume's lists are sized for at open (see [`Volume::open`]).
const PREALLOCATED_WINDOW: usize = 1024;

/// A finished request. Ordered writes: durable, and every earlier write of the stream too.
#[derive(Debug)]
pub struct Done {
    pub stream: u16,
    /// The write's group (0 for orderless writes and reads).
    pub seq: u64,
    pub id: u64,
    pub result: Result<(), String>,
    pub buf: FixedBuf,
}

/// What recovery found and did.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    /// Per stream: groups below this are settled on every target: durable, or given up by an
    /// earlier recovery (handed back failed then). The stream resumes here, or, after a group
    /// of its own failed, at its next group (those it held beyond this come back failed).
    pub prefix_end: Vec<u64>,
    /// Writes beyond the prefixes whose data was zeroed.
    pub discarded: usize,
    /// In-place updates beyond the prefixes (not zeroed: for the upper layer).
    pub in_place: Vec<Attr>,
    /// Writes this initiator replayed (it still held them).
    pub replayed: usize,
    pub took: Duration,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct VolumeStats {
    pub ordered_cmds: u64,
    /// Merged commands sent (each carries several whole groups; counted in `ordered_cmds`).
    pub merged_cmds: u64,
    /// Groups that went out inside merged commands.
    pub merged_groups: u64,
    /// Runs of groups that could have been merged but went out one by one: the arena had no
    /// room for the merged copy at that moment.
    pub merge_skipped: u64,
    pub flushes: u64,
    pub marks: u64,
    pub recoveries: u64,
    pub replayed: u64,
    /// The most commands one stream's requests took at once (bounded by
    /// `VolumeConfig::max_commands`).
    pub peak_commands: u32,
    /// Turns of the connections (a receive on each, then a wait for the network when nothing
    /// came): what a wait costs the CPU.
    pub turns: u64,
}

struct TargetInfo {
    addr: SocketAddr,
    admin: Option<Conn>,
    cntlid: u16,
    ns_bytes: u64,
    plp: bool,
    rio: bool,
    log_streams: u16,
    /// Attribute slots of its log (`RIO_INFO`): bounds the log image recovery reads.
    log_slots: u32,
    next_cid: u16,
    /// The namespace's block size, as a shift (512 to 4096 bytes).
    lba_shift: u8,
    /// In-capsule data the I/O queues take (Identify Controller IOCCSZ); larger writes wait
    /// for the target's R2T.
    incap: u32,
    /// Entries of each I/O queue (Connect's SQSIZE + 1): what the window asks for, within
    /// the target's CAP.MQES + 1 and MAXCMD.
    queue_entries: u32,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// A piece of an ordered write: (group seq, request index in the group).
    Ordered {
        seq: u64,
        req: u32,
    },
    /// Whole groups `seq..=seq_end`, their writes back to back, as one command (its data is the
    /// command's own copy, [`ICmd::copy`]).
    Merged {
        seq: u64,
        seq_end: u64,
    },
    /// An ordered FLUSH covering this connection's commands sent before it.
    Flush {
        covers: u64,
    },
    Mark,
    /// A piece of an orderless write or read: index into the orderless table.
    Plain {
        slot: u32,
    },
    /// Recovery's own commands (its zeroing and FLUSH): a failure fails the recovery.
    PlainFlush,
    /// [`Volume::flush_all`]'s FLUSH: a failure is that call's error.
    CallerFlush,
}

struct ICmd {
    kind: Kind,
    /// Byte range of the request's buffer this command carries (writes, reads).
    range: (u32, u32),
    sent_no: u64,
    completed: bool,
    /// A merged command's data (returned to the arena when the command is released).
    copy: Option<FixedBuf>,
}

struct IoConn {
    conn: Option<Conn>,
    /// Commands this queue may have out at once (its SQSIZE, one below its entries): past it,
    /// commands wait in `deferred` (encoded, in order) until answers free room.
    cap: u32,
    /// Commands sent (or in `conn`'s send buffer) and not answered.
    wire: u32,
    /// Command capsules waiting for room on the queue, from `deferred_at` on.
    deferred: Vec<u8>,
    deferred_at: usize,
    deferred_cmds: u32,
    /// The key of the volume's arena on this connection (RDMA): writes carry a keyed SGL.
    rkey: Option<u32>,
    cmds: Vec<Option<ICmd>>,
    free: Vec<u16>,
    /// Ordered pieces not yet durable, in the order sent.
    order: VecDeque<u16>,
    /// Commands awaiting their CQE.
    outstanding: u32,
    sent: u64,
    /// Ordered pieces completed but not yet durable.
    volatile: u32,
    /// An ordered FLUSH is out.
    flush_out: bool,
    last_progress: Instant,
}

impl IoConn {
    /// A connection's state with room for `cmds` commands at once (sized from the window at
    /// start, so steady I/O does not grow its lists).
    fn new(cmds: usize) -> IoConn {
        IoConn {
            conn: None,
            cap: 1,
            wire: 0,
            deferred: Vec::new(),
            deferred_at: 0,
            deferred_cmds: 0,
            rkey: None,
            cmds: Vec::with_capacity(cmds),
            free: Vec::with_capacity(cmds),
            order: VecDeque::with_capacity(cmds),
            outstanding: 0,
            sent: 0,
            volatile: 0,
            flush_out: false,
            last_progress: Instant::now(),
        }
    }
    fn alloc(&mut self, kind: Kind, range: (u32, u32)) -> u16 {
        let cid = match self.free.pop() {
            Some(c) => c,
            None => {
                // `MAX_PIECES` keeps a connection's commands well under this.
                assert!(
                    self.cmds.len() < 1 << 16,
                    "command ids of a connection ran out"
                );
                self.cmds.push(None);
                (self.cmds.len() - 1) as u16
            }
        };
        self.sent += 1;
        // The quiet clock runs from the first command out: a connection left idle for longer
        // than `io_timeout` is not silent when its next command has only just gone out.
        if self.outstanding == 0 {
            self.last_progress = Instant::now();
        }
        self.outstanding += 1;
        self.cmds[cid as usize] = Some(ICmd {
            kind,
            range,
            sent_no: self.sent,
            completed: false,
            copy: None,
        });
        cid
    }
    /// Queue a command capsule (dropped when the connection is gone: recovery resends): to
    /// the wire while the queue has room, else behind the commands already waiting for it.
    fn queue(&mut self, sqe: &Sqe, data: &[u8]) {
        let Some(c) = self.conn.as_mut() else {
            return;
        };
        if self.wire < self.cap && self.deferred_cmds == 0 {
            pdu::put_cmd(&mut c.tx, sqe, data, c.dg);
            self.wire += 1;
        } else {
            pdu::put_cmd(&mut self.deferred, sqe, data, c.dg);
            self.deferred_cmds += 1;
        }
    }
    /// A command was answered: send those waiting for its room.
    fn answered(&mut self) {
        self.wire = self.wire.saturating_sub(1);
        let Some(c) = self.conn.as_mut() else {
            return;
        };
        while self.wire < self.cap && self.deferred_cmds > 0 {
            let at = self.deferred_at;
            let plen =
                u32::from_le_bytes(self.deferred[at + 4..at + 8].try_into().expect("4")) as usize;
            c.tx.extend_from_slice(&self.deferred[at..at + plen]);
            self.deferred_at += plen;
            self.deferred_cmds -= 1;
            self.wire += 1;
        }
        if self.deferred_cmds == 0 {
            self.deferred.clear();
            self.deferred_at = 0;
        } else if self.deferred_at >= self.deferred.len() - self.deferred_at {
            // Commands still wait (a window larger than the queue, kept full, leaves some
            // waiting at every answer), and more are appended behind them: drop the capsules
            // that went once they are at least as many bytes as those waiting, so the buffer
            // holds under twice what waits instead of every capsule since it last emptied.
            let at = self.deferred_at;
            self.deferred.copy_within(at.., 0);
            self.deferred.truncate(self.deferred.len() - at);
            self.deferred_at = 0;
        }
    }
    fn release(&mut self, cid: u16) {
        self.cmds[cid as usize] = None;
        self.free.push(cid);
    }
    fn reset(&mut self) {
        self.conn = None;
        self.wire = 0;
        self.deferred.clear();
        self.deferred_at = 0;
        self.deferred_cmds = 0;
        self.rkey = None;
        self.cmds.clear();
        self.free.clear();
        self.order.clear();
        self.outstanding = 0;
        self.volatile = 0;
        self.flush_out = false;
    }
}

/// A command on namespace 1.
fn ns_cmd(opcode: u8, cid: u16) -> Sqe {
    let mut sqe = Sqe::default();
    sqe.set_opcode(opcode);
    sqe.set_cid(cid);
    sqe.set_cdw(1, 1);
    sqe.set_sgl(0, false);
    sqe
}

/// A read, write or write-zeroes command over `len` bytes at byte `off` of the namespace.
fn lba_cmd(opcode: u8, cid: u16, off: u64, len: u32, lba_shift: u8) -> Sqe {
    let mut sqe = ns_cmd(opcode, cid);
    let slba = off >> lba_shift;
    sqe.set_cdw(10, slba as u32);
    sqe.set_cdw(11, (slba >> 32) as u32);
    sqe.set_cdw(12, (len >> lba_shift) - 1);
    sqe
}

struct Req {
    id: u64,
    offset: u64,
    buf: Option<FixedBuf>,
    pieces: u32,
    /// Pieces the targets completed (durable or not).
    completed: u32,
    durable: u32,
    failed: Option<String>,
    /// An in-place update ([`Volume::submit_in_place`]): recovery leaves it where it lies
    /// beyond the durable prefix instead of zeroing it (zeroing would take the block's earlier,
    /// acknowledged contents with it).
    ipu: bool,
}

/// A group's requests (most groups hold one: no heap allocation for those).
type Reqs = SmallVec<[Req; 1]>;
/// A write's pieces, one per stripe it touches: (target, target offset, range in the buffer).
type Pieces = SmallVec<[(usize, u64, (u32, u32)); 4]>;
/// A group's commands: (request, target, target offset, range in the request's buffer).
type Plan = SmallVec<[(u32, usize, u64, (u32, u32)); 8]>;

struct Group {
    seq: u64,
    reqs: Reqs,
}

struct Stream {
    next_seq: u64,
    open: Reqs,
    /// Commands the open group's requests take (the sum of their `pieces`).
    open_pieces: u32,
    /// Groups sent and not yet handed back, oldest first (`groups[0].seq == durable_below`).
    groups: VecDeque<Group>,
    /// Per target: the stream's last group sent there.
    prev: Vec<u64>,
    /// Per target: the mark last told.
    mark_told: Vec<u64>,
    durable_below: u64,
    next_id: u64,
    /// Requests not yet handed back.
    not_done: u32,
    /// Requests not yet completed by the targets (the window).
    in_flight: u32,
    /// Commands the requests not yet handed back take (one per stripe a request touches): a
    /// bound on the command ids the stream's connections have in use (see [`MAX_PIECES`]).
    pieces_out: u32,
    /// The lowest group that failed (a write the target failed, or one a failed FLUSH may
    /// have dropped); `u64::MAX`: none since the last recovery. It and every group after it
    /// come back failed, the mark told the targets stays below it, and no FLUSH entry vouches
    /// for it: recovery's prefix ends before it.
    failed_from: u64,
    /// Closed groups held, not yet sent (the last `held` of `groups`; `VolumeConfig::batch`).
    held: u32,
}

impl Stream {
    /// Group `seq`, while it is held (`None` once handed back).
    fn group(&self, seq: u64) -> Option<&Group> {
        let front = self.groups.front()?.seq;
        self.groups.get(seq.checked_sub(front)? as usize)
    }

    /// Requests in group `seq` (0 once it is handed back).
    fn group_len(&self, seq: u64) -> u32 {
        self.group(seq).map_or(0, |g| g.reqs.len() as u32)
    }
}

/// An orderless write or a read in flight.
struct Plain {
    stream: u16,
    id: u64,
    /// A read (data comes back as C2HData); otherwise an orderless write (data goes out).
    read: bool,
    buf: Option<FixedBuf>,
    pieces: u32,
    failed: Option<String>,
}

/// A volume striped over target servers.
pub struct Volume {
    cfg: VolumeConfig,
    engine: Rc<Engine>,
    targets: Vec<TargetInfo>,
    /// `[stream * targets + target]`.
    conns: Vec<IoConn>,
    streams: Vec<Stream>,
    plain: Vec<Option<Plain>>,
    plain_free: Vec<u32>,
    ready: VecDeque<Done>,
    /// Scratch lists of a FLUSH's completion: the pieces it made durable, and the commands it
    /// did not cover (kept for their allocations).
    durable_scratch: Vec<(u64, u32)>,
    order_scratch: VecDeque<u16>,
    bytes: u64,
    stats: VolumeStats,
    hostid: [u8; 16],
    /// Why a FLUSH of [`Volume::flush_all`] failed (taken by that call).
    caller_flush_error: Option<String>,
    /// FLUSHes of [`Volume::flush_all`] not answered yet.
    caller_flushes_out: u32,
    /// What the last recovery found and did (the volume's own ones included).
    last_recovery: Option<RecoveryReport>,
    /// A recovery started and has not succeeded since: the connections it dropped took the
    /// held groups' commands with them, so the next call runs it again before anything else.
    recovery_due: bool,
}

impl Drop for Volume {
    fn drop(&mut self) {
        // Links go before the engine: an RDMA link has the engine's arena registered.
        self.conns.clear();
        for t in &mut self.targets {
            t.admin = None;
        }
    }
}

fn status_err(peer: SocketAddr, what: &str, cqe: &Cqe) -> NetError {
    let (sct, sc) = cqe.sct_sc();
    NetError::Status {
        peer: peer.to_string(),
        what: what.into(),
        sct,
        sc,
    }
}

impl Volume {
    /// Connect to every target and recover: the volume is cut back to each stream's durable
    /// prefix (see the module docs) and streams resume after it.
    pub fn open(cfg: VolumeConfig) -> Result<(Volume, RecoveryReport), NetError> {
        let mut v = Volume::connect(cfg)?;
        let r = v.recover()?;
        Ok((v, r))
    }

    /// Connect without recovering (reads and orderless writes only until [`Volume::recover`]).
    pub fn connect(cfg: VolumeConfig) -> Result<Volume, NetError> {
        if cfg.targets.is_empty() || cfg.streams == 0 {
            return Err(NetError::Config(
                "a volume needs at least one target and one stream".into(),
            ));
        }
        if cfg.stripe == 0 || cfg.stripe % LBA != 0 || cfg.stripe > MAX_DATA {
            return Err(NetError::Config(format!(
                "stripe {} must be a multiple of {LBA} up to {MAX_DATA}",
                cfg.stripe
            )));
        }
        if cfg.window == 0 {
            return Err(NetError::Config("window must be at least 1".into()));
        }
        if cfg.max_commands == 0 || cfg.max_commands > MAX_PIECES {
            return Err(NetError::Config(format!(
                "max_commands {}: 1 to {MAX_PIECES}",
                cfg.max_commands
            )));
        }
        if cfg.batch > 1 && cfg.max_merge_bytes > MAX_DATA {
            return Err(NetError::Config(format!(
                "max_merge_bytes {} is more than a target takes in one command ({MAX_DATA})",
                cfg.max_merge_bytes
            )));
        }
        let engine = Engine::new(EngineConfig {
            arena_bytes: cfg.arena_bytes,
            huge_pages: false,
            ring_entries: 64,
            ..EngineConfig::default()
        })?;
        let nt = cfg.targets.len();
        // Finished requests wait in `ready` until the caller polls, and handing one back frees
        // its room in the window: how many wait depends on how often the caller polls, not on
        // the window. Each holds its buffer, though, so with buffers from `Volume::alloc` there
        // are at most as many as the arena has frames (`Volume::max_done`), whatever the
        // schedule: sized for that here (about 2% of the arena with 4 KiB frames).
        let max_done = engine.arena().frames() as usize;
        // Allocate at start: what the window bounds is sized here. A stream holds up to
        // `window × HELD_PER_WINDOW` writes not yet handed back; a connection's commands are
        // those pieces, plus reads and orderless writes within the window, plus a FLUSH or two.
        // (Bounded, so that a huge window is not allocated up front: past the bound the lists
        // grow as they fill, and keep what they grew.)
        let window = (cfg.window as usize).min(PREALLOCATED_WINDOW);
        let held = window * HELD_PER_WINDOW as usize;
        let cmds = held + window + 4;
        let mut hostid = [0u8; 16];
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ std::process::id() as u64;
        hostid[..8].copy_from_slice(&seed.to_le_bytes());
        let mut v = Volume {
            targets: cfg
                .targets
                .iter()
                .map(|&addr| TargetInfo {
                    addr,
                    admin: None,
                    cntlid: 0,
                    ns_bytes: 0,
                    plp: false,
                    rio: false,
                    log_streams: 0,
                    log_slots: 0,
                    next_cid: 0,
                    lba_shift: 12,
                    incap: 0,
                    queue_entries: 0,
                })
                .collect(),
            conns: (0..cfg.streams as usize * nt)
                .map(|_| IoConn::new(cmds))
                .collect(),
            streams: (0..cfg.streams)
                .map(|_| Stream {
                    next_seq: 1,
                    open: Reqs::new(),
                    open_pieces: 0,
                    groups: VecDeque::with_capacity(held),
                    prev: vec![0; nt],
                    mark_told: vec![0; nt],
                    durable_below: 1,
                    next_id: 1,
                    not_done: 0,
                    in_flight: 0,
                    pieces_out: 0,
                    failed_from: u64::MAX,
                    held: 0,
                })
                .collect(),
            plain: Vec::with_capacity(window),
            plain_free: Vec::with_capacity(window),
            ready: VecDeque::with_capacity(max_done),
            durable_scratch: Vec::with_capacity(cmds),
            order_scratch: VecDeque::with_capacity(cmds),
            bytes: 0,
            stats: VolumeStats::default(),
            caller_flush_error: None,
            caller_flushes_out: 0,
            last_recovery: None,
            recovery_due: false,
            engine,
            hostid,
            cfg,
        };
        for t in 0..nt {
            v.connect_admin(t)?;
        }
        let min_ns = v.targets.iter().map(|t| t.ns_bytes).min().unwrap_or(0);
        let per_target = min_ns / v.cfg.stripe as u64 * v.cfg.stripe as u64;
        v.bytes = per_target * nt as u64;
        for s in 0..v.cfg.streams {
            for t in 0..nt {
                v.connect_io(s, t)?;
            }
        }
        Ok(v)
    }

    /// Bytes of the volume.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    pub fn streams(&self) -> u16 {
        self.cfg.streams
    }
    /// Closed groups a stream holds before sending them ([`VolumeConfig::batch`]).
    pub fn batch(&self) -> u32 {
        self.cfg.batch.max(1)
    }
    pub fn stats(&self) -> VolumeStats {
        self.stats
    }
    pub fn engine(&self) -> &Rc<Engine> {
        &self.engine
    }
    /// The most finished requests the volume can hold for the caller at once when their
    /// buffers come from [`Volume::alloc`]: one per frame of its arena, since each holds its
    /// buffer until taken. The volume keeps room for that many from the start, and a vector
    /// with this much room never grows in [`Volume::poll_into`] (emptied between calls),
    /// however many requests finish between polls. (Buffers from another arena are not
    /// counted: with those the volume's list may grow, once, past this.)
    pub fn max_done(&self) -> usize {
        self.engine.arena().frames() as usize
    }
    /// A buffer from the volume's arena (waits for nothing: `None` when exhausted).
    pub fn alloc(&self, len: usize) -> Option<FixedBuf> {
        let mut b = self.engine.try_alloc(len)?;
        b.set_len(len).ok()?;
        Some(b)
    }
    /// Whether each target keeps completed writes across power loss.
    pub fn plp(&self) -> Vec<bool> {
        self.targets.iter().map(|t| t.plp).collect()
    }
    /// Per target: the write data its I/O queues take in the command capsule (Identify
    /// Controller IOCCSZ); larger pieces go after the target's R2T.
    pub fn in_capsule(&self) -> Vec<u32> {
        self.targets.iter().map(|t| t.incap).collect()
    }
    /// Per target: the namespace's block size in bytes.
    pub fn block_size(&self) -> Vec<u32> {
        self.targets.iter().map(|t| 1 << t.lba_shift).collect()
    }
    /// The group the stream's next write joins (a stream the volume does not have is an
    /// error, as for the calls that take a stream).
    pub fn next_seq(&self, stream: u16) -> Result<u64, NetError> {
        self.check_stream(stream)?;
        Ok(self.streams[stream as usize].next_seq)
    }

    /// A new connection to target `t`, past ICReq/ICResp.
    fn dial(&self, t: usize) -> Result<Conn, NetError> {
        let addr = self.targets[t].addr;
        let mut c = match self.cfg.transport {
            Transport::Tcp => {
                let sock = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
                    .map_err(|e| NetError::io("connect to", addr, e))?;
                Conn::new(sock, MAX_PDU).map_err(|e| NetError::io("socket setup for", addr, e))?
            }
            #[cfg(feature = "rdma")]
            Transport::Rdma => {
                let link = crate::rdma::Link::connect(addr, Duration::from_secs(5))
                    .map_err(|e| NetError::io("RDMA connect to", addr, e))?;
                Conn::rdma(link, MAX_PDU)
            }
            #[cfg(not(feature = "rdma"))]
            Transport::Rdma => return Err(NetError::Config(crate::conn::NO_RDMA.into())),
        };
        pdu::put_icreq(&mut c.tx, self.cfg.digests, 0);
        let p = self.exchange(&mut c, addr, 0, |p| matches!(p, Pdu::ICResp { .. }))?;
        let Reply::IcResp { dgst, maxh2cdata } = p else {
            return Err(NetError::peer(addr, "no ICResp"));
        };
        // The specification's floor is 4 KiB; a peer that says less is taken at the floor.
        c.maxh2cdata = maxh2cdata.max(4096);
        c.dg = Digests {
            header: dgst & 1 != 0,
            data: dgst & 2 != 0,
        };
        Ok(c)
    }

    /// Send what `c` holds and read until `done` matches a PDU; data PDUs are collected, at
    /// most `max_data` bytes (what the command asked for): a target that sends more is a
    /// protocol error, not memory this side allocates for it.
    fn exchange(
        &self,
        c: &mut Conn,
        addr: SocketAddr,
        max_data: usize,
        done: impl Fn(&Pdu) -> bool,
    ) -> Result<Reply, NetError> {
        let deadline = deadline_after(self.cfg.io_timeout);
        c.flush_blocking(self.cfg.io_timeout)
            .map_err(|e| NetError::io("send to", addr, e))?;
        let mut data = Vec::new();
        loop {
            loop {
                let dg = c.dg;
                let got =
                    pdu::decode(c.rx.pending(), dg, c.max_pdu).map_err(|e| NetError::Protocol {
                        peer: addr.to_string(),
                        source: e,
                    })?;
                let Some((p, n)) = got else { break };
                let matched = done(&p);
                let reply = match p {
                    Pdu::ICResp {
                        dgst, maxh2cdata, ..
                    } => Some(Reply::IcResp { dgst, maxh2cdata }),
                    Pdu::Resp { cqe } => Some(Reply::Resp(cqe, std::mem::take(&mut data))),
                    Pdu::C2HData { data: d, .. } => {
                        if data.len() + d.len() > max_data {
                            return Err(NetError::peer(
                                addr,
                                format!(
                                    "sent more data than the command asked for ({max_data} bytes)"
                                ),
                            ));
                        }
                        data.extend_from_slice(d);
                        None
                    }
                    Pdu::TermReq { fes, .. } => {
                        return Err(NetError::peer(
                            addr,
                            format!("terminated the connection (status {fes:#x})"),
                        ))
                    }
                    other => {
                        return Err(NetError::peer(addr, format!("unexpected PDU {other:?}")));
                    }
                };
                c.rx.consume(n);
                if matched {
                    if let Some(r) = reply {
                        return Ok(r);
                    }
                }
            }
            if c.eof {
                return Err(NetError::peer(addr, "closed the connection"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(NetError::io(
                    "waiting for",
                    addr,
                    std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"),
                ));
            }
            wait_fds(&c.fds(true), Some(left)).map_err(|e| NetError::io("poll", addr, e))?;
            c.fill()
                .map_err(|e| NetError::io("receive from", addr, e))?;
        }
    }

    /// A command on `t`'s admin queue, waited for.
    fn admin(
        &mut self,
        t: usize,
        mut sqe: Sqe,
        out: &[u8],
        what: &str,
    ) -> Result<(Cqe, Vec<u8>), NetError> {
        let addr = self.targets[t].addr;
        let cid = self.targets[t].next_cid;
        self.targets[t].next_cid = cid.wrapping_add(1);
        sqe.set_cid(cid);
        sqe.ensure_sgl();
        let mut c = self.targets[t]
            .admin
            .take()
            .ok_or_else(|| NetError::peer(addr, "no admin connection"))?;
        pdu::put_cmd(&mut c.tx, &sqe, out, c.dg);
        // Data in the capsule goes out; otherwise the descriptor's length comes back at most.
        let (_, len, id) = sqe.sgl();
        let max_data = if id == pdu::SGL_IN_CAPSULE {
            0
        } else {
            len as usize
        };
        let r = self.exchange(
            &mut c,
            addr,
            max_data,
            |p| matches!(p, Pdu::Resp { cqe } if cqe.cid == cid),
        );
        match r {
            Ok(Reply::Resp(cqe, data)) => {
                self.targets[t].admin = Some(c);
                if cqe.ok() {
                    Ok((cqe, data))
                } else {
                    Err(status_err(addr, what, &cqe))
                }
            }
            Ok(_) => Err(NetError::peer(addr, "unexpected reply")),
            Err(e) => Err(e),
        }
    }

    fn connect_data(&self, cntlid: u16) -> Vec<u8> {
        pdu::connect_data(&self.hostid, cntlid, &self.cfg.subnqn, &self.cfg.hostnqn)
    }

    /// Identify data structure `cns` (for namespace `nsid`), checked to be whole.
    fn identify(&mut self, t: usize, cns: u32, nsid: u32, what: &str) -> Result<Vec<u8>, NetError> {
        let mut id = Sqe::default();
        id.set_opcode(op::IDENTIFY);
        id.set_cdw(1, nsid);
        id.set_cdw(10, cns);
        id.set_sgl(4096, false);
        let (_, page) = self.admin(t, id, &[], what)?;
        if page.len() < 4096 {
            return Err(NetError::peer(
                self.targets[t].addr,
                format!("short {what} data"),
            ));
        }
        Ok(page)
    }

    fn connect_admin(&mut self, t: usize) -> Result<(), NetError> {
        let c = self.dial(t)?;
        self.targets[t].admin = Some(c);
        let data = self.connect_data(0xffff);
        let (cqe, _) = self.admin(
            t,
            pdu::connect_command(0, 31),
            &data,
            "Connect (admin queue)",
        )?;
        self.targets[t].cntlid = cqe.dw0 as u16;
        // CC: enable, 64-byte SQEs, 16-byte CQEs.
        let mut set = Sqe::default();
        set.set_opcode(op::FABRICS);
        set.0[4] = op::FC_PROPERTY_SET;
        set.0[44..48].copy_from_slice(&0x14u32.to_le_bytes());
        set.0[48..56].copy_from_slice(&(1u64 | 6 << 16 | 4 << 20).to_le_bytes());
        self.admin(t, set, &[], "Property Set CC")?;
        let deadline = deadline_after(self.cfg.io_timeout);
        loop {
            let mut get = Sqe::default();
            get.set_opcode(op::FABRICS);
            get.0[4] = op::FC_PROPERTY_GET;
            get.0[44..48].copy_from_slice(&0x1cu32.to_le_bytes());
            let (cqe, _) = self.admin(t, get, &[], "Property Get CSTS")?;
            if cqe.dw0 & 1 == 1 {
                break;
            }
            if Instant::now() > deadline {
                return Err(NetError::peer(
                    self.targets[t].addr,
                    "controller never became ready",
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let page = self.identify(t, 0, 1, "Identify Namespace")?;
        let nsze = u64::from_le_bytes(page[0..8].try_into().expect("8"));
        let flbas = page[26] as usize & 0xf;
        let lbads = page[128 + 4 * flbas + 2];
        if !(9..=LBA.trailing_zeros() as u8).contains(&lbads) {
            return Err(NetError::peer(
                self.targets[t].addr,
                format!("namespace 1 has 2^{lbads}-byte blocks; this initiator needs 512 to {LBA}"),
            ));
        }
        self.targets[t].lba_shift = lbads;
        self.targets[t].ns_bytes = nsze << lbads;
        let page = self.identify(t, 1, 0, "Identify Controller")?;
        let ioccsz = u32::from_le_bytes(page[1792..1796].try_into().expect("4"));
        self.targets[t].incap = ioccsz.saturating_mul(16).saturating_sub(64);
        // I/O queue size: what the window asks for (at least the 128 entries it always was),
        // within the target's CAP.MQES (0's based) and MAXCMD (0: not said).
        let mut cap = Sqe::default();
        cap.set_opcode(op::FABRICS);
        cap.0[4] = op::FC_PROPERTY_GET;
        cap.0[40] = 1; // an 8-byte property
        let (cqe, _) = self.admin(t, cap, &[], "Property Get CAP")?;
        let mqes = (cqe.dw0 & 0xffff) + 1;
        let maxcmd = u16::from_le_bytes([page[514], page[515]]) as u32;
        let maxcmd = if maxcmd == 0 { u32::MAX } else { maxcmd };
        let want = self.cfg.window.saturating_add(QUEUE_EXTRA).max(128);
        self.targets[t].queue_entries = want.min(mqes).min(maxcmd).clamp(2, 1 << 16);
        let mut info = Sqe::default();
        info.set_opcode(op::RIO_INFO);
        match self.admin(t, info, &[], "RIO_INFO") {
            Ok((cqe, _)) => {
                self.targets[t].rio = true;
                self.targets[t].plp = cqe.dw1 & 1 != 0;
                self.targets[t].log_streams = (cqe.dw1 >> 16) as u16;
                if self.targets[t].log_streams < self.cfg.streams {
                    return Err(NetError::Config(format!(
                        "target {} keeps a log for {} streams; this volume has {}",
                        self.targets[t].addr, self.targets[t].log_streams, self.cfg.streams
                    )));
                }
                self.targets[t].log_slots = cqe.dw0;
                let slots = cqe.dw0 as u64;
                let need = 4 * self.cfg.streams as u64 * (self.cfg.window as u64 + 2);
                if slots < need {
                    return Err(NetError::Config(format!(
                        "target {}'s attribute log has {slots} slots; {} streams with a window of {} need {need}",
                        self.targets[t].addr, self.cfg.streams, self.cfg.window
                    )));
                }
            }
            Err(NetError::Status { sct: 0, sc: 1, .. }) => {
                // A standard NVMe/TCP target: orderless I/O only.
                self.targets[t].rio = false;
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    fn connect_io(&mut self, s: u16, t: usize) -> Result<(), NetError> {
        let addr = self.targets[t].addr;
        let mut c = self.dial(t)?;
        let rkey = self.register_arena(&mut c)?;
        let data = self.connect_data(self.targets[t].cntlid);
        // SQSIZE is 0's based: the queue has `queue_entries`, and at most one fewer
        // commands go out on it at once (`IoConn::cap`).
        let entries = self.targets[t].queue_entries.max(2);
        let mut sqe = pdu::connect_command(s + 1, (entries - 1) as u16);
        sqe.set_cid(0);
        pdu::put_cmd(&mut c.tx, &sqe, &data, c.dg);
        match self.exchange(&mut c, addr, 0, |p| matches!(p, Pdu::Resp { .. }))? {
            Reply::Resp(cqe, _) if cqe.ok() => {}
            Reply::Resp(cqe, _) => return Err(status_err(addr, "Connect (I/O queue)", &cqe)),
            _ => return Err(NetError::peer(addr, "no Connect response")),
        }
        let ic = &mut self.conns[s as usize * self.targets.len() + t];
        ic.reset();
        ic.conn = Some(c);
        ic.cap = entries - 1;
        ic.rkey = rkey;
        ic.last_progress = Instant::now();
        Ok(())
    }

    /// On an RDMA connection: register the arena, so the target can pull write data from it.
    #[cfg(feature = "rdma")]
    fn register_arena(&self, c: &mut Conn) -> Result<Option<u32>, NetError> {
        let Some(link) = c.rdma_link() else {
            return Ok(None);
        };
        let a = self.engine.arena();
        let peer = link.peer();
        // SAFETY: the arena stays mapped while the engine lives, and `Drop for Volume` drops
        // every connection (and so every link) before the engine.
        #[allow(unsafe_code)]
        let k = unsafe { link.register(a.base_ptr(), a.bytes()) };
        Ok(Some(
            k.map_err(|e| NetError::io("registering the arena for", peer, e))?
                .rkey,
        ))
    }

    #[cfg(not(feature = "rdma"))]
    fn register_arena(&self, _c: &mut Conn) -> Result<Option<u32>, NetError> {
        Ok(None)
    }

    /// Where volume byte `off` lives: (target, byte offset on it).
    fn locate(&self, off: u64) -> (usize, u64) {
        let stripe = self.cfg.stripe as u64;
        let unit = off / stripe;
        let nt = self.targets.len() as u64;
        ((unit % nt) as usize, (unit / nt) * stripe + off % stripe)
    }

    /// Pieces of `offset..offset+len`: (target, target offset, range in the buffer).
    fn pieces(&self, offset: u64, len: u32) -> Pieces {
        let stripe = self.cfg.stripe as u64;
        let mut out = Pieces::new();
        let mut at = 0u32;
        while at < len {
            let off = offset + at as u64;
            let n = ((stripe - off % stripe) as u32).min(len - at);
            let (t, toff) = self.locate(off);
            out.push((t, toff, (at, at + n)));
            at += n;
        }
        out
    }

    /// How many pieces [`Volume::pieces`] cuts `offset..offset+len` into (no list built).
    fn piece_count(&self, offset: u64, len: u32) -> u32 {
        if len == 0 {
            return 0;
        }
        let stripe = self.cfg.stripe as u64;
        ((offset + len as u64 - 1) / stripe - offset / stripe + 1) as u32
    }

    /// The commands a request of `len` bytes at `offset` takes, refused when with `open` more
    /// (its open group's) they could never fit `VolumeConfig::max_commands`.
    fn commands_for(&self, offset: u64, len: usize, open: u32) -> Result<u32, NetError> {
        let n = self.piece_count(offset, len as u32);
        if open + n <= self.command_limit() {
            return Ok(n);
        }
        let group = if open > 0 {
            format!(" and its open group already has {open}")
        } else {
            String::new()
        };
        Err(NetError::Config(format!(
            "a request of {len} bytes at {offset} is {n} commands (one per {}-byte stripe){group}: a stream takes at most {} at once{}",
            self.cfg.stripe,
            self.command_limit(),
            if open > 0 { "; write less per group" } else { "" }
        )))
    }

    /// Commands a stream's requests not yet handed back may take: `max_commands`, and no more
    /// than half a stream's share of the smallest target log (each command has an entry there
    /// until the stream's mark passes it, and so may an ordered FLUSH per command): a log
    /// filled by writes not yet durable takes no FLUSH entry, and the stream stalls for good.
    fn command_limit(&self) -> u32 {
        let streams = self.cfg.streams.max(1) as u32;
        let log = self
            .targets
            .iter()
            .filter(|t| t.rio)
            .map(|t| (t.log_slots / streams / 2).saturating_sub(2).max(1))
            .min()
            .unwrap_or(u32::MAX);
        self.cfg.max_commands.min(log)
    }

    fn check_stream(&self, stream: u16) -> Result<(), NetError> {
        if stream >= self.cfg.streams {
            return Err(NetError::Config(format!(
                "stream {stream} of a volume with {}",
                self.cfg.streams
            )));
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<(), NetError> {
        if len == 0 || offset % LBA as u64 != 0 || len % LBA as usize != 0 {
            return Err(NetError::Config(format!(
                "volume I/O at byte {offset} of {len} bytes: offset and length must be multiples of {LBA}"
            )));
        }
        // Checked: an offset near `u64::MAX` wrapped past the end and went out as I/O (a
        // panic in a debug build).
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.bytes)
        {
            return Err(NetError::Config(format!(
                "volume I/O at byte {offset} of {len} bytes ends past the volume ({} bytes)",
                self.bytes
            )));
        }
        Ok(())
    }

    /// Queue an ordered write on `stream`; `end_of_group` closes its group (the writes of one
    /// group may become durable in any order among themselves; groups in order). Waits while
    /// the stream has `window` writes not yet handed back.
    ///
    /// For writes to blocks not written since they were last made durable (a log, fresh
    /// space): after a crash, recovery zeroes such a write when it lies beyond the durable
    /// prefix. A write over a block whose earlier contents were acknowledged goes through
    /// [`Volume::submit_in_place`] instead.
    pub fn submit(
        &mut self,
        stream: u16,
        offset: u64,
        buf: FixedBuf,
        end_of_group: bool,
    ) -> Result<u64, NetError> {
        self.submit_with(stream, offset, buf, end_of_group, false)
    }

    /// [`Volume::submit`] for an in-place update: a write over a block whose earlier contents
    /// were acknowledged. Rio's IPU flag goes with it, and recovery leaves it as it lies when it
    /// falls beyond the durable prefix (reported in `RecoveryReport::in_place`): zeroing it,
    /// as for other writes there, would also erase those earlier contents.
    pub fn submit_in_place(
        &mut self,
        stream: u16,
        offset: u64,
        buf: FixedBuf,
        end_of_group: bool,
    ) -> Result<u64, NetError> {
        self.submit_with(stream, offset, buf, end_of_group, true)
    }

    fn submit_with(
        &mut self,
        stream: u16,
        offset: u64,
        buf: FixedBuf,
        end_of_group: bool,
        ipu: bool,
    ) -> Result<u64, NetError> {
        self.check_stream(stream)?;
        if self.targets.iter().any(|t| !t.rio) {
            return Err(NetError::Config(
                "ordered writes need Rio targets (one of them is a plain NVMe/TCP target)".into(),
            ));
        }
        self.check_range(offset, buf.len())?;
        if self.recovery_due {
            // As for orderless requests: a recovery that failed part way left connections it
            // had not finished with (fenced, or opened before a reset), and stream state (the
            // `prev` of each target, the marks) it had not brought to the targets' logs.
            self.recover_retrying()?;
        }
        let open = self.streams[stream as usize].open_pieces;
        let pieces = self.commands_for(offset, buf.len(), open)?;
        self.wait_for_room(stream, pieces)?;
        let st = &mut self.streams[stream as usize];
        let id = st.next_id;
        st.next_id += 1;
        st.not_done += 1;
        st.in_flight += 1;
        st.pieces_out += pieces;
        st.open_pieces += pieces;
        self.stats.peak_commands = self.stats.peak_commands.max(st.pieces_out);
        st.open.push(Req {
            id,
            offset,
            buf: Some(buf),
            pieces,
            completed: 0,
            durable: 0,
            failed: None,
            ipu,
        });
        if end_of_group {
            self.close_group(stream)?;
        }
        Ok(id)
    }

    /// Wait until the stream has room in its window and may hold another write. Once full, it
    /// waits until a quarter of the window is free, so the requests that follow go out in a
    /// burst and each turn of the connections serves several of them.
    ///
    /// `pieces`: the commands the new request takes. The stream's requests not handed back may
    /// take `VolumeConfig::max_commands` in all; past that it waits until they are under it again
    /// with the new request's (the caller refuses a request that could never fit).
    ///
    /// Only requests that are out can be waited for: those of the open group go out when it
    /// closes, so they are left out of the window's and the held writes' low marks, and the
    /// low mark of a limit applies only when that limit is what the call waits for.
    fn wait_for_room(&mut self, stream: u16, pieces: u32) -> Result<(), NetError> {
        let window = self.cfg.window;
        let held = window.saturating_mul(HELD_PER_WINDOW);
        let max = self.command_limit();
        let st = &self.streams[stream as usize];
        let window_full = st.in_flight >= window;
        let held_full = st.not_done >= held;
        if !window_full && !held_full && st.pieces_out + pieces <= max {
            return Ok(());
        }
        let window_low = window - window.div_ceil(4);
        let held_low = held - held.div_ceil(4);
        loop {
            let st = &self.streams[stream as usize];
            let open = st.open.len() as u32;
            let open_pieces = st.open_pieces;
            let window_ok = !window_full || st.in_flight - open <= window_low;
            let held_ok = !held_full || st.not_done - open <= held_low;
            let fits = st.pieces_out + pieces <= max;
            if window_ok && held_ok && fits {
                return Ok(());
            }
            if !fits && st.pieces_out == open_pieces {
                // Waiting cannot help: all the stream has out is its own open group.
                return Err(NetError::Config(format!(
                    "the stream's open group takes {open_pieces} commands and a request of {pieces} more would pass {max}: close the group first"
                )));
            }
            self.drive(true)?;
        }
    }

    fn close_group(&mut self, stream: u16) -> Result<(), NetError> {
        let s = stream as usize;
        let reqs = std::mem::take(&mut self.streams[s].open);
        self.streams[s].open_pieces = 0;
        if reqs.is_empty() {
            return Ok(());
        }
        let seq = self.streams[s].next_seq;
        self.streams[s].next_seq += 1;
        let g = Group { seq, reqs };
        self.streams[s].groups.push_back(g);
        if self.cfg.batch <= 1 {
            return self.send_group(stream, seq);
        }
        self.streams[s].held += 1;
        if self.streams[s].held >= self.cfg.batch {
            self.send_held(stream)?;
        }
        Ok(())
    }

    /// Send the stream's held groups in order: runs of mergeable groups (see
    /// [`VolumeConfig::batch`]) as one command each, the others as they are.
    fn send_held(&mut self, stream: u16) -> Result<(), NetError> {
        let s = stream as usize;
        let held = self.streams[s].held as u64;
        if held == 0 {
            return Ok(());
        }
        self.streams[s].held = 0;
        let end = self.streams[s].next_seq;
        let mut seq = end - held;
        let max = self.cfg.max_merge_bytes as u64;
        while seq < end {
            let Some((t, toff, len, reqs)) = self
                .contiguous(s, seq)
                .filter(|&(_, _, len, _)| len as u64 <= max)
            else {
                self.send_group(stream, seq)?;
                seq += 1;
                continue;
            };
            let (mut last, mut bytes, mut requests) = (seq, len as u64, reqs);
            while last + 1 < end {
                match self.contiguous(s, last + 1) {
                    Some((t2, off2, len2, reqs2))
                        if t2 == t && off2 == toff + bytes && bytes + len2 as u64 <= max =>
                    {
                        last += 1;
                        bytes += len2 as u64;
                        requests += reqs2;
                    }
                    _ => break,
                }
            }
            if requests == 1 {
                self.send_group(stream, seq)?;
            } else if !self.send_merged(stream, seq, last, t, toff, bytes as u32) {
                self.stats.merge_skipped += 1;
                for q in seq..=last {
                    self.send_group(stream, q)?;
                }
            }
            seq = last + 1;
        }
        Ok(())
    }

    /// Group `seq` as (target, target offset, length, requests) when its writes lie on one
    /// target, each following the one before: what a merge can take.
    fn contiguous(&self, s: usize, seq: u64) -> Option<(usize, u64, u32, u32)> {
        let g = self.streams[s].group(seq)?;
        let mut run: Option<(usize, u64, u32)> = None;
        for r in &g.reqs {
            if r.pieces != 1 {
                return None;
            }
            let len = r.buf.as_ref().map_or(0, |b| b.len() as u32);
            let (t, toff, _) = *self.pieces(r.offset, len).first()?;
            run = match run {
                None => Some((t, toff, len)),
                Some((t0, off0, n)) if t0 == t && off0 + n as u64 == toff => {
                    Some((t0, off0, n + len))
                }
                Some(_) => return None,
            };
        }
        let (t, toff, len) = run?;
        Some((t, toff, len, g.reqs.len() as u32))
    }

    /// Groups `first..=last` (their writes back to back on target `t` from `toff`, `len` bytes
    /// in all) as one merged command. `false`: the arena had no room for the copy, and
    /// nothing was sent.
    fn send_merged(
        &mut self,
        stream: u16,
        first: u64,
        last: u64,
        t: usize,
        toff: u64,
        len: u32,
    ) -> bool {
        let s = stream as usize;
        let nt = self.targets.len();
        // A miss is not the arena's exhaustion (the groups still go out): not counted as one.
        let Some(mut copy) = self.engine.try_alloc_run(len as usize) else {
            return false;
        };
        if copy.set_len(len as usize).is_err() {
            return false;
        }
        let st = &self.streams[s];
        let mut at = 0usize;
        let mut members = 0u16;
        let mut ipu = false;
        for q in first..=last {
            for r in &st.group(q).expect("held until durable").reqs {
                let b = r.buf.as_ref().expect("held until durable");
                copy[at..at + b.len()].copy_from_slice(b);
                at += b.len();
                members += 1;
                ipu |= r.ipu;
            }
        }
        let mark = self.take_mark(stream, t);
        let attr = WireAttr {
            stream,
            seq: first,
            seq_end: last,
            prev: self.streams[s].prev[t],
            // One group's writes merged: recovery counts them against `num`, as for any group.
            num: if first == last { members } else { 0 },
            members,
            boundary: true,
            merged: true,
            // One in-place update among them: the command is left as it lies by recovery.
            ipu,
            mark,
            ..WireAttr::default()
        };
        let ic = &mut self.conns[s * nt + t];
        let cid = ic.alloc(
            Kind::Merged {
                seq: first,
                seq_end: last,
            },
            (0, len),
        );
        ic.order.push_back(cid);
        let mut sqe = lba_cmd(op::WRITE, cid, toff, len, self.targets[t].lba_shift);
        attr.put(&mut sqe);
        let incap = ic.rkey.is_none() && len <= self.targets[t].incap;
        match ic.rkey {
            Some(key) => sqe.set_keyed_sgl(copy.as_ptr() as u64, len, key),
            None => sqe.set_sgl(len, incap),
        }
        ic.queue(&sqe, if incap { &copy[..] } else { &[][..] });
        ic.cmds[cid as usize].as_mut().expect("just allocated").copy = Some(copy);
        self.streams[s].prev[t] = last;
        self.stats.ordered_cmds += 1;
        self.stats.merged_cmds += 1;
        self.stats.merged_groups += last - first + 1;
        true
    }

    /// Send every piece of group `seq` (first send and replay alike).
    fn send_group(&mut self, stream: u16, seq: u64) -> Result<(), NetError> {
        let s = stream as usize;
        let nt = self.targets.len();
        let gi = (seq - self.streams[s].groups[0].seq) as usize;
        let mut plan: Plan = SmallVec::new();
        for (ri, r) in self.streams[s].groups[gi].reqs.iter().enumerate() {
            let len = r.buf.as_ref().map_or(0, |b| b.len() as u32);
            for (t, toff, range) in self.pieces(r.offset, len) {
                plan.push((ri as u32, t, toff, range));
            }
        }
        let num = plan.len() as u16;
        let prev_before: SmallVec<[u64; 8]> = self.streams[s].prev.iter().copied().collect();
        for (i, &(ri, t, toff, range)) in plan.iter().enumerate() {
            let last = i + 1 == plan.len();
            let mark = self.take_mark(stream, t);
            let attr = WireAttr {
                stream,
                seq,
                seq_end: seq,
                prev: prev_before[t],
                num: if last { num } else { 0 },
                members: 1,
                boundary: last,
                ipu: self.streams[s].groups[gi].reqs[ri as usize].ipu,
                mark,
                ..WireAttr::default()
            };
            let ic = &mut self.conns[s * nt + t];
            let cid = ic.alloc(Kind::Ordered { seq, req: ri }, range);
            ic.order.push_back(cid);
            let len = range.1 - range.0;
            let mut sqe = lba_cmd(op::WRITE, cid, toff, len, self.targets[t].lba_shift);
            attr.put(&mut sqe);
            let buf = self.streams[s].groups[gi].reqs[ri as usize]
                .buf
                .as_ref()
                .expect("held until durable");
            let ic = &mut self.conns[s * nt + t];
            let incap = ic.rkey.is_none() && len <= self.targets[t].incap;
            match ic.rkey {
                Some(key) => sqe.set_keyed_sgl(buf.as_ptr() as u64 + range.0 as u64, len, key),
                None => sqe.set_sgl(len, incap),
            }
            let data = if incap {
                &buf[range.0 as usize..range.1 as usize]
            } else {
                &[][..]
            };
            ic.queue(&sqe, data);
            self.stats.ordered_cmds += 1;
        }
        for &(_, t, _, _) in &plan {
            self.streams[s].prev[t] = seq;
        }
        Ok(())
    }

    /// The mark to piggyback on the next ordered command to `t` (0: nothing new).
    fn take_mark(&mut self, stream: u16, t: usize) -> u64 {
        let st = &mut self.streams[stream as usize];
        let durable = st.durable_below.min(st.failed_from);
        if durable > st.mark_told[t].max(1) {
            st.mark_told[t] = durable;
            durable
        } else {
            0
        }
    }

    /// Orderless write (no attribute); handed back at completion (not necessarily durable).
    pub fn write_orderless(
        &mut self,
        stream: u16,
        offset: u64,
        buf: FixedBuf,
    ) -> Result<u64, NetError> {
        self.plain_io(stream, offset, buf, false)
    }

    /// Read into `buf`; handed back with the data.
    pub fn read(&mut self, stream: u16, offset: u64, buf: FixedBuf) -> Result<u64, NetError> {
        self.plain_io(stream, offset, buf, true)
    }

    fn plain_io(
        &mut self,
        stream: u16,
        offset: u64,
        buf: FixedBuf,
        read: bool,
    ) -> Result<u64, NetError> {
        self.check_stream(stream)?;
        self.check_range(offset, buf.len())?;
        if self.recovery_due {
            // A recovery that failed part way may have fenced or reset a target: the
            // connections left from before it would be refused writes there.
            self.recover_retrying()?;
        }
        let n = self.commands_for(offset, buf.len(), 0)?;
        self.wait_for_room(stream, n)?;
        let s = stream as usize;
        let nt = self.targets.len();
        let id = self.streams[s].next_id;
        self.streams[s].next_id += 1;
        self.streams[s].not_done += 1;
        self.streams[s].in_flight += 1;
        self.streams[s].pieces_out += n;
        self.stats.peak_commands = self.stats.peak_commands.max(self.streams[s].pieces_out);
        let pieces = self.pieces(offset, buf.len() as u32);
        let slot = match self.plain_free.pop() {
            Some(x) => x,
            None => {
                self.plain.push(None);
                (self.plain.len() - 1) as u32
            }
        };
        for &(t, toff, range) in &pieces {
            let ic = &mut self.conns[s * nt + t];
            let cid = ic.alloc(Kind::Plain { slot }, range);
            let opcode = if read { op::READ } else { op::WRITE };
            let len = range.1 - range.0;
            let mut sqe = lba_cmd(opcode, cid, toff, len, self.targets[t].lba_shift);
            let incap = !read && ic.rkey.is_none() && len <= self.targets[t].incap;
            match ic.rkey {
                Some(key) if !read => {
                    sqe.set_keyed_sgl(buf.as_ptr() as u64 + range.0 as u64, len, key)
                }
                _ => sqe.set_sgl(len, incap),
            }
            let data = if !incap {
                &[][..]
            } else {
                &buf[range.0 as usize..range.1 as usize]
            };
            ic.queue(&sqe, data);
        }
        self.plain[slot as usize] = Some(Plain {
            stream,
            id,
            read,
            buf: Some(buf),
            pieces: pieces.len() as u32,
            failed: None,
        });
        Ok(id)
    }

    /// Plain FLUSH of every target on `stream`'s connections, waited for (synchronous ordering:
    /// what a stack without Rio does between dependent writes).
    pub fn flush_all(&mut self, stream: u16) -> Result<(), NetError> {
        self.check_stream(stream)?;
        if self.recovery_due {
            // As for orderless requests: a recovery that failed part way may have fenced the
            // connections this FLUSH would go on.
            self.recover_retrying()?;
        }
        let s = stream as usize;
        let nt = self.targets.len();
        self.caller_flush_error = None;
        self.caller_flushes_out = nt as u32;
        for t in 0..nt {
            let ic = &mut self.conns[s * nt + t];
            let cid = ic.alloc(Kind::CallerFlush, (0, 0));
            ic.queue(&ns_cmd(op::FLUSH, cid), &[]);
            self.stats.flushes += 1;
        }
        while (0..nt).any(|t| self.conns[s * nt + t].outstanding > 0) {
            self.drive(true)?;
        }
        if let Some(e) = self.caller_flush_error.take() {
            return Err(NetError::Config(format!("FLUSH: {e}")));
        }
        if std::mem::take(&mut self.caller_flushes_out) > 0 {
            // Some went unanswered with a failed connection; its target may have lost what
            // they were to make durable.
            return Err(NetError::Config(
                "a connection failed while the FLUSH was out (a recovery ran): orderless writes handed back before it may not be durable; write them again".into(),
            ));
        }
        Ok(())
    }

    /// Close the open group, make every ordered write of the stream durable, and wait until
    /// they are all handed back. Orderless writes and reads are not waited for (they are handed
    /// back at completion; [`Volume::flush_all`] makes orderless writes durable).
    pub fn wait(&mut self, stream: u16) -> Result<(), NetError> {
        self.check_stream(stream)?;
        if self.recovery_due {
            // Before the open group goes out (see `submit`).
            self.recover_retrying()?;
        }
        self.close_group(stream)?;
        let s = stream as usize;
        loop {
            let st = &self.streams[s];
            if st.groups.is_empty() && st.open.is_empty() {
                break;
            }
            self.drive(true)?;
        }
        self.tell_marks(stream);
        Ok(())
    }

    /// Finished requests so far (without waiting).
    pub fn poll(&mut self) -> Result<Vec<Done>, NetError> {
        let mut out = Vec::new();
        self.poll_into(&mut out)?;
        Ok(out)
    }

    /// [`Volume::poll`], appending to `out`: no allocation while `out` has room for what
    /// finished since the last poll, which is never more than [`Volume::max_done`] (requests
    /// handed back leave the window, so it can be more than the window: size `out` for
    /// `max_done`, not for the window).
    pub fn poll_into(&mut self, out: &mut Vec<Done>) -> Result<(), NetError> {
        self.drive(false)?;
        out.extend(self.ready.drain(..));
        Ok(())
    }

    /// Wait until at least one request is handed back.
    pub fn wait_any(&mut self) -> Result<Vec<Done>, NetError> {
        while self.ready.is_empty() {
            let sent = self.streams.iter().any(|s| !s.groups.is_empty())
                || self.plain.iter().any(|p| p.is_some());
            if !sent {
                return Ok(Vec::new());
            }
            self.drive(true)?;
        }
        Ok(self.ready.drain(..).collect())
    }

    /// Send an ordered FLUSH on each of the stream's connections (to targets without power-loss
    /// protection) that has completed writes not yet durable and no FLUSH out.
    fn maybe_flush(&mut self, stream: u16) {
        let s = stream as usize;
        let nt = self.targets.len();
        // The last group sent: held groups go out after this FLUSH, so it must not cover
        // them (recovery counts an entry durable when a FLUSH at or after its group is).
        let last = self.streams[s].next_seq - 1 - self.streams[s].held as u64;
        // Nor any group from the first that failed on.
        let last = last.min(self.streams[s].failed_from.saturating_sub(1));
        for t in 0..nt {
            if self.targets[t].plp || self.conns[s * nt + t].volatile == 0 {
                continue;
            }
            if self.conns[s * nt + t].flush_out {
                continue; // one at a time
            }

            let mark = self.take_mark(stream, t);
            let ic = &mut self.conns[s * nt + t];
            ic.flush_out = true;
            let covers = ic.sent;
            let cid = ic.alloc(Kind::Flush { covers }, (0, 0));
            let mut sqe = ns_cmd(op::FLUSH, cid);
            WireAttr {
                stream,
                seq: last,
                seq_end: last,
                flush: true,
                mark,
                ..WireAttr::default()
            }
            .put(&mut sqe);
            ic.queue(&sqe, &[]);
            self.stats.flushes += 1;
        }
    }

    /// Tell the targets the stream's durability mark where they have not heard it.
    fn tell_marks(&mut self, stream: u16) {
        let s = stream as usize;
        let nt = self.targets.len();
        for t in 0..nt {
            let mark = self.take_mark(stream, t);
            if mark == 0 {
                continue;
            }
            let ic = &mut self.conns[s * nt + t];
            let cid = ic.alloc(Kind::Mark, (0, 0));
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::RIO_MARK);
            sqe.set_cid(cid);
            sqe.ensure_sgl();
            sqe.set_cdw(10, stream as u32);
            sqe.set_cdw(11, mark as u32);
            sqe.set_cdw(12, (mark >> 32) as u32);
            ic.queue(&sqe, &[]);
            self.stats.marks += 1;
        }
    }

    /// Move everything along: send, receive, complete. `block`: wait for the network when there
    /// is nothing to do. A failed target starts recovery.
    fn drive(&mut self, block: bool) -> Result<(), NetError> {
        let ready = self.ready.len();
        if self.recovery_due {
            self.recover_retrying()?;
        }
        for stream in 0..self.cfg.streams {
            self.send_held(stream)?;
        }
        // What a recovery just handed back is news for the caller: no wait for the network.
        let block = block && self.ready.len() == ready;
        match self.drive_once(block, false) {
            Ok(()) => self.recover_after_failure(),
            Err((t, why)) => {
                if self.cfg.verbose {
                    eprintln!(
                        "aios initiator: target {} failed ({why}); recovering",
                        self.targets[t].addr
                    );
                }
                self.recover_with_retry(t)?;
                Ok(())
            }
        }
    }

    /// Recover once a stream's failed group has been handed back. Until then the stream's
    /// later groups cannot become durable in order, and the targets keep every log entry from
    /// the failed group on (no mark passes it), which would fill their logs for all streams.
    /// Recovery hands back the stream's groups beyond the durable prefix failed, zeroes their
    /// writes and resets the logs so the stream resumes at its next group; other streams'
    /// held groups are sent again.
    fn recover_after_failure(&mut self) -> Result<(), NetError> {
        let due = self.streams.iter().any(|st| {
            st.failed_from != u64::MAX && st.groups.front().is_none_or(|g| g.seq > st.failed_from)
        });
        if !due {
            return Ok(());
        }
        if self.cfg.verbose {
            eprintln!("aios initiator: a group failed on a target's device; recovering");
        }
        self.recover_retrying().map(|_| ())
    }

    /// What the last recovery found and did, whoever started it: [`Volume::open`], a caller's
    /// [`Volume::recover`], a failed connection or a group that failed on a target. Its
    /// `in_place` lists the in-place updates beyond the prefixes, which recovery leaves as
    /// they lie (they may be torn across targets): the upper layer's to repair.
    pub fn last_recovery(&self) -> Option<&RecoveryReport> {
        self.last_recovery.as_ref()
    }

    /// One turn of every connection. `block`: wait (up to 100 ms) for the network when the
    /// turn got nothing. `skip_gone`: a connection already dropped is passed over, not
    /// reported (recovery's first step, waiting on the connections still up: it returned at
    /// once, and the step spun the CPU until the others answered).
    fn drive_once(&mut self, block: bool, skip_gone: bool) -> Result<(), (usize, String)> {
        let nt = self.targets.len();
        self.stats.turns += 1;
        let mut progress = false;
        let mut gone = None;
        for i in 0..self.conns.len() {
            let t = i % nt;
            let Some(c) = self.conns[i].conn.as_mut() else {
                if !skip_gone {
                    gone.get_or_insert(t);
                }
                continue;
            };
            c.flush().map_err(|e| (t, format!("send: {e}")))?;
            let n = c.fill().map_err(|e| (t, format!("receive: {e}")))?;
            if n > 0 {
                progress = true;
                self.conns[i].last_progress = Instant::now();
            }
            progress |= self.take_pdus(i).map_err(|e| (t, e))?;
            let ic = &self.conns[i];
            if ic.conn.as_ref().is_some_and(|c| c.eof) {
                return Err((t, "the target closed the connection".into()));
            }
            if ic.outstanding > 0 && ic.last_progress.elapsed() > self.cfg.io_timeout {
                return Err((t, format!("no answer for {:?}", self.cfg.io_timeout)));
            }
        }
        if let Some(t) = gone {
            return Err((t, "not connected".into()));
        }
        for s in 0..self.cfg.streams {
            self.maybe_flush(s);
            if self.streams[s as usize].not_done == 0 {
                self.tell_marks(s);
            }
        }
        for i in 0..self.conns.len() {
            if let Some(c) = self.conns[i].conn.as_mut() {
                c.flush().map_err(|e| (i % nt, format!("send: {e}")))?;
            }
        }
        // Requests handed back before this turn are no reason not to wait: `wait`, `flush_all`
        // and recovery wait on the network whether or not the caller has taken them (they
        // spun the CPU until it had).
        if progress || !block {
            return Ok(());
        }
        let fds: crate::conn::WaitFds<'_> = self
            .conns
            .iter()
            .filter_map(|ic| ic.conn.as_ref())
            .flat_map(|c| c.fds(true))
            .collect();
        let _ = wait_fds(&fds, Some(Duration::from_millis(100)));
        Ok(())
    }

    /// Decode and apply the PDUs connection `i` has received.
    fn take_pdus(&mut self, i: usize) -> Result<bool, String> {
        let nt = self.targets.len();
        let s = i / nt;
        let mut any = false;
        loop {
            let ic = &mut self.conns[i];
            let Some(c) = ic.conn.as_mut() else {
                return Ok(any);
            };
            let dg = c.dg;
            let (p, n) = match pdu::decode(c.rx.pending(), dg, c.max_pdu) {
                Ok(Some(x)) => x,
                Ok(None) => return Ok(any),
                Err(e) => return Err(e.to_string()),
            };
            any = true;
            match p {
                Pdu::Resp { cqe } => {
                    c.rx.consume(n);
                    self.on_cqe(s, i, cqe)?;
                }
                Pdu::C2HData {
                    cccid,
                    datao,
                    data,
                    last,
                    success,
                } => {
                    let Some(cmd) = ic.cmds.get(cccid as usize).and_then(|c| c.as_ref()) else {
                        return Err(format!("data for unknown command {cccid}"));
                    };
                    let Kind::Plain { slot } = cmd.kind else {
                        return Err(format!("data for command {cccid}, which reads nothing"));
                    };
                    let (a, b) = cmd.range;
                    if datao as u64 + data.len() as u64 > (b - a) as u64 {
                        return Err(format!(
                            "{} bytes at {datao} for a {}-byte read",
                            data.len(),
                            b - a
                        ));
                    }
                    let p = self.plain[slot as usize]
                        .as_mut()
                        .ok_or("data for a finished read")?;
                    // A target's data aimed at an orderless write would land in the write's
                    // buffer (the caller's data, still to go out after an R2T).
                    if !p.read {
                        return Err(format!("data for command {cccid}, a write"));
                    }
                    let buf = p.buf.as_mut().expect("held until done");
                    let at = a as usize + datao as usize;
                    buf[at..at + data.len()].copy_from_slice(data);
                    c.rx.consume(n);
                    if last && success {
                        // The target skips the CapsuleResp of a read that succeeded.
                        let qid = (s + 1) as u16;
                        let cqe = Cqe {
                            cid: cccid,
                            sqid: qid,
                            ..Cqe::default()
                        };
                        self.on_cqe(s, i, cqe)?;
                    }
                }
                Pdu::R2T {
                    cccid,
                    ttag,
                    r2to,
                    r2tl,
                } => {
                    c.rx.consume(n);
                    self.on_r2t(s, i, cccid, ttag, r2to, r2tl)?;
                }
                Pdu::TermReq { fes, .. } => {
                    return Err(format!(
                        "the target terminated the connection (status {fes:#x})"
                    ))
                }
                other => return Err(format!("unexpected PDU {other:?}")),
            }
        }
    }

    /// The target is ready for `r2tl` bytes at `r2to` of write `cccid`: send them as H2CData
    /// PDUs of at most its MAXH2CDATA each.
    fn on_r2t(
        &mut self,
        s: usize,
        i: usize,
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    ) -> Result<(), String> {
        let ic = &mut self.conns[i];
        let Some(cmd) = ic.cmds.get(cccid as usize).and_then(|c| c.as_ref()) else {
            return Err(format!("R2T for unknown command {cccid}"));
        };
        let (a, b) = cmd.range;
        if r2tl == 0 || r2to as u64 + r2tl as u64 > (b - a) as u64 {
            return Err(format!(
                "R2T for {r2tl} bytes at {r2to} of a {}-byte write",
                b - a
            ));
        }
        let buf = match cmd.kind {
            Kind::Ordered { seq, req } => {
                let st = &self.streams[s];
                let gi = seq
                    .checked_sub(st.groups.front().map_or(u64::MAX, |g| g.seq))
                    .ok_or("R2T for a write already handed back")?;
                st.groups
                    .get(gi as usize)
                    .and_then(|g| g.reqs.get(req as usize))
                    .and_then(|r| r.buf.as_ref())
                    .ok_or("R2T for a write already handed back")?
            }
            Kind::Plain { slot } => match self.plain[slot as usize].as_ref() {
                Some(p) if p.read => return Err(format!("R2T for command {cccid}, a read")),
                p => p
                    .and_then(|p| p.buf.as_ref())
                    .ok_or("R2T for a finished write")?,
            },
            Kind::Merged { .. } => cmd
                .copy
                .as_ref()
                .ok_or("R2T for a merged write without data")?,
            _ => return Err(format!("R2T for command {cccid}, which sends no data")),
        };
        let c = ic.conn.as_mut().expect("the R2T came on it");
        let from = a as usize + r2to as usize;
        let end = from + r2tl as usize;
        let step = c.maxh2cdata as usize;
        let mut at = from;
        while at < end {
            let m = (end - at).min(step);
            pdu::put_h2c_data(
                &mut c.tx,
                cccid,
                ttag,
                (at - a as usize) as u32,
                &buf[at..at + m],
                at + m == end,
                c.dg,
            );
            at += m;
        }
        Ok(())
    }

    fn on_cqe(&mut self, s: usize, i: usize, cqe: Cqe) -> Result<(), String> {
        let nt = self.targets.len();
        let t = i % nt;
        let ic = &mut self.conns[i];
        let Some(cmd) = ic.cmds.get_mut(cqe.cid as usize).and_then(|c| c.as_mut()) else {
            return Err(format!("completion for unknown command {}", cqe.cid));
        };
        if cmd.completed {
            return Err(format!("second completion for command {}", cqe.cid));
        }
        cmd.completed = true;
        let kind = cmd.kind;
        ic.outstanding -= 1;
        ic.answered();
        let err = (!cqe.ok()).then(|| {
            let (sct, sc) = cqe.sct_sc();
            format!(
                "target {} failed the command: status type {sct:#x} code {sc:#04x}",
                self.targets[t].addr
            )
        });
        match kind {
            Kind::Ordered { seq, req } => {
                self.piece_completed(s, seq, req);
                if let Some(e) = err {
                    let st = &mut self.streams[s];
                    st.failed_from = st.failed_from.min(seq);
                    self.conns[i].order.retain(|&c| c != cqe.cid);
                    self.conns[i].release(cqe.cid);
                    self.piece_durable(s, seq, req, Some(e));
                } else if self.targets[t].plp {
                    self.conns[i].order.retain(|&c| c != cqe.cid);
                    self.conns[i].release(cqe.cid);
                    self.piece_durable(s, seq, req, None);
                } else {
                    self.conns[i].volatile += 1;
                }
            }
            Kind::Merged { seq, seq_end } => {
                for q in seq..=seq_end {
                    for r in 0..self.streams[s].group_len(q) {
                        self.piece_completed(s, q, r);
                    }
                }
                if err.is_some() {
                    let st = &mut self.streams[s];
                    st.failed_from = st.failed_from.min(seq);
                }
                if err.is_some() || self.targets[t].plp {
                    self.conns[i].order.retain(|&c| c != cqe.cid);
                    self.conns[i].release(cqe.cid);
                    for q in seq..=seq_end {
                        for r in 0..self.streams[s].group_len(q) {
                            self.piece_durable(s, q, r, err.clone());
                        }
                    }
                } else {
                    self.conns[i].volatile += 1;
                }
            }
            Kind::Flush { covers } => {
                let ic = &mut self.conns[i];
                ic.release(cqe.cid);
                ic.flush_out = false;
                if let Some(e) = &err {
                    // Nothing it covered is durable, and a later FLUSH that succeeds says
                    // nothing about what this one may have dropped: the groups of every piece
                    // still waiting on this connection, and all after them, fail. Those that
                    // have completed are handed back failed now (a later FLUSH could only be
                    // refused too: the target keeps the failure until a recovery).
                    eprintln!("aios initiator: ordered FLUSH failed: {e}");
                    let ic = &self.conns[i];
                    let lowest =
                        ic.order
                            .iter()
                            .filter_map(|&c| match ic.cmds[c as usize].as_ref().map(|c| c.kind) {
                                Some(Kind::Ordered { seq, .. })
                                | Some(Kind::Merged { seq, .. }) => Some(seq),
                                _ => None,
                            })
                            .min();
                    if let Some(low) = lowest {
                        let st = &mut self.streams[s];
                        st.failed_from = st.failed_from.min(low);
                    }
                }
                // Scratch lists kept for their allocations.
                let mut now_durable = std::mem::take(&mut self.durable_scratch);
                let mut keep = std::mem::take(&mut self.order_scratch);
                let ic = &mut self.conns[i];
                while let Some(cid) = ic.order.pop_front() {
                    let c = ic.cmds[cid as usize].as_ref().expect("ordered piece");
                    if c.completed && (err.is_some() || c.sent_no <= covers) {
                        match c.kind {
                            Kind::Ordered { seq, req } => now_durable.push((seq, req)),
                            Kind::Merged { seq, seq_end } => {
                                for q in seq..=seq_end {
                                    let n = self.streams[s].group_len(q);
                                    now_durable.extend((0..n).map(|r| (q, r)));
                                }
                            }
                            _ => {}
                        }
                        ic.release(cid);
                        ic.volatile -= 1;
                    } else {
                        keep.push_back(cid);
                    }
                }
                self.order_scratch = std::mem::replace(&mut ic.order, keep);
                for &(seq, req) in &now_durable {
                    self.piece_durable(s, seq, req, err.clone());
                }
                now_durable.clear();
                self.durable_scratch = now_durable;
            }
            Kind::Mark => {
                self.conns[i].release(cqe.cid);
            }
            Kind::PlainFlush => {
                self.conns[i].release(cqe.cid);
                if let Some(e) = err {
                    return Err(e);
                }
            }
            Kind::CallerFlush => {
                self.conns[i].release(cqe.cid);
                self.caller_flushes_out = self.caller_flushes_out.saturating_sub(1);
                // The target marks its streams failed; their next ordered FLUSH says so.
                if let Some(e) = err {
                    self.caller_flush_error.get_or_insert(e);
                }
            }
            Kind::Plain { slot } => {
                self.conns[i].release(cqe.cid);
                let p = self.plain[slot as usize]
                    .as_mut()
                    .ok_or("completion for a finished request")?;
                p.pieces -= 1;
                self.streams[p.stream as usize].pieces_out -= 1;
                if let Some(e) = err {
                    p.failed.get_or_insert(e);
                }
                if p.pieces == 0 {
                    let p = self.plain[slot as usize].take().expect("present");
                    self.plain_free.push(slot);
                    self.streams[p.stream as usize].not_done -= 1;
                    self.streams[p.stream as usize].in_flight -= 1;
                    self.ready.push_back(Done {
                        stream: p.stream,
                        seq: 0,
                        id: p.id,
                        result: p.failed.map_or(Ok(()), Err),
                        buf: p.buf.expect("held"),
                    });
                }
            }
        }
        Ok(())
    }

    /// The targets completed a piece of request `req` of group `seq`: the request leaves the
    /// window when all its pieces have.
    fn piece_completed(&mut self, s: usize, seq: u64, req: u32) {
        let st = &mut self.streams[s];
        let Some(gi) = st.groups.front().and_then(|f| seq.checked_sub(f.seq)) else {
            return;
        };
        let Some(r) = st
            .groups
            .get_mut(gi as usize)
            .and_then(|g| g.reqs.get_mut(req as usize))
        else {
            return;
        };
        r.completed += 1;
        if r.completed == r.pieces {
            st.in_flight -= 1;
        }
    }

    /// A piece of request `req` of group `seq` is durable (or failed): hand back what is now
    /// durable in order.
    fn piece_durable(&mut self, s: usize, seq: u64, req: u32, failed: Option<String>) {
        let st = &mut self.streams[s];
        let Some(front) = st.groups.front() else {
            return;
        };
        let gi = (seq - front.seq) as usize;
        let r = &mut st.groups[gi].reqs[req as usize];
        r.durable += 1;
        if let Some(e) = failed {
            r.failed.get_or_insert(e);
        }
        while let Some(g) = st.groups.front() {
            if g.reqs.iter().any(|r| r.durable < r.pieces) {
                break;
            }
            let g = st.groups.pop_front().expect("front");
            st.durable_below = g.seq + 1;
            let failed_from = st.failed_from;
            let after_failure = g.seq >= failed_from;
            hand_back(&mut self.ready, st, s, g, |r| {
                match r.failed.take() {
                Some(e) => Err(e),
                None if after_failure => Err(format!(
                    "group {failed_from} of stream {s} failed: this later group is not durable in order until recovery"
                )),
                None => Ok(()),
            }
            });
        }
    }
}

/// Hand back every request of group `g` of stream `s` (no longer held) with `result(request)`.
fn hand_back(
    ready: &mut VecDeque<Done>,
    st: &mut Stream,
    s: usize,
    g: Group,
    result: impl Fn(&mut Req) -> Result<(), String>,
) {
    for mut r in g.reqs {
        st.not_done -= 1;
        st.pieces_out -= r.pieces;
        let result = result(&mut r);
        ready.push_back(Done {
            stream: s as u16,
            seq: g.seq,
            id: r.id,
            result,
            buf: r.buf.expect("held until handed back"),
        });
    }
}

enum Reply {
    IcResp { dgst: u8, maxh2cdata: u32 },
    Resp(Cqe, Vec<u8>),
}

impl Volume {
    /// Recovery after target `failed`'s connection failed: [`Volume::recover_retrying`], its
    /// error naming that target.
    fn recover_with_retry(&mut self, failed: usize) -> Result<RecoveryReport, NetError> {
        let start = Instant::now();
        self.recover_retrying().map_err(|e| NetError::Unreachable {
            peer: self.targets[failed].addr.to_string(),
            secs: start.elapsed().as_secs_f64(),
            why: e.to_string(),
        })
    }

    /// Run [`Volume::recover`], and again every 100 ms while it fails (a target restarting, a
    /// link coming back, a connection lost during the recovery itself), for up to
    /// `reconnect_for`; then its last error.
    fn recover_retrying(&mut self) -> Result<RecoveryReport, NetError> {
        let start = Instant::now();
        loop {
            match self.recover() {
                Ok(r) => return Ok(r),
                Err(e) => {
                    if self.cfg.verbose {
                        eprintln!("aios initiator: recovery attempt failed: {e}");
                    }
                    if start.elapsed() > self.cfg.reconnect_for {
                        return Err(e);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Recovery across the targets (see the module docs). Safe to run at any time; runs by
    /// itself when a target fails. One that fails part way is run again by the volume's next
    /// call that drives I/O (it may have dropped connections holding commands of groups not
    /// yet durable, which only a recovery sends again). Over a standard NVMe/TCP target (one
    /// that refuses `RIO_INFO`: no log, no ordered writes) it reconnects, and nothing more.
    pub fn recover(&mut self) -> Result<RecoveryReport, NetError> {
        self.recovery_due = true;
        let r = self.recover_steps();
        if r.is_ok() {
            self.recovery_due = false;
        }
        r
    }

    fn recover_steps(&mut self) -> Result<RecoveryReport, NetError> {
        let started = Instant::now();
        let nt = self.targets.len();
        self.stats.recoveries += 1;
        // 1. Let connections that still work answer what they hold (bounded), then drop them:
        //    nothing sent before the reset may land after it.
        let deadline = deadline_after(self.cfg.io_timeout);
        while Instant::now() < deadline
            && self
                .conns
                .iter()
                .any(|c| c.conn.is_some() && c.outstanding > 0)
        {
            if let Err((t, _)) = self.drive_once(true, true) {
                for s in 0..self.cfg.streams as usize {
                    self.conns[s * nt + t].conn = None;
                }
            }
        }
        for ic in &mut self.conns {
            ic.reset();
        }
        // Orderless requests in flight are lost with their connections: fail them.
        for slot in 0..self.plain.len() {
            if let Some(p) = self.plain[slot].take() {
                self.plain_free.push(slot as u32);
                self.streams[p.stream as usize].pieces_out -= p.pieces;
                self.streams[p.stream as usize].not_done -= 1;
                self.streams[p.stream as usize].in_flight -= 1;
                self.ready.push_back(Done {
                    stream: p.stream,
                    seq: 0,
                    id: p.id,
                    result: Err("the connection failed; recovery ran".into()),
                    buf: p.buf.expect("held"),
                });
            }
        }
        // 2. Admin connections and the logs.
        for t in 0..nt {
            let alive = self.targets[t].admin.is_some() && {
                let mut info = Sqe::default();
                info.set_opcode(op::RIO_INFO);
                // Any answer shows the queue works: a standard target refuses RIO_INFO (it
                // was taken for a dead connection, dropped and dialled again).
                match self.admin(t, info, &[], "RIO_INFO") {
                    Ok(_) | Err(NetError::Status { .. }) => true,
                    Err(_) => false,
                }
            };
            if !alive {
                self.targets[t].admin = None;
                self.connect_admin(t)?;
            }
        }
        if self.targets.iter().any(|t| !t.rio) {
            // A standard target keeps no log, and the volume then takes no ordered writes:
            // recovery is a reconnection (the orderless requests in flight failed above). It
            // used to fail here, so one lost connection left a volume over a standard target
            // failing every later call.
            if self
                .streams
                .iter()
                .any(|st| !st.groups.is_empty() || !st.open.is_empty())
            {
                return Err(NetError::Config(
                    "recovery needs Rio targets: the volume holds ordered writes and one of its targets is a plain NVMe/TCP target".into(),
                ));
            }
            for s in 0..self.cfg.streams {
                for t in 0..nt {
                    self.connect_io(s, t)?;
                }
            }
            let report = RecoveryReport {
                prefix_end: self.streams.iter().map(|st| st.next_seq).collect(),
                took: started.elapsed(),
                ..RecoveryReport::default()
            };
            self.last_recovery = Some(report.clone());
            return Ok(report);
        }
        // Fence every target before reading its log: a connection dropped above, or one of
        // an initiator that crashed, may still deliver writes (bytes the network held, a
        // target slow to act on what it received). A write landing after its log was read
        // and its group zeroed would tear the group; after the fence none can land, and the
        // ones already sent are complete and in the log.
        for t in 0..nt {
            let mut fence = Sqe::default();
            fence.set_opcode(op::RIO_FENCE);
            self.admin(t, fence, &[], "RIO_FENCE")?;
        }
        let mut scans = Vec::new();
        for t in 0..nt {
            let mut sc = self.fetch_log(t)?;
            for (_, a) in &mut sc.entries {
                a.target = t as u16;
            }
            scans.push(sc);
        }
        let merged = LogScan::merge(&scans)?;
        let plp: Vec<bool> = self.targets.iter().map(|t| t.plp).collect();
        let rec = recover(&merged, &|t| plp.get(t as usize).copied().unwrap_or(false));
        let prefix = rec.resume_marks();
        let mut marks = prefix.clone();
        // Acknowledged writes must be inside the prefix (groups from a stream's first failure
        // on were handed back failed, not acknowledged).
        for (s, st) in self.streams.iter().enumerate() {
            let acked_below = st.durable_below.min(st.failed_from);
            if marks.get(s).copied().unwrap_or(1) < acked_below {
                return Err(NetError::Config(format!(
                    "stream {s}: the targets' logs end the durable prefix at group {}, but groups up to {} were acknowledged durable (a target lost its attribute log?)",
                    marks[s],
                    acked_below - 1
                )));
            }
        }
        // A stream that failed gives up every group beyond its prefix (step 5 hands them back
        // failed): groups sent after a failed one must not become durable without it, and
        // those before it that are not durable yet cannot be told apart from the rest in a
        // later recovery once the failed ones are gone. It resumes at its next group, so the
        // targets' in-order gate does not wait for groups nobody will send again; the writes
        // of the groups given up lie beyond the prefix and are zeroed below like any other.
        // They are handed back now, before anything is zeroed or reset: a retry of this
        // recovery after a reset finds the logs' prefix moved to the stream's next group, and
        // must not take the groups below it for durable.
        for s in 0..self.streams.len() {
            let st = &mut self.streams[s];
            if st.failed_from == u64::MAX {
                continue;
            }
            if let Some(m) = marks.get_mut(s) {
                *m = (*m).max(st.next_seq);
            }
            let durable = prefix.get(s).copied().unwrap_or(1).max(1);
            let failed_from = st.failed_from;
            while let Some(g) = st.groups.pop_front() {
                let result = if g.seq < durable {
                    Ok(())
                } else {
                    Err(format!(
                        "group {failed_from} of stream {s} failed on a target: recovery discarded the stream's groups from {durable} on"
                    ))
                };
                hand_back(&mut self.ready, st, s, g, |_| result.clone());
            }
            st.held = 0;
        }
        // 3. Zero what lies beyond the prefixes (out-of-place writes), flush.
        for s in 0..self.cfg.streams {
            for t in 0..nt {
                self.connect_io(s, t)?;
            }
        }
        let mut report = RecoveryReport {
            prefix_end: prefix,
            ..RecoveryReport::default()
        };
        for sr in &rec.streams {
            for a in &sr.beyond {
                if a.ipu {
                    report.in_place.push(*a);
                } else if a.len > 0 {
                    self.zero(a.target as usize, a.offset, a.len)?;
                    report.discarded += 1;
                }
            }
        }
        // The zeroing completes before the FLUSH goes: a FLUSH makes durable only what had
        // completed when the device took it, and the reset below drops the entries that name
        // these writes (a power cut would bring their bytes back with nothing to zero them).
        self.settle()?;
        for t in 0..nt {
            let ic = &mut self.conns[t];
            let cid = ic.alloc(Kind::PlainFlush, (0, 0));
            ic.queue(&ns_cmd(op::FLUSH, cid), &[]);
        }
        self.settle()?;
        // 4. Reset every log to the prefixes: a new epoch and generation.
        for t in 0..nt {
            let ls = self.targets[t].log_streams as usize;
            let mut d = Vec::with_capacity(ls * 8);
            for s in 0..ls {
                d.extend_from_slice(&marks.get(s).copied().unwrap_or(1).max(1).to_le_bytes());
            }
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::RIO_RESET);
            sqe.set_sgl(d.len() as u32, true);
            self.admin(t, sqe, &d, "RIO_RESET")?;
        }
        for s in 0..self.cfg.streams {
            for t in 0..nt {
                self.connect_io(s, t)?;
            }
        }
        // 5. Streams resume at their prefix; groups held beyond it are sent again (a stream
        // that failed resumes after them, and they come back failed).
        for s in 0..self.cfg.streams as usize {
            let p = marks.get(s).copied().unwrap_or(1).max(1);
            let durable = report.prefix_end.get(s).copied().unwrap_or(1).max(1);
            let st = &mut self.streams[s];
            st.prev.iter_mut().for_each(|x| *x = 0);
            st.mark_told.iter_mut().for_each(|x| *x = p);
            // The targets' logs are reset: earlier failures are behind the marks.
            st.failed_from = u64::MAX;
            // Groups now known durable are handed back (a failed stream has none left).
            while st.groups.front().is_some_and(|g| g.seq < durable) {
                let g = st.groups.pop_front().expect("front");
                hand_back(&mut self.ready, st, s, g, |_| Ok(()));
            }
            st.durable_below = p;
            // Held groups too: the replay below sends every group there is.
            st.held = 0;
            if st.groups.is_empty() {
                // Nothing held beyond the prefix: the stream goes on where it stops.
                st.next_seq = p;
            }
            let seqs: Vec<u64> = st.groups.iter().map(|g| g.seq).collect();
            for g in st.groups.iter_mut() {
                for r in &mut g.reqs {
                    r.completed = 0;
                    r.durable = 0;
                    r.failed = None;
                }
            }
            // Everything held is in flight again (the replay below resends it), and so are
            // the writes of the open group; orderless requests were failed above.
            st.in_flight =
                (st.open.len() + st.groups.iter().map(|g| g.reqs.len()).sum::<usize>()) as u32;
            for seq in seqs {
                self.send_group(s as u16, seq)?;
                report.replayed += 1;
                self.stats.replayed += 1;
            }
        }
        report.took = started.elapsed();
        self.last_recovery = Some(report.clone());
        if self.cfg.verbose {
            eprintln!(
                "aios initiator: recovered in {:.1} ms: prefixes {:?}, {} writes zeroed, {} replayed, {} in-place updates reported",
                report.took.as_secs_f64() * 1e3,
                report.prefix_end,
                report.discarded,
                report.replayed,
                report.in_place.len()
            );
        }
        Ok(report)
    }

    /// Wait until every connection has no command out. It gives up after `io_timeout` with no
    /// command answered (not `io_timeout` for all of them: a batch of [`ZEROES_OUT`] large
    /// zeroing commands may take longer than that on a slow device).
    fn settle(&mut self) -> Result<(), NetError> {
        let out = |v: &Volume| v.conns.iter().map(|c| c.outstanding as u64).sum::<u64>();
        let mut left = out(self);
        let mut deadline = deadline_after(self.cfg.io_timeout);
        while left > 0 {
            if Instant::now() > deadline {
                return Err(NetError::Config(
                    "recovery: targets did not answer in time".into(),
                ));
            }
            if let Err((t, why)) = self.drive_once(true, false) {
                return Err(NetError::peer(self.targets[t].addr, why));
            }
            let n = out(self);
            if n < left {
                left = n;
                deadline = deadline_after(self.cfg.io_timeout);
            }
        }
        Ok(())
    }

    /// Zero `len` bytes at `offset` of target `t` (over stream 0's connection), first waiting
    /// for the zeroing already out when it holds [`ZEROES_OUT`] commands: a log's worth of
    /// entries beyond the prefixes would otherwise run out of command ids.
    ///
    /// The range comes from the target's log: one that is not whole blocks of its namespace
    /// (or more than one command may name) is the target's protocol error.
    fn zero(&mut self, t: usize, offset: u64, len: u32) -> Result<(), NetError> {
        let ti = &self.targets[t];
        let shift = ti.lba_shift;
        let mask = (1u64 << shift) - 1;
        let blocks = len as u64 >> shift;
        if offset & mask != 0
            || len as u64 & mask != 0
            || blocks == 0
            || blocks > 1 << 16
            || offset
                .checked_add(len as u64)
                .is_none_or(|end| end > ti.ns_bytes)
        {
            return Err(NetError::peer(
                ti.addr,
                format!(
                    "its attribute log names a write of {len} bytes at byte {offset}: not whole {}-byte blocks inside its {}-byte namespace (at most 65,536 blocks)",
                    1u64 << shift,
                    ti.ns_bytes
                ),
            ));
        }
        if self.conns[t].outstanding >= ZEROES_OUT {
            self.settle()?;
        }
        let ic = &mut self.conns[t];
        let cid = ic.alloc(Kind::PlainFlush, (0, 0));
        ic.queue(&lba_cmd(op::WRITE_ZEROES, cid, offset, len, shift), &[]);
        Ok(())
    }

    /// Read target `t`'s whole attribute log. The size it gives must fit the slots it told
    /// at connect (and [`MAX_LOG_BYTES`]) and stay the same from one piece to the next: a
    /// target that says otherwise is a protocol error, not memory allocated on its word.
    fn fetch_log(&mut self, t: usize) -> Result<LogScan, NetError> {
        let addr = self.targets[t].addr;
        let most = (self.targets[t].log_slots as u64 * rio_ordering::ATTR_BYTES as u64
            + LOG_HEADER_ALLOWANCE)
            .min(MAX_LOG_BYTES);
        let mut image = Vec::new();
        let mut total = None;
        while total.is_none_or(|n| image.len() < n) {
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::RIO_GET_LOG);
            sqe.set_cdw(10, image.len() as u32);
            sqe.set_cdw(11, (image.len() as u64 >> 32) as u32);
            sqe.set_sgl(MAX_DATA, false);
            let (cqe, data) = self.admin(t, sqe, &[], "RIO_GET_LOG")?;
            let said = cqe.dw0 as u64 | (cqe.dw1 as u64) << 32;
            if said > most {
                return Err(NetError::peer(
                    addr,
                    format!(
                        "its attribute log of {} slots is {said} bytes (at most {most})",
                        self.targets[t].log_slots
                    ),
                ));
            }
            if total.is_some_and(|n| n as u64 != said) {
                return Err(NetError::peer(
                    addr,
                    format!(
                        "its attribute log changed size while read ({} then {said} bytes)",
                        total.unwrap_or(0)
                    ),
                ));
            }
            let n = said as usize;
            total = Some(n);
            if data.is_empty() && image.len() < n {
                return Err(NetError::peer(addr, "attribute log read returned nothing"));
            }
            image.extend_from_slice(&data);
        }
        let total = total.unwrap_or(0);
        image.truncate(total);
        let mut pmr = MemPmr::new(total);
        pmr.bytes_mut().copy_from_slice(&image);
        Ok(scan(&pmr)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{Target, TargetConfig, TargetLogKind};

    /// A file in /dev/shm for a target's namespace, removed on drop.
    struct Scratch(std::path::PathBuf);
    impl Scratch {
        fn new(name: &str, bytes: u64) -> Scratch {
            let p = std::path::PathBuf::from(format!(
                "/dev/shm/rio-net-unit-{}-{name}",
                std::process::id()
            ));
            std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A queue whose commands outnumber its entries at every answer (a window larger than the
    /// target's queue, kept full): `deferred` never empties, and each answer lets one waiting
    /// command out while the caller queues another behind the rest. Its buffer stays within
    /// twice what waits (rounded up by the vector's doubling), where it used to keep every
    /// capsule that passed through it (about 8 MiB here).
    #[test]
    fn commands_always_waiting_for_room_on_the_queue_keep_their_buffer_bounded() {
        use std::net::TcpListener;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let _peer = l.accept().unwrap();
        const WAITING: usize = 4;
        let mut ic = IoConn::new(16);
        ic.conn = Some(Conn::new(s, MAX_PDU).unwrap());
        ic.cap = 4;
        let data = [7u8; 4096];
        let sqe = lba_cmd(op::WRITE, 1, 0, data.len() as u32, 12);
        let mut one = Vec::new();
        pdu::put_cmd(&mut one, &sqe, &data, Digests::default());
        for _ in 0..ic.cap as usize + WAITING {
            ic.queue(&sqe, &data);
        }
        for _ in 0..2000 {
            ic.answered();
            ic.queue(&sqe, &data);
            // As if it all went: only `deferred` is measured.
            ic.conn.as_mut().unwrap().tx.clear();
            assert_eq!(ic.deferred_cmds as usize, WAITING);
        }
        assert!(
            ic.deferred.capacity() <= 4 * WAITING * one.len(),
            "the buffer of waiting commands grew to {} KiB for {WAITING} capsules of {} bytes",
            ic.deferred.capacity() >> 10,
            one.len()
        );
    }

    /// A caller that does not poll while it submits: every request finishes and waits in
    /// `ready`, far more than the window (handing a request back frees its room). With every
    /// frame of the arena in a request, the volume's list and a caller's vector of
    /// `max_done` still have room for all of them: neither grows.
    #[test]
    fn finished_requests_up_to_the_arena_fit_without_growing() {
        const BLOCK: usize = 4096;
        let dev = Scratch::new("max-done", 4 << 20);
        let mut tc = TargetConfig::new(dev.0.clone(), TargetLogKind::Mem(1 << 20));
        tc.streams = 1;
        let target = Target::bind("127.0.0.1:0".parse().unwrap(), tc).unwrap();
        let addr = target.local_addr();
        target.spawn();
        let mut cfg = VolumeConfig::new(vec![addr], 1);
        cfg.window = 1;
        cfg.arena_bytes = 1 << 20;
        let (mut v, _) = Volume::open(cfg).unwrap();
        let frames = v.engine().arena().frames() as usize;
        let room = v.ready.capacity();
        let blocks = v.bytes() / BLOCK as u64;
        let mut n = 0usize;
        while let Some(mut buf) = v.alloc(BLOCK) {
            buf.fill(n as u8);
            let off = (n as u64 % blocks) * BLOCK as u64;
            match n % 4 {
                1 => v.write_orderless(0, off, buf).map(|_| ()),
                3 => v.read(0, off, buf).map(|_| ()),
                _ => v.submit(0, off, buf, true).map(|_| ()),
            }
            .unwrap();
            n += 1;
        }
        assert_eq!(n, frames, "every frame of the arena went into a request");
        assert!(n > (HELD_PER_WINDOW * v.cfg.window) as usize);
        v.wait(0).unwrap();
        while v.ready.len() < n {
            v.drive(true).unwrap();
        }
        assert_eq!(
            v.ready.capacity(),
            room,
            "the list of finished requests grew"
        );
        let mut out = Vec::with_capacity(v.max_done());
        let want = out.capacity();
        v.poll_into(&mut out).unwrap();
        assert_eq!(out.len(), n);
        assert_eq!(out.capacity(), want, "the caller's vector grew");
        for d in out {
            d.result.unwrap();
        }
    }
}
