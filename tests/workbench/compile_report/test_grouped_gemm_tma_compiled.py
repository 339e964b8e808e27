"""The persistent TMA grouped GEMM (moe_lab.kernels.grouped_gemm_tma) as CUDA compiles it, no GPU
needed: its specs (`moe_lab.workbench.compile_report.specs.grouped_gemm_tma`) describe every launch,
and compiled for sm_90 and sm_100 the kernel copies its tiles with TMA (``cp.async.bulk.tensor``,
loads and a store, through descriptors it builds itself: ``tensormap.replace``), waits on mbarriers,
keeps >= 3 stages of operand tiles in shared memory, walks its tiles in a loop strided by the
number of programs (a persistent grid), spills nothing, and is warp-specialised on sm_100 only.

One child process (``TRITON_INTERPRET=0``, a fresh Triton cache) compiles the DeepSeek-V3 forward
and dX of each architecture's own launch as the compile report does
(`moe_lab.workbench.compile_report.worker.compile_spec`: its row, ptxas's spill count among it)
and reads the same compilation's Triton IR and PTX back from the cache: four compiles.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from support import checked_compile_specs

from moe_lab.config import preset
from moe_lab.kernels import grouped_gemm_tma as tma
from moe_lab.kernels.grouped_gemm import tile_group
from moe_lab.workbench.compile_report import reading
from moe_lab.workbench.compile_report.specs import SPEC_PRESETS, SPEC_TOKENS
from moe_lab.workbench.compile_report.specs.grouped_gemm_tma import LAUNCHES, PER_TILE

COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_lab.workbench.compile_report.specs import for_module
from moe_lab.workbench.compile_report.worker import compile_spec, triton_signature
from moe_lab.workbench.compile_report.specs.grouped_gemm_tma import LAUNCHES

out = []
for index, spec in enumerate(for_module("moe_lab.kernels.grouped_gemm_tma")):
    arch = spec.label[1:].split(" launch")[0]
    if "DeepSeek-V3" not in spec.label or arch not in LAUNCHES:
        continue
    kernel = getattr(importlib.import_module(spec.kernel.split(":")[0]), spec.kernel.split(":")[1])
    row = compile_spec(kernel, spec, arch)
    sig, constexprs, attrs, _ = triton_signature(kernel, spec.kernel, spec.signature, spec.constexprs)
    compiled = triton.compile(  # the same compilation again: from the cache
        ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", int(arch[3:]), 32),
        options={"num_warps": spec.config.num_warps, "num_stages": spec.config.num_stages})
    out.append({"index": index, "arch": arch, "row": row,
                **{k: compiled.asm[k] for k in ("ttir", "ttgir", "ptx")}})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    cache = tmp_path_factory.mktemp("triton_cache")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache),
           "TRITON_DUMP_PTXAS_LOG": "1"}
    env.pop("TRITON_ALWAYS_COMPILE", None)
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_specs_describe_each_launch():
    specs = checked_compile_specs(tma)
    labels = [s.label for s in specs]
    groups = {model: tile_group(SPEC_TOKENS * preset(name).moe.top_k, preset(name).moe.n_experts,
                                tma.launch_config(1, 1, 1, 1, interpreted=False).blocks["BLOCK_M"])
              for name, model in SPEC_PRESETS.items()}
    for spec in specs:
        arch = spec.label[1:].split(" launch")[0]
        assert spec.constexprs["WARP_SPECIALIZE"] == LAUNCHES[arch], spec.label
        assert spec.constexprs["TRANS_W"] == ("dX" in spec.label), spec.label
        assert spec.config == tma.launch_config(1, 1, 1, 1, interpreted=False) and spec.config.num_stages >= 3
        model = next(m for m in groups if m in spec.label)
        assert spec.constexprs["GROUP_M"] == groups[model], spec.label  # as the wrapper picks it
    for model in SPEC_PRESETS.values():
        for arch in LAUNCHES:
            for what in ("forward (up/gate", "forward (down", "dX = dY·Wᵀ (TRANS_W; up/gate",
                         "dX = dY·Wᵀ (TRANS_W; down"):
                assert any(f"[{arch} launch" in label and what in label and model in label
                           for label in labels), (arch, what, model)


def test_tma_mbarriers_stages_persistent_grid_and_no_spills(compiled):
    assert sorted((c["arch"], c["row"]["constexprs"]["TRANS_W"]) for c in compiled) == [
        ("sm_100", False), ("sm_100", True), ("sm_90", False), ("sm_90", True)]
    for c in compiled:
        row, ptx, what = c["row"], c["ptx"], (c["arch"], c["row"]["label"][:60])
        assert row["error"] is None and row["spill_bytes"] == 0 and row["local_bytes"] == 0, what
        ops = [reading.opcode(line) for line in reading.instructions(ptx)]
        loads = sum(op.startswith("cp.async.bulk.tensor.2d.shared::cta.global") for op in ops)
        stores = sum(op.startswith("cp.async.bulk.tensor.2d.global.shared::cta") for op in ops)
        assert loads >= 2 and stores >= 1 and row["async_copy"] == "TMA", (what, loads, stores)
        assert row["copies"]["cp_async"] == 0, what  # no per-thread copies left
        assert row["copies"]["mbarrier_inits"] > 0 and row["copies"]["mbarrier_waits"] > 0, what
        # three descriptors (x, w[e], y) written on the device for each tile, each released to
        # global memory and acquired before use: what the spec's label says (PER_TILE)
        assert sum(op.startswith("tensormap.replace.tile.global_address") for op in ops) == 3, what
        assert sum(op.startswith("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release")
                   for op in ops) == 3, what
        assert sum(op.startswith("fence.proxy.tensormap::generic.acquire") for op in ops) == 3, what
        assert PER_TILE in row["label"], what
        mma = "wgmma" if c["arch"] == "sm_90" else "tcgen05.mma"
        assert row["mma_class"] == mma and all("bf16" in k or "f16" in k for k in row["mma_kinds"]), what
        # >= 3 stages of both operand tiles in shared memory (bf16: 2 bytes)
        b = row["blocks"]
        stage = (b["BLOCK_M"] * b["BLOCK_K"] + b["BLOCK_K"] * b["BLOCK_N"]) * 2
        assert row["num_stages"] >= 3 and row["shared_bytes"] >= row["num_stages"] * stage, what
        assert row["copies"]["mbarrier_inits"] >= row["num_stages"], what  # one per stage, at least
        # persistent: the tile loop starts at the program id and steps by the number of programs
        pid = re.search(r"(%\w+) = tt\.get_program_id x", c["ttir"]).group(1)
        programs = re.search(r"(%\w+) = tt\.get_num_programs x", c["ttir"]).group(1)
        assert re.search(rf"scf\.for %\w+ = {pid} to %\w+ step {programs} ", c["ttir"]), what
        assert "%nctaid.x" in ptx and row["persistent"], what
        # warp specialisation: on sm_100 (a partition per role, registers moved between them)
        specialised = "ttg.warp_specialize" in c["ttgir"] and "setmaxnreg" in ptx
        assert specialised == (c["arch"] == "sm_100") == row["warp_specialized"], what
        # ... whose partitions' warps the block holds besides the config's, and the occupancy counts
        assert (row["block_warps"] > row["num_warps"]) == specialised and row["agree"], (what, row["checks"])
        assert row["warps_per_sm"] == row["blocks_per_sm"] * row["block_warps"], what
