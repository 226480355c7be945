"""Pieces of the data-parallel serving simulator driven by ``scripts/simulate_dp.py``.

Each module owns one responsibility: ``costmodel`` (step time from a JSON profile), ``workload``
(request lengths and the client's arrival process), ``router`` (which DP rank gets a request),
``cluster`` (real vLLM schedulers stepped in lockstep), ``metrics`` (per-request and per-step
records turned into the result table), ``settings`` (run parameters and presets), ``simulation``
(one run, wiring them together) and ``plotting``.
"""
