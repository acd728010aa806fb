"""Guided decoding (structured outputs): what a request's output must match (`spec`), compiled and
matched token by token through llguidance (`decoder`); the sampler applies the allowed-token mask."""
