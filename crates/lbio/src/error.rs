//! Typed lbio errors: each names the wrong value and what would be right.

use std::io;
use std::path::PathBuf;

use aios_core::CoreError;

use crate::Op;

/// Everything an lbio call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LbioError {
    /// An offset, length or buffer address breaks the device's direct-I/O alignment.
    #[error("{what} {value} is not aligned to the device's {align}-byte direct-I/O alignment")]
    Unaligned {
        what: &'static str,
        value: u64,
        align: u32,
    },

    /// The request reaches past the end of the device.
    #[error(
        "{len}-byte request at offset {offset} runs past the end of the device ({capacity} bytes; \
         the last valid offset for it is {})",
        capacity.saturating_sub(*len as u64)
    )]
    PastEnd {
        offset: u64,
        len: u32,
        capacity: u64,
    },

    /// A read or write of zero bytes.
    #[error("zero-length {0}: give the buffer a length with FixedBuf::set_len")]
    Empty(Op),

    /// A request longer than one request may be.
    #[error("{len}-byte request is longer than the {max}-byte limit of one request")]
    TooLong { len: usize, max: u32 },

    /// The path does not exist.
    #[error("{path}: no such device or file")]
    NotFound { path: PathBuf },

    /// The path is on a file system (or is a file) without direct I/O.
    #[error(
        "{path}: {detail}; lbio needs O_DIRECT — use a block device or a file on a file system \
         with direct I/O (ext4, xfs, btrfs, tmpfs on Linux >= 6.6)"
    )]
    NoDirectIo { path: PathBuf, detail: String },

    /// The path is neither a block device nor a regular file.
    #[error(
        "{path}: a {kind} is not a block device or regular file{}",
        if kind == "character device" {
            " (nor an NVMe namespace passthrough device, /dev/ngXnY)"
        } else {
            ""
        }
    )]
    NotABlockDevice { path: PathBuf, kind: String },

    /// A queue depth larger than the slot array.
    #[error(
        "queue depth {qd} exceeds the {slots} request slots configured; raise LbioConfig::slots \
         or lower the depth"
    )]
    QueueDepth { qd: u32, slots: u32 },

    /// Every request slot is busy (back-pressure: wait for a completion and retry).
    #[error("all {slots} request slots are in flight; wait for a completion and retry")]
    NoFreeSlot { slots: u32 },

    /// A write or flush on a device opened read-only.
    #[error("{0} on a device opened read-only: open it with DeviceConfig {{ write: true, .. }}")]
    ReadOnly(Op),

    /// Too many devices on one slot array.
    #[error("all {max} device slots of this lbio array are open; raise LbioConfig::max_devices")]
    TooManyDevices { max: u16 },

    /// The device reported an error for the request.
    #[error("{op} of {len} bytes at offset {offset} failed: {source}")]
    Io {
        op: Op,
        offset: u64,
        len: u32,
        source: io::Error,
    },

    /// The NVMe controller completed the request with an error status.
    #[error("{op} of {len} bytes at offset {offset} failed: {status}")]
    Nvme {
        op: Op,
        offset: u64,
        len: u32,
        status: aios_core::nvme::NvmeStatus,
    },

    /// The device transferred fewer bytes than asked (e.g. the file shrank underneath).
    #[error("short {op} at offset {offset}: {done} of {len} bytes")]
    Short {
        op: Op,
        offset: u64,
        done: u32,
        len: u32,
    },

    /// An lbio configuration value is out of range.
    #[error("invalid lbio configuration: {0}")]
    Config(String),

    /// An engine-level failure (ring, arena, registration).
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl LbioError {
    /// Whether this is back-pressure (retry after a completion) rather than a failure.
    pub fn is_would_block(&self) -> bool {
        matches!(self, LbioError::NoFreeSlot { .. })
    }
}
