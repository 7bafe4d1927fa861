//! A non-blocking connection — a TCP socket, or (feature `rdma`) an RDMA queue pair carrying the
//! same byte stream in SEND messages — with a receive buffer PDUs are decoded from and a send
//! buffer PDUs are encoded into; both sides of the protocol drive it from a `poll(2)` loop.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use smallvec::SmallVec;

use crate::pdu::Digests;

/// Receive buffer: `buf[start..end]` holds bytes not yet decoded; `buf` is allocated (and
/// zeroed) once and grows only for a PDU larger than it.
pub struct Rx {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Default for Rx {
    fn default() -> Self {
        Rx {
            buf: vec![0; 256 << 10],
            start: 0,
            end: 0,
        }
    }
}

impl Rx {
    pub fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
    pub fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }
    /// Append `bytes` (a message from a transport that delivers whole messages).
    pub fn push(&mut self, bytes: &[u8]) {
        let mut at = 0;
        while at < bytes.len() {
            let room = self.room();
            let n = room.len().min(bytes.len() - at);
            room[..n].copy_from_slice(&bytes[at..at + n]);
            self.end += n;
            at += n;
        }
    }
    /// Room to read into: move pending bytes to the front when the tail is short, grow when
    /// the buffer is full of one PDU.
    fn room(&mut self) -> &mut [u8] {
        if self.buf.len() - self.end < 64 << 10 && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            let n = self.buf.len() * 2;
            self.buf.resize(n, 0);
        }
        &mut self.buf[self.end..]
    }
}

/// The transport a target serves or an initiator connects with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    #[default]
    Tcp,
    /// An RDMA reliable connection (feature `rdma`); addresses are the IPv4 addresses of
    /// RDMA-capable interfaces (a Soft-RoCE device over any Ethernet interface will do).
    Rdma,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Transport, String> {
        match s {
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(format!("transport {s:?}: tcp or rdma")),
        }
    }
}

#[cfg(not(feature = "rdma"))]
pub(crate) const NO_RDMA: &str =
    "this build has no RDMA transport (build with `--features rdma`: needs libibverbs-dev, librdmacm-dev and libclang-dev)";

/// What carries a connection's bytes.
pub enum Link {
    Tcp(TcpStream),
    #[cfg(feature = "rdma")]
    Rdma(Box<crate::rdma::Link>),
}

/// One connection.
pub struct Conn {
    pub link: Link,
    pub rx: Rx,
    pub tx: Vec<u8>,
    tx_at: usize,
    pub dg: Digests,
    /// Largest PDU accepted from the peer.
    pub max_pdu: u32,
    /// Largest H2CData the peer takes (its ICResp's MAXH2CDATA; hosts only).
    pub maxh2cdata: u32,
    /// The peer closed its side.
    pub eof: bool,
}

impl Conn {
    pub fn new(sock: TcpStream, max_pdu: u32) -> io::Result<Conn> {
        sock.set_nodelay(true)?;
        sock.set_nonblocking(true)?;
        Ok(Conn::with_link(Link::Tcp(sock), max_pdu))
    }

    /// A connection over an RDMA queue pair.
    #[cfg(feature = "rdma")]
    pub fn rdma(link: crate::rdma::Link, max_pdu: u32) -> Conn {
        Conn::with_link(Link::Rdma(Box::new(link)), max_pdu)
    }

    fn with_link(link: Link, max_pdu: u32) -> Conn {
        Conn {
            link,
            rx: Rx::default(),
            tx: Vec::with_capacity(64 << 10),
            tx_at: 0,
            dg: Digests::default(),
            max_pdu,
            maxh2cdata: 4096,
            eof: false,
        }
    }

    /// The RDMA link, when the connection has one.
    #[cfg(feature = "rdma")]
    pub fn rdma_link(&mut self) -> Option<&mut crate::rdma::Link> {
        match &mut self.link {
            Link::Rdma(l) => Some(l),
            Link::Tcp(_) => None,
        }
    }

    /// Whether the connection is an RDMA queue pair.
    pub fn is_rdma(&self) -> bool {
        !matches!(self.link, Link::Tcp(_))
    }

    /// Descriptors to wait on: (descriptor, readable wanted, writable wanted). An RDMA link
    /// reports everything (received messages, freed send buffers, disconnects) as readable.
    pub fn fds(&self, want_read: bool) -> WaitFds<'_> {
        match &self.link {
            Link::Tcp(s) => smallvec::smallvec![(s.as_fd(), want_read, self.unsent() > 0)],
            #[cfg(feature = "rdma")]
            Link::Rdma(l) => l.fds().into_iter().map(|fd| (fd, true, false)).collect(),
        }
    }

    /// Read what the socket has (without blocking). Returns the bytes read.
    #[allow(clippy::infallible_destructuring_match)] // one variant without `rdma`
    pub fn fill(&mut self) -> io::Result<usize> {
        let sock = match &mut self.link {
            Link::Tcp(s) => s,
            #[cfg(feature = "rdma")]
            Link::Rdma(l) => {
                let rx = &mut self.rx;
                let n = l.poll(|m| rx.push(m))?;
                if l.closed {
                    self.eof = true;
                }
                return Ok(n);
            }
        };
        let mut total = 0;
        // Whole PDUs the other side's own state keeps us from acting on (a target starved of
        // request slots) stay in the socket once this much is pending: its flow control then
        // holds the sender back, where the buffer used to grow with everything it sent.
        let backlog = (self.max_pdu as usize).max(256 << 10) * 2;
        loop {
            if self.rx.pending().len() >= backlog {
                return Ok(total);
            }
            let room = self.rx.room();
            let want = room.len();
            let r = sock.read(room);
            match r {
                Ok(0) => {
                    self.eof = true;
                    return Ok(total);
                }
                Ok(n) => {
                    self.rx.end += n;
                    total += n;
                    if n < want {
                        return Ok(total);
                    }
                }
                Err(e) => {
                    return match e.kind() {
                        io::ErrorKind::WouldBlock => Ok(total),
                        io::ErrorKind::Interrupted => continue,
                        _ => Err(e),
                    };
                }
            }
        }
    }

    /// Send what is queued, as far as the socket takes it. Returns whether all of it went.
    #[allow(clippy::infallible_destructuring_match)] // one variant without `rdma`
    pub fn flush(&mut self) -> io::Result<bool> {
        let sock = match &mut self.link {
            Link::Tcp(s) => s,
            #[cfg(feature = "rdma")]
            Link::Rdma(l) => {
                if self.tx_at < self.tx.len() {
                    let mut n = l.send(&self.tx[self.tx_at..])?;
                    if n == 0 {
                        // Every send buffer is out: take completions to free some.
                        let rx = &mut self.rx;
                        l.poll(|m| rx.push(m))?;
                        n = l.send(&self.tx[self.tx_at..])?;
                    }
                    self.tx_at += n;
                }
                if self.tx_at < self.tx.len() {
                    self.compact_tx();
                    return Ok(false);
                }
                self.tx.clear();
                self.tx_at = 0;
                return Ok(true);
            }
        };
        while self.tx_at < self.tx.len() {
            match sock.write(&self.tx[self.tx_at..]) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
                Ok(n) => self.tx_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.compact_tx();
                    return Ok(false);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.tx.clear();
        self.tx_at = 0;
        Ok(true)
    }

    /// After a partial send: drop the bytes that went once they are at least as many as those
    /// left, moving the rest to the front. A peer that keeps the socket full (it reads slowly,
    /// or its window is small) never lets the buffer empty, and PDUs are appended meanwhile:
    /// without this the buffer grew by everything sent until it did. With it the buffer holds
    /// less than twice what waits (which the protocol bounds) plus what is appended before the
    /// next send, and each byte is moved at most once for each byte sent before it.
    fn compact_tx(&mut self) {
        if self.tx_at > 0 && self.tx_at >= self.tx.len() - self.tx_at {
            self.tx.copy_within(self.tx_at.., 0);
            self.tx.truncate(self.tx.len() - self.tx_at);
            self.tx_at = 0;
        }
    }

    /// Bytes queued and not yet sent.
    pub fn unsent(&self) -> usize {
        self.tx.len() - self.tx_at
    }

    /// Send everything queued, waiting for the socket as needed (up to `timeout`).
    pub fn flush_blocking(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = deadline_after(timeout);
        while !self.flush()? {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "send timed out"));
            }
            wait_fds(&self.fds(false), Some(left))?;
        }
        Ok(())
    }
}

/// The instant `timeout` from now. A timeout the clock cannot add (`Duration::MAX`, for one:
/// a caller's "no limit") gives a deadline a century away instead of a panic.
pub fn deadline_after(timeout: Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// Descriptors a wait covers without a heap allocation.
pub const WAIT_FDS_INLINE: usize = 16;

/// Descriptors to wait on: (descriptor, readable wanted, writable wanted).
pub type WaitFds<'a> = SmallVec<[(BorrowedFd<'a>, bool, bool); WAIT_FDS_INLINE]>;

/// Wait until one of `fds` is ready: (fd, readable wanted, writable wanted). `None`: no limit.
pub fn wait_fds(fds: &[(BorrowedFd<'_>, bool, bool)], timeout: Option<Duration>) -> io::Result<()> {
    let mut pfds: SmallVec<[PollFd<'_>; WAIT_FDS_INLINE]> = fds
        .iter()
        .map(|(fd, r, w)| {
            let mut f = PollFlags::empty();
            if *r {
                f |= PollFlags::POLLIN;
            }
            if *w {
                f |= PollFlags::POLLOUT;
            }
            PollFd::new(*fd, f)
        })
        .collect();
    let t = match timeout {
        None => PollTimeout::NONE,
        Some(d) => PollTimeout::try_from(d.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX),
    };
    match poll(&mut pfds, t) {
        Ok(_) => Ok(()),
        Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{setsockopt, sockopt};
    use std::net::TcpListener;

    /// A peer that reads slowly, a step at a time, while the connection appends as much as it
    /// reads: the socket never takes all that is queued, so the send buffer never empties. Its
    /// size stays within twice what waits (rounded up by the vector's doubling), where it used
    /// to grow by every byte sent (to 16 MiB here, with under 1 MiB waiting).
    #[test]
    fn a_send_buffer_the_socket_never_empties_stays_bounded() {
        const WAITING: usize = 1 << 20;
        const STEP: usize = 4096;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        // Small kernel buffers on both sides (no autotuning): the kernel holds far less than
        // `WAITING`, so some of it always waits in `tx`.
        setsockopt(&l, sockopt::RcvBuf, &(64 << 10)).unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        setsockopt(&s, sockopt::SndBuf, &(64 << 10)).unwrap();
        let (mut peer, _) = l.accept().unwrap();
        let mut c = Conn::new(s, 1 << 20).unwrap();
        c.tx.resize(WAITING, 1);
        assert!(
            !c.flush().unwrap(),
            "the kernel took {WAITING} bytes at once"
        );
        let mut got = vec![0u8; STEP];
        let step = [2u8; STEP];
        for round in 0..3000 {
            peer.read_exact(&mut got).unwrap();
            c.tx.extend_from_slice(&step);
            // What waits never falls: the peer read only as much as was appended.
            assert!(!c.flush().unwrap(), "round {round}: everything queued went");
            assert!(c.unsent() > WAITING / 2);
        }
        assert!(
            c.tx.capacity() <= 4 * WAITING,
            "the send buffer grew to {} KiB with {} KiB waiting",
            c.tx.capacity() >> 10,
            c.unsent() >> 10
        );
    }
}
