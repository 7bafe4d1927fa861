//! Helpers shared by the lab test programs (`nvme_lab`, `tcp_lab`, `rdma_lab`).

/// Position-dependent content: a misplaced or torn write cannot read back as right.
pub fn fill_pattern(buf: &mut [u8], device_offset: u64, seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let mut x = (device_offset + 8 * i as u64) ^ seed.rotate_left(40);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// `Ok` when `got` equals `want`; otherwise where they first differ.
#[allow(dead_code)] // not every lab program compares buffers
pub fn same(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(format!(
        "{what}: byte {first} differs ({} bytes compared)",
        want.len()
    ))
}
