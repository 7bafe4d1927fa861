//! A device opened on an lbio array: validation, routes per request class, and the three ways to
//! do I/O — detached (`submit` + `LbioArray::take_done`), async (futures) and blocking.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use aios_core::{probe, DeviceKind, DeviceProbe, FixedBuf, ProbeOptions, Route};

use crate::array::{Class, LbioArray, Owner, RawBuf, RawIov, Request, Tag};
use crate::backend::{Backend, Caps, FileBackend, MemBackend, NvmeBackend, Op, SyncBackend};
use crate::error::LbioError;

/// Whether `v` is a multiple of `align` (alignments are powers of two on every device lbio
/// opens: a mask, not a division, on the path every request takes).
#[inline]
pub fn aligned(v: u64, align: u32) -> bool {
    if align.is_power_of_two() {
        v & (align as u64 - 1) == 0
    } else {
        align != 0 && v % align as u64 == 0
    }
}

/// Sizes and alignment rules of a device, checked on every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub capacity_bytes: u64,
    pub logical_block: u32,
    /// Buffer address alignment for direct I/O.
    pub mem_align: u32,
    /// Offset and length alignment for direct I/O.
    pub offset_align: u32,
    /// Largest single device command; longer requests are split.
    pub max_transfer_bytes: u32,
}

/// The most bytes one request may carry (one slot's length field, and one io_uring `len`).
pub const MAX_REQUEST_BYTES: u32 = 1 << 30;

/// Which route critical requests take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RouteChoice {
    /// Whatever the probe measured fastest.
    #[default]
    Auto,
    /// Always io_uring.
    Ring,
    /// Always `pread`/`pwrite` on the caller's thread.
    Sync,
}

/// How to open a device.
#[derive(Clone, Copy, Debug)]
pub struct DeviceConfig {
    /// Open read-write (writes and flushes are refused otherwise).
    pub write: bool,
    /// Route for critical requests.
    pub route: RouteChoice,
    /// Cap the max transfer below what the device reports (splits sooner).
    pub max_transfer_bytes: Option<u32>,
    /// Use the engine's IOPOLL ring for critical requests when the probe found IOPOLL working.
    pub iopoll: bool,
    /// Probe settings (latency samples decide the automatic route).
    pub probe: ProbeOptions,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            write: false,
            route: RouteChoice::Auto,
            max_transfer_bytes: None,
            iopoll: false,
            probe: ProbeOptions::default(),
        }
    }
}

/// A device open on an [`LbioArray`]. Dropping it closes the device once its requests finish.
pub struct Device {
    lbio: Rc<LbioArray>,
    idx: u16,
    geometry: Geometry,
    writable: bool,
    critical: (Caps, String),
    background: (Caps, String),
    probe: Option<DeviceProbe>,
}

impl Device {
    /// Probe `path`, open it `O_DIRECT` and choose the route for each request class.
    pub fn open(lbio: &Rc<LbioArray>, path: &Path, cfg: DeviceConfig) -> Result<Device, LbioError> {
        if !path.exists() {
            return Err(LbioError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let p = probe(path, cfg.probe)?;
        if p.kind == DeviceKind::CharDevice && p.passthrough.is_some() {
            return Self::open_passthrough(lbio, path, cfg, p);
        }
        if !matches!(p.kind, DeviceKind::BlockDevice | DeviceKind::RegularFile) {
            return Err(LbioError::NotABlockDevice {
                path: path.to_path_buf(),
                kind: p.kind.to_string(),
            });
        }
        let Some(dio) = p.dio else {
            return Err(LbioError::NoDirectIo {
                path: path.to_path_buf(),
                detail: p.dio_source.clone(),
            });
        };
        let fd = Rc::new(
            aios_core::sys::open_direct(path, cfg.write).map_err(|source| {
                LbioError::Core(aios_core::CoreError::Path {
                    path: path.to_path_buf(),
                    source,
                })
            })?,
        );
        let max_transfer = cfg
            .max_transfer_bytes
            .map_or(p.max_transfer_bytes, |m| m.min(p.max_transfer_bytes));
        // Split pieces must start aligned in memory too (see `from_backends`).
        let align = dio.offset_align.max(dio.mem_align);
        if max_transfer < align || max_transfer % align != 0 {
            return Err(LbioError::Config(format!(
                "max transfer {max_transfer} must be a positive multiple of the device's {align}-byte \
                 alignment"
            )));
        }
        let geometry = Geometry {
            capacity_bytes: p.capacity_bytes,
            logical_block: p.logical_block,
            mem_align: dio.mem_align,
            offset_align: dio.offset_align,
            max_transfer_bytes: max_transfer,
        };
        let engine = lbio.engine();
        let use_iopoll = cfg.iopoll && p.iopoll.is_ok() && engine.has_iopoll_ring();
        let (route, why) = match cfg.route {
            RouteChoice::Auto => (p.critical.route, p.critical.reason.clone()),
            RouteChoice::Ring => (Route::Ring, "io_uring, as configured".to_string()),
            RouteChoice::Sync => (Route::Sync, "sync pread/pwrite, as configured".to_string()),
        };
        let ring = FileBackend::new(engine, Rc::clone(&fd), false)?;
        let critical: Box<dyn Backend> = match route {
            Route::Sync => Box::new(SyncBackend::new(Rc::clone(&fd))),
            Route::Ring if use_iopoll => Box::new(FileBackend::new(engine, Rc::clone(&fd), true)?),
            Route::Ring | Route::Passthrough => Box::new(ring.clone()),
        };
        let why = if use_iopoll {
            format!("{why}; completions polled on the IOPOLL ring")
        } else {
            why
        };
        let background_why = p.background.reason.clone();
        let mut dev = Self::from_backends(lbio, critical, Box::new(ring), geometry, cfg.write)?;
        dev.critical.1 = why;
        dev.background.1 = background_why;
        dev.declare_cache(&p);
        dev.probe = Some(p);
        Ok(dev)
    }

    /// Open an NVMe namespace's passthrough character device: both classes send raw NVMe
    /// commands; critical reads and writes use the IOPOLL ring when configured and working.
    fn open_passthrough(
        lbio: &Rc<LbioArray>,
        path: &Path,
        cfg: DeviceConfig,
        p: DeviceProbe,
    ) -> Result<Device, LbioError> {
        if cfg.route == RouteChoice::Sync {
            return Err(LbioError::Config(format!(
                "{}: an NVMe passthrough device takes commands only through io_uring; the sync \
                 route needs the block device (/dev/nvmeXnY)",
                path.display()
            )));
        }
        let pt = p.passthrough.as_ref().expect("checked by the caller");
        if let Err(why) = &pt.namespace {
            return Err(LbioError::Core(aios_core::CoreError::NotNvme {
                path: path.to_path_buf(),
                why: why.clone(),
            }));
        }
        let (fd, ns) = aios_core::nvme::open_namespace(path)?;
        let fd = Rc::new(fd);
        let engine = lbio.engine();
        let max_transfer = cfg
            .max_transfer_bytes
            .map_or(ns.max_transfer_bytes(), |m| m.min(ns.max_transfer_bytes()));
        if max_transfer < ns.lba_bytes || max_transfer % ns.lba_bytes != 0 {
            return Err(LbioError::Config(format!(
                "max transfer {max_transfer} must be a positive multiple of the namespace's \
                 {}-byte blocks",
                ns.lba_bytes
            )));
        }
        let geometry = Geometry {
            capacity_bytes: ns.capacity_bytes(),
            logical_block: ns.lba_bytes,
            mem_align: ns.lba_bytes,
            offset_align: ns.lba_bytes,
            max_transfer_bytes: max_transfer,
        };
        let use_iopoll = cfg.iopoll && pt.iopoll.is_ok() && engine.has_iopoll_ring();
        let background = NvmeBackend::new(engine, fd, &ns)?;
        let critical: Box<dyn Backend> = if use_iopoll {
            Box::new(background.polled()?)
        } else {
            Box::new(background.clone())
        };
        let base = match background.registered_buffers() {
            Ok(()) => p.critical.reason.clone(),
            Err(refused) => format!("{}; {refused}", p.critical.reason),
        };
        let why = if use_iopoll {
            format!("{}; completions polled on the IOPOLL ring", base)
        } else if cfg.iopoll {
            match &pt.iopoll {
                Err(e) => format!("{}; IOPOLL unavailable: {e}", base),
                Ok(()) => format!("{}; IOPOLL works but the engine has no IOPOLL ring", base),
            }
        } else {
            base
        };
        let background_why = p.background.reason.clone();
        let mut dev =
            Self::from_backends(lbio, critical, Box::new(background), geometry, cfg.write)?;
        dev.critical.1 = why;
        dev.background.1 = background_why;
        dev.declare_cache(&p);
        dev.probe = Some(p);
        Ok(dev)
    }

    /// Open a device over explicit backends (e.g. [`MemBackend`]) with the given geometry.
    pub fn from_backends(
        lbio: &Rc<LbioArray>,
        critical: Box<dyn Backend>,
        background: Box<dyn Backend>,
        geometry: Geometry,
        writable: bool,
    ) -> Result<Device, LbioError> {
        let g = geometry;
        let ok = |v: u32| v.is_power_of_two();
        // Pieces of a split request start at multiples of the max transfer (or the background
        // piece size) into its memory: they must keep the memory alignment too. Both are powers
        // of two, so the larger is a multiple of the other.
        let align = g.offset_align.max(g.mem_align);
        if !ok(g.mem_align)
            || !ok(g.offset_align)
            || g.max_transfer_bytes == 0
            || g.max_transfer_bytes % align != 0
        {
            return Err(LbioError::Config(format!(
                "geometry {g:?}: alignments must be powers of two and max transfer a non-zero \
                 multiple of the offset alignment and of the memory alignment"
            )));
        }
        let caps = (critical.caps(), background.caps());
        let idx = lbio.add_device(critical, background, g.max_transfer_bytes, align)?;
        Ok(Device {
            lbio: Rc::clone(lbio),
            idx,
            geometry,
            writable,
            critical: (caps.0, "as given".to_string()),
            background: (caps.1, "as given".to_string()),
            probe: None,
        })
    }

    /// A RAM device of `bytes` bytes with 512-byte blocks (both classes on [`MemBackend`]).
    pub fn memory(lbio: &Rc<LbioArray>, bytes: usize) -> Result<Device, LbioError> {
        let mem = Rc::new(MemBackend::new(bytes));
        let geometry = Geometry {
            capacity_bytes: bytes as u64,
            logical_block: 512,
            mem_align: 512,
            offset_align: 512,
            max_transfer_bytes: 1 << 20,
        };
        Self::from_backends(
            lbio,
            Box::new(SharedMem(Rc::clone(&mem))),
            Box::new(SharedMem(mem)),
            geometry,
            true,
        )
    }

    /// A device without a volatile write cache (the kernel's `write_cache` says "write
    /// through", or the NVMe controller has no VWC) makes writes durable at completion: both
    /// routes declare power-loss protection, and callers skip their FLUSH (the kernel would
    /// complete it without doing anything).
    fn declare_cache(&mut self, p: &DeviceProbe) {
        if p.volatile_write_cache == Some(false) {
            self.critical.0.power_loss_protected = true;
            self.background.0.power_loss_protected = true;
        }
    }

    /// The device's geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    /// Whether the device was opened for writing (writes and FLUSHes are refused otherwise).
    pub fn writable(&self) -> bool {
        self.writable
    }
    /// The lbio array the device is open on.
    pub fn lbio(&self) -> &Rc<LbioArray> {
        &self.lbio
    }
    /// What the probe found (for devices opened by path).
    pub fn probe(&self) -> Option<&DeviceProbe> {
        self.probe.as_ref()
    }
    /// Backend capabilities and reason for the critical route.
    pub fn critical_route(&self) -> (&Caps, &str) {
        (&self.critical.0, &self.critical.1)
    }
    /// Backend capabilities and reason for the background route.
    pub fn background_route(&self) -> (&Caps, &str) {
        (&self.background.0, &self.background.1)
    }

    /// Check a queue depth against the slot array before starting a workload.
    pub fn check_queue_depth(&self, qd: u32) -> Result<(), LbioError> {
        let slots = self.lbio.config().slots;
        if qd == 0 || qd > slots {
            return Err(LbioError::QueueDepth { qd, slots });
        }
        Ok(())
    }

    #[inline]
    fn validate(&self, op: Op, offset: u64, mem: Option<(usize, usize)>) -> Result<u32, LbioError> {
        if op != Op::Read && !self.writable {
            return Err(LbioError::ReadOnly(op));
        }
        let Some((addr, len)) = mem else {
            return Ok(0);
        };
        let g = &self.geometry;
        if len == 0 {
            return Err(LbioError::Empty(op));
        }
        if len > MAX_REQUEST_BYTES as usize {
            return Err(LbioError::TooLong {
                len,
                max: MAX_REQUEST_BYTES,
            });
        }
        if !aligned(offset, g.offset_align) {
            return Err(LbioError::Unaligned {
                what: "offset",
                value: offset,
                align: g.offset_align,
            });
        }
        if !aligned(len as u64, g.offset_align) {
            return Err(LbioError::Unaligned {
                what: "length",
                value: len as u64,
                align: g.offset_align,
            });
        }
        if !aligned(addr as u64, g.mem_align) {
            return Err(LbioError::Unaligned {
                what: "buffer address",
                value: addr as u64,
                align: g.mem_align,
            });
        }
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > g.capacity_bytes)
        {
            return Err(LbioError::PastEnd {
                offset,
                len: len as u32,
                capacity: g.capacity_bytes,
            });
        }
        Ok(len as u32)
    }

    /// Every segment of a scattered request must meet the alignment rules on its own (direct
    /// I/O moves whole blocks to each); the whole is then checked like one buffer.
    fn validate_segments(&self, op: Op, v: &RawIov) -> Result<(usize, usize), LbioError> {
        let g = &self.geometry;
        let segs = v.segments();
        if segs.is_empty() {
            return Err(LbioError::Empty(op));
        }
        for s in segs {
            let (addr, len) = (s.iov_base as usize, s.iov_len);
            if len == 0 || !aligned(len as u64, g.offset_align) {
                return Err(LbioError::Unaligned {
                    what: "segment length",
                    value: len as u64,
                    align: g.offset_align,
                });
            }
            if !aligned(addr as u64, g.mem_align) {
                return Err(LbioError::Unaligned {
                    what: "segment address",
                    value: addr as u64,
                    align: g.mem_align,
                });
            }
        }
        if v.bytes() > MAX_REQUEST_BYTES as u64 {
            return Err(LbioError::TooLong {
                len: v.bytes() as usize,
                max: MAX_REQUEST_BYTES,
            });
        }
        Ok((segs[0].iov_base as usize, v.bytes() as usize))
    }

    #[inline]
    fn request(&self, io: Io) -> Result<Request, (LbioError, Option<FixedBuf>)> {
        let mem = match (&io.buf, &io.raw, &io.iov) {
            (Some(b), _, _) => Some((b.as_ptr() as usize, b.len())),
            (None, Some(r), _) => Some((r.as_ptr() as usize, r.len() as usize)),
            (None, None, Some(v)) => match self.validate_segments(io.op, v) {
                Ok(m) => Some(m),
                Err(e) => return Err((e, io.buf)),
            },
            (None, None, None) => None,
        };
        match self.validate(io.op, io.offset, mem) {
            Ok(len) => Ok(Request {
                op: io.op,
                class: io.class,
                fua: io.fua,
                offset: io.offset,
                len,
                buf: io.buf,
                raw: io.raw,
                iov: io.iov,
            }),
            Err(e) => Err((e, io.buf)),
        }
    }

    /// Start a request whose completion goes to the array's done queue
    /// ([`LbioArray::take_done`]). A refused request gives its buffer back with the error.
    ///
    /// This is the lowest-overhead interface: no future, no waker. Inside
    /// [`Engine::hold_submissions`](aios_core::Engine::hold_submissions) or a plug, many submits
    /// reach the kernel in one `io_uring_enter`.
    #[inline]
    pub fn submit(&self, io: Io) -> Result<Tag, (LbioError, Option<FixedBuf>)> {
        let req = self.request(io)?;
        self.lbio.submit(self.idx, req, Owner::Detached)
    }

    /// Read `buf.len()` bytes at `offset` into `buf` (a critical request).
    pub fn read_at(&self, offset: u64, buf: FixedBuf) -> IoFuture<'_> {
        self.future(Io::read(offset, buf))
    }

    /// Write `buf` at `offset` (a critical request); with `fua` it is durable on completion.
    pub fn write_at(&self, offset: u64, buf: FixedBuf, fua: bool) -> IoFuture<'_> {
        self.future(Io::write(offset, buf).fua(fua))
    }

    /// Make completed writes durable.
    pub fn flush(&self) -> IoFuture<'_> {
        self.future(Io::flush())
    }

    /// Any request as a future. A request refused for bad input resolves to the error and
    /// drops its buffer; [`Device::submit`] hands the buffer back instead.
    pub fn future(&self, io: Io) -> IoFuture<'_> {
        IoFuture {
            dev: self,
            state: match self.request(io) {
                Ok(req) => FutState::Start(Some(req)),
                Err((e, _)) => FutState::Failed(Some(e)),
            },
        }
    }

    /// Blocking read: returns the filled buffer.
    pub fn read_at_blocking(&self, offset: u64, buf: FixedBuf) -> Result<FixedBuf, LbioError> {
        self.run_blocking(Io::read(offset, buf))
            .map(|b| b.expect("reads carry a buffer"))
    }

    /// Blocking write: returns the buffer for reuse.
    pub fn write_at_blocking(
        &self,
        offset: u64,
        buf: FixedBuf,
        fua: bool,
    ) -> Result<FixedBuf, LbioError> {
        self.run_blocking(Io::write(offset, buf).fua(fua))
            .map(|b| b.expect("writes carry a buffer"))
    }

    /// Blocking flush.
    pub fn flush_blocking(&self) -> Result<(), LbioError> {
        self.run_blocking(Io::flush()).map(|_| ())
    }

    /// Run any request to completion on the calling thread.
    ///
    /// A request refused for bad input (alignment, bounds, read-only) drops its buffer with the
    /// error; [`Device::submit`] hands the buffer back instead.
    pub fn run_blocking(&self, io: Io) -> Result<Option<FixedBuf>, LbioError> {
        let mut req = self.request(io).map_err(|e| e.0)?;
        let engine = self.lbio.engine();
        let tag = loop {
            let shape = req.shape();
            // Held: the wait below submits and waits in one io_uring_enter.
            match engine.hold_submissions(|| self.lbio.submit(self.idx, req, Owner::Blocking)) {
                Ok(tag) => break tag,
                Err((LbioError::NoFreeSlot { slots }, buf)) => {
                    if !engine.has_work() {
                        return Err(LbioError::NoFreeSlot { slots });
                    }
                    req = shape.with_buf(buf);
                    engine.wait(1)?;
                }
                Err((e, _)) => return Err(e),
            }
        };
        loop {
            if let Some(c) = self.lbio.try_take(tag) {
                return c.result.map(|_| c.buf);
            }
            if let Err(e) = engine.wait(1) {
                // The wait may have dispatched this request's completion before it failed
                // (submitting other queued work): then it is done, and its result stands.
                if let Some(c) = self.lbio.try_take(tag) {
                    return c.result.map(|_| c.buf);
                }
                // The request may still be in flight, its buffer the kernel's: nobody will
                // take it now, so its slot (and buffer) go back when it ends.
                self.lbio.orphan(tag);
                return Err(e.into());
            }
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.lbio.close_device(self.idx);
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("geometry", &self.geometry)
            .field("critical", &self.critical)
            .field("background", &self.background)
            .finish()
    }
}

/// Describes one request: operation, offset, buffer, class and FUA.
#[derive(Debug)]
pub struct Io {
    op: Op,
    offset: u64,
    buf: Option<FixedBuf>,
    raw: Option<RawBuf>,
    iov: Option<RawIov>,
    class: Class,
    fua: bool,
}

impl Io {
    /// Read `buf.len()` bytes at `offset`.
    pub fn read(offset: u64, buf: FixedBuf) -> Io {
        Io {
            op: Op::Read,
            offset,
            buf: Some(buf),
            raw: None,
            iov: None,
            class: Class::Critical,
            fua: false,
        }
    }
    /// Write `buf` at `offset`.
    pub fn write(offset: u64, buf: FixedBuf) -> Io {
        Io {
            op: Op::Write,
            offset,
            buf: Some(buf),
            raw: None,
            iov: None,
            class: Class::Critical,
            fua: false,
        }
    }
    /// Flush completed writes to stable storage.
    pub fn flush() -> Io {
        Io {
            op: Op::Flush,
            offset: 0,
            buf: None,
            raw: None,
            iov: None,
            class: Class::Critical,
            fua: false,
        }
    }
    /// Read `raw.len()` bytes at `offset` into memory outside the arena (e.g. a page-cache frame
    /// in a registered shared region). The completion carries no buffer.
    ///
    /// # Safety
    /// `raw`'s contract ([`RawBuf::new`]) holds until the request completes — also when its
    /// future is dropped early.
    pub unsafe fn read_raw(offset: u64, raw: RawBuf) -> Io {
        Io {
            op: Op::Read,
            offset,
            buf: None,
            raw: Some(raw),
            iov: None,
            class: Class::Critical,
            fua: false,
        }
    }
    /// Write `raw.len()` bytes from memory outside the arena at `offset`.
    ///
    /// # Safety
    /// As [`Io::read_raw`] (the bytes must not change until the write completes).
    pub unsafe fn write_raw(offset: u64, raw: RawBuf) -> Io {
        Io {
            op: Op::Write,
            offset,
            buf: None,
            raw: Some(raw),
            iov: None,
            class: Class::Critical,
            fua: false,
        }
    }
    /// Read `iov.bytes()` bytes at `offset` into scattered memory outside the arena: one device
    /// command where the backend takes vectored pieces ([`Caps::vectored`]), one per segment
    /// otherwise; one completion either way, carrying no buffer.
    ///
    /// # Safety
    /// `iov`'s contract ([`RawIov::new`]) holds until the request completes — also when its
    /// future is dropped early.
    pub unsafe fn readv_raw(offset: u64, iov: RawIov) -> Io {
        Io {
            op: Op::Read,
            offset,
            buf: None,
            raw: None,
            iov: Some(iov),
            class: Class::Critical,
            fua: false,
        }
    }
    /// Write scattered memory outside the arena to `offset` onwards ([`Io::readv_raw`]'s
    /// counterpart).
    ///
    /// # Safety
    /// As [`Io::readv_raw`] (the bytes must not change until the write completes).
    pub unsafe fn writev_raw(offset: u64, iov: RawIov) -> Io {
        Io {
            op: Op::Write,
            offset,
            buf: None,
            raw: None,
            iov: Some(iov),
            class: Class::Critical,
            fua: false,
        }
    }
    /// Set the request class.
    pub fn class(mut self, class: Class) -> Io {
        self.class = class;
        self
    }
    /// Mark a write force-unit-access (durable when it completes).
    pub fn fua(mut self, fua: bool) -> Io {
        self.fua = fua;
        self
    }
}

enum FutState {
    Failed(Option<LbioError>),
    Start(Option<Request>),
    Waiting(Tag),
    Finished,
}

/// A request in flight as a future; resolves to the buffer (`None` for a flush).
///
/// Dropping it before completion is safe: the slot keeps the buffer until the device is done with
/// it, then frees both.
pub struct IoFuture<'a> {
    dev: &'a Device,
    state: FutState,
}

impl Future for IoFuture<'_> {
    type Output = Result<Option<FixedBuf>, LbioError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let lbio = &this.dev.lbio;
        loop {
            match &mut this.state {
                FutState::Failed(e) => {
                    let e = e.take().expect("polled after completion");
                    this.state = FutState::Finished;
                    return Poll::Ready(Err(e));
                }
                FutState::Start(req) => {
                    let r = req.take().expect("request present until submitted");
                    let shape = r.shape();
                    match lbio.submit(this.dev.idx, r, Owner::Future) {
                        Ok(tag) => this.state = FutState::Waiting(tag),
                        Err((LbioError::NoFreeSlot { .. }, buf)) => {
                            // Back-pressure: wait for a slot, then resubmit the same request.
                            this.state = FutState::Start(Some(shape.with_buf(buf)));
                            lbio.wait_for_slot(cx.waker());
                            return Poll::Pending;
                        }
                        Err((e, _)) => {
                            this.state = FutState::Finished;
                            return Poll::Ready(Err(e));
                        }
                    }
                }
                FutState::Waiting(tag) => {
                    let tag = *tag;
                    if let Some(c) = lbio.try_take(tag) {
                        this.state = FutState::Finished;
                        return Poll::Ready(c.result.map(|_| c.buf));
                    }
                    lbio.set_waker(tag, cx.waker());
                    return Poll::Pending;
                }
                FutState::Finished => panic!("IoFuture polled after completion"),
            }
        }
    }
}

impl Drop for IoFuture<'_> {
    fn drop(&mut self) {
        if let FutState::Waiting(tag) = self.state {
            self.dev.lbio.orphan(tag);
        }
    }
}

/// RAM backend shared by both routes of a memory device.
struct SharedMem(Rc<MemBackend>);

impl Backend for SharedMem {
    fn caps(&self) -> Caps {
        self.0.caps()
    }
    unsafe fn start(
        &self,
        engine: &aios_core::Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &crate::backend::Piece,
    ) -> Result<crate::backend::Started, aios_core::CoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.0.start(engine, sink, tag, piece) }
    }
}
