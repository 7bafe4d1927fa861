//! 4 KiB copies out of a random page of a buffer: the platform's `memcpy` (`copy_from_slice`)
//! against `aios::core::copy::copy`, the routine the page cache copies hits out with. Two
//! buffer sizes: 1 MiB (stays in a core's L2 on most CPUs) and 32 MiB (as large as a whole L3 or
//! more: the copy waits for memory). Source and destination start on page boundaries, as page
//! frames and I/O buffers do.

use std::hint::black_box;
use std::time::Duration;

use aios::core::copy;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const PAGE: usize = 4096;

/// `len` bytes starting on a page boundary (inside a larger vector).
struct Aligned {
    bytes: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let bytes: Vec<u8> = (0..len + PAGE).map(|i| i as u8).collect();
        let at = bytes.as_ptr().align_offset(PAGE);
        Aligned { bytes, at, len }
    }
    fn get(&self) -> &[u8] {
        &self.bytes[self.at..self.at + self.len]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.at..self.at + self.len]
    }
}

fn pages(c: &mut Criterion) {
    let mut g = c.benchmark_group("copy_4k_random_page");
    g.throughput(Throughput::Bytes(PAGE as u64));
    for (name, size) in [("1MiB", 1usize << 20), ("32MiB", 32 << 20)] {
        let src = Aligned::new(size);
        let mut dst = Aligned::new(PAGE);
        let n = (size / PAGE) as u64;
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x % n) as usize) * PAGE
        };
        g.bench_function(format!("memcpy/{name}"), |b| {
            b.iter(|| {
                let at = next();
                dst.get_mut().copy_from_slice(&src.get()[at..at + PAGE]);
                black_box(dst.get()[0]);
            })
        });
        g.bench_function(format!("aios_copy/{name}"), |b| {
            b.iter(|| {
                let at = next();
                copy::copy(dst.get_mut(), &src.get()[at..at + PAGE]);
                black_box(dst.get()[0]);
            })
        });
    }
    g.finish();
    eprintln!("aios copy of 4 KiB on this CPU: {}", copy::method(PAGE));
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! {
    name = benches;
    config = config();
    targets = pages
}
criterion_main!(benches);
