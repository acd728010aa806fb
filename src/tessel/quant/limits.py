"""The ranges of the toolkit's training options, torch-free: the CLI checks them as it parses, before a
model loads, and `QATOptions` checks the same for the Python API."""

from __future__ import annotations

# An AdamW step moves each weight by about lr: below 1e-9 that is under the float32 spacing of weights
# near 0.01 (about 1e-9), so nothing trains; above 1 a step swamps weights of order 0.01-0.1 and the
# loss diverges at once (1e300 overflows float32 in the optimizer itself).
MIN_QAT_LR = 1e-9
MAX_QAT_LR = 1.0
# A million optimizer steps is weeks of fine-tuning on a CPU; more is a typo, and a run that never ends.
MAX_QAT_STEPS = 1_000_000
