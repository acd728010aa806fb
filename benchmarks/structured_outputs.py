"""Structured outputs on SmolLM2 behind `tessel serve`: how many guided outputs parse and validate,
and what guiding costs in throughput.

    python benchmarks/structured_outputs.py [--requests 40] [--concurrency 8] [--rounds 2] [--max-tokens 200]

A `tessel serve` child process serves SmolLM2-135M-Instruct (`tessel example-model`). Each request
asks, in a chat message, for one of 20 JSON schemas (nested objects, arrays, enums, bounded
numbers of two decimals, patterns, required fields: `SCHEMAS`; every object closed with
`additionalProperties: false`, as OpenAI's strict mode requires, and every string, array and
number bounded, so every output has a bound), request i for schema
i mod 20, sampled at temperature 0.7 with seed i.

Validity: the share of guided outputs (`response_format: json_schema`, strict) that `json.loads`
and `jsonschema.validate` accept (target 100%). Throughput: the same requests with and without the
schema, `--concurrency` in flight at once, in alternating rounds (a load change on a shared machine
hits both alike). Each unguided request ignores EOS and generates exactly as many tokens as its
guided twin of the round before, so both rounds do the same model work and differ only by guiding.
Figures: completion tokens per wall second of a round, and per CPU second of the server process
(`/proc/PID/stat`; on a machine other jobs load, waiting for a core does not count in it).
Prints the CPU's features, a table per schema and the ratios; appends a record to
benchmarks/results/structured_outputs.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _harness

# two decimals: JSON Schema bounds a number's digits by nothing else, and a sampled fraction may run
# on past max_tokens (seen: 2 of 400 outputs cut at 200 tokens, 5 readings of many digits each)
_num = {"type": "number", "minimum": 0, "maximum": 1000, "multipleOf": 0.01}
_short = {"type": "string", "maxLength": 24}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": _short, "age": {"type": "integer", "minimum": 0,
               "maximum": 120}}, "required": ["name", "age"]},
    "book": {"type": "object", "properties": {"title": _short, "author": _short, "year": {"type": "integer",
             "minimum": 1400, "maximum": 2030}}, "required": ["title", "author", "year"]},
    "weather": {"type": "object", "properties": {"city": _short, "temperature_c": {"type": "number",
                "minimum": -60, "maximum": 60}, "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
                "required": ["city", "temperature_c", "sky"]},
    "todo_list": {"type": "object", "properties": {"items": {"type": "array", "items": _short, "minItems": 1,
                  "maxItems": 4}}, "required": ["items"]},
    "point_3d": {"type": "object", "properties": {k: {"type": "number", "minimum": -100, "maximum": 100}
                 for k in "xyz"}, "required": ["x", "y", "z"], "additionalProperties": False},
    "order": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
              "lines": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties":
              {"sku": _short, "qty": {"type": "integer", "minimum": 1, "maximum": 20}}, "required":
              ["sku", "qty"]}}}, "required": ["id", "lines"]},
    "address": {"type": "object", "properties": {"street": _short, "city": _short, "zip": {"type": "string",
                "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]},
    "color": {"type": "object", "properties": {"name": _short, "rgb": {"type": "array", "items":
              {"type": "integer", "minimum": 0, "maximum": 255}, "minItems": 3, "maxItems": 3}},
              "required": ["name", "rgb"]},
    "movie_review": {"type": "object", "properties": {"movie": _short, "stars": {"type": "integer",
                     "minimum": 1, "maximum": 5}, "recommend": {"type": "boolean"}},
                     "required": ["movie", "stars", "recommend"]},
    "company": {"type": "object", "properties": {"name": _short, "ceo": {"type": "object", "properties":
                {"name": _short, "since": {"type": "integer", "minimum": 1900, "maximum": 2030}},
                "required": ["name"]}, "employees": {"type": "integer", "minimum": 1, "maximum": 10**6}},
                "required": ["name", "ceo"]},
    "recipe": {"type": "object", "properties": {"dish": _short, "ingredients": {"type": "array", "items":
               _short, "minItems": 2, "maxItems": 5}, "minutes": {"type": "integer", "minimum": 1,
               "maximum": 600}}, "required": ["dish", "ingredients", "minutes"]},
    "flight": {"type": "object", "properties": {"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to":
               {"type": "string", "pattern": "^[A-Z]{3}$"}, "seats": {"type": "integer", "minimum": 1,
               "maximum": 9}}, "required": ["from", "to", "seats"]},
    "planet": {"type": "object", "properties": {"name": _short, "moons": {"type": "integer", "minimum": 0,
               "maximum": 200}, "rocky": {"type": "boolean"}}, "required": ["name", "moons", "rocky"]},
    "invoice": {"type": "object", "properties": {"number": _short, "total": _num, "currency": {"enum":
                ["EUR", "USD", "GBP"]}, "paid": {"type": "boolean"}}, "required": ["number", "total",
                "currency", "paid"]},
    "user_roles": {"type": "object", "properties": {"user": _short, "roles": {"type": "array", "items":
                   {"enum": ["admin", "editor", "viewer"]}, "minItems": 1, "maxItems": 3}},
                   "required": ["user", "roles"]},
    "event": {"type": "object", "properties": {"title": _short, "day": {"type": "integer", "minimum": 1,
              "maximum": 31}, "month": {"type": "integer", "minimum": 1, "maximum": 12}},
              "required": ["title", "day", "month"]},
    "sensor": {"type": "object", "properties": {"id": _short, "readings": {"type": "array", "items": _num,
               "minItems": 1, "maxItems": 5}, "unit": {"enum": ["C", "F", "K"]}}, "required": ["id",
               "readings", "unit"]},
    "animal": {"type": "object", "properties": {"species": _short, "legs": {"enum": [0, 2, 4, 6, 8]},
               "habitat": {"enum": ["land", "sea", "air"]}}, "required": ["species", "legs", "habitat"]},
    "team": {"type": "object", "properties": {"name": _short, "members": {"type": "array", "maxItems": 3,
             "items": {"type": "object", "properties": {"name": _short, "role": {"enum": ["lead",
             "dev", "qa"]}}, "required": ["name", "role"]}}}, "required": ["name", "members"]},
    "answer": {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence":
               {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"]},
}  # fmt: skip
TEMPERATURE = 0.7


def strict(schema: Any) -> Any:
    """The schema as OpenAI's strict mode takes it: every object closed (additionalProperties false)."""
    if isinstance(schema, dict):
        closed = {key: strict(value) for key, value in schema.items()}
        if schema.get("type") == "object":
            closed.setdefault("additionalProperties", False)
        return closed
    return [strict(item) for item in schema] if isinstance(schema, list) else schema


SCHEMAS = {name: strict(schema) for name, schema in SCHEMAS.items()}


def request_bodies(count: int, max_tokens: list[int], guided: bool) -> list[dict[str, Any]]:
    """Request i asks for schema i mod 20 with `max_tokens[i]`; the free ones (no schema) ignore EOS,
    so each generates exactly as many tokens as its guided twin did."""
    names = list(SCHEMAS)
    bodies = []
    for i in range(count):
        name = names[i % len(names)]
        prompt = f"Reply with one JSON object describing a {name.replace('_', ' ')}. Example {i}."
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens[i],
            "temperature": TEMPERATURE,
            "seed": i,
            "schema_name": name,
        }
        if not guided:
            body["ignore_eos"] = True
        if guided:
            spec = {"name": name, "schema": SCHEMAS[name], "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        bodies.append(body)
    return bodies


async def run_round(url: str, bodies: list[dict[str, Any]], concurrency: int) -> tuple[float, list[dict]]:
    """All bodies, `concurrency` at a time -> (wall seconds, each answer with its schema name)."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=1800.0) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with limit:
                sent = {k: v for k, v in body.items() if k != "schema_name"}
                answer = await client.post(f"{url}/v1/chat/completions", json=sent)
                answer.raise_for_status()
                return {"schema_name": body["schema_name"], **answer.json()}

        started = time.perf_counter()
        answers = await asyncio.gather(*(one(body) for body in bodies))
        return time.perf_counter() - started, list(answers)


def exact_json(text: str) -> Any:
    """JSON with its fractions as Decimals: jsonschema checks `multipleOf: 0.01` on floats by float
    division, which refuses 11% of two-decimal numbers (0.07 / 0.01 is 7.000000000000001)."""
    from decimal import Decimal

    return json.loads(text, parse_float=Decimal)


def validity(answers: list[dict[str, Any]]) -> dict[str, Any]:
    import jsonschema

    per_schema: dict[str, list[bool]] = {}
    reasons: Counter = Counter()
    for answer in answers:
        choice = answer["choices"][0]
        reasons[choice["finish_reason"]] += 1
        name = answer["schema_name"]
        try:
            jsonschema.validate(
                exact_json(choice["message"]["content"]), exact_json(json.dumps(SCHEMAS[name]))
            )
            ok = True
        except (ValueError, jsonschema.ValidationError):
            ok = False
        per_schema.setdefault(name, []).append(ok)
    valid = sum(sum(oks) for oks in per_schema.values())
    return {
        "valid": valid,
        "total": len(answers),
        "share": valid / len(answers),
        "per_schema": {name: [sum(oks), len(oks)] for name, oks in per_schema.items()},
        "finish_reasons": dict(reasons),
    }


def tokens(answers: list[dict[str, Any]]) -> int:
    return sum(answer["usage"]["completion_tokens"] for answer in answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating guided / free rounds of all requests"
    )
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2 example model)")
    _harness.add_record_options(parser, "structured_outputs")
    args = parser.parse_args()

    print(_harness.machine_line())
    print(f"cpu flags: {' '.join(_harness.machine()['cpu'].get('flags', []))}")
    model = _harness.example_model(args.model)
    serve = _harness.tests_module("serve_process").serve_process
    log = Path(args.out).with_suffix(".serve.log.tmp")
    runs: dict[str, list[tuple[float, int]]] = {"guided": [], "free": []}
    cpu: dict[str, list[float]] = {"guided": [], "free": []}  # the server process's CPU seconds per round
    guided_answers: list[dict[str, Any]] = []
    with serve(model, log, "--max-num-seqs", str(args.concurrency), "--max-model-len", "2048") as served:
        url = served.url
        warm_up = request_bodies(args.concurrency, [16] * args.concurrency, True)
        asyncio.run(run_round(url, warm_up, args.concurrency))
        lengths: list[int] = []
        for _ in range(args.rounds):
            for mode in ("guided", "free"):
                limits = [args.max_tokens] * args.requests if mode == "guided" else lengths
                bodies = request_bodies(args.requests, limits, mode == "guided")
                cpu_before_s = served.cpu_s()
                wall_s, answers = asyncio.run(run_round(url, bodies, args.concurrency))
                cpu[mode].append(served.cpu_s() - cpu_before_s)
                if mode == "guided":  # the free round generates as many tokens per request
                    lengths = [answer["usage"]["completion_tokens"] for answer in answers]
                runs[mode].append((wall_s, tokens(answers)))
                if mode == "guided":
                    guided_answers += answers
                print(f"  {mode:>6} round: {tokens(answers)} tokens in {wall_s:.1f} s", file=sys.stderr)
    log.unlink(missing_ok=True)
    valid = validity(guided_answers)
    rates = {mode: [n / s for s, n in rounds] for mode, rounds in runs.items()}
    ratio = statistics.median(g / f for g, f in zip(rates["guided"], rates["free"], strict=True))
    cpu_rates = {mode: [n / c for (_, n), c in zip(runs[mode], cpu[mode], strict=True)] for mode in runs}
    cpu_ratio = statistics.median(g / f for g, f in zip(cpu_rates["guided"], cpu_rates["free"], strict=True))
    print(f"\n{'schema':<14}{'valid':>8}")
    for name, (ok, total) in valid["per_schema"].items():
        print(f"{name:<14}{ok:>4}/{total:<3}")
    print(f"\nvalid JSON per schema: {valid['valid']}/{valid['total']} ({valid['share']:.1%}); "
          f"finish reasons {valid['finish_reasons']}")  # fmt: skip
    print(f"{'mode':<8}{'tokens/s':>12}{'tokens/server CPU s':>22}{'completion tokens/round':>26}")
    for mode in runs:
        per_round = statistics.median(n for _, n in runs[mode])
        per_cpu_s = statistics.median(cpu_rates[mode])
        print(f"{mode:<8}{statistics.median(rates[mode]):>12.1f}{per_cpu_s:>22.1f}{per_round:>26.0f}")
    print(f"guided / free tokens/s: {ratio:.2f}x wall, {cpu_ratio:.2f}x per server CPU second, at "
          f"{args.concurrency} concurrent requests (shared machine: wall timings are noisy)")  # fmt: skip
    result = {
        "settings": vars(args) | {"out": str(args.out), "schemas": len(SCHEMAS), "temperature": TEMPERATURE},
        "validity": valid,
        "rounds": {mode: [{"wall_s": s, "completion_tokens": n} for s, n in r] for mode, r in runs.items()},
        "tokens_per_s": {mode: statistics.median(r) for mode, r in rates.items()},
        "server_cpu_s": cpu,
        "tokens_per_server_cpu_s": {mode: statistics.median(r) for mode, r in cpu_rates.items()},
        "guided_over_free": ratio,
        "guided_over_free_per_cpu_s": cpu_ratio,
    }
    _harness.append_record(args.out, "structured_outputs", result, args.label)


if __name__ == "__main__":
    main()
