//! `rlsync plot RUN_DIR... [KEYS...] [-o FILE]`: learning curves from runs' `metrics.jsonl` as one PNG.
//!
//! A RUN_DIR is a run directory (it holds `metrics.jsonl`) or a multirun sweep directory (its numbered job
//! directories are taken in order). Every run is one line per panel, labelled by the overrides that set it
//! apart from the other runs (`.hydra/overrides.yaml`), so the jobs of a `-m` sweep compare at a glance. KEYS
//! are metric names (`env/return`) or prefixes ending in `/` (`sync/`); without KEYS the panels are the
//! return, success rates, sync time and bytes and staleness, where the runs have them. Text is drawn with an
//! embedded DejaVu Sans subset (`assets/fonts`), so no system font is needed.

use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use plotters::prelude::*;

/// The panels drawn without KEYS (the first present of each group of alternatives).
const DEFAULT_KEYS: &[&[&str]] = &[
    &["env/return", "rollout/return"],
    &["env/success_rate"],
    &["eval/success_rate"],
    &["eval/return"],
    &["time/sync_weights"],
    &["sync/bytes"],
    &["staleness/mean"],
];

const PANEL: (u32, u32) = (640, 400);
const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSans-ascii.ttf");

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("plot usage: {reason} (expected: rlsync plot RUN_DIR... [KEYS...] [-o FILE.png])")]
    Usage { reason: String },
    #[error("{path}: no metrics.jsonl here or in a job directory below")]
    NoMetrics { path: PathBuf },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a metrics record")]
    Json {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}:{line}: not a metrics record: {reason}")]
    Record {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("no run has the metric '{key}' (metrics present: {available})")]
    UnknownKey { key: String, available: String },
    #[error("none of the default metrics is in these runs; name the metrics to plot")]
    NothingToPlot,
    #[error("drawing the plot: {reason}")]
    Draw { reason: String },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The parsed command line of `rlsync plot`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotArgs {
    pub runs: Vec<PathBuf>,
    pub keys: Vec<String>,
    pub output: Option<PathBuf>,
}

/// Split the arguments after `plot`: existing directories are runs, other words metric names.
pub fn parse_args(args: &[String]) -> Result<PlotArgs, PlotError> {
    use lexopt::Arg;
    let usage = |reason: &str| PlotError::Usage {
        reason: reason.into(),
    };
    let mut out = PlotArgs {
        runs: Vec::new(),
        keys: Vec::new(),
        output: None,
    };
    let mut parser = lexopt::Parser::from_args(args);
    // lexopt's own errors in this parser's words.
    let word = |e: lexopt::Error| match e {
        lexopt::Error::MissingValue { .. } => usage("-o needs a file name"),
        other => usage(&other.to_string()),
    };
    while let Some(arg) = parser.next().map_err(word)? {
        match arg {
            Arg::Short('o') | Arg::Long("output") => {
                out.output = Some(PathBuf::from(parser.value().map_err(word)?));
            }
            Arg::Short(c) => return Err(usage(&format!("unknown flag -{c}"))),
            Arg::Long(name) => return Err(usage(&format!("unknown flag --{name}"))),
            Arg::Value(value) if Path::new(&value).is_dir() => out.runs.push(PathBuf::from(value)),
            Arg::Value(value) => out.keys.push(value.to_string_lossy().into_owned()),
        }
    }
    if out.runs.is_empty() {
        return Err(match out.keys.first() {
            Some(first) => PlotError::NoMetrics {
                path: PathBuf::from(first),
            },
            None => usage("no run directory given"),
        });
    }
    Ok(out)
}

/// One run's metrics: every numeric metric as `(step, value)` points, in step order.
#[derive(Debug, Clone)]
pub struct Run {
    pub dir: PathBuf,
    pub label: String,
    pub series: IndexMap<String, Vec<(f64, f64)>>,
}

/// The run directories `dir` stands for: itself, or the job directories of a sweep.
pub fn expand(dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    if dir.join("metrics.jsonl").is_file() {
        return Ok(vec![dir.to_owned()]);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| PlotError::Read {
        path: dir.to_owned(),
        source,
    })?;
    let mut jobs: Vec<(u64, String, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("metrics.jsonl").is_file())
        .map(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (name.parse().unwrap_or(u64::MAX), name, p)
        })
        .collect();
    jobs.sort();
    if jobs.is_empty() {
        return Err(PlotError::NoMetrics {
            path: dir.to_owned(),
        });
    }
    Ok(jobs.into_iter().map(|(_, _, p)| p).collect())
}

/// Read `<dir>/metrics.jsonl` (numbers and booleans become points; text metrics are skipped).
pub fn load_run(dir: &Path) -> Result<Run, PlotError> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(|source| PlotError::Read {
        path: path.clone(),
        source,
    })?;
    let mut series: IndexMap<String, Vec<(f64, f64)>> = IndexMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| PlotError::Record {
            path: path.clone(),
            line: i + 1,
            reason,
        };
        let record: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line)
            .map_err(|source| PlotError::Json {
                path: path.clone(),
                line: i + 1,
                source,
            })?;
        let step = record
            .get("step")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| bad("no numeric 'step'".into()))?;
        for (key, value) in &record {
            let v = match value {
                serde_json::Value::Number(n) => n.as_f64(),
                serde_json::Value::Bool(b) => Some(f64::from(u8::from(*b))),
                _ => None,
            };
            if key != "step"
                && let Some(v) = v.filter(|v| v.is_finite())
            {
                series.entry(key.clone()).or_default().push((step, v));
            }
        }
    }
    Ok(Run {
        dir: dir.to_owned(),
        label: String::new(),
        series,
    })
}

/// The overrides of each run (`.hydra/overrides.yaml`) that not all runs share; a run without any is named
/// by its directory.
fn label_runs(runs: &mut [Run]) {
    let overrides: Vec<Vec<String>> = runs.iter().map(|r| read_overrides(&r.dir)).collect();
    for (run, own) in runs.iter_mut().zip(&overrides) {
        let distinct: Vec<&str> = own
            .iter()
            .filter(|o| overrides.len() == 1 || !overrides.iter().all(|other| other.contains(o)))
            .map(String::as_str)
            .collect();
        run.label = if distinct.is_empty() {
            run.dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| run.dir.display().to_string())
        } else {
            distinct.join(" ")
        };
    }
}

fn read_overrides(dir: &Path) -> Vec<String> {
    let path = dir.join(".hydra/overrides.yaml");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Vec::new();
    };
    let Ok(node) = hydra_compose::yaml::load_str(&text, &path.display().to_string()) else {
        return Vec::new();
    };
    node.as_list()
        .unwrap_or_default()
        .iter()
        .map(|n| n.value.python_str())
        .collect()
}

/// The panels to draw: the keys asked for (prefixes expanded), or the defaults the runs have.
pub fn select_keys(runs: &[Run], asked: &[String]) -> Result<Vec<String>, PlotError> {
    let present = |key: &str| runs.iter().any(|r| r.series.contains_key(key));
    let mut all: Vec<&str> = Vec::new();
    for run in runs {
        for key in run.series.keys() {
            if !all.contains(&key.as_str()) {
                all.push(key);
            }
        }
    }
    if asked.is_empty() {
        let keys: Vec<String> = DEFAULT_KEYS
            .iter()
            .filter_map(|alts| alts.iter().find(|k| present(k)))
            .map(|k| (*k).to_owned())
            .collect();
        return if keys.is_empty() {
            Err(PlotError::NothingToPlot)
        } else {
            Ok(keys)
        };
    }
    let mut keys = Vec::new();
    for key in asked {
        let matched: Vec<&str> = if key.ends_with('/') {
            all.iter()
                .copied()
                .filter(|k| k.starts_with(key.as_str()))
                .collect()
        } else {
            all.iter().copied().filter(|k| *k == key.as_str()).collect()
        };
        if matched.is_empty() {
            return Err(PlotError::UnknownKey {
                key: key.clone(),
                available: all.join(", "),
            });
        }
        keys.extend(matched.into_iter().map(str::to_owned));
    }
    Ok(keys)
}

/// Shell completion after `rlsync plot` (`typed`: the words already on the line after `plot`; `word`: the one
/// being completed): flags, directories (run or sweep directories, or the way to them), and the metric names
/// and prefixes of the runs already named; after `-o` any path. Unreadable runs complete nothing of theirs.
pub fn complete(typed: &[String], word: &str) -> Vec<String> {
    if matches!(typed.last().map(String::as_str), Some("-o" | "--output")) {
        return complete_path(word, false);
    }
    if word.starts_with('-') {
        return ["--output", "-o"]
            .into_iter()
            .filter(|f| f.starts_with(word))
            .map(str::to_owned)
            .collect();
    }
    let mut found = complete_path(word, true);
    let mut keys: Vec<String> = Vec::new();
    for dir in typed.iter().map(Path::new).filter(|p| p.is_dir()) {
        for job in expand(dir).unwrap_or_default() {
            let Ok(run) = load_run(&job) else { continue };
            for key in run.series.keys() {
                // The key, and each prefix of it ending in `/` (a group of panels).
                let prefixes = key.match_indices('/').map(|(i, _)| &key[..=i]);
                for k in prefixes.chain(std::iter::once(key.as_str())) {
                    if k.starts_with(word) && !keys.iter().any(|have| have == k) {
                        keys.push(k.to_owned());
                    }
                }
            }
        }
    }
    keys.sort();
    found.extend(keys);
    found
}

/// Paths starting with `word` (directories end in `/`); `dirs_only` leaves files out. Hidden entries only
/// when the typed name starts with `.`.
fn complete_path(word: &str, dirs_only: bool) -> Vec<String> {
    let (parent, prefix) = match word.rfind('/') {
        Some(i) => (&word[..=i], &word[i + 1..]),
        None => ("", word),
    };
    let dir = if parent.is_empty() {
        Path::new(".")
    } else {
        Path::new(parent)
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_str()?.to_owned();
            if !name.starts_with(prefix) || (name.starts_with('.') && !prefix.starts_with('.')) {
                return None;
            }
            let is_dir = e.path().is_dir();
            match (is_dir, dirs_only) {
                (true, _) => Some(format!("{parent}{name}/")),
                (false, false) => Some(format!("{parent}{name}")),
                (false, true) => None,
            }
        })
        .collect();
    out.sort();
    out
}

/// `rlsync plot`: load the runs, draw one panel per metric, write the PNG; returns its path.
pub fn run(args: &PlotArgs) -> Result<PathBuf, PlotError> {
    let mut runs = Vec::new();
    for dir in &args.runs {
        for job in expand(dir)? {
            runs.push(load_run(&job)?);
        }
    }
    label_runs(&mut runs);
    let keys = select_keys(&runs, &args.keys)?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| args.runs[0].join("curves.png"));
    let png = render(&runs, &keys)?;
    std::fs::write(&output, png).map_err(|source| PlotError::Write {
        path: output.clone(),
        source,
    })?;
    Ok(output)
}

/// Draw the panels (two per row) and encode them as PNG bytes.
pub fn render(runs: &[Run], keys: &[String]) -> Result<Vec<u8>, PlotError> {
    let draw = |e: &dyn std::fmt::Display| PlotError::Draw {
        reason: e.to_string(),
    };
    // Registering twice (a second plot in one process) is harmless: the same font under the same name.
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| draw(&"the embedded font is not a valid TrueType font"))?;
    let cols = if keys.len() == 1 { 1 } else { 2 };
    let rows = keys.len().div_ceil(cols);
    let (w, h) = (PANEL.0 * cols as u32, PANEL.1 * rows as u32);
    let mut pixels = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw(&e))?;
        let panels = root.split_evenly((rows, cols));
        for (key, area) in keys.iter().zip(panels.iter()) {
            panel(area, runs, key).map_err(|e| draw(&e))?;
        }
        root.present().map_err(|e| draw(&e))?;
    }
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| draw(&e))?;
    writer.write_image_data(&pixels).map_err(|e| draw(&e))?;
    writer.finish().map_err(|e| draw(&e))?;
    Ok(out)
}

/// Times are recorded in seconds and read best in milliseconds.
fn scale(key: &str) -> (f64, String) {
    if key.starts_with("time/") {
        (1e3, format!("{key} [ms]"))
    } else {
        (1.0, key.to_owned())
    }
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn panel(area: &Area<'_>, runs: &[Run], key: &str) -> Result<(), Box<dyn std::error::Error>> {
    let (factor, title) = scale(key);
    let lines: Vec<(&Run, Vec<(f64, f64)>)> = runs
        .iter()
        .filter_map(|r| {
            let points = r.series.get(key)?;
            Some((r, points.iter().map(|&(x, y)| (x, y * factor)).collect()))
        })
        .collect();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (_, points) in &lines {
        for &(x, y) in points {
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1.0 {
        x1 = x0 + 1.0;
    }
    let pad = if y1 > y0 {
        (y1 - y0) * 0.05
    } else {
        y0.abs().max(1.0) * 0.1
    };
    let y_step = ((y1 + pad) - (y0 - pad)) / Y_LABELS as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_labels(Y_LABELS)
        .y_label_formatter(&|v| tick_label(*v, y_step))
        .draw()?;
    for (i, (run, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))?
            .label(run.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
    }
    if lines.len() > 1 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .draw()?;
    }
    Ok(())
}

/// Labels plotters draws on the y axis at most (its default): ticks are at least the range / this apart.
const Y_LABELS: usize = 10;

/// A tick label short enough for the axis (`1.5M`, `20k`, `0.25`, `-4.2`) with the digits that tell it from its
/// neighbours `step` away (ticks of `sync/bytes` 10 apart near 40 500 read `40.51k`, `40.52k`, not all `40.5k`).
fn tick_label(v: f64, step: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    // (unit, suffix, decimals the unit shows at least)
    let (unit, suffix, least) = if a >= 1e9 {
        (1e9, "G", 2)
    } else if a >= 1e6 {
        (1e6, "M", 2)
    } else if a >= 1e4 {
        (1e3, "k", 1)
    } else if a >= 100.0 || a == 0.0 {
        (1.0, "", 0)
    } else {
        (1.0, "", 3)
    };
    // Enough decimals that `step` (in the unit) changes the last one shown, plus one for steps like 0.25.
    let needed = if step.is_finite() && step > 0.0 {
        ((-(step / unit).log10()).ceil() + 1.0).clamp(0.0, 12.0) as usize
    } else {
        0
    };
    let s = trim(format!("{:.*}", least.max(needed), v / unit));
    // A tick a rounding error below zero reads as 0, not -0.
    if s == "-0" {
        "0".to_owned()
    } else {
        format!("{s}{suffix}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_run(dir: &Path, overrides: &[&str], records: &[&str]) {
        std::fs::create_dir_all(dir.join(".hydra")).unwrap();
        let yaml: String = overrides.iter().map(|o| format!("- {o}\n")).collect();
        std::fs::write(dir.join(".hydra/overrides.yaml"), yaml).unwrap();
        std::fs::write(dir.join("metrics.jsonl"), records.join("\n")).unwrap();
    }

    #[test]
    fn completion_offers_flags_run_directories_and_the_named_runs_metrics() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run_a");
        write_run(
            &run,
            &[],
            &[r#"{"step":0,"env/return":-40.5,"sync/bytes":10,"sync/time_ms":2.0}"#],
        );
        std::fs::create_dir_all(tmp.path().join("run_b")).unwrap();
        std::fs::write(tmp.path().join("notes.txt"), "x").unwrap();
        let base = format!("{}/", tmp.path().display());
        assert_eq!(complete(&[], "-"), ["--output", "-o"]);
        assert_eq!(
            complete(&[], &format!("{base}run")),
            [format!("{base}run_a/"), format!("{base}run_b/")]
        );
        // Files only after -o; hidden entries only when asked for.
        assert_eq!(
            complete(&["-o".into()], &format!("{base}no")),
            [format!("{base}notes.txt")]
        );
        assert!(complete(&[], &format!("{base}no")).is_empty());
        let typed = [run.display().to_string()];
        assert_eq!(
            complete(&typed, "sync/"),
            ["sync/", "sync/bytes", "sync/time_ms"]
        );
        assert_eq!(complete(&typed, "env/r"), ["env/return"]);
        // A run that cannot be read completes nothing of its own (no panic).
        std::fs::write(tmp.path().join("run_b/metrics.jsonl"), "not json").unwrap();
        let typed = [tmp.path().join("run_b").display().to_string()];
        assert!(complete(&typed, "env/").is_empty());
    }

    #[test]
    fn a_sweep_dir_expands_to_its_jobs_in_order_labelled_by_their_own_overrides() {
        let tmp = tempfile::tempdir().unwrap();
        for (job, lr) in [("0", "1e-3"), ("1", "2e-3"), ("10", "3e-3")] {
            let lr = format!("actor.optim.lr={lr}");
            write_run(
                &tmp.path().join(job),
                &["runner.max_steps=3", lr.as_str()],
                &[
                    r#"{"step":0,"env/return":-40.5,"sync/kind":"init","sync/verified":true}"#,
                    r#"{"step":1,"env/return":-20.0,"sync/kind":"patch","sync/verified":true}"#,
                ],
            );
        }
        let jobs = expand(tmp.path()).unwrap();
        let names: Vec<_> = jobs
            .iter()
            .map(|j| j.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["0", "1", "10"]);
        let mut runs: Vec<Run> = jobs.iter().map(|j| load_run(j).unwrap()).collect();
        label_runs(&mut runs);
        assert_eq!(runs[2].label, "actor.optim.lr=3e-3");
        assert_eq!(
            runs[0].series["env/return"],
            vec![(0.0, -40.5), (1.0, -20.0)]
        );
        assert!(
            !runs[0].series.contains_key("sync/kind"),
            "text is not plotted"
        );
        assert_eq!(
            runs[0].series["sync/verified"],
            vec![(0.0, 1.0), (1.0, 1.0)]
        );
        assert_eq!(select_keys(&runs, &[]).unwrap(), ["env/return"]);
        assert_eq!(
            select_keys(&runs, &["sync/".into()]).unwrap(),
            ["sync/verified"]
        );
        let err = select_keys(&runs, &["env/retrun".into()]).unwrap_err();
        assert!(err.to_string().contains("env/return"), "{err}");

        let png = render(&runs, &["env/return".into(), "sync/verified".into()]).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = png::Decoder::new(std::io::Cursor::new(&png));
        let reader = decoder.read_info().unwrap();
        assert_eq!(
            (reader.info().width, reader.info().height),
            (2 * PANEL.0, PANEL.1)
        );
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            expand(tmp.path()),
            Err(PlotError::NoMetrics { .. })
        ));
        std::fs::write(tmp.path().join("metrics.jsonl"), "{\"step\":0}\nnot json\n").unwrap();
        let err = load_run(tmp.path()).unwrap_err();
        assert!(err.to_string().contains("metrics.jsonl:2"), "{err}");
        assert!(
            matches!(&err, PlotError::Json { line: 2, .. })
                && std::error::Error::source(&err).is_some(),
            "the JSON error is the cause: {err:?}"
        );
        std::fs::write(tmp.path().join("metrics.jsonl"), "{\"x\":1}\n").unwrap();
        assert!(load_run(tmp.path()).is_err());
        let args = |a: &[&str]| parse_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(matches!(args(&[]), Err(PlotError::Usage { .. })));
        assert!(matches!(
            args(&["/nonexistent/run"]),
            Err(PlotError::NoMetrics { .. })
        ));
        let dir = tmp.path().display().to_string();
        let parsed = args(&[dir.as_str(), "env/return", "-o", "x.png"]).unwrap();
        assert_eq!(parsed.keys, ["env/return"]);
        assert_eq!(parsed.output, Some(PathBuf::from("x.png")));
        assert!(matches!(
            args(&[dir.as_str(), "-o"]),
            Err(PlotError::Usage { .. })
        ));
        let long = args(&[dir.as_str(), "--output=y.png", "sync/"]).unwrap();
        assert_eq!(long.output, Some(PathBuf::from("y.png")));
        assert_eq!(long.keys, ["sync/"]);
        assert_eq!(
            args(&[dir.as_str(), "--colour"]).unwrap_err().to_string(),
            "plot usage: unknown flag --colour (expected: rlsync plot RUN_DIR... [KEYS...] [-o FILE.png])"
        );
        assert!(
            args(&[dir.as_str(), "-o"])
                .unwrap_err()
                .to_string()
                .contains("-o needs a file name")
        );
    }

    #[test]
    fn tick_labels_stay_short() {
        // Ticks far apart: the short forms.
        let coarse = f64::INFINITY;
        assert_eq!(tick_label(1_500_000.0, coarse), "1.5M");
        assert_eq!(tick_label(20_000.0, coarse), "20k");
        assert_eq!(tick_label(0.25, coarse), "0.25");
        assert_eq!(tick_label(-4.2, coarse), "-4.2");
        assert_eq!(tick_label(150.0, coarse), "150");
        assert_eq!(tick_label(0.0, coarse), "0");
        assert_eq!(tick_label(-1e-17, 0.1), "0");
        assert_eq!(tick_label(2_000_000.0, 500_000.0), "2M");
    }

    #[test]
    fn close_ticks_get_the_digits_that_tell_them_apart() {
        // `sync/bytes` of a run whose syncs all send about 40.5 kB: before, every tick read "40.5k".
        for (ticks, step) in [
            (&[40_500.0, 40_510.0, 40_520.0, 40_530.0][..], 10.0),
            (&[40_500.0, 40_502.0, 40_504.0][..], 2.0),
            (&[1_230_000.0, 1_230_500.0, 1_231_000.0][..], 500.0),
            (&[150.1, 150.2, 150.3][..], 0.1),
            (&[0.2501, 0.2502, 0.2503][..], 0.0001),
            (&[7.5e9, 7.5025e9, 7.505e9][..], 2.5e6),
        ] {
            let labels: Vec<String> = ticks.iter().map(|&v| tick_label(v, step)).collect();
            let mut distinct = labels.clone();
            distinct.dedup();
            assert_eq!(distinct.len(), labels.len(), "{labels:?}");
            // Each label reads back as its tick, to within a tenth of the step.
            for (label, &v) in labels.iter().zip(ticks) {
                let (digits, unit) = match label.chars().last() {
                    Some('k') => (&label[..label.len() - 1], 1e3),
                    Some('M') => (&label[..label.len() - 1], 1e6),
                    Some('G') => (&label[..label.len() - 1], 1e9),
                    _ => (label.as_str(), 1.0),
                };
                let back: f64 = digits.parse::<f64>().unwrap() * unit;
                assert!((back - v).abs() <= step / 10.0, "{label} for {v}");
            }
        }
        assert_eq!(tick_label(40_510.0, 10.0), "40.51k");
        assert_eq!(tick_label(40_500.0, 10.0), "40.5k");
    }
}
