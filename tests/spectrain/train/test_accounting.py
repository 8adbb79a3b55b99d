"""Step accounting under fake tensors: FLOPs checked analytically, memory by kind, the plan script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from spectrain.models.layers import MaskSpec, PreparedMask
from spectrain.train.accounting import (
    WorstCaseShapes,
    account_steps,
    fake_tensors,
    mask_pairs,
    measure_mask_density,
)

ROOT = Path(__file__).resolve().parents[3]


class _Net(nn.Module):
    """Linear -> masked causal attention -> Linear, as a draft layer would call attention."""

    def __init__(self, d_in, heads, head_dim, d_out):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.up = nn.Linear(d_in, 3 * heads * head_dim, bias=False)
        self.down = nn.Linear(heads * head_dim, d_out, bias=False)

    def forward(self, x):
        T = x.shape[0]
        q, k, v = self.up(x).view(T, 3, self.heads, self.head_dim).permute(1, 2, 0, 3)
        spec = MaskSpec(T, T, lambda b, h, qi, ki: ki <= qi, x.device)
        o = PreparedMask(spec, "flex")(q, k, v)
        return self.down(o.transpose(0, 1).reshape(T, -1))


def test_flops_and_memory_of_a_small_step_match_the_formulas():
    T, d_in, heads, hd, d_out = 64, 32, 2, 8, 16
    causal = T * (T + 1) // 2
    density = {(T, T): causal / (T * T)}

    def run(step_model, opt, x):
        def step():
            step_model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        return step

    with fake_tensors():
        net = _Net(d_in, heads, hd, d_out)
        opt = torch.optim.AdamW(net.parameters(), fused=True)
        x = torch.randn(T, d_in)
        acct = account_steps(run(net, opt, x), [net, opt, x], density)
    width = 3 * heads * hd
    up = 2 * T * d_in * width
    down = 2 * T * heads * hd * d_out
    # up: forward + weight gradient (x needs none); down: forward + input and weight gradients
    assert acct.matmul_flops == 2 * up + 3 * down
    # attention over the causal pairs: 2 matmuls of 2 FLOPs per pair and head dim, backward twice that
    assert acct.attention_flops == 3 * 4 * heads * hd * causal
    assert acct.attention_flops_dense == 3 * 4 * heads * hd * T * T
    assert acct.flops == acct.matmul_flops + acct.attention_flops
    params = (d_in * width + heads * hd * d_out) * 4
    assert acct.peak_breakdown["Parameter"] == params
    assert acct.peak_breakdown["Optstate"] >= 2 * params  # exp_avg and exp_avg_sq (plus step counters)
    assert acct.peak_bytes >= 3 * params + x.numel() * 4  # weights, moments, input, then activations


def test_worst_case_shapes_keep_every_element():
    with fake_tensors(), WorstCaseShapes():
        m = torch.empty(6, 4, dtype=torch.bool)
        assert tuple(m.nonzero().shape) == (24, 2)
        rows = torch.empty(6, 3)[torch.empty(6, dtype=torch.bool)]
        assert tuple(rows.shape) == (6, 3)
        assert torch.empty(()).item() == 1


def test_mask_pairs_counts_the_mask_and_density_comes_from_a_real_forward():
    spec = MaskSpec(10, 25, lambda b, h, q, k: (k <= q) | (k >= 20), torch.device("cpu"))
    assert mask_pairs(spec, rows=3) == int(spec.dense().sum()) == 55 + 10 * 5
    net = _Net(4, 1, 2, 3)
    density = measure_mask_density(lambda: net(torch.randn(12, 4)))
    assert density == {(12, 12): 78 / 144}


def test_plan_script_runs_through_the_real_drafts():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in
                                                       ("packages/hsgen/src", "packages/spectrain/src"))}  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_train.py"), "--plan", "--tiny"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )  # fmt: skip  (minutes under load)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("dflash", "eagle3"):
        best = res[f"{name}_variants"][res[f"{name}_variant"]]
        assert res[f"{name}_tflop_per_step"] == best["tflop_per_step"]
        assert best["flops"] > 0 and best["peak_bytes"] > 0
        assert 0 < best["attention_flops"] < best["attention_flops_dense"]
        assert "as-is" in res[f"{name}_variants"]
        split = res[f"{name}_muon_split"]
        assert set(split["ns_tflop_per_rank"]) == set(split["rank_tflop_per_step"]) == {"1", "2", "8"}
    assert res["peer"]["dflash_tflop_per_step"] == 84.2
