"""Draft model algorithms, one module each, registered by name (see :mod:`spectrain.models.registry`)."""

from spectrain.models.registry import (
    DraftConfig,
    DraftContext,
    DraftModel,
    available,
    build_draft,
    get_config_class,
    register,
)

__all__ = [
    "DraftConfig",
    "DraftContext",
    "DraftModel",
    "available",
    "build_draft",
    "get_config_class",
    "register",
]
