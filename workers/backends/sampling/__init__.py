"""Token sampling as transformers applies it, with a private, snapshot-able random generator.

A logits row goes through what ``transformers`` 4.57's ``generate`` builds in
``_get_logits_processor``, in its order, with OpenAI's frequency and presence
penalties (which transformers lacks) where vLLM applies them: the repetition
penalty, then the frequency and presence penalties (all three always, greedy
decoding included), then, only when sampling, temperature, top_k, top_p and
min_p; greedy takes the argmax after the penalties. So greedy output equals
``model.generate(do_sample=False)`` with the same generation config (and
those two penalties off).

The frequency and presence penalties count generated ids only, never the
prompt: an id generated ``c > 0`` times so far loses
``c * frequency_penalty + presence_penalty``, in float32 and frequency first,
as vLLM subtracts them. Both are off at 0, which costs nothing.

Every generation owns a snapshot-able random stream, so a resumed generation
continues token for token (:mod:`workers.backends.sampling.sampler`).
"""

from workers.backends.sampling.pool import SamplingPool, automatic_sampling_threads
from workers.backends.sampling.sampler import Sampler
from workers.backends.sampling.settings import SamplingDefaults, SamplingSettings

__all__ = ["Sampler", "SamplingDefaults", "SamplingPool", "SamplingSettings", "automatic_sampling_threads"]
