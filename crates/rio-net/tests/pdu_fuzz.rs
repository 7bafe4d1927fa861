//! Bounded fuzzing of the NVMe/TCP PDU parser and of a live target (`harness = false`).
//!
//! Part 1 mutates valid PDUs of every type (bit flips, interesting bytes in the length, type,
//! header-length and offset fields, truncation, splicing, junk) and feeds them to
//! [`pdu::decode`] with and without digests. Properties: it never panics; a decoded PDU is
//! exactly `plen` bytes, no more than the input, and its data lies inside it; every proper
//! prefix of a PDU that decodes is "not yet" (`Ok(None)`), so a stream split anywhere decodes
//! the same; a decoded PDU re-encodes to bytes that decode to the same PDU.
//!
//! Part 2 runs a target and a good initiator, and throws bad connections at the target:
//! malformed, oversized and out-of-sequence PDUs, random mutations of a valid session, and I/O
//! outside the namespace. Each bad connection must be closed by the target (with its reason
//! logged and counted) or answered with an error status, while the good initiator keeps
//! writing and reading correctly, and the bytes after the namespace stay untouched.
//!
//! `AIOS_FUZZ_SECONDS` (default 8) bounds each part; `AIOS_FUZZ_SEED` picks the seed (printed).

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rio_net::pdu::{self, op, Cqe, Digests, Pdu, Sqe};
use rio_net::target::LBA;
use rio_net::{Target, TargetConfig, TargetLogKind, Volume, VolumeConfig};

mod common;
use common::{lba_sqe, queues, Raw};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const MAX_PDU: u32 = 64 << 10;

static PANICKED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Valid PDUs of every type, for both digest settings.
fn corpus(dg: Digests) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut one = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        f(&mut b);
        out.push(b);
    };
    one(&|b| pdu::put_icreq(b, Digests::default(), 3));
    one(&|b| pdu::put_icresp(b, dg, 128 << 10));
    let mut sqe = Sqe::default();
    sqe.set_opcode(op::WRITE);
    sqe.set_cid(7);
    sqe.set_cdw(1, 1);
    sqe.set_cdw(10, 12);
    sqe.set_cdw(12, 0);
    sqe.set_sgl(512, true);
    let data: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    one(&|b| pdu::put_cmd(b, &sqe, &data, dg));
    one(&|b| pdu::put_cmd(b, &sqe, &[], dg));
    let cqe = Cqe {
        dw0: 1,
        dw1: 2,
        sqhd: 3,
        sqid: 1,
        cid: 7,
        status: 0,
    };
    one(&|b| pdu::put_resp(b, &cqe, dg));
    one(&|b| pdu::put_h2c_data(b, 7, 7, 0, &data[..300], false, dg));
    one(&|b| pdu::put_h2c_data(b, 7, 7, 300, &data[300..], true, dg));
    one(&|b| pdu::put_c2h_data(b, 9, 0, &data, true, dg));
    one(&|b| pdu::put_r2t(b, 7, 7, 0, 4096, dg));
    one(&|b| pdu::put_term(b, true, 1, 0, &data[..40]));
    one(&|b| pdu::put_term(b, false, 5, 0, &[]));
    out
}

const INTERESTING: &[u32] = &[
    0,
    1,
    7,
    8,
    23,
    24,
    71,
    72,
    127,
    128,
    255,
    4095,
    4096,
    MAX_PDU - 1,
    MAX_PDU,
    MAX_PDU + 1,
    0x7fff_ffff,
    0xffff_ffff,
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], b: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(4) {
        match rng.below(10) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] = [0u8, 1, 0x7f, 0x80, 0xff][rng.below(5)];
            }
            2 if b.len() >= 8 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                b[4..8].copy_from_slice(&v.to_le_bytes()); // plen
            }
            3 if !b.is_empty() => b[0] = rng.below(12) as u8, // type
            4 if b.len() >= 3 => b[2] = INTERESTING[rng.below(INTERESTING.len())] as u8, // hlen
            5 if b.len() >= 4 => b[3] = INTERESTING[rng.below(INTERESTING.len())] as u8, // pdo
            6 if b.len() >= 2 => b[1] = rng.below(16) as u8,  // flags
            7 => {
                let n = rng.below(b.len() + 1);
                b.truncate(n);
            }
            8 => {
                let s = &seeds[rng.below(seeds.len())];
                let at = rng.below(b.len() + 1);
                let take = rng.below(s.len() + 1);
                let tail = b.split_off(at);
                b.extend_from_slice(&s[..take]);
                b.extend_from_slice(&tail);
            }
            _ => {
                let n = rng.below(64);
                for _ in 0..n {
                    b.push(rng.next() as u8);
                }
            }
        }
    }
}

/// Re-encode a decoded PDU with the public writers (what a peer relaying it would send).
fn reencode(p: &Pdu<'_>, dg: Digests, orig: &[u8]) -> Option<Vec<u8>> {
    let mut b = Vec::new();
    match *p {
        Pdu::Cmd { sqe, data } => pdu::put_cmd(&mut b, &sqe, data, dg),
        Pdu::Resp { cqe } => pdu::put_resp(&mut b, &cqe, dg),
        Pdu::R2T {
            cccid,
            ttag,
            r2to,
            r2tl,
        } => pdu::put_r2t(&mut b, cccid, ttag, r2to, r2tl, dg),
        Pdu::H2CData {
            cccid,
            ttag,
            datao,
            data,
            last,
        } if orig[1] & !(pdu::F_DATA_LAST | pdu::F_HDGST | pdu::F_DDGST) == 0 => {
            pdu::put_h2c_data(&mut b, cccid, ttag, datao, data, last, dg)
        }
        _ => return None,
    }
    Some(b)
}

fn check_one(buf: &[u8], dg: Digests, max: u32, stats: &mut [u64; 3]) {
    match pdu::decode(buf, dg, max) {
        Ok(None) => stats[0] += 1,
        Err(_) => stats[1] += 1,
        Ok(Some((p, n))) => {
            stats[2] += 1;
            assert!(
                n >= pdu::CH_BYTES && n <= buf.len(),
                "consumed {n} of {}",
                buf.len()
            );
            let plen = u32::from_le_bytes(buf[4..8].try_into().unwrap()) as usize;
            assert_eq!(n, plen, "a PDU is exactly plen bytes");
            assert!(
                n as u32 <= max,
                "{n} bytes decoded over the {max}-byte limit"
            );
            let data: &[u8] = match p {
                Pdu::Cmd { data, .. } | Pdu::H2CData { data, .. } | Pdu::C2HData { data, .. } => {
                    data
                }
                _ => &[],
            };
            if !data.is_empty() {
                let r = pdu::data_range(buf, data);
                assert!(r.end <= n, "data {r:?} outside the {n}-byte PDU");
            }
            // A stream split anywhere inside a good PDU waits for the rest.
            for k in [0, 1, 7, 8, n / 2, n - 1] {
                if k < n {
                    match pdu::decode(&buf[..k], dg, max) {
                        Ok(None) => {}
                        other => panic!("prefix {k} of a good {n}-byte PDU gave {other:?}"),
                    }
                }
            }
            if let Some(again) = reencode(&p, dg, buf) {
                let q = pdu::decode(&again, dg, max.max(again.len() as u32))
                    .expect("re-encoded PDU decodes")
                    .expect("whole");
                assert_eq!(q.0, p, "re-encoded PDU decodes to itself");
            }
        }
    }
}

fn parser_fuzz(rng: &mut Rng, budget: Duration) {
    let t0 = Instant::now();
    let settings = [
        Digests::default(),
        Digests {
            header: true,
            data: true,
        },
        Digests {
            header: true,
            data: false,
        },
    ];
    let seeds: Vec<Vec<Vec<u8>>> = settings.iter().map(|&d| corpus(d)).collect();
    let all: Vec<Vec<u8>> = seeds.iter().flatten().cloned().collect();
    let mut stats = [0u64; 3];
    let mut runs = 0u64;
    // Every seed decodes as itself first.
    for (i, &dg) in settings.iter().enumerate() {
        for s in &seeds[i] {
            let (_, n) = pdu::decode(s, dg, MAX_PDU).unwrap().unwrap();
            assert_eq!(n, s.len());
        }
    }
    while t0.elapsed() < budget {
        for _ in 0..256 {
            let k = rng.below(settings.len());
            let dg = settings[k];
            let mut b = seeds[k][rng.below(seeds[k].len())].clone();
            mutate(rng, &all, &mut b);
            let max = [MAX_PDU, 4096, 200][rng.below(3)];
            check_one(&b, dg, max, &mut stats);
            runs += 1;
        }
    }
    println!(
        "parser: {runs} inputs in {:.1} s: {} incomplete, {} refused, {} decoded",
        t0.elapsed().as_secs_f64(),
        stats[0],
        stats[1],
        stats[2]
    );
    assert!(
        stats[1] > 0 && stats[2] > 0,
        "the mutations reach both outcomes"
    );
}

// ---- Part 2: a live target ----

/// Well-formed I/O for a connected queue: a write with its data in the capsule, a write whose
/// data follows as H2CData (as after an R2T), a read and a flush.
fn session_corpus() -> Vec<Vec<u8>> {
    let dg = Digests::default();
    let data = vec![0x5au8; LBA as usize];
    let mut out = Vec::new();
    let mut b = Vec::new();
    pdu::put_cmd(&mut b, &rw(op::WRITE, 21, 200, 1, Some(LBA)), &data, dg);
    out.push(b);
    let mut b = Vec::new();
    pdu::put_cmd(&mut b, &rw(op::WRITE, 22, 201, 1, None), &[], dg);
    pdu::put_h2c_data(&mut b, 22, 22, 0, &data, true, dg);
    out.push(b);
    let mut b = Vec::new();
    pdu::put_cmd(&mut b, &rw(op::READ, 23, 200, 1, None), &[], dg);
    out.push(b);
    let mut sqe = Sqe::default();
    sqe.set_opcode(op::FLUSH);
    sqe.set_cid(24);
    sqe.set_cdw(1, 1);
    let mut b = Vec::new();
    pdu::put_cmd(&mut b, &sqe, &[], dg);
    out.push(b);
    out
}

const NS_BYTES: u64 = 4 << 20;
const FILE_BYTES: u64 = 8 << 20;
const SENTINEL: u8 = 0xa5;

fn rw(opcode: u8, cid: u16, slba: u64, nlb: u32, in_capsule: Option<u32>) -> Sqe {
    let mut sqe = lba_sqe(opcode, cid, slba, nlb);
    match in_capsule {
        Some(len) => sqe.set_sgl(len, true),
        None => sqe.set_sgl(nlb * LBA, false),
    }
    sqe
}

struct Remove(PathBuf);
impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Wait until the target has finished every connection but the good initiator's `base`.
fn quiesce(stats: &rio_net::TargetStatsHandle, base: u64) {
    let t0 = Instant::now();
    while stats.stats().open_connections > base {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the target still holds {} connections 20 s after their hosts left",
            stats.stats().open_connections - base
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The good initiator: a write and a read-back at a rotating offset.
fn good_round(v: &mut Volume, round: u64) {
    let off = (round % 64) * 4096;
    let mut buf = v.alloc(4096).unwrap();
    buf.fill(round as u8 ^ 0x3c);
    v.submit(0, off, buf, true).unwrap();
    v.wait(0).unwrap();
    for d in v.poll().unwrap() {
        d.result.expect("good write");
    }
    let buf = v.alloc(4096).unwrap();
    v.read(0, off, buf).unwrap();
    let d = v.wait_any().unwrap();
    assert!(
        d[0].buf.iter().all(|&x| x == round as u8 ^ 0x3c),
        "good read-back, round {round}"
    );
}

fn live_fuzz(rng: &mut Rng, budget: Duration) {
    let dev = PathBuf::from(format!("/dev/shm/rio-net-fuzz-{}", std::process::id()));
    let _rm = Remove(dev.clone());
    std::fs::write(&dev, vec![SENTINEL; FILE_BYTES as usize]).unwrap();
    let mut cfg = TargetConfig::new(dev.clone(), TargetLogKind::Mem(1 << 20));
    cfg.streams = 2;
    cfg.ns_bytes = Some(NS_BYTES);
    let t = Target::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let addr = t.local_addr();
    let stats = t.stats_handle();
    t.spawn();
    let (mut v, _) = Volume::open(VolumeConfig::new(vec![addr], 1)).unwrap();
    let mut round = 0u64;
    good_round(&mut v, round);

    // Named cases: each must make the target close the connection.
    let mut sqe = rw(op::WRITE, 3, 0, 1, Some(4096));
    sqe.set_cdw(1, 1);
    let mut cmd = Vec::new();
    pdu::put_cmd(&mut cmd, &sqe, &[0u8; 4096], Digests::default());
    let mut garbage = vec![0u8; 200];
    garbage.iter_mut().for_each(|b| *b = rng.next() as u8);
    let mut oversized = cmd.clone();
    oversized[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes());
    let mut bad_hlen = cmd.clone();
    bad_hlen[2] = 40;
    let mut h2c = Vec::new();
    pdu::put_h2c_data(&mut h2c, 9, 9, 0, &[1u8; 512], true, Digests::default());
    let mut r2t = Vec::new();
    pdu::put_r2t(&mut r2t, 1, 1, 0, 512, Digests::default());
    let mut icreq = Vec::new();
    pdu::put_icreq(&mut icreq, Digests::default(), 0);
    let mut bad_digest_icreq = Vec::new();
    pdu::put_icreq(
        &mut bad_digest_icreq,
        Digests {
            header: true,
            data: true,
        },
        0,
    );
    let mut cmd_hd = Vec::new();
    pdu::put_cmd(
        &mut cmd_hd,
        &sqe,
        &[0u8; 4096],
        Digests {
            header: true,
            data: true,
        },
    );
    cmd_hd[20] ^= 1; // header digest now wrong
    let cases: Vec<(&str, bool, Vec<Vec<u8>>)> = vec![
        ("command before ICReq", false, vec![cmd.clone()]),
        ("random bytes", false, vec![garbage]),
        ("oversized PDU", true, vec![oversized]),
        ("bad header length", true, vec![bad_hlen]),
        ("second ICReq", true, vec![icreq]),
        ("H2CData with no R2T", true, vec![h2c]),
        ("R2T from the host", true, vec![r2t]),
        (
            "header digest mismatch",
            false,
            vec![bad_digest_icreq, cmd_hd],
        ),
    ];
    let mut closed = 0u64;
    for (name, after_icreq, pdus) in &cases {
        let before = stats.stats().closed_on_error;
        let mut r = Raw::connect(addr);
        if *after_icreq {
            r.icreq();
        }
        for p in pdus {
            if !r.send(p) {
                break;
            }
        }
        let (gone, types) = r.closed_within(Duration::from_secs(5));
        assert!(gone, "{name}: the target kept the connection open");
        let after = stats.stats().closed_on_error;
        assert!(
            after > before,
            "{name}: closed without counting a reason (answers {types:?})"
        );
        closed += 1;
        round += 1;
        good_round(&mut v, round);
        println!("live: {name}: closed with a logged reason; the good initiator goes on");
    }

    // I/O outside the namespace: refused with LBA Out of Range, the connection stays.
    let ns_blocks = NS_BYTES / LBA as u64;
    let (_admin, mut q) = queues(addr);
    for (what, sqe, data) in [
        (
            "write past the end",
            rw(op::WRITE, 10, ns_blocks, 1, Some(4096)),
            vec![0x11u8; 4096],
        ),
        (
            "write across the end",
            rw(op::WRITE, 11, ns_blocks - 1, 2, Some(8192)),
            vec![0x22; 8192],
        ),
        (
            "read past the end",
            rw(op::READ, 12, ns_blocks + 100, 1, None),
            vec![],
        ),
        (
            "write at LBA 2^63",
            rw(op::WRITE, 13, 1 << 63, 1, Some(4096)),
            vec![0x33; 4096],
        ),
        (
            "zeroes past the end",
            {
                let mut s = rw(op::WRITE_ZEROES, 14, ns_blocks - 1, 2, None);
                s.set_sgl(0, false);
                s
            },
            vec![],
        ),
    ] {
        let cqe = q.command(&sqe, &data).0;
        assert_eq!(
            cqe.sct_sc(),
            (0, 0x80),
            "{what}: expected LBA Out of Range, got {cqe:?}"
        );
        println!("live: {what}: LBA Out of Range");
    }
    let cqe = q
        .command(
            &rw(op::WRITE, 15, ns_blocks - 1, 1, Some(4096)),
            &[0x44; 4096],
        )
        .0;
    assert!(
        cqe.ok(),
        "the last block of the namespace is writable: {cqe:?}"
    );

    // A burst of more commands than the target has device request slots: back-pressure (the
    // commands wait in the socket), never an error.
    let burst = 1000u16;
    let mut b = Vec::new();
    for i in 0..burst {
        let sqe = rw(op::WRITE, 100 + i, (i % 64) as u64, 1, Some(4096));
        pdu::put_cmd(&mut b, &sqe, &[i as u8; 4096], Digests::default());
    }
    let sender = {
        let mut s = q.s.try_clone().unwrap();
        std::thread::spawn(move || s.write_all(&b).unwrap())
    };
    let mut ok = 0;
    while ok < burst {
        let p = q
            .next_pdu(Duration::from_secs(10))
            .expect("a completion for every command of the burst");
        match pdu::decode(&p, Digests::default(), u32::MAX).unwrap() {
            Some((Pdu::Resp { cqe }, _)) => {
                assert!(cqe.ok(), "burst write {} failed: {cqe:?}", cqe.cid);
                ok += 1;
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }
    sender.join().unwrap();
    println!("live: a burst of {burst} writes on one queue: all completed");

    // Random mutations of a valid session: ICReq, then commands and data, mutated.
    drop(_admin);
    drop(q);
    let base_open = 2; // the good volume's admin and I/O connections
    quiesce(&stats, base_open);
    let mut seeds = corpus(Digests::default());
    seeds.extend(session_corpus());
    let t0 = Instant::now();
    let mut sessions = 0u64;
    while t0.elapsed() < budget {
        // A fresh connection, one past ICReq, or an I/O queue past Connect (with its admin
        // queue), so the mutations reach every state of a connection.
        let (mut r, _admin) = match rng.below(3) {
            0 => (Raw::connect(addr), None),
            1 => {
                let mut r = Raw::connect(addr);
                r.icreq();
                (r, None)
            }
            _ => {
                let (a, q) = queues(addr);
                (q, Some(a))
            }
        };
        let mut stream = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let mut b = seeds[rng.below(seeds.len())].clone();
            if rng.below(2) != 0 {
                mutate(rng, &seeds, &mut b);
            }
            stream.extend_from_slice(&b);
        }
        // Sent in random pieces, so the target sees every split.
        let mut at = 0;
        while at < stream.len() {
            let n = 1 + rng.below(stream.len() - at);
            if !r.send(&stream[at..at + n]) {
                break;
            }
            at += n;
        }
        // Whatever the target made of it, it must answer or close, and keep serving others.
        drop(r);
        drop(_admin);
        sessions += 1;
        if sessions % 16 == 0 {
            // Once the target has finished with every bad connection (their writes may land
            // anywhere in the namespace), the good initiator writes and reads back.
            quiesce(&stats, base_open);
            round += 1;
            good_round(&mut v, round);
        }
    }
    quiesce(&stats, base_open);
    round += 1;
    good_round(&mut v, round);

    // Nothing after the namespace changed.
    let bytes = std::fs::read(&dev).unwrap();
    let outside = &bytes[NS_BYTES as usize..];
    assert!(
        outside.iter().all(|&b| b == SENTINEL),
        "the target wrote outside its namespace"
    );
    let s = stats.stats();
    println!(
        "live: {closed} named cases closed, {sessions} mutated sessions in {:.1} s; target closed {} connections on errors and served {} orderless writes and {} reads; {} good rounds; nothing outside the namespace changed",
        t0.elapsed().as_secs_f64(),
        s.closed_on_error,
        s.orderless,
        s.reads,
        round + 1
    );
}

fn main() {
    // `cargo test` passes harness flags (`--list` when tools enumerate tests): run only for a
    // plain run or an explicit filter naming this file.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("pdu_fuzz: test");
        return;
    }
    let secs: f64 = std::env::var("AIOS_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8.0);
    let seed: u64 = std::env::var("AIOS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("pdu_fuzz: seed {seed} (AIOS_FUZZ_SEED={seed} repeats it), {secs} s per part");
    // A panic on any thread (a target connection thread included) fails the run.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICKED.store(true, std::sync::atomic::Ordering::SeqCst);
        default_hook(info)
    }));
    let mut rng = Rng(seed);
    parser_fuzz(&mut rng, Duration::from_secs_f64(secs));
    live_fuzz(&mut rng, Duration::from_secs_f64(secs));
    assert!(
        !PANICKED.load(std::sync::atomic::Ordering::SeqCst),
        "a thread panicked (see above)"
    );
    println!("test result: ok. 1 passed; 0 failed; 0 ignored");
}
