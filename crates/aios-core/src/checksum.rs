//! crc32c for short records.
//!
//! The layers above checksum many small records (a 64-byte Rio attribute entry on every
//! ordered write). The `crc32c` crate is built for long buffers: on 52 bytes its alignment
//! handling and three-way interleaving cost about 120 instructions (callgrind), where SSE 4.2's
//! `crc32` instruction needs one per 8 bytes. [`crc32c_short`] is that loop, with the crate as
//! the fallback on CPUs without SSE 4.2 and on other architectures. Both compute the same
//! Castagnoli CRC (initial value and final XOR all ones), so records written by one are read by
//! the other.

/// The crc32c of `data`, as `crc32c::crc32c` computes it; fastest for records up to a few
/// hundred bytes.
///
/// ```
/// let entry = [7u8; 52];
/// assert_eq!(aios_core::checksum::crc32c_short(&entry), crc32c::crc32c(&entry));
/// ```
#[inline]
pub fn crc32c_short(data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE 4.2, checked just above.
            return unsafe { sse42(data) };
        }
    }
    crc32c::crc32c(data)
}

/// [`crc32c_short`] for a record whose length is known when the caller is compiled (a fixed-size
/// entry): the loop is built for that length, without a loop counter or a tail test
/// (callgrind: 13 instructions instead of 58 for 52 bytes).
///
/// ```
/// let entry = [7u8; 52];
/// assert_eq!(aios_core::checksum::crc32c_array(&entry), crc32c::crc32c(&entry));
/// ```
#[inline]
pub fn crc32c_array<const N: usize>(data: &[u8; N]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU has SSE 4.2, checked just above.
            return unsafe { sse42(data) };
        }
    }
    crc32c::crc32c(data)
}

/// The SSE 4.2 loop: one `crc32` per 8 bytes, then one per byte left. Generic so that a fixed-size
/// record (`[u8; N]`) gets a copy compiled for its length.
///
/// # Safety
/// The CPU must have SSE 4.2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn sse42<T: AsRef<[u8]> + ?Sized>(data: &T) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u32, _mm_crc32_u64, _mm_crc32_u8};
    let mut c = u32::MAX as u64;
    let words = data.as_ref().chunks_exact(8);
    let tail = words.remainder();
    // (The intrinsics are safe to call in an SSE 4.2 function from Rust 1.87 on; the block keeps
    // the crate building on 1.85.)
    #[allow(unused_unsafe)]
    // SAFETY: this function runs only on CPUs with SSE 4.2 (its contract).
    unsafe {
        for w in words {
            c = _mm_crc32_u64(c, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let mut c = c as u32;
        // Four bytes at once (the instruction takes them low byte first, as four single-byte
        // steps would), then what is left.
        let mut tail = tail;
        if let Some((four, rest)) = tail.split_first_chunk::<4>() {
            c = _mm_crc32_u32(c, u32::from_le_bytes(*four));
            tail = rest;
        }
        for &b in tail {
            c = _mm_crc32_u8(c, b);
        }
        !c
    }
}

#[cfg(test)]
mod tests {
    use super::{crc32c_array, crc32c_short};

    #[test]
    fn the_fixed_length_form_agrees_with_the_crate() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let a0 = [0u8; 0];
        let a7: [u8; 7] = std::array::from_fn(|_| next());
        let a8: [u8; 8] = std::array::from_fn(|_| next());
        let a52: [u8; 52] = std::array::from_fn(|_| next());
        let a61: [u8; 61] = std::array::from_fn(|_| next());
        assert_eq!(crc32c_array(&a0), crc32c::crc32c(&a0));
        assert_eq!(crc32c_array(&a7), crc32c::crc32c(&a7));
        assert_eq!(crc32c_array(&a8), crc32c::crc32c(&a8));
        assert_eq!(crc32c_array(&a52), crc32c::crc32c(&a52));
        assert_eq!(crc32c_array(&a61), crc32c::crc32c(&a61));
        assert_eq!(crc32c_array(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn agrees_with_the_crate_at_every_length_and_alignment() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut data = vec![0u8; 300];
        for b in &mut data {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        for start in 0..8 {
            for len in 0..=data.len() - start {
                let d = &data[start..start + len];
                assert_eq!(
                    crc32c_short(d),
                    crc32c::crc32c(d),
                    "start {start} len {len}"
                );
            }
        }
        // The standard check value of CRC-32C.
        assert_eq!(crc32c_short(b"123456789"), 0xe306_9283);
    }
}
