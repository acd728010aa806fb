"""How to sample one request (vLLM's field names and defaults), and the one validation of its fields.

The `check_*` functions are the only place a sampling field's type and range are decided: the
HTTP protocol (`tessel.server.protocol`), `SamplingParams` and `tessel generate` all call them, so a
value refused by one is refused by all. They raise `InvalidSamplingParams`, a `TesselError` that is
also a `ValueError` (pydantic turns it into a 400 naming the field). Counts must be real ints (not
bools, not 2.5, not "3"); floats must be finite. `top_k` above the vocabulary is refused when the
request reaches the engine (`SamplingParams.verify`), the first point that knows the vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tessel.engine.guided.spec import GuidedDecoding
from tessel.errors import TesselError
from tessel.text import check_text

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM has no bound
MAX_STOP_STRING_CHARS = 1000  # the detokenizer holds back this many characters while streaming
MAX_STOP_TOKEN_IDS = 1024
INT64_MAX = 2**63 - 1  # counts (max_tokens, n) fit a signed 64-bit int, as in every other engine
MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default max_logprobs; OpenAI's chat limit)
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS): 1/T would overflow


class InvalidSamplingParams(TesselError, ValueError):
    """A sampling field of the wrong type or out of range."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSamplingParams(f"{name} must be a number, got {type(value).__name__} {value!r:.40}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        raise InvalidSamplingParams(f"{name} is out of range: {_short(value)}") from None
    if not math.isfinite(number):
        raise InvalidSamplingParams(f"{name} must be finite, got {value}")
    return number


def check_int(value: Any, name: str) -> int:
    """A real int (not a bool, not 2.0, not "2")."""
    return _int(name, value)


def _int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise InvalidSamplingParams(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}")
    return value


def _short(value: int) -> str:
    """An int for a message: a huge one is not printed whole (str() refuses over 4300 digits)."""
    if abs(value) < 10**30:
        return str(value)
    return f"{'minus ' if value < 0 else ''}a {value.bit_length()}-bit number"


def check_temperature(value: Any) -> float:
    temperature = _real("temperature", value)
    if temperature < 0:
        raise InvalidSamplingParams(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    return temperature


def check_top_p(value: Any) -> float:
    top_p = _real("top_p", value)
    if not 0 < top_p <= 1:
        raise InvalidSamplingParams(f"top_p must be in (0, 1] (1 is off), got {top_p}")
    return top_p


def check_top_k(value: Any) -> int:
    """-1 and 0 switch top-k off; positive values are checked against the vocabulary by `verify`."""
    if value is None:
        return 0
    top_k = _int("top_k", value)
    if top_k < -1:
        raise InvalidSamplingParams(f"top_k must be -1 or 0 (off) or a positive count, got {_short(top_k)}")
    return top_k


def _optional_int_in(name: str, value: Any, low: int, high: int, high_text: str) -> int | None:
    """None, or an integer in [low, high] (`high_text` spells `high` in the message)."""
    if value is None:
        return None
    number = _int(name, value)
    if not low <= number <= high:
        raise InvalidSamplingParams(f"{name} must be in [{low}, {high_text}], got {_short(number)}")
    return number


def check_max_tokens(value: Any) -> int | None:
    return _optional_int_in("max_tokens", value, 1, INT64_MAX, "2**63 - 1")


def check_seed(value: Any) -> int | None:
    return _optional_int_in("seed", value, 0, MAX_SEED, "2**64 - 1")


def check_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list | tuple):
        raise InvalidSamplingParams(f"stop must be a string or a list of strings, got {type(value).__name__}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidSamplingParams(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for stop in stops:
        check_text(stop, "stop")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidSamplingParams(
                f"a stop string has {len(stop)} characters; at most {MAX_STOP_STRING_CHARS} are allowed"
            )
    return [s for s in stops if s]


def check_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise InvalidSamplingParams(f"stop_token_ids must be a list of integers, got {type(value).__name__}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidSamplingParams(
            f"stop_token_ids has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        )
    ids = [_int("stop_token_ids", t) for t in value]
    if any(t < 0 for t in ids):
        raise InvalidSamplingParams("stop_token_ids must be non-negative")
    return ids


def check_logprobs(value: Any, name: str = "logprobs") -> int | None:
    """None: none; k in [0, MAX_LOGPROBS]: the chosen token's logprob and the k most likely."""
    if value is None:
        return None
    k = _int(name, value)
    if not 0 <= k <= MAX_LOGPROBS:
        raise InvalidSamplingParams(f"{name} must be in [0, {MAX_LOGPROBS}], got {_short(k)}")
    return k


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidSamplingParams(f"{name} must be true or false, got {type(value).__name__} {value!r:.40}")
    return value


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k -1 or 0 and top_p = 1 switch those filters off.

    `max_tokens=None` generates until EOS/stop or `max_model_len`. `stop` strings end the request
    and are cut from the text; `stop_token_ids` (and EOS, unless `ignore_eos`) end it and stay in
    `token_ids`. `seed` gives the request its own generator: same seed, same tokens.
    `logprobs=k` returns each generated token's log-probability and the k most likely tokens';
    `prompt_logprobs=k` the same for the prompt's tokens (the first has none). Log-probabilities
    are log-softmax of the model's logits before temperature, top-k and top-p (as vLLM's default)
    and before `guided`, which restricts every sampled token to what its grammar allows.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: GuidedDecoding | None = None  # what the output must match (structured outputs)

    def __post_init__(self) -> None:
        self.temperature = check_temperature(self.temperature)
        self.top_p = check_top_p(self.top_p)
        self.top_k = check_top_k(self.top_k)
        self.max_tokens = check_max_tokens(self.max_tokens)
        self.seed = check_seed(self.seed)
        self.stop = check_stop(self.stop)
        self.stop_token_ids = check_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = check_bool(self.ignore_eos, "ignore_eos")
        self.skip_special_tokens = check_bool(self.skip_special_tokens, "skip_special_tokens")
        self.logprobs = check_logprobs(self.logprobs, "logprobs")
        self.prompt_logprobs = check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise InvalidSamplingParams(f"guided must be a GuidedDecoding, got {type(self.guided).__name__}")

    def verify(self, vocab_size: int) -> None:
        """Checks that need the model: top_k is refused (not clamped) above the vocabulary size."""
        if self.top_k > vocab_size:
            raise InvalidSamplingParams(
                f"top_k={_short(self.top_k)} is larger than the vocabulary ({vocab_size} tokens); "
                f"use 1..{vocab_size}, or -1 / 0 for no top-k"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
