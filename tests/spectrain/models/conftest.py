"""The tiny verifier's frozen heads, shared by the model tests that run at its own precision."""

from __future__ import annotations

import pytest
import torch

from spectrain.models.verifier import VerifierHeads


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    torch.set_num_threads(1)
    return VerifierHeads.load(tiny_model_dir)
