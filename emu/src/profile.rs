//! Timing profiles from the command line: a built-in name (`cx6-100g`, `cx7-400g`) or a TOML
//! file that starts from a built-in one and overrides parameters by name.
//!
//! ```toml
//! base = "cx6-100g"          # optional; cx6-100g when absent
//! name = "cx6-gen3"          # optional; "<base>+file" when absent
//! pcie_read_bytes_per_us = 13200
//! pcie_write_bytes_per_us = 13000
//! ```
//!
//! Every other key must be a parameter of [`TimingProfile`] with a non-negative integer
//! value (picoseconds, bytes or bits per microsecond, as the parameter's name says).

use ringbell_model::TimingProfile;

/// Why a profile could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// Neither a built-in name nor a readable file.
    #[error("{0:?} is not a built-in profile ({builtins}) nor a readable file: {1}", builtins = TimingProfile::BUILTIN.join(", "))]
    NotFound(String, std::io::Error),
    /// The file is not valid TOML.
    #[error("profile file: {0}")]
    Syntax(#[from] toml::de::Error),
    /// A key or value the file may not have.
    #[error("profile file: {0}")]
    Bad(String),
}

/// Loads `spec`: a built-in profile name or the path of a TOML profile file.
pub fn load(spec: &str) -> Result<TimingProfile, ProfileError> {
    if let Some(p) = TimingProfile::builtin(spec) {
        return Ok(p);
    }
    let text = std::fs::read_to_string(spec).map_err(|e| ProfileError::NotFound(spec.into(), e))?;
    parse(&text)
}

/// Parses the text of a profile file.
pub fn parse(text: &str) -> Result<TimingProfile, ProfileError> {
    let table: toml::Table = text.parse()?;
    let base = match table.get("base") {
        None => TimingProfile::default(),
        Some(toml::Value::String(b)) => TimingProfile::builtin(b).ok_or_else(|| {
            ProfileError::Bad(format!(
                "base {b:?} is not one of {}",
                TimingProfile::BUILTIN.join(", ")
            ))
        })?,
        Some(v) => return Err(ProfileError::Bad(format!("base must be a string, not {v}"))),
    };
    let mut p = base;
    p.name = format!("{}+file", p.name);
    for (k, v) in &table {
        match (k.as_str(), v) {
            ("base", _) => {}
            ("name", toml::Value::String(n)) => p.name = n.clone(),
            ("name", v) => {
                return Err(ProfileError::Bad(format!("name must be a string, not {v}")))
            }
            (k, toml::Value::Integer(i)) => {
                let i = u64::try_from(*i)
                    .map_err(|_| ProfileError::Bad(format!("{k} = {i}: must not be negative")))?;
                if !p.set(k, i) {
                    return Err(ProfileError::Bad(format!(
                        "{k} is not a timing parameter (see `ringbell-emu profile`)"
                    )));
                }
            }
            (k, v) => {
                return Err(ProfileError::Bad(format!(
                    "{k} = {v}: parameters are integers"
                )))
            }
        }
    }
    // Rates of zero would divide by zero in the model (which clamps them to 1): refuse them.
    for rate in [
        "link_bits_per_us",
        "pcie_read_bytes_per_us",
        "pcie_write_bytes_per_us",
    ] {
        if p.get(rate) == Some(0) {
            return Err(ProfileError::Bad(format!("{rate} must be positive")));
        }
    }
    Ok(p)
}

/// The profile as a table: parameter, value, documentation (for `ringbell-emu profile`).
pub fn describe(p: &TimingProfile) -> String {
    let mut out = format!("timing profile {}\n", p.name);
    for f in TimingProfile::FIELDS {
        let v = p.get(f).unwrap_or(0);
        let doc = TimingProfile::doc(f).unwrap_or("").trim();
        out.push_str(&format!("{f:<28} {v:>12}  {doc}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_load_by_name() {
        assert_eq!(load("cx6-100g").unwrap(), TimingProfile::cx6_100g());
        assert_eq!(load("cx7-400g").unwrap(), TimingProfile::cx7_400g());
        let e = load("/no/such/profile.toml").unwrap_err().to_string();
        assert!(e.contains("cx6-100g, cx7-400g"), "{e}");
    }

    #[test]
    fn a_file_overrides_a_base_by_name() {
        let p =
            parse("base = \"cx7-400g\"\nname = \"slow-pcie\"\ndma_read_rtt_ps = 550000\n").unwrap();
        assert_eq!(p.name, "slow-pcie");
        assert_eq!(p.dma_read_rtt_ps, 550_000);
        assert_eq!(
            p.link_bits_per_us,
            TimingProfile::cx7_400g().link_bits_per_us
        );
        let q = parse("mmio_post_ps = 150000").unwrap();
        assert_eq!(q.name, "cx6-100g+file");
        assert_eq!(q.mmio_post_ps, 150_000);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        for (text, want) in [
            ("no_such_ps = 1", "not a timing parameter"),
            ("mmio_post_ps = -1", "must not be negative"),
            ("mmio_post_ps = \"fast\"", "integers"),
            ("base = \"cx9\"", "not one of"),
            ("link_bits_per_us = 0", "must be positive"),
            ("mmio_post_ps = ", "profile file"),
        ] {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn describe_lists_every_parameter_with_its_source() {
        let d = describe(&TimingProfile::default());
        for f in TimingProfile::FIELDS {
            assert!(d.contains(f), "{f}");
        }
        assert!(d.contains("[S10b]"));
    }
}
