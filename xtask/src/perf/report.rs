//! A bench's `--json` report as table rows: any JSON object, flattened to dotted paths and
//! numbers at a readable precision, so one renderer serves `kvroute bench transport`, `fabric`,
//! `kernels` and `kvpath` alike. serde_json's maps keep their keys sorted, so the rows come out
//! in key order whatever order the bench wrote them in.

use serde_json::Value;

/// A report as table rows: one per top-level key, or per element where the key holds an array
/// of objects or arrays; each row's scalars named by their dotted path below it (array
/// elements as `[i]`, arrays of scalars as one list), numbers by [`format_number`]. Nulls and
/// empty containers are left out.
pub(super) fn report_rows(report: &Value) -> Vec<(String, String)> {
    let Some(top) = report.as_object() else {
        return Vec::new();
    };
    let mut rows = Vec::new();
    let mut row = |key: String, value: &Value| {
        let mut leaves = Vec::new();
        flatten("", value, &mut leaves);
        let values: Vec<String> = leaves
            .into_iter()
            .map(|(name, v)| {
                if name.is_empty() {
                    v
                } else {
                    format!("{name}: {v}")
                }
            })
            .collect();
        if !values.is_empty() {
            rows.push((key.replace('|', "\\|"), values.join("; ")));
        }
    };
    for (key, value) in top {
        match value {
            Value::Array(items) if !items.iter().all(is_scalar) => {
                for (i, item) in items.iter().enumerate() {
                    row(format!("{key}[{i}]"), item);
                }
            }
            _ => row(key.clone(), value),
        }
    }
    rows
}

/// Whether `v` is neither an object nor an array.
fn is_scalar(v: &Value) -> bool {
    !(v.is_object() || v.is_array())
}

/// Appends `value`'s scalars below `path` as (dotted path, rendered value).
fn flatten(path: &str, value: &Value, out: &mut Vec<(String, String)>) {
    let join = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    match value {
        Value::Null => {}
        Value::Object(map) => {
            for (k, v) in map {
                flatten(&join(k), v, out);
            }
        }
        Value::Array(items) if items.is_empty() => {}
        Value::Array(items) if items.iter().all(is_scalar) => {
            let list: Vec<String> = items.iter().map(scalar).collect();
            out.push((path.to_owned(), list.join(", ")));
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                flatten(&format!("{path}[{i}]"), item, out);
            }
        }
        _ => out.push((path.to_owned(), scalar(value))),
    }
}

/// A scalar as a table shows it: numbers by [`format_number`], strings on one line with `|`
/// escaped, null as `-`.
fn scalar(value: &Value) -> String {
    match value {
        Value::Null => "-".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => format_number(n),
        Value::String(s) => s.replace('\n', " ").replace('|', "\\|"),
        other => other.to_string(),
    }
}

/// Integers as they are; other numbers to four significant digits with trailing zeros
/// dropped, rounded to a whole number from 10,000 up and in scientific notation below 0.001.
fn format_number(n: &serde_json::Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    let x = n.as_f64().unwrap_or(f64::NAN);
    if x == 0.0 || !x.is_finite() {
        return x.to_string();
    }
    let magnitude = x.abs().log10().floor() as i32;
    if magnitude >= 4 {
        format!("{x:.0}")
    } else if magnitude >= -3 {
        trim_zeros(&format!("{x:.*}", (3 - magnitude) as usize)).to_owned()
    } else {
        let text = format!("{x:.3e}");
        match text.split_once('e') {
            Some((mantissa, exponent)) => format!("{}e{exponent}", trim_zeros(mantissa)),
            None => text,
        }
    }
}

/// `s` without the trailing zeros of its fraction (and its point, if nothing is left of it).
fn trim_zeros(s: &str) -> &str {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Result;

    use super::*;

    /// A `kvroute --json bench transport` report as `TransportBenchReport` serialises it
    /// (crates/cli/src/bench.rs), cut to one row of each list.
    const TRANSPORT: &str = r#"{
      "machine": "AMD EPYC (family 26, model 2), avx2 fma avx512f, 2 cores available",
      "submit": {
        "engine": {"samples": 50000, "p50_ns": 301.26, "p99_ns": 1220.7},
        "baseline_handoff": {"samples": 50000, "p50_ns": 152.0, "p99_ns": 410.0}
      },
      "paged": [
        {"page_len": 1024, "pages": 2048, "engine_pages_per_s": 30512345.6,
         "memcpy_pages_per_s": 51100000.0}
      ],
      "scatter": [],
      "targets": [
        {"what": "submit p50 (ns)", "target": "<= 1000", "measured": 301.26, "met": true,
         "bound": null}
      ]
    }"#;

    /// A `kvroute --json bench kvpath` report's shape (crates/cli/src/bench_kvpath.rs): a list
    /// of numbers inside a list of objects, and top-level numbers.
    const KVPATH: &str = r#"{
      "provider": "shm",
      "blocks": 24,
      "de_path_ratio": 0.92987,
      "implied_snic_gbps": 14.208,
      "paths": [
        {"what": "storage -> PE", "median_mb_s": 1776.4, "best_mb_s": 1979.0,
         "rounds_mb_s": [1776.4, 1979.0, 1650.25]}
      ]
    }"#;

    #[test]
    fn numbers_keep_four_significant_digits_and_integers_stay_whole() -> Result<()> {
        let cases = [
            ("0.29384", "0.2938"),
            ("12.3456", "12.35"),
            ("1234.56", "1235"),
            ("30512345.6", "30512346"),
            ("0.000039", "3.9e-5"),
            ("2.0", "2"),
            ("-0.5", "-0.5"),
            ("0.0", "0"),
            ("50000", "50000"),
            ("-3", "-3"),
            ("18446744073709551615", "18446744073709551615"),
        ];
        for (json, want) in cases {
            let n: serde_json::Number = serde_json::from_str(json)?;
            assert_eq!(format_number(&n), want, "{json}");
        }
        Ok(())
    }

    #[test]
    fn transport_report_flattens_to_one_row_per_key_or_list_element() -> Result<()> {
        let rows = report_rows(&serde_json::from_str(TRANSPORT)?);
        let want = [
            (
                "machine",
                "AMD EPYC (family 26, model 2), avx2 fma avx512f, 2 cores available",
            ),
            (
                "paged[0]",
                "engine_pages_per_s: 30512346; memcpy_pages_per_s: 51100000; page_len: 1024; \
                 pages: 2048",
            ),
            (
                "submit",
                "baseline_handoff.p50_ns: 152; baseline_handoff.p99_ns: 410; \
                 baseline_handoff.samples: 50000; engine.p50_ns: 301.3; engine.p99_ns: 1221; \
                 engine.samples: 50000",
            ),
            (
                "targets[0]",
                "measured: 301.3; met: true; target: <= 1000; what: submit p50 (ns)",
            ),
        ];
        let got: Vec<(&str, &str)> = rows.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(got, want);
        Ok(())
    }

    #[test]
    fn lists_of_numbers_stay_one_value_and_nested_lists_are_indexed() -> Result<()> {
        let rows = report_rows(&serde_json::from_str(KVPATH)?);
        let got: Vec<(&str, &str)> = rows.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("blocks", "24"),
                ("de_path_ratio", "0.9299"),
                ("implied_snic_gbps", "14.21"),
                (
                    "paths[0]",
                    "best_mb_s: 1979; median_mb_s: 1776; rounds_mb_s: 1776, 1979, 1650; \
                     what: storage -> PE"
                ),
                ("provider", "shm"),
            ]
        );
        let nested: Value =
            serde_json::from_str(r#"{"a": {"b": [{"c": 1}, {"c": 2.5}], "d": "x|y"}}"#)?;
        assert_eq!(
            report_rows(&nested),
            [(
                "a".to_owned(),
                "b[0].c: 1; b[1].c: 2.5; d: x\\|y".to_owned()
            )]
        );
        Ok(())
    }
}
