"""``python -m spectrain.cli``: the ``spectrain`` command."""

from spectrain.cli import main

main()
