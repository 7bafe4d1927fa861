//! "Allocate at start, never on the hot path" (DESIGN.md) across a whole rio-net set-up: a
//! volume and two Rio targets over loopback TCP in one process, every thread counted.
//!
//! `tests/no_alloc.rs` counts only the thread that measures (its tests run in parallel); the
//! targets serve each connection on a thread of their own, so this file holds one test and
//! counts the allocations of every thread of the process while the requests run: the
//! initiator's, and each target's connection thread receiving commands, writing through its
//! ordered device, logging attributes, FLUSHing and answering.
//!
//! With `AIOS_ALLOC_TRACE=N` the stacks of the first N counted allocations are printed, to find
//! where they come from.

mod counting;
use counting::{allocations_during_all_threads, TempFile};

#[global_allocator]
static GLOBAL: counting::CountingAlloc = counting::CountingAlloc;

const BLOCK: usize = 4096;
const DEVICE_BYTES: usize = 4 << 20;

/// A volume striped over two targets: ordered writes, reads and orderless writes, 20,000
/// requests after a warm-up, with a `wait` (a FLUSH on each target) at the end. Neither the
/// initiator nor the targets allocate meanwhile.
#[test]
fn volume_and_targets_allocate_nothing() {
    use rio_net::{Done, Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};
    let mut files = Vec::new();
    let mut addrs = Vec::new();
    let mut stats = Vec::new();
    for t in 0..2 {
        let file = TempFile::new(&format!("net-target{t}"), DEVICE_BYTES);
        let mut cfg = TargetConfig::new(file.0.clone(), TargetLogKind::Mem(1 << 20));
        cfg.streams = 1;
        let target = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
        addrs.push(target.local_addr());
        stats.push(target.stats_handle());
        target.spawn();
        files.push(file);
    }
    let (mut v, _) = Volume::open(VolumeConfig::new(addrs, 1)).unwrap();
    let blocks = v.bytes() / BLOCK as u64;
    // Room for every request that can finish between two polls: handing one back frees its
    // room in the window, so that is not bounded by the window but by the buffers.
    let mut got: Vec<Done> = Vec::with_capacity(v.max_done());
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let (mut ops, mut back, mut last_seq) = (0u64, 0u64, 0u64);
    let mut take = |got: &mut Vec<Done>, back: &mut u64| {
        for d in got.drain(..) {
            d.result.expect("request");
            if d.seq != 0 {
                assert!(d.seq > last_seq, "ordered writes hand back in order");
                last_seq = d.seq;
            }
            *back += 1;
        }
    };
    let mut run = |n: u32, v: &mut Volume| {
        for i in 0..n {
            let mut buf = loop {
                if let Some(b) = v.alloc(BLOCK) {
                    break b;
                }
                v.poll_into(&mut got).unwrap();
                take(&mut got, &mut back);
            };
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % blocks) * BLOCK as u64;
            buf.fill(x as u8);
            match i % 8 {
                3 => v.read(0, off, buf).map(|_| ()),
                6 => v.write_orderless(0, off, buf).map(|_| ()),
                _ => v.submit(0, off, buf, true).map(|_| ()),
            }
            .unwrap();
            ops += 1;
            if i % 16 == 15 {
                v.poll_into(&mut got).unwrap();
                take(&mut got, &mut back);
            }
        }
        v.wait(0).unwrap();
        while back < ops {
            v.poll_into(&mut got).unwrap();
            take(&mut got, &mut back);
        }
    };
    // Warm-up: connections up, every list at its working size.
    run(5_000, &mut v);
    let before: Vec<_> = stats.iter().map(|s| s.stats()).collect();
    let ((), n) = allocations_during_all_threads(|| run(20_000, &mut v));
    let after: Vec<_> = stats.iter().map(|s| s.stats()).collect();
    let served: u64 = after
        .iter()
        .zip(&before)
        .map(|(a, b)| {
            (a.ordered_writes + a.orderless + a.reads) - (b.ordered_writes + b.orderless + b.reads)
        })
        .sum();
    assert!(served >= 20_000, "the targets served {served} requests");
    assert_eq!(
        n, 0,
        "{n} allocations on the initiator and target threads in 20,000 requests \
         (AIOS_ALLOC_TRACE=N prints where the first N come from)"
    );
}
