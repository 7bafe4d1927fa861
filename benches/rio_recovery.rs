//! How long recovery (Rio §4.4) takes to read a full attribute log: `scan` (decode and check
//! every slot) and `recover` (walk each stream's groups from the header's mark), on a 2 MiB log
//! (32,767 slots) in memory, every group durable, so the walk goes to the end.
//!
//! * `single`: one stream of single-write groups (one entry per group).
//! * `groups_of_4`: one stream of four-write groups.
//! * `streams_8`: eight streams of single-write groups, interleaved.
//!
//! Rio reports recovery of about 55 ms for its log; the walk here was quadratic in the entries
//! of a stream until 2026-11-28 (each group searched the whole stream).

use std::hint::black_box;

use aios::rio::{recover, scan, Attr, AttrLog, MemPmr};
use criterion::{criterion_group, criterion_main, Criterion};

const LOG_BYTES: usize = 2 << 20;

/// A full log: `streams` streams in turn, groups of `per_group` writes, every entry persisted.
fn full_log(streams: u16, per_group: u16) -> MemPmr {
    let mut log = AttrLog::format(MemPmr::new(LOG_BYTES), streams).expect("format");
    let slots = log.slots() as u64;
    let mut next = vec![1u64; streams as usize];
    let mut written = 0u64;
    'fill: loop {
        for s in 0..streams {
            let seq = next[s as usize];
            for k in 0..per_group {
                if written == slots {
                    break 'fill;
                }
                let a = Attr {
                    stream: s,
                    target: 0,
                    seq,
                    seq_end: seq,
                    prev: seq - 1,
                    offset: (written % 4096) * 4096,
                    len: 4096,
                    boundary: k + 1 == per_group,
                    num: if k + 1 == per_group { per_group } else { 0 },
                    members: 1,
                    ..Attr::default()
                };
                let slot = log.append(&a).expect("room: nothing is released");
                log.set_persist(slot, seq).expect("persist");
                written += 1;
            }
            next[s as usize] += 1;
        }
    }
    log.into_pmr()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("rio_recovery_2mib_log");
    g.sample_size(10);
    for (name, streams, per_group) in [("single", 1, 1), ("groups_of_4", 1, 4), ("streams_8", 8, 1)]
    {
        let pmr = full_log(streams, per_group);
        let entries = scan(&pmr).expect("scan").entries.len();
        let r = recover(&scan(&pmr).expect("scan"), &|_| true);
        let kept: usize = r.streams.iter().map(|s| s.kept.len()).sum();
        // The last group of each stream may be cut short by the log's end.
        assert!(
            kept + 4 * streams as usize >= entries,
            "{kept} of {entries} entries kept"
        );
        g.bench_function(name, |b| {
            b.iter(|| {
                let s = scan(black_box(&pmr)).expect("scan");
                black_box(recover(&s, &|_| true))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
