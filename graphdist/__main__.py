"""``python -m graphdist`` runs the command-line interface (Ctrl-C while it still imports is one
line too: :mod:`graphdist._cli.entry`)."""

import sys

from graphdist._cli.entry import main

sys.exit(main())
