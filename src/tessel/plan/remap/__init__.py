"""Changing a serving plan: re-planning for a new workload (`replan`), the plan on the stages left
after a loss (`survivors`), when to remap a serving pipeline (`remap_decision`)."""
