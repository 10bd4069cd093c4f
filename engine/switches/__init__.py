"""The switches a run turns: weight precision (levels and their linear layers), activation sparsity and
speculative decoding (the methods and their drafters)."""
