"""Regenerated blocks inside hand-written Markdown documents.

A block is the text between ``<!-- begin:NAME -->`` and ``<!-- end:NAME -->`` lines; the
benchmark scripts rewrite their blocks (tables, the command that produced them) and leave
the prose around them alone.
"""

from __future__ import annotations

import re


def replace_block(text: str, name: str, content: str) -> str:
    """``text`` with block ``name``'s content replaced; ValueError if the markers are missing."""
    pattern = re.compile(rf"(<!-- begin:{re.escape(name)} -->\n).*?(<!-- end:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no '<!-- begin:{name} -->' ... '<!-- end:{name} -->' block")
    return pattern.sub(lambda m: m.group(1) + content.rstrip("\n") + "\n" + m.group(2), text, count=1)


def check_file(path: str, names) -> None:
    """Raise ValueError (or OSError) unless the file at ``path`` has every block in ``names``."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    for name in names:
        replace_block(text, name, "")


def update_file(path: str, blocks: dict) -> None:
    """Replace every ``{name: content}`` block of the file at ``path`` in place."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    for name, content in blocks.items():
        text = replace_block(text, name, content)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
