//! FUSE over io_uring: the kernel's per-CPU request queues (Linux 6.14+, with the `fuse` module
//! parameter `enable_uring` set), served by one thread per CPU pinned to that CPU.
//!
//! With the classic `/dev/fuse` transport every request is a `read` by whichever worker the
//! kernel wakes and a `write` of the answer: two system calls and, as often as not, a wakeup of
//! a thread on another CPU, which on a virtual machine costs an inter-processor interrupt each
//! way. Over io_uring the kernel puts a request in a buffer of the queue of the CPU the caller
//! runs on, completes that queue's pending command, and the answer goes back with the command
//! that fetches the next request (`COMMIT_AND_FETCH`): one `io_uring_enter` per request, on
//! the caller's CPU.
//!
//! The mount still starts on `/dev/fuse` (fuser does the `INIT` handshake, asking for
//! `FUSE_OVER_IO_URING`), and fuser's workers keep serving what never goes through the
//! queues: `FORGET`, interrupts and the end of the session. Once every queue has registered
//! its buffers the kernel sends all other requests here; this module decodes them from the
//! queue buffers (the fixed header in `in_out`, the operation's first argument in `op_in`,
//! the rest in the payload) and answers them with the same [`Fs`] calls the fuser adapter
//! makes.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aios_core::fuse_ring::{pin_current_thread, FuseQueue, HEADER_BYTES};

use crate::format::{put32, put64, u32_at, u64_at, BLOCK, NAME_MAX};
use crate::fs::{Attr, Caller, Fs, SetAttr};
use crate::mount::mknod_mode;

/// The parts of a queue entry's header buffer: the request's or answer's fixed header, the
/// operation's own header, and the entry's bookkeeping (flags, commit id, payload size).
const IN_OUT: usize = 128;
const OP_IN: usize = 128;
const _: () = assert!(HEADER_BYTES == IN_OUT + OP_IN + 32);
const ENT_COMMIT_ID: usize = IN_OUT + OP_IN + 8;
const ENT_PAYLOAD_SZ: usize = IN_OUT + OP_IN + 16;

/// Opcodes served here (the numbers of `enum fuse_opcode`).
mod op {
    pub const LOOKUP: u32 = 1;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const CREATE: u32 = 35;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const FALLOCATE: u32 = 43;
    pub const RENAME2: u32 = 45;
    pub const STATX: u32 = 52;
}

/// `fuse_setattr_in.valid` bits.
const FATTR_MODE: u32 = 1 << 0;
const FATTR_UID: u32 = 1 << 1;
const FATTR_GID: u32 = 1 << 2;
const FATTR_SIZE: u32 = 1 << 3;
const FATTR_ATIME: u32 = 1 << 4;
const FATTR_MTIME: u32 = 1 << 5;
const FATTR_ATIME_NOW: u32 = 1 << 7;
const FATTR_MTIME_NOW: u32 = 1 << 8;
const FATTR_KILL_SUIDGID: u32 = 1 << 11;
/// `fuse_write_in.write_flags`: the writer lacks `CAP_FSETID`; clear set-user-ID and friends.
const FUSE_WRITE_KILL_SUIDGID: u32 = 1 << 2;
/// `fuse_open_out.open_flags`: keep the page cache across opens.
const FOPEN_KEEP_CACHE: u32 = 1 << 1;

/// Whether this kernel sends requests over io_uring: `Err` says why not, in words.
pub fn available() -> Result<(), String> {
    let p = "/sys/module/fuse/parameters/enable_uring";
    match std::fs::read_to_string(p) {
        Ok(s) if s.trim() == "Y" || s.trim() == "1" => Ok(()),
        Ok(s) => Err(format!("{p} is {} (as root: echo 1 > {p})", s.trim())),
        Err(e) => Err(format!(
            "{p}: {e} (a kernel before 6.14, or fuse built without CONFIG_FUSE_IO_URING)"
        )),
    }
}

/// The CPUs the kernel keeps a queue for (`/sys/devices/system/cpu/possible`, e.g. `0-15`).
fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| {
            s.trim()
                .split(',')
                .filter_map(|r| r.rsplit('-').next()?.parse::<usize>().ok())
                .max()
        })
        .map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |m| m + 1,
        )
}

/// What the queue threads share.
pub struct Handler {
    pub fs: Arc<Fs>,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
    /// Serve extended attributes; off, each xattr request is answered ENOSYS, and the kernel
    /// sends no more ([`crate::MountOptions::xattrs`]).
    pub xattrs: bool,
}

/// Called with the reason when a queue fails (see [`Queues::start`]).
pub type OnFailure = Arc<dyn Fn(&str) + Send + Sync>;

/// The queue threads of one mount; they end when the session does.
pub struct Queues {
    pub queues: usize,
    pub depth: usize,
    /// Requests answered over io_uring (all queues), per opcode.
    pub stats: Arc<OpStats>,
    threads: Vec<std::thread::JoinHandle<Result<(), String>>>,
}

impl Queues {
    /// Start one thread per possible CPU, each registering `depth` entries with payload
    /// buffers of `payload` bytes on its CPU's queue of the connection behind `dev` (a
    /// duplicate of the session's `/dev/fuse` descriptor). Registration is retried while the
    /// kernel has not finished the `INIT` handshake. Between requests a thread spins on its
    /// queue for up to `spin`, then sleeps.
    ///
    /// A queue that fails (or waits in vain for INIT) is logged; `on_failure`, when given, is
    /// then called with the reason, from that queue's thread (`--transport uring` ends the
    /// mount there rather than let `/dev/fuse` serve it).
    pub fn start(
        dev: OwnedFd,
        handler: Arc<Handler>,
        negotiated: Arc<std::sync::Mutex<Option<bool>>>,
        depth: usize,
        payload: usize,
        spin: Duration,
        on_failure: Option<OnFailure>,
    ) -> std::io::Result<Queues> {
        let dev = Arc::new(dev);
        let n = possible_cpus();
        let stats = Arc::new(OpStats::default());
        let mut threads = Vec::with_capacity(n);
        for qid in 0..n {
            let dev = Arc::clone(&dev);
            let h = Arc::clone(&handler);
            let stats = Arc::clone(&stats);
            let negotiated = Arc::clone(&negotiated);
            let on_failure = on_failure.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("aiosfs-q{qid}"))
                    .spawn(move || {
                        // fuser answers INIT once the session runs; register only if it
                        // granted io_uring.
                        let t0 = Instant::now();
                        loop {
                            let g = *negotiated.lock().unwrap_or_else(|p| p.into_inner());
                            match g {
                                Some(true) => break,
                                Some(false) => {
                                    if qid == 0 {
                                        eprintln!("aiosfs: the kernel did not offer FUSE over io_uring at INIT; requests stay on /dev/fuse");
                                    }
                                    return Ok(());
                                }
                                None if t0.elapsed() > Duration::from_secs(60) => {
                                    let e = format!("queue {qid}: no INIT after 60 s");
                                    eprintln!("aiosfs: {e}");
                                    if let Some(f) = &on_failure {
                                        f(&e);
                                    }
                                    return Err(e);
                                }
                                None => std::thread::sleep(Duration::from_millis(2)),
                            }
                        }
                        let r = serve_queue(dev, qid as u16, depth, payload, spin, &h, &stats);
                        if let Err(e) = &r {
                            // The kernel turns io_uring off for the connection when a
                            // registration fails; fuser's workers then serve everything.
                            eprintln!("aiosfs: {e}");
                            if let Some(f) = &on_failure {
                                f(e);
                            }
                        }
                        r
                    })?,
            );
        }
        Ok(Queues {
            queues: n,
            depth,
            stats,
            threads,
        })
    }

    /// Wait for the queue threads (after the session has ended); their errors, in words (each
    /// was logged when it happened).
    pub fn join(self) -> Vec<String> {
        self.threads
            .into_iter()
            .filter_map(|t| match t.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some("a queue thread panicked".into()),
            })
            .collect()
    }
}

fn serve_queue(
    dev: Arc<OwnedFd>,
    qid: u16,
    depth: usize,
    payload: usize,
    spin: Duration,
    h: &Handler,
    stats: &OpStats,
) -> Result<(), String> {
    // An offline CPU cannot be pinned to; its queue is then served from wherever the thread
    // runs.
    let _ = pin_current_thread(qid as usize);
    let mut q = FuseQueue::new(dev, qid, depth, payload)
        .map_err(|e| format!("queue {qid}: io_uring with 128-byte entries: {e}"))?;
    let io = |e: std::io::Error| format!("queue {qid}: {e}");
    for i in 0..q.depth() {
        q.register(i).map_err(io)?;
    }
    let started = Instant::now();
    let mut budget = SpinBudget::new(spin);
    loop {
        let done = q.submit_and_spin(budget.next()).map_err(io)?;
        budget.saw(q.caught_spinning());
        for c in done {
            let i = c.entry;
            if c.result < 0 {
                let errno = -c.result;
                // Before the kernel has taken the INIT answer it refuses registrations; try
                // again for a while.
                if errno == libc::EAGAIN && started.elapsed() < Duration::from_secs(10) {
                    std::thread::sleep(Duration::from_millis(5));
                    q.register(i).map_err(io)?;
                    continue;
                }
                // The connection ended (unmount or abort): the queue is done.
                if [libc::ENOTCONN, libc::ENODEV, libc::ECANCELED, libc::EINTR].contains(&errno) {
                    return Ok(());
                }
                return Err(format!(
                    "queue {qid}: the kernel answered a FUSE io_uring command with {}",
                    std::io::Error::from_raw_os_error(errno)
                ));
            }
            let commit_id = u64_at(q.header(i), ENT_COMMIT_ID);
            let (header, payload) = q.buffers_mut(i);
            let t0 = Instant::now();
            let opcode = dispatch(h, header, payload);
            stats.add(opcode, t0.elapsed());
            let end = opcode == op::DESTROY;
            q.commit_and_fetch(i, commit_id).map_err(io)?;
            if end {
                // DESTROY answered: nothing more comes on this queue.
                q.submit().map_err(io)?;
                return Ok(());
            }
        }
    }
}

/// How long a queue thread spins for its next request, adapted to whether spinning pays.
///
/// A spin that times out halves the next one; a spin that catches a request doubles it, up to
/// the configured spin. Below 8 µs the thread sleeps at once, trying a spin again every 64th
/// wait. Where requests come back to the queue soon after each answer (one process issuing them
/// one after another from this CPU), spins catch them and the full spin is kept. Where they do
/// not, the spinning is dropped. On a 16-vCPU VM, one unpinned fio job reading at QD1 took
/// 100-117 µs a read through a mount spinning 500 µs at every wait, 31 µs through one that
/// slept at once, and 19.5 µs spinning with fio pinned to one CPU (its requests then all come
/// to one queue): the spinning thread, on the CPU the reader had run on, cost the reader more
/// than it saved once the reader moved.
struct SpinBudget {
    max: Duration,
    cur: Duration,
    waits: u32,
    spun: bool,
}

impl SpinBudget {
    const FLOOR: Duration = Duration::from_micros(8);

    fn new(max: Duration) -> SpinBudget {
        SpinBudget {
            max,
            cur: max,
            waits: 0,
            spun: false,
        }
    }

    /// The spin for the next wait.
    fn next(&mut self) -> Duration {
        self.waits = self.waits.wrapping_add(1);
        let spin = if self.cur.is_zero() && self.waits % 64 == 0 {
            // A probe: does spinning pay again?
            (self.max / 4).max(Self::FLOOR).min(self.max)
        } else {
            self.cur
        };
        self.spun = !spin.is_zero();
        spin
    }

    /// How the wait went: `caught` when a request came while spinning.
    fn saw(&mut self, caught: bool) {
        if !self.spun {
            return;
        }
        self.cur = if caught {
            (self.cur * 2).max(Self::FLOOR * 2).min(self.max)
        } else {
            let half = self.cur / 2;
            if half < Self::FLOOR {
                Duration::ZERO
            } else {
                half
            }
        };
    }
}

/// Requests served and the time spent in them, per opcode.
pub struct OpStats {
    count: [AtomicU64; 64],
    ns: [AtomicU64; 64],
}

impl Default for OpStats {
    fn default() -> Self {
        OpStats {
            count: std::array::from_fn(|_| AtomicU64::new(0)),
            ns: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl OpStats {
    fn add(&self, opcode: u32, t: Duration) {
        let i = (opcode as usize).min(63);
        self.count[i].fetch_add(1, Ordering::Relaxed);
        self.ns[i].fetch_add(t.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Total requests, and the operations that took the most time: `write 4000 × 12.5 us`.
    pub fn summary(&self, top: usize) -> (u64, String) {
        let mut rows: Vec<(u64, u64, usize)> = (0..64)
            .map(|i| {
                (
                    self.ns[i].load(Ordering::Relaxed),
                    self.count[i].load(Ordering::Relaxed),
                    i,
                )
            })
            .filter(|r| r.1 > 0)
            .collect();
        let total = rows.iter().map(|r| r.1).sum();
        rows.sort_by_key(|r| std::cmp::Reverse(r.0));
        let text = rows
            .iter()
            .take(top)
            .map(|&(ns, n, i)| {
                format!(
                    "{} {n} × {:.1} us",
                    op_name(i as u32),
                    ns as f64 / n as f64 / 1e3
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        (total, text)
    }
}

fn op_name(opcode: u32) -> String {
    let n = match opcode {
        op::LOOKUP => "lookup",
        op::GETATTR => "getattr",
        op::SETATTR => "setattr",
        op::READLINK => "readlink",
        op::SYMLINK => "symlink",
        op::MKNOD => "mknod",
        op::MKDIR => "mkdir",
        op::UNLINK => "unlink",
        op::RMDIR => "rmdir",
        op::RENAME => "rename",
        op::LINK => "link",
        op::OPEN => "open",
        op::READ => "read",
        op::WRITE => "write",
        op::STATFS => "statfs",
        op::RELEASE => "release",
        op::FSYNC => "fsync",
        op::SETXATTR => "setxattr",
        op::GETXATTR => "getxattr",
        op::LISTXATTR => "listxattr",
        op::REMOVEXATTR => "removexattr",
        op::FLUSH => "flush",
        op::OPENDIR => "opendir",
        op::READDIR => "readdir",
        op::RELEASEDIR => "releasedir",
        op::FSYNCDIR => "fsyncdir",
        op::CREATE => "create",
        op::DESTROY => "destroy",
        op::FALLOCATE => "fallocate",
        op::RENAME2 => "rename2",
        // Neither is served (ENOSYS); the kernel keeps sending ioctls (a program's isatty()
        // on a file is one).
        op::IOCTL => "ioctl",
        op::STATX => "statx",
        other => return format!("opcode {other}"),
    };
    n.into()
}

/// The NUL-terminated strings at the start of `b`, in order (at most `n`).
fn names(b: &[u8], n: usize) -> Option<Vec<&[u8]>> {
    let mut out = Vec::with_capacity(n);
    let mut rest = b;
    for _ in 0..n {
        let z = rest.iter().position(|&c| c == 0)?;
        out.push(&rest[..z]);
        rest = &rest[z + 1..];
    }
    Some(out)
}

/// `struct fuse_attr` (88 bytes) for `a`.
fn put_attr(b: &mut [u8], a: &Attr) {
    put64(b, 0, a.ino);
    put64(b, 8, a.size);
    put64(b, 16, a.blocks);
    put64(b, 24, a.atime.0 as u64);
    put64(b, 32, a.mtime.0 as u64);
    put64(b, 40, a.ctime.0 as u64);
    put32(b, 48, a.atime.1);
    put32(b, 52, a.mtime.1);
    put32(b, 56, a.ctime.1);
    put32(b, 60, a.mode);
    put32(b, 64, a.nlink);
    put32(b, 68, a.uid);
    put32(b, 72, a.gid);
    put32(b, 76, a.rdev);
    put32(b, 80, BLOCK as u32);
    put32(b, 84, 0);
}

/// An answer: the bytes written at the start of the payload, or an errno.
type Answer = Result<usize, i32>;

/// Decode the request in an entry's buffers, run it, write the answer's header and payload;
/// returns the opcode.
pub fn dispatch(h: &Handler, header: &mut [u8], payload: &mut [u8]) -> u32 {
    let hd = &*header;
    let opcode = u32_at(hd, 4);
    let unique = u64_at(hd, 8);
    let nodeid = u64_at(hd, 16);
    let caller = Caller {
        uid: u32_at(hd, 24),
        gid: u32_at(hd, 28),
    };
    let op_in: [u8; OP_IN] = hd[IN_OUT..IN_OUT + OP_IN].try_into().expect("op_in");
    let in_sz = (u32_at(hd, ENT_PAYLOAD_SZ) as usize).min(payload.len());
    // The input is copied out of the payload buffer only where the answer may overwrite it
    // (names are short; write data is consumed before the answer is written).
    //
    // A handler that panics is answered EIO, as fuser answers a reply dropped by a panic. If
    // the panic unwound the queue thread instead, its entry would never be committed: the
    // queue (every later request from that CPU) would stall until the connection is aborted.
    // What the handler was changing may be half done: the file system takes no more changes.
    let answer = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(h, opcode, nodeid, caller, &op_in, in_sz, payload)
    }))
    .unwrap_or_else(|_| {
        h.fs.fail(&format!(
            "a {} request panicked (answered EIO)",
            op_name(opcode)
        ));
        Err(libc::EIO)
    });
    let hd = header;
    hd[..IN_OUT].fill(0);
    let (len, error) = match answer {
        Ok(n) => (n, 0i32),
        Err(e) => (0, -e),
    };
    put32(hd, 0, (16 + len) as u32);
    put32(hd, 4, error as u32);
    put64(hd, 8, unique);
    put32(hd, ENT_PAYLOAD_SZ, len as u32);
    opcode
}

fn ttl(d: Duration) -> (u64, u32) {
    (d.as_secs(), d.subsec_nanos())
}

fn entry_out(h: &Handler, out: &mut [u8], a: &Attr) -> usize {
    out[..128].fill(0);
    let (es, en) = ttl(h.entry_ttl);
    let (as_, an) = ttl(h.attr_ttl);
    put64(out, 0, a.ino);
    put64(out, 8, a.generation as u64);
    put64(out, 16, es);
    put64(out, 24, as_);
    put32(out, 32, en);
    put32(out, 36, an);
    put_attr(&mut out[40..128], a);
    128
}

fn attr_out(h: &Handler, out: &mut [u8], a: &Attr) -> usize {
    out[..104].fill(0);
    let (s, n) = ttl(h.attr_ttl);
    put64(out, 0, s);
    put32(out, 8, n);
    put_attr(&mut out[16..104], a);
    104
}

fn open_out(out: &mut [u8], flags: u32) -> usize {
    out[..16].fill(0);
    put32(out, 8, flags);
    16
}

fn data(out: &mut [u8], d: &[u8]) -> Answer {
    if d.len() > out.len() {
        return Err(libc::EIO);
    }
    out[..d.len()].copy_from_slice(d);
    Ok(d.len())
}

/// An xattr value or list: its size when the caller asked for the size, else the bytes.
fn xattr_answer(out: &mut [u8], v: Vec<u8>, size: u32) -> Answer {
    if size == 0 {
        out[..8].fill(0);
        put32(out, 0, v.len() as u32);
        return Ok(8);
    }
    if v.len() > size as usize {
        return Err(libc::ERANGE);
    }
    data(out, &v)
}

fn run(
    h: &Handler,
    opcode: u32,
    nodeid: u64,
    caller: Caller,
    op_in: &[u8; OP_IN],
    in_sz: usize,
    payload: &mut [u8],
) -> Answer {
    let fs = &h.fs;
    // Names and small arguments, copied so the answer can be written over the payload.
    let small = || payload[..in_sz.min(2 * (NAME_MAX + 1) + BLOCK + 64)].to_vec();
    // mknod, mkdir and create: the name is the payload's first string.
    let new_node = |mode: u32, rdev: u32| {
        let p = small();
        let n = names(&p, 1).ok_or(libc::EINVAL)?;
        fs.mknod(nodeid, n[0], mode, rdev, caller, None)
    };
    match opcode {
        // ENOSYS once, and the kernel asks no more (the mount runs with xattrs off).
        op::SETXATTR | op::GETXATTR | op::LISTXATTR | op::REMOVEXATTR if !h.xattrs => {
            Err(libc::ENOSYS)
        }
        op::LOOKUP => {
            let p = small();
            let n = names(&p, 1).ok_or(libc::EINVAL)?;
            let a = fs.lookup(nodeid, n[0], true)?;
            Ok(entry_out(h, payload, &a))
        }
        op::GETATTR => {
            let a = fs.getattr(nodeid)?;
            Ok(attr_out(h, payload, &a))
        }
        op::SETATTR => {
            let valid = u32_at(op_in, 0);
            let has = |f: u32| valid & f != 0;
            let time = |f: u32, now: u32, s: usize, ns: usize| {
                if has(now) {
                    Some(None)
                } else if has(f) {
                    Some(Some((u64_at(op_in, s) as i64, u32_at(op_in, ns))))
                } else {
                    None
                }
            };
            let set = SetAttr {
                mode: has(FATTR_MODE).then(|| u32_at(op_in, 68)),
                uid: has(FATTR_UID).then(|| u32_at(op_in, 76)),
                gid: has(FATTR_GID).then(|| u32_at(op_in, 80)),
                size: has(FATTR_SIZE).then(|| u64_at(op_in, 16)),
                atime: time(FATTR_ATIME, FATTR_ATIME_NOW, 32, 56),
                mtime: time(FATTR_MTIME, FATTR_MTIME_NOW, 40, 60),
                kill_privs: has(FATTR_KILL_SUIDGID),
            };
            let a = fs.setattr(nodeid, &set)?;
            Ok(attr_out(h, payload, &a))
        }
        op::READLINK => {
            let t = fs.readlink(nodeid)?;
            data(payload, &t)
        }
        op::SYMLINK => {
            let p = small();
            let n = names(&p, 2).ok_or(libc::EINVAL)?;
            let (name, target) = (n[0], n[1]);
            if target.is_empty() {
                return Err(libc::ENOENT);
            }
            if target.len() >= BLOCK {
                return Err(libc::ENAMETOOLONG);
            }
            let a = fs.mknod(nodeid, name, libc::S_IFLNK | 0o777, 0, caller, Some(target))?;
            Ok(entry_out(h, payload, &a))
        }
        op::MKNOD => {
            let mode = mknod_mode(u32_at(op_in, 0), u32_at(op_in, 8))?;
            let a = new_node(mode, u32_at(op_in, 4))?;
            Ok(entry_out(h, payload, &a))
        }
        op::MKDIR => {
            let (mode, umask) = (u32_at(op_in, 0), u32_at(op_in, 4));
            let a = new_node(libc::S_IFDIR | (mode & 0o7777 & !umask), 0)?;
            Ok(entry_out(h, payload, &a))
        }
        op::UNLINK | op::RMDIR => {
            let p = small();
            let n = names(&p, 1).ok_or(libc::EINVAL)?;
            fs.remove(nodeid, n[0], opcode == op::RMDIR)?;
            Ok(0)
        }
        op::RENAME | op::RENAME2 => {
            let newdir = u64_at(op_in, 0);
            let flags = if opcode == op::RENAME2 {
                u32_at(op_in, 8)
            } else {
                0
            };
            let p = small();
            let n = names(&p, 2).ok_or(libc::EINVAL)?;
            fs.rename(nodeid, n[0], newdir, n[1], flags)?;
            Ok(0)
        }
        op::LINK => {
            let old = u64_at(op_in, 0);
            let p = small();
            let n = names(&p, 1).ok_or(libc::EINVAL)?;
            let a = fs.link(old, nodeid, n[0])?;
            Ok(entry_out(h, payload, &a))
        }
        // See the /dev/fuse adapter's `open`: ENOSYS, and the kernel opens files by itself
        // from then on (no OPEN, no RELEASE).
        op::OPEN => Err(libc::ENOSYS),
        op::READ => {
            let (offset, size) = (u64_at(op_in, 8), u32_at(op_in, 16));
            // fuse_read_in.flags: the file's open flags.
            let direct = u32_at(op_in, 32) as i32 & libc::O_DIRECT != 0;
            let size = (size as usize).min(payload.len());
            fs.read_into(nodeid, offset, &mut payload[..size], direct)
        }
        op::WRITE => {
            let (offset, size) = (u64_at(op_in, 8), u32_at(op_in, 16) as usize);
            let kill = u32_at(op_in, 20) & FUSE_WRITE_KILL_SUIDGID != 0;
            if size > in_sz {
                return Err(libc::EINVAL);
            }
            let n = fs.write_as(nodeid, offset, &payload[..size], kill)?;
            payload[..8].fill(0);
            put32(payload, 0, n as u32);
            Ok(8)
        }
        op::STATFS => {
            let s = fs.statfs();
            payload[..80].fill(0);
            put64(payload, 0, s.blocks);
            put64(payload, 8, s.bfree);
            put64(payload, 16, s.bfree);
            put64(payload, 24, s.files);
            put64(payload, 32, s.ffree);
            put32(payload, 40, BLOCK as u32);
            put32(payload, 44, NAME_MAX as u32);
            put32(payload, 48, BLOCK as u32);
            Ok(80)
        }
        // Opens are not counted (see OPEN and CREATE); the FORGET ends a file's life.
        op::RELEASE => Ok(0),
        op::FSYNC => {
            // fuse_fsync_in.fsync_flags bit 0: fdatasync.
            fs.fsync_as(nodeid, u32_at(op_in, 8) & 1 != 0)?;
            Ok(0)
        }
        op::FSYNCDIR => {
            fs.fsync(nodeid)?;
            Ok(0)
        }
        op::SETXATTR => {
            let (size, flags) = (u32_at(op_in, 0) as usize, u32_at(op_in, 4) as i32);
            let p = payload[..in_sz].to_vec();
            let z = p.iter().position(|&c| c == 0).ok_or(libc::EINVAL)?;
            let value = p.get(z + 1..z + 1 + size).ok_or(libc::EINVAL)?;
            fs.setxattr(nodeid, &p[..z], value, flags)?;
            Ok(0)
        }
        op::GETXATTR => {
            let size = u32_at(op_in, 0);
            let p = small();
            let n = names(&p, 1).ok_or(libc::EINVAL)?;
            let v = fs.getxattr(nodeid, n[0])?;
            xattr_answer(payload, v, size)
        }
        op::LISTXATTR => {
            let size = u32_at(op_in, 0);
            let v = fs.listxattr(nodeid)?;
            xattr_answer(payload, v, size)
        }
        op::REMOVEXATTR => {
            let p = small();
            let n = names(&p, 1).ok_or(libc::EINVAL)?;
            fs.removexattr(nodeid, n[0])?;
            Ok(0)
        }
        // Nothing to do at a close (no POSIX locks here, and data goes out at fsync or commit):
        // ENOSYS tells the kernel so, and it sends no FLUSH again on this mount.
        op::FLUSH => Err(libc::ENOSYS),
        op::RELEASEDIR | op::DESTROY => Ok(0),
        op::OPENDIR => {
            let a = fs.getattr(nodeid)?;
            if a.mode & libc::S_IFMT != libc::S_IFDIR {
                return Err(libc::ENOTDIR);
            }
            Ok(open_out(payload, 0))
        }
        op::READDIR => {
            let (offset, size) = (u64_at(op_in, 8), u32_at(op_in, 16) as usize);
            let cap = size.min(payload.len());
            let mut len = 0usize;
            fs.readdir(nodeid, offset, |next, ino, kind, name| {
                // struct fuse_dirent: ino, off, namelen, type, then the name, padded to 8.
                let rec = (24 + name.len() + 7) & !7;
                if len + rec > cap {
                    return true;
                }
                let b = &mut payload[len..len + rec];
                b.fill(0);
                put64(b, 0, ino);
                put64(b, 8, next);
                put32(b, 16, name.len() as u32);
                put32(b, 20, kind as u32);
                b[24..24 + name.len()].copy_from_slice(name);
                len += rec;
                false
            })?;
            Ok(len)
        }
        op::CREATE => {
            let (mode, umask) = (u32_at(op_in, 4), u32_at(op_in, 8));
            let a = new_node(libc::S_IFREG | (mode & 0o7777 & !umask), 0)?;
            // Not counted as an open (see OPEN): the lookup this reply gives the kernel keeps
            // the file while it is open.
            let e = entry_out(h, payload, &a);
            Ok(e + open_out(&mut payload[e..], FOPEN_KEEP_CACHE))
        }
        op::FALLOCATE => {
            let (offset, length, mode) = (
                u64_at(op_in, 8),
                u64_at(op_in, 16),
                u32_at(op_in, 24) as i32,
            );
            fs.fallocate(nodeid, offset, length, mode)?;
            Ok(0)
        }
        // What the fuser adapter does not implement either: the kernel falls back (local
        // locks, generic lseek, copy through the page cache) or reports it unsupported.
        // FORGET and BATCH_FORGET never come here: the kernel sends them over /dev/fuse, where
        // fuser's workers take them (`Fs::forget`, which frees an unlinked file).
        _ => Err(libc::ENOSYS),
    }
}
