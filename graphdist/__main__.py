"""``python -m graphdist`` runs the command-line interface."""

import sys

from graphdist._cli import main

sys.exit(main())
