"""The model as pure functions: embed -> L blocks -> norm -> logits, with or without a KV cache.

`forward` scores whole sequences (no cache kept). `prefill` and `decode_step` write new tokens
into a `KVCache` at each row's end and return logits for the last position only. The public
`forward`/`prefill`/`decode_step` (engine/steps.py) check their inputs on the host; `step` is the
jitted pure function they call, for engines that keep their own bookkeeping.
"""

import math
import os
from functools import partial

import jax
import jax.numpy as jnp

from jaxllm import kernels
from jaxllm.layers import dense as L
from jaxllm.layers.quant import QuantizedWeight
from jaxllm.model import sharding
from jaxllm.model.cache import KVCache, init_cache
from jaxllm.model.config import ModelConfig, rope_frequencies
from jaxllm.model.params import Layer, Params


def _attention_block(cfg: ModelConfig, layer: Layer, qkv_BTKJH, positions_BT, kv, end_B,
                     mask_BTS, inv_freq, rope_scale, window=None, unroll_BT=None, fused=None):
    """Self-attention of T new tokens over the cache; returns (heads [B, T, K*G*H], kv).

    `qkv_BTKJH` is the projection of the normed tokens, bias included: per KV head, G queries,
    then k, then v.

    `kv` is this layer's (k, v, k_scale, v_scale) cache arrays; the scales are None unless int8.
    Row b's new tokens go to slots end_B[b] onward.
    `unroll_BT` marks a fresh prefill (see `_hidden`): the tokens come rotated to start at index
    0, attend among themselves only, and go into the cache rotated back by these indices.
    `fused` marks a decode step taking the Pallas kernel: (start_B, rotation_P2R (cos and sin by
    position, `rotation_table`), interpret, split_out); with split_out the heads may come back as a
    `kernels.SplitHeads` for `_project`.

    Inside shard_map, K is the device's KV heads.
    """
    G = cfg.q_per_kv
    B, T, K, _, H = qkv_BTKJH.shape
    if fused is not None:  # rotation, cache writes and attention in one kernel
        start_B, rotation_P2R, interpret, split_out = fused
        out_BKGH, k_cache, v_cache = kernels.decode_attention(
            qkv_BTKJH[:, 0], kv[0], kv[1], end_B, start_B, rotation_P2R, window=window,
            q_norm_H=layer.q_norm, k_norm_H=layer.k_norm, eps=cfg.rms_norm_eps, interpret=interpret,
            split_out=split_out)
        if isinstance(out_BKGH, kernels.SplitHeads):
            return out_BKGH, (k_cache, v_cache, None, None)
        return out_BKGH.reshape(B, T, K * G * H), (k_cache, v_cache, None, None)
    q_BTNH = qkv_BTKJH[:, :, :, :G].reshape(B, T, K * G, H)
    k_BTKH, v_BTKH = qkv_BTKJH[:, :, :, G], qkv_BTKJH[:, :, :, G + 1]
    if layer.q_norm is not None:  # Qwen3: per-head RMSNorm before the rotation
        q_BTNH = L.rms_norm(q_BTNH, layer.q_norm, cfg.rms_norm_eps)
        k_BTKH = L.rms_norm(k_BTKH, layer.k_norm, cfg.rms_norm_eps)
    q_BTNH = L.rope(q_BTNH, positions_BT, inv_freq, rope_scale)
    k_BTKH = L.rope(k_BTKH, positions_BT, inv_freq, rope_scale)
    if unroll_BT is not None:
        out_BTKGH = L.causal_attention(q_BTNH, k_BTKH, v_BTKH, window).reshape(B, T, K, G, H)
        k_BTKH, v_BTKH = (jnp.take_along_axis(x, unroll_BT[:, :, None, None], axis=1)
                          for x in (k_BTKH, v_BTKH))
    end_B = None if unroll_BT is not None else end_B  # a fresh prefill writes every row at slot 0
    kv = tuple(_write(cache, new_BKTH, scale, end_B) for cache, new_BKTH, scale in
               ((kv[0], k_BTKH.transpose(0, 2, 1, 3), kv[2]), (kv[1], v_BTKH.transpose(0, 2, 1, 3), kv[3])))
    (k_cache, k_scale), (v_cache, v_scale) = kv
    if unroll_BT is None:
        out_BTKGH = L.attention(q_BTNH.reshape(B, T, K, G, H), k_cache, v_cache, mask_BTS, k_scale,
                                v_scale)
    return out_BTKGH.reshape(B, T, K * G * H), (k_cache, v_cache, k_scale, v_scale)


def _attention_out(cfg: ModelConfig, layer: Layer, heads_BTC, axis=None):
    """The output projection of the heads [B, T, K*G*H], psummed over `axis` if heads are split."""
    # One flat contraction over (K, G, H): given as three axes, XLA transposed all of wo per step.
    out_BTD = L.project(heads_BTC, layer.wo.reshape(layer.wo.shape[0], -1))
    if axis is not None and L.is_split(layer.wqkv.shape[0], cfg.num_kv_heads):
        out_BTD = jax.lax.psum(out_BTD, axis)  # each device's heads add a part; the bias comes once
    if layer.bo is not None:
        out_BTD = out_BTD + layer.bo
    return out_BTD


def _write(cache_BKSH, new_BKTH, scale_BKS, end_B):
    """Write each row's T new slots at its end_B[b] (all at slot 0 where end_B is None: a fresh
    prefill, one update); an int8 cache (scale given) quantizes them per slot first."""
    zero = jnp.zeros((), jnp.int32)

    def put(into, x):
        if end_B is None:
            return jax.lax.dynamic_update_slice(into, x, (zero,) * into.ndim)
        # Per row (vmapped: one scatter of B updates [K, T, ...] at (0, end_b, ...)).
        at = lambda end: (zero, end) + (zero,) * (into.ndim - 3)  # a row's [K, S, ...]
        return jax.vmap(lambda a, b, end: jax.lax.dynamic_update_slice(a, b, at(end)))(into, x, end_B)
    if scale_BKS is None:
        return put(cache_BKSH, new_BKTH.astype(cache_BKSH.dtype)), None
    q_BKTH, s_BKT = L.quantize_kv(new_BKTH)
    return put(cache_BKSH, q_BKTH), put(scale_BKS, s_BKT)


def _ffn_block(cfg: ModelConfig, moe: bool, layer: Layer, h_BTD, axis=None):
    """Dense or MoE SwiGLU; with `axis`, F (or the experts) may be the device's part: psum then."""
    split = (lambda local, total: axis is not None and L.is_split(local, total))
    if moe:
        experts_split = split(layer.experts_gate_up.shape[0], cfg.num_experts)
        # The routing kernel outside shard_map only: inside it, not yet run on GPUs.
        routes = kernels.route(h_BTD.reshape(-1, h_BTD.shape[-1]), layer.router,
                               cfg.experts_per_token, cfg.norm_topk_prob,
                               mode=kernels.route_mode(h_BTD.dtype) if axis is None else None)
        out_BTD = L.moe(h_BTD, layer.router, layer.experts_gate_up, layer.experts_down,
                        cfg.experts_per_token, cfg.norm_topk_prob, routes=routes,
                        expert_axis=axis if experts_split else None)  # moe psums expert splits itself
        partial_sum = split(layer.experts_down.shape[2], cfg.moe_ffn_size)
    else:
        out_BTD = L.mlp(h_BTD, layer.w_gate_up, layer.w_down)
        partial_sum = split(layer.w_down.shape[1], cfg.ffn_size)
    return jax.lax.psum(out_BTD, axis) if partial_sum else out_BTD


# A decode step's attention kernel takes the new tokens' cos and sin from a table of every
# position, which `generate` makes once before its loop: a step made its rows' own in an XLA
# kernel of its own (1.4 us of a Qwen3-0.6B step, H200 trace). With greedy's argmax in blocks
# (`sampling.argmax`), on an H200 (bench, batch 1, prompt 128 + 256 new, same runs, five rounds
# over two runs) Qwen3-0.6B took 0.6512-0.6604 ms a step against 0.6625-0.6870 (1514-1536 tok/s
# against 1456-1510; each change alone 0.6560-0.6645); within the noise SmolLM2 (0.3799-0.3970
# against 0.3870-0.3932), Llama-3.2-1B (0.8096 against 0.8102), the 8B shape (3.9111 against
# 3.9288, at batch 32 4.7174 against 4.7133; one round each).
# The step's tail in a trace (Qwen3-0.6B, host loop): 11.4 us of kernels after the lm_head
# against 13.6. `stream` makes the table once per prompt too; a step given none (`decode_step`
# without one, a sharded step) makes it itself.
def rotation_table(config: ModelConfig, length: int):
    """cos and sin of every position below `length` (float32 [length, 2, R], the attention factor
    included), as `kernels.decode_attention` takes them."""
    inv_freq, rope_scale = rope_frequencies(config)
    positions_S = jnp.arange(length, dtype=jnp.int32).astype(jnp.float32)
    angles_SR = positions_S[:, None] * jnp.asarray(inv_freq)
    return jnp.stack([jnp.cos(angles_SR), jnp.sin(angles_SR)], axis=1) * rope_scale


def _hidden(params: Params, tokens_BT, cache: KVCache, axis=None, fresh: bool = False,
            rotation=None):
    """Run all blocks over T new tokens written at each row's cache.end; returns (x_BTD,
    normed_BTD, new cache): normed_BTD is x_BTD through the final norm where a kernel made it (as a
    `kernels.DigitRow` for an int8 lm_head that takes them), else None.

    `axis`: the tensor-parallel mesh axis when running inside shard_map (see jaxllm.sharding).
    `fresh`: the caller guarantees the cache is empty (every end 0), so the tokens attend only among
    themselves: each row is rotated left by its padding, so its prompt starts at index 0 and
    plain causal attention (a fused kernel on GPUs) needs no padding mask; the keys and values go
    into the cache, and the hidden states come out, rotated back to the left-padded layout.
    `rotation`: `rotation_table(cfg, cache.length)`, made by a caller that runs many steps (else
    a decode step through the attention kernel makes it).
    """
    cfg = params.config
    B, T = tokens_BT.shape
    # No dynamic-NTK stretch: forward and generate keep positions within max_position_embeddings,
    # where transformers leaves the base alone; the cache length (left padding, bucket slack)
    # says nothing about how far positions go.
    inv_freq, rope_scale = rope_frequencies(cfg)
    inv_freq = jnp.asarray(inv_freq)
    windows = {cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)}
    t_T = jnp.arange(T, dtype=jnp.int32)
    proj = _project_mode(params, B, T, axis)
    # A decode step through the attention kernel: its arrays, and its static switches (see
    # `_attention_block`'s `fused`), apart so that `_block` takes the switches as static.
    fused_args = fused_static = None
    if fresh:
        roll_BT = (t_T[None, :] + cache.start[:, None]) % T
        unroll_BT = (t_T[None, :] - cache.start[:, None]) % T
        tokens_BT = jnp.take_along_axis(tokens_BT, roll_BT, axis=1)
        positions_BT = jnp.broadcast_to(t_T, (B, T))
        masks = dict.fromkeys(windows)
    else:
        unroll_BT = None
        q_slots_BT = cache.end[:, None] + t_T[None, :]  # each row writes at its own end
        # Left padding sits before start; its (unused) positions are clamped to 0.
        positions_BT = jnp.maximum(q_slots_BT - cache.start[:, None], 0)
        # Inside shard_map too, on each device's KV heads (see sharding.shard_call's check_vma):
        # the 8B shape on two H200s, 3.20-3.22 ms a step against 3.63 with XLA's attention.
        mode = T == 1 and kernels.decode_attention_mode(
            params.dtype, cfg.head_dim, 2 * inv_freq.shape[0], cache.k_scale is not None, cache.length)
        if mode:  # every position's rotation, unless the caller made the table before its loop
            if rotation is None:
                rotation = rotation_table(cfg, cache.length)
            fused_args = (cache.start, rotation)
            fused_static = (mode == "interpret", proj is not None)  # o's kernel may combine splits
        masks = dict.fromkeys(windows) if mode else \
            {w: L.visible_mask(q_slots_BT, cache.start, cache.length, w) for w in windows}
    x_BTD = L.embed_lookup(params.embed, tokens_BT, axis, cfg.vocab_size)
    # Residual adds and norms pair up in `kernels.add_norm`: normed_BTD is then x_BTD through
    # the norm that comes next, made by the same pass. In a prefill always; in a decode step
    # only at batch 1, before a matrix too large for `kernels.project`'s kernel (which folds the
    # norm in itself) or a large int8 one (`kernels.project_folds_norm`). A decode step of 8-32
    # rows of a dense float model takes `_rows_block`, which pairs o's output with the residual
    # so itself.
    fuse = None if axis is not None or (T == 1 and proj is None) else \
        kernels.add_norm_mode(params.dtype)
    normed_BTD = None
    head_VD = params.embed if params.lm_head is None else params.lm_head
    # What the residual stream feeds after each layer: the next layer's qkv, or after the last
    # layer the lm_head (in a decode step; a prefill's final norm takes its last position only):
    # (its norm, its matrix, whether biased), and whether that matrix's kernel folds the norm in.
    nexts = [(nxt.attn_norm, nxt.wqkv, nxt.bqkv is not None) for nxt in params.layers[1:]]
    nexts.append((params.final_norm if T == 1 else None, head_VD, False))
    next_takes = [proj is not None and kernels.project_folds_norm(w, proj, biased=biased)
                  for _, w, biased in nexts]
    # Bounds on the gate/up outputs of the layers whose down takes them as digits
    # (`kernels.down_digits`; not where down adds the residual, the next norm folded), and each
    # such layer's index in them.
    down_at = [i for i, layer in enumerate(params.layers) if fuse and proj and not cfg.is_moe(i)
               and not next_takes[i]
               and kernels.project_digits(layer.w_gate_up, proj, swiglu=True)
               and kernels.down_digits(layer.w_down, proj)]
    down_bounds = kernels.down_bounds([params.layers[i].w_gate_up for i in down_at]) \
        if down_at else None
    new_kv = []
    # A decode step of 8-32 rows runs `_rows_block`, every matrix through kernels.rows_project.
    rows = _rows_mode(params, B, T, axis, fresh)
    for i, layer in enumerate(params.layers):
        window = cfg.sliding_window if cfg.is_sliding(i) else None
        kv = (cache.k[i], cache.v[i], cache.k_scale and cache.k_scale[i],
              cache.v_scale and cache.v_scale[i])
        if rows:
            with jax.named_scope(f"layer_{i}"):
                x_BTD, kv = _rows_block(layer, x_BTD, kv, cache.end, positions_BT, masks[window],
                                        inv_freq, fused_args, cfg=cfg, window=window, mode=rows,
                                        rope_scale=rope_scale, fused_static=fused_static)
            new_kv.append(kv)
            continue
        next_norm, next_w, next_bias = nexts[i]
        # Digits for what comes next (the lm_head's) in a decode step (proj: of one row); a
        # one-token prefill (fresh) keeps a plain normed row, which it reorders with x.
        next_digits = proj is not None and not fresh and kernels.project_digits(
            next_w, proj, biased=next_bias)
        # What down's kernel asks L2 for, None where nothing is: a step without prefetches then
        # traces its layers as one kind (the last one's next matrix, the lm_head, differs).
        ahead_w = next_w if proj and kernels.prefetched(next_w) else None
        first = bool(proj) and kernels.weights_first(
            (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down))
        with jax.named_scope(f"layer_{i}"):
            x_BTD, normed_BTD, kv = _block(
                layer, x_BTD, normed_BTD, kv, cache.end, positions_BT, masks[window], inv_freq,
                unroll_BT, fused_args, next_norm, ahead_w,
                (down_bounds, jnp.int32(down_at.index(i))) if i in down_at else None,
                cfg=cfg, window=window, moe=cfg.is_moe(i), proj=proj, fuse=fuse,
                rope_scale=rope_scale, axis=axis, fused_static=fused_static,
                next_takes=next_takes[i], next_digits=next_digits, weights_first=first)
        new_kv.append(kv)
    if fresh:
        x_BTD, normed_BTD = (None if a is None else jnp.take_along_axis(a, unroll_BT[:, :, None], axis=1)
                             for a in (x_BTD, normed_BTD))
    k, v, k_scale, v_scale = ([kv[j] for kv in new_kv] for j in range(4))
    cache = cache.replace(k=k, v=v, end=cache.end + T,
                          k_scale=None if cache.k_scale is None else k_scale,
                          v_scale=None if cache.v_scale is None else v_scale)
    return x_BTD, normed_BTD, cache


@partial(jax.jit, inline=True, static_argnames=(
    "cfg", "window", "moe", "proj", "fuse", "rope_scale", "axis", "fused_static", "next_takes",
    "next_digits", "weights_first"))
def _block(layer: Layer, x_BTD, normed_BTD, kv, end_B, positions_BT, mask_BTS, inv_freq,
           unroll_BT, fused_args, next_norm, next_w, down_bounds, *, cfg: ModelConfig, window,
           moe: bool, proj, fuse, rope_scale, axis, fused_static, next_takes: bool,
           next_digits: bool = False, weights_first: bool = False):
    """One decoder block of `_hidden`: returns (x_BTD, normed_BTD, kv), normed_BTD being x_BTD
    through `next_norm` where `kernels.add_norm` made it (a `kernels.DigitRow` with `next_digits`),
    else None.

    Jitted and inlined: layers of one shape trace once, and their equations are copied into the
    step (a step traced each of its 32 layers, about a second of a warm-cache first call for the
    8B shape). `next_takes`: whatever comes next (the next qkv or the lm_head) takes `project`'s
    kernel and folds `next_norm` in itself (`kernels.project_folds_norm`); `next_digits`: it
    takes the normed row as a `kernels.DigitRow` (`kernels.project_digits`). Each of the
    projections' kernels asks L2 for the matrix read next (`kernels.prefetched`), the down
    projection's for `next_w` (that one, or None). `weights_first`: the projections' kernels
    load their weights before their input (`kernels.weights_first`). `down_bounds`: (the step's
    `kernels.down_bounds`, this layer's index in them) where gate/up hands down its output as
    digits (`_hidden` decides), else None. The rest is as `_hidden` computes it.
    """
    eps = cfg.rms_norm_eps
    fused = None if fused_args is None else (*fused_args, *fused_static)
    with jax.named_scope("attention"):
        bias = None if layer.bqkv is None else layer.bqkv.reshape(-1)
        qkv_BTKJH = _normed_project(proj, x_BTD, normed_BTD, layer.wqkv, layer.attn_norm, eps,
                                    bias_N=bias, prefetch=(layer.wo,), weights_first=weights_first)
        heads_BTC, kv = _attention_block(cfg, layer, qkv_BTKJH, positions_BT, kv, end_B,
                                         mask_BTS, inv_freq, rope_scale, window, unroll_BT, fused)
        ffn_kernel = proj and not moe and kernels.project_takes(layer.w_gate_up, proj, swiglu=True)
        ffn_norm = ffn_kernel and kernels.project_folds_norm(layer.w_gate_up, proj, swiglu=True)
        if proj:  # with the FFN's norm in project's kernel, o's kernel adds the residual
            wo_DC = layer.wo.reshape(layer.wo.shape[0], -1)
            out_BTD = _project(proj, heads_BTC, wo_DC, bias_N=layer.bo,
                               residual=x_BTD if ffn_norm else None, prefetch=(layer.w_gate_up,),
                               weights_first=weights_first)
        else:
            out_BTD = _attention_out(cfg, layer, heads_BTC, axis)
        ffn_digits = ffn_kernel and kernels.project_digits(layer.w_gate_up, proj, swiglu=True)
        x_BTD, normed_BTD = (out_BTD, None) if ffn_norm else \
            _add_norm(fuse, x_BTD, out_BTD, layer.mlp_norm, eps, digits=ffn_digits)
    with jax.named_scope("moe" if moe else "mlp"):
        folds = ffn_kernel and next_takes
        if ffn_kernel:
            act_BTF = _normed_project(proj, x_BTD, normed_BTD, layer.w_gate_up, layer.mlp_norm,
                                      eps, swiglu=True, prefetch=(layer.w_down,),
                                      weights_first=weights_first, down_digits_of=down_bounds)
            out_BTD = _project(proj, act_BTF, layer.w_down, residual=x_BTD if folds else None,
                               prefetch=(next_w,), weights_first=weights_first)
        else:
            if normed_BTD is None:
                normed_BTD = L.rms_norm(x_BTD, layer.mlp_norm, eps)
            out_BTD = _ffn_block(cfg, moe, layer, normed_BTD, axis)
        # folds: what comes next (qkv, lm_head) folds next_norm into its own kernel
        return (out_BTD, None, kv) if folds else \
            (*_add_norm(fuse, x_BTD, out_BTD, next_norm, eps, digits=next_digits), kv)


@partial(jax.jit, inline=True, static_argnames=("cfg", "window", "mode", "rope_scale",
                                                 "fused_static"))
def _rows_block(layer: Layer, x_BTD, kv, end_B, positions_BT, mask_BTS, inv_freq, fused_args, *,
                cfg: ModelConfig, window, mode: str, rope_scale, fused_static):
    """One decoder block of a decode step of 8-32 rows (`_rows_mode`), its matrices through
    `kernels.rows_project`, whose kernels add the biases and down's residual and make SwiGLU:
    returns (x_BTD, kv). The norm before qkv is XLA's; o's output goes with the residual through
    `kernels.add_norm`, whose kernel makes the FFN's normed input, rounded as before (the sum to
    the model dtype, then the norm). Against o adding the residual in its epilogue and XLA's norm
    after it, same runs (H200, 2026-12-01, `.device/run125.sh`, `run127.sh`): the 8B shape at
    batch 32 4.6823-4.6924 ms a step against 4.6979-4.7120 in five alternating rounds, Mistral-7B
    4.4817 and 4.4867 against 4.5210 and 4.5229; as landed, on a faster machine (`run128.sh`),
    4.5662-4.5826 against 4.5951-4.6089. Our reading, not measured apart: add_norm's PDL signal
    lets gate/up's kernel launch before it ends. The norm before qkv through it too (down without
    its residual) took 4.6798 and 4.6904, no better, so that one stays XLA's."""
    eps = cfg.rms_norm_eps
    B, T, D = x_BTD.shape
    x_MD = x_BTD.reshape(B * T, D)
    project = partial(kernels.rows_project, eps=eps, mode=mode)
    fused = None if fused_args is None else (*fused_args, *fused_static)
    with jax.named_scope("attention"):
        bias = None if layer.bqkv is None else layer.bqkv.reshape(-1)
        qkv_MC = project(x_MD, layer.wqkv.reshape(-1, D), norm_C=layer.attn_norm, bias_N=bias)
        heads_BTC, kv = _attention_block(cfg, layer, qkv_MC.reshape(B, T, *layer.wqkv.shape[:-1]),
                                         positions_BT, kv, end_B, mask_BTS, inv_freq, rope_scale,
                                         window, None, fused)
        out_MD = project(heads_BTC.reshape(B * T, -1), layer.wo.reshape(layer.wo.shape[0], -1),
                         bias_N=layer.bo)
        x_MD, normed_MD = kernels.add_norm(x_MD, out_MD, layer.mlp_norm, eps,
                                           mode=kernels.add_norm_mode(x_MD.dtype))
    with jax.named_scope("mlp"):
        act_MF = project(normed_MD, layer.w_gate_up, swiglu=True)
        x_MD = project(act_MF, layer.w_down, residual_MN=x_MD)
    return x_MD.reshape(B, T, D), kv


def _rows_mode(params: Params, B: int, T: int, axis=None, fresh: bool = False) -> str | None:
    """Whether a step's blocks take `_rows_block`: a decode step (not inside shard_map) of
    kernels.ROWS_MIN to ROWS_MAX rows of a dense float model whose every matrix the kernel's
    tiles divide (`kernels.rows_tiles`) and, below kernels.ROWS_ANY_SIZE rows, is large
    (`kernels.rows_sized`)."""
    if T != 1 or fresh or axis is not None or params.config.num_experts:
        return None
    mode = kernels.rows_project_mode(params.dtype, B)

    def divided(layer):  # (outputs, channels) of qkv, o, gate/up and down
        qkv, o, gate_up, down = layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down
        shapes = ((math.prod(qkv.shape[:-1]), qkv.shape[-1]), (o.shape[0], math.prod(o.shape[1:])),
                  gate_up.shape[1:], down.shape)
        return (not isinstance(qkv, QuantizedWeight) and kernels.rows_sized(B, shapes)
                and all(kernels.rows_tiles(*shape) for shape in shapes))
    return mode if mode and all(divided(layer) for layer in params.layers) else None


def _add_norm(mode: str | None, x_BTD, delta_BTD, norm_D, eps: float, digits: bool = False):
    """(x + delta, its rms_norm by norm_D) through `kernels.add_norm` under `mode`; (x + delta,
    None) when there is no mode or no norm to apply, the consumer norming it itself. With
    `digits` the normed row may come as a `kernels.DigitRow` (its x [B, T, D])."""
    if mode is None or norm_D is None:
        return x_BTD + delta_BTD, None
    B, T, D = x_BTD.shape
    sum_MD, normed = kernels.add_norm(x_BTD.reshape(B * T, D), delta_BTD.reshape(B * T, D),
                                      norm_D, eps, mode=mode, digits=digits)
    if isinstance(normed, kernels.DigitRow):
        return sum_MD.reshape(B, T, D), normed.replace(x=normed.x.reshape(B, T, D))
    return sum_MD.reshape(B, T, D), normed.reshape(B, T, D)


def _normed_project(mode: str | None, x_BTD, normed_BTD, w, norm_D, eps: float, **kw):
    """`_project` of x through norm_D against w: of normed_BTD where `kernels.add_norm` made it,
    else with the norm folded into `kernels.project`."""
    if normed_BTD is None:
        return _project(mode, x_BTD, w, norm_C=norm_D, eps=eps, **kw)
    return _project(mode, normed_BTD, w, **kw)


def _project_mode(params: Params, B: int, T: int, axis=None) -> str | None:
    """Whether a step's projections take `kernels.project` (decode steps, not inside shard_map)."""
    return kernels.decode_project_mode(params.dtype, B) if T == 1 and axis is None else None


def _project(mode: str | None, x_BTC, w, *, residual=None, **kw):
    """`kernels.project` of [B, T, C] activations (or a decode step's `kernels.SplitHeads`)
    against w [O..., C], or with `swiglu` against gate/up [2, F, C]; returns [B, T, O...]
    ([B, T, F]). Its kernel runs under `mode` (see `_project_mode`), XLA's form otherwise."""
    C = w.shape[-1]
    if isinstance(x_BTC, kernels.SplitHeads):  # a decode step's heads, one token per row
        B, T, x_MC = x_BTC.acc.shape[0], 1, x_BTC
    elif isinstance(x_BTC, kernels.DigitRow):  # one normed row, with its digits
        B, T, _ = x_BTC.x.shape
        x_MC = x_BTC.replace(x=x_BTC.x.reshape(B * T, C))
    else:
        B, T, _ = x_BTC.shape
        x_MC = x_BTC.reshape(B * T, C)
    swiglu = kw.get("swiglu", False)
    outs = w.shape[1:2] if swiglu else w.shape[:-1]
    w = w if swiglu else w.reshape(-1, C)
    residual_MN = None if residual is None else residual.reshape(B * T, -1)
    y_MN = kernels.project(x_MC, w, residual_MN=residual_MN, mode=mode, **kw)
    if isinstance(y_MN, kernels.DigitRow):  # gate/up's output for down, with its digits
        return y_MN.replace(x=y_MN.x.reshape(B, T, *outs))
    return y_MN.reshape(B, T, *outs)


def logits(params: Params, x_BTD, proj: str | None = None, normed_BTD=None):
    """Final norm and output projection; float32 logits [B, T, V]. `proj`: see `_project_mode`;
    `normed_BTD`: x_BTD already through the final norm (see `_hidden`)."""
    with jax.named_scope("lm_head"):
        head_VD = params.embed if params.lm_head is None else params.lm_head
        if normed_BTD is not None:
            return _project(proj, normed_BTD, head_VD, out_dtype=jnp.float32)
        return _project(proj, x_BTD, head_VD, norm_C=params.final_norm,
                        eps=params.config.rms_norm_eps, out_dtype=jnp.float32)


# Compiling a program cold, XLA's autotuner times candidate kernels on fresh copies of their
# operands, each between two 8 MiB redzones, while the weights are resident. Its fusion autotuner
# (XLA's own emitters against Triton's block-level one, for every fusion) copied the lm_head to
# time a decode step's lm_head reduction: a process compiling cold peaked at 133.2% (SmolLM2),
# 122.0% (Qwen3-0.6B) and 119.8% (Llama-3.2-1B) of weights + KV cache + one step's activations.
# With it off and redzones of 64 KiB: 108.5%, 101.7% and 101.4%, as with a warm compilation cache
# (108.5%, 101.7%, 99.5%); the 8B shape 100.8% against 105.8%, in int8 102.9% against 104.8%
# (H200, bench, batch 1, an empty cache per process). It had picked Triton's emitter for 1 to 3
# fusions of 60-70 (the loop's stop test; in the 8B shape a decode step's qkv reduction and the
# attention output's convert, 0.2 and 1.5 us faster alone), yet without it the 8B shape's decode
# step took 3.819-3.824 ms against 3.869-3.873 (three alternating rounds); Qwen3-0.6B 0.666-0.671
# against 0.662-0.668 there, 0.6558-0.6604 against 0.6543-0.6634 on another machine (five
# rounds); batch 32 4.691 against 4.676 (one round), int8 2.473 against 2.474, a
# 2048-token prefill 47.38-47.82 ms against 46.86-47.43 (three rounds). The model's programs
# (forward, step, generate's loop) compile so; XLA_FLAGS naming an option when jaxllm is
# imported leave XLA's default.
AUTOTUNE_OPTIONS = {name: value for name, value in {
    "xla_gpu_experimental_enable_fusion_autotuner": False,
    "xla_gpu_redzone_padding_bytes": 1 << 16,
}.items() if name not in os.environ.get("XLA_FLAGS", "")}


def _forward_local(params: Params, tokens_BT, cache: KVCache, axis=None):
    x_BTD, normed_BTD, cache = _hidden(params, tokens_BT, cache, axis, fresh=True)
    return logits(params, x_BTD, normed_BTD=normed_BTD), cache


@partial(jax.jit, compiler_options=AUTOTUNE_OPTIONS)
def _forward(params: Params, tokens_BT):
    B, T = tokens_BT.shape
    cache = init_cache(params.config, B, T, params.dtype)
    if params.tp is not None:  # sharded: per device under shard_map, logits split over V
        return sharding.shard_call(_forward_local, params, tokens_BT, cache, logits_ndim=3)[0]
    return _forward_local(params, tokens_BT, cache)[0]


def _step_local(params: Params, tokens_BT, cache: KVCache, axis=None, fresh: bool = False,
                rotation=None, all_logits: bool = False):
    x_BTD, normed_BTD, cache = _hidden(params, tokens_BT, cache, axis, fresh, rotation)
    proj = _project_mode(params, *tokens_BT.shape, axis)
    if all_logits:
        return logits(params, x_BTD, proj, normed_BTD), cache
    if normed_BTD is not None and not isinstance(normed_BTD, kernels.DigitRow):  # one row if digits
        normed_BTD = normed_BTD[:, -1:]
    return logits(params, x_BTD[:, -1:], proj, normed_BTD)[:, 0], cache


def step(params: Params, tokens_BT, cache: KVCache, fresh: bool = False, rotation=None,
         all_logits: bool = False):
    """Pure step: write each row's T tokens at slots [end_b, end_b + T), at positions
    end_b - start_b + t, each attending over its own row's live slots; then end += T. Returns
    (last-position logits [B, V], cache), or with `all_logits` (static) the logits [B, T, V] of
    every new position (a speculative verify step).

    Unchecked: the caller guarantees max(end) + T <= S and ids within the vocabulary, and with
    `fresh` (static) that the cache is empty (every end 0): a prompt's prefill, which then attends
    among its own tokens without reading the cache. Sharded params (`params.tp`) run it per
    device under shard_map; the logits come back split over V. `rotation`:
    `rotation_table(params.config, cache.length)`, for a loop that makes it once (unsharded).
    """
    with jax.named_scope("prefill" if tokens_BT.shape[1] > 1 else "decode"):
        if params.tp is not None:
            return sharding.shard_call(partial(_step_local, fresh=fresh, all_logits=all_logits),
                                       params, tokens_BT, cache, logits_ndim=3 if all_logits else 2)
        return _step_local(params, tokens_BT, cache, fresh=fresh, rotation=rotation,
                           all_logits=all_logits)


def _donate_cache() -> tuple[int, ...]:
    # CPU cannot donate buffers (and warns each call); on GPU donation makes the update in place.
    return () if jax.default_backend() == "cpu" else (2,)


_step_jit = {}


def jitted_step():
    """`step` under jit with the cache donated where the backend supports it."""
    backend = jax.default_backend()
    if backend not in _step_jit:
        _step_jit[backend] = jax.jit(step, donate_argnums=_donate_cache(), static_argnames=("fresh", "all_logits"),
                                     compiler_options=AUTOTUNE_OPTIONS)
    return _step_jit[backend]
