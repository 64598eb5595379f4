"""``python -m pipefold`` runs the command line."""

import sys

from pipefold.cli.main import main

sys.exit(main())
