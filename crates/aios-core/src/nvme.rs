//! NVMe passthrough plumbing: the kernel's command layouts and ioctls, Identify, and status codes.
//!
//! Linux exposes each NVMe namespace twice: a block device (`/dev/nvme0n1`) and a generic
//! character device (`/dev/ng0n1`) that takes raw NVMe commands, either synchronously through an
//! ioctl or asynchronously as `IORING_OP_URING_CMD` on a ring with 128-byte SQEs. This module holds
//! the layouts both use (`struct nvme_passthru_cmd` / `struct nvme_uring_cmd`, 72 bytes, which
//! agree field for field up to the last word), Identify Controller/Namespace parsing, and the
//! decoding of an NVMe completion status into something a person can read.

use std::cell::Cell;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::rc::{Rc, Weak};

use io_uring::{opcode, squeue, types};

use crate::engine::{CompletionSink, Engine, FixedFile, LastResult, RingKind};
use crate::error::CoreError;
use crate::sys;

/// `_IOWR('N', nr, 72-byte struct)`: both passthrough structs are 72 bytes.
const fn iowr_n(nr: u32) -> u32 {
    (3 << 30) | (72 << 16) | ((b'N' as u32) << 8) | nr
}
/// `NVME_IOCTL_ID`: `_IO('N', 0x40)`, returns the namespace id of a namespace device.
const NVME_IOCTL_ID: u32 = ((b'N' as u32) << 8) | 0x40;
/// `NVME_IOCTL_ADMIN_CMD`: synchronous admin command.
const NVME_IOCTL_ADMIN_CMD: u32 = iowr_n(0x41);
/// `NVME_URING_CMD_IO`: the `cmd_op` of an asynchronous I/O command through io_uring.
pub const NVME_URING_CMD_IO: u32 = iowr_n(0x80);

/// NVMe I/O command opcodes lbio uses (NVM command set).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum IoOpcode {
    Flush = 0x00,
    Write = 0x01,
    Read = 0x02,
}

const ADMIN_IDENTIFY: u8 = 0x06;
const CNS_NAMESPACE: u32 = 0x00;
const CNS_CONTROLLER: u32 = 0x01;
/// Force Unit Access: bit 30 of CDW12 on reads and writes.
const CDW12_FUA: u32 = 1 << 30;
/// Identify data structures are one 4 KiB page.
const IDENTIFY_BYTES: usize = 4096;
/// The memory page size MDTS is counted in when the controller's CAP.MPSMIN is the common 4 KiB
/// (Linux sets the controller page size to 4 KiB, and passthrough data is mapped in those pages).
const MDTS_UNIT_BYTES: u64 = 4096;

/// The 72-byte command both passthrough interfaces take (`struct nvme_passthru_cmd` for the
/// ioctl, `struct nvme_uring_cmd` for io_uring; the last word is `result` in one, reserved in the
/// other).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct PassthruCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    pub result: u32,
}

const _: () = assert!(std::mem::size_of::<PassthruCmd>() == 72);

impl PassthruCmd {
    /// A read, write or flush of `nlb` blocks at `slba` moving `data_len` bytes at `addr`.
    /// `nlb` is the real count (the 0-based field is filled here); flushes ignore the range.
    pub fn io(
        op: IoOpcode,
        nsid: u32,
        slba: u64,
        nlb: u32,
        addr: u64,
        data_len: u32,
        fua: bool,
    ) -> PassthruCmd {
        let mut c = PassthruCmd {
            opcode: op as u8,
            nsid,
            ..PassthruCmd::default()
        };
        if op != IoOpcode::Flush {
            debug_assert!((1..=1 << 16).contains(&nlb));
            c.addr = addr;
            c.data_len = data_len;
            c.cdw10 = slba as u32;
            c.cdw11 = (slba >> 32) as u32;
            c.cdw12 = (nlb - 1) | if fua { CDW12_FUA } else { 0 };
        }
        c
    }

    /// The command as the 80-byte payload of an `IORING_OP_URING_CMD` SQE.
    pub fn to_uring_cmd(&self) -> [u8; 80] {
        let mut out = [0u8; 80];
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            out[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        put(&[self.opcode, self.flags]);
        put(&self.rsvd1.to_le_bytes());
        for w in [self.nsid, self.cdw2, self.cdw3] {
            put(&w.to_le_bytes());
        }
        put(&self.metadata.to_le_bytes());
        put(&self.addr.to_le_bytes());
        for w in [
            self.metadata_len,
            self.data_len,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
            self.timeout_ms,
            0,
        ] {
            put(&w.to_le_bytes());
        }
        out
    }
}

/// An `IORING_OP_URING_CMD` SQE carrying `cmd` to the registered passthrough device `file`. With
/// `fixed_data: Some(i)`, `cmd.addr` must lie in registered buffer `i` (0 is the engine's arena),
/// which the kernel then uses without pinning pages per command.
pub fn uring_cmd(file: FixedFile, cmd: &PassthruCmd, fixed_data: Option<u16>) -> squeue::Entry128 {
    opcode::UringCmd80::new(types::Fixed(file.0), NVME_URING_CMD_IO)
        .cmd(cmd.to_uring_cmd())
        .buf_index(fixed_data)
        .build()
}

/// Read block 0 of the namespace into a buffer of `engine`'s arena, through `file`, with or
/// without the fixed-buffer flag; the raw completion result.
fn read_block0(
    engine: &Engine,
    file: FixedFile,
    ns: &NvmeNamespace,
    fixed: bool,
) -> Result<i32, CoreError> {
    let sink = Rc::new(LastResult(Cell::new(None)));
    let id = engine.register_sink(Rc::downgrade(&sink) as Weak<dyn CompletionSink>)?;
    let mut buf = engine.alloc_blocking(ns.lba_bytes as usize)?;
    let cmd = PassthruCmd::io(
        IoOpcode::Read,
        ns.nsid,
        0,
        1,
        buf.as_mut_ptr() as u64,
        ns.lba_bytes,
        false,
    );
    // SAFETY: `buf` and the registered file outlive the waits below, which run until this
    // command's completion has been dispatched.
    unsafe {
        engine.push_cmd(
            RingKind::Main,
            id,
            0,
            uring_cmd(file, &cmd, fixed.then_some(0)),
        )
    }?;
    while sink.0.get().is_none() {
        if let Err(e) = engine.wait(1) {
            // The command may still be in the kernel's hands: its buffer must not go back to
            // the arena for another use (a leak of one block, on a failing engine).
            std::mem::forget(buf);
            return Err(e);
        }
    }
    Ok(sink.0.get().expect("completed"))
}

/// Whether the kernel accepts `engine`'s registered arena as passthrough data buffers
/// (`IORING_URING_CMD_FIXED`), found by reading block 0 both ways. `Ok(Err(why))` when it refuses
/// them but maps ordinary addresses: Linux 6.1 fails fixed-buffer passthrough with `EINVAL`
/// whenever the registered buffer spans more pages than the device's max segments, which any
/// arena larger than a few hundred KiB does.
pub fn registered_buffers_work(
    engine: &Engine,
    file: FixedFile,
    ns: &NvmeNamespace,
) -> Result<Result<(), String>, CoreError> {
    let fixed = read_block0(engine, file, ns, true)?;
    if fixed == 0 {
        return Ok(Ok(()));
    }
    let plain = read_block0(engine, file, ns, false)?;
    let describe = |r: i32| {
        if r < 0 {
            io::Error::from_raw_os_error(-r).to_string()
        } else {
            NvmeStatus(r as u16).to_string()
        }
    };
    if plain == 0 {
        Ok(Err(format!(
            "this kernel refuses the registered arena for passthrough data ({}), so each command's \
             pages are mapped per command (Linux 6.1 does this for registered buffers larger than \
             the device's max segments)",
            describe(fixed)
        )))
    } else {
        Err(CoreError::Sys {
            op: "NVMe passthrough read of block 0",
            source: if plain < 0 {
                io::Error::from_raw_os_error(-plain)
            } else {
                io::Error::other(describe(plain))
            },
        })
    }
}

/// An NVMe completion status as the kernel reports it for passthrough (a positive CQE result or
/// ioctl return): status code in bits 0–7, status code type in 8–10, More in 13, Do Not Retry
/// in 14.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NvmeStatus(pub u16);

impl NvmeStatus {
    /// Status Code Type (0 generic, 1 command specific, 2 media and data integrity, 3 path).
    pub fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }
    /// Status Code within its type.
    pub fn sc(self) -> u8 {
        self.0 as u8
    }
    /// Do Not Retry: the controller says the same command would fail again.
    pub fn dnr(self) -> bool {
        self.0 & (1 << 14) != 0
    }

    /// The specification's name for the common codes.
    pub fn name(self) -> &'static str {
        match (self.sct(), self.sc()) {
            (0, 0x00) => "Successful Completion",
            (0, 0x01) => "Invalid Command Opcode",
            (0, 0x02) => "Invalid Field in Command",
            (0, 0x04) => "Data Transfer Error",
            (0, 0x05) => "Commands Aborted due to Power Loss Notification",
            (0, 0x06) => "Internal Error",
            (0, 0x07) => "Command Abort Requested",
            (0, 0x0B) => "Invalid Namespace or Format",
            (0, 0x0D) => "Invalid SGL Segment Descriptor",
            (0, 0x15) => "Operation Denied",
            (0, 0x80) => "LBA Out of Range",
            (0, 0x81) => "Capacity Exceeded",
            (0, 0x82) => "Namespace Not Ready",
            (1, 0x80) => "Conflicting Attributes",
            (1, 0x82) => "Attempted Write to Read Only Range",
            (2, 0x80) => "Write Fault",
            (2, 0x81) => "Unrecovered Read Error",
            (2, 0x82) => "End-to-end Guard Check Error",
            (2, 0x85) => "Compare Failure",
            (2, 0x86) => "Access Denied",
            (2, 0x87) => "Deallocated or Unwritten Logical Block",
            (3, _) => "Path Related Status",
            _ => "unrecognised status",
        }
    }
}

impl fmt::Display for NvmeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NVMe status {} (SCT {:#x}, SC {:#04x}{})",
            self.name(),
            self.sct(),
            self.sc(),
            if self.dnr() { ", do not retry" } else { "" }
        )
    }
}

/// What Identify Controller and Identify Namespace say about a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeNamespace {
    /// The passthrough character device (`/dev/ngXnY`).
    pub char_device: PathBuf,
    pub nsid: u32,
    pub model: String,
    pub serial: String,
    /// Bytes per logical block in the namespace's current format.
    pub lba_bytes: u32,
    /// Namespace size in logical blocks (NSZE).
    pub capacity_lbas: u64,
    /// Maximum Data Transfer Size from Identify Controller, in bytes (`None`: no limit reported).
    pub mdts_bytes: Option<u64>,
    /// The block layer's limit on one passthrough command (`max_hw_sectors_kb`), when readable.
    pub max_hw_bytes: Option<u64>,
    /// The controller has a volatile write cache (flush matters).
    pub volatile_write_cache: bool,
}

impl NvmeNamespace {
    /// Largest data transfer one command may carry: the smaller of MDTS and the block layer's
    /// limit, rounded down to whole blocks, and at most the 65,536 blocks a read or write
    /// command's 16-bit (0's based) block count can say.
    pub fn max_transfer_bytes(&self) -> u32 {
        let lba = self.lba_bytes as u64;
        let lim = [self.mdts_bytes, self.max_hw_bytes]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(1 << 20)
            .min(1 << 30)
            .min(lba.saturating_mul(1 << 16));
        (lim / lba * lba).max(lba) as u32
    }

    /// Capacity in bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_lbas * self.lba_bytes as u64
    }

    /// Where the MDTS figure came from and how it combines with the block layer's limit.
    pub fn max_transfer_source(&self) -> String {
        let mdts = self
            .mdts_bytes
            .map_or("no MDTS limit".to_string(), |b| format!("MDTS {b} bytes"));
        let hw = self
            .max_hw_bytes
            .map_or("max_hw_sectors_kb unreadable".into(), |b| {
                format!("max_hw_sectors_kb {} KiB", b / 1024)
            });
        format!("Identify Controller {mdts}; block layer {hw}")
    }
}

fn path_err(path: &Path) -> impl Fn(io::Error) -> CoreError + '_ {
    move |source| CoreError::Path {
        path: path.to_path_buf(),
        source,
    }
}

/// The namespace id of an NVMe namespace device, or `None` when `fd` is not one (the ioctl is
/// refused: `ENOTTY`, `EINVAL`, …).
pub fn namespace_id(fd: RawFd) -> Option<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument; on a device that does not know it the kernel
    // returns an error without touching memory.
    let r = unsafe { libc::ioctl(fd, NVME_IOCTL_ID as _) };
    (r > 0).then_some(r as u32)
}

/// Run one synchronous admin command, returning its 4 KiB data page.
fn admin_identify(fd: RawFd, nsid: u32, cns: u32) -> Result<Box<[u8; IDENTIFY_BYTES]>, io::Error> {
    let mut page = Box::new([0u8; IDENTIFY_BYTES]);
    let mut cmd = PassthruCmd {
        opcode: ADMIN_IDENTIFY,
        nsid,
        addr: page.as_mut_ptr() as u64,
        data_len: IDENTIFY_BYTES as u32,
        cdw10: cns,
        ..PassthruCmd::default()
    };
    // SAFETY: `cmd` is a valid `struct nvme_passthru_cmd`; its `addr` points at `page`, which is
    // `data_len` writable bytes and outlives this synchronous call.
    let r = unsafe { libc::ioctl(fd, NVME_IOCTL_ADMIN_CMD as _, &mut cmd as *mut PassthruCmd) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    if r > 0 {
        return Err(io::Error::other(format!(
            "Identify (CNS {cns}) failed: {}",
            NvmeStatus(r as u16)
        )));
    }
    Ok(page)
}

fn ascii_field(b: &[u8]) -> String {
    // The specification pads with spaces; some devices pad with NULs.
    String::from_utf8_lossy(b)
        .trim_matches(|c: char| c == ' ' || c == '\0')
        .to_string()
}

/// Parse Identify Controller and Identify Namespace pages (NVMe base specification layouts).
pub fn parse_identify(
    char_device: PathBuf,
    nsid: u32,
    ctrl: &[u8; IDENTIFY_BYTES],
    ns: &[u8; IDENTIFY_BYTES],
    max_hw_bytes: Option<u64>,
) -> Result<NvmeNamespace, String> {
    let nsze = u64::from_le_bytes(ns[0..8].try_into().expect("8 bytes"));
    let flbas = ns[26];
    let nlbaf = ns[25] as usize + 1;
    // FLBAS bits 3:0 index the format; bits 6:5 extend it past 16 formats.
    let idx = (flbas & 0x0f) as usize | (((flbas >> 5) & 0x3) as usize) << 4;
    if idx >= nlbaf.max(1) || idx >= 64 {
        return Err(format!("FLBAS selects LBA format {idx} of {nlbaf} formats"));
    }
    let at = 128 + 4 * idx;
    let lbaf = u32::from_le_bytes(ns[at..at + 4].try_into().expect("4 bytes"));
    let lbads = (lbaf >> 16) & 0xff;
    if !(9..=16).contains(&lbads) {
        return Err(format!(
            "LBA format {idx} has LBADS {lbads} (2^{lbads}-byte blocks): lbio supports 512 B to 64 KiB"
        ));
    }
    // Metadata per block (bits 15:0): lbio's commands carry no metadata pointer and size the
    // data as plain blocks, so such a format cannot be driven correctly.
    let ms = lbaf & 0xffff;
    if ms != 0 {
        let how = if flbas & 0x10 != 0 {
            "inline with each block"
        } else {
            "in a separate buffer"
        };
        return Err(format!(
            "LBA format {idx} carries {ms} bytes of metadata per block ({how}): lbio sends no \
             metadata; format the namespace with a metadata-free LBA format (nvme format --lbaf)"
        ));
    }
    let mdts = ctrl[77];
    Ok(NvmeNamespace {
        char_device,
        nsid,
        serial: ascii_field(&ctrl[4..24]),
        model: ascii_field(&ctrl[24..64]),
        lba_bytes: 1 << lbads,
        capacity_lbas: nsze,
        mdts_bytes: (mdts != 0 && mdts < 32).then(|| MDTS_UNIT_BYTES << mdts),
        max_hw_bytes,
        volatile_write_cache: ctrl[525] & 1 != 0,
    })
}

/// The block-device name behind a namespace device name (`ng0n1` or `nvme0n1` → `nvme0n1`).
fn block_name(dev_name: &str) -> Option<String> {
    if let Some(rest) = dev_name.strip_prefix("ng") {
        Some(format!("nvme{rest}"))
    } else if dev_name.starts_with("nvme") && dev_name.contains('n') {
        Some(dev_name.to_string())
    } else {
        None
    }
}

/// The passthrough character device for an NVMe namespace path: `/dev/ngXnY` itself, or the one
/// beside a block device `/dev/nvmeXnY`. `None` when the path is not an NVMe namespace.
pub fn char_device_for(path: &Path) -> Option<PathBuf> {
    let name = path.file_name()?.to_str()?;
    if name.starts_with("ng") {
        return Some(path.to_path_buf());
    }
    let rest = name.strip_prefix("nvme")?;
    // nvmeXnY (a namespace), not nvmeX (the controller) or nvmeXnYpZ (a partition).
    if !rest.contains('n') || rest.contains('p') {
        return None;
    }
    let ng = path.with_file_name(format!("ng{rest}"));
    ng.exists().then_some(ng)
}

/// Whether `path` is an NVMe namespace passthrough character device (so an engine driving it
/// needs [`EngineConfig::passthrough`](crate::EngineConfig::passthrough)).
pub fn is_passthrough_device(path: &Path) -> bool {
    let Ok(fd) = sys::open_buffered(path, false) else {
        return false;
    };
    sys::statx(fd.as_raw_fd()).is_ok_and(|st| st.is_char_device())
        && namespace_id(fd.as_raw_fd()).is_some()
}

/// Open an NVMe passthrough character device read-write and identify its namespace.
///
/// Fails with a clear error when the path is not an NVMe namespace character device (a block
/// device, another character device, a file), or when Identify fails (it needs `CAP_SYS_ADMIN`).
pub fn open_namespace(path: &Path) -> Result<(OwnedFd, NvmeNamespace), CoreError> {
    let fd = sys::open_buffered(path, true).map_err(path_err(path))?;
    let st = sys::statx(fd.as_raw_fd()).map_err(path_err(path))?;
    if !st.is_char_device() {
        return Err(CoreError::NotNvme {
            path: path.to_path_buf(),
            why: "not a character device; NVMe passthrough uses /dev/ngXnY".into(),
        });
    }
    let Some(nsid) = namespace_id(fd.as_raw_fd()) else {
        return Err(CoreError::NotNvme {
            path: path.to_path_buf(),
            why: format!(
                "a character device ({}:{}) that does not answer NVME_IOCTL_ID",
                st.rdev_major, st.rdev_minor
            ),
        });
    };
    let identify_err = |source: io::Error| CoreError::Sys {
        op: "NVMe Identify (admin passthrough ioctl)",
        source,
    };
    let ctrl = admin_identify(fd.as_raw_fd(), 0, CNS_CONTROLLER).map_err(identify_err)?;
    let ns = admin_identify(fd.as_raw_fd(), nsid, CNS_NAMESPACE).map_err(identify_err)?;
    let max_hw_bytes = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(block_name)
        .and_then(|b| {
            std::fs::read_to_string(format!("/sys/block/{b}/queue/max_hw_sectors_kb")).ok()
        })
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024);
    let info =
        parse_identify(path.to_path_buf(), nsid, &ctrl, &ns, max_hw_bytes).map_err(|why| {
            CoreError::NotNvme {
                path: path.to_path_buf(),
                why,
            }
        })?;
    Ok((fd, info))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller reporting a large MDTS (or none) with the block layer's limit unreadable:
    /// one command still carries at most 65,536 blocks, the most its block count says (past
    /// it the count wrapped and the command moved fewer blocks than its buffer held).
    #[test]
    fn a_command_carries_at_most_the_blocks_its_count_says() {
        let ns = |lba_bytes, mdts_bytes, max_hw_bytes| NvmeNamespace {
            char_device: PathBuf::from("/dev/ng0n1"),
            nsid: 1,
            model: String::new(),
            serial: String::new(),
            lba_bytes,
            capacity_lbas: 1 << 30,
            mdts_bytes,
            max_hw_bytes,
            volatile_write_cache: false,
        };
        assert_eq!(ns(512, Some(1 << 31), None).max_transfer_bytes(), 32 << 20);
        assert_eq!(ns(512, Some(1 << 20), None).max_transfer_bytes(), 1 << 20);
        assert_eq!(
            ns(4096, Some(1 << 31), None).max_transfer_bytes(),
            256 << 20
        );
        assert_eq!(
            ns(4096, None, Some(128 << 10)).max_transfer_bytes(),
            128 << 10
        );
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_abi() {
        // From <linux/nvme_ioctl.h>, as the kernel's _IOWR expands them for 72-byte structs.
        assert_eq!(NVME_IOCTL_ID, 0x4e40);
        assert_eq!(NVME_IOCTL_ADMIN_CMD, 0xc048_4e41);
        assert_eq!(NVME_URING_CMD_IO, 0xc048_4e80);
    }

    #[test]
    fn io_command_fields_land_where_the_kernel_reads_them() {
        let c = PassthruCmd::io(
            IoOpcode::Write,
            1,
            0x1_2345_6789,
            8,
            0xdead_b000,
            4096,
            true,
        );
        let b = c.to_uring_cmd();
        assert_eq!(b[0], 0x01, "opcode");
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 1, "nsid");
        assert_eq!(
            u64::from_le_bytes(b[24..32].try_into().unwrap()),
            0xdead_b000
        );
        assert_eq!(u32::from_le_bytes(b[36..40].try_into().unwrap()), 4096);
        assert_eq!(
            u32::from_le_bytes(b[40..44].try_into().unwrap()),
            0x2345_6789
        );
        assert_eq!(u32::from_le_bytes(b[44..48].try_into().unwrap()), 1);
        assert_eq!(
            u32::from_le_bytes(b[48..52].try_into().unwrap()),
            7 | CDW12_FUA,
            "0-based block count and FUA"
        );
        assert!(b[72..].iter().all(|&x| x == 0));
        let f = PassthruCmd::io(IoOpcode::Flush, 3, 99, 1, 0x1000, 512, true);
        assert_eq!(
            (f.addr, f.data_len, f.cdw12),
            (0, 0, 0),
            "flush moves no data"
        );
    }

    #[test]
    fn status_decoding_names_type_code_and_dnr() {
        let s = NvmeStatus(0x4080);
        assert_eq!((s.sct(), s.sc(), s.dnr()), (0, 0x80, true));
        assert_eq!(s.name(), "LBA Out of Range");
        let text = s.to_string();
        assert!(
            text.contains("LBA Out of Range") && text.contains("do not retry"),
            "{text}"
        );
        assert_eq!(NvmeStatus(0x0281).name(), "Unrecovered Read Error");
        assert_eq!(NvmeStatus(0x0002).name(), "Invalid Field in Command");
    }

    fn pages(lbads: u32, mdts: u8, nsze: u64) -> (Box<[u8; 4096]>, Box<[u8; 4096]>) {
        let mut ctrl = Box::new([0u8; 4096]);
        let mut ns = Box::new([0u8; 4096]);
        ctrl[4..8].copy_from_slice(b"SN01");
        ctrl[24..32].copy_from_slice(b"QEMU NVM");
        ctrl[77] = mdts;
        ctrl[525] = 1;
        ns[0..8].copy_from_slice(&nsze.to_le_bytes());
        ns[25] = 1; // two formats
        ns[26] = 1; // the second is in use
        ns[128..132].copy_from_slice(&(9u32 << 16).to_le_bytes());
        ns[132..136].copy_from_slice(&(lbads << 16).to_le_bytes());
        (ctrl, ns)
    }

    #[test]
    fn identify_pages_give_geometry() {
        let (ctrl, ns) = pages(12, 7, 65536);
        let n = parse_identify("/dev/ng0n1".into(), 1, &ctrl, &ns, Some(256 << 10)).unwrap();
        assert_eq!(n.lba_bytes, 4096);
        assert_eq!(n.capacity_bytes(), 65536 * 4096);
        assert_eq!(n.mdts_bytes, Some(512 << 10));
        assert_eq!(n.max_transfer_bytes(), 256 << 10, "the smaller limit wins");
        assert_eq!(n.model, "QEMU NVM");
        assert!(n.volatile_write_cache);
        let (ctrl, ns) = pages(12, 0, 1);
        let n = parse_identify("/dev/ng0n1".into(), 1, &ctrl, &ns, None).unwrap();
        assert_eq!(n.mdts_bytes, None, "MDTS 0 means no limit");
        let (ctrl, ns) = pages(3, 5, 1);
        assert!(parse_identify("/dev/ng0n1".into(), 1, &ctrl, &ns, None).is_err());
    }

    /// A namespace formatted with metadata per block (MS > 0: inline with the data, or in a
    /// separate buffer) is refused. lbio's commands carry no metadata pointer and size their
    /// data as blocks without metadata: the controller would move metadata to or from address
    /// 0, or the transfer would not match the buffer. (Found by a review on 2026-11-28: such a
    /// namespace was taken.)
    #[test]
    fn a_namespace_formatted_with_metadata_is_refused() {
        for extended in [false, true] {
            let (ctrl, mut ns) = pages(12, 7, 65536);
            ns[132..136].copy_from_slice(&((12u32 << 16) | 8).to_le_bytes());
            if extended {
                ns[26] |= 0x10;
            }
            let e = parse_identify("/dev/ng0n1".into(), 1, &ctrl, &ns, None).unwrap_err();
            assert!(e.contains("metadata"), "extended {extended}: {e}");
        }
    }

    #[test]
    fn namespace_names_map_between_block_and_char_devices() {
        assert_eq!(block_name("ng0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(block_name("nvme1n2").as_deref(), Some("nvme1n2"));
        assert_eq!(block_name("sda"), None);
        assert_eq!(
            char_device_for(Path::new("/dev/ng3n1")),
            Some(PathBuf::from("/dev/ng3n1"))
        );
        assert_eq!(char_device_for(Path::new("/dev/nvme0")), None);
        assert_eq!(char_device_for(Path::new("/dev/nvme0n1p1")), None);
        assert_eq!(char_device_for(Path::new("/dev/sda")), None);
    }

    #[test]
    fn a_non_nvme_char_device_is_refused_with_the_reason() {
        assert!(!is_passthrough_device(Path::new("/dev/null")));
        assert!(!is_passthrough_device(Path::new("/nonexistent")));
        let e = open_namespace(Path::new("/dev/null")).unwrap_err();
        assert!(matches!(e, CoreError::NotNvme { .. }), "{e}");
        assert!(e.to_string().contains("NVME_IOCTL_ID"), "{e}");
        let e = open_namespace(Path::new("/dev/zero")).unwrap_err();
        assert!(matches!(e, CoreError::NotNvme { .. }), "{e}");
    }
}
