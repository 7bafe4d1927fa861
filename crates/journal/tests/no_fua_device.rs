//! A device whose writes do not honour FUA: a commit makes its data and journal blocks durable
//! with a FLUSH before the commit block, whatever durability the set chose (measured on another
//! device, or set by hand). The FUA flag was taken from the set alone, and the FLUSH skipped.

use std::cell::RefCell;
use std::rc::Rc;

use journal::{CommitMode, Durability, Journal, JournalSet, Layout, Tx};

mod common;
use common::lbio;

const DISK: u64 = 4 << 20;

/// RAM behind a backend that declares no FUA and records each request: (is a FLUSH, offset).
struct NoFua {
    mem: lbio::MemBackend,
    ops: Rc<RefCell<Vec<(bool, u64)>>>,
}

impl lbio::Backend for NoFua {
    fn caps(&self) -> lbio::Caps {
        lbio::Caps {
            fua: false,
            power_loss_protected: false,
            ..self.mem.caps()
        }
    }
    fn outcome_of(&self, payload: u64, res: i32, len: u32) -> lbio::Outcome {
        self.mem.outcome_of(payload, res, len)
    }
    unsafe fn start(
        &self,
        engine: &aios_core::Engine,
        sink: aios_core::SinkId,
        tag: u64,
        piece: &lbio::Piece,
    ) -> Result<lbio::Started, aios_core::CoreError> {
        match piece.op {
            lbio::Op::Flush => self.ops.borrow_mut().push((true, 0)),
            lbio::Op::Write => self.ops.borrow_mut().push((false, piece.offset)),
            _ => {}
        }
        // SAFETY: the caller's contract on `piece` is passed on unchanged.
        unsafe { self.mem.start(engine, sink, tag, piece) }
    }
}

#[test]
fn a_commit_on_a_device_without_fua_flushes_before_its_commit_block() {
    for mode in [CommitMode::Vanilla, CommitMode::Overlapped] {
        let lbio = lbio();
        let ops = Rc::new(RefCell::new(Vec::new()));
        let backend = || {
            Box::new(NoFua {
                mem: lbio::MemBackend::new(DISK as usize),
                ops: Rc::clone(&ops),
            })
        };
        let geometry = lbio::Geometry {
            capacity_bytes: DISK,
            logical_block: 512,
            mem_align: 512,
            offset_align: 512,
            max_transfer_bytes: 128 << 10,
        };
        let open =
            || lbio::Device::from_backends(&lbio, backend(), backend(), geometry, true).unwrap();
        let set = JournalSet::format(&open(), Layout::per_core(0, 64, 1)).unwrap();
        // As if measured on a device that honours FUA.
        set.set_durability(Durability::FuaWrites);
        let j = Journal::new(&set, 0, open(), mode).unwrap();
        let mut tx = Tx::new();
        tx.write_data(200, &[7; 4096]).unwrap();
        tx.write_meta(300, &[9; 4096]).unwrap();
        ops.borrow_mut().clear();
        j.commit(&tx).unwrap();
        let ops = ops.borrow().clone();
        // The commit block is the last write; a FLUSH must come between every write before it
        // and it.
        let last_write = ops.iter().rposition(|&(flush, _)| !flush).expect("writes");
        let before = &ops[..last_write];
        let last_flush = before.iter().rposition(|&(flush, _)| flush);
        let last_other_write = before.iter().rposition(|&(flush, _)| !flush);
        assert!(
            last_flush.is_some_and(|f| last_other_write.is_none_or(|w| f > w)),
            "{mode:?}: no FLUSH between the data and journal writes and the commit block: {ops:?}"
        );
    }
}
