//! Scenario files: a fabric's seed and faults in TOML, for the CLI and for tests.
//!
//! ```toml
//! seed = 7
//! [faults]
//! loss = 0.01            # probability per frame, every link
//! duplicate = 0.001
//! reorder = 0.001
//! reorder_delay_us = 2.0
//! corrupt = 0.0005
//! [[faults.node]]        # faults of one node's link instead of the defaults
//! node = 1
//! loss = 0.05
//! [[faults.link_down]]
//! node = 1
//! from_us = 100.0
//! until_us = 300.0
//! [[faults.rule]]        # targeted: drop the 3rd request to QP 2
//! action = "drop"        # drop | duplicate | corrupt | delay
//! kind = "request"       # request | ack | read_response | atomic_ack | datagram
//! qpn = 2
//! nth = 3
//! [[faults.rule]]        # a UD datagram: from QP 4 (DETH), to QP 7, sender's PSN 10
//! action = "drop"
//! kind = "datagram"
//! src_qpn = 4
//! qpn = 7
//! psn = 10
//! ```
//!
//! Probabilities and times are converted to integers (parts per million, picoseconds) when
//! the file is read; nothing at run time depends on a float.

use crate::faults::{ppm, FaultAction, FaultPlan, FaultRule, FrameKind, FrameMatch, LinkFaults};
use ringbell_specs::SimTime;
use serde::Deserialize;

/// A parsed scenario.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scenario {
    /// Root seed, if the file sets one.
    pub seed: Option<u64>,
    /// The faults.
    pub faults: FaultPlan,
}

/// Why a scenario file was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read {path}: {err}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        err: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("{0}")]
    Syntax(#[from] toml::de::Error),
    /// A value is out of range.
    #[error("{0}")]
    Invalid(String),
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct File {
    seed: Option<u64>,
    #[serde(default)]
    faults: Faults,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Faults {
    #[serde(flatten)]
    links: Link,
    #[serde(default)]
    node: Vec<NodeLink>,
    #[serde(default)]
    link_down: Vec<Down>,
    #[serde(default)]
    rule: Vec<Rule>,
}

#[derive(Deserialize, Default, Clone)]
struct Link {
    #[serde(default)]
    loss: f64,
    #[serde(default)]
    duplicate: f64,
    #[serde(default)]
    reorder: f64,
    reorder_delay_us: Option<f64>,
    #[serde(default)]
    corrupt: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeLink {
    node: usize,
    #[serde(flatten)]
    link: Link,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Down {
    node: usize,
    from_us: f64,
    until_us: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    action: String,
    delay_us: Option<f64>,
    from: Option<usize>,
    to: Option<usize>,
    qpn: Option<u32>,
    src_qpn: Option<u32>,
    kind: Option<String>,
    psn: Option<u32>,
    opcode: Option<u8>,
    #[serde(default = "one")]
    nth: u64,
    #[serde(default = "one")]
    times: u64,
}

fn one() -> u64 {
    1
}

fn us(v: f64, what: &str) -> Result<SimTime, ScenarioError> {
    if !(0.0..=1e12).contains(&v) {
        return Err(ScenarioError::Invalid(format!(
            "{what} = {v} µs is out of range"
        )));
    }
    Ok(SimTime((v * 1e6).round() as u64))
}

fn prob(v: f64, what: &str) -> Result<u32, ScenarioError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(ScenarioError::Invalid(format!(
            "{what} = {v} is not a probability"
        )));
    }
    Ok(ppm(v))
}

impl Link {
    fn to_faults(&self) -> Result<LinkFaults, ScenarioError> {
        Ok(LinkFaults {
            drop_ppm: prob(self.loss, "loss")?,
            duplicate_ppm: prob(self.duplicate, "duplicate")?,
            reorder_ppm: prob(self.reorder, "reorder")?,
            reorder_delay: us(self.reorder_delay_us.unwrap_or(2.0), "reorder_delay_us")?,
            corrupt_ppm: prob(self.corrupt, "corrupt")?,
            down: Vec::new(),
        })
    }
}

impl Scenario {
    /// Reads a scenario file.
    pub fn load(path: &str) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|err| ScenarioError::Io {
            path: path.into(),
            err,
        })?;
        Self::parse(&text)
    }

    /// Parses scenario TOML.
    pub fn parse(text: &str) -> Result<Scenario, ScenarioError> {
        let f: File = toml::from_str(text)?;
        let mut plan = FaultPlan {
            links: f.faults.links.to_faults()?,
            ..Default::default()
        };
        for n in &f.faults.node {
            plan.per_node.insert(n.node, n.link.to_faults()?);
        }
        for d in &f.faults.link_down {
            let (a, b) = (us(d.from_us, "from_us")?, us(d.until_us, "until_us")?);
            if b <= a {
                return Err(ScenarioError::Invalid(format!(
                    "link_down of node {}: until_us must follow from_us",
                    d.node
                )));
            }
            let base = plan
                .per_node
                .get(&d.node)
                .cloned()
                .unwrap_or_else(|| plan.links.clone());
            plan.per_node
                .entry(d.node)
                .or_insert(base)
                .down
                .push((a, b));
        }
        for r in &f.faults.rule {
            let action = match r.action.as_str() {
                "drop" => FaultAction::Drop,
                "duplicate" => FaultAction::Duplicate,
                "corrupt" => FaultAction::Corrupt,
                "delay" => FaultAction::Delay(us(r.delay_us.unwrap_or(0.0), "delay_us")?),
                other => return Err(ScenarioError::Invalid(format!("unknown action {other:?}"))),
            };
            let kind = match r.kind.as_deref() {
                None => None,
                Some("request") => Some(FrameKind::Request),
                Some("ack") => Some(FrameKind::Ack),
                Some("read_response") => Some(FrameKind::ReadResponse),
                Some("atomic_ack") => Some(FrameKind::AtomicAck),
                Some("datagram") => Some(FrameKind::Datagram),
                Some(other) => {
                    return Err(ScenarioError::Invalid(format!(
                        "unknown frame kind {other:?}"
                    )))
                }
            };
            let when = FrameMatch {
                from: r.from,
                to: r.to,
                qpn: r.qpn,
                src_qpn: r.src_qpn,
                kind,
                psn: r.psn,
                opcode: r.opcode,
            };
            plan.rules.push(FaultRule {
                when,
                nth: r.nth.max(1),
                times: r.times,
                action,
            });
        }
        Ok(Scenario {
            seed: f.seed,
            faults: plan,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_of_fault() {
        let s = Scenario::parse(
            r#"
            seed = 7
            [faults]
            loss = 0.01
            corrupt = 0.0005
            [[faults.node]]
            node = 1
            loss = 0.05
            [[faults.link_down]]
            node = 1
            from_us = 100.0
            until_us = 300.0
            [[faults.rule]]
            action = "delay"
            delay_us = 2.5
            kind = "read_response"
            psn = 42
            [[faults.rule]]
            action = "drop"
            kind = "request"
            qpn = 2
            nth = 3
            [[faults.rule]]
            action = "drop"
            kind = "datagram"
            src_qpn = 4
            qpn = 7
            psn = 10
            "#,
        )
        .unwrap();
        assert_eq!(s.seed, Some(7));
        assert_eq!(s.faults.links.drop_ppm, 10_000);
        assert_eq!(s.faults.links.corrupt_ppm, 500);
        let n1 = &s.faults.per_node[&1];
        assert_eq!(n1.drop_ppm, 50_000);
        assert_eq!(n1.down, vec![(SimTime(100_000_000), SimTime(300_000_000))]);
        assert_eq!(
            s.faults.rules[0].action,
            FaultAction::Delay(SimTime(2_500_000))
        );
        assert_eq!(s.faults.rules[0].when.psn, Some(42));
        assert_eq!(s.faults.rules[1].nth, 3);
        assert_eq!(s.faults.rules[1].when.kind, Some(FrameKind::Request));
        assert_eq!(
            s.faults.rules[2].when,
            FrameMatch {
                kind: Some(FrameKind::Datagram),
                src_qpn: Some(4),
                qpn: Some(7),
                psn: Some(10),
                ..Default::default()
            }
        );
    }

    #[test]
    fn refuses_nonsense() {
        for bad in [
            "[faults]\nloss = 1.5",
            "[faults]\nloss = -0.1",
            "[faults]\nlose = 0.1",
            "[[faults.rule]]\naction = \"explode\"",
            "[[faults.rule]]\naction = \"drop\"\nkind = \"gossip\"",
            "[[faults.link_down]]\nnode = 0\nfrom_us = 5.0\nuntil_us = 1.0",
            "seed = \"seven\"",
        ] {
            assert!(Scenario::parse(bad).is_err(), "{bad}");
        }
    }
}
