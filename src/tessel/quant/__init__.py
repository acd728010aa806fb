"""The offline quantisation toolkit: observers, calibration, SmoothQuant, GPTQ, AWQ, QAT, sensitivity, and
writing compressed-tensors checkpoints (`formats/`). The runtime half (schemes, integer ranges and
rounding, the layout read at load, module swap, load-time rounding, int8 LM head, GGUF in) is
`tessel.models.quantized` and `tessel.models.gguf`.

The torch side of tessel (the `runtime` extra); nothing here is imported by the planner.
"""
