"""The package as a user installs it: a wheel built from this repository, installed into a fresh venv that is not
the development one, imported from outside the source tree, syncs a torch module."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

SMOKE = textwrap.dedent(
    """
    import asyncio, pydoc, torch, rlsync

    assert rlsync.__file__.startswith(FRESH), rlsync.__file__
    assert "PatchWeightSyncer" in pydoc.render_doc(rlsync)

    async def main():
        torch.manual_seed(0)
        trainer, rollout = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
        down, up = asyncio.Queue(), asyncio.Queue()
        tx = rlsync.PatchWeightSyncer(compression_algorithm="lz4", init_sync_enabled=True)
        rx = rlsync.PatchWeightSyncer(compression_algorithm="lz4", init_sync_enabled=True)
        names = rlsync.param_names_need_sync(trainer)
        await asyncio.gather(
            tx.init_sender(trainer.state_dict(), names, down.put, up.get),
            rx.init_receiver(rollout.state_dict(), down.get, up.put),
        )
        with torch.no_grad():
            trainer.weight[0, :3] += 1.0
        await tx.sync(trainer.state_dict(), down.put, 1)
        assert await rx.apply(rollout, down.get) == 1
        assert torch.equal(trainer.weight, rollout.weight)

    asyncio.run(main())
    print("installed rlsync synced version 1")
    """
)


def test_a_built_wheel_installs_and_works_in_a_fresh_venv(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    env = dict(os.environ, VIRTUAL_ENV=str(VENV_BIN.parent))
    subprocess.run(
        [VENV_BIN / "maturin", "build", "--release", "--locked", "-q", "-m", REPO / "python" / "Cargo.toml",
         "-o", wheels],
        check=True,
        env=env,
    )
    (wheel,) = wheels.glob("rlsync-*-abi3-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    # Type checkers see the native module's stubs and the package's own hints (PEP 561).
    assert {"rlsync/_native.pyi", "rlsync/py.typed", "rlsync/checkpoint.py", "rlsync/worker.py"} <= names, names

    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", fresh], check=True)
    python = fresh / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps", wheel],
        check=True,
    )
    # The user's venv has its own torch; here the development venv's site-packages lend theirs (added after the
    # fresh venv's own site-packages, and without processing its .pth files, so its editable rlsync is not seen).
    fresh_site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(fresh_site, "zz_torch_from_dev_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    out = subprocess.run(
        [python, "-c", f"FRESH = {str(fresh)!r}\n" + SMOKE],
        cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "installed rlsync synced version 1" in out.stdout
