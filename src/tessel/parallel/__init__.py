"""Tensor parallelism: one model's layers split across ranks that compute each step together.

split.py    TPSplit: which heads, KV heads, MLP columns and vocabulary rows each rank holds;
            the per-rank ModelConfig the model is built from; the degree's checks
group.py    TPGroup: the ranks' process group (gloo on the CPU, NCCL between GPUs):
            all-reduce, gather to the leader, the step broadcast
layers.py   row-parallel linears (one all-reduce after), the vocabulary-parallel embedding and
            LM head
load.py     a rank's model: built from its config, each tensor read as its slice only
step.py     TPStep: what the leader broadcasts each step so the followers run the same forward
follower.py a follower rank's process: join, load, run the leader's steps until told to stop
executor.py TensorParallelExecutor: the engine's executor with this process as rank 0
"""
