"""The ``pipefold`` command line: parsing, one function per command, printing. Nothing in the library imports
it."""
