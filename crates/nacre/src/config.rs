//! Configuration: a TOML file overlaid with `NACRE_*` environment variables.
//!
//! `NACRE_MSGR__WORKERS=4` sets `msgr.workers = 4`: the name after the prefix is
//! lower-cased and split on `__`. A value is used as TOML when it parses as a TOML
//! value (`4`, `true`, `[1, 2]`, `"quoted"`), otherwise as a plain string; quote a
//! value to force a string (`NACRE_NAME='"1234"'`). Variables are applied in name
//! order, so the outcome does not depend on the order of the environment.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use toml::map::Entry;
use toml::{Table, Value};

/// Prefix of the environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "NACRE_";

/// `NACRE_*` variables that are not configuration overrides (they are read elsewhere).
pub const RESERVED_ENV: &[&str] = &["NACRE_LOG"];

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The I/O error is the `source()`, not part of the message (anyhow's `{:#}` shows both).
    #[error("cannot read config file {}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot parse config file {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("invalid override {var}: {message}")]
    Override { var: String, message: String },
    #[error("invalid configuration: {message}")]
    Invalid { message: String },
}

/// Loads `T` from the file at `path` (if any) overlaid with the `NACRE_*` entries of `env`.
pub fn load<T: DeserializeOwned>(
    path: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError> {
    let mut table = match path {
        Some(path) => read_file(path)?,
        None => Table::new(),
    };
    let mut vars: Vec<(String, String)> = env
        .into_iter()
        .filter(|(name, _)| is_override(name))
        .collect();
    // Name order puts `NACRE_A` before `NACRE_A__B`, whatever order the caller used.
    vars.sort();
    let mut applied = Vec::with_capacity(vars.len());
    for (var, raw) in vars {
        applied.push(apply_override(&mut table, var, &raw)?);
    }
    table
        .try_into()
        .map_err(|err| invalid(&err, path, &applied))
}

/// [`load`] with the environment of this process.
///
/// Variables that are not UTF-8 are skipped, unless an override's value is not UTF-8,
/// which is an error.
pub fn load_from_process_env<T: DeserializeOwned>(path: Option<&Path>) -> Result<T, ConfigError> {
    let mut env = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str().filter(|name| is_override(name)) else {
            continue;
        };
        match value.into_string() {
            Ok(value) => env.push((name.to_owned(), value)),
            Err(_) => {
                return Err(ConfigError::Override {
                    var: name.to_owned(),
                    message: "value is not valid UTF-8".to_owned(),
                });
            }
        }
    }
    load(path, env)
}

fn is_override(name: &str) -> bool {
    name.starts_with(ENV_PREFIX) && !RESERVED_ENV.contains(&name)
}

fn read_file(path: &Path) -> Result<Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    text.parse()
        .map_err(|err: toml::de::Error| ConfigError::Parse {
            path: path.to_owned(),
            message: err.to_string().trim_end().to_owned(),
        })
}

/// An override that was applied, kept to say where a bad value came from.
struct Applied {
    var: String,
    path: Vec<String>,
    /// Length of the shortest prefix of `path` that the override brought into being:
    /// an intermediate table it created, or else the whole path.
    root_len: usize,
}

fn apply_override(table: &mut Table, var: String, raw: &str) -> Result<Applied, ConfigError> {
    let key = var[ENV_PREFIX.len()..].to_lowercase();
    let path: Vec<String> = key.split("__").map(str::to_owned).collect();
    let Some((last, parents)) = path.split_last().filter(|_| !key.is_empty()) else {
        return Err(ConfigError::Override {
            var,
            message: "no key after the prefix".to_owned(),
        });
    };
    if path.iter().any(String::is_empty) {
        return Err(ConfigError::Override {
            var,
            message: format!("empty key segment in `{key}` (separate keys with `__`)"),
        });
    }
    let value = raw
        .parse::<Value>()
        .unwrap_or_else(|_| Value::String(raw.to_owned()));

    let mut root_len = path.len();
    let mut current = table;
    for (depth, key) in parents.iter().enumerate() {
        let slot = match current.entry(key.as_str()) {
            Entry::Vacant(slot) => {
                root_len = root_len.min(depth + 1);
                slot.insert(Value::Table(Table::new()))
            }
            Entry::Occupied(slot) => slot.into_mut(),
        };
        current = match slot {
            Value::Table(inner) => inner,
            other => {
                let message = format!(
                    "`{}` is {}, not a table",
                    path[..=depth].join("."),
                    article(other.type_str())
                );
                return Err(ConfigError::Override { var, message });
            }
        };
    }
    current.insert(last.clone(), value);
    Ok(Applied {
        var,
        path,
        root_len,
    })
}

fn article(type_str: &str) -> String {
    match type_str.chars().next() {
        Some('a' | 'e' | 'i' | 'o' | 'u') => format!("an {type_str}"),
        _ => format!("a {type_str}"),
    }
}

fn invalid(err: &toml::de::Error, file: Option<&Path>, applied: &[Applied]) -> ConfigError {
    let detail = err.message().trim_end();
    // The error's key path is only exposed through its Display: a last line "in `a.b`".
    let display = err.to_string();
    let at: Vec<String> = display
        .lines()
        .last()
        .and_then(|line| line.strip_prefix("in `")?.strip_suffix('`'))
        .map(|keys| keys.split('.').map(str::to_owned).collect())
        .unwrap_or_default();
    let mut message = if at.is_empty() {
        detail.to_owned()
    } else {
        format!("in `{}`: {detail}", at.join("."))
    };

    let field = |prefix: &str| {
        detail
            .strip_prefix(prefix)
            .and_then(|rest| rest.split('`').next())
            .map(str::to_owned)
    };
    let mut culprit = at;
    culprit.extend(field("unknown field `"));
    let origin = applied
        .iter()
        .filter(|a| culprit.starts_with(&a.path[..a.root_len]))
        .max_by_key(|a| a.root_len);
    if let Some(origin) = origin {
        let _ = write!(message, " (from environment variable {})", origin.var);
    } else if let Some(missing) = field("missing field `") {
        culprit.push(missing);
        let var = format!("{ENV_PREFIX}{}", culprit.join("__").to_uppercase());
        let key = culprit.join(".");
        let _ = write!(message, " (set `{key}` in the config file or {var})");
    } else if let Some(file) = file {
        let _ = write!(message, " (from config file {})", file.display());
    }
    ConfigError::Invalid { message }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Cfg {
        listen: String,
        #[serde(default)]
        debug: bool,
        #[serde(default)]
        name: Option<String>,
        #[serde(default)]
        msgr: Msgr,
    }

    #[derive(Debug, Default, Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Msgr {
        #[serde(default)]
        workers: u32,
        #[serde(default)]
        ports: Vec<u16>,
        #[serde(default)]
        ratio: f64,
    }

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(text.as_bytes()).expect("write temp file");
        file
    }

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn load_err(path: Option<&Path>, vars: &[(&str, &str)]) -> ConfigError {
        match load::<Cfg>(path, env(vars)) {
            Ok(cfg) => panic!("expected an error, got {cfg:?}"),
            Err(err) => err,
        }
    }

    const FILE: &str = "listen = \"0.0.0.0:7000\"\n\n[msgr]\nworkers = 2\nports = [1, 2]\n";

    #[test]
    fn file_only() {
        let f = file(FILE);
        let cfg: Cfg = load(Some(f.path()), env(&[])).expect("load");
        assert_eq!(
            cfg,
            Cfg {
                listen: "0.0.0.0:7000".into(),
                debug: false,
                name: None,
                msgr: Msgr {
                    workers: 2,
                    ports: vec![1, 2],
                    ratio: 0.0,
                },
            }
        );
    }

    #[test]
    fn env_overrides_nested_and_top_level_keys() {
        let cfg: Cfg = load(
            None,
            env(&[
                ("NACRE_LISTEN", "127.0.0.1:7000"),
                ("NACRE_DEBUG", "true"),
                ("NACRE_MSGR__WORKERS", "4"),
                ("NACRE_MSGR__PORTS", "[7001, 7002]"),
                ("NACRE_MSGR__RATIO", "0.5"),
                ("NACRE_NAME", "\"1234\""),
                ("PATH", "/usr/bin"),
            ]),
        )
        .expect("load");
        assert_eq!(
            cfg,
            Cfg {
                listen: "127.0.0.1:7000".into(),
                debug: true,
                name: Some("1234".into()),
                msgr: Msgr {
                    workers: 4,
                    ports: vec![7001, 7002],
                    ratio: 0.5,
                },
            }
        );
    }

    #[test]
    fn env_wins_over_file() {
        let f = file(FILE);
        let cfg: Cfg = load(
            Some(f.path()),
            env(&[("NACRE_MSGR__WORKERS", "8"), ("NACRE_LISTEN", "[::1]:9")]),
        )
        .expect("load");
        assert_eq!(cfg.listen, "[::1]:9");
        assert_eq!(cfg.msgr.workers, 8);
        assert_eq!(cfg.msgr.ports, vec![1, 2], "untouched file keys stay");
    }

    #[test]
    fn unknown_field_rejected() {
        let err = load_err(None, &[("NACRE_LISTEN", "x"), ("NACRE_MSGR__BOGUS", "1")]);
        let msg = err.to_string();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{msg}");
        assert!(msg.contains("unknown field `bogus`"), "{msg}");
        assert!(msg.contains("in `msgr`: unknown field `bogus`"), "{msg}");
        assert!(msg.contains("NACRE_MSGR__BOGUS"), "{msg}");

        let f = file("listen = \"x\"\nextra = 1\n");
        let msg = load_err(Some(f.path()), &[]).to_string();
        assert!(msg.contains("unknown field `extra`"), "{msg}");
        assert!(msg.contains(&f.path().display().to_string()), "{msg}");
    }

    #[test]
    fn type_error_names_field() {
        let err = load_err(
            None,
            &[("NACRE_LISTEN", "x"), ("NACRE_MSGR__WORKERS", "many")],
        );
        let msg = err.to_string();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{msg}");
        assert!(msg.contains("`msgr.workers`"), "{msg}");
        assert!(
            msg.contains("from environment variable NACRE_MSGR__WORKERS"),
            "{msg}"
        );

        let f = file("listen = \"x\"\n[msgr]\nworkers = \"many\"\n");
        let msg = load_err(Some(f.path()), &[("NACRE_DEBUG", "true")]).to_string();
        assert!(msg.contains("`msgr.workers`"), "{msg}");
        assert!(msg.contains("from config file"), "{msg}");
        assert!(!msg.contains("NACRE_DEBUG"), "{msg}");
    }

    #[test]
    fn missing_field_suggests_key_and_variable() {
        let f = file("[msgr]\nworkers = 1\n");
        let msg = load_err(Some(f.path()), &[]).to_string();
        assert!(msg.contains("missing field `listen`"), "{msg}");
        assert!(msg.contains("NACRE_LISTEN"), "{msg}");
    }

    #[test]
    fn table_created_by_env_is_blamed_on_env() {
        // `listen` is a string; the env var turns it into a table.
        let err = load_err(None, &[("NACRE_LISTEN__HOST", "x")]);
        let msg = err.to_string();
        assert!(msg.contains("NACRE_LISTEN__HOST"), "{msg}");
    }

    #[test]
    fn missing_file_names_path() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("nope.toml");
        let err = load_err(Some(&path), &[]);
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
        assert!(err.to_string().contains("nope.toml"), "{err}");
    }

    #[test]
    fn parse_error_has_path_line_and_column() {
        let f = file("listen = \"x\"\nworkers = = 3\n");
        let err = load_err(Some(f.path()), &[]);
        let msg = err.to_string();
        assert!(matches!(err, ConfigError::Parse { .. }), "{msg}");
        assert!(msg.contains(&f.path().display().to_string()), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");
        assert!(msg.contains("column"), "{msg}");
    }

    #[test]
    fn reserved_vars_ignored() {
        let cfg: Cfg = load(
            None,
            env(&[("NACRE_LOG", "debug,nacre=trace"), ("NACRE_LISTEN", "x")]),
        )
        .expect("NACRE_LOG must not reach deny_unknown_fields");
        assert_eq!(cfg.listen, "x");
    }

    #[test]
    fn table_path_through_scalar_is_error() {
        let f = file(FILE);
        let err = load_err(Some(f.path()), &[("NACRE_MSGR__WORKERS__MAX", "3")]);
        let msg = err.to_string();
        assert!(matches!(err, ConfigError::Override { .. }), "{msg}");
        assert!(msg.contains("NACRE_MSGR__WORKERS__MAX"), "{msg}");
        assert!(msg.contains("`msgr.workers` is an integer"), "{msg}");

        // Same conflict between two variables, whatever their order.
        for vars in [
            [("NACRE_LISTEN", "x"), ("NACRE_LISTEN__PORT", "1")],
            [("NACRE_LISTEN__PORT", "1"), ("NACRE_LISTEN", "x")],
        ] {
            let err = load_err(None, &vars);
            assert!(err.to_string().contains("NACRE_LISTEN__PORT"), "{err}");
        }
    }

    #[test]
    fn malformed_names_are_errors() {
        for var in ["NACRE_", "NACRE_MSGR____WORKERS", "NACRE_MSGR__"] {
            let err = load_err(None, &[("NACRE_LISTEN", "x"), (var, "1")]);
            assert!(matches!(err, ConfigError::Override { .. }), "{var}: {err}");
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn process_env_loader_reads_file() {
        #[derive(Debug, Deserialize)]
        struct Loose {
            listen: String,
        }
        let f = file(FILE);
        let cfg: Loose = load_from_process_env(Some(f.path())).expect("load");
        // A NACRE_LISTEN in the test's environment would legitimately win.
        if std::env::var_os("NACRE_LISTEN").is_none() {
            assert_eq!(cfg.listen, "0.0.0.0:7000");
        }
    }
}
