"""``python -m hsgen.cli``: the ``hsgen`` command."""

from hsgen.cli import main

main()
