//! `aios`: probe devices, benchmark lbio against fio, and run the demo.
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Duration;

use aios::bench::compare::{
    check_write_allowed, choose_completion, plug_auto, run_comparison, Comparison, Contender,
    Progress,
};
use aios::bench::fio::{fio_version, FioEngine};
use aios::bench::report::{parse_bytes, plot_cdf, print_header, print_json, print_row};
use aios::bench::{check_seconds, BenchError, LbioRunOptions, Rw, Sample, Workload};
use aios::core::{probe, sys, CompletionMode, DeviceProbe, Engine, EngineConfig, ProbeOptions};
use aios::lbio::{Class, Device, DeviceConfig, LbioArray, LbioConfig, RouteChoice};
use aios::target::Target;
use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser)]
#[command(
    name = "aios",
    version,
    about = "An io_uring storage runtime for NVMe SSDs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a short lbio-vs-fio comparison and write a report (JSON + latency CDF plots).
    Demo(DemoArgs),
    /// Probe a device: alignment, max transfer, IOPOLL, and the fastest path per request class.
    Probe {
        /// Block device or file.
        path: PathBuf,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Latency samples per path for the inline-vs-punted measurement.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 300)]
        samples: u32,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Serve a device over NVMe/TCP as a Rio target (ordered writes with an attribute log).
    Target(TargetArgs),
    /// Make an empty aiosfs on an image file or block device.
    Mkfs(MkfsArgs),
    /// Mount an aiosfs image or device through FUSE (runs in the background unless
    /// --foreground; unmount with `umount MOUNTPOINT`, or SIGINT/SIGTERM to the process).
    Mount(MountArgs),
    /// Check an aiosfs image; exit 0 when clean, 4 when damaged, 8 when it is no aiosfs or
    /// cannot be read.
    Fsck {
        /// Image file or block device.
        image: PathBuf,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct MkfsArgs {
    /// Image file or block device.
    image: PathBuf,
    /// Create (or grow) the image file to this size first (e.g. 1g).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Journal areas, one per core that commits (default: this machine's cores).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    journals: Option<u32>,
    /// Blocks of 4 KiB per journal area, at least 32 (small images get less: a quarter of the
    /// image at most, and never under 32).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(32..))]
    journal_blocks: u64,
    /// One inode per this many bytes.
    #[arg(long, default_value = "16k", value_parser = parse_size)]
    bytes_per_inode: u64,
    /// Replace a file system already on the image.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct FsBenchArgs {
    /// Thread counts of the write + fsync workload.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',', default_value = "1,2")]
    threads: Vec<u32>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Rounds (the order of the two file systems alternates; medians are reported).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
    /// Workloads: randread, fsync, createsync, postmark (postmark only when installed),
    /// append (512-byte appends + fdatasync).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "randread,fsync,createsync,postmark"
    )]
    workloads: Vec<String>,
    /// How the mount's workers wait for I/O (see `aios mount --completion`; `hybrid`, the
    /// mount's default, spins up to 100 us per wait and then sleeps).
    #[arg(long, value_enum, default_value = "hybrid")]
    completion: MountCompletion,
    /// How the mount gets FUSE requests (see `aios mount --transport`).
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// The mount's commit mode (see `aios mount --commit`).
    #[arg(long, value_enum, default_value = "overlapped")]
    commit: CommitArg,
    /// The mount's page cache (see `aios mount --cache-size`; 0 for none).
    #[arg(long, default_value = "64m", value_parser = parse_size_or_zero)]
    cache_size: u64,
    /// Mount with the kernel's write-back cache (see `aios mount --writeback-cache`).
    #[arg(long)]
    writeback_cache: bool,
    /// Mount without extended attributes (see `aios mount --no-xattrs`).
    #[arg(long)]
    no_xattrs: bool,
    /// The mount's spin between requests (see `aios mount --request-spin-us`).
    #[arg(long, default_value_t = REQUEST_SPIN_US)]
    request_spin_us: u64,
    /// One JSON object per median instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    qos: QosArgs,
}

#[derive(Args)]
struct MountArgs {
    /// Image file or block device holding an aiosfs (see `aios mkfs`).
    image: PathBuf,
    /// Directory to mount it on.
    mountpoint: PathBuf,
    /// Stay in the foreground (logs to stderr); otherwise the file system runs as a background
    /// process logging to --log.
    #[arg(long, short = 'f')]
    foreground: bool,
    /// Worker threads, each with its own /dev/fuse clone and engine (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Log file of the background process (default: /var/tmp/aios-mount-<image name>.log).
    #[arg(long)]
    log: Option<PathBuf>,
    /// Commit mode of fsync's transactions. `rio`: Rio-ordered (data, journal and commit block
    /// sent together, ordered through the journal area's attribute log, one FLUSH at the end);
    /// each worker that gets a journal area of its own commits so, the others overlapped.
    /// `one-write`: the data journaled too, and the log blocks with the commit block in one write
    /// (one device round trip per fsync; recovery tells a torn commit by its checksum).
    #[arg(long, value_enum, default_value = "overlapped")]
    commit: CommitArg,
    /// How workers wait for I/O: `hybrid` spins on the completion queue for up to 100 us
    /// (yielding the CPU every few empty polls, so the device's own kernel work can run there)
    /// and then sleeps, so an I/O that a fast device answers in time costs no wake-up and each
    /// wait on a slow one at most 100 us of CPU; `wait` always sleeps in io_uring_enter; `poll`
    /// always spins (a busy core per waiting worker).
    #[arg(long, value_enum, default_value = "hybrid")]
    completion: MountCompletion,
    /// How FUSE requests arrive: `uring` uses the kernel's per-CPU io_uring queues (Linux
    /// 6.14+ with `fuse.enable_uring`; fewer system calls and cross-CPU wakeups), `classic`
    /// reads /dev/fuse, `auto` takes io_uring when the kernel offers it and says so.
    #[arg(long, value_enum, default_value = "auto")]
    transport: TransportArg,
    /// Page cache for clean file data, shared by all workers (`0` for none: every read of data
    /// not written since the last commit goes to the device). Reads of files opened
    /// `O_DIRECT` bypass it.
    #[arg(long, default_value = "64m", value_parser = parse_size_or_zero)]
    cache_size: u64,
    /// Ask the kernel for its write-back cache: small writes collect in the kernel's page cache
    /// and reach aiosfs in larger requests (at fsync, close or the kernel's write-back), not one
    /// request per write. fsync still makes them durable before it returns.
    #[arg(long)]
    writeback_cache: bool,
    /// Answer extended-attribute requests ENOSYS: the kernel then sends none and tells
    /// programs the file system has no xattrs (EOPNOTSUPP). This saves a round trip per file
    /// written, the kernel's look for `security.capability` before a first write. Attributes
    /// already on the image are kept for a mount without this flag.
    #[arg(long)]
    no_xattrs: bool,
    /// FUSE over io_uring: microseconds a queue thread spins on its queue for the next request
    /// before it sleeps (yielding the CPU every few empty looks). A request that comes in time
    /// costs no wake-up of the file system's thread; an idle mount spends at most this much CPU
    /// per queue after its last request. 0: sleep at once. The /dev/fuse transport always sleeps.
    #[arg(long, default_value_t = REQUEST_SPIN_US)]
    request_spin_us: u64,
}

/// `--request-spin-us`' default (`fs_fuse::REQUEST_SPIN` says what it was measured against).
const REQUEST_SPIN_US: u64 = fs_fuse::REQUEST_SPIN.as_micros() as u64;

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    Auto,
    Uring,
    Classic,
}

impl TransportArg {
    fn name(self) -> &'static str {
        match self {
            TransportArg::Auto => "auto",
            TransportArg::Uring => "uring",
            TransportArg::Classic => "classic",
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum MountCompletion {
    Wait,
    Poll,
    Hybrid,
}

impl MountCompletion {
    fn name(self) -> &'static str {
        self.mode().name()
    }
    fn mode(self) -> CompletionMode {
        match self {
            MountCompletion::Wait => CompletionMode::Wait,
            MountCompletion::Poll => CompletionMode::BusyPoll,
            MountCompletion::Hybrid => CompletionMode::hybrid(),
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum CommitArg {
    Overlapped,
    Vanilla,
    Rio,
    #[value(name = "one-write")]
    OneWrite,
}

impl CommitArg {
    fn name(self) -> &'static str {
        match self {
            CommitArg::Overlapped => "overlapped",
            CommitArg::Vanilla => "vanilla",
            CommitArg::Rio => "rio",
            CommitArg::OneWrite => "one-write",
        }
    }
}

#[derive(Args)]
struct TargetArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:4420")]
    listen: std::net::SocketAddr,
    /// Block device or file served as namespace 1 (its contents are the volume's: written).
    #[arg(long)]
    device: PathBuf,
    /// Where the attribute log lives: `mem` (emulated persistent memory in RAM: lost with the
    /// process), `file:PATH` (emulated in a file: survives the process), or `nvme:/dev/nvmeX`
    /// (the controller's persistent memory region).
    #[arg(long, default_value = "mem")]
    attr_log: String,
    /// Bytes of the attribute log (mem and file; Rio uses 2 MiB per target).
    #[arg(long, default_value = "2m", value_parser = parse_size)]
    log_bytes: u64,
    /// Streams the log serves (initiators may use fewer), 1 to 64.
    #[arg(long, default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..=aios::rio::MAX_STREAMS as i64))]
    streams: u16,
    /// Format the log even when it holds one (its entries are lost; without this a log found at
    /// start is kept for the initiator's recovery).
    #[arg(long)]
    format: bool,
    /// Serve only this many bytes of the device (whole 4 KiB blocks, at most the device's size).
    #[arg(long, value_parser = parse_size)]
    ns_bytes: Option<u64>,
    /// Subsystem NQN.
    #[arg(long, default_value = "nqn.2026-11.io.aios:target")]
    subnqn: String,
    /// Write data taken inside the command capsule (larger writes' data follows an R2T);
    /// 0 makes every write use R2T.
    #[arg(long, default_value = "128k", value_parser = parse_size_or_zero)]
    in_capsule: u64,
    /// Connections served at once (admin and I/O queues alike; a Linux host opens one I/O
    /// queue per CPU): one more is closed when accepted, and logged, until one ends.
    #[arg(long, default_value_t = aios::rio_net::target::DEFAULT_MAX_CONNECTIONS as u64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    max_connections: u64,
    /// One line per connection opened and closed.
    #[arg(long)]
    verbose: bool,
    /// `tcp`, or `rdma` (a build with `--features rdma`; --listen is then the IPv4 address of
    /// an RDMA-capable interface, such as a Soft-RoCE device's netdev).
    #[arg(long, default_value = "tcp")]
    transport: rio_net::Transport,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// lbio on a device, optionally side by side with fio.
    Lbio(LbioArgs),
    /// The page cache's read path (cold misses, hits, submission latency) beside the kernel's
    /// page cache, O_DIRECT pread and raw lbio.
    Pagecache(PagecacheArgs),
    /// A 4 KiB write made durable: the journal's vanilla and overlapped commit beside ext4's
    /// pwrite + fsync on the same kind of device.
    Fsync(FsyncArgs),
    /// aiosfs through FUSE beside ext4, each on its own ull device: 4 KiB random reads at QD1
    /// (O_DIRECT), 4 KiB write + fsync at 1..N threads, file create + fsync, postmark.
    Fs(FsBenchArgs),
    /// Ordered 4 KiB writes: Rio's ordered device against synchronous ordering (write, wait,
    /// FLUSH) and orderless writes.
    Ordered(OrderedArgs),
    /// Per-core scaling: 1..N threads, each with its own engine, lbio array and device, beside
    /// fio with one job per thread on the same devices.
    Scale(ScaleArgs),
}

#[derive(Args)]
struct ScaleArgs {
    /// `ull` (one loop device over /dev/shm per thread, created and removed; needs root), `mem`
    /// (RAM behind lbio's MemBackend, one per thread, written before the run: no device, only
    /// the engines and the 4 KiB copies to and from that memory), or
    /// devices or files separated by commas (thread t uses the (t mod n)-th; a missing file is
    /// created with --size and removed afterwards; no empty names, and `ull` and `mem` only alone).
    #[arg(long, default_value = "ull")]
    device: String,
    /// Thread counts (default: 1, 2, 4, ... up to the CPUs there are, and that number).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',')]
    threads: Vec<u32>,
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Block size (4k, 64k, 1m, ...).
    #[arg(long, default_value = "4k", value_parser = parse_bytes)]
    bs: u32,
    /// Queue depth per thread.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 32)]
    qd: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Rounds (thread counts and fio alternate in rotating order; figures are medians).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
    /// Also run fio (io_uring, fixedbufs, registerfiles) with one job per thread on the same
    /// devices, and report ours ÷ fio.
    #[arg(long)]
    vs_fio: bool,
    /// How each thread waits for its completions (`auto`: sleep; busy-polling threads would
    /// take the CPUs the devices' kernel workers need once threads approach the CPU count).
    #[arg(long, value_enum, default_value = "auto")]
    completion: CompletionArg,
    /// Pin thread t to CPU t (mod the CPU count).
    #[arg(long)]
    pin: bool,
    /// Size of each ull device, mem device or created file.
    #[arg(long, default_value = "1g", value_parser = parse_size)]
    size: u64,
    /// Allow write workloads on existing devices or files (their data is overwritten).
    #[arg(long)]
    destructive: bool,
    /// lbio request slots per thread.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=aios::lbio::MAX_SLOTS as i64), default_value_t = 256)]
    slots: u32,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Write a plot of IOPS against threads (PNG or SVG by extension).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Milliseconds of idle before every timed run.
    #[arg(long, default_value_t = DEFAULT_SETTLE_MS, value_name = "MS")]
    settle_ms: u64,
    #[command(flatten)]
    qos: QosArgs,
}

#[derive(Args)]
struct OrderedArgs {
    /// `ull` (a loop device over /dev/shm, created and removed; needs root), `sim` (a SimDisk
    /// per stream without power-loss protection: throughput in simulated device time), or a
    /// block device or file (overwritten: --destructive when it existed before). Not with
    /// --targets; not `mem` (`sim` is the RAM stand-in).
    #[arg(long, default_value = "ull", conflicts_with = "targets")]
    device: String,
    /// Stream counts (a thread per stream).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',', default_value = "1,2")]
    streams: Vec<u32>,
    /// ORDER-queue batch sizes for rio (groups held and merged before sending).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',', default_value = "1")]
    batch: Vec<u32>,
    /// Modes to run.
    #[arg(long, value_delimiter = ',', default_value = "rio,sync,orderless")]
    modes: Vec<aios::bench::ordered::OrderedMode>,
    /// Rio's attribute log: `pmr` (persistent memory, emulated in RAM) and/or `block` (blocks at
    /// the end of the device, written with FUA ahead of each batch's data; not on sim). Not
    /// with --targets (each target keeps its own log: `aios target --attr-log`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pmr",
        conflicts_with = "targets"
    )]
    log: Vec<aios::bench::ordered::LogKind>,
    /// Writes in flight per stream (rio, orderless).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 32)]
    qd: u32,
    /// Sequential writes (each stream in its own region) instead of random ones.
    #[arg(long)]
    seq: bool,
    /// Seconds per run (device paths).
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Run over the network instead: a volume striped over these Rio targets (`ADDR,ADDR…`,
    /// each an `aios target`), or `netns:N` to start N targets in network namespaces of their
    /// own on this machine (root; their CPU time is reported too). --device, --log,
    /// --sim-writes, --flush-ahead and --destructive are for the local device and refused here.
    #[arg(long)]
    targets: Option<String>,
    /// Over the network: the volume's stripe unit (a multiple of 4 KiB). Groups merge only
    /// within one target's stripe, so sequential runs with --batch above 1 want a large one.
    /// [default: 4k] (only with --targets)
    #[arg(long, value_parser = parse_size)]
    stripe: Option<u64>,
    /// Writes per stream per run on `sim`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), default_value_t = 20_000, conflicts_with = "targets")]
    sim_writes: u64,
    /// Rounds (alternating order; figures are medians).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
    /// Rio: send a background FLUSH once this many completed writes wait for one (0: only
    /// `wait` and a full log FLUSH). Capped at half the attribute log's slots. Not with
    /// --targets.
    #[arg(long, default_value_t = aios::rio::OrderedConfig::default().flush_ahead, conflicts_with = "targets")]
    flush_ahead: usize,
    /// Size of a file the bench creates (when --device names a path that does not exist).
    #[arg(long, default_value = "256m", value_parser = parse_size)]
    size: u64,
    /// Allow overwriting an existing device or file.
    #[arg(long, conflicts_with = "targets")]
    destructive: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    qos: QosArgs,
}

#[derive(Args)]
struct FsyncArgs {
    /// `ull` (two loop devices over /dev/shm: one for the journal, one made ext4; needs root),
    /// or a block device or file the journal modes may overwrite (with --destructive when it
    /// existed before). Not `mem` (durability is a device's).
    #[arg(long, default_value = "ull")]
    device: String,
    /// A directory on an ext4 file system for the ext4 mode when --device is not `ull`.
    #[arg(long)]
    ext4_dir: Option<PathBuf>,
    /// Thread counts (each thread: its own engine, journal area and file).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',', default_value = "1")]
    threads: Vec<u32>,
    /// Journal areas (default: one per thread, per-core journals). Fewer areas than threads:
    /// threads share them and concurrent commits form groups (group commit).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    areas: Option<u32>,
    /// Turn group commit off (threads sharing an area then commit one after another).
    #[arg(long)]
    no_group_commit: bool,
    /// How the journal makes data and journal blocks durable before the commit block: `auto`
    /// (what it measures on the device: FUA writes when one costs less than a write plus a
    /// FLUSH), `flush` (plain writes, then a FLUSH) or `fua` (every block written with FUA).
    #[arg(long, default_value = "auto", value_parser = parse_durability)]
    durability: DurabilityArg,
    /// Modes to run.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "vanilla,overlapped,one-write,ext4,ext4-meta"
    )]
    modes: Vec<aios::bench::fsync::FsyncMode>,
    /// Seconds per run.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Rounds (the order alternates from round to round; figures are medians over rounds).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
    /// Size of a file the bench creates (when --device names a path that does not exist).
    #[arg(long, default_value = "256m", value_parser = parse_size)]
    size: u64,
    /// Allow overwriting an existing device or file named by --device.
    #[arg(long)]
    destructive: bool,
    /// With --device ull: declare both loop devices free of a volatile write cache ("write
    /// through"), like a ULL SSD with power-loss protection: FLUSH becomes free for ext4 and is
    /// skipped by the journal.
    #[arg(long)]
    plp: bool,
    /// How the journal threads wait for their I/O (ext4's threads sleep in the kernel).
    #[arg(long, value_enum, default_value_t = PcCompletionArg::Auto)]
    completion: PcCompletionArg,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Where the latency CDF plot goes (PNG and SVG).
    #[arg(long, default_value = "aios-report")]
    out: PathBuf,
    #[command(flatten)]
    qos: QosArgs,
}

#[derive(Args)]
struct PagecacheArgs {
    /// `ull` (a loop device over /dev/shm, created and removed by the bench; needs root), an
    /// existing block device or file, or a new file path (created with --size, then removed).
    /// Not `mem` (the kernel's page cache needs a device or file).
    #[arg(long, default_value = "ull")]
    device: String,
    /// Block sizes of the cold random reads.
    #[arg(long, value_delimiter = ',', default_value = "4k,128k", value_parser = parse_bytes)]
    bs: Vec<u32>,
    /// Thread counts (each thread: its own engine, lbio array and cache handle; one cache).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), value_delimiter = ',', default_value = "1,2")]
    threads: Vec<u32>,
    /// Page-cache modes for the cold reads: aios, vanilla, and the ablation steps between
    /// (fixed, fixed+pool, pool, pool+lazy, lazy, fixed+lazy).
    #[arg(long, value_delimiter = ',', default_value = "vanilla,fixed,fixed+pool,aios", value_parser = parse_mode)]
    modes: Vec<aios::pagecache::Mode>,
    /// Skip the hit workloads.
    #[arg(long)]
    no_hits: bool,
    /// Skip the cold workloads (and the submission-latency figures they give).
    #[arg(long, conflicts_with = "no_hits")]
    no_cold: bool,
    /// Seconds per run.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Rounds (runs alternate order from round to round; figures are medians over rounds).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
    /// Capacity of the page cache under test for cold reads.
    #[arg(long, default_value = "64m", value_parser = parse_size)]
    cache: u64,
    /// Hot-set sizes of the hit workloads. The defaults: one that fits in a core's L2, one a
    /// little larger than it, one well beyond it. Past the L2 a copy-out hit is bound by the
    /// 4 KiB copy itself, for the kernel's page cache as much as for this one: the `copy` row (the
    /// cache's own copy routine from a buffer of the hot set's size, no lookup) is that floor, and
    /// the `memcpy` row the platform's copy, both measured in the same run.
    #[arg(long, value_delimiter = ',', default_value = "1m,4m,32m", value_parser = parse_size)]
    hot: Vec<u64>,
    /// Size of a file the bench creates (when --device names a path that does not exist).
    #[arg(long, default_value = "1g", value_parser = parse_size)]
    size: u64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// How each reader's thread waits for its completions (raw lbio and the cache alike).
    #[arg(long, value_enum, default_value_t = PcCompletionArg::Auto)]
    completion: PcCompletionArg,
    /// Where the CDF plots go (PNG and SVG).
    #[arg(long, default_value = "aios-report")]
    out: PathBuf,
    #[command(flatten)]
    qos: QosArgs,
}

#[derive(Clone, Copy, ValueEnum)]
enum PcCompletionArg {
    /// Busy-poll (yielding after a few empty polls) up to one thread per CPU; with more threads
    /// than CPUs, spin up to 100 us per wait and then sleep (`hybrid`).
    Auto,
    /// Sleep in io_uring_enter until the completion arrives.
    Wait,
    /// Spin on the completion queue.
    Poll,
    /// Spin (yielding after a few empty polls) for up to 100 us per wait, then sleep.
    Hybrid,
}

impl PcCompletionArg {
    /// The mode asked for; `None`: the bench's own choice.
    fn mode(self) -> Option<CompletionMode> {
        match self {
            PcCompletionArg::Auto => None,
            PcCompletionArg::Wait => Some(CompletionMode::Wait),
            PcCompletionArg::Poll => Some(CompletionMode::BusyPoll),
            PcCompletionArg::Hybrid => Some(CompletionMode::hybrid()),
        }
    }
}

#[derive(Clone, Copy)]
struct DurabilityArg(Option<aios::journal::Durability>);

fn parse_durability(s: &str) -> Result<DurabilityArg, String> {
    use aios::journal::Durability;
    match s {
        "auto" => Ok(DurabilityArg(None)),
        "flush" => Ok(DurabilityArg(Some(Durability::Flush))),
        "fua" => Ok(DurabilityArg(Some(Durability::FuaWrites))),
        other => Err(format!(
            "unknown durability '{other}' (one of: auto, flush, fua)"
        )),
    }
}

fn parse_mode(s: &str) -> Result<aios::pagecache::Mode, String> {
    use aios::pagecache::Mode;
    let all = [
        Mode::AIOS,
        Mode::VANILLA,
        Mode::FIXED,
        Mode::FIXED_POOL,
        Mode {
            pool: true,
            lazy_index: true,
            fixed: false,
        },
        Mode {
            pool: true,
            lazy_index: false,
            fixed: false,
        },
        Mode {
            pool: false,
            lazy_index: true,
            fixed: true,
        },
        Mode {
            pool: false,
            lazy_index: true,
            fixed: false,
        },
    ];
    all.into_iter()
        .find(|m| m.name() == s.trim())
        .ok_or_else(|| {
            let names: Vec<&str> = all.iter().map(|m| m.name()).collect();
            format!("unknown mode '{s}' (one of: {})", names.join(", "))
        })
}

#[derive(Clone, Copy, ValueEnum)]
enum RouteArg {
    Auto,
    Ring,
    Sync,
}

#[derive(Clone, Copy, ValueEnum)]
enum ClassArg {
    Critical,
    Background,
}

/// `bench lbio --completion auto`: alternating short runs of each mode before the bench.
const COMPLETION_CALIBRATION_ROUNDS: u32 = 4;
const COMPLETION_CALIBRATION_SECONDS: f64 = 0.15;
/// Idle before each timed run of a comparison (`--settle-ms`).
const DEFAULT_SETTLE_MS: u64 = 250;

#[derive(Clone, Copy, ValueEnum)]
enum CompletionArg {
    /// The bench's own choice. `bench lbio`: for critical requests, measure busy-polling and
    /// sleeping on the device at the run's queue depth first (four alternating 0.15 s runs of
    /// each) and use the faster (above QD1, polling only when it is more than 5% faster: it
    /// keeps a core busy); background requests sleep. `bench scale`: sleep.
    Auto,
    /// Sleep in io_uring_enter until completions arrive.
    Wait,
    /// Spin on the completion queue (no wake-up latency; burns the core while waiting).
    Poll,
    /// Spin (yielding after a few empty polls) for up to 100 us per wait, then sleep.
    Hybrid,
}

#[derive(Clone, Copy, ValueEnum)]
enum PlugArg {
    /// Plug at QD1 when busy-polling or spinning first (the submission rides on the first
    /// poll's io_uring_enter); a sleeping caller submits at once and then waits: on the `ull`
    /// device, each of 8 alternating pairs of 2-second sleeping runs had the lower mean that
    /// way, by 1.5-12.8 us. Above QD1 submit at once (on the loop device a plugged batch leaves the fast inline path;
    /// measured).
    Auto,
    On,
    Off,
}

#[derive(Args)]
struct LbioArgs {
    /// `ull` (a loop device over /dev/shm, created and removed by the bench; needs root), an
    /// existing block device or file, or a new file path (created with --size, then removed).
    /// Not `mem`: lbio on RAM is `aios bench scale --device mem`.
    #[arg(long, default_value = "ull")]
    device: String,
    #[arg(long, value_enum, default_value = "randread")]
    rw: Rw,
    /// Block size (4k, 64k, 1m, ...).
    #[arg(long, default_value = "4k", value_parser = parse_bytes)]
    bs: u32,
    /// Queue depth (requests in flight).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 1)]
    qd: u32,
    /// Seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Rounds (default 1, or 5 with --vs-fio).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: Option<u32>,
    /// Also run fio (io_uring with fixedbufs+registerfiles, and psync at QD1) in alternating
    /// rounds and report ours ÷ fio.
    #[arg(long)]
    vs_fio: bool,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Route for critical requests (auto = what the probe measured fastest).
    #[arg(long, value_enum, default_value = "auto")]
    route: RouteArg,
    /// Request class.
    #[arg(long, value_enum, default_value = "critical")]
    class: ClassArg,
    /// How to wait for completions.
    #[arg(long, value_enum, default_value = "auto")]
    completion: CompletionArg,
    /// Whether lbio holds submissions until it waits (plugging).
    #[arg(long, value_enum, default_value = "auto")]
    plug: PlugArg,
    /// Size of a file the bench creates (when --device names a path that does not exist).
    #[arg(long, default_value = "256m", value_parser = parse_size)]
    size: u64,
    /// Bytes of the device the offsets cover (default: all of it).
    #[arg(long, value_parser = parse_size)]
    span: Option<u64>,
    /// Allow write workloads on an existing device or file (its data is overwritten).
    #[arg(long)]
    destructive: bool,
    /// lbio request slots.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=aios::lbio::MAX_SLOTS as i64), default_value_t = 1024)]
    slots: u32,
    /// Write a latency CDF plot (PNG or SVG by extension) of the median runs.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Complete critical requests on an IOPOLL ring (the device needs poll queues, e.g. NVMe
    /// with nvme.poll_queues=N; the route reports why when it cannot be used).
    #[arg(long)]
    iopoll: bool,
    /// Milliseconds of idle before every timed run, lbio's and each fio run's alike, and before
    /// each completion-mode calibration sample: each starts from an idle machine, not on the
    /// heels of the work before it (on one of the VMs this was built on, a QD1 reader that
    /// starts right after CPU-heavy work stayed 3-6x slower for the whole run; see
    /// docs/lbio-qd1-history.md). 0: none.
    #[arg(long, default_value_t = DEFAULT_SETTLE_MS, value_name = "MS")]
    settle_ms: u64,
    #[command(flatten)]
    qos: QosArgs,
}

/// The machine's idle policy during a bench.
#[derive(Args, Clone, Copy, Default)]
struct QosArgs {
    /// Hold a PM QoS request on CPU wake-up latency (/dev/cpu_dma_latency) of US microseconds
    /// for the whole run, every contender's rounds alike: with 0, idle CPUs poll instead of
    /// halting, so a thread woken on one runs at once (needs root). Default: the machine's own
    /// idle policy.
    #[arg(long, value_name = "US")]
    cpu_latency_us: Option<u32>,
}

/// Take the PM QoS request `q` asks for (held until the value drops), and say what it does on
/// this machine.
fn hold_cpu_latency(q: QosArgs) -> Result<Option<sys::CpuLatencyRequest>, BenchError> {
    let Some(us) = q.cpu_latency_us else {
        // A KVM guest whose idle vCPUs halt at once: how soon the device's kernel thread runs
        // on one is up to the hypervisor, and QD1 latencies can move between runs with it.
        if sys::guest_halt_poll_ns() == Some(0) {
            eprintln!(
                "cpu latency: the machine's own idle policy (haltpoll guest, guest_halt_poll_ns 0: an idle vCPU halts at once, and waking it is up to the hypervisor, so QD1 latencies may shift between runs); --cpu-latency-us 0 keeps idle CPUs polling, every contender alike"
            );
        }
        return Ok(None);
    };
    let r = sys::CpuLatencyRequest::new(us)
        .map_err(|e| BenchError::Setup(format!("--cpu-latency-us {us}: {e}")))?;
    let in_force = sys::CpuLatencyRequest::effective_us()
        .map_or_else(|e| format!("unreadable: {e}"), |v| format!("{v} µs"));
    let (usable, kept_out): (Vec<_>, Vec<_>) =
        sys::cpuidle_states().into_iter().partition(|s| s.1 <= us);
    eprintln!(
        "cpu latency: PM QoS request of {us} µs held for the whole run, every contender alike (in force: {in_force}); cpuidle driver {}: idle CPUs may use {}, not {}",
        cpuidle_driver_name(),
        idle_states_list(&usable),
        idle_states_list(&kept_out),
    );
    Ok(Some(r))
}

#[derive(Args)]
struct DemoArgs {
    /// Where the report goes.
    #[arg(long, default_value = "aios-report")]
    out: PathBuf,
    /// Seconds per run.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// Rounds per comparison.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 3)]
    rounds: u32,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (n, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t.as_str(), 1),
    };
    n.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("'{s}' is not a size like 256m or 1g"))
}

/// [`parse_size`], or `0` (turns the thing off).
fn parse_size_or_zero(s: &str) -> Result<u64, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_size(s)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Fsck { image, json } => return cmd_fsck(&image, json),
        Cmd::Mkfs(a) => cmd_mkfs(a),
        Cmd::Mount(a) => cmd_mount(a),
        Cmd::Probe {
            path,
            json,
            samples,
        } => cmd_probe(&path, json, samples),
        Cmd::Bench(BenchCmd::Lbio(a)) => cmd_bench_lbio(a),
        Cmd::Bench(BenchCmd::Pagecache(a)) => cmd_bench_pagecache(a),
        Cmd::Bench(BenchCmd::Fsync(a)) => cmd_bench_fsync(a),
        Cmd::Bench(BenchCmd::Fs(a)) => cmd_bench_fs(a),
        Cmd::Bench(BenchCmd::Ordered(a)) => cmd_bench_ordered(a),
        Cmd::Bench(BenchCmd::Scale(a)) => cmd_bench_scale(a),
        Cmd::Demo(a) => cmd_demo(a),
        Cmd::Target(a) => cmd_target(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("aios: {e}");
            ExitCode::FAILURE
        }
    }
}

fn cmd_mkfs(a: MkfsArgs) -> Result<(), BenchError> {
    // Not even with --force: mkfs under a live file system leaves it serving blocks that are
    // no longer its own.
    let then = "unmount it (or stop that process) first";
    refuse_image_in_use(&a.image, then)?;
    // `fs_fuse::mkfs` takes the image's lock, and a mount holds it: probed here as well, so
    // that `--size` does not grow an image a mount is serving before mkfs refuses it.
    if a.image.exists() {
        drop(fs_fuse::ImageLock::exclusive(&a.image).map_err(|e| image_error(e, then))?);
    }
    // A file `--size` creates is removed again when mkfs fails.
    let mut created = None;
    if let Some(size) = a.size {
        let existed = a.image.exists();
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&a.image)
            .map_err(|e| BenchError::Setup(about(&a.image, e)))?;
        if !existed {
            created = Some(aios::bench::cleanup::remove_file(
                "the image file mkfs created",
                &a.image,
            ));
        }
        let len = f.metadata().map_err(io_err)?.len();
        if len < size {
            f.set_len(size)
                .map_err(|e| BenchError::Setup(about(&a.image, e)))?;
        }
    }
    let mut opts = fs_fuse::MkfsOptions {
        journal_blocks: a.journal_blocks,
        bytes_per_inode: a.bytes_per_inode,
        force: a.force,
        ..fs_fuse::MkfsOptions::default()
    };
    if let Some(j) = a.journals {
        opts.journals = j;
    }
    let sb = fs_fuse::mkfs(&a.image, &opts).map_err(|e| image_error(e, then))?;
    // Made: keep the file.
    if let Some(undo) = created {
        undo.cancel();
    }
    println!(
        "aiosfs on {}: {} blocks of 4 KiB ({} MiB), {} inodes, {} journal areas of {} blocks, data from block {}",
        a.image.display(),
        sb.blocks,
        (sb.blocks * 4096) >> 20,
        sb.inodes,
        sb.journal_areas,
        sb.journal_blocks,
        sb.data.start
    );
    Ok(())
}

fn cmd_bench_fs(a: FsBenchArgs) -> Result<(), BenchError> {
    use aios::bench::fsbench::{medians, FsBench, FsBenchSetup};
    let _qos = hold_cpu_latency(a.qos)?;
    check_seconds(a.seconds)?;
    check_mount_cache(a.cache_size)?;
    const KNOWN: [&str; 5] = ["randread", "fsync", "createsync", "postmark", "append"];
    if let Some(w) = a.workloads.iter().find(|w| !KNOWN.contains(&w.as_str())) {
        return Err(BenchError::Invalid(format!(
            "--workloads {w}: not a workload (they are {})",
            KNOWN.join(", ")
        )));
    }
    if fio_version().is_none() {
        return Err(BenchError::Setup(
            "aios bench fs runs fio: install it (apt-get install fio)".into(),
        ));
    }
    let mut workloads = a.workloads.clone();
    if workloads.iter().any(|w| w == "postmark") && !aios::bench::fsbench::postmark_installed() {
        eprintln!("postmark is not installed (apt-get install postmark): skipping it");
        workloads.retain(|w| w != "postmark");
    }
    let exe = std::env::current_exe().map_err(io_err)?;
    let completion = a.completion.name();
    let cache = a.cache_size.to_string();
    let spin = a.request_spin_us.to_string();
    let mut mount_args = vec![
        "--completion",
        completion,
        "--transport",
        a.transport.name(),
        "--commit",
        a.commit.name(),
        "--cache-size",
        &cache,
        "--request-spin-us",
        &spin,
    ];
    if a.writeback_cache {
        mount_args.push("--writeback-cache");
    }
    if a.no_xattrs {
        mount_args.push("--no-xattrs");
    }
    let setup = FsBenchSetup::ull(&exe, &mount_args)?;
    eprintln!("{}", setup.aios.log_line);
    eprintln!(
        "ext4 on the other ull device: mkfs.ext4 defaults (ordered data, barriers), mounted at {}",
        setup.ext4.dir().display()
    );
    let bench = FsBench {
        threads: a.threads.clone(),
        seconds: a.seconds,
        rounds: a.rounds,
        workloads,
    };
    let mut progress = |s: &aios::bench::fsbench::FsSample| {
        if !a.json {
            eprintln!(
                "  {:<10} {:>2} thr {:<6} {:>10.0} ops/s  mean {:>8.1} us",
                s.workload, s.threads, s.fs, s.ops_per_sec, s.mean_us
            );
        }
    };
    let samples = bench.run(setup.aios.dir(), setup.ext4.dir(), &mut progress)?;
    let meds = medians(&samples);
    if a.json {
        for m in &meds {
            println!(
                "{}",
                serde_json::to_string(m).map_err(|e| BenchError::Parse(e.to_string()))?
            );
        }
        return Ok(());
    }
    println!(
        "\nmedians over {} rounds of {} s; ratio = aiosfs / ext4",
        a.rounds, a.seconds
    );
    aios::bench::fsbench::print_table(&mut std::io::stdout(), &meds).map_err(io_err)?;
    Ok(())
}

fn is_mounted(mountpoint: &Path) -> bool {
    mounted_type(mountpoint).is_some_and(|t| t.starts_with("fuse"))
}

/// The type of the file system mounted on `mountpoint` (the one on top), if one is.
fn mounted_type(mountpoint: &Path) -> Option<String> {
    let canon = mountpoint.canonicalize().ok()?;
    let want = canon.to_string_lossy().replace(' ', "\\040");
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let (_, mp, ty) = (f.next(), f.next(), f.next());
            (mp == Some(want.as_str())).then(|| ty.unwrap_or("").to_string())
        })
        .next_back()
}

/// Processes other than this one that hold `image` open for writing (a serving `aios mount`,
/// an `aios target`, a bench): each one's id and command line, read from /proc (a process
/// this user cannot look into is passed over; root sees them all). A block device is matched
/// by its device number, whatever node names it.
fn writers_of(image: &Path) -> Vec<(u32, String)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(want) = std::fs::metadata(image) else {
        return Vec::new();
    };
    let block = want.file_type().is_block_device();
    let same = |m: &std::fs::Metadata| {
        if block {
            m.file_type().is_block_device() && m.rdev() == want.rdev()
        } else {
            m.dev() == want.dev() && m.ino() == want.ino()
        }
    };
    // fdinfo's `flags:` are octal; the low two bits are the access mode (0: read only).
    let writable = |info: &Path| {
        std::fs::read_to_string(info).is_ok_and(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| u32::from_str_radix(f.trim(), 8).ok())
                .is_some_and(|f| f & 3 != 0)
        })
    };
    let me = std::process::id();
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return found;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let writes = fds.flatten().any(|fd| {
            std::fs::metadata(fd.path()).is_ok_and(|m| same(&m))
                && writable(&p.path().join("fdinfo").join(fd.file_name()))
        });
        if writes {
            found.push((pid, cmdline_of(pid)));
        }
    }
    found
}

/// Process `pid`'s command line, its arguments joined by spaces (empty where /proc does not
/// show it).
fn cmdline_of(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\0')
                .filter(|a| !a.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Refuse `image` when another process has it open for writing (`then` says what to do):
/// a second mount of an image, or mkfs under a live one, writes over the file system that
/// process is serving. Read from /proc, so not atomic: two mounts started at the same instant
/// both pass it. The image's lock ([`fs_fuse::ImageLock`], taken by `fs_fuse::mount` and
/// `fs_fuse::mkfs`) is what keeps those apart; this check stays for writers that take no lock
/// (`aios target`, a bench), and names the process.
fn refuse_image_in_use(image: &Path, then: &str) -> Result<(), BenchError> {
    match writers_of(image).first() {
        Some((pid, cmd)) => Err(BenchError::Invalid(format!(
            "{}: in use, open for writing by process {pid} ({cmd}); {then}",
            image.display()
        ))),
        None => Ok(()),
    }
}

/// `e` as this command reports it: a held image lock ([`fs_fuse::FsError::InUse`]) names the
/// holding process and its command line where /proc shows them, and says what to do (`then`).
fn image_error(e: fs_fuse::FsError, then: &str) -> BenchError {
    match e {
        fs_fuse::FsError::InUse { image, holder } => {
            let by = match holder {
                Some(pid) => format!("process {pid} ({})", cmdline_of(pid)),
                None => "another aiosfs mount or mkfs".to_string(),
            };
            BenchError::Invalid(format!("{image}: in use, locked by {by}; {then}"))
        }
        e => BenchError::Setup(e.to_string()),
    }
}

/// The smallest page cache a mount takes (two 4 KiB frames: one pool batch per handle).
const MIN_MOUNT_CACHE: u64 = 8 << 10;

/// `--cache-size`: 0 (none) or at least [`MIN_MOUNT_CACHE`]. Checked before the mount starts,
/// so the error comes before a background file system or a bench's devices are set up (the
/// file system itself refuses such a cache before it writes anything).
fn check_mount_cache(bytes: u64) -> Result<(), BenchError> {
    if bytes > 0 && bytes < MIN_MOUNT_CACHE {
        return Err(BenchError::Invalid(format!(
            "--cache-size {bytes}: at least 8k (two 4 KiB pages), or 0 for no page cache"
        )));
    }
    Ok(())
}

fn cmd_mount(a: MountArgs) -> Result<(), BenchError> {
    if a.threads == Some(0) {
        return Err(BenchError::Invalid(
            "--threads 0: at least one worker".into(),
        ));
    }
    check_mount_cache(a.cache_size)?;
    // Both paths are checked here, before a background file system and its log exist, each
    // error naming the path it is about.
    let meta = std::fs::metadata(&a.image).map_err(|e| BenchError::Setup(about(&a.image, e)))?;
    if meta.is_dir() {
        return Err(BenchError::Invalid(format!(
            "{}: a directory, not an image file or block device",
            a.image.display()
        )));
    }
    match std::fs::metadata(&a.mountpoint) {
        Ok(m) if m.is_dir() => {
            // The wait for the background mount below looks for a FUSE mount there: one that
            // was there first read as this one, and the new mount hid the old one's files.
            if let Some(ty) = mounted_type(&a.mountpoint) {
                return Err(BenchError::Invalid(format!(
                    "mountpoint {}: already a mount point ({ty}); unmount it first or choose another directory",
                    a.mountpoint.display()
                )));
            }
        }
        Ok(_) => {
            return Err(BenchError::Invalid(format!(
                "mountpoint {}: not a directory",
                a.mountpoint.display()
            )))
        }
        Err(e) => {
            return Err(BenchError::Setup(format!(
                "mountpoint {}: {e}",
                a.mountpoint.display()
            )))
        }
    }
    let then =
        "two file systems writing one image destroy it: unmount it (or stop that process) first";
    refuse_image_in_use(&a.image, then)?;
    // The image's lock is what keeps a second mount out (`fs_fuse::mount` takes it and holds it
    // while the file system runs; of two mounts started together one gets it). Taken and let go
    // here too, so that a locked image is refused before a background file system and its log
    // exist.
    drop(fs_fuse::ImageLock::exclusive(&a.image).map_err(|e| image_error(e, then))?);
    if !a.foreground {
        // The file system runs as a child in its own process group (a Ctrl-C at this terminal
        // does not reach it); this process waits until the mount is there or the child fails.
        let log = a.log.clone().unwrap_or_else(|| {
            let name = a
                .image
                .file_name()
                .map_or("image".into(), |n| n.to_string_lossy().into_owned());
            PathBuf::from(format!("/var/tmp/aios-mount-{name}.log"))
        });
        let out = std::fs::File::create(&log)
            .map_err(|e| BenchError::Setup(format!("log {}: {e}", log.display())))?;
        let err = out.try_clone().map_err(io_err)?;
        let exe = std::env::current_exe().map_err(io_err)?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("mount")
            .arg(&a.image)
            .arg(&a.mountpoint)
            .arg("--foreground");
        if let Some(t) = a.threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        cmd.arg("--commit").arg(a.commit.name());
        cmd.arg("--completion").arg(a.completion.name());
        cmd.arg("--transport").arg(a.transport.name());
        cmd.arg("--cache-size").arg(a.cache_size.to_string());
        cmd.arg("--request-spin-us")
            .arg(a.request_spin_us.to_string());
        if a.writeback_cache {
            cmd.arg("--writeback-cache");
        }
        if a.no_xattrs {
            cmd.arg("--no-xattrs");
        }
        use std::os::unix::process::CommandExt;
        let mut child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| BenchError::Setup(format!("starting the file system process: {e}")))?;
        let t0 = std::time::Instant::now();
        loop {
            if let Some(st) = child.try_wait().map_err(io_err)? {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                eprint!("{text}");
                return Err(BenchError::Setup(format!(
                    "mount failed ({st}); log: {}",
                    log.display()
                )));
            }
            if is_mounted(&a.mountpoint) {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if let Some(l) = text.lines().find(|l| l.contains("mounted")) {
                    println!("{l}");
                }
                println!(
                    "aiosfs: serving in process {} (log: {})",
                    child.id(),
                    log.display()
                );
                return Ok(());
            }
            if t0.elapsed() > std::time::Duration::from_secs(120) {
                let _ = child.kill();
                return Err(BenchError::Setup(format!(
                    "no mount after 120 s; log: {}",
                    log.display()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    let mut opts = fs_fuse::MountOptions::default();
    if let Some(t) = a.threads {
        opts.threads = t;
    }
    opts.fs.commit_mode = match a.commit {
        CommitArg::Overlapped | CommitArg::Rio => aios::journal::CommitMode::Overlapped,
        CommitArg::Vanilla => aios::journal::CommitMode::Vanilla,
        CommitArg::OneWrite => aios::journal::CommitMode::OneWrite,
    };
    opts.fs.rio = matches!(a.commit, CommitArg::Rio);
    opts.fs.cache_bytes = usize::try_from(a.cache_size)
        .map_err(|_| BenchError::Invalid(format!("--cache-size {}: too large", a.cache_size)))?;
    opts.fs.completion = a.completion.mode();
    opts.writeback_cache = a.writeback_cache;
    opts.xattrs = !a.no_xattrs;
    opts.request_spin = Duration::from_micros(a.request_spin_us);
    opts.transport = match a.transport {
        TransportArg::Auto => fs_fuse::Transport::Auto,
        TransportArg::Uring => fs_fuse::Transport::Uring,
        TransportArg::Classic => fs_fuse::Transport::Classic,
    };
    let m = fs_fuse::mount(&a.image, &a.mountpoint, &opts).map_err(|e| match e {
        e @ fs_fuse::FsError::InUse { .. } => image_error(e, then),
        e => BenchError::Setup(about(&a.image, e)),
    })?;
    let fs_probe = probe(&a.image, ProbeOptions::default()).ok();
    let r = &m.report;
    eprintln!(
        "aiosfs: mounted {} on {}: {} workers (one per core unless --threads; each its own /dev/fuse clone, engine, lbio array and journal area), device {} ({}), completion {}, journal: {} commit, durability {}, {}, recovery replayed {} transactions ({} blocks){}{}{}",
        a.image.display(),
        a.mountpoint.display(),
        m.threads,
        a.image.display(),
        fs_probe.map_or("unprobed".into(), |p| format!("{}, O_DIRECT", p.kind)),
        match opts.fs.completion {
            CompletionMode::Wait => "wait".to_string(),
            CompletionMode::BusyPoll => "busy-poll".to_string(),
            CompletionMode::Hybrid { spin } => format!("hybrid (spin up to {} us, then sleep)", spin.as_micros()),
        },
        if opts.fs.rio {
            "rio (attribute logs as block logs on the device, FUA-written; workers without an area of their own: overlapped)"
        } else {
            opts.fs.commit_mode.name()
        },
        r.durability,
        if opts.fs.cache_bytes > 0 {
            format!(
                "page cache {} for clean data (AIOS read path; O_DIRECT reads bypass it)",
                aios::bench::report::human_bytes(opts.fs.cache_bytes as u64)
            )
        } else {
            "no page cache (--cache-size 0)".into()
        },
        r.replayed_transactions,
        r.replayed_blocks,
        if r.was_mounted { ", after an unclean stop" } else { "" },
        if r.orphans_freed > 0 { format!(", {} orphan inodes freed", r.orphans_freed) } else { String::new() },
        if opts.xattrs { "" } else { "; extended attributes off (--no-xattrs): their requests are answered ENOSYS, and programs get EOPNOTSUPP" },
    );
    m.run().map_err(|e| BenchError::Setup(e.to_string()))
}

fn cmd_fsck(image: &std::path::Path, json: bool) -> ExitCode {
    // fsck reads the image as it is on the device: under a live file system, whatever that
    // one has not committed yet is missing, and a check can report damage that is not there.
    if let Some((pid, cmd)) = writers_of(image).first() {
        eprintln!(
            "aios fsck: warning: {} is open for writing by process {pid} ({cmd}); what it has \
             not committed is not on the device, so problems found now may not be real: \
             unmount it first for a reliable check",
            image.display()
        );
    }
    match fs_fuse::fsck(image) {
        Ok(r) => {
            if json {
                let v = serde_json::json!({
                    "image": image.display().to_string(),
                    "clean": r.clean(),
                    "problems": r.problems,
                    "notes": r.notes,
                    "blocks": r.superblock.blocks,
                    "used_blocks": r.used_blocks,
                    "inodes": r.superblock.inodes,
                    "used_inodes": r.used_inodes,
                    "files": r.files,
                    "directories": r.directories,
                    "symlinks": r.symlinks,
                    "other": r.other,
                });
                println!("{v}");
            } else {
                println!(
                    "{}: aiosfs, {} of {} blocks and {} of {} inodes in use; {} files, {} directories, {} symlinks, {} other",
                    image.display(),
                    r.used_blocks,
                    r.superblock.blocks,
                    r.used_inodes,
                    r.superblock.inodes,
                    r.files,
                    r.directories,
                    r.symlinks,
                    r.other
                );
                for n in &r.notes {
                    println!("note: {n}");
                }
                for p in &r.problems {
                    println!("problem: {p}");
                }
                println!(
                    "{}",
                    if r.clean() {
                        "clean".to_string()
                    } else {
                        format!("DAMAGED: {} problems", r.problems.len())
                    }
                );
            }
            if r.clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(4)
            }
        }
        Err(e) => {
            if json {
                println!(
                    "{}",
                    serde_json::json!({"image": image.display().to_string(), "error": e.to_string()})
                );
            }
            eprintln!("aios fsck: {}", about(image, e));
            ExitCode::from(8)
        }
    }
}

fn probe_json(p: &DeviceProbe) -> serde_json::Value {
    serde_json::json!({
        "cpu_idle": {
            "driver": sys::cpuidle_driver(),
            "states": sys::cpuidle_states().iter().map(|(n, lat)| serde_json::json!({"name": n, "exit_latency_us": lat})).collect::<Vec<_>>(),
            "pm_qos_limit_us": sys::CpuLatencyRequest::effective_us().ok(),
            "guest_halt_poll_ns": sys::guest_halt_poll_ns(),
        },
        "path": p.path,
        "kind": p.kind.to_string(),
        "fs_type": p.fs_type,
        "capacity_bytes": p.capacity_bytes,
        "logical_block": p.logical_block,
        "dio_mem_align": p.dio.map(|d| d.mem_align),
        "dio_offset_align": p.dio.map(|d| d.offset_align),
        "dio_source": p.dio_source,
        "max_transfer_bytes": p.max_transfer_bytes,
        "max_transfer_source": p.max_transfer_source,
        "rotational": p.rotational,
        "volatile_write_cache": p.volatile_write_cache,
        "allocated_bytes": p.allocated_bytes,
        "iopoll": p.iopoll.is_ok(),
        "iopoll_reason": p.iopoll.as_ref().err(),
        "uring_qd1_us": p.latency.map(|l| l.uring_qd1_ns / 1000.0),
        "pread_qd1_us": p.latency.map(|l| l.pread_ns / 1000.0),
        "punts_to_io_wq": p.latency.map(|l| l.punts()),
        "io_wq_workers": p.latency.and_then(|l| l.io_wq_workers),
        "critical_route": p.critical.route.to_string(),
        "critical_reason": p.critical.reason,
        "background_route": p.background.route.to_string(),
        "background_reason": p.background.reason,
        "passthrough": p.passthrough.as_ref().map(|pt| serde_json::json!({
            "char_device": pt.char_device,
            "available": pt.namespace.is_ok(),
            "reason": pt.namespace.as_ref().err(),
            "nsid": pt.namespace.as_ref().ok().map(|n| n.nsid),
            "lba_bytes": pt.namespace.as_ref().ok().map(|n| n.lba_bytes),
            "capacity_lbas": pt.namespace.as_ref().ok().map(|n| n.capacity_lbas),
            "mdts_bytes": pt.namespace.as_ref().ok().and_then(|n| n.mdts_bytes),
            "max_transfer_bytes": pt.namespace.as_ref().ok().map(|n| n.max_transfer_bytes()),
            "iopoll": pt.iopoll.is_ok(),
            "iopoll_reason": pt.iopoll.as_ref().err(),
            "qd1_read_us": pt.qd1_read_ns.map(|n| n / 1000.0),
        })),
    })
}

fn cmd_probe(path: &Path, json: bool, samples: u32) -> Result<(), BenchError> {
    if !path.exists() {
        return Err(BenchError::Setup(format!(
            "{}: no such device or file",
            path.display()
        )));
    }
    if path.is_dir() {
        return Err(BenchError::Invalid(format!(
            "{}: a directory, not a device: name a block device, an NVMe character device or a file",
            path.display()
        )));
    }
    let p = probe(
        path,
        ProbeOptions {
            latency_samples: samples,
            try_iopoll: true,
        },
    )?;
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", probe_json(&p)).map_err(io_err)?;
        return Ok(());
    }
    let w = |out: &mut std::io::StdoutLock<'_>, k: &str, v: String| writeln!(out, "{k:<22} {v}");
    w(&mut out, "device", p.path.display().to_string()).map_err(io_err)?;
    w(
        &mut out,
        "kind",
        match &p.fs_type {
            Some(fs) => format!("{} on {fs}", p.kind),
            None => p.kind.to_string(),
        },
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "capacity",
        match p.allocated_bytes {
            Some(a) if a < p.capacity_bytes => format!(
                "{} bytes, {a} allocated (sparse: reads of holes never reach the device)",
                p.capacity_bytes
            ),
            _ => format!("{} bytes", p.capacity_bytes),
        },
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "logical block",
        format!("{} bytes", p.logical_block),
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "direct I/O",
        match p.dio {
            Some(d) => format!(
                "buffer align {} B, offset/length align {} B ({})",
                d.mem_align, d.offset_align, p.dio_source
            ),
            None => format!("unavailable: {}", p.dio_source),
        },
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "max transfer",
        format!(
            "{} KiB ({})",
            p.max_transfer_bytes / 1024,
            p.max_transfer_source
        ),
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "rotational",
        p.rotational.map_or("unknown".into(), |r| r.to_string()),
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "volatile write cache",
        match p.volatile_write_cache {
            Some(true) => "yes: durability needs FLUSH or FUA".to_string(),
            Some(false) => "no: writes are durable at completion (FLUSH skipped)".to_string(),
            None => "unknown (a file: fdatasync)".to_string(),
        },
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "IOPOLL",
        match &p.iopoll {
            Ok(()) => "available (a polled read completed)".to_string(),
            Err(why) => format!("unavailable: {why}"),
        },
    )
    .map_err(io_err)?;
    if let Some(l) = p.latency {
        w(
            &mut out,
            "QD1 4k read",
            format!(
                "io_uring {:.1} us, pread {:.1} us (median of {}), {} → {}",
                l.uring_qd1_ns / 1000.0,
                l.pread_ns / 1000.0,
                l.samples,
                match l.io_wq_workers {
                    Some(n) => format!("{n} io-wq worker(s) seen"),
                    None => "io-wq workers not visible".to_string(),
                },
                if l.punts() {
                    "io_uring punts to io-wq"
                } else {
                    "io_uring completes inline"
                }
            ),
        )
        .map_err(io_err)?;
    }
    if let Some(pt) = &p.passthrough {
        w(
            &mut out,
            "NVMe passthrough",
            match &pt.namespace {
                Ok(ns) => format!(
                    "available via {} (nsid {}, {} {}, {}-byte LBAs, {} LBAs, {}, volatile \
                     write cache {})",
                    pt.char_device.display(),
                    ns.nsid,
                    ns.model,
                    ns.serial,
                    ns.lba_bytes,
                    ns.capacity_lbas,
                    ns.max_transfer_source(),
                    if ns.volatile_write_cache { "yes" } else { "no" }
                ),
                Err(why) => format!("unavailable via {}: {why}", pt.char_device.display()),
            },
        )
        .map_err(io_err)?;
        w(
            &mut out,
            "passthrough IOPOLL",
            match &pt.iopoll {
                Ok(()) => "available (a polled passthrough read completed)".to_string(),
                Err(why) => format!("unavailable: {why}"),
            },
        )
        .map_err(io_err)?;
        if let Some(ns) = pt.qd1_read_ns {
            w(
                &mut out,
                "passthrough QD1 read",
                format!("{:.1} us (median)", ns / 1000.0),
            )
            .map_err(io_err)?;
        }
    } else {
        w(
            &mut out,
            "NVMe passthrough",
            "unavailable: not an NVMe namespace".to_string(),
        )
        .map_err(io_err)?;
    }
    w(
        &mut out,
        "critical path",
        format!("{} — {}", p.critical.route, p.critical.reason),
    )
    .map_err(io_err)?;
    w(
        &mut out,
        "background path",
        format!("{} — {}", p.background.route, p.background.reason),
    )
    .map_err(io_err)?;
    w(&mut out, "cpu idle", cpu_idle_line()).map_err(io_err)?;
    Ok(())
}

fn cpuidle_driver_name() -> String {
    sys::cpuidle_driver().unwrap_or_else(|| "none".into())
}

/// cpuidle states as `name (exit latency µs)`, or `none`.
fn idle_states_list(states: &[(String, u32)]) -> String {
    if states.is_empty() {
        return "none".into();
    }
    let named: Vec<String> = states
        .iter()
        .map(|(n, lat)| format!("{n} ({lat} µs)"))
        .collect();
    named.join(", ")
}

/// The machine's CPU idle policy: what a thread woken on an idle CPU waits for (QD1 latency
/// depends on it when the device's side of the I/O runs in a kernel thread).
fn cpu_idle_line() -> String {
    let halt_poll = match sys::guest_halt_poll_ns() {
        Some(0) => "; guest halt polling off (guest_halt_poll_ns 0): an idle vCPU halts at once, and waking it takes what the hypervisor takes".to_string(),
        Some(ns) => format!("; guest halt polling up to {} us before an idle vCPU halts", ns / 1000),
        None => String::new(),
    };
    format!(
        "driver {}, states: {}{halt_poll}; PM QoS limit in force: {} (aios bench … --cpu-latency-us 0 keeps idle CPUs polling)",
        cpuidle_driver_name(),
        idle_states_list(&sys::cpuidle_states()),
        sys::CpuLatencyRequest::effective_us()
            .map_or_else(|_| "unreadable (needs root)".to_string(), |v| format!("{v} us")),
    )
}

/// Print a sample on stdout: one JSON object, or a table row through `row`.
fn emit_line<S: serde::Serialize>(
    json: bool,
    s: &S,
    row: impl Fn(&mut std::io::StdoutLock<'static>, &S) -> std::io::Result<()>,
) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (e.g. piped into `head`) is not worth failing the run for.
    let _ = if json {
        print_json(&mut out, s)
    } else {
        row(&mut out, s)
    };
}

fn io_err(e: std::io::Error) -> BenchError {
    BenchError::Setup(format!("writing output: {e}"))
}

struct Stack {
    engine: Rc<Engine>,
    _lbio: Rc<LbioArray>,
    dev: Device,
}

fn open_stack(
    path: &Path,
    bs: u32,
    qd: u32,
    slots: u32,
    route: RouteChoice,
    write: bool,
    iopoll: bool,
) -> Result<Stack, BenchError> {
    let engine = Engine::new(EngineConfig {
        passthrough: aios::core::nvme::is_passthrough_device(path),
        iopoll_ring: iopoll,
        ..aios::bench::lbio_engine_config(bs, qd, slots, 1)
    })?;
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots,
            ..LbioConfig::default()
        },
    )?;
    let dev = Device::open(
        &lbio,
        path,
        DeviceConfig {
            write,
            route,
            iopoll,
            ..DeviceConfig::default()
        },
    )?;
    Ok(Stack {
        engine,
        _lbio: lbio,
        dev,
    })
}

/// `e` about `path`: prefixed with the path unless its message starts with it already.
fn about(path: &Path, e: impl std::fmt::Display) -> String {
    let (p, msg) = (path.display().to_string(), e.to_string());
    if msg.starts_with(&p) {
        msg
    } else {
        format!("{p}: {msg}")
    }
}

/// `--device mem` names lbio's RAM backend wherever a command takes it (`bench scale`); a bench
/// that cannot run on it refuses it by name rather than creating a file called `mem` in the
/// working directory. `why` says why this bench needs a device; `./mem` still names a file.
fn refuse_mem_device(device: &str, bench: &str, why: &str) -> Result<(), BenchError> {
    if device == "mem" {
        return Err(BenchError::Invalid(format!(
            "--device mem: bench {bench} does not run on lbio's RAM backend ({why}); give ull, \
             a block device or file, or a new file path (./mem for a file named mem)"
        )));
    }
    Ok(())
}

/// `bench scale --device a,b,…`: every element names a device or file; `ull` and `mem` stand
/// alone (in a list they would be taken as file paths).
fn check_scale_device_list(list: &str) -> Result<(), BenchError> {
    for spec in list.split(',') {
        let why = match spec {
            "" => "an empty name in the list",
            "ull" | "mem" => "ull and mem stand alone, not in a list",
            _ => continue,
        };
        return Err(BenchError::Invalid(format!(
            "--device {list:?}: {why}; give ull, mem, or block devices or files separated by \
             commas"
        )));
    }
    Ok(())
}

/// `--qd` must fit the lbio request slots (`--slots`).
fn check_qd_slots(qd: u32, slots: u32) -> Result<(), BenchError> {
    if qd == 0 || qd > slots {
        return Err(BenchError::Invalid(format!(
            "--qd {qd} exceeds the {slots} request slots (--slots {slots}): lower --qd or raise \
             --slots to at least {qd}"
        )));
    }
    Ok(())
}

/// A `--plot` path must end in `.png` or `.svg` (the format goes by the extension); checked
/// before the bench runs, not after.
fn check_plot_path(p: &Path) -> Result<(), BenchError> {
    match p.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("png") || e.eq_ignore_ascii_case("svg") => Ok(()),
        _ => Err(BenchError::Invalid(format!(
            "--plot {}: name a .png or .svg file (the plot's format goes by the extension)",
            p.display()
        ))),
    }
}

/// Create the directory `p` goes in, if it has one.
fn create_plot_dir(p: &Path) -> Result<(), BenchError> {
    if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| {
            BenchError::Setup(format!("creating {} for the plot: {e}", dir.display()))
        })?;
    }
    Ok(())
}

fn cmd_bench_lbio(a: LbioArgs) -> Result<(), BenchError> {
    refuse_mem_device(
        &a.device,
        "lbio",
        "it measures a device's path, beside fio; `aios bench scale --device mem --threads 1` \
         runs lbio on RAM",
    )?;
    check_seconds(a.seconds)?;
    check_qd_slots(a.qd, a.slots)?;
    if let Some(span) = a.span.filter(|&s| s < a.bs as u64) {
        return Err(BenchError::Invalid(format!(
            "--span {span} is less than one --bs {} block: give a --span of at least {}",
            a.bs, a.bs
        )));
    }
    if let Some(p) = &a.plot {
        check_plot_path(p)?;
    }
    let fio = if a.vs_fio {
        Some(fio_version().ok_or_else(|| {
            BenchError::Setup("--vs-fio needs fio on the PATH (apt-get install fio)".into())
        })?)
    } else {
        None
    };
    let _qos = hold_cpu_latency(a.qos)?;
    let target = Target::prepare(&a.device, a.size)?;
    let write = !a.rw.is_read();
    if write {
        check_write_allowed(target.path(), target.created_here(), a.destructive)?;
    }
    let route = match a.route {
        RouteArg::Auto => RouteChoice::Auto,
        RouteArg::Ring => RouteChoice::Ring,
        RouteArg::Sync => RouteChoice::Sync,
    };
    let stack = open_stack(target.path(), a.bs, a.qd, a.slots, route, write, a.iopoll)?;
    let g = *stack.dev.geometry();
    if a.bs % g.offset_align != 0 {
        return Err(BenchError::Invalid(format!(
            "block size {} is not a multiple of the device's {}-byte alignment",
            a.bs, g.offset_align
        )));
    }
    let span = a.span.unwrap_or(g.capacity_bytes).min(g.capacity_bytes);
    let mut contenders = vec![Contender::Lbio];
    if fio.is_some() {
        contenders.push(Contender::Fio(FioEngine::IoUring));
        if a.qd == 1 {
            contenders.push(Contender::Fio(FioEngine::Psync));
        }
    }
    let rounds = a.rounds.unwrap_or(if a.vs_fio { 5 } else { 1 }).max(1);
    let class = match a.class {
        ClassArg::Critical => Class::Critical,
        ClassArg::Background => Class::Background,
    };
    let plug_for = |mode: CompletionMode| match a.plug {
        PlugArg::Auto => plug_auto(a.qd, mode),
        PlugArg::On => true,
        PlugArg::Off => false,
    };
    let workload = Workload {
        rw: a.rw,
        bs: a.bs,
        qd: a.qd,
        seconds: a.seconds,
    };
    let completion = match a.completion {
        CompletionArg::Auto if matches!(a.class, ClassArg::Critical) => {
            // Measured on this device, now: busy-poll or sleep, whichever is faster here.
            let c = choose_completion(
                &stack.dev,
                &workload,
                LbioRunOptions {
                    class,
                    completion: CompletionMode::BusyPoll,
                    span,
                    plug: false,
                },
                &plug_for,
                COMPLETION_CALIBRATION_ROUNDS,
                COMPLETION_CALIBRATION_SECONDS,
                Duration::from_millis(a.settle_ms),
            )?;
            eprintln!(
                "QD{} completion: busy-poll {:.1} us, sleep {:.1} us (mean latency, medians of {} alternating {} s runs): {}",
                a.qd,
                c.poll_us,
                c.wait_us,
                COMPLETION_CALIBRATION_ROUNDS,
                COMPLETION_CALIBRATION_SECONDS,
                c.chosen()
            );
            c.mode
        }
        CompletionArg::Auto | CompletionArg::Wait => CompletionMode::Wait,
        CompletionArg::Poll => CompletionMode::BusyPoll,
        CompletionArg::Hybrid => CompletionMode::hybrid(),
    };
    let plug = plug_for(completion);
    let cmp = Comparison {
        dev: &stack.dev,
        path: target.path().to_path_buf(),
        span,
        workload,
        contenders,
        rounds,
        class,
        completion,
        plug,
        settle: Duration::from_millis(a.settle_ms),
    };
    let progress = Progress::new(false);
    if !a.json {
        eprintln!("device: {}", target.describe());
        let (c, why) = stack.dev.critical_route();
        eprintln!("critical route: {} — {why}", c.name);
        if let Some(v) = &fio {
            eprintln!("anchor: {v}");
        }
        print_header(&mut std::io::stdout()).map_err(io_err)?;
    }
    let json = a.json;
    let qos_us = a.qos.cpu_latency_us;
    let mut emit = |s: &Sample| {
        let mut s = s.clone();
        s.cpu_latency_us = qos_us;
        emit_line(json, &s, print_row)
    };
    let (_, meds) = run_comparison(&cmp, &progress, "bench", &mut emit)?;
    if rounds > 1 {
        for s in &meds {
            emit(s);
        }
    }
    if let Some(p) = &a.plot {
        create_plot_dir(p)?;
        let refs: Vec<&Sample> = meds.iter().collect();
        plot_cdf(
            p,
            &format!("{} {} QD{} on {}", a.rw.name(), a.bs, a.qd, a.device),
            &refs,
        )?;
        eprintln!("plot: {}", p.display());
    }
    let m = stack.engine.metrics();
    if !a.json {
        eprintln!(
            "engine: {} SQEs, {} io_uring_enter calls, ring flags [{}], arena {} KiB on {}",
            m.sqes,
            m.enters,
            stack.engine.ring_setup().applied.join(" "),
            stack.engine.arena().bytes() / 1024,
            stack.engine.arena().backing()
        );
    }
    Ok(())
}

fn cmd_bench_scale(a: ScaleArgs) -> Result<(), BenchError> {
    use aios::bench::scale::{run_scale, ScaleConfig, ScaleDevices, ScaleSample};
    check_seconds(a.seconds)?;
    check_qd_slots(a.qd, a.slots)?;
    if let Some(p) = &a.plot {
        check_plot_path(p)?;
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    let threads = if a.threads.is_empty() {
        let mut v: Vec<u32> = std::iter::successors(Some(1u32), |t| t.checked_mul(2))
            .take_while(|&t| t <= ncpu)
            .collect();
        if v.last() != Some(&ncpu) {
            v.push(ncpu);
        }
        v
    } else {
        a.threads.clone()
    };
    let most = *threads.iter().max().expect("at least one thread count");
    let fio = if a.vs_fio {
        if a.device == "mem" {
            return Err(BenchError::Invalid(
                "--vs-fio needs a device fio can open (the mem device is lbio's RAM backend)"
                    .into(),
            ));
        }
        Some(fio_version().ok_or_else(|| {
            BenchError::Setup("--vs-fio needs fio on the PATH (apt-get install fio)".into())
        })?)
    } else {
        None
    };
    let write = !a.rw.is_read();
    let _qos = hold_cpu_latency(a.qos)?;
    let progress = Progress::new(false);
    // Held until the end: dropping them removes the loop devices and created files.
    let mut targets: Vec<Target> = Vec::new();
    if a.device.contains(',') {
        check_scale_device_list(&a.device)?;
    }
    let devices = match a.device.as_str() {
        "mem" => ScaleDevices::Mem {
            bytes: usize::try_from(a.size)
                .map_err(|_| BenchError::Invalid(format!("--size {} is too large", a.size)))?,
        },
        "ull" => {
            // All of them, before the first is made (each checks only itself).
            aios::bench::ull::check_room(most as u64, a.size, "--threads and --size")?;
            for i in 0..most {
                progress.step(&format!("creating ull device {}/{most}", i + 1));
                targets.push(Target::Ull(aios::bench::ull::UllDevice::create(a.size)?));
            }
            progress.done();
            ScaleDevices::Paths(targets.iter().map(|t| t.path().to_path_buf()).collect())
        }
        list => {
            for spec in list.split(',').filter(|s| !s.is_empty()) {
                let t = Target::prepare(spec, a.size)?;
                if write {
                    check_write_allowed(t.path(), t.created_here(), a.destructive)?;
                }
                targets.push(t);
            }
            ScaleDevices::Paths(targets.iter().map(|t| t.path().to_path_buf()).collect())
        }
    };
    let completion = match a.completion {
        CompletionArg::Auto | CompletionArg::Wait => CompletionMode::Wait,
        CompletionArg::Poll => CompletionMode::BusyPoll,
        CompletionArg::Hybrid => CompletionMode::hybrid(),
    };
    let cfg = ScaleConfig {
        devices,
        workload: Workload {
            rw: a.rw,
            bs: a.bs,
            qd: a.qd,
            seconds: a.seconds,
        },
        threads: threads.clone(),
        rounds: a.rounds,
        completion,
        pin: a.pin,
        slots: a.slots,
        span: None,
        fio: fio.is_some(),
        write,
        settle: Duration::from_millis(a.settle_ms),
    };
    let row = |out: &mut std::io::StdoutLock<'static>, s: &ScaleSample| {
        let opt = |v: Option<f64>, w: usize, p: usize| {
            v.map_or_else(|| format!("{:>w$}", "-"), |v| format!("{v:>w$.p$}"))
        };
        writeln!(
            out,
            "{:>5} {:<5} {:<22} {:>11.0} {:>10.0} {} {} {:>9.1} {:>9.1} {:>7.2} {:>10.0} {}",
            s.round.map_or_else(|| "med".to_string(), |r| r.to_string()),
            s.threads,
            s.engine,
            s.iops,
            s.iops_per_thread,
            opt(s.scaling, 7, 2),
            opt(s.efficiency, 5, 2),
            s.lat_us_mean,
            s.lat_us_p99,
            s.cpu_s,
            s.iops_per_cpu_s,
            opt(s.iops_ratio_vs_fio, 7, 3),
        )
    };
    if !a.json {
        eprintln!(
            "devices: {} · {} bs={} qd={} per thread · threads {:?} · completion {:?}{}",
            match &cfg.devices {
                ScaleDevices::Mem { bytes } => format!("mem, {} MiB per thread", bytes >> 20),
                ScaleDevices::Paths(p) if a.device == "ull" => format!(
                    "{} ull devices ({} each, loop over /dev/shm, direct-io)",
                    p.len(),
                    aios::bench::report::human_bytes(a.size)
                ),
                ScaleDevices::Paths(p) => p
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            },
            a.rw.name(),
            a.bs,
            a.qd,
            threads,
            completion,
            if a.pin { " · pinned" } else { "" }
        );
        if let Some(v) = &fio {
            eprintln!("anchor: {v}, one job per thread");
        }
        println!(
            "{:>5} {:<5} {:<22} {:>11} {:>10} {:>7} {:>5} {:>9} {:>9} {:>7} {:>10} {:>7}",
            "round",
            "thr",
            "engine",
            "IOPS",
            "IOPS/thr",
            "scaling",
            "eff",
            "mean us",
            "p99 us",
            "CPU s",
            "IOPS/CPUs",
            "÷fio"
        );
    }
    let json = a.json;
    let meds = run_scale(&cfg, &progress, &mut |s| emit_line(json, s, row))?;
    if a.rounds > 1 {
        for s in &meds {
            emit_line(json, s, row);
        }
    }
    if let Some(p) = &a.plot {
        create_plot_dir(p)?;
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for s in &meds {
            let name = if s.engine.starts_with("fio") {
                "fio io_uring".to_string()
            } else {
                "lbio (an engine per thread)".to_string()
            };
            match series.iter_mut().find(|x| x.0 == name) {
                Some(x) => x.1.push((s.threads as f64, s.iops)),
                None => series.push((name, vec![(s.threads as f64, s.iops)])),
            }
        }
        aios::bench::report::plot_lines(
            p,
            &format!(
                "{} {} QD{} per thread on {}",
                a.rw.name(),
                aios::bench::report::human_bytes(a.bs as u64),
                a.qd,
                a.device
            ),
            ("threads", "IOPS"),
            &series,
        )?;
        eprintln!("plot: {}", p.display());
    }
    drop(targets);
    Ok(())
}

fn cmd_bench_pagecache(a: PagecacheArgs) -> Result<(), BenchError> {
    use aios::bench::pagecache::{self as pc, PagecacheBench};
    refuse_mem_device(
        &a.device,
        "pagecache",
        "the kernel's page cache and O_DIRECT reads it is compared with need a device or file",
    )?;
    let _qos = hold_cpu_latency(a.qos)?;
    check_seconds(a.seconds)?;
    pc::check_block_sizes(&a.bs, None)?;
    if let Some(h) = a.hot.iter().find(|&&h| h < 4096).filter(|_| !a.no_hits) {
        return Err(BenchError::Invalid(format!(
            "--hot {h}: a hot set holds at least one 4 KiB page (4k or more)"
        )));
    }
    let mut bench = PagecacheBench {
        // Set once the device is ready (the arguments are checked first).
        path: PathBuf::new(),
        device_name: a.device.clone(),
        cold_bs: a.bs.clone(),
        threads: a.threads.clone(),
        modes: a.modes.clone(),
        cold: !a.no_cold,
        hits: !a.no_hits,
        seconds: a.seconds,
        rounds: a.rounds.max(1),
        cache_bytes: a.cache as usize,
        hot_sets: a.hot.clone(),
        completion: a.completion.mode(),
    };
    bench.check_cache()?;
    let target = Target::prepare(&a.device, a.size)?;
    bench.path = target.path().to_path_buf();
    if !a.json {
        eprintln!("device: {}", target.describe());
        let c = aios::core::copy::calibrate();
        match (c.loop_ns, c.memcpy_ns) {
            (Some(l), Some(m)) => eprintln!(
                "hit copy: {} (4 KiB from random pages of {} MiB: avx2 loop {l:.1} ns, memcpy {m:.1} ns)",
                aios::core::copy::method(4096),
                aios::core::copy::CALIBRATION_BYTES >> 20
            ),
            _ => eprintln!("hit copy: {}", aios::core::copy::method(4096)),
        }
        pc::print_header(&mut std::io::stdout()).map_err(io_err)?;
    }
    let json = a.json;
    let mut emit = |s: &pc::PcSample| emit_line(json, s, pc::print_row);
    let (_, meds) = bench.run(&Progress::new(false), &mut emit)?;
    if bench.rounds > 1 {
        for s in &meds {
            emit(s);
        }
    }
    let written = write_pagecache_plots(&a.out, &bench, &meds)?;
    if !a.json {
        print_pagecache_legend();
        eprintln!("plots: {}", written.join(", "));
    }
    Ok(())
}

fn cmd_target(a: TargetArgs) -> Result<(), BenchError> {
    use aios::rio_net::{Target, TargetConfig, TargetLogKind};
    // A mem or file log is held in memory whole (Rio uses 2 MiB per target): past this the
    // allocation could abort the process instead of failing.
    const MAX_LOG_BYTES: u64 = 1 << 30;
    if a.log_bytes > MAX_LOG_BYTES && a.attr_log.split_once(':').is_none_or(|(k, _)| k != "nvme") {
        return Err(BenchError::Invalid(format!(
            "--log-bytes {}: at most 1g (a mem or file log is held in memory; Rio uses 2m)",
            a.log_bytes
        )));
    }
    let log = match a.attr_log.split_once(':') {
        _ if a.attr_log == "mem" => TargetLogKind::Mem(a.log_bytes as usize),
        Some(("file", "")) => {
            return Err(BenchError::Invalid(
                "--attr-log file: needs a path (file:PATH)".into(),
            ))
        }
        Some(("file", p)) => TargetLogKind::File(PathBuf::from(p), a.log_bytes as usize),
        Some(("nvme", p)) => TargetLogKind::Nvme(PathBuf::from(p)),
        _ => {
            return Err(BenchError::Invalid(format!(
                "--attr-log {:?}: expected mem, file:PATH or nvme:/dev/nvmeX",
                a.attr_log
            )))
        }
    };
    let mut cfg = TargetConfig::new(&a.device, log);
    cfg.streams = a.streams;
    cfg.format = a.format;
    cfg.ns_bytes = a.ns_bytes;
    cfg.subnqn = a.subnqn.clone();
    cfg.verbose = a.verbose;
    cfg.max_connections = a.max_connections as usize;
    if a.in_capsule > 128 << 10 || a.in_capsule % 16 != 0 {
        return Err(BenchError::Invalid(format!(
            "--in-capsule {}: a multiple of 16 bytes up to 128k",
            a.in_capsule
        )));
    }
    cfg.in_capsule = a.in_capsule as u32;
    cfg.transport = a.transport;
    let t = Target::bind(a.listen, cfg).map_err(|e| BenchError::Setup(e.to_string()))?;
    eprintln!(
        "aios target: serving {} ({} bytes, {} power-loss protection) as {} on {} ({:?}), attribute log {}, at most {} connections",
        a.device.display(),
        t.ns_bytes(),
        if t.plp() { "with" } else { "without" },
        a.subnqn,
        t.local_addr(),
        a.transport,
        a.attr_log,
        a.max_connections
    );
    t.serve().map_err(|e| BenchError::Setup(e.to_string()))
}

fn cmd_bench_net(a: &OrderedArgs, spec: &str) -> Result<(), BenchError> {
    use aios::bench::net::{self as nb, NetBench};
    check_seconds(a.seconds)?;
    // A volume numbers its streams in 16 bits (a larger count was truncated to them).
    if let Some(s) = a.streams.iter().find(|&&s| s > u16::MAX as u32) {
        return Err(BenchError::Invalid(format!(
            "--streams {s}: a volume over --targets has at most {} streams",
            u16::MAX
        )));
    }
    let mut _lab = None;
    let (targets, pids) = if let Some(n) = spec.strip_prefix("netns:") {
        let n: usize = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
            BenchError::Invalid(format!(
                "--targets {spec}: netns:N wants a number of targets, 1 or more"
            ))
        })?;
        let exe = std::env::current_exe().map_err(io_err)?;
        eprintln!("starting {n} targets in network namespaces (veth pairs, files in /dev/shm)");
        let lab =
            aios::netlab::NetLab::start(&exe, n, a.size, 16, true).map_err(BenchError::Setup)?;
        let addrs = lab.addrs();
        let pids = (0..n).filter_map(|i| lab.pid(i)).collect();
        _lab = Some(lab);
        (addrs, pids)
    } else {
        let addrs = spec
            .split(',')
            .map(|s| s.trim().parse::<std::net::SocketAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| BenchError::Invalid(format!("--targets {spec}: {e}")))?;
        (addrs, Vec::new())
    };
    let bench = NetBench {
        targets,
        target_pids: pids,
        modes: a.modes.clone(),
        streams: a.streams.first().copied().unwrap_or(1),
        qd: a.qd,
        seconds: a.seconds,
        rounds: a.rounds.max(1),
        batch: a.batch.first().copied().unwrap_or(1),
        seq: a.seq,
        stripe: {
            let stripe = a.stripe.unwrap_or(4096);
            u32::try_from(stripe)
                .ok()
                .filter(|s| s % 4096 == 0)
                .ok_or_else(|| {
                    BenchError::Invalid(format!(
                        "--stripe {stripe}: a multiple of 4 KiB below 4 GiB"
                    ))
                })?
        },
    };
    if a.batch.len() > 1 || a.streams.len() > 1 {
        eprintln!(
            "over the network one stream count and one batch per run: {} stream(s), batch {}",
            bench.streams, bench.batch
        );
    }
    if !a.json {
        nb::print_header(&mut std::io::stdout()).map_err(io_err)?;
    }
    let json = a.json;
    let mut emit = |s: &nb::NetSample| emit_line(json, s, nb::print_row);
    let meds = bench.run(&Progress::new(a.json), &mut emit)?;
    if bench.rounds > 1 {
        for s in &meds {
            emit(s);
        }
    }
    if !a.json {
        eprintln!(
            "rio: ordered writes, each its own group, handed back when durable; orderless: plain \
             writes; sync: write, wait, FLUSH every target, wait. init_us/w and tgt_us/w: CPU \
             microseconds per write in the initiator and in all targets together."
        );
    }
    Ok(())
}

fn cmd_bench_ordered(a: OrderedArgs) -> Result<(), BenchError> {
    use aios::bench::ordered::{self as ob, OrderedBench, OrderedTarget};
    refuse_mem_device(
        &a.device,
        "ordered",
        "its RAM stand-in is `sim`, a SimDisk per stream with a device's ordering and timing",
    )?;
    let _qos = hold_cpu_latency(a.qos)?;
    if let Some(spec) = a.targets.clone() {
        return cmd_bench_net(&a, &spec);
    }
    if let Some(stripe) = a.stripe {
        return Err(BenchError::Invalid(format!(
            "--stripe {stripe}: a stripe unit is for a volume over --targets; a local device has none"
        )));
    }
    let progress = Progress::new(false);
    // The settings are checked before a device is made or written.
    let provisional = |target| OrderedBench {
        target,
        device_name: a.device.clone(),
        modes: a.modes.clone(),
        streams: a.streams.clone(),
        batches: a.batch.clone(),
        logs: a.log.clone(),
        qd: a.qd,
        sequential: a.seq,
        seconds: a.seconds,
        sim_writes: a.sim_writes,
        rounds: a.rounds,
        flush_ahead: a.flush_ahead,
    };
    provisional(if a.device == "sim" {
        OrderedTarget::Sim
    } else {
        OrderedTarget::Path(PathBuf::from(&a.device))
    })
    .validate()?;
    let target = if a.device == "sim" {
        None
    } else {
        progress.step("preparing the device");
        let t = Target::prepare(&a.device, a.size)?;
        check_write_allowed(t.path(), t.created_here(), a.destructive)?;
        progress.done();
        Some(t)
    };
    let bench = provisional(match &target {
        Some(t) => OrderedTarget::Path(t.path().to_path_buf()),
        None => OrderedTarget::Sim,
    });
    if !a.json {
        match &target {
            Some(t) => eprintln!("device: {}", t.describe()),
            None => eprintln!(
                "device: SimDisk per stream, no power-loss protection (device time modelled: \
                 8 parallel units, 11 us per 4 KiB write, 20 us FLUSH)"
            ),
        }
        ob::print_header(&mut std::io::stdout()).map_err(io_err)?;
    }
    let json = a.json;
    let mut emit = |s: &ob::OrderedSample| emit_line(json, s, ob::print_row);
    let (_, meds) = bench.run(&progress, &mut emit)?;
    if bench.rounds > 1 {
        for s in &meds {
            emit(s);
        }
    }
    drop(target);
    if !a.json {
        eprintln!("{}", ob::legend());
    }
    Ok(())
}

/// Targets of the fsync bench: the journal's device, and an ext4 mount when asked for.
struct FsyncTargets {
    // Field order is drop order: unmount before the device goes.
    ext4: Option<aios::bench::fsync::Ext4Mount>,
    _ext4_dev: Option<Target>,
    journal: Target,
}

fn prepare_fsync_targets(
    device: &str,
    size: u64,
    ext4_wanted: bool,
    destructive: bool,
    plp: bool,
    progress: &Progress,
) -> Result<FsyncTargets, BenchError> {
    if plp && device != "ull" {
        return Err(BenchError::Invalid(
            "--plp applies to --device ull (the bench sets its loop devices to write through)"
                .into(),
        ));
    }
    let write_through = |t: &Target| match t {
        Target::Ull(u) if plp => u.set_write_through(),
        _ => Ok(()),
    };
    progress.step("preparing the journal's device");
    let journal = Target::prepare(device, size)?;
    check_write_allowed(journal.path(), journal.created_here(), destructive)?;
    write_through(&journal)?;
    let (ext4, ext4_dev) = if ext4_wanted && device == "ull" {
        progress.step("making ext4 on a second ull device");
        let t = Target::prepare("ull", 0)?;
        write_through(&t)?;
        (
            Some(aios::bench::fsync::Ext4Mount::make(t.path())?),
            Some(t),
        )
    } else {
        (None, None)
    };
    progress.done();
    Ok(FsyncTargets {
        ext4,
        _ext4_dev: ext4_dev,
        journal,
    })
}

fn cmd_bench_fsync(a: FsyncArgs) -> Result<(), BenchError> {
    use aios::bench::fsync::{self as fs, FsyncBench};
    refuse_mem_device(
        &a.device,
        "fsync",
        "it measures writes made durable on a device, beside ext4's fsync",
    )?;
    let _qos = hold_cpu_latency(a.qos)?;
    let progress = Progress::new(false);
    check_seconds(a.seconds)?;
    let ext4_wanted = a.modes.iter().any(|m| m.is_ext4());
    if ext4_wanted && a.device != "ull" && a.ext4_dir.is_none() {
        return Err(BenchError::Invalid(
            "the ext4 modes need --ext4-dir DIR (a directory on ext4) when --device is not ull; \
             or leave them out with --modes vanilla,overlapped"
                .into(),
        ));
    }
    if let Some(d) = a.ext4_dir.as_ref().filter(|d| ext4_wanted && !d.is_dir()) {
        return Err(BenchError::Invalid(format!(
            "--ext4-dir {}: not a directory (name one on an ext4 file system)",
            d.display()
        )));
    }
    let mut bench = FsyncBench {
        // Set once the devices are ready (the settings are checked first).
        journal_dev: PathBuf::new(),
        ext4_dir: None,
        modes: a.modes.clone(),
        threads: a.threads.clone(),
        seconds: a.seconds,
        rounds: a.rounds.max(1),
        device_name: if a.plp {
            format!("{}-plp", a.device)
        } else {
            a.device.clone()
        },
        areas: a.areas,
        group_commit: !a.no_group_commit,
        durability: a.durability.0,
        completion: a.completion.mode(),
    };
    bench.validate_settings()?;
    let targets = prepare_fsync_targets(
        &a.device,
        a.size,
        ext4_wanted,
        a.destructive,
        a.plp,
        &progress,
    )?;
    bench.journal_dev = targets.journal.path().to_path_buf();
    bench.ext4_dir = match (&targets.ext4, &a.ext4_dir) {
        (Some(m), _) => Some(m.dir().to_path_buf()),
        (None, Some(d)) => {
            if aios::core::sys::fs_type_of(d).as_deref() != Some("ext4") {
                eprintln!(
                    "note: {} is not on ext4; the 'ext4' rows measure whatever it is",
                    d.display()
                );
            }
            Some(d.clone())
        }
        (None, None) => None,
    };
    bench.validate()?;
    if !a.json {
        eprintln!("journal device: {}", targets.journal.describe());
        if let Some(d) = &bench.ext4_dir {
            eprintln!("ext4: {}", d.display());
        }
        fs::print_header(&mut std::io::stdout()).map_err(io_err)?;
    }
    let json = a.json;
    let mut emit = |s: &fs::FsyncSample| emit_line(json, s, fs::print_row);
    let (_, meds) = bench.run(&progress, &mut emit)?;
    if bench.rounds > 1 {
        for s in &meds {
            emit(s);
        }
    }
    let written = write_fsync_plot(&a.out, &bench, &meds)?;
    drop(targets);
    if !a.json {
        eprintln!("{}", fs::legend());
        eprintln!("plots: {}", written.join(", "));
    }
    Ok(())
}

fn write_fsync_plot(
    out: &Path,
    bench: &aios::bench::fsync::FsyncBench,
    meds: &[aios::bench::fsync::FsyncSample],
) -> Result<Vec<String>, BenchError> {
    std::fs::create_dir_all(out)
        .map_err(|e| BenchError::Setup(format!("creating {}: {e}", out.display())))?;
    let threads = bench.threads[0];
    let series = aios::bench::fsync::cdf_series(meds, threads);
    let refs: Vec<&Sample> = series.iter().collect();
    let mut written = Vec::new();
    if refs.is_empty() {
        return Ok(written);
    }
    for ext in ["png", "svg"] {
        let p = out.join(format!("fsync_cdf.{ext}"));
        plot_cdf(
            &p,
            &format!(
                "4 KiB write made durable, x{threads} thread(s) on {}",
                bench.device_name
            ),
            &refs,
        )?;
        written.push(p.display().to_string());
    }
    Ok(written)
}

fn print_pagecache_legend() {
    eprintln!(
        "'submit us' = median from the read call's entry to its SQE entering the kernel \
         (page-cache misses); '/k-cold' = mean latency ÷ the kernel page cache's cold buffered \
         read; '-lbio us' = mean latency − that of the raw lbio reads the page cache's cold runs \
         interleave with their misses, one each, on the same engine (so those runs' IOPS count \
         half the reads they do); '/k-hot' = hits per second ÷ the kernel's hot buffered pread; \
         '/1 thr' = throughput ÷ one thread's (all within a round; 'med' rows: medians over \
         rounds)"
    );
}

/// The submission-latency CDF (AIOS Fig. 14) and the cold read-latency CDF, 4 KiB, one thread.
fn write_pagecache_plots(
    out: &Path,
    bench: &aios::bench::pagecache::PagecacheBench,
    meds: &[aios::bench::pagecache::PcSample],
) -> Result<Vec<String>, BenchError> {
    use aios::bench::pagecache::cdf_series;
    std::fs::create_dir_all(out)
        .map_err(|e| BenchError::Setup(format!("creating {}: {e}", out.display())))?;
    let bs = if bench.cold_bs.contains(&4096) {
        4096
    } else {
        bench.cold_bs[0]
    };
    let threads = bench.threads[0];
    let mut written = Vec::new();
    for (submit, name, title) in [
        (
            true,
            "pagecache_submit_cdf",
            "page-cache miss: read entry to SQE entering the kernel",
        ),
        (false, "pagecache_cold_cdf", "cold random read latency"),
    ] {
        let series = cdf_series(meds, bs, threads, submit);
        if series.is_empty() {
            continue;
        }
        let refs: Vec<&Sample> = series.iter().collect();
        for ext in ["png", "svg"] {
            let p = out.join(format!("{name}.{ext}"));
            plot_cdf(
                &p,
                &format!(
                    "{title}, {} x{threads} thread(s) on {}",
                    aios::bench::report::human_bytes(bs.into()),
                    bench.device_name
                ),
                &refs,
            )?;
            written.push(p.display().to_string());
        }
    }
    Ok(written)
}

/// Writes one JSON line per sample to `path`; returns the path as printed.
fn write_jsonl<'a, T: serde::Serialize + 'a>(
    path: &std::path::Path,
    samples: impl IntoIterator<Item = &'a T>,
) -> Result<String, BenchError> {
    let mut f = std::fs::File::create(path)
        .map_err(|e| BenchError::Setup(format!("creating {}: {e}", path.display())))?;
    for s in samples {
        print_json(&mut f, s).map_err(io_err)?;
    }
    Ok(path.display().to_string())
}

fn cmd_demo(a: DemoArgs) -> Result<(), BenchError> {
    check_seconds(a.seconds)?;
    std::fs::create_dir_all(&a.out)
        .map_err(|e| BenchError::Setup(format!("creating {}: {e}", a.out.display())))?;
    let fio = fio_version();
    let progress = Progress::new(false);
    println!("aios demo — lbio (aios' lightweight block layer on io_uring) against its anchors");
    match &fio {
        Some(v) => println!("anchor: {v} (io_uring with fixedbufs+registerfiles, and psync)"),
        None => println!(
            "anchor: fio is not installed, so lbio is compared with the project's own pread \
             loop.\n        Add the fio column with: apt-get install fio   (then run the demo again)"
        ),
    }
    let target = if aios::core::sys::is_root() {
        progress.step("creating the ull device (1 GiB image in /dev/shm, loop with direct I/O)");
        Target::prepare("ull", 0)?
    } else {
        let dir = std::env::temp_dir();
        progress.step(&format!(
            "not root: using a 256 MiB scratch file in {}",
            dir.display()
        ));
        Target::scratch(&dir, "aios-demo", 256 << 20)?
    };
    progress.done();
    println!("device: {}", target.describe());

    let mut all: Vec<Sample> = Vec::new();
    let mut medians: Vec<Vec<Sample>> = Vec::new();
    let anchors_qd1 = match &fio {
        Some(_) => vec![
            Contender::Lbio,
            Contender::Fio(FioEngine::IoUring),
            Contender::Fio(FioEngine::Psync),
        ],
        None => vec![Contender::Lbio, Contender::Pread],
    };
    let mut sections: Vec<(String, Target, u32, Vec<Contender>)> = Vec::new();
    sections.push(("4k random read, QD1".into(), target, 1, anchors_qd1.clone()));
    let tmpfs = Target::scratch(Path::new("/dev/shm"), "aios-demo-tmpfs", 256 << 20)?;
    for (title, t, qd, contenders) in [
        (
            "4k random read, QD32".to_string(),
            None,
            32,
            if fio.is_some() {
                vec![Contender::Lbio, Contender::Fio(FioEngine::IoUring)]
            } else {
                vec![Contender::Lbio]
            },
        ),
        (
            "4k random read, QD1, file in /dev/shm (io_uring punts: automatic SyncPath)"
                .to_string(),
            Some(tmpfs),
            1,
            anchors_qd1,
        ),
    ] {
        match t {
            Some(t) => sections.push((title, t, qd, contenders)),
            None => {
                let same = Target::Existing(sections[0].1.path().to_path_buf());
                sections.push((title, same, qd, contenders));
            }
        }
    }
    for (title, t, qd, contenders) in &sections {
        println!("\n== {title} — {}", t.path().display());
        let stack = open_stack(t.path(), 4096, *qd, 1024, RouteChoice::Auto, false, false)?;
        let (c, why) = stack.dev.critical_route();
        println!("   lbio critical route: {} — {why}", c.name);
        let g = *stack.dev.geometry();
        let workload = Workload {
            rw: Rw::RandRead,
            bs: 4096,
            qd: *qd,
            seconds: a.seconds,
        };
        let settle = Duration::from_millis(DEFAULT_SETTLE_MS);
        // As `bench lbio` does by default: busy-poll or sleep, whichever measured faster here
        // just now (by `choose_completion`'s rule), plugged by `--plug auto`'s rule.
        let plug_for = |mode: CompletionMode| plug_auto(*qd, mode);
        let completion = {
            let c = choose_completion(
                &stack.dev,
                &workload,
                LbioRunOptions {
                    class: Class::Critical,
                    completion: CompletionMode::BusyPoll,
                    span: g.capacity_bytes,
                    plug: false,
                },
                &plug_for,
                COMPLETION_CALIBRATION_ROUNDS,
                COMPLETION_CALIBRATION_SECONDS,
                settle,
            )?;
            println!(
                "   QD{qd} completion: busy-poll {:.1} us, sleep {:.1} us: {}",
                c.poll_us,
                c.wait_us,
                c.chosen()
            );
            c.mode
        };
        let cmp = Comparison {
            dev: &stack.dev,
            path: t.path().to_path_buf(),
            span: g.capacity_bytes,
            workload,
            contenders: contenders.clone(),
            rounds: a.rounds,
            class: Class::Critical,
            completion,
            plug: plug_for(completion),
            settle,
        };
        let (samples, meds) = run_comparison(&cmp, &progress, title, &mut |_| {})?;
        print_header(&mut std::io::stdout()).map_err(io_err)?;
        for s in &meds {
            print_row(&mut std::io::stdout(), s).map_err(io_err)?;
        }
        all.extend(samples);
        medians.push(meds);
    }
    // `Existing` aliases of the ull device must not outlive it: drop sections in reverse.
    while sections.pop().is_some() {}

    let mut written = vec![write_jsonl(
        &a.out.join("demo.jsonl"),
        all.iter().chain(medians.iter().flatten()),
    )?];
    for (i, name) in [(0usize, "latency_cdf"), (2, "latency_cdf_tmpfs")] {
        if let Some(m) = medians.get(i) {
            let refs: Vec<&Sample> = m.iter().collect();
            for ext in ["png", "svg"] {
                let p = a.out.join(format!("{name}.{ext}"));
                let title = if i == 0 {
                    "4k random read QD1 — latency CDF"
                } else {
                    "4k random read QD1, /dev/shm file — latency CDF"
                };
                plot_cdf(&p, title, &refs)?;
                written.push(p.display().to_string());
            }
        }
    }
    // The page cache's read path on the same kind of device (AIOS §3.2, Fig. 13/14).
    let pc_target = if aios::core::sys::is_root() {
        progress.step("creating a ull device for the page-cache comparison");
        Target::prepare("ull", 0)?
    } else {
        Target::scratch(&std::env::temp_dir(), "aios-demo-pc", 256 << 20)?
    };
    progress.done();
    println!(
        "\n== page cache: 4k cold random reads and hits — {}",
        pc_target.path().display()
    );
    let pc = aios::bench::pagecache::PagecacheBench {
        path: pc_target.path().to_path_buf(),
        device_name: if matches!(pc_target, Target::Ull(_)) {
            "ull".into()
        } else {
            pc_target.path().display().to_string()
        },
        cold_bs: vec![4096],
        threads: vec![1],
        modes: vec![aios::pagecache::Mode::VANILLA, aios::pagecache::Mode::AIOS],
        cold: true,
        hits: true,
        seconds: (a.seconds / 2.0).max(0.2),
        rounds: a.rounds,
        // The cache's frames are pinned: without CAP_IPC_LOCK, what RLIMIT_MEMLOCK allows.
        cache_bytes: aios::bench::arena_within_memlock(64 << 20, 1),
        hot_sets: vec![(1u64 << 20).min(aios::bench::arena_within_memlock(64 << 20, 1) as u64 / 2)],
        completion: None,
    };
    let (pc_all, pc_meds) = pc.run(&progress, &mut |_| {})?;
    aios::bench::pagecache::print_header(&mut std::io::stdout()).map_err(io_err)?;
    for s in &pc_meds {
        aios::bench::pagecache::print_row(&mut std::io::stdout(), s).map_err(io_err)?;
    }
    written.push(write_jsonl(
        &a.out.join("demo-pagecache.jsonl"),
        pc_all.iter().chain(pc_meds.iter()),
    )?);
    written.extend(write_pagecache_plots(&a.out, &pc, &pc_meds)?);
    drop(pc_target);
    print_pagecache_legend();

    // The journal's commit (AIOS §3.3, Fig. 5) beside ext4's fsync on the same kind of device.
    let root = aios::core::sys::is_root();
    let fsync_modes = if root {
        vec![
            aios::bench::fsync::FsyncMode::Vanilla,
            aios::bench::fsync::FsyncMode::Overlapped,
            aios::bench::fsync::FsyncMode::OneWrite,
            aios::bench::fsync::FsyncMode::Ext4,
            aios::bench::fsync::FsyncMode::Ext4Meta,
        ]
    } else {
        println!("\n(not root: the fsync section runs without the ext4 anchor, on a scratch file)");
        vec![
            aios::bench::fsync::FsyncMode::Vanilla,
            aios::bench::fsync::FsyncMode::Overlapped,
            aios::bench::fsync::FsyncMode::OneWrite,
        ]
    };
    let fsync_targets = if root {
        prepare_fsync_targets("ull", 0, true, false, false, &progress)?
    } else {
        FsyncTargets {
            ext4: None,
            _ext4_dev: None,
            journal: Target::scratch(&std::env::temp_dir(), "aios-demo-fsync", 64 << 20)?,
        }
    };
    println!(
        "\n== fsync: 4 KiB write made durable, journal commit vs ext4 — {}",
        fsync_targets.journal.path().display()
    );
    let fb = aios::bench::fsync::FsyncBench {
        journal_dev: fsync_targets.journal.path().to_path_buf(),
        ext4_dir: fsync_targets.ext4.as_ref().map(|m| m.dir().to_path_buf()),
        modes: fsync_modes,
        threads: vec![1],
        seconds: (a.seconds / 2.0).max(0.2),
        rounds: a.rounds,
        device_name: if root { "ull".into() } else { "file".into() },
        areas: None,
        group_commit: true,
        durability: None,
        completion: None,
    };
    let (fs_all, fs_meds) = fb.run(&progress, &mut |_| {})?;
    aios::bench::fsync::print_header(&mut std::io::stdout()).map_err(io_err)?;
    for s in &fs_meds {
        aios::bench::fsync::print_row(&mut std::io::stdout(), s).map_err(io_err)?;
    }
    written.push(write_jsonl(
        &a.out.join("demo-fsync.jsonl"),
        fs_all.iter().chain(fs_meds.iter()),
    )?);
    written.extend(write_fsync_plot(&a.out, &fb, &fs_meds)?);
    drop(fsync_targets);
    println!("{}", aios::bench::fsync::legend());

    // Rio's ordered writes: against orderless writes on the device, and against synchronous
    // ordering on a SimDisk with a costly FLUSH.
    let ordered_dev = if root {
        Target::prepare("ull", 0)?
    } else {
        Target::scratch(&std::env::temp_dir(), "aios-demo-ordered", 256 << 20)?
    };
    let mut ordered_all = Vec::new();
    for (title, target, name) in [
        (
            "ordered 4 KiB random writes, 1 stream — rio vs sync vs orderless",
            aios::bench::ordered::OrderedTarget::Path(ordered_dev.path().to_path_buf()),
            if root { "ull" } else { "file" },
        ),
        (
            "ordered 4 KiB random writes on SimDisk (FLUSH 20 us, simulated device time)",
            aios::bench::ordered::OrderedTarget::Sim,
            "sim",
        ),
    ] {
        println!("\n== {title}");
        let ob = aios::bench::ordered::OrderedBench {
            target,
            device_name: name.into(),
            modes: vec![
                aios::bench::ordered::OrderedMode::Rio,
                aios::bench::ordered::OrderedMode::Sync,
                aios::bench::ordered::OrderedMode::Orderless,
            ],
            streams: vec![1],
            batches: vec![1],
            logs: vec![aios::bench::ordered::LogKind::Pmr],
            qd: 32,
            sequential: false,
            seconds: (a.seconds / 2.0).max(0.2),
            sim_writes: 5_000,
            rounds: a.rounds,
            flush_ahead: aios::rio::OrderedConfig::default().flush_ahead,
        };
        let (all, meds) = ob.run(&progress, &mut |_| {})?;
        aios::bench::ordered::print_header(&mut std::io::stdout()).map_err(io_err)?;
        for s in &meds {
            aios::bench::ordered::print_row(&mut std::io::stdout(), s).map_err(io_err)?;
        }
        ordered_all.extend(all.into_iter().chain(meds));
    }
    drop(ordered_dev);
    written.push(write_jsonl(
        &a.out.join("demo-ordered.jsonl"),
        &ordered_all,
    )?);
    println!("{}", aios::bench::ordered::legend());

    // aiosfs through FUSE beside ext4, each on its own ull device.
    if root && Path::new("/dev/fuse").exists() && fio.is_some() {
        println!("\n== aiosfs through FUSE vs ext4 (two ull devices; aios bench fs)");
        let exe = std::env::current_exe().map_err(io_err)?;
        let setup = aios::bench::fsbench::FsBenchSetup::ull(&exe, &[])?;
        let mut workloads: Vec<String> =
            vec!["randread".into(), "fsync".into(), "createsync".into()];
        if aios::bench::fsbench::postmark_installed() {
            workloads.push("postmark".into());
        }
        let fb = aios::bench::fsbench::FsBench {
            threads: vec![1],
            seconds: (a.seconds / 2.0).max(0.3),
            rounds: a.rounds,
            workloads,
        };
        let samples = fb.run(setup.aios.dir(), setup.ext4.dir(), &mut |_| {})?;
        let meds = aios::bench::fsbench::medians(&samples);
        aios::bench::fsbench::print_table(&mut std::io::stdout(), &meds).map_err(io_err)?;
        written.push(write_jsonl(
            &a.out.join("demo-fs.jsonl"),
            samples.iter().chain(meds.iter()),
        )?);
        drop(setup);
    } else {
        println!("\n(aiosfs vs ext4 skipped: it needs root, /dev/fuse and fio)");
    }
    println!(
        "\nmedians of {} rounds of {} s each; 'lat/fio' = lbio mean latency ÷ fio io_uring's, \
         'IOPS/fio' = lbio IOPS ÷ fio io_uring's, 'lat/psync' = lbio mean latency ÷ fio psync's \
         (or the pread loop's)",
        a.rounds, a.seconds
    );
    println!("report: {}", written.join(", "));
    Ok(())
}
