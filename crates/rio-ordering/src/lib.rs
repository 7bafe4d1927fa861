//! Rio's ordered block device (EuroSys'23, §4): ordering attributes, the persistent attribute
//! log, and recovery to the longest valid prefix of each stream's order.
//!
//! **In progress.** Built: the attribute and its 64-byte log entry ([`Attr`]); the circular
//! attribute log with back-pressure and per-stream durability marks ([`AttrLog`]) on any
//! [`Pmr`]: an NVMe controller's persistent memory region ([`NvmePmr`]), a block log on the
//! device for hardware without one ([`BlockPmr`]), or persistent memory *emulated* in a file
//! ([`FilePmr`]) or in RAM ([`MemPmr`]); the ordered device over lbio ([`OrderedDevice`]:
//! streams and groups, an ORDER queue that merges contiguous whole groups and splits writes
//! above the transfer limit, the attribute persisted before its data, in-order completion per
//! stream, `wait` with a logged FLUSH, stream stealing between threads with
//! [`OrderedDevice::detach`] and [`OrderedDevice::attach`]); and recovery ([`recover`]): per
//! stream, the longest prefix of groups whose requests are all in the log and durable (merged
//! groups all or nothing, split requests joined again), what lies beyond it, and the in-place
//! updates among that, over one log or several ([`LogScan::merge`]). Not built yet: an
//! asynchronous block log (its sync blocks the thread), and targets across the network
//! (rio-net).
//!
//! ```
//! use rio_ordering::{recover, scan, Attr, AttrLog, MemPmr};
//!
//! let mut log = AttrLog::format(MemPmr::new(64 << 10), 1)?;
//! // Group 1: one 4 KiB write on target 0, its final request; the data is then durable
//! // (power-loss-protected target), so the persist word is set.
//! let a = Attr { stream: 0, target: 0, seq: 1, seq_end: 1, offset: 0, len: 4096,
//!                boundary: true, num: 1, members: 1, ..Attr::default() };
//! let slot = log.append(&a)?;
//! log.set_persist(slot, 1)?;
//! // Group 2 was written to the log but its data never became durable.
//! log.append(&Attr { seq: 2, seq_end: 2, prev: 1, offset: 4096, ..a })?;
//!
//! let r = recover(&scan(log.pmr())?, &|_target| true);
//! assert_eq!(r.streams[0].prefix_end, 2);          // group 1 survives
//! assert_eq!(r.streams[0].beyond[0].seq, 2);       // group 2 is to be discarded
//! # Ok::<(), rio_ordering::RioError>(())
//! ```

#![forbid(unsafe_code)]

pub mod attr;
mod device;
mod error;
pub mod log;
pub mod pmr;
pub mod recovery;

pub use aios_core::pmr::NvmePmr;
pub use attr::{Attr, ATTR_BYTES, MAX_SEQ};
pub use device::{
    Done, OrderedConfig, OrderedDevice, OrderedStats, StreamHandoff, Write, MAX_GROUP_WRITES,
};
pub use error::RioError;
pub use log::{scan, AttrLog, Header, LogScan, MemPmr, Pmr, Slot, MAX_STREAMS};
pub use pmr::{BlockLogStats, BlockPmr, FilePmr};
pub use recovery::{recover, Recovery, StreamRecovery};

/// The README's examples, compiled and run by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeExamples;
