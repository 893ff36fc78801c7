"""jaxllm: LLM inference as pure JAX functions over pytrees.

Dimension alphabet, used the same way in names (`x_BTD`), einsums and docstrings:
  B batch, T new tokens, S cache length, D model width, N query heads, K KV heads,
  G = N/K query heads per KV head, H head dim, F FFN width, V vocab, L layers,
  E experts, A active experts per token, J a small fused axis (q/k/v groups, gate/up),
  M = B*T tokens in one row and R = M*A (token, expert) assignments (MoE routing).
Inside `shard_map`, N, K, F are per-device counts.

Layers: a module imports only from its own layer or those before it, and no two modules import
each other, not even inside a function (tests/test_layering.py holds the same list):
  env, checks -> runtime -> layers (dense, moe, quant) -> kernels (one family a module, tuning) ->
  model (config, params, cache, plan, transformer, sharding) -> families (HF config keys, tensor
  names, GGUF archs per model_type) -> io (hf, gguf, reading, checkpoint, loader, paths, compile_cache) ->
  text (tokenizer, chat_template, detokenize) -> engine (sampling, memory, steps, compile, generate, score, batching) ->
  tools (trace, telemetry, roofline, presets) -> this public API -> cli -> __main__
"""

from jaxllm.engine.batching import BatchingEngine as Engine
from jaxllm.engine.generate import GenerateOutput, generate, stream
from jaxllm.engine.sampling import sample
from jaxllm.engine.steps import decode_step, forward, prefill
from jaxllm.io import compile_cache
from jaxllm.io.loader import load
from jaxllm.model.cache import KVCache, init_cache
from jaxllm.model.config import ModelConfig
from jaxllm.model.params import Params, init_params
from jaxllm.text.tokenizer import load_tokenizer
from jaxllm.tools import trace
from jaxllm.tools.trace import summarize, trace_steady


__all__ = ["Engine", "KVCache", "GenerateOutput", "ModelConfig", "Params", "decode_step", "forward", "generate",
           "init_cache", "init_params", "load", "load_tokenizer", "prefill", "sample", "stream"]
__all__ += ["summarize", "trace", "trace_steady"]

# The persistent compilation cache, on by default; set up at import, before anything compiles
# (JAX fixes its cache at the first compilation). Raises only for a JAXLLM_NO_COMPILE_CACHE
# that is no on/off switch; an unusable directory means no cache. See io/compile_cache.py.
compile_cache.enable()
