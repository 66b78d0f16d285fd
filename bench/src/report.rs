//! The results table, printed and written into docs/benchmarks.md.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

/// Whether a figure meets its goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The goal is met.
    Met,
    /// The goal is missed.
    Missed,
    /// The row has no goal (a reference figure).
    NoGoal,
}

impl Verdict {
    /// Met when `ok`, else Missed.
    pub fn of(ok: bool) -> Verdict {
        if ok {
            Verdict::Met
        } else {
            Verdict::Missed
        }
    }

    fn text(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::Missed => "MISSED",
            Verdict::NoGoal => "-",
        }
    }
}

/// One row of the table.
#[derive(Clone, Debug)]
pub struct Row {
    /// Row number and sub-case, e.g. `2 (N=8)`.
    pub id: String,
    /// What is measured.
    pub what: String,
    /// The measured figure.
    pub figure: String,
    /// The goal, or `-`.
    pub goal: String,
    /// Met, missed, or no goal.
    pub verdict: Verdict,
    /// How it was measured.
    pub method: String,
}

/// The whole report: rows plus measured detail sections (Markdown).
#[derive(Default)]
pub struct Report {
    /// The table's rows, in order.
    pub rows: Vec<Row>,
    /// (heading, Markdown body) of each detail section.
    pub details: Vec<(String, String)>,
}

impl Report {
    /// The table as aligned plain text, then how each row was measured.
    pub fn text(&self) -> String {
        let headers = ["#", "what", "figure", "goal", "verdict"];
        let cells: Vec<[String; 5]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.id.clone(),
                    r.what.clone(),
                    r.figure.clone(),
                    r.goal.clone(),
                    r.verdict.text().to_string(),
                ]
            })
            .collect();
        let mut widths = headers.map(str::len);
        for row in &cells {
            for (w, c) in widths.iter_mut().zip(row) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cols: &[String]| {
            let mut s = String::new();
            for (i, (c, w)) in cols.iter().zip(widths).enumerate() {
                if i > 0 {
                    s.push_str(" | ");
                }
                let _ = write!(s, "{c:<w$}");
            }
            s.trim_end().to_string()
        };
        let mut out = String::new();
        out.push_str(&line(&headers.map(String::from)));
        out.push('\n');
        out.push_str(&widths.map(|w| "-".repeat(w)).join("-+-"));
        out.push('\n');
        for row in &cells {
            out.push_str(&line(row));
            out.push('\n');
        }
        out.push_str("\nHow each row was measured:\n");
        for r in &self.rows {
            let _ = writeln!(out, "  {}: {}", r.id, r.method);
        }
        out
    }

    /// The generated Markdown: run description, table, detail sections.
    pub fn markdown(&self, run: &str) -> String {
        let mut out = String::new();
        out.push_str(run);
        out.push_str("\n| # | what | figure | goal | verdict | how it was measured |\n");
        out.push_str("|---|---|---|---|---|---|\n");
        for r in &self.rows {
            let v = match r.verdict {
                Verdict::Met => "met",
                Verdict::Missed => "**missed**",
                Verdict::NoGoal => "-",
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                r.id,
                cell(&r.what),
                cell(&r.figure),
                cell(&r.goal),
                v,
                cell(&r.method)
            );
        }
        for (heading, body) in &self.details {
            let _ = write!(out, "\n### {heading}\n\n{}\n", body.trim_end());
        }
        out
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// Start and end markers of the generated part of docs/benchmarks.md.
pub const BEGIN: &str = "<!-- leasehold-bench:begin (generated; rerun scripts/bench to update) -->";
/// See [`BEGIN`].
pub const END: &str = "<!-- leasehold-bench:end -->";

/// The markers of a named block: `<!-- leasehold-bench:NAME:begin ... -->` and
/// `<!-- leasehold-bench:NAME:end -->`, for a run of some rows kept beside the full run's
/// block (see `--block`); an empty name gives [`BEGIN`] and [`END`].
pub fn markers(block: &str) -> (String, String) {
    if block.is_empty() {
        (BEGIN.to_string(), END.to_string())
    } else {
        (
            format!("<!-- leasehold-bench:{block}:begin (generated; rerun scripts/bench --block {block} to update) -->"),
            format!("<!-- leasehold-bench:{block}:end -->"),
        )
    }
}

/// Writes `generated` between the markers of the block named `block` (see [`markers`]; ""
/// for the full run's) in the file at `path`, keeping everything outside them (the
/// hand-written analysis, other blocks); creates the file if it is missing, and appends a
/// block not yet in it.
pub fn write_block(path: &Path, block: &str, generated: &str) -> anyhow::Result<()> {
    let (begin, end) = markers(block);
    let (begin, end) = (begin.as_str(), end.as_str());
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let block = format!("{begin}\n{}\n{end}", generated.trim_end());
    let new = match (old.find(begin), old.find(end)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{block}{}", &old[..b], &old[e + end.len()..])
        }
        _ if old.trim().is_empty() => format!("# Benchmarks\n\n{block}\n"),
        _ => format!("{}\n\n{block}\n", old.trim_end()),
    };
    std::fs::write(path, new).with_context(|| format!("write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regenerating_keeps_the_text_around_the_markers() {
        let dir = std::env::temp_dir().join(format!("lh-bench-{}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("b.md");
        write_block(&path, "", "one").unwrap();
        let first = std::fs::read_to_string(&path).unwrap();
        assert!(first.starts_with("# Benchmarks\n"));
        std::fs::write(&path, format!("{first}\n## Analysis\nkeep me\n")).unwrap();
        write_block(&path, "", "two").unwrap();
        let second = std::fs::read_to_string(&path).unwrap();
        assert!(second.contains("two") && !second.contains("one"));
        assert!(second.contains("keep me"));
        write_block(&path, "scale", "rows nine and ten").unwrap();
        write_block(&path, "", "three").unwrap();
        let third = std::fs::read_to_string(&path).unwrap();
        assert!(third.contains("three") && third.contains("rows nine and ten"));
        assert!(third.contains("<!-- leasehold-bench:scale:end -->") && !third.contains("two"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn text_table_lines_up() {
        let report = Report {
            rows: vec![Row {
                id: "1".into(),
                what: "w".into(),
                figure: "f|x".into(),
                goal: "-".into(),
                verdict: Verdict::NoGoal,
                method: "m".into(),
            }],
            details: vec![],
        };
        let t = report.text();
        assert!(t.starts_with("# | what | figure | goal | verdict\n"));
        assert!(report.markdown("").contains("f\\|x"));
    }
}
