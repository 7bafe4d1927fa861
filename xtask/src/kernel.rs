//! The guest kernel: Debian's `linux-image-*` package, fetched with apt and unpacked with `dpkg -x`,
//! and its modules (found by name, dependencies read from their `.modinfo` sections).

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{run_checked, say};

pub const META_PACKAGE: &str = "linux-image-amd64";
pub const PKG_ENV: &str = "AIOS_LAB_KERNEL_PKG";
/// The Debian suite the kernel comes from (default `<codename>-backports`), e.g.
/// `trixie-backports` for a newer kernel than bookworm's backports carry.
pub const SUITE_ENV: &str = "AIOS_LAB_KERNEL_SUITE";
const COMPLETE: &str = ".aios-lab-complete";

pub struct Kernel {
    pub pkg: String,
    pub version: String,
    pub vmlinuz: PathBuf,
    /// `…/lib/modules/<version>`
    pub modules_dir: PathBuf,
    /// Normalized names of modules built into the kernel.
    builtin: HashSet<String>,
    /// Normalized name → path of the `.ko` (or `.ko.xz`) under `kernel/`.
    index: BTreeMap<String, PathBuf>,
}

/// Module names as the kernel compares them: `-` and `_` are the same.
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The package `linux-image-amd64` depends on, from `apt-cache depends` output.
pub fn parse_depends(out: &str) -> Option<String> {
    out.lines().find_map(|l| {
        let l = l.trim().trim_start_matches('|');
        let dep = l.strip_prefix("Depends:")?.trim();
        (dep.starts_with("linux-image-") && !dep.starts_with('<')).then(|| dep.to_string())
    })
}

/// Where the kernel package comes from.
pub enum Source {
    /// The machine's own apt sources (for a package named in `AIOS_LAB_KERNEL_PKG`).
    System,
    /// `<codename>-backports` (or `AIOS_LAB_KERNEL_SUITE`), through a private apt configuration
    /// under `target/lab/apt/` (the machine's sources are not touched).
    Backports(PathBuf),
}

impl Source {
    fn apt_options(&self) -> Vec<String> {
        match self {
            Source::System => Vec::new(),
            Source::Backports(dir) => vec![
                format!(
                    "-oDir::Etc::SourceList={}",
                    dir.join("sources.list").display()
                ),
                "-oDir::Etc::SourceParts=/dev/null".to_string(),
                format!("-oDir::State::Lists={}", dir.join("lists").display()),
                format!("-oDir::Cache={}", dir.join("cache").display()),
            ],
        }
    }
}

fn codename() -> String {
    fs::read_to_string("/etc/os-release")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("VERSION_CODENAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
        })
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "bookworm".to_string())
}

/// The kernel package to boot: `AIOS_LAB_KERNEL_PKG` from the machine's apt sources, or else the
/// newest Debian kernel of `<codename>-backports` (6.12 for bookworm). The backports kernel is the
/// default because 6.1 (bookworm's own) refuses registered buffers for NVMe passthrough whenever
/// the registered buffer spans more pages than the device's max segments.
pub fn resolve_package(lab_dir: &Path) -> Result<(String, Source), String> {
    if let Ok(pkg) = std::env::var(PKG_ENV) {
        if !pkg.is_empty() {
            return Ok((pkg, Source::System));
        }
    }
    let default_suite = format!("{}-backports", codename());
    let suite = std::env::var(SUITE_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or(default_suite.clone());
    if !suite.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(format!("{SUITE_ENV}={suite:?} is not a suite name"));
    }
    // The default suite keeps the directory earlier runs used; others get their own.
    let dir = if suite == default_suite {
        lab_dir.join("apt")
    } else {
        lab_dir.join(format!("apt-{suite}"))
    };
    for sub in ["lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(dir.join(sub)).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let list = format!("deb http://deb.debian.org/debian {suite} main\n");
    let sources = dir.join("sources.list");
    let fresh = fs::read_to_string(&sources).ok().as_deref() == Some(list.as_str())
        && fs::metadata(dir.join("lists"))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() < 24 * 3600)
        && fs::read_dir(dir.join("lists"))
            .map(|d| d.count() > 2)
            .unwrap_or(false);
    let source = Source::Backports(dir.clone());
    if !fresh {
        fs::write(&sources, &list).map_err(|e| format!("{}: {e}", sources.display()))?;
        say(&format!(
            "lab: apt-get update ({suite}, private lists in {})",
            dir.display()
        ));
        let mut cmd = Command::new("apt-get");
        cmd.args(source.apt_options()).args(["-q", "update"]);
        run_checked(&mut cmd, "apt-get update (backports)")?;
    }
    let out = Command::new("apt-cache")
        .args(source.apt_options())
        .args(["depends", META_PACKAGE])
        .output()
        .map_err(|e| {
            format!("cannot run apt-cache (set {PKG_ENV} and provide a cached kernel): {e}")
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let pkg = parse_depends(&text).ok_or_else(|| {
        format!(
            "apt-cache depends {META_PACKAGE} ({suite}) names no linux-image package (exit {}): {}{}",
            out.status,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    Ok((pkg, source))
}

/// Downloads (once) and unpacks (once) the kernel package under `lab_dir`.
pub fn fetch(pkg: &str, source: &Source, lab_dir: &Path) -> Result<Kernel, String> {
    if pkg.is_empty() || pkg.contains('/') || pkg.starts_with('.') {
        return Err(format!("bad kernel package name {pkg:?}"));
    }
    let root = lab_dir.join("kernel").join(pkg);
    if root.join(COMPLETE).exists() {
        say(&format!("lab: kernel {pkg} cached in {}", root.display()));
    } else {
        let cache = lab_dir.join("cache");
        fs::create_dir_all(&cache).map_err(|e| format!("{}: {e}", cache.display()))?;
        let tmp = lab_dir.join("kernel").join(format!(".{pkg}.unpacking"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        unpack(&download(pkg, source, &cache)?, &tmp)?;
        if find_layout(&tmp).is_none() {
            // Newer Debian kernels (7.x) split the image: `linux-image-V` only depends on
            // `linux-binary-V` (vmlinuz), `linux-modules-V` and `linux-base-V` (modules.*).
            let v = pkg.strip_prefix("linux-image-").unwrap_or(pkg);
            for part in ["binary", "modules", "base"] {
                let p = format!("linux-{part}-{v}");
                unpack(&download(&p, source, &cache)?, &tmp)?;
            }
        }
        fs::write(tmp.join(COMPLETE), pkg).map_err(|e| e.to_string())?;
        let _ = fs::remove_dir_all(&root);
        fs::rename(&tmp, &root)
            .map_err(|e| format!("rename {} → {}: {e}", tmp.display(), root.display()))?;
    }
    Kernel::open(pkg, &root)
}

/// The package's `.deb` in `cache`, downloaded once.
fn download(pkg: &str, source: &Source, cache: &Path) -> Result<PathBuf, String> {
    if let Some(deb) = find_deb(cache, pkg) {
        return Ok(deb);
    }
    say(&format!("lab: fetching {pkg} (apt-get download) …"));
    let mut cmd = Command::new("apt-get");
    cmd.args(source.apt_options())
        .args(["download", pkg])
        .current_dir(cache);
    run_checked(&mut cmd, "apt-get download")?;
    find_deb(cache, pkg).ok_or_else(|| {
        format!(
            "apt-get download left no {pkg}_*.deb in {}",
            cache.display()
        )
    })
}

fn unpack(deb: &Path, into: &Path) -> Result<(), String> {
    say(&format!("lab: unpacking {} …", deb.display()));
    let mut cmd = Command::new("dpkg");
    cmd.arg("-x").arg(deb).arg(into);
    run_checked(&mut cmd, "dpkg -x")
}

/// Where an unpacked kernel keeps its modules and image: `(lib/modules/V, vmlinuz)` under
/// `root`, for the classic layout (`lib/modules`, `boot/vmlinuz-V`) and the merged-/usr one
/// (`usr/lib/modules/V/vmlinuz`). `None` until both are there.
fn find_layout(root: &Path) -> Option<(PathBuf, PathBuf)> {
    for mods in ["lib/modules", "usr/lib/modules"] {
        let Ok(rd) = fs::read_dir(root.join(mods)) else {
            continue;
        };
        for e in rd.flatten() {
            let v = e.file_name().into_string().ok()?;
            let dir = root.join(mods).join(&v);
            for img in [
                root.join("boot").join(format!("vmlinuz-{v}")),
                dir.join("vmlinuz"),
            ] {
                if img.is_file() && dir.join("kernel").is_dir() {
                    return Some((dir, img));
                }
            }
        }
    }
    None
}

fn find_deb(cache: &Path, pkg: &str) -> Option<PathBuf> {
    let prefix = format!("{pkg}_");
    let mut debs: Vec<PathBuf> = fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(&prefix) && name.ends_with(".deb")
        })
        .collect();
    debs.sort();
    debs.pop()
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            walk(&entry.path(), out)?;
        } else {
            out.push(entry.path());
        }
    }
    Ok(())
}

impl Kernel {
    fn open(pkg: &str, root: &Path) -> Result<Kernel, String> {
        let (modules_dir, vmlinuz) = find_layout(root).ok_or_else(|| {
            format!(
                "{}: no kernel image with modules (lib/modules/V and boot/vmlinuz-V, or usr/lib/modules/V/vmlinuz)",
                root.display()
            )
        })?;
        let version = modules_dir
            .file_name()
            .and_then(|v| v.to_str())
            .ok_or("kernel version directory is not UTF-8")?
            .to_string();
        let builtin = fs::read_to_string(modules_dir.join("modules.builtin"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                Some(normalize(
                    Path::new(l).file_name()?.to_str()?.strip_suffix(".ko")?,
                ))
            })
            .collect();
        let mut files = Vec::new();
        walk(&modules_dir.join("kernel"), &mut files)
            .map_err(|e| format!("{}: {e}", modules_dir.display()))?;
        let index = files
            .into_iter()
            .filter_map(|p| {
                let name = p.file_name()?.to_str()?;
                let stem = name
                    .strip_suffix(".ko")
                    .or_else(|| name.strip_suffix(".ko.xz"))?;
                Some((normalize(stem), p))
            })
            .collect();
        Ok(Kernel {
            pkg: pkg.to_string(),
            version,
            vmlinuz,
            modules_dir,
            builtin,
            index,
        })
    }

    /// A kernel with no modules on disk, for tests of what is generated from one.
    #[cfg(test)]
    pub fn for_test(version: &str) -> Kernel {
        Kernel {
            pkg: format!("linux-image-{version}"),
            version: version.to_string(),
            vmlinuz: PathBuf::from("/nonexistent/vmlinuz"),
            modules_dir: PathBuf::from("/nonexistent/lib/modules").join(version),
            builtin: HashSet::new(),
            index: BTreeMap::new(),
        }
    }

    /// Bytes of a module, decompressed if it is a `.ko.xz`.
    pub fn module_bytes(path: &Path) -> Result<Vec<u8>, String> {
        if path.extension().is_some_and(|e| e == "xz") {
            let out = Command::new("xz")
                .arg("-dc")
                .arg(path)
                .stderr(Stdio::inherit())
                .output()
                .map_err(|e| format!("cannot run xz: {e}"))?;
            if !out.status.success() {
                return Err(format!("xz -dc {} failed ({})", path.display(), out.status));
            }
            Ok(out.stdout)
        } else {
            fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
        }
    }

    /// Works out what to load, in order: each wanted module after the modules it depends on
    /// (`depends=` in its `.modinfo`), skipping those built into the kernel. Parameters are checked
    /// against the module's `parm=` entries.
    pub fn plan_modules(&self, wanted: &[(&str, &str)]) -> Result<Vec<ModuleLoad>, String> {
        let mut plan = Vec::new();
        let mut seen = HashSet::new();
        for (name, params) in wanted {
            self.add_module(name, params, false, &mut seen, &mut plan, 0)?;
        }
        Ok(plan)
    }

    fn add_module(
        &self,
        name: &str,
        params: &str,
        implied: bool,
        seen: &mut HashSet<String>,
        plan: &mut Vec<ModuleLoad>,
        depth: usize,
    ) -> Result<(), String> {
        let (name, optional) = match name.strip_prefix('?') {
            Some(n) => (n, true),
            None => (name, false),
        };
        let key = normalize(name);
        if depth > 32 {
            return Err(format!("module dependency loop at {name}"));
        }
        if !seen.insert(key.clone()) {
            return Ok(());
        }
        if self.builtin.contains(&key) {
            if !params.is_empty() {
                say(&format!("lab: warning: {name} is built in; parameters {params:?} only apply on the kernel command line"));
            }
            plan.push(ModuleLoad {
                name: name.to_string(),
                file: None,
                params: params.to_string(),
                implied,
            });
            return Ok(());
        }
        if optional && !self.index.contains_key(&key) {
            say(&format!(
                "lab: {name} is not a module of this kernel (built in or merged): not loaded"
            ));
            return Ok(());
        }
        let path = self.index.get(&key).ok_or_else(|| {
            format!(
                "module {name} not found under {}",
                self.modules_dir.display()
            )
        })?;
        let info =
            modinfo(&Self::module_bytes(path)?).map_err(|e| format!("{}: {e}", path.display()))?;
        let parms: Vec<&str> = info
            .iter()
            .filter(|(k, _)| k == "parm")
            .filter_map(|(_, v)| v.split(':').next())
            .collect();
        for p in params.split_whitespace() {
            let key = p.split('=').next().unwrap_or(p);
            if !parms.contains(&key) {
                return Err(format!(
                    "module {name} has no parameter {key:?}; it has: {}",
                    parms.join(" ")
                ));
            }
        }
        for (k, v) in &info {
            if k == "depends" {
                for dep in v.split(',').filter(|d| !d.is_empty()) {
                    self.add_module(dep, "", true, seen, plan, depth + 1)?;
                }
            }
        }
        let rel = path
            .strip_prefix(&self.modules_dir)
            .map_err(|e| e.to_string())?;
        plan.push(ModuleLoad {
            name: name.to_string(),
            file: Some((path.clone(), rel.to_path_buf())),
            params: params.to_string(),
            implied,
        });
        Ok(())
    }
}

pub struct ModuleLoad {
    pub name: String,
    /// (host path, path relative to `lib/modules/<version>`); `None` when built in.
    pub file: Option<(PathBuf, PathBuf)>,
    pub params: String,
    /// Pulled in as a dependency of a module that was asked for.
    pub implied: bool,
}

/// `key=value` strings of an ELF object's `.modinfo` section.
pub fn modinfo(elf: &[u8]) -> Result<Vec<(String, String)>, String> {
    let section = elf_section(elf, ".modinfo")?.ok_or("no .modinfo section")?;
    Ok(section
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            let s = String::from_utf8_lossy(s);
            let (k, v) = s.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect())
}

/// The contents of a named section of a little-endian ELF64 file.
fn elf_section<'a>(elf: &'a [u8], want: &str) -> Result<Option<&'a [u8]>, String> {
    let bytes = |at: usize, n: usize| {
        elf.get(at..at + n)
            .ok_or_else(|| "truncated ELF file".to_string())
    };
    let u16_at = |at| bytes(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as usize);
    let u32_at = |at| bytes(at, 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize);
    let u64_at = |at| bytes(at, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    if bytes(0, 6)? != b"\x7fELF\x02\x01" {
        return Err("not a little-endian ELF64 file".into());
    }
    let (shoff, shentsize, shnum, shstrndx) =
        (u64_at(0x28)?, u16_at(0x3a)?, u16_at(0x3c)?, u16_at(0x3e)?);
    // Section header: name (u32) at 0, offset (u64) at 0x18, size (u64) at 0x20.
    let sh = |i: usize| -> Result<(usize, usize, usize), String> {
        let at = shoff + i * shentsize;
        Ok((u32_at(at)?, u64_at(at + 0x18)?, u64_at(at + 0x20)?))
    };
    let (_, str_off, str_size) = sh(shstrndx)?;
    let strtab = bytes(str_off, str_size)?;
    for i in 0..shnum {
        let (name_off, off, size) = sh(i)?;
        let name = strtab.get(name_off..).unwrap_or(&[]);
        let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
        if name == want.as_bytes() {
            return Ok(Some(bytes(off, size)?));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_of_the_meta_package() {
        let out = "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n";
        assert_eq!(
            parse_depends(out).as_deref(),
            Some("linux-image-6.1.0-56-amd64")
        );
        let out = "linux-image-amd64\n |Depends: <linux-image-virtual>\n  Depends: linux-image-6.1.0-9-amd64\n";
        assert_eq!(
            parse_depends(out).as_deref(),
            Some("linux-image-6.1.0-9-amd64")
        );
        assert_eq!(parse_depends("linux-image-amd64\n"), None);
    }

    /// A minimal ELF64 with a section-name table and a `.modinfo` section.
    fn tiny_elf(modinfo: &[u8]) -> Vec<u8> {
        let shstr = b"\0.shstrtab\0.modinfo\0";
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let shstr_off = f.len();
        f.extend_from_slice(shstr);
        let mi_off = f.len();
        f.extend_from_slice(modinfo);
        while f.len() % 8 != 0 {
            f.push(0);
        }
        let shoff = f.len();
        let section = |name: u32, off: usize, size: usize| {
            let mut s = vec![0u8; 64];
            s[..4].copy_from_slice(&name.to_le_bytes());
            s[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            s[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            s
        };
        f.extend(section(0, 0, 0));
        f.extend(section(1, shstr_off, shstr.len()));
        f.extend(section(11, mi_off, modinfo.len()));
        f[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        f[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        f[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        f[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        f
    }

    #[test]
    fn modinfo_from_elf_section() {
        let elf = tiny_elf(b"parm=gb:Size in GB\0\0depends=configfs\0license=GPL\0");
        let info = modinfo(&elf).unwrap();
        assert_eq!(
            info,
            [
                ("parm".to_string(), "gb:Size in GB".to_string()),
                ("depends".to_string(), "configfs".to_string()),
                ("license".to_string(), "GPL".to_string()),
            ]
        );
        assert!(modinfo(b"not elf at all, long enough").is_err());
    }
}
