"""The offline toolkit's checkpoint formats: compressed-tensors writing (the layout and its reading,
GGUF in included, live with the models: `tessel.models.quantized`, `tessel.models.gguf`)."""
