//! NVMe passthrough on a real NVMe namespace: data, IOPOLL, bad input, and null_blk.
//!
//! These tests need an NVMe namespace with poll queues, which the host machines do not have, so
//! they are `#[ignore]`d here and run inside the QEMU lab guest by `cargo xtask lab`, which sets:
//! - `AIOS_LAB_NVME_CHAR`  — the passthrough character device (`/dev/ng0n1`), and
//! - `AIOS_LAB_NVME_BLOCK` — the same namespace's block device (`/dev/nvme0n1`), and
//! - `AIOS_LAB_NULLB`      — a null_blk device with poll queues (`/dev/nullb0`), and
//! - `AIOS_LAB_EXPECT_FIXED_BUFFERS` — set where the kernel must accept the registered arena for
//!   passthrough data (the lab's 6.12 kernel; Linux 6.1 refuses it, and lbio says so).
//!
//! Run by hand against a scratch NVMe drive (its data is overwritten!):
//! `AIOS_LAB_NVME_CHAR=/dev/ng0n1 AIOS_LAB_NVME_BLOCK=/dev/nvme0n1 cargo test --test nvme_lab -- --ignored`

mod common;
use common::fill_pattern;

use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use aios_core::nvme;
use aios_core::{probe, CoreError, Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{
    Backend, Class, Device, DeviceConfig, Geometry, Io, LbioArray, LbioConfig, LbioError,
    NvmeBackend, RouteChoice,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The tests write only within this many leading bytes of the namespace.
const REGION_BYTES: u64 = 16 << 20;
/// Operations per proptest case, and cases: together at least 10,000 operations.
const OPS_PER_CASE: usize = 1000;
const CASES: u32 = 11;
const ARENA_BYTES: usize = 64 << 20;

fn env_path(name: &str) -> PathBuf {
    std::env::var_os(name).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{name} is not set: this test needs an NVMe namespace; it runs in the lab (cargo xtask lab)")
    })
}

fn engine(iopoll: bool) -> Rc<Engine> {
    Engine::new(EngineConfig {
        arena_bytes: ARENA_BYTES,
        passthrough: true,
        iopoll_ring: iopoll,
        ..EngineConfig::default()
    })
    .expect("engine with passthrough rings")
}

fn open(lbio: &Rc<LbioArray>, path: &Path, iopoll: bool) -> Device {
    Device::open(
        lbio,
        path,
        DeviceConfig {
            write: true,
            route: RouteChoice::Ring,
            iopoll,
            probe: ProbeOptions {
                latency_samples: 0,
                try_iopoll: true,
            },
            ..DeviceConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

fn alloc(engine: &Engine, len: usize) -> FixedBuf {
    engine.alloc_blocking(len).expect("arena room")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// `NvmeBackend` on `/dev/ngXnY`.
    Passthrough,
    /// `FileBackend` on `/dev/nvmeXnY`, O_DIRECT.
    Block,
}

#[derive(Clone, Debug)]
enum Step {
    Write {
        via: Via,
        block: u64,
        blocks: u64,
        fua: bool,
        background: bool,
        seed: u64,
    },
    Read {
        via: Via,
        block: u64,
        blocks: u64,
    },
    Flush {
        via: Via,
    },
}

struct Harness {
    engine: Rc<Engine>,
    lbio: Rc<LbioArray>,
    ng: Device,
    blk: Device,
    lba: u64,
    /// What the region must hold.
    model: RefCell<Vec<u8>>,
}

impl Harness {
    fn new() -> Harness {
        let engine = engine(false);
        let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
        let ng = open(&lbio, &env_path("AIOS_LAB_NVME_CHAR"), false);
        let blk = open(&lbio, &env_path("AIOS_LAB_NVME_BLOCK"), false);
        let lba = ng.geometry().logical_block as u64;
        assert!(ng.critical_route().0.name.starts_with("nvme-passthrough"));
        assert_eq!(blk.critical_route().0.name, "io_uring");
        assert_eq!(
            ng.geometry().capacity_bytes,
            blk.geometry().capacity_bytes,
            "Identify and the block device agree on the namespace size"
        );
        // Start from what the region holds now.
        let mut model = vec![0u8; REGION_BYTES as usize];
        let chunk = ng.geometry().max_transfer_bytes as u64;
        let mut at = 0;
        while at < REGION_BYTES {
            let n = chunk.min(REGION_BYTES - at);
            let buf = ng
                .read_at_blocking(at, alloc(&engine, n as usize))
                .expect("read region");
            model[at as usize..(at + n) as usize].copy_from_slice(&buf[..]);
            at += n;
        }
        Harness {
            engine,
            lbio,
            ng,
            blk,
            lba,
            model: RefCell::new(model),
        }
    }

    fn dev(&self, via: Via) -> &Device {
        match via {
            Via::Passthrough => &self.ng,
            Via::Block => &self.blk,
        }
    }

    fn run(&self, step: &Step) -> Result<(), TestCaseError> {
        match *step {
            Step::Write {
                via,
                block,
                blocks,
                fua,
                background,
                seed,
            } => {
                let (off, len) = (block * self.lba, (blocks * self.lba) as usize);
                let mut buf = alloc(&self.engine, len);
                fill_pattern(&mut buf, off, seed);
                let class = if background {
                    Class::Background
                } else {
                    Class::Critical
                };
                let buf = self
                    .dev(via)
                    .run_blocking(Io::write(off, buf).fua(fua).class(class))
                    .map_err(|e| TestCaseError::fail(format!("{step:?}: {e}")))?
                    .expect("a write returns its buffer");
                self.model.borrow_mut()[off as usize..off as usize + len].copy_from_slice(&buf);
            }
            Step::Read { via, block, blocks } => {
                let (off, len) = (block * self.lba, (blocks * self.lba) as usize);
                let buf = self
                    .dev(via)
                    .read_at_blocking(off, alloc(&self.engine, len))
                    .map_err(|e| TestCaseError::fail(format!("{step:?}: {e}")))?;
                let model = self.model.borrow();
                let want = &model[off as usize..off as usize + len];
                if &buf[..] != want {
                    let first = buf.iter().zip(want).position(|(a, b)| a != b).unwrap();
                    return Err(TestCaseError::fail(format!(
                        "{step:?}: byte {} (device offset {}) differs",
                        first,
                        off + first as u64
                    )));
                }
            }
            Step::Flush { via } => {
                self.dev(via)
                    .flush_blocking()
                    .map_err(|e| TestCaseError::fail(format!("{step:?}: {e}")))?;
            }
        }
        Ok(())
    }
}

fn via() -> impl Strategy<Value = Via> {
    prop_oneof![Just(Via::Passthrough), Just(Via::Block)]
}

/// Random steps inside the region, up to three max transfers long (so lbio must split them).
fn steps(region_blocks: u64, max_blocks: u64) -> impl Strategy<Value = Vec<Step>> {
    let range = (0..region_blocks).prop_flat_map(move |block| {
        let room = (region_blocks - block).min(max_blocks);
        (Just(block), 1..=room)
    });
    let step = prop_oneof![
        5 => (via(), range.clone(), any::<bool>(), prop::bool::weighted(0.2), any::<u64>())
            .prop_map(|(via, (block, blocks), fua, background, seed)| Step::Write {
                via, block, blocks, fua, background, seed
            }),
        5 => (via(), range).prop_map(|(via, (block, blocks))| Step::Read { via, block, blocks }),
        1 => via().prop_map(|via| Step::Flush { via }),
    ];
    prop::collection::vec(step, OPS_PER_CASE)
}

#[test]
#[ignore = "needs an NVMe namespace: runs in the QEMU lab (cargo xtask lab)"]
fn passthrough_and_block_device_agree_over_ten_thousand_random_operations() {
    let h = Harness::new();
    let region_blocks = REGION_BYTES / h.lba;
    let max_blocks = 3 * h.ng.geometry().max_transfer_bytes as u64 / h.lba;
    let ops = Cell::new(0usize);
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        failure_persistence: None,
        ..Config::default()
    });
    let split_before = h.lbio.metrics().split_requests;
    let result = runner.run(&steps(region_blocks, max_blocks), |steps| {
        for s in &steps {
            h.run(s)?;
            ops.set(ops.get() + 1);
        }
        // Everything written reads back identical through both paths.
        h.run(&Step::Read {
            via: Via::Passthrough,
            block: 0,
            blocks: region_blocks.min(max_blocks),
        })?;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let splits = h.lbio.metrics().split_requests - split_before;
    println!(
        "{} operations over {} cases, {} requests split at the {}-byte max transfer",
        ops.get(),
        CASES,
        splits,
        h.ng.geometry().max_transfer_bytes
    );
    assert!(ops.get() >= 10_000, "ran {} operations", ops.get());
    assert!(
        splits > 0,
        "requests above the max transfer must have been split"
    );
}

#[test]
#[ignore = "needs an NVMe namespace: runs in the QEMU lab (cargo xtask lab)"]
fn queued_passthrough_requests_complete_and_verify() {
    let engine = engine(false);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let ng = open(&lbio, &env_path("AIOS_LAB_NVME_CHAR"), false);
    const QD: usize = 32;
    const REQUESTS: u64 = 512;
    let bs = 4096u64;
    let base = REGION_BYTES; // beyond the property test's region
                             // Writes, QD32, detached.
    let mut next = 0u64;
    let mut done = 0u64;
    while done < REQUESTS {
        while next < REQUESTS && (next - done) < QD as u64 {
            let mut buf = alloc(&engine, bs as usize);
            fill_pattern(&mut buf, base + next * bs, 7);
            ng.submit(Io::write(base + next * bs, buf))
                .map_err(|(e, _)| e)
                .expect("submit write");
            next += 1;
        }
        lbio.wait_done(1).unwrap();
        while let Some(c) = lbio.take_done() {
            c.result.expect("queued write");
            done += 1;
        }
    }
    // Reads, QD32, each checked against its offset's pattern.
    let (mut next, mut done) = (0u64, 0u64);
    let mut want = vec![0u8; bs as usize];
    while done < REQUESTS {
        while next < REQUESTS && (next - done) < QD as u64 {
            ng.submit(Io::read(base + next * bs, alloc(&engine, bs as usize)))
                .map_err(|(e, _)| e)
                .expect("submit read");
            next += 1;
        }
        lbio.wait_done(1).unwrap();
        while let Some(c) = lbio.take_done() {
            c.result.expect("queued read");
            let buf = c.buf.expect("read buffer");
            // The tag does not say the offset; the content does: find which block it must be.
            let got_first = u64::from_le_bytes(buf[..8].try_into().unwrap());
            let block = (0..REQUESTS)
                .find(|b| {
                    fill_pattern(&mut want[..8], base + b * bs, 7);
                    u64::from_le_bytes(want[..8].try_into().unwrap()) == got_first
                })
                .expect("read returned a block that was written");
            fill_pattern(&mut want, base + block * bs, 7);
            assert!(buf[..] == want[..], "block {block} differs");
            done += 1;
        }
    }
}

#[test]
#[ignore = "needs an NVMe namespace with poll queues: runs in the QEMU lab (cargo xtask lab)"]
fn iopoll_reads_complete_and_verify_and_probe_reports_passthrough() {
    let ng_path = env_path("AIOS_LAB_NVME_CHAR");
    let blk_path = env_path("AIOS_LAB_NVME_BLOCK");
    let opts = ProbeOptions {
        latency_samples: 20,
        try_iopoll: true,
    };
    let p = probe(&ng_path, opts).expect("probe ng");
    let pt = p.passthrough.as_ref().expect("passthrough probed");
    assert!(pt.namespace.is_ok(), "{:?}", pt.namespace);
    assert_eq!(
        pt.iopoll,
        Ok(()),
        "polled passthrough read on {}",
        ng_path.display()
    );
    let p = probe(&blk_path, opts).expect("probe block");
    assert_eq!(
        p.iopoll,
        Ok(()),
        "polled O_DIRECT read on {}",
        blk_path.display()
    );
    let pt = p
        .passthrough
        .as_ref()
        .expect("the block device names its ng twin");
    assert_eq!(pt.char_device, ng_path);
    assert_eq!(pt.iopoll, Ok(()));

    let engine = engine(true);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let ng = open(&lbio, &ng_path, true);
    let blk = open(&lbio, &blk_path, true);
    assert!(ng
        .critical_route()
        .0
        .name
        .starts_with("nvme-passthrough-iopoll"));
    assert!(ng.critical_route().0.iopoll && blk.critical_route().0.iopoll);
    assert!(
        !ng.background_route().0.iopoll,
        "background stays on the normal ring"
    );
    let base = REGION_BYTES * 2;
    for i in 0..64u64 {
        let bs = 4096 * (1 + i % 8);
        let off = base + i * 32768;
        let mut buf = alloc(&engine, bs as usize);
        fill_pattern(&mut buf, off, 11);
        // Writes on the normal ring (background), reads on the IOPOLL ring (critical).
        ng.run_blocking(Io::write(off, buf).class(Class::Background))
            .expect("write");
        for dev in [&ng, &blk] {
            let got = dev
                .read_at_blocking(off, alloc(&engine, bs as usize))
                .expect("polled read");
            let mut want = vec![0u8; bs as usize];
            fill_pattern(&mut want, off, 11);
            assert!(got[..] == want[..], "polled read at {off} differs");
        }
    }
    ng.flush_blocking().expect("flush on the normal ring");
}

#[test]
#[ignore = "needs an NVMe namespace: runs in the QEMU lab (cargo xtask lab)"]
fn bad_input_gives_typed_errors_or_correct_splits() {
    let ng_path = env_path("AIOS_LAB_NVME_CHAR");
    let engine = engine(false);
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let ng = open(&lbio, &ng_path, false);
    let g = *ng.geometry();
    let lba = g.logical_block as usize;

    // An LBA past the end: refused before it reaches the device.
    let e = ng
        .read_at_blocking(g.capacity_bytes, alloc(&engine, lba))
        .unwrap_err();
    assert!(matches!(e, LbioError::PastEnd { .. }), "{e}");
    let e = ng
        .read_at_blocking(g.capacity_bytes - lba as u64, alloc(&engine, 2 * lba))
        .unwrap_err();
    assert!(matches!(e, LbioError::PastEnd { .. }), "{e}");

    // The same, sent raw (no lbio bounds check): the controller's status comes back typed.
    let (fd, ns) = nvme::open_namespace(&ng_path).expect("identify");
    let raw = NvmeBackend::new(&engine, Rc::new(fd), &ns).expect("backend");
    println!(
        "registered buffers for passthrough: {:?}",
        raw.registered_buffers()
    );
    if std::env::var_os("AIOS_LAB_EXPECT_FIXED_BUFFERS").is_some() {
        assert_eq!(
            raw.registered_buffers(),
            Ok(()),
            "this kernel should take the arena as fixed passthrough buffers"
        );
    }
    let caps = raw.caps();
    let unchecked = Device::from_backends(
        &lbio,
        Box::new(raw.clone()),
        Box::new(raw),
        Geometry {
            capacity_bytes: g.capacity_bytes * 2,
            max_transfer_bytes: g.max_transfer_bytes * 4,
            ..g
        },
        true,
    )
    .expect("unchecked device");
    assert!(caps.fua && caps.flush);
    let e = unchecked
        .read_at_blocking(g.capacity_bytes, alloc(&engine, lba))
        .unwrap_err();
    match &e {
        LbioError::Nvme { status, .. } => {
            assert_eq!(status.name(), "LBA Out of Range", "{e}");
            assert!(status.dnr(), "{e}");
        }
        other => panic!("expected an NVMe status, got {other}"),
    }
    println!("past-end read, sent raw: {e}");

    // Above the max transfer: lbio splits it and it succeeds.
    let splits = lbio.metrics().split_requests;
    let big = g.max_transfer_bytes as usize * 3 + lba;
    let off = REGION_BYTES * 3;
    let mut buf = alloc(&engine, big);
    fill_pattern(&mut buf, off, 5);
    ng.write_at_blocking(off, buf, true).expect("split write");
    let got = ng
        .read_at_blocking(off, alloc(&engine, big))
        .expect("split read");
    let mut want = vec![0u8; big];
    fill_pattern(&mut want, off, 5);
    assert!(got[..] == want[..]);
    assert_eq!(lbio.metrics().split_requests, splits + 2);

    // One command above MDTS sent raw (lbio told the limit is 4x higher): refused, not hung.
    let e = unchecked
        .read_at_blocking(0, alloc(&engine, g.max_transfer_bytes as usize * 2))
        .unwrap_err();
    assert!(
        matches!(e, LbioError::Io { .. } | LbioError::Nvme { .. }),
        "{e}"
    );
    println!("one command of twice the max transfer, sent raw: {e}");

    // A misaligned buffer.
    let mut buf = alloc(&engine, 2 * lba);
    buf.set_range(1, lba).unwrap();
    let e = ng.read_at_blocking(0, buf).unwrap_err();
    assert!(
        matches!(
            e,
            LbioError::Unaligned {
                what: "buffer address",
                ..
            }
        ),
        "{e}"
    );

    // Character devices that are not NVMe namespaces.
    for path in ["/dev/null", "/dev/zero", "/dev/nvme0"] {
        if !Path::new(path).exists() {
            continue;
        }
        let e = nvme::open_namespace(Path::new(path)).unwrap_err();
        assert!(matches!(e, CoreError::NotNvme { .. }), "{path}: {e}");
        let e = Device::open(&lbio, Path::new(path), DeviceConfig::default()).unwrap_err();
        assert!(
            matches!(e, LbioError::NotABlockDevice { .. }),
            "{path}: {e}"
        );
        println!("{path}: {e}");
    }

    // An engine without 128-byte SQEs cannot drive passthrough: said at open.
    let plain = Engine::new(EngineConfig {
        arena_bytes: 1 << 20,
        ..EngineConfig::default()
    })
    .unwrap();
    let plain_lbio = LbioArray::new(Rc::clone(&plain), LbioConfig::default()).unwrap();
    let e = Device::open(&plain_lbio, &ng_path, DeviceConfig::default()).unwrap_err();
    assert!(e.to_string().contains("passthrough: true"), "{e}");
}

#[test]
#[ignore = "needs null_blk with poll queues: runs in the QEMU lab (cargo xtask lab)"]
fn null_blk_is_a_second_polled_lab_device() {
    let path = env_path("AIOS_LAB_NULLB");
    let p = probe(
        &path,
        ProbeOptions {
            latency_samples: 20,
            try_iopoll: true,
        },
    )
    .expect("probe null_blk");
    assert_eq!(p.iopoll, Ok(()), "polled read on {}", path.display());
    assert!(p.passthrough.is_none(), "null_blk is not NVMe");
    let engine = Engine::new(EngineConfig {
        arena_bytes: 8 << 20,
        iopoll_ring: true,
        ..EngineConfig::default()
    })
    .unwrap();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = open(&lbio, &path, true);
    assert!(dev.critical_route().0.iopoll);
    for i in 0..32u64 {
        let off = i * 65536;
        let mut buf = alloc(&engine, 8192);
        fill_pattern(&mut buf, off, 3);
        dev.write_at_blocking(off, buf, i % 2 == 0).expect("write");
        let got = dev
            .read_at_blocking(off, alloc(&engine, 8192))
            .expect("read");
        let mut want = vec![0u8; 8192];
        fill_pattern(&mut want, off, 3);
        assert!(got[..] == want[..], "memory-backed null_blk keeps data");
    }
}
