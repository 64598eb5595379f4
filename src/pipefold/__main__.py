"""``python -m pipefold`` runs the command line."""

from pipefold._entry import main

main()
