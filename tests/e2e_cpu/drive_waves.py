"""Client side of the online test: bursts from vLLM's benchmark client, JSON-mode requests within.

Run as a process of its own by ``harness.run_waves``: ``python drive_waves.py PLAN.json OUT.json``.
Each burst is ``vllm bench serve --dataset-name random`` — the entry the ``vllm bench serve``
command calls (``vllm.benchmarks.serve.main`` with that command's own argument parser), invoked
once per burst in this one process, so importing vLLM is paid once and not between bursts.

While a burst runs, a sender thread waits until the server reports requests running
(``vllm:num_requests_running`` on ``/metrics``), then sends the burst's JSON-mode chat requests
(``response_format`` ``json_schema``), so they queue behind, and are scheduled among, the random
requests. Between bursts the client waits for the server to report nothing running or waiting,
then stays idle for the gap, so every burst starts a new DP wave.

From the first burst to the end a sampler thread scrapes ``/metrics`` every ``SAMPLE_S``, keeping the balance
gate's metrics and vLLM's request gauges per engine (``series`` in the output: the test checks the counters move
during the run, ``scripts/plot_gate_metrics.py`` draws them).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

POLL_S = 0.05
SAMPLE_S = 0.5
SAMPLED = ("vllm:balance_", "vllm:num_requests_running", "vllm:num_requests_waiting")
BENCH_KEYS = (
    "completed",
    "failed",
    "num_prompts",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "max_concurrency",
)


def metric_sum(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def sampled_values(text: str) -> dict[str, dict[str, float]]:
    """``{sample name: {engine: value}}`` of the SAMPLED metrics in one /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(SAMPLED) and not sample.name.endswith("_created"):
                values.setdefault(sample.name, {})[sample.labels.get("engine", "")] = sample.value
    return values


class Sampler(threading.Thread):
    """Scrapes /metrics every SAMPLE_S until stopped: ``series`` is a list of ``{"t": s, "values": ...}``."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.series, self.stopped = base_url, [], threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.wait(SAMPLE_S):
            with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
                text = response.read().decode()
            self.series.append({"t": round(time.monotonic() - started, 3), "values": sampled_values(text)})


def chat_json(base_url: str, model: str, schema: dict[str, Any], index: int, timeout: float) -> dict[str, Any]:
    body = {
        "model": model,
        "max_tokens": 96,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": f"City {index} as JSON"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class JsonSender(threading.Thread):
    """Sends ``count`` JSON-mode requests at once, as soon as the burst is under way.

    "Under way": at least ``min_running`` requests running, more than the benchmark client's
    single ready-check request.
    """

    def __init__(self, plan: dict[str, Any], wave: int, count: int) -> None:
        super().__init__(daemon=True)
        self.plan, self.wave, self.count = plan, wave, count
        self.answers: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.running_when_sent = 0.0

    def run(self) -> None:
        base = self.plan["base_url"]
        deadline = time.monotonic() + self.plan["timeout_s"]
        while time.monotonic() < deadline:
            self.running_when_sent = metric_sum(base, "vllm:num_requests_running")
            if self.running_when_sent >= self.plan["min_running"]:
                break
            time.sleep(POLL_S)
        threads = [
            threading.Thread(target=self._one, args=(self.wave * 100 + i,), daemon=True) for i in range(self.count)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.plan["timeout_s"])

    def _one(self, index: int) -> None:
        try:
            self.answers.append(
                chat_json(self.plan["base_url"], self.plan["model"], self.plan["schema"], index, self.plan["timeout_s"])
            )
        except Exception as error:  # reported to the test, which fails on it
            self.errors.append(f"JSON request {index}: {error!r}")


def wait_drained(base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (metric_sum(base_url, "vllm:num_requests_running") + metric_sum(base_url, "vllm:num_requests_waiting")) == 0:
            return
        time.sleep(POLL_S)
    raise TimeoutError(f"server still has requests {timeout:.0f} s after the burst")


def bench_args(plan: dict[str, Any], wave: dict[str, Any], seed: int) -> list[str]:
    return [
        "--backend",
        "openai",
        "--base-url",
        plan["base_url"],
        "--model",
        plan["model"],
        "--tokenizer",
        plan["model"],
        "--dataset-name",
        "random",
        "--random-input-len",
        str(wave["input_len"]),
        "--random-output-len",
        str(wave["output_len"]),
        "--random-range-ratio",
        "0.5",
        "--num-prompts",
        str(wave["num_prompts"]),
        "--max-concurrency",
        str(wave["max_concurrency"]),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--ready-check-timeout-sec",
        "120",
        "--disable-tqdm",
    ]


def main(plan_path: str, out_path: str) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plan = json.loads(Path(plan_path).read_text())
    out: dict[str, Any] = {"bench": [], "json": [], "json_errors": [], "running_when_sent": [], "series": []}
    sampler = Sampler(plan["base_url"])
    sampler.start()
    for number, wave in enumerate(plan["waves"]):
        if number:
            wait_drained(plan["base_url"], plan["timeout_s"])
            time.sleep(plan["idle_gap_s"])
        sender = JsonSender(plan, number, wave["json_requests"])
        sender.start()
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        result = bench_main(parser.parse_args(bench_args(plan, wave, seed=number + 1)))
        out["bench"].append({k: result.get(k) for k in BENCH_KEYS})
        sender.join(plan["timeout_s"])
        out["json"] += sender.answers
        out["json_errors"] += sender.errors
        out["running_when_sent"].append(sender.running_when_sent)
        out["series"] = list(sampler.series)
        Path(out_path).write_text(json.dumps(out, indent=1))
    wait_drained(plan["base_url"], plan["timeout_s"])
    sampler.stopped.set()
    sampler.join(30)
    out["series"] = sampler.series
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
