"""``python -m megacompile ...``: the same command line as the ``megacompile`` console script."""
import sys

from megacompile.cli.commands import main

sys.exit(main())
