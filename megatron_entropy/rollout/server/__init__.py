"""Inference servers (vLLM, SGLang) behind the rollout engines, one concern per module.

- ``errors``: what a server failure raises, named once for every module.
- ``process``: one server process (its command line, port, environment and log), started and
  stopped; the URL list of servers started elsewhere.
- ``pool``: ``ServerPool``, the servers of one engine: requests dispatched over asyncio to the
  least-loaded one, health probes, hung and dead servers restarted, drains at weight pushes,
  metrics.
- ``partial``: answers a server aborted, and the partial rollouts that resume them.
- ``engine``: ``ServerEngine``, the rollout engine over a pool, with the one generate loop.
- ``vllm``, ``sglang``: what each serving stack does its own way (payloads, answers, endpoints,
  weight sync, aborts).

Nothing is re-exported here: importing one module (``partial`` from the trainer, ``process`` from
the Slurm helpers) loads neither aiohttp nor an engine.
"""
