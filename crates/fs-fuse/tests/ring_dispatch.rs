//! The FUSE-over-io_uring dispatcher on a SimDisk file system: requests laid out in a queue
//! entry's buffers as the kernel lays them out (fixed header in `in_out`, the operation's
//! header in `op_in`, names and data in the payload), answers checked byte by byte.

mod common;

use std::sync::Arc;
use std::time::Duration;

use aios_core::fuse_ring::HEADER_BYTES;
use fs_fuse::ring::{dispatch, Handler};

const PAYLOAD_SZ: usize = 256 + 16;

struct Req {
    header: Vec<u8>,
    payload: Vec<u8>,
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn get64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// A request as the kernel puts it in an entry: `op_in` bytes, then `payload` bytes.
fn req(opcode: u32, unique: u64, nodeid: u64, op_in: &[u8], payload: &[u8]) -> Req {
    let mut header = vec![0xAAu8; HEADER_BYTES];
    put32(&mut header, 0, (40 + op_in.len() + payload.len()) as u32);
    put32(&mut header, 4, opcode);
    put64(&mut header, 8, unique);
    put64(&mut header, 16, nodeid);
    put32(&mut header, 24, 0); // uid
    put32(&mut header, 28, 0); // gid
    put32(&mut header, 32, 1234); // pid
    header[36..40].fill(0);
    header[128..128 + op_in.len()].copy_from_slice(op_in);
    put32(&mut header, 256 + 16, payload.len() as u32);
    let mut p = vec![0u8; 1 << 20];
    p[..payload.len()].copy_from_slice(payload);
    Req { header, payload: p }
}

/// Run it; returns (errno or 0, answer payload).
fn call(h: &Handler, mut r: Req, unique: u64) -> (i32, Vec<u8>) {
    dispatch(h, &mut r.header, &mut r.payload);
    let error = get32(&r.header, 4) as i32;
    assert_eq!(get64(&r.header, 8), unique, "the answer names its request");
    let n = get32(&r.header, PAYLOAD_SZ) as usize;
    assert_eq!(get32(&r.header, 0) as usize, 16 + n, "out header length");
    (error, r.payload[..n].to_vec())
}

#[test]
fn requests_in_queue_buffers_are_answered_as_the_kernel_expects() {
    let (_disk, fs) = common::open(common::fresh_image(16 << 20), 1).unwrap();
    let h = Handler {
        fs: Arc::clone(&fs),
        entry_ttl: Duration::from_secs(1),
        attr_ttl: Duration::from_millis(1500),
        xattrs: true,
    };
    // CREATE "a" in the root: fuse_create_in {flags, mode, umask, open_flags}, then the name.
    let mut op = vec![0u8; 16];
    put32(&mut op, 0, libc::O_RDWR as u32);
    put32(&mut op, 4, libc::S_IFREG | 0o666);
    put32(&mut op, 8, 0o022);
    let (e, out) = call(&h, req(35, 7, 1, &op, b"a\0"), 7);
    assert_eq!(e, 0);
    assert_eq!(out.len(), 128 + 16, "fuse_entry_out then fuse_open_out");
    let ino = get64(&out, 0);
    assert!(ino > 1);
    assert_eq!(get64(&out, 16), 1, "entry valid 1 s");
    assert_eq!(get64(&out, 24), 1, "attr valid 1.5 s: seconds");
    assert_eq!(
        get32(&out, 36),
        500_000_000,
        "attr valid 1.5 s: nanoseconds"
    );
    assert_eq!(get64(&out, 40), ino, "attr.ino");
    assert_eq!(
        get32(&out, 40 + 60),
        libc::S_IFREG | 0o644,
        "mode less umask"
    );
    assert_eq!(get32(&out, 40 + 64), 1, "nlink");
    assert_eq!(get32(&out, 128 + 8) & 2, 2, "FOPEN_KEEP_CACHE");

    // WRITE 5000 bytes at 100: fuse_write_in {fh, offset, size, ...}, then the data.
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let mut op = vec![0u8; 40];
    put64(&mut op, 8, 100);
    put32(&mut op, 16, data.len() as u32);
    let (e, out) = call(&h, req(16, 8, ino, &op, &data), 8);
    assert_eq!((e, out.len(), get32(&out, 0)), (0, 8, 5000));

    // READ it back: fuse_read_in {fh, offset, size, ...}.
    let mut op = vec![0u8; 40];
    put64(&mut op, 8, 100);
    put32(&mut op, 16, 8192);
    let (e, out) = call(&h, req(15, 9, ino, &op, &[]), 9);
    assert_eq!(e, 0);
    assert_eq!(out, data, "short read at end of file, same bytes");

    // GETATTR: fuse_attr_out with the new size.
    let (e, out) = call(&h, req(3, 10, ino, &[0u8; 16], &[]), 10);
    assert_eq!((e, out.len()), (0, 104));
    assert_eq!(get64(&out, 16 + 8), 5100, "size");

    // SETATTR size 10 and mode 0600: fuse_setattr_in.
    let mut op = vec![0u8; 88];
    put32(&mut op, 0, 1 | 8);
    put64(&mut op, 16, 10);
    put32(&mut op, 68, 0o600);
    let (e, out) = call(&h, req(4, 11, ino, &op, &[]), 11);
    assert_eq!(e, 0);
    assert_eq!(get64(&out, 16 + 8), 10);
    assert_eq!(get32(&out, 16 + 60), libc::S_IFREG | 0o600);

    // LOOKUP: found, and a missing name is ENOENT with no payload.
    let (e, out) = call(&h, req(1, 12, 1, &[], b"a\0"), 12);
    assert_eq!((e, get64(&out, 0)), (0, ino));
    let (e, out) = call(&h, req(1, 13, 1, &[], b"missing\0"), 13);
    assert_eq!((e, out.len()), (-libc::ENOENT, 0));

    // MKDIR "d", RENAME2 "a" -> "d/b", READDIR of "d".
    let mut op = vec![0u8; 8];
    put32(&mut op, 0, 0o755);
    let (e, out) = call(&h, req(9, 14, 1, &op, b"d\0"), 14);
    assert_eq!(e, 0);
    let dir = get64(&out, 0);
    let mut op = vec![0u8; 16];
    put64(&mut op, 0, dir);
    let (e, _) = call(&h, req(45, 15, 1, &op, b"a\0b\0"), 15);
    assert_eq!(e, 0);
    let mut op = vec![0u8; 40];
    put32(&mut op, 16, 4096);
    let (e, out) = call(&h, req(28, 16, dir, &op, &[]), 16);
    assert_eq!(e, 0);
    let mut names = Vec::new();
    let mut at = 0;
    while at < out.len() {
        let n = get32(&out, at + 16) as usize;
        names.push(String::from_utf8(out[at + 24..at + 24 + n].to_vec()).unwrap());
        at += (24 + n + 7) & !7;
    }
    assert_eq!(at, out.len(), "dirents padded to 8 bytes");
    assert!(names.contains(&"b".to_string()), "{names:?}");

    // SETXATTR / GETXATTR (size query, then value) / FSYNC.
    let mut op = vec![0u8; 16];
    put32(&mut op, 0, 3);
    let (e, _) = call(&h, req(21, 17, ino, &op, b"user.k\0xyz"), 17);
    assert_eq!(e, 0);
    let (e, out) = call(&h, req(22, 18, ino, &[0u8; 8], b"user.k\0"), 18);
    assert_eq!((e, out.len(), get32(&out, 0)), (0, 8, 3));
    let mut op = vec![0u8; 8];
    put32(&mut op, 0, 64);
    let (e, out) = call(&h, req(22, 19, ino, &op, b"user.k\0"), 19);
    assert_eq!((e, out), (0, b"xyz".to_vec()));
    let (e, _) = call(&h, req(20, 20, ino, &[0u8; 16], &[]), 20);
    assert_eq!(e, 0);

    // Set-user-ID and set-group-ID (group-executable): a write from a process with
    // CAP_FSETID keeps them, one with FUSE_WRITE_KILL_SUIDGID clears them, and so does a
    // chown carrying FATTR_KILL_SUIDGID.
    let mode = |h: &Handler, unique| {
        let (e, out) = call(h, req(3, unique, ino, &[0u8; 16], &[]), unique);
        assert_eq!(e, 0);
        get32(&out, 16 + 60) & 0o7777
    };
    let chmod = |h: &Handler, unique, m: u32| {
        let mut op = vec![0u8; 88];
        put32(&mut op, 0, 1);
        put32(&mut op, 68, m);
        assert_eq!(call(h, req(4, unique, ino, &op, &[]), unique).0, 0);
    };
    let write = |h: &Handler, unique, flags: u32| {
        let mut op = vec![0u8; 40];
        put32(&mut op, 16, 1);
        put32(&mut op, 20, flags);
        assert_eq!(call(h, req(16, unique, ino, &op, b"z"), unique).0, 0);
    };
    chmod(&h, 30, 0o6755);
    write(&h, 31, 0);
    assert_eq!(mode(&h, 32), 0o6755, "no kill flag: bits kept");
    write(&h, 33, 1 << 2);
    assert_eq!(mode(&h, 34), 0o755, "FUSE_WRITE_KILL_SUIDGID");
    // A file capability goes with any write, the writer's CAP_FSETID or not.
    let mut op = vec![0u8; 16];
    put32(&mut op, 0, 4);
    let (e, _) = call(&h, req(21, 40, ino, &op, b"security.capability\0abcd"), 40);
    assert_eq!(e, 0);
    write(&h, 41, 0);
    let (e, _) = call(
        &h,
        req(22, 42, ino, &[0u8; 8], b"security.capability\0"),
        42,
    );
    assert_eq!(e, -libc::ENODATA, "security.capability dropped by a write");
    chmod(&h, 35, 0o6755);
    let mut op = vec![0u8; 88];
    put32(&mut op, 0, 2 | (1 << 11));
    put32(&mut op, 76, 1000);
    let (e, out) = call(&h, req(4, 36, ino, &op, &[]), 36);
    assert_eq!(e, 0);
    assert_eq!(
        get32(&out, 16 + 60) & 0o7777,
        0o755,
        "chown with FATTR_KILL_SUIDGID"
    );
    assert_eq!(get32(&out, 16 + 68), 1000, "uid");

    // STATFS is a fixed 80 bytes; an opcode nobody serves is ENOSYS.
    let (e, out) = call(&h, req(17, 21, 1, &[], &[]), 21);
    assert_eq!((e, out.len(), get32(&out, 40)), (0, 80, 4096));
    let (e, _) = call(&h, req(46, 22, ino, &[0u8; 24], &[]), 22);
    assert_eq!(e, -libc::ENOSYS);
}

#[test]
fn with_xattrs_off_every_xattr_request_is_enosys_and_stored_ones_are_kept() {
    let (_disk, fs) = common::open(common::fresh_image(16 << 20), 1).unwrap();
    let on = Handler {
        fs: Arc::clone(&fs),
        entry_ttl: Duration::from_secs(1),
        attr_ttl: Duration::from_secs(1),
        xattrs: true,
    };
    let off = Handler {
        fs: Arc::clone(&fs),
        entry_ttl: Duration::from_secs(1),
        attr_ttl: Duration::from_secs(1),
        xattrs: false,
    };
    // CREATE "f" in the root, then user.k = "xyz" with xattrs on.
    let mut op = vec![0u8; 16];
    put32(&mut op, 0, libc::O_RDWR as u32);
    put32(&mut op, 4, libc::S_IFREG | 0o644);
    let (e, out) = call(&on, req(35, 1, 1, &op, b"f\0"), 1);
    assert_eq!(e, 0);
    let ino = get64(&out, 0);
    let mut set = vec![0u8; 16];
    put32(&mut set, 0, 3);
    assert_eq!(call(&on, req(21, 2, ino, &set, b"user.k\0xyz"), 2).0, 0);

    // Off: SETXATTR, GETXATTR, LISTXATTR and REMOVEXATTR are all ENOSYS.
    let mut sized = vec![0u8; 8];
    put32(&mut sized, 0, 64);
    for (opcode, op_in, payload) in [
        (21u32, &set[..], &b"user.j\0abc"[..]),
        (22, &sized[..], &b"user.k\0"[..]),
        (23, &sized[..], &b""[..]),
        (24, &[][..], &b"user.k\0"[..]),
    ] {
        let (e, _) = call(
            &off,
            req(opcode, 10 + opcode as u64, ino, op_in, payload),
            10 + opcode as u64,
        );
        assert_eq!(e, -libc::ENOSYS, "opcode {opcode} with xattrs off");
    }
    // The rest is served as usual: a WRITE of one byte, then GETATTR sees it.
    let mut w = vec![0u8; 40];
    put32(&mut w, 16, 1);
    let (e, out) = call(&off, req(16, 40, ino, &w, b"z"), 40);
    assert_eq!((e, get32(&out, 0)), (0, 1));
    let (e, out) = call(&off, req(3, 41, ino, &[0u8; 16], &[]), 41);
    assert_eq!((e, get64(&out, 16 + 8)), (0, 1), "size after the write");

    // The attribute set before is untouched: removal was refused, and on again it reads back.
    let (e, out) = call(&on, req(22, 50, ino, &sized, b"user.k\0"), 50);
    assert_eq!((e, out), (0, b"xyz".to_vec()));
    assert!(
        fs.getxattr(ino, b"user.j").is_err(),
        "the refused set stored nothing"
    );
}

/// A handler that panics is answered EIO and the queue thread goes on serving. Here the panic
/// comes from the device factory, which a thread's first request calls (each queue thread
/// opens its own device); before, the panic unwound out of `dispatch`, and in the mount the
/// queue thread died with its entry never committed, so every later request from that CPU
/// hung until the connection was aborted.
#[test]
fn a_request_whose_handler_panics_is_answered_eio_and_the_thread_serves_the_next() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use fs_fuse::fs::{DeviceFactory, Fs};
    use lbio::{SimConfig, SimDisk};

    let image = common::fresh_image(16 << 20);
    let disk = SimDisk::from_image(SimConfig::new(image.len() as u64, 1), image).unwrap();
    let inner = common::factory(&disk);
    let armed = Arc::new(AtomicBool::new(false));
    let a = Arc::clone(&armed);
    let factory: DeviceFactory = Arc::new(move |lbio| {
        if a.load(Ordering::SeqCst) {
            panic!("injected: the device open panics");
        }
        inner(lbio)
    });
    let (fs, _) = Fs::open(factory, common::opts()).unwrap();
    let h = Handler {
        fs: Arc::clone(&fs),
        entry_ttl: Duration::from_secs(1),
        attr_ttl: Duration::from_secs(1),
        xattrs: true,
    };
    armed.store(true, Ordering::SeqCst);
    // A thread that has not served this file system yet, as a queue thread's first request.
    let served = std::thread::scope(|s| {
        s.spawn(|| {
            let (e, out) = call(&h, req(3, 5, 1, &[0u8; 16], &[]), 5);
            assert_eq!((e, out.len()), (-libc::EIO, 0), "the panicking request");
            armed.store(false, Ordering::SeqCst);
            // The same thread serves the next request.
            let (e, out) = call(&h, req(3, 6, 1, &[0u8; 16], &[]), 6);
            assert_eq!((e, out.len()), (0, 104), "the next request");
            // What a panicking handler was changing may be half done: the file system takes
            // no more changes (a commit could write the half-done state to the device).
            assert!(fs.failed(), "the file system still takes changes");
            let mut op = vec![0u8; 16];
            put32(&mut op, 0, libc::O_RDWR as u32);
            put32(&mut op, 4, libc::S_IFREG | 0o666);
            let (e, _) = call(&h, req(35, 7, 1, &op, b"b\0"), 7);
            assert_eq!(e, -libc::EIO, "a create after the panic");
            get32(&out, 16 + 60) & libc::S_IFMT
        })
        .join()
    });
    assert_eq!(
        served.expect("the panic unwound out of dispatch: the queue thread would have died"),
        libc::S_IFDIR,
        "the root's attributes"
    );
}

/// A queue that cannot serve (here a socket in place of `/dev/fuse`: its registrations fail) calls `on_failure` with its reason, which `--transport uring` uses to end the mount;
/// the kernel otherwise moves the connection to `/dev/fuse` and the mount went on there.
#[test]
fn a_failing_queue_reports_to_on_failure() {
    use std::sync::Mutex;

    use fs_fuse::ring::{OnFailure, Queues};

    let (_disk, fs) = common::open(common::fresh_image(16 << 20), 1).unwrap();
    let h = Arc::new(Handler {
        fs: Arc::clone(&fs),
        entry_ttl: Duration::from_secs(1),
        attr_ttl: Duration::from_secs(1),
        xattrs: true,
    });
    let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
    let not_fuse: std::os::fd::OwnedFd = sock.into();
    let reasons = Arc::new(Mutex::new(Vec::new()));
    let r = Arc::clone(&reasons);
    let on_failure: OnFailure = Arc::new(move |why: &str| r.lock().unwrap().push(why.to_string()));
    let q = Queues::start(
        not_fuse,
        h,
        Arc::new(Mutex::new(Some(true))),
        2,
        64 << 10,
        Duration::ZERO,
        Some(on_failure),
    )
    .unwrap();
    let n = q.queues;
    let failed = q.join();
    assert_eq!(failed.len(), n, "{failed:?}");
    let reasons = reasons.lock().unwrap();
    assert_eq!(reasons.len(), n, "{reasons:?}");
    assert!(
        reasons.iter().all(|w| w.starts_with("queue ")),
        "{reasons:?}"
    );
}
