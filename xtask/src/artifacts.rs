//! Project binaries for the guest: `bin:NAME`, `test:NAME`, `bench:NAME`, built by nested cargo runs.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Bin,
    Test,
    Bench,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Bin => "bin",
            Kind::Test => "test",
            Kind::Bench => "bench",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Spec {
    pub kind: Kind,
    pub name: String,
}

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.kind.as_str(), self.name)
    }
}

impl std::str::FromStr for Spec {
    type Err = String;
    fn from_str(s: &str) -> Result<Spec, String> {
        let (kind, name) = s
            .split_once(':')
            .ok_or_else(|| format!("artifact {s:?} is not KIND:NAME"))?;
        let kind = match kind {
            "bin" => Kind::Bin,
            "test" => Kind::Test,
            "bench" => Kind::Bench,
            _ => return Err(format!("artifact {s:?}: kind must be bin, test or bench")),
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(format!("artifact {s:?}: bad name"));
        }
        Ok(Spec {
            kind,
            name: name.to_string(),
        })
    }
}

/// `bin:aios,test:nvme_lab` → specs; an empty string → none.
pub fn parse_list(s: &str) -> Result<Vec<Spec>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::parse)
        .collect()
}

/// The executable cargo reported for the target `name` of `kind`, from its JSON messages.
pub fn find_executable(messages: &str, kind: Kind, name: &str) -> Option<PathBuf> {
    messages
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .filter(|m| {
            m["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == kind.as_str()))
        })
        .filter_map(|m| m["executable"].as_str().map(PathBuf::from))
        .next_back()
}

/// Builds every spec (one cargo run per kind) and returns each with its executable.
pub fn build(root: &Path, specs: &[Spec]) -> Result<Vec<(Spec, PathBuf)>, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut built = Vec::new();
    for kind in [Kind::Bin, Kind::Test, Kind::Bench] {
        let names: Vec<&str> = specs
            .iter()
            .filter(|s| s.kind == kind)
            .map(|s| s.name.as_str())
            .collect();
        if names.is_empty() {
            continue;
        }
        let mut cmd = Command::new(&cargo);
        match kind {
            Kind::Bin => cmd.args(["build", "--release"]),
            Kind::Test => cmd.args(["test", "--release", "--no-run"]),
            Kind::Bench => cmd.args(["bench", "--no-run"]),
        };
        for n in &names {
            cmd.arg(format!("--{}", kind.as_str())).arg(n);
        }
        // The guest has Soft-RoCE: its binaries carry the RDMA transport (tests/rdma_lab.rs,
        // `aios target --transport rdma`).
        cmd.args(["--features", "rdma"]);
        // Diagnostics are rendered on stderr (inherited, with cargo's progress); stdout is JSON.
        cmd.arg("--message-format=json-render-diagnostics")
            .current_dir(root)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let shown = format!(
            "cargo {}",
            cmd.get_args()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        );
        crate::say(&format!("lab: {shown}"));
        let mut child = cmd.spawn().map_err(|e| format!("cannot run cargo: {e}"))?;
        let mut messages = String::new();
        for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
            let line = line.map_err(|e| e.to_string())?;
            messages.push_str(&line);
            messages.push('\n');
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!(
                "`{shown}` failed ({status}); cargo's errors are above"
            ));
        }
        for spec in specs.iter().filter(|s| s.kind == kind) {
            let exe = find_executable(&messages, kind, &spec.name)
                .ok_or_else(|| format!("`{shown}` reported no executable for {spec}"))?;
            built.push((spec.clone(), exe));
        }
    }
    Ok(built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let list = parse_list("bin:aios, test:nvme_lab,bench:lbio_mem,").unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(
            list[0],
            Spec {
                kind: Kind::Bin,
                name: "aios".into()
            }
        );
        assert_eq!(list[2].to_string(), "bench:lbio_mem");
        assert!(parse_list("").unwrap().is_empty());
        assert!(parse_list("aios").is_err());
        assert!(parse_list("lib:x").is_err());
        assert!(parse_list("bin:a b").is_err());
    }

    #[test]
    fn executable_from_cargo_messages() {
        let msgs = r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"aios"},"executable":null}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"aios"},"executable":"/t/release/deps/aios-1"}
{"reason":"compiler-artifact","target":{"kind":["test"],"name":"nvme_lab"},"executable":"/t/release/deps/nvme_lab-2"}
{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"aios"},"executable":"/t/release/aios"}
{"reason":"build-finished","success":true}"#;
        assert_eq!(
            find_executable(msgs, Kind::Bin, "aios"),
            Some(PathBuf::from("/t/release/aios"))
        );
        assert_eq!(
            find_executable(msgs, Kind::Test, "nvme_lab"),
            Some(PathBuf::from("/t/release/deps/nvme_lab-2"))
        );
        assert_eq!(find_executable(msgs, Kind::Bench, "nvme_lab"), None);
    }
}
