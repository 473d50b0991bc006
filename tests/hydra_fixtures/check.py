#!/usr/bin/env python3
"""Regression cases for issue #15: Hydra's own example apps and fixtures (copied under data/, see
LICENSE-hydra) plus small trees written for one behaviour each, run through the command line.

    check.py gen --oracle "PYTHON .../oracle.py" --kit KIT_DIR [-j N] [--only KIND]   # (re)write cases.jsonl
    check.py run --bin BIN --kit KIT_DIR [-j N] [--verbose]       # check BIN against cases.jsonl

KIT_DIR is the shared conformance kit (its run.py provides the value encoding and the YAML comparison).
A case runs `ENTRY --config-path DIR --config-name NAME OVERRIDES... ARGS...` in CWD with ENV on top of
the caller's environment (`{data}` in a value stands for this directory's data/); its expectation is what
hydra-core 1.3.8 printed through oracle.py: `config` (stdout as OmegaConf loads it, key order included),
`stdout` (exact text, for a leaf printed by --package) or `error` (a regex over stderr, made from Hydra's
message). Nothing here is written by hand except the inputs below.
"""

import argparse
import concurrent.futures
import zlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
CASES = os.path.join(HERE, "cases.jsonl")
ENTRY = "train_embodied"

JOB = ["--cfg", "job"]
RESOLVE = ["--cfg", "job", "--resolve"]


def hydra_p(package):
    return ["--cfg", "hydra", "-p", package]


# (kind, config dir under data/, config name, overrides, args, env, cwd under data/)
INPUTS = []


def add(kind, cdir, name, overrides, args=JOB, env=None, cwd=None):
    INPUTS.append((kind, cdir, name, list(overrides), list(args), env or {}, cwd))


# 1. The hydra node is typed by Hydra's schema.
for value in ["1", "1.5", "true", "abc", "[1]", "null", "'${db.driver}'", "{a:1}"]:
    add("typed_hydra", "defaults", "config", [f"+hydra.job.env_set.X={value}"],
        hydra_p("hydra.job.env_set"))
for override in [
    "hydra.job.chdir=abc", "hydra.job.chdir=yes", "hydra.job.chdir=0", "hydra.job.chdir=null",
    "hydra.job.num=abc", "hydra.job.num=3", "hydra.job.num=1.5", "hydra.job.num=true",
    "hydra.job.name=1", "hydra.job.name=null", "hydra.job.id=[1]", "hydra.job.env_set={a:1}",
    "hydra.job.env_set.X=1", "hydra.job.config_name=null", "~hydra.job", "~hydra.job.name",
    "~hydra.job.env_set", "+hydra.job.env_set.X=1", "hydra.job.env_copy=[]",
    "hydra.job.config.override_dirname.kv_sep=1", "+hydra.job.config.override_dirname.x=1",
]:
    add("typed_hydra", "defaults", "config", [override], hydra_p("hydra.job"))
for override, package in [
    ("hydra.mode=MULTIRUN", "hydra.mode"), ("hydra.mode=foo", "hydra.mode"),
    ("hydra.mode=RunMode.RUN", "hydra.mode"), ("hydra.mode=2", "hydra.mode"),
    ("hydra.run=5", "hydra.run"), ("hydra.run.dir=[1]", "hydra.run"), ("hydra.run.dir=7", "hydra.run"),
    ("+hydra.foo=1", "hydra.foo"), ("++hydra.foo=1", "hydra.foo"), ("hydra.verbose=[a]", "hydra.verbose"),
    ("hydra.sweeper.max_batch_size=abc", "hydra.sweeper"), ("hydra.sweeper.max_batch_size=5", "hydra.sweeper"),
("+hydra.launcher.x=1", "hydra.launcher"),
    ("hydra.output_subdir=null", "hydra.output_subdir"), ("hydra.output_subdir=1", "hydra.output_subdir"),
    ("hydra.sweep.subdir=1.5", "hydra.sweep"),
]:
    add("typed_hydra", "defaults", "config", [override], hydra_p(package))
for option in sorted(f[:-5] for f in os.listdir(os.path.join(DATA, "hydra_schema", "h"))):
    add("typed_hydra", "hydra_schema", "config", [f"+h={option}"], hydra_p("hydra.job"))
    add("typed_hydra", "hydra_schema", "config", [f"+h={option}"], JOB)
for option in ["early", "early_env"]:
    add("typed_hydra", "hydra_schema", "config", [f"hydra/output={option}"], hydra_p("hydra.run"))
    add("typed_hydra", "hydra_schema", "config", [f"hydra/output={option}"], hydra_p("hydra.job"))
add("typed_hydra", "setting_env", "config", [])
add("typed_hydra", "user_hydra_config", "config_default", [])
add("typed_hydra", "user_hydra_config", "config_default", [], ["--info", "defaults"])

# 2. pkg:// search paths.
add("pkg_search_path", "config_search_path/conf", "config", [], cwd="config_search_path")
add("pkg_search_path", "config_search_path/conf", "config", ["dataset=cifar10"], cwd="config_search_path")
for env in [{"PYTHONPATH": "{data}/pkg_search/pythonpath"}, {"PYTHONPATH": None}]:
    for overrides in [[], ["db=pkg"], ["+extra=on"], ["db=nope"]]:
        add("pkg_search_path", "pkg_search/conf", "config", overrides, env=env)

# 3. ~key compares and selects the resolved value.
for override in ["~a=10", "~a=11", "~a", "~b", "~a=10.0", "~a='10'"]:
    add("delete_resolved", "simple_interpolation", "config", [override])
add("delete_resolved", "test_utils_configs", "custom_resolver", ["~x"])
for override in ["~a=10", "~a=11", "~a", "~c", "~c=1", "~e", "~e=1", "~d={x:10}", "~d={x:11}",
                 "~f={x:10}", "~f", "~g", "~h=10", "~h='10'", "~a=10.0", "~m", "~n"]:
    add("delete_resolved", "delete_resolved", "config", [override], env={"NOPE_X": None})

# 4. --package on a leaf prints the resolved value.
for overrides, package in [
    ([], "node.do"), ([], "node.zippity"), ([], "node.loompa"), ([], "node.waldo"), ([], "node"),
    (["node.loompa=???"], "node.do"), (["node.loompa=${x}"], "node.do"),
    (["node.loompa=???"], "node.loompa"), (["node.loompa=${hydra:job.name}"], "node.loompa"),
    (["node.loompa=null"], "node.zippity"),
]:
    add("package_leaf", "using_config", "config", overrides, JOB + [f"--package={package}"])
    add("package_leaf", "using_config", "config", overrides, RESOLVE + [f"--package={package}"])

# 5. hydra.searchpath in a non-primary config lands at that config's package.
add("searchpath_package", "test_utils_configs", "config", ["+completion_test=additional_searchpath"])
for option in ["global", "group", "scalar", "missing"]:
    add("searchpath_package", "searchpath_package", "config", [f"+g={option}"])

# 6. ${hydra:...} reads a hydra node that hangs below the printed config.
for overrides in [[], ["b=${a}"], ["a=${b}"], ["b=${a}", "a=3"]]:
    add("hydra_node_parent", "hydra_to_cfg_interpolation", "config", overrides, RESOLVE)
for overrides in [["~x"], ["~x", "hydra.job.name=n${a}"], ["~x", "~y", "+z=${hydra:runtime.version}"]]:
    add("hydra_node_parent", "hidden_hydra", "config", overrides, RESOLVE)
add("hydra_node_parent", "hidden_hydra", "config", [], RESOLVE)

# 7. YAML !!binary keys.
for overrides in [[], ["b=2"]]:
    add("binary_keys", "binary_keys", "config", overrides)
    add("binary_keys", "binary_keys", "config", overrides, RESOLVE)

# 8. Error texts: ANTLR's first syntax error, worded as Hydra (overrides) and OmegaConf (interpolations, merged
# through a quoted override value) print it. The inputs are valid overrides and interpolations cut, stuffed with
# a stray character or missing one at every position; a fixed hash picks a sample of them.
def mutations(seeds, stray):
    out = set()
    for v in seeds:
        for i in range(len(v) + 1):
            out.add(v[:i])
            out.update(v[:i] + c + v[i:] for c in stray)
        out.update(v[:i] + v[i + 1:] for i in range(len(v)))
    return sorted(out)


OVERRIDE_SEEDS = [
    "x=[1,2,3]", "x={a:1,b:[2,3]}", "x=choice(1,2,3)", "x=range(1,10,2)", "x=interval(0,1)",
    "x=glob(a*,exclude=b*)", "x=1,2,3", "x='a b',\"c\"", "x=${y}", "+x=1", "++x.y=[a,{b:c}]", "~x", "~x=1",
    "db@pkg=mysql", "hydra/launcher=basic", "x=tag(a,b,c)", "x=sort([3,1],reverse=true)", "x=a\\,b",
    "x= 1 , 2 ", "x={ a : 1 }", "@pkg=x", "a.b.c=1.5e3", "x=shuffle(choice(a,b))", "$x.y=1", "x=f()",
    "x=a(b(c(d)))", "x=[1,[2,{a:3}]]", "x={a:[1,2],b:choice(1,2)}",
]
OVERRIDE_STRAY = list("[]{}(),=:'\"\\$@~+ \t/.*#") + ["${", ",,"]
# Not a syntax error (a group override that matches no default; its hint prints the list as Python's str(),
# checked in tests/cli.rs), so not a case of this kind.
NOT_SYNTAX = {"@x=[1,2,3]"}
for text in mutations(OVERRIDE_SEEDS, OVERRIDE_STRAY):
    if zlib.crc32(text.encode()) % 60 == 0 and text not in NOT_SYNTAX:
        add("error_text", "error_text", "config", [text])

INTERPOLATION_SEEDS = [
    "${a}", "${a.b[c]}", "${oc.env:HOME,x}", "${dict .a}", "${foo:[1,2],{a:b}}", "x${a}y", "${${a}}",
    "${..a.b}", "${a:b:c}", "${a:\"q\"}", "${a: 1 , 2 }", "${a:,}", "${a[0]}", "${ns.${x}:1}", "${a:{b:[c,d]}}",
    "${ a }", "${a:\\,b}",
]
INTERPOLATION_STRAY = list("[]{}(),=:'\"\\$. \t#") + ["${", "}"]
for text in mutations(INTERPOLATION_SEEDS, INTERPOLATION_STRAY):
    if "${" not in text or zlib.crc32(text.encode()) % 10 != 0 or text.endswith("\\"):
        continue
    if "'" not in text:
        add("error_text", "error_text", "config", [f"x='{text}'"])
    elif '"' not in text:
        add("error_text", "error_text", "config", [f'x="{text}"'])

# oc.decode parses its input as a single element, lexed in value mode.
for text in [" }", "1 }", "\t", "[1,2", "{a:1,}", "a=b", "[1,{a:2}]", "'x", "{a:1}}"]:
    quoted = f"'{text}'" if "'" not in text else f'"{text}"'
    add("error_text", "error_text", "config", [f"+y={quoted}", "x='${oc.decode:${y}}'"], RESOLVE)


def case_id(kind, cdir, name, overrides, args):
    text = " ".join([cdir, name] + overrides + args)
    cid = f"{kind}/{re.sub(r'[^A-Za-z0-9_.=+~-]+', '_', text)}"
    if kind == "error_text":  # inputs that differ only in punctuation must not share an id
        cid += f"/{zlib.crc32(text.encode()):08x}"
    return cid


def command(bin_argv, case):
    config_dir = os.path.join(DATA, case["config_dir"])
    return (list(bin_argv) + [ENTRY, "--config-path", config_dir, "--config-name", case["config_name"]]
            + case["overrides"] + case["args"])


def environment(case):
    env = dict(os.environ)
    for key, value in case["env"].items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value.replace("{data}", DATA)
    return env


def execute(bin_argv, case, timeout=30):
    cwd = os.path.join(DATA, case["cwd"]) if case.get("cwd") else HERE
    p = subprocess.run(command(bin_argv, case), env=environment(case), cwd=cwd,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")


def error_regex(stderr):
    """Hydra's message: the exception text of a traceback, else stderr without warnings and the hint."""
    lines = [line for line in stderr.splitlines()]
    if any(line.startswith("Traceback") for line in lines):
        for idx in range(len(lines) - 1, -1, -1):
            m = re.match(r"^[A-Za-z_.]+(Error|Exception|Value)[A-Za-z]*: (.*)$", lines[idx])
            if m:
                lines = [m.group(2)] + lines[idx + 1:]
                break
    kept = []
    for line in lines:
        if "HYDRA_FULL_ERROR" in line or "UserWarning" in line or line.startswith("  warnings.warn"):
            continue
        if line.startswith("    full_key") or line.startswith("    reference_type") or line.startswith("    object_type"):
            continue
        if line.strip():
            kept.append(line)
    return r"[\s\S]*?".join(re.escape(line) for line in kept[:2])


def load_kit(kit):
    spec = importlib.util.spec_from_file_location("kit_run", os.path.join(kit, "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expectation(kit, rc, out, err):
    if rc != 0:
        return {"error": error_regex(err)}
    if out.lstrip().startswith("#") or ":" in out.split("\n", 1)[0]:
        try:
            return {"config": kit.encode(kit.yaml_to_container(out))}
        except Exception:  # noqa: BLE001 - not a mapping: compare the text
            pass
    if "Defaults List" in out:
        return {"defaults": [list(r) for r in kit.parse_defaults_table(out)]}
    return {"stdout": out}


def gen(args):
    kit = load_kit(args.kit)
    oracle = shlex.split(args.oracle)
    seen = set()
    cases = []
    kept = {}
    if args.only:
        with open(CASES, encoding="utf-8") as fh:
            kept = {c["id"]: c for c in map(json.loads, fh) if c["kind"] != args.only}
    for kind, cdir, name, overrides, cargs, env, cwd in INPUTS:
        cid = case_id(kind, cdir, name, overrides, cargs)
        if cid in seen:
            continue
        seen.add(cid)
        cases.append({"id": cid, "kind": kind, "config_dir": cdir, "config_name": name,
                      "overrides": overrides, "args": cargs, "env": env, "cwd": cwd})
    todo = [c for c in cases if c["id"] not in kept]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        results = dict(zip((c["id"] for c in todo), ex.map(lambda c: execute(oracle, c), todo)))
    with open(CASES, "w", encoding="utf-8") as fh:
        for case in cases:
            if case["id"] in kept:
                case = kept[case["id"]]
            else:
                case["expect"] = expectation(kit, *results[case["id"]])
            fh.write(json.dumps(case, sort_keys=False) + "\n")
    print(f"wrote {len(cases)} cases to {CASES}")


def check(kit, bin_argv, case):
    rc, out, err = execute(bin_argv, case)
    expect = case["expect"]
    if "error" in expect:
        if rc == 0:
            return f"expected an error matching /{expect['error']}/, exit status was 0"
        if not re.search(expect["error"], err):
            return f"stderr does not match /{expect['error']}/: {err.strip()[-300:]!r}"
        return None
    if rc != 0:
        return f"exit status {rc}: {err.strip()[-300:]!r}"
    if "stdout" in expect:
        return None if out == expect["stdout"] else f"stdout {out!r} != {expect['stdout']!r}"
    if "defaults" in expect:
        return kit.compare_tables(expect["defaults"], kit.parse_defaults_table(out))
    try:
        actual = kit.yaml_to_container(out)
    except Exception as e:  # noqa: BLE001
        return f"stdout is not YAML OmegaConf loads: {e}"
    return kit.compare(kit.decode(expect["config"]), actual)


def run(args):
    kit = load_kit(args.kit)
    bin_argv = shlex.split(args.bin)
    with open(CASES, encoding="utf-8") as fh:
        cases = [json.loads(line) for line in fh if line.strip()]
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for case, problem in zip(cases, ex.map(lambda c: check(kit, bin_argv, c), cases)):
            if problem:
                failed += 1
                print(f"FAIL {case['id']}: {problem}")
                if args.verbose:
                    print("    " + shlex.join(command(bin_argv, case)))
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--oracle", required=True)
    g.add_argument("--kit", required=True)
    g.add_argument("-j", "--jobs", type=int, default=2)
    g.add_argument("--only", metavar="KIND", help="rerun only this kind's inputs; keep the other cases")
    r = sub.add_parser("run")
    r.add_argument("--bin", required=True)
    r.add_argument("--kit", required=True)
    r.add_argument("-j", "--jobs", type=int, default=2)
    r.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.cmd == "gen":
        gen(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
