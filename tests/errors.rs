//! Bad input gets a typed error that names the wrong value and the right one — never a panic.
//!
//! Each request error is checked through the blocking, async and detached interfaces (the
//! detached one must also give the caller's buffer back), on a real O_DIRECT file under /var/tmp.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::rc::Rc;
use std::sync::atomic::{AtomicU32, Ordering};

use aios_core::{CoreError, Engine, EngineConfig, FixedBuf, ProbeOptions};
use lbio::{Device, DeviceConfig, Io, LbioArray, LbioConfig, LbioError, Op, RouteChoice};

const FILE_BYTES: u64 = 1 << 20;

/// A file under /var/tmp (ext4 with O_DIRECT), removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(dir: &Path, tag: &str) -> TempFile {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("aios-errors-{}-{tag}-{n}.img", std::process::id()));
        let f = std::fs::File::create(&path).expect("create the test file");
        f.set_len(FILE_BYTES).expect("size the test file");
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn engine() -> Rc<Engine> {
    Engine::new(EngineConfig {
        ring_entries: 64,
        arena_bytes: 1 << 20,
        huge_pages: false,
        ..EngineConfig::default()
    })
    .expect("engine")
}

fn config(write: bool) -> DeviceConfig {
    DeviceConfig {
        write,
        route: RouteChoice::Ring,
        probe: ProbeOptions {
            latency_samples: 0,
            try_iopoll: false,
        },
        ..DeviceConfig::default()
    }
}

struct Fixture {
    engine: Rc<Engine>,
    lbio: Rc<LbioArray>,
    dev: Device,
    _file: TempFile,
}

fn fixture() -> Fixture {
    let file = TempFile::new(Path::new("/var/tmp"), "dev");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = Device::open(&lbio, &file.0, config(true)).expect("open the test file");
    Fixture {
        engine,
        lbio,
        dev,
        _file: file,
    }
}

/// Send a read of `buf` at `offset` through all three interfaces; return the blocking error after
/// checking the other two agree and that the detached one gave the buffer back untouched.
fn read_error(f: &Fixture, offset: u64, make: impl Fn() -> FixedBuf) -> LbioError {
    let blocking = f
        .dev
        .read_at_blocking(offset, make())
        .expect_err("the blocking read must be refused");
    let by_future = f
        .engine
        .block_on(f.dev.read_at(offset, make()))
        .expect("block_on")
        .expect_err("the async read must be refused");
    assert_eq!(by_future.to_string(), blocking.to_string());

    let mut buf = make();
    let (start, len) = (buf.start(), buf.len());
    buf.fill(0x42);
    let (detached, back) = f
        .dev
        .submit(Io::read(offset, buf))
        .expect_err("the detached read must be refused");
    let back = back.expect("a refused request gives its buffer back");
    assert_eq!((back.start(), back.len()), (start, len));
    assert!(back.iter().all(|&b| b == 0x42), "and leaves it untouched");
    assert_eq!(detached.to_string(), blocking.to_string());
    assert!(!detached.is_would_block(), "bad input is not back-pressure");

    assert_eq!(f.lbio.free_slots(), f.lbio.config().slots, "no slot taken");
    assert_eq!(f.lbio.metrics().requests, 0, "nothing reached the device");
    blocking
}

fn buf(f: &Fixture, len: usize) -> FixedBuf {
    let mut b = f.engine.try_alloc(len.max(4096)).unwrap();
    b.set_len(len).unwrap();
    b
}

#[test]
fn unaligned_offset_names_offset_and_alignment() {
    let f = fixture();
    let align = f.dev.geometry().offset_align;
    let bad = align as u64 * 3 + 1;
    let e = read_error(&f, bad, || buf(&f, 4096));
    match e {
        LbioError::Unaligned {
            what: "offset",
            value,
            align: a,
        } => assert_eq!((value, a), (bad, align)),
        ref other => panic!("expected an unaligned offset, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&format!("offset {bad}")), "{msg}");
    assert!(msg.contains(&format!("{align}-byte")), "{msg}");
}

#[test]
fn unaligned_length_names_length_and_alignment() {
    let f = fixture();
    let align = f.dev.geometry().offset_align;
    let e = read_error(&f, 0, || buf(&f, 1000));
    assert!(
        matches!(e, LbioError::Unaligned { what: "length", value: 1000, align: a } if a == align),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("length 1000"), "{msg}");
    assert!(msg.contains(&format!("{align}-byte")), "{msg}");
}

#[test]
fn unaligned_buffer_address_names_address_and_alignment() {
    let f = fixture();
    let mem_align = f.dev.geometry().mem_align;
    let shifted = || {
        let mut b = f.engine.try_alloc(8192).unwrap();
        b.set_range(1, 4096).unwrap();
        b
    };
    let addr = shifted().as_ptr() as u64;
    assert_eq!(addr % 4096, 1, "the range starts one byte into a frame");
    let e = read_error(&f, 0, shifted);
    match e {
        LbioError::Unaligned {
            what: "buffer address",
            value,
            align,
        } => {
            assert_eq!(align, mem_align);
            assert_eq!(
                value % mem_align as u64,
                1,
                "the off-by-one address: {value:#x}"
            );
        }
        ref other => panic!("expected an unaligned buffer address, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("buffer address"), "{msg}");
    assert!(msg.contains(&format!("{mem_align}-byte")), "{msg}");
}

#[test]
fn io_past_the_end_names_capacity_and_last_valid_offset() {
    let f = fixture();
    let cap = f.dev.geometry().capacity_bytes;
    assert_eq!(cap, FILE_BYTES);
    let offset = cap - 4096 + 512;
    let e = read_error(&f, offset, || buf(&f, 4096));
    assert!(
        matches!(e, LbioError::PastEnd { offset: o, len: 4096, capacity } if o == offset && capacity == cap),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains(&offset.to_string()), "{msg}");
    assert!(msg.contains(&cap.to_string()), "{msg}");
    assert!(
        msg.contains(&(cap - 4096).to_string()),
        "the last valid offset: {msg}"
    );

    // An offset whose end overflows u64 is past the end too, not an arithmetic panic.
    let huge = u64::MAX - 511;
    let e = read_error(&f, huge, || buf(&f, 4096));
    assert!(
        matches!(e, LbioError::PastEnd { offset, .. } if offset == huge),
        "{e:?}"
    );

    // Writes are checked the same way.
    let e = f
        .dev
        .write_at_blocking(cap, buf(&f, 512), false)
        .unwrap_err();
    assert!(matches!(e, LbioError::PastEnd { .. }), "{e:?}");
}

#[test]
fn zero_length_is_refused_with_the_fix() {
    let f = fixture();
    let e = read_error(&f, 0, || buf(&f, 0));
    assert!(matches!(e, LbioError::Empty(Op::Read)), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("zero-length read"), "{msg}");
    assert!(msg.contains("set_len"), "{msg}");
}

#[test]
fn writes_to_a_read_only_device_are_refused() {
    let file = TempFile::new(Path::new("/var/tmp"), "ro");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let dev = Device::open(&lbio, &file.0, config(false)).unwrap();
    let e = dev
        .write_at_blocking(0, engine.try_alloc(4096).unwrap(), false)
        .unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Write)), "{e:?}");
    assert!(e.to_string().contains("write: true"), "the fix: {e}");
    let e = dev.flush_blocking().unwrap_err();
    assert!(matches!(e, LbioError::ReadOnly(Op::Flush)), "{e:?}");
    dev.read_at_blocking(0, engine.try_alloc(4096).unwrap())
        .expect("reads work");
}

fn open_error(path: &Path) -> LbioError {
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    Device::open(&lbio, path, config(true)).expect_err("the open must fail")
}

#[test]
fn a_missing_path_is_not_found() {
    let path = PathBuf::from(format!(
        "/var/tmp/aios-no-such-device-{}",
        std::process::id()
    ));
    let e = open_error(&path);
    assert!(
        matches!(&e, LbioError::NotFound { path: p } if *p == path),
        "{e:?}"
    );
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[test]
fn a_character_device_or_directory_is_not_a_block_device() {
    let e = open_error(Path::new("/dev/null"));
    assert!(
        matches!(&e, LbioError::NotABlockDevice { path, kind } if path == Path::new("/dev/null") && kind == "character device"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("/dev/null"), "{msg}");
    assert!(msg.contains("not a block device or regular file"), "{msg}");

    let e = open_error(Path::new("/var/tmp"));
    assert!(
        matches!(&e, LbioError::NotABlockDevice { kind, .. } if kind == "directory"),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("/var/tmp: a directory is not"),
        "{e}"
    );
}

/// A ramfs mounted on a fresh directory, unmounted and removed when dropped.
struct Ramfs(PathBuf);

impl Ramfs {
    fn mount() -> Result<Ramfs, String> {
        let dir = std::env::temp_dir().join(format!("aios-ramfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "ramfs", "none"])
            .arg(&dir)
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(Ramfs(dir))
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_file_system_without_direct_io_is_named() {
    if !aios_core::sys::is_root() {
        eprintln!("SKIPPED a_file_system_without_direct_io_is_named: mounting a ramfs needs root");
        return;
    }
    let ramfs = match Ramfs::mount() {
        Ok(m) => m,
        Err(why) => {
            eprintln!(
                "SKIPPED a_file_system_without_direct_io_is_named: mount -t ramfs failed: {why}"
            );
            return;
        }
    };
    let file = TempFile::new(&ramfs.0, "ramfs");
    let e = open_error(&file.0);
    match &e {
        LbioError::NoDirectIo { path, detail } => {
            assert_eq!(*path, file.0);
            assert!(detail.contains("O_DIRECT"), "{detail}");
        }
        other => panic!("expected NoDirectIo, got {other:?}"),
    }
    let msg = e.to_string();
    assert!(msg.contains(&file.0.display().to_string()), "{msg}");
    assert!(msg.contains("ramfs"), "names the file system: {msg}");
    assert!(msg.contains("ext4"), "says where direct I/O works: {msg}");
    drop(file);
}

#[test]
fn a_max_transfer_off_the_alignment_is_refused() {
    let file = TempFile::new(Path::new("/var/tmp"), "mt");
    let engine = engine();
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default()).unwrap();
    let cfg = DeviceConfig {
        max_transfer_bytes: Some(1000),
        ..config(true)
    };
    let e = Device::open(&lbio, &file.0, cfg).unwrap_err();
    assert!(matches!(e, LbioError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("1000"), "{e}");
    assert!(e.to_string().contains("512-byte"), "{e}");
}

#[test]
fn a_queue_depth_over_the_slots_names_both() {
    let f = fixture();
    let slots = f.lbio.config().slots;
    f.dev
        .check_queue_depth(slots)
        .expect("exactly the slots is fine");
    let e = f.dev.check_queue_depth(slots + 1).unwrap_err();
    assert!(matches!(e, LbioError::QueueDepth { qd, slots: s } if qd == slots + 1 && s == slots));
    let msg = e.to_string();
    assert!(msg.contains(&format!("queue depth {}", slots + 1)), "{msg}");
    assert!(msg.contains(&format!("{slots} request slots")), "{msg}");
    assert!(msg.contains("LbioConfig::slots"), "the fix: {msg}");
    assert!(matches!(
        f.dev.check_queue_depth(0),
        Err(LbioError::QueueDepth { qd: 0, .. })
    ));
}

const MEMLOCK_CHILD: &str = "AIOS_MEMLOCK_CHILD";

fn on_path(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn memlock_too_low_names_the_limit_and_the_fix() {
    if std::env::var_os(MEMLOCK_CHILD).is_some() {
        // The child: a 16 MiB arena under a 64 KiB memlock limit, without CAP_IPC_LOCK.
        match Engine::new(EngineConfig {
            arena_bytes: 16 << 20,
            ..EngineConfig::default()
        }) {
            Ok(_) => println!("CHILD: the engine started"),
            Err(e) => {
                let kind = if matches!(e, CoreError::MemlockTooLow { .. }) {
                    "MemlockTooLow"
                } else {
                    "other"
                };
                println!("CHILD ERROR {kind}: {e}");
            }
        }
        return;
    }
    let root = aios_core::sys::is_root();
    let tools: &[&str] = if root {
        &["setpriv", "prlimit"]
    } else {
        &["prlimit"]
    };
    if let Some(missing) = tools.iter().find(|t| !on_path(t)) {
        eprintln!(
            "SKIPPED memlock_too_low_names_the_limit_and_the_fix: {missing} is not installed"
        );
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if root {
        // Root has CAP_IPC_LOCK, which lifts the limit: drop it for the child.
        let mut c = Command::new("setpriv");
        c.args([
            "--bounding-set=-ipc_lock",
            "--inh-caps=-ipc_lock",
            "prlimit",
        ]);
        c
    } else {
        Command::new("prlimit")
    };
    let out = cmd
        .arg("--memlock=65536:65536")
        .arg(exe)
        .args([
            "memlock_too_low_names_the_limit_and_the_fix",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(MEMLOCK_CHILD, "1")
        .output()
        .expect("run the child");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the child must not panic:\n{text}");
    // The harness prints the test's name on the same line, before the child's own output.
    let line = text
        .lines()
        .find_map(|l| l.find("CHILD").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("the child ran the test:\n{text}"));
    println!("{line}");
    assert!(line.starts_with("CHILD ERROR MemlockTooLow"), "{line}");
    assert!(line.contains("RLIMIT_MEMLOCK"), "{line}");
    assert!(line.contains("65536"), "names the limit: {line}");
    assert!(
        line.contains(&(16u64 << 20).to_string()),
        "names what is needed: {line}"
    );
    assert!(line.contains("ulimit -l"), "says how to fix it: {line}");
}
