//! aios: an io_uring storage runtime for NVMe SSDs — facade over the crates, plus the benchmark
//! harness behind the `aios` command.
//!
//! ```
//! use std::rc::Rc;
//! use aios::core::{Engine, EngineConfig};
//! use aios::lbio::{Device, LbioArray, LbioConfig};
//!
//! let engine = Engine::new(EngineConfig { arena_bytes: 1 << 20, ..EngineConfig::default() })?;
//! let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
//! let dev = Device::memory(&lbio, 1 << 20)?;
//! let buf = dev.read_at_blocking(0, engine.try_alloc(4096).unwrap())?;
//! assert_eq!(buf.len(), 4096);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

pub use aios_core as core;
pub use fs_fuse as fs;
pub use journal;
pub use lbio;
pub use pagecache;
pub use rio_net;
pub use rio_ordering as rio;

pub mod bench;
pub mod netlab;
pub mod target;
