//! Targets and a volume in one process over 127.0.0.1: ordered writes, reads, recovery.

use std::path::PathBuf;

use rio_net::{Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};

fn scratch(name: &str, bytes: u64) -> PathBuf {
    let p = PathBuf::from(format!(
        "/dev/shm/rio-net-test-{}-{name}",
        std::process::id()
    ));
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(bytes).unwrap();
    p
}

fn start_target(name: &str, log: TargetLogKind) -> (std::net::SocketAddr, Remove) {
    let dev = scratch(name, 16 << 20);
    let cleanup = Remove(dev.clone());
    let mut cfg = TargetConfig::new(dev, log);
    cfg.streams = 4;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = t.local_addr();
    t.spawn();
    (addr, cleanup)
}

struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn pattern(stream: u16, seq: u64, buf: &mut [u8]) {
    for (i, c) in buf.chunks_mut(8).enumerate() {
        c.copy_from_slice(&((stream as u64) << 48 ^ seq << 16 ^ i as u64).to_le_bytes());
    }
}

#[test]
fn ordered_writes_land_striped_and_read_back() {
    let (a, _ra) = start_target("a", TargetLogKind::Mem(1 << 20));
    let (b, _rb) = start_target("b", TargetLogKind::Mem(1 << 20));
    let cfg = VolumeConfig::new(vec![a, b], 2);
    let (mut v, rep) = Volume::open(cfg).unwrap();
    assert_eq!(rep.prefix_end[..2], [1, 1]);
    assert_eq!(v.bytes(), 32 << 20);
    let mut done = Vec::new();
    for g in 0..300u64 {
        for s in 0..2u16 {
            let mut buf = v.alloc(4096).unwrap();
            pattern(s, g + 1, &mut buf);
            let off = (s as u64 * 1000 + g) * 4096;
            v.submit(s, off, buf, true).unwrap();
            done.extend(v.poll().unwrap());
        }
    }
    v.wait(0).unwrap();
    v.wait(1).unwrap();
    done.extend(v.poll().unwrap());
    assert_eq!(done.len(), 600);
    for s in 0..2u16 {
        let seqs: Vec<u64> = done
            .iter()
            .filter(|d| d.stream == s)
            .map(|d| d.seq)
            .collect();
        assert_eq!(
            seqs,
            (1..=300).collect::<Vec<_>>(),
            "stream {s} handed back in order"
        );
        assert!(done.iter().all(|d| d.result.is_ok()));
    }
    drop(done);
    // Read everything back through the volume (both targets: 4 KiB stripes alternate).
    for s in 0..2u16 {
        for g in 0..300u64 {
            let buf = v.alloc(4096).unwrap();
            v.read(s, (s as u64 * 1000 + g) * 4096, buf).unwrap();
            let d = v.wait_any().unwrap();
            assert_eq!(d.len(), 1);
            let mut want = vec![0u8; 4096];
            pattern(s, g + 1, &mut want);
            assert!(d[0].buf[..] == want[..], "stream {s} group {}", g + 1);
        }
    }
    // A second initiator finds everything durable and nothing to discard.
    drop(v);
    let cfg = VolumeConfig::new(vec![a, b], 2);
    let (v2, rep) = Volume::open(cfg).unwrap();
    assert_eq!(rep.prefix_end[..2], [301, 301]);
    assert_eq!(rep.discarded, 0);
    assert_eq!(v2.next_seq(0).unwrap(), 301);
}

#[test]
fn out_of_range_and_misaligned_io_is_refused() {
    let (a, _ra) = start_target("c", TargetLogKind::Mem(1 << 20));
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![a], 1)).unwrap();
    let buf = v.alloc(4096).unwrap();
    assert!(v.submit(0, v.bytes(), buf, true).is_err());
    let buf = v.alloc(4096).unwrap();
    assert!(v.submit(0, 100, buf, true).is_err());
}

/// An offset so large that offset + length passes `u64::MAX` is refused like any other range
/// past the volume. (The sum overflowed: a panic in a debug build, and in a release build it
/// wrapped to a small number, passed the check and went out to the targets.)
#[test]
fn an_offset_whose_end_passes_u64_max_is_refused() {
    let (a, _ra) = start_target("wrap", TargetLogKind::Mem(1 << 20));
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![a], 1)).unwrap();
    let off = u64::MAX - 4095; // a multiple of 4 KiB: only the end is wrong
    let buf = v.alloc(4096).unwrap();
    assert!(matches!(
        v.submit(0, off, buf, true),
        Err(rio_net::NetError::Config(_))
    ));
    let buf = v.alloc(4096).unwrap();
    assert!(matches!(
        v.read(0, off, buf),
        Err(rio_net::NetError::Config(_))
    ));
    let buf = v.alloc(4096).unwrap();
    assert!(matches!(
        v.write_orderless(0, off, buf),
        Err(rio_net::NetError::Config(_))
    ));
    // Nothing went out, and the volume goes on.
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().is_empty());
    assert_eq!(v.stats().recoveries, 1, "only the open's recovery ran");
}

/// `wait` on a stream the volume does not have is an error, as for the other calls that take
/// a stream. (It indexed the stream list: a panic.)
#[test]
fn wait_on_a_stream_the_volume_does_not_have_is_an_error() {
    let (a, _ra) = start_target("nostream", TargetLogKind::Mem(1 << 20));
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![a], 2)).unwrap();
    assert!(matches!(v.wait(2), Err(rio_net::NetError::Config(_))));
    assert!(matches!(v.flush_all(2), Err(rio_net::NetError::Config(_))));
    v.wait(1).unwrap();
}

/// `next_seq` of a stream the volume does not have is an error, as for the other calls that
/// take a stream. (It indexed the stream list: a panic.)
#[test]
fn next_seq_of_a_stream_the_volume_does_not_have_is_an_error() {
    let (a, _ra) = start_target("noseq", TargetLogKind::Mem(1 << 20));
    let (v, _) = Volume::open(VolumeConfig::new(vec![a], 2)).unwrap();
    assert!(matches!(v.next_seq(2), Err(rio_net::NetError::Config(_))));
    assert_eq!(v.next_seq(1).unwrap(), 1);
}

/// `io_timeout: Duration::MAX` ("never give a connection up") works. (Every wait added it to
/// `Instant::now()`: the open panicked with an overflow.)
#[test]
fn an_io_timeout_of_duration_max_means_no_limit() {
    let (a, _ra) = start_target("notimeout", TargetLogKind::Mem(1 << 20));
    let mut cfg = VolumeConfig::new(vec![a], 1);
    cfg.io_timeout = std::time::Duration::MAX;
    let (mut v, _) = Volume::open(cfg).unwrap();
    let mut buf = v.alloc(4096).unwrap();
    buf.fill(0x5a);
    v.submit(0, 0, buf, true).unwrap();
    v.wait(0).unwrap();
    assert!(v.poll().unwrap().iter().all(|d| d.result.is_ok()));
    v.recover().unwrap();
    let buf = v.alloc(4096).unwrap();
    v.read(0, 0, buf).unwrap();
    let d = v.wait_any().unwrap();
    assert!(d[0].result.is_ok() && d[0].buf.iter().all(|&b| b == 0x5a));
}

#[test]
fn writes_larger_than_the_capsule_go_by_r2t() {
    // A target that takes no write data in the capsule: every write waits for its R2T.
    let dev = scratch("r2t", 16 << 20);
    let _rm = Remove(dev.clone());
    let mut cfg = TargetConfig::new(dev, TargetLogKind::Mem(1 << 20));
    cfg.streams = 2;
    cfg.in_capsule = 0;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let a = t.local_addr();
    t.spawn();
    let mut vc = VolumeConfig::new(vec![a], 1);
    vc.stripe = 64 << 10;
    let (mut v, _) = Volume::open(vc).unwrap();
    for g in 0..50u64 {
        let mut buf = v.alloc(64 << 10).unwrap();
        pattern(0, g + 1, &mut buf);
        v.submit(0, g * (64 << 10), buf, true).unwrap();
        let mut buf = v.alloc(8192).unwrap();
        pattern(1, g + 1, &mut buf);
        v.write_orderless(0, (8 << 20) + g * 8192, buf).unwrap();
    }
    v.wait(0).unwrap();
    let mut done = v.poll().unwrap();
    while done.len() < 100 {
        done.extend(v.wait_any().unwrap());
    }
    assert!(done.iter().all(|d| d.result.is_ok()));
    for g in 0..50u64 {
        for (stream, off, len) in [
            (0, g * (64 << 10), 64 << 10),
            (1, (8 << 20) + g * 8192, 8192),
        ] {
            let buf = v.alloc(len).unwrap();
            v.read(0, off, buf).unwrap();
            let d = v.wait_any().unwrap();
            let mut want = vec![0u8; len];
            pattern(stream, g + 1, &mut want);
            assert!(d[0].buf[..] == want[..], "write {g} of pattern {stream}");
        }
    }
}

#[test]
fn a_connection_left_idle_longer_than_the_io_timeout_is_not_taken_for_dead() {
    let (a, _ra) = start_target("idle", TargetLogKind::Mem(1 << 20));
    let mut cfg = VolumeConfig::new(vec![a], 2);
    cfg.io_timeout = std::time::Duration::from_millis(200);
    let (mut v, _) = Volume::open(cfg).unwrap();
    for s in 0..2u16 {
        let mut buf = v.alloc(4096).unwrap();
        pattern(s, 1, &mut buf);
        v.submit(s, s as u64 * 4096, buf, true).unwrap();
        v.wait(s).unwrap();
    }
    let _ = v.poll().unwrap();
    // Opening the volume was one recovery; there must be no other.
    let recoveries = v.stats().recoveries;
    // Both streams' connections sit idle for twice the timeout; then each reads.
    std::thread::sleep(std::time::Duration::from_millis(400));
    for s in 0..2u16 {
        let buf = v.alloc(4096).unwrap();
        v.read(s, s as u64 * 4096, buf).unwrap();
        let d = v.wait_any().unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(
            d[0].result,
            Ok(()),
            "stream {s}'s read after the idle spell"
        );
        let mut want = vec![0u8; 4096];
        pattern(s, 1, &mut want);
        assert!(d[0].buf[..] == want[..]);
    }
    assert_eq!(
        v.stats().recoveries,
        recoveries,
        "an idle connection was taken for a failed one"
    );
}

/// Submit `offs` as groups (a list of several offsets: one group of those writes), polling
/// only every `every` groups; wait; return what came back.
fn write_groups(v: &mut Volume, groups: &[Vec<u64>], every: usize) -> Vec<rio_net::Done> {
    let mut done = Vec::new();
    for (g, offs) in groups.iter().enumerate() {
        for (k, &off) in offs.iter().enumerate() {
            let mut buf = v.alloc(4096).unwrap();
            pattern(0, off / 4096 + 1, &mut buf);
            v.submit(0, off, buf, k + 1 == offs.len()).unwrap();
        }
        if (g + 1) % every == 0 {
            done.extend(v.poll().unwrap());
        }
    }
    v.wait(0).unwrap();
    done.extend(v.poll().unwrap());
    done
}

fn check_blocks(v: &mut Volume, offs: impl Iterator<Item = u64>) {
    for off in offs {
        let buf = v.alloc(4096).unwrap();
        v.read(0, off, buf).unwrap();
        let d = v.wait_any().unwrap();
        let mut want = vec![0u8; 4096];
        pattern(0, off / 4096 + 1, &mut want);
        assert!(d[0].buf[..] == want[..], "block at {off}");
    }
}

#[test]
fn held_groups_back_to_back_on_a_target_go_out_merged() {
    // Two targets striped by 64 KiB: 40 groups of one 4 KiB write each, in order, fill the
    // first stripe (16 groups, target 0), the second (16, target 1) and half the third.
    let (a, _ra) = start_target("merge-a", TargetLogKind::Mem(1 << 20));
    let (b, _rb) = start_target("merge-b", TargetLogKind::Mem(1 << 20));
    let mut cfg = VolumeConfig::new(vec![a, b], 1);
    cfg.stripe = 64 << 10;
    cfg.batch = 40;
    let (mut v, _) = Volume::open(cfg).unwrap();
    let groups: Vec<Vec<u64>> = (0..40u64).map(|g| vec![g * 4096]).collect();
    let done = write_groups(&mut v, &groups, 40);
    assert_eq!(done.len(), 40);
    assert!(done.iter().all(|d| d.result.is_ok()));
    let seqs: Vec<u64> = done.iter().map(|d| d.seq).collect();
    assert_eq!(
        seqs,
        (1..=40).collect::<Vec<_>>(),
        "handed back in group order"
    );
    let st = v.stats();
    // A merged command never crosses a stripe (it is one target's bytes): 16 + 16 + 8.
    assert_eq!((st.merged_cmds, st.merged_groups), (3, 40), "{st:?}");
    assert_eq!(st.ordered_cmds, 3);
    check_blocks(&mut v, (0..40u64).map(|g| g * 4096));
    // Recovery reads the merged entries: everything is in the prefix.
    drop(done);
    drop(v);
    let mut cfg = VolumeConfig::new(vec![a, b], 1);
    cfg.stripe = 64 << 10;
    let (mut v2, rep) = Volume::open(cfg).unwrap();
    assert_eq!(rep.prefix_end[0], 41);
    assert_eq!(rep.discarded, 0);
    check_blocks(&mut v2, (0..40u64).map(|g| g * 4096));
}

#[test]
fn only_writes_that_follow_each_other_merge_and_r2t_carries_the_copy() {
    // A target that takes no data in the capsule: merged commands go by R2T from their copy.
    let dev = scratch("merge-r2t", 16 << 20);
    let _rm = Remove(dev.clone());
    let mut tc = TargetConfig::new(dev, TargetLogKind::Mem(1 << 20));
    tc.streams = 2;
    tc.in_capsule = 0;
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), tc).unwrap();
    let a = t.local_addr();
    t.spawn();
    let mut cfg = VolumeConfig::new(vec![a], 1);
    cfg.batch = 8;
    cfg.max_merge_bytes = 16 << 10;
    let (mut v, _) = Volume::open(cfg).unwrap();
    let k = |b: u64| b * 4096;
    let groups: Vec<Vec<u64>> = vec![
        // Held together (batch 8): blocks 0-1 merge; a group of two writes with a gap between
        // them goes alone; 3-4 merge; after a gap, 10-12 merge. The second batch: 13-14 merge
        // (a batch's runs end with it); then 30, a group of two writes 31-32 and 33 merge up to
        // the 16 KiB limit; 34-35, one group, merge within it; 37 goes alone.
        vec![k(0)],
        vec![k(1)],
        vec![k(2), k(5)],
        vec![k(3)],
        vec![k(4)],
        vec![k(10)],
        vec![k(11)],
        vec![k(12)],
        // Next batch.
        vec![k(13)],
        vec![k(14)],
        vec![k(30)],
        vec![k(31), k(32)],
        vec![k(33)],
        vec![k(34), k(35)],
        vec![k(37)],
    ];
    let done = write_groups(&mut v, &groups, 8);
    assert_eq!(done.len(), 18);
    assert!(done.iter().all(|d| d.result.is_ok()));
    let mut seqs: Vec<u64> = done.iter().map(|d| d.seq).collect();
    seqs.dedup();
    assert_eq!(
        seqs,
        (1..=15).collect::<Vec<_>>(),
        "handed back in group order"
    );
    let st = v.stats();
    // Batch 1 (groups 1-8): {1,2}, {3} (two commands), {4,5}, {6,7,8}; batch 2 (9-15):
    // {9,10}, {11,12,13}, {14} (its two writes merged), {15}.
    assert_eq!((st.merged_cmds, st.merged_groups), (6, 13), "{st:?}");
    assert_eq!(st.ordered_cmds, 6 + 2 + 1, "{st:?}");
    let blocks = [
        0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 30, 31, 32, 33, 34, 35, 37,
    ];
    check_blocks(&mut v, blocks.into_iter().map(k));
    // A second initiator's recovery keeps every group, merged or not.
    drop(done);
    drop(v);
    let (mut v2, rep) = Volume::open(VolumeConfig::new(vec![a], 1)).unwrap();
    assert_eq!(rep.prefix_end[0], 16);
    assert_eq!(rep.discarded, 0);
    check_blocks(&mut v2, blocks.into_iter().map(k));
}
