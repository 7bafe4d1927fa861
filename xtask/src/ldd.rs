//! Shared libraries of a host binary, from `ldd`, so they can be copied into the guest.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Parses `ldd` output into the absolute paths of the libraries (the dynamic loader included).
/// A statically linked binary has none. A library `ldd` could not find is an error.
pub fn parse(out: &str) -> Result<Vec<PathBuf>, String> {
    let mut libs = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not a dynamic executable") || line == "statically linked" {
            return Ok(Vec::new());
        }
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)", "libfoo.so => not found",
        // "/lib64/ld-linux-x86-64.so.2 (0x…)", "linux-vdso.so.1 (0x…)" (in the kernel: skipped).
        let (name, resolved) = match line.split_once(" => ") {
            Some((name, rest)) => (name.trim(), rest.trim()),
            None => (line, line),
        };
        if resolved.starts_with("not found") {
            return Err(format!("ldd: library {name} not found"));
        }
        let path = resolved.split(" (0x").next().unwrap_or("").trim();
        if path.starts_with('/') {
            let path = PathBuf::from(path);
            if !libs.contains(&path) {
                libs.push(path);
            }
        }
    }
    Ok(libs)
}

/// Runs `ldd` on `bin`.
pub fn libraries(bin: &Path) -> Result<Vec<PathBuf>, String> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| format!("cannot run ldd: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let libs = parse(&text)?;
    if !out.status.success() && !libs.is_empty() {
        return Err(format!("ldd {} failed: {}", bin.display(), text.trim()));
    }
    Ok(libs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typical_rust_binary() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd5b9f2000)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f6eaf55a000)\n\
                   \tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x00007f6eaf120000)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f6eaef3e000)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f6eaf590000)\n";
        let libs = parse(out).unwrap();
        let libs: Vec<&str> = libs.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            libs,
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libm.so.6",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2",
            ]
        );
    }

    #[test]
    fn static_binaries_have_no_libraries() {
        assert!(parse("\tnot a dynamic executable\n").unwrap().is_empty());
        assert!(parse("\tstatically linked\n").unwrap().is_empty());
    }

    #[test]
    fn missing_library_is_an_error() {
        let err =
            parse("\tlibfoo.so.1 => not found\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n").unwrap_err();
        assert!(err.contains("libfoo.so.1"), "{err}");
    }

    #[test]
    fn arrow_without_path_and_duplicates() {
        let out = "\tlinux-gate.so.1 =>  (0x00007fff)\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n\tlibc.so.6 => /lib/libc.so.6 (0x1)\n";
        assert_eq!(parse(out).unwrap(), [PathBuf::from("/lib/libc.so.6")]);
    }
}
