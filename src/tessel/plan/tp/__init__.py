"""Tensor-parallel stages (issue 45): a stage may span d GPUs of one machine, each stage its own d.
`groups` (which GPUs may group), `tp_instance` (a grouping as a planning problem), `search`
(`solve_tp`: degrees chosen with the layer split), `brute` (the oracle over degrees and splits)."""
