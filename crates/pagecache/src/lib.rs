//! A page cache over lbio with AIOS's asynchronous read path: pooled registered frames, lazy
//! indexing, lazy release, CLOCK eviction, writeback and readahead.
//!
//! One [`PageCache`] is shared by all cores (`Arc`); each thread works through its own
//! [`CacheHandle`], built on that thread's engine and lbio array. Frames live in one
//! [`SharedRegion`](aios_core::SharedRegion) registered as a fixed buffer with every handle's
//! engine, so a page read on one core is a hit on every other, and reads go straight into the
//! frames with `ReadFixed`.
//!
//! - **Miss** (AIOS §3.2): take a frame from the handle's pool, submit the read at once, then —
//!   while the device works — insert the page into the index (lazy indexing) and refill the pool.
//!   Two readers missing the same page both read it; the loser's frame is marked abandoned and
//!   freed once its reader has its bytes. Freed frames go back in batches (lazy release).
//! - **Hit**: the index is read without locks and a page is copied out optimistically (state
//!   word, bytes, state word again), so hits on different cores write no shared cache line;
//!   [`CacheHandle::get`] hands out a zero-copy guard that holds the page through a hazard slot
//!   of its own handle (eviction and writers check the slots), again writing no shared line.
//! - [`Mode`] switches the same code to the vanilla path (allocate under a lock, index, then
//!   submit with unregistered memory) or the steps between, for the ablation of AIOS Fig. 13.
//!
//! ```
//! use std::rc::Rc;
//! use aios_core::{Engine, EngineConfig};
//! use lbio::{Device, LbioArray, LbioConfig};
//! use pagecache::{CacheConfig, CacheHandle, Mode, PageCache};
//!
//! let cache = PageCache::new(CacheConfig { capacity_bytes: 1 << 20, ..CacheConfig::default() })?;
//! let engine = Engine::new(EngineConfig { arena_bytes: 1 << 20, ..EngineConfig::default() })?;
//! let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
//! let file = cache.add_file(1 << 20)?;
//! let handle = CacheHandle::new(&cache, &engine, &lbio, Mode::AIOS)?;
//! handle.attach(file, Device::memory(&lbio, 1 << 20)?)?;
//! handle.write(file, 4096, b"hello")?;
//! let mut back = [0u8; 5];
//! handle.read(file, 4096, &mut back)?;
//! assert_eq!(&back, b"hello");
//! handle.sync(file)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cache;
mod error;
mod frames;
mod handle;
mod hazard;
mod index;

pub use cache::{CacheConfig, CacheMetrics, FileId, Mode, PageCache, PAGE_BYTES};
pub use error::CacheError;
pub use handle::{CacheHandle, PageGuard, MISS_BATCH, WRITEBACK_BATCH};

#[cfg(test)]
mod tests;
