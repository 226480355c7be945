"""Test-only vLLM plugin that lets a real ``vllm serve`` of a tiny MoE run with DP 2 + EP on vLLM's CPU build.

Nothing here is installed: the harness puts the directory above this package on ``PYTHONPATH`` and names the plugin
in ``VLLM_PLUGINS``; the ``balance_real_forward-0.1.0.dist-info`` beside it declares the entry point
(``cpu_fixes.install``). See ``cpu_fixes`` for the three gaps it fills.
"""
