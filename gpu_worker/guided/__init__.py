"""Guided decoding on a rank: compiled-grammar cache, bitmask fill and apply, the mask kernel."""
