//! Weight sync over the TCP chain between nodes: a synthetic bf16 model, bucket or patch sync from node 0
//! (the trainer, no local rollout) along node 1 -> node 2 -> ..., one rollout per further node.
//!
//! ```text
//! # every node in this process, on 127.0.0.1 (a check of the pipeline; loopback is not a network):
//! cargo run --release --example chain_bench -- loopback --nodes 5 --mib 512 --syncer bucket
//! # one node per process (what scripts/netns_chain_bench.sh runs, one per network namespace):
//! chain_bench node --rank K --listen IP:PORT --next IP:PORT|- --mib 512 --syncer bucket|patch --steps 3
//! ```
//! Node 0 prints one JSON line per sync (`ms`, payload bytes, effective GB/s) and its state checksum; every
//! other node prints the checksum its rollout reached per version, so the runner can check them all equal.
//! The run token comes from `RLSYNC_RUN_TOKEN` (or a fixed test token).

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use rlsync::config::schema::{SyncerKind, WeightSyncerConfig};
use rlsync_core::syncer::{SyncOptions, WeightSyncer};
use rlsync_core::tensor::DType;
use rlsync_core::tensor::synthetic::{ModelSpec, SyntheticModel, UpdateMode};
use rlsync_core::transport::{ChainConfig, ChainRelay, ChainSender, inproc_channel_with_timeout};
use tokio::net::TcpListener;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Clone)]
struct Opts {
    mib: u64,
    steps: u64,
    syncer: SyncerKind,
    part_bytes: usize,
    token: Vec<u8>,
}

fn spec(o: &Opts) -> ModelSpec {
    ModelSpec {
        params: o.mib * (1 << 20) / 2,
        tensors: 64,
        dtype: DType::Bf16,
        frozen_fraction: 0.0,
        seed: 11,
    }
}

fn syncer_cfg(o: &Opts) -> WeightSyncerConfig {
    WeightSyncerConfig {
        kind: o.syncer,
        ..WeightSyncerConfig::default()
    }
}

fn chain_cfg(o: &Opts, name: String) -> ChainConfig {
    ChainConfig {
        token: o.token.clone(),
        name,
        part_bytes: o.part_bytes,
        timeout: Duration::from_secs(120),
    }
}

/// Node 0: the trainer's syncer over the chain, no local rollout.
async fn head(o: Opts, next: String) -> Res<()> {
    let mut model = SyntheticModel::new(spec(&o))?;
    let mut state = model.state_dict()?;
    let tx = WeightSyncer::from_config(&syncer_cfg(&o), SyncOptions::default())?;
    let ch = ChainSender::connect(None, Some(&next), chain_cfg(&o, "node 0".into())).await?;
    let receivers = ch.receivers();
    let t = Instant::now();
    let (mut tx, _) = tx.init_sender(&state, &state.synced_keys(), ch).await?;
    println!(
        "{{\"node\":0,\"event\":\"init\",\"receivers\":{receivers},\"ms\":{:.1}}}",
        t.elapsed().as_secs_f64() * 1e3
    );
    for v in 1..=o.steps {
        model.step(UpdateMode::Adam { lr: 1e-6 }, &mut state, NonZeroUsize::MIN)?;
        let t = Instant::now();
        let report = tx.sync(&state, v).await?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "{{\"node\":0,\"event\":\"sync\",\"syncer\":\"{:?}\",\"version\":{v},\"ms\":{ms:.1},\"payload_bytes\":{},\"state_bytes\":{},\"gb_per_s\":{:.3},\"checksum\":\"{:016x}\"}}",
            o.syncer,
            report.payload_bytes,
            o.mib << 20,
            report.payload_bytes as f64 / ms / 1e6,
            tx.checksum(&state)?
        );
    }
    Ok(())
}

/// Node k > 0: relay the chain and run one rollout's receiving syncer on this node.
async fn relay(o: Opts, rank: u32, listener: TcpListener, next: Option<String>) -> Res<()> {
    let model = SyntheticModel::new(spec(&o))?;
    let mut state = model.state_dict()?;
    let (local, mut rxs) = inproc_channel_with_timeout(1, Duration::from_secs(120));
    let relay = ChainRelay::establish(
        &listener,
        next.as_deref(),
        local,
        chain_cfg(&o, format!("node {rank}")),
    )
    .await?;
    let serving = tokio::spawn(relay.serve());
    let rx = WeightSyncer::from_config(&syncer_cfg(&o), SyncOptions::default())?;
    let ch = rxs.pop().ok_or("no local receiver")?;
    let (mut rx, _) = rx.init_receiver(&mut state, ch).await?;
    for _ in 1..=o.steps {
        let r = rx.apply(&mut state).await?;
        println!(
            "{{\"node\":{rank},\"event\":\"applied\",\"version\":{},\"checksum\":\"{:016x}\"}}",
            r.version,
            rx.checksum(&state)
        );
    }
    drop(rx);
    serving.await??;
    Ok(())
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("loopback");
    let num = |name: &str, default: u64| -> Res<u64> {
        Ok(arg(&args, name)
            .map(str::parse)
            .transpose()?
            .unwrap_or(default))
    };
    let o = Opts {
        mib: num("--mib", 64)?,
        steps: num("--steps", 3)?,
        syncer: match arg(&args, "--syncer").unwrap_or("bucket") {
            "patch" => SyncerKind::Patch,
            "bucket" => SyncerKind::Bucket,
            other => return Err(format!("--syncer {other}: bucket or patch").into()),
        },
        part_bytes: num("--part-bytes", 256 << 10)? as usize,
        token: std::env::var("RLSYNC_RUN_TOKEN")
            .unwrap_or_else(|_| "chain-bench-token".into())
            .into_bytes(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        match mode {
            "loopback" => {
                let nodes = num("--nodes", 3)? as usize;
                let mut listeners = Vec::new();
                for _ in 1..nodes {
                    listeners.push(TcpListener::bind("127.0.0.1:0").await?);
                }
                let addrs: Vec<String> = listeners
                    .iter()
                    .map(|l| l.local_addr().map(|a| a.to_string()))
                    .collect::<Result<_, _>>()?;
                let mut tasks = Vec::new();
                for (i, l) in listeners.into_iter().enumerate() {
                    let next = addrs.get(i + 1).cloned();
                    tasks.push(tokio::spawn(relay(o.clone(), i as u32 + 1, l, next)));
                }
                head(
                    o,
                    addrs.first().cloned().ok_or("--nodes must be at least 2")?,
                )
                .await?;
                for t in tasks {
                    t.await??;
                }
                Ok(())
            }
            "node" => {
                let rank = num("--rank", 0)? as u32;
                let next = arg(&args, "--next")
                    .filter(|n| *n != "-")
                    .map(str::to_owned);
                if rank == 0 {
                    head(o, next.ok_or("node 0 needs --next")?).await
                } else {
                    let listen = arg(&args, "--listen").ok_or("--listen IP:PORT")?;
                    let listener = TcpListener::bind(listen).await?;
                    relay(o, rank, listener, next).await
                }
            }
            other => Err(format!("unknown mode {other}: loopback or node").into()),
        }
    })
}
