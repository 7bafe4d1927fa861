//! Lightweight block I/O: preallocated request slots, plugging, request classes and backends.
//!
//! lbio is AIOS's lightweight block layer (§3.1) in user space: a request lives in a per-engine
//! slot array sized at start, the slot index is the tag its completion carries, requests go
//! straight to the device with no merging or scheduling, and a burst can be plugged into one
//! `io_uring_enter`. Critical requests go out at once; background requests are throttled by a
//! token budget and split into 32 KiB pieces in LBA order (FastResponse §3.3).
//!
//! ```
//! use std::rc::Rc;
//! use aios_core::{Engine, EngineConfig};
//! use lbio::{Device, LbioArray, LbioConfig};
//!
//! let engine = Engine::new(EngineConfig { arena_bytes: 1 << 20, ..EngineConfig::default() })?;
//! let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
//! let dev = Device::memory(&lbio, 1 << 20)?;
//!
//! let mut buf = engine.try_alloc(4096).unwrap();
//! buf.fill(0x5a);
//! let buf = dev.write_at_blocking(8192, buf, false)?;          // blocking API
//! let back = engine.block_on(dev.read_at(8192, buf))??;         // async API
//! assert!(back.unwrap().iter().all(|&b| b == 0x5a));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod array;
mod backend;
mod device;
mod error;
mod simdisk;

pub use array::{
    ArrayFate, Class, Completion, Fate, LbioArray, LbioConfig, LbioMetrics, RawBuf, RawIov, Tag,
    MAX_PIECE_SEGMENTS, MAX_SLOTS,
};
pub use backend::{
    piece_in_memory, Backend, Caps, FileBackend, MemBackend, NvmeBackend, Op, Outcome, Piece,
    PieceError, Started, SyncBackend,
};
pub use device::{
    aligned, Device, DeviceConfig, Geometry, Io, IoFuture, RouteChoice, MAX_REQUEST_BYTES,
};
pub use error::LbioError;
pub use simdisk::{CrashOptions, SimConfig, SimDisk, SimLatency, SimRng, SimStats};

#[cfg(test)]
mod tests;
