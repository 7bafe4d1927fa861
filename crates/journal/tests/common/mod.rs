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
