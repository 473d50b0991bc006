//! Entry points (`train_embodied`, `train_async`, `bench_sync`, `plot`, hidden `worker`) and Hydra's command-line
//! flags.
//!
//! This module only turns argv into a typed [`HydraArgs`] and dispatches; composition lives in `config`.

use std::process::ExitCode;

use crate::orchestrator::Entry;
use hydra_compose::hydra::app::{self, AppRequest, Command, InfoKind, Outcome, ShowCfg};

/// The process exit statuses rlsync uses (documented in README.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// The job (or `--cfg`, `--info`, `--dry-run`) completed.
    Success,
    /// A configuration or runtime error; the message is on stderr.
    Failure,
    /// A command-line usage error (argparse's exit status); usage and message are on stderr.
    Usage,
}

impl From<ExitStatus> for ExitCode {
    fn from(status: ExitStatus) -> ExitCode {
        match status {
            ExitStatus::Success => ExitCode::SUCCESS,
            ExitStatus::Failure => ExitCode::FAILURE,
            ExitStatus::Usage => ExitCode::from(2),
        }
    }
}

/// What to print instead of running, from `--cfg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CfgKind {
    Job,
    Hydra,
    All,
}

/// Hydra's flags as typed on the command line (validated, not yet interpreted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HydraArgs {
    pub entry: Entry,
    pub config_path: Option<String>,
    pub config_name: Option<String>,
    pub config_dir: Option<String>,
    pub cfg: Option<CfgKind>,
    pub resolve: bool,
    pub package: Option<String>,
    pub info: Option<InfoKind>,
    pub multirun: bool,
    pub run: bool,
    pub help: bool,
    pub hydra_help: bool,
    pub dry_run: bool,
    /// `-sc/--shell-completion [install|uninstall|query=SHELL]`: `Some("")` when given without a value.
    pub shell_completion: Option<String>,
    pub overrides: Vec<String>,
}

/// A command-line usage error (unknown flag, missing or bad flag value).
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("{USAGE}\nrlsync: error: unrecognized arguments: {0}")]
    UnknownFlag(String),
    #[error("{USAGE}\nrlsync: error: argument {flag}: expected one argument")]
    MissingValue { flag: &'static str },
    #[error(
        "{USAGE}\nrlsync: error: argument {flag}: invalid choice: '{value}' (choose from {choices})"
    )]
    InvalidChoice {
        flag: &'static str,
        value: String,
        choices: &'static str,
    },
    #[error(
        "{USAGE}\nrlsync: error: argument entry: invalid choice: '{0}' (choose from 'train_embodied', 'train_async', 'bench_sync', 'plot')"
    )]
    UnknownEntry(String),
    #[error(
        "{USAGE}\nrlsync: error: the following arguments are required: entry (train_embodied, train_async, bench_sync or plot)"
    )]
    NoEntry,
}

/// The entry points `rlsync` takes, as shell completion offers them (the usage line names the same).
const ENTRY_POINTS: [&str; 4] = ["bench_sync", "plot", "train_async", "train_embodied"];

const USAGE: &str = "usage: rlsync {train_embodied,train_async,bench_sync,plot} [--help] [--hydra-help] [--version] [--cfg {job,hydra,all}]
              [--resolve] [--package PACKAGE] [--run] [--multirun] [--shell-completion] [--config-path CONFIG_PATH]
              [--config-name CONFIG_NAME] [--config-dir CONFIG_DIR]
              [--info [{all,config,defaults,defaults-tree,plugins,searchpath}]] [--dry-run]
              [overrides ...]";

const FLAGS_HELP: &str = "--help,-h : Application's help
--hydra-help : Hydra's help
--version : Show Hydra's version and exit
--cfg,-c : Show config instead of running [job|hydra|all]
--resolve : Used in conjunction with --cfg, resolve config interpolations before printing.
--package,-p : Config package to show
--run,-r : Run a job
--multirun,-m : Run multiple jobs with the configured launcher and sweeper
--shell-completion,-sc : Install or Uninstall shell completion:
    Bash - Install:
    eval \"$(rlsync -sc install=bash)\"
    Bash - Uninstall:
    eval \"$(rlsync -sc uninstall=bash)\"

    Fish - Install:
    rlsync -sc install=fish | source
    Fish - Uninstall:
    rlsync -sc uninstall=fish | source

    Zsh - Install:
    Zsh is compatible with the Bash shell completion, see the [documentation](https://hydra.cc/docs/1.2/tutorials/basic/running_your_app/tab_completion#zsh-instructions) for details.
    eval \"$(rlsync -sc install=bash)\"
    Zsh - Uninstall:
    eval \"$(rlsync -sc uninstall=bash)\"

--config-path,-cp : Overrides the config_path specified in hydra.main().
                    The config_path is absolute or relative to the working directory
--config-name,-cn : Overrides the config_name specified in hydra.main()
--config-dir,-cd : Adds an additional config dir to the config search path
--info,-i : Print Hydra information [all|config|defaults|defaults-tree|plugins|searchpath]
--dry-run : Compose, resolve and validate the config, print the plan, and exit
Overrides : Any key=value arguments to override config values (use dots for.nested=overrides)";

/// Parse the arguments after the entry point name.
pub fn parse_hydra_args(entry: Entry, args: &[String]) -> Result<HydraArgs, UsageError> {
    let mut out = HydraArgs {
        entry,
        config_path: None,
        config_name: None,
        config_dir: None,
        cfg: None,
        resolve: false,
        package: None,
        info: None,
        multirun: false,
        run: false,
        help: false,
        hydra_help: false,
        dry_run: false,
        shell_completion: None,
        overrides: Vec::new(),
    };
    let mut i = 0;
    while i < args.len() {
        let arg = args[i].as_str();
        i += 1;
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_owned())),
            _ => (arg, None),
        };
        let mut value = |name: &'static str| -> Result<String, UsageError> {
            if let Some(v) = &inline {
                return Ok(v.clone());
            }
            let v = args.get(i).ok_or(UsageError::MissingValue { flag: name })?;
            i += 1;
            Ok(v.clone())
        };
        match flag {
            "--help" | "-h" => out.help = true,
            "--hydra-help" => out.hydra_help = true,
            "--resolve" => out.resolve = true,
            "--run" | "-r" => out.run = true,
            "--multirun" | "-m" => out.multirun = true,
            "--dry-run" => out.dry_run = true,
            "--config-path" | "-cp" => out.config_path = Some(value("--config-path/-cp")?),
            "--config-name" | "-cn" => out.config_name = Some(value("--config-name/-cn")?),
            "--config-dir" | "-cd" => out.config_dir = Some(value("--config-dir/-cd")?),
            "--package" | "-p" => out.package = Some(value("--package/-p")?),
            "--cfg" | "-c" => {
                let v = value("--cfg/-c")?;
                out.cfg = Some(match v.as_str() {
                    "job" => CfgKind::Job,
                    "hydra" => CfgKind::Hydra,
                    "all" => CfgKind::All,
                    _ => {
                        return Err(UsageError::InvalidChoice {
                            flag: "--cfg/-c",
                            value: v,
                            choices: "'job', 'hydra', 'all'",
                        });
                    }
                });
            }
            "--shell-completion" | "-sc" => {
                let v = match (&inline, args.get(i)) {
                    (Some(v), _) => v.clone(),
                    // argparse's optional value: the next word unless it is a flag.
                    (None, Some(next)) if !next.starts_with('-') => {
                        i += 1;
                        next.clone()
                    }
                    _ => String::new(),
                };
                out.shell_completion = Some(v);
            }
            "--info" | "-i" => {
                let v = match (&inline, args.get(i)) {
                    (Some(v), _) => v.clone(),
                    (None, Some(next)) if !next.starts_with('-') => {
                        i += 1;
                        next.clone()
                    }
                    _ => "all".into(),
                };
                out.info = Some(InfoKind::parse(&v).ok_or(UsageError::InvalidChoice {
                    flag: "--info/-i",
                    value: v,
                    choices: "'all', 'config', 'defaults', 'defaults-tree', 'plugins', 'searchpath'",
                })?);
            }
            _ if arg.starts_with('-') && !arg.starts_with("--") && arg.len() == 2
                || arg.starts_with("--") =>
            {
                return Err(UsageError::UnknownFlag(arg.to_owned()));
            }
            _ if arg.starts_with('-') && !arg.contains('=') => {
                return Err(UsageError::UnknownFlag(arg.to_owned()));
            }
            _ => out.overrides.push(arg.to_owned()),
        }
    }
    Ok(out)
}

/// `rlsync --help`: the usage, every entry point (`plot` among them), `--cleanup` and Hydra's flags.
fn usage_text() -> String {
    format!(
        "{USAGE}\n\nEntry points:\n{ENTRY_POINTS_HELP}\nrlsync --cleanup removes the sockets and shared memory of runs whose orchestrator was killed.\n\nFlags:\n{FLAGS_HELP}\n"
    )
}

/// The entry points `rlsync --help` lists, one a line.
const ENTRY_POINTS_HELP: &str = "  train_embodied  synchronous embodied RL training
  train_async     asynchronous (overlapped) training
  bench_sync      weight-sync benchmark
  plot            learning curves from metrics.jsonl as a PNG: rlsync plot RUN_DIR... [KEYS...] [-o FILE]
";

fn print_usage() {
    hydra_compose::stdio::out(format_args!("{}", usage_text()));
}

/// When `run` began (the process's start, as far as rlsync can tell): the first job's wall time counts from it.
static STARTED: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

/// Where a job's wall time starts: the process's start for the first job, the moment it starts for the later
/// jobs of a multirun.
fn job_start() -> std::time::Instant {
    STARTED
        .lock()
        .ok()
        .and_then(|mut started| started.take())
        .unwrap_or_else(std::time::Instant::now)
}

/// Run rlsync with the arguments after the program name.
pub fn run(args: &[String]) -> anyhow::Result<ExitStatus> {
    if let Ok(mut started) = STARTED.lock() {
        started.get_or_insert_with(std::time::Instant::now);
    }
    match run_args(args) {
        Err(err) => match err.downcast::<UsageError>() {
            // argparse's way: usage and message on stderr, exit status 2.
            Ok(usage) => {
                hydra_compose::stdio::err(format_args!("{usage}\n"));
                Ok(ExitStatus::Usage)
            }
            Err(other) => Err(other),
        },
        ok => ok,
    }
}

fn run_args(args: &[String]) -> anyhow::Result<ExitStatus> {
    let Some(first) = args.first() else {
        return Err(UsageError::NoEntry.into());
    };
    if first == "-sc" || first == "--shell-completion" || first.starts_with("--shell-completion=") {
        // Completion is set up once for `rlsync`, not per entry point.
        let parsed = parse_hydra_args(Entry::Embodied, args)?;
        return shell_completion(parsed.shell_completion.as_deref().unwrap_or_default());
    }
    if first == "-h" || first == "--help" {
        print_usage();
        return Ok(ExitStatus::Success);
    }
    if first == "--version" {
        hydra_compose::stdio::out(format_args!(
            "rlsync {} (Hydra {})\n",
            env!("CARGO_PKG_VERSION"),
            hydra_compose::hydra::HYDRA_VERSION
        ));
        return Ok(ExitStatus::Success);
    }
    if first == "--cleanup" {
        // Leftovers of runs whose orchestrator was killed (SIGKILL leaves no chance to clean up).
        let swept = crate::orchestrator::run_files::sweep_leftovers(&std::env::temp_dir());
        for dir in &swept.dirs {
            hydra_compose::stdio::out(format_args!("removed {}\n", dir.display()));
        }
        hydra_compose::stdio::out(format_args!(
            "removed {} run director{} and {} shared-memory segment{} of runs that are gone\n",
            swept.dirs.len(),
            if swept.dirs.len() == 1 { "y" } else { "ies" },
            swept.segments,
            if swept.segments == 1 { "" } else { "s" }
        ));
        return Ok(ExitStatus::Success);
    }
    if first == "plot" {
        let args = crate::plot::parse_args(args.get(1..).unwrap_or_default())?;
        let written = crate::plot::run(&args)?;
        hydra_compose::stdio::out(format_args!("{}\n", written.display()));
        return Ok(ExitStatus::Success);
    }
    if first == "worker" {
        // Hidden: started by the orchestrator's supervisor, never by users.
        crate::worker::run_worker(args.get(1..).unwrap_or_default())?;
        return Ok(ExitStatus::Success);
    }
    let entry = Entry::parse(first).ok_or_else(|| {
        if first.starts_with('-') {
            UsageError::UnknownFlag(first.clone())
        } else {
            UsageError::UnknownEntry(first.clone())
        }
    })?;
    let rest = args.get(1..).unwrap_or_default();
    if rest.iter().any(|a| a == "--version") {
        hydra_compose::stdio::out(format_args!(
            "Hydra {}\n",
            hydra_compose::hydra::HYDRA_VERSION
        ));
        return Ok(ExitStatus::Success);
    }
    let hydra_args = parse_hydra_args(entry, rest)?;
    run_entry(&hydra_args)
}

fn run_entry(args: &HydraArgs) -> anyhow::Result<ExitStatus> {
    let has_cfg = args.cfg.is_some();
    if args.resolve && !has_cfg && !args.help {
        anyhow::bail!("The --resolve flag can only be used in conjunction with --cfg or --help");
    }
    let commands = [
        args.run,
        has_cfg,
        args.multirun,
        args.info.is_some(),
        args.shell_completion.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if commands > 1 {
        anyhow::bail!(
            "Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified"
        );
    }
    if let Some(sc) = &args.shell_completion {
        return shell_completion(sc);
    }
    let command = if args.help {
        Command::AppHelp {
            flags_help: FLAGS_HELP,
        }
    } else if args.hydra_help {
        Command::HydraHelp {
            flags_help: FLAGS_HELP,
        }
    } else if let Some(kind) = args.cfg {
        let show = match kind {
            CfgKind::Job => ShowCfg::Job,
            CfgKind::Hydra => ShowCfg::Hydra,
            CfgKind::All => ShowCfg::All,
        };
        Command::ShowCfg {
            show,
            package: args.package.clone(),
            resolve: args.resolve,
        }
    } else if let Some(info) = args.info {
        Command::Info(info)
    } else if args.multirun {
        Command::Multirun {
            dry_run: args.dry_run,
        }
    } else {
        Command::Run {
            dry_run: args.dry_run,
        }
    };
    let request = AppRequest {
        primary: &crate::config::EMBEDDED,
        entry: args.entry.name(),
        config_path: args.config_path.as_deref(),
        config_name: args.config_name.as_deref().unwrap_or(args.entry.name()),
        config_dir: args.config_dir.as_deref(),
        overrides: &args.overrides,
        command,
    };
    // Composition's message is Hydra's wording, printed as it is (its causes, if any, on `caused by:` lines).
    let outcome = app::execute(&request)?;
    match outcome {
        Outcome::Printed { success } => Ok(if success {
            ExitStatus::Success
        } else {
            ExitStatus::Failure
        }),
        Outcome::Jobs(jobs) => {
            // Every job runs (as Hydra's basic launcher does); the sweep fails if any job failed.
            let mut status = ExitStatus::Success;
            for job in *jobs {
                let job = job.map_err(anyhow::Error::from)?;
                if run_job(args.entry, &job)? == ExitStatus::Failure {
                    status = ExitStatus::Failure;
                }
            }
            Ok(status)
        }
    }
}

/// `-sc install=SHELL`, `uninstall=SHELL`, `query=SHELL` (the shell's `COMP_LINE` is the line to complete).
fn shell_completion(value: &str) -> anyhow::Result<ExitStatus> {
    use hydra_compose::hydra::completion::{self, Action, Shell};
    let Some((action, shell)) = value
        .split_once('=')
        .and_then(|(a, s)| Some((Action::parse(a)?, s)))
    else {
        anyhow::bail!("Expecting one subcommand from ['install', 'uninstall', 'query'] to be set");
    };
    let shell = Shell::parse(shell).ok_or_else(|| {
        anyhow::anyhow!(
            "No completion plugin for '{shell}' found, available : \n\tbash\n\tfish\n\tzsh"
        )
    })?;
    let exe = std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "rlsync".into());
    match action {
        Action::Install => {
            hydra_compose::stdio::out(format_args!("{}", completion::install_script(shell, &exe)))
        }
        Action::Uninstall => {
            let old = std::env::var("_HYDRA_OLD_COMP").unwrap_or_default();
            hydra_compose::stdio::out(format_args!(
                "{}",
                completion::uninstall_script(shell, &exe, &old)
            ));
        }
        Action::Query => {
            let line = std::env::var("COMP_LINE").unwrap_or_default();
            let found = completion_candidates(&line);
            hydra_compose::stdio::out(format_args!(
                "{}\n",
                completion::format_candidates(shell, &found)
            ));
        }
    }
    Ok(ExitStatus::Success)
}

/// Candidates for the last word of `line` (`rlsync ENTRY [FLAGS] [OVERRIDES] WORD`): entry points first,
/// then what Hydra completes for the entry's config (`-cp`/`-cn`/`-cd`/`-m` on the line are honoured).
pub fn completion_candidates(line: &str) -> Vec<String> {
    use hydra_compose::hydra::completion;
    let rest = completion::strip_program(line);
    let new_word = line.is_empty() || line.ends_with(' ');
    let mut words: Vec<String> = rest.split_whitespace().map(str::to_owned).collect();
    let word = if new_word {
        String::new()
    } else {
        words.pop().unwrap_or_default()
    };
    let Some((first, typed)) = words.split_first() else {
        return ENTRY_POINTS
            .into_iter()
            .filter(|e| e.starts_with(&word))
            .map(str::to_owned)
            .collect();
    };
    if first == "plot" {
        return crate::plot::complete(typed, &word);
    }
    let Some(entry) = Entry::parse(first) else {
        return Vec::new();
    };
    let Ok(args) = parse_hydra_args(entry, typed) else {
        return Vec::new();
    };
    let Ok(mut repo) = app::build_repository(
        &crate::config::EMBEDDED,
        args.config_path.as_deref(),
        args.config_dir.as_deref(),
    ) else {
        return Vec::new();
    };
    completion::candidates(
        &mut repo,
        &completion::Query {
            config_name: args.config_name.as_deref().unwrap_or(entry.name()),
            job_name: entry.name(),
            overrides: &args.overrides,
            word: &word,
            multirun: args.multirun,
        },
    )
}

/// The seam to the rest of rlsync: a composed, resolved job goes to typed validation, then to the dry-run plan
/// or the orchestrator.
fn run_job(entry: Entry, job: &app::PreparedJob) -> anyhow::Result<ExitStatus> {
    let extracted = match crate::config::typed::extract(&job.config) {
        Ok(extracted) => extracted,
        Err(errors) => {
            hydra_compose::stdio::err(format_args!("{errors}"));
            return Ok(ExitStatus::Failure);
        }
    };
    if job.dry_run {
        let report = crate::dry_run::dry_run(entry, &extracted, &job.output_dir);
        hydra_compose::stdio::out(format_args!("{report}"));
        return Ok(if report.problems.is_empty() {
            ExitStatus::Success
        } else {
            ExitStatus::Failure
        });
    }
    if entry == Entry::BenchSync {
        crate::bench::run(&extracted.config)?;
        return Ok(ExitStatus::Success);
    }
    crate::logging::init_console(extracted.config.runner.logger.level);
    let job_name = match job.full.get_path("hydra.job.name").and_then(|n| n.as_str()) {
        Some(name) => name.to_owned(),
        None => entry.name().to_owned(),
    };
    let opts = crate::orchestrator::RunOptions {
        job: job.config.to_json(),
        job_log: Some(job.output_dir.join(format!("{job_name}.log"))),
        unused_keys: extracted.ignored.clone(),
        started: job_start(),
        ..Default::default()
    };
    crate::orchestrator::run(entry, &extracted.config, &job.output_dir, opts)?;
    Ok(ExitStatus::Success)
}

/// The process's arguments after the program name, or the first that is not valid UTF-8 (rlsync's command
/// lines are UTF-8; both executables refuse anything else before parsing).
pub fn utf8_args() -> Result<Vec<String>, std::ffi::OsString> {
    std::env::args_os()
        .skip(1)
        .map(|arg| arg.into_string())
        .collect()
}

/// What a failed command prints on stderr: `Error: ` and the [`error_report`]. A caret line right under the
/// first line (Hydra's `LexerNoViableAltException: <override>` and its `^` under the bad character) is shifted by
/// the prefix too, so it still points at the character.
pub fn error_text(err: &anyhow::Error) -> String {
    const PREFIX: &str = "Error: ";
    let report = error_report(err);
    let mut lines = report.splitn(3, '\n');
    let first = lines.next().unwrap_or_default();
    let mut out = format!("{PREFIX}{first}");
    if let Some(second) = lines.next() {
        let is_caret = second.trim_start() == "^";
        out.push('\n');
        if is_caret {
            out.push_str(&" ".repeat(PREFIX.len()));
        }
        out.push_str(second);
    }
    if let Some(rest) = lines.next() {
        out.push('\n');
        out.push_str(rest);
    }
    out
}

/// The message of a failed run: the error's own line, then one `caused by:` line per cause (each
/// error's message says only its own layer; its cause is its `source()`).
pub fn error_report(err: &anyhow::Error) -> String {
    let mut msg = err.to_string();
    for cause in err.chain().skip(1) {
        msg.push_str("\n  caused by: ");
        msg.push_str(&cause.to_string());
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_report_puts_each_cause_on_its_own_line() {
        #[derive(Debug, thiserror::Error)]
        #[error("cannot prepare /run")]
        struct Prepare {
            source: std::io::Error,
        }
        let io = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, "permission denied");
        let err = anyhow::Error::new(Prepare { source: io() }).context("train_embodied");
        assert_eq!(
            error_report(&err),
            "train_embodied\n  caused by: cannot prepare /run\n  caused by: permission denied"
        );
        assert_eq!(
            error_report(&anyhow::Error::new(io())),
            "permission denied",
            "an error without causes is one line"
        );
    }

    #[test]
    fn error_text_keeps_a_caret_under_its_character() {
        let err = anyhow::anyhow!("LexerNoViableAltException: #x=1\n{:>28}\nSee the docs", "^");
        let text = error_text(&err);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Error: LexerNoViableAltException: #x=1");
        assert_eq!(lines[1].find('^'), lines[0].find('#'), "{text}");
        assert_eq!(lines[2], "See the docs");
        // Other second lines are not moved.
        assert_eq!(
            error_text(&anyhow::anyhow!("first\n  indented")),
            "Error: first\n  indented"
        );
    }

    fn parse(args: &[&str]) -> Result<HydraArgs, UsageError> {
        parse_hydra_args(
            Entry::Embodied,
            &args.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn flags_and_overrides_are_told_apart() {
        let a = parse(&[
            "-cp",
            "/x",
            "--config-name=foo",
            "db=mysql",
            "+a.b=1",
            "~c",
            "--cfg",
            "job",
            "--resolve",
        ])
        .ok();
        let a = a.as_ref();
        assert_eq!(a.and_then(|a| a.config_path.as_deref()), Some("/x"));
        assert_eq!(a.and_then(|a| a.config_name.as_deref()), Some("foo"));
        assert_eq!(a.and_then(|a| a.cfg), Some(CfgKind::Job));
        assert_eq!(a.map(|a| a.resolve), Some(true));
        assert_eq!(
            a.map(|a| a.overrides.clone()),
            Some(vec![
                "db=mysql".to_owned(),
                "+a.b=1".to_owned(),
                "~c".to_owned()
            ])
        );
    }

    #[test]
    fn info_takes_an_optional_choice() {
        assert_eq!(
            parse(&["--info", "defaults"]).ok().and_then(|a| a.info),
            Some(InfoKind::Defaults)
        );
        assert_eq!(
            parse(&["-i"]).ok().and_then(|a| a.info),
            Some(InfoKind::All)
        );
        assert_eq!(
            parse(&["--info", "--cfg", "job"]).ok().and_then(|a| a.info),
            Some(InfoKind::All)
        );
        assert!(matches!(
            parse(&["--info", "nope"]),
            Err(UsageError::InvalidChoice { .. })
        ));
    }

    #[test]
    fn help_lists_every_entry_point_plot_included() {
        let help = usage_text();
        let section = help
            .split("Entry points:\n")
            .nth(1)
            .and_then(|rest| rest.split("\n\n").next())
            .unwrap_or_default();
        let names: Vec<&str> = section
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert_eq!(
            names,
            ["train_embodied", "train_async", "bench_sync", "plot"],
            "{help}"
        );
        assert!(help.starts_with("usage: rlsync {train_embodied,train_async,bench_sync,plot}"));
    }

    #[test]
    fn completion_offers_every_entry_point_of_the_usage_line_and_plots_own_words() {
        let listed = USAGE
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'))
            .map(|(names, _)| names)
            .unwrap();
        let mut listed: Vec<&str> = listed.split(',').collect();
        listed.sort();
        assert_eq!(completion_candidates("rlsync "), listed);
        assert_eq!(completion_candidates("rlsync p"), ["plot"]);
        assert_eq!(completion_candidates("rlsync plot --o"), ["--output"]);
    }

    #[test]
    fn bad_flags_are_usage_errors() {
        assert!(matches!(
            parse(&["--frobnicate"]),
            Err(UsageError::UnknownFlag(_))
        ));
        assert!(matches!(parse(&["-x"]), Err(UsageError::UnknownFlag(_))));
        assert!(matches!(
            parse(&["--cfg"]),
            Err(UsageError::MissingValue { .. })
        ));
        assert!(matches!(
            parse(&["--cfg", "nope"]),
            Err(UsageError::InvalidChoice { .. })
        ));
    }
}
