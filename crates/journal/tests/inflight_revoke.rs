//! A revoke still in flight in one area, and another area's in-place write to the revoked
//! block (found by a review on 2026-11-27). The set dropped a block's kept version when the
//! revoking commit took its id, before its writes were durable, so a commit on another area saw
//! no journaled copy and let an in-place write without a revoke through; if the revoke never
//! became durable (a power cut, or a failed write), recovery replayed the old journaled copy
//! over the acknowledged data. Such a write is now refused until the revoke is durable, and
//! one that carries its own revoke goes through.
//!
//! The revoking commit is paused deterministically: it is a Rio-ordered commit whose attribute
//! log (a `PausingPmr` of the tests' common module) blocks on its first write until released.

mod common;
use common::{block_of, lbio, value_at, Gate, PausingPmr, SimPmr};

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use journal::rio_ordering::{OrderedConfig, Pmr};
use journal::{recover_image, CommitMode, Journal, JournalError, JournalSet, Layout, Tx};
use lbio::{LbioArray, LbioConfig, SimConfig, SimDisk};

#[test]
fn an_in_flight_revoke_keeps_unrevoked_data_writes_to_its_block_out() {
    let area_blocks = 64u64;
    let areas = 2usize;
    let home = areas as u64 * area_blocks;
    let b = home + 1; // the block freed and reused
    let layout = Layout::per_core(0, area_blocks, areas);
    let disk = SimDisk::new(SimConfig::new((home + 16) * 4096, 3)).unwrap();
    let lbio1 = lbio();
    let set = JournalSet::format(&disk.open(&lbio1).unwrap(), layout.clone()).unwrap();
    // Area 1: block b journaled as metadata (acknowledged, not checkpointed).
    let j1 = Journal::new(&set, 1, disk.open(&lbio1).unwrap(), CommitMode::Overlapped).unwrap();
    let mut tx = Tx::new();
    tx.write_meta(b, &block_of(111)).unwrap();
    j1.commit(&tx).unwrap();

    // Without the race the same write is refused.
    let mut bad = Tx::new();
    bad.write_data(b, &block_of(999)).unwrap();
    assert!(matches!(
        j1.commit(&bad),
        Err(JournalError::DataOverJournaledBlock { .. })
    ));

    let armed = Arc::new(AtomicBool::new(false));
    let gate: Gate = Arc::new((Mutex::new((false, false)), Condvar::new()));
    // What area 1's two commits return; checked once the revoking commit has ended (a failed
    // check inside the scope would leave it blocked, and the test hanging).
    let (unrevoked, revoking) = std::thread::scope(|s| {
        let (set2, disk2, armed2, gate2) = (
            Arc::clone(&set),
            disk.clone(),
            Arc::clone(&armed),
            Arc::clone(&gate),
        );
        let a = s.spawn(move || {
            let lbio0 = lbio();
            let pmr: Box<dyn Pmr> = Box::new(PausingPmr {
                inner: SimPmr {
                    bytes: Rc::new(RefCell::new(vec![0u8; 16 << 10])),
                    disk: disk2.clone(),
                },
                armed: Arc::clone(&armed2),
                gate: gate2,
            });
            let own = LbioArray::new(Rc::clone(lbio0.engine()), LbioConfig::default()).unwrap();
            let j0 = Journal::with_rio(
                &set2,
                0,
                disk2.open(&lbio0).unwrap(),
                disk2.open(&own).unwrap(),
                pmr,
                OrderedConfig::default(),
            )
            .unwrap();
            // Area 0 frees block b (revokes it) and journals something else.
            let mut tx = Tx::new();
            tx.revoke(b);
            tx.write_meta(home + 5, &block_of(555)).unwrap();
            armed2.store(true, Ordering::SeqCst);
            let r = j0.commit(&tx);
            std::mem::forget(j0); // its drop would checkpoint an aborted set
            r.is_ok()
        });
        // Wait until the revoking commit has taken its id and is writing.
        {
            let (m, cv) = &*gate;
            let mut g = m.lock().unwrap();
            while !g.0 {
                g = cv.wait(g).unwrap();
            }
        }
        // Area 1 reuses block b for data without revoking it: refused while the revoke is in
        // flight (it used to be accepted and acknowledged).
        let mut tx = Tx::new();
        tx.write_data(b, &block_of(222)).unwrap();
        let unrevoked = j1.commit(&tx);
        // With its own revoke it goes through.
        let revoking = unrevoked.is_err().then(|| {
            tx.revoke(b);
            j1.commit(&tx)
        });
        // The power goes before the revoking commit is durable.
        disk.cut_power();
        {
            let (m, cv) = &*gate;
            m.lock().unwrap().1 = true;
            cv.notify_all();
        }
        let revoke_acked = a.join().unwrap();
        assert!(!revoke_acked, "the revoking commit was cut short");
        (unrevoked, revoking)
    });
    assert!(
        matches!(unrevoked, Err(JournalError::DataOverJournaledBlock { block }) if block == b),
        "an unrevoked in-place write over a block whose revoke is in flight: {unrevoked:?}"
    );
    revoking
        .expect("tried")
        .expect("the in-place write that revokes the block itself");
    let mut img = disk.media();
    let report = recover_image(&mut img, &layout).unwrap();
    assert_eq!(
        value_at(&img, b),
        222,
        "block {b}: the acknowledged in-place data was replaced by the revoked journaled copy \
         on recovery ({report:?})"
    );
}
