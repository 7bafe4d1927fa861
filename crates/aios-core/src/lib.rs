//! Per-core io_uring engine: ring setup, registered buffer arena, device probe and metrics.
//!
//! An [`Engine`] belongs to one thread. It owns an io_uring ring built with the fastest flags the
//! kernel accepts, one registered buffer [`Arena`] carved into frames, a registered-file table and
//! a small executor ([`Engine::block_on`]). Layers above it push SQEs tagged for a
//! [`CompletionSink`] and get each completion back by tag.
//!
//! ```
//! use aios_core::{Engine, EngineConfig};
//! let engine = Engine::new(EngineConfig { arena_bytes: 1 << 20, ..EngineConfig::default() })?;
//! let mut buf = engine.try_alloc(4096).expect("a fresh arena has room");
//! buf.fill(0xab);
//! assert_eq!(buf.len(), 4096);
//! assert_eq!(buf.as_ptr() as usize % 4096, 0, "frames are page aligned");
//! # Ok::<(), aios_core::CoreError>(())
//! ```

pub mod arena;
pub mod checksum;
pub mod copy;
pub mod engine;
pub mod error;
pub mod fuse_ring;
pub mod hint;
pub mod nvme;
pub mod pmr;
pub mod probe;
pub mod sys;

pub use arena::{Arena, Backing, FixedBuf, MappedBytes, SharedRegion};
pub use engine::{
    check_memlock, nop_sqe, CompletionMode, CompletionSink, Engine, EngineConfig, EngineMetrics,
    FixedFile, Plug, RingKind, RingSetup, SinkId, SoftDevice, HYBRID_SPIN, MAX_COMPLETION_SINKS,
    MAX_SHARED_REGIONS, PAYLOAD_MASK,
};
pub use error::CoreError;
pub use probe::{probe, DeviceKind, DeviceProbe, PathChoice, PathLatency, ProbeOptions, Route};
