//! Multi-node runs on this host (issue 14): the real binary started once per node on 127.0.0.1 with the same
//! command line and its node rank, as a scheduler would. Patch and bucket runs finish with every sync
//! verified across the TCP weight chain; a node agent killed with SIGKILL or stopped with SIGSTOP fails the
//! run with an error naming the node, every other node exits and nothing is left behind; a peer with the
//! wrong token is refused and the run goes on. With `runner.rollout_restarts`, rollouts on other nodes killed
//! with SIGKILL are restarted through their agents and rejoin through the chain (patch and bucket,
//! `train_embodied` and `train_async`); one killed past its budget fails the run naming it and its node; rollouts
//! placed out of chain order, and a host-shared node's applier that is not its node's place in the chain, are
//! caught up by their receiver index on the weight channel.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::util::{self, PATIENCE, Scratch, bin, processes_naming as processes_of, worker_pid};
/// `cluster.node_timeout_s` of the fault runs (short: the test waits that long), and of the others (long: a
/// node starved of CPU by a loaded machine must not look dead).
const FAULT_NODE_TIMEOUT_S: f64 = 3.0;
const NODE_TIMEOUT_S: f64 = 30.0;
/// Ports of a run's `cluster.network.port_min..=port_max` (the nodes' chain listeners).
const CHAIN_PORTS: u16 = 21;

/// The first of `len` consecutive loopback ports that are free now, below the kernel's ephemeral range: a port
/// taken from that range (`bind(":0")`) may be handed to another process's connection between this pick and
/// the run's own bind (seen: "Address already in use" for a rendezvous port); ports below it are only ever
/// bound on purpose, and the random start keeps the tests that run at once apart.
fn free_ports(len: u16) -> u16 {
    use rand::Rng;
    const LOWEST: u16 = 10_000;
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let top = ephemeral.saturating_sub(len).max(LOWEST + 1);
    for _ in 0..1000 {
        let first = rand::thread_rng().gen_range(LOWEST..top);
        let free = (first..first + len)
            .all(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok());
        if free {
            return first;
        }
    }
    panic!("no {len} consecutive free ports in {LOWEST}..{ephemeral}");
}

/// One run over `nodes` nodes: its run dir and private TMPDIR, the rendezvous port and the token.
struct Run {
    scratch: Scratch,
    run_dir: PathBuf,
    nodes: u32,
    port: u16,
    chain_ports: u16,
    token: String,
    node_timeout_s: f64,
    /// More overrides for every node.
    extra: Vec<String>,
    /// The entry point (`train_embodied` unless set).
    entry: &'static str,
    /// More environment for every node (and so its workers).
    env: Vec<(String, String)>,
    /// `cluster.slots_per_node` (1 unless set).
    slots_per_node: u32,
    /// `cluster.component_placement.rollout` (`0-<nodes-1>` unless set: rollout r on node r).
    rollout_slots: String,
    /// The rollouts `rollout_slots` places (each gets two train envs and one eval env).
    rollouts: u32,
}

impl Run {
    fn new(nodes: u32) -> Run {
        let scratch = Scratch::new("mn");
        // The rendezvous port, then the chain's range.
        let port = free_ports(1 + CHAIN_PORTS);
        Run {
            run_dir: scratch.run_dir.clone(),
            nodes,
            port,
            chain_ports: port + 1,
            token: format!("{:032x}", rand::random::<u128>()),
            node_timeout_s: NODE_TIMEOUT_S,
            extra: Vec::new(),
            entry: "train_embodied",
            env: Vec::new(),
            slots_per_node: 1,
            rollout_slots: format!("0-{}", nodes - 1),
            rollouts: nodes,
            scratch,
        }
    }

    /// Node `node`'s `rlsync train_embodied` (one rollout per node, the trainer beside rollout 0 on node 0),
    /// its rank and rendezvous as `cluster.*` keys.
    fn node(&self, node: u32, syncer: &str, steps: u32, token: &str) -> Command {
        let mut cmd = self.node_base(syncer, steps, token);
        cmd.arg(format!("cluster.node_rank={node}"))
            .arg("cluster.master_addr=127.0.0.1")
            .arg(format!("cluster.master_port={}", self.port));
        cmd
    }

    /// Node `node` as torchrun starts it: rank, count and rendezvous from its environment only.
    fn torchrun_node(&self, node: u32, syncer: &str, steps: u32) -> Command {
        let mut cmd = self.node_base(syncer, steps, &self.token);
        cmd.env("NODE_RANK", node.to_string())
            .env("NNODES", self.nodes.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.port.to_string());
        cmd
    }

    /// Node `node` as Slurm's srun starts it (one task per node; the rendezvous port as a key: Slurm sets none).
    fn slurm_node(&self, node: u32, syncer: &str, steps: u32) -> Command {
        let mut cmd = self.node_base(syncer, steps, &self.token);
        cmd.env("SLURM_PROCID", node.to_string())
            .env("SLURM_NNODES", self.nodes.to_string())
            .env("SLURM_NTASKS", self.nodes.to_string())
            .env("SLURM_JOB_NODELIST", "127.0.0.1")
            .arg(format!("cluster.master_port={}", self.port));
        cmd
    }

    /// The command line every node shares, with no scheduler variables in its environment.
    fn node_base(&self, syncer: &str, steps: u32, token: &str) -> Command {
        let mut cmd = self.scratch.command([self.entry]);
        cmd.args([
            "model@actor.model=synthetic_small",
            "env@env.train=synthetic",
            "env@env.eval=synthetic",
            "actor.model.params=65536",
            "actor.model.tensors=8",
            "actor.model.train_ms=5",
            "actor.model.rollout_ms_per_step=1",
            "env.train.max_steps_per_rollout_epoch=8",
            "rollout.chunk_steps=4",
            "runner.shutdown_grace_s=1",
            "runner.handshake_timeout_s=60",
            "runner.step_timeout_s=60",
            "cluster.component_placement.actor=0",
        ])
        .arg(format!("cluster.slots_per_node={}", self.slots_per_node))
        .arg(format!("weight_syncer={syncer}"))
        .arg(format!("runner.max_steps={steps}"))
        .arg(format!("env.train.total_num_envs={}", 2 * self.rollouts))
        .arg(format!("env.eval.total_num_envs={}", self.rollouts))
        .arg(format!("cluster.num_nodes={}", self.nodes))
        .arg(format!(
            "cluster.component_placement.rollout='{}'",
            self.rollout_slots
        ))
        .arg(format!("cluster.node_timeout_s={}", self.node_timeout_s))
        .arg(format!("cluster.network.port_min={}", self.chain_ports))
        .arg(format!(
            "cluster.network.port_max={}",
            self.chain_ports + CHAIN_PORTS - 1
        ))
        .args(&self.extra)
        .envs(self.env.iter().map(|(k, v)| (k, v)))
        .env("RLSYNC_RUN_TOKEN", token);
        for var in [
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "GROUP_RANK",
            "RANK",
            "WORLD_SIZE",
            "NNODES",
            "SLURM_PROCID",
            "SLURM_NNODES",
            "SLURM_JOB_NODELIST",
            "SLURM_NTASKS",
            "LOCAL_WORLD_SIZE",
            "GROUP_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        ] {
            cmd.env_remove(var);
        }
        cmd
    }

    /// Every node of the run, node 0 first.
    fn start(&self, syncer: &str, steps: u32) -> Vec<Child> {
        (0..self.nodes)
            .map(|n| {
                self.node(n, syncer, steps, &self.token)
                    .spawn()
                    .expect("spawn rlsync")
            })
            .collect()
    }

    fn metrics(&self) -> Vec<serde_json::Map<String, serde_json::Value>> {
        self.scratch.metrics()
    }

    /// Node 0's run dir, then every agent's.
    fn node_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![self.run_dir.clone()];
        dirs.extend((1..self.nodes).map(|n| self.run_dir.join(format!("node-{n}"))));
        dirs
    }

    /// SIGKILL each of `ranks` in turn, three steps apart, each once its predecessor's successor is up (started by
    /// its node's supervisor or agent); the (rank, pid) of each process killed.
    fn kill_in_turn(&self, children: &mut [Child], ranks: &[u32]) -> Vec<(u32, i32)> {
        let mut kills = Vec::new();
        for &rank in ranks {
            let at = self.metrics().len() + 3;
            self.wait_until(children, "the step to kill at", || {
                self.metrics().len() >= at
            });
            let pid = self.rollout_pid(rank).expect("the rollout runs");
            kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
            self.wait_until(children, "the restart", || {
                self.rollout_pid(rank).is_some_and(|p| p != pid)
            });
            kills.push((rank, pid));
        }
        kills
    }

    /// The pid of the run's rollout `rank` now (on whichever node), if it runs.
    fn rollout_pid(&self, rank: u32) -> Option<i32> {
        worker_pid(&self.run_dir, "rollout", rank)
    }

    /// Hold `what` (`rollout-1@catchup`: a worker and a stage): the run's built-in workers start from the
    /// `held_worker` example (`RLSYNC_WORKER`), whose first process of that worker to reach the stage writes
    /// its pid to the file returned and waits to be killed (`RLSYNC_TEST_HOLD`); its successors go on.
    fn hold(&mut self, what: &str) -> PathBuf {
        let file = self.scratch.path().join("held");
        self.env.push((
            "RLSYNC_WORKER".into(),
            util::example("held_worker").display().to_string(),
        ));
        self.env.push((
            "RLSYNC_TEST_HOLD".into(),
            format!("{what}:{}", file.display()),
        ));
        file
    }

    /// The pid of the process held by [`Run::hold`], once it is held there.
    fn held_pid(&self, children: &mut [Child], file: &std::path::Path) -> i32 {
        let read = || {
            std::fs::read_to_string(file)
                .ok()
                .filter(|t| t.ends_with('\n'))
                .and_then(|t| t.trim().parse::<i32>().ok())
        };
        self.wait_until(children, "the held worker", || read().is_some());
        read().unwrap()
    }

    /// Wait until `cond` holds; node 0 ending first (or [`PATIENCE`] passing) fails the test with its stderr.
    fn wait_until(&self, children: &mut [Child], what: &str, cond: impl Fn() -> bool) {
        if let Err(why) = crate::util::wait_until(&mut children[0], what, cond) {
            panic!("node 0: {why}");
        }
    }

    /// What is left of the run: processes naming its dir, files in its TMPDIR, shm segments of its nodes.
    fn leftovers(&self) -> Vec<String> {
        self.scratch.leftovers_of(&self.node_dirs())
    }

    /// `rlsync --cleanup` with this run's TMPDIR (what the next run's start does anyway).
    fn cleanup(&self) {
        let status = Command::new(bin())
            .arg("--cleanup")
            .env("TMPDIR", &self.scratch.tmp)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
    }
}

/// Wait for `child` (killing it after [`PATIENCE`]): its exit code (None: killed by a signal) and stderr.
fn finish(child: Child) -> (Option<i32>, String) {
    crate::util::finish(child).unwrap_or_else(|why| panic!("{why}"))
}

/// Every node exits 0, every train step has a verified sync, and nothing is left.
fn completes(run: &Run, children: Vec<Child>, steps: usize) -> Vec<String> {
    let outs: Vec<(Option<i32>, String)> = children.into_iter().map(finish).collect();
    let all = || {
        outs.iter()
            .enumerate()
            .map(|(node, (code, err))| format!("--- node {node} (exit {code:?}):\n{err}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (node, (code, err)) in outs.iter().enumerate() {
        assert_eq!(*code, Some(0), "node {node} failed:\n{}", all());
        assert!(!err.contains("panicked"), "node {node}:\n{}", all());
    }
    let rows: Vec<_> = run
        .metrics()
        .into_iter()
        .filter(|r| r.contains_key("train/loss"))
        .collect();
    assert_eq!(rows.len(), steps, "{}", outs[0].1);
    for row in &rows {
        assert_eq!(
            row.get("sync/verified"),
            Some(&serde_json::Value::Bool(true)),
            "{row:?}"
        );
    }
    let left = run.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
    outs.into_iter().map(|(_, err)| err).collect()
}

#[test]
fn three_nodes_train_with_patches_every_sync_verified() {
    let run = Run::new(3);
    let children = run.start("patch_syncer", 6);
    completes(&run, children, 6);
    // Each agent ran its rollout in its own node dir.
    for n in 1..3 {
        let log = run.run_dir.join(format!("node-{n}/logs/rollout-{n}.log"));
        assert!(log.exists(), "{}", log.display());
    }
}

/// Node 0 started as srun would start it and node 1 as torchrun would (the README's launch lines).
#[test]
fn two_nodes_train_with_buckets_and_a_wrong_token_peer_is_refused() {
    let run = Run::new(2);
    let node0 = run.slurm_node(0, "bucket_syncer", 5).spawn().unwrap();
    // An impostor claiming node 1 with another token, before the real node 1.
    let intruder = run
        .node(1, "bucket_syncer", 5, "not-the-run-token")
        .spawn()
        .unwrap();
    let (code, intruder_err) = finish(intruder);
    assert_ne!(code, Some(0), "the impostor was let in:\n{intruder_err}");
    assert!(
        intruder_err.contains("token"),
        "the impostor's error names the token:\n{intruder_err}"
    );
    let node1 = run.torchrun_node(1, "bucket_syncer", 5).spawn().unwrap();
    let errs = completes(&run, vec![node0, node1], 5);
    assert!(
        errs[0].contains("refused a node connection"),
        "node 0 logs the refusal:\n{}",
        errs[0]
    );
}

/// Start a long run, wait for a few steps, hit node `victim`'s agent with `signal`: node 0 fails naming the
/// node. Returns node 0's stderr, the seconds from the signal to node 0's exit, and the victim's child.
fn fault(run: &mut Run, victim: u32, signal: Signal) -> (String, f64, Vec<Child>) {
    run.node_timeout_s = FAULT_NODE_TIMEOUT_S;
    let mut children = run.start("patch_syncer", 100_000);
    let deadline = Instant::now() + PATIENCE;
    while run.metrics().len() < 3 {
        if let Some(status) = children[0].try_wait().unwrap() {
            let (_, err) = finish(children.remove(0));
            panic!("node 0 ended ({status}) before the fault:\n{err}");
        }
        assert!(Instant::now() < deadline, "no steps within {PATIENCE:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = children[victim as usize].id() as i32;
    kill(Pid::from_raw(pid), signal).unwrap();
    let hit = Instant::now();
    let node0 = children.remove(0);
    let (code, err) = finish(node0);
    let took = hit.elapsed().as_secs_f64();
    assert_eq!(code, Some(1), "node 0 should fail:\n{err}");
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned();
    assert!(
        err.contains(&format!("node {victim} ({host}")),
        "the error names node {victim} and its host:\n{err}"
    );
    (err, took, children)
}

#[test]
fn a_killed_agent_fails_the_run_naming_its_node() {
    let mut run = Run::new(3);
    let (err, took, children) = fault(&mut run, 2, Signal::SIGKILL);
    println!("SIGKILL of node 2's agent: node 0 exited {took:.2} s later");
    assert!(err.contains("its control connection"), "{err}");
    for (i, child) in children.into_iter().enumerate() {
        let (code, err) = finish(child);
        if i == 0 {
            // Node 1 stopped its workers when node 0 told it the run failed (or went away).
            assert_eq!(code, Some(1), "{err}");
            assert!(
                err.contains("the run failed on node 0") || err.contains("went away"),
                "{err}"
            );
        } else {
            assert_eq!(code, None, "node 2 was killed");
        }
    }
    // A SIGKILLed agent cannot remove its own private dir; the next run's sweep (or --cleanup) does, as for a
    // SIGKILLed orchestrator. Every process is gone already.
    assert!(processes_of(&run.run_dir).is_empty());
    run.cleanup();
    let left = run.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

#[test]
fn a_stopped_agent_fails_the_run_naming_its_node() {
    let mut run = Run::new(3);
    let (err, took, mut children) = fault(&mut run, 1, Signal::SIGSTOP);
    println!("SIGSTOP of node 1's agent: node 0 exited {took:.2} s later");
    assert!(err.contains("did not answer for"), "{err}");
    // Woken, the stopped agent finds the run failed (or its orchestrator gone), stops its workers and exits 1;
    // node 2 did so when node 0 told it.
    let stopped = children[0].id() as i32;
    kill(Pid::from_raw(stopped), Signal::SIGCONT).unwrap();
    for child in children.drain(..) {
        // Exit 1 with the run's failure, the orchestrator's absence, or (under load, when the stopped node's
        // chain link broke first) its own relay's failure.
        let (code, err) = finish(child);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("node "), "{err}");
    }
    let left = run.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

/// Three nodes, one rollout each; rollout 1 (node 1), rollout 2 (node 2) and rollout 0 (node 0, beside the
/// trainer) are killed with SIGKILL mid-run, one after the other. Node 0's supervisor restarts each (the remote
/// ones through their node's agent), the successor rejoins (the remote ones through the TCP chain, whose relay
/// hands the catch-up to it alone), and the run completes with every sync verified, the restarts counted and
/// logged, and nothing left.
fn rollouts_on_every_node_survive_kills(entry: &'static str, syncer: &str) {
    let mut run = Run::new(3);
    run.entry = entry;
    run.extra = vec![
        "runner.rollout_restarts=2".into(),
        "runner.rollout_restart_backoff_s=0.05".into(),
    ];
    let steps = 120;
    let mut children = run.start(syncer, steps as u32);
    let kills = run.kill_in_turn(&mut children, &[1, 2, 0]);
    let errs = completes(&run, children, steps);
    let node0 = &errs[0];
    let rows: Vec<_> = run
        .metrics()
        .into_iter()
        .filter(|r| r.contains_key("train/loss"))
        .collect();
    assert_eq!(restarts_counted(&run), Some(3), "{node0}");
    for (rank, pid) in kills {
        logs_the_restart(node0, rank, pid);
        let rejoined = format!("rollout-{rank} rejoined: caught up by");
        assert!(
            node0.contains(&rejoined),
            "node 0 logs the catch-up:\n{node0}"
        );
    }
    assert!(
        rows.iter().any(|r| r.contains_key("sync/catchup_kind")),
        "the catch-ups are in the metrics"
    );
}

#[test]
fn killed_rollouts_on_every_node_are_restarted_patch() {
    rollouts_on_every_node_survive_kills("train_embodied", "patch_syncer");
}

#[test]
fn killed_rollouts_on_every_node_are_restarted_bucket() {
    rollouts_on_every_node_survive_kills("train_embodied", "bucket_syncer");
}

#[test]
fn killed_rollouts_on_every_node_are_restarted_async_patch() {
    rollouts_on_every_node_survive_kills("train_async", "patch_syncer");
}

/// A rollout on node 1 killed once more than `runner.rollout_restarts` allows fails the run naming it, its
/// node and the count; every node exits and nothing is left.
#[test]
fn a_rollout_on_another_node_past_its_budget_fails_the_run() {
    let mut run = Run::new(2);
    run.extra = vec![
        "runner.rollout_restarts=1".into(),
        "runner.rollout_restart_backoff_s=0.05".into(),
    ];
    let mut children = run.start("patch_syncer", 100_000);
    run.wait_until(&mut children, "a step", || !run.metrics().is_empty());
    let first = run.rollout_pid(1).expect("rollout-1 runs");
    kill(Pid::from_raw(first), Signal::SIGKILL).unwrap();
    run.wait_until(&mut children, "the restart", || {
        run.rollout_pid(1).is_some_and(|p| p != first)
    });
    let second = run.rollout_pid(1).expect("rollout-1 runs again");
    // The successor printed something of its own (its rejoin) before it is killed.
    let log = run.run_dir.join("node-1/logs/rollout-1.log");
    run.wait_until(&mut children, "the successor's rejoin", || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("rejoined the weight channel"))
    });
    kill(Pid::from_raw(second), Signal::SIGKILL).unwrap();
    // The quoted lines are its successor's last ones.
    past_budget(children, second, &log, "rejoined the weight channel");
    let left = run.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

#[test]
fn killed_rollouts_on_every_node_are_restarted_async_bucket() {
    rollouts_on_every_node_survive_kills("train_async", "bucket_syncer");
}

/// With restarts, rollout ranks need not follow the weight chain (a successor rejoins it by its receiver index,
/// not its rank): a placement listing node 1's slots first is accepted at `--dry-run`, as the one in chain order.
#[test]
fn restarts_accept_rollout_ranks_out_of_chain_order() {
    let dir = tempfile::tempdir().unwrap();
    let dry_run = |rollout: &str| {
        Command::new(bin())
            .args([
                "train_embodied",
                "--dry-run",
                "model@actor.model=synthetic_small",
                "env@env.train=synthetic",
                "env@env.eval=synthetic",
                "cluster.num_nodes=2",
                "cluster.slots_per_node=2",
                "cluster.component_placement.actor=0",
                "runner.rollout_restarts=1",
                "env.train.total_num_envs=6",
                "env.eval.total_num_envs=3",
            ])
            .arg(format!("cluster.component_placement.rollout='{rollout}'"))
            .arg(format!(
                "hydra.run.dir={}",
                dir.path().join("run").display()
            ))
            .env("RLSYNC_RUN_TOKEN", "t")
            .env("TMPDIR", dir.path())
            .env_remove("NODE_RANK")
            .env_remove("SLURM_PROCID")
            .output()
            .unwrap()
    };
    for rollout in ["2-3,1", "1-3"] {
        let out = dry_run(rollout);
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{rollout}: {text}");
        assert!(text.contains("OK: configuration is valid"), "{text}");
    }
}

/// Two nodes with the rollouts out of chain order: rollout 0 on node 1 (the weight channel's receiver 1),
/// rollout 1 beside the trainer on node 0 (receiver 0). Rollout 0, killed mid-run, is restarted by node 1's
/// agent and caught up as receiver 1 through the chain; the run completes with every sync verified, the
/// restart counted and logged, and nothing left.
#[test]
fn a_rollout_placed_out_of_chain_order_rejoins_by_its_receiver() {
    let mut run = Run::new(2);
    run.rollout_slots = "1,0".into();
    run.extra = restarts(1);
    // Long enough for the successor to start and be caught up before the last step on a loaded machine.
    let steps = 300;
    let mut children = run.start("patch_syncer", steps);
    run.wait_until(&mut children, "a few steps", || run.metrics().len() >= 3);
    let pid = run.rollout_pid(0).expect("rollout-0 runs");
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    run.wait_until(&mut children, "the restart", || {
        run.rollout_pid(0).is_some_and(|p| p != pid)
    });
    let errs = completes(&run, children, steps as usize);
    let node0 = &errs[0];
    assert_eq!(restarts_counted(&run), Some(1), "{node0}");
    logs_the_restart_on(node0, 0, 1, pid);
    assert!(
        node0.contains("rollout-0 rejoined: caught up by"),
        "node 0 logs the catch-up:\n{node0}"
    );
    // The trainer served it as the chain's receiver 1, on node 1.
    let trainer = std::fs::read_to_string(run.run_dir.join("logs/trainer-0.log")).unwrap();
    assert!(
        trainer.contains("caught up rollout-0 (weight receiver 1)"),
        "{trainer}"
    );
    let log = std::fs::read_to_string(run.run_dir.join("node-1/logs/rollout-0.log")).unwrap();
    assert!(log.contains("rejoined the weight channel"), "{log}");
}

/// `weight_syncer.host_shared` over two nodes with two rollouts each: node 1's applier is rollout 2, the weight
/// channel's receiver 1 (one receiver per node). Killed mid-run, its successor reopens node 1's arena and is
/// caught up as receiver 1 while its reader (rollout 3) keeps going; every sync is verified, the restart counted,
/// no arena or anything else left.
#[test]
fn host_shared_a_remote_applier_rejoins_by_its_nodes_place_in_the_chain() {
    let mut run = Run::new(2);
    run.slots_per_node = 2;
    run.rollout_slots = "0-3".into();
    run.rollouts = 4;
    run.extra = restarts(1);
    run.extra.push("weight_syncer.host_shared=true".into());
    let steps = 300;
    let mut children = run.start("patch_syncer", steps);
    run.wait_until(&mut children, "a few steps", || run.metrics().len() >= 3);
    let reader = run.rollout_pid(3).expect("rollout-3 runs");
    let pid = run.rollout_pid(2).expect("rollout-2 runs");
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    run.wait_until(&mut children, "the restart", || {
        run.rollout_pid(2).is_some_and(|p| p != pid)
    });
    // Node 1's reader was not disturbed: the same process still runs.
    assert_eq!(run.rollout_pid(3), Some(reader));
    let errs = completes(&run, children, steps as usize);
    let node0 = &errs[0];
    assert_eq!(restarts_counted(&run), Some(1), "{node0}");
    logs_the_restart_on(node0, 2, 1, pid);
    assert!(
        node0.contains("rollout-2 rejoined: caught up by"),
        "node 0 logs the catch-up:\n{node0}"
    );
    let trainer = std::fs::read_to_string(run.run_dir.join("logs/trainer-0.log")).unwrap();
    assert!(
        trainer.contains("caught up rollout-2 (weight receiver 1)"),
        "{trainer}"
    );
    let node1 = run.run_dir.join("node-1/logs");
    let log = std::fs::read_to_string(node1.join("rollout-2.log")).unwrap();
    assert!(
        log.contains("rejoined the weight channel into the host's weights")
            && log.contains(".arena.1"),
        "{log}"
    );
}

fn restarts(n: u32) -> Vec<String> {
    vec![
        format!("runner.rollout_restarts={n}"),
        "runner.rollout_restart_backoff_s=0.05".into(),
    ]
}

/// `rollout/restarts` of the run's last train step.
fn restarts_counted(run: &Run) -> Option<u64> {
    run.metrics()
        .into_iter()
        .rfind(|r| r.contains_key("train/loss"))
        .and_then(|r| {
            r.get("rollout/restarts")
                .and_then(serde_json::Value::as_u64)
        })
}

/// Node 0 logs the loss of `rollout-<rank>` (process `pid`; rollout r runs on node r, named when it is not
/// node 0) and its restart.
fn logs_the_restart(node0: &str, rank: u32, pid: i32) {
    logs_the_restart_on(node0, rank, rank, pid);
}

/// [`logs_the_restart`] of a rollout on `node`.
fn logs_the_restart_on(node0: &str, rank: u32, node: u32, pid: i32) {
    // Its supervisor (node 0's, or its agent) saw the connection close or the exit first.
    let lost = match node {
        0 => format!("rollout-{rank} (pid {pid}) "),
        _ => format!("rollout-{rank} (pid {pid} on node {node}) "),
    };
    assert!(
        node0
            .lines()
            .any(|l| l.contains(&lost) && l.contains("restarting it in")),
        "node 0 logs the loss ({lost}):\n{node0}"
    );
    let back = format!("rollout-{rank}: restarted as pid ");
    assert!(node0.contains(&back), "node 0 logs the restart:\n{node0}");
}

/// A rollout on node 1 killed before its agent reported its workers `ready` (held before its hello, so the
/// agent is still starting) is lost, restarted within the budget after the backoff and joins the run, as a
/// rollout of node 0 killed during the start-up: every sync verified, the restart counted, nothing left.
#[test]
fn a_remote_rollout_killed_before_its_agent_is_ready_is_restarted() {
    let mut run = Run::new(2);
    run.extra = restarts(1);
    let held = run.hold("rollout-1@hello");
    let steps = 8;
    let mut children = run.start("patch_syncer", steps);
    let pid = run.held_pid(&mut children, &held);
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let errs = completes(&run, children, steps as usize);
    assert_eq!(restarts_counted(&run), Some(1), "{}", errs[0]);
    logs_the_restart(&errs[0], 1, pid);
    // Its agent was not ready yet: it reported the loss and, once the successor was up, its workers ready.
    let agent = &errs[1];
    let lost = agent
        .find(&format!(
            "rollout-1 (pid {pid}) was killed by SIGKILL; node 0 decides"
        ))
        .unwrap_or_else(|| panic!("node 1 logs the loss:\n{agent}"));
    let ready = agent
        .find("1 worker(s) ready")
        .unwrap_or_else(|| panic!("node 1 gets ready:\n{agent}"));
    assert!(
        lost < ready,
        "the loss came before node 1 was ready:\n{agent}"
    );
}

/// The same past its budget: killed again before its agent was ready, it fails the run naming it and its node
/// and quoting its last lines (sent up by its agent); every node exits and nothing is left.
#[test]
fn a_remote_rollout_killed_before_its_agent_is_ready_past_its_budget_fails_the_run() {
    let mut run = Run::new(2);
    run.extra = restarts(1);
    let held = run.hold("rollout-1@hello*2");
    let mut children = run.start("patch_syncer", 100_000);
    let first = run.held_pid(&mut children, &held);
    kill(Pid::from_raw(first), Signal::SIGKILL).unwrap();
    let second = run.held_pid(
        &mut children,
        &PathBuf::from(format!("{}.2", held.display())),
    );
    kill(Pid::from_raw(second), Signal::SIGKILL).unwrap();
    let log = run.run_dir.join("node-1/logs/rollout-1.log");
    past_budget(children, second, &log, "RLSYNC_TEST_HOLD: held at");
    assert!(run.metrics().iter().all(|r| !r.contains_key("train/loss")));
    let left = run.leftovers();
    assert!(left.is_empty(), "leftovers: {left:?}");
}

/// A rollout on node 1 (the middle of a three-node chain) dies during the weight chain's init bootstrap, held
/// at `stage`: `handshake` (connected to its node's channel, before it sent its metadata: the trainer's
/// bootstrap waits on it until its node answers that it is gone), or `bootstrap` (the plan received, before
/// the bootstrap's payloads). The trainer's bootstrap goes on without it, its successor joins and is caught
/// up, every sync is verified, the restart counted, nothing left.
fn a_remote_rollout_killed_in_the_bootstrap_is_restarted(syncer: &str, stage: &str) {
    let mut run = Run::new(3);
    run.extra = restarts(2);
    let held = run.hold(&format!("rollout-1@{stage}"));
    // Long enough for the successor to start and join before the last step on a loaded machine (the run does
    // not wait for a restarting rollout), ~4 s when idle.
    let steps = 300;
    let mut children = run.start(syncer, steps);
    let pid = run.held_pid(&mut children, &held);
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let errs = completes(&run, children, steps as usize);
    assert_eq!(restarts_counted(&run), Some(1), "{}", errs[0]);
    logs_the_restart(&errs[0], 1, pid);
}

#[test]
fn a_remote_rollout_killed_in_the_bootstrap_is_restarted_patch() {
    a_remote_rollout_killed_in_the_bootstrap_is_restarted("patch_syncer", "bootstrap");
}

#[test]
fn a_remote_rollout_killed_in_the_bootstrap_is_restarted_bucket() {
    a_remote_rollout_killed_in_the_bootstrap_is_restarted("bucket_syncer", "bootstrap");
}

#[test]
fn a_remote_rollout_killed_in_the_bootstrap_handshake_is_restarted_patch() {
    a_remote_rollout_killed_in_the_bootstrap_is_restarted("patch_syncer", "handshake");
}

#[test]
fn a_remote_rollout_killed_in_the_bootstrap_handshake_is_restarted_bucket() {
    a_remote_rollout_killed_in_the_bootstrap_is_restarted("bucket_syncer", "handshake");
}

/// A rollout on node 1 (mid-chain) is killed mid-run; its successor dies while the trainer catches it up
/// (held once the catch-up was announced, before the replay or full transfer reached it): that catch-up
/// fails alone, the next successor is caught up, every sync is verified, both restarts counted, nothing left.
fn a_remote_rollout_killed_in_its_catch_up_is_restarted(syncer: &str) {
    let mut run = Run::new(3);
    run.extra = restarts(3);
    let held = run.hold("rollout-1@catchup");
    // Long enough for two successors to start and the last to be caught up before the last step under load.
    let steps = 300;
    let mut children = run.start(syncer, steps);
    run.wait_until(&mut children, "a few steps", || run.metrics().len() >= 3);
    let first = run.rollout_pid(1).expect("rollout-1 runs");
    kill(Pid::from_raw(first), Signal::SIGKILL).unwrap();
    let second = run.held_pid(&mut children, &held);
    assert_ne!(first, second);
    kill(Pid::from_raw(second), Signal::SIGKILL).unwrap();
    let errs = completes(&run, children, steps as usize);
    let node0 = &errs[0];
    assert_eq!(restarts_counted(&run), Some(2), "{node0}");
    logs_the_restart(node0, 1, first);
    logs_the_restart(node0, 1, second);
    assert!(
        node0.contains("rollout-1 rejoined: caught up by"),
        "node 0 logs the last successor's catch-up:\n{node0}"
    );
}

#[test]
fn a_remote_rollout_killed_in_its_catch_up_is_restarted_patch() {
    a_remote_rollout_killed_in_its_catch_up_is_restarted("patch_syncer");
}

#[test]
fn a_remote_rollout_killed_in_its_catch_up_is_restarted_bucket() {
    a_remote_rollout_killed_in_its_catch_up_is_restarted("bucket_syncer");
}

/// Node 0 of a two-node run failed because rollout-1 on node 1 (last pid `second`) died past its one restart:
/// its error names the rollout, its node and the budget and quotes the last lines of its log on node 1 (sent up
/// by the agent, as a local rollout's are quoted), which hold `last_words`; node 1 exits with the run's failure,
/// told why before its link closed.
fn past_budget(children: Vec<Child>, second: i32, log: &Path, last_words: &str) {
    let mut outs = children.into_iter().map(finish);
    let (code, err) = outs.next().unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(
            "rollout-1 on node 1 died after all its 1 restarts were used (runner.rollout_restarts=1)"
        ) && err.contains(&format!("worker rollout-1 (pid {second}) ")),
        "{err}"
    );
    let quoted = err
        .split(&format!("--- last lines of {} ---\n", log.display()))
        .nth(1)
        .unwrap_or_else(|| panic!("the error quotes node 1's log of it:\n{err}"));
    assert!(quoted.contains(last_words), "{err}");
    for (code, err) in outs {
        assert_eq!(code, Some(1), "node 1 exits with the run's failure:\n{err}");
        assert!(
            err.contains("the run failed on node 0 (rollout-1 on node 1 died"),
            "{err}"
        );
    }
}

/// `weight_syncer.host_shared` over nodes: each node's rollout applies into its own node's arena (named by its
/// supervisor's run tag and node), every sync is verified and no arena is left on any node.
#[test]
fn host_shared_over_two_nodes_gives_each_node_its_arena() {
    let mut run = Run::new(2);
    run.extra.push("weight_syncer.host_shared=true".into());
    let children = run.start("patch_syncer", 6);
    completes(&run, children, 6);
    for (node, dir) in run.node_dirs().iter().enumerate() {
        let log = std::fs::read_to_string(dir.join(format!("logs/rollout-{node}.log"))).unwrap();
        assert!(
            log.contains("into the host's arena") && log.contains(&format!(".arena.{node}:")),
            "{log}"
        );
    }
}

/// The same-host GPU channel over two hosts with two rollouts each (the test worker's simulated devices):
/// node 0's rollouts (0, 1) take every version device to device, node 1's (2, 3) coded patches over the TCP
/// chain from the trainer's device build. Rollout 1 (a channel receiver) and rollout 3 (the chain's receiver 1,
/// the run's receiver 3) are killed mid-run: the first rejoins by a full copy over the channel, the second by
/// the chain's syncer. Every sync is verified (one checksum: every rollout holds what the channel's hold), the
/// restarts are counted and nothing is left.
#[test]
fn the_gpu_channel_serves_the_trainers_host_and_the_chain_the_others() {
    gpu_channel_over_two_hosts("train_embodied", &[]);
}

/// As above with no-wait installs in the background (`train_async`): the channel's syncs return once sent,
/// the chain's rollouts receive on their threads.
#[test]
fn the_gpu_channel_and_the_chain_serve_no_wait_installs() {
    gpu_channel_over_two_hosts("train_async", &["actor.sync_weight_no_wait=true"]);
}

/// Two hosts with two rollouts each over the GPU channel (node 0's) and the TCP chain (node 1's), on the test
/// worker's simulated devices, every sync verified, rollouts restartable.
fn gpu_channel_run(entry: &'static str, extra: &[&str]) -> Run {
    let mut run = Run::new(2);
    run.slots_per_node = 2;
    run.rollout_slots = "0-3".into();
    run.rollouts = 4;
    run.entry = entry;
    run.extra = restarts(2);
    run.extra.extend(extra.iter().map(|x| x.to_string()));
    run.extra.extend(
        [
            "weight_syncer.patch.transport_device=cuda",
            "weight_syncer.patch.snapshot_device=cuda",
            "runner.verify_sync=true",
        ]
        .map(String::from),
    );
    run.env.push((
        "RLSYNC_WORKER".into(),
        util::example("held_worker").display().to_string(),
    ));
    run.env.push(("RLSYNC_TEST_DEVICE".into(), "1".into()));
    run
}

/// A rollout dies in its init bootstrap (held after the plan, before the payloads) on node 0, whose bootstrap
/// the GPU channel then completes, or on node 1, whose bootstrap the chain's syncer runs at the same time: the
/// other bootstrap is not disturbed, the successor rejoins its way, every sync is verified, nothing is left.
#[test]
fn a_rollout_killed_in_the_bootstrap_of_either_host_rejoins_its_way() {
    for (rank, node) in [(1, 0), (3, 1)] {
        let mut run = gpu_channel_run("train_embodied", &[]);
        let held = run.hold(&format!("rollout-{rank}@bootstrap"));
        let steps = 300;
        let mut children = run.start("patch_syncer", steps);
        let pid = run.held_pid(&mut children, &held);
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        let errs = completes(&run, children, steps as usize);
        assert_eq!(restarts_counted(&run), Some(1), "{}", errs[0]);
        logs_the_restart_on(&errs[0], rank, node, pid);
        assert!(
            errs[0].contains(&format!("rollout-{rank} rejoined: caught up by")),
            "{}",
            errs[0]
        );
    }
}

/// No rollout on the trainer's host: the GPU channel would serve nobody, so the run says so and every version
/// goes over the chain (from the trainer's device build); every sync verified.
#[test]
fn the_gpu_channel_without_rollouts_on_the_trainers_host_leaves_it_to_the_chain() {
    let mut run = gpu_channel_run("train_embodied", &[]);
    run.rollout_slots = "2-3".into();
    run.rollouts = 2;
    let steps = 20;
    let children = run.start("patch_syncer", steps);
    let errs = completes(&run, children, steps as usize);
    assert!(
        errs[0].contains("no rollout on the trainer's host for the same-host GPU channel"),
        "{}",
        errs[0]
    );
    let trainer = std::fs::read_to_string(run.run_dir.join("logs/trainer-0.log")).unwrap();
    assert!(
        !trainer.contains("GPU channel") && trainer.contains("simulated device: patch build"),
        "{trainer}"
    );
}

fn gpu_channel_over_two_hosts(entry: &'static str, extra: &[&str]) {
    let run = gpu_channel_run(entry, extra);
    let steps = 300;
    let mut children = run.start("patch_syncer", steps);
    let kills = run.kill_in_turn(&mut children, &[1, 3]);
    let errs = completes(&run, children, steps as usize);
    let node0 = &errs[0];
    assert_eq!(restarts_counted(&run), Some(2), "{node0}");
    logs_the_restart_on(node0, 1, 0, kills[0].1);
    logs_the_restart_on(node0, 3, 1, kills[1].1);
    let trainer = std::fs::read_to_string(run.run_dir.join("logs/trainer-0.log")).unwrap();
    for want in [
        "simulated device: GPU channel sender",
        "weights synced to the other hosts from the device, over the TCP chain",
        "the GPU keeps the channel's): simulated device: patch build",
        "the same-host GPU channel, device to device (",
        "caught up rollout-1 (weight receiver 1): handshake",
        "caught up rollout-3 (weight receiver 3): ",
    ] {
        assert!(
            trainer.contains(want),
            "{want:?} in the trainer's log:\n{trainer}"
        );
    }
    // Node 0's rollouts install over the channel, node 1's patches from the chain.
    let log = |path: &str| std::fs::read_to_string(run.run_dir.join(path)).unwrap();
    for path in ["logs/rollout-0.log", "logs/rollout-1.log"] {
        let log = log(path);
        assert!(
            log.contains("simulated device: GPU channel install"),
            "{path}:\n{log}"
        );
    }
    for path in ["node-1/logs/rollout-2.log", "node-1/logs/rollout-3.log"] {
        let log = log(path);
        assert!(
            !log.contains("GPU channel") && log.contains("simulated device: patch install"),
            "{path}:\n{log}"
        );
    }
}
