"""The files the planner reads and writes: cluster and workload files, the plan file (`plan_file`,
made of `plan_parts`), merged cluster files and the vLLM export."""
