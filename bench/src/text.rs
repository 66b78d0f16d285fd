//! Text shared by the rows: CPU lines, request tables, shares.

use std::fmt::Write as _;

use crate::metrics;

pub(crate) fn cpu_line(cpu: &[(String, f64)]) -> String {
    cpu.iter()
        .map(|(n, c)| format!("{n} {c:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) fn requests_table(columns: &[(&str, &metrics::Requests, f64)]) -> String {
    let grouped: Vec<Vec<metrics::Grouped>> = columns
        .iter()
        .map(|(_, r, _)| r.by_resource_verb())
        .collect();
    let mut keys: Vec<(String, String)> = Vec::new();
    for g in &grouped {
        for row in g {
            let key = (row.resource.clone(), row.verb.clone());
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    let mut s = String::from("| resource | verb |");
    for (name, _, _) in columns {
        let _ = write!(s, " {name} |");
    }
    s.push_str("\n|---|---|");
    for _ in columns {
        s.push_str("---|");
    }
    s.push('\n');
    for (res, verb) in keys {
        let mut cells = String::new();
        let mut shown = false;
        for (g, (_, _, per)) in grouped.iter().zip(columns) {
            match g.iter().find(|x| x.resource == res && x.verb == verb) {
                Some(x) if x.count / per >= 0.005 => {
                    shown = true;
                    let _ = write!(cells, " {:.2}", x.count / per);
                    let failed: Vec<String> = x
                        .failed
                        .iter()
                        .map(|(code, n)| format!("{:.2} {code}", n / per))
                        .collect();
                    if !failed.is_empty() {
                        let _ = write!(cells, " (of which {})", failed.join(", "));
                    }
                    cells.push_str(" |");
                }
                _ => cells.push_str(" 0 |"),
            }
        }
        if shown {
            let _ = writeln!(s, "| {res} | {verb} |{cells}");
        }
    }
    s
}

/// A 409 share over part of a claim run, as a percentage; "not measured" when the run ended
/// before the benchmark scraped the API server's metrics at that part's marks (NaN).
pub(crate) fn split_share(share: f64) -> String {
    if share.is_nan() {
        "not measured".into()
    } else {
        format!("{:.1}%", share * 100.0)
    }
}

#[cfg(test)]
mod tests {
    use super::split_share;

    #[test]
    fn a_share_not_measured_says_so() {
        assert_eq!(split_share(f64::NAN), "not measured");
        assert_eq!(split_share(0.0), "0.0%");
        assert_eq!(split_share(0.0125), "1.2%");
    }
}
