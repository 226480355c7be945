"""Balance scheduling on vLLM's Ray DP backend, end to end on CPU: a real two-node Ray cluster, real ``vllm serve``.

What runs: a Ray cluster of its own on this machine (``ray start --head`` plus one more ``ray start``: two raylets,
so the two DP ranks are placed on different Ray nodes, as on a real cluster), and vLLM's own server started with
``--data-parallel-backend ray --data-parallel-size 2 --enable-expert-parallel`` against it: API server, DP
coordinator, and two MoE DP engine *actors*, one per Ray node. Only the model forward is fake (``fake_forward/``,
whose platform counts a rank's devices in Ray's ``CPU`` resource). Load: ``vllm bench serve`` in bursts with idle
gaps and JSON-mode requests (``harness.run_waves``), as the multiprocess test.

It would fail on: a request that never finishes; actors not on two different Ray nodes; balance on without both
actors running ``BalanceDPMoEEngineCoreActor`` and agreeing, or with a rank whose gate never closed, or one that
admitted while it was closed (``gate_check``); balance off with anything balanced or gated; a Ray node with another
release of the package that is not refused by the start-up agreement on every rank (or, without the package, a
head that does not fail at once); and any Ray or vLLM process left behind. vLLM kills its actors at shutdown
(``ray.kill``), so the engines' stats line is mostly lost: gated steps come from the gate-check lines the actors log
while they run. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from harness import (
    BALANCE_ON,
    Server,
    Watchdog,
    Wave,
    final_stats,
    free_port,
    gate_checks,
    gate_violations,
    kill_tree,
    run_waves,
    server_env,
)
from test_online_serving import ENGINE_ARGS
from tiny_model import write_tiny_moe_model

DP_SIZE = 2
# Two loopback addresses, one per Ray node: Ray 2.60 replaces 127.0.0.1 (only that one) by the machine's address
# (resolve_ip_for_localhost), and vLLM 0.33's DP placement wants one head node per IP. The driver (vllm serve)
# resolves its node IP to the head's.
HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
# Two short bursts (concurrency 12 > DP x max_num_seqs = 8, so the gate closes in each) and one idle gap.
WAVES = [Wave(num_prompts=24, max_concurrency=12, json_requests=2), Wave(num_prompts=16, max_concurrency=12)]
IDLE_GAP_S = 2.0
RAY_START_TIMEOUT_S = 180.0
RUN_BOUND_S = 600.0
AGREEMENT_BOUND_S = 15  # VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S for the disagreeing group
REFUSAL_BOUND_S = 300.0  # start-up (vLLM import in the API server and both actors) plus the agreement bound
ACTOR_LINE = re.compile(
    r"\((\w*DPMoEEngineCoreActor) pid=(\d+)\)[^\n]*?Balance scheduling: (this DP engine core is|all)"
)


@dataclass
class RayCluster:
    """Two raylets on this machine; ``nodes`` are the ``ray start --block`` processes (one session each)."""

    address: str
    node_ip: str
    nodes: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def sessions(self) -> set[int]:
        return {node.pid for node in self.nodes}

    def processes(self) -> list[psutil.Process]:
        """Every live process of this cluster (its raylets, GCS, agents and workers, actors included)."""
        found = []
        for proc in psutil.process_iter(["status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getsid(proc.pid) in self.sessions() and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        return found

    def actor_sessions(self) -> dict[int, int]:
        """pid -> Ray node (session) of each DP engine actor alive now."""
        return {p.pid: os.getsid(p.pid) for p in self.processes() if "EngineCoreActor" in " ".join(_cmdline(p)[:1])}


def _cmdline(proc: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return proc.cmdline()
    return []


def _ray_start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    ray = Path(sys.executable).parent / "ray"
    node_args = ["--num-cpus", "2", "--object-store-memory", "100000000", "--disable-usage-stats", "--block"]
    agent_args = ["--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [str(ray), "start", *args, *node_args, *agent_args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + RAY_START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if node.poll() is not None or time.monotonic() > deadline:
            kill_tree(node, timeout=10)
            raise AssertionError(f"ray start did not start: {log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.5)
    return node


@contextlib.contextmanager
def ray_cluster(workdir: Path, second_node_pythonpath: str | None = None) -> Iterator[RayCluster]:
    """Starts a head and one more node (its ``PYTHONPATH`` optionally replaced: a node whose Python environment
    differs), yields the cluster, and stops every one of its processes, checking none is left."""
    # Ray's socket paths must stay short: its temp dir is not under pytest's tmp_path.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayt-", dir="/tmp"))
    env = dict(server_env(), RAY_DEDUP_LOGS="0")
    port, nodes, logs = free_port(), [], [workdir / "ray-head.log", workdir / "ray-node1.log"]
    try:
        head_args = ["--head", "--port", str(port), "--temp-dir", str(temp_dir), "--include-dashboard", "false"]
        head_args += ["--ray-client-server-port", str(free_port()), "--node-ip-address", HEAD_IP]
        nodes.append(_ray_start(head_args, logs[0], env))
        node_ip = re.search(r"Local node IP: (\S+)", logs[0].read_text()).group(1)
        # Test traffic stays on loopback: the next node, vLLM's DP master and every request follow the head's IP.
        assert ipaddress.ip_address(node_ip).is_loopback, f"the Ray head registered {node_ip}, not a loopback address"
        node_env = dict(env, PYTHONPATH=second_node_pythonpath) if second_node_pythonpath else env
        node_args = ["--address", f"{node_ip}:{port}", "--node-ip-address", NODE_IP]
        nodes.append(_ray_start(node_args, logs[1], node_env))
        cluster = RayCluster(f"{node_ip}:{port}", node_ip, nodes, logs)
        yield cluster
    finally:
        # The other node before the head: a node whose head is gone outlives SIGTERM until kill_tree's bound
        # (measured: 35 s more per cluster, stopped in start order).
        leftovers = [left for node in reversed(nodes) for left in kill_tree(node, timeout=30)]
        if nodes:
            deadline = time.monotonic() + 30
            while (alive := RayCluster("", "", nodes, logs).processes()) and time.monotonic() < deadline:
                time.sleep(0.5)
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            leftovers += [f"pid {p.pid} {' '.join(_cmdline(p))[:80]}" for p in alive]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, f"Ray processes left after stopping the cluster: {leftovers}"


def ray_serve_args(cluster: RayCluster, balance: bool) -> list[str]:
    return [
        "--data-parallel-backend",
        "ray",
        "--data-parallel-size",
        str(DP_SIZE),
        "--data-parallel-size-local",
        "1",  # one rank per Ray node (vLLM places DP ranks by Ray node)
        "--data-parallel-address",
        cluster.node_ip,  # Ray's node IP: the launcher looks the DP master node up by it
        "--api-server-count",
        "1",
        *ENGINE_ARGS,
        *(BALANCE_ON if balance else []),
    ]


def actor_lines(log: str) -> dict[str, dict[str, str]]:
    """What each DP actor (by pid) logged: its class, and whether it logged the DP group's agreement."""
    seen: dict[str, dict[str, str]] = {}
    for cls, pid, what in ACTOR_LINE.findall(log):
        seen.setdefault(pid, {})["agreement" if what == "all" else "class"] = cls
    return seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_moe_model(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    with ray_cluster(tmp_path_factory.mktemp("ray")) as started:
        yield started


@pytest.mark.parametrize("balance", [True, False], ids=["balance-on", "balance-off"])
def test_ray_dp_waves(model_dir: Path, cluster: RayCluster, tmp_path: Path, balance: bool) -> None:
    started = time.monotonic()
    server = Server(
        model_dir,
        tmp_path / "serve.log",
        ray_serve_args(cluster, balance),
        extra_env={"RAY_ADDRESS": cluster.address, "RAY_DEDUP_LOGS": "0"},
    )
    with Watchdog(server, RUN_BOUND_S) as watchdog:
        try:
            with server:
                placement = cluster.actor_sessions()
                client = run_waves(server, WAVES, IDLE_GAP_S, 4, tmp_path)
        except Exception as error:
            if watchdog.fired:
                raise AssertionError(f"run exceeded {RUN_BOUND_S:.0f} s; log tail:\n{server.log_tail()}") from error
            raise
    wall_s, log, label = time.monotonic() - started, server.log(), "on" if balance else "off"

    assert not server.leftovers, f"processes left after stopping the server: {server.leftovers}"
    # One actor on each Ray node (each raylet runs in the session of its own ``ray start``).
    assert sorted(placement.values()) == sorted(cluster.sessions()), (placement, cluster.sessions())
    for wave, result in zip(WAVES, client["bench"]):
        assert (result["completed"], result["failed"]) == (wave.num_prompts, 0), f"balance {label}: {result}"
    assert not client["json_errors"] and len(client["json"]) == sum(w.json_requests for w in WAVES), client
    actors, checks = actor_lines(log), gate_checks(log)
    assert not gate_violations(log), f"a rank admitted while the gate was closed: {gate_violations(log)}"
    if balance:
        # Every actor's agreement line, which Ray prefixes with the actor's class. The class line the mixin logs
        # before construction is there too where the actor's logging is already set up: vLLM >= 0.33 configures it
        # in EngineCoreActorMixin.__init__, which runs after that line, so there it is dropped.
        balanced = "BalanceDPMoEEngineCoreActor"
        assert len(actors) == DP_SIZE and all(
            a.get("agreement") == a.get("class", balanced) == balanced for a in actors.values()
        ), f"not every actor is balanced and agreed: {actors}"
        # The gate check's count of closed steps, or the stats line where vLLM let an actor log it before killing it.
        gated = {rank: c["closed_steps"] for rank, c in checks.items()}
        gated.update({rank: s["gated_steps"] for rank, s in final_stats(log).items()})
        assert set(gated) == set(range(DP_SIZE)) and all(g > 0 for g in gated.values()), gated
        assert all(c["admitted_while_closed"] == 0 for c in checks.values()), checks
    else:
        assert actors == {} and "Balance scheduling: using" not in log, "balance off, yet something balanced ran"
        assert "(DPMoEEngineCoreActor pid=" in log, "the stock actors did not log"
        assert final_stats(log) == {} and checks == {}, "balance off, yet some rank gated a step"
        gated = {}
    print(
        f"\n[ray dp e2e] balance {label}: start-up {server.startup_s:.1f} s, actors on Ray nodes "
        f"{sorted(placement.values())}, {sum(w.num_prompts + w.json_requests for w in WAVES)} requests completed, "
        f"gated steps per rank {gated or 'none'}; run {wall_s:.1f} s"
    )


def _refused_start(model_dir: Path, workdir: Path, node_package: Path) -> tuple[str, float]:
    """Balance on, the second Ray node's Python environment finding ``node_package`` first: the head's start-up
    must fail (not hang) within the bound, leaving no process of the server and no actor in the cluster."""
    fake_forward = server_env()["PYTHONPATH"]
    started = time.monotonic()
    with ray_cluster(workdir, second_node_pythonpath=f"{node_package}{os.pathsep}{fake_forward}") as cluster:
        server = Server(
            model_dir,
            workdir / "serve.log",
            ray_serve_args(cluster, balance=True),
            extra_env={
                "RAY_ADDRESS": cluster.address,
                "RAY_DEDUP_LOGS": "0",
                "VLLM_ASCEND_BALANCE_AGREEMENT_TIMEOUT_S": str(AGREEMENT_BOUND_S),
            },
        )
        server.start()
        try:
            assert server.proc is not None
            server.proc.wait(timeout=REFUSAL_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the head still runs after {REFUSAL_BOUND_S:.0f} s (hung):\n{server.log_tail()}")
        finally:
            server.stop()
        failed_s = time.monotonic() - started
        assert server.proc.returncode != 0 and not server.leftovers, (server.proc.returncode, server.leftovers)
        deadline = time.monotonic() + 60  # Ray reaps the dead actors' workers
        while (left := cluster.actor_sessions()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"DP engine actors left in the cluster: {left}"
    return server.log(), failed_s


def _node_package(root: Path, other_code: bool) -> Path:
    """A ``vllm_ascend`` package that shadows the installed one on a node: empty (the package is missing there), or
    this package's four balance modules with the engine core's changed by one comment (another release of it)."""
    installed = Path(sysconfig.get_paths()["purelib"]) / "vllm_ascend" / "core"
    core = root / "vllm_ascend" / "core"
    core.mkdir(parents=True)
    (root / "vllm_ascend" / "__init__.py").write_text("")
    if other_code:
        (core / "__init__.py").write_text("")
        for name in ("balance_scheduler.py", "balance_seam.py", "balance_rule.py", "balance_engine_core.py"):
            shutil.copy(installed / name, core / name)
        with open(core / "balance_engine_core.py", "a") as module:
            module.write("# another release of the balance scheduling package\n")
    return root


def test_a_node_with_other_balance_code_fails_the_agreement(model_dir: Path, tmp_path: Path) -> None:
    """Both actors run balance scheduling, but the second node's package differs: every rank refuses at once, naming
    the other rank and 'code', and the head's start-up fails with that error."""
    log, failed_s = _refused_start(model_dir, tmp_path, _node_package(tmp_path / "node-package", other_code=True))
    refusal = r"Balance scheduling: DP rank (\d) runs balance scheduling with \{[^}]*\}, but DP rank\(s\) differ: "
    refusals = re.findall(refusal + r"\{(\d): \{'code'", log)
    assert {rank for rank, _ in refusals} == {"0", "1"} and all(a != b for a, b in refusals), (
        f"not every rank refused naming the other's code:\n{log[-6000:]}"
    )
    print(f"\n[ray dp e2e] node with other balance code: both ranks refused, head exited after {failed_s:.1f} s")


def test_a_node_without_the_package_fails_the_start_up(model_dir: Path, tmp_path: Path) -> None:
    """The second node lacks the package: Ray cannot build the actor there and says so (naming the module); the
    head fails at once instead of hanging (the balanced rank, if it got as far, gives up within the agreement
    bound)."""
    log, failed_s = _refused_start(model_dir, tmp_path, _node_package(tmp_path / "node-package", other_code=False))
    assert "failed to import on the worker" in log and "No module named 'vllm_ascend.core" in log, log[-6000:]
    print(f"\n[ray dp e2e] node without the package: actor import refused, head exited after {failed_s:.1f} s")
