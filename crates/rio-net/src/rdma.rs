//! The RDMA transport (cargo feature `rdma`): one reliable-connected queue pair per connection,
//! set up with the RDMA connection manager (librdmacm) on an IP address and port.
//!
//! - **Capsules by SEND/RECV.** The NVMe/TCP PDUs both sides already speak (ICReq, command
//!   capsules, responses, C2HData, R2T) travel as a byte stream cut into SEND messages of at most
//!   [`MSG`] bytes; the receiver appends each message to its receive buffer and decodes PDUs from
//!   it as it would from a socket. RC queue pairs deliver in order and retry for ever on
//!   receiver-not-ready, so the stream is reliable and ordered like TCP.
//! - **Write data by RDMA READ.** A write on an RDMA connection carries a keyed SGL descriptor
//!   (address, length, key) pointing into the initiator's arena, which is registered as a memory
//!   region; the target pulls the data with RDMA READ into a buffer of its own arena (registered
//!   too) and submits the write when the READ completes. No data crosses in the capsule and no
//!   R2T is needed.
//! - Read data comes back as C2HData PDUs in the stream (one copy into a send buffer).
//!
//! This is aios's own binding of the PDUs to RDMA, not NVMe/RDMA (the kernel's `nvme-rdma`
//! host and `nvmet-rdma` target cannot talk to it).

#![allow(unsafe_code)]

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr;
use std::time::{Duration, Instant};

use rdma_sys::*;

/// Bytes of one SEND message (and of each posted receive buffer).
pub const MSG: usize = 32 << 10;
/// Receive buffers posted per connection.
const RECVS: usize = 64;
/// Send buffers per connection.
const SENDS: usize = 64;
/// RDMA READs a connection may have posted at once.
pub const MAX_READS: usize = 256;

const KIND_SHIFT: u32 = 62;
const KIND_RECV: u64 = 1;
const KIND_SEND: u64 = 2;
const KIND_READ: u64 = 3;

fn os_err(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

fn check(rc: i32, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(os_err(what))
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns; no memory is passed.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } < 0 {
        return Err(os_err("fcntl O_NONBLOCK"));
    }
    Ok(())
}

fn sockaddr_in(addr: SocketAddr) -> io::Result<libc::sockaddr_in> {
    let SocketAddr::V4(a) = addr else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{addr}: the RDMA transport takes IPv4 addresses"),
        ));
    };
    // SAFETY: sockaddr_in is plain data; all-zero is a valid value.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = a.port().to_be();
    sa.sin_addr.s_addr = u32::from(*a.ip()).to_be();
    Ok(sa)
}

fn from_sockaddr(sa: &libc::sockaddr) -> SocketAddr {
    if sa.sa_family as i32 == libc::AF_INET {
        // SAFETY: the family says this is a sockaddr_in, which fits in the storage it came from.
        let sin = unsafe { &*(sa as *const libc::sockaddr).cast::<libc::sockaddr_in>() };
        SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))),
            u16::from_be(sin.sin_port),
        )
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
    }
}

fn event_name(ev: rdma_cm_event_type::Type) -> String {
    // SAFETY: rdma_event_str returns a static C string for any value.
    let p = unsafe { rdma_event_str(ev) };
    if p.is_null() {
        return format!("event {ev}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// An event channel of the connection manager.
struct Channel(*mut rdma_event_channel);

impl Channel {
    fn new() -> io::Result<Channel> {
        // SAFETY: creates a channel; null on failure.
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            return Err(os_err(
                "rdma_create_event_channel (is an RDMA device configured?)",
            ));
        }
        Ok(Channel(ch))
    }
    fn fd(&self) -> RawFd {
        // SAFETY: the channel is live for as long as self.
        unsafe { (*self.0).fd }
    }
    /// The next event: (its id, its type, its status), acknowledged; waits up to `timeout`.
    fn next(&self, timeout: Duration) -> io::Result<(*mut rdma_cm_id, u32, i32)> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.try_next()? {
                Some(e) => return Ok(e),
                None => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "no answer from the RDMA connection manager",
                        ));
                    }
                    poll_in(&[self.fd()], left)?;
                }
            }
        }
    }
    /// An event if one is waiting (the channel's descriptor is non-blocking).
    fn try_next(&self) -> io::Result<Option<(*mut rdma_cm_id, u32, i32)>> {
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: the channel is live; ev receives an event we acknowledge below.
        let rc = unsafe { rdma_get_cm_event(self.0, &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(io::Error::new(e.kind(), format!("rdma_get_cm_event: {e}"))),
            };
        }
        // SAFETY: ev is a valid event until acknowledged.
        let got = unsafe { ((*ev).id, (*ev).event, (*ev).status) };
        // SAFETY: acknowledging the event we got, once.
        unsafe { rdma_ack_cm_event(ev) };
        Ok(Some(got))
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel was destroyed before (Link's drop order).
        unsafe { rdma_destroy_event_channel(self.0) };
    }
}

fn poll_in(fds: &[RawFd], timeout: Duration) -> io::Result<()> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: p is a valid array of pollfd for its length.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if rc < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
        return Err(os_err("poll"));
    }
    Ok(())
}

/// A registered buffer the link owns (receive or send messages).
struct Region {
    mem: Vec<u8>,
    mr: *mut ibv_mr,
}

impl Region {
    fn new(pd: *mut ibv_pd, bytes: usize) -> io::Result<Region> {
        let mut mem = vec![0u8; bytes];
        // SAFETY: mem lives as long as the region; it is deregistered before it is freed.
        let mr = unsafe {
            ibv_reg_mr(
                pd,
                mem.as_mut_ptr().cast(),
                bytes,
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            )
        };
        if mr.is_null() {
            return Err(os_err("ibv_reg_mr (message buffers)"));
        }
        Ok(Region { mem, mr })
    }
    fn lkey(&self) -> u32 {
        // SAFETY: mr is live for as long as self.
        unsafe { (*self.mr).lkey }
    }
    fn at(&mut self, i: usize) -> *mut u8 {
        self.mem[i * MSG..].as_mut_ptr()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered in new(); the queue pair using it is gone (Link drops it first).
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// Memory a caller registered on the link (an engine's arena).
#[derive(Clone, Copy, Debug)]
pub struct MemKeys {
    pub lkey: u32,
    pub rkey: u32,
}

/// A connected RC queue pair with its completion queue and message buffers.
pub struct Link {
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    cc: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    qp_made: bool,
    recv: Option<Region>,
    send: Option<Region>,
    free_send: Vec<usize>,
    mrs: Vec<*mut ibv_mr>,
    reads_out: usize,
    /// Completed RDMA READs: (caller's id, error if it failed).
    pub reads_done: Vec<(u64, Option<String>)>,
    /// The peer disconnected, or the queue pair was flushed.
    pub closed: bool,
    cq_events: u32,
    peer: SocketAddr,
    // Dropped last: the ids on it are destroyed in Link::drop.
    ch: Channel,
}

// SAFETY: the verbs objects are thread-safe in libibverbs; a Link is used by one thread at a
// time (it is moved to its connection's thread, never shared).
unsafe impl Send for Link {}

fn conn_param(depth: u8) -> rdma_conn_param {
    rdma_conn_param {
        private_data: ptr::null(),
        private_data_len: 0,
        responder_resources: depth,
        initiator_depth: depth,
        flow_control: 1,
        retry_count: 7,
        // 7: retry for ever while the receiver has no buffer posted.
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    }
}

/// Outstanding RDMA READs per queue pair asked for (the device may allow fewer).
const RD_DEPTH: u8 = 16;

impl Link {
    fn new(ch: Channel, id: *mut rdma_cm_id, peer: SocketAddr) -> Link {
        Link {
            id,
            pd: ptr::null_mut(),
            cc: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp_made: false,
            recv: None,
            send: None,
            free_send: (0..SENDS).rev().collect(),
            mrs: Vec::new(),
            reads_out: 0,
            reads_done: Vec::new(),
            closed: false,
            cq_events: 0,
            peer,
            ch,
        }
    }

    /// Protection domain, completion channel and queue, queue pair and buffers on `self.id`.
    fn setup(&mut self) -> io::Result<()> {
        // SAFETY: id is a live cm id with a resolved device (verbs non-null checked).
        let verbs = unsafe { (*self.id).verbs };
        if verbs.is_null() {
            return Err(io::Error::other("the connection has no RDMA device"));
        }
        // SAFETY: verbs context of the id; objects are freed in drop.
        unsafe {
            self.pd = ibv_alloc_pd(verbs);
            if self.pd.is_null() {
                return Err(os_err("ibv_alloc_pd"));
            }
            self.cc = ibv_create_comp_channel(verbs);
            if self.cc.is_null() {
                return Err(os_err("ibv_create_comp_channel"));
            }
            set_nonblocking((*self.cc).fd)?;
            let depth = (RECVS + SENDS + MAX_READS + 16) as i32;
            self.cq = ibv_create_cq(verbs, depth, ptr::null_mut(), self.cc, 0);
            if self.cq.is_null() {
                return Err(os_err("ibv_create_cq"));
            }
            let mut attr: ibv_qp_init_attr = std::mem::zeroed();
            attr.send_cq = self.cq;
            attr.recv_cq = self.cq;
            attr.qp_type = ibv_qp_type::IBV_QPT_RC;
            attr.sq_sig_all = 1;
            attr.cap.max_send_wr = (SENDS + MAX_READS) as u32;
            attr.cap.max_recv_wr = RECVS as u32;
            attr.cap.max_send_sge = 1;
            attr.cap.max_recv_sge = 1;
            check(
                rdma_create_qp(self.id, self.pd, &mut attr),
                "rdma_create_qp",
            )?;
            self.qp_made = true;
        }
        self.recv = Some(Region::new(self.pd, RECVS * MSG)?);
        self.send = Some(Region::new(self.pd, SENDS * MSG)?);
        for i in 0..RECVS {
            self.post_recv(i)?;
        }
        self.arm()?;
        Ok(())
    }

    fn post_recv(&mut self, i: usize) -> io::Result<()> {
        let r = self.recv.as_mut().expect("set up");
        let mut sge = ibv_sge {
            addr: r.at(i) as u64,
            length: MSG as u32,
            lkey: r.lkey(),
        };
        let mut wr = ibv_recv_wr {
            wr_id: KIND_RECV << KIND_SHIFT | i as u64,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the queue pair is live; sge points into a registered region that outlives it.
        check(
            unsafe { ibv_post_recv((*self.id).qp, &mut wr, &mut bad) },
            "ibv_post_recv",
        )
    }

    fn arm(&mut self) -> io::Result<()> {
        // SAFETY: cq is live.
        check(
            unsafe { ibv_req_notify_cq(self.cq, 0) },
            "ibv_req_notify_cq",
        )
    }

    /// Connect to a listening [`Listener`] at `addr`.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Link> {
        let ch = Channel::new()?;
        let mut id = ptr::null_mut();
        // SAFETY: creates an id on our channel.
        check(
            unsafe { rdma_create_id(ch.0, &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) },
            "rdma_create_id",
        )?;
        let mut link = Link::new(ch, id, addr);
        set_nonblocking(link.ch.fd())?;
        let mut dst = sockaddr_in(addr)?;
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: dst is a valid sockaddr_in for the call's duration.
        check(
            unsafe {
                rdma_resolve_addr(
                    id,
                    ptr::null_mut(),
                    (&mut dst as *mut libc::sockaddr_in).cast(),
                    ms,
                )
            },
            "rdma_resolve_addr",
        )?;
        link.expect(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED, timeout)?;
        // SAFETY: the address is resolved.
        check(unsafe { rdma_resolve_route(id, ms) }, "rdma_resolve_route")?;
        link.expect(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED, timeout)?;
        link.setup()?;
        let mut p = conn_param(RD_DEPTH);
        // SAFETY: the queue pair exists; p lives for the call.
        check(unsafe { rdma_connect(id, &mut p) }, "rdma_connect")?;
        link.expect(rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED, timeout)?;
        Ok(link)
    }

    fn expect(&mut self, want: u32, timeout: Duration) -> io::Result<()> {
        let (_, ev, status) = self.ch.next(timeout).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("{}: waiting for {}: {e}", self.peer, event_name(want)),
            )
        })?;
        if ev == want {
            return Ok(());
        }
        let kind = if ev == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED {
            io::ErrorKind::ConnectionRefused
        } else {
            io::ErrorKind::Other
        };
        Err(io::Error::new(
            kind,
            format!(
                "{}: expected {}, got {} (status {status})",
                self.peer,
                event_name(want),
                event_name(ev)
            ),
        ))
    }

    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Register `len` bytes at `ptr` for local writes and remote reads.
    ///
    /// # Safety
    /// The memory must stay mapped until the link is dropped.
    pub unsafe fn register(&mut self, ptr: *mut u8, len: usize) -> io::Result<MemKeys> {
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        // SAFETY: the caller keeps the memory mapped while the link lives.
        let mr = unsafe { ibv_reg_mr(self.pd, ptr.cast(), len, access as i32) };
        if mr.is_null() {
            return Err(os_err("ibv_reg_mr (arena)"));
        }
        self.mrs.push(mr);
        // SAFETY: mr is live.
        Ok(unsafe {
            MemKeys {
                lkey: (*mr).lkey,
                rkey: (*mr).rkey,
            }
        })
    }

    /// Descriptors to wait on for anything this link may report.
    pub fn fds(&self) -> [BorrowedFd<'_>; 2] {
        // SAFETY: both descriptors live as long as self.
        unsafe {
            [
                BorrowedFd::borrow_raw((*self.cc).fd),
                BorrowedFd::borrow_raw(self.ch.fd()),
            ]
        }
    }

    /// Take completions: received messages go to `on_msg` (then their buffer is posted again),
    /// finished sends free their buffer, finished READs go to `reads_done`. Returns the bytes
    /// received.
    pub fn poll(&mut self, mut on_msg: impl FnMut(&[u8])) -> io::Result<usize> {
        // Connection manager events: only a disconnect matters once connected.
        while let Some((_, ev, _)) = self.ch.try_next()? {
            if ev == rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                || ev == rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                || ev == rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT
            {
                self.closed = true;
            }
        }
        // Completion events: acknowledge, then re-arm before polling so nothing is missed.
        loop {
            let mut cq = ptr::null_mut();
            let mut ctx = ptr::null_mut();
            // SAFETY: non-blocking channel; returns -1 when no event is waiting.
            if unsafe { ibv_get_cq_event(self.cc, &mut cq, &mut ctx) } != 0 {
                break;
            }
            self.cq_events += 1;
        }
        if self.cq_events > 0 {
            // SAFETY: acknowledging events we took from this cq.
            unsafe { ibv_ack_cq_events(self.cq, self.cq_events) };
            self.cq_events = 0;
        }
        self.arm()?;
        let mut total = 0;
        // SAFETY: ibv_wc is plain data.
        let mut wcs: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: wcs has room for 32 entries.
            let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(os_err("ibv_poll_cq"));
            }
            for wc in &wcs[..n as usize] {
                let kind = wc.wr_id >> KIND_SHIFT;
                let low = wc.wr_id & ((1 << KIND_SHIFT) - 1);
                let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
                if !ok && wc.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR {
                    // The queue pair went to the error state (disconnect): no more traffic.
                    self.closed = true;
                }
                match kind {
                    KIND_RECV => {
                        if !ok {
                            if self.closed {
                                continue;
                            }
                            return Err(wc_err("receive", wc));
                        }
                        let i = low as usize;
                        let len = wc.byte_len as usize;
                        let r = self.recv.as_mut().expect("set up");
                        on_msg(&r.mem[i * MSG..i * MSG + len]);
                        total += len;
                        self.post_recv(i)?;
                    }
                    KIND_SEND => {
                        self.free_send.push(low as usize);
                        if !ok && !self.closed {
                            return Err(wc_err("send", wc));
                        }
                    }
                    KIND_READ => {
                        self.reads_out -= 1;
                        let err = (!ok).then(|| wc_text(wc));
                        self.reads_done.push((low, err));
                    }
                    _ => {}
                }
            }
            if (n as usize) < wcs.len() {
                break;
            }
        }
        Ok(total)
    }

    /// Send a prefix of `bytes` as SEND messages, as far as free buffers go. Returns the bytes
    /// taken.
    pub fn send(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.closed {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the RDMA connection is closed",
            ));
        }
        let mut at = 0;
        while at < bytes.len() {
            let Some(i) = self.free_send.pop() else { break };
            let n = (bytes.len() - at).min(MSG);
            let s = self.send.as_mut().expect("set up");
            let dst = s.at(i);
            // SAFETY: dst has MSG bytes of room in the send region; n <= MSG.
            unsafe { ptr::copy_nonoverlapping(bytes[at..].as_ptr(), dst, n) };
            let mut sge = ibv_sge {
                addr: dst as u64,
                length: n as u32,
                lkey: s.lkey(),
            };
            // SAFETY: ibv_send_wr is plain data; zero is a valid start.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = KIND_SEND << KIND_SHIFT | i as u64;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            let mut bad = ptr::null_mut();
            // SAFETY: the queue pair is live; the buffer stays until the send completes.
            let rc = unsafe { ibv_post_send((*self.id).qp, &mut wr, &mut bad) };
            if rc != 0 {
                self.free_send.push(i);
                return Err(io::Error::from_raw_os_error(rc));
            }
            at += n;
        }
        Ok(at)
    }

    /// Whether another RDMA READ may be posted now.
    pub fn can_read(&self) -> bool {
        self.reads_out < MAX_READS
    }

    /// Pull `len` bytes from the peer's `remote` (key `rkey`) into `local` (registered, key
    /// `lkey`). Its completion shows up in `reads_done` under `id` (< 2^62).
    ///
    /// # Safety
    /// `local..local+len` must be registered memory that stays valid until the READ completes
    /// or the link is dropped.
    pub unsafe fn read(
        &mut self,
        id: u64,
        local: *mut u8,
        len: u32,
        lkey: u32,
        remote: u64,
        rkey: u32,
    ) -> io::Result<()> {
        let mut sge = ibv_sge {
            addr: local as u64,
            length: len,
            lkey,
        };
        // SAFETY: plain data.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = KIND_READ << KIND_SHIFT | id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = rdma_t {
            remote_addr: remote,
            rkey,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the caller keeps `local` valid; the queue pair is live.
        let rc = unsafe { ibv_post_send((*self.id).qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        self.reads_out += 1;
        Ok(())
    }
}

fn wc_text(wc: &ibv_wc) -> String {
    // SAFETY: returns a static string for any status.
    let p = unsafe { ibv_wc_status_str(wc.status) };
    let s = if p.is_null() {
        format!("status {}", wc.status)
    } else {
        // SAFETY: static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    };
    format!("{s} (vendor error {:#x})", wc.vendor_err)
}

fn wc_err(what: &str, wc: &ibv_wc) -> io::Error {
    io::Error::other(format!("RDMA {what} failed: {}", wc_text(wc)))
}

impl Drop for Link {
    fn drop(&mut self) {
        // SAFETY: objects are destroyed once, in reverse order of creation; null ones were
        // never made.
        unsafe {
            if self.qp_made {
                rdma_disconnect(self.id);
                rdma_destroy_qp(self.id);
            }
            self.recv = None;
            self.send = None;
            for mr in self.mrs.drain(..) {
                ibv_dereg_mr(mr);
            }
            if !self.cq.is_null() {
                if self.cq_events > 0 {
                    ibv_ack_cq_events(self.cq, self.cq_events);
                }
                ibv_destroy_cq(self.cq);
            }
            if !self.cc.is_null() {
                ibv_destroy_comp_channel(self.cc);
            }
            if !self.pd.is_null() {
                ibv_dealloc_pd(self.pd);
            }
            rdma_destroy_id(self.id);
        }
    }
}

/// A listening endpoint.
pub struct Listener {
    id: *mut rdma_cm_id,
    addr: SocketAddr,
    ch: Channel,
}

// SAFETY: moved to the accepting thread and used there only.
unsafe impl Send for Listener {}

impl Listener {
    /// Listen on `addr` (an IPv4 address of an RDMA-capable interface; port 0 picks one).
    pub fn bind(addr: SocketAddr) -> io::Result<Listener> {
        let ch = Channel::new()?;
        let mut id = ptr::null_mut();
        // SAFETY: creates an id on our channel.
        check(
            unsafe { rdma_create_id(ch.0, &mut id, ptr::null_mut(), rdma_port_space::RDMA_PS_TCP) },
            "rdma_create_id",
        )?;
        let mut l = Listener { id, addr, ch };
        set_nonblocking(l.ch.fd())?;
        let mut sa = sockaddr_in(addr)?;
        // SAFETY: sa is valid for the call.
        check(
            unsafe { rdma_bind_addr(id, (&mut sa as *mut libc::sockaddr_in).cast()) },
            &format!("rdma_bind_addr {addr}"),
        )?;
        // SAFETY: bound id.
        check(unsafe { rdma_listen(id, 64) }, "rdma_listen")?;
        // SAFETY: the id is bound: its source address holds the port chosen.
        l.addr = from_sockaddr(unsafe { rdma_get_local_addr(&*id) });
        Ok(l)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Wait for a connection request, accept it and wait until it is established.
    pub fn accept(&mut self) -> io::Result<Link> {
        loop {
            let (id, ev, status) = self.ch.next(Duration::from_secs(3600))?;
            if ev != rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                if id != self.id && ev == rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED {
                    continue;
                }
                if id == self.id && ev == rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL {
                    return Err(io::Error::other("the RDMA device went away"));
                }
                let _ = status;
                continue;
            }
            // SAFETY: id is the new connection's id from the request we acknowledged.
            let peer = from_sockaddr(unsafe { rdma_get_peer_addr(&*id) });
            match self.take(id, peer) {
                Ok(l) => return Ok(l),
                Err(e) => {
                    eprintln!("aios target: RDMA connection from {peer} failed: {e}");
                    continue;
                }
            }
        }
    }

    fn take(&mut self, id: *mut rdma_cm_id, peer: SocketAddr) -> io::Result<Link> {
        let ch = Channel::new()?;
        // SAFETY: the request event was acknowledged; the id moves to its own channel.
        if unsafe { rdma_migrate_id(id, ch.0) } != 0 {
            let e = os_err("rdma_migrate_id");
            // SAFETY: the id is ours and unused.
            unsafe { rdma_destroy_id(id) };
            return Err(e);
        }
        let mut link = Link::new(ch, id, peer);
        set_nonblocking(link.ch.fd())?;
        link.setup()?;
        let mut p = conn_param(RD_DEPTH);
        // SAFETY: the queue pair exists.
        check(unsafe { rdma_accept(id, &mut p) }, "rdma_accept")?;
        link.expect(
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            Duration::from_secs(5),
        )?;
        Ok(link)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: the listening id, destroyed once before its channel.
        unsafe { rdma_destroy_id(self.id) };
    }
}
