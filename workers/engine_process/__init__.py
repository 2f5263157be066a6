"""The engine core in a process of its own (docs/decisions/0008, docs/workers.md).

A worker process keeps Django, Celery, the commits and Redis; its models, their
batch engines, the sampler, the detokeniser, stop strings and constraints run in
one child process, the *engine process*, which imports no Django at all. The
model thread there has a GIL of its own: no commit, no task thread and no
Redis client ever makes it wait.

- ``messages``: what crosses the pipe between the two, both ways;
- ``host``: the engine process's side (``python -m workers.engine_process.host``);
- ``client``: the worker's side: the child's start, watch and end, and the
  ``LoadedModel``, ``Engine`` and ``Generation`` a worker uses, so that
  ``workers.execution`` does not know the model runs elsewhere.

Rows cross as small messages (ids, settings, a snapshot's state, the steps'
text), batched per engine step; logits and the KV cache never leave the
engine process.
"""
