//! The NVMe/TCP wire format (NVMe/TCP transport specification, PDU layouts) and Rio's ordering
//! attribute in reserved dwords of the I/O commands (Rio Table 1).
//!
//! Every PDU starts with the 8-byte common header: type, flags, header length (`hlen`), data
//! offset (`pdo`) and total length (`plen`). Optional CRC32C digests follow the header (`HDGST`)
//! and the data (`DDGST`) when both sides enabled them in ICReq/ICResp.
//!
//! | type | PDU | header |
//! | --- | --- | --- |
//! | 0x00 | ICReq | 128 |
//! | 0x01 | ICResp | 128 |
//! | 0x02 | H2CTermReq | 24 |
//! | 0x03 | C2HTermReq | 24 |
//! | 0x04 | CapsuleCmd (64-byte submission entry, in-capsule data after) | 72 |
//! | 0x05 | CapsuleResp (16-byte completion entry) | 24 |
//! | 0x06 | H2CData | 24 |
//! | 0x07 | C2HData | 24 |
//! | 0x09 | R2T | 24 |
//!
//! [`decode`] checks everything a peer could get wrong — unknown types, header lengths that do
//! not match the type, lengths above the negotiated maximum, data offsets inside the header,
//! digest mismatches, data lengths that disagree with the header — and returns a [`PduError`]
//! naming it; it never panics on any input (a fuzz test holds it to that).

use std::fmt;

pub const ICREQ: u8 = 0x00;
pub const ICRESP: u8 = 0x01;
pub const H2C_TERM: u8 = 0x02;
pub const C2H_TERM: u8 = 0x03;
pub const CMD: u8 = 0x04;
pub const RSP: u8 = 0x05;
pub const H2C_DATA: u8 = 0x06;
pub const C2H_DATA: u8 = 0x07;
pub const R2T: u8 = 0x09;

/// Common-header flags.
pub const F_HDGST: u8 = 0x01;
pub const F_DDGST: u8 = 0x02;
/// Data PDUs: the last one of a transfer.
pub const F_DATA_LAST: u8 = 0x04;
/// C2HData: the command succeeded and no CapsuleResp follows.
pub const F_DATA_SUCCESS: u8 = 0x08;

pub const CH_BYTES: usize = 8;
pub const IC_HLEN: usize = 128;
pub const CMD_HLEN: usize = CH_BYTES + 64;
pub const RSP_HLEN: usize = CH_BYTES + 16;
pub const DATA_HLEN: usize = 24;
pub const R2T_HLEN: usize = 24;
pub const TERM_HLEN: usize = 24;
const DIGEST: usize = 4;

/// Digests negotiated on a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Why a PDU was refused. Each closes the connection it arrived on (with a TermReq naming it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PduError {
    #[error("unknown PDU type {0:#04x}")]
    UnknownType(u8),
    #[error("PDU type {ty:#04x} with header length {hlen} (expected {expected})")]
    BadHeaderLength { ty: u8, hlen: u8, expected: usize },
    #[error("PDU of {plen} bytes is larger than the {max}-byte limit")]
    Oversized { plen: u32, max: u32 },
    #[error("PDU length {plen} is shorter than its header ({need} bytes)")]
    Truncated { plen: u32, need: usize },
    #[error("data offset {pdo} lies inside the header (header ends at byte {header_end})")]
    BadDataOffset { pdo: u8, header_end: usize },
    #[error("header digest mismatch (got {got:#010x}, computed {want:#010x})")]
    HeaderDigest { got: u32, want: u32 },
    #[error("data digest mismatch (got {got:#010x}, computed {want:#010x})")]
    DataDigest { got: u32, want: u32 },
    #[error("digest flags {flags:#04x} disagree with the negotiated digests ({dg:?})")]
    DigestFlags { flags: u8, dg: Digests },
    #[error("data PDU says {said} bytes of data but carries {carried}")]
    DataLength { said: u32, carried: usize },
    #[error("PDU type {0:#04x} is not allowed in this direction or state")]
    Unexpected(u8),
}

impl PduError {
    /// The fatal-error status a TermReq carries for this error (NVMe/TCP FES values).
    pub fn fes(&self) -> u16 {
        match self {
            PduError::UnknownType(_) | PduError::Unexpected(_) => 0x05, // PDU sequence error / invalid type
            PduError::BadHeaderLength { .. }
            | PduError::Truncated { .. }
            | PduError::BadDataOffset { .. }
            | PduError::DataLength { .. }
            | PduError::DigestFlags { .. } => 0x01, // invalid PDU header field
            PduError::HeaderDigest { .. } => 0x03,
            PduError::DataDigest { .. } => 0x04,
            PduError::Oversized { .. } => 0x06, // R2T limit / data transfer limit exceeded
        }
    }
}

/// A 64-byte NVMe submission queue entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; 64]);

impl Default for Sqe {
    fn default() -> Self {
        Sqe([0; 64])
    }
}

impl fmt::Debug for Sqe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Sqe(op {:#04x} cid {} cdw10..16",
            self.opcode(),
            self.cid()
        )?;
        for i in 10..16 {
            write!(f, " {:#x}", self.cdw(i))?;
        }
        write!(f, ")")
    }
}

/// SGL descriptor identifiers (byte 15 of the descriptor).
pub const SGL_IN_CAPSULE: u8 = 0x01; // data block, offset subtype
pub const SGL_TRANSPORT: u8 = 0x5a; // transport data block, transport-specific subtype
pub const SGL_KEYED: u8 = 0x40; // keyed data block, address subtype (RDMA: address, length, key)

impl Sqe {
    pub fn opcode(&self) -> u8 {
        self.0[0]
    }
    pub fn set_opcode(&mut self, op: u8) {
        self.0[0] = op;
    }
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.0[2], self.0[3]])
    }
    pub fn set_cid(&mut self, cid: u16) {
        self.0[2..4].copy_from_slice(&cid.to_le_bytes());
    }
    pub fn nsid(&self) -> u32 {
        self.cdw(1)
    }
    pub fn cdw(&self, i: usize) -> u32 {
        u32::from_le_bytes(self.0[4 * i..4 * i + 4].try_into().expect("4 bytes"))
    }
    pub fn set_cdw(&mut self, i: usize, v: u32) {
        self.0[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    /// Fabrics commands: the command type (byte 4).
    pub fn fctype(&self) -> u8 {
        self.0[4]
    }
    /// The data pointer as an SGL descriptor: (address, length, identifier). A keyed
    /// descriptor's length is its 24-bit field.
    pub fn sgl(&self) -> (u64, u32, u8) {
        let id = self.0[39];
        let mut len = u32::from_le_bytes(self.0[32..36].try_into().expect("4"));
        if id >> 4 == SGL_KEYED >> 4 {
            len &= 0x00ff_ffff;
        }
        (
            u64::from_le_bytes(self.0[24..32].try_into().expect("8")),
            len,
            id,
        )
    }
    /// Point the command at `len` bytes at `addr` of the host's memory region `key` (the peer
    /// moves the data with RDMA READ or WRITE).
    pub fn set_keyed_sgl(&mut self, addr: u64, len: u32, key: u32) {
        debug_assert!(len < 1 << 24);
        self.0[1] = (self.0[1] & 0x3f) | 0x40;
        self.0[24..32].copy_from_slice(&addr.to_le_bytes());
        self.0[32..35].copy_from_slice(&len.to_le_bytes()[..3]);
        self.0[35..39].copy_from_slice(&key.to_le_bytes());
        self.0[39] = SGL_KEYED;
    }
    /// A keyed descriptor's (address, length, key).
    pub fn keyed_sgl(&self) -> Option<(u64, u32, u32)> {
        if self.0[39] != SGL_KEYED {
            return None;
        }
        let (addr, len, _) = self.sgl();
        let key = u32::from_le_bytes(self.0[35..39].try_into().expect("4"));
        Some((addr, len, key))
    }
    /// Point the command at `len` bytes of data: in the capsule or by the transport (R2T or
    /// C2HData). PSDT says "SGL", as fabrics require.
    pub fn set_sgl(&mut self, len: u32, in_capsule: bool) {
        self.0[1] = (self.0[1] & 0x3f) | 0x40;
        self.0[24..32].fill(0);
        self.0[32..36].copy_from_slice(&len.to_le_bytes());
        self.0[36..39].fill(0);
        self.0[39] = if in_capsule {
            SGL_IN_CAPSULE
        } else {
            SGL_TRANSPORT
        };
    }
    /// A command without data still says "SGL" in PSDT, with a null transport descriptor
    /// (fabrics targets such as Linux's nvmet refuse PSDT 0). Leaves a set descriptor alone.
    pub fn ensure_sgl(&mut self) {
        if self.0[1] & 0xc0 == 0 {
            self.set_sgl(0, false);
        }
    }
    /// Rio's op code in CDW0 bits 10..13 (reserved in NVMe): 0 for an ordinary command.
    pub fn rio_op(&self) -> u8 {
        (self.0[1] >> 2) & 0x0f
    }
    pub fn set_rio_op(&mut self, op: u8) {
        self.0[1] = (self.0[1] & !0x3c) | ((op & 0x0f) << 2);
    }
    /// Starting LBA (CDW10..11) of a read, write or write-zeroes.
    pub fn slba(&self) -> u64 {
        self.cdw(10) as u64 | (self.cdw(11) as u64) << 32
    }
    /// Blocks (CDW12 bits 0..15 hold the count minus one).
    pub fn nlb(&self) -> u32 {
        (self.cdw(12) & 0xffff) + 1
    }
    pub fn fua(&self) -> bool {
        self.cdw(12) & (1 << 30) != 0
    }
}

/// A 16-byte completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    /// Status field without the phase bit: SC in bits 0..7, SCT in bits 8..10, DNR bit 14.
    pub status: u16,
}

impl Cqe {
    pub fn encode(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        out[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        out[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        out[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        out[12..14].copy_from_slice(&self.cid.to_le_bytes());
        out[14..16].copy_from_slice(&(self.status << 1).to_le_bytes());
    }
    pub fn decode(b: &[u8]) -> Cqe {
        Cqe {
            dw0: u32::from_le_bytes(b[0..4].try_into().expect("4")),
            dw1: u32::from_le_bytes(b[4..8].try_into().expect("4")),
            sqhd: u16::from_le_bytes([b[8], b[9]]),
            sqid: u16::from_le_bytes([b[10], b[11]]),
            cid: u16::from_le_bytes([b[12], b[13]]),
            status: u16::from_le_bytes([b[14], b[15]]) >> 1,
        }
    }
    pub fn ok(&self) -> bool {
        self.status & 0x7ff == 0
    }
    /// Status code type and status code.
    pub fn sct_sc(&self) -> (u8, u8) {
        (((self.status >> 8) & 7) as u8, self.status as u8)
    }
}

/// An NVMe status (type and code); `DNR` is set on every error this crate returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
}

impl Status {
    pub const SUCCESS: Status = Status { sct: 0, sc: 0 };
    pub const INVALID_OPCODE: Status = Status { sct: 0, sc: 0x01 };
    pub const INVALID_FIELD: Status = Status { sct: 0, sc: 0x02 };
    pub const DATA_TRANSFER_ERROR: Status = Status { sct: 0, sc: 0x04 };
    pub const INTERNAL: Status = Status { sct: 0, sc: 0x06 };
    pub const INVALID_NS: Status = Status { sct: 0, sc: 0x0b };
    pub const SGL_INVALID: Status = Status { sct: 0, sc: 0x0f };
    pub const SGL_TYPE_INVALID: Status = Status { sct: 0, sc: 0x11 };
    pub const LBA_OUT_OF_RANGE: Status = Status { sct: 0, sc: 0x80 };
    /// Reservation Conflict: the write came on a connection opened before a recovery fenced
    /// the target (`RIO_FENCE`); it never reached the device.
    pub const FENCED: Status = Status { sct: 0, sc: 0x83 };
    /// More Asynchronous Event Requests outstanding than the controller's AERL allows.
    pub const AER_LIMIT_EXCEEDED: Status = Status { sct: 1, sc: 0x05 };
    pub const CONNECT_INVALID_PARAM: Status = Status { sct: 1, sc: 0x82 };
    pub const CONNECT_INVALID_HOST: Status = Status { sct: 1, sc: 0x84 };
    /// Vendor specific (SCT 7): the ordering attribute is refused.
    pub const RIO_BAD_ATTR: Status = Status { sct: 7, sc: 0x01 };
    /// Vendor specific: the target's attribute log failed.
    pub const RIO_LOG: Status = Status { sct: 7, sc: 0x02 };
    /// Vendor specific: the command completed on the device, but the target's log cannot
    /// vouch for it (an earlier write or FLUSH of the stream failed there since the last
    /// recovery, or the log could not take its persist word): not durable as ordered.
    pub const RIO_NOT_DURABLE: Status = Status { sct: 7, sc: 0x03 };

    pub fn field(self) -> u16 {
        if self == Status::SUCCESS {
            0
        } else {
            (1 << 14) | ((self.sct as u16 & 7) << 8) | self.sc as u16
        }
    }
}

/// One decoded PDU; data borrows the receive buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    ICReq {
        pfv: u16,
        hpda: u8,
        dgst: u8,
        maxr2t: u32,
    },
    ICResp {
        pfv: u16,
        cpda: u8,
        dgst: u8,
        maxh2cdata: u32,
    },
    TermReq {
        from_host: bool,
        fes: u16,
        fei: u32,
    },
    Cmd {
        sqe: Sqe,
        data: &'a [u8],
    },
    Resp {
        cqe: Cqe,
    },
    H2CData {
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: &'a [u8],
        last: bool,
    },
    C2HData {
        cccid: u16,
        datao: u32,
        data: &'a [u8],
        last: bool,
        success: bool,
    },
    R2T {
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    },
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4"))
}

/// Decode the PDU at the start of `buf`. `Ok(None)`: not all of it has arrived yet (at most
/// `max_pdu` bytes are ever waited for). `Ok(Some((pdu, bytes)))`: one PDU of `bytes` bytes.
pub fn decode(buf: &[u8], dg: Digests, max_pdu: u32) -> Result<Option<(Pdu<'_>, usize)>, PduError> {
    if buf.len() < CH_BYTES {
        return Ok(None);
    }
    let (ty, flags, hlen, pdo) = (buf[0], buf[1], buf[2], buf[3]);
    let plen = u32_at(buf, 4);
    let expected = match ty {
        ICREQ | ICRESP => IC_HLEN,
        CMD => CMD_HLEN,
        RSP => RSP_HLEN,
        H2C_DATA | C2H_DATA => DATA_HLEN,
        R2T => R2T_HLEN,
        H2C_TERM | C2H_TERM => TERM_HLEN,
        other => return Err(PduError::UnknownType(other)),
    };
    if hlen as usize != expected {
        return Err(PduError::BadHeaderLength { ty, hlen, expected });
    }
    if plen > max_pdu {
        return Err(PduError::Oversized { plen, max: max_pdu });
    }
    let ic = matches!(ty, ICREQ | ICRESP);
    let term = matches!(ty, H2C_TERM | C2H_TERM);
    // Initialization and termination PDUs never carry digests.
    let hd = !ic && !term && dg.header;
    if !ic && !term && ((flags & F_HDGST != 0) != dg.header) {
        return Err(PduError::DigestFlags { flags, dg });
    }
    let header_end = hlen as usize + if hd { DIGEST } else { 0 };
    if (plen as usize) < header_end {
        return Err(PduError::Truncated {
            plen,
            need: header_end,
        });
    }
    let has_data = plen as usize > header_end;
    if has_data && !term && !matches!(ty, CMD | H2C_DATA | C2H_DATA) {
        return Err(PduError::DataLength {
            said: 0,
            carried: plen as usize - header_end,
        });
    }
    let dd = has_data && !term && dg.data;
    if has_data && !term && ((flags & F_DDGST != 0) != dg.data) {
        return Err(PduError::DigestFlags { flags, dg });
    }
    let data_at = if has_data && !term {
        if (pdo as usize) < header_end {
            return Err(PduError::BadDataOffset { pdo, header_end });
        }
        pdo as usize
    } else {
        header_end
    };
    let data_end = plen as usize - if dd { DIGEST } else { 0 };
    if data_at > data_end {
        return Err(PduError::Truncated {
            plen,
            need: data_at + if dd { DIGEST } else { 0 },
        });
    }
    if buf.len() < plen as usize {
        return Ok(None);
    }
    let h = &buf[..hlen as usize];
    if hd {
        let got = u32_at(buf, hlen as usize);
        let want = crc32c::crc32c(h);
        if got != want {
            return Err(PduError::HeaderDigest { got, want });
        }
    }
    let data = &buf[data_at..data_end];
    if dd {
        let got = u32_at(buf, data_end);
        let want = crc32c::crc32c(data);
        if got != want {
            return Err(PduError::DataDigest { got, want });
        }
    }
    let pdu = match ty {
        ICREQ => Pdu::ICReq {
            pfv: u16_at(h, 8),
            hpda: h[10],
            dgst: h[11],
            maxr2t: u32_at(h, 12),
        },
        ICRESP => Pdu::ICResp {
            pfv: u16_at(h, 8),
            cpda: h[10],
            dgst: h[11],
            maxh2cdata: u32_at(h, 12),
        },
        H2C_TERM | C2H_TERM => Pdu::TermReq {
            from_host: ty == H2C_TERM,
            fes: u16_at(h, 8),
            fei: u32_at(h, 10),
        },
        CMD => {
            let mut sqe = Sqe::default();
            sqe.0.copy_from_slice(&h[8..72]);
            Pdu::Cmd { sqe, data }
        }
        RSP => Pdu::Resp {
            cqe: Cqe::decode(&h[8..24]),
        },
        H2C_DATA | C2H_DATA => {
            let datal = u32_at(h, 16);
            if datal as usize != data.len() {
                return Err(PduError::DataLength {
                    said: datal,
                    carried: data.len(),
                });
            }
            if ty == H2C_DATA {
                Pdu::H2CData {
                    cccid: u16_at(h, 8),
                    ttag: u16_at(h, 10),
                    datao: u32_at(h, 12),
                    data,
                    last: flags & F_DATA_LAST != 0,
                }
            } else {
                Pdu::C2HData {
                    cccid: u16_at(h, 8),
                    datao: u32_at(h, 12),
                    data,
                    last: flags & F_DATA_LAST != 0,
                    success: flags & F_DATA_SUCCESS != 0,
                }
            }
        }
        R2T => Pdu::R2T {
            cccid: u16_at(h, 8),
            ttag: u16_at(h, 10),
            r2to: u32_at(h, 12),
            r2tl: u32_at(h, 16),
        },
        _ => unreachable!("types were checked above"),
    };
    Ok(Some((pdu, plen as usize)))
}

/// Append a PDU: `header` (its first 8 bytes are filled here) and `data`.
fn put(out: &mut Vec<u8>, ty: u8, mut flags: u8, header: &mut [u8], data: &[u8], dg: Digests) {
    let ic_or_term = matches!(ty, ICREQ | ICRESP | H2C_TERM | C2H_TERM);
    let hd = dg.header && !ic_or_term;
    let dd = dg.data && !data.is_empty() && !ic_or_term;
    if hd {
        flags |= F_HDGST;
    }
    if dd {
        flags |= F_DDGST;
    }
    let hlen = header.len();
    let header_end = hlen + if hd { DIGEST } else { 0 };
    let pdo = if data.is_empty() || ic_or_term {
        0
    } else {
        header_end
    };
    let plen = header_end + data.len() + if dd { DIGEST } else { 0 };
    header[0] = ty;
    header[1] = flags;
    header[2] = hlen as u8;
    header[3] = pdo as u8;
    header[4..8].copy_from_slice(&(plen as u32).to_le_bytes());
    out.extend_from_slice(header);
    if hd {
        out.extend_from_slice(&crc32c::crc32c(header).to_le_bytes());
    }
    out.extend_from_slice(data);
    if dd {
        out.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    }
}

/// ICReq: protocol version 0, no data alignment, the digests asked for, `maxr2t` (0-based).
pub fn put_icreq(out: &mut Vec<u8>, want: Digests, maxr2t: u32) {
    let mut h = [0u8; IC_HLEN];
    h[11] = want.header as u8 | (want.data as u8) << 1;
    h[12..16].copy_from_slice(&maxr2t.to_le_bytes());
    put(out, ICREQ, 0, &mut h, &[], Digests::default());
}

/// ICResp: the digests agreed and the largest H2CData the controller takes.
pub fn put_icresp(out: &mut Vec<u8>, dg: Digests, maxh2cdata: u32) {
    let mut h = [0u8; IC_HLEN];
    h[11] = dg.header as u8 | (dg.data as u8) << 1;
    h[12..16].copy_from_slice(&maxh2cdata.to_le_bytes());
    put(out, ICRESP, 0, &mut h, &[], Digests::default());
}

/// A command capsule with optional in-capsule data.
pub fn put_cmd(out: &mut Vec<u8>, sqe: &Sqe, data: &[u8], dg: Digests) {
    let mut h = [0u8; CMD_HLEN];
    h[8..72].copy_from_slice(&sqe.0);
    put(out, CMD, 0, &mut h, data, dg);
}

/// A response capsule.
pub fn put_resp(out: &mut Vec<u8>, cqe: &Cqe, dg: Digests) {
    let mut h = [0u8; RSP_HLEN];
    cqe.encode(&mut h[8..24]);
    put(out, RSP, 0, &mut h, &[], dg);
}

/// A data PDU (H2CData or C2HData; `ttag` is 0 in the latter).
#[allow(clippy::too_many_arguments)]
fn put_data(
    out: &mut Vec<u8>,
    ty: u8,
    cccid: u16,
    ttag: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    dg: Digests,
) {
    let mut h = [0u8; DATA_HLEN];
    h[8..10].copy_from_slice(&cccid.to_le_bytes());
    h[10..12].copy_from_slice(&ttag.to_le_bytes());
    h[12..16].copy_from_slice(&datao.to_le_bytes());
    h[16..20].copy_from_slice(&(data.len() as u32).to_le_bytes());
    let flags = if last { F_DATA_LAST } else { 0 };
    put(out, ty, flags, &mut h, data, dg);
}

/// Host-to-controller data for the R2T `ttag` of command `cccid`.
pub fn put_h2c_data(
    out: &mut Vec<u8>,
    cccid: u16,
    ttag: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    dg: Digests,
) {
    put_data(out, H2C_DATA, cccid, ttag, datao, data, last, dg);
}

/// Controller-to-host data for command `cccid`.
pub fn put_c2h_data(
    out: &mut Vec<u8>,
    cccid: u16,
    datao: u32,
    data: &[u8],
    last: bool,
    dg: Digests,
) {
    put_data(out, C2H_DATA, cccid, 0, datao, data, last, dg);
}

/// Where `data` (a PDU's data, as [`decode`] returned it) lies in `buf`, the slice it was
/// decoded from: lets a caller copy it later without holding the borrow.
pub fn data_range(buf: &[u8], data: &[u8]) -> std::ops::Range<usize> {
    let at = data.as_ptr() as usize - buf.as_ptr() as usize;
    debug_assert!(at + data.len() <= buf.len(), "data lies inside buf");
    at..at + data.len()
}

/// Ready to transfer: the controller asks for `r2tl` bytes at `r2to` of command `cccid`.
pub fn put_r2t(out: &mut Vec<u8>, cccid: u16, ttag: u16, r2to: u32, r2tl: u32, dg: Digests) {
    let mut h = [0u8; R2T_HLEN];
    h[8..10].copy_from_slice(&cccid.to_le_bytes());
    h[10..12].copy_from_slice(&ttag.to_le_bytes());
    h[12..16].copy_from_slice(&r2to.to_le_bytes());
    h[16..20].copy_from_slice(&r2tl.to_le_bytes());
    put(out, R2T, 0, &mut h, &[], dg);
}

/// A termination request carrying the fatal error status and the offending header bytes.
pub fn put_term(out: &mut Vec<u8>, from_host: bool, fes: u16, fei: u32, offending: &[u8]) {
    let mut h = [0u8; TERM_HLEN];
    h[8..10].copy_from_slice(&fes.to_le_bytes());
    h[10..14].copy_from_slice(&fei.to_le_bytes());
    let n = offending.len().min(128);
    put(
        out,
        if from_host { H2C_TERM } else { C2H_TERM },
        0,
        &mut h,
        &offending[..n],
        Digests::default(),
    );
}

/// NVMe opcodes used here.
pub mod op {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const FABRICS: u8 = 0x7f;
    /// I/O vendor command: Rio durability mark (CDW10 stream, CDW11..12 the mark).
    pub const RIO_MARK: u8 = 0x84;
    // Admin.
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
    pub const ASYNC_EVENT: u8 = 0x0c;
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Admin vendor commands of Rio's target.
    pub const RIO_INFO: u8 = 0xc0;
    pub const RIO_RESET: u8 = 0xc1;
    pub const RIO_GET_LOG: u8 = 0xc2;
    /// Start a recovery: connections opened before it may write no more, and their writes
    /// already sent are complete when it is answered.
    pub const RIO_FENCE: u8 = 0xc3;
    // Fabrics command types.
    pub const FC_PROPERTY_SET: u8 = 0x00;
    pub const FC_CONNECT: u8 = 0x01;
    pub const FC_PROPERTY_GET: u8 = 0x04;
}

/// A Fabrics Connect command for queue `qid` (0: admin) of `sqsize` entries (0-based), no keep
/// alive, its 1,024 bytes of data in the capsule (see [`connect_data`]).
pub fn connect_command(qid: u16, sqsize: u16) -> Sqe {
    let mut sqe = Sqe::default();
    sqe.set_opcode(op::FABRICS);
    sqe.0[4] = op::FC_CONNECT;
    sqe.0[42..44].copy_from_slice(&qid.to_le_bytes());
    sqe.0[44..46].copy_from_slice(&sqsize.to_le_bytes());
    sqe.0[48..52].copy_from_slice(&0u32.to_le_bytes()); // KATO: none
    sqe.set_sgl(1024, true);
    sqe
}

/// The Connect command's data: host id, controller id (0xffff: any, for the admin queue),
/// subsystem and host NQNs (at most 255 bytes each).
pub fn connect_data(hostid: &[u8; 16], cntlid: u16, subnqn: &str, hostnqn: &str) -> Vec<u8> {
    let mut d = vec![0u8; 1024];
    d[0..16].copy_from_slice(hostid);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    let s = &subnqn.as_bytes()[..subnqn.len().min(255)];
    d[256..256 + s.len()].copy_from_slice(s);
    let h = &hostnqn.as_bytes()[..hostnqn.len().min(255)];
    d[512..512 + h.len()].copy_from_slice(h);
    d
}

/// Rio's op code: an ordered command (the attribute fields below are set).
pub const RIO_ORDERED: u8 = 1;

/// Rio's ordering attribute as it travels in a Write or Flush command (Table 1 of the Rio
/// paper, with this crate's extensions in CDW13..14):
///
/// | dword | bits | field |
/// | --- | --- | --- |
/// | 0 | 10..13 | Rio op code (1: ordered) |
/// | 2 | 0..31 | start sequence (`seq`, low 32 bits) |
/// | 3 | 0..31 | end sequence (`seq_end`, low 32 bits) |
/// | 4 | 0..31 | previous group on this target, as its distance below `seq` (`seq - prev`; 0: none) |
/// | 5 | 0..15 | requests in the group (`num`) |
/// | 5 | 16..31 | stream |
/// | 12 | 16..19 | flags: boundary, in-place update, flush, merged |
/// | 13 | 0..15 | requests this command carries (`members`) |
/// | 13 | 16..23, 24..31 | split index, split count |
/// | 14 | 0..31 | the stream's durability mark (low 32 bits; 0: none) |
///
/// Sequence numbers are 64-bit in memory; the target widens the 32 bits it receives to the
/// value nearest the stream's latest (see [`widen`]), so they may wrap on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireAttr {
    pub stream: u16,
    pub seq: u64,
    pub seq_end: u64,
    pub prev: u64,
    pub num: u16,
    pub members: u16,
    pub boundary: bool,
    pub ipu: bool,
    pub flush: bool,
    pub merged: bool,
    pub split: Option<(u8, u8)>,
    /// Every group of the stream below this is durable on every target (0: not said).
    pub mark: u64,
}

impl WireAttr {
    pub fn put(&self, sqe: &mut Sqe) {
        sqe.set_rio_op(RIO_ORDERED);
        sqe.set_cdw(2, self.seq as u32);
        sqe.set_cdw(3, self.seq_end as u32);
        sqe.set_cdw(4, prev_distance(self.seq, self.prev));
        sqe.set_cdw(5, self.num as u32 | (self.stream as u32) << 16);
        let flags = self.boundary as u32
            | (self.ipu as u32) << 1
            | (self.flush as u32) << 2
            | (self.merged as u32) << 3;
        sqe.set_cdw(12, (sqe.cdw(12) & !(0xf << 16)) | flags << 16);
        let (i, n) = self.split.unwrap_or((0, 0));
        sqe.set_cdw(
            13,
            self.members as u32 | (i as u32) << 16 | (n as u32) << 24,
        );
        sqe.set_cdw(14, self.mark as u32);
    }

    /// Read the attribute of an ordered command; 32-bit fields are widened against
    /// `reference(stream)` (the stream's latest group the reader knows).
    pub fn get(sqe: &Sqe, reference: impl Fn(u16) -> u64) -> Option<WireAttr> {
        if sqe.rio_op() != RIO_ORDERED {
            return None;
        }
        let stream = (sqe.cdw(5) >> 16) as u16;
        let r = reference(stream);
        let seq = widen(sqe.cdw(2), r);
        let w = |v: u32| if v == 0 { 0 } else { widen(v, seq) };
        let flags = sqe.cdw(12) >> 16;
        let c13 = sqe.cdw(13);
        let (i, n) = ((c13 >> 16) as u8, (c13 >> 24) as u8);
        Some(WireAttr {
            stream,
            seq,
            seq_end: widen(sqe.cdw(3), seq),
            prev: match sqe.cdw(4) {
                0 => 0,
                d => seq.saturating_sub(d as u64),
            },
            num: sqe.cdw(5) as u16,
            members: c13 as u16,
            boundary: flags & 1 != 0,
            ipu: flags & 2 != 0,
            flush: flags & 4 != 0,
            merged: flags & 8 != 0,
            split: (n != 0).then_some((i, n)),
            mark: w(sqe.cdw(14)),
        })
    }
}

/// How `prev` travels: its distance below `seq`, so that no previous group reads as none (0)
/// on the wire. (Its low 32 bits did, at every multiple of 2^32: the target's in-order gate
/// then let the command pass without waiting.) A previous group 2^32 groups back or more is
/// sent as none: the stream's window keeps far fewer than that out, so the target has long
/// submitted it.
fn prev_distance(seq: u64, prev: u64) -> u32 {
    match seq.checked_sub(prev) {
        Some(d) if prev != 0 && d <= u32::MAX as u64 => d as u32,
        _ => 0,
    }
}

/// The 64-bit value whose low 32 bits are `lo` and which lies nearest `reference`.
pub fn widen(lo: u32, reference: u64) -> u64 {
    let base = (reference & !0xffff_ffff) | lo as u64;
    let cands = [
        base.checked_sub(1 << 32),
        Some(base),
        base.checked_add(1 << 32),
    ];
    cands
        .into_iter()
        .flatten()
        .min_by_key(|&c| c.abs_diff(reference))
        .expect("base is a candidate")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u32 = 1 << 20;

    #[test]
    fn keyed_sgl_carries_address_length_and_key() {
        let mut sqe = Sqe::default();
        sqe.set_opcode(op::WRITE);
        sqe.set_keyed_sgl(0x7f12_3456_7000, 131072, 0xa1b2_c3d4);
        assert_eq!(
            sqe.keyed_sgl(),
            Some((0x7f12_3456_7000, 131072, 0xa1b2_c3d4))
        );
        // The length is 24 bits: the key's low byte must not leak into it.
        assert_eq!(sqe.sgl(), (0x7f12_3456_7000, 131072, SGL_KEYED));
        assert_eq!(sqe.0[1] & 0xc0, 0x40, "PSDT says SGL");
        sqe.set_sgl(4096, true);
        assert_eq!(sqe.keyed_sgl(), None);
        assert_eq!(sqe.sgl(), (0, 4096, SGL_IN_CAPSULE));
    }

    #[test]
    fn every_pdu_round_trips_with_and_without_digests() {
        for dg in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
            Digests {
                header: true,
                data: false,
            },
        ] {
            let mut out = Vec::new();
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::WRITE);
            sqe.set_cid(7);
            sqe.set_sgl(5, true);
            put_cmd(&mut out, &sqe, b"hello", dg);
            let cqe = Cqe {
                dw0: 1,
                cid: 7,
                status: Status::LBA_OUT_OF_RANGE.field(),
                ..Cqe::default()
            };
            put_resp(&mut out, &cqe, dg);
            put_r2t(&mut out, 7, 3, 0, 4096, dg);
            put_h2c_data(&mut out, 7, 3, 0, &[9; 100], true, dg);
            put_c2h_data(&mut out, 7, 4, &[8; 10], false, dg);
            let mut at = 0;
            let mut got = Vec::new();
            while let Some((p, n)) = decode(&out[at..], dg, MAX).unwrap() {
                got.push(format!("{p:?}"));
                at += n;
            }
            assert_eq!(at, out.len());
            assert_eq!(got.len(), 5);
            let (p, _) = decode(&out, dg, MAX).unwrap().unwrap();
            assert_eq!(
                p,
                Pdu::Cmd {
                    sqe,
                    data: b"hello"
                }
            );
        }
        let mut out = Vec::new();
        put_icreq(
            &mut out,
            Digests {
                header: true,
                data: false,
            },
            3,
        );
        assert_eq!(
            decode(&out, Digests::default(), MAX).unwrap().unwrap().0,
            Pdu::ICReq {
                pfv: 0,
                hpda: 0,
                dgst: 1,
                maxr2t: 3
            }
        );
    }

    #[test]
    fn partial_pdus_wait_and_bad_ones_are_named() {
        let dg = Digests {
            header: true,
            data: true,
        };
        let mut out = Vec::new();
        put_h2c_data(&mut out, 1, 1, 0, &[5; 64], true, dg);
        for cut in 0..out.len() {
            assert_eq!(decode(&out[..cut], dg, MAX), Ok(None), "cut at {cut}");
        }
        let mut bad = out.clone();
        bad[30] ^= 1; // data byte
        assert!(matches!(
            decode(&bad, dg, MAX),
            Err(PduError::DataDigest { .. })
        ));
        let mut bad = out.clone();
        bad[9] ^= 1; // header byte
        assert!(matches!(
            decode(&bad, dg, MAX),
            Err(PduError::HeaderDigest { .. })
        ));
        let mut bad = out.clone();
        bad[0] = 0x42;
        assert_eq!(decode(&bad, dg, MAX), Err(PduError::UnknownType(0x42)));
        assert!(matches!(
            decode(&out, dg, 32),
            Err(PduError::Oversized { .. })
        ));
        assert!(matches!(
            decode(&out, Digests::default(), MAX),
            Err(PduError::DigestFlags { .. })
        ));
    }

    #[test]
    fn the_attribute_travels_in_reserved_dwords_and_widens() {
        let a = WireAttr {
            stream: 3,
            seq: (5 << 32) + 10,
            seq_end: (5 << 32) + 12,
            prev: (5 << 32) + 2,
            num: 2,
            members: 1,
            boundary: true,
            flush: false,
            ipu: true,
            merged: true,
            split: Some((1, 3)),
            mark: (5 << 32) - 4,
        };
        let mut sqe = Sqe::default();
        sqe.set_opcode(op::WRITE);
        sqe.set_cdw(12, 7 | 1 << 30);
        a.put(&mut sqe);
        assert_eq!(sqe.nlb(), 8);
        assert!(sqe.fua());
        assert_eq!(WireAttr::get(&sqe, |_| (5 << 32) + 9), Some(a));
        let mut plain = Sqe::default();
        plain.set_opcode(op::WRITE);
        assert_eq!(WireAttr::get(&plain, |_| 0), None);
        // A previous group at a multiple of 2^32 (its low bits 0, read as none before), and
        // one just past 2^32 groups back (sent as none).
        for (seq, prev, got) in [
            ((5 << 32) + 3, 5 << 32, 5 << 32),
            (1 << 32, (1 << 32) - 1, (1 << 32) - 1),
            ((1 << 32) + 7, 0, 0),
            ((1 << 33) + 7, 7, 0),
        ] {
            let b = WireAttr {
                seq,
                seq_end: seq,
                prev,
                ..a
            };
            let mut sqe = Sqe::default();
            sqe.set_opcode(op::WRITE);
            b.put(&mut sqe);
            let back = WireAttr::get(&sqe, |_| seq).expect("ordered");
            assert_eq!(back.prev, got, "seq {seq:#x}, prev {prev:#x}");
        }
        assert_eq!(widen(5, 0), 5);
        assert_eq!(widen(0xffff_fffe, 1 << 32), 0xffff_fffe);
        assert_eq!(widen(2, 0xffff_fff0), (1 << 32) + 2);
    }
}
