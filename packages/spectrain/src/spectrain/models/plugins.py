"""Draft algorithms from outside the package: plugin modules named on the command line or in
the environment, and installed packages' ``spectrain.algorithms`` entry points.

A plugin is a module that calls ``@register("<name>")`` (docs/adding-an-algorithm.md) when it
is imported. ``spectrain --plugin MODULE`` (repeatable) or ``SPECTRAIN_PLUGINS="MOD1 MOD2"``
(what torchrun's ranks and SLURM jobs inherit) imports them before any subcommand; a package
that declares ``[project.entry-points."spectrain.algorithms"] mydraft = "mypkg.mydraft"`` is
imported the first time ``--speculator-type mydraft`` (or an exported mydraft draft) is used.
This module imports neither torch nor the registry: ``--help`` stays fast.
"""

from __future__ import annotations

import importlib
import importlib.metadata

ENTRY_POINT_GROUP = "spectrain.algorithms"
ENV = "SPECTRAIN_PLUGINS"


class PluginError(ValueError):
    """A plugin module that cannot be imported (the message names it and how it was given)."""


def load_plugins(modules: list[str] | tuple[str, ...], origin: str = "--plugin") -> list[str]:
    """Import each module of ``modules``; returns their names.

    Raises:
        PluginError: a module is not found, or raised while importing (one line naming it).
    """
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            where = "" if e.name == name else f" (it imports {e.name!r}, which is not installed)"
            raise PluginError(f"{origin} {name}: no module named {e.name!r}{where}; "
                              "is its directory on PYTHONPATH or the package installed?") from None  # fmt: skip
        except Exception as e:  # a plugin's own bug, reported in one line naming it
            raise PluginError(f"{origin} {name}: importing it raised {type(e).__name__}: {e}") from None
        done.append(name)
    return done


def load_entry_point(algorithm: str) -> bool:
    """Import the installed ``spectrain.algorithms`` entry point named ``algorithm``, if any;
    returns whether one was found."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == algorithm:
            try:
                ep.load()
            except Exception as e:
                raise PluginError(
                    f"entry point {ENTRY_POINT_GROUP}:{algorithm} ({ep.value}): importing it raised "
                    f"{type(e).__name__}: {e}"
                ) from None
            return True
    return False


__all__ = ["ENTRY_POINT_GROUP", "ENV", "PluginError", "load_entry_point", "load_plugins"]
