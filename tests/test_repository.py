"""The repository explains itself: no tracked text file points at what a reader of it cannot
open. That is a design note kept elsewhere, a path outside the checkout, a numbered issue or
work session, or the name a GPU machine was rented under. Say the rule, the goal or the
machine ("two H200s") in place instead."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT)

OUTSIDE_REFERENCES = re.compile(
    "|".join(
        [
            r"design\.md",  # a design note that is not in the repository
            r"\.\./shared\b",  # a folder beside the checkout
            r"\.library/",  # the build machines' own documentation
            r"\bissues?[ -]#?\d",  # an issue number: spaced, hyphenated or with "#"
            r"\bissue's\b|\bthe issue\b|\"[\w ]+\" issue\b",  # an issue named by its title
            r"\b(?:PR|pull request|fixes|closes|see)\s+#\d",
            r"\(#\d+\)",
            r"\b[\w.-]+/[\w.-]+#\d",  # owner/repo#N
            r"\bsessions? \d",  # a numbered work session
            r"nvidia-h\d+|\bh\d00-x\d",  # a machine's rental kind, not its GPUs
        ]
    ),
    re.IGNORECASE,
)


def tracked_text_files() -> list[str]:
    """The repository's tracked files that are text (no NUL byte, valid UTF-8), but this one."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
    ).stdout.split("\0")
    out = []
    for name in filter(None, names):
        path = os.path.join(ROOT, name)
        if name == THIS_FILE or not os.path.isfile(path):
            continue
        data = open(path, "rb").read()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(name)
    return out


def test_no_references_outside_the_repository():
    found = []
    for name in tracked_text_files():
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                m = OUTSIDE_REFERENCES.search(line)
                if m:
                    found.append(f"{name}:{number}: {m.group(0)!r} in {line.strip()[:120]}")
    assert not found, "references to things outside the repository:\n" + "\n".join(found)
