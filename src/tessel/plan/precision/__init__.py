"""A weight precision per layer: the choice and its budget (`precision`) and each layer's quality
cost (`quality`)."""
