//! A non-blocking TCP connection with a receive buffer PDUs are decoded from and a send buffer
//! PDUs are encoded into; both sides of the protocol drive it from a `poll(2)` loop.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

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

/// One connection.
pub struct Conn {
    pub sock: TcpStream,
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
        Ok(Conn {
            sock,
            rx: Rx::default(),
            tx: Vec::with_capacity(64 << 10),
            tx_at: 0,
            dg: Digests::default(),
            max_pdu,
            maxh2cdata: 4096,
            eof: false,
        })
    }

    /// Read what the socket has (without blocking). Returns the bytes read.
    pub fn fill(&mut self) -> io::Result<usize> {
        let mut total = 0;
        loop {
            let room = self.rx.room();
            let want = room.len();
            let r = self.sock.read(room);
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
    pub fn flush(&mut self) -> io::Result<bool> {
        while self.tx_at < self.tx.len() {
            match self.sock.write(&self.tx[self.tx_at..]) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "socket closed")),
                Ok(n) => self.tx_at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.tx.clear();
        self.tx_at = 0;
        Ok(true)
    }

    /// Bytes queued and not yet sent.
    pub fn unsent(&self) -> usize {
        self.tx.len() - self.tx_at
    }

    /// Send everything queued, waiting for the socket as needed (up to `timeout`).
    pub fn flush_blocking(&mut self, timeout: Duration) -> io::Result<()> {
        let deadline = std::time::Instant::now() + timeout;
        while !self.flush()? {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "send timed out"));
            }
            wait_fds(&[(&self.sock, false, true)], Some(left))?;
        }
        Ok(())
    }
}

/// Wait until one of `fds` is ready: (fd, readable wanted, writable wanted). `None`: no limit.
pub fn wait_fds(fds: &[(&dyn AsFd, bool, bool)], timeout: Option<Duration>) -> io::Result<()> {
    let mut pfds: Vec<PollFd> = fds
        .iter()
        .map(|(fd, r, w)| {
            let mut f = PollFlags::empty();
            if *r {
                f |= PollFlags::POLLIN;
            }
            if *w {
                f |= PollFlags::POLLOUT;
            }
            PollFd::new(fd.as_fd(), f)
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
