//! The target server: NVMe/TCP over any lbio device, with Rio's attribute log.
//!
//! One thread per connection (each with its own engine and lbio array, as everything lbio drives
//! is per thread). The attribute log and the per-stream submission order are shared by the
//! target's connections behind one mutex, taken once per ordered command.
//!
//! For an ordered write (Rio §4.3): wait until the group named by `prev` has been submitted
//! (in-order submission per server; with one connection per stream, TCP's in-order delivery
//! makes this wait rare), append the attribute to the log (persist word clear), submit the data,
//! and when it completes set the persist word if the device has power-loss protection. An
//! ordered FLUSH waits for the connection's writes to complete, appends its marker, flushes the
//! device and sets the marker's persist word: that certifies every earlier write of the stream
//! here. The durability mark the initiator piggybacks on commands releases log slots.
//!
//! A target that starts on an existing log keeps it for recovery and refuses ordered writes
//! until the initiator has collected the log and reset it (`RIO_RESET`). A recovery's
//! `RIO_FENCE`, before it reads the log, and every reset start a new generation: connections
//! from before it may no longer write (reads are served), and a fence answers once their
//! writes already on the device are done. An I/O queue takes its controller's generation:
//! the one current at the admin queue's Connect, moved on by the fences and resets it sends.
//! Malformed, oversized or out-of-sequence PDUs close only their connection, with the reason
//! logged; commands outside the namespace fail with LBA Out of Range.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use aios_core::{CompletionMode, Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{Device, DeviceConfig, Io, LbioArray, LbioConfig};
use rio_ordering::{Attr, AttrLog, FilePmr, MemPmr, NvmePmr, Pmr, RioError, Slot};

use crate::conn::{wait_fds, Conn, Transport};
use crate::error::NetError;
use crate::pdu::{self, op, Cqe, Digests, Pdu, PduError, Sqe, Status, WireAttr};

/// Largest data transfer of one command (MDTS 5: 32 × 4 KiB).
pub const MAX_DATA: u32 = 128 << 10;
/// Largest PDU accepted: a command capsule with `MAX_DATA` in-capsule bytes and both digests.
pub const MAX_PDU: u32 = MAX_DATA + 128;
/// In-capsule data accepted on I/O queues (IOCCSZ counts 16-byte units including the SQE).
/// Admin queues take 8 KiB in the capsule.
const ADMIN_CAPSULE_DATA: u32 = 8192;
/// Commands an admin queue (or a connection before Connect) may have waiting for their data
/// by R2T; one more closes the connection.
const ADMIN_AWAITING_DATA: usize = 8;
/// LBA size of the namespace.
pub const LBA: u32 = 4096;
/// Asynchronous Event Requests a controller holds at once (Identify Controller's AERL + 1).
const AER_LIMIT: usize = 4;

/// Where a target keeps its attribute log.
#[derive(Clone, Debug)]
pub enum TargetLogKind {
    /// Persistent memory emulated in RAM (lost with the process: for benchmarks and tests).
    Mem(usize),
    /// Persistent memory emulated in a file (survives the process; `fdatasync` per write).
    File(PathBuf, usize),
    /// An NVMe controller's persistent memory region (`/dev/nvmeX`).
    Nvme(PathBuf),
}

/// Settings of a target.
#[derive(Clone, Debug)]
pub struct TargetConfig {
    /// The device or file served as namespace 1.
    pub device: PathBuf,
    pub log: TargetLogKind,
    /// Streams the log serves (initiators may use fewer).
    pub streams: u16,
    /// Format the log even when it holds one (its entries are lost).
    pub format: bool,
    /// Serve only this many bytes of the device: whole blocks, at most the device's size
    /// (anything else is refused by [`Target::bind`]).
    pub ns_bytes: Option<u64>,
    pub subnqn: String,
    /// Arena bytes per I/O connection.
    pub arena_bytes: usize,
    /// Write data the I/O queues take inside the command capsule (Identify Controller
    /// IOCCSZ); the host sends larger writes' data after an R2T. A multiple of 16, at most
    /// 128 KiB.
    pub in_capsule: u32,
    /// Print one line per connection opened or closed.
    pub verbose: bool,
    /// TCP, or RDMA (feature `rdma`).
    pub transport: Transport,
    /// Connections served at once, admin and I/O queues alike (each has a thread, and an I/O
    /// queue `arena_bytes` of memory). One more is closed as soon as it is accepted, logged
    /// and counted in [`TargetStats::refused_connections`]; its place frees when a connection
    /// ends. At least 1; default [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
    /// Test hook: serve this simulated disk instead of opening `device` (then only named in
    /// messages). `None` in normal use.
    #[doc(hidden)]
    pub sim: Option<SimDevice>,
}

/// A simulated disk a test target serves ([`TargetConfig::sim`]): each connection opens it on
/// its own engine, and it completes the requests on it in random order.
#[doc(hidden)]
#[derive(Clone)]
pub struct SimDevice(pub lbio::SimDisk);

impl std::fmt::Debug for SimDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDevice")
    }
}

/// Open the device a target serves, on `lbio`.
fn open_device(lbio: &Rc<LbioArray>, cfg: &TargetConfig) -> Result<Device, lbio::LbioError> {
    match &cfg.sim {
        Some(sim) => sim.0.open(lbio),
        None => Device::open(lbio, &cfg.device, device_config()),
    }
}

/// [`TargetConfig::max_connections`] unless set: a host's admin queue and an I/O queue per CPU
/// for a host of up to 127 CPUs (Linux opens one per CPU), with at most 1 GiB of connection
/// arenas at the default `arena_bytes`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;

impl TargetConfig {
    pub fn new(device: impl Into<PathBuf>, log: TargetLogKind) -> TargetConfig {
        TargetConfig {
            device: device.into(),
            log,
            streams: 16,
            format: false,
            ns_bytes: None,
            subnqn: "nqn.2026-11.io.aios:target".into(),
            arena_bytes: 8 << 20,
            in_capsule: MAX_DATA,
            verbose: false,
            transport: Transport::Tcp,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            sim: None,
        }
    }
}

type BoxPmr = Box<dyn Pmr + Send>;

enum LogSlot {
    Live(AttrLog<BoxPmr>),
    /// Found at start: kept for the initiator's recovery; ordered writes wait for a reset.
    Recovering(BoxPmr),
    /// Between taking the region out and putting it back.
    Moving,
}

impl LogSlot {
    fn pmr(&self) -> &dyn Pmr {
        match self {
            LogSlot::Live(l) => l.pmr(),
            LogSlot::Recovering(p) => p,
            LogSlot::Moving => unreachable!("the log is only moving under the lock"),
        }
    }
}

struct LogState {
    log: LogSlot,
    /// Bumped by every reset.
    generation: u64,
    /// Per stream: the highest group submitted to the device (the in-order gate).
    submitted: Vec<u64>,
    /// Per stream: the lowest group whose write failed on the device, or that a failed FLUSH
    /// may have dropped (`u64::MAX`: none) since the last reset. No FLUSH entry vouches for it
    /// or anything after it, and no mark frees its entries: recovery must not count it durable.
    failed_from: Vec<u64>,
    /// Per stream: the highest group a completed ordered FLUSH made durable here.
    flushed_to: Vec<u64>,
    streams: u16,
    slots: u32,
    log_full: u64,
}

/// Test hooks: while non-zero, each ordered write (or ordered FLUSH) the device completes in
/// this process takes one from the count and is failed as if the device had failed it (EIO).
/// For tests of what a failing device does to the log and to recovery; 0 in normal use.
#[doc(hidden)]
pub static TEST_FAIL_ORDERED_WRITES: AtomicU32 = AtomicU32::new(0);
#[doc(hidden)]
pub static TEST_FAIL_ORDERED_FLUSHES: AtomicU32 = AtomicU32::new(0);
/// As [`TEST_FAIL_ORDERED_WRITES`], for plain (orderless) FLUSHes.
#[doc(hidden)]
pub static TEST_FAIL_PLAIN_FLUSHES: AtomicU32 = AtomicU32::new(0);

/// Test hook: set to 1, the next ordered FLUSH the device completes in this process is held
/// before anything is done with its completion (no persist word set, the host not answered)
/// until the hook is set back to 0; it reads 2 while it holds one. For tests of a completion
/// that lands after a reset; 0 in normal use.
#[doc(hidden)]
pub static TEST_HOLD_ORDERED_FLUSH: AtomicU32 = AtomicU32::new(0);

/// Test hook: as [`TEST_HOLD_ORDERED_FLUSH`], for the next write (ordered or not) the device
/// completes, held before the connection takes it off its list of requests on the device. For
/// tests of what waits for such writes (`RIO_FENCE`); 0 in normal use.
#[doc(hidden)]
pub static TEST_HOLD_WRITE_COMPLETION: AtomicU32 = AtomicU32::new(0);

fn hold_test_completion(hook: &AtomicU32) {
    // A plain load first: in normal use the hook costs no locked instruction.
    if hook.load(Ordering::Relaxed) == 1
        && hook
            .compare_exchange(1, 2, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        while hook.load(Ordering::Relaxed) == 2 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn take_test_fault(count: &AtomicU32) -> bool {
    count
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

/// Counters of a target.
#[derive(Clone, Copy, Debug, Default)]
pub struct TargetStats {
    pub connections: u64,
    /// Connections open now (each is counted until its last device request has completed).
    pub open_connections: u64,
    pub ordered_writes: u64,
    pub ordered_flushes: u64,
    pub orderless: u64,
    pub reads: u64,
    pub closed_on_error: u64,
    /// Connections closed as soon as they were accepted, because
    /// [`TargetConfig::max_connections`] were open.
    pub refused_connections: u64,
    /// Writes whose data was asked for with an R2T (larger than the in-capsule size).
    pub r2ts: u64,
    /// Writes whose data was pulled with RDMA READ (RDMA connections).
    pub rdma_reads: u64,
    /// Ordered commands that found the attribute log full and waited for marks.
    pub log_full_waits: u64,
    /// Ordered writes held until an earlier write of their connection over some of their
    /// bytes had completed on the device (so the later one lands last).
    pub overlap_waits: u64,
}

struct Shared {
    cfg: TargetConfig,
    ns_bytes: u64,
    plp: bool,
    state: Mutex<LogState>,
    /// `LogState::generation`, stored under the lock whenever it changes: read without the
    /// lock by a connection about to send a request to the device (see [`Gate`]).
    generation: AtomicU64,
    /// One per connection serving now.
    gates: Mutex<Vec<Arc<Gate>>>,
    next_cntlid: AtomicU16,
    /// Controllers (admin connections) open now, each with the generation its I/O queues
    /// take: the generation current at its Connect, moved on by each fence and reset it sends.
    /// So an I/O queue opened after a fence belongs to the fenced past unless its controller
    /// is the one that fenced (an old initiator's Connect the network held is refused writes).
    live_cntlids: Mutex<Vec<(u16, u64)>>,
    ordered_writes: AtomicU64,
    ordered_flushes: AtomicU64,
    orderless: AtomicU64,
    reads: AtomicU64,
    connections: AtomicU64,
    open_connections: AtomicU64,
    closed_on_error: AtomicU64,
    refused_connections: AtomicU64,
    r2ts: AtomicU64,
    rdma_reads: AtomicU64,
    overlap_waits: AtomicU64,
    close_log: Mutex<CloseLog>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, LogState> {
        // A connection thread that panicked leaves the log as it was: keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gates(&self) -> MutexGuard<'_, Vec<Arc<Gate>>> {
        self.gates.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn controllers(&self) -> MutexGuard<'_, Vec<(u16, u64)>> {
        self.live_cntlids.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Controller `cntlid`'s I/O queues opened from now on take `generation`.
    fn move_controller(&self, cntlid: u16, generation: u64) {
        if let Some(c) = self.controllers().iter_mut().find(|c| c.0 == cntlid) {
            c.1 = generation;
        }
    }

    /// Publish `st.generation`, just changed by the caller (who holds the lock).
    fn publish_generation(&self, st: &LogState) {
        self.generation.store(st.generation, Ordering::SeqCst);
    }

    /// Wait until no connection from a generation before `generation` has a write on the
    /// device (those connections may send no more: [`TConn::submit`] refuses them). Gives up
    /// after [`FENCE_WAIT`] with the number still out.
    fn drain_older(&self, generation: u64) -> Result<(), u64> {
        let deadline = Instant::now() + FENCE_WAIT;
        loop {
            let out: u64 = self
                .gates()
                .iter()
                .filter(|g| g.generation.load(Ordering::SeqCst) < generation)
                .map(|g| g.out.load(Ordering::SeqCst))
                .sum();
            if out == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(out);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// How long a fence waits for older connections' device writes to complete before it answers
/// with an error. Under the initiator's default `io_timeout` (5 s), so that the initiator
/// hears why, and retries, rather than time out first.
const FENCE_WAIT: Duration = Duration::from_secs(4);

/// What the target's fence needs to know of a connection, without taking the log's lock on
/// its orderless path: its generation, and how many of its writes the device holds.
///
/// A connection counts a write in `out` before it reads the target's generation, and sends it
/// to the device only if that generation is still its own; a fence stores the new generation
/// before it reads the counts (all `SeqCst`). So either the fence sees the write counted and
/// waits for it, or the connection sees the new generation and refuses it: no write of an
/// older connection reaches the device after a fence has drained them.
#[derive(Default)]
struct Gate {
    generation: AtomicU64,
    /// Requests on the device that change it (everything but reads: a read changes nothing a
    /// recovery reads, and a connection that keeps reading would hold a fence up).
    out: AtomicU64,
}

impl Gate {
    /// Whether `what` is counted in `out`.
    fn counts(what: &InFlight) -> bool {
        !matches!(what, InFlight::Read { .. })
    }

    /// `what`, taken off the device.
    fn done(&self, what: &InFlight) {
        if Gate::counts(what) {
            self.out.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    #[cfg(feature = "rdma")]
    Rdma(crate::rdma::Listener),
}

/// A target server, bound and ready to serve.
pub struct Target {
    listener: Listener,
    addr: SocketAddr,
    shared: Arc<Shared>,
}

fn open_pmr(kind: &TargetLogKind) -> Result<BoxPmr, NetError> {
    Ok(match kind {
        TargetLogKind::Mem(n) => Box::new(MemPmr::new(*n)),
        TargetLogKind::File(p, n) => Box::new(FilePmr::open(p, *n)?),
        TargetLogKind::Nvme(p) => Box::new(NvmePmr::open(p).map_err(RioError::from)?),
    })
}

impl Target {
    /// Open the device and the log and bind `addr`.
    pub fn bind(addr: SocketAddr, cfg: TargetConfig) -> Result<Target, NetError> {
        if cfg.in_capsule > MAX_DATA || cfg.in_capsule % 16 != 0 {
            return Err(NetError::Config(format!(
                "in-capsule data of {} bytes: a multiple of 16 up to {MAX_DATA}",
                cfg.in_capsule
            )));
        }
        if cfg.max_connections == 0 {
            return Err(NetError::Config(
                "max_connections 0 (--max-connections): the target would serve nobody; give 1 \
                 or more"
                    .into(),
            ));
        }
        // Probe the device once, on a small engine of its own.
        let (capacity, plp) = {
            let engine = Engine::new(EngineConfig {
                arena_bytes: 1 << 20,
                huge_pages: false,
                ring_entries: 64,
                ..EngineConfig::default()
            })?;
            let lbio = LbioArray::new(engine, LbioConfig::default())?;
            let dev = open_device(&lbio, &cfg)?;
            (
                dev.geometry().capacity_bytes,
                dev.critical_route().0.power_loss_protected,
            )
        };
        if let Some(n) = cfg.ns_bytes {
            if n == 0 || n % LBA as u64 != 0 || n > capacity {
                return Err(NetError::Config(format!(
                    "a namespace of {n} bytes (ns_bytes, --ns-bytes) on {}: it must be a whole \
                     number of {LBA}-byte blocks, at most the device's {capacity} bytes",
                    cfg.device.display()
                )));
            }
        }
        let ns_bytes = cfg.ns_bytes.unwrap_or(capacity) / LBA as u64 * LBA as u64;
        if ns_bytes == 0 {
            return Err(NetError::Config(format!(
                "{}: {capacity} bytes is too small for a namespace of {LBA}-byte blocks",
                cfg.device.display()
            )));
        }
        let pmr = open_pmr(&cfg.log)?;
        let existing = (!cfg.format)
            .then(|| rio_ordering::scan(&pmr).ok())
            .flatten();
        let (log, streams, slots) = match existing {
            Some(sc) => {
                let streams = sc.header.durable_below.len() as u16;
                let slots = sc.header.slots;
                if cfg.verbose {
                    eprintln!(
                        "aios target: kept the attribute log found ({} entries of epoch {}, {} streams): ordered writes wait for the initiator's recovery",
                        sc.entries.len(),
                        sc.header.epoch,
                        streams
                    );
                }
                (LogSlot::Recovering(pmr), streams, slots)
            }
            None => {
                let log = AttrLog::format(pmr, cfg.streams)?;
                let slots = log.slots();
                (LogSlot::Live(log), cfg.streams, slots)
            }
        };
        let (listener, addr) = match cfg.transport {
            Transport::Tcp => {
                let l = TcpListener::bind(addr).map_err(|e| NetError::io("bind", addr, e))?;
                let a = l.local_addr().map_err(|e| NetError::io("bind", addr, e))?;
                (Listener::Tcp(l), a)
            }
            #[cfg(feature = "rdma")]
            Transport::Rdma => {
                let l = crate::rdma::Listener::bind(addr)
                    .map_err(|e| NetError::io("RDMA listen on", addr, e))?;
                let a = l.local_addr();
                (Listener::Rdma(l), a)
            }
            #[cfg(not(feature = "rdma"))]
            Transport::Rdma => return Err(NetError::Config(crate::conn::NO_RDMA.into())),
        };
        Ok(Target {
            listener,
            addr,
            shared: Arc::new(Shared {
                ns_bytes,
                plp,
                generation: AtomicU64::new(1),
                gates: Mutex::new(Vec::new()),
                state: Mutex::new(LogState {
                    log,
                    generation: 1,
                    submitted: vec![0; streams as usize],
                    failed_from: vec![u64::MAX; streams as usize],
                    flushed_to: vec![0; streams as usize],
                    streams,
                    slots,
                    log_full: 0,
                }),
                next_cntlid: AtomicU16::new(1),
                live_cntlids: Mutex::new(Vec::new()),
                ordered_writes: AtomicU64::new(0),
                ordered_flushes: AtomicU64::new(0),
                orderless: AtomicU64::new(0),
                reads: AtomicU64::new(0),
                connections: AtomicU64::new(0),
                open_connections: AtomicU64::new(0),
                closed_on_error: AtomicU64::new(0),
                refused_connections: AtomicU64::new(0),
                r2ts: AtomicU64::new(0),
                rdma_reads: AtomicU64::new(0),
                overlap_waits: AtomicU64::new(0),
                close_log: Mutex::new(CloseLog {
                    window: Instant::now(),
                    printed: 0,
                    suppressed: 0,
                }),
                cfg,
            }),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
    /// Bytes of the namespace.
    pub fn ns_bytes(&self) -> u64 {
        self.shared.ns_bytes
    }
    /// Whether the device keeps completed writes across a power cut.
    pub fn plp(&self) -> bool {
        self.shared.plp
    }

    /// A handle for counters, usable after [`Target::serve`] took the target.
    pub fn stats_handle(&self) -> TargetStatsHandle {
        TargetStatsHandle(Arc::clone(&self.shared))
    }

    /// Accept connections until the listener fails, one thread each.
    pub fn serve(mut self) -> Result<(), NetError> {
        let addr = self.local_addr();
        loop {
            let accepted = match &mut self.listener {
                Listener::Tcp(l) => l.accept().map(|(sock, peer)| {
                    let c = Conn::new(sock, MAX_PDU).inspect_err(|e| {
                        eprintln!("aios target: {peer}: socket setup: {e}");
                    });
                    c.ok().map(|c| (c, peer))
                }),
                #[cfg(feature = "rdma")]
                Listener::Rdma(l) => l.accept().map(|link| {
                    let peer = link.peer();
                    Some((Conn::rdma(link, MAX_PDU), peer))
                }),
            };
            let (conn, peer) = match accepted {
                Ok(Some(x)) => x,
                Ok(None) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(NetError::io("accept on", addr, e)),
            };
            let shared = Arc::clone(&self.shared);
            // Only this loop adds to the count, and connection threads only take from it: a
            // count under the limit here stays under it until the next accept.
            let open = shared.open_connections.load(Ordering::SeqCst);
            if open >= shared.cfg.max_connections as u64 {
                shared.refused_connections.fetch_add(1, Ordering::Relaxed);
                drop(conn);
                log_limited(
                    &shared,
                    format_args!(
                        "{peer}: refused the connection: {open} open, the most allowed \
                         (max_connections, --max-connections {})",
                        shared.cfg.max_connections
                    ),
                );
                continue;
            }
            shared.connections.fetch_add(1, Ordering::Relaxed);
            shared.open_connections.fetch_add(1, Ordering::SeqCst);
            let mine = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("aios-target-{peer}"))
                .spawn(move || {
                    serve_conn(Arc::clone(&mine), conn, peer);
                    mine.open_connections.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                shared.open_connections.fetch_sub(1, Ordering::SeqCst);
                eprintln!("aios target: {peer}: no thread for the connection: {e}");
            }
        }
    }

    /// Serve on a background thread (tests, examples).
    pub fn spawn(self) -> std::thread::JoinHandle<Result<(), NetError>> {
        std::thread::spawn(move || self.serve())
    }
}

/// Reads a running target's counters.
#[derive(Clone)]
pub struct TargetStatsHandle(Arc<Shared>);

impl TargetStatsHandle {
    pub fn stats(&self) -> TargetStats {
        let s = &self.0;
        TargetStats {
            connections: s.connections.load(Ordering::Relaxed),
            open_connections: s.open_connections.load(Ordering::Relaxed),
            ordered_writes: s.ordered_writes.load(Ordering::Relaxed),
            ordered_flushes: s.ordered_flushes.load(Ordering::Relaxed),
            orderless: s.orderless.load(Ordering::Relaxed),
            reads: s.reads.load(Ordering::Relaxed),
            closed_on_error: s.closed_on_error.load(Ordering::Relaxed),
            refused_connections: s.refused_connections.load(Ordering::Relaxed),
            r2ts: s.r2ts.load(Ordering::Relaxed),
            rdma_reads: s.rdma_reads.load(Ordering::Relaxed),
            log_full_waits: s.lock().log_full,
            overlap_waits: s.overlap_waits.load(Ordering::Relaxed),
        }
    }
}

fn device_config() -> DeviceConfig {
    DeviceConfig {
        write: true,
        probe: ProbeOptions {
            latency_samples: 20,
            try_iopoll: false,
        },
        ..DeviceConfig::default()
    }
}

/// The I/O side of a connection: its engine, lbio array and device.
struct IoSide {
    engine: Rc<Engine>,
    lbio: Rc<LbioArray>,
    dev: Device,
    /// The engine's arena registered on the connection's RDMA link (RDMA connections only).
    #[cfg(feature = "rdma")]
    keys: Option<crate::rdma::MemKeys>,
}

/// Data of a command: none, an arena buffer (I/O), or plain memory (admin).
enum Data {
    None,
    Fixed(FixedBuf),
    Vec(Vec<u8>),
}

impl Data {
    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Data::None => &mut [],
            Data::Fixed(b) => &mut b[..],
            Data::Vec(v) => &mut v[..],
        }
    }
}

/// A command whose data is coming in H2CData PDUs.
struct Collecting {
    sqe: Sqe,
    data: Data,
    got: u32,
    /// Its place among the connection's commands ([`TConn::arrivals`] when it came).
    arrived: u64,
}

/// What a device request in flight belongs to.
enum InFlight {
    Write {
        cid: u16,
        ordered: Option<(Slot, u16, u64)>,
        /// An ordered write's number on its connection ([`TConn::ordered_sent`] when it went
        /// out); 0 for the others.
        order_no: u64,
    },
    Flush {
        cid: u16,
        ordered: Option<(Slot, u16, u64)>,
        /// An ordered FLUSH whose entry was capped below the group it was sent for (a failure
        /// came before): it cannot vouch for what its host asked, and is answered with an
        /// error once the device has flushed.
        short: bool,
    },
    Read {
        cid: u16,
    },
    Zeroes {
        cid: u16,
        next: u64,
        end: u64,
    },
}

/// An ordered FLUSH waiting for the writes out when it arrived: those numbered below `before`,
/// of which `out` have not completed. (Counts, not a list of the writes: nothing is allocated
/// per FLUSH.)
struct WaitingFlush {
    held: Held,
    before: u64,
    out: usize,
}

/// An ordered command waiting for its turn.
struct Held {
    sqe: Sqe,
    data: Data,
    attr: WireAttr,
    /// Counted in [`TargetStats::overlap_waits`] (once, however long it waits).
    overlap_counted: bool,
}

enum Queue {
    /// Before Connect.
    None,
    Admin {
        cntlid: u16,
    },
    Io {
        qid: u16,
    },
}

/// Request slots of a connection's device (the most device commands it has in flight, and so
/// the most commands it accepts at once).
const IO_SLOTS: u32 = 256;

struct TConn {
    shared: Arc<Shared>,
    peer: SocketAddr,
    conn: Conn,
    icreq_done: bool,
    queue: Queue,
    generation: u64,
    /// This connection's generation and writes on the device, as the fence sees them.
    gate: Arc<Gate>,
    io: Option<IoSide>,
    collecting: HashMap<u16, Collecting>,
    /// Writes whose data is being pulled by RDMA READ (RDMA connections only).
    pulling: HashMap<u16, Collecting>,
    held: VecDeque<Held>,
    inflight: HashMap<u32, InFlight>,
    /// Writes (ordered and orderless) on the device: (tag, first byte, end). An ordered write
    /// over bytes of one of them waits in `held` until it completes: the device may complete
    /// requests it holds in any order, so two writes of one stream to the same bytes out at
    /// once could leave the older group's bytes (storage order must be submission order). At
    /// most the request slots; room for them is taken when the I/O queue opens.
    write_spans: Vec<(u32, u64, u64)>,
    /// Ordered writes submitted on this connection so far: the next one's number.
    ordered_sent: u64,
    /// Ordered writes submitted and not completed.
    ordered_out: usize,
    /// Ordered FLUSHes waiting for the ordered writes that were out when they arrived (later
    /// writes go on meanwhile: a FLUSH certifies only groups up to its own).
    flushes_waiting: VecDeque<WaitingFlush>,
    /// Ordered FLUSHes that arrived while writes before them still waited for their data (by
    /// R2T or RDMA READ), with the arrival number of the last such write: a FLUSH joins `held`
    /// only once they have their data (so it goes after them), or it would certify groups
    /// whose data is not on the device yet. (Numbers, not command ids: a host may reuse an id
    /// for a write sent after the FLUSH.)
    parked_flushes: VecDeque<(Held, u64)>,
    /// Commands that waited for their data so far (numbering `Collecting::arrived`).
    arrivals: u64,
    /// Controller registers (admin queue).
    cc: u32,
    csts: u32,
    /// Asynchronous event requests held (never answered: no events are raised).
    aers: Vec<u16>,
    /// Set when a command could not get a buffer or a request slot: stop decoding for this
    /// turn of the loop (cleared at the start of each turn).
    starved: bool,
    /// This turn stopped decoding because [`TX_BACKLOG`] bytes of answers waited to go out.
    answers_backlogged: bool,
}

/// Bytes of answers waiting to go out past which a connection takes no more commands: a host
/// that does not read them is held back by TCP, and the send buffer stays bounded.
const TX_BACKLOG: usize = 2 * MAX_PDU as usize;

/// Reasons logged per second at most; the rest are counted and summed up in the next line.
const CLOSE_LOG_PER_SECOND: u32 = 10;

/// Count a connection closed on an error and log why (see [`log_limited`]).
fn close_reason(shared: &Shared, peer: SocketAddr, why: &str) {
    shared.closed_on_error.fetch_add(1, Ordering::Relaxed);
    log_limited(
        shared,
        format_args!("{peer}: closing the connection: {why}"),
    );
}

/// Log a connection closed or refused — at most [`CLOSE_LOG_PER_SECOND`] lines a second, so a
/// flood of bad clients cannot flood the log (the callers' counts stay exact).
fn log_limited(shared: &Shared, line: std::fmt::Arguments<'_>) {
    let mut rl = shared.close_log.lock().unwrap_or_else(|e| e.into_inner());
    if rl.window.elapsed() >= Duration::from_secs(1) {
        if rl.suppressed > 0 {
            eprintln!(
                "aios target: {} more connections closed on errors or refused (not logged one by \
                 one)",
                rl.suppressed
            );
        }
        *rl = CloseLog {
            window: Instant::now(),
            printed: 0,
            suppressed: 0,
        };
    }
    if rl.printed < CLOSE_LOG_PER_SECOND {
        rl.printed += 1;
        eprintln!("aios target: {line}");
    } else {
        rl.suppressed += 1;
    }
}

struct CloseLog {
    window: Instant,
    printed: u32,
    suppressed: u64,
}

fn serve_conn(shared: Arc<Shared>, conn: Conn, peer: SocketAddr) {
    let verbose = shared.cfg.verbose;
    if verbose {
        eprintln!("aios target: {peer}: connected");
    }
    let generation = shared.lock().generation;
    let gate = Arc::new(Gate::default());
    gate.generation.store(generation, Ordering::SeqCst);
    shared.gates().push(Arc::clone(&gate));
    let mut c = TConn {
        generation,
        gate,
        shared,
        peer,
        conn,
        icreq_done: false,
        queue: Queue::None,
        io: None,
        collecting: HashMap::new(),
        pulling: HashMap::new(),
        held: VecDeque::new(),
        inflight: HashMap::new(),
        write_spans: Vec::new(),
        ordered_sent: 0,
        ordered_out: 0,
        flushes_waiting: VecDeque::new(),
        parked_flushes: VecDeque::new(),
        arrivals: 0,
        cc: 0,
        csts: 0,
        aers: Vec::new(),
        starved: false,
        answers_backlogged: false,
    };
    // A panic in the connection's loop (a bug) ends only the connection, and still goes
    // through the drain below: a fence must keep seeing the writes it left on the device.
    let end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.run()))
        .unwrap_or_else(|_| Err("the connection's thread panicked".into()));
    // Let the device finish what it holds before the buffers go.
    let mut abandoned = false;
    if let Some(io) = &c.io {
        while !c.inflight.is_empty() {
            if let Err(e) = io.lbio.wait_done(1) {
                eprintln!(
                    "aios target: {peer}: waiting for {} device requests at close: {e}",
                    c.inflight.len()
                );
                abandoned = true;
                break;
            }
            while let Some(done) = io.lbio.take_done() {
                if let Some(what) = c.inflight.remove(&done.tag.0) {
                    c.gate.done(&what);
                }
            }
        }
    }
    // A gate whose writes may still be on the device stays: fences go on waiting for them (and
    // fail, naming them) rather than let a recovery read a log they may yet change.
    if !abandoned || c.gate.out.load(Ordering::SeqCst) == 0 {
        c.shared.gates().retain(|g| !Arc::ptr_eq(g, &c.gate));
    }
    if let Queue::Admin { cntlid } = c.queue {
        c.shared.controllers().retain(|x| x.0 != cntlid);
    }
    match end {
        Ok(()) => {
            if verbose {
                eprintln!("aios target: {peer}: disconnected");
            }
        }
        Err(why) => close_reason(&c.shared, peer, &why),
    }
}

impl TConn {
    fn run(&mut self) -> Result<(), String> {
        loop {
            let mut progress = false;
            if self.io.is_some() {
                progress |= self.reap()?;
            }
            // Completions and held commands that went to the device may have made room: try
            // the receive buffer again (it holds what arrived; reading stops when it is full).
            self.starved = false;
            let n = match self.conn.fill() {
                Ok(n) => n,
                // A host that closes with unread data resets the connection: it left, like EOF.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    self.conn.eof = true;
                    0
                }
                Err(e) => return Err(format!("receive failed: {e}")),
            };
            progress |= n > 0;
            progress |= self.pulled()?;
            progress |= self.decode()?;
            progress |= self.release_parked_flushes();
            progress |= self.advance_held()?;
            progress |= self.start_flushes()?;
            if let Some(io) = &self.io {
                io.engine.submit().map_err(|e| format!("engine: {e}"))?;
            }
            self.conn.flush().map_err(|e| format!("send failed: {e}"))?;
            if self.conn.eof && self.inflight.is_empty() {
                return Ok(());
            }
            // Commands held back by answers not yet sent: go on once the socket took them.
            progress |=
                std::mem::take(&mut self.answers_backlogged) && self.conn.unsent() < TX_BACKLOG;
            if progress {
                continue;
            }
            let timeout = if !self.held.is_empty() || !self.flushes_waiting.is_empty() {
                Some(Duration::from_millis(1))
            } else {
                Some(Duration::from_millis(500))
            };
            let want_read = !self.starved && !self.conn.eof;
            let mut fds = self.conn.fds(want_read);
            match self.io.as_ref().and_then(|io| io.engine.eventfd_fd()) {
                Some(ev) if !self.inflight.is_empty() => {
                    fds.push((ev, true, false));
                    let _ = wait_fds(&fds, timeout);
                    if let Some(io) = &self.io {
                        io.engine.drain_eventfd();
                    }
                }
                _ => {
                    let _ = wait_fds(&fds, timeout);
                }
            }
        }
    }
}

impl TConn {
    fn respond(&mut self, cid: u16, st: Status, dw0: u32, dw1: u32) {
        let qid = match self.queue {
            Queue::Io { qid } => qid,
            _ => 0,
        };
        let cqe = Cqe {
            dw0,
            dw1,
            sqhd: 0,
            sqid: qid,
            cid,
            status: st.field(),
        };
        pdu::put_resp(&mut self.conn.tx, &cqe, self.conn.dg);
    }

    /// Decode and handle what has arrived. Returns whether anything was handled.
    fn decode(&mut self) -> Result<bool, String> {
        let mut any = false;
        while !self.starved {
            // Answers the host has not taken yet: past a few PDUs' worth, take no more commands
            // (TCP then holds the host back) until the socket drains them.
            if self.conn.unsent() >= TX_BACKLOG {
                self.starved = true;
                self.answers_backlogged = true;
                break;
            }
            let dg = self.conn.dg;
            let got = pdu::decode(self.conn.rx.pending(), dg, self.conn.max_pdu);
            let (p, n) = match got {
                Ok(Some(x)) => x,
                Ok(None) => break,
                Err(e) => return Err(self.terminate(e)),
            };
            // Handling may need the PDU's bytes while writing replies: copy the small part.
            let consumed = match p {
                Pdu::ICReq { pfv, dgst, .. } => {
                    if self.icreq_done {
                        return Err(self.terminate(PduError::Unexpected(pdu::ICREQ)));
                    }
                    if pfv != 0 {
                        return Err(format!("unsupported protocol version {pfv}"));
                    }
                    let want = Digests {
                        header: dgst & 1 != 0,
                        data: dgst & 2 != 0,
                    };
                    pdu::put_icresp(&mut self.conn.tx, want, MAX_DATA);
                    self.conn.dg = want;
                    self.icreq_done = true;
                    true
                }
                _ if !self.icreq_done => {
                    return Err(self.terminate(PduError::Unexpected(self.conn.rx.pending()[0])))
                }
                Pdu::Cmd { sqe, data } => {
                    // The data is copied once, from the receive buffer into its own buffer.
                    let range = pdu::data_range(self.conn.rx.pending(), data);
                    self.command(sqe, range)?
                }
                Pdu::H2CData {
                    cccid,
                    ttag,
                    datao,
                    data,
                    last,
                } => {
                    let range = pdu::data_range(self.conn.rx.pending(), data);
                    self.h2c_data(cccid, ttag, datao, range, last)?;
                    true
                }
                Pdu::TermReq { fes, .. } => {
                    return Err(format!(
                        "the host terminated the connection (status {fes:#x})"
                    ))
                }
                Pdu::ICResp { .. } | Pdu::Resp { .. } | Pdu::C2HData { .. } | Pdu::R2T { .. } => {
                    let ty = self.conn.rx.pending()[0];
                    return Err(self.terminate(PduError::Unexpected(ty)));
                }
            };
            if !consumed {
                // No buffer for it now: decode it again once completions free some.
                self.starved = true;
                break;
            }
            self.conn.rx.consume(n);
            any = true;
        }
        Ok(any)
    }

    /// Queue a C2HTermReq for `e` and return the reason to log.
    fn terminate(&mut self, e: PduError) -> String {
        let pending = self.conn.rx.pending();
        let head = pending[..pending.len().min(pdu::CMD_HLEN)].to_vec();
        pdu::put_term(&mut self.conn.tx, false, e.fes(), 0, &head);
        let _ = self.conn.flush_blocking(Duration::from_millis(200));
        format!("{e}")
    }

    /// H2CData whose data is `range` of the pending receive bytes.
    fn h2c_data(
        &mut self,
        cid: u16,
        ttag: u16,
        datao: u32,
        range: std::ops::Range<usize>,
        last: bool,
    ) -> Result<(), String> {
        let data = &self.conn.rx.pending()[range];
        let Some(col) = self.collecting.get_mut(&cid) else {
            return Err(
                self.terminate_msg(format!("H2CData for command {cid}, which awaits no data"))
            );
        };
        if ttag != cid {
            return Err(
                self.terminate_msg(format!("H2CData with transfer tag {ttag}, expected {cid}"))
            );
        }
        let len = col.data.bytes_mut().len() as u32;
        if datao != col.got || datao + data.len() as u32 > len {
            let got = col.got;
            return Err(self.terminate_msg(format!(
                "H2CData at offset {datao}+{} for command {cid}: expected offset {got} of {len}",
                data.len()
            )));
        }
        col.data.bytes_mut()[datao as usize..datao as usize + data.len()].copy_from_slice(data);
        col.got += data.len() as u32;
        if col.got == len {
            if !last {
                return Err(self.terminate_msg(format!(
                    "command {cid}: all {len} bytes arrived but the last H2CData lacks LAST_PDU"
                )));
            }
            let col = self.collecting.remove(&cid).expect("present");
            self.ready(col.sqe, col.data)?;
        } else if last {
            let got = col.got;
            return Err(self.terminate_msg(format!(
                "command {cid}: LAST_PDU after {got} of {len} bytes"
            )));
        }
        Ok(())
    }

    fn terminate_msg(&mut self, msg: String) -> String {
        pdu::put_term(&mut self.conn.tx, false, 0x05, 0, &[]);
        let _ = self.conn.flush_blocking(Duration::from_millis(200));
        msg
    }

    /// A command capsule whose in-capsule data is `incap` of the pending receive bytes.
    /// Returns `Ok(false)` when it must wait for a buffer.
    fn command(&mut self, sqe: Sqe, incap: std::ops::Range<usize>) -> Result<bool, String> {
        let cid = sqe.cid();
        if self.collecting.contains_key(&cid) || self.pulling.contains_key(&cid) {
            return Err(self.terminate_msg(format!("command id {cid} reused while in use")));
        }
        // Back-pressure: a device command waits in the receive buffer until a request slot is
        // free for it beyond those the commands accepted before it will take.
        if let (Some(io), Queue::Io { .. }) = (&self.io, &self.queue) {
            let reserved = self.held.len()
                + self.flushes_waiting.len()
                + self.parked_flushes.len()
                + self.collecting.len()
                + self.pulling.len();
            if sqe.opcode() != op::RIO_MARK && io.lbio.free_slots() as usize <= reserved {
                return Ok(false);
            }
        }
        let admin = !matches!(self.queue, Queue::Io { .. });
        // Data the host sends: in the capsule or after an R2T.
        let host_to_ctrl = match sqe.opcode() {
            op::FABRICS => matches!(sqe.fctype(), op::FC_CONNECT),
            o if admin => o & 3 == 1,
            o => o == op::WRITE || o & 0x83 == 0x81,
        };
        let (_, sgl_len, sgl_id) = sqe.sgl();
        if !host_to_ctrl {
            if !incap.is_empty() {
                return Err(self.terminate_msg(format!(
                    "command {cid} (opcode {:#04x}) carries {} in-capsule bytes but takes no data",
                    sqe.opcode(),
                    incap.len()
                )));
            }
            // A read or Write Zeroes needs a buffer of the arena: like a write, it waits in the
            // receive buffer for one while requests on the device will free some.
            let buf_len = match (sqe.opcode(), &self.queue) {
                (op::READ, Queue::Io { .. }) => sqe.nlb() as usize * LBA as usize,
                (op::WRITE_ZEROES, Queue::Io { .. }) => {
                    (sqe.nlb() as usize * LBA as usize).min(MAX_DATA as usize)
                }
                _ => 0,
            };
            let mut data = Data::None;
            if buf_len > 0 {
                let io = self.io.as_ref().expect("I/O queues have a device");
                match io.engine.try_alloc(buf_len) {
                    Some(mut b) => {
                        b.set_len(buf_len).map_err(|e| e.to_string())?;
                        data = Data::Fixed(b);
                    }
                    None if io.engine.inflight() > 0 || !self.inflight.is_empty() => {
                        return Ok(false)
                    }
                    // Nothing will free room: `io_cmd` answers it.
                    None => {}
                }
            }
            self.ready(sqe, data)?;
            return Ok(true);
        }
        let limit = if admin {
            ADMIN_CAPSULE_DATA
        } else {
            self.shared.cfg.in_capsule
        };
        if sgl_len > MAX_DATA || (!incap.is_empty() && incap.len() as u32 > limit) {
            self.respond(cid, Status::SGL_INVALID, 0, 0);
            return Ok(true);
        }
        // Queues without request slots (before Connect, admin) bound what waits for data in
        // other ways: before Connect only fabrics commands are taken, and an admin queue holds
        // a few commands awaiting data (hosts send admin data in the capsule). Otherwise each
        // 72-byte capsule got an R2T and a buffer of up to `MAX_DATA`, without limit.
        if admin {
            if matches!(self.queue, Queue::None) && sqe.opcode() != op::FABRICS {
                return Err(
                    self.terminate_msg(format!("command {:#04x} before Connect", sqe.opcode()))
                );
            }
            let by_r2t = incap.is_empty() && sgl_id != pdu::SGL_IN_CAPSULE && sgl_len > 0;
            if by_r2t && self.collecting.len() >= ADMIN_AWAITING_DATA {
                return Err(self.terminate_msg(format!(
                    "command {cid}: more than {ADMIN_AWAITING_DATA} admin commands await their data"
                )));
            }
        }
        // A keyed descriptor: the data waits in the host's memory for an RDMA READ.
        let keyed = sgl_id == pdu::SGL_KEYED;
        if keyed {
            if admin || !self.conn.is_rdma() || !incap.is_empty() {
                self.respond(cid, Status::SGL_TYPE_INVALID, 0, 0);
                return Ok(true);
            }
            if !self.can_pull() {
                return Ok(false);
            }
        }
        let mut data = if admin {
            Data::Vec(vec![0u8; sgl_len as usize])
        } else if sgl_len == 0 {
            Data::None
        } else {
            let io = self.io.as_ref().expect("I/O queues have a device");
            match io.engine.try_alloc(sgl_len as usize) {
                Some(mut b) => {
                    b.set_len(sgl_len as usize).map_err(|e| e.to_string())?;
                    Data::Fixed(b)
                }
                None if io.engine.inflight() > 0 || !self.inflight.is_empty() => return Ok(false),
                None => {
                    self.respond(cid, Status::INTERNAL, 0, 0);
                    return Ok(true);
                }
            }
        };
        if sgl_id == pdu::SGL_IN_CAPSULE || !incap.is_empty() {
            if incap.len() != sgl_len as usize {
                return Err(self.terminate_msg(format!(
                    "command {cid}: {} in-capsule bytes for an SGL of {sgl_len}",
                    incap.len()
                )));
            }
            data.bytes_mut()
                .copy_from_slice(&self.conn.rx.pending()[incap]);
            self.ready(sqe, data)?;
        } else if sgl_len == 0 {
            self.ready(sqe, data)?;
        } else if keyed {
            self.pull(sqe, data)?;
        } else {
            pdu::put_r2t(&mut self.conn.tx, cid, cid, 0, sgl_len, self.conn.dg);
            self.shared.r2ts.fetch_add(1, Ordering::Relaxed);
            let c = self.awaiting_data(sqe, data);
            self.collecting.insert(cid, c);
        }
        Ok(true)
    }

    /// A write whose data comes later (by R2T or RDMA READ), numbered among such writes.
    fn awaiting_data(&mut self, sqe: Sqe, data: Data) -> Collecting {
        self.arrivals += 1;
        Collecting {
            sqe,
            data,
            got: 0,
            arrived: self.arrivals,
        }
    }

    /// Whether another RDMA READ may go out now.
    fn can_pull(&mut self) -> bool {
        #[cfg(feature = "rdma")]
        if let Some(l) = self.conn.rdma_link() {
            return l.can_read();
        }
        false
    }

    /// Pull a write's data from the host with RDMA READ; [`TConn::pulled`] goes on.
    #[cfg(feature = "rdma")]
    fn pull(&mut self, sqe: Sqe, mut data: Data) -> Result<(), String> {
        let cid = sqe.cid();
        let (addr, len, key) = sqe.keyed_sgl().expect("checked by command()");
        let lkey = self
            .io
            .as_ref()
            .and_then(|io| io.keys)
            .ok_or("RDMA READ without a registered arena")?
            .lkey;
        let Data::Fixed(b) = &mut data else {
            return Err("RDMA READ into memory outside the arena".into());
        };
        let local = b.as_mut_ptr();
        let link = self.conn.rdma_link().expect("checked by command()");
        // SAFETY: `local` is a frame of this connection's arena, registered under `lkey`; the
        // buffer stays in `pulling` until the READ completes, and the link (with its queue
        // pair) is dropped before `pulling` and the engine (field order of TConn).
        #[allow(unsafe_code)]
        let r = unsafe { link.read(cid as u64, local, len, lkey, addr, key) };
        r.map_err(|e| format!("posting an RDMA READ: {e}"))?;
        let c = self.awaiting_data(sqe, data);
        self.pulling.insert(cid, c);
        self.shared.rdma_reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    #[cfg(not(feature = "rdma"))]
    fn pull(&mut self, _sqe: Sqe, _data: Data) -> Result<(), String> {
        Err("keyed SGL on a connection without RDMA".into())
    }

    /// Writes whose RDMA READ finished go on to the device.
    fn pulled(&mut self) -> Result<bool, String> {
        #[cfg(feature = "rdma")]
        if let Some(link) = self.conn.rdma_link() {
            if link.reads_done.is_empty() {
                return Ok(false);
            }
            let done = std::mem::take(&mut link.reads_done);
            for (id, err) in done {
                let cid = id as u16;
                let Some(col) = self.pulling.remove(&cid) else {
                    return Err(format!(
                        "RDMA READ completion for command {cid}, which pulls nothing"
                    ));
                };
                match err {
                    None => self.ready(col.sqe, col.data)?,
                    Some(e) => {
                        eprintln!(
                            "aios target: {}: RDMA READ for command {cid} failed: {e}",
                            self.peer
                        );
                        self.respond(cid, Status::DATA_TRANSFER_ERROR, 0, 0);
                    }
                }
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// A command with all its data.
    fn ready(&mut self, sqe: Sqe, data: Data) -> Result<(), String> {
        if sqe.opcode() == op::FABRICS {
            return self.fabrics(sqe, data);
        }
        match self.queue {
            Queue::None => {
                Err(self.terminate_msg(format!("command {:#04x} before Connect", sqe.opcode())))
            }
            Queue::Admin { .. } => self.admin(sqe, data),
            Queue::Io { .. } => self.io_cmd(sqe, data),
        }
    }

    fn fabrics(&mut self, sqe: Sqe, data: Data) -> Result<(), String> {
        let cid = sqe.cid();
        let b = &sqe.0;
        match sqe.fctype() {
            op::FC_CONNECT => {
                if !matches!(self.queue, Queue::None) {
                    self.respond(cid, Status::INVALID_FIELD, 0, 0);
                    return Ok(());
                }
                let qid = u16::from_le_bytes([b[42], b[43]]);
                let Data::Vec(d) = data else {
                    return Err("Connect without its data".into());
                };
                if d.len() < 1024 {
                    self.respond(cid, Status::CONNECT_INVALID_PARAM, 0, 0);
                    return Ok(());
                }
                let want_cntlid = u16::from_le_bytes([d[16], d[17]]);
                let subnqn = nqn(&d[256..512]);
                if subnqn != self.shared.cfg.subnqn
                    && subnqn != "nqn.2014-08.org.nvmexpress.discovery"
                {
                    eprintln!(
                        "aios target: {}: Connect to unknown subsystem {subnqn:?} (this is {:?})",
                        self.peer, self.shared.cfg.subnqn
                    );
                    self.respond(cid, Status::CONNECT_INVALID_PARAM, 0, 0);
                    return Ok(());
                }
                if qid == 0 {
                    let cntlid = self
                        .shared
                        .next_cntlid
                        .fetch_add(1, Ordering::Relaxed)
                        .max(1);
                    let generation = self.shared.lock().generation;
                    self.shared.controllers().push((cntlid, generation));
                    self.queue = Queue::Admin { cntlid };
                    self.respond(cid, Status::SUCCESS, cntlid as u32, 0);
                } else {
                    let controller = self
                        .shared
                        .controllers()
                        .iter()
                        .find(|c| c.0 == want_cntlid)
                        .map(|c| c.1);
                    let Some(generation) = controller else {
                        self.respond(cid, Status::CONNECT_INVALID_PARAM, 0, 0);
                        return Ok(());
                    };
                    self.open_io()
                        .map_err(|e| format!("opening the device: {e}"))?;
                    self.queue = Queue::Io { qid };
                    self.generation = generation;
                    self.gate
                        .generation
                        .store(self.generation, Ordering::SeqCst);
                    self.respond(cid, Status::SUCCESS, want_cntlid as u32, 0);
                }
            }
            op::FC_PROPERTY_GET => {
                let off = u32::from_le_bytes(b[44..48].try_into().expect("4"));
                let v: u64 = match off {
                    // CAP: MQES 1023, CQR, timeout 2 s, NVM command set.
                    0x00 => 1023 | 1 << 16 | 4 << 24 | 1 << 37,
                    0x08 => 0x0001_0400,
                    0x14 => self.cc as u64,
                    0x1c => self.csts as u64,
                    _ => 0,
                };
                self.respond(cid, Status::SUCCESS, v as u32, (v >> 32) as u32);
            }
            op::FC_PROPERTY_SET => {
                let off = u32::from_le_bytes(b[44..48].try_into().expect("4"));
                let v = u64::from_le_bytes(b[48..56].try_into().expect("8"));
                if off == 0x14 {
                    self.cc = v as u32;
                    let en = self.cc & 1;
                    let shn = (self.cc >> 14) & 3;
                    self.csts = en | if shn != 0 { 2 << 2 } else { 0 };
                }
                self.respond(cid, Status::SUCCESS, 0, 0);
            }
            other => {
                eprintln!(
                    "aios target: {}: fabrics command type {other:#04x} not supported",
                    self.peer
                );
                self.respond(cid, Status::INVALID_OPCODE, 0, 0);
            }
        }
        Ok(())
    }

    fn open_io(&mut self) -> Result<(), NetError> {
        if self.io.is_some() {
            return Ok(());
        }
        let engine = Engine::new(EngineConfig {
            arena_bytes: self.shared.cfg.arena_bytes,
            huge_pages: false,
            ring_entries: 256,
            eventfd: true,
            fast_flags: false,
            completion: CompletionMode::Wait,
            ..EngineConfig::default()
        })?;
        let lbio = LbioArray::new(
            Rc::clone(&engine),
            LbioConfig {
                slots: IO_SLOTS,
                ..LbioConfig::default()
            },
        )?;
        let dev = open_device(&lbio, &self.shared.cfg)?;
        // Every command accepted holds a request slot for itself (see `command`'s
        // back-pressure): the lists of commands held, FLUSHes waiting or parked, data being
        // collected and requests on the device never hold more than the slots, and get that
        // room now.
        // The maps get twice that: a hash map whose removals leave markers behind rehashes in
        // place (no allocation) only while it is at most half full.
        let n = IO_SLOTS as usize;
        self.held.reserve(n);
        self.flushes_waiting.reserve(n);
        self.parked_flushes.reserve(n);
        self.inflight.reserve(2 * n);
        self.write_spans.reserve(n);
        self.collecting.reserve(2 * n);
        self.pulling.reserve(2 * n);
        #[cfg(feature = "rdma")]
        let keys = match self.conn.rdma_link() {
            Some(l) => {
                let a = engine.arena();
                // SAFETY: the arena stays mapped while the engine lives, and the engine (in
                // `io`) outlives the link (in `conn`, dropped first).
                #[allow(unsafe_code)]
                let k = unsafe { l.register(a.base_ptr(), a.bytes()) };
                Some(k.map_err(|e| NetError::io("registering the arena for", self.peer, e))?)
            }
            None => None,
        };
        self.io = Some(IoSide {
            engine,
            lbio,
            dev,
            #[cfg(feature = "rdma")]
            keys,
        });
        Ok(())
    }

    /// Send `bytes` to the host for command `cid`, then its completion.
    fn send_data(&mut self, cid: u16, bytes: &[u8]) {
        let dg = self.conn.dg;
        let mut at = 0;
        while at < bytes.len() {
            let n = (bytes.len() - at).min(MAX_DATA as usize);
            pdu::put_c2h_data(
                &mut self.conn.tx,
                cid,
                at as u32,
                &bytes[at..at + n],
                at + n == bytes.len(),
                dg,
            );
            at += n;
        }
        self.respond(cid, Status::SUCCESS, 0, 0);
    }

    fn admin(&mut self, sqe: Sqe, data: Data) -> Result<(), String> {
        let cid = sqe.cid();
        let (_, len, _) = sqe.sgl();
        match sqe.opcode() {
            op::IDENTIFY => {
                let mut page = vec![0u8; 4096];
                let cns = sqe.cdw(10) as u8;
                match cns {
                    0 if sqe.nsid() == 1 => self.identify_ns(&mut page),
                    0 => {}
                    1 => self.identify_ctrl(&mut page),
                    2 => page[0..4].copy_from_slice(&1u32.to_le_bytes()),
                    3 if sqe.nsid() == 1 => {
                        // One descriptor: the NGUID, derived from the device path.
                        page[0] = 2;
                        page[1] = 16;
                        let h = crc32c::crc32c(self.shared.cfg.device.to_string_lossy().as_bytes());
                        page[4..8].copy_from_slice(&h.to_le_bytes());
                        page[8..12].copy_from_slice(b"aios");
                    }
                    _ => {
                        self.respond(cid, Status::INVALID_FIELD, 0, 0);
                        return Ok(());
                    }
                }
                let n = (len as usize).min(page.len());
                self.send_data(cid, &page[..n]);
            }
            op::GET_LOG_PAGE => {
                let numd = ((sqe.cdw(10) >> 16) | (sqe.cdw(11) & 0xffff) << 16) as usize + 1;
                let n = (numd * 4).min(len as usize).min(MAX_DATA as usize);
                self.send_data(cid, &vec![0u8; n]);
            }
            op::SET_FEATURES => {
                let fid = sqe.cdw(10) as u8;
                let dw0 = if fid == 0x07 {
                    // Number of queues: grant what was asked, up to 64 each.
                    let v = sqe.cdw(11);
                    (v & 0xffff).min(63) | ((v >> 16).min(63) << 16)
                } else {
                    0
                };
                self.respond(cid, Status::SUCCESS, dw0, 0);
            }
            op::GET_FEATURES => self.respond(cid, Status::SUCCESS, 0, 0),
            op::KEEP_ALIVE => self.respond(cid, Status::SUCCESS, 0, 0),
            // Held until an event (none is ever raised here), up to the limit Identify
            // Controller advertises; one more is answered at once, as the spec says.
            op::ASYNC_EVENT if self.aers.len() >= AER_LIMIT => {
                self.respond(cid, Status::AER_LIMIT_EXCEEDED, 0, 0)
            }
            op::ASYNC_EVENT => self.aers.push(cid),
            op::RIO_INFO => {
                let st = self.shared.lock();
                let recovering = matches!(st.log, LogSlot::Recovering(_));
                let dw1 =
                    self.shared.plp as u32 | (recovering as u32) << 1 | (st.streams as u32) << 16;
                let slots = st.slots;
                drop(st);
                self.respond(cid, Status::SUCCESS, slots, dw1);
            }
            op::RIO_GET_LOG => {
                let off = sqe.cdw(10) as usize | (sqe.cdw(11) as usize) << 32;
                let st = self.shared.lock();
                let pmr = st.log.pmr();
                let total = pmr.len();
                // One transfer at most (MDTS), whatever the descriptor says: the host reads
                // the log in pieces.
                let n = (len as usize)
                    .min(MAX_DATA as usize)
                    .min(total.saturating_sub(off));
                let mut out = vec![0u8; n];
                let r = pmr.read(off, &mut out);
                drop(st);
                match r {
                    Ok(()) => {
                        let dg = self.conn.dg;
                        if n > 0 {
                            pdu::put_c2h_data(&mut self.conn.tx, cid, 0, &out, true, dg);
                        }
                        self.respond(
                            cid,
                            Status::SUCCESS,
                            total as u32,
                            (total as u64 >> 32) as u32,
                        );
                    }
                    Err(e) => {
                        eprintln!("aios target: reading the attribute log: {e}");
                        self.respond(cid, Status::RIO_LOG, 0, 0);
                    }
                }
            }
            op::RIO_RESET => {
                let Data::Vec(d) = data else {
                    return Err("RIO_RESET without its data".into());
                };
                let r = self.reset(&d);
                match r {
                    Ok(generation) => {
                        if let Queue::Admin { cntlid } = self.queue {
                            self.shared.move_controller(cntlid, generation);
                        }
                        self.respond(cid, Status::SUCCESS, 0, 0)
                    }
                    Err(e) => {
                        eprintln!("aios target: {}: reset refused: {e}", self.peer);
                        self.respond(cid, Status::RIO_LOG, 0, 0);
                    }
                }
            }
            op::RIO_FENCE => {
                // A recovery starts: connections opened before it (an initiator that crashed
                // or lost them) may still deliver commands. From here on they can send the
                // device nothing, and what they already sent is complete before the answer,
                // so the log the recovery reads next holds every write they made and no write
                // of theirs lands after the recovery's zeroing.
                let generation = {
                    let mut st = self.shared.lock();
                    st.generation += 1;
                    self.shared.publish_generation(&st);
                    st.generation
                };
                if let Queue::Admin { cntlid } = self.queue {
                    self.shared.move_controller(cntlid, generation);
                }
                let t0 = Instant::now();
                match self.shared.drain_older(generation) {
                    Ok(()) => {
                        if self.shared.cfg.verbose {
                            eprintln!(
                                "aios target: {}: fence: generation {generation}; older connections' writes done after {:.1} ms",
                                self.peer,
                                t0.elapsed().as_secs_f64() * 1e3
                            );
                        }
                        self.respond(cid, Status::SUCCESS, 0, 0)
                    }
                    Err(out) => {
                        eprintln!(
                            "aios target: {}: fence: {out} writes of older connections still on the device after {} s",
                            self.peer,
                            FENCE_WAIT.as_secs()
                        );
                        self.respond(cid, Status::INTERNAL, 0, 0);
                    }
                }
            }
            other => {
                eprintln!(
                    "aios target: {}: admin opcode {other:#04x} not supported",
                    self.peer
                );
                self.respond(cid, Status::INVALID_OPCODE, 0, 0);
            }
        }
        Ok(())
    }

    /// Start a new log epoch with the initiator's marks (one u64 per log stream).
    /// The new generation, or why the reset was refused.
    fn reset(&mut self, d: &[u8]) -> Result<u64, String> {
        let mut st = self.shared.lock();
        let streams = st.streams as usize;
        if d.len() != streams * 8 {
            return Err(format!(
                "{} bytes of marks for a log of {streams} streams",
                d.len()
            ));
        }
        let marks: Vec<u64> = d
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")).max(1))
            .collect();
        let pmr = match std::mem::replace(&mut st.log, LogSlot::Moving) {
            LogSlot::Live(l) => l.into_pmr(),
            LogSlot::Recovering(p) => p,
            LogSlot::Moving => unreachable!("never left moving"),
        };
        let reopened = if rio_ordering::scan(&pmr).is_ok() {
            AttrLog::reopen(pmr, &marks)
        } else {
            let r = AttrLog::format(pmr, streams as u16);
            r.and_then(|l| AttrLog::reopen(l.into_pmr(), &marks))
        };
        match reopened {
            Ok(l) => {
                st.slots = l.slots();
                st.log = LogSlot::Live(l);
                st.generation += 1;
                self.shared.publish_generation(&st);
                st.submitted = marks.iter().map(|m| m - 1).collect();
                st.flushed_to = st.submitted.clone();
                st.failed_from = vec![u64::MAX; streams];
                Ok(st.generation)
            }
            Err(e) => {
                // The region is gone with the failed reopen: reopen it from its source.
                match open_pmr(&self.shared.cfg.log) {
                    Ok(p) => st.log = LogSlot::Recovering(p),
                    Err(e2) => {
                        return Err(format!("{e}; reopening the log region failed too: {e2}"))
                    }
                }
                Err(e.to_string())
            }
        }
    }

    fn identify_ctrl(&self, p: &mut [u8]) {
        p[0..2].copy_from_slice(&0x1d1du16.to_le_bytes()); // VID
        put_str(&mut p[4..24], "aios0001");
        put_str(&mut p[24..64], "aios rio-net target");
        put_str(&mut p[64..72], env!("CARGO_PKG_VERSION"));
        p[76] = 1; // CMIC: none; IEEE OUI left 0
        p[77] = 5; // MDTS: 2^5 × 4 KiB
        if let Queue::Admin { cntlid } = self.queue {
            p[78..80].copy_from_slice(&cntlid.to_le_bytes());
        }
        p[80..84].copy_from_slice(&0x0001_0400u32.to_le_bytes()); // VER 1.4
        p[96..100].copy_from_slice(&(1u32 << 8).to_le_bytes()); // OAES: namespace attribute notices
        p[111] = 1; // CNTRLTYPE: I/O controller
        p[258] = 3; // ACL
        p[259] = (AER_LIMIT - 1) as u8; // AERL (0's based)
        p[261] = 0x04; // LPA: extended data for Get Log Page
        p[262] = 0; // ELPE
        p[320..322].copy_from_slice(&100u16.to_le_bytes()); // KAS: 100 ms units
        p[512] = 0x66; // SQES
        p[513] = 0x44; // CQES
        p[514..516].copy_from_slice(&1024u16.to_le_bytes()); // MAXCMD
        p[516..520].copy_from_slice(&1u32.to_le_bytes()); // NN
        p[520..522].copy_from_slice(&(1u16 << 3).to_le_bytes()); // ONCS: Write Zeroes
        p[525] = (!self.shared.plp) as u8; // VWC
                                           // SGLS: SGLs supported, keyed data blocks off, offset-based in-capsule data.
        p[536..540].copy_from_slice(&(1u32 | 1 << 20).to_le_bytes());
        let nqn = self.shared.cfg.subnqn.as_bytes();
        let n = nqn.len().min(255);
        p[768..768 + n].copy_from_slice(&nqn[..n]);
        let ioccsz = (64 + self.shared.cfg.in_capsule) / 16;
        p[1792..1796].copy_from_slice(&ioccsz.to_le_bytes());
        p[1796..1800].copy_from_slice(&1u32.to_le_bytes()); // IORCSZ
        p[1800..1802].copy_from_slice(&0u16.to_le_bytes()); // ICDOFF
        p[1802] = 0; // FCATT: dynamic controller model
        p[1803] = 0; // MSDBD
    }

    fn identify_ns(&self, p: &mut [u8]) {
        let blocks = self.shared.ns_bytes / LBA as u64;
        p[0..8].copy_from_slice(&blocks.to_le_bytes());
        p[8..16].copy_from_slice(&blocks.to_le_bytes());
        p[16..24].copy_from_slice(&blocks.to_le_bytes());
        p[25] = 0; // NLBAF: one format
        p[26] = 0; // FLBAS: format 0
        p[128 + 2] = LBA.trailing_zeros() as u8; // LBAF0.LBADS
    }

    fn io_cmd(&mut self, sqe: Sqe, data: Data) -> Result<(), String> {
        let cid = sqe.cid();
        let opc = sqe.opcode();
        if opc == op::RIO_MARK {
            let stream = sqe.cdw(10) as u16;
            let mark = sqe.cdw(11) as u64 | (sqe.cdw(12) as u64) << 32;
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            if st.generation != self.generation {
                drop(guard);
                // Its marks name groups of a log that recovery has since reset.
                self.respond(cid, Status::RIO_BAD_ATTR, 0, 0);
                return Ok(());
            }
            if let LogSlot::Live(l) = &mut st.log {
                if stream < l.streams() {
                    l.durable(stream, mark.min(st.failed_from[stream as usize]));
                }
            }
            drop(guard);
            self.respond(cid, Status::SUCCESS, 0, 0);
            return Ok(());
        }
        if sqe.nsid() != 1 && !(opc == op::FLUSH && sqe.nsid() == u32::MAX) {
            self.respond(cid, Status::INVALID_NS, 0, 0);
            return Ok(());
        }
        if matches!(opc, op::READ | op::WRITE | op::WRITE_ZEROES) {
            let off = sqe.slba().checked_mul(LBA as u64);
            let len = sqe.nlb() as u64 * LBA as u64;
            let inside = off
                .and_then(|o| o.checked_add(len))
                .is_some_and(|e| e <= self.shared.ns_bytes);
            if !inside {
                self.respond(cid, Status::LBA_OUT_OF_RANGE, 0, 0);
                return Ok(());
            }
            let sgl_len = sqe.sgl().1 as u64;
            if opc != op::WRITE_ZEROES && sgl_len != len {
                self.respond(cid, Status::SGL_INVALID, 0, 0);
                return Ok(());
            }
        }
        if sqe.rio_op() == pdu::RIO_ORDERED {
            // One lock for the attribute: its widening reference and the mark it carries.
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            let streams = st.streams;
            let a = WireAttr::get(&sqe, |s| st.submitted.get(s as usize).copied().unwrap_or(0))
                .expect("an ordered command carries an attribute");
            let ok = matches!(opc, op::WRITE | op::FLUSH) && a.stream < streams;
            if ok && a.mark > 0 && st.generation == self.generation {
                if let LogSlot::Live(l) = &mut st.log {
                    l.durable(a.stream, a.mark.min(st.failed_from[a.stream as usize]));
                }
            }
            drop(guard);
            if !ok {
                eprintln!(
                    "aios target: {}: ordered command refused (opcode {opc:#04x}, stream {} of {streams})",
                    self.peer, a.stream
                );
                self.respond(cid, Status::RIO_BAD_ATTR, 0, 0);
                return Ok(());
            }
            let held = Held {
                sqe,
                data,
                attr: a,
                overlap_counted: false,
            };
            if opc == op::FLUSH
                && (!self.collecting.is_empty()
                    || !self.pulling.is_empty()
                    || !self.parked_flushes.is_empty())
            {
                // Writes that arrived before this FLUSH still wait for their data: it waits for
                // those (numbered up to `arrivals`), not for ones that come after it.
                self.parked_flushes.push_back((held, self.arrivals));
                return Ok(());
            }
            self.held.push_back(held);
            return Ok(());
        }
        match opc {
            op::WRITE => {
                let Data::Fixed(buf) = data else {
                    self.respond(cid, Status::SGL_INVALID, 0, 0);
                    return Ok(());
                };
                self.shared.orderless.fetch_add(1, Ordering::Relaxed);
                let start = sqe.slba() * LBA as u64;
                let end = start + buf.len() as u64;
                let io = Io::write(start, buf).fua(sqe.fua());
                self.submit_span(
                    io,
                    InFlight::Write {
                        cid,
                        ordered: None,
                        order_no: 0,
                    },
                    Some((start, end)),
                );
            }
            op::READ => {
                // `command` took its buffer when the arena had room.
                let Data::Fixed(buf) = data else {
                    self.respond(cid, Status::INTERNAL, 0, 0);
                    return Ok(());
                };
                self.shared.reads.fetch_add(1, Ordering::Relaxed);
                self.submit(
                    Io::read(sqe.slba() * LBA as u64, buf),
                    InFlight::Read { cid },
                );
            }
            op::FLUSH => {
                self.shared.orderless.fetch_add(1, Ordering::Relaxed);
                self.submit(
                    Io::flush(),
                    InFlight::Flush {
                        cid,
                        ordered: None,
                        short: false,
                    },
                );
            }
            op::WRITE_ZEROES => {
                let off = sqe.slba() * LBA as u64;
                let end = off + sqe.nlb() as u64 * LBA as u64;
                self.shared.orderless.fetch_add(1, Ordering::Relaxed);
                let first = match data {
                    Data::Fixed(b) => Some(b),
                    _ => None,
                };
                self.zeroes(cid, off, end, first)?;
            }
            other => {
                eprintln!(
                    "aios target: {}: I/O opcode {other:#04x} not supported",
                    self.peer
                );
                self.respond(cid, Status::INVALID_OPCODE, 0, 0);
            }
        }
        Ok(())
    }

    /// Write zeroes over `off..end`, one piece at a time.
    /// `first`: a buffer already taken for it (at least the first piece's length).
    fn zeroes(
        &mut self,
        cid: u16,
        off: u64,
        end: u64,
        first: Option<FixedBuf>,
    ) -> Result<(), String> {
        if off >= end {
            self.respond(cid, Status::SUCCESS, 0, 0);
            return Ok(());
        }
        let n = (end - off).min(MAX_DATA as u64) as usize;
        let io = self.io.as_ref().expect("I/O queue");
        let Some(mut buf) = first
            .filter(|b| b.capacity() >= n)
            .or_else(|| io.engine.try_alloc(n))
        else {
            self.respond(cid, Status::INTERNAL, 0, 0);
            return Ok(());
        };
        buf.set_len(n).map_err(|e| e.to_string())?;
        buf.fill(0);
        self.submit(
            Io::write(off, buf),
            InFlight::Zeroes {
                cid,
                next: off + n as u64,
                end,
            },
        );
        Ok(())
    }

    /// Send `io` to the device, to be completed as `what`. Whether it went (a refusal is
    /// answered to the host here).
    /// An ordered write of group `write` (`None`: an ordered FLUSH) of `stream` failed after its
    /// entry went into the log. A failed write fails its group; a failed FLUSH, every group
    /// after the last one a FLUSH made durable here (it may have dropped any of them: a FLUSH
    /// that succeeds later says nothing about what this one lost). No later FLUSH entry
    /// vouches for those groups, and no mark frees their entries.
    fn ordered_failed(&self, stream: u16, write: Option<u64>) {
        let mut guard = self.shared.lock();
        let g = &mut *guard;
        if g.generation != self.generation {
            return; // the log it wrote to has been reset since
        }
        let s = stream as usize;
        let from = write.unwrap_or(g.flushed_to[s] + 1);
        g.failed_from[s] = g.failed_from[s].min(from);
    }

    /// A plain FLUSH failed: for every stream, as [`TConn::ordered_failed`] for a failed
    /// ordered FLUSH.
    fn flush_failed_for_all(&self) {
        let mut guard = self.shared.lock();
        let g = &mut *guard;
        if g.generation != self.generation {
            return;
        }
        for s in 0..g.failed_from.len() {
            g.failed_from[s] = g.failed_from[s].min(g.flushed_to[s] + 1);
        }
    }

    fn submit(&mut self, io: Io, what: InFlight) -> bool {
        self.submit_span(io, what, None)
    }

    /// [`TConn::submit`] for a write over `span` (first byte, end): kept in `write_spans`
    /// while it is on the device.
    fn submit_span(&mut self, io: Io, what: InFlight, span: Option<(u64, u64)>) -> bool {
        let side = self.io.as_ref().expect("I/O queue");
        // Counted first, then the generation read: see `Gate`.
        let counted = Gate::counts(&what);
        if counted {
            self.gate.out.fetch_add(1, Ordering::SeqCst);
        }
        let fenced = counted && self.shared.generation.load(Ordering::SeqCst) != self.generation;
        let sent = if fenced {
            Err(None)
        } else {
            side.dev.submit(io).map_err(|(e, _)| Some(e))
        };
        match sent {
            Ok(tag) => {
                self.inflight.insert(tag.0, what);
                if let Some((start, end)) = span {
                    self.write_spans.push((tag.0, start, end));
                }
                true
            }
            Err(e) => {
                self.gate.done(&what);
                match &e {
                    Some(e) => {
                        eprintln!("aios target: {}: device refused a request: {e}", self.peer)
                    }
                    None => {
                        if self.shared.cfg.verbose {
                            eprintln!(
                                "aios target: {}: write refused: a recovery started after this connection opened",
                                self.peer
                            );
                        }
                    }
                }
                match what {
                    InFlight::Write {
                        ordered: Some((_, stream, seq)),
                        ..
                    } => self.ordered_failed(stream, Some(seq)),
                    InFlight::Flush {
                        ordered: Some((_, stream, _)),
                        ..
                    } => self.ordered_failed(stream, None),
                    _ => {}
                }
                let cid = match what {
                    InFlight::Write { cid, .. }
                    | InFlight::Flush { cid, .. }
                    | InFlight::Read { cid }
                    | InFlight::Zeroes { cid, .. } => cid,
                };
                let st = if e.is_none() {
                    Status::FENCED
                } else {
                    Status::INTERNAL
                };
                self.respond(cid, st, 0, 0);
                false
            }
        }
    }

    /// Move parked FLUSHes whose earlier writes have all left `collecting` and `pulling` (their
    /// data in, so they are in `held` ahead of the FLUSH, or answered) into `held`, in order.
    fn release_parked_flushes(&mut self) -> bool {
        let mut any = false;
        while let Some(&(_, before)) = self.parked_flushes.front() {
            if self
                .collecting
                .values()
                .chain(self.pulling.values())
                .any(|c| c.arrived <= before)
            {
                break;
            }
            let (held, _) = self.parked_flushes.pop_front().expect("front");
            self.held.push_back(held);
            any = true;
        }
        any
    }

    /// Submit held ordered commands whose turn has come. Returns whether any went.
    fn advance_held(&mut self) -> Result<bool, String> {
        let mut any = false;
        while let Some(h) = self.held.front() {
            let a = h.attr;
            let is_flush = h.sqe.opcode() == op::FLUSH;
            if is_flush {
                // It waits for the writes out now; later ones need not wait for it.
                let h = self.held.pop_front().expect("front");
                self.flushes_waiting.push_back(WaitingFlush {
                    held: h,
                    before: self.ordered_sent,
                    out: self.ordered_out,
                });
                any = true;
                continue;
            }
            // Storage order is submission order: a write over bytes an earlier write still on
            // the device covers waits for it (the device may complete the two in any order).
            let start = h.sqe.slba() * LBA as u64;
            let end = start + h.sqe.nlb() as u64 * LBA as u64;
            if self
                .write_spans
                .iter()
                .any(|&(_, s, e)| s < end && start < e)
            {
                if !h.overlap_counted {
                    self.shared.overlap_waits.fetch_add(1, Ordering::Relaxed);
                    if let Some(h) = self.held.front_mut() {
                        h.overlap_counted = true;
                    }
                }
                break;
            }
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            if st.generation != self.generation {
                return Err("ordered write on a connection from before the last recovery".into());
            }
            let LogSlot::Live(log) = &mut st.log else {
                drop(guard);
                let h = self.held.pop_front().expect("front");
                eprintln!(
                    "aios target: {}: ordered write before recovery reset the log: refused",
                    self.peer
                );
                self.respond(h.sqe.cid(), Status::RIO_BAD_ATTR, 0, 0);
                any = true;
                continue;
            };
            let s = a.stream as usize;
            if a.prev > st.submitted[s] {
                break; // the previous group has not reached this server yet
            }
            let (offset, len) = if is_flush {
                (0, 0)
            } else {
                (h.sqe.slba() * LBA as u64, h.sqe.nlb() * LBA)
            };
            let entry = Attr {
                stream: a.stream,
                target: 0,
                seq: a.seq,
                seq_end: a.seq_end,
                prev: a.prev,
                offset,
                len,
                boundary: a.boundary,
                ipu: a.ipu,
                flush: a.flush || is_flush,
                merged: a.merged,
                num: a.num,
                members: if is_flush { 0 } else { a.members },
                split: a.split,
                ..Attr::default()
            };
            let slot = match log.append(&entry) {
                Ok(slot) => slot,
                Err(RioError::LogFull { .. }) => {
                    st.log_full += 1;
                    break; // wait for the initiator's marks to free slots
                }
                Err(e) => {
                    drop(guard);
                    eprintln!("aios target: {}: attribute log: {e}", self.peer);
                    let h = self.held.pop_front().expect("front");
                    self.respond(h.sqe.cid(), Status::RIO_LOG, 0, 0);
                    any = true;
                    continue;
                }
            };
            st.submitted[s] = st.submitted[s].max(a.seq_end);
            drop(guard);
            let h = self.held.pop_front().expect("front");
            let cid = h.sqe.cid();
            if is_flush {
                self.shared.ordered_flushes.fetch_add(1, Ordering::Relaxed);
                self.submit(
                    Io::flush(),
                    InFlight::Flush {
                        cid,
                        ordered: Some((slot, a.stream, a.seq)),
                        short: false,
                    },
                );
            } else {
                let Data::Fixed(buf) = h.data else {
                    // Its entry is in the log, but its data never goes to the device.
                    self.ordered_failed(a.stream, Some(a.seq));
                    self.respond(cid, Status::SGL_INVALID, 0, 0);
                    continue;
                };
                self.shared.ordered_writes.fetch_add(1, Ordering::Relaxed);
                let io = Io::write(offset, buf).fua(h.sqe.fua());
                let write = InFlight::Write {
                    cid,
                    ordered: Some((slot, a.stream, a.seq)),
                    order_no: self.ordered_sent,
                };
                if self.submit_span(io, write, Some((offset, offset + len as u64))) {
                    self.ordered_sent += 1;
                    self.ordered_out += 1;
                }
            }
            any = true;
        }
        Ok(any)
    }

    /// Start the waiting FLUSHes whose writes have all completed, in order.
    fn start_flushes(&mut self) -> Result<bool, String> {
        let mut any = false;
        while self.flushes_waiting.front().is_some_and(|f| f.out == 0) {
            let h = self.flushes_waiting.pop_front().expect("front").held;
            let a = h.attr;
            let cid = h.sqe.cid();
            let mut guard = self.shared.lock();
            let st = &mut *guard;
            if st.generation != self.generation {
                return Err("ordered FLUSH on a connection from before the last recovery".into());
            }
            let LogSlot::Live(log) = &mut st.log else {
                drop(guard);
                self.respond(cid, Status::RIO_BAD_ATTR, 0, 0);
                continue;
            };
            // A FLUSH entry vouches for every earlier group of its stream here: never for one
            // whose write failed or that an earlier failed FLUSH may have dropped.
            let seq = a.seq.min(
                st.failed_from
                    .get(a.stream as usize)
                    .map_or(u64::MAX, |f| f.saturating_sub(1)),
            );
            let entry = Attr {
                stream: a.stream,
                seq,
                seq_end: seq,
                prev: a.prev,
                flush: true,
                ..Attr::default()
            };
            let slot = match log.append(&entry) {
                Ok(slot) => slot,
                Err(RioError::LogFull { .. }) => {
                    st.log_full += 1;
                    drop(guard);
                    // Its writes are all done: it waits for nothing but room in the log.
                    self.flushes_waiting.push_front(WaitingFlush {
                        held: h,
                        before: 0,
                        out: 0,
                    });
                    break;
                }
                Err(e) => {
                    drop(guard);
                    eprintln!("aios target: {}: attribute log: {e}", self.peer);
                    self.respond(cid, Status::RIO_LOG, 0, 0);
                    continue;
                }
            };
            drop(guard);
            self.shared.ordered_flushes.fetch_add(1, Ordering::Relaxed);
            self.submit(
                Io::flush(),
                InFlight::Flush {
                    cid,
                    ordered: Some((slot, a.stream, seq)),
                    short: seq < a.seq,
                },
            );
            any = true;
        }
        Ok(any)
    }

    /// Take device completions. Returns whether any came.
    fn reap(&mut self) -> Result<bool, String> {
        let io = self.io.as_ref().expect("reap with a device");
        io.engine
            .poll_completions()
            .map_err(|e| format!("engine: {e}"))?;
        let mut any = false;
        loop {
            let io = self.io.as_ref().expect("device");
            let Some(done) = io.lbio.take_done() else {
                break;
            };
            any = true;
            if TEST_HOLD_WRITE_COMPLETION.load(Ordering::Relaxed) != 0
                && matches!(self.inflight.get(&done.tag.0), Some(InFlight::Write { .. }))
            {
                hold_test_completion(&TEST_HOLD_WRITE_COMPLETION);
            }
            let Some(what) = self.inflight.remove(&done.tag.0) else {
                continue;
            };
            if let Some(i) = self.write_spans.iter().position(|w| w.0 == done.tag.0) {
                self.write_spans.swap_remove(i);
            }
            self.gate.done(&what);
            self.complete(what, done.result.map(|_| ()), done.buf)?;
        }
        Ok(any)
    }

    fn complete(
        &mut self,
        what: InFlight,
        result: Result<(), lbio::LbioError>,
        buf: Option<FixedBuf>,
    ) -> Result<(), String> {
        let failed = |peer: SocketAddr, e: &lbio::LbioError| {
            eprintln!("aios target: {peer}: device request failed: {e}");
            Status::DATA_TRANSFER_ERROR
        };
        let order_no = match &what {
            InFlight::Write { order_no, .. } => *order_no,
            _ => 0,
        };
        if matches!(
            what,
            InFlight::Flush {
                ordered: Some(_),
                ..
            }
        ) {
            hold_test_completion(&TEST_HOLD_ORDERED_FLUSH);
        }
        let mut result = result;
        let injected = match &what {
            InFlight::Write {
                ordered: Some(_), ..
            } => take_test_fault(&TEST_FAIL_ORDERED_WRITES).then_some(lbio::Op::Write),
            InFlight::Flush {
                ordered: Some(_), ..
            } => take_test_fault(&TEST_FAIL_ORDERED_FLUSHES).then_some(lbio::Op::Flush),
            InFlight::Flush { ordered: None, .. } => {
                take_test_fault(&TEST_FAIL_PLAIN_FLUSHES).then_some(lbio::Op::Flush)
            }
            _ => None,
        };
        if let (Some(op), Ok(())) = (injected, &result) {
            result = Err(lbio::LbioError::Io {
                op,
                offset: 0,
                len: 0,
                source: std::io::Error::from_raw_os_error(5), // EIO,
            });
        }
        let short = matches!(what, InFlight::Flush { short: true, .. });
        match what {
            InFlight::Write { cid, ordered, .. } | InFlight::Flush { cid, ordered, .. } => {
                let was_write = buf.is_some();
                if ordered.is_some() && was_write {
                    self.ordered_out -= 1;
                    for f in self.flushes_waiting.iter_mut() {
                        if order_no < f.before {
                            f.out -= 1;
                        }
                    }
                }
                let st = match &result {
                    Ok(()) => {
                        let mut st = Status::SUCCESS;
                        // The data is durable: at once with power-loss protection, and
                        // always for a completed FLUSH. Its entry's persist word says so; when
                        // it cannot be set, the host is told the command failed, so that it
                        // never counts durable what recovery will not.
                        if let Some((slot, stream, seq)) = ordered {
                            if !was_write || self.shared.plp {
                                let mut guard = self.shared.lock();
                                let g = &mut *guard;
                                let s = stream as usize;
                                // A slot of a log that recovery has reset since may hold
                                // another entry now: its persist word is not this one's. And
                                // nothing from the stream's first failure on is vouched for,
                                // though this entry went in before the failure was known
                                // (another FLUSH out with this one failed, say).
                                let vouched = g.generation == self.generation
                                    && seq < g.failed_from[s]
                                    && !short
                                    && match &mut g.log {
                                        LogSlot::Live(l) => match l.set_persist(slot, seq) {
                                            Ok(()) => true,
                                            Err(e) => {
                                                eprintln!(
                                                    "aios target: setting a persist word: {e}"
                                                );
                                                false
                                            }
                                        },
                                        _ => false,
                                    };
                                if vouched && !was_write {
                                    g.flushed_to[s] = g.flushed_to[s].max(seq);
                                }
                                if !vouched {
                                    st = Status::RIO_NOT_DURABLE;
                                }
                            }
                        }
                        st
                    }
                    Err(e) => {
                        match ordered {
                            Some((_, stream, seq)) => {
                                self.ordered_failed(stream, was_write.then_some(seq))
                            }
                            // A plain FLUSH that failed may have dropped any stream's writes
                            // (the device lost them, not this connection).
                            None if !was_write => self.flush_failed_for_all(),
                            None => {}
                        }
                        failed(self.peer, e)
                    }
                };
                self.respond(cid, st, 0, 0);
            }
            InFlight::Read { cid } => match (&result, buf) {
                (Ok(()), Some(b)) => self.send_data(cid, &b),
                (Err(e), _) => {
                    let st = failed(self.peer, e);
                    self.respond(cid, st, 0, 0);
                }
                (Ok(()), None) => self.respond(cid, Status::INTERNAL, 0, 0),
            },
            InFlight::Zeroes { cid, next, end } => match result {
                Ok(()) => {
                    drop(buf);
                    self.zeroes(cid, next, end, None)?;
                }
                Err(e) => {
                    let st = failed(self.peer, &e);
                    self.respond(cid, st, 0, 0);
                }
            },
        }
        Ok(())
    }
}

fn put_str(out: &mut [u8], s: &str) {
    out.fill(b' ');
    let n = s.len().min(out.len());
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn nqn(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim().to_string()
}
