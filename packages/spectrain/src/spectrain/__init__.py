"""spectrain: DFlash and Eagle3 draft training from target hidden states."""

__version__ = "0.1.0"

from spectrain import _moved

_moved.install()
