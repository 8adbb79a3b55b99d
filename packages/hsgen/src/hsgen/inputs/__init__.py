"""Prompts in: dataset files and hub datasets read (:mod:`~hsgen.inputs.formats`), rendered to token
ids and loss masks (:mod:`~hsgen.inputs.render`), counted for a progress bar.

The names of the module this folder was (``hsgen.inputs``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "InputError",
    "InputSample",
    "InputStats",
    "OnBadInput",
    "content_id",
    "iter_records",
    "parse_record",
    "read_inputs",
    "sample_to_json",
]

__getattr__ = forward("hsgen.inputs.formats", __all__)
