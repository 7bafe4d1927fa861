//! Blocking API: open a device (or a scratch file), write a pattern, flush, read it back.
//!
//! ```text
//! cargo run --example blocking                 # scratch file in /var/tmp
//! cargo run --example blocking -- /dev/loop0   # a device you are willing to overwrite
//! ```

use std::path::PathBuf;
use std::rc::Rc;

use aios::core::{Engine, EngineConfig};
use aios::lbio::{Device, DeviceConfig, LbioArray, LbioConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (path, scratch) = match std::env::args().nth(1) {
        Some(p) => (PathBuf::from(p), false),
        None => {
            let p = PathBuf::from(format!("/var/tmp/aios-example-{}.img", std::process::id()));
            std::fs::File::create(&p)?.set_len(16 << 20)?;
            (p, true)
        }
    };
    let engine = Engine::new(EngineConfig::default())?;
    let lbio = LbioArray::new(Rc::clone(&engine), LbioConfig::default())?;
    let dev = Device::open(
        &lbio,
        &path,
        DeviceConfig {
            write: true,
            ..DeviceConfig::default()
        },
    )?;
    let (route, why) = dev.critical_route();
    println!(
        "{}: critical requests via {} ({why})",
        path.display(),
        route.name
    );

    // 64 KiB write, durable when it returns (FUA), then read back into a fresh buffer.
    let mut buf = engine.alloc_blocking(64 << 10)?;
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let written = dev.write_at_blocking(1 << 20, buf, true)?;
    dev.flush_blocking()?;
    let back = dev.read_at_blocking(1 << 20, engine.alloc_blocking(64 << 10)?)?;
    assert_eq!(&back[..], &written[..]);
    println!(
        "wrote and read back {} bytes at offset 1 MiB: identical",
        back.len()
    );

    // Bad input is a typed error, not a panic.
    let mut odd = engine.alloc_blocking(4096)?;
    odd.set_len(1000)?;
    match dev.read_at_blocking(0, odd) {
        Err(e) => println!("as expected: {e}"),
        Ok(_) => return Err("a 1000-byte direct read should have been refused".into()),
    }
    drop(dev);
    if scratch {
        std::fs::remove_file(&path)?;
    }
    Ok(())
}
