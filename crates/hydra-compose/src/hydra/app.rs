//! The Hydra application front end after argv parsing: build the search path, then show the config
//! (`--cfg`), print information (`--info`, `--help`, `--hydra-help`), or prepare the job(s) of a run or
//! multirun (run directory and `.hydra/` files). Running a prepared job is the caller's business.

use std::path::{Path, PathBuf};

use crate::compose::{self, ComposeError, ComposeRequest, Composed, RunMode};
use crate::emit::to_yaml;
use crate::hydra::{self as hy, format_defaults_table, format_defaults_tree, format_search_path};
use crate::interpolate::{self, InterpolationError, ResolveContext};
use crate::node::{Key, Node, Value};
use crate::scalar::Scalar;
use crate::search_path::{
    EmbeddedTree, ObjectType, PythonEnv, Repository, SearchPathError, Source,
};

/// `--info` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InfoKind {
    All,
    Config,
    Defaults,
    DefaultsTree,
    Plugins,
    SearchPath,
}

impl InfoKind {
    pub fn parse(text: &str) -> Option<InfoKind> {
        Some(match text {
            "all" => InfoKind::All,
            "config" => InfoKind::Config,
            "defaults" => InfoKind::Defaults,
            "defaults-tree" => InfoKind::DefaultsTree,
            "plugins" => InfoKind::Plugins,
            "searchpath" => InfoKind::SearchPath,
            _ => return None,
        })
    }
}

/// Which part of the config `--cfg` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShowCfg {
    Job,
    Hydra,
    All,
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    AppHelp {
        flags_help: &'static str,
    },
    HydraHelp {
        flags_help: &'static str,
    },
    ShowCfg {
        show: ShowCfg,
        package: Option<String>,
        resolve: bool,
    },
    Info(InfoKind),
    Run {
        dry_run: bool,
    },
    Multirun {
        dry_run: bool,
    },
}

/// One invocation of an entry point.
#[derive(Debug, Clone)]
pub struct AppRequest<'a> {
    /// The program's own config tree: the primary source when there is no `--config-path`.
    pub primary: &'a EmbeddedTree,
    /// Entry point name (`train_embodied`): the default job name.
    pub entry: &'a str,
    pub config_path: Option<&'a str>,
    pub config_name: &'a str,
    pub config_dir: Option<&'a str>,
    pub overrides: &'a [String],
    pub command: Command,
}

/// A composed job ready to run.
#[derive(Debug, Clone)]
pub struct PreparedJob {
    /// The job config (no `hydra` node), interpolations resolved.
    pub config: Node,
    /// The full composed config, unresolved (with its `hydra` node).
    pub full: Node,
    /// The job's output directory (created unless `dry_run`).
    pub output_dir: PathBuf,
    pub dry_run: bool,
}

/// What `execute` did.
#[derive(Debug)]
pub enum Outcome<'a> {
    /// Output was printed; exit with this success flag.
    Printed { success: bool },
    /// Jobs to run, one after another (composed as they are taken).
    Jobs(Box<Jobs<'a>>),
}

/// The jobs of a run (one) or a multirun (the sweep's product, composed lazily: each job is composed, its
/// directory prepared and its line printed only when the caller takes it).
#[derive(Debug)]
pub struct Jobs<'a> {
    kind: JobsKind<'a>,
}

#[derive(Debug)]
enum JobsKind<'a> {
    One(Option<PreparedJob>),
    Sweep {
        req: AppRequest<'a>,
        sweep_dir: PathBuf,
        dry_run: bool,
        product: compose::SweepProduct,
        num: u64,
    },
}

impl Jobs<'_> {
    /// How many jobs there are in all.
    pub fn total(&self) -> u128 {
        match &self.kind {
            JobsKind::One(_) => 1,
            JobsKind::Sweep { product, .. } => product.total(),
        }
    }
}

impl Iterator for Jobs<'_> {
    type Item = Result<PreparedJob, AppError>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.kind {
            JobsKind::One(job) => job.take().map(Ok),
            JobsKind::Sweep {
                req,
                sweep_dir,
                dry_run,
                product,
                num,
            } => {
                let overrides = product.next()?;
                let job = prepare_sweep_job(req, sweep_dir, *dry_run, &overrides, *num);
                *num += 1;
                Some(job)
            }
        }
    }
}

/// Errors of the application front end.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Compose(#[from] ComposeError),
    #[error(transparent)]
    SearchPath(#[from] SearchPathError),
    #[error("package '{package}' not found in config")]
    PackageNotFound { package: String },
    #[error(transparent)]
    Interpolation(#[from] InterpolationError),
    #[error("cannot write '{path}'")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The config asks Hydra to run Python code around the job (a callback, a launcher or sweeper plugin),
    /// which the program cannot do; `--cfg` and `--info` of such a config still work.
    #[error("needs Python: {what}")]
    NeedsPython { what: String },
}

/// Hydra's own launcher and sweeper, the only ones the program runs jobs as.
const BASIC_PLUGINS: [(&str, &str); 2] = [
    (
        "launcher",
        "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    ),
    (
        "sweeper",
        "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
    ),
];

/// What of a composed config Hydra would run as Python code around a job: `hydra.callbacks` entries, and a
/// launcher or sweeper `_target_` other than Hydra's basic ones.
fn needs_python(full: &Node, program: &str) -> Result<(), AppError> {
    let target = |node: &Node| {
        node.get("_target_")
            .and_then(Node::as_str)
            .unwrap_or("no _target_")
            .to_owned()
    };
    if let Some((name, callback)) = full
        .get_path("hydra.callbacks")
        .and_then(Node::as_dict)
        .and_then(|d| d.iter().next())
    {
        return Err(AppError::NeedsPython {
            what: format!(
                "hydra.callbacks.{name} ({}) is Python code Hydra calls around the job; {program} does not run it",
                target(callback)
            ),
        });
    }
    for (group, basic) in BASIC_PLUGINS {
        if let Some(node) = full.get_path(&format!("hydra.{group}"))
            && node.get("_target_").and_then(Node::as_str) != Some(basic)
        {
            return Err(AppError::NeedsPython {
                what: format!(
                    "hydra.{group} is {}, a Hydra plugin; {program} runs jobs only as Hydra's basic {group} does",
                    target(node)
                ),
            });
        }
    }
    Ok(())
}

/// Build the search path for `--config-path` / `--config-dir` (relative paths are taken from the working directory).
pub fn build_repository(
    primary: &EmbeddedTree,
    config_path: Option<&str>,
    config_dir: Option<&str>,
) -> Result<Repository, SearchPathError> {
    let mut sources = vec![Source::hydra_builtin()];
    match config_path {
        Some(path) if path.starts_with("pkg://") => {
            let module = &path["pkg://".len()..];
            let (source, lookup) = Source::package("main", module, &PythonEnv::from_process());
            if source.path.is_empty() {
                return Err(SearchPathError::PrimaryModuleEmpty);
            }
            if lookup.found.is_none() {
                return Err(SearchPathError::PrimaryModuleNotFound {
                    module: source.path,
                    searched: lookup
                        .searched
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect(),
                });
            }
            sources.push(source);
        }
        Some(path) => {
            let dir = absolute(path.strip_prefix("file://").unwrap_or(path));
            let source = Source::dir("main", dir.clone());
            if !source.available() {
                return Err(SearchPathError::PrimaryDirNotFound {
                    path: dir.display().to_string(),
                });
            }
            sources.push(source);
        }
        None => sources.push(Source::embedded_main(primary)),
    }
    if let Some(dir) = config_dir {
        let dir = absolute(dir);
        if !dir.is_dir() {
            return Err(SearchPathError::ConfigDirNotFound {
                path: dir.display().to_string(),
            });
        }
        sources.push(Source::dir("command-line", dir));
    }
    sources.push(Source::structured());
    Ok(Repository::new(primary.program, sources))
}

fn absolute(path: &str) -> PathBuf {
    std::path::absolute(Path::new(path)).unwrap_or_else(|_| PathBuf::from(path))
}

/// Run the command; prints to stdout what Hydra prints there.
pub fn execute<'a>(req: &AppRequest<'a>) -> Result<Outcome<'a>, AppError> {
    let mut repo = build_repository(req.primary, req.config_path, req.config_dir)?;
    match &req.command {
        Command::ShowCfg {
            show,
            package,
            resolve,
        } => show_cfg(&mut repo, req, *show, package.as_deref(), *resolve),
        Command::Info(kind) => {
            crate::stdio::out(format_args!("{}", info(&mut repo, req, *kind)?));
            Ok(Outcome::Printed { success: true })
        }
        Command::AppHelp { flags_help } => {
            let composed = compose_run(&mut repo, req, RunMode::Run)?;
            crate::stdio::out(format_args!(
                "{}\n",
                app_help(&repo, &composed.config, flags_help)
            ));
            Ok(Outcome::Printed { success: true })
        }
        Command::HydraHelp { flags_help } => {
            let composed = compose_run(&mut repo, req, RunMode::Run)?;
            crate::stdio::out(format_args!(
                "{}\n",
                hydra_help(&repo, &composed.config, flags_help)
            ));
            Ok(Outcome::Printed { success: true })
        }
        Command::Run { dry_run } => {
            let job = prepare_run(&mut repo, req, *dry_run)?;
            Ok(Outcome::Jobs(Box::new(Jobs {
                kind: JobsKind::One(Some(job)),
            })))
        }
        Command::Multirun { dry_run } => Ok(Outcome::Jobs(Box::new(prepare_multirun(
            &mut repo, req, *dry_run,
        )?))),
    }
}

fn compose_run(
    repo: &mut Repository,
    req: &AppRequest<'_>,
    mode: RunMode,
) -> Result<Composed, ComposeError> {
    compose::compose(
        repo,
        &ComposeRequest {
            config_name: req.config_name,
            overrides: req.overrides,
            mode,
            job_name: req.entry,
        },
    )
}

fn remove_key(node: &mut Node, key: &str) -> Option<Node> {
    node.as_dict_mut()
        .and_then(|d| d.shift_remove(&Key::from(key)))
}

/// The job part of a composed config (everything but `hydra`).
pub(crate) fn job_config(full: &Node) -> Node {
    let mut job = full.clone();
    remove_key(&mut job, "hydra");
    job
}

/// `{hydra: ...}` without the help templates, as `--cfg hydra` shows it.
fn sanitized_hydra(full: &Node) -> Node {
    let mut out = Node::empty_dict();
    if let (Some(hydra), Some(dict)) = (full.get("hydra"), out.as_dict_mut()) {
        let mut hydra = hydra.clone();
        remove_key(&mut hydra, "hydra_help");
        remove_key(&mut hydra, "help");
        dict.insert(Key::from("hydra"), hydra);
    }
    out
}

fn show_cfg(
    repo: &mut Repository,
    req: &AppRequest<'_>,
    show: ShowCfg,
    package: Option<&str>,
    resolve: bool,
) -> Result<Outcome<'static>, AppError> {
    let composed = compose_run(repo, req, RunMode::Run)?;
    let cfg = match show {
        ShowCfg::Job => job_config(&composed.config),
        ShowCfg::Hydra => sanitized_hydra(&composed.config),
        ShowCfg::All => composed.config.clone(),
    };
    let ctx = match show {
        ShowCfg::Hydra => context(&composed.config, repo.program()),
        ShowCfg::Job | ShowCfg::All => show_context(&composed.config, repo.program()),
    };
    let resolved = |cfg: &Node| -> Result<Node, AppError> {
        if resolve {
            resolve_tree(cfg, &ctx)
        } else {
            Ok(cfg.clone())
        }
    };
    let package = package.filter(|p| *p != "_global_");
    let Some(package) = package else {
        crate::stdio::out(format_args!("{}", to_yaml(&resolved(&cfg)?)));
        return Ok(Outcome::Printed { success: true });
    };
    let not_found = || AppError::PackageNotFound {
        package: package.into(),
    };
    // Hydra selects first (`OmegaConf.select`, which resolves a leaf) and resolves only a container.
    let selected = cfg
        .get_path(package)
        .filter(|n| !matches!(n.value, Value::NULL | Value::Missing))
        .ok_or_else(not_found)?;
    if selected.value.is_container() {
        let full = resolved(&cfg)?;
        let selected = full.get_path(package).ok_or_else(not_found)?;
        crate::stdio::out(format_args!("# @package {package}\n"));
        crate::stdio::out(format_args!("{}", to_yaml(selected)));
        return Ok(Outcome::Printed { success: true });
    }
    let value = interpolate::resolve_at(&cfg, package, &ctx)?;
    if matches!(value.value, Value::NULL) {
        return Err(not_found());
    }
    // `print(value)`: Hydra's `hydra.mode` is a `RunMode` enum, whose str() names its class.
    let is_run_mode = package
        .strip_prefix("hydra.")
        .map(|rest| rest.split('.').map(str::to_owned).collect::<Vec<_>>())
        .and_then(|path| hy::conf::type_at(&path, composed.config.get("hydra")))
        .is_some_and(|(ty, _)| matches!(ty, hy::conf::Ty::Mode));
    match &value.value {
        Value::Scalar(Scalar::Str(name)) if is_run_mode => {
            crate::stdio::out(format_args!("RunMode.{name}\n"))
        }
        other => crate::stdio::out(format_args!("{}\n", other.python_str())),
    }
    Ok(Outcome::Printed { success: true })
}

/// One clock reading per process, as Hydra caches `${now:...}` for the whole run (and its sweep); errors
/// name `program`.
fn clock(program: &'static str) -> ResolveContext<'static> {
    static NOW: std::sync::OnceLock<chrono::NaiveDateTime> = std::sync::OnceLock::new();
    ResolveContext::new()
        .with_now(*NOW.get_or_init(|| chrono::Local::now().naive_local()))
        .with_program(program)
}

/// The resolution context of a running job: its `hydra` node serves `${hydra:...}`, and absolute keys
/// inside that node resolve in the full config.
fn context<'a>(full: &'a Node, program: &'static str) -> ResolveContext<'a> {
    clock(program).with_full_config(full)
}

/// The resolution context of `--cfg job|all`: Hydra deletes `hydra` from the config it prints but keeps
/// it as the `HydraConfig` node, whose parent is the printed config.
fn show_context<'a>(full: &'a Node, program: &'static str) -> ResolveContext<'a> {
    match full.get("hydra") {
        Some(hydra) => clock(program).with_hydra(hydra),
        None => clock(program),
    }
}

/// Resolve every interpolation of `cfg` (OmegaConf.resolve).
fn resolve_tree(cfg: &Node, ctx: &ResolveContext<'_>) -> Result<Node, AppError> {
    Ok(interpolate::resolve_tree(cfg, ctx)?)
}

fn info(repo: &mut Repository, req: &AppRequest<'_>, kind: InfoKind) -> Result<String, AppError> {
    Ok(match kind {
        InfoKind::Defaults => format_defaults_table(&compose::compute_defaults(
            repo,
            req.config_name,
            req.overrides,
        )?),
        InfoKind::DefaultsTree => format_defaults_tree(
            &compose::compute_defaults(repo, req.config_name, req.overrides)?.tree,
        ),
        InfoKind::SearchPath => {
            compose_run(repo, req, RunMode::Run)?;
            format_search_path(repo.sources())
        }
        InfoKind::Plugins => plugins_info(),
        InfoKind::Config => config_info(repo, req)?,
        InfoKind::All => {
            let title = format!("Hydra {}", hy::HYDRA_VERSION);
            format!(
                "{title}\n{}\n{}{}",
                "=".repeat(title.len()),
                plugins_info(),
                config_info(repo, req)?
            )
        }
    })
}

fn plugins_info() -> String {
    let mut out = String::from("Installed Hydra Plugins\n***********************\n");
    let kinds: [(&str, &[&str]); 4] = [
        (
            "ConfigSource:",
            &[
                "FileConfigSource",
                "ImportlibResourcesConfigSource",
                "StructuredConfigSource",
            ],
        ),
        (
            "CompletionPlugin:",
            &["BashCompletion", "FishCompletion", "ZshCompletion"],
        ),
        ("Launcher:", &["BasicLauncher"]),
        ("Sweeper:", &["BasicSweeper"]),
    ];
    for (kind, plugins) in kinds {
        out.push_str(&format!("\t{kind}\n\t{}\n", "-".repeat(kind.len())));
        for plugin in plugins {
            out.push_str(&format!("\t\t{plugin}\n"));
        }
    }
    out
}

fn config_info(repo: &mut Repository, req: &AppRequest<'_>) -> Result<String, AppError> {
    let composed = compose_run(repo, req, RunMode::Run)?;
    let mut out = format_search_path(repo.sources());
    let defaults = compose::compute_defaults(repo, req.config_name, req.overrides)?;
    out.push_str(&format_defaults_tree(&defaults.tree));
    out.push_str(&format_defaults_table(&defaults));
    out.push_str("Config\n******\n");
    out.push_str(&to_yaml(&job_config(&composed.config)));
    out.push('\n');
    Ok(out)
}

/// All config groups (recursively), as Hydra's help lists them.
fn all_groups(repo: &Repository, parent: &str, out: &mut Vec<String>) {
    for group in repo.group_options(parent, ObjectType::Group) {
        let name = if parent.is_empty() {
            group
        } else {
            format!("{parent}/{group}")
        };
        if !repo.group_options(&name, ObjectType::Config).is_empty() {
            out.push(name.clone());
        }
        if !repo.group_options(&name, ObjectType::Group).is_empty() {
            all_groups(repo, &name, out);
        }
    }
}

fn format_groups(repo: &Repository, hydra_groups: bool) -> String {
    let mut groups = Vec::new();
    all_groups(repo, "", &mut groups);
    groups.retain(|g| (g == "hydra" || g.starts_with("hydra/")) == hydra_groups);
    groups.sort();
    groups
        .iter()
        .map(|g| {
            format!(
                "{g}: {}\n",
                repo.group_options(g, ObjectType::Config).join(", ")
            )
        })
        .collect()
}

/// A help template, resolved as Hydra reads it (`cfg.hydra.help.template`); unresolvable ones stay raw.
fn template(repo: &Repository, full: &Node, key: &str) -> String {
    match interpolate::resolve_at(full, key, &context(full, repo.program())) {
        Ok(node) => node.value.python_str(),
        Err(_) => full
            .get_path(key)
            .map(|n| n.value.python_str())
            .unwrap_or_default(),
    }
}

fn fill_template(template: &str, flags_help: &str, repo: &Repository, config: &str) -> String {
    template
        .replace("$FLAGS_HELP", flags_help)
        .replace("$APP_CONFIG_GROUPS", &format_groups(repo, false))
        .replace("$HYDRA_CONFIG_GROUPS", &format_groups(repo, true))
        .replace("$CONFIG", config)
}

fn app_help(repo: &Repository, full: &Node, flags_help: &str) -> String {
    fill_template(
        &template(repo, full, "hydra.help.template"),
        flags_help,
        repo,
        &to_yaml(&job_config(full)),
    )
}

fn hydra_help(repo: &Repository, full: &Node, flags_help: &str) -> String {
    fill_template(
        &template(repo, full, "hydra.hydra_help.template"),
        flags_help,
        repo,
        &to_yaml(&sanitized_hydra(full)),
    )
}

fn set_hydra(full: &mut Node, path: &[&str], value: Value) {
    let mut cur = full;
    for part in ["hydra"]
        .iter()
        .chain(path[..path.len().saturating_sub(1)].iter())
    {
        let Some(dict) = cur.as_dict_mut() else {
            return;
        };
        cur = dict
            .entry(Key::from(*part))
            .or_insert_with(Node::empty_dict);
    }
    if let (Some(dict), Some(last)) = (cur.as_dict_mut(), path.last()) {
        dict.insert(Key::from(*last), Node::new(value));
    }
}

/// Resolve a `hydra.*` directory setting (`outputs/${now:...}`) against the full config.
fn resolve_dir(full: &Node, key: &str, program: &'static str) -> Result<PathBuf, AppError> {
    let node = interpolate::resolve_at(full, key, &context(full, program))?;
    Ok(PathBuf::from(node.value.python_str()))
}

/// Write `.hydra/{config,hydra,overrides}.yaml` under `output_dir` unless `hydra.output_subdir` is null.
fn write_hydra_files(full: &Node, output_dir: &Path) -> Result<(), AppError> {
    let subdir = match full.get_path("hydra.output_subdir") {
        None
        | Some(Node {
            value: Value::NULL, ..
        }) => return Ok(()),
        Some(node) => node.value.python_str(),
    };
    let dir = output_dir.join(subdir);
    let io = |path: &Path, source: std::io::Error| AppError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(&dir).map_err(|e| io(&dir, e))?;
    let overrides = full
        .get_path("hydra.overrides.task")
        .cloned()
        .unwrap_or_else(|| Node::new(Value::List(Vec::new())));
    for (name, node) in [
        ("config.yaml", job_config(full)),
        ("hydra.yaml", sanitized_hydra_full(full)),
        ("overrides.yaml", overrides),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, to_yaml(&node)).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

fn sanitized_hydra_full(full: &Node) -> Node {
    let mut out = Node::empty_dict();
    if let (Some(hydra), Some(dict)) = (full.get("hydra"), out.as_dict_mut()) {
        dict.insert(Key::from("hydra"), hydra.clone());
    }
    out
}

fn finish_job(
    mut full: Node,
    output_dir: PathBuf,
    dry_run: bool,
    program: &'static str,
) -> Result<PreparedJob, AppError> {
    let abs = std::path::absolute(&output_dir).unwrap_or(output_dir);
    set_hydra(
        &mut full,
        &["runtime", "output_dir"],
        Value::str(abs.display().to_string()),
    );
    if !dry_run {
        std::fs::create_dir_all(&abs).map_err(|source| AppError::Io {
            path: abs.display().to_string(),
            source,
        })?;
        write_hydra_files(&full, &abs)?;
    }
    let config = resolve_tree(&job_config(&full), &context(&full, program))?;
    Ok(PreparedJob {
        config,
        full,
        output_dir: abs,
        dry_run,
    })
}

fn prepare_run(
    repo: &mut Repository,
    req: &AppRequest<'_>,
    dry_run: bool,
) -> Result<PreparedJob, AppError> {
    let mut composed = compose_run(repo, req, RunMode::Run)?;
    let program = req.primary.program;
    needs_python(&composed.config, program)?;
    mark_mode(&mut composed.config, "RUN");
    let output_dir = resolve_dir(&composed.config, "hydra.run.dir", program)?;
    finish_job(composed.config, output_dir, dry_run, program)
}

/// `hydra.mode=RUN|MULTIRUN`, added as Hydra's `_run_app` does when the config does not set it.
fn mark_mode(full: &mut Node, mode: &str) {
    if full
        .get_path("hydra.mode")
        .is_some_and(|n| !matches!(n.value, Value::NULL))
    {
        return;
    }
    set_hydra(full, &["mode"], Value::str(mode));
    if let Some(Value::List(list)) = full
        .get_path("hydra.overrides.hydra")
        .map(|n| n.value.clone())
    {
        let mut list = list;
        list.push(Node::str(format!("hydra.mode={mode}")));
        set_hydra(full, &["overrides", "hydra"], Value::List(list));
    }
}

fn prepare_multirun<'a>(
    repo: &mut Repository,
    req: &AppRequest<'a>,
    dry_run: bool,
) -> Result<Jobs<'a>, AppError> {
    let mut master = compose_run(repo, req, RunMode::Multirun)?;
    needs_python(&master.config, req.primary.program)?;
    mark_mode(&mut master.config, "MULTIRUN");
    let sweep_dir = resolve_dir(&master.config, "hydra.sweep.dir", req.primary.program)?;
    if !dry_run {
        std::fs::create_dir_all(&sweep_dir).map_err(|source| AppError::Io {
            path: sweep_dir.display().to_string(),
            source,
        })?;
        let path = sweep_dir.join("multirun.yaml");
        std::fs::write(&path, to_yaml(&master.config)).map_err(|source| AppError::Io {
            path: path.display().to_string(),
            source,
        })?;
    }
    let product = compose::sweep_combinations(repo, req.overrides)?;
    crate::stdio::out(format_args!(
        "[HYDRA] Launching {} jobs locally\n",
        product.total()
    ));
    if !dry_run {
        // This engine's addition to Hydra's launcher lines: where the jobs' dirs go.
        let shown = std::path::absolute(&sweep_dir).unwrap_or_else(|_| sweep_dir.clone());
        crate::stdio::out(format_args!(
            "[HYDRA] Sweep output dir : {}\n",
            shown.display()
        ));
    }
    Ok(Jobs {
        kind: JobsKind::Sweep {
            req: req.clone(),
            sweep_dir,
            dry_run,
            product,
            num: 0,
        },
    })
}

/// Compose job `num` of a sweep with its overrides, announcing it as Hydra's launcher does.
fn prepare_sweep_job(
    req: &AppRequest<'_>,
    sweep_dir: &Path,
    dry_run: bool,
    overrides: &[String],
    num: u64,
) -> Result<PreparedJob, AppError> {
    // As Hydra's launcher lists a job: its overrides without the `hydra.*` ones (`filter_overrides`).
    let shown: Vec<&str> = overrides
        .iter()
        .map(String::as_str)
        .filter(|o| !o.trim_start_matches(['+', '~']).starts_with("hydra."))
        .collect();
    crate::stdio::out(format_args!("[HYDRA] \t#{num} : {}\n", shown.join(" ")));
    let mut repo_job = build_repository(req.primary, req.config_path, req.config_dir)?;
    let job_req = AppRequest {
        overrides,
        ..req.clone()
    };
    let mut composed = compose_run(&mut repo_job, &job_req, RunMode::Run)?;
    mark_mode(&mut composed.config, "MULTIRUN");
    let num = i64::try_from(num).unwrap_or(i64::MAX);
    set_hydra(&mut composed.config, &["job", "id"], Value::int(num));
    set_hydra(&mut composed.config, &["job", "num"], Value::int(num));
    let program = req.primary.program;
    let subdir = resolve_dir(&composed.config, "hydra.sweep.subdir", program)?;
    finish_job(composed.config, sweep_dir.join(subdir), dry_run, program)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::yaml::load_str;

    fn check(hydra: &str) -> Result<(), String> {
        let full = load_str(&format!("a: 1\nhydra:\n{hydra}"), "test.yaml")
            .unwrap_or_else(|e| panic!("bad test YAML: {e}"));
        needs_python(&full, "myapp").map_err(|e| e.to_string())
    }

    /// Hydra's basic launcher and sweeper (what the built-in `hydra/config` composes) need no Python;
    /// callbacks and other plugins do, and say which entry.
    #[test]
    fn python_callbacks_and_plugins_are_named() {
        let basic = "  launcher:\n    _target_: hydra._internal.core_plugins.basic_launcher.BasicLauncher\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n";
        assert_eq!(check(basic), Ok(()));
        assert_eq!(check("  callbacks: {}\n"), Ok(()));
        assert_eq!(
            check("  callbacks:\n    log:\n      _target_: my.Callback\n"),
            Err("needs Python: hydra.callbacks.log (my.Callback) is Python code Hydra calls around the job; myapp does not run it".to_owned())
        );
        assert_eq!(
            check("  launcher:\n    _target_: hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher\n"),
            Err("needs Python: hydra.launcher is hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher, a Hydra plugin; myapp runs jobs only as Hydra's basic launcher does".to_owned())
        );
    }
}
