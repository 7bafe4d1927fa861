//! Cache hints for hot paths.

/// Ask the CPU to bring the cache line holding `*r` close (into L1) ahead of its use. Only a
/// hint: it never faults and changes nothing a program can observe, so it is safe for any
/// reference. On targets without a prefetch instruction it does nothing.
#[inline(always)]
pub fn prefetch<T: ?Sized>(r: &T) {
    prefetch_ptr((r as *const T).cast::<u8>());
}

/// [`prefetch`] by address: any address, valid or not, is allowed (a prefetch never faults).
#[inline(always)]
pub fn prefetch_ptr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast())
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
