//! The cost of one `io_uring_enter` round trip: a NOP submitted and its completion waited for
//! in the same call, on a ring entered by its registered index (`IORING_REGISTER_RING_FDS`, the
//! engine's default) and, side by side in the same run, on one entered by its descriptor
//! (`EngineConfig::register_ring_fd: false`). The difference is the kernel's descriptor lookup
//! per call.

use std::cell::Cell;
use std::rc::{Rc, Weak};

use aios::core::{nop_sqe, CompletionMode, CompletionSink, Engine, EngineConfig, RingKind};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

struct Count(Cell<u64>);
impl CompletionSink for Count {
    fn complete(&self, _payload: u64, result: i32, _flags: u32) {
        assert_eq!(result, 0, "a NOP completes with 0");
        self.0.set(self.0.get() + 1);
    }
}

fn round_trips(c: &mut Criterion) {
    let mut g = c.benchmark_group("nop_round_trip");
    g.throughput(Throughput::Elements(1));
    for registered in [true, false] {
        let engine = Engine::new(EngineConfig {
            arena_bytes: 64 << 10,
            huge_pages: false,
            completion: CompletionMode::Wait,
            register_ring_fd: registered,
            ..EngineConfig::default()
        })
        .expect("engine");
        let applied = engine.ring_setup().applied.contains(&"REGISTERED_RING_FD");
        if registered && !applied {
            eprintln!(
                "registered ring descriptor refused ({:?}): skipping that case",
                engine.ring_setup().dropped
            );
            continue;
        }
        let sink = Rc::new(Count(Cell::new(0)));
        let weak: Weak<dyn CompletionSink> = Rc::downgrade(&sink) as Weak<dyn CompletionSink>;
        let id = engine.register_sink(weak).expect("sink");
        let name = if registered {
            "registered_index"
        } else {
            "descriptor"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                // SAFETY: a NOP refers to no memory.
                unsafe {
                    engine
                        .push(RingKind::Main, id, 0, nop_sqe())
                        .expect("ring room")
                };
                engine.wait(1).expect("wait");
            })
        });
        let m = engine.metrics();
        eprintln!(
            "{name}: {} NOPs in {} io_uring_enter calls",
            sink.0.get(),
            m.enters
        );
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(30)
        .measurement_time(std::time::Duration::from_secs(3))
        .warm_up_time(std::time::Duration::from_millis(500))
}

criterion_group! {
    name = benches;
    config = config();
    targets = round_trips
}
criterion_main!(benches);
