//! lbio's own software cost: submit + complete through the slot array on `MemBackend`, batches
//! of 32 plugged into one submission, on one core. With `AIOS_BENCH_DEVICE=/path` it also times
//! QD1 4 KiB random reads on that device: a block device, a file, or an NVMe passthrough
//! character device (`AIOS_BENCH_DEVICE=/dev/ng0n1`, driven with raw NVMe commands).

use std::hint::black_box;
use std::rc::Rc;

use aios::core::{Engine, EngineConfig, FixedBuf};
use aios::lbio::{Device, DeviceConfig, Io, LbioArray, LbioConfig};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

const BATCH: usize = 32;
const SLOTS: u32 = 1024;
/// Small enough to stay in cache: the bench measures software cost, not DRAM.
const MEM_BYTES: usize = 1 << 20;

fn stack() -> (Rc<Engine>, Rc<LbioArray>) {
    let engine = Engine::new(EngineConfig {
        arena_bytes: 4 << 20,
        ..EngineConfig::default()
    })
    .expect("engine");
    let lbio = LbioArray::new(
        Rc::clone(&engine),
        LbioConfig {
            slots: SLOTS,
            ..LbioConfig::default()
        },
    )
    .expect("lbio array");
    (engine, lbio)
}

fn mem_batches(c: &mut Criterion) {
    eprintln!(
        "lbio static memory for {SLOTS} slots: {} bytes ({:.1} KiB; AIOS Table 2: 192 KiB per core)",
        LbioArray::static_bytes(SLOTS),
        LbioArray::static_bytes(SLOTS) as f64 / 1024.0
    );
    let mut g = c.benchmark_group("lbio_mem_submit_complete");
    for bs in [512usize, 4096] {
        let (engine, lbio) = stack();
        let dev = Device::memory(&lbio, MEM_BYTES).expect("memory device");
        let mut bufs: Vec<FixedBuf> = (0..BATCH)
            .map(|_| {
                let mut b = engine.try_alloc(bs).expect("arena room");
                b.set_len(bs).expect("fits");
                b
            })
            .collect();
        let blocks = MEM_BYTES as u64 / bs as u64;
        let mut x: u64 = 0x9e37_79b9;
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_with_input(BenchmarkId::new("batch32", bs), &bs, |b, _| {
            b.iter(|| {
                engine.hold_submissions(|| {
                    for buf in bufs.drain(..) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let off = (x % blocks) * bs as u64;
                        let io = if x & 1 == 0 {
                            Io::read(off, buf)
                        } else {
                            Io::write(off, buf)
                        };
                        dev.submit(io).expect("slot available");
                    }
                });
                while let Some(done) = lbio.take_done() {
                    black_box(done.result.expect("memory I/O succeeds"));
                    bufs.push(done.buf.expect("data request"));
                }
                assert_eq!(bufs.len(), BATCH);
            })
        });
    }
    g.finish();
}

fn device_qd1(c: &mut Criterion) {
    let Ok(path) = std::env::var("AIOS_BENCH_DEVICE") else {
        eprintln!("AIOS_BENCH_DEVICE not set: skipping the device benchmark");
        return;
    };
    let passthrough = aios::core::nvme::is_passthrough_device(path.as_ref());
    let engine = Engine::new(EngineConfig {
        arena_bytes: 4 << 20,
        passthrough,
        ..EngineConfig::default()
    })
    .expect("engine");
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).expect("lbio array");
    let dev = Device::open(&lbio, path.as_ref(), DeviceConfig::default()).expect("open device");
    eprintln!("{path}: critical route {:?}", dev.critical_route());
    let blocks = dev.geometry().capacity_bytes / 4096;
    let mut buf = Some(engine.try_alloc(4096).expect("arena room"));
    let mut x: u64 = 0x1234_5678;
    c.bench_function("device_qd1_randread_4k", |b| {
        b.iter(|| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % blocks) * 4096;
            let got = dev
                .read_at_blocking(off, buf.take().expect("buffer"))
                .expect("read");
            buf = Some(got);
        })
    });
}

criterion_group!(benches, mem_batches, device_qd1);
criterion_main!(benches);
