"""jaxllm: LLM inference as pure JAX functions over pytrees.

Dimension alphabet, used the same way in names (`x_BTD`), einsums and docstrings:
  B batch, T new tokens, S cache length, D model width, N query heads, K KV heads,
  G = N/K query heads per KV head, H head dim, F FFN width, V vocab, L layers,
  E experts, A active experts per token, J a small fused axis (q/k/v groups, gate/up),
  M = B*T tokens in one row and R = M*A (token, expert) assignments (MoE routing).
Inside `shard_map`, N, K, F are per-device counts.

Modules import only from those above them:
  config -> quant -> layers -> kernels -> params -> cache -> memory -> model -> sampling ->
  generate -> hf, gguf, loader, chat_template, tokenizer -> cli
"""

from jaxllm import compile_cache
from jaxllm.cache import KVCache, init_cache
from jaxllm.config import ModelConfig
from jaxllm.generate import GenerateOutput, generate, stream
from jaxllm.loader import load
from jaxllm.model import decode_step, forward, prefill
from jaxllm.params import Params, init_params
from jaxllm.sampling import sample
from jaxllm import trace
from jaxllm.trace import summarize, trace_steady


def load_tokenizer(path=None):
    """The model's tokenizer: None (default model), a .gguf file, or an HF directory."""
    from jaxllm.tokenizer import load_tokenizer as _load
    return _load(path)


__all__ = ["KVCache", "GenerateOutput", "ModelConfig", "Params", "decode_step", "forward", "generate",
           "init_cache", "init_params", "load", "load_tokenizer", "prefill", "sample", "stream"]
__all__ += ["summarize", "trace", "trace_steady"]

# The persistent compilation cache, on by default; set up at import, before anything compiles
# (JAX fixes its cache at the first compilation). Raises only for a JAXLLM_NO_COMPILE_CACHE
# that is no on/off switch; an unusable directory means no cache. See compile_cache.py.
compile_cache.enable()
