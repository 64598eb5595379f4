"""``python -m pipefold`` runs the command line."""

from pipefold.cli.main import entry

entry()
