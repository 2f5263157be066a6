"""A plain ONNX Runtime KV-cache loop over an Optimum-named decoder, the way optimum runs one.

Only numpy and onnxruntime: ``fixture_models.exports`` records the dynamically
quantized graphs' references with it, and the tests compute with it what those
graphs give on the CPU they run on (``tests/support/quantized.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import onnxruntime

# MLAS asked to run uint8 x int8 products as uint8 x uint8 (exact) where its kernel would saturate.
EXACT_U8S8_OPTION = "session.x64quantprecision"


def plain_greedy_ids(
    graph: Path,
    *,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    chunk: int | None,
    repetition_penalty: float,
    eos_token_ids: Collection[int],
    exact_u8s8: bool = False,
) -> list[int]:
    """Greedy ids from a plain ``session.run`` KV loop over an Optimum-named graph, as optimum runs it.

    numpy feeds and no IOBinding: the prompt in one call (``chunk`` None) or in ``chunk``-token
    calls, then one token a call, with transformers' repetition penalty over every id so far.
    ``exact_u8s8`` sets ``session.x64quantprecision``: MLAS then computes uint8 x int8 products
    exactly on a CPU whose kernel would saturate (no effect elsewhere).
    """
    options = onnxruntime.SessionOptions()
    if exact_u8s8:
        options.add_session_config_entry(EXACT_U8S8_OPTION, "1")
    session = onnxruntime.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    past = {
        name: np.zeros((1, i.shape[1], 0, i.shape[3]), dtype=np.float32)
        for name, i in inputs.items()
        if name.startswith("past_key_values.")
    }
    sequence, pending, new = list(prompt_ids), list(prompt_ids), []
    while len(new) < max_new_tokens:
        step = pending if chunk is None else pending[:chunk]
        pending = pending[len(step) :]
        start = len(sequence) - len(pending) - len(step)
        feeds = {
            "input_ids": np.asarray([step], dtype=np.int64),
            "attention_mask": np.ones((1, start + len(step)), dtype=np.int64),
            "position_ids": np.arange(start, start + len(step), dtype=np.int64)[None, :],
            **past,
        }
        result = dict(zip(outputs, session.run(outputs, {k: v for k, v in feeds.items() if k in inputs}), strict=True))
        past = {name: result[name.replace("past_key_values", "present")] for name in past}
        if pending:
            continue
        logits = result["logits"][0, -1].astype(np.float32)
        seen = np.unique(np.asarray(sequence))
        scores = logits[seen]
        logits[seen] = np.where(scores < 0, scores * repetition_penalty, scores / repetition_penalty)
        token = int(np.argmax(logits))
        new.append(token)
        sequence.append(token)
        if token in eos_token_ids:
            break
        pending = [token]
    return new
