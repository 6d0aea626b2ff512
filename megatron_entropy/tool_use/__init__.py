"""Multi-turn rollouts with tools: the policy calls tools across turns (engine.py wraps any
rollout engine in the tool-calling loop), the tools themselves (tools.py: the API, the registry,
the calculator and the sandboxed Python tool of sandbox.py), the worker processes that run them
(pool.py), how calls and results are written (formats.py), entropy-aware branching
(branching.py) and the per-turn metrics (metrics.py). Its settings are the config tree's
``rollout.tools`` (config/tools.py)."""
