"""The runtime half of quantisation: schemes, integer ranges and weight rounding, the compressed-tensors
layout read into quantised linears at load (module swap), load-time rounding of a plan's int8 / int4
layers and the int8 LM head. The offline toolkit (observers, calibration, GPTQ, AWQ, QAT, ...) is
`tessel.quant`."""
