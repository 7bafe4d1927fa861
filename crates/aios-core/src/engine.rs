//! The per-core `Engine`: its io_uring rings, registered files, buffer arena, completion dispatch
//! and a single-thread executor.
//!
//! An engine belongs to the thread that created it (`Rc`, `RefCell`, a `SINGLE_ISSUER` ring).
//! Layers above it (lbio) push SQEs tagged with a *sink* id and a payload; when the CQE comes back
//! the engine hands `(payload, result, flags)` to that sink. The tag is the payload — lbio uses
//! its slot index — so completion costs no lookup beyond an array index.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::pin::{pin, Pin};
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread, ThreadId};
use std::time::{Duration, Instant};

use io_uring::{cqueue, squeue, types, IoUring};

use crate::arena::{Arena, FixedBuf, SharedRegion};
use crate::error::CoreError;
use crate::sys;

/// Shared regions an engine can register beside its arena (fixed buffers 1..=N).
pub const MAX_SHARED_REGIONS: usize = 4;
/// Completion sinks an engine can hold (the top byte of `user_data` names one).
pub const MAX_COMPLETION_SINKS: usize = 8;
const SINK_SHIFT: u32 = 56;
/// Bits of `user_data` left to a sink's payload.
pub const PAYLOAD_MASK: u64 = (1 << SINK_SHIFT) - 1;
/// CQEs copied out of the ring per borrow, before they are dispatched.
const REAP_BATCH: usize = 64;
/// `IORING_ENTER_GETEVENTS` from the kernel ABI (the io-uring crate keeps its copy private).
const IORING_ENTER_GETEVENTS: u32 = 1;
/// Setup flags from the kernel ABI, to report what a ring was built with.
const IORING_SETUP_SQE128: u32 = 1 << 10;
const IORING_SETUP_CQE32: u32 = 1 << 11;

/// How the engine waits for completions when a caller must block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionMode {
    /// Sleep in `io_uring_enter` until a completion arrives (one syscall submits and waits).
    Wait,
    /// Spin on the completion queue (running deferred task work with non-blocking enters)
    /// instead of sleeping: no wake-up latency, at the cost of a busy core while waiting.
    BusyPoll,
    /// Spin as `BusyPoll` does for at most `spin` per wait, then sleep as `Wait` does: a wait
    /// the device answers within `spin` pays no wake-up, and a long one costs at most `spin`
    /// of CPU (per wait: a caller that waits for several I/Os one after another may spin that
    /// long for each). [`HYBRID_SPIN`] is a budget that covers a flash write with FUA.
    Hybrid {
        /// Longest spin of one wait before it sleeps.
        spin: Duration,
    },
}

/// A [`CompletionMode::Hybrid`] spin budget that covers a 4 KiB FUA write on the devices
/// measured here (23 µs on the `ull` loop device busy-polled, 41 µs when the thread sleeps), and
/// the two-write phase of a small journal commit (55–60 µs), with room to spare.
pub const HYBRID_SPIN: Duration = Duration::from_micros(100);

impl CompletionMode {
    /// [`CompletionMode::Hybrid`] with the [`HYBRID_SPIN`] budget.
    pub const fn hybrid() -> CompletionMode {
        CompletionMode::Hybrid { spin: HYBRID_SPIN }
    }

    /// A short name for logs and tables: `wait`, `poll` or `hybrid`.
    pub fn name(self) -> &'static str {
        match self {
            CompletionMode::Wait => "wait",
            CompletionMode::BusyPoll => "poll",
            CompletionMode::Hybrid { .. } => "hybrid",
        }
    }
}

/// Which of the engine's rings an SQE goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingKind {
    /// The ordinary ring: everything.
    Main,
    /// The IOPOLL ring (when configured): polled reads and writes on devices that support it.
    Iopoll,
}

/// Engine settings, validated once by [`Engine::new`].
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Submission-queue entries per ring (power of two, 1..=32768).
    pub ring_entries: u32,
    /// Bytes of registered buffer arena (rounded up to whole frames).
    pub arena_bytes: usize,
    /// Bytes per arena frame (power of two, at least 512).
    pub frame_bytes: usize,
    /// Try explicit huge pages for the arena first.
    pub huge_pages: bool,
    /// Registered-file slots.
    pub max_files: u32,
    /// How blocking waits for completions behave.
    pub completion: CompletionMode,
    /// Run an SQPOLL kernel thread with this idle time (only when set).
    pub sqpoll_idle: Option<Duration>,
    /// Create an IOPOLL ring beside the main one (only when set; fails loudly if unsupported).
    pub iopoll_ring: bool,
    /// Ask for `IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN | COOP_TASKRUN`; each is dropped, one at
    /// a time, if the kernel answers EINVAL.
    pub fast_flags: bool,
    /// Register each ring's descriptor with the thread (`IORING_REGISTER_RING_FDS`), so that
    /// `io_uring_enter` names the ring by index and skips the descriptor lookup. Dropped, with
    /// the reason in [`Engine::ring_setup`], where the kernel refuses (before 5.18, or a thread
    /// already holding 16).
    pub register_ring_fd: bool,
    /// Register an eventfd that the kernel signals on completions (to drive the engine from
    /// another event loop, e.g. tokio's `AsyncFd`).
    pub eventfd: bool,
    /// Build every ring with 128-byte SQEs and 32-byte CQEs (`SQE128 | CQE32`), which NVMe
    /// passthrough (`IORING_OP_URING_CMD`, see [`Engine::push_cmd`]) needs. Doubles the rings'
    /// memory; ordinary SQEs work on such rings too.
    pub passthrough: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            ring_entries: 1024,
            arena_bytes: 16 << 20,
            frame_bytes: 4096,
            huge_pages: true,
            max_files: 64,
            completion: CompletionMode::Wait,
            sqpoll_idle: None,
            iopoll_ring: false,
            fast_flags: true,
            register_ring_fd: true,
            eventfd: false,
            passthrough: false,
        }
    }
}

impl EngineConfig {
    fn validate(&self) -> Result<(), CoreError> {
        if !self.ring_entries.is_power_of_two() || self.ring_entries > 32768 {
            return Err(CoreError::Config(format!(
                "ring_entries {} must be a power of two in 1..=32768",
                self.ring_entries
            )));
        }
        if self.max_files == 0 || self.max_files > 1 << 20 {
            return Err(CoreError::Config(format!(
                "max_files {} must be in 1..=1048576",
                self.max_files
            )));
        }
        // Checked here, before `Engine::new` divides by it to size the memlock check.
        if !self.frame_bytes.is_power_of_two() || !(512..=1 << 30).contains(&self.frame_bytes) {
            return Err(CoreError::Config(format!(
                "frame_bytes {} must be a power of two in 512..=1 GiB",
                self.frame_bytes
            )));
        }
        if self.arena_bytes == 0 || self.arena_bytes > 1 << 30 {
            return Err(CoreError::Config(format!(
                "arena_bytes {} must be in 1..=1 GiB (one registered buffer)",
                self.arena_bytes
            )));
        }
        Ok(())
    }
}

/// What the ring setup ended up with: the flags applied and those dropped (with why).
#[derive(Clone, Debug, Default)]
pub struct RingSetup {
    pub applied: Vec<&'static str>,
    pub dropped: Vec<(&'static str, String)>,
}

/// Counters of one engine. Read with [`Engine::metrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineMetrics {
    /// SQEs pushed.
    pub sqes: u64,
    /// `io_uring_enter` calls.
    pub enters: u64,
    /// CQEs dispatched to sinks.
    pub cqes: u64,
    /// CQEs whose sink was gone.
    pub orphan_cqes: u64,
    /// Waits that slept in the kernel.
    pub sleeps: u64,
    /// Busy-poll spins that found nothing.
    pub empty_polls: u64,
}

/// Receives the completions of SQEs pushed with its [`SinkId`].
pub trait CompletionSink {
    /// Called once per CQE, on the engine's thread, outside any engine borrow.
    fn complete(&self, payload: u64, result: i32, flags: u32);
}

/// A device simulated in software (lbio's `SimDisk`): it keeps the requests started on it and
/// completes them, in an order of its choosing, when the engine needs progress.
pub trait SoftDevice {
    /// Requests started and not yet completed.
    fn pending(&self) -> u32;
    /// Complete at least one pending request by pushing an SQE whose completion stands for it (a
    /// NOP for its sink, see [`nop_sqe`]); the engine then dispatches it like any other.
    fn advance(&self, engine: &Engine) -> Result<(), CoreError>;
}

/// A sink that keeps the result of the last completion it got (one request at a time: probes,
/// capability checks).
pub(crate) struct LastResult(pub(crate) Cell<Option<i32>>);

impl CompletionSink for LastResult {
    fn complete(&self, _payload: u64, result: i32, _flags: u32) {
        self.0.set(Some(result));
    }
}

/// Names a registered completion sink (the top byte of each of its SQEs' `user_data`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SinkId(pub u8);

/// A file registered with the engine's rings (use with `types::Fixed`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedFile(pub u32);

struct WakeState {
    woken: AtomicBool,
    thread: Thread,
}

impl Wake for WakeState {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// A ring of either SQE format.
enum Uring {
    Std(IoUring),
    /// SQE128 | CQE32: room for an 80-byte passthrough command and a 16-byte extra result.
    Big(IoUring<squeue::Entry128, cqueue::Entry32>),
}

impl Uring {
    fn submitter(&self) -> io_uring::Submitter<'_> {
        match self {
            Uring::Std(u) => u.submitter(),
            Uring::Big(u) => u.submitter(),
        }
    }

    fn fd(&self) -> RawFd {
        match self {
            Uring::Std(u) => u.as_raw_fd(),
            Uring::Big(u) => u.as_raw_fd(),
        }
    }

    /// Push one SQE; `false` when the submission queue is full.
    ///
    /// # Safety
    /// As [`io_uring::SubmissionQueue::push`]: the SQE's buffers and files stay valid until its
    /// completion.
    unsafe fn push(&mut self, sqe: &Sqe) -> bool {
        // SAFETY: forwarded to the caller.
        unsafe {
            match (self, sqe) {
                (Uring::Std(u), Sqe::Std(e)) => u.submission().push(e).is_ok(),
                (Uring::Big(u), Sqe::Std(e)) => u
                    .submission()
                    .push(&squeue::Entry128::from(e.clone()))
                    .is_ok(),
                (Uring::Big(u), Sqe::Big(e)) => u.submission().push(e).is_ok(),
                (Uring::Std(_), Sqe::Big(_)) => {
                    unreachable!("push_cmd checks the ring format first")
                }
            }
        }
    }

    /// Whether the ring was set up with a submission-queue polling thread.
    fn sqpoll(&self) -> bool {
        match self {
            Uring::Std(u) => u.params().is_setup_sqpoll(),
            Uring::Big(u) => u.params().is_setup_sqpoll(),
        }
    }

    /// Whether the SQ polling thread sleeps and must be woken to take new SQEs.
    fn sq_needs_wakeup(&mut self) -> bool {
        match self {
            Uring::Std(u) => u.submission().need_wakeup(),
            Uring::Big(u) => u.submission().need_wakeup(),
        }
    }

    /// Whether the kernel holds completions that did not fit the CQ (`IORING_SQ_CQ_OVERFLOW`):
    /// they reach the CQ only through an `io_uring_enter` with `GETEVENTS`.
    fn cq_overflow(&mut self) -> bool {
        match self {
            Uring::Std(u) => u.submission().cq_overflow(),
            Uring::Big(u) => u.submission().cq_overflow(),
        }
    }

    /// Whether no CQE is posted.
    fn cq_empty(&mut self) -> bool {
        match self {
            Uring::Std(u) => u.completion().is_empty(),
            Uring::Big(u) => u.completion().is_empty(),
        }
    }

    /// Copy up to `batch.len()` CQEs out as `(user_data, result, flags)`: the first `n`
    /// entries of `batch` are written, for the `n` returned.
    fn drain(&mut self, batch: &mut [MaybeUninit<(u64, i32, u32)>]) -> usize {
        let mut n = 0;
        match self {
            Uring::Std(u) => {
                for cqe in u.completion().take(batch.len()) {
                    batch[n].write((cqe.user_data(), cqe.result(), cqe.flags()));
                    n += 1;
                }
            }
            Uring::Big(u) => {
                for cqe in u.completion().take(batch.len()) {
                    batch[n].write((cqe.user_data(), cqe.result(), cqe.flags()));
                    n += 1;
                }
            }
        }
        n
    }
}

enum Sqe {
    Std(squeue::Entry),
    Big(squeue::Entry128),
}

struct Ring {
    uring: RefCell<Uring>,
    /// SQEs pushed but not yet handed to the kernel.
    pending: Cell<u32>,
    /// SQEs handed to the kernel whose CQE has not been dispatched.
    inflight: Cell<u32>,
    iopoll: bool,
    defer_taskrun: bool,
    /// A kernel thread polls the submission queue; once idle past `sqpoll_idle` it sleeps
    /// until an `io_uring_enter` with `IORING_ENTER_SQ_WAKEUP` wakes it.
    sqpoll: bool,
    /// The ring's index among the thread's registered ring descriptors
    /// (`IORING_REGISTER_RING_FDS`): `io_uring_enter` names it instead of the descriptor, and
    /// the kernel skips the descriptor lookup on every call. The engine is not `Send`, so every
    /// enter comes from the thread that registered it.
    registered: Option<u32>,
}

impl Drop for Ring {
    fn drop(&mut self) {
        if let Some(index) = self.registered {
            // A failure leaves the registration until the thread exits (the kernel drops it
            // then); nothing else depends on it.
            let _ = ring_fd_registration(self.uring.get_mut().fd(), Some(index));
        }
    }
}

const IORING_REGISTER_RING_FDS: libc::c_uint = 20;
const IORING_UNREGISTER_RING_FDS: libc::c_uint = 21;
const IORING_ENTER_REGISTERED_RING: u32 = 1 << 4;
const IORING_ENTER_SQ_WAKEUP: u32 = 1 << 1;

/// `struct io_uring_rsrc_update`.
#[repr(C)]
struct RsrcUpdate {
    offset: u32,
    resv: u32,
    data: u64,
}

/// Register ring `fd` with the calling thread (`index: None`; returns the index the kernel
/// chose), or unregister `index`.
fn ring_fd_registration(fd: RawFd, index: Option<u32>) -> io::Result<u32> {
    let (op, mut up) = match index {
        None => (
            IORING_REGISTER_RING_FDS,
            RsrcUpdate {
                offset: u32::MAX,
                resv: 0,
                data: fd as u64,
            },
        ),
        Some(i) => (
            IORING_UNREGISTER_RING_FDS,
            RsrcUpdate {
                offset: i,
                resv: 0,
                data: 0,
            },
        ),
    };
    // SAFETY: one `io_uring_rsrc_update`, valid for the call; the kernel writes the chosen
    // index back into it.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            fd,
            op,
            &mut up as *mut RsrcUpdate,
            1u32,
        )
    };
    match r {
        1 => Ok(up.offset),
        r if r < 0 => Err(io::Error::last_os_error()),
        r => Err(io::Error::other(format!(
            "io_uring_register(ring fds) took {r} entries of 1"
        ))),
    }
}

/// A per-core io_uring engine. Create one per thread with [`Engine::new`].
pub struct Engine {
    main: Ring,
    iopoll: Option<Ring>,
    setup: RingSetup,
    arena: Rc<Arena>,
    free_files: RefCell<Vec<u32>>,
    max_files: u32,
    sinks: RefCell<[Option<Weak<dyn CompletionSink>>; MAX_COMPLETION_SINKS]>,
    plug_depth: Cell<u32>,
    completion: Cell<CompletionMode>,
    metrics: Cell<EngineMetrics>,
    wake: Arc<WakeState>,
    owner: ThreadId,
    eventfd: Option<OwnedFd>,
    passthrough: bool,
    /// Shared regions registered as fixed buffers 1.., kept alive while the rings may use them.
    regions: RefCell<Vec<Arc<SharedRegion>>>,
    /// Software devices whose requests count as work (see [`SoftDevice`]).
    soft: RefCell<Vec<Weak<dyn SoftDevice>>>,
    /// The engine stays on the thread that made it (`!Send`, `!Sync`), and not only because of
    /// its `Rc` fields: the rings are entered by their index among this thread's registered ring
    /// descriptors, which means another ring (or none) on any other thread.
    _thread_bound: std::marker::PhantomData<*const ()>,
    /// Opcodes the kernel's io_uring supports (`IORING_REGISTER_PROBE`), one bit each.
    ops: [u64; 4],
    /// `io_uring_enter` calls still to fail (see [`Engine::fail_next_enters`]).
    #[cfg(any(test, feature = "fault-injection"))]
    failing_enters: Cell<u32>,
}

const FLAG_NAMES: [&str; 3] = ["SINGLE_ISSUER", "DEFER_TASKRUN", "COOP_TASKRUN"];

fn build_ring<S: squeue::EntryMarker, C: cqueue::EntryMarker>(
    entries: u32,
    wanted: &[&'static str],
    sqpoll_idle: Option<Duration>,
    iopoll: bool,
) -> Result<(IoUring<S, C>, RingSetup), CoreError> {
    let mut flags: Vec<&'static str> = wanted.to_vec();
    let mut setup = RingSetup::default();
    // Drop order when the kernel says EINVAL: newest and most demanding first.
    let drop_order = ["DEFER_TASKRUN", "COOP_TASKRUN", "SINGLE_ISSUER"];
    loop {
        let mut b = IoUring::<S, C>::builder();
        b.setup_cqsize(entries * 2);
        for f in &flags {
            match *f {
                "SINGLE_ISSUER" => b.setup_single_issuer(),
                "DEFER_TASKRUN" => b.setup_defer_taskrun(),
                "COOP_TASKRUN" => b.setup_coop_taskrun(),
                _ => unreachable!("flag names come from FLAG_NAMES"),
            };
        }
        if let Some(idle) = sqpoll_idle {
            b.setup_sqpoll(idle.as_millis().min(u32::MAX as u128) as u32);
        }
        if iopoll {
            b.setup_iopoll();
        }
        match b.build(entries) {
            Ok(ring) => {
                setup.applied = flags.clone();
                if sqpoll_idle.is_some() {
                    setup.applied.push("SQPOLL");
                }
                if iopoll {
                    setup.applied.push("IOPOLL");
                }
                if S::BUILD_FLAGS & IORING_SETUP_SQE128 != 0 {
                    setup.applied.push("SQE128");
                }
                if C::BUILD_FLAGS & IORING_SETUP_CQE32 != 0 {
                    setup.applied.push("CQE32");
                }
                return Ok((ring, setup));
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                match drop_order.iter().find(|f| flags.contains(f)) {
                    Some(f) => {
                        flags.retain(|x| x != f);
                        setup
                            .dropped
                            .push((f, "io_uring_setup returned EINVAL".to_string()));
                    }
                    None => {
                        return Err(CoreError::RingSetup {
                            entries,
                            flags: describe(&flags, sqpoll_idle, iopoll),
                            source: e,
                        })
                    }
                }
            }
            Err(e) => {
                return Err(CoreError::RingSetup {
                    entries,
                    flags: describe(&flags, sqpoll_idle, iopoll),
                    source: e,
                })
            }
        }
    }
}

fn describe(flags: &[&str], sqpoll: Option<Duration>, iopoll: bool) -> String {
    let mut all: Vec<&str> = flags.to_vec();
    if sqpoll.is_some() {
        all.push("SQPOLL");
    }
    if iopoll {
        all.push("IOPOLL");
    }
    all.join(" | ")
}

/// While busy-polling, yield the CPU after this many empty polls in a row.
const YIELD_EVERY_EMPTY_POLLS: u32 = 8;

impl Engine {
    /// Create an engine on the calling thread: check memlock, build the ring(s), map and register
    /// the arena, reserve registered-file slots.
    pub fn new(cfg: EngineConfig) -> Result<Rc<Engine>, CoreError> {
        cfg.validate()?;
        let rings = if cfg.iopoll_ring { 2 } else { 1 };
        let needed = (cfg.arena_bytes.div_ceil(cfg.frame_bytes) * cfg.frame_bytes) as u64 * rings;
        check_memlock(
            sys::memlock_limit().map_err(|e| CoreError::Sys {
                op: "getrlimit(RLIMIT_MEMLOCK)",
                source: e,
            })?,
            needed,
            sys::has_cap_ipc_lock(),
        )?;

        let mut wanted: Vec<&'static str> = if cfg.fast_flags {
            FLAG_NAMES.to_vec()
        } else {
            Vec::new()
        };
        if cfg.sqpoll_idle.is_some() {
            // DEFER_TASKRUN needs the submitter to reap; SQPOLL submits from a kernel thread.
            wanted.retain(|f| *f != "DEFER_TASKRUN");
        }
        let build = |sqpoll: Option<Duration>, iopoll: bool| -> Result<_, CoreError> {
            Ok(if cfg.passthrough {
                let (u, s) = build_ring(cfg.ring_entries, &wanted, sqpoll, iopoll)?;
                (Uring::Big(u), s)
            } else {
                let (u, s) = build_ring(cfg.ring_entries, &wanted, sqpoll, iopoll)?;
                (Uring::Std(u), s)
            })
        };
        let (uring, setup) = build(cfg.sqpoll_idle, false)?;
        let iopoll = if cfg.iopoll_ring {
            let (ring, _) = build(None, true).map_err(|e| match e {
                CoreError::RingSetup { source, .. } => CoreError::IopollUnavailable(source),
                other => other,
            })?;
            Some(ring)
        } else {
            None
        };

        let arena = Rc::new(Arena::map(
            cfg.arena_bytes,
            cfg.frame_bytes,
            cfg.huge_pages,
        )?);
        let iov = [arena.iovec()];
        for ring in std::iter::once(&uring).chain(iopoll.as_ref()) {
            // A sparse table: slot 0 is the arena, the rest take shared regions later.
            ring.submitter()
                .register_buffers_sparse(1 + MAX_SHARED_REGIONS as u32)
                .map_err(|e| CoreError::RegisterBuffers {
                    bytes: arena.bytes(),
                    source: e,
                })?;
            // SAFETY: the iovec covers the arena mapping, which lives in an `Rc<Arena>` owned by
            // the engine; the rings are dropped (unregistering) before the engine's arena field.
            unsafe { ring.submitter().register_buffers_update(0, &iov, None) }.map_err(|e| {
                CoreError::RegisterBuffers {
                    bytes: arena.bytes(),
                    source: e,
                }
            })?;
            ring.submitter()
                .register_files_sparse(cfg.max_files)
                .map_err(|e| CoreError::Sys {
                    op: "io_uring_register(REGISTER_FILES2, sparse)",
                    source: e,
                })?;
        }
        let eventfd = if cfg.eventfd {
            let fd = sys::eventfd().map_err(|e| CoreError::Sys {
                op: "eventfd",
                source: e,
            })?;
            uring
                .submitter()
                .register_eventfd(fd.as_raw_fd())
                .map_err(|e| CoreError::Sys {
                    op: "io_uring_register(REGISTER_EVENTFD)",
                    source: e,
                })?;
            Some(fd)
        } else {
            None
        };

        let mut probe = io_uring::Probe::new();
        let mut ops = [0u64; 4];
        // A kernel without the probe (before 5.6) leaves every bit clear: nothing newer is used.
        if uring.submitter().register_probe(&mut probe).is_ok() {
            for code in 0..=255u8 {
                if probe.is_supported(code) {
                    ops[code as usize / 64] |= 1 << (code % 64);
                }
            }
        }
        let defer = setup.applied.contains(&"DEFER_TASKRUN");
        let passthrough = cfg.passthrough;
        let mut setup = setup;
        let mut make_ring = |u: Uring, iopoll: bool| {
            // Linux 5.18+; a thread holds at most 16 (EBUSY beyond): then the ring is named by
            // its descriptor, as before, and the setup report says why.
            let registered = if cfg.register_ring_fd {
                match ring_fd_registration(u.fd(), None) {
                    Ok(i) => Some(i),
                    Err(e) => {
                        if !setup.dropped.iter().any(|d| d.0 == "REGISTERED_RING_FD") {
                            setup.dropped.push(("REGISTERED_RING_FD", e.to_string()));
                        }
                        None
                    }
                }
            } else {
                None
            };
            if registered.is_some() && !setup.applied.contains(&"REGISTERED_RING_FD") {
                setup.applied.push("REGISTERED_RING_FD");
            }
            let sqpoll = u.sqpoll();
            Ring {
                uring: RefCell::new(u),
                pending: Cell::new(0),
                inflight: Cell::new(0),
                iopoll,
                defer_taskrun: defer,
                sqpoll,
                registered,
            }
        };
        let main = make_ring(uring, false);
        let iopoll = iopoll.map(|r| make_ring(r, true));
        Ok(Rc::new(Engine {
            main,
            iopoll,
            setup,
            arena,
            free_files: RefCell::new((0..cfg.max_files).rev().collect()),
            max_files: cfg.max_files,
            sinks: RefCell::new(Default::default()),
            plug_depth: Cell::new(0),
            completion: Cell::new(cfg.completion),
            metrics: Cell::new(EngineMetrics::default()),
            wake: Arc::new(WakeState {
                woken: AtomicBool::new(false),
                thread: thread::current(),
            }),
            owner: thread::current().id(),
            eventfd,
            passthrough,
            regions: RefCell::new(Vec::new()),
            soft: RefCell::new(Vec::new()),
            _thread_bound: std::marker::PhantomData,
            ops,
            #[cfg(any(test, feature = "fault-injection"))]
            failing_enters: Cell::new(0),
        }))
    }

    /// What the ring setup applied and dropped.
    pub fn ring_setup(&self) -> &RingSetup {
        &self.setup
    }
    /// The registered buffer arena.
    pub fn arena(&self) -> &Rc<Arena> {
        &self.arena
    }
    /// Whether the rings take 128-byte passthrough SQEs ([`EngineConfig::passthrough`]).
    pub fn has_passthrough_rings(&self) -> bool {
        self.passthrough
    }
    /// Whether an IOPOLL ring exists.
    pub fn has_iopoll_ring(&self) -> bool {
        self.iopoll.is_some()
    }
    /// Whether the kernel's io_uring supports opcode `code` (asked once, at start, with
    /// `IORING_REGISTER_PROBE`), e.g. `io_uring::opcode::ReadvFixed::CODE`.
    pub fn supports_op(&self, code: u8) -> bool {
        self.ops[code as usize / 64] & (1 << (code % 64)) != 0
    }
    /// Whether vectored reads and writes can name a registered buffer
    /// (`IORING_OP_READV_FIXED` / `WRITEV_FIXED`, Linux 6.15+).
    pub fn supports_vectored_fixed(&self) -> bool {
        self.supports_op(io_uring::opcode::ReadvFixed::CODE)
            && self.supports_op(io_uring::opcode::WritevFixed::CODE)
    }
    /// A snapshot of the engine's counters.
    pub fn metrics(&self) -> EngineMetrics {
        self.metrics.get()
    }
    /// The completion mode used by blocking waits.
    pub fn completion_mode(&self) -> CompletionMode {
        self.completion.get()
    }
    /// Change the completion mode (e.g. busy-poll only while latency-critical work runs).
    pub fn set_completion_mode(&self, mode: CompletionMode) {
        self.completion.set(mode);
    }
    /// The eventfd the kernel signals on completions, when configured.
    pub fn eventfd(&self) -> Option<RawFd> {
        self.eventfd.as_ref().map(|f| f.as_raw_fd())
    }
    /// The eventfd, borrowed for a `poll(2)` set (when configured).
    pub fn eventfd_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.eventfd.as_ref().map(|f| f.as_fd())
    }
    /// Reset the eventfd's counter (after the event loop saw it readable).
    pub fn drain_eventfd(&self) {
        if let Some(fd) = &self.eventfd {
            sys::eventfd_drain(fd);
        }
    }

    /// Allocate a buffer from the arena, or `None` when it is exhausted (back-pressure).
    pub fn try_alloc(&self, len: usize) -> Option<FixedBuf> {
        self.arena.try_alloc(len)
    }

    /// [`Engine::try_alloc`] for a caller that falls back to a shorter buffer when this one does
    /// not fit (a run of frames in a row): a miss is not counted as exhaustion.
    pub fn try_alloc_run(&self, len: usize) -> Option<FixedBuf> {
        self.arena.try_alloc_run(len)
    }

    /// Allocate a buffer, waiting for in-flight I/O to give frames back when the arena is
    /// exhausted. Fails only when nothing in flight could free a frame, and at once for a
    /// buffer longer than the whole arena (no completion can make room for it).
    pub fn alloc_blocking(&self, len: usize) -> Result<FixedBuf, CoreError> {
        let needed = len.max(1).div_ceil(self.arena.frame_bytes());
        loop {
            if let Some(b) = self.arena.try_alloc(len) {
                return Ok(b);
            }
            if !self.has_work() || needed > self.arena.frames() as usize {
                return Err(CoreError::ArenaExhausted {
                    needed,
                    free: self.arena.free_frames(),
                    frames: self.arena.frames(),
                    frame_bytes: self.arena.frame_bytes(),
                });
            }
            self.wait(1)?;
        }
    }

    /// Register a completion sink; its SQEs carry the returned id.
    ///
    /// A never-used id is taken first. The id of a sink that is gone is reused only once
    /// nothing is in flight on the rings or held by a software device (waiting for that here):
    /// a completion of the old sink's still to come would otherwise be handed to the new one.
    pub fn register_sink(&self, sink: Weak<dyn CompletionSink>) -> Result<SinkId, CoreError> {
        loop {
            let mut sinks = self.sinks.borrow_mut();
            let free = match sinks.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    let dead = sinks
                        .iter()
                        .position(|s| s.as_ref().is_some_and(|w| w.strong_count() == 0))
                        .ok_or(CoreError::SinksExhausted(MAX_COMPLETION_SINKS))?;
                    // A software device's requests count too: their completions are pushed
                    // (tagged with the sink's id) only when it advances.
                    if self.inflight() > 0 {
                        // Dispatch (as orphans, for the dead sink) what is out, then look again.
                        drop(sinks);
                        self.wait(1)?;
                        continue;
                    }
                    dead
                }
            };
            sinks[free] = Some(sink);
            return Ok(SinkId(free as u8));
        }
    }

    /// Register `region` with every ring as a fixed buffer; returns its buffer index (1..). The
    /// engine keeps the region alive for as long as it lives. Registering the same region again
    /// returns the index it already has.
    pub fn register_region(&self, region: &Arc<SharedRegion>) -> Result<u16, CoreError> {
        let mut regions = self.regions.borrow_mut();
        if let Some(i) = regions.iter().position(|r| Arc::ptr_eq(r, region)) {
            return Ok(i as u16 + 1);
        }
        if regions.len() == MAX_SHARED_REGIONS {
            return Err(CoreError::Config(format!(
                "an engine takes at most {MAX_SHARED_REGIONS} shared regions"
            )));
        }
        let index = regions.len() as u32 + 1;
        let iov = [region.iovec()];
        for ring in self.rings() {
            // SAFETY: the iovec covers the region's mapping, which the engine keeps alive (its
            // `Arc` is pushed below) for as long as the rings exist.
            unsafe {
                ring.uring
                    .borrow()
                    .submitter()
                    .register_buffers_update(index, &iov, None)
            }
            .map_err(|e| CoreError::RegisterBuffers {
                bytes: region.bytes(),
                source: e,
            })?;
        }
        regions.push(Arc::clone(region));
        Ok(index as u16)
    }

    /// Register `fd` with every ring; the returned slot stays valid until
    /// [`Engine::unregister_file`].
    pub fn register_file(&self, fd: RawFd) -> Result<FixedFile, CoreError> {
        let slot = self
            .free_files
            .borrow_mut()
            .pop()
            .ok_or(CoreError::FilesExhausted {
                max_files: self.max_files,
            })?;
        for ring in self.rings() {
            if let Err(e) = ring
                .uring
                .borrow()
                .submitter()
                .register_files_update(slot, &[fd])
            {
                self.free_files.borrow_mut().push(slot);
                return Err(CoreError::Sys {
                    op: "io_uring_register(FILES_UPDATE)",
                    source: e,
                });
            }
        }
        Ok(FixedFile(slot))
    }

    /// Release a registered-file slot. Call only when no SQE using it is in flight.
    pub fn unregister_file(&self, file: FixedFile) {
        for ring in self.rings() {
            // A failure leaves the slot pointing at a file we no longer use: harmless, and it is
            // overwritten by the next registration in that slot.
            let _ = ring
                .uring
                .borrow()
                .submitter()
                .register_files_update(file.0, &[-1]);
        }
        self.free_files.borrow_mut().push(file.0);
    }

    fn rings(&self) -> impl Iterator<Item = &Ring> {
        std::iter::once(&self.main).chain(self.iopoll.as_ref())
    }

    fn ring(&self, kind: RingKind) -> &Ring {
        match kind {
            RingKind::Main => &self.main,
            RingKind::Iopoll => self.iopoll.as_ref().unwrap_or(&self.main),
        }
    }

    fn bump(&self, f: impl FnOnce(&mut EngineMetrics)) {
        let mut m = self.metrics.get();
        f(&mut m);
        self.metrics.set(m);
    }

    /// Queue one SQE for `sink` with `payload` as its tag. Unless the engine is plugged it is
    /// submitted at once.
    ///
    /// # Safety
    /// Every buffer and file the SQE refers to must stay valid, and untouched by the caller, until
    /// its completion has been handed to the sink.
    #[inline]
    pub unsafe fn push(
        &self,
        kind: RingKind,
        sink: SinkId,
        payload: u64,
        sqe: squeue::Entry,
    ) -> Result<(), CoreError> {
        let sqe = sqe.user_data(tag(sink, payload)?);
        // SAFETY: forwarded to the caller.
        unsafe { self.push_any(kind, Sqe::Std(sqe)) }
    }

    /// Queue a NOP on the main ring for `sink` with `payload` as its tag: a completion (result
    /// 0) that a later wait hands to the sink. How a [`SoftDevice`] answers a request.
    pub fn push_nop(&self, sink: SinkId, payload: u64) -> Result<(), CoreError> {
        // SAFETY: a NOP refers to no buffer or file.
        unsafe { self.push(RingKind::Main, sink, payload, nop_sqe()) }
    }

    /// Queue one 128-byte SQE (e.g. an NVMe passthrough `UringCmd80`) for `sink` with `payload`
    /// as its tag. The engine must have been built with [`EngineConfig::passthrough`].
    ///
    /// # Safety
    /// As [`Engine::push`]: every buffer and file the SQE refers to must stay valid, and untouched
    /// by the caller, until its completion has been handed to the sink.
    pub unsafe fn push_cmd(
        &self,
        kind: RingKind,
        sink: SinkId,
        payload: u64,
        sqe: squeue::Entry128,
    ) -> Result<(), CoreError> {
        if !self.passthrough {
            return Err(CoreError::Config(
                "a 128-byte (passthrough) SQE needs an engine built with \
                 EngineConfig { passthrough: true, .. }"
                    .into(),
            ));
        }
        let sqe = sqe.user_data(tag(sink, payload)?);
        // SAFETY: forwarded to the caller.
        unsafe { self.push_any(kind, Sqe::Big(sqe)) }
    }

    /// # Safety
    /// As [`Engine::push`].
    #[inline]
    unsafe fn push_any(&self, kind: RingKind, sqe: Sqe) -> Result<(), CoreError> {
        let ring = self.ring(kind);
        loop {
            // SAFETY: the caller's contract covers the SQE's buffers and files.
            let pushed = unsafe { ring.uring.borrow_mut().push(&sqe) };
            if pushed {
                break;
            }
            // Submission queue full: hand what is queued to the kernel and try again.
            self.submit_ring(ring, 0)?;
        }
        ring.pending.set(ring.pending.get() + 1);
        ring.inflight.set(ring.inflight.get() + 1);
        self.bump(|m| m.sqes += 1);
        if self.plug_depth.get() == 0 {
            // The SQE is queued and counted: an `io_uring_enter` failing now leaves it for the
            // next one (which reports the error). Failing the push instead would tell the
            // caller the SQE never went out, and it would free the SQE's buffer while the
            // kernel could still take it.
            let _ = self.submit_ring(ring, 0);
        }
        Ok(())
    }

    /// Hold submissions until the returned guard is dropped, so a burst of requests reaches the
    /// kernel in one `io_uring_enter` (plugging; the thesis' temporal merge). Plugs nest.
    pub fn plug(&self) -> Plug<'_> {
        self.plug_depth.set(self.plug_depth.get() + 1);
        Plug { engine: self }
    }

    /// Run `f` with submissions held: SQEs it pushes stay queued and go out with the next
    /// [`Engine::wait`], [`Engine::submit`] or unplug, so a push and the wait for its completion
    /// cost one `io_uring_enter`.
    pub fn hold_submissions<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Hold<'a>(&'a Cell<u32>);
        impl Drop for Hold<'_> {
            // Restores the depth even if `f` panics; submitting is left to the caller's next wait.
            fn drop(&mut self) {
                self.0.set(self.0.get() - 1);
            }
        }
        self.plug_depth.set(self.plug_depth.get() + 1);
        let _hold = Hold(&self.plug_depth);
        f()
    }

    /// Submit everything queued, without waiting.
    pub fn submit(&self) -> Result<(), CoreError> {
        for ring in self.rings() {
            if ring.pending.get() > 0 {
                self.submit_ring(ring, 0)?;
            }
        }
        Ok(())
    }

    /// Test hook (cargo feature `fault-injection`, for other crates' tests): the next `n`
    /// `io_uring_enter` calls fail with `ENOMEM` without reaching the kernel, leaving their SQEs
    /// queued, as a call the kernel refuses does. A later call submits them.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn fail_next_enters(&self, n: u32) {
        self.failing_enters.set(n);
    }

    #[inline]
    fn enter(&self, ring: &Ring, want: u32, getevents: bool) -> io::Result<usize> {
        #[cfg(any(test, feature = "fault-injection"))]
        if self.failing_enters.get() > 0 {
            self.failing_enters.set(self.failing_enters.get() - 1);
            return Err(io::Error::from_raw_os_error(libc::ENOMEM));
        }
        self.bump(|m| m.enters += 1);
        let to_submit = ring.pending.get();
        let mut flags = if getevents || want > 0 || ring.iopoll {
            IORING_ENTER_GETEVENTS
        } else {
            0
        };
        // An SQPOLL ring's thread takes the SQEs itself, but one that went idle sleeps until
        // it is woken: without this, SQEs pushed after an idle spell were never submitted and
        // the wait for them never ended. (When the queue is borrowed here, wake it anyway.)
        if ring.sqpoll
            && to_submit > 0
            && ring
                .uring
                .try_borrow_mut()
                .map_or(true, |mut u| u.sq_needs_wakeup())
        {
            flags |= IORING_ENTER_SQ_WAKEUP;
        }
        let r = match ring.registered {
            // SAFETY: no extra argument is passed; the index names this thread's registration
            // of this ring (the engine never leaves its thread).
            Some(index) => match unsafe {
                libc::syscall(
                    libc::SYS_io_uring_enter,
                    index,
                    to_submit,
                    want,
                    flags | IORING_ENTER_REGISTERED_RING,
                    std::ptr::null::<libc::c_void>(),
                    0usize,
                )
            } {
                n if n < 0 => Err(io::Error::last_os_error()),
                n => Ok(n as usize),
            },
            // SAFETY: no extra argument is passed; the counts come from our own bookkeeping.
            None => unsafe {
                ring.uring
                    .borrow()
                    .submitter()
                    .enter::<libc::sigset_t>(to_submit, want, flags, None)
            },
        };
        if let Ok(n) = r {
            ring.pending.set(to_submit - (n as u32).min(to_submit));
        }
        r
    }

    /// Submit the ring's pending SQEs and wait for `want` completions, retrying on the transient
    /// errors the kernel returns when it is short of CQ space or interrupted.
    fn submit_ring(&self, ring: &Ring, want: u32) -> Result<(), CoreError> {
        loop {
            // With DEFER_TASKRUN, GETEVENTS also posts completions that finished meanwhile, so a
            // later wait often finds them without another system call.
            match self.enter(ring, want, ring.defer_taskrun) {
                Ok(_) if ring.pending.get() == 0 || want > 0 => return Ok(()),
                Ok(_) => continue,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => {
                    // The CQ is full: make room by dispatching what has completed.
                    if self.reap(ring) == 0 {
                        thread::yield_now();
                    }
                }
                Err(e) => {
                    return Err(CoreError::Sys {
                        op: "io_uring_enter",
                        source: e,
                    })
                }
            }
        }
    }

    /// Wait until nothing is queued or in flight (what a user of the engine does before it
    /// lets go of buffers the kernel may still write), each wait as [`Engine::wait_retrying`].
    /// `false`: the ring kept failing, and the I/O still out may write into its buffers at any
    /// time.
    pub fn drain_all(&self) -> bool {
        while self.has_work() {
            if self.wait_retrying().is_err() {
                return false;
            }
        }
        true
    }

    /// [`Engine::wait`] for one completion, a failed wait tried again up to 64 failures in a
    /// row, 1 ms apart (an enter refused for want of memory leaves its SQEs for the next one):
    /// for a caller that must see its I/O complete before it lets go of the memory. The last
    /// error when the ring kept failing.
    pub fn wait_retrying(&self) -> Result<u32, CoreError> {
        let mut failures = 0;
        loop {
            match self.wait(1) {
                Ok(n) => return Ok(n),
                Err(e) => {
                    failures += 1;
                    if failures >= DRAIN_TRIES {
                        return Err(e);
                    }
                    thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }

    /// Whether any SQE is queued or in flight, or a software device holds requests.
    pub fn has_work(&self) -> bool {
        self.rings()
            .any(|r| r.pending.get() > 0 || r.inflight.get() > 0)
            || self.soft_pending() > 0
    }

    /// SQEs handed to the kernel (or queued) whose completion has not been dispatched, plus
    /// requests held by software devices.
    pub fn inflight(&self) -> u32 {
        self.rings().map(|r| r.inflight.get()).sum::<u32>() + self.soft_pending()
    }

    /// Let a software device's requests count as this engine's work: waits ask it to complete
    /// some. The engine keeps a weak reference; attaching the same device again changes nothing.
    pub fn attach_soft_device(&self, dev: Weak<dyn SoftDevice>) {
        let mut soft = self.soft.borrow_mut();
        soft.retain(|d| d.strong_count() > 0);
        if !soft.iter().any(|d| d.ptr_eq(&dev)) {
            soft.push(dev);
        }
    }

    fn soft_devices(&self) -> Vec<Rc<dyn SoftDevice>> {
        let soft = self.soft.borrow();
        if soft.is_empty() {
            return Vec::new();
        }
        soft.iter().filter_map(Weak::upgrade).collect()
    }

    /// Requests held by software devices: a length check inline (most engines have none, and
    /// every wait asks), the sum out of line.
    #[inline]
    fn soft_pending(&self) -> u32 {
        if self.soft.borrow().is_empty() {
            return 0;
        }
        self.soft_pending_sum()
    }

    #[cold]
    #[inline(never)]
    fn soft_pending_sum(&self) -> u32 {
        self.soft_devices().iter().map(|d| d.pending()).sum()
    }

    /// Ask every software device holding requests to complete some.
    fn advance_soft(&self) -> Result<(), CoreError> {
        for d in self.soft_devices() {
            let pending = d.pending();
            if pending > 0 {
                let before = self.metrics.get().sqes;
                d.advance(self)?;
                // The trait's contract: at least one completion pushed. A device that pushed
                // none would have every wait for its requests go round for ever.
                if self.metrics.get().sqes == before && d.pending() >= pending {
                    return Err(CoreError::Config(format!(
                        "a software device holds {pending} requests and its advance completed \
                         none (it must push at least one completion)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Submit what is queued and dispatch at least `min` completions (fewer only if fewer are in
    /// flight, or once nothing is: a wait nested in a sink's handler may take some), blocking
    /// or spinning according to the completion mode. In `Wait` mode the submission and the
    /// wait are one `io_uring_enter`.
    pub fn wait(&self, min: u32) -> Result<u32, CoreError> {
        let min = min.min(self.inflight());
        // Completions already posted cost no system call.
        let mut done: u32 = self.rings().map(|r| self.reap(r)).sum();
        if done >= min {
            // The completions are dispatched: the caller's I/O may have ended in them, so the
            // wait succeeded. An enter failing now leaves its SQEs queued for the next one,
            // which reports the error (as a push does); failing here made callers give up on
            // requests that had just completed.
            let _ = self.submit();
            return Ok(done);
        }
        let polled = |e: &Engine| e.iopoll.as_ref().is_some_and(|r| r.inflight.get() > 0);
        let mut empty = 0u32;
        // Hybrid: spin until this instant, then sleep.
        let spin_until = match self.completion.get() {
            // A budget past an hour is taken as an hour (and cannot overflow the clock).
            CompletionMode::Hybrid { spin } => {
                Some(Instant::now() + spin.min(Duration::from_secs(3600)))
            }
            _ => None,
        };
        while done < min {
            // Nothing left in flight, nothing more can come: a wait nested in a sink's handler
            // may have taken completions counted in `min` (this loop went round for ever).
            if self.inflight() == 0 {
                break;
            }
            if self.soft_pending() > 0 {
                // Their completions arrive as NOPs, pushed now and reaped below.
                self.advance_soft()?;
            }
            let sleep = match self.completion.get() {
                CompletionMode::Wait => true,
                CompletionMode::BusyPoll => false,
                // The clock is read only after an empty poll: a spin that found completions
                // goes round again at once.
                CompletionMode::Hybrid { .. } => {
                    empty > 0 && spin_until.is_none_or(|t| Instant::now() >= t)
                }
            };
            if sleep && !polled(self) {
                if let Some(r) = self.iopoll.as_ref().filter(|r| r.pending.get() > 0) {
                    self.submit_ring(r, 0)?;
                }
                self.bump(|m| m.sleeps += 1);
                // Never wait for more than the ring holds (the rest may be a software device's).
                self.submit_ring(&self.main, (min - done).min(self.main.inflight.get()))?;
                done += self.reap(&self.main);
            } else {
                let got = self.poll_completions()?;
                if got == 0 {
                    self.bump(|m| m.empty_polls += 1);
                    empty += 1;
                    if empty % YIELD_EVERY_EMPTY_POLLS == 0 {
                        // The device's work may need this CPU (a loop device's worker, a
                        // softirq): let it run rather than wait for this thread's time slice.
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                done += got;
            }
        }
        Ok(done)
    }

    /// Submit what is queued, let the kernel post finished completions (deferred task work, IOPOLL
    /// polling) without sleeping, and dispatch them. Returns how many were dispatched.
    pub fn poll_completions(&self) -> Result<u32, CoreError> {
        if self.soft_pending() > 0 {
            self.advance_soft()?;
        }
        let mut n = 0;
        for ring in self.rings() {
            // Completions that overflowed the CQ are moved into it only by an enter with
            // GETEVENTS: without one, a busy-poll on a ring without DEFER_TASKRUN never saw them.
            let needs_enter = ring.pending.get() > 0
                || (ring.inflight.get() > 0
                    && (ring.defer_taskrun
                        || ring.iopoll
                        || ring.uring.borrow_mut().cq_overflow()));
            if needs_enter {
                loop {
                    match self.enter(ring, 0, true) {
                        Ok(_) => break,
                        Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                        Err(e)
                            if matches!(
                                e.raw_os_error(),
                                Some(libc::EBUSY) | Some(libc::EAGAIN)
                            ) =>
                        {
                            n += self.reap(ring);
                        }
                        Err(e) => {
                            return Err(CoreError::Sys {
                                op: "io_uring_enter",
                                source: e,
                            })
                        }
                    }
                }
            }
            n += self.reap(ring);
        }
        Ok(n)
    }

    /// Dispatch every posted CQE of `ring` to its sink. The empty case (a wait asks before it
    /// sleeps, and usually finds nothing) is inline; the dispatch is not.
    #[inline(always)]
    fn reap(&self, ring: &Ring) -> u32 {
        // Every CQE answers an SQE counted in flight: a ring with none out (the IOPOLL ring of
        // an engine that reads through the main one) has nothing to reap.
        if ring.inflight.get() == 0 || ring.uring.borrow_mut().cq_empty() {
            return 0;
        }
        self.reap_posted(ring)
    }

    #[inline(never)]
    fn reap_posted(&self, ring: &Ring) -> u32 {
        let mut total = 0u32;
        loop {
            // Not zeroed: this runs once or twice per wait, and zeroing the batch (1 KiB) cost
            // more instructions than dispatching a completion (callgrind, QD1 reads).
            let mut batch = [MaybeUninit::<(u64, i32, u32)>::uninit(); REAP_BATCH];
            let n = ring.uring.borrow_mut().drain(&mut batch);
            ring.inflight.set(ring.inflight.get() - n as u32);
            for slot in &batch[..n] {
                // SAFETY: `drain` wrote the first `n` entries.
                let (user_data, result, flags) = unsafe { slot.assume_init() };
                let id = (user_data >> SINK_SHIFT) as usize;
                let sink = self.sinks.borrow()[id].as_ref().and_then(Weak::upgrade);
                match sink {
                    Some(sink) => sink.complete(user_data & PAYLOAD_MASK, result, flags),
                    None => self.bump(|m| m.orphan_cqes += 1),
                }
            }
            self.bump(|m| m.cqes += n as u64);
            total += n as u32;
            if n < REAP_BATCH {
                return total;
            }
        }
    }

    /// Run `fut` to completion on this thread, driving the rings whenever it is pending.
    ///
    /// While nothing is in flight and the future is pending it parks the thread until woken,
    /// so futures woken from other threads work too. **Not while I/O is in flight:** the thread
    /// then sleeps in `io_uring_enter`, which a wake from another thread does not end, so the
    /// future is polled again only when some completion arrives (never, for a read of a pipe
    /// that nobody writes). A future that waits on another thread's event and on engine I/O at
    /// once should be driven by an outside runtime through the engine's eventfd instead (see
    /// the `tokio_driver` example).
    ///
    /// It may be called from inside a future that another `block_on` of this engine polls. The
    /// two share one wake flag, which the nested call clears as it goes round, so it may take
    /// a wake meant for the outer future (whose completion its wait dispatched): it leaves the
    /// flag set when it returns, and the outer future is polled once more instead of parked.
    pub fn block_on<F: Future>(&self, fut: F) -> Result<F::Output, CoreError> {
        if thread::current().id() != self.owner {
            return Err(CoreError::WrongThread);
        }
        /// Sets the wake flag on every way out (an extra poll of an outer future is harmless;
        /// a lost wake parked it with nothing left to wake it).
        struct Rewake<'a>(&'a AtomicBool);
        impl Drop for Rewake<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let _rewake = Rewake(&self.wake.woken);
        let waker = Waker::from(Arc::clone(&self.wake));
        let mut cx = Context::from_waker(&waker);
        let mut fut: Pin<&mut F> = pin!(fut);
        loop {
            self.wake.woken.store(false, Ordering::Release);
            // SQEs pushed while the future runs go out with the wait below: submit and wait in
            // one io_uring_enter.
            let polled = self.hold_submissions(|| fut.as_mut().poll(&mut cx));
            if let Poll::Ready(v) = polled {
                // The future is done: an enter refused now leaves its SQEs queued for the next
                // one, which reports the error (as `wait` and `push` do); failing here dropped
                // the finished future's output.
                let _ = self.submit();
                return Ok(v);
            }
            while !self.wake.woken.load(Ordering::Acquire) {
                if self.has_work() {
                    self.wait(1)?;
                } else {
                    thread::park();
                }
            }
        }
    }
}

/// Failed waits in a row after which [`Engine::wait_retrying`] gives up.
const DRAIN_TRIES: u32 = 64;

impl Drop for Engine {
    fn drop(&mut self) {
        // Buffers in flight would be written by the kernel after the arena is unmapped: wait for
        // every outstanding completion first (their sinks may be gone; the CQEs are discarded).
        // A failed wait is tried again: stopping at the first error unmapped memory that reads
        // still in flight could land in.
        if !self.drain_all() {
            // The I/O still out may be written into the arena or a region at any time: never
            // unmap them (nor hand their memory to anyone else).
            std::mem::forget(Rc::clone(&self.arena));
            for region in self.regions.borrow().iter() {
                std::mem::forget(Arc::clone(region));
            }
        }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("ring_setup", &self.setup)
            .field("arena", &self.arena)
            .field("iopoll_ring", &self.iopoll.is_some())
            .field("completion", &self.completion.get())
            .field("metrics", &self.metrics.get())
            .finish()
    }
}

/// Guard returned by [`Engine::plug`]; submits the batch when dropped.
pub struct Plug<'a> {
    engine: &'a Engine,
}

impl Drop for Plug<'_> {
    fn drop(&mut self) {
        let depth = self.engine.plug_depth.get() - 1;
        self.engine.plug_depth.set(depth);
        if depth == 0 {
            // A submit error here resurfaces on the next enter, where it can be returned.
            let _ = self.engine.submit();
        }
    }
}

/// An SQE's `user_data`: `sink` in the top byte, `payload` below. A sink past the table (its
/// CQE would panic the dispatch, losing the rest of the batch) or a payload reaching into the
/// sink's bits (its CQE would go to another sink) is refused.
#[inline]
fn tag(sink: SinkId, payload: u64) -> Result<u64, CoreError> {
    if sink.0 as usize >= MAX_COMPLETION_SINKS || payload > PAYLOAD_MASK {
        return Err(CoreError::Config(format!(
            "sink {} with payload {payload:#x}: sinks are 0..{MAX_COMPLETION_SINKS}, payloads \
             at most {PAYLOAD_MASK:#x}",
            sink.0
        )));
    }
    Ok(((sink.0 as u64) << SINK_SHIFT) | payload)
}

/// Check that `needed` bytes can be pinned under memlock `limit` (`None` = unlimited).
pub fn check_memlock(limit: Option<u64>, needed: u64, cap_ipc_lock: bool) -> Result<(), CoreError> {
    match limit {
        Some(limit) if !cap_ipc_lock && limit < needed => Err(CoreError::MemlockTooLow {
            limit,
            needed,
            fix_kib: needed.div_ceil(1024) + 1024,
        }),
        _ => Ok(()),
    }
}

/// Build a read SQE for a registered file: `ReadFixed` from registered buffer `index`, or a
/// plain `Read` (the kernel pins the pages per I/O) when `index` is `None`.
pub fn read_sqe(
    file: FixedFile,
    buf: *mut u8,
    len: u32,
    offset: u64,
    index: Option<u16>,
) -> squeue::Entry {
    let fd = types::Fixed(file.0);
    match index {
        Some(i) => io_uring::opcode::ReadFixed::new(fd, buf, len, i)
            .offset(offset)
            .build(),
        None => io_uring::opcode::Read::new(fd, buf, len)
            .offset(offset)
            .build(),
    }
}

/// Build a write SQE for a registered file (`WriteFixed` from buffer `index`, or a plain
/// `Write`); `dsync` makes it a FUA write (`RWF_DSYNC`).
pub fn write_sqe(
    file: FixedFile,
    buf: *const u8,
    len: u32,
    offset: u64,
    index: Option<u16>,
    dsync: bool,
) -> squeue::Entry {
    let fd = types::Fixed(file.0);
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    match index {
        Some(i) => io_uring::opcode::WriteFixed::new(fd, buf, len, i)
            .offset(offset)
            .rw_flags(flags)
            .build(),
        None => io_uring::opcode::Write::new(fd, buf, len)
            .offset(offset)
            .rw_flags(flags)
            .build(),
    }
}

/// Build a vectored read SQE for a registered file: `ReadvFixed` when every segment lies in
/// registered buffer `index` (the kernel must support it: [`Engine::supports_vectored_fixed`]),
/// or a plain `Readv` when `index` is `None`.
///
/// The `count` iovecs at `iov` must stay valid until the SQE completes (the kernel may read them
/// as late as issue time, e.g. from an SQPOLL thread).
pub fn readv_sqe(
    file: FixedFile,
    iov: *const libc::iovec,
    count: u32,
    offset: u64,
    index: Option<u16>,
) -> squeue::Entry {
    let fd = types::Fixed(file.0);
    match index {
        Some(i) => io_uring::opcode::ReadvFixed::new(fd, iov, count, i)
            .offset(offset)
            .build(),
        None => io_uring::opcode::Readv::new(fd, iov, count)
            .offset(offset)
            .build(),
    }
}

/// Build a vectored write SQE (`WritevFixed` from registered buffer `index`, or a plain
/// `Writev`); `dsync` makes it a FUA write. The iovecs follow [`readv_sqe`]'s rule.
pub fn writev_sqe(
    file: FixedFile,
    iov: *const libc::iovec,
    count: u32,
    offset: u64,
    index: Option<u16>,
    dsync: bool,
) -> squeue::Entry {
    let fd = types::Fixed(file.0);
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    match index {
        Some(i) => io_uring::opcode::WritevFixed::new(fd, iov, count, i)
            .offset(offset)
            .rw_flags(flags)
            .build(),
        None => io_uring::opcode::Writev::new(fd, iov, count)
            .offset(offset)
            .rw_flags(flags)
            .build(),
    }
}

/// Build a NOP SQE (it completes at once with result 0): how a [`SoftDevice`] posts a completion.
pub fn nop_sqe() -> squeue::Entry {
    io_uring::opcode::Nop::new().build()
}

/// Build an `fdatasync` SQE for a registered file.
pub fn fdatasync(file: FixedFile) -> squeue::Entry {
    io_uring::opcode::Fsync::new(types::Fixed(file.0))
        .flags(types::FsyncFlags::DATASYNC)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_check_names_limit_need_and_fix() {
        assert!(check_memlock(None, 1 << 30, false).is_ok());
        assert!(check_memlock(Some(1 << 20), 1 << 30, true).is_ok());
        let e = check_memlock(Some(8 << 20), 16 << 20, false).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("8388608"), "{msg}");
        assert!(msg.contains("16777216"), "{msg}");
        assert!(msg.contains("ulimit -l"), "{msg}");
    }

    #[test]
    fn config_is_validated() {
        let bad = EngineConfig {
            ring_entries: 1000,
            ..EngineConfig::default()
        };
        assert!(matches!(Engine::new(bad), Err(CoreError::Config(m)) if m.contains("1000")));
    }

    struct Count(Cell<u32>, Cell<i32>);
    impl CompletionSink for Count {
        fn complete(&self, _payload: u64, result: i32, _flags: u32) {
            self.0.set(self.0.get() + 1);
            self.1.set(result);
        }
    }

    /// With SQPOLL, an SQE pushed after the polling thread went idle is still submitted: the
    /// engine wakes the thread when the ring says it sleeps. Without that, the second NOP
    /// below never completed (found by a review, 2026-11-27). Run on a thread with a deadline
    /// so that a hang fails the test. Skipped where the kernel refuses SQPOLL here.
    #[test]
    fn an_sqpoll_ring_takes_submissions_after_its_thread_went_idle() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let engine = Engine::new(EngineConfig {
                arena_bytes: 64 << 10,
                huge_pages: false,
                sqpoll_idle: Some(Duration::from_millis(20)),
                ..EngineConfig::default()
            })
            .unwrap();
            if !engine.main.sqpoll {
                tx.send(None).unwrap();
                return;
            }
            let sink = Rc::new(Count(Cell::new(0), Cell::new(-1)));
            let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
            let id = engine.register_sink(weak).unwrap();
            for round in 0..3u64 {
                // Past the idle time: the polling thread sleeps.
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: a NOP refers to no memory.
                unsafe {
                    engine.push(
                        RingKind::Main,
                        id,
                        round,
                        io_uring::opcode::Nop::new().build(),
                    )
                }
                .unwrap();
                engine.wait(1).unwrap();
            }
            tx.send(Some(sink.0.get())).unwrap();
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(n)) => assert_eq!(n, 3),
            Ok(None) => eprintln!("SQPOLL not granted here: nothing to check"),
            Err(_) => panic!("a NOP pushed after the SQPOLL thread went idle never completed"),
        }
    }

    #[test]
    fn nop_round_trip_through_a_sink() {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 1 << 20,
            ..EngineConfig::default()
        })
        .unwrap();
        let sink = Rc::new(Count(Cell::new(0), Cell::new(-1)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).unwrap();
        {
            let _plug = engine.plug();
            for i in 0..10 {
                // SAFETY: a NOP refers to no memory.
                unsafe { engine.push(RingKind::Main, id, i, io_uring::opcode::Nop::new().build()) }
                    .unwrap();
            }
            assert_eq!(engine.metrics().enters, 0, "plugged: nothing entered yet");
        }
        engine.wait(10).unwrap();
        assert_eq!(sink.0.get(), 10);
        assert_eq!(sink.1.get(), 0);
        assert!(!engine.has_work());
    }

    /// A push whose `io_uring_enter` fails has still queued its SQE, which the next enter
    /// submits: the push reports success (the caller keeps the SQE's memory until its
    /// completion), and the completion comes. A push that returned the enter's error told its
    /// caller the SQE never went out, and the caller could free memory the kernel then used.
    #[test]
    fn a_push_whose_enter_fails_is_still_submitted_by_the_next_one() {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 64 << 10,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .unwrap();
        let sink = Rc::new(Count(Cell::new(0), Cell::new(-1)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).unwrap();
        engine.fail_next_enters(1);
        // SAFETY: a NOP refers to no memory.
        unsafe { engine.push(RingKind::Main, id, 7, io_uring::opcode::Nop::new().build()) }
            .expect("the SQE is queued: the push succeeded");
        assert!(engine.has_work());
        engine.wait(1).unwrap();
        assert_eq!((sink.0.get(), sink.1.get()), (1, 0));
        assert!(!engine.has_work());
    }

    fn sink(engine: &Engine) -> (Rc<Count>, SinkId) {
        let sink = Rc::new(Count(Cell::new(0), Cell::new(-1)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).unwrap();
        (sink, id)
    }

    /// A software device whose advance completes nothing, though it reports requests pending:
    /// a wait says so instead of going round for ever.
    #[test]
    fn a_soft_device_that_completes_nothing_fails_the_wait() {
        struct Stuck;
        impl SoftDevice for Stuck {
            fn pending(&self) -> u32 {
                1
            }
            fn advance(&self, _engine: &Engine) -> Result<(), CoreError> {
                Ok(())
            }
        }
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let engine = small();
            let dev: Rc<dyn SoftDevice> = Rc::new(Stuck);
            engine.attach_soft_device(Rc::downgrade(&dev));
            let r = engine.wait(1).map_err(|e| e.to_string());
            let _ = tx.send(r);
        });
        // A hang guard, not a timing check: the wait went round for ever.
        let r = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the wait never returned");
        let e = r.expect_err("a wait on a stuck device");
        assert!(e.contains("completed none"), "{e}");
    }

    fn small() -> Rc<Engine> {
        Engine::new(EngineConfig {
            arena_bytes: 64 << 10,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .unwrap()
    }

    /// A sink dropped while one of its SQEs is still out: a sink registered next must not be
    /// handed that SQE's completion (with a payload that meant something to the old sink only),
    /// whether a never-used id is left or the dead sink's id is the only one.
    #[test]
    fn a_dead_sinks_id_is_not_reused_while_its_completions_can_still_come() {
        for fill in [false, true] {
            let engine = small();
            let mut keep = Vec::new();
            if fill {
                for _ in 0..MAX_COMPLETION_SINKS - 1 {
                    keep.push(sink(&engine));
                }
            }
            let (old, old_id) = sink(&engine);
            {
                let _plug = engine.plug();
                // SAFETY: a NOP refers to no memory.
                unsafe {
                    engine.push(
                        RingKind::Main,
                        old_id,
                        5,
                        io_uring::opcode::Nop::new().build(),
                    )
                }
                .unwrap();
                drop(old);
                let (new, _) = sink(&engine);
                drop(_plug);
                while engine.has_work() {
                    engine.wait(1).unwrap();
                }
                assert_eq!(new.0.get(), 0, "the new sink got the dead one's completion");
            }
            assert_eq!(engine.metrics().orphan_cqes, 1);
            drop(keep);
        }
    }

    /// A sink id past the table, or a payload that spills into the sink's bits, is refused at
    /// the push (it would panic the dispatch, losing the batch's other completions, or route
    /// the completion to another sink).
    #[test]
    fn a_push_with_a_bad_sink_or_payload_is_refused() {
        let engine = small();
        let (a, a_id) = sink(&engine);
        let (b, _) = sink(&engine);
        for (id, payload) in [
            (SinkId(MAX_COMPLETION_SINKS as u8), 0),
            (a_id, 1 << SINK_SHIFT),
        ] {
            // SAFETY: a NOP refers to no memory.
            let r = unsafe {
                engine.push(
                    RingKind::Main,
                    id,
                    payload,
                    io_uring::opcode::Nop::new().build(),
                )
            };
            assert!(matches!(r, Err(CoreError::Config(_))), "{r:?}");
        }
        while engine.has_work() {
            engine.wait(1).unwrap();
        }
        assert_eq!((a.0.get(), b.0.get()), (0, 0));
        assert_eq!(engine.metrics().sqes, 0);
    }

    /// A dropping engine whose wait fails once keeps waiting: its SQE out still completes (and
    /// is dispatched) before the arena goes. The drop used to stop at the first failed wait,
    /// unmapping memory that a read still in flight could land in.
    #[test]
    fn a_dropping_engine_waits_past_a_failed_wait() {
        let engine = small();
        let (sink, id) = sink(&engine);
        engine.fail_next_enters(1);
        // SAFETY: a NOP refers to no memory.
        unsafe { engine.push(RingKind::Main, id, 3, io_uring::opcode::Nop::new().build()) }
            .expect("queued");
        assert!(engine.has_work());
        // The drop's first wait fails; the second submits the NOP and reaps it.
        engine.fail_next_enters(1);
        drop(engine);
        assert_eq!(
            (sink.0.get(), sink.1.get()),
            (1, 0),
            "the drop gave up on the SQE still out"
        );
    }

    /// A dropping engine whose waits keep failing cannot know when the kernel is done with its
    /// memory: it leaks the arena and the shared regions rather than unmap them.
    #[test]
    fn a_dropping_engine_that_cannot_wait_leaks_its_memory_rather_than_unmap_it() {
        let engine = small();
        let (sink, id) = sink(&engine);
        let region = Arc::new(SharedRegion::map(64 << 10, false).unwrap());
        engine.register_region(&region).unwrap();
        let arena = Rc::downgrade(engine.arena());
        engine.fail_next_enters(1);
        // SAFETY: a NOP refers to no memory.
        unsafe { engine.push(RingKind::Main, id, 3, io_uring::opcode::Nop::new().build()) }
            .expect("queued");
        engine.fail_next_enters(u32::MAX);
        drop(engine);
        assert_eq!(sink.0.get(), 0);
        assert!(
            arena.upgrade().is_some(),
            "the arena was unmapped with I/O possibly in flight"
        );
        assert_eq!(
            Arc::strong_count(&region),
            2,
            "the region was let go with I/O possibly in flight"
        );
    }

    #[test]
    fn a_zero_frame_size_is_a_config_error() {
        for frame_bytes in [0, 100, usize::MAX / 2 + 1] {
            let cfg = EngineConfig {
                frame_bytes,
                arena_bytes: 64 << 10,
                huge_pages: false,
                ..EngineConfig::default()
            };
            assert!(
                matches!(Engine::new(cfg), Err(CoreError::Config(_))),
                "{frame_bytes}"
            );
        }
    }

    #[test]
    fn hybrid_waits_spin_within_their_budget_and_sleep_past_it() {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 64 << 10,
            huge_pages: false,
            ..EngineConfig::default()
        })
        .unwrap();
        let sink = Rc::new(Count(Cell::new(0), Cell::new(0)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).unwrap();
        let ts = io_uring::types::Timespec::new().nsec(2_000_000);
        let timer = |engine: &Engine| {
            let sqe = io_uring::opcode::Timeout::new(&ts).build();
            // SAFETY: `ts` outlives the wait below that completes the timer.
            unsafe { engine.push(RingKind::Main, id, 0, sqe) }.unwrap();
        };
        // A budget far past the 2 ms timer: the wait spins through it and never sleeps.
        engine.set_completion_mode(CompletionMode::Hybrid {
            spin: Duration::from_secs(10),
        });
        timer(&engine);
        let before = engine.metrics();
        engine.wait(1).unwrap();
        let spun = engine.metrics();
        assert_eq!(spun.sleeps, before.sleeps, "slept within the budget");
        assert!(spun.empty_polls > before.empty_polls, "never spun");
        // No budget: one poll, then it sleeps.
        engine.set_completion_mode(CompletionMode::Hybrid {
            spin: Duration::ZERO,
        });
        timer(&engine);
        engine.wait(1).unwrap();
        assert!(
            engine.metrics().sleeps > spun.sleeps,
            "did not sleep past the budget"
        );
        assert_eq!(sink.0.get(), 2);
        assert_eq!(sink.1.get(), -libc::ETIME);
        assert!(!engine.has_work());
    }

    /// NOPs through `engine`'s main ring, sleeping for them (every enter names the ring).
    fn nops(engine: &Engine, n: u64) -> u32 {
        let sink = Rc::new(Count(Cell::new(0), Cell::new(-1)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).unwrap();
        for i in 0..n {
            // SAFETY: a NOP refers to no memory.
            unsafe { engine.push(RingKind::Main, id, i, io_uring::opcode::Nop::new().build()) }
                .unwrap();
        }
        engine.wait(n as u32).unwrap();
        sink.0.get()
    }

    #[test]
    fn rings_are_entered_by_registered_index_up_to_the_threads_limit_and_released_on_drop() {
        let small = || {
            Engine::new(EngineConfig {
                arena_bytes: 64 << 10,
                huge_pages: false,
                ..EngineConfig::default()
            })
            .unwrap()
        };
        let first = small();
        if first
            .ring_setup()
            .dropped
            .iter()
            .any(|d| d.0 == "REGISTERED_RING_FD")
        {
            eprintln!("skipped: this kernel refuses registered ring descriptors");
            return;
        }
        assert!(first.main.registered.is_some());
        assert_eq!(nops(&first, 8), 8);
        // A thread holds at most 16: beyond that the ring is named by its descriptor, works
        // the same, and the setup report says why.
        let many: Vec<Rc<Engine>> = (0..20).map(|_| small()).collect();
        let unregistered: Vec<&Rc<Engine>> = many
            .iter()
            .filter(|e| e.main.registered.is_none())
            .collect();
        assert!(!unregistered.is_empty(), "21 engines, 16 registrations");
        for e in &unregistered {
            assert!(e
                .ring_setup()
                .dropped
                .iter()
                .any(|d| d.0 == "REGISTERED_RING_FD" && !d.1.is_empty()));
        }
        for e in &many {
            assert_eq!(nops(e, 3), 3);
        }
        // Dropping them gives their registrations back: a new engine registers again.
        drop(unregistered);
        drop(many);
        let again = small();
        assert!(again.main.registered.is_some());
        assert_eq!(nops(&again, 4), 4);
        assert_eq!(nops(&first, 2), 2);
    }

    #[test]
    fn passthrough_rings_take_both_sqe_sizes() {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 1 << 20,
            passthrough: true,
            ..EngineConfig::default()
        })
        .unwrap();
        let applied = &engine.ring_setup().applied;
        assert!(
            applied.contains(&"SQE128") && applied.contains(&"CQE32"),
            "{applied:?}"
        );
        let sink = Rc::new(Count(Cell::new(0), Cell::new(1)));
        let id = engine
            .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
            .unwrap();
        // SAFETY: a NOP refers to no memory.
        unsafe { engine.push(RingKind::Main, id, 1, io_uring::opcode::Nop::new().build()) }
            .unwrap();
        engine.wait(1).unwrap();
        assert_eq!(
            (sink.0.get(), sink.1.get()),
            (1, 0),
            "a 64-byte SQE on a big ring"
        );
        // A passthrough command to a file without uring_cmd support completes with an errno.
        let path = std::env::temp_dir().join(format!("aios-uring-cmd-{}", std::process::id()));
        let plain = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let file = engine.register_file(plain.as_raw_fd()).unwrap();
        let cmd = crate::nvme::PassthruCmd::io(crate::nvme::IoOpcode::Flush, 1, 0, 1, 0, 0, false);
        let sqe = crate::nvme::uring_cmd(file, &cmd, None);
        // SAFETY: the command carries no buffer; the file outlives the wait.
        unsafe { engine.push_cmd(RingKind::Main, id, 2, sqe) }.unwrap();
        engine.wait(1).unwrap();
        assert_eq!(sink.0.get(), 2);
        assert_eq!(
            sink.1.get(),
            -libc::EOPNOTSUPP,
            "uring_cmd on a regular file"
        );
        engine.unregister_file(file);
    }

    #[test]
    fn push_cmd_needs_passthrough_rings() {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 1 << 20,
            ..EngineConfig::default()
        })
        .unwrap();
        let cmd = crate::nvme::PassthruCmd::io(crate::nvme::IoOpcode::Flush, 1, 0, 1, 0, 0, false);
        let sqe = crate::nvme::uring_cmd(FixedFile(0), &cmd, None);
        // SAFETY: refused before it reaches the ring.
        let e = unsafe { engine.push_cmd(RingKind::Main, SinkId(0), 0, sqe) }.unwrap_err();
        assert!(e.to_string().contains("passthrough: true"), "{e}");
        assert!(!engine.has_work());
    }

    /// More completions than the CQ holds, busy-polled on a ring without DEFER_TASKRUN: the
    /// kernel keeps the excess on its overflow list and moves it into the CQ only on an enter
    /// with GETEVENTS, which the busy-poll never made (nothing queued, no deferred task work),
    /// so the wait spun for ever once the CQ was reaped. Run on a thread with a deadline.
    #[test]
    fn a_busy_poll_gets_completions_that_overflowed_the_cq() {
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let engine = Engine::new(EngineConfig {
                ring_entries: 2,
                arena_bytes: 64 << 10,
                huge_pages: false,
                fast_flags: false,
                completion: CompletionMode::BusyPoll,
                ..EngineConfig::default()
            })
            .unwrap();
            let (sink, id) = sink(&engine);
            // Each push submits its NOP, which completes at once: 4 fill the CQ, 12 overflow.
            for i in 0..16 {
                // SAFETY: a NOP refers to no memory.
                unsafe { engine.push(RingKind::Main, id, i, nop_sqe()) }.unwrap();
            }
            let r = engine.wait(16).map_err(|e| e.to_string());
            let _ = tx.send((r, sink.0.get(), engine.has_work()));
        });
        let (r, got, work) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the busy-poll wait never returned");
        assert_eq!(r, Ok(16));
        assert_eq!((got, work), (16, false));
    }

    /// A sink that waits on the engine from its completion (a handler that needs a frame and
    /// calls `alloc_blocking`, say) reaps, in that nested wait, completions the outer wait
    /// counted on. The outer wait then went round for ever with nothing left in flight: in
    /// `Wait` mode with enters that wait for nothing, in `BusyPoll` with empty polls. Run on a
    /// thread with a deadline.
    #[test]
    fn a_wait_whose_completions_a_nested_wait_took_returns() {
        struct Nested(Weak<Engine>, Cell<u32>);
        impl CompletionSink for Nested {
            fn complete(&self, payload: u64, _result: i32, _flags: u32) {
                self.1.set(self.1.get() + 1);
                if payload == 0 {
                    let engine = self.0.upgrade().expect("the engine lives");
                    engine.wait(1).expect("the nested wait");
                }
            }
        }
        for mode in [CompletionMode::Wait, CompletionMode::BusyPoll] {
            let (tx, rx) = std::sync::mpsc::channel();
            thread::spawn(move || {
                let engine = small();
                engine.set_completion_mode(mode);
                let sink = Rc::new(Nested(Rc::downgrade(&engine), Cell::new(0)));
                let id = engine
                    .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
                    .unwrap();
                let ts = io_uring::types::Timespec::new().nsec(5_000_000);
                {
                    let _plug = engine.plug();
                    // SAFETY: a NOP refers to no memory; `ts` outlives the waits below.
                    unsafe {
                        engine.push(RingKind::Main, id, 0, nop_sqe()).unwrap();
                        let timer = io_uring::opcode::Timeout::new(&ts).build();
                        engine.push(RingKind::Main, id, 1, timer).unwrap();
                    }
                }
                // The NOP's completion comes first; its handler's wait takes the timer's.
                let r = engine.wait(2).map_err(|e| e.to_string());
                let _ = tx.send((r, sink.1.get(), engine.has_work()));
            });
            let (r, got, work) = rx
                .recv_timeout(Duration::from_secs(20))
                .unwrap_or_else(|_| panic!("{mode:?}: the outer wait never returned"));
            assert!(r.is_ok(), "{mode:?}: {r:?}");
            assert_eq!((got, work), (2, false), "{mode:?}");
        }
    }

    /// A `block_on` nested in a future that an outer `block_on` polls: the nested one's wait
    /// may dispatch the completion the outer future waits on, and that wake (the same flag for
    /// both) was cleared when the nested loop went round. The outer future, pending once the
    /// nested call returned, was then never polled again: `block_on` parked with nothing in
    /// flight. Run on a thread with a deadline (a hang guard, not a timing check).
    #[test]
    fn a_wake_taken_by_a_nested_block_on_still_polls_the_outer_future() {
        use std::task::Poll;
        /// Per payload: whether its completion came, and who to wake then.
        struct Wakes(RefCell<[(bool, Option<Waker>); 2]>);
        impl CompletionSink for Wakes {
            fn complete(&self, payload: u64, _result: i32, _flags: u32) {
                let waker = {
                    let mut w = self.0.borrow_mut();
                    w[payload as usize].0 = true;
                    w[payload as usize].1.take()
                };
                if let Some(w) = waker {
                    w.wake();
                }
            }
        }
        /// Pushes a NOP with `payload` on its first poll; ready once its completion came.
        fn nop_done<'a>(
            engine: &'a Engine,
            sink: &'a Rc<Wakes>,
            id: SinkId,
            payload: u64,
        ) -> impl Future<Output = ()> + 'a {
            let mut pushed = false;
            std::future::poll_fn(move |cx| {
                if !pushed {
                    engine.push_nop(id, payload).unwrap();
                    pushed = true;
                }
                let mut w = sink.0.borrow_mut();
                if w[payload as usize].0 {
                    return Poll::Ready(());
                }
                w[payload as usize].1 = Some(cx.waker().clone());
                Poll::Pending
            })
        }
        let (tx, rx) = std::sync::mpsc::channel();
        thread::spawn(move || {
            let engine = small();
            let sink = Rc::new(Wakes(RefCell::new([(false, None), (false, None)])));
            let id = engine
                .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
                .unwrap();
            let mut first = pin!(nop_done(&engine, &sink, id, 0));
            let mut nested_done = false;
            let r = engine.block_on(std::future::poll_fn(|cx| {
                if first.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(());
                }
                if !nested_done {
                    // Its wait submits both NOPs and dispatches both completions, waking the
                    // outer future too.
                    engine
                        .block_on(nop_done(&engine, &sink, id, 1))
                        .expect("the nested block_on");
                    nested_done = true;
                }
                Poll::Pending
            }));
            let _ = tx.send(r.map_err(|e| e.to_string()));
        });
        let r = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the outer block_on parked for ever: the nested one took its wake");
        assert_eq!(r, Ok(()));
    }

    /// A future that is ready, whose last poll queued an SQE (a follow-up request, as a
    /// completion that frees a token starts the next one): the `io_uring_enter` that
    /// `block_on` makes on the way out is refused. The SQE stays queued for the next enter
    /// (which reports the error, as after a push or a wait), so the finished future's output
    /// must come back; `block_on` returned the enter's error and dropped the output.
    #[test]
    fn a_ready_future_is_returned_when_the_submit_after_it_fails() {
        use std::task::Poll;
        let engine = small();
        let (sink, id) = sink(&engine);
        let r = engine.block_on(std::future::poll_fn(|_cx| {
            engine.push_nop(id, 1).unwrap();
            engine.fail_next_enters(1);
            Poll::Ready(7)
        }));
        assert_eq!(
            r.map_err(|e| e.to_string()),
            Ok(7),
            "the finished future's output was lost"
        );
        // The queued NOP still goes out with the next enter.
        engine.wait(1).unwrap();
        assert_eq!(sink.0.get(), 1);
        assert!(!engine.has_work());
    }

    /// A buffer longer than the whole arena can never be allocated, whatever completes:
    /// `alloc_blocking` fails at once. It waited for the engine's other work first (here a
    /// NOP; a timer or a socket read would have held it for as long as they take).
    #[test]
    fn alloc_blocking_of_more_than_the_arena_fails_without_waiting_for_other_work() {
        let engine = small();
        let (sink, id) = sink(&engine);
        let frames = engine.arena().frames() as usize;
        let frame = engine.arena().frame_bytes();
        let _plug = engine.plug();
        // SAFETY: a NOP refers to no memory.
        unsafe { engine.push(RingKind::Main, id, 0, nop_sqe()) }.unwrap();
        let e = engine.alloc_blocking((frames + 1) * frame).unwrap_err();
        assert!(
            matches!(e, CoreError::ArenaExhausted { needed, .. } if needed == frames + 1),
            "{e}"
        );
        assert_eq!(
            sink.0.get(),
            0,
            "it waited for unrelated work before failing"
        );
        assert!(engine.has_work());
        // A buffer the arena can hold is still handed out.
        assert_eq!(
            engine.alloc_blocking(frames * frame).unwrap().capacity(),
            frames * frame
        );
    }

    /// A software device holding a request of a sink that is gone: the request's completion
    /// is still to come (the device pushes it when asked to advance), so the dead sink's id
    /// must not go to a new sink before it came. Only the rings' SQEs were counted, and the
    /// new sink got the old one's completion.
    #[test]
    fn a_dead_sinks_id_is_not_reused_while_a_soft_device_holds_its_requests() {
        struct Held(RefCell<Vec<(SinkId, u64)>>);
        impl SoftDevice for Held {
            fn pending(&self) -> u32 {
                self.0.borrow().len() as u32
            }
            fn advance(&self, engine: &Engine) -> Result<(), CoreError> {
                let (sink, payload) = self.0.borrow_mut().pop().expect("a request pending");
                // SAFETY: a NOP refers to no memory.
                unsafe { engine.push(RingKind::Main, sink, payload, nop_sqe()) }
            }
        }
        let engine = small();
        let keep: Vec<_> = (0..MAX_COMPLETION_SINKS - 1)
            .map(|_| sink(&engine))
            .collect();
        let (old, old_id) = sink(&engine);
        let dev = Rc::new(Held(RefCell::new(vec![(old_id, 5)])));
        engine.attach_soft_device(Rc::downgrade(&dev) as Weak<dyn SoftDevice>);
        drop(old);
        let (new, _) = sink(&engine);
        while engine.has_work() {
            engine.wait(1).unwrap();
        }
        assert_eq!(new.0.get(), 0, "the new sink got the dead one's completion");
        assert_eq!(engine.metrics().orphan_cqes, 1);
        drop(keep);
    }
}
