"""The model runtime: config, tensor-parallel layers, decoder, loader, CUDA graphs, attention."""
