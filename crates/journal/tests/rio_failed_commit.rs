//! A Rio-ordered commit that fails after some of its writes went to the device (its attribute
//! log stops taking writes part-way) returns only once none of them is in flight: until then
//! the device may still read their buffers, and the commit's error aborts the set, after which
//! the caller may reopen (recover) the journal and must not find a write of the failed commit
//! landing behind recovery's back.

mod common;
use common::{block_of, lbio};

use std::cell::Cell;
use std::rc::Rc;

use journal::rio_ordering::{MemPmr, OrderedConfig, Pmr, RioError};
use journal::{Journal, JournalError, JournalSet, Layout, Tx};
use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk};

const AREA_BLOCKS: u64 = 32;
const BLOCKS: u64 = AREA_BLOCKS + 64;

/// An attribute log in RAM whose writes fail from the `fail_from`-th on (counted in `calls`).
struct FailingPmr {
    inner: MemPmr,
    calls: Rc<Cell<u64>>,
    fail_from: Rc<Cell<u64>>,
}

impl Pmr for FailingPmr {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn persist(&mut self, offset: usize, bytes: &[u8]) -> Result<(), RioError> {
        let n = self.calls.get();
        self.calls.set(n + 1);
        if n >= self.fail_from.get() {
            return Err(RioError::Config("attribute log write failed (test)".into()));
        }
        self.inner.persist(offset, bytes)
    }
    fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), RioError> {
        self.inner.read(offset, out)
    }
}

/// For each point at which the attribute log may stop taking writes during a commit, a fresh
/// Rio handle commits data and metadata blocks. Whenever the commit fails after writes went to
/// the device, none of them may still be in flight when it returns.
#[test]
fn a_failed_rio_commit_leaves_none_of_its_writes_in_flight() {
    let mut failed_with_writes_sent = 0;
    for k in 0..24u64 {
        let lbio = lbio();
        let engine = Rc::clone(lbio.engine());
        let disk = SimDisk::new(SimConfig::new(BLOCKS * 4096, 3 + k)).unwrap();
        let layout = Layout::per_core(0, AREA_BLOCKS, 1);
        let set = JournalSet::format(&disk.open(&lbio).unwrap(), layout).unwrap();
        let own = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let calls = Rc::new(Cell::new(0));
        let fail_from = Rc::new(Cell::new(u64::MAX));
        let j = Journal::with_rio(
            &set,
            0,
            disk.open(&lbio).unwrap(),
            disk.open(&own).unwrap(),
            Box::new(FailingPmr {
                inner: MemPmr::new(16 << 10),
                calls: Rc::clone(&calls),
                fail_from: Rc::clone(&fail_from),
            }),
            OrderedConfig::default(),
        )
        .unwrap();
        // The k-th attribute log write of the commit fails, and every one after it.
        fail_from.set(calls.get() + k);
        let mut tx = Tx::new();
        tx.write_data(AREA_BLOCKS + 10, &block_of(1)).unwrap();
        tx.write_data(AREA_BLOCKS + 20, &block_of(2)).unwrap();
        tx.write_meta(AREA_BLOCKS + 30, &block_of(3)).unwrap();
        let started = disk.started();
        let r = j.commit(&tx);
        let sent = disk.started() - started;
        let in_flight = engine.inflight();
        match r {
            Ok(_) => {
                assert!(
                    calls.get() <= fail_from.get(),
                    "k {k}: a commit whose attribute log failed returned Ok"
                );
                continue;
            }
            Err(JournalError::Rio(_)) => {}
            Err(e) => panic!("k {k}: {e}"),
        }
        if sent > 0 {
            failed_with_writes_sent += 1;
        }
        assert_eq!(
            in_flight, 0,
            "k {k}: the failed commit returned with {in_flight} of its {sent} sent requests \
             still in flight"
        );
        // The set is aborted: nothing more goes out through it.
        assert!(matches!(j.commit(&tx), Err(JournalError::Aborted)));
        std::mem::forget(j);
    }
    assert!(
        failed_with_writes_sent > 0,
        "no commit failed after sending writes: the test proves nothing"
    );
}
