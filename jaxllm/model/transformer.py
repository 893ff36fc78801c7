"""The model as pure functions: embed -> L blocks -> norm -> logits, with or without a KV cache.

`forward` scores whole sequences (no cache kept). `prefill` and `decode_step` write new tokens
into a `KVCache` at each row's end and return logits for the last position only. The public
`forward`/`prefill`/`decode_step` (engine/steps.py) check their inputs on the host; `step` is the
jitted pure function they call, for engines that keep their own bookkeeping.
"""

import dataclasses
import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm import kernels
from jaxllm.layers import dense as L
from jaxllm.layers import moe as M
from jaxllm.model import sharding
from jaxllm.model.cache import KVCache, init_cache
from jaxllm.model.config import ModelConfig, rope_frequencies
from jaxllm.model.params import Layer, Params
from jaxllm.model.plan import LayerPlan, Projection, StepPlan, score_switches, step_plan
from jaxllm.runtime import AUTOTUNE_OPTIONS


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
    position, `rotation_table`), interpret, split_out, tuning); with split_out the heads may come
    back as a `kernels.SplitHeads` for `_project`. With T > 1 (a verify step) the kernel's
    few-token form, `kernels.verify_attention`.

    Inside shard_map, K is the device's KV heads.
    """
    G = cfg.q_per_kv
    B, T, K, _, H = qkv_BTKJH.shape
    if fused is not None and T > 1:  # a verify step's few tokens a row, in one kernel
        start_B, rotation_P2R, interpret, _, tuning = fused
        out_BTKGH, k_cache, v_cache = kernels.verify_attention(
            qkv_BTKJH, kv[0], kv[1], end_B, start_B, rotation_P2R, window=window,
            q_norm_H=layer.q_norm, k_norm_H=layer.k_norm, eps=cfg.rms_norm_eps, interpret=interpret,
            tuning=tuning, **score_switches(cfg))
        return out_BTKGH.reshape(B, T, K * G * H), (k_cache, v_cache, None, None)
    if fused is not None:  # rotation, cache writes and attention in one kernel
        start_B, rotation_P2R, interpret, split_out, tuning = fused
        out_BKGH, k_cache, v_cache = kernels.decode_attention(
            qkv_BTKJH[:, 0], kv[0], kv[1], end_B, start_B, rotation_P2R, window=window,
            q_norm_H=layer.q_norm, k_norm_H=layer.k_norm, eps=cfg.rms_norm_eps, interpret=interpret,
            split_out=split_out, tuning=tuning, **score_switches(cfg))
        if isinstance(out_BKGH, kernels.SplitHeads):
            return out_BKGH, (k_cache, v_cache, None, None)
        return out_BKGH.reshape(B, T, K * G * H), (k_cache, v_cache, None, None)
    q_BTNH = qkv_BTKJH[:, :, :, :G].reshape(B, T, K * G, H)
    k_BTKH, v_BTKH = qkv_BTKJH[:, :, :, G], qkv_BTKJH[:, :, :, G + 1]
    if layer.q_norm is not None:  # Qwen3, Gemma 3: per-head RMSNorm before the rotation
        q_BTNH = L.rms_norm(q_BTNH, layer.q_norm, cfg.rms_norm_eps, cfg.norm_offset)
        k_BTKH = L.rms_norm(k_BTKH, layer.k_norm, cfg.rms_norm_eps, cfg.norm_offset)
    q_BTNH = L.rope(q_BTNH, positions_BT, inv_freq, rope_scale)
    k_BTKH = L.rope(k_BTKH, positions_BT, inv_freq, rope_scale)
    scores = dict(scale=cfg.attn_scale, softcap=cfg.attn_logit_softcap)
    if unroll_BT is not None:
        out_BTKGH = L.causal_attention(q_BTNH, k_BTKH, v_BTKH, window, **scores).reshape(B, T, K, G, H)
        k_BTKH, v_BTKH = (jnp.take_along_axis(x, unroll_BT[:, :, None, None], axis=1)
                          for x in (k_BTKH, v_BTKH))
    end_B = None if unroll_BT is not None else end_B  # a fresh prefill writes every row at slot 0
    kv = tuple(_write(cache, new_BKTH, scale, end_B) for cache, new_BKTH, scale in
               ((kv[0], k_BTKH.transpose(0, 2, 1, 3), kv[2]), (kv[1], v_BTKH.transpose(0, 2, 1, 3), kv[3])))
    (k_cache, k_scale), (v_cache, v_scale) = kv
    if unroll_BT is None:
        rows = lambda a: a if a is None or a.shape[0] == B else a[:B]  # the cache's first B rows
        out_BTKGH = L.attention(q_BTNH.reshape(B, T, K, G, H), rows(k_cache), rows(v_cache), mask_BTS,
                                rows(k_scale), rows(v_scale), **scores)
    return out_BTKGH.reshape(B, T, K * G * H), (k_cache, v_cache, k_scale, v_scale)


def _mixed_attention(cfg: ModelConfig, layer: Layer, qkv_1MKJH, kv, inputs, plan: LayerPlan, fused):
    """A `mixed_step`'s attention: of its M tokens the first n are one a decode row, attending over
    the cache (kv's first item) as `_attention_block` does for a decode step; the other b*W are
    the prompts' (rotated, see `_hidden`), attending among themselves, their keys and values
    written into kv's second item, a fresh b-row cache of W slots. Returns (heads [1, M, C], kv)."""
    b, W = inputs.prompts_unroll.shape
    _, M, K, J, H = qkv_1MKJH.shape
    n = M - b * W
    decode_kv, prompts_kv = kv
    heads_n1C, decode_kv = _attention_block(cfg, layer, qkv_1MKJH[0, :n, None], inputs.positions_BT,
                                            decode_kv, inputs.end_B, inputs.mask_BTS, inputs.inv_freq,
                                            plan.rope_scale, plan.window, None, fused)
    positions_bW = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (b, W))
    heads_bWC, prompts_kv = _attention_block(cfg, layer, qkv_1MKJH[0, n:].reshape(b, W, K, J, H), positions_bW,
                                             prompts_kv, None, None, inputs.inv_freq, plan.rope_scale,
                                             plan.window, inputs.prompts_unroll)
    heads_MC = jnp.concatenate([heads_n1C.reshape(n, -1), heads_bWC.reshape(b * W, -1)])
    return heads_MC[None], (decode_kv, prompts_kv)


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
        if x.shape[0] < into.shape[0]:  # the cache's first B rows (see `step`): a scatter in place
            B, T = x.shape[0], x.shape[2]
            slots_BT = end_B[:, None] + jnp.arange(T, dtype=jnp.int32)
            # the two index arrays put [B, T] first: updates [B, T, K(, H)]
            return into.at[jnp.arange(B)[:, None], :, slots_BT].set(jnp.moveaxis(x, 2, 1))
        # Per row (vmapped: one scatter of B updates [K, T, ...] at (0, end_b, ...)).
        at = lambda end: (zero, end) + (zero,) * (into.ndim - 3)  # a row's [K, S, ...]
        return jax.vmap(lambda a, b, end: jax.lax.dynamic_update_slice(a, b, at(end)))(into, x, end_B)
    if scale_BKS is None:
        return put(cache_BKSH, new_BKTH.astype(cache_BKSH.dtype)), None
    q_BKTH, s_BKT = L.quantize_kv(new_BKTH)
    return put(cache_BKSH, q_BKTH), put(scale_BKS, s_BKT)


def _ffn_block(cfg: ModelConfig, moe: bool, layer: Layer, h_BTD, axis=None, route=None, tuning=None):
    """Dense or MoE SwiGLU; with `axis`, F (or the experts) may be the device's part: psum then.
    `route`: the routing kernel's mode (the plan's; never inside shard_map, not yet run on GPUs)."""
    split = (lambda local, total: axis is not None and L.is_split(local, total))
    if moe:
        experts_split = split(layer.experts_gate_up.shape[0], cfg.num_experts)
        routes = kernels.route(h_BTD.reshape(-1, h_BTD.shape[-1]), layer.router,
                               cfg.experts_per_token, cfg.norm_topk_prob, mode=route, tuning=tuning)
        out_BTD = M.moe(h_BTD, layer.router, layer.experts_gate_up, layer.experts_down,
                        cfg.experts_per_token, cfg.norm_topk_prob, routes=routes,
                        expert_axis=axis if experts_split else None)  # moe psums expert splits itself
        partial_sum = split(layer.experts_down.shape[2], cfg.moe_ffn_size)
    else:
        out_BTD = L.mlp(h_BTD, layer.w_gate_up, layer.w_down, cfg.activation)
        partial_sum = split(layer.w_down.shape[1], cfg.ffn_size)
    return jax.lax.psum(out_BTD, axis) if partial_sum else out_BTD


# A decode step's attention kernel takes the new tokens' cos and sin from a table of every
# position, made once before a loop rather than in each step
# (docs/decisions/decode-attention.md#the-rotation-table-once-a-loop). A step given none
# (`decode_step` without one, a sharded step) makes it itself.
def rotation_table(config: ModelConfig, length: int):
    """cos and sin of every position below `length` (float32 [length, 2, R], the attention factor
    included), as `kernels.decode_attention` takes them: one table for a model of one rope, a
    tuple of one a rope (`config.ropes`' order) for Gemma 3's global and local ones; a loop
    passes it to each `step` as it is."""
    positions_S = jnp.arange(length, dtype=jnp.int32).astype(jnp.float32)

    def table(rope):
        inv_freq, rope_scale = rope_frequencies(config, rope=rope)
        angles_SR = positions_S[:, None] * jnp.asarray(inv_freq)
        return jnp.stack([jnp.cos(angles_SR), jnp.sin(angles_SR)], axis=1) * rope_scale
    tables = tuple(table(rope) for rope in config.ropes)
    return tables[0] if len(tables) == 1 else tables


def _rope_tables(config: ModelConfig, rotation) -> dict:
    """`rotation_table`'s tables by the rope they rotate with."""
    return dict(zip(config.ropes, rotation if isinstance(rotation, tuple) else (rotation,)))


class StepInputs(NamedTuple):
    """The arrays a block takes besides its layer and the residual stream, as `_hidden` makes them:
    each row's write slot `end_B`, the new tokens' positions, the layer's mask (None where the
    attention needs none), the layer's rotary frequencies, a fresh prefill's unrolling indices, the
    attention kernel's (start_B, rotation table), the norm and matrix that come after the block
    (the next qkv's or the lm_head's), and (down_bounds, this layer's index) where gate/up hands
    down its output as digits. In a `mixed_step` the first five are its decode rows', and
    `prompts_unroll` its prompts' unrolling indices [b, W] (None in any other step)."""
    end_B: jax.Array
    positions_BT: jax.Array
    mask_BTS: jax.Array | None
    inv_freq: jax.Array
    unroll_BT: jax.Array | None
    fused_args: tuple | None
    next_norm: jax.Array | None
    next_w: object
    down_bounds: tuple | None
    prompts_unroll: jax.Array | None = None


def _hidden(params: Params, tokens_BT, cache: KVCache, plan: StepPlan | None = None,
            fresh: bool = False, rotation=None):
    """Run all blocks over T new tokens written at each row's cache.end; returns (x_BTD,
    normed_BTD, new cache): normed_BTD is x_BTD through the final norm where a kernel made it (as a
    `kernels.DigitRow` for an int8 lm_head that takes them), else None.

    `plan`: the step's `StepPlan` (its kernels, fusions and tensor-parallel axis); by default
    the one `step_plan` makes for these shapes, unsharded.
    `fresh`: the caller guarantees the cache is empty (every end 0), so the tokens attend only among
    themselves: each row is rotated left by its padding, so its prompt starts at index 0 and
    plain causal attention (a fused kernel on GPUs) needs no padding mask; the keys and values go
    into the cache, and the hidden states come out, rotated back to the left-padded layout.
    `rotation`: `rotation_table(cfg, cache.length)`, made by a caller that runs many steps (else
    a decode step through the attention kernel makes it).
    """
    B, T = tokens_BT.shape
    plan = plan or _plan(params, tokens_BT, cache, fresh=fresh)
    # Fewer token rows than the cache has: they are its first B rows (see `step`).
    start_B, end_B = (x if x.shape[0] == B else x[:B] for x in (cache.start, cache.end))
    if fresh:
        tokens_BT, unroll_BT = _rolled(tokens_BT, start_B)
        rows = _Rows(end_B, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
                     dict.fromkeys(_windows(params.config)), None)
    else:
        unroll_BT = None
        rows = _warm_rows(params.config, plan, start_B, end_B, T, cache.length, rotation)
    x_BTD = _embed(params, tokens_BT, plan.axis)
    x_BTD, normed_BTD, new_kv = _layers(params, plan, x_BTD, _layer_kv(cache), rows, unroll_BT,
                                        final_norm=T == 1)
    if fresh:
        x_BTD, normed_BTD = (None if a is None else jnp.take_along_axis(a, unroll_BT[:, :, None], axis=1)
                             for a in (x_BTD, normed_BTD))
    return x_BTD, normed_BTD, _with_layers(cache, new_kv, T, B)


class _Rows(NamedTuple):
    """What a step's attention takes for its rows, besides the layer (see `StepInputs`): their
    write slots, positions, masks by window and the attention kernel's arguments by rope."""
    end_B: jax.Array
    positions_BT: jax.Array
    masks: dict
    fused_args: dict | None


def _windows(cfg: ModelConfig) -> set:
    return {cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)}


def _rolled(tokens_BT, start_B):
    """A fresh prefill's tokens, each row rotated left by its padding (see `_hidden`), and the
    indices that rotate them back."""
    T = tokens_BT.shape[1]
    t_T = jnp.arange(T, dtype=jnp.int32)
    roll_BT = (t_T[None, :] + start_B[:, None]) % T
    return jnp.take_along_axis(tokens_BT, roll_BT, axis=1), (t_T[None, :] - start_B[:, None]) % T


def _warm_rows(cfg: ModelConfig, plan: StepPlan, start_B, end_B, T: int, length: int, rotation) -> _Rows:
    """`_Rows` of B rows writing T tokens each at their ends in a cache of `length` slots."""
    q_slots_BT = end_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # each row writes at its own end
    # Left padding sits before start; its (unused) positions are clamped to 0.
    positions_BT = jnp.maximum(q_slots_BT - start_B[:, None], 0)
    fused_args = None
    if plan.attention:  # every position's rotation, unless the caller made the table before its loop
        if rotation is None:
            rotation = rotation_table(cfg, length)
        fused_args = {rope: (start_B, table) for rope, table in _rope_tables(cfg, rotation).items()}
    windows = _windows(cfg)
    masks = dict.fromkeys(windows) if plan.attention else \
        {w: L.visible_mask(q_slots_BT, start_B, length, w) for w in windows}
    return _Rows(end_B, positions_BT, masks, fused_args)


def _embed(params: Params, tokens_BT, axis):
    cfg = params.config
    x_BTD = L.embed_lookup(params.embed, tokens_BT, axis, cfg.vocab_size)
    if cfg.embed_scale:  # Gemma: the factor is rounded to the dtype first, as transformers does
        x_BTD = x_BTD * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(x_BTD.dtype)
    return x_BTD


def _layer_kv(cache: KVCache) -> list[tuple]:
    """Each layer's (k, v, k_scale, v_scale) arrays (the scales None unless int8)."""
    return [(cache.k[i], cache.v[i], cache.k_scale and cache.k_scale[i], cache.v_scale and cache.v_scale[i])
            for i in range(len(cache.k))]


def _with_layers(cache: KVCache, new_kv: list[tuple], T: int, B: int) -> KVCache:
    """`cache` holding each layer's new (k, v, k_scale, v_scale) and its first B rows' ends T on."""
    k, v, k_scale, v_scale = ([kv[j] for kv in new_kv] for j in range(4))
    return cache.replace(k=k, v=v, end=cache.end + T if B == cache.batch else cache.end.at[:B].add(T),
                         k_scale=None if cache.k_scale is None else k_scale,
                         v_scale=None if cache.v_scale is None else v_scale)


def _layers(params: Params, plan: StepPlan, x_BTD, kvs: list, rows: _Rows, unroll_BT, final_norm: bool,
            prompts_unroll=None):
    """Every block over the residual stream x_BTD; returns (x_BTD, normed_BTD, each layer's kv).
    `final_norm`: the last block may hand the lm_head x through the final norm (a decode step's)."""
    cfg = params.config
    # No dynamic-NTK stretch: forward and generate keep positions within max_position_embeddings,
    # where transformers leaves the base alone; the cache length (left padding, bucket slack)
    # says nothing about how far positions go. Per rope: Gemma 3's local layers have their own.
    inv_freqs = {rope: jnp.asarray(rope_frequencies(cfg, rope=rope)[0]) for rope in cfg.ropes}
    normed_BTD = None
    head_VD = params.embed if params.lm_head is None else params.lm_head
    # What the residual stream feeds after each layer: the next layer's qkv, or after the last
    # layer the lm_head (in a decode step; a prefill's final norm takes its last position only).
    nexts = [(nxt.attn_norm, nxt.wqkv) for nxt in params.layers[1:]]
    nexts.append((params.final_norm if final_norm else None, head_VD))
    down_bounds = kernels.down_bounds([params.layers[i].w_gate_up for i in plan.down_layers]) \
        if plan.down_layers else None
    new_kv = []
    for i, (layer, lp, kv) in enumerate(zip(params.layers, plan.layers, kvs)):
        next_norm, next_w = nexts[i]
        inputs = StepInputs(
            rows.end_B, rows.positions_BT, rows.masks[lp.window], inv_freqs[cfg.rope_of(i)], unroll_BT,
            None if rows.fused_args is None else rows.fused_args[cfg.rope_of(i)],
            next_norm,
            # What down's kernel asks L2 for, None where nothing is: a step without prefetches then
            # traces its layers as one kind (the last one's next matrix, the lm_head, differs).
            next_w if lp.prefetch[3] else None,
            (down_bounds, jnp.int32(plan.down_layers.index(i))) if lp.down_digits else None,
            prompts_unroll)
        with jax.named_scope(f"layer_{i}"):
            x_BTD, normed_BTD, kv = _block(layer, x_BTD, normed_BTD, kv, inputs, plan=lp)
        new_kv.append(kv)
    return x_BTD, normed_BTD, new_kv


@partial(jax.jit, inline=True, static_argnames=("plan",))
def _block(layer: Layer, x_BTD, normed_BTD, kv, inputs: StepInputs, *, plan: LayerPlan):
    """One decoder block, whatever the plan: returns (x_BTD, normed_BTD, kv), normed_BTD being
    x_BTD through `inputs.next_norm` where `kernels.add_norm` made it (a `kernels.DigitRow` with
    `plan.next_digits`), else None.

    Jitted and inlined: layers of one shape and plan trace once, and their equations are copied
    into the step (a step traced each of its 32 layers, about a second of a warm-cache first call
    for the 8B shape). The projections take `plan.projection`'s kernels: one row folds norms and
    epilogues into `kernels.project`, 8-32 rows take `kernels.rows_project` (their norms XLA's,
    o's output paired with the residual by `add_norm`), none XLA's forms. Gemma's plan folds no
    norm into a matrix and no residual into o or down: its post-norms go with the residual adds
    (`_add_norm`).
    """
    cfg, eps, how = plan.cfg, plan.cfg.rms_norm_eps, plan.projection
    offset = cfg.norm_offset
    wo_ahead, gate_up_ahead, down_ahead, _ = plan.prefetch
    first = plan.weights_first
    fused = None if inputs.fused_args is None else \
        (*inputs.fused_args, plan.attention == "interpret", plan.split_out, how.tuning)
    with jax.named_scope("attention"):
        bias = None if layer.bqkv is None else layer.bqkv.reshape(-1)
        qkv_BTKJH = _normed_project(how, x_BTD, normed_BTD, layer.wqkv, layer.attn_norm, eps,
                                    offset, bias_N=bias, prefetch=(layer.wo,) if wo_ahead else (),
                                    weights_first=first)
        if inputs.prompts_unroll is None:
            heads_BTC, kv = _attention_block(cfg, layer, qkv_BTKJH, inputs.positions_BT, kv,
                                             inputs.end_B, inputs.mask_BTS, inputs.inv_freq,
                                             plan.rope_scale, plan.window, inputs.unroll_BT, fused)
        else:
            heads_BTC, kv = _mixed_attention(cfg, layer, qkv_BTKJH, kv, inputs, plan, fused)
        if how.family:  # with the FFN's norm in gate/up's kernel, o's kernel adds the residual
            wo_DC = layer.wo.reshape(layer.wo.shape[0], -1)
            out_BTD = _project(how, heads_BTC, wo_DC, bias_N=layer.bo,
                               residual=x_BTD if plan.ffn_norm_folded else None,
                               prefetch=(layer.w_gate_up,) if gate_up_ahead else (),
                               weights_first=first)
        else:
            out_BTD = _attention_out(cfg, layer, heads_BTC, plan.axis)
        # Gemma's norm of the attention's output goes with the residual add (its plan folds no
        # residual into o)
        x_BTD, normed_BTD = (out_BTD, None) if plan.ffn_norm_folded else \
            _add_norm(plan.add_norm, x_BTD, out_BTD, layer.mlp_norm, eps, offset,
                      layer.post_attn_norm, digits=plan.ffn_digits, tuning=how.tuning)
    with jax.named_scope("moe" if plan.moe else "mlp"):
        if plan.ffn_kernel:
            act_BTF = _normed_project(how, x_BTD, normed_BTD, layer.w_gate_up, layer.mlp_norm,
                                      eps, offset, swiglu=True, activation=cfg.activation,
                                      prefetch=(layer.w_down,) if down_ahead else (),
                                      weights_first=first, down_digits_of=inputs.down_bounds,
                                      wide=plan.gate_up_wide)
            out_BTD = _project(how, act_BTF, layer.w_down,
                               residual=x_BTD if plan.next_folds else None,
                               prefetch=() if inputs.next_w is None else (inputs.next_w,),
                               weights_first=first)
        else:
            if normed_BTD is None:
                normed_BTD = L.rms_norm(x_BTD, layer.mlp_norm, eps, offset)
            out_BTD = _ffn_block(cfg, plan.moe, layer, normed_BTD, plan.axis, plan.route, how.tuning)
        # next_folds: what comes next (qkv, lm_head) folds next_norm into its own kernel
        return (out_BTD, None, kv) if plan.next_folds else \
            (*_add_norm(plan.add_norm, x_BTD, out_BTD, inputs.next_norm, eps, offset,
                        layer.post_mlp_norm, digits=plan.next_digits, tuning=how.tuning), kv)


def _add_norm(mode: str | None, x_BTD, delta_BTD, norm_D, eps: float, offset: float = 0.0,
              delta_norm_D=None, digits: bool = False, tuning=None):
    """(x + delta, its rms_norm by norm_D) through `kernels.add_norm` under `mode`; (x + delta,
    None) when there is no mode or no norm to apply, the consumer norming it itself. With
    `digits` the normed row may come as a `kernels.DigitRow` (its x [B, T, D]). Gemma's: norms of
    scale (offset + w), and delta through its norm `delta_norm_D` before the add."""
    if mode is None or norm_D is None:
        if delta_norm_D is not None:
            delta_BTD = L.rms_norm(delta_BTD, delta_norm_D, eps, offset)
        return x_BTD + delta_BTD, None
    B, T, D = x_BTD.shape
    sum_MD, normed = kernels.add_norm(x_BTD.reshape(B * T, D), delta_BTD.reshape(B * T, D),
                                      norm_D, eps, offset=offset, delta_norm_C=delta_norm_D,
                                      mode=mode, digits=digits, tuning=tuning)
    if isinstance(normed, kernels.DigitRow):
        return sum_MD.reshape(B, T, D), normed.replace(x=normed.x.reshape(B, T, D))
    return sum_MD.reshape(B, T, D), normed.reshape(B, T, D)


def _normed_project(how: Projection, x_BTD, normed_BTD, w, norm_D, eps: float, offset: float = 0.0,
                    **kw):
    """`_project` of x through norm_D against w: of normed_BTD where `kernels.add_norm` made it,
    else with the norm folded into the projection. A (offset + w) norm (Gemma) no kernel folds:
    XLA's norm, then the projection."""
    if normed_BTD is None and offset:
        normed_BTD = L.rms_norm(x_BTD, norm_D, eps, offset)
    if normed_BTD is None:
        return _project(how, x_BTD, w, norm_C=norm_D, eps=eps, **kw)
    return _project(how, normed_BTD, w, **kw)


def _project(how: Projection, x_BTC, w, *, residual=None, **kw):
    """The projection of [B, T, C] activations (or a decode step's `kernels.SplitHeads`, or a
    `kernels.DigitRow`) against w [O..., C], or with `swiglu` against gate/up [2, F, C]; returns
    [B, T, O...] ([B, T, F]), through `how`'s kernel family, XLA's form where it has none."""
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
    if how.family == "rows":  # no prefetch, weights order, digits or wide programs there
        y_MN = kernels.rows_project(x_MC, w, residual_MN=residual_MN, mode=how.mode, tuning=how.tuning,
                                    **{k: v for k, v in kw.items()
                                       if k in ("norm_C", "eps", "bias_N", "swiglu", "activation")})
    else:
        y_MN = kernels.project(x_MC, w, residual_MN=residual_MN, mode=how.mode, tuning=how.tuning, **kw)
    if isinstance(y_MN, kernels.DigitRow):  # gate/up's output for down, with its digits
        return y_MN.replace(x=y_MN.x.reshape(B, T, *outs))
    return y_MN.reshape(B, T, *outs)


def logits(params: Params, x_BTD, head: Projection | None = None, normed_BTD=None):
    """Final norm and output projection; float32 logits [B, T, V], soft-capped where the model
    caps them (Gemma 2). `head`: the step plan's projection for the lm_head (None: XLA's);
    `normed_BTD`: x_BTD already through the final norm (see `_hidden`)."""
    head, cfg = head or Projection(), params.config
    with jax.named_scope("lm_head"):
        head_VD = params.embed if params.lm_head is None else params.lm_head
        logits_BTV = _normed_project(head, x_BTD, normed_BTD, head_VD, params.final_norm,
                                     cfg.rms_norm_eps, cfg.norm_offset, out_dtype=jnp.float32)
        if cfg.final_logit_softcap is not None:
            c = cfg.final_logit_softcap
            logits_BTV = jnp.tanh(logits_BTV / c) * c
        return logits_BTV


def _plan(params: Params, tokens_BT, cache: KVCache, axis=None, fresh: bool = False) -> StepPlan:
    B, T = tokens_BT.shape
    return step_plan(params, B, T, axis=axis, fresh=fresh, cache_length=cache.length,
                     kv_int8=cache.k_scale is not None)


def _forward_local(params: Params, tokens_BT, cache: KVCache, axis=None):
    plan = _plan(params, tokens_BT, cache, axis, fresh=True)
    x_BTD, normed_BTD, cache = _hidden(params, tokens_BT, cache, plan, fresh=True)
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
    plan = _plan(params, tokens_BT, cache, axis, fresh)
    x_BTD, normed_BTD, cache = _hidden(params, tokens_BT, cache, plan, fresh, rotation)
    if all_logits:
        return logits(params, x_BTD, plan.head, normed_BTD), cache
    if normed_BTD is not None and not isinstance(normed_BTD, kernels.DigitRow):  # one row if digits
        normed_BTD = normed_BTD[:, -1:]
    return logits(params, x_BTD[:, -1:], plan.head, normed_BTD)[:, 0], cache


def step(params: Params, tokens_BT, cache: KVCache, fresh: bool = False, rotation=None,
         all_logits: bool = False):
    """Pure step: write each row's T tokens at slots [end_b, end_b + T), at positions
    end_b - start_b + t, each attending over its own row's live slots; then end += T. Returns
    (last-position logits [B, V], cache), or with `all_logits` (static) the logits [B, T, V] of
    every new position (a speculative verify step).

    `tokens_BT` may have fewer rows than the cache: they are then its first B rows, and the
    other rows are neither read nor written (a serving engine's decode step over the rows in use;
    unsharded params, not `fresh`).

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


def mixed_plan(params: Params, decode_rows: int, prompts: int, width: int, cache: KVCache) -> StepPlan:
    """A `mixed_step`'s plan: the prompts' prefill plan (every matrix XLA's: n + b*W rows), its
    attention the decode step's (the kernel where a decode step of `decode_rows` rows takes it)."""
    kv_int8 = cache.k_scale is not None
    decode = step_plan(params, decode_rows, 1, cache_length=cache.length, kv_int8=kv_int8)
    prompts_plan = step_plan(params, prompts, width, fresh=True, cache_length=width, kv_int8=kv_int8)
    return dataclasses.replace(
        prompts_plan, attention=decode.attention,
        layers=tuple(dataclasses.replace(lp, attention=d.attention) for lp, d in zip(prompts_plan.layers, decode.layers)))


def mixed_step(params: Params, tokens_n, cache: KVCache, prompts_bW, start_b, rotation=None):
    """A decode step and a prefill in one pass (vLLM's mixed batches): one token for each of the
    cache's first n rows, as `step(params, tokens_n[:, None], cache)`, and b left-padded prompts
    (their padding before start_b), as `step(params, prompts_bW, <empty b-row cache of W slots>,
    fresh=True)`. Every matrix multiplies the n + b*W rows at once, reading its weights once for
    both; only the attention is apart (`_mixed_attention`).

    Returns (logits [n, V], the prompts' last-position logits [b, V], cache, the prompts' b-row
    cache of W slots), for the caller to insert those rows where it wants them. Unsharded params;
    unchecked as `step`."""
    cfg = params.config
    n, (b, W) = tokens_n.shape[0], prompts_bW.shape
    plan = mixed_plan(params, n, b, W, cache)
    start_n, end_n = (x if x.shape[0] == n else x[:n] for x in (cache.start, cache.end))
    rows = _warm_rows(cfg, plan, start_n, end_n, 1, cache.length, rotation)
    prompts_bW, unroll_bW = _rolled(prompts_bW, start_b)
    kv_dtype = "int8" if cache.k_scale is not None else None
    prompts = init_cache(cfg, b, W, params.dtype, start_b, kv_dtype=kv_dtype)
    with jax.named_scope("mixed"):
        x_1MD = _embed(params, jnp.concatenate([tokens_n, prompts_bW.reshape(b * W)])[None], None)
        x_1MD, _, new_kv = _layers(params, plan, x_1MD, list(zip(_layer_kv(cache), _layer_kv(prompts))), rows,
                                   None, final_norm=False, prompts_unroll=unroll_bW)
        # each prompt's last token: rotated left by its padding, it sits at W - 1 - start
        last_b = n + jnp.arange(b, dtype=jnp.int32) * W + W - 1 - start_b
        logits_1RV = logits(params, jnp.concatenate([x_1MD[:, :n], x_1MD[:, last_b]], axis=1), plan.head)
    cache = _with_layers(cache, [kv[0] for kv in new_kv], 1, n)
    prompts = _with_layers(prompts, [kv[1] for kv in new_kv], W, b)
    return logits_1RV[0, :n], logits_1RV[0, n:], cache, prompts


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
