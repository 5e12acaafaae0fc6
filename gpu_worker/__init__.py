"""One process per tensor-parallel rank: model, slots, guided decoding, step loop."""
