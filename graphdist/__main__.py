"""``python -m graphdist`` runs the command-line interface."""

import sys

from graphdist._cli.main import main

sys.exit(main())
