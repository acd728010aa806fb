"""lm-evaluation-harness as a client of `tessel serve`: its `local-completions` and
`local-chat-completions` backends, four requests in flight, score the same as its `hf` backend
(transformers in this process, the oracle) on SmolLM2, for a multiple-choice task (loglikelihoods
of the choices, through `echo` and `logprobs`) and a generate-until task (greedy text), with and
without the chat template.

The tasks are local (tests/server/data/lm_eval: YAML task configs over JSONL files): no network.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm_eval's API backends (the `api` extra)

from serve_process import serve_process  # noqa: E402

pytestmark = pytest.mark.slow  # two transformers runs and a server process: ~2 minutes on 2 cores

TASKS = Path(__file__).parent / "data" / "lm_eval"
LOGLIKELIHOOD_ATOL = 1e-3  # float32 engine vs float32 transformers, summed over a few tokens


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: Any) -> Path:
    work = tmp_path_factory.mktemp("lm_eval_tasks")
    for path in TASKS.iterdir():
        shutil.copy(path, work / path.name)
    monkeypatch_module.chdir(work)  # the task configs name their data files relative to here
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    return work


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def server_url(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_process(smollm2_dir, log, "--max-model-len", "2048") as served:
        yield served.url


def _evaluate(task_dir: Path, model: str, model_args: str, tasks: list[str], chat: bool) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=1,
        apply_chat_template=chat,
        device="cpu" if model == "hf" else None,
    )


def _api_args(url: str, route: str, model_dir: Path) -> str:
    return (
        f"model={model_dir.name},base_url={url}/v1/{route},tokenizer={model_dir},"
        "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1"
    )


def _responses(results: dict[str, Any], task: str) -> list[Any]:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_local_completions_score_as_hf(task_dir: Path, server_url: str, smollm2_dir: Path) -> None:
    tasks = ["tessel_mc", "tessel_gen"]
    hf = _evaluate(task_dir, "hf", f"pretrained={smollm2_dir},dtype=float32", tasks, chat=False)
    api = _evaluate(
        task_dir, "local-completions", _api_args(server_url, "completions", smollm2_dir), tasks, False
    )
    assert api["results"]["tessel_mc"]["acc,none"] == hf["results"]["tessel_mc"]["acc,none"]
    for ours, theirs in zip(_responses(api, "tessel_mc"), _responses(hf, "tessel_mc"), strict=True):
        for [(ours_ll, _)], [(theirs_ll, _)] in zip(ours, theirs, strict=True):
            assert math.isclose(ours_ll, theirs_ll, abs_tol=LOGLIKELIHOOD_ATOL), (ours, theirs)
    assert _responses(api, "tessel_gen") == _responses(hf, "tessel_gen")
    assert api["results"]["tessel_gen"]["exact_match,none"] == hf["results"]["tessel_gen"]["exact_match,none"]


def test_local_chat_completions_generate_as_hf(task_dir: Path, server_url: str, smollm2_dir: Path) -> None:
    tasks = ["tessel_gen"]
    hf = _evaluate(task_dir, "hf", f"pretrained={smollm2_dir},dtype=float32", tasks, chat=True)
    route = "chat/completions"
    api = _evaluate(
        task_dir, "local-chat-completions", _api_args(server_url, route, smollm2_dir), tasks, True
    )
    assert _responses(api, "tessel_gen") == _responses(hf, "tessel_gen")
