//! What the guest runs: the default plan (data, in one place) and ad-hoc `--step` lists.

use crate::artifacts::{self, Spec};

/// Block and character devices every lab guest has; `/init` waits for them before the steps.
pub const LAB_DEVICES: &[&str] = &["/dev/nvme0n1", "/dev/ng0n1", "/dev/nullb0"];

/// Modules loaded by `/init`, in order, with their parameters (dependencies are added before them).
/// A leading `?` marks a module loaded only if this kernel has it as a module: the CRC and T10-PI
/// helpers NVMe needs on 6.1 are built in or folded into the block layer on later kernels.
pub const MODULES: &[(&str, &str)] = &[
    ("?crct10dif_common", ""),
    ("?crc64", ""),
    ("?crc-t10dif", ""),
    ("?crc64-rocksoft", ""),
    ("?t10-pi", ""),
    ("nvme-core", ""),
    // `nvme.poll_queues=1` on the kernel command line only reaches a module through modprobe;
    // insmod needs the parameter itself.
    ("nvme", "poll_queues=1"),
    (
        "null_blk",
        "queue_mode=2 poll_queues=1 memory_backed=1 gb=1 nr_devices=2",
    ),
    // NVMe/TCP: the kernel's host and target, for interoperability with rio-net (tcp_lab).
    ("nvme-tcp", ""),
    ("nvmet-tcp", ""),
    // Soft-RoCE for rio-net's RDMA transport (rdma_lab): rxe needs the crc32 algorithm
    // registered first; rdma_ucm gives user space /dev/infiniband/rdma_cm; veth for its netdev.
    ("?crc32_generic", ""),
    ("veth", ""),
    ("rdma_ucm", ""),
    ("rdma_rxe", ""),
    // Delay and loss on a veth link (tcp-netem).
    ("sch_netem", ""),
];

struct StepDef {
    name: &'static str,
    /// Run by busybox `sh` in the guest, cwd `/tmp`, PATH `/aios/bin:/bin:…`.
    command: &'static str,
    artifacts: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
    /// The step ends its boot by cutting the guest's power (it resets the machine itself); the
    /// steps after it run in the next boot, on the same NVMe disk image and PMR file.
    cuts_power: bool,
}

const PMR_ENV: &[(&str, &str)] = &[
    ("AIOS_LAB_NVME_CHAR", "/dev/ng0n1"),
    ("AIOS_LAB_NVME_BLOCK", "/dev/nvme0n1"),
];

/// The default plan of `cargo xtask lab`.
const DEFAULT_PLAN: &[StepDef] = &[
    StepDef {
        name: "probe-ng",
        command: "aios probe /dev/ng0n1",
        artifacts: &["bin:aios"],
        env: &[],
        cuts_power: false,
    },
    StepDef {
        name: "probe-nvme",
        command: "aios probe /dev/nvme0n1",
        artifacts: &["bin:aios"],
        env: &[],
        cuts_power: false,
    },
    StepDef {
        name: "probe-nullb",
        command: "aios probe /dev/nullb0",
        artifacts: &["bin:aios"],
        env: &[],
        cuts_power: false,
    },
    StepDef {
        name: "nvme-tests",
        command: "nvme_lab --ignored --test-threads=1 --nocapture",
        artifacts: &["test:nvme_lab"],
        env: &[
            ("AIOS_LAB_NVME_CHAR", "/dev/ng0n1"),
            ("AIOS_LAB_NVME_BLOCK", "/dev/nvme0n1"),
            ("AIOS_LAB_NULLB", "/dev/nullb0"),
            ("AIOS_LAB_EXPECT_FIXED_BUFFERS", "1"),
        ],
        cuts_power: false,
    },
    StepDef {
        name: "bench-ng",
        command: "aios bench lbio --device /dev/ng0n1 --seconds 1 --rounds 1",
        artifacts: &["bin:aios"],
        env: &[],
        cuts_power: false,
    },
    StepDef {
        name: "bench-ng-iopoll",
        command: "aios bench lbio --device /dev/ng0n1 --seconds 1 --rounds 1 --iopoll",
        artifacts: &["bin:aios"],
        env: &[],
        cuts_power: false,
    },
    StepDef {
        name: "criterion-ng",
        command: "lbio_mem --bench device --warm-up-time 1 --measurement-time 2",
        artifacts: &["bench:lbio_mem"],
        env: &[("AIOS_BENCH_DEVICE", "/dev/ng0n1")],
        cuts_power: false,
    },
    // NVMe/TCP interoperability over the guest's loopback (tests/tcp_lab.rs): the kernel's
    // host against an aios target, then rio-net's initiator against the kernel's nvmet-tcp.
    StepDef {
        name: "tcp-linux-host",
        command: "ip link set lo up && tcp_lab --linux-host",
        artifacts: &["test:tcp_lab"],
        env: &[("AIOS_LAB_TCP_DEVICE", "/dev/nullb0")],
        cuts_power: false,
    },
    StepDef {
        name: "tcp-linux-target",
        command: "ip link set lo up && tcp_lab --linux-target",
        artifacts: &["test:tcp_lab"],
        env: &[("AIOS_LAB_TCP_DEVICE", "/dev/nullb0")],
        cuts_power: false,
    },
    // rio-net over RDMA: one Soft-RoCE device on a veth interface; the targets and the
    // initiator share it (rxe loops packets between its own addresses back in the kernel).
    StepDef {
        name: "rdma-rxe",
        command: "/usr/bin/ip link add va type veth peer name vb && /usr/bin/ip addr add 10.9.0.1/24 dev va && /usr/bin/ip link set va up && /usr/bin/ip link set vb up && ip link set lo up && /usr/bin/rdma link add rxe0 type rxe netdev va && /usr/bin/rdma link show && rdma_lab --integrity",
        artifacts: &["test:rdma_lab"],
        env: &[
            ("AIOS_LAB_RDMA_ADDR", "10.9.0.1"),
            ("AIOS_LAB_RDMA_DEVICES", "/dev/nullb0,/dev/nullb1"),
        ],
        cuts_power: false,
    },
    // rio-net over TCP through a slow, lossy link: two targets in network namespace `nt`, the
    // initiator in `ni`, netem adding 2 ms ± 1 ms of delay and 1 % loss on both veth ends
    // (`na`/`nb`: rdma-rxe's `va`/`vb` stay in the initial namespace).
    StepDef {
        name: "tcp-netem",
        command: "mount -t tmpfs tmpfs /run && mkdir -p /run/netns \
            && /usr/bin/ip netns add ni && /usr/bin/ip netns add nt \
            && /usr/bin/ip link add na type veth peer name nb \
            && /usr/bin/ip link set na netns ni && /usr/bin/ip link set nb netns nt \
            && /usr/bin/ip -n ni addr add 10.9.2.1/24 dev na && /usr/bin/ip -n nt addr add 10.9.2.2/24 dev nb \
            && /usr/bin/ip -n ni link set na up && /usr/bin/ip -n nt link set nb up \
            && /usr/bin/ip -n ni link set lo up && /usr/bin/ip -n nt link set lo up \
            && /usr/sbin/tc -n ni qdisc add dev na root netem delay 2ms 1ms loss 1% \
            && /usr/sbin/tc -n nt qdisc add dev nb root netem delay 2ms 1ms loss 1% \
            && /usr/sbin/tc -n ni qdisc show dev na || exit 1; \
            /usr/bin/ip netns exec nt aios target --listen 10.9.2.2:4460 --device /dev/nullb0 --ns-bytes 64m --format --streams 4 & p0=$!; \
            /usr/bin/ip netns exec nt aios target --listen 10.9.2.2:4461 --device /dev/nullb1 --ns-bytes 64m --format --streams 4 & p1=$!; \
            sleep 2; /usr/bin/ip netns exec ni rdma_lab --integrity --remote 10.9.2.2:4460,10.9.2.2:4461 --transport tcp; rc=$?; \
            kill $p0 $p1; wait; exit $rc",
        artifacts: &["bin:aios", "test:rdma_lab"],
        env: &[("AIOS_LAB_RDMA_DEVICES", "/dev/nullb0,/dev/nullb1")],
        cuts_power: false,
    },
    // Rio's attribute log on the controller's PMR across two power cuts (tests/pmr_lab.rs).
    StepDef {
        name: "pmr-cut-1",
        command: "pmr_lab --fresh --cut --seed 1",
        artifacts: &["test:pmr_lab"],
        env: PMR_ENV,
        cuts_power: true,
    },
    StepDef {
        name: "pmr-cut-2",
        command: "pmr_lab --cut --seed 2",
        artifacts: &["test:pmr_lab"],
        env: PMR_ENV,
        cuts_power: true,
    },
    StepDef {
        name: "pmr-recover",
        command: "pmr_lab",
        artifacts: &["test:pmr_lab"],
        env: PMR_ENV,
        cuts_power: false,
    },
];

#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub name: String,
    pub command: String,
    pub artifacts: Vec<Spec>,
    pub env: Vec<(String, String)>,
    /// The step cuts the guest's power: the boot ends with it, and the next boot runs the
    /// steps after it on the same disk image and PMR.
    pub cuts_power: bool,
}

/// The steps of each boot, as index ranges into `steps`: a boot ends after a step that cuts
/// the power.
pub fn boots(steps: &[Step]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, s) in steps.iter().enumerate() {
        if s.cuts_power {
            out.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < steps.len() || out.is_empty() {
        out.push(start..steps.len());
    }
    out
}

/// Steps run only when named with `--only`: they need a kernel other than the default one.
const EXTRA_STEPS: &[StepDef] = &[
    // rio-net over RDMA between two network namespaces: a veth pair with one end and one
    // Soft-RoCE device in each; two `aios target --transport rdma` processes in namespace `t`,
    // rdma_lab's initiator in namespace `i`. Needs a kernel whose rxe routes in the device's
    // namespace (7.x; 6.12's rxe sends through the initial namespace only):
    // `AIOS_LAB_KERNEL_SUITE=trixie-backports cargo xtask lab --only rdma-netns`.
    StepDef {
        name: "rdma-netns",
        command: "mount -t tmpfs tmpfs /run && mkdir -p /run/netns \
            && /usr/bin/ip netns add i && /usr/bin/ip netns add t \
            && /usr/bin/ip link add va type veth peer name vb \
            && /usr/bin/ip link set va netns i && /usr/bin/ip link set vb netns t \
            && /usr/bin/ip -n i addr add 10.9.1.1/24 dev va && /usr/bin/ip -n t addr add 10.9.1.2/24 dev vb \
            && /usr/bin/ip -n i link set va up && /usr/bin/ip -n t link set vb up \
            && /usr/bin/ip -n i link set lo up && /usr/bin/ip -n t link set lo up \
            && /usr/bin/ip netns exec i /usr/bin/rdma link add rxe0 type rxe netdev va \
            && /usr/bin/ip netns exec t /usr/bin/rdma link add rxe1 type rxe netdev vb \
            && /usr/bin/ip netns exec i ping -c 1 -W 5 10.9.1.2 >/dev/null || exit 1; \
            /usr/bin/ip netns exec t aios target --transport rdma --listen 10.9.1.2:4450 --device /dev/nullb0 --ns-bytes 64m --format --streams 4 & p0=$!; \
            /usr/bin/ip netns exec t aios target --transport rdma --listen 10.9.1.2:4451 --device /dev/nullb1 --ns-bytes 64m --format --streams 4 & p1=$!; \
            sleep 3; /usr/bin/ip netns exec i rdma_lab --integrity --remote 10.9.1.2:4450,10.9.1.2:4451; rc=$?; \
            kill $p0 $p1; wait; exit $rc",
        artifacts: &["bin:aios", "test:rdma_lab"],
        env: &[("AIOS_LAB_RDMA_DEVICES", "/dev/nullb0,/dev/nullb1")],
        cuts_power: false,
    },
];

fn to_steps(defs: &[StepDef]) -> Vec<Step> {
    defs.iter()
        .map(|d| Step {
            name: d.name.to_string(),
            command: d.command.to_string(),
            artifacts: d
                .artifacts
                .iter()
                .map(|a| a.parse().expect("valid artifact in the plan"))
                .collect(),
            env: d
                .env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cuts_power: d.cuts_power,
        })
        .collect()
}

pub fn default_plan() -> Vec<Step> {
    to_steps(DEFAULT_PLAN)
}

/// Steps `--only` can name besides the default plan's.
pub fn extra_steps() -> Vec<Step> {
    to_steps(EXTRA_STEPS)
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
    {
        return Err(format!(
            "step name {name:?}: use letters, digits and . _ : - only"
        ));
    }
    Ok(())
}

/// `NAME=COMMAND` → an ad-hoc step whose artifacts are the known ones its command names.
pub fn parse_step(s: &str) -> Result<Step, String> {
    let (name, command) = s
        .split_once('=')
        .ok_or_else(|| format!("--step {s:?} is not NAME=COMMAND"))?;
    check_name(name)?;
    if command.trim().is_empty() {
        return Err(format!("--step {name}: empty command"));
    }
    let known: Vec<Spec> = default_plan()
        .into_iter()
        .flat_map(|s| s.artifacts)
        .collect();
    let mut artifacts: Vec<Spec> = command
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
        .filter_map(|word| known.iter().find(|k| k.name == word).cloned())
        .collect();
    artifacts.sort();
    artifacts.dedup();
    Ok(Step {
        name: name.to_string(),
        command: command.to_string(),
        artifacts,
        env: Vec::new(),
        cuts_power: false,
    })
}

/// The steps to run and the artifacts to build for them.
pub fn select(
    only: &[String],
    adhoc: &[String],
    artifacts: Option<&str>,
) -> Result<(Vec<Step>, Vec<Spec>), String> {
    let defaults = default_plan();
    let known: Vec<Step> = defaults.iter().cloned().chain(extra_steps()).collect();
    let mut steps = Vec::new();
    for name in only {
        let step = known.iter().find(|s| &s.name == name).ok_or_else(|| {
            let names: Vec<&str> = known.iter().map(|s| s.name.as_str()).collect();
            format!("--only {name}: no such step ({})", names.join(", "))
        })?;
        if !steps.contains(step) {
            steps.push(step.clone());
        }
    }
    for s in adhoc {
        steps.push(parse_step(s)?);
    }
    if only.is_empty() && adhoc.is_empty() {
        steps = defaults;
    }
    for (i, s) in steps.iter().enumerate() {
        if steps[..i].iter().any(|t| t.name == s.name) {
            return Err(format!("two steps are named {}", s.name));
        }
    }
    let specs = match artifacts {
        Some(list) => artifacts::parse_list(list)?,
        None => steps.iter().flat_map(|s| s.artifacts.clone()).collect(),
    };
    let mut specs: Vec<Spec> = specs;
    specs.sort();
    specs.dedup();
    for (i, s) in specs.iter().enumerate() {
        if specs[..i].iter().any(|t| t.name == s.name) {
            return Err(format!("two artifacts would both be /aios/bin/{}", s.name));
        }
    }
    Ok((steps, specs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_plan_is_well_formed() {
        let plan = default_plan();
        let names: Vec<&str> = plan.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "probe-ng",
                "probe-nvme",
                "probe-nullb",
                "nvme-tests",
                "bench-ng",
                "bench-ng-iopoll",
                "criterion-ng",
                "tcp-linux-host",
                "tcp-linux-target",
                "rdma-rxe",
                "tcp-netem",
                "pmr-cut-1",
                "pmr-cut-2",
                "pmr-recover"
            ]
        );
        let b = boots(&plan);
        assert_eq!(
            b,
            [0..12, 12..13, 13..14],
            "a boot ends after each power cut"
        );
        for s in &plan {
            check_name(&s.name).unwrap();
        }
        let (_, specs) = select(&[], &[], None).unwrap();
        let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            specs,
            [
                "bin:aios",
                "test:nvme_lab",
                "test:pmr_lab",
                "test:rdma_lab",
                "test:tcp_lab",
                "bench:lbio_mem"
            ]
        );
    }

    #[test]
    fn adhoc_steps_and_subsets() {
        let (steps, specs) = select(
            &[],
            &[
                "ls=ls -l /dev/nvme*".into(),
                "x=aios probe /dev/nvme0n1".into(),
            ],
            None,
        )
        .unwrap();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].command, "ls -l /dev/nvme*");
        assert_eq!(
            specs.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            ["bin:aios"]
        );

        let (steps, specs) = select(&["probe-nullb".into()], &[], Some("")).unwrap();
        assert_eq!(steps[0].name, "probe-nullb");
        assert!(specs.is_empty());

        assert!(select(&["nope".into()], &[], None).is_err());
        assert!(select(&[], &["a=true".into(), "a=false".into()], None).is_err());
        assert!(parse_step("no equals").is_err());
        assert!(parse_step("bad name=true").is_err());
        assert_eq!(parse_step("e=a=b").unwrap().command, "a=b");
    }
}
