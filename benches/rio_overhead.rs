//! What Rio's ordering costs in software per write, with no device in the way: 4 KiB writes to
//! a RAM device (`MemBackend`, which completes a request when it is submitted, and has a
//! volatile write cache: writes become durable at a FLUSH), 32 in flight, at random offsets
//! in 4 MiB (the copy into the device stays in the CPU caches: the bench times software, not
//! memory bandwidth).
//!
//! * `orderless`: `Device::submit` and `LbioArray::take_done`, nothing else.
//! * `rio`: `OrderedDevice::submit` (each write its own group, ordered after the one before;
//!   attribute log on an emulated 2 MiB PMR, as `aios bench ordered` runs it) and
//!   `wait_progress_into` (completions handed back in order), with the default settings
//!   (background FLUSH every 4,096 completed writes).
//!
//! The difference is the sequencer, the log entry, the ORDER queue, in-order completion and
//! durability bookkeeping per write. `aios bench ordered` measures the same against a real
//! device, where the kernel's share of each write is the larger part.

use std::hint::black_box;
use std::rc::Rc;
use std::time::{Duration, Instant};

use aios::core::{Engine, EngineConfig, FixedBuf};
use aios::lbio::{Device, Io, LbioArray, LbioConfig};
use aios::rio::{AttrLog, MemPmr, OrderedConfig, OrderedDevice, Write};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const DEVICE_BYTES: usize = 4 << 20;
const BS: usize = 4096;
const QD: usize = 32;
const PMR_BYTES: usize = 2 << 20;

fn stack() -> (Rc<Engine>, Rc<LbioArray>, Device, Vec<FixedBuf>) {
    let engine = Engine::new(EngineConfig {
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine");
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).expect("lbio array");
    let dev = Device::memory(&lbio, DEVICE_BYTES).expect("memory device");
    let bufs = (0..QD)
        .map(|i| {
            let mut b = engine.try_alloc(BS).expect("arena room");
            b.fill(i as u8 | 1);
            b
        })
        .collect();
    (engine, lbio, dev, bufs)
}

/// Block offsets in a fixed pseudo-random order.
fn offset(i: u64) -> u64 {
    let blocks = (DEVICE_BYTES / BS) as u64;
    (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & (blocks - 1)) * BS as u64
}

/// Wait for a completion, and take every finished write's buffer back.
fn reap(lbio: &LbioArray, free: &mut Vec<FixedBuf>) {
    lbio.wait_done(1).expect("wait");
    while let Some(c) = lbio.take_done() {
        c.result.expect("write");
        free.push(c.buf.expect("a write returns its buffer"));
    }
}

fn writes(c: &mut Criterion) {
    let mut g = c.benchmark_group("ordered_write_4k");
    g.throughput(Throughput::Elements(1));

    {
        let (_engine, lbio, dev, mut free) = stack();
        let mut i = 0u64;
        g.bench_function("orderless", |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    if free.is_empty() {
                        reap(&lbio, &mut free);
                    }
                    let buf = free.pop().expect("a free buffer");
                    i += 1;
                    black_box(dev.submit(Io::write(offset(i), buf)).map_err(|(e, _)| e))
                        .expect("submit");
                }
                t.elapsed()
            })
        });
        // Take the last completions back before the device goes.
        while free.len() < QD {
            reap(&lbio, &mut free);
        }
    }

    {
        let (_engine, lbio, dev, mut free) = stack();
        let log = AttrLog::format(MemPmr::new(PMR_BYTES), 1).expect("log");
        let mut od = OrderedDevice::new(lbio, vec![dev], log, &[1], OrderedConfig::default())
            .expect("ordered device");
        let mut got = Vec::with_capacity(QD);
        let mut i = 0u64;
        g.bench_function("rio", |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                for _ in 0..iters {
                    while free.is_empty() {
                        od.wait_progress_into(&mut got).expect("wait");
                        for d in got.drain(..) {
                            d.result.expect("write");
                            free.push(d.buf);
                        }
                    }
                    let buf = free.pop().expect("a free buffer");
                    i += 1;
                    let w = Write {
                        target: 0,
                        offset: offset(i),
                        buf,
                        ipu: false,
                    };
                    black_box(od.submit(0, w, true)).expect("submit");
                }
                t.elapsed()
            })
        });
        od.wait(0).expect("wait");
        let st = od.stats();
        eprintln!(
            "rio: {} writes, {} device commands, {} FLUSHes ({} in the background), {} waits on a full log",
            st.requests, st.device_cmds, st.flushes, st.flushes_ahead, st.log_full_waits
        );
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = writes
}
criterion_main!(benches);
