"""The compile report (`moe_lab.workbench.compile_report.report`): kernels compiled for sm_90 and sm_100
without a GPU, and what is read off the PTX and the cubins.

The reading functions are checked on fixed text; the compile itself on at least one spec
of every kernel module for both architectures (one child process for all of them), where
the report's registers, stack, local and shared memory must equal what ``cuobjdump
-res-usage`` reads off the same cubins, run here on its own, and ptxas's log and the
compiled metadata must agree with them. The full report (every spec) is the ``slow`` test.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import triton
import triton.language as tl

from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import ARCHS as TABLE
from moe_lab.perf.hardware import gpu_arch
from moe_lab.workbench.compile_report import reading
from moe_lab.workbench.compile_report import report as compile_report

# Every module of moe_lab.kernels that launches a kernel of its own (read from the sources,
# so a new kernel file is compiled here without being listed).
KERNEL_MODULES = tuple(sorted(
    f"moe_lab.kernels.{path.stem}"
    for path in (Path(__file__).resolve().parents[3] / "moe_lab" / "kernels").glob("*.py")
    if re.search(r"^@(?:triton\.)?jit\ndef (\w+)\(", path.read_text(encoding="utf-8"), re.MULTILINE)
    and re.search(r"\b_\w+_kernel\[|[(,]\s*_\w+_kernel\s*,", path.read_text(encoding="utf-8"))))
ARCHS = ("sm_90", "sm_100")

# `cuobjdump -res-usage` of a 64x64x32 bf16 tl.dot kernel compiled for sm_90 by Triton 3.7.1.
RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function mm:
  REG:128 STACK:0 SHARED:1024 LOCAL:0 CONSTANT[0]:584 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mm' for 'sm_90a'
ptxas info    : Function properties for mm
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
ptxas info    : Compile time = 21.372 ms
"""
PTX_LOOP = """
$L__BB0_2:
	cp.async.wait_group 	2;
	bar.sync 	0;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2}, %rd1, %rd2, p, 1, 1, 0, 1;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2}, %rd3, %rd4, p, 1, 1, 0, 1;
	add.s32 	%r5, %r5, 1;
	@%p1 cp.async.cg.shared.global [ %r53 + 0 ], [ %rd22 + 0 ], 0x10, %r54;
	cp.async.commit_group;
	setp.lt.s32 	%p2, %r5, %r6;
	@%p2 bra 	$L__BB0_2;
	cp.async.wait_group 	0;
"""


# ------------------------------------------------------------------------------ reading


def test_parse_res_usage_and_ptxas_log():
    assert reading.parse_res_usage(RES_USAGE) == {"mm": {
        "REG": 128, "STACK": 0, "SHARED": 1024, "LOCAL": 0, "CONSTANT[0]": 584, "TEXTURE": 0,
        "SURFACE": 0, "SAMPLER": 0}}
    assert reading.parse_ptxas_log(PTXAS_LOG) == {
        "registers": 128, "stack_bytes": 16, "spill_store_bytes": 8, "spill_load_bytes": 4, "shared_bytes": 0}
    assert reading.parse_res_usage("no functions here") == {}
    with pytest.raises(ValueError, match="ptxas"):
        reading.parse_ptxas_log("nothing")


@pytest.mark.parametrize("line, klass, kind, scaled", [
    ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f1};",
     "mma.sync", "mma.sync m16n8k16 f32.f16.f16.f32", False),
    ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 1;",
     "wgmma", "wgmma m64n64k16 f32.bf16.bf16", False),
    ("@%p13 tcgen05.mma.cta_group::1.kind::f16 [ %r316 + 0 ], %rd72, %rd73, %r161, %p12;",
     "tcgen05.mma", "tcgen05.mma kind::f16", False),
    ("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale [%r1], %rd1, %rd2, %r2, [%r3], [%r4], %p1;",
     "tcgen05.mma", "tcgen05.mma kind::mxf8f6f4 block_scale", True),
    ("fma.rn.f32 %f1, %f2, %f3, %f4;", "none", None, False),
])
def test_mma_class(line, klass, kind, scaled):
    found = reading.mma_instructions(f"\t{line}\n")
    assert found["class"] == klass
    assert found["kinds"] == ([kind] if kind else [])
    assert found["block_scaled"] is scaled


def test_fp8_upcasts_count_cvt_from_an_fp8_type_only():
    ptx = ("\tcvt.rn.f16x2.e4m3x2 %r1, %rs1;\n\tcvt.rn.f16x2.e5m2x2 %r2, %rs2;\n"
           "\tcvt.bf16.f16 %rs3, %rs4;\n\tcvt.rn.satfinite.e4m3x2.f32 %rs5, %f1, %f2;\n")
    assert reading.mma_instructions(ptx)["fp8_upcasts"] == 2  # not to fp8, nor 16 -> 16 bits


def test_async_copies_and_loop_sketch():
    copies = reading.async_copies(PTX_LOOP)
    assert copies["kind"] == "cp.async" and copies["cp_async"] == 1 and copies["commit_groups"] == 1
    assert copies["max_pending_groups"] == 2 and copies["tma"] == 0
    tma = reading.async_copies("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                               "[%r1], [%rd1, {%r2, %r3}], [%r4];\nmbarrier.try_wait.parity.shared::cta.b64 "
                               "p, [%r4], %r5;\n")
    assert tma["kind"] == "TMA" and tma["mbarrier_waits"] == 1
    sketch = reading.loop_sketch(PTX_LOOP)
    assert [reading.opcode(line) for line in sketch] == [
        "cp.async.wait_group", "bar.sync", "wgmma.fence.sync.aligned",
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "cp.async.cg.shared.global",
        "cp.async.commit_group"]
    assert sketch[3].endswith("×2")
    assert reading.loop_sketch("add.s32 %r1, %r1, 1;\n") == []


def test_occupancy_is_the_minimum_over_the_limits():
    h200 = gpu_arch("sm_90")
    assert h200.reserved_shared_per_block == 1024 and h200.capability == 90
    # 128 registers x 4 warps: 16K registers per block -> 4 blocks; shared and warps allow more.
    occ = reading.occupancy(128, 24576, 4, h200)
    assert (occ["blocks_per_sm"], occ["warps_per_sm"], occ["limiter"]) == (4, 16, "registers")
    assert occ["by_shared"] == 228 * 1024 // (24576 + 1024) and occ["by_warps"] == 16
    # 22 registers round up to 768 per warp: 85 warps' worth, so the 64-warp limit binds.
    assert reading.occupancy(22, 0, 4, h200)["limiter"] == "warps"
    # 1 warp per block of 32 registers: the 32-block limit binds.
    assert reading.occupancy(32, 0, 1, h200)["limiter"] == "blocks"
    big = reading.occupancy(32, 200 * 1024, 4, h200)
    assert (big["blocks_per_sm"], big["limiter"]) == (1, "shared")
    assert reading.occupancy(32, 227 * 1024 + 1, 4, h200)["blocks_per_sm"] == 0  # cannot launch
    with pytest.raises(ValueError, match="arch must be one of"):
        gpu_arch("sm_70")
    assert set(TABLE) >= set(ARCHS)


def test_parse_archs():
    assert compile_report.parse_archs("sm_90, sm_100") == ARCHS
    assert compile_report.parse_archs("sm_80,sm_86,sm_89") == ("sm_80", "sm_86", "sm_89")  # a reader's GPUs
    with pytest.raises(ValueError, match="sm_70"):
        compile_report.parse_archs("sm_70")
    with pytest.raises(ValueError, match="at least one"):
        compile_report.parse_archs(",")
    with pytest.raises(ValueError, match="sm_90 more than once"):
        compile_report.parse_archs("sm_90,sm_100, sm_90")


# ------------------------------------------------------------------------------ compiling


@pytest.fixture(scope="module")
def first_specs(tmp_path_factory) -> dict:
    """One spec of every kernel module compiled for sm_90 and sm_100, cubins kept: the grouped
    GEMM's first forward spec (a bf16 ``tl.dot``), every other module's first spec."""
    cubins = tmp_path_factory.mktemp("cubins")
    jobs = [compile_report.module_job(module, **({"kernel": "_grouped_gemm_kernel"}
                                                 if module.endswith("grouped_gemm") else {}), limit=1)
            for module in KERNEL_MODULES]
    return {"rows": compile_report.compile_jobs(*jobs, archs=ARCHS, cubin_dir=cubins)}


def _cuobjdump(cubin: str) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {name: int(value) for name, value in fields.items()}


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_every_kernel_module_compiles_for_hopper_and_blackwell(first_specs, module):
    rows = [row for row in first_specs["rows"] if row["kernel"].partition(":")[0] == module]
    problems = [row["error"] for row in rows if row.get("error")]
    assert not problems, f"{module}: {problems}"
    assert sorted(row["arch"] for row in rows) == sorted(ARCHS), f"{module}: no compiled rows"
    for row in rows:
        # The acceptance: the report's figures are what cuobjdump reads off the same cubin.
        usage = _cuobjdump(row["cubin"])
        assert (row["registers"], row["stack_bytes"], row["shared_static"], row["local_bytes"]) == (
            usage["REG"], usage["STACK"], usage["SHARED"], usage["LOCAL"]), row["kernel"]
        # ...and ptxas's log and Triton's metadata of the same compile say the same.
        assert row["agree"], row["checks"]
        assert row["registers"] == row["ptxas"]["registers"] and row["spill_bytes"] == row["ptxas"][
            "spill_store_bytes"]
        assert row["shared_bytes"] == row["shared_static"] + row["shared_dynamic"]
        assert 0 < row["registers"] <= 255 and row["compile_s"] > 0
        assert 0 <= row["blocks_per_sm"] <= 32
        assert row["warps_per_sm"] == row["blocks_per_sm"] * row["block_warps"]
        assert row["block_warps"] == row["num_warps"] or row["warp_specialized"]
        assert row["persistent"] == (module == "moe_lab.kernels.grouped_gemm_tma")  # the one persistent grid


def test_a_tl_dot_kernel_uses_wgmma_on_hopper_and_tcgen05_on_blackwell(first_specs):
    gemm = {row["arch"]: row for row in first_specs["rows"]
            if row["kernel"].partition(":")[0] == "moe_lab.kernels.grouped_gemm" and not row.get("error")}
    assert gemm["sm_90"]["mma_class"] == "wgmma", gemm["sm_90"]["mma_kinds"]
    assert gemm["sm_100"]["mma_class"] == "tcgen05.mma", gemm["sm_100"]["mma_kinds"]
    assert any(line.startswith("wgmma.mma_async") for line in gemm["sm_90"]["loop"])


@triton.jit
def _probe_dot(a_ptr, b_ptr, c_ptr, K, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn, rk = tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        acc = tl.dot(a, tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :]), acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def test_an_inline_kernel_is_sent_as_source():
    """A kernel defined outside moe_lab (a notebook's, this test's) compiles from its source;
    sizes marked ':16' let Triton vectorise, so its loads become pipelined cp.async copies."""
    rows = compile_report.compile_jobs(compile_report.kernel_job(
        _probe_dot, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "K": "i32:16", "N": "i32:16"},
        {"BM": 64, "BN": 64, "BK": 32}, LaunchConfig(num_warps=4, num_stages=3), label="probe"))
    by_arch = {row["arch"]: row for row in rows}
    assert by_arch["sm_90"]["mma_class"] == "wgmma" and by_arch["sm_100"]["mma_class"] == "tcgen05.mma"
    for row in rows:
        assert row["kernel"] == "<inline>:_probe_dot" and row["agree"], row
        assert row["async_copy"] == "cp.async" and row["copies"]["max_pending_groups"] >= 1
        assert row["divisible_by_16"] == ["a_ptr", "b_ptr", "c_ptr", "K", "N"]
    text = compile_report.format_rows_with_loop(rows)
    assert "wgmma.mma_async" in text and "tcgen05.mma" in text
    with pytest.raises(ValueError, match="kernel must be"):
        compile_report.kernel_job(len, {})


def test_compile_errors_are_rows_not_crashes(capsys):
    rows = compile_report.compile_jobs(
        compile_report.kernel_job(_probe_dot, {"a_ptr": "*bf16"}, {"BM": 64}),
        compile_report.module_job("moe_lab.kernels.launch"),
        compile_report.module_job("moe_lab.kernels.permute", label_contains="no such label"),
        archs=("sm_90",))
    assert "no type or constexpr value for argument 'b_ptr'" in rows[0]["error"]
    assert rows[1]["error"].startswith("moe_lab.kernels.launch has no compile specs")
    assert rows[2]["error"].startswith("no CompileSpec of moe_lab.kernels.permute matches")
    assert len(rows) == 3
    # The progress lines are output (in a notebook, not rendered as an error), one per row.
    out, err = capsys.readouterr()
    assert err == "" and out.count("[") >= 1 and "_probe_dot" in out


# ------------------------------------------------------------------------------ the command


def _fake_report(archs, modules=None, select=None, cubin_dir=None) -> dict:
    row = {"kernel": "moe_lab.kernels.demo:_k", "label": "demo", "arch": "sm_90", "gpu": "H200 SXM",
           "blocks": {"BLOCK": 64}, "num_warps": 4, "num_stages": 3, "registers": 40, "spill_bytes": 0,
           "stack_bytes": 0, "local_bytes": 0, "shared_static": 0, "shared_dynamic": 0, "shared_bytes": 0,
           "blocks_per_sm": 16, "warps_per_sm": 64, "occupancy": 1.0, "limiter": "warps",
           "mma_class": "none", "mma_kinds": [], "async_copy": "none",
           "copies": {"max_pending_groups": 0}, "loop": [], "compile_s": 0.1, "agree": True, "error": None,
           "has_dot": False, "note": ""}
    return {"archs": list(archs), "triton": triton.__version__, "compiled_on": "test",
            "limits": {"sm_90": {"gpu": "H200 SXM", "registers_per_sm": 65536, "max_warps_per_sm": 64,
                                 "max_blocks_per_sm": 32, "shared_per_sm": 228 * 1024}},
            "rows": [row]}


def test_cli_json_files_and_ledger(monkeypatch, tmp_path, capsys):
    from moe_lab.__main__ import main
    from moe_lab.workbench.measure import ledger

    monkeypatch.setattr(compile_report, "compile_report", _fake_report)
    before = len(ledger.read())
    assert main(["compile", "--arch", "sm_90", "--json", "--out", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"archs", "triton", "limits", "rows"} and report["archs"] == ["sm_90"]
    assert report["rows"][0]["registers"] == 40
    assert json.loads((tmp_path / "sm_90.json").read_text())["rows"] == report["rows"]
    assert "| moe_lab" not in (tmp_path / "summary.md").read_text()  # short kernel names
    assert "demo:_k — demo" in (tmp_path / "summary.md").read_text()
    new = ledger.read()[before:]
    assert [(r["notebook"], r["metric"], r["value"], r["arch"], r["kind"]) for r in new] == [
        ("compile", "warps_per_sm", 64, "sm_90", "compiled")]
    assert main(["compile", "--arch", "sm_90", "--out", str(tmp_path)]) == 0
    assert "demo:_k — demo" in capsys.readouterr().out


@pytest.mark.slow
def test_full_report_every_kernel_compiles(tmp_path, capsys):
    """`python -m moe_lab compile --json`: every spec of every kernel module, both archs. The
    command runs in this process (its compiles in their own child, as always), so the tables it
    writes after the reports share this worker's traffic simulations with test_roofline.py and
    test_traffic_table.py (conftest.py keeps the three on one worker)."""
    from moe_lab.__main__ import main

    status = main(["compile", "--json", "--out", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    failed = [(row["kernel"], row.get("arch"), row.get("error") or row.get("checks"))
              for row in report["rows"] if row.get("error") or not row.get("agree")]
    assert not failed and status == 0, failed
    assert {row["kernel"].partition(":")[0] for row in report["rows"]} == set(KERNEL_MODULES)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "roofline.md", "sm_100.json", "sm_90.json", "summary.md", "traffic.md"]
    # The targets: a GEMM-like kernel on the tensor cores of each arch, fed by async copies
    # pipelined over >= 2 stages, nothing spilled — or its spec says why not.
    unexplained = [(row["label"][:80], row["arch"], compile_report.off_target(row))
                   for row in report["rows"] if compile_report.off_target(row) and not row["note"]]
    assert not unexplained, unexplained
    for row in report["rows"]:
        if row["has_dot"] and row["mma_kinds"]:
            assert row["mma_class"] == {"sm_90": "wgmma", "sm_100": "tcgen05.mma"}[row["arch"]], row["label"]
            # pipelined: cp.async waits that leave groups in flight, or TMA with an mbarrier per stage
            copies = row["copies"]
            assert row["num_stages"] >= 2 and (copies["max_pending_groups"] >= 1 or (
                row["async_copy"] == "TMA" and copies["mbarrier_inits"] >= row["num_stages"])), row["label"]
    # Native MXFP8: the GEMM and the recipe's attention (P quantized) on block-scaled MMA.
    blackwell = [row for row in report["rows"] if row["arch"] == "sm_100"]
    for module in ("moe_lab.kernels.mx_gemm", "moe_lab.kernels.mx_attention"):
        rows = [row for row in blackwell if row["kernel"].startswith(module + ":")
                and row["constexprs"].get("QUANT_P", True)]
        assert rows and all(row["block_scaled"] for row in rows), module
    assert "## Off target, and why" in (tmp_path / "summary.md").read_text()


def test_off_target_rows_name_their_misses():
    row = {"spill_bytes": 40, "has_dot": True, "mma_kinds": [], "async_copy": "none"}
    assert compile_report.off_target(row) == ["40 B spilled", "no tensor cores"]
    assert compile_report.off_target({**row, "spill_bytes": 0, "mma_kinds": ["wgmma"]}) == ["no async copy"]
    assert compile_report.off_target({**row, "error": "boom"}) == []
    listed = compile_report.exceptions_markdown([{**row, "kernel": "m.k:_k", "label": "x", "arch": "sm_90",
                                                  "note": "by design"}])
    assert listed.startswith("- by design\n  - k:_k — x [sm_90]: 40 B spilled, no tensor cores")
    assert "no reason recorded" in compile_report.exceptions_markdown(
        [{**row, "kernel": "m.k:_k", "label": "x", "arch": "sm_90", "note": ""}])


def test_the_kernel_list_holds_every_kernel_file():
    assert {"moe_lab.kernels.fused_router", "moe_lab.kernels.grouped_gemm", "moe_lab.kernels.mx_quantize",
            "moe_lab.kernels.mx_attention", "moe_lab.kernels.mx_gemm", "moe_lab.kernels.fused_moe",
            "moe_lab.kernels.fused_mxfp8", "moe_lab.kernels.permute"} <= set(KERNEL_MODULES)
    # the shared @jit helpers are called by kernels, never launched: no specs of their own
    helpers = {"moe_lab.kernels.launch", "moe_lab.kernels.common", "moe_lab.kernels.fusions"}
    assert not helpers & set(KERNEL_MODULES)
