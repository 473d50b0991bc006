//! End-to-end tests of the Hydra front end: `--cfg`, `--info`, errors, run and multirun directories.

use hydra_compose::node::{Node, Value};
use hydra_compose::yaml::load_str;

use crate::util::Dir;

/// A node tree with origins removed, so trees loaded from different texts compare by value.
fn plain(node: Node) -> Node {
    let value = match node.value {
        Value::List(items) => Value::List(items.into_iter().map(plain).collect()),
        Value::Dict(d) => Value::Dict(d.into_iter().map(|(k, v)| (k, plain(v))).collect()),
        other => other,
    };
    Node::new(value)
}

#[track_caller]
fn assert_yaml_eq(got: &str, want: &str) {
    let got_node = load_str(got, "stdout").map(plain);
    let want_node = load_str(want, "expected").map(plain);
    assert!(
        got_node.is_ok() && want_node.is_ok(),
        "unparsable YAML:\n{got}"
    );
    assert_eq!(got_node.ok(), want_node.ok(), "stdout was:\n{got}");
}

/// A small app: a primary config with a group default, a nested group and a `# @package` header.
fn app() -> Dir {
    let dir = Dir::new();
    dir.create("config.yaml", "defaults:\n  - db: mysql\n  - server: small\n  - _self_\napp:\n  name: demo\n  port: 8080\n")
        .create("db/mysql.yaml", "driver: mysql\nport: 3306\n")
        .create("db/postgresql.yaml", "driver: postgresql\nport: 5432\n")
        .create("server/small.yaml", "# @package server.size\nworkers: 2\n")
        .create("server/large.yaml", "# @package server.size\nworkers: 16\n");
    dir
}

#[test]
fn cfg_job_composes_defaults_in_order() {
    let dir = app();
    let out = dir.compose("config", &["--cfg", "job"]);
    assert_yaml_eq(
        out.ok(),
        "db: {driver: mysql, port: 3306}\nserver: {size: {workers: 2}}\napp: {name: demo, port: 8080}\n",
    );
}

#[test]
fn group_and_value_overrides_apply() {
    let dir = app();
    let out = dir.compose(
        "config",
        &[
            "db=postgresql",
            "server=large",
            "app.port=9000",
            "+app.debug=true",
            "~db.port",
            "--cfg",
            "job",
        ],
    );
    assert_yaml_eq(
        out.ok(),
        "db: {driver: postgresql}\nserver: {size: {workers: 16}}\napp: {name: demo, port: 9000, debug: true}\n",
    );
}

#[test]
fn group_at_package_and_append() {
    let dir = app();
    let out = dir.compose("config", &["+db@backup=postgresql", "--cfg", "job"]);
    assert_yaml_eq(
        out.ok(),
        "db: {driver: mysql, port: 3306}\nserver: {size: {workers: 2}}\napp: {name: demo, port: 8080}\nbackup: {driver: postgresql, port: 5432}\n",
    );
}

#[test]
fn info_defaults_prints_hydras_table() {
    let dir = app();
    let out = dir.compose("config", &["--info", "defaults"]);
    let want = "
Defaults List
*************
| Config path                 | Package             | _self_ | Parent       | 
------------------------------------------------------------------------------
| hydra/output/default        | hydra               | False  | hydra/config |
| hydra/launcher/basic        | hydra.launcher      | False  | hydra/config |
| hydra/sweeper/basic         | hydra.sweeper       | False  | hydra/config |
| hydra/help/default          | hydra.help          | False  | hydra/config |
| hydra/hydra_help/default    | hydra.hydra_help    | False  | hydra/config |
| hydra/hydra_logging/default | hydra.hydra_logging | False  | hydra/config |
| hydra/job_logging/default   | hydra.job_logging   | False  | hydra/config |
| hydra/env/default           | hydra.env           | False  | hydra/config |
| hydra/config                | hydra               | True   | <root>       |
| db/mysql                    | db                  | False  | config       |
| server/small                | server.size         | False  | config       |
| config                      |                     | True   | <root>       |
------------------------------------------------------------------------------
";
    assert_eq!(out.ok(), want);
}

#[test]
fn info_defaults_ignores_value_overrides() {
    let dir = app();
    assert!(
        dir.compose("config", &["nosuch.key=1", "--info", "defaults"])
            .success()
    );
    assert!(
        dir.compose("config", &["nosuch.key=1", "--cfg", "job"])
            .err()
            .contains("Could not override 'nosuch.key'.")
    );
}

#[test]
fn errors_use_hydras_wording() {
    let dir = app();
    // (overrides, a fragment of the expected message)
    let cases: &[(&[&str], &str)] = &[
        (
            &["db=nosuch"],
            "In 'config': Could not find 'db/nosuch'\n\nAvailable options in 'db':\n\tmysql\n\tpostgresql",
        ),
        (
            &["nosuch=1"],
            "Could not override 'nosuch'.\nTo append to your config use +nosuch=1",
        ),
        (
            &["+app.name=x"],
            "Could not append to config. An item is already at 'app.name'.",
        ),
        (
            &["~app.name=other"],
            "Could not delete from config. The value of 'app.name' is demo and not other.",
        ),
        (
            &["~nosuch"],
            "Could not delete from config. 'nosuch' does not exist.",
        ),
        (
            &["~db=postgresql"],
            "Could not delete 'db=postgresql'. No match in the defaults list",
        ),
        (
            &["++db=mysql"],
            "force-add of config groups is not supported: '++db=mysql'",
        ),
        (
            &["@x=[1,'b',2.5]"],
            "No match in the defaults list.\nTo append to your default list use +@x=[1, 'b', 2.5]",
        ),
        (
            &["app.port=1,2"],
            "Ambiguous value for argument 'app.port=1,2'",
        ),
        (
            &["db=mysql,postgresql"],
            "Ambiguous value for argument 'db=mysql,postgresql'",
        ),
    ];
    for (overrides, want) in cases {
        let mut args: Vec<&str> = overrides.to_vec();
        args.extend(["--cfg", "job"]);
        let out = dir.compose("config", &args);
        assert!(
            out.err().contains(want),
            "{overrides:?}: stderr was:\n{}",
            out.stderr
        );
    }
    assert!(
        dir.compose("nosuch", &["--cfg", "job"])
            .err()
            .contains("Cannot find primary config 'nosuch'")
    );
}

/// Configs only Python code could provide (a `ConfigStore` schema, a Hydra plugin's option) fail with Hydra's text
/// and then a "needs Python" line; a plain typo in a group with YAML options gets Hydra's text alone.
#[test]
fn configs_only_python_provides_say_needs_python() {
    let dir = Dir::new();
    dir.create(
        "config.yaml",
        "defaults:\n  - base_schema\n  - _self_\nx: 1\n",
    )
    .create(
        "plugin.yaml",
        "defaults:\n  - override hydra/launcher: joblib\n  - _self_\n",
    )
    .create("typo.yaml", "defaults:\n  - db: mysqll\n  - _self_\n")
    .create(
        "empty_group.yaml",
        "defaults:\n  - schema: s1\n  - _self_\n",
    )
    .create("db/mysql.yaml", "a: 1\n");
    let cases: &[(&str, &str, Option<&str>)] = &[
        (
            "config",
            "In 'config': Could not load 'base_schema'.\n",
            Some("needs Python: if your app registers 'base_schema' with ConfigStore"),
        ),
        (
            "plugin",
            "Could not find 'hydra/launcher/joblib'\n\nAvailable options in 'hydra/launcher':\n\tbasic",
            Some("needs Python: 'hydra/launcher/joblib' would come from a Hydra plugin"),
        ),
        (
            "empty_group",
            "In 'empty_group': Could not find 'schema/s1'\n",
            Some("(`cs.store(group=\"schema\", name=...)`)"),
        ),
        (
            "nosuch",
            "Cannot find primary config 'nosuch'.",
            Some("needs Python: if your app registers 'nosuch' with ConfigStore"),
        ),
        (
            "typo",
            "In 'typo': Could not find 'db/mysqll'\n\nAvailable options in 'db':\n\tmysql",
            None,
        ),
    ];
    for (name, hydra, hint) in cases {
        let err = dir.compose(name, &["--cfg", "job"]).err().to_owned();
        assert!(err.contains(hydra), "{name}: {err}");
        // Hydra's text (its search path included) comes first, the hint last.
        let last = err.trim_end().lines().last().unwrap_or_default().to_owned();
        match hint {
            Some(h) => assert!(last.contains(h), "{name}: last line {last:?} of:\n{err}"),
            None => assert!(!err.contains("needs Python"), "{name}: {err}"),
        }
    }
}

#[test]
fn missing_group_choice_lists_options() {
    let dir = Dir::new();
    dir.create("config.yaml", "defaults:\n  - db: ???\n")
        .create("db/a.yaml", "x: 1\n")
        .create("db/b.yaml", "x: 2\n");
    let err = dir.compose("config", &["--cfg", "job"]).err().to_owned();
    assert!(
        err.contains("You must specify 'db', e.g, db=<OPTION>\nAvailable options:\n\ta\n\tb"),
        "{err}"
    );
    assert_yaml_eq(
        dir.compose("config", &["db=b", "--cfg", "job"]).ok(),
        "db: {x: 2}\n",
    );
}

#[test]
fn hydra_groups_are_built_in() {
    let dir = app();
    let out = dir.compose(
        "config",
        &["hydra/job_logging=stdout", "--info", "defaults"],
    );
    assert!(
        out.ok().contains("| hydra/job_logging/stdout "),
        "{}",
        out.stdout
    );
    let err = dir
        .compose("config", &["hydra/job_logging=nosuch", "--cfg", "job"])
        .err()
        .to_owned();
    assert!(
        err.contains(
            "Available options in 'hydra/job_logging':\n\tdefault\n\tdisabled\n\tnone\n\tstdout"
        ),
        "{err}"
    );
    let hydra = dir.compose("config", &["--cfg", "hydra"]);
    assert!(
        hydra.ok().contains("train_embodied"),
        "job name missing:\n{}",
        hydra.stdout
    );
}

#[test]
fn config_dir_and_search_path_add_sources() {
    let dir = app();
    dir.create("extra/cache/redis.yaml", "host: localhost\n");
    dir.create("more/queue/rabbit.yaml", "port: 5672\n");
    let extra = dir.join("extra").display().to_string();
    let out = dir.compose("config", &["-cd", &extra, "+cache=redis", "--cfg", "job"]);
    assert!(
        out.ok().contains("redis") || out.stdout.contains("localhost"),
        "{}",
        out.stdout
    );
    let more = format!(
        "hydra.searchpath=[file://{},file:///no/such/dir]",
        dir.join("more").display()
    );
    let out = dir.compose("config", &[&more, "+queue=rabbit", "--cfg", "job"]);
    assert!(out.ok().contains("5672"), "{}", out.stdout);
    assert!(
        dir.compose("config", &["-cd", "/no/such/dir", "--cfg", "job"])
            .err()
            .contains("Additional config directory '/no/such/dir' not found")
    );
}

#[test]
fn usage_errors_name_the_flag() {
    let dir = app();
    assert!(
        dir.run(&["train_embodied", "--frobnicate"])
            .err()
            .contains("unrecognized arguments: --frobnicate")
    );
    assert!(
        dir.run(&["train_embodied", "--cfg", "everything"])
            .err()
            .contains("invalid choice: 'everything'")
    );
    assert!(
        dir.run(&["nosuch_entry"])
            .err()
            .contains("argument entry: invalid choice: 'nosuch_entry'")
    );
    assert!(
        dir.run(&["train_embodied", "-cp", "/no/such/dir", "--cfg", "job"])
            .err()
            .contains("Primary config directory not found")
    );
    assert!(
        dir.compose("config", &["--resolve"])
            .err()
            .contains("--resolve flag can only be used in conjunction with --cfg")
    );
}

#[test]
fn show_commands_create_no_output_dirs() {
    let dir = app();
    dir.compose("config", &["--cfg", "job"]).ok();
    dir.compose("config", &["--info", "defaults"]).ok();
    assert!(!dir.join("outputs").exists());
}

/// A run of the test app that stops at typed validation (an unknown syncer type), after Hydra's part of
/// the run (output directory, `.hydra/` files) is done and before any worker would start.
const STOP_AT_VALIDATION: &str = "+weight_syncer.type=no_such_syncer";

#[test]
fn a_run_writes_the_hydra_files() {
    let dir = app();
    let err = dir
        .compose(
            "config",
            &["hydra.run.dir=runs/one", "app.port=1", STOP_AT_VALIDATION],
        )
        .err()
        .to_owned();
    assert!(err.contains("weight_syncer.type"), "{err}");
    assert!(dir.join("runs/one/.hydra/config.yaml").is_file());
    assert!(dir.join("runs/one/.hydra/hydra.yaml").is_file());
    let overrides =
        std::fs::read_to_string(dir.join("runs/one/.hydra/overrides.yaml")).unwrap_or_default();
    assert!(overrides.contains("app.port=1"), "{overrides}");
    let config =
        std::fs::read_to_string(dir.join("runs/one/.hydra/config.yaml")).unwrap_or_default();
    assert_yaml_eq(
        &config,
        "db: {driver: mysql, port: 3306}\nserver: {size: {workers: 2}}\napp: {name: demo, port: 1}\nweight_syncer: {type: no_such_syncer}\n",
    );

    dir.compose(
        "config",
        &[
            "hydra.run.dir=runs/two",
            "hydra.output_subdir=null",
            STOP_AT_VALIDATION,
        ],
    );
    assert!(dir.join("runs/two").is_dir());
    assert!(!dir.join("runs/two/.hydra").exists());
}

#[test]
fn multirun_prepares_one_dir_per_combination() {
    let dir = app();
    dir.compose(
        "config",
        &[
            "-m",
            "hydra.sweep.dir=sweep",
            "db=mysql,postgresql",
            "app.port=1,2,3",
            STOP_AT_VALIDATION,
        ],
    );
    assert!(dir.join("sweep/multirun.yaml").is_file());
    for n in 0..6 {
        assert!(
            dir.join(&format!("sweep/{n}/.hydra/config.yaml")).is_file(),
            "job {n}"
        );
    }
    assert!(!dir.join("sweep/6").exists());
    let last =
        std::fs::read_to_string(dir.join("sweep/5/.hydra/overrides.yaml")).unwrap_or_default();
    assert!(
        last.contains("db=postgresql") && last.contains("app.port=3"),
        "{last}"
    );
}

#[test]
fn app_help_lists_groups() {
    let dir = app();
    let out = dir.compose("config", &["--help"]);
    let text = out.ok();
    assert!(
        text.contains("train_embodied is powered by Hydra."),
        "{text}"
    );
    assert!(text.contains("db: mysql, postgresql"), "{text}");
    assert!(text.contains("server: large, small"), "{text}");
}

#[test]
fn a_config_that_includes_itself_is_an_error_not_a_crash() {
    let dir = Dir::new();
    dir.create("c.yaml", "defaults:\n  - g: a\n")
        .create("g/a.yaml", "defaults:\n  - /c\n");
    let err = dir.compose("c", &["--cfg", "job"]).err().to_owned();
    assert!(
        err.contains("defaults list cycle: <root> -> c -> g/a -> c"),
        "{err}"
    );
}

#[test]
fn interpolated_defaults_and_resolve() {
    let dir = Dir::new();
    dir.create("config.yaml", "defaults:\n  - db: mysql\n  - combo: ${db}_small\n  - _self_\nname: ${db.driver}-app\njob: ${hydra:job.name}\n")
        .create("db/mysql.yaml", "driver: mysql\n")
        .create("db/pg.yaml", "driver: pg\n")
        .create("combo/mysql_small.yaml", "size: 1\n")
        .create("combo/pg_small.yaml", "size: 2\n");
    assert_yaml_eq(
        dir.compose("config", &["db=pg", "--cfg", "job"]).ok(),
        "db: {driver: pg}\ncombo: {size: 2}\nname: ${db.driver}-app\njob: ${hydra:job.name}\n",
    );
    assert_yaml_eq(
        dir.compose("config", &["db=pg", "--cfg", "job", "--resolve"])
            .ok(),
        "db: {driver: pg}\ncombo: {size: 2}\nname: pg-app\njob: train_embodied\n",
    );
    let err = dir
        .compose("config", &["name=${nosuch}", "--cfg", "job", "--resolve"])
        .err()
        .to_owned();
    assert!(
        err.contains("Interpolation key 'nosuch' not found"),
        "{err}"
    );
}

/// `-sc query=bash` with the shell's `COMP_LINE` (the line typed so far).
fn complete(dir: &Dir, line: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rlsync"))
        .args(["-sc", "query=bash"])
        .env("COMP_LINE", line)
        .current_dir(dir.join(""))
        .output()
        .unwrap_or_else(|e| panic!("cannot run rlsync: {e}"));
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).trim_end().to_owned()
}

/// The candidates Hydra 1.3.8's bash completion gives for the same tree and words (recorded from a
/// `@hydra.main` app on `app()`'s files).
#[test]
fn shell_completion_queries_complete_as_hydras() {
    let dir = app();
    let cp = dir.join("").display().to_string();
    let line = |words: &str| format!("rlsync train_embodied -cp {cp} -cn config {words}");
    for (words, want) in [
        ("", "app. db. db= hydra hydra. server. server="),
        ("d", "db. db="),
        ("db=", "db=mysql db=postgresql"),
        ("db=p", "db=postgresql"),
        ("app.", "app.name= app.port="),
        ("app.port=", "app.port=8080"),
        ("server.size.w", "server.size.workers="),
        ("+", "+db= +hydra +server="),
        ("~", "~db ~hydra ~server"),
        ("db.driver=", "db.driver=mysql"),
        ("db=postgresql db.port=", "db.port=5432"),
        ("app.nme=1 app.", ""),
    ] {
        assert_eq!(complete(&dir, &line(words)), want, "words {words:?}");
    }
    // Before the entry point, the entry points; in the embedded tree, a typo's neighbour.
    assert_eq!(
        complete(&dir, "rlsync "),
        "bench_sync plot train_async train_embodied"
    );
    assert_eq!(complete(&dir, "rlsync train_a"), "train_async");
    assert_eq!(
        complete(&dir, "rlsync train_embodied actor.optim.l"),
        "actor.optim.lr="
    );
    assert_eq!(
        complete(&dir, "rlsync train_embodied weight_syncer="),
        "weight_syncer=bucket_syncer weight_syncer=patch_syncer"
    );
}

#[test]
fn shell_completion_installs_hydras_scripts() {
    let dir = Dir::new();
    let bash = dir.run(&["-sc", "install=bash"]);
    assert!(
        bash.ok()
            .contains("complete -o nospace -o default -F hydra_bash_completion rlsync"),
        "{}",
        bash.stdout
    );
    assert!(bash.stdout.contains("$helper -sc query=bash"));
    let fish = dir.run(&["train_embodied", "-sc", "install=fish"]);
    assert!(
        fish.ok()
            .contains("complete -c rlsync -x -a '(hydra_fish_completion)'")
    );
    assert!(
        dir.run(&["-sc", "uninstall=zsh"])
            .ok()
            .contains("unset hydra_bash_completion")
    );
    let bad = dir.run(&["-sc", "install=tcsh"]);
    assert_eq!(bad.code, Some(1));
    assert!(
        bad.stderr.contains("No completion plugin for 'tcsh' found"),
        "{}",
        bad.stderr
    );
    let both = dir.run(&["train_embodied", "-sc", "install=bash", "--cfg", "job"]);
    assert!(
        both.err()
            .contains("Only one of --run, --multirun, --cfg, --info and --shell_completion")
    );
}

/// argparse's habits: usage errors exit with status 2, usage and message on stderr.
#[test]
fn usage_errors_exit_2_with_argparses_wording() {
    let dir = Dir::new();
    for (args, message) in [
        (
            &[][..],
            "rlsync: error: the following arguments are required: entry",
        ),
        (
            &["--frob"][..],
            "rlsync: error: unrecognized arguments: --frob",
        ),
        (
            &["nope"][..],
            "rlsync: error: argument entry: invalid choice: 'nope'",
        ),
        (
            &["train_embodied", "--cfg", "nope"][..],
            "rlsync: error: argument --cfg/-c: invalid choice: 'nope' (choose from 'job', 'hydra', 'all')",
        ),
        (
            &["train_embodied", "--cfg"][..],
            "rlsync: error: argument --cfg/-c: expected one argument",
        ),
    ] {
        let out = dir.run(args);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(
            out.stderr.starts_with("usage: rlsync"),
            "{args:?}: {}",
            out.stderr
        );
        assert!(out.stderr.contains(message), "{args:?}: {}", out.stderr);
        assert!(out.stdout.is_empty());
    }
}

/// `rlsync --help` lists `plot` with the other entry points.
#[test]
fn top_level_help_lists_plot_among_the_entry_points() {
    let dir = Dir::new();
    let out = dir.run(&["--help"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let entries = out
        .stdout
        .split("Entry points:\n")
        .nth(1)
        .unwrap_or_default();
    for name in ["train_embodied", "train_async", "bench_sync", "plot"] {
        assert!(
            entries
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{name} "))),
            "{name} missing from:\n{}",
            out.stdout
        );
    }
}

#[test]
fn an_override_typo_keeps_hydras_message_and_suggests_the_key() {
    let dir = Dir::new();
    let out = dir.run(&["train_embodied", "actor.optim.lrr=1e-3", "--cfg", "job"]);
    assert_eq!(out.code, Some(1));
    assert!(
        out.stderr.contains(
            "Could not override 'actor.optim.lrr'.\nTo append to your config use +actor.optim.lrr=1e-3\ndid you mean actor.optim.lr?"
        ),
        "{}",
        out.stderr
    );
    let out = dir.run(&["train_embodied", "actr.optim.lr=1", "--cfg", "job"]);
    assert!(
        out.err().contains("did you mean actor.optim.lr?"),
        "{}",
        out.stderr
    );
    // Nothing near: Hydra's message alone.
    let out = dir.run(&["train_embodied", "zzzzzz=1", "--cfg", "job"]);
    assert!(!out.err().contains("did you mean"), "{}", out.stderr);
}
