//! Benchmark results: one row per measured configuration, printed as a table or as JSON lines.
//!
//! Every row carries `bench`, `impl` (`nacre` or the baseline's name), the workload parameters and
//! figures whose names carry their units, so scripts can compare runs without parsing tables.

use comfy_table::{Cell, CellAlignment, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

/// Latency percentiles in microseconds from unsorted samples (nanoseconds).
pub fn percentiles_us(samples: &mut [u64], ps: &[f64]) -> Vec<f64> {
    samples.sort_unstable();
    ps.iter()
        .map(|p| {
            if samples.is_empty() {
                return 0.0;
            }
            // Nearest-rank percentile.
            let rank = ((p / 100.0) * samples.len() as f64).ceil() as usize;
            let idx = rank.clamp(1, samples.len()) - 1;
            samples[idx] as f64 / 1000.0
        })
        .collect()
}

/// One measured configuration of a message-passing benchmark.
#[derive(Clone, Debug, Serialize)]
pub struct MsgrRow {
    pub bench: &'static str,
    #[serde(rename = "impl")]
    pub implementation: String,
    pub size: usize,
    pub inflight: usize,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// nacre's figure relative to the raw baseline in the same run (ops/s ratio), on nacre rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_baseline: Option<f64>,
}

pub fn print_table(rows: &[MsgrRow]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "impl", "size", "inflight", "ops/s", "MiB/s", "p50 µs", "p99 µs", "vs raw",
    ]);
    for r in rows {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        t.add_row(vec![
            Cell::new(&r.implementation),
            right(human_size(r.size)),
            right(r.inflight.to_string()),
            right(format!("{:.0}", r.ops_per_s)),
            right(format!("{:.1}", r.mib_per_s)),
            right(format!("{:.1}", r.p50_us)),
            right(format!("{:.1}", r.p99_us)),
            right(
                r.vs_baseline
                    .map(|v| format!("{:.0}%", v * 100.0))
                    .unwrap_or_default(),
            ),
        ]);
    }
    println!("{t}");
}

/// The `--skew` experiment's table.
pub fn print_skew_table(rows: &[super::skew::SkewRow]) {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header([
        "impl",
        "load",
        "size",
        "ops/s",
        "MiB/s",
        "p50 µs",
        "p99 µs",
        "light p99 µs",
        "spread %",
        "moves",
        "pause p99 µs",
        "vs static",
    ]);
    for r in rows {
        let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
        t.add_row(vec![
            Cell::new(r.implementation),
            Cell::new(r.load),
            right(human_size(r.size)),
            right(format!("{:.0}", r.ops_per_s)),
            right(format!("{:.1}", r.mib_per_s)),
            right(format!("{:.1}", r.p50_us)),
            right(format!("{:.1}", r.p99_us)),
            right(
                r.light_p99_us
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_default(),
            ),
            right(format!("{:.1}", r.worker_spread_pct)),
            right(r.migrations.to_string()),
            right(format!("{:.1}", r.migration_pause_p99_us)),
            right(
                r.vs_static
                    .map(|v| format!("{:.0}%", v * 100.0))
                    .unwrap_or_default(),
            ),
        ]);
    }
    println!("{t}");
}

pub fn print_json<T: serde::Serialize>(rows: &[T]) -> anyhow::Result<()> {
    for r in rows {
        println!("{}", serde_json::to_string(r)?);
    }
    Ok(())
}

pub fn human_size(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => format!("{n}B"),
    }
}

/// Parses `4k`, `64KiB`, `1m`, `1048576`.
pub fn parse_size(s: &str) -> Result<usize, SizeError> {
    let t = s.trim().to_ascii_lowercase();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    let n: usize = num
        .parse()
        .map_err(|_| SizeError::NotANumber(s.to_string()))?;
    let mult = match unit {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(SizeError::UnknownUnit(s.to_string())),
    };
    n.checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge(s.to_string()))
}

/// Why [`parse_size`] refused its input (shown by clap as the argument's error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("invalid size {0:?}: expected a number with an optional unit")]
    NotANumber(String),
    #[error("invalid size unit in {0:?} (use k, m or g)")]
    UnknownUnit(String),
    #[error("size {0:?} is too large")]
    TooLarge(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("4q").is_err());
        assert!(parse_size("k").is_err());
        assert_eq!(human_size(4096), "4KiB");
        assert_eq!(human_size(1 << 20), "1MiB");
        assert_eq!(human_size(1000), "1000B");
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut s: Vec<u64> = (1..=100).map(|i| i * 1000).collect();
        assert_eq!(
            percentiles_us(&mut s, &[50.0, 99.0, 100.0]),
            vec![50.0, 99.0, 100.0]
        );
        assert_eq!(percentiles_us(&mut [], &[50.0]), vec![0.0]);
    }
}
