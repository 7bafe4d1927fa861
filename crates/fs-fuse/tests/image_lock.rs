//! The image lock (`fs_fuse::ImageLock`): `mount()` and `mkfs()` hold an exclusive `flock` on
//! the image they write. Before, only `aios mount`/`aios mkfs` looked for another writer, in
//! /proc, so two started at the same instant both passed the check and wrote one image, and a
//! library caller had no check at all.

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use common::ImageFile;
use fs_fuse::{fsck, mkfs, mount, FsError, ImageLock, MkfsOptions, MountOptions};
use nix::fcntl::{Flock, FlockArg};

mod common;

fn force() -> MkfsOptions {
    MkfsOptions {
        journals: 1,
        journal_blocks: 256,
        force: true,
        ..MkfsOptions::default()
    }
}

/// A directory for a mountpoint, removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "aiosfs-lock-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Dir(p)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// An image whose lock another holder has (here an `flock(LOCK_EX)` of this process on a
/// descriptor of its own, as another `aios mount` holds it) is refused by mkfs, even with
/// `force`, and by mount, naming the image and the holder, and left unchanged; once the holder
/// lets go, mkfs goes ahead. Before the lock, mkfs wrote a fresh file system over it.
#[test]
fn mkfs_and_mount_refuse_an_image_whose_lock_is_held() {
    let img = ImageFile::new("lock-held", 16 << 20);
    let before = std::fs::read(&img.0).unwrap();
    let holder = Flock::lock(File::open(&img.0).unwrap(), FlockArg::LockExclusiveNonblock).unwrap();
    let in_use = format!("{}: in use", img.0.display());
    let by_me = format!("(process {})", std::process::id());

    let e = mkfs(&img.0, &force())
        .map(|_| ())
        .expect_err("mkfs --force went ahead on an image whose lock another holder has");
    assert!(
        e.to_string().starts_with(&in_use) && e.to_string().contains(&by_me),
        "{e}"
    );
    let mp = Dir::new("held");
    let e = mount(&img.0, &mp.0, &MountOptions::default())
        .map(|_| ())
        .expect_err("mount went ahead on an image whose lock another holder has");
    assert!(
        e.to_string().starts_with(&in_use) && e.to_string().contains(&by_me),
        "{e}"
    );
    assert!(
        std::fs::read(&img.0).unwrap() == before,
        "a refused opener changed the image"
    );

    drop(holder);
    mkfs(&img.0, &force()).unwrap();
    assert!(fsck(&img.0).unwrap().clean());
}

/// Openers racing for one image (eight threads released together, each keeping what it got
/// until all have tried): exactly one gets the lock, and every other one a typed
/// [`FsError::InUse`] naming the image and this process. While one holds it, mkfs is refused
/// the same way; once it is dropped, the lock and mkfs are to be had again.
#[test]
fn of_openers_racing_for_an_image_exactly_one_gets_it() {
    let img = ImageFile::new("lock-race", 16 << 20);
    let n = 8;
    let start = Arc::new(Barrier::new(n));
    let tried = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (path, start, tried) = (img.0.clone(), Arc::clone(&start), Arc::clone(&tried));
            std::thread::spawn(move || {
                start.wait();
                let r = ImageLock::exclusive(&path);
                // Held until every thread has tried.
                tried.wait();
                r.map(|l| l.path().to_path_buf())
            })
        })
        .collect();
    let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(won, vec![&img.0], "{results:?}");
    for r in &results {
        match r {
            Ok(_) => {}
            Err(FsError::InUse { image, holder }) => {
                assert_eq!(image, &img.0.display().to_string());
                assert_eq!(*holder, Some(std::process::id()));
            }
            Err(e) => panic!("not InUse: {e}"),
        }
    }

    let held = ImageLock::exclusive(&img.0).unwrap();
    match mkfs(&img.0, &force()) {
        Err(FsError::InUse { image, .. }) => assert_eq!(image, img.0.display().to_string()),
        r => panic!("mkfs under a held lock: {:?}", r.map(|sb| sb.blocks)),
    }
    drop(held);
    mkfs(&img.0, &force()).unwrap();
    drop(ImageLock::exclusive(&img.0).unwrap());
}

/// A mount holds the lock: a second mount of the image and mkfs are refused with
/// [`FsError::InUse`]. Once it is unmounted (its `run` returned) the lock is let go, the image
/// checks clean and mounts again, and a mount dropped without running lets go as well.
#[test]
fn a_mount_holds_the_image_lock_until_it_is_unmounted() {
    let is_root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|u| u.split_whitespace().nth(1).map(|e| e == "0"))
            .unwrap_or(false)
    });
    if !is_root || !std::path::Path::new("/dev/fuse").exists() {
        eprintln!("SKIPPED: mounting through FUSE needs root and /dev/fuse");
        return;
    }
    let img = ImageFile::new("lock-mount", 16 << 20);
    let (mp1, mp2) = (Dir::new("mp1"), Dir::new("mp2"));
    let opts = MountOptions {
        threads: 1,
        ..MountOptions::default()
    };
    let m = mount(&img.0, &mp1.0, &opts).unwrap();
    let me = Some(std::process::id());
    match mount(&img.0, &mp2.0, &opts) {
        Err(FsError::InUse { holder, .. }) => assert_eq!(holder, me),
        r => panic!("a second mount: {:?}", r.map(|_| ())),
    }
    match mkfs(&img.0, &force()) {
        Err(FsError::InUse { holder, .. }) => assert_eq!(holder, me),
        r => panic!("mkfs under a mount: {:?}", r.map(|sb| sb.blocks)),
    }
    let mp = mp1.0.clone();
    let serving = std::thread::spawn(move || m.run());
    // Unmounted as `umount MOUNTPOINT` does; `run` returns once the session has ended.
    let mut unmounted = false;
    for _ in 0..500 {
        if nix::mount::umount(&mp).is_ok() {
            unmounted = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(unmounted, "could not unmount {}", mp.display());
    serving.join().unwrap().unwrap();
    drop(ImageLock::exclusive(&img.0).expect("the lock outlived the unmount"));
    let r = fsck(&img.0).unwrap();
    assert!(r.clean(), "{:?}", r.problems);

    // Mounted again, and dropped without running: the lock goes with it.
    let m = mount(&img.0, &mp1.0, &opts).unwrap();
    assert!(matches!(
        ImageLock::exclusive(&img.0),
        Err(FsError::InUse { .. })
    ));
    drop(m);
    drop(ImageLock::exclusive(&img.0).expect("the lock outlived the dropped mount"));
    mkfs(&img.0, &force()).unwrap();
}
