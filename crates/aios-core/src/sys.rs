//! Thin, safe wrappers over the few Linux calls the engine and its users need beyond io_uring.
//!
//! Every `unsafe` block here calls into libc with arguments whose validity is stated next to it.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

/// Open `path` for direct I/O (`O_DIRECT`), read-write when `write` is set.
///
/// Errors keep the raw OS error so callers can tell "no such file" from "this file system has no
/// direct I/O" (`EINVAL`).
pub fn open_direct(path: &Path, write: bool) -> io::Result<OwnedFd> {
    open_with(path, write, libc::O_DIRECT)
}

/// Open `path` for buffered I/O, read-write when `write` is set.
pub fn open_buffered(path: &Path, write: bool) -> io::Result<OwnedFd> {
    open_with(path, write, 0)
}

fn open_with(path: &Path, write: bool, extra: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mode = if write { libc::O_RDWR } else { libc::O_RDONLY };
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call; the flags are plain ints.
    let fd = unsafe { libc::open(c.as_ptr(), mode | libc::O_CLOEXEC | extra) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `open` returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Direct-I/O alignment of an open file, from `statx(STATX_DIOALIGN)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of the user buffer's address, bytes.
    pub mem_align: u32,
    /// Required alignment of file offsets and lengths, bytes.
    pub offset_align: u32,
}

/// `statx` results the probe uses.
#[derive(Clone, Copy, Debug)]
pub struct Statx {
    pub mode: u32,
    pub size: u64,
    pub blksize: u32,
    /// `None` when the file system does not report `STATX_DIOALIGN` (or reports 0: no direct I/O).
    pub dio: Option<DioAlign>,
    pub rdev_major: u32,
    pub rdev_minor: u32,
    pub dev_major: u32,
    pub dev_minor: u32,
    /// Bytes actually allocated (512-byte blocks × 512).
    pub allocated_bytes: u64,
}

impl Statx {
    pub fn is_block_device(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFBLK
    }
    pub fn is_char_device(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFCHR
    }
    pub fn is_regular(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFREG
    }
    pub fn is_dir(&self) -> bool {
        self.mode & libc::S_IFMT == libc::S_IFDIR
    }
}

/// `statx` on an open descriptor.
pub fn statx(fd: RawFd) -> io::Result<Statx> {
    // SAFETY: an all-zero `statx` is a valid value of this plain C struct.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    let empty = c"";
    let mask = libc::STATX_BASIC_STATS | libc::STATX_DIOALIGN;
    // SAFETY: `fd` is an open descriptor owned by the caller, the path is an empty C string used
    // with AT_EMPTY_PATH, and `st` is a valid, writable statx buffer.
    let rc = unsafe { libc::statx(fd, empty.as_ptr(), libc::AT_EMPTY_PATH, mask, &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let dio = if st.stx_mask & libc::STATX_DIOALIGN != 0 && st.stx_dio_offset_align != 0 {
        Some(DioAlign {
            mem_align: st.stx_dio_mem_align,
            offset_align: st.stx_dio_offset_align,
        })
    } else {
        None
    };
    Ok(Statx {
        mode: st.stx_mode as u32,
        size: st.stx_size,
        blksize: st.stx_blksize,
        dio,
        rdev_major: st.stx_rdev_major,
        rdev_minor: st.stx_rdev_minor,
        dev_major: st.stx_dev_major,
        dev_minor: st.stx_dev_minor,
        allocated_bytes: st.stx_blocks * 512,
    })
}

/// `_IOR(0x12, 114, size_t)`: libc does not export it.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// The first offset at or after `from` that holds data (`lseek(SEEK_DATA)`); `None` when the
/// rest of the file is a hole.
pub fn next_data_offset(fd: RawFd, from: u64) -> Option<u64> {
    // SAFETY: plain syscall on a descriptor the caller owns.
    let r = unsafe { libc::lseek(fd, from as libc::off_t, libc::SEEK_DATA) };
    (r >= 0).then_some(r as u64)
}

/// Size in bytes of an open block device (`BLKGETSIZE64`).
pub fn block_device_bytes(fd: RawFd) -> io::Result<u64> {
    let mut bytes: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at a live local.
    let rc = unsafe { libc::ioctl(fd, BLKGETSIZE64, &mut bytes as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(bytes)
}

/// Logical block size in bytes of an open block device (`BLKSSZGET`).
pub fn block_device_logical_block(fd: RawFd) -> io::Result<u32> {
    let mut bytes: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, which points at a live local.
    let rc = unsafe { libc::ioctl(fd, libc::BLKSSZGET, &mut bytes as *mut libc::c_int) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(bytes as u32)
}

/// `pread` into a raw buffer.
///
/// # Safety
/// `ptr` must be valid for writes of `len` bytes for the duration of the call.
pub unsafe fn pread_raw(fd: RawFd, ptr: *mut u8, len: usize, offset: u64) -> io::Result<usize> {
    // SAFETY: the caller guarantees `ptr..ptr+len` is writable; offset fits off_t on 64-bit Linux.
    let rc = unsafe { libc::pread(fd, ptr.cast(), len, offset as libc::off_t) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as usize)
}

/// `pwritev2` from a raw buffer, with `RWF_DSYNC` when `dsync` is set (a FUA write).
///
/// # Safety
/// `ptr` must be valid for reads of `len` bytes for the duration of the call.
pub unsafe fn pwrite_raw(
    fd: RawFd,
    ptr: *const u8,
    len: usize,
    offset: u64,
    dsync: bool,
) -> io::Result<usize> {
    let iov = libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `iov` describes memory the caller guarantees readable; one iovec is passed.
    unsafe { pwritev_raw(fd, &iov, 1, offset, dsync) }
}

/// `preadv` into `count` iovecs.
///
/// # Safety
/// Every iovec must describe memory writable for its length for the duration of the call.
pub unsafe fn preadv_raw(
    fd: RawFd,
    iov: *const libc::iovec,
    count: usize,
    offset: u64,
) -> io::Result<usize> {
    // SAFETY: the caller guarantees the iovecs; `count` is the array's length.
    let rc = unsafe { libc::preadv(fd, iov, count as libc::c_int, offset as libc::off_t) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as usize)
}

/// `pwritev2` from `count` iovecs, with `RWF_DSYNC` when `dsync` is set (a FUA write).
///
/// # Safety
/// Every iovec must describe memory readable for its length for the duration of the call.
pub unsafe fn pwritev_raw(
    fd: RawFd,
    iov: *const libc::iovec,
    count: usize,
    offset: u64,
    dsync: bool,
) -> io::Result<usize> {
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    // SAFETY: the caller guarantees the iovecs; `count` is the array's length.
    let rc = unsafe { libc::pwritev2(fd, iov, count as libc::c_int, offset as libc::off_t, flags) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(rc as usize)
}

/// `pread` into a slice (for direct I/O the slice must meet the device's alignment).
pub fn pread_into(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    // SAFETY: the slice is valid and writable for its whole length during the call.
    unsafe { pread_raw(fd, buf.as_mut_ptr(), buf.len(), offset) }
}

/// `pwritev2` from a slice, with `RWF_DSYNC` when `dsync` is set.
pub fn pwrite_from(fd: RawFd, buf: &[u8], offset: u64, dsync: bool) -> io::Result<usize> {
    // SAFETY: the slice is valid and readable for its whole length during the call.
    unsafe { pwrite_raw(fd, buf.as_ptr(), buf.len(), offset, dsync) }
}

/// `fdatasync` on an open descriptor.
pub fn fdatasync(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller owns.
    if unsafe { libc::fdatasync(fd) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Advice for [`fadvise`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Drop the range from the kernel's page cache (clean pages).
    DontNeed,
    /// Random access: no readahead.
    Random,
}

/// `posix_fadvise` on a range (`len` 0: to the end).
pub fn fadvise(fd: RawFd, offset: u64, len: u64, advice: Advice) -> io::Result<()> {
    let a = match advice {
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
        Advice::Random => libc::POSIX_FADV_RANDOM,
    };
    // SAFETY: plain syscall on a descriptor the caller owns; no memory is passed.
    let rc = unsafe { libc::posix_fadvise(fd, offset as libc::off_t, len as libc::off_t, a) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// CPU time (user + system) consumed so far by the calling thread.
pub fn thread_cpu_time() -> Duration {
    cpu_time(libc::RUSAGE_THREAD)
}

/// CPU time (user + system) consumed so far by the whole process.
pub fn process_cpu_time() -> Duration {
    cpu_time(libc::RUSAGE_SELF)
}

/// CPU time of this process so far, in user space and in the kernel: `(user, system)`.
pub fn process_cpu_split() -> (Duration, Duration) {
    cpu_split(libc::RUSAGE_SELF)
}

fn cpu_time(who: libc::c_int) -> Duration {
    let (user, system) = cpu_split(who);
    user + system
}

fn cpu_split(who: libc::c_int) -> (Duration, Duration) {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, (t.tv_usec as u32) * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

/// The soft `RLIMIT_MEMLOCK` in bytes (`None` = unlimited).
pub fn memlock_limit() -> io::Result<Option<u64>> {
    // SAFETY: an all-zero rlimit is valid; getrlimit fills it.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `rl` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(if rl.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(rl.rlim_cur)
    })
}

/// Whether this process holds `CAP_IPC_LOCK` in its effective set (then memlock is not enforced).
pub fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let status = match std::fs::read_to_string("/proc/self/status") {
        Ok(s) => s,
        Err(_) => return false,
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// A non-blocking, close-on-exec eventfd.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned descriptor is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `eventfd` returned a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Reset an eventfd's counter; returns how many signals it had collected (0 when none).
pub fn eventfd_drain(fd: &OwnedFd) -> u64 {
    let mut v: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd.
    let rc = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    if rc == 8 {
        v
    } else {
        0
    }
}

/// Read a sysfs attribute of the block device `major:minor` (or of its parent disk, for a
/// partition, whose `queue/` lives one level up).
pub fn block_queue_attr(major: u32, minor: u32, attr: &str) -> Option<String> {
    let base = format!("/sys/dev/block/{major}:{minor}");
    for dir in [format!("{base}/queue"), format!("{base}/../queue")] {
        if let Ok(s) = std::fs::read_to_string(format!("{dir}/{attr}")) {
            return Some(s.trim().to_string());
        }
    }
    None
}

/// The file-system type name of the mount holding `path`, from `/proc/self/mountinfo`.
pub fn fs_type_of(path: &Path) -> Option<String> {
    let canon = std::fs::canonicalize(path).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    fs_type_in(&info, &canon)
}

/// [`fs_type_of`] on the text of a `mountinfo` file, for the canonical path `canon`: the
/// deepest mount point holding it (the last one listed, where mounts stack).
fn fs_type_in(mountinfo: &str, canon: &Path) -> Option<String> {
    let mut best: Option<(usize, String)> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let (Some(mount_point), Some(fstype)) = (left.split(' ').nth(4), right.split(' ').next())
        else {
            continue;
        };
        // The kernel writes a space, tab, newline or backslash in a mount point as an octal
        // escape (`\040`): compared as written, such a mount never held anything.
        let mount_point = unescape_octal(mount_point);
        let depth = mount_point.len();
        if canon.starts_with(Path::new(std::ffi::OsStr::from_bytes(&mount_point)))
            && best.as_ref().is_none_or(|b| depth >= b.0)
        {
            best = Some((depth, fstype.to_string()));
        }
    }
    best.map(|b| b.1)
}

/// A `mountinfo` field with its `\ooo` escapes turned back into the bytes they stand for.
fn unescape_octal(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let digits = b.get(i + 1..i + 4);
        match digits {
            Some(d) if b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)) => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(v as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// The calling thread's id (what `/proc/self/task` lists it under).
pub fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Where the kernel takes PM QoS requests on CPU wake-up latency.
pub const CPU_LATENCY_QOS: &str = "/dev/cpu_dma_latency";

/// A PM QoS request on CPU wake-up latency (`/dev/cpu_dma_latency`), held for as long as the
/// value lives and withdrawn when it drops (the kernel drops it with the file descriptor).
///
/// While a request of `us` microseconds is held, the cpuidle governor keeps every CPU out of
/// idle states whose exit takes longer, system-wide: with 0, an idle CPU polls instead of
/// halting, so a thread woken on it (the loop device's worker, an interrupt's task work) runs
/// at once. In a VM whose idle vCPUs halt, waking one goes through the host and takes
/// microseconds to tens of microseconds. The price is power, and in a VM the host CPU time the
/// polling vCPUs take; the polling is idle time, not the process's CPU time.
///
/// ```no_run
/// let _qos = aios_core::sys::CpuLatencyRequest::new(0)?; // held until dropped
/// // ... latency-critical I/O ...
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct CpuLatencyRequest {
    _file: std::fs::File,
    us: u32,
}

impl CpuLatencyRequest {
    /// Ask for CPU wake-ups within `us` microseconds. Needs write access to
    /// `/dev/cpu_dma_latency` (root); the error says so.
    pub fn new(us: u32) -> io::Result<Self> {
        use std::io::Write;
        let value = i32::try_from(us).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a CPU latency of {us} µs is above the {} µs a request can hold",
                    i32::MAX
                ),
            )
        })?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(CPU_LATENCY_QOS)
            .map_err(|e| {
                let why = match e.kind() {
                    io::ErrorKind::PermissionDenied => "needs root (or write access to the file)",
                    io::ErrorKind::NotFound => "this kernel has no CPU latency PM QoS",
                    _ => "cannot open it",
                };
                io::Error::new(e.kind(), format!("{CPU_LATENCY_QOS}: {e}: {why}"))
            })?;
        // The request is the binary 32-bit value; it stands while the file stays open.
        f.write_all(&value.to_ne_bytes())
            .map_err(|e| io::Error::new(e.kind(), format!("{CPU_LATENCY_QOS}: writing: {e}")))?;
        Ok(CpuLatencyRequest { _file: f, us })
    }

    /// The latency asked for, in microseconds.
    pub fn us(&self) -> u32 {
        self.us
    }

    /// The limit in force now (the lowest of every request held on the system), in
    /// microseconds.
    pub fn effective_us() -> io::Result<u32> {
        use std::io::Read;
        let mut f = std::fs::File::open(CPU_LATENCY_QOS)?;
        let mut b = [0u8; 4];
        f.read_exact(&mut b)?;
        Ok(i32::from_ne_bytes(b).max(0) as u32)
    }
}

/// CPU 0's idle states as the cpuidle driver declares them: (name, exit latency in µs).
pub fn cpuidle_states() -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for i in 0.. {
        let dir = format!("/sys/devices/system/cpu/cpu0/cpuidle/state{i}");
        let (Ok(name), Ok(lat)) = (
            std::fs::read_to_string(format!("{dir}/name")),
            std::fs::read_to_string(format!("{dir}/latency")),
        ) else {
            break;
        };
        out.push((name.trim().to_string(), lat.trim().parse().unwrap_or(0)));
    }
    out
}

/// The cpuidle driver in use (`haltpoll`, `intel_idle`, `acpi_idle`, ...), if any.
pub fn cpuidle_driver() -> Option<String> {
    std::fs::read_to_string("/sys/devices/system/cpu/cpuidle/current_driver")
        .ok()
        .map(|s| s.trim().to_string())
}

/// With the `haltpoll` cpuidle driver in use (KVM guests): how long an idle vCPU polls before it
/// halts at most, in ns (`guest_halt_poll_ns`; 0: it halts at once, and a wake-up then waits for
/// the hypervisor). `None` under any other driver.
pub fn guest_halt_poll_ns() -> Option<u64> {
    if cpuidle_driver().as_deref() != Some("haltpoll") {
        return None;
    }
    std::fs::read_to_string("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Send SIGTERM to process `pid` (asking it to finish and exit). Pid 0, which `kill(2)` takes
/// for every process of the caller's process group (the caller included), is refused.
pub fn terminate(pid: u32) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid)
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("pid {pid}")))?;
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bytes free to this process on the file system holding `path` (`statvfs`: available blocks
/// times the fragment size).
pub fn free_bytes(path: &Path) -> io::Result<u64> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    // SAFETY: a zeroed statvfs is a valid output buffer; `c` is NUL-terminated and outlives
    // the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The write end of the pipe [`interrupt_pipe`]'s handler writes to.
static INTERRUPT_WAKE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn on_interrupt(sig: libc::c_int) {
    let fd = INTERRUPT_WAKE.load(std::sync::atomic::Ordering::Relaxed);
    let b = sig as u8;
    // The handler runs in whatever thread took the signal, between any two of its
    // instructions: it leaves that thread's errno as it found it. The pipe's write end does
    // not block: with the pipe full (signals nobody read), the byte is dropped, and the
    // reader still has plenty to wake on; a blocking write would stop the interrupted thread
    // inside the handler for good.
    // SAFETY: write(2) is async-signal-safe; `b` lives for the call; errno's location is the
    // calling thread's own.
    unsafe {
        let errno = *libc::__errno_location();
        libc::write(fd, (&b as *const u8).cast(), 1);
        *libc::__errno_location() = errno;
    }
}

/// The pipe [`interrupt_pipe`]'s handler writes to: (read end, write end). Only the write end
/// is non-blocking (the handler's); the reader may block on its end.
fn wake_pipe() -> io::Result<(std::fs::File, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 just returned these two descriptors, owned by nothing else.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_SETFL on a descriptor this function owns.
    if unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((std::fs::File::from(read), write))
}

/// Catch SIGINT and SIGTERM: from now on each writes its signal number (one byte) to a pipe
/// instead of ending the process; returns the pipe's read end, for a thread that reads it and
/// decides what to do. Call once per process (a second call replaces the first pipe).
pub fn interrupt_pipe() -> io::Result<std::fs::File> {
    let (read, write) = wake_pipe()?;
    use std::os::fd::IntoRawFd;
    // The write end stays open for the process's life: the handler may run at any time.
    INTERRUPT_WAKE.store(write.into_raw_fd(), std::sync::atomic::Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a plain handler and an empty mask is valid; the
        // handler only writes one byte to a pipe.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_interrupt as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(read)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A burst of signals nobody reads fills the pipe: the handler then drops its byte instead
    /// of blocking (its write end blocked: the thread the signal interrupted stopped in the
    /// handler for good once 64 KiB of signals were unread), and leaves errno as it was.
    #[test]
    fn the_interrupt_handler_neither_blocks_on_a_full_pipe_nor_touches_errno() {
        // The handler's pipe, without installing the handler (the test process keeps its own
        // SIGINT and SIGTERM).
        let (read, write) = wake_pipe().unwrap();
        INTERRUPT_WAKE.store(write.as_raw_fd(), std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // SAFETY: errno's location is this thread's own.
            unsafe { *libc::__errno_location() = libc::EINTR };
            for _ in 0..(1 << 18) {
                on_interrupt(libc::SIGINT);
            }
            // SAFETY: as above.
            let _ = tx.send(unsafe { *libc::__errno_location() });
        });
        // A hang guard, not a timing check: a full pipe blocked the handler for ever.
        let errno = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("the handler blocked on the full pipe");
        assert_eq!(errno, libc::EINTR, "the handler changed errno");
        let mut b = [0u8; 1];
        use std::io::Read;
        (&read).read_exact(&mut b).unwrap();
        assert_eq!(b[0], libc::SIGINT as u8);
        INTERRUPT_WAKE.store(-1, std::sync::atomic::Ordering::Relaxed);
        drop(write);
    }

    /// Free space is reported for a directory that exists, an error for one that does not.
    #[test]
    fn free_bytes_of_a_real_and_a_missing_path() {
        let dir = std::env::temp_dir();
        let free = free_bytes(&dir).unwrap();
        // A file of a few bytes fits in what is reported free (a tmp with no room at all
        // would fail the write below as well).
        let f = dir.join(format!("aios-free-bytes-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        std::fs::remove_file(&f).unwrap();
        assert!(free > 0);
        let e = free_bytes(Path::new("/nonexistent/aios/dir")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    /// Pid 0 names no process: `kill(0, SIGTERM)` would end the caller's whole process group,
    /// this test run included. Pids past `pid_t` are refused too.
    #[test]
    fn terminate_refuses_pids_that_name_no_single_process() {
        for pid in [0, u32::MAX, i32::MAX as u32 + 1] {
            let e = terminate(pid).expect_err("refused");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "pid {pid}");
        }
    }

    /// A mount point with a space in its name (written `\040` in mountinfo) holds the paths
    /// below it: they were reported on the file system of the mount underneath.
    #[test]
    fn a_mount_point_with_an_escaped_space_holds_its_paths() {
        let info = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                    40 22 0:35 / /mnt/my\\040disk rw,relatime shared:20 - tmpfs tmpfs rw\n\
                    41 22 0:36 / /mnt/b\\134s rw shared:21 - xfs /dev/sdb rw\n";
        let at = |p: &str| fs_type_in(info, Path::new(p));
        assert_eq!(at("/mnt/my disk/f").as_deref(), Some("tmpfs"));
        assert_eq!(at("/mnt/my disk").as_deref(), Some("tmpfs"));
        assert_eq!(at("/mnt/b\\s/x").as_deref(), Some("xfs"));
        assert_eq!(at("/mnt/my\\040disk/f").as_deref(), Some("ext4"));
        assert_eq!(at("/mnt/my").as_deref(), Some("ext4"));
        assert_eq!(at("/etc").as_deref(), Some("ext4"));
    }

    #[test]
    fn a_cpu_latency_request_holds_while_it_lives() {
        let e = CpuLatencyRequest::new(u32::MAX)
            .err()
            .expect("above i32::MAX");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("4294967295"), "{e}");
        if !is_root() || !Path::new(CPU_LATENCY_QOS).exists() {
            eprintln!("SKIPPED the held part: needs root and {CPU_LATENCY_QOS}");
            return;
        }
        let before = CpuLatencyRequest::effective_us().expect("readable");
        {
            let r = CpuLatencyRequest::new(0).expect("request");
            assert_eq!(r.us(), 0);
            assert_eq!(CpuLatencyRequest::effective_us().expect("readable"), 0);
        }
        // Dropped: the system's limit is what it was (no other request came meanwhile).
        assert_eq!(CpuLatencyRequest::effective_us().expect("readable"), before);
    }
}
