//! What a page-cache miss costs in software on top of the block layer, with no device in the
//! way: 4 KiB reads from a RAM device (`MemBackend`, which completes a request when it is
//! submitted), every one a miss, against raw lbio reading the same device.
//!
//! * `raw_lbio`: `Device::read_at_blocking` into one arena buffer.
//! * `aios_zero_copy`: `CacheHandle::get` (AIOS mode), guard dropped at once.
//! * `aios_copy_out`: `CacheHandle::read` (AIOS mode) into a 4 KiB user buffer.
//! * `vanilla_copy_out`: `CacheHandle::read` in vanilla mode (no pool, no lazy indexing, no
//!   fixed buffers), for the ablation.
//!
//! The reads walk a permutation of the device's 64 Ki blocks while the cache holds 256 frames,
//! so a page is long evicted before the walk comes back to it: every read misses (the bench
//! checks the cache's miss counter). Everything fits in the CPU's caches, so the differences are
//! instructions, not memory. The `ull` device figures (`aios bench pagecache`) add a real device
//! and the loop device's worker on another CPU.

use std::hint::black_box;
use std::rc::Rc;
use std::sync::Arc;

use aios::core::{Engine, EngineConfig};
use aios::lbio::{Device, LbioArray, LbioConfig};
use aios::pagecache::{CacheConfig, CacheHandle, FileId, Mode, PageCache, PAGE_BYTES};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const DEVICE_BYTES: usize = 256 << 20;
const CACHE_FRAMES: usize = 256;

fn engine() -> Rc<Engine> {
    Engine::new(EngineConfig {
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine")
}

/// Block `i` of a fixed permutation of `n` blocks (`n` a power of two: multiplying by an odd
/// number is a bijection modulo `n`).
fn permuted(i: u64, n: u64) -> u64 {
    i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & (n - 1)
}

struct CacheStack {
    cache: Arc<PageCache>,
    h: CacheHandle,
    file: FileId,
    _lbio: Rc<LbioArray>,
    _engine: Rc<Engine>,
}

fn cache_stack(mode: Mode) -> CacheStack {
    let cache = PageCache::new(CacheConfig {
        capacity_bytes: CACHE_FRAMES * PAGE_BYTES,
        readahead_pages: 0,
        huge_pages: false,
        ..CacheConfig::default()
    })
    .expect("page cache");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).expect("lbio array");
    let file = cache.add_file(DEVICE_BYTES as u64).expect("file");
    let h = CacheHandle::new(&cache, &engine, &lbio, mode).expect("cache handle");
    h.attach(
        file,
        Device::memory(&lbio, DEVICE_BYTES).expect("memory device"),
    )
    .expect("attach");
    CacheStack {
        cache,
        h,
        file,
        _lbio: lbio,
        _engine: engine,
    }
}

fn misses(c: &mut Criterion) {
    let blocks = (DEVICE_BYTES / PAGE_BYTES) as u64;
    let mut g = c.benchmark_group("pagecache_miss_4k");
    g.throughput(Throughput::Elements(1));

    {
        let engine = engine();
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).expect("lbio array");
        let dev = Device::memory(&lbio, DEVICE_BYTES).expect("memory device");
        let mut buf = Some(engine.try_alloc(PAGE_BYTES).expect("arena room"));
        let mut i = 0u64;
        g.bench_function("raw_lbio", |b| {
            b.iter(|| {
                let off = permuted(i, blocks) * PAGE_BYTES as u64;
                i += 1;
                let got = dev
                    .read_at_blocking(off, buf.take().expect("buffer"))
                    .expect("read");
                buf = Some(black_box(got));
            })
        });
    }

    for (name, mode, zero_copy) in [
        ("aios_zero_copy", Mode::AIOS, true),
        ("aios_copy_out", Mode::AIOS, false),
        ("vanilla_copy_out", Mode::VANILLA, false),
    ] {
        let s = cache_stack(mode);
        let mut user = vec![0u8; PAGE_BYTES];
        let mut i = 0u64;
        g.bench_function(name, |b| {
            b.iter(|| {
                let page = permuted(i, blocks);
                i += 1;
                if zero_copy {
                    let guard = s.h.get(s.file, page).expect("get");
                    black_box(&*guard);
                } else {
                    s.h.read(s.file, page * PAGE_BYTES as u64, &mut user)
                        .expect("read");
                    black_box(&user);
                }
            })
        });
        s.h.publish_metrics();
        let m = s.cache.metrics();
        eprintln!(
            "{name}: {} reads, {} hits ({:.3} % of reads)",
            m.hits + m.misses,
            m.hits,
            100.0 * m.hits as f64 / (m.hits + m.misses).max(1) as f64
        );
    }
    g.finish();
}

criterion_group!(benches, misses);
criterion_main!(benches);
