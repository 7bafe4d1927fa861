//! Helpers shared by the journal's integration tests (each uses some of them).
#![allow(dead_code)]

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use aios_core::{Engine, EngineConfig};
use journal::rio_ordering::{Pmr, RioError};
use lbio::{LbioArray, LbioConfig, SimDisk};

/// An engine of its own (4 MiB arena) with an lbio array over it.
pub fn lbio() -> Rc<LbioArray> {
    let engine = Engine::new(EngineConfig {
        ring_entries: 128,
        arena_bytes: 4 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .unwrap();
    LbioArray::new(engine, LbioConfig::default()).unwrap()
}

/// The 8-byte little-endian value at the start of 4 KiB block `block` of `img`.
pub fn value_at(img: &[u8], block: u64) -> u64 {
    u64::from_le_bytes(img[(block * 4096) as usize..][..8].try_into().unwrap())
}

/// A 4 KiB block filled with the 8-byte little-endian `v`.
pub fn block_of(v: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    for c in b.chunks_mut(8) {
        c.copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// Persistent memory emulated in RAM for the attribute log of a Rio-ordered area: a write lands
/// at once, and nothing lands once the SimDisk's power is cut (the crash keeps what is there).
pub struct SimPmr {
    pub bytes: Rc<RefCell<Vec<u8>>>,
    pub disk: SimDisk,
}

impl Pmr for SimPmr {
    fn len(&self) -> usize {
        self.bytes.borrow().len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        if !self.disk.powered() {
            return Err(RioError::Config("power cut".into()));
        }
        self.bytes.borrow_mut()[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        out.copy_from_slice(&self.bytes.borrow()[offset..offset + out.len()]);
        Ok(())
    }
}

/// (entered, released)
pub type Gate = Arc<(Mutex<(bool, bool)>, Condvar)>;

/// A [`SimPmr`] whose next write, once armed, blocks until the test releases it: it holds a
/// Rio-ordered commit mid-write (its id taken, its area's lead held).
pub struct PausingPmr {
    pub inner: SimPmr,
    pub armed: Arc<AtomicBool>,
    pub gate: Gate,
}

impl Pmr for PausingPmr {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        if self.armed.swap(false, Ordering::SeqCst) {
            let (m, cv) = &*self.gate;
            let mut g = m.lock().unwrap();
            g.0 = true;
            cv.notify_all();
            while !g.1 {
                g = cv.wait(g).unwrap();
            }
        }
        self.inner.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.inner.read(offset, out)
    }
}

/// One round of [`two_area_race`], seen once both commits are acknowledged.
pub struct RaceRound<'a> {
    pub disk: &'a SimDisk,
    pub set: &'a journal::JournalSet,
    pub layout: &'a journal::Layout,
    /// A handle on area 0 to checkpoint through.
    pub checkpointer: &'a journal::Journal,
    /// (tid, value) each thread committed this round.
    pub committed: [(u64, u64); 2],
}

/// Two threads, each with its own handle (thread `t` in `modes[t]`) on its own area of a fresh
/// two-area set (64-block areas; home blocks from 128, the shared block 129), commit at the same
/// moment in every round the transaction `tx(t, v, shared, home, &mut tx)` builds, `v` being
/// `1000 × (round + 1) + t`. Once both are acknowledged, `check` looks at the round.
pub fn two_area_race(
    modes: [journal::CommitMode; 2],
    rounds: u64,
    tx: impl Fn(usize, u64, u64, u64, &mut journal::Tx) + Sync,
    mut check: impl FnMut(&RaceRound<'_>),
) {
    use journal::{CommitMode, Journal, JournalSet, Layout, Tx};
    use std::sync::Barrier;
    let area_blocks = 64u64;
    let areas = 2usize;
    let home = areas as u64 * area_blocks;
    let shared = home + 1;
    let layout = Layout::per_core(0, area_blocks, areas);
    let disk = SimDisk::new(lbio::SimConfig::new((home + 16) * 4096, 11)).unwrap();
    let lbio0 = lbio();
    let set = JournalSet::format(&disk.open(&lbio0).unwrap(), layout.clone()).unwrap();
    let checkpointer =
        Journal::new(&set, 0, disk.open(&lbio0).unwrap(), CommitMode::Overlapped).unwrap();
    let barrier = Arc::new(Barrier::new(3));
    let values: Arc<Mutex<[(u64, u64); 2]>> = Arc::new(Mutex::new([(0, 0); 2]));
    std::thread::scope(|s| {
        for (t, &mode) in modes.iter().enumerate().take(areas) {
            let (set, disk, barrier, values, tx) = (
                Arc::clone(&set),
                disk.clone(),
                Arc::clone(&barrier),
                Arc::clone(&values),
                &tx,
            );
            s.spawn(move || {
                let lbio = lbio();
                let j = Journal::new(&set, t, disk.open(&lbio).unwrap(), mode).unwrap();
                for r in 0..rounds {
                    barrier.wait();
                    let v = 1000 * (r + 1) + t as u64;
                    let mut one = Tx::new();
                    tx(t, v, shared, home, &mut one);
                    let info = j.commit(&one).unwrap();
                    values.lock().unwrap()[t] = (info.tid, v);
                    barrier.wait();
                }
            });
        }
        for _ in 0..rounds {
            barrier.wait();
            barrier.wait();
            let committed = *values.lock().unwrap();
            check(&RaceRound {
                disk: &disk,
                set: &set,
                layout: &layout,
                checkpointer: &checkpointer,
                committed,
            });
        }
    });
}
