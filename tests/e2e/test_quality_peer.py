"""The quality benchmark's peer (``scripts/quality_peer.py``): speculators 0.9.0's own trainer on
exactly our samples, and the paired statistics that compare it with ours (issue 31).

The data the peer's own dataset class reads back is the store's, bit for bit, row for row, and its
own train/validation split trains on exactly our training samples; its trainer, run as its CLI runs
it (with the named CPU changes), trains a DFlash and a DSpark draft (issue 32) that ``spectrain eval``
decodes exactly; the paired bootstrap gives zero for a draft against itself and the sign and size of a known difference.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import quality_stats  # noqa: E402
from quality_peer import write_peer_data  # noqa: E402
from quality_sizes import SIZES  # noqa: E402
from quality_steps import evaluate_draft, generate_hidden_states  # noqa: E402

pytest.importorskip("speculators.train.data", reason="scripts/install.sh installs speculators 0.9.0")

LAYERS = [1, 2, 3, 4]
VAL = 0.2


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir) -> Path:
    """A store of 24 samples of the tiny verifier (prompt untrained, continuation trained)."""
    work = tmp_path_factory.mktemp("peer-store")
    rng = random.Random(0)
    with open(work / "train.jsonl", "w") as f:
        for i in range(24):
            n, p = rng.randrange(40, 90), rng.randrange(5, 20)
            ids = [rng.randrange(10, 1000) for _ in range(n)]
            f.write(
                json.dumps({"id": f"s{i:03d}", "input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)}) + "\n"
            )
    return generate_hidden_states(tiny_model_dir, work / "train.jsonl", LAYERS, work, "cpu", in_process=True)


def test_the_peers_own_dataset_reads_our_samples_bit_for_bit_and_trains_on_ours(store, tmp_path):
    from speculators.train.data import ArrowDataset

    from hsgen.store import HiddenStateStore
    from spectrain.data.sources import split_of

    out = tmp_path / "peer-data"
    facts = write_peer_data(store, [1, 3, 4], out, VAL)
    ours = HiddenStateStore.open(store)
    train_ids = sorted(i for i in ours.sample_ids() if split_of(i, VAL) == "train")  # our trainer's order
    assert 0 < facts["train_rows"] == len(train_ids) < len(ours.sample_ids())
    peer_train = ArrowDataset(512, out, train_ratio=facts["train_data_ratio"], split="train",
                              hidden_states_dtype=torch.float32, on_missing="raise")  # fmt: skip
    peer_val = ArrowDataset(512, out, train_ratio=facts["train_data_ratio"], split="val",
                            hidden_states_dtype=torch.float32, on_missing="raise")  # fmt: skip
    assert len(peer_train) == len(train_ids) and len(peer_val) == facts["val_rows"]
    assert facts["row_ids"][: len(train_ids)] == train_ids
    for row, sid in enumerate(facts["row_ids"][: len(peer_train)]):
        theirs, sample = peer_train[row], ours.read(sid)
        states = torch.from_numpy(sample.hidden_states)
        assert torch.equal(theirs["hidden_states"], states[:, [0, 2]].flatten(1))  # layers 1 and 3
        assert torch.equal(theirs["verifier_last_hidden_states"], states[:, 3])  # layer 4, the last
        assert torch.equal(theirs["input_ids"], torch.from_numpy(sample.token_ids.astype(np.int64)))
        assert torch.equal(theirs["loss_mask"], torch.from_numpy(sample.loss_mask.astype(np.int64)))


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_the_peers_trainer_trains_a_draft_spectrain_eval_decodes_exactly(
    store, tmp_path, tiny_model_dir, algorithm
):
    from quality_peer import train_peer

    size = dataclasses.replace(SIZES["quick"], draft_epochs=1, draft_seq_len=256, dflash_max_anchors=32,
                               num_eval_prompts=2, eval_new_tokens=12)  # fmt: skip
    final, summary = train_peer(algorithm, size, tiny_model_dir, store, [1, 2, 3], tmp_path, "cpu", 1e-3, VAL)
    assert final == tmp_path / f"peer-train-{algorithm}" / "0"
    assert summary["step"] > 0 and summary["train_flops"] > 0
    # attention counted (torch's counter has no formula for the CPU kernel): at the mask's pairs, and dense
    assert 0 < summary["attention_flops"] < summary["train_flops"] < summary["train_flops_dense_attention"]
    assert {"--draft-attn-impl", "--loss-implementation"} <= set(summary["command"])
    config = json.loads((final / "config.json").read_text())
    # its DSpark samples from the anchor: one slot fewer than DFlash's block proposes the same K tokens
    block = size.dflash_block_size - (algorithm == "dspark")
    assert (config["speculators_model_type"], config["block_size"]) == (algorithm, block)
    assert bool(config.get("sample_from_anchor")) == (algorithm == "dspark")
    assert not (tmp_path / f"peer-data-{algorithm}").exists()  # the copy of the store is removed once trained
    prompts = tmp_path / "eval.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"e{i}", "input_ids": [20 + i, 30, 40, 50]}) + "\n" for i in range(2))
    )
    report = evaluate_draft(final, tiny_model_dir, prompts, size, "cpu")
    assert report["exact_match"] is True and len(report["per_prompt"]) == 2


def test_the_peers_attention_is_counted_over_the_pairs_its_mask_allows():
    from torch.utils.flop_counter import FlopCounterMode

    from quality_peer import attention_formulas

    tally = {"dense": 0.0, "allowed": 0.0}
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (16, 32, 32))
    mask = torch.zeros(1, 1, 16, 32, dtype=torch.bool)
    mask[..., :8] = True  # a quarter of the pairs
    plain = FlopCounterMode(display=False)
    with plain:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    assert plain.get_total_flops() == 0  # why the formulas exist
    counter = FlopCounterMode(display=False, custom_mapping=attention_formulas(tally))
    with counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    dense = (4 + 8) * 2 * 16 * 32 * 8  # forward + backward, heads x q x k x head_dim
    assert counter.get_total_flops() == tally["allowed"] == dense / 4 and tally["dense"] == dense
    causal = {"dense": 0.0, "allowed": 0.0}
    counter = FlopCounterMode(display=False, custom_mapping=attention_formulas(causal))
    with counter:  # sdpa aligns a causal mask top-left: query i sees keys 0..i, 136 of the 16 x 32 pairs
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert counter.get_total_flops() == causal["allowed"] == dense * 136 / 512


def test_ours_stops_at_the_peers_compute(store, tmp_path, tiny_model_dir):
    from quality_draw import _compute_cap
    from quality_steps import train_draft

    size = dataclasses.replace(SIZES["quick"], draft_epochs=3, draft_seq_len=256, dflash_max_anchors=32)
    args = ("dflash", size, tiny_model_dir, store, [1, 2, 3], tmp_path, "cpu")
    _, full = train_draft(*args)
    assert _compute_cap(*args, [], "", {}) == {}
    roomy = _compute_cap(*args, [], "", {"train_flops": 2 * full["train_flops"], "step": full["step"]})
    assert roomy["max_steps"] > full["step"]
    _, uncapped = train_draft(
        *args, ["--max-steps", str(roomy["max_steps"])], "roomy"
    )  # beyond the data: all
    assert uncapped["step"] == full["step"]
    budget = {"train_flops": 0.6 * full["train_flops"], "step": full["step"]}
    cap = _compute_cap(*args, [], "", budget)
    steps = cap["max_steps"]
    assert 0 < steps < full["step"]
    _, capped = train_draft(*args, ["--max-steps", str(steps)], "capped")
    assert capped["step"] == steps and capped["train_flops"] <= budget["train_flops"]
    more = _compute_cap(*args, ["--epochs", "6"], "", budget)  # more epochs than the peer's: still capped
    assert more["max_steps"] == cap["max_steps"]
    assert not list(tmp_path.glob("*probe*"))  # the probe's run is removed


def test_peer_flags_and_default_drafts_include_dspark(tmp_path):
    import bench_quality
    from quality_peer import PEER_ALGORITHMS, peer_flags

    size = SIZES["quick"]

    def flags(algorithm: str) -> list[str]:
        return peer_flags(algorithm, size, tmp_path, tmp_path, tmp_path, [1, 2], 1e-3, 0.9, "float32", "cpu")

    for algorithm, block in (("dflash", size.dflash_block_size), ("dspark", size.dflash_block_size - 1)):
        f = flags(algorithm)
        value = {k: f[f.index(k) + 1] for k in ("--speculator-type", "--block-size", "--num-layers")}
        assert value == {"--speculator-type": algorithm, "--block-size": str(block),
                         "--num-layers": str(size.dflash_layers)}  # fmt: skip
    assert "--block-size" not in flags("eagle3")
    assert PEER_ALGORITHMS == ("dflash", "dspark", "eagle3")
    plan = bench_quality._plan(bench_quality._parser().parse_args(["--peer"]))
    assert plan.ours == bench_quality.ALL_DRAFTS and plan.peer == PEER_ALGORITHMS
    assert plan.match_compute  # ours capped at the peer's compute unless asked not to
    plan = bench_quality._plan(bench_quality._parser().parse_args(["--peer", "--drafts", "dspark"]))
    assert (plan.ours, plan.peer) == (("dspark",), ("dspark",))
    assert not bench_quality._plan(
        bench_quality._parser().parse_args(["--peer", "--no-compute-match"])
    ).match_compute
    assert not bench_quality._plan(bench_quality._parser().parse_args([])).match_compute


def _rows(taus_steps: list[tuple[int, int]]) -> list[dict]:
    return [{"id": f"p{i}", "new_tokens": n, "steps": s} for i, (n, s) in enumerate(taus_steps)]


def test_paired_difference_and_its_interval():
    a = _rows([(30, 10), (40, 10), (20, 10), (35, 10)])
    same = quality_stats.paired(a, a)
    assert same["diff"] == 0 and same["ci"] == [0, 0]
    b = _rows([(20, 10), (30, 10), (10, 10), (25, 10)])  # one token per step fewer on every prompt
    d = quality_stats.paired(a, b)
    assert d["diff"] == pytest.approx(1.0) and d["ci"] == [pytest.approx(1.0), pytest.approx(1.0)]
    noisy = _rows([(20, 10), (45, 10), (10, 10), (30, 10)])
    n = quality_stats.paired(a, noisy)
    assert n["ci"][0] < n["diff"] < n["ci"][1]
    pooled = quality_stats.pooled([(a, b), (a, a)])
    assert pooled["diff"] == pytest.approx(0.5) and pooled["min_diff"] == 0
    with pytest.raises(ValueError, match="not of the same prompts"):
        quality_stats.paired(a, a[:3])


def _draw(seed: int, ours: list[tuple[int, int]], peer: list[tuple[int, int]]) -> dict:
    def result(rows):
        r = _rows(rows)
        tau = sum(x["new_tokens"] for x in r) / sum(x["steps"] for x in r)
        return {
            "tau": tau,
            "per_prompt": r,
            "exact_match": True,
            "acceptance_rate": [0.5],
            "num_speculative_tokens": 1,
        }

    train = {"train_flops": 1e12, "step": 10, "step_time_s": 0.1, "cpu_seconds": 1.0}
    return {"seed": seed, "inputs": {"train_jsonl_sha256": f"t{seed}"}, "eval": {"dflash": result(ours),
            "peer-dflash": result(peer)}, "train": {"dflash": train, "peer-dflash": dict(train)}}  # fmt: skip


def test_merge_pools_draws_run_apart(tmp_path, capsys):
    import bench_quality
    from quality_draw import DrawPlan

    plan = dataclasses.asdict(DrawPlan(ours=("dflash",), peer=("dflash",), match_compute=True))
    runs = {0: _draw(0, [(30, 10), (40, 10)], [(20, 10), (30, 10)]), 1: _draw(1, [(30, 10), (20, 10)],
            [(30, 10), (20, 10)])}  # fmt: skip
    files = []
    for seed, draw in runs.items():
        files.append(tmp_path / f"results-{seed}.json")
        files[-1].write_text(
            json.dumps({"plan": {**plan, "tag": f"t{seed}"}, "draws": [draw], "environment": {}})
        )
    assert bench_quality.main(["--merge", *map(str, reversed(files))]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        final["seeds"] == [0, 1] and final["diffs_dflash"] == [1.0, 0.0] and final["min_diff_dflash"] == 0.0
    )
    assert final["diff_dflash"] == pytest.approx(0.5) and final["train_jsonl_sha256"] == ["t0", "t1"]
    with pytest.raises(SystemExit, match="seed 0's dflash, peer-dflash is in two files"):
        bench_quality.main(["--merge", str(files[0]), str(files[0])])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"plan": {**plan, "lrs": [0.001]}, "draws": [runs[1]]}))
    with pytest.raises(SystemExit, match="some files swept learning rates and some did not"):
        bench_quality.main(["--merge", str(files[0]), str(other)])
    other.write_text(json.dumps({"plan": {**plan, "peer": []}, "draws": [runs[1]]}))
    with pytest.raises(SystemExit, match="different plans"):
        bench_quality.main(["--merge", str(files[0]), str(other)])


def test_merge_extends_a_sweep_with_rates_run_later(tmp_path, capsys):
    import bench_quality
    from quality_draw import DrawPlan

    def swept(seed: int, lr: float, ours: list, peer: list) -> dict:
        d = _draw(seed, ours, peer)
        d["eval"] = {f"{k}@{lr:g}": v for k, v in d["eval"].items()}
        d["train"] = {f"{k}@{lr:g}": v for k, v in d["train"].items()}
        return d

    plan = dataclasses.asdict(DrawPlan(ours=("dflash",), peer=("dflash",), lrs=(0.001,)))
    first = tmp_path / "first.json"  # seeds 0 and 1 at 1e-3: ours ahead by 1 token per step on seed 0
    first.write_text(json.dumps({"plan": plan, "draws": [swept(0, 0.001, [(30, 10)], [(20, 10)]),
                                                         swept(1, 0.001, [(20, 10)], [(20, 10)])]}))  # fmt: skip
    later = tmp_path / "later.json"  # the same draws at 5e-3: the peer best there, ahead of ours by 2
    later.write_text(json.dumps({"plan": {**plan, "lrs": [0.005]}, "draws": [swept(0, 0.005, [(30, 10)], [(50, 10)]),
                                                                            swept(1, 0.005, [(20, 10)], [(40, 10)])]}))  # fmt: skip
    assert bench_quality.main(["--merge", str(later), str(first)]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert final["sweep"]["ours_dflash"]["tau"] == {"0.001": 2.5, "0.005": 2.5}
    assert final["sweep"]["peer_dflash"]["best_lr"] == 0.005 and final["diffs_dflash"] == [-2.0, -2.0]
    lone = tmp_path / "lone.json"  # seed 2 at 5e-3 only: the merged sweep has no 1e-3 draft for it
    lone.write_text(
        json.dumps({"plan": {**plan, "lrs": [0.005]}, "draws": [swept(2, 0.005, [(9, 9)], [(9, 9)])]})
    )
    with pytest.raises(SystemExit, match="seed 2 has no dflash@0.001, peer-dflash@0.001"):
        bench_quality.main(["--merge", str(first), str(later), str(lone)])
    with pytest.raises(SystemExit, match="not a bench_quality results file"):
        bench_quality.main(["--merge", str(tmp_path / "missing.json")])


def test_a_later_run_never_overwrites_results(tmp_path):
    import bench_quality

    first = bench_quality.results_path(tmp_path, "-b")
    assert first == tmp_path / "results-b.json"
    first.write_text("{}")
    second = bench_quality.results_path(tmp_path, "-b")
    assert second == tmp_path / "results-b-2.json"
    second.write_text("{}")
    assert bench_quality.results_path(tmp_path, "-b") == tmp_path / "results-b-3.json"
    assert bench_quality.results_path(tmp_path, "-g") == tmp_path / "results-g.json"
