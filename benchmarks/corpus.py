"""Real English text without a network: the prose paragraphs of the Python documentation that
ships with CPython (``pydoc_data.topics``), with code blocks, grammar rules and headings
removed. About 60k tokens of technical English."""

from __future__ import annotations

import re


def english_paragraphs() -> list[str]:
    """Prose paragraphs in a fixed order (sorted topic names), each at least 200 characters."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code, grammar, indented examples
            text = " ".join(line.strip() for line in lines)
            if len(text) < 200 or re.fullmatch(r"[*=\-~^ ]+", lines[-1].strip() or "x"):
                continue
            paragraphs.append(text)
    return paragraphs


def english_text() -> str:
    return "\n\n".join(english_paragraphs())
