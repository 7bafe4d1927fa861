//! The ordering attribute (Rio §4.2) and its 64-byte form in the attribute log.
//!
//! Layout (little endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `RIOA` |
//! | 4..8 | crc32c of bytes 8..60 |
//! | 8..10 | stream |
//! | 10..12 | target |
//! | 12..16 | log epoch (entries of an earlier epoch are stale) |
//! | 16..24 | seq (first group the entry carries) |
//! | 24..32 | seq_end (last group; equal to seq unless whole groups were merged) |
//! | 32..40 | prev: the previous group of this stream sent to this target (0: none) |
//! | 40..48 | byte offset on the target |
//! | 48..52 | length in bytes |
//! | 52..54 | flags: boundary, ipu, flush, merged |
//! | 54..56 | num: requests in the group (on the group's final entry; 0 elsewhere) |
//! | 56..58 | members: requests of the group this entry carries (merges within a group) |
//! | 58 | split index |
//! | 59 | split count (0: not split) |
//! | 60..64 | persist word: a checksum of stream, epoch and seq (never 0) once the data is durable, else 0 |
//!
//! The persist word sits outside the checksum: it is written after the entry, by itself, when
//! the data becomes durable (a 4-byte write, atomic on persistent memory), and a torn or foreign
//! value is not mistaken for it because it depends on the entry's stream, epoch and seq (the
//! word a torn append leaves from the slot's previous entry is another entry's).

use crate::error::RioError;

/// Bytes of one log entry.
pub const ATTR_BYTES: usize = 64;
const MAGIC: u32 = u32::from_le_bytes(*b"RIOA");
const PERSISTED: u32 = 0x5e51_57ed;

/// The largest group number an entry may carry (the log's slot table counts 2^58 − 2 groups;
/// at ten million writes a second, about 900 years): a larger one is damage, and keeps
/// recovery's arithmetic on group numbers and byte ranges inside 64 bits.
pub const MAX_SEQ: u64 = (1 << 58) - 2;

/// Flag bits.
pub const BOUNDARY: u16 = 1;
pub const IPU: u16 = 2;
pub const FLUSH: u16 = 4;
pub const MERGED: u16 = 8;

/// One request's ordering attribute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Attr {
    pub stream: u16,
    pub target: u16,
    pub epoch: u32,
    /// The group this request belongs to (submission order; the storage order).
    pub seq: u64,
    /// The last group carried (merged whole groups `seq..=seq_end`); equal to `seq` otherwise.
    pub seq_end: u64,
    /// The previous group of this stream on this target (0: none).
    pub prev: u64,
    /// Byte offset on the target.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
    /// The group's final request: `num` is set.
    pub boundary: bool,
    /// An in-place update (recovery hands it to the upper layer instead of discarding it).
    pub ipu: bool,
    /// Carries the FLUSH of a `wait`: once durable it certifies every earlier entry of its
    /// stream on its target.
    pub flush: bool,
    /// Requests of whole groups merged into one device command.
    pub merged: bool,
    /// Requests in the group (on the boundary entry of an unmerged group).
    pub num: u16,
    /// Requests of its group this entry carries (more than one when merged within a group).
    pub members: u16,
    /// `(index, count)` when the request was split into `count` pieces.
    pub split: Option<(u8, u8)>,
    /// The data is durable (set after the entry is written).
    pub persist: bool,
}

impl Attr {
    /// Encode into a 64-byte entry.
    pub fn encode(&self, out: &mut [u8]) {
        assert_eq!(
            out.len(),
            ATTR_BYTES,
            "an attribute entry is {ATTR_BYTES} bytes"
        );
        out.copy_from_slice(&self.to_bytes());
    }

    /// The 64-byte entry (one is written for every ordered write: kept to fixed-size copies).
    #[inline]
    pub fn to_bytes(&self) -> [u8; ATTR_BYTES] {
        self.entry_bytes(self.epoch, self.persist)
    }

    /// [`Attr::to_bytes`] with `epoch` and `persist` in place of the attribute's own: what the
    /// log writes for an append (its epoch, not yet persisted) without copying the attribute
    /// first. The fields go straight to their place in the entry, and the checksum is taken
    /// over them there.
    #[inline]
    pub(crate) fn entry_bytes(&self, epoch: u32, persist: bool) -> [u8; ATTR_BYTES] {
        let flags = (self.boundary as u16 * BOUNDARY)
            | (self.ipu as u16 * IPU)
            | (self.flush as u16 * FLUSH)
            | (self.merged as u16 * MERGED);
        let (i, n) = self.split.unwrap_or((0, 0));
        let mut out = [0u8; ATTR_BYTES];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[8..10].copy_from_slice(&self.stream.to_le_bytes());
        out[10..12].copy_from_slice(&self.target.to_le_bytes());
        out[12..16].copy_from_slice(&epoch.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.seq_end.to_le_bytes());
        out[32..40].copy_from_slice(&self.prev.to_le_bytes());
        out[40..48].copy_from_slice(&self.offset.to_le_bytes());
        out[48..52].copy_from_slice(&self.len.to_le_bytes());
        out[52..54].copy_from_slice(&flags.to_le_bytes());
        out[54..56].copy_from_slice(&self.num.to_le_bytes());
        out[56..58].copy_from_slice(&self.members.to_le_bytes());
        out[58] = i;
        out[59] = n;
        let crc = entry_crc(out[8..60].try_into().expect("52 bytes"));
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        let word = if persist {
            Self::persisted_word(self.stream, epoch, self.seq)
        } else {
            0
        };
        out[60..64].copy_from_slice(&word.to_le_bytes());
        out
    }

    /// The persist word this entry carries once its data is durable.
    pub fn persist_word(&self) -> u32 {
        if self.persist {
            Self::persisted_word(self.stream, self.epoch, self.seq)
        } else {
            0
        }
    }

    /// The persist word for an entry of `stream`'s group `seq` stamped with `epoch`, to write at
    /// byte 60 of its slot. It depends on all three (a checksum of them, never 0), so the word
    /// an earlier entry left in the slot is not this entry's: an append torn before its last
    /// bytes landed leaves the old word behind, and a word of another stream, another epoch or
    /// an older group would otherwise read as this entry's data being durable.
    pub fn persisted_word(stream: u16, epoch: u32, seq: u64) -> u32 {
        let mut b = [0u8; 14];
        b[0..2].copy_from_slice(&stream.to_le_bytes());
        b[2..6].copy_from_slice(&epoch.to_le_bytes());
        b[6..14].copy_from_slice(&seq.to_le_bytes());
        (PERSISTED ^ aios_core::checksum::crc32c_array(&b)).max(1)
    }

    /// Decode an entry: `Ok(None)` for an empty slot (no magic), `Err` for a damaged one.
    pub fn decode(b: &[u8]) -> Result<Option<Attr>, RioError> {
        if b.len() != ATTR_BYTES {
            return Err(RioError::Corrupt(format!(
                "an attribute entry is {ATTR_BYTES} bytes, got {}",
                b.len()
            )));
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC {
            return Ok(None);
        }
        if entry_crc(b[8..60].try_into().expect("52 bytes")) != u32_at(4) {
            return Err(RioError::Corrupt(
                "attribute entry checksum mismatch".into(),
            ));
        }
        let flags = u16_at(52);
        let seq = u64_at(16);
        let seq_end = u64_at(24);
        let split = (b[59] != 0).then_some((b[58], b[59]));
        let a = Attr {
            stream: u16_at(8),
            target: u16_at(10),
            epoch: u32_at(12),
            seq,
            seq_end,
            prev: u64_at(32),
            offset: u64_at(40),
            len: u32_at(48),
            boundary: flags & BOUNDARY != 0,
            ipu: flags & IPU != 0,
            flush: flags & FLUSH != 0,
            merged: flags & MERGED != 0,
            num: u16_at(54),
            members: u16_at(56),
            split,
            persist: false,
        };
        let a = Attr {
            persist: u32_at(60) == Self::persisted_word(a.stream, a.epoch, seq),
            ..a
        };
        // members is 0 only on a FLUSH marker (a flush-bearing entry with no data of its own).
        let marker = a.flush && a.len == 0;
        if seq == 0
            || seq_end < seq
            || seq_end > MAX_SEQ
            || a.offset.checked_add(a.len as u64).is_none()
            || (a.members == 0) != marker
            || split.is_some_and(|(i, n)| i >= n)
        {
            return Err(RioError::Corrupt(format!(
                "attribute entry with impossible fields (seq {seq}..={seq_end}, members {}, \
                 split {split:?}, bytes {}+{})",
                a.members, a.offset, a.len
            )));
        }
        Ok(Some(a))
    }
}

/// Bytes of an entry under its checksum (8..60).
const CRC_BYTES: usize = 52;

/// The checksum of an entry's bytes 8..60 (one per ordered write).
fn entry_crc(b: &[u8; CRC_BYTES]) -> u32 {
    aios_core::checksum::crc32c_array(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Attr {
        Attr {
            stream: 3,
            target: 1,
            epoch: 7,
            seq: 42,
            seq_end: 44,
            prev: 40,
            offset: 8192,
            len: 12288,
            boundary: true,
            ipu: true,
            flush: false,
            merged: true,
            num: 0,
            members: 3,
            split: None,
            persist: false,
        }
    }

    #[test]
    fn entries_round_trip_and_persist_is_separate() {
        let mut a = sample();
        let mut b = [0u8; ATTR_BYTES];
        a.encode(&mut b);
        assert_eq!(Attr::decode(&b).unwrap(), Some(a));
        // Setting persist afterwards touches only the persist word.
        b[60..64].copy_from_slice(&Attr::persisted_word(a.stream, a.epoch, a.seq).to_le_bytes());
        a.persist = true;
        assert_eq!(Attr::decode(&b).unwrap(), Some(a));
        a.split = Some((1, 4));
        a.encode(&mut b);
        assert_eq!(Attr::decode(&b).unwrap(), Some(a));
    }

    #[test]
    fn the_entry_checksum_is_crc32c() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1000 {
            let mut b = [0u8; CRC_BYTES];
            for byte in &mut b {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = x as u8;
            }
            assert_eq!(entry_crc(&b), crc32c::crc32c(&b));
        }
        assert_eq!(
            entry_crc(&[0u8; CRC_BYTES]),
            crc32c::crc32c(&[0u8; CRC_BYTES])
        );
    }

    #[test]
    fn damage_is_detected_and_empty_slots_are_empty() {
        assert_eq!(Attr::decode(&[0u8; ATTR_BYTES]).unwrap(), None);
        let mut b = [0u8; ATTR_BYTES];
        sample().encode(&mut b);
        for byte in 8..60 {
            let mut c = b;
            c[byte] ^= 0x10;
            assert!(Attr::decode(&c).is_err(), "byte {byte} flipped");
        }
        // A foreign persist word is not "persisted".
        let mut c = b;
        c[60..64].copy_from_slice(&0xdead_beefu32.to_le_bytes());
        assert!(!Attr::decode(&c).unwrap().unwrap().persist);
    }
}
