//! Device probe: what a device can do and which I/O path is fastest on it, measured, not guessed.
//!
//! "Probe, then choose" (DESIGN.md): alignment from `statx(STATX_DIOALIGN)`, max transfer and
//! rotational flag from sysfs, IOPOLL by trying a polled read, and whether io_uring completes
//! reads inline or punts them to its worker threads by timing QD1 io_uring reads against `pread`
//! on the device itself. For an NVMe namespace, also what passthrough (`/dev/ngXnY`) offers:
//! Identify geometry and whether polled passthrough reads complete.

use std::cell::Cell;
use std::fmt;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};
use std::time::Instant;

use crate::arena::FixedBuf;
use crate::engine::{
    self, CompletionMode, CompletionSink, Engine, EngineConfig, LastResult, RingKind,
};
use crate::error::CoreError;
use crate::nvme::{self, IoOpcode, NvmeNamespace, NvmeStatus, PassthruCmd};
use crate::sys::{self, DioAlign};

/// Transfer limit used when the device exposes no block queue to ask (e.g. a file on tmpfs).
pub const DEFAULT_MAX_TRANSFER_BYTES: u32 = 1 << 20;
/// Bytes read per latency sample.
pub const PROBE_READ_BYTES: u32 = 4096;
/// The probe reads only within this many leading bytes of the device.
pub const PROBE_SPAN_BYTES: u64 = 256 << 20;

/// What kind of file the path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    BlockDevice,
    RegularFile,
    CharDevice,
    Directory,
    /// A FIFO, a socket, or anything else that is none of the above.
    Other,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::BlockDevice => "block device",
            DeviceKind::RegularFile => "regular file",
            DeviceKind::CharDevice => "character device",
            DeviceKind::Directory => "directory",
            DeviceKind::Other => "special file",
        })
    }
}

/// How requests of one class reach the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// io_uring with registered buffers and files.
    Ring,
    /// `pread`/`pwrite` on the caller's thread (the thesis' SyncPath).
    Sync,
    /// Raw NVMe commands through `IORING_OP_URING_CMD` on the namespace's character device.
    Passthrough,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Route::Ring => "io_uring",
            Route::Sync => "sync pread/pwrite",
            Route::Passthrough => "NVMe passthrough (io_uring uring_cmd)",
        })
    }
}

/// A route and why it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathChoice {
    pub route: Route,
    pub reason: String,
}

/// QD1 latency of the two read paths, median of the samples, and whether io_uring's worker
/// threads served the io_uring reads.
#[derive(Clone, Copy, Debug)]
pub struct PathLatency {
    pub uring_qd1_ns: f64,
    pub pread_ns: f64,
    pub samples: u32,
    /// io-wq worker threads (`iou-wrk-<tid>`) the probe's thread had after its io_uring reads:
    /// io_uring starts one only when a request cannot be issued without blocking and is handed
    /// to it. `None` when `/proc/self/task` could not be read.
    pub io_wq_workers: Option<u32>,
}

impl PathLatency {
    /// Whether io_uring punts this device's reads to io-wq. Seen directly when it can be: an
    /// io-wq worker appeared for the probe's reads. Otherwise from the latencies: io_uring taken
    /// to punt when its QD1 read is 1.5x slower than a plain `pread` (inline completion costs
    /// about the same as `pread`, a hop through io-wq several times more). The latencies alone
    /// mislead on a device whose own latency swings from run to run (a loop device's worker is
    /// scheduled now on the caller's CPU, now on another): they are reported, not relied on.
    pub fn punts(&self) -> bool {
        match self.io_wq_workers {
            Some(n) => n > 0,
            None => self.uring_qd1_ns > 1.5 * self.pread_ns,
        }
    }
}

/// Everything the probe found about one device.
#[derive(Clone, Debug)]
pub struct DeviceProbe {
    pub path: PathBuf,
    pub kind: DeviceKind,
    pub fs_type: Option<String>,
    pub capacity_bytes: u64,
    pub logical_block: u32,
    /// Direct-I/O alignment; `None` when the device cannot be opened `O_DIRECT`.
    pub dio: Option<DioAlign>,
    pub dio_source: String,
    pub max_transfer_bytes: u32,
    pub max_transfer_source: String,
    pub rotational: Option<bool>,
    /// Whether the device has a volatile write cache (completed writes need a FLUSH to be
    /// durable): the block queue's `write_cache` ("write back" / "write through"), or the NVMe
    /// controller's VWC bit. `Some(false)` means durable at completion (power-loss protected,
    /// or no cache): the kernel drops FLUSH and FUA for such a device anyway. `None` for a
    /// regular file, whose durability also needs its file system's metadata synced.
    pub volatile_write_cache: Option<bool>,
    /// For a regular file: bytes allocated on disk (reads of holes never reach the device).
    pub allocated_bytes: Option<u64>,
    /// `Ok` when a polled read completed, `Err(reason)` otherwise.
    pub iopoll: Result<(), String>,
    pub latency: Option<PathLatency>,
    pub critical: PathChoice,
    pub background: PathChoice,
    /// NVMe passthrough for this namespace (`None`: the path is not an NVMe namespace).
    pub passthrough: Option<PassthroughProbe>,
}

/// What NVMe passthrough offers for one namespace.
#[derive(Clone, Debug)]
pub struct PassthroughProbe {
    /// The namespace's generic character device (`/dev/ngXnY`).
    pub char_device: PathBuf,
    /// Identify results, or why the namespace could not be identified or opened.
    pub namespace: Result<NvmeNamespace, String>,
    /// `Ok` when a passthrough read completed on an IOPOLL ring, `Err(reason)` otherwise.
    pub iopoll: Result<(), String>,
    /// Median QD1 passthrough read latency, when measured.
    pub qd1_read_ns: Option<f64>,
}

/// Most latency samples a probe takes per path ([`ProbeOptions::latency_samples`]).
pub const MAX_LATENCY_SAMPLES: u32 = 1_000_000;

/// Probe options.
#[derive(Clone, Copy, Debug)]
pub struct ProbeOptions {
    /// Latency samples per path (0 skips the measurement; the ring is then chosen untested);
    /// at most [`MAX_LATENCY_SAMPLES`].
    pub latency_samples: u32,
    /// Try a polled read on an IOPOLL ring.
    pub try_iopoll: bool,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            latency_samples: 300,
            try_iopoll: true,
        }
    }
}

fn path_err(path: &Path) -> impl FnOnce(std::io::Error) -> CoreError + '_ {
    move |source| CoreError::Path {
        path: path.to_path_buf(),
        source,
    }
}

/// Probe `path`. Reads only; never writes the device.
pub fn probe(path: &Path, opts: ProbeOptions) -> Result<DeviceProbe, CoreError> {
    if opts.latency_samples > MAX_LATENCY_SAMPLES {
        return Err(CoreError::Config(format!(
            "{} latency samples: a probe takes at most {MAX_LATENCY_SAMPLES} per path",
            opts.latency_samples
        )));
    }
    let buffered = sys::open_buffered(path, false).map_err(path_err(path))?;
    let st = sys::statx(buffered.as_raw_fd()).map_err(path_err(path))?;
    let kind = if st.is_block_device() {
        DeviceKind::BlockDevice
    } else if st.is_regular() {
        DeviceKind::RegularFile
    } else if st.is_char_device() {
        DeviceKind::CharDevice
    } else if st.is_dir() {
        DeviceKind::Directory
    } else {
        DeviceKind::Other
    };
    if kind == DeviceKind::CharDevice && nvme::namespace_id(buffered.as_raw_fd()).is_some() {
        drop(buffered);
        return Ok(probe_nvme_char(path, opts));
    }
    let (capacity_bytes, logical_block) = match kind {
        DeviceKind::BlockDevice => (
            sys::block_device_bytes(buffered.as_raw_fd()).map_err(path_err(path))?,
            sys::block_device_logical_block(buffered.as_raw_fd()).map_err(path_err(path))?,
        ),
        _ => (st.size, st.dio.map_or(512, |d| d.offset_align)),
    };
    // Where the block queue attributes live: the device itself, or the one under the file system.
    let (qmaj, qmin) = if kind == DeviceKind::BlockDevice {
        (st.rdev_major, st.rdev_minor)
    } else {
        (st.dev_major, st.dev_minor)
    };
    let has_queue = qmaj != 0;
    let (max_transfer_bytes, max_transfer_source) = match has_queue
        .then(|| sys::block_queue_attr(qmaj, qmin, "max_sectors_kb"))
        .flatten()
    {
        Some(kb) => match kb.parse::<u32>() {
            Ok(kb) if kb > 0 => (
                kb.saturating_mul(1024),
                format!("/sys/dev/block/{qmaj}:{qmin}/queue/max_sectors_kb"),
            ),
            _ => (
                DEFAULT_MAX_TRANSFER_BYTES,
                format!("default (max_sectors_kb unreadable: {kb:?})"),
            ),
        },
        None => (
            DEFAULT_MAX_TRANSFER_BYTES,
            "default (no block queue behind this file)".to_string(),
        ),
    };
    let rotational = has_queue
        .then(|| sys::block_queue_attr(qmaj, qmin, "rotational"))
        .flatten()
        .map(|r| r == "1");
    let volatile_write_cache = (kind == DeviceKind::BlockDevice)
        .then(|| sys::block_queue_attr(qmaj, qmin, "write_cache"))
        .flatten()
        .and_then(|w| match w.as_str() {
            "write back" => Some(true),
            "write through" => Some(false),
            _ => None,
        });
    let fs_type = if kind == DeviceKind::RegularFile {
        sys::fs_type_of(path)
    } else {
        None
    };

    let direct = sys::open_direct(path, false);
    let (dio, dio_source) = match (&direct, st.dio) {
        (Err(e), _) => (
            None,
            format!(
                "O_DIRECT open failed: {e}{}",
                fs_type
                    .as_ref()
                    .map(|t| format!(" (file system {t})"))
                    .unwrap_or_default()
            ),
        ),
        (Ok(_), Some(d)) => (Some(d), "statx STATX_DIOALIGN".to_string()),
        (Ok(_), None) => (
            Some(DioAlign {
                mem_align: logical_block,
                offset_align: logical_block,
            }),
            "logical block size (statx reported no DIO alignment)".to_string(),
        ),
    };

    let passthrough = (kind == DeviceKind::BlockDevice)
        .then(|| nvme::char_device_for(path))
        .flatten()
        .map(|ng| probe_passthrough(&ng, opts));
    let mut probe = DeviceProbe {
        passthrough,
        path: path.to_path_buf(),
        kind,
        fs_type,
        capacity_bytes,
        logical_block,
        dio,
        dio_source,
        max_transfer_bytes,
        max_transfer_source,
        rotational,
        volatile_write_cache,
        allocated_bytes: (kind == DeviceKind::RegularFile).then_some(st.allocated_bytes),
        iopoll: Err("not tried".to_string()),
        latency: None,
        critical: PathChoice {
            route: Route::Ring,
            reason: String::new(),
        },
        background: PathChoice {
            route: Route::Ring,
            reason: "asynchronous: throttled by tokens and overlapped with the caller".to_string(),
        },
    };

    let Ok(direct) = direct else {
        probe.critical.reason = "no direct I/O on this path: lbio cannot use it".to_string();
        probe.background.reason = probe.critical.reason.clone();
        probe.iopoll = Err("no direct I/O".to_string());
        return Ok(probe);
    };
    let read_len = PROBE_READ_BYTES.max(dio.map_or(512, |d| d.offset_align));
    if capacity_bytes < read_len as u64 {
        probe.iopoll = Err(format!(
            "device holds {capacity_bytes} bytes: nothing to read"
        ));
        probe.critical.reason = "device too small to measure: io_uring by default".to_string();
        return Ok(probe);
    }
    if opts.try_iopoll {
        // A polled read of a hole completes without reaching the device: read real data.
        let at = if kind == DeviceKind::RegularFile {
            sys::next_data_offset(direct.as_raw_fd(), 0)
                .map(|o| o / read_len as u64 * read_len as u64)
                .filter(|o| o + read_len as u64 <= capacity_bytes)
        } else {
            Some(0)
        };
        probe.iopoll = match at {
            Some(at) => try_iopoll(&direct, read_len, at),
            None => Err(
                "the file holds no allocated data: a polled read of a hole would \
                         never reach the device, so IOPOLL cannot be tested"
                    .to_string(),
            ),
        };
    }
    if opts.latency_samples > 0 {
        let lat = measure(&direct, capacity_bytes, read_len, opts.latency_samples)?;
        probe.latency = Some(lat);
        let (u, p) = (lat.uring_qd1_ns / 1000.0, lat.pread_ns / 1000.0);
        let seen = match lat.io_wq_workers {
            Some(0) => "no io-wq worker served its reads".to_string(),
            Some(n) => format!("{n} io-wq worker(s) served its reads"),
            None => "io-wq workers not visible (no /proc/self/task)".to_string(),
        };
        probe.critical = if lat.punts() {
            PathChoice {
                route: Route::Sync,
                reason: format!(
                    "io_uring QD1 read {u:.1} us vs pread {p:.1} us, {seen}: io_uring punts \
                     this device's reads to its worker threads, so critical requests use the \
                     SyncPath"
                ),
            }
        } else {
            PathChoice {
                route: Route::Ring,
                // Without a punt the ring is the way: it batches and can busy-poll, where a
                // pread sleeps in the kernel for every request.
                reason: format!(
                    "io_uring QD1 read {u:.1} us vs pread {p:.1} us, {seen}: completes \
                     inline, and submissions can be batched"
                ),
            }
        };
    } else {
        probe.critical.reason = "latency not measured: io_uring by default".to_string();
    }
    Ok(probe)
}

/// Probe a namespace through its passthrough character device only.
fn probe_nvme_char(path: &Path, opts: ProbeOptions) -> DeviceProbe {
    let pt = probe_passthrough(path, opts);
    let block = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("ng"))
        .map(|rest| format!("nvme{rest}"));
    let rotational = block
        .and_then(|b| std::fs::read_to_string(format!("/sys/block/{b}/queue/rotational")).ok())
        .map(|r| r.trim() == "1");
    let mut p = DeviceProbe {
        path: path.to_path_buf(),
        kind: DeviceKind::CharDevice,
        fs_type: None,
        capacity_bytes: 0,
        logical_block: 0,
        dio: None,
        dio_source: String::new(),
        max_transfer_bytes: 0,
        max_transfer_source: String::new(),
        rotational,
        volatile_write_cache: pt.namespace.as_ref().ok().map(|n| n.volatile_write_cache),
        allocated_bytes: None,
        iopoll: pt.iopoll.clone(),
        latency: None,
        critical: PathChoice {
            route: Route::Passthrough,
            reason: String::new(),
        },
        background: PathChoice {
            route: Route::Passthrough,
            reason: "asynchronous NVMe commands, throttled by tokens".to_string(),
        },
        passthrough: None,
    };
    match &pt.namespace {
        Ok(ns) => {
            p.capacity_bytes = ns.capacity_bytes();
            p.logical_block = ns.lba_bytes;
            p.dio = Some(DioAlign {
                mem_align: ns.lba_bytes,
                offset_align: ns.lba_bytes,
            });
            p.dio_source = "NVMe Identify Namespace (current LBA format)".to_string();
            p.max_transfer_bytes = ns.max_transfer_bytes();
            p.max_transfer_source = ns.max_transfer_source();
            p.critical.reason = match pt.qd1_read_ns {
                Some(ns) => format!(
                    "commands go straight to the NVMe driver, no bio or file layer; QD1 read {:.1} us",
                    ns / 1000.0
                ),
                None => "commands go straight to the NVMe driver, no bio or file layer".into(),
            };
        }
        Err(why) => {
            p.dio_source = format!("namespace not identified: {why}");
            p.critical.reason = format!("passthrough unusable: {why}");
            p.background.reason = p.critical.reason.clone();
        }
    }
    p.passthrough = Some(pt);
    p
}

/// Identify a namespace through its character device, try a polled passthrough read and time
/// QD1 passthrough reads.
fn probe_passthrough(char_device: &Path, opts: ProbeOptions) -> PassthroughProbe {
    let mut pt = PassthroughProbe {
        char_device: char_device.to_path_buf(),
        namespace: Err("not tried".into()),
        iopoll: Err("not tried".into()),
        qd1_read_ns: None,
    };
    let (fd, ns) = match nvme::open_namespace(char_device) {
        Ok(x) => x,
        Err(e) => {
            pt.namespace = Err(e.to_string());
            pt.iopoll = Err("namespace not identified".into());
            return pt;
        }
    };
    if opts.try_iopoll {
        pt.iopoll = passthrough_reads(&fd, &ns, true, 1).map(|_| ());
    }
    if opts.latency_samples > 0 {
        pt.qd1_read_ns = passthrough_reads(&fd, &ns, false, opts.latency_samples).ok();
    }
    pt.namespace = Ok(ns);
    pt
}

/// Issue `samples` QD1 passthrough reads of one block spread over the probe span; the median
/// latency in ns, or why a read failed.
fn passthrough_reads(
    fd: &std::os::fd::OwnedFd,
    ns: &NvmeNamespace,
    iopoll: bool,
    samples: u32,
) -> Result<f64, String> {
    let engine = Engine::new(EngineConfig {
        ring_entries: 8,
        arena_bytes: 64 << 10,
        huge_pages: false,
        max_files: 1,
        iopoll_ring: iopoll,
        passthrough: true,
        completion: CompletionMode::Wait,
        ..EngineConfig::default()
    })
    .map_err(|e| match e {
        CoreError::IopollUnavailable(src) => format!("the kernel refused an IOPOLL ring: {src}"),
        e => e.to_string(),
    })?;
    let sink = Rc::new(LastResult(Cell::new(None)));
    let id = engine
        .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
        .map_err(|e| e.to_string())?;
    let file = engine
        .register_file(fd.as_raw_fd())
        .map_err(|e| e.to_string())?;
    let len = ns.lba_bytes.max(PROBE_READ_BYTES);
    let mut buf = engine.try_alloc(len as usize).ok_or("arena exhausted")?;
    let blocks = (ns.capacity_bytes().min(PROBE_SPAN_BYTES) / len as u64).max(1);
    let ring = if iopoll {
        RingKind::Iopoll
    } else {
        RingKind::Main
    };
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut times = Vec::with_capacity(samples as usize);
    let mut outcome = Ok(());
    for _ in 0..samples {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let offset = (x % blocks) * len as u64;
        let slba = offset / ns.lba_bytes as u64;
        let cmd = PassthruCmd::io(
            IoOpcode::Read,
            ns.nsid,
            slba,
            len / ns.lba_bytes,
            buf.as_mut_ptr() as u64,
            len,
            false,
        );
        let t = Instant::now();
        sink.0.set(None);
        // SAFETY: `buf` and the registered file outlive the wait, which dispatches this CQE
        // (or, when it fails, keeps `buf` out of the arena for good).
        let pushed = unsafe { engine.push_cmd(ring, id, 0, nvme::uring_cmd(file, &cmd, Some(0))) };
        if let Err(e) = pushed {
            outcome = Err(e.to_string());
            break;
        }
        buf = match wait_for_read(&engine, buf) {
            Ok(b) => b,
            Err(e) => {
                outcome = Err(e.to_string());
                break;
            }
        };
        times.push(t.elapsed().as_nanos() as f64);
        match sink.0.get() {
            Some(0) => {}
            Some(r) if -r == libc::EOPNOTSUPP && iopoll => {
                outcome = Err(
                    "EOPNOTSUPP: the driver has no poll queues (load nvme with poll_queues=N)"
                        .into(),
                );
                break;
            }
            Some(r) if r < 0 => {
                outcome = Err(format!(
                    "passthrough read failed: {}",
                    std::io::Error::from_raw_os_error(-r)
                ));
                break;
            }
            Some(r) => {
                outcome = Err(format!("passthrough read failed: {}", NvmeStatus(r as u16)));
                break;
            }
            None => {
                outcome = Err("the read produced no completion".into());
                break;
            }
        }
    }
    engine.unregister_file(file);
    outcome.map(|()| median(&mut times))
}

fn small_engine(iopoll: bool) -> Result<Rc<Engine>, CoreError> {
    Engine::new(EngineConfig {
        ring_entries: 8,
        arena_bytes: 64 << 10,
        huge_pages: false,
        max_files: 1,
        iopoll_ring: iopoll,
        completion: CompletionMode::Wait,
        ..EngineConfig::default()
    })
}

fn try_iopoll(direct: &std::os::fd::OwnedFd, read_len: u32, at: u64) -> Result<(), String> {
    let engine = small_engine(true).map_err(|e| e.to_string())?;
    let sink = Rc::new(LastResult(Cell::new(None)));
    let id = engine
        .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
        .map_err(|e| e.to_string())?;
    let file = engine
        .register_file(direct.as_raw_fd())
        .map_err(|e| e.to_string())?;
    let mut buf = engine
        .try_alloc(read_len as usize)
        .ok_or("arena exhausted")?;
    let sqe = engine::read_sqe(file, buf.as_mut_ptr(), read_len, at, Some(0));
    // SAFETY: `buf` and the file outlive the wait below, which dispatches this SQE's completion
    // (or, when it fails, keeps `buf` out of the arena for good).
    unsafe { engine.push(RingKind::Iopoll, id, 0, sqe) }.map_err(|e| e.to_string())?;
    let _buf = wait_for_read(&engine, buf).map_err(|e| e.to_string())?;
    let result = sink.0.get();
    engine.unregister_file(file);
    match result {
        Some(n) if n >= 0 => Ok(()),
        Some(n) if -n == libc::EOPNOTSUPP => {
            Err("EOPNOTSUPP: the device has no poll queues for polled completion".to_string())
        }
        Some(n) => Err(format!(
            "polled read failed: {}",
            std::io::Error::from_raw_os_error(-n)
        )),
        None => Err("polled read produced no completion".to_string()),
    }
}

/// Wait for the one read in flight into `buf` and give `buf` back. When the wait fails, the
/// read may still be in the kernel's hands: `buf` is then leaked (its frames never go back to
/// the arena, and the arena is never unmapped) instead of dropped, where another allocation
/// could take memory the read still writes.
fn wait_for_read(engine: &Engine, buf: FixedBuf) -> Result<FixedBuf, CoreError> {
    match engine.wait(1) {
        Ok(_) => Ok(buf),
        Err(e) => {
            std::mem::forget(buf);
            Err(e)
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn measure(
    direct: &std::os::fd::OwnedFd,
    capacity: u64,
    read_len: u32,
    samples: u32,
) -> Result<PathLatency, CoreError> {
    // On a thread of its own: io-wq workers belong to the thread whose ring handed them work,
    // so the ones named after this thread were started by these reads and no others.
    std::thread::scope(|scope| {
        scope
            .spawn(|| measure_here(direct, capacity, read_len, samples))
            .join()
            .unwrap_or_else(|_| Err(CoreError::Config("the probe's thread panicked".into())))
    })
}

/// io-wq workers of the calling thread: threads of this process named `iou-wrk-<its tid>`.
fn io_wq_workers_of_this_thread() -> Option<u32> {
    let name = format!("iou-wrk-{}", sys::gettid());
    let tasks = std::fs::read_dir("/proc/self/task").ok()?;
    let mut n = 0;
    for task in tasks.flatten() {
        // A thread that exited since the listing has no comm left: not counted.
        if let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) {
            if comm.trim_end() == name {
                n += 1;
            }
        }
    }
    Some(n)
}

fn measure_here(
    direct: &std::os::fd::OwnedFd,
    capacity: u64,
    read_len: u32,
    samples: u32,
) -> Result<PathLatency, CoreError> {
    let engine = small_engine(false)?;
    let sink = Rc::new(LastResult(Cell::new(None)));
    let id = engine.register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)?;
    let file = engine.register_file(direct.as_raw_fd())?;
    let mut buf = engine
        .try_alloc(read_len as usize)
        .ok_or_else(|| CoreError::Config("probe arena exhausted".into()))?;
    let blocks = capacity.min(PROBE_SPAN_BYTES) / read_len as u64;
    // A fixed-seed xorshift spreads samples over the span without a dependency.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_offset = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % blocks) * read_len as u64
    };
    let warmup = 16;
    let mut uring = Vec::with_capacity(samples as usize);
    let mut pread = Vec::with_capacity(samples as usize);
    for i in 0..samples.saturating_add(warmup) {
        let off = next_offset();
        let t = Instant::now();
        let sqe = engine::read_sqe(file, buf.as_mut_ptr(), read_len, off, Some(0));
        // SAFETY: `buf` and the file stay alive and untouched until `wait` dispatches the CQE
        // (or, when it fails, `buf` is kept out of the arena for good).
        unsafe { engine.push(RingKind::Main, id, 0, sqe) }?;
        buf = wait_for_read(&engine, buf)?;
        let u = t.elapsed().as_nanos() as f64;
        if let Some(r) = sink.0.get().filter(|r| *r < 0) {
            engine.unregister_file(file);
            return Err(CoreError::Sys {
                op: "probe io_uring read",
                source: std::io::Error::from_raw_os_error(-r),
            });
        }
        let off = next_offset();
        let t = Instant::now();
        // SAFETY: `buf` owns `read_len` writable bytes of the arena.
        unsafe { sys::pread_raw(direct.as_raw_fd(), buf.as_mut_ptr(), read_len as usize, off) }
            .map_err(|e| CoreError::Sys {
                op: "probe pread",
                source: e,
            })?;
        let p = t.elapsed().as_nanos() as f64;
        if i >= warmup {
            uring.push(u);
            pread.push(p);
        }
    }
    // Workers linger idle for seconds after their last request: still there to be counted.
    let io_wq_workers = io_wq_workers_of_this_thread();
    engine.unregister_file(file);
    Ok(PathLatency {
        uring_qd1_ns: median(&mut uring),
        pread_ns: median(&mut pread),
        samples,
        io_wq_workers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe read whose wait fails may still be in flight: its buffer must stay out of the
    /// arena (the probes dropped it, freeing frames the kernel could still write).
    /// More samples than a probe takes are refused before anything is opened or measured (the
    /// sample count plus the warm-up overflowed `u32`, and the sample vectors alone would have
    /// taken 32 GiB).
    #[test]
    fn too_many_latency_samples_are_refused() {
        let opts = ProbeOptions {
            latency_samples: u32::MAX,
            try_iopoll: false,
        };
        let e = probe(Path::new("/dev/null"), opts).unwrap_err();
        assert!(
            matches!(&e, CoreError::Config(m) if m.contains("at most")),
            "{e}"
        );
        let ok = ProbeOptions {
            latency_samples: MAX_LATENCY_SAMPLES,
            try_iopoll: false,
        };
        assert!(!matches!(
            probe(Path::new("/nonexistent-aios-probe"), ok),
            Err(CoreError::Config(_))
        ));
    }

    #[test]
    fn a_failed_wait_keeps_the_reads_buffer_out_of_the_arena() {
        let zero = std::fs::File::open("/dev/zero").unwrap();
        let engine = small_engine(false).unwrap();
        let sink = Rc::new(LastResult(Cell::new(None)));
        let id = engine
            .register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)
            .unwrap();
        let file = engine.register_file(zero.as_raw_fd()).unwrap();
        let frames = engine.arena().frames();
        let mut buf = engine.try_alloc(4096).unwrap();
        let sqe = engine::read_sqe(file, buf.as_mut_ptr(), 4096, 0, Some(0));
        // The push's enter fails, leaving the read queued, and so does the wait's.
        engine.fail_next_enters(2);
        // SAFETY: `buf` is kept (or leaked) by `wait_for_read`; the engine's drop waits for
        // the read.
        unsafe { engine.push(RingKind::Main, id, 0, sqe) }.unwrap();
        assert!(wait_for_read(&engine, buf).is_err());
        assert!(engine.has_work(), "the read is still out");
        assert_eq!(
            engine.arena().free_frames(),
            frames - 1,
            "the buffer of a read still out went back to the arena"
        );
        drop(engine);
        assert_eq!(
            sink.0.get(),
            Some(4096),
            "the engine's drop waited for the read"
        );
    }
}
