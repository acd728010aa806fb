"""Online plans: the highest arrival rate whose p90 TTFT and TPOT meet the workload's SLOs (goodput)."""
