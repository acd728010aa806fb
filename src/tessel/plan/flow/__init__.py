"""Flow plans: GPUs hold one range of layers each and requests are routed over the placements
(`flow`), chosen by a MILP (`flow_milp`), cheap candidates (`flow_heuristics`, `swarm`) and compared
with replicas (`flow_choice`)."""
