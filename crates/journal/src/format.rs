//! The on-disk format: a superblock per journal area, then a circular log of 4 KiB blocks.
//!
//! A transaction in the log is one or more descriptor blocks, each followed by the metadata
//! blocks it tags, then revoke blocks, then one commit block. Every descriptor, revoke and commit
//! block starts with a 32-byte header and ends with a crc32c of the rest of the block; each tag
//! carries the crc32c of its metadata block; the commit block carries the transaction's block
//! count and a crc32c chained over all of its blocks. All integers are little-endian.
//!
//! ```text
//! superblock   0 magic "AIOSJSB\x01" · 8 version · 12 block size · 16 area blocks · 24 area index
//!              28 area count · 32 tail position · 40 tail tid · 48 generation · 508 crc32c
//!              (all in the first 512-byte sector, so a torn write keeps the old or the new one)
//! log header   0 magic · 4 kind (1 descriptor, 2 revoke, 3 commit) · 8 tid · 16 area · 20 count
//!              24 flags · 28 file · 32.. payload · 4092 crc32c
//! descriptor   payload: `count` tags of 16 bytes: home block (u64), crc32c of the block (u32),
//!              tag flags (u32: `TAG_ESCAPED`)
//! revoke       payload: `count` home blocks (u64)
//! commit       payload: 32 blocks in the transaction before the commit (u32) · 36 chained crc32c
//! ```

/// Journal block size (and the unit of home block numbers).
pub const BLOCK: usize = 4096;
pub const SB_MAGIC: [u8; 8] = *b"AIOSJSB\x01";
pub const LOG_MAGIC: u32 = 0x4a53_4941;
pub const VERSION: u32 = 1;
pub const HEADER: usize = 32;
pub const CRC_AT: usize = BLOCK - 4;
/// Tags one descriptor block holds.
pub const TAGS_PER_DESC: usize = (CRC_AT - HEADER) / 16;
/// Block numbers one revoke block holds.
pub const REVOKES_PER_BLOCK: usize = (CRC_AT - HEADER) / 8;
/// Descriptor flag: a file-level transaction (it carries one file's metadata only).
pub const FLAG_FILE_TX: u32 = 1;
/// On a commit block: the transaction went out as Rio-ordered writes, without a FLUSH between
/// its journal blocks and this block; the 8 bytes after the chained checksum hold the Rio group
/// of this block on the area's stream, and recovery keeps the transaction only when the
/// attribute log shows that group durable.
pub const FLAG_RIO: u32 = 2;
/// On a commit block: a one-write commit ([`crate::CommitMode::OneWrite`]). The block went to
/// the device in the same write as the transaction's other log blocks, which hold the data
/// blocks too, so only the chained checksum tells a whole transaction from a torn one. An intact
/// one-write commit block over contents that fail the checksum is therefore a torn tail, not
/// evidence of damage.
pub const FLAG_ONE_WRITE: u32 = 4;
/// Tag flag: the block starts with the log magic, and the log holds it with those four bytes
/// zeroed, so that no journaled block (a file's data in a one-write commit, a copy of a journal
/// image) is ever read as a log block of its own: by the scan for later commits, or as a
/// transaction where the log restarts after a checkpoint. Recovery puts the magic back. The
/// tag's checksum is the block's as given (an older build, which does not know the flag, finds
/// it wrong and reports damage rather than replay the zeroed bytes); the commit block's chained
/// checksum covers the bytes the log holds.
pub const TAG_ESCAPED: u32 = 1;
/// The superblock's checksum covers its first sector up to here.
pub const SB_CRC_AT: usize = 508;
/// The largest transaction id a log block or superblock may carry. Ids start at 1 and grow by one
/// per commit, so a larger one can only come from damaged or crafted bytes: such a block is not
/// taken for a transaction (and an id one past it still fits a `u64`).
pub const MAX_TID: u64 = u64::MAX >> 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Descriptor = 1,
    Revoke = 2,
    Commit = 3,
}

pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Chain `bytes` into a running transaction checksum.
pub fn crc_chain(seed: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(seed, bytes)
}

/// `crc_chain(seed, block)` for a whole [`BLOCK`]-byte block whose own crc32c (`crc(block)`)
/// is already known, without another pass over its bytes.
///
/// The CRC register is linear over GF(2): running it over a block from state `s` ends in
/// `M(s) ^ R`, where `M` moves a state past `BLOCK` zero bytes and `R` depends on the bytes
/// alone. Hence `crc32c_append(seed, block) == M(seed) ^ crc32c(block)`, and `M` of a 32-bit
/// value is four lookups in tables built once from `M` of each single bit.
pub fn chain_block(seed: u32, block_crc: u32) -> u32 {
    let t = block_shift();
    let b = seed.to_le_bytes();
    t[0][b[0] as usize]
        ^ t[1][b[1] as usize]
        ^ t[2][b[2] as usize]
        ^ t[3][b[3] as usize]
        ^ block_crc
}

/// `M` (see [`chain_block`]) as four tables, one per byte of the state.
fn block_shift() -> &'static [[u32; 256]; 4] {
    static SHIFT: std::sync::OnceLock<[[u32; 256]; 4]> = std::sync::OnceLock::new();
    SHIFT.get_or_init(|| {
        let zeros = [0u8; BLOCK];
        // `crc32c_append` inverts the state on the way in and out; undo both to get `M(e_i)`.
        let bit: [u32; 32] = std::array::from_fn(|i| !crc32c::crc32c_append(!(1u32 << i), &zeros));
        let mut t = [[0u32; 256]; 4];
        for (k, table) in t.iter_mut().enumerate() {
            for (v, out) in table.iter_mut().enumerate() {
                *out = (0..8)
                    .filter(|j| v >> j & 1 == 1)
                    .fold(0, |acc, j| acc ^ bit[8 * k + j]);
            }
        }
        t
    })
}

/// `crc(block)` of a block [`seal`] has just sealed, from the checksum it wrote (the last four
/// bytes are the only ones left to run over).
pub fn sealed_crc(block: &[u8]) -> u32 {
    crc32c::crc32c_append(get_u32(block, CRC_AT), &block[CRC_AT..])
}

pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
pub fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Write the block's trailing checksum.
pub fn seal(block: &mut [u8]) {
    let c = crc(&block[..CRC_AT]);
    put_u32(block, CRC_AT, c);
}

fn sealed(block: &[u8]) -> bool {
    block.len() == BLOCK && get_u32(block, CRC_AT) == crc(&block[..CRC_AT])
}

/// One area's superblock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub area_blocks: u64,
    pub area_index: u32,
    pub area_count: u32,
    /// Log position (0-based, in blocks after the superblock) of the oldest live transaction.
    pub tail_pos: u64,
    /// No live transaction in the log has a smaller id.
    pub tail_tid: u64,
    pub generation: u64,
}

impl Superblock {
    pub fn encode(&self, b: &mut [u8]) {
        b.fill(0);
        b[..8].copy_from_slice(&SB_MAGIC);
        put_u32(b, 8, VERSION);
        put_u32(b, 12, BLOCK as u32);
        put_u64(b, 16, self.area_blocks);
        put_u32(b, 24, self.area_index);
        put_u32(b, 28, self.area_count);
        put_u64(b, 32, self.tail_pos);
        put_u64(b, 40, self.tail_tid);
        put_u64(b, 48, self.generation);
        let c = crc(&b[..SB_CRC_AT]);
        put_u32(b, SB_CRC_AT, c);
    }

    /// Decode and check a superblock; the error says what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() != BLOCK {
            return Err(format!("{} bytes, not one {BLOCK}-byte block", b.len()));
        }
        if b[..8] != SB_MAGIC {
            return Err("no journal superblock magic (not formatted, or overwritten)".into());
        }
        if get_u32(b, SB_CRC_AT) != crc(&b[..SB_CRC_AT]) {
            return Err("checksum mismatch".into());
        }
        let version = get_u32(b, 8);
        if version != VERSION {
            return Err(format!(
                "format version {version}, this build reads {VERSION}"
            ));
        }
        let bs = get_u32(b, 12);
        if bs as usize != BLOCK {
            return Err(format!("block size {bs}, expected {BLOCK}"));
        }
        let sb = Superblock {
            area_blocks: get_u64(b, 16),
            area_index: get_u32(b, 24),
            area_count: get_u32(b, 28),
            tail_pos: get_u64(b, 32),
            tail_tid: get_u64(b, 40),
            generation: get_u64(b, 48),
        };
        if sb.tail_tid > MAX_TID {
            return Err(format!(
                "tail transaction id {} past the largest a journal uses ({MAX_TID})",
                sb.tail_tid
            ));
        }
        // Generations start at 1 and grow by one per checkpoint or recovery, which write the
        // next one: a larger one is damage, and its successor must still fit.
        if sb.generation > MAX_TID {
            return Err(format!(
                "generation {} past the largest a journal uses ({MAX_TID})",
                sb.generation
            ));
        }
        if sb.area_blocks < 2 || sb.tail_pos >= sb.area_blocks - 1 {
            return Err(format!(
                "tail position {} outside a log of {} blocks",
                sb.tail_pos,
                sb.area_blocks.saturating_sub(1)
            ));
        }
        Ok(sb)
    }
}

/// A log block's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub tid: u64,
    pub area: u32,
    pub count: u32,
    pub flags: u32,
    pub file: u32,
}

impl Header {
    /// Start a log block: zero it and write the header (seal it when the payload is in).
    pub fn write(&self, b: &mut [u8]) {
        b.fill(0);
        put_u32(b, 0, LOG_MAGIC);
        put_u32(b, 4, self.kind as u32);
        put_u64(b, 8, self.tid);
        put_u32(b, 16, self.area);
        put_u32(b, 20, self.count);
        put_u32(b, 24, self.flags);
        put_u32(b, 28, self.file);
    }

    /// The header of a sealed log block whose counts fit its kind; `None` for anything else.
    pub fn read(b: &[u8]) -> Option<Header> {
        if b.len() != BLOCK || get_u32(b, 0) != LOG_MAGIC || !sealed(b) {
            return None;
        }
        let kind = match get_u32(b, 4) {
            1 => Kind::Descriptor,
            2 => Kind::Revoke,
            3 => Kind::Commit,
            _ => return None,
        };
        let count = get_u32(b, 20);
        let fits = match kind {
            // A transaction with no metadata (data and revokes only) has one empty descriptor.
            Kind::Descriptor => count <= TAGS_PER_DESC as u32,
            Kind::Revoke => (1..=REVOKES_PER_BLOCK as u32).contains(&count),
            Kind::Commit => count == 0,
        };
        let tid = get_u64(b, 8);
        (fits && tid <= MAX_TID).then(|| Header {
            kind,
            tid,
            area: get_u32(b, 16),
            count,
            flags: get_u32(b, 24),
            file: get_u32(b, 28),
        })
    }
}

/// Tag `i` of a descriptor: (home block, crc32c of the block).
pub fn tag(b: &[u8], i: usize) -> (u64, u32) {
    let at = HEADER + 16 * i;
    (get_u64(b, at), get_u32(b, at + 8))
}

pub fn put_tag(b: &mut [u8], i: usize, home: u64, crc: u32) {
    let at = HEADER + 16 * i;
    put_u64(b, at, home);
    put_u32(b, at + 8, crc);
}

/// The flags of tag `i` of a descriptor ([`TAG_ESCAPED`]).
pub fn tag_flags(b: &[u8], i: usize) -> u32 {
    get_u32(b, HEADER + 16 * i + 12)
}

pub fn put_tag_flags(b: &mut [u8], i: usize, flags: u32) {
    put_u32(b, HEADER + 16 * i + 12, flags);
}

/// Whether a block to be journaled starts with the log magic (and goes to the log escaped).
pub fn needs_escape(block: &[u8]) -> bool {
    get_u32(block, 0) == LOG_MAGIC
}

/// The log's copy of a block that [`needs_escape`]: its magic zeroed.
pub fn escape(block: &mut [u8]) {
    put_u32(block, 0, 0);
}

/// A block read back from the log under a [`TAG_ESCAPED`] tag: its magic restored.
pub fn unescape(block: &mut [u8]) {
    put_u32(block, 0, LOG_MAGIC);
}

/// Blocks a transaction takes in the log.
pub fn tx_blocks(metas: usize, revokes: usize) -> u64 {
    let desc = metas.div_ceil(TAGS_PER_DESC).max(1);
    (desc + metas + revokes.div_ceil(REVOKES_PER_BLOCK) + 1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trips_and_rejects_damage() {
        let sb = Superblock {
            area_blocks: 64,
            area_index: 1,
            area_count: 2,
            tail_pos: 5,
            tail_tid: 77,
            generation: 3,
        };
        let mut b = vec![0u8; BLOCK];
        sb.encode(&mut b);
        assert_eq!(Superblock::decode(&b), Ok(sb));
        b[40] ^= 1;
        assert!(Superblock::decode(&b).unwrap_err().contains("checksum"));
        assert!(Superblock::decode(&[0u8; BLOCK])
            .unwrap_err()
            .contains("magic"));
    }

    #[test]
    fn headers_need_magic_checksum_and_sane_counts() {
        let mut b = vec![0u8; BLOCK];
        let h = Header {
            kind: Kind::Descriptor,
            tid: 9,
            area: 0,
            count: 2,
            flags: FLAG_FILE_TX,
            file: 4,
        };
        h.write(&mut b);
        put_tag(&mut b, 1, 42, 7);
        seal(&mut b);
        assert_eq!(Header::read(&b), Some(h));
        assert_eq!(tag(&b, 1), (42, 7));
        let mut bad = b.clone();
        bad[100] ^= 4;
        assert_eq!(Header::read(&bad), None);
        put_u32(&mut b, 20, TAGS_PER_DESC as u32 + 1);
        seal(&mut b);
        assert_eq!(Header::read(&b), None, "a descriptor with too many tags");
    }

    #[test]
    fn chain_block_matches_a_pass_over_the_block() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut b = vec![0u8; BLOCK];
        for round in 0..200 {
            for w in b.chunks_mut(8) {
                w.copy_from_slice(&next().to_le_bytes());
            }
            if round % 3 == 0 {
                b[64..].fill(0); // mostly zero, as descriptors and commit blocks are
            }
            let seed = match round {
                0 => 0,
                1 => u32::MAX,
                _ => next() as u32,
            };
            assert_eq!(
                chain_block(seed, crc(&b)),
                crc_chain(seed, &b),
                "round {round}, seed {seed:#x}"
            );
            seal(&mut b);
            assert_eq!(sealed_crc(&b), crc(&b), "round {round}: sealed block");
        }
    }

    #[test]
    fn transaction_sizes() {
        assert_eq!(tx_blocks(1, 0), 3);
        assert_eq!(tx_blocks(0, 1), 3);
        assert_eq!(
            tx_blocks(TAGS_PER_DESC + 1, 0),
            2 + TAGS_PER_DESC as u64 + 1 + 1
        );
    }
}
