"""Structured outputs: constrained decoding through a grammar engine (llguidance)."""

from pagedserve.structured.backend import Grammar, GrammarCompiler, fill_allowed

__all__ = ["Grammar", "GrammarCompiler", "fill_allowed"]
