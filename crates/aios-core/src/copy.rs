//! Copying pages out of the cache and into I/O buffers.
//!
//! A 4 KiB copy is most of what a page-cache hit costs once the page has left the CPU's
//! caches. For blocks of [`VECTOR_MIN`] bytes and more, on x86-64 CPUs with AVX2 (detected at
//! run time), [`copy`] moves 256 bytes per step through eight 32-byte registers, all loads of a
//! step before its stores; anything shorter, and every other CPU, goes to the platform's
//! `memcpy`.
//!
//! Why not always `memcpy`: on the 2 vCPU AMD EPYC VM this project is measured on, glibc's
//! `memcpy` for 4 KiB (`__memmove_avx512_unaligned_erms`) took 255–289 ns per page copied from
//! a random page of a 32 MiB buffer, the loop here 218–250 ns (three runs, one of them on
//! transparent huge pages); from 1 MiB 57 ns against 51 ns, from 4 MiB 73 ns against 62 ns (a
//! standalone C program timing 300,000 copies per figure, five rounds each). `cargo bench
//! --bench copy` times both on the machine at hand.

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
    #[cfg(target_arch = "x86_64")]
    {
        len >= VECTOR_MIN && std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = len;
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

    #[test]
    fn names_the_loop_it_uses() {
        assert_eq!(method(16), "memcpy");
        let big = method(4096);
        assert!(big == "avx2 loop" || big == "memcpy");
    }
}
