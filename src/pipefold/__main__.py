"""``python -m pipefold`` runs the command line."""

import sys

from pipefold.cli import main

sys.exit(main())
