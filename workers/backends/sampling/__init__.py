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

Every generation owns one ``numpy.random.Generator`` (PCG64) seeded from the
request's seed, or from a random seed that is recorded so the run can be
repeated. Sampling draws exactly one number per sampled token and greedy
decoding draws none, so saving the generator state after any step and
restoring it later continues the very same random stream: that is what makes
a resumed generation token-for-token equal to an uninterrupted one. The
penalties' memory (which ids were seen, how often each was generated) needs
no snapshot: it is the prompt plus the generated ids, which a resumed
generation passes back in.

The modules:

- ``settings``: :class:`SamplingSettings` and the request's knobs resolved against the model's
  ``generation_config.json`` (:class:`SamplingDefaults`);
- ``penalties``: the repetition, frequency and presence penalties and the ids they remember;
- ``draw``: temperature, top_k, top_p and min_p, and the one uniform draw;
- ``sampler``: :class:`Sampler`, one generation's picks (greedy ones from the device's candidates
  too) and its random stream;
- ``pool``: :class:`SamplingPool`, a decode step's rows sampled on several threads;
- ``scratch``: each thread's work arrays.
"""

from workers.backends.sampling.pool import SamplingPool, automatic_sampling_threads
from workers.backends.sampling.sampler import Sampler
from workers.backends.sampling.settings import SamplingDefaults, SamplingSettings

__all__ = ["Sampler", "SamplingDefaults", "SamplingPool", "SamplingSettings", "automatic_sampling_threads"]
