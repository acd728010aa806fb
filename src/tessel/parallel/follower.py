"""A follower rank's process: join the leader's group, load the rank's shards, run its steps.

    python -m tessel.parallel.follower --options rank1.json

Started by `TensorParallelExecutor` (one per rank after the first); it dies with its parent
(`PR_SET_PDEATHSIG`) and writes any error to its log, which the executor names on failure.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tessel.models.layer_filter import LayerFilter


@dataclass(frozen=True, slots=True)
class RankOptions:
    """What a follower is started with (a JSON file the leader writes)."""

    model_path: str
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # the rank's device, "cpu" or "cuda:K"
    rank: int
    degree: int
    host: str
    port: int
    threads: int | None = None  # torch threads (None: torch's default)
    layers: list | None = None  # a pipeline stage's [layer_start, layer_end, embed, head]; None: all
    tied: bool = False
    precisions: dict | None = None  # a plan's layer -> [attention, MLP] weight precisions (JSON keys)

    def layer_precisions(self) -> dict[int, tuple[str, str]] | None:
        if not self.precisions:
            return None
        return {int(layer): (halves[0], halves[1]) for layer, halves in self.precisions.items()}

    def layer_filter(self) -> LayerFilter | None:
        if self.layers is None:
            return None
        start, end, embed, head = self.layers
        return LayerFilter(start, end, embed, head, self.tied)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> RankOptions:
        return cls(**json.loads(path.read_text()))


def run_follower(options: RankOptions) -> int:
    """Join, load, follow the leader's steps -> how many ran."""
    from tessel.models.config import ModelConfig
    from tessel.parallel.group import join_tp_group
    from tessel.parallel.load import load_rank
    from tessel.parallel.runner import follow, follower_runner
    from tessel.parallel.split import TPSplit

    if options.threads is not None:
        torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    group = join_tp_group(options.rank, options.degree, device, options.host, options.port)
    split = TPSplit.of(ModelConfig.from_dir(options.model_path), options.degree)
    dtype = getattr(torch, options.dtype)
    layers, precisions = options.layer_filter(), options.layer_precisions()
    model = load_rank(options.model_path, dtype, group, split, layers, precisions).model
    return follow(follower_runner(model, group, dtype), group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--options", type=Path, required=True)
    run_follower(RankOptions.read(parser.parse_args(argv).options))


if __name__ == "__main__":
    main()
