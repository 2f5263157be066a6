"""One sequence through the session: a batch of one row (``KVBatch``) fed a prompt in its chunks, then token by token.

A prompt goes in whole when it fits ``prefill_chunk``, else in chunks of that
size whose last one (whatever remains) is one call. It must not be split
otherwise: a dynamically quantized graph (``onnxruntime.quantization``'s
int8) computes its activation scales over the tokens of each call, so
another split gives other logits, and the tokens would differ from the
exporting tool's own runtime, which feeds the prompt in one call.

Optimum's legacy merged decoder takes ``use_cache_branch``: False on the
first call (with the empty past Optimum itself feeds), True on every call
after, as ``ORTModelForCausalLM.forward`` does.

The batch engine (``workers.backends.onnx.engine``) runs the same calls for
rows that join a running batch, so a row alone and a row in a batch share
every line up to the batched decode step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from workers.backends.onnx.kv_batch import CacheOps, KVBatch
from workers.backends.onnx.runtime import ModelRuntime


def prompt_calls(count: int, chunk: int) -> list[int]:
    """How many ids each call of a ``count``-id feed takes: chunks of ``chunk``, the rest in one last call."""
    sizes = []
    while count > chunk:
        sizes.append(chunk)
        count -= chunk
    sizes.append(count)
    return sizes


class KVDecoder:
    """Feeds token ids through the session, keeping the KV cache on the device.

    :meth:`feed` takes any number of ids (a prompt, or one sampled token) and
    returns the logits of the last position as a float32 host array;
    a prompt goes in calls of at most ``prefill_chunk`` ids (the model's).
    """

    def __init__(self, runtime: ModelRuntime, *, prefill_chunk: int, ops: CacheOps | None = None) -> None:
        self.batch = KVBatch(runtime, ops=ops)
        self._chunk = prefill_chunk

    @property
    def past_length(self) -> int:
        return int(self.batch.lengths[0])

    def feed(self, ids: Sequence[int]) -> np.ndarray:
        """Append ``ids`` to the cache; the logits row (vocabulary) after the last one."""
        if not ids:
            raise ValueError("feed needs at least one token id")
        start = 0
        for size in prompt_calls(len(ids), self._chunk)[:-1]:
            self.call(ids[start : start + size], want_logits=False)
            start += size
        logits = self.call(ids[start:], want_logits=True)
        assert logits is not None
        return logits

    def call(self, ids: Sequence[int], *, want_logits: bool) -> np.ndarray | None:
        """One session call over ``ids``, as given (no chunking)."""
        logits = self.batch.feed(np.asarray([ids], dtype=np.int64), want_logits=want_logits)
        return None if logits is None else logits[0]
