"""The pipeline runtime: a plan's stages as processes over torch.distributed (gloo on CPU, NCCL on
CUDA), stage 0 running the engine's scheduler, CPP prefill, per-stage weight loading."""
