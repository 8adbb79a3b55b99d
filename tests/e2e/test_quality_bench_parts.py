"""The quality benchmark's parts (``scripts/quality_*.py``) that its ``--quick`` size rests on.

The quick size builds its target on a share of the standard library, so the share must keep
held-out files to evaluate on; adding ``corpus_share`` must not rename the targets cached for the
other sizes; and a ``spectrain`` step run inside the benchmark's process must report the exit
status the console script would, or a failed step would be read as a measurement.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import quality_steps  # noqa: E402
from quality_sizes import SIZES  # noqa: E402
from quality_target import BENCH_VERSION, TargetSpec, is_held_out, stdlib_files  # noqa: E402


def _key_before_corpus_share(spec: TargetSpec) -> str:
    """The fingerprint as computed before ``corpus_share`` existed."""
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k != "corpus_share"}
    payload = {"v": BENCH_VERSION, "py": sys.version_info[:2], **fields}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


@pytest.mark.parametrize("name", ["small", "default", "gpu"])
def test_sizes_on_the_whole_corpus_keep_their_cached_target(name):
    spec = SIZES[name].target
    assert spec.corpus_share == 1
    assert spec.fingerprint() == _key_before_corpus_share(spec)


def test_a_corpus_share_is_another_target():
    spec = SIZES["small"].target
    assert dataclasses.replace(spec, corpus_share=8).fingerprint() != spec.fingerprint()


def test_the_quick_share_is_a_subset_with_held_out_files_to_evaluate_on():
    size = SIZES["quick"]
    every = dict(stdlib_files())
    share = stdlib_files(size.target.corpus_share)
    assert share and set(rel for rel, _ in share) < set(every)
    assert len(share) < len(every) / size.target.corpus_share * 2
    assert all(every[rel] == text for rel, text in share)
    held = [rel for rel, text in share if is_held_out(rel) and len(text) > 20 * size.prompt_tokens]
    trained = [rel for rel, _ in share if not is_held_out(rel)]
    assert held and len(trained) > 10 * len(held)


def test_a_spectrain_step_in_process_reports_the_console_scripts_exit_status(capsys):
    code, stdout = quality_steps._spectrain_in_process(["--version"])
    assert (code, "spectrain" in stdout) == (0, True)
    code, _ = quality_steps._spectrain_in_process(["train", "--no-such-flag"])
    assert code == 2
    with pytest.raises(SystemExit, match="spectrain export failed with exit status 2"):
        quality_steps.run(
            quality_steps.spectrain_cmd("export", "--no-such-flag"), "spectrain export", in_process=True
        )
