//! A host speaking raw NVMe/TCP PDUs to a target, for the tests that drive a target below the
//! initiator (`target_edges.rs`, `recovery_edges.rs`, `pdu_fuzz.rs`).
#![allow(dead_code)]

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rio_net::pdu::{self, Cqe, Digests, Pdu, Sqe};
use rio_net::Volume;

/// One connection: commands go out as built, PDUs are read one by one.
pub struct Raw {
    /// The socket, for tests that write raw bytes.
    pub s: TcpStream,
    rx: Vec<u8>,
}

impl Raw {
    /// A connection that has exchanged ICReq/ICResp.
    pub fn open(addr: SocketAddr) -> Raw {
        let mut r = Raw::connect(addr);
        r.icreq();
        r
    }
    /// A bare TCP connection: nothing sent yet.
    pub fn connect(addr: SocketAddr) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        s.set_nodelay(true).unwrap();
        Raw { s, rx: Vec::new() }
    }
    pub fn icreq(&mut self) {
        let mut b = Vec::new();
        pdu::put_icreq(&mut b, Digests::default(), 0);
        assert!(self.send(&b), "sending ICReq");
        let r = self.next_pdu(Duration::from_secs(5)).expect("an ICResp");
        assert_eq!(r[0], pdu::ICRESP);
    }
    /// Send raw bytes: whether they went (the target may have closed the connection).
    pub fn send(&mut self, b: &[u8]) -> bool {
        self.s.write_all(b).is_ok()
    }
    /// The next PDU's bytes, or `None` once the target closed the connection (or `limit`).
    pub fn next_pdu(&mut self, limit: Duration) -> Option<Vec<u8>> {
        let t0 = Instant::now();
        loop {
            if self.rx.len() >= 8 {
                let plen = u32::from_le_bytes(self.rx[4..8].try_into().unwrap()) as usize;
                if self.rx.len() >= plen {
                    return Some(self.rx.drain(..plen).collect());
                }
            }
            if t0.elapsed() > limit {
                return None;
            }
            let mut buf = [0u8; 65536];
            match self.s.read(&mut buf) {
                Ok(0) => return None,
                Ok(n) => self.rx.extend_from_slice(&buf[..n]),
                // A signal is not the end of the connection.
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                    ) => {}
                // Reset by the target: closed.
                Err(_) => return None,
            }
        }
    }
    /// Whether the target closes the connection within `limit` (PDUs it sends first, such as
    /// a C2HTermReq, are read: their types are returned).
    pub fn closed_within(&mut self, limit: Duration) -> (bool, Vec<u8>) {
        let t0 = Instant::now();
        let mut types = Vec::new();
        while t0.elapsed() < limit {
            match self.next_pdu(limit.saturating_sub(t0.elapsed())) {
                Some(b) => types.push(b[0]),
                None => return (t0.elapsed() < limit, types),
            }
        }
        (false, types)
    }
    pub fn send_cmd(&mut self, sqe: &Sqe, data: &[u8]) {
        let mut b = Vec::new();
        pdu::put_cmd(&mut b, sqe, data, Digests::default());
        assert!(self.send(&b), "sending a command");
    }
    /// Next decoded PDU as a debug-able owned form: (type, cid, data).
    pub fn next(&mut self) -> (u8, Option<Cqe>, u16, Vec<u8>) {
        let p = self
            .next_pdu(Duration::from_secs(5))
            .unwrap_or_else(|| panic!("a PDU (rx {} bytes buffered)", self.rx.len()));
        match pdu::decode(&p, Digests::default(), u32::MAX)
            .unwrap()
            .unwrap()
            .0
        {
            Pdu::Resp { cqe } => (pdu::RSP, Some(cqe), cqe.cid, vec![]),
            Pdu::R2T { cccid, .. } => (pdu::R2T, None, cccid, vec![]),
            Pdu::C2HData { cccid, data, .. } => (pdu::C2H_DATA, None, cccid, data.to_vec()),
            other => panic!("unexpected {other:?}"),
        }
    }
    /// Send a command and take its answer.
    pub fn command(&mut self, sqe: &Sqe, data: &[u8]) -> (Cqe, Vec<u8>) {
        self.send_cmd(sqe, data);
        self.answer()
    }
    /// The next answer, with the data sent before it.
    pub fn answer(&mut self) -> (Cqe, Vec<u8>) {
        let mut got = Vec::new();
        loop {
            match self.next() {
                (_, Some(cqe), _, _) => return (cqe, got),
                (pdu::C2H_DATA, _, _, d) => got.extend_from_slice(&d),
                other => panic!("unexpected {:?}", other.0),
            }
        }
    }
}

pub fn cdata(cntlid: u16) -> Vec<u8> {
    pdu::connect_data(&[0; 16], cntlid, "nqn.2026-11.io.aios:target", "nqn.review")
}

/// An admin queue, and its controller's id.
pub fn admin_queue(addr: SocketAddr) -> (Raw, u16) {
    let mut a = Raw::open(addr);
    let mut c = pdu::connect_command(0, 31);
    c.set_cid(1);
    let (cqe, _) = a.command(&c, &cdata(0xffff));
    assert!(cqe.ok());
    (a, cqe.dw0 as u16)
}

/// I/O queue 1 of controller `cntlid`.
pub fn io_queue(addr: SocketAddr, cntlid: u16) -> Raw {
    let mut q = Raw::open(addr);
    let mut c = pdu::connect_command(1, 127);
    c.set_cid(1);
    let (cqe, _) = q.command(&c, &cdata(cntlid));
    assert!(cqe.ok());
    q
}

/// An admin queue and an I/O queue of its controller.
pub fn queues(addr: SocketAddr) -> (Raw, Raw) {
    let (a, cntlid) = admin_queue(addr);
    (a, io_queue(addr, cntlid))
}

/// Stream 0's ordered write of one 4 KiB block of `byte` at block `block`, in its open group.
pub fn put(v: &mut Volume, block: u64, byte: u8) {
    let mut b = v.alloc(4096).unwrap();
    b.fill(byte);
    v.submit(0, block * 4096, b, true).unwrap();
}

/// The first byte of 4 KiB block `block`, read through the volume.
pub fn read_block(v: &mut Volume, block: u64) -> u8 {
    let b = v.alloc(4096).unwrap();
    v.read(0, block * 4096, b).unwrap();
    loop {
        let d = v.wait_any().unwrap();
        if let Some(d) = d.into_iter().find(|d| d.seq == 0) {
            assert!(d.result.is_ok(), "{:?}", d.result);
            return d.buf[0];
        }
    }
}

/// An I/O command on namespace 1: `opcode` for `blocks` blocks from block `slba` (its data
/// descriptor is the caller's to set).
pub fn lba_sqe(opcode: u8, cid: u16, slba: u64, blocks: u32) -> Sqe {
    let mut sqe = Sqe::default();
    sqe.set_opcode(opcode);
    sqe.set_cid(cid);
    sqe.set_cdw(1, 1);
    sqe.set_cdw(10, slba as u32);
    sqe.set_cdw(11, (slba >> 32) as u32);
    sqe.set_cdw(12, blocks - 1);
    sqe
}
