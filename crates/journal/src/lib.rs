//! A physical block journal over lbio, with AIOS's overlapped commit (§3.3).
//!
//! - **Format** ([`format`](mod@format)): per journal area a superblock and a circular log of 4 KiB blocks;
//!   a transaction is descriptor blocks (tags with per-block crc32c), the metadata blocks, revoke
//!   records and a commit block with the transaction id, its block count and a crc32c chained
//!   over all of it.
//! - **Ordered mode**: a transaction's data blocks are written in place and are durable before
//!   its commit block.
//! - **Commit modes** ([`CommitMode`]): *vanilla* waits between the data, the journal blocks,
//!   the FLUSH and the commit, preparing each on the critical path; *overlapped* prepares the
//!   journal and commit blocks while the data is in flight and sends the journal blocks without
//!   waiting for it. The FLUSH is skipped on devices that declare power-loss protection; the
//!   commit block is written with FUA (`RWF_DSYNC` on files, the FUA bit on NVMe).
//! - **Rio-ordered commit** ([`Journal::with_rio`], Rio §4.7): data, journal blocks and commit
//!   block go out together as two ordered groups on the area's Rio stream, one FLUSH at the end;
//!   recovery ([`JournalSet::open_rio`]) keeps a Rio commit only when the attribute log shows
//!   its group durable ([`rio_prefix`]).
//! - **Per-core journals**: one area per engine ([`Layout::per_core`]), transaction ids global
//!   across areas; recovery merges areas by id so the newest version of a block wins. File-level
//!   transactions ([`Tx::for_file`]) carry one file's blocks and are committed by the calling
//!   thread.
//! - **Checkpoint** writes committed metadata home and empties the logs; **recovery**
//!   ([`JournalSet::open`]) replays committed transactions, stops at the first invalid one and
//!   tells a torn tail from damage mid-log ([`LogEnd`]).
//!
//! ```
//! use std::rc::Rc;
//! use aios_core::{Engine, EngineConfig};
//! use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk};
//! use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
//!
//! let engine = Engine::new(EngineConfig { arena_bytes: 1 << 20, ..EngineConfig::default() })?;
//! let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
//! let disk = SimDisk::new(SimConfig::new(1 << 20, 1))?;
//! let layout = Layout::per_core(0, 64, 1); // blocks 0..64: the journal; the rest: home blocks
//! let set = JournalSet::format(&disk.open(&lbio)?, layout.clone())?;
//! let j = Journal::new(&set, 0, disk.open(&lbio)?, CommitMode::Overlapped)?;
//! let mut tx = Tx::new();
//! tx.write_data(100, &[1u8; 4096])?.write_meta(101, &[2u8; 4096])?;
//! let info = j.commit(&tx)?;
//! assert_eq!(info.tid, 1);
//!
//! // The next transaction reuses the same `Tx` (and its memory: steady commits allocate nothing).
//! tx.clear();
//! tx.write_meta(101, &[2u8; 4096])?;
//! assert_eq!(j.commit(&tx)?.tid, 2);
//!
//! // A power cut after the commit: whatever the cut leaves, recovery brings block 101 back.
//! disk.cut_power();
//! let mut image = disk.crash_image(Default::default());
//! journal::recover_image(&mut image, &layout)?;
//! assert!(image[101 * 4096..102 * 4096].iter().all(|&b| b == 2));
//! assert!(image[100 * 4096..101 * 4096].iter().all(|&b| b == 1));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod error;
pub mod format;
mod journal;
pub mod recovery;

pub use error::JournalError;
pub use journal::{
    recover_image, recover_image_rio, rio_prefix, CommitInfo, CommitMode, Durability,
    DurabilityProbe, Journal, JournalSet, JournalStats, Layout, RecoveryReport, Tx,
};
pub use recovery::{AreaLog, LogEnd, RecoveredTx};
/// The Rio ordering crate a Rio-ordered handle ([`Journal::with_rio`]) is built from.
pub use rio_ordering;
