"""Autoregressive sampling with a static KV cache, compiled once per shape.

The prompt is prefilled in one forward pass; `lax.while_loop`s then decode one token per
step into a cache that grows to `P + T` slots (`decode_windows`), and stop as soon as every
sequence has emitted EOS. With `num_samples = G` (GRPO) each prompt is prefilled once and
its cache is repeated for its G samples, which stay adjacent in the output (sample `g` of
prompt `b` is row `b·G + g`).

Log-probabilities returned with the tokens are those of `softmax(logits / τ)` over the
*whole* vocabulary, before any top-k / top-p truncation: exactly what
`ops.token_logprobs(logits, tokens, temperature=τ)` computes in the trainer, so that the
first PPO ratio is 1 up to float rounding. (Truncation changes which tokens can be drawn,
not the density the trainer's ratios and KL are measured against.) With `temperature=0`
decoding is greedy and the log-probs are those of `softmax(logits)`. When sampling draws
from another distribution than `softmax(logits / τ)` — top-k or top-p truncation, or EOS
banned before `min_new_tokens` — `behaviour_logprobs` holds each token's log-prob under
the distribution it was actually drawn from (the truncated one, renormalised): the
behaviour policy μ of the off-policy correction (`algorithms.offpolicy`).

Row r samples step t with the noise of `fold_in(fold_in(rng, r), t)`, so a row's
tokens depend on its prompt, its index and the key, never on the other rows: a batch split
by rows (over a mesh, or into `generate`'s CPU row blocks) samples what it samples whole.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.models import decode_compiler_options, vocab_major_decode_head
from jaxrlhf.models.transformer import (Transformer, grow_cache, init_cache, lm_head_rows, project_logits,
                                        vocab_major_logits)


class SampleOutput(NamedTuple):
    """A batch of `N = B·num_samples` sampled responses (all arrays have leading axis N).

    prompt_ids, prompt_mask: `[N, P]`, left-padded (each prompt repeated per sample).
    response_ids: `[N, T]`, right-padded with `pad_id` after EOS.
    response_mask: `[N, T]` bool, True up to and including EOS.
    logprobs: `[N, T]` float32 log-prob of each response token under softmax(logits/τ)
      (0 on padding).
    sequences, attention_mask: `[N, P + T]`, prompt ⧺ response, what the scoring forward
      passes take.
    lengths: `[N]` int32 number of valid response tokens.
    behaviour_logprobs: `[N, T]` float32 log-prob of each response token under the
      distribution it was drawn from (after top-k / top-p truncation and an EOS ban,
      renormalised; 0 on padding), or None when that is softmax(logits/τ) itself (no
      truncation, no ban) or decoding is greedy: `logprobs` are then the behaviour's.
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    sequences: jax.Array
    attention_mask: jax.Array
    lengths: jax.Array
    behaviour_logprobs: jax.Array | None = None

    @property
    def behaviour(self) -> jax.Array:
        """The behaviour policy's log-probs: `behaviour_logprobs`, else `logprobs`."""
        return self.logprobs if self.behaviour_logprobs is None else self.behaviour_logprobs

    def arrays(self) -> dict:
        """The fields that hold arrays (`behaviour_logprobs` left out when None), by name."""
        return {k: v for k, v in self._asdict().items() if v is not None}


def stop_ids(eos_id) -> tuple[int, ...]:
    """The token ids that end a response, from a sampler's `eos_id`: None -> (), one id ->
    (id,), several (a chat model's `<|im_end|>` and `<|endoftext|>`: the `eos_token_id`
    list of its `generation_config.json`) -> them, in order."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, (int, np.integer)):
        return (int(eos_id),)
    return tuple(int(i) for i in eos_id)


def is_stop(tokens: jax.Array, eos_id) -> jax.Array:
    """Whether each of `tokens` is one of `stop_ids(eos_id)` (bool, the shape of `tokens`)."""
    out = jnp.zeros(jnp.shape(tokens), bool)
    for i in stop_ids(eos_id):
        out = out | (tokens == i)
    return out


def finished(response_ids_NxT: jax.Array, response_mask_NxT: jax.Array, eos_id) -> jax.Array:
    """`[N]` bool: the response ended on its own — it holds one of `stop_ids(eos_id)` among
    its valid tokens, or it is shorter than T (cut at a stop string, `rollout.stop_strings`)
    — rather than running out of `max_new_tokens`."""
    mask = response_mask_NxT.astype(bool)
    return jnp.any(is_stop(response_ids_NxT, eos_id) & mask, axis=1) | (mask.sum(axis=1) < mask.shape[1])


def until_stop(token_ids: list, eos_id) -> tuple[list, bool]:
    """(the ids before the first of `stop_ids(eos_id)`, whether there was one): a response's
    content, on the host, for rewards and answers."""
    ids = stop_ids(eos_id)
    for j, t in enumerate(token_ids):
        if t in ids:
            return token_ids[:j], True
    return token_ids, False


def _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len,
           min_new_tokens=0, eos_id=None):
    if max_new_tokens is None or int(max_new_tokens) <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not 0 <= int(min_new_tokens) <= int(max_new_tokens):
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens}")
    if prompt_ids.ndim != 2:
        raise ValueError(f"prompt_ids must have shape [B, P], got {prompt_ids.shape}")
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_mask must have the shape of prompt_ids [B, P] = "
                         f"{tuple(prompt_ids.shape)}, got {tuple(prompt_mask.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0 or top_k > model.config.vocab_size:
        raise ValueError(f"top_k must be in [0, vocab_size={model.config.vocab_size}], got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if eos_id is not None and not stop_ids(eos_id):
        raise ValueError("eos_id is an empty list: give the token ids that end a response, or None (never stop)")
    for i in stop_ids(eos_id):
        if not 0 <= i < model.config.vocab_size:
            raise ValueError(f"eos_id {i} is outside the vocabulary [0, {model.config.vocab_size})")
    total = prompt_ids.shape[1] + int(max_new_tokens)
    limit = model.config.max_position_embeddings if max_len is None else max_len
    if total > limit:
        raise ValueError(
            f"prompt length {prompt_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds "
            f"the cache/position limit {limit} ({'max_len' if max_len is not None else 'config.max_position_embeddings'})")


def truncate_logits(logits_BxV: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Mask (to -inf) the tokens that top-k and then top-p (nucleus) exclude.

    top-k keeps the k highest logits (ties at the k-th value are all kept); top-p keeps the
    smallest prefix of tokens, by descending probability, whose mass reaches `top_p` (the
    token that crosses the threshold is kept). Either is off at its default.
    """
    neg = jnp.finfo(logits_BxV.dtype).min
    if top_k:
        kth = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth, neg, logits_BxV)
    if top_p < 1.0:
        sorted_desc = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # The smallest logit still inside the nucleus is the threshold.
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < threshold, neg, logits_BxV)
    return logits_BxV


def _argmax(x_BxV: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` (first index of the maximum) as two plain reductions.

    XLA:CPU runs argmax as one variadic (value, index) reduction that does not vectorise:
    88 µs of a profiled decode step at [16, 512]; a max and an index min take ~9 µs.
    """
    v = x_BxV.shape[-1]
    is_max = x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(is_max, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
    return jnp.minimum(first, v - 1)  # a row with a NaN matches nothing: keep the id valid


def tracks_behaviour(temperature: float, top_k: int, top_p: float, banned=None) -> bool:
    """Whether sampling draws from another distribution than softmax(logits/τ), so that
    the behaviour log-probs differ from the sampler's `logprobs` (`_pick`'s third output)."""
    return temperature > 0 and (bool(top_k) or top_p < 1.0 or banned is not None)


@jax.named_scope("pick")  # its ops' name in a profile (`benchmarks/profile_decode.py`)
def _pick(logits_BxV, noise_BxM, temperature, top_k, top_p, banned=None, ban=False):
    """(token [B], log-prob of it under softmax(logits/τ) [B], its behaviour log-prob [B]
    or None).

    Sampling draws from softmax(truncated logits / τ) by a two-level Gumbel-max with the
    row's `noise_BxM` (`_draw`, `_step_noise`); greedy (`temperature=0`) takes the first
    argmax. Where `ban` (a bool, may be traced) holds, the tokens `stop_ids(banned)` cannot
    be drawn; like top-k/top-p truncation this changes which tokens are drawn, not the
    log-probs. The behaviour log-prob is the token's under the distribution it was drawn
    from, `log_softmax(truncated logits / τ)` (`tracks_behaviour`; else None).
    """
    logits_BxV = logits_BxV.astype(jnp.float32)
    if temperature > 0:
        logits_BxV = logits_BxV / temperature
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
    if banned is not None:
        banned_V = ban & is_stop(jnp.arange(logits_BxV.shape[-1]), banned)
        logits_BxV = jnp.where(banned_V, jnp.finfo(jnp.float32).min, logits_BxV)
    behaviour = None
    if temperature == 0:
        token = _argmax(logits_BxV)
    else:
        drawn_BxV = truncate_logits(logits_BxV, top_k=top_k, top_p=top_p)
        token = _draw(drawn_BxV, noise_BxM)
        if tracks_behaviour(temperature, top_k, top_p, banned):
            behaviour = jnp.take_along_axis(jax.nn.log_softmax(drawn_BxV, axis=-1), token[:, None], axis=-1)[:, 0]
    return token.astype(jnp.int32), jnp.take_along_axis(logp_BxV, token[:, None], axis=-1)[:, 0], behaviour


_DRAW_BLOCK = 256


def _draw_blocks(vocab_size: int) -> tuple[int, int]:
    """`(blocks, block size)` of `_draw` over a vocabulary of `vocab_size`."""
    blk = min(_DRAW_BLOCK, vocab_size)
    return -(-vocab_size // blk), blk


def _draw(logits_BxV: jax.Array, noise_BxM: jax.Array) -> jax.Array:
    """`[B]` tokens drawn from softmax(logits) by Gumbel-max in two levels, with `M = N + K`
    standard Gumbel variates per row (`N` blocks of `K = 256` tokens, `_draw_blocks`):

        block j = argmax_j (log Σ_{k∈j} exp(x_k − max x) + g_j),   token = argmax_{k∈j} (x_k + g_{N+k−jK})

    so P(block j) = m_j / Σ m and P(token k | j) = p_k / m_j: P(token = k) = p_k / Σ p
    with p = exp(x − max x), and a token with p = 0 (its logit truncated or banned to
    finfo.min) is never drawn.

    Against one Gumbel variate per token (`argmax(x + g)` over all V), the hash of the
    noise falls from V to N + K variates per row (49,152 → 448 at SmolLM2's V; that hash
    was ~8 % of a real-shaped decode step). Against the inverse CDF of one uniform, which
    is as cheap, the draw keeps Gumbel-max's stability under float rounding: a token
    changes only where two perturbed scores tie to within rounding, where an inverse CDF
    moves at every one of the V boundaries of its running sum — at V = 49,152 with
    near-flat logits, two programs whose logits differ by dot rounding (static and
    continuous batching) drew different tokens at ~0.2 % of their steps.
    """
    b, v = logits_BxV.shape
    nb, blk = _draw_blocks(v)
    x_BxNxK = jnp.pad(logits_BxV.astype(jnp.float32), ((0, 0), (0, nb * blk - v)),
                      constant_values=-jnp.inf).reshape(b, nb, blk)
    mass_BxN = jnp.exp(x_BxNxK - jnp.max(x_BxNxK, axis=(1, 2), keepdims=True)).sum(axis=-1)
    j_B = _argmax(jnp.log(mass_BxN) + noise_BxM[:, :nb])
    block_BxK = jnp.take_along_axis(x_BxNxK, j_B[:, None, None], axis=1)[:, 0]
    k_B = _argmax(block_BxK + noise_BxM[:, nb:nb + blk])
    return jnp.minimum(j_B * blk + k_B, v - 1)


# Row r's noise at step t comes from `fold_in(fold_in(rng, r), t)`: it depends on no other
# row, so a batch split into row blocks (or decoded by `sample_continuous`, whose rows run
# at their own steps) samples the same tokens.
def _row_keys(rng: jax.Array, n: int, first_row=0) -> jax.Array:
    """`[N]` keys of rows `first_row .. first_row + N - 1`: `fold_in(rng, row)`."""
    return jax.vmap(jax.random.fold_in, (None, 0))(rng, first_row + jnp.arange(n))


def _step_noise(keys_N: jax.Array, t_N, vocab_size: int) -> jax.Array:
    """`[N, M]` float32 standard Gumbel variates of decode step `t_N` (one step, or each
    row's own) for the rows whose keys are `keys_N`: `_draw`'s noise over `vocab_size`."""
    m = sum(_draw_blocks(vocab_size))
    one = lambda key, t: jax.random.gumbel(jax.random.fold_in(key, t), (m,), jnp.float32)
    return jax.vmap(one, (0, 0 if jnp.ndim(t_N) else None))(keys_N, t_N)


_WINDOW_STEPS = 64  # the shortest decode segment (`decode_windows`)
_MAX_WINDOWS = 4


def decode_windows(max_new_tokens: int) -> tuple[int, ...]:
    """The ends `e_1 < .. < e_k = T` of the decode loop's segments: steps `t < e_j` run with
    a cache of `P + e_j` slots, grown (`models.grow_cache`) between segments.

    A decode step's attention reads every slot of its cache, used or not, so one cache of
    `P + T` slots makes every step pay for the longest response. Up to four segments of at
    least 64 steps (one for T < 128) cut the response slots read by 3/8 at T = 256 (each
    segment's body is compiled once). The masked slots a smaller cache leaves out add
    exactly zero: the tokens and log-probs are those of one cache, up to the dots'
    summation order.
    """
    t = int(max_new_tokens)
    k = max(1, min(_MAX_WINDOWS, t // _WINDOW_STEPS))
    return tuple(-(-t * j // k) for j in range(1, k + 1))


def _decode_head(model: Transformer, params):
    """The LM head as `[V, D]` rows (`models.lm_head_rows`) where this backend decodes
    vocab-major (`models.vocab_major_decode_head`), else None: taken once before a loop."""
    return lm_head_rows(model.config, params) if vocab_major_decode_head() else None


def _step_logits(model: Transformer, head_VxD, out) -> jax.Array:
    """A decode step's `[N, V]` logits from `out = apply(..., compute_logits=head_VxD is None)`
    of one query per row: the model's own, or `models.vocab_major_logits` of `_decode_head`."""
    return out.logits[:, 0] if head_VxD is None else vocab_major_logits(model.config, head_VxD, out.hidden[:, 0])


def prefill(model: Transformer, params, prompt_ids: jax.Array, prompt_mask: jax.Array, max_new_tokens: int):
    """The prompts `[B, P]` (left-padded, mask bool) in one forward pass: `(cache, logits)`,
    a cache of `P + max_new_tokens` slots with the prompts' keys and values in the first P,
    and the next token's logits `[B, V]`. Left padding puts every prompt's last token in
    slot P-1: only it needs logits, and only it needs the last layer's attention and MLP."""
    b, p = prompt_ids.shape
    slot_mask = jnp.concatenate([prompt_mask, jnp.zeros((b, int(max_new_tokens)), bool)], axis=1)
    out = model.apply({"params": params}, prompt_ids, slot_mask, cache=init_cache(model.config, b, slot_mask.shape[1]),
                      cache_index=0, compute_logits=False, last_position_only=True)
    return out.cache, project_logits(model.config, params, out.hidden[:, -1])


def sample(
    model: Transformer,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | tuple[int, ...] | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    max_len: int | None = None,
    min_new_tokens: int = 0,
    first_row: int | jax.Array = 0,
) -> SampleOutput:
    """Sample responses; traceable (call it inside your own jit) — see `generate`.

    `first_row`: the index of this batch's first output row in a larger batch that was
    split by rows (may be traced). Row r draws its noise from `fold_in(rng, r)`, so blocks
    given their offsets sample exactly what the whole batch samples.
    """
    _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len,
           min_new_tokens, eos_id)
    b, p = prompt_ids.shape
    t_max = int(max_new_tokens)
    n = b * num_samples
    prompt_mask = prompt_mask.astype(bool)
    apply = functools.partial(model.apply, {"params": params})

    ends = decode_windows(t_max)
    cache, last_logits = prefill(model, params, prompt_ids, prompt_mask, ends[0])
    repeat = lambda x: jnp.repeat(x, num_samples, axis=0) if num_samples > 1 else x
    cache = jax.tree.map(repeat, cache)
    last_logits, prompt_ids, prompt_mask = repeat(last_logits), repeat(prompt_ids), repeat(prompt_mask)
    prompt_len = prompt_mask.sum(axis=1).astype(jnp.int32)

    head_VxD = _decode_head(model, params)
    keys_N = _row_keys(rng, n, first_row) if temperature > 0 else None

    def emit(state, logits, t):
        noise_N = None if keys_N is None else _step_noise(keys_N, t, model.config.vocab_size)
        tokens, logps, done = state["tokens"], state["logps"], state["done"]
        # Response token t is the (t+1)-th: EOS cannot be drawn before min_new_tokens of them.
        ban_eos = min_new_tokens > 0 and eos_id is not None
        token, logp, blogp = _pick(logits, noise_N, temperature, top_k, top_p, eos_id if ban_eos else None,
                                   ban_eos and (t < min_new_tokens))
        token = jnp.where(done, pad_id, token)
        logp = jnp.where(done, 0.0, logp)
        new_done = done | is_stop(token, eos_id)
        out = dict(state,
                   tokens=jax.lax.dynamic_update_slice(tokens, token[:, None], (0, t)),
                   logps=jax.lax.dynamic_update_slice(logps, logp[:, None], (0, t)),
                   valid=jax.lax.dynamic_update_slice(state["valid"], (~done)[:, None], (0, t)),
                   done=new_done)
        if blogp is not None:
            out["blogps"] = jax.lax.dynamic_update_slice(state["blogps"], jnp.where(done, 0.0, blogp)[:, None], (0, t))
        return out

    state = dict(
        tokens=jnp.full((n, t_max), pad_id, jnp.int32),
        logps=jnp.zeros((n, t_max), jnp.float32),
        valid=jnp.zeros((n, t_max), bool),
        done=jnp.zeros((n,), bool),
        cache=cache,
        t=jnp.int32(0),
    )
    if tracks_behaviour(temperature, top_k, top_p, eos_id if min_new_tokens > 0 and eos_id is not None else None):
        state["blogps"] = jnp.zeros((n, t_max), jnp.float32)
    state = emit(state, last_logits, 0)

    def segment(state, end):  # the steps t < end, over the first w = P + end cache slots
        w = p + end
        prompt_slots = jnp.concatenate([prompt_mask, jnp.zeros((n, end), bool)], axis=1)
        response_slots = jnp.arange(w)[None, :] >= p

        def cond(state):
            return (state["t"] + 1 < t_max) & (state["t"] < end) & ~jnp.all(state["done"])

        def body(state):
            t = state["t"]
            token = jax.lax.dynamic_slice_in_dim(state["tokens"], t, 1, axis=1)
            mask = prompt_slots | (response_slots & (jnp.arange(w)[None, :] <= p + t))
            out = apply(token, mask, position_ids=(prompt_len + t)[:, None], cache=state["cache"], cache_index=p + t,
                        compute_logits=head_VxD is None)
            state = dict(state, cache=out.cache, t=t + 1)
            return emit(state, _step_logits(model, head_VxD, out), t + 1)

        return jax.lax.while_loop(cond, body, state)

    for i, end in enumerate(ends):
        if i:
            state = dict(state, cache=grow_cache(state["cache"], p + end))
        state = segment(state, end)
    response_mask = state["valid"]
    sequences = jnp.concatenate([prompt_ids, state["tokens"]], axis=1)
    return SampleOutput(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=state["tokens"],
        response_mask=response_mask,
        logprobs=state["logps"],
        sequences=sequences,
        attention_mask=jnp.concatenate([prompt_mask, response_mask], axis=1),
        lengths=response_mask.sum(axis=1).astype(jnp.int32),
        behaviour_logprobs=state.get("blogps"),
    )


@functools.lru_cache(maxsize=64)
def _compiled(model, options: tuple = (), **static):
    """`sample` jitted with these static arguments and XLA `options` (`(name, value)` pairs)."""
    return jax.jit(functools.partial(sample, model, **static), compiler_options=dict(options) or None)


def weight_bytes_of(params) -> int:
    """Bytes of every array in `params` (what each decode step reads)."""
    return sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(params))


def platform_of(tree) -> str:
    """The platform of the first `jax.Array` in `tree` ("cpu", "gpu", "tpu"), else JAX's
    default backend (traced or host arrays)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.sharding.device_set)).platform
    return jax.default_backend()


@jax.jit
def _concat_rows(outs: list[SampleOutput]) -> SampleOutput:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outs)


@functools.lru_cache(maxsize=4)
def _thread_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxrlhf-generate")


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# The default splits only where each block decodes at least one row per this many bytes of
# weights: every block reads all the weights at each decode step, so small blocks of a large
# model are bound by memory bandwidth, not by the core they run on. Measured on 2 cores
# (benchmarks/bench_row_blocks.py, docs/benchmarks.md): 2 blocks beat one program by
# 1.12-1.66x at 12, 107 and 324 MiB of weights with 32 rows per block (and 12 MiB with 8),
# and lost (0.80-0.96x) or tied at 107-621 MiB with 8 rows, and 621 MiB with 32.
_WEIGHT_BYTES_PER_BLOCK_ROW = 12 * 2**20


def cpu_row_blocks(prompts: int, *trees, cpu_threads: int | None = None, rows_per_prompt: int = 1,
                   weight_bytes: int = 0) -> int:
    """How many concurrent row blocks `generate` splits its `prompts` into.

    More than one only when every array in `trees` is concrete and lives on one and the
    same CPU device (nothing sharded, nothing traced): the largest divisor of `prompts`
    that is at most `cpu_threads`. With `cpu_threads=None` (the default) at most the usable
    cores of this process, and only as many blocks as leave each one at least one row
    (`rows_per_prompt` per prompt) per 12 MiB of `weight_bytes`: below that, blocks of a
    large model are slower than one program.
    """
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu_threads must be None or >= 1, got {cpu_threads}")
    if cpu_threads is None:
        rows = prompts * rows_per_prompt
        threads = min(_usable_cores(), max(1, rows * _WEIGHT_BYTES_PER_BLOCK_ROW // max(int(weight_bytes), 1)))
    else:
        threads = int(cpu_threads)
    if threads == 1 or prompts < 2:
        return 1
    devices = set()
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.core.Tracer):
            return 1
        if isinstance(leaf, jax.Array):
            devices |= leaf.sharding.device_set
    if len(devices) > 1:
        return 1
    device = devices.pop() if devices else jax.devices()[0]
    if device.platform != "cpu":
        return 1
    return max(d for d in range(1, min(threads, prompts) + 1) if prompts % d == 0)


def generate(
    model: Transformer,
    params,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | tuple[int, ...] | None = None,
    pad_id: int = 0,
    num_samples: int = 1,
    max_len: int | None = None,
    min_new_tokens: int = 0,
    cpu_threads: int | None = None,
) -> SampleOutput:
    """Sample `num_samples` responses per left-padded prompt; jitted once per shape.

    Args:
      model, params: a `Transformer` with an LM head and its parameters.
      prompt_ids: `[B, P]` int token ids, left-padded.
      prompt_mask: `[B, P]` bool/int, 1 on real prompt tokens.
      rng: a PRNG key; the same key gives the same samples.
      max_new_tokens: T, the response length (static).
      temperature: τ > 0 samples from softmax(logits/τ); 0 is greedy.
      top_k: keep the k most likely tokens (0: off). top_p: nucleus mass (1.0: off).
      eos_id: a token that ends a sequence (kept in the response, mask 1), or several (any
        of them ends it: `stop_ids`); None: never stop.
      pad_id: written after EOS.
      num_samples: G responses per prompt, rows `b·G .. b·G + G − 1`.
      max_len: an explicit cap on P + T (defaults to config.max_position_embeddings).
      min_new_tokens: EOS cannot be drawn among the first this many response tokens (TRL's
        and transformers' `min_new_tokens`); the log-probs stay those of the model, as
        with top-k/top-p. 0: off.
      cpu_threads: on a CPU device, run the prompts as up to this many row blocks at once,
        one thread each (1: a single program). XLA:CPU runs a decode step's small ops on
        one core, so one program leaves the other cores idle; but each block reads all the
        weights at every step, so for a large model small blocks are slower than one
        program. None (the default): one block per usable core, only where each block
        keeps at least one row per 12 MiB of weights (`cpu_row_blocks`; measured in
        `benchmarks/bench_row_blocks.py`). The blocks draw the same tokens as one program
        (`sample`'s `first_row`) and the call returns once all are done. Sharded, traced or
        accelerator inputs always run as one program.

    On an AVX2 CPU without AVX-512, a program that decodes at most 32 rows through at least
    64 MiB of weights is compiled with XLA's own dots instead of YNNPACK's
    (`models.decode_compiler_options`: measured ~10 % faster there; slower for small models
    and on AVX-512); the tokens are the same.
    A decode of T ≥ 128 tokens runs in up to four segments whose attention reads only the
    cache slots they can reach (`decode_windows`), and on a CPU each step's LM head is one
    vocab-major dot (`models.vocab_major_logits`): together 74.4 → 85.7 new tokens/s at
    the SmolLM2-135M shape, B = 8 × 256 (docs/benchmarks.md), the same tokens.

    Returns: `SampleOutput` with leading axis `B·num_samples`.
    """
    _check(model, prompt_ids, prompt_mask, max_new_tokens, temperature, top_k, top_p, num_samples, max_len,
           min_new_tokens, eos_id)
    b = prompt_ids.shape[0]
    weight_bytes = weight_bytes_of(params)
    blocks = cpu_row_blocks(b, params, prompt_ids, prompt_mask, rng, cpu_threads=cpu_threads,
                            rows_per_prompt=int(num_samples), weight_bytes=weight_bytes)
    options = decode_compiler_options(b // blocks * int(num_samples), weight_bytes, platform_of(params))
    fn = _compiled(model, options, max_new_tokens=int(max_new_tokens), temperature=float(temperature),
                   top_k=int(top_k), top_p=float(top_p), eos_id=stop_ids(eos_id) or None, pad_id=int(pad_id),
                   num_samples=int(num_samples), max_len=max_len, min_new_tokens=int(min_new_tokens))
    if blocks == 1:
        return fn(params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask), rng)
    rows = b // blocks

    def run_block(i):
        block = slice(i * rows, (i + 1) * rows)
        out = fn(params, jnp.asarray(prompt_ids[block]), jnp.asarray(prompt_mask[block]), rng,
                 first_row=jnp.int32(i * rows * num_samples))
        # Block here: JAX dispatch is asynchronous, and only waiting threads run concurrently.
        return jax.block_until_ready(out)

    return _concat_rows(list(_thread_pool(blocks).map(run_block, range(blocks))))
