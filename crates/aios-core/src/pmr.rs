//! An NVMe controller's persistent memory region (PMR), mapped into this process.
//!
//! A PMR is a PCI BAR of byte-addressable memory that the controller keeps across power loss
//! (NVMe base specification, "Persistent Memory Region"). Linux's nvme driver does not use it, so
//! [`NvmePmr::open`] reaches it through sysfs: it maps the controller's register BAR
//! (`resource0`) to read `CAP.PMRS` and `PMRCAP`, sets `PMRCTL.EN`, waits for `PMRSTS.NRDY` to
//! clear within `PMRTO`, and maps the BAR that `PMRCAP.BIR` names (`resourceN`).
//!
//! **Persistence.** A store to a PCIe BAR is posted: it may still be on its way when the CPU
//! moves on. The specification's write barrier (`PMRCAP.PMRWBM`) says which read makes earlier
//! writes persistent: bit 0, a read of any PMR location; bit 1, a read of `PMRSTS`.
//! [`NvmePmr::persist`] writes, then performs every read the controller names (and always a read
//! back of the last word written), so that when it returns the bytes are persistent.
//!
//! **Permissions.** Mapping a BAR that a driver has claimed needs root and, on kernels built with
//! `CONFIG_IO_STRICT_DEVMEM` (Debian's are), the boot parameter `iomem=relaxed`; without it the
//! mapping fails with `EINVAL` and the error says so.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::error::CoreError;

const REG_CAP: usize = 0x00;
const REG_PMRCAP: usize = 0xE00;
const REG_PMRCTL: usize = 0xE04;
const REG_PMRSTS: usize = 0xE08;
const REG_PMREBS: usize = 0xE0C;
/// Bytes of register space mapped: the page holding every PMR register.
const REGS_MAPPED: usize = 0x1000;
/// `CAP.PMRS`: the controller supports a PMR.
const CAP_PMRS: u64 = 1 << 56;

/// A mapping of a PCI resource file (`MAP_SHARED`), unmapped on drop.
struct Mmio {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain device memory with no thread affinity; every access goes through
// volatile reads and writes of the process-wide mapping.
unsafe impl Send for Mmio {}
unsafe impl Sync for Mmio {}

impl Mmio {
    fn map(file: &File, len: usize) -> io::Result<Mmio> {
        // SAFETY: a fresh shared mapping of `len` bytes of an open resource file; the kernel
        // checks the length against the BAR and the result is checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mmio {
            ptr: NonNull::new(p.cast()).expect("mmap returned a non-null address"),
            len,
        })
    }

    fn read32(&self, off: usize) -> u32 {
        assert!(
            off % 4 == 0 && off + 4 <= self.len,
            "register read out of range"
        );
        // SAFETY: in range and 4-byte aligned (checked); device memory is read with one volatile
        // 32-bit load, as the registers require.
        unsafe { self.ptr.as_ptr().add(off).cast::<u32>().read_volatile() }
    }

    fn read64(&self, off: usize) -> u64 {
        // Two 32-bit reads, low half first: every controller accepts these, not all accept 64-bit.
        let lo = self.read32(off) as u64;
        let hi = self.read32(off + 4) as u64;
        lo | (hi << 32)
    }

    fn write32(&self, off: usize, v: u32) {
        assert!(
            off % 4 == 0 && off + 4 <= self.len,
            "register write out of range"
        );
        // SAFETY: as in read32.
        unsafe { self.ptr.as_ptr().add(off).cast::<u32>().write_volatile(v) }
    }

    /// Copies `bytes` to `off` with volatile stores: 8-byte words where aligned, bytes elsewhere.
    fn write_bytes(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.len, "PMR write out of range");
        let mut i = 0;
        while i < bytes.len() {
            let at = off + i;
            // SAFETY: `at..at + 8` (or `at`) lies within the mapping (checked above); the 8-byte
            // store is only used at 8-byte aligned addresses.
            unsafe {
                let p = self.ptr.as_ptr().add(at);
                if at % 8 == 0 && bytes.len() - i >= 8 {
                    let w = u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
                    p.cast::<u64>().write_volatile(w);
                    i += 8;
                } else {
                    p.write_volatile(bytes[i]);
                    i += 1;
                }
            }
        }
    }

    fn read_bytes(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.len, "PMR read out of range");
        let mut i = 0;
        while i < out.len() {
            let at = off + i;
            // SAFETY: as in write_bytes.
            unsafe {
                let p = self.ptr.as_ptr().add(at);
                if at % 8 == 0 && out.len() - i >= 8 {
                    let w = p.cast::<u64>().read_volatile();
                    out[i..i + 8].copy_from_slice(&w.to_le_bytes());
                    i += 8;
                } else {
                    out[i] = p.read_volatile();
                    i += 1;
                }
            }
        }
    }
}

impl Drop for Mmio {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the region this value mapped; nothing borrows it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// What the controller says about its PMR (`PMRCAP`, `PMRSTS`, `PMREBS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmrInfo {
    /// The PCI device directory in sysfs.
    pub pci_dir: PathBuf,
    /// The BAR holding the PMR (`PMRCAP.BIR`).
    pub bar: u8,
    /// Bytes of the PMR (the BAR's size).
    pub bytes: usize,
    /// `PMRCAP.PMRWBM`: bit 0, a PMR read completes earlier writes; bit 1, a `PMRSTS` read does.
    pub write_barrier: u8,
    /// `PMRCAP.PMRTO` as a duration: how long enabling may take.
    pub ready_timeout: Duration,
    /// Elastic buffer size in bytes (`PMREBS`), 0 when not reported.
    pub elastic_buffer_bytes: u64,
    /// Whether this open enabled the PMR (it was disabled before).
    pub enabled_now: bool,
}

/// A mapped, enabled NVMe PMR. See the module documentation.
pub struct NvmePmr {
    regs: Mmio,
    pmr: Mmio,
    info: PmrInfo,
}

impl std::fmt::Debug for NvmePmr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmePmr").field("info", &self.info).finish()
    }
}

fn pmr_err(path: &Path, why: impl Into<String>) -> CoreError {
    CoreError::Pmr {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// The PCI device directory of the NVMe controller behind `path`: a namespace block device
/// (`/dev/nvme0n1`), its generic character device (`/dev/ng0n1`), the controller's character
/// device (`/dev/nvme0`), a `/sys/class/nvme/nvmeX` directory, or a PCI device directory.
pub fn pci_dir_of(path: &Path) -> Result<PathBuf, CoreError> {
    let meta = std::fs::metadata(path).map_err(|source| CoreError::Path {
        path: path.to_path_buf(),
        source,
    })?;
    let start = if meta.is_dir() {
        path.to_path_buf()
    } else {
        use std::os::unix::fs::MetadataExt;
        let rdev = meta.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        let kind = if meta.file_type().is_block_device() {
            "block"
        } else if meta.file_type().is_char_device() {
            "char"
        } else {
            return Err(pmr_err(
                path,
                "not a device node or a sysfs directory; give /dev/nvmeXnY, /dev/ngXnY or /dev/nvmeX",
            ));
        };
        PathBuf::from(format!("/sys/dev/{kind}/{major}:{minor}"))
    };
    // Walk `device` links upwards (namespace → controller → PCI function) until a directory
    // has the BAR files.
    let mut dir = start.clone();
    for _ in 0..4 {
        if dir.join("resource0").exists() {
            return std::fs::canonicalize(&dir).map_err(|source| CoreError::Path {
                path: dir.clone(),
                source,
            });
        }
        dir = dir.join("device");
        if !dir.exists() {
            break;
        }
    }
    Err(pmr_err(
        path,
        format!(
            "no PCI device with BAR files (resource0) found from {}; is this an NVMe device on PCI?",
            start.display()
        ),
    ))
}

fn open_rw(path: &Path) -> Result<File, CoreError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|source| CoreError::Path {
            path: path.to_path_buf(),
            source,
        })
}

fn map_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EINVAL) => {
            " (a BAR claimed by a driver can only be mapped with the kernel boot parameter \
             iomem=relaxed when the kernel has CONFIG_IO_STRICT_DEVMEM)"
        }
        Some(libc::EPERM) | Some(libc::EACCES) => " (mapping PCI BARs needs root)",
        _ => "",
    }
}

impl NvmePmr {
    /// Maps and enables the PMR of the controller behind `path` (see [`pci_dir_of`]).
    pub fn open(path: &Path) -> Result<NvmePmr, CoreError> {
        let pci = pci_dir_of(path)?;
        let class = std::fs::read_to_string(pci.join("class")).unwrap_or_default();
        // 0x010802: mass storage, non-volatile memory controller, NVM Express.
        if !class.trim().starts_with("0x0108") {
            return Err(pmr_err(
                path,
                format!(
                    "{} is PCI class {}, not an NVMe controller",
                    pci.display(),
                    class.trim()
                ),
            ));
        }
        let regs_path = pci.join("resource0");
        let regs_file = open_rw(&regs_path)?;
        let regs = Mmio::map(&regs_file, REGS_MAPPED).map_err(|e| {
            pmr_err(
                path,
                format!("mapping {}: {e}{}", regs_path.display(), map_hint(&e)),
            )
        })?;
        let cap = regs.read64(REG_CAP);
        if cap & CAP_PMRS == 0 {
            return Err(pmr_err(
                path,
                format!("the controller reports no PMR (CAP = {cap:#018x}, PMRS clear)"),
            ));
        }
        let pmrcap = regs.read32(REG_PMRCAP);
        let bar = ((pmrcap >> 5) & 0x7) as u8;
        if !(2..=5).contains(&bar) {
            return Err(pmr_err(
                path,
                format!("PMRCAP = {pmrcap:#010x} names BAR {bar}, not one of 2..5"),
            ));
        }
        let write_barrier = ((pmrcap >> 10) & 0xf) as u8;
        let timeout_units = ((pmrcap >> 16) & 0xff) as u64;
        let unit = if (pmrcap >> 8) & 0x3 == 1 {
            Duration::from_secs(60)
        } else {
            Duration::from_millis(500)
        };
        let ready_timeout = unit * timeout_units.max(1) as u32;
        let ebs = regs.read32(REG_PMREBS);
        let elastic_buffer_bytes = if ebs >> 8 == 0 {
            0
        } else {
            let scale: u64 = match ebs & 0xf {
                0 => 1,
                1 => 1 << 10,
                2 => 1 << 20,
                3 => 1 << 30,
                _ => 0,
            };
            ((ebs >> 8) as u64) * scale
        };

        let enabled_before = regs.read32(REG_PMRCTL) & 1 == 1;
        if !enabled_before {
            regs.write32(REG_PMRCTL, 1);
        }
        let t0 = Instant::now();
        loop {
            let sts = regs.read32(REG_PMRSTS);
            if sts & (1 << 8) == 0 {
                let health = (sts >> 9) & 0x7;
                if health != 0 {
                    let what = match health {
                        1 => "restore error: the contents were not restored",
                        2 => "read only",
                        3 => "unreliable",
                        _ => "a reserved health state",
                    };
                    return Err(pmr_err(
                        path,
                        format!("PMRSTS = {sts:#010x}: the PMR is {what}"),
                    ));
                }
                break;
            }
            if t0.elapsed() > ready_timeout {
                return Err(pmr_err(
                    path,
                    format!(
                        "PMRSTS = {sts:#010x}: still not ready {:?} after enabling (PMRTO)",
                        ready_timeout
                    ),
                ));
            }
            sleep(Duration::from_millis(1));
        }

        let bar_path = pci.join(format!("resource{bar}"));
        let bar_file = open_rw(&bar_path)?;
        let bytes = bar_file
            .metadata()
            .map_err(|source| CoreError::Path {
                path: bar_path.clone(),
                source,
            })?
            .len() as usize;
        if bytes == 0 {
            return Err(pmr_err(path, format!("{} has size 0", bar_path.display())));
        }
        let pmr = Mmio::map(&bar_file, bytes).map_err(|e| {
            pmr_err(
                path,
                format!("mapping {}: {e}{}", bar_path.display(), map_hint(&e)),
            )
        })?;
        Ok(NvmePmr {
            regs,
            pmr,
            info: PmrInfo {
                pci_dir: pci,
                bar,
                bytes,
                write_barrier,
                ready_timeout,
                elastic_buffer_bytes,
                enabled_now: !enabled_before,
            },
        })
    }

    /// What the controller reported.
    pub fn info(&self) -> &PmrInfo {
        &self.info
    }

    /// Bytes of the region.
    pub fn len(&self) -> usize {
        self.info.bytes
    }

    /// Whether the region is empty (never, for an opened PMR).
    pub fn is_empty(&self) -> bool {
        self.info.bytes == 0
    }

    /// Writes `bytes` at `offset` (posted: not yet known to be persistent).
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<(), CoreError> {
        self.check(offset, bytes.len())?;
        self.pmr.write_bytes(offset, bytes);
        Ok(())
    }

    /// Makes every earlier write persistent: the reads `PMRWBM` names, and a read back of the
    /// word at `offset`.
    pub fn barrier(&self, offset: usize) {
        fence(Ordering::SeqCst);
        let mut word = [0u8; 4];
        let at = offset.min(self.info.bytes - 4) & !3;
        self.pmr.read_bytes(at, &mut word);
        if self.info.write_barrier & 0x2 != 0 {
            let _ = self.regs.read32(REG_PMRSTS);
        }
        fence(Ordering::SeqCst);
    }

    /// Writes `bytes` at `offset` and returns once they are persistent (a persistent MMIO write:
    /// the write, then the reads that complete it).
    pub fn persist(&self, offset: usize, bytes: &[u8]) -> Result<(), CoreError> {
        self.write(offset, bytes)?;
        // The read back is of the word holding the last byte written (`barrier` aligns down).
        self.barrier(offset + bytes.len().saturating_sub(1));
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CoreError> {
        self.check(offset, out.len())?;
        self.pmr.read_bytes(offset, out);
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), CoreError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.info.bytes => Ok(()),
            _ => Err(CoreError::Config(format!(
                "PMR access at {offset}+{len} past its {} bytes",
                self.info.bytes
            ))),
        }
    }
}
