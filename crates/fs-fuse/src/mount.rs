//! `aios mount`: aiosfs through FUSE (fuser), one worker thread per core, each with its own
//! `/dev/fuse` clone and, on first use, its own engine, lbio array and journal area.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, SessionACL, TimeOrNow, WriteFlags,
};
use lbio::{Device, DeviceConfig, LbioArray};

use crate::error::FsError;
use crate::format::{BLOCK, NAME_MAX};
use crate::fs::{Attr, Caller, DeviceFactory, Fs, FsOptions, OpenReport, SetAttr};

thread_local! {
    /// A worker thread's READ buffer: grown to the largest read it has served, then reused.
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Settings of `aios mount`.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// Worker threads (each its own /dev/fuse clone and engine). Default: one per core.
    pub threads: usize,
    /// How long the kernel may cache names (lookups).
    pub entry_timeout: Duration,
    /// How long the kernel may cache attributes (every change goes through this mount, and
    /// the kernel refreshes or drops what a change touches).
    pub attr_timeout: Duration,
    /// How requests reach the file system.
    pub transport: Transport,
    /// Ask the kernel for its write-back cache (`FUSE_WRITEBACK_CACHE`): writes land in the
    /// kernel's page cache and reach the file system later, in larger requests (at fsync,
    /// close, memory pressure or the kernel's periodic write-back); fsync sends them first.
    /// Data not yet fsynced is not durable either way: with the cache it waits in the kernel,
    /// without it in the file system's dirty blocks. Off by default.
    pub writeback_cache: bool,
    /// io_uring transport: how long a queue thread, having answered a request, spins on its
    /// queue for the next one before it sleeps (yielding its CPU every few empty looks, so the
    /// process about to send that request can run there). Zero: sleep at once.
    pub request_spin: Duration,
    /// Serve extended attributes (the default). Off, every xattr request is answered ENOSYS,
    /// after which the kernel sends none on this mount and tells programs the file system
    /// does not support them (EOPNOTSUPP). That saves a round trip per file written: the
    /// kernel asks for `security.capability` before the first write after each time it
    /// refreshes a file's attributes. Writes still drop that attribute and set-user-ID
    /// themselves, and attributes already on the image stay there, untouched, for a mount
    /// with them on.
    pub xattrs: bool,
    pub fs: FsOptions,
}

/// [`MountOptions::request_spin`]'s default. On the 2-vCPU Intel VM (2026-11-25, `aios bench
/// fs --rounds 3 --seconds 1 --threads 1,2`, two alternating runs each) spinning up to 500 µs
/// against sleeping at once took random 4 KiB O_DIRECT reads through the mount from 22.3/22.9
/// to 17.4/15.9 µs, postmark from 11,538/10,881 to 13,999/14,171 transactions/s, write + fsync
/// from 21,057/20,703 to 23,566/22,366 IOPS and create + fsync from 6,527/6,571 to 7,168/7,117
/// files/s (two threads' write + fsync unchanged). Postmark alone gained with every budget
/// tried, most of it by 500 µs: 20 µs none, 50 µs 7%, 200 µs 18%, 500 µs 24%, 2 ms 26%.
pub const REQUEST_SPIN: Duration = Duration::from_micros(500);

/// How the kernel's FUSE requests reach the file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// io_uring when the kernel offers it (`fuse.enable_uring`), else `/dev/fuse`; the log
    /// says which and why.
    Auto,
    /// io_uring, or refuse to mount.
    Uring,
    /// `/dev/fuse` reads and writes by the worker threads.
    Classic,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            entry_timeout: Duration::from_secs(1),
            attr_timeout: Duration::from_secs(1),
            transport: Transport::Auto,
            writeback_cache: false,
            request_spin: REQUEST_SPIN,
            xattrs: true,
            fs: FsOptions::default(),
        }
    }
}

/// The largest write the kernel sends in one request.
const MAX_WRITE: u32 = 1 << 20;

/// The image's device factory: each worker opens it on its own lbio array (O_DIRECT).
pub fn image_factory(path: &Path) -> DeviceFactory {
    let path = path.to_path_buf();
    Arc::new(move |lbio: &Rc<LbioArray>| {
        Device::open(
            lbio,
            &path,
            DeviceConfig {
                write: true,
                ..DeviceConfig::default()
            },
        )
        .map_err(FsError::from)
    })
}

struct Adapter {
    fs: Arc<Fs>,
    entry_ttl: Duration,
    attr_ttl: Duration,
    /// Ask for FUSE over io_uring at INIT.
    want_uring: bool,
    /// Refuse INIT when the kernel does not grant io_uring (`--transport uring`).
    require_uring: bool,
    /// What INIT settled: `Some(true)` when the kernel will send requests over io_uring.
    negotiated: Arc<std::sync::Mutex<Option<bool>>>,
    /// Ask for the kernel's write-back cache at INIT.
    want_writeback: bool,
    /// INIT granted FUSE_HANDLE_KILLPRIV_V2: the file system clears set-user-ID and
    /// set-group-ID on write, truncate and chown.
    killpriv_v2: bool,
    /// [`MountOptions::xattrs`].
    xattrs: bool,
}

fn to_time((s, ns): (i64, u32)) -> SystemTime {
    if s >= 0 {
        UNIX_EPOCH + Duration::new(s as u64, ns)
    } else {
        UNIX_EPOCH - Duration::from_secs(s.unsigned_abs()) + Duration::from_nanos(ns as u64)
    }
}

/// The kernel's (seconds, nanoseconds) of a time that fuser (0.18) hands to `setattr`.
///
/// fuser builds a time before 1970 as the epoch minus -seconds s *and minus* the nanoseconds
/// (its `system_time_from_time`), where the kernel's time is -seconds s *plus* the nanoseconds:
/// -0.5 s, which the kernel sends as (-1, 500000000), arrives as 1.5 s before the epoch. Read
/// back the usual way, such a time was stored one second early over `/dev/fuse` (`touch -d
/// '1969-12-31 23:59:59.5'` gave 23:59:58.5), and right over io_uring, which decodes the
/// kernel's numbers itself. So it is read back the way fuser built it; the test below goes
/// through fuser's own decoding, and fails if fuser ever changes it.
fn from_fuser_time(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(e) => {
            let d = e.duration();
            (
                0i64.checked_sub_unsigned(d.as_secs()).unwrap_or(i64::MIN),
                d.subsec_nanos(),
            )
        }
    }
}

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn kind_of_entry(kind: u8) -> FileType {
    kind_of((kind as u32) << 12)
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: to_time(a.atime),
        mtime: to_time(a.mtime),
        ctime: to_time(a.ctime),
        crtime: to_time(a.ctime),
        kind: kind_of(a.mode),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: BLOCK as u32,
        flags: 0,
    }
}

fn err(e: i32) -> Errno {
    Errno::from_i32(e)
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
    }
}

/// The mode of a node made by mknod: a regular file, fifo, socket or device (any other type
/// is EINVAL), with the permission bits of `mode` less `umask`.
pub(crate) fn mknod_mode(mode: u32, umask: u32) -> Result<u32, i32> {
    let kind = mode & libc::S_IFMT;
    let ok = [
        libc::S_IFREG,
        libc::S_IFIFO,
        libc::S_IFCHR,
        libc::S_IFBLK,
        libc::S_IFSOCK,
    ];
    if !ok.contains(&kind) {
        return Err(libc::EINVAL);
    }
    Ok(kind | (mode & 0o7777 & !umask))
}

/// Answer a request that returns nothing but success or an errno.
fn empty(r: Result<(), i32>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(err(e)),
    }
}

impl Adapter {
    fn entry(&self, r: Result<Attr, i32>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(
                &self.entry_ttl,
                &file_attr(&a),
                Generation(a.generation as u64),
            ),
            Err(e) => reply.error(err(e)),
        }
    }
}

/// Run a request's handler; a panic in it is logged, the file system takes no more changes
/// (`Fs::fail`: what the handler was changing may be half done), and the worker thread goes
/// on. The reply, dropped unanswered by the unwinding, answers EIO (fuser's `Drop`), as a
/// panicking request is answered over io_uring (`ring::dispatch`). Unguarded, the panic ended
/// the worker thread, and `--threads` of them ended the session and its mount.
fn guarded(fs: &Fs, what: &str, f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        // What the handler was changing may be half done: no more changes (see `Fs::fail`).
        fs.fail(&format!("a {what} request panicked (answered EIO)"));
    }
}

impl Filesystem for Adapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_readahead(1 << 20);
        let uring = self.want_uring
            && config
                .add_capabilities(fuser::InitFlags::FUSE_OVER_IO_URING)
                .is_ok();
        // With io_uring, the file system clears set-user-ID and friends itself
        // (FUSE_HANDLE_KILLPRIV_V2): the kernel then stops asking for `security.capability`
        // before every write, a round trip per write. The queues see the kernel's
        // FATTR_KILL_SUIDGID; fuser's setattr does not, so /dev/fuse alone keeps the kernel's
        // way.
        self.killpriv_v2 = uring
            && config
                .add_capabilities(fuser::InitFlags::FUSE_HANDLE_KILLPRIV_V2)
                .is_ok();
        if self.want_writeback {
            match config.add_capabilities(fuser::InitFlags::FUSE_WRITEBACK_CACHE) {
                Ok(()) => eprintln!("aiosfs: the kernel's write-back cache is on"),
                Err(_) => eprintln!(
                    "aiosfs: the kernel does not offer its write-back cache: writes go through"
                ),
            }
        }
        // Not FUSE_ATOMIC_O_TRUNC: OPEN is answered ENOSYS (see `open`), so an O_TRUNC must
        // come as the SETATTR of a size the kernel sends without it.
        *self.negotiated.lock().unwrap_or_else(|p| p.into_inner()) = Some(uring);
        if self.require_uring && !uring {
            // `--transport uring` asked for io_uring or nothing: the failed INIT ends the
            // session, and the mount with it.
            eprintln!(
                "aiosfs: --transport uring: the kernel did not grant FUSE over io_uring at INIT; \
                 refusing the mount (--transport auto would serve it over /dev/fuse)"
            );
            return Err(std::io::Error::from_raw_os_error(libc::EPROTONOSUPPORT));
        }
        Ok(())
    }

    fn destroy(&mut self) {
        match self.fs.unmount() {
            Ok(()) => {
                let st = &self.fs.stats;
                let js = &self.fs.journal_set().stats;
                let phases = js.mean_phases_ns().map_or(String::new(), |p| {
                    format!(
                        "; journal per commit: prepare {:.1} us, data + journal writes {:.1} us, flush {:.1} us, commit block {:.1} us",
                        p[0] / 1e3,
                        p[1] / 1e3,
                        p[2] / 1e3,
                        p[3] / 1e3
                    )
                });
                let n =
                    |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
                let rio = if self.fs.options().rio {
                    format!(
                        "; Rio-ordered: {} workers on areas of their own, {} sharing an area (overlapped)",
                        n(&st.rio_handles),
                        n(&st.shared_handles)
                    )
                } else {
                    String::new()
                };
                let cache = self.fs.cache_metrics().map_or(String::new(), |m| {
                    format!(
                        "; page cache: {} hits, {} misses, {} evictions",
                        m.hits, m.misses, m.evictions
                    )
                });
                eprintln!(
                    "aiosfs: unmounted cleanly (everything committed and checkpointed): {} commits ({} by fsync), {} fsyncs written in place without a transaction, {} data and {} metadata blocks written{phases}{rio}{cache}",
                    n(&st.commits),
                    n(&st.fsync_commits),
                    n(&st.fsync_in_place),
                    n(&st.data_blocks_written),
                    n(&st.meta_blocks_written),
                )
            }
            Err(e) => eprintln!("aiosfs: unmount: {e}; the next mount replays the journal"),
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        guarded(&self.fs, "lookup", || {
            self.entry(self.fs.lookup(parent.0, name.as_bytes(), true), reply)
        })
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        guarded(&self.fs, "forget", || self.fs.forget(ino.0, nlookup))
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        guarded(&self.fs, "getattr", || match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&self.attr_ttl, &file_attr(&a)),
            Err(e) => reply.error(err(e)),
        })
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        guarded(&self.fs, "setattr", || {
            let t = |x: Option<TimeOrNow>| {
                x.map(|x| match x {
                    TimeOrNow::Now => None,
                    TimeOrNow::SpecificTime(t) => Some(from_fuser_time(t)),
                })
            };
            let set = SetAttr {
                mode,
                uid,
                gid,
                size,
                atime: t(atime),
                mtime: t(mtime),
                // fuser does not pass FATTR_KILL_SUIDGID on: with KILLPRIV_V2 (granted only
                // with io_uring, so only here if the queues failed), a chown or truncate kills.
                kill_privs: self.killpriv_v2 && (uid.is_some() || gid.is_some() || size.is_some()),
            };
            match self.fs.setattr(ino.0, &set) {
                Ok(a) => reply.attr(&self.attr_ttl, &file_attr(&a)),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        guarded(&self.fs, "readlink", || match self.fs.readlink(ino.0) {
            Ok(t) => reply.data(&t),
            Err(e) => reply.error(err(e)),
        })
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        guarded(&self.fs, "mknod", || {
            let mode = match mknod_mode(mode, umask) {
                Ok(m) => m,
                Err(e) => return reply.error(err(e)),
            };
            self.entry(
                self.fs
                    .mknod(parent.0, name.as_bytes(), mode, rdev, caller(req), None),
                reply,
            )
        })
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        guarded(&self.fs, "mkdir", || {
            let mode = libc::S_IFDIR | (mode & 0o7777 & !umask);
            self.entry(
                self.fs
                    .mknod(parent.0, name.as_bytes(), mode, 0, caller(req), None),
                reply,
            )
        })
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        guarded(&self.fs, "unlink", || {
            empty(self.fs.remove(parent.0, name.as_bytes(), false), reply)
        })
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        guarded(&self.fs, "rmdir", || {
            empty(self.fs.remove(parent.0, name.as_bytes(), true), reply)
        })
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        guarded(&self.fs, "symlink", || {
            let t = target.as_os_str().as_bytes();
            if t.is_empty() {
                return reply.error(err(libc::ENOENT));
            }
            if t.len() >= BLOCK {
                return reply.error(err(libc::ENAMETOOLONG));
            }
            let mode = libc::S_IFLNK | 0o777;
            self.entry(
                self.fs.mknod(
                    parent.0,
                    link_name.as_bytes(),
                    mode,
                    0,
                    caller(req),
                    Some(t),
                ),
                reply,
            )
        })
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, "rename", || {
            empty(
                self.fs.rename(
                    parent.0,
                    name.as_bytes(),
                    newparent.0,
                    newname.as_bytes(),
                    flags.bits(),
                ),
                reply,
            )
        })
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        guarded(&self.fs, "link", || {
            self.entry(self.fs.link(ino.0, newparent.0, newname.as_bytes()), reply)
        })
    }

    /// ENOSYS: the kernel then opens regular files by itself (no OPEN and no RELEASE, two
    /// round trips less per open file), keeping its cached pages across opens, which is right
    /// because every change reaches the file through this mount. An unlinked file stays until
    /// its last user goes all the same: the kernel holds its lookup while the file is open,
    /// and the file system frees it at the FORGET. So no path of the mount counts opens
    /// (`Fs::open_file`): a file made by CREATE gets a RELEASE only until the kernel has
    /// stopped sending OPENs.
    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.error(err(libc::ENOSYS))
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        guarded(&self.fs, "read", || {
            let direct = flags.0 & libc::O_DIRECT != 0;
            // Each worker thread reads into a buffer of its own, kept for its next READ.
            READ_BUF.with_borrow_mut(|buf| {
                if buf.len() < size as usize {
                    buf.resize(size as usize, 0);
                }
                match self
                    .fs
                    .read_into(ino.0, offset, &mut buf[..size as usize], direct)
                {
                    Ok(n) => reply.data(&buf[..n]),
                    Err(e) => reply.error(err(e)),
                }
            })
        })
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        guarded(&self.fs, "write", || {
            let kill =
                !self.killpriv_v2 || write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
            match self.fs.write_as(ino.0, offset, data, kill) {
                Ok(n) => reply.written(n as u32),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // Nothing to do at a close (no POSIX locks here, and data goes out at fsync or commit):
        // ENOSYS tells the kernel so, and it sends no FLUSH again on this mount (one round
        // trip less per close).
        reply.error(err(libc::ENOSYS))
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // Opens are not counted (see `open`); the FORGET ends a file's life.
        reply.ok()
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, "fsync", || {
            empty(self.fs.fsync_as(ino.0, datasync), reply)
        })
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        guarded(&self.fs, "opendir", || match self.fs.getattr(ino.0) {
            Ok(a) if a.mode & libc::S_IFMT == libc::S_IFDIR => {
                reply.opened(FileHandle(0), FopenFlags::empty())
            }
            Ok(_) => reply.error(err(libc::ENOTDIR)),
            Err(e) => reply.error(err(e)),
        })
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        guarded(&self.fs, "readdir", || {
            let r = self.fs.readdir(ino.0, offset, |next, ino, kind, name| {
                reply.add(
                    INodeNo(ino),
                    next,
                    kind_of_entry(kind),
                    OsStr::from_bytes(name),
                )
            });
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, "fsyncdir", || empty(self.fs.fsync(ino.0), reply))
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        guarded(&self.fs, "statfs", || {
            let s = self.fs.statfs();
            reply.statfs(
                s.blocks,
                s.bfree,
                s.bfree,
                s.files,
                s.ffree,
                BLOCK as u32,
                NAME_MAX as u32,
                BLOCK as u32,
            )
        })
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, "setxattr", || {
            if !self.xattrs {
                return reply.error(err(libc::ENOSYS));
            }
            empty(
                self.fs.setxattr(ino.0, name.as_bytes(), value, flags),
                reply,
            )
        })
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        guarded(&self.fs, "getxattr", || {
            if !self.xattrs {
                return reply.error(err(libc::ENOSYS));
            }
            match self.fs.getxattr(ino.0, name.as_bytes()) {
                Ok(v) if size == 0 => reply.size(v.len() as u32),
                Ok(v) if v.len() > size as usize => reply.error(err(libc::ERANGE)),
                Ok(v) => reply.data(&v),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        guarded(&self.fs, "listxattr", || {
            if !self.xattrs {
                return reply.error(err(libc::ENOSYS));
            }
            match self.fs.listxattr(ino.0) {
                Ok(v) if size == 0 => reply.size(v.len() as u32),
                Ok(v) if v.len() > size as usize => reply.error(err(libc::ERANGE)),
                Ok(v) => reply.data(&v),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn removexattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        guarded(&self.fs, "removexattr", || {
            if !self.xattrs {
                return reply.error(err(libc::ENOSYS));
            }
            empty(self.fs.removexattr(ino.0, name.as_bytes()), reply)
        })
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        guarded(&self.fs, "create", || {
            let mode = libc::S_IFREG | (mode & 0o7777 & !umask);
            match self
                .fs
                .mknod(parent.0, name.as_bytes(), mode, 0, caller(req), None)
            {
                // Not counted as an open: see `open`.
                Ok(a) => reply.created(
                    &self.entry_ttl,
                    &file_attr(&a),
                    Generation(a.generation as u64),
                    FileHandle(0),
                    FopenFlags::FOPEN_KEEP_CACHE,
                ),
                Err(e) => reply.error(err(e)),
            }
        })
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, "fallocate", || {
            empty(self.fs.fallocate(ino.0, offset, length, mode), reply)
        })
    }
}

/// A mounted file system: `run` serves it until it is unmounted (`umount`, `fusermount3 -u`,
/// or SIGINT/SIGTERM, which unmount it).
pub struct Mounted {
    session: fuser::Session<Adapter>,
    fs: Arc<Fs>,
    transport: Transport,
    entry_ttl: Duration,
    attr_ttl: Duration,
    request_spin: Duration,
    xattrs: bool,
    negotiated: Arc<std::sync::Mutex<Option<bool>>>,
    /// Why `--transport uring`'s queues failed, when they did (the mount was then ended).
    uring_failure: Arc<std::sync::Mutex<Option<String>>>,
    pub report: OpenReport,
    pub mountpoint: PathBuf,
    pub threads: usize,
    /// The image's lock, let go when this is dropped: after `run` has unmounted (its final
    /// commit and checkpoint done), or with a mount that never ran.
    _lock: crate::lock::ImageLock,
}

/// Lock `image` (another mount or mkfs holding it: [`FsError::InUse`]), check it (a damaged
/// or foreign image is refused, nothing written), open it (journal replay) and mount it at
/// `mountpoint`. The lock is held until the [`Mounted`] is dropped.
pub fn mount(image: &Path, mountpoint: &Path, opts: &MountOptions) -> Result<Mounted, FsError> {
    // First: of two mounts started together, the second stops here, before it reads anything.
    let lock = crate::lock::ImageLock::exclusive(image)?;
    // SIGINT/SIGTERM stay pending from here until `run`'s signal thread takes them, so a
    // signal that arrives while mounting still unmounts cleanly.
    signals()
        .thread_block()
        .map_err(|e| FsError::Config(format!("blocking signals: {e}")))?;
    // Refuses foreign, unsupported and damaged superblocks; then every structure, as the
    // journal's replay will leave it.
    crate::fsck::read_superblock(image)?;
    let report = crate::fsck::fsck(image)?;
    if !report.clean() {
        let n = report.problems.len();
        let first: Vec<&str> = report.problems.iter().take(5).map(String::as_str).collect();
        return Err(FsError::Damaged(format!(
            "{n} problems found, the image was not changed (run `aios fsck {}`): {}",
            image.display(),
            first.join("; ")
        )));
    }
    let meta = std::fs::metadata(mountpoint).map_err(|e| FsError::io(mountpoint, e))?;
    if !meta.is_dir() {
        return Err(FsError::Config(format!(
            "{} is not a directory",
            mountpoint.display()
        )));
    }
    if opts.transport == Transport::Uring {
        crate::ring::available().map_err(|why| {
            FsError::Config(format!("FUSE over io_uring is not available: {why}"))
        })?;
    }
    let (fs, report) = Fs::open(image_factory(image), opts.fs.clone())?;
    let negotiated = Arc::new(std::sync::Mutex::new(None));
    let adapter = Adapter {
        fs: Arc::clone(&fs),
        entry_ttl: opts.entry_timeout,
        attr_ttl: opts.attr_timeout,
        want_uring: opts.transport != Transport::Classic && crate::ring::available().is_ok(),
        require_uring: opts.transport == Transport::Uring,
        negotiated: Arc::clone(&negotiated),
        killpriv_v2: false,
        want_writeback: opts.writeback_cache,
        xattrs: opts.xattrs,
    };
    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(image.display().to_string()),
        MountOption::Subtype("aiosfs".into()),
        MountOption::DefaultPermissions,
        MountOption::Dev,
        MountOption::Suid,
    ];
    cfg.acl = SessionACL::All;
    cfg.n_threads = Some(opts.threads.max(1));
    cfg.clone_fd = true;
    let session = match fuser::Session::new(adapter, mountpoint, &cfg) {
        Ok(s) => s,
        Err(e) => {
            let _ = fs.unmount();
            return Err(FsError::io(mountpoint, e));
        }
    };
    Ok(Mounted {
        session,
        fs,
        transport: opts.transport,
        entry_ttl: opts.entry_timeout,
        attr_ttl: opts.attr_timeout,
        request_spin: opts.request_spin,
        xattrs: opts.xattrs,
        negotiated,
        uring_failure: Arc::new(std::sync::Mutex::new(None)),
        report,
        mountpoint: mountpoint.to_path_buf(),
        threads: opts.threads.max(1),
        _lock: lock,
    })
}

fn signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set
}

impl Mounted {
    /// Serve requests until unmounted. SIGINT and SIGTERM unmount (cleanly: the final commit
    /// and checkpoint run when the kernel lets go).
    pub fn run(self) -> Result<(), FsError> {
        let queues = self.start_queues(&self.session)?;
        let set = signals();
        let mp = self.mountpoint.clone();
        // Changes nobody fsyncs are committed every COMMIT_INTERVAL, as ext4 does every 5 s.
        let fs = Arc::clone(&self.fs);
        std::thread::Builder::new()
            .name("aiosfs-flusher".into())
            .spawn(move || {
                let mut full = false;
                loop {
                    std::thread::sleep(crate::fs::COMMIT_INTERVAL);
                    if Arc::strong_count(&fs) == 1 {
                        return;
                    }
                    match fs.sync_if_dirty() {
                        Ok(_) => full = false,
                        // A full disk: the commit went through except for what waits for a
                        // free block (new xattr blocks), so the next ones go on.
                        Err(libc::ENOSPC) => {
                            if !full {
                                eprintln!(
                                    "aiosfs: periodic commit: the disk is full; some changes \
                                     wait for free blocks"
                                );
                            }
                            full = true;
                        }
                        Err(e) => {
                            eprintln!("aiosfs: periodic commit failed: errno {e}");
                            return;
                        }
                    }
                }
            })
            .map_err(|e| FsError::Config(format!("flusher thread: {e}")))?;
        let mut session = self.session;
        let mut unmounter = session.unmount_callable();
        std::thread::Builder::new()
            .name("aiosfs-signals".into())
            .spawn(move || {
                if let Ok(sig) = set.wait() {
                    eprintln!("aiosfs: {sig:?}: unmounting {}", mp.display());
                    if let Err(e) = unmounter.unmount() {
                        // Busy (a process still has a file open there): detach it now; the
                        // session ends, and the final commit runs, when the last user lets go.
                        eprintln!(
                            "aiosfs: unmount of {}: {e}; detaching it (lazy unmount)",
                            mp.display()
                        );
                        if let Err(e) = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH) {
                            eprintln!("aiosfs: lazy unmount of {}: {e}", mp.display());
                        }
                    }
                }
            })
            .map_err(|e| FsError::Config(format!("signal thread: {e}")))?;
        let uring_failure = Arc::clone(&self.uring_failure);
        let r = session
            .run()
            .map_err(|e| FsError::Config(format!("FUSE session: {e}")));
        if let Some(q) = queues {
            let stats = Arc::clone(&q.stats);
            let failed = q.join().len();
            if failed > 0 {
                eprintln!("aiosfs: {failed} io_uring queues failed (see above)");
            }
            // Every kind of request, the costliest first: what a workload asks of the mount.
            let (n, top) = stats.summary(usize::MAX);
            if n > 0 {
                eprintln!(
                    "aiosfs: {n} requests served over io_uring; time per kind of request: {top}"
                );
            }
        }
        let failure = uring_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(why) = failure {
            r?;
            return Err(FsError::Config(format!(
                "--transport uring: {why}; the mount was ended"
            )));
        }
        r
    }

    /// Start the io_uring queues when the transport allows it and the kernel offers it; log
    /// which transport serves the mount, and why.
    fn start_queues(
        &self,
        session: &fuser::Session<Adapter>,
    ) -> Result<Option<crate::ring::Queues>, FsError> {
        use std::os::fd::AsFd;
        let classic = |why: String| {
            eprintln!("aiosfs: requests over /dev/fuse ({why})");
            Ok(None)
        };
        match (self.transport, crate::ring::available()) {
            (Transport::Classic, _) => return classic("--transport classic".into()),
            (Transport::Auto, Err(why)) => {
                return classic(format!("FUSE over io_uring is off: {why}"))
            }
            _ => {}
        }
        let dev = session
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| FsError::Config(format!("duplicating the /dev/fuse descriptor: {e}")))?;
        let handler = Arc::new(crate::ring::Handler {
            fs: Arc::clone(&self.fs),
            entry_ttl: self.entry_ttl,
            attr_ttl: self.attr_ttl,
            xattrs: self.xattrs,
        });
        let depth = 2;
        // A write of MAX_WRITE bytes, or a read answer of as much, fits whole.
        let payload = MAX_WRITE as usize;
        // `--transport uring`: a queue that fails ends the mount (the kernel would otherwise
        // move the connection to `/dev/fuse`); `run` then says why.
        let on_failure: Option<crate::ring::OnFailure> =
            (self.transport == Transport::Uring).then(|| {
                let why = Arc::clone(&self.uring_failure);
                let mp = self.mountpoint.clone();
                Arc::new(move |e: &str| {
                    let mut w = why.lock().unwrap_or_else(|p| p.into_inner());
                    if w.is_none() {
                        *w = Some(e.to_string());
                        eprintln!(
                            "aiosfs: --transport uring: {e}; unmounting {} (--transport auto \
                             would go on over /dev/fuse)",
                            mp.display()
                        );
                        if let Err(e) = nix::mount::umount2(&mp, nix::mount::MntFlags::MNT_DETACH) {
                            eprintln!("aiosfs: unmount of {}: {e}", mp.display());
                        }
                    }
                }) as crate::ring::OnFailure
            });
        let q = crate::ring::Queues::start(
            dev,
            handler,
            Arc::clone(&self.negotiated),
            depth,
            payload,
            self.request_spin,
            on_failure,
        )
        .map_err(|e| FsError::Config(format!("FUSE io_uring queue threads: {e}")))?;
        let wait = if self.request_spin.is_zero() {
            "sleeping between requests".to_string()
        } else {
            format!(
                "spinning up to {} us for the next request, then sleeping",
                self.request_spin.as_micros()
            )
        };
        eprintln!(
            "aiosfs: requests over io_uring once INIT grants it: {} queues (one per CPU, each served by a thread pinned to it) × {} entries, {wait}",
            q.queues, q.depth
        );
        Ok(Some(q))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A fresh image in the temp directory, removed when dropped.
    struct Image(PathBuf);

    impl Image {
        fn new(tag: &str) -> Image {
            let img = Image(
                std::env::temp_dir().join(format!("aiosfs-mount-{tag}-{}.img", std::process::id())),
            );
            std::fs::File::create(&img.0)
                .unwrap()
                .set_len(16 << 20)
                .unwrap();
            crate::mkfs(
                &img.0,
                &crate::MkfsOptions {
                    journals: 1,
                    journal_blocks: 256,
                    ..crate::MkfsOptions::default()
                },
            )
            .unwrap();
            img
        }
    }

    impl Drop for Image {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn open(factory: DeviceFactory) -> Arc<Fs> {
        let opts = FsOptions {
            arena_bytes: 2 << 20,
            cache_bytes: 256 << 10,
            ..FsOptions::default()
        };
        Fs::open(factory, opts).unwrap().0
    }

    /// A FUSE request as the kernel writes it to `/dev/fuse`: `fuse_in_header`, then `body`.
    fn request(opcode: u32, unique: u64, nodeid: u64, body: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(40 + body.len());
        b.extend_from_slice(&((40 + body.len()) as u32).to_le_bytes());
        b.extend_from_slice(&opcode.to_le_bytes());
        b.extend_from_slice(&unique.to_le_bytes());
        b.extend_from_slice(&nodeid.to_le_bytes());
        b.extend_from_slice(&[0u8; 16]); // uid, gid, pid, extension length, padding
        b.extend_from_slice(body);
        b
    }

    /// The adapter the mount builds on `fs`, over `/dev/fuse` only unless `uring` (then
    /// `--transport uring`: io_uring asked for, and required), recording INIT's outcome in
    /// `negotiated`.
    fn adapter(
        fs: &Arc<Fs>,
        uring: bool,
        negotiated: Arc<std::sync::Mutex<Option<bool>>>,
    ) -> Adapter {
        Adapter {
            fs: Arc::clone(fs),
            entry_ttl: Duration::from_secs(1),
            attr_ttl: Duration::from_secs(1),
            want_uring: uring,
            require_uring: uring,
            negotiated,
            want_writeback: false,
            killpriv_v2: false,
            xattrs: true,
        }
    }

    /// A fuser session for `adapter` (one worker) over a socket pair standing in for
    /// `/dev/fuse`, after an INIT (7.40) offering no capability flags; returns our end and the
    /// session (an error where INIT was refused).
    fn handshake(adapter: Adapter) -> (UnixStream, std::io::Result<fuser::Session<Adapter>>) {
        let (mut dev, theirs) = UnixStream::pair().unwrap();
        // INIT: fuse_init_in {major 7, minor 40, max_readahead, flags, flags2, unused}.
        let mut init = vec![0u8; 64];
        init[..4].copy_from_slice(&7u32.to_le_bytes());
        init[4..8].copy_from_slice(&40u32.to_le_bytes());
        init[8..12].copy_from_slice(&(128u32 << 10).to_le_bytes());
        dev.write_all(&request(26, 1, 0, &init)).unwrap();
        let session = fuser::Session::from_fd(
            adapter,
            OwnedFd::from(theirs),
            SessionACL::All,
            Config::default(),
        );
        (dev, session)
    }

    /// The adapter on `fs`, served by fuser (one worker) as in the mount, with a socket pair
    /// standing in for `/dev/fuse`: INIT is done. Requests are sent one at a time, each answer
    /// read before the next request, so each read and write carries one message as on the
    /// device; a stream, so that the session's end reads as end of file.
    fn serve(fs: &Arc<Fs>) -> (UnixStream, std::thread::JoinHandle<std::io::Result<()>>) {
        let (mut dev, session) = handshake(adapter(fs, false, Default::default()));
        let session = session.unwrap();
        assert_eq!(answer(&mut dev, 1).map(|a| a.0), Some(0), "INIT");
        (dev, std::thread::spawn(move || session.run()))
    }

    /// `--transport uring` refuses a kernel whose INIT does not offer FUSE over io_uring: INIT
    /// is answered with an error, and the session (the mount) does not start. It went on over
    /// `/dev/fuse`, though the transport was asked for by name.
    #[test]
    fn transport_uring_refuses_an_init_without_io_uring() {
        let img = Image::new("require-uring");
        let fs = open(image_factory(&img.0));
        let negotiated = Arc::new(std::sync::Mutex::new(None));
        // INIT with no flags: no io_uring on offer.
        let (mut dev, session) = handshake(adapter(&fs, true, Arc::clone(&negotiated)));
        assert_eq!(
            answer(&mut dev, 1).map(|a| a.0),
            Some(-libc::EPROTONOSUPPORT),
            "INIT"
        );
        assert!(session.is_err(), "the session started over /dev/fuse");
        assert_eq!(*negotiated.lock().unwrap(), Some(false));
    }

    /// The answer to request `unique`: its errno (0 or negative) and payload; `None` when the
    /// session has ended.
    fn answer(dev: &mut UnixStream, unique: u64) -> Option<(i32, Vec<u8>)> {
        let mut b = vec![0u8; 1 << 16];
        let n = dev.read(&mut b).unwrap();
        if n == 0 {
            return None;
        }
        assert!(n >= 16, "an answer of {n} bytes");
        assert_eq!(u32::from_le_bytes(b[..4].try_into().unwrap()) as usize, n);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), unique);
        let e = i32::from_le_bytes(b[4..8].try_into().unwrap());
        Some((e, b[16..n].to_vec()))
    }

    /// Send a request and read its answer (`None`: the session has ended).
    fn call(
        dev: &mut UnixStream,
        opcode: u32,
        unique: u64,
        nodeid: u64,
        body: &[u8],
    ) -> Option<(i32, Vec<u8>)> {
        // Refused (the peer is gone): the session has ended.
        dev.write_all(&request(opcode, unique, nodeid, body)).ok()?;
        answer(dev, unique)
    }

    /// Times before 1970 with nanoseconds, set over `/dev/fuse`, are stored as the kernel sent
    /// them: they go through fuser's own decoding here, as in the mount. Before, -0.5 s was
    /// stored as -1.5 s (and -2.999999999 s as -3.000000001 s); times at or after 1970 were
    /// right.
    #[test]
    fn setattr_over_dev_fuse_stores_times_before_1970_as_the_kernel_sent_them() {
        let img = Image::new("times");
        let fs = open(image_factory(&img.0));
        let root = Caller { uid: 0, gid: 0 };
        let ino = fs
            .mknod(1, b"f", libc::S_IFREG | 0o644, 0, root, None)
            .unwrap()
            .ino;
        let (mut dev, served) = serve(&fs);
        let cases: [(i64, u32); 6] = [
            (-1, 500_000_000),
            (-3, 1),
            (-3, 999_999_999),
            (-1, 0),
            (i64::MIN + 1, 7),
            (1_700_000_000, 250),
        ];
        for (k, &(s, ns)) in cases.iter().enumerate() {
            // SETATTR atime and mtime: fuse_setattr_in (88 bytes).
            let mut set = vec![0u8; 88];
            set[..4].copy_from_slice(&((1u32 << 4) | (1 << 5)).to_le_bytes());
            set[32..40].copy_from_slice(&s.to_le_bytes());
            set[40..48].copy_from_slice(&s.to_le_bytes());
            set[56..60].copy_from_slice(&ns.to_le_bytes());
            set[60..64].copy_from_slice(&ns.to_le_bytes());
            let (e, _) = call(&mut dev, 4, 10 + k as u64, ino, &set).expect("answered");
            assert_eq!(e, 0, "SETATTR {s} s {ns} ns");
            let a = fs.getattr(ino).unwrap();
            assert_eq!((a.atime, a.mtime), ((s, ns), (s, ns)), "stored");
        }
        // DESTROY ends fuser's worker; the session then unmounts the file system.
        assert_eq!(call(&mut dev, 38, 99, 0, &[]).map(|a| a.0), Some(0));
        served.join().unwrap().unwrap();
    }

    /// A handler that panics over `/dev/fuse` is answered EIO and its worker serves the next
    /// request. The panic comes from the device factory, which a worker's first request calls
    /// (each worker opens its own device). Before, the panic ended the worker thread: with one
    /// worker (`--threads 1`, or after as many panics as workers) the session ended, and with
    /// it the mount.
    #[test]
    fn a_request_whose_handler_panics_over_dev_fuse_is_answered_eio_and_the_worker_goes_on() {
        let img = Image::new("panic");
        let inner = image_factory(&img.0);
        let armed = Arc::new(AtomicBool::new(false));
        let a = Arc::clone(&armed);
        let factory: DeviceFactory = Arc::new(move |lbio| {
            if a.load(Ordering::SeqCst) {
                panic!("injected: the device open panics");
            }
            inner(lbio)
        });
        let fs = open(factory);
        armed.store(true, Ordering::SeqCst);
        let (mut dev, served) = serve(&fs);
        let (e, _) = call(&mut dev, 3, 2, 1, &[0u8; 16]).expect("the panicking GETATTR answered");
        assert_eq!(e, -libc::EIO, "the panicking GETATTR");
        armed.store(false, Ordering::SeqCst);
        let (e, out) = call(&mut dev, 3, 3, 1, &[0u8; 16])
            .expect("the worker died with the panic: the session ended, nothing answered");
        assert_eq!((e, out.len()), (0, 104), "the next GETATTR");
        let mode = u32::from_le_bytes(out[16 + 60..16 + 64].try_into().unwrap());
        assert_eq!(mode & libc::S_IFMT, libc::S_IFDIR, "the root's attributes");
        // What the handler was changing may be half done: no more changes.
        assert!(
            fs.failed(),
            "the file system still takes changes after a panic"
        );
        assert_eq!(call(&mut dev, 38, 99, 0, &[]).map(|a| a.0), Some(0));
        served.join().unwrap().unwrap();
    }
}
