"""Which rank this process is, from explicit flags or the launcher that started it, and its endpoints.

``srun`` sets ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID``; torchrun sets ``RANK`` /
``WORLD_SIZE`` / ``LOCAL_RANK``; hsgen's own ``HSGEN_RANK`` / ``HSGEN_WORLD_SIZE`` come before
both. Explicit flags win over every variable. :func:`resolve_ranks` says which it used, so the
startup line can tell the user.

A node-local endpoint is named per rank with a template, ``http://localhost:{8000+local_rank}``
(``local_rank``, ``rank``, ``node_rank`` and integer ``+ - *`` inside braces), or by taking the
``local_rank``-th of a list (:func:`endpoints_for_rank`).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# (name, rank variable, world size variable, local rank variable), in order of precedence
LAUNCHERS: tuple[tuple[str, str, str, str], ...] = (
    ("HSGEN_*", "HSGEN_RANK", "HSGEN_WORLD_SIZE", "HSGEN_LOCAL_RANK"),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process run.

    Attributes:
        world_size, rank: the split of the work (``0 <= rank < world_size``).
        local_rank: the rank among the processes of this node (picks a node-local endpoint).
        node_rank: which node (torchrun's ``GROUP_RANK``, SLURM's ``SLURM_NODEID``; 0 if unknown).
        source: where the values came from, e.g. ``"flags"``, ``"SLURM"``, ``"flags + torchrun"``.
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    source: str = "default"

    def describe(self) -> str:
        """One phrase for the startup line: ``rank 1 of 2 (local rank 1, from SLURM)``."""
        return f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}, from {self.source})"


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def resolve_ranks(
    world_size: int | None = None, rank: int | None = None, env: Mapping[str, str] | None = None
) -> Ranks:
    """The ranks of this process: explicit values first, then the first launcher whose variables are set.

    Args:
        world_size, rank: the values of explicit flags (None when not given).
        env: the environment (default ``os.environ``).

    Raises:
        ValueError: a variable is not an integer, or the rank is not below the world size (the
            message names where each value came from).
    """
    env = os.environ if env is None else env
    found: tuple[str, int | None, int | None, int | None] | None = None
    for name, rank_var, world_var, local_var in LAUNCHERS:
        r, w = _int_var(env, rank_var), _int_var(env, world_var)
        if r is not None or w is not None:
            found = (name, r, w, _int_var(env, local_var))
            break
    sources = ["flags"] if world_size is not None or rank is not None else []
    launcher_r = launcher_w = local = None
    if found is not None:
        name, launcher_r, launcher_w, local = found
        if world_size is None or rank is None:
            sources.append(name)
    w = world_size if world_size is not None else (launcher_w if launcher_w is not None else 1)
    r = rank if rank is not None else (launcher_r if launcher_r is not None else 0)
    if local is None:
        local = _int_var(env, "LOCAL_RANK")
    node = _int_var(env, "GROUP_RANK")
    if node is None:
        node = _int_var(env, "SLURM_NODEID")
    source = " + ".join(sources) or "default"
    if w < 1:
        raise ValueError(f"world size {w} (from {source}) must be >= 1")
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in 0..{w - 1} (world size {w}; from {source})")
    return Ranks(w, r, local if local is not None and local >= 0 else 0, node or 0, source)


_FIELD = re.compile(r"\{([^{}]*)\}")
_NAMES = ("local_rank", "rank", "node_rank")


def _eval(node: ast.AST, values: Mapping[str, int], text: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name) and node.id in values:
        return values[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        a, b = _eval(node.left, values, text), _eval(node.right, values, text)
        return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    raise ValueError(
        f"endpoint template {{{text}}}: only integers, {', '.join(_NAMES)} and + - * are allowed"
    )


def expand_endpoint(template: str, ranks: Ranks) -> str:
    """``template`` with each ``{expression}`` replaced, e.g. ``http://localhost:{8000+local_rank}``.

    Raises:
        ValueError: an expression uses anything but integers, the rank names and ``+ - *``.
    """
    values = {"local_rank": ranks.local_rank, "rank": ranks.rank, "node_rank": ranks.node_rank}

    def one(m: re.Match[str]) -> str:
        text = m.group(1)
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"endpoint template {{{text}}} is not an expression") from None
        return str(_eval(tree.body, values, text))

    return _FIELD.sub(one, template)


def endpoints_for_rank(endpoints: Sequence[str], ranks: Ranks, *, per_local_rank: bool = False) -> list[str]:
    """The endpoints this rank talks to: templates expanded; with ``per_local_rank`` only the
    ``local_rank``-th of the list (modulo its length, so 8 ranks can share 4 servers).

    Raises:
        ValueError: a template is not one (see :func:`expand_endpoint`), or an endpoint carries
            credentials (the message shows it redacted: :func:`hsgen.protocol.extraction.check_no_credentials`).
    """
    from hsgen.protocol import extraction as protocol

    for e in endpoints:  # before anything is expanded, logged or printed
        protocol.check_no_credentials(e)
    urls = [expand_endpoint(e, ranks) for e in endpoints]
    if per_local_rank and urls:
        return [urls[ranks.local_rank % len(urls)]]
    return urls


__all__ = ["LAUNCHERS", "Ranks", "endpoints_for_rank", "expand_endpoint", "resolve_ranks"]
