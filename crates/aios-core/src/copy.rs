//! Copying pages out of the cache and into I/O buffers.
//!
//! A 4 KiB copy is most of what a page-cache hit costs once the page has left the CPU's
//! caches. For blocks of [`VECTOR_MIN`] bytes and more, on x86-64 CPUs with AVX2 (detected at
//! run time), [`copy`] can move 256 bytes per step through eight 32-byte registers, all loads
//! of a step before its stores; anything shorter, and every other CPU, goes to the platform's
//! `memcpy`.
//!
//! Which of the two is faster depends on the machine. On the 2 vCPU AMD EPYC VM this project
//! is measured on, glibc's `memcpy` for 4 KiB (`__memmove_avx512_unaligned_erms`) took 255–289
//! ns per page copied from a random page of a 32 MiB buffer, the loop here 218–250 ns (three
//! runs, one of them on transparent huge pages); from 1 MiB 57 ns against 51 ns, from 4 MiB 73
//! ns against 62 ns (a standalone C program timing 300,000 copies per figure, five rounds
//! each). On a 2 vCPU Intel Xeon VM it was the other way round: `cargo bench --bench copy`
//! gave `memcpy` 186.9 ns against the loop's 213.0 ns from 32 MiB, and 38.7 against 41.0 ns
//! from 1 MiB. So [`calibrate`] times both on the machine at hand, once per process, and
//! [`copy`] uses the faster from then on (the loop until then). The page cache calibrates
//! when it is created.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Blocks from this many bytes up take the vector loop (where the CPU has one).
pub const VECTOR_MIN: usize = 1024;

/// Copy `src` into `dst` (equal lengths; panics otherwise, like `copy_from_slice`).
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy: destination and source lengths differ"
    );
    // SAFETY: both slices are valid for `len` bytes, and a `&mut` cannot overlap a `&`.
    unsafe { copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// [`copy`] between raw pointers (for memory the caller owns through other means, such as a
/// page-cache frame pinned or re-validated around the copy).
///
/// # Safety
///
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes of `len`
/// bytes, and the two ranges do not overlap.
#[inline]
pub unsafe fn copy_nonoverlapping(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if vector_loop(len) {
        // SAFETY: the caller's promise, and AVX2 is present.
        unsafe { copy_avx2(src, dst, len) };
        return;
    }
    // SAFETY: the caller's promise.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Whether blocks of [`VECTOR_MIN`] bytes and more go to the platform's `memcpy` (set by
/// [`calibrate`] when it measured that faster).
static PLATFORM_FASTER: AtomicBool = AtomicBool::new(false);

/// What [`calibrate`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// Nanoseconds per 4 KiB copy from a random page of a [`CALIBRATION_BYTES`] buffer, the
    /// fastest round's mean: the vector loop (`None` where the CPU has none) and the
    /// platform's `memcpy` (`None` where there was no choice to make).
    pub loop_ns: Option<f64>,
    pub memcpy_ns: Option<f64>,
    /// Whether [`copy`] now takes the vector loop for blocks of [`VECTOR_MIN`] bytes and more.
    pub vector_loop: bool,
}

/// The buffer [`calibrate`] copies from: larger than a core's L2 on the machines measured, so
/// the copies wait for the farther caches or memory, as hits on a large hot set do.
pub const CALIBRATION_BYTES: usize = 8 << 20;

static CALIBRATION: OnceLock<Calibration> = OnceLock::new();

/// Time the vector loop against the platform's `memcpy` (an untimed pass, then nine alternating
/// rounds of 2,048 copies of 4 KiB each, from random pages of a [`CALIBRATION_BYTES`] buffer
/// into one page) and make [`copy`] use the faster. Runs once per process (a few milliseconds,
/// most of it touching the buffer); later calls return the first result. Without AVX2 there is
/// nothing to choose and nothing is measured.
pub fn calibrate() -> Calibration {
    *CALIBRATION.get_or_init(measure)
}

/// The result of [`calibrate`], if it has run in this process.
pub fn calibration() -> Option<Calibration> {
    CALIBRATION.get().copied()
}

fn measure() -> Calibration {
    if !avx2() {
        return Calibration {
            loop_ns: None,
            memcpy_ns: None,
            vector_loop: false,
        };
    }
    const PAGE: usize = 4096;
    const COPIES: usize = 2048;
    const ROUNDS: usize = 9;
    // Page-aligned source and destination, as frames and I/O buffers are.
    let src: Vec<u8> = (0..CALIBRATION_BYTES + PAGE).map(|i| i as u8).collect();
    let s0 = src.as_ptr().align_offset(PAGE);
    let mut dst = vec![0u8; 2 * PAGE];
    let d0 = dst.as_ptr().align_offset(PAGE);
    let pages = (CALIBRATION_BYTES / PAGE) as u64;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut offsets: Vec<usize> = (0..COPIES)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s0 + (x % pages) as usize * PAGE
        })
        .collect();
    let mut time = |vector: bool, offsets: &[usize]| -> f64 {
        let d = dst[d0..d0 + PAGE].as_mut_ptr();
        let t = Instant::now();
        for &at in offsets {
            let s = src[at..at + PAGE].as_ptr();
            // SAFETY: `s` and `d` are valid for a page each and lie in different vectors.
            unsafe {
                if vector {
                    #[cfg(target_arch = "x86_64")]
                    copy_avx2(s, d, PAGE);
                } else {
                    std::ptr::copy_nonoverlapping(s, d, PAGE);
                }
            }
            std::hint::black_box(d);
        }
        t.elapsed().as_nanos() as f64 / offsets.len() as f64
    };
    // One untimed pass each first: the buffer was just written, and the first copies from it
    // pay for bringing its translations and lines in.
    time(true, &offsets);
    time(false, &offsets);
    let (mut lp, mut mc) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // A fresh order each round, and each method first in turn.
        offsets.rotate_left(COPIES / ROUNDS);
        for vector in [round % 2 == 0, round % 2 != 0] {
            let ns = time(vector, &offsets);
            if vector {
                lp.push(ns);
            } else {
                mc.push(ns);
            }
        }
    }
    // The fastest round of each: interruptions and a busy neighbour only ever add time.
    let fastest = |v: Vec<f64>| v.into_iter().fold(f64::INFINITY, f64::min);
    let (loop_ns, memcpy_ns) = (fastest(lp), fastest(mc));
    let vector_loop = loop_ns <= memcpy_ns;
    PLATFORM_FASTER.store(!vector_loop, Ordering::Relaxed);
    Calibration {
        loop_ns: Some(loop_ns),
        memcpy_ns: Some(memcpy_ns),
        vector_loop,
    }
}

/// Which loop [`copy`] uses for a block of `len` bytes on this CPU (for reports).
pub fn method(len: usize) -> &'static str {
    if vector_loop(len) {
        "avx2 loop"
    } else {
        "memcpy"
    }
}

/// Whether a block of `len` bytes takes the vector loop on this CPU (the feature test is a
/// cached load after the first call).
#[inline]
fn vector_loop(len: usize) -> bool {
    len >= VECTOR_MIN && !PLATFORM_FASTER.load(Ordering::Relaxed) && avx2()
}

#[inline]
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// 256 bytes per step (eight unaligned 32-byte loads, then eight stores), then 32-byte steps,
/// then the platform copy for the last bytes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    const STEP: usize = 256;
    const V: usize = 32;
    let mut at = 0;
    // SAFETY (every block below): `at + STEP <= len` (or `at + V <= len`), so each access is
    // inside the ranges the caller vouched for; the loads and stores are unaligned ones.
    while at + STEP <= len {
        unsafe {
            let s = src.add(at);
            let d = dst.add(at);
            let r0 = _mm256_loadu_si256(s.cast::<__m256i>());
            let r1 = _mm256_loadu_si256(s.add(V).cast::<__m256i>());
            let r2 = _mm256_loadu_si256(s.add(2 * V).cast::<__m256i>());
            let r3 = _mm256_loadu_si256(s.add(3 * V).cast::<__m256i>());
            let r4 = _mm256_loadu_si256(s.add(4 * V).cast::<__m256i>());
            let r5 = _mm256_loadu_si256(s.add(5 * V).cast::<__m256i>());
            let r6 = _mm256_loadu_si256(s.add(6 * V).cast::<__m256i>());
            let r7 = _mm256_loadu_si256(s.add(7 * V).cast::<__m256i>());
            _mm256_storeu_si256(d.cast::<__m256i>(), r0);
            _mm256_storeu_si256(d.add(V).cast::<__m256i>(), r1);
            _mm256_storeu_si256(d.add(2 * V).cast::<__m256i>(), r2);
            _mm256_storeu_si256(d.add(3 * V).cast::<__m256i>(), r3);
            _mm256_storeu_si256(d.add(4 * V).cast::<__m256i>(), r4);
            _mm256_storeu_si256(d.add(5 * V).cast::<__m256i>(), r5);
            _mm256_storeu_si256(d.add(6 * V).cast::<__m256i>(), r6);
            _mm256_storeu_si256(d.add(7 * V).cast::<__m256i>(), r7);
        }
        at += STEP;
    }
    while at + V <= len {
        unsafe {
            let r = _mm256_loadu_si256(src.add(at).cast::<__m256i>());
            _mm256_storeu_si256(dst.add(at).cast::<__m256i>(), r);
        }
        at += V;
    }
    if at < len {
        // SAFETY: the remaining `len - at` bytes of both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the thresholds and step sizes, at every source and destination
    /// misalignment within a vector, copies exactly its bytes and touches nothing around them.
    #[test]
    fn copies_exactly_the_bytes_at_every_length_and_alignment() {
        let lens = [
            0, 1, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 1056, 1279, 1280, 4095, 4096, 4097,
            8192, 12_345,
        ];
        let src: Vec<u8> = (0..16_384 + 64).map(|i| (i * 7 + 3) as u8).collect();
        for &len in &lens {
            for so in [0, 1, 7, 31] {
                for d_off in [0, 3, 32] {
                    let mut dst = vec![0xeeu8; len + 96];
                    let s = &src[so..so + len];
                    copy(&mut dst[d_off..d_off + len], s);
                    // The vector loop itself, whichever way a calibration chose.
                    #[cfg(target_arch = "x86_64")]
                    if avx2() {
                        dst.fill(0xee);
                        // SAFETY: `s` and the destination range are `len` bytes of two vectors.
                        unsafe { copy_avx2(s.as_ptr(), dst[d_off..].as_mut_ptr(), len) };
                    }
                    assert_eq!(
                        &dst[d_off..d_off + len],
                        s,
                        "len {len} src+{so} dst+{d_off}"
                    );
                    assert!(
                        dst[..d_off].iter().all(|&b| b == 0xee),
                        "bytes before, len {len}"
                    );
                    assert!(
                        dst[d_off + len..].iter().all(|&b| b == 0xee),
                        "bytes after, len {len}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn unequal_lengths_panic() {
        let mut d = [0u8; 8];
        copy(&mut d, &[1u8; 9]);
    }

    /// A calibration measures both ways where there is a choice, picks the faster, is done
    /// once, and `copy` (and the name `method` reports) follow it.
    #[test]
    fn calibration_picks_the_faster_and_copy_follows() {
        let c = calibrate();
        assert_eq!(calibrate(), c, "a second call returns the first result");
        assert_eq!(calibration(), Some(c));
        match (c.loop_ns, c.memcpy_ns) {
            (Some(l), Some(m)) => {
                assert!(l > 0.0 && m > 0.0);
                assert_eq!(c.vector_loop, l <= m);
            }
            (None, None) => assert!(!c.vector_loop && !avx2()),
            other => panic!("one method measured: {other:?}"),
        }
        let want = if c.vector_loop { "avx2 loop" } else { "memcpy" };
        assert_eq!(method(4096), want);
        let src: Vec<u8> = (0..4096).map(|i| (i * 13) as u8).collect();
        let mut dst = vec![0u8; 4096];
        copy(&mut dst, &src);
        assert_eq!(dst, src);
    }

    #[test]
    fn names_the_loop_it_uses() {
        assert_eq!(method(16), "memcpy");
        let big = method(4096);
        assert!(big == "avx2 loop" || big == "memcpy");
    }
}
