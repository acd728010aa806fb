"""Quantisation: observers, SmoothQuant, schemes, calibration and the compressed-tensors checkpoint format.

The torch side of tessel (the `runtime` extra); nothing here is imported by the planner.
"""
