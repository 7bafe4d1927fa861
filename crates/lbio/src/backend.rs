//! Backends: how one piece of a request reaches a device. One trait, capabilities declared.

use std::cell::UnsafeCell;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;

use aios_core::nvme::{self, IoOpcode, NvmeNamespace, NvmeStatus, PassthruCmd};
use aios_core::{engine, CoreError, Engine, FixedFile, RingKind, SinkId};

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// Make completed writes durable (`fdatasync` / NVMe FLUSH).
    Flush,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
        })
    }
}

/// What a backend can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Short name, for reports.
    pub name: &'static str,
    /// Completes through the engine's rings (a CQE per piece); otherwise inline at start.
    pub asynchronous: bool,
    /// Honours `fua` on writes.
    pub fua: bool,
    /// Supports `Op::Flush`.
    pub flush: bool,
    /// Reads and writes go to the engine's IOPOLL ring.
    pub iopoll: bool,
    /// Completed writes survive a power cut (no volatile write cache, or a protected one): a
    /// FLUSH buys no durability and callers may skip it.
    pub power_loss_protected: bool,
    /// Takes a piece made of several memory segments ([`Piece::iov`]) as one device command.
    /// Without it, lbio sends a scattered request one segment at a time.
    pub vectored: bool,
}

/// One device command: a whole request, or one piece of a split one.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub op: Op,
    pub offset: u64,
    pub ptr: *mut u8,
    pub len: u32,
    pub fua: bool,
    /// The registered buffer `ptr` lies in (`None`: unregistered memory, pinned per I/O).
    pub buf_index: Option<u16>,
    /// A vectored piece: `iov_count` iovecs at `iov` (all in `buf_index` when it is set),
    /// `len` bytes in all, `ptr` the first segment's start. Only backends that declare
    /// [`Caps::vectored`] receive one; `iov_count` is 0 otherwise.
    pub iov: *const libc::iovec,
    pub iov_count: u16,
}

impl Piece {
    /// The piece's memory as iovecs: its own segments, or `one` set to `ptr..ptr+len`.
    pub fn iovecs<'a>(&'a self, one: &'a mut libc::iovec) -> &'a [libc::iovec] {
        if self.iov_count == 0 {
            *one = libc::iovec {
                iov_base: self.ptr.cast(),
                iov_len: self.len as usize,
            };
            std::slice::from_ref(one)
        } else {
            // SAFETY: lbio builds vectored pieces from a request's iovec array, which its
            // submitter keeps valid until the request completes.
            unsafe { std::slice::from_raw_parts(self.iov, self.iov_count as usize) }
        }
    }
}

/// How a piece was started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Started {
    /// A completion will reach the sink with this piece's tag.
    Queued,
    /// Finished inline: bytes transferred, or a negative errno.
    Done(i32),
}

/// Why a piece failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceError {
    /// The kernel refused or failed it (a positive errno value).
    Errno(i32),
    /// The NVMe controller completed it with an error status.
    Nvme(NvmeStatus),
}

/// A finished piece, as the backend reads its completion result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Bytes transferred.
    Bytes(u32),
    Failed(PieceError),
}

/// A device lbio can send pieces to.
pub trait Backend {
    /// What this backend can do.
    fn caps(&self) -> Caps;

    /// Read the completion result `res` of a piece of `len` bytes. The default is the read(2)
    /// convention: bytes transferred, or a negative errno.
    fn outcome(&self, res: i32, len: u32) -> Outcome {
        let _ = len;
        if res < 0 {
            Outcome::Failed(PieceError::Errno(-res))
        } else {
            Outcome::Bytes(res as u32)
        }
    }

    /// [`Backend::outcome`] for the piece whose completion carried `payload` (a backend that
    /// keeps per-piece results overrides this).
    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> Outcome {
        let _ = payload;
        self.outcome(res, len)
    }

    /// Start `piece`. Asynchronous backends push an SQE for `sink` tagged `tag` and return
    /// [`Started::Queued`]; synchronous ones do the work and return [`Started::Done`].
    ///
    /// # Safety
    /// `piece.ptr` must be valid for `piece.len` bytes (writable for reads) and untouched by
    /// anyone else until the piece completes: until `start` returns for `Done`, or until its
    /// completion has been dispatched for `Queued`.
    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError>;
}

fn require_iopoll_ring(engine: &Engine) -> Result<(), CoreError> {
    if engine.has_iopoll_ring() {
        Ok(())
    } else {
        Err(CoreError::Config(
            "an IOPOLL route needs EngineConfig { iopoll_ring: true, .. }".into(),
        ))
    }
}

struct RegisteredFile {
    fd: Rc<OwnedFd>,
    fixed: FixedFile,
    engine: Rc<Engine>,
}

impl Drop for RegisteredFile {
    fn drop(&mut self) {
        self.engine.unregister_file(self.fixed);
    }
}

/// A regular file or block device opened `O_DIRECT`, driven through io_uring with
/// `ReadFixed`/`WriteFixed` on the registered arena; `fdatasync` for flush; `RWF_DSYNC` writes as
/// FUA.
#[derive(Clone)]
pub struct FileBackend {
    file: Rc<RegisteredFile>,
    ring: RingKind,
    /// The kernel has `READV_FIXED`/`WRITEV_FIXED`: scattered pieces go out as one command.
    vectored: bool,
}

impl FileBackend {
    /// Register `fd` (opened `O_DIRECT`) with the engine. With `iopoll`, reads and writes go to the
    /// engine's IOPOLL ring (the engine must have one).
    pub fn new(engine: &Rc<Engine>, fd: Rc<OwnedFd>, iopoll: bool) -> Result<Self, CoreError> {
        if iopoll {
            require_iopoll_ring(engine)?;
        }
        let fixed = engine.register_file(fd.as_raw_fd())?;
        Ok(FileBackend {
            file: Rc::new(RegisteredFile {
                fd,
                fixed,
                engine: Rc::clone(engine),
            }),
            ring: if iopoll {
                RingKind::Iopoll
            } else {
                RingKind::Main
            },
            vectored: engine.supports_vectored_fixed(),
        })
    }

    /// The underlying descriptor.
    pub fn fd(&self) -> &Rc<OwnedFd> {
        &self.file.fd
    }
}

impl Backend for FileBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: if self.ring == RingKind::Iopoll {
                "io_uring-iopoll"
            } else {
                "io_uring"
            },
            asynchronous: true,
            fua: true,
            flush: true,
            iopoll: self.ring == RingKind::Iopoll,
            power_loss_protected: false,
            vectored: self.vectored,
        }
    }

    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let f = self.file.fixed;
        let n = piece.iov_count as u32;
        let (ring, sqe) = match piece.op {
            Op::Read if n > 0 => (
                self.ring,
                engine::readv_sqe(f, piece.iov, n, piece.offset, piece.buf_index),
            ),
            Op::Write if n > 0 => (
                self.ring,
                engine::writev_sqe(f, piece.iov, n, piece.offset, piece.buf_index, piece.fua),
            ),
            Op::Read => (
                self.ring,
                engine::read_sqe(f, piece.ptr, piece.len, piece.offset, piece.buf_index),
            ),
            Op::Write => (
                self.ring,
                engine::write_sqe(
                    f,
                    piece.ptr,
                    piece.len,
                    piece.offset,
                    piece.buf_index,
                    piece.fua,
                ),
            ),
            // fsync cannot be polled: it always goes to the main ring.
            Op::Flush => (RingKind::Main, engine::fdatasync(f)),
        };
        // SAFETY: the caller guarantees the buffer until completion; the registered file lives in
        // `self.file`, which the device keeps until all its requests have completed.
        unsafe { engine.push(ring, sink, tag, sqe) }?;
        Ok(Started::Queued)
    }
}

/// `pread`/`pwrite` on the caller's thread: the SyncPath for devices where io_uring punts reads
/// to its worker threads (then a plain system call is several times faster).
#[derive(Clone)]
pub struct SyncBackend {
    fd: Rc<OwnedFd>,
}

impl SyncBackend {
    /// Use `fd` (opened `O_DIRECT`) synchronously.
    pub fn new(fd: Rc<OwnedFd>) -> Self {
        SyncBackend { fd }
    }
}

fn neg_errno(e: std::io::Error) -> i32 {
    -e.raw_os_error().unwrap_or(libc::EIO)
}

impl Backend for SyncBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: "sync",
            asynchronous: false,
            fua: true,
            flush: true,
            iopoll: false,
            power_loss_protected: false,
            vectored: true,
        }
    }

    unsafe fn start(
        &self,
        _engine: &Engine,
        _sink: SinkId,
        _tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let fd = self.fd.as_raw_fd();
        let len = piece.len as usize;
        let (iov, n) = (piece.iov, piece.iov_count as usize);
        let r = match piece.op {
            // SAFETY: the caller guarantees every segment for the duration of this call.
            Op::Read if n > 0 => unsafe { aios_core::sys::preadv_raw(fd, iov, n, piece.offset) },
            // SAFETY: as above, read-only use.
            Op::Write if n > 0 => unsafe {
                aios_core::sys::pwritev_raw(fd, iov, n, piece.offset, piece.fua)
            },
            // SAFETY: the caller guarantees `ptr..ptr+len` for the duration of this call.
            Op::Read => unsafe { aios_core::sys::pread_raw(fd, piece.ptr, len, piece.offset) },
            // SAFETY: as above, read-only use.
            Op::Write => unsafe {
                aios_core::sys::pwrite_raw(fd, piece.ptr, len, piece.offset, piece.fua)
            },
            Op::Flush => aios_core::sys::fdatasync(fd).map(|()| 0),
        };
        Ok(Started::Done(match r {
            Ok(n) => n as i32,
            Err(e) => neg_errno(e),
        }))
    }
}

/// RAM as a device: for tests, and for measuring lbio's own software cost.
pub struct MemBackend {
    mem: UnsafeCell<Box<[u8]>>,
    len: usize,
}

impl MemBackend {
    /// A zero-filled device of `bytes` bytes.
    pub fn new(bytes: usize) -> Self {
        MemBackend {
            mem: UnsafeCell::new(vec![0u8; bytes].into_boxed_slice()),
            len: bytes,
        }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the device has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Backend for MemBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: "memory",
            asynchronous: false,
            fua: true,
            flush: true,
            iopoll: false,
            power_loss_protected: false,
            vectored: true,
        }
    }

    unsafe fn start(
        &self,
        _engine: &Engine,
        _sink: SinkId,
        _tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        // SAFETY: `MemBackend` is !Sync and `start` is not re-entrant, so this is the only live
        // reference to the memory.
        let mem = unsafe { &mut *self.mem.get() };
        // SAFETY: the caller's contract on `piece` is passed on; `mem` is a separate heap
        // allocation, which no segment can overlap.
        Ok(Started::Done(unsafe { piece_in_memory(mem, piece) }))
    }
}

/// Do `piece` on a device whose bytes are `mem` (a read copies out of it, a write into it, a
/// FLUSH does nothing), for a backend kept in memory: what its completion carries, the bytes
/// done, or `-EINVAL` for a piece past the end of `mem`.
///
/// # Safety
/// Every segment of `piece` must be memory the caller may read (a write) or write (a read)
/// until this returns, and none may overlap `mem`.
pub unsafe fn piece_in_memory(mem: &mut [u8], piece: &Piece) -> i32 {
    let off = piece.offset as usize;
    let len = piece.len as usize;
    if off.checked_add(len).is_none_or(|end| end > mem.len()) {
        return -libc::EINVAL;
    }
    let mut one = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut at = off;
    for seg in piece.iovecs(&mut one) {
        let (p, n) = (seg.iov_base.cast::<u8>(), seg.iov_len);
        match piece.op {
            // SAFETY: the caller guarantees every segment is ours and apart from `mem`; the
            // segments add up to `len`, checked against `mem` above.
            Op::Read => unsafe { std::ptr::copy_nonoverlapping(mem.as_ptr().add(at), p, n) },
            // SAFETY: as above, in the other direction.
            Op::Write => unsafe { std::ptr::copy_nonoverlapping(p, mem.as_mut_ptr().add(at), n) },
            Op::Flush => {}
        }
        at += n;
    }
    len as i32
}

/// NVMe passthrough: reads, writes (optionally FUA) and flushes sent as raw NVMe commands
/// through `IORING_OP_URING_CMD` on the generic character device (`/dev/ngXnY`), with data in the
/// engine's registered arena (`IORING_URING_CMD_FIXED`). The block layer's bio path, the page
/// cache and the file layer are all skipped.
///
/// Completion results follow the passthrough convention: 0 is success (the whole piece moved), a
/// positive value is the NVMe status, a negative one an errno.
#[derive(Clone)]
pub struct NvmeBackend {
    file: Rc<RegisteredFile>,
    nsid: u32,
    lba_shift: u32,
    ring: RingKind,
    /// `Err(why)` when the kernel refuses the arena as fixed buffers for passthrough.
    registered: Result<(), Rc<str>>,
}

impl NvmeBackend {
    /// Register the opened character device `fd` of namespace `ns` with the engine, whose rings
    /// must take 128-byte SQEs (`EngineConfig { passthrough: true, .. }`), and check with one read
    /// of block 0 that the kernel takes the arena as fixed buffers (if it refuses them but maps
    /// plain addresses, commands carry plain addresses and
    /// [`NvmeBackend::registered_buffers`] says why).
    pub fn new(
        engine: &Rc<Engine>,
        fd: Rc<OwnedFd>,
        ns: &NvmeNamespace,
    ) -> Result<Self, CoreError> {
        if !engine.has_passthrough_rings() {
            return Err(CoreError::Config(format!(
                "{}: NVMe passthrough needs an engine built with EngineConfig {{ passthrough: \
                 true, .. }} (128-byte SQEs, 32-byte CQEs)",
                ns.char_device.display()
            )));
        }
        let fixed = engine.register_file(fd.as_raw_fd())?;
        let file = Rc::new(RegisteredFile {
            fd,
            fixed,
            engine: Rc::clone(engine),
        });
        let registered = nvme::registered_buffers_work(engine, fixed, ns)?.map_err(Rc::from);
        Ok(NvmeBackend {
            file,
            nsid: ns.nsid,
            lba_shift: ns.lba_bytes.trailing_zeros(),
            ring: RingKind::Main,
            registered,
        })
    }

    /// The same namespace with reads and writes on the engine's IOPOLL ring (the driver must have
    /// poll queues; the engine an IOPOLL ring).
    pub fn polled(&self) -> Result<Self, CoreError> {
        require_iopoll_ring(&self.file.engine)?;
        Ok(NvmeBackend {
            ring: RingKind::Iopoll,
            ..self.clone()
        })
    }

    /// `Ok` when commands carry data in the registered arena (`IORING_URING_CMD_FIXED`), else why
    /// the kernel refused it.
    pub fn registered_buffers(&self) -> Result<(), &str> {
        self.registered.as_ref().map(|_| ()).map_err(|w| &**w)
    }
}

impl Backend for NvmeBackend {
    fn caps(&self) -> Caps {
        Caps {
            name: match (self.ring == RingKind::Iopoll, self.registered.is_ok()) {
                (true, true) => "nvme-passthrough-iopoll",
                (false, true) => "nvme-passthrough",
                (true, false) => "nvme-passthrough-iopoll-unregistered",
                (false, false) => "nvme-passthrough-unregistered",
            },
            asynchronous: true,
            fua: true,
            flush: true,
            iopoll: self.ring == RingKind::Iopoll,
            power_loss_protected: false,
            // NVMe's vectored passthrough (`NVME_URING_CMD_IO_VEC`) is not used: a scattered
            // request goes out one segment per command.
            vectored: false,
        }
    }

    fn outcome(&self, res: i32, len: u32) -> Outcome {
        match res {
            0 => Outcome::Bytes(len),
            r if r < 0 => Outcome::Failed(PieceError::Errno(-r)),
            r => Outcome::Failed(PieceError::Nvme(NvmeStatus(r as u16))),
        }
    }

    unsafe fn start(
        &self,
        engine: &Engine,
        sink: SinkId,
        tag: u64,
        piece: &Piece,
    ) -> Result<Started, CoreError> {
        let slba = piece.offset >> self.lba_shift;
        let nlb = piece.len >> self.lba_shift;
        let (op, ring) = match piece.op {
            Op::Read => (IoOpcode::Read, self.ring),
            Op::Write => (IoOpcode::Write, self.ring),
            // A flush moves no data and gains nothing from polling.
            Op::Flush => (IoOpcode::Flush, RingKind::Main),
        };
        let cmd = PassthruCmd::io(
            op,
            self.nsid,
            slba,
            nlb,
            piece.ptr as u64,
            piece.len,
            piece.fua,
        );
        let fixed_data = match op {
            IoOpcode::Flush => None,
            _ if self.registered.is_err() => None,
            _ => piece.buf_index,
        };
        let sqe = nvme::uring_cmd(self.file.fixed, &cmd, fixed_data);
        // SAFETY: the caller guarantees the buffer until completion; the registered file lives in
        // `self.file`, which the device keeps until all its requests have completed.
        unsafe { engine.push_cmd(ring, sink, tag, sqe) }?;
        Ok(Started::Queued)
    }
}
