"""Solvers of a `PlanningInstance`: `solve` over the MILP (on HiGHS, through `highs`), the DP, the
brute force, the bounds and the baselines."""
