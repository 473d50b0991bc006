#!/usr/bin/env python3
"""Assemble the committed PTX (crates/rlsync-core/kernels/rlsync.ptx) with a pinned ptxas, without a GPU.

What a driver does to the PTX at load time (JIT it for the device's architecture) is done here ahead of time
for sm_80 (A100, the PTX's target) and sm_90 (H100): a PTX the assembler rejects would make every CUDA path
of rlsync fail on the first `Gpu::open` (the whole module is one image), which no CPU test sees otherwise.
Per kernel it prints the registers, stack and spills; it fails on an assembler error, on a kernel missing
from the output, or on a spill for sm_90 (the kernels' register budgets were fitted there: rlsync.cu's
`__launch_bounds__` comments).

ptxas comes from the pip wheel nvidia-cuda-nvcc-cu12==12.4.131 (the release of the pinned NVRTC, 12.4;
`make ptxas` installs it under ~/.cache/rlsync/ptxas-12.4.131). Stdlib only.

Usage: ptxas_check.py [--ptxas PATH]
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RELEASE = "12.4.131"
ROOT = Path(__file__).resolve().parent.parent
PTX = ROOT / "crates/rlsync-core/kernels/rlsync.ptx"
ARCHS = ("sm_80", "sm_90")
NO_SPILLS = "sm_90"


def default_ptxas() -> Path:
    cache = Path(os.environ.get("RLSYNC_CACHE", Path.home() / ".cache/rlsync"))
    return cache / f"ptxas-{RELEASE}" / "nvidia/cuda_nvcc/bin/ptxas"


def entries(ptx: str) -> list[str]:
    return re.findall(r"^\.visible \.entry (\w+)\(", ptx, flags=re.M)


def assemble(ptxas: Path, arch: str) -> dict[str, dict[str, int]]:
    """ptxas -v for `arch`: per entry function, registers, stack frame and spill bytes."""
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(PTX), "-o", str(Path(d) / "rlsync.cubin")],
                           capture_output=True, text=True, timeout=300)
    log = p.stdout + p.stderr
    if p.returncode != 0:
        sys.exit(f"ptxas_check: ptxas -arch={arch} rejected {PTX.relative_to(ROOT)}:\n{log[-4000:]}")
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            out[name] = {}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["registers"] = int(m.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ptxas", type=Path, default=None, help="the ptxas binary (default: `make ptxas`'s)")
    args = ap.parse_args()
    ptxas = args.ptxas or default_ptxas()
    if not ptxas.is_file():
        sys.exit(f"ptxas_check: no ptxas {RELEASE} at {ptxas} (run `make ptxas`)")
    want = entries(PTX.read_text())
    if not want:
        sys.exit(f"ptxas_check: {PTX.relative_to(ROOT)} defines no kernel")
    failures = []
    for arch in ARCHS:
        got = assemble(ptxas, arch)
        for name in want:
            k = got.get(name)
            if not k or "registers" not in k:
                failures.append(f"{arch}: {name} missing from ptxas's output")
                continue
            spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
            print(f"ptxas_check: {arch} {name}: {k['registers']} registers, {k.get('stack', 0)} bytes stack, "
                  f"{spill} bytes spilled")
            if arch == NO_SPILLS and spill:
                failures.append(f"{arch}: {name} spills {spill} bytes")
    if failures:
        sys.exit("ptxas_check: " + "; ".join(failures))
    print(f"ptxas_check: {len(want)} kernels assemble for {', '.join(ARCHS)} (ptxas {RELEASE})")


if __name__ == "__main__":
    main()
