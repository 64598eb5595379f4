"""The command line's reference page (docs/cli.md), written from the parser itself: every command, its options,
their defaults, choices and ranges, and their help, so that the list is written once (in :mod:`.args`) and the page
cannot drift from it (a test compares them). ``python -m pipefold.cli.reference > docs/cli.md`` writes it again."""

from __future__ import annotations

import argparse

from pipefold.cli.args import build_parser

HEADER = """# Command-line reference

Every command of `pipefold` and every option it takes, as `pipefold COMMAND --help` prints them. This page is
generated from the parser (`python -m pipefold.cli.reference > docs/cli.md`; a test keeps it current). A number
outside an option's range is refused before any work, and an option given in a mode where it does not apply is
refused too, in one line that says what would work.
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    metavar = action.metavar or (action.dest.upper() if action.nargs != 0 else None)
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    if action.nargs == "?":
        return f"{names} `[{metavar}]`"
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, [], ""):
        return ""
    return f"`{action.default}`"


def _accepts(action: argparse.Action) -> str:
    rng = getattr(action.type, "range", None)
    if rng is not None:
        return rng.describe()
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return ", ".join(f"`{c}`" for c in action.choices)
    return ""


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    usage = " ".join(parser.format_usage().split())
    if usage.startswith("usage: "):
        usage = usage[len("usage: "):]
    lines = [f"## pipefold {name}", "", _cell(summary) + ".", "", "```text", usage, "```", "",
             "| option | default | accepts | what it does |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        lines.append(f"| {_flags(action)} | {_default(action)} | {_cell(_accepts(action))} | "
                     f"{_cell((action.help or '').replace('%%', '%'))} |")
    return [*lines, ""]


def markdown() -> str:
    """docs/cli.md's text."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {c.dest: c.help or "" for c in sub._choices_actions}
    lines = [HEADER, "Commands: " + ", ".join(f"[{n}](#pipefold-{n})" for n in sub.choices) + ".", ""]
    for name, command in sub.choices.items():
        lines += _command(name, command, summaries.get(name, ""))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
