//! Helpers shared by the SimDisk tests: a fresh image made by mkfs, and the file system opened
//! on a SimDisk holding it.

use std::rc::Rc;
use std::sync::Arc;

use fs_fuse::fs::{DeviceFactory, Fs, FsOptions};
use fs_fuse::{mkfs, FsError, MkfsOptions};
use lbio::{LbioArray, SimConfig, SimDisk};

/// Small arenas and a small page cache (64 frames): these tests open thousands of file
/// systems.
pub fn opts() -> FsOptions {
    FsOptions {
        arena_bytes: 2 << 20,
        cache_bytes: 256 << 10,
        ..FsOptions::default()
    }
}

/// [`opts`] with Rio-ordered commits.
#[allow(dead_code)]
pub fn opts_rio() -> FsOptions {
    FsOptions {
        rio: true,
        ..opts()
    }
}

/// [`opts`] with one-write commits (`CommitMode::OneWrite`).
#[allow(dead_code)]
pub fn opts_one_write() -> FsOptions {
    FsOptions {
        commit_mode: journal::CommitMode::OneWrite,
        ..opts()
    }
}

pub fn factory(disk: &SimDisk) -> DeviceFactory {
    let d = disk.clone();
    Arc::new(move |lbio: &Rc<LbioArray>| d.open(lbio).map_err(FsError::from))
}

/// An empty aiosfs of `bytes` (one journal area of 256 blocks), made by mkfs on a file.
pub fn fresh_image(bytes: u64) -> Vec<u8> {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("aiosfs-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("base.img");
    std::fs::File::create(&img).unwrap().set_len(bytes).unwrap();
    mkfs(
        &img,
        &MkfsOptions {
            journals: 1,
            journal_blocks: 256,
            ..MkfsOptions::default()
        },
    )
    .unwrap();
    let base = std::fs::read(&img).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    base
}

/// The file system on a SimDisk holding `image`.
#[allow(dead_code)]
pub fn open(image: Vec<u8>, seed: u64) -> Result<(SimDisk, Arc<Fs>), FsError> {
    let disk = SimDisk::from_image(SimConfig::new(image.len() as u64, seed), image).unwrap();
    let (fs, _) = Fs::open(factory(&disk), opts())?;
    Ok((disk, fs))
}

/// A fresh aiosfs image (mkfs'd, [`fresh_image`]) in a real file under the temp directory, for
/// tests that need the device's own timing (O_DIRECT writes); removed when dropped.
#[allow(dead_code)]
pub struct ImageFile(pub std::path::PathBuf);

#[allow(dead_code)]
impl ImageFile {
    pub fn new(tag: &str, bytes: u64) -> ImageFile {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "aiosfs-{tag}-{}-{}.img",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::write(&path, fresh_image(bytes)).unwrap();
        ImageFile(path)
    }

    /// The file system on it, opened as `aios mount` opens an image.
    pub fn open(&self) -> Arc<Fs> {
        Fs::open(fs_fuse::mount::image_factory(&self.0), opts())
            .unwrap()
            .0
    }
}

impl Drop for ImageFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Grow file `ino`'s one extent, on the unmounted image at `path`, to `blocks` blocks, and mark
/// them in use in the block bitmap: a file of many blocks without writing them. Returns the
/// extent's first block.
#[allow(dead_code)]
pub fn grow_first_extent(path: &std::path::Path, ino: u64, blocks: u64) -> u64 {
    use fs_fuse::format::{set_bit, Inode, Superblock, BLOCK, INODES_PER_BLOCK, INODE_BYTES};
    use std::os::unix::fs::FileExt;
    let b = BLOCK as u64;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut blk = vec![0u8; BLOCK];
    file.read_exact_at(&mut blk, 0).unwrap();
    let sb = Superblock::decode(&blk, file.metadata().unwrap().len() / b).unwrap();
    let tb = sb.inode_table.start + ino / INODES_PER_BLOCK as u64;
    let at = (ino % INODES_PER_BLOCK as u64) as usize * INODE_BYTES;
    file.read_exact_at(&mut blk, tb * b).unwrap();
    let mut inode: Inode = Inode::decode(&blk[at..at + INODE_BYTES]).unwrap().unwrap();
    assert_eq!(inode.extents.len(), 1);
    let p0 = inode.extents[0].physical;
    assert!(p0 + blocks <= sb.data.end());
    inode.extents[0].len = blocks as u32;
    inode.size = blocks * b;
    inode.encode(&mut blk[at..at + INODE_BYTES]);
    file.write_all_at(&blk, tb * b).unwrap();
    let mut bbm = vec![0u8; (sb.block_bitmap.count * b) as usize];
    file.read_exact_at(&mut bbm, sb.block_bitmap.start * b)
        .unwrap();
    for p in p0..p0 + blocks {
        set_bit(&mut bbm, p);
    }
    file.write_all_at(&bbm, sb.block_bitmap.start * b).unwrap();
    file.sync_all().unwrap();
    p0
}
