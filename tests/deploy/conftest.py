"""Helpers for the deployment tests: the Dockerfile read as instructions, .dockerignore matching."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and its arguments, continuation lines joined."""

    keyword: str
    args: str


def dockerfile_instructions(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile, with comments (and the ``# syntax=`` directive) dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        pending += line
        keyword, _, args = pending.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def build_args(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=default`` -> {NAME: default} (quotes removed as the shell would)."""
    args: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name] = " ".join(shlex.split(default)) if default else ""
    return args


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    # Docker's .dockerignore: Go filepath.Match per segment, plus "**" for any number of directories.
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            parts.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            parts.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            parts.append(pattern[i:end + 1])
            i = end + 1
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(parts))


def dockerignore_patterns(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, pattern) for each rule, in order."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line.lstrip("!").strip().strip("/")
        rules.append((negate, _pattern_regex(line)))
    return rules


def is_ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves out ``path`` (a rule on a directory covers everything below it)."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not negate
    return ignored
