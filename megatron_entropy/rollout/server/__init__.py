"""Inference servers (vLLM, SGLang) behind the rollout engines, one concern per module.

- ``errors``: what a server failure raises, named once for every module here.
- ``process``: one server process (its command line, port, environment and log), started,
  signalled and stopped with its process group; also for the Slurm server tasks.
- ``eventloop``: the event loop every server call runs on (a background thread's, or one per
  call).
- ``supervisor``: the servers' lives: launched or connected, health probes, hung and dead
  servers marked and restarted.
- ``dispatch``: requests sent to the least-loaded server, retried or resumed.
- ``control``: control calls to every server at once, and the pause gate at weight pushes.
- ``metrics``: what the servers report each step.
- ``pool``: ``ServerPool``, the servers of one engine, putting those together.
- ``partial``: answers a server aborted, and the partial rollouts that resume them.
- ``engine``: ``ServerEngine``, the rollout engine over a pool, with the one generate loop.
- ``vllm``, ``sglang``: what each serving stack does its own way (payloads, answers, endpoints,
  weight sync, aborts).

Nothing is re-exported here: importing one module (``partial`` from the trainer, ``process``
from the Slurm helpers) loads neither aiohttp nor an engine.
"""
