"""Test-only vLLM plugins that let a real ``vllm serve`` run on a CPU machine with a fake forward.

Nothing here is installed: the directory above this package is put on ``PYTHONPATH`` by the test
harness, and the ``balance_fake_forward-0.1.0.dist-info`` beside it declares the entry points
vLLM discovers there (``importlib.metadata`` reads ``*.dist-info`` on ``sys.path``):

* ``vllm.platform_plugins`` ``balance_fake_forward``: :class:`platform.FakeForwardPlatform`,
  vLLM's own CPU platform whose worker is :class:`worker.FakeForwardWorker` (no model weights,
  no kernels: ``sample_tokens`` returns token ids the request's grammar allows);
* ``vllm.general_plugins`` ``balance_gate_check``: :func:`gate_check.install`, which records in
  every engine core whether a step admitted a request while the balance gate was closed.

Both load only when ``VLLM_PLUGINS`` names them (the harness sets it).
"""

PLATFORM_QUALNAME = "balance_fake_forward.platform.FakeForwardPlatform"


def platform_plugin() -> str:
    """vLLM calls this when it resolves ``current_platform`` (every process)."""
    return PLATFORM_QUALNAME
