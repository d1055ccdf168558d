"""Training a converted module: the loss-scaled step, its CUDA-graph, distributed and checkpoint forms."""
