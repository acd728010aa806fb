"""Requests for a pipeline run: `--prompt` strings or a JSONL file, one request per line.

A line is a JSON string (the prompt) or an object with `prompt` (text or a list of token ids) and
optionally any `SamplingParams` field (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop`, `stop_token_ids`, `ignore_eos`) overriding the command-line defaults. Blank lines are
skipped; a bad line is a `TesselError` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from tessel.engine.sampling_params import SamplingParams
from tessel.errors import TesselError

MAX_REQUESTS = 100_000
PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_INT_FIELDS = ("max_tokens", "top_k", "seed")
_NUMBER_FIELDS = ("temperature", "top_p")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")


@dataclass(frozen=True, slots=True)
class RunRequest:
    prompt: str | list[int]
    params: SamplingParams
    where: str = ""  # for messages: "FILE:LINE" of a prompts-file request, "--prompt N" of another


def read_requests(path: Path, defaults: SamplingParams) -> list[RunRequest]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise TesselError(f"cannot read the prompts file {path}: {error}") from None
    requests = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            requests.append(_parse_line(f"{path}:{number}", line, defaults))
        if len(requests) > MAX_REQUESTS:
            raise TesselError(f"{path}: more than {MAX_REQUESTS} requests; split the file")
    if not requests:
        raise TesselError(f"{path} holds no requests (one JSON object or string per line)")
    return requests


def _parse_line(where: str, line: str, defaults: SamplingParams) -> RunRequest:
    try:
        entry = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        raise TesselError(f"{where}: not valid JSON ({error})") from None
    if isinstance(entry, str):
        entry = {"prompt": entry}
    if not isinstance(entry, dict) or "prompt" not in entry:
        raise TesselError(f"{where}: expected a JSON string or an object with a 'prompt'")
    prompt = entry["prompt"]
    token_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )
    if not (isinstance(prompt, str) or token_ids) or not prompt:
        raise TesselError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")
    unknown = sorted(set(entry) - PARAM_FIELDS - {"prompt"})
    if unknown:
        raise TesselError(f"{where}: unknown field(s) {unknown}; sampling fields are {sorted(PARAM_FIELDS)}")
    overrides = {key: value for key, value in entry.items() if key != "prompt"}
    for key, value in overrides.items():
        if not _well_typed(key, value):
            raise TesselError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
    try:
        params = dataclasses.replace(defaults, **overrides)
    except TesselError as error:
        raise TesselError(f"{where}: {error}") from None
    except (TypeError, ValueError) as error:
        raise TesselError(f"{where}: bad sampling field ({error})") from None
    return RunRequest(prompt, params, where)


def _well_typed(key: str, value: object) -> bool:
    if key in _INT_FIELDS:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if key in _NUMBER_FIELDS:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if key in _BOOL_FIELDS:
        return isinstance(value, bool)
    if key == "stop":
        return (
            value is None
            or isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        )
    if key == "stop_token_ids":
        return value is None or (isinstance(value, list) and all(type(v) is int for v in value))
    return True
