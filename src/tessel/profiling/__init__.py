"""Measuring this machine for the planner (`tessel profile`): a decoder layer's prefill and decode
times on a grid (`layer`), the model's other components (`components`), the device's peak rates
(`device_bench`), a CUDA-graph decode step (`cuda_graph_timing`), all timed one way (`timing`)."""
