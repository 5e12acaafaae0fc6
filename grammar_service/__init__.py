"""Owns grammars and the vocabulary: compiles constraints with xgrammar and caches them."""
