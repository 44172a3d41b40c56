"""bench/fp8_variants.py: each variant builds the precision it names through dtrain's own
options (and runs, small and eager, on the CPU); the GPU call it is written for gets one try."""

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, cli_env

sys.path.insert(0, str(ROOT / "bench"))
import fp8_variants as fv  # noqa: E402

from dtrain.model import ModelConfig, build_model  # noqa: E402


def _fp8(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


def test_each_variant_builds_what_it_names(monkeypatch):
    pytest.importorskip("torchao")
    import torchao.float8 as f8

    # the gwbf16 variant patches torchao's recipe: put it back after the test
    monkeypatch.setattr(
        f8.Float8LinearConfig, "from_recipe_name", f8.Float8LinearConfig.from_recipe_name
    )
    cfg = ModelConfig(n_layer=1, n_head=4, d_model=64, vocab_size=96, tie_embeddings=True)
    cpu = torch.device("cpu")
    built = {}
    for name in (
        "bf16",
        "fp8",
        "fp8_head",
        "fp8_fastacc",
        "fp8_fastgi",
        "fp8_head_fastgi",
        "fp8_gwbf16",
        "fp8_delayed",
    ):
        model = build_model(cfg, cpu)
        fv.build_variant(name, model, cpu)
        built[name] = _fp8(model)
    assert built["bf16"] == {} and len(built["fp8"]) == 7 and built["fp8_delayed"] == {}
    # the base of the others is dynamic scaling; fp8_delayed builds dtrain's delayed linears
    model = build_model(cfg, cpu)
    delayed = fv.build_variant("fp8_delayed", model, cpu)
    dynamic = fv.build_variant("fp8", build_model(cfg, cpu), cpu)
    assert (delayed.fp8_scaling, dynamic.fp8_scaling) == ("delayed", "dynamic")
    assert sum(type(m).__name__ == "DelayedFloat8Linear" for m in model.modules()) == 7
    assert set(built["fp8_head"]) == set(built["fp8"]) | {"output"}
    assert set(built["fp8_head_fastgi"]) == set(built["fp8_head"])
    for name, mods in built.items():
        for m in mods.values():
            c = m.config
            assert c.gemm_config_grad_weight.use_fast_accum is (name == "fp8_fastacc")
            assert c.gemm_config_grad_input.use_fast_accum is ("fast" in name)
            off = c.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
            assert off is (name == "fp8_gwbf16")


def test_fp8_variants_smoke_and_bad_name(tmp_path):
    pytest.importorskip("torchao")
    out = tmp_path / "v.jsonl"
    args = ["--smoke", "--layers", "1", "--batch", "2", "--seq", "32", "--iters", "1"]
    res = subprocess.run(
        [sys.executable, "bench/fp8_variants.py", "--variants", "bf16,fp8,fp8_head", *args]
        + ["--out", out],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["bf16", "fp8", "fp8_head"]
    assert [r["fp8_linears"] for r in rows] == [0, 7, 8]
    assert all(r["ms_fwd_bwd"] > 0 for r in rows)
    bad = subprocess.run(
        [sys.executable, "bench/fp8_variants.py", "--variants", "fp8,fp9"],
        cwd=ROOT,
        env=cli_env(),
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "fp9" in bad.stdout and "fp8_head" in bad.stdout
