"""The quality benchmark's inputs reproduce and say who they are (issue 31).

Two builds of a target on one machine give the same weights and tokenizer bit for bit, with one
torch thread or two; the target's greedy continuations (``train.jsonl``) are the same bits on every
run; a cached target whose weights no longer hash to its record is reported, moved aside and built
anew, never used; ``--target DIR`` refuses such a directory in one line naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_quality  # noqa: E402
from quality_inputs import sha256_file  # noqa: E402
from quality_sizes import SIZES  # noqa: E402
from quality_steps import make_prompts  # noqa: E402
from quality_target import TargetError, ensure_target, target_facts  # noqa: E402

# the quick size's target, trained for fewer steps: the same code path in about a second
SPEC = dataclasses.replace(SIZES["quick"].target, train_steps=12)


def _build(cache: Path) -> tuple[Path, dict]:
    target = ensure_target(cache, SPEC, "cpu")
    return target, json.loads((target / "bench_target.json").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One cache holding a built target; tests that alter it work on a copy (:func:`_copy`)."""
    cache = tmp_path_factory.mktemp("built")
    _build(cache)
    return cache


def _copy(built: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``(cache, target)``: a copy of the built cache under ``tmp_path``."""
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    return cache, next(cache.glob("target-*"))


def test_two_builds_are_bit_identical_whatever_the_callers_threads(tmp_path, built):
    """The build pins its own thread count (BUILD_THREADS = 1), so a caller running 1 or 2 torch
    threads gets the same bits. Building with 2 threads is another computation: on AMD Zen 4 it gave
    the same bits, on this Intel Xeon VM other ones (MKL splits a matmul's reduction over threads),
    which is why the thread count is pinned and recorded (docs/benchmarks.md)."""
    import torch

    a, fa = _build(built)
    b, fb = _build(tmp_path / "b")
    assert fa["weights_sha256"] == sha256_file(a / "model.safetensors")
    assert (fa["weights_sha256"], fa["tokenizer_sha256"]) == (fb["weights_sha256"], fb["tokenizer_sha256"])
    assert fa["built_with"]["threads"] == 1 and fa["built_with"]["deterministic_algorithms"] is True
    assert {"torch", "transformers", "tokenizers", "isa"} <= set(fa["built_with"])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        c, fc = _build(tmp_path / "c")
    finally:
        torch.set_num_threads(threads)
    assert fc["built_with"]["threads"] == 1
    assert fc["weights_sha256"] == fa["weights_sha256"]


def test_the_targets_continuations_are_the_same_bits_on_every_run(tmp_path, built):
    target, _ = _build(built)
    size = dataclasses.replace(SIZES["quick"], target=SPEC, num_train_prompts=8)
    one = make_prompts(target, size, tmp_path / "one", "cpu", seed=3)
    two = make_prompts(target, size, tmp_path / "two", "cpu", seed=3)
    other = make_prompts(target, size, tmp_path / "other", "cpu", seed=4)
    assert [sha256_file(p) for p in one] == [sha256_file(p) for p in two]
    assert sha256_file(other[0]) != sha256_file(one[0]) and sha256_file(other[1]) != sha256_file(one[1])


def test_a_cached_target_with_other_weights_is_reported_and_rebuilt(tmp_path, caplog, built):
    cache, target = _copy(built, tmp_path)
    facts = target_facts(target)
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(
        TargetError, match=r"model\.safetensors: sha256 .* is not the .* bench_target\.json records"
    ):
        target_facts(target)
    with caplog.at_level(logging.ERROR, logger="bench_quality"):
        again, again_facts = _build(cache)
    assert again == target and again_facts["weights_sha256"] == facts["weights_sha256"]
    assert sha256_file(weights) == facts["weights_sha256"]
    aside = [p for p in cache.iterdir() if ".mismatch-" in p.name]
    assert len(aside) == 1 and sha256_file(aside[0] / "model.safetensors") != facts["weights_sha256"]
    assert any("model.safetensors: sha256" in r.getMessage() and "building it anew" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_target_dir_with_wrong_weights_or_no_record_is_refused_in_one_line(tmp_path, built):
    _, target = _copy(built, tmp_path)
    (target / "model.safetensors").write_bytes(b"not the weights")
    with pytest.raises(SystemExit, match=r"^--target: .*model\.safetensors: sha256 "):
        bench_quality.main(["--quick", "--target", str(target), "--work", str(tmp_path / "w")])
    (target / "bench_target.json").unlink()
    with pytest.raises(SystemExit, match=r"^--target: .*bench_target\.json: missing"):
        bench_quality.main(["--quick", "--target", str(target), "--work", str(tmp_path / "w")])
