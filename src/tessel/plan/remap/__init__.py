"""Changing a serving plan: re-planning for a new workload (`replan`), when to remap a serving
pipeline (`remap_decision`)."""
